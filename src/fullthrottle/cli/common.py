"""What the commands share: the sample photos, the GPU-decode options as Config fields, quiet exits."""

from __future__ import annotations

import contextlib
import errno
import importlib.util
import os
import stat
import sys

from ..core.config import Config

SAMPLE_PHOTOS = ("chelsea.png", "coffee.png", "astronaut.png", "rocket.jpg", "motorcycle_left.png")


@contextlib.contextmanager
def held_signals():
    """SIGINT and SIGTERM held back in this thread for the block (the imports of torch, torchvision and
    OpenCV): a signal that lands inside a native library's start-up code can abort the process (C++
    terminate: exit -6) instead of raising KeyboardInterrupt (or, for SIGTERM, :class:`Terminated`
    where :func:`sigterm_as_interrupt` is on). It is delivered when the block ends, to the handler
    then in place (where the platform has no ``pthread_sigmask``, nothing is held)."""
    import signal

    try:
        old = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT, signal.SIGTERM})
    except (AttributeError, OSError, ValueError):
        old = None
    try:
        yield
    finally:
        if old is not None:
            signal.pthread_sigmask(signal.SIG_SETMASK, old)


class Terminated(KeyboardInterrupt):
    """SIGTERM, raised where a Ctrl-C would be: the command stops as it does for one (exit 143)."""


def stopped(e: KeyboardInterrupt, lead: str = "") -> int:
    """Say on stderr why the command stopped ("terminated" on SIGTERM: :class:`Terminated`, else
    "interrupted"), after ``lead``; returns its exit status (143 or 130)."""
    term = isinstance(e, Terminated)
    print(lead + ("terminated" if term else "interrupted"), file=sys.stderr)
    return 143 if term else 130


def say_stopping(e: KeyboardInterrupt) -> None:
    """Say on stderr that the command is stopping, and why ("terminated" on SIGTERM, else "interrupted")."""
    print("terminated: stopping" if isinstance(e, Terminated) else "interrupted: stopping", file=sys.stderr)


@contextlib.contextmanager
def sigterm_as_interrupt():
    """SIGTERM raises :class:`Terminated` in the main thread for the block (elsewhere: nothing
    changes), so that a command stops its stages and child processes and says so, as on Ctrl-C,
    instead of dying at once with its decoder processes left to notice."""
    import signal
    import threading

    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def on_term(signum, frame):
        raise Terminated()

    old = signal.signal(signal.SIGTERM, on_term)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, old)


def freeze_startup_objects() -> None:
    """Exempt every object alive now (the model, its graphs, the imported libraries: a few hundred
    thousand) from the garbage collector's full passes (``gc.collect()`` then ``gc.freeze()``). Each
    full pass would otherwise traverse them all, about 0.1 s holding the GIL that every stage of
    the pipeline shares, a few times a second while results flow (their objects are promoted
    quickly). For a command's own process, once its start-up is done: frozen objects are never freed."""
    import gc

    gc.collect()
    gc.freeze()


def sample_photos() -> list[str]:
    """Paths of a few real photos that ship with scikit-image (no download).

    Raises:
        FileNotFoundError: scikit-image is not installed.
    """
    spec = importlib.util.find_spec("skimage")
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            "no inputs given and scikit-image (whose sample photos are the "
            "default inputs) is not installed: pass image paths or URLs"
        )
    data = os.path.join(list(spec.submodule_search_locations)[0], "data")
    return [os.path.join(data, name) for name in SAMPLE_PHOTOS if os.path.exists(os.path.join(data, name))]


def _input_limits(args) -> dict:
    """``Config`` fields of the input limits' flags (``--max-image-megapixels``: see ``options.megapixels``)."""
    return {"max_image_pixels": max(1, round(args.max_image_megapixels * 1e6))}


def _gpu_decode_settings(args) -> dict:
    """``Config`` fields of the GPU-decode options; a note on stderr when --gpu-decoder or
    --gpu-decode-processes is given with --no-gpu-decode (they would do nothing)."""
    given = [
        f
        for f, v in (("--gpu-decoder", args.gpu_decoder), ("--gpu-decode-processes", args.gpu_decode_processes))
        if v is not None
    ]
    on = Config.gpu_decode if args.gpu_decode is None else args.gpu_decode
    if given and not on:
        print(
            f"note: {' and '.join(given)} {'has' if len(given) == 1 else 'have'} no effect with --no-gpu-decode",
            file=sys.stderr,
        )
        return {"gpu_decode": False}  # (ignored: not checked either, as the note says)
    n = args.gpu_decode_processes
    if n is not None and not 0 <= n <= 16:
        raise ValueError(f"--gpu-decode-processes must be in 0..16, got {n}")
    return {
        "gpu_decode": on,
        "gpu_decoder": args.gpu_decoder if args.gpu_decoder is not None else Config.gpu_decoder,
        "gpu_decode_processes": args.gpu_decode_processes,
    }  # (None: the Pipeline picks, by MPS)


