"""``fullthrottle generate``: LLM generation from the command line (a Llama folder or random weights)."""

from __future__ import annotations

import os
import re
import sys
import time

from ..core.config import resolve_dtype, torch_dtype


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
            + (
                " (the CPU computes in float32, whatever --dtype says: run it on a GPU, --device cuda)"
                if device.type == "cpu"
                else ""
            )
        )


#: the shapes ``--random`` builds
RANDOM_SHAPES = ("tiny", "llama2-7b")


def random_llama(shape: str, device, dtype):
    """A Llama of ``shape`` (one of :data:`RANDOM_SHAPES`) with random weights (seed 0) on ``device``,
    with no end-of-sequence token (``serve --llm-random`` stopped its requests at token 2, the
    default's, where ``generate --random`` ran them to their max tokens).

    Raises:
        ValueError: its weights do not fit in the memory free there.
    """
    import torch

    from ..workloads.llm.llama import Llama, LlamaConfig

    if shape == "llama2-7b":
        cfg = LlamaConfig.llama2_7b()
    else:
        kw = dict(num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2)
        cfg = LlamaConfig(vocab_size=512, hidden_size=128, intermediate_size=344, **kw)
    cfg.eos_token_id = None  # (random weights: no token ends a text; each request runs to its max tokens)
    _check_memory_for(cfg, device, dtype)
    dev = torch.device(device)
    # (the weights from seed 0; torch's global generator, which draws the seeds of requests that give
    # none, is left as it was)
    with torch.random.fork_rng(devices=[dev.index or 0] if dev.type == "cuda" else []):
        torch.manual_seed(0)
        with dev:
            return Llama(cfg).to(dtype).eval()


def _report(args, tokens: int, wall: float, gen, device, dtype):
    """The run's summary: tokens made, the Generator's stages (prefill, decode), the machine."""
    from ..core.report import Report

    return Report(
        items=tokens,
        ok=tokens,
        wall_s=wall,
        stages=[s.snapshot(wall) for s in gen.stats.values()],
        device=str(device),
        model=os.path.basename(os.path.normpath(args.model_dir)) if args.model_dir else f"random {args.random}",
        dtype=str(dtype).removeprefix("torch."),
        unit="token",
    )


def _many(args, model, tok, eos, device, dtype) -> int:
    from .generate_many import generate_many

    t0 = time.perf_counter()
    new, gen, failed = generate_many(args, model, tok, eos)
    wall = time.perf_counter() - t0
    print(_report(args, new, wall, gen, device, dtype).format(), file=sys.stderr)
    if failed:
        print(f"{failed} request(s) failed: their errors are in the output", file=sys.stderr)
    return 1 if failed else 0


def _prompt_args_error(args) -> str | None:
    """What is wrong with the prompt flags as given (``--prompts``, ``--prompt``, ``--tokens``), or None."""
    if args.prompts is not None:
        if args.tokens is not None or args.prompt is not None:
            return "give --prompts FILE, or one --prompt / --tokens, not both"
        if args.prompts == "-":
            return None
        try:
            os.stat(args.prompts)
        except OSError as e:  # (a file there that cannot be read: said as it is opened)
            return f"cannot read {args.prompts}: {e.strerror or e}"
        return None
    if args.tokens is not None and args.prompt is not None:
        return "give either --prompt or --tokens, not both"
    if args.tokens is None and args.prompt is None:
        return "give --prompt TEXT or --tokens IDS"
    if args.prompt is not None and not args.model_dir:
        return "--prompt needs a tokenizer.json in --model-dir; give --tokens instead"
    if args.tokens is not None and not re.fullmatch(r"\s*\d+\s*(,\s*\d+\s*)*", args.tokens, re.ASCII):
        return f"--tokens must be comma-separated integers >= 0, got {args.tokens!r}"
    return None


