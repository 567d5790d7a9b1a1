"""Helpers shared by the benchmark scripts: machine/version metadata, test images, JSON output."""

from __future__ import annotations

import collections
import contextlib
import json
import os
import sys
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))
SAMPLES = ROOT / "tests" / "data" / "imagenet-sample"


def machine_info() -> dict:
    from fullthrottle.cli.benchmarks import machine_info as info

    return info()


def jpegs_640x480(quality: int = 90) -> list[bytes]:
    """The 200 ImageNet samples resized to exactly 640x480 and re-encoded as JPEG (bytes)."""
    import cv2

    out = []
    for p in sorted(SAMPLES.glob("*.JPEG")):
        bgr = cv2.imdecode(np.fromfile(str(p), np.uint8), cv2.IMREAD_COLOR)
        bgr = cv2.resize(bgr, (640, 480), interpolation=cv2.INTER_AREA)
        ok, buf = cv2.imencode(".jpg", bgr, [cv2.IMWRITE_JPEG_QUALITY, quality])
        assert ok
        out.append(buf.tobytes())
    return out


def sample_jpegs() -> list[bytes]:
    """The 200 mixed-size ImageNet sample JPEGs as bytes."""
    return [p.read_bytes() for p in sorted(SAMPLES.glob("*.JPEG"))]


def capture_graph(fn, warmup: int = 3):
    """``fn()`` (CUDA work, no host sync) captured by hand as a ``torch.cuda.CUDAGraph``, after
    ``warmup`` calls on a side stream (cuDNN/cuBLAS pick their kernels, workspaces are allocated)."""
    import torch

    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(warmup):
            fn()
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        fn()
    return g


def events_time(fn, iters):
    """Seconds per call of ``fn`` (which queues GPU work on the current stream), by CUDA events."""
    import torch

    t0, t1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize()
    t0.record()
    for _ in range(iters):
        fn()
    t1.record()
    torch.cuda.synchronize()
    return t0.elapsed_time(t1) / 1e3 / iters


def engine_ring_loop(eng, bs: int, iters: int) -> None:
    """Run ``iters`` batches of ``bs`` rows (already in the slots' pinned inputs) through a
    :class:`fullthrottle.workloads.classify.compute.Engine`, every staging slot in flight: submit, and collect + release
    the oldest batch whenever the ring is full; then drain."""
    inflight = []
    for _ in range(iters):
        slot = eng.acquire()
        inflight.append(eng.submit(slot, None, bs))
        if len(inflight) == len(eng.slots):
            done = inflight.pop(0)
            eng.collect(done)
            eng.release(done)
    for done in inflight:
        eng.collect(done)
        eng.release(done)


def write_json(path: str | os.PathLike, payload: dict) -> None:
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w", encoding="utf-8") as f:
        json.dump(payload, f, indent=2)
    print(f"wrote {path}")


def mps_servers(mps: dict) -> str:
    """The MPS control daemon's answer to get_server_list (the PIDs of its servers: one once a client
    connected)."""
    import subprocess

    r = subprocess.run([mps["exe"]], input="get_server_list\n", capture_output=True, text=True, timeout=30)
    return r.stdout.strip()


def mps_pipe_listing() -> dict:
    """What the MPS pipe folder ($CUDA_MPS_PIPE_DIRECTORY) holds: name -> file type, to check how
    :func:`fullthrottle.data.gpu_decode_procs.mps_server_running` should find the daemon."""
    import stat

    d = os.environ.get("CUDA_MPS_PIPE_DIRECTORY") or "/tmp/nvidia-mps"
    kinds = {stat.S_ISSOCK: "socket", stat.S_ISFIFO: "fifo", stat.S_ISREG: "file", stat.S_ISDIR: "dir"}
    try:
        names = sorted(os.listdir(d))
    except OSError as e:
        return {"error": str(e)}
    out = {}
    for name in names:
        try:
            mode = os.lstat(os.path.join(d, name)).st_mode
        except OSError as e:
            out[name] = str(e)
            continue
        out[name] = next((k for f, k in kinds.items() if f(mode)), oct(mode))
    return out


