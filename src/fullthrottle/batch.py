"""Stage 3, batch: where batches are formed. Dynamic batching with a size cap and a wait deadline,
and the batch-bucket arithmetic (pad up to a bucket, split what exceeds the largest)."""

from __future__ import annotations

import bisect
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from .gpumon import nvtx_range
from .load import Item


def bucket_for(n: int, buckets: Sequence[int]) -> int:
    """The smallest bucket that holds ``n`` items (``buckets`` sorted ascending).

    Raises:
        ValueError: ``n`` < 1 or ``n`` larger than the largest bucket.
    """
    if n < 1:
        raise ValueError(f"batch size must be >= 1, got {n}")
    i = bisect.bisect_left(buckets, n)
    if i == len(buckets):
        raise ValueError(f"batch of {n} exceeds the largest bucket {buckets[-1]}")
    return buckets[i]


def split_into_buckets(n: int, buckets: Sequence[int]) -> list[tuple[int, int]]:
    """Split ``n`` items into chunks that each run as one bucket: ``[(chunk_size, bucket), ...]``.

    Whole largest buckets first, then the remainder padded to the smallest bucket that holds it,
    so no chunk pads more than the remainder needs.

    >>> split_into_buckets(1100, (1, 8, 512))
    [(512, 512), (512, 512), (76, 512)]
    """
    out, big = [], buckets[-1]
    while n > big:
        out.append((big, big))
        n -= big
    if n > 0:
        out.append((n, bucket_for(n, buckets)))
    return out


@dataclass
class Batch:
    """A group of good items the compute stage runs together; ``t_queued`` is for queue-wait stats."""

    items: list[Item]
    t_queued: float = field(default_factory=time.perf_counter)

    def __len__(self) -> int:
        return len(self.items)


class Batcher:
    """The batch stage: collects preprocessed items into batches.

    A batch is closed when it holds ``max_batch_size`` items or ``max_wait_ms`` after its first item
    arrived, whichever is first, or when the stream ends. Items that already carry an error skip
    batching and go straight on (their position is restored at the end).

    Args:
        get: ``get(timeout_s) -> item | list of items | None`` from the preprocess queue (None on
            timeout; a list is a GPU decoder's batch, handed over at once).
        put: ``put(obj, block=True) -> bool`` into the compute queue (blocking put: backpressure;
            ``block=False`` returns False when the queue is full).
        n_end: how many end markers (one per preprocess worker) close the stream.
        end: the end marker.
        device_busy: True while the compute stage already has enough batches in flight (then a
            partial batch past its deadline keeps filling instead of being sent).
    """

    def __init__(
        self,
        get: Callable,
        put: Callable,
        max_batch_size: int,
        max_wait_ms: float,
        n_end: int,
        end,
        stats,
        stopped: Callable[[], bool],
        device_busy: Callable[[], bool] = lambda: False,
    ):
        self.get, self.put, self.device_busy = get, put, device_busy
        self.max_batch_size, self.max_wait_s = max_batch_size, max_wait_ms / 1e3
        self.n_end, self.end, self.stats, self.stopped = n_end, end, stats, stopped
        self.batches = 0
        self.batched_items = 0
        self.on_batch: Callable[[int], None] | None = None  # observer, e.g. a metrics histogram

    def _flush(self, items: list[Item], block: bool = True) -> bool:
        """Hand ``items`` to the compute stage; with ``block=False`` only if it has room now."""
        if not items:
            return True
        with nvtx_range(f"batch {len(items)}"):
            ok = self.put(Batch(items), block)
        if not ok:
            return False
        self.batches += 1
        self.batched_items += len(items)
        if self.on_batch is not None:
            self.on_batch(len(items))
        return True

    def run(self) -> None:
        ends = 0
        pending: list[Item] = []
        deadline = 0.0
        while ends < self.n_end and not self.stopped():
            now = time.perf_counter()
            if pending and now >= deadline:
                # Deadline passed: send the partial batch if compute can take it now and the device
                # is not already working on two batches; otherwise keep filling it (bigger batches
                # exactly when they pay off: per-batch host costs are amortised under load).
                if not self.device_busy() and self._flush(pending, block=False):
                    pending = []
                    continue
                timeout = 0.001
            else:
                timeout = max(deadline - now, 0.0) if pending else 0.05
            it = self.get(timeout)
            if it is None:
                continue
            if it is self.end:
                ends += 1
                continue
            if isinstance(it, list):
                pending, deadline = self._take_list(it, pending, deadline)
                continue
            self.stats.begin()
            now = time.perf_counter()
            self.stats.waited(now - it.t_queued)
            if it.error is not None:
                self.stats.end(1)
                self.put(it)
                continue
            if not pending:
                deadline = now + self.max_wait_s
            pending.append(it)
            self.stats.end(1)
            if len(pending) >= self.max_batch_size:
                self._flush(pending)
                pending = []
        if not self.stopped():
            self._flush(pending)
            self.put(self.end)

    def _take_list(self, items: list[Item], pending: list[Item], deadline: float) -> tuple[list[Item], float]:
        """Add a list of items to the open batch (full batches go at once); returns the open batch
        and its deadline."""
        if not items:
            return pending, deadline
        self.stats.begin()
        now = time.perf_counter()
        self.stats.waited(sum(now - it.t_queued for it in items) / len(items), len(items))
        full, failed = [], []
        for it in items:
            if it.error is not None:
                failed.append(it)
                continue
            if not pending:
                deadline = now + self.max_wait_s
            pending.append(it)
            if len(pending) >= self.max_batch_size:
                full.append(pending)
                pending = []
        self.stats.end(len(items))  # (waiting for the compute stage below is backpressure, not work)
        for it in failed:
            self.put(it)
        for b in full:
            self._flush(b)
        return pending, deadline
