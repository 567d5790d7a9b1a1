"""``POST /v1/classify``: the request's images read and checked, handed to a classifier backend as
one list, answered with one result per image.

The same route serves in one process (:class:`LocalClassifier`: the app's own pipelines) and in the
HTTP worker processes of a multi-process server (:class:`~fullthrottle.server.front.EngineClient`:
the images go to the engine process). A backend has ``async classify(images) -> list[Result]`` and
raises :class:`~fullthrottle.server.services.Overloaded` (503 with Retry-After) or ``RuntimeError``
(503: loading, shutting down, failed).

Bodies: raw image bytes (any content type but the two below), ``multipart/form-data`` (one part
per image), or ``application/json`` ``{"urls": [...]}`` (fetched only with ``--allow-fetch``).
"""

from __future__ import annotations

import asyncio
import logging
import time

from fastapi import Request  # module level: FastAPI resolves handler annotations from module globals

from ..core.errors import Overloaded, error_info
from ..core.json_body import json_type, parse_body
from ..workloads.classify.result import Result, utf8_text
from .guard import (
    HTTPError,
    answer_unless_gone,
    check_json_size,
    check_pixels,
    overloaded,
    past_deadline,
    read_body,
    time_left,
)

log = logging.getLogger("fullthrottle.server.classify")
ROUTE = "/v1/classify"
#: most multipart form fields that are not files in one request (starlette's parser's default): one
#: more is answered 413
MAX_FORM_FIELDS = 1000


class EntryError(str):
    """An entry of a request that fails before the pipeline (a URL that is none or is not fetched, a
    form field where a file was expected): that image's own error, the message."""


class LocalClassifier:
    """The backend of a one-process server: each request goes to the replica
    (:class:`~fullthrottle.server.services.BatchingService`) with the fewest images waiting."""

    def __init__(self, services: list):
        self.services = services

    async def classify(self, images: list[tuple[str, bytes | EntryError]]) -> list[Result]:
        svc = min(self.services, key=lambda v: v.queued() + v.pending())
        futs = []
        try:
            for item_id, data in images:
                if isinstance(data, EntryError):  # that entry's own error; the others go on
                    f = asyncio.get_running_loop().create_future()
                    f.set_result(Result(-1, item_id, error=f"{item_id}: {data}"))
                    futs.append(f)
                else:
                    futs.append(svc.submit(item_id, data))
        except BaseException:
            for f in futs:
                f.cancel()
            raise
        return list(await asyncio.gather(*futs))


def _top_k_asked(request: Request, most: int) -> int | None:
    """The request's ``?top_k=N`` (1..``most``, the server's ``--top-k``: each result's labels cut to
    N), or None. Raises HTTPError 400 for another query parameter (it would be ignored unseen), a
    second ``top_k``, or one that is no integer in range."""
    params = request.query_params
    other = next((k for k in params.keys() if k != "top_k"), None)
    if other is not None:
        raise HTTPError(400, f"unknown query parameter {other[:100]!r}: {ROUTE} takes top_k (1..{most})")
    got = params.getlist("top_k")
    if not got:
        return None
    if len(got) > 1:
        raise HTTPError(400, "top_k is given more than once")
    v = got[0]
    if not (v.isascii() and v.isdigit() and len(v) < 10 and 1 <= int(v) <= most):
        raise HTTPError(400, f"top_k must be an integer 1..{most} (the server's --top-k), got {v[:100]!r}")
    return int(v)


