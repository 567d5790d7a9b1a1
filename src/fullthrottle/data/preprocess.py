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
import struct

import cv2
import numpy as np
import torch
import torch.nn.functional as F
from PIL import Image, ImageOps, UnidentifiedImageError

# Our own threads do the parallelism; OpenCV's pool would only fight them for the cores.
cv2.setNumThreads(1)


class ImageError(ValueError):
    """A specific, per-item reason why an input could not become an image."""


# OpenCV >= 4.10 decodes straight to RGB (one GIL-releasing call fewer per image); not combinable
# with the reduced-size flags, which imply BGR.
_RGB = getattr(cv2, "IMREAD_COLOR_RGB", None)
_REDUCED = {
    1: cv2.IMREAD_COLOR,
    2: cv2.IMREAD_REDUCED_COLOR_2,
    4: cv2.IMREAD_REDUCED_COLOR_4,
    8: cv2.IMREAD_REDUCED_COLOR_8,
}


def sniff(data: bytes) -> str | None:
    """The image format named by the first bytes of ``data``, or ``None`` if unknown."""
    if data[:3] == b"\xff\xd8\xff":
        return "JPEG"
    if data[:8] == b"\x89PNG\r\n\x1a\n":
        return "PNG"
    if data[:6] in (b"GIF87a", b"GIF89a"):
        return "GIF"
    if data[:4] == b"RIFF" and data[8:12] == b"WEBP":
        return "WEBP"
    if data[:2] == b"BM":
        return "BMP"
    if data[:4] in (b"II*\x00", b"MM\x00*"):
        return "TIFF"
    return None


def _exif_orientation(app1: bytes) -> int:
    """EXIF orientation tag (1..8) from an APP1 payload starting with ``Exif\\0\\0``; 1 if absent."""
    tiff = app1[6:]
    if len(tiff) < 8 or tiff[:2] not in (b"II", b"MM"):
        return 1
    e = "<" if tiff[:2] == b"II" else ">"
    (ifd,) = struct.unpack(e + "I", tiff[4:8])
    if ifd + 2 > len(tiff):
        return 1
    (n,) = struct.unpack(e + "H", tiff[ifd : ifd + 2])
    for k in range(n):
        off = ifd + 2 + 12 * k
        if off + 12 > len(tiff):
            break
        tag, _typ, _cnt = struct.unpack(e + "HHI", tiff[off : off + 8])
        if tag == 0x0112:
            return struct.unpack(e + "H", tiff[off + 8 : off + 10])[0]
    return 1


def jpeg_info(data: bytes) -> dict | None:
    """SOF marker, component count, size and EXIF orientation of a JPEG, from its header only."""
    i, n, orient = 2, len(data), 1
    while i + 4 <= n:
        if data[i] != 0xFF:
            return None
        marker = data[i + 1]
        if marker == 0xFF:
            i += 1
            continue
        if marker in (0xD8, 0x01) or 0xD0 <= marker <= 0xD7:
            i += 2
            continue
        (seg,) = struct.unpack(">H", data[i + 2 : i + 4])
        if marker == 0xE1 and data[i + 4 : i + 10] == b"Exif\x00\x00":
            try:
                orient = _exif_orientation(data[i + 4 : i + 2 + seg])
            except struct.error:
                orient = 0
        if 0xC0 <= marker <= 0xCF and marker not in (0xC4, 0xC8, 0xCC):
            if i + 10 > n:
                return None
            h, w = struct.unpack(">HH", data[i + 5 : i + 9])
            return {"sof": marker, "components": data[i + 9], "width": w, "height": h, "orientation": orient}
        i += 2 + seg
    return None


def jpeg_is_complete(data: bytes) -> bool:
    """True when an end-of-image marker follows the last start-of-scan marker.

    libjpeg (behind OpenCV) and nvJPEG both fill a truncated JPEG with grey and return no error, so
    truncation has to be detected on the bytes. Inside entropy-coded data every 0xFF byte is
    followed by 0x00 (byte stuffing), so ``FF D9`` / ``FF DA`` can only be markers.
    """
    # fast path (the GIL is held while bytes are scanned): an EOI near the end, no scan after it
    eoi = data.rfind(b"\xff\xd9", max(0, len(data) - 4096))
    if eoi > 0 and data.find(b"\xff\xda", eoi) < 0:
        return data.find(b"\xff\xda", 0, eoi) > 0
    return data.rfind(b"\xff\xd9") > data.rfind(b"\xff\xda") > 0


