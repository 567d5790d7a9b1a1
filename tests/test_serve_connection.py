"""HTTP/1.1 pipelining through the server's connection protocol (server/connection.py): a pipelined
request's body is not read as a request head, nor timed by the next head's deadline; a connection
that pipelines past MAX_PIPELINED requests without reading its answers is closed; transfer codings, trailing
slashes and JSON bodies over their limit."""

import socket
import time

import pytest
from test_serve import Server, Tiny, post_image

from fullthrottle.server.connection import MAX_PIPELINED, head_deadline_protocol


def read_all(sock: socket.socket, idle_s: float = 2.0) -> tuple[bytes, bool]:
    """Everything the server sends until it is quiet for ``idle_s``; whether it closed the connection."""
    sock.settimeout(idle_s)
    got = b""
    try:
        while chunk := sock.recv(65536):
            got += chunk
        return got, True
    except TimeoutError:
        return got, False
    except OSError:
        return got, True


@pytest.mark.parametrize("parser", ["httptools", "h11"])
def test_a_pipelined_requests_body_is_neither_a_head_nor_under_the_heads_deadline(samples, parser):
    pytest.importorskip(parser)
    img = samples[0].read_bytes()
    assert len(img) > 20000  # (over the 16 KiB head limit)
    post = b"POST /v1/classify HTTP/1.1\r\nHost: x\r\nContent-Type: image/jpeg\r\nContent-Length: %d\r\n\r\n" % len(img)
    with Server(Tiny(), uvicorn_kw={"http": head_deadline_protocol(1.0, parser=parser)}) as srv:
        for pieces in (1, 4):  # the body at once after a pause, and trickled past the 1 s head deadline
            sock = socket.create_connection(("127.0.0.1", srv.port))
            sock.sendall(b"GET /healthz HTTP/1.1\r\nHost: x\r\n\r\n" + post)
            step = len(img) // pieces + 1
            for k in range(0, len(img), step):
                time.sleep(0.5)
                sock.sendall(img[k : k + step])
            got, _ = read_all(sock)
            sock.close()
            assert got.count(b"HTTP/1.1 200") == 2 and b"HTTP/1.1 400" not in got, (pieces, got[:300])
            assert b'"top_k"' in got or b'"results"' in got
        # a route that answers before reading a large body: the body that follows is no head either
        sock = socket.create_connection(("127.0.0.1", srv.port))
        sock.sendall(b"POST /nowhere HTTP/1.1\r\nHost: x\r\nContent-Length: %d\r\n\r\n" % len(img))
        time.sleep(0.3)
        sock.sendall(img)
        time.sleep(0.3)
        sock.sendall(b"GET /healthz HTTP/1.1\r\nHost: x\r\n\r\n")
        got, _ = read_all(sock)
        sock.close()
        assert got.startswith(b"HTTP/1.1 404") and b"HTTP/1.1 400" not in got, got[:300]


@pytest.mark.parametrize("parser", ["httptools", "h11"])
def test_a_request_before_bad_bytes_is_answered_then_the_400(samples, parser):
    """A whole request, then bytes that are no request, in one send: the request is answered (and
    counted 200, not as a client gone), then 400, then the connection closes. The server's log
    names the client and the parser's reason (uvicorn's own line names neither: it is left out)."""
    import logging

    import httpx

    pytest.importorskip(parser)
    img = samples[0].read_bytes()
    post = b"POST /v1/classify HTTP/1.1\r\nHost: x\r\nContent-Type: image/jpeg\r\nContent-Length: %d\r\n\r\n" % len(img)
    logged: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda r: logged.append(r.getMessage())
    try:
        with Server(Tiny(), uvicorn_kw={"http": head_deadline_protocol(5.0, parser=parser)}) as srv:
            logging.getLogger("uvicorn.error").addHandler(handler)  # (uvicorn's start set its handlers)
            sock = socket.create_connection(("127.0.0.1", srv.port))
            sock.sendall(post + img + b"garbage\r\n\r\n")
            got, closed = read_all(sock, 5.0)
            sock.close()
            metrics = httpx.get(f"http://127.0.0.1:{srv.port}/metrics").text
    finally:
        logging.getLogger("uvicorn.error").removeHandler(handler)
    assert got.startswith(b"HTTP/1.1 200") and b'"top_k"' in got, got[:300]
    assert got.count(b"HTTP/1.1 400") == 1 and got.index(b"HTTP/1.1 400") > got.index(b'"top_k"') and closed
    assert 'route="/v1/classify",status="200"} 1.0' in metrics and 'status="499"' not in metrics
    refused = [m for m in logged if "refused" in m or "Invalid HTTP" in m]
    assert len(refused) == 1, logged
    assert refused[0].startswith("refused a request from 127.0.0.1: 400 malformed HTTP request: "), refused


