"""Models by name, weights from safe formats, and ImageNet class names (offline)."""

from __future__ import annotations

from pathlib import Path

import torch
from torch import nn

_RESNETS = ("resnet18", "resnet34", "resnet50", "resnet101", "resnet152")


class WeightsError(ValueError):
    """A weights file that cannot be loaded into the model (with the reason)."""


def imagenet_labels() -> list[str]:
    """The 1000 ImageNet class names, from torchvision's weights metadata (no download)."""
    from torchvision.models import ResNet18_Weights

    return list(ResNet18_Weights.IMAGENET1K_V1.meta["categories"])


def build_model(name: str) -> nn.Module:
    """A randomly initialised torchvision ResNet by name.

    Raises:
        ValueError: unknown model name.
    """
    import torchvision.models as tvm

    if name not in _RESNETS:
        raise ValueError(f"unknown model {name!r}; choose one of {', '.join(_RESNETS)} "
                         "or pass an nn.Module through the library")
    return getattr(tvm, name)(weights=None)


def load_state_dict(path: str | Path) -> dict[str, torch.Tensor]:
    """Read a state dict from ``.safetensors`` or ``.pth``/``.pt`` without unpickling code.

    ``.pth`` files go through ``torch.load(weights_only=True)``; a checkpoint that wraps the weights
    under ``"state_dict"`` or ``"model"`` is unwrapped.

    Raises:
        FileNotFoundError: no such file.
        WeightsError: unsupported extension, or a file that is not a safe state dict.
    """
    p = Path(path)
    if not p.is_file():
        raise FileNotFoundError(f"weights file not found: {p}")
    suffix = p.suffix.lower()
    try:
        if suffix == ".safetensors":
            from safetensors.torch import load_file

            sd = load_file(str(p), device="cpu")
        elif suffix in (".pth", ".pt", ".bin"):
            sd = torch.load(str(p), map_location="cpu", weights_only=True)
        else:
            raise WeightsError(f"unsupported weights format {suffix!r} (use .safetensors or .pth)")
    except WeightsError:
        raise
    except Exception as e:  # pickle refusal, corrupt file, header errors
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise WeightsError(f"cannot read weights from {p}: not a safe state dict file "
                           f"(loaded with weights_only=True; {type(e).__name__}: {first[:200]})") from None
    for key in ("state_dict", "model"):
        if isinstance(sd, dict) and key in sd and isinstance(sd[key], dict):
            sd = sd[key]
    if not isinstance(sd, dict) or not all(isinstance(v, torch.Tensor) for v in sd.values()):
        raise WeightsError(f"{p} does not hold a state dict of tensors")
    return {k.removeprefix("module."): v for k, v in sd.items()}


def load_weights(model: nn.Module, path: str | Path) -> None:
    """Load a state dict file into ``model`` strictly (every key, every shape).

    Raises:
        WeightsError: missing/unexpected keys or shape mismatch, with the first few named.
    """
    sd = load_state_dict(path)
    try:
        model.load_state_dict(sd, strict=True)
    except RuntimeError as e:
        msg = str(e).splitlines()
        raise WeightsError(f"weights in {path} do not fit the model: " + " ".join(msg[:4])[:600]) from None
