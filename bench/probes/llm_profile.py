"""Where an LLM decode step's time goes (issue 06): CUDA kernels of one step, by name, count and time.

Llama-2-7B shape, bf16, random weights, every row at position ``--pos`` (200), the static KV cache
of ``--max-seq-len`` (328) positions per row or (``--paged``) paged KV memory, each row holding the
pages of ``--max-seq-len`` positions. For each batch: the decode step replayed as a CUDA graph (ms
per step, CUDA events, median of 50), the floor that the H200's memory bandwidth puts under it
(weights + the keys and values read, at ``--bandwidth`` GB/s) and the kernels of one eager step
under ``torch.profiler`` (count and device time per kernel name), so the launch overhead (kernel
count), the bandwidth-bound matmuls and the attention can be told apart.

Usage: python bench/probes/llm_profile.py --out bench/probes/results/llm_profile.json [--batches 1,8]
    [--paged --batches 256,512 --pos 192 --max-seq-len 256 [--kv-dtype fp8]]
"""

from __future__ import annotations

import argparse
import statistics
import sys
from collections import defaultdict
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # bench/: common.py
from common import machine_info, write_json  # noqa: E402

from fullthrottle.workloads.llm.generate import Generator  # noqa: E402
from fullthrottle.workloads.llm.llama import Llama, LlamaConfig  # noqa: E402


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default="bench/probes/results/llm_profile.json")
    ap.add_argument("--batches", default="1,8,64")
    ap.add_argument("--pos", type=int, default=200, help="every row's position (tokens already cached)")
    ap.add_argument("--max-seq-len", type=int, default=328)
    ap.add_argument("--paged", action="store_true", help="paged KV memory instead of the static cache")
    ap.add_argument("--kv-dtype", default="auto", choices=("auto", "fp8"), help="paged KV memory's dtype")
    ap.add_argument("--bandwidth", type=float, default=4800.0, help="GB/s for the floor (H200: 4,800)")
    args = ap.parse_args()
    batches = [int(b) for b in args.batches.split(",")]
    torch.manual_seed(0)
    torch.set_default_dtype(torch.bfloat16)
    with torch.device("cuda"):
        model = Llama(LlamaConfig.llama2_7b()).eval()
    torch.set_default_dtype(torch.float32)
    model.inv_freq = model.inv_freq.float()
    cfg, pos = model.cfg, args.pos
    rows = max(batches)
    pages = rows * -(-args.max_seq_len // 64) if args.paged else 0
    gen = Generator(
        model, max_batch=rows, max_seq_len=args.max_seq_len, graphs=True, kv_pages=pages, kv_dtype=args.kv_dtype
    )
    if gen.kv is not None:
        gen.kv.reserve_rows([args.max_seq_len] * gen.max_batch)
    weight_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    # K and V of one token, every layer (bf16: 2 bytes an element, fp8: 1)
    kv_token_bytes = (
        2 * cfg.num_hidden_layers * cfg.num_key_value_heads * cfg.head_dim * (1 if args.kv_dtype == "fp8" else 2)
    )
    gen.pos.fill_(pos)
    out = {}
    for b in batches:
        kv = next(x for x in gen.kv_buckets if x > pos)  # the attention length a step at this position uses
        g, _ = gen.graphs[(b, True, kv)]
        times = []
        for _ in range(60):
            gen.pos.fill_(pos)
            e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            e0.record()
            g.replay()
            e1.record()
            e1.synchronize()
            times.append(e0.elapsed_time(e1))
        step_ms = statistics.median(times[10:])
        gen.pos.fill_(pos)
        gen._step(b, True, kv)
        torch.cuda.synchronize()
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
            gen.pos.fill_(pos)
            gen._step(b, True, kv)
            torch.cuda.synchronize()
        agg = defaultdict(lambda: [0, 0.0])
        for ev in prof.events():
            if ev.device_type == torch.autograd.DeviceType.CUDA:
                agg[ev.name][0] += 1
                agg[ev.name][1] += ev.device_time_total if hasattr(ev, "device_time_total") else ev.cuda_time_total
        kernels = sorted(({"name": k[:120], "count": v[0], "us": v[1]} for k, v in agg.items()), key=lambda r: -r["us"])
        total_n = sum(r["count"] for r in kernels)
        total_us = sum(r["us"] for r in kernels)
        floor_ms = (weight_bytes + b * (pos + 1) * kv_token_bytes) / (args.bandwidth * 1e6)
        out[b] = {
            "graph_step_ms": step_ms,
            "bandwidth_floor_ms": floor_ms,
            "tok_per_s_graph": b / step_ms * 1e3,
            "kernels_per_step": total_n,
            "kernel_time_us": total_us,
            "top": kernels[:30],
        }
        print(
            f"batch {b}: graph step {step_ms:.3f} ms ({b / step_ms * 1e3:.0f} tok/s; floor {floor_ms:.3f} ms), {total_n} kernels, "
            f"{total_us / 1e3:.3f} ms of kernel time",
            flush=True,
        )
        for r in kernels[:14]:
            print(f"   {r['count']:5d} {r['us']:9.1f} us  {r['name'][:90]}", flush=True)
    settings = {
        "pos": pos,
        "max_seq_len": args.max_seq_len,
        "paged": args.paged,
        "kv_dtype": args.kv_dtype,
        "bandwidth_gb_s": args.bandwidth,
    }
    write_json(args.out, {"benchmark": "llm_profile", "machine": machine_info(), "settings": settings, "batches": out})


if __name__ == "__main__":
    main()
