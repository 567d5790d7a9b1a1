"""End to end with CPU decoding: JPEG bytes in memory -> top-5, fullthrottle vs torch DataLoader.

Same images, same model (ResNet18, bf16, channels_last, eager), same run:
  (a) DataLoader, N workers, pin_memory=True, PIL decode + torchvision v2 Resize(256)+CenterCrop(224)
      (what most users write), normalisation and model on the GPU, top-5 copied back each batch;
  (b) fullthrottle's pipeline (decoder processes running OpenCV into a shared pinned crop pool,
      dynamic batching, CUDA graphs).

Rates are steady-state: the first quarter of the items (which DataLoader prefetching can swallow
before the clock starts) is excluded, clocks read after the CUDA work of each batch is synchronised.

Usage: python bench/e2e_cpu_decode.py --out bench/probes/results/e2e_cpu_decode.json [--n 30000] [--images 640x480|mixed]
"""

from __future__ import annotations

import argparse
import io
import os
import sys
import threading
import time
from pathlib import Path

import torch

from fullthrottle.workloads.classify.transform import TORCHVISION_IMAGENET

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # bench/: common.py
from common import jpegs_640x480, machine_info, mps_clients, mps_pipe_listing, mps_servers, sample_jpegs, write_json  # noqa: E402

PY_SPY_S = 3.0  # seconds py-spy records (--py-spy-s)

MEAN = torch.tensor(TORCHVISION_IMAGENET.mean).view(1, 3, 1, 1) * 255  # (the baselines run a ResNet18)
STD = torch.tensor(TORCHVISION_IMAGENET.std).view(1, 3, 1, 1) * 255


class BytesDataset(torch.utils.data.Dataset):
    def __init__(self, blobs, n):
        self.blobs, self.n = blobs, n

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        from PIL import Image
        from torchvision.transforms import v2

        img = Image.open(io.BytesIO(self.blobs[i % len(self.blobs)])).convert("RGB")
        tf = v2.Compose([v2.Resize(256, antialias=True), v2.CenterCrop(224), v2.PILToTensor()])
        return tf(img)  # (3,224,224) uint8


def run_dataloader(blobs, n, workers, batch, model, warm_frac=0.25):
    dl = torch.utils.data.DataLoader(
        BytesDataset(blobs, n), batch_size=batch, num_workers=workers, pin_memory=True, shuffle=False
    )
    mean, std = MEAN.cuda(), STD.cuda()
    seen, t_warm, n_warm = 0, None, 0
    with torch.inference_mode():
        for x in dl:
            x = x.cuda(non_blocking=True)
            x = ((x.float() - mean) / std).to(torch.bfloat16).contiguous(memory_format=torch.channels_last)
            v, i = torch.softmax(model(x).float(), -1).topk(5)
            v.cpu(), i.cpu()  # synchronises: results are on the host
            seen += len(x)
            if t_warm is None and seen >= warm_frac * n:
                t_warm, n_warm = time.perf_counter(), seen
    t_end = time.perf_counter()
    return {
        "images": seen,
        "steady_images": seen - n_warm,
        "steady_s": t_end - t_warm,
        "img_per_s": (seen - n_warm) / (t_end - t_warm),
    }


def _cpu_s(pid: int) -> float:
    """CPU seconds (user + system) process ``pid`` has used so far (Linux /proc), 0.0 if unreadable."""
    try:
        fields = open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    except (OSError, IndexError, ValueError):
        return 0.0


def _threads_cpu_s() -> dict:
    """CPU seconds per thread of this process, keyed by Python thread name (grouped: ``name-3`` ->
    ``name``); threads Python did not start (CUDA, OpenMP, executors' natives) under ``other``."""
    names = {t.native_id: t.name.rstrip("0123456789").rstrip("-_") for t in threading.enumerate()}
    out: dict = {}
    for tid in os.listdir("/proc/self/task"):
        c = _cpu_s(f"self/task/{tid}")
        key = names.get(int(tid), "other")
        out[key] = out.get(key, 0.0) + c
    return out


