"""Probe: what handing a step's tokens to the streams costs the LLM step loop's thread. CPU only.

``CompletionService._send`` (the step thread's hand-off of each live request's new tokens to its
asyncio queue) with ``--streams`` live requests, one new token each per step, their queues on an
event loop in another thread that empties them: wall and thread CPU time of the step thread per
step. With ``--against SRC`` (another checkout's ``src`` folder) the same runs on that code in a
second process, for a before/after.

Usage: python bench/probes/llm_send_probe.py [--streams 256] [--steps 300] [--against OTHER/src]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import subprocess
import sys
import threading
import time


def measure(streams: int, steps: int) -> dict:
    from fullthrottle.server.services import CompletionService

    class Rec:  # (the scheduler's record: tokens so far, done, logprobs)
        def __init__(self):
            self.tokens, self.done, self.logprobs = [], False, None

    loop = asyncio.new_event_loop()
    threading.Thread(target=loop.run_forever, daemon=True).start()

    async def queue():
        return asyncio.Queue()

    outs = [asyncio.run_coroutine_threadsafe(queue(), loop).result() for _ in range(streams)]
    recs = [Rec() for _ in range(streams)]
    live = {r: [{}, loop, o, 0] for r, o in zip(recs, outs)}

    async def drain():  # (the streams' readers)
        while True:
            for o in outs:
                while not o.empty():
                    o.get_nowait()
            await asyncio.sleep(0.001)

    asyncio.run_coroutine_threadsafe(drain(), loop)
    t0, c0 = time.perf_counter(), time.thread_time()
    for k in range(steps):
        for r in recs:
            r.tokens.append(k)
        CompletionService._send(live, 1)
    wall, cpu = time.perf_counter() - t0, time.thread_time() - c0
    return {
        "streams": streams,
        "steps": steps,
        "wall_ms_per_step": 1e3 * wall / steps,
        "cpu_ms_per_step": 1e3 * cpu / steps,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--streams", type=int, default=256)
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--against", help="another checkout's src folder, measured the same way")
    ap.add_argument("--one", action="store_true", help=argparse.SUPPRESS)  # (a child: print its JSON)
    args = ap.parse_args()
    if args.one:
        print(json.dumps(measure(args.streams, args.steps)))
        return
    out = {}
    for name, src in (("this", None), ("against", args.against)):
        if name == "against" and not src:
            continue
        env = dict(os.environ, **({"PYTHONPATH": src} if src else {}))
        cmd = [sys.executable, __file__, "--one", "--streams", str(args.streams), "--steps", str(args.steps)]
        out[name] = json.loads(subprocess.run(cmd, env=env, capture_output=True, text=True, check=True).stdout)
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
