"""Probe: does a decode step overlap with a long prefill when each runs on its own CUDA stream?

A long prefill forward is bound by arithmetic (the matrix products of ``--prefill-tokens`` tokens),
a decode step at a large batch mostly by memory (every row's keys and values, the weights). Run
side by side on two streams, the GPU could do both in less than their sum. This measures, with
CUDA events and a synchronize around each case, on the Llama-2-7B shape (random weights, bf16,
paged KV memory):

- ``decode``: ``--replays`` replays of the decode graph of ``--rows`` running rows at position
  ``--pos`` (the graph the scheduler replays), alone;
- ``prefill``: one eager packed prefill of ``--prefill-tokens`` tokens (prompts of
  ``--prompt-len``) into other rows, alone;
- ``both``: the two launched together, the decode replays on a second stream (normal priority,
  and high priority), each stream's own span timed by its events.

The rows' contents are random and the two cases share no rows or pages; the tokens made are
thrown away. Usage: python bench/probes/llm_concurrent_probe.py --out OUT.json
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from common import machine_info, write_json  # noqa: E402


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True)
    ap.add_argument("--rows", type=int, default=256, help="running rows the decode graph steps")
    ap.add_argument("--pos", type=int, default=640, help="their position (keys and values read per row)")
    ap.add_argument("--prefill-tokens", type=int, default=16384)
    ap.add_argument("--prompt-len", type=int, default=512)
    ap.add_argument("--replays", type=int, default=16)
    ap.add_argument("--kv-dtype", default="fp8", choices=("auto", "fp8"))
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--shape", default="llama2-7b", choices=("llama2-7b", "tiny"))
    args = ap.parse_args()

    from fullthrottle.cli.generate import random_llama
    from fullthrottle.workloads.llm.generate import Generator
    from fullthrottle.workloads.llm.kv_pages import PAGE

    dev = torch.device("cuda")
    model = random_llama(args.shape, dev, torch.bfloat16)
    n_pf = args.prefill_tokens // args.prompt_len
    max_len = max(args.pos + 64, args.prompt_len)
    rows = args.rows + n_pf + 1
    pages = (args.rows * -(-(args.pos + 64) // PAGE)) + n_pf * -(-args.prompt_len // PAGE) + 64
    gen = Generator(
        model,
        max_batch=rows,
        max_seq_len=max_len,
        graphs=True,
        kv_pages=pages,
        kv_dtype=args.kv_dtype,
        max_prefill_tokens=args.prefill_tokens,
        buckets=[args.rows],
    )
    vocab = model.cfg.vocab_size
    g = torch.Generator().manual_seed(0)
    for r in range(args.rows):  # decode rows: pages for their positions, their tokens random
        gen.kv.reserve(r, args.pos + 32)
    gen.pos[: args.rows] = args.pos
    gen.done[: args.rows] = False
    gen.tok[: args.rows, 0] = torch.randint(3, vocab, (args.rows,), generator=g).to(dev)
    pf_rows = list(range(args.rows, args.rows + n_pf))
    for r in pf_rows:
        gen.kv.reserve(r, args.prompt_len + 1)
    prompts = [torch.randint(3, vocab, (args.prompt_len,), generator=g).tolist() for _ in pf_rows]
    pieces = [(r, p, 0, len(p)) for r, p in zip(pf_rows, prompts)]
    kv = next(x for x in gen.kv_buckets if x >= args.pos + args.replays)
    key = (args.rows, True, kv)
    assert key in gen.graphs, f"no decode graph {key}: {sorted(gen.graphs)[:6]}"

    def decode(n):
        gen.pos[: args.rows] = args.pos  # (in place, graph-safe: every replay reads the same slots)
        for _ in range(n):
            gen.graph_set.replay(key)

    def prefill():
        with torch.inference_mode():
            gen.prefill(pieces)

    def timed(fn, stream):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        with torch.cuda.stream(stream):
            a.record(stream)
            fn()
            b.record(stream)
        return a, b

    main_s = torch.cuda.current_stream(dev)
    side = {"normal": torch.cuda.Stream(dev), "high": torch.cuda.Stream(dev, priority=-1)}
    prefill()
    decode(2)
    torch.cuda.synchronize()
    res = {"probe": "llm_concurrent", "machine": machine_info(), "settings": vars(args), "rounds": []}
    for _ in range(args.rounds):
        rnd = {}
        torch.cuda.synchronize()
        a, b = timed(lambda: decode(args.replays), main_s)
        torch.cuda.synchronize()
        rnd["decode_ms"] = a.elapsed_time(b)
        a, b = timed(prefill, main_s)
        torch.cuda.synchronize()
        rnd["prefill_ms"] = a.elapsed_time(b)
        for name, s in side.items():
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            s.wait_stream(main_s)
            da, db = timed(lambda: decode(args.replays), s)
            pa, pb = timed(prefill, main_s)
            torch.cuda.synchronize()
            wall = 1e3 * (time.perf_counter() - t0)
            rnd[f"both_{name}"] = {
                "wall_ms": wall,
                "decode_span_ms": da.elapsed_time(db),
                "prefill_span_ms": pa.elapsed_time(pb),
                "span_ms": max(pa.elapsed_time(db), pa.elapsed_time(pb), da.elapsed_time(pb), da.elapsed_time(db)),
            }
        rnd["sum_ms"] = rnd["decode_ms"] + rnd["prefill_ms"]
        res["rounds"].append(rnd)
        print(rnd, flush=True)
    write_json(args.out, res)


if __name__ == "__main__":
    main()
