"""Batch-1 LLM decode GEMVs on the H200: cuBLAS (F.linear) against a Triton GEMV, per Llama-2-7B shape (issue 06).

At batch 1 a decode step is bound by reading the weights once: the 7B model's 13.48 GB at the
4.26 TB/s copy bandwidth is the 316 tok/s roofline. cuBLAS ran the step's projections at 3.1-4.1 TB/s
(bench/probes/results/llm_profile.json). This probe times y = x @ W.T for x (1, K) bf16,
W (N, K) bf16 with CUDA graphs of 20 calls (weights of 8 layers cycled, so nothing sits in L2),
for cuBLAS and for a grid of Triton GEMV configurations, and writes the best per shape.

Also times the decode-step attention kernel (fullthrottle.core.kernels.decode_attention) against cuDNN's
through F.scaled_dot_product_attention at batch 1, 8, 32 and 64.

Usage: python bench/probes/gemv_probe.py --out gemv_probe.json
"""

from __future__ import annotations

import argparse
import itertools
import sys
from pathlib import Path

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # bench/: common.py
from common import capture_graph, machine_info, write_json  # noqa: E402

SHAPES = {
    "qkv": (12288, 4096),
    "o": (4096, 4096),
    "gate_up": (22016, 4096),
    "down": (4096, 11008),
    "lm_head": (32000, 4096),
}


