"""The contract a workload implements to be served with cross-request batching, in the spirit of
LitServe's ``LitAPI``: set up once, decode a request into items, run a batch of items from any
requests, encode one request's answer, report stage counters.

``fullthrottle serve --workload MODULE:CLASS`` serves any class that follows it at ``POST /v1/<name>``
(:class:`~fullthrottle.server.workload_routes.WorkloadService`): batches formed across requests by count,
cost budget and deadline (:class:`~fullthrottle.core.batch.RequestBatcher`), a full queue 503, a request
past the deadline 504, stage counters in ``/metrics`` under the workload's name. ``fullthrottle run
FILE.jsonl --workload MODULE:CLASS`` answers one request body per line offline (:func:`run_offline`),
and ``--ray`` in Ray Data actors. Wherever it runs, the same checks (:func:`items_of`, :func:`cost_of`,
:func:`outputs_of`, :func:`response_of`) hold a workload to the contract: the client's mistakes are 4xx
(or that line's error), the workload's bugs 500, and neither costs any other request. An error's body
is ``{"detail": "<the message>"}``, except a 422 for a request whose items all failed, whose body
:meth:`Workload.encode_response` makes.

Example (``decode_request``: per request, outside the batch; ``predict``: items of many requests)::

    class Doubler(Workload):
        name = "double"
        max_batch = 64

        def setup(self, device):
            self.device = torch.device(device)

        def decode_request(self, body):  # {"inputs": [1, 2.5]} -> two items
            xs = body.get("inputs")
            if not isinstance(xs, list) or not all(isinstance(x, (int, float)) for x in xs):
                raise ValueError("'inputs' must be a list of numbers")
            return [float(x) for x in xs]

        def predict(self, items):  # items: floats of many requests -> one output each
            return (2 * torch.tensor(items, dtype=torch.float32, device=self.device)).tolist()
"""

from __future__ import annotations

import json
import traceback
from collections.abc import Mapping
from types import MappingProxyType

from .imports import import_object, raised
from .json_body import not_json
from .report import StageStats


class ItemError(Exception):
    """One item's failure, returned (not raised) in :meth:`Workload.predict`'s outputs: that item's
    answer is this error; the rest of its request and of the batch are answered as usual."""


class Workload:
    """Subclass it and set :attr:`name`; override :meth:`decode_request` and :meth:`predict` (and, as
    needed, :meth:`setup`, :meth:`cost`, :meth:`encode_response`).

    Attributes:
        name: the route (``POST /v1/<name>``) and the ``workload`` label of its metrics: lowercase
            letters, digits, ``-`` and ``_``.
        max_batch: most items in one :meth:`predict` call (a request with more is run in several).
        max_batch_cost: most total :meth:`cost` of the requests batched together (``None``: no
            budget), as text-embeddings-inference's ``--max-batch-tokens``; a request over it alone
            runs by itself (bound it with :attr:`max_items_per_request`).
        max_wait_ms: how long a batch waits for more requests once its first has arrived.
        max_items_per_request: a request with more items gets 413.
        openai: the server's error answers carry OpenAI's ``{"error": {"message", ...}}`` beside
            ``detail`` (for a workload in OpenAI's request shapes, whose clients read that).
        stats: stage counters (``fullthrottle.StageStats``) the workload keeps, by name, shown in
            ``/metrics`` and reports; assign your own dict (in ``__init__`` or :meth:`setup`: the class
            default is an empty read-only mapping, shared). The service adds its own ``"predict"`` stage.
    """

    name: str = ""
    max_batch: int = 64
    max_batch_cost: int | None = None
    max_wait_ms: float = 2.0
    max_items_per_request: int = 1024
    openai: bool = False
    stats: Mapping[str, StageStats] = MappingProxyType({})

    def setup(self, device: str) -> None:
        """Load the model on ``device`` (``"cpu"``, ``"cuda"``, ``"cuda:1"``), once, before the server
        says it is ready. Raise to stop the server from starting (the message is shown). On the CPU, torch's
        intra-op threads spin between small batches and take cores from the HTTP side: a model whose
        batches take well under a millisecond runs better after ``torch.set_num_threads(1)`` here."""

    def decode_request(self, body: dict) -> list:
        """The items of one request's JSON body (a dict), as a list. Raise ``ValueError`` for a
        malformed request: the client gets 400 with the message (any other exception: 500). To fail one
        item alone (an image that does not decode), pass it on marked and answer it with an :class:`ItemError`
        from :meth:`predict` (``workloads/embed_api.py`` does so for a text it cannot tokenise). The
        server calls it in threads of its own, for concurrent requests at once: keep it thread-safe."""
        raise NotImplementedError

    def cost(self, item) -> int:
        """What ``item`` adds to a batch's :attr:`max_batch_cost` (tokens, pixels); default 1. Asked
        once per item, on the batching thread; an exception fails the item's request (500)."""
        return 1

    def predict(self, items: list) -> list:
        """One output per item, in order, for items of one or more requests; each output JSON-able
        (convert tensors: ``.tolist()``). An output that is an :class:`ItemError` fails its item only;
        when the call raises (or returns another number of outputs), its items run again one at a
        time, and an item whose call raises alone fails its own request (500 with the message). A
        request whose items all fail is answered 422 (its body as :meth:`encode_response` makes it);
        one with some items ok, 200. Items of one request need not be neighbours in ``items``: name
        an item in an error by its content, not by its place in the batch."""
        raise NotImplementedError

    def encode_response(self, outputs: list) -> dict:
        """The JSON answer of one request from its items' outputs (each a JSON-able value or an
        :class:`ItemError`). Default: ``{"results": [{"output": ...} | {"error": "..."}, ...]}``.
        Raise ``ValueError`` to fail the request (422 with the message). Called in worker threads."""
        return {"results": [{"error": str(o)} if isinstance(o, ItemError) else {"output": o} for o in outputs]}


