"""The multi-process server (``serve --http-workers N``): HTTP worker processes in front of one engine
process, on 127.0.0.1, driven from client processes."""

import json
import os
import re
import signal
import subprocess
import sys
import threading
import time

import httpx
import pytest
from conftest import keep_alive_statuses, post_chunked
from procs import alive, children
from test_serve import abandon

import fullthrottle
from fullthrottle.server.front import PROBE_EVERY_S

CLIENT = r"""
import json, sys, httpx
url, paths = sys.argv[1], sys.argv[2:]
out = []
with httpx.Client(timeout=60) as c:
    for p in paths:
        r = c.post(url + "/v1/classify", content=open(p, "rb").read(), headers={"content-type": "image/jpeg"})
        out.append([p, r.status_code, r.json()])
print(json.dumps(out))
"""


def start(*args, timeout=120, headers=None, device="cpu", stdout=None, ready=True):
    """``fullthrottle serve ARGS`` on a free port: (process, URL, its log lines so far and to come),
    once /readyz says 200 (``ready``), or once its HTTP workers listen."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "fullthrottle.cli", "serve", "--device", device, "--port", "0", *args],
        stdout=stdout,
        stderr=subprocess.PIPE,
        text=True,
        env=dict(os.environ, PYTHONUNBUFFERED="1"),
    )
    url, deadline, lines = None, time.time() + timeout, []
    while url is None and time.time() < deadline and proc.poll() is None:
        line = proc.stderr.readline()
        lines.append(line)
        m = re.search(r"running on (http://127\.0\.0\.1:\d+)", line)  # (one process, or N HTTP workers)
        url = m.group(1) if m else None
    assert url, "".join(lines)
    log: list[str] = []
    threading.Thread(target=lambda: log.extend(proc.stderr), daemon=True).start()
    if not ready:
        return proc, url, log
    deadline = time.time() + timeout
    while time.time() < deadline:
        try:
            if httpx.get(url + "/readyz", headers=headers, timeout=5).status_code == 200:
                return proc, url, log
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    proc.kill()
    raise AssertionError("not ready: " + "".join(log)[-2000:])


def from_client_processes(url: str, photos: list, n: int = 4) -> list:
    """Each photo posted to ``url`` from one of ``n`` client processes: ``[path, status, body]`` each."""
    clients = [
        subprocess.Popen([sys.executable, "-c", CLIENT, url, *map(str, photos[k::n])], stdout=subprocess.PIPE)
        for k in range(n)
    ]
    got = [row for c in clients for row in json.loads(c.communicate(timeout=120)[0])]
    assert len(got) == len(photos)
    return got


def fronts(pid: int) -> set[int]:
    """The HTTP worker processes of server ``pid``."""
    out = set()
    for c in children(pid):
        try:
            with open(f"/proc/{c}/cmdline", "rb") as f:
                if b"server.front" in f.read():
                    out.add(c)
        except OSError:
            pass
    return out


def stop(proc) -> int:
    proc.send_signal(signal.SIGTERM)
    return proc.wait(60)


@pytest.mark.parametrize("flag", [(), ("--access-log",)])
def test_a_line_per_request_is_logged_only_with_access_log(samples, flag):
    proc, url, log = start("--http-workers", "2", "--threads", "1", *flag, stdout=subprocess.PIPE)
    try:
        for _ in range(3):
            assert httpx.post(url + "/v1/classify", content=samples[0].read_bytes(), timeout=60).status_code == 200
    finally:
        code = stop(proc)
    said = proc.stdout.read() + "".join(log)  # (a few lines: the pipe never filled)
    assert code == 0 and said.count('"POST /v1/classify HTTP/1.1" 200') == (3 if flag else 0), said[-3000:]


def test_clients_in_processes_get_the_librarys_answers_and_metrics_count_every_worker(samples):
    photos = samples[:12]
    want = {str(p): r for p, r in zip(photos, fullthrottle.classify([p.read_bytes() for p in photos], device="cpu"))}
    proc, url, log = start("--http-workers", "3", "--preprocess", "processes", "--threads", "2")
    try:
        assert len(fronts(proc.pid)) == 3
        for w in fronts(proc.pid):  # an HTTP worker holds no model: torch is not even loaded there
            with open(f"/proc/{w}/maps") as f:
                assert "libtorch" not in f.read(), "an HTTP worker process loaded torch"
        got = from_client_processes(url, photos)
        for path, status, body in got:
            assert status == 200, body
            top = body["results"][0]["top_k"]
            ref = want[path]
            assert [t["class_id"] for t in top[:3]] == ref.class_ids[:3], path
            assert abs(top[0]["prob"] - ref.probs[0]) < 1e-3
        # a multi-image request with a broken image: that image's own error, the others answered
        files = [
            ("f", ("a.jpg", photos[0].read_bytes(), "image/jpeg")),
            ("f", ("broken.jpg", b"\xff\xd8\xff\xe0 not a jpeg", "image/jpeg")),
            ("f", ("b.jpg", photos[1].read_bytes(), "image/jpeg")),
        ]
        r = httpx.post(url + "/v1/classify", files=files, timeout=60)
        res = r.json()["results"]
        assert r.status_code == 200 and [x["id"] for x in res] == ["a.jpg", "broken.jpg", "b.jpg"]
        assert (
            "error" in res[1]
            and "top_k" not in res[1]
            and res[0]["top_k"][0]["class_id"] == want[str(photos[0])].class_ids[0]
        )
        r = httpx.post(url + "/v1/classify", json={"urls": ["http://10.0.0.1/a.jpg"]}, timeout=10)
        assert r.status_code == 400 and "fetches no URLs" in r.json()["detail"]  # (checked in the worker)
        for route in ("/healthz", "/readyz", "/metrics"):  # HEAD wherever GET is (RFC 9110), in a worker or not
            r = httpx.head(url + route, timeout=10)
            assert r.status_code == 200 and r.content == b"", (route, r.status_code)
        text = httpx.get(url + "/metrics", timeout=10).text
        served = re.search(r'fullthrottle_requests_total\{route="/v1/classify",status="200"\} (\S+)', text)
        assert served and float(served.group(1)) == len(photos) + 1, text[:3000]
        assert re.search(r'fullthrottle_batch_size_count\{workload="classify"\} (\S+)', text)  # the engine's
        assert "fullthrottle_queue_images" in text
        scrapes = re.search(r'fullthrottle_requests_total\{route="/metrics",status="200"\} (\S+)', text)
        assert scrapes and float(scrapes.group(1)) == 2, text[-3000:]  # (a HEAD, then this GET)
        r = httpx.post(url + "/v1/classify?top_k=2", files=files, timeout=60)  # (cut in the worker)
        assert [len(x.get("top_k", ())) for x in r.json()["results"]] == [2, 0, 2], r.text
        cut, whole = r.json()["results"][0]["top_k"], res[0]["top_k"][:2]  # (other batch mates: probs to 1e-4)
        assert [t["class_id"] for t in cut] == [t["class_id"] for t in whole]
        assert all(abs(a["prob"] - b["prob"]) < 1e-4 for a, b in zip(cut, whole)), (cut, whole)
    finally:
        code = stop(proc)
    assert code == 0, "".join(log)[-3000:]
    assert not [x for x in log if x.startswith("Traceback")], "".join(log)[-3000:]


@pytest.mark.gpu
def test_on_cuda_clients_in_processes_get_the_librarys_answers(samples):
    """The multi-process server with its CUDA defaults (GPU decoding, bf16 graphs): the same top-3 as
    the library with the same defaults, from four client processes, and a clean SIGTERM."""
    import torch

    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    photos = samples[:40]
    lib = fullthrottle.classify([p.read_bytes() for p in photos], device="cuda", model="resnet18")
    want = {str(p): r for p, r in zip(photos, lib)}
    proc, url, log = start("--http-workers", "4", "--model", "resnet18", device="cuda", timeout=300)
    try:
        got = from_client_processes(url, photos)
        for path, status, body in got:
            assert status == 200, body
            top = body["results"][0]["top_k"]
            assert top[0]["class_id"] == want[path].class_ids[0], path
            assert abs(top[0]["prob"] - want[path].probs[0]) < 2e-2, path
    finally:
        code = stop(proc)
    assert code == 0, "".join(log)[-3000:]
    assert not [x for x in log if x.startswith("Traceback")], "".join(log)[-3000:]


def test_sigterm_answers_requests_in_flight_and_leaves_no_process(samples):
    photo = samples[0].read_bytes()
    proc, url, log = start("--http-workers", "2", "--preprocess", "processes", "--threads", "2")
    kids = children(proc.pid)
    assert len(kids) >= 4  # 2 HTTP workers, 2 decoder processes
    outcomes, halt = [], threading.Event()

    def client():
        with httpx.Client(timeout=60, headers={"connection": "close"}) as c:
            while not halt.is_set():
                try:
                    outcomes.append(c.post(url + "/v1/classify", content=photo).status_code)
                except httpx.ConnectError:
                    outcomes.append("refused")  # (not accepted: the server had stopped listening)
                    return
                except httpx.HTTPError as e:
                    outcomes.append(f"lost: {e!r}")

    threads = [threading.Thread(target=client) for _ in range(6)]
    for t in threads:
        t.start()
    time.sleep(3)
    # (no new request once SIGTERM is on its way: a connection that reaches the listen backlog as
    # the server closes it is reset by the kernel, never accepted; each request in flight is answered)
    halt.set()
    try:
        code = stop(proc)
    finally:
        for t in threads:
            t.join(60)
    assert code == 0, "".join(log)[-3000:]
    assert outcomes.count(200) >= 6 and not [o for o in outcomes if o not in (200, "refused")], outcomes
    time.sleep(0.5)
    assert not [k for k in kids if alive(k)], "processes left behind"


@pytest.mark.parametrize("workers", ["1", "2"])
def test_sigterm_cuts_off_a_request_body_that_stopped_coming(samples, workers):
    """At SIGTERM a request whose body stopped coming gets 408 within DRAIN_BODY_IDLE_S and the
    server exits (it waited out the whole --body-timeout-s: 30 s here), while a body still trickling
    in is received whole and answered, and an idle connection is closed."""
    import socket
    from urllib.parse import urlsplit

    from fullthrottle.server.guard import DRAIN_BODY_IDLE_S

    photo = samples[0].read_bytes()
    proc, url, log = start("--http-workers", workers, "--body-timeout-s", "30")
    addr = (urlsplit(url).hostname, urlsplit(url).port)

    def head(n: int) -> bytes:
        return (
            f"POST /v1/classify HTTP/1.1\r\nHost: x\r\nContent-Type: image/jpeg\r\nContent-Length: {n}\r\n\r\n".encode()
        )

    def answer(s) -> bytes:
        got = b""
        while chunk := s.recv(65536):
            got += chunk
        return got

    idle = socket.create_connection(addr, timeout=60)
    stalled = socket.create_connection(addr, timeout=60)
    stalled.sendall(head(100_000) + b"ab")  # ... and no more
    trickle = socket.create_connection(addr, timeout=60)
    trickle.sendall(head(len(photo)) + photo[:100])
    pieces = [photo[i : i + len(photo) // 15 + 1] for i in range(100, len(photo), len(photo) // 15 + 1)]
    got: dict = {}

    def send_slowly():  # a piece every 0.2 s for 3 s: its body keeps coming during the drain
        for p in pieces:
            time.sleep(0.2)
            trickle.sendall(p)
        got["trickle"] = answer(trickle)

    sender = threading.Thread(target=send_slowly)
    try:
        time.sleep(0.5)  # (the requests' heads reach the server)
        sender.start()
        t0 = time.time()
        proc.send_signal(signal.SIGTERM)
        got["stalled"] = answer(stalled)
        stalled_s = time.time() - t0
        sender.join(30)
        assert idle.recv(1) == b""
        code = proc.wait(60)
        exit_s = time.time() - t0
    finally:
        if proc.poll() is None:
            proc.kill()
        for s in (idle, stalled, trickle):
            s.close()
    assert code == 0, "".join(log)[-3000:]
    assert got["stalled"].startswith(b"HTTP/1.1 408") and b"connection: close" in got["stalled"].lower(), got
    assert b"the request body stalled" in got["stalled"], got["stalled"]
    assert stalled_s < DRAIN_BODY_IDLE_S + 2, stalled_s
    assert got["trickle"].startswith(b"HTTP/1.1 200"), got["trickle"][:300]
    assert exit_s < 20, exit_s  # (the trickle takes 3 s; the stalled body held it 30 s; 11.7 on a busy CI machine)


def test_a_killed_http_worker_is_replaced_and_a_full_queue_says_503(samples):
    photos = [p.read_bytes() for p in samples[:8]]
    proc, url, log = start("--http-workers", "2", "--max-queue", "4", "--threads", "1", "--max-batch-size", "1")
    try:
        first = fronts(proc.pid)
        victim = sorted(first)[0]
        os.kill(victim, signal.SIGKILL)
        deadline, now = time.time() + 30, first
        while time.time() < deadline and not (len(now) == 2 and victim not in now):
            time.sleep(0.1)
            now = fronts(proc.pid)  # (one look per round: two could see the victim alive, then gone)
        assert len(now) == 2 and victim not in now, (first, now)
        assert any("ended (killed by signal SIGKILL): starting another" in x for x in log), "".join(log)[-2000:]
        time.sleep(1.5)  # (the new worker imports its libraries)
        for p in photos[:3]:
            assert httpx.post(url + "/v1/classify", content=p, timeout=60).status_code == 200
        # many 4-image requests at once: beyond a queue of 4 images, 503 with Retry-After
        files = [("f", (f"{i}.jpg", photos[i], "image/jpeg")) for i in range(4)]
        got = []

        def one():
            r = httpx.post(url + "/v1/classify", files=files, timeout=60)
            got.append((r.status_code, r.headers.get("retry-after"), r.json().get("detail", "")))

        ts = [threading.Thread(target=one) for _ in range(12)]
        for t in ts:
            t.start()
        for t in ts:
            t.join(90)
        statuses = [g[0] for g in got]
        assert 200 in statuses and 503 in statuses, got
        assert all(g[1] == "1" and "overloaded" in g[2] for g in got if g[0] == 503), got
        assert set(statuses) <= {200, 503}, got
    finally:
        code = stop(proc)
    assert code == 0, "".join(log)[-3000:]


def test_a_stopped_engine_gets_answers_from_the_workers_in_time():
    """/readyz says 503 within seconds, /metrics answers, a passed-on request gets 504 at its
    deadline; all is well again once the engine runs."""
    proc, url, log = start("--http-workers", "2", "--threads", "1", "--timeout-s", "1")
    try:
        os.kill(proc.pid, signal.SIGSTOP)
        try:
            t0 = time.perf_counter()
            r = httpx.get(url + "/readyz", timeout=10)
            assert r.status_code == 503 and "did not answer" in r.json()["detail"], r.text
            assert time.perf_counter() - t0 < 4
            t0 = time.perf_counter()
            assert httpx.get(url + "/metrics", timeout=10).status_code == 200  # (the workers' counters)
            assert time.perf_counter() - t0 < 4
            t0 = time.perf_counter()
            r = httpx.post(url + "/v1/not-a-route", content=b"{}", timeout=10)
            assert r.status_code == 504 and time.perf_counter() - t0 < 5, r.text
        finally:
            os.kill(proc.pid, signal.SIGCONT)
        assert httpx.get(url + "/readyz", timeout=10).status_code == 200
        assert httpx.post(url + "/v1/not-a-route", content=b"{}", timeout=10).status_code == 404
        text = httpx.get(url + "/metrics", timeout=10).text
        assert 'fullthrottle_requests_total{route="other",status="504"} 1.0' in text, text[-3000:]
        # the request the worker answered 504 was dropped by the engine, not run once it could
        assert 'fullthrottle_requests_total{route="other",status="404"} 1.0' in text, text[-3000:]
    finally:
        code = stop(proc)
    assert code == 0, "".join(log)[-3000:]


def test_the_workers_link_reads_and_writes_what_a_connection_does():
    """The worker's end of a link (an asyncio transport) speaks ``Connection``'s message format."""
    import socket
    import struct
    from multiprocessing.connection import Connection

    from fullthrottle.server import link as wire

    a, b = socket.socketpair()
    sender, msgs = Connection(a.detach()), [b"", b"x", bytes(range(256)) * 300, b"y" * 70000]
    for m in msgs:
        sender.send_bytes(m)
    sender.close()
    stream = b""
    while chunk := b.recv(1 << 20):
        stream += chunk
    b.close()
    assert stream == b"".join(wire.message_header(len(m)) + m for m in msgs)
    reader, got = wire.MessageReader(), []
    for k in range(0, len(stream), 977):  # in pieces that cut prefixes and messages
        got += reader.feed(stream[k : k + 977])
    assert got == msgs and not reader.buf
    long_form = struct.pack("!i", -1) + struct.pack("!Q", 3) + b"abc"  # (how a message over 2 GiB starts)
    assert wire.MessageReader().feed(long_form[:7]) == [] and wire.MessageReader().feed(long_form) == [b"abc"]
    assert wire.message_header(1 << 31) == long_form[:4] + struct.pack("!Q", 1 << 31)


def test_the_engines_link_reader_cuts_a_stream_into_its_messages():
    """The engine's end (a blocking socket, :class:`SocketReader`) gets every message whole, whatever
    the pieces the stream arrives in: many in one read, one over several, one larger than its buffer,
    the 64-bit length form; then EOFError."""
    import socket
    import struct
    import threading
    import time

    from fullthrottle.server import link as wire

    msgs = [b"", b"x", bytes(range(256)) * 300, b"y" * 70000, b"z" * 5000] * 3
    stream = b"".join(wire.message_header(len(m)) + m for m in msgs)
    stream += struct.pack("!i", -1) + struct.pack("!Q", 3) + b"abc"  # (how a message over 2 GiB starts)
    msgs.append(b"abc")
    a, b = socket.socketpair()

    def send():  # in pieces that cut prefixes and messages, with pauses: the reader waits for the rest
        for k in range(0, len(stream), 30011):
            a.sendall(stream[k : k + 30011])
            time.sleep(0.002)
        a.close()

    t = threading.Thread(target=send)
    t.start()
    reader, got, reads = wire.SocketReader(b, size=4096), [], 0
    with pytest.raises(EOFError):
        while True:
            views = reader.read()
            assert views and all(isinstance(v, memoryview) for v in views)
            got += [bytes(v) for v in views]
            reads += 1
    t.join()
    b.close()
    assert got == msgs and reads < len(msgs)  # (some reads gave several messages)


def test_result_rows_cross_the_link_exactly():
    """A classify answer crosses the link as binary numbers and JSON strings, and comes out as the
    rows the worker answers from, every value equal (probabilities to the last bit)."""
    from fullthrottle.server import link as wire
    from fullthrottle.workloads.classify.result import Result

    ok = Result(
        0, "cat \u00e9\n.jpg", ["tabby, tabby cat", 'say "hi"'], [281, 9], [0.7317346334457397, 1e-9], None, 12.5
    )
    bad = Result(1, "broken.jpg", error="broken.jpg: not an image (cannot identify it)", latency_ms=0.25)
    payload = b"".join(wire.results_payload([wire.pack_result(ok), wire.pack_result(bad)]))
    assert wire.unpack_results(payload) == {
        "results": [
            ["cat \u00e9\n.jpg", ["tabby, tabby cat", 'say "hi"'], [281, 9], [0.7317346334457397, 1e-9], None, 12.5],
            ["broken.jpg", [], [], [], "broken.jpg: not an image (cannot identify it)", 0.25],
        ]
    }
    assert wire.unpack_results(wire.error_payload("queue full", True)) == {"error": "queue full", "overloaded": True}
    for broken in (b"", b"\x07", payload[:-3], payload[:20]):
        with pytest.raises(ValueError):
            wire.unpack_results(broken)


def test_the_engines_link_reader_hands_out_views_that_stay_valid_while_held():
    """The engine's reader writes no byte of its buffers while a view of it is held: a view it
    handed out (an image on its way through the pipeline) keeps its bytes through every later read,
    across buffer changes and a message larger than the buffer; buffers whose views are gone are
    used again."""
    import socket
    import threading
    import weakref

    from fullthrottle.server import link as wire

    msgs = [bytes([i % 251]) * (70000 + 13 * i) for i in range(150)] + [b"q" * (3 << 20), b"ok"]
    a, b = socket.socketpair()
    t = threading.Thread(target=lambda: (a.sendall(b"".join(wire.message_header(len(m)) + m for m in msgs)), a.close()))
    t.start()
    reader, held = wire.SocketReader(b, size=1 << 20), []  # (~13 MiB through 1 MiB buffers)
    with pytest.raises(EOFError):
        while True:
            held += reader.read()
    t.join()
    b.close()
    assert [bytes(v) for v in held] == msgs

    # views let go as they come: the same few buffers go round (no fresh mapping, zeroed, per fill)
    a, b = socket.socketpair()
    t = threading.Thread(target=lambda: (a.sendall(b"".join(wire.message_header(len(m)) + m for m in msgs)), a.close()))
    t.start()
    reader, maps, got = wire.SocketReader(b, size=1 << 20), [], []  # (weak: a held map is never free)
    with pytest.raises(EOFError):
        while True:
            got += [bytes(v) for v in reader.read()]
            if not any(m() is reader._map for m in maps):
                maps.append(weakref.ref(reader._map))
    t.join()
    b.close()
    assert got == msgs and len(maps) <= wire.SocketReader.SPARES + 2  # (+1: the 3 MiB message's own)


def test_an_engine_that_does_not_read_stalls_only_the_requests_sent_to_it():
    """The bodies a stopped engine does not read wait in the worker's link, not in its event loop:
    the worker goes on answering what it answers itself."""
    proc, url, log = start("--http-workers", "2", "--threads", "1")
    sent = []
    try:
        os.kill(proc.pid, signal.SIGSTOP)  # (the engine process: it reads no link)
        try:

            def big():  # passed on whole to the engine: 4 MiB each, far past a socket's buffer
                try:
                    sent.append(httpx.post(url + "/v1/not-a-route", content=b"x" * (4 << 20), timeout=60).status_code)
                except httpx.HTTPError as e:
                    sent.append(repr(e))

            ts = [threading.Thread(target=big, daemon=True) for _ in range(6)]
            for t in ts:
                t.start()
            time.sleep(1.5)  # (every worker has taken bodies in and sent them towards the engine)
            assert not sent, sent
            for _ in range(6):  # new connections, on either worker
                t0 = time.perf_counter()
                assert httpx.get(url + "/healthz", timeout=10).status_code == 200
                assert time.perf_counter() - t0 < 2
        finally:
            os.kill(proc.pid, signal.SIGCONT)
        for t in ts:
            t.join(60)
        assert sent == [404] * 6, sent  # (the engine answers them once it runs again)
    finally:
        code = stop(proc)
    assert code == 0, "".join(log)[-3000:]


SLOW_MODEL = """
import os, time, torch
class Slow(torch.nn.Module):  # 0.05 s an image; appends a line per image to $SLOW_LOG
    labels = ["a", "b"]
    def forward(self, x):
        with open(os.environ["SLOW_LOG"], "a") as f:
            f.write("x\\n" * x.shape[0])
        time.sleep(0.05 * x.shape[0])
        return torch.zeros(x.shape[0], 2)
