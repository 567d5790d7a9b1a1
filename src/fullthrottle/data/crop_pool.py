"""The crop pool: rows of ``(S, S, 3)`` uint8 crops in shared memory, written by the decoder
processes (CPU and GPU) and read by the compute stage, registered with CUDA as pinned memory so the
H2D copy reads it directly."""

from __future__ import annotations

import collections
import mmap
import os
import threading
import weakref

import numpy as np


class CropPool:
    """Rows of ``(S, S, 3)`` uint8 crops in memory shared with the decoder processes.

    One anonymous shared-memory file (``memfd_create``; nothing to clean up, it disappears with the
    last process that maps it) holds ``rows + scratch`` crops. The first ``rows`` are handed out with
    :meth:`acquire` and given back with :meth:`release`; ``scratch`` rows, one per worker, serve
    single calls (:meth:`DecoderProcess.__call__`). :meth:`pin` registers the whole file with CUDA
    (``cudaHostRegister``) so H2D copies read it as pinned memory.

    Attributes:
        array: ``(rows + scratch, S, S, 3)`` uint8 numpy view; ``tensor``: the same memory as a torch tensor.
        fd: the file descriptor that workers map (passed to them with ``pass_fds``).

    Raises:
        OSError: the shared memory cannot be created (size: ``(rows + scratch) * S * S * 3`` bytes).
    """

    def __init__(self, rows: int, crop_size: int = 224, scratch: int = 0):
        if rows < 0 or scratch < 0 or rows + scratch < 1:
            raise ValueError(f"a crop pool needs at least one row, got rows={rows}, scratch={scratch}")
        self.rows, self.scratch, self.crop_size = rows, scratch, crop_size
        self.row_bytes = crop_size * crop_size * 3
        size = (rows + scratch) * self.row_bytes
        if hasattr(os, "memfd_create"):
            self.fd = os.memfd_create("fullthrottle-crops", 0)
        else:  # pragma: no cover - not Linux: an unlinked temporary file
            import tempfile

            fd, path = tempfile.mkstemp(prefix="fullthrottle-crops-")
            os.unlink(path)
            self.fd = fd
        os.ftruncate(self.fd, size)
        self.mm = mmap.mmap(self.fd, size)
        self.array = np.frombuffer(self.mm, np.uint8).reshape(rows + scratch, crop_size, crop_size, 3)
        import torch

        self.tensor = torch.from_numpy(self.array)
        self._free = collections.deque(range(rows))
        self._cv = threading.Condition()
        # unregistered from CUDA and closed when closed or collected, *before* the mapping goes away:
        # a range unmapped while registered makes the next registration there fail
        self._state = {"mm": self.mm, "ptr": self.tensor.data_ptr(), "fd": self.fd, "pinned": False}
        self._finalizer = weakref.finalize(self, _release_pool, self._state)

    @property
    def pinned(self) -> bool:
        """Whether the pool is registered with CUDA as page-locked (pinned) memory."""
        return self._state["pinned"]

    def pin(self) -> bool:
        """Register the pool with CUDA as page-locked memory; False (pageable copies) if that fails."""
        import torch

        if self.pinned or not torch.cuda.is_available():
            return self.pinned
        try:
            err = torch.cuda.cudart().cudaHostRegister(self.tensor.data_ptr(), self.mm.size(), 0)
            ok = int(err[0] if isinstance(err, tuple) else err) == 0
        except (RuntimeError, AttributeError, TypeError):
            ok = False
        if not ok:
            clear_cuda_error()  # the failed call left an error that the next CUDA call would raise
        self._state["pinned"] = ok
        return ok

    def acquire(self, stopped=lambda: False) -> int | None:
        """A free row, blocking while all are taken (backpressure); ``None`` if ``stopped()``."""
        with self._cv:
            while not self._free:
                if stopped():
                    return None
                self._cv.wait(0.05)
            return self._free.popleft()

    def acquire_many(self, n: int, stopped=lambda: False) -> list[int] | None:
        """``n`` free rows, taken as they become free (blocking while none is: backpressure);
        ``None`` if ``stopped()`` first (rows taken so far are given back)."""
        rows: list[int] = []
        with self._cv:
            while len(rows) < n:
                k = min(n - len(rows), len(self._free))
                if k:
                    rows += [self._free.popleft() for _ in range(k)]
                    continue
                if stopped():
                    self._free.extend(rows)
                    self._cv.notify_all()
                    return None
                self._cv.wait(0.05)
        return rows

    def release(self, rows) -> None:
        """Give rows back (their crops have been consumed)."""
        with self._cv:
            self._free.extend(rows)
            self._cv.notify_all()

    def reset(self) -> None:
        """Mark every row free (start of a run; nothing may be writing or reading rows)."""
        with self._cv:
            self._free = collections.deque(range(self.rows))
            self._cv.notify_all()

    def free_rows(self) -> int:
        return len(self._free)

    def close(self) -> None:
        """Unregister from CUDA and close the file (the memory goes when the last view does)."""
        self._finalizer()


def _release_pool(state: dict) -> None:
    if state["pinned"]:
        try:
            import torch

            torch.cuda.cudart().cudaHostUnregister(state["ptr"])
        except (RuntimeError, AttributeError):
            pass
        state["pinned"] = False
    try:
        os.close(state["fd"])
    except OSError:
        pass


def clear_cuda_error() -> None:
    """Reset the CUDA runtime's last error (``cudaGetLastError``) after a call that failed on purpose."""
    import ctypes

    for name in ("libcudart.so.13", "libcudart.so.12", "libcudart.so"):
        try:
            ctypes.CDLL(name).cudaGetLastError()
            return
        except (OSError, AttributeError):
            continue
