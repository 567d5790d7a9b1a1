"""Where paths and bytes become crops on the CPU: the thread that keeps the CPU decoder processes busy.

:func:`feed_cpu_decoders` hands each item to a :class:`~fullthrottle.data.preprocess_procs.DecoderProcess`
(a file as its path, which the process reads; bytes in memory as they are), with up to
:data:`WORKER_DEPTH` images out per process, and routes JPEGs to the GPU decoders whenever no CPU
process is idle, or when JPEGs already keep :func:`cpu_jpeg_workers` of them busy. The processes
write the crops into the shared crop pool; this thread passes each item on with its pool row or its
error. Takes the :class:`~fullthrottle.workloads.classify.run.Run` it serves.
"""

from __future__ import annotations

import collections
import logging
import selectors
import time

from ..core import env
from ..core.config import usable_cores
from .gpu_feed import GPU_CHUNK
from .image_header import ImageError
from .load import LoadError, shown_path
from .worker_procs import WorkerDied

log = logging.getLogger(__name__)

#: images out at each decoder process at once (one decoding, the rest waiting in its socket), so
#: that a worker finishing an image finds the next one even when this process is slow to answer
#: (its threads take turns on the GIL). Images queue behind others only while their bytes fit in the
#: worker's socket buffer (``DecoderProcess.queue_bytes``): a send to a hung worker never blocks;
#: an image too large to queue waits for an idle worker
WORKER_DEPTH = 4


def cpu_jpeg_workers(workers: int, gpu_processes: int, cores: int | None = None) -> int:
    """How many of ``workers`` CPU decoder processes may decode JPEGs the GPU decoder processes could
    take: all of them without GPU decoder processes; else the cores left over by the
    ``gpu_processes`` and the main process (about two cores), at least one. Each GPU decoder process
    needs CPU to read its files and drive the GPU's decoders, and a CPU worker decoding a JPEG at
    about 250 img/s keeps a whole core from them; more CPU workers for JPEGs lowered the rate on
    640x480 files (see docs/performance.md). Other images (PNG,
    WebP, CMYK or EXIF-rotated JPEGs, ...) may use every worker. ``FULLTHROTTLE_CPU_JPEG_WORKERS``
    sets the count instead (trials); 0: every JPEG the GPU decoder processes can take goes to them.

    Raises:
        ValueError: ``FULLTHROTTLE_CPU_JPEG_WORKERS`` is set to anything but an integer >= 0."""
    if not gpu_processes:
        return workers
    env.check(env.CPU_JPEG_WORKERS)
    given = env.get(env.CPU_JPEG_WORKERS)
    if given:
        return min(workers, int(given))
    return max(1, min(workers, (cores or usable_cores()) - 2 - gpu_processes))


