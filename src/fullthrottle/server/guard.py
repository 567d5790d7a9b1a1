"""What the server does before a request reaches a model (its API keys: :mod:`~fullthrottle.server.keys`):
bounded body reads, and the total-pixels limit of a classify request.

- Bodies: read in full within ``body_timeout_s`` (a client trickling bytes is cut off with 408; while
  the server drains, one that sends nothing for :data:`DRAIN_BODY_IDLE_S` is too) and
  at most ``max_body_bytes`` (413), whatever ``Content-Length`` claims; a process receives at most
  :data:`BODIES_AT_ONCE` times that at once (503); a JSON body of URLs or of an LLM request holds at
  most :data:`MAX_JSON_BYTES` (413, unparsed); after a burst of bodies, once quiet, the freed heap
  goes back to the system (:data:`TRIM_AFTER_BYTES`).
- Pixels: the images of one request may hold at most ``max_request_pixels`` together (each image's
  own limit is the pipeline's ``max_image_pixels``), read from their headers before any decode.
"""

from __future__ import annotations

import asyncio
import contextlib
import re
import time
from collections.abc import Callable

#: most bytes of a JSON body of classify URLs or of an LLM request (413 past it): JSON is parsed on
#: the event loop, which answers no other client meanwhile (tens of ms per MiB of numbers), and no
#: such request needs more (64 URLs; a prompt of 64 characters per token of a 4k context, escaped)
MAX_JSON_BYTES = 4 << 20


def check_json_size(body: bytes) -> None:
    """Raises HTTPError 413 for a JSON body over :data:`MAX_JSON_BYTES`."""
    if len(body) > MAX_JSON_BYTES:
        raise HTTPError(413, f"a JSON body of {len(body)} bytes; at most {MAX_JSON_BYTES} for this route")


class HTTPError(Exception):
    """An HTTP error answer: status, detail (the JSON body's ``detail``) and extra headers."""

    def __init__(self, status: int, detail: str, headers: dict | None = None):
        super().__init__(detail)
        self.status, self.detail, self.headers = status, detail, headers


def check_json_type(request, route: str) -> None:
    """HTTPError 415 for a body sent as an image, audio, video, a file (``application/octet-stream``)
    or multipart to ``route``, which reads JSON. Any other type is read as JSON (``curl -d`` sends
    JSON as form-urlencoded)."""
    ctype = request.headers.get("content-type", "").split(";")[0].strip().lower()
    if ctype.startswith(("image/", "multipart/", "audio/", "video/")) or ctype == "application/octet-stream":
        raise HTTPError(415, f"Content-Type {ctype} is not accepted: {route} reads a JSON body (application/json)")


def overloaded(e: Exception, retry_after_s: float) -> HTTPError:
    """The answer to a request refused by a full queue (``e``: the ``Overloaded`` raised): 503 with
    ``Retry-After``."""
    return HTTPError(503, f"overloaded: {e}", {"Retry-After": str(retry_after_s)})


_OPENAI_ERROR_TYPES = {404: "model_not_found", 500: "server_error", 503: "overloaded_error", 504: "timeout_error"}


#: the request fields of OpenAI's API that an error's ``param`` may name (the field its message starts with)
OPENAI_FIELDS = frozenset(
    "model prompt messages max_tokens max_completion_tokens temperature top_p top_k n stream stream_options "
    "stop stop_token_ids seed logprobs top_logprobs echo suffix best_of presence_penalty frequency_penalty "
    "logit_bias response_format tools tool_choice user input encoding_format dimensions ignore_eos "
    # (vLLM's sampling extensions, refused by name: workloads/llm/api.py's UNSUPPORTED)
    "repetition_penalty min_tokens min_p typical_p length_penalty use_beam_search include_stop_str_in_output "
    "prompt_logprobs guided_json guided_regex guided_choice guided_grammar".split()
)


def openai_path(path: str) -> bool:
    """Whether a request's ``path`` is under ``/v1/`` (also as ``//v1/...``): its errors then carry
    OpenAI's shape too (:func:`error_body`)."""
    return path.lstrip("/").startswith("v1/")


