"""Probe: what load past a multi-process server's capacity costs its engine process. CPU only.

``serve --http-workers 2`` as the library runs it (``supervisor.run_multi``), on the CPU, with a model
that holds each batch 20 ms without using the CPU (so what the engine process spends is its own
handling of requests: links, queue, pipeline threads) and a small queue (``--max-queue``), under a
closed loop of ``--concurrency`` clients (``load_client.py``) posting single 640x480 JPEGs: most are
refused with 503. Per round: images answered 200 per second, requests answered per second (any
status), and the engine process's CPU per request (µs) and in cores.

With ``--against SRC`` (another checkout's ``src`` folder) the same rounds run on that code too,
alternated, for a before/after in one call.

Usage: python bench/probes/overload_probe.py [--rounds 2] [--seconds 8] [--max-queue 4]
    [--concurrency 64] [--against OTHER/src] --out overload_probe.json
"""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(HERE))  # bench/: common.py, load_client.py
from common import cpu_s, free_port, jpegs_640x480, machine_info, wait_ready, write_json  # noqa: E402
from load_client import closed_loop  # noqa: E402

SERVER = r"""
import sys, time, torch
from fullthrottle import Config
from fullthrottle.server.options import ServeOptions
from fullthrottle.server.supervisor import run_multi

class Held(torch.nn.Module):  # 20 ms a batch, no CPU
    def __init__(self):
        super().__init__()
        self.fc = torch.nn.Linear(3, 1000)
    def forward(self, x):
        time.sleep(0.02)
        return self.fc(x.mean((2, 3)))

if __name__ == "__main__":
    torch.manual_seed(0)
    cfg = Config(model=Held().eval(), device="cpu", preprocess="processes", threads=1, resize_size=32,
                 crop_size=32, max_batch_size=8, torch_threads=1)
    opts = ServeOptions(max_queue=int(sys.argv[2]), max_connections_per_client=100000)
    sys.exit(run_multi(cfg, port=int(sys.argv[1]), options=opts, http_workers=2, max_connections=4096))
"""


def one_round(src: str, args, bodies) -> dict:

    port = free_port()
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([src, os.environ.get("PYTHONPATH", "")])}
    cmd = [sys.executable, "-c", SERVER, str(port), str(args.max_queue)]
    proc = subprocess.Popen(cmd, env=env, stderr=subprocess.DEVNULL)
    try:
        wait_ready(f"http://127.0.0.1:{port}/readyz", None, 120, every_s=0.2)
        c0, t0 = cpu_s(proc.pid), time.perf_counter()
        url = f"http://127.0.0.1:{port}/v1/classify"
        r = closed_loop(url, bodies, 1, args.concurrency, args.seconds, 1.0, procs=1)
        c1, t1 = cpu_s(proc.pid), time.perf_counter()
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(60)
    n = sum(r["statuses"].values())
    return {
        "statuses": r["statuses"],
        "ok_img_per_s": r["img_per_s"],
        "requests_per_s": n / args.seconds,
        "engine_cores": (c1 - c0) / (t1 - t0),
        "engine_cpu_us_per_request": 1e6 * (c1 - c0) / max(1, n) * (args.seconds / (t1 - t0)),
        "client_cores": r["client_cores"],
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--seconds", type=float, default=8.0)
    ap.add_argument("--max-queue", type=int, default=4)
    ap.add_argument("--concurrency", type=int, default=64)
    ap.add_argument("--against", default=None, help="another checkout's src folder: the same rounds on it")
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    bodies = [(b, "image/jpeg") for b in jpegs_640x480()[:20]]
    srcs = {"this": str(HERE.parent / "src")}
    if args.against:
        srcs["against"] = str(Path(args.against).resolve())
    res = {"probe": "overload", "machine": machine_info(), "settings": vars(args)}
    for r in range(args.rounds):
        for name, src in srcs.items():  # (alternating, so that drifts of the machine hit both)
            got = one_round(src, args, bodies)
            res.setdefault(name, []).append(got)
            print(name, r, {k: v if isinstance(v, dict) else round(v, 2) for k, v in got.items()}, flush=True)
    write_json(args.out, res)


if __name__ == "__main__":
    main()
