"""LLM serving as a user runs it (issue 14), Llama-2-7B shape, bf16, random weights, one JSON:

- **offline**, all requests given at once, in this process: fullthrottle's ``Scheduler`` (continuous
  batching on ``--rows`` rows, up to ``check_every`` decode steps per read back, as ``generate
  --prompts`` runs it) against transformers' ``generate_batch``
  (continuous batching, its paged cache, SDPA attention) on the same requests (transformers on the first
  ``--hf-requests`` of them: its rate at that load; greedy, no EOS);
- **online**, over HTTP: ``fullthrottle serve --no-classify --llm-random llama2-7b`` in a subprocess;
  a load generator in ``--client-procs`` processes (their own event loops, pinned to their own cores
  where the machine has them), closed loop, ``--seconds`` per concurrency point, streaming
  ``POST /v1/completions`` in OpenAI's request shape (prompts as token ids), on a fixed set (128 in,
  128 out) and a mixed set (prompt lengths log-normal, median 256, clipped to 64..2048; outputs
  log-normal, median 128, clipped to 32..512). Per point: output tok/s (tokens received / wall from
  the first request to the last answer), time to first token p50/p99, inter-token latency p50/p99
  (each streamed chunk's gap spread over its tokens), errors, the server process's CPU cores. The static cache holds ``rows`` x
  ``max_seq_len`` tokens whatever the requests' lengths, so the mixed set runs with fewer rows.

With ``--kv-pages N|auto`` the engine uses paged KV memory; ``--kv-dtype auto,fp8`` runs the offline
sets once per KV dtype (bf16, float8) in the same process, and the server with the last.

Usage: python bench/llm_serve.py --out bench/results/llm_serve.json
(or ``--parts offline`` and ``--parts online`` in two calls on one machine, then
``python bench/llm_serve.py --merge OFFLINE.json ONLINE.json --out bench/results/llm_serve.json``)
"""

from __future__ import annotations

import asyncio
import gc
import json
import os
import random
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import cpu_s, free_port, machine_info, wait_ready, write_json  # noqa: E402
from llm_serve_args import VOCAB, parse_args  # noqa: E402


def requests_of(kind: str, n: int, vocab: int, seed: int = 0) -> list[tuple[list[int], int]]:
    """``n`` (prompt ids, max_tokens) pairs of the fixed or mixed set."""
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        if kind == "fixed":
            p, m = 128, 128
        else:
            p = int(min(2048, max(64, rng.lognormvariate(np.log(256), 0.8))))
            m = int(min(512, max(32, rng.lognormvariate(np.log(128), 0.7))))
        out.append(([rng.randrange(3, vocab) for _ in range(p)], m))
    return out


def sync(dev) -> None:
    import torch

    if dev.type == "cuda":
        torch.cuda.synchronize(dev)


