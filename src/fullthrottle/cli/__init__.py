"""The ``fullthrottle`` command line.

Exit status of ``fullthrottle classify``: 0 every item classified; 1 at least one item failed
(its error is in the output); 2 bad usage or configuration (unknown model, weights that do not fit,
CUDA asked for but absent) or an output file that cannot be written; 130 interrupted (Ctrl-C).

One module per command (``classify``, ``serve``, ``run``, ``generate``, ``embed``, ``bench``), the parser in
:mod:`~fullthrottle.cli.parser`, what they share in :mod:`~fullthrottle.cli.common`.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import sys

from ..core import env
from ..core.config import Config
from .bench import cmd_bench
from .classify import cmd_classify
from .common import (
    _close_out,
    _gpu_decode_settings,
    _silence_stdout,
    sample_photos,
    say_stopping,
    sigterm_as_interrupt,
    stopped,
    with_stdout,
)
from .embed import _read_texts, cmd_embed
from .generate import _check_memory_for, _llama_bytes, cmd_generate
from .options import ray_only_given
from .parser import build_parser
from .run import cmd_run
from .serve import cmd_serve

__all__ = [
    "main",
    "build_parser",
    "sample_photos",
    "_gpu_decode_settings",
    "_read_texts",
    "_check_memory_for",
    "_llama_bytes",
    "_close_out",
]


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args, unknown = parser.parse_known_args(argv)
    # (a command's own mistakes under its own usage line, not the top-level one)
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction)).choices[args.command]
    if unknown:
        hint = (
            " (classify takes the address as --ray ADDRESS)"
            if "--ray-address" in unknown and args.command == "classify"
            else ""
        )
        sub.error(f"unrecognized arguments: {' '.join(unknown)}{hint}")
    if flag := ray_only_given(args):
        sub.error(f"{flag} acts with --ray only")
    args.argv = list(sys.argv[1:] if argv is None else argv)
    try:
        env.check()  # (a mistyped setting: one line, before anything starts)
    except ValueError as e:
        print(f"fullthrottle: error: {e}", file=sys.stderr)
        return 2
    try:
        return _run_command(args, argv)
    except KeyboardInterrupt as e:  # before a command's own handling (Ctrl-C while torch is imported, say)
        return stopped(e, lead="\n")


def mps_wanted(args) -> bool:
    """Whether classify or serve starts a private CUDA MPS server: when it may decode on the GPU (not
    ``--device cpu``, not ``--no-gpu-decode``, not ``--ray``) and ``--mps`` is on, which by default it
    is for classify (the GPU decoder processes and the model then share the GPU at once: a faster run
    over a folder) and not for serve (a fatal GPU fault of one MPS client reaches every client of
    the GPU: a server of untrusted images keeps its processes apart)."""
    gpu_decode = Config.gpu_decode if args.gpu_decode is None else args.gpu_decode
    on = args.command == "classify" if args.mps is None else args.mps
    on_cpu = str(args.device).startswith("cpu")  # ("cpu", "cpu:0")
    return bool(gpu_decode and on and not on_cpu and not getattr(args, "ray", None))


@contextlib.contextmanager
def _private_mps(args):
    """classify and serve: a private CUDA MPS server (:mod:`fullthrottle.core.mps`) while the command runs,
    when :func:`mps_wanted`; started before any CUDA call."""
    from ..core.mps import private_mps

    wanted = mps_wanted(args)
    with private_mps(wanted) as how:
        if args.mps and not wanted:
            gpu_decode = Config.gpu_decode if args.gpu_decode is None else args.gpu_decode
            why = next(
                w
                for w, on in (
                    (f"--device {args.device}", str(args.device).startswith("cpu")),
                    ("--no-gpu-decode", not gpu_decode),
                    ("--ray", getattr(args, "ray", None)),
                )
                if on
            )
            print(f"note: --mps is for GPU decoding on CUDA, not with {why}: no MPS server started", file=sys.stderr)
        elif args.mps and how not in ("started", "a server is running"):
            print(f"note: --mps: no private CUDA MPS server: {how}", file=sys.stderr)
        yield


def _run_command(args, argv: list[str] | None) -> int:
    if args.command == "bench":
        return with_stdout(cmd_bench, args)
    if args.command == "serve":
        try:  # (SIGTERM before the server's own handlers, in the imports and checks: stop as it does, exit 0)
            with sigterm_as_interrupt(), _private_mps(args):
                return cmd_serve(args)
        except KeyboardInterrupt as e:
            say_stopping(e)
            return 0
    if args.command in ("generate", "embed", "run"):
        cmd = {"generate": cmd_generate, "embed": cmd_embed, "run": cmd_run}[args.command]
        try:
            with sigterm_as_interrupt():  # (SIGTERM stops it as a Ctrl-C does, saying so: exit 143)
                return with_stdout(cmd, args)
        except KeyboardInterrupt as e:
            return stopped(e, lead="\n")
        except BrokenPipeError:  # the reader went away (`| head`): stop quietly
            _silence_stdout()
            return 1
    if args.command == "classify":
        try:
            with _private_mps(args):
                rc = with_stdout(cmd_classify, args)
        except KeyboardInterrupt as e:  # (while cmd_classify imported torch: before its own handling)
            rc = stopped(e, lead="\n")
        if rc in (130, 143) and argv is None:
            # Interrupted or terminated: our stages are joined, but native thread pools (or a
            # half-imported torch) may still be tearing down; skip interpreter finalisation, which can
            # otherwise abort (exit 134), crash (-11) or end by the signal (-2) in their destructors.
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(rc)
        return rc
    return 2
