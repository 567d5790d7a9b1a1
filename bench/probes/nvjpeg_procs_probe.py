"""Does nvJPEG scale across processes? (issue 04: a probe, not the product benchmark)

torchvision's ``decode_jpeg(list, device="cuda")`` serialises every call in a process on one global
decoder behind a mutex (``decode_jpegs_cuda.cpp``), so threads cannot add GPU decode throughput.
Each process has its own decoder. This runs P = 1, 2, 3, 4 processes at once, each decoding batches
of the same JPEGs for a fixed time, and reports the aggregate img/s: decode only, and decode +
resize/crop (:func:`fullthrottle.data.gpu_decode.decode_crops`) + D2H of the crops into pinned memory
(what a GPU decoder process would hand the pipeline). The last pass adds ``--busy`` CPU-bound
processes beside them (the CPU decoders of the pipeline).

Usage: python bench/probes/nvjpeg_procs_probe.py --out bench/probes/results/nvjpeg_procs_probe.json
(committed result: bench/probes/results/nvjpeg_procs_probe.txt, the printed rows of a run cut short)
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # bench/: common.py
from common import jpegs_640x480, machine_info, sample_jpegs, write_json  # noqa: E402


def _spin(stop):
    x = 0
    while not stop.is_set():
        for i in range(100_000):
            x += i


def _worker(blobs, bs, seconds, mode, barrier, q):
    import torch

    from fullthrottle.data.gpu_decode import decode_crops
    from fullthrottle.data.gpu_decoders import GpuJpegDecoder

    dev = torch.device("cuda")
    dec = GpuJpegDecoder(dev)
    host = torch.empty((bs, 224, 224, 3), dtype=torch.uint8, pin_memory=True)

    def one(i):
        b = [blobs[(i * bs + j) % len(blobs)] for j in range(bs)]
        if mode == "decode":
            dec(b)
        else:
            out = decode_crops(dec, b, device=dev)
            rows = next(o[0] for o in out if isinstance(o, tuple))
            host[: rows.shape[0]].copy_(rows, non_blocking=True)
        torch.cuda.synchronize()

    for i in range(3):
        one(i)
    barrier.wait()
    t0, n, i = time.perf_counter(), 0, 0
    while time.perf_counter() - t0 < seconds:
        one(i)
        i += 1
        n += bs
    q.put((n, time.perf_counter() - t0))


def run(blobs, procs, bs, seconds, mode, busy):
    ctx = mp.get_context("spawn")
    barrier, q, stop = ctx.Barrier(procs), ctx.Queue(), ctx.Event()
    spinners = [ctx.Process(target=_spin, args=(stop,), daemon=True) for _ in range(busy)]
    for p in spinners:
        p.start()
    ps = [ctx.Process(target=_worker, args=(blobs, bs, seconds, mode, barrier, q)) for _ in range(procs)]
    for p in ps:
        p.start()
    res = [q.get(timeout=300) for _ in ps]
    for p in ps:
        p.join()
    stop.set()
    for p in spinners:
        p.join(5)
    return sum(n for n, _ in res) / max(s for _, s in res)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default="bench/probes/results/nvjpeg_procs_probe.json")
    ap.add_argument("--procs", default="1,2,4")
    ap.add_argument("--batch", type=int, default=128)
    ap.add_argument("--seconds", type=float, default=3.0)
    ap.add_argument("--busy", type=int, default=12, help="CPU-bound processes beside, in the second pass")
    args = ap.parse_args()
    from fullthrottle.data.gpu_decode import gpu_eligible

    sets = {"640x480": jpegs_640x480(), "mixed": [b for b in sample_jpegs() if gpu_eligible(b)[0]]}
    rows = []
    for images, blobs in sets.items():
        for mode, busy in (("decode", 0), ("decode+resize+D2H", 0), ("decode+resize+D2H", args.busy)):
            for p in (int(x) for x in args.procs.split(",")):
                r = run(blobs, p, args.batch, args.seconds, mode, busy)
                rows.append({"images": images, "mode": mode, "busy_cpu_procs": busy, "procs": p, "img_per_s": r})
                print(rows[-1], flush=True)
    write_json(
        args.out,
        {
            "benchmark": "nvjpeg_procs_probe",
            "machine": machine_info(),
            "batch": args.batch,
            "seconds": args.seconds,
            "rows": rows,
        },
    )


if __name__ == "__main__":
    main()
