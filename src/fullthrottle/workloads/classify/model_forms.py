"""The forms of an image model that compute may run: as given, BatchNorm folded (with conv -> (add ->)
ReLU fused into one cuDNN call each), and the model's own fused inference form (EfficientNet-Lite0's
``fused_for_inference``); each placed on the device in its dtype and memory format. With graphs every
form is a candidate per batch bucket and the fastest replay is kept (:class:`~fullthrottle.core.graphs.GraphRunner`):
none wins at every batch size (see docs/performance.md)."""

from __future__ import annotations

import copy
import warnings
from dataclasses import dataclass

import torch
from torch import nn

from ...core.config import Config
from ...core.kernels import use_triton
from .fuse import fold_batchnorm, fuse_conv_relu


@dataclass
class InferenceForms:
    """``model``: what runs without graphs (folded when folding applied); ``unfolded``: the model as
    given, a graph candidate beside the folded one (or ``None``); ``fused``: the model's own inference
    form (or ``None``)."""

    model: nn.Module
    unfolded: nn.Module | None
    fused: nn.Module | None
    bn_folded: bool
    conv_relu_fused: int  # conv -> ReLU pairs fused

    def candidates(self) -> list[tuple[str, nn.Module]]:
        """``(name, module)`` of every form, the default first (the report names the one kept)."""
        name = ("BN folded, conv+ReLU fused" if self.conv_relu_fused else "BN folded") if self.bn_folded else "model"
        out = [(name, self.model)]
        if self.fused is not None:
            out.append(("fused inference form", self.fused))
        if self.unfolded is not None:
            out.append(("BN unfolded", self.unfolded))
        return out


def inference_forms(
    model: nn.Module, config: Config, device: torch.device, dtype: torch.dtype, channels_last: bool
) -> InferenceForms:
    """``model`` (eval mode) in the forms ``config`` allows on ``device`` (folding and fusion on CUDA only).

    A graph the conv+ReLU rewrite cannot take leaves the folded model as it was; a fused inference
    form that fails its first call is left out with a ``RuntimeWarning``.
    """
    cuda = device.type == "cuda"
    folded, bn_folded = fold_batchnorm(model) if config.fold_bn and cuda else (model, False)
    conv_relu_fused = 0
    if bn_folded:
        try:  # on a copy: a graph the rewrite cannot take leaves the folded model as it was
            fused = copy.deepcopy(folded)
            conv_relu_fused = fuse_conv_relu(fused)
            folded = fused
        except Exception:  # noqa: BLE001 - an unusual graph simply runs unfused
            conv_relu_fused = 0

    def place(m: nn.Module) -> nn.Module:
        m = m.to(device, dtype)
        if channels_last:
            m = m.to(memory_format=torch.channels_last)
        if config.compile and cuda:
            m = torch.compile(m, mode="max-autotune-no-cudagraphs")  # fuse; we own the graphs
        return m

    unfolded = place(model) if bn_folded and config.graphs else None
    own_form, own = None, getattr(model, "fused_for_inference", None)
    if own is not None and config.fold_bn and config.graphs and cuda and use_triton(torch.empty(0, device=device)):
        try:
            own_form = place(own().eval())
            s = config.crop_size
            with torch.inference_mode():
                x = torch.zeros((1, 3, s, s), device=device, dtype=dtype)
                own_form(x.contiguous(memory_format=torch.channels_last))
        except Exception as e:  # noqa: BLE001 - the folded forms still run
            own_form = None
            warnings.warn(
                f"{type(model).__name__}'s fused inference form failed ({type(e).__name__}: {e}); "
                "running it BN-folded instead",
                RuntimeWarning,
                stacklevel=3,
            )
    return InferenceForms(place(folded), unfolded, own_form, bn_folded, conv_relu_fused)
