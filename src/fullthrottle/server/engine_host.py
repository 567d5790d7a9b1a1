"""The engine process's side of a multi-process server: it answers its HTTP worker processes'
links (:mod:`~fullthrottle.server.link`) from the one-process app
(:func:`~fullthrottle.server.app.create_app`), which it runs without a socket of its own.

- ``CLASSIFY`` frames go straight to the app's classification replicas
  (:meth:`~fullthrottle.server.services.BatchingService.submit_cb`): a link's reader thread submits
  the images, the replica's dispatcher thread collects each request's results, and the link's
  writer thread sends every answer ready at that moment in one message. No asyncio, no HTTP, no
  JSON parsing of requests in this process.
- ``HTTP`` frames (embeddings, completions, the user's workloads, ``/readyz``, ...) are run through
  the app as ASGI calls on the engine's event loop; the answer streams back as ``START`` and
  ``BODY`` frames, and a ``CANCEL`` reads as the client's disconnect.
"""

from __future__ import annotations

import asyncio
import json
import logging
import queue
import socket
import threading

from ..core.errors import Overloaded
from . import link as wire
from .guard import trim_soon

log = logging.getLogger("fullthrottle.server.engine")


class Link:
    """The engine's end of one HTTP worker's link (``sock``: its end of the supervisor's socket pair,
    blocking): a reader thread (frames in, every message waiting read at once) and a writer thread
    (frames out, all that are ready sent as one message)."""

    def __init__(self, sock: socket.socket, host: EngineHost, name: str):
        self.sock, self.host, self.name = sock, host, name
        self._in = wire.SocketReader(sock)
        self.out: queue.SimpleQueue = queue.SimpleQueue()
        self.closed = threading.Event()
        self.cancels: dict[int, asyncio.Event] = {}  # HTTP request id -> set on the client's disconnect
        self.classifying: dict[int, _Gather] = {}  # classify request id -> its images in the pipeline
        self._reader = threading.Thread(target=self._read, name=f"ft-link-in-{name}", daemon=True)
        self._writer = threading.Thread(target=self._write, name=f"ft-link-out-{name}", daemon=True)
        self._reader.start()
        self._writer.start()

    def send(self, kind: int, req_id: int, *parts: bytes) -> None:
        if not self.closed.is_set():
            self.out.put(wire.frame(kind, req_id, *parts))

    def _write(self) -> None:
        while True:
            pieces = self.out.get()
            if pieces is None:
                return
            more = [pieces]
            while True:  # every frame ready now goes in the same message
                try:
                    nxt = self.out.get_nowait()
                except queue.Empty:
                    break
                if nxt is None:
                    self.out.put(None)
                    break
                more.append(nxt)
            pieces = [p for f in more for p in f]
            try:
                self.sock.sendall(b"".join([wire.message_header(sum(map(len, pieces))), *pieces]))
            except OSError:
                self.close()
                return

    def _read(self) -> None:
        try:
            while True:
                # every message there already: a request cancelled among them never runs
                frames = [f for m in self._in.read() for f in wire.frames(m)]
                # (the bodies came in here, and the pipeline's work on them: after a burst, the heap
                # they took goes back once no image is left, as the app's lifespan set_busy says)
                trim_soon(sum(len(p) for _, _, p in frames), self.host.loop)
                dropped = {req_id for kind, req_id, _ in frames if kind == wire.CANCEL}
                for kind, req_id, payload in frames:
                    if kind in (wire.CLASSIFY, wire.HTTP) and req_id in dropped:
                        continue  # (answered by the worker already: its deadline passed, or its client left)
                    if kind == wire.CLASSIFY:
                        self.host.classify(self, req_id, wire.unpack_images(payload))
                    elif kind == wire.HTTP:
                        head, body = wire.unpack_http(payload)
                        # (its cancel event made here: a CANCEL read later finds it, even before it runs)
                        cancel = self.cancels[req_id] = asyncio.Event()
                        asyncio.run_coroutine_threadsafe(
                            self.host.bridge(self, req_id, head, body, cancel), self.host.loop
                        )
                    elif kind == wire.CANCEL:
                        g = self.classifying.pop(req_id, None)
                        if g is not None:  # (its client left: its images still queued are not decoded)
                            g.cancel()
                        ev = self.cancels.get(req_id)
                        if ev is not None:
                            self.host.loop.call_soon_threadsafe(ev.set)
        except (EOFError, OSError):
            pass  # the worker exited (or was killed): its requests are gone with it
        except ValueError as e:  # (our own workers write these frames: a bug, not a client's doing)
            log.error("HTTP worker %s sent a malformed frame: %s", self.name, e)
        self.close()

    def close(self) -> None:
        if not self.closed.is_set():
            self.closed.set()
            self.out.put(None)
            lost = list(self.classifying.values())
            for g in lost:  # (the worker is gone: nobody reads their answers)
                g.cancel()
            if lost and self.host.requests is not None:  # (counted here: their worker counts no more)
                self.host.requests.labels("/v1/classify", "499").inc(len(lost))
            for ev in list(self.cancels.values()):
                self.host.loop.call_soon_threadsafe(ev.set)
            try:
                self.sock.shutdown(socket.SHUT_RDWR)  # (wakes the reader thread, if it is not this one)
            except OSError:
                pass
            self.sock.close()


