"""Stage 2 on the GPU, in worker processes: JPEG batches decoded outside the main interpreter
(nvJPEG, or the GPU's hardware JPEG engines: ``Config.gpu_decoder``).

Why: torchvision serialises ``decode_jpeg(..., device="cuda")`` within a process (one global decoder
behind a mutex), and nvJPEG spends ~50-70 us of CPU per image around the hardware decoder. In the
pipeline's own process that CPU time competes for the GIL with every other stage, and one GPU
decode thread saturates long before the GPU does; several processes, each with its own decoder,
decode far more (see docs/performance.md). So each :class:`GpuDecoderProcess` owns a decoder:

- the pipeline sends it a batch: ``n``, where the bytes are, then ``(pool row, length)`` per image; the
  bytes lie in one of the process's :data:`DEPTH` slots of shared memory (its input arena), so a
  request is a few hundred bytes and the next batch waits there while the process decodes one (a
  batch too large for a slot follows its request on the socket instead, with nothing behind it);
- it decodes the batch on the GPU (:func:`~fullthrottle.data.gpu_decoders.make_gpu_decoder`), resizes and crops there
  (:func:`~fullthrottle.data.gpu_decode.decode_crops`: the same transform as the GPU decode thread), copies
  each crop D2H into its row of the shared :class:`~fullthrottle.data.crop_pool.CropPool` (which
  it registers as pinned memory in its own CUDA context), decodes what nvJPEG refuses on its CPU
  instead, synchronises, and answers with one status per image;
- the main process then treats the rows exactly like the CPU decoder processes' crops (H2D from the
  pool, gathered on the device).

A process that dies or hangs (past ``decode_timeout_s``) costs the batch it was working on (each item
gets the error), and a fresh one replaces it. Started with ``subprocess`` like the CPU workers.
"""

from __future__ import annotations

import collections
import mmap
import os
import socket
import subprocess
import sys
import threading
import time
import weakref
from collections.abc import Sequence
from multiprocessing.connection import Connection

from ..core.config import GPU_PROCESS_DEPTH
from ..core.mps import mps_server_running
from .crop_pool import CropPool
from .gpu_wire import decode_reply, encode_request
from .worker_procs import (
    STARTUP_S,
    WORKER_PROCESS_GROUP,
    WorkerDied,
    exit_reason,
    shutdown_worker,
    stop_workers,
    worker_command,
)

# gave its CPU decoder (not for the GPU decoder, or refused by it)
_CMD = worker_command("data.gpu_decoder_worker", "gpu_worker_main")


#: batches a GPU decoder process holds at once (one decoding, the next waiting in its arena slot)
DEPTH = GPU_PROCESS_DEPTH
#: bytes of each arena slot (a batch of encoded JPEGs larger than this goes inline on the socket)
SLOT_BYTES = 32 << 20


def count_fitting(items, limit: int) -> int:
    """How many of ``items``, in order, fit in ``limit`` bytes of their ``data``."""
    total = 0
    for k, it in enumerate(items):
        total += len(it.data)
        if total > limit:
            return k
    return len(items)


def _close_arena(arena: mmap.mmap, fd: int) -> None:
    arena.close()
    os.close(fd)


