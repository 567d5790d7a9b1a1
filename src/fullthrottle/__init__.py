"""fullthrottle: keep the GPU at full throttle from plain Python, and show where the time goes.

Library API::

    from fullthrottle import Config, Pipeline
    with Pipeline(Config(model="resnet18", device="auto", max_batch_size=64)) as pipe:
        for r in pipe.run(["photos/", "https://example.com/cat.jpg"]):
            print(r.id, r.labels[:1], r.probs[:1], r.error)
"""

from .config import Config
from .decode import Result
from .pipeline import Pipeline, PipelineError, classify
from .preprocess import ImageError

__all__ = ["Config", "ImageError", "Pipeline", "PipelineError", "Result", "classify"]
__version__ = "0.1.0"
