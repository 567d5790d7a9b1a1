"""Text embeddings throughput (issue 07): fullthrottle's Embedder (length buckets, graphs) against
sentence-transformers ``encode`` on the same corpus, same run.

Corpus: docstrings of Python's standard library (real English, mixed lengths). Reports texts/s over
the corpus, and the latency of one short text (median of repeats); our pass over the corpus is the median of
``--repeats``, next to the tokenizer alone on the same texts. Synchronised timing (the results
come back to the host as numpy).

Usage: python bench/embed.py --out bench/results/embed_minilm.json [--device cuda] [--dtype float16] [--quick]
"""

from __future__ import annotations

import argparse
import importlib
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import machine_info, write_json  # noqa: E402

from fullthrottle.workloads.embed import Embedder, cosine, default_model_dir  # noqa: E402


def stdlib_docstrings(limit: int | None = None) -> list[str]:
    out = []
    for m in sorted(sys.stdlib_module_names):
        if m.startswith("_") or m in ("antigravity", "this", "idlelib", "tkinter", "turtle", "turtledemo"):
            continue
        try:
            mod = importlib.import_module(m)
        except Exception:  # noqa: BLE001
            continue
        for name in sorted(dir(mod)):
            d = getattr(getattr(mod, name, None), "__doc__", None)
            if isinstance(d, str) and d.strip():
                out.append(" ".join(d.split()))
    out = list(dict.fromkeys(out))
    return out[:limit] if limit else out


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default="bench/results/embed_minilm.json")
    ap.add_argument("--device", default="auto")
    ap.add_argument("--dtype", default=None)
    ap.add_argument("--quick", action="store_true", help="300 texts (a CPU check)")
    ap.add_argument("--repeats", type=int, default=7, help="timed passes over the corpus (median reported)")
    args = ap.parse_args()
    import torch
    from sentence_transformers import SentenceTransformer

    texts = stdlib_docstrings(300 if args.quick else None)
    words = sorted(len(t.split()) for t in texts)
    emb = Embedder(device=args.device, dtype=args.dtype)
    dev = str(emb.device)
    emb.embed(texts[:512])  # warm-up: captures the graphs of the shapes used
    emb.embed(texts)
    runs = []
    for _ in range(args.repeats):  # the corpus takes ~0.1 s: the median of several passes
        t = time.perf_counter()
        ours = emb.embed(texts).vectors
        runs.append(time.perf_counter() - t)
    ours_s = statistics.median(runs)
    tok = []
    for _ in range(args.repeats):  # the tokenizer alone (all cores), the CPU floor of a pass
        t = time.perf_counter()
        emb.tokenize(texts)
        tok.append(time.perf_counter() - t)
    short = ["how do I open a file?"]
    lat = []
    for _ in range(50):
        t = time.perf_counter()
        emb.embed(short)
        lat.append(time.perf_counter() - t)
    st = SentenceTransformer(str(default_model_dir()), device=dev)
    if emb.dtype == torch.float16:
        st = st.half()
    rows = {}
    for bs in (32, 256):
        st.encode(texts[:512], batch_size=bs)
        t = time.perf_counter()
        ref = st.encode(texts, batch_size=bs)
        rows[f"sentence_transformers_bs{bs}_texts_per_s"] = len(texts) / (time.perf_counter() - t)
    st_lat = []
    for _ in range(50):
        t = time.perf_counter()
        st.encode(short)
        st_lat.append(time.perf_counter() - t)
    payload = {
        "benchmark": "embed_minilm",
        "machine": machine_info(),
        "device": dev,
        "dtype": str(emb.dtype),
        "texts": len(texts),
        "words_median": words[len(words) // 2],
        "words_p90": words[int(len(words) * 0.9)],
        "fullthrottle_texts_per_s": len(texts) / ours_s,
        "fullthrottle_pass_s": runs,
        "tokenize_only_texts_per_s": len(texts) / statistics.median(tok),
        "fullthrottle_one_short_text_ms": 1e3 * statistics.median(lat),
        "sentence_transformers_one_short_text_ms": 1e3 * statistics.median(st_lat),
        "min_cosine_vs_sentence_transformers": float(cosine(ours, ref).min()),
        **rows,
    }
    write_json(args.out, payload)
    print({k: v for k, v in payload.items() if k != "machine"})


if __name__ == "__main__":
    main()
