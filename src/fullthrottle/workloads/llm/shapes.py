"""The attention lengths the LLM's decode graphs are captured for."""

from __future__ import annotations


def kv_buckets(max_seq_len: int) -> tuple[int, ...]:
    """Attention lengths to capture decode graphs for: 256, 1024, 4096, ... below ``max_seq_len``, and it.

    A step whose longest row is at position ``p`` replays the graph of the smallest length > ``p``, so
    attention reads that much of the static KV cache, not all of it (at large batches, reading the
    whole cache makes attention a large share of the step: see docs/performance.md).

    >>> kv_buckets(328), kv_buckets(4096)
    ((256, 328), (256, 1024, 4096))
    """
    return tuple(sorted({min(max_seq_len, 256 * 4**k) for k in range(8)}))