def check_workload(w) -> None:
    """ValueError naming what is wrong with a workload object before it is served."""
    import inspect
    import re

    if not hasattr(w, "name") and not any(callable(getattr(w, a, None)) for a in ("decode_request", "predict")):
        raise ValueError(f"an object of type {type(w).__name__} is not a workload: subclass fullthrottle.Workload")
    name = getattr(w, "name", "")
    if not isinstance(name, str) or not re.fullmatch(r"[a-z0-9][a-z0-9_-]{0,63}", name):
        raise ValueError(f"{type(w).__name__}.name must be 1-64 of a-z, 0-9, '-', '_', got {name!r}")
    for attr in ("decode_request", "predict", "encode_response", "setup", "cost"):
        if not callable(getattr(w, attr, None)):
            raise ValueError(f"{type(w).__name__} has no method {attr}() (subclass fullthrottle.Workload)")
        if inspect.iscoroutinefunction(getattr(w, attr)):  # (its coroutine would never be awaited)
            raise ValueError(f"{type(w).__name__}.{attr}() is async: the contract's methods are plain functions")
    for attr in ("decode_request", "predict"):  # (the two a workload must write itself)
        if getattr(type(w), attr, None) is getattr(Workload, attr):
            raise ValueError(f"{type(w).__name__} does not define {attr}()")
    for attr in ("max_batch", "max_items_per_request"):
        v = getattr(w, attr, None)
        if not isinstance(v, int) or isinstance(v, bool) or v < 1:
            raise ValueError(f"{type(w).__name__}.{attr} must be an integer >= 1, got {v!r}")
    c = getattr(w, "max_batch_cost", None)
    if c is not None and (not isinstance(c, int) or isinstance(c, bool) or c < 1):
        raise ValueError(f"{type(w).__name__}.max_batch_cost must be None or an integer >= 1, got {c!r}")
    m = getattr(w, "max_wait_ms", None)
    if not isinstance(m, (int, float)) or isinstance(m, bool) or not 0 <= m < 60_000:
        raise ValueError(f"{type(w).__name__}.max_wait_ms must be a number in [0, 60000), got {m!r}")


def check_stats(w) -> None:
    """ValueError unless ``w.stats`` (once its ``setup()`` has run) maps names to StageStats (for ``/metrics``)."""
    if not hasattr(w, "stats"):  # (a class of its own, not a Workload subclass: Workload's stats is {})
        raise ValueError(f"workload {w.name!r} has no stats: set self.stats = {{}}, or subclass fullthrottle.Workload")
    st = w.stats
    if not isinstance(st, Mapping) or not all(isinstance(v, StageStats) for v in st.values()):
        raise ValueError(f"workload {w.name!r}: stats must map names to fullthrottle.StageStats, got {st!r:.200}")


def load_workload(spec: str) -> Workload:
    """An instance of the class ``spec`` names (``package.module:Class``, built with no arguments), or
    the instance it names (``package.module:my_workload``), checked (:func:`check_workload`); a module
    in the current folder is found. Raises ValueError: not ``MODULE:CLASS``, the module or class not
    found, its constructor failed (its error named), or the object breaks the contract (``spec`` named)."""
    obj = import_object(spec, "--workload", "my_package.my_module:MyWorkload")
    try:
        w = obj() if isinstance(obj, type) else obj
    except (Exception, SystemExit) as e:  # the user's constructor: its own error, named
        hint = " (the class is built with no arguments)" if isinstance(e, TypeError) else ""
        raise ValueError(f"--workload {spec}: {obj.__name__}() failed: {raised(e)}{hint}") from e
    try:
        check_workload(w)
    except ValueError as e:
        raise ValueError(f"--workload {spec}: {e}") from None
    return w


