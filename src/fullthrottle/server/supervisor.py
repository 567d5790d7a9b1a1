"""``fullthrottle serve --http-workers N`` (N >= 2): N HTTP worker processes in front of one engine.

    clients --TCP--> HTTP worker processes (server/front.py: parse, check, answer)
        --one link each (server/link.py)--> this process: the engine (server/engine_host.py in
        front of the one-process app: every classification replica, embeddings, the LLM, workloads)

This process holds the listening socket (bound before the model loads, so the port is taken at
once) and passes it to every worker, which accept on it together. It runs the app's lifespan
(model load, graph capture), starts the workers and starts another in place of one that exits (its
in-flight requests are lost with it, no other). SIGTERM or SIGINT: every worker drains (finishes
its in-flight requests, each within its deadline) and exits, then the engine closes; exit status 0.
A second signal stops waiting for in-flight requests.

``/metrics`` sums every process's counters and histograms with prometheus-client's multiprocess
mode (``PROMETHEUS_MULTIPROC_DIR``: a private folder, removed at the end).
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time

from ..core.config import Config
from ..data.worker_procs import exit_reason
from .options import MAX_CONNECTIONS, ServeOptions

log = logging.getLogger("fullthrottle.server.supervisor")
#: a worker that exits sooner than this after its start counts as failing to start
QUICK_EXIT_S = 5.0
#: the server stops when workers fail to start this many times in a row
MAX_QUICK_EXITS = 5
_OPTION_FIELDS = [f.name for f in dataclasses.fields(ServeOptions) if f.name not in ("llm", "workloads", "devices")]


class _Worker:
    def __init__(self, slot: int, listen: socket.socket, settings: bytes, host):
        ours, theirs = socket.socketpair()
        self.slot, self.t0 = slot, time.monotonic()
        fds = (listen.fileno(), theirs.fileno(), host.backlog.fd)  # (the queue's state: front.EngineClient)
        self.proc = subprocess.Popen(
            [sys.executable, "-c", "from fullthrottle.server.front import main; main()", *map(str, fds)],
            pass_fds=fds,
            stdin=subprocess.PIPE,
            process_group=0,  # Ctrl-C reaches this process only; it stops the workers in order
        )
        theirs.close()
        self.proc.stdin.write(settings)
        self.proc.stdin.close()
        self.link = host.add_link(ours, f"{slot}")


class _Lifespan:
    """The app's ASGI lifespan, run here as uvicorn would run it."""

    def __init__(self, app):
        self.app, self.inbox, self.said = app, asyncio.Queue(), asyncio.Queue()
        self.task = None

    async def _send(self, msg):
        await self.said.put(msg)

    async def _step(self, what: str) -> str | None:
        await self.inbox.put({"type": f"lifespan.{what}"})
        got = asyncio.ensure_future(self.said.get())
        await asyncio.wait([got, self.task], return_when=asyncio.FIRST_COMPLETED)
        if not got.done():
            got.cancel()
            return f"the app's lifespan ended during {what}: {self.task.exception()!r}"
        msg = got.result()
        return msg.get("message", what + " failed") if msg["type"].endswith(".failed") else None

    async def startup(self) -> str | None:
        """None once the app is up, else why it could not start."""
        scope = {"type": "lifespan", "asgi": {"version": "3.0"}, "state": {}}
        self.task = asyncio.ensure_future(self.app(scope, self.inbox.get, self._send))
        return await self._step("startup")

    async def shutdown(self) -> None:
        if self.task is not None and self.task.done() and not self.task.cancelled():
            self.task.exception()  # (its startup failed: already reported)
        elif self.task is not None:
            err = await self._step("shutdown")
            if err:
                log.error("shutdown: %s", err)


def run_multi(
    config: Config,
    host: str = "127.0.0.1",
    port: int = 8000,
    options: ServeOptions | None = None,
    http_workers: int = 2,
    max_connections: int = MAX_CONNECTIONS,
) -> int:
    """Serve with ``http_workers`` HTTP worker processes until SIGTERM/SIGINT; returns the exit
    status (0 after a graceful stop, 3 when the app could not start or its HTTP workers keep dying
    as they start).

    ``max_connections`` and the per-client connection cap (``options.max_connections_per_client``)
    hold per worker, as uvicorn's ``--limit-concurrency`` does with its ``--workers``: the workers
    accept on one shared socket, and the idlest takes most new connections, so an even share of the
    limit would run out in one worker while the others had room.

    Raises:
        OSError: ``host:port`` cannot be listened on.
    """
    opts = options or ServeOptions()
    metrics_dir = tempfile.mkdtemp(prefix="fullthrottle-metrics-")
    os.environ["PROMETHEUS_MULTIPROC_DIR"] = metrics_dir  # (the workers inherit it)
    from prometheus_client import values

    values.ValueClass = values.get_value_class()  # this process's metrics go to the folder too
    family = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)[0][0]
    listen = socket.create_server((host, port), family=family, backlog=4096)
    try:
        return asyncio.run(_supervise(config, opts, listen, http_workers, max_connections))
    finally:
        listen.close()
        shutil.rmtree(metrics_dir, ignore_errors=True)
        os.environ.pop("PROMETHEUS_MULTIPROC_DIR", None)


