"""HTTP image serving under load, the benchmark of record of the server: ``fullthrottle serve`` (its
default HTTP worker processes, and one process) against plain FastAPI and LitServe with its batching
on, same model (ResNet18, random weights, bf16 on CUDA), same 640x480 JPEGs, same run.

Each server runs as its own process tree pinned to the server cores; the load comes from client
processes on the client cores (``load_client.py``: aiohttp, keep-alive, closed loop). Per point:
img/s, p50/p99 ms, status counts, GPU busy (NVML), the server's CPU use (cores), the clients' CPU use;
fullthrottle's also where an image's time went inside the server (``where_time_goes``, from two scrapes
of its /metrics: each stage's mean queue wait, the engine's and the HTTP worker's mean latency).

- ``single``: one JPEG per request (LitServe: as a one-file multipart form, its way for files);
- ``multi32``: 32 JPEGs per multipart request (fullthrottle and FastAPI);
- LitServe: ``workers_per_device`` (and as many API server processes) swept at 64 clients, the best
  runs every point;
- overload: after fullthrottle's points, an open loop at twice its best img/s over at most
  ``load_client.OPEN_LOOP_CONNECTIONS`` connections: goodput, statuses, and the server's resident
  memory before and after.

Usage:
  python bench/serve_load.py --out bench/results/serve_load.json [--servers fullthrottle,litserve,...]
  python bench/serve_load.py --merge a.json b.json --out bench/results/serve_load.json   (+ the plot)
  python bench/serve_load.py --compare-gpus ...   (fullthrottle on one GPU against --gpus all)
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from common import (  # noqa: E402
    cores_by_kind,
    cpu_by_kind,
    cpu_s,
    free_port,
    jpegs_640x480,
    machine_info,
    scrape,
    tree,
    wait_ready,
    where_time_goes,
    write_json,
)
from load_client import OPEN_LOOP_CONNECTIONS, closed_loop, multipart, open_loop  # noqa: E402


def tree_cpu_s(pid: int) -> float:
    return sum(c for p in tree(pid) if (c := cpu_s(p)) is not None)


def tree_rss_mib(pid: int) -> float:
    total = 0
    for p in tree(pid):
        try:
            total += int(Path(f"/proc/{p}/statm").read_text().split()[1]) * os.sysconf("SC_PAGE_SIZE")
        except (OSError, IndexError, ValueError):
            pass
    return total / 2**20


def start(cmd: list[str], port: int, ready: str, cores: list[int] | None) -> subprocess.Popen:
    import tempfile

    pin = (lambda: os.sched_setaffinity(0, cores)) if cores else None
    log = tempfile.TemporaryFile("w+")  # (a pipe nobody reads would stall the server on its access log)
    p = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=log, text=True, preexec_fn=pin)
    if wait_ready(f"http://127.0.0.1:{port}{ready}", p, 400):
        return p
    p.kill()
    log.seek(0)
    raise RuntimeError(f"server did not start: {' '.join(cmd)}\n{log.read()[-3000:]}")


def stop(p: subprocess.Popen) -> None:
    """SIGTERM, then SIGKILL for whatever of its process tree is left 60 s on (LitServe leaves its
    worker processes behind when its main process stops)."""
    procs = tree(p.pid)
    p.send_signal(signal.SIGTERM)
    try:
        p.wait(60)
    except subprocess.TimeoutExpired:
        pass
    time.sleep(1)
    for q in procs:
        try:
            os.kill(q, signal.SIGKILL)
        except ProcessLookupError:
            pass
    p.wait()


def servers(device: str, extra: list[str], litserve_workers: int) -> dict:
    """name -> (command without the port, readiness path, modes)."""
    # (the load comes from one address, as from a proxy: the per-client connection cap is raised, as
    # serve --help says to do behind one; the connection cap is raised above the overload's client
    # connections, so that the overload meets the queue's admission control: load_client.open_loop)
    ft = [sys.executable, "-m", "fullthrottle.cli", "serve", "--device", device, "--model", "resnet18"]
    ft += ["--max-connections-per-client", "100000", "--max-connections", str(2 * OPEN_LOOP_CONNECTIONS), *extra]
    peer = [sys.executable, str(HERE / "serve_peers.py")]
    return {
        "fullthrottle": (ft, "/readyz", ("single", "multi32")),
        "fullthrottle_1_process": (ft + ["--http-workers", "1"], "/readyz", ("single",)),
        "fastapi": (peer + ["fastapi", "--device", device], "/readyz", ("single", "multi32")),
        "litserve": (
            peer
            + ["litserve", "--device", device, "--workers", str(litserve_workers)]
            + ["--api-servers", str(litserve_workers)],
            "/health",
            ("single",),
        ),
        "fullthrottle_1_gpu": (ft + ["--gpus", "1"], "/readyz", ("single",)),
        "fullthrottle_all_gpus": (ft + ["--gpus", "all"], "/readyz", ("single",)),
    }


def bodies_for(mode: str, name: str, blobs: list[bytes]) -> tuple[list[tuple[bytes, str]], int]:
    if mode == "multi32":
        return [multipart([blobs[(k + j) % len(blobs)] for j in range(32)]) for k in range(0, len(blobs), 8)], 32
    if name == "litserve":
        return [multipart([b], field="content") for b in blobs], 1
    return [(b, "image/jpeg") for b in blobs], 1


def measure(proc, url, bodies, images, conc, args, client_cores, gpu, ours=False) -> dict:
    """One closed-loop point; for fullthrottle (``ours``), where an image's time went in the server
    over it, from its /metrics (the stages' queue waits, the engine's and the HTTP worker's latency)."""
    base = url.rsplit("/v1/", 1)[0]
    m0, k0 = (scrape(base), cpu_by_kind(proc.pid)) if ours else (None, None)
    cpu0, t0 = tree_cpu_s(proc.pid), time.perf_counter()
    mon = None
    if gpu:
        from fullthrottle.core.gpumon import GpuMonitor

        mon = GpuMonitor(0).__enter__()
    try:
        r = closed_loop(url, bodies, images, conc, args.duration_s, 3.0, args.client_procs, client_cores)
    finally:
        if mon is not None:
            mon.__exit__(None, None, None)
    dt = time.perf_counter() - t0
    r["server_cores"] = (tree_cpu_s(proc.pid) - cpu0) / dt
    r["gpu_busy_pct"] = mon.mean_util_pct if mon is not None else None
    if ours:
        r["where_time_goes"] = where_time_goes(m0, scrape(base))
        r["server_cores_by_kind"] = cores_by_kind(k0, cpu_by_kind(proc.pid), dt)
    if not r["statuses"]:  # (nothing measured: no rate of 0 img/s to be read as one)
        print(f"  {conc:4d} clients: no request ended within the {args.duration_s:g} s window", flush=True)
    else:
        lat = f"p50 {r['p50_ms']:.1f} p99 {r['p99_ms']:.1f} ms" if r["p50_ms"] is not None else "no 200"
        print(f"  {conc:4d} clients: {r['img_per_s']:8.0f} img/s  {lat}  {r['statuses']}", flush=True)
    return r


def run_server(name, cmd, ready, modes, args, blobs, server_cores, client_cores, gpu, overload=False) -> dict:
    port = free_port()
    proc = start(cmd + ["--port", str(port)], port, ready, server_cores)
    out = {"command": " ".join(cmd[1:]), "points": {}}
    try:
        url = f"http://127.0.0.1:{port}/v1/classify"
        for mode in modes:
            bodies, images = bodies_for(mode, name, blobs)
            print(f"{name} {mode}", flush=True)
            out["points"][mode] = [
                measure(proc, url, bodies, images, c, args, client_cores, gpu, name.startswith("fullthrottle"))
                for c in args.concurrency
            ]
        if overload:
            peak = max(p["img_per_s"] for p in out["points"]["single"])
            bodies, _ = bodies_for("single", name, blobs)
            rss0, k0, t0 = tree_rss_mib(proc.pid), cpu_by_kind(proc.pid), time.perf_counter()
            o = open_loop(url, bodies, 1, 2 * peak, args.overload_s, 10.0, args.client_procs, client_cores)
            # (over the open loop and the wait for its last answers)
            o["server_cores_by_kind"] = cores_by_kind(k0, cpu_by_kind(proc.pid), time.perf_counter() - t0)
            time.sleep(10)
            o.update(peak_img_per_s=peak, goodput_over_peak=o["goodput_img_per_s"] / peak)
            o.update(server_rss_mib_before=rss0, server_rss_mib_10s_after=tree_rss_mib(proc.pid))
            limited = " (limited by the clients)" if o["client_limited"] else ""
            print(
                f"  overload at {2 * peak:.0f} req/s: goodput {o['goodput_img_per_s']:.0f} {o['statuses']}{limited}",
                flush=True,
            )
            out["overload"] = o
    finally:
        stop(proc)
    return out


def plot(result: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (a, b) = plt.subplots(1, 2, figsize=(11, 4))
    for name, s in result["servers"].items():
        for mode, pts in s["points"].items():
            x = [p["concurrency"] for p in pts]
            a.plot(x, [p["img_per_s"] for p in pts], marker="o", label=f"{name} {mode}")
            b.plot(x, [p["p99_ms"] for p in pts], marker="o", label=f"{name} {mode}")
    for ax, y in ((a, "images/s"), (b, "p99 latency (ms)")):
        ax.set_xscale("log", base=2)
        ax.set_xlabel("concurrent clients")
        ax.set_ylabel(y)
        ax.grid(alpha=0.3)
    b.set_yscale("log")
    a.legend(fontsize=7)
    fig.suptitle(f"POST /v1/classify, ResNet18, 640x480 JPEG ({result['machine'].get('gpu', 'cpu')})")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default="bench/results/serve_load.json")
    ap.add_argument("--device", default="auto")
    ap.add_argument("--servers", default="fullthrottle,fullthrottle_1_process,fastapi,litserve")
    ap.add_argument("--concurrency", default="1,8,64,256", type=lambda s: [int(c) for c in s.split(",")])
    ap.add_argument("--duration-s", type=float, default=20.0, help="measured seconds per point (after 3 s warm-up)")
    ap.add_argument("--overload-s", type=float, default=30.0, help="the open loop's seconds (0: none)")
    ap.add_argument("--client-procs", type=int, default=4)
    ap.add_argument("--client-cores", type=int, default=4, help="the last N cores run the clients (0: not pinned)")
    ap.add_argument(
        "--litserve-workers", default="1,2,4", help="workers_per_device (= num_api_servers) tried at 64 clients"
    )
    ap.add_argument("--modes", default="single,multi32", help="request kinds measured (each server: those it takes)")
    ap.add_argument("--server-args", default="", help="extra `fullthrottle serve` arguments")
    ap.add_argument("--compare-gpus", action="store_true", help="fullthrottle_1_gpu against fullthrottle_all_gpus")
    ap.add_argument("--merge", nargs="+", metavar="JSON", help="merge partial results into --out and plot")
    ap.add_argument("--note", action="append", default=[], help="with --merge: a note kept in the result (repeatable)")
    args = ap.parse_args()
    known = servers("cpu", [], 1)
    names = ["fullthrottle_1_gpu", "fullthrottle_all_gpus"] if args.compare_gpus else args.servers.split(",")
    if bad := [n for n in names if n not in known]:
        ap.error(f"--servers: no server named {', '.join(bad)} (known: {', '.join(known)})")
    if bad := [m for m in args.modes.split(",") if m not in ("single", "multi32")]:
        ap.error(f"--modes: {', '.join(bad)} is no request kind (single, multi32)")
    if min(args.concurrency) < 1 or args.duration_s <= 0 or args.overload_s < 0 or args.client_procs < 1:
        ap.error("--concurrency, --duration-s and --client-procs must be > 0, --overload-s >= 0")
    if args.merge and (missing := [p for p in args.merge if not Path(p).is_file()]):
        ap.error(f"--merge: no such file: {', '.join(missing)}")
    if args.merge:
        parts = [json.loads(Path(p).read_text()) for p in args.merge]
        res = dict(parts[0], servers={k: v for p in parts for k, v in p["servers"].items()})
        res["commands"] = [p["command"] for p in parts]
        res["machines"] = [p["machine"] for p in parts]
        if args.note:
            res["notes"] = args.note
        write_json(args.out, res)
        plot(res, str(Path(args.out).with_suffix(".png")))
        return
    import torch

    if args.device == "auto":
        args.device = "cuda" if torch.cuda.is_available() else "cpu"
    gpu = args.device.startswith("cuda")
    ncpu = len(os.sched_getaffinity(0))
    cores = sorted(os.sched_getaffinity(0))
    client_cores = cores[-args.client_cores :] if 0 < args.client_cores < ncpu else None
    server_cores = cores[: -args.client_cores] if client_cores else None
    if args.client_cores and client_cores is None:
        print(f"note: --client-cores {args.client_cores} leaves no core of {ncpu} to the servers: not pinned")
    blobs = jpegs_640x480()
    table = servers(args.device, args.server_args.split(), 1)
    res = {"servers": {}}
    head = {
        "benchmark": "serve_load",
        "machine": machine_info(),
        "command": " ".join(sys.argv),
        "device": args.device,
        "images": "the 200 ImageNet samples at 640x480, JPEG quality 90 (~60 KB)",
        "model": "resnet18, random weights, bf16 on CUDA",
        "server_cores": server_cores,
        "client_cores": client_cores,
        "duration_s_per_point": args.duration_s,
    }
    for name in names:
        try:  # (a server that cannot start is its own entry: the others' results are kept)
            res["servers"][name] = run_named(name, table, args, blobs, server_cores, client_cores, gpu)
        except RuntimeError as e:
            print(f"{name}: {e}", file=sys.stderr)
            res["servers"][name] = {"error": str(e)[-2000:], "points": {}}
        write_json(args.out, {**head, **res})  # (after each server: a run cut short keeps what it measured)


def run_named(name, table, args, blobs, server_cores, client_cores, gpu) -> dict:
    """Server ``name``'s points (LitServe: its workers per device swept at 64 clients first, the best run)."""
    if name == "litserve":
        sweep = {}
        for w in map(int, args.litserve_workers.split(",")):
            cmd, ready, _ = servers(args.device, [], w)["litserve"]
            short = argparse.Namespace(**{**vars(args), "concurrency": [64], "duration_s": 10.0})
            r = run_server("litserve", cmd, ready, ("single",), short, blobs, server_cores, client_cores, gpu)
            sweep[w] = r["points"]["single"][0]["img_per_s"]
        best = max(sweep, key=sweep.get)
        cmd, ready, modes = servers(args.device, [], best)["litserve"]
        r = run_server(name, cmd, ready, modes, args, blobs, server_cores, client_cores, gpu)
        r["workers_per_device_sweep_img_per_s_at_64"] = sweep
        return r
    cmd, ready, modes = table[name]
    modes = tuple(m for m in modes if m in args.modes.split(","))
    overload = name == "fullthrottle" and args.overload_s > 0 and "single" in modes
    return run_server(name, cmd, ready, modes, args, blobs, server_cores, client_cores, gpu, overload)


if __name__ == "__main__":
    main()
