"""Respond over HTTP: ``fullthrottle serve``. FastAPI + uvicorn in front of one long-running pipeline.

Every request's images join the same stream, so concurrent requests share batches (and graphs):

    HTTP handlers (asyncio) --bounded submission queue--> Pipeline (preprocess threads, batcher,
        compute, decode) --dispatcher thread--> the waiting request's future

Overload and faults: a full submission queue answers 503 with Retry-After; a request past its
deadline answers 504; a body over the limit 413; an image that cannot be decoded 422 with the reason; a request whose
images all failed in the model (it raised, or gave NaN/Inf) 500.
SIGTERM (uvicorn's graceful shutdown) stops accepting, lets in-flight requests finish, exits 0.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import time

from ..core.config import Config, usable_cores
from ..core.workload import check_stats, user_traceback
from ..workloads.classify.pipeline import Pipeline
from ..workloads.embed_api import EmbeddingsAPI
from .classify_route import LocalClassifier, add_classify_route
from .fetch import FetchPolicy
from .guard import error_body, set_busy
from .http_layer import NO_DOCS, add_basics, uvicorn_server
from .metrics import ServerMetrics
from .options import MAX_CONNECTIONS, ServeOptions
from .services import BatchingService, CompletionService
from .startup import StartupError
from .text import add_text_routes, end_streams_in
from .workload_routes import WorkloadService, add_workload_routes

log = logging.getLogger("fullthrottle.server.app")


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
    from fastapi.responses import PlainTextResponse
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
            state["classifier"] = LocalClassifier(state["services"])
            # (the heap trim: the pipeline's own memory, held until the last image is answered)
            set_busy(lambda: any(v.queued() or v.pending() for v in state["services"]), work=True)
        except Exception as e:  # noqa: BLE001 - one clear line (uvicorn then exits; serve: status 2)
            raise StartupError(f"the classification model could not start: {type(e).__name__}: {e}") from None
        if state["services"] and state["services"][0].pipeline.engine.random_weights:
            log.warning("the model has random weights (no --weights given): its labels are meaningless")
        if opts.llm is not None:
            state["llm"] = CompletionService(*opts.llm, max_queue=opts.max_queue, name=opts.llm_name)
        state["workloads"] = {}
        for w in workloads:  # (embeddings, and the user's own): set up here, served at /v1/<name>
            try:  # (a KeyboardInterrupt in that thread is the workload's own: signals reach the main thread)
                await asyncio.to_thread(w.setup, devices[0])
            except (Exception, SystemExit, KeyboardInterrupt) as e:  # noqa: BLE001 - the user's code: its own frames, then one clear line
                raise StartupError(f"workload {w.name!r}: setup() failed:\n{user_traceback(e)}") from None
            try:
                check_stats(w)
            except ValueError as e:
                raise StartupError(str(e)) from None
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
        redirect_slashes=False,  # (/v1/classify/ is 404: a redirect would name the client's Host header)
        **NO_DOCS,
    )

    reply = add_basics(app, m.requests, opts.api_keys)

    @app.api_route("/readyz", methods=["GET", "HEAD"])
    async def readyz():
        if not state["ready"]:
            return reply("/readyz", 503, {"status": "loading"})
        dead = sorted(n for n, svc in state.get("workloads", {}).items() if not svc.alive)
        if dead:  # (its batching thread ended: no request of it can be answered)
            return reply("/readyz", 503, {"status": "failed", "workloads_down": dead})
        failed = {str(i): str(svc.error) for i, svc in enumerate(state["services"]) if svc.error is not None}
        if failed:  # (a replica's pipeline died: its requests get 503 "the pipeline failed")
            return reply("/readyz", 503, {"status": "failed", "classify_replicas_down": failed})
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

    @app.api_route("/metrics", methods=["GET", "HEAD"])
    async def metrics():
        m.requests.labels("/metrics", "200").inc()  # (counted as every answer is, this one included)
        return PlainTextResponse(m.render(state), media_type=CONTENT_TYPE_LATEST)

    add_text_routes(app, state, opts, reply, m.requests, m.latency, m.ttft)
    add_workload_routes(app, workloads, state, opts, reply, m.latency)
    if opts.embed_model is None:

        @app.post("/v1/embeddings")
        async def embeddings_off():
            why = "embeddings are not enabled (start the server with --embed-model)"
            return reply("/v1/embeddings", 404, error_body(404, why, openai=True))

    add_classify_route(app, state, opts, policy, reply, m, cfg.max_image_pixels, cfg.top_k)
    app.state.ft = state  # (the engine process of a multi-process server serves from it)
    app.state.requests_counter = m.requests
    return app


def run_server(
    config: Config,
    host: str = "127.0.0.1",
    port: int = 8000,
    options: ServeOptions | None = None,
    max_connections: int = MAX_CONNECTIONS,
) -> None:
    """Serve until SIGINT/SIGTERM (graceful: in-flight requests finish, each within its deadline; a
    second signal stops waiting for them), then return (exit status 0).

    ``max_connections``: a connection opened while this many are open gets 503 (Retry-After) for its
    requests and is closed; those open before it go on; idle keep-alive connections close after 5 s; a request head must arrive
    whole within ``options.header_timeout_s`` and is limited to 16 KiB (h11's default)."""
    opts = options or ServeOptions()
    app = create_app(config, opts)
    drain = functools.partial(end_streams_in, app.state.ft)  # (streams end cleanly before the drain does)
    uvicorn_server(app, opts, max_connections, on_drain=drain, host=host, port=port).run()
