"""``fullthrottle embed``: texts (a file, or stdin) to embedding vectors (.npy or JSON lines)."""

from __future__ import annotations

import json
import os
import sys
import time

from ..core.json_body import json_type
from .common import numbered_lines, own_stdin, stdin_bytes


def _read_texts(path: str, not_utf8: list[int] | None = None, bad: dict[int, str] | None = None):
    """One text per line of ``path`` ('-': stdin), UTF-8. Lines end at ``\n`` (or ``\r\n``) only: a
    lone ``\r`` inside a line is part of its text. ``.jsonl`` (any case): each line a JSON string or an object
    with a string field ``text`` (stdin is read as plain text). A byte-order mark opening the file
    is dropped. A line that is not valid UTF-8 is still one text (each invalid byte
    read as U+FFFD, so the vectors stay one per line); its number is appended to ``not_utf8``.

    A ``.jsonl`` line that is blank, not valid JSON or lacks ``text`` is that line's error: it yields ``""``
    in its place (the lines keep their indices) and ``bad[index] = message`` (index from 0).

    Raises:
        ValueError: such a line when ``bad`` is None, naming the line.
        InputError: ``path`` cannot be read (the message names it).
    """
    try:
        f = own_stdin() if path == "-" else open(path, "rb")
    except OSError as e:
        raise InputError(f"cannot read {path}: {e.strerror or e}") from None
    try:
        for no, raw in _lines(f, path):
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError:
                line = raw.decode("utf-8", errors="replace")
                if not_utf8 is not None:
                    not_utf8.append(no)
            if path.lower().endswith(".jsonl"):  # (T.JSONL too)
                why = None
                try:
                    obj = json.loads(line)
                except json.JSONDecodeError as e:
                    obj, why = None, f"not valid JSON ({e.msg} at character {e.pos + 1})"
                    if not line.strip():  # (its row kept, as every line's: the vectors stay one per line)
                        why = "a blank line (a .jsonl line is a JSON string or an object with a string field 'text')"
                except RecursionError:
                    obj, why = None, "not valid JSON here (nested too deep)"
                except ValueError as e:  # (an integer of more digits than Python converts)
                    obj, why = None, f"not valid JSON here ({e})"
                text = obj.get("text") if isinstance(obj, dict) else obj
                if why is None and not isinstance(text, str):
                    why = (
                        "a JSON object needs a string field 'text'"
                        if isinstance(obj, dict)
                        else "a line must be a JSON string or an object with a string field 'text', not "
                        + json_type(obj)
                    )
                if why is None:
                    try:
                        text.encode("utf-8")
                    except UnicodeEncodeError as e:
                        why = f"not valid Unicode (a lone surrogate escape at character {e.start + 1} of its text)"
                if why is not None:
                    if bad is None:
                        raise ValueError(f"line {no}: {why}")
                    bad[no - 1] = f"line {no}: {why}"
                    yield ""
                    continue
                yield text
            else:
                yield line
    finally:
        if f is not getattr(sys.stdin, "buffer", None):  # (stdin itself stays open)
            f.close()


class InputError(OSError):
    """The input file could not be read (opened, or a read failed): the message names it."""


def _lines(f, path: str):
    """``numbered_lines(f)``, a read error raised as :class:`InputError` naming ``path``."""
    it = numbered_lines(f)
    while True:
        try:
            line = next(it)
        except StopIteration:
            return
        except OSError as e:
            raise InputError(f"cannot read {path}: {e.strerror or e}") from None
        yield line


