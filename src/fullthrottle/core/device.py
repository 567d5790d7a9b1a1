"""Which device a command runs on: auto, cpu, cuda or cuda:N, checked; how a process waits for it."""

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


#: the driver's ``CU_CTX_SCHED_BLOCKING_SYNC``: a thread waiting for the GPU sleeps on an OS primitive
CU_CTX_SCHED_BLOCKING_SYNC = 0x04


def sleep_while_waiting() -> bool:
    """Make this process's waits for the GPU sleep instead of spin: every device's primary CUDA context
    gets ``CU_CTX_SCHED_BLOCKING_SYNC`` (the driver API's ``cuDevicePrimaryCtxSetFlags``), so that
    ``cudaStreamSynchronize`` and the like, also those inside libraries (torchvision's nvJPEG
    decode synchronises its stream twice a batch), give the core back while the GPU works. CUDA's
    default, with fewer contexts in a process than cores, spins a core for the whole wait. Call it
    before the process's first CUDA call; a wait then costs a wake-up (microseconds) instead of a core.

    Returns:
        True when the flags are set; False without an NVIDIA driver or when the driver refuses them
        (nothing changes then)."""
    import ctypes

    try:
        cuda = ctypes.CDLL("libcuda.so.1")
    except OSError:
        return False
    count = ctypes.c_int(0)
    if cuda.cuInit(0) != 0 or cuda.cuDeviceGetCount(ctypes.byref(count)) != 0:
        return False
    ok = count.value > 0
    for i in range(count.value):
        dev = ctypes.c_int(0)
        ok = ok and cuda.cuDeviceGet(ctypes.byref(dev), i) == 0
        ok = ok and cuda.cuDevicePrimaryCtxSetFlags(dev, CU_CTX_SCHED_BLOCKING_SYNC) == 0
    return ok
