import contextlib
import dataclasses
import inspect
import json
import os
import subprocess
import sys

import pytest

from fullthrottle.cli import main, sample_photos


def test_help_explains():
    out = subprocess.run(
        [sys.executable, "-m", "fullthrottle.cli", "classify", "--help"], capture_output=True, text=True
    )
    assert out.returncode == 0
    for word in ("--batch-size", "--max-wait-ms", "--weights", "Exit status", "randomly initialised"):
        assert word in out.stdout


def test_default_inputs_are_real_photos():
    photos = sample_photos()
    assert len(photos) >= 3 and any(p.endswith("chelsea.png") for p in photos)


def test_classify_default_photos(capsys):
    rc = main(["classify", "--device", "cpu", "--no-progress", "--batch-size", "4"])
    out, err = capsys.readouterr()
    assert rc == 0
    chelsea = next(line for line in out.splitlines() if "chelsea.png:" in line)
    assert chelsea.split(": ", 1)[1].split(" 0.")[0] in ("tiger cat", "Egyptian cat", "tabby")  # it is a cat
    assert "randomly initialised" not in err and "img/s" in err and "p99" in err
    for stage in ("load", "preprocess", "batch", "compute", "decode"):
        assert f"\n{stage} " in err


def test_classify_bad_inputs_jsonl(tmp_path, bad_dir, capsys):
    out = tmp_path / "r.jsonl"
    rep = tmp_path / "rep.json"
    rc = main(
        [
            "classify",
            str(bad_dir),
            "--device",
            "cpu",
            "--no-progress",
            "--out",
            str(out),
            "--report-json",
            str(rep),
            "--top-k",
            "3",
        ]
    )
    assert rc == 1  # some items failed
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    by_name = {r["id"].rsplit("/", 1)[-1]: r for r in rows}
    assert len(rows) == 14 and "README.md" not in by_name
    assert "truncated or corrupt" in by_name["truncated.jpg"]["error"]
    assert "empty file" in by_name["empty.jpg"]["error"]
    assert "not a supported image" in by_name["not-an-image.jpg"]["error"]
    assert "image too large" in by_name["bomb-40000x40000.png"]["error"]
    for ok in (
        "png-named-as.JPEG",
        "cmyk.jpg",
        "gray16.png",
        "rgba.png",
        "exif-rotated.jpg",
        "tiny-1x1.jpg",
        "progressive.jpg",
        "animated.gif",
        "photo.webp",
        "large-6000x4000.jpg",
    ):
        assert len(by_name[ok]["top_k"]) == 3, by_name[ok]
    # the default model has real weights: the CMYK copy of a photo is seen as the photo itself
    assert by_name["cmyk.jpg"]["top_k"][0]["label"] == by_name["progressive.jpg"]["top_k"][0]["label"]
    summary = json.loads(rep.read_text())
    assert summary["ok"] == 10 and summary["failed"] == 4
    assert summary["images_per_s"] == pytest.approx(10 / summary["wall_s"])  # failed items don't count
    err = capsys.readouterr().err
    assert "ERROR" in err and "truncated" in err


@pytest.mark.parametrize(
    "args,msg",
    [
        (["--weights", "/nonexistent.safetensors"], "weights file not found"),
        (["--batch-size", "100000000"], "max_batch_size (--batch-size) must be at most 4096 images, got 100000000"),
    ],
)
def test_config_errors_exit_2(args, msg, capsys):
    rc = main(["classify", "--device", "cpu", "--no-progress", *args])
    assert rc == 2 and msg in capsys.readouterr().err


@pytest.mark.parametrize(
    "argv,flag",
    [
        (["classify", "--ray-actors", "3", "x.jpg"], "--ray-actors"),
        (["serve", "--replicas", "2"], "--replicas"),
        (["run", "lines.jsonl", "--workload", "m:C", "--ray-address", "10.0.0.1:6379"], "--ray-address"),
        (["run", "lines.jsonl", "--workload", "m:C", "--ray-actors", "4"], "--ray-actors"),
    ],
)
def test_ray_settings_without_ray_are_a_usage_error(argv, flag, capsys):
    with pytest.raises(SystemExit) as e:
        main(argv)
    err = capsys.readouterr().err
    assert e.value.code == 2 and f"fullthrottle {argv[0]}: error: {flag} acts with --ray only" in err, err


@pytest.mark.parametrize(
    "argv,want",
    [
        (
            ["classify", "--ray-address", "10.0.0.1:6379", "x.jpg"],
            "--ray-address (classify takes the address as --ray ADDRESS)",
        ),
        (["serve", "--no-such-flag"], "--no-such-flag"),
    ],
)
def test_an_unknown_option_is_named_under_its_commands_usage(argv, want, capsys):
    with pytest.raises(SystemExit) as e:
        main(argv)
    err = capsys.readouterr().err
    assert e.value.code == 2 and f"usage: fullthrottle {argv[0]} " in err, err
    assert err.rstrip().endswith(f"fullthrottle {argv[0]}: error: unrecognized arguments: {want}"), err


def test_ray_followed_by_an_input_says_how_to_give_both(samples, tmp_path, capsys):
    pytest.importorskip("ray")
    rc = main(["classify", "--device", "cpu", "--ray", str(samples[0]), "--out", str(tmp_path / "r.jsonl")])
    err = capsys.readouterr().err
    assert rc == 2 and f"--ray took '{samples[0]}' as the cluster's address: put --ray after the inputs" in err, err
    assert not (tmp_path / "r.jsonl").exists()


def test_unknown_model_is_a_usage_error_naming_the_models(capsys):
    with pytest.raises(SystemExit) as e:
        main(["classify", "--device", "cpu", "--model", "resnet19"])
    err = capsys.readouterr().err
    assert (
        e.value.code == 2
        and "unknown model 'resnet19'" in err
        and "efficientnet_lite0" in err
        and "MODULE:CLASS" in err
    )


def test_console_script_installed():
    out = subprocess.run(["fullthrottle", "--help"], capture_output=True, text=True)
    assert out.returncode == 0 and "classify" in out.stdout


@pytest.mark.parametrize("out,msg", [("{tmp}", "Is a directory"), ("/dev/full", "No space left on device")])
def test_unwritable_out_exits_2_with_one_line(samples, tmp_path, capsys, out, msg):
    """--out naming a folder fails before the model is built; a full disk fails when written: both
    exit 2 with the reason (not a traceback, and not 1, which means an item failed)."""
    import os

    if out == "/dev/full" and not os.path.exists(out):
        pytest.skip("no /dev/full here")
    rc = main(["classify", str(samples[0]), "--device", "cpu", "--no-progress", "--out", out.format(tmp=tmp_path)])
    err = capsys.readouterr().err
    assert rc == 2 and "fullthrottle: error: cannot write" in err and msg in err and "Traceback" not in err


def test_an_out_fifo_whose_reader_leaves_is_exit_2_naming_it(samples, tmp_path, capsys):
    """--out FIFO whose reader goes away: an output that cannot be written (exit 2, said), not the
    quiet exit 1 of stdout's reader leaving (`| head`)."""
    import os
    import threading

    fifo = tmp_path / "results.fifo"
    os.mkfifo(fifo)

    def reader():
        with open(fifo, "rb") as f:
            f.read(10)

    t = threading.Thread(target=reader, daemon=True)
    t.start()
    argv = ["classify", *map(str, samples[:8]), "--device", "cpu", "--no-progress", "--out", str(fifo)]
    rc = main([*argv, "--top-k", "1000"])  # (lines of ~40 KB: past the pipe's buffer)
    t.join(10)
    err = capsys.readouterr().err
    assert rc == 2 and f"cannot write {fifo}: its reader went away" in err, (rc, err[-500:])


def test_a_run_that_stops_at_a_configuration_error_leaves_an_existing_out_file_as_it_was(samples, tmp_path, capsys):
    """classify --out FILE: FILE's earlier lines stay when the run stops before it starts (exit 2: bad
    weights); a run that starts replaces them with its own."""
    out, bad = tmp_path / "results.jsonl", tmp_path / "bad.safetensors"
    out.write_text("earlier results\n")
    bad.write_bytes(b"not a safetensors file")
    argv = ["classify", str(samples[0]), "--device", "cpu", "--no-progress", "--out", str(out)]
    rc = main([*argv, "--model", "resnet18", "--weights", str(bad)])
    assert rc == 2 and "fullthrottle: error:" in capsys.readouterr().err
    assert out.read_text() == "earlier results\n"
    assert main(argv) == 0
    lines = out.read_text().splitlines()
    assert len(lines) == 1 and json.loads(lines[0])["id"] == str(samples[0])


def test_cuda_only_options_on_cpu_are_named_not_ignored(samples, capsys):
    rc = main(
        [
            "classify",
            str(samples[0]),
            "--device",
            "cpu",
            "--no-progress",
            "--gpu-decode",
            "--gpu-decode-processes",
            "4",
            "--dtype",
            "bfloat16",
            "--top-k",
            "1001",
        ]
    )
    err = capsys.readouterr().err
    assert rc == 0
    assert (
        "note: --gpu-decode and --gpu-decode-processes 4 and --dtype bfloat16 need CUDA: "
        "this run on cpu decodes on the CPU and computes in float32"
    ) in err, err
    assert "note: --top-k 1001 is more than the model's 1000 classes" in err


def test_gpu_decoder_options_without_gpu_decode_are_named_not_ignored(samples, capsys):
    rc = main(
        [
            "classify",
            str(samples[0]),
            "--device",
            "cpu",
            "--no-progress",
            "--no-gpu-decode",
            "--gpu-decoder",
            "hardware",
        ]
    )
    assert rc == 0
    assert "note: --gpu-decoder has no effect with --no-gpu-decode" in capsys.readouterr().err
    rc = main(
        [
            "classify",
            str(samples[0]),
            "--device",
            "cpu",
            "--no-progress",
            "--no-gpu-decode",
            "--gpu-decode-processes",
            "99",
        ]
    )
    err = capsys.readouterr().err  # ignored, so not refused either (it used to note, then fail on the value)
    assert rc == 0 and "note: --gpu-decode-processes has no effect with --no-gpu-decode" in err
    rc = main(["classify", str(samples[0]), "--device", "cpu", "--no-progress"])
    assert rc == 0 and "no effect" not in capsys.readouterr().err
    rc = main(
        [
            "classify",
            str(samples[0]),
            "--device",
            "cpu",
            "--no-progress",
            "--gpu-decode",
            "--gpu-decode-processes",
            "17",
        ]
    )
    assert rc == 2 and "--gpu-decode-processes must be in 0..16, got 17" in capsys.readouterr().err


