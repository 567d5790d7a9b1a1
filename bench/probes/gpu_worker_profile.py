"""Where a GPU decoder process's time goes, on JPEG files (issue 10: a probe, not the product benchmark).

Part 1, one process, the worker's steps one at a time on batches of ``--batch`` files, each step
synchronised and timed: file read (:func:`~fullthrottle.data.load.read_local`), the header check
(:func:`~fullthrottle.data.gpu_decode.gpu_eligible`), the decoder's call, the resize + crop
(:func:`~fullthrottle.data.gpu_resize.resize_crop_batch`) and the D2H copy into pinned memory; ms per batch.

Part 2, P processes at once (each the worker's loop body, unsynchronised until the end of a batch,
as :func:`~fullthrottle.data.gpu_decoder_worker.gpu_worker_main` runs it) for ``--seconds``: aggregate img/s
for P in ``--procs``, with and without the header check, for each decoder kind in ``--kinds``.

Usage: python bench/probes/gpu_worker_profile.py --folder /tmp/ft-files/640x480 --out OUT.json
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # bench/: common.py
from common import machine_info, write_json  # noqa: E402


def _setup(kind: str, bs: int):
    import torch

    from fullthrottle.data.gpu_decoders import make_gpu_decoder

    torch.set_num_threads(1)
    dev = torch.device("cuda")
    dec = make_gpu_decoder(dev, kind)
    host = torch.empty((bs, 224, 224, 3), dtype=torch.uint8, pin_memory=True)
    return torch, dev, dec, host


def profile_steps(paths: list[str], kind: str, bs: int, batches: int) -> dict:
    """Part 1: ms per batch of each step, each synchronised."""
    torch, dev, dec, host = _setup(kind, bs)
    from fullthrottle.data.gpu_decode import gpu_eligible
    from fullthrottle.data.gpu_resize import resize_crop_batch
    from fullthrottle.data.load import read_local

    steps = {"read": 0.0, "check": 0.0, "decode": 0.0, "resize": 0.0, "d2h": 0.0}
    stream = torch.cuda.Stream()
    n = 0
    with torch.cuda.stream(stream), torch.inference_mode():
        for b in range(batches + 2):
            chunk = [paths[(b * bs + j) % len(paths)] for j in range(bs)]
            t0 = time.perf_counter()
            blobs = [read_local(p, 1 << 28) for p in chunk]
            t1 = time.perf_counter()
            ok = [gpu_eligible(x)[0] for x in blobs]
            t2 = time.perf_counter()
            imgs = dec([x for x, o in zip(blobs, ok) if o])
            stream.synchronize()
            t3 = time.perf_counter()
            rows = torch.empty((len(imgs), 224, 224, 3), dtype=torch.uint8, device=dev)
            resize_crop_batch(imgs, rows, 256, 224)
            stream.synchronize()
            t4 = time.perf_counter()
            host[: len(imgs)].copy_(rows, non_blocking=True)
            stream.synchronize()
            t5 = time.perf_counter()
            if b >= 2:  # (the first two warm up)
                for k, v in zip(steps, (t1 - t0, t2 - t1, t3 - t2, t4 - t3, t5 - t4)):
                    steps[k] += v
                n += 1
    ms = {k: round(v / n * 1e3, 3) for k, v in steps.items()}
    total = sum(ms.values())
    return {"kind": dec.kind, "batch": bs, "ms_per_batch": ms, "img_per_s": round(bs / total * 1e3, 1)}


def _loop(paths, kind, bs, seconds, check, barrier, q):
    torch, dev, dec, host = _setup(kind, bs)
    from fullthrottle.data.gpu_decode import decode_crops
    from fullthrottle.data.load import read_local

    stream = torch.cuda.Stream()

    def one(i):
        blobs = [read_local(paths[(i * bs + j) % len(paths)], 1 << 28) for j in range(bs)]
        with torch.cuda.stream(stream), torch.inference_mode():
            out = decode_crops(dec, blobs, 256, 224, device=dev, check=check)
            rows = next(o[0] for o in out if isinstance(o, tuple))
            host[: rows.shape[0]].copy_(rows, non_blocking=True)
        stream.synchronize()

    for i in range(3):
        one(i)
    barrier.wait()
    t0, n, i = time.perf_counter(), 0, 0
    while time.perf_counter() - t0 < seconds:
        one(i)
        i += 1
        n += bs
    q.put((n, time.perf_counter() - t0))


def concurrent(paths, procs, kind, bs, seconds, check) -> float:
    """Part 2: aggregate img/s of ``procs`` worker loops at once."""
    ctx = mp.get_context("spawn")
    barrier, q = ctx.Barrier(procs), ctx.Queue()
    ps = [ctx.Process(target=_loop, args=(paths[k::procs], kind, bs, seconds, check, barrier, q)) for k in range(procs)]
    for p in ps:
        p.start()
    res = [q.get(timeout=300) for _ in ps]
    for p in ps:
        p.join()
    return sum(n for n, _ in res) / max(s for _, s in res)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--folder", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--kinds", default="nvjpeg,hardware")
    ap.add_argument("--batches", default="64,128", help="batch sizes of part 1")
    ap.add_argument("--batch", type=int, default=64, help="batch size of part 2")
    ap.add_argument("--procs", default="1,2,4,6")
    ap.add_argument("--seconds", type=float, default=4.0)
    args = ap.parse_args()
    paths = sorted(str(p) for p in Path(args.folder).glob("*.jpg"))
    rows = []
    for kind in args.kinds.split(","):
        for bs in (int(x) for x in args.batches.split(",")):
            try:
                r = {"part": "steps", **profile_steps(paths, kind, bs, 20)}
            except Exception as e:  # noqa: BLE001 - a probe: say what failed, go on
                r = {"part": "steps", "kind": kind, "batch": bs, "error": f"{type(e).__name__}: {e}"}
            rows.append(r)
            print(r, flush=True)
    for kind in args.kinds.split(","):
        for check in (True, False):
            for p in (int(x) for x in args.procs.split(",")):
                try:
                    v = round(concurrent(paths, p, kind, args.batch, args.seconds, check), 1)
                except Exception as e:  # noqa: BLE001
                    v = f"{type(e).__name__}: {e}"
                rows.append({"part": "procs", "kind": kind, "check": check, "procs": p, "img_per_s": v})
                print(rows[-1], flush=True)
    write_json(
        args.out, {"benchmark": "gpu_worker_profile", "machine": machine_info(), "files": len(paths), "rows": rows}
    )


if __name__ == "__main__":
    main()
