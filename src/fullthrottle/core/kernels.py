"""Fused kernels for the LLM decode step and the image input (Triton on CUDA; the plain PyTorch
reference everywhere else).

A Llama-2-7B decode step at batch 1 is ~660 kernels, and the small ones cost as much as their
launch: in plain PyTorch RMSNorm, RoPE (five elementwise kernels on q and k) and the KV-cache write
(two scatters) take a sizeable share of the step next to the matrix products (see
docs/performance.md). Three kernels here replace them:

- :func:`rms_norm` — RMSNorm of each row, optionally after adding a residual (one read, one write);
- :func:`rope_qkv_into_cache` — RoPE on q and k straight from the fused qkv projection, q written out
  as ``(B, H, S, D)`` for attention, k and v written into the static KV cache at their positions;
- :func:`silu_mul` — SwiGLU's ``silu(gate) * up`` from the fused gate/up projection.

and, for the image classifier, :func:`normalize_u8`: uint8 NHWC crops to the normalised half-precision
input in one pass; and :func:`resize_crop_u8`: the GPU decode stage's resize + center crop of a batch
of decoded images of any sizes, in two launches.

Each has a reference in plain PyTorch (the ``*_ref`` functions, the same math as Hugging Face's
Llama; for the resize, :func:`fullthrottle.data.gpu_resize.resize_crop_matmul`), used on the CPU, without
Triton, or with ``FULLTHROTTLE_TRITON=0``. The Triton kernels compute
in float32 and round once, so they agree with the references (which round bf16 intermediates) to
bf16 rounding, not bit for bit. With ``TRITON_INTERPRET=1`` Triton's interpreter runs them on CPU
tensors (how CI checks their indexing without a GPU).
"""

from __future__ import annotations

import os

import torch
import torch.nn.functional as F

from . import env

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only installs: the references run
    triton = None

_INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"


def use_triton(t: torch.Tensor) -> bool:
    """True when the Triton kernels run for tensors like ``t``: Triton importable, ``t`` on CUDA (or
    Triton's interpreter on), and ``FULLTHROTTLE_TRITON`` not ``0``."""
    return triton is not None and (t.is_cuda or _INTERPRET) and env.get(env.TRITON) != "0"


# -- references (plain PyTorch) ------------------------------------------------------------------
def rms_norm_ref(x, weight, eps, residual=None):
    if residual is not None:
        x = x + residual
        return x, F.rms_norm(x, weight.shape, weight, eps)
    return F.rms_norm(x, weight.shape, weight, eps)


def _rotate_half(x):
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


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


def rope_qkv_into_cache_ref(qkv, cos, sin, pos, k_cache, v_cache, row0, h, hkv):
    B, S, _ = qkv.shape
    d = k_cache.shape[-1]
    qkv = deinterleave_pairs(qkv, d)  # each head: [x_0..x_D/2-1, x_D/2..]
    qk, v = qkv.split([(h + hkv) * d, hkv * d], dim=-1)  # (B, S, (H+Hkv)*D), (B, S, Hkv*D)
    c = torch.cat((cos, cos), dim=-1)[:, :, None].to(qkv.dtype)  # (B, S, 1, D)
    s = torch.cat((sin, sin), dim=-1)[:, :, None].to(qkv.dtype)
    qk = qk.view(B, S, h + hkv, d)
    qk = qk * c + _rotate_half(qk) * s  # RoPE on q and k at once
    q, k = qk.transpose(1, 2).split([h, hkv], dim=1)  # (B, H, S, D), (B, Hkv, S, D)
    v = v.view(B, S, hkv, d).transpose(1, 2)  # (B, Hkv, S, D)
    idx = pos[:, None, :, None].expand(B, hkv, S, d)  # where each new token goes
    k_cache[row0 : row0 + B].scatter_(2, idx, k)
    v_cache[row0 : row0 + B].scatter_(2, idx, v)
    return q


def silu_mul_ref(gate_up):
    gate, up = gate_up[..., 0::2], gate_up[..., 1::2]  # pair-interleaved
    return F.silu(gate) * up


