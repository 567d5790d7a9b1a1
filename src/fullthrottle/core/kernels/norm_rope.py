"""RMSNorm (optionally after a residual add), RoPE of q and k into the static KV cache or into paged
KV memory, and SwiGLU's ``silu(gate) * up``: Triton kernels with their plain-PyTorch references."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .common import _FLOATS, FP8_MAX, KV_FP8, _check, _kv_dtype_ok, _same_device, tl, to_kv, triton, use_triton
from .layout import deinterleave_pairs


def rms_norm_ref(x, weight, eps, residual=None):
    if residual is not None:
        x = x + residual
        return x, F.rms_norm(x, weight.shape, weight, eps)
    return F.rms_norm(x, weight.shape, weight, eps)


def _rotate_half(x):
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def _rope_ref(qkv, cos, sin, h, hkv, d):
    """q, k rotated and v: ``(B, H, S, D)``, ``(B, Hkv, S, D)``, ``(B, Hkv, S, D)``."""
    B, S, _ = qkv.shape
    qkv = deinterleave_pairs(qkv, d)  # each head: [x_0..x_D/2-1, x_D/2..]
    qk, v = qkv.split([(h + hkv) * d, hkv * d], dim=-1)  # (B, S, (H+Hkv)*D), (B, S, Hkv*D)
    c = torch.cat((cos, cos), dim=-1)[:, :, None].to(qkv.dtype)  # (B, S, 1, D)
    s = torch.cat((sin, sin), dim=-1)[:, :, None].to(qkv.dtype)
    qk = qk.view(B, S, h + hkv, d)
    qk = qk * c + _rotate_half(qk) * s  # RoPE on q and k at once
    q, k = qk.transpose(1, 2).split([h, hkv], dim=1)  # (B, H, S, D), (B, Hkv, S, D)
    return q, k, v.view(B, S, hkv, d).transpose(1, 2)


def rope_qkv_into_cache_ref(qkv, cos, sin, pos, k_cache, v_cache, row0, h, hkv):
    B, S, _ = qkv.shape
    d = k_cache.shape[-1]
    q, k, v = _rope_ref(qkv, cos, sin, h, hkv, d)
    idx = pos[:, None, :, None].expand(B, hkv, S, d)  # where each new token goes
    k_cache[row0 : row0 + B].scatter_(2, idx, k)
    v_cache[row0 : row0 + B].scatter_(2, idx, v)
    return q


def write_pages(k_pages, v_pages, table, rows, pos, k, v) -> None:
    """New keys and values into their pages: ``k``, ``v`` ``(B, Hkv, S, D)`` at positions ``pos``
    ``(B, S)`` int64 of cache rows ``rows`` ``(B, S)`` (or ``(B,)``: one row per b) int64, through the
    block table ``(rows, P)``, in the pages' dtype (:func:`~fullthrottle.core.kernels.common.to_kv`;
    graph-safe: no host sync)."""
    page = k_pages.shape[2]
    where = table[rows if rows.dim() == 2 else rows[:, None], pos // page]  # (B, S): each token's page
    k_pages[where, :, pos % page] = to_kv(k.transpose(1, 2), k_pages.dtype)  # (B, S, Hkv, D)
    v_pages[where, :, pos % page] = to_kv(v.transpose(1, 2), v_pages.dtype)


def rope_qkv_into_pages_ref(qkv, cos, sin, pos, k_pages, v_pages, table, rows, h, hkv):
    q, k, v = _rope_ref(qkv, cos, sin, h, hkv, k_pages.shape[-1])
    write_pages(k_pages, v_pages, table, rows, pos, k, v)
    return q


def silu_mul_ref(gate_up):
    gate, up = gate_up[..., 0::2], gate_up[..., 1::2]  # pair-interleaved
    return F.silu(gate) * up


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None):
    """RMSNorm over the last dim: ``x * rsqrt(mean(x^2) + eps) * weight`` (Zhang & Sennrich, 2019).

    Args:
        x: ``(..., N)`` float (bf16/fp16/fp32). weight: ``(N,)``. eps: e.g. 1e-5.
        residual: optional, same shape as ``x``; then ``s = x + residual`` is normalised instead.

    Returns:
        the normalised ``(..., N)`` in ``x``'s dtype; with ``residual``, the tuple ``(s, norm(s))``.

    Raises:
        ValueError: a weight not ``(N,)``, a residual of another shape or dtype, a non-float ``x``, eps <= 0.
    """
    N = x.shape[-1] if x.dim() else 0
    _check(x.dtype in _FLOATS, f"rms_norm: x must be float32/float16/bfloat16, got {x.dtype}")
    _check(weight.shape == (N,), f"rms_norm: weight must be ({N},) for x {tuple(x.shape)}, got {tuple(weight.shape)}")
    _check(weight.dtype in _FLOATS, f"rms_norm: weight must be a float tensor, got {weight.dtype}")
    _check(
        residual is None or (residual.shape == x.shape and residual.dtype == x.dtype),
        "rms_norm: residual must have x's shape and dtype",
    )
    _check(isinstance(eps, (int, float)) and eps > 0, f"rms_norm: eps must be a number > 0, got {eps!r}")
    _same_device("rms_norm", x=x, weight=weight, residual=residual)
    if not use_triton(x):
        return rms_norm_ref(x, weight, eps, residual)
    x2 = x.reshape(-1, N).contiguous()
    y = torch.empty_like(x2)
    s = torch.empty_like(x2) if residual is not None else x2
    r = residual.reshape(-1, N).contiguous() if residual is not None else x2
    _rms_norm_kernel[(x2.shape[0],)](
        x2,
        r,
        weight,
        s,
        y,
        N,
        eps,
        HAS_RESIDUAL=residual is not None,
        BLOCK=triton.next_power_of_2(N),
        num_warps=8 if N >= 2048 else 4,
    )
    if residual is not None:
        return s.view(x.shape), y.view(x.shape)
    return y.view(x.shape)


def rope_qkv_into_cache(
    qkv: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    pos: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    row0: int,
    h: int,
    hkv: int,
) -> torch.Tensor:
    """Rotary embedding (Su et al., 2021, "RoFormer"; the rotate-half layout of HF's Llama) on q and k,
    and the new k and v written into the static KV cache.

    Args:
        qkv: ``(B, S, (H + 2*Hkv) * D)``, the fused q/k/v projection (q heads, k heads, v heads; each
            head pair-interleaved, :data:`PAIRED_LAYOUT`).
        cos, sin: ``(B, S, D/2)`` float32, the angles ``pos * inv_freq``'s cosine and sine.
        pos: ``(B, S)`` int64 positions = cache slots (each < the cache length; not checked here).
        k_cache, v_cache: ``(maxB, Hkv, T, D)``, rows ``row0 .. row0+B`` are written at ``pos``.
        h, hkv: query and key/value head counts.

    Returns:
        q: ``(B, H, S, D)`` in ``qkv``'s dtype, rotated.

    Raises:
        ValueError: shapes or dtypes that do not fit together, or rows past the cache. Positions are
            not checked here (that would synchronise with the host inside a CUDA graph): the caller
            keeps them below the cache length (:class:`~fullthrottle.workloads.llm.generate.Generator` does).
    """
    _check(qkv.dim() == 3, f"rope_qkv_into_cache: qkv must be (B, S, (H+2*Hkv)*D), got {tuple(qkv.shape)}")
    B, S, F_ = qkv.shape
    _check(
        k_cache.dim() == 4 and v_cache.shape == k_cache.shape and k_cache.shape[1] == hkv,
        f"rope_qkv_into_cache: caches must be (maxB, {hkv}, T, D), got {tuple(k_cache.shape)} and "
        f"{tuple(v_cache.shape)}",
    )
    d = k_cache.shape[-1]
    _check(d % 2 == 0, f"rope_qkv_into_cache: the head dim D must be even (RoPE rotates pairs), got {d}")
    _check(
        F_ == (h + 2 * hkv) * d,
        f"rope_qkv_into_cache: qkv's last dim {F_} is not (H + 2*Hkv) * D = ({h} + 2*{hkv}) * {d}",
    )
    _check(
        qkv.dtype in _FLOATS and k_cache.dtype == qkv.dtype == v_cache.dtype,
        f"rope_qkv_into_cache: qkv and caches must share a float dtype, got {qkv.dtype}, {k_cache.dtype}",
    )
    _check(
        cos.shape == sin.shape == (B, S, d // 2) and pos.shape == (B, S),
        f"rope_qkv_into_cache: cos/sin must be ({B}, {S}, {d // 2}) and pos ({B}, {S})",
    )
    _check(
        0 <= row0 and row0 + B <= k_cache.shape[0],
        f"rope_qkv_into_cache: rows {row0}..{row0 + B} are past the cache's {k_cache.shape[0]}",
    )
    _same_device("rope_qkv_into_cache", qkv=qkv, cos=cos, sin=sin, pos=pos, k_cache=k_cache, v_cache=v_cache)
    if not use_triton(qkv):
        return rope_qkv_into_cache_ref(qkv, cos, sin, pos, k_cache, v_cache, row0, h, hkv)
    assert k_cache.stride(-1) == 1 and v_cache.stride() == k_cache.stride()
    return _launch_rope(qkv, cos, sin, pos, k_cache, v_cache, row0, h, hkv)


def rope_qkv_into_pages(
    qkv: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    pos: torch.Tensor,
    k_pages: torch.Tensor,
    v_pages: torch.Tensor,
    table: torch.Tensor,
    rows: torch.Tensor,
    h: int,
    hkv: int,
) -> torch.Tensor:
    """:func:`rope_qkv_into_cache` into paged KV memory: token ``(b, s)``'s k and v go to position
    ``pos[b, s]`` of cache row ``rows[b, s]``, in page ``table[row, pos // PAGE]`` at slot ``pos % PAGE``,
    converted to the pages' dtype (float8 e4m3: saturated at 448), in the same kernel.

    Args:
        qkv, cos, sin, h, hkv: as :func:`rope_qkv_into_cache`. pos, rows: ``(B, S)`` int64 positions and
            cache rows (a decode step: one row per b; a packed prefill: ``B == 1``, a row per token).
        k_pages, v_pages: ``(num_pages, Hkv, PAGE, D)`` in ``qkv``'s dtype or float8 e4m3.
        table: ``(rows, P)`` int64 page numbers. Positions and rows are not checked (no host sync).

    Returns:
        q: ``(B, H, S, D)`` in ``qkv``'s dtype, rotated.

    Raises:
        ValueError: shapes or dtypes that do not fit together.
    """
    _check(qkv.dim() == 3, f"rope_qkv_into_pages: qkv must be (B, S, (H+2*Hkv)*D), got {tuple(qkv.shape)}")
    B, S, F_ = qkv.shape
    _check(
        k_pages.dim() == 4 and v_pages.shape == k_pages.shape and k_pages.shape[1] == hkv and table.dim() == 2,
        f"rope_qkv_into_pages: pages must be (num_pages, {hkv}, PAGE, D) and the table (rows, P), got "
        f"{tuple(k_pages.shape)}, {tuple(v_pages.shape)}, {tuple(table.shape)}",
    )
    d, page = k_pages.shape[-1], k_pages.shape[2]
    _check(
        d % 2 == 0 and F_ == (h + 2 * hkv) * d,
        f"rope_qkv_into_pages: qkv's last dim {F_} is not (H + 2*Hkv) * D = ({h} + 2*{hkv}) * {d}, D even",
    )
    _check(
        qkv.dtype in _FLOATS and _kv_dtype_ok(k_pages, qkv) and v_pages.dtype == k_pages.dtype,
        f"rope_qkv_into_pages: the pages must be in qkv's dtype or float8_e4m3fn, got {qkv.dtype}, {k_pages.dtype}",
    )
    _check(
        cos.shape == sin.shape == (B, S, d // 2) and pos.shape == rows.shape == (B, S) and table.dtype == torch.long,
        f"rope_qkv_into_pages: cos/sin must be ({B}, {S}, {d // 2}), pos and rows ({B}, {S}), the table int64",
    )
    _same_device("rope_qkv_into_pages", qkv=qkv, cos=cos, pos=pos, k_pages=k_pages, table=table, rows=rows)
    if not use_triton(qkv) or k_pages.stride(-1) != 1 or v_pages.stride() != k_pages.stride():
        return rope_qkv_into_pages_ref(qkv, cos, sin, pos, k_pages, v_pages, table, rows, h, hkv)
    return _launch_rope(qkv, cos, sin, pos, k_pages, v_pages, 0, h, hkv, (table, rows.contiguous(), page))


def _launch_rope(qkv, cos, sin, pos, k_cache, v_cache, row0, h, hkv, paged=None) -> torch.Tensor:
    # the rope kernel's launch: into the static cache's rows row0.., or ``paged`` (table, rows, PAGE)
    B, S, _ = qkv.shape
    d = k_cache.shape[-1]
    qkv = qkv.contiguous()
    q = torch.empty((B, h, S, d), dtype=qkv.dtype, device=qkv.device)
    table, rows, page = paged or (pos, pos, 1)  # (static: never read)
    _rope_qkv_kernel[(B * S, h + 2 * hkv)](
        qkv,
        cos.contiguous(),
        sin.contiguous(),
        pos.contiguous(),
        q,
        k_cache,
        v_cache,
        rows,
        table,
        table.stride(0),
        S,
        h,
        hkv,
        row0,
        qkv.stride(1),
        k_cache.stride(0),
        k_cache.stride(1),
        k_cache.stride(2),
        HALF=d // 2,
        BLOCK=triton.next_power_of_2(d // 2),
        PAGED=paged is not None,
        PAGE=page,
        FP8=k_cache.dtype == KV_FP8,
        FP8_MAX=FP8_MAX,
        num_warps=1,
    )
    return q


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """SwiGLU's gating (Shazeer, 2020, "GLU Variants Improve Transformer"): ``silu(gate) * up``.

    Args:
        gate_up: ``(..., 2*I)``, gate and up pair-interleaved: ``[gate_0, up_0, gate_1, up_1, ...]``.

    Returns:
        ``(..., I)`` in ``gate_up``'s dtype.

    Raises:
        ValueError: an odd last dim, or not a float tensor.
    """
    _check(
        gate_up.dim() >= 1 and gate_up.shape[-1] % 2 == 0 and gate_up.shape[-1] > 0,
        f"silu_mul: the last dim must be even (gate and up halves), got {tuple(gate_up.shape)}",
    )
    _check(gate_up.dtype in _FLOATS, f"silu_mul: gate_up must be a float tensor, got {gate_up.dtype}")
    if not use_triton(gate_up):
        return silu_mul_ref(gate_up)
    I2 = gate_up.shape[-1]
    gu = gate_up.reshape(-1, I2).contiguous()
    out = torch.empty((gu.shape[0], I2 // 2), dtype=gu.dtype, device=gu.device)
    BLOCK = 1024
    _silu_mul_kernel[(gu.shape[0], triton.cdiv(I2 // 2, BLOCK))](gu, out, I2 // 2, BLOCK=BLOCK, num_warps=4)
    return out.view(*gate_up.shape[:-1], I2 // 2)


if triton is not None:

    @triton.jit
    def _rms_norm_kernel(x_ptr, r_ptr, w_ptr, s_ptr, y_ptr, N, eps, HAS_RESIDUAL: tl.constexpr, BLOCK: tl.constexpr):
        row = tl.program_id(0)  # one program per row of N features
        cols = tl.arange(0, BLOCK)
        m = cols < N
        x = tl.load(x_ptr + row * N + cols, mask=m, other=0.0)
        if HAS_RESIDUAL:  # the sum is rounded to the input type, as the unfused add would store it
            x = x.to(tl.float32) + tl.load(r_ptr + row * N + cols, mask=m, other=0.0).to(tl.float32)
            x = x.to(s_ptr.dtype.element_ty)
            tl.store(s_ptr + row * N + cols, x, mask=m)
        xf = x.to(tl.float32)
        rstd = 1.0 / tl.sqrt(tl.sum(xf * xf, axis=0) / N + eps)
        w = tl.load(w_ptr + cols, mask=m, other=0.0).to(tl.float32)
        tl.store(y_ptr + row * N + cols, (xf * rstd * w).to(y_ptr.dtype.element_ty), mask=m)

    @triton.jit(do_not_specialize=["S", "row0"])  # prompt lengths and cache rows vary: one compile
    def _rope_qkv_kernel(
        qkv_ptr,
        cos_ptr,
        sin_ptr,
        pos_ptr,
        q_ptr,
        kc_ptr,
        vc_ptr,
        rows_ptr,
        table_ptr,
        table_stride,
        S,
        H,
        HKV,
        row0,
        qkv_tok_stride,
        c_b,
        c_h,
        c_t,
        HALF: tl.constexpr,
        BLOCK: tl.constexpr,
        PAGED: tl.constexpr,
        PAGE: tl.constexpr,
        FP8: tl.constexpr,
        FP8_MAX: tl.constexpr,
    ):
        # PAGED: token tok's k and v go to row rows[tok], page table[row, pos // PAGE], slot pos % PAGE
        # (c_b: a page's stride); FP8: the caches are float8, the values saturated first
        tok = tl.program_id(0)  # b * S + s
        j = tl.program_id(1)  # head: q heads, then k heads, then v heads
        b = tok // S
        s = tok % S
        d = tl.arange(0, BLOCK)
        m = d < HALF
        src = qkv_ptr + tok * qkv_tok_stride + j * 2 * HALF  # pair-interleaved head
        x1 = tl.load(src + 2 * d, mask=m, other=0.0).to(tl.float32)  # dims 0 .. D/2-1
        x2 = tl.load(src + 2 * d + 1, mask=m, other=0.0).to(tl.float32)  # dims D/2 .. D-1
        if j < H + HKV:  # rotate q and k: (x1, x2) -> (x1 cos - x2 sin, x2 cos + x1 sin)
            c = tl.load(cos_ptr + tok * HALF + d, mask=m, other=0.0)
            sn = tl.load(sin_ptr + tok * HALF + d, mask=m, other=0.0)
            o1 = x1 * c - x2 * sn
            o2 = x2 * c + x1 * sn
        else:
            o1 = x1
            o2 = x2
        if j < H:
            dst = q_ptr + ((b * H + j) * S + s) * 2 * HALF  # q: (B, H, S, D)
            tl.store(dst + d, o1.to(q_ptr.dtype.element_ty), mask=m)
            tl.store(dst + HALF + d, o2.to(q_ptr.dtype.element_ty), mask=m)
        else:  # k or v: into the cache at the token's position
            p = tl.load(pos_ptr + tok).to(tl.int64)
            if PAGED:
                rb = tl.load(rows_ptr + tok).to(tl.int64)
                slot = tl.load(table_ptr + rb * table_stride + p // PAGE).to(tl.int64) * c_b + (p % PAGE) * c_t
            else:
                slot = (row0 + b).to(tl.int64) * c_b + p * c_t  # cache offsets can pass 2**31 elements
            if FP8:
                o1 = tl.minimum(tl.maximum(o1, -FP8_MAX), FP8_MAX)
                o2 = tl.minimum(tl.maximum(o2, -FP8_MAX), FP8_MAX)
            if j < H + HKV:
                kv = kc_ptr + slot + (j - H) * c_h  # k_cache[row, j-H, p]
            else:
                kv = vc_ptr + slot + (j - H - HKV) * c_h
            tl.store(kv + d, o1.to(kc_ptr.dtype.element_ty), mask=m)
            tl.store(kv + HALF + d, o2.to(kc_ptr.dtype.element_ty), mask=m)

    @triton.jit
    def _silu_mul_kernel(gu_ptr, out_ptr, I, BLOCK: tl.constexpr):
        row = tl.program_id(0)
        cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        m = cols < I
        g = tl.load(gu_ptr + row * 2 * I + 2 * cols, mask=m, other=0.0).to(tl.float32)  # pair-interleaved
        u = tl.load(gu_ptr + row * 2 * I + 2 * cols + 1, mask=m, other=0.0).to(tl.float32)
        tl.store(out_ptr + row * I + cols, (g * tl.sigmoid(g) * u).to(out_ptr.dtype.element_ty), mask=m)