def cmd_embed(args) -> int:
    from .common import cannot_write, held_signals, overwrites_an_input, write_report_json

    with held_signals():  # (a Ctrl-C or SIGTERM is taken once the native libraries have imported)
        import numpy as np
        from tqdm import tqdm

        from ..core.gpumon import GpuMonitor
        from ..core.report import Report, StageStats
        from ..workloads.embed import Embedder

    to_stdout = args.out == "-"
    if not (to_stdout or args.out.endswith(".npy") or args.out.endswith(".jsonl")):
        print("fullthrottle: error: --out must end in .npy or .jsonl, or be - (JSON lines on stdout)", file=sys.stderr)
        return 2
    if to_stdout and args.report_json == "-":
        print("fullthrottle: error: --out - and --report-json - would both write to stdout", file=sys.stderr)
        return 2
    if args.file == "-":  # (before the model loads: a closed stdin is said at once)
        try:
            stdin_bytes()
        except OSError as e:
            print(f"fullthrottle: error: cannot read - (stdin): {e.strerror}", file=sys.stderr)
            return 2
    if args.file != "-" and (os.path.isdir(args.file) or not os.path.exists(args.file)):  # (a pipe or device: read)
        what = "is a directory, not a file" if os.path.isdir(args.file) else "no such file"
        print(f"fullthrottle: error: {args.file}: {what}", file=sys.stderr)
        return 2
    if os.path.isfile(args.file):  # (before the output file is made and the model loads; a pipe is left unopened)
        try:
            open(args.file, "rb").close()
        except OSError as e:
            print(f"fullthrottle: error: cannot read {args.file}: {e.strerror or e}", file=sys.stderr)
            return 2
    if not to_stdout and not os.path.isdir(os.path.dirname(os.path.abspath(args.out))):
        print(f"fullthrottle: error: cannot write {args.out}: its folder does not exist", file=sys.stderr)
        return 2
    # find out now, not after the whole corpus is embedded, and leave no empty file behind
    target = args.out if os.path.exists(args.out) else os.path.dirname(os.path.abspath(args.out))
    if not to_stdout and (os.path.isdir(args.out) or not os.access(target, os.W_OK)):
        why = "it is a directory" if os.path.isdir(args.out) else "permission denied"
        print(f"fullthrottle: error: cannot write {args.out}: {why}", file=sys.stderr)
        return 2
    if args.report_json not in (None, "-") and (  # ('-': stdout, free: the vectors go to a file)
        args.report_json == "" or not os.path.isdir(os.path.dirname(os.path.abspath(args.report_json)))
    ):
        print(
            f"fullthrottle: error: cannot write {args.report_json}: not a file in a folder that exists", file=sys.stderr
        )
        return 2
    why = cannot_write(args.report_json) if args.report_json not in (None, "-") else None
    if why:
        print(f"fullthrottle: error: cannot write {args.report_json}: {why}", file=sys.stderr)
        return 2
    clash = overwrites_an_input({"--out": args.out, "--report-json": args.report_json}, {"the input": args.file})
    if clash:
        print(f"fullthrottle: error: {clash}", file=sys.stderr)
        return 2
    if args.model_dir and not os.path.isdir(args.model_dir):
        print(f"fullthrottle: error: model folder not found: {args.model_dir}", file=sys.stderr)
        return 2
    try:
        emb = Embedder(args.model_dir, args.device, args.dtype, args.graphs)
        if emb.device.type != "cuda" and args.dtype not in (None, "float32"):  # (as classify: named, not ignored)
            print(
                f"note: --dtype {args.dtype} needs CUDA: this run on {emb.device} computes in float32", file=sys.stderr
            )
    except FileNotFoundError as e:  # (a folder without the model's files)
        where = args.model_dir or "the default folder"
        why = f"no sentence-transformers model in {where}: {e.filename} is missing" if e.filename else str(e)
        print(f"fullthrottle: error: {why}", file=sys.stderr)
        return 2
    except (ValueError, RuntimeError) as e:
        print(f"fullthrottle: error: {e}", file=sys.stderr)
        return 2
    except Exception as e:  # noqa: BLE001 - a broken model folder (tokenizer.json, safetensors)
        print(
            f"fullthrottle: error: cannot load the model from {args.model_dir or 'the default folder'}: "
            f"{type(e).__name__}: {e}",
            file=sys.stderr,
        )
        return 2
    t0 = time.perf_counter()
    vectors, n, n_trunc, not_utf8, bad = [], 0, 0, [], {}
    respond = StageStats("respond")  # the vectors written out (the tokenize and compute stages: emb.stats)
    bar = tqdm(unit="text", desc="embed", disable=args.no_progress or None, file=sys.stderr)
    jsonl = sys.stdout if to_stdout else open(args.out, "w", encoding="utf-8") if args.out.endswith(".jsonl") else None
    mon = GpuMonitor((emb.device.index or 0) if emb.device.type == "cuda" else None)
    try:
        mon.__enter__()
        for block in emb.embed_stream(_read_texts(args.file, not_utf8, bad)):
            respond.begin()
            failed = [k for k in range(len(block.vectors)) if n + k in bad]
            if failed:  # (a bad line's row: NaN in the .npy, its error in the JSON lines)
                block.vectors[failed] = np.nan
            if jsonl is not None:
                for k in range(len(block.vectors)):
                    if n + k in bad:
                        jsonl.write(json.dumps({"index": n + k, "error": bad[n + k]}) + "\n")
                        continue
                    jsonl.write(
                        json.dumps(
                            {
                                "index": n + k,
                                "truncated": bool(block.truncated[k]),
                                "embedding": [round(float(v), 7) for v in block.vectors[k]],
                            }
                        )
                        + "\n"
                    )
                jsonl.flush()  # (a stream's lines, as they come: a file is read as it grows too)
            else:
                vectors.append(block.vectors)
            n += len(block.vectors)
            n_trunc += int(block.truncated.sum())
            respond.end(len(block.vectors))
            bar.update(len(block.vectors))
    except BrokenPipeError:  # (stdout's reader went away: the caller stops quietly)
        raise
    except KeyboardInterrupt:  # (Ctrl-C, SIGTERM: a .npy keeps the vectors of the texts embedded so far)
        if jsonl is None:  # (none yet: an empty one, not a file of another run left as it was)
            bar.close()
            np.save(args.out, np.concatenate(vectors) if vectors else np.zeros((0, emb.dim), np.float32))
            print(f"wrote {args.out}: the vectors of the first {n} texts", file=sys.stderr)
        raise
    except InputError as e:
        print(f"fullthrottle: error: {e}", file=sys.stderr)
        if jsonl is not None and not to_stdout and n == 0:  # (no empty file left: nothing was read)
            jsonl.close()
            os.unlink(args.out)
        return 2
    except OSError as e:
        print(
            f"fullthrottle: error: cannot write {'stdout' if to_stdout else args.out}: {e.strerror or e}",
            file=sys.stderr,
        )
        return 2
    finally:
        mon.__exit__(None, None, None)
        bar.close()
        if jsonl is not None and not to_stdout:
            jsonl.close()
    if jsonl is None:
        try:
            np.save(args.out, np.concatenate(vectors) if vectors else np.zeros((0, emb.dim), np.float32))
        except OSError as e:
            print(f"fullthrottle: error: cannot write {args.out}: {e.strerror or e}", file=sys.stderr)
            return 2
    dt = time.perf_counter() - t0
    rep = Report(
        items=n,
        ok=n - len(bad),
        failed=len(bad),
        wall_s=dt,
        stages=[st.snapshot(dt) for st in (*emb.stats.values(), respond)],
        batches=emb.batches,
        mean_batch_size=n / emb.batches if emb.batches else 0.0,
        device=str(emb.device),
        model=os.path.basename(os.path.normpath(args.model_dir)) if args.model_dir else "all-MiniLM-L6-v2",
        dtype=str(emb.dtype).removeprefix("torch."),
        graphs=f"CUDA graphs: {len(emb.runners)} sequence buckets captured" if emb.runners else "",
        gpu_util_pct=mon.mean_util_pct,
        gpu_mem_max_bytes=mon.max_mem_bytes,
        unit="text",
    )
    not_utf8 = [no for no in not_utf8 if no - 1 not in bad]  # (a line that failed was not embedded)
    if not_utf8:
        lines = ", ".join(map(str, not_utf8[:10])) + (f" and {len(not_utf8) - 10} more" if len(not_utf8) > 10 else "")
        rep.notes.append(
            f"{len(not_utf8)} line{'s' * (len(not_utf8) > 1)} not valid UTF-8 (line {lines}): embedded "
            "with each invalid byte read as U+FFFD"
        )
    for i in sorted(bad)[:10]:
        print(f"error: {args.file}: {bad[i]}", file=sys.stderr)
    if bad:
        where = "a row of NaN in the .npy" if jsonl is None else 'an "error" field in its JSON line'
        more = f" ({len(bad) - 10} more not shown)" if len(bad) > 10 else ""
        rep.notes.append(f"{len(bad)} line{'s' * (len(bad) > 1)} not read as a text{more}: each has {where}")
    if n_trunc:
        rep.notes.append(f"{n_trunc} text{'s' * (n_trunc > 1)} truncated to {emb.max_seq_length} tokens")
    if n == 0:  # (a plain-text line is a text even when blank: only an empty input gives none)
        rep.notes.append(f"{'stdin' if args.file == '-' else args.file} is empty: no text to embed (one text a line)")
    print(rep.format(), file=sys.stderr)
    if not write_report_json(rep, args.report_json):
        return 2
    if not to_stdout:
        print(f"wrote {args.out}", file=sys.stderr)
    return 1 if bad else 0
