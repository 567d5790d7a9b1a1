"""Probe: the CPU the engine process of a multi-process server spends per single-image classify
request on its links to the HTTP worker processes. CPU only.

The engine side is ``server/engine_host.py``'s :class:`EngineHost` over real socket pairs, as the
supervisor makes them, with a stand-in classification service whose dispatcher thread answers every
image at once (a real :class:`Result`: five labels, ids and probabilities); the worker side is
``server/front.py``'s :class:`EngineClient` in ``--workers`` processes, each keeping ``--inflight``
requests of one 640x480 JPEG (~60 KB) in flight. What is measured is the link: frames in and out,
the images' bytes, the answers' JSON, the threads' hand-offs. Per round: requests/s, and the
engine process's CPU per request (µs) and its threads.

With ``--against SRC`` (another checkout's ``src`` folder) the same rounds run on that code too, for
a before/after in one call.

Usage: python bench/probes/engine_link_probe.py [--workers 2] [--inflight 16] [--seconds 4]
    [--rounds 3] [--against OTHER/src] --out engine_link.json
"""

from __future__ import annotations

import argparse
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(HERE))  # bench/: common.py
sys.path.insert(0, str(HERE / "probes"))  # serve_profile.summarize
from common import jpegs_640x480, machine_info, write_json  # noqa: E402

ENGINE = r"""
import asyncio, itertools, queue, socket, sys, threading, types
from multiprocessing.connection import Connection
from fullthrottle.server.engine_host import EngineHost
from fullthrottle.workloads.classify.result import Result

LABELS = ["tabby cat", "tiger cat", "Egyptian cat", "lynx", "Persian cat"]

class Svc:  # the replica's part: its dispatcher thread answers each image at once
    def __init__(self):
        self.q, self.n = queue.SimpleQueue(), itertools.count()
        threading.Thread(target=self.run, daemon=True).start()
    def queued(self): return 0
    def pending(self): return 0
    def cancel(self, indexes): pass
    def submit_cb(self, item_id, data, done):
        self.q.put((done, item_id, len(data)))
        return next(self.n)
    def run(self):
        while True:
            got = [self.q.get()]
            while True:
                try: got.append(self.q.get_nowait())
                except queue.Empty: break
            for done, iid, n in got:
                done(Result(0, iid, LABELS, [281, 282, 285, 287, 283], [0.6123, 0.2011, 0.0912, 0.0453, 0.0101], None, 3.25))

def pipeline_service():  # the real replica: a BatchingService over a CPU pipeline, decoder processes
    import torch
    from fullthrottle import Config, Pipeline
    from fullthrottle.server.services import BatchingService
    class Tiny(torch.nn.Module):  # (B, 3, 32, 32) -> (B, 1000): the model's own work next to nothing
        def __init__(self):
            super().__init__()
            self.fc = torch.nn.Linear(3, 1000)
        def forward(self, x):
            return self.fc(x.mean((2, 3)))
    torch.manual_seed(0)
    cfg = Config(device="cpu", preprocess="processes", threads=1, resize_size=32, crop_size=32,
                 ordered=False, max_wait_ms=0.5)
    return BatchingService(Pipeline(cfg, model=Tiny().eval()), 1024)

svc = pipeline_service() if "--pipeline" in sys.argv else Svc()
sys.argv = [a for a in sys.argv if a != "--pipeline"]
app = types.SimpleNamespace(state=types.SimpleNamespace(ft={"ready": True, "services": [svc]}))
host = EngineHost(app, asyncio.new_event_loop())
import inspect
from fullthrottle.server.engine_host import Link
takes_socket = "sock" in inspect.signature(Link.__init__).parameters  # (older code: a Connection)
for i, fd in enumerate(sys.argv[1:]):
    host.add_link(socket.socket(fileno=int(fd)) if takes_socket else Connection(int(fd)), str(i))
print("ready", flush=True)
sys.stdin.read()  # until the probe closes it
"""

WORKER = r"""
import asyncio, socket, sys, time
from fullthrottle.server.front import EngineClient

fd, inflight, seconds, path = int(sys.argv[1]), int(sys.argv[2]), float(sys.argv[3]), sys.argv[4]
pipeline = sys.argv[5:] == ["--pipeline"]
jpeg = open(path, "rb").read()

async def main():
    client = await EngineClient.connect(socket.socket(fileno=fd))
    done = [0]
    async def loop(end):
        while time.perf_counter() < end:
            (r,) = await client.classify([("img.jpg", jpeg)])
            assert r.error is None and (pipeline or r.class_ids[0] == 281), r
            done[0] += 1
    end = time.perf_counter() + 0.5
    await asyncio.gather(*(loop(end) for _ in range(inflight)))  # warm-up
    done[0] = 0
    t0 = time.perf_counter()
    await asyncio.gather(*(loop(t0 + seconds) for _ in range(inflight)))
    print(done[0], time.perf_counter() - t0, flush=True)

asyncio.run(main())
"""


