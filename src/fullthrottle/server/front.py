"""An HTTP worker process of a multi-process server (``fullthrottle serve --http-workers N``).

It accepts connections on the listening socket it shares with its sibling workers, parses,
authenticates and checks every request (body limits and deadlines, multipart, pixel limits, URL
fetching with ``--allow-fetch``) and answers it; the engine process (one per server: the model,
the graphs, the decoders) only sees what passed. ``POST /v1/classify`` sends the request's images
to the engine in one ``CLASSIFY`` frame (:mod:`~fullthrottle.server.link`) and builds the answer
from the results that come back; ``/healthz`` and ``/metrics`` are answered here; every other
route is passed to the engine whole and its answer streamed back (embeddings, completions with
server-sent events, the user's workloads, ``/readyz``).

Started by :mod:`~fullthrottle.server.supervisor` as ``python -c`` :func:`main` with the listening
socket and its link as inherited file descriptors, its settings as JSON on stdin. When its link
closes (the engine process is gone) it drains like at SIGTERM and exits."""

from __future__ import annotations

import asyncio
import itertools
import json
import os
import signal
import sys

from ..core.errors import Overloaded
from ..workloads.classify.result import Result
from . import link as wire
from .classify_route import EntryError
from .guard import HTTPError, error_body, openai_path, read_asgi_body, set_busy
from .keys import NO_KEY, authorised

#: the routes an HTTP worker answers itself; every other goes to the engine
LOCAL_ROUTES = frozenset({"/healthz", "/v1/classify", "/metrics"})
#: seconds the engine has to answer ``/readyz`` (else 503) and the worker's ``/metrics`` (else its gauges stay)
ENGINE_PROBE_S = 2.0
#: while the engine's queue reads full, a worker refuses classify requests itself (503) but for one
#: per this many seconds, which goes to the engine: a depth that reads full by mistake cannot last
PROBE_EVERY_S = 0.1
#: seconds past ``--timeout-s`` that a passed-on request waits for its answer to start before the
#: worker answers 504 itself (the engine's own 504 comes first, unless it cannot run)
ENGINE_GRACE_S = 1.0


