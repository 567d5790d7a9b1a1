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
