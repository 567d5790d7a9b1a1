"""``fullthrottle bench``: the four experiments of :mod:`fullthrottle.cli.benchmarks`."""

from __future__ import annotations

import json
import os
import sys

from ..core.config import usable_cores
from .common import sample_photos


def _blobs(paths: list[str] | None) -> list[bytes]:
    from ..data.preprocess import ImageError, preprocess
    from ..data.sources import BadSource, expand

    paths = paths or sample_photos()
    out = []
    for _, p in expand(paths):
        if isinstance(p, (str, BadSource)):
            continue
        try:
            data = p.read_bytes()
        except OSError as e:  # (a path that is not there, or not readable: named, as an image that fails)
            print(f"fullthrottle bench: skipping {p}: cannot read it: {e.strerror or e}", file=sys.stderr)
            continue
        try:
            preprocess(data)
        except ImageError as e:  # a benchmark measures images, not errors: say which and go on
            print(f"fullthrottle bench: skipping {p}: {e}", file=sys.stderr)
            continue
        out.append(data)
    if not out:
        raise FileNotFoundError(f"no image files found in {', '.join(map(str, paths))}")
    return out


def cmd_bench(args) -> int:
    from . import benchmarks as B
    from .bench_e2e import bench_e2e

    exp = args.experiment
    prefix = args.out or f"fullthrottle-bench-{exp}"
    if os.path.isdir(prefix) or prefix.endswith(os.sep):  # (a folder: it wrote FOLDER.json beside it)
        print(
            f"fullthrottle bench {exp}: --out is a prefix (PREFIX.json and PREFIX.png are written), not a folder: "
            f"give {os.path.join(prefix, exp)}, say",
            file=sys.stderr,
        )
        return 2
    if not os.path.isdir(os.path.dirname(os.path.abspath(prefix))):  # find out before the run, not after
        print(f"fullthrottle bench {exp}: cannot write {prefix}.json: its folder does not exist", file=sys.stderr)
        return 2
    try:
        if exp == "threads":
            cores = usable_cores()
            default = sorted({1, 2, *[2**i for i in range(1, 8) if 2**i <= 2 * cores], cores, 2 * cores})
            res = B.bench_threads(
                _blobs(args.images),
                args.threads or ([1, 2] if args.quick else default),
                args.seconds or (0.3 if args.quick else 2.0),
            )
        elif exp == "batch":
            res = B.bench_batch(
                args.batches or ([1, 2] if args.quick else [2**i for i in range(11)]),
                args.model,
                args.compile,
                iters=1 if args.quick else 10,
            )
        elif exp == "transfer":
            res = B.bench_transfer(args.batches or ([1, 8] if args.quick else [1, 8, 32, 128, 512]), args.model)
        else:
            quick = (48, 2, 4) if args.quick else (20000, usable_cores(), 128)  # (the flags given are kept)
            n, workers, batch = (given or q for given, q in zip((args.n, args.workers, args.batch), quick))
            res = bench_e2e(_blobs(args.images), n, workers, batch, args.device, args.model)
    except (RuntimeError, ValueError, FileNotFoundError) as e:
        print(f"fullthrottle bench {exp}: {e}", file=sys.stderr)
        return 2
    res["machine"] = B.machine_info()
    res["machine"]["command"] = "fullthrottle " + " ".join(args.argv)
    with open(prefix + ".json", "w", encoding="utf-8") as f:
        json.dump(res, f, indent=2)
    B.plot(res, prefix + ".png")
    print(json.dumps({k: v for k, v in res.items() if k not in ("machine",)}, indent=1)[:4000])
    for note in res.get("notes", ()):
        print(f"note: {note}", file=sys.stderr)
    print(f"wrote {prefix}.json and {prefix}.png", file=sys.stderr)
    return 0