async def _supervise(config: Config, opts: ServeOptions, listen: socket.socket, n: int, max_connections: int) -> int:
    from prometheus_client.multiprocess import mark_process_dead

    from .app import create_app
    from .engine_host import EngineHost
    from .http_layer import FORCED_END_S
    from .link import Backlog
    from .text import end_streams_in

    loop = asyncio.get_running_loop()
    app = create_app(config, opts)
    engine = EngineHost(app, loop, Backlog())
    settings = json.dumps(
        {
            "options": {k: getattr(opts, k) for k in _OPTION_FIELDS},
            "max_image_pixels": config.max_image_pixels,
            "top_k": config.top_k,
            "max_connections": max_connections,  # (each worker's own: they take uneven shares of the clients)
        }
    ).encode()
    stop, signals = asyncio.Event(), [0]
    workers: list[_Worker] = []

    def forward_signal():
        for w in workers:
            if w.proc.poll() is None:
                w.proc.send_signal(signal.SIGTERM)

    def on_signal():
        signals[0] += 1
        stop.set()
        if signals[0] > 1:  # the second: streams end now, then the workers stop waiting for in-flight requests
            end_streams_in(app.state.ft, 0.0)
            loop.call_later(FORCED_END_S / 2, forward_signal)  # (the ends reach the workers first)

    for s in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(s, on_signal)
    workers = [_Worker(i, listen, settings, engine) for i in range(n)]
    addr = listen.getsockname()
    shown = f"[{addr[0]}]" if ":" in addr[0] else addr[0]
    print(
        f"fullthrottle: running on http://{shown}:{addr[1]} with {n} HTTP worker processes (Ctrl-C or SIGTERM to stop)",
        file=sys.stderr,
        flush=True,
    )
    life = _Lifespan(app)
    starting = asyncio.ensure_future(life.startup())
    code, quick_exits = 0, 0
    stopped = asyncio.ensure_future(stop.wait())  # (one waiter: a new one per round would pile up)
    while not (stop.is_set() and starting.done()):
        await asyncio.wait([starting, stopped], timeout=0.2)
        if starting.done() and starting.result() is not None:
            msg = starting.result()
            msg = msg.split("StartupError: ", 1)[1].rstrip() if "StartupError: " in msg else msg
            print(f"fullthrottle: error: {msg}", file=sys.stderr, flush=True)
            code = 2  # (a start that fails: as with one HTTP process)
            break
        for i, w in enumerate(workers):
            if w.proc.poll() is None or stop.is_set():
                continue
            quick_exits = quick_exits + 1 if time.monotonic() - w.t0 < QUICK_EXIT_S else 0
            last = quick_exits >= MAX_QUICK_EXITS
            then = "stopping" if last else "starting another"
            log.warning("HTTP worker %d (pid %d) ended (%s): %s", w.slot, w.proc.pid, exit_reason(w.proc), then)
            mark_process_dead(w.proc.pid)
            w.link.close()
            if last:
                print(
                    f"fullthrottle: error: {MAX_QUICK_EXITS} HTTP worker processes in a row died within "
                    f"{QUICK_EXIT_S:g} s of their start: stopping",
                    file=sys.stderr,
                )
                code = 3
                stop.set()
                break
            workers[i] = _Worker(w.slot, listen, settings, engine)
    stopped.cancel()
    end_streams_in(app.state.ft, opts.timeout_s)  # (the workers drain as long: streams end cleanly before)
    # drain: every worker finishes its in-flight requests (they need the engine) and exits; each
    # closes its listening socket at once, and this process's copy goes first, so that a new
    # connection is refused instead of waiting unaccepted in the backlog until it is reset
    listen.close()
    for w in workers:
        if w.proc.poll() is None:
            w.proc.send_signal(signal.SIGTERM)
    deadline = time.monotonic() + opts.timeout_s + 10
    while any(w.proc.poll() is None for w in workers) and time.monotonic() < deadline:
        await asyncio.sleep(0.05)
    for w in workers:
        if w.proc.poll() is None:
            log.warning("HTTP worker %d (pid %d) did not stop: killed", w.slot, w.proc.pid)
            w.proc.kill()
        w.proc.wait()
        mark_process_dead(w.proc.pid)
    engine.close()
    if not starting.done():
        await starting
    await life.shutdown()
    return code
