"""The ``fullthrottle`` command line.

Exit status of ``fullthrottle classify``: 0 every item classified; 1 at least one item failed
(its error is in the output); 2 bad usage or configuration (unknown model, weights that do not fit,
CUDA asked for but absent) or an output file that cannot be written; 130 interrupted (Ctrl-C).
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import io
import json
import os
import sys
import time

from .config import GPU_DECODERS, Config, torch_dtype, usable_cores
from .env import describe as describe_env
from .models import DEFAULT_MODEL, MODELS

SAMPLE_PHOTOS = ("chelsea.png", "coffee.png", "astronaut.png", "rocket.jpg", "motorcycle_left.png")


def sample_photos() -> list[str]:
    """Paths of a few real photos that ship with scikit-image (no download).

    Raises:
        FileNotFoundError: scikit-image is not installed.
    """
    spec = importlib.util.find_spec("skimage")
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            "no inputs given and scikit-image (whose sample photos are the "
            "default inputs) is not installed: pass image paths or URLs"
        )
    data = os.path.join(list(spec.submodule_search_locations)[0], "data")
    return [os.path.join(data, name) for name in SAMPLE_PHOTOS if os.path.exists(os.path.join(data, name))]


def _positive_int(s: str) -> int:
    v = int(s)
    if v < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {v}")
    return v


def _add_gpu_decode_args(p: argparse.ArgumentParser) -> None:
    """--gpu-decode, --gpu-decoder and --gpu-decode-processes (classify and serve)."""
    p.add_argument(
        "--gpu-decode",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="also decode JPEGs on the GPU (default on CUDA: on): with decoder processes, a JPEG "
        "goes to the GPU whenever no CPU worker is idle; with threads, split by measured "
        "rates. --no-gpu-decode: decode on the CPU only",
    )
    p.add_argument(
        "--mps",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="with GPU decoding on CUDA: run this command's GPU work as clients of a private CUDA "
        "MPS server, started for the command and stopped after it, so that the GPU decoder "
        "processes' kernels and the model's run at once instead of time-slicing the GPU "
        "(default: off; nothing is started when an MPS server is already running, or "
        "without an NVIDIA driver, and the run says why)",
    )
    p.add_argument(
        "--gpu-decoder",
        default=None,
        choices=GPU_DECODERS,
        help="with --gpu-decode: 'hardware' = the GPU's JPEG engines via nvImageCodec (pip install "
        "nvidia-nvimgcodec-cu13; A100/H100/H200); 'nvjpeg' = torchvision's nvJPEG, which on those GPUs "
        "also sends baseline JPEGs to the engines (its hardware backend) and decodes the rest "
        "with Huffman decoding on the CPU; 'auto' = hardware when available, else nvjpeg. "
        f"Default: {Config.gpu_decoder}",
    )
    p.add_argument(
        "--gpu-decode-processes",
        type=int,
        default=None,
        metavar="N",
        help="with --gpu-decode and decoder processes: processes decoding on the GPU, each its own "
        "decoder, 0..16 (0: one GPU decode thread in this process; default: 8 when a CUDA MPS "
        "server is running, else 6)",
    )


def _gpu_decode_settings(args) -> dict:
    """``Config`` fields of the GPU-decode options; a note on stderr when --gpu-decoder or
    --gpu-decode-processes is given with --no-gpu-decode (they would do nothing)."""
    given = [
        f
        for f, v in (("--gpu-decoder", args.gpu_decoder), ("--gpu-decode-processes", args.gpu_decode_processes))
        if v is not None
    ]
    on = Config.gpu_decode if args.gpu_decode is None else args.gpu_decode
    if given and not on:
        print(
            f"note: {' and '.join(given)} {'has' if len(given) == 1 else 'have'} no effect with --no-gpu-decode",
            file=sys.stderr,
        )
        return {"gpu_decode": False}  # (ignored: not checked either, as the note says)
    n = args.gpu_decode_processes
    if n is not None and not 0 <= n <= 16:
        raise ValueError(f"--gpu-decode-processes must be in 0..16, got {n}")
    return {
        "gpu_decode": on,
        "gpu_decoder": args.gpu_decoder if args.gpu_decoder is not None else Config.gpu_decoder,
        "gpu_decode_processes": args.gpu_decode_processes,
    }  # (None: the Pipeline picks, by MPS)


_MODEL_HELP = (
    "; ".join(f"{name}: {m.about}" for name, m in MODELS.items())
    + ". Each model brings its own resize, crop and normalisation (default: %(default)s)"
)
_WEIGHTS_HELP = (
    "state dict file: .safetensors, or .pth loaded with weights_only=True (no code is "
    "unpickled), e.g. torchvision's own checkpoint resnet50-11ad3fa6.pth from torch's hub cache "
    "(~/.cache/torch/hub/checkpoints/); default: the model's bundled weights, or none "
    "(random weights, fixed seed: labels are then meaningless)"
)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="fullthrottle",
        description="GPU inference that keeps the GPU busy: load (asyncio) -> preprocess (threads or "
        "worker processes) -> "
        "dynamic batching -> model on the device -> top-k on the device.",
        epilog="Environment variables:\n" + describe_env(),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    sub = p.add_subparsers(dest="command", required=True, metavar="COMMAND")
    c = sub.add_parser(
        "classify",
        help="classify images (files, folders, globs, URLs): EfficientNet-Lite0 or a ResNet",
        description="Classify images and print top-k ImageNet labels. With no INPUT, classifies a few "
        "sample photos that ship with scikit-image. The default model, efficientnet_lite0, "
        "comes with its ImageNet weights; a ResNet without --weights is randomly "
        "initialised and its labels are meaningless (the output says so).",
        epilog="Exit status: 0 all items ok; 1 some item failed (see its error); 2 usage or "
        "configuration error, or --out / --report-json cannot be written; 130 interrupted.",
    )
    c.add_argument(
        "inputs", nargs="*", metavar="INPUT", help="image file, folder (recursive), glob pattern or http(s) URL"
    )
    c.add_argument("--model", default=DEFAULT_MODEL, choices=tuple(MODELS), metavar="MODEL", help=_MODEL_HELP)
    c.add_argument("--weights", metavar="FILE", help=_WEIGHTS_HELP)
    c.add_argument("--batch-size", type=_positive_int, default=64, help="max batch size (default: %(default)s)")
    c.add_argument(
        "--max-wait-ms", type=float, default=5.0, help="how long a batch may wait to fill, ms (default: %(default)s)"
    )
    c.add_argument(
        "--threads",
        type=_positive_int,
        default=None,
        help="preprocess threads, or decoder processes with --preprocess processes (default: one "
        "per CPU core; with processes, one per core but one, left to this process's threads)",
    )
    c.add_argument(
        "--preprocess",
        default="auto",
        choices=("auto", "threads", "processes"),
        help="decode in threads of this process, or in --threads worker processes fed by one "
        "dispatcher thread, outside this process's GIL (auto: processes on CUDA, threads on CPU)",
    )
    c.add_argument("--device", default="auto", help="auto | cpu | cuda | cuda:N (default: %(default)s)")
    c.add_argument(
        "--dtype",
        default=None,
        choices=("float32", "bfloat16", "float16"),
        help="compute dtype on CUDA (default: bfloat16 on CUDA; CPU always float32)",
    )
    c.add_argument(
        "--graphs",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="replay the model as CUDA graphs, one per batch bucket (CUDA only; default: on)",
    )
    _add_gpu_decode_args(c)
    c.add_argument(
        "--compile",
        action="store_true",
        help="torch.compile the model (kernel fusion) before graph capture; slow start",
    )
    c.add_argument("--top-k", type=_positive_int, default=5, help="classes per image (default: %(default)s)")
    c.add_argument("--out", help="write one JSON line per item to this file ('-' for stdout)")
    c.add_argument("--unordered", action="store_true", help="emit results in completion order")
    c.add_argument("--no-progress", action="store_true", help="no progress bar")
    c.add_argument("--report-json", help="write the run summary (rates, latency, stages) as JSON here")
    c.add_argument(
        "--ray",
        nargs="?",
        const="local",
        default=None,
        metavar="ADDRESS",
        help="run as a Ray Data job (a local Ray cluster, or the one at ADDRESS); "
        "needs pip install 'fullthrottle[ray]'",
    )
    c.add_argument("--ray-actors", type=_positive_int, default=2, help="Ray actors (one per GPU)")
    v = sub.add_parser(
        "serve",
        help="HTTP API with cross-request dynamic batching, Prometheus metrics, overload control",
        description='Serve POST /v1/classify (raw image body, multipart files, or JSON {"urls": [...]}), '
        "GET /healthz, /readyz, /metrics. Concurrent requests share batches. Full queue: 503 "
        "with Retry-After; past the deadline: 504; body too large: 413; undecodable image: 422. "
        "SIGTERM finishes in-flight requests, then exits 0.",
    )
    v.add_argument("--model", default=DEFAULT_MODEL, choices=tuple(MODELS), metavar="MODEL", help=_MODEL_HELP)
    v.add_argument("--weights", metavar="FILE", help=_WEIGHTS_HELP)
    v.add_argument("--host", default="127.0.0.1", help="bind address (default: %(default)s, local only)")
    v.add_argument("--port", type=int, default=8000, help="port (default: %(default)s; 0 picks a free one)")
    v.add_argument(
        "--max-batch-size",
        type=_positive_int,
        default=64,
        help="largest batch the batcher forms across requests (default: %(default)s)",
    )
    v.add_argument(
        "--max-wait-ms",
        type=float,
        default=5.0,
        help="longest a partial batch waits for more images (default: %(default)s)",
    )
    v.add_argument(
        "--max-queue",
        type=_positive_int,
        default=256,
        help="images waiting before 503; a request with more images than this can never fit (413) "
        "(default: %(default)s; --max-images is the usual per-request limit)",
    )
    v.add_argument(
        "--timeout-s", type=float, default=30.0, help="per-request deadline before 504 (default: %(default)s)"
    )
    v.add_argument(
        "--max-body-mb", type=float, default=32.0, help="request body limit before 413, MiB (default: %(default)s)"
    )
    v.add_argument(
        "--allow-fetch",
        nargs="+",
        action="extend",
        default=[],
        metavar="HOST|CIDR",
        help="let JSON requests name image URLs on these hosts (their public addresses) or "
        "networks (10.0.0.0/8, 192.168.1.7: private ones only when named so); default: the "
        "server fetches nothing. Every address a name resolves to is checked and the "
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
        type=float,
        default=10.0,
        help="a request body must arrive within this time, else 408 (default: %(default)s)",
    )
    v.add_argument(
        "--header-timeout-s",
        type=float,
        default=10.0,
        help="a request's line and headers must arrive within this time, else the connection "
        "is closed (default: %(default)s)",
    )
    v.add_argument(
        "--max-images",
        type=_positive_int,
        default=64,
        help="most images (files or URLs) per classify request, else 413 (default: %(default)s)",
    )
    v.add_argument(
        "--max-request-megapixels",
        type=float,
        default=1000.0,
        help="most pixels the images of one request hold together, else 413 (default: %(default)s)",
    )
    v.add_argument(
        "--max-connections",
        type=_positive_int,
        default=1024,
        help="open connections beyond this get 503 at once (default: %(default)s)",
    )
    v.add_argument(
        "--max-connections-per-client",
        type=_positive_int,
        default=64,
        help="connections one client address may hold open; more are closed as they open "
        "(behind a proxy every client has its address: raise this) (default: %(default)s)",
    )
    v.add_argument(
        "--threads",
        type=_positive_int,
        default=None,
        help="preprocess threads (default: one per core; with worker processes, one per core but one)",
    )
    v.add_argument(
        "--preprocess",
        default="auto",
        choices=("auto", "threads", "processes"),
        help="decode in threads of this process, or in --threads worker processes fed by one "
        "dispatcher thread (auto: processes on CUDA)",
    )
    v.add_argument("--device", default="auto", help="auto, cpu, cuda or cuda:N (default: %(default)s)")
    v.add_argument(
        "--gpus", default=None, help="'all' or N: one model replica per GPU (default with --device auto: every GPU)"
    )
    v.add_argument(
        "--dtype",
        default=None,
        choices=("float32", "bfloat16", "float16"),
        help="compute dtype on CUDA (default: bfloat16; the CPU always computes in float32)",
    )
    v.add_argument(
        "--graphs",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="replay the model as CUDA graphs per batch bucket (CUDA only; default: on)",
    )
    v.add_argument("--top-k", type=_positive_int, default=5, help="classes per image (default: %(default)s)")
    _add_gpu_decode_args(v)
    v.add_argument(
        "--ray",
        action="store_true",
        help="deploy on Ray Serve (one replica per GPU; --replicas); needs fullthrottle[ray]",
    )
    v.add_argument(
        "--replicas", type=_positive_int, default=1, help="Ray Serve replicas (with --ray; default: %(default)s)"
    )
    v.add_argument(
        "--llm-model-dir",
        default=None,
        metavar="DIR",
        help="also serve POST /v1/completions with this Hugging Face Llama folder",
    )
    v.add_argument(
        "--llm-max-batch", type=_positive_int, default=8, help="LLM rows per decode batch (default: %(default)s)"
    )
    v.add_argument(
        "--llm-max-seq-len",
        type=_positive_int,
        default=None,
        help="LLM context (KV cache) length (default: the model's, at most 4096)",
    )
    v.add_argument(
        "--embed-model",
        default=None,
        metavar="DIR|default",
        help="also serve POST /v1/embeddings with this sentence-transformers folder ('default': all-MiniLM-L6-v2)",
    )
    g = sub.add_parser(
        "generate",
        help="LLM text generation (Llama family) with a static KV cache and CUDA graphs",
        description="Generate from a Hugging Face Llama folder (config.json + safetensors, tokenizer.json "
        "for text), or from a randomly initialised config (--random) for benchmarks. Tokens "
        "stream to stdout as they are produced.",
    )
    src = g.add_mutually_exclusive_group(required=True)
    src.add_argument("--model-dir", help="Hugging Face Llama folder (config.json, *.safetensors)")
    src.add_argument("--random", choices=("tiny", "llama2-7b"), help="random weights of this shape")
    g.add_argument("--prompt", help="text (needs tokenizer.json in --model-dir)")
    g.add_argument("--tokens", help="comma-separated prompt token ids (instead of --prompt)")
    g.add_argument(
        "--max-new-tokens", type=_positive_int, default=64, help="tokens to generate per prompt (default: %(default)s)"
    )
    g.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    g.add_argument("--top-k", type=int, default=0, help="0 = off")
    g.add_argument("--top-p", type=float, default=1.0, help="1.0 = off")
    g.add_argument("--seed", type=int, default=None, help="sampling seed (same seed, same tokens)")
    g.add_argument("--device", default="auto", help="auto, cpu, cuda or cuda:N (default: %(default)s)")
    g.add_argument(
        "--dtype",
        default=None,
        choices=("float32", "bfloat16", "float16"),
        help="default: bfloat16 on CUDA, float32 on CPU",
    )
    g.add_argument(
        "--max-seq-len", type=_positive_int, default=None, help="KV cache length (default: prompt + max new tokens)"
    )
    g.add_argument(
        "--graphs",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="CUDA graphs for the decode step (one replay per token; CUDA only; default: on)",
    )
    m = sub.add_parser(
        "embed",
        help="text embeddings (sentence-transformers models; all-MiniLM-L6-v2 by default)",
        description="Embed one text per line of FILE (or '-' for stdin; .jsonl lines may be "
        '{"text": ...}). Writes JSON lines (text index, truncated flag, vector) or a .npy '
        "(N, dim) float32 array. Texts longer than the model's max_seq_length are truncated, "
        "as sentence-transformers does, and flagged.",
    )
    m.add_argument("file", metavar="FILE|-")
    m.add_argument("--model-dir", default=None, help="sentence-transformers folder (default: all-MiniLM-L6-v2)")
    m.add_argument("--out", required=True, help="output: .npy or .jsonl")
    m.add_argument("--device", default="auto", help="auto, cpu, cuda or cuda:N (default: %(default)s)")
    m.add_argument(
        "--dtype",
        default=None,
        choices=("float32", "bfloat16", "float16"),
        help="default: float16 on CUDA, float32 on CPU",
    )
    m.add_argument(
        "--graphs",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="CUDA graphs per batch bucket (CUDA only; default: on)",
    )
    m.add_argument("--no-progress", action="store_true", help="no progress bar")
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
            "--quick", action="store_true", help="a small, fast run (what CI runs on CPU; transfer needs CUDA even so)"
        )
        if name in ("threads", "e2e"):
            e.add_argument(
                "--images",
                nargs="*",
                default=None,
                help="image files/folders/globs (default: scikit-image's sample photos)",
            )
        if name == "threads":
            e.add_argument("--threads", default=None, help="comma list (default: 1,2,4,... up to 2x cores)")
            e.add_argument("--seconds", type=float, default=2.0, help="per point (default: %(default)s)")
        if name in ("batch", "transfer"):
            e.add_argument("--batches", default=None, help="comma list of batch sizes")
            e.add_argument("--model", default="resnet18", help="torchvision model (default: %(default)s)")
        if name == "batch":
            e.add_argument("--compile", action="store_true", help="also torch.compile + graphs (slow start)")
        if name == "e2e":
            e.add_argument("--n", type=_positive_int, default=20000, help="images per method (default: %(default)s)")
            e.add_argument(
                "--workers",
                type=_positive_int,
                default=usable_cores(),
                help="DataLoader workers and fullthrottle threads (default: cores)",
            )
            e.add_argument(
                "--batch",
                type=_positive_int,
                default=128,
                help="batch size, the same for every method (default: %(default)s)",
            )
            e.add_argument("--device", default="auto", help="auto, cpu, cuda or cuda:N (default: %(default)s)")
            e.add_argument("--model", default="resnet18", help="torchvision model (default: %(default)s)")
    return p


def _blobs(paths: list[str] | None) -> list[bytes]:
    from .load import BadSource, expand
    from .preprocess import ImageError, preprocess

    paths = paths or sample_photos()
    out = []
    for _, p in expand(paths):
        if isinstance(p, (str, BadSource)):
            continue
        data = p.read_bytes()
        try:
            preprocess(data)
        except ImageError as e:  # a benchmark measures images, not errors: say which and go on
            print(f"fullthrottle bench: skipping {p}: {e}", file=sys.stderr)
            continue
        out.append(data)
    if not out:
        raise FileNotFoundError(f"no image files found in {paths}")
    return out


def _ints(s: str | None, default: list[int]) -> list[int]:
    try:
        vals = [int(x) for x in s.split(",")] if s else default
    except ValueError:
        raise ValueError(f"expected comma-separated integers, got {s!r}") from None
    if any(v < 1 for v in vals):
        raise ValueError(f"expected positive integers, got {s!r}")
    return vals


def _check_port_free(host: str, port: int) -> None:
    """ValueError when ``host:port`` cannot be listened on (in use, not an address of this machine)."""
    import socket

    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except socket.gaierror as e:
        raise ValueError(f"cannot listen on {host}:{port}: {e.strerror or e}") from None
    fam, _, _, _, addr = infos[0]
    with socket.socket(fam, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind(addr)
        except OSError as e:
            raise ValueError(f"cannot listen on {host}:{port}: {e.strerror or e}") from None


def cmd_serve(args) -> int:
    from .compute import resolve_device
    from .config import Config
    from .serve import ServeOptions, run_server

    try:
        device = resolve_device(args.device)
        cfg = Config(
            model=args.model,
            weights=args.weights,
            device=str(device),
            dtype=args.dtype or ("bfloat16" if device.type == "cuda" else "float32"),
            max_batch_size=args.max_batch_size,
            max_wait_ms=args.max_wait_ms,
            threads=args.threads,
            top_k=args.top_k,
            graphs=args.graphs,
            ordered=False,
            **_gpu_decode_settings(args),
            preprocess=args.preprocess,
        )
        if args.weights is not None and not os.path.isfile(args.weights):
            raise FileNotFoundError(f"weights file not found: {args.weights}")
        if (
            min(
                args.timeout_s,
                args.max_body_mb,
                args.body_timeout_s,
                args.header_timeout_s,
                args.max_request_megapixels,
            )
            <= 0
        ):
            raise ValueError(
                "--timeout-s, --max-body-mb, --body-timeout-s, --header-timeout-s and "
                "--max-request-megapixels must be > 0"
            )
        from .fetch import FetchPolicy
        from .serve_guard import load_keys

        FetchPolicy(tuple(args.allow_fetch))  # (checks every entry now)
        keys = load_keys(args.api_key, args.api_key_file)
        _check_port_free(args.host, args.port)  # before the model loads, not after
        devices = None
        if args.gpus is not None:
            import torch

            count = torch.cuda.device_count()
            want = count if args.gpus == "all" else int(args.gpus)
            if want < 1 or want > count:
                raise ValueError(f"--gpus {args.gpus}: this machine has {count} CUDA device(s)")
            devices = tuple(f"cuda:{i}" for i in range(want))
    except (ValueError, RuntimeError, FileNotFoundError) as e:
        print(f"fullthrottle: error: {e}", file=sys.stderr)
        return 2
    guard = dict(
        allow_fetch=tuple(args.allow_fetch),
        api_keys=keys,
        body_timeout_s=args.body_timeout_s,
        header_timeout_s=args.header_timeout_s,
        max_connections_per_client=args.max_connections_per_client,
        max_images=args.max_images,
        max_request_pixels=int(args.max_request_megapixels * 1e6),
    )
    if args.host not in ("127.0.0.1", "localhost", "::1") and not keys:
        print(f"note: serving on {args.host} without --api-key: anyone who can reach it may use it", file=sys.stderr)
    if args.weights is None and MODELS[args.model].bundled_weights is None:
        print(
            f"WARNING: no --weights given: {args.model} is randomly initialised, labels are meaningless",
            file=sys.stderr,
        )
    llm = None
    if args.llm_model_dir:
        import torch

        from .generate import Generator
        from .llama import load_hf

        try:
            model = load_hf(args.llm_model_dir, device, torch.bfloat16 if device.type == "cuda" else torch.float32)
        except (FileNotFoundError, ValueError) as e:
            print(f"fullthrottle: error: {e}", file=sys.stderr)
            return 2
        tok = None
        tj = os.path.join(args.llm_model_dir, "tokenizer.json")
        if os.path.isfile(tj):
            from tokenizers import Tokenizer

            tok = Tokenizer.from_file(tj)
        try:
            seq = args.llm_max_seq_len or min(model.cfg.max_position_embeddings, 4096)
            llm = (Generator(model, args.llm_max_batch, seq, graphs=args.graphs), tok)
        except ValueError as e:
            print(f"fullthrottle: error: {e}", file=sys.stderr)
            return 2
    if args.ray:
        if importlib.util.find_spec("ray") is None:
            print("fullthrottle: error: --ray needs Ray Serve: pip install 'fullthrottle[ray]'", file=sys.stderr)
            return 2
        from .ray_jobs import serve_on_ray

        serve_on_ray(
            cfg,
            ServeOptions(
                max_queue=args.max_queue,
                timeout_s=args.timeout_s,
                max_body_bytes=int(args.max_body_mb * 2**20),
                **guard,
            ),
            replicas=args.replicas,
            host=args.host,
            port=args.port,
        )
        return 0
    run_server(
        cfg,
        args.host,
        args.port,
        ServeOptions(
            max_queue=args.max_queue,
            timeout_s=args.timeout_s,
            max_body_bytes=int(args.max_body_mb * 2**20),
            devices=devices,
            embed_model=args.embed_model,
            llm=llm,
            **guard,
        ),
        max_connections=args.max_connections,
    )
    return 0


def _llama_bytes(cfg, dtype) -> int:
    """Bytes of a Llama's weights (embedding, blocks, norms, lm_head unless tied) in ``dtype``."""
    import torch

    h, i, d = cfg.hidden_size, cfg.intermediate_size, cfg.head_dim
    block = (
        h * (cfg.num_attention_heads + 2 * cfg.num_key_value_heads) * d
        + cfg.num_attention_heads * d * h
        + 3 * h * i
        + 2 * h
    )
    n = cfg.vocab_size * h * (1 if cfg.tie_word_embeddings else 2) + cfg.num_hidden_layers * block + h
    return n * torch.empty((), dtype=dtype).element_size()


