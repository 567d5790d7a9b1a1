"""The stage report: busy %, items/s and queue wait per stage, from counters the stages keep anyway."""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field

from .latency import LatencyHistogram

STAGES = ("load", "preprocess", "batch", "compute", "decode")


class StageStats:
    """Counters of one stage, safe to update from its worker threads.

    Busy time is the union of the intervals in which at least one worker of the stage was working
    on an item (so a stage with 16 threads, all busy all the time, is 100% busy, not 1600%); it does
    not include waiting on an input queue, or (for decode) waiting for the GPU to finish. It is wall
    time, not CPU time: a worker waiting for a core or for the GIL while on an item counts as busy.
    """

    def __init__(self, name: str, workers: int = 1):
        self.name, self.workers = name, workers
        self._lock = threading.Lock()
        self.items = 0
        self.busy_s = 0.0  # union of busy intervals (s)
        self.work_s = 0.0  # sum over workers of busy time (s)
        self.queue_wait_s = 0.0  # sum over items of time spent in this stage's input queue (s)
        self.queue_waits = 0
        self._active = 0
        self._since = 0.0
        self._starts: dict[int, float] = {}

    def begin(self) -> None:
        """A worker starts on an item."""
        now = time.perf_counter()
        with self._lock:
            if self._active == 0:
                self._since = now
            self._active += 1
            self._starts[threading.get_ident()] = now

    def end(self, n_items: int = 1) -> None:
        """The worker that called :meth:`begin` finished ``n_items`` items."""
        now = time.perf_counter()
        with self._lock:
            start = self._starts.pop(threading.get_ident(), now)
            self.work_s += now - start
            self._active -= 1
            if self._active == 0:
                self.busy_s += now - self._since
            self.items += n_items

    def add(self, n_items: int, busy_s: float) -> None:
        """Count items processed outside begin/end (a zero-cost pass-through, say)."""
        self.record(n_items, busy_s, busy_s)

    def record(self, n_items: int, work_s: float, busy_s: float = 0.0) -> None:
        """Count ``n_items`` done by workers outside this process (``work_s`` of worker time), and
        ``busy_s`` more seconds in which at least one worker was busy."""
        with self._lock:
            self.items += n_items
            self.work_s += work_s
            self.busy_s += busy_s

    def waited(self, seconds: float, n: int = 1) -> None:
        """``n`` items waited ``seconds`` each in this stage's input queue."""
        with self._lock:
            self.queue_wait_s += seconds * n
            self.queue_waits += n

    def snapshot(self, wall_s: float) -> dict:
        with self._lock:
            busy = self.busy_s + (time.perf_counter() - self._since if self._active else 0.0)
            return {
                "stage": self.name,
                "workers": self.workers,
                "items": self.items,
                "busy_pct": 100.0 * min(busy / wall_s, 1.0) if wall_s > 0 else 0.0,
                "worker_busy_pct": (100.0 * min(self.work_s / (wall_s * self.workers), 1.0) if wall_s > 0 else 0.0),
                "items_per_s": self.items / wall_s if wall_s > 0 else 0.0,
                "mean_queue_wait_ms": (1e3 * self.queue_wait_s / self.queue_waits if self.queue_waits else 0.0),
            }


def verdict(stages: list[dict], gpu_util_pct: float | None, on_gpu: bool, jpeg_util_pct: float | None = None) -> str:
    """One line naming the bottleneck, from the stage counters and the GPU's utilisation.

    The busiest stage (preprocess counted per worker thread, the others as wall-clock busy) limits
    the run if it is at least 70% busy; otherwise nothing inside the pipeline is saturated and the
    source (disk, network, the caller's iterator) is the limit. On a GPU a busy compute *thread* with
    an idle GPU means the host (staging copies, launches, the GIL) is the limit, not the GPU. A busy
    GPU decode stage names the JPEG engines' utilisation (``jpeg_util_pct``) where it was measured:
    they decode outside the SMs that ``gpu_util_pct`` counts, and may be its limit.

    >>> verdict([{"stage": "preprocess", "workers": 16, "busy_pct": 99, "worker_busy_pct": 98},
    ...          {"stage": "compute", "workers": 1, "busy_pct": 20, "worker_busy_pct": 20}], 31.0, True)
    'preprocess-bound: GPU busy 31%, preprocess threads busy 98%'
    """
    gpu = "n/a" if gpu_util_pct is None else f"{gpu_util_pct:.0f}%"
    load = {s["stage"]: (s["worker_busy_pct"] if s["stage"] == "preprocess" else s["busy_pct"]) for s in stages}
    if not load:
        return "no stages ran"
    stage = max(load, key=load.get)
    pct = load[stage]
    what = {"preprocess": "preprocess threads", "compute": "compute thread"}.get(stage, f"{stage} stage")
    if pct < 70:
        return f"source-bound: no stage is saturated (busiest: {what} {pct:.0f}%), GPU busy {gpu}"
    if stage == "compute" and on_gpu:
        if gpu_util_pct is not None and gpu_util_pct < 70:
            return (
                f"compute-bound on the host: compute thread busy {pct:.0f}% (staging copies, launches, "
                f"GIL waits) while GPU busy {gpu}"
            )
        return f"compute-bound (GPU): GPU busy {gpu}, compute thread busy {pct:.0f}%"
    if stage == "gpu decode" and jpeg_util_pct is not None:
        gpu += f", JPEG engines busy {jpeg_util_pct:.0f}%"
    return f"{stage}-bound: GPU busy {gpu}, {what} busy {pct:.0f}%"


