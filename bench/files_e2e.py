"""The main job as a user runs it: ``fullthrottle classify DIR`` on folders of JPEG files read from
disk, against a hand-written PyTorch loop on the same files and machine, in one run.

Folders (made once by a process pool, seeded, then in the page cache), ``--n`` distinct files each:

- ``640x480``: the 200 ImageNet samples, random crop of 60-100% of each side, random horizontal flip,
  resized to 640x480, JPEG quality 75-95;
- ``mixed``: the same crops scaled so that the longer side is 64 to 2000 px (uniform), quality 75-95.

Ours: the CLI in a subprocess, wall clock from start to exit (model load and graph capture included),
its own report (``--report-json``: img/s over the run, GPU utilisation, stage busy %, verdict) and the
main process's CPU use (``/proc/PID/stat`` sampled every 0.5 s: the busiest 5-s window, in cores,
start-up included; the report's ``main_process_cores`` covers the images' run alone) and resident memory.
Baseline: a ``Dataset`` reading each file with PIL, torchvision v2 ``Resize(256) + CenterCrop(224)``,
a ``DataLoader`` (``--workers``, pin_memory, batch 128), the same model eager in bf16 channels_last
with the model's own normalisation, top-5 to the host.

Usage: python bench/files_e2e.py --n 60000 --out bench/results/files_e2e.json
"""

from __future__ import annotations

import argparse
import io
import json
import os
import random
import re
import subprocess
import sys
import time
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import SAMPLES, cpu_by_pid, cpu_s, machine_info, processes_by_kind, rss_mib, write_json  # noqa: E402


def _make(args) -> int:
    start, stop, folder, kind = args
    from PIL import Image

    photos = [Image.open(p).convert("RGB") for p in sorted(SAMPLES.glob("*.JPEG"))]
    for i in range(start, stop):
        rng = random.Random(i)
        im = photos[i % len(photos)]
        w, h = im.size
        cw, ch = int(w * rng.uniform(0.6, 1.0)), int(h * rng.uniform(0.6, 1.0))
        x, y = rng.randint(0, w - cw), rng.randint(0, h - ch)
        if kind == "640x480":
            size = (640, 480)
        else:  # the longer side 64..2000 px, the aspect ratio of the crop
            k = rng.uniform(64, 2000) / max(cw, ch)
            size = (max(1, round(cw * k)), max(1, round(ch * k)))
        out = im.crop((x, y, x + cw, y + ch)).resize(size, Image.BILINEAR)
        if rng.random() < 0.5:
            out = out.transpose(Image.FLIP_LEFT_RIGHT)
        out.save(os.path.join(folder, f"{i:06d}.jpg"), quality=rng.randint(75, 95))
    return stop - start


def make_folder(folder: Path, n: int, kind: str) -> float:
    """``n`` JPEG files of ``kind`` in ``folder`` (kept when already complete); returns their total bytes."""
    folder.mkdir(parents=True, exist_ok=True)
    if len(list(folder.glob("*.jpg"))) != n:
        step = 500
        with ProcessPoolExecutor(os.cpu_count()) as ex:
            sum(ex.map(_make, [(s, min(s + step, n), str(folder), kind) for s in range(0, n, step)]))
    return sum(p.stat().st_size for p in folder.glob("*.jpg"))