class EngineClient(asyncio.Protocol):
    """A worker's end of its link: the classify backend of :mod:`~fullthrottle.server.classify_route`,
    and the pass-through of every other request. The link is the event loop's own transport: a send
    never blocks the loop (while the engine is slow to read, its requests wait, not the worker's
    other connections), and answers are handed out where they arrive. Made by :meth:`connect`."""

    #: bytes the link may hold unsent before a request waits to send its own
    WRITE_BUFFER_BYTES = 8 << 20

    def __init__(self, loop: asyncio.AbstractEventLoop, on_lost=None, backlog=None, max_queue: int = 0):
        self.loop, self.on_lost = loop, on_lost
        # (the engine's queue as it last said, and its size: a request it cannot take is refused here)
        self.backlog, self.max_queue = backlog, max_queue
        self._probe_at = 0.0
        self.pending: dict[int, object] = {}  # request id -> its future (classify) or queue (HTTP)
        self.lost = False
        self._ids = itertools.count(1)
        self._reader = wire.MessageReader()
        self._transport: asyncio.Transport | None = None
        self._writable = asyncio.Event()
        self._writable.set()

    @classmethod
    async def connect(cls, sock, on_lost=None, backlog=None, max_queue: int = 0) -> EngineClient:
        """The client on the link socket ``sock`` (its end of the supervisor's socket pair);
        ``backlog``: the engine's :class:`~fullthrottle.server.link.Backlog` and ``max_queue`` its
        queue's size (``--max-queue``), or None: every request goes to the engine."""
        loop = asyncio.get_running_loop()
        client = cls(loop, on_lost, backlog, max_queue)
        await loop.create_unix_connection(lambda: client, sock=sock)
        return client

    def connection_made(self, transport) -> None:
        self._transport = transport
        transport.set_write_buffer_limits(high=self.WRITE_BUFFER_BYTES)

    def data_received(self, data: bytes) -> None:
        try:
            for msg in self._reader.feed(data):
                self._deliver([(k, r, bytes(p)) for k, r, p in wire.frames(msg)])
        except ValueError:  # (the engine writes these frames: a bug, not a client's doing)
            self._transport.close()  # (-> connection_lost)

    def connection_lost(self, exc) -> None:
        self._lose()

    def pause_writing(self) -> None:
        self._writable.clear()

    def resume_writing(self) -> None:
        self._writable.set()

    def _deliver(self, got: list) -> None:
        for kind, req_id, payload in got:
            waiter = self.pending.get(req_id)
            if waiter is None:  # (its client went away, or its deadline passed)
                continue
            if kind == wire.RESULTS:
                if not waiter.done():
                    waiter.set_result(wire.unpack_results(payload))
            else:
                waiter.put_nowait((kind, payload))

    def _lose(self) -> None:
        if self.lost:
            return
        self.lost = True
        self._writable.set()  # (a request waiting to send finds the link gone)
        for waiter in self.pending.values():
            if isinstance(waiter, asyncio.Future):
                if not waiter.done():
                    waiter.set_exception(RuntimeError("the engine process has stopped"))
            else:
                waiter.put_nowait(None)
        if self.on_lost is not None:
            self.on_lost()

    def _send(self, pieces: list[bytes]) -> None:
        if self.lost:
            raise RuntimeError("the engine process has stopped")
        self._transport.writelines([wire.message_header(sum(map(len, pieces))), *pieces])

    async def _send_when_writable(self, pieces: list[bytes]) -> None:
        """:meth:`_send` once the link holds less than :attr:`WRITE_BUFFER_BYTES` unsent."""
        await self._writable.wait()
        self._send(pieces)

    async def classify(self, images: list[tuple[str, bytes | EntryError]]) -> list[Result]:
        """The results of a request's images (URLs that could not be fetched get their own error).

        Raises:
            Overloaded: the engine's queue is full. RuntimeError: loading, shutting down, stopped.
        """
        sent = [(iid, data) for iid, data in images if not isinstance(data, EntryError)]
        rows = []
        if sent and self.backlog is not None and self.backlog.get() + len(sent) > self.max_queue:
            # (one such request per PROBE_EVERY_S still goes: the engine's answer rewrites the depth)
            if self.loop.time() < self._probe_at:
                raise Overloaded(f"queue full ({self.max_queue} images waiting)")  # (as the engine says it)
            self._probe_at = self.loop.time() + PROBE_EVERY_S
        if sent:
            req_id = next(self._ids)
            fut = self.pending[req_id] = self.loop.create_future()
            try:
                await self._send_when_writable(wire.frame(wire.CLASSIFY, req_id, *wire.pack_images(sent)))
                got = await fut
            except asyncio.CancelledError:  # (its client left, or its deadline passed)
                if req_id in self.pending and not self.lost:
                    self._send(wire.frame(wire.CANCEL, req_id))  # the engine drops its queued images
                raise
            finally:
                self.pending.pop(req_id, None)
            if "error" in got:
                raise (Overloaded if got["overloaded"] else RuntimeError)(got["error"])
            rows = got["results"]
        out, it = [], iter(rows)
        for i, (iid, data) in enumerate(images):
            if isinstance(data, EntryError):
                out.append(Result(-1, iid, error=f"{iid}: {data}"))
            else:
                rid, labels, class_ids, probs, error, latency_ms = next(it)
                out.append(Result(i, rid, labels, class_ids, probs, error, latency_ms))
        return out

    async def forward(
        self, scope, receive, send, body: bytes, first_byte_s: float, late=(504, ""), retry_after_s: int = 1
    ) -> int | None:
        """Pass one request (its body already read) to the engine and stream its answer to the client.
        No start of an answer within ``first_byte_s``: ``late`` (status, detail) is the answer and
        the engine is told to drop the request (a stopped or wedged engine; once an answer has
        started, a stream runs as long as it lasts). Returns the status of an answer made here
        (``late``, or 503 with ``retry_after_s``: the engine is gone), None for the engine's own."""
        req_id = next(self._ids)
        q = self.pending[req_id] = asyncio.Queue()
        head = {
            "method": scope["method"],
            "path": scope["path"],
            "query": scope.get("query_string", b"").decode("latin-1"),
            "headers": [[k.decode("latin-1"), v.decode("latin-1")] for k, v in scope["headers"]],
            "client": list(scope["client"]) if scope.get("client") else None,
            "server": list(scope["server"]) if scope.get("server") else None,
            "http_version": scope.get("http_version", "1.1"),
        }

        async def watch():  # the client hanging up is passed on: a stream stops, a row is freed
            while (await receive())["type"] != "http.disconnect":
                pass
            if not self.lost:
                self._send(wire.frame(wire.CANCEL, req_id))
            q.put_nowait(None)

        watcher = None
        started = False
        deadline = self.loop.time() + first_byte_s
        try:
            await self._send_when_writable(wire.frame(wire.HTTP, req_id, *wire.pack_http(head, body)))
            watcher = asyncio.ensure_future(watch())
            while True:
                try:
                    got = await (q.get() if started else asyncio.wait_for(q.get(), deadline - self.loop.time()))
                except TimeoutError:
                    if not self.lost:
                        self._send(wire.frame(wire.CANCEL, req_id))
                    await _error(send, scope, late[0], late[1] or f"no answer within {first_byte_s:g} s")
                    return late[0]
                if got is None:  # the client or the engine went away
                    if not started and self.lost:
                        retry = {"Retry-After": str(retry_after_s)}
                        await _error(send, scope, 503, "the engine process has stopped", retry)
                        return 503
                    return None
                kind, payload = got
                if kind == wire.START:
                    start = json.loads(payload)
                    hdrs = [(k.encode("latin-1"), v.encode("latin-1")) for k, v in start["headers"]]
                    await send({"type": "http.response.start", "status": start["status"], "headers": hdrs})
                    started = True
                elif kind == wire.BODY:
                    more = payload[:1] == b"\x01"
                    await send({"type": "http.response.body", "body": payload[1:], "more_body": more})
                    if not more:
                        return None
        except RuntimeError as e:  # (the link is gone)
            if not started:
                await _error(send, scope, 503, str(e))
                return 503
            return None
        finally:
            self.pending.pop(req_id, None)
            if watcher is not None:
                watcher.cancel()

    async def get(self, path: str, timeout_s: float, key: str | None = None) -> tuple[int, bytes]:
        """An internal GET through the engine's app (status, body; 504 past ``timeout_s``), with the
        API ``key`` where the server has keys."""
        chunks, status = [], [0]

        async def receive():
            await asyncio.sleep(3600)
            return {"type": "http.disconnect"}

        async def send(msg):
            if msg["type"] == "http.response.start":
                status[0] = msg["status"]
            else:
                chunks.append(msg.get("body", b""))

        auth = [(b"authorization", f"Bearer {key}".encode("latin-1"))] if key else []
        scope = {"type": "http", "method": "GET", "path": path, "headers": auth, "client": None, "server": None}
        await self.forward(scope, receive, send, b"", timeout_s)
        return status[0], b"".join(chunks)


