"""fullthrottle: keep the GPU at full throttle from plain Python, and show where the time goes.

Library API::

    from fullthrottle import Config, Pipeline
    with Pipeline(Config(model="resnet18", device="auto", max_batch_size=64)) as pipe:
        for r in pipe.run(["photos/", "https://example.com/cat.jpg"]):
            print(r.id, r.labels[:1], r.probs[:1], r.error)

The names below are imported on first use (PEP 562), so ``import fullthrottle`` and the CLI's
``--help`` do not import torch, and a Ctrl-C while the CLI starts is handled by the CLI.
"""

from typing import TYPE_CHECKING

if TYPE_CHECKING:  # (for type checkers and IDEs; at run time the names come from __getattr__)
    from .core.config import Config
    from .core.report import StageStats
    from .core.workload import ItemError, Workload
    from .data.image_header import ImageError
    from .workloads.classify.pipeline import Pipeline, PipelineError, classify
    from .workloads.classify.result import Result
    from .workloads.classify.transform import Transform
    from .workloads.embed import Embedder
    from .workloads.llm.generate import Generator
    from .workloads.llm.llama import load_hf

_WHERE = {
    "Config": ".core.config",
    "Result": ".workloads.classify.result",
    "Pipeline": ".workloads.classify.pipeline",
    "PipelineError": ".workloads.classify.pipeline",
    "classify": ".workloads.classify.pipeline",
    "ImageError": ".data.image_header",
    "Workload": ".core.workload",
    "ItemError": ".core.workload",
    "StageStats": ".core.report",
    "Transform": ".workloads.classify.transform",
    "Embedder": ".workloads.embed",
    "Generator": ".workloads.llm.generate",
    "load_hf": ".workloads.llm.llama",
}

__all__ = [
    "Config",
    "Embedder",
    "Generator",
    "ImageError",
    "ItemError",
    "Pipeline",
    "PipelineError",
    "Result",
    "StageStats",
    "Transform",
    "Workload",
    "classify",
    "load_hf",
]
__version__ = "0.1.0"


def __getattr__(name: str):
    if name in _WHERE:
        import importlib

        value = getattr(importlib.import_module(_WHERE[name], __name__), name)
        globals()[name] = value  # (looked up here from now on)
        return value
    raise AttributeError(f"module 'fullthrottle' has no attribute {name!r}")


def __dir__():
    return sorted(__all__ + ["__version__"])
