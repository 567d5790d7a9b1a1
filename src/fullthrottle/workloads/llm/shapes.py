"""The shapes the LLM's CUDA graphs are captured for: prefill (batch bucket, prompt length bucket)
pairs and decode attention lengths."""

from __future__ import annotations

from collections.abc import Sequence


def prefill_shapes(buckets: Sequence[int], max_seq_len: int, tokens: int) -> list[tuple[int, int]]:
    """The (batch bucket, length bucket) shapes to capture prefill graphs for: lengths 16, 32, 64, ...
    up to ``max_seq_len``, every pair of at most ``tokens`` tokens, most tokens first (0: none).

    >>> prefill_shapes((1, 2, 4), 64, 64)
    [(1, 64), (2, 32), (4, 16), (1, 32), (2, 16), (1, 16)]
    """
    lengths = [16 * 2**i for i in range(16) if 16 * 2**i <= max_seq_len]
    pairs = [(b, s) for b in buckets for s in lengths if b * s <= tokens]
    return sorted(pairs, key=lambda p: (-p[0] * p[1], -p[1]))


def kv_buckets(max_seq_len: int) -> tuple[int, ...]:
    """Attention lengths to capture decode graphs for: 256, 1024, 4096, ... below ``max_seq_len``, and it.

    A step whose longest row is at position ``p`` replays the graph of the smallest length > ``p``, so
    attention reads that much of the static KV cache, not all of it (at large batches, reading the
    whole cache makes attention a large share of the step: see docs/performance.md).

    >>> kv_buckets(328), kv_buckets(4096)
    ((256, 328), (256, 1024, 4096))
    """
    return tuple(sorted({min(max_seq_len, 256 * 4**k) for k in range(8)}))
