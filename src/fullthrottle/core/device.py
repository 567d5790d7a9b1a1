"""Which device a command runs on: auto, cpu, cuda or cuda:N, checked."""

from __future__ import annotations

import torch


def resolve_device(spec: str) -> torch.device:
    """``"auto"`` -> CUDA if available else CPU; otherwise ``torch.device(spec)``.

    Raises:
        RuntimeError: CUDA asked for but not available.
    """
    if spec == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if not isinstance(spec, (str, torch.device)):
        raise ValueError(f"unsupported device {spec!r}: use auto, cpu, cuda or cuda:N")
    try:
        dev = torch.device(spec)
    except RuntimeError:
        raise ValueError(f"unsupported device {spec!r}: use auto, cpu, cuda or cuda:N") from None
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise RuntimeError(
            f"device {spec!r} requested but CUDA is not available on this machine (use --device cpu or auto)"
        )
    if dev.type not in ("cpu", "cuda"):
        raise ValueError(f"unsupported device {spec!r}: use auto, cpu, cuda or cuda:N")
    return dev
