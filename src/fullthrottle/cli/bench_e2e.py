"""``fullthrottle bench e2e``: images (bytes in memory) to top-5, fullthrottle against a naive loop and a
DataLoader (PIL, OpenCV), in one run."""

from __future__ import annotations

import io
import math
import time

import numpy as np
import torch

from ..data.preprocess import preprocess
from .benchmarks import MEAN, STD, _model


class _BytesDataset(torch.utils.data.Dataset):
    def __init__(self, blobs, n, decoder):
        self.blobs, self.n, self.decoder = blobs, n, decoder

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        data = self.blobs[i % len(self.blobs)]
        if self.decoder == "pil":
            from PIL import Image
            from torchvision.transforms import v2

            img = Image.open(io.BytesIO(data)).convert("RGB")
            return v2.Compose([v2.Resize(256, antialias=True), v2.CenterCrop(224), v2.PILToTensor()])(img)
        import cv2

        bgr = cv2.imdecode(np.frombuffer(data, np.uint8), cv2.IMREAD_COLOR)
        h, w = bgr.shape[:2]
        s = 256 / min(h, w)
        bgr = cv2.resize(bgr, (max(256, int(w * s)), max(256, int(h * s))), interpolation=cv2.INTER_AREA)
        h, w = bgr.shape[:2]
        top, left = (h - 224) // 2, (w - 224) // 2
        rgb = cv2.cvtColor(bgr[top : top + 224, left : left + 224], cv2.COLOR_BGR2RGB)
        return torch.from_numpy(rgb).permute(2, 0, 1).contiguous()


#: batches after the warm-up that the steady rate is measured over, at the least (results come a batch
#: at a time: fewer make the rate the spacing of a few bursts)
MIN_STEADY_BATCHES = 8


def _steady(times: list[tuple[float, int]], n: int, warm_frac: float) -> float:
    """img/s after the first ``warm_frac`` of the items: ``times`` is [(clock, items so far)], a
    point per batch or per item."""
    start = next((t for t in times if t[1] >= warm_frac * n), times[0])
    end = times[-1]
    return (end[1] - start[1]) / (end[0] - start[0]) if end[0] > start[0] else 0.0


def min_images(batch: int, warm_frac: float = 0.25) -> int:
    """The fewest images per method whose steady window holds :data:`MIN_STEADY_BATCHES` batches."""
    return math.ceil(MIN_STEADY_BATCHES * batch / (1 - warm_frac))


def bench_e2e(
    blobs: list[bytes],
    n: int,
    workers: int,
    batch: int,
    device: str = "auto",
    model: str = "resnet18",
    warm_frac: float = 0.25,
) -> dict:
    """Images (bytes in memory) to top-5, fullthrottle vs naive loop vs DataLoader (PIL, OpenCV)."""
    from ..core.config import Config, resolve_dtype, torch_dtype
    from ..core.device import resolve_device
    from ..workloads.classify.pipeline import Pipeline

    if n < min_images(batch, warm_frac):
        raise ValueError(
            f"--n {n} is too few images at --batch {batch} for a steady rate: give --n {min_images(batch, warm_frac)} "
            f"or more, or a smaller --batch"
        )
    dev = resolve_device(device)
    dtype = torch_dtype(resolve_dtype(None, dev))
    m = _model(model, dev, dtype, dev.type == "cuda")
    mean = torch.tensor(MEAN, device=dev).view(1, 3, 1, 1) * 255
    std = torch.tensor(STD, device=dev).view(1, 3, 1, 1) * 255

    def top5(x_u8_nchw):
        x = ((x_u8_nchw.to(dev, non_blocking=True).float() - mean) / std).to(dtype)
        if dev.type == "cuda":
            x = x.contiguous(memory_format=torch.channels_last)
        v, i = m(x).float().softmax(-1).topk(5)
        return v.cpu(), i.cpu()  # results on the host: synchronises

    results = {}
    with torch.inference_mode():
        top5(torch.zeros(batch, 3, 224, 224, dtype=torch.uint8))
        # (a) naive: decode, tensor, model, one fixed batch at a time, one thread
        times, buf, seen = [], [], 0
        n_naive = max(min_images(batch, warm_frac), n // 4)
        for i in range(n_naive):
            buf.append(torch.from_numpy(preprocess(blobs[i % len(blobs)])).permute(2, 0, 1))
            if len(buf) == batch or i == n_naive - 1:
                top5(torch.stack(buf))
                seen += len(buf)
                buf = []
                times.append((time.perf_counter(), seen))
        results["naive loop"] = {"images": seen, "img_per_s": _steady(times, seen, warm_frac)}
        # (b) DataLoader with N workers, pin_memory, PIL and OpenCV decoding
        for dec in ("pil", "opencv"):
            dl = torch.utils.data.DataLoader(
                _BytesDataset(blobs, n, dec), batch_size=batch, num_workers=workers, pin_memory=dev.type == "cuda"
            )
            times, seen = [], 0
            for x in dl:
                top5(x)
                seen += len(x)
                times.append((time.perf_counter(), seen))
            results[f"DataLoader {workers} workers, {dec}"] = {
                "images": seen,
                "img_per_s": _steady(times, seen, warm_frac),
            }
    # (c) fullthrottle
    pipe = Pipeline(
        Config(
            model=model,
            device=str(dev),
            dtype=resolve_dtype(None, dev),
            max_batch_size=batch,
            threads=workers,
        )
    )
    list(pipe.run(blobs[: min(len(blobs), 2 * batch)]))  # warm-up
    times, seen = [], 0
    for r in pipe.run(blobs[i % len(blobs)] for i in range(n)):
        seen += 1
        times.append((time.perf_counter(), seen))  # (each result: they come a batch at a time)
    rep = pipe.last_report
    results["fullthrottle"] = {"images": seen, "img_per_s": _steady(times, seen, warm_frac), "report": rep.to_dict()}
    ft = results["fullthrottle"]["img_per_s"]
    ratios = {
        f"fullthrottle / {k}": ft / v["img_per_s"]
        for k, v in results.items()
        if k != "fullthrottle" and v["img_per_s"] > 0
    }
    return {
        "experiment": "e2e",
        "device": str(dev),
        "model": model,
        "n": n,
        "workers": workers,
        "batch": batch,
        "results": results,
        "ratios": ratios,
        "verdict": rep.verdict,
    }
