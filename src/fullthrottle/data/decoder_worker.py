"""The CPU decoder process's side (its parent's side is :mod:`~fullthrottle.data.preprocess_procs`): it
reads requests from its socket (a crop-pool row, then encoded bytes or a file's path), runs
:func:`~fullthrottle.data.preprocess.preprocess`, writes the crop into its row of the shared pool and
answers with one status byte, or the status and the item's error.

The protocol: a request is ``_ROW`` (the row, with :data:`~fullthrottle.data.worker_procs.PATH_BIT` set for
a path) and the bytes; a reply is ``_OK``, ``_WARNED`` followed by the decoder's warnings (the crop
is written), or ``_IMAGE_ERROR`` / ``_OTHER_ERROR`` / ``_LOAD_ERROR`` followed by the error's text.

The warnings are what C libraries write to the process's stderr while decoding the image: libjpeg's
"Corrupt JPEG data: ..." (through OpenCV) for a JPEG it decoded from damaged data. A process decodes
one image at a time, so they are caught here (:class:`CStderr`) and go back with the image they came
from, for the parent to give with its name.
"""

from __future__ import annotations

import mmap
import os
import signal
import struct
import sys
import time
from multiprocessing.connection import Connection

import numpy as np

from ..core import env
from .load import LoadError, read_local
from .preprocess import ImageError, preprocess
from .worker_procs import PATH_BIT

_OK, _IMAGE_ERROR, _OTHER_ERROR = 0, 1, 2
_ROW = struct.Struct("<I")  # the pool row a request's crop goes to, ahead of the encoded bytes
_LOAD_ERROR = 3  # reply: the file could not be read (the message is the item's whole error)
_WARNED = 4  # reply: the crop is written; the decoder's warnings follow
#: most bytes of an image's warnings sent back (the rest dropped)
MAX_WARNING_BYTES = 1000


class CStderr:
    """File descriptor 2 of this process turned into the pipe ``(r, w)`` (made by the parent, which
    keeps ``r`` too: what a process that dies wrote last, a crash's report, is read there), which
    :meth:`take` empties: what C code (libjpeg) writes there is caught. Python's ``sys.stderr``, and
    ``faulthandler`` where it is on, keep the stream they had. Neither end blocks: past the pipe's
    capacity (64 KiB) between two :meth:`take`, a decoder's lines are dropped, it never waits."""

    def __init__(self, r: int, w: int):
        import faulthandler

        os.set_blocking(r, False)
        os.set_blocking(w, False)
        keep = os.dup(2)
        sys.stderr.flush()
        os.dup2(w, 2)
        os.close(w)
        sys.stderr = open(keep, "w", encoding="utf-8", errors="backslashreplace", buffering=1)  # noqa: SIM115
        if faulthandler.is_enabled():  # (it wrote to fd 2 as it was)
            faulthandler.enable(sys.stderr)
        self._r = r

    def take(self) -> bytes:
        """What was written since the last call: its lines joined by "; ", at most
        :data:`MAX_WARNING_BYTES` (b"" for none)."""
        got = b""
        while True:
            try:
                chunk = os.read(self._r, 65536)
            except BlockingIOError:
                break
            if not chunk:
                break
            got += chunk[: max(0, 4 * MAX_WARNING_BYTES - len(got))]
        lines = [ln.strip() for ln in got.splitlines() if ln.strip()]
        return b"; ".join(dict.fromkeys(lines))[:MAX_WARNING_BYTES]


