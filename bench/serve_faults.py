"""Faults under load for ``--duration`` seconds: does the server lose an accepted request?

Starts ``fullthrottle serve --port 0`` with the given arguments (``--gpu-decode`` on CUDA by default),
loads it from ``--clients`` threads posting the 200 ImageNet samples (half on new connections, half
on kept-alive ones), and meanwhile, every ``--every`` seconds: kills one CPU decoder process and one GPU
decoder process (SIGKILL), and opens 5 connections that hang up mid-body and 5 that hang up before
reading their answer. It pauses the load at the start and at the end to take the memory (PSS) of
the server and its decoder processes, then sends SIGTERM. Counted per request: 200, an error status
with the reason (its ``detail``), "refused" (the server had stopped listening), "raced" (a keep-alive
connection closed at SIGTERM as the request went out: clients retry those) and "lost" (no answer:
the goal is none). After exit: which of the server's processes are left.

Usage: python bench/serve_faults.py --duration 300 --out bench/results/serve_faults.json -- --device cuda
"""

from __future__ import annotations

import argparse
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import SAMPLES, machine_info, write_json  # noqa: E402


def children(pid: int) -> set[int]:
    out = set()
    for d in os.listdir("/proc"):
        if d.isdigit():
            try:
                with open(f"/proc/{d}/stat") as f:
                    if int(f.read().rsplit(")", 1)[1].split()[1]) == pid:
                        out.add(int(d))
            except (OSError, ValueError, IndexError):
                pass
    return out


def cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return ""


def pss_mib(pids) -> float:
    """Proportional set size of these processes together (MiB): a page they share (the crop pool,
    the libraries) counts once, split between them, where resident sizes would count it per process."""
    total = 0
    for pid in pids:
        try:
            with open(f"/proc/{pid}/smaps_rollup") as f:
                total += next(int(line.split()[1]) for line in f if line.startswith("Pss:"))
        except (OSError, StopIteration):
            pass
    return total / 1024


def alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def main() -> None:
    import httpx

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--duration", type=float, default=300.0, help="seconds of load with faults")
    ap.add_argument("--every", type=float, default=20.0, help="seconds between rounds of faults")
    ap.add_argument("--clients", type=int, default=16)
    ap.add_argument("--out", default="bench/results/serve_faults.json")
    ap.add_argument("server_args", nargs="*", help="after --: arguments for fullthrottle serve")
    args = ap.parse_args()
    photos = [p.read_bytes() for p in sorted(SAMPLES.glob("*.JPEG"))]
    cmd = [sys.executable, "-m", "fullthrottle.cli", "serve", "--port", "0", *args.server_args]
    proc = subprocess.Popen(
        cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, env=dict(os.environ, PYTHONUNBUFFERED="1")
    )
    log: list[str] = []
    url, deadline = None, time.time() + 300
    while url is None and time.time() < deadline and proc.poll() is None:
        line = proc.stderr.readline()
        log.append(line)
        m = re.search(r"running on (http://127\.0\.0\.1:\d+)", line)
        url = m.group(1) if m else None
    if url is None:
        if proc.poll() is not None:  # it exited: what it wrote last is still in the pipe
            log.append(proc.stderr.read())
        sys.exit(f"server did not start (exit {proc.poll()}):\n" + "".join(log)[-6000:])
    threading.Thread(target=lambda: [log.append(x) for x in proc.stderr], daemon=True).start()
    print(f"server up at {url} ({' '.join(cmd[2:])})", flush=True)
    host, port = url.removeprefix("http://").split(":")
    stop, pause, lock = threading.Event(), threading.Event(), threading.Lock()
    outcomes: list[tuple] = []
    t_term = [float("inf")]
    modes = ("close", "keep-alive")

    def client(k: int) -> None:
        with httpx.Client(timeout=120) as c:
            i = k
            while not stop.is_set():
                while pause.is_set():
                    time.sleep(0.05)
                try:
                    r = c.post(
                        url + "/v1/classify",
                        content=photos[i % len(photos)],
                        headers={"content-type": "image/jpeg", "connection": modes[k % 2]},
                    )
                    got = (r.status_code, r.json().get("detail", "") if r.status_code != 200 else "")
                except httpx.ConnectError:
                    got = ("refused", "")
                except httpx.HTTPError as e:
                    raced = modes[k % 2] == "keep-alive" and time.time() > t_term[0]
                    got = (
                        "raced" if raced else "lost",
                        f"{type(e).__name__} {time.time() - t_term[0]:+.2f} s from SIGTERM, connection {modes[k % 2]}",
                    )
                with lock:
                    outcomes.append(got)
                if got[0] == "refused":
                    return
                i += args.clients

    def hang_ups() -> None:
        for _ in range(5):
            for body in (photos[0][:1000], photos[1]):  # mid-body; whole body, then gone before the answer
                s = socket.create_connection((host, int(port)))
                n = len(photos[0]) if len(body) == 1000 else len(body)
                s.sendall(
                    b"POST /v1/classify HTTP/1.1\r\nHost: x\r\nContent-Type: image/jpeg\r\n"
                    b"Content-Length: %d\r\n\r\n" % n + body
                )
                s.close()

    def snapshot() -> float:
        pause.set()
        time.sleep(3)
        v = pss_mib([proc.pid, *children(proc.pid)])
        pause.clear()
        return v

    threads = [threading.Thread(target=client, args=(k,), daemon=True) for k in range(args.clients)]
    for t in threads:
        t.start()
    time.sleep(10)  # warm
    rss0 = snapshot()
    workers0 = children(proc.pid)
    kills = {"cpu decoder": 0, "gpu decoder": 0}
    t0 = time.time()
    rounds = 0
    while time.time() - t0 < args.duration:
        kids = sorted(children(proc.pid))
        gpu = [p for p in kids if "fullthrottle.data.gpu_decoder_worker" in cmdline(p)]
        cpu = [p for p in kids if "fullthrottle.data.decoder_worker" in cmdline(p)]
        for name, pool in (("cpu decoder", cpu), ("gpu decoder", gpu)):
            if pool:
                os.kill(pool[rounds % len(pool)], signal.SIGKILL)
                kills[name] += 1
        hang_ups()
        rounds += 1
        time.sleep(args.every)
        with lock:  # progress, so a run cut short still tells what it saw
            seen = [o[0] for o in outcomes]
        print(
            f"{time.time() - t0:5.0f} s: {len(seen)} requests, {seen.count(200)} ok, "
            f"{seen.count('lost')} lost, kills {kills}",
            flush=True,
        )
    with lock:
        n_before_end = len(outcomes)
    rss1 = snapshot()
    everyone = children(proc.pid) | workers0
    t_term[0] = time.time()
    proc.send_signal(signal.SIGTERM)
    try:
        code = proc.wait(120)
    except subprocess.TimeoutExpired:
        proc.kill()
        code = "killed after 120 s"
    stop.set()
    for t in threads:
        t.join(120)
    time.sleep(2)
    left = [p for p in everyone if alive(p)]
    statuses = [o[0] for o in outcomes]
    counts = {str(s): statuses.count(s) for s in sorted(set(statuses), key=str)}
    reasons = sorted({f"{o[0]}: {o[1]}" for o in outcomes if o[1]})[:30]
    payload = {
        "benchmark": "serve_faults",
        "machine": machine_info(),
        "command": " ".join(cmd[2:]),
        "duration_s": args.duration,
        "every_s": args.every,
        "clients": args.clients,
        "rounds": rounds,
        "kills": kills,
        "hang_ups": rounds * 10,
        "requests": len(outcomes),
        "requests_before_sigterm": n_before_end,
        "outcomes": counts,
        "reasons": reasons,
        "pss_mib_start": rss0,
        "pss_mib_end": rss1,
        "server_tracebacks": sum(line.startswith("Traceback") for line in log),
        "exit_code": code,
        "processes_left": left,
        "server_log_tail": "".join(log[-30:])[-4000:],
    }
    write_json(args.out, payload)
    print(
        {
            k: payload[k]
            for k in (
                "requests",
                "outcomes",
                "kills",
                "pss_mib_start",
                "pss_mib_end",
                "server_tracebacks",
                "exit_code",
                "processes_left",
            )
        },
        flush=True,
    )


if __name__ == "__main__":
    main()
