"""The server facing untrusted clients: no SSRF, bounded downloads, API keys, slow clients, limits.

Every attempt runs against listeners of the test's own on loopback addresses; a refused URL must
never reach them."""

import contextlib
import http.server
import json
import logging
import re
import socket
import subprocess
import sys
import threading
import time

import httpx
import pytest
from conftest import keep_alive_statuses
from procs import alive, children
from test_serve import Server, Tiny, post_image

from fullthrottle.server.app import ServeOptions
from fullthrottle.server.fetch import FetchPolicy, FetchRefused, is_public, parse_ip


class Listener:
    """An HTTP server on ``host`` (ephemeral port) that records every request path. Paths:
    ``/a.jpg`` a sample photo, ``/redirect?to=URL`` a 302 to URL, ``/chain/N`` N redirects before
    ``/a.jpg``, ``/endless`` a body streamed without end (chunked), ``/trickle`` the photo a byte
    each 0.1 s."""

    def __init__(self, host: str, photo: bytes):
        self.paths: list[str] = []
        outer = self

        class H(http.server.BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *a):
                pass

            def do_GET(self):
                outer.paths.append(self.path)
                if self.path == "/a.jpg":
                    self.send_response(200)
                    self.send_header("Content-Length", str(len(photo)))
                    self.end_headers()
                    self.wfile.write(photo)
                elif self.path.startswith("/redirect?to="):
                    self.send_response(302)
                    self.send_header("Location", self.path.split("=", 1)[1])
                    self.send_header("Content-Length", "0")
                    self.end_headers()
                elif self.path.startswith("/chain/"):
                    n = int(self.path.rsplit("/", 1)[1])
                    self.send_response(302)
                    self.send_header("Location", f"/chain/{n - 1}" if n > 1 else "/a.jpg")
                    self.send_header("Content-Length", "0")
                    self.end_headers()
                elif self.path == "/gzip":  # 64 MiB of zeros in 64 KiB: a decompression bomb
                    import gzip

                    blob = gzip.compress(b"\0" * (64 << 20), 9)
                    self.send_response(200)
                    self.send_header("Content-Encoding", "gzip")
                    self.send_header("Content-Length", str(len(blob)))
                    self.end_headers()
                    self.wfile.write(blob)
                elif self.path == "/trickle":
                    self.send_response(200)
                    self.send_header("Content-Length", str(len(photo)))
                    self.end_headers()
                    try:
                        for k in range(len(photo)):
                            self.wfile.write(photo[k : k + 1])
                            self.wfile.flush()
                            time.sleep(0.1)
                    except OSError:
                        pass  # cut off by the client
                elif self.path == "/endless":
                    self.send_response(200)
                    self.send_header("Transfer-Encoding", "chunked")
                    self.end_headers()
                    block = b"\xff" * 65536
                    try:
                        for _ in range(2000):  # 128 MiB, far past any limit
                            self.wfile.write(b"%x\r\n%s\r\n" % (len(block), block))
                    except OSError:
                        pass  # cut off by the client, as it should be
                else:
                    self.send_response(404)
                    self.send_header("Content-Length", "0")
                    self.end_headers()

        self.srv = http.server.ThreadingHTTPServer((host, 0), H)
        self.srv.daemon_threads = True
        self.port = self.srv.server_address[1]
        self.base = f"http://{host}:{self.port}"
        threading.Thread(target=self.srv.serve_forever, daemon=True).start()

    def close(self):
        self.srv.shutdown()
        self.srv.server_close()


@pytest.fixture
def listeners(samples):
    photo = samples[0].read_bytes()
    a, b = Listener("127.0.0.2", photo), Listener("127.0.0.1", photo)  # a: admitted, b: never
    yield a, b
    a.close()
    b.close()


def rss_mib() -> float:
    """This process's resident memory now (MiB)."""
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmRSS:")) / 1024


def classify_urls(s, urls, **kw):
    return httpx.post(s.url + "/v1/classify", json={"urls": urls}, timeout=60, **kw)


def test_numeric_hosts_are_read_like_the_c_library():
    loop = [
        "127.0.0.1",
        "2130706433",
        "0x7f.0.0.1",
        "0177.0.0.1",
        "127.1",
        "0x7f000001",
        "017700000001",
        "[::ffff:127.0.0.1]",
        "::ffff:7f00:1",
    ]
    assert {str(parse_ip(h)) for h in loop} == {"127.0.0.1"}
    assert parse_ip("example.com") is None and parse_ip("0x7f.example.com") is None
    for h in [
        "127.0.0.1",
        "::1",
        "0.0.0.0",
        "169.254.169.254",
        "10.1.2.3",
        "192.168.0.1",
        "100.64.0.1",
        "224.0.0.1",
        "fe80::1",
        "fd00:ec2::254",
        "::",
    ]:
        assert not is_public(parse_ip(h)), h
    assert is_public(parse_ip("93.184.216.34"))
    for bad in ("http://x/", "999.1.1.1", "images.example.123"):  # (an all-digit last label: no name)
        with pytest.raises(ValueError, match="neither a host name"):
            FetchPolicy((bad,))