def error_body(status: int, detail: str, openai: bool = False, kind: str | None = None) -> dict:
    """An error answer's JSON: ``{"detail": ...}``, and with ``openai`` also OpenAI's ``{"error":
    {"message", "type", "param", "code"}}`` (what its client shows; ``type``: ``kind``, else the
    status's: 404 ``model_not_found``; ``param``: the request field the message starts with, as in
    "max_tokens must be a positive integer" or "messages[0].role must be ...", else None)."""
    if not openai:
        return {"detail": detail}
    kind = kind or _OPENAI_ERROR_TYPES.get(status, "invalid_request_error")
    field = re.match(r"[a-z_]+", detail)
    param = field.group(0) if field and field.group(0) in OPENAI_FIELDS and status < 500 else None
    return {"error": {"message": detail, "type": kind, "param": param, "code": status}, "detail": detail}


#: a body over the limit is read on and dropped, up to this many bytes more and for this long, so that
#: the 413 reaches a client still sending (a connection closed with bytes unread is reset, and the
#: answer with it: Python's http.client sends a whole body before it reads); past either, the
#: connection closes regardless. Dropping bytes holds no memory: a few times the largest body limit
DRAIN_BYTES = 256 << 20
DRAIN_S = 2.0


#: request bodies this process may be receiving at once, in bytes, as a multiple of the limit of
#: one (``max_body_bytes``: 32 x 32 MiB by default); a body that would go past it gets 503 with
#: Retry-After, so that slow or many large uploads cannot take the process's memory
BODIES_AT_ONCE = 32
_receiving = [0]  # bytes of the request bodies being received in this process now (one event loop)

#: while the server drains (a graceful shutdown: :func:`draining`), a request body still on its way
#: must keep coming: one that brings no byte for this many seconds is answered 408 (a client that
#: stopped sending would hold the drain, and the process, for the rest of its ``body_timeout_s``);
#: one still arriving goes on within its own deadline
DRAIN_BODY_IDLE_S = 1.0
_bodies: dict = {}  # the request bodies being received now: their asyncio.Timeout -> (deadline, event loop)
_draining: set = set()  # the event loops whose server is draining (a test may run servers in threads)

#: once this many bytes of request bodies came in, and then none for a whole :data:`TRIM_AFTER_S`
#: (checked once per that period: the heap goes back one to two periods after the last body), glibc
#: is asked to give the freed heap back to the system (``malloc_trim``): without it, a burst of
#: large bodies leaves the process at its peak size for good
TRIM_AFTER_BYTES = 256 << 20
TRIM_AFTER_S = 2.0
_trim: dict = {"bytes": 0, "armed": False, "at_check": 0, "busy": None, "work": False}


def set_busy(busy: Callable[[], bool], work: bool) -> None:
    """What busy means in this process, for the heap trim: a period is quiet only if ``busy()`` (called
    on the event loop) is false, as requests still being answered hold their memory and free it later.
    ``work``: the bodies go on to a pipeline in this process (the engine, or the one process), whose
    own allocations are not counted in their bytes: any body starts the checks, not only
    :data:`TRIM_AFTER_BYTES` of them."""
    _trim["busy"], _trim["work"] = busy, work


def trim_soon(n: int, loop: asyncio.AbstractEventLoop | None = None) -> None:
    """Count ``n`` more request-body bytes; past :data:`TRIM_AFTER_BYTES` (or at once, with
    :func:`set_busy`'s ``work``), start the checks for a quiet period. Without ``loop``: call it on the
    process's event loop; with it, from any thread (the engine's link readers). Per body, an addition
    and a comparison: no timer, no wake-up."""
    _trim["bytes"] += n
    if _trim["armed"] or (_trim["bytes"] < TRIM_AFTER_BYTES and not _trim["work"]):
        return
    _trim["armed"] = True
    if loop is None:
        _check_later()
    else:
        loop.call_soon_threadsafe(_check_later)


def _check_later() -> None:
    _trim["at_check"] = _trim["bytes"]
    asyncio.get_running_loop().call_later(TRIM_AFTER_S, _trim_if_quiet)


def _trim_if_quiet() -> None:
    busy = _trim["busy"]
    if _receiving[0] or _trim["bytes"] != _trim["at_check"] or (busy is not None and busy()):
        _check_later()  # bodies came meanwhile, or work is left: another period
        return
    _trim["bytes"], _trim["armed"] = 0, False
    try:
        asyncio.get_running_loop().run_in_executor(None, malloc_trim)
    except RuntimeError:  # (the loop's executor shut down: the server is stopping, nothing to trim for)
        pass