def test_unwritable_report_json_fails_before_the_run(samples, tmp_path, capsys, monkeypatch):
    """--report-json naming a folder is refused up front (exit 2), before any image is classified."""
    import fullthrottle.workloads.classify.pipeline as pl

    monkeypatch.setattr(pl.Pipeline, "__init__", lambda *a, **k: pytest.fail("the pipeline was built"))
    rc = main(["classify", str(samples[0]), "--device", "cpu", "--no-progress", "--report-json", str(tmp_path)])
    err = capsys.readouterr().err
    assert rc == 2 and f"cannot write {tmp_path}: Is a directory" in err
    # a folder that exists but takes no file (found out by trying, as --out is; nothing left behind)
    for cmd in (["classify", str(samples[0]), "--device", "cpu"], ["embed", str(samples[0]), "--out", "-"]):
        rc = main([*cmd, "--no-progress", "--report-json", "/proc/fullthrottle-report.json"])
        err = capsys.readouterr().err
        assert rc == 2 and "cannot write /proc/fullthrottle-report.json: No such file or directory" in err, err
    report = tmp_path / "r.json"
    import fullthrottle.cli.common as common

    assert common.cannot_write(str(report)) is None and not report.exists()
    report.write_text("kept")
    assert common.cannot_write(str(report)) is None and report.read_text() == "kept"
    link = tmp_path / "link.json"
    link.symlink_to(tmp_path / "target.json")  # (dangling: tried through, the link left as it was)
    assert common.cannot_write(str(link)) is None and link.is_symlink()


def test_generate_and_embed_name_a_missing_model_folder(tmp_path, capsys, monkeypatch):
    missing = str(tmp_path / "nope")
    assert main(["generate", "--model-dir", missing, "--tokens", "1,2"]) == 2
    assert f"model folder not found: {missing}" in capsys.readouterr().err
    src = tmp_path / "in.txt"
    src.write_text("hello\n")
    assert main(["embed", str(src), "--model-dir", missing, "--out", str(tmp_path / "o.npy")]) == 2
    assert f"model folder not found: {missing}" in capsys.readouterr().err
    assert main(["serve", "--no-classify", "--embed-model", missing]) == 2  # before anything loads
    assert f"--embed-model {missing}: no config.json there" in capsys.readouterr().err
    # the variable naming a folder without a model; a config.json that is not JSON: each said once, plainly
    with monkeypatch.context() as m:
        m.setenv("FULLTHROTTLE_EMBED_MODEL", missing)
        assert main(["embed", str(src), "--out", str(tmp_path / "o.npy")]) == 2
    err = capsys.readouterr().err
    assert (
        f"error: FULLTHROTTLE_EMBED_MODEL={missing!r} is not a sentence-transformers model folder (no config.json)\n"
        in err
    )
    (tmp_path / "broken").mkdir()
    (tmp_path / "broken" / "config.json").write_text("not json")
    assert main(["embed", str(src), "--model-dir", str(tmp_path / "broken"), "--out", str(tmp_path / "o.npy")]) == 2
    assert (
        f"{tmp_path / 'broken' / 'config.json'}: not valid JSON (Expecting value at line 1 column 1)"
        in capsys.readouterr().err
    )


def test_embed_and_generate_refuse_to_write_over_their_input(tmp_path, capsys, monkeypatch):
    """An output that is the input (by name or by a link) or the other output: exit 2 before any
    model loads, and the input left as it was."""
    texts = tmp_path / "in.jsonl"
    texts.write_text('{"text": "hello"}\n')
    (tmp_path / "link.jsonl").symlink_to(texts)
    for extra in (
        ["--out", str(texts)],
        ["--out", str(tmp_path / "link.jsonl")],
        ["--out", str(tmp_path / "v.npy"), "--report-json", str(texts)],
        ["--out", str(tmp_path / "v.jsonl"), "--report-json", str(tmp_path / "v.jsonl")],
    ):
        assert main(["embed", str(texts), "--device", "cpu", "--model-dir", str(tmp_path / "nope"), *extra]) == 2
        err = capsys.readouterr().err
        assert "is the same file as" in err and "writing it would destroy it" in err, (extra, err)
        assert texts.read_text() == '{"text": "hello"}\n' and not (tmp_path / "v.jsonl").exists()
    prompts = tmp_path / "p.jsonl"
    prompts.write_text('{"prompt": "a"}\n')
    assert (
        main(["generate", "--random", "tiny", "--device", "cpu", "--prompts", str(prompts), "--out", str(prompts)]) == 2
    )
    assert f"--out {prompts} is the same file as --prompts" in capsys.readouterr().err
    assert prompts.read_text() == '{"prompt": "a"}\n'
    for cmd, name in ((["embed", "-"], "the input"), (["generate", "--random", "tiny", "--prompts", "-"], "--prompts")):
        target = texts if cmd[0] == "embed" else prompts
        with open(target) as stdin:  # (a shell's < FILE)
            monkeypatch.setattr(sys, "stdin", stdin)
            assert main([*cmd, "--device", "cpu", "--out", str(target)]) == 2
        assert f"is the same file as {name} (stdin)" in capsys.readouterr().err
    assert texts.read_text() == '{"text": "hello"}\n' and prompts.read_text() == '{"prompt": "a"}\n'


def test_generate_many_prompts_runs_them_together_each_as_it_would_run_alone(tmp_path, capsys):
    """``generate --prompts FILE``: every line a request through the continuous-batching scheduler,
    answered in order with the tokens the single-prompt path gives it; a bad line gets its own error."""
    import json

    singles = []
    for ids in ("1,2,3", "7,8"):
        assert main(["generate", "--random", "tiny", "--tokens", ids, "--max-new-tokens", "6", "--device", "cpu"]) == 0
        singles.append([int(t) for t in capsys.readouterr().out.split()])
    src = tmp_path / "reqs.jsonl"
    src.write_text(
        '{"prompt": [1, 2, 3]}\n\n{"prompt": [1], "max_tokens": 0}\n{"prompt": [7, 8]}\n{not json\n'
        '{"prompt": [4, 5], "max_tokens": 3, "temperature": 0.7, "seed": 9}\n'
        '{"prompt": [4], "temperature": NaN}\n{"prompt": [4], "seed": 1e999}\n'
        + '{"prompt": '
        + "[" * 100000
        + "]" * 100000
        + "}\n"
    )
    out = tmp_path / "out.jsonl"
    args = ["generate", "--random", "tiny", "--prompts", str(src), "--max-new-tokens", "6", "--device", "cpu"]
    assert main([*args, "--out", str(out), "--max-batch", "2", "--no-progress"]) == 1  # (some failed)
    got = [json.loads(line) for line in out.read_text().splitlines()]
    assert [g["index"] for g in got] == [0, 1, 2, 3, 4, 5, 6, 7] and [g["line"] for g in got] == [
        1,
        3,
        4,
        5,
        6,
        7,
        8,
        9,
    ]
    assert got[0]["token_ids"] == singles[0] and got[2]["token_ids"] == singles[1]
    assert got[1]["error"].startswith("line 3: ") and "max_tokens must be a positive integer" in got[1]["error"]
    assert "line 5: not valid JSON" in got[3]["error"]
    assert got[3]["error"].endswith(
        "a line that starts with '{' is read as a JSON request: give such a prompt as {\"prompt\": ...}"
    )
    assert len(got[4]["token_ids"]) == 3 and got[4]["finish_reason"] == "length"
    assert got[5]["error"] == "line 7: not valid JSON: NaN is not JSON"  # (as every route reads a body)
    assert got[6]["error"] == "line 8: not valid JSON: the number 1e999 is too large for a float"
    assert got[7]["error"].startswith("line 9: not valid JSON: ") and "read as a JSON request" not in got[7]["error"]
    assert "5 request(s) failed" in capsys.readouterr().err
    assert main([*args, "--tokens", "1,2"]) == 2 and "not both" in capsys.readouterr().err
    assert main(["generate", "--random", "tiny", "--tokens", "1,2", "--out", str(out)]) == 2
    assert "--out is for --prompts FILE" in capsys.readouterr().err
    sampled = ["generate", "--random", "tiny", "--tokens", "1,2", "--max-new-tokens", "12", "--temperature", "1"]
    runs = []
    for extra in ([], [], ["--seed", "3"], ["--seed", "3"]):  # no seed: a new draw each run; a seed: the same
        assert main([*sampled, *extra, "--device", "cpu"]) == 0
        runs.append(capsys.readouterr().out.split())
    assert runs[0] != runs[1] and runs[2] == runs[3]
    # a field given as null takes the command's flag (greedy, 6 tokens), as one left out does
    src.write_text('{"prompt": [1, 2, 3], "temperature": null, "max_tokens": null, "top_p": null}\n')
    assert main([*args, "--out", str(out), "--no-progress"]) == 0
    assert json.loads(out.read_text())["token_ids"] == singles[0]
    assert main([*args, "--out", str(tmp_path), "--no-progress"]) == 2  # a folder: a clear error, exit 2
    assert "cannot write --out" in capsys.readouterr().err
    # stop_token_ids end a request of random weights too (which have no end-of-sequence token of their own)
    src.write_text(json.dumps({"prompt": [1, 2, 3], "stop_token_ids": [singles[0][2]]}) + "\n")
    assert main([*args, "--out", str(out), "--no-progress"]) == 0
    got = json.loads(out.read_text())
    assert got["token_ids"] == singles[0][: singles[0].index(singles[0][2]) + 1] and got["finish_reason"] == "stop"


