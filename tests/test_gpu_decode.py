"""GPU JPEG decoding: routing, the rate-based split and the mixed CPU/GPU batches, with a fake decoder on
CPU (CI); the real nvJPEG path is checked against the CPU path under the ``gpu`` marker."""

import collections
import os
import subprocess
import sys
import time

import cv2
import numpy as np
import pytest
import torch
from test_pipeline import LABELS, Tiny

from fullthrottle import Config, Pipeline
from fullthrottle.data.gpu_decode import RateSplitter, gpu_eligible, jpeg_info
from fullthrottle.data.gpu_resize import resize_crop_batch, resize_crop_interpolate
from fullthrottle.data.preprocess import decode, preprocess, resize_crop

ROUTE = {
    "truncated.jpg": (False, "truncated"),
    "cmyk.jpg": (False, "4-component"),
    "exif-rotated.jpg": (False, "EXIF orientation"),
    "png-named-as.JPEG": (False, "not a JPEG"),
    "empty.jpg": (False, "not a JPEG"),
    "not-an-image.jpg": (False, "not a JPEG"),
    "photo.webp": (False, "not a JPEG"),
    "animated.gif": (False, "not a JPEG"),
    "progressive.jpg": (True, ""),
    "tiny-1x1.jpg": (True, ""),
    "large-6000x4000.jpg": (True, ""),
}


@pytest.mark.parametrize("name", sorted(ROUTE))
def test_routing_of_bad_inputs(bad_dir, name):
    ok, reason = gpu_eligible((bad_dir / name).read_bytes())
    assert ok == ROUTE[name][0] and ROUTE[name][1] in reason


def test_samples_are_eligible(samples):
    infos = [jpeg_info(p.read_bytes()) for p in samples]
    assert all(i is not None for i in infos)
    assert sum(gpu_eligible(p.read_bytes())[0] for p in samples) >= 190


def test_rate_split_follows_measured_rates():
    s = RateSplitter(cpu_workers=16, initial_gpu_share=0.5)
    assert [s.choose() for _ in range(4)].count("gpu") == 2
    for _ in range(50):
        s.record_cpu(1, 0.004)  # 16 threads x 250 img/s = 4000 img/s
        s.record_gpu(100, 0.005)  # 20000 img/s
    assert s.gpu_share == pytest.approx(20000 / 24000, rel=1e-6)
    picks = [s.choose() for _ in range(600)]
    assert picks.count("gpu") == 500  # deterministic proportion, not a random draw


def test_batched_gpu_resize_matches_cpu_path(samples):
    rgbs = [decode(p.read_bytes()) for p in samples[:12]]
    rgbs += [rgbs[0].copy(), rgbs[0].copy()]  # a same-size group, resized in one call
    imgs = [torch.from_numpy(np.ascontiguousarray(a)).permute(2, 0, 1) for a in rgbs]
    out = torch.empty((len(imgs), 224, 224, 3), dtype=torch.uint8)
    resize_crop_batch(imgs, out)  # mixed sizes: the batched matrix-product path
    for a, o in zip(rgbs, out):
        ref = resize_crop(a).astype(np.int16)
        diff = np.abs(o.numpy().astype(np.int16) - ref)
        assert diff.mean() <= 0.5 and diff.max() <= 2
    chunked = torch.empty_like(out)  # one image per chunk: the same pixels
    resize_crop_batch(imgs, chunked, chunk_elems=1)
    assert torch.equal(chunked, out)
    same = torch.empty((2, 224, 224, 3), dtype=torch.uint8)  # one size: shared matrices, no padding
    resize_crop_batch(imgs[-2:], same)
    assert (same[0].int() - out[-2].int()).abs().max() <= 1 and torch.equal(same[0], same[1])
    interp = torch.empty_like(out)  # PyTorch's antialiased interpolate, the filter written out
    resize_crop_interpolate(imgs, interp)
    diff = (interp.int() - out.int()).abs()
    assert diff.float().mean() <= 0.05 and diff.max() <= 1
    assert imgs[0].stride()[0] == 1  # (views of (H, W, 3) images, as the hardware decoder gives)
    chw = [im.contiguous() for im in imgs]  # planar (3, H, W), as nvJPEG gives: the same pixels
    again = torch.empty_like(out)
    resize_crop_batch(chw, again)
    assert torch.equal(again, out)


class FakeGpuDecoder:
    """The GPU decoder's contract on CPU: (3,H,W) uint8 tensors, or the exception per image."""

    def __init__(self, fail_every=0):
        self.calls, self.images, self.fail_every = 0, 0, fail_every

    def __call__(self, blobs):
        self.calls += 1
        out = []
        for b in blobs:
            self.images += 1
            if self.fail_every and self.images % self.fail_every == 0:
                out.append(RuntimeError("fake nvJPEG failure"))
                continue
            rgb = cv2.imdecode(np.frombuffer(b, np.uint8), cv2.IMREAD_COLOR)[:, :, ::-1]
            out.append(torch.from_numpy(np.ascontiguousarray(rgb)).permute(2, 0, 1))
        return out


