"""The five stages wired together with bounded queues; the library's entry point.

::

    Loader (asyncio thread) -q1-> preprocess threads -q2-> Batcher thread -q3-> compute thread
        -q4-> decode thread -> reorder buffer -> your iterator (sync or async)
                  `-gq-> GPU decode thread -q2-^       (with gpu_decode: nvJPEG batches, own stream)

With ``preprocess="processes"`` (the default on CUDA) a dispatcher thread hands each image to a
worker process (:mod:`fullthrottle.preprocess_procs`), which writes the crop into shared pinned
memory; the dispatcher waits on the workers' sockets without the GIL.

Every queue is bounded, and a window of ``max_in_flight`` permits (taken when an item starts
loading, given back when you receive its result) bounds everything in between, the reorder buffer
included: memory stays flat however long the input stream is.
"""

from __future__ import annotations

import asyncio
import collections
import functools
import queue
import selectors
import threading
import time
import warnings
from collections.abc import AsyncIterator, Iterable, Iterator
from dataclasses import replace

import torch
from torch import nn

from .batch import Batch, Batcher
from .compute import Engine
from .config import Config, usable_cores
from .decode import Result
from .gpumon import GpuMonitor, nvtx_range
from .load import Item, LoadError, Loader
from .gpu_decode import gpu_eligible
from .preprocess import ImageError, allow_pillow_pixels, preprocess
from .gpu_decode_procs import DEPTH as GPU_DEPTH
from .preprocess_procs import PATH_BIT, STARTUP_S, DecoderPool, WorkerDied
from .report import Report, StageStats

_END = object()

