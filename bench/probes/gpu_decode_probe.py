"""Where the GPU decode thread's time goes (issue 04): per-image cost of each phase of a batch.

Phases, each timed with the device synchronised: wrap the JPEG bytes as tensors; nvJPEG batched
decode (``torchvision.io.decode_jpeg(list, device="cuda")``); batched resize + crop
(:func:`fullthrottle.data.gpu_resize.resize_crop_batch`). Measured three ways on the same images: idle host;
with 16 busy processes at nice 5 (the decoder workers' load); with a Python thread spinning under
the GIL (the pipeline's other threads).

Usage: python bench/probes/gpu_decode_probe.py --out bench/probes/results/gpu_decode_probe.json
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # bench/: common.py
from common import jpegs_640x480, machine_info, sample_jpegs, write_json  # noqa: E402


def phases(blobs, device):
    from torchvision.io import ImageReadMode, decode_jpeg

    from fullthrottle.data.gpu_decode import gpu_eligible
    from fullthrottle.data.gpu_resize import resize_crop_batch

    blobs = [b for b in blobs if gpu_eligible(b)[0]]
    t0 = time.perf_counter()
    tensors = [torch.frombuffer(bytearray(b), dtype=torch.uint8) for b in blobs]
    t1 = time.perf_counter()
    imgs = decode_jpeg(tensors, mode=ImageReadMode.RGB, device=device)
    torch.cuda.synchronize()
    t2 = time.perf_counter()
    out = torch.empty((len(imgs), 224, 224, 3), dtype=torch.uint8, device=device)
    resize_crop_batch(imgs, out)
    torch.cuda.synchronize()
    t3 = time.perf_counter()
    n = len(blobs)
    return {
        "wrap_us": 1e6 * (t1 - t0) / n,
        "decode_us": 1e6 * (t2 - t1) / n,
        "resize_us": 1e6 * (t3 - t2) / n,
        "total_img_per_s": n / (t3 - t0),
    }


def measure(blobs_all, bs, device, reps=8):
    rows = []
    for i in range(reps + 2):
        b = [blobs_all[(i * bs + j) % len(blobs_all)] for j in range(bs)]
        r = phases(b, device)
        if i >= 2:
            rows.append(r)
    return {k: statistics.median(r[k] for r in rows) for k in rows[0]}


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default="bench/probes/results/gpu_decode_probe.json")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        sys.exit("needs CUDA")
    dev = torch.device("cuda")
    sets = {"640x480": jpegs_640x480(), "mixed": sample_jpegs()}
    res = {}
    for cond in ("idle", "16 busy processes", "GIL-holding thread"):
        procs, stop = [], threading.Event()
        if cond == "16 busy processes":
            procs = [subprocess.Popen(["nice", "-n", "5", sys.executable, "-c", "while True: pass"]) for _ in range(16)]
            time.sleep(0.5)
        if cond == "GIL-holding thread":

            def spin():
                x = 0
                while not stop.is_set():
                    x += 1

            threading.Thread(target=spin, daemon=True).start()
        for name, blobs in sets.items():
            for bs in (32, 128, 256):
                r = measure(blobs, bs, dev)
                res[f"{cond} | {name} | batch {bs}"] = r
                print(cond, name, bs, {k: round(v, 1) for k, v in r.items()}, flush=True)
        stop.set()
        for p in procs:
            p.kill()
            p.wait()
    write_json(args.out, {"benchmark": "gpu_decode_probe", "machine": machine_info(), "results": res})


if __name__ == "__main__":
    main()
