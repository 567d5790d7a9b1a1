"""What the kernels share: whether Triton runs (:func:`use_triton`), and the argument checks."""

from __future__ import annotations

import os

import torch

from .. import env

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only installs: the references run
    triton = tl = None

_INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"


def use_triton(t: torch.Tensor) -> bool:
    """True when the Triton kernels run for tensors like ``t``: Triton importable, ``t`` on CUDA (or
    Triton's interpreter on), and ``FULLTHROTTLE_TRITON`` not ``0``."""
    return triton is not None and (t.is_cuda or _INTERPRET) and env.get(env.TRITON) != "0"


_FLOATS = (torch.float32, torch.float16, torch.bfloat16)
#: the dtype of float8 paged KV memory (e4m3: 3 mantissa bits, finite values up to :data:`FP8_MAX`);
#: the attention kernels read it and compute in float32
KV_FP8 = torch.float8_e4m3fn
FP8_MAX = 448.0


def to_kv(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``x`` in a KV memory's ``dtype`` (float8: saturated at +-:data:`FP8_MAX`, never NaN)."""
    if x.dtype == dtype:
        return x
    if dtype == KV_FP8:
        x = x.clamp(-FP8_MAX, FP8_MAX)
    return x.to(dtype)


def _kv_dtype_ok(cache: torch.Tensor, q: torch.Tensor) -> bool:
    """Whether a KV cache's dtype goes with ``q``'s: the same, or float8 (:data:`KV_FP8`)."""
    return cache.dtype in (q.dtype, KV_FP8)


def _check(ok: bool, msg: str) -> None:
    if not ok:
        raise ValueError(msg)


def _same_device(fn: str, **tensors) -> None:
    """ValueError naming the tensors when they are not all on one device."""
    devs = {name: t.device for name, t in tensors.items() if t is not None}
    _check(
        len(set(devs.values())) <= 1,
        f"{fn}: tensors on different devices: " + ", ".join(f"{k} on {v}" for k, v in devs.items()),
    )


def _is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def paged_setting() -> dict:
    """``warps``, ``per`` and ``sub`` for :func:`~.attention.paged_decode_attention` from
    ``FULLTHROTTLE_PAGED_ATTENTION`` (``"WARPS,PER,SUB"``, trials), or ``{}`` (its defaults) when unset.

    Raises:
        ValueError: a value that is not three positive integers (:func:`~fullthrottle.core.env.check`)."""
    env.check(env.PAGED_ATTENTION)
    given = env.get(env.PAGED_ATTENTION)
    return dict(zip(("warps", "per", "sub"), map(int, given.split(",")))) if given else {}
