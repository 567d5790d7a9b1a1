"""Decode + resize throughput of N threads for several per-image recipes (GIL hand-offs matter).

Each recipe turns 640x480 JPEG bytes into a (224, 224, 3) uint8 crop; the recipes differ in how many
GIL-releasing calls they make per image. Usage: python bench/probes/threads_probe.py [--threads 8,16,32]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import cv2
import numpy as np
import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # bench/: common.py
sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "src"))
from common import jpegs_640x480, machine_info, write_json  # noqa: E402

from fullthrottle.cli.benchmarks import _rate  # noqa: E402
from fullthrottle.data.preprocess import preprocess  # noqa: E402


def decode_only(d):
    return cv2.imdecode(np.frombuffer(d, np.uint8), cv2.IMREAD_COLOR)


def cv2_area(d):
    a = cv2.imdecode(np.frombuffer(d, np.uint8), cv2.IMREAD_COLOR)
    a = cv2.resize(a, (341, 256), interpolation=cv2.INTER_AREA)
    return cv2.cvtColor(a[16:240, 58:282], cv2.COLOR_BGR2RGB)


def torch_min(d):
    a = cv2.imdecode(np.frombuffer(d, np.uint8), cv2.IMREAD_COLOR_RGB)
    t = torch.from_numpy(a).permute(2, 0, 1)[None]
    t = F.interpolate(t, size=(256, 341), mode="bilinear", antialias=True)
    return t[0].permute(1, 2, 0).numpy()[16:240, 58:282]


RECIPES = {"decode_only": decode_only, "current_preprocess": preprocess, "cv2_area": cv2_area, "torch_min": torch_min}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--threads", default="1,8,16,32")
    ap.add_argument("--out", default="bench/probes/results/threads_probe.json")
    args = ap.parse_args()
    torch.set_num_threads(1)
    cv2.setNumThreads(1)
    blobs = jpegs_640x480()
    rows = []
    for name, fn in RECIPES.items():
        fn(blobs[0])
        for n in [int(x) for x in args.threads.split(",")]:
            r = _rate(lambda k, fn=fn: fn(blobs[k % len(blobs)]), n, 2.0)
            rows.append({"recipe": name, "threads": n, "img_per_s": r})
            print(f"{name:<20}{n:>4}{r:>10.0f}", flush=True)
    write_json(args.out, {"benchmark": "threads_probe", "machine": machine_info(), "rows": rows})


if __name__ == "__main__":
    main()
