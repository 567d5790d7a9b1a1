"""Workloads of the user's own in the server: any :class:`~fullthrottle.core.workload.Workload`
served at ``POST /v1/<name>`` with cross-request batching.

- :class:`WorkloadService`: a thread takes waiting requests as batches
  (:class:`~fullthrottle.core.batch.RequestBatcher`: the workload's ``max_batch`` items, its
  ``max_batch_cost`` budget, its ``max_wait_ms``), runs the workload's ``predict`` on their items in
  calls within that budget (a request larger than one call in turns with those that come while it
  runs), and hands each request its own outputs;
- :func:`add_workload_routes`: the route of each, with the server's limits (body size and time,
  deadline -> 504, full queue -> 503 with Retry-After, 400 for what ``decode_request`` refuses, 413
  for too many items).
- :func:`load_workload`: ``MODULE:CLASS`` (``fullthrottle serve --workload``) to an instance.
"""

from __future__ import annotations

import asyncio
import collections
import itertools
import logging
import queue
import threading
import time
from dataclasses import dataclass

from fastapi import Request  # module level: FastAPI resolves handler annotations from module globals

from ..core.batch import RequestBatcher
from ..core.errors import Overloaded
from ..core.imports import raised
from ..core.json_body import not_json, parse_body
from ..core.report import StageStats
from ..core.workload import (
    ContractError,
    NotServed,
    PredictFailed,
    TooManyItems,
    Workload,
    calls,
    cost_of,
    every_item_failed,
    items_of,
    predict_each,
    response_of,
    user_traceback,
)
from ..core.workload import load_workload as load_any_workload
from .guard import (
    HTTPError,
    answer_unless_gone,
    check_json_type,
    error_body,
    overloaded,
    past_deadline,
    read_body,
    time_left,
)

log = logging.getLogger(__name__)


def load_workload(spec: str) -> Workload:
    """The workload ``spec`` names, to be served (:func:`~fullthrottle.core.workload.load_workload`);
    a name of the server's own routes is refused.

    Raises:
        ValueError: as :func:`~fullthrottle.core.workload.load_workload`, or a reserved name.
    """
    w = load_any_workload(spec)
    if w.name in RESERVED:
        raise ValueError(f"--workload {spec}: the name {w.name!r} is one of the server's own routes")
    return w


@dataclass
class _Request:
    items: list
    loop: asyncio.AbstractEventLoop
    fut: asyncio.Future
    error: BaseException | None = None  # cost() failed for it
    costs: list | None = None  # each item's cost() (None: 1 each)
    outs: list | None = None  # its outputs so far
    left: int = 0  # its items not yet predicted (-1: answered with an error)
    next: int = 0  # its next item to go into a call


