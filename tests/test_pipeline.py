import asyncio
import os
import time

import numpy as np
import pytest
import torch
from torch import nn
from torchvision.transforms import v2

from fullthrottle import Config, Pipeline, PipelineError
from fullthrottle.data.preprocess import preprocess
from fullthrottle.workloads.classify.models import WeightsError
from fullthrottle.workloads.classify.transform import TORCHVISION_IMAGENET

LABELS = [f"class{i}" for i in range(10)]


class Tiny(nn.Module):
    """A small CNN so that pipeline tests run fast on 2 CPU cores: (B,3,224,224) -> (B,10)."""

    def __init__(self, seed=0):
        super().__init__()
        torch.manual_seed(seed)
        self.conv = nn.Conv2d(3, 8, 7, stride=8)
        self.fc = nn.Linear(8, 10)

    def forward(self, x):
        return self.fc(torch.relu(self.conv(x)).mean(dim=(2, 3)))


NORM = v2.Normalize(mean=list(TORCHVISION_IMAGENET.mean), std=list(TORCHVISION_IMAGENET.std))  # (Tiny declares none)


def reference_logits(model, arrays):
    """Plain eager PyTorch on the same uint8 crops: (N,224,224,3) -> (N,C) float32."""
    x = torch.from_numpy(np.stack(arrays)).permute(0, 3, 1, 2).float() / 255.0
    with torch.no_grad():
        return model(NORM(x))


def tiny_pipe(**kw):
    kw.setdefault("device", "cpu")
    kw.setdefault("max_batch_size", 8)
    kw.setdefault("threads", 2)
    return Pipeline(Config(labels=LABELS, **kw), model=Tiny())


def test_resnet18_logits_equal_eager(samples):
    torch.manual_seed(0)
    pipe = Pipeline(Config(model="resnet18", device="cpu", max_batch_size=4))
    arrays = [preprocess(p.read_bytes()) for p in samples[:4]]
    x = torch.from_numpy(np.stack(arrays))
    ours = pipe.engine.forward(x)
    ref = reference_logits(pipe.engine.model, arrays)
    assert ours.shape == (4, 1000) and ours.dtype == torch.float32
    torch.testing.assert_close(ours, ref, atol=1e-5, rtol=0)
    # and through the whole pipeline: the top-5 probabilities are softmax of those logits
    res = pipe.classify([p for p in samples[:4]])
    pref, iref = torch.softmax(ref, -1).topk(5)
    for r, pr, ir in zip(res, pref, iref):
        assert r.class_ids == ir.tolist()
        np.testing.assert_allclose(r.probs, pr.numpy(), atol=1e-6)
        assert r.labels[0] == pipe.engine.labels[ir[0]]
    assert pipe.engine.random_weights


