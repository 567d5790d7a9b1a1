"""Decoding JPEG files on the GPU's JPEG engines inside the compute process, pipelined (issue 10): how
close one process gets to the engines' ceiling when nothing waits on anything else.

One process, one CUDA context (no time-slicing with decoder processes):

- reader threads read the files of the next batches (``read_local``: one ``os.read`` each, without
  the GIL) into a queue ``--ahead`` batches deep;
- one decode thread takes a batch of bytes, decodes it (``--decoders``: ``tv``, torchvision's batched
  nvJPEG, which puts baseline JPEGs on the engines; ``hw``, nvImageCodec on the engines), resizes and
  crops it on its stream (``resize_crop_batch``), and keeps ``--inflight`` batches on the stream before
  it waits for the oldest (the engines start the next batch while the SMs resize the last);
- with ``--model``, ResNet18 bf16 graph replays (batch 128) paced at 20k img/s on another stream, as
  the pipeline's compute stage would load the GPU at that rate.

Rows also give the ceiling from memory (``source=memory``: the same batches read once beforehand).

Usage: python bench/probes/pipelined_decode_probe.py --folder /tmp/ft-files/640x480 --out probe.json
"""

from __future__ import annotations

import argparse
import queue
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # bench/: common.py
sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import machine_info, write_json  # noqa: E402
from inproc_decode_probe import model_loop  # noqa: E402


def make_decoder(kind, dev):
    from fullthrottle.data.gpu_decoders import GpuJpegDecoder, HwJpegDecoder

    if kind == "tv":
        return GpuJpegDecoder(dev)
    return HwJpegDecoder(dev, fallback=GpuJpegDecoder(dev))


def run_row(paths, kind, batch, seconds, dev, source, readers, ahead, inflight, with_model):
    from fullthrottle.data.gpu_resize import resize_crop_batch
    from fullthrottle.data.load import read_local

    dec = make_decoder(kind, dev)
    ms, stop, ready = {}, threading.Event(), threading.Event()
    mt = None
    if with_model:
        mt = threading.Thread(target=model_loop, args=(dev, 128, stop, ms, ready))
        mt.start()
        ready.wait(120)
    nb = len(paths) // batch
    chunks = [paths[i * batch : (i + 1) * batch] for i in range(nb)]
    pool = ThreadPoolExecutor(readers)

    def read_batch(chunk):
        return [read_local(p, 1 << 26) for p in chunk]

    mem = [read_batch(c) for c in chunks[: min(nb, 40)]] if source == "memory" else None
    q: queue.Queue = queue.Queue(ahead)
    done = threading.Event()

    def producer():
        i = 0
        futs = []
        while not done.is_set():
            if mem is not None:
                item = mem[i % len(mem)]
            else:
                while len(futs) < ahead:
                    futs.append(pool.submit(read_batch, chunks[(i + len(futs)) % nb]))
                item = futs.pop(0).result()
            i += 1
            while not done.is_set():
                try:
                    q.put(item, timeout=0.1)
                    break
                except queue.Full:
                    pass

    pt = threading.Thread(target=producer, daemon=True)
    pt.start()
    stream = torch.cuda.Stream(dev)
    outs = [torch.empty((batch, 224, 224, 3), dtype=torch.uint8, device=dev) for _ in range(inflight)]
    evs: list = [None] * inflight
    keep: list = [None] * inflight
    t_dec = t_wait = 0.0
    n = k = 0
    # warm-up: two batches
    for _ in range(2):
        blobs = q.get()
        with torch.cuda.stream(stream):
            ims = dec(blobs)
            resize_crop_batch([im for im in ims if isinstance(im, torch.Tensor)], outs[0][: len(ims)])
        stream.synchronize()
    errors = 0
    t0 = time.perf_counter()
    while time.perf_counter() - t0 < seconds:
        a = time.perf_counter()
        blobs = q.get()
        b = time.perf_counter()
        slot = k % inflight
        if evs[slot] is not None:
            evs[slot].synchronize()
            keep[slot] = None
        c = time.perf_counter()
        with torch.cuda.stream(stream):
            ims = dec(blobs)
            good = [im for im in ims if isinstance(im, torch.Tensor)]
            errors += len(ims) - len(good)
            resize_crop_batch(good, outs[slot][: len(good)])
            ev = torch.cuda.Event()
            ev.record(stream)
        evs[slot], keep[slot] = ev, ims
        d = time.perf_counter()
        t_wait += (b - a) + (c - b)
        t_dec += d - c
        n += len(blobs)
        k += 1
    stream.synchronize()
    wall = time.perf_counter() - t0
    done.set()
    stop.set()
    if mt:
        mt.join()
    pool.shutdown(wait=False, cancel_futures=True)
    return {
        "decoder": kind,
        "source": source,
        "batch": batch,
        "readers": readers,
        "inflight": inflight,
        "with_model": with_model,
        "img_per_s": n / wall,
        "decode_call_ms_per_batch": 1e3 * t_dec / max(k, 1),
        "wait_ms_per_batch": 1e3 * t_wait / max(k, 1),
        "failed": errors,
        "model_img_per_s": ms.get("img_per_s"),
    }


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--folder", required=True)
    ap.add_argument("--seconds", type=float, default=4.0)
    ap.add_argument("--decoders", default="tv,hw")
    ap.add_argument("--batches", default="64,128,256")
    ap.add_argument("--sources", default="memory,files")
    ap.add_argument("--readers", type=int, default=6)
    ap.add_argument("--ahead", type=int, default=4)
    ap.add_argument("--inflight", type=int, default=2)
    ap.add_argument("--models", default="0,1")
    ap.add_argument("--out", default="pipelined_decode_probe.json")
    args = ap.parse_args()
    dev = torch.device("cuda", 0)
    torch.cuda.set_device(dev)
    paths = sorted(str(p) for p in Path(args.folder).glob("*.jpg"))
    rows = []
    for kind in args.decoders.split(","):
        for batch in [int(b) for b in args.batches.split(",")]:
            for source in args.sources.split(","):
                for wm in [bool(int(m)) for m in args.models.split(",")]:
                    try:
                        row = run_row(
                            paths, kind, batch, args.seconds, dev, source, args.readers, args.ahead, args.inflight, wm
                        )
                    except Exception as e:  # noqa: BLE001
                        row = {"decoder": kind, "batch": batch, "source": source, "with_model": wm, "error": repr(e)}
                    rows.append(row)
                    print(row, flush=True)
    write_json(
        args.out, {"benchmark": "pipelined_decode_probe", "machine": machine_info(), "files": len(paths), "rows": rows}
    )


if __name__ == "__main__":
    main()
