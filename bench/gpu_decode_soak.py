"""GPU JPEG decoding soak (issue 04): host and device memory over a long run of nvJPEG decodes.

nvJPEG has had leak reports, so this pushes ``--n`` images (default 100k, 640x480 JPEGs in memory)
through the pipeline with ``gpu_decode=True`` and samples, every ``--every`` images: host RSS
(bytes, psutil; the main process, the CPU decoder processes and the GPU decoder processes), device memory allocated and reserved by PyTorch's caching allocator (bytes) and the
device memory in use per NVML (bytes, all processes). A leak shows as growth between the sample
taken after warm-up and the last one.

Usage: python bench/gpu_decode_soak.py --out bench/results/gpu_decode_soak.json [--n 100000]
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import psutil
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import jpegs_640x480, machine_info, mps_clients, write_json  # noqa: E402

from fullthrottle.core.config import GPU_DECODERS  # noqa: E402


def memory() -> dict:
    me = psutil.Process()
    kids = me.children(recursive=True)  # the CPU and GPU decoder processes
    # RSS counts the pages of the shared crop pool each worker has touched (it grows towards the pool's
    # size as a worker writes into more rows); USS counts only a process's private memory: a leak
    rss = {"cpu": 0, "gpu": 0, "cpu_uss": 0, "gpu_uss": 0}
    for k in kids:
        try:
            kind = "gpu" if "gpu_decode_procs" in " ".join(k.cmdline()) else "cpu"
            m = k.memory_full_info()
            rss[kind] += m.rss
            rss[kind + "_uss"] += m.uss
        except psutil.Error:  # exited meanwhile
            pass
    out = {
        "host_rss_bytes": me.memory_info().rss,
        "cpu_decoder_processes_rss_bytes": rss["cpu"],
        "gpu_decoder_processes_rss_bytes": rss["gpu"],
        "cpu_decoder_processes_uss_bytes": rss["cpu_uss"],
        "gpu_decoder_processes_uss_bytes": rss["gpu_uss"],
        "cuda_allocated_bytes": torch.cuda.memory_allocated(),
        "cuda_reserved_bytes": torch.cuda.memory_reserved(),
    }
    try:
        import pynvml

        pynvml.nvmlInit()
        out["nvml_used_bytes"] = pynvml.nvmlDeviceGetMemoryInfo(pynvml.nvmlDeviceGetHandleByIndex(0)).used
    except Exception:  # noqa: BLE001 - NVML is optional
        pass
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--n", type=int, default=100_000)
    ap.add_argument("--every", type=int, default=10_000)
    ap.add_argument("--gpu-decoder", default="auto", choices=GPU_DECODERS)
    ap.add_argument(
        "--mps",
        action="store_true",
        help="run as clients of a CUDA MPS server started here (as bench/e2e_cpu_decode.py --mps)",
    )
    ap.add_argument("--out", default="bench/results/gpu_decode_soak.json")
    args = ap.parse_args()
    with mps_clients(args.mps):  # before this process's first CUDA call
        run(args)


def run(args) -> None:
    if not torch.cuda.is_available():
        sys.exit("needs CUDA")
    from fullthrottle import Config, Pipeline

    blobs = jpegs_640x480()
    pipe = Pipeline(
        Config(
            model="resnet18",
            device="cuda",
            dtype="bfloat16",
            max_batch_size=128,
            threads=16,
            gpu_decode=True,
            gpu_decoder=args.gpu_decoder,
        )
    )
    list(pipe.run([blobs[i % len(blobs)] for i in range(5000)]))  # warm-up: pools, graphs, nvJPEG state
    samples = [{"images": 0, "t_s": 0.0, **memory()}]
    t0 = time.perf_counter()
    seen = failed = 0
    for r in pipe.run(blobs[i % len(blobs)] for i in range(args.n)):
        seen += 1
        failed += not r.ok
        if seen % args.every == 0:
            samples.append({"images": seen, "t_s": time.perf_counter() - t0, **memory()})
            print(samples[-1], flush=True)
    first, last = samples[0], samples[-1]
    payload = {
        "benchmark": "gpu_decode_soak",
        "machine": machine_info(),
        "mps": args.mps,
        "images": seen,
        "failed": failed,
        "img_per_s": seen / (time.perf_counter() - t0),
        "gpu_share": pipe.engine.splitter.routed_gpu_share,
        "gpu_decoder": pipe.engine.gpu_decoder.kind,
        "gpu_decode_summary": pipe.last_report.gpu_decode,
        "gpu_decoder_processes": len(pipe.gpu_decoders) if pipe.gpu_decoders is not None else 0,
        "growth_bytes": {k: last[k] - first[k] for k in first if k.endswith("_bytes")},
        "samples": samples,
    }
    pipe.close()
    write_json(args.out, payload)
    print({k: v for k, v in payload.items() if k not in ("machine", "samples")})


if __name__ == "__main__":
    main()
