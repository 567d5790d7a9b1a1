"""Stage 2 in worker processes: decode + resize + crop outside the main interpreter's GIL.

Why: OpenCV and torch release the GIL while they work, but every call into them takes it back, and
with 16 decode threads the main process's GIL is handed over thousands of times a second. The
compute thread (which must take the GIL for every launch and copy) then waits in that queue, busy
all the time while the GPU is mostly idle (see docs/performance.md). A ``DataLoader`` escapes the
GIL with worker processes; so does this.

Each preprocess thread of the pipeline owns one worker process and talks to it over a socket pair:
it sends a row number of the shared :class:`CropPool` and the encoded bytes; the worker runs
:func:`fullthrottle.data.preprocess.preprocess` (the very same code as the thread path, so results are
bit-identical), writes the ``(S, S, 3)`` uint8 crop straight into that row, and answers with one
status byte (or the item's error). The pool is shared memory that the compute stage registers as
pinned memory with CUDA, so a crop is copied exactly once, by the worker: the main process never
touches pixels, and the H2D copy reads the pool directly. While the thread waits on the socket it
holds no GIL, so per image the main process does a few microseconds of Python. Workers run at a
lower scheduling priority (``nice``) so that the main process's compute and copy threads win the
cores when all are busy.

A worker that dies (a decoder crash on a hostile file) costs only the item it was decoding: that item
gets an error, and a fresh worker replaces it. Workers are started with ``subprocess`` (``python
-c`` with :func:`~fullthrottle.data.decoder_worker.worker_main`), not ``multiprocessing``, so a user script without an
``if __name__ == "__main__"`` guard is never re-imported.
"""

from __future__ import annotations

import os
import select
import socket
import subprocess
import sys
import threading
import time
import weakref
from multiprocessing.connection import Connection

import numpy as np

from ..core import env
from .crop_pool import CropPool
from .decoder_worker import _LOAD_ERROR, _OK, _ROW, _WARNED
from .image_header import ImageError
from .load import LoadError
from .worker_procs import (
    PATH_BIT,
    PROBE_PNG,
    STARTUP_S,
    WORKER_PROCESS_GROUP,
    WorkerDied,
    exit_reason,
    last_words,
    shutdown_worker,
    stop_workers,
    worker_command,
)

#: socket send buffer asked for per worker (bytes); what the kernel grants sets how many encoded
#: images may queue at a worker (:attr:`DecoderProcess.queue_bytes`)
SOCKET_BUFFER = 4 << 20
#: scheduling niceness added to each decoder process (so the main process's compute and copy threads
#: win the cores when all are busy)
WORKER_NICE = 5
#: glibc malloc settings for the workers. By default a block over 128 KiB may be a fresh ``mmap``,
#: unmapped when freed, so an image's decode buffer (900 KB at 640x480) and resize output kept coming
#: back as new zeroed pages: hundreds of page faults per image. Keeping blocks up to 16 MiB in the
#: heap (trimmed only past 64 MiB free) leaves almost none, and the workers decode faster (see
#: docs/performance.md).
MALLOC_ENV = {"MALLOC_MMAP_THRESHOLD_": str(16 << 20), "MALLOC_TRIM_THRESHOLD_": str(64 << 20)}
#: environment variable: when set to a path prefix, each worker writes ``<prefix>.<pid>.json`` on exit
#: with where its time went (seconds blocked in recv, in preprocess (wall and CPU), writing the crop,
#: in send; images; page faults and context switches) -- for benchmarks, off by default
STATS_ENV = env.WORKER_STATS


_WORKER_CMD = worker_command("data.decoder_worker", "worker_main")