def test_generate_many_on_paged_kv_memory_gives_the_static_cache_tokens_and_refuses_what_never_fits(tmp_path, capsys):
    """``generate --prompts FILE --kv-pages N|auto``: the same tokens as a static row per request (here
    through 2 pages of 64 tokens for 3 requests: they wait for pages); a request longer than
    the whole pool gets its own error; ``--kv-dtype fp8`` runs on float8 pages; the flags' misuses are
    clear errors, exit 2."""
    import json

    src, out = tmp_path / "reqs.jsonl", tmp_path / "out.jsonl"
    reqs = [
        {"prompt": [1, 2, 3], "max_tokens": 40},
        {"prompt": [5] * 30, "max_tokens": 60},
        {"prompt": [7], "max_tokens": 9},
    ]
    src.write_text("".join(json.dumps(r) + "\n" for r in reqs) + json.dumps({"prompt": [4], "max_tokens": 200}) + "\n")
    args = [
        "generate",
        "--random",
        "tiny",
        "--prompts",
        str(src),
        "--device",
        "cpu",
        "--no-progress",
        "--out",
        str(out),
    ]
    runs = {}
    for extra in ([], ["--kv-pages", "2"], ["--kv-pages", "auto"], ["--kv-pages", "2", "--kv-dtype", "fp8"]):
        assert main([*args, *extra]) == (1 if extra[1:2] == ["2"] else 0), extra
        runs[" ".join(extra)] = [json.loads(x) for x in out.read_text().splitlines()]
        capsys.readouterr()
    static = runs[""]
    assert [g["token_ids"] for g in runs["--kv-pages auto"]] == [g["token_ids"] for g in static]
    paged = runs["--kv-pages 2"]
    assert [g["token_ids"] for g in paged[:3]] == [g["token_ids"] for g in static[:3]]
    assert "needs more KV memory than there is: 2 pages of 64 tokens" in paged[3]["error"]
    fp8 = runs["--kv-pages 2 --kv-dtype fp8"]
    assert [len(g["token_ids"]) for g in fp8[:3]] == [40, 60, 9] and "error" in fp8[3]
    for bad, said in (
        (["--kv-dtype", "fp8"], "--kv-dtype fp8 needs paged KV memory: give --kv-pages N or auto"),
        (["--kv-pages", "-1"], "argument --kv-pages"),
    ):
        with pytest.raises(SystemExit) if bad[0] == "--kv-pages" else contextlib.nullcontext():
            assert main([*args, *bad]) == 2
        assert said in capsys.readouterr().err
    assert main(["generate", "--random", "tiny", "--tokens", "1", "--kv-pages", "4", "--device", "cpu"]) == 2
    assert "--kv-pages and --kv-dtype are for --prompts FILE" in capsys.readouterr().err
    out.write_text("kept\n")  # an engine that cannot be built: exit 2, and the --out already there is left as it was
    assert main([*args, "--kv-pages", "2", "--max-seq-len", "5000"]) == 2
    assert "exceeds the model's context" in capsys.readouterr().err and out.read_text() == "kept\n"


def test_generate_many_keeps_the_answers_done_when_stopped(tmp_path, monkeypatch, capsys):
    """Ctrl-C during ``generate --prompts``: the requests answered so far (in input order) are in
    --out; the rest are not (exit 130)."""
    import json

    from fullthrottle.workloads.llm.scheduler import Scheduler

    real, calls = Scheduler.step, []

    def step(self):
        calls.append(1)
        if len(calls) == 4:
            raise KeyboardInterrupt
        return real(self)

    monkeypatch.setattr(Scheduler, "step", step)
    src, out = tmp_path / "reqs.jsonl", tmp_path / "out.jsonl"
    lines = [
        '{"prompt": [1, 2], "max_tokens": 1}',
        '{"prompt": [3], "max_tokens": 1}',
        '{"prompt": [4], "max_tokens": 90}',
    ]
    src.write_text("\n".join(lines) + "\n")
    args = ["generate", "--random", "tiny", "--prompts", str(src), "--device", "cpu", "--max-batch", "1"]
    assert main([*args, "--out", str(out), "--no-progress"]) == 130
    assert [json.loads(x)["index"] for x in out.read_text().splitlines()] == [0, 1]


@pytest.mark.parametrize(
    "flags, want",
    [
        (["--prompts", "p.txt", "--tokens", "1,2"], "give --prompts FILE, or one --prompt / --tokens, not both"),
        (["--prompt", "hi", "--tokens", "1,2"], "give either --prompt or --tokens, not both"),
        ([], "give --prompt TEXT or --tokens IDS"),
        (["--prompt", "hi"], "--prompt needs a tokenizer.json in --model-dir; give --tokens instead"),
        (["--tokens", "1,x"], "--tokens must be comma-separated integers >= 0, got '1,x'"),
        (["--tokens", "1,-1"], "--tokens must be comma-separated integers >= 0, got '1,-1'"),
        (["--tokens", "1_0"], "--tokens must be comma-separated integers >= 0, got '1_0'"),
        (["--prompts", "/nonexistent/p.txt"], "cannot read /nonexistent/p.txt: No such file or directory"),
    ],
)
def test_generate_names_prompt_flags_that_do_not_fit_before_the_model_loads(flags, want, capsys, monkeypatch):
    from fullthrottle.cli import generate

    def no_load(*a, **k):
        raise AssertionError("the model was loaded before the flags were checked")

    monkeypatch.setattr(generate, "random_llama", no_load)
    assert main(["generate", "--random", "tiny", *flags]) == 2
    assert capsys.readouterr().err == f"fullthrottle: error: {want}\n"


def test_generate_names_what_a_cpu_run_leaves_out_and_the_context_it_exceeds(capsys):
    assert (
        main(
            [
                "generate",
                "--random",
                "tiny",
                "--tokens",
                "1,2",
                "--max-new-tokens",
                "3",
                "--device",
                "cpu",
                "--dtype",
                "bfloat16",
            ]
        )
        == 0
    )
    err = capsys.readouterr().err
    assert "--dtype bfloat16 needs CUDA: this run on cpu computes in float32" in err and "float32)" in err
    assert main(["generate", "--random", "tiny", "--tokens", "1,2", "--max-new-tokens", "5000", "--device", "cpu"]) == 2
    assert "2 tokens + --max-new-tokens 5000 exceed the model's context of 4096" in capsys.readouterr().err
    # (in the flags' own words: it said "prompt 0: ... max_new_tokens 64 exceeds max_seq_len 2")
    assert main(["generate", "--random", "tiny", "--tokens", "1", "--max-seq-len", "2", "--device", "cpu"]) == 2
    assert "the prompt's 1 tokens + --max-new-tokens 64 exceed --max-seq-len 2" in capsys.readouterr().err


def test_random_7b_that_cannot_fit_is_refused_before_it_is_built():
    """Llama-2-7B with random weights needs 13.5 GB in bf16 (27 GB in fp32): checked against the free
    memory before any allocation, with the way out named."""
    import torch

    from fullthrottle.cli import _check_memory_for, _llama_bytes
    from fullthrottle.workloads.llm.llama import LlamaConfig

    cfg = LlamaConfig.llama2_7b()
    assert _llama_bytes(cfg, torch.bfloat16) == 13_476_831_232
    with pytest.raises(ValueError, match=r"need 25\.1 GiB in float32 on cpu, but only 16\.0 GiB is free") as e:
        _check_memory_for(cfg, torch.device("cpu"), torch.float32, free=16 * 2**30)
    # (the way out: a GPU; on the CPU --dtype bfloat16 still computes in float32)
    assert "run it on a GPU, --device cuda" in str(e.value) and "--dtype bfloat16)" not in str(e.value)
    _check_memory_for(cfg, torch.device("cpu"), torch.bfloat16, free=16 * 2**30)  # fits: no error


def test_embed_input_lines_end_at_newline_and_jsonl_errors_name_their_line(tmp_path):
    """A lone \\r is text, not a line break (\\r\\n still ends a line); a bad .jsonl line is named by
    its number in the file, not by json's position inside that one line."""
    from fullthrottle.cli import _read_texts

    src = tmp_path / "in.txt"
    src.write_bytes(b"one\rstill one\r\ntwo\nthree")
    assert list(_read_texts(str(src))) == ["one\rstill one", "two", "three"]
    bad = tmp_path / "in.jsonl"
    bad.write_text('{"text": "a"}\n"b"\n\n{"text": oops}\n')
    got = _read_texts(str(bad))
    assert next(got) == "a" and next(got) == "b"
    with pytest.raises(ValueError, match=r"line 3: a blank line \(a .jsonl line is a JSON string or an object"):
        next(got)  # (a blank line is no JSON text: not an empty text embedded)
    errors: dict[int, str] = {}  # (the CLI's way: the line's error, and its place kept)
    assert list(_read_texts(str(bad), bad=errors)) == ["a", "b", "", ""]
    assert errors == {
        2: "line 3: a blank line (a .jsonl line is a JSON string or an object with a string field 'text')",
        3: "line 4: not valid JSON (Expecting value at character 10)",
    }
    deep = tmp_path / "deep.jsonl"  # JSON nested past Python's recursion limit; an integer of 5000 digits
    deep.write_text('"a"\n' + "[" * 100000 + "]" * 100000 + "\n" + "1" * 5000 + '\n"b"\n')
    errors = {}
    assert list(_read_texts(str(deep), bad=errors)) == ["a", "", "", "b"]
    assert errors[1] == "line 2: not valid JSON here (nested too deep)" and errors[2].startswith(
        "line 3: not valid JSON here"
    )
    odd = tmp_path / "odd.jsonl"  # a byte-order mark; JSON that is no text; a lone surrogate escape
    odd.write_bytes(b'\xef\xbb\xbf{"text": "a"}\r\n5\nnull\n[1]\n{"text": "x\\ud800"}\n"ok"\n')
    errors = {}
    assert list(_read_texts(str(odd), bad=errors)) == ["a", "", "", "", "", "ok"]
    want = "a line must be a JSON string or an object with a string field 'text', not "
    assert errors == {
        1: f"line 2: {want}a number",
        2: f"line 3: {want}null",
        3: f"line 4: {want}an array",
        4: "line 5: not valid Unicode (a lone surrogate escape at character 2 of its text)",
    }


def test_the_library_names_of_the_readme_import_from_the_package():
    """What the README's library lines use comes from ``fullthrottle`` itself, each the object of its module."""
    import fullthrottle
    from fullthrottle import Config, Embedder, Generator, Pipeline, load_hf
    from fullthrottle.workloads.embed import Embedder as E
    from fullthrottle.workloads.llm.generate import Generator as G
    from fullthrottle.workloads.llm.llama import load_hf as L

    assert (Embedder, Generator, load_hf) == (E, G, L) and Config and Pipeline
    assert set(fullthrottle.__all__) <= set(dir(fullthrottle))
    with pytest.raises(AttributeError, match="no attribute 'Embeder'"):
        fullthrottle.Embeder  # noqa: B018


def test_help_imports_no_torch_and_ctrl_c_while_starting_is_clean(samples):
    """``import fullthrottle`` (and so the CLI's --help) does not import torch; a Ctrl-C while
    ``classify`` starts (importing torch, building the model) ends it with 130 and one line, no
    traceback."""
    import os
    import signal
    import time

    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    out = subprocess.run(
        [sys.executable, "-c", "import sys, fullthrottle, fullthrottle.cli; print('torch' in sys.modules)"],
        capture_output=True,
        text=True,
        env=env,
        timeout=60,
    )
    assert out.stdout.strip() == "False", out.stderr
    for delay in (0.5, 1.5):
        p = subprocess.Popen(
            [sys.executable, "-m", "fullthrottle.cli", "classify", str(samples[0]), "--no-progress"],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=env,
        )
        time.sleep(delay)
        p.send_signal(signal.SIGINT)
        _, err = p.communicate(timeout=120)
        if p.returncode == 0:  # (finished before the signal: nothing to check)
            continue
        assert p.returncode == 130, (delay, p.returncode, err[-2000:])
        assert "Traceback" not in err and "interrupted" in err, err[-2000:]


