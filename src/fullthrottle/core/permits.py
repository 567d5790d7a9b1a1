"""A counting semaphore that a Ctrl-C cannot leave locked."""

from __future__ import annotations

import queue


class Permits:
    """A counting semaphore (the in-flight window) whose every step is one C call: permits are items
    of a ``queue.SimpleQueue``. Its consumer, the caller's (main) thread, gives permits back, and a
    Ctrl-C raises KeyboardInterrupt there at whichever bytecode it is at: inside
    ``threading.Semaphore.release``'s Python-level Condition that can leave its lock held (the same
    thread's next release, in ``hand_out``'s ``finally``, then hangs for good, and the load stage's
    next acquire too). Here each permit is given back or not (one lost in a stop matters to no one)."""

    def __init__(self, n: int):
        self._q: queue.SimpleQueue = queue.SimpleQueue()
        self.release(n)

    def acquire(self, blocking: bool = True, timeout: float | None = None) -> bool:
        try:
            self._q.get(blocking, timeout)
            return True
        except queue.Empty:
            return False

    def release(self, n: int = 1) -> None:
        put = self._q.put
        for _ in range(n):
            put(None)
