"""GPU utilisation and memory sampled through NVML (nvidia-ml-py) while a run goes on, and NVTX ranges.

Utilisation is NVML's ``utilization.gpu``: the percent of the sample period in which at least one
kernel ran (not how full the SMs were). The JPEG engines' (NVJPG: A100, H100, H200) utilisation is
NVML's ``nvmlDeviceGetJpgUtilization``, the percent of the period in which they decoded: the GPU's
hardware JPEG decoding, which ``utilization.gpu`` does not count. Without NVML or a GPU every figure
is ``None`` ("n/a"); without JPEG engines (or an NVML too old to ask) theirs is.
"""

from __future__ import annotations

import contextlib
import threading

import torch


@contextlib.contextmanager
def nvtx_range(name: str):
    """An NVTX range (visible on an Nsight Systems timeline); costs ~1 us, harmless without a GPU."""
    torch.cuda.nvtx.range_push(name)
    try:
        yield
    finally:
        torch.cuda.nvtx.range_pop()


class GpuMonitor:
    """Samples one GPU's utilisation (%) and used memory (bytes) every ``interval_s`` in a thread.

    Use as a context manager; afterwards :attr:`mean_util_pct`, :attr:`max_mem_bytes` and
    :attr:`samples` hold the figures (``None`` where NVML or the GPU is absent).
    """

    def __init__(self, device_index: int | None = 0, interval_s: float = 0.1):
        self.device_index, self.interval_s = device_index, interval_s
        self.utils: list[int] = []
        self.mems: list[int] = []
        self.jpg_utils: list[int] = []  # the JPEG engines' utilisation (%), where NVML reports it
        self.available = False
        self.reason = ""
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._handle = None
        if device_index is None:
            self.reason = "no GPU in use"
            return
        try:
            import pynvml

            pynvml.nvmlInit()
            self._nvml = pynvml
            self._handle = pynvml.nvmlDeviceGetHandleByIndex(device_index)
            self.available = True
        except Exception as e:  # noqa: BLE001 - no library, no driver, no GPU: report n/a
            self.reason = f"NVML unavailable ({type(e).__name__})"

    def _sample(self) -> None:
        jpg = getattr(self._nvml, "nvmlDeviceGetJpgUtilization", None)
        while not self._stop.wait(self.interval_s):
            try:
                self.utils.append(self._nvml.nvmlDeviceGetUtilizationRates(self._handle).gpu)
                self.mems.append(self._nvml.nvmlDeviceGetMemoryInfo(self._handle).used)
            except Exception:  # noqa: BLE001
                return
            if jpg is not None:
                try:
                    u = jpg(self._handle)  # [percent, sampling period in us]
                    self.jpg_utils.append(int(u[0] if isinstance(u, list | tuple) else u))
                except Exception:  # noqa: BLE001 - no JPEG engines, or not supported: not asked again
                    jpg = None

    def __enter__(self) -> GpuMonitor:
        if self.available:
            self._thread = threading.Thread(target=self._sample, name="nvml-sampler", daemon=True)
            self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(2)

    @property
    def samples(self) -> int:
        return len(self.utils)

    @property
    def mean_util_pct(self) -> float | None:
        return sum(self.utils) / len(self.utils) if self.utils else None

    @property
    def mean_jpg_util_pct(self) -> float | None:
        """Mean utilisation (%) of the GPU's JPEG engines over the samples, None where not reported."""
        return sum(self.jpg_utils) / len(self.jpg_utils) if self.jpg_utils else None

    @property
    def max_mem_bytes(self) -> int | None:
        return max(self.mems) if self.mems else None

    def to_dict(self) -> dict:
        return {
            "gpu_util_mean_pct": self.mean_util_pct,
            "jpeg_engines_util_mean_pct": self.mean_jpg_util_pct,
            "gpu_mem_max_bytes": self.max_mem_bytes,
            "samples": self.samples,
            "note": self.reason or None,
        }
