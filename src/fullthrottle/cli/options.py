"""Option groups that more than one ``fullthrottle`` command takes, each default read from the
dataclass that owns it (:class:`~fullthrottle.core.config.Config`), so it is stated once."""

from __future__ import annotations

import argparse
import dataclasses
import math

from ..core.config import DTYPES, GPU_DECODERS, Config, LlmSettings, Runtime
from ..server.options import SERVE_MAX_PREFILL_TOKENS, ServeOptions
from ..workloads.classify.models import DEFAULT_MODEL, MODELS
from .generate import RANDOM_SHAPES


def _integer(s: str) -> int:
    try:
        return int(s)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be an integer, got {s!r}") from None


#: Ray actors of ``classify --ray`` and ``run --ray`` without ``--ray-actors``; Ray Serve replicas of
#: ``serve --ray`` without ``--replicas``
RAY_ACTORS, RAY_REPLICAS = 2, 1
_RAY_ONLY = (
    ("ray_actors", "--ray-actors", RAY_ACTORS),
    ("replicas", "--replicas", RAY_REPLICAS),
    ("ray_address", "--ray-address", None),
)


def ray_only_given(args) -> str | None:
    """The first of ``--ray-actors``, ``--replicas``, ``--ray-address`` given without ``--ray`` (they act
    with it only), or None; fills in the defaults of those not given (their parser default is None,
    so that a given one shows)."""
    for key, flag, default in _RAY_ONLY:
        if not hasattr(args, key):
            continue
        if getattr(args, key) is not None and not getattr(args, "ray", None):
            return flag
        if getattr(args, key) is None:
            setattr(args, key, default)
    return None


def port_number(s: str) -> int:
    """A TCP port, 0..65535 (0: the system picks a free one)."""
    v = _integer(s)
    if not 0 <= v <= 65535:
        raise argparse.ArgumentTypeError(f"must be a port number 0..65535, got {v}")
    return v


def _finite(s: str, zero_ok: bool) -> float:
    try:
        v = float(s)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a number, got {s!r}") from None
    if not math.isfinite(v) or v < 0 or (v == 0 and not zero_ok):
        raise argparse.ArgumentTypeError(f"must be a finite number {'>=' if zero_ok else '>'} 0, got {s}")
    return v


def positive_float(s: str) -> float:
    """A finite number > 0 (``nan`` and ``inf`` refused)."""
    return _finite(s, zero_ok=False)


def nonnegative_float(s: str) -> float:
    """A finite number >= 0 (``nan`` and ``inf`` refused)."""
    return _finite(s, zero_ok=True)


#: the largest image limit in megapixels a flag takes: 1e18 pixels, a count that fits in 64 bits
MAX_MEGAPIXELS = 1e12


def megapixels(s: str) -> float:
    """A number of megapixels from 0.000001 (one pixel) to :data:`MAX_MEGAPIXELS` (``nan``, ``inf``
    and ``1e308``, whose count of pixels is infinite, refused)."""
    v = _finite(s, zero_ok=False)
    if not 1e-6 <= v <= MAX_MEGAPIXELS:
        raise argparse.ArgumentTypeError(
            f"must be a finite number > 0 of megapixels, from 0.000001 (one pixel) to {MAX_MEGAPIXELS:g}, got {s}"
        )
    return v


#: the largest body limit a flag takes, MiB (1 TiB: no request body of a server comes near it)
MAX_BODY_MB = 2.0**20


def body_mb(s: str) -> float:
    """A request body limit in MiB, from one byte to :data:`MAX_BODY_MB` (``nan``, ``inf`` refused)."""
    v = _finite(s, zero_ok=False)
    if not 2.0**-20 <= v <= MAX_BODY_MB:
        raise argparse.ArgumentTypeError(
            f"must be a finite number > 0 of MiB, from {2.0**-20:.7f} (one byte) to {MAX_BODY_MB:.0f} (1 TiB), got {s}"
        )
    return v


def torchvision_model(s: str) -> str:
    """The name of one of torchvision's classification models (``resnet18``, ...)."""
    import torchvision

    if s not in torchvision.models.list_models(module=torchvision.models):
        raise argparse.ArgumentTypeError(
            f"{s!r} is not one of torchvision's models (resnet18, mobilenet_v3_small, ...)"
        )
    return s


def logprobs_arg(s: str) -> int:
    """``--llm-logprobs``: 0 to 20 (OpenAI's API's most top logprobs)."""
    v = _integer(s)
    if not 0 <= v <= 20:
        raise argparse.ArgumentTypeError(f"must be 0-20, got {v}")
    return v


def positive_int(s: str) -> int:
    """An integer >= 1."""
    v = _integer(s)
    if v < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {v}")
    return v