def test_odd_file_names_stay_on_one_line_and_empty_out_is_refused(samples, tmp_path, capsys, monkeypatch):
    """A file name with a newline prints escaped, on its own line; --out '' and --report-json '-' while
    stdout carries the results are usage errors."""
    odd = tmp_path / "new\nline.jpg"
    odd.write_bytes(samples[0].read_bytes())
    rc = main(["classify", str(odd), "--device", "cpu", "--no-progress", "--threads", "1"])
    out = capsys.readouterr().out.splitlines()
    assert rc == 0 and len(out) == 1 and out[0].startswith(str(tmp_path) + "/new\\nline.jpg: "), out
    latin = os.path.join(os.fsencode(tmp_path), b"caf\xe9.jpg")  # not UTF-8: shown as in the JSON lines
    with open(latin, "wb") as f:
        f.write(samples[0].read_bytes())
    assert main(["classify", os.fsdecode(latin), "--device", "cpu", "--no-progress", "--threads", "1"]) == 0
    assert capsys.readouterr().out.startswith(str(tmp_path) + "/caf\\xe9.jpg: ")
    assert main(["classify", str(odd), "--device", "cpu", "--out", ""]) == 2
    assert "--out needs a file name ('-' for stdout)" in capsys.readouterr().err
    monkeypatch.chdir(tmp_path)  # (a file named '-' would land here)
    assert main(["classify", str(odd), "--device", "cpu", "--report-json", "-"]) == 2
    assert "--report-json - would write the report to stdout, which carries the results" in capsys.readouterr().err
    if os.path.exists("/dev/stdout"):
        assert main(["classify", str(odd), "--device", "cpu", "--report-json", "/dev/stdout"]) == 2
        assert "stdout, which carries the results" in capsys.readouterr().err
    assert main(["embed", "-", "--out", str(tmp_path / "v.npy"), "--report-json", "-"]) == 2
    assert not (tmp_path / "-").exists()


def test_flag_defaults_are_the_dataclasses_defaults():
    """Every default is stated once: classify's and serve's flags read theirs from Config and ServeOptions
    (serve's batch wait from server.options, where it is stated)."""
    from fullthrottle.cli.parser import build_parser
    from fullthrottle.core.config import Config
    from fullthrottle.server.options import MAX_CONNECTIONS, SERVE_MAX_WAIT_MS, ServeOptions

    p = build_parser()
    c = p.parse_args(["classify"])
    v = p.parse_args(["serve"])
    assert (c.max_wait_ms, v.max_wait_ms) == (Config.max_wait_ms, SERVE_MAX_WAIT_MS)
    for a in (c, v):
        assert (a.preprocess, a.device, a.graphs, a.top_k) == (
            Config.preprocess,
            Config.device,
            Config.graphs,
            Config.top_k,
        )
    assert c.batch_size == v.max_batch_size == Config.max_batch_size
    from fullthrottle.core.config import LlmSettings
    from fullthrottle.server.options import SERVE_MAX_PREFILL_TOKENS

    assert (v.llm_max_batch, v.llm_kv_pages, v.llm_logprobs, v.llm_kv_dtype) == (
        LlmSettings.max_batch,
        LlmSettings.kv_pages,
        LlmSettings.logprobs,
        LlmSettings.kv_dtype,
    )
    # (a server prefills less per step than the library does offline: its streams wait on each step)
    assert v.llm_max_prefill_tokens == SERVE_MAX_PREFILL_TOKENS < LlmSettings.max_prefill_tokens
    assert p.parse_args(["serve", "--llm-max-prefill-tokens", "7"]).llm_max_prefill_tokens == 7
    assert p.parse_args(["serve", "--llm-kv-pages", "auto"]).llm_kv_pages == "auto"
    assert p.parse_args(["serve", "--llm-kv-pages", "AUTO", "--llm-kv-dtype", "FP8"]).llm_kv_dtype == "fp8"
    assert p.parse_args(["generate", "--random", "tiny", "--prompts", "f", "--kv-dtype", "Fp8"]).kv_dtype == "fp8"
    assert p.parse_args(["serve", "--llm-kv-pages", "12"]).llm_kv_pages == 12
    o = ServeOptions()
    assert (v.max_queue, v.timeout_s, v.body_timeout_s, v.header_timeout_s, v.max_images) == (
        o.max_queue,
        o.timeout_s,
        o.body_timeout_s,
        o.header_timeout_s,
        o.max_images,
    )
    assert int(v.max_body_mb * 2**20) == o.max_body_bytes and v.max_request_megapixels * 1e6 == o.max_request_pixels
    assert v.max_connections_per_client == o.max_connections_per_client and v.max_connections == MAX_CONNECTIONS
    from fullthrottle.core.config import LlmSettings
    from fullthrottle.workloads.llm.generate import Generator

    assert (v.llm_max_batch, v.llm_logprobs) == (LlmSettings.max_batch, LlmSettings.logprobs)
    gen_defaults = {k: p.default for k, p in inspect.signature(Generator).parameters.items()}
    for f in dataclasses.fields(LlmSettings):  # the Generator's defaults are these fields'
        # (max_seq_len None: the field's, capped at the model's context; test_llm checks it)
        assert gen_defaults[f.name] == (None if f.name == "max_seq_len" else f.default), f.name


@pytest.mark.parametrize("sig", ["SIGINT", "SIGTERM"])
def test_ctrl_c_mid_run_with_decoder_processes_leaves_no_process_and_no_shared_memory(samples, tmp_path, sig):
    """A terminal's Ctrl-C (SIGINT to the foreground process group) in the middle of a run with
    decoder processes: exit 130, every decoder process gone, no shared-memory file left behind.
    SIGTERM to the command alone (a service manager's stop) does the same, exit 143."""
    import os
    import signal
    import time

    from procs import alive, children

    folder = tmp_path / "many"
    folder.mkdir()
    for i in range(3000):
        (folder / f"{i:05d}.jpg").symlink_to(samples[i % len(samples)])
    shm0 = set(os.listdir("/dev/shm")) if os.path.isdir("/dev/shm") else set()
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    cmd = [sys.executable, "-m", "fullthrottle.cli", "classify", str(folder), "--device", "cpu", "--model", "resnet18"]
    p = subprocess.Popen(
        [*cmd, "--preprocess", "processes", "--threads", "2", "--no-progress", "--out", str(tmp_path / "o.jsonl")],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
        start_new_session=True,  # its own process group, as a terminal's foreground job has
    )
    out = tmp_path / "o.jsonl"
    deadline = time.time() + 120
    while time.time() < deadline and not (out.exists() and out.stat().st_size > 0):
        time.sleep(0.1)  # until results flow: the decoder processes are working
    workers = children(p.pid)
    assert len(workers) >= 2, workers
    if sig == "SIGINT":
        os.killpg(p.pid, signal.SIGINT)
    else:
        os.kill(p.pid, signal.SIGTERM)
    _, err = p.communicate(timeout=60)
    assert p.returncode == (130 if sig == "SIGINT" else 143), err[-2000:]
    assert ("interrupted: stopping" if sig == "SIGINT" else "terminated: stopping") in err

    time.sleep(0.5)
    assert not [w for w in workers if alive(w)]
    shm1 = set(os.listdir("/dev/shm")) if os.path.isdir("/dev/shm") else set()
    assert shm1 <= shm0, shm1 - shm0


def test_an_empty_weights_path_is_named_as_empty_not_as_the_current_folder(samples, capsys):
    """... and a name of spaces or of bytes that are not UTF-8 is shown as load errors show names."""
    for argv in (["classify", str(samples[0]), "--device", "cpu"], ["serve", "--device", "cpu"]):
        assert main([*argv, "--weights="]) == 2
        assert capsys.readouterr().err.endswith("fullthrottle: error: cannot read weights: the path given is empty\n")
        for name, shown in ((" ", "' '"), (os.fsdecode(b"w\xe9.pth"), "w\\xe9.pth")):
            assert main([*argv, f"--weights={name}"]) == 2
            assert capsys.readouterr().err.endswith(f"fullthrottle: error: weights file not found: {shown}\n")
    # serve without the classifier checks --weights as classify does: a folder is named as one
    assert main(["serve", "--device", "cpu", "--no-classify", f"--weights={samples[0].parent}"]) == 2
    assert capsys.readouterr().err.endswith("it is a directory, not a file\n")


def test_a_value_that_starts_with_a_dash_is_said_how_to_give(capsys):
    """argparse reads ``--tokens -1,2`` or ``--prompt "-x"`` as an option and says only "expected one
    argument": the error also says how to give such a value (a subcommand's parser too)."""
    for argv, flag in (
        (["generate", "--random", "tiny", "--tokens", "-1,2"], "--tokens"),
        (["classify", "--out"], "--out"),
    ):
        with pytest.raises(SystemExit) as e:
            main(argv)
        err = capsys.readouterr().err
        assert e.value.code == 2 and err.rstrip().endswith(
            f"argument {flag}: expected one argument (to give one that starts with '-': {flag}=VALUE)"
        ), err


def test_a_port_out_of_range_is_a_usage_error_before_anything_loads(capsys):
    with pytest.raises(SystemExit) as e:
        main(["serve", "--port", "70000"])
    assert e.value.code == 2 and "must be a port number 0..65535, got 70000" in capsys.readouterr().err


@pytest.mark.parametrize(
    "argv, want",
    [
        (["serve", "--llm-logprobs", "21"], "argument --llm-logprobs: must be 0-20, got 21"),
        (["bench", "threads", "--threads", "0,abc"], "argument --threads: expected comma-separated integers"),
        (["bench", "threads", "--threads", ""], "argument --threads: expected comma-separated integers"),
        (["bench", "batch", "--batches", "8,0"], "argument --batches: expected integers >= 1, got '8,0'"),
        (["serve", "--llm-random", "tiny", "--llm-max-seq-len", "1"], "argument --llm-max-seq-len: must be >= 2"),
        (
            ["generate", "--random", "tiny", "--tokens", "1", "--max-seq-len", "1"],
            "argument --max-seq-len: must be >= 2",
        ),
    ],
)
def test_number_flags_are_checked_before_anything_loads(argv, want, capsys):
    """Such values are usage errors, exit 2 with argparse's 'error:' line (--llm-logprobs 21 was refused
    once the model had loaded; bench's lists printed their complaint bare, and '' ran the defaults; a
    server with --llm-max-seq-len 1 started and refused every request)."""
    with pytest.raises(SystemExit) as e:
        main(argv)
    assert e.value.code == 2 and want in capsys.readouterr().err


