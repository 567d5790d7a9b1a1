"""Decoder worker processes (preprocess="processes"): failures cost one item, never the run."""

import os
import signal
import time

import cv2
import numpy as np
import pytest
import torch
from test_pipeline import tiny_pipe

from fullthrottle import Config
from fullthrottle.core.config import GPU_PROCESS_DEPTH
from fullthrottle.data.preprocess import ImageError, preprocess
from fullthrottle.data.preprocess_procs import DecoderPool, DecoderProcess


@pytest.fixture(scope="module")
def pool():
    p = DecoderPool(1)
    yield p
    procs = [w.proc for w in p.workers]
    p.close()
    assert all(x.poll() is not None for x in procs)


def test_worker_that_died_idle_is_replaced_before_the_next_image(pool, samples):
    w = pool[0]
    old = w.proc
    os.kill(old.pid, signal.SIGKILL)
    old.wait(5)
    data = samples[0].read_bytes()
    assert np.array_equal(w(data), preprocess(data))  # no error for an image the dead worker never saw
    assert w.proc is not old


def test_ctrl_c_at_the_terminal_never_reaches_a_starting_worker(samples):
    """A terminal's Ctrl-C goes to its foreground process group: workers start in a group of their
    own, so one still importing torch (before any handler of its own) is not killed by it."""
    p = DecoderPool(1)
    try:
        w = p.workers[0]
        w._restart()  # a fresh process, still starting
        assert os.getpgid(w.proc.pid) == w.proc.pid != os.getpgid(0)
        data = samples[1].read_bytes()
        assert np.array_equal(w(data), preprocess(data))
    finally:
        p.close()


def test_ctrl_c_is_left_to_the_parent(pool, samples):
    os.kill(pool[0].proc.pid, signal.SIGINT)  # a terminal's Ctrl-C reaches the whole process group
    time.sleep(0.3)
    assert pool[0].proc.poll() is None
    data = samples[1].read_bytes()
    assert np.array_equal(pool[0](data), preprocess(data))


def test_error_longer_than_a_small_crop_arrives_whole(bad_dir):
    w = DecoderProcess(resize_size=8, crop_size=4)
    try:
        with pytest.raises(ImageError, match="image too large: 40000x40000"):
            w((bad_dir / "bomb-40000x40000.png").read_bytes())
    finally:
        w.close()


@pytest.mark.parametrize("size", [(20000, 1), (1, 30000)])
def test_extreme_aspect_ratio_is_refused_before_resizing(size):
    ok, png = cv2.imencode(".png", np.zeros((size[1], size[0], 3), np.uint8))
    with pytest.raises(ImageError, match="extreme aspect ratio"):
        preprocess(png.tobytes())  # would be 5120000 x 256 (3.9 GB) after Resize(256)


def test_a_hung_worker_costs_its_image_only(samples, no_thread_leak):
    inputs = [str(p) for p in samples[:30]]
    with tiny_pipe(preprocess="processes", threads=2, decode_timeout_s=1.5) as pipe:
        assert all(w.wait_ready(30) for w in pipe.decoders.workers)  # past their imports: a slow answer is a hang
        stuck = pipe.decoders[0].proc
        os.kill(stuck.pid, signal.SIGSTOP)  # a decoder hang, as far as the pipeline can tell
        t0 = time.perf_counter()
        res = pipe.classify(inputs)
        assert time.perf_counter() - t0 < 10  # the timeout (1.5 s) and a replacement's start, not STARTUP_S
        failed = [r for r in res if not r.ok]
        assert len(failed) == 1 and "decode_timeout_s" in failed[0].error
        assert [r.id for r in res] == inputs and sum(r.ok for r in res) == 29
        assert stuck.poll() is not None and pipe.decoders[0].proc is not stuck


def test_config_checks():
    with pytest.raises(ValueError, match="crop_size <= resize_size"):
        Config(crop_size=300).for_model()  # (checked against the model's resize 256)
    for bad in (1.5, True, 0):
        with pytest.raises(ValueError, match="threads must be an integer"):
            Config(threads=bad)
    with pytest.raises(ValueError, match="decode_timeout_s"):
        Config(decode_timeout_s=0)


