"""The five stages wired together with bounded queues; the library's entry point.

::

    Loader (asyncio thread) -q1-> preprocess threads -q2-> Batcher thread -q3-> compute thread
        -q4-> decode thread -> reorder buffer -> your iterator (sync or async)
                  `-gq-> GPU decode thread -q2-^       (with gpu_decode: nvJPEG batches, own stream)

With ``preprocess="processes"`` (the default on CUDA) one dispatcher thread (:mod:`fullthrottle.data.cpu_feed`)
hands each image, a file as its path, to a decoder process (:mod:`fullthrottle.data.preprocess_procs`),
which reads it and writes the crop into shared pinned memory; with GPU decoding, JPEGs go in batches
to GPU decoder processes (:mod:`fullthrottle.data.gpu_feed`), which write their crops there too.

Every queue is bounded, and a window of ``max_in_flight`` permits (taken when an item starts
loading, given back when you receive its result) bounds everything in between, the reorder buffer
included: memory stays flat however long the input stream is.
"""

from __future__ import annotations

import asyncio
import atexit
import contextlib
import sys
import threading
import warnings
import weakref
from collections.abc import AsyncIterator, Iterable, Iterator, Mapping
from dataclasses import replace

import torch
from torch import nn

from ...core.config import Config, usable_cores
from ...core.device import resolve_device
from ...core.report import Report
from ...data.preprocess import allow_pillow_pixels
from ...data.preprocess_procs import DecoderPool
from .compute import Engine
from .result import Result
from .run import PipelineError, Run, limit_heap_fragmentation  # noqa: F401 - (PipelineError: the public name lives here)
from .transform import GPU_INTERPOLATIONS

#: the runs started and not yet finished: stopped before the interpreter exits (:func:`_stop_live_runs`)
_LIVE_RUNS: weakref.WeakSet = weakref.WeakSet()


@atexit.register
def _stop_live_runs() -> None:
    """At exit, stop the runs a caller left unfinished (an iterator of :meth:`Pipeline.run` never
    exhausted nor closed): their stage threads, still inside torch or OpenCV when the interpreter
    tears down, made the process abort ("terminate called without an active exception", exit 134)."""
    for run in list(_LIVE_RUNS):
        run.stop()


#: what using a closed Pipeline raises (RuntimeError)
CLOSED = "this Pipeline is closed (its decoders and buffers are released): build a new one"