def _check_memory_for(cfg, device, dtype, free: int | None = None) -> None:
    """ValueError before building a model whose weights cannot fit in the memory free on ``device``
    (``free`` bytes; by default read from CUDA or /proc/meminfo's MemAvailable)."""
    import torch

    need = _llama_bytes(cfg, dtype)
    if free is None and device.type == "cuda":
        free = torch.cuda.mem_get_info(device)[0]
    elif free is None:
        try:
            with open("/proc/meminfo", encoding="ascii") as f:
                free = next(int(line.split()[1]) * 1024 for line in f if line.startswith("MemAvailable:"))
        except (OSError, StopIteration, ValueError):
            pass
    if free is not None and need > free:
        raise ValueError(
            f"the weights need {need / 2**30:.1f} GiB in {str(dtype).replace('torch.', '')} on "
            f"{device}, but only {free / 2**30:.1f} GiB is free"
            + (" (try --device cuda, or --dtype bfloat16)" if device.type == "cpu" else "")
        )


def cmd_generate(args) -> int:
    import torch

    from .compute import resolve_device
    from .generate import GenerateStats, Generator
    from .llama import Llama, LlamaConfig, load_hf

    try:
        device = resolve_device(args.device)
        dtype = torch_dtype(args.dtype or ("bfloat16" if device.type == "cuda" else "float32"))
        tok = None
        if args.model_dir:
            if not os.path.isdir(args.model_dir):
                raise ValueError(f"model folder not found: {args.model_dir}")
            try:
                model = load_hf(args.model_dir, device, dtype)
                tj = os.path.join(args.model_dir, "tokenizer.json")
                if os.path.isfile(tj):
                    from tokenizers import Tokenizer

                    tok = Tokenizer.from_file(tj)
            except (ValueError, FileNotFoundError):
                raise
            except Exception as e:  # noqa: BLE001 - a corrupt config, shard or tokenizer.json
                raise ValueError(f"cannot load the model from {args.model_dir}: {type(e).__name__}: {e}") from None
        else:
            cfg = (
                LlamaConfig.llama2_7b()
                if args.random == "llama2-7b"
                else LlamaConfig(
                    vocab_size=512,
                    hidden_size=128,
                    intermediate_size=344,
                    num_hidden_layers=4,
                    num_attention_heads=4,
                    num_key_value_heads=2,
                )
            )
            _check_memory_for(cfg, device, dtype)
            torch.manual_seed(0)
            with torch.device(device):
                model = Llama(cfg).to(dtype).eval()
            print("WARNING: random weights: the tokens are meaningless", file=sys.stderr)
        if args.tokens and args.prompt is not None:
            raise ValueError("give either --prompt or --tokens, not both")
        if args.tokens:
            try:
                ids = [int(x) for x in args.tokens.split(",")]
            except ValueError:
                raise ValueError(f"--tokens must be comma-separated integers, got {args.tokens!r}") from None
        elif args.prompt is not None:
            if tok is None:
                raise ValueError("--prompt needs a tokenizer.json in --model-dir; give --tokens instead")
            ids = tok.encode(args.prompt).ids
        else:
            raise ValueError("give --prompt TEXT or --tokens IDS")
        if any(i < 0 or i >= model.cfg.vocab_size for i in ids):
            raise ValueError(f"token ids must be in [0, {model.cfg.vocab_size})")
        eos = model.cfg.eos_token_id
        eos = eos[0] if isinstance(eos, list) else eos
        t0 = time.perf_counter()
        gen = Generator(
            model, max_batch=1, max_seq_len=args.max_seq_len or len(ids) + args.max_new_tokens, graphs=args.graphs
        )
        ready_s = time.perf_counter() - t0
        st = GenerateStats()

        stop_id = eos if args.model_dir else None
        finished = [False]

        def show(chunks):
            if finished[0]:
                return
            toks = chunks[0]
            if stop_id is not None and stop_id in toks:
                toks, finished[0] = toks[: toks.index(stop_id) + 1], True
            text = tok.decode(toks) if tok is not None else " ".join(map(str, toks)) + " "
            sys.stdout.write(text)
            sys.stdout.flush()

        gen.generate(
            [ids],
            args.max_new_tokens,
            args.temperature,
            args.top_k,
            args.top_p,
            args.seed,
            eos_id=stop_id,
            stats=st,
            on_tokens=show,
        )
    except (ValueError, FileNotFoundError, RuntimeError) as e:
        print(f"fullthrottle: error: {e}", file=sys.stderr)
        return 2
    print(file=sys.stdout)
    print(
        f"{st.new_tokens} tokens in {st.decode_s:.2f} s = {st.tokens_per_s:.1f} tok/s (decode), prefill "
        f"{1e3 * st.prefill_s:.1f} ms; ready in {ready_s:.2f} s (graphs: {sorted(gen.graphs) or 'off'}) "
        f"on {device}",
        file=sys.stderr,
    )
    return 0


