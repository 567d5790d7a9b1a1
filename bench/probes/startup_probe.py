"""Where the classify CLI's start-up goes (issue 10: on 40k files, 30-40 s of each CLI run came before
the first image): ``import`` of the package in a fresh interpreter, then ``Pipeline(cfg)`` with its
phases timed (model load, graph capture, waiting for the CPU and the GPU decoder processes, which
start in the background meanwhile) and under cProfile, the first result and the whole run on
``--n`` files, and ``close()``. Per ``--models`` (comma list; a model named twice shows the second
build, with Triton's kernels compiled), default CLI settings on CUDA.

Usage: python bench/probes/startup_probe.py --folder /tmp/ft-files/640x480 --out probe.json
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # bench/: common.py
from common import machine_info, write_json  # noqa: E402


def import_s(stmt: str) -> float:
    t0 = time.perf_counter()
    subprocess.run([sys.executable, "-c", stmt], check=True)
    return time.perf_counter() - t0


def top_functions(prof: cProfile.Profile, n: int = 40) -> list[dict]:
    st = pstats.Stats(prof)
    rows = []
    for (file, line, name), (_cc, nc, _tt, ct, _callers) in st.stats.items():
        if "fullthrottle" in file or name in ("_capture", "capture", "load_state_dict", "cuda_graph"):
            rows.append({"function": f"{Path(file).name}:{line}:{name}", "calls": nc, "cum_s": round(ct, 3)})
    return sorted(rows, key=lambda r: -r["cum_s"])[:n]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--folder", required=True)
    ap.add_argument("--n", type=int, default=4000)
    ap.add_argument("--models", default="efficientnet_lite0,efficientnet_lite0,resnet18")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--out", default="startup_probe.json")
    args = ap.parse_args()
    rows = {
        "import_torch_s": import_s("import torch"),
        "import_cli_s": import_s("import fullthrottle.cli"),
        "device_init_s": import_s(f"import torch; torch.zeros(1, device='{args.device}')"),
    }
    print(rows, flush=True)

    import fullthrottle.data.gpu_decode_procs as gdp
    import fullthrottle.data.preprocess_procs as pp
    import fullthrottle.workloads.classify.compute as comp
    from fullthrottle.core.config import Config, resolve_dtype
    from fullthrottle.workloads.classify.pipeline import Pipeline

    phases: dict[str, float] = {}

    def timed(cls, name, label):  # the probe's own wrapper: how long each phase holds the main thread
        real = getattr(cls, name)

        def wrapper(self, *a, **k):
            t0 = time.perf_counter()
            try:
                return real(self, *a, **k)
            finally:
                phases[label] = phases.get(label, 0.0) + time.perf_counter() - t0

        setattr(cls, name, wrapper)

    timed(comp.Engine, "__init__", "engine_build_s")
    timed(comp.Engine, "capture", "graph_capture_s")
    timed(pp.DecoderPool, "wait_ready", "wait_cpu_decoders_s")
    timed(gdp.GpuDecoderPool, "wait_ready", "wait_gpu_decoders_s")
    paths = sorted(str(p) for p in Path(args.folder).glob("*.jpg"))[: args.n]
    runs = []
    for model in args.models.split(","):
        phases.clear()
        cfg = Config(model=model, device=args.device, dtype=resolve_dtype(None, args.device))  # the CLI's defaults
        prof = cProfile.Profile()
        t0 = time.perf_counter()
        prof.enable()
        pipe = Pipeline(cfg)
        prof.disable()
        build = time.perf_counter() - t0
        t0 = time.perf_counter()
        first = None
        n = 0
        for _r in pipe.run(paths):
            n += 1
            if first is None:
                first = time.perf_counter() - t0
        total = time.perf_counter() - t0
        t0 = time.perf_counter()
        pipe.close()
        row = {
            "model": model,
            "pipeline_build_s": build,
            **dict(phases),
            "first_result_s": first,
            "run_s": total,
            "images": n,
            "img_per_s": n / total,
            "close_s": time.perf_counter() - t0,
            "top": top_functions(prof),
        }
        print({k: v for k, v in row.items() if k != "top"}, flush=True)
        for t in row["top"][:25]:
            print("  ", t, flush=True)
        runs.append(row)
    write_json(args.out, {"benchmark": "startup_probe", "machine": machine_info(), **rows, "runs": runs})


if __name__ == "__main__":
    main()
