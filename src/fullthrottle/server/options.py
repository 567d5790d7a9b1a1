"""The server's options (:class:`ServeOptions`, besides the pipeline's
:class:`~fullthrottle.core.config.Config`), each default stated here once: ``fullthrottle serve`` takes its
flags' defaults from these fields. Imports nothing heavy, so the CLI's ``--help`` stays fast."""

from __future__ import annotations

from dataclasses import dataclass

#: most images (files or URLs) in one classify request (the default of ServeOptions.max_images)
MAX_IMAGES_PER_REQUEST = 64
#: open connections and requests beyond this get 503 at once (``run_server``'s default)
MAX_CONNECTIONS = 1024


#: ``serve``'s --max-wait-ms (ms): a server's request waits at most this for others to join its
#: batch, at each batching stage (the GPU decoders' and the model's); the offline default
#: (``Config.max_wait_ms``) is larger, for fuller batches. See docs/performance.md (serving).
SERVE_MAX_WAIT_MS = 0.5
#: ``serve``'s --llm-max-prefill-tokens: prompt tokens prefilled per step while other requests stream
#: their tokens. The offline default (``LlmSettings.max_prefill_tokens``) is larger: fewer, fuller
#: steps, where nobody waits for a next token. A wave of prompts in one large forward delays every
#: first token and every running stream's next one (see docs/performance.md, the LLM server).
SERVE_MAX_PREFILL_TOKENS = 1024
#: ``serve``'s CPU decoder processes on CUDA with GPU decoding (--threads not given): the GPU
#: decoders take the JPEGs that find every CPU decoder busy, and the cores are left to the HTTP
#: worker processes. See docs/performance.md (serving).
SERVE_DECODER_PROCESSES = 2


def serve_threads(threads: int | None, device_type: str, gpu_decode: bool, preprocess: str) -> int | None:
    """``serve``'s ``Config.threads``: the user's ``--threads``, else :data:`SERVE_DECODER_PROCESSES`
    decoder processes on CUDA with GPU decoding, else None (``Config``'s own default)."""
    if threads is None and device_type == "cuda" and gpu_decode and preprocess != "threads":
        return SERVE_DECODER_PROCESSES
    return threads


def default_http_workers(cores: int) -> int:
    """``serve --http-workers auto``: one HTTP worker process per 2 cores, at most 8; on a machine
    of fewer than 8 cores 1, which serves from one process (no engine link)."""
    return 1 if cores < 8 else min(8, cores // 2)


@dataclass
class ServeOptions:
    """Server knobs (besides the pipeline's :class:`~fullthrottle.core.config.Config`).

    Attributes:
        max_queue: images waiting to enter the pipeline before 503 (it holds more in flight besides:
            ``Config.in_flight_limit``); a classify request with more images than this gets 413.
        timeout_s: per-request deadline (s) before 504 (a streamed completion is not cut: it runs to
            its ``max_tokens``, a stop, or its client leaving).
        max_body_bytes: request body limit (bytes) before 413.
        retry_after_s: the Retry-After header sent with 503 (s).
        url_timeout_s: timeout (s) for fetching one image URL of a JSON request (redirects included).
        allow_fetch: hosts and networks whose URLs a JSON request may name
            (:class:`~fullthrottle.server.fetch.FetchPolicy`); empty (the default): the server fetches nothing.
            Each URL reads at most ``max_body_bytes``, and all of a request's URLs together at most
            ``max_request_fetch_bytes`` (default: 4 x ``max_body_bytes``); a URL past either limit
            fails alone, and what it read no longer counts.
        api_keys: with any, every route but ``/healthz`` needs ``Authorization: Bearer KEY`` (401).
        body_timeout_s: a request body must arrive within this many seconds (408 otherwise).
        header_timeout_s: a request's line and headers must arrive within this many seconds of the
            connection opening (or of its previous response), else the connection is closed.
        max_connections_per_client: most connections open at once from one client address (one more
            is answered 503 with Retry-After, then closed).
        max_images: most images (files or URLs) in one classify request (413 over it).
        max_request_pixels: most pixels the images of one classify request hold together (413).
        embed_model: serve ``POST /v1/embeddings`` with this sentence-transformers folder ("default":
            all-MiniLM-L6-v2); None leaves the route off.
        classify: serve ``POST /v1/classify`` (the image model loads at start); False: only the
            other routes (embeddings, completions, workloads).
        workloads: :class:`~fullthrottle.core.workload.Workload` objects of the user's own, each served
            at ``POST /v1/<name>`` with cross-request batching (set up in the server's start).
        access_log: one line per request on stdout (uvicorn's access log, every HTTP worker's). Off
            by default: at thousands of requests a second its formatting and writing take an HTTP
            worker's CPU from the requests (``/metrics`` counts them by route and status).
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
    access_log: bool = False
    devices: tuple[str, ...] | None = None
    embed_model: str | None = None
    llm: object | None = None  # a (Generator, LlmText or None) pair: serves the /v1/completions routes
    llm_name: str = "llm"  # the LLM's name in /v1/models and in its answers
    workloads: tuple = ()
    classify: bool = True