class GpuDecoderProcess:
    """One worker process decoding JPEG batches with nvJPEG into a :class:`CropPool`.

    Args:
        pool: the shared crop rows (the CPU decoder processes' pool).
        device_index: the CUDA device it decodes on.
        resize_size / crop_size / max_pixels: the transform (as in :class:`~fullthrottle.core.config.Config`).
        decoder: ``"hardware"`` (the GPU's JPEG engines via nvImageCodec) or ``"nvjpeg"`` (torchvision);
            see :func:`~fullthrottle.data.gpu_decoders.make_gpu_decoder`.
        max_file_bytes: largest file the process reads for an item sent as a path (its row with
            :data:`~fullthrottle.data.preprocess_procs.PATH_BIT` set).

    Up to :data:`DEPTH` batches may be sent before the first answer (:meth:`send` with a free
    ``slot``); answers come in the order sent. Not thread-safe: one caller thread per process.
    """

    def __init__(
        self,
        pool: CropPool,
        device_index: int = 0,
        resize_size: int = 256,
        crop_size: int = 224,
        max_pixels: int = 89_478_485,
        decoder: str = "nvjpeg",
        max_file_bytes: int = 256 << 20,
    ):
        if pool.crop_size != crop_size:
            raise ValueError(f"pool rows are {pool.crop_size}px crops, the transform makes {crop_size}px")
        if decoder not in ("hardware", "nvjpeg"):
            raise ValueError(f"decoder must be 'hardware' or 'nvjpeg', got {decoder!r}")
        self.pool = pool
        self.args = (
            device_index,
            resize_size,
            crop_size,
            max_pixels,
            pool.rows + pool.scratch,
            decoder,
            max_file_bytes,
        )
        self.closed = False
        self.depth = DEPTH
        self.arena_fd = os.memfd_create("fullthrottle-jpegs", 0) if hasattr(os, "memfd_create") else None
        self.arena = None
        if self.arena_fd is not None:  # (elsewhere: every batch goes inline, one at a time)
            os.ftruncate(self.arena_fd, DEPTH * SLOT_BYTES)  # pages are only used where written
            self.arena = mmap.mmap(self.arena_fd, DEPTH * SLOT_BYTES)
            self._close_arena = weakref.finalize(self, _close_arena, self.arena, self.arena_fd)
        self._sent: collections.deque = collections.deque()  # send times of the batches not answered
        #: seconds summed over answered batches: in this process's thread (send to answer), and in the
        #: worker (``launch``: decode call + resize/copy launches; ``total``: until its stream finished)
        self.times = {"round_trip_s": 0.0, "launch_s": 0.0, "total_s": 0.0, "batches": 0, "cpu_decoded": 0}
        self._start()

    def _start(self) -> None:
        if self.closed:
            raise WorkerDied("the GPU decoder pool is closed")
        parent, child = socket.socketpair()
        arena = () if self.arena_fd is None else (self.arena_fd,)
        self.proc = subprocess.Popen(
            [
                sys.executable,
                "-c",
                _CMD,
                str(child.fileno()),
                str(self.pool.fd),
                *map(str, self.args),
                str(self.arena_fd if self.arena_fd is not None else -1),
                str(DEPTH * SLOT_BYTES),
            ],
            pass_fds=(child.fileno(), self.pool.fd, *arena),
            env=dict(os.environ, OMP_NUM_THREADS="1"),
            stdin=subprocess.DEVNULL,
            close_fds=True,
            process_group=WORKER_PROCESS_GROUP,
        )
        self._sent.clear()
        child.close()
        self.spawned = time.perf_counter()
        self.conn = Connection(parent.detach())
        self._finalizer = weakref.finalize(self, shutdown_worker, self.conn, self.proc)

    def _restart(self) -> None:
        self._finalizer()
        self._start()

    def ready(self, timeout: float) -> None:
        """Wait until the process has set up CUDA and nvJPEG (it answers an empty request).

        Raises:
            RuntimeError: it did not answer in ``timeout`` s, or exited (its exit code named).
        """
        self.send([])
        try:
            self.receive(timeout)
        except WorkerDied as e:
            raise RuntimeError(f"GPU decoder process did not start: {e}") from None

    def fitting(self, items) -> int:
        """How many of ``items`` (their ``data`` bytes, in order) fit in one arena slot; 0 without an
        arena or when the first alone is larger (such a batch goes inline, whole)."""
        return 0 if self.arena is None else count_fitting(items, SLOT_BYTES)

    def send(self, items: Sequence[tuple[bytes, int]], slot: int | None = None) -> bool:
        """Hand a batch to the process: ``(encoded bytes, pool row)`` per image, or ``(path, pool row |
        PATH_BIT)`` for a file the process reads itself (:meth:`receive` answers).

        ``slot`` (0..DEPTH-1, free: its previous batch answered) puts the bytes in that arena slot;
        returns True then, False when they went inline (no slot, no arena, or more than
        :data:`SLOT_BYTES`): an inline send may wait until the process reads it, so send nothing
        behind it. A process found dead while it owes nothing is replaced first."""
        if self.proc.poll() is not None and not self._sent:
            self._restart()
        in_arena = slot is not None and self.arena is not None and sum(len(d) for d, _ in items) <= SLOT_BYTES
        try:  # the copy into shared memory first: its failure is this process's, not the worker's
            msg = (
                encode_request(items, self.arena, slot * SLOT_BYTES, self.arena_fd)
                if in_arena
                else encode_request(items)
            )
        except OSError as e:
            raise RuntimeError(f"cannot copy a batch into the GPU decoder process's shared memory: {e}") from e
        self._sent.append(time.perf_counter())
        try:
            self.conn.send_bytes(msg)
        except OSError:
            pass  # gone: receive() reports it for this batch and restarts it
        return in_arena

    def receive(self, timeout: float) -> list:
        """The answer to the oldest unanswered :meth:`send`: per image ``None`` (its crop is in its pool
        row), its error message (worded like the CPU path's) or, for a path, the
        :class:`~fullthrottle.data.load.LoadError` of its file. Adds the batch's times to :attr:`times`.

        Raises:
            WorkerDied: the process died on this batch, or took longer than ``timeout`` s (+ its
                start-up time when new) and was killed; a new one has been started either way.
        """
        wait = timeout + max(0.0, self.spawned + STARTUP_S - time.perf_counter())
        if not self.conn.poll(wait if wait < 1e6 else None):  # (None: no limit; poll takes no inf)
            self.proc.kill()
            self._restart()
            raise WorkerDied(
                f"GPU decoding took longer than {timeout:g} s (decode_timeout_s): its process was replaced"
            )
        try:
            statuses, launch_s, total_s, cpu_decoded = decode_reply(self.conn.recv_bytes())
        except (EOFError, OSError) as e:
            how = exit_reason(self.proc)
            self._restart()
            raise WorkerDied(f"GPU decoder process died on this batch ({how}): {type(e).__name__}") from None
        t = self.times
        t["round_trip_s"] += time.perf_counter() - self._sent.popleft()
        t["launch_s"] += launch_s
        t["total_s"] += total_s
        t["batches"] += 1
        t["cpu_decoded"] += cpu_decoded
        return statuses

    def discard_replies(self, timeout: float = 2.0) -> None:
        """Read and drop the answers still owed (a run stopped with batches out), so the next batch gets
        its own answer; a process that does not answer in ``timeout`` s (+ start-up) is killed and
        replaced, and then owes nothing."""
        while self._sent and not self.closed:
            try:
                self.receive(timeout)
            except WorkerDied:
                return

    def close(self) -> None:
        self.closed = True
        self._finalizer()
        if self.arena is not None:
            self._close_arena()
            self.arena = None


