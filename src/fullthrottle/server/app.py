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
import time

from fastapi import Request  # module level: FastAPI resolves handler annotations from module globals

from ..core.config import Config, usable_cores
from ..core.workload import user_traceback
from ..workloads.classify.decode import Result
from ..workloads.classify.pipeline import Pipeline
from ..workloads.embed_api import EmbeddingsAPI
from .fetch import FetchPolicy
from .guard import HTTPError as _HTTPError
from .guard import authorised, check_pixels, head_deadline_protocol, read_body
from .metrics import ServerMetrics
from .options import MAX_CONNECTIONS, ServeOptions
from .services import BatchingService, CompletionService, Overloaded
from .startup import StartupError, startup_error_only
from .text import add_text_routes
from .workload_routes import WorkloadService, add_workload_routes

log = logging.getLogger("fullthrottle.server.app")
_ROUTES = (
    "/v1/classify",
    "/v1/embeddings",
    "/v1/completions",
    "/v1/chat/completions",
    "/v1/models",
    "/readyz",
    "/metrics",
)  # metric labels


def _default_devices(device: str) -> list[str]:
    import torch

    if device in ("auto", "cuda") and torch.cuda.is_available():
        return [f"cuda:{i}" for i in range(torch.cuda.device_count())]
    return [device]


