"""The server's HTTP/1.1 connections: uvicorn's protocol (httptools or h11) with a deadline and a size
limit on every request head, a cap on the connections of one client address and on all of them, a
bound on the requests one connection may pipeline, and a graceful shutdown that answers a request
already on its way (:func:`head_deadline_protocol`)."""

from __future__ import annotations

#: at a graceful shutdown, how long an idle keep-alive connection stays open for a request that
#: may already be on its way (it is answered, with ``Connection: close``), seconds
SHUTDOWN_LINGER_S = 0.5
#: most bytes of one request head (request line and headers) before the connection is answered 431
#: and closed (h11 has the same limit of its own)
MAX_HEAD_BYTES = 16384
#: a connection past the per-client cap must send its request head within this many seconds (or
#: ``seconds``, if shorter) to be answered 503; it is closed then
CLIENT_REFUSAL_HEAD_S = 1.0
#: most requests one connection may have parsed and waiting behind the one being answered (HTTP/1.1
#: pipelining, httptools); one more closes the connection: a client that pipelines without reading
#: its answers would otherwise have the server queue requests, and their answers, without bound
MAX_PIPELINED = 128
#: most lines a second one server process logs for the requests its parser refuses; the next line
#: logged after a second over it says how many were left out (every one is counted in /metrics)
REFUSALS_LOGGED_PER_S = 10


class LogBudget:
    """At most ``per_window`` log lines in any window of ``window_s`` seconds that starts at a line (a
    client that sends bad bytes in a loop cannot fill the log). :meth:`take` says whether a line is logged."""

    def __init__(self, per_window: int, window_s: float = 1.0, clock=None):
        import time

        self.per_window, self.window_s, self.clock = per_window, window_s, clock or time.monotonic
        self.start, self.used, self.left_out = -1e9, 0, 0

    def take(self) -> int | None:
        """None: leave this line out (it is counted); else log it, saying that the returned number
        of lines before it were left out (0: none)."""
        now = self.clock()
        if now - self.start >= self.window_s:
            self.start, self.used = now, 0
        if self.used >= self.per_window:
            self.left_out += 1
            return None
        self.used += 1
        left_out, self.left_out = self.left_out, 0
        return left_out


class _NotGeneric:
    """A filter for uvicorn's log: drops its one line for every request its parser refuses ("Invalid
    HTTP request received."), which names neither the client nor why: the protocol below logs a line
    that names both."""

    @staticmethod
    def filter(record) -> bool:
        return record.msg not in ("Invalid HTTP request received.", "Invalid HTTP request received")


class _KeepsError:
    """``obj`` as it is, but the exception of ``errors`` (and not of ``passing``) that its method ``name``
    raises is kept in ``error`` before it goes on up: uvicorn answers every parser error with one
    generic line, and the parser's own reason (a bad header character, Content-Length with
    Transfer-Encoding, a head too long) is what the client needs."""

    def __init__(self, obj, name: str, errors, passing=()):
        method = getattr(obj, name)

        def kept(*args):
            try:
                return method(*args)
            except passing:
                raise
            except errors as e:
                self.__dict__["error"] = e
                raise

        self.__dict__.update({"_obj": obj, "error": None, name: kept})

    def __getattr__(self, name):
        return getattr(self.__dict__["_obj"], name)

    def __setattr__(self, name, value):
        setattr(self.__dict__["_obj"], name, value)


def _refusal_bytes(status: int, reason: str, default_headers) -> bytes:
    """The answer to bytes that are no acceptable request: ``status`` with ``{"detail": reason}``
    (the JSON shape of the server's other errors), then the connection closes."""
    import json
    from http import HTTPStatus

    body = json.dumps({"detail": reason}).encode()
    out = [f"HTTP/1.1 {status} {HTTPStatus(status).phrase}\r\n".encode()]
    for name, value in default_headers:
        out += [name, b": ", value, b"\r\n"]
    out += [b"content-type: application/json\r\ncontent-length: %d\r\nconnection: close\r\n\r\n" % len(body), body]
    return b"".join(out)


#: a request head over :data:`MAX_HEAD_BYTES`, and an HTTP/1.1 one without Host (RFC 9112, 3.2): refused so
TOO_BIG = (431, f"request head (request line and headers) over {MAX_HEAD_BYTES} bytes")
NO_HOST = (400, "malformed HTTP request: an HTTP/1.1 request needs a Host header")


