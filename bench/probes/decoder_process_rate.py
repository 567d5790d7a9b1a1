"""Images/s of fullthrottle's decoder processes alone (no GPU, no pipeline), with and without the
glibc malloc settings they get (``fullthrottle.data.preprocess_procs.MALLOC_ENV``), side by side (issue 01).

P decoder processes, each fed by its own thread one 640x480 JPEG at a time from memory for a fixed
time; images/s summed over them. Also reports each variant's page faults per image (the processes'
own time split, ``FULLTHROTTLE_WORKER_STATS``).

Usage: python bench/probes/decoder_process_rate.py --procs 1,15 --seconds 8 --out decoder_process_rate.json
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # bench/: common.py
from common import jpegs_640x480, machine_info, write_json  # noqa: E402
from e2e_cpu_decode import _worker_stats  # noqa: E402


def measure(procs: int, seconds: float, blobs: list[bytes], malloc_env: bool) -> dict:
    import fullthrottle.data.preprocess_procs as pp

    stats = tempfile.mkdtemp(prefix="ft-rate-")
    os.environ[pp.STATS_ENV] = os.path.join(stats, "w")
    try:
        pool = pp.DecoderPool(procs, rows=procs, malloc_env=None if malloc_env else {})
    finally:
        os.environ.pop(pp.STATS_ENV)
    counts = [0] * procs
    start = threading.Barrier(procs + 1)

    def feed(i):
        w = pool[i]
        for b in blobs[:10]:  # warm-up
            w(b)
        start.wait()
        t0 = time.perf_counter()
        while time.perf_counter() - t0 < seconds:
            w.send(blobs[counts[i] % len(blobs)], i)
            w.receive()
            counts[i] += 1

    ts = [threading.Thread(target=feed, args=(i,)) for i in range(procs)]
    for t in ts:
        t.start()
    start.wait()
    t0 = time.perf_counter()
    for t in ts:
        t.join()
    rate = sum(counts) / (time.perf_counter() - t0)
    pool.close()
    return {
        "procs": procs,
        "malloc_env": pp.MALLOC_ENV if malloc_env else "glibc defaults",
        "img_per_s": rate,
        "worker_time_split": _worker_stats(stats),
    }


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--procs", default="1,15")
    ap.add_argument("--seconds", type=float, default=8.0)
    ap.add_argument("--out", default="decoder_process_rate.json")
    args = ap.parse_args()
    blobs = jpegs_640x480()[:256]
    rows = []
    for p in [int(x) for x in args.procs.split(",")]:
        for env in (False, True):  # side by side, same images
            rows.append(measure(p, args.seconds, blobs, env))
            r = rows[-1]
            print(
                f"{p} procs, malloc env {'on ' if env else 'off'}: {r['img_per_s']:.0f} img/s, "
                f"{r['worker_time_split']['minor_faults_per_image']:.0f} faults/img",
                flush=True,
            )
    write_json(
        args.out, {"benchmark": "decoder_process_rate", "machine": machine_info(), "images": "640x480", "rows": rows}
    )


if __name__ == "__main__":
    main()
