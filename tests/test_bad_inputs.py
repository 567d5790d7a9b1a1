"""Every file in tests/data/bad-inputs gives what that folder's README says."""

import resource
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from fullthrottle.data.preprocess import ImageError, decode, preprocess

ERRORS = {
    "truncated.jpg": r"truncated or corrupt",
    "empty.jpg": r"empty file",
    "not-an-image.jpg": r"not a supported image",
    "bomb-40000x40000.png": r"image too large: 40000x40000",
}


@pytest.mark.parametrize("name,pattern", sorted(ERRORS.items()))
def test_errors(bad_dir, name, pattern):
    with pytest.raises(ImageError, match=pattern):
        preprocess((bad_dir / name).read_bytes())


def test_bomb_does_not_allocate(bad_dir):
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    with pytest.raises(ImageError):
        decode((bad_dir / "bomb-40000x40000.png").read_bytes())
    grown_kib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before
    assert grown_kib < 100 * 1024  # a decode would need 4.8 GB


def _png(w: int, h: int, rows: int, interlace: int = 0, cut: int = 0) -> bytes:
    """A greyscale PNG of ``w`` x ``h`` whose image data holds only ``rows`` rows (non-interlaced;
    interlaced (Adam7): every pass whole), less its last ``cut`` bytes, its zlib stream ended cleanly."""
    import struct
    import zlib

    from fullthrottle.data.image_header import _ADAM7

    def chunk(kind: bytes, body: bytes) -> bytes:
        return struct.pack(">I", len(body)) + kind + body + struct.pack(">I", zlib.crc32(kind + body))

    raw = b"".join(b"\0" + bytes((x * 7 + y) % 256 for x in range(w)) for y in range(rows))
    if interlace:  # (each pass's rows, a filter byte before each: pixel (x, y) is x)
        raw = b""
        for x0, y0, dx, dy in _ADAM7:
            cols = range(x0, w, dx)
            raw += b"".join(b"\0" + bytes(x % 256 for x in cols) for _ in range(y0, h, dy)) if len(cols) else b""
    raw = raw[: len(raw) - cut]
    head = struct.pack(">IIBBBBB", w, h, 8, 0, 0, 0, interlace)
    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", head) + chunk(b"IDAT", zlib.compress(raw)) + chunk(b"IEND", b"")


def test_a_png_whose_image_data_ends_early_is_refused_and_a_raised_limit_does_not_decode_the_bomb(bad_dir):
    """A PNG whose data ends cleanly after 100 of its 400 rows: OpenCV refuses it, and Pillow (the
    fallback) made it a mostly blank image, classified without an error. The bomb (a few thousand of
    its 40,000 rows) with the pixel limit raised: refused before Pillow decodes (it took 18 GB)."""
    from fullthrottle.data.image_header import png_data_complete

    with pytest.raises(ImageError, match=r"truncated or corrupt PNG"):
        decode(_png(500, 400, 100))
    whole = _png(500, 400, 400)
    assert png_data_complete(whole) and decode(whole).shape == (400, 500, 3)
    adam7 = _png(37, 23, 23, interlace=1)
    assert png_data_complete(adam7) and not png_data_complete(_png(37, 23, 23, interlace=1, cut=1))
    assert (decode(adam7)[:, :, 0] == np.arange(37)).all()  # (the layout the count assumes is the format's)
    bomb = (bad_dir / "bomb-40000x40000.png").read_bytes()
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    with pytest.raises(ImageError, match=r"truncated or corrupt PNG"):
        decode(bomb, max_pixels=2_000_000_000)
    assert resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before < 200 * 1024
    for mode in ("L", "LA", "P", "RGB", "RGBA", "I;16", "1"):  # (every colour type and depth Pillow writes)
        import io

        buf = io.BytesIO()
        Image.new(mode, (37, 23)).save(buf, "PNG")
        assert png_data_complete(buf.getvalue()), mode


def _decoded(bad_dir, name):
    return decode((bad_dir / name).read_bytes(), min_side=256)


def test_png_named_as_jpeg_decoded_by_content(bad_dir):
    a = _decoded(bad_dir, "png-named-as.JPEG")
    ref = np.asarray(Image.open(bad_dir / "png-named-as.JPEG").convert("RGB"))
    np.testing.assert_array_equal(a, ref)


