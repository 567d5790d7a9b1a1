"""Text embeddings as a :class:`~fullthrottle.core.workload.Workload`: what ``POST /v1/embeddings``
serves (OpenAI's embeddings request and response shape), batched across requests by a token
budget, as text-embeddings-inference forms its batches (``--max-batch-tokens``).
"""

from __future__ import annotations

import os
from dataclasses import dataclass

from ..core.workload import ItemError, Workload

#: texts one embeddings request may carry (413 beyond)
MAX_TEXTS_PER_REQUEST = 2048


@dataclass
class _Text:
    index: int  # its place in its request
    text: str
    enc: object = None  # its tokenizer encoding, once the batcher has costed it
    error: str | None = None  # why it could not be tokenised


class EmbeddingsAPI(Workload):
    """``{"input": "text" | ["text", ...], "model": ...}`` -> ``{"object": "list", "data": [{"index",
    "embedding", "truncated"}, ...], "model", "usage"}``.

    Args:
        path: a sentence-transformers folder (None: all-MiniLM-L6-v2, :func:`~fullthrottle.workloads.embed.default_model_dir`).
        max_batch: most texts per forward batch; max_batch_tokens: most tokens per batch.

    A text that cannot be tokenised (a lone surrogate) fails its request with 422 naming it; the
    other requests of its batch are not affected.
    """

    name = "embeddings"
    max_items_per_request = MAX_TEXTS_PER_REQUEST
    max_wait_ms = 0.0  # (what is queued when a batch starts joins it; no waiting for more)

    def __init__(self, path: str | None = None, max_batch: int = 1024, max_batch_tokens: int = 32768):
        self.path, self.max_batch, self.max_batch_cost = path, max_batch, max_batch_tokens
        self.model_name = "all-MiniLM-L6-v2" if path is None else os.path.basename(os.path.normpath(path))
        self.embedder = None
        self.stats = {}

    def setup(self, device: str) -> None:
        from .embed import Embedder

        self.embedder = Embedder(self.path, device)
        self.embedder.capture()  # every shape's graph before the server says ready
        self.stats = self.embedder.stats  # tokenize, compute

    def decode_request(self, body: dict) -> list:
        texts = body.get("input")
        texts = [texts] if isinstance(texts, str) else texts
        if not isinstance(texts, list) or not texts or not all(isinstance(t, str) for t in texts):
            raise ValueError('JSON body must be {"input": "text" | ["text", ...]}')
        return [_Text(i, t) for i, t in enumerate(texts)]

    def cost(self, item: _Text) -> int:
        """Its token count (tokenised here, on the batching thread; the encoding kept on it)."""
        try:
            item.enc = self.embedder.tokenize([item.text])[0]
        except (TypeError, ValueError) as e:
            item.error = str(e).replace("text 0", f"text {item.index}", 1)
            return 0
        return len(item.enc.ids)

    def predict(self, items: list) -> list:
        good = [it for it in items if it.error is None]
        res = self.embedder.embed_encoded([it.enc for it in good])
        out: list = [ItemError(it.error) for it in items]
        k = 0
        for j, it in enumerate(items):
            if it.error is None:
                out[j] = (res.vectors[k], bool(res.truncated[k]), int(res.tokens[k]))
                k += 1
        return out

    def encode_response(self, outputs: list) -> dict:
        bad = [str(o) for o in outputs if isinstance(o, ItemError)]
        if bad:  # (OpenAI's shape has no per-text error: the request fails, naming its texts)
            raise ValueError("; ".join(bad))
        n_tok = sum(t for _, _, t in outputs)
        return {
            "object": "list",
            "data": [
                {"object": "embedding", "index": i, "embedding": v.tolist(), "truncated": tr}
                for i, (v, tr, _) in enumerate(outputs)
            ],
            "model": self.model_name,
            "usage": {"prompt_tokens": n_tok, "total_tokens": n_tok},
        }
