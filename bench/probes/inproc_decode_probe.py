"""Decoding JPEG files on the GPU inside the compute process (issue 10): how fast threads of the
process that runs the model decode, resize and crop files, alone and while the model's CUDA graph
replays on another stream of the same process (one CUDA context, no decoder processes). ``--mixes``
names the sets of decode threads run at once, each thread its own decoder and stream of
``--priorities``, by backend: nvImageCodec on the hardware JPEG engines (``hw``), on the SMs
(``cuda``), CPU Huffman + GPU (``hybrid``), or torchvision's batched nvJPEG (``tv``); img/s summed
over the threads. Optionally the main process of ``fullthrottle classify DIR``
sampled with py-spy (``--gil``: which Python code holds the GIL).

Variants of the file read: ``python``: ``read_local`` per file in the thread (one ``os.read``), the
bytes wrapped as ``CodeStream``; ``nvimgcodec``: ``CodeStream(path)``, nvImageCodec reads the file.

Usage: python bench/probes/inproc_decode_probe.py --folder /tmp/ft-files/640x480 --out probe.json
"""

from __future__ import annotations

import argparse
import collections
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # bench/: common.py
from common import machine_info, py_spy_raw, write_json  # noqa: E402

BACKENDS = {"hw": "HW_GPU_ONLY", "cuda": "GPU_ONLY", "hybrid": "HYBRID_CPU_GPU"}


def decode_loop(paths, batch, variant, seconds, dev, stream, stats, start=0, backend="hw"):
    from nvidia import nvimgcodec

    from fullthrottle.data.gpu_resize import resize_crop_batch
    from fullthrottle.data.load import read_local

    if backend == "tv":
        return tv_loop(paths, batch, seconds, dev, stream, stats, start)
    kind = getattr(nvimgcodec.BackendKind, BACKENDS[backend])
    dec = nvimgcodec.Decoder(device_id=dev.index or 0, backends=[nvimgcodec.Backend(kind)])
    rgb = getattr(nvimgcodec.ColorSpec, "RGB", None) or nvimgcodec.ColorSpec.SRGB
    params = nvimgcodec.DecodeParams(apply_exif_orientation=False, color_spec=rgb, allow_any_depth=False)
    rows = torch.empty((batch, 224, 224, 3), dtype=torch.uint8, device=dev)
    t_read = t_dec = t_rs = 0.0
    n, i, t0 = 0, start, time.perf_counter()
    with torch.cuda.stream(stream):
        while time.perf_counter() - t0 < seconds:
            chunk = [paths[(i + k) % len(paths)] for k in range(batch)]
            i += batch
            a = time.perf_counter()
            if variant == "python":
                srcs = [nvimgcodec.CodeStream(np.frombuffer(read_local(p, 1 << 26), np.uint8)) for p in chunk]
            else:
                srcs = [nvimgcodec.CodeStream(p) for p in chunk]
            b = time.perf_counter()
            imgs = dec.decode(srcs, params=params, cuda_stream=stream.cuda_stream)
            ts = [torch.as_tensor(im, device=dev).permute(2, 0, 1) for im in imgs]
            c = time.perf_counter()
            resize_crop_batch(ts, rows[: len(ts)])
            stream.synchronize()
            d = time.perf_counter()
            t_read += b - a
            t_dec += c - b
            t_rs += d - c
            n += len(ts)
    wall = time.perf_counter() - t0
    stats.update(
        img_per_s=n / wall,
        images=n,
        ms_per_batch={
            "read": 1e3 * t_read * batch / n,
            "decode": 1e3 * t_dec * batch / n,
            "resize": 1e3 * t_rs * batch / n,
        },
    )