def offline(args) -> dict:
    import torch

    from fullthrottle.cli.generate import random_llama
    from fullthrottle.workloads.llm.checks import pages_that_fit
    from fullthrottle.workloads.llm.generate import Generator
    from fullthrottle.workloads.llm.kv_pages import PAGE
    from fullthrottle.workloads.llm.scheduler import Scheduler

    res = {}
    dev = torch.device(args.device)
    model = random_llama(args.shape, dev, torch.bfloat16 if dev.type == "cuda" else torch.float32)
    vocab = VOCAB[args.shape]
    dtypes = args.kv_dtype.split(",")
    budgets = [int(b) for b in args.max_prefill_tokens.split(",")] if args.max_prefill_tokens else [None]
    sets = [s for s in (("128/128", 512, 128, 128), ("512/256", 256, 512, 256)) if s[0] in args.sets.split(",")]
    for (name, n, p, m), dt, budget in ((s, dt, b) for dt in dtypes for b in budgets for s in sets):
        if len(dtypes) > 1:  # each KV dtype's results under its own keys
            name = f"{name}, kv {dt}"
        if len(budgets) > 1:  # and each prefill budget's
            name = f"{name}, prefill {budget}"
        g = torch.Generator().manual_seed(1)
        reqs = [(torch.randint(3, vocab, (p,), generator=g).tolist(), m) for _ in range(n // args.scale)]
        t0 = time.perf_counter()
        aside = {} if budget is None else {"prefill_tokens": budget}
        pages = pages_that_fit(model, PAGE, dt, **aside) if args.kv_pages == "auto" else int(args.kv_pages)
        kw = {} if budget is None else {"max_prefill_tokens": budget}
        gen = Generator(model, max_batch=args.rows, max_seq_len=p + m, graphs=True, kv_pages=pages, kv_dtype=dt, **kw)
        ready = time.perf_counter() - t0
        Scheduler(gen).run([{"prompt": r[0], "max_new_tokens": 4} for r in reqs[:8]])  # warm-up
        sync(dev)
        busy0 = {k: st.busy_s for k, st in gen.stats.items()}
        t0 = time.perf_counter()
        sched = Scheduler(gen, ahead=gen.check_every)
        out = sched.run([{"prompt": r[0], "max_new_tokens": r[1]} for r in reqs])
        sync(dev)
        wall = time.perf_counter() - t0
        toks = sum(len(o) for o in out)
        res[name] = {
            "requests": len(reqs),
            "rows": gen.max_batch,
            "kv_pages": gen.kv.num_pages if gen.kv is not None else 0,
            "kv_dtype": dt,
            "max_prefill_tokens": gen.max_prefill_tokens,
            "fullthrottle_tok_per_s": toks / wall,
            "wall_s": wall,
            # the device's time in the prefill and decode launches (CUDA events), and the rest of the
            # wall clock: the device idle between steps
            "prefill_s": gen.stats["prefill"].busy_s - busy0["prefill"],
            "decode_s": gen.stats["decode"].busy_s - busy0["decode"],
            "idle_s": wall - sum(gen.stats[k].busy_s - busy0[k] for k in ("prefill", "decode")),
            "steps": sched.steps,
            "preemptions": sched.preemptions,
            "output_tokens": toks,
            "capture_s": ready,
        }
        print(name, res[name], flush=True)
        del gen, sched  # the scheduler holds the generator: both go before the next one is built
        gc.collect()
        torch.cuda.empty_cache()
    del model
    gc.collect()
    torch.cuda.empty_cache()
    if args.hf_requests and args.shape == "llama2-7b":
        try:
            res["transformers"] = hf_offline(args)
        except Exception as e:  # noqa: BLE001 - the baseline's failure is recorded, ours stands
            res["transformers"] = {"error": f"{type(e).__name__}: {e}"}
        print("transformers", res["transformers"], flush=True)
    return res


def hf_offline(args) -> dict:
    import torch
    import transformers
    from transformers import AutoModelForCausalLM, GenerationConfig
    from transformers import LlamaConfig as HFConfig

    torch.manual_seed(0)
    cfg = HFConfig(
        vocab_size=VOCAB["llama2-7b"],
        hidden_size=4096,
        intermediate_size=11008,
        num_hidden_layers=32,
        num_attention_heads=32,
        num_key_value_heads=32,
        max_position_embeddings=4096,
    )
    with torch.device("cuda"):
        model = AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16, attn_implementation="sdpa").eval()
    out = {"version": transformers.__version__}
    for name, p, m in (("128/128", 128, 128), ("512/256", 512, 256)):
        n = args.hf_requests
        g = torch.Generator().manual_seed(1)
        reqs = [torch.randint(3, VOCAB["llama2-7b"], (p,), generator=g).tolist() for _ in range(n)]
        gen_cfg = GenerationConfig(max_new_tokens=m, do_sample=False, eos_token_id=None, pad_token_id=0)
        model.generate_batch(reqs[:4], generation_config=gen_cfg, progress_bar=False)  # warm-up
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        res = model.generate_batch(reqs, generation_config=gen_cfg, progress_bar=False)
        torch.cuda.synchronize()
        wall = time.perf_counter() - t0
        toks = sum(len(r.generated_tokens) for r in res.values())
        out[name] = {"requests": n, "tok_per_s": toks / wall, "wall_s": wall, "output_tokens": toks}
    del model
    torch.cuda.empty_cache()
    return out


async def _client(url: str, reqs, conc: int, seconds: float) -> dict:
    import httpx

    ttft, itl, toks, errors = [], [], 0, {}
    deadline = time.perf_counter() + seconds
    t_first = time.perf_counter()
    t_last = t_first
    async with httpx.AsyncClient(timeout=600, limits=httpx.Limits(max_connections=conc)) as c:

        async def worker(w: int):
            nonlocal toks, t_last
            i = w
            while time.perf_counter() < deadline:
                ids, m = reqs[i % len(reqs)]
                i += conc
                body = {"prompt": ids, "max_tokens": m, "temperature": 0, "stream": True}
                t0 = prev = time.perf_counter()
                got = 0
                try:
                    async with c.stream("POST", url + "/v1/completions", json=body) as r:
                        if r.status_code != 200:
                            body = (await r.aread()).decode(errors="replace")[:120]
                            key = f"HTTP {r.status_code}: {body}"
                            errors[key] = errors.get(key, 0) + 1
                            continue
                        async for line in r.aiter_lines():
                            if not line.startswith("data: ") or line == "data: [DONE]":
                                continue
                            k = len(json.loads(line[6:])["choices"][0]["token_ids"])
                            if not k:
                                continue
                            now = time.perf_counter()
                            if got == 0:
                                ttft.append(now - t0)
                            else:
                                itl.extend([(now - prev) / k] * k)
                            got += k
                            prev = now
                except httpx.HTTPError as e:
                    key = f"{type(e).__name__}: {e}"[:160]
                    errors[key] = errors.get(key, 0) + 1
                toks += got
                t_last = max(t_last, time.perf_counter())

        await asyncio.gather(*(worker(w) for w in range(conc)))
    return {"ttft": ttft, "itl": itl, "tokens": toks, "errors": errors, "t0": t_first, "t1": t_last}


def _client_proc(a):
    url, reqs, conc, seconds, core = a
    if core is not None:
        os.sched_setaffinity(0, {core})
    return asyncio.run(_client(url, reqs, conc, seconds))


def load_point(url, reqs, conc, seconds, procs) -> dict:
    import concurrent.futures as cf
    import multiprocessing as mp

    procs = max(1, min(procs, conc))
    cores = sorted(os.sched_getaffinity(0))
    per = [conc // procs + (i < conc % procs) for i in range(procs)]
    parts_args = [
        (url, reqs[i::procs], per[i], seconds, cores[-1 - i] if len(cores) > procs + 4 else None) for i in range(procs)
    ]
    with cf.ProcessPoolExecutor(procs, mp_context=mp.get_context("spawn")) as ex:
        parts = list(ex.map(_client_proc, parts_args))
    wall = max(p["t1"] for p in parts) - min(p["t0"] for p in parts)
    ttft = np.array([x for p in parts for x in p["ttft"]]) * 1e3
    itl = np.array([x for p in parts for x in p["itl"]]) * 1e3

    def pct(a, q):
        return float(np.percentile(a, q)) if len(a) else None

    return {
        "clients": conc,
        "output_tok_per_s": sum(p["tokens"] for p in parts) / wall,
        "wall_s": wall,
        "requests": len(ttft),
        "errors": sum(sum(p["errors"].values()) for p in parts),
        "error_kinds": {k: sum(p["errors"].get(k, 0) for p in parts) for k in {k for p in parts for k in p["errors"]}},
        "ttft_ms_p50": pct(ttft, 50),
        "ttft_ms_p99": pct(ttft, 99),
        "itl_ms_p50": pct(itl, 50),
        "itl_ms_p99": pct(itl, 99),
    }


def start_server(args, rows: int, seq: int, port: int):
    cmd = [
        sys.executable,
        "-m",
        "fullthrottle.cli",
        "serve",
        "--no-classify",
        "--llm-random",
        args.shape,
        "--llm-max-batch",
        str(rows),
        "--llm-max-seq-len",
        str(seq),
        "--llm-kv-pages",
        str(args.kv_pages),
        "--llm-kv-dtype",
        args.kv_dtype.split(",")[-1],
        "--device",
        args.device,
        "--port",
        str(port),
        "--max-queue",
        "1024",
        "--max-connections-per-client",  # every client process is 127.0.0.1: the default 64 would cap it
        "4096",
        *args.server_args.split(),
    ]
    t0 = time.perf_counter()
    p = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    if wait_ready(f"http://127.0.0.1:{port}/readyz", p, 300, every_s=1.0):
        return p, time.perf_counter() - t0, cmd
    if p.poll() is not None:
        raise RuntimeError(f"server exited: {p.stderr.read()[-2000:]}")
    p.kill()
    raise RuntimeError("server did not become ready")


def online(args, res: dict) -> None:
    """The online sets into ``res["online"]``; ``res`` is written to ``args.out`` after each point, so
    that a run cut short keeps what it measured."""
    out = res["online"] = {}
    for kind, rows, seq in (("fixed", args.rows, 256), ("mixed", args.mixed_rows, 2560)):
        port = free_port()
        p, ready_s, cmd = start_server(args, rows, seq, port)
        url = f"http://127.0.0.1:{port}"
        try:
            reqs = requests_of(kind, 4096, VOCAB[args.shape])
            load_point(url, reqs[:8], 4, 3, 1)  # warm-up
            pts = []
            out[kind] = {
                "server": " ".join(cmd[1:]),
                "rows": rows,
                "max_seq_len": seq,
                "ready_s": ready_s,
                "points": pts,
            }
            for conc in [int(c) for c in args.concurrency.split(",")]:
                c0, t0 = cpu_s(p.pid), time.perf_counter()
                pts.append(load_point(url, reqs, conc, args.seconds, args.client_procs))
                c1 = cpu_s(p.pid)  # the server process's cores over the point (its event loop and engine thread)
                pts[-1]["server_cores"] = (c1 - c0) / (time.perf_counter() - t0) if c0 is not None and c1 else None
                print(kind, pts[-1], flush=True)
                write_json(args.out, res)
        finally:
            p.terminate()
            p.wait(60)


def merge(offline_json: str, online_json: str, out: str) -> None:
    """The offline part of one result file and the online part of another, run on one machine, as one."""
    a, b = (json.loads(Path(f).read_text()) for f in (offline_json, online_json))
    if a["machine"]["gpu"] != b["machine"]["gpu"] or a["machine"]["host"] != b["machine"]["host"]:
        raise SystemExit(f"not one machine: {a['machine']['gpu']} and {b['machine']['gpu']}")
    res = {k: a[k] for k in ("benchmark", "machine", "model")}
    res.update(command=" ; ".join((a["command"], b["command"])), args={"offline": a["args"], "online": b["args"]})
    res.update(offline=a["offline"], online=b["online"], online_machine=b["machine"])
    write_json(out, res)


def main():
    args = parse_args(__doc__)
    if args.merge:
        return merge(*args.merge, out=args.out)
    res = {
        "benchmark": "llm_serve",
        "machine": machine_info(),
        "model": f"{args.shape} shape, random weights",
        "command": " ".join(sys.argv),
        "args": vars(args),
    }
    if "offline" in args.parts and "online" in args.parts:  # offline in a process of its own: its memory goes
        part = Path(args.out).with_suffix(".offline.json")
        argv = [a for a in sys.argv[1:]]
        subprocess.run([sys.executable, __file__, *argv, "--parts", "offline", "--out", str(part)], check=True)
        res["offline"] = json.loads(part.read_text())["offline"]
        part.unlink()
    elif "offline" in args.parts:
        res["offline"] = offline(args)
    if "offline" in res:  # (written once something is measured: a run that fails first leaves --out as it was)
        write_json(args.out, res)
    if "online" in args.parts:
        online(args, res)


if __name__ == "__main__":
    main()