def _read_texts(path: str):
    """One text per line of ``path`` ('-': stdin), UTF-8. Lines end at ``\n`` (or ``\r\n``) only: a
    lone ``\r`` inside a line is part of its text. ``.jsonl``: each line a JSON string or an object
    with a string field ``text``.

    Raises:
        ValueError: a ``.jsonl`` line that is not valid JSON or lacks ``text``, naming the line.
        UnicodeDecodeError: the input is not UTF-8.
    """
    if path == "-":  # re-read stdin's bytes with the same line rule as files
        f = io.TextIOWrapper(sys.stdin.buffer, encoding="utf-8", newline="\n")
    else:
        f = open(path, encoding="utf-8", newline="\n")
    try:
        for no, line in enumerate(f, 1):
            line = line[:-1] if line.endswith("\n") else line
            line = line[:-1] if line.endswith("\r") else line
            if path.endswith(".jsonl") and line.strip():
                try:
                    obj = json.loads(line)
                except json.JSONDecodeError as e:
                    raise ValueError(f"line {no}: not valid JSON ({e.msg} at character {e.pos + 1})") from None
                if isinstance(obj, dict) and not isinstance(obj.get("text"), str):
                    raise ValueError(f"line {no}: a JSON object needs a string field 'text'")
                yield obj["text"] if isinstance(obj, dict) else str(obj)
            else:
                yield line
    finally:
        if path == "-":
            f.detach()  # leave sys.stdin's buffer open
        else:
            f.close()


