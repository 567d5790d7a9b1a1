"""``fullthrottle bench``: the field's classic experiments, side by side in one run, on your machine.

Each experiment returns a dict (machine, versions, command, every point) that the CLI writes as JSON
next to a PNG plot. Every timing warms up first and reads clocks only after synchronising the device
(CUDA events where the GPU does the work).

- ``threads``: decode+resize img/s against thread count, OpenCV/torch kernels (release the GIL) against a
  pure-Python loop of similar single-thread cost (holds the GIL).
- ``batch``: model img/s against batch size: CPU, GPU eager fp32, GPU eager bf16 channels_last, GPU
  CUDA graphs (optionally torch.compile); inputs generated on the device, softmax over classes.
- ``transfer``: H2D copy + model: pageable blocking copies, pinned + ``non_blocking``, and pinned + a
  copy stream with two batches in flight, against batch size.
- ``e2e``: a folder of images to top-5: fullthrottle against a naive loop and a ``DataLoader`` (N
  workers, ``pin_memory=True``) decoding with PIL + torchvision transforms and with OpenCV.
"""

from __future__ import annotations

import os
import platform
import socket
import statistics
import sys
import threading
import time

import torch

from ..data.preprocess import preprocess
from ..workloads.classify.transform import TORCHVISION_IMAGENET

# the baselines run torchvision ResNets, so they normalise as torchvision's recipe does
MEAN, STD = TORCHVISION_IMAGENET.mean, TORCHVISION_IMAGENET.std


def machine_info() -> dict:
    """Host, CPU count, GPU, library versions, date and the exact command line."""
    import cv2
    import PIL
    import torchvision

    return {
        "host": socket.gethostname(),
        "platform": platform.platform(),
        "cpu_count": os.cpu_count(),
        "python": sys.version.split()[0],
        "torch": torch.__version__,
        "torchvision": torchvision.__version__,
        "opencv": cv2.__version__,
        "pillow": PIL.__version__,
        "gpu": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None,
        "cuda": torch.version.cuda,
        "date": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "free_threaded": not getattr(sys, "_is_gil_enabled", lambda: True)(),
        "command": " ".join(
            (
                [os.path.basename(sys.executable), sys.argv[0]]
                if sys.argv[0].endswith(".py")
                else [os.path.basename(sys.argv[0])]
            )
            + sys.argv[1:]
        ),
    }


def _sync(dev: torch.device) -> None:
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)


def _time_per_call(step, dev: torch.device, iters: int, repeats: int = 3, warmup: int = 2) -> float:
    """Median seconds per call of ``step()`` (device synchronised before every clock read)."""
    for _ in range(warmup):
        step()
    out = []
    for _ in range(repeats):
        _sync(dev)
        t = time.perf_counter()
        for _ in range(iters):
            step()
        _sync(dev)
        out.append((time.perf_counter() - t) / iters)
    return statistics.median(out)


# -- threads ---------------------------------------------------------------------------------------


def _python_work(n: int) -> int:
    acc = 0
    for i in range(n):
        acc = (acc * 31 + i) & 0xFFFF
    return acc


def _rate(fn, nthreads: int, seconds: float) -> float:
    counts = [0] * nthreads
    stop = time.perf_counter() + seconds

    def work(k):
        while time.perf_counter() < stop:
            fn(k)
            counts[k] += 1

    ts = [threading.Thread(target=work, args=(k,)) for k in range(nthreads)]
    t0 = time.perf_counter()
    for t in ts:
        t.start()
    for t in ts:
        t.join()
    return sum(counts) / (time.perf_counter() - t0)


def bench_threads(blobs: list[bytes], threads: list[int], seconds: float = 2.0) -> dict:
    """img/s of decode + resize + crop against thread count, GIL-releasing vs GIL-holding work."""
    import cv2

    cv2.setNumThreads(1)
    torch.set_num_threads(1)
    preprocess(blobs[0])  # warm-up: first-call initialisation stays out of the calibration
    t = time.perf_counter()
    for b in blobs[:20]:
        preprocess(b)
    per_img = (time.perf_counter() - t) / min(20, len(blobs))
    n, t = 10000, time.perf_counter()
    _python_work(n)
    loops = max(1, int(n * per_img / (time.perf_counter() - t)))  # same single-thread cost
    recipes = {
        "opencv+torch kernels (release the GIL)": lambda k: preprocess(blobs[k % len(blobs)]),
        "pure Python, same cost (holds the GIL)": lambda k: _python_work(loops),
    }
    rows = []
    for name, fn in recipes.items():
        for n in threads:
            rows.append({"recipe": name, "threads": n, "img_per_s": _rate(fn, n, seconds)})
    return {
        "experiment": "threads",
        "single_thread_ms_per_image": 1e3 * per_img,
        "python_loops": loops,
        "free_threaded": not getattr(sys, "_is_gil_enabled", lambda: True)(),
        "rows": rows,
    }


# -- batch -----------------------------------------------------------------------------------------


def _model(name: str, dev: torch.device, dtype: torch.dtype, channels_last: bool):
    import torchvision

    torch.manual_seed(0)
    m = getattr(torchvision.models, name)().eval().to(dev, dtype)
    return m.to(memory_format=torch.channels_last) if channels_last else m


