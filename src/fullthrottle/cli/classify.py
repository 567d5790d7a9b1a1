"""``fullthrottle classify``: images to top-k labels, with a progress bar and the stage report."""

from __future__ import annotations

import io
import os
import sys
from collections.abc import Iterator

from .classify_ray import classify_on_ray_cli, ray_refusal
from .common import (
    Terminated,
    _close_out,
    _format_result,
    _gpu_decode_settings,
    _input_limits,
    _silence_stdout,
    begin_out,
    cannot_write,
    freeze_startup_objects,
    held_signals,
    numbered_lines,
    open_out,
    sample_photos,
    sigterm_as_interrupt,
    stdin_bytes,
    stopped,
    write_report_json,
)


def _with_stdin_list(inputs: list) -> Iterator:
    """``inputs`` with ``-`` replaced by the inputs read from stdin, one per line (paths, folders,
    globs or URLs; blank lines skipped; a name's bytes as the file system gives them), read as the
    run goes."""
    for inp in inputs:
        if inp != "-":
            yield inp
            continue
        f = stdin_bytes()
        if not hasattr(f, "peek"):  # (a test's stand-in)
            f = io.BufferedReader(f)
        head = f.peek(16)[:16]  # (the first bytes as they are: a line may end inside a header)
        for n, raw in numbered_lines(f):
            if n == 1 and (b"\0" in raw or _is_image(head)):
                raise StdinNotNames(
                    "stdin holds image data, not names: 'classify -' reads paths, folders or URLs, one a "
                    "line; give an image file as an argument (fullthrottle classify photo.jpg)"
                )
            if raw.strip():
                yield os.fsdecode(raw)


class StdinNotNames(ValueError):
    """What ``classify -`` read from stdin is an image's bytes, not a list of inputs."""


def _is_image(head: bytes) -> bool:
    """Whether ``head``, the first bytes of a stream, open an image file (``sniff``), a BMP only with
    the 4 zero bytes after its size (a line of names may begin ``BM``)."""
    from ..data.image_header import sniff

    fmt = sniff(head)
    return fmt is not None and (fmt != "BMP" or head[6:10] == b"\0\0\0\0")


def _output_among_inputs(inputs, *outputs) -> str | None:
    """Why an output file would destroy an input (it is one of the input files, a file a glob pattern
    matches or would match, or an image file in an input folder, which the run would read), or why
    two outputs are one file; None when neither."""
    import glob

    from ..data.sources import IMAGE_SUFFIXES, glob_match

    real = [os.path.realpath(o) for o in outputs if o and o != "-"]
    if len(set(real)) < len(real):
        return "--out and --report-json name the same file: one would overwrite the other"
    for out in outputs:
        if not out or out == "-":
            continue
        target = os.path.realpath(out)
        for inp in inputs or ():
            if not isinstance(inp, str) or "://" in inp or inp == "-":  # (stdin's: read later)
                continue
            if glob.has_magic(inp) and not os.path.exists(inp):  # (matched by name: no walk of the tree here)
                pattern = os.path.abspath(inp).split(os.sep)
                if any(glob_match(p.split(os.sep), pattern) for p in (os.path.abspath(out), target)):
                    return f"the output {out} matches the input pattern {inp}: writing it would destroy an input"
                continue
            src = os.path.realpath(inp)
            if os.path.isfile(src) and src == target:
                return f"the output {out} is one of the inputs: writing it would destroy it"
            inside = any(  # (by its real path, or by the path given: the walk follows symlinked folders)
                t.startswith(d + os.sep) for t in (target, os.path.abspath(out)) for d in (src, os.path.abspath(inp))
            )
            if os.path.isdir(src) and inside and target.lower().endswith(IMAGE_SUFFIXES):
                return f"the output {out} is an image file inside the input folder {inp}: choose another name"
        if _is_image_file(target):  # (an input reached by a link the walk follows, or any photo)
            return f"the output {out} is an image file: writing it would destroy it"
    return None


def _is_image_file(path: str) -> bool:
    """Whether ``path`` is an existing regular file that starts like an image (sniffed by content)."""
    from ..data.image_header import sniff

    if not os.path.isfile(path):  # (never opened: a FIFO would block)
        return False
    try:
        with open(path, "rb") as f:
            head = f.read(32)
    except OSError:
        return False
    return bool(head) and sniff(head) is not None


