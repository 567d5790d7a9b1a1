"""EfficientNet-Lite0 on the GPU, data already there: the reference package as a user runs it, against
fullthrottle's product API, side by side in one run; and its accuracy on the 200 ImageNet samples.

Peer: ``efficientnet_lite_pytorch.EfficientNet.from_pretrained("efficientnet-lite0", weights_path=...)``
(the package the weights were converted for): fp32 eager and one hand-captured CUDA graph at batch 1;
bf16 channels_last eager and one hand-captured graph at the large batch. Ours: the
:class:`~fullthrottle.workloads.classify.compute.Engine` (``Config()``'s default model, bf16, channels_last, BN folded,
graphs per bucket), fed from pinned uint8 ``(B, 224, 224, 3)`` host buffers: H2D on the copy stream,
normalise + model + softmax + top-5 replayed as one graph per bucket, top-5 D2H, ``staging_slots``
batches in flight; its inference form (BN folded, Triton depthwise convolutions with the activations
fused) against the same Engine with ``FULLTHROTTLE_TRITON=0`` (BN folded by torch.fx, cuDNN). Timing: warm-up first; CUDA events (peer) or synchronize before reading the clock
(ours); median of repeats. ``--compile`` adds the Engine with ``compile=True`` (inductor fusion before
capture).

Usage: python bench/efficientnet.py --out bench/results/efficientnet_lite0.json
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import SAMPLES, capture_graph, engine_ring_loop, events_time, machine_info, write_json  # noqa: E402

BATCHES = (1, 8, 32, 128, 256)


def warm_time(fn, iters: int) -> float:
    """Seconds per call of ``fn`` by CUDA events, after 10 warm-up calls (cuDNN picks its kernels)."""
    for _ in range(10):
        fn()
    return events_time(fn, iters)


def true_label(path: Path) -> str:
    return path.name.split(".")[0].split("_", 1)[1].replace("_", " ")


def peer(path: str, big: int) -> dict:
    """The reference implementation as its users run it: img/s at batch 1 and ``big``."""
    from efficientnet_lite_pytorch import EfficientNet

    out = {}
    with torch.inference_mode():
        m32 = EfficientNet.from_pretrained("efficientnet-lite0", weights_path=path).eval().cuda()
        x1 = torch.randn(1, 3, 224, 224, device="cuda")
        out["batch1_fp32_eager"] = 1 / warm_time(lambda: m32(x1), 200)
        g = capture_graph(lambda: m32(x1))
        out["batch1_fp32_graph"] = 1 / warm_time(g.replay, 500)
        del g
        mb = m32.to(torch.bfloat16).to(memory_format=torch.channels_last)
        xb = torch.randn(big, 3, 224, 224, device="cuda", dtype=torch.bfloat16).contiguous(
            memory_format=torch.channels_last
        )
        out[f"batch{big}_bf16_cl_eager"] = big / warm_time(lambda: mb(xb), 30)
        g = capture_graph(lambda: mb(xb))
        out[f"batch{big}_bf16_cl_graph"] = big / warm_time(g.replay, 60)
        del g
    torch.cuda.empty_cache()
    return out


def product(batches: list[int], **cfg) -> dict:
    """Our Engine: capture time and img/s per batch size (3000 batches at batch 1, >= 300 and >= 20k
    images otherwise, three times; the median)."""
    from fullthrottle import Config
    from fullthrottle.workloads.classify.compute import Engine

    t0 = time.perf_counter()
    eng = Engine(Config(device="cuda", dtype="bfloat16", max_batch_size=max(batches), staging_slots=3, **cfg))
    build_s = time.perf_counter() - t0
    info = eng.runner.info
    rng = torch.Generator().manual_seed(0)
    for slot in eng.slots:
        slot.host_in.copy_(torch.randint(0, 256, slot.host_in.shape, dtype=torch.uint8, generator=rng))
    rows = {}
    for bs in batches:
        iters = max(300, min(3000, 20_000 // bs))
        engine_ring_loop(eng, bs, 100)  # warm-up
        times = []
        for _ in range(3):
            torch.cuda.synchronize()
            t = time.perf_counter()
            engine_ring_loop(eng, bs, iters)
            times.append(time.perf_counter() - t)
        rows[bs] = bs * iters / statistics.median(times)
        print(f"  product {cfg or 'default'} batch {bs}: {rows[bs]:.0f} img/s", flush=True)
    res = {
        "img_per_s": rows,
        "engine_build_s": build_s,
        "capture_total_s": info.total_capture_s,
        "capture_ms_per_bucket": info.capture_ms,
        "bn_folded": eng.bn_folded,
        "fused_form": eng.model_fused is not None,
        "kept": info.variant,
        "graph_info": info.format(),
    }
    del eng
    torch.cuda.empty_cache()
    return res


def accuracy() -> dict:
    """Top-1 on the 200 samples: fp32 eager and bf16 graphs (the default), and their agreement."""
    from fullthrottle import Config, Pipeline

    paths = sorted(SAMPLES.glob("*.JPEG"))
    truth = [true_label(p) for p in paths]
    runs = {}
    for name, cfg in (
        ("fp32_eager", dict(dtype="float32", graphs=False, fold_bn=False)),
        ("bf16_graphs", dict(dtype="bfloat16")),
    ):
        with Pipeline(Config(device="cuda", max_batch_size=64, **cfg)) as pipe:
            res = pipe.classify(paths)
        runs[name] = [r.labels[0] if r.ok else None for r in res]
    ref = runs["fp32_eager"]
    return {
        name: {
            "top1": float(np.mean([a == t for a, t in zip(labs, truth)])),
            "top1_agreement_with_fp32_eager": float(np.mean([a == b for a, b in zip(labs, ref)])),
        }
        for name, labs in runs.items()
    }


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default="bench/results/efficientnet_lite0.json")
    ap.add_argument("--batches", default=",".join(map(str, BATCHES)))
    ap.add_argument("--compile", action="store_true", help="also the Engine with compile=True")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        sys.exit("needs CUDA")
    from fullthrottle.workloads.classify.models import load_model

    batches = [int(b) for b in args.batches.split(",")]
    _, path = load_model("efficientnet_lite0")
    payload = {
        "benchmark": "efficientnet_lite0",
        "machine": machine_info(),
        "inputs": "random uint8 crops (speed); the 200 ImageNet samples (accuracy)",
        "peer": "efficientnet_lite_pytorch 0.1.0 (reference implementation), same weights",
    }
    payload["peer_img_per_s"] = peer(str(path), max(batches))
    print("peer:", payload["peer_img_per_s"], flush=True)
    payload["product"] = product(batches)
    os.environ["FULLTHROTTLE_TRITON"] = "0"  # the same model folded by torch.fx, cuDNN depthwise, no Triton
    payload["product_without_triton"] = product(batches)
    del os.environ["FULLTHROTTLE_TRITON"]
    if args.compile:
        payload["product_compile"] = product(batches, compile=True)
    payload["accuracy_200_samples"] = accuracy()
    print(payload["accuracy_200_samples"], flush=True)
    write_json(args.out, payload)


if __name__ == "__main__":
    main()