def linear_ref(x, weight):
    return F.linear(x, weight)


def decode_attention_ref(q, k_cache, v_cache, pos, row0, kv_len):
    B, H, S, D = q.shape
    hkv = k_cache.shape[1]
    kc, vc = k_cache[row0 : row0 + B, :, :kv_len], v_cache[row0 : row0 + B, :, :kv_len]  # (B, Hkv, T, D)
    if H > hkv:
        kc, vc = kc.repeat_interleave(H // hkv, dim=1), vc.repeat_interleave(H // hkv, dim=1)
    t = torch.arange(kv_len, device=q.device)
    mask = t[None, None, None, :] <= pos[:, None, :, None]  # (B, 1, S, T): slots 0..pos
    return F.scaled_dot_product_attention(q, kc, vc, attn_mask=mask)


def normalize_u8_ref(x_u8, scale, shift, dtype):
    # shift + x * scale over the last dim (channels), computed in float32, rounded once to dtype
    return torch.addcmul(shift.float(), x_u8.float(), scale.float()).to(dtype)


# -- Triton kernels ----------------------------------------------------------------------------
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
    ):
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
        p = tl.load(pos_ptr + tok).to(tl.int64)
        rb = (row0 + b).to(tl.int64)  # cache offsets can pass 2**31 elements
        if j < H:
            dst = q_ptr + ((b * H + j) * S + s) * 2 * HALF  # q: (B, H, S, D)
        elif j < H + HKV:
            dst = kc_ptr + rb * c_b + (j - H) * c_h + p * c_t  # k_cache[row0+b, j-H, p]
        else:
            dst = vc_ptr + rb * c_b + (j - H - HKV) * c_h + p * c_t
        tl.store(dst + d, o1.to(q_ptr.dtype.element_ty), mask=m)
        tl.store(dst + HALF + d, o2.to(q_ptr.dtype.element_ty), mask=m)

    @triton.jit
    def _silu_mul_kernel(gu_ptr, out_ptr, I, BLOCK: tl.constexpr):
        row = tl.program_id(0)
        cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        m = cols < I
        g = tl.load(gu_ptr + row * 2 * I + 2 * cols, mask=m, other=0.0).to(tl.float32)  # pair-interleaved
        u = tl.load(gu_ptr + row * 2 * I + 2 * cols + 1, mask=m, other=0.0).to(tl.float32)
        tl.store(out_ptr + row * I + cols, (g * tl.sigmoid(g) * u).to(out_ptr.dtype.element_ty), mask=m)

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

    @triton.jit
    def _attention_part_kernel(
        q_ptr,
        kc_ptr,
        vc_ptr,
        pos_ptr,
        part_ptr,
        o_ptr,
        cnt_ptr,
        row0,
        T,
        H,
        REP,
        SPLITS,
        c_b,
        c_h,
        c_t,
        sm_scale,
        D: tl.constexpr,
        BLOCK_T: tl.constexpr,
        MERGE: tl.constexpr,
        BLOCK_S: tl.constexpr,
    ):
        # split-KV decode attention, part 1: program (row*head, split) takes cache slots
        # [split*BLOCK_T, (split+1)*BLOCK_T) of the valid 0..pos and leaves (acc[D], max, sum)
        bh = tl.program_id(0)
        sp = tl.program_id(1)
        b = bh // H
        h = bh % H
        d = tl.arange(0, D)
        q = tl.load(q_ptr + bh * D + d).to(tl.float32) * sm_scale
        n = tl.minimum(tl.load(pos_ptr + b) + 1, T)  # valid slots: 0..pos
        t = sp * BLOCK_T + tl.arange(0, BLOCK_T)
        mt = t < n
        off = (row0 + b).to(tl.int64) * c_b + (h // REP) * c_h + t[:, None].to(tl.int64) * c_t + d[None, :]
        k = tl.load(kc_ptr + off, mask=mt[:, None], other=0.0).to(tl.float32)  # (BLOCK_T, D)
        sc = tl.where(mt, tl.sum(k * q[None, :], axis=1), float("-inf"))
        m = tl.max(sc, axis=0)
        p = tl.exp(sc - tl.where(m == float("-inf"), 0.0, m))  # 0 where masked
        v = tl.load(vc_ptr + off, mask=mt[:, None], other=0.0).to(tl.float32)
        out = part_ptr + (bh * SPLITS + sp) * (D + 2)
        tl.store(out + d, tl.sum(p[:, None] * v, axis=0))
        tl.store(out + D, m)
        tl.store(out + D + 1, tl.sum(p, axis=0))
        if MERGE:  # the last split of this (row, head) to finish merges them all: no second kernel
            tl.debug_barrier()  # every thread's partial is stored
            done = tl.atomic_add(cnt_ptr + bh, 1, sem="acq_rel")  # release ours, acquire the others'
            if done == SPLITS - 1:
                _merge_splits(part_ptr, o_ptr, bh, SPLITS, D, BLOCK_S)
                tl.store(cnt_ptr + bh, 0)  # ready for the next call / replay

    @triton.jit
    def _merge_splits(part_ptr, o_ptr, bh, SPLITS, D: tl.constexpr, BLOCK_S: tl.constexpr):
        # merge the splits' partial softmaxes (Dao et al., 2023, "Flash-Decoding"); .cg: read the
        # other programs' partials from L2, never a stale L1 line
        sidx = tl.arange(0, BLOCK_S)
        ms = sidx < SPLITS
        base = part_ptr + (bh * SPLITS + sidx) * (D + 2)
        m = tl.load(base + D, mask=ms, other=float("-inf"), cache_modifier=".cg")
        l_ = tl.load(base + D + 1, mask=ms, other=0.0, cache_modifier=".cg")
        w = tl.exp(m - tl.max(m, axis=0))  # split 0 is never empty
        d = tl.arange(0, D)
        acc = tl.load(base[:, None] + d[None, :], mask=ms[:, None], other=0.0, cache_modifier=".cg")
        o = tl.sum(w[:, None] * acc, axis=0) / tl.sum(w * l_, axis=0)
        tl.store(o_ptr + bh * D + d, o.to(o_ptr.dtype.element_ty))

    @triton.jit
    def _attention_merge_kernel(part_ptr, o_ptr, SPLITS, D: tl.constexpr, BLOCK_S: tl.constexpr):
        # part 2 (when no counters are given): one program per (row, head)
        _merge_splits(part_ptr, o_ptr, tl.program_id(0), SPLITS, D, BLOCK_S)

    @triton.jit
    def _normalize_u8_kernel(x_ptr, scale_ptr, shift_ptr, y_ptr, n, C: tl.constexpr, BLOCK: tl.constexpr):
        offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)  # flat (..., C) index
        m = offs < n
        x = tl.load(x_ptr + offs, mask=m, other=0).to(tl.float32)
        c = offs % C  # the channel
        sc = tl.load(scale_ptr + c).to(tl.float32)
        sh = tl.load(shift_ptr + c).to(tl.float32)
        tl.store(y_ptr + offs, (x * sc + sh).to(y_ptr.dtype.element_ty), mask=m)

    # -- resize + center crop of a batch of decoded images of any sizes (two separable passes) ----
    # meta, int64 per image (_RESIZE_META columns): pointer, strides (c, h, w), H, W, resized (nh, nw),
    # crop offsets (top, left), the first source row kept and how many (row0, nrows), the image's
    # offset in the float32 scratch, taps per output (kx, ky).
    @triton.jit
    def _resize_h_kernel(meta_ptr, prog_ptr, tmp_ptr, CROP: tl.constexpr, BLOCK_C: tl.constexpr, NMETA: tl.constexpr):
        # pass 1, one program per kept source row: CROP output columns x 3 channels into the scratch
        p = tl.load(prog_ptr + tl.program_id(0))  # image << 32 | kept row
        i = p >> 32
        t = p & 0xFFFFFFFF
        m = meta_ptr + i * NMETA
        x = tl.load(m).to(tl.pointer_type(tl.uint8))
        sc, sh, sw = tl.load(m + 1), tl.load(m + 2), tl.load(m + 3)
        W, nw, left = tl.load(m + 5), tl.load(m + 7), tl.load(m + 9)
        row = x + (tl.load(m + 10) + t) * sh
        kx = tl.load(m + 13)
        scale = W.to(tl.float32) / nw.to(tl.float32)
        support = tl.maximum(scale, 1.0)  # antialias when downscaling
        inv = 1.0 / support
        c = tl.arange(0, BLOCK_C)  # output columns
        ch = tl.arange(0, 4)
        cm = c < CROP
        center = scale * ((left + c).to(tl.float32) + 0.5)  # (BLOCK_C,)
        lo = tl.maximum(tl.floor(center - support + 0.5), 0.0).to(tl.int32)
        hi = tl.minimum(tl.floor(center + support + 0.5), W.to(tl.float32)).to(tl.int32)
        acc = tl.zeros((BLOCK_C, 4), tl.float32)
        wsum = tl.zeros((BLOCK_C,), tl.float32)
        for k in range(0, kx):
            j = lo + k
            ok = (j < hi) & cm
            w = tl.where(ok, tl.maximum(1.0 - tl.abs((j.to(tl.float32) - center + 0.5) * inv), 0.0), 0.0)
            v = tl.load(row + j[:, None] * sw + ch[None, :] * sc, mask=ok[:, None] & (ch[None, :] < 3), other=0)
            acc += w[:, None] * v.to(tl.float32)
            wsum += w
        acc = acc / tl.where(wsum > 0, wsum, 1.0)[:, None]
        dst = tmp_ptr + tl.load(m + 12) + t * (CROP * 3) + c[:, None] * 3 + ch[None, :]
        tl.store(dst, acc, mask=cm[:, None] & (ch[None, :] < 3))

    @triton.jit
    def _resize_v_kernel(
        meta_ptr, tmp_ptr, out_ptr, s_on, s_or, s_oc, CROP: tl.constexpr, BLOCK_C: tl.constexpr, NMETA: tl.constexpr
    ):
        # pass 2, one program per (image, output row): the scratch rows' weighted sum, rounded to uint8
        i = tl.program_id(0)
        r = tl.program_id(1)
        m = meta_ptr + i * NMETA
        H, nh, top = tl.load(m + 4), tl.load(m + 6), tl.load(m + 8)
        row0, nrows = tl.load(m + 10), tl.load(m + 11)
        tmp = tmp_ptr + tl.load(m + 12)
        ky = tl.load(m + 14)
        scale = H.to(tl.float32) / nh.to(tl.float32)
        support = tl.maximum(scale, 1.0)
        inv = 1.0 / support
        center = scale * ((top + r).to(tl.float32) + 0.5)  # scalar
        lo = tl.maximum(tl.floor(center - support + 0.5), 0.0).to(tl.int32)
        hi = tl.minimum(tl.floor(center + support + 0.5), H.to(tl.float32)).to(tl.int32)
        c = tl.arange(0, BLOCK_C)
        ch = tl.arange(0, 4)
        cm = (c < CROP)[:, None] & (ch[None, :] < 3)
        acc = tl.zeros((BLOCK_C, 4), tl.float32)
        wsum = 0.0
        for k in range(0, ky):
            j = lo + k
            ok = (j < hi) & (j >= row0) & (j < row0 + nrows)
            w = tl.where(ok, tl.maximum(1.0 - tl.abs((j.to(tl.float32) - center + 0.5) * inv), 0.0), 0.0)
            v = tl.load(tmp + (j - row0) * (CROP * 3) + c[:, None] * 3 + ch[None, :], mask=cm & ok, other=0.0)
            acc += w * v
            wsum += w
        y = tl.minimum(tl.maximum(tl.floor(acc / wsum + 0.5), 0.0), 255.0)
        tl.store(out_ptr + i * s_on + r * s_or + c[:, None] * s_oc + ch[None, :], y.to(tl.uint8), mask=cm)