def cmd_embed(args) -> int:
    import numpy as np
    from tqdm import tqdm

    from .embed import Embedder

    if not (args.out.endswith(".npy") or args.out.endswith(".jsonl")):
        print("fullthrottle: error: --out must end in .npy or .jsonl", file=sys.stderr)
        return 2
    if args.file != "-" and not os.path.isfile(args.file):
        what = "is a directory, not a file" if os.path.isdir(args.file) else "no such file"
        print(f"fullthrottle: error: {args.file}: {what}", file=sys.stderr)
        return 2
    if not os.path.isdir(os.path.dirname(os.path.abspath(args.out))):
        print(f"fullthrottle: error: cannot write {args.out}: its folder does not exist", file=sys.stderr)
        return 2
    # find out now, not after the whole corpus is embedded, and leave no empty file behind
    target = args.out if os.path.exists(args.out) else os.path.dirname(os.path.abspath(args.out))
    if os.path.isdir(args.out) or not os.access(target, os.W_OK):
        why = "it is a directory" if os.path.isdir(args.out) else "permission denied"
        print(f"fullthrottle: error: cannot write {args.out}: {why}", file=sys.stderr)
        return 2
    if args.model_dir and not os.path.isdir(args.model_dir):
        print(f"fullthrottle: error: model folder not found: {args.model_dir}", file=sys.stderr)
        return 2
    try:
        emb = Embedder(args.model_dir, args.device, args.dtype, args.graphs)
    except (FileNotFoundError, ValueError, RuntimeError) as e:
        print(f"fullthrottle: error: {e}", file=sys.stderr)
        return 2
    except Exception as e:  # noqa: BLE001 - a broken model folder (tokenizer.json, safetensors)
        print(
            f"fullthrottle: error: cannot load the model from {args.model_dir or 'the default folder'}: "
            f"{type(e).__name__}: {e}",
            file=sys.stderr,
        )
        return 2
    t0 = time.perf_counter()
    vectors, n, n_trunc = [], 0, 0
    bar = tqdm(unit="text", desc="embed", disable=args.no_progress or None, file=sys.stderr)
    jsonl = open(args.out, "w", encoding="utf-8") if args.out.endswith(".jsonl") else None
    try:
        for block in emb.embed_stream(_read_texts(args.file)):
            if jsonl is not None:
                for k in range(len(block.vectors)):
                    jsonl.write(
                        json.dumps(
                            {
                                "index": n + k,
                                "truncated": bool(block.truncated[k]),
                                "embedding": [round(float(v), 7) for v in block.vectors[k]],
                            }
                        )
                        + "\n"
                    )
            else:
                vectors.append(block.vectors)
            n += len(block.vectors)
            n_trunc += int(block.truncated.sum())
            bar.update(len(block.vectors))
    except (UnicodeDecodeError, ValueError) as e:
        print(f"fullthrottle: error: cannot read texts from {args.file}: {e}", file=sys.stderr)
        return 2
    except OSError as e:
        print(f"fullthrottle: error: cannot write {args.out}: {e.strerror or e}", file=sys.stderr)
        return 2
    finally:
        bar.close()
        if jsonl is not None:
            jsonl.close()
    if jsonl is None:
        try:
            np.save(args.out, np.concatenate(vectors) if vectors else np.zeros((0, emb.dim), np.float32))
        except OSError as e:
            print(f"fullthrottle: error: cannot write {args.out}: {e.strerror or e}", file=sys.stderr)
            return 2
    dt = time.perf_counter() - t0
    print(
        f"{n} texts in {dt:.2f} s = {n / dt if dt else 0:.1f} texts/s on {emb.device} ({emb.dtype}); "
        f"{n_trunc} truncated to {emb.max_seq_length} tokens; wrote {args.out}",
        file=sys.stderr,
    )
    return 0