def test_row_spans_cover_exactly_the_rows_asked_for():
    from fullthrottle.data.device_copy import row_spans

    assert row_spans([7, 3, 4, 5, 40, 41]) == [(3, 8), (40, 42)]
    assert row_spans([5, 1], max_gap=1) == [(1, 2), (5, 6)]
    assert row_spans([]) == []
    rows = list(np.random.default_rng(0).choice(500, 64, replace=False))
    covered = {r for lo, hi in row_spans(rows) for r in range(lo, hi)}
    assert set(rows) <= covered


def test_few_crop_rows_keep_every_result(samples, bad_dir, no_thread_leak):
    """4 shared crop rows for batches of 8: the dispatcher waits for rows (backpressure), nothing is lost,
    and every crop reaches its own item."""
    inputs = [str(p) for p in samples[:50]] + sorted(str(p) for p in bad_dir.iterdir())
    with tiny_pipe() as pipe:
        ref = pipe.classify(inputs)
    with tiny_pipe(preprocess="processes", max_in_flight=4) as pipe:
        assert pipe.decoders.crops.rows == 4
        got = pipe.classify(inputs)
        assert pipe.decoders.crops.free_rows() == 4  # every row given back
        names = [t.name for t in pipe.current_run.threads if t.name.startswith("ft-preprocess-dispatch")]
        assert len(names) == 1
    assert [(r.id, r.ok, r.error, r.class_ids) for r in got] == [(r.id, r.ok, r.error, r.class_ids) for r in ref]


def test_crop_pool_is_released_when_collected():
    """A pool dropped without close() still releases its file (and, on CUDA, its registration)."""
    import gc

    from fullthrottle.data.crop_pool import CropPool

    pool = CropPool(3, crop_size=8, scratch=1)
    assert pool.array.shape == (4, 8, 8, 3) and pool.free_rows() == 3
    assert [pool.acquire() for _ in range(3)] == [0, 1, 2] and pool.free_rows() == 0
    pool.release([1])
    assert pool.acquire() == 1
    fd = pool.fd
    os.fstat(fd)
    del pool
    gc.collect()
    with pytest.raises(OSError):
        os.fstat(fd)
    with pytest.raises(ValueError, match="at least one row"):
        CropPool(0, 8)


@pytest.mark.parametrize("fmt", ["BMP", "GIF"])
def test_forged_bmp_and_gif_headers_meet_our_limit(fmt):
    """The configured max_image_pixels, not Pillow's own limit, refuses a forged header, by name."""
    import struct

    if fmt == "BMP":
        data = (
            b"BM"
            + struct.pack("<IHHI", 54, 0, 0, 54)
            + struct.pack("<IiiHHIIiiII", 40, 15000, 15000, 1, 24, 0, 0, 0, 0, 0, 0)
        )
    else:
        data = b"GIF89a" + struct.pack("<HHBBB", 60000, 60000, 0, 0, 0) + b"\x3b"
    for limit in (1_000_000, 89_478_485):
        with pytest.raises(ImageError, match="image too large: .* megapixels.*max_image_pixels"):
            preprocess(data, max_pixels=limit)


def test_images_queue_at_a_worker_only_within_its_socket_buffer(samples, monkeypatch, no_thread_leak):
    """Up to WORKER_DEPTH images are out at each worker, but one waits behind another only while the
    bytes fit in the worker's socket buffer (so a send never blocks on a hung worker): with a budget
    smaller than any JPEG no worker is sent a second image before it answered the first; with the
    real buffer images do queue; every result arrives either way."""
    import fullthrottle.data.preprocess_procs as pp

    out, peak, kinds = {}, {}, set()
    send0, receive0 = pp.DecoderProcess.send, pp.DecoderProcess.receive

    def send(self, data, row, is_path=False):
        out[id(self)] = out.get(id(self), 0) + 1
        peak[id(self)] = max(peak.get(id(self), 0), out[id(self)])
        kinds.add(is_path)
        return send0(self, data, row, is_path)

    def receive(self):
        try:
            return receive0(self)
        finally:
            out[id(self)] -= 1

    monkeypatch.setattr(pp.DecoderProcess, "send", send)
    monkeypatch.setattr(pp.DecoderProcess, "receive", receive)
    inputs = [str(p) for p in samples[:40]]
    with tiny_pipe() as pipe:
        ref = [(r.id, r.class_ids) for r in pipe.classify(inputs)]
    with tiny_pipe(preprocess="processes") as pipe:
        assert all(w.queue_bytes > 100_000 for w in pipe.decoders.workers)  # the kernel's grant
        kinds.clear()  # (the workers' start-up probe went as bytes)
        got = [(r.id, r.class_ids) for r in pipe.classify(inputs)]
        assert got == ref and max(peak.values()) >= 2
        assert kinds == {True}  # files go to the workers as paths: this process reads none of them
        peak.clear()
        for w in pipe.decoders.workers:
            w.queue_bytes = 16
        got = [(r.id, r.class_ids) for r in pipe.classify(inputs)]
        assert got == ref and max(peak.values()) == 1


