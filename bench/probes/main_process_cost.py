"""CPU the main process spends per image, per thread, with decoder processes (issue 01). CPU only.

The decoder processes do the pixels; the main process's threads (load, dispatcher, batcher, compute,
decode) hand each image along, and on the H200 machine they used about one of the 16 cores
(bench/probes/results/e2e_cpu_decode_640x480.json). Here decoding is made almost free (tiny JPEGs,
8x8 crops) and the model is a linear layer on the CPU, so the main process's own cost shows:
microseconds of CPU per image for each of its threads (``time.thread_time`` of each stage's thread).

With ``--gpu-procs N`` the GPU decode path's side of the main process is measured too: N stand-in
GPU decoder processes answer every batch at once (their crops are left as they are), so what remains
is this process's own work per image: routing, the feeder threads, batching, compute and results.

Usage: python bench/probes/main_process_cost.py --n 20000 [--gpu-procs 6] --out main_process_cost.json
"""

from __future__ import annotations

import argparse
import collections
import sys
import threading
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # bench/: common.py
from common import machine_info, write_json  # noqa: E402


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--n", type=int, default=20000)
    ap.add_argument("--threads", type=int, default=2, help="decoder processes")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--gpu-procs", type=int, default=0, help="stand-in GPU decoder processes (0: none)")
    ap.add_argument("--out", default="main_process_cost.json")
    args = ap.parse_args()
    import cv2
    import torch
    from torch import nn

    import fullthrottle.data.load as ld
    import fullthrottle.workloads.classify.run as pl
    from fullthrottle import Pipeline

    cpu = collections.Counter()
    guard0, loader0 = pl.Run._guard, ld.Loader._thread_main

    def guard(self, fn):  # every stage thread adds its CPU time when it ends
        inner = guard0(self, fn)

        def run():
            t = time.thread_time()
            try:
                inner()
            finally:
                cpu[threading.current_thread().name.rstrip("0123456789").rstrip("-")] += time.thread_time() - t

        return run

    def loader_main(self):
        t = time.thread_time()
        try:
            return loader0(self)
        finally:
            cpu["ft-load"] += time.thread_time() - t

    pl.Run._guard, ld.Loader._thread_main = guard, loader_main
    rng = np.random.default_rng(0)
    blobs = [cv2.imencode(".jpg", rng.integers(0, 255, (64, 64, 3), dtype=np.uint8))[1].tobytes() for _ in range(50)]

    class Tiny(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = nn.Linear(3, 1000)

        def forward(self, x):
            return self.fc(x.mean((2, 3)))

    runs = []
    with Pipeline(
        model=Tiny(),
        device="cpu",
        threads=args.threads,
        preprocess="processes",
        max_batch_size=128,
        torch_threads=1,  # as on CUDA: no OpenMP pool spinning in this process
        crop_size=8,
        resize_size=8,
        labels=[str(i) for i in range(1000)],
    ) as pipe:
        if args.gpu_procs:
            from types import SimpleNamespace

            class InstantGpuProcess:  # answers at once: only the main process's side costs anything
                depth = 2

                def __init__(self):
                    self.sent = collections.deque()
                    self.times = {"cpu_decoded": 0}
                    self.fd = os.memfd_create("stand-in", 0)  # the real request and arena copy (os.pwritev)
                    os.ftruncate(self.fd, gp.DEPTH * gp.SLOT_BYTES)
                    self.arena = mmap.mmap(self.fd, gp.DEPTH * gp.SLOT_BYTES)

                def fitting(self, items):
                    return gp.count_fitting(items, gp.SLOT_BYTES)

                def send(self, items, slot=None):
                    gp.encode_request(items, self.arena, (slot or 0) * gp.SLOT_BYTES, self.fd)
                    self.sent.append(len(items))
                    return True

                def receive(self, timeout):
                    return [None] * self.sent.popleft()

                def discard_replies(self, timeout=2.0):
                    self.sent.clear()

            import mmap
            import os

            import fullthrottle.data.gpu_decode_procs as gp
            from fullthrottle.data.gpu_decoders import GpuJpegDecoder

            pipe.engine.gpu_decoder = GpuJpegDecoder(torch.device("cpu"))  # never called: routing only
            pipe.gpu_decoders = SimpleNamespace(
                workers=[InstantGpuProcess() for _ in range(args.gpu_procs)], close=lambda: None
            )
        items = [blobs[i % len(blobs)] for i in range(args.n)]
        list(pipe.run(items[:500]))  # warm-up: worker start, first calls
        for _ in range(args.repeats):
            cpu.clear()
            t, c = time.perf_counter(), time.process_time()
            assert all(r.ok for r in pipe.run(items))
            wall, proc = time.perf_counter() - t, time.process_time() - c
            runs.append(
                {
                    "img_per_s": args.n / wall,
                    "main_process_us_per_img": 1e6 * proc / args.n,
                    "threads_us_per_img": {k: 1e6 * v / args.n for k, v in sorted(cpu.items())},
                }
            )
            print(runs[-1], flush=True)
    write_json(
        args.out,
        {
            "benchmark": "main_process_cost",
            "machine": machine_info(),
            "images": "64x64 random JPEGs, 8x8 crops, linear model on CPU",
            "decoder_processes": args.threads,
            "gpu_decoder_processes": args.gpu_procs,
            "n": args.n,
            "runs": runs,
        },
    )


if __name__ == "__main__":
    main()
