"""The HTTP layer that the one-process app (:mod:`~fullthrottle.server.app`) and the worker
processes of a multi-process server (:mod:`~fullthrottle.server.front`) share: the route table that
labels metrics, the counted JSON reply, the API-key check, ``/healthz``, and the uvicorn server with
the guard's limits. Imports neither
the engines nor torch (an HTTP worker process holds no model).
"""

from __future__ import annotations

import asyncio
import json
import logging

from fastapi import Request  # module level: FastAPI resolves handler annotations from module globals

from .connection import LogBudget, head_deadline_protocol
from .guard import draining, error_body, openai_path
from .keys import NO_KEY, authorised
from .options import ServeOptions
from .startup import startup_error_only

log = logging.getLogger("fullthrottle.server")

ROUTES = (
    "/v1/classify",
    "/v1/embeddings",
    "/v1/completions",
    "/v1/chat/completions",
    "/v1/models",
    "/readyz",
    "/metrics",
)  # metric labels

#: FastAPI's generated docs are not served (``/docs``, ``/redoc``, ``/openapi.json``: 404): every route
#: reads its body itself, so they would describe none of them
NO_DOCS = {"docs_url": None, "redoc_url": None, "openapi_url": None}


def add_key_check(app, keys: tuple[str, ...], reply) -> None:
    """With any ``keys``: every route but ``/healthz`` answers 401 without ``Authorization: Bearer KEY``
    (before the body is read: the connection closes, the body is never taken in)."""
    if not keys:
        return

    @app.middleware("http")
    async def require_key(request: Request, call_next):
        if request.url.path != "/healthz" and not authorised(request.headers.get("authorization"), keys):
            return reply(request.url.path if request.url.path in ROUTES else "other", *NO_KEY)
        return await call_next(request)


def add_basics(app, requests_counter, keys: tuple[str, ...]):
    """What the one-process app and an HTTP worker's app both start with: ``reply(route, status,
    body, headers=None)`` (a JSON response, counted in ``requests_counter`` by route and status),
    the API-key check, ``GET /healthz``, and 404/405 answers counted too. Returns ``reply``.
    (``app.requests_counter`` is the counter: :func:`uvicorn_server` counts there what the HTTP
    parser refuses.)"""
    from fastapi.responses import JSONResponse

    def reply(route: str, status: int, body: dict, headers: dict | None = None):
        r = JSONResponse(body, status_code=status, headers=headers)  # (raises for what is not JSON: uncounted)
        requests_counter.labels(route, str(status)).inc()
        return r

    add_key_check(app, keys, reply)
    app.requests_counter = requests_counter

    from starlette.exceptions import HTTPException

    @app.exception_handler(HTTPException)
    async def no_such_route(request, exc):  # 404 (no route), 405 (method): counted like every answer
        # (a 405's path is a route of the app's; a 404's may be anything: one label for them all)
        route = request.url.path if exc.status_code == 405 or request.url.path in ROUTES else "other"
        # (under /v1/ also OpenAI's error shape, which its clients show, beside "detail"; no route
        # is a bad request, as OpenAI's API answers one, not a model it lacks)
        openai = openai_path(request.url.path)
        detail = f"no route {request.method} {request.url.path}" if exc.status_code == 404 else exc.detail
        body = error_body(exc.status_code, detail, openai, "invalid_request_error")
        return reply(route, exc.status_code, body, getattr(exc, "headers", None))

    @app.api_route("/healthz", methods=["GET", "HEAD"])
    async def healthz():
        return reply("/healthz", 200, {"status": "alive"})

    return reply


def busy_app(detail: str, retry_after_s: int, counter=None):
    """The ASGI app that answers the requests of a connection opened past a connection cap: 503 with
    Retry-After and the server's JSON error shape (``detail``: why), the connection closed after it,
    counted in ``counter`` (by route and status) where one is given."""
    # (under /v1/ also OpenAI's error shape, as every answer there: its clients read error.message)
    answers = {}
    for openai in (False, True):
        body = json.dumps(error_body(503, detail, openai)).encode()
        headers = [
            (b"content-type", b"application/json"),
            (b"content-length", str(len(body)).encode()),
            (b"retry-after", str(retry_after_s).encode()),
            (b"connection", b"close"),
        ]
        answers[openai] = body, headers

    async def app(scope, receive, send):
        if scope["type"] != "http":
            return
        if counter is not None:
            counter.labels(scope["path"] if scope["path"] in (*ROUTES, "/healthz") else "other", "503").inc()
        body, headers = answers[openai_path(scope["path"])]
        await send({"type": "http.response.start", "status": 503, "headers": headers})
        await send({"type": "http.response.body", "body": body})

    return app


def _not_a_dropped_request(record: logging.LogRecord) -> bool:
    """Logging filter: no traceback for a task cancelled because a second signal stopped the server
    (a request's connection is closed unanswered, and one line says so)."""
    if record.exc_info and isinstance(record.exc_info[1], asyncio.CancelledError):
        return False
    msg = record.getMessage()  # (the app's lifespan task, cancelled the same way, logs its traceback as text)
    return not (msg.startswith("Traceback") and msg.rstrip().endswith("CancelledError"))


def _no_websocket_advice(record: logging.LogRecord) -> bool:
    """Logging filter: not uvicorn's advice to install a WebSocket library, which it gives with each
    Upgrade request (``ws="none"``: no route speaks WebSocket, and a client could fill the log)."""
    return not record.getMessage().startswith("No supported WebSocket library detected")


#: at a second SIGTERM, how long (s) what ``on_drain(0)`` ended has to send its last bytes before the
#: connections close
FORCED_END_S = 0.3


