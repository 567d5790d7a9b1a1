"""Stage 3, batch: where batches are formed. One rule closes every batch (:class:`OpenBatch`: a count
cap, a token budget, a wait deadline); the pipeline's :class:`Batcher`, the GPU decoders' feed and the
servers' :class:`RequestBatcher` differ only in where their items come from. Also the batch-bucket
arithmetic (pad up to a bucket, split what exceeds the largest)."""

from __future__ import annotations

import bisect
import queue
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from .gpumon import nvtx_range

if TYPE_CHECKING:  # (a type only: the core does not import the data plane)
    from ..data.load import Item


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


class OpenBatch:
    """The batch being formed and the rule that closes it, written once for every batcher: at most
    ``max_items`` items (each of ``size`` items: 1, or a request's texts), at most ``max_tokens``
    tokens (None: no budget), and no later than ``max_wait_s`` after its first item arrived. The
    first item is always taken, even alone over a limit. Not thread-safe (one batching thread).

    Raises:
        ValueError: ``max_items`` or ``max_tokens`` below 1, ``max_wait_s`` below 0.
    """

    __slots__ = ("max_items", "max_tokens", "max_wait_s", "items", "n", "tokens", "deadline")

    def __init__(self, max_items: int, max_tokens: int | None = None, max_wait_s: float = 0.0):
        if max_items < 1 or (max_tokens is not None and max_tokens < 1) or not max_wait_s >= 0:
            raise ValueError("max_items and max_tokens must be >= 1, max_wait_s >= 0")
        self.max_items, self.max_tokens, self.max_wait_s = max_items, max_tokens, max_wait_s
        self.items: list = []
        self.n = self.tokens = 0
        self.deadline = 0.0  # (perf_counter s) when the open batch must go

    def __len__(self) -> int:
        return len(self.items)

    def fits(self, size: int = 1, tokens: int = 0) -> bool:
        """Whether one more item of ``size`` items and ``tokens`` tokens fits (always, when empty)."""
        return not self.items or (
            self.n + size <= self.max_items and (self.max_tokens is None or self.tokens + tokens <= self.max_tokens)
        )

    def add(self, item, size: int = 1, tokens: int = 0, now: float | None = None) -> None:
        """Add ``item``; the first one starts the deadline (``now``: the caller's clock reading)."""
        if not self.items:
            self.deadline = (time.perf_counter() if now is None else now) + self.max_wait_s
        self.items.append(item)
        self.n += size
        self.tokens += tokens

    def extend(self, items: list, now: float | None = None) -> list:
        """Add items of size 1 until the batch is full; returns those that did not fit."""
        k = max(self.max_items - self.n, 1 if not self.items else 0)
        if items[:k]:
            if not self.items:
                self.deadline = (time.perf_counter() if now is None else now) + self.max_wait_s
            self.items.extend(items[:k])
            self.n += len(items[:k])
        return items[k:]

    @property
    def full(self) -> bool:
        return self.n >= self.max_items or (self.max_tokens is not None and self.tokens >= self.max_tokens)

    def wait_s(self, now: float | None = None) -> float:
        """Seconds left before the open batch must go (0 when due)."""
        return max(self.deadline - (time.perf_counter() if now is None else now), 0.0)

    def take(self) -> list:
        """The batch's items, oldest first; the batch is empty again."""
        items, self.items, self.n, self.tokens = self.items, [], 0, 0
        return items


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
        open_ = OpenBatch(self.max_batch_size, None, self.max_wait_s)
        while ends < self.n_end and not self.stopped():
            now = time.perf_counter()
            if open_ and now >= open_.deadline:
                # Deadline passed: send the partial batch if compute can take it now and the device
                # is not already working on two batches; otherwise keep filling it (bigger batches
                # exactly when they pay off: per-batch host costs are amortised under load).
                if not self.device_busy() and self._flush(open_.items, block=False):
                    open_.take()
                    continue
                timeout = 0.001
            else:
                timeout = open_.wait_s(now) if open_ else 0.05
            it = self.get(timeout)
            if it is None:
                continue
            if it is self.end:
                ends += 1
                continue
            if isinstance(it, list):
                self._take_list(it, open_)
                continue
            self.stats.begin()
            now = time.perf_counter()
            self.stats.waited(now - it.t_queued)
            if it.error is not None:
                self.stats.end(1)
                self.put(it)
                continue
            open_.add(it, now=now)
            self.stats.end(1)
            if open_.full:
                self._flush(open_.take())
        if not self.stopped():
            self._flush(open_.take())
            self.put(self.end)

    def _take_list(self, items: list[Item], open_: OpenBatch) -> None:
        """Add a list of items to the open batch (full batches go at once)."""
        if not items:
            return
        self.stats.begin()
        now = time.perf_counter()
        self.stats.waited(sum(now - it.t_queued for it in items) / len(items), len(items))
        full, failed = [], []
        for it in items:
            if it.error is not None:
                failed.append(it)
                continue
            open_.add(it, now=now)
            if open_.full:
                full.append(open_.take())
        self.stats.end(len(items))  # (waiting for the compute stage below is backpressure, not work)
        for it in failed:
            self.put(it)
        for b in full:
            self._flush(b)


class RequestBatcher:
    """Batches of waiting requests for the services that batch across callers (text embeddings, LLM
    completions): by count, by token budget and by deadline, as text-embeddings-inference forms its
    batches (``max_batch_tokens``) and LitServe its (``max_batch_size``, ``batch_timeout``).

    :meth:`next` takes the first waiting request (waiting up to ``timeout`` s for one), then more
    while the batch holds at most ``max_items`` items (``size(request)``: texts per request, or 1)
    and at most ``max_tokens`` tokens (``tokens(request)``, asked once per request), waiting up to
    ``max_wait_s`` after the first for more to arrive (0: only what is queued already). A request
    that would overflow either limit opens the next batch instead; the first request of a batch is
    always taken, even alone over a limit. ``tokens`` may do work (tokenise) and store it in the
    request: it runs in the caller's thread, once per request. Not thread-safe: one consumer thread.
    """

    def __init__(
        self,
        q,
        max_items: int,
        max_tokens: int | None = None,
        max_wait_s: float = 0.0,
        size: Callable = lambda r: 1,
        tokens: Callable = lambda r: 0,
    ):
        OpenBatch(max_items, max_tokens, max_wait_s)  # (checks the limits)
        self.q, self.max_items, self.max_tokens, self.max_wait_s = q, max_items, max_tokens, max_wait_s
        self.size, self.tokens = size, tokens
        self._carry = None  # (request, its tokens): the one that opened no room in the last batch

    def _take(self, timeout: float | None):
        if timeout is not None and timeout <= 0:
            try:
                r = self.q.get_nowait()
            except queue.Empty:
                return None
        else:
            try:
                r = self.q.get(timeout=timeout)
            except queue.Empty:
                return None
        return r, self.tokens(r)

    def next(self, timeout: float = 0.05) -> list:
        """The next batch of requests, oldest first; ``[]`` when none arrived within ``timeout`` s."""
        first, self._carry = self._carry or self._take(timeout), None
        if first is None:
            return []
        b = OpenBatch(self.max_items, self.max_tokens, self.max_wait_s)
        b.add(first[0], self.size(first[0]), first[1])
        while not b.full:
            nxt = self._take(b.wait_s())
            if nxt is None:
                break
            if not b.fits(self.size(nxt[0]), nxt[1]):
                self._carry = nxt
                break
            b.add(nxt[0], self.size(nxt[0]), nxt[1])
        return b.take()
