"""Matrix-vector products of the decode step (batch 1-2 rows) and the fused projections with their
epilogues (SwiGLU; RoPE into the KV cache): Triton kernels with their plain-PyTorch references."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .common import _FLOATS, _check, _is_int, _same_device, tl, triton, use_triton
from .norm_rope import rope_qkv_into_cache, silu_mul


def linear_ref(x, weight):
    return F.linear(x, weight)


def _gemv_config(N: int, K: int) -> tuple[int, int, int, int]:
    """(BLOCK_N, BLOCK_K, warps, stages), the fastest per Llama-2-7B projection shape on an H200
    (see docs/performance.md)."""
    if N <= 4096:  # o_proj (4096x4096), down_proj (4096x11008)
        bn, bk, warps, stages = 16, 1024, 8, 3
    elif N >= 32000:  # lm_head (32000x4096)
        bn, bk, warps, stages = 4, 256, 4, 1
    else:  # qkv_proj (12288x4096), gate_up_proj (22016x4096)
        bn, bk, warps, stages = 32, 256, 8, 3
    return bn, min(bk, triton.next_power_of_2(K)), warps, stages


def linear(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """``x @ weight.T`` (no bias); for a single row on CUDA a Triton GEMV.

    At batch 1 an LLM decode step is weight-bandwidth bound: every projection reads its whole weight
    for one token. cuBLAS splits K into a second reduction kernel for these shapes; this GEMV streams
    each weight row block once, in one kernel, closer to the memory bandwidth (see
    docs/performance.md). Any other shape goes to ``F.linear``.

    Args:
        x: ``(..., K)``; weight: ``(N, K)``, same dtype and device.

    Returns:
        ``(..., N)`` in ``x``'s dtype (float32 accumulation).

    Raises:
        ValueError: ``weight`` not 2-D with ``x``'s last dim, or dtypes that differ.
    """
    _check(
        weight.dim() == 2 and x.dim() >= 1 and weight.shape[1] == x.shape[-1],
        f"linear: weight must be (N, {x.shape[-1] if x.dim() else '?'}), got {tuple(weight.shape)}",
    )
    _check(
        x.dtype == weight.dtype and x.dtype in _FLOATS,
        f"linear: x and weight must share one dtype of float32/float16/bfloat16, got {x.dtype} and {weight.dtype}",
    )
    _same_device("linear", x=x, weight=weight)
    N, K = weight.shape
    if x.numel() != K or not use_triton(x) or not weight.is_contiguous():  # (dtype checked above)
        return linear_ref(x, weight)
    y = torch.empty((*x.shape[:-1], N), dtype=x.dtype, device=x.device)
    bn, bk, warps, stages = _gemv_config(N, K)
    _gemv_kernel[(triton.cdiv(N, bn),)](
        weight,
        x.contiguous(),
        y,
        N,
        K,
        y,
        y,
        y,
        y,
        y,
        0,
        0,
        0,
        0,
        0,
        0,
        BLOCK_N=bn,
        BLOCK_K=bk,
        EPILOGUE=0,
        HALF=1,
        num_warps=warps,
        num_stages=stages,
    )
    return y


#: launch settings (BLOCK_N, BLOCK_K, warps, stages) of the GEMVs with fused epilogues, by epilogue
#: (1: SwiGLU, 2: RoPE + cache write), the fastest on an H200 for Llama-2-7B's gate_up and qkv
#: (see docs/performance.md)
FUSED_CONFIGS = {1: (32, 256, 8, 1), 2: (16, 256, 4, 3)}


def _paired_config(epilogue: int, N: int, K: int, group: int) -> tuple[int, int, int, int] | None:
    """:data:`FUSED_CONFIGS` for ``epilogue`` with BLOCK_N cut to divide ``group`` (a head: D;
    SwiGLU: N), or None when no even block fits."""
    bn, bk, warps, stages = FUSED_CONFIGS[epilogue]
    while bn > 2 and group % bn:
        bn //= 2
    ok = bn >= 2 and group % bn == 0 and N % bn == 0
    return (bn, min(bk, triton.next_power_of_2(K)), warps, stages) if ok else None


def linear_silu_mul(x: torch.Tensor, w_gate_up: torch.Tensor) -> torch.Tensor:
    """SwiGLU's gated projection ``silu(x @ W_gate.T) * (x @ W_up.T)`` with ``W_gate``/``W_up`` the two
    halves of ``w_gate_up`` (Shazeer, 2020, "GLU Variants Improve Transformer").

    For a single row on CUDA one Triton GEMV computes the projection and gates each (gate, up) pair in
    its epilogue, so the ``(2*I,)`` projection is never written out and no second kernel runs;
    otherwise :func:`linear` then :func:`silu_mul`.

    Args:
        x: ``(..., K)``; w_gate_up: ``(2*I, K)`` with gate and up rows pair-interleaved
            (:data:`PAIRED_LAYOUT`), same dtype and device as ``x``.

    Returns:
        ``(..., I)`` in ``x``'s dtype (float32 accumulation, rounded once).

    Raises:
        ValueError: as :func:`linear`, or an odd number of rows.
    """
    _check(
        w_gate_up.dim() == 2 and w_gate_up.shape[0] % 2 == 0,
        f"linear_silu_mul: w_gate_up must be (2*I, K), got {tuple(w_gate_up.shape)}",
    )
    I2, K = w_gate_up.shape
    cfg = _paired_config(1, I2, K, I2) if triton is not None else None
    if (
        x.numel() != K
        or not use_triton(x)
        or not w_gate_up.is_contiguous()
        or x.dtype != w_gate_up.dtype
        or cfg is None
    ):
        return silu_mul(linear(x, w_gate_up))
    _same_device("linear_silu_mul", x=x, w_gate_up=w_gate_up)
    _check(x.dtype in _FLOATS, f"linear_silu_mul: x must be float32/float16/bfloat16, got {x.dtype}")
    bn, bk, warps, stages = cfg
    y = torch.empty((*x.shape[:-1], I2 // 2), dtype=x.dtype, device=x.device)
    _gemv_kernel[(I2 // bn,)](
        w_gate_up,
        x.contiguous(),
        y,
        I2,
        K,
        y,
        y,
        y,
        y,
        y,
        0,
        0,
        0,
        0,
        0,
        0,
        BLOCK_N=bn,
        BLOCK_K=bk,
        EPILOGUE=1,
        HALF=1,
        num_warps=warps,
        num_stages=stages,
    )
    return y


def linear_rope_qkv_into_cache(
    x: torch.Tensor,
    w_qkv: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    pos: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    row0: int,
    h: int,
    hkv: int,
) -> torch.Tensor:
    """The fused q/k/v projection, RoPE on q and k, and k and v written into the static KV cache:
    ``rope_qkv_into_cache(linear(x, w_qkv), ...)``.

    For a single token (``B == S == 1``) on CUDA this is one Triton GEMV whose programs each hold
    whole rotate-half pairs ``(d, d + D/2)`` of one head, so the rotation (as Hugging Face's Llama)
    happens in its epilogue and q, k and v go straight to their places: the ``(H + 2*Hkv) * D``
    projection is never written out and no second kernel runs.

    Args:
        x: ``(B, S, dim)``; w_qkv: ``((H + 2*Hkv) * D, dim)``, q heads, then k heads, then v heads,
            each head's rows pair-interleaved (:data:`PAIRED_LAYOUT`).
        cos, sin, pos, k_cache, v_cache, row0, h, hkv: as :func:`rope_qkv_into_cache`.

    Returns:
        q: ``(B, H, S, D)`` in ``x``'s dtype, rotated.

    Raises:
        ValueError: as :func:`linear` and :func:`rope_qkv_into_cache`.
    """
    d = k_cache.shape[-1] if k_cache.dim() == 4 else 0
    single = (
        x.dim() == 3
        and x.shape[0] == x.shape[1] == 1
        and use_triton(x)
        and w_qkv.is_contiguous()
        and w_qkv.dim() == 2
        and w_qkv.shape == ((h + 2 * hkv) * d, x.shape[-1])
        and d % 2 == 0
        and x.dtype == w_qkv.dtype == k_cache.dtype == v_cache.dtype
        and x.dtype in _FLOATS
        and k_cache.stride(-1) == 1
        and v_cache.stride() == k_cache.stride()
        and v_cache.shape == k_cache.shape
        and k_cache.shape[1] == hkv
        and cos.shape == sin.shape == (1, 1, d // 2)
        and pos.shape == (1, 1)
        and _is_int(row0)
        and 0 <= row0 < k_cache.shape[0]
    )
    cfg = _paired_config(2, *w_qkv.shape, d) if single else None
    if cfg is None:
        return rope_qkv_into_cache(linear(x, w_qkv), cos, sin, pos, k_cache, v_cache, row0, h, hkv)
    _same_device(
        "linear_rope_qkv_into_cache", x=x, w_qkv=w_qkv, cos=cos, sin=sin, pos=pos, k_cache=k_cache, v_cache=v_cache
    )
    q = torch.empty((1, h, 1, d), dtype=x.dtype, device=x.device)
    N, K = w_qkv.shape
    bn, bk, warps, stages = cfg
    _gemv_kernel[(N // bn,)](
        w_qkv,
        x.contiguous(),
        q,
        N,
        K,
        cos.contiguous(),
        sin.contiguous(),
        pos.contiguous(),
        k_cache,
        v_cache,
        h,
        hkv,
        row0,
        k_cache.stride(0),
        k_cache.stride(1),
        k_cache.stride(2),
        BLOCK_N=bn,
        BLOCK_K=bk,
        EPILOGUE=2,
        HALF=d // 2,
        num_warps=warps,
        num_stages=stages,
    )
    return q


if triton is not None:

    @triton.jit(do_not_specialize=["row0"])
    def _gemv_kernel(
        w_ptr,
        x_ptr,
        y_ptr,
        N,
        K,
        cos_ptr,
        sin_ptr,
        pos_ptr,
        kc_ptr,
        vc_ptr,
        H,
        HKV,
        row0,
        c_b,
        c_h,
        c_t,
        BLOCK_N: tl.constexpr,
        BLOCK_K: tl.constexpr,
        EPILOGUE: tl.constexpr,
        HALF: tl.constexpr,
    ):
        # y[n] = sum_k W[n, k] x[k]: one program per BLOCK_N rows of W, streamed once along K
        rn = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
        acc = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            rk = k0 + tl.arange(0, BLOCK_K)
            mk = rk < K
            w = tl.load(
                w_ptr + rn[:, None].to(tl.int64) * K + rk[None, :], mask=(rn[:, None] < N) & mk[None, :], other=0.0
            )
            xv = tl.load(x_ptr + rk, mask=mk, other=0.0).to(tl.float32)
            acc += w.to(tl.float32) * xv[None, :]
        y = tl.sum(acc, axis=1)  # (BLOCK_N,) float32
        if EPILOGUE == 0:
            tl.store(y_ptr + rn, y.to(y_ptr.dtype.element_ty), mask=rn < N)
        else:
            # the fused projections store their rows pair-interleaved (see PAIRED_LAYOUT): even rows
            # are one member of a pair, odd rows the other, so each program holds whole pairs
            a, b = tl.split(tl.reshape(y, (BLOCK_N // 2, 2)))
            i = tl.program_id(0) * (BLOCK_N // 2) + tl.arange(0, BLOCK_N // 2)  # pair index
            if EPILOGUE == 1:  # SwiGLU: pair (gate_i, up_i) -> silu(gate_i) * up_i
                tl.store(y_ptr + i, (a * tl.sigmoid(a) * b).to(y_ptr.dtype.element_ty), mask=i < N // 2)
            else:  # qkv: pair (x_d, x_{d+D/2}) of head j; RoPE on q and k; q out, k and v into the cache
                j = i // HALF
                d = i % HALF
                if tl.program_id(0) * BLOCK_N < (H + HKV) * 2 * HALF:  # a q or k head (whole program)
                    c = tl.load(cos_ptr + d)
                    sn = tl.load(sin_ptr + d)
                    o1 = a * c - b * sn
                    o2 = b * c + a * sn
                else:
                    o1 = a
                    o2 = b
                p = tl.load(pos_ptr).to(tl.int64)
                rb = row0.to(tl.int64) * c_b + p * c_t
                j0 = (tl.program_id(0) * BLOCK_N) // (2 * HALF)  # the program's head
                if j0 < H:
                    dst = y_ptr + j * 2 * HALF + d  # q: (1, H, 1, D)
                elif j0 < H + HKV:
                    dst = kc_ptr + rb + (j - H) * c_h + d
                else:
                    dst = vc_ptr + rb + (j - H - HKV) * c_h + d
                tl.store(dst, o1.to(y_ptr.dtype.element_ty))
                tl.store(dst + HALF, o2.to(y_ptr.dtype.element_ty))