class FakeNvImageCodec:
    """nvImageCodec's ``Decoder.decode`` on CPU: HWC uint8 arrays, ``None`` for what the "engines" refuse
    (here progressive JPEGs, as on the real hardware), and optionally the old behaviour of dropping
    refused images from the list instead of answering ``None``."""

    def __init__(self, drop_refused=False, raise_on=None):
        self.drop_refused, self.raise_on, self.calls = drop_refused, raise_on, []

    def decode(self, srcs, params=None, cuda_stream=0):
        single = not isinstance(srcs, list)
        srcs = [srcs] if single else srcs
        self.calls.append(len(srcs))
        out = []
        for a in srcs:
            b = bytes(a)
            if self.raise_on is not None and b == self.raise_on and len(srcs) > 1:
                raise RuntimeError("fake batch failure")
            info = jpeg_info(b)
            if info is None or info["sof"] == 0xC2:
                if not self.drop_refused:
                    out.append(None)
                continue
            gray = cv2.imdecode(np.frombuffer(b, np.uint8), cv2.IMREAD_UNCHANGED)
            if gray.ndim == 2:  # the real decoder gives RGB; a (H, W, 1) tests the expansion
                out.append(gray[:, :, None])
            else:
                out.append(np.ascontiguousarray(gray[:, :, ::-1]))
        return (out[0] if out else None) if single else out


def _hw_decoder(fake, fallback=None):
    from fullthrottle.data.gpu_decoders import HwJpegDecoder

    d = HwJpegDecoder.__new__(HwJpegDecoder)  # skips the import of nvImageCodec and the device probe
    d.device, d._dec, d._params, d._code_stream, d.fallback = torch.device("cpu"), fake, None, lambda a: a, fallback
    return d


@pytest.mark.parametrize("drop_refused", [False, True])
def test_hardware_decoder_per_item_results(bad_dir, samples, drop_refused):
    """Refused images go to the fallback (or become that item's error); everything else is (3, H, W)
    uint8 equal to OpenCV's decode; a failing batch call is retried image by image."""
    good = [p.read_bytes() for p in samples[:3]]
    prog = (bad_dir / "progressive.jpg").read_bytes()
    gray = next(p.read_bytes() for p in samples if jpeg_info(p.read_bytes())["components"] == 1)
    blobs = [good[0], prog, gray, good[1], good[2]]
    fallback = FakeGpuDecoder()
    for fb in (fallback, None):
        fake = FakeNvImageCodec(drop_refused=drop_refused)
        out = _hw_decoder(fake, fb)(blobs)
        assert len(out) == 5
        for j in (0, 2, 3, 4):
            ref = cv2.cvtColor(cv2.imdecode(np.frombuffer(blobs[j], np.uint8), cv2.IMREAD_COLOR), cv2.COLOR_BGR2RGB)
            assert out[j].shape == (3, *ref.shape[:2]) and out[j].dtype == torch.uint8
            assert torch.equal(out[j].permute(1, 2, 0), torch.from_numpy(ref))
        if fb is None:
            assert isinstance(out[1], RuntimeError) and "refused" in str(out[1])
        else:
            assert isinstance(out[1], torch.Tensor) and fallback.images == 1
        assert fake.calls[0] == 5 and (fake.calls[1:] == [1] * 5 if drop_refused else fake.calls == [5])
    fake = FakeNvImageCodec(raise_on=good[1])  # one image breaks the batch call: the others still decode
    out = _hw_decoder(fake)(blobs)
    assert all(isinstance(out[j], torch.Tensor) for j in (0, 2, 3, 4)) and fake.calls == [5, 1, 1, 1, 1, 1]


def test_nvimgcodec_backend_spec():
    """FULLTHROTTLE_NVIMGCODEC_BACKENDS: the engines alone by default, or shares of each batch between the
    engines and nvImageCodec's nvJPEG backends; a bad name or load hint is refused with the rule."""
    from fullthrottle.data.gpu_decoders import parse_nvimgcodec_backends as parse

    assert parse("") == parse("hw") == [("HW_GPU_ONLY", 1.0)]
    assert parse("hw:0.7+hybrid") == [("HW_GPU_ONLY", 0.7), ("HYBRID_CPU_GPU", 1.0)]
    assert parse(" gpu + hw:0 ") == [("GPU_ONLY", 1.0), ("HW_GPU_ONLY", 0.0)]
    for bad, msg in (
        ("cuda", "unknown nvImageCodec backend 'cuda'"),
        ("hw:1.5", "must be a number in 0..1"),
        ("hw:x", "must be a number in 0..1"),
        ("hw+", "unknown nvImageCodec backend ''"),
    ):
        with pytest.raises(ValueError, match=msg):
            parse(bad)


def test_gpu_decoder_choice_and_errors(monkeypatch):
    import builtins

    from fullthrottle.data.gpu_decoders import GpuJpegDecoder, make_gpu_decoder

    with pytest.raises(ValueError, match="gpu_decoder must be one of"):
        make_gpu_decoder(torch.device("cpu"), "nvimgcodec")
    with pytest.raises(ValueError, match="gpu_decoder must be 'auto', 'hardware' or 'nvjpeg'"):
        Config(gpu_decoder="fast")
    real_import = builtins.__import__

    def no_nvimgcodec(name, *a, **k):
        if name.startswith("nvidia"):
            raise ImportError("No module named 'nvidia.nvimgcodec'")
        return real_import(name, *a, **k)

    monkeypatch.setattr(builtins, "__import__", no_nvimgcodec)
    d = make_gpu_decoder(torch.device("cpu"), "auto")  # auto falls back to nvJPEG
    assert isinstance(d, GpuJpegDecoder) and d.kind == "nvjpeg"
    assert make_gpu_decoder(torch.device("cpu"), "nvjpeg").kind == "nvjpeg"
    with pytest.raises(RuntimeError, match="hardware JPEG decoder is not available.*pip install nvidia-nvimgcodec"):
        make_gpu_decoder(torch.device("cpu"), "hardware")


