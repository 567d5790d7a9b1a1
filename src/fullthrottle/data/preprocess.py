"""Stage 2, preprocess: bytes -> upright RGB -> resize shorter side -> center crop, as uint8.

Runs in a pool of threads; OpenCV and Pillow release the GIL while they decode and resize, so
threads scale with cores. Normalisation is *not* done here: it happens on the device.

Decoding is chosen by content (magic bytes), never by file name:
- JPEG, PNG, WebP, BMP, TIFF go through OpenCV (``cv2.imdecode``), which applies EXIF orientation and
  scales 16-bit images to 8 bits; a JPEG far larger than needed is decoded at 1/2, 1/4 or 1/8 scale
  by the JPEG library's DCT scaling (``IMREAD_REDUCED_COLOR_*``).
- GIF (first frame) and anything else Pillow can open go through Pillow, with EXIF orientation.
- The header is read first, so an image whose header claims too many pixels is refused before a
  single pixel is decoded.
"""

from __future__ import annotations

import io
import os
import re
import struct

import cv2
import numpy as np
import torch
import torch.nn.functional as F
from PIL import Image, ImageOps

from .image_header import (
    FORMATS,
    ImageError,
    bomb_message,
    header_size,
    jpeg_is_complete,
    png_data_complete,
    png_is_animated,
    resized_pixels,
    sniff,
)

# Our own threads do the parallelism; OpenCV's pool would only fight them for the cores.
cv2.setNumThreads(1)
# OpenCV's log lines ("[ WARN:0@1.3] global grfmt_tiff.cpp ...") only repeat on stderr what the item's own
# error says; silenced unless $OPENCV_LOG_LEVEL asks for them
_CV_LOG = getattr(getattr(cv2, "utils", None), "logging", None)
if _CV_LOG is not None and "OPENCV_LOG_LEVEL" not in os.environ:
    _CV_LOG.setLogLevel(_CV_LOG.LOG_LEVEL_SILENT)


# OpenCV >= 4.10 decodes straight to RGB (one GIL-releasing call fewer per image); not combinable
# with the reduced-size flags, which imply BGR.
_RGB = getattr(cv2, "IMREAD_COLOR_RGB", None)
_REDUCED = {
    1: cv2.IMREAD_COLOR,
    2: cv2.IMREAD_REDUCED_COLOR_2,
    4: cv2.IMREAD_REDUCED_COLOR_4,
    8: cv2.IMREAD_REDUCED_COLOR_8,
}


def allow_pillow_pixels(max_pixels: int) -> None:
    """Raise Pillow's own decompression-bomb limit (``Image.MAX_IMAGE_PIXELS``, process-wide) to
    ``max_pixels`` when that is larger, so that the limit a user configured is the one applied (our
    header check runs first and names it). Never lowers it."""
    if Image.MAX_IMAGE_PIXELS is not None and max_pixels > Image.MAX_IMAGE_PIXELS:
        Image.MAX_IMAGE_PIXELS = max_pixels


def decode(data: bytes, min_side: int = 0, max_pixels: int = 89_478_485) -> np.ndarray:
    """Decode image bytes to an upright RGB array.

    Args:
        data: the encoded file (any format OpenCV or Pillow reads).
        min_side: the shorter side the caller needs; a JPEG whose shorter side is at least twice as
            large (times 2, 4 or 8) is decoded at reduced scale. 0 decodes at full size.
        max_pixels: largest width*height accepted, checked on the header; also the largest the image
            may become once its shorter side is resized to ``min_side`` (a 20000x1 strip would be
            5 million x 256).

    Returns:
        ``(H, W, 3)`` uint8, RGB, EXIF orientation applied.

    Raises:
        ImageError: empty, unrecognised, truncated/corrupt, or too large (each with its own message).
    """
    if len(data) == 0:
        raise ImageError("empty file (0 bytes)")
    fmt = sniff(data)
    w, h, fmt = header_size(data, fmt)
    if w <= 0 or h <= 0:
        raise ImageError(f"corrupt {fmt} header: size {w}x{h}")
    if w * h > max_pixels:
        raise _too_large(w, h, max_pixels)
    if min_side > 0 and resized_pixels(w, h, min_side) > max_pixels:
        raise ImageError(
            f"extreme aspect ratio: {w}x{h} with its shorter side resized to {min_side} would be "
            f"{resized_pixels(w, h, min_side) / 1e6:.0f} megapixels, over the limit of "
            f"{max_pixels / 1e6:.3g} megapixels (Config.max_image_pixels, --max-image-megapixels)"
        )
    if fmt == "JPEG" and not jpeg_is_complete(data):
        raise ImageError("truncated or corrupt JPEG (no end-of-image marker after the last scan)")
    # (an animated PNG goes to Pillow: OpenCV's APNG reader crashes the process on some damaged frames,
    # and Pillow's first frame is the image a viewer shows)
    if fmt in ("JPEG", "PNG", "WEBP", "BMP", "TIFF") and not (fmt == "PNG" and png_is_animated(data)):
        factor = 1
        if fmt == "JPEG" and min_side > 0:
            while factor < 8 and min(w, h) // (factor * 2) >= 2 * min_side:
                factor *= 2
        buf = np.frombuffer(data, np.uint8)
        try:  # (OpenCV refuses with an error what it will not decode, past its own pixel cap say: Pillow then)
            if factor == 1 and _RGB is not None:
                rgb = cv2.imdecode(buf, _RGB)
                if rgb is not None and rgb.ndim == 3 and rgb.shape[2] == 3:
                    return rgb
            else:
                bgr = cv2.imdecode(buf, _REDUCED[factor])
                if bgr is not None and bgr.ndim == 3 and bgr.shape[2] == 3:
                    return cv2.cvtColor(bgr, cv2.COLOR_BGR2RGB)
        except cv2.error:
            pass
    if fmt == "PNG" and not png_data_complete(data):  # (Pillow would blank the rows that are missing)
        raise ImageError("truncated or corrupt PNG (its image data ends before its last row)")
    return _decode_pil(data, fmt, max_pixels)


