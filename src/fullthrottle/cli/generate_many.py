"""``fullthrottle generate --prompts FILE``: many prompts at once through the continuous-batching
:class:`~fullthrottle.workloads.llm.scheduler.Scheduler` (the server's engine, offline).

FILE (or ``-``, stdin) holds one request per line: plain text (the prompt), or (a line that starts
with ``{``) a JSON object with the fields of the server's ``POST /v1/completions`` (``prompt``: text
or token ids, ``max_tokens``, ``temperature``, ``top_p``, ``top_k``, ``seed``, ``stop``); fields a
line leaves out take the command's flags (as do fields given as null). Output: one JSON line per
request, in input order (each written as soon as it and those before it are done): ``{"index",
"line", "text", "token_ids", "finish_reason", "prompt_tokens"}``, or ``{"index", "line", "error"}``
for a line that is not a valid request (the others still run; exit status 1). ``index`` counts the
requests from 0, ``line`` is the request's line in FILE from 1 (blank lines hold no request).
"""

from __future__ import annotations

import json
import re
import sys
from types import SimpleNamespace

from ..core.json_body import parse_body
from .common import numbered_lines, own_stdin, stdin_bytes


def read_requests(path: str, args, eos=None) -> list[tuple[int, dict | str]]:
    """The requests of FILE: each non-blank line's number (from 1) and its body (a dict), or the
    error of a line that is not one (``eos``: the model's end-of-sequence id(s); None: a request does
    not stop at the model's own)."""
    if path == "-":
        return list(requests(numbered_lines(stdin_bytes()), args, eos))
    with open(path, "rb") as f:
        return list(requests(numbered_lines(f), args, eos))


def requests(lines, args, eos=None):
    """:func:`read_requests` of ``(number, bytes)`` lines, each request yielded as its line is read."""
    defaults = {
        "max_tokens": args.max_new_tokens,
        "temperature": args.temperature,
        "top_k": args.top_k,
        "top_p": args.top_p,
        **({} if eos is not None else {"ignore_eos": True}),  # (random weights: no end-of-sequence token)
    }
    index = 0  # (requests so far, errors included: the seed of each is --seed + its index)
    for n, raw in lines:
        r = _request(n, raw)
        if r is None:
            continue
        if isinstance(r, dict):
            given = {k: v for k, v in r.items() if v is not None}  # (null: left out, as OpenAI's API reads it)
            r = {**defaults, **({"seed": args.seed + index} if args.seed is not None else {}), **given}
        index += 1
        yield n, r


def _request(n: int, raw: bytes) -> dict | str | None:
    """Line ``n``'s request body as written, its error, or None for a blank line."""
    try:
        line = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        return f"line {n}: not valid UTF-8 (byte 0x{raw[e.start]:02x} at byte {e.start + 1})"
    if not line.strip():
        return None
    if line.lstrip().startswith("{"):
        try:
            body = parse_body(line)  # (as every route reads a body: no NaN, Infinity or 1e999)
        except ValueError as e:
            why = str(e).removeprefix("malformed JSON body: ")
            if not _json_like(line):  # (text, perhaps: a prompt may begin with a brace)
                why += (
                    "; a line that starts with '{' is read as a JSON request: give such a prompt as {\"prompt\": ...}"
                )
            return f"line {n}: not valid JSON: {why}"
    else:  # (text; a JSON list is the prompt's token ids, as in a JSON request)
        prompt = _token_ids(line)
        if prompt is None:
            return f"line {n}: not valid JSON: a line of token ids is a JSON list of integers, as [1, 2, 3]"
        body = {"prompt": prompt}
    if not isinstance(body, dict):
        return f"line {n}: a JSON object or a line of text expected"
    return body


_ID_LIST = re.compile(r"\[[\s\d,+-]*\]?")  # (what a broken list of token ids looks like: "[1, 2", "[1,,2]")


def _token_ids(line: str) -> str | list | None:
    """``line`` as a prompt: the JSON list it is (``[1, 2, 3]``: token ids, checked as a request's
    ``prompt`` is), its text where it is no JSON (``[INST] hi`` included), or None where it looks like
    a list of token ids and is not valid JSON (``[1, 2``)."""
    if line.lstrip().startswith("["):
        try:
            ids = json.loads(line)
        except RecursionError:
            return line
        except ValueError:
            return None if _ID_LIST.fullmatch(line.strip()) else line
        if isinstance(ids, list):
            return ids
    return line


def _json_like(line: str) -> bool:
    """Whether ``line`` parses as JSON at all (NaN and huge numbers allowed, which requests refuse)."""
    try:
        json.loads(line)
    except RecursionError:  # (JSON, nested too deep to read)
        return True
    except ValueError:
        return False
    return True