def run_cli(folder: Path, extra: list[str], tmp: Path, repeat: int = 1) -> dict:
    """The CLI on ``folder`` (listed ``repeat`` times: each pass reads every file again). Leading
    ``NAME=VALUE`` words of ``extra`` set that environment variable for this run (``PYTHONPATH`` is
    prepended to the current one)."""
    env = dict(os.environ)
    prefix = ""
    while extra and re.match(r"[A-Z_][A-Z0-9_]*=", extra[0]):
        name, _, value = extra[0].partition("=")
        env[name] = value + os.pathsep + env.get(name, "") if name == "PYTHONPATH" else value
        prefix += extra[0] + " "
        extra = extra[1:]
    rep = tmp / "report.json"
    rep.unlink(missing_ok=True)
    cmd = [
        sys.executable,
        "-m",
        "fullthrottle.cli",
        "classify",
        *[str(folder)] * repeat,
        "--device",
        "cuda",
        "--no-progress",
        "--out",
        str(tmp / "out.jsonl"),
        "--report-json",
        str(rep),
        *extra,
    ]
    t0 = time.perf_counter()
    p = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, env=env)
    samples = []  # (seconds since start, CPU seconds of the main process)
    rss = []  # (seconds since start, resident MiB of the main process)
    flow = []  # (seconds since start, bytes of results written, {pid: (kind, CPU seconds)})
    procs = None  # the run's processes by kind, when the first results were written
    out_file = tmp / "out.jsonl"
    out_file.unlink(missing_ok=True)
    import threading

    err: list[str] = []
    reader = threading.Thread(target=lambda: err.append(p.stderr.read()), daemon=True)
    reader.start()
    while p.poll() is None:
        c = cpu_s(p.pid)
        if c is not None:
            samples.append((time.perf_counter() - t0, c))
        m = rss_mib(p.pid)
        if m is not None:
            rss.append((time.perf_counter() - t0, m))
        try:
            size = out_file.stat().st_size
        except OSError:
            size = 0
        flow.append((time.perf_counter() - t0, size, cpu_by_pid(p.pid, "main")))
        if size and procs is None:  # (once results flow: which processes the run has)
            procs = processes_by_kind(p.pid, "main")
        time.sleep(0.5)
    wall = time.perf_counter() - t0
    reader.join(10)
    stderr = err[0] if err else ""
    r = json.loads(rep.read_text()) if rep.exists() else {}
    peak = max(((c1 - c0) / (t1 - t0_) for (t0_, c0), (t1, c1) in zip(samples, samples[10:])), default=None)
    print(" ".join(cmd[3 + repeat :]), "x", repeat, "->", p.returncode, stderr[-1500:], flush=True)
    # resident memory once the images flow (a quarter into the run) against its peak after that
    quarter = [m for t, m in rss if t >= wall / 4]
    memory = {
        "rss_mib_at_quarter": quarter[0] if quarter else None,
        "rss_mib_max_after_quarter": max(quarter, default=None),
        "rss_mib_last": rss[-1][1] if rss else None,
        "rss_mib_series_every_5s": [(round(t, 1), round(m)) for t, m in rss[::10]],
    }
    # (the report's main_process_cores: the main process's CPU over the run itself, start-up excluded)
    return {
        "cores_by_kind_while_results_flow": cores_while_flowing(flow),
        "processes_by_kind_when_results_flow": procs,
        "command": prefix + "fullthrottle " + " ".join(cmd[3:])
        if repeat == 1
        else prefix + f"fullthrottle classify {folder} (listed {repeat} times) " + " ".join(cmd[4 + repeat :]),
        "main_process_memory": memory,
        "exit": p.returncode,
        "wall_s_with_startup": wall,
        "main_process_cores_peak_5s": peak,
        "report": r,
        "stderr_tail": stderr[-3000:],
    }


def cores_while_flowing(flow: list) -> dict | None:
    """Cores by kind of process (the CLI's main process, its GPU and CPU decoder processes) from the
    first sample with results written to the last before all of them were: the images' run,
    start-up and close left out. Counted per process: one that exits before that last sample
    (decoder processes closing while the last results are written) counts up to the last sample
    that saw it; one started after the first counts from its start. None when it spans fewer than
    two samples."""
    import collections

    if not flow:
        return None
    final = flow[-1][1]
    first = next((i for i, f in enumerate(flow) if f[1] > 0), None)
    last = max((i for i, f in enumerate(flow) if f[1] < final), default=None)
    if first is None or last is None or last <= first:
        return None
    seen = {}  # pid -> (kind, CPU seconds) at the last sample of the window that saw it
    for i in range(first + 1, last + 1):
        seen.update(flow[i][2])
    dt = flow[last][0] - flow[first][0]
    used: dict[str, float] = collections.Counter()
    for pid, (kind, c) in seen.items():
        if kind != "gone":
            used[kind] += c - flow[first][2].get(pid, (kind, 0.0))[1]
    return {"seconds": round(dt, 1)} | {k: round(v / dt, 2) for k, v in used.items()}


class Files(torch.utils.data.Dataset):
    def __init__(self, paths):
        from torchvision.transforms import v2

        self.paths = paths
        self.tf = v2.Compose([v2.Resize(256, antialias=True), v2.CenterCrop(224), v2.PILToTensor()])

    def __len__(self):
        return len(self.paths)

    def __getitem__(self, i):
        from PIL import Image

        with open(self.paths[i], "rb") as f:
            return self.tf(Image.open(io.BytesIO(f.read())).convert("RGB"))


def dataloader_loop(paths: list[Path], model_name: str, workers: int, batch: int = 128) -> dict:
    from fullthrottle.workloads.classify.models import load_model, transform_of

    model, _ = load_model(model_name)
    t = transform_of(model_name)
    model = model.cuda().to(torch.bfloat16).to(memory_format=torch.channels_last)
    mean = torch.tensor(t.mean, device="cuda").view(1, 3, 1, 1) * 255
    std = torch.tensor(t.std, device="cuda").view(1, 3, 1, 1) * 255
    dl = torch.utils.data.DataLoader(
        Files(paths),
        batch_size=batch,
        num_workers=workers,
        pin_memory=True,
        persistent_workers=False,
        prefetch_factor=4,
    )
    n, t0, t_warm, n_warm = 0, time.perf_counter(), None, 0
    with torch.inference_mode():
        for x in dl:
            x = (
                ((x.cuda(non_blocking=True).float() - mean) / std)
                .to(torch.bfloat16)
                .contiguous(memory_format=torch.channels_last)
            )
            model(x).float().softmax(-1).topk(5)[1].cpu()
            n += len(x)
            if t_warm is None and n >= len(paths) // 4:
                t_warm, n_warm = time.perf_counter(), n
    t1 = time.perf_counter()
    return {
        "images": n,
        "img_per_s_whole": n / (t1 - t0),
        "img_per_s_after_first_quarter": (n - n_warm) / (t1 - t_warm),
        "workers": workers,
        "batch": batch,
        "reader": "PIL + torchvision v2 Resize(256)+CenterCrop(224)",
        "model": f"{model_name} bf16 channels_last eager",
    }


