"""The fused kernels (src/fullthrottle/core/kernels/) against their plain-PyTorch references.

On CPU, Triton's interpreter (``TRITON_INTERPRET=1``, set in a child process before Triton is
imported) runs the very kernels that run on the GPU, so their indexing is checked in CI; the
``gpu`` test runs them compiled, in bf16.
"""

import os
import subprocess
import sys
import textwrap

import pytest
import torch

from fullthrottle.workloads.classify.transform import TORCHVISION_IMAGENET

CHECK = textwrap.dedent("""
    import torch
    from fullthrottle.core import kernels as K

    def check(dtype, device, tol):
        g = torch.Generator(device="cpu").manual_seed(0)
        def rnd(*shape):
            return torch.randn(*shape, generator=g).to(device, dtype)
        assert K.use_triton(rnd(1))
        # RMSNorm, with and without a residual; N not a power of two
        for N in (64, 96):
            x, r, w = rnd(3, 2, N), rnd(3, 2, N), rnd(N)
            y = K.rms_norm(x, w, 1e-5)
            ref = K.rms_norm_ref(x.float(), w.float(), 1e-5)
            assert y.shape == x.shape and y.dtype == dtype
            assert torch.allclose(y.float(), ref, atol=tol, rtol=tol), (y.float() - ref).abs().max()
            s, y = K.rms_norm(x, w, 1e-5, residual=r)
            s_ref, y_ref = K.rms_norm_ref(x.float(), w.float(), 1e-5, residual=r.float())
            assert torch.allclose(s.float(), s_ref, atol=tol, rtol=tol)
            assert torch.allclose(y.float(), y_ref, atol=tol, rtol=tol)
        # RoPE + cache write: B=3, S=2, H=4, Hkv=2, D=16, cache rows 5, T=8, written at rows 1..3
        B, S, H, Hkv, D = 3, 2, 4, 2, 16
        qkv = rnd(B, S, (H + 2 * Hkv) * D)
        pos = torch.tensor([[0, 1], [5, 6], [3, 7]], device=device)
        ang = pos[..., None].float() * (1.0 / 10000 ** (torch.arange(0, D, 2, device=device).float() / D))
        cos, sin = ang.cos(), ang.sin()
        kc, vc = rnd(5, Hkv, 8, D), rnd(5, Hkv, 8, D)
        kc_ref, vc_ref = kc.float().clone(), vc.float().clone()
        q = K.rope_qkv_into_cache(qkv, cos, sin, pos, kc, vc, 1, H, Hkv)
        q_ref = K.rope_qkv_into_cache_ref(qkv.float(), cos, sin, pos, kc_ref, vc_ref, 1, H, Hkv)
        assert q.shape == (B, H, S, D) and q.dtype == dtype
        assert torch.allclose(q.float(), q_ref, atol=tol, rtol=tol), (q.float() - q_ref).abs().max()
        assert torch.allclose(kc.float(), kc_ref, atol=tol, rtol=tol)   # rows 0 and 4 untouched, too
        assert torch.equal(vc.float(), vc_ref)                          # v is copied, not rounded
        # SwiGLU gate, I not a multiple of the block
        gu = rnd(2, 3, 2 * 1500)
        out = K.silu_mul(gu)
        ref = K.silu_mul_ref(gu.float())
        assert out.shape == (2, 3, 1500) and torch.allclose(out.float(), ref, atol=tol, rtol=tol)
        # batch-1 GEMV (odd N and K: partial blocks) and, with more rows, F.linear
        for N, Kd in ((300, 200), (40, 1100)):
            w, x = rnd(N, Kd), rnd(1, 1, Kd)
            y = K.linear(x, w)
            ref = x.float() @ w.float().T
            assert y.shape == (1, 1, N) and y.dtype == dtype
            assert torch.allclose(y.float(), ref, atol=tol * 10, rtol=tol), (y.float() - ref).abs().max()
        x3 = rnd(3, Kd)
        assert torch.equal(K.linear(x3, w), torch.nn.functional.linear(x3, w))  # several rows: F.linear
        # SwiGLU in the gate/up GEMV's epilogue (one row; I = 12 pairs blocks of 4), and with several rows
        w, x = rnd(2 * 12, 200), rnd(1, 1, 200)
        ref = K.silu_mul_ref(x.float() @ w.float().T)
        y = K.linear_silu_mul(x, w)
        assert y.shape == (1, 1, 12) and y.dtype == dtype
        assert torch.allclose(y.float(), ref, atol=tol * 10, rtol=tol), (y.float() - ref).abs().max()
        x3 = rnd(3, 200)
        assert torch.equal(K.linear_silu_mul(x3, w), K.silu_mul(torch.nn.functional.linear(x3, w)))
        # q/k/v projection + RoPE + cache write in one GEMV (one token at cache row 2, position 5)
        H, Hkv, D, dim = 4, 2, 16, 40
        w, x = rnd((H + 2 * Hkv) * D, dim), rnd(1, 1, dim)
        pos = torch.tensor([[5]], device=device)
        ang = pos[..., None].float() * (1.0 / 10000 ** (torch.arange(0, D, 2, device=device).float() / D))
        cos, sin = ang.cos(), ang.sin()
        kc, vc = rnd(4, Hkv, 8, D), rnd(4, Hkv, 8, D)
        kc_ref, vc_ref, kc0 = kc.float().clone(), vc.float().clone(), kc.clone()
        q = K.linear_rope_qkv_into_cache(x, w, cos, sin, pos, kc, vc, 2, H, Hkv)
        q_ref = K.rope_qkv_into_cache_ref(x.float() @ w.float().T, cos, sin, pos, kc_ref, vc_ref, 2, H, Hkv)
        assert q.shape == (1, H, 1, D) and q.dtype == dtype
        assert torch.allclose(q.float(), q_ref, atol=tol * 10, rtol=tol), (q.float() - q_ref).abs().max()
        assert torch.allclose(kc.float(), kc_ref, atol=tol * 10, rtol=tol)   # only row 2, slot 5 changed
        assert torch.allclose(vc.float(), vc_ref, atol=tol * 10, rtol=tol)
        changed = (kc != kc0).any(-1)                                        # (rows, Hkv, T)
        assert changed[2, :, 5].all() and changed.sum() == Hkv
        # the same into paged KV memory: tokens of rows 3 and 1 at positions 5, 17 (pages of 16 through
        # a table), in the model's dtype and as float8 (saturated: values past 448 stay finite)
        qkv = rnd(2, 1, (H + 2 * Hkv) * D) * 1000
        cos2, sin2 = torch.cat([cos, cos]), torch.cat([sin, sin])
        pos2, rows2 = torch.tensor([[5], [17]], device=device), torch.tensor([[3], [1]], device=device)
        table = torch.tensor([[0, 0], [4, 2], [0, 0], [1, 3]], device=device)
        for pdt in (dtype, torch.float8_e4m3fn):
            pk, pv = torch.zeros(5, Hkv, 16, D, device=device).to(pdt), torch.zeros(5, Hkv, 16, D, device=device).to(pdt)
            rk, rv = pk.clone(), pv.clone()
            q = K.rope_qkv_into_pages(qkv, cos2, sin2, pos2, pk, pv, table, rows2, H, Hkv)
            q_ref = K.rope_qkv_into_pages_ref(qkv.float(), cos2, sin2, pos2, rk.float(), rv.float(), table, rows2, H, Hkv)
            assert q.dtype == dtype and torch.allclose(q.float(), q_ref, atol=tol * 100, rtol=tol)
            ref_k = K.rope_qkv_into_pages_ref(qkv, cos2, sin2, pos2, rk, rv, table, rows2, H, Hkv) is not None and rk
            # (float8: a rotated value's rounding may differ by one step; Triton 3.8's interpreter rounds a
            # value that rounds up to a power of two to half of it, 125.5 -> 64: exact on the GPU only)
            ulp = tol * 4 if pdt == dtype else 0.13 if device != "cpu" else 0.51
            assert torch.allclose(pk.float(), ref_k.float(), atol=tol * 100, rtol=ulp)
            assert torch.allclose(pv.float(), rv.float(), atol=tol * 100, rtol=ulp)
            written = (pk.float() != 0).any(-1)          # (pages, Hkv, 16): page 1 slot 5, page 2 slot 1 only
            assert written[1, :, 5].all() and written[2, :, 1].all() and written.sum() == 2 * Hkv
            assert pk.float().isfinite().all() and (pdt == dtype or pk.float().abs().max() == 448)
        # decode attention: 3 rows at cache rows 1..3, GQA (4 query heads over 2 kv heads); a short
        # cache (one split) and a long one (3 splits of 64 slots, positions on both sides of a split)
        B, H, Hkv, D = 3, 4, 2, 16
        q = rnd(B, H, 1, D)
        for T, kv_len, ps in ((8, 7, (0, 5, 6)), (160, 150, (0, 64, 149))):
            kc, vc = rnd(5, Hkv, T, D), rnd(5, Hkv, T, D)
            pos = torch.tensor(ps, device=device)[:, None]
            ref = K.decode_attention_ref(q.float(), kc.float(), vc.float(), pos, 1, kv_len)
            counters = torch.zeros(B * H + 3, dtype=torch.int32, device=device)
            for merge in (None, counters, counters):   # merge kernel; merged by the last split, twice
                o = K.decode_attention(q, kc, vc, pos, 1, kv_len, merge)
                assert o.shape == (B, H, 1, D) and o.dtype == dtype
                assert torch.allclose(o.float(), ref, atol=tol, rtol=tol), (o.float() - ref).abs().max()
                assert not counters.any()              # left zero for the next call
            o = K.decode_attention(q, kc, vc, pos, 1, kv_len, counters, block_t=32, warps=4)  # other splits
            assert torch.allclose(o.float(), ref, atol=tol, rtol=tol), (o.float() - ref).abs().max()
            for per in (2, 3):  # blocks of 64 per program: 2 splits (one empty for position 0); no split
                for merge in (None, counters):
                    o = K.decode_attention(q, kc, vc, pos, 1, kv_len, merge, per=per)
                    assert torch.allclose(o.float(), ref, atol=tol, rtol=tol), (per, (o.float() - ref).abs().max())
                    assert not counters.any()
        # paged decode attention: the same rows as pages of 16 positions, in scattered pages, found
        # through a block table; unused entries point to page 0, which holds noise never read
        page, P = 16, 10
        pages_k, pages_v = rnd(40, Hkv, page, D), rnd(40, Hkv, page, D)
        table = torch.zeros(5, P, dtype=torch.long, device=device)
        table[1:4] = torch.randperm(39, generator=g)[: 3 * P].view(3, P).to(device) + 1
        kc = pages_k[table].permute(0, 2, 1, 3, 4).reshape(5, Hkv, P * page, D)   # (rows, Hkv, T, D)
        vc = pages_v[table].permute(0, 2, 1, 3, 4).reshape(5, Hkv, P * page, D)
        rows = torch.tensor([1, 2, 3], device=device)
        assert torch.equal(K.gather_pages(pages_k, table, rows, 150), kc[1:4, :, :150])
        pos = torch.tensor([0, 64, 149], device=device)[:, None]
        ref = K.decode_attention_ref(q.float(), kc.float(), vc.float(), pos, 1, 150)
        counters = torch.zeros(B * H, dtype=torch.int32, device=device)
        for merge in (None, counters):
            # a page per program (10 splits), 4 (3 splits), every page (no split); half a page (20 splits),
            # 3 halves (7 splits), every half (no split)
            for per, sub in ((1, 1), (4, 1), (10, 1), (1, 2), (3, 2), (20, 2)):
                o = K.paged_decode_attention(q, pages_k, pages_v, table, pos, 1, 150, merge, per=per, sub=sub)
                assert o.shape == (B, H, 1, D) and o.dtype == dtype
                assert torch.allclose(o.float(), ref, atol=tol, rtol=tol), (per, sub, (o.float() - ref).abs().max())
        # variable-length prefill attention: pieces packed end to end (5 tokens from position 0, an
        # empty one, 70 from 0: two query blocks, 17 from position 20: a chunk reading earlier keys) and
        # 6 padding tokens, over the static rows above and over the same rows as pages
        cu = torch.tensor([0, 5, 5, 75, 92], device=device)
        qp = rnd(98, H, D)
        args = (torch.tensor([2, 1, 3, 1], device=device), torch.tensor([0, 3, 0, 20], device=device), cu)
        ref = K.prefill_attention_ref(qp.float(), kc.float(), vc.float(), *args)
        for bn in (16, 64):
            o = K.prefill_attention(qp, kc, vc, *args, block_n=bn)
            assert o.shape == qp.shape and o.dtype == dtype and not o[92:].any()
            assert torch.allclose(o.float(), ref, atol=tol * 2, rtol=tol), (o.float() - ref).abs().max()
        o = K.prefill_attention(qp, pages_k, pages_v, *args, table=table)
        assert torch.allclose(o.float(), ref, atol=tol * 2, rtol=tol), (o.float() - ref).abs().max()
        from fullthrottle.core.kernels.varlen import query_blocks
        seg, m0 = query_blocks([5, 0, 70, 17])   # the grid as a graph's static buffer holds it: unused blocks -1
        grid = [torch.tensor(v + [f] * 4, device=device) for v, f in ((seg, -1), (m0, 0))]
        o = K.prefill_attention(qp, pages_k, pages_v, *args, *grid, table=table)
        assert torch.allclose(o.float(), ref, atol=tol * 2, rtol=tol), (o.float() - ref).abs().max()
        # float8 e4m3 pages: the kernels read each key and value as float8 and compute as with the
        # same values rounded to float8 and held in q's dtype
        f8k, f8v = pages_k.to(torch.float8_e4m3fn), pages_v.to(torch.float8_e4m3fn)
        assert (f8k.float() != pages_k.float()).any()                           # (the rounding is real)
        r8k, r8v = f8k.to(dtype), f8v.to(dtype)
        pos = torch.tensor([0, 64, 149], device=device)[:, None]
        for per, sub in ((None, 1), (1, 1), (4, 1), (1, 2)):  # (None: float8's default, 4 pages and 1 warp)
            o = K.paged_decode_attention(q, f8k, f8v, table, pos, 1, 150, counters, per=per, sub=sub)
            want = K.paged_decode_attention(q, r8k, r8v, table, pos, 1, 150, counters, per=per or 1)
            assert o.dtype == dtype and torch.allclose(o.float(), want.float(), atol=tol, rtol=tol), (o.float() - want.float()).abs().max()
        o = K.prefill_attention(qp, f8k, f8v, *args, table=table)
        want = K.prefill_attention(qp, r8k, r8v, *args, table=table)
        assert o.dtype == dtype and torch.allclose(o.float(), want.float(), atol=tol * 2, rtol=tol), (o.float() - want.float()).abs().max()
        # image normalisation from uint8 NHWC, a size not a multiple of the block, every byte value
        x8 = torch.arange(5 * 7 * 11 * 3, device=device).remainder(256).to(torch.uint8).view(5, 7, 11, 3)
        scale = torch.tensor([0.0171, 0.0175, 0.0174], device=device).to(dtype)
        shift = torch.tensor([-2.118, -2.036, -1.804], device=device).to(dtype)
        y = K.normalize_u8(x8, scale, shift, dtype)
        ref = x8.float() * scale.float() + shift.float()                 # per channel, the last dim
        assert y.shape == x8.shape and y.dtype == dtype
        assert torch.allclose(y.float(), ref, atol=tol, rtol=tol), (y.float() - ref).abs().max()
        # the reference (what runs without Triton) computes the same (it may fuse the multiply-add)
        assert torch.allclose(K.normalize_u8_ref(x8, scale, shift, dtype).float(), ref, atol=tol, rtol=tol)
""")


