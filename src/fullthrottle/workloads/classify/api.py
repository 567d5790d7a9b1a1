"""Image classification as a :class:`~fullthrottle.core.workload.Workload`, so that what takes any
workload (``fullthrottle run``, :func:`~fullthrottle.ray_jobs.workload_on_ray`, ``serve --workload``)
takes classification too: a JSON body of base64-encoded images in, each image's top-k (or its own
error) out. (The server's built-in ``POST /v1/classify`` takes raw bytes and multipart bodies and
streams them through the pipeline's stages instead.)
"""

from __future__ import annotations

import base64
import binascii

from ...core.json_body import json_type
from ...core.workload import ItemError, Workload

#: images one request may carry (413 beyond, as POST /v1/classify)
MAX_IMAGES = 64


def _b64(s: str) -> bytes:
    """The bytes of a base64 image string (see :class:`ClassifyImages`). Raises ValueError
    (``binascii.Error``): a character outside the alphabet, a length no base64 has, a data URL of
    another encoding."""
    if s[:5].lower() == "data:":  # (scheme and parameters in any case, as RFC 2397 reads them)
        head, sep, s = s.partition(",")
        if not sep or not head.lower().endswith(";base64"):
            raise ValueError("a data: URL must be ';base64,'-encoded")
    s = "".join(s.split())  # (line breaks)
    return base64.b64decode(s + "=" * (-len(s) % 4), validate=True)


class ClassifyImages(Workload):
    """``{"images": ["<base64 JPEG/PNG/...>", ...]}`` -> ``{"results": [{"index", "id", "top_k": [{"label",
    "class_id", "prob"}, ...]} | {"index", "id", "error", "error_stage", "error_kind"}, ...]}``, the
    shape of ``POST /v1/classify``'s results.

    Args:
        config: keyword arguments of :class:`~fullthrottle.core.config.Config` (``model``, ``weights``,
            ``top_k``...); the device comes from :meth:`setup`. Default: EfficientNet-Lite0 with its
            ImageNet weights (serve's ``--model`` and ``--weights`` are for ``/v1/classify``, not for
            this workload). Your own model: a module-level ``ClassifyImages(model="my_module:MyNet")``
            (or a subclass with its own ``name``), named to ``--workload``.

    An image is standard base64, as a ``data:image/...;base64,`` URL too (as a browser's
    ``readAsDataURL`` writes it), with line breaks (as the ``base64`` tool writes it) or without its
    ``=`` padding. A string that is not base64, or an image that does not decode, fails that image alone.
    """

    name = "images"
    max_batch = 256
    max_wait_ms = 5.0
    max_items_per_request = MAX_IMAGES

    def __init__(self, **config):
        self.config = config
        self.pipe = None

    def setup(self, device: str) -> None:
        from ...core.config import Config
        from .pipeline import Pipeline

        self.pipe = Pipeline(Config(**{**self.config, "device": device}))

    def decode_request(self, body: dict) -> list:
        images = body.get("images")
        if not isinstance(images, list) or not images:
            raise ValueError('JSON body must be {"images": ["<base64>", ...]}')
        out = []
        for i, x in enumerate(images):
            if not isinstance(x, str):  # (that image's error: the others are answered)
                out.append(
                    (f"image {i}", ItemError(f"image {i}: not base64: a string is expected, not {json_type(x)}"))
                )
                continue
            try:
                out.append((f"image {i}", _b64(x)))
            except (binascii.Error, ValueError) as e:
                out.append((f"image {i}", ItemError(f"image {i}: not base64: {e}")))
        return out

    def predict(self, items: list) -> list:
        todo = [k for k, (_, data) in enumerate(items) if not isinstance(data, ItemError)]
        out: list = [data for _, data in items]
        for k, r in zip(todo, self.pipe.classify([items[k] for k in todo]) if todo else ()):
            out[k] = r.to_dict() if r.ok else ItemError(r.error)  # (encode_response sets the index)
        return out

    def encode_response(self, outputs: list) -> dict:
        from ...core.errors import error_info

        res = []
        for i, o in enumerate(outputs):
            if isinstance(o, ItemError):
                stage, kind = error_info(str(o))
                res.append({"index": i, "id": f"image {i}", "error": str(o), "error_stage": stage, "error_kind": kind})
            else:
                res.append({**o, "index": i})
        return {"results": res}
