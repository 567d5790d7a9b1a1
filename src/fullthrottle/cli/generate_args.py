"""The ``fullthrottle generate`` command's arguments (:func:`add_generate_parser`)."""

from __future__ import annotations

from ..core.config import LlmSettings
from .generate import RANDOM_SHAPES
from .options import KV_DTYPE_ARG, add_runtime_flags, context_length, kv_pages_arg, positive_int


def add_generate_parser(sub) -> None:
    """Add ``generate`` to ``sub`` (the top-level parser's subcommands)."""
    g = sub.add_parser(
        "generate",
        help="LLM text generation (Llama family) with CUDA graphs; --prompts: many requests, continuously batched",
        description="Generate from a Hugging Face Llama folder (config.json + safetensors, tokenizer.json "
        "for text), or from a randomly initialised config (--random) for benchmarks. One prompt: its "
        "tokens stream to stdout as they are produced. Many (--prompts FILE): they run together "
        "through the server's continuous-batching engine and each gets a JSON line.",
        epilog="Exit status: 0 every prompt answered; 1 some --prompts line failed (see its error), or stdout's "
        "reader left (| head); 2 usage or model error (flags that do not fit, a model folder that does not load, "
        "an output that cannot be written); 130 on Ctrl-C, 143 on SIGTERM.",
    )
    src = g.add_mutually_exclusive_group(required=True)
    src.add_argument("--model-dir", help="Hugging Face Llama folder (config.json, *.safetensors)")
    src.add_argument("--random", choices=RANDOM_SHAPES, help="random weights of this shape")
    g.add_argument("--prompt", help="text (needs tokenizer.json in --model-dir)")
    g.add_argument("--tokens", help="comma-separated prompt token ids (instead of --prompt)")
    g.add_argument(
        "--prompts",
        metavar="FILE|-",
        help="many requests, one per line (text, token ids as [1, 2, 3], or a JSON object with "
        "/v1/completions' fields), run together with continuous batching; one JSON line per request to "
        '--out, in order, naming its line of FILE ("line", from 1)',
    )
    g.add_argument("--out", default=None, help="with --prompts: write the JSON lines here (default: stdout)")
    g.add_argument(
        "--max-batch",
        type=positive_int,
        default=64,
        help="with --prompts: KV-cache rows, requests decoded at once (default: %(default)s)",
    )
    g.add_argument(
        "--kv-pages",
        type=kv_pages_arg,
        default=LlmSettings.kv_pages,
        metavar="N|auto",
        help="with --prompts: paged KV memory, N pages of 64 tokens shared by the requests ('auto': as many as "
        "fit in 90%% of the free memory), as serve's --llm-kv-pages (default 0: a static row per request)",
    )
    g.add_argument(
        "--kv-dtype",
        **KV_DTYPE_ARG,
        help="with --kv-pages: the pages' dtype, as serve's --llm-kv-dtype (fp8: float8, lossy; default: %(default)s)",
    )
    g.add_argument("--no-progress", action="store_true", help="with --prompts: no progress bar")
    g.add_argument(
        "--max-new-tokens", type=positive_int, default=64, help="tokens to generate per prompt (default: %(default)s)"
    )
    g.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    g.add_argument("--top-k", type=int, default=0, help="0 or -1 = off (default: %(default)s)")
    g.add_argument("--top-p", type=float, default=1.0, help="1.0 = off (default: %(default)s)")
    g.add_argument(
        "--seed",
        type=int,
        default=None,
        help="sampling seed (same seed, same tokens; taken modulo 2**32; default: none, a fresh one per run)",
    )
    add_runtime_flags(g, "device", "dtype")
    g.add_argument(
        "--max-seq-len",
        type=context_length,
        default=None,
        help="KV cache length (default: prompt + max new tokens, the longest of --prompts FILE's; for --prompts - "
        "on a pipe or terminal, read as it comes: the model's context, at most 4096)",
    )
    add_runtime_flags(
        g, "graphs", help={"graphs": "CUDA graphs for the decode step (one replay per token; CUDA only; default: on)"}
    )
