"""``fullthrottle serve``: the HTTP server's options checked, then :func:`fullthrottle.server.app.run_server`."""

from __future__ import annotations

import importlib.util
import os
import sys

from ..workloads.classify.models import spec
from .common import _gpu_decode_settings, _input_limits, say_stopping, sigterm_as_interrupt


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
    from .common import held_signals

    with held_signals():  # (a Ctrl-C or SIGTERM is taken once the native libraries have imported)
        from ..core.config import Config, resolve_dtype, usable_cores
        from ..core.device import resolve_device
        from ..server.app import ServeOptions, run_server
        from ..server.options import default_http_workers, serve_threads

    try:
        device = resolve_device(args.device)
        decode = _gpu_decode_settings(args)
        threads = serve_threads(args.threads, device.type, decode["gpu_decode"], args.preprocess)
        cfg = Config(
            model=args.model,
            weights=args.weights,
            device=str(device),
            dtype=resolve_dtype(args.dtype, device),
            max_batch_size=args.max_batch_size,
            max_wait_ms=args.max_wait_ms,
            threads=threads,
            top_k=args.top_k,
            graphs=args.graphs,
            ordered=False,
            **decode,
            **_input_limits(args),
            preprocess=args.preprocess,
        )
        spec(args.model)  # (a MODULE:CLASS is imported now: its errors before anything starts)
        if args.weights is not None:  # weights that are not there, or do not fit: an error before anything starts
            from ..workloads.classify.models import check_weights_file, load_model

            check_weights_file(args.weights)
            if args.classify:
                load_model(args.model, args.weights)
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
        if args.max_wait_ms >= 1000 * args.timeout_s:  # every request would wait past its deadline
            raise ValueError(
                f"--max-wait-ms {args.max_wait_ms:g} must be below the request deadline "
                f"--timeout-s {args.timeout_s:g} (in ms: {1000 * args.timeout_s:g})"
            )
        from ..server.fetch import FetchPolicy
        from ..server.keys import load_keys

        FetchPolicy(tuple(args.allow_fetch))  # (checks every entry now)
        from ..server.workload_routes import load_workload

        workloads = tuple(load_workload(spec) for spec in args.workload)  # (imported before the model loads)
        if len({w.name for w in workloads}) < len(workloads):
            raise ValueError(f"--workload: two workloads named alike ({', '.join(w.name for w in workloads)})")
        if args.llm_model_dir and args.llm_random:
            raise ValueError("give either --llm-model-dir or --llm-random, not both")
        llm = args.llm_model_dir or args.llm_random
        if not llm and (unused := _llm_flags_given(args)):
            print(f"note: {', '.join(unused)}: no LLM is served (--llm-model-dir or --llm-random)", file=sys.stderr)
        if not args.classify and not (workloads or args.embed_model or llm):
            raise ValueError(
                "--no-classify leaves nothing to serve: add --workload, --embed-model, --llm-model-dir or --llm-random"
            )
        em = args.embed_model
        if em and em != "default" and not os.path.isfile(os.path.join(em, "config.json")):  # (before anything loads)
            raise ValueError(f"--embed-model {em}: no config.json there (a sentence-transformers folder, or 'default')")
        if getattr(args, "ray", None) and (llm or args.gpus is not None):
            raise ValueError("an LLM and --gpus are not served through --ray (Ray Serve: --replicas)")
        if getattr(args, "ray", None) and args.http_workers != "auto":
            raise ValueError("--http-workers is for the server without --ray (Ray Serve's own proxy takes the HTTP)")
        http_workers = default_http_workers(usable_cores()) if args.http_workers == "auto" else args.http_workers
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
        max_request_pixels=max(1, round(args.max_request_megapixels * 1e6)),
        access_log=args.access_log,
    )
    if args.host not in ("127.0.0.1", "localhost", "::1") and not keys:
        print(f"note: serving on {args.host} without --api-key: anyone who can reach it may use it", file=sys.stderr)
    llm = None
    if args.llm_model_dir or args.llm_random:
        import torch

        from ..workloads.llm.checks import serving_context
        from ..workloads.llm.generate import Generator
        from ..workloads.llm.llama import load_hf
        from ..workloads.llm.text import LlmText
        from .generate import random_llama

        dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
        try:
            if args.llm_random:
                model, tok = random_llama(args.llm_random, device, dtype), None
                print("WARNING: --llm-random: random weights, the tokens are meaningless", file=sys.stderr)
            else:
                model = load_hf(args.llm_model_dir, device, dtype)
                tok = LlmText.from_folder(args.llm_model_dir)
        except (FileNotFoundError, ValueError) as e:
            print(f"fullthrottle: error: {e}", file=sys.stderr)
            return 2
        try:
            if args.llm_kv_dtype != "auto" and not args.llm_kv_pages:
                raise ValueError(
                    f"--llm-kv-dtype {args.llm_kv_dtype} needs paged KV memory: give --llm-kv-pages N or auto"
                )
            seq = args.llm_max_seq_len or serving_context(model.cfg)
            pages = args.llm_kv_pages
            if pages == "auto":
                from ..workloads.llm.checks import pages_that_fit
                from ..workloads.llm.kv_pages import PAGE

                pages = pages_that_fit(model, PAGE, args.llm_kv_dtype, args.llm_max_prefill_tokens)
            kw = dict(graphs=args.graphs, logprobs=args.llm_logprobs, kv_pages=pages, kv_dtype=args.llm_kv_dtype)
            kw.update(max_prefill_tokens=args.llm_max_prefill_tokens)
            llm = (Generator(model, args.llm_max_batch, seq, **kw), tok)
            kv = llm[0].kv
            if args.llm_kv_pages == "auto":
                print(
                    f"note: --llm-kv-pages auto: {kv.num_pages} pages ({kv.num_pages * kv.page} token positions)",
                    file=sys.stderr,
                )
            elif kv is not None and kv.num_pages < pages:  # (capped at what full rows can use)
                print(
                    f"note: --llm-kv-pages {pages}: {kv.num_pages} used, all that {args.llm_max_batch} rows of "
                    f"{seq} positions can hold",
                    file=sys.stderr,
                )
        except (ValueError, RuntimeError, MemoryError) as e:  # (RuntimeError: torch's out of memory)
            print(f"fullthrottle: error: {e}", file=sys.stderr)
            return 2
    if args.ray:
        if importlib.util.find_spec("ray") is None:
            print("fullthrottle: error: --ray needs Ray Serve: pip install 'fullthrottle[ray]'", file=sys.stderr)
            return 2
        from ..ray_jobs import serve_on_ray

        try:  # (SIGTERM as Ctrl-C: Ray Serve's wait ends, the deployment and the local cluster stop, exit 0)
            with sigterm_as_interrupt():
                serve_on_ray(
                    cfg,
                    ServeOptions(
                        max_queue=args.max_queue,
                        timeout_s=args.timeout_s,
                        max_body_bytes=int(args.max_body_mb * 2**20),
                        embed_model=args.embed_model,
                        workloads=workloads,
                        classify=args.classify,
                        **guard,
                    ),
                    replicas=args.replicas,
                    host=args.host,
                    port=args.port,
                )
        except KeyboardInterrupt as e:
            import ray
            from ray import serve

            say_stopping(e)
            serve.shutdown()
            ray.shutdown()
        return 0
    opts = ServeOptions(
        max_queue=args.max_queue,
        timeout_s=args.timeout_s,
        max_body_bytes=int(args.max_body_mb * 2**20),
        devices=devices,
        embed_model=args.embed_model,
        llm=llm,
        llm_name=os.path.basename(os.path.abspath(args.llm_model_dir)) or "llm"
        if args.llm_model_dir
        else f"random-{args.llm_random}",
        workloads=workloads,
        classify=args.classify,
        **guard,
    )
    if http_workers > 1:
        from ..server.supervisor import run_multi

        return run_multi(cfg, args.host, args.port, opts, http_workers, args.max_connections)
    try:
        run_server(cfg, args.host, args.port, opts, max_connections=args.max_connections)
    except SystemExit as e:  # uvicorn's exit when the start fails (status 3): its reason is logged above
        if e.code == 3:
            return 2
        raise
    return 0


def _llm_flags_given(args) -> list[str]:
    """The ``--llm-*`` engine settings given other than their defaults (they act only with an LLM)."""
    from ..core.config import LlmSettings
    from ..server.options import SERVE_MAX_PREFILL_TOKENS

    defaults = {n: getattr(LlmSettings, n) for n in ("max_batch", "logprobs", "kv_pages", "kv_dtype")}
    defaults["max_prefill_tokens"] = SERVE_MAX_PREFILL_TOKENS
    given = [n for n, v in defaults.items() if getattr(args, f"llm_{n}") != v]
    given += ["max_seq_len"] if args.llm_max_seq_len is not None else []
    return ["--llm-" + n.replace("_", "-") for n in given]