def test_cmyk_gives_correct_rgb(bad_dir):
    a = _decoded(bad_dir, "cmyk.jpg").astype(np.float32)
    # the same photo decoded normally (the RGB copy of it among the bad inputs)
    ref = _decoded(bad_dir, "progressive.jpg").astype(np.float32)
    assert a.shape == ref.shape == (375, 500, 3)
    assert np.abs(a - ref).mean() < 8.0, np.abs(a - ref).mean()


def test_gray16_ramp_preserved(bad_dir):
    a = _decoded(bad_dir, "gray16.png")
    assert a.dtype == np.uint8 and a.ndim == 3 and a.shape[2] == 3
    assert np.array_equal(a[..., 0], a[..., 1]) and np.array_equal(a[..., 1], a[..., 2])
    raw = np.asarray(Image.open(bad_dir / "gray16.png"), dtype=np.float64)
    # 8-bit value tracks the 16-bit ramp (value / 257), not clipped to white
    np.testing.assert_allclose(a[..., 0], raw / 257.0, atol=1.0)
    assert a.min() < 10 and a.max() > 245 and len(np.unique(a)) > 200


def test_rgba_to_rgb(bad_dir):
    a = _decoded(bad_dir, "rgba.png")
    ref = np.asarray(Image.open(bad_dir / "rgba.png").convert("RGB"))
    assert a.shape == ref.shape and a.shape[2] == 3
    np.testing.assert_array_equal(a, ref)


def test_exif_rotation_applied(bad_dir):
    from PIL import ImageOps

    a = _decoded(bad_dir, "exif-rotated.jpg")
    with Image.open(bad_dir / "exif-rotated.jpg") as im:
        assert im.getexif().get(0x0112) == 6
        raw_w, raw_h = im.size
        upright = np.asarray(ImageOps.exif_transpose(im).convert("RGB"))
    assert a.shape[:2] == (raw_w, raw_h)  # rotated by 90 degrees
    assert np.abs(a.astype(np.int16) - upright.astype(np.int16)).mean() < 1.0


def test_animated_gif_first_frame(bad_dir):
    a = _decoded(bad_dir, "animated.gif")
    with Image.open(bad_dir / "animated.gif") as im:
        assert getattr(im, "n_frames", 1) == 3
        im.seek(0)
        first = np.asarray(im.convert("RGB"))
    np.testing.assert_array_equal(a, first)


@pytest.mark.parametrize("name", ["tiny-1x1.jpg", "progressive.jpg", "photo.webp", "large-6000x4000.jpg"])
def test_valid_results(bad_dir, name):
    out = preprocess((bad_dir / name).read_bytes())
    assert out.shape == (224, 224, 3) and out.dtype == np.uint8


def test_large_jpeg_uses_reduced_decode(bad_dir):
    a = _decoded(bad_dir, "large-6000x4000.jpg")
    assert a.shape == (1000, 1500, 3)  # 1/4 scale, not 4000x6000