class WorkloadService:
    """Cross-request batching for one :class:`~fullthrottle.core.workload.Workload` (already set up).

    Args:
        workload: the workload; its ``max_batch``, ``max_batch_cost`` and ``max_wait_ms`` form the
            batches.
        max_queue: requests waiting before :meth:`submit` raises :class:`~fullthrottle.server.services.Overloaded`.
        on_batch: called with the items of each ``predict`` call (a metrics histogram's ``observe``).
    """

    def __init__(self, workload: Workload, max_queue: int = 256, on_batch=None):
        self.workload = workload
        self.on_batch = on_batch
        self.q: queue.Queue = queue.Queue(max_queue)
        self.batcher = RequestBatcher(
            self.q,
            workload.max_batch,
            workload.max_batch_cost,
            workload.max_wait_ms / 1e3,
            size=lambda r: len(r.items),
            tokens=self._cost,
        )
        #: the workload's own stage counters, and this service's "predict" (its predict calls)
        self.stats = {**(getattr(workload, "stats", None) or {}), "predict": StageStats("predict")}
        self.batches = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name=f"ft-{workload.name}", daemon=True)
        self._thread.start()

    def submit(self, items: list) -> asyncio.Future:
        """The future of the outputs of ``items`` (one request's). Raises Overloaded on a full queue."""
        loop = asyncio.get_running_loop()
        fut = loop.create_future()
        try:
            self.q.put_nowait(_Request(items, loop, fut))
        except queue.Full:
            raise Overloaded(f"queue full ({self.q.maxsize} requests waiting)") from None
        return fut

    def _cost(self, r: _Request) -> int:
        """The request's cost in the batch budget (each item's kept on it); 0 with its error kept when
        ``cost()`` failed."""
        if not self.workload.max_batch_cost or r.fut.done():
            return 0
        try:
            r.costs = [cost_of(self.workload, x) for x in r.items]
        except ContractError as e:  # the workload's bug costs this request, not the service
            r.error = e
            return 0
        return sum(r.costs)

    def _next_call(self, active: collections.deque) -> list:
        """The next ``predict`` call: items of the requests in progress, in turn from the front one
        (the next items of each, in order), at most ``max_batch`` items and ``max_batch_cost`` (an item
        over the budget alone: a call of its own)."""
        w = self.workload
        work = list(itertools.islice(((r, i) for r in active for i in range(r.next, len(r.items))), w.max_batch))
        costs = [r.costs[i] if r.costs is not None else 1 for r, i in work]
        (a, b), *_ = calls(costs, w.max_batch, w.max_batch_cost)
        return work[a:b]

    def _run_call(self, active: collections.deque) -> None:
        """One ``predict`` call (:meth:`_next_call`); a request is answered as soon as its last item is
        done. The front request then goes to the back of the line if it has items left: a request
        larger than one call runs in turns with those that arrive while it runs (round robin), so that
        a small request waits a call or two, not for every call of a large one. A call that raises runs
        again item by item (:func:`~fullthrottle.core.workload.predict_each`): an item that raises alone
        fails its request, no other."""
        call = self._next_call(active)
        for r, i in call:
            r.next = i + 1
        if self.on_batch is not None:
            self.on_batch(len(call))
        st = self.stats["predict"]
        st.begin()
        try:
            outs = predict_each(self.workload, [r.items[i] for r, i in call], self._log_failure)
            self.batches += 1
        except BaseException as e:  # noqa: BLE001 - (a KeyboardInterrupt raised in predict()): every
            # request of the call is answered, and the service lives on
            outs = [PredictFailed(f"predict() failed: {raised(e)}")] * len(call)
        finally:
            st.end(len(call))
        for (r, i), o in zip(call, outs):
            if r.left <= 0:
                continue
            if isinstance(o, PredictFailed):
                r.left = -1  # (answered: its other items are not predicted)
                r.loop.call_soon_threadsafe(_set, r.fut, None, RuntimeError(o.message))
                continue
            r.outs[i] = o
            r.left -= 1
            if r.left == 0:
                r.loop.call_soon_threadsafe(_set, r.fut, r.outs, None)
        if active and active[0].left > 0 and active[0].next < len(active[0].items):
            active.rotate(-1)

    def _log_failure(self, e: BaseException, n: int) -> None:
        log.error("workload %s: predict() failed on a batch of %d:\n%s", self.workload.name, n, user_traceback(e))

    def _loop(self) -> None:
        active: collections.deque[_Request] = collections.deque()  # requests in progress, in turn
        while not self._stop.is_set():
            for r in self.batcher.next(0 if active else 0.05):  # (new requests join the line)
                if r.error is not None:
                    r.loop.call_soon_threadsafe(_set, r.fut, None, r.error)
                elif not r.fut.done():  # (skip callers that gave up)
                    r.outs, r.left = [None] * len(r.items), len(r.items)
                    active.append(r)
            # (the items of a request whose caller left, its deadline passed or its client hung up,
            # are not predicted)
            active = collections.deque(r for r in active if r.left > 0 and not r.fut.done())
            if active:
                self._run_call(active)

    @property
    def waiting(self) -> int:
        """Requests queued whose callers still wait (one past its deadline, or whose client hung up,
        stays in the queue until the batching thread skips it, and does not count)."""
        with self.q.mutex:
            return sum(not r.fut.done() for r in self.q.queue)

    @property
    def alive(self) -> bool:
        """Whether its batching thread runs (``/readyz`` is 503 when one does not)."""
        return self._thread.is_alive()

    def close(self, timeout_s: float = 5.0) -> None:
        """Stop taking batches; wait at most ``timeout_s`` for a ``predict()`` call in progress (a call
        that hangs is left behind, logged: its thread does not keep the process alive)."""
        self._stop.set()
        self._thread.join(timeout_s)
        if self._thread.is_alive():
            log.warning(
                "workload %r: predict() still running after %.0f s: not waited for", self.workload.name, timeout_s
            )


def _set(fut: asyncio.Future, value, error: BaseException | None) -> None:
    if fut.done():
        return
    if error is not None:
        fut.set_exception(error)
    else:
        fut.set_result(value)


#: routes of the server's own: a workload may not take their names
RESERVED = ("classify", "embeddings", "completions", "chat", "models")


def add_workload_routes(app, workloads, state: dict, opts, reply, m_latency) -> None:
    """Add ``POST /v1/<name>`` for each workload to ``app``; its service is ``state["workloads"][name]``
    once the app's lifespan has set the workload up (503 before).

    Args:
        opts: the :class:`~fullthrottle.server.options.ServeOptions` (body limit and time, deadline,
            Retry-After).
        reply: ``reply(route, status, body, headers=None)``: the JSON response, counted in the metrics.
        m_latency: the app's latency histogram (prometheus-client).
    """
    for w in workloads:
        app.add_api_route(
            f"/v1/{w.name}", _handler(w.name, state, opts, reply, m_latency), methods=["POST"], name=w.name
        )


def _items(w, body: bytes) -> list:
    """The items of one request body: JSON, then the workload's ``decode_request``."""
    return items_of(w, parse_body(body))


#: most threads running a workload's per-request code at once in one process (calls past their
#: request's deadline included); one more request is answered 503
MAX_WORKLOAD_THREADS = 64
_threads = [0]  # threads running workload code now, in every app of the process
_threads_lock = threading.Lock()  # (counted up on an event loop, down in the threads as they end)


