"""Between the server's handlers and the engines: the services that take requests from asyncio and
answer them from engine threads.

- :class:`BatchingService`: image requests join one :class:`~fullthrottle.workloads.classify.pipeline.Pipeline` stream
  (a bounded submission queue, a dispatcher thread resolving each request's future);
- :class:`CompletionService`: LLM completions, batched per decode loop, streamed token by token.

A full queue raises :class:`Overloaded` (the server answers 503).
"""

from __future__ import annotations

import asyncio
import itertools
import queue
import threading

from ..core.batch import RequestBatcher
from ..workloads.classify.decode import Result
from ..workloads.classify.pipeline import Pipeline


class Overloaded(RuntimeError):
    """The submission queue is full (HTTP 503)."""


class BatchingService:
    """One pipeline run fed by many concurrent callers; thread-safe, asyncio-friendly.

    Args:
        pipeline: a built :class:`~fullthrottle.workloads.classify.pipeline.Pipeline` (its config should have
            ``ordered=False``: results are routed by index, not order).
        max_queue: images waiting to enter the pipeline before :meth:`submit` refuses (503).
    """

    def __init__(self, pipeline: Pipeline, max_queue: int = 256):
        self.pipeline = pipeline
        self.q: queue.Queue = queue.Queue(max_queue)
        self._lock = threading.Lock()
        self._count = itertools.count()
        self._waiting: dict[int, tuple[asyncio.AbstractEventLoop, asyncio.Future]] = {}
        self._closing = threading.Event()
        self.error: BaseException | None = None
        self._results = pipeline.run(self._source())
        self._thread = threading.Thread(target=self._dispatch, name="ft-dispatch", daemon=True)
        self._thread.start()

    def _source(self):
        while True:
            try:
                yield self.q.get(timeout=0.05)
            except queue.Empty:
                if self._closing.is_set():
                    return

    def _dispatch(self) -> None:
        try:
            for r in self._results:
                with self._lock:
                    waiter = self._waiting.pop(r.index, None)
                if waiter is not None:
                    loop, fut = waiter
                    loop.call_soon_threadsafe(_resolve, fut, r)
        except BaseException as e:  # noqa: BLE001 - the pipeline died: fail every waiter
            self.error = e
            with self._lock:
                waiters, self._waiting = list(self._waiting.values()), {}
            for loop, fut in waiters:
                loop.call_soon_threadsafe(_fail, fut, e)

    def submit(self, item_id: str, data: bytes) -> asyncio.Future:
        """Queue one image; returns a future for its :class:`~fullthrottle.workloads.classify.decode.Result`.

        Raises:
            Overloaded: the queue is full. RuntimeError: the service is shutting down or failed.
        """
        if self._closing.is_set() or self.error is not None:
            raise RuntimeError(
                "the service is shutting down" if self.error is None else f"the pipeline failed: {self.error}"
            )
        loop = asyncio.get_running_loop()
        fut = loop.create_future()
        with self._lock:  # index order == queue order, as the loader enumerates the source
            idx = next(self._count)
            try:
                self.q.put_nowait((item_id, data))
            except queue.Full:
                self._count = itertools.count(idx)  # the index was not used
                raise Overloaded(f"queue full ({self.q.maxsize} images waiting)") from None
            self._waiting[idx] = (loop, fut)
        return fut

    def queued(self) -> int:
        """Images waiting to enter the pipeline."""
        return self.q.qsize()

    def pending(self) -> int:
        """Images submitted and not yet answered."""
        return len(self._waiting)

    def close(self, timeout: float = 30.0) -> None:
        """Let queued and in-flight images finish, then stop the pipeline run and its decoder processes."""
        self._closing.set()
        self._thread.join(timeout)
        self._results.close()
        self.pipeline.close()


class CompletionService:
    """LLM requests batched across callers: a thread takes up to ``max_batch`` waiting requests and
    runs them as one :meth:`~fullthrottle.workloads.llm.generate.Generator.generate` call (per-row sampling values),
    streaming each request's tokens to its asyncio queue as chunks arrive."""

    def __init__(self, generator, tokenizer=None, max_queue: int = 256):
        self.gen, self.tok = generator, tokenizer
        self.q: queue.Queue = queue.Queue(max_queue)
        self.batcher = RequestBatcher(self.q, generator.max_batch)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="ft-llm", daemon=True)
        self._thread.start()

    def submit(self, req: dict) -> asyncio.Queue:
        """Queue ``req`` (ids, max_tokens, temperature, top_k, top_p, eos); returns the queue that
        receives lists of new token ids, then None at the end (or an Exception). Setting
        ``req["cancelled"] = True`` (the client disconnected) stops its tokens, and the whole batch
        once no request in it is still wanted."""
        loop = asyncio.get_running_loop()
        out: asyncio.Queue = asyncio.Queue()
        try:
            self.q.put_nowait((req, loop, out))
        except queue.Full:
            raise Overloaded(f"queue full ({self.q.maxsize} requests waiting)") from None
        return out

    def _loop(self) -> None:
        while not self._stop.is_set():
            batch = self.batcher.next()
            if not batch:
                continue
            reqs = [b[0] for b in batch]
            eos = reqs[0]["eos"]
            done = [False] * len(batch)

            def on_tokens(chunks):
                for i, ((_, loop, out), toks) in enumerate(zip(batch, chunks)):
                    if reqs[i].get("cancelled"):  # its client went away
                        done[i] = True
                    if done[i]:
                        continue
                    toks = toks[: reqs[i]["max_tokens"] - reqs[i].setdefault("sent", 0)]
                    if eos is not None and eos in toks:
                        toks, done[i] = toks[: toks.index(eos) + 1], True
                    reqs[i]["sent"] += len(toks)
                    if reqs[i]["sent"] >= reqs[i]["max_tokens"]:
                        done[i] = True
                    if toks:
                        loop.call_soon_threadsafe(out.put_nowait, toks)
                return all(done)  # nobody is waiting for more: stop the batch

            try:
                self.gen.generate(
                    [r["ids"] for r in reqs],
                    max(r["max_tokens"] for r in reqs),
                    [r["temperature"] for r in reqs],
                    [r["top_k"] for r in reqs],
                    [r["top_p"] for r in reqs],
                    seed=reqs[0].get("seed"),
                    eos_id=eos,
                    on_tokens=on_tokens,
                )
                for _, loop, out in batch:
                    loop.call_soon_threadsafe(out.put_nowait, None)
            except Exception as e:  # noqa: BLE001 - every request in the batch gets the error
                for _, loop, out in batch:
                    loop.call_soon_threadsafe(out.put_nowait, e)

    def close(self) -> None:
        self._stop.set()
        self._thread.join(5)


def _resolve(fut: asyncio.Future, r: Result) -> None:
    if not fut.done():
        fut.set_result(r)


def _fail(fut: asyncio.Future, e: BaseException) -> None:
    if not fut.done():
        fut.set_exception(RuntimeError(f"pipeline failed: {e}"))