def test_every_item_error_has_its_stage_and_kind(bad_dir, tmp_path):
    """Each failing bad input, and each way a file or input cannot be loaded, comes out of the pipeline
    with its stage and kind (fullthrottle.core.errors), in the Result and in its JSON, never as 'other'."""
    import os

    from fullthrottle import Config, Pipeline
    from fullthrottle.core.errors import KINDS

    (tmp_path / "loop.jpg").symlink_to(tmp_path / "loop.jpg")
    os.mkfifo(tmp_path / "fifo.jpg")
    with open(tmp_path / "big.jpg", "wb") as f:
        f.truncate(2 << 20)
    (tmp_path / "empty_dir").mkdir()
    want = {
        str(bad_dir / "truncated.jpg"): ("preprocess", "corrupt"),
        str(bad_dir / "empty.jpg"): ("preprocess", "empty"),
        str(bad_dir / "not-an-image.jpg"): ("preprocess", "unsupported_format"),
        str(bad_dir / "bomb-40000x40000.png"): ("preprocess", "too_many_pixels"),
        str(tmp_path / "missing.jpg"): ("load", "not_found"),
        str(tmp_path / "empty_dir"): ("load", "not_found"),
        str(tmp_path / "*.png"): ("load", "not_found"),
        str(tmp_path / "loop.jpg"): ("load", "unreadable"),
        str(tmp_path / "fifo.jpg"): ("load", "not_a_file"),
        str(tmp_path / "big.jpg"): ("load", "too_large"),
        "ftp://example.com/a.jpg": ("load", "unsupported_input"),
    }
    with Pipeline(Config(model="resnet18", device="cpu", threads=2, max_file_bytes=1 << 20)) as pipe:
        got = {r.id: r for r in pipe.run([*want, 42])}
    assert got.pop("<input #11>").error_kind == "unsupported_input"  # (the 42)
    for item, (stage, kind) in want.items():
        r = got[item]
        assert (r.error_stage, r.error_kind) == (stage, kind), (item, r.error)
        assert (r.to_dict()["error_stage"], r.to_dict()["error_kind"]) == (stage, kind)
    assert {k for k, _, _ in KINDS} >= {k for _, k in want.values()}
    assert got[str(bad_dir / "truncated.jpg")].to_dict().keys() == {"index", "id", "error", "error_stage", "error_kind"}


def test_read_local_reads_whole_files_up_to_the_limit_and_names_each_refusal(tmp_path):
    """A file of exactly the limit is read whole; one byte more, a folder, a FIFO (opened without
    waiting for a writer), a missing file and a symlink loop each get their own error."""
    import os

    from fullthrottle.data.load import LoadError, read_local

    data = os.urandom(70_000)
    (tmp_path / "a.jpg").write_bytes(data)
    assert read_local(str(tmp_path / "a.jpg"), len(data)) == data
    os.mkfifo(tmp_path / "fifo.jpg")
    os.symlink(tmp_path / "loop.jpg", tmp_path / "loop.jpg")
    for name, limit, want in [
        ("a.jpg", len(data) - 1, f"file too large: {len(data)} bytes exceeds max_file_bytes={len(data) - 1}"),
        ("fifo.jpg", 1 << 20, "not a regular file"),
        (".", 1 << 20, "not a regular file"),
        ("missing.jpg", 1 << 20, "file not found"),
        ("loop.jpg", 1 << 20, "Too many levels of symbolic links"),
    ]:
        with pytest.raises(LoadError, match=want):
            read_local(str(tmp_path / name), limit)


def test_an_extreme_aspect_ratio_is_too_many_pixels_at_preprocess():
    """A 60000x1 strip, which resized to a shorter side of 256 would be 3932 megapixels, is refused
    before decoding as preprocess / too_many_pixels."""
    import io

    from fullthrottle.core.errors import error_info

    buf = io.BytesIO()
    Image.new("RGB", (60000, 1)).save(buf, "PNG")
    with pytest.raises(ImageError, match="extreme aspect ratio: 60000x1") as e:
        preprocess(buf.getvalue())
    assert error_info(f"wide.png: {e.value}") == ("preprocess", "too_many_pixels")


def test_a_header_past_pillows_bomb_limit_gets_our_message_and_no_warning(monkeypatch):
    """WebP and TIFF over Pillow's decompression-bomb threshold (lowered here to 1000 pixels: 40x40 is
    over it, 60x60 over twice it, where Pillow raises) and a WebP header claiming 16383x16383: each is
    refused on its header with the product's message (naming --max-image-megapixels, kind
    too_many_pixels), and no Pillow warning is issued."""
    import io
    import warnings

    from fullthrottle.core.errors import error_info

    def encoded(size, fmt):
        buf = io.BytesIO()
        Image.new("RGB", size, (10, 200, 10)).save(buf, fmt)
        return buf.getvalue()

    # a VP8X chunk: flags, then canvas width - 1 and height - 1 as 24-bit little-endian
    vp8x = b"VP8X" + (10).to_bytes(4, "little") + bytes(4) + (16382).to_bytes(3, "little") * 2
    claim = b"RIFF" + (4 + len(vp8x)).to_bytes(4, "little") + b"WEBP" + vp8x
    cases = [(claim, 89_478_485, "16383x16383")]
    monkeypatch.setattr(Image, "MAX_IMAGE_PIXELS", 1000)
    cases += [(encoded((n, n), fmt), 1000, f"{n}x{n}") for fmt in ("WEBP", "TIFF") for n in (40, 60)]
    for data, limit, size in cases:
        with warnings.catch_warnings(record=True) as seen:
            warnings.simplefilter("always")
            with pytest.raises(ImageError) as e:
                decode(data, 256, max_pixels=limit)
        msg = str(e.value)
        assert msg.startswith(f"image too large: {size} = ") and "--max-image-megapixels" in msg, msg
        assert error_info(msg) == ("preprocess", "too_many_pixels")
        assert not [w for w in seen if issubclass(w.category, Image.DecompressionBombWarning)], size


