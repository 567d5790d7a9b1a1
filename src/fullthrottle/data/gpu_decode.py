"""Preprocess on the GPU: batched JPEG decoding, batched resize + crop, and the CPU/GPU split.

nvJPEG on one GPU decodes several times as many JPEGs a second as a machine's CPU cores (see
docs/performance.md), so on CUDA the preprocess threads only read headers and route:

- the decoders themselves (nvJPEG, the hardware JPEG engines) are in
  :mod:`~fullthrottle.data.gpu_decoders`;
- :func:`gpu_eligible` sends to the GPU only what it decodes exactly like the CPU path: complete
  (nvJPEG silently greys a truncated file), 1- or 3-component (no CMYK), baseline/extended/progressive
  JPEGs without an EXIF rotation. Everything else takes the CPU path, per item.
- :class:`RateSplitter` splits the eligible items between the CPU threads and the GPU decoder by their
  measured rates, so both decoders work at once and the total approaches the sum of the two.
- :func:`decode_crops`: a batch decoded, then resized and cropped like the CPU path
  (:func:`~fullthrottle.data.gpu_resize.resize_crop_batch`), with the CPU path as the per-item fallback.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence

import torch

from .gpu_decoders import Decoder
from .gpu_resize import resize_crop_batch
from .image_header import jpeg_info, jpeg_is_complete, resized_pixels, sniff


def gpu_eligible(data: bytes, max_pixels: int = 89_478_485, resize: int = 256) -> tuple[bool, str]:
    """Whether nvJPEG gives the same image as the CPU path; ``(False, reason)`` routes it to the CPU."""
    if sniff(data) != "JPEG":
        return False, "not a JPEG"
    info = jpeg_info(data)
    if info is None:
        return False, "unreadable JPEG header"
    if info["sof"] not in (0xC0, 0xC1, 0xC2):
        return False, "lossless/arithmetic JPEG"
    if info["components"] not in (1, 3):
        return False, f"{info['components']}-component (CMYK/YCCK) JPEG"
    if info["orientation"] != 1:
        return False, "EXIF orientation"
    if (
        info["width"] * info["height"] > max_pixels
        or info["width"] == 0
        or info["height"] == 0
        or resized_pixels(info["width"], info["height"], resize) > max_pixels
    ):
        return False, "size out of range"
    if not jpeg_is_complete(data):
        return False, "truncated"
    return True, ""


class RateSplitter:
    """Splits work between the CPU decode threads and the GPU decoder by their measured rates.

    Each decoder reports (items, seconds) as it works; the GPU share is
    ``gpu_rate / (gpu_rate + cpu_rate)`` with exponentially weighted rates (img/s), and
    :meth:`choose` hands out "gpu"/"cpu" deterministically in that proportion (an error-diffusion
    accumulator, so 3 of every 4 items go to the GPU at a 0.75 share, not a random 75%).

    Args:
        cpu_workers: CPU decode threads (the CPU rate is per-thread rate x threads).
        initial_gpu_share: the share before both rates are measured.
        alpha: weight of a new measurement in the moving average.
    """

    def __init__(self, cpu_workers: int, initial_gpu_share: float = 0.8, alpha: float = 0.1):
        self.cpu_workers, self.alpha = cpu_workers, alpha
        self._cpu_s_per_item: float | None = None
        self._gpu_s_per_item: float | None = None
        self._share = initial_gpu_share
        self._acc = 0.0
        self._lock = threading.Lock()
        self.routed = {"cpu": 0, "gpu": 0}  # eligible images sent each way

    def _ewma(self, old: float | None, new: float) -> float:
        return new if old is None else (1 - self.alpha) * old + self.alpha * new

    def record_cpu(self, items: int, seconds: float) -> None:
        """One CPU thread decoded ``items`` in ``seconds``."""
        if items > 0 and seconds > 0:
            with self._lock:
                self._cpu_s_per_item = self._ewma(self._cpu_s_per_item, seconds / items)
                self._update()

    def record_gpu(self, items: int, seconds: float) -> None:
        """The GPU decoder decoded (and resized) ``items`` in ``seconds``."""
        if items > 0 and seconds > 0:
            with self._lock:
                self._gpu_s_per_item = self._ewma(self._gpu_s_per_item, seconds / items)
                self._update()

    def _update(self) -> None:
        if self._cpu_s_per_item and self._gpu_s_per_item:
            cpu_rate = self.cpu_workers / self._cpu_s_per_item
            gpu_rate = 1.0 / self._gpu_s_per_item
            self._share = gpu_rate / (gpu_rate + cpu_rate)

    @property
    def gpu_share(self) -> float:
        """Fraction (0..1) of eligible items sent to the GPU."""
        return self._share

    def choose(self) -> str:
        """``"gpu"`` or ``"cpu"`` for the next eligible item."""
        with self._lock:
            self._acc += self._share
            gpu = self._acc >= 1.0
            if gpu:
                self._acc -= 1.0
        self.note(gpu)
        return "gpu" if gpu else "cpu"

    def note(self, gpu: bool, n: int = 1) -> None:
        """Count ``n`` eligible images routed to the GPU (True) or a CPU decoder (False)."""
        self.routed["gpu" if gpu else "cpu"] += n

    @property
    def routed_gpu_share(self) -> float:
        """Fraction (0..1) of the eligible images actually decoded on the GPU so far."""
        n = self.routed["gpu"] + self.routed["cpu"]
        return self.routed["gpu"] / n if n else 0.0


def decode_crops(
    decoder: Decoder,
    blobs: Sequence[bytes],
    resize: int = 256,
    crop: int = 224,
    max_pixels: int = 89_478_485,
    device: torch.device | None = None,
    check: bool = False,
) -> list:
    """Decode + resize + crop a batch on the GPU decoder, with the CPU path as the per-item fallback.

    Returns one entry per blob: ``(rows, r)``, its crop being row ``r`` of the ``(n_good, crop, crop, 3)``
    uint8 device tensor ``rows`` (no per-image tensor is made), a ``(crop, crop, 3)`` uint8 numpy
    array (the GPU decoder refused it, or with ``check`` :func:`gpu_eligible` did, and the CPU path
    decoded it; so did the batch's eligible images if the GPU resize failed as a whole), or the
    :class:`~fullthrottle.data.preprocess.ImageError` the CPU path gave (the item's error).
    ``check``: the caller has not run :func:`gpu_eligible` on the blobs (the GPU decoder processes
    check here, off the main process's GIL). Runs on the current CUDA stream; the caller synchronises
    before handing rows to another stream.
    """
    from .preprocess import ImageError, preprocess

    def on_cpu(j: int):  # the CPU path's crop of blob j, or its error
        try:
            return preprocess(bytes(blobs[j]), resize, crop, max_pixels)
        except ImageError as e:
            return e

    if check:
        ok = [gpu_eligible(bytes(b), max_pixels, resize)[0] for b in blobs]
        sent = [j for j, e in enumerate(ok) if e]
        decoded: list = [ValueError("not for the GPU decoder")] * len(blobs)
        for j, d in zip(sent, decoder([blobs[j] for j in sent]) if sent else ()):
            decoded[j] = d
    else:
        decoded = decoder(blobs)
    out: list = [None] * len(blobs)
    good = []
    for j, d in enumerate(decoded):
        if isinstance(d, Exception):
            out[j] = on_cpu(j)
        else:
            good.append(j)
    if good:
        dev = device if device is not None else decoded[good[0]].device
        try:
            rows = torch.empty((len(good), crop, crop, 3), dtype=torch.uint8, device=dev)
            resize_crop_batch([decoded[j] for j in good], rows, resize, crop)
        except Exception:  # noqa: BLE001 - the batch's failure (out of memory, say) is no image's: the CPU path
            for j in good:  # decodes them, and the images it already decoded keep their crops
                out[j] = on_cpu(j)
            return out
        for r, j in enumerate(good):
            out[j] = (rows, r)
    return out


def crop_runs(crops: Sequence[tuple[torch.Tensor, int]]) -> list[tuple[torch.Tensor, int, int]]:
    """``[(rows, r), ...]`` -> ``[(rows, r0, r1), ...]``: consecutive rows of one tensor merged, so a
    batch's GPU crops are gathered with a copy per run instead of one per image.

    >>> a, b = torch.zeros(4), torch.zeros(2)
    >>> [(t is a, r0, r1) for t, r0, r1 in crop_runs([(a, 0), (a, 1), (a, 3), (b, 0)])]
    [(True, 0, 2), (True, 3, 4), (False, 0, 1)]
    """
    out: list[tuple[torch.Tensor, int, int]] = []
    for t, r in crops:
        if out and out[-1][0] is t and out[-1][2] == r:
            out[-1] = (t, out[-1][1], r + 1)
        else:
            out.append((t, r, r + 1))
    return out