def _worker_stats(folder: str) -> dict | None:
    """The decoder processes' own time split (preprocess_procs.STATS_ENV files), summed over workers:
    per image in ms (wall: blocked in recv, preprocess, pool write, send; CPU: preprocess, whole
    process), page faults and context switches per image."""
    import glob
    import json
    import shutil

    tot: dict = {}
    files = glob.glob(os.path.join(folder, "*.json"))
    for f in files:
        for k, v in json.load(open(f)).items():
            tot[k] = tot.get(k, 0) + v
    shutil.rmtree(folder, ignore_errors=True)
    n = tot.get("images", 0)
    if not n:
        return None
    return {
        "workers": len(files),
        "images": n,
        **{k.replace("_s", "_ms_per_image"): 1e3 * v / n for k, v in tot.items() if k.endswith("_s")},
        **{f"{k}_per_image": v / n for k, v in tot.items() if not k.endswith("_s") and k != "images"},
    }


def run_fullthrottle(
    blobs,
    n,
    threads,
    batch,
    graphs=True,
    max_wait_ms=5.0,
    gpu_decode=False,
    warm_frac=0.25,
    preprocess="auto",
    gpu_procs=2,
    worker_stats=False,
    gpu_decoder="auto",
    py_spy=None,
    max_in_flight=None,
):
    import tempfile

    import fullthrottle.data.preprocess_procs as pp
    from fullthrottle import Config, Pipeline

    stats_dir = tempfile.mkdtemp(prefix="ft-worker-stats-") if worker_stats else None
    if stats_dir:
        os.environ[pp.STATS_ENV] = os.path.join(stats_dir, "w")

    torch.manual_seed(0)
    mix = int(gpu_decoder.split(":")[1]) if gpu_decoder.startswith("mix:") else None  # hardware processes
    pipe = Pipeline(
        Config(
            model="resnet18",
            device="cuda",
            dtype="bfloat16",
            channels_last=True,
            max_batch_size=batch,
            threads=threads,
            max_wait_ms=max_wait_ms,
            graphs=graphs,
            gpu_decode=gpu_decode,
            preprocess=preprocess,
            gpu_decode_processes=gpu_procs,
            gpu_decoder="nvjpeg" if mix is not None else gpu_decoder,
            max_in_flight=max_in_flight,
        )
    )
    if mix is not None and pipe.gpu_decoders is not None:  # the same number of processes, mix of two kinds
        from fullthrottle.data.gpu_decode_procs import GpuDecoderPool

        cfg = pipe.config
        pipe.gpu_decoders.close()
        pipe.gpu_decoders = GpuDecoderPool(
            cfg.gpu_decode_processes,
            pipe.decoders.crops,
            0,
            cfg.resize_size,
            cfg.crop_size,
            cfg.max_image_pixels,
            decoder=["hardware"] * mix + ["nvjpeg"] * (cfg.gpu_decode_processes - mix),
        )
    list(pipe.run([blobs[i % len(blobs)] for i in range(2000)]))  # warm-up (cuDNN autotune, pools)
    seen, t_warm, n_warm = 0, None, 0
    inputs = (blobs[i % len(blobs)] for i in range(n))
    pids = [w.proc.pid for w in pipe.decoders.workers] if pipe.decoders is not None else []
    gws = list(pipe.gpu_decoders.workers) if pipe.gpu_decoders is not None else []
    times0 = [dict(w.times) for w in gws]
    gpids = [w.proc.pid for w in gws]
    gcpu0 = 0.0
    cpu0 = main0 = 0.0
    cpu = None
    for r in pipe.run(inputs):
        assert r.ok, r.error
        seen += 1
        if t_warm is None and seen >= warm_frac * n:
            t_warm, n_warm = time.perf_counter(), seen
            if py_spy:  # sample the threads holding the GIL, without pausing the process
                import shutil
                import subprocess

                exe = shutil.which("py-spy") or os.path.join(os.path.dirname(sys.executable), "py-spy")
                os.makedirs(os.path.dirname(os.path.abspath(py_spy)), exist_ok=True)
                subprocess.Popen(
                    [
                        exe,
                        "record",
                        "--gil",
                        "--nonblocking",
                        "-r",
                        "250",
                        "-d",
                        str(max(1, round(PY_SPY_S))),
                        "-f",
                        "raw",
                        "-p",
                        str(os.getpid()),
                        "-o",
                        py_spy,
                    ],
                    stdout=subprocess.DEVNULL,
                    stderr=open(py_spy + ".log", "w"),
                )  # (why it wrote nothing, if so)
            cpu0, main0, thr0 = sum(map(_cpu_s, pids)), time.process_time(), _threads_cpu_s()
            gcpu0 = sum(map(_cpu_s, gpids))
        if cpu is None and seen >= 0.85 * n:  # CPU use measured while every stage's thread still runs
            # (at 95% the dispatcher and GPU feeders could be done: their threads' CPU dropped out)
            cpu = (
                time.perf_counter() - t_warm,
                sum(map(_cpu_s, pids)),
                time.process_time(),
                _threads_cpu_s(),
                sum(map(_cpu_s, gpids)),
            )
    t_end = time.perf_counter()
    # how busy the decoder processes really were (CPU time, not time with an image out), and how
    # many cores the main process (and each of its threads) used: a starved worker shows up here,
    # not in the stage's busy %
    window, cpu1, main1, thr1, gcpu1 = cpu
    # GPU decoder processes: where a batch's round trip went (whole run, warm-up excluded)
    gsum = {
        k: sum(w.times[k] - t0[k] for w, t0 in zip(gws, times0))
        for k in ("round_trip_s", "launch_s", "total_s", "batches")
    }
    gpu_procs_timing = None
    if gsum["batches"]:
        gpu_procs_timing = {
            "batches": gsum["batches"],
            "round_trip_ms_mean": 1e3 * gsum["round_trip_s"] / gsum["batches"],
            "in_process_ms_mean": 1e3 * gsum["total_s"] / gsum["batches"],
            "launch_ms_mean": 1e3 * gsum["launch_s"] / gsum["batches"],
            "in_process_share_of_round_trip": gsum["total_s"] / gsum["round_trip_s"] if gsum["round_trip_s"] else None,
            "cpu_pct_per_process": 100 * (gcpu1 - gcpu0) / (window * len(gpids)),
        }
    workers_cpu_pct = 100 * (cpu1 - cpu0) / (window * len(pids)) if pids else None
    main_cores = (main1 - main0) / window
    main_threads = {k: round((v - thr0.get(k, 0.0)) / window, 3) for k, v in sorted(thr1.items())}
    os.environ.pop(pp.STATS_ENV, None)
    rep = pipe.last_report
    eng = pipe.engine
    n_procs = len(pipe.decoders) if pipe.decoders is not None else 0
    pinned = pipe.decoders.crops.pinned if pipe.decoders is not None else None
    gpu_kind = (gpu_decoder if mix is not None else eng.gpu_decoder.kind) if eng.gpu_decoder is not None else None
    n_disp = sum(t.name.startswith("ft-preprocess-dispatch") for t in pipe.current_run.threads)
    mapped = eng.mapped_crops is not None
    n_gpu = len(pipe.gpu_decoders) if pipe.gpu_decoders is not None else 0
    pipe.close()
    worker_split = _worker_stats(stats_dir) if stats_dir else None
    return {
        "threads": threads,
        "preprocess": preprocess,
        "decoder_processes": n_procs,
        "worker_nice": pp.WORKER_NICE,
        "worker_time_split": worker_split,
        "decoder_processes_cpu_pct": workers_cpu_pct,
        "main_process_cores": main_cores,
        "main_process_cores_by_thread": main_threads,
        "dispatch_threads": n_disp,
        "crop_pool_pinned": pinned,
        "max_in_flight": pipe.config.in_flight_limit,
        "crop_pool_rows": pipe.decoders.crops.rows if pipe.decoders is not None else None,
        "graphs": graphs,
        "max_wait_ms": max_wait_ms,
        "gpu_decode": gpu_decode,
        "gpu_decode_processes": n_gpu if gpu_decode and n_procs else 0,
        "gpu_decode_processes_asked": "auto" if gpu_procs is None else gpu_procs,
        "gpu_decoder": gpu_kind,
        "gpu_decode_summary": rep.gpu_decode,
        "gpu_decoder_processes_timing": gpu_procs_timing,
        "gpu_share": eng.splitter.routed_gpu_share if gpu_decode else 0.0,
        "gpu_util_mean_pct": rep.gpu_util_pct,
        "verdict": rep.verdict,
        "switch_interval_s": sys.getswitchinterval(),
        "compute_staging_s": eng.staging_s,
        "compute_launch_s": eng.launch_s,
        "compute_pool_copies_per_batch": (eng.pool.copies if eng.pool else 0) / max(1, eng.batches),
        "images": seen,
        "steady_images": seen - n_warm,
        "steady_s": t_end - t_warm,
        "img_per_s": (seen - n_warm) / (t_end - t_warm),
        "whole_run_img_per_s": rep.images_per_s,
        "latency_p50_ms": rep.latency_ms(50),
        "latency_p99_ms": rep.latency_ms(99),
        "mean_batch_size": rep.mean_batch_size,
        "stages": rep.stages,
        "pool_gather": "mapped" if mapped else "copy",
    }


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--n", type=int, default=30000, help="images per measurement")
    ap.add_argument("--images", default="640x480", choices=("640x480", "mixed"))
    ap.add_argument("--workers", type=int, default=16, help="DataLoader workers")
    ap.add_argument(
        "--threads",
        type=int,
        default=None,
        help="fullthrottle preprocess threads (decoder processes); default: its own default "
        "(one per core but one with decoder processes)",
    )
    ap.add_argument("--batch", type=int, default=128)
    ap.add_argument("--ft-threads", default="", help="extra fullthrottle thread counts to try, e.g. 8,12")
    ap.add_argument("--gpu-decode", action="store_true", help="also run fullthrottle with GPU JPEG decoding")
    ap.add_argument(
        "--gpu-procs",
        default="2",
        help="GPU decoder processes to try with --gpu-decode, e.g. 0,2,4 "
        "(0: the GPU decode thread in the main process; auto: Config's default, 8 under a CUDA "
        "MPS server, else 6)",
    )
    ap.add_argument(
        "--gpu-decoders",
        default="auto",
        help="GPU JPEG decoders to try with --gpu-decode: "
        "hardware, nvjpeg, auto, or mix:N (N of the --gpu-procs processes on the hardware engines, "
        "the rest nvJPEG), comma-separated (each with every --gpu-procs value)",
    )
    ap.add_argument(
        "--nvimgcodec-threads",
        default="",
        help="nvImageCodec CPU threads per hardware decoder to "
        "try, comma-separated (FULLTHROTTLE_NVIMGCODEC_THREADS; empty: its default, one per core)",
    )
    ap.add_argument(
        "--nvimgcodec-backends",
        default="",
        help="with the hardware decoder: nvImageCodec backend mixes to try, comma-separated, each like "
        "hw:0.7+hybrid (FULLTHROTTLE_NVIMGCODEC_BACKENDS; empty: hw, the engines alone)",
    )
    ap.add_argument(
        "--gpu-switch-intervals",
        default="",
        help="with --gpu-decode: sys.setswitchinterval values (s) to try, e.g. 0.005,0.0005 (how long a "
        "thread waiting for the GIL lets another run before asking for it; Python's default 0.005)",
    )
    ap.add_argument(
        "--pool-gathers",
        default="",
        help="how the compute thread reads the crop pool, variants to try: mapped,copy "
        "(FULLTHROTTLE_POOL_GATHER; mapped: one gather kernel reading the pinned pool in place)",
    )
    ap.add_argument(
        "--max-in-flights",
        default="",
        help="with --gpu-decode: Config.max_in_flight values to try, e.g. 2080,3072 (default: the "
        "library's, (4 + 2 x GPU decoder processes) x batch + 2 x decoder processes)",
    )
    ap.add_argument(
        "--mps",
        action="store_true",
        help="run everything (baselines too) as clients of a CUDA MPS server this script starts "
        "(nvidia-cuda-mps-control -d, private pipe folder) and stops at the end",
    )
    ap.add_argument(
        "--baseline-n", type=int, default=None, help="images for the DataLoader and CPU-only runs (default: --n)"
    )
    ap.add_argument(
        "--py-spy",
        default="",
        help="folder: record the main process's GIL-holding stacks (py-spy --gil, --py-spy-s seconds) during the "
        "last GPU decode variant's steady part (list it twice to have one run without)",
    )
    ap.add_argument("--py-spy-s", type=float, default=3.0, help="with --py-spy: seconds to record")
    ap.add_argument("--skip-no-graphs", action="store_true", help="skip the graphs-off fullthrottle run")
    ap.add_argument(
        "--thread-decode",
        action="store_true",
        help="also run fullthrottle with decoding in threads (preprocess='threads')",
    )
    ap.add_argument("--ft-waits", default="", help="extra fullthrottle max_wait_ms values to try, e.g. 50")
    ap.add_argument(
        "--worker-stats",
        action="store_true",
        help="decoder processes report where their "
        "time went (recv wait, preprocess wall/CPU, pool write, send; faults, switches)",
    )
    ap.add_argument(
        "--switch-interval", type=float, default=0.0, help="also try fullthrottle with this sys.setswitchinterval (s)"
    )
    ap.add_argument("--out", default="bench/probes/results/e2e_cpu_decode.json")
    args = ap.parse_args()
    with mps_clients(args.mps) as mps:  # before this process's first CUDA call
        run(args, mps)


