"""Stage 5, decode: softmax and top-k on the device, so only ``(B, k)`` values and indices cross back."""

from __future__ import annotations

import torch


def topk_probs(logits: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Softmax over classes and the ``k`` most probable, on the logits' device.

    Args:
        logits: ``(B, C)`` any float dtype.
        k: how many classes per row (clamped to ``C``).
    Returns:
        ``(probs, indices)``: ``(B, k)`` float32 in descending order, and ``(B, k)`` int64 class ids.
    """
    probs = torch.softmax(logits.float(), dim=-1)
    return probs.topk(min(k, logits.shape[-1]), dim=-1)
