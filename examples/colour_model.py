"""A model of your own for ``fullthrottle classify`` and ``serve``: any ``nn.Module`` built with no
arguments, which says its preprocessing (``input_transform``) and class names (``labels``).

This one names the strongest colour of a photo, so its answers can be checked by eye::

    cd examples
    fullthrottle classify ../tests/data/imagenet-sample --model colour_model:ColourNet --device cpu
    fullthrottle serve --model colour_model:ColourNet --device cpu     # POST /v1/classify

In a library program: ``Pipeline(Config(device="cpu"), model=ColourNet())``. A real model loads its
weights in ``__init__`` (fullthrottle does not know whether it did: no random-weights warning), or
takes them from ``--weights FILE`` (a state dict: ``.safetensors``, or ``.pth`` read without
unpickling code).
"""

import torch

from fullthrottle import Transform


class ColourNet(torch.nn.Module):
    """``(B, 3, 64, 64)`` float32 images, normalised as ``input_transform`` says -> ``(B, 3)`` logits
    for red, green and blue: each channel's mean over the image, scaled."""

    # every decode path (CPU, GPU) resizes the shorter side to 72 px, crops the centre 64 x 64 and
    # normalises (x / 255 - mean) / std on the device
    input_transform = Transform(resize=72, crop=64, mean=(0.5, 0.5, 0.5), std=(0.25, 0.25, 0.25))
    labels = ["red", "green", "blue"]

    def __init__(self):
        super().__init__()
        self.scale = torch.nn.Parameter(torch.tensor(4.0))  # (a state dict has it: --weights works)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x.mean(dim=(2, 3)) * self.scale  # (B, 3)
