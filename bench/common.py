"""Helpers shared by the benchmark scripts: machine/version metadata, test images, JSON output."""

from __future__ import annotations

import json
import os
import platform
import socket
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
SAMPLES = ROOT / "tests" / "data" / "imagenet-sample"


def machine_info() -> dict:
    import cv2
    import PIL
    import torch
    import torchvision

    info = {
        "host": socket.gethostname(), "platform": platform.platform(), "cpu_count": os.cpu_count(),
        "python": sys.version.split()[0], "torch": torch.__version__, "torchvision": torchvision.__version__,
        "opencv": cv2.__version__, "pillow": PIL.__version__,
        "gpu": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None,
        "cuda": torch.version.cuda, "date": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "command": " ".join([os.path.basename(sys.executable)] + sys.argv),
    }
    return info


def jpegs_640x480(quality: int = 90) -> list[bytes]:
    """The 200 ImageNet samples resized to exactly 640x480 and re-encoded as JPEG (bytes)."""
    import cv2

    out = []
    for p in sorted(SAMPLES.glob("*.JPEG")):
        bgr = cv2.imdecode(np.fromfile(str(p), np.uint8), cv2.IMREAD_COLOR)
        bgr = cv2.resize(bgr, (640, 480), interpolation=cv2.INTER_AREA)
        ok, buf = cv2.imencode(".jpg", bgr, [cv2.IMWRITE_JPEG_QUALITY, quality])
        assert ok
        out.append(buf.tobytes())
    return out


def sample_jpegs() -> list[bytes]:
    """The 200 mixed-size ImageNet sample JPEGs as bytes."""
    return [p.read_bytes() for p in sorted(SAMPLES.glob("*.JPEG"))]


def write_json(path: str | os.PathLike, payload: dict) -> None:
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w", encoding="utf-8") as f:
        json.dump(payload, f, indent=2)
    print(f"wrote {path}")
