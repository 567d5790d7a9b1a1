"""Items of an iterable read ahead by a thread of their own, taken in lists as they come.

What a stream of texts needs when it comes from a pipe or a terminal (``embed -``): a read that
blocks must neither hold back the texts already read (``tail -f log | fullthrottle embed -`` embeds
each line as it comes, not once a list is full) nor hold up a Ctrl-C (the reader is a daemon thread;
the one taking lists waits in steps of :data:`POLL_S` and gives up once :meth:`ReadAhead.close` is
called). Items pass through a deque: a list of ``size`` costs the taker one wake-up, not one per item.
"""

from __future__ import annotations

import collections
import threading
import time
from collections.abc import Iterable

#: seconds between a waiting taker's checks that it was closed, and a full reader's
POLL_S = 0.1


class _Flag:
    """A wake-up flag whose every step is one C call (a lock used as a binary semaphore: held while
    clear). The taker's thread is the one a Ctrl-C raises KeyboardInterrupt in, at whichever bytecode
    it is at: inside ``threading.Event``'s Python-level Condition that can leave its lock held (a later
    ``set()``, in :meth:`ReadAhead.close`, then hangs) or released twice ("RuntimeError: release
    unlocked lock" instead of the interrupt). Here either C call is done or not done."""

    def __init__(self):
        self._lock = threading.Lock()
        self._lock.acquire()

    def set(self) -> None:
        if self._lock.locked():
            try:
                self._lock.release()
            except RuntimeError:  # (set meanwhile, by another thread)
                pass

    def clear(self) -> None:
        self._lock.acquire(False)

    def wait(self, timeout: float) -> bool:
        """Wait until set (at most ``timeout`` s), and clear it; whether it was set."""
        return self._lock.acquire(True, max(timeout, 0))


class ReadAhead:
    """``items`` read by a daemon thread into a buffer of at most ``2 * size`` items.

    Args:
        items: any iterable; read in the reader thread only.
        size: the most items :meth:`take` returns at once.
        linger_s: how long :meth:`take` waits in all once it holds an item; a list is cut short
            there (a slow or stalled source: what came is taken now).
    """

    def __init__(self, items: Iterable, size: int, linger_s: float = 0.05):
        self.size, self.linger_s = size, linger_s
        self._items: collections.deque = collections.deque()
        self._ready, self._space = _Flag(), _Flag()
        self._stopped = False
        self._end: tuple | None = None  # ((what the iterable raised, or None),) once it ends
        self._thread = threading.Thread(target=self._read, args=(iter(items),), name="ft-read-ahead", daemon=True)
        self._thread.start()

    def _read(self, it) -> None:
        cap = 2 * self.size
        try:
            for x in it:
                self._items.append(x)
                self._ready.set()
                if len(self._items) >= cap:
                    self._space.clear()
                    while len(self._items) >= cap and not self._stopped:
                        self._space.wait(POLL_S)
                if self._stopped:
                    return
            self._end = (None,)
        except Exception as e:  # noqa: BLE001 - the taker raises it, after the items given before
            self._end = (e,)
        self._ready.set()

    def take(self) -> tuple[list, Exception | None, bool]:
        """``(items, error, ended)``: up to ``size`` items, waiting for the first (in steps, until
        :meth:`close`); ``ended`` once the iterable is done (``error``: what it raised, after its
        last items are taken). After :meth:`close`: ``([], None, False)``."""
        block: list = []
        until = None  # (once an item is held: when the list is cut short)
        while len(block) < self.size:
            if self._items:
                while self._items and len(block) < self.size:
                    block.append(self._items.popleft())
                self._space.set()
                continue
            if self._end is not None and not self._items:  # (set after its last item was appended)
                return block, self._end[0], True
            if self._stopped:
                break
            now = time.monotonic()
            if block and until is None:
                until = now + self.linger_s
            if until is not None and now >= until:
                break  # (a slow or stalled source: take what came)
            self._ready.clear()
            if self._items or self._end is not None:  # (came between the checks and the clear)
                continue
            self._ready.wait(POLL_S if until is None else until - now)
        return block, None, False

    def ready(self) -> tuple[list, Exception | None, bool]:
        """As :meth:`take`, without waiting: the items that have come, up to ``size`` (maybe none)."""
        block: list = []
        while self._items and len(block) < self.size:
            block.append(self._items.popleft())
        if block:
            self._space.set()
        if not block and self._end is not None and not self._items:
            return block, self._end[0], True
        return block, None, False

    def close(self) -> None:
        """Stop: a waiting :meth:`take` returns, the reader stops after its current item (a read
        that blocks keeps its daemon thread until it returns)."""
        self._stopped = True
        self._space.set()
        self._ready.set()

    def join(self, timeout: float | None = None) -> None:
        """After :meth:`close`: wait for the reader's thread to end (one inside native code when the
        interpreter exits can abort it), where its iterable cannot block (it is not a pipe's reader)."""
        self._thread.join(timeout)