@pytest.mark.parametrize(
    "host",
    [
        "localhost",
        "127.0.0.1",
        "2130706433",
        "0x7f.0.0.1",
        "0177.0.0.1",
        "127.1",
        "[::1]",
        "[::ffff:127.0.0.1]",
        "0.0.0.0",
        "169.254.169.254",
        "10.0.0.1",
        "192.168.1.1",
    ],
)
def test_policy_refuses_internal_addresses_before_connecting(host):
    import asyncio

    pol = FetchPolicy(("images.example.com", "8.8.8.0/24"))
    with pytest.raises(FetchRefused, match="not admitted"):
        asyncio.run(pol.resolve(f"http://{host}:8080/x.jpg"))


def test_a_name_not_listed_is_refused_without_a_dns_lookup(monkeypatch):
    import asyncio

    looked_up = []  # (names of this test's URLs: threads other tests left may look up localhost meanwhile)
    local = ("localhost", "127.0.0.1", "::1")
    real = socket.getaddrinfo
    monkeypatch.setattr(
        socket, "getaddrinfo", lambda *a, **k: real(*a, **k) if a[0] in local else looked_up.append(a) or []
    )
    pol = FetchPolicy(("images.example.com", "10.0.0.0/8"))
    for host in ("unlisted.example.org", "images.example.com.evil.org", "internal"):
        with pytest.raises(FetchRefused, match="a name not listed"):
            asyncio.run(pol.resolve(f"http://{host}/x.jpg"))
    assert looked_up == []
    with pytest.raises(FetchRefused, match="not admitted"):  # a listed name is looked up (here: no answer)
        asyncio.run(pol.resolve("http://Images.Example.com./x.jpg"))
    assert [a[0] for a in looked_up] == ["images.example.com."]


def test_fetching_is_off_by_default(listeners):
    a, b = listeners
    with Server(Tiny()) as s:
        r = classify_urls(s, [a.base + "/a.jpg"])
        deep = httpx.post(
            s.url + "/v1/classify",
            content=b'{"urls": ' + b"[" * 100_000 + b"]" * 100_000 + b"}",
            headers={"content-type": "application/json"},
        )
        long_num, shape, top_k, extra = (
            httpx.post(s.url + "/v1/classify", content=c, headers={"content-type": "application/json"})
            for c in (
                b'{"urls": [' + b"7" * 5000 + b"]}",
                b'{"urls": "http://a/x.jpg"}',
                b'{"urls": [], "top_k": 1}',
                b'{"urls": [], "zeta": 1, "alpha": 2}',
            )
        )
    assert r.status_code == 400 and "--allow-fetch" in r.json()["detail"]
    assert deep.status_code == 400 and "malformed JSON body: nested too deep" in deep.json()["detail"]
    assert long_num.status_code == 400 and long_num.json()["detail"].startswith(
        "malformed JSON body: a number of more than 4300 digits;"
    ), long_num.text
    assert shape.status_code == 400 and shape.json()["detail"].startswith("wrong shape: the body must be")
    assert top_k.status_code == 400 and top_k.json()["detail"].startswith(
        "unknown field 'top_k' in the body (top_k is a query parameter: /v1/classify?top_k=N); the body must be"
    ), top_k.text
    assert extra.status_code == 400 and extra.json()["detail"].startswith("unknown field 'alpha' in the body;")
    assert a.paths == [] and b.paths == []


def test_ssrf_attempts_are_refused_and_never_reach_the_listener(listeners, caplog):
    a, b = listeners
    p = b.port
    attempts = [
        f"http://{h}:{p}/a.jpg"
        for h in (
            "localhost",
            "127.0.0.1",
            "2130706433",
            "0x7f.0.0.1",
            "0177.0.0.1",
            "127.1",
            "[::1]",
            "[::ffff:127.0.0.1]",
            "0.0.0.0",
        )
    ]
    attempts += [
        "http://169.254.169.254/latest/meta-data/",
        "http://10.0.0.1/a.jpg",
        f"{a.base}/redirect?to=http://127.0.0.1:{p}/a.jpg",  # admitted host, redirect to loopback
        f"{a.base}/redirect?to=http://2130706433:{p}/a.jpg",
        f"{a.base}/chain/4",  # a chain of 4 redirects (3 allowed)
        f"http://127.0.0.2%40127.0.0.1:{a.port}/a.jpg",  # a zone id riding into Host
        f"{a.base}/a\x00.jpg",
        f"{a.base}/" + "a" * 100_000,  # what httpx itself refuses
        f"http://127.0.0.2%C3%A9:{a.port}/a.jpg",
        'http://x.invalid/\nINFO:     6.6.6.6:1 - "GET /admin HTTP/1.1" 200 OK',  # a line forged for the log
    ]
    caplog.set_level(logging.WARNING, logger="fullthrottle.server.classify")
    with Server(Tiny(), ServeOptions(allow_fetch=("127.0.0.2",))) as s:
        r = classify_urls(s, attempts)
        seen = list(a.paths)
        ok = classify_urls(s, [f"{a.base}/a.jpg", f"{a.base}/chain/3"])
    assert r.status_code == 422
    errors = [x["error"] for x in r.json()["results"]]
    assert errors == [f"{u}: cannot fetch URL {i}" for i, u in enumerate(attempts)]  # and nothing more
    assert r.json()["detail"] == "; ".join(f"cannot fetch URL {i}" for i in range(len(attempts)))
    assert b.paths == []  # the loopback listener saw no request at all
    logged = [r.getMessage() for r in caplog.records if r.name == "fullthrottle.server.classify"]
    assert len(logged) == len(attempts) and not [m for m in logged if "\n" in m or "\r" in m]
    assert "/a.jpg" not in seen and seen.count("/chain/1") == 1  # the chain stopped before /a.jpg
    assert ok.status_code == 200 and all("top_k" in x for x in ok.json()["results"])