def cmd_bench(args) -> int:
    from . import benchmarks as B

    exp = args.experiment
    prefix = args.out or f"fullthrottle-bench-{exp}"
    if not os.path.isdir(os.path.dirname(os.path.abspath(prefix))):  # find out before the run, not after
        print(f"fullthrottle bench {exp}: cannot write {prefix}.json: its folder does not exist", file=sys.stderr)
        return 2
    try:
        if exp == "threads":
            cores = usable_cores()
            default = sorted({1, 2, *[2**i for i in range(1, 8) if 2**i <= 2 * cores], cores, 2 * cores})
            res = B.bench_threads(
                _blobs(args.images),
                _ints(args.threads, [1, 2] if args.quick else default),
                0.3 if args.quick else args.seconds,
            )
        elif exp == "batch":
            res = B.bench_batch(
                _ints(args.batches, [1, 2] if args.quick else [2**i for i in range(11)]),
                args.model,
                args.compile,
                iters=1 if args.quick else 10,
            )
        elif exp == "transfer":
            res = B.bench_transfer(_ints(args.batches, [1, 8] if args.quick else [1, 8, 32, 128, 512]), args.model)
        else:
            n, workers, batch = (48, 2, 8) if args.quick else (args.n, args.workers, args.batch)
            res = B.bench_e2e(_blobs(args.images), n, workers, batch, args.device, args.model)
    except (RuntimeError, ValueError, FileNotFoundError) as e:
        print(f"fullthrottle bench {exp}: {e}", file=sys.stderr)
        return 2
    res["machine"] = B.machine_info()
    res["machine"]["command"] = "fullthrottle " + " ".join(args.argv)
    with open(prefix + ".json", "w", encoding="utf-8") as f:
        json.dump(res, f, indent=2)
    B.plot(res, prefix + ".png")
    print(json.dumps({k: v for k, v in res.items() if k not in ("machine",)}, indent=1)[:4000])
    print(f"wrote {prefix}.json and {prefix}.png", file=sys.stderr)
    return 0


