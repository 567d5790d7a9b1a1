"""How many 640x480 JPEGs per second this machine's CPUs can turn into 224x224 crops (issue 01).

No GPU, no pipeline, no queues: N forked processes, each in a loop over the same in-memory JPEGs
for a fixed time, counting finished images; the sum over processes is the ceiling any CPU-decoding
pipeline on this machine can reach with that per-image work. Two kinds of per-image work:

  fullthrottle   fullthrottle.data.preprocess.preprocess (OpenCV decode + torch antialias resize + crop)
  dataloader     what the DataLoader baseline's workers do: PIL open/convert + torchvision v2
                 Resize(256, antialias=True) + CenterCrop(224) on the PIL image + PILToTensor

Each process uses one intra-op thread (torch and OpenCV), as the pipeline's workers do.
Usage: python bench/probes/cpu_decode_ceiling.py --procs 1,8,16 --out cpu_decode_ceiling.json
"""

from __future__ import annotations

import argparse
import io
import multiprocessing as mp
import os
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # bench/: common.py
from common import jpegs_640x480, machine_info, write_json  # noqa: E402

BLOBS: list[bytes] = []


def _work(kind: str):
    import cv2
    import torch

    torch.set_num_threads(1)
    cv2.setNumThreads(1)
    if kind == "fullthrottle":
        from fullthrottle.data.preprocess import preprocess

        return preprocess
    from PIL import Image
    from torchvision.transforms import v2

    # exactly the DataLoader baseline's transform in bench/e2e_cpu_decode.py (Pillow resizes)
    tf = v2.Compose([v2.Resize(256, antialias=True), v2.CenterCrop(224), v2.PILToTensor()])

    def pil(b):
        with Image.open(io.BytesIO(b)) as im:
            return tf(im.convert("RGB"))

    return pil


def _run(kind, seconds, barrier, q):
    fn = _work(kind)
    for b in BLOBS[:20]:  # warm-up: imports and first calls stay outside the timed window
        fn(b)
    barrier.wait()  # every process starts timing together
    n, t0 = 0, time.perf_counter()
    while time.perf_counter() - t0 < seconds:
        fn(BLOBS[n % len(BLOBS)])
        n += 1
    q.put(n / (time.perf_counter() - t0))


def measure(kind: str, procs: int, seconds: float) -> float:
    """Images/s summed over ``procs`` processes running ``kind`` work at the same time."""
    ctx = mp.get_context("fork")
    q, barrier = ctx.Queue(), ctx.Barrier(procs)
    ps = [ctx.Process(target=_run, args=(kind, seconds, barrier, q)) for _ in range(procs)]
    for p in ps:
        p.start()
    total = sum(q.get() for _ in ps)
    for p in ps:
        p.join()
    return total


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--procs", default="1,8,16")
    ap.add_argument("--seconds", type=float, default=4.0)
    ap.add_argument("--out", default="cpu_decode_ceiling.json")
    args = ap.parse_args()
    import cv2

    cv2.setNumThreads(1)  # before any OpenCV call: a fork after its thread pool started can deadlock
    BLOBS.extend(jpegs_640x480())
    try:
        lscpu = subprocess.run(["lscpu"], capture_output=True, text=True, timeout=10).stdout
    except OSError:
        lscpu = ""
    rows = []
    for kind in ("fullthrottle", "dataloader"):
        for n in [int(p) for p in args.procs.split(",")]:
            rate = measure(kind, n, args.seconds)
            rows.append({"work": kind, "processes": n, "img_per_s": rate, "ms_per_img_per_proc": 1e3 * n / rate})
            print(rows[-1], flush=True)
    write_json(
        args.out,
        {
            "benchmark": "cpu_decode_ceiling",
            "machine": machine_info(),
            "cpu_count": os.cpu_count(),
            "sched_affinity": len(os.sched_getaffinity(0)),
            "lscpu": lscpu,
            "images": "640x480 (200 ImageNet samples re-encoded, quality 90)",
            "seconds_per_point": args.seconds,
            "rows": rows,
        },
    )


if __name__ == "__main__":
    main()
