"""What the CPU and the GPU decoder processes share: how a worker process is started (its ``python -c``
line and process group), the grace a new one gets for its imports, the request flag for file paths,
the error of an item whose worker died, how a worker's end is read and brought about (and what it
wrote last), and the image a new CPU decoder process is first sent.

The parent side of each kind lives in :mod:`~fullthrottle.data.preprocess_procs` (CPU decoders) and
:mod:`~fullthrottle.data.gpu_decode_procs` (GPU decoders); the shared crop rows in :mod:`~fullthrottle.data.crop_pool`.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from multiprocessing.connection import Connection

#: seconds a freshly started worker is allowed for its imports before decode_timeout_s applies
STARTUP_S = 15.0
#: set in a request's row: what follows is a file's path (``os.fsencode``), which the worker reads itself
PATH_BIT = 1 << 31


#: worker processes start in a process group of their own (``Popen(process_group=0)``): a terminal's
#: Ctrl-C goes to the foreground group, so it reaches the parent only, also while a worker is still
#: starting (a SIGINT then, before its first line ran, killed it with a traceback)
WORKER_PROCESS_GROUP = 0


def worker_command(module: str, main: str) -> str:
    """The ``python -c`` line that runs ``fullthrottle.<module>.<main>(sys.argv[1:])`` in a worker
    process. Ctrl-C is the parent's to handle (the worker ends on EOF): a SIGINT sent to the worker
    itself is ignored from its first line, before the imports."""
    return (
        f"import signal, sys; signal.signal(signal.SIGINT, signal.SIG_IGN); "
        f"from fullthrottle.{module} import {main}; {main}(sys.argv[1:])"
    )


class WorkerDied(RuntimeError):
    """The decoder process exited while working on an item (that item's error)."""


def exit_reason(proc: subprocess.Popen) -> str:
    """How a worker that closed its socket ended: ``"exit code N"`` or ``"killed by signal SIGSEGV"``
    (its exit status follows the close at once; waits at most 1 s for it)."""
    try:
        code = proc.wait(1.0)
    except subprocess.TimeoutExpired:
        code = None
    if code is not None and code < 0:
        try:
            return f"killed by signal {signal.Signals(-code).name}"
        except ValueError:
            return f"killed by signal {-code}"
    return f"exit code {code}"


def shutdown_worker(conn: Connection, proc: subprocess.Popen, ready_fd: int = -1, err_fd: int = -1) -> None:
    """Close a worker's socket (and its readiness and stderr pipes, if any): its loop ends on EOF;
    killed if it has not exited 2 s later."""
    for close in (conn.close, *(lambda fd=fd: os.close(fd) if fd >= 0 else None for fd in (ready_fd, err_fd))):
        try:
            close()
        except OSError:
            pass
    try:
        proc.wait(2.0)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


def stop_workers(workers, grace_s: float) -> None:
    """Stop worker processes together: every socket closed first (each loop ends on EOF and the
    processes exit in parallel), then ``grace_s`` s in all for them to exit, then killed; each
    worker's own ``close()`` then reaps it. ``workers``: objects with ``conn``, ``proc``, ``closed``
    and ``close()``."""
    for w in workers:
        w.closed = True
        try:
            w.conn.close()
        except OSError:
            pass
    deadline = time.perf_counter() + grace_s
    for w in workers:
        try:
            w.proc.wait(max(0.0, deadline - time.perf_counter()))
        except subprocess.TimeoutExpired:
            w.proc.kill()
        w.close()


def last_words(fd: int, how: str) -> None:
    """What a decoder process that died (``how``: :func:`exit_reason`) wrote to its fd 2, the pipe
    whose read end is ``fd`` (non-blocking), and had not yet sent back: a crash's report
    (faulthandler's traceback, the C library's abort message), printed to this process's stderr."""
    got = b""
    try:
        while chunk := os.read(fd, 65536):
            got += chunk
    except OSError:  # (BlockingIOError: all read)
        pass
    text = got.decode("utf-8", "backslashreplace").strip()
    if text:
        print(f"fullthrottle: a decoder process died ({how}); its last output:\n{text}", file=sys.stderr)


def _probe_png() -> bytes:
    """A 1x1 RGB PNG: the image a new decoder process is first sent (its answer says it is up)."""
    import zlib

    raw = b"\x00\x00\x00\x00"  # one filter byte + one RGB pixel, 1x1

    def chunk(t, d):
        return len(d).to_bytes(4, "big") + t + d + zlib.crc32(t + d).to_bytes(4, "big")

    return (
        b"\x89PNG\r\n\x1a\n"
        + chunk(b"IHDR", (1).to_bytes(4, "big") * 2 + b"\x08\x02\x00\x00\x00")
        + chunk(b"IDAT", zlib.compress(raw))
        + chunk(b"IEND", b"")
    )


PROBE_PNG = _probe_png()
