"""Resize + center crop of a batch of decoded images on the GPU, equal to the CPU path's.

:func:`resize_crop_batch` resizes decoded images with the same antialiased bilinear filter and crop
as the CPU path (:func:`~fullthrottle.data.preprocess.preprocess`), a fixed number of kernels per batch
whatever its sizes (not one Python call per image): two Triton kernels reading the images in place on
CUDA (:func:`~fullthrottle.core.kernels.resize_crop_u8`), batched matrix products elsewhere
(:func:`resize_crop_matmul`); :func:`resize_crop_interpolate` is PyTorch's antialiased interpolate,
image by image, the reference the tests hold both to.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence

import torch
import torch.nn.functional as F


def resize_size(h: int, w: int, resize: int) -> tuple[int, int]:
    """torchvision v2 Resize(resize) output size: shorter side to ``resize``, longer truncated."""
    return (resize, int(resize * w / h)) if h <= w else (int(resize * h / w), resize)


def _resize_and_crop_at(h: int, w: int, resize: int, crop: int) -> tuple[int, int, int, int]:
    """``(nh, nw, top, left)``: the resized size and CenterCrop(crop)'s offsets in it."""
    nh, nw = resize_size(h, w, resize)
    return nh, nw, int(round((nh - crop) / 2.0)), int(round((nw - crop) / 2.0))


def resize_crop_batch(
    images: Sequence[torch.Tensor], out: torch.Tensor, resize: int = 256, crop: int = 224, chunk_elems: int = 1 << 27
) -> None:
    """Resize (antialiased bilinear, shorter side to ``resize``) + center-crop (``crop``) decoded images
    into ``out``: the GPU decode stage's transform, the same as the CPU path's.

    Args:
        images: ``(3, H, W)`` uint8 tensors on one device, any mix of sizes; CHW or views of ``(H, W, 3)``.
        out: ``(len(images), crop, crop, 3)`` uint8 on that device (NHWC, like the staging buffers).
        chunk_elems: see :func:`resize_crop_matmul` (the path without Triton).

    With Triton (on CUDA, :func:`~fullthrottle.core.kernels.use_triton`) two kernels that read each image in
    place and compute only what the crop keeps (:func:`~fullthrottle.core.kernels.resize_crop_u8`);
    otherwise float matrix products (:func:`resize_crop_matmul`). Both round once, from float32
    (Triton) or float16/float32 (products), and agree with each other and ``F.interpolate`` to 1/255.
    """
    from ..core.kernels import resize_crop_u8, use_triton

    if images and use_triton(out):
        resize_crop_u8(images, out, resize, crop)
    else:
        resize_crop_matmul(images, out, resize, crop, chunk_elems)


