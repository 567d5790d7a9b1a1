"""A Ctrl-C at any point: the main thread gets KeyboardInterrupt at whichever bytecode it is at."""

from __future__ import annotations

import sys
import threading


def interrupt_at_c_call(n: int, *codes):
    """A ``sys.setprofile`` hook that raises KeyboardInterrupt just after the ``n``-th C call (a lock's
    acquire or release, a clock read...) made inside any of ``codes`` (functions' ``__code__``) or
    what they call: where a Ctrl-C's interrupt can land."""
    calls = 0

    def hook(frame, event, arg):
        nonlocal calls
        f = frame
        while f is not None and f.f_code not in codes:
            f = f.f_back
        if event == "c_return" and f is not None:
            calls += 1
            if calls == n:
                raise KeyboardInterrupt

    return hook


def consume_interrupted(stream, n: int, *codes, meanwhile=None) -> BaseException | None:
    """Iterate ``stream`` to its end in a thread of its own with :func:`interrupt_at_c_call`'s hook
    (``n``, ``codes``) set, ``meanwhile()`` called here once it has started; returns what the
    iteration raised (None: nothing). AssertionError: the thread still runs 20 s on (the stream hangs
    after the interrupt)."""
    got = {}

    def consume():
        sys.setprofile(interrupt_at_c_call(n, *codes))
        try:
            for _ in stream:
                pass
        except BaseException as e:  # noqa: BLE001 - what the stream raised
            got["e"] = e
        finally:
            sys.setprofile(None)

    t = threading.Thread(target=consume, daemon=True)
    t.start()
    if meanwhile is not None:
        meanwhile()
    t.join(20)
    assert not t.is_alive(), f"the stream hangs after an interrupt at its C call {n}"
    return got.get("e")
