"""The open loop of the serving benchmarks on bare asyncio connections: requests sent at a fixed rate
over keep-alive HTTP/1.1 connections, each one an :class:`asyncio.Protocol` that writes a prepared
request (head and body in one buffer) and reads the answer's status line and ``Content-Length``.

No task, future or timer is made per request: a request due while every connection is busy waits in
one queue, the next connection to free up takes it, and one sweep every :data:`SWEEP_S` expires what
waited too long. (aiohttp's client, a task and a ``wait_for`` per request, took about 250 µs of a core
per request: 4 client processes could not send the 15,800 requests a second the image server's
overload point asks for, and the point measured them.)

Supported answers: a status line, headers and a ``Content-Length`` body (uvicorn's and FastAPI's
JSON answers); one without ``Content-Length`` (chunked) is counted as :data:`NO_LENGTH` and its
connection closed and opened again.
"""

from __future__ import annotations

import asyncio
import time
from collections import Counter, deque
from urllib.parse import urlsplit

#: the status of a request whose time ran out while it waited for one of the clients'
#: connections: never sent (the load generator's queue, not the server's)
UNSENT = "TimeoutError before a client connection was free"
#: the status of an answer this client cannot frame (no Content-Length: chunked, or read to close)
NO_LENGTH = "answer without Content-Length"
#: seconds between sweeps for requests past their time (in the queue, or sent and unanswered)
SWEEP_S = 0.02
#: seconds the sender sleeps between its rounds (each round sends every request due by then)
TICK_S = 0.001
#: connections opened at once at the start (more at once overflow the server's listen backlog)
CONNECT_AT_ONCE = 128


def request_bytes(url: str, body: bytes, ctype: str) -> bytes:
    """One POST to ``url`` with ``body`` of type ``ctype``, head and body, as sent on the wire."""
    u = urlsplit(url)
    path = (u.path or "/") + (f"?{u.query}" if u.query else "")
    head = f"POST {path} HTTP/1.1\r\nHost: {u.netloc}\r\nContent-Type: {ctype}\r\nContent-Length: {len(body)}\r\n\r\n"
    return head.encode("latin-1") + body


class _Conn(asyncio.Protocol):
    """One keep-alive connection, one request on it at a time (``due``: its due time; None: idle)."""

    def __init__(self, run: _Run):
        self.run, self.buf, self.transport = run, bytearray(), None
        self.due: float | None = None
        self.t_sent = 0.0

    def connection_made(self, transport):
        self.transport = transport

    def send(self, req: bytes, due: float) -> None:
        self.due, self.t_sent = due, time.perf_counter()
        self.run.busy.add(self)
        self.transport.write(req)

    def data_received(self, data: bytes) -> None:
        buf = self.buf
        buf += data
        end = buf.find(b"\r\n\r\n")
        if end < 0 or self.due is None:
            return
        head = bytes(buf[:end]).lower()
        status = int(head[9:12])
        at = head.find(b"\r\ncontent-length:")
        if at < 0:
            if status in (204, 304) or status < 200:
                n = 0
            else:
                self.run.answered(self, NO_LENGTH, close=True)
                return
        else:
            stop = head.find(b"\r\n", at + 2)
            n = int(head[at + 17 : stop if stop >= 0 else len(head)])
        if len(buf) < end + 4 + n:
            return
        del buf[: end + 4 + n]
        self.run.answered(self, status, close=b"\r\nconnection: close" in head)

    def connection_lost(self, exc) -> None:
        self.run.lost(self, exc)


