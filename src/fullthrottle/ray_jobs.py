"""Past one machine: the same pipeline inside Ray Data actors (offline batch inference), any
:class:`~fullthrottle.core.workload.Workload` in Ray Data actors (:func:`workload_on_ray`), and the
server's app on Ray Serve (:func:`serve_on_ray`, the workloads included).

Ray is an optional extra (``pip install 'fullthrottle[ray]'``); the core never imports this module.
Each actor builds one :class:`~fullthrottle.workloads.classify.pipeline.Pipeline` (model load, graph
capture) when it starts and then classifies the batches Ray hands it: decoding, batching and graph
replay happen inside the actor, exactly as in a single process.

Example (a folder of JPEGs to Parquet)::

    import ray
    from fullthrottle.ray_jobs import RayClassifier

    ds = ray.data.read_binary_files("photos/", include_paths=True)          # columns: bytes, path
    ds = ds.map_batches(RayClassifier, fn_constructor_kwargs={"config": {"model": "efficientnet_lite0"}},
                        compute=ray.data.ActorPoolStrategy(size=2), num_gpus=1, batch_size=256,
                        batch_format="pandas")
    ds.write_parquet("out/")  # id, labels, probs, error
"""

from __future__ import annotations

import signal
import socket
import threading
from collections.abc import Iterator
from pathlib import Path