def run(args, mps) -> None:
    from fullthrottle.core.mps import mps_server_running

    global PY_SPY_S
    PY_SPY_S = args.py_spy_s
    if not torch.cuda.is_available():
        sys.exit("needs CUDA")
    import torchvision

    blobs = jpegs_640x480() if args.images == "640x480" else sample_jpegs()
    torch.manual_seed(0)
    model = torchvision.models.resnet18().eval().cuda().to(torch.bfloat16).to(memory_format=torch.channels_last)
    with torch.inference_mode():
        for _ in range(3):
            model(torch.randn(args.batch, 3, 224, 224, device="cuda", dtype=torch.bfloat16))
    print("DataLoader + PIL ...", flush=True)
    nb = args.baseline_n or args.n
    dl = run_dataloader(blobs, nb, args.workers, args.batch, model)
    print(dl, flush=True)
    print("fullthrottle ...", flush=True)
    ft = run_fullthrottle(blobs, nb, args.threads, args.batch, worker_stats=args.worker_stats)
    print({k: v for k, v in ft.items() if k != "stages"}, flush=True)
    ft_eager = None
    if not args.skip_no_graphs:
        print("fullthrottle, graphs off ...", flush=True)
        ft_eager = run_fullthrottle(blobs, args.n, args.threads, args.batch, graphs=False)
        print({k: v for k, v in ft_eager.items() if k != "stages"}, flush=True)
    extra = []
    for t in [int(x) for x in args.ft_threads.split(",") if x]:
        print(f"fullthrottle, {t} threads ...", flush=True)
        extra.append(run_fullthrottle(blobs, args.n, t, args.batch))
        print({k: v for k, v in extra[-1].items() if k != "stages"}, flush=True)
    if args.thread_decode:
        print("fullthrottle, decoding in threads ...", flush=True)
        extra.append(run_fullthrottle(blobs, args.n, args.threads, args.batch, preprocess="threads"))
        print({k: v for k, v in extra[-1].items() if k != "stages"}, flush=True)
    from fullthrottle.data.device_copy import POOL_GATHER_ENV

    variants = (
        [
            (kind, t, b, g, si, pg, mf)
            for kind in args.gpu_decoders.split(",")
            if kind
            for t in (args.nvimgcodec_threads.split(",") if kind != "nvjpeg" else [""])
            for b in (args.nvimgcodec_backends.split(",") if kind != "nvjpeg" else [""])
            for g in [None if x == "auto" else int(x) for x in args.gpu_procs.split(",") if x]
            for si in ([float(x) for x in args.gpu_switch_intervals.split(",") if x] or [sys.getswitchinterval()])
            for pg in (args.pool_gathers.split(",") if args.pool_gathers else [""])
            for mf in ([int(x) for x in args.max_in_flights.split(",") if x] or [None])
        ]
        if args.gpu_decode
        else []
    )
    si0 = sys.getswitchinterval()
    env0 = {k: os.environ.get(k) for k in (POOL_GATHER_ENV,)}  # the caller's settings

    def set_env(name: str, value: str) -> None:  # a variant's value, or "": the caller's setting
        if value:
            os.environ[name] = value
        elif env0[name] is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = env0[name]

    for vi, (kind, t, b, g, si, pg, mf) in enumerate(variants):
        sys.setswitchinterval(si)
        set_env(POOL_GATHER_ENV, pg)
        os.environ["FULLTHROTTLE_NVIMGCODEC_THREADS"] = t  # nvImageCodec's CPU threads per decoder ("": one per core)
        os.environ["FULLTHROTTLE_NVIMGCODEC_BACKENDS"] = b  # its backends ("": the engines alone)
        print(
            f"fullthrottle, GPU decode ({kind}), {g} GPU decoder processes, nvImageCodec threads {t or 'default'} backends {b or 'hw'}, "
            f"switch interval {si * 1e3:g} ms, "
            f"pool gather {pg or 'default'}, max_in_flight {mf or 'default'} ...",
            flush=True,
        )
        try:
            last = vi == len(variants) - 1  # (py-spy's sampling costs some speed)
            spy = os.path.join(args.py_spy, f"py_spy_{len(extra)}_{kind}_{g}.raw") if args.py_spy and last else None
            extra.append(
                run_fullthrottle(
                    blobs,
                    args.n,
                    args.threads,
                    args.batch,
                    gpu_decode=True,
                    gpu_procs=g,
                    gpu_decoder=kind,
                    py_spy=spy,
                    max_in_flight=mf,
                )
            )
            extra[-1]["nvimgcodec_threads"] = t or "default"
            extra[-1]["nvimgcodec_backends"] = b or "hw"
        except Exception as e:  # noqa: BLE001 - one variant failing must not lose the others' figures
            print(f"  failed: {type(e).__name__}: {e}", flush=True)
            extra.append(
                {
                    "gpu_decode": True,
                    "gpu_decoder": kind,
                    "gpu_decode_processes": g,
                    "error": f"{type(e).__name__}: {e}"[:500],
                }
            )
            continue
        print({k: v for k, v in extra[-1].items() if k != "stages"}, flush=True)
    set_env(POOL_GATHER_ENV, "")
    os.environ.pop("FULLTHROTTLE_NVIMGCODEC_THREADS", None)
    os.environ.pop("FULLTHROTTLE_NVIMGCODEC_BACKENDS", None)
    sys.setswitchinterval(si0)
    for w in [float(x) for x in args.ft_waits.split(",") if x]:
        print(f"fullthrottle, max_wait_ms {w} ...", flush=True)
        extra.append(run_fullthrottle(blobs, args.n, args.threads, args.batch, max_wait_ms=w))
        print({k: v for k, v in extra[-1].items() if k != "stages"}, flush=True)
        extra.append(run_fullthrottle(blobs, args.n, args.threads, args.batch, graphs=False, max_wait_ms=w))
        print({k: v for k, v in extra[-1].items() if k != "stages"}, flush=True)
    if args.switch_interval:
        old = sys.getswitchinterval()
        sys.setswitchinterval(args.switch_interval)
        print(f"fullthrottle, switch interval {args.switch_interval} ...", flush=True)
        extra.append(run_fullthrottle(blobs, args.n, args.threads, args.batch))
        print({k: v for k, v in extra[-1].items() if k != "stages"}, flush=True)
        sys.setswitchinterval(old)
    payload = {
        "benchmark": "e2e_cpu_decode",
        "machine": machine_info(),
        "images": args.images,
        "n": args.n,
        "baseline_n": nb,
        "dataloader_workers": args.workers,
        "fullthrottle_threads": args.threads,
        "batch": args.batch,
        "model": "resnet18 bf16 channels_last eager, random weights",
        "baseline_dataloader_pil": dl,
        "fullthrottle": ft,
        "fullthrottle_no_graphs": ft_eager,
        "ratio_fullthrottle_over_dataloader": ft["img_per_s"] / dl["img_per_s"],
        "fullthrottle_variants": extra,
        "mps": None
        if mps is None
        else {
            "server_list_after_run": mps_servers(mps),
            "pipe_dir": mps_pipe_listing(),
            "library_sees_server": mps_server_running(),
        },
    }
    write_json(args.out, payload)
    print(
        f"fullthrottle {ft['img_per_s']:.0f} img/s vs DataLoader+PIL {dl['img_per_s']:.0f} img/s "
        f"= {payload['ratio_fullthrottle_over_dataloader']:.2f}x"
    )
    for v in extra:
        if v.get("gpu_decode") and "error" not in v:
            print(
                f"  GPU decode ({v['gpu_decoder']}, nvImageCodec threads {v.get('nvimgcodec_threads')}), "
                f"{v['gpu_decode_processes']} GPU decoder processes, "
                f"pool {v.get('pool_gather')}: "
                f"{v['img_per_s']:.0f} img/s, "
                f"{v['gpu_share']:.0%} of eligible JPEGs on the GPU, GPU busy {v['gpu_util_mean_pct']:.0f}%"
            )


if __name__ == "__main__":
    main()