class _Run:
    """One client process's open loop (see :func:`run`)."""

    def __init__(self, url, reqs, images, rate, duration_s, timeout_s, connections):
        u = urlsplit(url)
        self.host, self.port = u.hostname, u.port or 80
        self.reqs, self.images, self.rate = reqs, images, rate
        self.duration_s, self.timeout_s, self.connections = duration_s, timeout_s, connections
        self.idle: deque[_Conn] = deque()
        self.busy: set[_Conn] = set()
        self.pending: deque[tuple[int, float]] = deque()  # (request index, due time), oldest first
        self.codes, self.lat, self.ok_images = Counter(), [], 0
        self.stopping = False
        self.t_end = float("inf")

    async def connect(self) -> None:
        loop = asyncio.get_running_loop()
        while not self.stopping:
            try:
                _, c = await loop.create_connection(lambda: _Conn(self), self.host, self.port)
            except OSError:
                await asyncio.sleep(0.05)  # (the server's backlog full: try again)
                continue
            self.free(c, time.perf_counter())
            return

    def free(self, c: _Conn, now: float) -> None:
        """``c`` takes the oldest queued request still within its time, or waits idle."""
        pending, t = self.pending, self.timeout_s
        while pending:
            i, due = pending.popleft()
            if due + t < now:
                self.codes[UNSENT] += 1
                continue
            c.send(self.reqs[i % len(self.reqs)], due)
            return
        self.idle.append(c)

    def answered(self, c: _Conn, status, close: bool) -> None:
        now, due = time.perf_counter(), c.due
        c.due = None
        self.busy.discard(c)
        self.codes[status] += 1
        if status == 200 and now <= self.t_end:  # (goodput: answered within the window)
            self.lat.append(now - due)
            self.ok_images += self.images
        if close:
            c.transport.close()  # (connection_lost opens another)
        else:
            self.free(c, now)

    def lost(self, c: _Conn, exc) -> None:
        if c.due is not None:  # (sent, unanswered: the server closed it)
            self.codes[type(exc).__name__ if exc else "ServerDisconnectedError"] += 1
            c.due = None
            self.busy.discard(c)
        try:
            self.idle.remove(c)
        except ValueError:
            pass
        if not self.stopping:
            asyncio.get_running_loop().create_task(self.connect())

    def sweep(self, now: float) -> None:
        """Queued requests past their time are never sent; sent ones unanswered past it time out (their
        connection is dropped and opened again)."""
        pending, t = self.pending, self.timeout_s
        while pending and pending[0][1] + t < now:
            pending.popleft()
            self.codes[UNSENT] += 1
        for c in [c for c in self.busy if now - c.t_sent > t]:
            self.codes["TimeoutError"] += 1
            c.due = None
            self.busy.discard(c)
            c.transport.abort()

    async def main(self) -> dict:
        for k in range(0, self.connections, CONNECT_AT_ONCE):
            await asyncio.gather(*(self.connect() for _ in range(min(CONNECT_AT_ONCE, self.connections - k))))
        n, rate = int(self.rate * self.duration_s), self.rate
        t0 = time.perf_counter()
        self.t_end, i, next_sweep = t0 + self.duration_s, 0, t0 + SWEEP_S
        while i < n:
            now = time.perf_counter()
            due_now = min(n, int((now - t0) * rate) + 1)
            while i < due_now:  # (every request due by now: on an idle connection, else queued)
                due = t0 + i / rate
                if self.idle:
                    self.idle.pop().send(self.reqs[i % len(self.reqs)], due)
                else:
                    self.pending.append((i, due))
                i += 1
            if now >= next_sweep:
                self.sweep(now)
                next_sweep = now + SWEEP_S
            await asyncio.sleep(TICK_S)
        sent_s = time.perf_counter() - t0
        while self.busy or self.pending:  # (the last answers, or their time running out)
            await asyncio.sleep(SWEEP_S)
            self.sweep(time.perf_counter())
        self.stopping = True
        for c in list(self.idle):
            c.transport.close()
        return {"codes": self.codes, "lat": self.lat, "images": self.ok_images, "sent_per_s": n / sent_s}


async def run(url, bodies, images, rate, duration_s, timeout_s, connections) -> dict:
    """``rate`` requests/s to ``url`` for ``duration_s`` over ``connections`` keep-alive connections,
    ``bodies`` ([(body, content-type)]) in turn, each request ``images`` images. A request waits at most
    ``timeout_s`` from its due time for a free connection (else it is never sent: :data:`UNSENT`), then
    at most ``timeout_s`` for the server's answer (else ``TimeoutError``); an answer's latency counts
    from its due time. Returns ``codes`` (a Counter of statuses), ``lat`` (seconds, of the 200s
    answered within the window), ``images`` (images answered 200 within it) and ``sent_per_s``."""
    reqs = [request_bytes(url, body, ctype) for body, ctype in bodies]
    return await _Run(url, reqs, images, rate, duration_s, timeout_s, connections).main()