def assert_same_results(res, ref):
    """``res`` (results in order) match ``ref`` (id -> result): ids, ok, top-1 class and prob, error text."""
    assert [r.id for r in res] == list(ref)
    for r in res:
        assert r.ok == ref[r.id].ok, (r.id, r.error, ref[r.id].error)
        if r.ok:
            assert r.class_ids[0] == ref[r.id].class_ids[0]
            assert r.probs[0] == pytest.approx(ref[r.id].probs[0], abs=1e-3)
        else:
            assert r.error.split(": ", 1)[1] == ref[r.id].error.split(": ", 1)[1]


def _pipe(gpu_decode, preprocess="threads"):
    pipe = Pipeline(
        Config(labels=LABELS, device="cpu", max_batch_size=8, threads=2, top_k=3, preprocess=preprocess), model=Tiny()
    )
    if gpu_decode is not None:
        pipe.engine.gpu_decoder = gpu_decode
    return pipe


@pytest.mark.parametrize("preprocess", ["threads", "processes"])
def test_mixed_cpu_gpu_batches_equal_cpu_only(samples, bad_dir, preprocess):
    inputs = [p for p in samples[:60]] + [bad_dir]
    ref = {r.id: r for r in _pipe(None).run(inputs)}
    fake = FakeGpuDecoder(fail_every=7)  # some GPU failures fall back to the CPU path, per item
    pipe = _pipe(fake, preprocess)
    res = list(pipe.run(inputs))
    if preprocess == "processes":  # with a GPU decoder, one dispatcher thread feeds both workers
        assert pipe.current_run.threads[0].name == "ft-preprocess-dispatch-0"
        assert not any(t.name == "ft-preprocess-dispatch-1" for t in pipe.current_run.threads)
        pipe.close()
    assert fake.images > 20, "the split sent nothing to the (fake) GPU decoder"
    assert_same_results(res, ref)
    assert 0 < pipe.engine.splitter.routed_gpu_share < 1
    if preprocess == "threads":  # (decoder processes route by availability, not by the rate split)
        assert 0 < pipe.engine.splitter.gpu_share < 1


def test_gpu_process_protocol_round_trip():
    from fullthrottle.data.gpu_wire import decode_reply, decode_request, encode_reply, encode_request

    items = [(b"\xff\xd8abc", 7), (b"", 0), (bytes(range(256)) * 3, 41)]
    back = decode_request(bytearray(encode_request(items)))
    assert [(bytes(d), r) for d, r in back] == items
    assert decode_request(encode_request([])) == []
    arena = bytearray(2000)  # the bytes in shared memory from offset 900; the request carries lengths only
    msg = encode_request(items, arena, 900)
    assert len(msg) < 64 and bytes(arena[900:905]) == b"\xff\xd8abc"
    back = decode_request(bytearray(msg), arena)
    assert [(bytes(d), r) for d, r in back] == items
    statuses = [None, "truncated or corrupt JPEG", None, "é ünïcode"]
    assert decode_reply(encode_reply(statuses, 0.25, 1.5, 3)) == (statuses, 0.25, 1.5, 3)
    assert decode_reply(encode_reply([])) == ([], 0.0, 0.0, 0)


@pytest.mark.skipif(not hasattr(os, "memfd_create"), reason="needs memfd_create (Linux)")
@pytest.mark.parametrize("short", [None, 0, 5, 300])
def test_gpu_process_request_written_with_pwritev(monkeypatch, short):
    """The arena's bytes go in with one os.pwritev on its memfd (no GIL held for the copy); a short
    write (``short`` bytes) is finished by hand from the image it cut, and the other side reads the
    same bytes either way."""
    import mmap

    import fullthrottle.data.gpu_wire as gw

    items = [(b"\xff\xd8abc", 7), (b"", 0), (bytes(range(256)) * 3, 41), (b"xyz" * 50, 3)]
    fd = os.memfd_create("t", 0)
    try:
        os.ftruncate(fd, 4096)
        arena = mmap.mmap(fd, 4096)
        calls = []
        if short is not None:
            real = os.pwritev

            def pwritev(f, bufs, off):
                calls.append(len(bufs))
                data = b"".join(bytes(b) for b in bufs)[:short]
                return real(f, [data], off) if data else 0

            monkeypatch.setattr(gw.os, "pwritev", pwritev)
        msg = gw.encode_request(items, arena, 1000, fd, iov_max=3)  # two system calls for 4 images
        back = gw.decode_request(bytearray(msg), arena)
        assert [(bytes(d), r) for d, r in back] == items
        if short is not None:
            assert calls == [3]  # stopped at the short write, the rest by hand
        del back  # (its views into the arena)
        arena.close()
    finally:
        os.close(fd)


