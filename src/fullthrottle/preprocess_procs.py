"""Stage 2 in worker processes: decode + resize + crop outside the main interpreter's GIL.

Why: OpenCV and torch release the GIL while they work, but every call into them takes it back, and
with 16 decode threads the main process's GIL is handed over thousands of times a second. The
compute thread (which must take the GIL for every launch and copy) then waits in that queue: measured
on the H200 machine, 16 threads decoding 640x480 JPEGs fed ResNet18 at 1.8-2.3k img/s while the
compute thread sat at 100% busy and the GPU at 9% (bench/results/e2e_cpu_decode_*.json). A
``DataLoader`` escapes the GIL with worker processes; so does this.

Each preprocess thread of the pipeline owns one worker process and talks to it over a socket pair:
it sends the encoded bytes, the worker runs :func:`fullthrottle.preprocess.preprocess` (the very
same code as the thread path, so results are bit-identical) and sends back the ``(S, S, 3)`` uint8
crop or the item's error. While the thread waits on the socket it holds no GIL, so per image the
main process does a few microseconds of Python instead of a dozen GIL round trips. Workers run at a
lower scheduling priority (``nice``) so that the main process's compute and copy threads win the
cores when all are busy.

A worker that dies (a decoder crash on a hostile file) costs only the item it was decoding: that item
gets an error, and a fresh worker replaces it. Workers are started with ``subprocess`` (``python
-c`` with :func:`_worker_main`), not ``multiprocessing``, so a user script without an
``if __name__ == "__main__"`` guard is never re-imported.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import threading
import time
import weakref
from multiprocessing import BufferTooShort
from multiprocessing.connection import Connection

import numpy as np

from .preprocess import ImageError

_OK, _IMAGE_ERROR, _OTHER_ERROR = 0, 1, 2
_WORKER_CMD = "import sys; from fullthrottle.preprocess_procs import _worker_main; _worker_main(sys.argv[1:])"


class WorkerDied(RuntimeError):
    """The decoder process exited while working on an item (that item's error)."""


class DecoderProcess:
    """One worker process running :func:`~fullthrottle.preprocess.preprocess`.

    Args:
        resize_size / crop_size / max_pixels: the transform (as in :class:`~fullthrottle.config.Config`).
        nice: added to the worker's scheduling niceness (0 leaves it as the parent's).

    Not thread-safe: one caller thread per process (the pipeline gives each preprocess thread its own).
    """

    def __init__(self, resize_size: int = 256, crop_size: int = 224, max_pixels: int = 89_478_485,
                 nice: int = 5):
        self.args = (resize_size, crop_size, max_pixels, nice)
        self.crop_bytes = crop_size * crop_size * 3
        self.crop_size = crop_size
        self.closed = False
        # held from send to reply: a thread that is still waiting when its run is stopped reads its own
        # reply before the next run's thread can send, so replies never go to the wrong item
        self._lock = threading.Lock()
        self._start()

    def _start(self) -> None:
        if self.closed:  # never start a worker after close(): it would outlive its pipeline
            raise WorkerDied("the decoder pool is closed")
        parent, child = socket.socketpair()
        env = dict(os.environ, OMP_NUM_THREADS="1", MKL_NUM_THREADS="1")
        self.proc = subprocess.Popen(
            [sys.executable, "-c", _WORKER_CMD, str(child.fileno()), *map(str, self.args)],
            pass_fds=(child.fileno(),), env=env, stdin=subprocess.DEVNULL, close_fds=True)
        child.close()
        self.conn = Connection(parent.detach())
        self._finalizer = weakref.finalize(self, _shutdown, self.conn, self.proc)

    def _restart(self) -> None:
        self._finalizer()
        self._start()

    def __call__(self, data: bytes) -> np.ndarray:
        """Encoded image bytes -> ``(S, S, 3)`` uint8 RGB crop (a fresh, writable array).

        Raises:
            ImageError: the item cannot be decoded (same message as the thread path).
            WorkerDied: the worker process died on this item; a new one has been started.
        """
        with self._lock:
            self.send(data)
            return self.receive()

    def send(self, data: bytes) -> None:
        """Hand one image to the worker (:meth:`receive` gets the answer; one request at a time).

        A worker found dead here (it died while idle) is replaced first, so the image is not lost;
        one that dies on this image is reported by :meth:`receive`.
        """
        if self.proc.poll() is not None:
            self._restart()
        try:
            self.conn.send_bytes(data)
        except OSError:
            pass  # the worker is gone: receive() reports it for this item and restarts it

    def receive(self) -> np.ndarray:
        """The answer to the last :meth:`send`: the crop, or the item's error raised (see :meth:`__call__`)."""
        buf = bytearray(1 + self.crop_bytes)
        try:
            n = self.conn.recv_bytes_into(buf)
        except BufferTooShort as e:  # an error message longer than a (small) crop
            buf, n = bytearray(e.args[0]), len(e.args[0])
        except (EOFError, OSError) as e:
            code = self.proc.poll()
            self._restart()
            raise WorkerDied(f"decoder process died on this item (exit code {code}): "
                             f"{type(e).__name__}") from None
        status = buf[0]
        if status == _OK:
            return np.frombuffer(buf, np.uint8, count=self.crop_bytes, offset=1).reshape(
                self.crop_size, self.crop_size, 3)
        # _IMAGE_ERROR or _OTHER_ERROR: the message is already worded as the thread path words it
        raise ImageError(bytes(buf[1:n]).decode("utf-8", "replace"))

    def kill(self, reason: str) -> WorkerDied:
        """Kill a worker stuck on its image and start a new one; returns the error for that image."""
        self.proc.kill()
        self._restart()
        return WorkerDied(reason)

    def discard_reply(self, timeout: float = 2.0) -> None:
        """Read and drop the answer to an outstanding request (a run stopped while it was out), so the
        next request gets its own answer; a worker that does not answer in ``timeout`` s is killed and
        replaced (nothing is started once the pool is closed)."""
        if not self.closed and self.conn.poll(timeout):
            try:
                self.receive()
                return
            except (ImageError, WorkerDied):
                return
        self.proc.kill()
        if not self.closed:
            self._restart()

    def close(self) -> None:
        """Stop the worker for good (closing its socket ends its loop; killed if it does not exit in 2 s)."""
        self.closed = True
        self._finalizer()


def _shutdown(conn: Connection, proc: subprocess.Popen) -> None:
    try:
        conn.close()
    except OSError:
        pass
    try:
        proc.wait(2.0)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


class DecoderPool:
    """``n`` :class:`DecoderProcess` workers started in parallel; ``pool[i]`` is thread ``i``'s worker.

    Raises:
        RuntimeError: a worker could not start (its import failed), with its exit code.
    """

    def __init__(self, n: int, resize_size: int = 256, crop_size: int = 224, max_pixels: int = 89_478_485):
        self.workers: list[DecoderProcess] = []
        errs: list[BaseException] = []

        def start():
            try:
                w = DecoderProcess(resize_size, crop_size, max_pixels)
                self.workers.append(w)
                try:
                    w(_PROBE)  # waits until the worker has imported and answered once
                except ImageError:
                    pass
            except BaseException as e:  # noqa: BLE001
                errs.append(e)

        ts = [threading.Thread(target=start, daemon=True) for _ in range(n)]
        for t in ts:
            t.start()
        for t in ts:
            t.join()
        if errs:
            self.close()
            raise RuntimeError(f"could not start decoder processes: {errs[0]}") from errs[0]

    def __len__(self) -> int:
        return len(self.workers)

    def __getitem__(self, i: int) -> DecoderProcess:
        return self.workers[i]

    def close(self, grace_s: float = 1.0) -> None:
        """Stop every worker: all sockets closed at once, then ``grace_s`` s in all to exit, then killed."""
        for w in self.workers:
            w.closed = True
            try:
                w.conn.close()
            except OSError:
                pass
        deadline = time.perf_counter() + grace_s
        for w in self.workers:
            try:
                w.proc.wait(max(0.0, deadline - time.perf_counter()))
            except subprocess.TimeoutExpired:
                w.proc.kill()
            w.close()  # reaps it
        self.workers = []


def _probe_png() -> bytes:
    import zlib

    raw = b"\x00\x00\x00\x00"  # one filter byte + one RGB pixel, 1x1
    chunk = lambda t, d: (len(d).to_bytes(4, "big") + t + d  # noqa: E731
                          + zlib.crc32(t + d).to_bytes(4, "big"))
    return (b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", (1).to_bytes(4, "big") * 2 + b"\x08\x02\x00\x00\x00")
            + chunk(b"IDAT", zlib.compress(raw)) + chunk(b"IEND", b""))


_PROBE = _probe_png()


def _worker_main(argv: list[str]) -> None:
    import signal

    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the parent's to handle; we end on EOF
    fd, resize_size, crop_size, max_pixels, nice = (int(a) for a in argv)
    if nice:
        try:
            os.nice(nice)
        except OSError:
            pass
    import torch

    torch.set_num_threads(1)
    from .preprocess import preprocess  # also sets OpenCV to one thread

    conn = Connection(fd)
    while True:
        try:
            data = conn.recv_bytes()
        except (EOFError, OSError):
            return
        try:
            arr = preprocess(data, resize_size, crop_size, max_pixels)
            out = bytearray(1 + arr.nbytes)
            out[0] = _OK
            out[1:] = arr.reshape(-1).data
        except ImageError as e:
            out = bytes([_IMAGE_ERROR]) + str(e).encode()[:60000]
        except Exception as e:  # noqa: BLE001 - a decoder error belongs to this item
            out = bytes([_OTHER_ERROR]) + f"cannot decode image: {type(e).__name__}: {e}".encode()[:60000]
        try:
            conn.send_bytes(out)
        except (EOFError, OSError):
            return