def test_a_url_streaming_past_the_limit_is_cut_and_memory_stays_flat(listeners):
    a, _ = listeners
    with Server(Tiny(), ServeOptions(allow_fetch=("127.0.0.2",), max_body_bytes=2 * 2**20)) as s:
        for _ in range(5):  # warm: the pipeline's buffers, the allocator's working set
            assert classify_urls(s, [a.base + "/endless", a.base + "/a.jpg"]).status_code == 200
        rss0 = rss_mib()
        for _ in range(20):  # 20 x 128 MiB offered
            r = classify_urls(s, [a.base + "/endless", a.base + "/a.jpg"])
            assert r.status_code == 200
            res = r.json()["results"]
            assert res[0]["error"].endswith("cannot fetch URL 0") and "top_k" in res[1]
        bomb = classify_urls(s, [a.base + "/gzip"])  # refused, never inflated
        assert bomb.status_code == 422 and bomb.json()["detail"] == "cannot fetch URL 0"
        grown = rss_mib() - rss0
    assert grown < 100, grown


def test_urls_still_fetched_at_the_requests_deadline_are_a_504(listeners):
    """--timeout-s bounds the whole request, its URLs' fetching included (each URL's own limit,
    --url-timeout-s, may be longer): a URL still arriving at the deadline is 504, not the URL's error
    at its own limit."""
    a, _ = listeners
    with Server(Tiny(), ServeOptions(allow_fetch=("127.0.0.2",), timeout_s=1.5, url_timeout_s=10.0)) as s:
        t0 = time.perf_counter()
        r = classify_urls(s, [a.base + "/trickle", a.base + "/a.jpg"])
        took = time.perf_counter() - t0
        ok = classify_urls(s, [a.base + "/a.jpg"])
    assert r.status_code == 504 and r.json()["detail"] == "deadline of 1.5 s exceeded", r.text
    assert 1.4 < took < 5, took
    assert ok.status_code == 200


def test_api_keys(samples):
    key = "k" * 24
    photo = samples[0].read_bytes()
    with Server(Tiny(), ServeOptions(api_keys=(key,))) as s:
        assert httpx.get(s.url + "/healthz").status_code == 200  # liveness needs no key
        for headers in ({}, {"Authorization": "Bearer wrong-key-of-some-length"}, {"Authorization": key}):
            r = httpx.post(s.url + "/v1/classify", content=photo, headers=headers)
            assert r.status_code == 401 and r.headers["www-authenticate"] == "Bearer"
        assert httpx.get(s.url + "/metrics").status_code == 401
        good = httpx.post(s.url + "/v1/classify", content=photo, headers={"Authorization": f"Bearer {key}"})
        assert good.status_code == 200
    from fullthrottle.server.keys import load_keys

    with pytest.raises(ValueError, match="shorter than 16"):
        load_keys(["short"], environ={})
    assert load_keys([key], environ={"FULLTHROTTLE_API_KEY": f"{'x' * 20},{key}"}) == (key, "x" * 20)
    assert load_keys([key], environ={"FULLTHROTTLE_API_KEY": ""}) == (key,)  # set empty: as unset


def test_a_key_file_or_key_variable_with_no_key_refuses_to_serve(tmp_path):
    """Keys asked for but none found (a blank file, a failed secret mount, ``,``): exit 2, never a
    server open to all."""
    from fullthrottle.server.keys import load_keys

    blank = tmp_path / "keys"
    blank.write_text("\n   \n# a comment\n")
    with pytest.raises(ValueError, match="holds no key"):
        load_keys((), str(blank), environ={})
    with pytest.raises(ValueError, match="FULLTHROTTLE_API_KEY is set but holds no key"):
        load_keys((), None, environ={"FULLTHROTTLE_API_KEY": " , "})
    blank.write_bytes(b"\xff\xfe not utf-8")
    with pytest.raises(ValueError, match="cannot read the API key file .*: not UTF-8"):
        load_keys((), str(blank), environ={})
    blank.write_bytes(b"\xef\xbb\xbfabcdefghijklmnop0123\r\n")  # (Notepad's UTF-8 with BOM, CRLF)
    assert load_keys((), str(blank), environ={}) == ("abcdefghijklmnop0123",)
    with pytest.raises(ValueError, match="API keys must be printable ASCII"):
        load_keys(["clé-secrète-très-longue"], environ={})
    blank.write_text("\n")
    cmd = [sys.executable, "-m", "fullthrottle.cli", "serve", "--device", "cpu", "--port", "0", "--api-key-file"]
    out = subprocess.run([*cmd, str(blank)], capture_output=True, text=True, timeout=120)
    assert out.returncode == 2 and "holds no key" in out.stderr, out.stderr[-500:]