def _shown(s: str) -> str:
    """``s`` with control characters and undecodable bytes escaped (a file name with a newline stays on
    one line of the text output)."""
    return s if s.isprintable() else "".join(c if c.isprintable() else repr(c)[1:-1] for c in s)


def _format_result(r) -> str:
    if r.ok:
        return f"{_shown(r.id)}: " + ", ".join(f"{lab} {p:.3f}" for lab, p in zip(r.labels, r.probs))
    err = r.error.removeprefix(f"{r.id}: ")  # the error names its item already (for library users)
    return f"{_shown(r.id)}: ERROR {_shown(err)}"


def _classify_ray(args) -> int:
    from .ray_jobs import classify_on_ray

    if importlib.util.find_spec("ray") is None:
        print("fullthrottle: error: --ray needs Ray: pip install 'fullthrottle[ray]'", file=sys.stderr)
        return 2
    try:
        gpu = _gpu_decode_settings(args)  # (the GPU decoder flags go to the actors too)
    except ValueError as e:
        print(f"fullthrottle: error: {e}", file=sys.stderr)
        return 2
    cfg = {
        "model": args.model,
        "weights": args.weights,
        "device": args.device,
        "top_k": args.top_k,
        "max_batch_size": args.batch_size,
        "max_wait_ms": args.max_wait_ms,
        "threads": args.threads,
        "graphs": args.graphs,
        "compile": args.compile,
        "preprocess": args.preprocess,
        **gpu,
    }
    if args.dtype:
        cfg["dtype"] = args.dtype
    inputs = args.inputs or sample_photos()
    out = open(args.out, "w", encoding="utf-8") if args.out and args.out != "-" else None
    t0, ok, failed = time.perf_counter(), 0, 0
    try:
        for row in classify_on_ray(
            inputs,
            cfg,
            None if args.ray == "local" else args.ray,
            concurrency=args.ray_actors,
            batch_size=args.batch_size,
        ):
            good = row["error"] is None
            ok += good
            failed += not good
            line = json.dumps(row)
            if out is not None:
                out.write(line + "\n")
            elif args.out == "-":
                print(line)
            else:
                print(
                    f"{row['id']}: "
                    + (
                        ", ".join(f"{lab} {p:.3f}" for lab, p in zip(row["labels"], row["probs"]))
                        if good
                        else f"ERROR {row['error']}"
                    )
                )
    finally:
        if out is not None:
            out.close()
    dt = time.perf_counter() - t0
    print(
        f"{ok + failed} items: {ok} ok, {failed} failed in {dt:.1f} s on Ray ({args.ray_actors} actors)",
        file=sys.stderr,
    )
    return 1 if failed else 0


