"""``bench/llm_serve.py``'s arguments: the parser, and every value checked before anything is built
or written (a bad one: exit 2 with the reason)."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

VOCAB = {"llama2-7b": 32000, "tiny": 512}  # --shape's vocabulary


def parse_args(doc: str) -> argparse.Namespace:
    """The benchmark's arguments, checked (``--device`` resolved: cpu for ``--shape tiny``, else cuda)."""
    ap = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default="bench/results/llm_serve.json")
    ap.add_argument("--rows", type=int, default=256, help="KV-cache rows (fixed set, offline)")
    ap.add_argument("--mixed-rows", type=int, default=64, help="KV-cache rows for the mixed set (2560 slots each)")
    ap.add_argument("--hf-requests", type=int, default=64, help="requests given to transformers (0: skip it)")
    ap.add_argument("--kv-pages", default="0", help="paged KV memory: N 64-token pages, or auto (0: static rows)")
    ap.add_argument(
        "--kv-dtype",
        default="auto",
        help="paged KV memory's dtype, auto or fp8; a list (auto,fp8): offline runs each, the server the last",
    )
    ap.add_argument(
        "--server-args", default="", help="more serve arguments, e.g. --server-args='--llm-max-prefill-tokens 2048'"
    )
    ap.add_argument(
        "--max-prefill-tokens",
        default="",
        help="offline: the Generator's prefill budget per step, or a list (default: its own)",
    )
    ap.add_argument("--sets", default="128/128,512/256", help="offline: the request sets run")
    ap.add_argument("--concurrency", default="1,16,64,256")
    ap.add_argument("--seconds", type=float, default=20.0)
    ap.add_argument("--client-procs", type=int, default=4)
    ap.add_argument("--parts", default="offline,online")
    ap.add_argument("--shape", default="llama2-7b", choices=sorted(VOCAB), help="tiny: a CPU smoke run")
    ap.add_argument("--device", help="default: cpu for --shape tiny, else cuda")
    ap.add_argument("--scale", type=int, default=1, help="offline requests divided by this (smoke runs)")
    ap.add_argument("--merge", nargs=2, metavar=("OFFLINE", "ONLINE"), help="one result of the two parts' files")
    args = ap.parse_args()
    check_args(ap, args)
    return args


def check_args(ap, args) -> None:
    """Every argument checked before anything is built or written (ap.error: exit 2 with the reason)."""

    def ints(flag: str, text: str, low: int) -> list[int]:
        try:
            vals = [int(x) for x in text.split(",")]
        except ValueError:
            ap.error(f"{flag} takes integers separated by commas, got {text!r}")
        if min(vals) < low:
            ap.error(f"{flag} must be >= {low}, got {text!r}")
        return vals

    args.device = args.device or ("cpu" if args.shape == "tiny" else "cuda")
    if args.merge:
        if missing := [p for p in args.merge if not Path(p).is_file()]:
            ap.error(f"--merge: no such file: {', '.join(missing)}")
        return
    for flag, v, low in (("--rows", args.rows, 1), ("--mixed-rows", args.mixed_rows, 1), ("--scale", args.scale, 1)):
        ints(flag, str(v), low)
    ints("--hf-requests", str(args.hf_requests), 0)
    ints("--client-procs", str(args.client_procs), 1)
    ints("--concurrency", args.concurrency, 1)
    if args.max_prefill_tokens:
        ints("--max-prefill-tokens", args.max_prefill_tokens, 1)
    if args.kv_pages != "auto":
        ints("--kv-pages", args.kv_pages, 0)
    if bad := [d for d in args.kv_dtype.split(",") if d not in ("auto", "fp8")]:
        ap.error(f"--kv-dtype: {', '.join(bad)} is neither auto nor fp8")
    if not args.seconds > 0:
        ap.error(f"--seconds must be > 0, got {args.seconds}")
    parts = args.parts.split(",")
    if bad := [p for p in parts if p not in ("offline", "online")]:
        ap.error(f"--parts: {', '.join(bad)} is neither offline nor online")
    if bad := [x for x in args.sets.split(",") if x not in ("128/128", "512/256")]:
        ap.error(f"--sets: {', '.join(bad)} is no set of this benchmark (128/128, 512/256)")
    if "offline" in parts and min(n for x, n in (("128/128", 512), ("512/256", 256)) if x in args.sets) < args.scale:
        ap.error(f"--scale {args.scale} leaves a set with no request (512 and 256 requests, divided by it)")
    if args.hf_requests and args.shape != "llama2-7b":
        print("note: transformers runs with --shape llama2-7b only: --hf-requests is not used", file=sys.stderr)