def uvicorn_server(app, opts: ServeOptions, max_connections: int, on_drain=None, **where):
    """A uvicorn server for ``app`` with the guard's limits (``where``: ``host`` and ``port``, or
    nothing when the caller passes its sockets to ``run``). Its first SIGTERM or SIGINT drains
    in-flight requests (each within ``opts.timeout_s``; a request body that stops coming is answered
    408 after :data:`~fullthrottle.server.guard.DRAIN_BODY_IDLE_S`; connections still waiting in the
    listening sockets' backlogs are accepted and drained too), the second stops waiting; ``run`` then
    returns normally (exit status 0). Requests the HTTP parser refuses (400) are counted in
    ``app.requests_counter`` (route ``other``), where ``app`` has one (:func:`add_basics`).
    ``on_drain(seconds)``, if given, is called (in the event loop) as the drain starts, with its length,
    and with 0 at a second signal, :data:`FORCED_END_S` before the connections close."""
    import contextlib
    import signal

    import uvicorn

    class _Server(uvicorn.Server):
        async def _take_the_backlog(self) -> None:
            """Accept the connections still waiting in the listening sockets' backlogs, then stop
            listening: closing a listening socket resets them, though their clients have sent their
            requests (a busy event loop accepts late). They are drained as every open connection is."""
            import functools
            import os
            import socket

            taken, cfg = [], self.config
            for server in self.servers:
                for ts in server.sockets:
                    listener = socket.socket(ts.family, ts.type, fileno=os.dup(ts.fileno()))
                    listener.setblocking(False)
                    try:
                        for _ in range(cfg.backlog):  # (at most a backlog's worth: no client keeps it open)
                            taken.append(listener.accept()[0])
                    except OSError:  # (BlockingIOError: the backlog is empty)
                        pass
                    finally:
                        listener.close()
                server.close()  # (no connection joins a backlog from here on: it is refused)
            factory = functools.partial(
                cfg.http_protocol_class, config=cfg, server_state=self.server_state, app_state=self.lifespan.state
            )
            loop = asyncio.get_running_loop()
            for conn in taken:
                try:
                    await loop.connect_accepted_socket(factory, conn)
                except OSError:  # (its client has gone)
                    conn.close()

        # uvicorn re-raises the captured signal after its graceful shutdown, so the process would die
        # of SIGTERM (status -15) after draining; we drain the same way and then return normally.
        def handle_exit(self, sig, frame):
            if self.should_exit:  # a second SIGTERM or SIGINT: stop waiting for in-flight requests
                self.force_exit = True
                if on_drain is not None:  # (what can end cleanly at once does: streams send their last chunk)
                    asyncio.get_event_loop().call_soon_threadsafe(on_drain, 0.0)
            super().handle_exit(sig, frame)

        async def shutdown(self, sockets=None):
            if on_drain is not None:
                on_drain(opts.timeout_s)
            await self._take_the_backlog()
            with draining():  # (a request body that stopped coming does not hold the drain: 408)
                await super().shutdown(sockets)
            if self.force_exit:  # requests still in flight are dropped: their connections close unanswered
                await asyncio.sleep(FORCED_END_S)  # (first the streams' last chunks go out)
                conns = list(self.server_state.connections)
                dropped = [c for c in conns if not getattr(getattr(c, "cycle", None), "response_complete", True)]
                for c in conns:
                    if getattr(c, "transport", None) is not None:
                        c.transport.close()
                if dropped:
                    log.warning("a second signal: %d connection(s) closed with requests unanswered", len(dropped))

        @contextlib.contextmanager
        def capture_signals(self):
            sigs = (signal.SIGINT, signal.SIGTERM)
            old = {s: signal.signal(s, self.handle_exit) for s in sigs}
            try:
                yield
            finally:
                for s, h in old.items():
                    signal.signal(s, h)

    counter = getattr(app, "requests_counter", None)

    def refused(status: int):  # (a 400 or 431 of the parser's: the request never reached the app)
        if counter is not None:
            counter.labels("other", str(status)).inc()

    budget = LogBudget(1, window_s=60.0)  # (at most one line a minute for refused clients)

    def client_refused(peer, limit: int) -> None:  # (its client sees a 503, the operator this line)
        if budget.take() is not None:
            log.warning(
                "connections from %s answered 503 and closed: it holds %d already "
                "(--max-connections-per-client; further refusals within a minute are not logged)",
                peer,
                limit,
            )

    logging.getLogger("uvicorn.error").addFilter(startup_error_only)
    logging.getLogger("uvicorn.error").addFilter(_not_a_dropped_request)
    logging.getLogger("uvicorn.error").addFilter(_no_websocket_advice)
    return _Server(
        uvicorn.Config(
            app,
            **where,
            log_level="info",
            access_log=opts.access_log,
            timeout_graceful_shutdown=opts.timeout_s,
            timeout_keep_alive=5,
            ws="none",  # (no route speaks WebSocket: an Upgrade request is answered as plain HTTP)
            http=head_deadline_protocol(
                opts.header_timeout_s,
                opts.max_connections_per_client,
                on_refused=refused,
                on_client_refused=client_refused,
                max_connections=max_connections,
                busy_app=busy_app(
                    f"the server holds its most connections ({max_connections}) open: retry later",
                    opts.retry_after_s,
                    counter,
                ),
                client_busy_app=busy_app(
                    f"this client address holds its most connections ({opts.max_connections_per_client}) open: "
                    "retry later, or on fewer connections (--max-connections-per-client)",
                    opts.retry_after_s,
                    counter,
                ),
            ),
        )
    )