# -- the entry points ----------------------------------------------------------------------------
_FLOATS = (torch.float32, torch.float16, torch.bfloat16)


def _check(ok: bool, msg: str) -> None:
    if not ok:
        raise ValueError(msg)


def _same_device(fn: str, **tensors) -> None:
    """ValueError naming the tensors when they are not all on one device."""
    devs = {name: t.device for name, t in tensors.items() if t is not None}
    _check(
        len(set(devs.values())) <= 1,
        f"{fn}: tensors on different devices: " + ", ".join(f"{k} on {v}" for k, v in devs.items()),
    )


def _is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


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
    qkv = qkv.contiguous()
    q = torch.empty((B, h, S, d), dtype=qkv.dtype, device=qkv.device)
    assert k_cache.stride(-1) == 1 and v_cache.stride() == k_cache.stride()
    _rope_qkv_kernel[(B * S, h + 2 * hkv)](
        qkv,
        cos.contiguous(),
        sin.contiguous(),
        pos.contiguous(),
        q,
        k_cache,
        v_cache,
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


PAIRED_LAYOUT = """The fused projections keep their rows pair-interleaved: ``gate_up_proj`` as
``[gate_0, up_0, gate_1, up_1, ...]``, and each q/k/v head of ``qkv_proj`` as ``[x_0, x_{D/2}, x_1,
x_{D/2+1}, ...]`` (RoPE's rotate-half pairs side by side; :func:`llama.fuse_hf_projections` arranges
Hugging Face's weights so). A GEMV program then holds whole pairs, and gates or rotates them in its
epilogue before anything is written."""


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


#: decode attention's cache slots per split and warps per program (2 warps: faster than 4 for
#: Llama-2-7B's heads; see docs/performance.md)
ATTN_BLOCK_T, ATTN_WARPS = 64, 2


def decode_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    pos: torch.Tensor,
    row0: int,
    kv_len: int,
    counters: torch.Tensor | None = None,
) -> torch.Tensor:
    """Attention of one new token per row over its cached keys and values (decode step).

    Row ``b``'s query attends to cache slots ``0..pos[b]`` of cache row ``row0 + b`` (causal: its
    own slot included, written before this call), never past ``kv_len``. The Triton kernel reads only
    those valid slots, split along the cache in blocks of 64 slots run side by side, whose partial
    softmaxes are then merged (split-KV, "Flash-Decoding", Dao et al., 2023): with ``counters``, by
    the last split of each (row, head) to finish, counted with an atomic (one kernel); without, by a
    second kernel. Grouped-query
    attention maps query head ``h`` to key/value head ``h // (H / Hkv)``, as ``repeat_interleave``
    does. Without Triton (or for more than one query per row) it is
    ``F.scaled_dot_product_attention`` with the causal mask.

    Args:
        q: ``(B, H, S, D)``; the kernel runs for ``S == 1``.
        k_cache, v_cache: ``(maxB, Hkv, T, D)``, same dtype as ``q``.
        pos: ``(B, S)`` int64 positions of the queries (device tensor: no host sync).
        row0: first cache row. kv_len: slots that may be read (``<= T``).
        counters: optional ``(>= B*H,)`` int32 zeros on ``q``'s device, owned by the caller (the
            kernel leaves them zero again); calls that use one buffer must not run concurrently.

    Returns:
        ``(B, H, S, D)`` in ``q``'s dtype.

    Raises:
        ValueError: shapes that do not fit, head counts that do not divide, rows past the cache.
    """
    _check(
        q.dim() == 4 and k_cache.dim() == 4 and v_cache.shape == k_cache.shape,
        f"decode_attention: q must be (B, H, S, D) and the caches (maxB, Hkv, T, D), got "
        f"{tuple(q.shape)}, {tuple(k_cache.shape)}, {tuple(v_cache.shape)}",
    )
    B, H, S, D = q.shape
    hkv = k_cache.shape[1]
    _check(
        k_cache.shape[-1] == D and hkv > 0 and H % hkv == 0 and pos.shape == (B, S),
        f"decode_attention: head dim / head counts / positions do not fit: q {tuple(q.shape)}, "
        f"cache {tuple(k_cache.shape)}, pos {tuple(pos.shape)}",
    )
    _check(
        q.dtype in _FLOATS and k_cache.dtype == q.dtype == v_cache.dtype,
        f"decode_attention: q and the caches must share a float dtype, got {q.dtype}, {k_cache.dtype}, {v_cache.dtype}",
    )
    _check(
        not pos.dtype.is_floating_point and pos.dtype != torch.bool,
        f"decode_attention: pos must be an integer tensor, got {pos.dtype}",
    )
    _check(
        _is_int(row0) and _is_int(kv_len),
        f"decode_attention: row0 and kv_len must be ints, got {row0!r} and {kv_len!r}",
    )
    _check(
        0 <= row0 and row0 + B <= k_cache.shape[0] and 0 < kv_len <= k_cache.shape[2],
        f"decode_attention: rows {row0}..{row0 + B} or kv_len {kv_len} past the cache {tuple(k_cache.shape)}",
    )
    _check(
        counters is None or (counters.dtype == torch.int32 and counters.dim() == 1 and counters.numel() >= B * H),
        f"decode_attention: counters must be int32 with at least B*H = {B * H} entries",
    )
    _same_device("decode_attention", q=q, k_cache=k_cache, v_cache=v_cache, pos=pos, counters=counters)
    if S != 1 or not use_triton(q) or D & (D - 1) or k_cache.stride(-1) != 1 or v_cache.stride() != k_cache.stride():
        return decode_attention_ref(q, k_cache, v_cache, pos, row0, kv_len)
    o = torch.empty_like(q, memory_format=torch.contiguous_format)
    BLOCK_T = ATTN_BLOCK_T
    splits = triton.cdiv(kv_len, BLOCK_T)  # static per captured graph (kv_len is)
    part = torch.empty((B * H, splits, D + 2), dtype=torch.float32, device=q.device)
    merge = counters is not None
    BLOCK_S = triton.next_power_of_2(splits)
    _attention_part_kernel[(B * H, splits)](
        q.contiguous(),
        k_cache,
        v_cache,
        pos.contiguous(),
        part,
        o,
        counters if merge else part,
        row0,
        kv_len,
        H,
        H // hkv,
        splits,
        k_cache.stride(0),
        k_cache.stride(1),
        k_cache.stride(2),
        D**-0.5,
        D=D,
        BLOCK_T=BLOCK_T,
        MERGE=merge,
        BLOCK_S=BLOCK_S,
        num_warps=ATTN_WARPS,
    )
    if not merge:
        _attention_merge_kernel[(B * H,)](part, o, splits, D=D, BLOCK_S=BLOCK_S, num_warps=4)
    return o


