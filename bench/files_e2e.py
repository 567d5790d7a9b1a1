"""The main job as a user runs it: ``fullthrottle classify DIR`` on a folder of JPEG files read from
disk, against a hand-written PyTorch loop on the same files and machine, in one run.

The folder: ``--n`` distinct 640x480 JPEG files made from the 200 ImageNet samples (random crop of
60-100% of each side, random horizontal flip, resized to 640x480, JPEG quality 75-95; seeded), written
once by a process pool and then in the page cache. Ours: the CLI in a subprocess, wall clock from
start to exit (model load and graph capture included) and its own report (``--report-json``: img/s
over the run, GPU utilisation, stage busy %). Baseline: a ``Dataset`` reading each file with PIL,
torchvision v2 ``Resize(256) + CenterCrop(224)``, a ``DataLoader`` (``--workers``, pin_memory, batch
128), the same model eager in bf16 channels_last with the model's own normalisation, top-5 to the host.

Usage: python bench/files_e2e.py --n 60000 --out bench/results/files_e2e_efficientnet_lite0.json
"""

from __future__ import annotations

import argparse
import io
import json
import os
import random
import subprocess
import sys
import time
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import SAMPLES, machine_info, write_json  # noqa: E402


def _make(args) -> int:
    start, stop, folder = args
    from PIL import Image

    photos = [Image.open(p).convert("RGB") for p in sorted(SAMPLES.glob("*.JPEG"))]
    for i in range(start, stop):
        rng = random.Random(i)
        im = photos[i % len(photos)]
        w, h = im.size
        cw, ch = int(w * rng.uniform(0.6, 1.0)), int(h * rng.uniform(0.6, 1.0))
        x, y = rng.randint(0, w - cw), rng.randint(0, h - ch)
        out = im.crop((x, y, x + cw, y + ch)).resize((640, 480), Image.BILINEAR)
        if rng.random() < 0.5:
            out = out.transpose(Image.FLIP_LEFT_RIGHT)
        out.save(os.path.join(folder, f"{i:06d}.jpg"), quality=rng.randint(75, 95))
    return stop - start


def make_folder(folder: Path, n: int) -> float:
    """``n`` JPEG files in ``folder`` (kept when already complete); returns their total bytes."""
    folder.mkdir(parents=True, exist_ok=True)
    if len(list(folder.glob("*.jpg"))) != n:
        step = 500
        with ProcessPoolExecutor(os.cpu_count()) as ex:
            sum(ex.map(_make, [(s, min(s + step, n), str(folder)) for s in range(0, n, step)]))
    return sum(p.stat().st_size for p in folder.glob("*.jpg"))


def run_cli(folder: Path, extra: list[str], tmp: Path) -> dict:
    rep = tmp / "report.json"
    cmd = [sys.executable, "-m", "fullthrottle.cli", "classify", str(folder), "--device", "cuda",
           "--no-progress", "--out", str(tmp / "out.jsonl"), "--report-json", str(rep), *extra]
    t0 = time.perf_counter()
    p = subprocess.run(cmd, capture_output=True, text=True)
    wall = time.perf_counter() - t0
    r = json.loads(rep.read_text()) if rep.exists() else {}
    print(" ".join(cmd[2:]), "->", p.returncode, p.stderr[-1500:], flush=True)
    return {"command": "fullthrottle " + " ".join(cmd[3:]), "exit": p.returncode, "wall_s_with_startup": wall,
            "report": r, "stderr_tail": p.stderr[-3000:]}


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
    from fullthrottle.models import load_model, transform_of

    model, _ = load_model(model_name)
    t = transform_of(model_name)
    model = model.cuda().to(torch.bfloat16).to(memory_format=torch.channels_last)
    mean = torch.tensor(t.mean, device="cuda").view(1, 3, 1, 1) * 255
    std = torch.tensor(t.std, device="cuda").view(1, 3, 1, 1) * 255
    dl = torch.utils.data.DataLoader(Files(paths), batch_size=batch, num_workers=workers, pin_memory=True,
                                     persistent_workers=False, prefetch_factor=4)
    n, t0, t_warm, n_warm = 0, time.perf_counter(), None, 0
    with torch.inference_mode():
        for x in dl:
            x = ((x.cuda(non_blocking=True).float() - mean) / std).to(torch.bfloat16).contiguous(
                memory_format=torch.channels_last)
            model(x).float().softmax(-1).topk(5)[1].cpu()
            n += len(x)
            if t_warm is None and n >= len(paths) // 4:
                t_warm, n_warm = time.perf_counter(), n
    t1 = time.perf_counter()
    return {"images": n, "img_per_s_whole": n / (t1 - t0), "img_per_s_after_first_quarter": (n - n_warm) / (t1 - t_warm),
            "workers": workers, "batch": batch, "reader": "PIL + torchvision v2 Resize(256)+CenterCrop(224)",
            "model": f"{model_name} bf16 channels_last eager"}


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--n", type=int, default=60000)
    ap.add_argument("--folder", default="/tmp/ft-files-640x480")
    ap.add_argument("--model", default="efficientnet_lite0")
    ap.add_argument("--workers", type=int, default=os.cpu_count())
    ap.add_argument("--variants", default="gpu-decode,cpu-decode",
                    help="CLI runs: gpu-decode (--gpu-decode), cpu-decode (the default decode path)")
    ap.add_argument("--out", default="bench/results/files_e2e_efficientnet_lite0.json")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        sys.exit("needs CUDA")
    folder = Path(args.folder)
    t0 = time.perf_counter()
    size = make_folder(folder, args.n)
    print(f"{args.n} files, {size / 1e9:.2f} GB, made in {time.perf_counter() - t0:.0f} s", flush=True)
    paths = sorted(folder.glob("*.jpg"))
    tmp = Path(os.environ.get("TMPDIR", "/tmp")) / "ft-files-e2e"
    tmp.mkdir(exist_ok=True)
    payload = {"benchmark": "files_e2e", "machine": machine_info(),
               "inputs": f"{args.n} distinct 640x480 JPEG files ({size / 1e9:.2f} GB, page cache), "
                         "made from the 200 ImageNet samples (random crop, flip, quality 75-95)",
               "model": args.model, "runs": {}}
    payload["runs"]["dataloader_baseline"] = dataloader_loop(paths, args.model, args.workers)
    print("DataLoader:", payload["runs"]["dataloader_baseline"], flush=True)
    flags = {"gpu-decode": ["--gpu-decode"], "cpu-decode": []}
    for v in args.variants.split(","):
        payload["runs"][f"cli_{v}"] = run_cli(folder, ["--model", args.model, "--batch-size", "128", *flags[v]], tmp)
    write_json(args.out, payload)
    for k, r in payload["runs"].items():
        rate = r.get("img_per_s_after_first_quarter") or r.get("report", {}).get("images_per_s")
        print(f"{k:>24}: {rate or 0:.0f} img/s", flush=True)


if __name__ == "__main__":
    main()