def tv_loop(paths, batch, seconds, dev, stream, stats, start=0):
    """torchvision's batched nvJPEG decode (``decode_jpeg(list, device=...)``) on ``stream``."""
    from torchvision.io import decode_jpeg

    from fullthrottle.data.gpu_resize import resize_crop_batch
    from fullthrottle.data.load import read_local

    rows = torch.empty((batch, 224, 224, 3), dtype=torch.uint8, device=dev)
    t_read = t_dec = t_rs = 0.0
    n, i, t0 = 0, start, time.perf_counter()
    with torch.cuda.stream(stream):
        while time.perf_counter() - t0 < seconds:
            chunk = [paths[(i + k) % len(paths)] for k in range(batch)]
            i += batch
            a = time.perf_counter()
            srcs = [torch.frombuffer(read_local(p, 1 << 26), dtype=torch.uint8) for p in chunk]
            b = time.perf_counter()
            ts = decode_jpeg(srcs, device=dev)
            c = time.perf_counter()
            resize_crop_batch(ts, rows[: len(ts)])
            stream.synchronize()
            d = time.perf_counter()
            t_read += b - a
            t_dec += c - b
            t_rs += d - c
            n += len(ts)
    wall = time.perf_counter() - t0
    stats.update(
        img_per_s=n / wall,
        images=n,
        ms_per_batch={
            "read": 1e3 * t_read * batch / n,
            "decode": 1e3 * t_dec * batch / n,
            "resize": 1e3 * t_rs * batch / n,
        },
    )


def model_loop(dev, batch, stop, stats, ready, rate=20000.0):
    """ResNet18 bf16 graph replays at batch ``batch``, paced to ``rate`` img/s at most (the load the
    model puts on the GPU at that end-to-end rate)."""
    import torchvision

    m = torchvision.models.resnet18().to(dev, torch.bfloat16).to(memory_format=torch.channels_last).eval()
    x = torch.ones(batch, 3, 224, 224, device=dev, dtype=torch.bfloat16).contiguous(memory_format=torch.channels_last)
    s = torch.cuda.Stream(dev)
    with torch.cuda.stream(s), torch.inference_mode():
        for _ in range(3):
            m(x)
        s.synchronize()
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g, stream=s, capture_error_mode="thread_local"):
            y = m(x)
        ready.set()  # captured: the decode loop may start
        n, t0 = 0, time.perf_counter()
        while not stop.is_set():
            g.replay()
            y[:, :5].float().cpu()  # a batch's answer to the host, as the pipeline does
            n += batch
            ahead = n / rate - (time.perf_counter() - t0)
            if ahead > 0:
                time.sleep(ahead)
        stats.update(img_per_s=n / (time.perf_counter() - t0))


def py_spy_cli(folder, seconds, exe, out_raw):
    """The CLI on ``folder``; py-spy --gil on its main process for ``seconds`` once it runs."""
    import json

    rep = out_raw + ".report.json"
    cmd = [sys.executable, "-m", "fullthrottle.cli", "classify", folder, "--device", "cuda", "--model", "resnet18"]
    cmd += ["--no-progress", "--out", "/tmp/probe_out.jsonl", "--report-json", rep]
    p = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    time.sleep(15)  # model load, graph capture, decoder processes up (use a folder that takes longer)
    spy = subprocess.run(
        [
            exe,
            "record",
            "--gil",
            "--nonblocking",
            "-r",
            "200",
            "-d",
            str(seconds),
            "-f",
            "raw",
            "-p",
            str(p.pid),
            "-o",
            out_raw,
        ],
        capture_output=True,
        text=True,
    )
    _, err = p.communicate()
    out = {
        "cli_exit": p.returncode,
        "py_spy_exit": spy.returncode,
        "py_spy_stderr": spy.stderr[-800:],
        "cli_stderr": err[-1500:],
    }
    if os.path.exists(rep):
        r = json.loads(open(rep).read())
        out["cli_img_per_s"] = r.get("images_per_s")
        out["cli_report_keys"] = list(r)[:40]
    leaf, own = collections.Counter(), collections.Counter()
    total = 0
    for frames, c in py_spy_raw(out_raw):
        total += c
        leaf[frames[-1]] += c
        for f in set(frames):
            own[f] += c
    out["samples"] = total
    out["top_leaf"] = [(f, round(c / max(total, 1), 4)) for f, c in leaf.most_common(40)]
    out["top_inclusive"] = [(f, round(c / max(total, 1), 4)) for f, c in own.most_common(60)]
    return out