@contextlib.contextmanager
def mps_clients(enabled: bool):
    """``with mps_clients(True) as mps:`` everything CUDA in the block (this process and its children)
    runs as clients of a private CUDA MPS server (the product's :func:`fullthrottle.core.mps.private_mps`),
    asked to quit at the end; ``mps`` (``{"exe", "root"}``) is None when not ``enabled``. Enter it
    before the first CUDA call. Exits if the server cannot be started."""
    from fullthrottle.core.mps import control_binary, private_mps

    with private_mps(enabled) as how:
        if not enabled:
            yield None
            return
        if how != "started":
            sys.exit(f"--mps: {how}")
        root = os.path.dirname(os.environ["CUDA_MPS_PIPE_DIRECTORY"])
        print(f"MPS control daemon started ({root})", flush=True)
        yield {"exe": control_binary(), "root": root}


def free_port() -> int:
    """A TCP port free on 127.0.0.1 now (the OS picks it; a server started next may take it)."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_ready(url: str, proc=None, timeout_s: float = 120.0, every_s: float = 0.5) -> bool:
    """Poll ``url`` (a server's readiness route) until it answers 200: True; False once ``timeout_s``
    pass or the process ``proc`` (a Popen, optional) exits first."""
    import time

    import httpx

    deadline = time.time() + timeout_s
    while time.time() < deadline and (proc is None or proc.poll() is None):
        try:
            if httpx.get(url, timeout=2).status_code == 200:
                return True
        except httpx.HTTPError:
            pass
        time.sleep(every_s)
    return False


def rss_mib(pid: int) -> float | None:
    """Resident memory of process ``pid`` in MiB (``VmRSS`` in /proc; None if gone)."""
    from pathlib import Path

    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    except (OSError, IndexError, ValueError):
        return None
    return None


def cpu_s(pid: int) -> float | None:
    """CPU seconds (user + system) process ``pid`` has used so far, from /proc (None if gone)."""
    import os
    from pathlib import Path

    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")  # utime + stime
    except (OSError, IndexError, ValueError):
        return None


def tree(pid: int) -> list[int]:
    """``pid`` and all its descendants (from /proc)."""
    kids: dict[int, list[int]] = {}
    for d in os.listdir("/proc"):
        if d.isdigit():
            try:
                ppid = int(Path(f"/proc/{d}/stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            kids.setdefault(ppid, []).append(int(d))
    out, todo = [], [pid]
    while todo:
        p = todo.pop()
        out.append(p)
        todo += kids.get(p, [])
    return out


#: the kinds of fullthrottle's child processes, by a word of their command line
KINDS = (("server.front", "http_workers"), ("gpu_decoder_worker", "gpu_decoders"), ("decoder_worker", "cpu_decoders"))


def kind_of(pid: int, root: int, root_name: str = "engine") -> str:
    """What process ``pid`` of ``root``'s tree is: ``root_name`` for the root, else a name of :data:`KINDS`
    (``"other"``: none of them, ``"gone"``: it exited)."""
    if pid == root:
        return root_name
    try:
        cmd = Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return "gone"
    return next((name for key, name in KINDS if key.encode() in cmd), "other")


def processes_by_kind(root: int, root_name: str = "engine") -> dict[str, list[str]]:
    """The processes of ``root``'s tree by :func:`kind_of`: per kind, each one's pid and the start of
    its command line (to see what a kind holds, ``"other"`` above all)."""
    out: dict[str, list[str]] = {}
    for p in tree(root):
        try:
            cmd = Path(f"/proc/{p}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        out.setdefault(kind_of(p, root, root_name), []).append(f"{p}: {cmd[:160]}")
    return out


def cpu_by_pid(root: int, root_name: str = "engine") -> dict[int, tuple[str, float]]:
    """``(kind, CPU seconds used so far)`` of each process of ``root``'s tree (:func:`kind_of`)."""
    out = {}
    for p in tree(root):
        c = cpu_s(p)
        if c is not None:
            out[p] = (kind_of(p, root, root_name), c)
    return out


def cpu_by_kind(root: int, root_name: str = "engine") -> dict[str, float]:
    """CPU seconds used so far by the processes of ``root``'s tree, summed by :func:`kind_of`."""
    import collections

    out: dict[str, float] = collections.Counter()
    for kind, c in cpu_by_pid(root, root_name).values():
        out[kind] += c
    return out


def cores_by_kind(before: dict, after: dict, seconds: float) -> dict[str, float]:
    """Cores used by each kind of the server's processes between two :func:`cpu_by_kind` reads."""
    return {k: round((after[k] - before.get(k, 0.0)) / seconds, 2) for k in after}


def py_spy_raw(path) -> list[tuple[list[str], int]]:
    """The samples of a ``py-spy record -f raw`` file: ``(frames, count)`` per stack, outermost frame
    first (with ``--threads``, the thread's name); nothing when the file is missing."""
    out = []
    p = Path(path)
    for line in p.read_text().splitlines() if p.exists() else []:
        stack, _, cnt = line.rstrip().rpartition(" ")
        if cnt.isdigit():
            out.append((stack.split(";"), int(cnt)))
    return out


def scrape(base: str) -> dict[str, float]:
    """The server's /metrics: every sample's value by its name and labels (summed over replicas)."""
    import re

    import httpx

    out: dict[str, float] = collections.Counter()
    for line in httpx.get(base + "/metrics", timeout=30).text.splitlines():
        m = re.match(r"^(fullthrottle_[a-z_]+)(\{[^}]*\})? (\S+)$", line)
        if m:
            labels = re.sub(r'replica="[^"]*",?', "", m.group(2) or "")
            out[m.group(1) + labels] += float(m.group(3))
    return out


def _either(d: dict, name: str, stage: str) -> float:
    """A per-stage total as a counter (``NAME_total``) or, from an older server, a gauge (``NAME``)."""
    return d.get(f'{name}_total{{stage="{stage}"}}', d.get(f'{name}{{stage="{stage}"}}', 0.0))


def where_time_goes(m0: dict, m1: dict) -> dict:
    """Between two scrapes: the mean wait per image in each stage's input queue and the mean work
    per image in each stage (ms; a batch's work shared among its images), the mean classify batch
    size, the mean per-image latency in the engine's pipeline, and the mean request latency of
    /v1/classify (ms)."""
    import re

    d = {k: m1[k] - m0.get(k, 0.0) for k in m1}
    out = {}
    for k, v in d.items():
        st = re.fullmatch(r'fullthrottle_stage_queue_wait_seconds(?:_total)?\{stage="([^"]+)"\}', k)
        n = _either(d, "fullthrottle_stage_queue_waits", st.group(1)) if st else 0.0
        if st and n > 0:
            out[f"queue_wait_ms {st.group(1)}"] = round(1e3 * v / n, 2)
        st = re.fullmatch(r'fullthrottle_stage_work_seconds(?:_total)?\{stage="([^"]+)"\}', k)
        n = _either(d, "fullthrottle_stage_items", st.group(1)) if st else 0.0
        if st and n > 0:
            out[f"work_ms {st.group(1)}"] = round(1e3 * v / n, 3)
    k = 'fullthrottle_batch_size_{}{{workload="classify"}}'
    if d.get(k.format("count"), 0.0) > 0:
        out["mean_batch"] = round(d[k.format("sum")] / d[k.format("count")], 1)
    n = d.get("fullthrottle_item_latency_seconds_count", 0.0)
    if n > 0:
        out["engine_latency_ms"] = round(1e3 * d["fullthrottle_item_latency_seconds_sum"] / n, 2)
    k = 'fullthrottle_request_latency_seconds_{}{{route="/v1/classify"}}'
    if d.get(k.format("count"), 0.0) > 0:
        out["http_worker_latency_ms"] = round(1e3 * d[k.format("sum")] / d[k.format("count")], 2)
    return out