class StdoutUnwritable(OSError):
    """stdout cannot take a command's output: it is closed (``1>&-``) or a write failed (disk full).
    A reader gone away (``| head``) stays :class:`BrokenPipeError`."""


class Stdout:
    """What ``sys.stdout`` is while a command runs (``with_stdout``): the same stream, whose failed
    writes raise :class:`StdoutUnwritable`, and a closed stdout (``sys.stdout`` None) one that refuses
    every write, so that every command answers both with one error line and exit 2."""

    def __init__(self, stream):
        self.stream = stream

    def _call(self, name: str, *a):
        if self.stream is None:
            if name == "flush":
                return None
            raise StdoutUnwritable(9, "stdout is closed")  # (EBADF)
        try:
            return getattr(self.stream, name)(*a)
        except BrokenPipeError:
            raise
        except OSError as e:
            raise StdoutUnwritable(e.errno, e.strerror or str(e)) from None

    def write(self, text: str):
        return self._call("write", text)

    def flush(self):
        return self._call("flush")

    def isatty(self) -> bool:
        return self.stream is not None and self.stream.isatty()

    def __getattr__(self, name: str):  # fileno, encoding, ...
        if self.stream is None:
            raise AttributeError(name)
        return getattr(self.stream, name)


def with_stdout(command, args) -> int:
    """``command(args)`` with ``sys.stdout`` a :class:`Stdout` (put back after): output that cannot be
    written to stdout ends the command with one error line and exit 2."""
    saved = sys.stdout
    sys.stdout = Stdout(saved)
    try:
        return command(args)
    except StdoutUnwritable as e:
        print(f"fullthrottle: error: cannot write stdout: {e.strerror}", file=sys.stderr)
        sys.stdout = saved
        _silence_stdout()  # (what the stream still holds goes nowhere at exit, quietly)
        return 2
    finally:
        sys.stdout = saved


def _silence_stdout(stdout=None) -> None:
    """After a broken pipe: point stdout (``stdout``: the file that was stdout, where ``sys.stdout``
    is redirected) at /dev/null, so the interpreter's final flush stays quiet."""
    try:
        os.dup2(os.open(os.devnull, os.O_WRONLY), (stdout or sys.stdout).fileno())
    except (OSError, ValueError, AttributeError):
        pass


def open_out(path: str):
    """The results file ``path`` opened for writing without emptying it yet (append mode): a run that
    stops at a configuration error leaves an existing file as it was. :func:`begin_out` empties it
    once the run starts. Raises OSError (a missing folder, no permission, a directory)."""
    return open(path, "a", encoding="utf-8")


def begin_out(out) -> None:
    """The run has started: the results file of :func:`open_out` (a regular file) is emptied, so that
    its lines replace what it held (a pipe, a device or stdout is left as it is)."""
    if out is not None and out is not sys.stdout and os.path.isfile(out.name):
        out.truncate(0)


def _close_out(out) -> str | None:
    """Close the results file (not stdout); the reason if its last writes failed (disk full), else None."""
    if out is None or out is sys.stdout:
        return None
    try:
        out.close()
    except OSError as e:
        return e.strerror or str(e)
    return None


def stdin_bytes():
    """This process's stdin as a binary file (what an input ``-`` reads).

    Raises:
        OSError: stdin is closed (the process started with it closed, as ``<&-`` does).
    """
    if sys.stdin is None:
        raise OSError(errno.EBADF, "stdin is closed")
    return sys.stdin.buffer


def own_stdin():
    """stdin as a binary file of its own (a duplicate of its descriptor), for a thread that may stay
    blocked reading it when the command ends (Ctrl-C at a terminal or an open pipe): one blocked in
    ``sys.stdin.buffer`` holds its lock, and the interpreter aborts at exit trying to take it.
    :func:`stdin_bytes` itself where stdin has no descriptor (a test's stand-in).

    Raises:
        OSError: stdin is closed.
    """
    import io

    f = stdin_bytes()
    try:
        return os.fdopen(os.dup(f.fileno()), "rb")
    except (AttributeError, ValueError, io.UnsupportedOperation):
        return f