def test_triton_kernels_in_the_interpreter_match_the_references():
    pytest.importorskip("triton")
    code = CHECK + "\ncheck(torch.float32, 'cpu', 1e-5)\nprint('ok')\n"
    import fullthrottle

    src = os.path.dirname(os.path.dirname(fullthrottle.__file__))
    env = dict(
        os.environ,
        TRITON_INTERPRET="1",
        FULLTHROTTLE_TRITON="1",
        PYTHONPATH=os.pathsep.join([src, os.environ.get("PYTHONPATH", "")]),
    )
    r = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0 and r.stdout.strip().endswith("ok"), r.stderr[-3000:]


def test_references_run_without_triton(monkeypatch):
    from fullthrottle.core import kernels as K

    monkeypatch.setenv("FULLTHROTTLE_TRITON", "0")
    x = torch.randn(2, 8)
    assert not K.use_triton(x)
    w = torch.ones(8)
    expect = x / x.pow(2).mean(-1, keepdim=True).add(1e-6).sqrt()
    torch.testing.assert_close(K.rms_norm(x, w, 1e-6), expect)
    s, y = K.rms_norm(x, w, 1e-6, residual=x)
    torch.testing.assert_close(s, 2 * x)
    torch.testing.assert_close(y, expect, rtol=1e-5, atol=1e-5)  # RMSNorm is scale-invariant
    gu = torch.randn(4, 6)
    torch.testing.assert_close(K.silu_mul(gu), torch.nn.functional.silu(gu[:, 0::2]) * gu[:, 1::2])
    w = torch.randn(3 * 8, 5)  # 3 heads of 8 rows: interleave / de-interleave are inverses
    wi = K.interleave_pairs(w, 8, dim=0)
    assert wi[:4, 0].tolist() == [w[0, 0], w[4, 0], w[1, 0], w[5, 0]]
    torch.testing.assert_close(K.deinterleave_pairs(wi.T, 8).T, w, rtol=0, atol=0)
    for bad in (0, 3, 5):
        with pytest.raises(ValueError, match="group must be an even int"):
            K.interleave_pairs(w, bad, dim=0)


