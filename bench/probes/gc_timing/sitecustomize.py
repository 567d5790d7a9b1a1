"""Probe (issue 10): how long the garbage collector holds the GIL in a process. Put this folder on
``PYTHONPATH`` and set ``FT_GC_TIMING=FILE``: every collection's generation and duration is
counted, and at exit ``FILE.PID.json`` gets, per generation, the number of collections, their total
and longest milliseconds, and the objects tracked at exit. Without ``FT_GC_TIMING`` it does nothing."""

import atexit
import gc
import json
import os
import time

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
