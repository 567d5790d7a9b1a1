"""Probe: the LLM scheduler's steps under continuous arrival, with and without overlapped steps.

``--live`` requests (``--prompt`` tokens in, ``--new`` out, greedy) are kept in the
:class:`~fullthrottle.workloads.llm.scheduler.Scheduler` at all times: each one that ends is
replaced by a fresh one at once, as a closed loop of clients does to the server (so a prompt waits
at nearly every step). Over ``--steps`` steps after ``--warm`` more, with ``overlap`` off (each step
reads its own tokens back) and on (each step reads back the step before's while its own runs): wall
time per step, the step thread's CPU time per step and tokens decoded per second, all over the
whole run, with nothing outside the scheduler waiting for the GPU (a wait per step, as a CUDA event
read after each step, would undo the overlap it measures). Each (live, overlap) pair runs
``--repeat`` times, in turn. Llama-2-7B shape, random
weights, bf16, paged KV memory of ``--kv-dtype``.

Usage: python bench/probes/llm_step_gap_probe.py --out OUT.json [--live 256] [--prompt 128 --new 128]
    [--rows 512] [--kv-dtype fp8] [--max-prefill-tokens 1024]
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # bench/: common.py
from common import machine_info, write_json  # noqa: E402


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True)
    ap.add_argument("--live", default="256", help="requests kept live, a list (e.g. 64,256)")
    ap.add_argument("--prompt", type=int, default=128)
    ap.add_argument("--new", type=int, default=128)
    ap.add_argument("--rows", type=int, default=512)
    ap.add_argument("--kv-dtype", default="fp8", choices=("auto", "fp8"))
    ap.add_argument("--max-prefill-tokens", type=int, default=1024)
    ap.add_argument("--steps", type=int, default=400)
    ap.add_argument("--warm", type=int, default=150)
    ap.add_argument("--shape", default="llama2-7b", choices=("llama2-7b", "tiny"))
    ap.add_argument("--device", default="cuda", help="cpu: a smoke run (with --shape tiny)")
    ap.add_argument("--overlap", default="off,on", help="the Scheduler's overlap, each in turn (off, on)")
    ap.add_argument("--repeat", type=int, default=2, help="rounds of every (live, overlap) pair")
    args = ap.parse_args()

    from fullthrottle.cli.generate import random_llama
    from fullthrottle.workloads.llm.checks import pages_that_fit
    from fullthrottle.workloads.llm.generate import Generator
    from fullthrottle.workloads.llm.kv_pages import PAGE
    from fullthrottle.workloads.llm.scheduler import Scheduler

    dev = torch.device(args.device)
    cuda = dev.type == "cuda"
    model = random_llama(args.shape, dev, torch.bfloat16 if cuda else torch.float32)
    vocab = model.cfg.vocab_size
    pages = pages_that_fit(model, PAGE, args.kv_dtype, prefill_tokens=args.max_prefill_tokens) if cuda else 1024

    def sync():
        if cuda:
            torch.cuda.synchronize(dev)

    gen = Generator(
        model,
        max_batch=args.rows,
        max_seq_len=args.prompt + args.new,
        graphs=True,
        kv_pages=pages,
        kv_dtype=args.kv_dtype,
        max_prefill_tokens=args.max_prefill_tokens,
    )
    rnd = random.Random(0)
    res = {"probe": "llm_step_gap", "machine": machine_info(), "settings": vars(args), "points": []}
    runs = [(int(x), o == "on") for x in args.live.split(",") for o in args.overlap.split(",")]
    for live, overlap in runs * args.repeat:
        sched = Scheduler(gen, overlap=overlap)

        def fresh():
            # (end only at max_new_tokens: no stop ids, as the benchmark's requests)
            return sched.submit([rnd.randrange(3, vocab) for _ in range(args.prompt)], args.new, stop_ids=())

        for _ in range(live):
            fresh()
        for _ in range(args.warm):
            for _ in sched.step():
                fresh()
        sync()
        decode_rows, prefills, made0 = [], 0, gen.stats["decode"].items
        t0, c0 = time.perf_counter(), time.thread_time()
        for _ in range(args.steps):  # (nothing here waits for the GPU but the scheduler itself)
            admitted = sched._admissions
            for _ in sched.step():
                fresh()
            decode_rows.append(len(sched.running))
            prefills += sched._admissions > admitted
        sync()
        wall, cpu = time.perf_counter() - t0, time.thread_time() - c0
        pt = {
            "live": live,
            "overlap": overlap,
            "steps": args.steps,
            "wall_ms_per_step": 1e3 * wall / args.steps,
            "step_thread_cpu_ms_per_step": 1e3 * cpu / args.steps,
            "steps_with_admissions": prefills,
            "mean_running": statistics.mean(decode_rows),
            "decoded_tok_per_s": (gen.stats["decode"].items - made0) / wall,
        }
        res["points"].append(pt)
        print(pt, flush=True)
        for s in list(sched.running.values()) + list(sched.waiting):
            sched.cancel(s)
        while sched.busy:
            sched.step()
    write_json(args.out, res)


if __name__ == "__main__":
    main()
