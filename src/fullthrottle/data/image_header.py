"""What an image's first bytes say before a pixel is decoded: its format (by content, never by file
name), width and height, a JPEG's SOF marker and EXIF orientation, whether a JPEG is complete.
Needs only Pillow (for formats whose header it parses), so the HTTP worker processes can check a
request's images without importing the decoders or torch.
"""

from __future__ import annotations

import io
import re
import struct

from PIL import (  # noqa: F401 - the readers of FORMATS, registered with Image as they are imported
    BmpImagePlugin,
    GifImagePlugin,
    Image,
    JpegImagePlugin,
    PngImagePlugin,
    TiffImagePlugin,
    UnidentifiedImageError,
    WebPImagePlugin,
)

#: the image formats read (Pillow's names), by content: every other is refused unread. Pillow has
#: readers for dozens more, some of which hand the bytes to other programs (EPS: Ghostscript) or
#: are rarely exercised; an image service facing untrusted clients offers none of them
FORMATS = ("JPEG", "PNG", "GIF", "WEBP", "BMP", "TIFF")


class ImageError(ValueError):
    """A specific, per-item reason why an input could not become an image."""


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
    if not isinstance(data, (bytes, bytearray)):  # (a memoryview has no find: scanned as bytes)
        data = bytes(data)
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
    if fmt == "GIF" and len(data) >= 10:  # the logical screen, or the first frame where it passes it
        w, h = struct.unpack("<HH", data[6:10])
        try:  # (Pillow's size covers the first frame: the size it decodes at)
            fw, fh, _ = _pillow_header(data)
        except Image.DecompressionBombError as e:
            raise ImageError(bomb_message(e)) from None
        except (UnidentifiedImageError, OSError, SyntaxError, ValueError, struct.error):
            return w, h, fmt  # (no frame it reads: decoding fails on its own)
        return max(w, fw), max(h, fh), fmt
    if fmt == "BMP" and len(data) >= 26:
        (hdr,) = struct.unpack("<I", data[14:18])
        if hdr == 12 and len(data) >= 22:  # BITMAPCOREHEADER: 16-bit sizes
            w, h = struct.unpack("<HH", data[18:22])
            return w, h, fmt
        if hdr >= 40:  # BITMAPINFOHEADER and later: signed 32-bit, negative height = top-down
            w, h = struct.unpack("<ii", data[18:26])
            return w, abs(h), fmt
    if fmt == "WEBP":
        size = _webp_size(data)
        if size is not None:
            return *size, fmt
    try:
        w, h, name = _pillow_header(data)
        return w, h, fmt or name
    except Image.DecompressionBombError as e:  # (a plugin's own check, e.g. on an animation's frame)
        raise ImageError(bomb_message(e)) from None
    except ImageError:
        raise
    except (UnidentifiedImageError, OSError, SyntaxError, ValueError, struct.error):
        if fmt is not None:  # the signature says what it is, its header does not parse: cut short
            raise ImageError(f"truncated or corrupt {fmt} (its header cannot be read)") from None
        raise ImageError(f"not a supported image (unrecognised format; read: {', '.join(FORMATS)})") from None


def bomb_message(e: Exception) -> str:
    """Pillow's decompression-bomb error (a reader's own check, on a frame say) in the words of the
    pixel limit's other messages."""
    m = re.search(r"\((\d+) pixels\) exceeds limit of (\d+) pixels", str(e))
    if m is None:
        return f"image too large: {e}"
    size, limit = int(m[1]), int(m[2]) // 2  # (Pillow fails past twice its MAX_IMAGE_PIXELS: the limit set)
    return (
        f"image too large: a frame of {size / 1e6:.1f} megapixels exceeds the limit of {limit / 1e6:.3g} "
        "megapixels (Config.max_image_pixels, --max-image-megapixels)"
    )


def png_is_animated(data: bytes) -> bool:
    """Whether a PNG holds an animation (an ``acTL`` chunk before its first ``IDAT``: APNG). Read
    from its chunk headers only."""
    at = 8
    while at + 8 <= len(data):
        n, kind = struct.unpack(">I4s", data[at : at + 8])
        if kind == b"acTL":
            return True
        if kind in (b"IDAT", b"IEND"):
            return False
        at += 12 + n
    return False


