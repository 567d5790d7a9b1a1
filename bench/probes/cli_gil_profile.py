"""Who holds the main process's GIL while ``fullthrottle classify`` runs on files (issue 10). A probe.

Runs the CLI (ResNet18, defaults) on ``--folder`` listed ``--repeat`` times and, once results flow
(the output file grows), samples its main process with ``py-spy record --gil --threads`` for
``--seconds``. Writes: the fraction of samples in which some thread held the GIL (near 1: the main
interpreter is the bottleneck), the share of each thread, and the functions with the most samples
(own time and inclusive), so the per-image Python work can be ranked.

Usage: python bench/probes/cli_gil_profile.py --folder DIR --py-spy PATH --out cli_gil_profile.json
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # bench/: common.py
from common import machine_info, py_spy_raw, write_json  # noqa: E402


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--folder", required=True)
    ap.add_argument("--repeat", type=int, default=4, help="list the folder this many times")
    ap.add_argument("--py-spy", required=True, help="py-spy executable")
    ap.add_argument("--seconds", type=float, default=8.0)
    ap.add_argument("--rate", type=int, default=250, help="samples per second")
    ap.add_argument("--args", default="--model resnet18", help="more CLI arguments")
    ap.add_argument(
        "--gc-timing", action="store_true", help="also time the main process's garbage collections (interp_hooks/)"
    )
    ap.add_argument("--out", default="cli_gil_profile.json")
    args = ap.parse_args()
    tmp = Path(os.environ.get("TMPDIR", "/tmp"))
    out_file, rep, raw = tmp / "gil_out.jsonl", tmp / "gil_report.json", tmp / "gil_raw.txt"
    for f in (out_file, rep, raw):
        f.unlink(missing_ok=True)
    cmd = [sys.executable, "-m", "fullthrottle.cli", "classify", *[args.folder] * args.repeat, "--device", "cuda"]
    cmd += ["--no-progress", "--out", str(out_file), "--report-json", str(rep), *args.args.split()]
    env = dict(os.environ)
    gc_prefix = str(tmp / "gc_timing")
    if args.gc_timing:  # (every Python process of the run writes one; the main process's is read)
        here = str(Path(__file__).resolve().parent / "interp_hooks")
        env.update(FT_GC_TIMING=gc_prefix, PYTHONPATH=here + os.pathsep + env.get("PYTHONPATH", ""))
    p = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, env=env)
    t0 = time.perf_counter()
    while p.poll() is None and (not out_file.exists() or out_file.stat().st_size < 1 << 20):
        time.sleep(0.1)
    started = time.perf_counter() - t0
    spy = subprocess.run(
        [args.py_spy, "record", "--gil", "--threads", "--nonblocking", "-r", str(args.rate)]
        + ["-d", str(int(args.seconds)), "-f", "raw", "-p", str(p.pid), "-o", str(raw)],
        capture_output=True,
        text=True,
    )
    _, err = p.communicate()
    by_thread, own, incl = collections.Counter(), collections.Counter(), collections.Counter()
    total = 0
    for frames, c in py_spy_raw(raw):
        total += c
        thread = frames[0]
        by_thread[re.sub(r"\(tid.*?\)|0x[0-9a-f]+", "", thread).strip()] += c
        own[frames[-1]] += c
        for f in set(frames[1:]):
            incl[f] += c
    gc_file = Path(f"{gc_prefix}.{p.pid}.json")
    payload = {
        "probe": "cli_gil_profile",
        "machine": machine_info(),
        "command": " ".join(cmd[2:]),
        "results_flowed_after_s": round(started, 1),
        "py_spy_exit": spy.returncode,
        "py_spy_stderr": spy.stderr[-600:],
        "cli_exit": p.returncode,
        "cli_stderr_tail": err[-1200:],
        "report": json.loads(rep.read_text()) if rep.exists() else None,
        "main_process_gc": json.loads(gc_file.read_text()) if gc_file.exists() else None,
        "samples_with_gil": total,
        "gil_held_fraction": round(total / (args.rate * args.seconds), 3),
        "by_thread": dict(by_thread.most_common(30)),
        "top_own": dict(own.most_common(60)),
        "top_inclusive": dict(incl.most_common(80)),
    }
    write_json(args.out, payload)
    print(json.dumps({k: payload[k] for k in ("gil_held_fraction", "main_process_gc", "by_thread")}, indent=1))
    for f, c in own.most_common(25):
        print(f"{c:6d} {f[:150]}")


if __name__ == "__main__":
    main()
