"""Probe: whether a burst of large request bodies leaves the server's processes at their peak size.

``fullthrottle serve --device cpu`` (one process, or ``--http-workers N``) gets ``--bursts`` bursts of
``--clients`` concurrent POSTs of ``--body-mb`` MB each (random bytes: each image is refused after
its body is read, so what is measured is the bodies' memory, not a model's). The resident memory
(VmRSS, MiB) of every server process, summed and by process id (the first: the engine), is read once ready, right after each burst, and
``--idle-s`` seconds later. The server gives the freed heap back ``TRIM_AFTER_S`` after a burst
(``server/guard.py``); without that, the process stays near its peak.

Usage: python bench/probes/burst_memory_probe.py [--http-workers 1] [--bursts 2] [--clients 24]
    [--body-mb 20] [--idle-s 5] --out burst_memory_probe.json
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

HERE = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(HERE))  # bench/: common.py
from common import free_port, machine_info, rss_mib, tree, wait_ready, write_json  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--http-workers", type=int, default=1)
    ap.add_argument("--bursts", type=int, default=2)
    ap.add_argument("--clients", type=int, default=24)
    ap.add_argument("--body-mb", type=int, default=20)
    ap.add_argument("--idle-s", type=float, default=5.0)
    ap.add_argument("--out", required=True)
    a = ap.parse_args()
    import httpx

    port = free_port()
    cmd = [sys.executable, "-m", "fullthrottle.cli", "serve", "--device", "cpu", "--port", str(port), "--model",
           "resnet18", "--http-workers", str(a.http_workers), "--max-body-mb", str(a.body_mb + 4)]  # fmt: skip
    srv = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=dict(os.environ))
    url = f"http://127.0.0.1:{port}"
    points = []

    def mib() -> float:
        return round(sum(rss_mib(p) or 0.0 for p in tree(srv.pid)), 1)

    def each() -> dict:
        return {str(p): round(rss_mib(p) or 0.0, 1) for p in tree(srv.pid)}

    try:
        if not wait_ready(url + "/readyz", None, 120):
            raise SystemExit("the server did not become ready")
        points.append({"when": "ready", "rss_mib": mib(), "by_process": each()})
        body = os.urandom(a.body_mb << 20)
        statuses: list[int] = []

        def post():
            try:
                r = httpx.post(url + "/v1/classify", content=body, headers={"content-type": "image/jpeg"}, timeout=120)
                statuses.append(r.status_code)
            except httpx.HTTPError:
                statuses.append(-1)

        for b in range(a.bursts):
            ts = [threading.Thread(target=post) for _ in range(a.clients)]
            for t in ts:
                t.start()
            for t in ts:
                t.join()
            points.append({"when": f"after burst {b}", "rss_mib": mib(), "by_process": each()})
            time.sleep(a.idle_s)
            points.append({"when": f"{a.idle_s:g} s later", "rss_mib": mib(), "by_process": each()})
    finally:
        srv.terminate()
        srv.wait(60)
    for p in points:
        print(f"{p['when']:>16}: {p['rss_mib']:8.1f} MiB  {p['by_process']}")
    write_json(
        a.out,
        {
            "probe": "burst_memory",
            "machine": machine_info(),
            "command": " ".join(cmd[1:]),
            "bursts": a.bursts,
            "clients": a.clients,
            "body_mb": a.body_mb,
            "statuses": {str(s): statuses.count(s) for s in sorted(set(statuses))},
            "points": points,
        },
    )


if __name__ == "__main__":
    main()
