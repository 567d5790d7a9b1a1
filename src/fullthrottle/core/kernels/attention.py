"""Decode attention over the static KV cache, split along the cache (Flash-Decoding), with its
plain-PyTorch reference."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .common import _FLOATS, KV_FP8, _check, _is_int, _kv_dtype_ok, _same_device, tl, triton, use_triton

#: splits the merge reads at a time: it holds a (MERGE_CHUNK, D) float32 tile, whose registers count
#: for the whole kernel where the last split merges (more splits: more passes, the same registers)
MERGE_CHUNK = 8


def decode_attention_ref(q, k_cache, v_cache, pos, row0, kv_len):
    B, H, S, D = q.shape
    hkv = k_cache.shape[1]
    kc, vc = k_cache[row0 : row0 + B, :, :kv_len], v_cache[row0 : row0 + B, :, :kv_len]  # (B, Hkv, T, D)
    kc, vc = kc.to(q.dtype), vc.to(q.dtype)  # (float8 KV memory: computed in q's dtype)
    if H > hkv:
        kc, vc = kc.repeat_interleave(H // hkv, dim=1), vc.repeat_interleave(H // hkv, dim=1)
    t = torch.arange(kv_len, device=q.device)
    mask = t[None, None, None, :] <= pos[:, None, :, None]  # (B, 1, S, T): slots 0..pos
    return F.scaled_dot_product_attention(q, kc, vc, attn_mask=mask)


def gather_pages(pages: torch.Tensor, table: torch.Tensor, rows: torch.Tensor, kv_len: int) -> torch.Tensor:
    """The first ``kv_len`` positions of rows ``rows`` ``(B,)`` of paged KV memory (``pages``
    ``(num_pages, Hkv, PAGE, D)``, ``table`` ``(rows, P)`` int64) as one contiguous ``(B, Hkv, kv_len, D)``
    (a copy: the reference path)."""
    B, (_, hkv, page, d) = rows.shape[0], pages.shape
    n = -(-kv_len // page)
    got = pages[table[rows, :n]]  # (B, n, Hkv, PAGE, D)
    return got.permute(0, 2, 1, 3, 4).reshape(B, hkv, n * page, d)[:, :, :kv_len]


def decode_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    pos: torch.Tensor,
    row0: int,
    kv_len: int,
    counters: torch.Tensor | None = None,
    block_t: int = 64,
    warps: int = 2,
    per: int = 1,
) -> torch.Tensor:
    """Attention of one new token per row over its cached keys and values (decode step).

    Row ``b``'s query attends to cache slots ``0..pos[b]`` of cache row ``row0 + b`` (causal: its
    own slot included, written before this call), never past ``kv_len``. The Triton kernel reads only
    those valid slots, split along the cache in blocks of 64 slots run side by side (``per`` blocks
    to a program, with an online softmax over them), whose partial softmaxes are then merged
    (split-KV, "Flash-Decoding", Dao et al., 2023): with ``counters``, by the last split of each (row,
    head) to finish, counted with an atomic (one kernel); without, by a second kernel. One split (all
    blocks to a program) writes the output directly. Grouped-query
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
        block_t, warps: cache slots per block (a power of two) and warps per program of the Triton
            kernel (64 and 2: the fastest for Llama-2-7B's heads on an H200, docs/performance.md).
        per: blocks one program reads: 1 (the most splits) was the fastest at every batch from 8 to
            512 rows on an H200, also against one program per (row, head) reading its whole cache
            (``bench/probes/paged_attention_probe.py``, docs/performance.md).

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
    _check(
        _is_int(block_t) and block_t >= 16 and not block_t & (block_t - 1) and warps in (1, 2, 4, 8),
        f"decode_attention: block_t must be a power of two >= 16 and warps 1, 2, 4 or 8, got {block_t!r}, {warps!r}",
    )
    _check(_is_int(per) and per >= 1, f"decode_attention: per must be an int >= 1, got {per!r}")
    _same_device("decode_attention", q=q, k_cache=k_cache, v_cache=v_cache, pos=pos, counters=counters)
    if S != 1 or not use_triton(q) or D & (D - 1) or k_cache.stride(-1) != 1 or v_cache.stride() != k_cache.stride():
        return decode_attention_ref(q, k_cache, v_cache, pos, row0, kv_len)
    return _split_kv(q, k_cache, v_cache, pos, counters, None, row0, kv_len, block_t, warps, per)


def paged_decode_attention(
    q: torch.Tensor,
    k_pages: torch.Tensor,
    v_pages: torch.Tensor,
    table: torch.Tensor,
    pos: torch.Tensor,
    row0: int,
    kv_len: int,
    counters: torch.Tensor | None = None,
    warps: int | None = None,
    per: int | None = None,
    sub: int = 1,
) -> torch.Tensor:
    """:func:`decode_attention` over paged KV memory (PagedAttention, Kwon et al., 2023): row ``b``'s
    positions ``[i*PAGE, (i+1)*PAGE)`` are in page ``table[row0 + b, i]``. The Triton kernel's blocks
    are one page each (``sub`` > 1: a ``1/sub`` of a page each), read in place; the reference gathers
    the pages into one contiguous cache.

    Args:
        q: ``(B, H, S, D)``. k_pages, v_pages: ``(num_pages, Hkv, PAGE, D)``, PAGE a power of two >= 16,
            in ``q``'s dtype or float8 e4m3 (:data:`~fullthrottle.core.kernels.common.KV_FP8`: the
            kernel converts each key and value to float32 as it reads it).
        table: ``(rows, P)`` int64 page numbers, ``P * PAGE >= kv_len``. pos, row0, kv_len, counters,
            warps, per: as :func:`decode_attention`; unset: 2 warps and a page a program (bf16 pages,
            the fastest on an H200), over float8 pages 1 warp and 4 pages a program (the fastest of
            27 settings on an H100 at 256 and 512 rows: 13-14% under 2 warps and a page at positions
            128-255, 2% at 512-767; ``bench/probes/paged_attention_probe.py``, docs/performance.md).
            sub: blocks per page (a power of two, ``PAGE / sub >= 8``).

    Returns:
        ``(B, H, S, D)`` in ``q``'s dtype.

    Raises:
        ValueError: shapes that do not fit.
    """
    B, H, S, D = q.shape
    _check(
        k_pages.dim() == 4 and v_pages.shape == k_pages.shape and table.dim() == 2 and pos.shape == (B, S),
        f"paged_decode_attention: pages must be (num_pages, Hkv, PAGE, D) and the table (rows, P), got "
        f"{tuple(k_pages.shape)}, {tuple(v_pages.shape)}, {tuple(table.shape)}, pos {tuple(pos.shape)}",
    )
    page, hkv = k_pages.shape[2], k_pages.shape[1]
    _check(
        k_pages.shape[-1] == D and H % hkv == 0 and table.dtype == torch.long,
        f"paged_decode_attention: head dim / head counts / table dtype do not fit: q {tuple(q.shape)}, "
        f"pages {tuple(k_pages.shape)}, table {table.dtype}",
    )
    _check(
        _is_int(row0) and 0 <= row0 and row0 + B <= table.shape[0] and 0 < kv_len <= table.shape[1] * page,
        f"paged_decode_attention: rows {row0}..{row0 + B} or kv_len {kv_len} past the table {tuple(table.shape)}",
    )
    _check(
        q.dtype in _FLOATS and _kv_dtype_ok(k_pages, q) and v_pages.dtype == k_pages.dtype,
        f"paged_decode_attention: the pages must be in q's dtype or float8_e4m3fn, got q {q.dtype}, "
        f"pages {k_pages.dtype}, {v_pages.dtype}",
    )
    _same_device("paged_decode_attention", q=q, k_pages=k_pages, v_pages=v_pages, table=table, pos=pos)
    fp8 = k_pages.dtype == KV_FP8
    warps = warps if warps is not None else 1 if fp8 else 2
    per = per if per is not None else 4 if fp8 else 1
    _check(
        _is_int(per) and per >= 1 and warps in (1, 2, 4, 8),
        f"paged_decode_attention: per must be an int >= 1 and warps 1, 2, 4 or 8, got {per!r}, {warps!r}",
    )
    _check(
        _is_int(sub) and sub >= 1 and not sub & (sub - 1) and page // sub >= 8,
        f"paged_decode_attention: sub must be a power of two with PAGE / sub >= 8, got {sub!r} (PAGE {page})",
    )
    triton_ok = S == 1 and use_triton(q) and not D & (D - 1) and page >= 16 and not page & (page - 1)
    if not triton_ok or k_pages.stride(-1) != 1 or v_pages.stride() != k_pages.stride():
        rows = torch.arange(row0, row0 + B, device=q.device)
        kc, vc = gather_pages(k_pages, table, rows, kv_len), gather_pages(v_pages, table, rows, kv_len)
        return decode_attention_ref(q, kc, vc, pos, 0, kv_len)
    merge = counters is not None and counters.dtype == torch.int32 and counters.numel() >= B * H
    return _split_kv(
        q, k_pages, v_pages, pos, counters if merge else None, table, row0, kv_len, page // sub, warps, per, sub
    )


def _split_kv(
    q, k, v, pos, counters, table, row0: int, kv_len: int, block_t: int, warps: int, per: int, sub: int = 1
) -> torch.Tensor:
    # the Triton launch of both: splits of ``per`` blocks of block_t slots (paged: a page each, or
    # 1/sub of one, through ``table``); one split: the output written directly
    B, H, _, D = q.shape
    o = torch.empty_like(q, memory_format=torch.contiguous_format)
    blocks = triton.cdiv(kv_len, block_t)  # static per captured graph (kv_len is)
    per = min(blocks, per)
    splits = triton.cdiv(blocks, per)
    direct = splits == 1
    part = o if direct else torch.empty((B * H, splits, D + 2), dtype=torch.float32, device=q.device)
    merge = counters is not None and not direct
    BLOCK_S = min(triton.next_power_of_2(splits), MERGE_CHUNK)  # (splits merged at a time)
    paged = table is not None
    pos = pos.contiguous()
    _attention_part_kernel[(B * H, splits)](
        q.contiguous(),
        k,
        v,
        pos,
        part,
        o,
        counters if merge else part,
        table if paged else pos,  # (no table: never read)
        table.stride(0) if paged else 0,
        row0,
        kv_len,
        H,
        H // k.shape[1],
        splits,
        k.stride(0),
        k.stride(1),
        k.stride(2),
        D**-0.5,
        D=D,
        BLOCK_T=block_t,
        PER=per,
        MERGE=merge,
        DIRECT=direct,
        BLOCK_S=BLOCK_S,
        PAGED=paged,
        SUB=sub,
        num_warps=warps,
    )
    if not merge and not direct:
        _attention_merge_kernel[(B * H,)](
            part, o, pos, kv_len, H, splits, D=D, BLOCK_T=block_t, PER=per, BLOCK_S=BLOCK_S, num_warps=4
        )
    return o


if triton is not None:

    @triton.jit
    def _attention_part_kernel(
        q_ptr,
        kc_ptr,
        vc_ptr,
        pos_ptr,
        part_ptr,
        o_ptr,
        cnt_ptr,
        table_ptr,
        table_stride,
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
        PER: tl.constexpr,
        MERGE: tl.constexpr,
        DIRECT: tl.constexpr,
        BLOCK_S: tl.constexpr,
        PAGED: tl.constexpr,
        SUB: tl.constexpr,
    ):
        # split-KV decode attention, part 1: program (row*head, split) takes the PER blocks of
        # BLOCK_T cache slots [split*PER*BLOCK_T, (split+1)*PER*BLOCK_T) of the valid 0..pos, with
        # an online softmax over them, and leaves (acc[D], max, sum); DIRECT (one split): the output.
        # PAGED: block j is part j % SUB of page table[row, j // SUB] (BLOCK_T == PAGE / SUB), c_b its stride
        bh = tl.program_id(0)
        sp = tl.program_id(1)
        b = bh // H
        h = bh % H
        # the splits past the row's end (the grid is sized for the longest row) store nothing and take
        # no part in the merge
        n, active = _row_splits(pos_ptr, b, T, BLOCK_T, PER)
        if sp < active:
            _attention_split(
                q_ptr, kc_ptr, vc_ptr, part_ptr, o_ptr, cnt_ptr, table_ptr, table_stride, row0, n, bh, sp, b, h,
                REP, SPLITS, active, c_b, c_h, c_t, sm_scale, D, BLOCK_T, PER, MERGE, DIRECT, BLOCK_S, PAGED, SUB,
            )  # fmt: skip

    @triton.jit
    def _row_splits(pos_ptr, b, T, BLOCK_T: tl.constexpr, PER: tl.constexpr):
        # row b's valid slots (0..pos, never past T) and the splits that hold some (>= 1)
        n = tl.minimum(tl.load(pos_ptr + b) + 1, T)
        return n, tl.cdiv(tl.cdiv(n, BLOCK_T), PER)

    @triton.jit
    def _attention_split(
        q_ptr, kc_ptr, vc_ptr, part_ptr, o_ptr, cnt_ptr, table_ptr, table_stride, row0, n, bh, sp, b, h,
        REP, SPLITS, active, c_b, c_h, c_t, sm_scale, D: tl.constexpr, BLOCK_T: tl.constexpr, PER: tl.constexpr,
        MERGE: tl.constexpr, DIRECT: tl.constexpr, BLOCK_S: tl.constexpr, PAGED: tl.constexpr, SUB: tl.constexpr,
    ):  # fmt: skip
        # one split of a row's valid slots (``active`` of them hold some)
        d = tl.arange(0, D)
        q = tl.load(q_ptr + bh * D + d).to(tl.float32) * sm_scale
        first = sp * PER
        blocks = tl.minimum(PER, tl.cdiv(n, BLOCK_T) - first)  # (>= 1: an active split)
        m_i = tl.full((), float("-inf"), tl.float32)
        l_i = tl.zeros((), tl.float32)
        acc = tl.zeros((D,), tl.float32)
        slot = tl.arange(0, BLOCK_T)
        for j in range(0, blocks):
            t = (first + j) * BLOCK_T + slot
            mt = t < n
            if PAGED:
                page = tl.load(table_ptr + (row0 + b).to(tl.int64) * table_stride + (first + j) // SUB)
                in_page = ((first + j) % SUB) * BLOCK_T + slot  # (SUB 1: slot)
                off = page * c_b + (h // REP) * c_h + in_page[:, None].to(tl.int64) * c_t + d[None, :]
            else:
                off = (row0 + b).to(tl.int64) * c_b + (h // REP) * c_h + t[:, None].to(tl.int64) * c_t + d[None, :]
            k = tl.load(kc_ptr + off, mask=mt[:, None], other=0.0).to(tl.float32)  # (BLOCK_T, D)
            sc = tl.where(mt, tl.sum(k * q[None, :], axis=1), float("-inf"))
            m_new = tl.maximum(m_i, tl.max(sc, axis=0))  # (finite: every block read holds a valid slot)
            alpha = tl.exp(m_i - m_new)
            p = tl.exp(sc - m_new)  # 0 where masked
            # (the values loaded once the keys are used: one (BLOCK_T, D) tile in registers at a time)
            v = tl.load(vc_ptr + off, mask=mt[:, None], other=0.0).to(tl.float32)
            l_i = l_i * alpha + tl.sum(p, axis=0)
            acc = acc * alpha + tl.sum(p[:, None] * v, axis=0)
            m_i = m_new
        if DIRECT:
            tl.store(o_ptr + bh * D + d, (acc / l_i).to(o_ptr.dtype.element_ty))
        else:
            out = part_ptr + (bh * SPLITS + sp) * (D + 2)
            tl.store(out + d, acc)
            tl.store(out + D, m_i)
            tl.store(out + D + 1, l_i)
            if MERGE:  # the last split of this (row, head) to finish merges them all: no second kernel
                tl.debug_barrier()  # every thread's partial is stored
                done = tl.atomic_add(cnt_ptr + bh, 1, sem="acq_rel")  # release ours, acquire the others'
                if done == active - 1:
                    _merge_splits(part_ptr, o_ptr, bh, SPLITS, active, D, BLOCK_S)
                    tl.store(cnt_ptr + bh, 0)  # ready for the next call / replay

    @triton.jit
    def _merge_splits(part_ptr, o_ptr, bh, SPLITS, active, D: tl.constexpr, BLOCK_S: tl.constexpr):
        # merge the ``active`` splits' partial softmaxes (Dao et al., 2023, "Flash-Decoding"), BLOCK_S
        # at a time with a running max (the registers of a (BLOCK_S, D) tile, however many splits);
        # .cg: read the other programs' partials from L2, never a stale L1 line
        d = tl.arange(0, D)
        m_run = tl.full((), float("-inf"), tl.float32)
        l_run = tl.zeros((), tl.float32)
        acc_run = tl.zeros((D,), tl.float32)
        for c in range(0, tl.cdiv(active, BLOCK_S)):
            sidx = c * BLOCK_S + tl.arange(0, BLOCK_S)
            ms = sidx < active
            base = part_ptr + (bh * SPLITS + sidx) * (D + 2)
            m = tl.load(base + D, mask=ms, other=float("-inf"), cache_modifier=".cg")
            l_ = tl.load(base + D + 1, mask=ms, other=0.0, cache_modifier=".cg")
            acc = tl.load(base[:, None] + d[None, :], mask=ms[:, None], other=0.0, cache_modifier=".cg")
            m_new = tl.maximum(m_run, tl.max(m, axis=0))  # (finite: each chunk holds an active split)
            alpha = tl.exp(m_run - m_new)
            w = tl.exp(m - m_new)  # 0 where masked
            l_run = l_run * alpha + tl.sum(w * l_, axis=0)
            acc_run = acc_run * alpha + tl.sum(w[:, None] * acc, axis=0)
            m_run = m_new
        tl.store(o_ptr + bh * D + d, (acc_run / l_run).to(o_ptr.dtype.element_ty))

    @triton.jit
    def _attention_merge_kernel(
        part_ptr, o_ptr, pos_ptr, T, H, SPLITS, D: tl.constexpr, BLOCK_T: tl.constexpr, PER: tl.constexpr,
        BLOCK_S: tl.constexpr,
    ):  # fmt: skip
        # part 2 (when no counters are given): one program per (row, head), over the row's active splits
        bh = tl.program_id(0)
        _, active = _row_splits(pos_ptr, bh // H, T, BLOCK_T, PER)
        _merge_splits(part_ptr, o_ptr, bh, SPLITS, active, D, BLOCK_S)