class GpuDecoderPool:
    """``n`` :class:`GpuDecoderProcess` workers started in parallel, writing into ``pool``.

    ``decoder``: one kind for all (``"nvjpeg"`` or ``"hardware"``), or one per process (a mix: the
    hardware engines and nvJPEG's CUDA and CPU stages are different resources).

    ``wait``: wait here until every process has set up CUDA and its decoder; False: they do so in
    the background and :meth:`wait_ready` waits.

    Raises:
        ValueError: a list of kinds that is not one per process.
        RuntimeError: a process could not start (no CUDA there, an import failed), with the cause
            (here, or from :meth:`wait_ready`).
    """

    def __init__(
        self,
        n: int,
        pool: CropPool,
        device_index: int = 0,
        resize_size: int = 256,
        crop_size: int = 224,
        max_pixels: int = 89_478_485,
        start_timeout_s: float = 120.0,
        decoder: str | Sequence[str] = "nvjpeg",
        max_file_bytes: int = 256 << 20,
        wait: bool = True,
    ):
        kinds = [decoder] * n if isinstance(decoder, str) else list(decoder)
        if len(kinds) != n:
            raise ValueError(f"{len(kinds)} decoder kinds for {n} GPU decoder processes")
        #: whether the processes start as clients of a CUDA MPS server (:func:`mps_server_running`)
        self.mps = mps_server_running()
        self.workers: list[GpuDecoderProcess] = []
        try:
            for kind in kinds:
                self.workers.append(
                    GpuDecoderProcess(pool, device_index, resize_size, crop_size, max_pixels, kind, max_file_bytes)
                )
            errs: list[BaseException] = []

            def ready(w):
                try:
                    w.ready(start_timeout_s)
                except BaseException as e:  # noqa: BLE001
                    errs.append(e)

            self._starting = [threading.Thread(target=ready, args=(w,), daemon=True) for w in self.workers]
            self._start_errors = errs
            for t in self._starting:
                t.start()
        except BaseException:
            self.close()
            raise
        if wait:
            self.wait_ready()

    def wait_ready(self) -> None:
        """Wait until every process has answered that it is ready (at once when they have).

        Raises:
            RuntimeError: a process could not start (the pool is closed then).
        """
        try:
            for t in self._starting:
                t.join()
            self._starting = []
            if self._start_errors:
                raise self._start_errors[0]
        except BaseException:
            self.close()
            raise

    def __len__(self) -> int:
        return len(self.workers)

    def close(self, grace_s: float = 2.0) -> None:
        """Stop every process: all sockets closed at once (each exits on EOF, tearing its CUDA
        context down in parallel with the others), ``grace_s`` s in all to exit, then killed."""
        stop_workers(self.workers, grace_s)  # (each close() also gives its arena back)
        self.workers = []
