"""The GPU's JPEG decoders, one contract (``n`` JPEGs in, ``n`` device tensors or per-item exceptions out):
:class:`GpuJpegDecoder` (torchvision's nvJPEG) and :class:`HwJpegDecoder` (the hardware JPEG engines through
nvImageCodec); :func:`make_gpu_decoder` picks one."""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from ..core import env
from ..core.config import GPU_DECODERS


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