def test_a_trickling_client_is_cut_off_while_others_are_served(samples):
    photo = samples[0].read_bytes()
    with Server(Tiny(), ServeOptions(body_timeout_s=1.0)) as s:
        host, port = s.url.removeprefix("http://").split(":")
        sock = socket.create_connection((host, int(port)))
        sock.sendall(
            b"POST /v1/classify HTTP/1.1\r\nHost: x\r\nContent-Type: image/jpeg\r\nContent-Length: 100000\r\n\r\n"
        )
        t0, answer = time.time(), b""
        sock.settimeout(0.2)
        served = None
        while time.time() - t0 < 10 and b"\r\n\r\n" not in answer:
            try:
                sock.sendall(b"x")
                answer += sock.recv(4096)
            except TimeoutError:
                pass
            except OSError:
                break
            if served is None:  # meanwhile another client is answered at once
                served = post_image(s.url, photo).status_code
        took = time.time() - t0
        sock.close()
    assert answer.startswith(b"HTTP/1.1 408"), answer[:200]
    assert took < 3 and served == 200


def test_limits_per_request(samples):
    photos = [p.read_bytes() for p in samples[:3]]
    files = [("f", (f"{i}.jpg", d, "image/jpeg")) for i, d in enumerate(photos)]
    with Server(Tiny(), ServeOptions(max_images=2, max_request_pixels=300_000)) as s:
        r = httpx.post(s.url + "/v1/classify", files=files)
        assert r.status_code == 413 and "at most 2" in r.json()["detail"]
        r = httpx.post(s.url + "/v1/classify", files=files * 3)  # (past the form parser's own file limit)
        assert r.status_code == 413 and "more than 2 images" in r.json()["detail"]
        r = httpx.post(s.url + "/v1/classify", files=files[:2])
        assert r.status_code == 413 and "megapixels together" in r.json()["detail"]
        assert post_image(s.url, photos[0]).status_code == 200
        # form fields are their own entries' errors, and no image of the limit
        r = httpx.post(s.url + "/v1/classify", files=files[:1], data={"a": "1", "b": "2"})
        assert r.status_code == 200, r.text
        got = {e["id"]: e for e in r.json()["results"]}
        assert sorted(got) == ["0.jpg", "a", "b"] and got["0.jpg"]["top_k"], r.text
        assert all("not a file part" in got[k]["error"] for k in "ab"), r.text


def test_serve_on_a_port_in_use_exits_2_before_loading_the_model():
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        t0 = time.time()
        out = subprocess.run(
            [sys.executable, "-m", "fullthrottle.cli", "serve", "--device", "cpu", "--port", str(port)],
            capture_output=True,
            text=True,
            timeout=120,
        )
    assert out.returncode == 2 and f"cannot listen on 127.0.0.1:{port}" in out.stderr, out.stderr[-500:]
    assert "in use" in out.stderr and time.time() - t0 < 30


@pytest.mark.parametrize("parser", ["httptools", "h11"])
def test_a_request_head_over_the_limit_is_refused_with_either_parser(samples, parser):
    """A head of a few hundred KiB (one endless header) gets 431 and a closed connection, with
    uvicorn's C parser as with h11, and bytes that are no HTTP request 400 with the parser's reason,
    both as JSON; a normal request on a new connection is then served."""
    pytest.importorskip(parser)
    from fullthrottle.server.connection import MAX_HEAD_BYTES, head_deadline_protocol

    with Server(Tiny(), uvicorn_kw={"http": head_deadline_protocol(30.0, parser=parser)}) as srv:
        sock = socket.create_connection(("127.0.0.1", srv.port))
        sock.settimeout(10)
        try:
            sock.sendall(b"GET /healthz HTTP/1.1\r\nHost: x\r\nX-Big: " + b"a" * (20 * MAX_HEAD_BYTES))
        except OSError:
            pass  # (closed while we were still sending: also a refusal)
        got = b""
        try:
            while chunk := sock.recv(65536):
                got += chunk
        except OSError:
            pass
        sock.close()
        assert got.startswith(b"HTTP/1.1 431 Request Header Fields Too Large"), got[:200]
        assert b"request head" in got and json.loads(got.split(b"\r\n\r\n", 1)[1])["detail"], got[:400]
        whole = (b"X-Big: " + b"a" * 17000 + b"\r\n", b"".join(b"X-%d: %s\r\n" % (i, b"b" * 100) for i in range(200)))
        for head in whole if parser == "httptools" else ():  # (h11: not checked on a whole head yet)
            sock = socket.create_connection(("127.0.0.1", srv.port))  # a whole head over the limit in one send
            sock.settimeout(10)
            sock.sendall(b"GET /healthz HTTP/1.1\r\nHost: x\r\n" + head + b"\r\n")
            got = sock.recv(400)
            sock.close()
            assert got.startswith(b"HTTP/1.1 431") and b"over 16384 bytes" in got, got[:400]
        # framing that is no HTTP: 400 with the parser's reason, in the server's JSON error shape
        for bad, why in (
            (b"POST /healthz HTTP/1.1\r\nHost: x\r\nContent-Length: -5\r\n\r\n", b"Content-Length"),
            (b"\x16\x03\x01 not http\r\n\r\n", b""),
            (b"GET /healthz HTTP/1.1\r\n\r\n", b"Host"),  # (RFC 9112: an HTTP/1.1 request names its host)
            # (h11 reads this one as chunked, as RFC 9112 allows; llhttp refuses it)
            *[(b"POST / HTTP/1.1\r\nHost: x\r\nContent-Length: 5\r\nTransfer-Encoding: chunked\r\n\r\n", b"")]
            * (parser == "httptools"),
        ):
            sock = socket.create_connection(("127.0.0.1", srv.port))
            sock.settimeout(10)
            sock.sendall(bad)
            got = sock.recv(400)
            sock.close()
            head, body = got.split(b"\r\n\r\n", 1)
            assert head.startswith(b"HTTP/1.1 400") and b"content-type: application/json" in head, got
            assert json.loads(body)["detail"].startswith("malformed HTTP request: ") and why in body, got
        assert post_image(srv.url, samples[0].read_bytes()).status_code == 200


