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
import logging
import queue
import threading

from ..core.errors import Overloaded
from ..workloads.classify.pipeline import Pipeline
from ..workloads.classify.result import Result

#: the queue may hold this many times ``max_queue`` images counting those whose callers left
CANCELLED_QUEUE_FACTOR = 8


log = logging.getLogger("fullthrottle.server.llm")


class BatchingService:
    """One pipeline run fed by many concurrent callers; thread-safe, asyncio-friendly.

    Args:
        pipeline: a built :class:`~fullthrottle.workloads.classify.pipeline.Pipeline` (its config should have
            ``ordered=False``: results are routed by index, not order).
        max_queue: images waiting to enter the pipeline before :meth:`submit` refuses (503).
    """

    def __init__(self, pipeline: Pipeline, max_queue: int = 256):
        self.pipeline, self.max_queue = pipeline, max_queue
        self.q: queue.Queue = queue.Queue()  # (bounded by submit_cb: its cancelled images do not count)
        self._lock = threading.Lock()
        self._count = itertools.count()
        self._waiting: dict[int, object] = {}  # index -> its callback (a Result, or the pipeline's error)
        self._cancelled: set[int] = set()  # indexes whose callers left, until their results come out
        self._taken = 0  # images the pipeline has taken from the queue (their indexes are below it)
        self._queued: dict[int, list] = {}  # index -> its [id, bytes] entry, while in the queue
        self._cancelled_queued = 0  # of _cancelled, those still in the queue (their bytes let go)
        self._closing = threading.Event()
        self.error: BaseException | None = None
        #: called (no arguments, on the pipeline's load thread) after the pipeline takes an image from
        #: the queue: the multi-process server's engine tells its HTTP workers the queue's new depth
        self.on_take = None
        # (a cancelled image leaves the load stage undecoded: the pipeline drops it)
        self._results = pipeline.run(self._source(), drop=self._cancelled.__contains__)
        self._thread = threading.Thread(target=self._dispatch, name="ft-dispatch", daemon=True)
        self._thread.start()

    def _source(self):
        while True:
            try:
                item = self.q.get(timeout=0.05)
            except queue.Empty:
                run = self.pipeline.current_run  # (stopped: a stage failed; its loader waits for this to end)
                if self._closing.is_set() or (run is not None and run.stop_event.is_set()):
                    return
                continue
            with self._lock:
                self._queued.pop(self._taken, None)
                self._cancelled_queued -= self._taken in self._cancelled
                self._taken += 1
            if self.on_take is not None:
                self.on_take()
            yield item[0], item[1]

    def _dispatch(self) -> None:
        try:
            for r in self._results:
                with self._lock:
                    done = self._waiting.pop(r.index, None)
                    self._cancelled.discard(r.index)
                if done is not None:
                    done(r)
        except BaseException as e:  # noqa: BLE001 - the pipeline died: fail every waiter
            self.error = e
            with self._lock:
                waiters, self._waiting = list(self._waiting.values()), {}
            for done in waiters:
                done(RuntimeError(f"pipeline failed: {e}"))

    def submit(self, item_id: str, data: bytes) -> asyncio.Future:
        """Queue one image; returns a future for its :class:`~fullthrottle.workloads.classify.decode.Result`.

        Raises:
            Overloaded: the queue is full. RuntimeError: the service is shutting down or failed.
        """
        loop = asyncio.get_running_loop()
        fut = loop.create_future()
        idx = self.submit_cb(item_id, data, lambda r: loop.call_soon_threadsafe(_settle, fut, r))
        fut.add_done_callback(lambda f: self.cancel([idx]) if f.cancelled() else None)  # (a caller that left)
        return fut

    def submit_cb(self, item_id: str, data: bytes, done) -> int:
        """Queue one image; ``done(result)`` is called from the service's dispatcher thread with its
        :class:`~fullthrottle.workloads.classify.decode.Result`, or with a ``RuntimeError`` if the
        pipeline fails. ``done`` must return quickly (it holds up the other results). Returns the
        image's index (for :meth:`cancel`).

        Raises:
            Overloaded: the queue is full. RuntimeError: the service is shutting down or failed.
        """
        if self._closing.is_set() or self.error is not None:
            raise RuntimeError(
                "the service is shutting down" if self.error is None else f"the pipeline failed: {self.error}"
            )
        with self._lock:  # index order == queue order, as the loader enumerates the source
            # (cancelled images hold no place, only a few bytes each, up to a bound of their own)
            waiting = self.q.qsize() - self._cancelled_queued
            if waiting >= self.max_queue or self.q.qsize() >= CANCELLED_QUEUE_FACTOR * self.max_queue:
                raise Overloaded(f"queue full ({self.max_queue} images waiting)")
            idx = next(self._count)
            entry = self._queued[idx] = [item_id, data]
            self.q.put_nowait(entry)
            self._waiting[idx] = done
        return idx

    def cancel(self, indexes) -> None:
        """Forget the images of these indexes (their caller left): no callback for them, no place in
        the queue, and no decoding unless it has begun (those then run on, unanswered)."""
        with self._lock:
            for idx in indexes:
                if self._waiting.pop(idx, None) is not None:
                    self._cancelled.add(idx)
                    entry = self._queued.pop(idx, None)
                    if entry is not None:  # still queued: its bytes go now (it leaves as an error item)
                        entry[1] = None
                        self._cancelled_queued += 1

    def queued(self) -> int:
        """Images waiting to enter the pipeline (their callers still waiting)."""
        return max(0, self.q.qsize() - self._cancelled_queued)

    def pending(self) -> int:
        """Images submitted and not yet answered."""
        return len(self._waiting)

    def close(self, timeout: float = 30.0) -> None:
        """Let queued and in-flight images finish, then stop the pipeline run and its decoder processes."""
        self._closing.set()
        self._thread.join(timeout)
        self._results.close()
        self.pipeline.close()