class RayClassifier:
    """A callable class for ``Dataset.map_batches`` (stateful actor).

    Args:
        config: keyword arguments of :class:`~fullthrottle.core.config.Config` (a model *name*; the
            weights file must be readable on every node).

    A batch (pandas DataFrame) holds a ``path`` column (str; an ``id`` column beside it names each
    row in its output and errors), or ``bytes`` (with ``path`` or ``id`` as the item id). The output
    has one row per input row: ``id``, ``labels`` (list of str),
    ``class_ids``, ``probs`` (lists, most probable first), ``error`` (None when ok) and ``node``
    (the Ray node that ran it).
    """

    def __init__(self, config: dict | None = None):
        from .core.config import Config
        from .workloads.classify.pipeline import Pipeline

        self.pipe = Pipeline(Config(**(config or {})))
        self.node = _node_id()

    def __call__(self, batch):
        import pandas as pd

        if "bytes" in batch:
            ids = batch["path"] if "path" in batch else batch.get("id", pd.Series(range(len(batch))))
            inputs = [(str(i), bytes(b)) for i, b in zip(ids, batch["bytes"])]
        elif "path" in batch:
            inputs = [str(p) for p in batch["path"]]
        else:
            raise ValueError("a batch needs a 'path' or a 'bytes' column")
        from .workloads.classify.result import utf8_text

        res = self.pipe.classify(inputs)
        if "path" in batch and "id" in batch and "bytes" not in batch:  # (a path read, named by its id)
            for r, i in zip(res, batch["id"]):
                if r.error is not None and r.error.startswith(f"{r.id}: "):
                    r.error = f"{i}: {r.error[len(r.id) + 2 :]}"
                r.id = str(i)
        return pd.DataFrame(  # (ids and errors as UTF-8 holds them: a file name's other bytes as \xNN)
            {
                "id": [utf8_text(r.id) for r in res],
                "labels": [r.labels for r in res],
                "class_ids": [r.class_ids for r in res],
                "probs": [r.probs for r in res],
                "error": [utf8_text(r.error) for r in res],
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
    paths must be visible to every node (a shared filesystem, or a single machine). A row's ``id``
    is the item's id as the library gives it (the path as expanded, not resolved). An input that is
    no file or folder (``(id, bytes)``, a URL, an array) is its row's error: it is not sent.

    Raises:
        ImportError: Ray is not installed. RayUnreachable: nothing answers at ``address``.
    """
    import ray

    from .data.sources import BadSource, expand

    _init_ray(address)
    rows, bad = [], []
    for i, (item_id, src) in enumerate(expand(inputs)):
        if isinstance(src, Path):  # (read by its absolute path: an actor runs in a folder of its own)
            rows.append({"path": str(src.resolve()) if src.exists() else str(src), "id": item_id, "order": i})
        else:
            bad.append(
                {
                    "id": item_id,
                    "order": i,
                    "error": str(src)
                    if isinstance(src, BadSource)
                    else f"{item_id}: cannot load an input of type {'URL' if isinstance(src, str) else 'bytes'} "
                    "on Ray workers: files and folders only (each worker reads its own)",
                }
            )
    if num_gpus is None:
        import torch

        num_gpus = 1 if config.get("device", "auto") != "cpu" and torch.cuda.is_available() else 0
    ctx = ray.data.DataContext.get_current()
    ctx.execution_options.preserve_order = True
    out = {}
    if rows:
        import os
        import sys

        ds = ray.data.from_items(rows)
        # (the actors find what this process imports from: a --model MODULE:CLASS of the current folder)
        path = os.pathsep.join(p for p in [os.getcwd(), *sys.path] if p and os.path.isdir(p))
        ds = ds.map_batches(
            RayClassifier,
            fn_constructor_kwargs={"config": config},
            compute=ray.data.ActorPoolStrategy(size=concurrency),  # (map_batches' concurrency= is deprecated)
            batch_size=batch_size,
            num_gpus=num_gpus,
            batch_format="pandas",
            runtime_env={"env_vars": {"PYTHONPATH": path}},
        )
        for row, src in zip(ds.iter_rows(), rows):
            out[src["order"]] = {
                k: (list(v) if hasattr(v, "tolist") and not isinstance(v, str) else v) for k, v in row.items()
            }
    for b in bad:
        out[b["order"]] = {"id": b["id"], "labels": [], "class_ids": [], "probs": [], "error": b["error"], "node": ""}
    for k in sorted(out):
        yield out[k]


#: brackets the message of a workload whose setup() failed in an actor, for the driver to find it in Ray's error
_SETUP_MARK = "[[fullthrottle: setup failed]]"


class SetupFailed(RuntimeError):
    """A workload's ``setup()`` raised in a Ray actor: the message (and the user's frames)."""


class RayUnreachable(RuntimeError):
    """The Ray cluster's address is not ``HOST:PORT`` (``ray://``, Ray Client, is refused), or no Ray
    cluster answers there within :data:`RAY_CONNECT_S` (``ray.init`` would wait without end on a port
    where something else listens, saying nothing)."""


#: seconds a given Ray cluster's address has to answer before a job says it cannot reach it
RAY_CONNECT_S = 10.0
#: a method every Ray GCS serves (ray>=2.40): asked with an empty request, a GCS answers it (or asks for
#: its token); a port where no GCS listens answers UNAVAILABLE or UNIMPLEMENTED
_GCS_PROBE = "/ray.rpc.NodeInfoGcsService/GetClusterId"


def _check_reachable(address: str | None) -> None:
    """Raises :class:`RayUnreachable` for a ``HOST:PORT`` address where no Ray cluster answers, or a
    ``ray://`` one (Ray Data's jobs fail through Ray Client); None and ``"auto"`` are left to Ray."""
    if address is None or address == "auto":
        return
    scheme, _, rest = address.rpartition("://")
    host, _, port = rest.rpartition(":")
    bracketed = host.startswith("[") and host.endswith("]")
    host = host[1:-1] if bracketed else host
    odd_host = not host or (":" in host and not bracketed) or host != host.strip()
    if scheme == "ray":
        raise RayUnreachable(
            f"Ray cluster address {address!r}: a Ray Data job does not run through Ray Client (ray://); run "
            "it on a node of the cluster, with the address HOST:PORT (the head's GCS port, 6379 by default) or auto"
        )
    if scheme or odd_host or not port.isdigit() or not 0 < int(port) < 65536:
        raise RayUnreachable(f"Ray cluster address {address!r}: not HOST:PORT or auto")
    try:
        socket.create_connection((host, int(port)), timeout=RAY_CONNECT_S).close()
    except OSError as e:
        why = "no answer" if isinstance(e, TimeoutError) else (e.strerror or str(e))
        raise RayUnreachable(f"cannot reach the Ray cluster at {address}: {why}") from None
    import grpc  # (Ray's own dependency)

    with grpc.insecure_channel(f"[{host}]:{port}" if bracketed else f"{host}:{port}") as ch:
        try:
            ch.unary_unary(_GCS_PROBE)(b"", timeout=RAY_CONNECT_S)
        except grpc.RpcError as e:
            no_gcs = (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.UNIMPLEMENTED, grpc.StatusCode.DEADLINE_EXCEEDED)
            if e.code() in no_gcs:
                raise RayUnreachable(f"cannot reach the Ray cluster at {address}: no Ray cluster answers") from None


class RayWorkload:
    """A callable class for ``Dataset.map_batches`` that answers requests of any workload through its
    contract (:func:`~fullthrottle.core.workload.run_offline`: decode, batches by count and cost,
    predict, encode), as ``POST /v1/<name>`` would.

    Args:
        workload: ``"MODULE:CLASS"`` (importable on every node), constructed with no arguments.
        device: where its ``setup()`` loads the model ("auto": CUDA when there is one).

    A batch (pandas DataFrame) holds a ``request`` column: each a JSON string of one request body.
    The output has one row per input row: ``response`` (the answer as a JSON string, or None),
    ``error`` (None when ok) and ``node``."""

    def __init__(self, workload: str, device: str = "auto"):
        from .core.device import resolve_device
        from .core.workload import load_workload, user_traceback

        self.workload = load_workload(workload)
        try:
            self.workload.setup(str(resolve_device(device)))
        except Exception as e:  # noqa: BLE001 - the user's code: its own frames, marked for the driver to find
            why = f"workload {self.workload.name!r}: setup() failed:\n{user_traceback(e)}".rstrip()
            raise RuntimeError(f"{_SETUP_MARK}{why}{_SETUP_MARK}") from None
        self.node = _node_id()

    def __call__(self, batch):
        import json

        import pandas as pd

        from .core.json_body import parse_body
        from .core.workload import run_offline

        bodies, bad = [], {}
        for j, text in enumerate(batch["request"]):
            try:
                bodies.append(parse_body(text))
            except (TypeError, ValueError) as e:
                bodies.append(None)
                bad[j] = str(e)
        out = run_offline(self.workload, bodies)
        return pd.DataFrame(
            {
                "response": [None if a is None else json.dumps(a) for a, _ in out],
                "error": [bad.get(j, e) for j, (_, e) in enumerate(out)],
                "node": [self.node] * len(out),
            }
        )


def workload_on_ray(
    workload: str,
    requests,
    address: str | None = None,
    concurrency: int = 2,
    batch_size: int = 64,
    num_gpus: float = 0,
    device: str = "auto",
) -> Iterator[dict]:
    """Answer ``requests`` (request bodies, parsed: JSON objects as dicts) with ``workload``
    (``"MODULE:CLASS"``) in ``concurrency`` Ray actors; yields ``{"response": dict | None, "error":
    str | None, "node": str}`` per request, in order. The driver's ``sys.path`` is given to the actors
    (``runtime_env``), so a module importable here is importable there on a shared filesystem.

    Raises:
        ImportError: Ray is not installed. ValueError: a bad ``workload`` spec (checked here first).
        SetupFailed: the workload's ``setup()`` raised in an actor (its message and the user's frames,
            without Ray's own).
    """
    import json
    import os
    import sys

    import ray

    from .core.workload import load_workload

    load_workload(workload)  # (a bad spec fails here, not in every actor)
    _init_ray(address)
    rows = [{"request": json.dumps(r)} for r in requests]
    if not rows:
        return
    ray.data.DataContext.get_current().execution_options.preserve_order = True
    path = os.pathsep.join(p for p in sys.path if p and os.path.isdir(p))
    ds = ray.data.from_items(rows).map_batches(
        RayWorkload,
        fn_constructor_kwargs={"workload": workload, "device": device},
        compute=ray.data.ActorPoolStrategy(size=concurrency),
        batch_size=batch_size,
        num_gpus=num_gpus,
        batch_format="pandas",
        runtime_env={"env_vars": {"PYTHONPATH": path}},
    )
    try:
        for row in ds.iter_rows():
            yield {
                "response": json.loads(row["response"]) if row["response"] else None,
                "error": row["error"],
                "node": row["node"],
            }
    except Exception as e:  # noqa: BLE001 - Ray wraps an actor's failed start in its own tracebacks
        parts = str(e).split(_SETUP_MARK)
        if len(parts) >= 3:
            raise SetupFailed(parts[1]) from None
        raise


def _init_ray(address: str | None) -> None:
    """Join the Ray cluster at ``address`` (a local one when None), once per process. Ray hands the
    driver's command line (read from ``/proc``) to its C++ core, which takes UTF-8 only: a file
    name on it that is not UTF-8 is passed as ``\\xNN`` instead (Ray's ``get_entrypoint_name``
    wrapped for the time of the call; it failed the whole job). A SIGTERM handler of the caller's
    (the CLI's: exit 143) is put back over the one ``ray.init`` sets."""
    import ray

    from .workloads.classify.result import utf8_text

    if ray.is_initialized():
        return
    _check_reachable(address)
    utils = getattr(getattr(ray, "_private", None), "utils", None)
    entrypoint = getattr(utils, "get_entrypoint_name", None)
    if entrypoint is not None:
        utils.get_entrypoint_name = lambda: utf8_text(entrypoint())
    main = threading.current_thread() is threading.main_thread()
    on_term = signal.getsignal(signal.SIGTERM) if main else None
    try:
        ray.init(address=address, ignore_reinit_error=True, log_to_driver=False)
    except ConnectionError as e:  # (something answers there, not a Ray cluster: Ray's own reason)
        raise RayUnreachable(f"cannot reach the Ray cluster at {address}: {e}") from None
    finally:
        if entrypoint is not None:
            utils.get_entrypoint_name = entrypoint
        if callable(on_term):  # (ray.init sets its own, which exits 15: the caller's handler stays)
            signal.signal(signal.SIGTERM, on_term)


def _node_id() -> str:
    try:
        import ray

        return ray.get_runtime_context().get_node_id()
    except Exception:  # noqa: BLE001 - outside Ray
        return ""


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
        options: :class:`~fullthrottle.server.app.ServeOptions`; its workloads are served in every
            replica (each sets its own up; their classes must be importable on every node).
        blocking: wait until interrupted (the CLI); False returns after the deployment is running.

    Raises:
        ImportError: Ray Serve is not installed.
    """
    from ray import serve

    from .server.app import create_app

    if num_gpus is None:
        import torch

        num_gpus = 1 if config.device != "cpu" and torch.cuda.is_available() else 0
    _init_ray(None)

    actor = {"num_gpus": num_gpus, "num_cpus": 0.5}
    if options is not None and options.workloads:  # their classes must import in every replica
        import os
        import sys

        path = os.pathsep.join(p for p in sys.path if p and os.path.isdir(p))
        actor["runtime_env"] = {"env_vars": {"PYTHONPATH": path}}

    @serve.deployment(num_replicas=replicas, ray_actor_options=actor)
    @serve.ingress(lambda: create_app(config, options))
    class Fullthrottle:
        """One replica: the whole fullthrottle app (pipeline built in the app's lifespan)."""

    serve.start(http_options={"host": host, "port": port})
    serve.run(Fullthrottle.bind(), name="fullthrottle", route_prefix="/", blocking=blocking)
