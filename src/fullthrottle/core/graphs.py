"""Where CUDA graphs are captured and replayed, for every workload: :class:`GraphSet` (graphs keyed by
shape in one shared memory pool: the LLM's decode steps use it directly) and :class:`GraphRunner` (a
function of a batch run through batch buckets, one graph per bucket: images, embeddings).

At batch 1 an eager ResNet18 forward costs the host a few milliseconds of kernel launches while the
GPU needs far less, so replayed it runs several times faster (see docs/performance.md). A replay
launches the whole captured forward with one call, so the host cost stops depending on the number
of kernels, and (just as important in a threaded pipeline) the compute thread takes the GIL once
per batch instead of once per op.

The rules followed here (PyTorch's CUDA graph notes, https://pytorch.org/docs/stable/notes/cuda.html#cuda-graphs):
- warm up on a side stream before capture (cuDNN/cuBLAS pick their kernels, workspaces are allocated);
- capture the largest bucket first, all buckets into one pool (``torch.cuda.graph_pool_handle``), so
  smaller graphs reuse the larger one's memory; graphs of one pool replay only on one stream, in turn;
- ``capture_error_mode="thread_local"``, so loader and copy threads may keep using CUDA during capture;
- static inputs are views of one buffer of the largest bucket's size (graphs never run at the same
  time, so they can share it); new data is copied in before each replay, partial batches are padded
  up to the next bucket (pad rows hold stale but finite data; rows are independent in eval mode) and
  outputs are sliced back; a batch larger than the largest bucket is split into buckets;
- a replay overwrites its outputs: :meth:`GraphRunner.__call__` returns copies; callers of
  :meth:`GraphRunner.replay` must consume the outputs (in stream order) before the next replay.
"""

from __future__ import annotations

import gc
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch
from torch import nn

from .batch import bucket_for, split_into_buckets

Outputs = tuple[torch.Tensor, ...]


def _as_tuple(out) -> Outputs:
    return out if isinstance(out, tuple) else (out,)


@dataclass
class GraphInfo:
    """Capture figures: per bucket capture time (ms), total (s), and the shared pool's memory (bytes)."""

    capture_ms: dict[int, float]
    total_capture_s: float
    pool_bytes: int
    variant: dict[int, str] = field(default_factory=dict)  # bucket -> the candidate kept (when several)
    replay_ms: dict[int, dict[str, float]] = field(default_factory=dict)  # bucket -> candidate -> ms

    def format(self) -> str:
        per = ", ".join(f"{b}: {ms:.0f} ms" for b, ms in sorted(self.capture_ms.items()))
        out = (
            f"CUDA graphs: {len(self.capture_ms)} buckets captured in {self.total_capture_s:.2f} s "
            f"({per}); graph pool {self.pool_bytes / 2**20:.1f} MiB"
        )
        if self.variant:
            kept: dict[str, list[int]] = {}
            for b, v in sorted(self.variant.items()):
                kept.setdefault(v, []).append(b)
            out += "; fastest replay kept: " + "; ".join(f"{v} for {bs}" for v, bs in kept.items())
        return out