class DecoderProcess:
    """One worker process running :func:`~fullthrottle.data.preprocess.preprocess` into a :class:`CropPool`.

    Args:
        resize_size / crop_size / max_pixels / interpolation: the transform (as in
            :class:`~fullthrottle.core.config.Config`).
        nice: added to the worker's scheduling niceness (0 leaves it as the parent's; default
            :data:`WORKER_NICE`).
        pool: the shared crop rows the worker writes into; ``None``: a private pool of one row.
        scratch_row: the pool row that :meth:`__call__` uses (this worker's own).
        max_file_bytes: largest file the worker reads for a path request (``send(..., is_path=True)``).
        malloc_env: glibc malloc settings for the worker (default :data:`MALLOC_ENV`; ``{}``: glibc's
            own); settings already in the environment win.

    Not thread-safe: one caller thread per process.
    """

    def __init__(
        self,
        resize_size: int = 256,
        crop_size: int = 224,
        max_pixels: int = 89_478_485,
        nice: int | None = None,
        pool: CropPool | None = None,
        scratch_row: int | None = None,
        max_file_bytes: int = 256 << 20,
        malloc_env: dict | None = None,
        interpolation: str = "bilinear",
    ):
        self.malloc_env = MALLOC_ENV if malloc_env is None else malloc_env
        self._own_pool = pool is None
        if pool is None:
            pool, scratch_row = CropPool(0, crop_size, scratch=1), 0
        if pool.crop_size != crop_size:
            raise ValueError(f"pool rows are {pool.crop_size}px crops, the transform makes {crop_size}px")
        self.pool = pool
        self.scratch_row = scratch_row
        nice = WORKER_NICE if nice is None else nice
        self.args = (resize_size, crop_size, max_pixels, nice, pool.rows + pool.scratch, max_file_bytes, interpolation)
        self.crop_size = crop_size
        self.closed = False
        # held from send to reply: a thread that is still waiting when its run is stopped reads its own
        # reply before the next run's thread can send, so replies never go to the wrong item
        self._lock = threading.Lock()
        self._start()

    def _start(self) -> None:
        if self.closed:  # never start a worker after close(): it would outlive its pipeline
            raise WorkerDied("the decoder pool is closed")
        self.owed = 0  # requests sent to this worker and not yet answered
        parent, child = socket.socketpair()
        ready_r, ready_w = os.pipe()  # the worker writes one byte here once its imports are done
        os.set_blocking(ready_r, False)
        err_r, err_w = os.pipe()  # the worker's fd 2 (decoder_worker.CStderr); read here if it dies
        os.set_blocking(err_r, False)
        try:  # room for several images queued in the socket (the kernel caps it at net.core.wmem_max)
            parent.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, SOCKET_BUFFER)
        except OSError:
            pass
        # bytes that may wait in the socket without a send ever blocking: half the buffer the kernel
        # granted (it reports twice the payload it accepts; the rest is bookkeeping)
        self.queue_bytes = parent.getsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF) // 2
        env = dict(os.environ, OMP_NUM_THREADS="1", MKL_NUM_THREADS="1")
        env.update({k: v for k, v in self.malloc_env.items() if k not in os.environ})  # the user's settings win
        self.proc = subprocess.Popen(
            [
                sys.executable,
                "-c",
                _WORKER_CMD,
                str(child.fileno()),
                str(self.pool.fd),
                str(ready_w),
                *map(str, self.args),
                str(err_r),
                str(err_w),
            ],
            pass_fds=(child.fileno(), self.pool.fd, ready_w, err_r, err_w),
            env=env,
            stdin=subprocess.DEVNULL,
            close_fds=True,
            process_group=WORKER_PROCESS_GROUP,
        )
        child.close()
        os.close(ready_w)
        os.close(err_w)
        self.spawned = time.perf_counter()  # a new worker first imports its libraries (seconds)
        self._ready_fd, self.ready_at, self._err_fd = ready_r, None, err_r
        self.conn = Connection(parent.detach())
        self._finalizer = weakref.finalize(self, shutdown_worker, self.conn, self.proc, ready_r, err_r)

    def is_ready(self) -> bool:
        """Whether the worker has done its imports and is decoding (it said so; never blocks)."""
        if self.ready_at is None:
            try:
                if os.read(self._ready_fd, 1) == b"R":
                    self.ready_at = time.perf_counter()
            except (BlockingIOError, OSError):
                pass
        return self.ready_at is not None

    def wait_ready(self, timeout: float) -> bool:
        """Wait up to ``timeout`` s for :meth:`is_ready`; False if the worker is not ready by then."""
        if not self.is_ready():
            try:
                select.select([self._ready_fd], [], [], timeout)
            except (OSError, ValueError):
                pass
        return self.is_ready()

    def grace_until(self) -> float:
        """From when (``time.perf_counter()``) the worker's time on an image counts towards
        ``decode_timeout_s``: while it is still importing its libraries, :data:`STARTUP_S` after its
        start; once it is ready, the moment it was seen ready (an image sent before then waited for
        the imports, not for its decoder)."""
        return self.ready_at if self.is_ready() else self.spawned + STARTUP_S

    def _restart(self) -> None:
        self._finalizer()
        self._start()

    def __call__(self, data: bytes) -> np.ndarray:
        """Encoded image bytes -> ``(S, S, 3)`` uint8 RGB crop (a fresh, writable array).

        Raises:
            ImageError: the item cannot be decoded (same message as the thread path).
            WorkerDied: the worker process died on this item; a new one has been started.
            RuntimeError: this worker has no scratch row in its pool.
        """
        if self.scratch_row is None:
            raise RuntimeError("this decoder has no scratch row: use send(data, row) and receive()")
        with self._lock:
            self.send(data, self.scratch_row)
            self.receive()
            return self.pool.array[self.scratch_row].copy()

    def send(self, data: bytes, row: int, is_path: bool = False) -> None:
        """Hand one image to the worker, to be written into pool row ``row`` (:meth:`receive` gets the
        answer; one request at a time). ``is_path``: ``data`` is a file's path (``os.fsencode``), which
        the worker reads (:func:`~fullthrottle.data.load.read_local`).

        A worker found dead here while it owes no answer (it died idle) is replaced first, so the image
        is not lost. One that still owes answers is left as it is: replacing it here would hand the new
        worker's answer to the oldest image out (whose crop was never written); :meth:`receive` reports
        the death for that image instead, and the caller sends the others again.
        """
        if self.proc.poll() is not None and not self.owed:
            last_words(self._err_fd, exit_reason(self.proc))
            self._restart()
        self.owed += 1
        try:
            self.conn.send_bytes(_ROW.pack(row | PATH_BIT if is_path else row) + data)
        except OSError:
            pass  # the worker is gone: receive() reports it for this item and restarts it

    def receive(self) -> str | None:
        """Wait for the answer to the last :meth:`send`: returns once the crop is in its pool row, with
        the decoder's warnings for the image (libjpeg's "Corrupt JPEG data: ...", the crop made
        from what it could read) or None.

        Raises: see :meth:`__call__` (the item's error); :class:`~fullthrottle.data.load.LoadError`: the
            file of a path request could not be read (its message is the item's whole error).
        """
        try:
            msg = self.conn.recv_bytes()
        except (EOFError, OSError) as e:
            how = exit_reason(self.proc)
            last_words(self._err_fd, how)
            self._restart()
            raise WorkerDied(f"decoder process died on this item ({how}): {type(e).__name__}") from None
        self.owed -= 1
        if msg[0] == _OK:
            return None
        if msg[0] == _WARNED:
            return msg[1:].decode("utf-8", "replace")
        if msg[0] == _LOAD_ERROR:
            raise LoadError(msg[1:].decode("utf-8", "replace"))
        # _IMAGE_ERROR or _OTHER_ERROR: the message is already worded as the thread path words it
        raise ImageError(msg[1:].decode("utf-8", "replace"))

    def kill(self, reason: str) -> WorkerDied:
        """Kill a worker stuck on its image and start a new one; returns the error for that image."""
        self.proc.kill()
        self._restart()
        return WorkerDied(reason)

    def discard_reply(self, timeout: float = 2.0) -> bool:
        """Read and drop the answer to an outstanding request (a run stopped while it was out), so the
        next request gets its own answer; a worker that does not answer in ``timeout`` s is killed and
        replaced (nothing is started once the pool is closed).

        Returns True when the worker was replaced (it died or was killed): then none of its other
        requests will be answered either.
        """
        if not self.closed and self.conn.poll(timeout):
            try:
                self.receive()
                return False
            except ImageError:
                return False
            except WorkerDied:
                return True
        self.proc.kill()
        if not self.closed:
            self._restart()
        return True

    def close(self) -> None:
        """Stop the worker for good (closing its socket ends its loop; killed if it does not exit in 2 s)."""
        self.closed = True
        self._finalizer()
        if self._own_pool:
            self.pool.close()


