"""Where the product API loses to a raw graph replay at large batches (issue 02), measured in one run.

At bs 512/1024 the Engine fed from pinned uint8 ran 3.7% under a raw replay of the same model
(bench/results/graphs_resnet18.json). This probe times, interleaved round by round so that clock
drift hits every variant alike (CUDA events, median of rounds):

  raw          the model graph alone on a device-resident bf16 channels_last input
  product      the Engine's graph alone (normalise from uint8 + model + softmax + top-5)
  product_addcmul  the same with normalise as torch.addcmul (FULLTHROTTLE_TRITON=0), not Triton
  +copy        the same through GraphRunner.replay (device copy into the static input first)
  +h2d         + the pinned uint8 batch copied H2D on a copy stream, ordered by an event (3 slots)
  engine       Engine.submit/collect as bench/graphs.py drives it (wall clock)

Usage: python bench/probes/graphs_overhead_probe.py --out graphs_overhead_probe.json
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

import torch
import torchvision

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # bench/: common.py
from common import capture_graph, engine_ring_loop, events_time, machine_info, write_json  # noqa: E402


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default="graphs_overhead_probe.json")
    ap.add_argument("--batches", default="512,1024")
    ap.add_argument("--rounds", type=int, default=5)
    args = ap.parse_args()
    from fullthrottle import Config
    from fullthrottle.workloads.classify.compute import Engine

    torch.manual_seed(0)
    model = torchvision.models.resnet18().eval().cuda().to(torch.bfloat16).to(memory_format=torch.channels_last)
    result = {"benchmark": "graphs_overhead_probe", "machine": machine_info(), "rows": []}
    for bs in [int(b) for b in args.batches.split(",")]:
        iters = max(8, 20_000 // bs)
        with torch.inference_mode():
            x = torch.randn(bs, 3, 224, 224, device="cuda", dtype=torch.bfloat16).contiguous(
                memory_format=torch.channels_last
            )
            g_raw = capture_graph(lambda: model(x))
        eng = Engine(
            Config(
                model=model,
                device="cuda",
                dtype="bfloat16",
                channels_last=True,
                graphs=True,
                max_batch_size=bs,
                buckets=(bs,),
                staging_slots=3,
            )
        )
        print(eng.runner.info.format(), flush=True)
        g_prod, _ = eng.runner.graphs[bs]
        os.environ["FULLTHROTTLE_TRITON"] = "0"  # the same Engine with normalise as torch.addcmul
        eng_addcmul = Engine(
            Config(
                model=model,
                device="cuda",
                dtype="bfloat16",
                channels_last=True,
                graphs=True,
                max_batch_size=bs,
                buckets=(bs,),
                staging_slots=2,
            )
        )
        os.environ.pop("FULLTHROTTLE_TRITON")
        g_addcmul, _ = eng_addcmul.runner.graphs[bs]
        u8 = torch.randint(0, 256, (bs, 224, 224, 3), dtype=torch.uint8, device="cuda")
        for slot in eng.slots:
            slot.host_in.copy_(torch.randint(0, 256, slot.host_in.shape, dtype=torch.uint8))
        copy_stream = torch.cuda.Stream()
        copied = [torch.cuda.Event() for _ in eng.slots]
        consumed = [torch.cuda.Event() for _ in eng.slots]
        state = {"i": 0}

        def with_h2d():
            i = state["i"] = (state["i"] + 1) % len(eng.slots)
            slot = eng.slots[i]
            with torch.cuda.stream(copy_stream):
                copy_stream.wait_event(consumed[i])  # the slot's previous batch has been read
                slot.dev_in[:bs].copy_(slot.host_in[:bs], non_blocking=True)
                copied[i].record(copy_stream)
            torch.cuda.current_stream().wait_event(copied[i])
            eng.runner.replay(slot.dev_in[:bs])
            consumed[i].record()

        def engine_loop():
            engine_ring_loop(eng, bs, iters)

        variants = {
            "raw": lambda: g_raw.replay(),
            "product": lambda: g_prod.replay(),
            "product_addcmul": lambda: g_addcmul.replay(),
            "+copy": lambda: eng.runner.replay(u8),
            "+h2d": with_h2d,
        }
        times = {k: [] for k in [*variants, "engine"]}
        with torch.inference_mode():
            for v in variants.values():  # warm-up
                events_time(v, 3)
            engine_loop()
            for _ in range(args.rounds):
                for k, v in variants.items():
                    times[k].append(events_time(v, iters))
                torch.cuda.synchronize()
                t = time.perf_counter()
                engine_loop()
                times["engine"].append((time.perf_counter() - t) / iters)
        row = {"batch": bs, "iters": iters}
        for k, ts in times.items():
            row[f"{k}_img_per_s"] = bs / statistics.median(ts)
            row[f"{k}_ms"] = 1e3 * statistics.median(ts)
        print(row, flush=True)
        result["rows"].append(row)
        del eng, eng_addcmul, g_raw, g_prod, g_addcmul
        torch.cuda.empty_cache()
    write_json(args.out, result)


if __name__ == "__main__":
    main()