#: the runs of record: (folder kind, "dataloader" or the CLI's arguments after the folder)
RUNS = {
    "dataloader_resnet18_640x480": ("640x480", "dataloader resnet18"),
    "cli_resnet18_640x480": ("640x480", "--model resnet18"),
    "cli_resnet18_640x480_no_mps": ("640x480", "--model resnet18 --no-mps"),
    "cli_resnet18_640x480_cpu_decode": ("640x480", "--model resnet18 --no-gpu-decode"),
    "dataloader_efficientnet_lite0_640x480": ("640x480", "dataloader efficientnet_lite0"),
    "cli_efficientnet_lite0_640x480": ("640x480", ""),
    "cli_resnet18_mixed": ("mixed", "--model resnet18"),
}


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--n", type=int, default=60000, help="files per folder")
    ap.add_argument("--folders", default="/tmp/ft-files", help="the folders are made under this one")
    ap.add_argument("--workers", type=int, default=os.cpu_count(), help="DataLoader workers")
    ap.add_argument("--runs", default=",".join(RUNS), help=f"which runs, in order: {', '.join(RUNS)}")
    ap.add_argument(
        "--try",
        dest="trials",
        action="append",
        default=[],
        metavar="ARGS",
        help="also run the CLI with these arguments on the --try-folder (a trial, named try_N; repeatable); "
        "leading NAME=VALUE words set that environment variable for the trial; a leading @FOLDER word "
        "(@mixed, @640x480) reads that folder instead",
    )
    ap.add_argument(
        "--try-folder", default="640x480", choices=("640x480", "mixed"), help="the folder the --try runs read"
    )
    ap.add_argument(
        "--soak",
        type=int,
        default=0,
        metavar="N",
        help="also run the CLI's defaults (ResNet18) on the 640x480 folder listed N times (each file read N "
        "times: 17 x 60,000 = 1.02M images), recording the main process's resident memory",
    )
    ap.add_argument("--out", default="bench/results/files_e2e.json")
    args = ap.parse_args()
    if args.soak:
        RUNS["soak_resnet18_640x480"] = ("640x480", "--model resnet18")
        args.runs += ",soak_resnet18_640x480"
    for i, extra in enumerate(args.trials):
        folder, _, rest = extra.partition(" ")
        if folder[1:] in ("640x480", "mixed") and folder.startswith("@"):
            RUNS[f"try_{i}"] = (folder[1:], rest)
        else:
            RUNS[f"try_{i}"] = (args.try_folder, extra)
        args.runs += f",try_{i}"
    if not torch.cuda.is_available():
        sys.exit("needs CUDA")
    runs = [r for r in args.runs.split(",") if r]
    unknown = [r for r in runs if r not in RUNS]
    if unknown:
        sys.exit(f"unknown runs {unknown}: choose from {list(RUNS)}")
    tmp = Path(os.environ.get("TMPDIR", "/tmp")) / "ft-files-e2e"
    tmp.mkdir(exist_ok=True)
    payload = {"benchmark": "files_e2e", "machine": machine_info(), "folders": {}, "runs": {}}
    for name in runs:
        kind, what = RUNS[name]
        folder = Path(args.folders) / kind
        if kind not in payload["folders"]:
            t0 = time.perf_counter()
            size = make_folder(folder, args.n, kind)
            payload["folders"][kind] = (
                f"{args.n} distinct JPEG files ({size / 1e9:.2f} GB, page cache), "
                f"{'640x480' if kind == '640x480' else 'longer side 64-2000 px'}, made "
                "from the 200 ImageNet samples (random crop, flip, quality 75-95)"
            )
            print(f"{kind}: {args.n} files, {size / 1e9:.2f} GB, made in {time.perf_counter() - t0:.0f} s", flush=True)
        if what.startswith("dataloader "):
            r = dataloader_loop(sorted(folder.glob("*.jpg")), what.split()[1], args.workers)
        else:
            r = run_cli(folder, what.split(), tmp, args.soak if name.startswith("soak_") else 1)
        payload["runs"][name] = {"folder": kind, **r}
        write_json(args.out, payload)  # after every run: a later one that fails leaves the earlier ones
        rep = r.get("report", {})
        rate = r.get("img_per_s_after_first_quarter") or rep.get("images_per_s")
        print(
            f"{name:>44}: {rate or 0:.0f} img/s  GPU {rep.get('gpu_util_mean_pct')}  "
            f"JPEG engines {rep.get('jpeg_engines_util_mean_pct')}  cores {r.get('cores_by_kind_while_results_flow')}  "
            f"main cores {rep.get('main_process_cores')} (peak 5 s with start-up {r.get('main_process_cores_peak_5s')})  "
            f"{rep.get('verdict', '')}",
            flush=True,
        )


if __name__ == "__main__":
    main()