class TokenChunk(list):
    """New token ids of one request, as :class:`CompletionService` streams them; ``logprobs``: per
    token, (its log-probability, the top ids, their log-probabilities), when the request asked."""

    logprobs: list | None = None


class CompletionService:
    """LLM requests with continuous batching (:class:`~fullthrottle.workloads.llm.scheduler.Scheduler`):
    a thread runs the step loop; a request joins at the next step with a free KV-cache row and leaves
    at its end; its first token goes to its asyncio queue as soon as it is made, then every
    ``generator.check_every`` tokens.
    Requests beyond the free rows wait in the scheduler (up to one batch) and then in the queue
    (``max_queue``: past it, :meth:`submit` raises Overloaded). ``tokenizer``: an
    :class:`~fullthrottle.workloads.llm.text.LlmText` or None (token ids only); ``name``: the model's
    name in the API's answers."""

    def __init__(self, generator, tokenizer=None, max_queue: int = 256, name: str = "llm"):
        self.gen, self.tok, self.name = generator, tokenizer, name
        self.q: queue.Queue = queue.Queue(max_queue)
        #: requests waiting for a KV-cache row (in the queue and the scheduler), and running (/metrics)
        self.waiting = self.running = 0
        self.preempted = self._preempted_before = 0  # requests preempted for KV pages so far (/metrics)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="ft-llm", daemon=True)
        self._thread.start()

    def submit(self, req: dict) -> asyncio.Queue:
        """Queue ``req`` (ids, max_tokens, temperature, top_k, top_p, stop_ids, seed, logprobs); returns the
        queue that receives :class:`TokenChunk` lists of new token ids, then None at the end (or an
        Exception). Setting
        ``req["cancelled"] = True`` (the client disconnected) frees its row at the next step.
        With a ``seed``, a sampled request's tokens are the same whatever runs beside it."""
        loop = asyncio.get_running_loop()
        out: asyncio.Queue = asyncio.Queue()
        try:
            self.q.put_nowait((req, loop, out))
        except queue.Full:
            raise Overloaded(f"queue full ({self.q.maxsize} requests waiting)") from None
        return out

    def _loop(self) -> None:
        from ..workloads.llm.scheduler import Scheduler

        sched, live = None, {}  # live: scheduler record -> [req, loop, out, tokens sent]
        every = max(1, self.gen.check_every)

        def first_tokens() -> None:  # (a step's prefill made them: out before its decode)
            self._gauges(sched)
            self._send(live, every)

        while not self._stop.is_set():
            idle = sched is None or not sched.busy
            while sched is None or len(sched.waiting) < self.gen.max_batch:  # take what has arrived
                try:
                    req, loop, out = self.q.get(timeout=0.05) if idle else self.q.get_nowait()
                except queue.Empty:
                    break
                idle = False
                try:
                    if sched is None:  # (each request ends at its own stop_ids)
                        sched = Scheduler(self.gen, on_first=first_tokens)
                    rec = sched.submit(
                        req["ids"],
                        req["max_tokens"],
                        req["temperature"],
                        req["top_k"],
                        req["top_p"],
                        req.get("seed"),
                        req.get("logprobs"),
                        req.get("stop_ids", ()),
                    )
                except ValueError as e:  # (the route checks first: a caller of submit's own, or a bad eos id)
                    loop.call_soon_threadsafe(out.put_nowait, e)
                    continue
                live[rec] = [req, loop, out, 0]
            if sched is not None:
                self._gauges(sched)
            if sched is None or not sched.busy:
                continue
            try:
                for rec, (req, _, _, _) in live.items():
                    if req.get("cancelled"):
                        sched.cancel(rec)
                sched.step()
                self._gauges(sched)  # (before the answers go out: the requests the step ended are gone)
            except Exception as e:  # noqa: BLE001 - every request running gets the error; a fresh engine state
                n = len(live)
                log.exception("the LLM step failed: the error goes to its %d request%s", n, "s" * (n != 1))
                for _, loop, out, _ in live.values():
                    loop.call_soon_threadsafe(out.put_nowait, e)
                live, sched, self._preempted_before = {}, None, self.preempted
                continue
            self._send(live, every)

    @staticmethod
    def _send(live: dict, every: int) -> None:
        """Each live request's new tokens to its queue: the first at once (after the prefill that made
        it: time to first token), then every ``every`` tokens, the rest at its end (then None). One
        call into each event loop a step, with every item for its queues (a call per request woke
        the loop, and took the step's thread, once per request)."""
        by_loop: dict = {}
        for rec in list(live):
            req, loop, out, sent = live[rec]
            items = by_loop.setdefault(loop, [])
            new = TokenChunk(rec.tokens[sent:])
            if new and not req.get("cancelled") and (rec.done or sent == 0 or len(new) >= every):
                if rec.logprobs is not None:
                    new.logprobs = rec.lps[sent : sent + len(new)]
                items.append((out, new))
                live[rec][3] = len(rec.tokens)
            if rec.done:
                items.append((out, None))
                del live[rec]
        for loop, items in by_loop.items():
            if items:
                loop.call_soon_threadsafe(_put_all, items)

    def _gauges(self, sched) -> None:
        """/metrics' view of the engine: requests waiting, running, preempted so far."""
        self.waiting = self.q.qsize() + len(sched.waiting)
        self.running = len(sched.running) + (sched.prefilling is not None)
        self.preempted = self._preempted_before + sched.preemptions

    def close(self) -> None:
        self._stop.set()
        self._thread.join(5)


def _put_all(items: list) -> None:
    """(On the queues' event loop) each ``(queue, item)`` put, in order."""
    for out, item in items:
        out.put_nowait(item)


def _settle(fut: asyncio.Future, r: Result | BaseException) -> None:
    if not fut.done():
        if isinstance(r, BaseException):
            fut.set_exception(r)
        else:
            fut.set_result(r)
