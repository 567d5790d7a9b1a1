"""``fullthrottle run``: requests answered offline by a workload of the user's own, in this process
(:func:`~fullthrottle.core.workload.answers_offline`) or in Ray Data actors
(:func:`~fullthrottle.ray_jobs.workload_on_ray`)."""

from __future__ import annotations

import contextlib
import json
import sys

from .common import _silence_stdout, numbered_lines, own_stdin

#: most requests read and answered at a time (bounds memory on large files; batches form within a
#: chunk, of 4 batches' requests at least; each answer is written once it and those before it are)
CHUNK = 4096


def _bodies(f):
    """``(line number, body or None, error or None)`` per non-empty line of the binary file ``f``."""
    from ..core.json_body import parse_body

    for n, raw in numbered_lines(f):
        if not raw.strip():
            continue
        try:
            yield n, parse_body(raw), None
        except ValueError as e:  # (the body is one line of the file: a position in it is a column)
            yield n, None, str(e).replace(": line 1 column ", ": column ")


def _fail(msg: str) -> int:
    print(f"fullthrottle: error: {msg}", file=sys.stderr)
    return 2


def cmd_run(args) -> int:
    stdout = sys.stdout  # (the answers' when --out is -)
    with contextlib.redirect_stdout(sys.stderr):  # the workload's own print()s: never among the answers
        return _run(args, stdout)


def _run(args, stdout) -> int:
    from ..core.device import resolve_device
    from ..core.workload import check_stats, load_workload, user_traceback
    from .common import cannot_write, overwrites_an_input

    try:
        workload = load_workload(args.workload)
        device = args.device if args.ray else str(resolve_device(args.device))  # (Ray: the actors' own)
    except (ValueError, RuntimeError, OSError) as e:
        return _fail(str(e))
    try:
        src = own_stdin() if args.file == "-" else open(args.file, "rb")
    except OSError as e:
        return _fail(f"cannot read {args.file}: {e.strerror or e}")
    clash = overwrites_an_input({"--out": args.out}, {"the input": args.file})
    if clash:
        return _fail(clash)
    if args.out != "-" and (why := cannot_write(args.out)):  # (before setup(), which may take long)
        return _fail(f"cannot write --out {args.out}: {why}")
    if not args.ray:
        try:
            workload.setup(device)
        except (Exception, SystemExit) as e:  # noqa: BLE001 - the user's code: its own frames, then one clear line
            return _fail(f"workload {workload.name!r}: setup() failed:\n{user_traceback(e)}")
        try:
            check_stats(workload)
        except ValueError as e:
            return _fail(str(e))
    try:  # (opened once the workload is ready: a failed start leaves an existing file as it was)
        out = stdout if args.out == "-" else open(args.out, "w", encoding="utf-8")
    except OSError as e:
        return _fail(f"cannot write --out {args.out}: {e.strerror or e}")
    failed = total = 0
    try:
        # (stdin's copy is not closed: its reader thread may still be blocked reading it, and a close
        # would wait for that read; it goes with the process)
        with src if args.file != "-" else contextlib.nullcontext():
            size = min(CHUNK, max(16, 4 * workload.max_batch)) if not args.ray else None
            for chunk in _chunks(_bodies(src), size, stream=args.file == "-"):
                for n, resp, err in _answer(workload, chunk, args, device):
                    failed += err is not None
                    total += 1
                    row = {
                        "line": n,
                        **({"error": err} if err is not None else {}),
                        **({"response": resp} if resp is not None else {}),
                    }
                    out.write(json.dumps(row))
                    out.write("\n")
                    out.flush()  # (what is answered is written: Ctrl-C or a crash keeps it)
        if out is not stdout:
            out.close()
    except BrokenPipeError:  # the reader went away (`| head`): stop quietly
        _silence_stdout(stdout)
        return 1
    except RuntimeError as e:  # (--ray: the workload's setup() failed in the actors, or no cluster there)
        from ..ray_jobs import RayUnreachable, SetupFailed

        if not isinstance(e, (SetupFailed, RayUnreachable)):
            raise
        return _fail(str(e))
    except OSError as e:  # (disk full, stdout closed)
        return _fail(f"cannot write {'stdout' if out is stdout else args.out}: {e.strerror or e}")
    print(
        f"{total} request{'s' * (total != 1)}: {total - failed} ok, {failed} failed ({workload.name})", file=sys.stderr
    )
    if total == 0:  # (said, as embed says an empty input)
        name = "stdin" if args.file == "-" else args.file
        print(f"note: {name} holds no request (one JSON request body a line; blank lines are skipped)", file=sys.stderr)
    return 1 if failed else 0


def _chunks(rows, size: int | None, stream: bool = False):
    """``rows`` in lists of ``size`` (None: one list). ``stream`` (stdin: a pipe or a terminal that may
    stay open): a list is cut short once the source stalls (:class:`~fullthrottle.core.read_ahead.ReadAhead`),
    so that each line is answered as it comes, not once ``size`` lines have."""
    if stream and size:
        from ..core.read_ahead import ReadAhead

        ahead = ReadAhead(rows, size)
        try:
            while True:
                block, error, ended = ahead.take()
                if block:
                    yield block
                if error is not None:
                    raise error
                if ended:
                    return
        finally:
            ahead.close()
    chunk: list = []
    for row in rows:
        chunk.append(row)
        if size and len(chunk) >= size:
            yield chunk
            chunk = []
    if chunk:
        yield chunk


def _answer(workload, chunk: list, args, device: str):
    """``(line, response, error)`` for each line of ``chunk``, in order."""
    good = [b for _, b, e in chunk if e is None]
    if args.ray:
        from ..ray_jobs import workload_on_ray

        got = iter(
            (r["response"], r["error"])
            for r in workload_on_ray(args.workload, good, args.ray_address, args.ray_actors, device=device)
        )
    else:
        from ..core.workload import answers_offline

        got = answers_offline(workload, good)
    for n, _, e in chunk:
        resp, err = (None, e) if e is not None else next(got)
        yield n, resp, err