def resize_crop_matmul(
    images: Sequence[torch.Tensor], out: torch.Tensor, resize: int = 256, crop: int = 224, chunk_elems: int = 1 << 27
) -> None:
    """Resize (antialiased bilinear) + center-crop decoded images into ``out`` as float matrix products,
    a fixed number of kernels per batch whatever the mix of sizes (the path without Triton).

    Args:
        images: ``(3, H, W)`` uint8 tensors on one device (sizes may differ); views of ``(H, W, 3)``
            images (what the hardware decoder gives) are read without a transposing copy.
        out: ``(len(images), crop, crop, 3)`` uint8 on that device (NHWC, like the staging buffers).
        chunk_elems: images of different sizes are zero-padded to a common size in chunks of at most
            this many padded pixels x channels (bounds the working memory: 2 bytes each on CUDA).

    The antialiased filter is written as two matrix products per image, ``rows @ x @ cols^T``, with
    the crop folded into the matrices (only the kept rows and columns are computed) and the image
    kept channels-last throughout (:func:`_resize_crop_hwc`). Photos of one size share one pair of
    matrices (cached per size); a mix of sizes is zero-padded to the largest (rounded up to a
    multiple of 8, sizes float16 GEMMs run on tensor cores) and gets per-image matrices, so a batch
    costs ~10 kernel launches whatever its sizes. On CUDA the products run in float16 (the pixels
    0..255 are exact in float16; the weights carry 11 bits). Mixed sizes are padded to the largest
    rather than grouped into chunks of similar size: per-chunk work costs more than the padding
    (see docs/performance.md). The result is within 1/255 of the CPU path's uint8 kernel on almost
    every pixel.
    """
    if not images:
        return
    dtype = torch.float16 if out.device.type == "cuda" else torch.float32
    h, w = images[0].shape[1:]
    if h % 8 == 0 and w % 8 == 0 and all(im.shape[1:] == (h, w) for im in images):  # one size, aligned
        x = torch.stack([im.permute(1, 2, 0) for im in images])  # (N, H, W, 3) uint8
        rows, cols = _uniform_weights(h, w, resize, crop, out.device, dtype)
        _resize_crop_hwc(x, rows, cols, out)
        return
    # largest first, in chunks whose padded size stays under chunk_elems
    order = sorted(range(len(images)), key=lambda i: -images[i].shape[1] * images[i].shape[2])
    i = 0
    while i < len(order):
        j, hmax, wmax = i, 0, 0
        while j < len(order):
            h, w = images[order[j]].shape[1:]
            if j > i and (j - i + 1) * 3 * max(hmax, h) * max(wmax, w) > chunk_elems:
                break
            hmax, wmax = max(hmax, h), max(wmax, w)
            j += 1
        idx = order[i:j]
        hmax, wmax = -(-hmax // 8) * 8, -(-wmax // 8) * 8  # float16 GEMMs run on tensor cores at multiples of 8
        if idx == list(range(idx[0], idx[0] + len(idx))):
            _resize_crop_padded(
                [images[k] for k in idx], hmax, wmax, resize, crop, out[idx[0] : idx[0] + len(idx)], dtype
            )
        else:
            res = torch.empty((len(idx), crop, crop, 3), dtype=torch.uint8, device=out.device)
            _resize_crop_padded([images[k] for k in idx], hmax, wmax, resize, crop, res, dtype)
            out[torch.tensor(idx, device=out.device)] = res
        i = j


def _aa_weights(
    n_in: torch.Tensor, n_out: torch.Tensor, offset: torch.Tensor, crop: int, n_max: int, device
) -> torch.Tensor:
    """Antialiased bilinear resize along one axis as matrices: ``(N, crop, n_max)`` float32.

    Row ``r`` of image ``i`` holds the weights of output pixel ``offset[i] + r`` of a resize from
    ``n_in[i]`` to ``n_out[i]`` pixels: PyTorch's (and Pillow's) antialias filter, a triangle of
    half-width ``scale = n_in / n_out`` when downscaling (plain bilinear when upscaling), clipped to
    the input and normalised to sum 1 (``aten/src/ATen/native/UpSample.h``, ``_compute_weights_aa``).
    Columns past ``n_in[i]`` are zero (padding).
    """
    n_in, n_out, offset = (t.to(device=device, dtype=torch.float64)[:, None, None] for t in (n_in, n_out, offset))
    scale = n_in / n_out  # (N, 1, 1)
    support = torch.clamp(scale, min=1.0)
    inv = 1.0 / support
    r = torch.arange(crop, device=device, dtype=torch.float64)[None, :, None] + offset
    center = scale * (r + 0.5)  # (N, crop, 1)
    lo = torch.clamp(torch.trunc(center - support + 0.5), min=0)
    hi = torch.minimum(torch.trunc(center + support + 0.5), n_in)
    j = torch.arange(n_max, device=device, dtype=torch.float64)[None, None, :]
    w = torch.clamp(1 - torch.abs((j - center + 0.5) * inv), min=0) * ((j >= lo) & (j < hi))
    return (w / w.sum(-1, keepdim=True)).float()


@functools.lru_cache(maxsize=64)
def _uniform_weights(
    h: int, w: int, resize: int, crop: int, device: torch.device, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    """The filter matrices of one image size: rows ``(crop, h)`` and cols ``(crop, w)`` in ``dtype``."""
    rows, cols = _filter_matrices([(h, w)], h, w, resize, crop, device, dtype)
    return rows[0], cols[0]


def _filter_matrices(
    sizes: Sequence[tuple[int, int]], hmax: int, wmax: int, resize: int, crop: int, device, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per image of size ``(h, w)``: rows ``(N, crop, hmax)`` and cols ``(N, crop, wmax)`` in ``dtype``
    (:func:`_aa_weights` for Resize(resize) + CenterCrop(crop), zero over any padding)."""
    dims = [(h, w, *_resize_and_crop_at(h, w, resize, crop)) for h, w in sizes]
    d = torch.tensor(dims, dtype=torch.float64)  # (N, 6), one copy to the device
    rows = _aa_weights(d[:, 0], d[:, 2], d[:, 4], crop, hmax, device).to(dtype)
    cols = _aa_weights(d[:, 1], d[:, 3], d[:, 5], crop, wmax, device).to(dtype)
    return rows, cols


def _resize_crop_hwc(x: torch.Tensor, rows: torch.Tensor, cols: torch.Tensor, out: torch.Tensor) -> None:
    """``out[n] = rows[n] @ x[n] @ cols[n]^T`` per channel, channels-last, rounded to uint8.

    Args:
        x: ``(N, H, W, 3)`` uint8.
        rows: ``(crop, H)`` (shared) or ``(N, crop, H)`` filter weights, float16/float32.
        cols: ``(crop, W)`` (shared) or ``(N, crop, W)``, same dtype.
        out: ``(N, crop, crop, 3)`` uint8 (may be a non-contiguous view).
    """
    n, h, w, _ = x.shape
    crop = rows.shape[-2]
    y = torch.matmul(rows, x.to(rows.dtype).view(n, h, w * 3))  # (N, crop, W*3)
    y = y.view(n, crop, w, 3).transpose(2, 3).reshape(n, crop * 3, w)  # (N, crop*3, W)
    z = torch.matmul(y, cols.transpose(-1, -2))  # (N, crop*3, crop)
    z = z.round_().clamp_(0, 255).view(n, crop, 3, crop).transpose(2, 3)  # (N, crop, crop, 3)
    out.copy_(z)


def _resize_crop_padded(
    images: Sequence[torch.Tensor], hmax: int, wmax: int, resize: int, crop: int, out: torch.Tensor, dtype: torch.dtype
) -> None:
    """Images of different sizes -> ``out`` ``(N, crop, crop, 3)`` uint8: zero-padded to
    ``(hmax, wmax)`` channels-last, then :func:`_resize_crop_hwc` with per-image matrices from
    :func:`_aa_weights` (zero columns over the padding)."""
    dev = images[0].device
    n = len(images)
    buf = torch.zeros((n, hmax, wmax, 3), dtype=torch.uint8, device=dev)
    torch._foreach_copy_(
        [buf[k, : im.shape[1], : im.shape[2]] for k, im in enumerate(images)], [im.permute(1, 2, 0) for im in images]
    )
    rows, cols = _filter_matrices([tuple(im.shape[1:]) for im in images], hmax, wmax, resize, crop, dev, dtype)
    _resize_crop_hwc(buf, rows, cols, out)


def resize_crop_interpolate(
    images: Sequence[torch.Tensor], out: torch.Tensor, resize: int = 256, crop: int = 224
) -> None:
    """The reference: PyTorch's antialiased ``F.interpolate`` (float32), one call per image size, then
    the crop. Same arguments as :func:`resize_crop_batch`; kept for tests and benchmarks."""
    by_size: dict[tuple[int, int], list[int]] = {}
    for k, im in enumerate(images):
        by_size.setdefault(tuple(im.shape[1:]), []).append(k)
    for (h, w), idx in by_size.items():
        x = torch.stack([images[k] for k in idx])
        nh, nw, top, left = _resize_and_crop_at(h, w, resize, crop)
        if (nh, nw) != (h, w):
            x = F.interpolate(x.float(), size=(nh, nw), mode="bilinear", antialias=True, align_corners=False)
            x = x.round_().clamp_(0, 255).to(torch.uint8)
        out[torch.tensor(idx, device=out.device)] = x[:, :, top : top + crop, left : left + crop].permute(0, 2, 3, 1)