def test_decoder_processes_default_to_one_per_core_but_one(monkeypatch):
    """The main process's threads (dispatcher, batcher, compute, decode) need about a core: by default
    one is left to them; an explicit thread count is taken as given (capped at the cores); the
    pipeline starts what the config says."""
    import fullthrottle.core.config as fc

    monkeypatch.setattr(fc, "usable_cores", lambda: 3)
    assert Config(threads=None).decoder_processes() == 2
    assert Config(threads=3).decoder_processes() == 3
    assert Config(threads=8).decoder_processes() == 3
    monkeypatch.setattr(fc, "usable_cores", lambda: 1)
    assert Config(threads=None).decoder_processes() == 1
    with tiny_pipe(preprocess="processes", threads=None) as pipe:
        assert len(pipe.decoders) == 1


def test_worker_gets_malloc_settings_and_reports_its_time_split(samples, tmp_path, monkeypatch):
    import json

    import fullthrottle.data.preprocess_procs as pp

    monkeypatch.setenv(pp.STATS_ENV, str(tmp_path / "w"))
    w = DecoderProcess()
    data = samples[0].read_bytes()
    for _ in range(3):
        np.testing.assert_array_equal(w(data), preprocess(data))
    # read once the worker has answered (right after the spawn, the new process may not have exec'd yet)
    env = open(f"/proc/{w.proc.pid}/environ", "rb").read().split(b"\0")
    assert f"MALLOC_MMAP_THRESHOLD_={16 << 20}".encode() in env
    with pytest.raises(ImageError, match="unrecognised format"):
        w(b"not an image")  # the timed loop words errors as the plain one does
    pid = w.proc.pid
    w.close()
    stats = json.loads((tmp_path / f"w.{pid}.json").read_text())
    assert stats["images"] == 4  # 3 images + the refused one
    assert stats["preprocess_cpu_s"] > 0 and stats["minor_faults"] >= 0


@pytest.mark.parametrize("foreach", [True, False])
def test_copy_all_copies_every_pair_like_copy_(monkeypatch, foreach):
    """The compute thread's H2D copies in one call: slices of a pool and a row index list (two dtypes)
    land exactly where a copy_ each would put them, with torch._foreach_copy_ or without it."""
    import fullthrottle.data.device_copy as c

    if not foreach:
        monkeypatch.delattr(torch, "_foreach_copy_", raising=False)
    pool = torch.arange(10 * 2 * 2 * 3, dtype=torch.uint8).view(10, 2, 2, 3)
    mirror = torch.zeros_like(pool)
    rows = torch.tensor([9, 3, 4, 0], dtype=torch.int64)
    dev_rows = torch.zeros(8, dtype=torch.int64)
    spans = c.row_spans(rows.tolist(), max_gap=2)
    assert spans == [(0, 1), (3, 5), (9, 10)]
    c.copy_all([mirror[lo:hi] for lo, hi in spans] + [dev_rows[:4]], [pool[lo:hi] for lo, hi in spans] + [rows])
    for r in range(10):
        assert torch.equal(mirror[r], pool[r]) == (r in (0, 3, 4, 9))
    assert dev_rows.tolist() == [9, 3, 4, 0, 0, 0, 0, 0]
    c.copy_all([], [])  # nothing to copy: no call
    with pytest.raises(ValueError, match="1 destinations for 2 sources"):
        c.copy_all([mirror[0]], [pool[0], pool[1]])