def one_row(paths, batch, variant, mix, with_model, seconds, dev, priority=0, model_batch=256):
    """One decode loop per entry of ``mix`` (its backend: hw, cuda, hybrid, tv) at once, each on its
    own stream of ``priority`` (-1: high), and the model beside them when ``with_model``: one row."""
    threads = len(mix)
    ms, stop, ready = {}, threading.Event(), threading.Event()
    mt = threading.Thread(target=model_loop, args=(dev, model_batch, stop, ms, ready)) if with_model else None
    if mt:
        mt.start()
        ready.wait(120)
    sts = [{} for _ in range(threads)]
    step = len(paths) // threads

    def loop(k):
        try:
            st = torch.cuda.Stream(dev, priority=priority)
            decode_loop(paths, batch, variant, seconds, dev, st, sts[k], start=k * step, backend=mix[k])
        except Exception as e:  # noqa: BLE001
            sts[k]["error"] = f"{type(e).__name__}: {e}"

    ts = [threading.Thread(target=loop, args=(k,)) for k in range(threads)]
    for t in ts:
        t.start()
    for t in ts:
        t.join()
    stop.set()
    if mt:
        mt.join()
    errors = [st["error"] for st in sts if "error" in st]
    return {
        "batch": batch,
        "read": variant,
        "threads": threads,
        "mix": "+".join(mix),
        "stream_priority": priority,
        "model_batch": model_batch,
        "with_model": with_model,
        "img_per_s": None if errors else sum(st["img_per_s"] for st in sts),
        "img_per_s_by_thread": [st.get("img_per_s") for st in sts],
        "ms_per_batch_thread0": sts[0].get("ms_per_batch"),
        "errors": errors,
        "model_img_per_s": ms.get("img_per_s"),
    }


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--folder", required=True)
    ap.add_argument("--seconds", type=float, default=6.0)
    ap.add_argument("--batches", default="64,128")
    ap.add_argument(
        "--mixes",
        default="hw;hw,hw;hw,hw,hw,hw",
        help="';'-separated sets of decode threads run at once, each a ','-list of their backends "
        "(hw: hardware engines, cuda: nvJPEG on the SMs, hybrid: CPU Huffman + GPU, tv: torchvision)",
    )
    ap.add_argument("--priorities", default="0", help="decode streams' priority (comma list; -1 high)")
    ap.add_argument("--alone", type=int, default=1, help="1: also each set without the model beside")
    ap.add_argument("--model-batch", type=int, default=256)
    ap.add_argument("--reads", default="python", help="python, nvimgcodec (comma list)")
    ap.add_argument("--py-spy", default="", help="py-spy executable: also profile the CLI's main process")
    ap.add_argument("--out", default="inproc_decode_probe.json")
    args = ap.parse_args()
    dev = torch.device("cuda", 0)
    torch.cuda.set_device(dev)
    paths = sorted(str(p) for p in Path(args.folder).glob("*.jpg"))
    rows = []
    for batch in [int(b) for b in args.batches.split(",")]:
        for variant in args.reads.split(","):
            for mix in args.mixes.split(";"):
                for prio in [int(p) for p in args.priorities.split(",")]:
                    for with_model in (False, True) if args.alone else (True,):
                        row = one_row(
                            paths, batch, variant, mix.split(","), with_model, args.seconds, dev, prio, args.model_batch
                        )
                        rows.append(row)
                        print(row, flush=True)
    out = {"benchmark": "inproc_decode_probe", "machine": machine_info(), "files": len(paths), "rows": rows}
    if args.py_spy:
        out["cli_gil_profile"] = py_spy_cli(args.folder, 10, args.py_spy, os.path.splitext(args.out)[0] + "_spy.txt")
        print({k: v for k, v in out["cli_gil_profile"].items() if k.startswith("top_leaf") or "img" in k}, flush=True)
    write_json(args.out, out)


if __name__ == "__main__":
    main()