def cpu_s(pid: int) -> float:
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def one_round(
    src: str, workers: int, inflight: int, seconds: float, jpeg_path: str, spy: str | None = None, pipeline=False
) -> dict:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([src, os.environ.get("PYTHONPATH", "")])}
    pairs = [socket.socketpair() for _ in range(workers)]
    fds = [a.fileno() for a, _ in pairs]
    engine = subprocess.Popen(
        [sys.executable, "-c", ENGINE, *map(str, fds), *(["--pipeline"] if pipeline else [])],
        pass_fds=fds,
        env=env,
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    for a, _ in pairs:
        a.close()
    assert engine.stdout.readline().strip() == "ready"
    procs = []
    for _, b in pairs:
        procs.append(
            subprocess.Popen(
                [sys.executable, "-c", WORKER, str(b.fileno()), str(inflight), str(seconds), jpeg_path]
                + (["--pipeline"] if pipeline else []),
                pass_fds=(b.fileno(),),
                env=env,
                stdout=subprocess.PIPE,
                text=True,
            )
        )
        b.close()
    time.sleep(0.5 + 0.1)  # (the workers' warm-up)
    c0, t0 = cpu_s(engine.pid), time.perf_counter()
    rec = None
    if spy:  # the engine's stacks while the link is busy (collapsed; by thread and function)
        cmd = [spy, "record", "--pid", str(engine.pid), "--threads", "--rate", "500", "--format", "raw"]
        cmd += ["--duration", str(int(seconds) - 1), "--output", "/tmp/engine_link_spy.txt", "--nonblocking"]
        rec = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    outs = [p.communicate()[0].split() for p in procs]
    c1, t1 = cpu_s(engine.pid), time.perf_counter()
    if rec is not None:
        rec.wait()
    engine.stdin.close()
    engine.kill()
    engine.wait()
    n = sum(int(o[0]) for o in outs)
    wall = max(float(o[1]) for o in outs)
    got = {
        "requests": n,
        "requests_per_s": n / wall,
        "engine_cores": (c1 - c0) / (t1 - t0),
        "engine_cpu_us_per_request": 1e6 * (c1 - c0) / n * (wall / (t1 - t0)),
    }
    if rec is not None and Path("/tmp/engine_link_spy.txt").exists():
        from serve_profile import summarize

        got["py_spy"] = summarize(Path("/tmp/engine_link_spy.txt").read_text(), top=25)
    return got


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--inflight", type=int, default=16)
    ap.add_argument("--seconds", type=float, default=4.0)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--against", default=None, help="another checkout's src folder: the same rounds on it")
    ap.add_argument("--py-spy", default=None, help="py-spy executable: record the engine in the first round")
    ap.add_argument(
        "--pipeline",
        action="store_true",
        help="the real service instead of the stand-in: a CPU Pipeline with a decoder process and a "
        "model of next to no work, on 32x32 crops (then the engine's CPU is the link's and the pipeline's threads')",
    )
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    jpeg = jpegs_640x480()[0]
    path = Path("/tmp/engine_link_probe.jpg")
    path.write_bytes(jpeg)
    srcs = {"this": str(HERE.parent / "src")}
    if args.against:
        srcs["against"] = str(Path(args.against).resolve())
    res = {"probe": "engine_link", "machine": machine_info(), "settings": vars(args), "jpeg_bytes": len(jpeg)}
    for r in range(args.rounds):
        for name, src in srcs.items():  # (alternating, so that drifts of the machine hit both)
            spy = args.py_spy if r == 0 else None
            got = one_round(src, args.workers, args.inflight, args.seconds, str(path), spy, args.pipeline)
            res.setdefault(name, []).append(got)
            print(name, r, {k: round(v, 1) for k, v in got.items() if k != "py_spy"}, flush=True)
            for kind in ("by_thread", "self") if "py_spy" in got else ():
                print("  ", kind, got["py_spy"][kind][:12], flush=True)
    write_json(args.out, res)


if __name__ == "__main__":
    main()