def test_worker_crash_with_answers_owed_costs_only_its_image(samples, monkeypatch, no_thread_leak):
    """A worker that dies on an image while the dispatcher is slow to come back (GIL contention) must
    not be replaced by the next send: the new worker's answer would be taken for the crashed image,
    whose crop was never written. The crashed image gets the error; every other image its own result."""
    import fullthrottle.data.preprocess_procs as pp

    monkeypatch.setattr(
        pp,
        "_WORKER_CMD",
        (
            "import sys, os; import fullthrottle.data.decoder_worker as dw; orig = dw._work_one\n"
            "def w(msg, *a):\n"
            "    if b'CRASHME' in msg[:40]: os._exit(3)\n"
            "    return orig(msg, *a)\n"
            "dw._work_one = w; dw.worker_main(sys.argv[1:])"
        ),
    )
    receive = pp.DecoderProcess.receive
    slow = [False]

    def slow_receive(self):
        receive(self)
        if slow[0]:
            time.sleep(0.1)  # the dispatcher late to its next send: the worker dies in the meantime

    monkeypatch.setattr(pp.DecoderProcess, "receive", slow_receive)
    good = [(p.name, p.read_bytes()) for p in samples[:12]]
    with tiny_pipe(preprocess="processes", threads=1, decode_timeout_s=10.0) as pipe:
        ref = {r.id: r.class_ids for r in pipe.classify(good)}
        slow[0] = True
        t0 = time.perf_counter()
        res = pipe.classify(good[:4] + [("CRASH", b"\xff\xd8\xffCRASHME" + bytes(100))] + good[4:])
        took = time.perf_counter() - t0
    assert "decoder process died on this item (exit code 3)" in res[4].error
    assert all(r.ok and r.class_ids == ref[r.id] for r in res if r.id != "CRASH")
    assert took < 10.0  # nobody waited out decode_timeout_s (the replacement's start takes seconds)


def test_crop_rows_follow_a_raised_window_up_to_twice_the_batches_need():
    """Every item the window admits may hold a decoded crop: a larger max_in_flight gets the rows to
    queue more ahead of the decoders (a fixed cap made the rows, not the window, the limit), up to
    twice what the batches in flight need; the pipeline's pool has the rows the config gives."""
    base = dict(preprocess="processes", threads=2, max_batch_size=8, staging_slots=3, gpu_decode=False)
    cfg = Config(**base)
    assert cfg.crop_rows(2, 0) == cfg.in_flight_limit  # the default window
    need = (3 + 3) * 8 + 2 * 2  # staging slots + 3 batches of 8, 2 rows per decoder process
    assert need < 80 and Config(**base, max_in_flight=80).crop_rows(2, 0) == 80
    assert Config(**base, max_in_flight=500).crop_rows(2, 0) == 2 * need
    need_gpu = (3 + 3 + 2 * GPU_PROCESS_DEPTH) * 8 + 2 * 2  # and 2 GPU decoder processes' batches out
    assert Config(**base, max_in_flight=500).crop_rows(2, 2) == 2 * need_gpu
    with tiny_pipe(**base, max_in_flight=500) as pipe:
        assert pipe.decoders.crops.rows == 2 * need


def test_a_folder_with_broken_files_read_by_the_decoder_processes(samples, bad_dir, tmp_path, no_thread_leak):
    """1,000 files, 5% of them broken (the bad inputs under other names, and files that cannot be
    read: missing, a symlink loop, a named pipe, over max_file_bytes), read by the decoder processes
    themselves: every result equals the one from the loader's own reads (threads) on the same files,
    errors worded alike, in input order; a decoder process killed mid-run costs at most the image it held."""
    import os
    import signal

    from PIL import Image

    folder, small = tmp_path / "photos", []
    folder.mkdir()
    for k, p in enumerate(samples[:20]):  # small copies of real photos: the test is about the files, not pixels
        small.append(tmp_path / f"small{k}.jpg")
        Image.open(p).convert("RGB").resize((96, 72)).save(small[-1], quality=90)
    bad = sorted(p for p in bad_dir.iterdir() if p.name != "README.md" and p.stat().st_size < 5 << 20)
    specials = ["missing", "loop", "fifo", "oversized"]
    n_bad = unreadable = 0
    for i in range(1000):
        name = folder / f"{i:05d}.jpg"
        if i % 20 == 7:  # 5% broken
            kind = (bad + specials)[n_bad % (len(bad) + len(specials))]
            n_bad += 1
            unreadable += kind in specials
            if kind == "missing":
                name.symlink_to(tmp_path / "gone.jpg")  # (a file that vanished after the walk)
            elif kind == "loop":
                name.symlink_to(name)
            elif kind == "fifo":  # (never opened: a read would wait for a writer)
                os.mkfifo(name)
            elif kind == "oversized":
                with open(name, "wb") as f:
                    f.truncate(6 << 20)
            else:
                name.write_bytes(kind.read_bytes())
        else:
            name.symlink_to(small[i % len(small)])
    inputs = [str(folder / f"{i:05d}.jpg") for i in range(1000)]
    with tiny_pipe(max_file_bytes=5 << 20) as pipe:
        ref = [(r.id, r.class_ids, r.error) for r in pipe.run(inputs)]
    errors = [e for _, _, e in ref if e]
    # (most of the bad inputs are odd but valid images: WebP, CMYK, 16-bit PNG, ... which decode)
    assert unreadable + 5 < len(errors) < n_bad
    for want in ("file not found", "Too many levels of symbolic links", "not a regular file", "file too large"):
        assert any(want in e for e in errors), want
    with tiny_pipe(max_file_bytes=5 << 20, preprocess="processes") as pipe:
        it = pipe.run(inputs)  # a decoder process is killed after the first results
        got, killed = [], False
        for r in it:
            got.append((r.id, r.class_ids, r.error))
            if len(got) == 300 and not killed:
                os.kill(pipe.decoders.workers[0].proc.pid, signal.SIGKILL)
                killed = True
    diff = [(g, r) for g, r in zip(got, ref) if g != r]
    assert [g[0] for g in got] == [r[0] for r in ref]  # nothing lost, order kept
    assert len(diff) <= 1 and all("decoder process died on this item" in g[2] for g, _ in diff), diff[:3]


