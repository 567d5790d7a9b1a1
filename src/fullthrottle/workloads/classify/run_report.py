"""The stage report of one classification run: its counts, stage counters, GPU use and the line
saying which GPU JPEG decoder ran where."""

from __future__ import annotations

import time

from ...core.report import Report


def run_report(run) -> Report:
    """The :class:`~fullthrottle.core.report.Report` of a
    :class:`~fullthrottle.workloads.classify.run.Run` so far."""
    wall = (run.t_end or time.perf_counter()) - run.t0
    eng = run.engine
    batches = run.batcher.batches
    return Report(
        items=run.ok + run.failed,
        ok=run.ok,
        failed=run.failed,
        wall_s=wall,
        latencies_ms=run.latencies.copy(),
        stages=[s.snapshot(wall) for s in run.stats.values()],
        batches=batches,
        mean_batch_size=run.batcher.batched_items / batches if batches else 0.0,
        device=str(eng.device),
        model=eng.model_name,
        dtype=str(eng.dtype).removeprefix("torch."),
        random_weights=eng.random_weights,
        gpu_util_pct=run.gpumon.mean_util_pct,
        jpeg_engines_util_pct=run.gpumon.mean_jpg_util_pct,
        gpu_mem_max_bytes=run.gpumon.max_mem_bytes,
        main_process_cores=((run.cpu_end or time.process_time()) - run.cpu0) / wall if wall > 0 else None,
        graphs=eng.runner.info.format() if eng.runner is not None and eng.runner.info else "",
        gpu_decode=gpu_decode_summary(run),
    )


def gpu_decode_summary(run) -> str:
    """One line: which GPU JPEG decoder ran where, and the share of eligible JPEGs it decoded."""
    from .transform import GPU_INTERPOLATIONS

    eng = run.engine
    if eng.cuda and eng.config.interpolation not in GPU_INTERPOLATIONS:
        return f"GPU decode: off (the model's {eng.config.interpolation} resize has no GPU path: decoded on the CPU)"
    if eng.gpu_decoder is None:
        return ""
    name = {"hardware": "the GPU's JPEG engines (nvImageCodec)", "nvjpeg": "nvJPEG (torchvision)"}.get(
        getattr(eng.gpu_decoder, "kind", None), type(eng.gpu_decoder).__name__
    )
    where = f"{len(run.gpu_procs)} GPU decoder processes" if run.gpu_procs else "a thread of this process"
    gpu, cpu = (eng.splitter.routed[k] - run._routed0[k] for k in ("gpu", "cpu"))
    share = f" ({gpu / (gpu + cpu):.0%})" if gpu + cpu else ""
    if not run.gpu_procs:
        return (
            f"GPU decode: {name} in {where}; {gpu} of {gpu + cpu} eligible JPEGs{share} sent there, "
            "the rest decoded on the CPU"
        )
    on_cpu = sum(p.times["cpu_decoded"] for p in run.gpu_procs) - run._gpu_cpu0
    from ...core.mps import started_here

    mps = (
        "as clients of a CUDA MPS server" + (" started for this run" if started_here() else "")
        if run.gpu_mps
        else "time-slicing the GPU (no CUDA MPS server found: see the README's GPU JPEG decoding section)"
    )
    return (
        f"GPU decode: {name} in {where}, {mps}; {gpu} of {gpu + cpu} JPEGs{share} sent there ({on_cpu} "
        "of them to those processes' CPU decoder: not for the GPU decoder or refused by it), the rest "
        "decoded by the CPU decoder processes"
    )
