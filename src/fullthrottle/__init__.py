"""fullthrottle: keep the GPU at full throttle from plain Python, and show where the time goes.

Library API::

    from fullthrottle import Config, Pipeline
    with Pipeline(Config(model="resnet18", device="auto", max_batch_size=64)) as pipe:
        for r in pipe.run(["photos/", "https://example.com/cat.jpg"]):
            print(r.id, r.labels[:1], r.probs[:1], r.error)

The names below are imported on first use (PEP 562), so ``import fullthrottle`` and the CLI's
``--help`` do not import torch, and a Ctrl-C while the CLI starts is handled by the CLI.
"""

from __future__ import annotations

import importlib

_WHERE = {"Config": ".config", "Result": ".decode", "Pipeline": ".pipeline", "PipelineError": ".pipeline",
          "classify": ".pipeline", "ImageError": ".preprocess"}

__all__ = ["Config", "ImageError", "Pipeline", "PipelineError", "Result", "classify"]
__version__ = "0.1.0"


def __getattr__(name: str):
    if name in _WHERE:
        value = getattr(importlib.import_module(_WHERE[name], __name__), name)
        globals()[name] = value  # (looked up here from now on)
        return value
    raise AttributeError(f"module 'fullthrottle' has no attribute {name!r}")


def __dir__():
    return sorted(set(globals()) | set(__all__))