def test_bad_requests_in_a_loop_log_a_bounded_number_of_lines_and_say_how_many_were_left_out():
    """A client that sends bytes that are no request, again and again: each is answered 400 and
    counted, the log holds at most REFUSALS_LOGGED_PER_S lines a second, and the first line logged
    after that says how many were left out."""
    import logging

    from fullthrottle.server.connection import REFUSALS_LOGGED_PER_S

    logged: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda r: logged.append(r.getMessage())
    n = 3 * REFUSALS_LOGGED_PER_S
    counted: list[int] = []
    proto = head_deadline_protocol(5.0, parser="httptools", on_refused=counted.append)
    try:
        with Server(Tiny(), uvicorn_kw={"http": proto}) as srv:
            logging.getLogger("uvicorn.error").addHandler(handler)
            t0 = time.monotonic()
            for _ in range(n):
                sock = socket.create_connection(("127.0.0.1", srv.port))
                sock.sendall(b"garbage\r\n\r\n")
                got, _ = read_all(sock, 5.0)
                sock.close()
                assert got.startswith(b"HTTP/1.1 400"), got[:200]
            took = time.monotonic() - t0
            time.sleep(1.05)
            sock = socket.create_connection(("127.0.0.1", srv.port))
            sock.sendall(b"garbage\r\n\r\n")
            read_all(sock, 5.0)
            sock.close()
    finally:
        logging.getLogger("uvicorn.error").removeHandler(handler)
    assert counted == [400] * (n + 1)  # (every one counted, for /metrics)
    lines = [m for m in logged if m.startswith("refused a request")]
    if took < 1.0:  # (the loop within one window, as it is on any machine but a stalled one)
        assert len(lines) == REFUSALS_LOGGED_PER_S + 1, lines
        assert lines[-1].endswith(f" ({n - REFUSALS_LOGGED_PER_S} more refused before it, not logged)"), lines[-1]
    assert len(lines) <= REFUSALS_LOGGED_PER_S * (int(took) + 2), (took, lines)


def test_a_connection_pipelining_past_the_bound_without_reading_is_closed(samples):
    pytest.importorskip("httptools")
    one = b"GET /healthz HTTP/1.1\r\nHost: x\r\n\r\n"
    with Server(Tiny(), uvicorn_kw={"http": head_deadline_protocol(10.0, parser="httptools")}) as srv:
        sock = socket.create_connection(("127.0.0.1", srv.port))
        sock.sendall(one * 50)  # within the bound: every one answered, in order
        got, closed = read_all(sock, 1.0)
        assert got.count(b"HTTP/1.1 200") == 50 and not closed
        sock.sendall(one * (4 * MAX_PIPELINED))  # in one send, no answer read: closed
        got, closed = read_all(sock, 3.0)
        sock.close()
        assert closed and got.count(b"HTTP/1.1 200") <= MAX_PIPELINED + 2, got.count(b"HTTP/1.1 200")
        assert post_image(srv.url, samples[0].read_bytes()).status_code == 200  # others are served


def test_a_transfer_coding_but_chunked_is_501_and_a_trailing_slash_is_no_redirect(samples):
    gz = (
        b"POST /v1/classify HTTP/1.1\r\nHost: x\r\nContent-Type: image/jpeg\r\nTransfer-Encoding: gzip, chunked\r\n\r\n"
    )
    with Server(Tiny()) as srv:
        sock = socket.create_connection(("127.0.0.1", srv.port))
        sock.sendall(gz + b"5\r\nhello\r\n0\r\n\r\n")
        got, _ = read_all(sock, 1.0)
        sock.close()
        assert got.startswith(b"HTTP/1.1 501") and b"Transfer-Encoding gzip, chunked" in got, got[:300]
        sock = socket.create_connection(("127.0.0.1", srv.port))
        sock.sendall(b"GET /healthz/ HTTP/1.1\r\nHost: evil.example\r\n\r\n")
        got, _ = read_all(sock, 1.0)
        sock.close()
        assert got.startswith(b"HTTP/1.1 404") and b"evil.example" not in got, got[:300]


