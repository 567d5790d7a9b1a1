"""`fullthrottle bench ... --quick` on CPU: each experiment writes JSON (machine, command, points) and a PNG."""

import json

import pytest
import torch

from fullthrottle.cli import main


def _run(tmp_path, *args):
    prefix = str(tmp_path / "b")
    rc = main(["bench", *args, "--quick", "--out", prefix])
    return rc, prefix


def _check_files(prefix):
    data = json.loads(open(prefix + ".json").read())
    png = open(prefix + ".png", "rb").read()
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) > 5000
    m = data["machine"]
    assert m["cpu_count"] >= 1 and m["torch"] and "bench" in m["command"]
    return data


def test_threads(tmp_path, samples):
    rc, prefix = _run(tmp_path, "threads", "--images", *map(str, samples[:8]))
    assert rc == 0
    d = _check_files(prefix)
    rows = {(r["recipe"].split()[0], r["threads"]): r["img_per_s"] for r in d["rows"]}
    assert set(rows) == {("opencv+torch", 1), ("opencv+torch", 2), ("pure", 1), ("pure", 2)}
    assert all(v > 0 for v in rows.values())
    assert d["free_threaded"] in (True, False) and d["single_thread_ms_per_image"] > 0


def test_batch(tmp_path):
    rc, prefix = _run(tmp_path, "batch")
    assert rc == 0
    d = _check_files(prefix)
    cpu = [r for r in d["rows"] if r["config"] == "cpu fp32 eager"]
    assert [r["batch"] for r in cpu] == [1, 2] and all(r["img_per_s"] > 0 for r in cpu)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU refusal")
def test_transfer_needs_cuda(tmp_path, capsys):
    rc, _ = _run(tmp_path, "transfer")
    assert rc == 2 and "needs a CUDA device" in capsys.readouterr().err


def test_e2e(tmp_path, samples):
    rc, prefix = _run(tmp_path, "e2e", "--images", *map(str, samples[:16]))
    assert rc == 0
    d = _check_files(prefix)
    assert set(d["results"]) == {
        "naive loop",
        "DataLoader 2 workers, pil",
        "DataLoader 2 workers, opencv",
        "fullthrottle",
    }
    assert all(v["img_per_s"] > 0 for v in d["results"].values())
    assert d["results"]["fullthrottle"]["report"]["ok"] == d["n"] == 48 and d["batch"] == 4
    assert d["verdict"].split(":")[0].endswith("-bound")
    assert len(d["ratios"]) == 3


def test_quick_keeps_the_flags_given_and_too_few_images_for_a_steady_rate_are_refused(tmp_path, samples, capsys):
    """--quick supplies the defaults it makes smaller, not the flags given (it replaced --n, --workers
    and --batch unsaid); an --n whose steady window is under MIN_STEADY_BATCHES batches is refused (its
    rate was the spacing of two bursts of results: 4 times the run's own)."""
    from fullthrottle.cli.bench_e2e import MIN_STEADY_BATCHES, min_images

    assert min_images(8) == 86 and min_images(8) * 0.75 >= MIN_STEADY_BATCHES * 8
    args = ["bench", "e2e", "--quick", "--device", "cpu", "--images", str(samples[0]), "--out", str(tmp_path / "e")]
    assert main([*args, "--n", "32"]) == 2
    assert "--n 32 is too few images at --batch 4 for a steady rate: give --n 43 or more" in capsys.readouterr().err
    assert main([*args, "--n", "24", "--batch", "2", "--workers", "1"]) == 0
    d = json.loads((tmp_path / "e.json").read_text())
    assert (d["n"], d["batch"], d["workers"]) == (24, 2, 1) and "DataLoader 1 workers, pil" in d["results"]
    assert d["results"]["fullthrottle"]["report"]["ok"] == 24
    rc, prefix = _run(tmp_path, "batch", "--batches", "1,3")
    assert rc == 0 and [r["batch"] for r in _check_files(prefix)["rows"] if r["config"] == "cpu fp32 eager"] == [1, 3]


def test_out_in_a_missing_folder_is_refused_before_the_run(tmp_path, capsys):
    rc = main(["bench", "threads", "--quick", "--out", str(tmp_path / "no" / "such" / "b")])
    assert rc == 2 and "its folder does not exist" in capsys.readouterr().err
    rc = main(["bench", "threads", "--quick", "--out", str(tmp_path)])  # (a folder: it wrote FOLDER.json)
    assert (
        rc == 2
        and "--out is a prefix (PREFIX.json and PREFIX.png are written), not a folder" in capsys.readouterr().err
    )
    assert not (tmp_path.parent / f"{tmp_path.name}.json").exists()


def test_bench_flags_are_checked_before_anything_runs(capsys):
    for argv, says in (
        (["bench", "e2e", "--quick", "--model", "nosuch"], "'nosuch' is not one of torchvision's models"),
        (["bench", "batch", "--quick", "--model", "efficientnet_lite0"], "not one of torchvision's models"),
        (["bench", "threads", "--quick", "--seconds", "-1"], "must be a finite number > 0"),
        (["bench", "threads", "--quick", "--seconds", "0"], "must be a finite number > 0"),
    ):
        with pytest.raises(SystemExit) as e:
            main(argv)
        assert e.value.code == 2 and says in capsys.readouterr().err, argv
    # a path that is not there: named as it is skipped, then the run's one error (was a bare [Errno 2])
    assert main(["bench", "e2e", "--images", "/no/such/dir", "--n", "4"]) == 2
    err = capsys.readouterr().err
    assert err == (
        "fullthrottle bench: skipping /no/such/dir: cannot read it: No such file or directory\n"
        "fullthrottle bench e2e: no image files found in /no/such/dir\n"
    ), err


