"""The load generator of the serving benchmarks: client processes, each pinned to its own cores, each
one event loop (uvloop's where installed) posting prepared request bodies to one URL over keep-alive
connections; the closed loop's through an ``aiohttp.ClientSession``. (aiohttp, not httpx: on one core httpx's ``AsyncClient`` sends about 1,100 req/s
over 8 connections and 140 over 64, aiohttp about 5,000 over either, against a server that answers
at once, so an httpx load generator would measure itself.)

- :func:`closed_loop`: ``concurrency`` connections in all; each sends its next request when its last
  answer arrives, for ``duration_s`` after ``warmup_s``. Counted: requests that start after the warm-up
  and end within the window.
- :func:`open_loop`: requests sent at a fixed total rate (req/s), whatever the answers, for
  ``duration_s``, on bare asyncio connections (:mod:`rate_client`: aiohttp's client per request cost
  more CPU than the rates asked of it); a request waits at most ``timeout_s`` from its due time for a free connection (else
  it is never sent: :data:`UNSENT`, the load generator's queue), then at most ``timeout_s`` for the
  server's answer (else ``TimeoutError``); the latency of an answer counts from its due time.
  Goodput: images answered 200 within the window, per second (every answer's status is counted, in
  the window or after it). The clients hold at most ``connections``
  keep-alive connections in all: start the server with a connection cap above it, so that load past
  its capacity meets its admission control (503 on the same connection) and not its connection cap
  (whose refusals close the connection: every next request would open another, and the handshakes
  would load both sides more than the requests).

Both return per-status counts, images answered, p50/p99 latency of the 200s (ms), and the client
processes' own CPU use (cores) and ``client_limited`` (those cores nearly full: the result then
measures the clients, not the server).
"""

from __future__ import annotations

import asyncio
import concurrent.futures as cf
import multiprocessing as mp
import os
import resource
import time
import uuid
from collections import Counter

import numpy as np
import rate_client  # bench/ (on the path of whoever imports this module)
from rate_client import UNSENT  # noqa: F401  (a status of the open loop's results)

#: share of the client processes' cores in use past which a result is marked ``client_limited``
CLIENT_LIMITED = 0.85
#: keep-alive connections of an open loop, all client processes together
OPEN_LOOP_CONNECTIONS = 4096


def multipart(blobs: list[bytes], field: str = "file") -> tuple[bytes, str]:
    """One multipart/form-data body holding ``blobs`` as JPEG files; returns (body, content-type)."""
    b = uuid.uuid4().hex
    parts = [
        f'--{b}\r\nContent-Disposition: form-data; name="{field}"; filename="{k}.jpg"\r\n'
        f"Content-Type: image/jpeg\r\n\r\n".encode()
        + x
        + b"\r\n"
        for k, x in enumerate(blobs)
    ]
    return b"".join(parts) + f"--{b}--\r\n".encode(), f"multipart/form-data; boundary={b}"


def _session(connections: int, timeout_s: float):
    import aiohttp

    conn = aiohttp.TCPConnector(limit=connections, force_close=False)
    return aiohttp.ClientSession(connector=conn, timeout=aiohttp.ClientTimeout(total=timeout_s))


async def _post(s, url, body, ctype, timeout_s: float | None = None) -> int | str:
    import aiohttp

    kw = {} if timeout_s is None else {"timeout": aiohttp.ClientTimeout(total=timeout_s)}
    try:
        async with s.post(url, data=body, headers={"content-type": ctype}, **kw) as r:
            await r.read()
            return r.status
    except (aiohttp.ClientError, TimeoutError) as e:
        return type(e).__name__


async def _closed(url, bodies, images, concurrency, duration_s, warmup_s) -> dict:
    codes, lat, ok_images = Counter(), [], 0
    async with _session(concurrency, 60) as s:
        t_start = time.perf_counter() + warmup_s
        t_end = t_start + duration_s

        async def conn(k):
            nonlocal ok_images
            i = k
            while (t := time.perf_counter()) < t_end:
                body, ctype = bodies[i % len(bodies)]
                i += concurrency
                code = await _post(s, url, body, ctype)
                t2 = time.perf_counter()
                if t >= t_start and t2 <= t_end:
                    codes[code] += 1
                    if code == 200:
                        lat.append(t2 - t)
                        ok_images += images

        await asyncio.gather(*(conn(k) for k in range(concurrency)))
    return {"codes": codes, "lat": lat, "images": ok_images}