def test_a_workers_decode_clock_starts_once_it_is_ready():
    """Until a new worker has imported its libraries its images wait for that, not for a decoder:
    the hang clock starts STARTUP_S after its start, and once it is ready, when it was seen ready."""
    from fullthrottle.data.worker_procs import STARTUP_S

    w = DecoderProcess()
    try:
        assert not w.is_ready() and w.grace_until() == w.spawned + STARTUP_S  # (importing torch: seconds)
        assert w.wait_ready(60)
        assert w.spawned < w.ready_at == w.grace_until() <= time.perf_counter()
    finally:
        w.close()


def test_decoder_processes_start_beside_the_model_and_a_failed_start_leaves_none(tmp_path, samples, monkeypatch):
    """The pipeline starts its decoder processes before it loads the model (wait=False): a model
    that fails to load stops them all, including those still starting; a good start classifies."""
    from procs import alive, children

    from fullthrottle import Pipeline
    from fullthrottle.workloads.classify.models import WeightsError

    bad = tmp_path / "bad.safetensors"
    bad.write_bytes(b"not a safetensors file")
    cfg = Config(model="resnet18", device="cpu", preprocess="processes", threads=2, max_batch_size=4)
    import fullthrottle.workloads.classify.pipeline as pl

    before, seen = children(os.getpid()), []
    real = pl.Engine

    def engine(*a, **k):  # the model loads while the decoder processes come up
        deadline = time.time() + 10
        while not (children(os.getpid()) - before) and time.time() < deadline:
            time.sleep(0.01)
        seen.append(len(children(os.getpid()) - before))
        return real(*a, **k)

    monkeypatch.setattr(pl, "Engine", engine)
    with pytest.raises(WeightsError):
        Pipeline(cfg, weights=str(bad))
    monkeypatch.undo()
    assert seen and seen[0] >= 1
    left = [p for p in children(os.getpid()) - before if alive(p)]
    assert not left, left
    pool = DecoderPool(2, wait=False)  # started in the background, waited for later
    pool.wait_ready()
    assert len(pool) == 2 and all(w.proc.poll() is None for w in pool.workers)
    pool.close()
    with Pipeline(cfg) as pipe:
        got = pipe.classify(samples[:6])
    assert [r.ok for r in got] == [True] * 6 and pipe.decoders is not None


def test_a_worker_whose_parent_left_during_its_start_exits_quietly(capfd):
    """A second Ctrl-C while the decoder processes still import: the parent is gone before a worker
    says it is ready. The worker then exits at once, with status 0 and no traceback."""
    import os

    w = DecoderProcess(resize_size=8, crop_size=4)
    _, _, (conn, proc, ready_r, err_r), _ = w._finalizer.detach()  # (closed by hand here)
    os.close(ready_r)  # the parent's end of the readiness pipe, as at its exit
    try:
        assert proc.wait(60) == 0
    finally:
        conn.close()
        os.close(err_r)
        proc.kill()
    assert "Traceback" not in capfd.readouterr().err


