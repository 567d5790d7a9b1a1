"""nvImageCodec's JPEG decoders on the H200, beside torchvision's batched nvJPEG, in one run (issue 04).

The H200 has hardware JPEG decoders (NVJPG engines). (An earlier note here said torchvision's
``decode_jpeg(device="cuda")`` does not use them; its source says otherwise: on such GPUs it opens
nvJPEG's hardware backend for baseline JPEGs, ``decode_jpegs_cuda.cpp``.) NVIDIA's nvImageCodec (``nvidia-nvimgcodec-cu13``, carried as a wheel: nothing is installed on the device)
exposes the hardware backend. This probe decodes the same in-memory JPEGs in batches of 128 for a
fixed time per decoder and reports images/s and the mean absolute difference against OpenCV on the
CPU (a sanity check, not the pipeline's transform).

Usage: python bench/probes/nvimgcodec_probe.py --out nvimgcodec_probe.json
"""

from __future__ import annotations

import argparse
import sys
import threading
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # bench/: common.py
from common import jpegs_640x480, machine_info, sample_jpegs, write_json  # noqa: E402


def rate(decode_batch, blobs, seconds=3.0, batch=128, threads=1):
    """Images/s of ``decode_batch(list_of_bytes)`` over ``threads`` threads, after one warm-up batch."""
    decode_batch(blobs[:batch])
    torch.cuda.synchronize()
    counts = [0] * threads

    def run(i):
        t0, j = time.perf_counter(), i * batch
        while time.perf_counter() - t0 < seconds:
            chunk = [blobs[(j + k) % len(blobs)] for k in range(batch)]
            decode_batch(chunk)
            counts[i] += batch
            j += batch * threads

    t0 = time.perf_counter()
    ts = [threading.Thread(target=run, args=(i,)) for i in range(threads)]
    for t in ts:
        t.start()
    for t in ts:
        t.join()
    torch.cuda.synchronize()
    return sum(counts) / (time.perf_counter() - t0)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default="nvimgcodec_probe.json")
    args = ap.parse_args()
    import cv2
    import torchvision
    from torchvision.io import decode_jpeg

    out = {"benchmark": "nvimgcodec_probe", "machine": machine_info(), "rows": [], "errors": []}
    try:
        from nvidia import nvimgcodec

        out["nvimgcodec"] = getattr(nvimgcodec, "__version__", "?")
        out["nvimgcodec_names"] = sorted(n for n in dir(nvimgcodec) if not n.startswith("_"))
    except Exception as e:  # noqa: BLE001
        nvimgcodec = None
        out["errors"].append(f"import nvimgcodec: {type(e).__name__}: {e}")
    sets = {"640x480": jpegs_640x480()[:512], "mixed": sample_jpegs()}
    for name, blobs in sets.items():
        ref = cv2.cvtColor(cv2.imdecode(np.frombuffer(blobs[0], np.uint8), cv2.IMREAD_COLOR), cv2.COLOR_BGR2RGB)
        tv = lambda b: decode_jpeg([torch.frombuffer(x, dtype=torch.uint8) for x in b], device="cuda")  # noqa: E731
        r = rate(tv, blobs)
        mad = (tv(blobs[:1])[0].permute(1, 2, 0).cpu().float() - torch.from_numpy(ref).float()).abs().mean().item()
        out["rows"].append(
            {
                "images": name,
                "decoder": f"torchvision {torchvision.__version__} nvJPEG (CUDA)",
                "img_per_s": r,
                "mad_vs_opencv": mad,
            }
        )
        print(out["rows"][-1], flush=True)
        if nvimgcodec is None:
            continue
        for kind in ("HW_GPU_ONLY", "GPU_ONLY", "HYBRID_CPU_GPU"):
            for threads in (1, 2):
                try:
                    bk = (
                        getattr(nvimgcodec.BackendKind, kind)
                        if hasattr(nvimgcodec, "BackendKind")
                        else getattr(nvimgcodec, kind)
                    )
                    decs = [nvimgcodec.Decoder(backends=[nvimgcodec.Backend(bk)]) for _ in range(threads)]
                    local = threading.local()
                    pool = iter(decs)
                    lock = threading.Lock()

                    def dec(b):
                        if not hasattr(local, "d"):
                            with lock:
                                local.d = next(pool, decs[0])
                        imgs = local.d.decode(b)
                        return [torch.as_tensor(im, device="cuda") for im in imgs if im is not None]

                    got = dec(blobs[:8])
                    r = rate(dec, blobs, threads=threads)
                    im = dec(blobs[:1])[0].cpu().float()
                    mad = (im - torch.from_numpy(ref).float()).abs().mean().item() if im.shape == ref.shape else None
                    out["rows"].append(
                        {
                            "images": name,
                            "decoder": f"nvimgcodec {kind}",
                            "threads": threads,
                            "img_per_s": r,
                            "decoded_of_8": len(got),
                            "shape": list(im.shape),
                            "mad_vs_opencv": mad,
                        }
                    )
                except Exception as e:  # noqa: BLE001
                    out["errors"].append(f"{name} {kind} x{threads}: {type(e).__name__}: {e}"[:300])
                    print(out["errors"][-1], flush=True)
                    continue
                print(out["rows"][-1], flush=True)
    write_json(args.out, out)


if __name__ == "__main__":
    main()