def malloc_trim() -> bool:
    """glibc's ``malloc_trim(0)``: free heap pages back to the system; False where glibc is absent."""
    import ctypes
    import ctypes.util

    try:
        return bool(ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6").malloc_trim(0))
    except (OSError, AttributeError):
        return False


@contextlib.contextmanager
def draining():
    """While the server of the running event loop drains: every request body it is receiving, and
    every one that starts, is cut off with 408 once no byte came for :data:`DRAIN_BODY_IDLE_S`."""
    loop = asyncio.get_running_loop()
    _draining.add(loop)
    cut = loop.time() + DRAIN_BODY_IDLE_S
    for timeout, (_, owner) in list(_bodies.items()):
        if owner is loop and not timeout.expired() and timeout.when() > cut:
            timeout.reschedule(cut)
    try:
        yield
    finally:
        _draining.discard(loop)


async def drain(chunks, declared: int | None = None) -> None:
    """Read and drop what is left of a request body (``chunks``: an async iterator of bytes), at most
    :data:`DRAIN_BYTES` within :data:`DRAIN_S`; nothing when its declared length is past that."""
    if declared is not None and declared > DRAIN_BYTES:
        return
    left = DRAIN_BYTES

    async def go():
        nonlocal left
        async for c in chunks:
            left -= len(c)
            if left < 0:
                return

    try:
        await asyncio.wait_for(go(), DRAIN_S)
    except Exception:  # noqa: BLE001 - (timed out, or the client left: the connection closes anyway)
        pass


async def read_body(request, max_bytes: int, timeout_s: float) -> bytes:
    """The whole request body, within ``timeout_s`` and ``max_bytes``; none is taken encoded.

    Raises:
        HTTPError: 415 a Content-Encoding but identity (nothing here inflates a body), 501 a
            Transfer-Encoding but chunked, 413 over the limit (declared or read), 408 not received in
            time, 503 past the bodies this process may receive at once (:data:`BODIES_AT_ONCE`), 499
            the client hung up before the end of its body (nginx's "client closed request": nobody
            reads that answer, and /metrics counts it apart from the clients' errors).
    """
    from starlette.requests import ClientDisconnect

    h = request.headers
    try:  # (read first, also when refused: an answer to a client still sending is lost to a reset)
        body = await _read_limited(request.stream(), h.get("content-length"), "expect" in h, max_bytes, timeout_s)
    except ClientDisconnect:
        raise HTTPError(499, "the client disconnected before the end of its request body") from None
    if (coding := h.get("content-encoding", "identity").strip().lower()) not in ("", "identity"):
        raise HTTPError(415, f"Content-Encoding {coding} is not accepted: send the body unencoded")
    if [c for c in h.get("transfer-encoding", "").lower().replace(" ", "").split(",") if c not in ("", "chunked")]:
        raise HTTPError(501, f"Transfer-Encoding {h['transfer-encoding']} is not implemented: only chunked")
    return body


async def read_asgi_body(receive, headers: dict, max_bytes: int, timeout_s: float) -> bytes | None:
    """:func:`read_body` from ASGI ``receive`` and the request's ``headers`` (lower-case bytes names
    to bytes values; an HTTP worker's passed-on request): the whole body, or None if the client hung
    up. Raises HTTPError (413, 408)."""
    from starlette.requests import ClientDisconnect

    declared = headers.get(b"content-length", b"").decode("latin-1") or None
    try:
        return await _read_limited(body_chunks(receive), declared, b"expect" in headers, max_bytes, timeout_s)
    except ClientDisconnect:
        return None


async def body_chunks(receive):
    """A request body's pieces, as ASGI ``receive`` gives them, to its end. Raises starlette's
    ``ClientDisconnect`` if the client leaves first."""
    from starlette.requests import ClientDisconnect

    while True:
        msg = await receive()
        if msg["type"] == "http.disconnect":
            raise ClientDisconnect()
        yield msg.get("body", b"")
        if not msg.get("more_body", False):
            return


async def _read_limited(chunks, declared: str | None, expecting: bool, max_bytes: int, timeout_s: float) -> bytes:
    """The whole body from ``chunks`` (an async iterator of bytes; ``declared``: its Content-Length,
    ``expecting``: the client waits for 100-continue). Raises HTTPError (413, 408, 503 past
    :data:`BODIES_AT_ONCE`), and what ``chunks`` raises."""
    # (413s close the connection, the rest of the body drained first: it must not be read as a request)
    if declared is not None and declared.isdigit() and int(declared) > max_bytes:
        if not expecting:  # (a client waiting for 100-continue sends nothing more)
            await drain(chunks, int(declared))
        raise HTTPError(
            413, f"request body of {declared} bytes exceeds the limit of {max_bytes}", {"Connection": "close"}
        )
    body = bytearray()
    budget = BODIES_AT_ONCE * max_bytes
    busy = HTTPError(
        503,
        "the server is receiving too many large request bodies at once: retry",
        {"Retry-After": "1", "Connection": "close"},
    )
    if declared is not None and declared.isdigit() and _receiving[0] + int(declared) > budget:
        raise busy

    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    timeout = asyncio.timeout_at(min(deadline, loop.time() + DRAIN_BODY_IDLE_S) if loop in _draining else deadline)

    async def read():
        async for chunk in chunks:
            body.extend(chunk)
            _receiving[0] += len(chunk)
            if len(body) > max_bytes:
                await drain(chunks)
                raise HTTPError(413, f"request body exceeds the limit of {max_bytes} bytes", {"Connection": "close"})
            if _receiving[0] > budget:
                raise busy
            if _draining and loop in _draining:  # (a body still coming in: its deadline goes on)
                timeout.reschedule(min(deadline, loop.time() + DRAIN_BODY_IDLE_S))

    try:
        async with timeout:  # (its deadline is cut short where the server starts to drain: draining())
            _bodies[timeout] = (deadline, loop)
            await read()
    except TimeoutError:
        if timeout.when() < deadline:
            detail = f"the server is stopping and the request body stalled (no byte for {DRAIN_BODY_IDLE_S:g} s)"
        else:
            detail = f"request body not received within {timeout_s:g} s"
        raise HTTPError(408, detail, {"Connection": "close"}) from None
    finally:
        _bodies.pop(timeout, None)
        _receiving[0] -= len(body)
        trim_soon(len(body))
    return bytes(body)


def past_deadline(deadline_s: float) -> HTTPError:
    """The 504 of a request whose deadline (``deadline_s``, the server's ``--timeout-s``) passed."""
    return HTTPError(504, f"deadline of {deadline_s:g} s exceeded")


def time_left(deadline_s: float, t0: float) -> float:
    """Seconds left of ``deadline_s`` for a request that came at ``t0`` (``time.perf_counter``), >= 0."""
    return max(0.0, deadline_s - (time.perf_counter() - t0))


async def answer_unless_gone(request, work, timeout_s: float, deadline_s: float):
    """The result of ``work`` (a coroutine or future) for ``request`` (its body read), unless its
    client hangs up first or ``timeout_s`` passes: then ``work`` is cancelled (which drops what it
    queued: a client that leaves costs only what was already running for it).

    Raises:
        HTTPError: 499 the client hung up, 504 past the deadline (``deadline_s``: the one to name).
    """
    work = asyncio.ensure_future(work)
    gone = asyncio.ensure_future(_disconnected(request))
    try:
        done, _ = await asyncio.wait({work, gone}, timeout=max(timeout_s, 0.001), return_when="FIRST_COMPLETED")
    except asyncio.CancelledError:
        work.cancel()
        raise
    finally:
        gone.cancel()
    if work not in done:
        work.cancel()
        await asyncio.gather(work, return_exceptions=True)
        if gone in done:
            raise HTTPError(499, "the client closed the connection before its answer")
        raise past_deadline(deadline_s)
    return work.result()


async def _disconnected(request) -> None:
    """Returns when the client of ``request`` (its body read) hangs up."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


def check_pixels(images: list[tuple[str, object]], max_pixels: int, max_image_pixels: int) -> None:
    """HTTPError 413 when the images (``(id, bytes)``; other entries skipped) hold more than
    ``max_pixels`` together, by their headers. An image that will fail alone (an unreadable header,
    over ``max_image_pixels`` by itself) counts 0: it gets its own error."""
    from ..data.image_header import ImageError, header_size, sniff

    total = 0
    for _, data in images:
        if isinstance(data, bytes) and data:
            try:
                w, h, _ = header_size(data, sniff(data))
            except ImageError:
                continue
            if 0 < w * h <= max_image_pixels:
                total += w * h
    if total > max_pixels:
        raise HTTPError(
            413,
            f"the request's images hold {total / 1e6:.1f} megapixels together, over the "
            f"limit of {max_pixels / 1e6:.1f} (--max-request-megapixels): send fewer per request",
        )
