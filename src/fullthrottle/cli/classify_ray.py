"""``fullthrottle classify --ray``: the offline job on a Ray cluster (:func:`~fullthrottle.ray_jobs.classify_on_ray`),
written as a local run writes its results: the same JSON lines (``index``, ``id`` as typed, ``top_k``
or ``error`` with its stage and kind), each with the ``node`` that ran it, or the same text lines."""

from __future__ import annotations

import importlib.util
import json
import os
import sys
import time

from .common import (
    Terminated,
    _close_out,
    _format_result,
    _gpu_decode_settings,
    _input_limits,
    _silence_stdout,
    begin_out,
    sample_photos,
    say_stopping,
)


def ray_refusal(args) -> str | None:
    """Why ``classify --ray`` cannot run with these arguments (before any output is opened), or None."""
    if importlib.util.find_spec("ray") is None:
        return "--ray needs Ray: pip install 'fullthrottle[ray]'"
    if args.ray not in ("local", "auto") and ("/" in args.ray.split("://")[-1] or os.path.exists(args.ray)):
        return f"--ray took {args.ray!r} as the cluster's address: put --ray after the inputs, or write --ray=ADDRESS"
    if args.report_json is not None:  # (each actor runs a pipeline of its own: no one stage table)
        return "--report-json is not written for a --ray job: leave it out (the summary goes to stderr)"
    try:
        _gpu_decode_settings(args)
    except ValueError as e:
        return str(e)
    return None


def classify_on_ray_cli(args, out) -> int:
    """Run the job and write its lines to ``out`` (an open file, ``sys.stdout`` for ``--out -``, or
    None: text lines on stdout). Returns the exit code: 0 all ok, 1 some item failed (or the reader
    of stdout went away), 2 the output could not be written or the job failed (an actor that could
    not start: Ray's reason), 130/143 stopped."""
    from ..ray_jobs import RayUnreachable, classify_on_ray
    from ..workloads.classify.result import Result

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
        "dtype": args.dtype,  # (None: the default of the device each actor runs on)
        **_gpu_decode_settings(args),  # (the GPU decoder flags go to the actors too)
        **_input_limits(args),
    }
    inputs = args.inputs or sample_photos()
    dest = args.out if args.out not in (None, "-") else "stdout"  # (where the results go, named in errors)
    address = None if args.ray == "local" else args.ray
    t0, ok, failed = time.perf_counter(), 0, 0
    try:
        for row in classify_on_ray(inputs, cfg, address, concurrency=args.ray_actors, batch_size=args.batch_size):
            if ok + failed == 0:  # (the job has started: the file's old lines go)
                begin_out(out)
            r = Result(ok + failed, row["id"], row["labels"], row["class_ids"], row["probs"], row["error"])
            ok += r.ok
            failed += not r.ok
            if out is None:
                print(_format_result(r))
            else:
                out.write(json.dumps(r.to_dict() | {"node": row["node"]}) + "\n")
                if not r.ok and out is not sys.stdout:  # (as a local run: failures also on stderr)
                    print(_format_result(r), file=sys.stderr)
    except KeyboardInterrupt as e:
        say_stopping(e)
        if address is None:  # (the local cluster this run started, its agents included, stopped now)
            import ray

            ray.shutdown()
        return 143 if isinstance(e, Terminated) else 130
    except BrokenPipeError:  # the reader went away (`| head`): stop quietly, like other CLI tools
        _silence_stdout()
        return 1
    except RayUnreachable as e:
        print(f"fullthrottle: error: {e}", file=sys.stderr)
        return 2
    except OSError as e:  # the output could not be written (disk full, ...): stop, say so
        print(f"fullthrottle: error: cannot write {dest}: {e.strerror or e}", file=sys.stderr)
        return 2
    except Exception as e:  # noqa: BLE001 - Ray's: an actor that could not start (a missing --weights, ...)
        if not type(e).__module__.startswith("ray"):
            raise
        why = (str(e).strip().splitlines() or [type(e).__name__])[-1]  # (the cause's own line, after its traceback)
        print(f"fullthrottle: error: the Ray job failed: {why}", file=sys.stderr)
        return 2
    finally:
        err = _close_out(out)
    if err is not None:
        print(f"fullthrottle: error: cannot write {dest}: {err}", file=sys.stderr)
        return 2
    print(
        f"{ok + failed} items: {ok} ok, {failed} failed in {time.perf_counter() - t0:.1f} s on Ray "
        f"({args.ray_actors} actors)",
        file=sys.stderr,
    )
    return 1 if failed else 0
