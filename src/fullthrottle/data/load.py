"""Stage 1, load: turn inputs (files, directories, globs, URLs, bytes) into items with bytes, on asyncio.

Reading is I/O-bound, so one event loop (in its own thread) keeps up to ``load_concurrency`` reads
and HTTP requests in flight. Every item gets its index (input order) and id (path, URL or a name
for in-memory bytes) here and keeps them to the end; a failed read becomes that item's error.
"""

from __future__ import annotations

import asyncio
import os
import stat
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from ..core.gpumon import nvtx_range
from .sources import BadSource, expand

#: most items per list the loader hands on (one queue hand-off for up to this many images)
LOAD_CHUNK = 32


#: the error of an item the load stage's ``drop`` dropped
DROPPED = "dropped: its caller no longer waits for it"


@dataclass(slots=True)  # (no per-instance dict: made and read once per image, under the GIL)
class Item:
    """One input on its way through the stages.

    ``data`` holds the encoded bytes after load, ``array`` the ``(224, 224, 3)`` uint8 RGB crop after
    preprocess in threads (``pool_row`` its row in the shared crop pool after preprocess in decoder
    processes); ``error`` is set instead when a stage failed for this item.
    """

    index: int
    id: str
    source: Any = None
    data: bytes | None = None
    array: np.ndarray | None = None
    error: str | None = None
    gpu_crop: Any = None  # (rows, r): its crop is row r of a (m, S, S, 3) uint8 device tensor (GPU decoded)
    is_path: bool = False  # data holds the file's path (os.fsencode): a decoder process reads the file
    pool_row: int = -1  # the crop is in this row of the decoder processes' shared CropPool (no array)
    t_start: float = field(default_factory=time.perf_counter)
    t_queued: float = 0.0


def read_local(path: str, max_bytes: int) -> bytes:
    """The bytes of the local file ``path`` (an item's id), at most ``max_bytes`` of them.

    Used by the load stage and by the decoder processes that read files themselves.

    Raises:
        LoadError: the item's error, worded for it: not found, not a regular file, too large, or
            the system's reason (permission denied, too many levels of symbolic links, ...).
    """
    try:
        with nvtx_range("load"):
            return _read_file_inner(path, max_bytes)
    except LoadError:
        raise
    except OSError as e:
        raise LoadError(f"cannot read {shown_path(path)}: {e.strerror or e}") from None


def shown_path(path) -> str:
    """``path`` as an error names it: bytes of the name that are not UTF-8 as ``\\xNN`` (as the item's
    id shows them), and quoted where spaces at its ends or unprintable characters would leave the
    name unseen."""
    s = os.fspath(path)
    s = os.fsdecode(s) if isinstance(s, bytes) else s
    try:
        s.encode("utf-8")
    except UnicodeEncodeError:
        s = s.encode("utf-8", "surrogateescape" if _escapes_bytes(s) else "backslashreplace")
        s = s.decode("utf-8", "backslashreplace")
    if s != s.strip() or not s.isprintable():  # (as repr, but a \\xNN above stays one backslash)
        return "'" + "".join(c if c.isprintable() else repr(c)[1:-1] for c in s) + "'"
    return s


def _escapes_bytes(s: str) -> bool:
    """Whether every lone surrogate in ``s`` stands for a byte (``surrogateescape``: U+DC80-U+DCFF)."""
    return all(not 0xD800 <= ord(c) <= 0xDFFF or 0xDC80 <= ord(c) <= 0xDCFF for c in s)


def _read_file_inner(path: str | os.PathLike, max_bytes: int) -> bytes:
    # One open, one fstat, one read of the file's size (+1, to see a file that grew past the limit):
    # ``f.read(max_bytes + 1)`` would allocate ``max_bytes`` for every file (~10x the time of this).
    # O_NONBLOCK: a FIFO opens at once (and is refused below) instead of waiting for a writer.
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC | os.O_NONBLOCK)
    except FileNotFoundError:
        raise LoadError(f"file not found: {shown_path(path)}") from None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise LoadError(f"not a regular file: {shown_path(path)}")
        if st.st_size > max_bytes:
            raise LoadError(f"file too large: {st.st_size} bytes exceeds max_file_bytes={max_bytes}")
        parts, n = [], 0
        while n <= max_bytes:  # (one read but for a file that grows while it is read)
            b = os.read(fd, min(max(st.st_size - n, 0) + 1, max_bytes + 1 - n))
            if not b:
                break
            parts.append(b)
            n += len(b)
        if n > max_bytes:
            raise LoadError(f"file too large: more than max_file_bytes={max_bytes} bytes")
        return parts[0] if len(parts) == 1 else b"".join(parts)
    finally:
        os.close(fd)


class LoadError(IOError):
    """A read or download that failed for one item."""