def test_serve_numbers_must_be_finite_and_an_output_may_not_overwrite_an_input(samples, tmp_path, capsys):
    for flag in ("--timeout-s", "--max-body-mb", "--body-timeout-s", "--header-timeout-s", "--max-request-megapixels"):
        for bad in ("nan", "inf", "0"):
            with pytest.raises(SystemExit) as e:
                main(["serve", flag, bad])
            assert e.value.code == 2 and f"argument {flag}: must be a finite number > 0" in capsys.readouterr().err
    for bad in ("1e9", "1e-7"):  # (a petabyte, or under one byte: every body 413)
        with pytest.raises(SystemExit) as e:
            main(["serve", "--max-body-mb", bad])
        assert (
            e.value.code == 2 and f"from 0.0000010 (one byte) to 1048576 (1 TiB), got {bad}" in capsys.readouterr().err
        )
    for flag, bad in (("--llm-max-prefill-tokens", "0"), ("--llm-max-prefill-tokens", "1.5"), ("--llm-kv-pages", "-1")):
        with pytest.raises(SystemExit) as e:
            main(["serve", flag, bad])
        assert e.value.code == 2 and f"argument {flag}" in capsys.readouterr().err
    with pytest.raises(SystemExit) as e:
        main(["serve", "--llm-kv-dtype", "int8"])
    assert e.value.code == 2 and "argument --llm-kv-dtype: invalid choice: 'int8'" in capsys.readouterr().err
    assert main(["serve", "--no-classify", "--llm-random", "tiny", "--device", "cpu", "--llm-kv-dtype", "fp8"]) == 2
    assert "--llm-kv-dtype fp8 needs paged KV memory: give --llm-kv-pages N or auto" in capsys.readouterr().err
    assert main(["serve", "--no-classify", "--llm-kv-dtype", "fp8", "--llm-max-seq-len", "64"]) == 2
    err = capsys.readouterr().err  # (LLM settings with no LLM: said, not silently dropped)
    assert "note: --llm-kv-dtype, --llm-max-seq-len: no LLM is served (--llm-model-dir or --llm-random)" in err
    assert "leaves nothing to serve: add --workload, --embed-model, --llm-model-dir or --llm-random" in err
    for bad in ("nan", "-1"):
        with pytest.raises(SystemExit) as e:
            main(["serve", "--max-wait-ms", bad])
        assert e.value.code == 2 and "argument --max-wait-ms: must be a finite number >= 0" in capsys.readouterr().err
    assert main(["serve", "--max-wait-ms", "1e9", "--timeout-s", "30"]) == 2  # (every request would 504)
    assert "--max-wait-ms 1e+09 must be below the request deadline --timeout-s 30" in capsys.readouterr().err
    photo = tmp_path / "a.jpg"
    photo.write_bytes(samples[0].read_bytes())
    size = photo.stat().st_size
    assert main(["classify", str(photo), "--device", "cpu", "--out", str(photo)]) == 2
    assert "is one of the inputs" in capsys.readouterr().err and photo.stat().st_size == size
    assert main(["classify", str(tmp_path), "--device", "cpu", "--report-json", str(tmp_path / "r.png")]) == 2
    assert "inside the input folder" in capsys.readouterr().err
    # a glob that matches the output now, or would match it once written; two outputs in one file
    for flag, out, pattern in (
        ("--out", photo, "*.jpg"),
        ("--report-json", photo, "*.jpg"),
        ("--out", tmp_path / "new.jpg", "*.jpg"),
        ("--out", photo, "**/*.jpg"),
        ("--out", photo, "[ab].jpg"),
    ):
        assert main(["classify", str(tmp_path / pattern), "--device", "cpu", flag, str(out)]) == 2
        assert "matches the input pattern" in capsys.readouterr().err and photo.stat().st_size == size
    (tmp_path / "sub").mkdir()  # a glob's '*' stays within one folder, as glob's does: no refusal here
    main(
        [
            "classify",
            str(tmp_path / "*"),
            "--device",
            "cpu",
            "--threads",
            "1",
            "--out",
            str(tmp_path / "sub" / "r.jsonl"),
        ]
    )
    assert "matches the input pattern" not in capsys.readouterr().err
    same = str(tmp_path / "same.json")
    assert main(["classify", str(photo), "--device", "cpu", "--out", same, "--report-json", same]) == 2
    assert "--out and --report-json name the same file" in capsys.readouterr().err


def test_a_non_integer_count_is_named_plainly(capsys):
    with pytest.raises(SystemExit) as e:
        main(["classify", "--batch-size", "abc"])
    err = capsys.readouterr().err
    assert (
        e.value.code == 2
        and "argument --batch-size: must be an integer, got 'abc'" in err
        and "positive_int" not in err
    )


def test_the_pixel_limit_is_a_flag_and_its_error_names_it(samples, tmp_path, capsys):
    out = tmp_path / "r.jsonl"
    rc = main(
        [
            "classify",
            str(samples[0]),
            "--device",
            "cpu",
            "--no-progress",
            "--out",
            str(out),
            "--max-image-megapixels",
            "0.01",
        ]
    )
    assert rc == 1
    err = json.loads(out.read_text())["error"]
    assert "exceeds the limit of 0.01 megapixels" in err and "--max-image-megapixels" in err
    assert main(["classify", str(samples[0]), "--device", "cpu", "--no-progress", "--out", str(out)]) == 0


def test_generate_many_reads_a_bom_first_line_as_json_and_a_full_out_is_exit_2(tmp_path, capsys):
    """``generate --prompts``: a UTF-8 byte-order mark before the first line (as Windows editors write)
    leaves that line a JSON request, answered like the same line without it (it was taken as a text
    prompt); an --out that fills up is "cannot write --out", exit 2 (it was a traceback, exit 1)."""
    f = tmp_path / "p.jsonl"
    f.write_bytes(b'\xef\xbb\xbf{"prompt": [5, 6, 7], "max_tokens": 3}\r\n{"prompt": [5, 6, 7], "max_tokens": 3}\r\n')
    out = tmp_path / "o.jsonl"
    args = [
        "generate",
        "--random",
        "tiny",
        "--device",
        "cpu",
        "--no-progress",
        "--temperature",
        "0",
        "--prompts",
        str(f),
    ]
    assert main([*args, "--out", str(out)]) == 0
    first, second = (json.loads(line) for line in out.read_text().splitlines())
    assert "error" not in first and len(first["token_ids"]) == 3 and first["token_ids"] == second["token_ids"]
    if os.path.exists("/dev/full"):
        capsys.readouterr()
        assert main([*args, "--out", "/dev/full"]) == 2
        assert "cannot write --out /dev/full: No space left on device" in capsys.readouterr().err


def test_generate_many_with_text_prompts_gives_a_bad_line_its_own_error(tmp_path, make_tiny_llama, tiny_text):
    """Text prompts are checked once, each line alone: one that is not valid Unicode fails alone."""
    from types import SimpleNamespace

    from fullthrottle.cli.generate_many import generate_many

    src, out = tmp_path / "reqs.jsonl", tmp_path / "out.jsonl"
    src.write_text('hello world\n{"prompt": "bad \\ud800 text"}\n{"prompt": "the quick fox", "max_tokens": 3}\n')
    args = SimpleNamespace(
        prompts=str(src),
        out=str(out),
        max_new_tokens=5,
        temperature=0.0,
        top_k=0,
        top_p=1.0,
        seed=None,
        max_batch=2,
        max_seq_len=None,
        graphs=False,
        no_progress=True,
        kv_pages=0,
        kv_dtype="auto",
    )
    model = make_tiny_llama(vocab_size=tiny_text.tokenizer.get_vocab_size(), max_position_embeddings=64)
    new, gen, failed = generate_many(args, model, tiny_text, None)
    got = [json.loads(line) for line in out.read_text().splitlines()]
    assert failed == 1 and "not valid Unicode" in got[1]["error"] and "is the input UTF-8?" in got[1]["error"]
    assert [len(got[0]["token_ids"]), len(got[2]["token_ids"])] == [5, 3] and new == 8
    assert gen.max_seq_len == max(len(tiny_text.encode(t)) + m for t, m in (("hello world", 5), ("the quick fox", 3)))


USER_MODEL = '''
import torch
from fullthrottle.workloads.classify.transform import Transform


class ColourNet(torch.nn.Module):
    """Three classes: the image's strongest colour channel."""

    input_transform = Transform(48, 40, (0.0, 0.0, 0.0), (1.0, 1.0, 1.0))
    labels = ["red", "green", "blue"]

    def __init__(self):
        super().__init__()
        self.scale = torch.nn.Parameter(torch.ones(1))

    def forward(self, x):  # (B, 3, 40, 40) -> (B, 3)
        assert x.shape[-2:] == (40, 40), x.shape
        return x.mean(dim=(2, 3)) * 20 * self.scale


from fullthrottle.workloads.classify.models import ModelSpec

NO_TRANSFORM = ModelSpec(ColourNet, None, None, "a spec without its transform")


class NeedsArgs(ColourNet):
    def __init__(self, width):
        super().__init__()


class RaisesInInit(ColourNet):
    def __init__(self):
        raise KeyError("no such layer")


class OneRowForABatch(ColourNet):
    def forward(self, x):  # (B, 3, 40, 40) -> (1, 3): not one row per image
        return super().forward(x)[:1]


class TwoLabelsThreeClasses(ColourNet):
    labels = ["red", "green"]


class NoLabels(ColourNet):
    labels = None


class Counted(ColourNet):
    built = 0

    def __init__(self):
        super().__init__()
        Counted.built += 1


class LabelsNotStrings(ColourNet):
    labels = [1, 2, 3]


class RaisesOnBlue(ColourNet):
    def forward(self, x):  # fails any batch holding an image whose blue channel wins
        y = super().forward(x)
        if bool((y.argmax(1) == 2).any()):
            raise RuntimeError("no blue")
        return y


class NaNForBlue(ColourNet):
    def forward(self, x):  # NaN logits for the images whose blue channel wins
        y = super().forward(x)
        return torch.where(y.argmax(1, keepdim=True) == 2, torch.nan, y)
'''