def cmd_generate(args) -> int:
    from .common import held_signals, overwrites_an_input

    if args.out is not None and args.prompts is None:  # (one prompt's tokens stream to stdout)
        print("fullthrottle: error: --out is for --prompts FILE (one prompt's text goes to stdout)", file=sys.stderr)
        return 2
    if args.top_k < -1:
        print(f"fullthrottle: error: --top-k must be >= 0, or -1 (0 and -1: off), got {args.top_k}", file=sys.stderr)
        return 2
    args.top_k = max(args.top_k, 0)  # (-1: off, as in a request)
    clash = overwrites_an_input({"--out": args.out}, {"--prompts": args.prompts})
    if clash:
        print(f"fullthrottle: error: {clash}", file=sys.stderr)
        return 2
    if (args.kv_pages or args.kv_dtype != "auto") and args.prompts is None:
        print("fullthrottle: error: --kv-pages and --kv-dtype are for --prompts FILE", file=sys.stderr)
        return 2
    if args.kv_dtype != "auto" and not args.kv_pages:
        print(
            f"fullthrottle: error: --kv-dtype {args.kv_dtype} needs paged KV memory: give --kv-pages N or auto",
            file=sys.stderr,
        )
        return 2
    why = _prompt_args_error(args)
    if why:  # (before the model loads: a 7B model takes a while)
        print(f"fullthrottle: error: {why}", file=sys.stderr)
        return 2

    with held_signals():  # (a Ctrl-C or SIGTERM is taken once the native libraries have imported)
        from ..core.device import resolve_device
        from ..workloads.llm.checks import check_prompt
        from ..workloads.llm.generate import GenerateStats, Generator
        from ..workloads.llm.llama import load_hf
        from ..workloads.llm.text import LlmText, TextStream

    try:
        device = resolve_device(args.device)
        if device.type != "cuda" and args.dtype not in (None, "float32"):  # (as classify: named, not ignored)
            print(f"note: --dtype {args.dtype} needs CUDA: this run on {device} computes in float32", file=sys.stderr)
            args.dtype = "float32"
        dtype = torch_dtype(resolve_dtype(args.dtype, device))
        tok = None
        if args.model_dir:
            if not os.path.isdir(args.model_dir):
                raise ValueError(f"model folder not found: {args.model_dir}")
            try:
                model = load_hf(args.model_dir, device, dtype)
                tok = LlmText.from_folder(args.model_dir)
            except (ValueError, FileNotFoundError):
                raise
            except Exception as e:  # noqa: BLE001 - a corrupt config, shard or tokenizer.json
                raise ValueError(f"cannot load the model from {args.model_dir}: {type(e).__name__}: {e}") from None
        else:
            model = random_llama(args.random, device, dtype)
            print("WARNING: random weights: the tokens are meaningless", file=sys.stderr)
        eos = model.cfg.eos_token_id  # (one token id, or several: any ends a prompt)
        if args.prompts is not None:
            return _many(args, model, tok, eos if args.model_dir else None, device, dtype)
        if args.tokens is not None:
            ids = [int(x) for x in args.tokens.split(",")]  # (checked by _prompt_args_error)
        else:
            if tok is None:
                raise ValueError("--prompt needs a tokenizer.json in --model-dir; give --tokens instead")
            ids = tok.encode(args.prompt)
        check_prompt(ids, model.cfg.vocab_size)
        context = model.cfg.max_position_embeddings
        if args.max_seq_len is None and len(ids) + args.max_new_tokens > context:
            raise ValueError(
                f"the prompt's {len(ids)} tokens + --max-new-tokens {args.max_new_tokens} exceed the model's "
                f"context of {context} tokens"
            )
        if args.max_seq_len is not None and len(ids) + args.max_new_tokens > args.max_seq_len:
            raise ValueError(
                f"the prompt's {len(ids)} tokens + --max-new-tokens {args.max_new_tokens} exceed --max-seq-len "
                f"{args.max_seq_len}"
            )
        t0 = time.perf_counter()
        gen = Generator(
            model, max_batch=1, max_seq_len=args.max_seq_len or len(ids) + args.max_new_tokens, graphs=args.graphs
        )
        ready_s = time.perf_counter() - t0
        st = GenerateStats()

        stop_id = eos if args.model_dir else None
        finished = [False]
        stream = TextStream(tok) if tok is not None else None  # (words split over chunks come out whole)

        def show(chunks):
            if finished[0]:
                return
            toks = chunks[0]
            if stop_id is not None and stop_id in toks:
                toks, finished[0] = toks[: toks.index(stop_id) + 1], True
            text = stream.push(toks) if stream is not None else " ".join(map(str, toks)) + " "
            if finished[0] and stream is not None:
                text += stream.flush()
            sys.stdout.write(text)
            sys.stdout.flush()

        t_gen = time.perf_counter()
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
        if stream is not None and not finished[0]:
            sys.stdout.write(stream.flush())
    except (ValueError, FileNotFoundError, RuntimeError) as e:
        print(f"fullthrottle: error: {e}", file=sys.stderr)
        return 2
    wall = time.perf_counter() - t_gen
    print(file=sys.stdout, flush=True)  # (the tokens' line ends before the summary on stderr)
    print(_report(args, st.new_tokens, wall, gen, device, dtype).format(), file=sys.stderr)
    print(
        f"decode alone: {st.new_tokens} tokens in {st.decode_s:.2f} s = {st.tokens_per_s:.1f} token/s; prefill "
        f"{1e3 * st.prefill_s:.1f} ms; ready in {ready_s:.2f} s (graphs: {sorted(gen.graphs) or 'off'}) "
        f"on {device}",
        file=sys.stderr,
    )
    return 0