class FakeGpuProcess:
    """A GPU decoder process's contract on CPU: crops written into the shared pool rows, one status each
    (the CPU path's decoder stands in for nvJPEG)."""

    depth = 2  # batches it may hold at once, answered in order
    delay_s = 0.01

    def __init__(self, pool, poison=None):
        self.pool, self.batches, self.poison, self.died = pool, [], poison, 0
        self.sent, self.max_queued, self.lost, self.inline = collections.deque(), 0, 0, 0
        self.discarded = self.paths = 0
        self.times = {"cpu_decoded": 0}  # images it would have decoded on its CPU (not gpu_eligible)

    slot_bytes = 150_000  # small arena slots: batches are split, the largest images go inline

    def fitting(self, items):
        from fullthrottle.data.gpu_decode_procs import count_fitting

        return count_fitting(items, self.slot_bytes)

    def send(self, items, slot=None):
        from fullthrottle.data.worker_procs import PATH_BIT

        self.paths += sum(1 for _, row in items if row & PATH_BIT)
        in_arena = slot is not None and sum(len(d) for d, _ in items) <= self.slot_bytes
        if not in_arena:
            self.inline += 1
            assert not self.sent, "an inline batch was sent to a busy process"
        self.sent.append(list(items))
        self.max_queued = max(self.max_queued, len(self.sent))
        return in_arena

    def discard_replies(self, timeout=2.0):
        self.discarded += len(self.sent)
        self.sent.clear()

    def receive(self, timeout):
        from fullthrottle.data.gpu_decoder_worker import _read_paths
        from fullthrottle.data.worker_procs import WorkerDied

        time.sleep(self.delay_s)  # decoding takes a while: the next batch can queue behind this one
        batch, read_errors = _read_paths(self.sent.popleft(), 256 << 20)  # (files sent as paths: read here)
        if self.poison and any(bytes(d) in self.poison for d, _ in batch):
            self.died += 1
            self.lost += len(self.sent)
            self.sent.clear()  # replaced: the new process owes nothing
            raise WorkerDied("GPU decoder process died on this batch (killed by signal SIGSEGV)")
        out = []
        for (data, row), err in zip(batch, read_errors):
            if err is not None:
                out.append(err)
                continue
            self.times["cpu_decoded"] += not gpu_eligible(bytes(data))[0]
            try:
                self.pool.array[row] = preprocess(bytes(data))
                out.append(None)
            except Exception as e:  # noqa: BLE001
                out.append(str(e))
        self.batches.append(len(batch))
        return out


def test_gpu_decoder_processes_path_equals_cpu_only(samples, bad_dir):
    """The pipeline's side of GPU decoder processes (routing, batches, pool rows, end markers): the
    same results as CPU-only decoding, every image accounted for, every crop row given back."""
    from types import SimpleNamespace

    # files (sent to the processes as paths) and bytes in memory (sent in their arena, or inline)
    inputs = [p if i % 2 else (str(p), p.read_bytes()) for i, p in enumerate(samples[:80])] + [bad_dir]
    ref = {r.id: r for r in _pipe(None).run(inputs)}
    pipe = _pipe(FakeGpuDecoder(), "processes")
    fakes = [FakeGpuProcess(pipe.decoders.crops) for _ in range(2)]
    pipe.gpu_decoders = SimpleNamespace(workers=fakes, close=lambda: None)
    try:
        for _ in range(2):  # a second run on the same processes and pool
            res = list(pipe.run(inputs))
            names = [t.name for t in pipe.current_run.threads]
            assert "ft-gpu-decode-0" in names and "ft-gpu-decode-1" in names
            assert_same_results(res, ref)
            assert pipe.decoders.crops.free_rows() == pipe.decoders.crops.rows  # every row came back
        assert sum(sum(f.batches) for f in fakes) > 10, "nothing was routed to the GPU processes"
        assert max(f.max_queued for f in fakes) == 2  # a batch waited behind another, never more
        assert sum(f.inline for f in fakes) > 0  # images larger than a slot went inline, to idle processes
        assert sum(f.paths for f in fakes) > 0  # files went as paths, read by the process
        assert 0 < pipe.engine.splitter.routed_gpu_share < 1
        # every image counted as routed to the GPU reached a GPU process (one at a time or in runs)
        assert pipe.engine.splitter.routed["gpu"] == sum(sum(f.batches) for f in fakes)
        # a process that dies on one image of a batch: the batch is retried image by image, so only
        # that image fails (when it went to the GPU; a CPU worker decodes it fine)
        poisoned = {str(p): p.read_bytes() for p in samples[:80:4]}
        for f in fakes:
            f.poison = set(poisoned.values())
        res = {r.id: r for r in pipe.run(inputs)}
        assert sum(f.died for f in fakes) > 0
        print("batches lost with a dead process, sent again:", sum(f.lost for f in fakes))
        for k, r in res.items():
            if k in poisoned and not r.ok:
                assert "died on this batch" in r.error
            else:
                assert r.ok == ref[k].ok, (k, r.error)
        assert sum(not r.ok for r in res.values()) > sum(not r.ok for r in ref.values())
    finally:
        pipe.close()


