"""The stage report names the bottleneck; both cases are forced on CPU."""

import time

import torch
from test_pipeline import LABELS, Tiny

from fullthrottle import Config, Pipeline
from fullthrottle.core.gpumon import GpuMonitor
from fullthrottle.core.report import Report, verdict


class SlowModel(Tiny):
    def forward(self, x):
        time.sleep(0.05 * x.shape[0])  # 50 ms per image: the model is the bottleneck
        return super().forward(x)


def test_slow_model_is_compute_bound(samples):
    pipe = Pipeline(Config(labels=LABELS, device="cpu", max_batch_size=4, threads=2), model=SlowModel())
    res = pipe.classify(samples[:24])
    assert all(r.ok for r in res)
    rep = pipe.last_report
    assert rep.verdict.startswith("compute-bound"), rep.format()
    assert "GPU busy n/a" in rep.verdict
    stages = {s["stage"]: s for s in rep.stages}
    assert stages["compute"]["busy_pct"] > 80 and stages["preprocess"]["worker_busy_pct"] < 50
    # the model sleeps: this process used little CPU over the run, and the report says how little
    assert 0 < rep.main_process_cores < 0.8, rep.main_process_cores
    assert rep.to_dict()["main_process_cores"] == rep.main_process_cores
    assert f"this process: {rep.main_process_cores:.2f} cores of CPU" in rep.format()


def test_slow_decoder_is_preprocess_bound(samples, monkeypatch):
    import fullthrottle.workloads.classify.stage_threads as stage_threads

    real = stage_threads.preprocess

    def slow(data, *a, **k):
        time.sleep(0.05)  # 50 ms per image on each of 2 threads: 40 img/s at most
        return real(data, *a, **k)

    monkeypatch.setattr(stage_threads, "preprocess", slow)  # (what the preprocess threads call)
    pipe = Pipeline(Config(labels=LABELS, device="cpu", max_batch_size=8, threads=2), model=Tiny())
    pipe.classify(samples[:40])
    rep = pipe.last_report
    assert rep.verdict.startswith("preprocess-bound"), rep.format()
    assert "preprocess threads busy" in rep.verdict
    assert "bottleneck: preprocess-bound" in rep.format()
    assert rep.to_dict()["verdict"] == rep.verdict


def test_verdict_rules():
    def st(pre, comp):
        return [
            {"stage": "preprocess", "workers": 16, "busy_pct": pre, "worker_busy_pct": pre},
            {"stage": "compute", "workers": 1, "busy_pct": comp, "worker_busy_pct": comp},
        ]

    assert verdict(st(98, 20), 31.0, True) == "preprocess-bound: GPU busy 31%, preprocess threads busy 98%"
    assert verdict(st(40, 99), 95.0, True).startswith("compute-bound (GPU): GPU busy 95%")
    assert verdict(st(40, 99), 20.0, True).startswith("compute-bound on the host")
    assert verdict(st(30, 20), None, False).startswith("source-bound")
    gd = [{"stage": "gpu decode", "workers": 12, "busy_pct": 95, "worker_busy_pct": 90}]
    assert (
        verdict(gd, 57.0, True, 98.0)
        == "gpu decode-bound: GPU busy 57%, JPEG engines busy 98%, gpu decode stage busy 95%"
    )
    assert verdict(gd, 57.0, True) == "gpu decode-bound: GPU busy 57%, gpu decode stage busy 95%"


def test_gpu_monitor_without_gpu_reports_na():
    with GpuMonitor(None) as m:
        pass
    assert m.mean_util_pct is None and m.to_dict()["gpu_util_mean_pct"] is None
    if not torch.cuda.is_available():
        with GpuMonitor(0) as m:
            time.sleep(0.01)
        assert m.mean_util_pct is None


def test_gpu_monitor_samples_the_jpeg_engines_where_nvml_reports_them(monkeypatch):
    """The JPEG engines' utilisation comes from nvmlDeviceGetJpgUtilization beside the GPU's; a GPU
    without engines (NVML raises NotSupported) reports None, and its GPU figures still come; the
    report's GPU line names the engines only when they were measured."""
    import sys
    import types

    def fake_nvml(jpg):
        m = types.ModuleType("pynvml")
        m.nvmlInit = lambda: None
        m.nvmlDeviceGetHandleByIndex = lambda i: object()
        m.nvmlDeviceGetUtilizationRates = lambda h: types.SimpleNamespace(gpu=60)
        m.nvmlDeviceGetMemoryInfo = lambda h: types.SimpleNamespace(used=2**30)
        m.nvmlDeviceGetJpgUtilization = jpg
        return m

    def not_supported(h):
        raise RuntimeError("NVML_ERROR_NOT_SUPPORTED")

    for jpg, want in ((lambda h: [37, 166666], 37.0), (not_supported, None)):
        monkeypatch.setitem(sys.modules, "pynvml", fake_nvml(jpg))
        with GpuMonitor(0, interval_s=0.01) as m:
            deadline = time.time() + 5
            while m.samples < 3 and time.time() < deadline:
                time.sleep(0.01)
        assert m.mean_util_pct == 60 and m.mean_jpg_util_pct == want
        assert m.to_dict()["jpeg_engines_util_mean_pct"] == want
        line = Report(items=1, ok=1, wall_s=1.0, gpu_util_pct=60.0, jpeg_engines_util_pct=want).format()
        assert ("GPU utilisation (NVML): 60%; JPEG engines busy 37%" in line) == (want is not None), line


def test_latency_histogram_percentiles_within_half_a_percent_in_constant_memory():
    import numpy as np

    from fullthrottle.core.latency import LatencyHistogram

    rng = np.random.default_rng(0)
    ms = rng.lognormal(mean=2.0, sigma=1.5, size=200_000)  # ~0.01 ms .. ~1 s
    h = LatencyHistogram()
    size = h.counts.nbytes
    for chunk in np.array_split(ms, 1000):
        h.add(chunk.tolist())
    assert len(h) == ms.size and h.counts.nbytes == size
    for q in (0, 1, 50, 90, 99, 99.9, 100):
        exact = float(np.percentile(ms, q, method="inverted_cdf"))  # nearest rank
        assert abs(h.percentile(q) - exact) <= 0.005 * exact, (q, h.percentile(q), exact)
    h.remove(ms[:100_000].tolist())  # taken back: the rest's percentiles
    assert len(h) == 100_000
    exact = float(np.percentile(ms[100_000:], 99, method="inverted_cdf"))
    assert abs(h.percentile(99) - exact) <= 0.005 * exact
    assert LatencyHistogram().percentile(50) == 0.0 and not LatencyHistogram()


def test_a_report_gives_the_latency_percentiles_of_its_run(samples):
    import fullthrottle as ft

    pipe = ft.Pipeline(ft.Config(model="resnet18", device="cpu", threads=1))
    try:
        results = pipe.classify([p.read_bytes() for p in samples[:6]])
    finally:
        pipe.close()
    lat = sorted(r.latency_ms for r in results)
    rep = pipe.last_report
    assert len(rep.latencies_ms) == 6
    assert abs(rep.latency_ms(50) - lat[2]) <= 0.005 * lat[2]  # nearest rank: the 3rd of 6
    assert abs(rep.to_dict()["latency_p99_ms"] - lat[5]) <= 0.005 * lat[5]