def test_a_client_trickling_its_request_head_is_disconnected(samples):
    """uvicorn times out only idle keep-alive connections; the head deadline closes a connection
    whose request line and headers do not arrive whole in time, also after a first request."""
    from fullthrottle.server.connection import head_deadline_protocol

    with Server(Tiny(), uvicorn_kw={"http": head_deadline_protocol(1.0)}) as srv:
        port = srv.port
        for first in (b"", b"GET /healthz HTTP/1.1\r\nHost: x\r\n\r\n"):  # fresh, and after a response
            sock = socket.create_connection(("127.0.0.1", port))
            sock.sendall(first)
            sock.settimeout(0.25)
            t0, closed = time.time(), False
            while time.time() - t0 < 6:
                try:
                    sock.sendall(b"G")  # a request head that never ends (the first answer is read past)
                    if sock.recv(65536) == b"":
                        closed = True
                        break
                except TimeoutError:
                    continue
                except OSError:
                    closed = True
                    break
            sock.close()
            assert closed and time.time() - t0 < 4, (first, time.time() - t0)
        assert post_image(srv.url, samples[0].read_bytes()).status_code == 200  # others are served


def test_faults_under_load_lose_no_accepted_request(samples):
    """Under load from 6 clients, six times: a decoder process is killed, clients hang up mid-body and
    before their answer; then SIGTERM. The server process's private memory stops
    growing: a leak grows in every round; the allocator's high-water marks rise in steps that stop (its
    shared crop pool is left out: its pages count as they are first written, up to the pool's size,
    a bound). Every request the server accepted is answered (200, or an error that
    says why), it exits 0, and none of its decoder processes is left behind. (A request sent on a
    keep-alive connection that was idle at SIGTERM may meet the connection's close unread, and a new
    connection made just before SIGTERM may still sit in the kernel's backlog, unaccepted, when the
    server stops listening: both are counted apart, as clients must retry those.)"""
    import os
    import re
    import signal

    photos = [p.read_bytes() for p in samples[:24]]
    private: list[float] = []
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "fullthrottle.cli",
            "serve",
            "--device",
            "cpu",
            "--port",
            "0",
            "--threads",
            "2",
            "--preprocess",
            "processes",
            "--max-wait-ms",
            "20",
        ],
        stderr=subprocess.PIPE,
        text=True,
        env=dict(os.environ, PYTHONUNBUFFERED="1"),
    )
    try:
        url, deadline = None, time.time() + 90
        while url is None and time.time() < deadline:
            m = re.search(r"running on (http://127\.0\.0\.1:\d+)", proc.stderr.readline())
            url = m.group(1) if m else None
        assert url, "server did not start"
        log: list[str] = []  # (read as it comes: its access log must not block it)
        threading.Thread(target=lambda: log.extend(proc.stderr), daemon=True).start()
        host, port = url.removeprefix("http://").split(":")
        workers = children(proc.pid)
        assert len(workers) == 2, workers
        stop, pause, outcomes, lock, t_term = threading.Event(), threading.Event(), [], threading.Lock(), [float("inf")]

        def client(k):
            with httpx.Client(timeout=60) as c:
                i = k
                while not stop.is_set():
                    while pause.is_set():
                        time.sleep(0.05)
                    t_send = time.time()
                    try:
                        r = c.post(
                            url + "/v1/classify",
                            content=photos[i % len(photos)],
                            headers={"content-type": "image/jpeg", "connection": conn_mode[k % 2]},
                        )
                        got = (r.status_code, r.json().get("detail", "") if r.status_code != 200 else "")
                    except httpx.ConnectError:
                        got = ("refused", "")  # not accepted: the server had stopped listening
                    except httpx.HTTPError as e:
                        # a keep-alive connection idle at SIGTERM is closed (SHUTDOWN_LINGER_S later): a
                        # request sent on it just then meets the close, unread; and a new connection still in
                        # the listening socket's backlog when the server stops listening is reset by the
                        # kernel, never accepted. The client must retry both.
                        late = time.time() > t_term[0]
                        raced = late and (conn_mode[k % 2] == "keep-alive" or t_send > t_term[0] - 0.25)
                        got = (
                            "raced" if raced else "lost",
                            f"{type(e).__name__} "
                            f"{time.time() - t_term[0]:+.2f} s from SIGTERM, connection {conn_mode[k % 2]}",
                        )
                    with lock:
                        outcomes.append(got)
                    if got[0] == "refused":
                        return
                    i += 6

        conn_mode = ("close", "keep-alive")  # a new connection per request, or one kept alive
        threads = [threading.Thread(target=client, args=(k,)) for k in range(6)]
        for t in threads:
            t.start()
        time.sleep(2)

        def faults_then_rss() -> None:
            os.kill(sorted(children(proc.pid))[0], signal.SIGKILL)  # a decoder process dies under load
            for _ in range(5):  # clients that hang up mid-body, and before reading their answer
                s = socket.create_connection((host, int(port)))
                s.sendall(
                    b"POST /v1/classify HTTP/1.1\r\nHost: x\r\nContent-Type: image/jpeg\r\n"
                    b"Content-Length: %d\r\n\r\n" % len(photos[0]) + photos[0][:1000]
                )
                s.close()
                s = socket.create_connection((host, int(port)))
                s.sendall(
                    b"POST /v1/classify HTTP/1.1\r\nHost: x\r\nContent-Type: image/jpeg\r\n"
                    b"Content-Length: %d\r\n\r\n" % len(photos[1]) + photos[1]
                )
                s.close()
            time.sleep(2)
            pause.set()  # the load stops a moment: every image submitted is answered (or dropped)
            end, pending = time.time() + 30, None
            while pending != 0 and time.time() < end:
                time.sleep(0.5)
                m = re.search(r"fullthrottle_pending_images\{[^}]*\} (\S+)", httpx.get(url + "/metrics").text)
                pending = float(m.group(1))
            held.append(pending)  # (a request whose client hung up must not hold its images)
            metrics = httpx.get(url + "/metrics").text  # a hang-up mid-body counts as 499, not as a client error
            hung_up.append(re.search(r'requests_total\{route="/v1/classify",status="499"\} (\S+)', metrics))
            assert 'route="/v1/classify",status="400"' not in metrics
            # (the server's own: its decoder processes are killed and replaced, young, in turn)
            private.append(_private_mib(proc.pid))
            pause.clear()

        held: list[float] = []
        hung_up: list = []
        for _ in range(6):
            faults_then_rss()
        workers |= children(proc.pid)
        pause.clear()
        time.sleep(0.5)
        t_term[0] = time.time()
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(60) == 0
        stop.set()
        for t in threads:
            t.join(60)
    finally:
        if proc.poll() is None:
            proc.kill()
    statuses = [o[0] for o in outcomes]
    print(
        f"faults under load: private memory {[round(m) for m in private]} MiB; {len(outcomes)} requests: "
        + ", ".join(f"{statuses.count(s)} x {s}" for s in sorted(set(statuses), key=str)),
        sorted({o for o in outcomes if o[1]}, key=str),
    )
    assert "lost" not in statuses, [o for o in outcomes if o[0] == "lost"][:5]
    assert statuses.count(200) >= 20 and statuses.count("raced") <= 3
    assert all(o[1] for o in outcomes if o[0] not in (200, "refused")), outcomes  # errors say why
    time.sleep(1)
    assert not [w for w in workers if alive(w)], "decoder processes left behind"
    # a client that hangs up is no server error: no traceback in its log
    assert not [x for x in log if x.startswith("Traceback")], "".join(log)[-3000:]
    assert held == [0.0] * 6, f"images held by the server with no client waiting: {held}"
    assert hung_up[-1] and float(hung_up[-1].group(1)) >= 5, "hang-ups mid-body are not counted as 499"
    steps = [b - a for a, b in zip(private, private[1:])]
    assert min(steps[-3:]) < 10, f"the server's private memory grew in each of the last rounds: {private} MiB"