def _too_large(w: int, h: int, max_pixels: int) -> ImageError:
    return ImageError(
        f"image too large: {w}x{h} = {w * h / 1e6:.1f} megapixels exceeds the limit of "
        f"{max_pixels / 1e6:.3g} megapixels (Config.max_image_pixels, --max-image-megapixels)"
    )


def _decode_pil(data: bytes, fmt: str, max_pixels: int) -> np.ndarray:
    try:
        with Image.open(io.BytesIO(data), formats=FORMATS) as im:  # (no other reader: image_header.FORMATS)
            im.seek(0)  # first frame of an animation
            if im.width * im.height > max_pixels:  # (the size Pillow decodes at: a frame past the header's)
                raise _too_large(im.width, im.height, max_pixels)
            im = ImageOps.exif_transpose(im)
            if im.mode == "F":  # (Pillow would clip them to 0 and 1 of 255: a black image)
                raise ImageError(f"not a supported image: a {fmt} of floating-point samples (no agreed range)")
            if im.mode.startswith("I;16"):  # round(x * 255 / 65535), in integers: 4 bytes a pixel at most
                v = np.asarray(im).astype(np.uint32)
                v *= 255
                v += 32767
                v //= 65535
                return np.repeat(v.astype(np.uint8)[:, :, None], 3, axis=2)
            if im.mode == "I":  # (32-bit samples: scaled by their largest, in place)
                arr = np.asarray(im, dtype=np.float64)
                arr *= 255.0 / max(float(arr.max()), 1.0)
                arr += 0.5
                np.clip(arr, 0, 255, out=arr)
                return np.repeat(arr.astype(np.uint8)[:, :, None], 3, axis=2)
            if im.mode in ("RGBA", "LA", "PA") or (im.mode == "P" and "transparency" in im.info):
                im = im.convert("RGBA")
            return np.array(im.convert("RGB"))  # a writable copy
    except Image.DecompressionBombError as e:
        raise ImageError(bomb_message(e)) from None
    except ImageError:
        raise
    except (OSError, SyntaxError, ValueError, struct.error) as e:
        why = re.sub(r" ?<_io\.BytesIO object at 0x[0-9a-fA-F]+>", "", str(e))  # (Pillow names its buffer)
        raise ImageError(f"corrupt or unsupported {fmt} image: {why}") from None


def resize_crop(
    rgb: np.ndarray, resize_size: int = 256, crop_size: int = 224, interpolation: str = "bilinear"
) -> np.ndarray:
    """torchvision's ResNet eval transform on uint8: shorter side to ``resize_size``, center crop.

    Uses the very kernel ``torchvision.transforms.v2.Resize(resize_size, antialias=True)`` runs on a
    uint8 tensor (``F.interpolate(..., mode="bilinear", antialias=True)``, AVX2 on x86), with the same
    output size and ``CenterCrop(crop_size)`` offsets, so the result equals torchvision's exactly; it is
    also faster than Pillow's or OpenCV's area resize (see docs/performance.md). With intra-op
    threads set to 1 it is one single-threaded kernel that releases the GIL. Few Python->C calls per
    image on purpose: under 16 threads every GIL hand-off costs, and hand-offs, not pixels, set the
    pace.

    Args:
        rgb: ``(H, W, 3)`` uint8.
        interpolation: ``"bilinear"`` or ``"bicubic"`` (both antialiased, on uint8, equal to
            torchvision v2's ``Resize(..., interpolation=..., antialias=True)``).
    Returns:
        ``(crop_size, crop_size, 3)`` uint8, C-contiguous.
    """
    h, w = rgb.shape[:2]
    if h <= w:
        nh, nw = resize_size, int(resize_size * w / h)
    else:
        nh, nw = int(resize_size * h / w), resize_size
    t = torch.from_numpy(rgb).permute(2, 0, 1)[None]  # (1, 3, H, W) view of NHWC memory
    if (nh, nw) != (h, w):
        t = F.interpolate(t, size=(nh, nw), mode=interpolation, antialias=True, align_corners=False)
    top = int(round((nh - crop_size) / 2.0))
    left = int(round((nw - crop_size) / 2.0))
    # C-contiguous on purpose: the compute stage stacks crops into pinned memory, and a strided
    # uint8 source makes that copy run 3 bytes at a time, many times slower
    return np.ascontiguousarray(t[0].permute(1, 2, 0).numpy()[top : top + crop_size, left : left + crop_size])


def preprocess(
    data: bytes,
    resize_size: int = 256,
    crop_size: int = 224,
    max_pixels: int = 89_478_485,
    interpolation: str = "bilinear",
) -> np.ndarray:
    """Encoded image bytes -> ``(crop_size, crop_size, 3)`` uint8 RGB, ready for the device
    (``interpolation``: :func:`resize_crop`'s).

    Raises:
        ImageError: see :func:`decode`.
    """
    rgb = decode(data, min_side=resize_size, max_pixels=max_pixels)
    return resize_crop(rgb, resize_size, crop_size, interpolation)