class ContractError(RuntimeError):
    """The workload broke its contract (a bug of the workload's, not the client's): the server answers
    500 with the message."""


class TooManyItems(ValueError):
    """A request with more items than the workload's ``max_items_per_request`` (the server: 413)."""


class NotServed(ValueError):
    """Raised by ``decode_request`` for a request naming a model the workload does not serve (the
    server: 404, as OpenAI's API answers)."""


def items_of(workload, body) -> list:
    """``decode_request(body)`` checked: the request's items.

    Raises:
        ValueError: the client's fault (not a JSON object, the workload's own ValueError, no items;
            NotServed: a model not served); TooManyItems: over ``max_items_per_request``;
            ContractError: decode_request raised something else or did not return a list.
    """
    if not isinstance(body, dict):
        raise ValueError("the body must be a JSON object")
    try:
        items = workload.decode_request(body)
    except NotServed:
        raise
    except ValueError as e:
        raise ValueError(str(e) or "bad request") from None
    except (Exception, SystemExit) as e:  # noqa: BLE001 - the workload's bug
        raise ContractError(f"decode_request() failed: {raised(e)}") from None
    if not isinstance(items, (list, tuple)):
        raise ContractError(f"decode_request() must return a list, got {type(items).__name__}")
    if not items:
        raise ValueError("no items in the request")
    if len(items) > workload.max_items_per_request:
        raise TooManyItems(f"{len(items)} items in one request; at most {workload.max_items_per_request}")
    return list(items)


def cost_of(workload, item) -> int:
    """``cost(item)`` checked (1 when the workload has no ``max_batch_cost``).

    Raises:
        ContractError: cost() raised, or gave no integer >= 0.
    """
    if not workload.max_batch_cost:
        return 1
    try:
        c = workload.cost(item)
    except (Exception, SystemExit) as e:  # noqa: BLE001
        raise ContractError(f"cost() failed: {raised(e)}") from None
    if not isinstance(c, int) or isinstance(c, bool) or c < 0:
        raise ContractError(f"cost() must return an integer >= 0, got {c!r}")
    return c


class PredictFailed:
    """In :func:`predict_each`'s outputs: ``predict()`` raised on this item alone (``message``); its
    request fails with the message (the server: 500)."""

    def __init__(self, message: str):
        self.message = message


def predict_each(workload, items: list, on_error=None) -> list:
    """:func:`outputs_of` on ``items``; when that raises, each item alone, so that an item on which
    ``predict()`` raises costs its own request only: its output is then a :class:`PredictFailed`.
    ``on_error(exception, n_items)`` is told of the first failure of the call (a log line, say).
    KeyboardInterrupt passes through."""
    try:
        return outputs_of(workload, items)
    except (Exception, SystemExit) as e:  # noqa: BLE001 - the workload's bug: it costs whom it hits
        if on_error is not None:
            on_error(e, len(items))
        if len(items) == 1:
            return [PredictFailed(f"predict() failed: {raised(e)}")]
    return [o for x in items for o in predict_each(workload, [x])]


def outputs_of(workload, items: list) -> list:
    """``predict(items)`` checked: one output per item. Raises RuntimeError: predict() returned no list
    (a dict, a str, a set) or another number of outputs."""
    got = workload.predict(items)
    if got is None or isinstance(got, (dict, str, bytes, bytearray, set, frozenset)):  # (keys, characters)
        raise RuntimeError(f"predict() returned a {type(got).__name__}, not a list of one output per item")
    got = list(got)
    if len(got) != len(items):
        raise RuntimeError(f"predict() returned {len(got)} outputs for {len(items)} item{'s' * (len(items) != 1)}")
    return got


def response_of(workload, outputs: list, check_json: bool = True) -> dict:
    """``encode_response(outputs)`` checked.

    Raises:
        ValueError: the workload's own (the server: 422); ContractError: anything else raised, no
            dict returned, or (``check_json``) an answer JSON cannot hold (a tensor, NaN).
    """
    try:
        answer = workload.encode_response(outputs)
    except ValueError:
        raise
    except (Exception, SystemExit) as e:  # noqa: BLE001
        raise ContractError(f"encode_response() failed: {raised(e)}") from None
    if not isinstance(answer, dict):
        raise ContractError(f"encode_response() must return a dict, got {type(answer).__name__}")
    if check_json:
        try:
            json.dumps(answer, allow_nan=False)
        except (TypeError, ValueError, RecursionError) as e:
            raise ContractError(f"the response is not JSON: {not_json(answer, e)}") from None
    return answer


