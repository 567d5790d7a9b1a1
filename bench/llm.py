"""LLM decode throughput (issue 06): fullthrottle's Generator (static KV cache, decode step as CUDA graphs
per batch bucket) against transformers eager, Llama-2-7B shape, bf16, random weights, same run.

Usage: python bench/llm.py --out bench/results/llm_llama2_7b.json [--batches 1,8,32,64] [--no-hf]
Batch 1: prompt 128, 200 new tokens; larger batches: prompt 128, 128 new tokens (tokens/s over all rows).
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import machine_info, write_json  # noqa: E402

from fullthrottle.workloads.llm.generate import GenerateStats, Generator  # noqa: E402
from fullthrottle.workloads.llm.llama import Llama, LlamaConfig  # noqa: E402


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default="bench/results/llm_llama2_7b.json")
    ap.add_argument("--batches", default="1,8,32,64")
    ap.add_argument("--no-hf", action="store_true", help="skip the transformers eager baseline")
    args = ap.parse_args()
    batches = [int(b) for b in args.batches.split(",")]
    cfg = LlamaConfig.llama2_7b()
    t0 = time.perf_counter()
    torch.manual_seed(0)
    torch.set_default_dtype(torch.bfloat16)
    with torch.device("cuda"):
        model = Llama(cfg).eval()
    torch.set_default_dtype(torch.float32)
    model.inv_freq = model.inv_freq.float()
    torch.cuda.synchronize()
    init_s = time.perf_counter() - t0
    t1 = time.perf_counter()
    gen = Generator(model, max_batch=max(batches), max_seq_len=128 + 200, graphs=True)
    gen_buckets = gen.buckets
    capture_s = time.perf_counter() - t1
    rows = []
    g = torch.Generator().manual_seed(0)
    for b in batches:
        new = 200 if b == 1 else 128
        prompts = [torch.randint(0, cfg.vocab_size, (128,), generator=g).tolist() for _ in range(b)]
        gen.generate(prompts, max_new_tokens=8)  # warm-up
        st = GenerateStats()
        gen.generate(prompts, max_new_tokens=new, stats=st)
        rows.append(
            {
                "batch": b,
                "new_tokens_per_row": new,
                "tok_per_s": st.tokens_per_s,
                "prefill_s": st.prefill_s,
                "decode_s": st.decode_s,
            }
        )
        print(rows[-1], flush=True)
    hf = None
    if not args.no_hf:
        import transformers

        del gen
        torch.cuda.empty_cache()
        hc = transformers.LlamaConfig(**{k: v for k, v in cfg.__dict__.items() if k not in ("extra", "head_dim")})
        with torch.device("cuda"):
            m = transformers.LlamaForCausalLM(hc).to(torch.bfloat16).eval()
        ids = torch.randint(0, cfg.vocab_size, (1, 128), device="cuda")
        m.generate(ids, max_new_tokens=8, do_sample=False)
        torch.cuda.synchronize()
        t = time.perf_counter()
        out = m.generate(ids, max_new_tokens=200, min_new_tokens=200, do_sample=False)
        torch.cuda.synchronize()
        hf = {"batch": 1, "tok_per_s": (out.shape[1] - 128) / (time.perf_counter() - t)}
        print("transformers eager", hf, flush=True)
    write_json(
        args.out,
        {
            "benchmark": "llm_llama2_7b",
            "machine": machine_info(),
            "model": "Llama-2-7B shape, bf16, random weights",
            "init_s": init_s,
            "graph_capture_s": capture_s,
            "buckets": list(gen_buckets),
            "rows": rows,
            "baseline_transformers_eager": hf,
        },
    )


if __name__ == "__main__":
    main()
