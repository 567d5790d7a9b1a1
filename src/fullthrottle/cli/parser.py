"""The ``fullthrottle`` argument parser: every command, its options and their help."""

from __future__ import annotations

import argparse

from ..config import DTYPES, GPU_DECODERS, Config, usable_cores
from ..env import describe as describe_env
from ..models import DEFAULT_MODEL, MODELS


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
    c.add_argument(
        "--batch-size", type=_positive_int, default=Config.max_batch_size, help="max batch size (default: %(default)s)"
    )
    c.add_argument(
        "--max-wait-ms",
        type=float,
        default=Config.max_wait_ms,
        help="how long a batch may wait to fill, ms (default: %(default)s)",
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
        default=Config.preprocess,
        choices=("auto", "threads", "processes"),
        help="decode in threads of this process, or in --threads worker processes fed by one "
        "dispatcher thread, outside this process's GIL (auto: processes on CUDA, threads on CPU)",
    )
    c.add_argument("--device", default=Config.device, help="auto | cpu | cuda | cuda:N (default: %(default)s)")
    c.add_argument(
        "--dtype",
        default=None,
        choices=DTYPES,
        help="compute dtype on CUDA (default: bfloat16 on CUDA; CPU always float32)",
    )
    c.add_argument(
        "--graphs",
        action=argparse.BooleanOptionalAction,
        default=Config.graphs,
        help="replay the model as CUDA graphs, one per batch bucket (CUDA only; default: on)",
    )
    _add_gpu_decode_args(c)
    c.add_argument(
        "--compile",
        action="store_true",
        help="torch.compile the model (kernel fusion) before graph capture; slow start",
    )
    c.add_argument("--top-k", type=_positive_int, default=Config.top_k, help="classes per image (default: %(default)s)")
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
        default=Config.max_batch_size,
        help="largest batch the batcher forms across requests (default: %(default)s)",
    )
    v.add_argument(
        "--max-wait-ms",
        type=float,
        default=Config.max_wait_ms,
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
        default=Config.preprocess,
        choices=("auto", "threads", "processes"),
        help="decode in threads of this process, or in --threads worker processes fed by one "
        "dispatcher thread (auto: processes on CUDA)",
    )
    v.add_argument("--device", default=Config.device, help="auto, cpu, cuda or cuda:N (default: %(default)s)")
    v.add_argument(
        "--gpus", default=None, help="'all' or N: one model replica per GPU (default with --device auto: every GPU)"
    )
    v.add_argument(
        "--dtype",
        default=None,
        choices=DTYPES,
        help="compute dtype on CUDA (default: bfloat16; the CPU always computes in float32)",
    )
    v.add_argument(
        "--graphs",
        action=argparse.BooleanOptionalAction,
        default=Config.graphs,
        help="replay the model as CUDA graphs per batch bucket (CUDA only; default: on)",
    )
    v.add_argument("--top-k", type=_positive_int, default=Config.top_k, help="classes per image (default: %(default)s)")
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
        choices=DTYPES,
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
        choices=DTYPES,
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