def test_model_of_ones_own_by_module_and_class(tmp_path, monkeypatch, capsys):
    """--model MODULE:CLASS: a class in the current folder, built with no arguments, brings its own
    crop (40 px) and labels; a name that is neither known nor MODULE:CLASS is a usage error, and a
    MODULE:CLASS that does not import is an error before anything starts, in classify and serve."""
    from PIL import Image

    (tmp_path / "colour_models.py").write_text(USER_MODEL)
    monkeypatch.chdir(tmp_path)
    for name, rgb in (("r.jpg", (230, 20, 20)), ("g.jpg", (20, 230, 20)), ("b.jpg", (20, 20, 230))):
        Image.new("RGB", (64, 50), rgb).save(tmp_path / name, quality=95)
    args = ["--model", "colour_models:ColourNet", "--device", "cpu", "--no-progress", "--out", "-", "--threads", "1"]
    rc = main(["classify", *(str(tmp_path / n) for n in ("r.jpg", "g.jpg", "b.jpg")), *args])
    out, err = capsys.readouterr()
    out = out.splitlines()
    assert rc == 0, out
    assert [json.loads(line)["top_k"][0]["label"] for line in out] == ["red", "green", "blue"], out
    assert "more than the model's" not in err  # (the default top-k over 3 classes lists them, unremarked)
    # without labels, 3 classes are named by their ids (not ImageNet's first names), and --top-k 4 lists 3
    rc = main(["classify", "r.jpg", "b.jpg", *args[:1], "colour_models:NoLabels", *args[2:], "--top-k", "4"])
    out, err = capsys.readouterr()
    tops = [[t["label"] for t in json.loads(line)["top_k"]] for line in out.splitlines()]
    assert rc == 0 and [t[0] for t in tops] == ["0", "2"] and all(len(t) == 3 for t in tops), tops
    assert "more than the model's 3 classes" in err and "randomly initialised" not in err, err
    assert main(["classify", "r.jpg", *args[:1], "colour_models:Counted", *args[2:]]) == 0
    assert sys.modules["colour_models"].Counted.built == 1  # the user's model is built once a run
    capsys.readouterr()
    with pytest.raises(SystemExit) as e:
        main(["classify", "r.jpg", "--model", "resnet9000"])
    assert e.value.code == 2 and "MODULE:CLASS" in capsys.readouterr().err
    assert main(["classify", "r.jpg", "--device", "cpu", "--threads", "1", "--model", "colour_models:Nope"]) == 2
    assert "colour_models has no Nope" in capsys.readouterr().err
    assert (
        main(["classify", "r.jpg", "--device", "cpu", "--threads", "1", "--model", "colour_models:NO_TRANSFORM"]) == 2
    )
    assert "its transform must be a Transform, got NoneType" in capsys.readouterr().err
    assert main(["serve", "--device", "cpu", "--model", "no_such_module_q:Net"]) == 2
    assert "cannot import no_such_module_q" in capsys.readouterr().err


def test_models_of_ones_own_that_fail_say_how(tmp_path, monkeypatch, capsys):
    """A user's MODULE:CLASS that cannot be imported or built is a usage error (exit 2) naming the
    module or class and what went wrong, never a traceback; labels that are not class names are
    refused, and so is a model whose output is not one row of logits per image, or whose labels name
    another number of classes; NaN logits fail their own images
    (``non_finite``), and no JSON line holds a NaN."""
    from PIL import Image

    (tmp_path / "colour_models.py").write_text(USER_MODEL)
    (tmp_path / "bad_syntax.py").write_text("def f(:\n")
    (tmp_path / "exits_on_import.py").write_text("import sys\nsys.exit(3)\n")
    (tmp_path / "raises_on_import.py").write_text("raise RuntimeError('no GPU here')\n")
    monkeypatch.chdir(tmp_path)
    for name, rgb in (("r.jpg", (230, 20, 20)), ("g.jpg", (20, 230, 20)), ("b.jpg", (20, 20, 230))):
        Image.new("RGB", (64, 50), rgb).save(tmp_path / name, quality=95)
    run = ["--device", "cpu", "--threads", "1", "--no-progress", "--out", "-"]
    for model, said in (
        ("bad_syntax:Net", "bad_syntax has a syntax error"),
        ("exits_on_import:Net", "importing exits_on_import failed: exit(3)"),
        ("raises_on_import:Net", "importing raises_on_import failed: RuntimeError: no GPU here"),
        (".colour_models:ColourNet", "a relative module name cannot be imported"),
        ("colour_models:NeedsArgs", "NeedsArgs() failed: TypeError"),
        ("colour_models:RaisesInInit", "RaisesInInit() failed: KeyError: 'no such layer'"),
        ("colour_models:LabelsNotStrings", "LabelsNotStrings.labels must be a sequence of class names"),
        # the output contract broken, or labels for another number of classes: found at start-up (as
        # capture's warm-up finds it on CUDA), not once per image
        ("colour_models:OneRowForABatch", "logits (B, C), one row per image; it gave (1, 3)"),
        ("colour_models:TwoLabelsThreeClasses", "the model gives 3 classes, its labels name 2"),
    ):
        assert main(["classify", "r.jpg", "--model", model, *run]) == 2, model
        out, err = capsys.readouterr()
        assert said in err and "Traceback" not in err and not out, (model, err)
    main(["classify", "r.jpg", "g.jpg", "b.jpg", "--model", "colour_models:NaNForBlue", *run])
    lines = capsys.readouterr().out.splitlines()

    def no_nan(token):
        raise AssertionError(f"{token} in the JSON lines: {lines}")

    rows = [json.loads(line, parse_constant=no_nan) for line in lines]
    assert [r.get("error_kind") for r in rows] == [None, None, "non_finite"], rows
    assert [r["top_k"][0]["label"] for r in rows[:2]] == ["red", "green"]
    # a model that raises on one image's batch: its rows run one by one, so only that image fails
    assert main(["classify", "r.jpg", "b.jpg", "g.jpg", "--model", "colour_models:RaisesOnBlue", *run]) == 1
    rows = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert [r.get("error_kind") for r in rows] == [None, "compute_failed", None], rows
    assert "no blue" in rows[1]["error"] and [rows[0]["top_k"][0]["label"], rows[2]["top_k"][0]["label"]] == [
        "red",
        "green",
    ]


def test_a_dotted_module_class_is_pointed_at_the_colon(capsys):
    """``--model my_module.MyNet`` (a dot for the colon): the usage error shows the spelling meant."""
    with pytest.raises(SystemExit) as e:
        main(["classify", "--device", "cpu", "--model", "my_pkg.nets.MyNet"])
    assert e.value.code == 2 and "a colon between module and class: my_pkg.nets:MyNet" in capsys.readouterr().err


def test_an_output_may_not_overwrite_an_image_reached_through_a_symlinked_folder(samples, tmp_path, capsys):
    """The folder walk follows symlinked folders, so ``--out`` naming an image there (by the link's
    path or the real one), or any existing image file, is refused before anything is written; an
    existing results file is overwritten as usual."""
    import hashlib
    import shutil

    (tmp_path / "in").mkdir()
    (tmp_path / "outside").mkdir()
    shutil.copy(samples[0], tmp_path / "outside" / "b.jpg")
    shutil.copy(samples[1], tmp_path / "photo.png.bak")
    (tmp_path / "in" / "sub").symlink_to(tmp_path / "outside")
    before = hashlib.md5((tmp_path / "outside" / "b.jpg").read_bytes()).hexdigest()
    run = [str(tmp_path / "in"), "--device", "cpu", "--threads", "1", "--no-progress"]
    for out, said in (
        (tmp_path / "in" / "sub" / "b.jpg", "is an image file inside the input folder"),
        (tmp_path / "outside" / "b.jpg", "is an image file: writing it would destroy it"),
        (tmp_path / "photo.png.bak", "is an image file: writing it would destroy it"),
    ):
        assert main(["classify", *run, "--out", str(out)]) == 2, out
        assert said in capsys.readouterr().err, out
    assert hashlib.md5((tmp_path / "outside" / "b.jpg").read_bytes()).hexdigest() == before
    (tmp_path / "old.jsonl").write_text('{"index": 0}\n')
    assert main(["classify", *run, "--out", str(tmp_path / "old.jsonl")]) == 0
    assert json.loads((tmp_path / "old.jsonl").read_text().splitlines()[0])["id"].endswith("sub/b.jpg")


def test_a_top_k_past_the_model_s_classes_is_clamped_before_anything_is_allocated(tmp_path, monkeypatch, capsys):
    """--top-k of any size over the model's classes lists them all, with the note --top-k 2000 gets,
    whatever its size: the output buffers are as wide as the model's classes, never as the flag."""
    from PIL import Image

    (tmp_path / "colour_models.py").write_text(USER_MODEL)
    monkeypatch.chdir(tmp_path)
    Image.new("RGB", (64, 50), (230, 20, 20)).save(tmp_path / "r.jpg")
    run = ["r.jpg", "--model", "colour_models:ColourNet", "--device", "cpu", "--threads", "1", "--no-progress"]
    for k in ("99999999999999999999", "100000000", "4"):
        rc = main(["classify", *run, "--out", "-", "--top-k", k])
        out, err = capsys.readouterr()
        assert rc == 0, err
        labels = [t["label"] for t in json.loads(out)["top_k"]]
        assert labels[0] == "red" and sorted(labels) == ["blue", "green", "red"], out
        assert f"note: --top-k {k} is more than the model's 3 classes: each result lists all 3" in err, err


@pytest.mark.parametrize(
    "command,flag", [("classify", "--max-image-megapixels"), ("serve", "--max-request-megapixels")]
)
def test_a_megapixel_limit_past_any_pixel_count_is_a_usage_error(command, flag, capsys):
    """A megapixel limit whose count of pixels is no number (1e308 x 1e6 is infinite) or under one pixel
    is refused as nan, 0 and -1 are: one line, exit 2, before anything starts."""
    for bad in ("1e308", "1e-7"):
        with pytest.raises(SystemExit) as e:
            main([command, "--device", "cpu", flag, bad])
        err = capsys.readouterr().err
        last = err.strip().splitlines()[-1]  # (after argparse's usage lines)
        assert e.value.code == 2 and "Traceback" not in err, err
        assert last.startswith(f"fullthrottle {command}: error: argument {flag}: must be a finite number > 0 of"), err


def test_a_folder_passes_over_broken_links_without_an_image_name_and_a_dangling_link_is_not_found(
    samples, tmp_path, capsys
):
    """A folder gives only the files named like images (README): a link loop (l1 -> l2 -> l1) and a
    dangling link without an image extension are passed over, as the plain file notes is; a dangling
    link named like an image is not_found, in the folder as when given itself."""
    import shutil

    d = tmp_path / "photos"
    d.mkdir()
    shutil.copy(samples[0], d / "a.jpg")
    (d / "notes").write_text("not an image")
    (d / "l1").symlink_to("l2")
    (d / "l2").symlink_to("l1")
    (d / "dangling_noext").symlink_to(tmp_path / "nowhere")
    run = ["--device", "cpu", "--model", "resnet18", "--threads", "1", "--no-progress", "--out", "-"]
    assert main(["classify", str(d), *run]) == 0
    assert [json.loads(line)["id"] for line in capsys.readouterr().out.splitlines()] == [str(d / "a.jpg")]
    (d / "gone.jpg").symlink_to(tmp_path / "nowhere.jpg")
    assert main(["classify", str(d), str(d / "gone.jpg"), *run]) == 1
    rows = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert [r["id"] for r in rows] == [str(d / "a.jpg"), str(d / "gone.jpg"), str(d / "gone.jpg")], rows
    assert [r.get("error_kind") for r in rows] == [None, "not_found", "not_found"], rows