@dataclass
class Report:
    """What one run did: counts, rates (:attr:`unit` per second), latency percentiles (ms), per-stage
    figures; the same for every workload (classify, embed, generate)."""

    items: int = 0
    ok: int = 0
    failed: int = 0
    wall_s: float = 0.0
    #: per-item latencies (ms), as counts in log-spaced buckets (constant memory)
    latencies_ms: LatencyHistogram = field(default_factory=LatencyHistogram, repr=False)
    stages: list[dict] = field(default_factory=list)
    batches: int = 0
    mean_batch_size: float = 0.0
    device: str = ""
    model: str = ""
    dtype: str = ""
    random_weights: bool = False
    graphs: str = ""
    gpu_decode: str = ""
    gpu_util_pct: float | None = None
    #: the GPU's JPEG engines (NVJPG) busy, % of the run (None: not reported, or no engines)
    jpeg_engines_util_pct: float | None = None
    gpu_mem_max_bytes: int | None = None
    #: CPU time of the process running the pipeline (all its threads; not its decoder processes) per
    #: second of the run: how close its one interpreter is to being the limit
    main_process_cores: float | None = None
    #: what an item is, for the rate: "img" (classify), "text" (embed), "token" (generate)
    unit: str = "img"
    #: warnings about the run's input (lines not UTF-8, texts truncated), one line each
    notes: list[str] = field(default_factory=list)

    @property
    def verdict(self) -> str:
        return verdict(self.stages, self.gpu_util_pct, self.device.startswith("cuda"), self.jpeg_engines_util_pct)

    @property
    def images_per_s(self) -> float:
        """Images classified successfully per second (failed items excluded)."""
        return self.ok / self.wall_s if self.wall_s > 0 else 0.0

    @property
    def items_per_s(self) -> float:
        """Items done successfully per second (images, texts or generated tokens: :attr:`unit`)."""
        return self.images_per_s

    def latency_ms(self, q: float) -> float:
        """The ``q``-th percentile (0..100) of per-item latency (ms) from load start to result."""
        return self.latencies_ms.percentile(q)

    def to_dict(self) -> dict:
        d = self._dict()
        if self.unit != "img":  # (image-only figures left out of the text workloads' reports)
            for k in (
                "images_per_s",
                "gpu_decode",
                "jpeg_engines_util_mean_pct",
                *(() if self.latencies_ms else ("latency_p50_ms", "latency_p99_ms")),
            ):
                d.pop(k)
        return d

    def _dict(self) -> dict:
        return {
            "items": self.items,
            "ok": self.ok,
            "failed": self.failed,
            "wall_s": self.wall_s,
            "images_per_s": self.images_per_s,
            "items_per_s": self.items_per_s,
            "unit": self.unit,
            "latency_p50_ms": self.latency_ms(50),
            "latency_p99_ms": self.latency_ms(99),
            "batches": self.batches,
            "mean_batch_size": self.mean_batch_size,
            "device": self.device,
            "model": self.model,
            "dtype": self.dtype,
            "random_weights": self.random_weights,
            "graphs": self.graphs,
            "gpu_decode": self.gpu_decode,
            "stages": self.stages,
            "gpu_util_mean_pct": self.gpu_util_pct,
            "jpeg_engines_util_mean_pct": self.jpeg_engines_util_pct,
            "gpu_mem_max_bytes": self.gpu_mem_max_bytes,
            "main_process_cores": self.main_process_cores,
            "verdict": self.verdict,
            "notes": self.notes,
        }

    def format(self) -> str:
        """A human summary, a few lines."""
        count = (  # (tokens are made, not handed in: none of them fails)
            f"{self.items} tokens"
            if self.unit == "token"
            else f"{self.items} items: {self.ok} ok, {self.failed} failed"
        )
        lines = [
            f"{count} in {self.wall_s:.2f} s = {self.items_per_s:.1f} {self.unit}/s on {self.device} "
            f"({self.model}, {self.dtype})"
        ]
        batches = f"{self.batches} batch{'' if self.batches == 1 else 'es'}, mean size {self.mean_batch_size:.1f}"
        if self.latencies_ms:
            lines.append(
                f"latency per item: p50 {self.latency_ms(50):.1f} ms, p99 {self.latency_ms(99):.1f} ms; {batches}"
            )
        elif self.batches:
            lines.append(batches)
        # busy %: of the run, some worker of the stage at work; per worker: the workers' mean
        lines.append(
            f"{'stage':<11}{'workers':>8}{'busy %':>8}{'per worker %':>14}{'items/s':>10}{'queue wait ms':>15}"
        )
        for s in self.stages:
            lines.append(
                f"{s['stage']:<11}{s['workers']:>8}{s['busy_pct']:>8.1f}{s['worker_busy_pct']:>14.1f}"
                f"{s['items_per_s']:>10.1f}{s['mean_queue_wait_ms']:>15.2f}"
            )
        gpu = "n/a" if self.gpu_util_pct is None else f"{self.gpu_util_pct:.0f}%"
        mem = "" if self.gpu_mem_max_bytes is None else f", memory used up to {self.gpu_mem_max_bytes / 2**30:.1f} GiB"
        jpg = "" if self.jpeg_engines_util_pct is None else f"; JPEG engines busy {self.jpeg_engines_util_pct:.0f}%"
        lines.append(f"GPU utilisation (NVML): {gpu}{mem}{jpg}")
        if self.main_process_cores is not None:
            lines.append(
                f"this process: {self.main_process_cores:.2f} cores of CPU (its threads; decoder processes apart)"
            )
        lines.append(f"bottleneck: {self.verdict}")
        if self.graphs:
            lines.append(self.graphs)
        if self.gpu_decode:
            lines.append(self.gpu_decode)
        if self.random_weights:
            lines.append("NOTE: the model has random weights (no --weights given): labels are meaningless.")
        lines += [f"NOTE: {n}" for n in self.notes]
        return "\n".join(lines)