def test_a_json_body_of_urls_over_the_json_limit_is_413_unparsed():
    import httpx

    from fullthrottle.server.guard import MAX_JSON_BYTES

    body = b'{"urls": [' + b"1," * (MAX_JSON_BYTES // 2) + b"1]}"
    with Server(Tiny()) as srv:
        r = httpx.post(srv.url + "/v1/classify", content=body, headers={"content-type": "application/json"}, timeout=30)
        assert r.status_code == 413 and f"at most {MAX_JSON_BYTES}" in r.json()["detail"], r.text
        r = httpx.post(srv.url + "/v1/classify", json={"urls": 1}, timeout=30)
        assert r.status_code == 400 and "the body must be" in r.json()["detail"], r.text  # (a small one is read)


def test_bodies_past_what_a_process_may_receive_at_once_get_503_and_the_room_comes_back(samples):
    from fullthrottle.server.app import ServeOptions
    from fullthrottle.server.guard import BODIES_AT_ONCE

    limit, part = 100_000, 90_000
    head = b"POST /v1/classify HTTP/1.1\r\nHost: x\r\nContent-Type: image/jpeg\r\nContent-Length: %d\r\n\r\n" % limit
    with Server(Tiny(), ServeOptions(max_body_bytes=limit)) as srv:
        socks, answers = [], []
        for _ in range(BODIES_AT_ONCE + 8):  # each holds 90% of a body at the limit, and waits
            s = socket.create_connection(("127.0.0.1", srv.port))
            s.sendall(head + b"\0" * part)
            socks.append(s)
            time.sleep(0.05)
        time.sleep(0.5)
        for s in socks:
            got, _ = read_all(s, 0.05)
            answers.append(got)
        refused = [a for a in answers if a.startswith(b"HTTP/1.1 503")]
        assert 1 <= len(refused) <= 9 and all(b"retry-after: 1" in a.lower() for a in refused), answers[-3:]
        assert all(a == b"" for a in answers[: BODIES_AT_ONCE - 2]), answers[:3]  # (the first wait on)
        for s in socks:
            s.close()
        time.sleep(0.5)
        assert post_image(srv.url, samples[0].read_bytes()).status_code == 200  # the room came back


def _fresh_trim(monkeypatch, guard, period_s: float) -> list:
    """A heap-trim state of its own (earlier tests' bodies), ``period_s`` periods and a malloc_trim that
    only records when it ran."""
    trims = []
    monkeypatch.setattr(guard, "TRIM_AFTER_S", period_s)
    monkeypatch.setattr(guard, "malloc_trim", lambda: trims.append(time.perf_counter()))
    monkeypatch.setattr(guard, "_trim", {"bytes": 0, "armed": False, "at_check": 0, "busy": None, "work": False})
    return trims


def test_after_a_burst_of_bodies_the_one_process_server_trims_its_heap_once_quiet(samples, monkeypatch):
    """The one-process server (its pipeline in the process, whose memory is not counted in the bodies'
    bytes): even one body under TRIM_AFTER_BYTES ends in one malloc_trim once no body has come for a
    whole TRIM_AFTER_S and no image is left to answer, one to two periods after the last body; bodies
    still coming put it off."""
    from fullthrottle.server import guard

    trims = _fresh_trim(monkeypatch, guard, 0.8)
    monkeypatch.setattr(guard, "TRIM_AFTER_BYTES", 100_000)
    img = samples[0].read_bytes()
    with Server(Tiny()) as srv:
        assert len(img) < 100_000
        assert post_image(srv.url, img).status_code == 200
        first = time.perf_counter()
        time.sleep(2.5)  # (at most two periods of 0.8 s)
        assert len(trims) == 1 and trims[0] - first >= 0.5, (trims, first)
        for _ in range(8):  # a body every ~0.1 s: put off
            time.sleep(0.1)
            assert post_image(srv.url, img).status_code == 200
        last = time.perf_counter()
        assert len(trims) == 1
        time.sleep(2.5)
        assert len(trims) == 2 and trims[1] - last >= 0.5, (trims, last)
    assert guard._receiving[0] == 0


def test_a_trim_waits_for_the_requests_still_being_answered(monkeypatch):
    """As an HTTP worker (``set_busy(..., work=False)``): bodies under TRIM_AFTER_BYTES start nothing;
    past it, a period is quiet only once ``busy()`` says no request is left (each holds its body until
    the engine answers). As the engine (``work=True``: the pipeline's own memory), any frame starts the
    checks. Called from another thread, as the engine's link readers call it."""
    import asyncio
    import threading

    from fullthrottle.server import guard

    trims, work = _fresh_trim(monkeypatch, guard, 0.3), {"left": True}
    monkeypatch.setattr(guard, "TRIM_AFTER_BYTES", 10_000)
    loop = asyncio.new_event_loop()
    t = threading.Thread(target=loop.run_forever, daemon=True)
    t.start()
    try:
        guard.set_busy(lambda: work["left"], work=False)
        for _ in range(5):
            guard.trim_soon(1000, loop)
        time.sleep(1.0)
        assert trims == [] and not guard._trim["armed"]
        guard.trim_soon(6000, loop)  # (past the threshold)
        time.sleep(1.5)  # (bodies stopped 5 periods ago, but requests are still being answered)
        assert trims == []
        work["left"] = False
        done = time.perf_counter()
        time.sleep(1.0)  # (at most two periods of 0.3 s)
        assert len(trims) == 1 and 0 < trims[0] - done < 0.7, (trims, done)
        guard.set_busy(lambda: False, work=True)
        guard.trim_soon(100, loop)
        time.sleep(1.0)
        assert len(trims) == 2
    finally:
        loop.call_soon_threadsafe(loop.stop)
        t.join(5)
