"""Probe: the decode step's attention over paged KV memory (``kernels.paged_decode_attention``) at
the batch sizes a serving engine runs, by blocks per page (``--subs``: 2, half a page a block), how
many cache blocks one program reads (``per``: 1, the most splits, merged after; all of them, no
split) and warps per program, against cuDNN's attention
(``F.scaled_dot_product_attention``) over the same keys and values held contiguously, as the static
cache holds them.

Llama-2-7B's attention shape (32 heads of 128, no grouping), queries in bf16, keys and values in
bf16 or float8 e4m3 (``--kv-dtypes``), pages of 64 positions; every
row's position drawn uniformly from ``[--pos-lo, --pos-hi)``, the attention length ``--kv-len``
(the step's bucket). Each call reads another of ``--layers`` copies of the pages, so that the L2
cache holds little of what a call reads. Per setting: microseconds per call (``calls`` calls in one
CUDA graph, median of 10 replays), the bytes of keys and values the rows' valid positions hold
divided by that time (GB/s), and the largest difference from ``per=1``'s output.

Usage: python bench/probes/paged_attention_probe.py --batches 8,32,64,128,256,512 --out paged_attention_probe.json
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))  # bench/: common.py
sys.path.insert(0, str(HERE))
from common import machine_info, write_json  # noqa: E402
from gemv_probe import graph_time_us  # noqa: E402

from fullthrottle.core import kernels as K  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batches", default="8,32,64,128,256,512")
    ap.add_argument("--kv-len", type=int, default=256)
    ap.add_argument("--pos-lo", type=int, default=128)
    ap.add_argument("--pos-hi", type=int, default=256)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--kv-dtypes", default="bf16", help="comma-separated: bf16, fp8 (float8 e4m3 pages)")
    ap.add_argument("--pers", default="1,2,all", help="blocks per program to try (all: no split)")
    ap.add_argument("--warps", default="2,4,8")
    ap.add_argument("--subs", default="1", help="blocks per page to try (1: a page a block; 2: half a page)")
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    torch.manual_seed(0)
    H, D, PAGE, dev, dt = 32, 128, 64, "cuda", torch.bfloat16
    P = -(-args.kv_len // PAGE)
    rows = []
    kv_types = {"bf16": dt, "fp8": torch.float8_e4m3fn}
    for B, kvd in [(int(b), k) for b in args.batches.split(",") for k in args.kv_dtypes.split(",")]:
        n_pages = B * P
        pk = torch.randn(args.layers, n_pages + 1, H, PAGE, D, device=dev, dtype=dt).to(kv_types[kvd])
        pv = torch.randn(args.layers, n_pages + 1, H, PAGE, D, device=dev, dtype=dt).to(kv_types[kvd])
        table = (torch.randperm(n_pages, device=dev) + 1).view(B, P)
        pos = torch.randint(args.pos_lo, args.pos_hi, (B, 1), device=dev).clamp_max(args.kv_len - 1)
        q = torch.randn(B, H, 1, D, device=dev, dtype=dt)
        cnt = torch.zeros(B * H, dtype=torch.int32, device=dev)
        valid_bytes = int((pos + 1).sum()) * H * D * 2 * pk.element_size()  # keys and values
        ref = K.paged_decode_attention(q, pk[0], pv[0], table, pos, 0, args.kv_len, cnt, per=1)
        row = {"batch": B, "kv_dtype": kvd, "pairs": B * H, "valid_mb": valid_bytes / 1e6}
        settings = [
            (per, warps, sub)
            for sub in [int(x) for x in args.subs.split(",")]
            for per in sorted({P * sub if x == "all" else int(x) for x in args.pers.split(",")})
            for warps in [int(w) for w in args.warps.split(",")]
        ]
        for per, warps, sub in settings:

            def call(i, per=per, warps=warps, sub=sub):
                return K.paged_decode_attention(q, pk[i], pv[i], table, pos, 0, args.kv_len, cnt, warps, per, sub)

            diff = (call(0).float() - ref.float()).abs().max().item()
            us = graph_time_us(call, args.layers)
            key = f"per{per}_w{warps}" + (f"_sub{sub}" if sub > 1 else "")
            row[key] = {"us": us, "gb_s": valid_bytes / us / 1e3, "max_abs_diff": diff}
        # cuDNN over the same keys and values, contiguous (B, H, kv_len, D), as the static cache holds them
        # (float8 pages: gathered in bf16, so cuDNN reads twice the bytes the kernel does)
        every = torch.arange(B, device=dev)
        kc = torch.stack([K.gather_pages(pk[i].to(dt), table, every, args.kv_len) for i in range(2)])
        vc = torch.stack([K.gather_pages(pv[i].to(dt), table, every, args.kv_len) for i in range(2)])
        mask = torch.arange(args.kv_len, device=dev)[None, None, None, :] <= pos[:, None, :, None]
        diff = (F.scaled_dot_product_attention(q, kc[0], vc[0], attn_mask=mask).float() - ref.float()).abs().max()
        us = graph_time_us(lambda i: F.scaled_dot_product_attention(q, kc[i], vc[i], attn_mask=mask), 2)
        row["sdpa_contiguous"] = {"us": us, "gb_s": valid_bytes / us / 1e3, "max_abs_diff": diff.item()}
        rows.append(row)
        best = min((k for k in row if k.startswith("per")), key=lambda k: row[k]["us"])
        print(
            f"batch {B} {kvd}: "
            + ", ".join(f"{k} {row[k]['us']:.1f} us" for k in row if isinstance(row[k], dict))
            + f"; best {best} ({row[best]['gb_s']:.0f} GB/s)",
            flush=True,
        )
        del pk, pv, kc, vc
        torch.cuda.empty_cache()
    settings = {
        k: getattr(args, k) for k in ("kv_len", "pos_lo", "pos_hi", "layers", "kv_dtypes", "pers", "warps", "subs")
    }
    write_json(
        args.out, {"probe": "paged_attention_probe", "machine": machine_info(), "settings": settings, "rows": rows}
    )


if __name__ == "__main__":
    main()