def context_length(s: str) -> int:
    """A KV cache length: an integer >= 2 (a prompt's token and one new token)."""
    v = _integer(s)
    if v < 2:
        raise argparse.ArgumentTypeError(f"must be >= 2 (a prompt's token and one new token), got {v}")
    return v


def positive_int_list(s: str) -> list[int]:
    """A comma-separated list of integers >= 1 (``1,2,4``)."""
    try:
        vals = [int(x) for x in s.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers (1,2,4), got {s!r}") from None
    if any(v < 1 for v in vals):
        raise argparse.ArgumentTypeError(f"expected integers >= 1, got {s!r}")
    return vals


def nonnegative_int(s: str) -> int:
    """An integer >= 0."""
    v = _integer(s)
    if v < 0:
        raise argparse.ArgumentTypeError(f"must be >= 0, got {v}")
    return v


def add_gpu_decode_args(p: argparse.ArgumentParser) -> None:
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
        "(default: on for classify, off for serve, where a fatal GPU fault of one client would "
        "reach them all; nothing is started when an MPS server is already running, or without "
        "an NVIDIA driver, and the run's summary says how the GPU was shared)",
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
        "decoder, 0..16 (0: one GPU decode thread in this process; default: 12 when a CUDA MPS "
        "server is running, fewer below 16 cores, else 6)",
    )


def add_runtime_flags(p: argparse.ArgumentParser, *names: str, help: dict | None = None) -> None:
    """``--device``, ``--dtype``, ``--graphs`` (as ``names`` asks), generated from the fields of
    :class:`~fullthrottle.core.config.Runtime`: the default and the help are the field's (``help``
    overrides a flag's help text for a command, e.g. its own dtype default)."""
    meta = {f.name: f for f in dataclasses.fields(Runtime)}
    for name in names:
        f, text = meta[name], (help or {}).get(name) or meta[name].metadata["help"]
        if name == "device":
            p.add_argument("--device", default=f.default, help=text + " (default: %(default)s)")
        elif name == "dtype":
            p.add_argument("--dtype", default=f.default, choices=DTYPES, help=text)
        elif name == "graphs":
            p.add_argument("--graphs", action=argparse.BooleanOptionalAction, default=f.default, help=text)
        else:
            raise ValueError(f"no flag for Runtime.{name}")


MODEL_HELP = (
    "; ".join(f"{name}: {m.about}" for name, m in MODELS.items())
    + "; or MODULE:CLASS, an nn.Module class of yours (built with no arguments; its input_transform and "
    "labels attributes, if any, say its preprocessing and class names). Each model brings its own resize, "
    "crop and normalisation (default: %(default)s)"
)


def model_name(s: str) -> str:
    """``--model``: a name of :data:`MODELS`, or ``MODULE:CLASS`` (imported when the model is built)."""
    if s in MODELS or ":" in s:
        return s
    mod, dot, cls = s.rpartition(".")
    hint = f" (a colon between module and class: {mod}:{cls})" if dot and mod and cls[:1].isupper() else ""
    raise argparse.ArgumentTypeError(f"unknown model {s!r}: choose one of {', '.join(MODELS)}, or MODULE:CLASS{hint}")


WEIGHTS_HELP = (
    "state dict file: .safetensors, or .pth loaded with weights_only=True (no code is "
    "unpickled), e.g. torchvision's own checkpoint resnet50-11ad3fa6.pth from torch's hub cache "
    "(~/.cache/torch/hub/checkpoints/); default: the model's bundled weights, or none "
    "(random weights, fixed seed: labels are then meaningless)"
)


def add_runtime_args(
    p: argparse.ArgumentParser,
    batch_flag: str,
    batch_help: str,
    device_help: str | None = None,
    max_wait_ms: float = Config.max_wait_ms,
    threads_help: str = "one per CPU core; with processes, one per core but one, left to this process's threads",
) -> None:
    """The options classify and serve share, their defaults from :class:`~fullthrottle.core.config.Config`:
    the model and its weights, the batcher (``batch_flag``: the largest batch; --max-wait-ms), the
    decoders (--threads, --preprocess, GPU decoding), the device, dtype, graphs and top-k."""
    p.add_argument("--model", default=DEFAULT_MODEL, type=model_name, metavar="MODEL", help=MODEL_HELP)
    p.add_argument("--weights", metavar="FILE", help=WEIGHTS_HELP)
    p.add_argument(
        batch_flag, type=positive_int, default=Config.max_batch_size, help=batch_help + " (default: %(default)s)"
    )
    p.add_argument(
        "--max-wait-ms",
        type=nonnegative_float,
        default=max_wait_ms,
        help="how long a partial batch waits for more images, ms (classify; default: %(default)s)",
    )
    p.add_argument(
        "--threads",
        type=positive_int,
        default=None,
        help=f"preprocess threads, or decoder processes with --preprocess processes (default: {threads_help})",
    )
    p.add_argument(
        "--preprocess",
        default=Config.preprocess,
        choices=("auto", "threads", "processes"),
        help="decode in threads of this process, or in --threads worker processes fed by one "
        "dispatcher thread, outside this process's GIL (auto: processes on CUDA, threads on CPU)",
    )
    add_runtime_flags(
        p,
        "device",
        "dtype",
        "graphs",
        help={
            "device": device_help,
            "graphs": "replay the model as CUDA graphs, one per batch bucket (CUDA only; default: on)",
        },
    )
    p.add_argument("--top-k", type=positive_int, default=Config.top_k, help="classes per image (default: %(default)s)")
    p.add_argument(
        "--max-image-megapixels",
        type=megapixels,
        default=Config.max_image_pixels / 1e6,
        help="largest image (width x height, in millions of pixels) decoded; larger ones fail alone, "
        "checked on the header before decoding (default: %(default).1f, Pillow's bomb threshold)",
    )
    add_gpu_decode_args(p)


