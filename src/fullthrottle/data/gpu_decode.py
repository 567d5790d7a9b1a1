"""Preprocess on the GPU: batched JPEG decoding, batched resize + crop, and the CPU/GPU split.

nvJPEG on one GPU decodes several times as many JPEGs a second as a machine's CPU cores (see
docs/performance.md), so on CUDA the preprocess threads only read headers and route:

- two GPU decoders with one contract (``n`` JPEGs in, ``n`` device tensors or per-item exceptions
  out): :class:`GpuJpegDecoder` (torchvision's nvJPEG) and :class:`HwJpegDecoder` (the
  GPU's hardware JPEG engines through nvImageCodec); :func:`make_gpu_decoder` picks one;
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
from collections.abc import Callable, Sequence

import torch

from ..core import env
from ..core.config import GPU_DECODERS
from .gpu_resize import resize_crop_batch
from .preprocess import jpeg_info, jpeg_is_complete, resized_pixels, sniff


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


class GpuJpegDecoder:
    """torchvision's nvJPEG, ``torchvision.io.decode_jpeg(list, device=...)``, one call per batch.

    On GPUs with JPEG engines (A100, H100, H200) torchvision opens nvJPEG's hardware backend and
    decodes the baseline JPEGs of a batch there (``nvjpegDecodeBatched``), the others (progressive)
    one by one with Huffman decoding on the CPU (``decode_jpegs_cuda.cpp``; we read the source, we
    did not trace which path each image took).

    Calling it with ``n`` JPEG byte strings returns ``n`` entries: a ``(3, H, W)`` uint8 tensor on
    the device, or the exception that image raised (a failed batch call is retried image by image, so
    one bad image never fails the others).
    """

    kind = "nvjpeg"

    def __init__(self, device: torch.device):
        self.device = device

    def __call__(self, blobs: Sequence[bytes]) -> list:
        from torchvision.io import ImageReadMode, decode_jpeg

        # a writable buffer (a memoryview of a bytearray) is read in place; bytes are copied once
        tensors = [
            torch.frombuffer(b if isinstance(b, memoryview) and not b.readonly else bytearray(b), dtype=torch.uint8)
            for b in blobs
        ]
        try:
            return list(decode_jpeg(tensors, mode=ImageReadMode.RGB, device=self.device))
        except Exception:  # noqa: BLE001 - find the culprit(s), keep the rest
            out = []
            for t in tensors:
                try:
                    out.append(decode_jpeg(t, mode=ImageReadMode.RGB, device=self.device))
                except Exception as e:  # noqa: BLE001
                    out.append(e)
            return out


#: nvImageCodec backend names of :envvar:`FULLTHROTTLE_NVIMGCODEC_BACKENDS` (``nvimgcodec.BackendKind``)
NVIMGCODEC_BACKENDS = {"hw": "HW_GPU_ONLY", "hybrid": "HYBRID_CPU_GPU", "gpu": "GPU_ONLY"}


def parse_nvimgcodec_backends(spec: str) -> list[tuple[str, float]]:
    """``"hw:0.7+hybrid"`` -> ``[("HW_GPU_ONLY", 0.7), ("HYBRID_CPU_GPU", 1.0)]``: the backends the
    ``"hardware"`` decoder lets nvImageCodec use, each ``name[:load_hint]``, joined by ``+``.

    ``hw``: the JPEG engines; ``hybrid``: nvJPEG with Huffman decoding on nvImageCodec's CPU threads;
    ``gpu``: nvJPEG with Huffman decoding on the SMs. The load hint is the fraction of a batch a backend
    is offered (nvImageCodec's ``Backend(kind, load_hint)``; the rest go to the next backend), as in
    DALI's ``hw_decoder_load``. Empty: ``"hw"``, the engines alone.

    Raises:
        ValueError: an unknown name, or a load hint outside 0..1.
    """
    out = []
    for part in (spec or "hw").split("+"):
        name, _, hint = part.strip().partition(":")
        if name not in NVIMGCODEC_BACKENDS:
            raise ValueError(
                f"unknown nvImageCodec backend {name!r} in {spec!r} (use {', '.join(NVIMGCODEC_BACKENDS)})"
            )
        try:
            h = float(hint) if hint else 1.0
        except ValueError:
            h = -1.0
        if not 0.0 <= h <= 1.0:
            raise ValueError(f"load hint of {name!r} in {spec!r} must be a number in 0..1")
        out.append((NVIMGCODEC_BACKENDS[name], h))
    return out


class HwJpegDecoder:
    """The GPU's hardware JPEG decoders (the NVJPG engines of A100, H100, H200, B200) through NVIDIA's
    nvImageCodec (``pip install nvidia-nvimgcodec-cu13``, or ``-cu12``), one call per batch.

    Same contract as :class:`GpuJpegDecoder`: ``n`` JPEG byte strings in, ``n`` entries out, each a
    ``(3, H, W)`` uint8 tensor on ``device`` or the exception that image raised. The engines sit
    beside the SMs, so decoding does not take compute from the model running on the same GPU
    (torchvision's nvJPEG uses them too for baseline JPEGs: :class:`GpuJpegDecoder`). Images the engines
    do not take (nvImageCodec answers ``None``: progressive JPEGs, for one) are decoded by
    ``fallback`` (torchvision's nvJPEG) when given, else they get an exception and the caller's CPU
    path takes them.

    Decoding is ordered on the current CUDA stream of ``device`` (nvImageCodec's ``cuda_stream``):
    kernels queued after the call on that stream see the pixels, and each image's buffer is
    allocated and freed stream-ordered on it (``cudaMallocAsync``/``cudaFreeAsync``), so no call
    synchronises the device. EXIF orientation is not applied (:func:`gpu_eligible` sends rotated
    photos to the CPU path); grayscale JPEGs come out as 3 equal channels, like the CPU path's.

    ``FULLTHROTTLE_NVIMGCODEC_BACKENDS`` (:func:`parse_nvimgcodec_backends`, default ``hw``) lets
    nvImageCodec share each batch between the engines and its nvJPEG backends, as DALI's mixed decoder
    does (for example ``hw:0.7+hybrid``); ``FULLTHROTTLE_NVIMGCODEC_THREADS`` sets its CPU threads
    (default: one per core).

    Raises:
        ImportError: nvImageCodec is not installed.
        ValueError: a bad ``FULLTHROTTLE_NVIMGCODEC_BACKENDS``.
        RuntimeError: the GPU has no hardware JPEG decoder (a test image did not decode).
    """

    kind = "hardware"

    def __init__(self, device: torch.device, fallback: GpuJpegDecoder | None = None):
        from nvidia import nvimgcodec

        self.device = torch.device(device)
        index = self.device.index if self.device.index is not None else torch.cuda.current_device()
        threads = int(env.get(env.NVIMGCODEC_THREADS) or 0)  # 0: one per core
        backends = [
            nvimgcodec.Backend(getattr(nvimgcodec.BackendKind, k), load_hint=h)
            for k, h in parse_nvimgcodec_backends(env.get(env.NVIMGCODEC_BACKENDS))
        ]
        self._dec = nvimgcodec.Decoder(device_id=index, max_num_cpu_threads=threads, backends=backends)
        rgb = getattr(nvimgcodec.ColorSpec, "RGB", None) or nvimgcodec.ColorSpec.SRGB  # (SRGB from 0.9 on)
        self._params = nvimgcodec.DecodeParams(apply_exif_orientation=False, color_spec=rgb, allow_any_depth=False)
        self._code_stream = nvimgcodec.CodeStream
        self.fallback = fallback
        probe = _test_jpeg()
        with torch.cuda.device(self.device):
            got = self._decode([probe])[0]
        torch.cuda.synchronize(self.device)
        if not isinstance(got, torch.Tensor):
            raise RuntimeError(
                "nvImageCodec's hardware JPEG decoder did not decode a 64x64 baseline JPEG "
                f"on {torch.cuda.get_device_name(self.device)}: this GPU may have no NVJPG "
                "engines (use gpu_decoder='nvjpeg')"
            )

    def _decode(self, blobs: Sequence[bytes]) -> list:
        import numpy as np

        stream = torch.cuda.current_stream(self.device).cuda_stream if self.device.type == "cuda" else 0
        srcs = [self._code_stream(np.frombuffer(b, dtype=np.uint8)) for b in blobs]
        imgs = self._dec.decode(srcs, params=self._params, cuda_stream=stream)
        if len(imgs) != len(blobs):  # older nvImageCodec drops failed images instead of answering None
            imgs = [self._dec.decode(s, params=self._params, cuda_stream=stream) for s in srcs]
        out: list = []
        for im in imgs:
            if im is None:
                out.append(None)
                continue
            t = torch.as_tensor(im, device=self.device)  # (H, W, C) uint8, no copy
            if t.shape[2] == 1:
                t = t.expand(-1, -1, 3)
            out.append(t.permute(2, 0, 1))  # (3, H, W) view
        return out

    def __call__(self, blobs: Sequence[bytes]) -> list:
        try:
            out = self._decode(blobs)
        except Exception:  # noqa: BLE001 - find the culprit(s), keep the rest
            out = []
            for b in blobs:
                try:
                    out.append(self._decode([b])[0])
                except Exception as e:  # noqa: BLE001
                    out.append(e)
        refused = [j for j, o in enumerate(out) if o is None]
        if refused and self.fallback is not None:
            for j, o in zip(refused, self.fallback([blobs[j] for j in refused])):
                out[j] = o
        for j in refused:
            if out[j] is None:
                out[j] = RuntimeError("the hardware JPEG decoder refused it")
        return out


def _test_jpeg() -> bytes:
    """A 64x64 baseline JPEG (gradient), encoded with OpenCV."""
    import cv2
    import numpy as np

    y, x = np.mgrid[0:64, 0:64]
    img = np.stack([x * 4, y * 4, (x + y) * 2], -1).astype(np.uint8)
    ok, buf = cv2.imencode(".jpg", img)
    return buf.tobytes()


def make_gpu_decoder(device: torch.device, kind: str = "auto"):
    """The GPU JPEG decoder for ``Config.gpu_decoder``: a :class:`HwJpegDecoder` (``"hardware"``,
    with nvJPEG as its fallback for what the engines refuse) or a :class:`GpuJpegDecoder`
    (``"nvjpeg"``). ``"auto"`` takes the hardware decoder when nvImageCodec is installed and the GPU
    has the engines, nvJPEG otherwise. The result's ``kind`` attribute says which.

    Raises:
        ValueError: an unknown ``kind``.
        RuntimeError: ``"hardware"`` asked for and not available (the reason named).
    """
    if kind not in GPU_DECODERS:
        raise ValueError(f"gpu_decoder must be one of {', '.join(GPU_DECODERS)}, got {kind!r}")
    nvjpeg = GpuJpegDecoder(device)
    if kind == "nvjpeg":
        return nvjpeg
    try:
        return HwJpegDecoder(device, fallback=nvjpeg)
    except Exception as e:  # noqa: BLE001 - ImportError, RuntimeError, a CUDA error from the library
        if kind == "hardware":
            hint = " (pip install nvidia-nvimgcodec-cu13, or -cu12 for CUDA 12)" if isinstance(e, ImportError) else ""
            raise RuntimeError(
                f"gpu_decoder={kind!r}: nvImageCodec's hardware JPEG decoder is not "
                f"available: {type(e).__name__}: {e}{hint}"
            ) from None
        return nvjpeg


Decoder = Callable[[Sequence[bytes]], list]


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