def test_a_jpeg_decoded_from_damaged_data_is_named_with_the_decoders_warning(samples, tmp_path, caplog, capfd):
    """A JPEG whose data is damaged mid-way is decoded by libjpeg anyway, which writes "Corrupt JPEG
    data: ..." to its process's stderr: the decoder process catches it and sends it back with the
    image, and the warning is given with the file's name. No line without a name reaches stderr,
    and the image's result is the one of the damaged image (as the thread path decodes it)."""
    import logging

    data = bytearray(samples[0].read_bytes())
    data[len(data) // 2 : len(data) // 2 + 200] = bytes(200)
    damaged = tmp_path / "damaged.jpg"
    damaged.write_bytes(data)
    odd = tmp_path / os.fsdecode(b"caf\xe9\nd.jpg")  # (a name with a byte that is not UTF-8, and a newline)
    odd.write_bytes(data)
    inputs = [str(damaged), str(samples[1]), str(odd)]
    with caplog.at_level(logging.WARNING, logger="fullthrottle.data.cpu_feed"):
        with tiny_pipe(preprocess="processes") as pipe:
            got = [(r.id, r.class_ids, r.error) for r in pipe.run(inputs)]
    said = "decoded, with the decoder's warning: Corrupt JPEG data: premature end of data segment"
    assert caplog.messages == [f"{damaged}: {said}", f"'{tmp_path}/caf\\xe9\\nd.jpg': {said}"]
    assert "Corrupt JPEG data" not in capfd.readouterr().err
    with tiny_pipe(preprocess="threads") as pipe:
        assert got == [(r.id, r.class_ids, r.error) for r in pipe.run(inputs)]


def test_what_a_decoder_process_wrote_as_it_died_reaches_stderr(samples, monkeypatch, capfd):
    """A decoder process's fd 2 is a pipe it empties after each image (libjpeg's warnings go back
    with their image): what a process that crashes wrote there, a C library's abort message or
    faulthandler's report, is read by the parent and printed, not lost with the process."""
    import fullthrottle.data.preprocess_procs as pp

    monkeypatch.setattr(
        pp,
        "_WORKER_CMD",
        (
            "import sys, os, signal; import fullthrottle.data.decoder_worker as dw; orig = dw._work_one\n"
            "def w(msg, *a):\n"
            "    if b'CRASHME' in msg[:40]:\n"
            "        os.write(2, b'free(): invalid pointer\\n'); os.kill(os.getpid(), signal.SIGSEGV)\n"
            "    return orig(msg, *a)\n"
            "dw._work_one = w; dw.worker_main(sys.argv[1:])"
        ),
    )
    w = DecoderProcess()
    try:
        data = samples[0].read_bytes()
        assert np.array_equal(w(data), preprocess(data))
        with pytest.raises(Exception, match=r"decoder process died on this item \(killed by signal SIGSEGV\)"):
            w(b"CRASHME" + data)
        err = capfd.readouterr().err
        assert (
            "fullthrottle: a decoder process died (killed by signal SIGSEGV); its last output:\nfree(): invalid pointer"
            in err
        )
        assert np.array_equal(w(data), preprocess(data))  # (its replacement)
    finally:
        w.close()


def test_a_file_that_cannot_be_read_is_named_alike_by_the_threads_and_the_decoder_processes(tmp_path):
    """A FIFO and a symlink loop under names whose bytes are not UTF-8, read by the loader (threads)
    or by the decoder processes themselves: the same errors, the names shown as their ids are (a
    byte that is not UTF-8 as \\xNN, not '?')."""
    fifo, loop = tmp_path / os.fsdecode(b"ff\xe9.jpg"), tmp_path / os.fsdecode(b"ll\xe9.jpg")
    os.mkfifo(fifo)
    loop.symlink_to(loop)
    errors = {}
    for how in ("threads", "processes"):
        with tiny_pipe(preprocess=how, max_batch_size=2) as pipe:
            errors[how] = [r.error for r in pipe.run([str(fifo), str(loop)])]
    assert errors["threads"] == errors["processes"], errors
    assert errors["threads"][0] == f"not a regular file: {tmp_path}/ff\\xe9.jpg"
    assert errors["threads"][1].startswith(f"cannot read {tmp_path}/ll\\xe9.jpg: ")