async def _open(url, bodies, images, rate, duration_s, timeout_s, connections) -> dict:
    return await rate_client.run(url, bodies, images, rate, duration_s, timeout_s, connections)


def _client(job) -> dict:
    cores, mode, kw = job
    if cores:
        os.sched_setaffinity(0, cores)
    r0 = resource.getrusage(resource.RUSAGE_SELF)
    t0 = time.perf_counter()
    work = _closed(**kw) if mode == "closed" else _open(**kw)
    try:  # (uvloop's event loop where installed: less of the clients' CPU per request)
        from uvloop import run
    except ImportError:
        run = asyncio.run
    out = run(work)
    r1 = resource.getrusage(resource.RUSAGE_SELF)
    out["cpu_s"] = r1.ru_utime + r1.ru_stime - r0.ru_utime - r0.ru_stime
    out["wall_s"] = time.perf_counter() - t0
    return out


def _run(mode, procs, cores, per_proc: list[dict]) -> dict:
    with cf.ProcessPoolExecutor(procs, mp_context=mp.get_context("spawn")) as ex:
        jobs = [(cores[k::procs] if cores else None, mode, kw) for k, kw in enumerate(per_proc)]
        parts = list(ex.map(_client, jobs))
    codes = sum((Counter(p["codes"]) for p in parts), Counter())
    lat = np.concatenate([np.asarray(p["lat"], float) for p in parts]) * 1e3 if parts else np.array([])
    return {
        "statuses": {str(k): v for k, v in sorted(codes.items(), key=str)},
        "images_ok": sum(p["images"] for p in parts),
        "p50_ms": float(np.percentile(lat, 50)) if lat.size else None,
        "p99_ms": float(np.percentile(lat, 99)) if lat.size else None,
        "client_cores": (busy := sum(p["cpu_s"] for p in parts) / max(p["wall_s"] for p in parts)),
        "client_processes": procs,
        # (the clients' own cores nearly full: the point measures the load generator, not the server)
        "client_limited": busy >= CLIENT_LIMITED * min(procs, len(cores) if cores else procs),
        **({"sent_per_s": sum(p["sent_per_s"] for p in parts)} if mode == "open" else {}),
    }


def closed_loop(url, bodies, images, concurrency, duration_s, warmup_s=3.0, procs=4, cores=None) -> dict:
    """``concurrency`` connections split over ``procs`` client processes (pinned round-robin to
    ``cores``); ``bodies``: [(body, content-type)], each request ``images`` images. Adds ``img_per_s``."""
    procs = max(1, min(procs, concurrency))
    split = [concurrency // procs + (k < concurrency % procs) for k in range(procs)]
    kw = {"url": url, "bodies": bodies, "images": images, "duration_s": duration_s, "warmup_s": warmup_s}
    out = _run("closed", procs, cores, [dict(kw, concurrency=n) for n in split])
    return {"concurrency": concurrency, "img_per_s": out["images_ok"] / duration_s, **out}


def open_loop(
    url, bodies, images, rate, duration_s, timeout_s=10.0, procs=4, cores=None, connections=OPEN_LOOP_CONNECTIONS
) -> dict:
    """``rate`` requests/s in all from ``procs`` client processes for ``duration_s``, over at most
    ``connections`` connections in all; adds ``goodput_img_per_s`` (images answered 200 per second
    of the window)."""
    kw = {"url": url, "bodies": bodies, "images": images, "duration_s": duration_s, "timeout_s": timeout_s}
    kw["connections"] = max(1, connections // procs)
    out = _run("open", procs, cores, [dict(kw, rate=rate / procs)] * procs)
    return {
        "rate_req_per_s": rate,
        "connections": connections,
        "goodput_img_per_s": out["images_ok"] / duration_s,
        **out,
    }
