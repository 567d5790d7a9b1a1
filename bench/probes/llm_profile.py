"""Where an LLM decode step's time goes (issue 06): CUDA kernels of one step, by name, count and time.

Llama-2-7B shape, bf16, random weights, static KV cache of 328 positions. For each batch: the
decode step replayed as a CUDA graph (ms per step, CUDA events, median of 50) and the kernels of
one eager step under ``torch.profiler`` (count and device time per kernel name), so the launch
overhead (kernel count) and the bandwidth-bound matmuls can be told apart.

Usage: python bench/probes/llm_profile.py --out bench/probes/results/llm_profile.json [--batches 1,8]
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
    args = ap.parse_args()
    batches = [int(b) for b in args.batches.split(",")]
    torch.manual_seed(0)
    torch.set_default_dtype(torch.bfloat16)
    with torch.device("cuda"):
        model = Llama(LlamaConfig.llama2_7b()).eval()
    torch.set_default_dtype(torch.float32)
    model.inv_freq = model.inv_freq.float()
    gen = Generator(model, max_batch=max(batches), max_seq_len=328, graphs=True)
    gen.pos.fill_(200)
    out = {}
    for b in batches:
        kv = next(x for x in gen.kv_buckets if x > 200)  # the attention length a step at position 200 uses
        g, _ = gen.graphs[(b, True, kv)]
        times = []
        for _ in range(60):
            gen.pos.fill_(200)
            e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            e0.record()
            g.replay()
            e1.record()
            e1.synchronize()
            times.append(e0.elapsed_time(e1))
        step_ms = statistics.median(times[10:])
        gen.pos.fill_(200)
        gen._step(b, True, kv)
        torch.cuda.synchronize()
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
            gen.pos.fill_(200)
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
        out[b] = {
            "graph_step_ms": step_ms,
            "tok_per_s_graph": b / step_ms * 1e3,
            "kernels_per_step": total_n,
            "kernel_time_us": total_us,
            "top": kernels[:30],
        }
        print(
            f"batch {b}: graph step {step_ms:.3f} ms ({b / step_ms * 1e3:.0f} tok/s), {total_n} kernels, "
            f"{total_us / 1e3:.3f} ms of kernel time",
            flush=True,
        )
        for r in kernels[:14]:
            print(f"   {r['count']:5d} {r['us']:9.1f} us  {r['name'][:90]}", flush=True)
    write_json(args.out, {"benchmark": "llm_profile", "machine": machine_info(), "batches": out})


if __name__ == "__main__":
    main()