async def _fetch(client, url: str, max_bytes: int) -> bytes:
    import httpx

    try:  # (a bad port or IPv6 address, IDNA, a NUL, no host: refused before any connection)
        parsed = httpx.URL(url)
        if not parsed.host:
            raise ValueError("it names no host")
        if parsed.port is not None and not 0 < parsed.port < 65536:  # (else an OverflowError deep in the connection)
            raise ValueError(f"port {parsed.port} is not in 1..65535")
    except (httpx.InvalidURL, UnicodeError, ValueError) as e:
        raise LoadError(f"invalid URL {url!r}: {e}") from None
    try:
        async with client.stream("GET", url) as r:
            if r.status_code != 200:
                raise LoadError(f"HTTP {r.status_code} {r.reason_phrase} for {url}")
            declared = r.headers.get("content-length")
            if declared is not None and declared.isdigit() and int(declared) > max_bytes:
                raise LoadError(f"download too large: {declared} bytes exceeds max_file_bytes={max_bytes}")
            buf = bytearray()
            async for chunk in r.aiter_bytes():
                buf += chunk
                if len(buf) > max_bytes:
                    raise LoadError(f"download too large: over max_file_bytes={max_bytes}")
            return bytes(buf)
    except httpx.TimeoutException:
        raise LoadError(f"timeout fetching {url}") from None
    except httpx.HTTPError as e:
        raise LoadError(f"cannot fetch {url}: {type(e).__name__}: {e}") from None
    except (httpx.InvalidURL, UnicodeError) as e:  # (what only building the request finds)
        raise LoadError(f"invalid URL {url!r}: {e}") from None


