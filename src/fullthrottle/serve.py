"""Respond over HTTP: ``fullthrottle serve``. FastAPI + uvicorn in front of one long-running pipeline.

Every request's images join the same stream, so concurrent requests share batches (and graphs):

    HTTP handlers (asyncio) --bounded submission queue--> Pipeline (preprocess threads, batcher,
        compute, decode) --dispatcher thread--> the waiting request's future

Overload and faults: a full submission queue answers 503 with Retry-After; a request past its
deadline answers 504; a body over the limit 413; an image that cannot be decoded 422 with the reason.
SIGTERM (uvicorn's graceful shutdown) stops accepting, lets in-flight requests finish, exits 0.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import time
from dataclasses import dataclass

from fastapi import Request  # module level: FastAPI resolves handler annotations from module globals

from .config import Config, usable_cores
from .decode import Result
from .fetch import FetchPolicy
from .pipeline import Pipeline
from .serve_guard import HTTPError as _HTTPError
from .serve_guard import authorised, check_pixels, head_deadline_protocol, read_body
from .serve_services import BatchingService, CompletionService, EmbedService, Overloaded

MAX_IMAGES_PER_REQUEST = 64  # (the default of ServeOptions.max_images)
log = logging.getLogger("fullthrottle.serve")
_ROUTES = ("/v1/classify", "/v1/embeddings", "/v1/completions", "/readyz", "/metrics")  # metric labels
MAX_TEXTS_PER_REQUEST = 2048


def _default_devices(device: str) -> list[str]:
    import torch

    if device in ("auto", "cuda") and torch.cuda.is_available():
        return [f"cuda:{i}" for i in range(torch.cuda.device_count())]
    return [device]


@dataclass
class ServeOptions:
    """Server knobs (besides the pipeline's :class:`~fullthrottle.config.Config`).

    Attributes:
        max_queue: images waiting before 503; a classify request with more images than this gets 413.
        timeout_s: per-request deadline (s) before 504.
        max_body_bytes: request body limit (bytes) before 413.
        retry_after_s: the Retry-After header sent with 503 (s).
        url_timeout_s: timeout (s) for fetching one image URL of a JSON request (redirects included).
        allow_fetch: hosts and networks whose URLs a JSON request may name
            (:class:`~fullthrottle.fetch.FetchPolicy`); empty (the default): the server fetches nothing.
            Each URL reads at most ``max_body_bytes``, and all of a request's URLs together at most
            ``max_request_fetch_bytes`` (default: 4 x ``max_body_bytes``); a URL past either limit
            fails alone, and what it read no longer counts.
        api_keys: with any, every route but ``/healthz`` needs ``Authorization: Bearer KEY`` (401).
        body_timeout_s: a request body must arrive within this many seconds (408 otherwise).
        header_timeout_s: a request's line and headers must arrive within this many seconds of the
            connection opening (or of its previous response), else the connection is closed.
        max_connections_per_client: most connections open at once from one client address (more are
            closed as they open).
        max_images: most images (files or URLs) in one classify request (413 over it).
        max_request_pixels: most pixels the images of one classify request hold together (413).
        embed_model: serve ``POST /v1/embeddings`` with this sentence-transformers folder ("default":
            all-MiniLM-L6-v2); None leaves the route off.
        devices: one model replica (its own pipeline) per device; default: every visible GPU when the
            config's device is "auto"/"cuda" and CUDA exists, else the config's device. Each request
            goes to the replica with the fewest images waiting.
    """

    max_queue: int = 256
    timeout_s: float = 30.0
    max_body_bytes: int = 32 * 1024 * 1024
    retry_after_s: int = 1
    url_timeout_s: float = 10.0
    allow_fetch: tuple[str, ...] = ()
    api_keys: tuple[str, ...] = ()
    body_timeout_s: float = 10.0
    header_timeout_s: float = 10.0
    max_connections_per_client: int = 64
    max_images: int = MAX_IMAGES_PER_REQUEST
    max_request_pixels: int = 1_000_000_000
    max_request_fetch_bytes: int | None = None
    devices: tuple[str, ...] | None = None
    embed_model: str | None = None
    llm: object | None = None  # a (Generator, tokenizer or None) pair: serves POST /v1/completions


def create_app(config: Config, options: ServeOptions | None = None, model=None):
    """The FastAPI app: ``POST /v1/classify``, ``GET /healthz``, ``GET /readyz``, ``GET /metrics``.

    The pipeline (model load, graph capture) is built in the app's lifespan, so ``/healthz`` answers
    while ``/readyz`` says 503 until the model is ready.
    """
    import contextlib

    import httpx
    from fastapi import FastAPI
    from fastapi.responses import JSONResponse, PlainTextResponse
    from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge, Histogram, generate_latest

    opts = options or ServeOptions()
    policy = (
        FetchPolicy(opts.allow_fetch, max_bytes=opts.max_body_bytes, timeout_s=opts.url_timeout_s)
        if opts.allow_fetch
        else None
    )
    reg = CollectorRegistry()
    m_requests = Counter("fullthrottle_requests", "HTTP requests", ["route", "status"], registry=reg)
    m_latency = Histogram(
        "fullthrottle_request_latency_seconds",
        "request latency (s)",
        ["route"],
        registry=reg,
        buckets=(0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30),
    )
    m_queue_wait = Histogram(
        "fullthrottle_item_latency_seconds",
        "per-image latency in the pipeline (s)",
        registry=reg,
        buckets=(0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 5),
    )
    m_batch = Histogram(
        "fullthrottle_batch_size",
        "batch sizes formed by the batcher",
        registry=reg,
        buckets=(1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024),
    )
    m_queued = Gauge("fullthrottle_queue_images", "images waiting to enter the pipeline", ["replica"], registry=reg)
    m_pending = Gauge("fullthrottle_pending_images", "images submitted and not yet answered", ["replica"], registry=reg)
    m_busy = Gauge("fullthrottle_stage_busy_percent", "stage busy % since start", ["replica", "stage"], registry=reg)
    m_gpu = Gauge("fullthrottle_gpu_utilization_percent", "GPU utilisation (NVML)", ["replica"], registry=reg)
    m_gpu_mem = Gauge("fullthrottle_gpu_memory_used_bytes", "GPU memory used (NVML)", ["replica"], registry=reg)
    state: dict = {"services": [], "ready": False, "t0": time.perf_counter()}
    cfg = config if not config.ordered else Config(**{**config.__dict__, "ordered": False})
    devices = list(opts.devices or _default_devices(cfg.device))

    @contextlib.asynccontextmanager
    async def lifespan(app):
        def build():
            import copy

            services = []
            # the cores are shared: by default each replica gets its share of preprocess threads
            threads = cfg.threads or max(1, usable_cores() // len(devices))
            for dev in devices:
                pipe = Pipeline(
                    Config(**{**cfg.__dict__, "device": dev, "threads": threads}),
                    model=copy.deepcopy(model) if model is not None else None,
                )
                pipe.on_batch = m_batch.observe
                services.append(BatchingService(pipe, opts.max_queue))
            return services

        state["services"] = await asyncio.to_thread(build)
        if opts.llm is not None:
            state["llm"] = CompletionService(*opts.llm, max_queue=opts.max_queue)
        if opts.embed_model is not None:
            from .embed import Embedder

            path = None if opts.embed_model == "default" else opts.embed_model
            state["embed_name"] = "all-MiniLM-L6-v2" if path is None else os.path.basename(os.path.normpath(path))
            state["embed"] = EmbedService(await asyncio.to_thread(Embedder, path, devices[0]), max_queue=opts.max_queue)
        state["ready"] = True
        # redirects are followed by the FetchPolicy, each checked; no proxy from the environment
        state["http"] = httpx.AsyncClient(timeout=opts.url_timeout_s, follow_redirects=False, trust_env=False)
        try:
            yield
        finally:
            state["ready"] = False
            await state["http"].aclose()
            for svc in state["services"]:
                await asyncio.to_thread(svc.close)
            if state.get("embed") is not None:
                await asyncio.to_thread(state["embed"].close)
            if state.get("llm") is not None:
                await asyncio.to_thread(state["llm"].close)

    app = FastAPI(
        title="fullthrottle",
        lifespan=lifespan,
        description="Image classification with cross-request dynamic batching on the GPU.",
    )

    def reply(route: str, status: int, body: dict, headers: dict | None = None):
        m_requests.labels(route, str(status)).inc()
        return JSONResponse(body, status_code=status, headers=headers)

    if opts.api_keys:

        @app.middleware("http")
        async def require_key(request: Request, call_next):
            if request.url.path != "/healthz" and not authorised(request.headers.get("authorization"), opts.api_keys):
                # (answered before the body is read: the connection closes, the body is never taken in)
                return reply(
                    request.url.path if request.url.path in _ROUTES else "other",
                    401,
                    {"detail": "missing or wrong API key: send Authorization: Bearer KEY"},
                    {"WWW-Authenticate": "Bearer", "Connection": "close"},
                )
            return await call_next(request)

    @app.get("/healthz")
    async def healthz():
        return reply("/healthz", 200, {"status": "alive"})

    @app.get("/readyz")
    async def readyz():
        if not state["ready"]:
            return reply("/readyz", 503, {"status": "loading"})
        engines = [svc.pipeline.engine for svc in state["services"]]
        return reply(
            "/readyz",
            200,
            {
                "status": "ready",
                "devices": [str(e.device) for e in engines],
                "model": engines[0].model_name,
                "graphs": [e.runner.info.format() if e.runner else None for e in engines],
            },
        )

    @app.get("/metrics")
    async def metrics():
        for i, svc in enumerate(state["services"]):
            rep = str(i)
            m_queued.labels(rep).set(svc.queued())
            m_pending.labels(rep).set(svc.pending())
            run = svc.pipeline.current_run
            if run is not None:
                wall = time.perf_counter() - run.t0
                for st in run.stats.values():
                    snap = st.snapshot(wall)
                    m_busy.labels(rep, snap["stage"]).set(
                        snap["worker_busy_pct"] if snap["stage"] == "preprocess" else snap["busy_pct"]
                    )
                mon = run.gpumon
                if mon.utils:
                    m_gpu.labels(rep).set(mon.utils[-1])
                    m_gpu_mem.labels(rep).set(mon.mems[-1])
        return PlainTextResponse(generate_latest(reg), media_type=CONTENT_TYPE_LATEST)

    async def read_images(request: Request) -> list[tuple[str, bytes]]:
        """(id, bytes) for every image in the request. Raises _HTTPError."""
        body = await read_body(request, opts.max_body_bytes, opts.body_timeout_s)
        ctype = request.headers.get("content-type", "").split(";")[0].strip().lower()
        if ctype == "multipart/form-data":
            try:
                form = await _parse_form(request, body, opts.max_images)
            except Exception as e:  # noqa: BLE001 - starlette's MultiPartException and parser errors
                raise _HTTPError(400, f"malformed multipart body: {e}") from None
            images = [(f.filename or f"file{i}", await f.read()) for i, f in enumerate(form)]
            boundary = request.headers.get("content-type", "").partition("boundary=")[2].split(";")[0].strip('"')
            if not images and boundary and f"--{boundary}--".encode() not in body:
                raise _HTTPError(400, "malformed multipart body: it ends before its closing boundary")
        elif ctype == "application/json":
            try:
                payload = json.loads(body)
                urls = payload.get("urls") if isinstance(payload, dict) else None
                if not isinstance(urls, list) or not all(isinstance(u, str) for u in urls):
                    raise ValueError
            except (ValueError, RecursionError) as e:  # (RecursionError: JSON nested thousands deep)
                what = "wrong shape" if type(e) is ValueError else "malformed JSON"
                raise _HTTPError(400, f'{what}: the body must be {{"urls": ["http(s)://...", ...]}}') from None
            if policy is None:
                raise _HTTPError(
                    400,
                    "this server fetches no URLs: send the images in the body, or start it "
                    "with --allow-fetch HOST|CIDR ... to let clients name URLs on those hosts",
                )
            if len(urls) > opts.max_images:
                raise _HTTPError(413, f"{len(urls)} images in one request; at most {opts.max_images}")
            for u in urls:
                if not u.startswith(("http://", "https://")):
                    raise _HTTPError(400, f"not an http(s) URL: {u[:200]}")
            budget = [opts.max_request_fetch_bytes or 4 * opts.max_body_bytes]  # all of its URLs together

            async def fetch(i, u):
                try:
                    return u, await policy.fetch(state["http"], u, budget)
                except Exception as e:  # noqa: BLE001 - refused or failed: the detail is for the operator only
                    log.warning("classify: URL %d (%s) not fetched: %s", i, u[:200], str(e))  # (not e: its frames)
                    return u, _FetchError(f"cannot fetch URL {i}")

            images = list(await asyncio.gather(*(fetch(i, u) for i, u in enumerate(urls))))
        else:
            images = [("body", bytes(body))]
        if not images:
            raise _HTTPError(400, "no image in the request")
        if len(images) > opts.max_images:
            raise _HTTPError(413, f"{len(images)} images in one request; at most {opts.max_images}")
        check_pixels(images, opts.max_request_pixels, cfg.max_image_pixels)
        return images

    @app.post("/v1/embeddings")
    async def embeddings(request: Request):
        """OpenAI embeddings shape: ``{"input": str | [str], "model": ...}`` -> ``{"data": [...]}``."""
        route, t0 = "/v1/embeddings", time.perf_counter()
        try:
            svc = state.get("embed")
            if svc is None:
                raise _HTTPError(404, "embeddings are not enabled (start the server with --embed-model)")
            body = await request.body()
            if len(body) > opts.max_body_bytes:
                raise _HTTPError(413, f"request body exceeds the limit of {opts.max_body_bytes} bytes")
            try:
                payload = json.loads(body)
                texts = payload.get("input") if isinstance(payload, dict) else None
            except ValueError:
                texts = None
            texts = [texts] if isinstance(texts, str) else texts
            if not isinstance(texts, list) or not texts or not all(isinstance(t, str) for t in texts):
                raise _HTTPError(400, 'JSON body must be {"input": "text" | ["text", ...]}')
            if len(texts) > MAX_TEXTS_PER_REQUEST:
                raise _HTTPError(413, f"{len(texts)} texts in one request; at most {MAX_TEXTS_PER_REQUEST}")
            try:
                fut = svc.submit(texts)
            except Overloaded as e:
                raise _HTTPError(503, f"overloaded: {e}", {"Retry-After": str(opts.retry_after_s)}) from None
            try:
                vecs, trunc, toks = await asyncio.wait_for(fut, opts.timeout_s)
            except TimeoutError:
                raise _HTTPError(504, f"deadline of {opts.timeout_s:g} s exceeded") from None
            data = [
                {"object": "embedding", "index": i, "embedding": v.tolist(), "truncated": bool(t)}
                for i, (v, t) in enumerate(zip(vecs, trunc))
            ]
            n_tok = int(toks.sum())
            return reply(
                route,
                200,
                {
                    "object": "list",
                    "data": data,
                    "model": state["embed_name"],
                    "usage": {"prompt_tokens": n_tok, "total_tokens": n_tok},
                },
            )
        except _HTTPError as e:
            return reply(route, e.status, {"detail": e.detail}, e.headers)
        finally:
            m_latency.labels(route).observe(time.perf_counter() - t0)

    @app.post("/v1/completions")
    async def completions(request: Request):
        """OpenAI completions subset: prompt (text, or a list of token ids), max_tokens, temperature,
        top_p, top_k, seed, stream (server-sent events, one chunk per few tokens)."""
        from fastapi.responses import StreamingResponse

        route, t0 = "/v1/completions", time.perf_counter()
        try:
            svc = state.get("llm")
            if svc is None:
                raise _HTTPError(404, "completions are not enabled (start the server with --llm-model-dir)")
            try:
                p = json.loads(await request.body())
                if not isinstance(p, dict):
                    raise ValueError
            except ValueError:
                raise _HTTPError(400, "JSON object body required") from None
            prompt = p.get("prompt")
            if isinstance(prompt, str):
                if svc.tok is None:
                    raise _HTTPError(400, "this model has no tokenizer: send prompt as a list of token ids")
                ids = svc.tok.encode(prompt).ids
            elif (
                isinstance(prompt, list)
                and prompt
                and all(isinstance(i, int) and not isinstance(i, bool) for i in prompt)
            ):
                ids = prompt
            else:
                raise _HTTPError(400, "prompt must be a string or a non-empty list of token ids")
            vocab = svc.gen.model.cfg.vocab_size
            max_tokens = p.get("max_tokens", 16)
            if not isinstance(max_tokens, int) or max_tokens < 1:
                raise _HTTPError(400, "max_tokens must be a positive integer")
            if any(i < 0 or i >= vocab for i in ids):
                raise _HTTPError(400, f"token ids must be in [0, {vocab})")
            if len(ids) + max_tokens > svc.gen.max_seq_len:
                raise _HTTPError(
                    400,
                    f"prompt ({len(ids)} tokens) + max_tokens ({max_tokens}) exceeds the "
                    f"context of {svc.gen.max_seq_len}",
                )
            if not isinstance(p.get("stream", False), bool):
                raise _HTTPError(400, "stream must be true or false")
            try:
                svc.gen.check_sampling(
                    float(p.get("temperature", 1.0)), int(p.get("top_k", 0)), float(p.get("top_p", 1.0))
                )
            except (TypeError, ValueError) as e:
                raise _HTTPError(400, str(e)) from None
            eos = svc.gen.model.cfg.eos_token_id
            req = {
                "ids": ids,
                "max_tokens": max_tokens,
                "temperature": float(p.get("temperature", 1.0)),
                "top_p": float(p.get("top_p", 1.0)),
                "top_k": int(p.get("top_k", 0)),
                "seed": p.get("seed"),
                "eos": eos[0] if isinstance(eos, list) else eos,
            }
            try:
                out = svc.submit(req)
            except Overloaded as e:
                raise _HTTPError(503, f"overloaded: {e}", {"Retry-After": str(opts.retry_after_s)}) from None

            def text(toks):
                return svc.tok.decode(toks) if svc.tok is not None else None

            if p.get("stream"):

                async def events():
                    last = None
                    try:
                        while True:
                            item = await out.get()
                            if item is None or isinstance(item, Exception):
                                break
                            last = item[-1]
                            chunk = {
                                "object": "text_completion",
                                "choices": [{"index": 0, "text": text(item), "token_ids": item, "finish_reason": None}],
                            }
                            yield f"data: {json.dumps(chunk)}\n\n"
                    finally:  # also when the client disconnects mid-stream: stop generating for it
                        req["cancelled"] = True
                    finish = (
                        "error"
                        if isinstance(item, Exception)
                        else "stop"
                        if req["eos"] is not None and last == req["eos"]
                        else "length"
                    )
                    end = {
                        "object": "text_completion",
                        "choices": [{"index": 0, "text": "", "token_ids": [], "finish_reason": finish}],
                    }
                    yield f"data: {json.dumps(end)}\n\n"
                    yield "data: [DONE]\n\n"

                m_requests.labels(route, "200").inc()
                return StreamingResponse(events(), media_type="text/event-stream")
            toks: list[int] = []
            deadline = t0 + opts.timeout_s
            try:
                while True:
                    try:
                        item = await asyncio.wait_for(out.get(), max(deadline - time.perf_counter(), 0.001))
                    except TimeoutError:
                        raise _HTTPError(504, f"deadline of {opts.timeout_s:g} s exceeded") from None
                    if item is None:
                        break
                    if isinstance(item, Exception):
                        raise _HTTPError(500, f"generation failed: {item}")
                    toks += item
            finally:  # answered, timed out (504) or cancelled: generate no more for it
                req["cancelled"] = True
            finish = "stop" if req["eos"] is not None and toks and toks[-1] == req["eos"] else "length"
            return reply(
                route,
                200,
                {
                    "object": "text_completion",
                    "choices": [{"index": 0, "text": text(toks), "token_ids": toks, "finish_reason": finish}],
                    "usage": {
                        "prompt_tokens": len(ids),
                        "completion_tokens": len(toks),
                        "total_tokens": len(ids) + len(toks),
                    },
                },
            )
        except _HTTPError as e:
            return reply(route, e.status, {"detail": e.detail}, e.headers)
        finally:
            m_latency.labels(route).observe(time.perf_counter() - t0)

    @app.post("/v1/classify")
    async def classify(request: Request):
        route, t0 = "/v1/classify", time.perf_counter()
        try:
            if not state["ready"]:
                raise _HTTPError(503, "model is loading", {"Retry-After": str(opts.retry_after_s)})
            images = await read_images(request)
            n_new = sum(not isinstance(data, _FetchError) for _, data in images)
            if n_new > opts.max_queue:  # (a 503 would ask for a retry that can never succeed)
                raise _HTTPError(
                    413,
                    f"{n_new} images in one request; this server queues at most "
                    f"{opts.max_queue} (--max-queue): send them in smaller requests",
                )
            svc = min(state["services"], key=lambda v: v.queued() + v.pending())
            futs = []
            try:
                for item_id, data in images:
                    if isinstance(data, _FetchError):  # that URL's own error; the others go on
                        f = asyncio.get_running_loop().create_future()
                        f.set_result(Result(-1, item_id, error=f"{item_id}: {data}"))
                        futs.append(f)
                    else:
                        futs.append(svc.submit(item_id, data))
            except Overloaded as e:
                for f in futs:
                    f.cancel()
                raise _HTTPError(503, f"overloaded: {e}", {"Retry-After": str(opts.retry_after_s)}) from None
            except RuntimeError as e:
                raise _HTTPError(503, str(e)) from None
            remaining = opts.timeout_s - (time.perf_counter() - t0)
            try:
                results = await asyncio.wait_for(asyncio.gather(*futs), max(remaining, 0.001))
            except TimeoutError:
                raise _HTTPError(504, f"deadline of {opts.timeout_s:g} s exceeded") from None
            for r in results:
                m_queue_wait.observe(r.latency_ms / 1e3)
            body = {
                "results": [
                    r.to_dict() | {"index": i, "id": iid} for i, (r, (iid, _)) in enumerate(zip(results, images))
                ]
            }
            status = 422 if all(not r.ok for r in results) else 200
            if status == 422:
                body["detail"] = "; ".join(r.error.removeprefix(f"{iid}: ") for r, (iid, _) in zip(results, images))
            return reply(route, status, body)
        except _HTTPError as e:
            return reply(route, e.status, {"detail": e.detail}, e.headers)
        finally:
            m_latency.labels(route).observe(time.perf_counter() - t0)

    return app


class _FetchError(str):
    """A URL of a JSON request that could not be fetched (that image's error)."""


async def _parse_form(request, body: bytes, max_files: int):
    """The uploaded files of a multipart body (already read and size-checked)."""
    from starlette.datastructures import UploadFile
    from starlette.formparsers import MultiPartParser

    async def stream():
        yield body
        yield b""

    parser = MultiPartParser(request.headers, stream(), max_files=max_files + 1, max_part_size=len(body) + 1)
    form = await parser.parse()
    return [v for _, v in form.multi_items() if isinstance(v, UploadFile)]


def run_server(
    config: Config,
    host: str = "127.0.0.1",
    port: int = 8000,
    options: ServeOptions | None = None,
    max_connections: int = 1024,
) -> None:
    """Serve until SIGINT/SIGTERM (graceful: in-flight requests finish), then return (exit status 0).

    ``max_connections``: open connections and requests beyond it get 503 at once (uvicorn's
    ``limit_concurrency``); idle keep-alive connections close after 5 s; a request head must arrive
    whole within ``options.header_timeout_s`` and is limited to 16 KiB (h11's default)."""
    import contextlib
    import signal

    import uvicorn

    class _Server(uvicorn.Server):
        # uvicorn re-raises the captured signal after its graceful shutdown, so the process would die
        # of SIGTERM (status -15) after draining; we drain the same way and then return normally.
        @contextlib.contextmanager
        def capture_signals(self):
            sigs = (signal.SIGINT, signal.SIGTERM)
            old = {s: signal.signal(s, self.handle_exit) for s in sigs}
            try:
                yield
            finally:
                for s, h in old.items():
                    signal.signal(s, h)

    opts = options or ServeOptions()
    _Server(
        uvicorn.Config(
            create_app(config, opts),
            host=host,
            port=port,
            log_level="info",
            timeout_graceful_shutdown=opts.timeout_s,
            limit_concurrency=max_connections,
            timeout_keep_alive=5,
            http=head_deadline_protocol(opts.header_timeout_s, opts.max_connections_per_client),
        )
    ).run()
