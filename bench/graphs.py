"""Eager vs CUDA graphs for ResNet18, side by side in one run (issue 02).

For each batch size: (1) raw eager bf16 channels_last on a device-resident input; (2) raw graph
replay of the same model (one graph captured for that size by hand); (3) fullthrottle's product API:
the Engine with graphs, fed from pinned uint8 (B,224,224,3) host buffers: H2D on the copy stream,
normalise + model + softmax + top-k replayed as one graph per bucket, top-k D2H into pinned memory,
``staging_slots`` batches in flight. Times: CUDA events / synchronize before reading clocks, warm-up
first, median of repeats.

Usage: python bench/graphs.py --out bench/results/graphs_resnet18.json
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch
import torchvision

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import capture_graph, engine_ring_loop, machine_info, write_json  # noqa: E402

BATCHES = (1, 8, 32, 128, 512, 1024)


def time_loop(step, iters, repeats=5):
    """Median seconds per call of ``step`` over ``repeats`` timed loops of ``iters`` calls."""
    for _ in range(3):
        step()
    torch.cuda.synchronize()
    out = []
    for _ in range(repeats):
        t0 = torch.cuda.Event(enable_timing=True)
        t1 = torch.cuda.Event(enable_timing=True)
        t0.record()
        for _ in range(iters):
            step()
        t1.record()
        t1.synchronize()
        out.append(t0.elapsed_time(t1) / 1e3 / iters)
    return statistics.median(out)


def iters_for(bs):
    return max(5, min(200, 4096 // bs))


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default="bench/results/graphs_resnet18.json")
    ap.add_argument("--batches", default=",".join(map(str, BATCHES)))
    args = ap.parse_args()
    if not torch.cuda.is_available():
        sys.exit("needs CUDA")
    from fullthrottle import Config
    from fullthrottle.workloads.classify.compute import Engine

    batches = [int(b) for b in args.batches.split(",")]
    torch.manual_seed(0)
    model = torchvision.models.resnet18().eval().cuda().to(torch.bfloat16).to(memory_format=torch.channels_last)
    rows = []
    with torch.inference_mode():
        for bs in batches:
            x = torch.randn(bs, 3, 224, 224, device="cuda", dtype=torch.bfloat16).contiguous(
                memory_format=torch.channels_last
            )
            eager_s = time_loop(lambda: model(x), iters_for(bs))
            g = capture_graph(lambda: model(x), warmup=2)
            graph_s = time_loop(g.replay, iters_for(bs))
            del g
            rows.append({"batch": bs, "eager_img_per_s": bs / eager_s, "raw_graph_img_per_s": bs / graph_s})
            print(rows[-1], flush=True)
        torch.cuda.empty_cache()

    # the product API: buckets up to the largest batch, capture timed; with BatchNorm folded into the
    # convolutions (the default) and without (the same graph as the raw columns), side by side
    info = build_s = None
    for fold in (True, False):
        key = "fullthrottle_pinned_u8_img_per_s" if fold else "fullthrottle_unfolded_bn_img_per_s"
        t0 = time.perf_counter()
        eng = Engine(
            Config(
                model=model,
                device="cuda",
                dtype="bfloat16",
                channels_last=True,
                graphs=True,
                fold_bn=fold,
                max_batch_size=max(batches),
                staging_slots=3,
            )
        )
        if fold:
            build_s, info = time.perf_counter() - t0, eng.runner.info
            print(info.format(), "BN folded:", eng.bn_folded, flush=True)
        rng = torch.Generator().manual_seed(0)
        for slot in eng.slots:
            slot.host_in.copy_(torch.randint(0, 256, slot.host_in.shape, dtype=torch.uint8, generator=rng))
        for row in rows:
            bs = row["batch"]
            iters = max(iters_for(bs) * 2, -(-40_000 // bs))  # >= 40k images: fill and drain of the ring amortised

            def run_many():
                engine_ring_loop(eng, bs, iters)

            run_many()  # warm-up
            times = []
            for _ in range(3):
                torch.cuda.synchronize()
                t = time.perf_counter()
                run_many()
                times.append(time.perf_counter() - t)
            row[key] = bs * iters / statistics.median(times)
            row["graph_over_eager"] = row["raw_graph_img_per_s"] / row["eager_img_per_s"]
            print(row, flush=True)
        del eng
        torch.cuda.empty_cache()
    payload = {
        "benchmark": "graphs_resnet18",
        "machine": machine_info(),
        "model": "resnet18 bf16 channels_last, random weights; inputs random",
        "product_api": "Engine(graphs=True): pinned uint8 -> H2D copy stream -> graph(normalise+model+"
        "softmax+top5) -> D2H pinned, 3 slots in flight; BatchNorm folded into the "
        "convs (default fold_bn=True; the unfolded column runs the raw columns' model)",
        "capture_ms_per_bucket": info.capture_ms,
        "capture_total_s": info.total_capture_s,
        "engine_build_s": build_s,
        "graph_pool_bytes": info.pool_bytes,
        "rows": rows,
    }
    write_json(args.out, payload)
    print(f"{'batch':>6}{'eager':>10}{'raw graph':>11}{'product':>10}{'unfolded':>10}{'graph/eager':>13}")
    for r in rows:
        print(
            f"{r['batch']:>6}{r['eager_img_per_s']:>10.0f}{r['raw_graph_img_per_s']:>11.0f}"
            f"{r['fullthrottle_pinned_u8_img_per_s']:>10.0f}{r['fullthrottle_unfolded_bn_img_per_s']:>10.0f}"
            f"{r['graph_over_eager']:>13.2f}"
        )
    print(f"capture of {len(info.capture_ms)} buckets: {info.total_capture_s:.2f} s")


if __name__ == "__main__":
    main()
