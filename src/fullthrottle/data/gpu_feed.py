"""Where JPEGs become crops on the GPU: the pipeline's side of GPU decoding.

- :func:`feed_gpu_process`, one thread per GPU decoder process
  (:class:`~fullthrottle.data.gpu_decode_procs.GpuDecoderProcess`): batches of routed items (file paths,
  or bytes already in memory) out, statuses back; the crops land in the shared crop pool;
- :func:`gpu_decode_thread`: without GPU decoder processes, one thread of this process decodes the
  routed JPEGs in batches on its own stream (the device crops travel with the items);
- :func:`take_gpu_batch`: how both form a batch from the GPU queue (``Run.gq``).

Each function takes the :class:`~fullthrottle.workloads.classify.run.Run` it serves.
"""

from __future__ import annotations

import collections
import time

import torch

from ..core.batch import OpenBatch
from ..core.gpumon import nvtx_range
from .image_header import ImageError
from .load import LoadError
from .worker_procs import PATH_BIT, WorkerDied

#: images per hand-off on the GPU decode path (dispatcher -> GPU decoders -> batcher): each hand-off
#: between threads costs a queue operation and a GIL hand-off, so the GPU's images travel in lists
GPU_CHUNK = 32


def take_gpu_batch(
    run, carry: list, limit: int, wait_s: float, ends_wanted: int, block: bool = True
) -> tuple[list, int]:
    """Up to ``limit`` items for one GPU batch: what ``carry`` holds first (left over from a list),
    then lists from the GPU queue, waiting at most ``wait_s`` after the first item (for the first,
    briefly, or not at all without ``block``). Items beyond ``limit`` stay in ``carry``. Returns
    ``(items, end markers seen)``; stops at ``ends_wanted`` ends."""
    b = OpenBatch(limit, None, wait_s)
    carry[:] = b.extend(carry)
    ends = 0
    while not b.full and ends < ends_wanted:
        # nothing yet: wait briefly (the caller checks the stop event and asks again)
        if not b:
            c = run._get(run.gq) if block else run._get(run.gq, None)
        else:
            c = run._get(run.gq, b.wait_s())
        if c is None:
            break
        if c is run.END:
            ends += 1
            continue
        carry[:0] = b.extend(c)
    items = b.take()
    return items, ends


def gpu_decode_thread(run) -> None:
    """nvJPEG in batches on its own stream, ahead of the compute thread.

    Takes up to ``max_batch_size`` routed JPEGs at a time (waiting at most ``max_wait_ms`` for
    more), decodes, resizes and crops them as one batch (:func:`~fullthrottle.data.gpu_decode.decode_crops`),
    waits for that stream (the GIL is released meanwhile), and passes each item on with its device
    crop, or with the CPU path's crop or error for the images nvJPEG refused.
    """
    eng, cfg, st = run.engine, run.config, run.stats["gpu decode"]
    ends, limit, wait_s = 0, cfg.max_batch_size, cfg.max_wait_ms / 1e3
    carry: list = []
    while not run.stop_event.is_set() and (ends < run.n_pre or carry):
        items, e = take_gpu_batch(run, carry, limit, wait_s, run.n_pre - ends)
        ends += e
        if not items:
            continue
        st.begin()
        t0 = time.perf_counter()
        st.waited(sum(t0 - it.t_queued for it in items) / len(items), len(items))
        with nvtx_range(f"gpu decode {len(items)}"):
            if eng.cuda:
                with torch.cuda.stream(eng.decode_stream):
                    crops = run._decode_crops(items)
                eng.decode_stream.synchronize()  # rows complete before another stream reads them
            else:
                crops = run._decode_crops(items)
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
        run._put(run.q2, items)  # one hand-off for the batch
    run._put(run.q2, run.END)


def feed_gpu_process(run, proc) -> None:
    """Keeps one GPU decoder process (:class:`~fullthrottle.data.gpu_decode_procs.GpuDecoderProcess`)
    busy: takes up to ``max_batch_size`` routed JPEGs (waiting at most ``max_wait_ms`` for more),
    gives each a row of the shared crop pool and sends the batch, keeping up to ``proc.depth``
    batches at the process (the next one waits in its arena while it decodes one), and waits for
    each answer on the process's socket (without the GIL). Each image then travels on as a pooled
    crop, like the CPU decoder processes' ones, or with its error. Stops at its end marker.
    """
    cfg, st, crops = run.config, run.stats["gpu decode"], run.decoders.crops
    limit, wait_s = cfg.max_batch_size, cfg.max_wait_ms / 1e3
    ended, carry = False, []
    inflight: collections.deque = collections.deque()  # (items, rows, arena slot) sent, oldest first
    slots = list(range(proc.depth))
    try:
        while not run.stop_event.is_set() and (not ended or carry or inflight):
            while len(inflight) < proc.depth and (not ended or carry):  # fill the process's queue
                items, e = take_gpu_batch(run, carry, limit, wait_s, 0 if ended else 1, block=not inflight)
                ended = ended or e > 0
                if not items:
                    break
                k = proc.fitting(items)  # the images whose bytes fit in an arena slot
                if k == 0 and inflight:  # inline on the socket: only to an idle process (a send to a
                    carry[:0] = items  # busy one could wait as long as it hangs)
                    break
                if 0 < k < len(items):
                    carry[:0] = items[k:]
                    del items[k:]
                rows = crops.acquire_many(len(items), run.stop_event.is_set)  # backpressure: consumed crops
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
            run._put(run.q2, items)  # one hand-off for the batch
    finally:
        if inflight:  # stopped with batches out: their answers must not reach the next run
            proc.discard_replies()
    run._put(run.q2, run.END)