async def _json(send, status: int, body: dict, headers: dict | None = None) -> None:
    data = json.dumps(body).encode()
    hdrs = [(b"content-type", b"application/json"), (b"content-length", str(len(data)).encode())]
    hdrs += [(k.lower().encode(), v.encode()) for k, v in (headers or {}).items()]
    await send({"type": "http.response.start", "status": status, "headers": hdrs})
    await send({"type": "http.response.body", "body": data})


async def _error(send, scope, status: int, detail: str, headers: dict | None = None) -> None:
    """An error the worker answers itself, shaped as the engine's app shapes it (:func:`error_body`)."""
    await _json(send, status, error_body(status, detail, openai_path(scope["path"])), headers)


def create_front_app(opts, max_image_pixels: int, top_k: int, client_box: list):
    """The worker's ASGI app: its own FastAPI app for :data:`LOCAL_ROUTES` (``POST /v1/classify``
    straight to its route's handler, after the API-key check), the engine for the rest.
    ``client_box[0]`` is the :class:`EngineClient` (made once the event loop runs)."""
    import contextlib

    import httpx
    from fastapi import FastAPI
    from fastapi.responses import PlainTextResponse
    from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest
    from prometheus_client.multiprocess import MultiProcessCollector
    from starlette.requests import Request

    from .classify_route import ROUTE as CLASSIFY
    from .classify_route import add_classify_route
    from .fetch import FetchPolicy
    from .http_layer import NO_DOCS, ROUTES, add_basics
    from .metrics import ServerMetrics

    policy = (
        FetchPolicy(opts.allow_fetch, max_bytes=opts.max_body_bytes, timeout_s=opts.url_timeout_s)
        if opts.allow_fetch
        else None
    )
    m = ServerMetrics()
    state: dict = {"ready": True}  # (the engine says 503 while its model loads)

    @contextlib.asynccontextmanager
    async def lifespan(app):
        state["classifier"] = client_box[0]
        # (the heap trim: a worker holds each body until the engine answers it)
        set_busy(lambda: bool(client_box[0] is not None and client_box[0].pending), work=False)
        state["http"] = httpx.AsyncClient(timeout=opts.url_timeout_s, follow_redirects=False, trust_env=False)
        try:
            yield
        finally:
            await state["http"].aclose()

    local = FastAPI(title="fullthrottle", lifespan=lifespan, redirect_slashes=False, **NO_DOCS)

    reply = add_basics(local, m.requests, opts.api_keys)

    @local.api_route("/metrics", methods=["GET", "HEAD"])
    async def metrics():
        key = opts.api_keys[0] if opts.api_keys else None
        # (the engine's /metrics sets its gauges and counts this scrape, as every answer is counted)
        await client_box[0].get("/metrics", ENGINE_PROBE_S, key)
        reg = CollectorRegistry()
        MultiProcessCollector(reg)  # every process's counters and histograms, summed
        return PlainTextResponse(generate_latest(reg), media_type=CONTENT_TYPE_LATEST)

    classify = add_classify_route(local, state, opts, policy, reply, m, max_image_pixels, top_k)

    async def app(scope, receive, send):
        hot = scope["type"] == "http" and scope["path"] == CLASSIFY and scope["method"] == "POST"
        if not hot and (scope["type"] != "http" or scope["path"] in LOCAL_ROUTES):
            return await local(scope, receive, send)
        route = scope["path"] if scope["path"] in ROUTES else "other"
        try:
            headers = dict((k.lower(), v) for k, v in scope["headers"])
            key = (headers.get(b"authorization") or b"").decode("latin-1")
            if opts.api_keys and not authorised(key, opts.api_keys):
                m.requests.labels(route, "401").inc()
                return await _json(send, *NO_KEY)
            if hot:  # (classify straight to its handler: FastAPI's routing would cost as much as the handler)
                response = await classify(Request(scope, receive))
                return await response(scope, receive, send)
            body = await read_asgi_body(receive, headers, opts.max_body_bytes, opts.body_timeout_s)
            if body is None:
                return
            if scope["path"] == "/readyz":  # (a probe: a stopped or wedged engine is not ready, at once)
                late = (503, f"the engine process did not answer within {ENGINE_PROBE_S:g} s")
                mine = await client_box[0].forward(scope, receive, send, body, ENGINE_PROBE_S, late, opts.retry_after_s)
            else:  # (the engine answers 504 at the deadline itself; this one is for an engine that can't)
                wait_s = opts.timeout_s + ENGINE_GRACE_S
                mine = await client_box[0].forward(scope, receive, send, body, wait_s, (504, ""), opts.retry_after_s)
            if mine is not None:
                m.requests.labels(route, str(mine)).inc()
        except HTTPError as e:
            m.requests.labels(route, str(e.status)).inc()
            await _error(send, scope, e.status, e.detail, e.headers)

    app.requests_counter = m.requests  # (uvicorn_server counts the parser's refusals there)
    return app


