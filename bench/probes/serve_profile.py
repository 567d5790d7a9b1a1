"""Probe: where the multi-process server's time goes under load. For each set of ``serve``
arguments: single-image closed-loop points (``bench/load_client.py``), each with the CPU cores used
by every kind of process of the server's tree (engine, HTTP workers, GPU and CPU decoder
processes), where an image's time goes between two scrapes of ``/metrics`` (the mean wait in each
stage's input queue, the engine's per-image latency, the HTTP worker's request latency), and at
the last point of the first set a ``py-spy record`` of the engine process (collapsed stacks,
summed by thread and by function).

Usage: python bench/probes/serve_profile.py --variants "A;--max-wait-ms 1" --concurrency 64,256 \
    [--py-spy PATH] --out serve_profile.json   ("A" alone: the defaults; in a variant, SI=SECONDS:
    the engine's sys.setswitchinterval, NAME=VALUE: an environment variable of the server)
"""

from __future__ import annotations

import argparse
import collections
import json
import re
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(HERE))
from common import (  # noqa: E402
    cores_by_kind,
    cpu_by_kind,
    free_port,
    jpegs_640x480,
    machine_info,
    scrape,
    where_time_goes,
    write_json,
)
from load_client import closed_loop  # noqa: E402
from serve_load import bodies_for, servers, start, stop  # noqa: E402


def summarize(collapsed: str, top: int = 40, thread: str = "") -> dict:
    """py-spy's collapsed stacks -> samples by thread, and by function (self and inclusive); with
    ``thread``, only the samples of the threads whose name holds it."""
    by_thread, self_fn, incl_fn, total = collections.Counter(), collections.Counter(), collections.Counter(), 0
    for line in collapsed.splitlines():
        stack, _, n = line.rpartition(" ")
        if not stack or not n.isdigit() or thread not in stack.split(";")[0]:
            continue
        n = int(n)
        total += n
        frames = stack.split(";")
        by_thread[frames[0]] += n
        self_fn[frames[-1]] += n
        for f in set(frames[1:]):
            incl_fn[f] += n
    return {
        "samples": total,
        "by_thread": by_thread.most_common(top),
        "self": self_fn.most_common(top),
        "inclusive": incl_fn.most_common(top),
    }


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--variants", default="A", help="';'-separated `serve` argument sets ('A': the defaults)")
    ap.add_argument("--concurrency", default="64,256", type=lambda s: [int(c) for c in s.split(",")])
    ap.add_argument("--duration-s", type=float, default=10.0)
    ap.add_argument("--client-procs", type=int, default=4)
    ap.add_argument("--client-cores", type=int, default=4)
    ap.add_argument("--py-spy", default=None, help="py-spy executable: record the engine at the last point")
    ap.add_argument(
        "--py-spy-flags",
        default="--gil",
        help="py-spy record's sampling flags ('--gil': only while a thread holds the GIL; '--idle': every "
        "thread's wall time; '--native' adds C frames but stalls the engine, 180 img/s where it served 13k)",
    )
    ap.add_argument("--py-spy-thread", default="ft-compute", help="also summarise this thread's samples alone")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--mode", default="single", choices=("single", "multi32"), help="request kind (serve_load's)")
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    import os

    cores = sorted(os.sched_getaffinity(0))
    client_cores, server_cores = cores[-args.client_cores :], cores[: -args.client_cores]
    blobs = jpegs_640x480()
    bodies, images = bodies_for(args.mode, "fullthrottle", blobs)
    res = {"probe": "serve_profile", "machine": machine_info(), "command": " ".join(sys.argv), "variants": {}}
    for vi, variant in enumerate(args.variants.split(";")):
        words = [] if variant.strip() == "A" else variant.split()
        si = [w for w in words if w.startswith("SI=")]  # the engine's sys.setswitchinterval (s)
        envs = [w for w in words if re.match(r"[A-Z][A-Z0-9_]*=", w) and w not in si]  # the server's environment
        cmd, ready, _ = servers(args.device, [w for w in words if w not in si + envs], 1)["fullthrottle"]
        if si:
            wrap = f"import sys; sys.setswitchinterval({float(si[0][3:])}); from fullthrottle.cli import main; "
            wrap += "sys.argv = ['fullthrottle'] + sys.argv[1:]; sys.exit(main())"
            cmd = [cmd[0], "-c", wrap, *cmd[3:]]
        if envs:
            cmd = ["env", *envs, *cmd]  # (env execs the server: the same process id)
        port = free_port()
        proc = start(cmd + ["--port", str(port)], port, ready, server_cores)
        url = f"http://127.0.0.1:{port}/v1/classify"
        pts = []
        try:
            for ci, conc in enumerate(args.concurrency):
                spy = None
                if args.py_spy and vi == 0 and ci == len(args.concurrency) - 1:
                    spy_out = Path(args.out).with_suffix(".collapsed.txt")
                    spy = subprocess.Popen(
                        [
                            args.py_spy,
                            "record",
                            "--pid",
                            str(proc.pid),
                            "--threads",
                            *args.py_spy_flags.split(),
                            "--rate",
                            "200",
                        ]
                        + ["--format", "raw", "--duration", str(int(args.duration_s)), "-o", str(spy_out)],
                        stdout=subprocess.DEVNULL,
                        stderr=subprocess.PIPE,
                        text=True,
                    )
                base = f"http://127.0.0.1:{port}"
                m0, c0, t0 = scrape(base), cpu_by_kind(proc.pid), time.perf_counter()
                r = closed_loop(url, bodies, images, conc, args.duration_s, 3.0, args.client_procs, client_cores)
                c1, dt = cpu_by_kind(proc.pid), time.perf_counter() - t0
                r["where_time_goes"] = where_time_goes(m0, scrape(base))
                r["cores_by_kind"] = cores_by_kind(c0, c1, dt)
                if spy is not None:
                    err = spy.communicate(timeout=60)[1]
                    r["py_spy"] = summarize(spy_out.read_text()) if spy_out.exists() else {"error": err[-2000:]}
                    r["py_spy"]["flags"] = args.py_spy_flags
                    if spy_out.exists() and args.py_spy_thread:
                        r["py_spy"]["thread_" + args.py_spy_thread] = summarize(
                            spy_out.read_text(), 60, args.py_spy_thread
                        )
                    # (--gil: a sample is taken only while some thread holds the GIL)
                    r["py_spy"]["gil_held_pct"] = 100 * r["py_spy"].get("samples", 0) / (200 * int(args.duration_s))
                print(variant, conc, round(r["img_per_s"]), r["p50_ms"], r["p99_ms"], r["cores_by_kind"], flush=True)
                print(variant, conc, r["where_time_goes"], flush=True)
                pts.append(r)
        finally:
            stop(proc)
        key, n = variant, 1
        while key in res["variants"]:  # (a variant run again is kept as its own round)
            n += 1
            key = f"{variant} (round {n})"
        res["variants"][key] = pts
    write_json(args.out, res)
    sp = res["variants"][args.variants.split(";")[0]][-1].get("py_spy")
    if sp and "by_thread" in sp:
        print(json.dumps({k: sp[k][:15] for k in ("by_thread", "self", "inclusive")}, indent=0)[:6000])


if __name__ == "__main__":
    main()
