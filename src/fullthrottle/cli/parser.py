"""The ``fullthrottle`` argument parser: every command, its options and their help."""

from __future__ import annotations

import argparse
import re

from .. import __version__
from ..core.env import describe as describe_env
from ..server.options import MAX_CONNECTIONS, SERVE_DECODER_PROCESSES, SERVE_MAX_WAIT_MS, ServeOptions
from .generate_args import add_generate_parser
from .options import (
    RAY_ACTORS,
    RAY_REPLICAS,
    add_access_log_arg,
    add_llm_serve_args,
    add_runtime_args,
    add_runtime_flags,
    body_mb,
    megapixels,
    port_number,
    positive_float,
    positive_int,
    positive_int_list,
    torchvision_model,
)

_SO = ServeOptions  # (its fields' defaults are serve's flags' defaults)
MAX_HTTP_WORKERS = 64


def _http_workers(s: str) -> int | str:
    """``--http-workers``: ``auto`` (sized to this machine's cores by ``serve``) or 1 <= N <= 64."""
    if s == "auto":
        return s
    n = positive_int(s)
    if n > MAX_HTTP_WORKERS:
        raise argparse.ArgumentTypeError(f"at most {MAX_HTTP_WORKERS} HTTP worker processes, got {n}")
    return n


class _Parser(argparse.ArgumentParser):
    """argparse's parser (its subcommands' too), whose "expected one argument" also says how to give a
    value that starts with '-' (``--tokens -1,2``, ``--prompt "-x"``): argparse reads it as an option."""

    def error(self, message: str):
        m = re.match(r"argument (--[\w-]+)(?:/\S+)?: expected one argument$", message)
        if m:
            message += f" (to give one that starts with '-': {m.group(1)}=VALUE)"
        super().error(message)


