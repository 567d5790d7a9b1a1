"""HTTP serving under load (issue 05): ``fullthrottle serve`` against a plain FastAPI endpoint that runs the
eager model once per request (same model, same images, same run). Single-image requests from 1, 8 and
64 concurrent clients (httpx, asyncio); throughput (img/s) and p50/p99 latency (ms). Both servers run as
subprocesses on 127.0.0.1; the client runs here.

Usage: python bench/serve_load.py --out bench/results/serve_load.json [--requests 2000] [--device cuda]
"""

import argparse
import asyncio
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

from fullthrottle.workloads.classify.models import TORCHVISION_IMAGENET

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import jpegs_640x480, machine_info, write_json  # noqa: E402


def baseline_app(device: str):
    """Plain FastAPI: decode with PIL + torchvision, eager model once per request."""
    import io

    import torch
    import torchvision
    from fastapi import FastAPI, Request
    from PIL import Image
    from torchvision.transforms import v2

    dev = torch.device(device)
    dtype = torch.bfloat16 if dev.type == "cuda" else torch.float32
    torch.manual_seed(0)
    model = torchvision.models.resnet18().eval().to(dev, dtype)
    tf = v2.Compose([v2.Resize(256, antialias=True), v2.CenterCrop(224), v2.PILToTensor()])
    mean = torch.tensor(TORCHVISION_IMAGENET.mean, device=dev).view(1, 3, 1, 1) * 255
    std = torch.tensor(TORCHVISION_IMAGENET.std, device=dev).view(1, 3, 1, 1) * 255
    app = FastAPI()

    @app.get("/readyz")
    def ready():
        return {"status": "ready"}

    @app.post("/v1/classify")
    async def classify(request: Request):
        data = await request.body()

        def run():
            x = tf(Image.open(io.BytesIO(data)).convert("RGB"))[None].to(dev)
            with torch.inference_mode():
                v, i = torch.softmax(model(((x.float() - mean) / std).to(dtype)).float(), -1).topk(5)
            return {"results": [{"top_k": [{"class_id": int(c), "prob": float(p)} for c, p in zip(i[0], v[0])]}]}

        return await asyncio.to_thread(run)

    return app


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start(cmd: list[str], port: int) -> subprocess.Popen:
    import httpx

    p = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=dict(os.environ))
    deadline = time.time() + 300
    while time.time() < deadline:
        try:
            if httpx.get(f"http://127.0.0.1:{port}/readyz", timeout=2).status_code == 200:
                return p
        except httpx.HTTPError:
            time.sleep(0.5)
    p.kill()
    raise RuntimeError(f"server did not start: {cmd}")


async def load(url: str, blobs: list[bytes], n: int, conc: int) -> dict:
    import httpx

    lat: list[float] = []
    errors = 0
    sem = asyncio.Semaphore(conc)
    async with httpx.AsyncClient(timeout=120, limits=httpx.Limits(max_connections=conc)) as c:

        async def one(i):
            nonlocal errors
            async with sem:
                t = time.perf_counter()
                r = await c.post(
                    url + "/v1/classify", content=blobs[i % len(blobs)], headers={"content-type": "image/jpeg"}
                )
                lat.append(time.perf_counter() - t)
                errors += r.status_code != 200

        await asyncio.gather(*(one(i) for i in range(min(n, 4 * conc))))  # warm-up
        lat.clear()
        errors = 0
        t0 = time.perf_counter()
        await asyncio.gather(*(one(i) for i in range(n)))
        wall = time.perf_counter() - t0
    return {"lat": lat, "wall": wall, "errors": errors, "n": n}


def _client_proc(args):
    url, n, conc = args
    return asyncio.run(load(url, jpegs_640x480(), n, conc))