def numbered_lines(f):
    """``(number from 1, bytes)`` per line of the binary file ``f``, without its ``\n`` or ``\r\n``
    (lines end at ``\n`` only: a lone ``\r``, a form feed or U+2028 inside a line is part of it); a
    UTF-8 byte-order mark opening the file, as Windows editors write, is dropped. What every command
    that reads a request or a text per line reads its lines with."""
    for no, raw in enumerate(f, 1):
        if no == 1 and raw.startswith(b"\xef\xbb\xbf"):
            raw = raw[3:]
        raw = raw[:-1] if raw.endswith(b"\n") else raw
        yield no, raw[:-1] if raw.endswith(b"\r") else raw


def overwrites_an_input(outputs: dict, inputs: dict) -> str | None:
    """The error for an output file that is also an input or another output (by the file itself:
    links and other spellings count; a file not there yet by its real path), or None. ``outputs``
    and ``inputs`` map a flag's name (as the error names it) to its path; an input ``"-"`` is the
    file behind stdin, if it is one; None and an output ``"-"`` (stdout) are skipped."""
    seen = {}
    for name, path in [*inputs.items(), *outputs.items()]:
        if path == "-" and name in inputs:  # stdin: the file behind it, if it is one (< FILE)
            try:
                st = os.fstat(sys.stdin.fileno())
            except (OSError, ValueError, AttributeError):  # (closed, or replaced by a test)
                continue
            if stat.S_ISREG(st.st_mode):
                seen.setdefault((st.st_dev, st.st_ino), f"{name} (stdin)")
            continue
        if path in (None, "", "-"):
            continue
        try:
            st = os.stat(path)
            key = (st.st_dev, st.st_ino)
        except OSError:  # (not there yet: two outputs to one new file are still one file)
            key = os.path.realpath(path)
        if key in seen and name in outputs:
            return f"{name} {path} is the same file as {seen[key]}: writing it would destroy it"
        seen.setdefault(key, name)
    return None


def cannot_write(path: str) -> str | None:
    """Why the file ``path`` cannot be written, found out by opening it to append (and removing it
    again if it was not there), or None: before a run rather than after it. A path that is not a
    regular file (a pipe, a device) is not tried: opening a pipe would wait for its reader."""
    import stat

    if os.path.isdir(path):
        return "Is a directory"
    existed = os.path.lexists(path)  # (a link is kept, dangling or not)
    try:
        if existed and not stat.S_ISREG(os.stat(path).st_mode):
            return None
    except OSError:  # (a dangling link: tried below)
        pass
    try:
        with open(path, "a", encoding="utf-8"):
            pass
    except OSError as e:
        return e.strerror or str(e)
    if not existed:
        os.remove(path)
    return None


def write_report_json(rep, path: str | None) -> bool:
    """Write a run's :class:`~fullthrottle.core.report.Report` as JSON to ``path`` (None: nothing;
    ``"-"``: stdout); False (the reason printed) when it cannot be written.

    Raises:
        BrokenPipeError: ``"-"``, and stdout's reader went away (the caller's exit status says so).
    """
    import json

    if path is None or path == "":
        return True
    try:
        if path == "-":
            sys.stdout.write(json.dumps(rep.to_dict(), indent=2) + "\n")
            sys.stdout.flush()
        else:
            with open(path, "w", encoding="utf-8") as f:
                json.dump(rep.to_dict(), f, indent=2)
    except OSError as e:
        if path == "-" and isinstance(e, BrokenPipeError):
            raise
        where = "stdout" if path == "-" else path
        print(f"fullthrottle: error: cannot write {where}: {e.strerror or e}", file=sys.stderr)
        return False
    return True


def _shown(s: str) -> str:
    """``s`` with control characters and undecodable bytes escaped (a file name with a newline stays on
    one line of the text output; a byte that is not UTF-8 shows as ``\\xNN``, as in the JSON lines)."""
    if s.isprintable():
        return s
    from ..workloads.classify.result import utf8_text

    return "".join(c if c.isprintable() else repr(c)[1:-1] for c in utf8_text(s))


def _format_result(r) -> str:
    if r.ok:
        return f"{_shown(r.id)}: " + ", ".join(f"{lab} {p:.3f}" for lab, p in zip(r.labels, r.probs))
    err = r.error.removeprefix(f"{r.id}: ")  # the error names its item already (for library users)
    return f"{_shown(r.id)}: ERROR {_shown(err)}"
