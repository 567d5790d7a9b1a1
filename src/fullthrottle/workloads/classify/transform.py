"""How a model's input is made from a decoded image (:class:`Transform`), and the published recipes.

A model module of its own (a named model's, or one given as ``MODULE:CLASS``) imports
:class:`Transform` from here to declare its ``input_transform``.
"""

from __future__ import annotations

import math
import numbers
from dataclasses import dataclass
from typing import Any

#: interpolations the CPU decode paths (threads, decoder processes) implement (antialiased, as
#: ``torchvision.transforms.v2.Resize``)
INTERPOLATIONS = ("bilinear", "bicubic")
#: interpolations the GPU decode paths also implement; a model declaring another one is decoded on the
#: CPU only (the pipeline turns ``gpu_decode`` off for it)
GPU_INTERPOLATIONS = ("bilinear",)


#: the largest ``resize`` (and so ``crop``) taken, in pixels: a model's input far past any in use
MAX_SIDE = 4096


@dataclass(frozen=True)
class Transform:
    """How a model's input is made from a decoded RGB image (uint8).

    Attributes:
        resize: the shorter side is resized to this many pixels (aspect ratio kept).
        crop: then a ``crop`` x ``crop`` center crop (``crop <= resize``).
        mean / std: per RGB channel, in units of the pixel range ``[0, 1]``: the model sees
            ``(x / 255 - mean) / std``, applied on the device.
        interpolation: the resize filter, antialiased: one of :data:`INTERPOLATIONS` (``"bilinear"``,
            which every decode path has, or ``"bicubic"``: CPU decode paths only).

    Raises:
        ValueError: sizes that are not integers with ``1 <= crop <= resize <=`` :data:`MAX_SIDE`, an unknown
            interpolation, or mean/std that are not 3 finite numbers (std none zero).
    """

    resize: int
    crop: int
    mean: tuple[float, float, float]
    std: tuple[float, float, float]
    interpolation: str = "bilinear"

    def __post_init__(self) -> None:
        ints = all(isinstance(v, numbers.Integral) and not isinstance(v, bool) for v in (self.resize, self.crop))
        if ints:  # (numpy's integers too, kept as int)
            object.__setattr__(self, "resize", int(self.resize))
            object.__setattr__(self, "crop", int(self.crop))
        if not (ints and 1 <= self.crop <= self.resize):
            raise ValueError(f"need integers 1 <= crop <= resize, got crop={self.crop!r}, resize={self.resize!r}")
        if self.resize > MAX_SIDE:  # (a batch of crops is allocated at start: 64 x 3 x crop**2 floats)
            raise ValueError(f"resize {self.resize} is over the largest side taken, {MAX_SIDE} pixels")
        if self.interpolation not in INTERPOLATIONS:
            raise ValueError(
                f"interpolation must be one of {INTERPOLATIONS} (what the decode paths "
                f"implement), got {self.interpolation!r}"
            )
        for name in ("mean", "std"):
            check_channels(name, getattr(self, name))


def check_channels(name: str, v: Any) -> None:
    """ValueError unless ``v`` is 3 finite numbers (for ``std``: none zero)."""
    try:
        ok = len(v) == 3 and all(math.isfinite(float(x)) for x in v)
    except (TypeError, ValueError):
        ok = False
    if not ok or (name == "std" and any(float(x) == 0 for x in v)):
        raise ValueError(
            f"{name} must be 3 finite numbers (one per RGB channel{', none zero' if name == 'std' else ''}), got {v!r}"
        )


#: torchvision's ImageNet eval recipe (the ``transforms()`` of its ResNet weights and of
#: ``MobileNet_V3_Small_Weights.IMAGENET1K_V1``): resize 256 (bilinear), crop 224, ImageNet's channel mean and std
TORCHVISION_IMAGENET = Transform(resize=256, crop=224, mean=(0.485, 0.456, 0.406), std=(0.229, 0.224, 0.225))
#: EfficientNet-Lite's: ``(x - 127) / 128`` (tensorflow/tpu ``efficientnet_lite_builder.py``,
#: ``MEAN_RGB`` / ``STDDEV_RGB``), resize 256 + center crop 224
EFFICIENTNET_LITE = Transform(resize=256, crop=224, mean=(127 / 255,) * 3, std=(128 / 255,) * 3)