def head_deadline_protocol(
    seconds: float,
    per_client: int | None = None,
    parser: str = "auto",
    on_refused=None,
    on_client_refused=None,
    max_connections: int | None = None,
    busy_app=None,
    client_busy_app=None,
):
    """uvicorn's HTTP/1.1 protocol with a deadline on every request head: a connection whose request
    line and headers are not complete ``seconds`` after it opened (or after its previous response) is
    closed. uvicorn itself times out only idle keep-alive connections, and any byte received
    cancels that timer, so a client trickling a head could hold a connection for ever.

    A connection may pipeline requests (send the next before the answer to the last): each one's head
    is bounded as it comes, and at most :data:`MAX_PIPELINED` may wait (one more closes it). Bytes
    that are no request get 400 (431: a head too large) and the close once the requests before them
    are answered.

    ``per_client``: most connections open at once from one client address; one more gets
    ``client_busy_app`` (ASGI: 503, then closed) for its request, which must come within
    :data:`CLIENT_REFUSAL_HEAD_S`, or is closed as it opens where no ``client_busy_app`` is given,
    so that one client cannot take every connection the server allows (behind a proxy, every client
    has the proxy's address: raise it, or let the proxy limit).

    A client that shuts its side down once its request is sent (``shutdown(SHUT_WR)``, ``nc -N``) is
    taken as gone, as uvicorn takes it: its FIN cannot be told from a hang-up until an answer is
    written, and a hung-up client's queued work must leave at once (an LLM slot, images in a queue).

    At a graceful shutdown an idle keep-alive connection is closed :data:`SHUTDOWN_LINGER_S` later,
    not at once: a request the client sent just before is then answered (uvicorn would drop it
    unread, and the client sees a connection closed without an answer).

    ``parser``: ``"httptools"`` (uvicorn's C parser, llhttp), ``"h11"`` (pure Python: more CPU per
    request), or ``"auto"``: httptools where it is installed, as uvicorn itself picks.

    ``max_connections``: a connection opened while this many are open gets ``busy_app`` (ASGI: 503,
    then closed) for its requests (uvicorn's ``limit_concurrency`` would refuse the earlier ones too).
    ``on_refused``: called with the status for each request the parser refuses (400: malformed, with
    the parser's reason; 431: a head over :data:`MAX_HEAD_BYTES`), which never reaches the app (so the
    caller can count it). The refusal's body is ``{"detail": reason}``, as the server's other errors;
    the log has a line for each, naming the client and the reason, at most
    :data:`REFUSALS_LOGGED_PER_S` a second.
    ``on_client_refused``: called with the client's address and ``per_client`` for each connection
    refused because that address held ``per_client`` already."""
    if parser == "auto":
        import importlib.util

        parser = "httptools" if importlib.util.find_spec("httptools") is not None else "h11"
    if parser == "httptools":
        import httptools
        from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol as base
    elif parser == "h11":
        import h11
        from uvicorn.protocols.http.h11_impl import H11Protocol as base
    else:
        raise ValueError(f"parser must be auto, httptools or h11, got {parser!r}")

    import logging

    uv_log = logging.getLogger("uvicorn.error")
    log_budget = LogBudget(REFUSALS_LOGGED_PER_S)
    if not any(isinstance(f, _NotGeneric) for f in uv_log.filters):
        uv_log.addFilter(_NotGeneric())
    open_from: dict = {}  # client address -> its connections open now (one event loop: no lock)
    refused_open = [0]  # connections past the per-client cap still open (not counted against max_connections)

    class HeadDeadline(base):
        _head_timer = None
        _peer = None
        _closing = False
        _head_bytes: int | None = 0  # bytes received of the request head being read (None: it is whole)
        _arm_after_body = False  # answered before its body came in: the next head's deadline starts after it
        # a refusal (status, reason) held until the request in progress is answered
        _refusal: tuple[int, str] | None = None
        _head_why: tuple[int, str] | None = None  # a head refused by us: (status, reason)
        _over_cap = False  # past the per-client cap: answered 503 and closed

        def _arm(self) -> None:
            self._disarm()
            self._head_bytes = 0
            self._head_timer = self.loop.call_later(seconds, self._expired)

        def _disarm(self) -> None:
            if self._head_timer is not None:
                self._head_timer.cancel()
                self._head_timer = None

        def _expired(self) -> None:
            self._head_timer = None
            if not self.transport.is_closing():
                self.transport.close()

        def connection_made(self, transport) -> None:
            super().connection_made(transport)
            if parser == "httptools":
                self.parser = _KeepsError(
                    self.parser, "feed_data", httptools.HttpParserError, httptools.HttpParserUpgrade
                )
            else:
                self.conn = _KeepsError(self.conn, "next_event", h11.RemoteProtocolError)
            peer = transport.get_extra_info("peername")
            self._peer = peer[0] if isinstance(peer, tuple) and peer else None
            n = open_from[self._peer] = open_from.get(self._peer, 0) + 1
            if per_client is not None and n > per_client:
                if on_client_refused is not None:
                    on_client_refused(self._peer, per_client)
                if client_busy_app is None:
                    transport.close()
                    return
                self.app = client_busy_app  # (its one request answered 503, then closed)
                self._over_cap = True
                refused_open[0] += 1
                self._disarm()
                self._head_timer = self.loop.call_later(min(seconds, CLIENT_REFUSAL_HEAD_S), self._expired)
                return
            if max_connections is not None and len(self.connections) - refused_open[0] > max_connections:
                self.app = busy_app  # (this one's requests only: the connections open before go on)
            self._arm()

        def connection_lost(self, exc) -> None:
            self._disarm()
            if self._over_cap:
                self._over_cap = False
                refused_open[0] -= 1
            n = open_from.get(self._peer, 0) - 1
            if n > 0:
                open_from[self._peer] = n
            else:
                open_from.pop(self._peer, None)
            super().connection_lost(exc)

        def _head_arrived(self) -> None:
            self._disarm()
            self._head_bytes = None
            self._arm_after_body = False
            if self._closing and self.cycle is not None:
                self.cycle.keep_alive = False  # answered, then closed

        def handle_events(self) -> None:  # (h11: the parser's events)
            before = self.cycle
            super().handle_events()
            if self.cycle is not before:  # a request head arrived whole
                self._head_arrived()

        def data_received(self, data: bytes) -> None:
            if parser == "httptools" and self._head_bytes is not None:
                self._head_bytes += len(data)  # (httptools buffers a head of any size: h11 stops at 16 KiB)
            super().data_received(data)
            if self._arm_after_body and self.cycle is not None and not self.cycle.more_body:
                self._arm_after_body = False
                if not self.transport.is_closing():
                    self._arm()
            if (
                parser == "httptools"
                and self._head_bytes is not None
                and self._head_bytes > MAX_HEAD_BYTES
                and not self.transport.is_closing()
            ):
                self._head_why = TOO_BIG
                self.send_400_response(f"request head over {MAX_HEAD_BYTES} bytes")

        def _why(self, msg: str) -> tuple[int, str]:
            """The status and reason of a refusal that uvicorn words as ``msg``."""
            if self._head_why is not None:
                return self._head_why
            e = (self.parser if parser == "httptools" else self.conn).error
            if e is None or isinstance(e, ValueError):  # (ValueError: one of ours, raised in a callback)
                return 400, msg
            status = getattr(e, "error_status_hint", 400)  # (h11: 431 for a head too long)
            if status == 431:
                return 431, f"request head too large: {e}"
            return 400, f"malformed HTTP request: {e}"

        def send_400_response(self, msg: str) -> None:
            if self._refusal is not None:  # (refused already: what follows is not read)
                return
            status, reason = self._why(msg)
            left_out = log_budget.take()
            if left_out is not None:
                more = f" ({left_out} more refused before it, not logged)" if left_out else ""
                uv_log.warning("refused a request from %s: %d %s%s", self._peer or "a client", status, reason, more)
            c = self.cycle
            # (bad bytes inside a request's body: that request is the app's, which counts its end)
            if on_refused is not None and not (c is not None and c.more_body and not c.response_complete):
                on_refused(status)
            if c is not None and not c.more_body and not c.response_complete and not self.transport.is_closing():
                self._refusal = (status, reason)  # a whole request before the bad bytes is answered first, then this
                return
            self._refuse(status, reason)

        def _refuse(self, status: int, reason: str) -> None:
            self.transport.write(_refusal_bytes(status, reason, self.server_state.default_headers))
            self.transport.close()

        def on_headers_complete(self) -> None:  # (httptools: the parser's callback)
            # (a head that arrived whole in one read: its size is the line's and headers' bytes)
            size = len(self.url) + sum(len(k) + len(v) + 4 for k, v in self.headers)
            if size > MAX_HEAD_BYTES:
                self._head_why = TOO_BIG
            elif self.parser.get_http_version() == "1.1" and not any(k == b"host" for k, _ in self.headers):
                self._head_why = NO_HOST  # (h11 refuses it itself)
            if self._head_why is not None:
                raise ValueError(self._head_why[1])  # (the parser: refused, closed)
            before = self.cycle
            super().on_headers_complete()
            if self.cycle is not before:
                self._head_arrived()
            if len(self.pipeline) > MAX_PIPELINED and not self.transport.is_closing():
                self.transport.close()  # (see MAX_PIPELINED)

        def shutdown(self) -> None:
            if self.cycle is None or self.cycle.response_complete:
                self._closing = True
                self.loop.call_later(SHUTDOWN_LINGER_S, self._shutdown_now)
            else:
                super().shutdown()

        def _shutdown_now(self) -> None:
            if not self.transport.is_closing():
                super().shutdown()

        def on_response_complete(self) -> None:
            waiting = bool(getattr(self, "pipeline", None))  # (httptools: requests parsed ahead, one starts now)
            before = self.cycle
            super().on_response_complete()
            if self._refusal is not None and not waiting and not self.transport.is_closing():
                self._refuse(*self._refusal)  # (the requests before it answered: closed)
                return
            if self.transport.is_closing() or waiting or self.cycle is not before:
                return  # a request's head is here already (pipelined): its body is no head, no deadline runs
            if self.cycle is not None and self.cycle.more_body:  # answered before its whole body came in
                self._arm_after_body = True
                return
            self._arm()

    HeadDeadline.__name__ = HeadDeadline.__qualname__ = f"HeadDeadline{base.__name__}"
    return HeadDeadline
