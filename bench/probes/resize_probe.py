"""GPU decode stage, piece by piece, on the H200 (issue 04): decode alone, resize + crop alone, both.

The end-to-end run with the hardware JPEG decoder left the GPU decode stage 98% busy at 6.5k img/s
in one thread while the same decoder alone decodes ~21k img/s (bench/probes/results/nvimgcodec_probe.json).
This probe times, on the same in-memory JPEGs, in batches of ``--batch``:

- ``decode``: the GPU decoder alone (``make_gpu_decoder``: hardware engines, or nvJPEG), synchronised;
- ``resize``: resize + center crop of already-decoded images, CUDA events, three ways:
  PyTorch's antialiased ``F.interpolate`` (float32, :func:`resize_crop_interpolate`), the
  channels-last float16 matrix products (:func:`resize_crop_matmul`) and the two Triton kernels
  (:func:`~fullthrottle.core.kernels.resize_crop_u8`, what :func:`resize_crop_batch` runs on CUDA); with
  the mean absolute difference of each against the CPU path (/255 per pixel);
- ``decode+resize``: the two together, as the GPU decode stage runs them (Triton, and the products);
- the same ``decode`` with ``--burners`` processes spinning on the CPU (the 15 CPU decoder processes
  of a real run keep every core busy).

Usage: python bench/probes/resize_probe.py --out resize_probe.json [--decoder auto] [--batch 128]
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import sys
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # bench/: common.py
from common import jpegs_640x480, machine_info, sample_jpegs, write_json  # noqa: E402

from fullthrottle.core.config import GPU_DECODERS  # noqa: E402


def _burn(stop):
    x = 0
    while not stop.is_set():
        for _ in range(100000):
            x += 1


def rate(fn, blobs, batch, seconds=2.0):
    """Images/s of ``fn(list_of_bytes)`` (synchronised), after a warm-up batch."""
    fn(blobs[:batch])
    torch.cuda.synchronize()
    n, j, t0 = 0, 0, time.perf_counter()
    while time.perf_counter() - t0 < seconds:
        fn([blobs[(j + k) % len(blobs)] for k in range(batch)])
        torch.cuda.synchronize()
        n += batch
        j += batch
    return n / (time.perf_counter() - t0)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--decoder", default="auto", choices=GPU_DECODERS)
    ap.add_argument("--batch", type=int, default=128)
    ap.add_argument("--burners", type=int, default=15)
    ap.add_argument("--out", default="resize_probe.json")
    args = ap.parse_args()
    from fullthrottle.core.kernels import resize_crop_u8
    from fullthrottle.data.gpu_decode import gpu_eligible
    from fullthrottle.data.gpu_decoders import make_gpu_decoder
    from fullthrottle.data.gpu_resize import resize_crop_batch, resize_crop_interpolate, resize_crop_matmul
    from fullthrottle.data.preprocess import preprocess

    dec = make_gpu_decoder(torch.device("cuda"), args.decoder)
    out = {"benchmark": "resize_probe", "machine": machine_info(), "decoder": dec.kind, "batch": args.batch, "rows": []}
    stream = torch.cuda.Stream()
    torch.cuda.set_stream(stream)  # as in the pipeline: a side stream
    for name, blobs in {"640x480": jpegs_640x480()[:512], "mixed": sample_jpegs()}.items():
        blobs = [b for b in blobs if gpu_eligible(b)[0]]
        bs = min(args.batch, len(blobs))
        row = {"images": name, "n_distinct": len(blobs)}
        row["decode_img_per_s"] = rate(dec, blobs, bs)
        imgs = dec(blobs[:bs])
        torch.cuda.synchronize()
        ref = np.stack([preprocess(b) for b in blobs[:bs]]).astype(np.int16)
        res = torch.empty((bs, 224, 224, 3), dtype=torch.uint8, device="cuda")
        for label, fn in (
            ("interpolate_fp32", resize_crop_interpolate),
            ("matmul_fp16", resize_crop_matmul),
            ("triton", resize_crop_u8),
        ):
            fn(imgs, res)
            torch.cuda.synchronize()
            row[f"{label}_mad_vs_cpu"] = float(np.abs(res.cpu().numpy().astype(np.int16) - ref).mean())
            s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            s.record()
            for _ in range(10):
                fn(imgs, res)
            e.record()
            e.synchronize()
            row[f"{label}_gpu_us_per_image"] = 1e3 * s.elapsed_time(e) / (10 * bs)
            t0 = time.perf_counter()
            for _ in range(10):
                fn(imgs, res)
            torch.cuda.synchronize()
            row[f"{label}_wall_us_per_image"] = 1e6 * (time.perf_counter() - t0) / (10 * bs)
            if label == "triton" or (label == "matmul_fp16" and name == "640x480"):  # no host waits inside:
                torch.cuda._sleep(int(5e8))  # the GPU spins while the 10 calls queue up behind it, so the
                s.record()  # events time the GPU's work alone, not the host's launches
                for _ in range(10):
                    fn(imgs, res)
                e.record()
                e.synchronize()
                row[f"{label}_gpu_only_us_per_image"] = 1e3 * s.elapsed_time(e) / (10 * bs)

        def both(b, fn=resize_crop_batch):
            d = dec(b)
            r = torch.empty((len(b), 224, 224, 3), dtype=torch.uint8, device="cuda")
            fn([x for x in d if isinstance(x, torch.Tensor)], r[: sum(isinstance(x, torch.Tensor) for x in d)])

        row["decode_resize_triton_img_per_s"] = rate(both, blobs, bs)
        row["decode_resize_matmul_img_per_s"] = rate(lambda b: both(b, resize_crop_matmul), blobs, bs)
        row["decode_resize_interpolate_img_per_s"] = rate(lambda b: both(b, resize_crop_interpolate), blobs, bs)
        stop = mp.Event()
        ps = [mp.Process(target=_burn, args=(stop,), daemon=True) for _ in range(args.burners)]
        for p in ps:
            p.start()
        time.sleep(0.5)
        row[f"decode_img_per_s_with_{args.burners}_burners"] = rate(dec, blobs, bs)
        row[f"decode_resize_triton_img_per_s_with_{args.burners}_burners"] = rate(both, blobs, bs)
        stop.set()
        for p in ps:
            p.join()
        out["rows"].append(row)
        print(row, flush=True)
    write_json(args.out, out)


if __name__ == "__main__":
    main()
