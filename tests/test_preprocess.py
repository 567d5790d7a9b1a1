import io
import os

import numpy as np
import pytest
import torch
from PIL import Image
from torchvision.transforms import v2

from fullthrottle.data.image_header import ImageError, jpeg_is_complete, sniff
from fullthrottle.data.preprocess import decode, preprocess

REF = v2.Compose([v2.Resize(256, antialias=True), v2.CenterCrop(224)])


def reference(path) -> np.ndarray:
    """torchvision's own eval transform on a PIL-decoded image: (224, 224, 3) uint8."""
    rgb = np.array(Image.open(path).convert("RGB"))
    return REF(torch.from_numpy(rgb).permute(2, 0, 1)).permute(1, 2, 0).numpy()


def test_matches_torchvision_v2_on_200_samples(samples):
    """Tolerance: bit-exact, except where a JPEG is big enough for reduced-size (DCT-scaled) decoding.

    Our resize is the same uint8 antialiased-bilinear kernel torchvision v2 runs, and OpenCV and
    Pillow share libjpeg-turbo's decoder, so normal images match exactly. A JPEG whose shorter side is
    >= 1024 px is decoded at 1/2 (or less) by the JPEG library's DCT scaling, which averages pixels
    slightly differently from the antialiased resize: we allow a mean absolute difference of 1.0
    (on 0..255) for those, far below what changes a prediction.
    """
    exact, reduced = 0, 0
    for p in samples:
        ours = preprocess(p.read_bytes())
        assert ours.shape == (224, 224, 3) and ours.dtype == np.uint8
        ref = reference(p)
        diff = np.abs(ours.astype(np.int16) - ref.astype(np.int16))
        w, h = Image.open(p).size
        if min(w, h) >= 1024:
            reduced += 1
            assert diff.mean() <= 1.0, (p.name, diff.mean())
        else:
            assert diff.max() == 0, (p.name, diff.mean(), diff.max())
            exact += 1
    assert exact + reduced == 200 and exact >= 190


def _jpeg(arr: np.ndarray, **kw) -> bytes:
    buf = io.BytesIO()
    Image.fromarray(arr).save(buf, format="JPEG", **kw)
    return buf.getvalue()


@pytest.mark.parametrize("w,h", [(1, 1), (224, 224), (300, 100), (100, 300), (257, 256), (5000, 200)])
def test_output_shape_and_center(w, h):
    rng = np.random.default_rng(w * h)
    arr = rng.integers(0, 255, (h, w, 3), dtype=np.uint8)
    buf = io.BytesIO()
    Image.fromarray(arr).save(buf, format="PNG")
    ours = preprocess(buf.getvalue())
    ref = REF(torch.from_numpy(arr).permute(2, 0, 1)).permute(1, 2, 0).numpy()
    assert ours.shape == (224, 224, 3)
    np.testing.assert_array_equal(ours, ref)


def test_sniff_by_content():
    assert sniff(b"\xff\xd8\xff\xe0rest") == "JPEG"
    assert sniff(b"\x89PNG\r\n\x1a\n....") == "PNG"
    assert sniff(b"GIF89a...") == "GIF"
    assert sniff(b"RIFF\x00\x00\x00\x00WEBPVP8 ") == "WEBP"
    assert sniff(b"hello world") is None


