"""Between the server's handlers and the engines: the services that take requests from asyncio and
answer them from engine threads.

- :class:`BatchingService`: image requests join one :class:`~fullthrottle.workloads.classify.pipeline.Pipeline` stream
  (a bounded submission queue, a dispatcher thread resolving each request's future);
- :class:`EmbedService`: texts from many requests embedded together (:class:`~fullthrottle.workloads.embed.Embedder`);
- :class:`CompletionService`: LLM completions, batched per decode loop, streamed token by token.

A full queue raises :class:`Overloaded` (the server answers 503).
"""

from __future__ import annotations

import asyncio
import itertools
import queue
import threading
from dataclasses import dataclass, field

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


class EmbedService:
    """Cross-request batching for text embeddings: one thread tokenises each waiting request as it
    takes it and runs as many as fit ``max_texts`` texts and ``max_batch_tokens`` tokens
    (:class:`~fullthrottle.core.batch.RequestBatcher`, the token budget as text-embeddings-inference's
    ``--max-batch-tokens``) as one :meth:`~fullthrottle.workloads.embed.Embedder.embed_encoded` call. A request
    whose texts cannot be tokenised gets its own error; the others in its batch are not affected."""

    def __init__(self, embedder, max_texts: int = 1024, max_batch_tokens: int = 32768, max_queue: int = 256):
        self.embedder = embedder
        self.q: queue.Queue = queue.Queue(max_queue)
        self.batcher = RequestBatcher(
            self.q, max_texts, max_batch_tokens, size=lambda r: len(r.texts), tokens=self._tokenize
        )
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="ft-embed", daemon=True)
        self._thread.start()

    def submit(self, texts: list[str]) -> asyncio.Future:
        """Raises Overloaded when ``max_queue`` requests are already waiting."""
        loop = asyncio.get_running_loop()
        fut = loop.create_future()
        try:
            self.q.put_nowait(_EmbedRequest(texts, loop, fut))
        except queue.Full:
            raise Overloaded(f"queue full ({self.q.maxsize} requests waiting)") from None
        return fut

    def _tokenize(self, r: _EmbedRequest) -> int:
        """The request's token count (its encodings kept on it); 0 with its error kept instead."""
        if r.fut.done():  # its caller gave up (504): no work for it
            return 0
        try:
            r.encs = self.embedder.tokenize(r.texts)
        except Exception as e:  # noqa: BLE001 - this request's error, not its batch's
            r.error = e
            return 0
        return sum(len(e.ids) for e in r.encs)

    def _loop(self) -> None:
        while not self._stop.is_set():
            reqs = []
            for r in self.batcher.next():
                if r.error is not None:
                    r.loop.call_soon_threadsafe(_fail, r.fut, r.error)
                elif not r.fut.done():  # (skip requests whose caller gave up)
                    reqs.append(r)
            if not reqs:
                continue
            try:
                res = self.embedder.embed_encoded([e for r in reqs for e in r.encs])
            except Exception as e:  # noqa: BLE001 - answer every waiting request
                for r in reqs:
                    r.loop.call_soon_threadsafe(_fail, r.fut, e)
                continue
            k = 0
            for r in reqs:
                n = len(r.texts)
                part = (res.vectors[k : k + n], res.truncated[k : k + n], res.tokens[k : k + n])
                k += n
                r.loop.call_soon_threadsafe(_resolve, r.fut, part)

    def close(self) -> None:
        self._stop.set()
        self._thread.join(60)  # a batch in progress finishes (bounded by MAX_TEXTS_PER_REQUEST)


@dataclass
class _EmbedRequest:
    texts: list
    loop: asyncio.AbstractEventLoop
    fut: asyncio.Future
    encs: list = field(default_factory=list)  # its tokenizer encodings, once the service took it
    error: BaseException | None = None  # why it could not be tokenised


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
