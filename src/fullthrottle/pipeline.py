"""The five stages wired together with bounded queues; the library's entry point.

::

    Loader (asyncio thread) -q1-> preprocess threads -q2-> Batcher thread -q3-> compute thread
        -q4-> decode thread -> reorder buffer -> your iterator (sync or async)
                  `-gq-> GPU decode thread -q2-^       (with gpu_decode: nvJPEG batches, own stream)

With ``preprocess="processes"`` (the default on CUDA) one dispatcher thread (:mod:`fullthrottle.cpu_feed`)
hands each image, a file as its path, to a decoder process (:mod:`fullthrottle.preprocess_procs`),
which reads it and writes the crop into shared pinned memory; with GPU decoding, JPEGs go in batches
to GPU decoder processes (:mod:`fullthrottle.gpu_feed`), which write their crops there too.

Every queue is bounded, and a window of ``max_in_flight`` permits (taken when an item starts
loading, given back when you receive its result) bounds everything in between, the reorder buffer
included: memory stays flat however long the input stream is.
"""

from __future__ import annotations

import asyncio
import collections
import functools
import queue
import threading
import time
import warnings
from collections.abc import AsyncIterator, Iterable, Iterator
from dataclasses import replace

import torch
from torch import nn

from .batch import Batch, Batcher
from .compute import Engine
from .config import GPU_PROCESS_DEPTH, Config, usable_cores
from .cpu_feed import feed_cpu_decoders
from .decode import Result
from .gpu_decode import gpu_eligible
from .gpu_feed import GPU_CHUNK, feed_gpu_process, gpu_decode_thread
from .gpumon import GpuMonitor, nvtx_range
from .load import Item, Loader
from .preprocess import ImageError, allow_pillow_pixels, preprocess
from .preprocess_procs import DecoderPool
from .report import Report, StageStats

_END = object()

#: consumed results whose window permits the iterator gives back at once (never before they are consumed)
RELEASE_EVERY = 16
#: file name endings of the unread files that go to the GPU decoder processes (which decode what is not
#: a JPEG the GPU takes on their CPU)
JPEG_SUFFIXES = (".jpg", ".jpeg", ".jpe", ".jfif")


def limit_heap_fragmentation(arenas: int = 2) -> bool:
    """Cap glibc's malloc arenas (``mallopt(M_ARENA_MAX)``), process-wide, for threads started later.

    Decoded images and crops (0.1-1 MB each) are allocated in one thread and freed in another; with
    glibc's default of up to 8 arenas per core the arenas fragment and RSS keeps creeping up; with 2
    arenas it levels off (see docs/performance.md). (Serving large blocks with mmap keeps RSS flatter
    but makes every activation of a CPU model page-fault, which makes it much slower.)
    Returns False where glibc is absent (nothing changed).
    """
    import ctypes
    import ctypes.util

    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        return bool(libc.mallopt(-8, arenas))  # M_ARENA_MAX
    except (OSError, AttributeError):
        return False


class PipelineError(RuntimeError):
    """A stage failed for a reason that is not any single item's (a bug, a dead device)."""