def worker_main(argv: list[str]) -> None:
    """A CPU decoder process's main (``argv``: the socket, pool and readiness fds, then the transform
    and limits, then the two ends of the pipe its fd 2 becomes, as
    :class:`~fullthrottle.data.preprocess_procs.DecoderProcess` starts it)."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the parent's to handle; we end on EOF
    fd, pool_fd, ready_fd, resize_size, crop_size, max_pixels, nice, pool_rows, max_file_bytes = (
        int(a) for a in argv[:9]
    )
    interpolation = argv[9] if len(argv) > 9 else "bilinear"
    err_r, err_w = (int(a) for a in argv[10:12])  # (the pipe fd 2 becomes: CStderr)
    if nice:
        try:
            os.nice(nice)
        except OSError:
            pass
    import torch

    torch.set_num_threads(1)
    # (importing .preprocess set OpenCV to one thread and silenced its log lines: an image's error
    # goes back as its reply)
    from .preprocess import allow_pillow_pixels

    allow_pillow_pixels(max_pixels)

    crops = np.frombuffer(mmap.mmap(pool_fd, pool_rows * crop_size * crop_size * 3), np.uint8).reshape(
        pool_rows, crop_size, crop_size, 3
    )
    conn = Connection(fd)
    try:
        os.write(ready_fd, b"R")  # imports done: from now on a slow answer is a hang (DecoderProcess.grace_until)
    except OSError:  # the parent is gone (a second Ctrl-C during its start-up): nothing to serve
        return
    os.close(ready_fd)
    warnings = CStderr(err_r, err_w)
    stats_path = env.get(env.WORKER_STATS)
    if stats_path:
        return _worker_loop_timed(
            conn,
            crops,
            resize_size,
            crop_size,
            max_pixels,
            max_file_bytes,
            f"{stats_path}.{os.getpid()}.json",
            interpolation,
            warnings,
        )
    while True:
        try:
            msg = conn.recv_bytes()
        except (EOFError, OSError):
            return
        out = _work_one(msg, crops, resize_size, crop_size, max_pixels, max_file_bytes, interpolation, warnings)
        try:
            conn.send_bytes(out)
        except (EOFError, OSError):
            return


def _request(msg: bytes, max_file_bytes: int) -> tuple[int, bytes]:
    """``(pool row, encoded bytes)`` of a request; a path request's file is read here.

    Raises:
        LoadError: the file of a path request cannot be read.
    """
    (row,) = _ROW.unpack_from(msg)
    data = msg[_ROW.size :]
    if row & PATH_BIT:
        return row & ~PATH_BIT, read_local(os.fsdecode(data), max_file_bytes)
    return row, data


def _work_one(
    msg: bytes,
    crops: np.ndarray,
    resize_size: int,
    crop_size: int,
    max_pixels: int,
    max_file_bytes: int,
    interpolation: str = "bilinear",
    warnings: CStderr | None = None,
) -> bytes:
    """One request (pool row + encoded bytes or a path) -> its reply (status byte, or status and error
    text, or ``_WARNED`` and what ``warnings`` caught while decoding it)."""
    try:
        row, data = _request(msg, max_file_bytes)
        arr = preprocess(data, resize_size, crop_size, max_pixels, interpolation)
        crops[row] = arr  # straight into the shared (pinned) pool: the only copy of the pixels
        return _ok(warnings)
    except Exception as e:  # noqa: BLE001 - a decoder error belongs to this item
        if warnings is not None:
            warnings.take()  # (the error says what went wrong)
        return _error_reply(e)


def _ok(warnings: CStderr | None) -> bytes:
    said = warnings.take() if warnings is not None else b""
    return bytes([_WARNED]) + said if said else bytes([_OK])


def _error_reply(e: Exception) -> bytes:
    if isinstance(e, LoadError):  # the item's whole error, naming its file
        return bytes([_LOAD_ERROR]) + str(e).encode("utf-8", "replace")[:60000]
    if isinstance(e, ImageError):  # already worded as the thread path words it
        return bytes([_IMAGE_ERROR]) + str(e).encode()[:60000]
    return bytes([_OTHER_ERROR]) + f"cannot decode image: {type(e).__name__}: {e}".encode()[:60000]


def _worker_loop_timed(
    conn,
    crops,
    resize_size,
    crop_size,
    max_pixels,
    max_file_bytes,
    path: str,
    interpolation: str = "bilinear",
    warnings: CStderr | None = None,
) -> None:
    """The worker loop with a time split per phase, written as JSON to ``path`` at exit (benchmarks)."""
    import json
    import resource

    t = dict(images=0, recv_wait_s=0.0, preprocess_s=0.0, preprocess_cpu_s=0.0, pool_write_s=0.0, send_s=0.0)
    r0 = resource.getrusage(resource.RUSAGE_SELF)
    clock, cpu = time.perf_counter, time.thread_time
    try:
        while True:
            a = clock()
            try:
                msg = conn.recv_bytes()
            except (EOFError, OSError):
                return
            b, c0 = clock(), cpu()
            try:
                row, data = _request(msg, max_file_bytes)
                arr = preprocess(data, resize_size, crop_size, max_pixels, interpolation)
                c, c1 = clock(), cpu()
                crops[row] = arr
                out = _ok(warnings)
            except Exception as e:  # noqa: BLE001
                c, c1 = clock(), cpu()
                if warnings is not None:
                    warnings.take()
                out = _error_reply(e)
            d = clock()
            try:
                conn.send_bytes(out)
            except (EOFError, OSError):
                return
            e_ = clock()
            t["images"] += 1
            t["recv_wait_s"] += b - a
            t["preprocess_s"] += c - b
            t["preprocess_cpu_s"] += c1 - c0
            t["pool_write_s"] += d - c
            t["send_s"] += e_ - d
    finally:
        r1 = resource.getrusage(resource.RUSAGE_SELF)
        t.update(
            cpu_s=r1.ru_utime + r1.ru_stime - r0.ru_utime - r0.ru_stime,
            minor_faults=r1.ru_minflt - r0.ru_minflt,
            voluntary_switches=r1.ru_nvcsw - r0.ru_nvcsw,
            involuntary_switches=r1.ru_nivcsw - r0.ru_nivcsw,
        )
        try:
            with open(path, "w") as f:
                json.dump(t, f)
        except OSError as e:  # a bad stats path costs the stats, never an image (the loop is over)
            print(f"fullthrottle decoder process: cannot write {path}: {e}", file=sys.stderr)