@pytest.mark.parametrize("cap", [1, 0])
def test_jpegs_keep_at_most_their_share_of_cpu_workers_busy(samples, bad_dir, monkeypatch, cap):
    """With GPU decoder processes, JPEGs the GPU could take keep at most cpu_jpeg_workers CPU decoder
    processes busy (the other cores drive the GPU decoder processes): beyond that a JPEG waits for
    the GPU's room. Other images (PNG, CMYK, ...) still go to every worker; results equal the CPU
    path's."""
    from types import SimpleNamespace

    from fullthrottle.data import cpu_feed

    assert cpu_feed.cpu_jpeg_workers(15, 0, cores=16) == 15  # no GPU decoder processes: all of them
    assert cpu_feed.cpu_jpeg_workers(15, 12, cores=16) == 2  # the cores left by 12 of them and the main process
    assert cpu_feed.cpu_jpeg_workers(15, 6, cores=16) == 8
    assert cpu_feed.cpu_jpeg_workers(3, 6, cores=64) == 3 and cpu_feed.cpu_jpeg_workers(15, 16, cores=16) == 1
    monkeypatch.setenv("FULLTHROTTLE_CPU_JPEG_WORKERS", "6")  # (trials set it)
    assert cpu_feed.cpu_jpeg_workers(15, 12, cores=16) == 6 and cpu_feed.cpu_jpeg_workers(4, 12, cores=16) == 4
    assert cpu_feed.cpu_jpeg_workers(15, 0, cores=16) == 15
    monkeypatch.setenv("FULLTHROTTLE_CPU_JPEG_WORKERS", "0")  # every JPEG the GPU decoders can take: theirs
    assert cpu_feed.cpu_jpeg_workers(15, 12, cores=16) == 0 and cpu_feed.cpu_jpeg_workers(15, 0, cores=16) == 15
    monkeypatch.setenv("FULLTHROTTLE_CPU_JPEG_WORKERS", "-1")
    with pytest.raises(ValueError, match="FULLTHROTTLE_CPU_JPEG_WORKERS must be an integer >= 0"):
        cpu_feed.cpu_jpeg_workers(15, 12, cores=16)
    monkeypatch.delenv("FULLTHROTTLE_CPU_JPEG_WORKERS")
    monkeypatch.setattr(cpu_feed, "cpu_jpeg_workers", lambda workers, gpu_processes, cores=None: cap)
    inputs = list(samples[:60]) + [bad_dir]
    ref = {r.id: r for r in _pipe(None).run(inputs)}
    pipe = _pipe(FakeGpuDecoder(), "processes")
    fakes = [FakeGpuProcess(pipe.decoders.crops) for _ in range(2)]
    pipe.gpu_decoders = SimpleNamespace(workers=fakes, close=lambda: None)
    out, peak, other = collections.Counter(), [0], [0]  # JPEGs out at the CPU workers; their peak

    def track(w):
        send, receive, flags = w.send, w.receive, collections.deque()

        def tracked_send(data, row, is_path=False):
            jpeg = gpu_eligible(open(data, "rb").read() if is_path else bytes(data))[0]
            flags.append(jpeg)
            out["jpeg"] += jpeg
            other[0] += not jpeg
            peak[0] = max(peak[0], out["jpeg"])
            return send(data, row, is_path)

        def tracked_receive():
            out["jpeg"] -= flags.popleft()
            return receive()

        w.send, w.receive = tracked_send, tracked_receive

    try:
        for w in pipe.decoders.workers:
            track(w)
        res = list(pipe.run(inputs))
        assert_same_results(res, ref)
        assert peak[0] == cap, peak  # (cap 1 and 0 here: the CPU workers took no JPEG at all)
        assert other[0] >= 5, other  # the bad inputs that are not GPU JPEGs went to the CPU workers
        assert sum(sum(f.batches) for f in fakes) > 30
    finally:
        pipe.close()


def test_gpu_process_discards_replies_owed_when_a_run_stops():
    """A run stopped with batches out at a GPU decoder process: their answers are read and dropped, so
    the next run's first batch gets its own."""
    import socket
    from multiprocessing.connection import Connection

    from fullthrottle.data.gpu_decode_procs import GpuDecoderProcess
    from fullthrottle.data.gpu_wire import encode_reply

    a, b = socket.socketpair()
    p = GpuDecoderProcess.__new__(GpuDecoderProcess)  # the parent's side only: no CUDA process here
    p.conn, p.closed, p.spawned = Connection(a.detach()), False, 0.0
    p.times = {"round_trip_s": 0.0, "launch_s": 0.0, "total_s": 0.0, "batches": 0, "cpu_decoded": 0}
    p._sent = collections.deque([time.perf_counter()] * 2)
    worker = Connection(b.detach())
    worker.send_bytes(encode_reply([None, None], cpu_decoded=1))
    worker.send_bytes(encode_reply(["truncated or corrupt JPEG"]))
    p.discard_replies(1.0)
    assert not p._sent and p.times["batches"] == 2 and p.times["cpu_decoded"] == 1 and not p.conn.poll(0)
    worker.send_bytes(encode_reply([None]))  # the next batch's answer is its own
    p._sent.append(time.perf_counter())
    assert p.receive(1.0) == [None]


def test_stopping_a_run_leaves_no_gpu_answer_owed(samples):
    from types import SimpleNamespace

    pipe = _pipe(FakeGpuDecoder(), "processes")
    fakes = [FakeGpuProcess(pipe.decoders.crops) for _ in range(2)]
    pipe.gpu_decoders = SimpleNamespace(workers=fakes, close=lambda: None)
    try:
        for _ in range(3):
            n = 0
            for _ in pipe.run(list(samples) * 2):
                n += 1
                if n == 40:
                    break
            pipe.current_run.stop()
            assert all(not f.sent for f in fakes), [len(f.sent) for f in fakes]
        ref = {r.id: r for r in _pipe(None).run(samples[:30])}
        assert_same_results(list(pipe.run(samples[:30])), ref)  # and the next run is right
    finally:
        pipe.close()