def generate_many(args, model, tok, eos) -> tuple[int, object, int]:
    """Run every request of ``args.prompts``; writes the JSON lines to ``args.out`` (or stdout).
    Returns (new tokens, the Generator, requests that failed).

    ``-`` on a pipe or a terminal (one that may stay open) is read as it comes: each request joins
    the running ones once its line is read, and is answered once it and those before it are done;
    the KV cache is then made for ``--max-seq-len``, or the model's context (at most 4,096), since the
    longest request is not known in advance. A FILE, or stdin redirected from one, is read whole
    first, and the cache made as long as its longest request needs.

    Raises:
        ValueError: FILE cannot be read or holds no request.
    """
    from tqdm import tqdm

    from ..workloads.llm.api import completion_request
    from ..workloads.llm.checks import serving_context
    from ..workloads.llm.generate import Generator
    from ..workloads.llm.sampling import check_sampling
    from ..workloads.llm.scheduler import Scheduler
    from ..workloads.llm.text import TextStream

    stream = args.prompts == "-" and _stdin_streams()
    ahead = None
    try:
        if stream:
            from ..core.read_ahead import ReadAhead

            ahead = ReadAhead(requests(numbered_lines(own_stdin()), args, eos), args.max_batch)
            reqs = []
        else:
            reqs = read_requests(args.prompts, args, eos)
    except OSError as e:
        raise ValueError(f"cannot read {args.prompts}: {e.strerror or e}") from None
    if not reqs and not stream:
        raise ValueError(f"{args.prompts} holds no request")
    # each request checked and tokenized once, against the longest cache the run may have; the
    # cache is then made as long as the longest request needs
    limit = args.max_seq_len or (serving_context(model.cfg) if stream else model.cfg.max_position_embeddings)
    checks = SimpleNamespace(model=model, max_seq_len=limit, check_sampling=check_sampling, logprobs=0, kv=None)

    def parse(n: int, r) -> dict | str:  # (a request checked and tokenized, or its line's error)
        if isinstance(r, str):
            return r
        try:
            return completion_request(r, checks, tok)
        except ValueError as e:
            return f"line {n}: {e}"

    parsed = [parse(n, r) for n, r in reqs]
    need = max((len(c["ids"]) + c["max_tokens"] for c in parsed if isinstance(c, dict)), default=1)
    to_stdout = args.out in (None, "-")

    def open_out(mode: str):
        try:
            return open(args.out, mode, encoding="utf-8")
        except OSError as e:
            raise ValueError(f"cannot write --out {args.out}: {e.strerror or e}") from None

    if not to_stdout:  # writable? (appended to, not emptied: a file already there outlives a setup error below)
        open_out("a").close()
    pages = args.kv_pages
    if pages == "auto":
        from ..workloads.llm.checks import pages_that_fit
        from ..workloads.llm.kv_pages import PAGE

        pages = pages_that_fit(model, PAGE, args.kv_dtype)
    seq = limit if stream else args.max_seq_len or need
    gen = Generator(model, args.max_batch, seq, graphs=args.graphs, kv_pages=pages, kv_dtype=args.kv_dtype)
    sched = Scheduler(gen, eos_id=eos, ahead=gen.check_every)  # (offline: up to check_every steps a read)
    # (a stream's --out is emptied once its first request comes: an empty pipe leaves a file as it was)
    out = sys.stdout if to_stdout else None if stream else open_out("w")
    recs: list = []  # per request: (its checked request, its Sequence), or (None, its error)

    def admit(n: int, c) -> None:
        if not isinstance(c, dict):  # (its error already)
            recs.append((None, c))
            return
        try:  # (paged KV memory: a request longer than the whole pool is refused here, alone)
            s = sched.submit(
                c["ids"], c["max_tokens"], c["temperature"], c["top_k"], c["top_p"], c["seed"], stop_ids=c["stop_ids"]
            )
            recs.append((c, s))
        except ValueError as e:
            recs.append((None, f"line {n}: {e}"))

    for (n, _), c in zip(reqs, parsed):
        admit(n, c)
    failed = sum(c is None for c, _ in recs)
    bar = tqdm(
        total=None if stream else len(recs) - failed,
        unit="request",
        desc="generate",
        file=sys.stderr,
        disable=args.no_progress or None,
    )
    new, written, errors = 0, 0, 0

    def write_done() -> None:  # the requests done so far, in input order (kept if the run is stopped)
        nonlocal new, written, errors, out
        if out is None:
            if not recs:
                return
            out = open_out("w")
        while written < len(recs) and (recs[written][0] is None or recs[written][1].done):
            c, s = recs[written]
            where = {"index": written, "line": reqs[written][0]}
            recs[written] = reqs[written] = (None, None)  # (written: a stream's memory does not grow with it)
            if c is None:
                errors += 1
                out.write(json.dumps({**where, "error": s}) + "\n")
            else:
                toks, text, reason = s.tokens, None, "stop" if s.tokens[-1:] and s.tokens[-1] in s.stop else "length"
                if tok is not None:
                    ts = TextStream(tok, c["stop"])
                    text = ts.push(toks) + ts.flush()
                    if ts.stopped:
                        toks, reason = toks[: ts.used], "stop"
                new += len(toks)
                line = {**where, "text": text, "token_ids": toks, "finish_reason": reason}
                out.write(json.dumps({**line, "prompt_tokens": len(c["ids"])}) + "\n")
            written += 1
        out.flush()

    def come() -> bool:  # (streaming) admit the requests read so far, waiting for one when idle; False at the end
        got, error, ended = ahead.ready() if sched.busy else ahead.take()
        if error is not None:
            raise ValueError(f"cannot read {args.prompts}: {getattr(error, 'strerror', None) or error}")
        for n, r in got:
            reqs.append((n, r))
            admit(n, parse(n, r))
        return not ended

    try:
        try:
            write_done()
            more = stream
            while more or sched.busy:
                if more:
                    more = come()
                if sched.busy:
                    bar.update(len(sched.step()))
                write_done()
        finally:
            bar.close()
            if ahead is not None:
                ahead.close()
            if out is not None and out is not sys.stdout:
                out.close()
    except OSError as e:  # (a full disk, say; stdout's own failures are the CLI's to word)
        if out is sys.stdout:
            raise
        raise ValueError(f"cannot write --out {args.out}: {e.strerror or e}") from None
    if not recs:
        raise ValueError(f"{args.prompts} holds no request")
    return new, gen, errors


def _stdin_streams() -> bool:
    """Whether stdin may stay open (a pipe, a terminal, a socket), not a file redirected to it."""
    import os
    import stat

    try:
        return not stat.S_ISREG(os.fstat(stdin_bytes().fileno()).st_mode)
    except (OSError, AttributeError, ValueError):
        return False