def event_loop_factory():
    """uvloop's event loop where it is installed (what uvicorn picks with ``loop="auto"``: less CPU per
    request than asyncio's), else None (asyncio's)."""
    try:
        import uvloop
    except ImportError:
        return None
    return uvloop.new_event_loop


def main() -> None:
    """The worker's entry point: ``argv``: listening socket fd, link fd, and the engine's backlog's
    fd (:class:`~fullthrottle.server.link.Backlog`) if it has one; stdin: its settings (JSON)."""
    import socket

    from .http_layer import uvicorn_server
    from .options import ServeOptions

    listen_fd, link_fd = int(sys.argv[1]), int(sys.argv[2])
    backlog = wire.Backlog(int(sys.argv[3])) if len(sys.argv) > 3 else None
    settings = json.loads(sys.stdin.read())
    opts = ServeOptions(**{k: tuple(v) if isinstance(v, list) else v for k, v in settings["options"].items()})
    box: list = [None]
    server = uvicorn_server(
        create_front_app(opts, settings["max_image_pixels"], settings["top_k"], box), opts, settings["max_connections"]
    )

    engine_pid = os.getppid()

    def lost():  # the engine is gone: drain like at SIGTERM, then exit
        if not server.should_exit:
            print(f"fullthrottle: HTTP worker {os.getpid()}: the engine process has stopped; exiting", file=sys.stderr)
            os.kill(os.getpid(), signal.SIGTERM)

    async def run():
        box[0] = await EngineClient.connect(socket.socket(fileno=link_fd), lost, backlog, opts.max_queue)
        await server.serve(sockets=[socket.socket(fileno=listen_fd)])

    with asyncio.Runner(loop_factory=event_loop_factory()) as runner:
        runner.run(run())
    metrics_dir = os.environ.get("PROMETHEUS_MULTIPROC_DIR")
    if metrics_dir and os.getppid() != engine_pid:  # the engine died before us: nobody else removes it
        import shutil

        shutil.rmtree(metrics_dir, ignore_errors=True)
