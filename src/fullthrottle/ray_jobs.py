"""Past one machine: the same pipeline inside Ray Data actors (offline batch inference).

Ray is an optional extra (``pip install 'fullthrottle[ray]'``); the core never imports this module.
Each actor builds one :class:`~fullthrottle.workloads.classify.pipeline.Pipeline` (model load, graph capture) when it
starts and then classifies the batches Ray hands it: decoding, batching and graph replay happen inside
the actor, exactly as in a single process.

Example (a folder of JPEGs to Parquet)::

    import ray
    from fullthrottle.ray_jobs import RayClassifier

    ds = ray.data.read_binary_files("photos/", include_paths=True)          # columns: bytes, path
    ds = ds.map_batches(RayClassifier, fn_constructor_kwargs={"config": {"model": "efficientnet_lite0"}},
                        concurrency=2, num_gpus=1, batch_size=256, batch_format="pandas")
    ds.write_parquet("out/")                                                 # id, labels, probs, error
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path


class RayClassifier:
    """A callable class for ``Dataset.map_batches`` (stateful actor).

    Args:
        config: keyword arguments of :class:`~fullthrottle.core.config.Config` (a model *name*; the
            weights file must be readable on every node).

    A batch (pandas DataFrame) holds a ``path`` column (str), or ``bytes`` (with ``path`` or ``id``
    as the item id). The output has one row per input row: ``id``, ``labels`` (list of str),
    ``class_ids``, ``probs`` (lists, most probable first), ``error`` (None when ok) and ``node``
    (the Ray node that ran it).
    """

    def __init__(self, config: dict | None = None):
        from .core.config import Config
        from .workloads.classify.pipeline import Pipeline

        self.pipe = Pipeline(Config(**(config or {})))
        try:
            import ray

            self.node = ray.get_runtime_context().get_node_id()
        except Exception:  # noqa: BLE001 - outside Ray
            self.node = ""

    def __call__(self, batch):
        import pandas as pd

        if "bytes" in batch:
            ids = batch["path"] if "path" in batch else batch.get("id", pd.Series(range(len(batch))))
            inputs = [(str(i), bytes(b)) for i, b in zip(ids, batch["bytes"])]
        elif "path" in batch:
            inputs = [str(p) for p in batch["path"]]
        else:
            raise ValueError("a batch needs a 'path' or a 'bytes' column")
        res = self.pipe.classify(inputs)
        return pd.DataFrame(
            {
                "id": [r.id for r in res],
                "labels": [r.labels for r in res],
                "class_ids": [r.class_ids for r in res],
                "probs": [r.probs for r in res],
                "error": [r.error for r in res],
                "node": [self.node] * len(res),
            }
        )


def classify_on_ray(
    inputs,
    config: dict,
    address: str | None = None,
    concurrency: int = 2,
    batch_size: int = 64,
    num_gpus: float | None = None,
) -> Iterator[dict]:
    """Run the offline job on a Ray cluster (a local one when ``address`` is None); yields one row
    (dict, see :class:`RayClassifier`) per input item, in input order.

    Inputs are expanded here (files, folders, globs); each actor reads its files itself, so the
    paths must be visible to every node (a shared filesystem, or a single machine).

    Raises:
        ImportError: Ray is not installed.
    """
    import ray

    from .data.load import BadSource, expand

    if not ray.is_initialized():
        ray.init(address=address, ignore_reinit_error=True, log_to_driver=False)
    rows, bad = [], []
    for i, (item_id, src) in enumerate(expand(inputs)):
        if isinstance(src, Path):
            rows.append({"path": str(src.resolve()) if src.exists() else str(src), "order": i})
        else:
            bad.append(
                {
                    "id": item_id,
                    "order": i,
                    "error": str(src)
                    if isinstance(src, BadSource)
                    else f"{item_id}: only files and folders can be sent to Ray workers",
                }
            )
    if num_gpus is None:
        import torch

        num_gpus = 1 if config.get("device", "auto") != "cpu" and torch.cuda.is_available() else 0
    ctx = ray.data.DataContext.get_current()
    ctx.execution_options.preserve_order = True
    out = {}
    if rows:
        ds = ray.data.from_items(rows)
        ds = ds.map_batches(
            RayClassifier,
            fn_constructor_kwargs={"config": config},
            concurrency=concurrency,
            batch_size=batch_size,
            num_gpus=num_gpus,
            batch_format="pandas",
        )
        for row, src in zip(ds.iter_rows(), rows):
            out[src["order"]] = {
                k: (list(v) if hasattr(v, "tolist") and not isinstance(v, str) else v) for k, v in row.items()
            }
    for b in bad:
        out[b["order"]] = {"id": b["id"], "labels": [], "class_ids": [], "probs": [], "error": b["error"], "node": ""}
    for k in sorted(out):
        yield out[k]


def serve_on_ray(
    config,
    options=None,
    replicas: int = 1,
    host: str = "127.0.0.1",
    port: int = 8000,
    num_gpus: float | None = None,
    blocking: bool = True,
):
    """Deploy ``fullthrottle serve``'s app on Ray Serve: ``replicas`` replicas (one GPU each on CUDA),
    the same routes and response shapes, each replica feeding its own dynamic batcher.

    Args:
        config: the pipeline's :class:`~fullthrottle.core.config.Config` (a model name; weights readable
            on every node).
        options: :class:`~fullthrottle.server.app.ServeOptions`.
        blocking: wait until interrupted (the CLI); False returns after the deployment is running.

    Raises:
        ImportError: Ray Serve is not installed.
    """
    import ray
    from ray import serve

    from .server.app import create_app

    if num_gpus is None:
        import torch

        num_gpus = 1 if config.device != "cpu" and torch.cuda.is_available() else 0
    if not ray.is_initialized():
        ray.init(ignore_reinit_error=True, log_to_driver=False)

    @serve.deployment(num_replicas=replicas, ray_actor_options={"num_gpus": num_gpus, "num_cpus": 0.5})
    @serve.ingress(lambda: create_app(config, options))
    class Fullthrottle:
        """One replica: the whole fullthrottle app (pipeline built in the app's lifespan)."""

    serve.start(http_options={"host": host, "port": port})
    serve.run(Fullthrottle.bind(), name="fullthrottle", route_prefix="/", blocking=blocking)