#: threads feeding the decoder processes; None: one in all (each image costs it a few microseconds
#: of Python: a 5-byte header out, a 1-byte answer back; the pixels go through shared memory)
DISPATCH_THREADS: int | None = None
#: images out at each decoder process at once (one decoding, the rest waiting in its socket), so
#: that a worker finishing an image finds the next one even when this process is slow to answer
#: (its threads take turns on the GIL). Images queue behind others only while their bytes fit in the
#: worker's socket buffer (``DecoderProcess.queue_bytes``): a send to a hung worker never blocks;
#: an image too large to queue waits for an idle worker
WORKER_DEPTH = 4
#: with GPU decoding, images a CPU decoder process holds before an eligible JPEG goes to the GPU
#: instead (1: the GPU takes it unless the chosen worker is idle). 1: a deeper queue per CPU worker
#: gives no clear gain in throughput (see docs/performance.md)
GPU_SPILL_DEPTH = 1
#: images per hand-off on the GPU decode path (dispatcher -> GPU decoders -> batcher): each hand-off
#: between threads costs a queue operation and a GIL hand-off, so the GPU's images travel in lists
GPU_CHUNK = 32
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
            **({"gpu decode": StageStats("gpu decode", max(1, len(self.gpu_procs)))}
               if engine.gpu_decoder is not None else {}),
            "batch": StageStats("batch", 1),
            "compute": StageStats("compute", 1),
            "decode": StageStats("decode", 1),
        }
        # with decoder processes (and the GPU's JPEGs decoded in processes too) no file's bytes pass
        # through this process: the items carry paths, and the process each goes to reads it
        defer = decoders is not None and (engine.gpu_decoder is None or bool(self.gpu_procs))
        self.loader = Loader(inputs, self.q1, self._put, self.window, self.stop_event,
                             self.stats["load"], config.load_concurrency, config.http_timeout_s,
                             config.max_file_bytes, nthreads, _END, defer_files=defer)
        # With decoder processes, dispatcher threads feed them: by default one for all workers
        # (DISPATCH_THREADS). Fewer threads means fewer GIL hand-offs for the compute thread to wait in.
        if decoders is not None:
            n_pre = max(1, min(DISPATCH_THREADS or 1, len(decoders)))
        else:
            n_pre = nthreads
        self.n_pre = n_pre
        # lists of items and end markers: up to GPU_CHUNK items a list from the dispatcher (GPU decoder
        # processes), one item a list from the preprocess threads (the GPU decode thread)
        self.gq: queue.Queue | None = (queue.Queue(max(4, config.queue_size // GPU_CHUNK) if self.gpu_procs
                                                   else config.queue_size)
                                       if engine.gpu_decoder is not None else None)
        self._ends, self._ends_lock = 0, threading.Lock()
        self._inbox: collections.deque = collections.deque()  # preprocess threads: items taken from q1
        gpu_consumers = (max(1, len(self.gpu_procs))) if self.gq is not None else 0
        self.batcher = Batcher(lambda t: self._get(self.q2, t), lambda o, block=True: self._put(self.q3, o, block),
                               config.max_batch_size, config.max_wait_ms, n_pre + gpu_consumers, _END,
                               self.stats["batch"], self.stop_event.is_set,
                               lambda: engine.in_flight() >= 2)
        if decoders is not None:
            self.threads = [threading.Thread(target=self._guard(functools.partial(
                                self._dispatch_to_processes, list(decoders.workers)[i::n_pre])),
                                             name=f"ft-preprocess-dispatch-{i}", daemon=True)
                            for i in range(n_pre)]
        else:
            self.threads = [threading.Thread(target=self._guard(self._preprocess_worker),
                                             name=f"ft-preprocess-{i}", daemon=True) for i in range(nthreads)]
        if self.gpu_procs:
            self.threads += [threading.Thread(target=self._guard(functools.partial(self._gpu_process_feeder, p)),
                                              name=f"ft-gpu-decode-{i}", daemon=True)
                             for i, p in enumerate(self.gpu_procs)]
        elif self.gq is not None:
            self.threads.append(threading.Thread(target=self._guard(self._gpu_decode_worker),
                                                 name="ft-gpu-decode", daemon=True))
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
        return it.error is None and self.engine.gpu_decoder is not None and \
            gpu_eligible(it.data, self.config.max_image_pixels, self.config.resize_size)[0]

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

    def _take_gpu_batch(self, carry: list, limit: int, wait_s: float, ends_wanted: int,
                        block: bool = True) -> tuple[list, int]:
        """Up to ``limit`` items for one GPU batch: what ``carry`` holds first (left over from a list),
        then lists from the GPU queue, waiting at most ``wait_s`` after the first item (for the first,
        briefly, or not at all without ``block``). Items beyond ``limit`` stay in ``carry``. Returns
        ``(items, end markers seen)``; stops at ``ends_wanted`` ends."""
        items = carry[:limit]
        del carry[:limit]
        ends = 0
        deadline = time.perf_counter() + wait_s if items else None
        while len(items) < limit and ends < ends_wanted:
            # nothing yet: wait briefly (the caller checks the stop event and asks again)
            if deadline is None:
                c = self._get(self.gq) if block else self._get(self.gq, None)
            else:
                c = self._get(self.gq, max(deadline - time.perf_counter(), 0.0))
            if c is None:
                break
            if c is _END:
                ends += 1
                continue
            items.extend(c)
            if deadline is None:
                deadline = time.perf_counter() + wait_s
        if len(items) > limit:
            carry[:0] = items[limit:]
            del items[limit:]
        return items, ends

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

    def _gpu_decode_worker(self) -> None:
        """nvJPEG in batches on its own stream, ahead of the compute thread.

        Takes up to ``max_batch_size`` routed JPEGs at a time (waiting at most ``max_wait_ms`` for
        more), decodes, resizes and crops them as one batch (:func:`~fullthrottle.gpu_decode.decode_crops`),
        waits for that stream (the GIL is released meanwhile), and passes each item on with its device
        crop, or with the CPU path's crop or error for the images nvJPEG refused.
        """
        eng, cfg, st = self.engine, self.config, self.stats["gpu decode"]
        ends, limit, wait_s = 0, cfg.max_batch_size, cfg.max_wait_ms / 1e3
        carry: list = []
        while not self.stop_event.is_set() and (ends < self.n_pre or carry):
            items, e = self._take_gpu_batch(carry, limit, wait_s, self.n_pre - ends)
            ends += e
            if not items:
                continue
            st.begin()
            t0 = time.perf_counter()
            st.waited(sum(t0 - it.t_queued for it in items) / len(items), len(items))
            with nvtx_range(f"gpu decode {len(items)}"):
                if eng.cuda:
                    with torch.cuda.stream(eng.decode_stream):
                        crops = self._decode_crops(items)
                    eng.decode_stream.synchronize()  # rows complete before another stream reads them
                else:
                    crops = self._decode_crops(items)
            eng.splitter.record_gpu(len(items), time.perf_counter() - t0)
            for it, c in zip(items, crops):
                if isinstance(c, ImageError):
                    it.error = f"{it.id}: {c}"
                elif isinstance(c, tuple):
                    it.gpu_crop = c  # (rows, r): row r of the batch's device tensor
                else:
                    it.array = c
                it.data = None
            st.end(len(items))
            now = time.perf_counter()
            for it in items:
                it.t_queued = now
            self._put(self.q2, items)  # one hand-off for the batch
        self._put(self.q2, _END)

    def _gpu_process_feeder(self, proc) -> None:
        """Keeps one GPU decoder process (:class:`~fullthrottle.gpu_decode_procs.GpuDecoderProcess`)
        busy: takes up to ``max_batch_size`` routed JPEGs (waiting at most ``max_wait_ms`` for more),
        gives each a row of the shared crop pool and sends the batch, keeping up to ``proc.depth``
        batches at the process (the next one waits in its arena while it decodes one), and waits for
        each answer on the process's socket (without the GIL). Each image then travels on as a pooled
        crop, like the CPU decoder processes' ones, or with its error. Stops at its end marker.
        """
        cfg, st, crops = self.config, self.stats["gpu decode"], self.decoders.crops
        limit, wait_s = cfg.max_batch_size, cfg.max_wait_ms / 1e3
        ended, carry = False, []
        inflight: collections.deque = collections.deque()  # (items, rows, arena slot) sent, oldest first
        slots = list(range(proc.depth))
        try:
            while not self.stop_event.is_set() and (not ended or carry or inflight):
                while len(inflight) < proc.depth and (not ended or carry):  # fill the process's queue
                    items, e = self._take_gpu_batch(carry, limit, wait_s, 0 if ended else 1, block=not inflight)
                    ended = ended or e > 0
                    if not items:
                        break
                    k = proc.fitting(items)  # the images whose bytes fit in an arena slot
                    if k == 0 and inflight:  # inline on the socket: only to an idle process (a send to a
                        carry[:0] = items    # busy one could wait as long as it hangs)
                        break
                    if 0 < k < len(items):
                        carry[:0] = items[k:]
                        del items[k:]
                    rows = crops.acquire_many(len(items), self.stop_event.is_set)  # backpressure: consumed crops
                    if rows is None:
                        return
                    if not inflight:
                        st.begin()
                    t0 = time.perf_counter()
                    st.waited(sum(t0 - it.t_queued for it in items) / len(items), len(items))
                    slot = slots.pop()
                    queued = proc.send([(it.data, r | PATH_BIT if it.is_path else r) for it, r in zip(items, rows)], slot)
                    inflight.append((items, rows, slot))
                    if not queued:  # went inline on the socket: nothing may wait behind it
                        break
                if not inflight:
                    continue
                items, rows, slot = inflight.popleft()
                slots.append(slot)
                try:
                    answers = proc.receive(cfg.decode_timeout_s)
                except WorkerDied as e:  # the process died or hung on this batch (and was replaced):
                    for items2, rows2, slot2 in inflight:  # what waited behind it goes again, to the new one
                        crops.release(rows2)
                        carry[:0] = items2
                        slots.append(slot2)
                    inflight.clear()
                    answers = [str(e)] * len(items)
                    if len(items) > 1:  # one image at a time to the new one, so a culprit costs itself only
                        for k, (it, r) in enumerate(zip(items, rows)):
                            proc.send([(it.data, r | PATH_BIT if it.is_path else r)])
                            try:
                                answers[k] = proc.receive(cfg.decode_timeout_s)[0]
                            except WorkerDied as e1:
                                answers[k] = str(e1)
                for it, r, err in zip(items, rows, answers):
                    if err is None:
                        it.pool_row = r  # the crop is in crops.array[r]
                    else:  # (a LoadError names its file already)
                        it.error = str(err) if isinstance(err, LoadError) else f"{it.id}: {err}"
                        crops.release([r])
                    it.data = None
                st.end(len(items))
                if inflight:
                    st.begin()
                now = time.perf_counter()
                for it in items:
                    it.t_queued = now
                self._put(self.q2, items)  # one hand-off for the batch
        finally:
            if inflight:  # stopped with batches out: their answers must not reach the next run
                proc.discard_replies()
        self._put(self.q2, _END)

    @torch.inference_mode()
    def _decode_crops(self, items: list) -> list:
        from .gpu_decode import decode_crops

        cfg = self.config
        try:
            return decode_crops(self.engine.gpu_decoder, [it.data for it in items], cfg.resize_size,
                                cfg.crop_size, cfg.max_image_pixels, self.engine.device)
        except Exception as e:  # noqa: BLE001 - a failed batch fails its items, not the run
            return [ImageError(f"GPU decode failed: {type(e).__name__}: {e}")] * len(items)

    def _dispatch_to_processes(self, workers: list) -> None:
        """Transform with worker processes: this thread keeps ``workers`` (:class:`DecoderProcess`) busy.

        Each worker has up to :data:`WORKER_DEPTH` images out (the next one is already waiting in its
        socket when it finishes one, as a DataLoader's prefetch does); the thread waits on all their
        sockets at once (``multiprocessing.connection.wait``) and on the input queue, so it holds the
        GIL only for a few microseconds per image. A worker's replies come in the order it was sent
        images. A worker that dies or hangs (past ``decode_timeout_s``) costs the image it was on;
        the images queued behind it go to its replacement.
        """
        st, splitter = self.stats["preprocess"], self.engine.splitter
        timeout_s = self.config.decode_timeout_s
        crops = self.decoders.crops
        n = len(workers)
        pending = [collections.deque() for _ in range(n)]  # per worker: items sent, oldest first
        queued = [0] * n  # per worker: bytes of the items sent and not answered
        started = [0.0] * n  # when each worker began its oldest pending image
        places = n * WORKER_DEPTH  # images that may be out at the workers at once

        def pick(size: int):  # an idle worker first, else the shortest queue with room for the bytes
            best, best_k = None, WORKER_DEPTH
            for x in range(n):
                k = len(pending[x])
                if k == 0:
                    return x
                if k < best_k and queued[x] + size <= workers[x].queue_bytes:
                    best, best_k = x, k
            return best
        outstanding, busy_since = 0, 0.0
        idle = n  # workers with nothing out (kept as pending[w] empties and fills)
        ended = False
        inbox: collections.deque = collections.deque()  # items from the loader not yet handed out
        take = self.loader.take
        gbuf: list = []  # images routed to the GPU decoders, handed over GPU_CHUNK at a time

        gq = self.gq

        def gpu_room() -> bool:  # (the deque's length without the queue's lock: a hint, the put still waits)
            return gq is not None and len(gq.queue) < gq.maxsize

        def resend(w: int) -> None:  # the worker was replaced: its queued images go again
            started[w] = time.perf_counter()
            for it in pending[w]:
                workers[w].send(it.data, it.pool_row, it.is_path)

        # the sockets of the workers that owe replies, in one epoll set kept across waits
        # (multiprocessing.connection.wait builds a new poll set per call: 19 us for 16 sockets)
        sel = selectors.DefaultSelector()
        watched: dict[int, tuple] = {}  # worker -> (its connection, fd) registered in sel

        def watch(w: int) -> None:
            """Register w's current connection while it owes replies, and only then. Called right
            after every call that may replace w's process (and so close its socket)."""
            conn, cur = workers[w].conn, watched.get(w)
            if cur is not None and (cur[0] is not conn or not pending[w]):
                try:
                    sel.unregister(cur[1])
                except (KeyError, ValueError, OSError):
                    pass
                del watched[w]
                cur = None
            if cur is None and pending[w]:
                watched[w] = (conn, conn.fileno())
                sel.register(watched[w][1], selectors.EVENT_READ, w)

        try:
            while not self.stop_event.is_set():
                # hand out work while a worker or the GPU decoder has room. With the GPU decoder on,
                # routing follows availability: an eligible JPEG goes to the GPU when every CPU
                # worker is taken, so both decoders stay busy whatever their speeds (a split by
                # measured rates starves the GPU of batch size when it starts slow)
                while (outstanding < places or gpu_room()) and (inbox or not ended):
                    if outstanding and not crops.free_rows():  # backpressure: collect replies meanwhile
                        break
                    if not inbox:  # the loader's next list of items
                        c = self._get(self.q1, None if outstanding or gbuf else 0.05)
                        if c is None:
                            break
                        if c is _END:
                            ended = True
                            break
                        inbox.extend(take(c))
                        now = time.perf_counter()
                        st.waited(sum(now - it.t_queued for it in c) / len(c), len(c))
                    if self.gpu_procs and not idle and GPU_SPILL_DEPTH <= 1 and gpu_room():
                        # every CPU worker busy: the run of JPEGs at the inbox's head goes to the GPU
                        # at once (this thread's per-image cost bounds the whole pipeline)
                        k = 0
                        for it in inbox:
                            if not self._gpu_candidate(it):
                                break
                            k += 1
                        if k:
                            splitter.note(gpu=True, n=k)
                            gbuf += [inbox.popleft() for _ in range(k)]
                            if len(gbuf) >= GPU_CHUNK:
                                self._to_gpu(gbuf)
                                gbuf = []
                            continue
                    it = inbox.popleft()
                    if it.error is not None:
                        st.add(1, 0.0)
                        it.data = None
                        it.t_queued = time.perf_counter()
                        self._put(self.q2, it)
                        continue
                    eligible = self.gq is not None and (self._gpu_candidate(it) if self.gpu_procs
                                                        else self._gpu_eligible(it))
                    # an image queues behind others only if it fits in the socket's buffer: a send
                    # to a hung worker must never block this thread
                    size = len(it.data) + 4
                    w = pick(size)
                    if w is None or (eligible and len(pending[w]) >= GPU_SPILL_DEPTH and gpu_room()):
                        if eligible and gpu_room():
                            splitter.note(gpu=True)
                            gbuf.append(it)
                            if len(gbuf) >= GPU_CHUNK:
                                self._to_gpu(gbuf)
                                gbuf = []
                            continue
                        if w is None:
                            inbox.appendleft(it)  # waits for a worker with room
                            break
                    row = crops.acquire(self.stop_event.is_set)  # waits while the GPU holds all rows
                    if row is None:
                        break
                    if eligible:
                        splitter.note(gpu=False)
                    it.pool_row = row
                    now = time.perf_counter()
                    if not pending[w]:
                        started[w] = now
                        idle -= 1
                    if outstanding == 0:
                        busy_since = now
                    pending[w].append(it)
                    queued[w] += size
                    outstanding += 1
                    workers[w].send(it.data, row, it.is_path)
                    watch(w)
                if gbuf:  # the GPU's images so far go now, before this thread waits
                    self._to_gpu(gbuf)
                    gbuf = []
                if ended and not outstanding and not inbox:
                    self._end_of_stream()
                    return
                if not outstanding:
                    continue
                ready = [key.data for key, _ in sel.select(0.002 if outstanding < places and not ended else 0.05)]
                now = time.perf_counter()
                stuck = [w for w in range(n) if pending[w] and w not in ready  # (a new worker's imports don't count)
                         and now - max(started[w], workers[w].spawned + STARTUP_S) > timeout_s]
                for w in ready + stuck:
                    it = pending[w].popleft()
                    idle += not pending[w]
                    queued[w] -= len(it.data) + 4
                    outstanding -= 1
                    try:
                        if w not in stuck:
                            workers[w].receive()  # the crop is in crops.array[it.pool_row]
                        else:  # a worker stuck on one image (a decoder hang) costs that image only
                            raise workers[w].kill(f"decoding took longer than {timeout_s:g} s "
                                                  "(decode_timeout_s): its worker process was replaced")
                    except (ImageError, WorkerDied, LoadError) as e:  # worded like the thread path's errors
                        it.error = str(e) if isinstance(e, LoadError) else f"{it.id}: {e}"
                        crops.release([it.pool_row])
                        it.pool_row = -1
                        if isinstance(e, WorkerDied) and pending[w]:
                            resend(w)
                    watch(w)
                    now = time.perf_counter()
                    work = now - started[w]
                    started[w] = now  # the next queued image starts now
                    st.record(1, work, now - busy_since if outstanding == 0 else 0.0)
                    if outstanding == 0:
                        busy_since = now
                    it.data = None
                    it.t_queued = now
                    self._put(self.q2, it)
        finally:
            sel.close()
            for w in range(n):  # stopped mid-run: keep each worker's replies in step
                for _ in pending[w]:
                    if workers[w].discard_reply():
                        break  # replaced: the new worker owes nothing

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
                eng.submit(slot, [it.array for it in arrays], gpu_crops=[it.gpu_crop for it in on_gpu],
                           pool_rows=[it.pool_row for it in pooled])
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
                    out = [Result(it.index, it.id, error=f"{it.id}: {slot.error}",
                                  latency_ms=1e3 * (now - it.t_start)) for it in batch.items]
                else:  # positional: the per-image cost here is paid under the GIL
                    out = [Result(it.index, it.id, lab, ids, p, None, 1e3 * (now - it.t_start))
                           for it, lab, ids, p in zip(batch.items, eng.label_lists(idx), idx.tolist(), probs.tolist())]
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
                del self.latencies[len(self.latencies) - (len(results) - given):]

    def raise_source_error(self) -> None:
        """After the last result: if the inputs iterable raised, raise that now (every item it
        gave before is answered).

        Raises:
            PipelineError: naming the iterable's exception (chained to it).
        """
        e = self.loader.source_error
        if e is not None:
            raise PipelineError(f"the inputs iterable raised {type(e).__name__}: {e} (after "
                                f"{self.ok + self.failed} items, all answered)") from e

    def report(self) -> Report:
        wall = (self.t_end or time.perf_counter()) - self.t0
        eng = self.engine
        batches = self.batcher.batches
        return Report(
            items=self.ok + self.failed, ok=self.ok, failed=self.failed, wall_s=wall, latencies_ms=list(self.latencies),
            stages=[s.snapshot(wall) for s in self.stats.values()], batches=batches,
            mean_batch_size=self.batcher.batched_items / batches if batches else 0.0,
            device=str(eng.device), model=eng.model_name, dtype=str(eng.dtype).removeprefix("torch."),
            random_weights=eng.random_weights, gpu_util_pct=self.gpumon.mean_util_pct,
            gpu_mem_max_bytes=self.gpumon.max_mem_bytes,
            graphs=eng.runner.info.format() if eng.runner is not None and eng.runner.info else "",
            gpu_decode=self._gpu_decode_summary())

    def _gpu_decode_summary(self) -> str:
        """One line: which GPU JPEG decoder ran where, and the share of eligible JPEGs it decoded."""
        eng = self.engine
        if eng.gpu_decoder is None:
            return ""
        name = {"hardware": "the GPU's JPEG engines (nvImageCodec)", "nvjpeg": "nvJPEG (torchvision)"}.get(
            getattr(eng.gpu_decoder, "kind", None), type(eng.gpu_decoder).__name__)
        where = f"{len(self.gpu_procs)} GPU decoder processes" if self.gpu_procs else "a thread of this process"
        gpu, cpu = (eng.splitter.routed[k] - self._routed0[k] for k in ("gpu", "cpu"))
        share = f" ({gpu / (gpu + cpu):.0%})" if gpu + cpu else ""
        if not self.gpu_procs:
            return (f"GPU decode: {name} in {where}; {gpu} of {gpu + cpu} eligible JPEGs{share} sent there, "
                    "the rest decoded on the CPU")
        on_cpu = sum(p.times["cpu_decoded"] for p in self.gpu_procs) - self._gpu_cpu0
        from .mps import started_here

        mps = ("as clients of a CUDA MPS server" + (" started for this run" if started_here() else "")
               if self.gpu_mps else
               "time-slicing the GPU (no CUDA MPS server found: see the README's GPU JPEG decoding section)")
        return (f"GPU decode: {name} in {where}, {mps}; {gpu} of {gpu + cpu} JPEGs{share} sent there ({on_cpu} "
                "of them to those processes' CPU decoder: not for the GPU decoder or refused by it), the rest "
                "decoded by the CPU decoder processes")


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
            from .gpu_decode_procs import default_processes

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
            rows = min(config.in_flight_limit,
                       2 * ((config.staging_slots + 3 + n_gpu * GPU_DEPTH) * config.max_batch_size + 2 * n))
            self.decoders = DecoderPool(n, config.resize_size, config.crop_size, config.max_image_pixels,
                                        rows=rows, max_file_bytes=config.max_file_bytes)
            try:
                self.engine.attach_crops(self.decoders.crops)
                if n_gpu:
                    from .gpu_decode_procs import GpuDecoderPool

                    try:
                        self.gpu_decoders = GpuDecoderPool(
                            n_gpu, self.decoders.crops, self.engine.device.index or 0, config.resize_size,
                            config.crop_size, config.max_image_pixels, decoder=getattr(self.engine.gpu_decoder, "kind", "nvjpeg"),
                            max_file_bytes=config.max_file_bytes)
                    except RuntimeError as e:  # e.g. nvJPEG unavailable there: decode in this process
                        warnings.warn(f"GPU decoder processes did not start ({e}); decoding on the GPU "
                                      "from a thread of this process instead", RuntimeWarning, stacklevel=2)
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
            what = "an async iterable (iterate it yourself and pass a list or a plain generator)" if hasattr(
                inputs, "__aiter__") else type(inputs).__name__
            raise TypeError(f"inputs must be an iterable of paths, URLs, bytes or (id, bytes) pairs, got {what}")
        if not self._busy.acquire(blocking=False):
            raise RuntimeError("this Pipeline is already running a stream; finish it first "
                               "(or build a second Pipeline)")
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