def normalize_u8(x_u8: torch.Tensor, scale: torch.Tensor, shift: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Image normalisation from uint8 in one pass: ``x * scale[c] + shift[c]`` per channel ``c``.

    The image classifier's input step (``(x/255 - mean) / std`` with ``scale = 1/(255*std)``,
    ``shift = -mean/std``): one read of the uint8 batch and one write of the result, computed in
    float32 and rounded once. PyTorch's ``addcmul`` on a uint8 tensor and half-precision scalars goes
    through its dynamic-casting elementwise path instead, which is slower (see docs/performance.md).

    Args:
        x_u8: ``(..., C)`` uint8, channels last (NHWC images).
        scale, shift: ``(C,)`` float tensors on the same device.
        dtype: the output's float dtype.

    Returns:
        ``(..., C)`` in ``dtype``, contiguous (``permute(0, 3, 1, 2)`` of an NHWC result is the
        channels_last NCHW tensor a convolution wants).

    Raises:
        ValueError: ``x_u8`` not uint8, scale/shift not ``(C,)``, or a non-float ``dtype``.
    """
    _check(x_u8.dtype == torch.uint8 and x_u8.dim() >= 1, f"normalize_u8: x must be uint8 (..., C), got {x_u8.dtype}")
    C = x_u8.shape[-1]
    _check(
        scale.shape == (C,) and shift.shape == (C,),
        f"normalize_u8: scale and shift must be ({C},), got {tuple(scale.shape)} and {tuple(shift.shape)}",
    )
    _check(dtype in _FLOATS, f"normalize_u8: dtype must be float32/float16/bfloat16, got {dtype}")
    _check(
        scale.dtype in _FLOATS and shift.dtype in _FLOATS,
        f"normalize_u8: scale and shift must be float tensors, got {scale.dtype} and {shift.dtype}",
    )
    _same_device("normalize_u8", x=x_u8, scale=scale, shift=shift)
    if not use_triton(x_u8):
        return normalize_u8_ref(x_u8, scale, shift, dtype)
    x = x_u8.contiguous()
    y = torch.empty(x.shape, dtype=dtype, device=x.device)
    BLOCK = 4096
    _normalize_u8_kernel[(triton.cdiv(x.numel(), BLOCK),)](
        x, scale.contiguous(), shift.contiguous(), y, x.numel(), C=C, BLOCK=BLOCK, num_warps=8
    )
    return y


_RESIZE_META = 16  # int64 columns per image in resize_crop_u8's table (15 used)


def resize_crop_u8(images, out: torch.Tensor, resize: int = 256, crop: int = 224) -> None:
    """Resize (antialiased bilinear, shorter side to ``resize``) + center crop (``crop``) of a batch of
    decoded images of any mix of sizes into ``out``, in two Triton launches whatever the batch holds.

    The filter is PyTorch's (and Pillow's) antialias triangle (``aten/src/ATen/native/UpSample.h``,
    ``_compute_weights_aa``), applied separably: pass 1 filters along the width, one program per
    source row that the crop needs, into a float32 scratch of ``crop x 3`` values per row; pass 2
    filters the scratch along the height, one program per output row, and rounds to uint8. Only the
    kept rows and columns are computed, the weights are computed in the kernels, images are read in
    place through a table of pointers and strides (CHW from nvJPEG or HWC from the hardware decoder),
    and nothing is padded: the cost follows each image's own size (the matrix-product path pads a
    mixed batch to its largest image). The reference is
    :func:`fullthrottle.data.gpu_resize.resize_crop_matmul`, which runs without Triton.

    Args:
        images: ``(3, H, W)`` uint8 tensors on one device, any sizes and strides (each a dense block:
            contiguous, or a ``permute(2, 0, 1)`` view of a contiguous ``(H, W, 3)`` image).
        out: ``(len(images), crop, crop, 3)`` uint8 on that device, last dim contiguous.
        resize, crop: Resize(resize) then CenterCrop(crop), ``crop <= resize``.

    The images must stay alive until the work queued on the current stream has run (the caching
    allocator, or a stream-ordered free, guarantees that when they are freed after this call).

    Raises:
        ValueError: images not 3-channel uint8 on ``out``'s device, ``out`` of the wrong shape or dtype,
            or ``crop > resize``.
    """
    import numpy as np

    n = len(images)
    _check(0 < crop <= resize, f"resize_crop_u8: need 0 < crop <= resize, got crop={crop}, resize={resize}")
    _check(
        out.dtype == torch.uint8 and tuple(out.shape) == (n, crop, crop, 3) and out.stride(-1) == 1,
        f"resize_crop_u8: out must be uint8 ({n}, {crop}, {crop}, 3) with a contiguous last dim, "
        f"got {out.dtype} {tuple(out.shape)}",
    )
    if n == 0:
        return
    dev = out.device
    for k, im in enumerate(images):  # (a few attribute reads per image: this runs for every batch)
        if im.dtype != torch.uint8 or im.dim() != 3 or im.shape[0] != 3 or im.device != dev:
            raise ValueError(
                f"resize_crop_u8: image {k} must be a (3, H, W) uint8 tensor on {dev}, "
                f"got {im.dtype} {tuple(im.shape)} on {im.device}"
            )
    shape = np.array([im.shape for im in images], dtype=np.int64)  # (n, 3): 3, H, W
    stride = np.array([im.stride() for im in images], dtype=np.int64)  # (n, 3): c, h, w
    H, W = shape[:, 1], shape[:, 2]
    dense = ((stride[:, 2] == 1) & (stride[:, 1] == W) & (stride[:, 0] == H * W)) | (  # CHW
        (stride[:, 0] == 1) & (stride[:, 2] == 3) & (stride[:, 1] == 3 * W)
    )  # HWC viewed as CHW
    if not dense.all():
        k = int(np.argmin(dense))
        raise ValueError(f"resize_crop_u8: image {k} is not a dense CHW or HWC block (strides {images[k].stride()})")
    meta = np.zeros((n, _RESIZE_META), dtype=np.int64)
    meta[:, 0] = [im.data_ptr() for im in images]
    meta[:, 1:4] = stride
    meta[:, 4], meta[:, 5] = H, W
    H, W = H.astype(np.float64), W.astype(np.float64)
    # gpu_resize._resize_and_crop_at for the whole batch at once (the tests hold the two equal)
    tall = H > W  # torchvision Resize(int): shorter side
    nh = np.where(tall, (resize * H / W).astype(np.int64), resize)
    nw = np.where(tall, resize, (resize * W / H).astype(np.int64))
    top, left = np.round((nh - crop) / 2.0).astype(np.int64), np.round((nw - crop) / 2.0).astype(np.int64)
    sy, sx = H / nh, W / nw
    suy, sux = np.maximum(sy, 1.0), np.maximum(sx, 1.0)
    lo = np.floor(sy * (top + 0.5) - suy + 0.5) - 1  # the rows pass 2 reads (+1 each side:
    hi = np.floor(sy * (top + crop - 0.5) + suy + 0.5) + 1  # the kernels compute in float32)
    row0 = np.maximum(lo, 0).astype(np.int64)
    nrows = np.minimum(hi, H).astype(np.int64) - row0
    meta[:, 6], meta[:, 7], meta[:, 8], meta[:, 9], meta[:, 10], meta[:, 11] = nh, nw, top, left, row0, nrows
    meta[:, 12] = np.concatenate([[0], np.cumsum(nrows * crop * 3)[:-1]])
    meta[:, 13] = np.ceil(2 * sux).astype(np.int64) + 2  # taps per output, an upper bound
    meta[:, 14] = np.ceil(2 * suy).astype(np.int64) + 2
    prog = (np.repeat(np.arange(n, dtype=np.int64), nrows) << 32) | (
        np.arange(int(nrows.sum()), dtype=np.int64) - np.repeat(meta[:, 12] // (crop * 3), nrows)
    )
    table = torch.from_numpy(np.concatenate([meta.reshape(-1), prog]))
    if out.is_cuda:  # from pinned memory the copy is queued; from pageable memory it would wait for the stream
        table = table.pin_memory().to(out.device, non_blocking=True)
    tmp = torch.empty(int(nrows.sum()) * crop * 3, dtype=torch.float32, device=out.device)
    block = triton.next_power_of_2(crop)
    _resize_h_kernel[(len(prog),)](
        table, table[n * _RESIZE_META :], tmp, CROP=crop, BLOCK_C=block, NMETA=_RESIZE_META, num_warps=4
    )
    _resize_v_kernel[(n, crop)](
        table,
        tmp,
        out,
        out.stride(0),
        out.stride(1),
        out.stride(2),
        CROP=crop,
        BLOCK_C=block,
        NMETA=_RESIZE_META,
        num_warps=4,
    )


__all__ = [
    "rms_norm",
    "rope_qkv_into_cache",
    "silu_mul",
    "linear",
    "linear_silu_mul",
    "linear_rope_qkv_into_cache",
    "decode_attention",
    "normalize_u8",
    "resize_crop_u8",
    "use_triton",
    "PAIRED_LAYOUT",
    "interleave_pairs",
    "deinterleave_pairs",
    "rms_norm_ref",
    "rope_qkv_into_cache_ref",
    "silu_mul_ref",
    "linear_ref",
    "decode_attention_ref",
    "normalize_u8_ref",
]