def add_classify_route(app, state: dict, opts, policy, reply, metrics, max_image_pixels: int, top_k: int):
    """Add ``POST /v1/classify`` to ``app``; returns its handler (``await handler(request)``: the
    response, for a caller that routes to it itself).

    Args:
        state: the app's state: ``state["ready"]`` (503 until True), ``state["classifier"]`` (the
            backend), ``state["http"]`` (the httpx client that fetches URLs).
        opts: the :class:`~fullthrottle.server.options.ServeOptions`.
        policy: the :class:`~fullthrottle.server.fetch.FetchPolicy`, or None (no URL is fetched).
        reply: ``reply(route, status, body, headers=None)``: the JSON response, counted in the metrics.
        metrics: the app's :class:`~fullthrottle.server.metrics.ServerMetrics`.
        max_image_pixels: one image's pixel limit (the pipeline's), for the request's total check.
        top_k: the labels each result holds (the pipeline's ``top_k``): the most ``?top_k=`` may ask.
    """
    # (the multipart parser's warnings on a client's malformed body, answered 400 with the reason: no
    # log line a client could write at will)
    logging.getLogger("python_multipart").setLevel(logging.CRITICAL)

    async def read_images(request: Request) -> list[tuple[str, bytes | EntryError]]:
        """(id, bytes) for every image in the request. Raises HTTPError."""
        body = await read_body(request, opts.max_body_bytes, opts.body_timeout_s)
        ctype = request.headers.get("content-type", "").split(";")[0].strip().lower()
        if ctype == "application/x-www-form-urlencoded" or (
            ctype.startswith("multipart/") and ctype != "multipart/form-data"
        ):
            raise HTTPError(
                415,
                f"Content-Type {ctype} is not accepted: send the image bytes as the body, as "
                'multipart/form-data files, or {"urls": [...]} as application/json',
            )
        if ctype == "multipart/form-data":
            boundary = request.headers.get("content-type", "").partition("boundary=")[2].split(";")[0].strip('"')
            try:
                form = await _parse_form(request, body, opts.max_images)
            except _FieldsOnly as e:
                raise HTTPError(400, f"no image in the request: {e}") from None
            except Exception as e:  # noqa: BLE001 - starlette's MultiPartException and parser errors
                if "too many files" in str(e).lower():  # (the parser stops one file past the limit)
                    raise HTTPError(413, f"more than {opts.max_images} images in one request") from None
                if "too many fields" in str(e).lower():  # (form fields that are not files: the parser's limit)
                    raise HTTPError(413, f"more than {MAX_FORM_FIELDS} form fields that are not files") from None
                if boundary and f"--{boundary}".encode() not in body:  # (an image sent as multipart, say)
                    raise HTTPError(
                        400,
                        "malformed multipart body: its boundary (Content-Type's boundary=) is nowhere in it; "
                        "send one image as the raw body, or several as multipart/form-data files",
                    ) from None
                raise HTTPError(400, f"malformed multipart body: {_multipart_reason(e)}") from None
            images = [(name, data if isinstance(data, EntryError) else await data.read()) for name, data in form]
            if not images and boundary and f"--{boundary}--".encode() not in body:
                raise HTTPError(400, "malformed multipart body: it ends before its closing boundary")
        elif ctype == "application/json":
            images = await fetch_urls(body)
        else:
            images = [("body", bytes(body))]
        if not images:
            raise HTTPError(400, "no image in the request")
        # (a multipart field is its entry's error, not an image: it takes no place of the limit)
        n = len(images) - (ctype == "multipart/form-data") * sum(isinstance(d, EntryError) for _, d in images)
        if n > opts.max_images:
            raise HTTPError(413, f"{n} images in one request; at most {opts.max_images}")
        check_pixels(images, opts.max_request_pixels, max_image_pixels)
        return images

    async def fetch_urls(body: bytes) -> list[tuple[str, bytes | EntryError]]:
        check_json_size(body)
        shape = 'the body must be {"urls": ["http(s)://...", ...]}'
        try:
            payload = parse_body(body)
        except ValueError as e:  # (the reason named: not JSON, nested too deep, a number too long, ...)
            raise HTTPError(400, f"{e}; {shape}") from None
        urls = payload.get("urls") if isinstance(payload, dict) else None
        if not isinstance(urls, list):
            raise HTTPError(400, f"wrong shape: {shape}")
        if other := sorted(set(payload) - {"urls"}):  # (a key meant as an option is not dropped unsaid)
            where = " (top_k is a query parameter: /v1/classify?top_k=N)" if "top_k" in other else ""
            raise HTTPError(400, f"unknown field {other[0]!r} in the body{where}; {shape}")
        if policy is None:
            raise HTTPError(
                400,
                "this server fetches no URLs: send the images in the body, or start it "
                "with --allow-fetch HOST|CIDR ... to let clients name URLs on those hosts",
            )
        if len(urls) > opts.max_images:
            raise HTTPError(413, f"{len(urls)} images in one request; at most {opts.max_images}")
        budget = [opts.max_request_fetch_bytes or 4 * opts.max_body_bytes]  # all of its URLs together

        async def fetch(i, u):  # (an entry that is no http(s) URL is its own error: the others go on)
            if not isinstance(u, str):
                return f"URL {i}", EntryError(f"invalid URL (a string is expected, not {json_type(u)})")
            if not u:  # (named by its place: an empty id would read as no id)
                return f"URL {i}", EntryError("invalid URL (an empty string)")
            why = _url_spelling(u)
            if why:
                return u, EntryError(why)
            try:
                return u, await policy.fetch(state["http"], u, budget)
            except Exception as e:  # noqa: BLE001 - refused or failed: the detail is for the operator only
                # (repr: a client's URL must not write lines of its own into the log; str(e), not e: its frames)
                log.warning("classify: URL %d %r not fetched: %r", i, u[:200], str(e))
                return u, EntryError(f"cannot fetch URL {i}")

        return list(await asyncio.gather(*(fetch(i, u) for i, u in enumerate(urls))))

    @app.post(ROUTE)
    async def classify(request: Request):
        t0 = time.perf_counter()
        try:
            if not state["ready"]:
                raise HTTPError(503, "model is loading", {"Retry-After": str(opts.retry_after_s)})
            if not opts.classify:
                raise HTTPError(404, "image classification is not served (the server was started with --no-classify)")
            k = _top_k_asked(request, top_k)
            try:  # (URLs fetched, or a body read, past the deadline: 504, as for the model's part)
                images = await asyncio.wait_for(read_images(request), opts.timeout_s)
            except TimeoutError:
                raise past_deadline(opts.timeout_s) from None
            n_new = sum(not isinstance(data, EntryError) for _, data in images)
            if n_new > opts.max_queue:  # (a 503 would ask for a retry that can never succeed)
                raise HTTPError(
                    413,
                    f"{n_new} images in one request; this server queues at most "
                    f"{opts.max_queue} (--max-queue): send them in smaller requests",
                )
            try:  # (past the deadline, or its client gone: its images still queued are dropped)
                results = await answer_unless_gone(
                    request, state["classifier"].classify(images), time_left(opts.timeout_s, t0), opts.timeout_s
                )
            except Overloaded as e:
                raise overloaded(e, opts.retry_after_s) from None
            except RuntimeError as e:  # (the engine loading, shutting down or stopped: a retry may find another)
                raise HTTPError(503, str(e), {"Retry-After": str(opts.retry_after_s)}) from None
            for r, (iid, _) in zip(results, images):  # (an error answered at once is no latency of the model's)
                if r.ok:
                    metrics.item_latency.observe(r.latency_ms / 1e3)
                else:
                    metrics.item_errors.labels(*error_info(r.error, iid)).inc()
            body = {
                "results": [
                    r.to_dict() | {"index": i, "id": utf8_text(iid)}  # (a lone surrogate of a URL as \\udXXX)
                    for i, (r, (iid, _)) in enumerate(zip(results, images))
                ]
            }
            if k is not None:
                for d in body["results"]:
                    if "top_k" in d:
                        d["top_k"] = d["top_k"][:k]
            status = 200
            if all(not r.ok for r in results):  # the model's fault (compute stage): 500; the input's: 422
                status = 500 if any(r.error_stage == "compute" for r in results) else 422
                body["detail"] = "; ".join(
                    utf8_text(r.error.removeprefix(f"{iid}: ")) for r, (iid, _) in zip(results, images)
                )
            return reply(ROUTE, status, body)
        except HTTPError as e:
            return reply(ROUTE, e.status, {"detail": e.detail}, e.headers)
        finally:
            metrics.latency.labels(ROUTE).observe(time.perf_counter() - t0)

    return classify