class Run:
    """One pass of an input stream through the stages (internal: use :meth:`Pipeline.run`)."""

    END = _END  #: the end-of-stream marker in the stages' queues

    def __init__(self, engine: Engine, config: Config, inputs: Iterable, decoders=None, gpu_decoders=None):
        self.engine, self.config = engine, config
        self.decoders = decoders  # a DecoderPool (one worker process per preprocess thread) or None
        # GpuDecoderProcess workers (nvJPEG in processes, with decoder processes) or none
        self.gpu_procs = list(gpu_decoders.workers) if gpu_decoders is not None else []
        self.gpu_mps = getattr(gpu_decoders, "mps", False)  # started as MPS clients (GpuDecoderPool.mps)
        self.stop_event = threading.Event()
        self.error: BaseException | None = None
        self._routed0 = dict(engine.splitter.routed)  # the splitter lives on: this run's counts are the change
        self._gpu_cpu0 = sum(p.times["cpu_decoded"] for p in self.gpu_procs)  # (likewise the processes)
        nthreads = config.num_threads
        qs = config.queue_size
        self.q1: queue.Queue = queue.Queue(qs)
        self.q2: queue.Queue = queue.Queue(qs)
        self.q3: queue.Queue = queue.Queue(2)  # small: the batcher keeps filling while compute is busy
        self.q4: queue.Queue = queue.Queue(config.staging_slots + 2)
        self.out: queue.Queue = queue.Queue()  # bounded by the window
        self.window = threading.Semaphore(config.in_flight_limit)
        self.ok = self.failed = 0  # results handed out (hand_out)
        self.stats = {
            "load": StageStats("load", config.load_concurrency),
            "preprocess": StageStats("preprocess", len(decoders) if decoders is not None else nthreads),
            **(
                {"gpu decode": StageStats("gpu decode", max(1, len(self.gpu_procs)))}
                if engine.gpu_decoder is not None
                else {}
            ),
            "batch": StageStats("batch", 1),
            "compute": StageStats("compute", 1),
            "decode": StageStats("decode", 1),
        }
        # with decoder processes (and the GPU's JPEGs decoded in processes too) no file's bytes pass
        # through this process: the items carry paths, and the process each goes to reads it
        defer = decoders is not None and (engine.gpu_decoder is None or bool(self.gpu_procs))
        self.loader = Loader(
            inputs,
            self.q1,
            self._put,
            self.window,
            self.stop_event,
            self.stats["load"],
            config.load_concurrency,
            config.http_timeout_s,
            config.max_file_bytes,
            nthreads,
            _END,
            defer_files=defer,
        )
        # with decoder processes one dispatcher thread feeds them all (cpu_feed): each image costs it a
        # few microseconds of Python, and more threads only mean more GIL hand-offs for compute to wait in
        n_pre = 1 if decoders is not None else nthreads
        self.n_pre = n_pre
        # lists of items and end markers: up to GPU_CHUNK items a list from the dispatcher (GPU decoder
        # processes), one item a list from the preprocess threads (the GPU decode thread)
        self.gq: queue.Queue | None = (
            queue.Queue(max(4, config.queue_size // GPU_CHUNK) if self.gpu_procs else config.queue_size)
            if engine.gpu_decoder is not None
            else None
        )
        self._ends, self._ends_lock = 0, threading.Lock()
        self._inbox: collections.deque = collections.deque()  # preprocess threads: items taken from q1
        gpu_consumers = (max(1, len(self.gpu_procs))) if self.gq is not None else 0
        self.batcher = Batcher(
            lambda t: self._get(self.q2, t),
            lambda o, block=True: self._put(self.q3, o, block),
            config.max_batch_size,
            config.max_wait_ms,
            n_pre + gpu_consumers,
            _END,
            self.stats["batch"],
            self.stop_event.is_set,
            lambda: engine.in_flight() >= 2,
        )
        if decoders is not None:
            self.threads = [
                threading.Thread(
                    target=self._guard(functools.partial(feed_cpu_decoders, self, list(decoders.workers))),
                    name="ft-preprocess-dispatch-0",
                    daemon=True,
                )
            ]
        else:
            self.threads = [
                threading.Thread(target=self._guard(self._preprocess_worker), name=f"ft-preprocess-{i}", daemon=True)
                for i in range(nthreads)
            ]
        if self.gpu_procs:
            self.threads += [
                threading.Thread(
                    target=self._guard(functools.partial(feed_gpu_process, self, p)),
                    name=f"ft-gpu-decode-{i}",
                    daemon=True,
                )
                for i, p in enumerate(self.gpu_procs)
            ]
        elif self.gq is not None:
            self.threads.append(
                threading.Thread(
                    target=self._guard(functools.partial(gpu_decode_thread, self)), name="ft-gpu-decode", daemon=True
                )
            )
        self.threads += [
            threading.Thread(target=self._guard(self.batcher.run), name="ft-batch", daemon=True),
            threading.Thread(target=self._guard(self._compute_worker), name="ft-compute", daemon=True),
            threading.Thread(target=self._guard(self._decode_worker), name="ft-decode", daemon=True),
        ]
        self.latencies: list[float] = []
        self.gpumon = GpuMonitor((engine.device.index or 0) if engine.cuda else None)
        self.t0 = 0.0
        self.t_end = 0.0
        self.done = False

    # -- plumbing -------------------------------------------------------------------------------
    def _put(self, q: queue.Queue, obj, block: bool = True) -> bool:
        """Put with backpressure; gives up (False) when the run is stopped."""
        if not block:
            try:
                q.put_nowait(obj)
                return True
            except queue.Full:
                return False
        while not self.stop_event.is_set():
            try:
                q.put(obj, timeout=0.05)
                return True
            except queue.Full:
                continue
        return False

    def _get(self, q: queue.Queue, timeout: float | None = 0.05):
        try:
            return q.get(timeout=timeout) if timeout else q.get_nowait()
        except queue.Empty:
            return None

    def _guard(self, fn):
        def run():
            try:
                fn()
            except BaseException as e:  # noqa: BLE001 - a stage died: stop and report it
                if self.error is None:
                    self.error = e
                self.stop_event.set()

        return run

    def start(self) -> None:
        self.engine.reset()
        if self.decoders is not None:
            self.decoders.crops.reset()
        self.gpumon.__enter__()
        self.t0 = time.perf_counter()
        self.loader.start()
        for t in self.threads:
            t.start()

    def stop(self, timeout: float = 10.0) -> None:
        """Stop every stage and join its thread (at most ``timeout`` seconds in all)."""
        self.stop_event.set()
        self.gpumon.__exit__(None, None, None)
        deadline = time.perf_counter() + timeout
        for t in [self.loader.thread, *self.threads]:
            if t.is_alive():
                t.join(max(0.0, deadline - time.perf_counter()))

    # -- stages ---------------------------------------------------------------------------------
    def _gpu_eligible(self, it: Item) -> bool:
        """Whether the GPU decoder would decode ``it`` exactly like the CPU path (reads the header only)."""
        return (
            it.error is None
            and self.engine.gpu_decoder is not None
            and gpu_eligible(it.data, self.config.max_image_pixels, self.config.resize_size)[0]
        )

    def _gpu_candidate(self, it: Item) -> bool:
        """With GPU decoder processes: whether ``it`` starts like a JPEG. They run :func:`gpu_eligible`
        themselves and decode what fails it on their CPU, so this process (whose GIL bounds the whole
        pipeline) spends ~0.1 us on the image here instead of ~3 us parsing its header."""
        if it.is_path:  # (unread: its name says whether it is meant to be a JPEG)
            return it.error is None and it.id.lower().endswith(JPEG_SUFFIXES)
        return it.error is None and it.data.startswith(b"\xff\xd8\xff")

    def _to_gpu(self, items: list) -> None:
        """Hand a list of routed items to the GPU decoder(s)."""
        now = time.perf_counter()
        for it in items:
            it.t_queued = now
        self._put(self.gq, items)

    def _route_to_gpu(self, it: Item) -> bool:
        """Transform threads: hand ``it`` to the GPU decode thread if it is an eligible JPEG and the
        rate split says so."""
        if self._gpu_eligible(it) and self.engine.splitter.choose() == "gpu":
            self._to_gpu([it])
            return True
        return False

    def _end_of_stream(self) -> None:
        """A preprocess thread has seen the end: tell the batcher (and the GPU decode thread)."""
        self._put(self.q2, _END)
        if self.gq is not None and not self.gpu_procs:
            self._put(self.gq, _END)  # the GPU decode thread counts one per preprocess thread
        elif self.gq is not None:
            with self._ends_lock:
                self._ends += 1
                last = self._ends == self.n_pre
            if last:  # nothing more comes: one end for each GPU process's feeder, behind every image
                for _ in self.gpu_procs:
                    self._put(self.gq, _END)

    @torch.inference_mode()
    def _decode_crops(self, items: list) -> list:
        from .gpu_decode import decode_crops

        cfg = self.config
        try:
            return decode_crops(
                self.engine.gpu_decoder,
                [it.data for it in items],
                cfg.resize_size,
                cfg.crop_size,
                cfg.max_image_pixels,
                self.engine.device,
            )
        except Exception as e:  # noqa: BLE001 - a failed batch fails its items, not the run
            return [ImageError(f"GPU decode failed: {type(e).__name__}: {e}")] * len(items)

    def _preprocess_worker(self) -> None:
        cfg, st = self.config, self.stats["preprocess"]
        gpu, splitter = self.engine.gpu_decoder, self.engine.splitter
        inbox = self._inbox  # the rest of a list from the loader, for any preprocess thread to take
        while not self.stop_event.is_set():
            try:
                it = inbox.popleft()
            except IndexError:
                c = self._get(self.q1)
                if c is None:
                    continue
                if c is _END:  # (its list's other items are in the inbox: whoever took one drains it)
                    self._end_of_stream()
                    return
                c = self.loader.take(c)
                it = c[0]
                inbox.extend(c[1:])
            if self._route_to_gpu(it):
                continue
            st.begin()
            st.waited(time.perf_counter() - it.t_queued)
            if it.error is None:
                t0 = time.perf_counter()
                try:
                    with nvtx_range("preprocess"):
                        it.array = preprocess(it.data, cfg.resize_size, cfg.crop_size, cfg.max_image_pixels)
                except ImageError as e:
                    it.error = f"{it.id}: {e}"
                except Exception as e:  # noqa: BLE001 - a decoder crash belongs to this item
                    it.error = f"{it.id}: cannot decode image: {type(e).__name__}: {e}"
                if gpu is not None:
                    splitter.record_cpu(1, time.perf_counter() - t0)
            it.data = None
            st.end(1)
            it.t_queued = time.perf_counter()
            self._put(self.q2, it)

    def _compute_worker(self) -> None:
        st, eng = self.stats["compute"], self.engine
        while not self.stop_event.is_set():
            obj = self._get(self.q3)
            if obj is None:
                continue
            if obj is _END:
                self._put(self.q4, _END)
                return
            if isinstance(obj, Item):  # an item that failed earlier: pass it on
                self._put(self.q4, obj)
                continue
            st.waited(time.perf_counter() - obj.t_queued, len(obj))
            slot = eng.acquire(self.stop_event.is_set)
            if slot is None:
                return
            st.begin()
            arrays = [it for it in obj.items if it.array is not None]
            pooled = [it for it in obj.items if it.pool_row >= 0]
            on_gpu = [it for it in obj.items if it.gpu_crop is not None]
            obj.items = arrays + pooled + on_gpu  # rows: crops from threads, from processes, then the GPU's
            with nvtx_range(f"compute batch {len(obj)}"):
                eng.submit(
                    slot,
                    [it.array for it in arrays],
                    gpu_crops=[it.gpu_crop for it in on_gpu],
                    pool_rows=[it.pool_row for it in pooled],
                )
            for it in obj.items:
                it.array = it.data = it.gpu_crop = None
            st.end(len(obj))
            self._put(self.q4, (obj, slot, time.perf_counter()))

    def _decode_worker(self) -> None:
        st, eng = self.stats["decode"], self.engine
        pending: dict[int, Result] = {}
        next_index = 0
        ordered = self.config.ordered
        while not self.stop_event.is_set():
            obj = self._get(self.q4)
            if obj is None:
                continue
            if obj is _END:
                break
            out: list[Result] = []
            if isinstance(obj, Item):
                st.begin()
                out.append(Result(obj.index, obj.id, error=obj.error or "unknown error"))
                st.end(1)
            else:
                batch, slot, t_q = obj
                assert isinstance(batch, Batch)
                if slot.error is None:
                    with nvtx_range("decode: wait for device"):
                        probs, idx = eng.collect(slot)  # waits for the device
                st.begin()
                st.waited(time.perf_counter() - t_q, len(batch))
                now = time.perf_counter()
                if slot.error is not None:
                    out = [
                        Result(it.index, it.id, error=f"{it.id}: {slot.error}", latency_ms=1e3 * (now - it.t_start))
                        for it in batch.items
                    ]
                else:  # positional: the per-image cost here is paid under the GIL
                    out = [
                        Result(it.index, it.id, lab, ids, p, None, 1e3 * (now - it.t_start))
                        for it, lab, ids, p in zip(batch.items, eng.label_lists(idx), idx.tolist(), probs.tolist())
                    ]
                eng.release(slot)
                st.end(len(batch))
            if isinstance(obj, Item):
                out[0].latency_ms = 1e3 * (time.perf_counter() - obj.t_start)
            if not ordered:
                self.out.put(out)  # a batch's results in one hand-off
                continue
            for r in out:
                pending[r.index] = r
            ready = []
            while next_index in pending:
                ready.append(pending.pop(next_index))
                next_index += 1
            if ready:
                self.out.put(ready)
        if pending:  # only reached when the stream ended: nothing is missing
            self.out.put([pending.pop(i) for i in sorted(pending)])
        self.out.put(_END)

    # -- consumer side --------------------------------------------------------------------------
    def get_many(self, timeout: float = 0.1) -> list[Result] | None:
        """Results ready now (waiting up to ``timeout`` s for the first); ``None`` once finished.

        Raises:
            PipelineError: a stage failed (not an item: the run cannot continue).
        """
        out: list = []
        finished = False
        try:
            got = self.out.get(timeout=timeout)
            while True:  # lists of results, then the end marker
                if got is _END:
                    finished = True
                    break
                out += got
                got = self.out.get_nowait()
        except queue.Empty:
            pass
        err = self.error or self.loader.error
        if err is not None and not self.done:
            self.done = True
            self.stop()
            raise PipelineError(f"pipeline stage failed: {type(err).__name__}: {err}") from err
        self.latencies += [r.latency_ms for r in out]
        if finished:
            self.done = True
            self.t_end = time.perf_counter()
            return out if out else None
        return out

    def hand_out(self, results: list) -> Iterator[Result]:
        """Yield ``results`` to the caller, counting ok/failed; a result's window permit goes back
        once the caller asks for the next (it has taken this one), :data:`RELEASE_EVERY` at a time
        (a Semaphore release per item woke the loader once per image), the rest when the list ends
        or the caller stops."""
        owed = given = 0
        try:
            for r in results:
                if r.error is None:
                    self.ok += 1
                else:
                    self.failed += 1
                given += 1
                yield r
                owed += 1
                if owed >= RELEASE_EVERY:
                    self.window.release(owed)
                    owed = 0
        finally:
            if owed:
                self.window.release(owed)
            if given < len(results):  # the caller stopped: latencies only of the results it got
                del self.latencies[len(self.latencies) - (len(results) - given) :]

    def raise_source_error(self) -> None:
        """After the last result: if the inputs iterable raised, raise that now (every item it
        gave before is answered).

        Raises:
            PipelineError: naming the iterable's exception (chained to it).
        """
        e = self.loader.source_error
        if e is not None:
            raise PipelineError(
                f"the inputs iterable raised {type(e).__name__}: {e} (after "
                f"{self.ok + self.failed} items, all answered)"
            ) from e

    def report(self) -> Report:
        wall = (self.t_end or time.perf_counter()) - self.t0
        eng = self.engine
        batches = self.batcher.batches
        return Report(
            items=self.ok + self.failed,
            ok=self.ok,
            failed=self.failed,
            wall_s=wall,
            latencies_ms=list(self.latencies),
            stages=[s.snapshot(wall) for s in self.stats.values()],
            batches=batches,
            mean_batch_size=self.batcher.batched_items / batches if batches else 0.0,
            device=str(eng.device),
            model=eng.model_name,
            dtype=str(eng.dtype).removeprefix("torch."),
            random_weights=eng.random_weights,
            gpu_util_pct=self.gpumon.mean_util_pct,
            gpu_mem_max_bytes=self.gpumon.max_mem_bytes,
            graphs=eng.runner.info.format() if eng.runner is not None and eng.runner.info else "",
            gpu_decode=self._gpu_decode_summary(),
        )

    def _gpu_decode_summary(self) -> str:
        """One line: which GPU JPEG decoder ran where, and the share of eligible JPEGs it decoded."""
        eng = self.engine
        if eng.gpu_decoder is None:
            return ""
        name = {"hardware": "the GPU's JPEG engines (nvImageCodec)", "nvjpeg": "nvJPEG (torchvision)"}.get(
            getattr(eng.gpu_decoder, "kind", None), type(eng.gpu_decoder).__name__
        )
        where = f"{len(self.gpu_procs)} GPU decoder processes" if self.gpu_procs else "a thread of this process"
        gpu, cpu = (eng.splitter.routed[k] - self._routed0[k] for k in ("gpu", "cpu"))
        share = f" ({gpu / (gpu + cpu):.0%})" if gpu + cpu else ""
        if not self.gpu_procs:
            return (
                f"GPU decode: {name} in {where}; {gpu} of {gpu + cpu} eligible JPEGs{share} sent there, "
                "the rest decoded on the CPU"
            )
        on_cpu = sum(p.times["cpu_decoded"] for p in self.gpu_procs) - self._gpu_cpu0
        from .mps import started_here

        mps = (
            "as clients of a CUDA MPS server" + (" started for this run" if started_here() else "")
            if self.gpu_mps
            else "time-slicing the GPU (no CUDA MPS server found: see the README's GPU JPEG decoding section)"
        )
        return (
            f"GPU decode: {name} in {where}, {mps}; {gpu} of {gpu + cpu} JPEGs{share} sent there ({on_cpu} "
            "of them to those processes' CPU decoder: not for the GPU decoder or refused by it), the rest "
            "decoded by the CPU decoder processes"
        )


class Pipeline:
    """Classify images through the five overlapped stages.

    Build it once (the model is loaded and placed on the device here), then call :meth:`run` or
    :meth:`arun` for each input stream; one stream at a time.

    Args:
        config: a :class:`~fullthrottle.config.Config`; keyword arguments override its fields.
        model: optional ``nn.Module`` (float ``(B, 3, crop, crop)`` -> logits ``(B, C)``) instead of a
            named model; its input transform is its ``input_transform`` attribute (a
            :class:`~fullthrottle.models.Transform`) or torchvision's ImageNet recipe, unless
            ``config`` sets the fields.

    Example::

        with Pipeline(Config(device="auto")) as pipe:  # EfficientNet-Lite0, ImageNet weights
            for r in pipe.run(["photos/", "https://example.com/cat.jpg"]):
                print(r.id, r.labels[0] if r.ok else r.error)
            print(pipe.last_report.format())

    Raises:
        ValueError / WeightsError / RuntimeError: bad config, weights that do not fit, no CUDA.
    """

    def __init__(self, config: Config | None = None, model: nn.Module | None = None, **overrides):
        config = config or Config()
        if overrides:
            config = replace(config, **overrides)
        if config.gpu_decode and config.gpu_decode_processes is None:  # decided here, on this machine
            from .mps import default_processes

            config = replace(config, gpu_decode_processes=default_processes())
        config = config.for_model(model)  # the model's own resize, crop and normalisation
        limit_heap_fragmentation()
        self.engine = Engine(config, model)
        if config.gpu_decode and not self.engine.cuda:  # (CUDA only: nothing of it on the CPU)
            config = replace(config, gpu_decode=False)
        self.config = config
        n = config.torch_threads or (1 if self.engine.cuda else None)
        if n is not None:
            torch.set_num_threads(n)
        use_procs = config.preprocess == "processes" or (config.preprocess == "auto" and self.engine.cuda)
        #: one decoder process per preprocess thread (config.preprocess), started once, reused by every run
        # more processes than cores cannot decode faster, and each holds ~0.5 GB (it imports torch)
        allow_pillow_pixels(config.max_image_pixels)
        self.decoders = self.gpu_decoders = None
        if use_procs:
            # by default one core is left to this process: its dispatcher, batcher, compute and decode
            # threads use about one, and one decoder process per core would slow the pipeline
            # (see docs/performance.md)
            n = min(config.threads, usable_cores()) if config.threads else max(1, usable_cores() - 1)
            n_gpu = config.gpu_decode_processes if self.engine.gpu_decoder is not None else 0
            # crop rows: one per item the window lets in, capped at twice what every batch in flight,
            # forming, and out at the GPU decoder processes needs (a larger max_in_flight keeps more
            # items queued ahead of the decoders, not more pinned memory than that)
            rows = min(
                config.in_flight_limit,
                2 * ((config.staging_slots + 3 + n_gpu * GPU_PROCESS_DEPTH) * config.max_batch_size + 2 * n),
            )
            self.decoders = DecoderPool(
                n,
                config.resize_size,
                config.crop_size,
                config.max_image_pixels,
                rows=rows,
                max_file_bytes=config.max_file_bytes,
            )
            try:
                self.engine.attach_crops(self.decoders.crops)
                if n_gpu:
                    from .gpu_decode_procs import GpuDecoderPool

                    try:
                        self.gpu_decoders = GpuDecoderPool(
                            n_gpu,
                            self.decoders.crops,
                            self.engine.device.index or 0,
                            config.resize_size,
                            config.crop_size,
                            config.max_image_pixels,
                            decoder=getattr(self.engine.gpu_decoder, "kind", "nvjpeg"),
                            max_file_bytes=config.max_file_bytes,
                        )
                    except RuntimeError as e:  # e.g. nvJPEG unavailable there: decode in this process
                        warnings.warn(
                            f"GPU decoder processes did not start ({e}); decoding on the GPU "
                            "from a thread of this process instead",
                            RuntimeWarning,
                            stacklevel=2,
                        )
            except BaseException:
                self.decoders.close()
                raise
        self.last_report: Report | None = None
        self.current_run: Run | None = None
        #: called with each batch's size as the batcher forms it (from the batcher's thread)
        self.on_batch = None
        self._busy = threading.Lock()

    @property
    def device(self):
        return self.engine.device

    def __enter__(self) -> Pipeline:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        """Stop the decoder processes and release the device buffers (the pipeline cannot be used
        afterwards)."""
        if self.gpu_decoders is not None:
            self.gpu_decoders.close()
        if self.decoders is not None:
            self.decoders.close()
        self.engine.slots.clear()

    def _begin(self, inputs: Iterable) -> Run:
        if isinstance(inputs, (str, bytes)) or hasattr(inputs, "__fspath__"):
            inputs = [inputs]
        if not isinstance(inputs, Iterable):  # (a clear error now, not a stage failure once running)
            what = (
                "an async iterable (iterate it yourself and pass a list or a plain generator)"
                if hasattr(inputs, "__aiter__")
                else type(inputs).__name__
            )
            raise TypeError(f"inputs must be an iterable of paths, URLs, bytes or (id, bytes) pairs, got {what}")
        if not self._busy.acquire(blocking=False):
            raise RuntimeError(
                "this Pipeline is already running a stream; finish it first (or build a second Pipeline)"
            )
        run = Run(self.engine, self.config, inputs, self.decoders, self.gpu_decoders)
        run.batcher.on_batch = self.on_batch
        self.current_run = run
        run.start()
        return run

    def _finish(self, run: Run) -> None:
        try:
            run.stop()
            self.last_report = run.report()
        finally:
            self._busy.release()

    def run(self, inputs: Iterable) -> Iterator[Result]:
        """Classify ``inputs`` and yield one :class:`~fullthrottle.decode.Result` per item.

        ``inputs``: paths, directories, globs, URLs, ``bytes``, or ``(id, bytes)`` pairs (see
        :func:`fullthrottle.load.expand`). Results come in input order unless ``ordered=False``.
        Breaking out of the loop (or Ctrl-C) stops every stage and joins its threads.

        Raises:
            PipelineError: a stage failed for a reason that belongs to no single item, or the
                ``inputs`` iterable raised (after every item it gave has been answered).
            TypeError: ``inputs`` is not iterable (an async iterable included).
        """
        run = self._begin(inputs)
        try:
            while not run.done:
                got = run.get_many(0.1)
                if got is None:
                    break
                yield from run.hand_out(got)
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
                if got is None:
                    break
                results = run.hand_out(got)
                try:
                    for r in results:
                        yield r
                finally:
                    results.close()  # (the permits of what was taken go back now, not at collection)
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
