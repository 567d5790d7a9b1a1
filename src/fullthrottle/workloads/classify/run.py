"""One pass of an input stream through the five stages: the stages' threads and queues, and the results
handed out in order (internal: :meth:`fullthrottle.workloads.classify.pipeline.Pipeline.run` makes one per call).

::

    Loader (asyncio thread) -q1-> preprocess -q2-> Batcher thread -q3-> compute thread
        -q4-> decode thread -> reorder buffer -> the caller's iterator

Preprocess is threads of this process (:mod:`fullthrottle.workloads.classify.stage_threads`, with the compute and decode
threads), or one dispatcher thread feeding the decoder processes (:mod:`fullthrottle.data.cpu_feed`) and
feeders for the GPU decoder processes (:mod:`fullthrottle.data.gpu_feed`).
Every queue is bounded, and a window of ``max_in_flight`` permits (taken when an item starts
loading, given back when its result is consumed) bounds everything in between.
"""

from __future__ import annotations

import collections
import functools
import queue
import threading
import time
from collections.abc import Iterable, Iterator

import torch

from ...core.batch import Batcher
from ...core.config import Config
from ...core.gpumon import GpuMonitor
from ...core.latency import LatencyHistogram
from ...core.permits import Permits
from ...core.report import Report, StageStats
from ...data.cpu_feed import feed_cpu_decoders
from ...data.gpu_decode import gpu_eligible
from ...data.gpu_feed import GPU_CHUNK, feed_gpu_process, gpu_decode_thread
from ...data.image_header import ImageError
from ...data.load import Item, Loader
from .compute import Engine
from .result import Result
from .run_report import run_report
from .stage_threads import compute_thread, decode_thread, preprocess_thread

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

    def __init__(self, engine: Engine, config: Config, inputs: Iterable, decoders=None, gpu_decoders=None, drop=None):
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
        # bounded by the window; taken from by the caller's thread, where a Ctrl-C lands: get() is one
        # C call (queue.Queue's Python-level Condition could be left locked, or unlocked twice)
        self.out: queue.SimpleQueue = queue.SimpleQueue()
        self.window = Permits(config.in_flight_limit)
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
            drop=drop,
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
                threading.Thread(
                    target=self._guard(functools.partial(preprocess_thread, self)),
                    name=f"ft-preprocess-{i}",
                    daemon=True,
                )
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
            threading.Thread(
                target=self._guard(functools.partial(compute_thread, self)), name="ft-compute", daemon=True
            ),
            threading.Thread(target=self._guard(functools.partial(decode_thread, self)), name="ft-decode", daemon=True),
        ]
        self.latencies = LatencyHistogram()  # (constant memory: a server's run never ends)
        self.gpumon = GpuMonitor((engine.device.index or 0) if engine.cuda else None)
        self.t0 = 0.0
        self.t_end = 0.0
        self.cpu0 = self.cpu_end = 0.0  # this process's CPU time (all its threads) at start and end
        self.done = False
        self.closed_early = False  # (set by Pipeline.close while the stream runs: its reader must raise)
        self.handed_out = False  # (set once its reader is done with the stream: ended, broken off or failed)

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
        self.cpu0 = time.process_time()
        self.loader.start()
        for t in self.threads:
            t.start()

    def stop(self, timeout: float = 10.0) -> None:
        """Stop every stage and join its thread (at most ``timeout`` seconds in all). The load stage's
        thread is not waited for while it waits in the inputs iterable (a generator waiting for its
        next item: it ends when that item comes), nor is the calling thread (a ``drop`` callback or
        the inputs iterable that closed the Pipeline)."""
        self.stop_event.set()
        self.gpumon.__exit__(None, None, None)
        deadline = time.perf_counter() + timeout
        me = threading.current_thread()
        for t in [self.loader.thread, *self.threads]:
            if t is me or (t is self.loader.thread and self.loader.in_source):
                continue
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
        return it.error is None and it.data[:3] == b"\xff\xd8\xff"  # (bytes, or a memoryview: no startswith)

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
        from ...data.gpu_decode import decode_crops

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
        self.latencies.add([r.latency_ms for r in out])
        if finished:
            self.done = True
            self.t_end = time.perf_counter()
            self.cpu_end = time.process_time()
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
                self.latencies.remove([r.latency_ms for r in results[given:]])

    def raise_source_error(self) -> None:
        """After the last result: if the inputs iterable raised, raise that now (every item it
        gave before is answered): an ``Exception`` as a PipelineError naming it (chained to it),
        KeyboardInterrupt or SystemExit as it is."""
        e = self.loader.source_error
        if e is not None and not isinstance(e, Exception):  # (a Ctrl-C in the generator stays one)
            raise e
        if e is not None:
            n = self.ok + self.failed
            raise PipelineError(
                f"the inputs iterable raised {type(e).__name__}{f': {e}' if str(e) else ''} (after "
                f"{n} item{'s' * (n != 1)}, all answered)"
            ) from e

    def report(self) -> Report:
        """What the run did so far (:func:`~fullthrottle.workloads.classify.run_report.run_report`)."""
        return run_report(self)
