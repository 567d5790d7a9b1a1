"""Sampling on the GPU, per row and branch-free, so that it runs inside the decode step's CUDA graph:
greedy / temperature / top-k / top-p (:func:`sample`), drawing with counter-based noise keyed by each
request's seed and position (:func:`seeded_noise`), so that a request's tokens do not depend on the
rows beside it.
"""

from __future__ import annotations

import numbers

import torch

# murmur3's 32-bit finaliser and splitmix32's increment, as signed int32 (tensor arithmetic wraps)
_M1, _M2, GOLDEN = 0x85EBCA6B - (1 << 32), 0xC2B2AE35 - (1 << 32), 0x9E3779B9 - (1 << 32)


def _fmix32(h: torch.Tensor) -> torch.Tensor:
    """murmur3's ``fmix32`` on an int32 tensor (right shifts made logical by masking)."""
    h = h ^ ((h >> 16) & 0xFFFF)
    h = h * _M1
    h = h ^ ((h >> 13) & 0x7FFFF)
    h = h * _M2
    return h ^ ((h >> 16) & 0xFFFF)


def seed32(seed: int) -> int:
    """Any Python int as the signed 32-bit value :func:`seeded_noise` keys on (``seed`` mod 2**32)."""
    return (int(seed) + (1 << 31)) % (1 << 32) - (1 << 31)


def seeded_noise(seed: torch.Tensor, pos: torch.Tensor, vocab_mix: torch.Tensor) -> torch.Tensor:
    """Exponential(1) noise for drawing the token at position ``pos`` of a sequence seeded ``seed``:
    a function of (seed, position, token id) only, so a request's draws do not depend on the other
    rows of its batch, and the same seed gives the same tokens. Counter-based (splitmix32's stream
    keyed by murmur3's finaliser of seed and position), fixed-shape: it runs inside CUDA graphs.

    Args:
        seed: ``(B, 1)`` int32 (see :func:`seed32`). pos: ``(B, 1)`` int (the drawn token's position).
        vocab_mix: ``(V,)`` int32, ``arange(V) * 0x9E3779B9`` (wrapping), made once per Generator.
    Returns:
        ``(B, V)`` float32, > 0.
    """
    key = _fmix32(seed ^ _fmix32(pos.to(torch.int32) * GOLDEN))  # (B, 1)
    h = _fmix32(key + vocab_mix)  # (B, V)
    u = ((h >> 8) & 0xFFFFFF).float().add_(0.5).mul_(1.0 / (1 << 24))  # uniform in (0, 1), 24 bits
    return u.log_().neg_()


def sample(
    logits: torch.Tensor, temperature: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor, noise: torch.Tensor
) -> torch.Tensor:
    """Next token per row, without host synchronisation.

    Args:
        logits: ``(B, V)`` float32.
        temperature: ``(B, 1)``; 0 means greedy (argmax).
        top_k: ``(B, 1)`` int64; 0 means no top-k cut.
        top_p: ``(B, 1)``; 1.0 means no nucleus cut (Holtzman et al., 2020, "The Curious Case of
            Neural Text Degeneration").
        noise: ``(B, V)`` Exponential(1) samples (:func:`seeded_noise`): ``argmax(p / noise)`` draws
            from ``p`` (the exponential race / Gumbel-max trick), so drawing stays one fixed-shape
            kernel sequence.
    Returns:
        ``(B,)`` int64.
    """
    V = logits.shape[-1]
    greedy = logits.argmax(-1)
    x = logits / temperature.clamp_min(1e-5)
    srt, order = x.sort(-1, descending=True)
    k = torch.where(top_k > 0, top_k, torch.full_like(top_k, V)).clamp(1, V)
    kth = srt.gather(-1, k - 1)  # (B, 1) k-th largest
    probs_sorted = srt.softmax(-1)
    cum = probs_sorted.cumsum(-1) - probs_sorted  # mass before each token
    keep_sorted = cum < top_p
    keep_sorted[:, 0] = True  # the first token always stays (also for a top_p that is 0 in float32)
    keep = torch.zeros_like(keep_sorted).scatter(-1, order, keep_sorted) & (x >= kth)
    x = x.masked_fill(~keep, float("-inf"))
    drawn = (x.softmax(-1) / noise).argmax(-1)
    return torch.where(temperature[:, 0] == 0, greedy, drawn)


def row_seeds(seed, n: int) -> list[int]:
    """``n`` sampling seeds (:func:`seed32`) from ``seed`` as ``Generator.generate`` takes it.

    Raises:
        ValueError: a list whose length is not ``n``, a seed neither an integer nor None.
    """
    if isinstance(seed, (list, tuple)):
        if len(seed) != n:
            raise ValueError(f"{len(seed)} seeds for {n} prompts")
        return [row_seeds(s, 1)[0] for s in seed]
    if seed is None:
        return torch.randint(-(1 << 31), 1 << 31, (n,)).tolist()
    if not isinstance(seed, numbers.Integral) or isinstance(seed, bool):
        raise ValueError(f"a seed must be an integer or None, got {seed!r}")
    seed = int(seed)
    return [seed32(seed + i) for i in range(n)]


def check_sampling(temperature, top_k, top_p) -> None:
    """Raises ValueError for a temperature that is not a finite float32 >= 0, a top_k < 0 or past
    int64 (any top_k at or above the vocabulary is no cut), a top_p outside (0, 1]."""
    import math

    def number(x) -> bool:  # (Python's and numpy's)
        return isinstance(x, numbers.Real) and not isinstance(x, bool)

    for t in temperature if isinstance(temperature, (list, tuple)) else [temperature]:
        if not number(t) or not math.isfinite(t) or not 0 <= t <= 3e38:
            raise ValueError(f"temperature must be a number in [0, 3e38] (0 = greedy), got {t!r}")
    for k in top_k if isinstance(top_k, (list, tuple)) else [top_k]:
        if not isinstance(k, numbers.Integral) or isinstance(k, bool) or not 0 <= k < 2**63:
            raise ValueError(f"top_k must be an integer in [0, 2**63) (0 = off), got {k!r}")
    for p in top_p if isinstance(top_p, (list, tuple)) else [top_p]:
        if not number(p) or not (0 < p <= 1):
            raise ValueError(f"top_p must be in (0, 1] (1 = off), got {p!r}")


def token_logprobs(
    logits: torch.Tensor, chosen: torch.Tensor, k: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Log-probabilities under the model's distribution (before temperature and filters), as
    OpenAI's ``logprobs`` reports them: of the ``chosen`` tokens ``(B,)`` -> ``(B,)``, and the ``k``
    most likely tokens -> values ``(B, k)`` float32, ids ``(B, k)`` int64. Fixed shapes: graph-safe."""
    ls = logits.float().log_softmax(-1)  # (B, V)
    top = ls.topk(k, -1)
    return ls.gather(-1, chosen[:, None])[:, 0], top.values, top.indices
