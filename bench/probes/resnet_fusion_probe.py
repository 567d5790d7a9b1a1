"""ResNet18 model variants as raw CUDA-graph replays, side by side in one run (issue 02).

bf16, channels_last, a device-resident input, one graph per variant and batch size, timed with CUDA
events round by round (interleaved, median of rounds):

  unfolded        torchvision's model as is (eval BatchNorm kernels)
  folded          BatchNorm folded into the convolutions (fullthrottle.workloads.classify.fuse.fold_batchnorm)
  folded_fused    + conv->relu and conv->add->relu as single cuDNN calls (fuse.fuse_conv_relu)
  inductor        torch.compile (default mode) of the folded model, captured by hand
  inductor_autotune  (--autotune) torch.compile(mode="max-autotune-no-cudagraphs"), captured by hand

Each variant's top-1 is compared with the unfolded model's on the same random input.
Usage: python bench/probes/resnet_fusion_probe.py --batches 512,1024 --out resnet_fusion_probe.json
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch
import torchvision

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # bench/: common.py
from common import capture_graph, events_time, machine_info, write_json  # noqa: E402


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batches", default="512,1024")
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--autotune", action="store_true")
    ap.add_argument("--no-inductor", action="store_true")
    ap.add_argument("--out", default="resnet_fusion_probe.json")
    args = ap.parse_args()
    from fullthrottle.workloads.classify.fuse import fold_batchnorm, fuse_conv_relu

    torch.manual_seed(0)
    base = torchvision.models.resnet18().eval()
    folded, _ = fold_batchnorm(base)
    fused, _ = fold_batchnorm(base)
    n_fused = fuse_conv_relu(fused)
    prep = lambda m: m.cuda().to(torch.bfloat16).to(memory_format=torch.channels_last)  # noqa: E731
    variants = {"unfolded": prep(base), "folded": prep(folded), "folded_fused": prep(fused)}
    compile_s = {}
    modes = [] if args.no_inductor else [("inductor", "default")]
    if args.autotune:
        modes.append(("inductor_autotune", "max-autotune-no-cudagraphs"))
    for name, mode in modes:
        f2, _ = fold_batchnorm(base)
        variants[name] = torch.compile(prep(f2), mode=mode)
    rows = []
    for bs in [int(b) for b in args.batches.split(",")]:
        iters = max(8, 20_000 // bs)
        x = torch.randn(bs, 3, 224, 224, device="cuda", dtype=torch.bfloat16).contiguous(
            memory_format=torch.channels_last
        )
        graphs, top1 = {}, {}
        with torch.inference_mode():
            for name, m in variants.items():
                t = time.perf_counter()
                try:
                    graphs[name] = capture_graph(lambda m=m: m(x))
                except Exception as e:  # noqa: BLE001 - a variant that cannot run is reported, not fatal
                    print(f"bs {bs} {name}: {type(e).__name__}: {e}", flush=True)
                    continue
                compile_s[f"{name}@{bs}"] = time.perf_counter() - t
                top1[name] = m(x).argmax(-1)
        times = {k: [] for k in graphs}
        for _ in range(args.rounds):
            for name, g in graphs.items():
                times[name].append(events_time(g.replay, iters))
        row = {"batch": bs}
        for name in graphs:
            row[name] = {
                "img_per_s": bs / statistics.median(times[name]),
                "top1_agree_with_unfolded": (top1[name] == top1["unfolded"]).float().mean().item(),
            }
        rows.append(row)
        print(bs, {k: round(v["img_per_s"]) for k, v in row.items() if k != "batch"}, flush=True)
        del graphs
        torch.cuda.empty_cache()
    write_json(
        args.out,
        {
            "benchmark": "resnet_fusion_probe",
            "machine": machine_info(),
            "fused_pairs": n_fused,
            "capture_or_compile_s": compile_s,
            "rows": rows,
        },
    )


if __name__ == "__main__":
    main()