class Pipeline:
    """Classify images through the five overlapped stages.

    Build it once (the model is loaded and placed on the device here), then call :meth:`run` or
    :meth:`arun` for each input stream; one stream at a time.

    Args:
        config: a :class:`~fullthrottle.core.config.Config`; keyword arguments override its fields.
        model: optional ``nn.Module`` (float ``(B, 3, crop, crop)`` -> logits ``(B, C)``) instead of a
            named model; its input transform is its ``input_transform`` attribute (a
            :class:`~fullthrottle.workloads.classify.transform.Transform`) or torchvision's ImageNet recipe, unless
            ``config`` sets the fields. A model's name (``"resnet18"``) is taken as ``Config(model=name)``.

    Example::

        with Pipeline(Config(device="auto")) as pipe:  # EfficientNet-Lite0, ImageNet weights
            for r in pipe.run(["photos/", "https://example.com/cat.jpg"]):
                print(r.id, r.labels[0] if r.ok else r.error)
            print(pipe.last_report.format())

    Raises:
        ValueError / WeightsError / RuntimeError: bad config, weights that do not fit, no CUDA.
    """

    def __init__(self, config: Config | None = None, model: nn.Module | str | None = None, **overrides):
        if isinstance(config, str):  # (a model's name in config's place: Pipeline("resnet18"))
            config, model = Config(), config if model is None else model
        config = config or Config()
        if overrides:
            config = replace(config, **overrides)
        if isinstance(model, str):  # (a model's name: as Config(model=name))
            config, model = replace(config, model=model), None
        if config.gpu_decode and config.gpu_decode_processes is None:  # decided here, on this machine
            from ...core.mps import default_processes

            config = replace(config, gpu_decode_processes=default_processes(cores=usable_cores()))
        config = config.for_model(model)  # the model's own resize, crop and normalisation
        if config.gpu_decode and config.interpolation not in GPU_INTERPOLATIONS:  # (the GPU paths are bilinear)
            config = replace(config, gpu_decode=False)
        limit_heap_fragmentation()
        # start-up, overlapped: the decoder processes start first (each imports its libraries and
        # sets up CUDA: seconds), while this thread loads the model and captures its graphs
        cuda = resolve_device(config.device).type == "cuda"
        use_procs = config.preprocess == "processes" or (config.preprocess == "auto" and cuda)
        allow_pillow_pixels(config.max_image_pixels)
        self.decoders = self.gpu_decoders = None
        n = config.decoder_processes()
        if use_procs:
            planned_gpu = config.gpu_decode_processes if config.gpu_decode and cuda else 0
            self.decoders = DecoderPool(
                n,
                config.resize_size,
                config.crop_size,
                config.max_image_pixels,
                rows=config.crop_rows(n, planned_gpu),
                max_file_bytes=config.max_file_bytes,
                interpolation=config.interpolation,
                wait=False,
            )
        try:
            self.engine = Engine(config, model, capture=False)
            if config.gpu_decode and not self.engine.cuda:  # (CUDA only: nothing of it on the CPU)
                config = replace(config, gpu_decode=False)
            self.config = config
            threads = config.torch_threads or (1 if self.engine.cuda else None)
            if threads is not None:
                torch.set_num_threads(threads)
            if self.decoders is not None:
                self.engine.attach_crops(self.decoders.crops)
                if self.engine.gpu_decoder is not None and config.gpu_decode_processes:
                    self._start_gpu_decoders(config)
            self.engine.capture()
            if self.decoders is not None:
                self.decoders.wait_ready()
            if self.gpu_decoders is not None:
                try:
                    self.gpu_decoders.wait_ready()
                except RuntimeError as e:  # e.g. nvJPEG unavailable there: decode in this process
                    self._gpu_decoders_failed(e)
        except BaseException:
            self.close()
            raise
        self.last_report: Report | None = None
        self.current_run: Run | None = None
        #: called with each batch's size as the batcher forms it (from the batcher's thread)
        self.on_batch = None
        self._busy = threading.Lock()
        self.closed = False  # (close(): every later run raises)
        self._life = threading.RLock()  # close() and a run's start, one at a time

    def _start_gpu_decoders(self, config: Config) -> None:
        from ...data.gpu_decode_procs import GpuDecoderPool

        try:
            self.gpu_decoders = GpuDecoderPool(
                config.gpu_decode_processes,
                self.decoders.crops,
                self.engine.device.index or 0,
                config.resize_size,
                config.crop_size,
                config.max_image_pixels,
                decoder=getattr(self.engine.gpu_decoder, "kind", "nvjpeg"),
                max_file_bytes=config.max_file_bytes,
                wait=False,
            )
        except RuntimeError as e:
            self._gpu_decoders_failed(e)

    def _gpu_decoders_failed(self, e: RuntimeError) -> None:
        self.gpu_decoders = None
        warnings.warn(
            f"GPU decoder processes did not start ({e}); decoding on the GPU from a thread of this process instead",
            RuntimeWarning,
            stacklevel=3,
        )

    @property
    def device(self):
        return self.engine.device

    def __enter__(self) -> Pipeline:
        if self.closed:  # (a with block on a closed pipeline says so at its start, not at its first run)
            raise RuntimeError(CLOSED)
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        """Stop the decoder processes and release the device buffers (the pipeline cannot be used
        afterwards: :meth:`run` then raises RuntimeError, also one running now)."""
        with getattr(self, "_life", None) or contextlib.nullcontext():  # (a run starting now is stopped)
            self.closed = True
            run = getattr(self, "current_run", None)
        if run is not None and not run.handed_out:  # a stream its reader has not finished (made or not)
            run.closed_early = True  # (before the stop: what the stop cuts short is never handed out)
            if not run.done:  # its stages stop before the processes they feed
                run.stop()
        if getattr(self, "gpu_decoders", None) is not None:
            self.gpu_decoders.close()
        if getattr(self, "decoders", None) is not None:
            self.decoders.close()
        if getattr(self, "engine", None) is not None:
            self.engine.slots.clear()

    def _begin(self, inputs: Iterable, drop=None) -> Run:
        if isinstance(inputs, (str, bytes)) or hasattr(inputs, "__fspath__"):
            inputs = [inputs]
        if not isinstance(inputs, Iterable) or isinstance(inputs, Mapping):  # (a clear error now, not a
            # stage failure once running; a dict would give its keys)
            what = (
                "an async iterable (iterate it yourself and pass a list or a plain generator)"
                if hasattr(inputs, "__aiter__")
                else f"a {type(inputs).__name__} (its keys would be the inputs: pass list(d.values()), or "
                "list(d.items()) for (id, bytes) pairs)"
                if isinstance(inputs, Mapping)
                else type(inputs).__name__
            )
            raise TypeError(f"inputs must be an iterable of paths, URLs, bytes or (id, bytes) pairs, got {what}")
        with self._life:
            if self.closed:
                raise RuntimeError(CLOSED)
            if not self._busy.acquire(blocking=False):
                raise RuntimeError(
                    "this Pipeline is already running a stream; finish it first (or build a second Pipeline)"
                )
            run = None
            try:
                run = Run(self.engine, self.config, inputs, self.decoders, self.gpu_decoders, drop)
                run.batcher.on_batch = self.on_batch
                self.current_run = run
                run.start()
                _LIVE_RUNS.add(run)
            except BaseException:  # (a run that could not start leaves the Pipeline usable)
                if run is not None:
                    run.stop()
                self._busy.release()
                raise
            return run

    def _finish(self, run: Run) -> None:
        try:
            run.handed_out = True  # (its reader is done with it: a close() now ends nothing)
            run.stop()
            _LIVE_RUNS.discard(run)
            if not sys.is_finalizing():  # (an iterator closed as the interpreter tears down: no report)
                self.last_report = run.report()
        finally:
            self._busy.release()

    def run(self, inputs: Iterable, drop=None) -> Iterator[Result]:
        """Classify ``inputs`` and yield one :class:`~fullthrottle.workloads.classify.decode.Result` per item.

        ``inputs``: paths, directories, globs, URLs, ``bytes``, or ``(id, bytes)`` pairs (see
        :func:`fullthrottle.data.sources.expand`). Results come in input order unless ``ordered=False``.
        Breaking out of the loop (or Ctrl-C) stops every stage and joins its threads.
        ``drop``: ``drop(index) -> bool``, asked for each item (its result's ``index``: its place once
        folders and globs are expanded) as it leaves the load stage and again as its batch reaches the
        model (from those stages' threads): an item it drops is not decoded, or not computed, and its
        result carries the error :data:`~fullthrottle.data.load.DROPPED` (a server drops the images of
        a client that left).

        Raises:
            PipelineError: a stage failed for a reason that belongs to no single item, or the
                ``inputs`` iterable raised (after every item it gave has been answered).
            TypeError: ``inputs`` is not iterable (an async iterable included).
            RuntimeError: the Pipeline is closed, or running another stream.
        """
        run = self._begin(inputs, drop)
        try:
            while not run.done:
                got = run.get_many(0.1)
                if got is None or run.closed_early:
                    break
                results = run.hand_out(got)
                try:
                    for r in results:
                        if run.closed_early:  # (closed between two results: the stream raises at once)
                            break
                        yield r
                finally:
                    results.close()  # (the permits and latencies of what was not taken, now)
            if run.closed_early:
                raise RuntimeError("the Pipeline was closed while this stream ran")
            run.raise_source_error()
        finally:
            self._finish(run)

    async def arun(self, inputs: Iterable) -> AsyncIterator[Result]:
        """Async twin of :meth:`run`; cancelling the consuming task stops every stage."""
        run = self._begin(inputs)
        loop = asyncio.get_running_loop()
        try:
            while not run.done:
                got = await loop.run_in_executor(None, run.get_many, 0.1)
                if got is None or run.closed_early:
                    break
                results = run.hand_out(got)
                try:
                    for r in results:
                        if run.closed_early:  # (as in run())
                            break
                        yield r
                finally:
                    results.close()  # (the permits of what was taken go back now, not at collection)
            if run.closed_early:
                raise RuntimeError("the Pipeline was closed while this stream ran")
            run.raise_source_error()
        finally:
            self._finish(run)

    def classify(self, inputs: Iterable) -> list[Result]:
        """All results of :meth:`run` as a list."""
        return list(self.run(inputs))


def classify(inputs: Iterable, **config) -> list[Result]:
    """One-shot helper: ``classify(["img.jpg"], device="cpu")`` -> results (EfficientNet-Lite0 by default)."""
    with Pipeline(Config(**config)) as pipe:
        return pipe.classify(inputs)