def _url_spelling(url: str) -> str | None:
    """What is wrong with a URL's own spelling for a fetch, before any lookup (safe to tell the
    client, where a refused or failed fetch is not): not http(s), or an http(s) URL that cannot name
    a host; None when it can be fetched."""
    from urllib.parse import urlsplit

    scheme = url.partition("://")[0] if "://" in url[:30] else ""
    if scheme.lower() not in ("http", "https"):
        ok = scheme[:1].isalpha() and all(c.isalnum() or c in "+-." for c in scheme)  # (RFC 3986)
        what = f"unsupported URL scheme {scheme!r}" if ok else "invalid URL"
        return f"{what} (http:// and https:// URLs are fetched)"
    why = None
    try:
        url.encode("utf-8")
        parts = urlsplit(url)
        parts.port  # noqa: B018 - (raises on a port that is no number or out of range)
    except UnicodeEncodeError:
        why = "a lone surrogate in it"
    except ValueError as e:  # ("Invalid IPv6 URL", "Port out of range 0-65535", ...)
        why = str(e)
    else:
        if not parts.hostname:
            why = "it names no host"
        elif parts.username is not None or parts.password is not None:
            why = "credentials in it are not sent"
        elif url != url.strip():
            why = "white space around it"
    return f"invalid URL ({why})" if why else None


