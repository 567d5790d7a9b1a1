"""Continuous batching on the static KV cache (issue 14): the Scheduler against static batches of the
same Generator, Llama-2-7B shape bf16, random weights, all requests given at once.

Rows: ``static``: ``Generator.generate`` on consecutive batches of ``--max-batch`` (what a static server
does); ``scheduler``: ``Scheduler.run`` on all of them through ``--max-batch`` KV-cache rows. Output
tokens per second over the whole workload, and the prefill/decode seconds from the Generator's stages.

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

from fullthrottle.workloads.llm.generate import Generator  # noqa: E402
from fullthrottle.workloads.llm.llama import Llama, LlamaConfig  # noqa: E402
from fullthrottle.workloads.llm.scheduler import Scheduler  # noqa: E402


def stage_s(gen) -> dict:
    return {k: gen.stats[k].busy_s for k in ("prefill", "decode")}


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--requests", type=int, default=256)
    ap.add_argument("--prompt", type=int, default=128)
    ap.add_argument("--new", type=int, default=128)
    ap.add_argument("--max-batch", type=int, default=64)
    ap.add_argument("--out", default="scheduler_probe.json")
    args = ap.parse_args()
    cfg = LlamaConfig.llama2_7b()
    torch.manual_seed(0)
    torch.set_default_dtype(torch.bfloat16)
    with torch.device("cuda"):
        model = Llama(cfg).eval()
    torch.set_default_dtype(torch.float32)
    model.inv_freq = model.inv_freq.float()
    gen = Generator(model, max_batch=args.max_batch, max_seq_len=args.prompt + args.new, graphs=True)
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, cfg.vocab_size, (args.prompt,), generator=g).tolist() for _ in range(args.requests)]
    gen.generate(prompts[:2], max_new_tokens=4)  # warm-up
    rows = []
    for kind in ("static", "scheduler"):
        before = stage_s(gen)
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        if kind == "static":
            out = []
            for i in range(0, len(prompts), args.max_batch):
                out += gen.generate(prompts[i : i + args.max_batch], max_new_tokens=args.new)
        else:
            out = Scheduler(gen).run([{"prompt": p, "max_new_tokens": args.new} for p in prompts])
        torch.cuda.synchronize()
        wall = time.perf_counter() - t0
        after = stage_s(gen)
        n = sum(len(o) for o in out)
        rows.append(
            {
                "kind": kind,
                "output_tokens": n,
                "wall_s": wall,
                "output_tok_per_s": n / wall,
                **{f"{k}_s": after[k] - before[k] for k in after},
            }
        )
        print(rows[-1], flush=True)
    write_json(
        args.out,
        {
            "benchmark": "scheduler_probe",
            "machine": machine_info(),
            "model": "Llama-2-7B shape, bf16, random weights",
            "args": vars(args),
            "rows": rows,
        },
    )


if __name__ == "__main__":
    main()