async def _in_thread(what: str, fn, *args):
    """``fn(*args)`` in a daemon thread of its own, off the event loop.

    Not asyncio's default pool: a call that overruns its request's deadline keeps running after the
    504, and a few of those would hold every thread of a pool (6 on 2 cores), leaving every other
    request of a workload route to wait for them, and the server's exit too. Each call here holds only
    its own thread, which does not keep the process alive; at most :data:`MAX_WORKLOAD_THREADS` run at
    once (calls that hang would otherwise add a thread per request): past it, 503 with Retry-After.

    A KeyboardInterrupt raised there is the workload's own (a signal reaches the main thread only):
    ContractError, as anything else its code raises, where it would otherwise leave the route as a
    plain-text 500.

    Raises:
        Overloaded: :data:`MAX_WORKLOAD_THREADS` threads run workload code already.
    """
    loop = asyncio.get_running_loop()
    fut = loop.create_future()
    with _threads_lock:
        if _threads[0] >= MAX_WORKLOAD_THREADS:
            raise Overloaded(f"the workload's code is running in {_threads[0]} threads already")
        _threads[0] += 1

    def call():
        value, error = None, None
        try:
            value = fn(*args)
        except KeyboardInterrupt as e:
            error = ContractError(f"{what}() failed: {raised(e)}")
        except BaseException as e:  # noqa: BLE001 - handed to the awaiting route as it is
            error = e
        finally:
            with _threads_lock:
                _threads[0] -= 1
        try:
            loop.call_soon_threadsafe(_set, fut, value, error)
        except RuntimeError:  # the loop closed meanwhile (the server stopped): nobody waits
            pass

    try:
        threading.Thread(target=call, name=f"ft-{what}", daemon=True).start()
    except BaseException:  # (no thread could start: nothing runs, nothing to count)
        with _threads_lock:
            _threads[0] -= 1
        raise
    return await fut


def _handler(name: str, state: dict, opts, reply, m_latency):
    """The route of the workload ``name`` (a closure: FastAPI would read a default argument as a
    query parameter)."""
    route = f"/v1/{name}"

    async def handle(request: Request):
        t0 = time.perf_counter()
        try:
            svc = state.get("workloads", {}).get(name)
            if svc is None:
                raise HTTPError(503, "loading", {"Retry-After": str(opts.retry_after_s)})
            w = svc.workload
            check_json_type(request, route)
            body = await read_body(request, opts.max_body_bytes, opts.body_timeout_s)
            try:  # (in a thread, as is encode_response below: the workload's own code may take
                # its time, and this event loop serves every other request meanwhile)
                items = await asyncio.wait_for(
                    _in_thread("decode_request", _items, w, body), time_left(opts.timeout_s, t0)
                )
            except TimeoutError:  # (the decode goes on in its thread; its answer is not awaited)
                raise past_deadline(opts.timeout_s) from None
            except Overloaded as e:
                raise overloaded(e, opts.retry_after_s) from None
            except ContractError as e:  # the workload's bug: say so, as JSON
                raise HTTPError(500, str(e)) from None
            except TooManyItems as e:
                raise HTTPError(413, str(e)) from None
            except NotServed as e:
                raise HTTPError(404, str(e)) from None
            except ValueError as e:
                raise HTTPError(400, str(e)) from None
            try:
                fut = svc.submit(items)
            except Overloaded as e:
                raise overloaded(e, opts.retry_after_s) from None
            try:  # (past the deadline, or its client gone: the request leaves the queue unpredicted)
                outs = await answer_unless_gone(request, fut, time_left(opts.timeout_s, t0), opts.timeout_s)
            except HTTPError:
                raise
            except Exception as e:  # noqa: BLE001 - cost() or predict() failed for the whole batch
                raise HTTPError(500, f"{name}: {e}") from None
            try:  # (JSON: checked as sent)
                answer = await asyncio.wait_for(
                    _in_thread("encode_response", response_of, w, outs, False), time_left(opts.timeout_s, t0)
                )
            except TimeoutError:
                raise past_deadline(opts.timeout_s) from None
            except Overloaded as e:
                raise overloaded(e, opts.retry_after_s) from None
            except ContractError as e:
                raise HTTPError(500, str(e)) from None
            except ValueError as e:
                raise HTTPError(422, str(e)) from None
            status = 422 if every_item_failed(outs) else 200
            try:
                return reply(route, status, answer)
            except (TypeError, ValueError, RecursionError) as e:  # not JSON (a tensor, NaN, too deep)
                raise HTTPError(500, f"the response is not JSON: {not_json(answer, e)}") from None
        except HTTPError as e:  # (a workload in OpenAI's shapes answers errors in its shape too)
            body = error_body(e.status, e.detail, getattr(svc.workload if svc else None, "openai", False))
            return reply(route, e.status, body, e.headers)
        finally:
            m_latency.labels(route).observe(time.perf_counter() - t0)

    return handle