def _multipart_reason(e: Exception) -> str:
    """What the multipart parser found wrong (starlette says only "Invalid multipart data." and keeps
    the parser's own reason as the cause)."""
    cause = e.__cause__ if e.__cause__ is not None else e
    reason = str(cause).strip() or type(cause).__name__
    if "header size" in reason.lower():
        try:
            from python_multipart import multipart
        except ImportError:  # (an older python-multipart, under another name)
            multipart = None
        limit = getattr(multipart, "DEFAULT_MAX_HEADER_SIZE", None) or getattr(multipart, "MAX_HEADER_SIZE", None)
        if not limit:
            return reason + " (a part's headers, its filename included, are limited in size)"
        return f"{reason} (a part's headers, its filename included, may hold at most {limit} bytes)"
    return reason


class _FieldsOnly(Exception):
    """A multipart body whose parts are all form fields (no filename): no image."""


async def _parse_form(request, body: bytes, max_files: int) -> list[tuple[str, object]]:
    """``(id, UploadFile or EntryError)`` for each part of a multipart body (already read and
    size-checked), in order: a part with no plain ``filename=`` (a field, or ``filename*=`` alone) is
    that entry's error. Raises _FieldsOnly when no part is a file."""
    from starlette.datastructures import UploadFile
    from starlette.formparsers import MultiPartParser

    async def stream():
        yield body
        yield b""

    parser = MultiPartParser(
        request.headers, stream(), max_files=max_files + 1, max_fields=MAX_FORM_FIELDS, max_part_size=len(body) + 1
    )
    form = await parser.parse()
    if form and not any(isinstance(v, UploadFile) for _, v in form.multi_items()):
        names = ", ".join(sorted({k for k, _ in form.multi_items()}))[:200]  # (parts with no plain filename=)
        raise _FieldsOnly(
            f"its parts ({names}) are fields, not files: give each image part a filename= (curl -F 'a=@x.jpg')"
        )
    return [
        (v.filename or f"file{i}", v)
        if isinstance(v, UploadFile)
        else (
            k,
            EntryError(f"not a file part: form field {k[:100]!r} has no plain filename= (curl -F '{k[:100]}=@x.jpg')"),
        )
        for i, (k, v) in enumerate(form.multi_items())
    ]