def test_the_report_json_goes_to_stdout_when_the_results_go_to_a_file(samples, tmp_path, capsys):
    """--out FILE --report-json - (or /dev/stdout): stdout carries the report's JSON and nothing else;
    with the results on stdout, --report-json - is refused, naming --report-json and why."""
    out = tmp_path / "r.jsonl"
    run = [str(samples[0]), "--device", "cpu", "--model", "resnet18", "--threads", "1", "--no-progress"]
    for report in ["-"] + (["/dev/stdout"] if os.path.exists("/dev/stdout") else []):
        rc = main(["classify", *run, "--out", str(out), "--report-json", report])
        stdout, err = capsys.readouterr()
        assert rc == 0, err
        assert json.loads(stdout)["ok"] == 1 and json.loads(out.read_text())["id"] == str(samples[0])
    for results in ([], ["--out", "-"]):
        assert main(["classify", *run, *results, "--report-json", "-"]) == 2
        stdout, err = capsys.readouterr()
        assert not stdout and "--report-json - would write the report to stdout, which carries the results" in err


def _cli_with_examples(args: list[str], **popen) -> subprocess.Popen:
    """``fullthrottle ARGS`` in a process of its own, the repository's ``examples`` importable (their
    workloads), stdin a pipe, stderr read as text; ``popen``: more Popen arguments (stdout, ...)."""
    from pathlib import Path

    import fullthrottle

    examples = Path(fullthrottle.__file__).parents[2] / "examples"
    env = {**os.environ, "PYTHONPATH": f"{Path(fullthrottle.__file__).parents[1]}{os.pathsep}{examples}"}
    env["PYTHONFAULTHANDLER"] = "1"  # (a process that hangs dumps its threads' stacks on SIGABRT)
    cmd = [sys.executable, "-m", "fullthrottle.cli", *args]
    return subprocess.Popen(cmd, stdin=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env, **popen)


@pytest.mark.parametrize("redirect", ["closed", "full"])
def test_stdout_closed_or_full_exits_2_with_one_line(samples, tmp_path, redirect):
    """Every command that writes to stdout (classify, run, generate, generate --prompts, embed's
    report, bench) says it cannot, in one line, and exits 2, whether stdout is closed (``1>&-``) or full."""
    import os
    from pathlib import Path

    if redirect == "full" and not os.path.exists("/dev/full"):
        pytest.skip("no /dev/full here")
    (tmp_path / "p.jsonl").write_text('{"prompt": "hi", "max_tokens": 3}\n')
    (tmp_path / "r.jsonl").write_text('{"texts": ["good"]}\n')
    commands = [
        (["classify", str(samples[0]), "--device", "cpu", "--no-progress"], None),
        (["classify", str(samples[0]), "--device", "cpu", "--no-progress", "--out", "-"], None),
        (["run", "-", "--device", "cpu", "--workload", "word_workload:Sentiment"], tmp_path / "r.jsonl"),
        (["generate", "--random", "tiny", "--device", "cpu", "--tokens", "1,2", "--max-new-tokens", "3"], None),
        (["generate", "--random", "tiny", "--device", "cpu", "--prompts", str(tmp_path / "p.jsonl")], None),
        (["embed", "-", "--device", "cpu", "--out", str(tmp_path / "e.npy"), "--report-json", "-"], "hi\n"),
        (["bench", "threads", "--quick", "--out", str(tmp_path / "b")], None),
    ]
    if redirect == "full":  # (classify on a full stdout: test_unwritable_out_exits_2_with_one_line)
        commands = commands[2:5] + commands[6:]
    why = "No space left on device" if redirect == "full" else "stdout is closed"
    with open("/dev/full" if redirect == "full" else os.devnull, "w") as sink:
        procs = [  # (all at once: the imports overlap)
            (
                args,
                stdin,
                _cli_with_examples(
                    args,
                    stdout=sink if redirect == "full" else None,
                    preexec_fn=None if redirect == "full" else lambda: os.close(1),
                ),
            )
            for args, stdin in commands
        ]
        for args, stdin, p in procs:
            _, err = p.communicate(stdin.read_text() if isinstance(stdin, Path) else stdin or "", timeout=300)
            assert p.returncode == 2, (args, p.returncode, err[-600:])
            assert f"fullthrottle: error: cannot write stdout: {why}" in err, (args, err[-600:])
            assert "Traceback" not in err and "Exception ignored" not in err, (args, err[-600:])


def test_reading_a_closed_stdin_exits_2_with_one_line(tmp_path):
    """``embed -``, ``generate --prompts -`` and ``run -`` started with stdin closed (``<&-``) say
    they cannot read it, in one line, and exit 2 (they raised AttributeError on sys.stdin None)."""
    commands = [
        ["embed", "-", "--device", "cpu", "--out", str(tmp_path / "e.npy")],
        ["generate", "--random", "tiny", "--device", "cpu", "--prompts", "-"],
        ["run", "-", "--device", "cpu", "--workload", "word_workload:Sentiment", "--out", str(tmp_path / "r.jsonl")],
    ]
    procs = [(args, _cli_with_examples(args, preexec_fn=lambda: os.close(0))) for args in commands]
    for args, p in procs:
        _, err = p.communicate("", timeout=300)
        assert p.returncode == 2, (args, p.returncode, err[-600:])
        assert "cannot read -" in err and "stdin is closed" in err and "Traceback" not in err, (args, err[-600:])


def test_sigterm_stops_run_embed_and_generate_as_ctrl_c_does_saying_so(tmp_path):
    """SIGTERM (a service manager's stop) to ``run``, ``embed`` and ``generate --prompts`` waiting on
    their input: each says "terminated" and exits 143, as classify does (they used to die by the
    signal, silently); a Ctrl-C still says "interrupted", exit 130."""
    import signal
    import time
    from pathlib import Path

    commands = [
        (["run", "-", "--device", "cpu", "--workload", "word_workload:Sentiment"], signal.SIGTERM),
        (["embed", "-", "--device", "cpu", "--out", str(tmp_path / "e.npy")], signal.SIGTERM),
        (["generate", "--random", "tiny", "--device", "cpu", "--prompts", "-"], signal.SIGTERM),
        (["generate", "--random", "tiny", "--device", "cpu", "--prompts", "-"], signal.SIGINT),
    ]
    procs = [(args, sig, _cli_with_examples(args, stdout=subprocess.DEVNULL)) for args, sig in commands]  # (at once)

    def reading_stdin(pid: int) -> bool:  # some thread of it blocked in read(fd, ...), fd stdin's pipe
        import os

        for task in Path(f"/proc/{pid}/task").iterdir():
            try:
                call = (task / "syscall").read_text().split()
                if len(call) > 1 and call[0] == "0":
                    fd = int(call[1], 16)
                    if os.readlink(f"/proc/{pid}/fd/{fd}") == os.readlink(f"/proc/{pid}/fd/0"):
                        return True
            except OSError:
                continue
        return False

    for args, sig, p in procs:
        deadline = time.time() + 240
        while time.time() < deadline and p.poll() is None and not reading_stdin(p.pid):
            time.sleep(0.1)
        time.sleep(0.3)
        p.send_signal(sig)
        _, err = p.communicate(timeout=60)
        want = ("terminated", 143) if sig == signal.SIGTERM else ("interrupted", 130)
        assert p.returncode == want[1], (args, p.returncode, err[-800:])
        assert err.strip().splitlines()[-1] == want[0], (args, err[-800:])
        assert "Traceback" not in err, (args, err[-800:])


def test_request_and_text_files_split_at_newlines_only_and_name_a_line_not_utf8(tmp_path):
    """``generate --prompts``, ``embed`` and ``run`` read lines alike: a form feed, a lone CR or U+2028
    inside a line is part of it (generate split there: one line became two requests, and the line
    numbers after it were off); a line that is not UTF-8 is that line's error in generate."""
    from types import SimpleNamespace

    from fullthrottle.cli import _read_texts
    from fullthrottle.cli.generate_many import read_requests
    from fullthrottle.cli.run import _bodies

    f = tmp_path / "p.txt"
    f.write_bytes("a\x0cb\r\nc\u2028d\n\xff\nlast\rline\n".encode().replace(b"\xc3\xbf", b"\xff"))
    args = SimpleNamespace(max_new_tokens=4, temperature=0.0, top_k=0, top_p=1.0, seed=None)
    got = read_requests(str(f), args, eos=2)
    assert [n for n, _ in got] == [1, 2, 3, 4]
    assert [b["prompt"] for _, b in (got[0], got[1], got[3])] == ["a\x0cb", "c\u2028d", "last\rline"]
    assert got[2][1] == "line 3: not valid UTF-8 (byte 0xff at byte 1)"
    assert list(_read_texts(str(f))) == ["a\x0cb", "c\u2028d", "\ufffd", "last\rline"]
    # a line that is a JSON list is the prompt's token ids (checked as a request's are); text in
    # brackets that is no JSON stays text; a broken list of token ids is an error
    f.write_text("[1, 2, 3]\n[INST] hi [/INST]\n[]\n[1, true]\n[1,2\n[ 1, , 2 ]\n[1, two\n")
    got = read_requests(str(f), args, eos=2)
    assert [r if isinstance(r, str) else r["prompt"] for _, r in got] == [
        [1, 2, 3],
        "[INST] hi [/INST]",
        [],
        [1, True],
        "line 5: not valid JSON: a line of token ids is a JSON list of integers, as [1, 2, 3]",
        "line 6: not valid JSON: a line of token ids is a JSON list of integers, as [1, 2, 3]",
        "[1, two",
    ]
    j = tmp_path / "r.jsonl"
    j.write_bytes(b'\xef\xbb\xbf{"inputs": [1]}\r\n\n{"inputs": "\xe2\x80\xa8"}\n')
    with open(j, "rb") as fh:
        assert list(_bodies(fh)) == [(1, {"inputs": [1]}, None), (3, {"inputs": "\u2028"}, None)]


def test_version_is_the_packages(capsys):
    """``fullthrottle --version`` prints the version pyproject.toml gives the package."""
    import tomllib
    from pathlib import Path

    import fullthrottle

    with pytest.raises(SystemExit) as e:
        main(["--version"])
    pyproject = tomllib.loads((Path(fullthrottle.__file__).parents[2] / "pyproject.toml").read_text())
    assert e.value.code == 0 and capsys.readouterr().out == f"fullthrottle {pyproject['project']['version']}\n"