def test_order_preserved_with_5pct_corrupt(samples, no_thread_leak):
    model = Tiny()
    good = [p.read_bytes() for p in samples[:100]]
    inputs, expect = [], {}
    for i, data in enumerate(good):
        if i % 20 == 7:  # 5% corrupt, of three kinds
            bad = [b"", b"this is not an image", data[: len(data) // 3]][i % 3]
            inputs.append((f"bad{i}", bad))
        inputs.append((f"good{i}", data))
    ref = reference_logits(model, [preprocess(d) for d in good])
    ref_top = torch.softmax(ref, -1).topk(3)
    for i in range(len(good)):
        expect[f"good{i}"] = ref_top.indices[i].tolist()
    pipe = Pipeline(Config(labels=LABELS, device="cpu", max_batch_size=8, threads=2, top_k=3), model=model)
    res = list(pipe.run(inputs))
    assert [r.index for r in res] == list(range(len(inputs)))
    assert [r.id for r in res] == [i for i, _ in inputs]
    n_bad = 0
    for r in res:
        if r.id.startswith("bad"):
            n_bad += 1
            assert not r.ok and r.id in r.error
        else:
            assert r.ok, r.error
            assert r.class_ids == expect[r.id]
    assert n_bad == 5
    rep = pipe.last_report
    assert rep.ok == 100 and rep.failed == 5 and rep.items == 105


def test_unordered_gives_same_results(samples):
    pipe = tiny_pipe(ordered=False)
    inputs = [p for p in samples[:30]]
    a = {r.id: r.class_ids for r in pipe.run(inputs)}
    pipe2 = tiny_pipe()
    b = {r.id: r.class_ids for r in pipe2.run(inputs)}
    assert a == b and len(a) == 30


def test_memoryview_pairs_are_read_without_a_copy_and_give_what_bytes_give(samples, bad_dir):
    """``(id, memoryview)`` pairs (how the multi-process server's engine hands on the images of a
    request: views of its read buffer, an anonymous mapping) give the results ``(id, bytes)`` give,
    the bad inputs' errors included."""
    import mmap

    files = list(samples[:12]) + [bad_dir / n for n in ("truncated.jpg", "empty.jpg", "not-an-image.jpg", "cmyk.jpg")]
    blobs = [(p.name, p.read_bytes()) for p in files]
    buf = mmap.mmap(-1, sum(len(b) for _, b in blobs) + 1, flags=mmap.MAP_PRIVATE)
    views, at = [], 0
    for name, b in blobs:
        buf[at : at + len(b)] = b
        views.append((name, memoryview(buf)[at : at + len(b)]))
        at += len(b)
    want = list(tiny_pipe().run(blobs))
    got = list(tiny_pipe().run(views))
    assert [(r.id, r.class_ids, r.error) for r in got] == [(r.id, r.class_ids, r.error) for r in want]
    np.testing.assert_allclose([r.probs for r in got if r.ok], [r.probs for r in want if r.ok], rtol=1e-5)
    assert sum(not r.ok for r in got) == 3  # (probabilities: a batch's make-up may move the last bits)
    # a released view is its own item's error; bytes paths (os.scandir(b"dir")) are files as str ones
    gone = memoryview(blobs[0][1])
    gone.release()
    entries = sorted(os.scandir(os.fsencode(samples[0].parent)), key=lambda e: e.name)[:2]
    got = tiny_pipe().classify([blobs[1], ("gone", gone), *entries, (os.fsencode(blobs[1][0]), blobs[1][1])])
    assert got[0].ok and got[1].error.startswith("cannot read the bytes given: ") and "released" in got[1].error
    assert [r.class_ids for r in got[2:4]] == [
        r.class_ids for r in tiny_pipe().classify([os.fsdecode(e.path) for e in entries])
    ]
    assert (got[4].id, got[4].class_ids) == (blobs[1][0], got[0].class_ids)  # (a bytes id: its text)


def test_break_stops_every_thread(samples, no_thread_leak):
    pipe = tiny_pipe()
    n = 0
    for _ in pipe.run([p for p in samples] * 3):
        n += 1
        if n == 5:
            break
    assert n == 5
    # the report counts what was handed out, latencies included (not results left unconsumed)
    assert pipe.last_report.items == 5 and len(pipe.last_report.latencies_ms) == 5
    # the pipeline is usable again afterwards
    assert len(pipe.classify(samples[:3])) == 3


@pytest.mark.parametrize("kind", ["path", "bytes after a path"])
def test_slow_generator_of_paths_gets_each_result_before_its_next_item(samples, kind):
    """A generator that waits between items (a queue of requests, say): a file load in flight must
    run while the generator is blocked, so no item waits for later ones (each 0.3 s apart)."""
    pipe = tiny_pipe(max_batch_size=4, max_wait_ms=1)
    yielded, gap = {}, 0.3

    def slow():
        for i in range(4):
            yielded[i] = time.perf_counter()
            yield samples[i] if kind == "path" or i == 0 else (f"b{i}", samples[i].read_bytes())
            time.sleep(gap)

    list(pipe.run(samples[:2]))  # warm-up
    lat = [time.perf_counter() - yielded[r.index] for r in pipe.run(slow()) if r.ok]
    assert len(lat) == 4
    assert max(lat) < gap, f"an item waited for later ones: {lat}"


def test_a_raising_iterable_loses_nothing_before_it(samples):
    """The inputs iterable raising ends the stream there: every item before it is answered, then the
    error, named as the iterable's, is raised."""
    pipe = tiny_pipe()

    def broken():
        yield from (p.read_bytes() for p in samples[:5])
        raise ValueError("source broke")

    got = []
    with pytest.raises(PipelineError, match="inputs iterable raised ValueError: source broke") as e:
        for r in pipe.run(broken()):
            got.append(r)
    assert [r.index for r in got] == [0, 1, 2, 3, 4] and all(r.ok for r in got)
    assert isinstance(e.value.__cause__, ValueError)
    assert pipe.last_report.items == 5


def test_inputs_that_are_not_iterable_are_a_type_error_at_once():
    pipe = tiny_pipe()
    with pytest.raises(TypeError, match="iterable of paths, URLs, bytes.*got int"):
        next(pipe.run(42))

    async def agen():
        yield b""

    with pytest.raises(TypeError, match="async iterable"):
        next(pipe.run(agen()))
    with pytest.raises(TypeError, match=r"got a dict \(its keys would be the inputs: pass list\(d.values\(\)\)"):
        next(pipe.run({"a": b"\xff\xd8"}))  # (it read the key "a" as a path: file not found)
    assert len(pipe.classify([])) == 0  # not left busy


def test_cancel_async_iterator_stops_every_thread(samples, no_thread_leak):
    pipe = tiny_pipe()
    got = []

    async def consume():
        async for r in pipe.arun([p for p in samples] * 3):
            got.append(r)

    async def main():
        task = asyncio.create_task(consume())
        while len(got) < 3:
            await asyncio.sleep(0.01)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task

    asyncio.run(asyncio.wait_for(main(), 30))
    assert len(got) >= 3


def test_async_iterator_results(samples):
    pipe = tiny_pipe()

    async def main():
        return [r async for r in pipe.arun(samples[:12])]

    res = asyncio.run(main())
    assert [r.index for r in res] == list(range(12))
    sync = pipe.classify(samples[:12])
    assert [r.class_ids for r in res] == [r.class_ids for r in sync]


@pytest.mark.parametrize("preprocess", ["threads", "processes"])
def test_drop_leaves_the_items_it_names_undecoded_and_the_others_as_they_were(samples, preprocess):
    from fullthrottle.data.load import DROPPED

    inputs = [p.read_bytes() for p in samples[:24]] + [str(p) for p in samples[24:36]]
    with tiny_pipe(preprocess=preprocess) as pipe:
        ref = pipe.classify(inputs)
        got = list(pipe.run(inputs, drop=lambda i: i % 3 == 1))
    assert [r.index for r in got] == list(range(36))
    for r, want in zip(got, ref):
        if r.index % 3 == 1:
            assert r.error == DROPPED and not r.ok
        else:
            assert r.ok and r.class_ids == want.class_ids and r.probs == pytest.approx(want.probs, abs=1e-5)


def test_backpressure_bounds_items_in_flight(samples):
    """With a slow consumer the loader never runs more than max_in_flight items ahead."""
    data = samples[0].read_bytes()
    pulled = [0]

    def source():
        for i in range(200):
            pulled[0] += 1
            yield (f"x{i}", data)

    pipe = tiny_pipe(max_in_flight=10)
    worst = 0
    consumed = 0
    for r in pipe.run(source()):
        consumed += 1
        time.sleep(0.002)
        worst = max(worst, pulled[0] - consumed)
    assert consumed == 200
    assert worst <= 10 + 1  # the window, plus the one item the generator yields before it waits


def test_model_failure_costs_only_the_images_it_fails_on(samples, tmp_path, no_thread_leak):
    """A model that raises on a batch: the batch's rows run one by one, so only the image it fails on
    gets the error; a model that fails every image fails them all, each with the model's error."""
    from PIL import Image

    Image.new("RGB", (64, 48)).save(tmp_path / "black.jpg")  # a flat image: the one this model refuses
    inputs = [*samples[:5], tmp_path / "black.jpg", *samples[5:11]]

    class Picky(Tiny):
        always = False

        def forward(self, x):  # (B, 3, S, S)
            if Picky.always:
                raise RuntimeError(f"boom on {x.shape[0]}")  # (each image's error must be its own run's)
            if bool((x.float().std((2, 3)).sum(1) == 0).any()):
                raise RuntimeError("boom")
            return super().forward(x)

    cfg = Config(labels=LABELS, device="cpu", max_batch_size=4, threads=1, max_wait_ms=1000)
    pipe = Pipeline(cfg, model=Picky())
    res = pipe.classify(inputs)
    assert [r.ok for r in res] == [True] * 5 + [False] + [True] * 6
    assert res[5].error == f"{res[5].id}: compute failed: RuntimeError: boom"
    ref = {r.id: r.class_ids for r in tiny_pipe().classify(samples[:11])}
    assert all(r.class_ids == ref[r.id] for r in res if r.ok)
    Picky.always = True
    res = pipe.classify(inputs)
    assert all(not r.ok and r.error.endswith("compute failed: RuntimeError: boom on 1") for r in res)
    from fullthrottle.workloads.classify.labels import compute_failed

    long = compute_failed(RuntimeError("x" * 5000))
    assert long.startswith("compute failed: RuntimeError: xxx") and long.endswith("... (5000 characters)")
    assert len(long) < 1100 and compute_failed(KeyboardInterrupt()) == "compute failed: KeyboardInterrupt"


def test_ctrl_c_during_the_start_up_forward_is_the_users(monkeypatch):
    """The one forward at start-up that learns the class count lets a KeyboardInterrupt through (it
    is the user's Ctrl-C), while a model's own exception there only leaves the count unknown."""

    class Interrupted(Tiny):
        def forward(self, x):
            raise KeyboardInterrupt

    class Raises(Tiny):
        def forward(self, x):
            raise RuntimeError("not now")

    with pytest.raises(KeyboardInterrupt):
        Pipeline(Config(labels=LABELS, device="cpu", threads=1), model=Interrupted())
    pipe = Pipeline(Config(labels=LABELS, device="cpu", threads=1), model=Raises())
    assert pipe.engine.num_classes is None
    pipe.close()


def test_missing_file_and_glob_and_dir(tmp_path, samples):
    (tmp_path / "sub").mkdir()
    for i, p in enumerate(samples[:3]):
        (tmp_path / "sub" / f"img{i}.jpg").write_bytes(p.read_bytes())
    (tmp_path / "sub" / "notes.txt").write_text("skip me")
    pipe = tiny_pipe()
    latin1 = os.fsdecode(b"caf\xe9.jpg")  # (a name whose bytes are not UTF-8)
    res = pipe.classify([str(tmp_path), str(tmp_path / "sub" / "*.jpg"), str(tmp_path / "nope.jpg"), "   ", latin1])
    assert [r.ok for r in res] == [True] * 6 + [False, False, False]
    assert res[-3].error == f"file not found: {tmp_path / 'nope.jpg'}"
    assert res[-2].error == "file not found: '   '"  # (a name of spaces shown quoted: seen)
    assert res[-1].error == "file not found: caf\\xe9.jpg"  # (its bytes as the id's JSON shows them)
    assert res[0].class_ids == res[3].class_ids


def test_weights_safetensors_and_pth(tmp_path, samples):
    import torchvision
    from safetensors.torch import save_file

    torch.manual_seed(1)
    src = torchvision.models.resnet18(weights=None).eval()
    save_file(src.state_dict(), str(tmp_path / "w.safetensors"))
    torch.save({"state_dict": src.state_dict()}, tmp_path / "w.pth")
    arrays = [preprocess(samples[0].read_bytes())]
    ref = reference_logits(src, arrays)
    for name in ("w.safetensors", "w.pth"):
        pipe = Pipeline(Config(model="resnet18", weights=str(tmp_path / name), device="cpu", max_batch_size=1))
        assert not pipe.engine.random_weights
        torch.testing.assert_close(pipe.engine.forward(torch.from_numpy(np.stack(arrays))), ref, atol=1e-5, rtol=0)


class _Evil:
    def __reduce__(self):
        return (print, ("pwned",))


def test_weights_never_unpickle_code(tmp_path):
    torch.save({"x": _Evil()}, tmp_path / "evil.pth")
    with pytest.raises(WeightsError, match="cannot read weights"):
        Pipeline(Config(model="resnet18", weights=str(tmp_path / "evil.pth"), device="cpu"))


def test_weights_that_do_not_fit(tmp_path):
    from safetensors.torch import save_file

    save_file({"fc.weight": torch.zeros(3, 3)}, str(tmp_path / "bad.safetensors"))
    with pytest.raises(WeightsError, match="do not fit"):
        Pipeline(Config(model="resnet18", weights=str(tmp_path / "bad.safetensors"), device="cpu"))


def test_weights_that_do_not_fit_are_a_usage_error_in_classify_and_serve(tmp_path, capsys):
    """Exit 2 with the reason, before a server or a decoder process starts."""
    from safetensors.torch import save_file

    from fullthrottle.cli import main

    save_file({"fc.weight": torch.zeros(3, 3)}, str(tmp_path / "bad.safetensors"))
    w = ["--model", "resnet18", "--weights", str(tmp_path / "bad.safetensors"), "--device", "cpu"]
    assert main(["serve", *w, "--port", "0"]) == 2
    err = capsys.readouterr().err
    assert "do not fit" in err and "Uvicorn running" not in err and "Started server" not in err, err
    assert main(["classify", str(tmp_path), *w]) == 2
    assert "do not fit" in capsys.readouterr().err


def test_one_dtype_default_for_every_front_end():
    """dtype None means bfloat16 on CUDA and float32 on the CPU, for the library, the CLI (also its Ray
    path, which passes no dtype) and the server alike; the Embedder's own CUDA default is float16."""
    from fullthrottle.cli import build_parser
    from fullthrottle.core.config import CUDA_DTYPE, resolve_dtype

    assert Config().dtype is None and CUDA_DTYPE == "bfloat16"
    assert [resolve_dtype(None, d) for d in ("cuda", "cuda:1", "cpu")] == ["bfloat16", "bfloat16", "float32"]
    assert resolve_dtype("float16", "cpu") == "float16" and resolve_dtype(None, "cuda", "float16") == "float16"
    from fullthrottle.core.config import Runtime

    for cmd in (["classify"], ["serve"], ["generate", "--random", "tiny"], ["embed", "f", "--out", "o.npy"]):
        args = build_parser().parse_args(cmd)  # (the flags are generated from Runtime's fields)
        assert (args.device, args.dtype, args.graphs) == (Runtime.device, Runtime.dtype, Runtime.graphs), cmd
    assert build_parser().parse_args(["run", "f", "--workload", "m:C"]).device == Runtime.device
    assert Config().runtime == Runtime() and Config(device="cpu").runtime.device == "cpu"
    assert Pipeline(Config(labels=LABELS, device="cpu", threads=1), model=Tiny()).engine.dtype == torch.float32


def test_config_errors():
    with pytest.raises(ValueError, match="unknown model"):
        Pipeline(Config(model="resnet19", device="cpu"))
    with pytest.raises(ValueError, match="dtype"):
        Config(dtype="int8")
    with pytest.raises(ValueError, match="max_batch_size"):
        Config(max_batch_size=0)
    for labels in ("abc", ["cat", 3]):  # a string would have been taken as one label per letter
        with pytest.raises(ValueError, match="labels must be a list of class names"):
            Config(labels=labels)
    # settings that used to pass and then hang the run (load_concurrency=0) or fail deep inside it
    bad = {
        "load_concurrency": 0,
        "max_in_flight": -5,
        "torch_threads": 0,
        "queue_size": -1,
        "max_file_bytes": 0,
        "max_image_pixels": -3,
        "max_batch_size": "64",
        "top_k": 1.5,
    }
    for name, value in bad.items():
        with pytest.raises(ValueError, match=f"{name} must be .*integer >= 1, got {value!r}"):
            Config(**{name: value})
    with pytest.raises(ValueError, match="max_wait_ms must be a finite number >= 0, got inf"):
        Config(max_wait_ms=float("inf"))
    with pytest.raises(ValueError, match="http_timeout_s must be a finite number > 0, got 0"):
        Config(http_timeout_s=0)
    with pytest.raises(ValueError, match=r"mean must be 3 finite numbers \(one per RGB channel\), got \(0.5,\)"):
        Config(mean=(0.5,))
    with pytest.raises(ValueError, match="std must be 3 finite numbers .*none zero"):
        Config(std=(0.2, 0, 0.2))
    # types that used to pass silently: a string taken as True, a float bucket truncated, a bool size
    with pytest.raises(ValueError, match="gpu_decode must be True or False, got 'no'"):
        Config(gpu_decode="no")
    with pytest.raises(ValueError, match="ordered must be True or False, got 1"):
        Config(ordered=1)
    with pytest.raises(ValueError, match=r"decode_timeout_s must be a number > 0 .*got '30'"):
        Config(decode_timeout_s="30")
    with pytest.raises(ValueError, match=r"buckets must be positive integer batch sizes, got \[1.5\]"):
        Config(buckets=[1.5])
    with pytest.raises(ValueError, match="crop_size must be None .* or an integer >= 1, got True"):
        Config(crop_size=True)
    assert Config(decode_timeout_s=float("inf"), buckets=[8, 1, 4]).buckets == (1, 4, 8)  # inf: no limit
    if not torch.cuda.is_available():
        with pytest.raises(RuntimeError, match="CUDA is not available"):
            Pipeline(Config(device="cuda"))


def test_http_urls(http_server, samples):
    pipe = tiny_pipe()
    upper = f"{http_server}/a.jpg".replace("http://", "HTTP://")  # (a scheme is case-insensitive)
    res = pipe.classify([f"{http_server}/a.jpg", f"{http_server}/missing.jpg", samples[0], upper])
    assert res[0].ok and res[0].id == f"{http_server}/a.jpg"
    assert res[3].ok and res[3].class_ids == res[0].class_ids
    assert not res[1].ok and "HTTP 404" in res[1].error
    assert res[0].class_ids == res[2].class_ids and res[0].probs == res[2].probs


def test_malformed_urls_are_their_own_errors(samples):
    """URLs httpx or IDNA refuse (a bad port, a broken IPv6 address, an empty punycode label, a NUL)
    each fail their own item, in order; nothing is dropped and the photos beside them are classified."""
    bad = ["http://a:b/x.jpg", "http://[::1", "http://[zz]/x.jpg", "http://xn--/x.jpg", "http://ex\x00ample.com/x.jpg"]
    bad += ["http://127.0.0.1:99999/x.jpg"]
    inputs = [samples[0], *bad, samples[1]]
    res = tiny_pipe().classify(inputs)
    assert [r.id for r in res] == [str(samples[0]), *bad, str(samples[1])]
    assert res[0].ok and res[-1].ok
    for r in res[1:-1]:
        assert not r.ok and repr(r.id) in r.error and "invalid URL" in r.error, r.error
        assert (r.to_dict()["error_stage"], r.to_dict()["error_kind"]) == ("load", "unsupported_input")
    assert "port 99999 is not in 1..65535" in res[-2].error


def test_one_stream_at_a_time(samples):
    pipe = tiny_pipe()
    it = pipe.run(samples[:20])
    next(it)
    with pytest.raises(RuntimeError, match="already running"):
        next(pipe.run(samples[:2]))
    it.close()
    assert len(pipe.classify(samples[:2])) == 2


def test_bad_input_types_and_empty_matches_are_per_item_errors(samples, tmp_path):
    pipe = tiny_pipe()
    res = pipe.classify(
        [
            samples[0],
            12345,
            str(tmp_path),
            str(tmp_path / "*.jpg"),
            samples[1],
            "ftp://example.com/cat.jpg",
            "",
            "file:///etc/passwd",
        ]
    )
    assert [r.ok for r in res] == [True, False, False, False, True, False, False, False]
    # (each error names its item, as its id does: an input with no name of its own by its place)
    assert res[1].id == "<input #1>" and res[1].error.startswith("<input #1>: cannot load an input of type int")
    assert "unsupported URL scheme 'ftp'" in res[5].error and res[5].id == "ftp://example.com/cat.jpg"
    assert res[6].error.startswith("<input #6>: empty path") and res[6].id == "<input #6>"
    assert "unsupported URL scheme 'file'" in res[7].error
    assert "no image files" in res[2].error
    assert "no files match the pattern" in res[3].error


def test_a_pattern_in_a_folder_that_cannot_be_listed_says_so(tmp_path, monkeypatch):
    """glob matches nothing in a folder it cannot list, without a word: the item's error adds why."""
    from fullthrottle.data import sources

    (tmp_path / "locked").mkdir()
    real = os.scandir

    def scandir(path="."):
        if os.path.abspath(path) == str(tmp_path / "locked"):
            raise PermissionError(13, "Permission denied")
        return real(path)

    monkeypatch.setattr(sources.os, "scandir", scandir)
    [(_, locked)] = list(sources.expand([str(tmp_path / "locked" / "*.jpg")]))
    [(_, nowhere)] = list(sources.expand([str(tmp_path / "nowhere" / "*.jpg")]))
    assert (
        str(locked)
        == f"no files match the pattern {tmp_path}/locked/*.jpg (cannot read directory {tmp_path}/locked: Permission denied)"
    )
    assert str(nowhere) == f"no files match the pattern {tmp_path}/nowhere/*.jpg"


def test_stage_failure_is_raised(samples):
    pipe = tiny_pipe()
    pipe.engine.class_labels.given, pipe.engine.class_labels.names = False, None  # a bug in a stage must surface
    with pytest.raises(PipelineError, match="TypeError"):
        list(pipe.run([samples[0]]))


def test_decoder_processes_give_the_thread_results(samples, bad_dir, no_thread_leak):
    """preprocess="processes": bit-identical results and the same per-item errors as the threads;
    a worker killed mid-run costs at most the item it held; close() leaves no process behind."""
    import os
    import signal

    inputs = [str(p) for p in samples[:40]] + sorted(str(p) for p in bad_dir.iterdir())
    with tiny_pipe() as pipe:
        ref = pipe.classify(inputs)
    with tiny_pipe(preprocess="processes") as pipe:
        assert len(pipe.decoders) == 2
        got = pipe.classify(inputs)
        assert [(r.id, r.ok, r.error, r.class_ids) for r in got] == [(r.id, r.ok, r.error, r.class_ids) for r in ref]
        for a, b in zip(got, ref):  # batch mates differ (timing), so CPU kernels may round differently
            np.testing.assert_allclose(a.probs or [], b.probs or [], rtol=1e-5, atol=1e-7)
        for p in samples[:5]:  # the crops themselves are bit-identical
            assert np.array_equal(pipe.decoders[1](p.read_bytes()), preprocess(p.read_bytes()))
        victim = pipe.decoders[0].proc
        stream = pipe.run(str(p) for p in samples[:120])
        first = [next(stream) for _ in range(10)]
        os.kill(victim.pid, signal.SIGKILL)
        rest = first + list(stream)
        assert len(rest) == 120
        died = [r for r in rest if not r.ok]
        assert len(died) <= 1 and all(
            "decoder process died on this item (killed by signal SIGKILL)" in r.error for r in died
        )
        ok_ref = {r.id: r.class_ids for r in pipe.classify([str(p) for p in samples[:120]])}
        assert all(r.class_ids == ok_ref[r.id] for r in rest if r.ok)
        assert pipe.decoders[0].proc is not victim and pipe.decoders[0].proc.poll() is None
        for r in pipe.run(str(p) for p in samples[:120]):  # stopped with images out at the workers
            break
        again = pipe.classify(inputs)  # every answer still goes to its own item
        assert [(r.id, r.error, r.class_ids) for r in again] == [(r.id, r.error, r.class_ids) for r in ref]
        procs = [w.proc for w in pipe.decoders.workers]
    assert all(p.poll() is not None for p in procs)  # closed with the pipeline


def test_preprocess_mode_is_checked():
    with pytest.raises(ValueError, match="preprocess must be"):
        Config(preprocess="fork")


def test_label_lists_name_classes_past_the_labels_by_id():
    """ClassLabels.lists: (n, k) class ids -> label lists, row by row; ids past the labels -> their text."""
    pipe = tiny_pipe()
    cl = pipe.engine.class_labels
    labels = pipe.engine.labels
    idx = np.array([[0, 1], [len(labels) + 2, 1]])
    assert cl.lists(idx) == [[labels[0], labels[1]], [str(len(labels) + 2), labels[1]]]
    assert cl.lists(np.array([[1, 0]])) == [[labels[1], labels[0]]]
    assert cl.lists(np.zeros((0, 5), dtype=np.int64)) == []
    cl.names = [f"custom{i}" for i in range(len(labels))]  # replaced after use: taken at once
    assert cl.lists(np.array([[1, 0]])) == [["custom1", "custom0"]]


def test_a_glob_reports_broken_entries_as_a_folder_does(samples, tmp_path):
    """A dangling symlink matched by a pattern gets its own error, as it does in a folder walk."""
    (tmp_path / "a.jpg").symlink_to(samples[0])
    (tmp_path / "b.jpg").symlink_to(tmp_path / "gone.jpg")
    with tiny_pipe() as pipe:
        by_glob = [(r.id, r.ok, r.error) for r in pipe.run([str(tmp_path / "*.jpg")])]
        by_dir = [(r.id, r.ok, r.error) for r in pipe.run([str(tmp_path)])]
    assert by_glob == by_dir and [ok for _, ok, _ in by_glob] == [True, False]
    assert "file not found" in by_glob[1][2]


def test_result_json_line_equals_json_dumps_of_its_dict():
    """The CLI's fast JSON line is exactly ``json.dumps(r.to_dict())``: labels and ids with quotes,
    backslashes and non-ASCII, long float probabilities, errors, NaN, empty top-k."""
    import json

    from fullthrottle.workloads.classify.result import Result

    rs = [
        Result(0, "plain.jpg", ["tench", "goldfish"], [0, 1], [0.8123456789, 1.5e-07]),
        Result(7, 'dir/na"me\\é\n.jpg', ['q"uo\\te', "ünï"], [5, 999], [0.3333333432674408, 0.25]),
        Result(8, "bad.jpg", error="bad.jpg: not an image (corrupt)"),
        Result(9, "nan.jpg", ["a"], [3], [float("nan")]),
        Result(10, "inf.jpg", ["a", "b"], [3, 4], [float("inf"), 0.1]),
        Result(11, "empty.jpg"),
        Result(12, "types.jpg", [5, "x"], [1.0, True], [1, 0.5]),  # (not from the pipeline: other types)
    ]
    rs.append(Result(13, "dir/bad\udcffname.jpg", ["a"], [3], [0.5]))  # (a file name that is not UTF-8)
    rs.append(Result(14, "dir/x\ud800.jpg", error="dir/x\ud800.jpg: file not found: dir/x\ud800.jpg"))
    for r in rs:
        assert r.to_json() == json.dumps(r.to_dict())
        back = json.loads(r.to_json())  # (no lone surrogate in the JSON text: strict readers refuse them)
        (back["id"] + back.get("error", "")).encode("utf-8")
    assert json.loads(rs[1].to_json())["top_k"][0]["prob"] == 0.333333
    assert json.loads(rs[-2].to_json())["id"] == "dir/bad\\xffname.jpg"


def test_a_closed_pipeline_refuses_to_run_instead_of_waiting(samples):
    """run() on a closed Pipeline, or a with block on it, raises at once (its buffers are gone: it
    used to wait for ever)."""
    from fullthrottle import Config, Pipeline

    with Pipeline(Config(device="cpu", model="resnet18", preprocess="threads", threads=1)) as pipe:
        assert len(list(pipe.run([str(samples[0])]))) == 1
    with pytest.raises(RuntimeError, match="Pipeline is closed"):
        list(pipe.run([str(samples[0])]))
    with pytest.raises(RuntimeError, match="Pipeline is closed"):  # (a with block on it: at its start)
        with pipe:
            pass


def test_folder_walk_follows_symlinked_folders_and_says_why_it_skips_one(samples, tmp_path, monkeypatch):
    """A symlinked subfolder's images are classified (the link's path is their id); a symlink back to
    a folder it sits in, and a folder that cannot be listed, are each an item with its own error
    (kind ``unreadable``), never images dropped without a word."""
    import shutil

    from fullthrottle import Config, Pipeline

    top, other = tmp_path / "top", tmp_path / "other"
    (top / "sub" / "locked").mkdir(parents=True)
    other.mkdir()
    shutil.copy(samples[0], top / "a.jpg")
    shutil.copy(samples[1], other / "b.jpg")
    shutil.copy(samples[2], top / "sub" / "locked" / "c.jpg")
    (top / "link").symlink_to(other)
    (top / "sub" / "up").symlink_to(top)  # a loop
    (top / "gone").symlink_to(tmp_path / "nowhere")  # dangling, not named like an image: passed over
    (top / "notes.txt").write_text("not an image: passed over")
    real = os.scandir

    def scandir(path="."):  # (the tests run as root: a mode of 000 would not stop the listing)
        if os.fspath(path).endswith("locked"):
            raise PermissionError(13, "Permission denied", os.fspath(path))
        return real(path)

    monkeypatch.setattr(os, "scandir", scandir)
    with Pipeline(Config(device="cpu", model="resnet18", preprocess="threads", threads=1)) as pipe:
        got = {os.path.relpath(r.id, top): r for r in pipe.run([str(top)])}
        (direct,) = pipe.run([str(other / "b.jpg")])
    assert sorted(got) == ["a.jpg", "link/b.jpg", "sub/locked", "sub/up"], sorted(got)
    assert got["a.jpg"].ok and got["link/b.jpg"].class_ids == direct.class_ids
    locked, loop = got["sub/locked"], got["sub/up"]
    assert locked.error_kind == "unreadable" and "Permission denied" in locked.error, locked.error
    assert loop.error_kind == "unreadable" and "symlink loop" in loop.error, loop.error


def test_a_path_with_a_nul_and_a_url_without_a_host_are_the_users_input_errors(samples):
    """Both are item errors of kind unsupported_input (load), and say what is wrong; the rest runs."""
    with Pipeline(Config(device="cpu", model="resnet18", threads=1, preprocess="threads")) as pipe:
        bad_path, no_host, ok = pipe.classify(["a\x00b.jpg", "https://", str(samples[0])])
    assert (bad_path.error_stage, bad_path.error_kind) == ("load", "unsupported_input")
    assert "it holds a NUL byte" in bad_path.error and "\x00" not in bad_path.id
    assert (no_host.error_kind, no_host.error) == ("unsupported_input", "invalid URL 'https://': it names no host")
    assert ok.ok


def test_a_folder_reached_by_many_paths_is_walked_once(samples, tmp_path):
    """Two links from each of 18 folders to the next: 2**17 paths lead to the one image at the
    bottom. The walk enters each folder once (by its first path in sorted order): one item, at once."""
    import shutil

    from fullthrottle.data.sources import walk_images

    dirs = [tmp_path / f"d{i}" for i in range(18)]
    for d in dirs:
        d.mkdir()
    for d, nxt in zip(dirs, dirs[1:]):
        (d / "a").symlink_to(nxt)
        (d / "b").symlink_to(nxt)
    shutil.copy(samples[0], dirs[-1] / "hen.jpg")
    t0 = time.perf_counter()
    got = [os.path.relpath(p, tmp_path) for p, _ in walk_images(str(dirs[0]))]
    assert time.perf_counter() - t0 < 5
    assert got == [os.path.join("d0", *["a"] * 17, "hen.jpg")], got[:5]


@pytest.mark.parametrize("preprocess", ["threads", "processes"])
def test_closing_a_pipeline_mid_stream_ends_the_stream(samples, preprocess, no_thread_leak):
    """close() while a stream runs (the consumer calls it between results): iterating on raises
    RuntimeError promptly (it used to wait for ever with decoder processes), every stage stops."""
    from fullthrottle import Config, Pipeline

    pipe = Pipeline(Config(device="cpu", model="resnet18", preprocess=preprocess, threads=2))
    stream = pipe.run([str(p) for p in samples[:60]])
    assert next(stream).ok
    pipe.close()
    t0 = time.perf_counter()
    with pytest.raises(RuntimeError, match="closed while this stream ran"):
        for _ in stream:
            pass
    assert time.perf_counter() - t0 < 30


def test_closing_a_pipeline_whose_results_are_all_made_still_ends_its_stream(samples):
    """close() between two results of a stream whose results were all made (one batch, its end seen:
    the stream hands them out from memory): the stream raises at its next item all the same (it
    handed out the rest and ended quietly, as if never closed)."""
    for _ in range(3):
        pipe = tiny_pipe(max_batch_size=4, max_wait_ms=1000)  # (the 4 wait for each other: one batch)
        stream = pipe.run([p.read_bytes() for p in samples[:4]])
        assert next(stream).ok
        pipe.close()
        with pytest.raises(RuntimeError, match="closed while this stream ran"):
            next(stream)


def test_closing_a_pipeline_from_another_thread_mid_stream_raises_and_hands_out_no_gap(samples):
    """close() from another thread while the consumer iterates: the stream raises RuntimeError every
    time (it used to end quietly at times, with items missing from the middle), and what it gave
    before is a prefix of the inputs, in order."""
    import threading

    from fullthrottle import Config, Pipeline

    paths = [str(p) for p in samples]
    for delay in (0.3, 0.6, 0.9, 1.2):
        pipe = Pipeline(Config(device="cpu", model="resnet18", threads=2, max_batch_size=4, top_k=1))
        got = []
        threading.Timer(delay, pipe.close).start()
        with pytest.raises(RuntimeError, match="closed while this stream ran"):
            for r in pipe.run(paths):
                got.append(r.id)
                time.sleep(0.01)
        assert got == [os.path.basename(p) for p in paths[: len(got)]] or got == paths[: len(got)], delay
        assert len(got) < len(paths)


def test_a_recursive_glob_over_symlink_loops_lists_each_image_once_per_path_not_for_ever(samples, tmp_path):
    """``DIR/**/*.jpg`` with two symlink loops: glob itself follows each loop to the system's link
    limit, once per loop and level (exponential: it never ends); the pattern lists each image once
    per path that does not run through a loop (a pattern may match only one of them), skips hidden
    folders as glob does, and leaves folders out."""
    import shutil

    from fullthrottle.data.sources import glob_files

    (tmp_path / "a" / ".hidden").mkdir(parents=True)
    (tmp_path / "b").mkdir()
    for name in ("a/x.jpg", "a/.hidden/h.jpg", "b/y.jpg", "top.jpg"):
        shutil.copy(samples[0], tmp_path / name)
    (tmp_path / "a" / "up").symlink_to("..")  # loops
    (tmp_path / "b" / "toa").symlink_to("../a")
    t0 = time.perf_counter()
    got = glob_files(str(tmp_path / "**" / "*.jpg"))
    assert time.perf_counter() - t0 < 5
    assert [os.path.relpath(p, tmp_path) for p in got] == ["a/x.jpg", "b/toa/x.jpg", "b/y.jpg", "top.jpg"]
    assert glob_files(str(tmp_path / "**" / "toa" / "*.jpg")) == [str(tmp_path / "b" / "toa" / "x.jpg")]
    assert glob_files(str(tmp_path / "*" / "*.jpg")) == [str(tmp_path / "a" / "x.jpg"), str(tmp_path / "b" / "y.jpg")]


def test_a_module_class_for_model_is_refused_naming_the_instance_wanted():
    """model= takes a built nn.Module (the CLI's --model MODULE:CLASS takes the class): the class, or
    anything else, is a TypeError saying so before anything starts, as model= or as Config(model=...)."""
    for make in (
        lambda: Pipeline(Config(device="cpu"), model=Tiny),
        lambda: Pipeline(Config(device="cpu", model=Tiny)),
    ):
        with pytest.raises(TypeError, match=r"must be an nn.Module instance, got the class Tiny: pass model=Tiny\(\)"):
            make()
    with pytest.raises(TypeError, match="must be a model name .str. or an nn.Module instance, got int"):
        Pipeline(Config(device="cpu"), model=3)
    for device in (None, "tpu", "cuda:x", " cpu"):  # (named by Config, before anything is built)
        with pytest.raises(ValueError, match=rf"^device must be 'auto', 'cpu', 'cuda' or 'cuda:N', got {device!r}$"):
            Config(device=device)


def test_a_models_name_as_model_is_taken_as_config_model(samples):
    with Pipeline(Config(device="cpu", threads=1), model="resnet18") as pipe:
        assert pipe.engine.model_name == "resnet18"
        (r,) = pipe.classify([samples[0]])
    assert r.ok
    with Pipeline("resnet18", device="cpu", threads=1) as pipe:  # (the name in config's place)
        assert pipe.engine.model_name == "resnet18"


def test_a_top_k_of_any_size_is_clamped_to_the_model_s_classes(samples):
    """Config(top_k=...) past the model's classes lists them all; the engine's output buffers are as
    wide as the classes, not as top_k (a huge top_k allocates nothing more)."""
    with tiny_pipe(top_k=10**20, threads=1) as pipe:
        assert {tuple(s.out_probs.shape) for s in pipe.engine.slots} == {(8, 10)}
        (r,) = pipe.classify([samples[0]])
    assert r.ok and sorted(r.labels) == sorted(LABELS) and r.probs == sorted(r.probs, reverse=True)


def test_run_interrupted_anywhere_in_taking_results_raises_the_interrupt_and_stops(samples, monkeypatch):
    """A Ctrl-C raises KeyboardInterrupt at whichever bytecode the consuming (main) thread is at:
    raised just after each C call of the stream's hand-off in turn (Run.get_many and hand_out, and
    what they call: the results' queue, the window's permits), the stream raises it (not "release
    unlocked lock") and stops at once (no lock left held by a half-run ``with``: its own next
    release, in hand_out's ``finally``, hung for good)."""

    from interrupts import consume_interrupted

    from fullthrottle.workloads.classify import run as run_mod

    monkeypatch.setattr(run_mod, "RELEASE_EVERY", 1)  # (every permit given back inside the loop)
    pipe = tiny_pipe(threads=1)
    inputs = [str(p) for p in samples[:48]]
    codes = {run_mod.Run.get_many.__code__, run_mod.Run.hand_out.__code__}
    for n in range(1, 31):
        results = pipe.run(inputs)
        next(results)
        e = consume_interrupted(results, n, *codes)
        results.close()
        assert isinstance(e, KeyboardInterrupt), f"C call {n}: {e!r}"
    pipe.close()