def _private_mib(pid: int) -> float:
    """Resident private (anonymous) memory of one process (MiB): its heap and the allocators', not the
    shared memory it maps."""
    with open(f"/proc/{pid}/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("RssAnon:")) / 1024


def test_an_unterminated_multipart_body_is_malformed(samples):
    photo = samples[0].read_bytes()
    body = (
        b'--xyz\r\nContent-Disposition: form-data; name="f"; filename="a.jpg"\r\n'
        b"Content-Type: image/jpeg\r\n\r\n" + photo[:5000]
    )  # no closing boundary
    with Server(Tiny()) as s:
        r = httpx.post(
            s.url + "/v1/classify", content=body, headers={"content-type": "multipart/form-data; boundary=xyz"}
        )
    assert r.status_code == 400 and "closing boundary" in r.json()["detail"]


def test_embed_that_cannot_start_leaves_no_file(tmp_path, capsys):
    from fullthrottle.cli import main

    (tmp_path / "t.txt").write_text("a\n")
    out = tmp_path / "v.npy"
    assert main(["embed", str(tmp_path / "t.txt"), "--out", str(out), "--model-dir", str(tmp_path / "nope")]) == 2
    assert not out.exists() and "model folder not found" in capsys.readouterr().err


def test_one_client_address_cannot_take_every_connection(samples):
    """Past its per-address limit (no client_busy_app given) new connections are closed as they open, each reported
    to ``on_client_refused`` (the server logs it); a client at another address is served meanwhile."""
    from fullthrottle.server.connection import head_deadline_protocol

    socks, refused = [], []
    proto = head_deadline_protocol(30.0, per_client=5, on_client_refused=lambda *a: refused.append(a))
    kw = {"limit_concurrency": 20, "http": proto}
    with Server(Tiny(), uvicorn_kw=kw) as srv:
        port = srv.port
        for _ in range(30):  # from 127.0.0.3: 5 stay open, the rest are closed at once
            s = socket.create_connection(("127.0.0.1", port), source_address=("127.0.0.3", 0))
            s.settimeout(0.5)
            socks.append(s)
        closed = 0
        for s in socks:
            try:
                closed += s.recv(1) == b""
            except TimeoutError:
                pass
        assert closed == 25 and refused == [("127.0.0.3", 5)] * 25
        assert post_image(srv.url, samples[0].read_bytes()).status_code == 200  # others are still served
        for s in socks:
            s.close()


@contextlib.contextmanager
def _uvicorn_server(max_connections: int, opts: ServeOptions | None = None, keep: list | None = None):
    """A server of ``Tiny`` on 127.0.0.1 as ``serve`` makes it (``uvicorn_server``: the guard's
    connection limits), run in a thread: its port (``keep``: the server is appended)."""
    from fullthrottle.core.config import Config
    from fullthrottle.server.app import create_app
    from fullthrottle.server.http_layer import uvicorn_server

    opts = opts or ServeOptions()
    app = create_app(Config(device="cpu", labels=[str(i) for i in range(10)]), opts, model=Tiny())
    server = uvicorn_server(app, opts, max_connections, host="127.0.0.1", port=0)
    server.capture_signals = contextlib.nullcontext  # (not the main thread: no signal handlers)
    t = threading.Thread(target=server.run, daemon=True)
    t.start()
    deadline = time.time() + 30
    while not server.started and time.time() < deadline:
        time.sleep(0.02)
    if keep is not None:
        keep.append(server)
    try:
        yield server.servers[0].sockets[0].getsockname()[1]
    finally:
        server.should_exit = True
        t.join(30)


def test_requests_still_in_the_listening_backlog_when_the_drain_starts_are_answered():
    """A busy event loop accepts late: connections whose requests were sent while it was busy may
    still wait in the listening socket's backlog as the drain starts. They are accepted and answered
    (closing the listening socket reset them: the clients saw ECONNRESET, their requests lost)."""
    import asyncio

    held: list = []
    with _uvicorn_server(16, keep=held) as port:
        server, busy = held[0], threading.Event()

        def busy_then_drain():  # (in the event loop: busy while the clients connect, then the drain)
            busy.set()
            time.sleep(1.0)
            asyncio.ensure_future(server.shutdown())

        server.servers[0].get_loop().call_soon_threadsafe(busy_then_drain)
        assert busy.wait(10)
        socks = [socket.create_connection(("127.0.0.1", port), timeout=10) for _ in range(5)]
        for s in socks:
            s.sendall(b"GET /healthz HTTP/1.1\r\nHost: x\r\n\r\n")
        answers = []
        for s in socks:
            got = b""
            try:
                while chunk := s.recv(65536):
                    got += chunk
            except OSError as e:
                got += f" [{e!r}]".encode()
            s.close()
            answers.append(got)
    assert all(a.startswith(b"HTTP/1.1 200") and a.endswith(b'{"status":"alive"}') for a in answers), answers


def test_max_connections_serves_that_many_and_refuses_the_next():
    """``--max-connections 3``: three open keep-alive connections are all served, a fourth gets 503
    (Retry-After, a JSON reason, counted in /metrics) and is closed, and the three go on being served
    while it is open (uvicorn's own limit refused every request while too many connections were open)."""
    import http.client

    with _uvicorn_server(3) as port:
        conns = [http.client.HTTPConnection("127.0.0.1", port, timeout=10) for _ in range(4)]
        try:
            codes = keep_alive_statuses(conns)
            assert codes == [200, 200, 200, 503], codes
            idle = [socket.create_connection(("127.0.0.1", port)) for _ in range(2)]  # open, asking nothing
            assert keep_alive_statuses(conns[:3]) == [200, 200, 200]  # (the three before them go on)
            for c in idle:
                c.close()
            conns[3].request("GET", "/v1/models")
            r = conns[3].getresponse()
            body = r.read()
            assert (r.status, r.getheader("retry-after"), r.getheader("connection")) == (503, "1", "close"), r.status
            assert "most connections (3)" in json.loads(body)["detail"]
            metrics = keep_alive_statuses(conns[:1]) and conns[0]
            metrics.request("GET", "/metrics")
            text = metrics.getresponse().read().decode()
            assert 'fullthrottle_requests_total{route="/healthz",status="503"} 1.0' in text
            assert 'fullthrottle_requests_total{route="/v1/models",status="503"} 1.0' in text
        finally:
            for c in conns:
                c.close()


def test_a_connection_past_the_per_client_cap_is_answered_503():
    """``--max-connections-per-client 2``: a third connection from the address gets 503 with
    Retry-After and the reason, then is closed (it was closed unanswered, which a load test sees as
    read errors); one that asks nothing is closed within CLIENT_REFUSAL_HEAD_S; the two go on, and
    a client at another address is served while such connections are open."""
    import http.client

    from fullthrottle.server.connection import CLIENT_REFUSAL_HEAD_S

    with _uvicorn_server(3, ServeOptions(max_connections_per_client=2)) as port:
        conns = [http.client.HTTPConnection("127.0.0.1", port, timeout=10) for _ in range(3)]
        try:
            assert keep_alive_statuses(conns[:2]) == [200, 200]
            conns[2].request("GET", "/healthz")
            r = conns[2].getresponse()
            body = r.read()
            assert (r.status, r.getheader("retry-after"), r.getheader("connection")) == (503, "1", "close"), r.status
            assert "client address holds its most connections (2)" in json.loads(body)["detail"]
            fourth = http.client.HTTPConnection("127.0.0.1", port, timeout=10)  # under /v1/: OpenAI's shape too
            fourth.request("POST", "/v1/completions", body=b"{}", headers={"content-type": "application/json"})
            r = fourth.getresponse()
            err = json.loads(r.read())
            fourth.close()
            assert r.status == 503 and "holds its most connections (2)" in err["error"]["message"], err
            assert err["error"]["type"] == "overloaded_error" and err["detail"] == err["error"]["message"]
            with socket.create_connection(("127.0.0.1", port), timeout=10) as idle:  # past the cap, asking nothing
                t0 = time.perf_counter()
                assert idle.recv(1) == b""
                assert time.perf_counter() - t0 < CLIENT_REFUSAL_HEAD_S + 1.0
            assert keep_alive_statuses(conns[:2]) == [200, 200]
            # those held open past the cap do not count against --max-connections (3): another
            # client is served meanwhile
            idle = [socket.create_connection(("127.0.0.1", port)) for _ in range(4)]
            other = http.client.HTTPConnection("127.0.0.1", port, timeout=10, source_address=("127.0.0.2", 0))
            conns.append(other)
            assert keep_alive_statuses([other]) == [200]
            for c in idle:
                c.close()
        finally:
            for c in conns:
                c.close()


def test_requests_the_http_parser_refuses_are_counted():
    """A request the HTTP parser refuses never reaches the app; it is answered 400 and counted in
    /metrics (route "other", status 400) like every other answer."""
    with _uvicorn_server(8) as port:
        for junk in (b"NOT HTTP AT ALL\r\n\r\n", b"GET / HTTP/1.1\r\nHost: x\r\nBad Header Line\r\n\r\n"):
            sock = socket.create_connection(("127.0.0.1", port))
            sock.settimeout(10)
            sock.sendall(junk)
            got = sock.recv(200)
            sock.close()
            assert got.startswith(b"HTTP/1.1 400"), got
        text = httpx.get(f"http://127.0.0.1:{port}/metrics").text
        assert re.search(r'requests_total\{route="other",status="400"\} 2\.0', text), text[-2000:]


def _one_reply(port: int, request: bytes, size: int = 1000) -> bytes:
    """``request``'s bytes sent on a new connection to 127.0.0.1:``port``; the answer's head and as much
    of its body as its Content-Length says (or up to the connection's close), at most ``size`` bytes:
    the server may write the head and the body apart, and they may arrive apart."""
    with socket.create_connection(("127.0.0.1", port)) as sock:
        sock.settimeout(10)
        sock.sendall(request)
        got = b""
        while len(got) < size:
            head, sep, body = got.partition(b"\r\n\r\n")
            length = re.search(rb"(?im)^content-length:\s*(\d+)", head) if sep else None
            if length and len(body) >= int(length.group(1)):
                break
            chunk = sock.recv(size - len(got))
            if not chunk:
                break
            got += chunk
        return got


def test_bad_bytes_inside_a_request_body_count_that_request_once():
    """A chunked body whose chunk size is no number: the client gets one 400 with the parser's reason,
    and /metrics counts that request once, under its route (it reached the app, which saw its client
    go), not a second time as a refused request."""
    import http.client

    with _uvicorn_server(16) as port:
        got = _one_reply(
            port,
            b"POST /v1/classify HTTP/1.1\r\nHost: x\r\nContent-Type: image/jpeg\r\n"
            b"Transfer-Encoding: chunked\r\n\r\nZZ\r\nhello\r\n0\r\n\r\n",
        )
        assert got.startswith(b"HTTP/1.1 400") and b"malformed HTTP request: Invalid character in chunk size" in got
        time.sleep(0.5)  # (the app's handler sees its client gone)
        c = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
        c.request("GET", "/metrics")
        counted = [
            line
            for line in c.getresponse().read().decode().splitlines()
            if line.startswith("fullthrottle_requests_total") and 'route="/metrics"' not in line
        ]
        c.close()
        assert counted == ['fullthrottle_requests_total{route="/v1/classify",status="499"} 1.0'], counted


def test_a_websocket_upgrade_is_answered_as_plain_http():
    """No route speaks WebSocket: a request asking to upgrade is answered as the plain HTTP request it
    also is (was uvicorn's empty 403, uncounted), with no advice to install a WebSocket library logged."""
    said: list[str] = []
    log = logging.getLogger("uvicorn.error")
    catch = logging.Handler()
    catch.emit = lambda record: said.append(record.getMessage())
    with _uvicorn_server(16) as port:
        log.addHandler(catch)  # (once uvicorn has set its loggers up)
        got = _one_reply(
            port,
            b"GET /healthz HTTP/1.1\r\nHost: x\r\nUpgrade: websocket\r\nConnection: Upgrade\r\n"
            b"Sec-WebSocket-Key: dGhlIHNhbXBsZSBub25jZQ==\r\nSec-WebSocket-Version: 13\r\n\r\n",
        )
    log.removeHandler(catch)
    head, body = got.split(b"\r\n\r\n", 1)
    assert head.startswith(b"HTTP/1.1 200") and json.loads(body) == {"status": "alive"}, got
    assert "Unsupported upgrade request." in said and not [m for m in said if "WebSocket library" in m], said