@triton.jit
def _gemv(W, X, Y, N, K, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    # y[n] = sum_k W[n, k] * x[k]; one program per BLOCK_N rows, fp32 accumulation
    pid = tl.program_id(0)
    rn = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    acc = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        rk = k0 + tl.arange(0, BLOCK_K)
        w = tl.load(
            W + rn[:, None].to(tl.int64) * K + rk[None, :], mask=(rn[:, None] < N) & (rk[None, :] < K), other=0.0
        )
        x = tl.load(X + rk, mask=rk < K, other=0.0)
        acc += w.to(tl.float32) * x.to(tl.float32)[None, :]
    tl.store(Y + rn, tl.sum(acc, axis=1).to(Y.dtype.element_ty), mask=rn < N)


def gemv(w, x, y, bn, bk, warps, stages):
    N, K = w.shape
    _gemv[(triton.cdiv(N, bn),)](w, x, y, N, K, BLOCK_N=bn, BLOCK_K=bk, num_warps=warps, num_stages=stages)


def graph_time_us(fn_i, n_w, calls=20, reps=10):
    """Microseconds per call: ``calls`` calls (cycling ``n_w`` weight copies) captured in one graph."""
    g = capture_graph(lambda: [fn_i(i % n_w) for i in range(calls)], warmup=1)
    g.replay()
    torch.cuda.synchronize()
    ts = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        g.replay()
        b.record()
        b.synchronize()
        ts.append(a.elapsed_time(b) * 1e3 / calls)
    return sorted(ts)[len(ts) // 2]


def fused_probe(args):
    """Fused kernels against the two kernels they replace, Llama-2-7B shapes at batch 1, in one run."""
    from fullthrottle.core import kernels as K

    torch.manual_seed(0)
    out = {"benchmark": "gemv_probe_fused", "machine": machine_info(), "rows": []}
    H, D, dim, I = 32, 128, 4096, 11008
    x = torch.randn(1, 1, dim, device="cuda", dtype=torch.bfloat16)
    kc = torch.zeros(1, H, 512, D, device="cuda", dtype=torch.bfloat16)
    vc = torch.zeros_like(kc)
    pos = torch.full((1, 1), 300, device="cuda")
    ang = pos[..., None].float() * (1.0 / 10000 ** (torch.arange(0, D, 2, device="cuda").float() / D))
    cos, sin = ang.cos(), ang.sin()
    n_w = 8
    w_qkv = [torch.randn(3 * H * D, dim, device="cuda", dtype=torch.bfloat16) / dim**0.5 for _ in range(n_w)]
    w_gu = [torch.randn(2 * I, dim, device="cuda", dtype=torch.bfloat16) / dim**0.5 for _ in range(n_w)]
    cases = {
        "qkv+rope": (
            lambda i: K.rope_qkv_into_cache(K.linear(x, w_qkv[i]), cos, sin, pos, kc, vc, 0, H, H),
            lambda i: K.linear_rope_qkv_into_cache(x, w_qkv[i], cos, sin, pos, kc, vc, 0, H, H),
            3 * H * D * dim * 2 / 1e6,
        ),
        "gate_up+silu": (
            lambda i: K.silu_mul(K.linear(x, w_gu[i])),
            lambda i: K.linear_silu_mul(x, w_gu[i]),
            2 * I * dim * 2 / 1e6,
        ),
    }
    grid = list(itertools.product((16, 32), (256, 512), (4, 8), (1, 3)))
    for (name, (unfused, fused, mb)), epi in zip(cases.items(), (2, 1)):
        default = K.FUSED_CONFIGS[epi]
        ref = unfused(0).float()
        row = {
            "case": name,
            "MB": mb,
            "unfused_us": graph_time_us(unfused, n_w),
            "fused_default_us": graph_time_us(fused, n_w),
            "default_config": default,
            "fused": [],
        }
        for cfg in grid:  # the fused GEMV alone under other launch settings
            K.FUSED_CONFIGS[epi] = cfg
            try:
                err = (fused(0).float() - ref).abs().max().item()
                us = graph_time_us(fused, n_w)
            except Exception as e:  # noqa: BLE001 - a config the compiler rejects
                print(name, cfg, type(e).__name__, str(e)[:80])
                continue
            finally:
                K.FUSED_CONFIGS[epi] = default
            row["fused"].append({"config": cfg, "us": us, "max_abs_diff": err})
        row["best"] = min(row["fused"], key=lambda r: r["us"])
        print(
            name,
            "unfused",
            round(row["unfused_us"], 2),
            "us; fused",
            round(row["fused_default_us"], 2),
            "us; best fused",
            row["best"],
            flush=True,
        )
        out["rows"].append(row)
    # attention at batch 1, position 300 of 328 slots: merge kernel vs merged by the last split
    q = torch.randn(1, H, 1, D, device="cuda", dtype=torch.bfloat16)
    kc2, vc2 = (
        torch.randn(1, H, 328, D, device="cuda", dtype=torch.bfloat16),
        torch.randn(1, H, 328, D, device="cuda", dtype=torch.bfloat16),
    )
    cnt = torch.zeros(H, dtype=torch.int32, device="cuda")
    a = K.decode_attention(q, kc2, vc2, pos, 0, 328)
    b = K.decode_attention(q, kc2, vc2, pos, 0, 328, cnt)
    out["attention"] = {
        "two_kernels_us": graph_time_us(lambda i: K.decode_attention(q, kc2, vc2, pos, 0, 328), 1),
        "merged_by_last_split_us": graph_time_us(lambda i: K.decode_attention(q, kc2, vc2, pos, 0, 328, cnt), 1),
        "max_abs_diff": (a.float() - b.float()).abs().max().item(),
    }
    grid_attn = []
    for bt, warps in itertools.product((16, 32, 64, 128), (1, 2, 4, 8)):
        try:
            err = (
                (K.decode_attention(q, kc2, vc2, pos, 0, 328, cnt, block_t=bt, warps=warps).float() - a.float())
                .abs()
                .max()
                .item()
            )
            us = graph_time_us(
                lambda i, bt=bt, warps=warps: K.decode_attention(
                    q, kc2, vc2, pos, 0, 328, cnt, block_t=bt, warps=warps
                ),
                1,
            )
            grid_attn.append({"block_t": bt, "warps": warps, "us": us, "max_abs_diff": err})
        except Exception as e:  # noqa: BLE001
            print("attention", bt, warps, type(e).__name__, str(e)[:80])
    out["attention"]["grid"] = sorted(grid_attn, key=lambda r: r["us"])
    print(
        "attention",
        {k: v for k, v in out["attention"].items() if k != "grid"},
        "best",
        out["attention"]["grid"][:3],
        flush=True,
    )
    write_json(args.out, out)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default="gemv_probe.json")
    ap.add_argument("--attention-only", action="store_true", help="skip the GEMV grid")
    ap.add_argument(
        "--fused",
        action="store_true",
        help="only the fused kernels against their unfused pairs: "
        "SwiGLU in the gate/up GEMV, RoPE + cache write in the qkv GEMV (and a grid of "
        "launch settings), decode attention merged by its last split against the merge kernel",
    )
    args = ap.parse_args()
    if args.fused:
        return fused_probe(args)
    torch.manual_seed(0)
    rows = []
    configs = list(itertools.product((4, 8, 16, 32), (256, 512, 1024), (4, 8), (1, 3)))
    for name, (N, K) in ({} if args.attention_only else SHAPES).items():
        n_w = max(2, int(1.2e9 // (N * K * 2)))  # ~1.2 GB of weights cycled: far past L2
        ws = [torch.randn(N, K, device="cuda", dtype=torch.bfloat16) / K**0.5 for _ in range(n_w)]
        x = torch.randn(1, K, device="cuda", dtype=torch.bfloat16)
        y = torch.empty(N, device="cuda", dtype=torch.bfloat16)
        ref = F.linear(x, ws[0]).float()
        mb = N * K * 2 / 1e6
        cublas = graph_time_us(lambda i: F.linear(x, ws[i]), n_w)
        best = None
        for bn, bk, warps, stages in configs:
            try:
                gemv(ws[0], x, y, bn, bk, warps, stages)
                err = (y.float() - ref[0]).abs().max().item()
                if err > 0.05 * ref.abs().max().item():
                    continue
                us = graph_time_us(lambda i: gemv(ws[i], x, y, bn, bk, warps, stages), n_w)
            except Exception as e:  # noqa: BLE001 - a config the compiler rejects
                print(name, (bn, bk, warps, stages), type(e).__name__, str(e)[:80])
                continue
            if best is None or us < best[0]:
                best = (us, (bn, bk, warps, stages))
        row = {
            "shape": name,
            "N": N,
            "K": K,
            "MB": mb,
            "cublas_us": cublas,
            "cublas_TBps": mb / cublas,
            "triton_us": best[0],
            "triton_TBps": mb / best[0],
            "triton_config": best[1],
        }
        print(row, flush=True)
        rows.append(row)
        del ws
        torch.cuda.empty_cache()
    # decode-step attention: fullthrottle.core.kernels.decode_attention against cuDNN through SDPA (the
    # model's other path), Llama-2-7B heads, every row at position 300 of a 328-slot cache
    from fullthrottle.core import kernels as K

    attn = []
    for B in (1, 8, 32, 64):
        q = torch.randn(B, 32, 1, 128, device="cuda", dtype=torch.bfloat16)
        kc = torch.randn(B, 32, 328, 128, device="cuda", dtype=torch.bfloat16)
        vc = torch.randn_like(kc)
        pos = torch.full((B, 1), 300, device="cuda")
        t = torch.arange(328, device="cuda")
        mask = torch.zeros(B, 1, 1, 328, device="cuda", dtype=torch.bfloat16).masked_fill_(
            ~(t <= pos[:, None, :, None]), float("-inf")
        )
        err = (
            (
                K.decode_attention(q, kc, vc, pos, 0, 328).float()
                - F.scaled_dot_product_attention(q, kc, vc, attn_mask=mask).float()
            )
            .abs()
            .max()
            .item()
        )
        sdpa = graph_time_us(lambda i: F.scaled_dot_product_attention(q, kc, vc, attn_mask=mask), 1)
        tri = graph_time_us(lambda i: K.decode_attention(q, kc, vc, pos, 0, 328), 1)
        attn.append({"batch": B, "sdpa_us": sdpa, "triton_us": tri, "max_abs_diff": err})
        print(attn[-1], flush=True)
    step = None
    if rows:
        per_layer = {k: sum(r[k] for r in rows if r["shape"] != "lm_head") for k in ("cublas_us", "triton_us")}
        step = {k: 32 * per_layer[k] + next(r[k] for r in rows if r["shape"] == "lm_head") for k in per_layer}
        print("7B step GEMV time (us):", step)
    write_json(
        args.out,
        {
            "benchmark": "gemv_probe",
            "machine": machine_info(),
            "rows": rows,
            "step_gemv_us": step,
            "decode_attention": attn,
        },
    )


if __name__ == "__main__":
    main()
