"""``fullthrottle run``: requests answered offline by a workload of the user's own, in this process
(:func:`~fullthrottle.core.workload.run_offline`) or in Ray Data actors
(:func:`~fullthrottle.ray_jobs.workload_on_ray`)."""

from __future__ import annotations

import contextlib
import json
import sys

#: requests read and answered at a time (bounds memory on large files; batches form within a chunk)
CHUNK = 4096


def _bodies(f):
    """``(line number, body or None, error or None)`` per non-empty line of ``f``."""
    for n, line in enumerate(f, 1):
        if not line.strip():
            continue
        try:
            yield n, json.loads(line), None
        except ValueError as e:
            yield n, None, f"malformed JSON: {e}"


def cmd_run(args) -> int:
    from ..core.workload import load_workload

    try:
        workload = load_workload(args.workload)
        src = sys.stdin if args.file == "-" else open(args.file, encoding="utf-8")
    except (ValueError, OSError) as e:
        print(f"fullthrottle: error: {e}", file=sys.stderr)
        return 2
    try:
        out = sys.stdout if args.out == "-" else open(args.out, "w", encoding="utf-8")
    except OSError as e:
        print(f"fullthrottle: error: --out: {e}", file=sys.stderr)
        return 2
    failed = total = 0
    with src, out if out is not sys.stdout else contextlib.nullcontext():
        lines = list(_bodies(src)) if args.ray else None
        if args.ray:
            import importlib.util

            if importlib.util.find_spec("ray") is None:
                print("fullthrottle: error: --ray needs Ray: pip install 'fullthrottle[ray]'", file=sys.stderr)
                return 2
            from ..ray_jobs import workload_on_ray

            address = None if args.ray == "local" else args.ray
            good = [(n, b) for n, b, e in lines if e is None]
            answers = dict(
                zip(
                    [n for n, _ in good],
                    workload_on_ray(args.workload, [b for _, b in good], address, args.ray_actors, device=args.device),
                )
            )
            for n, _, e in lines:
                a = answers.get(n, {"response": None, "error": e})
                failed += a["error"] is not None
                total += 1
                out.write(json.dumps({"line": n, **_answer(a["response"], a["error"])}) + "\n")
        else:
            from ..core.device import resolve_device
            from ..core.workload import run_offline

            try:
                workload.setup(str(resolve_device(args.device)))
            except Exception as e:  # noqa: BLE001 - the user's code: say what failed
                print(f"fullthrottle: error: workload {workload.name!r}: setup() failed: {e!r}", file=sys.stderr)
                return 2
            chunk: list = []
            for row in _bodies(src):
                chunk.append(row)
                if len(chunk) >= CHUNK:
                    f, t = _answer_chunk(workload, chunk, out, run_offline)
                    failed, total, chunk = failed + f, total + t, []
            if chunk:
                f, t = _answer_chunk(workload, chunk, out, run_offline)
                failed, total = failed + f, total + t
    print(f"{total} requests: {total - failed} ok, {failed} failed ({workload.name})", file=sys.stderr)
    return 1 if failed else 0


def _answer(response, error) -> dict:
    return {"error": error} if error is not None else {"response": response}


def _answer_chunk(workload, chunk, out, run_offline) -> tuple[int, int]:
    bodies = [b for _, b, e in chunk if e is None]
    got = iter(run_offline(workload, bodies))
    failed = 0
    for n, _, e in chunk:
        resp, err = (None, e) if e is not None else next(got)
        failed += err is not None
        out.write(json.dumps({"line": n, **_answer(resp, err)}) + "\n")
    return failed, len(chunk)