@pytest.mark.gpu
def test_triton_kernels_on_gpu_bf16():
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    pytest.importorskip("triton")
    ns = {}
    exec(CHECK, ns)
    ns["check"](torch.float32, "cuda", 1e-5)
    ns["check"](torch.bfloat16, "cuda", 2e-2)


def test_bad_shapes_and_dtypes_are_clear_errors():
    from fullthrottle.core import kernels as K

    x = torch.randn(2, 8)
    with pytest.raises(ValueError, match="weight must be"):
        K.rms_norm(x, torch.ones(7), 1e-5)
    with pytest.raises(ValueError, match="must be float"):
        K.rms_norm(torch.ones(2, 8, dtype=torch.int64), torch.ones(8), 1e-5)
    with pytest.raises(ValueError, match="residual"):
        K.rms_norm(x, torch.ones(8), 1e-5, residual=torch.randn(1, 8))
    with pytest.raises(ValueError, match="eps"):
        K.rms_norm(x, torch.ones(8), -1.0)
    with pytest.raises(ValueError, match="last dim must be even"):
        K.silu_mul(torch.randn(2, 3))
    meta = torch.empty(3, 8, device="meta")
    with pytest.raises(ValueError, match="different devices: x on cpu, weight on meta"):
        K.linear(torch.randn(2, 8), meta)
    with pytest.raises(ValueError, match="share one dtype of float32/float16/bfloat16"):
        K.linear(torch.ones(2, 8, dtype=torch.bool), torch.ones(3, 8, dtype=torch.bool))
    with pytest.raises(ValueError, match="share one dtype of float32/float16/bfloat16, got torch.float64"):
        K.linear(torch.ones(2, 8, dtype=torch.float64), torch.ones(3, 8, dtype=torch.float64))
    with pytest.raises(ValueError, match="different devices"):
        K.rms_norm(x, torch.ones(8, device="meta"), 1e-5)
    with pytest.raises(ValueError, match="eps must be a number"):
        K.rms_norm(x, torch.ones(8), None)
    q, kv, p = torch.randn(2, 4, 1, 8), torch.randn(2, 2, 16, 8), torch.tensor([[3], [5]])
    with pytest.raises(ValueError, match="head counts"):
        K.decode_attention(q, torch.randn(2, 0, 16, 8), torch.randn(2, 0, 16, 8), p, 0, 16)
    with pytest.raises(ValueError, match="share a float dtype"):
        K.decode_attention(q.bfloat16(), kv, kv, p, 0, 16)
    with pytest.raises(ValueError, match="pos must be an integer"):
        K.decode_attention(q, kv, kv, p.float(), 0, 16)
    with pytest.raises(ValueError, match="must be ints"):
        K.decode_attention(q, kv, kv, p, 0, 4.5)
    with pytest.raises(ValueError, match="block_t must be a power of two >= 16"):
        K.decode_attention(q, kv, kv, p, 0, 16, block_t=48)
    with pytest.raises(ValueError, match="different devices"):
        K.normalize_u8(
            torch.zeros(2, 4, 4, 3, dtype=torch.uint8), torch.ones(3, device="meta"), torch.zeros(3), torch.bfloat16
        )
    with pytest.raises(ValueError, match="must be uint8"):
        K.normalize_u8(torch.randn(2, 4, 4, 3), torch.ones(3), torch.zeros(3), torch.bfloat16)
    with pytest.raises(ValueError, match="scale and shift must be \\(3,\\)"):
        K.normalize_u8(torch.zeros(2, 4, 4, 3, dtype=torch.uint8), torch.ones(4), torch.zeros(3), torch.bfloat16)
    B, S, H, Hkv, D = 1, 2, 4, 2, 8
    kc = torch.zeros(2, Hkv, 8, D)
    cs = torch.zeros(B, S, D // 2)
    pos = torch.zeros(B, S, dtype=torch.long)
    with pytest.raises(ValueError, match="is not"):
        K.rope_qkv_into_cache(torch.randn(B, S, (H + 2 * Hkv) * D + 1), cs, cs, pos, kc, kc.clone(), 0, H, Hkv)
    with pytest.raises(ValueError, match="past the cache"):
        K.rope_qkv_into_cache(torch.randn(B, S, (H + 2 * Hkv) * D), cs, cs, pos, kc, kc.clone(), 2, H, Hkv)
    with pytest.raises(ValueError, match="share a float dtype"):
        K.rope_qkv_into_cache(
            torch.randn(B, S, (H + 2 * Hkv) * D), cs, cs, pos, kc.bfloat16(), kc.bfloat16(), 0, H, Hkv
        )
    with pytest.raises(ValueError, match="must be \\(B, S"):
        K.rope_qkv_into_cache(torch.randn(S, (H + 2 * Hkv) * D), cs, cs, pos, kc, kc.clone(), 0, H, Hkv)
    k5 = torch.zeros(2, Hkv, 8, 5)  # an odd head dim: named as such
    with pytest.raises(ValueError, match="head dim D must be even"):
        K.rope_qkv_into_cache(torch.randn(B, S, (H + 2 * Hkv) * 5), cs, cs, pos, k5, k5.clone(), 0, H, Hkv)


def test_paged_attention_trial_setting_from_the_environment(monkeypatch):
    """FULLTHROTTLE_PAGED_ATTENTION (trials) gives the decode attention kernel's warps, per and sub; the
    model's paged cache takes it; a malformed value or a block of under 8 positions is a clear error."""
    from fullthrottle.core import kernels as K
    from fullthrottle.workloads.llm.llama import Llama, LlamaConfig

    assert K.paged_setting() == {}
    monkeypatch.setenv("FULLTHROTTLE_PAGED_ATTENTION", "1,2,4")
    assert K.paged_setting() == {"warps": 1, "per": 2, "sub": 4}
    cfg = LlamaConfig(32, 32, 64, num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=2)
    model = Llama(cfg)
    model.setup_paged_cache(rows=2, max_seq_len=128, num_pages=4)
    assert model.layers[0].self_attn.setting == {"warps": 1, "per": 2, "sub": 4}
    for bad in ("1,2", "0,1,1", "a,b,c"):
        monkeypatch.setenv("FULLTHROTTLE_PAGED_ATTENTION", bad)
        with pytest.raises(ValueError, match="FULLTHROTTLE_PAGED_ATTENTION must be WARPS,PER,SUB"):
            K.paged_setting()
    q, pages = torch.randn(1, 2, 1, 16), torch.randn(3, 2, 64, 16)
    table, pos = torch.tensor([[1, 2]]), torch.tensor([[70]])
    with pytest.raises(ValueError, match=r"sub must be a power of two with PAGE / sub >= 8, got 16 \(PAGE 64\)"):
        K.paged_decode_attention(q, pages, pages, table, pos, 0, 128, sub=16)
    out = K.paged_decode_attention(q, pages, pages, table, pos, 0, 128, sub=8)  # (the reference on CPU)
    assert torch.allclose(out, K.paged_decode_attention(q, pages, pages, table, pos, 0, 128), atol=1e-6)


@pytest.mark.gpu
def test_normalize_matches_addcmul_on_gpu():
    """The Triton image normalisation equals the ``addcmul`` it replaced, to one bf16 rounding step."""
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    pytest.importorskip("triton")
    from fullthrottle.core import kernels as K

    x8 = torch.randint(0, 256, (8, 224, 224, 3), dtype=torch.uint8, device="cuda")
    std, mean = (torch.tensor(v, device="cuda") for v in (TORCHVISION_IMAGENET.std, TORCHVISION_IMAGENET.mean))
    scale, shift = (1 / (255 * std)).bfloat16(), (-mean / std).bfloat16()
    y = K.normalize_u8(x8, scale, shift, torch.bfloat16)
    ref = torch.addcmul(shift, x8, scale)  # Engine's path without Triton
    assert y.dtype == ref.dtype == torch.bfloat16
    ulp = (ref.float().abs() * 2**-7).clamp_min(2**-133)
    assert ((y.float() - ref.float()).abs() <= ulp).all()
    assert (y == ref).float().mean() > 0.99


RESIZE_CHECK = textwrap.dedent("""
    import torch
    from fullthrottle.core import kernels as K
    from fullthrottle.data.gpu_resize import resize_crop_interpolate, resize_crop_matmul

    g = torch.Generator().manual_seed(0)
    # wide, tall, square, upscaled (9x7, 1x1), odd sizes; CHW and views of HWC, as the decoders give
    sizes = [(30, 40), (41, 23), (16, 16), (9, 7), (1, 1), (12, 100), (57, 57), (20, 33)]
    imgs = []
    for k, (h, w) in enumerate(sizes):
        a = torch.randint(0, 256, (h, w, 3), generator=g, dtype=torch.uint8)
        imgs.append(a.permute(2, 0, 1) if k % 2 else a.permute(2, 0, 1).contiguous())
    out = torch.full((len(imgs), 12, 12, 3), 7, dtype=torch.uint8)
    K.resize_crop_u8(imgs, out, resize=16, crop=12)
    ref = torch.empty_like(out)
    resize_crop_matmul(imgs, ref, resize=16, crop=12)      # float32 products on CPU: the same filter
    d = (out.int() - ref.int()).abs()
    assert d.max() <= 1 and d.float().mean() < 0.02, (d.max(), d.float().mean())
    resize_crop_interpolate(imgs, ref, resize=16, crop=12)  # PyTorch's antialiased interpolate
    d = (out.int() - ref.int()).abs()
    assert d.max() <= 1 and d.float().mean() < 0.02, (d.max(), d.float().mean())
    # into a non-contiguous view of a larger buffer (rows of the staging batch)
    big = torch.zeros((len(imgs), 12, 14, 3), dtype=torch.uint8)
    K.resize_crop_u8(imgs, big[:, :, 1:13], resize=16, crop=12)
    assert torch.equal(big[:, :, 1:13], out) and big[:, :, 0].eq(0).all() and big[:, :, 13].eq(0).all()
    print('ok')
""")


def test_triton_resize_crop_in_the_interpreter_matches_the_products_and_interpolate():
    pytest.importorskip("triton")
    import fullthrottle

    src = os.path.dirname(os.path.dirname(fullthrottle.__file__))
    env = dict(
        os.environ,
        TRITON_INTERPRET="1",
        FULLTHROTTLE_TRITON="1",
        PYTHONPATH=os.pathsep.join([src, os.environ.get("PYTHONPATH", "")]),
    )
    r = subprocess.run([sys.executable, "-c", RESIZE_CHECK], env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0 and r.stdout.strip().endswith("ok"), r.stderr[-3000:]


def test_resize_crop_u8_rejects_bad_arguments():
    from fullthrottle.core import kernels as K

    img = torch.zeros((3, 8, 8), dtype=torch.uint8)
    out = torch.empty((1, 4, 4, 3), dtype=torch.uint8)
    with pytest.raises(ValueError, match="crop <= resize"):
        K.resize_crop_u8([img], out, resize=4, crop=6)
    with pytest.raises(ValueError, match=r"out must be uint8 \(2, 4, 4, 3\)"):
        K.resize_crop_u8([img, img], out, resize=6, crop=4)
    with pytest.raises(ValueError, match="image 0 must be a \\(3, H, W\\) uint8"):
        K.resize_crop_u8([img.float()], out, resize=6, crop=4)
    with pytest.raises(ValueError, match="image 0 must be a \\(3, H, W\\) uint8"):
        K.resize_crop_u8([img[:1]], out, resize=6, crop=4)
    with pytest.raises(ValueError, match="not a dense CHW or HWC block"):
        K.resize_crop_u8([torch.zeros((3, 8, 16), dtype=torch.uint8)[:, :, ::2]], out, resize=6, crop=4)


def test_llm_attention_kernels_compile_for_the_h200_without_a_gpu():
    """Triton compiles the prefill (variable-length) and decode attention kernels, static and paged,
    down to an sm_90 cubin on a machine without a GPU: errors of types, shapes or control flow that
    the interpreter lets through would fail here, before a GPU run. In a fresh interpreter: Triton
    parses the kernels' source (``ast.parse``), which Python 3.11 can fail with a SystemError while
    another thread of the process (one a test before left) compiles code too."""
    pytest.importorskip("triton")
    here = os.path.dirname(os.path.abspath(__file__))
    code = f"import sys; sys.path.insert(0, {here!r}); import test_kernels; test_kernels._compile_for_the_h200()"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=600)
    assert out.returncode == 0 and "compiled" in out.stdout, out.stderr[-3000:]


def _compile_for_the_h200():
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from fullthrottle.core.kernels import attention, varlen

    ptrs = dict.fromkeys(("q_ptr", "k_ptr", "v_ptr", "o_ptr"), "*bf16")
    ptrs |= dict.fromkeys(("rows_ptr", "start_ptr", "cu_ptr", "blk_seg_ptr", "blk_m0_ptr", "table_ptr"), "*i64")
    ints = dict.fromkeys(("table_stride", "q_t", "q_h", "o_t", "c_b", "c_h", "c_t"), "i64")
    prefill = {**ptrs, **ints, "REP": "i32", "qk_scale": "fp32"}
    decode = {"q_ptr": "*bf16", "kc_ptr": "*bf16", "vc_ptr": "*bf16", "pos_ptr": "*i64", "part_ptr": "*fp32"}
    decode |= {"o_ptr": "*bf16", "cnt_ptr": "*i32", "table_ptr": "*i64", "table_stride": "i64"}
    decode |= dict.fromkeys(("row0", "T", "H", "REP", "SPLITS"), "i32") | dict.fromkeys(("c_b", "c_h", "c_t"), "i64")
    decode |= {"sm_scale": "fp32"}
    for paged in (False, True):
        consts = {"D": 128, "BLOCK_M": 64, "BLOCK_N": 64, "PAGE": 64, "PAGED": paged, "PRECISION": "tf32"}
        sig = prefill | dict.fromkeys(consts, "constexpr")
        src = ASTSource(fn=varlen._prefill_kernel, signature=sig, constexprs=consts)
        k = triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": 4})
        assert k.asm["cubin"] and ".target sm_90" in k.asm["ptx"]
        for per, direct in ((1, False), (2, False), (4, True)):  # splits of a block, of 2; one program a pair
            consts = {"D": 128, "BLOCK_T": 64, "PER": per, "MERGE": not direct, "DIRECT": direct}
            consts |= {"BLOCK_S": 64, "PAGED": paged, "SUB": 1}
            sig = decode | dict.fromkeys(consts, "constexpr")
            src = ASTSource(fn=attention._attention_part_kernel, signature=sig, constexprs=consts)
            assert triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": 2}).asm["cubin"]
    # RoPE into the static cache, into paged bf16 pages and into float8 pages
    from fullthrottle.core.kernels import norm_rope

    rope = {"qkv_ptr": "*bf16", "cos_ptr": "*fp32", "sin_ptr": "*fp32", "pos_ptr": "*i64", "q_ptr": "*bf16"}
    rope |= {"rows_ptr": "*i64", "table_ptr": "*i64", "table_stride": "i64", "S": "i32", "H": "i32", "HKV": "i32"}
    rope |= {"row0": "i32", "qkv_tok_stride": "i64", "c_b": "i64", "c_h": "i64", "c_t": "i64"}
    for paged, cache in ((False, "*bf16"), (True, "*bf16"), (True, "*fp8e4nv")):
        consts = {"HALF": 64, "BLOCK": 64, "PAGED": paged, "PAGE": 64, "FP8": cache == "*fp8e4nv", "FP8_MAX": 448.0}
        sig = rope | {"kc_ptr": cache, "vc_ptr": cache} | dict.fromkeys(consts, "constexpr")
        src = ASTSource(fn=norm_rope._rope_qkv_kernel, signature=sig, constexprs=consts)
        assert triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": 1}).asm["cubin"]
    # float8 e4m3 pages (kv_dtype="fp8"): both kernels read them
    consts = {"D": 128, "BLOCK_M": 64, "BLOCK_N": 64, "PAGE": 64, "PAGED": True, "PRECISION": "tf32"}
    sig = prefill | {"k_ptr": "*fp8e4nv", "v_ptr": "*fp8e4nv"} | dict.fromkeys(consts, "constexpr")
    src = ASTSource(fn=varlen._prefill_kernel, signature=sig, constexprs=consts)
    assert triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": 4}).asm["cubin"]
    for sub, per, warps in ((1, 1, 2), (1, 4, 1), (2, 1, 2)):  # a page a block (float8's default: 4 a
        # program, 1 warp); half a page
        consts = {"D": 128, "BLOCK_T": 64 // sub, "PER": per, "MERGE": True, "DIRECT": False, "BLOCK_S": 8}
        consts |= {"PAGED": True, "SUB": sub}
        sig = decode | {"kc_ptr": "*fp8e4nv", "vc_ptr": "*fp8e4nv"} | dict.fromkeys(consts, "constexpr")
        src = ASTSource(fn=attention._attention_part_kernel, signature=sig, constexprs=consts)
        assert triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": warps}).asm["cubin"]
    print("compiled")