@pytest.mark.gpu
@pytest.mark.parametrize("kind", ["nvjpeg", "hardware"])
def test_gpu_decoder_against_cpu_path(samples, bad_dir, kind):
    """Mean absolute difference per pixel <= 2/255 against the CPU path; top-1 agreement >= 99%;
    every bad input gives the CPU path's result (for nvJPEG and for the hardware JPEG engines)."""
    from fullthrottle.data.gpu_decoders import make_gpu_decoder

    if kind == "hardware":
        pytest.importorskip("nvidia.nvimgcodec", reason="needs nvImageCodec (pip install nvidia-nvimgcodec-cu13)")
    dec = make_gpu_decoder(torch.device("cuda"), kind)
    assert dec.kind == kind
    blobs = [p.read_bytes() for p in samples if gpu_eligible(p.read_bytes())[0]]
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):  # as the pipeline runs it: on a side stream
        imgs = dec(blobs)
        assert not any(isinstance(i, Exception) for i in imgs)
        out = torch.empty((len(imgs), 224, 224, 3), dtype=torch.uint8, device="cuda")
        resize_crop_batch(imgs, out)
        del imgs  # the hardware decoder's buffers are freed stream-ordered: the resize has them first
    stream.synchronize()
    ref = np.stack([preprocess(b) for b in blobs])
    mad = np.abs(out.cpu().numpy().astype(np.int16) - ref.astype(np.int16)).mean()
    print(f"{kind} vs CPU path: mean abs diff {mad:.3f} / 255 over {len(blobs)} images")
    assert mad <= 2.0
    torch.manual_seed(0)
    cpu_pipe = Pipeline(Config(model="resnet18", device="cuda", gpu_decode=False, dtype="float32", max_batch_size=32))
    a = {r.id: r for r in cpu_pipe.run(list(samples) + [bad_dir])}
    cpu_pipe.close()
    # nvJPEG in decoder processes (the default with processes), and in a thread of this process
    for pre, n_gpu in (("processes", 2), ("threads", 0)):
        gpu_pipe = Pipeline(
            Config(
                device="cuda",
                dtype="float32",
                max_batch_size=32,
                gpu_decode=True,
                gpu_decoder=kind,
                preprocess=pre,
                gpu_decode_processes=n_gpu,
            ),
            model=cpu_pipe.engine.model,
        )
        try:
            b = {r.id: r for r in gpu_pipe.run(list(samples) + [bad_dir])}
            share = gpu_pipe.engine.splitter.routed_gpu_share
            summary = gpu_pipe.last_report.gpu_decode
        finally:
            gpu_pipe.close()
        assert a.keys() == b.keys()
        assert all(a[k].ok == b[k].ok for k in a), [(k, a[k].error, b[k].error) for k in a if a[k].ok != b[k].ok]
        assert all(a[k].error.split(": ", 1)[1] == b[k].error.split(": ", 1)[1] for k in a if not a[k].ok)
        agree = np.mean([a[k].class_ids[0] == b[k].class_ids[0] for k in a if a[k].ok])
        print(
            f"top-1 agreement CPU vs GPU decode ({kind}, {pre}, {n_gpu} GPU processes): {agree:.3f}; "
            f"{share:.0%} of eligible JPEGs decoded on the GPU; {summary}"
        )
        assert summary.startswith("GPU decode: " + ("the GPU's JPEG engines" if kind == "hardware" else "nvJPEG"))
        assert agree >= 0.99 and share > 0


@pytest.mark.gpu
def test_triton_resize_on_gpu_matches_the_products(samples, bad_dir):
    """The Triton resize + crop (what resize_crop_batch runs on CUDA) against the float32 matrix
    products on the CPU (the same filter) and the CPU path: 1/255 at most, and MAD <= 0.5/255."""
    from fullthrottle.core.kernels import use_triton
    from fullthrottle.data.gpu_resize import resize_crop_matmul

    rgbs = [decode(p.read_bytes()) for p in samples[:40]]
    rgbs.append(decode((bad_dir / "large-6000x4000.jpg").read_bytes()))  # 15x downscale: ~34 taps
    rgbs += [cv2.resize(rgbs[0], (640, 480))] * 3  # one shared size
    hwc = [torch.from_numpy(np.ascontiguousarray(a)) for a in rgbs]
    on_gpu = [
        t.cuda().permute(2, 0, 1) if k % 2 else t.permute(2, 0, 1).contiguous().cuda() for k, t in enumerate(hwc)
    ]  # HWC views and planar CHW
    out = torch.empty((len(rgbs), 224, 224, 3), dtype=torch.uint8, device="cuda")
    assert use_triton(out)
    resize_crop_batch(on_gpu, out)
    ref = torch.empty((len(rgbs), 224, 224, 3), dtype=torch.uint8)
    resize_crop_matmul([t.permute(2, 0, 1) for t in hwc], ref)
    d = (out.cpu().int() - ref.int()).abs()
    print(f"Triton resize vs float32 products: max {d.max().item()}, mean {d.float().mean().item():.4f} /255")
    assert d.max() <= 1 and d.float().mean() < 0.02
    for a, o in zip(rgbs, out.cpu()):
        diff = np.abs(o.numpy().astype(np.int16) - resize_crop(a).astype(np.int16))
        assert diff.mean() <= 0.5 and diff.max() <= 2


