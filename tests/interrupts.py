"""A Ctrl-C at any point: the main thread gets KeyboardInterrupt at whichever bytecode it is at."""

from __future__ import annotations


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
