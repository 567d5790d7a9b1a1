"""The server's Prometheus metrics (prometheus-client, one registry per app): requests by route and
status, latency histograms, batch sizes per workload, queue depth, stage busy % per workload, replica
and stage (the same :class:`~fullthrottle.core.report.StageStats` the CLI's reports print), GPU
utilisation and memory (NVML).

In a multi-process server (``--http-workers``) every process writes its metrics to
prometheus-client's multiprocess folder: counters and histograms are summed over the processes, and
the gauges (set by the engine process only) over the live ones."""

from __future__ import annotations

import time

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest


class ServerMetrics:
    """The metrics of one app; :meth:`render` refreshes the gauges from the app's state and returns
    the text exposition format."""

    def __init__(self):
        reg = self.registry = CollectorRegistry()
        self.requests = Counter("fullthrottle_requests", "HTTP requests", ["route", "status"], registry=reg)
        self.latency = Histogram(
            "fullthrottle_request_latency_seconds",
            "request latency (s)",
            ["route"],
            registry=reg,
            buckets=(0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30),
        )
        self.item_latency = Histogram(
            "fullthrottle_item_latency_seconds",
            "per-image latency in the pipeline (s), of the images answered with their classes",
            registry=reg,
            buckets=(0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 5),
        )
        self.item_errors = Counter(
            "fullthrottle_item_errors",
            "images answered with their own error, by stage and kind (fullthrottle.core.errors)",
            ["stage", "kind"],
            registry=reg,
        )
        self.ttft = Histogram(
            "fullthrottle_llm_time_to_first_token_seconds",
            "LLM requests: time from a request's arrival to its first token (s), streamed or not",
            registry=reg,
            buckets=(0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30),
        )
        self.batch = Histogram(
            "fullthrottle_batch_size",
            "batch sizes formed by the batcher, per workload (classify, embeddings, a workload's name)",
            ["workload"],
            registry=reg,
            buckets=(1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024),
        )
        self.queued = Gauge(
            "fullthrottle_queue_images",
            "images waiting to enter the pipeline",
            ["replica"],
            registry=reg,
            multiprocess_mode="livesum",
        )
        self.pending = Gauge(
            "fullthrottle_pending_images",
            "images submitted and not yet answered",
            ["replica"],
            registry=reg,
            multiprocess_mode="livesum",
        )
        self.requests_waiting = Gauge(
            "fullthrottle_requests_waiting",
            "requests queued, per workload (generate: waiting for a KV-cache row; a workload's name)",
            ["workload"],
            registry=reg,
            multiprocess_mode="livesum",
        )
        self.requests_running = Gauge(
            "fullthrottle_requests_running",
            "requests holding a KV-cache row (generate)",
            ["workload"],
            registry=reg,
            multiprocess_mode="livesum",
        )
        self.kv_pages = Gauge(
            "fullthrottle_kv_pages",
            "the LLM's paged KV memory: pages of 64 tokens, used and in all (absent: a static cache)",
            ["state"],
            registry=reg,
            multiprocess_mode="livesum",
        )
        self.preempted = Counter(
            "fullthrottle_llm_preemptions",
            "LLM requests preempted for KV pages (prefilled again later)",
            registry=reg,
        )
        self.busy = Gauge(
            "fullthrottle_stage_busy_percent",
            "stage busy % since start, per workload (classify, embed, generate), replica and stage",
            ["workload", "replica", "stage"],
            registry=reg,
            multiprocess_mode="livesum",
        )

        def per_stage(name: str, doc: str) -> Counter:  # (classify: one value per replica and stage)
            return Counter(name, doc, ["replica", "stage"], registry=reg)

        self.queue_wait = per_stage(
            "fullthrottle_stage_queue_wait_seconds",
            "classify: seconds images have waited in each stage's input queue, summed over images (with "
            "fullthrottle_stage_queue_waits_total: the mean wait per image between two scrapes)",
        )
        self.queue_waits = per_stage(
            "fullthrottle_stage_queue_waits",
            "classify: images counted in fullthrottle_stage_queue_wait_seconds_total, per replica and stage",
        )
        self.work = per_stage(
            "fullthrottle_stage_work_seconds",
            "classify: seconds each stage's workers have spent on items, summed over workers (with "
            "fullthrottle_stage_items_total: the mean work per image between two scrapes)",
        )
        self.items = per_stage(
            "fullthrottle_stage_items", "classify: images each stage has finished, per replica and stage"
        )
        self._counted: dict = {}  # (counter, labels) -> the running total it was last brought up to
        self.gpu = Gauge(
            "fullthrottle_gpu_utilization_percent",
            "GPU utilisation (NVML)",
            ["replica"],
            registry=reg,
            multiprocess_mode="livesum",
        )
        self.gpu_mem = Gauge(
            "fullthrottle_gpu_memory_used_bytes",
            "GPU memory used (NVML)",
            ["replica"],
            registry=reg,
            multiprocess_mode="livesum",
        )

    def _count(self, counter: Counter, labels: tuple, total: float) -> None:
        """Bring ``counter`` up to the running ``total`` an engine keeps (a total that went down
        started again from zero: all of it is new)."""
        last = self._counted.get((counter, labels), 0.0)
        (counter.labels(*labels) if labels else counter).inc(total - last if total >= last else total)
        self._counted[(counter, labels)] = total

    def render(self, state: dict) -> bytes:
        """The gauges set from ``state`` (the app's: classification services, the LLM service, the
        workloads' services), then every metric in Prometheus' text format."""
        for i, svc in enumerate(state["services"]):
            rep = str(i)
            self.queued.labels(rep).set(svc.queued())
            self.pending.labels(rep).set(svc.pending())
            run = svc.pipeline.current_run
            if run is not None:
                wall = time.perf_counter() - run.t0
                for st in run.stats.values():
                    snap = st.snapshot(wall)
                    self.busy.labels("classify", rep, snap["stage"]).set(
                        snap["worker_busy_pct"] if snap["stage"] == "preprocess" else snap["busy_pct"]
                    )
                    self._count(self.queue_wait, (rep, st.name), st.queue_wait_s)
                    self._count(self.queue_waits, (rep, st.name), st.queue_waits)
                    self._count(self.work, (rep, st.name), st.work_s)
                    self._count(self.items, (rep, st.name), st.items)
                mon = run.gpumon
                if mon.utils:
                    self.gpu.labels(rep).set(mon.utils[-1])
                    self.gpu_mem.labels(rep).set(mon.mems[-1])
        # the other workloads keep the same StageStats: the same metric, their own stages
        if state.get("llm") is not None:
            self.requests_waiting.labels("generate").set(state["llm"].waiting)
            self.requests_running.labels("generate").set(state["llm"].running)
            kv = state["llm"].gen.kv
            if kv is not None:
                self.kv_pages.labels("used").set(kv.pages_used)
                self.kv_pages.labels("total").set(kv.num_pages)
                self._count(self.preempted, (), state["llm"].preempted)
            wall = time.perf_counter() - state["t_ready"]
            for st in state["llm"].gen.stats.values():
                self.busy.labels("generate", "0", st.name).set(st.snapshot(wall)["busy_pct"])
        for name, svc in state.get("workloads", {}).items():
            self.requests_waiting.labels(name).set(svc.waiting)
            wall = time.perf_counter() - state["t_ready"]
            for st in svc.stats.values():
                self.busy.labels(name, "0", st.name).set(st.snapshot(wall)["busy_pct"])
        return generate_latest(self.registry)