def assert_cpu_path_result(blob: bytes, got) -> None:
    """``got`` is what the CPU path gives ``blob``: the same crop, or an ImageError with the same message."""
    from fullthrottle.data.preprocess import ImageError

    try:
        want = preprocess(blob)
    except ImageError as err:
        assert isinstance(got, ImageError) and str(got) == str(err)
    else:
        assert isinstance(got, np.ndarray) and np.array_equal(got, want)


def test_decode_crops_checks_eligibility_itself_when_asked(samples, bad_dir):
    """GPU decoder processes get every JPEG-looking image unchecked (decode_crops(check=True)): what
    gpu_eligible refuses never reaches the GPU decoder and gets the CPU path's crop or error instead,
    byte for byte; the rest are decoded by the GPU decoder."""
    from fullthrottle.data.gpu_decode import decode_crops

    blobs = [p.read_bytes() for p in samples[:6]] + [
        (bad_dir / n).read_bytes() for n in ("cmyk.jpg", "exif-rotated.jpg", "truncated.jpg", "progressive.jpg")
    ]
    eligible = [gpu_eligible(b)[0] for b in blobs]
    assert eligible[6:] == [False, False, False, True]
    dec = FakeGpuDecoder()
    out = decode_crops(dec, [memoryview(bytearray(b)) for b in blobs], check=True)  # (arena slices)
    assert dec.images == sum(eligible)
    for b, e, o in zip(blobs, eligible, out):
        if e:  # the GPU decoder's image, resized and cropped
            rows, r = o
            ref = torch.empty((1, 224, 224, 3), dtype=torch.uint8)
            resize_crop_batch(FakeGpuDecoder()([b]), ref, 256, 224)
            assert torch.equal(rows[r], ref[0])
            continue
        assert_cpu_path_result(b, o)


def test_gpu_process_send_reports_a_failed_copy_and_bounds(monkeypatch):
    """A failed copy into the arena is this process's error, raised at once (it used to pass for a dead
    worker: nothing sent, then a decode_timeout_s wait and a healthy worker killed); bytes that would
    not fit in the arena are refused instead of being cut short; an unlimited timeout waits."""
    import errno
    import mmap
    import socket
    from multiprocessing.connection import Connection

    import fullthrottle.data.gpu_decode_procs as gp
    import fullthrottle.data.gpu_wire as gw

    arena_fd = os.memfd_create("t", 0)
    os.ftruncate(arena_fd, 4096)
    arena = mmap.mmap(arena_fd, 4096)
    with pytest.raises(ValueError, match="do not fit"):
        gw.encode_request([(b"x" * 100, 0)], arena, 4046, arena_fd)
    with pytest.raises(ValueError, match="do not fit"):
        gw.encode_request([(b"x" * 100, 0)], arena, 4046)  # the same without pwritev
    assert os.fstat(arena_fd).st_size == 4096  # nothing written past the mapping

    a, b = socket.socketpair()
    p = gp.GpuDecoderProcess.__new__(gp.GpuDecoderProcess)  # the parent's side only
    p.conn, p.closed, p.spawned, p.arena, p.arena_fd = Connection(a.detach()), False, 0.0, arena, arena_fd
    p.times = {"round_trip_s": 0.0, "launch_s": 0.0, "total_s": 0.0, "batches": 0, "cpu_decoded": 0}
    p._sent = collections.deque()
    p.proc = type("Alive", (), {"poll": lambda self: None})()
    worker = Connection(b.detach())

    def no_space(fd, bufs, off):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(gp.os, "pwritev", no_space)
    with pytest.raises(RuntimeError, match="shared memory.*No space left"):
        p.send([(b"\xff\xd8\xff" + b"x" * 100, 0)], slot=0)
    assert not p._sent and not worker.poll(0.1)  # nothing owed, nothing sent
    monkeypatch.undo()
    assert p.send([(b"\xff\xd8\xff" + b"y" * 10, 5)], slot=0) is True
    back = gw.decode_request(bytearray(worker.recv_bytes()), arena)
    assert [(bytes(d), r) for d, r in back] == [(b"\xff\xd8\xff" + b"y" * 10, 5)]
    del back
    worker.send_bytes(gw.encode_reply([None]))
    assert p.receive(float("inf")) == [None]  # decode_timeout_s=inf: no limit (poll takes no inf)
    arena.close()
    os.close(arena_fd)


def test_decode_crops_falls_back_to_the_cpu_when_the_gpu_batch_fails(samples, bad_dir, monkeypatch):
    """A failure of the batch's GPU resize (out of memory, say) is no image's: each image gets the CPU
    path's crop or error, and the images already on the CPU path keep theirs."""
    import fullthrottle.data.gpu_decode as gd

    def boom(*a, **k):
        raise torch.OutOfMemoryError("CUDA out of memory (simulated)")

    monkeypatch.setattr(gd, "resize_crop_batch", boom)
    blobs = [p.read_bytes() for p in samples[:3]] + [
        (bad_dir / "cmyk.jpg").read_bytes(),
        (bad_dir / "truncated.jpg").read_bytes(),
    ]
    out = gd.decode_crops(FakeGpuDecoder(), blobs, check=True)
    for b, o in zip(blobs, out):
        assert_cpu_path_result(b, o)


def test_gpu_decoder_pool_takes_one_kind_per_process():
    """A mix of decoder kinds names one kind per process; a list of another length is refused before
    any process starts."""
    from fullthrottle.data.crop_pool import CropPool
    from fullthrottle.data.gpu_decode_procs import GpuDecoderPool

    pool = CropPool(4, 8)
    try:
        with pytest.raises(ValueError, match="3 decoder kinds for 2 GPU decoder processes"):
            GpuDecoderPool(2, pool, crop_size=8, decoder=["hardware", "nvjpeg", "nvjpeg"])
    finally:
        pool.close()


