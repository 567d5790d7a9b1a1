"""Probe: the CPU an HTTP worker process spends per single-image ``POST /v1/classify`` request. CPU only.

One worker's app (``server/front.py``'s ``create_front_app``) served by uvicorn as ``serve
--http-workers`` serves it, with a stand-in engine that answers every request at once, so what is
measured is the worker's own work: HTTP parsing, the route (body, checks, the engine client's call,
the JSON answer) and metrics. The load: ``bench/load_client.py``'s aiohttp closed loop from one
client process. Per round: requests/s and the worker's CPU per request (µs, its process's CPU over
the round divided by the requests answered).

With ``--against SRC`` (another checkout's ``src`` folder) the same rounds run on that code too, in the
same call, for a before/after.

With ``--overloaded`` the stand-in engine's queue is full: every request is answered 503 (what a
worker spends on the load it refuses).

Usage: python bench/probes/front_cpu_probe.py [--rounds 3] [--seconds 5] [--concurrency 16]
    [--against OTHER/src] [--overloaded] --out front_cpu.json
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(HERE))  # bench/: common.py, load_client.py
from common import jpegs_640x480, machine_info, write_json  # noqa: E402
from load_client import closed_loop  # noqa: E402

SERVER = r"""
import os, sys, tempfile
os.environ.setdefault("PROMETHEUS_MULTIPROC_DIR", tempfile.mkdtemp())
from fullthrottle.server.front import create_front_app
from fullthrottle.server.http_layer import uvicorn_server
from fullthrottle.server.options import ServeOptions
from fullthrottle.workloads.classify.result import Result

class AtOnce:  # the engine's part, answered at once (with --overloaded: its queue is full, 503)
    async def classify(self, images):
        if sys.argv[2] == "1":
            from fullthrottle.core.errors import Overloaded
            raise Overloaded("queue full (256 images waiting)")
        return [Result(i, iid, list("abcde"), [1, 2, 3, 4, 5], [.5, .2, .1, .1, .1], None, 1.0)
                for i, (iid, _) in enumerate(images)]

opts = ServeOptions()
app = create_front_app(opts, 89_478_485, [AtOnce()])
uvicorn_server(app, opts, 1024, host="127.0.0.1", port=int(sys.argv[1])).run()
"""


def cpu_s(pid: int) -> float:
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--seconds", type=float, default=5.0)
    ap.add_argument("--concurrency", type=int, default=16)
    ap.add_argument("--port", type=int, default=23456)
    ap.add_argument("--against", help="another source tree (its src folder) measured the same way")
    ap.add_argument("--overloaded", action="store_true", help="the engine's queue is full: every request a 503")
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    trees = {"this tree": None} | ({args.against: args.against} if args.against else {})
    out = {name: measure(src, args) for name, src in trees.items()}
    write_json(
        args.out,
        {"machine": machine_info(), "command": " ".join(sys.argv), "concurrency": args.concurrency, "trees": out},
    )


def measure(src: str | None, args) -> list[dict]:
    """The rounds against one worker app (``src``: the source tree it is imported from; None: this one)."""
    import httpx

    env = dict(os.environ, PYTHONPATH=src) if src else None
    srv = subprocess.Popen(
        [sys.executable, "-c", SERVER, str(args.port), str(int(args.overloaded))], stdout=subprocess.DEVNULL, env=env
    )
    url = f"http://127.0.0.1:{args.port}"
    rounds = []
    try:
        for _ in range(150):
            try:
                httpx.get(url + "/healthz")
                break
            except httpx.HTTPError:
                time.sleep(0.2)
        photo = jpegs_640x480()[0]
        for _ in range(args.rounds):
            c0, t0 = cpu_s(srv.pid), time.perf_counter()
            r = closed_loop(url + "/v1/classify", [(photo, "image/jpeg")], 1, args.concurrency, args.seconds, 1.0, 1)
            rate = sum(r["statuses"].values()) / args.seconds
            cores = (cpu_s(srv.pid) - c0) / (time.perf_counter() - t0)
            rounds.append({"req_per_s": rate, "worker_us_per_request": 1e6 * cores / rate, "statuses": r["statuses"]})
            us = rounds[-1]["worker_us_per_request"]
            print(f"{src or 'this tree'}: {rate:.0f} req/s, worker {us:.0f} us of CPU per request", flush=True)
    finally:
        srv.terminate()
        srv.wait(10)
    return rounds


if __name__ == "__main__":
    main()