def test_opencv_log_lines_are_silenced_by_the_decoder_setup():
    """Importing the decoders sets OpenCV's log level to silent (its "[ WARN:0@...] grfmt_tiff.cpp"
    lines would only repeat an item's own error), unless $OPENCV_LOG_LEVEL asks for them."""
    import os

    import cv2  # (imported after fullthrottle.data.preprocess, at this file's top: the setup under test)

    if "OPENCV_LOG_LEVEL" in os.environ:
        pytest.skip("OPENCV_LOG_LEVEL is set: left as asked")
    assert cv2.utils.logging.getLogLevel() == cv2.utils.logging.LOG_LEVEL_SILENT


def test_an_image_past_opencvs_own_pixel_cap_goes_to_pillow_not_opencvs_message(monkeypatch):
    """With a pixel limit above OpenCV's own cap (2**30 pixels), an image between the two is decoded
    by Pillow: a header-only 100000x100000 TIFF gets Pillow's 'truncated' error, no OpenCV text."""
    import struct

    from PIL import Image

    from fullthrottle.data.preprocess import ImageError, decode

    tags = [(256, 4, 100000), (257, 4, 100000), (258, 3, 8), (259, 3, 1), (262, 3, 1), (273, 4, 8), (278, 4, 100000)]
    ifd = struct.pack("<H", len(tags)) + b"".join(struct.pack("<HHII", t, k, 1, v) for t, k, v in tags) + bytes(4)
    monkeypatch.setattr(Image, "MAX_IMAGE_PIXELS", None)  # (what --max-image-megapixels 1e12 sets)
    with pytest.raises(ImageError) as e:
        decode(b"II*\x00" + struct.pack("<I", 8) + ifd, 224, max_pixels=10**18)
    assert "OpenCV" not in str(e.value) and "truncated" in str(e.value), e.value


def test_an_animated_png_with_a_damaged_frame_gives_its_first_image_and_harms_nothing(tmp_path):
    """Decoded in a child process: OpenCV's APNG reader ends the process on this file (SIGSEGV), so
    animated PNGs go to Pillow, whose first frame is the default image a viewer shows."""
    import subprocess
    import sys

    code = (
        "import sys, numpy as np; from fullthrottle.data.preprocess import decode; "
        "np.save(sys.argv[2], decode(open(sys.argv[1], 'rb').read(), min_side=0))"
    )
    out, png = tmp_path / "a.npy", Path(__file__).parent / "data" / "crashers" / "apng-damaged-frame.png"
    r = subprocess.run([sys.executable, "-c", code, str(png), str(out)], timeout=120)
    assert r.returncode == 0, r.returncode
    with Image.open(png) as im:
        assert getattr(im, "is_animated", False)
        ref = np.asarray(im.convert("RGB"))
    np.testing.assert_array_equal(np.load(out), ref)


def test_a_memoryview_gives_what_bytes_give(bad_dir):
    """Every input decodes, or fails, the same from a memoryview (the multi-process server's engine
    hands on views of its read buffer) as from bytes."""

    def outcome(data):
        try:
            return preprocess(data).tobytes()
        except ImageError as e:
            return str(e)

    for path in sorted(bad_dir.iterdir()):
        if path.name != "README.md":
            data = path.read_bytes()
            assert outcome(memoryview(bytearray(data))) == outcome(data), path.name