class DecoderPool:
    """``n`` :class:`DecoderProcess` workers started in parallel, writing into one :class:`CropPool`.

    Args:
        n: worker processes.
        rows: crop rows shared by all workers (:attr:`crops`), handed out per item; bounds how many
            decoded crops can wait for the GPU (each row is ``S * S * 3`` bytes: 147 KiB at 224).
        malloc_env: the workers' glibc malloc settings (:class:`DecoderProcess`).

        wait: wait here until every worker has started; False: they start in the background
            (each imports its libraries: seconds) and :meth:`wait_ready` waits.

    Raises:
        RuntimeError: a worker could not start (its import failed), with its exit code (here, or
            from :meth:`wait_ready`).
    """

    def __init__(
        self,
        n: int,
        resize_size: int = 256,
        crop_size: int = 224,
        max_pixels: int = 89_478_485,
        rows: int = 256,
        max_file_bytes: int = 256 << 20,
        malloc_env: dict | None = None,
        interpolation: str = "bilinear",
        wait: bool = True,
    ):
        self.workers: list[DecoderProcess] = []
        self.crops = CropPool(rows, crop_size, scratch=n)
        self._start_errors, self._start_lock, self._closing = [], threading.Lock(), False
        errs, lock = self._start_errors, self._start_lock

        def start(i: int):
            try:
                w = DecoderProcess(
                    resize_size,
                    crop_size,
                    max_pixels,
                    pool=self.crops,
                    scratch_row=rows + i,
                    max_file_bytes=max_file_bytes,
                    malloc_env=malloc_env,
                    interpolation=interpolation,
                )
                with lock:
                    if self._closing:  # start-up was abandoned (Ctrl-C): don't leave this one behind
                        w.close()
                        return
                    self.workers.append(w)
                try:
                    w(PROBE_PNG)  # waits until the worker has imported and answered once
                except ImageError:
                    pass
            except BaseException as e:  # noqa: BLE001
                errs.append(e)

        self._starting = [threading.Thread(target=start, args=(i,), daemon=True) for i in range(n)]
        for t in self._starting:
            t.start()
        if wait:
            self.wait_ready()

    def wait_ready(self) -> None:
        """Wait until every worker has started (see ``wait``); at once when they have.

        Raises:
            RuntimeError: a worker could not start (the pool is closed then).
        """
        try:
            for t in self._starting:
                t.join()
        except BaseException:  # Ctrl-C while the workers start: stop those already running
            with self._start_lock:
                self._closing = True
            self.close()
            raise
        self._starting = []
        if self._start_errors:
            self.close()
            raise RuntimeError(f"could not start decoder processes: {self._start_errors[0]}") from self._start_errors[0]

    def __len__(self) -> int:
        return len(self.workers)

    def __getitem__(self, i: int) -> DecoderProcess:
        return self.workers[i]

    def close(self, grace_s: float = 1.0) -> None:
        """Stop every worker: all sockets closed at once, then ``grace_s`` s in all to exit, then killed.
        Workers still starting (``wait=False``) are stopped as they come up."""
        with self._start_lock:
            self._closing = True  # a worker that comes up from now on closes itself
            workers = list(self.workers)
        stop_workers(workers, grace_s)
        for t in self._starting:  # (their workers closed: each thread ends at once)
            t.join()
        self._starting = []
        self.workers = []
        self.crops.close()
