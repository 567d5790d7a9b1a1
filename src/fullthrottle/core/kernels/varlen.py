"""Variable-length prefill attention: the tokens of many prompts (or prompt chunks) packed into one
sequence with no padding between them, each attending causally to its own row of the KV cache
(static or paged), with its plain-PyTorch reference.

A packed forward holds N segments. Segment ``i`` is tokens ``[cu[i], cu[i+1])`` of the packed
sequence, at positions ``start[i] .. start[i] + L_i - 1`` of cache row ``rows[i]``; its keys and
values (those of earlier chunks, and its own, written before this call) are read from that row. As
FlashAttention-2's varlen kernels (Dao, 2023) take ``cu_seqlens``, the Triton kernel here takes the
segments' offsets, and runs one program per (block of one segment's queries, head).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .attention import gather_pages
from .common import _FLOATS, _check, _kv_dtype_ok, _same_device, tl, triton, use_triton

#: queries per program of the Triton kernel (a segment's queries are cut into blocks of this many)
BLOCK_M = 64


def query_blocks(lengths: list[int], block_m: int = BLOCK_M) -> tuple[list[int], list[int]]:
    """The kernel's grid for segments of ``lengths`` tokens: per program, its segment and its first
    query within it.

    >>> query_blocks([3, 0, 130], 64)
    ([0, 2, 2, 2], [0, 0, 64, 128])
    """
    seg, m0 = [], []
    for i, n in enumerate(lengths):
        for m in range(0, n, block_m):
            seg.append(i)
            m0.append(m)
    return seg, m0


def max_query_blocks(tokens: int, segments: int, block_m: int = BLOCK_M) -> int:
    """Most programs :func:`query_blocks` gives for ``tokens`` tokens in at most ``segments`` segments
    (the size of a CUDA graph's static grid)."""
    return -(-tokens // block_m) + min(segments, tokens)


def prefill_kernel_fits(head_dim: int, page: int | None = None) -> bool:
    """Whether :func:`prefill_attention`'s Triton kernel takes heads of ``head_dim`` (a power of two
    >= 16) and, paged, pages of ``page`` tokens (a power of two); else the reference runs, which reads
    the segments to the host and so cannot be captured in a CUDA graph."""
    return head_dim >= 16 and not head_dim & (head_dim - 1) and (page is None or not page & (page - 1))


def prefill_attention_ref(q, k_cache, v_cache, rows, start, cu, table=None) -> torch.Tensor:
    """:func:`prefill_attention` in plain PyTorch, one segment at a time (reads its values to the host)."""
    T, H, D = q.shape
    o = torch.zeros(T, H, D, dtype=q.dtype, device=q.device)
    cu_h, start_h, rows_h = cu.tolist(), start.tolist(), rows.tolist()
    for i, row in enumerate(rows_h):
        a, b, s = cu_h[i], cu_h[i + 1], start_h[i]
        if b == a:
            continue
        n = s + b - a  # keys: the row's positions [0, n)
        if table is None:
            kc, vc = k_cache[row, :, :n], v_cache[row, :, :n]  # (Hkv, n, D)
        else:
            r = torch.tensor([row], device=q.device)
            kc, vc = gather_pages(k_cache, table, r, n)[0], gather_pages(v_cache, table, r, n)[0]
        kc, vc = kc.to(q.dtype), vc.to(q.dtype)  # (float8 KV memory: computed in q's dtype)
        if H > kc.shape[0]:  # grouped-query attention
            kc, vc = kc.repeat_interleave(H // kc.shape[0], dim=0), vc.repeat_interleave(H // kc.shape[0], dim=0)
        qpos = s + torch.arange(b - a, device=q.device)
        mask = torch.arange(n, device=q.device)[None, :] <= qpos[:, None]  # (L, n): causal
        o[a:b] = F.scaled_dot_product_attention(q[a:b].transpose(0, 1), kc, vc, attn_mask=mask).transpose(0, 1)
    return o


def prefill_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    rows: torch.Tensor,
    start: torch.Tensor,
    cu: torch.Tensor,
    blk_seg: torch.Tensor | None = None,
    blk_m0: torch.Tensor | None = None,
    table: torch.Tensor | None = None,
    block_n: int = 64,
    warps: int = 4,
) -> torch.Tensor:
    """Causal attention of packed segments' queries over their rows of the KV cache.

    Args:
        q: ``(T, H, D)`` queries, rotated (last dim contiguous; any other strides).
        k_cache, v_cache: static ``(rows, Hkv, S, D)``, or with ``table`` pages ``(num_pages, Hkv, PAGE, D)``;
            each segment's keys and values already written at its positions; in ``q``'s dtype, or
            float8 e4m3 (converted to ``q``'s dtype as they are read).
        rows: ``(N,)`` int cache row of each segment. start: ``(N,)`` int position of its first token.
        cu: ``(N+1,)`` int offsets of the segments in the packed sequence, ``cu[0] == 0``; tokens past
            ``cu[N]`` (a CUDA graph's padding) belong to none and their output is 0.
        blk_seg, blk_m0: ``(NB,)`` int32 the Triton kernel's grid, :func:`query_blocks` of the
            segments' lengths (entries past them: segment -1, skipped); made here when None.
        table: paged KV memory's block table ``(rows, P)`` int64, or None (static cache).
        block_n, warps: keys per inner step (a power of two >= 16) and warps per program.

    Returns:
        ``(T, H, D)`` in ``q``'s dtype. Without Triton, :func:`prefill_attention_ref`.

    Raises:
        ValueError: shapes, dtypes or head counts that do not fit.
    """
    _check(
        q.dim() == 3 and k_cache.dim() == 4 and v_cache.shape == k_cache.shape,
        f"prefill_attention: q must be (T, H, D) and the caches 4-d, got {tuple(q.shape)}, "
        f"{tuple(k_cache.shape)}, {tuple(v_cache.shape)}",
    )
    T, H, D = q.shape
    hkv = k_cache.shape[1]
    N = rows.shape[0]
    _check(
        k_cache.shape[-1] == D and H % hkv == 0 and start.shape == (N,) and cu.shape == (N + 1,),
        f"prefill_attention: head dim / head counts / segments do not fit: q {tuple(q.shape)}, cache "
        f"{tuple(k_cache.shape)}, rows {tuple(rows.shape)}, start {tuple(start.shape)}, cu {tuple(cu.shape)}",
    )
    _check(
        q.dtype in _FLOATS and _kv_dtype_ok(k_cache, q) and v_cache.dtype == k_cache.dtype,
        f"prefill_attention: the caches must be in q's float dtype or float8_e4m3fn, got q {q.dtype}, "
        f"caches {k_cache.dtype}, {v_cache.dtype}",
    )
    _check(
        table is None or (table.dim() == 2 and table.dtype == torch.long),
        "prefill_attention: table must be a (rows, P) int64 tensor",
    )
    _same_device("prefill_attention", q=q, k_cache=k_cache, v_cache=v_cache, rows=rows, cu=cu, table=table)
    page = k_cache.shape[2]
    triton_ok = use_triton(q) and prefill_kernel_fits(D, None if table is None else page)
    if not triton_ok or q.stride(-1) != 1 or k_cache.stride(-1) != 1 or v_cache.stride() != k_cache.stride():
        return prefill_attention_ref(q, k_cache, v_cache, rows, start, cu, table)
    if blk_seg is None:
        seg, m0 = query_blocks(torch.diff(cu).tolist())
        blk_seg = torch.tensor(seg or [-1], dtype=torch.int32, device=q.device)
        blk_m0 = torch.tensor(m0 or [0], dtype=torch.int32, device=q.device)
    o = torch.zeros(T, H, D, dtype=q.dtype, device=q.device)
    paged = table is not None
    _prefill_kernel[(blk_seg.shape[0], H)](
        q,
        k_cache,
        v_cache,
        o,
        rows,
        start,
        cu,
        blk_seg,
        blk_m0,
        table if paged else rows,  # (no table: never read)
        table.stride(0) if paged else 0,
        q.stride(0),
        q.stride(1),
        H * D,
        k_cache.stride(0),
        k_cache.stride(1),
        k_cache.stride(2),
        H // hkv,
        D**-0.5 * 1.4426950408889634,  # (log2 e: the kernel's softmax is in base 2)
        D=D,
        BLOCK_M=BLOCK_M,
        BLOCK_N=block_n,
        PAGE=page,
        PAGED=paged,
        PRECISION="ieee" if q.dtype == torch.float32 else "tf32",  # (float32: no TF32 rounding)
        num_warps=warps,
    )
    return o


if triton is not None:

    @triton.jit
    def _prefill_kernel(
        q_ptr,
        k_ptr,
        v_ptr,
        o_ptr,
        rows_ptr,
        start_ptr,
        cu_ptr,
        blk_seg_ptr,
        blk_m0_ptr,
        table_ptr,
        table_stride,
        q_t,
        q_h,
        o_t,
        c_b,
        c_h,
        c_t,
        REP,
        qk_scale,
        D: tl.constexpr,
        BLOCK_M: tl.constexpr,
        BLOCK_N: tl.constexpr,
        PAGE: tl.constexpr,
        PAGED: tl.constexpr,
        PRECISION: tl.constexpr,
    ):
        # program (block, head): queries [m0, m0 + BLOCK_M) of one segment, online softmax over its
        # keys 0 .. its last query's position (FlashAttention-2's forward loop, causal)
        seg = tl.load(blk_seg_ptr + tl.program_id(0))
        if seg < 0:
            return
        h = tl.program_id(1)
        m0 = tl.load(blk_m0_ptr + tl.program_id(0))
        q0 = tl.load(cu_ptr + seg)
        length = tl.load(cu_ptr + seg + 1) - q0
        first = tl.load(start_ptr + seg)
        row = tl.load(rows_ptr + seg).to(tl.int64)
        m = m0 + tl.arange(0, BLOCK_M)
        mm = m < length
        d = tl.arange(0, D)
        q_off = (q0 + m)[:, None].to(tl.int64) * q_t + h * q_h + d[None, :]
        q = tl.load(q_ptr + q_off, mask=mm[:, None], other=0.0)  # (BLOCK_M, D)
        qpos = first + m
        kv_end = (first + tl.minimum(m0 + BLOCK_M, length)).to(tl.int32)  # keys this block reads: [0, kv_end)
        acc = tl.zeros((BLOCK_M, D), dtype=tl.float32)
        m_i = tl.full((BLOCK_M,), float("-inf"), dtype=tl.float32)
        l_i = tl.zeros((BLOCK_M,), dtype=tl.float32)
        hk = (h // REP).to(tl.int64) * c_h
        for n0 in range(0, kv_end, BLOCK_N):
            kpos = n0 + tl.arange(0, BLOCK_N)
            mk = kpos < kv_end
            if PAGED:
                pg = tl.load(table_ptr + row * table_stride + kpos // PAGE, mask=mk, other=0)
                k_off = pg * c_b + hk + (kpos % PAGE).to(tl.int64) * c_t
            else:
                k_off = row * c_b + hk + kpos.to(tl.int64) * c_t
            k = tl.load(k_ptr + k_off[:, None] + d[None, :], mask=mk[:, None], other=0.0).to(q.dtype)  # (BLOCK_N, D)
            s = tl.dot(q, tl.trans(k), input_precision=PRECISION) * qk_scale  # (BLOCK_M, BLOCK_N), base-2 logits
            s = tl.where((kpos[None, :] <= qpos[:, None]) & mk[None, :], s, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s, axis=1))  # (key 0 is in every block's first step: finite)
            p = tl.exp2(s - m_new[:, None])
            alpha = tl.exp2(m_i - m_new)
            l_i = l_i * alpha + tl.sum(p, axis=1)
            v = tl.load(v_ptr + k_off[:, None] + d[None, :], mask=mk[:, None], other=0.0).to(q.dtype)
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
            m_i = m_new
        out = acc / l_i[:, None]
        o_off = (q0 + m)[:, None].to(tl.int64) * o_t + h * D + d[None, :]
        tl.store(o_ptr + o_off, out.to(o_ptr.dtype.element_ty), mask=mm[:, None])