def build_parser() -> argparse.ArgumentParser:
    p = _Parser(
        prog="fullthrottle",
        description="GPU inference that keeps the GPU busy: load (asyncio) -> preprocess (threads or "
        "worker processes) -> dynamic batching -> model on the device -> top-k on the device.",
        epilog="Environment variables:\n" + describe_env(),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    sub = p.add_subparsers(dest="command", required=True, metavar="COMMAND")
    c = sub.add_parser(
        "classify",
        help="classify images (files, folders, globs, URLs) with a model of the registry (--model)",
        description="Classify images and print each one's top-k labels. With no INPUT, classifies a few "
        "sample photos that ship with scikit-image. The default model, efficientnet_lite0, "
        "comes with its ImageNet weights; a model without bundled weights and without --weights is "
        "randomly initialised and its labels are meaningless (the output says so).",
        epilog="Exit status: 0 all items ok; 1 some item failed (see its error), or stdout's reader left (| head); 2 usage or "
        "configuration error, or --out / --report-json cannot be written; 130 interrupted (Ctrl-C); 143 on SIGTERM.",
    )
    c.add_argument(
        "inputs",
        nargs="*",
        metavar="INPUT",
        help="image file, folder, glob or http(s) URL; -: these from stdin, a line each",
    )
    add_runtime_args(c, "--batch-size", "max batch size")
    c.add_argument("--compile", action="store_true", help="torch.compile the model before graph capture; slow start")
    c.add_argument("--out", help="write one JSON line per item to this file ('-' for stdout)")
    c.add_argument("--unordered", action="store_true", help="emit results in completion order")
    c.add_argument("--no-progress", action="store_true", help="no progress bar")
    c.add_argument(
        "--report-json",
        help="write the run summary (rates, latency, stages) as JSON here ('-': stdout, when --out is a file)",
    )
    c.add_argument(
        "--ray",
        nargs="?",
        const="local",
        default=None,
        metavar="ADDRESS",
        help="run as a Ray Data job (a local Ray cluster, or the one at ADDRESS): files and folders "
        "every node sees (a URL is its item's error), the lines of a local run with each one's node, "
        "no --report-json; needs pip install 'fullthrottle[ray]'",
    )
    c.add_argument("--ray-actors", type=positive_int, help=f"with --ray: actors (default {RAY_ACTORS})")
    v = sub.add_parser(
        "serve",
        help="HTTP API with cross-request dynamic batching, Prometheus metrics, overload control",
        description='Serve POST /v1/classify (raw image body, multipart files, or JSON {"urls": [...]}), '
        "?top_k=N for fewer labels; GET /healthz, /readyz, /metrics. Concurrent requests share batches. Full queue: 503 "
        "with Retry-After; past the deadline: 504; body too large: 413; undecodable image: its own error (422 if no image of the request got a result). "
        "Also POST /v1/embeddings (--embed-model), OpenAI's /v1/completions, /v1/chat/completions and "
        "GET /v1/models (--llm-model-dir, or --llm-random for random weights) and a route per "
        "--workload (batched by the workload's own limits; the image flags below are classify's). "
        "SIGTERM finishes in-flight requests (each within --timeout-s), then exits 0; a second "
        "SIGTERM stops waiting.",
        epilog="Exit status: 0 after SIGTERM/SIGINT; 2 usage or configuration error, or the start failed (a "
        "port in use, a bad --workload, a model that could not load, a workload's setup() raising); 3 HTTP "
        "worker processes kept dying (a worker that dies is replaced; several in a row that die within seconds "
        "of their start stop the server).",
    )
    v.add_argument("--host", default="127.0.0.1", help="bind address (default: %(default)s, local only)")
    v.add_argument("--port", type=port_number, default=8000, help="port (default: %(default)s; 0 picks a free one)")
    v.add_argument(
        "--max-queue",
        type=positive_int,
        default=_SO.max_queue,
        help="images (or a workload's requests, or completions not yet taken in by the LLM's step loop, "
        "which takes them between steps) waiting to enter the model's pipeline before 503 (the "
        "pipeline holds more in flight besides, being decoded and batched: about 4 batches of "
        "--max-batch-size, and 4 more per GPU decoder process); a request with more images than this "
        "can never fit (413) (default: %(default)s; --max-images is the usual per-request limit)",
    )
    v.add_argument(
        "--timeout-s",
        type=positive_float,
        default=_SO.timeout_s,
        help="per-request deadline before 504; a streamed completion, whose answer starts at once, "
        "is not cut: it runs to its max_tokens, a stop or its client leaving (default: %(default)s)",
    )
    v.add_argument(
        "--max-body-mb",
        type=body_mb,
        default=_SO.max_body_bytes / 2**20,
        help="request body limit before 413, MiB (default: %(default)s)",
    )
    v.add_argument(
        "--allow-fetch",
        nargs="+",
        action="extend",
        default=[],
        metavar="HOST|CIDR",
        help="let JSON requests name image URLs on these hosts (their public addresses) or "
        "networks (10.0.0.0/8, 192.168.1.7: private ones only when named so); default: the "
        "server fetches nothing. Names not listed are not even resolved; every address a listed name resolves to is checked and the "
        "connection made to it; redirects (at most 3) are checked the same way",
    )
    v.add_argument(
        "--api-key",
        action="append",
        default=[],
        metavar="KEY",
        help="require Authorization: Bearer KEY on every route but /healthz (repeatable; also "
        "$FULLTHROTTLE_API_KEY, comma-separated, and --api-key-file)",
    )
    v.add_argument("--api-key-file", default=None, metavar="FILE", help="API keys, one per line")
    v.add_argument(
        "--body-timeout-s",
        type=positive_float,
        default=_SO.body_timeout_s,
        help="a request body must arrive within this time, else 408 (default: %(default)s)",
    )
    v.add_argument(
        "--header-timeout-s",
        type=positive_float,
        default=_SO.header_timeout_s,
        help="a request's line and headers must arrive within this time, else the connection "
        "is closed (default: %(default)s)",
    )
    v.add_argument(
        "--max-images",
        type=positive_int,
        default=_SO.max_images,
        help="most images (files or URLs) per classify request, else 413 (default: %(default)s)",
    )
    v.add_argument(
        "--max-request-megapixels",
        type=megapixels,
        default=_SO.max_request_pixels / 1e6,
        help="most pixels the images of one request hold together, else 413 (default: %(default)s)",
    )
    v.add_argument(
        "--max-connections",
        type=positive_int,
        default=MAX_CONNECTIONS,
        help="open connections beyond this get 503 at once (per HTTP worker process) (default: %(default)s)",
    )
    v.add_argument(
        "--http-workers",
        type=_http_workers,
        default="auto",
        metavar="N|auto",
        help="HTTP worker processes that parse, check and answer requests in front of one engine "
        "process (the models, graphs and decoders); 1 serves from one process; auto: one per 2 "
        "cores, at most 8, and 1 below 8 cores (default: %(default)s)",
    )
    v.add_argument(
        "--max-connections-per-client",
        type=positive_int,
        default=_SO.max_connections_per_client,
        help="connections one client address may hold open (per HTTP worker); one more is "
        "answered 503 with Retry-After, then closed, and logged. Behind a proxy, or with a load generator on one machine, "
        "all clients share one address: raise this (default: %(default)s)",
    )
    add_runtime_args(
        v,
        "--max-batch-size",
        "classify: largest batch the batcher forms across requests (a workload batches by its own limits)",
        device_help="auto | cpu | cuda | cuda:N: the models', and where workloads' setup() loads theirs",
        max_wait_ms=SERVE_MAX_WAIT_MS,
        threads_help=f"{SERVE_DECODER_PROCESSES} decoder processes on CUDA with GPU decoding, which takes the "
        "JPEGs that find them busy; else one per CPU core, or one per core but one with processes",
    )
    v.add_argument(
        "--gpus", default=None, help="'all' or N: one model replica per GPU (default with --device auto: every GPU)"
    )
    v.add_argument(
        "--ray",
        action="store_true",
        help="deploy on Ray Serve (one replica per GPU; --replicas); needs fullthrottle[ray]",
    )
    v.add_argument("--replicas", type=positive_int, help=f"with --ray: Ray Serve replicas (default {RAY_REPLICAS})")
    add_access_log_arg(v)
    add_llm_serve_args(v)
    v.add_argument(
        "--embed-model",
        default=None,
        metavar="DIR|default",
        help="also serve POST /v1/embeddings with this sentence-transformers folder ('default': all-MiniLM-L6-v2)",
    )
    v.add_argument(
        "--classify",
        action=argparse.BooleanOptionalAction,
        default=_SO.classify,
        help="serve POST /v1/classify (the image model loads at start); --no-classify serves only the "
        "other routes, such as --workload or --embed-model (default: on)",
    )
    v.add_argument(
        "--workload",
        action="append",
        default=[],
        metavar="MODULE:CLASS",
        help="also serve a workload of your own (a fullthrottle.Workload subclass: setup, decode_request, "
        "predict, encode_response) at POST /v1/<its name>, batched across requests; repeatable; "
        "MODULE is imported from the current folder or the Python path; the image model is served "
        "beside it unless --no-classify",
    )
    add_generate_parser(sub)
    m = sub.add_parser(
        "embed",
        help="text embeddings (sentence-transformers models; all-MiniLM-L6-v2 by default)",
        description="Embed one text per line of FILE (or '-': stdin, plain text; a .jsonl FILE's lines are "
        'JSON strings or {"text": ...}). Writes JSON lines ({"index", "truncated", "embedding"}) or a .npy '
        "(N, dim) float32 array. Texts longer than the model's max_seq_length are truncated, "
        'as sentence-transformers does, and flagged. A .jsonl line that is no text gets {"index", "error"} '
        "(a row of NaN in a .npy). Exit status: 0, 1 if a line failed or stdout's reader left (| head), 2 on a usage or model error, "
        "130 on Ctrl-C, 143 on SIGTERM (what was embedded by then is written: the lines so far, or a .npy "
        "of the first texts).",
    )
    m.add_argument("file", metavar="FILE|-")
    m.add_argument("--model-dir", default=None, help="sentence-transformers folder (default: all-MiniLM-L6-v2)")
    m.add_argument("--out", required=True, help="output: .npy or .jsonl, or - (JSON lines on stdout)")
    m.add_argument("--report-json", help="write the run summary (rates, stages, GPU use) as JSON here ('-': stdout)")
    add_runtime_flags(
        m,
        "device",
        "dtype",
        "graphs",
        help={
            "dtype": "compute dtype on CUDA (default: float16 on CUDA, float32 on CPU)",
            "graphs": "CUDA graphs per batch bucket (CUDA only; default: on)",
        },
    )
    m.add_argument("--no-progress", action="store_true", help="no progress bar")
    w = sub.add_parser(
        "run",
        help="answer requests offline with a workload of your own (fullthrottle.Workload): JSON lines in and out",
        description="Answer one JSON request body per line of FILE (or '-' for stdin) with a workload "
        "(MODULE:CLASS, a fullthrottle.Workload subclass, as serve --workload takes): the same "
        "decode_request, batches by count and cost, predict and encode_response as POST /v1/<name>. "
        'Writes one JSON line per request, in order: {"line": N, "response": {...}} or {"line": N, '
        '"error": "..."}.',
        epilog="Exit status: 0 every request answered; 1 some request failed (see its error), or stdout's reader left "
        "(| head); 2 usage "
        "error (a bad --workload, a file that cannot be read, setup() failed); 130 on Ctrl-C, 143 on SIGTERM.",
    )
    w.add_argument("file", metavar="FILE|-", help="one JSON object (a request body) per line")
    w.add_argument("--workload", required=True, metavar="MODULE:CLASS", help="the workload to run")
    w.add_argument(
        "--out",
        default="-",
        metavar="FILE",
        help="JSON lines out (default: stdout; written once the workload is set up)",
    )
    add_runtime_flags(w, "device", help={"device": "where setup() loads the model: auto | cpu | cuda | cuda:N"})
    w.add_argument(
        "--ray", action="store_true", help="run in Ray Data actors (a local Ray cluster unless --ray-address)"
    )
    w.add_argument("--ray-address", default=None, metavar="ADDRESS", help="with --ray: the cluster to join")
    w.add_argument("--ray-actors", type=positive_int, metavar="N", help=f"with --ray: actors (default {RAY_ACTORS})")
    b = sub.add_parser(
        "bench",
        help="reproduce the field's experiments (threads, batch, transfer, e2e): JSON + PNG",
        description="Run one experiment side by side on this machine and write PREFIX.json (machine, "
        "versions, command, every point) and PREFIX.png. --quick makes a small CPU run.",
    )
    bsub = b.add_subparsers(dest="experiment", required=True, metavar="EXPERIMENT")
    helps = {
        "threads": "decode+resize img/s vs thread count: GIL-releasing kernels vs pure Python",
        "batch": "model img/s vs batch size: CPU, GPU eager fp32/bf16, CUDA graphs (, compile)",
        "transfer": "H2D + model: pageable blocking, pinned non_blocking, copy stream 2 in flight (CUDA)",
        "e2e": "images to top-5: fullthrottle vs naive loop vs DataLoader (PIL, OpenCV)",
    }
    for name, text in helps.items():
        e = bsub.add_parser(name, help=text, description=text)
        e.add_argument("--out", default=None, help="output prefix (default: fullthrottle-bench-EXPERIMENT)")
        e.add_argument(
            "--quick",
            action="store_true",
            help="a small, fast run (what CI runs on CPU): smaller defaults; the flags given are kept"
            + ("; needs CUDA even so" if name == "transfer" else ""),
        )
        if name in ("threads", "e2e"):
            e.add_argument(
                "--images",
                nargs="*",
                default=None,
                help="image files/folders/globs (default: scikit-image's sample photos)",
            )
        if name == "threads":
            e.add_argument(
                "--threads", type=positive_int_list, default=None, help="comma list (default: 1,2,4,... up to 2x cores)"
            )
            e.add_argument("--seconds", type=positive_float, default=None, help="per point (default: 2; --quick: 0.3)")
        if name in ("batch", "transfer"):
            e.add_argument(
                "--batches",
                type=positive_int_list,
                default=None,
                help="comma list of batch sizes (default: "
                + ("1,2,4,...,1024" if name == "batch" else "1,8,32,128,512")
                + "; --quick: "
                + ("1,2)" if name == "batch" else "1,8)"),
            )
            e.add_argument(
                "--model", type=torchvision_model, default="resnet18", help="torchvision model (default: %(default)s)"
            )
        if name == "batch":
            e.add_argument("--compile", action="store_true", help="also torch.compile + graphs (slow start)")
        if name == "e2e":
            e.add_argument(
                "--n", type=positive_int, default=None, help="images per method (default: 20000; --quick: 48)"
            )
            e.add_argument(
                "--workers",
                type=positive_int,
                default=None,
                help="DataLoader workers and fullthrottle threads (default: cores; --quick: 2)",
            )
            e.add_argument(
                "--batch",
                type=positive_int,
                default=None,
                help="batch size, the same for every method (default: 128; --quick: 4)",
            )
            add_runtime_flags(e, "device")
            e.add_argument(
                "--model", type=torchvision_model, default="resnet18", help="torchvision model (default: %(default)s)"
            )
    return p