def load_many(url: str, blobs: list[bytes], n: int, conc: int, procs: int = 1) -> dict:
    """``n`` requests at ``conc`` concurrency from ``procs`` client processes (one asyncio loop each, so
    the client's own Python does not cap the rate); img/s = all requests / the slowest client's wall."""
    if procs <= 1:
        parts = [asyncio.run(load(url, blobs, n, conc))]
    else:
        import concurrent.futures as cf
        import multiprocessing as mp

        with cf.ProcessPoolExecutor(procs, mp_context=mp.get_context("spawn")) as ex:
            parts = list(ex.map(_client_proc, [(url, n // procs, max(1, conc // procs))] * procs))
    a = np.concatenate([np.array(p["lat"]) for p in parts]) * 1e3
    total = sum(p["n"] for p in parts)
    return {
        "concurrency": conc,
        "client_processes": procs,
        "requests": total,
        "img_per_s": total / max(p["wall"] for p in parts),
        "p50_ms": float(np.percentile(a, 50)),
        "p99_ms": float(np.percentile(a, 99)),
        "errors": sum(p["errors"] for p in parts),
    }


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default="bench/results/serve_load.json")
    ap.add_argument("--requests", type=int, default=2000)
    ap.add_argument("--device", default="auto")
    ap.add_argument("--concurrency", default="1,8,64")
    ap.add_argument("--client-procs", type=int, default=1, help="client processes sharing the concurrency")
    ap.add_argument(
        "--compare-gpus",
        action="store_true",
        help="issue 08: `fullthrottle serve --gpus all` against one GPU (no plain baseline)",
    )
    ap.add_argument("--server-args", default="", help="extra `fullthrottle serve` arguments, e.g. '--gpu-decode'")
    ap.add_argument("--baseline-server", type=int, default=0, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.device == "auto":
        import torch

        args.device = "cuda" if torch.cuda.is_available() else "cpu"
    if args.baseline_server:
        import uvicorn

        uvicorn.run(baseline_app(args.device), host="127.0.0.1", port=args.baseline_server, log_level="warning")
        return
    blobs = jpegs_640x480()
    conc = [int(c) for c in args.concurrency.split(",")]
    out = {}
    ft = [
        sys.executable,
        "-m",
        "fullthrottle.cli",
        "serve",
        "--device",
        args.device,
        "--max-wait-ms",
        "2",
        *args.server_args.split(),
    ]
    if args.compare_gpus:
        servers = {"fullthrottle_1_gpu": ft + ["--gpus", "1"], "fullthrottle_all_gpus": ft + ["--gpus", "all"]}
    else:
        servers = {
            "fullthrottle": ft,
            "plain_fastapi_eager": [sys.executable, __file__, "--device", args.device, "--baseline-server"],
        }
    for name, cmd in servers.items():
        port = free_port()
        cmd = cmd + ([str(port)] if cmd[-1] == "--baseline-server" else ["--port", str(port)])
        proc = start(cmd, port)
        try:
            out[name] = [
                load_many(f"http://127.0.0.1:{port}", blobs, args.requests, c, args.client_procs) for c in conc
            ]
            print(name, out[name], flush=True)
        finally:
            proc.send_signal(signal.SIGTERM)
            proc.wait(60)
    a_name, b_name = list(servers)[::-1] if args.compare_gpus else list(servers)
    ratios = {f"c{c}": a["img_per_s"] / b["img_per_s"] for c, a, b in zip(conc, out[a_name], out[b_name])}
    import torch

    write_json(
        args.out,
        {
            "benchmark": "serve_load",
            "machine": machine_info(),
            "device": args.device,
            "gpus": torch.cuda.device_count(),
            "ratio": f"{a_name} / {b_name}",
            "server_args": args.server_args,
            "command": " ".join(sys.argv),
            "images": "200 ImageNet samples at 640x480, JPEG",
            "model": "resnet18 random weights",
            **out,
            "throughput_ratio": ratios,
        },
    )
    print(ratios)


if __name__ == "__main__":
    main()