def bench_batch(batches: list[int], model: str = "resnet18", compile: bool = False, iters: int = 10) -> dict:
    """Model img/s against batch size for every configuration this machine can run."""
    from ..core.graphs import graph_module

    configs = [("cpu fp32 eager", "cpu", torch.float32, False, None)]
    if torch.cuda.is_available():
        configs += [
            ("gpu fp32 eager", "cuda", torch.float32, False, None),
            ("gpu bf16 channels_last eager", "cuda", torch.bfloat16, True, None),
            ("gpu bf16 channels_last CUDA graphs", "cuda", torch.bfloat16, True, "graphs"),
        ]
        if compile:
            configs.append(("gpu bf16 channels_last compile+graphs", "cuda", torch.bfloat16, True, "compile"))
    notes = [] if torch.cuda.is_available() or not compile else ["--compile needs CUDA: no compile row here"]
    if any(b > 64 for b in batches):
        notes.append("the CPU rows stop at batch 64")
    rows = []
    for name, devname, dtype, cl, mode in configs:
        dev = torch.device(devname)
        m = _model(model, dev, dtype, cl)
        runner = None
        if mode is not None:
            runner = graph_module(
                m, (3, 224, 224), batches, device=dev, dtype=dtype, channels_last=cl, compile=mode == "compile"
            )
        for bs in batches:
            if devname == "cpu" and bs > 64:
                continue
            x = torch.randn(bs, 3, 224, 224, device=dev, dtype=dtype)
            if cl:
                x = x.contiguous(memory_format=torch.channels_last)
            with torch.inference_mode():
                if runner is None:

                    def step():
                        return torch.softmax(m(x).float(), dim=-1)
                else:

                    def step():
                        return torch.softmax(runner(x).float(), dim=-1)

                n = max(1, iters if devname == "cuda" else min(iters, max(1, 16 // bs)))
                s = _time_per_call(step, dev, n * (10 if devname == "cuda" else 1))
            rows.append({"config": name, "batch": bs, "img_per_s": bs / s})
        m = runner = None  # free this config's model before the next
    return {"experiment": "batch", "model": model, "rows": rows, "notes": notes}


# -- transfer --------------------------------------------------------------------------------------


def bench_transfer(batches: list[int], model: str = "resnet18", iters: int = 20) -> dict:
    """H2D of uint8 (B,224,224,3) batches + bf16 model, three ways, img/s against batch size.

    Raises:
        RuntimeError: no CUDA device.
    """
    if not torch.cuda.is_available():
        raise RuntimeError("the transfer experiment needs a CUDA device")
    dev = torch.device("cuda")
    m = _model(model, dev, torch.bfloat16, True)
    mean = torch.tensor(MEAN, device=dev).view(1, 3, 1, 1) * 255
    std = torch.tensor(STD, device=dev).view(1, 3, 1, 1) * 255

    def compute(xd):
        x = ((xd.permute(0, 3, 1, 2).float() - mean) / std).to(torch.bfloat16)
        return m(x).float().softmax(-1).topk(5)

    rows = []
    copy_stream = torch.cuda.Stream()
    for bs in batches:
        pageable = [torch.randint(0, 256, (bs, 224, 224, 3), dtype=torch.uint8) for _ in range(2)]
        pinned = [p.pin_memory() for p in pageable]
        dbuf = [torch.empty_like(p, device=dev) for p in pinned]
        copied = [torch.cuda.Event() for _ in range(2)]
        done = [torch.cuda.Event() for _ in range(2)]

        def blocking():
            for p in pageable:
                compute(p.to(dev))

        def pinned_nb():
            for p in pinned:
                compute(p.to(dev, non_blocking=True))

        def stream_2_in_flight():
            cur = torch.cuda.current_stream()
            for i in range(2):
                with torch.cuda.stream(copy_stream):
                    copy_stream.wait_event(done[i])  # buffer i free again
                    dbuf[i].copy_(pinned[i], non_blocking=True)
                    copied[i].record(copy_stream)
                cur.wait_event(copied[i])
                compute(dbuf[i])
                done[i].record(cur)

        with torch.inference_mode():
            for name, fn in (
                ("pageable, blocking", blocking),
                ("pinned, non_blocking", pinned_nb),
                ("pinned, copy stream, 2 in flight", stream_2_in_flight),
            ):
                s = _time_per_call(fn, dev, max(2, iters * 8 // max(bs, 8)))
                rows.append({"mode": name, "batch": bs, "img_per_s": 2 * bs / s})
        copy_s = _time_per_call(lambda: dbuf[0].copy_(pinned[0], non_blocking=True), dev, 10)
        rows.append(
            {
                "mode": "pinned H2D copy alone",
                "batch": bs,
                "img_per_s": bs / copy_s,
                "GB_per_s": pinned[0].numel() / copy_s / 1e9,
            }
        )
    return {"experiment": "transfer", "model": model + " bf16 channels_last eager", "rows": rows}


# -- plots -----------------------------------------------------------------------------------------


def plot(result: dict, path: str) -> None:
    """A PNG of ``result`` (one line per recipe/config/mode, or bars for e2e)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    exp = result["experiment"]
    if exp == "e2e":
        names = list(result["results"])
        ax.barh(names, [result["results"][k]["img_per_s"] for k in names])
        ax.set_xlabel("images/s (steady state)")
    else:
        key, x = {"threads": ("recipe", "threads"), "batch": ("config", "batch"), "transfer": ("mode", "batch")}[exp]
        for name in dict.fromkeys(r[key] for r in result["rows"]):
            pts = [(r[x], r["img_per_s"]) for r in result["rows"] if r[key] == name]
            ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=name)
        ax.set_xlabel(x)
        ax.set_ylabel("images/s")
        if exp != "threads":
            ax.set_xscale("log", base=2)
        ax.legend(fontsize=8)
    m = result.get("machine", {})
    ax.set_title(f"fullthrottle bench {exp}: {m.get('gpu') or 'CPU'}, {m.get('cpu_count')} cores", fontsize=10)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