def header_size(data: bytes, fmt: str | None) -> tuple[int, int, str]:
    """(width, height, format) read from the header only, without decoding pixels.

    Raises:
        ImageError: the data is not an image format we can read.
    """
    if fmt == "JPEG":
        info = jpeg_info(data)
        if info is not None:
            return info["width"], info["height"], fmt
    if fmt == "PNG" and len(data) >= 24 and data[12:16] == b"IHDR":
        w, h = struct.unpack(">II", data[16:24])
        return w, h, fmt
    if fmt == "GIF" and len(data) >= 10:  # logical screen size, as Pillow reports it
        w, h = struct.unpack("<HH", data[6:10])
        return w, h, fmt
    if fmt == "BMP" and len(data) >= 26:
        (hdr,) = struct.unpack("<I", data[14:18])
        if hdr == 12 and len(data) >= 22:  # BITMAPCOREHEADER: 16-bit sizes
            w, h = struct.unpack("<HH", data[18:22])
            return w, h, fmt
        if hdr >= 40:  # BITMAPINFOHEADER and later: signed 32-bit, negative height = top-down
            w, h = struct.unpack("<ii", data[18:26])
            return w, abs(h), fmt
    try:
        with Image.open(io.BytesIO(data)) as im:  # lazy: parses the header only
            return im.width, im.height, fmt or (im.format or "unknown")
    except Image.DecompressionBombError as e:
        raise ImageError(f"image too large: {e}") from None
    except (UnidentifiedImageError, OSError, SyntaxError, ValueError, struct.error):
        if fmt is not None:  # the signature says what it is, its header does not parse: cut short
            raise ImageError(f"truncated or corrupt {fmt} (its header cannot be read)") from None
        raise ImageError("not a supported image (unrecognised format)") from None


def resized_pixels(w: int, h: int, shorter: int) -> int:
    """Pixels of a ``w`` x ``h`` image once its shorter side is resized to ``shorter`` (as Resize does)."""
    return shorter * int(shorter * max(w, h) / min(w, h))


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
        raise ImageError(
            f"image too large: {w}x{h} = {w * h / 1e6:.1f} megapixels exceeds the limit of "
            f"{max_pixels / 1e6:.3g} megapixels (Config.max_image_pixels, --max-image-megapixels)"
        )
    if min_side > 0 and resized_pixels(w, h, min_side) > max_pixels:
        raise ImageError(
            f"extreme aspect ratio: {w}x{h} with its shorter side resized to {min_side} would be "
            f"{resized_pixels(w, h, min_side) / 1e6:.0f} megapixels, over the limit of "
            f"{max_pixels / 1e6:.3g} megapixels (Config.max_image_pixels, --max-image-megapixels)"
        )
    if fmt == "JPEG" and not jpeg_is_complete(data):
        raise ImageError("truncated or corrupt JPEG (no end-of-image marker after the last scan)")
    if fmt in ("JPEG", "PNG", "WEBP", "BMP", "TIFF"):
        factor = 1
        if fmt == "JPEG" and min_side > 0:
            while factor < 8 and min(w, h) // (factor * 2) >= 2 * min_side:
                factor *= 2
        buf = np.frombuffer(data, np.uint8)
        if factor == 1 and _RGB is not None:
            rgb = cv2.imdecode(buf, _RGB)
            if rgb is not None and rgb.ndim == 3 and rgb.shape[2] == 3:
                return rgb
        else:
            bgr = cv2.imdecode(buf, _REDUCED[factor])
            if bgr is not None and bgr.ndim == 3 and bgr.shape[2] == 3:
                return cv2.cvtColor(bgr, cv2.COLOR_BGR2RGB)
    return _decode_pil(data, fmt)


def _decode_pil(data: bytes, fmt: str) -> np.ndarray:
    try:
        with Image.open(io.BytesIO(data)) as im:
            im.seek(0)  # first frame of an animation
            im = ImageOps.exif_transpose(im)
            if im.mode in ("I;16", "I;16B", "I;16L", "I"):
                arr = np.asarray(im, dtype=np.float64)
                hi = 65535.0 if im.mode.startswith("I;16") else max(float(arr.max()), 1.0)
                arr = np.clip(arr * (255.0 / hi) + 0.5, 0, 255).astype(np.uint8)
                return np.ascontiguousarray(np.repeat(arr[:, :, None], 3, axis=2))
            if im.mode in ("RGBA", "LA", "PA") or (im.mode == "P" and "transparency" in im.info):
                im = im.convert("RGBA")
            return np.array(im.convert("RGB"))  # a writable copy
    except Image.DecompressionBombError as e:
        raise ImageError(f"image too large: {e}") from None
    except (OSError, SyntaxError, ValueError, struct.error) as e:
        raise ImageError(f"corrupt or unsupported {fmt} image: {e}") from None


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
