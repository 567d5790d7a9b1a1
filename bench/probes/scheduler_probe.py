"""Continuous batching (issue 14): the Scheduler with a read back per decode step (``ahead`` 1, as the
server runs it) and with up to 8 decode replays per read back (``ahead`` 8, as ``Generator.generate``
and offline runs), Llama-2-7B shape bf16, random weights, all requests given at once.

Rows: ``Scheduler.run`` on all requests through ``--max-batch`` KV-cache rows (a comma list: one
Generator each, in turn), then one request alone (batch-1 decode). Output tokens per second over the
whole workload, and the prefill/decode seconds from the Generator's stages. Then one prompt's
prefill alone (``--prefill-lens``), timed with CUDA events.

Usage: python bench/probes/scheduler_probe.py --requests 256 --prompt 128 --new 128 --out probe.json
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # bench/: common.py
from common import machine_info, write_json  # noqa: E402

from fullthrottle.core.kernels.varlen import query_blocks  # noqa: E402
from fullthrottle.workloads.llm.generate import Generator  # noqa: E402
from fullthrottle.workloads.llm.llama import Llama, LlamaConfig  # noqa: E402
from fullthrottle.workloads.llm.prefill import Packed  # noqa: E402
from fullthrottle.workloads.llm.scheduler import Scheduler  # noqa: E402


def stage_s(gen) -> dict:
    return {k: gen.stats[k].busy_s for k in ("prefill", "decode")}


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--requests", type=int, default=256)
    ap.add_argument("--prompt", type=int, default=128)
    ap.add_argument("--new", type=int, default=128)
    ap.add_argument("--max-batch", default="64,256")
    ap.add_argument("--prefill-lens", default="128,1024")
    ap.add_argument("--out", default="scheduler_probe.json")
    args = ap.parse_args()
    cfg = LlamaConfig.llama2_7b()
    torch.manual_seed(0)
    torch.set_default_dtype(torch.bfloat16)
    with torch.device("cuda"):
        model = Llama(cfg).eval()
    torch.set_default_dtype(torch.float32)
    model.inv_freq = model.inv_freq.float()
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, cfg.vocab_size, (args.prompt,), generator=g).tolist() for _ in range(args.requests)]
    rows = []
    for mb in [int(x) for x in args.max_batch.split(",")]:
        t0 = time.perf_counter()
        gen = Generator(model, max_batch=mb, max_seq_len=args.prompt + args.new, graphs=True)
        capture_s = time.perf_counter() - t0
        gen.generate(prompts[:2], max_new_tokens=4)  # warm-up
        for kind, ahead, reqs in (
            ("all", 1, prompts),
            ("all", 8, prompts),
            ("batch 1", 1, prompts[:1]),
            ("batch 1", 8, prompts[:1]),
        ):
            before = stage_s(gen)
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            out = Scheduler(gen, ahead=ahead).run([{"prompt": p, "max_new_tokens": args.new} for p in reqs])
            torch.cuda.synchronize()
            wall = time.perf_counter() - t0
            after = stage_s(gen)
            n = sum(len(o) for o in out)
            rows.append(
                {
                    "kind": kind,
                    "ahead": ahead,
                    "max_batch": mb,
                    "capture_s": capture_s,
                    "output_tokens": n,
                    "wall_s": wall,
                    "output_tok_per_s": n / wall,
                    **{f"{k}_s": after[k] - before[k] for k in after},
                }
            )
            print(rows[-1], flush=True)
        del gen
        torch.cuda.empty_cache()
    prefill = []
    lens = [int(x) for x in args.prefill_lens.split(",")]
    model.setup_cache(1, max(lens))
    with torch.inference_mode():
        for n in lens:
            ids = torch.randint(0, cfg.vocab_size, (n,)).tolist()
            sizes = (n, 1, len(query_blocks([n])[0]))
            pk = Packed.view(Packed.build([(0, ids, 0, n)], *sizes, pad_row=0).cuda(), *sizes)
            for _ in range(3):
                model.prefill(pk)
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            for _ in range(10):
                model.prefill(pk)
            b.record()
            torch.cuda.synchronize()
            h0 = time.perf_counter()  # the host's time to issue one prefill (launch-bound if ~ the GPU's)
            model.prefill(pk)
            host_ms = (time.perf_counter() - h0) * 1e3
            torch.cuda.synchronize()
            with torch.profiler.profile(
                activities=[torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
            ) as prof:
                model.prefill(pk)
                torch.cuda.synchronize()
            top = [
                {
                    "op": e.key,
                    "calls": e.count,
                    "cpu_ms": e.cpu_time_total / 1e3,
                    "cuda_ms": getattr(e, "device_time_total", getattr(e, "cuda_time_total", 0)) / 1e3,
                }
                for e in sorted(prof.key_averages(), key=lambda e: -e.cpu_time_total)[:20]
            ]
            prefill.append({"prompt_tokens": n, "ms": a.elapsed_time(b) / 10, "host_issue_ms": host_ms, "ops": top})
            print({k: v for k, v in prefill[-1].items() if k != "ops"}, flush=True)
            for t in top[:12]:
                print("   ", t, flush=True)
    # the Generator's own prefill (a CUDA graph per token bucket up to prefill_graph_tokens), first token sampled
    one = Generator(model, max_batch=1, max_seq_len=max(lens) + 1, graphs=True)
    for n in lens:
        prompt = torch.randint(0, cfg.vocab_size, (n,)).tolist()
        for _ in range(3):
            one._prefill([(0, prompt, 0, n)])
        torch.cuda.synchronize()
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        h0 = time.perf_counter()
        a.record()
        for _ in range(10):
            one._prefill([(0, prompt, 0, n)])
        b.record()
        torch.cuda.synchronize()
        wall_ms = (time.perf_counter() - h0) * 100
        graph = next((x for x in one.prefill.buckets if x >= n), None)
        prefill.append(
            {
                "prompt_tokens": n,
                "generator_ms": a.elapsed_time(b) / 10,
                "wall_ms": wall_ms,
                "graph_tokens": graph,
            }
        )
        print(prefill[-1], flush=True)
    write_json(
        args.out,
        {
            "benchmark": "scheduler_probe",
            "machine": machine_info(),
            "model": "Llama-2-7B shape, bf16, random weights",
            "args": vars(args),
            "rows": rows,
            "prefill_alone": prefill,
        },
    )


if __name__ == "__main__":
    main()