def cmd_classify(args) -> int:
    import torch
    from tqdm import tqdm

    from .compute import resolve_device
    from .config import Config
    from .models import WeightsError
    from .pipeline import Pipeline

    inputs = args.inputs
    if args.ray is not None:
        return _classify_ray(args)
    if args.out == "" or args.report_json == "":
        print("fullthrottle: error: --out and --report-json need a file name ('-' for stdout)", file=sys.stderr)
        return 2
    for path in (args.out, args.report_json):
        if path and path != "-" and not os.path.isdir(os.path.dirname(os.path.abspath(path))):
            print(f"fullthrottle: error: cannot write {path}: its folder does not exist", file=sys.stderr)
            return 2
    if args.report_json:
        is_dir = os.path.isdir(args.report_json)
        if is_dir or not os.access(os.path.dirname(os.path.abspath(args.report_json)), os.W_OK):
            why = "Is a directory" if is_dir else "its folder is not writable"
            print(f"fullthrottle: error: cannot write {args.report_json}: {why}", file=sys.stderr)
            return 2
    out = None
    if args.out == "-":
        out = sys.stdout
    elif args.out:
        try:  # opened before the model is built: a bad path costs nothing
            out = open(args.out, "w", encoding="utf-8")
        except OSError as e:
            print(f"fullthrottle: error: cannot write {args.out}: {e.strerror or e}", file=sys.stderr)
            return 2
    try:
        if not inputs:
            inputs = sample_photos()
            print(f"no inputs given: classifying {len(inputs)} sample photos from scikit-image", file=sys.stderr)
        device = resolve_device(args.device)
        dtype = args.dtype or ("bfloat16" if device.type == "cuda" else "float32")
        cfg = Config(
            model=args.model,
            weights=args.weights,
            device=str(device),
            dtype=dtype,
            max_batch_size=args.batch_size,
            max_wait_ms=args.max_wait_ms,
            threads=args.threads,
            top_k=args.top_k,
            ordered=not args.unordered,
            graphs=args.graphs,
            compile=args.compile,
            **_gpu_decode_settings(args),
            preprocess=args.preprocess,
        )
        if device.type != "cuda":  # say what a CPU run leaves out, rather than ignoring it silently
            ignored = [
                f
                for f, on in (
                    ("--gpu-decode", args.gpu_decode is True),
                    ("--compile", args.compile),
                    (f"--dtype {args.dtype}", args.dtype not in (None, "float32")),
                )
                if on
            ]
            if ignored:
                what = {"--gpu-decode": "decodes on the CPU", "--compile": "runs the model eager"}
                does = " and ".join(what.get(f, "computes in float32") for f in ignored)
                print(
                    f"note: {' and '.join(ignored)} need{'s' if len(ignored) == 1 else ''} CUDA: "
                    f"this run on {device} {does}",
                    file=sys.stderr,
                )
        pipe = Pipeline(cfg)
        n_classes = len(pipe.engine.labels)
        if args.top_k > n_classes:
            print(
                f"note: --top-k {args.top_k} is more than the model's {n_classes} classes: "
                f"each result lists all {n_classes}",
                file=sys.stderr,
            )
    except (ValueError, FileNotFoundError, RuntimeError, WeightsError) as e:
        print(f"fullthrottle: error: {e}", file=sys.stderr)
        _close_out(out)
        return 2
    except KeyboardInterrupt:  # during start-up (model load, graph capture, decoder processes)
        print("interrupted", file=sys.stderr)
        _close_out(out)
        return 130
    if pipe.engine.random_weights:
        print(
            f"WARNING: no --weights given: {args.model} is randomly initialised (fixed seed), labels are meaningless",
            file=sys.stderr,
        )
    failed = 0
    bar = tqdm(
        unit="img",
        desc="classify",
        disable=args.no_progress or None,
        file=sys.stderr,
        total=len(inputs) if all(os.path.isfile(str(i)) for i in inputs) else None,
    )
    results = pipe.run(inputs)
    try:
        for r in results:
            failed += not r.ok
            if out is not None:
                out.write(json.dumps(r.to_dict()) + "\n")
            if out is None:
                tqdm.write(_format_result(r), file=sys.stdout)
            elif not r.ok and out is not sys.stdout:
                tqdm.write(_format_result(r), file=sys.stderr)
            bar.update(1)
    except KeyboardInterrupt:
        results.close()  # stop every stage and join its thread before the interpreter exits
        bar.close()
        print("interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:  # the reader went away (`| head`): stop quietly, like other CLI tools
        results.close()
        _silence_stdout()
        return 1
    except OSError as e:  # the output could not be written (disk full, ...): stop, say so
        results.close()
        print(f"fullthrottle: error: cannot write {args.out or 'stdout'}: {e.strerror or e}", file=sys.stderr)
        return 2
    finally:
        bar.close()
        pipe.close()  # stops the decoder processes
        err = _close_out(out)
    if err is not None:
        print(f"fullthrottle: error: cannot write {args.out or 'stdout'}: {err}", file=sys.stderr)
        return 2
    rep = pipe.last_report
    print(rep.format(), file=sys.stderr)
    if device.type == "cuda":
        print(f"GPU: {torch.cuda.get_device_name(device)}", file=sys.stderr)
    if args.report_json:
        try:
            with open(args.report_json, "w", encoding="utf-8") as f:
                json.dump(rep.to_dict(), f, indent=2)
        except OSError as e:
            print(f"fullthrottle: error: cannot write {args.report_json}: {e.strerror or e}", file=sys.stderr)
            return 2
    return 1 if failed else 0


def _silence_stdout() -> None:
    """After a broken pipe: point stdout at /dev/null, so the interpreter's final flush stays quiet."""
    try:
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
    except (OSError, ValueError, AttributeError):
        pass


def _close_out(out) -> str | None:
    """Close the results file (not stdout); the reason if its last writes failed (disk full), else None."""
    if out is None or out is sys.stdout:
        return None
    try:
        out.close()
    except OSError as e:
        return e.strerror or str(e)
    return None


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    args.argv = list(sys.argv[1:] if argv is None else argv)
    try:
        return _run_command(args, argv)
    except KeyboardInterrupt:  # before a command's own handling (Ctrl-C while torch is imported, say)
        print("\ninterrupted", file=sys.stderr)
        return 130


@contextlib.contextmanager
def _private_mps(args):
    """classify and serve: a private CUDA MPS server (:mod:`fullthrottle.mps`) while the command runs,
    with ``--mps`` when it may decode on the GPU; started before any CUDA call."""
    from .mps import private_mps

    gpu_decode = Config.gpu_decode if args.gpu_decode is None else args.gpu_decode
    wanted = gpu_decode and args.mps is True and args.device != "cpu" and not getattr(args, "ray", None)
    with private_mps(wanted) as how:
        if args.mps and how not in ("started", "a server is running"):  # (--mps with --no-gpu-decode: "off")
            print(f"note: --mps: no private CUDA MPS server: {how}", file=sys.stderr)
        yield


def _run_command(args, argv: list[str] | None) -> int:
    if args.command == "bench":
        return cmd_bench(args)
    if args.command == "serve":
        with _private_mps(args):
            return cmd_serve(args)
    if args.command in ("generate", "embed"):
        try:
            return (cmd_generate if args.command == "generate" else cmd_embed)(args)
        except KeyboardInterrupt:
            print("\ninterrupted", file=sys.stderr)
            return 130
        except BrokenPipeError:  # the reader went away (`| head`): stop quietly
            _silence_stdout()
            return 1
    if args.command == "classify":
        try:
            with _private_mps(args):
                rc = cmd_classify(args)
        except KeyboardInterrupt:  # (while cmd_classify imported torch: before its own handling)
            print("\ninterrupted", file=sys.stderr)
            rc = 130
        if rc == 130 and argv is None:
            # Interrupted: our stages are joined, but native thread pools (or a half-imported torch) may
            # still be tearing down; skip interpreter finalisation, which can otherwise abort (exit 134)
            # or end by the signal (-2) in their destructors.
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(130)
        return rc
    return 2


if __name__ == "__main__":
    sys.exit(main())