def every_item_failed(outputs: list) -> bool:
    """Whether every output of a request is an :class:`ItemError` (the server answers it 422)."""
    return bool(outputs) and all(isinstance(o, ItemError) for o in outputs)


def calls(costs: list[int], max_batch: int, max_cost: int | None) -> list[tuple[int, int]]:
    """Items with ``costs``, in order, cut into ``predict`` calls: ``(start, end)`` ranges of at most
    ``max_batch`` items and ``max_cost`` cost (None: no budget); an item over the budget alone is a
    call of its own.

    >>> calls([3, 3, 3, 3, 9, 1], 64, 6)
    [(0, 2), (2, 4), (4, 5), (5, 6)]
    """
    out, start = [], 0
    while start < len(costs):
        end, total = start, 0
        while end < len(costs) and end - start < max_batch:
            if end > start and max_cost and total + costs[end] > max_cost:
                break
            total += costs[end]
            end += 1
        out.append((start, end))
        start = end
    return out


def run_offline(workload, bodies) -> list[tuple[dict | None, str | None]]:
    """Requests answered without a server: ``list(answers_offline(workload, bodies))``."""
    return list(answers_offline(workload, bodies))


def answers_offline(workload, bodies):
    """Requests answered without a server, through the same contract and checks as ``POST /v1/<name>``
    (:func:`items_of`, :func:`cost_of`, :func:`response_of`): the items of all requests run in batches
    of at most ``max_batch`` items and ``max_batch_cost`` cost (a request larger than either runs in
    several calls). ``workload`` is set up already; ``bodies`` are parsed JSON values.

    Yields one ``(answer, None)`` or ``(None, error)`` per body, in order, each as soon as it and
    every body before it are answered (not once all are); a request whose items all
    failed (:class:`ItemError`) gets ``(answer, "unprocessable: every item failed")``, the answer the
    server sends with its 422. An error is that request's alone: what the server answers 4xx or 500
    for, or an exception ``predict()`` raised on one of its items run alone (:func:`predict_each`).
    """
    n = len(bodies)
    errors: list = [None] * n
    items, owner = [], []  # every item of the requests that decoded, and its request's index
    first = [0] * n  # the request's items are items[first[j]:ends[j]]
    ends = [0] * n
    for j, body in enumerate(bodies):
        first[j] = len(items)
        try:
            got = items_of(workload, body)
        except ContractError as e:
            errors[j] = str(e)
            got = []
        except ValueError as e:  # (the client's: the server's 400 and 413)
            errors[j] = f"bad request: {e}"
            got = []
        items += got
        owner += [j] * len(got)
        ends[j] = len(items)
    costs = []
    for x, j in zip(items, owner):
        try:
            costs.append(cost_of(workload, x) if errors[j] is None else 0)
        except ContractError as e:
            errors[j] = str(e)
            costs.append(0)
    outs: list = [None] * len(items)
    nxt = 0  # the next request to hand out

    def ready(done: int):  # the requests, in order, whose items are all among the first `done`
        nonlocal nxt
        while nxt < n and (ends[nxt] <= done or errors[nxt] is not None):
            yield _offline_answer(workload, errors[nxt], outs[first[nxt] : ends[nxt]], ends[nxt] > first[nxt])
            nxt += 1

    yield from ready(0)
    for start, end in calls(costs, workload.max_batch, workload.max_batch_cost):
        part = [k for k in range(start, end) if errors[owner[k]] is None]
        for k, o in zip(part, predict_each(workload, [items[k] for k in part]) if part else ()):
            if isinstance(o, PredictFailed):  # (its own item raised: its request fails, no other)
                errors[owner[k]] = errors[owner[k]] or o.message
            else:
                outs[k] = o
        yield from ready(end)
    yield from ready(len(items))


def _offline_answer(workload, error: str | None, outs: list, has_items: bool) -> tuple[dict | None, str | None]:
    """One request's ``(answer, error)`` from its items' outputs (run_offline's, as the server's route)."""
    if error is not None or not has_items:
        return None, error
    try:
        answer = response_of(workload, outs)
    except ContractError as e:
        return None, str(e)
    except ValueError as e:  # (the server's 422)
        return None, f"unprocessable: {e}"
    return answer, ("unprocessable: every item failed" if every_item_failed(outs) else None)


def user_traceback(e: BaseException) -> str:
    """``e`` as a traceback of the frames outside this package, asyncio and the thread pool (the
    user's own code, where it raised), ending in ``Type: message``."""
    keep = [
        f
        for f in traceback.extract_tb(e.__traceback__)
        if not any(part in f.filename for part in ("/fullthrottle/", "/asyncio/", "/concurrent/futures/"))
    ]
    return "".join(traceback.format_list(keep)) + "".join(traceback.format_exception_only(type(e), e)).rstrip()
