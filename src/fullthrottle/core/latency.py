"""Latency percentiles in constant memory: a histogram of log-spaced buckets (the idea of Gil Tene's
HdrHistogram: buckets a fixed *relative* width apart), so that a run that never ends (a server's)
keeps a few KB of counts, not every item's latency."""

from __future__ import annotations

import math
from collections.abc import Iterable

import numpy as np

#: the smallest latency told apart (ms); anything below counts as this
LOW_MS = 1e-3
#: relative width of a bucket: a percentile is given within half of it (0.5%)
STEP = 0.01
#: buckets from LOW_MS up to about 28 hours (anything above counts as the last)
BUCKETS = math.ceil(math.log(1e8 / LOW_MS) / math.log1p(STEP))


class LatencyHistogram:
    """Counts of latencies (ms) in :data:`BUCKETS` log-spaced buckets (:data:`STEP` = 1% wide).

    ``len(h)`` is the number of latencies counted; :meth:`percentile` gives the nearest-rank
    percentile within 0.5% (relative) of the exact one for latencies from :data:`LOW_MS` up.
    Memory: one int64 per bucket (about 20 KB), whatever the count.
    """

    def __init__(self):
        self.counts = np.zeros(BUCKETS, np.int64)
        self.n = 0

    @staticmethod
    def _buckets(ms: Iterable[float]) -> np.ndarray:
        v = np.fromiter(ms, np.float64)
        idx = np.ceil(np.log(np.maximum(v, LOW_MS) / LOW_MS) / math.log1p(STEP))
        return np.minimum(idx, BUCKETS - 1).astype(np.intp)

    def add(self, ms: Iterable[float]) -> None:
        """Count these latencies (ms)."""
        idx = self._buckets(ms)
        if idx.size:
            self.counts += np.bincount(idx, minlength=BUCKETS)
            self.n += idx.size

    def remove(self, ms: Iterable[float]) -> None:
        """Take back latencies counted by :meth:`add` (the same values)."""
        idx = self._buckets(ms)
        if idx.size:
            self.counts -= np.bincount(idx, minlength=BUCKETS)
            self.n -= idx.size

    def percentile(self, q: float) -> float:
        """The ``q``-th (0..100) nearest-rank percentile (ms); 0.0 when nothing is counted.

        The value is its bucket's geometric middle: within 0.5% of the latency of that rank.
        """
        if self.n == 0:
            return 0.0
        rank = max(1, math.ceil(q / 100 * self.n))
        i = int(np.searchsorted(np.cumsum(self.counts), rank))
        return LOW_MS if i == 0 else LOW_MS * (1 + STEP) ** (i - 0.5)

    def copy(self) -> LatencyHistogram:
        h = LatencyHistogram()
        h.counts[:], h.n = self.counts, self.n
        return h

    def __len__(self) -> int:
        return self.n