class _Gather:
    """One classify request's results, collected on the replica's dispatcher thread."""

    def __init__(self, lk: Link, req_id: int, n: int):
        self.lk, self.req_id, self.left = lk, req_id, n
        self.rows: list = [None] * n
        self.lock = threading.Lock()
        self.failed = False
        self.svc, self.indexes = None, []  # the replica and the images' indexes there

    def done(self, i: int, r) -> None:
        with self.lock:
            if self.failed:
                return
            if isinstance(r, BaseException):
                self.fail(str(r), False)
                return
            self.rows[i] = wire.pack_result(r)
            self.left -= 1
            if self.left:
                return
        self.lk.classifying.pop(self.req_id, None)
        self.lk.send(wire.RESULTS, self.req_id, *wire.results_payload(self.rows))

    def fail(self, reason: str, overloaded: bool) -> None:
        """(Called with ``lock`` held.) The request's answer is this error; its other images are dropped."""
        self.cancel(locked=True)
        self.lk.send(wire.RESULTS, self.req_id, wire.error_payload(reason, overloaded))

    def cancel(self, locked: bool = False) -> None:
        """No answer for this request: its images still queued are not decoded."""
        if not locked:
            with self.lock:
                return self.cancel(locked=True)
        self.failed = True
        self.lk.classifying.pop(self.req_id, None)
        if self.svc is not None:
            self.svc.cancel(self.indexes)
            self.lk.host.publish_backlog()  # (its images left the queue)


class EngineHost:
    """Serves HTTP worker links from ``app`` (built by ``create_app``; its lifespan run by the
    caller) on ``loop`` (the engine's event loop, running in another thread or the caller's)."""

    def __init__(self, app, loop: asyncio.AbstractEventLoop, backlog: wire.Backlog | None = None):
        self.app, self.loop, self.backlog = app, loop, backlog
        self._publishing = threading.Lock()
        self.state: dict = app.state.ft
        #: the app's requests counter (by route and status), for the requests a lost worker held
        self.requests = getattr(app.state, "requests_counter", None)
        self.links: list[Link] = []

    def publish_backlog(self) -> None:
        """The images waiting in the least-loaded replica's queue, for the workers' own 503s
        (:class:`~fullthrottle.server.link.Backlog`): written as images join a queue, leave it for
        the pipeline (each replica's ``on_take``) or leave it with their client."""
        services = self.state.get("services")
        if self.backlog is not None and services:
            # (read and written under one lock, so that the last write has the last change: a stale
            # "full" left here would have the workers refuse every request, the queue being empty)
            with self._publishing:
                self.backlog.set(min(v.queued() for v in services))

    def add_link(self, sock: socket.socket, name: str) -> Link:
        lk = Link(sock, self, name)
        self.links = [x for x in self.links if not x.closed.is_set()] + [lk]
        return lk

    def close(self) -> None:
        for lk in self.links:
            lk.close()

    def classify(self, lk: Link, req_id: int, images: list[tuple[str, bytes]]) -> None:
        g = _Gather(lk, req_id, len(images))
        if not self.state.get("ready") or not self.state.get("services"):
            g.fail("model is loading" if not self.state.get("ready") else "classification is not served", False)
            return
        svc = g.svc = min(self.state["services"], key=lambda v: v.queued() + v.pending())
        if self.backlog is not None and svc.on_take is None:
            svc.on_take = self.publish_backlog
        lk.classifying[req_id] = g
        try:
            for i, (item_id, data) in enumerate(images):
                g.indexes.append(svc.submit_cb(item_id, data, lambda r, i=i: g.done(i, r)))
        except Overloaded as e:
            with g.lock:
                g.fail(str(e), True)
        except RuntimeError as e:
            with g.lock:
                g.fail(str(e), False)
        self.publish_backlog()

    async def bridge(self, lk: Link, req_id: int, head: dict, body: bytes, cancel: asyncio.Event) -> None:
        """Run one request through the app; its answer goes back as START and BODY frames.
        ``cancel``: set when the worker drops the request (its client left, or it answered it)."""
        if cancel.is_set() or lk.closed.is_set():  # (dropped before it ran: the app never sees it)
            lk.cancels.pop(req_id, None)
            return
        first = [True]
        started = [False]

        async def receive():
            if first[0]:
                first[0] = False
                return {"type": "http.request", "body": body, "more_body": False}
            await cancel.wait()
            return {"type": "http.disconnect"}

        async def send(msg):
            if msg["type"] == "http.response.start":
                started[0] = True
                hdrs = [[k.decode("latin-1"), v.decode("latin-1")] for k, v in msg.get("headers", [])]
                lk.send(wire.START, req_id, json.dumps({"status": msg["status"], "headers": hdrs}).encode())
            elif msg["type"] == "http.response.body":
                more = bool(msg.get("more_body", False))
                lk.send(wire.BODY, req_id, b"\x01" if more else b"\x00", bytes(msg.get("body", b"")))

        scope = {
            "type": "http",
            "asgi": {"version": "3.0"},
            "http_version": head.get("http_version", "1.1"),
            "method": head["method"],
            "scheme": "http",
            "path": head["path"],
            "raw_path": head["path"].encode(),
            "query_string": head.get("query", "").encode("latin-1"),
            "root_path": "",
            "headers": [(k.encode("latin-1"), v.encode("latin-1")) for k, v in head["headers"]],
            "client": tuple(head["client"]) if head.get("client") else None,
            "server": tuple(head["server"]) if head.get("server") else None,
            "state": {},
        }
        try:
            await self.app(scope, receive, send)
        except Exception:  # noqa: BLE001 - the app's own error handler answered 500 if it could
            log.exception("%s %s failed in the engine", head["method"], head["path"])
            if not started[0]:
                err = json.dumps({"detail": "internal server error"}).encode()
                hdrs = [["content-type", "application/json"], ["content-length", str(len(err))]]
                lk.send(wire.START, req_id, json.dumps({"status": 500, "headers": hdrs}).encode())
                lk.send(wire.BODY, req_id, b"\x00", err)
        finally:
            lk.cancels.pop(req_id, None)
