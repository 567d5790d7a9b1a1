"""Decoder worker processes (preprocess="processes"): failures cost one item, never the run."""

import os
import signal
import time

import cv2
import numpy as np
import pytest

from fullthrottle import Config
from fullthrottle.preprocess import ImageError, preprocess
from fullthrottle.preprocess_procs import DecoderPool, DecoderProcess

from test_pipeline import tiny_pipe


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
        stuck = pipe.decoders[0].proc
        os.kill(stuck.pid, signal.SIGSTOP)  # a decoder hang, as far as the pipeline can tell
        t0 = time.perf_counter()
        res = pipe.classify(inputs)
        assert time.perf_counter() - t0 < 30
        failed = [r for r in res if not r.ok]
        assert len(failed) == 1 and "decode_timeout_s" in failed[0].error
        assert [r.id for r in res] == inputs and sum(r.ok for r in res) == 29
        assert stuck.poll() is not None and pipe.decoders[0].proc is not stuck


def test_config_checks():
    with pytest.raises(ValueError, match="crop_size <= resize_size"):
        Config(crop_size=300)
    for bad in (1.5, True, 0):
        with pytest.raises(ValueError, match="threads must be an integer"):
            Config(threads=bad)
    with pytest.raises(ValueError, match="decode_timeout_s"):
        Config(decode_timeout_s=0)