def test_classify_reads_its_inputs_from_stdin_with_a_dash(samples, tmp_path, monkeypatch, capsys):
    """``classify -``: the inputs on stdin, one a line (blank lines skipped, a glob expanded, a name
    that is not UTF-8 kept as the file system's), answered in order among the other INPUTs; '-'
    twice or a closed stdin is a usage error (it was one item, "file not found: -")."""
    import io

    odd = tmp_path / os.fsdecode(b"caf\xe9.jpg")  # (a Latin-1 name: not UTF-8)
    odd.write_bytes(samples[2].read_bytes())
    listed = f"{samples[0]}\n\n{tmp_path / 'missing.jpg'}\r\n".encode() + os.fsencode(odd) + b"\n"
    bm = tmp_path / "BMW.jpg"  # (a name that begins as a BMP file does is a name)
    bm.write_bytes(samples[3].read_bytes())
    monkeypatch.setattr(sys, "stdin", io.TextIOWrapper(io.BytesIO(listed)))
    args = ["--device", "cpu", "--no-progress", "--out", "-", "--model", "efficientnet_lite0"]
    assert main(["classify", str(samples[1]), "-", *args]) == 1  # (one input missing)
    got = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    ids = [str(samples[1]), str(samples[0]), str(tmp_path / "missing.jpg"), str(tmp_path / "caf\\xe9.jpg")]
    assert [g["id"] for g in got] == ids and "file not found" in got[2]["error"] and "error" not in got[3]
    want = [s.stem.split("_", 1)[1].replace("_", " ") for s in (samples[1], samples[0], samples[2])]
    assert [got[i]["top_k"][0]["label"].lower() for i in (0, 1, 3)] == [w.lower() for w in want]
    assert main(["classify", "-", "-", *args]) == 2
    assert "'-' (the inputs on stdin) is given more than once" in capsys.readouterr().err
    monkeypatch.setattr(sys, "stdin", None)
    assert main(["classify", "-", *args]) == 2
    assert "cannot read the inputs from stdin: stdin is closed" in capsys.readouterr().err
    monkeypatch.chdir(tmp_path)
    (tmp_path / "exports" / "WEBP").mkdir(parents=True)  # (WEBP at a RIFF file's place in a name)
    (tmp_path / "exports" / "WEBP" / "a.jpg").write_bytes(samples[3].read_bytes())
    for name in ("BMW.jpg", "exports/WEBP/a.jpg"):  # (names that begin as a BMP or mention WEBP are names)
        monkeypatch.setattr(sys, "stdin", io.TextIOWrapper(io.BytesIO(name.encode() + b"\n")))
        assert main(["classify", "-", *args]) == 0
        assert json.loads(capsys.readouterr().out)["id"] == name
    from PIL import Image

    for fmt in ("JPEG", "PNG"):  # a photo piped in (a PNG's first line is \x89PNG\r\n)
        photo = io.BytesIO()
        Image.open(samples[0]).save(photo, fmt)
        monkeypatch.setattr(sys, "stdin", io.TextIOWrapper(io.BytesIO(photo.getvalue())))
        assert main(["classify", "-", *args]) == 2
        assert "error: stdin holds image data, not names: 'classify -' reads paths" in capsys.readouterr().err
    for empty in (b"", b"\n\n"):  # (nothing to classify: said, where the report is)
        monkeypatch.setattr(sys, "stdin", io.TextIOWrapper(io.BytesIO(empty)))
        assert main(["classify", "-", *args]) == 0
        assert "NOTE: stdin held no input: 'classify -' reads paths" in capsys.readouterr().err


def _answers_as_they_come(args: list[str], text: str, n: int) -> list[dict]:
    """``fullthrottle ARGS`` reading stdin, a pipe left open: ``text`` written to it, the first ``n``
    JSON lines it answers, then a Ctrl-C that must end it at once (exit 130, "interrupted")."""
    import queue
    import signal
    import threading
    import time

    p = _cli_with_examples(args, stdout=subprocess.PIPE)
    try:
        p.stdin.write(text)
        p.stdin.flush()
        lines: queue.Queue = queue.Queue()  # (a thread reads them: two may come in one read)
        threading.Thread(target=lambda: [lines.put(x) for x in p.stdout], daemon=True).start()
        got = [json.loads(lines.get(timeout=120)) for _ in range(n)]
        p.send_signal(signal.SIGINT)  # (stdin still open)
        t0 = time.time()
        try:
            code = p.wait(30)
        except subprocess.TimeoutExpired:  # (where it hangs: every thread's stack, from faulthandler)
            p.send_signal(signal.SIGABRT)
            p.wait(30)
            raise AssertionError("no exit 30 s after SIGINT:\n" + p.stderr.read()[-6000:]) from None
        err = p.stderr.read()
        assert code == 130 and time.time() - t0 < 10, (code, err[-3000:])
        assert err.strip().splitlines()[-1] == "interrupted"
        return got
    finally:
        if p.poll() is None:
            p.kill()


def test_run_from_a_pipe_that_stays_open_answers_each_line_and_stops_on_ctrl_c():
    """``run -`` on a pipe (or a terminal) that stays open: each request is answered as it comes
    (they waited for a chunk of 4 batches' requests or the end), and a Ctrl-C while it waits for
    more exits 130 at once."""
    args = ["run", "-", "--workload", "word_workload:Sentiment", "--device", "cpu"]
    got = _answers_as_they_come(args, '{"texts": ["a good day"]}\n{"texts": ["awful", "fine"]}\n', 2)
    assert [g["line"] for g in got] == [1, 2] and all("response" in g for g in got), got


def test_embed_from_a_pipe_writes_each_line_to_a_jsonl_file_as_it_comes(tmp_path):
    """``embed - --out FILE.jsonl`` on a pipe left open: the file holds each line's vector once it is
    embedded (it stayed in the file's buffer until about 8 KB more had come)."""
    import signal
    import time

    out = tmp_path / "o.jsonl"
    p = _cli_with_examples(["embed", "-", "--device", "cpu", "--out", str(out)])
    try:
        p.stdin.write("hello world\n")
        p.stdin.flush()
        deadline = time.time() + 120
        while time.time() < deadline and not (out.exists() and out.read_text().endswith("\n")):
            time.sleep(0.1)
        rows = [json.loads(x) for x in out.read_text().splitlines()]
        assert [r["index"] for r in rows] == [0] and len(rows[0]["embedding"]) == 384
        p.send_signal(signal.SIGINT)
        assert p.wait(30) == 130
    finally:
        if p.poll() is None:
            p.kill()


def test_generate_from_a_pipe_that_stays_open_answers_each_line_and_stops_on_ctrl_c(tmp_path):
    """``generate --prompts -`` on a pipe (or a terminal) that stays open: each request joins as its
    line comes and is answered once done (it read all of stdin first, so nothing came until the end);
    the tokens are those of the same requests from a file. A Ctrl-C while it waits exits 130 at once;
    an empty pipe holds no request (exit 2) and leaves --out as it was."""
    lines = "[1, 2, 3]\n[4, 5]\n"
    args = ["generate", "--random", "tiny", "--device", "cpu", "--max-new-tokens", "4", "--no-progress", "--prompts"]
    got = _answers_as_they_come([*args, "-"], lines, 2)
    (tmp_path / "p.txt").write_text(lines)
    p = _cli_with_examples([*args, str(tmp_path / "p.txt")], stdout=subprocess.PIPE)
    out, err = p.communicate("", timeout=300)
    assert p.returncode == 0, err[-600:]
    assert got == [json.loads(x) for x in out.splitlines()] and [g["line"] for g in got] == [1, 2], got
    kept = tmp_path / "kept.jsonl"  # (an empty pipe leaves --out as it was, as an empty FILE does)
    kept.write_text("precious\n")
    p = _cli_with_examples([*args, "-", "--out", str(kept)])
    _, err = p.communicate("", timeout=300)
    assert p.returncode == 2 and "fullthrottle: error: - holds no request" in err, err[-600:]
    assert kept.read_text() == "precious\n"


def test_embed_from_a_pipe_that_stays_open_answers_each_line_and_stops_on_ctrl_c():
    """``embed -`` on a pipe (or a terminal) that stays open: each line's vector is written as it
    comes (they waited for a chunk of 1,024 lines or the end), and a Ctrl-C while it waits for more
    exits 130 at once (it waited for the end of stdin)."""
    got = _answers_as_they_come(
        ["embed", "-", "--device", "cpu", "--out", "-"], "hello world\nthe quick brown fox\n", 2
    )
    assert [g["index"] for g in got] == [0, 1] and len(got[0]["embedding"]) == 384, got


def test_classify_interrupted_anywhere_in_writing_a_result_exits_130(tmp_path, monkeypatch, capsys):
    """A Ctrl-C raises KeyboardInterrupt at whichever bytecode the main thread is at: raised just
    after each C call of the results' writing (tqdm.write's bracket about it) in turn, classify says
    it was interrupted and exits 130 at once (not "RuntimeError: cannot release un-acquired lock",
    exit 1: tqdm takes its lock inside the ``try`` whose ``finally`` releases it)."""
    import threading

    import tqdm.std
    from PIL import Image

    import fullthrottle.cli.common as common

    (tmp_path / "colour_models.py").write_text(USER_MODEL)
    monkeypatch.chdir(tmp_path)
    for i in range(12):
        Image.new("RGB", (64, 50), (20 * i, 20, 230 - 10 * i)).save(tmp_path / f"{i}.jpg")
    args = ["classify", str(tmp_path), "--model", "colour_models:ColourNet", "--device", "cpu", "--threads", "1"]
    bracket = tqdm.std.tqdm.external_write_mode.__func__.__wrapped__.__code__
    for n in range(1, 7):
        state, got = {"armed": False, "calls": 0}, {}

        def at_nth_c_return(frame, event, arg, n=n):  # (in the bracket, once a result is being written)
            if event == "call" and frame.f_code is common._format_result.__code__:
                state["armed"] = True
            f = frame
            while f is not None and f.f_code is not bracket:
                f = f.f_back
            if event == "c_return" and f is not None and state["armed"]:
                state["calls"] += 1
                if state["calls"] == n:
                    raise KeyboardInterrupt

        def run():
            sys.setprofile(at_nth_c_return)
            try:
                got["rc"] = main(args)
            except BaseException as e:  # noqa: BLE001 - what escaped the command
                got["rc"] = repr(e)
            finally:
                sys.setprofile(None)

        t = threading.Thread(target=run, daemon=True)
        t.start()
        t.join(30)
        assert not t.is_alive(), f"classify hangs after an interrupt at C call {n} of a result's writing"
        assert got["rc"] == 130, f"C call {n}: {got['rc']}"
        assert "interrupted" in capsys.readouterr().err