def kv_pages_arg(s: str) -> int | str:
    """``--llm-kv-pages``: an integer >= 0, or ``auto``."""
    return "auto" if s.strip().lower() == "auto" else nonnegative_int(s)


#: ``--llm-kv-dtype`` / ``generate --kv-dtype``: a KV dtype's name, in any case (as AUTO for the pages)
KV_DTYPE_ARG = {"type": str.lower, "choices": ("auto", "fp8"), "default": LlmSettings.kv_dtype}


def add_access_log_arg(v: argparse.ArgumentParser) -> None:
    """``serve --access-log`` (:attr:`~fullthrottle.server.options.ServeOptions.access_log`)."""
    on = "on" if ServeOptions.access_log else "off"
    v.add_argument(
        "--access-log",
        action=argparse.BooleanOptionalAction,
        default=ServeOptions.access_log,
        help=f"a line per request on stdout (default: {on}: at thousands of requests a second it takes "
        "the HTTP workers' CPU; /metrics counts requests by route and status)",
    )


def add_llm_serve_args(v: argparse.ArgumentParser) -> None:
    """``serve``'s ``--llm-*`` flags: the LLM engine's settings (defaults from
    :class:`~fullthrottle.core.config.LlmSettings`)."""
    v.add_argument(
        "--llm-model-dir",
        default=None,
        metavar="DIR",
        help="also serve /v1/completions and /v1/chat/completions with this Hugging Face Llama folder",
    )
    v.add_argument(
        "--llm-random",
        choices=RANDOM_SHAPES,
        default=None,
        help="serve an LLM of this shape with random weights instead (token ids only: for benchmarks)",
    )
    v.add_argument(
        "--llm-max-batch",
        type=positive_int,
        default=LlmSettings.max_batch,
        help="LLM KV-cache rows: requests decoded at once (default: %(default)s)",
    )
    v.add_argument(
        "--llm-logprobs",
        type=logprobs_arg,
        default=LlmSettings.logprobs,
        metavar="N",
        help="let requests ask for logprobs: each token's and the top N (0-20; default: off, no extra work per step)",
    )
    v.add_argument(
        "--llm-kv-pages",
        type=kv_pages_arg,
        default=LlmSettings.kv_pages,
        metavar="N|auto",
        help="paged KV memory: N pages of 64 tokens shared by all requests (at most what --llm-max-batch full "
        "rows use; 'auto': as many as fit in 90%% of the device's free memory); a request holds the pages "
        "of the tokens it has, requests wait for pages, and when they run out the one admitted last is "
        "preempted and computed again later. Default 0: a static --llm-max-seq-len row per request",
    )
    v.add_argument(
        "--llm-kv-dtype",
        **KV_DTYPE_ARG,
        help="paged KV memory's dtype: auto, the model's; fp8, float8 e4m3: twice the tokens in the same "
        "memory and half the bytes each decode step reads, keys and values rounded to 3 mantissa bits "
        "(needs --llm-kv-pages; on CUDA, a GPU of compute capability 8.9 or newer, such as H100, H200, L4; "
        "on the CPU it saves memory, not time; default: %(default)s)",
    )
    v.add_argument(
        "--llm-max-prefill-tokens",
        type=positive_int,
        default=SERVE_MAX_PREFILL_TOKENS,
        metavar="N",
        help="LLM prompt tokens prefilled per step, in one forward (longer prompts go in chunks, while the "
        "others decode; default: %(default)s)",
    )
    v.add_argument(
        "--llm-max-seq-len",
        type=context_length,
        default=None,
        help="LLM context (KV cache) length (default: the model's, at most 4096)",
    )
