"""The pair-interleaved row layout of the fused projections, and its conversions."""

from __future__ import annotations

import torch


def _check_group(fn: str, n: int, group: int) -> None:
    if not (isinstance(group, int) and group > 0 and group % 2 == 0 and n % group == 0):
        raise ValueError(f"{fn}: group must be an even int > 0 dividing the dim's size {n}, got {group!r}")


def deinterleave_pairs(t: torch.Tensor, group: int) -> torch.Tensor:
    """``(..., n * group)`` in the pair-interleaved layout -> the plain one: in each ``group`` of the
    last dim, ``[a0, b0, a1, b1, ...]`` becomes ``[a0, a1, ..., b0, b1, ...]``."""
    _check_group("deinterleave_pairs", t.shape[-1] if t.dim() else 0, group)
    shape = t.shape
    return t.reshape(*shape[:-1], shape[-1] // group, group // 2, 2).transpose(-1, -2).reshape(shape)


def interleave_pairs(t: torch.Tensor, group: int, dim: int = -1) -> torch.Tensor:
    """The inverse of :func:`deinterleave_pairs` along ``dim`` (used on weight rows: ``dim=0``)."""
    t = t.movedim(dim, -1)
    _check_group("interleave_pairs", t.shape[-1], group)
    shape = t.shape
    out = t.reshape(*shape[:-1], shape[-1] // group, 2, group // 2).transpose(-1, -2).reshape(shape)
    return out.movedim(-1, dim)


PAIRED_LAYOUT = """The fused projections keep their rows pair-interleaved: ``gate_up_proj`` as
``[gate_0, up_0, gate_1, up_1, ...]``, and each q/k/v head of ``qkv_proj`` as ``[x_0, x_{D/2}, x_1,
x_{D/2+1}, ...]`` (RoPE's rotate-half pairs side by side; :func:`llama.fuse_hf_projections` arranges
Hugging Face's weights so). A GEMV program then holds whole pairs, and gates or rotates them in its
epilogue before anything is written."""