def create_app(config: Config, options: ServeOptions | None = None, model=None):
    """The FastAPI app: ``POST /v1/classify``, ``GET /healthz``, ``GET /readyz``, ``GET /metrics``, and
    the text routes ``POST /v1/embeddings`` and ``POST /v1/completions`` (:mod:`~fullthrottle.server.text`).

    The pipeline (model load, graph capture) is built in the app's lifespan, so ``/healthz`` answers
    while ``/readyz`` says 503 until the model is ready.
    """
    import contextlib

    import httpx
    from fastapi import FastAPI
    from fastapi.responses import JSONResponse, PlainTextResponse
    from prometheus_client import CONTENT_TYPE_LATEST

    opts = options or ServeOptions()
    policy = (
        FetchPolicy(opts.allow_fetch, max_bytes=opts.max_body_bytes, timeout_s=opts.url_timeout_s)
        if opts.allow_fetch
        else None
    )
    m = ServerMetrics()
    state: dict = {"services": [], "ready": False, "t0": time.perf_counter()}
    cfg = config if not config.ordered else Config(**{**config.__dict__, "ordered": False})
    devices = list(opts.devices or _default_devices(cfg.device))
    # the workloads served through the contract (core/workload.py): embeddings, then the user's own
    workloads = [EmbeddingsAPI(None if opts.embed_model == "default" else opts.embed_model)] if opts.embed_model else []
    workloads += list(opts.workloads)

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
                pipe.on_batch = m.batch.labels("classify").observe
                services.append(BatchingService(pipe, opts.max_queue))
            return services

        try:
            state["services"] = await asyncio.to_thread(build) if opts.classify else []
        except Exception as e:  # noqa: BLE001 - one clear line (uvicorn then exits, status 3)
            raise StartupError(f"the classification model could not start: {type(e).__name__}: {e}") from None
        if state["services"] and state["services"][0].pipeline.engine.random_weights:
            log.warning("the model has random weights (no --weights given): its labels are meaningless")
        if opts.llm is not None:
            state["llm"] = CompletionService(*opts.llm, max_queue=opts.max_queue, name=opts.llm_name)
        state["workloads"] = {}
        for w in workloads:  # (embeddings, and the user's own): set up here, served at /v1/<name>
            try:
                await asyncio.to_thread(w.setup, devices[0])
            except Exception as e:  # noqa: BLE001 - the user's code: its own frames, then one clear line
                raise StartupError(f"workload {w.name!r}: setup() failed:\n{user_traceback(e)}") from None
            state["workloads"][w.name] = WorkloadService(w, opts.max_queue, m.batch.labels(w.name).observe)
        state["ready"], state["t_ready"] = True, time.perf_counter()
        # redirects are followed by the FetchPolicy, each checked; no proxy from the environment
        state["http"] = httpx.AsyncClient(timeout=opts.url_timeout_s, follow_redirects=False, trust_env=False)
        try:
            yield
        finally:
            state["ready"] = False
            await state["http"].aclose()
            for svc in state["services"]:
                await asyncio.to_thread(svc.close)
            if state.get("llm") is not None:
                await asyncio.to_thread(state["llm"].close)
            for svc in state.get("workloads", {}).values():
                await asyncio.to_thread(svc.close)

    app = FastAPI(
        title="fullthrottle",
        lifespan=lifespan,
        description="Image classification with cross-request dynamic batching on the GPU.",
    )

    def reply(route: str, status: int, body: dict, headers: dict | None = None):
        r = JSONResponse(body, status_code=status, headers=headers)  # (raises for what is not JSON: uncounted)
        m.requests.labels(route, str(status)).inc()
        return r

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
        dead = sorted(n for n, svc in state.get("workloads", {}).items() if not svc.alive)
        if dead:  # (its batching thread ended: no request of it can be answered)
            return reply("/readyz", 503, {"status": "failed", "workloads_down": dead})
        engines = [svc.pipeline.engine for svc in state["services"]]
        body = {"status": "ready", "workloads": sorted(state.get("workloads", {}))}
        if state.get("llm") is not None:  # (the LLM routes served)
            body["llm"] = state["llm"].name
        if engines:  # (classification served)
            body |= {
                "devices": [str(e.device) for e in engines],
                "model": engines[0].model_name,
                "random_weights": engines[0].random_weights,  # (labels meaningless: no --weights given)
                "graphs": [e.runner.info.format() if e.runner else f"off ({e.device.type}: eager)" for e in engines],
            }
        return reply("/readyz", 200, body)

    @app.get("/metrics")
    async def metrics():
        return PlainTextResponse(m.render(state), media_type=CONTENT_TYPE_LATEST)

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
                    # (repr: a client's URL must not write lines of its own into the log; str(e), not e: its frames)
                    log.warning("classify: URL %d %r not fetched: %r", i, u[:200], str(e))
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

    add_text_routes(app, state, opts, reply, m.requests, m.latency)
    add_workload_routes(app, workloads, state, opts, reply, m.latency)
    if opts.embed_model is None:

        @app.post("/v1/embeddings")
        async def embeddings_off():
            return reply(
                "/v1/embeddings", 404, {"detail": "embeddings are not enabled (start the server with --embed-model)"}
            )

    @app.post("/v1/classify")
    async def classify(request: Request):
        route, t0 = "/v1/classify", time.perf_counter()
        try:
            if not state["ready"]:
                raise _HTTPError(503, "model is loading", {"Retry-After": str(opts.retry_after_s)})
            if not opts.classify:
                raise _HTTPError(404, "image classification is not served (the server was started with --no-classify)")
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
                m.item_latency.observe(r.latency_ms / 1e3)
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
            m.latency.labels(route).observe(time.perf_counter() - t0)

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
    max_connections: int = MAX_CONNECTIONS,
) -> None:
    """Serve until SIGINT/SIGTERM (graceful: in-flight requests finish, each within its deadline; a
    second signal stops waiting for them), then return (exit status 0).

    ``max_connections``: open connections and requests beyond it get 503 at once (uvicorn's
    ``limit_concurrency``); idle keep-alive connections close after 5 s; a request head must arrive
    whole within ``options.header_timeout_s`` and is limited to 16 KiB (h11's default)."""
    import contextlib
    import signal

    import uvicorn

    class _Server(uvicorn.Server):
        # uvicorn re-raises the captured signal after its graceful shutdown, so the process would die
        # of SIGTERM (status -15) after draining; we drain the same way and then return normally.
        def handle_exit(self, sig, frame):
            if self.should_exit:  # a second SIGTERM or SIGINT: stop waiting for in-flight requests
                self.force_exit = True
            super().handle_exit(sig, frame)

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
    logging.getLogger("uvicorn.error").addFilter(startup_error_only)
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
