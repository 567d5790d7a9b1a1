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
    assert d["results"]["fullthrottle"]["report"]["ok"] == 24
    assert d["verdict"].split(":")[0].endswith("-bound")
    assert len(d["ratios"]) == 3


def test_out_in_a_missing_folder_is_refused_before_the_run(tmp_path, capsys):
    rc = main(["bench", "threads", "--quick", "--out", str(tmp_path / "no" / "such" / "b")])
    assert rc == 2 and "its folder does not exist" in capsys.readouterr().err


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