def cmd_classify(args) -> int:
    with sigterm_as_interrupt():  # (SIGTERM stops the run as a Ctrl-C does: exit 143)
        return _classify(args)


def _classify(args) -> int:
    with held_signals():  # (a Ctrl-C or SIGTERM is taken once the native libraries have imported)
        import torch
        from tqdm import tqdm

        from ..core.config import Config, resolve_dtype
        from ..core.device import resolve_device
        from ..workloads.classify.models import WeightsError
        from ..workloads.classify.pipeline import Pipeline
        from ..workloads.classify.run import PipelineError

    inputs = inputs_given = args.inputs
    refusal = ray_refusal(args) if args.ray is not None else None
    if not refusal and "-" in inputs:
        try:
            stdin_bytes()
        except OSError as e:
            refusal = f"cannot read the inputs from stdin: {e.strerror}"
        if inputs.count("-") > 1:
            refusal = "'-' (the inputs on stdin) is given more than once"
    if refusal:
        print(f"fullthrottle: error: {refusal}", file=sys.stderr)
        return 2
    report = args.report_json  # ("-": stdout, which then carries the report alone)
    to_stdout = report == "-" or bool(report) and os.path.realpath(report) == os.path.realpath("/dev/stdout")
    usage = (
        "--out needs a file name ('-' for stdout)"
        if args.out == ""
        else "--report-json needs a file name ('-' for stdout, with --out FILE)"
        if report == ""
        else f"--report-json {report} would write the report to stdout, which carries the results: "
        "give --out FILE for the results, or --report-json FILE"
        if to_stdout and args.out in (None, "-")
        else None
    )
    if usage:
        print(f"fullthrottle: error: {usage}", file=sys.stderr)
        return 2
    clash = _output_among_inputs(inputs, args.out, "/dev/stdout" if to_stdout else report)
    if clash:
        print(f"fullthrottle: error: {clash}", file=sys.stderr)
        return 2
    report = "-" if to_stdout else report
    for path in (args.out, report):
        if path and path != "-" and not os.path.isdir(os.path.dirname(os.path.abspath(path))):
            print(f"fullthrottle: error: cannot write {path}: its folder does not exist", file=sys.stderr)
            return 2
    why = cannot_write(report) if report and report != "-" else None
    if why:
        print(f"fullthrottle: error: cannot write {report}: {why}", file=sys.stderr)
        return 2
    out = None
    if args.out == "-":
        out = sys.stdout
    elif args.out:
        try:  # opened before the model is built: a bad path costs nothing (emptied once the run starts)
            out = open_out(args.out)
        except OSError as e:
            print(f"fullthrottle: error: cannot write {args.out}: {e.strerror or e}", file=sys.stderr)
            return 2
    if "-" in inputs:
        inputs = args.inputs = _with_stdin_list(inputs)
    if args.ray is not None:  # (its outputs checked and opened as a local run's)
        return classify_on_ray_cli(args, out)
    try:
        if not inputs:
            inputs = sample_photos()
            print(f"no inputs given: classifying {len(inputs)} sample photos from scikit-image", file=sys.stderr)
        device = resolve_device(args.device)
        dtype = resolve_dtype(args.dtype, device)
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
            **_input_limits(args),
            preprocess=args.preprocess,
        )
        if device.type != "cuda":  # say what a CPU run leaves out, rather than ignoring it silently
            ignored = [  # (flag as given, what the CPU run does instead)
                (f, does)
                for f, on, does in (
                    ("--gpu-decode", args.gpu_decode is True, "decodes on the CPU"),
                    (f"--gpu-decoder {args.gpu_decoder}", args.gpu_decoder is not None, "decodes on the CPU"),
                    (
                        f"--gpu-decode-processes {args.gpu_decode_processes}",
                        args.gpu_decode_processes is not None,
                        "decodes on the CPU",
                    ),
                    ("--compile", args.compile, "runs the model eager"),
                    (f"--dtype {args.dtype}", args.dtype not in (None, "float32"), "computes in float32"),
                )
                if on
            ]
            if ignored:
                does = " and ".join(dict.fromkeys(d for _, d in ignored))
                ignored = [f for f, _ in ignored]
                print(
                    f"note: {' and '.join(ignored)} need{'s' if len(ignored) == 1 else ''} CUDA: "
                    f"this run on {device} {does}",
                    file=sys.stderr,
                )
        pipe = Pipeline(cfg)
        freeze_startup_objects()
        n_classes = pipe.engine.num_classes
        # (the default top-k over a model of fewer classes lists them all, unremarked)
        if n_classes is not None and args.top_k > n_classes and args.top_k != Config.top_k:
            print(
                f"note: --top-k {args.top_k} is more than the model's {n_classes} "
                f"class{'' if n_classes == 1 else 'es'}: "
                f"each result lists all {n_classes}",
                file=sys.stderr,
            )
    except (ValueError, FileNotFoundError, RuntimeError, WeightsError) as e:
        print(f"fullthrottle: error: {e}", file=sys.stderr)
        _close_out(out)
        return 2
    except KeyboardInterrupt as e:  # during start-up (model load, graph capture, decoder processes)
        rc = stopped(e)
        _close_out(out)
        return rc
    begin_out(out)
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
        total=len(inputs) if isinstance(inputs, list) and all(os.path.isfile(str(i)) for i in inputs) else None,
    )
    results = pipe.run(inputs)
    dest = args.out if args.out not in (None, "-") else "stdout"  # (where the results go, named in errors)
    try:
        for r in results:
            failed += not r.ok
            if out is not None:
                out.write(r.to_json() + "\n")
            # (nolock: the bar is this thread's alone, and tqdm's lock is taken inside a `try` whose
            # `finally` releases it: a Ctrl-C before or between its two locks' acquires raised
            # "RuntimeError: cannot release un-acquired lock" in place of the interrupt: exit 1)
            if out is None:
                tqdm.write(_format_result(r), file=sys.stdout, nolock=True)
            elif not r.ok and out is not sys.stdout:
                tqdm.write(_format_result(r), file=sys.stderr, nolock=True)
            bar.update(1)
    except KeyboardInterrupt as e:
        bar.close()
        # (said first: a model's forward that runs on in Python holds up the stop until it returns)
        if isinstance(e, Terminated):
            print("terminated: stopping", file=sys.stderr, flush=True)
        else:
            print("interrupted: stopping (Ctrl-C again to quit at once)", file=sys.stderr, flush=True)
        results.close()  # stop every stage and join its thread before the interpreter exits
        return 143 if isinstance(e, Terminated) else 130
    except BrokenPipeError:  # the reader went away (`| head`): stop quietly, like other CLI tools
        results.close()
        if out is not None and out is not sys.stdout:  # (--out FIFO: an output that cannot be written)
            print(f"fullthrottle: error: cannot write {dest}: its reader went away (Broken pipe)", file=sys.stderr)
            return 2
        _silence_stdout()
        return 1
    except PipelineError as e:
        if not isinstance(e.__cause__, StdinNotNames):
            raise
        print(f"fullthrottle: error: {e.__cause__}", file=sys.stderr)
        return 2
    except OSError as e:  # the output could not be written (disk full, ...): stop, say so
        results.close()
        print(f"fullthrottle: error: cannot write {dest}: {e.strerror or e}", file=sys.stderr)
        return 2
    finally:
        bar.close()
        pipe.close()  # stops the decoder processes
        err = _close_out(out)
    if err is not None:
        print(f"fullthrottle: error: cannot write {dest}: {err}", file=sys.stderr)
        return 2
    rep = pipe.last_report
    if rep.items == 0 and "-" in (inputs_given or ()):  # (any other input is an item, if only an error)
        rep.notes.append("stdin held no input: 'classify -' reads paths, folders or URLs, one a line")
    print(rep.format(), file=sys.stderr)
    if device.type == "cuda":
        print(f"GPU: {torch.cuda.get_device_name(device)}", file=sys.stderr)
    try:
        if not write_report_json(rep, report):
            return 2
    except BrokenPipeError:  # (the report on stdout, whose reader went away)
        _silence_stdout()
        return 1
    return 1 if failed else 0