def test_truncation_detector():
    data = _jpeg(np.full((64, 64, 3), 128, np.uint8))
    assert jpeg_is_complete(data)
    assert not jpeg_is_complete(data[: len(data) // 2])


def test_files_cut_inside_their_header_are_called_truncated(samples):
    data = samples[0].read_bytes()
    for n in (4, 20, 300):  # JPEG signature, then the header cut short
        with pytest.raises(ImageError, match="truncated or corrupt JPEG .its header cannot be read"):
            decode(data[:n])
    with pytest.raises(ImageError, match="truncated or corrupt PNG"):
        decode(b"\x89PNG\r\n\x1a\n" + b"\x00" * 5)
    with pytest.raises(ImageError, match="not a supported image .unrecognised format"):
        decode(b"plain text, no signature")


def test_a_tiff_in_a_pixel_layout_no_reader_takes_is_unsupported_not_corrupt():
    """A float32 RGB TIFF (a valid file) is refused as an unsupported format, not called corrupt; so
    is a float32 grey one, which Pillow reads but would clip to black."""
    import cv2

    from fullthrottle.core.errors import error_info

    ok, tif = cv2.imencode(".tiff", np.random.default_rng(0).random((32, 40, 3), dtype=np.float32))
    assert ok
    with pytest.raises(ImageError, match="not a supported image: a TIFF in a pixel layout") as e:
        decode(tif.tobytes())
    assert error_info(str(e.value)) == ("preprocess", "unsupported_format")
    ramp = np.tile(np.linspace(0, 1, 40, dtype=np.float32), (32, 1))
    for grey in (cv2.imencode(".tiff", ramp)[1].tobytes(), io.BytesIO()):
        if isinstance(grey, io.BytesIO):
            Image.fromarray(ramp).save(grey, format="TIFF")
            grey = grey.getvalue()
        with pytest.raises(ImageError, match="not a supported image: a TIFF of floating-point samples") as e:
            decode(grey)
        assert error_info(str(e.value)) == ("preprocess", "unsupported_format")


def test_a_frame_over_the_pixel_limit_is_named_in_the_limits_words():
    """A GIF of 10x10 whose one frame claims 60000x60000: refused before decoding, in the words of
    the pixel limit (not Pillow's own)."""
    import struct

    head = b"GIF89a" + struct.pack("<HH", 10, 10) + b"\x00\x00\x00"
    frame = b"," + struct.pack("<HHHH", 0, 0, 60000, 60000) + b"\x00\x02\x02\x44\x01\x00;"
    with pytest.raises(ImageError, match=r"^image too large: a frame of 3600.0 megapixels exceeds the limit of 89.5 m"):
        decode(head + frame)


def test_a_gif_frame_past_its_logical_screen_counts_at_the_size_it_decodes_to():
    """A GIF whose screen says 10x10 and whose first frame is 4000x3000 (under Pillow's own limit):
    Pillow decodes 12 megapixels; the header's size and the pixel limit go by the frame (the screen
    let such a file through any --max-image-megapixels and --max-request-megapixels)."""
    import struct

    from fullthrottle.data.image_header import header_size

    b = io.BytesIO()
    Image.new("P", (4000, 3000)).save(b, "GIF")
    data = bytearray(b.getvalue())
    data[6:10] = struct.pack("<HH", 10, 10)
    assert header_size(bytes(data), "GIF") == (4000, 3000, "GIF")
    with pytest.raises(ImageError, match=r"^image too large: 4000x3000 = 12.0 megapixels exceeds the limit of 5 m"):
        decode(bytes(data), 256, max_pixels=5_000_000)
    assert decode(bytes(data), 256).shape == (3000, 4000, 3)  # (under the default limit: decoded)


def test_16_bit_samples_read_by_pillow_scale_to_8_bits_rounded():
    """Pillow's 16-bit greyscale (an animated PNG's first frame, say) to 8 bits: round(v * 255 / 65535),
    in integers (a float64 copy of an 89-megapixel frame took gigabytes), every value of the ramp."""
    from fullthrottle.data.preprocess import _decode_pil

    ramp = np.arange(65536, dtype=np.uint16).reshape(256, 256)
    b = io.BytesIO()
    Image.fromarray(ramp).save(b, "PNG")
    got = _decode_pil(b.getvalue(), "PNG", 10**6)
    want = np.floor(ramp.astype(np.float64) * 255 / 65535 + 0.5).astype(np.uint8)
    assert got.shape == (256, 256, 3) and got.dtype == np.uint8 and got.flags["C_CONTIGUOUS"]
    assert (got == want[:, :, None]).all()


def test_only_the_documented_formats_are_read_and_no_other_program_runs(tmp_path, monkeypatch):
    """EPS would go to Ghostscript through Pillow: refused unread, as every format outside
    image_header.FORMATS is (a stand-in `gs` first on PATH records any call)."""
    from fullthrottle.data.image_header import header_size

    (tmp_path / "gs").write_text(f"#!/bin/sh\necho called >> {tmp_path / 'gs.log'}\n")
    (tmp_path / "gs").chmod(0o755)
    monkeypatch.setenv("PATH", f"{tmp_path}{os.pathsep}{os.environ['PATH']}")
    eps = b"%!PS-Adobe-3.0 EPSF-3.0\n%%BoundingBox: 0 0 100 100\nnewpath 0 0 moveto 9 9 lineto stroke\nshowpage\n"
    others = [eps]
    for fmt in ("PPM", "ICO", "TGA", "PCX"):
        b = io.BytesIO()
        Image.new("RGB", (50, 40), (10, 20, 30)).save(b, fmt)
        others.append(b.getvalue())
    for data in others:
        with pytest.raises(ImageError, match="not a supported image .unrecognised format; read: JPEG, PNG, GIF"):
            header_size(data, sniff(data))
        with pytest.raises(ImageError, match="not a supported image"):
            decode(data)
    assert not (tmp_path / "gs.log").exists()
    for fmt in ("PNG", "GIF", "BMP", "TIFF", "WEBP", "JPEG"):  # (what is read still is)
        b = io.BytesIO()
        Image.new("RGB", (50, 40), (10, 20, 30)).save(b, fmt)
        assert decode(b.getvalue(), min_side=0).shape == (40, 50, 3), fmt


def test_reduced_decode_for_large_jpeg():
    arr = np.random.default_rng(0).integers(0, 255, (2400, 3200, 3), dtype=np.uint8)
    data = _jpeg(arr, quality=80)
    full = decode(data, min_side=0)
    small = decode(data, min_side=256)
    assert full.shape == (2400, 3200, 3)
    assert small.shape == (600, 800, 3)  # 1/4: shorter side 600 >= 2 * 256, 1/8 would be 300 < 512


def test_pixel_limit_is_checked_on_header_before_decoding():
    arr = np.zeros((100, 100, 3), np.uint8)
    with pytest.raises(ImageError, match="image too large: 100x100"):
        decode(_jpeg(arr), max_pixels=5000)


def test_a_png_with_a_bad_checksum_is_corrupt_without_naming_a_python_object():
    """Pillow's message names its in-memory buffer (``<_io.BytesIO object at 0x...>``): the item's error
    says what is wrong with the file only."""
    import io

    from PIL import Image

    from fullthrottle.data.preprocess import ImageError, decode

    buf = io.BytesIO()
    Image.new("RGB", (50, 40), (1, 2, 3)).save(buf, "PNG")
    data = bytearray(buf.getvalue())
    data[29] ^= 0xFF  # the IHDR chunk's CRC
    with pytest.raises(ImageError) as e:
        decode(bytes(data))
    assert str(e.value) == "corrupt or unsupported PNG image: cannot identify image file"