class GraphSet:
    """CUDA graphs keyed by shape (any hashable key: a batch bucket, or (bucket, sampler, KV length)),
    written once for every workload: warm-up on one persistent side stream, capture with
    ``capture_error_mode="thread_local"`` into one shared memory pool, replay on that stream's order.

    Capture the largest shape first (the caller's order): later, smaller graphs reuse its memory.
    Graphs of one pool must never replay at the same time; a replay overwrites the outputs of the
    graph replayed (consume them, in stream order, before its next replay).

    Args:
        device: a CUDA device.
        warmup: eager calls before each capture (cuDNN/cuBLAS pick their kernels, workspaces are allocated).
    """

    def __init__(self, device: torch.device | str, warmup: int = 2):
        self.device = torch.device(device)
        self.warmup = warmup
        with torch.cuda.device(self.device):
            self.stream = torch.cuda.Stream(self.device)
            self.pool = torch.cuda.graph_pool_handle()
        self.graphs: dict = {}  # key -> (CUDAGraph, outputs)

    def __contains__(self, key) -> bool:
        return key in self.graphs

    def capture(self, key, fn: Callable[[], object], keep: bool = True) -> tuple[torch.cuda.CUDAGraph, object]:
        """Warm ``fn()`` up on the side stream, then capture it; kept under ``key`` unless ``keep`` is
        False (a candidate the caller times first: drop it to give its memory back to the pool).

        Returns ``(graph, outputs)``: ``fn``'s outputs are the graph's static tensors.

        Raises:
            RuntimeError: capture failed (a host sync or a CPU tensor inside ``fn``), naming ``key``.
        """
        self.stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(self.stream):
            for _ in range(self.warmup):
                fn()
        self.stream.synchronize()
        g = torch.cuda.CUDAGraph()
        # no garbage collection while this thread captures: a cycle holding an old CUDAGraph, freed
        # there, destroys it (cudaGraphExecDestroy), which is not permitted during a capture and
        # invalidates it (torch's own gc.collect() before a capture is off by default)
        collecting = gc.isenabled()
        gc.disable()
        try:
            with torch.cuda.graph(g, pool=self.pool, stream=self.stream, capture_error_mode="thread_local"):
                out = fn()
        except Exception as e:
            raise RuntimeError(
                f"CUDA graph capture failed for {key}: {type(e).__name__}: {e}. "
                "The captured function must not synchronise with the host "
                "(.item(), .cpu(), printing) or use CPU tensors."
            ) from e
        finally:
            if collecting:
                gc.enable()
        if keep:
            self.graphs[key] = (g, out)
        return g, out

    def replay(self, key):
        """Replay the graph of ``key`` on the current stream; returns its (static) outputs."""
        g, out = self.graphs[key]
        g.replay()
        return out

    def replay_ms(self, g: torch.cuda.CUDAGraph, reps: int = 5) -> float:
        """Median replay time (ms) of ``g`` on the side stream, timed with CUDA events, after one warm replay."""
        times = []
        with torch.cuda.stream(self.stream):
            g.replay()
            for _ in range(reps):
                t0, t1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                t0.record(self.stream)
                g.replay()
                t1.record(self.stream)
                t1.synchronize()
                times.append(t0.elapsed_time(t1))
        return sorted(times)[len(times) // 2]


class GraphRunner:
    """Run ``fn`` on any batch size through batch buckets: CUDA graph replays on CUDA, eager elsewhere.

    Args:
        fn: ``fn(x) -> Tensor | tuple[Tensor, ...]``, rows independent (row ``i`` of every output
            depends only on row ``i`` of ``x``), no host synchronisation inside. Or a dict of named
            candidates computing the same function (e.g. with and without BatchNorm folded): each is
            captured per bucket, its replay timed (CUDA events, median of 5), and the fastest kept,
            the way cuDNN's benchmark mode picks a kernel. Eager runs use the first.
        item_shape: shape of one input row, e.g. ``(224, 224, 3)``; the input is ``(B, *item_shape)``.
        dtype: input dtype (e.g. ``torch.uint8``).
        buckets: batch sizes to capture, e.g. ``(1, 2, 4, ..., 1024)``.
        device: where ``fn`` runs; graphs only when it is CUDA and ``graphs`` is True.
        graphs: False runs eager (the same splitting, no padding).
        warmup: eager calls per bucket on the side stream before capture.

    Raises:
        RuntimeError: capture failed (a host sync or CPU tensor inside ``fn``), with the bucket named.
    """

    def __init__(
        self,
        fn: Callable,
        item_shape: Sequence[int],
        dtype: torch.dtype,
        buckets: Sequence[int],
        device: torch.device | str,
        graphs: bool = True,
        warmup: int = 2,
    ):
        self.candidates = dict(fn) if isinstance(fn, dict) else {"": fn}
        self.fn = next(iter(self.candidates.values()))
        self.item_shape, self.dtype = tuple(item_shape), dtype
        self.buckets = tuple(sorted(set(int(b) for b in buckets)))
        self.device = torch.device(device)
        self.graphs_enabled = graphs and self.device.type == "cuda"
        self.warmup = warmup
        self.graphs: dict[int, tuple[torch.cuda.CUDAGraph, Outputs]] = {}
        self.info: GraphInfo | None = None
        self.static_in: torch.Tensor | None = None
        if self.graphs_enabled:
            self._capture()

    @torch.inference_mode()
    def _capture(self) -> None:
        dev = self.device
        with torch.cuda.device(dev):
            big = self.buckets[-1]
            # finite, non-trivial data so that warm-up and padding never see NaNs
            self.static_in = torch.zeros((big, *self.item_shape), dtype=self.dtype, device=dev)
            torch.cuda.synchronize(dev)
            reserved0 = torch.cuda.memory_reserved(dev)
            self.set = GraphSet(dev, self.warmup)
            self.stream = self.set.stream
            capture_ms: dict[int, float] = {}
            t_all = time.perf_counter()
            variant: dict[int, str] = {}
            replay_ms: dict[int, dict[str, float]] = {}
            for b in reversed(self.buckets):  # largest first: smaller graphs fit in its memory
                t0 = time.perf_counter()
                x = self.static_in[:b]
                best = None
                for name, fn in self.candidates.items():
                    g, out = self.set.capture(f"bucket {b}", lambda fn=fn: _as_tuple(fn(x)), keep=False)
                    if len(self.candidates) == 1:
                        best = (0.0, name, g, out)
                        break
                    ms = self.set.replay_ms(g)
                    replay_ms.setdefault(b, {})[name] = ms
                    if best is None or ms < best[0]:
                        best = (ms, name, g, out)
                    else:
                        del g, out  # its memory goes back to the pool for the next capture
                _, name, g, out = best
                self.graphs[b] = self.set.graphs[b] = (g, out)
                if len(self.candidates) > 1:
                    variant[b] = name
                capture_ms[b] = 1e3 * (time.perf_counter() - t0)
            torch.cuda.synchronize(dev)
            self.info = GraphInfo(
                capture_ms, time.perf_counter() - t_all, torch.cuda.memory_reserved(dev) - reserved0, variant, replay_ms
            )

    @torch.inference_mode()
    def replay(self, x: torch.Tensor) -> tuple[int, Outputs]:
        """Copy ``x`` (``n`` <= largest bucket rows, on the device) into the static input and replay.

        Runs on the current stream. Returns ``(bucket, outputs)``; the outputs are the graph's static
        tensors (``bucket`` rows, slice ``[:n]``), overwritten by the next replay of any bucket.
        """
        self.static_in[: x.shape[0]].copy_(x, non_blocking=True)
        return self.replay_staged(x.shape[0])

    def staged(self, n: int) -> torch.Tensor:
        """The static input's first ``n`` rows (``n`` <= the largest bucket), for a caller that writes its
        batch there itself, on the current stream, and then calls :meth:`replay_staged` (no copy)."""
        return self.static_in[:n]

    def replay_staged(self, n: int) -> tuple[int, Outputs]:
        """:meth:`replay` of the ``n`` rows already written in the static input (:meth:`staged`)."""
        b = bucket_for(n, self.buckets)
        g, out = self.graphs[b]
        g.replay()
        return b, out

    @torch.inference_mode()
    def __call__(self, x: torch.Tensor):
        """``fn(x)`` for a batch of any size ``n`` >= 1: ``(n, *item_shape)`` -> ``fn``'s outputs, ``n`` rows.

        With graphs, each chunk is replayed and its outputs copied out before the next replay.
        """
        if tuple(x.shape[1:]) != self.item_shape:
            raise ValueError(f"expected input (B, {', '.join(map(str, self.item_shape))}), got {tuple(x.shape)}")
        parts: list[Outputs] = []
        start = 0
        for size, _bucket in split_into_buckets(x.shape[0], self.buckets):
            chunk = x[start : start + size]
            start += size
            if self.graphs_enabled:
                _, out = self.replay(chunk.to(self.device, non_blocking=True))
                parts.append(tuple(o[:size].clone() for o in out))
            else:
                parts.append(_as_tuple(self.fn(chunk.to(self.device, self.dtype))))
        outs = tuple(torch.cat(p, 0) if len(parts) > 1 else p[0] for p in zip(*parts))
        return outs if len(outs) > 1 else outs[0]


def graph_module(
    module: nn.Module,
    item_shape: Sequence[int],
    buckets: Sequence[int],
    device: str | torch.device = "cuda",
    dtype: torch.dtype = torch.float32,
    channels_last: bool = False,
    compile: bool = False,
    graphs: bool = True,
) -> GraphRunner:
    """Wrap an ``nn.Module`` (input fixed except the batch dim) as CUDA graph replays per bucket.

    Args:
        module: e.g. a ResNet; its parameters are moved to ``device`` and ``dtype``, eval mode.
        item_shape: one input row's shape, e.g. ``(3, 224, 224)``.
        buckets: batch sizes to capture.
        dtype: the module's compute dtype (bf16 for speed); inputs are cast to it.
        channels_last: NHWC memory format for a 4-D input and the module's weights.
        compile: ``torch.compile(mode="max-autotune-no-cudagraphs")`` first (fuses kernels; we own the
            graphs). Slow first call.
        graphs: False gives the eager fallback with the same API (also what runs on CPU).

    Returns:
        a :class:`GraphRunner`: ``runner(x)`` for ``x`` of shape ``(n, *item_shape)``, any ``n``.
    """
    dev = torch.device(device)
    module = module.eval().to(dev, dtype)
    if channels_last:
        module = module.to(memory_format=torch.channels_last)
    if compile:
        module = torch.compile(module, mode="max-autotune-no-cudagraphs")

    def fn(x):
        if channels_last and x.dim() == 4:
            x = x.contiguous(memory_format=torch.channels_last)
        return module(x)

    return GraphRunner(fn, item_shape, dtype, buckets, dev, graphs=graphs)