class Loader:
    """The load stage: an asyncio loop in its own thread feeding a bounded queue.

    Args:
        inputs: anything :func:`expand` accepts.
        out: the bounded queue to the preprocess stage: it receives lists of :class:`Item` (chunks of
            up to :data:`LOAD_CHUNK`, see :meth:`take`) and, at the end, ``n_end`` copies of ``end``.
        window: a semaphore with one permit per item allowed in flight (released by the consumer):
            ``acquire(blocking, timeout)`` as ``threading.Semaphore``'s
            (:class:`~fullthrottle.core.permits.Permits`).
        stop: set to abandon the stage.
        stats: the stage's :class:`~fullthrottle.core.report.StageStats`.
        defer_files: local files are not read here: each item carries its path (``is_path``) and the
            decoder process it goes to reads it (:func:`read_local`), so no file's bytes pass through
            this process. URLs are still fetched here.
        drop: ``drop(index) -> bool``, asked in :meth:`take` for each item not failed yet: an item it
            drops is not decoded, and ends with the error :data:`DROPPED` (a server's caller that left).
    """

    def __init__(
        self,
        inputs,
        out,
        put,
        window,
        stop: threading.Event,
        stats,
        concurrency: int,
        timeout_s: float,
        max_bytes: int,
        n_end: int,
        end,
        defer_files: bool = False,
        drop=None,
    ):
        self.inputs, self.out, self.put = inputs, out, put
        self.window, self.stop, self.stats = window, stop, stats
        self.concurrency, self.timeout_s, self.max_bytes = concurrency, timeout_s, max_bytes
        self.n_end, self.end = n_end, end
        self.defer_files, self.drop = defer_files, drop
        self.error: BaseException | None = None
        #: what the inputs iterable raised: the stream ends there, every item before it is answered
        self.source_error: BaseException | None = None
        #: True while this stage waits in the inputs iterable's ``next()`` (a generator waiting for
        #: requests): nothing here can end that wait, so a stop does not join this thread then
        self.in_source = False
        self.thread = threading.Thread(target=self._thread_main, name="ft-load", daemon=True)
        # the newest chunk handed to ``out``: items join it until a consumer takes it (take()), so an
        # item is never held back waiting for a chunk to fill, and a busy consumer gets many at once
        self._open: list | None = None
        self._open_lock = threading.Lock()

    def take(self, chunk: list) -> list:
        """A consumer got ``chunk`` from ``out``: close it (no item joins it after this) and return it.
        Every consumer of ``out`` calls this on each list it gets, before reading it."""
        with self._open_lock:
            if self._open is chunk:
                self._open = None
        if self.drop is not None:
            for it in chunk:
                if it.error is None and self.drop(it.index):
                    it.error, it.data = DROPPED, None
        return chunk

    def _chunk_for(self, item: Item) -> list | None:
        """Add ``item`` to the open chunk (None: done, it is in ``out`` already) or start a new
        chunk with it, which the caller puts in ``out``. One queue put per chunk instead of one per
        image: under load each put and get costs the GIL a few microseconds and a thread wake-up."""
        with self._open_lock:
            c = self._open
            if c is not None and len(c) < LOAD_CHUNK:
                c.append(item)
                return None
            c = self._open = [item]
            return c

    def start(self) -> None:
        self.thread.start()

    def _thread_main(self) -> None:
        try:
            asyncio.run(self._main())
        except BaseException as e:  # noqa: BLE001 - reported to the consumer
            if not self.stop.is_set():
                self.error = e
                self.stop.set()

    async def _acquire_window(self, idle: bool = False) -> bool:
        """Take one permit of the in-flight window. ``idle``: no load task is running, so this thread
        may block itself (no hop through a helper thread per item while the pipeline is full)."""
        if self.window.acquire(blocking=False):
            return True
        while not self.stop.is_set():
            if idle and self.window.acquire(True, 0.05):
                return True
            if not idle and await asyncio.to_thread(self.window.acquire, True, 0.05):
                return True
        return False

    async def _emit(self, item, idle: bool = False) -> None:
        item.t_queued = time.perf_counter()
        chunk = self._chunk_for(item)
        if chunk is not None and not self.put(self.out, chunk, block=False):
            await self._put_waiting(chunk, idle)

    async def _put_waiting(self, chunk: list, idle: bool) -> None:
        if idle:  # nothing else for the event loop to do: wait here
            self.put(self.out, chunk)
        else:
            await asyncio.to_thread(self.put, self.out, chunk)

    async def _load_one(self, client_box, item: Item, sem: asyncio.Semaphore) -> None:
        async with sem:
            self.stats.begin()
            try:
                src = item.source
                if isinstance(src, BadSource):
                    raise LoadError(str(src))
                if isinstance(src, (bytes, memoryview)):
                    item.data = src
                elif isinstance(src, str):
                    if client_box[0] is None:
                        import httpx

                        client_box[0] = httpx.AsyncClient(
                            timeout=self.timeout_s,
                            follow_redirects=True,
                            limits=httpx.Limits(max_connections=self.concurrency),
                        )
                    try:  # the whole request, not each read: a dripping server cannot hold an item
                        item.data = await asyncio.wait_for(_fetch(client_box[0], src, self.max_bytes), self.timeout_s)
                    except TimeoutError:
                        raise LoadError(f"timeout after {self.timeout_s:g} s fetching {src}") from None
                else:
                    item.data = await asyncio.to_thread(read_local, item.id, self.max_bytes)
            except LoadError as e:
                item.error = str(e)
            except OSError as e:
                item.error = f"cannot read {shown_path(item.id)}: {e.strerror or e}"
            except Exception as e:  # noqa: BLE001 - whatever else an input raises is its own error: never lost
                item.error = f"cannot load {item.id}: {type(e).__name__}: {e}"
            finally:
                item.source = None
                self.stats.end(1)
        await self._emit(item)

    async def _main(self) -> None:
        sem = asyncio.Semaphore(self.concurrency)
        client_box: list = [None]
        tasks: set[asyncio.Task] = set()
        in_memory = 0  # bytes items passed on and not yet counted in the stage's stats
        source = enumerate(expand(self.inputs))
        # a list or tuple is walked here, and nothing of the caller's can block next() on it; another
        # iterable may (a generator waiting for requests): while loads are in flight its next item is
        # awaited in a helper thread, so the event loop keeps running them meanwhile
        may_block = not isinstance(self.inputs, (list, tuple, str, bytes, os.PathLike))
        try:
            while True:
                self.in_source = True
                try:
                    nxt = await asyncio.to_thread(next, source, None) if tasks and may_block else next(source, None)
                except asyncio.CancelledError:
                    raise
                except BaseException as e:  # noqa: BLE001 - the caller's iterable (sys.exit() in a generator
                    self.source_error = e  # too): what came before it still counts
                    break
                finally:
                    self.in_source = False
                if nxt is None:
                    break
                index, (item_id, src) = nxt
                deferred = self.defer_files and isinstance(src, Path)
                if deferred or isinstance(src, (bytes, memoryview)):  # nothing to wait for: no task, no hop
                    # (the common case is taken without a coroutine call: this thread's per-image
                    # Python shares the GIL with every other stage)
                    if not self.window.acquire(blocking=False) and not await self._acquire_window(idle=not tasks):
                        return
                    item = (
                        Item(index=index, id=item_id, data=os.fsencode(item_id), is_path=True)
                        if deferred
                        else Item(index=index, id=item_id, data=src)
                    )
                    in_memory += 1
                    if in_memory >= 64:
                        self.stats.add(in_memory, 0.0)
                        in_memory = 0
                    item.t_queued = time.perf_counter()
                    chunk = self._chunk_for(item)
                    if chunk is not None and not self.put(self.out, chunk, block=False):
                        await self._put_waiting(chunk, not tasks)
                    continue
                if not await self._acquire_window(idle=not tasks):
                    return
                item = Item(index=index, id=item_id, source=src)
                t = asyncio.create_task(self._load_one(client_box, item, sem))
                tasks.add(t)
                t.add_done_callback(tasks.discard)
                if len(tasks) >= 2 * self.concurrency:
                    await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
                if self.stop.is_set():
                    return
            while tasks:
                await asyncio.wait(tasks, timeout=0.05)
                if self.stop.is_set():
                    return
            for _ in range(self.n_end):
                await asyncio.to_thread(self.put, self.out, self.end)
        finally:
            if in_memory:
                self.stats.add(in_memory, 0.0)
            for t in tasks:
                t.cancel()
            if client_box[0] is not None:
                await client_box[0].aclose()
