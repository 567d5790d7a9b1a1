"""Probe hooks (issue 10) for every Python process started with this folder on ``PYTHONPATH``:

- ``FT_GC_TIMING=FILE``: how long the garbage collector holds the GIL. Every collection's generation
  and duration is counted, and at exit ``FILE.PID.json`` gets, per generation, the number of
  collections, their total and longest milliseconds, and the objects tracked at exit.
- ``FT_SWITCH_INTERVAL=SECONDS``: ``sys.setswitchinterval(SECONDS)`` at start-up (how long a thread
  that waits for the GIL lets the holder run before asking it to drop it; CPython's default 0.005).

Without these variables it does nothing."""

import atexit
import gc
import json
import os
import sys
import time

if os.environ.get("FT_SWITCH_INTERVAL"):
    sys.setswitchinterval(float(os.environ["FT_SWITCH_INTERVAL"]))

_path = os.environ.get("FT_GC_TIMING")
if _path:
    _t0 = [0.0]
    _stats = {g: [0, 0.0, 0.0] for g in range(3)}  # collections, total ms, longest ms

    def _cb(phase, info):
        if phase == "start":
            _t0[0] = time.perf_counter()
            return
        ms = 1e3 * (time.perf_counter() - _t0[0])
        s = _stats[info["generation"]]
        s[0] += 1
        s[1] += ms
        s[2] = max(s[2], ms)

    gc.callbacks.append(_cb)

    @atexit.register
    def _dump():
        out = {
            f"gen{g}": {"collections": c, "total_ms": round(t, 1), "max_ms": round(m, 2)}
            for g, (c, t, m) in _stats.items()
        }
        out["tracked_at_exit"] = len(gc.get_objects())
        with open(f"{_path}.{os.getpid()}.json", "w") as f:
            json.dump(out, f)