def feed_cpu_decoders(run, workers: list) -> None:
    """Transform with worker processes: this thread keeps ``workers`` (:class:`DecoderProcess`) busy.

    Each worker has up to :data:`WORKER_DEPTH` images out (the next one is already waiting in its
    socket when it finishes one, as a DataLoader's prefetch does); the thread waits on all their
    sockets at once (``multiprocessing.connection.wait``) and on the input queue, so it holds the
    GIL only for a few microseconds per image. A worker's replies come in the order it was sent
    images. A worker that dies or hangs (past ``decode_timeout_s``) costs the image it was on;
    the images queued behind it go to its replacement.
    """
    st, splitter = run.stats["preprocess"], run.engine.splitter
    timeout_s = run.config.decode_timeout_s
    crops = run.decoders.crops
    n = len(workers)
    pending = [collections.deque() for _ in range(n)]  # per worker: items sent, oldest first
    queued = [0] * n  # per worker: bytes of the items sent and not answered
    started = [0.0] * n  # when each worker began its oldest pending image
    places = n * WORKER_DEPTH  # images that may be out at the workers at once
    jpeg_cap = cpu_jpeg_workers(n, len(run.gpu_procs))

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
    take = run.loader.take
    gbuf: list = []  # images routed to the GPU decoders, handed over GPU_CHUNK at a time

    gq = run.gq

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
        while not run.stop_event.is_set():
            # hand out work while a worker or the GPU decoder has room. With the GPU decoder on,
            # routing follows availability: an eligible JPEG goes to the GPU when every CPU
            # worker is taken, so both decoders stay busy whatever their speeds (a split by
            # measured rates starves the GPU of batch size when it starts slow), or when JPEGs keep
            # jpeg_cap workers busy already: then it waits for the GPU's room rather than take a core
            # the GPU decoder processes need
            while (outstanding < places or gpu_room()) and (inbox or not ended):
                if outstanding and not crops.free_rows():  # backpressure: collect replies meanwhile
                    break
                if not inbox:  # the loader's next list of items
                    c = run._get(run.q1, None if outstanding or gbuf else 0.05)
                    if c is None:
                        break
                    if c is run.END:
                        ended = True
                        break
                    inbox.extend(take(c))
                    now = time.perf_counter()
                    st.waited(sum(now - it.t_queued for it in c) / len(c), len(c))
                over_cap = bool(run.gpu_procs) and n - idle >= jpeg_cap  # (JPEGs may busy no more)
                if (not idle or over_cap) and run.gpu_procs and gpu_room():
                    # every CPU worker busy, or as many as JPEGs may keep busy: the run of JPEGs at the
                    # inbox's head goes to the GPU at once (this thread's per-image cost bounds the
                    # whole pipeline)
                    k = 0
                    for it in inbox:
                        if not run._gpu_candidate(it):
                            break
                        k += 1
                    if k:
                        splitter.note(gpu=True, n=k)
                        gbuf += [inbox.popleft() for _ in range(k)]
                        if len(gbuf) >= GPU_CHUNK:
                            run._to_gpu(gbuf)
                            gbuf = []
                        continue
                it = inbox.popleft()
                if it.error is not None:
                    st.add(1, 0.0)
                    it.data = None
                    it.t_queued = time.perf_counter()
                    run._put(run.q2, it)
                    continue
                eligible = run.gq is not None and (run._gpu_candidate(it) if run.gpu_procs else run._gpu_eligible(it))
                # an image queues behind others only if it fits in the socket's buffer: a send
                # to a hung worker must never block this thread
                size = len(it.data) + 4
                w = pick(size)
                jpeg_waits = eligible and over_cap  # (for the GPU's room)
                if w is None or (eligible and (pending[w] or jpeg_waits) and (gpu_room() or jpeg_waits)):
                    if eligible and gpu_room():
                        splitter.note(gpu=True)
                        gbuf.append(it)
                        if len(gbuf) >= GPU_CHUNK:
                            run._to_gpu(gbuf)
                            gbuf = []
                        continue
                    if w is None or jpeg_waits:
                        inbox.appendleft(it)  # waits for a worker with room, or for the GPU's
                        break
                row = crops.acquire(run.stop_event.is_set)  # waits while the GPU holds all rows
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
                run._to_gpu(gbuf)
                gbuf = []
            if ended and not outstanding and not inbox:
                run._end_of_stream()
                return
            if not outstanding:
                continue
            ready = [key.data for key, _ in sel.select(0.002 if outstanding < places and not ended else 0.05)]
            now = time.perf_counter()
            stuck = [
                w
                for w in range(n)
                if pending[w]
                and w not in ready  # (a new worker's imports don't count)
                and now - max(started[w], workers[w].grace_until()) > timeout_s
            ]
            for w in ready + stuck:
                it = pending[w].popleft()
                idle += not pending[w]
                queued[w] -= len(it.data) + 4
                outstanding -= 1
                try:
                    if w not in stuck:
                        said = workers[w].receive()  # the crop is in crops.array[it.pool_row]
                        if said:  # (libjpeg's "Corrupt JPEG data: ...": the crop is what it could read)
                            log.warning("%s: decoded, with the decoder's warning: %s", shown_path(it.id), said)
                    else:  # a worker stuck on one image (a decoder hang) costs that image only
                        raise workers[w].kill(
                            f"decoding took longer than {timeout_s:g} s "
                            "(decode_timeout_s): its worker process was replaced"
                        )
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
                run._put(run.q2, it)
    finally:
        sel.close()
        for w in range(n):  # stopped mid-run: keep each worker's replies in step
            for _ in pending[w]:
                if workers[w].discard_reply():
                    break  # replaced: the new worker owes nothing
