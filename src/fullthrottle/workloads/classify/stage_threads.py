"""The threads of the stages that run in this process, each a function of the
:class:`~fullthrottle.workloads.classify.run.Run` it serves: the preprocess threads (decoding here, without decoder
processes), the compute thread and the decode thread (results, in order)."""

from __future__ import annotations

import time

import numpy as np

from ...core.batch import Batch
from ...core.gpumon import nvtx_range
from ...data.load import DROPPED, Item
from ...data.preprocess import ImageError, preprocess
from .result import Result


def preprocess_thread(run) -> None:
    """A preprocess thread (decoding in this process): items from the loader's queue, each decoded,
    resized and cropped (:func:`~fullthrottle.data.preprocess.preprocess`) or routed to the GPU decoder;
    its error kept on the item. Ends at the end marker."""
    cfg, st = run.config, run.stats["preprocess"]
    gpu, splitter = run.engine.gpu_decoder, run.engine.splitter
    inbox = run._inbox  # the rest of a list from the loader, for any preprocess thread to take
    while not run.stop_event.is_set():
        try:
            it = inbox.popleft()
        except IndexError:
            c = run._get(run.q1)
            if c is None:
                continue
            if c is run.END:  # (its list's other items are in the inbox: whoever took one drains it)
                run._end_of_stream()
                return
            c = run.loader.take(c)
            it = c[0]
            inbox.extend(c[1:])
        if run._route_to_gpu(it):
            continue
        st.begin()
        st.waited(time.perf_counter() - it.t_queued)
        if it.error is None:
            t0 = time.perf_counter()
            try:
                with nvtx_range("preprocess"):
                    it.array = preprocess(
                        it.data, cfg.resize_size, cfg.crop_size, cfg.max_image_pixels, cfg.interpolation
                    )
            except ImageError as e:
                it.error = f"{it.id}: {e}"
            except Exception as e:  # noqa: BLE001 - a decoder crash belongs to this item
                it.error = f"{it.id}: cannot decode image: {type(e).__name__}: {e}"
            if gpu is not None:
                splitter.record_cpu(1, time.perf_counter() - t0)
        it.data = None
        st.end(1)
        it.t_queued = time.perf_counter()
        run._put(run.q2, it)


def compute_thread(run) -> None:
    """The compute thread: each batch's crops into a staging slot and onto the device, the graph (or
    the model) launched (:meth:`~fullthrottle.workloads.classify.compute.Engine.submit`); failed items passed on."""
    st, eng = run.stats["compute"], run.engine
    while not run.stop_event.is_set():
        obj = run._get(run.q3)
        if obj is None:
            continue
        if obj is run.END:
            run._put(run.q4, run.END)
            return
        if isinstance(obj, Item):  # an item that failed earlier: pass it on
            run._put(run.q4, obj)
            continue
        if run.loader.drop is not None:
            obj.items = _drop_decoded(run, obj.items)
            if not obj.items:
                continue
        st.waited(time.perf_counter() - obj.t_queued, len(obj))
        slot = eng.acquire(run.stop_event.is_set)
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
        run._put(run.q4, (obj, slot, time.perf_counter()))


def _drop_decoded(run, items: list) -> list:
    """The items of a batch that the run's ``drop`` keeps; the others end here, decoded but not
    computed, with the error :data:`~fullthrottle.data.load.DROPPED` (their crops let go)."""
    keep = []
    for it in items:
        if not run.loader.drop(it.index):
            keep.append(it)
            continue
        if it.pool_row >= 0:
            run.engine.crops.release([it.pool_row])
            it.pool_row = -1
        it.array = it.data = it.gpu_crop = None
        it.error = DROPPED
        run._put(run.q4, it)
    return keep


def decode_thread(run) -> None:
    """The decode thread: waits for each batch's top-k, makes its :class:`~fullthrottle.workloads.classify.decode.Result`
    objects and hands them out, in input order when the config says so (a reorder buffer)."""
    st, eng = run.stats["decode"], run.engine
    pending: dict[int, Result] = {}
    next_index = 0
    ordered = run.config.ordered
    while not run.stop_event.is_set():
        obj = run._get(run.q4)
        if obj is None:
            continue
        if obj is run.END:
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
                    for it, lab, ids, p in zip(batch.items, eng.class_labels.lists(idx), idx.tolist(), probs.tolist())
                ]
                if not np.isfinite(probs).all():  # NaN/Inf logits: the model's fault, per item
                    for r, bad in zip(out, ~np.isfinite(probs).all(axis=1)):
                        if bad:
                            r.labels, r.class_ids, r.probs = [], [], []
                            r.error = f"{r.id}: model output is not finite (NaN or Inf in its logits)"
                for i, why in (slot.row_errors or {}).items():  # the rows the model failed on, alone
                    out[i].labels, out[i].class_ids, out[i].probs = [], [], []
                    out[i].error = f"{out[i].id}: {why}"
            eng.release(slot)
            st.end(len(batch))
        if isinstance(obj, Item):
            out[0].latency_ms = 1e3 * (time.perf_counter() - obj.t_start)
        if not ordered:
            run.out.put(out)  # a batch's results in one hand-off
            continue
        for r in out:
            pending[r.index] = r
        ready = []
        while next_index in pending:
            ready.append(pending.pop(next_index))
            next_index += 1
        if ready:
            run.out.put(ready)
    if pending:  # only reached when the stream ended: nothing is missing
        run.out.put([pending.pop(i) for i in sorted(pending)])
    run.out.put(run.END)