"""


def test_the_requests_a_killed_http_worker_held_are_counted_499(samples, tmp_path, monkeypatch):
    """Workers killed with requests in the engine take their answers with them: the engine counts
    them, as a worker counts its client leaving."""
    (tmp_path / "slowmod.py").write_text(SLOW_MODEL)
    (tmp_path / "seen.txt").write_text("")
    monkeypatch.setenv("PYTHONPATH", f"{tmp_path}{os.pathsep}{os.environ.get('PYTHONPATH', '')}")
    monkeypatch.setenv("SLOW_LOG", str(tmp_path / "seen.txt"))
    files = [("f", (f"{i}.jpg", samples[i].read_bytes(), "image/jpeg")) for i in range(40)]
    proc, url, log = start("--http-workers", "2", "--model", "slowmod:Slow", "--max-batch-size", "2", "--threads", "1")
    try:
        victims = fronts(proc.pid)
        ts = [
            threading.Thread(target=lambda: _quietly(httpx.post, url + "/v1/classify", files=files, timeout=60))
            for _ in range(3)
        ]
        for t in ts:
            t.start()
        time.sleep(1.0)  # (the 3 requests are in the engine: 120 images at 0.05 s each)
        for pid in victims:  # (both: whichever holds the requests)
            os.kill(pid, signal.SIGKILL)
        for t in ts:
            t.join(60)
        deadline, text = time.time() + 30, ""
        while time.time() < deadline and 'route="/v1/classify",status="499"' not in text:
            time.sleep(0.3)
            text = _quietly(lambda: httpx.get(url + "/metrics", timeout=10).text) or ""
        assert 'fullthrottle_requests_total{route="/v1/classify",status="499"} 3.0' in text, text[-3000:]
    finally:
        code = stop(proc)
    assert code == 0, "".join(log)[-3000:]


def _quietly(f, *args, **kwargs):
    """``f(...)``, or None where it raises an HTTP error (a connection its server's worker dropped)."""
    try:
        return f(*args, **kwargs)
    except httpx.HTTPError:
        return None


def test_a_client_that_hangs_up_takes_its_queued_images_with_it_across_processes(samples, tmp_path, monkeypatch):
    (tmp_path / "slowmod.py").write_text(SLOW_MODEL)
    log_file = tmp_path / "seen.txt"
    log_file.write_text("")
    monkeypatch.setenv("PYTHONPATH", f"{tmp_path}{os.pathsep}{os.environ.get('PYTHONPATH', '')}")
    monkeypatch.setenv("SLOW_LOG", str(log_file))
    files = [("f", (f"{i}.jpg", samples[i].read_bytes(), "image/jpeg")) for i in range(30)]
    proc, url, log = start("--http-workers", "2", "--model", "slowmod:Slow", "--max-batch-size", "2", "--threads", "1")
    try:
        warm = len(log_file.read_text())  # (the images of the model's warm-up)
        abandon(4, url + "/v1/classify", 1.0, files=files)
        r = httpx.post(url + "/v1/classify", content=samples[0].read_bytes(), timeout=60)
        assert r.status_code == 200, r.text
        seen = (len(log_file.read_text()) - warm) // 2
        assert seen <= 60, seen  # of the 121 images: those in the pipeline when their clients left, and one
        text = httpx.get(url + "/metrics", timeout=10).text
        assert 'fullthrottle_requests_total{route="/v1/classify",status="499"} 4.0' in text, text[-3000:]
    finally:
        code = stop(proc)
    assert code == 0, "".join(log)[-3000:]


GATED_MODEL = """
import os, time, torch
class Gated(torch.nn.Module):  # holds every batch while the file $GATE exists
    labels = ["a", "b"]
    def forward(self, x):
        while os.path.exists(os.environ["GATE"]):
            time.sleep(0.01)
        return torch.zeros(x.shape[0], 2)
"""


def test_while_the_engine_loads_the_workers_answer_503_with_retry_after(samples, tmp_path, monkeypatch):
    """The HTTP workers take requests while the engine process still loads (here: its model's
    warm-up held): classification and completions answer 503 with Retry-After (not 404 "not
    enabled"), as /readyz says; once loaded, 200."""
    (tmp_path / "gatedmod.py").write_text(GATED_MODEL)
    gate = tmp_path / "gate"
    gate.write_text("")
    monkeypatch.setenv("PYTHONPATH", f"{tmp_path}{os.pathsep}{os.environ.get('PYTHONPATH', '')}")
    monkeypatch.setenv("GATE", str(gate))
    args = ("--http-workers", "2", "--model", "gatedmod:Gated", "--threads", "1", "--llm-random", "tiny")
    proc, url, log = start(*args, ready=False)
    photo, body = samples[0].read_bytes(), {"prompt": [1, 2], "max_tokens": 2}
    try:
        assert httpx.get(url + "/readyz", timeout=10).status_code == 503
        for r in (
            httpx.post(url + "/v1/classify", content=photo, timeout=30),
            httpx.post(url + "/v1/completions", json=body, timeout=30),
        ):
            assert (r.status_code, r.headers.get("retry-after")) == (503, "1"), (r.request.url, r.text)
            assert "loading" in r.text
        gate.unlink()
        deadline = time.time() + 60
        while time.time() < deadline and httpx.get(url + "/readyz", timeout=10).status_code != 200:
            time.sleep(0.1)
        assert httpx.post(url + "/v1/classify", content=photo, timeout=30).status_code == 200
        assert httpx.post(url + "/v1/completions", json=body, timeout=30).status_code == 200
    finally:
        gate.unlink(missing_ok=True)
        code = stop(proc)
    assert code == 0, "".join(log)[-3000:]


def test_workers_refuse_what_a_full_queue_cannot_take_without_asking_the_engine(samples, tmp_path, monkeypatch):
    """With the engine's queue full, a worker answers 503 itself, at once, even while the engine
    process is stopped (only one request per ``PROBE_EVERY_S`` per worker still goes to it); once the
    queue drains, requests are taken again."""
    (tmp_path / "gatedmod.py").write_text(GATED_MODEL)
    gate = tmp_path / "gate"
    monkeypatch.setenv("PYTHONPATH", f"{tmp_path}{os.pathsep}{os.environ.get('PYTHONPATH', '')}")
    monkeypatch.setenv("GATE", str(gate))
    photo = samples[0].read_bytes()
    args = ("--http-workers", "2", "--model", "gatedmod:Gated", "--max-queue", "4", "--threads", "1")
    proc, url, log = start(*args, "--max-batch-size", "1")
    held, quick = [], []

    sent = []  # when each request started

    def post(out, timeout):
        t0 = time.perf_counter()
        sent.append(t0)
        try:
            r = httpx.post(url + "/v1/classify", content=photo, timeout=timeout)
            out.append((r.status_code, time.perf_counter() - t0, r.headers.get("retry-after")))
        except httpx.HTTPError as e:
            out.append((repr(e), time.perf_counter() - t0, None))

    try:
        gate.write_text("")  # the model holds its batch: the pipeline fills, then the queue
        ts = [threading.Thread(target=post, args=(held, 120), daemon=True) for _ in range(40)]
        for t in ts:
            t.start()
        deadline = time.time() + 30
        while time.time() < deadline and not any(h[0] == 503 for h in held):
            time.sleep(0.05)
        assert any(h[0] == 503 for h in held), held  # (the queue is full)
        time.sleep(0.3)  # (past each worker's probe interval)
        os.kill(proc.pid, signal.SIGSTOP)  # the engine process: it reads no link now
        sent.clear()
        try:
            qs = [threading.Thread(target=post, args=(quick, 3), daemon=True) for _ in range(16)]
            for t in qs:
                t.start()
            for t in qs:
                t.join(10)
        finally:
            os.kill(proc.pid, signal.SIGCONT)
        fast = [q for q in quick if q[0] == 503 and q[1] < 1.5 and q[2] == "1"]
        # at most one probe per worker and PROBE_EVERY_S went to the stopped engine (the 16 requests
        # start within one such interval on an idle machine; on a busy one they spread over more, and
        # reach the workers later than they were sent, by different lags: a worker's interval may end
        # inside the span, one probe more each), and one more to spare
        windows = 1 + int((max(sent) - min(sent)) / PROBE_EVERY_S)
        assert len(fast) >= max(1, len(quick) - 2 * (windows + 1) - 1), (windows, quick)
        gate.unlink()  # the queue drains
        for t in ts:
            t.join(120)
        assert {h[0] for h in held} <= {200, 503}, held
        r = httpx.post(url + "/v1/classify", content=photo, timeout=60)
        assert r.status_code == 200, r.text
    finally:
        gate.unlink(missing_ok=True)
        code = stop(proc)
    assert code == 0, "".join(log)[-3000:]


def test_the_engines_backlog_is_what_the_workers_read(tmp_path):
    """The depth the engine writes is what a worker process, given the fd, reads."""
    from fullthrottle.server.link import Backlog

    b = Backlog()
    b.set(137)
    out = subprocess.run(
        [
            sys.executable,
            "-c",
            "import sys; from fullthrottle.server.link import Backlog; print(Backlog(int(sys.argv[1])).get())",
            str(b.fd),
        ],
        pass_fds=(b.fd,),
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.stdout.strip() == "137", out.stderr
    b.set(0)
    assert b.get() == 0


def test_other_routes_pass_through_to_the_engine_and_stream():
    auth = {"authorization": "Bearer " + "k" * 20}
    proc, url, log = start(
        "--http-workers",
        "2",
        "--no-classify",
        "--llm-random",
        "tiny",
        "--api-key",
        "k" * 20,
        "--max-body-mb",
        "1",
        headers=auth,
    )
    try:
        assert httpx.get(url + "/readyz", timeout=10).status_code == 401  # keys checked in the worker
        assert httpx.get(url + "/readyz", headers=auth, timeout=10).json()["llm"] == "random-tiny"
        body = {"model": "random-tiny", "prompt": [1, 2, 3], "max_tokens": 8, "temperature": 0}
        whole = httpx.post(url + "/v1/completions", json=body, headers=auth, timeout=60)
        assert whole.status_code == 200 and whole.json()["usage"]["completion_tokens"] == 8, whole.text
        with httpx.stream("POST", url + "/v1/completions", json=body | {"stream": True}, headers=auth, timeout=60) as r:
            assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
            events = [line for line in r.iter_lines() if line.startswith("data: ")]
        assert events[-1] == "data: [DONE]" and len(events) >= 3
        streamed = [t for e in events[:-1] for t in json.loads(e[6:])["choices"][0]["token_ids"] or []]
        assert streamed == whole.json()["choices"][0]["token_ids"] and len(streamed) == 8
        bad = httpx.post(url + "/v1/completions", json=body | {"max_tokens": -1}, headers=auth, timeout=10)
        assert bad.status_code == 400 and "max_tokens" in bad.text
        assert httpx.post(url + "/v1/classify", content=b"x", headers=auth, timeout=10).status_code == 404
        nokey = httpx.post(url + "/v1/classify", content=b"x", timeout=10)  # (the worker's own route: keys too)
        assert nokey.status_code == 401 and nokey.headers["www-authenticate"] == "Bearer"
        assert httpx.get(url + "/v1/classify", headers=auth, timeout=10).status_code == 405
        # a passed-on route's chunked body over the limit (1 MiB here): one answer, 413, connection closed
        got = post_chunked(url, "/v1/completions", 1_100_000, "Authorization: Bearer " + "k" * 20 + "\r\n")
        head = got.split(b"\r\n\r\n", 1)[0].lower()
        assert head.startswith(b"http/1.1 413") and b"connection: close" in head and got.count(b"HTTP/1.1") == 1
        err = json.loads(got.split(b"\r\n\r\n", 1)[1])  # (as the engine's app answers: OpenAI's shape too)
        assert err["error"]["message"] == err["detail"] and err["error"]["code"] == 413, err
        for _ in range(2):  # (the worker asks the engine for its gauges with the server's key: no 401 counted)
            metrics = httpx.get(url + "/metrics", headers=auth, timeout=10).text
        assert "fullthrottle_requests_waiting" in metrics and 'route="/metrics",status="401"' not in metrics
    finally:
        code = stop(proc)
    assert code == 0, "".join(log)[-3000:]


@pytest.mark.parametrize("workers,signals", [("1", 1), ("2", 1), ("1", 2), ("2", 2)])
def test_sigterm_ends_the_streams_still_open_with_a_last_chunk_and_done(workers, signals):
    """Streams that would outlast the drain (``--timeout-s``) end a second before it runs out (at
    once at a second SIGTERM), each with a last chunk saying why and ``data: [DONE]``, also those
    still waiting for a row; exit 0."""
    import concurrent.futures as cf

    # A second SIGTERM must end the streams long before a drain of 20 s would (at 19 s).
    drain_s = 3 if signals == 1 else 20
    proc, url, log = start(
        "--http-workers",
        workers,
        "--no-classify",
        "--llm-random",
        "tiny",
        "--llm-max-batch",
        "2",
        "--timeout-s",
        str(drain_s),
    )
    body = {"prompt": [1, 2, 3], "max_tokens": 2000, "temperature": 0, "stream": True}
    started = threading.Semaphore(0)

    def stream():
        with httpx.stream("POST", url + "/v1/completions", json=body, timeout=60) as r:
            assert r.status_code == 200
            started.release()  # (the answer's head: the stream is the server's)
            return [line for line in r.iter_lines() if line.startswith("data: ")]

    try:
        with cf.ThreadPoolExecutor(3) as ex:  # 2 rows: the third stream waits for one
            futs = [ex.submit(stream) for _ in range(3)]
            for _ in futs:
                assert started.acquire(timeout=60)
            t0 = time.time()
            proc.send_signal(signal.SIGTERM)
            if signals == 2:
                time.sleep(0.2)
                proc.send_signal(signal.SIGTERM)
            got = [f.result(timeout=30) for f in futs]
            ended_s = time.time() - t0
        assert proc.wait(30) == 0, "".join(log)[-3000:]
        assert ended_s < (6 if signals == 1 else 10), ended_s
    finally:
        if proc.poll() is None:
            proc.kill()
    for events in got:
        assert events[-1] == "data: [DONE]", events[-3:]
        last = json.loads(events[-2][6:])
        assert last["choices"][0]["finish_reason"] == "error", last
        assert last["choices"][0]["text"] is None, last  # (no tokenizer: no text, as in its other chunks; was "")
        assert "the server is shutting down" in last["error"]["message"]


def test_http_workers_flag_is_checked_before_anything_loads(capsys):
    from fullthrottle.cli import main
    from fullthrottle.server.options import default_http_workers

    for bad, says in (("0", "must be >= 1"), ("abc", "--http-workers"), ("65", "at most 64")):
        with pytest.raises(SystemExit) as e:
            main(["serve", "--device", "cpu", "--http-workers", bad])
        assert e.value.code == 2 and says in capsys.readouterr().err, bad
    assert main(["serve", "--device", "cpu", "--ray", "--http-workers", "2"]) == 2
    assert "--http-workers is for the server without --ray" in capsys.readouterr().err
    assert [default_http_workers(c) for c in (2, 7, 8, 16, 64)] == [1, 1, 4, 8, 8]


def test_serve_defaults_are_its_own_where_a_server_needs_other_ones():
    """serve waits less for a batch than classify, and on CUDA with GPU decoding starts fewer CPU
    decoder processes (the rest of the cores serve HTTP); a value given is kept."""
    from fullthrottle.cli.parser import build_parser
    from fullthrottle.core.config import Config
    from fullthrottle.server.options import SERVE_DECODER_PROCESSES, SERVE_MAX_WAIT_MS, serve_threads

    p = build_parser()
    assert p.parse_args(["serve"]).max_wait_ms == SERVE_MAX_WAIT_MS < Config.max_wait_ms
    assert p.parse_args(["classify", "x"]).max_wait_ms == Config.max_wait_ms
    assert p.parse_args(["serve", "--max-wait-ms", "3"]).max_wait_ms == 3
    assert serve_threads(None, "cuda", True, "auto") == SERVE_DECODER_PROCESSES
    assert serve_threads(7, "cuda", True, "auto") == 7
    assert serve_threads(None, "cuda", False, "auto") is None
    assert serve_threads(None, "cuda", True, "threads") is None
    assert serve_threads(None, "cpu", True, "auto") is None


def test_max_connections_hold_per_http_worker():
    """--max-connections N with HTTP workers: N keep-alive connections are all served whichever
    worker accepts them (the workers share one socket and take uneven shares of the clients: an
    even split of N among them refused connections while others had room)."""
    import http.client

    proc, url, log = start("--http-workers", "2", "--no-classify", "--llm-random", "tiny", "--max-connections", "3")
    host, port = url.removeprefix("http://").split(":")
    conns = [http.client.HTTPConnection(host, int(port), timeout=10) for _ in range(3)]
    try:
        codes = keep_alive_statuses(conns)
        assert codes == [200, 200, 200], codes
    finally:
        for c in conns:
            c.close()
        code = stop(proc)
    assert code == 0, "".join(log)[-3000:]