#: Adam7's passes: (first column, first row, column step, row step)
_ADAM7 = ((0, 0, 8, 8), (4, 0, 8, 8), (0, 4, 4, 8), (2, 0, 4, 4), (0, 2, 2, 4), (1, 0, 2, 2), (0, 1, 1, 2))
#: samples per pixel of each PNG colour type
_PNG_SAMPLES = {0: 1, 2: 3, 3: 1, 4: 2, 6: 4}


def png_data_complete(data: bytes) -> bool:
    """Whether a (still) PNG's image data inflates to every row its header promises: a stream of
    ``IDAT`` data that ends early, but cleanly, is decoded by Pillow as a partly blank image without
    an error (a 40000x40000 "bomb" of a few thousand rows, too). Inflated in pieces and only counted
    (PNG spec 1.2, sections 4.1.1, 2.6 and 2.7: a filter byte before each row of each pass)."""
    import zlib

    if len(data) < 33:
        return False
    w, h, depth, ctype, _, _, interlace = struct.unpack(">IIBBBBB", data[16:29])
    bits = _PNG_SAMPLES.get(ctype, 0) * depth
    passes = _ADAM7 if interlace == 1 else ((0, 0, 1, 1),)
    need = 0
    for x0, y0, dx, dy in passes:
        cols, rows = max(0, (w - x0 + dx - 1) // dx), max(0, (h - y0 + dy - 1) // dy)
        need += rows * (1 + (cols * bits + 7) // 8) if cols else 0
    inflate, got, at = zlib.decompressobj(), 0, 8
    try:
        while at + 8 <= len(data) and got < need:
            n, kind = struct.unpack(">I4s", data[at : at + 8])
            if kind == b"IDAT":
                chunk = data[at + 8 : at + 8 + n]
                while chunk and got < need:
                    got += len(inflate.decompress(chunk, 1 << 20))
                    chunk = inflate.unconsumed_tail
            elif kind == b"IEND":
                break
            at += 12 + n
    except zlib.error:
        return False
    return got >= need


def _webp_size(data: bytes) -> tuple[int, int] | None:
    """A WebP's canvas size from its first chunk (``VP8X``, ``VP8 `` or ``VP8L``), or None. Read here,
    not by Pillow: its WebP reader sets up the whole decoder, canvas memory included, to say the size."""
    chunk = data[12:16]
    if chunk == b"VP8X" and len(data) >= 30:  # 24-bit width - 1, height - 1
        return int.from_bytes(data[24:27], "little") + 1, int.from_bytes(data[27:30], "little") + 1
    if chunk == b"VP8 " and len(data) >= 30 and data[23:26] == b"\x9d\x01\x2a":  # key frame start code
        w, h = struct.unpack("<HH", data[26:30])
        return w & 0x3FFF, h & 0x3FFF
    if chunk == b"VP8L" and len(data) >= 25 and data[20] == 0x2F:  # 14-bit width - 1, height - 1
        (bits,) = struct.unpack("<I", data[21:25])
        return (bits & 0x3FFF) + 1, ((bits >> 14) & 0x3FFF) + 1
    return None


def _pillow_header(data: bytes) -> tuple[int, int, str]:
    """Width, height and format as Pillow's readers of :data:`FORMATS` parse the header (no pixel
    decoded), found the way ``Image.open`` finds the reader, without ``Image.open``'s
    decompression-bomb check: its warning would reach stderr and its error would replace the
    caller's limit, which the caller checks on this size and names
    (:func:`~fullthrottle.data.preprocess.decode`).

    Raises:
        UnidentifiedImageError: none of those readers takes it; OSError, ValueError, ...: a reader's own error.
    """
    prefix = bytes(data[:16])  # (a reader's check may call bytes' methods: a memoryview has none)
    for name in FORMATS:
        factory, accept = Image.OPEN[name]
        ok = not accept or accept(prefix)
        if not ok or isinstance(ok, str):
            continue
        try:
            with factory(io.BytesIO(data), None) as im:
                return im.width, im.height, im.format or name
        except SyntaxError as e:  # (not this format: the next; or this one in a layout it cannot read)
            if str(e) == "unknown pixel mode":  # (a float32 or 64-bit-per-sample TIFF, say)
                raise ImageError(f"not a supported image: a {name} in a pixel layout no reader here takes") from None
            continue
        except (IndexError, TypeError, struct.error):
            continue
    raise UnidentifiedImageError("cannot identify image file")


def resized_pixels(w: int, h: int, shorter: int) -> int:
    """Pixels of a ``w`` x ``h`` image once its shorter side is resized to ``shorter`` (as Resize does)."""
    return shorter * int(shorter * max(w, h) / min(w, h))