def test_the_open_loop_tells_requests_never_sent_from_requests_the_server_did_not_answer():
    """bench/load_client.py: past its connections, a request waits in the load generator; one whose
    time runs out there is counted as never sent, apart from a sent one the server did not answer."""
    import asyncio
    import sys
    import threading
    from pathlib import Path

    aiohttp_web = pytest.importorskip("aiohttp.web")
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))
    import load_client

    started, port = threading.Event(), []

    async def hang(request):
        await request.read()
        await asyncio.sleep(30)  # (never answers within the clients' time)
        return aiohttp_web.Response()

    def serve():
        loop = asyncio.new_event_loop()
        app = aiohttp_web.Application()
        app.router.add_post("/", hang)
        runner = aiohttp_web.AppRunner(app)
        loop.run_until_complete(runner.setup())
        site = aiohttp_web.TCPSite(runner, "127.0.0.1", 0)
        loop.run_until_complete(site.start())
        port.append(site._server.sockets[0].getsockname()[1])
        started.set()
        loop.run_forever()

    threading.Thread(target=serve, daemon=True).start()
    assert started.wait(10)
    # 40 requests/s for 1 s over 4 connections, 1 s each to get one and 1 s for the answer
    got = asyncio.run(load_client._open(f"http://127.0.0.1:{port[0]}/", [(b"x", "image/jpeg")], 1, 40, 1.0, 1.0, 4))
    codes = got["codes"]  # (4 sent at once; up to 4 more as those time out, by their due times)
    assert set(codes) == {"TimeoutError", load_client.UNSENT} and 4 <= codes["TimeoutError"] <= 8, codes
    assert codes["TimeoutError"] + codes[load_client.UNSENT] == 40, codes


def test_the_open_loop_counts_every_answer_by_status_and_reconnects_after_a_close():
    """bench/rate_client.py: every request sent is answered and counted once, by status; an answer in
    several reads, a body of Content-Length, and a server that closes the connection after some
    answers (the next requests go on new connections) are all followed; only 200s count as images."""
    import asyncio
    import sys
    import threading
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))
    import rate_client

    seen, started, port = [], threading.Event(), []

    class Answer(asyncio.Protocol):
        def connection_made(self, t):
            self.t, self.buf = t, bytearray()

        def data_received(self, data):
            self.buf += data
            end = self.buf.find(b"\r\n\r\n")
            n = int(bytes(self.buf[:end]).lower().split(b"content-length: ")[1].split(b"\r\n")[0]) if end >= 0 else -1
            if end < 0 or len(self.buf) < end + 4 + n:
                return
            body = bytes(self.buf[end + 4 : end + 4 + n])
            del self.buf[: end + 4 + n]
            seen.append(body)
            k = len(seen)
            status, close = (200, k % 5 == 0) if k % 2 else (503, False)
            text = b'{"ok": true}' if status == 200 else b'{"detail": "queue full"}'
            head = f"HTTP/1.1 {status} X\r\nContent-Length: {len(text)}\r\n"
            head += "Connection: close\r\n\r\n" if close else "\r\n"
            self.t.write(head.encode())  # (the head and the body in two writes)
            self.t.write(text)
            if close:
                self.t.close()

    def serve():
        loop = asyncio.new_event_loop()
        srv = loop.run_until_complete(loop.create_server(Answer, "127.0.0.1", 0))
        port.append(srv.sockets[0].getsockname()[1])
        started.set()
        loop.run_forever()

    threading.Thread(target=serve, daemon=True).start()
    assert started.wait(10)
    bodies = [(b"a" * 70000, "image/jpeg"), (b"b", "image/png")]
    # 200 requests/s for 1 s over 3 connections, 2 images a request
    got = asyncio.run(rate_client.run(f"http://127.0.0.1:{port[0]}/v1/classify", bodies, 2, 200, 1.0, 5.0, 3))
    codes = got["codes"]
    assert sum(codes.values()) == 200 == len(seen), (codes, len(seen))
    assert codes[200] == 100 and codes[503] == 100, codes
    # (images and latencies: of the 200s answered within the 1 s window; the last may come after it)
    assert got["images"] == 2 * len(got["lat"]) and 97 <= len(got["lat"]) <= 100 and min(got["lat"]) > 0
    assert sorted(set(seen)) == [b"a" * 70000, b"b"] and seen.count(b"b") == 100


@pytest.mark.parametrize(
    "script,args,says",
    [
        ("llm_serve.py", ["--shape", "tiny", "--concurrency", "abc"], "--concurrency takes integers"),
        ("llm_serve.py", ["--shape", "tiny", "--scale", "1000"], "leaves a set with no request"),
        ("llm_serve.py", ["--shape", "tiny", "--kv-dtype", "fp9"], "--kv-dtype: fp9 is neither auto nor fp8"),
        ("serve_load.py", ["--servers", "fullthrottle,nosuch"], "--servers: no server named nosuch"),
        ("serve_load.py", ["--modes", "bogus"], "--modes: bogus is no request kind"),
    ],
)
def test_the_benchmarks_refuse_bad_arguments_before_they_write_anything(tmp_path, script, args, says):
    """bench/llm_serve.py and bench/serve_load.py: a bad argument is a usage error (exit 2, the reason),
    checked before anything runs, and --out (a result of record, say) stays as it was."""
    import subprocess
    import sys
    from pathlib import Path

    out = tmp_path / "result.json"
    out.write_text('{"kept": true}')
    bench = Path(__file__).resolve().parents[1] / "bench"
    p = subprocess.run(
        [sys.executable, str(bench / script), *args, "--out", str(out)], capture_output=True, text=True, timeout=120
    )
    assert p.returncode == 2 and says in p.stderr and "Traceback" not in p.stderr, p.stderr[-2000:]
    assert out.read_text() == '{"kept": true}'
