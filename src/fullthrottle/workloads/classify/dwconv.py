"""Depthwise convolution fused with the activations around it (Triton on CUDA; plain PyTorch elsewhere).

In a mobile inverted bottleneck (MobileNetV2, EfficientNet-Lite) the expanded activations are the
largest tensors of the network, and unfused inference passes over them five times: the 1x1 expand
convolution writes them, a bias add and a ReLU6 read and write them, a zero-pad copies them (for
TensorFlow's "SAME" padding at stride 2), and the depthwise convolution reads them. :func:`dw_conv`
reads them once: it applies the expand convolution's bias and ReLU6 as it loads each tap (a tap in
the padding is zero, as if padded after the activation), pads by masking, and adds its own bias and
ReLU6 before its one write.

Layout: channels last. ``x`` is ``(B, C, H, W)`` in NHWC memory (``torch.channels_last``), the
weights ``(C, K * K)``; the result is ``(B, C, OH, OW)``, NHWC memory, in ``x``'s dtype. The kernel
accumulates in float32 and rounds once.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ...core.kernels.common import triton, use_triton

if triton is not None:
    import triton.language as tl

    @triton.jit
    def _dw_kernel(
        x_ptr,
        w_ptr,
        b_ptr,
        bin_ptr,
        y_ptr,
        H,
        W,
        OH,
        OW,
        C,
        P,
        PAD_T,
        PAD_L,
        K: tl.constexpr,
        S: tl.constexpr,
        ACT_IN: tl.constexpr,
        BLOCK_P: tl.constexpr,
        BLOCK_C: tl.constexpr,
    ):
        p = tl.program_id(0) * BLOCK_P + tl.arange(0, BLOCK_P)  # output pixels, flat over (B, OH, OW)
        c = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)  # channels (contiguous in memory)
        mp, mc = p < P, c < C
        ow = p % OW
        oh = (p // OW) % OH
        b = p // (OW * OH)
        if ACT_IN:
            b_in = tl.load(bin_ptr + c, mask=mc, other=0.0).to(tl.float32)
        acc = tl.zeros((BLOCK_P, BLOCK_C), dtype=tl.float32)
        for kh in tl.static_range(K):
            ih = oh * S - PAD_T + kh
            for kw in tl.static_range(K):
                iw = ow * S - PAD_L + kw
                ok = mp & (ih >= 0) & (ih < H) & (iw >= 0) & (iw < W)
                row = ((b * H + ih) * W + iw).to(tl.int64) * C
                m2 = ok[:, None] & mc[None, :]
                xv = tl.load(x_ptr + row[:, None] + c[None, :], mask=m2, other=0.0).to(tl.float32)
                if ACT_IN:  # the producer's bias + ReLU6, zero in the padding
                    xv = tl.where(m2, tl.minimum(tl.maximum(xv + b_in[None, :], 0.0), 6.0), 0.0)
                wv = tl.load(w_ptr + c * (K * K) + (kh * K + kw), mask=mc, other=0.0).to(tl.float32)
                acc += xv * wv[None, :]
        acc += tl.load(b_ptr + c, mask=mc, other=0.0).to(tl.float32)[None, :]
        acc = tl.minimum(tl.maximum(acc, 0.0), 6.0)
        out = (p.to(tl.int64) * C)[:, None] + c[None, :]
        tl.store(y_ptr + out, acc.to(y_ptr.dtype.element_ty), mask=mp[:, None] & mc[None, :])


def same_pads(n: int, k: int, stride: int) -> tuple[int, int]:
    """TensorFlow ``"SAME"`` padding of one dim: ``(before, after)``, the odd pixel after."""
    total = max((-(-n // stride) - 1) * stride + k - n, 0)
    return total // 2, total - total // 2


def dw_conv_ref(
    x: torch.Tensor, w: torch.Tensor, b: torch.Tensor, k: int, stride: int, b_in: torch.Tensor | None = None
) -> torch.Tensor:
    """The reference: ``relu6(depthwise_conv(relu6(x + b_in)) + b)`` with TensorFlow "SAME" padding
    (``b_in`` None: no input activation), in float32, rounded to ``x``'s dtype once."""
    h = x.float()
    if b_in is not None:
        h = F.relu6(h + b_in.float().view(1, -1, 1, 1))
    (pt, pb), (pl, pr) = same_pads(x.shape[2], k, stride), same_pads(x.shape[3], k, stride)
    h = F.pad(h, (pl, pr, pt, pb))
    y = F.conv2d(h, w.float().view(-1, 1, k, k), b.float(), stride, groups=x.shape[1])
    return F.relu6(y).to(x.dtype).contiguous(memory_format=torch.channels_last)


def dw_conv(
    x: torch.Tensor, w: torch.Tensor, b: torch.Tensor, k: int, stride: int, b_in: torch.Tensor | None = None
) -> torch.Tensor:
    """``relu6(depthwise_conv(relu6(x + b_in)) + b)``, TensorFlow "SAME" padding, in one pass.

    Args:
        x: ``(B, C, H, W)`` float, channels-last memory (made so when it is not).
        w: ``(C, k * k)`` depthwise weights (BatchNorm folded in); b: ``(C,)`` bias.
        k, stride: kernel size (odd) and stride.
        b_in: ``(C,)`` the producer's bias, applied with ReLU6 to each tap on load; ``None``: none.

    Returns:
        ``(B, C, ceil(H / stride), ceil(W / stride))`` in ``x``'s dtype, channels-last memory.

    Raises:
        ValueError: shapes that do not fit together.
    """
    B, C, H, W = x.shape
    if w.shape != (C, k * k) or b.shape != (C,) or (b_in is not None and b_in.shape != (C,)):
        raise ValueError(
            f"dw_conv: weights ({C}, {k * k}) and biases ({C},) expected for x {tuple(x.shape)}, got "
            f"{tuple(w.shape)}, {tuple(b.shape)}{'' if b_in is None else ', ' + str(tuple(b_in.shape))}"
        )
    if not use_triton(x):
        return dw_conv_ref(x, w, b, k, stride, b_in)
    x = x.contiguous(memory_format=torch.channels_last)
    OH, OW = -(-H // stride), -(-W // stride)
    y = torch.empty((B, C, OH, OW), dtype=x.dtype, device=x.device, memory_format=torch.channels_last)
    P = B * OH * OW
    BLOCK_C = min(64, triton.next_power_of_2(C))
    BLOCK_P = 4096 // BLOCK_C // 2
    grid = (triton.cdiv(P, BLOCK_P), triton.cdiv(C, BLOCK_C))
    _dw_kernel[grid](
        x,
        w.contiguous(),
        b.contiguous(),
        b if b_in is None else b_in.contiguous(),
        y,
        H,
        W,
        OH,
        OW,
        C,
        P,
        same_pads(H, k, stride)[0],
        same_pads(W, k, stride)[0],
        K=k,
        S=stride,
        ACT_IN=b_in is not None,
        BLOCK_P=BLOCK_P,
        BLOCK_C=BLOCK_C,
        num_warps=4,
    )
    return y