def test_mps_server_running_looks_for_the_control_socket(tmp_path, monkeypatch):
    """The run summary says whether the GPU decoder processes started as MPS clients: a daemon
    listening on ``control`` in $CUDA_MPS_PIPE_DIRECTORY (stream or seqpacket), or its pid file naming
    a live process, means yes; nothing there, a plain file, the socket a killed daemon left behind
    (nobody accepts) or its pid file naming a dead process mean no."""
    import socket

    from fullthrottle.core.mps import mps_server_running

    monkeypatch.setenv("CUDA_MPS_PIPE_DIRECTORY", str(tmp_path))
    assert not mps_server_running()
    (tmp_path / "control").touch()
    assert not mps_server_running()
    for kind in (socket.SOCK_STREAM, socket.SOCK_SEQPACKET):  # (the daemon's may be either)
        (tmp_path / "control").unlink()
        srv = socket.socket(socket.AF_UNIX, kind)
        srv.bind(str(tmp_path / "control"))
        srv.listen(1)
        try:
            assert mps_server_running()
        finally:
            srv.close()
        assert (tmp_path / "control").exists() and not mps_server_running()  # stale socket file
    # the daemon's pid file: a live process means a server, a dead one's id a stale file
    (tmp_path / "nvidia-cuda-mps-control.pid").write_text(f"{os.getpid()}\n")
    assert mps_server_running()
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    (tmp_path / "nvidia-cuda-mps-control.pid").write_text(f"{dead.pid}\n")
    assert not mps_server_running()
    for junk in ("2147483648", "99999999999999999999", "-5", "abc", ""):  # never raises: no server
        (tmp_path / "nvidia-cuda-mps-control.pid").write_text(junk)
        assert not mps_server_running()
    (tmp_path / "nvidia-cuda-mps-control.pid").unlink()
    os.mkfifo(tmp_path / "nvidia-cuda-mps-control.pid")  # not a file: not read (opening it would wait)
    assert not mps_server_running()


def test_gpu_decode_processes_default_follows_the_mps_server(tmp_path, monkeypatch):
    """gpu_decode_processes unset (None) is decided when the Pipeline is made, however the Config was
    built (directly, by replace, by Pipeline overrides, by the CLI): 12 GPU decoder processes when an
    MPS server runs (its pid file names a live process), 6 when none does; the window
    (in_flight_limit) counts the same number; a value given is kept."""
    import dataclasses

    from fullthrottle.cli import _gpu_decode_settings, build_parser
    from fullthrottle.data.gpu_decode_procs import DEPTH

    def made(*args, **kw):  # the number a Pipeline settles on (CPU: no process is started, and the
        with Pipeline(*args, model=Tiny(), **kw) as pipe:  # run decodes on the CPU only)
            assert pipe.config.gpu_decode is False
            return pipe.config.gpu_decode_processes, dataclasses.replace(pipe.config, gpu_decode=True).in_flight_limit

    import fullthrottle.core.config as config_module
    import fullthrottle.workloads.classify.pipeline as pipeline_module
    from fullthrottle.core.mps import default_processes

    for m in (config_module, pipeline_module):  # a machine of 16 cores, as measured
        monkeypatch.setattr(m, "usable_cores", lambda: 16)
    # fewer cores under MPS: one process per core beyond four, at least two; none given: not capped
    assert [default_processes(True, c) for c in (2, 4, 8, 12, 16, 64)] == [2, 2, 4, 8, 12, 12]
    assert default_processes(True) == 12 and default_processes(False, 4) == 6
    base = dict(labels=LABELS, device="cpu", max_batch_size=8, threads=2, preprocess="threads")
    window = {n: (4 + 2 * n * DEPTH) * 8 + 2 * 2 for n in (6, 12, 3)}
    monkeypatch.setenv("CUDA_MPS_PIPE_DIRECTORY", str(tmp_path))
    assert Config(gpu_decode=True).gpu_decode_processes is None
    assert made(Config(gpu_decode=True, **base)) == (6, window[6])
    (tmp_path / "nvidia-cuda-mps-control.pid").write_text(f"{os.getpid()}\n")
    assert Config(gpu_decode=True, **base).in_flight_limit == window[12]
    assert made(Config(gpu_decode=True, **base)) == (12, window[12])
    assert made(dataclasses.replace(Config(**base), gpu_decode=True)) == (12, window[12])
    assert made(Config(**base), gpu_decode=True) == (12, window[12])
    assert made(Config(gpu_decode=True, gpu_decode_processes=3, **base)) == (3, window[3])
    assert made(Config(gpu_decode=False, **base))[0] is None  # (no GPU decode: nothing to decide)
    for argv, want in ((["--gpu-decode"], 12), (["--gpu-decode", "--gpu-decode-processes", "2"], 2)):
        args = build_parser().parse_args(["classify", "x.jpg", *argv])
        assert made(Config(**base, **_gpu_decode_settings(args)))[0] == want
    for bad in (17, -1, True, "8", 2.0):
        with pytest.raises(ValueError, match="gpu_decode_processes must be None .* or an integer in 0..16"):
            Config(gpu_decode=True, gpu_decode_processes=bad)
