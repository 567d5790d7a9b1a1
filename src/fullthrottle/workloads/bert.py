"""BERT, the encoder of sentence-transformers' models (all-MiniLM-L6-v2 and the like), in plain
PyTorch, and the mapping from a Hugging Face ``BertModel`` state dict to its parameters.

Shapes: B texts, L tokens, E hidden size (384 for MiniLM).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class BertLayer(nn.Module):
    def __init__(self, E: int, heads: int, inter: int, eps: float):
        super().__init__()
        self.heads = heads
        self.qkv = nn.Linear(E, 3 * E)  # query, key, value fused
        self.attn_out, self.attn_norm = nn.Linear(E, E), nn.LayerNorm(E, eps=eps)
        self.inter, self.out, self.out_norm = nn.Linear(E, inter), nn.Linear(inter, E), nn.LayerNorm(E, eps=eps)

    def forward(self, x, bias):
        B, L, E = x.shape  # x: (B, L, E)
        h, d = self.heads, E // self.heads

        q, k, v = self.qkv(x).view(B, L, 3, h, d).permute(2, 0, 3, 1, 4)  # each (B, h, L, d)
        y = F.scaled_dot_product_attention(q, k, v, attn_mask=bias)  # bias: (B, 1, 1, L)
        x = self.attn_norm(x + self.attn_out(y.transpose(1, 2).reshape(B, L, E)))
        return self.out_norm(x + self.out(F.gelu(self.inter(x))))  # exact (erf) GELU, like BERT


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
        self.layers = nn.ModuleList(
            BertLayer(E, cfg["num_attention_heads"], cfg["intermediate_size"], eps)
            for _ in range(cfg["num_hidden_layers"])
        )

    def forward(self, ids, mask):
        L = ids.shape[1]
        x = self.word(ids) + self.pos.weight[:L] + self.type_emb.weight[0]  # (B, L, E)
        x = self.norm(x)
        bias = (1.0 - mask[:, None, None, :].to(x.dtype)) * torch.finfo(x.dtype).min  # padding -> -inf
        for layer in self.layers:
            x = layer(x, bias)
        return x


_HF_NAMES = {  # our parameter name prefix <- Hugging Face BertModel's
    "word.": "embeddings.word_embeddings.",
    "pos.": "embeddings.position_embeddings.",
    "type_emb.": "embeddings.token_type_embeddings.",
    "norm.": "embeddings.LayerNorm.",
}
_HF_LAYER = {
    "attn_out.": "attention.output.dense.",
    "attn_norm.": "attention.output.LayerNorm.",
    "inter.": "intermediate.dense.",
    "out.": "output.dense.",
    "out_norm.": "output.LayerNorm.",
}


def _from_hf(sd: dict[str, torch.Tensor], ours: str) -> torch.Tensor:
    """Our parameter ``ours`` from a Hugging Face BertModel state dict (``qkv`` = query, key, value stacked)."""
    if ".qkv." in ours:
        _, i, rest = ours.split(".", 2)
        kind = rest.split(".", 1)[1]
        return torch.cat([sd[f"encoder.layer.{i}.attention.self.{n}.{kind}"] for n in ("query", "key", "value")])
    return sd[_hf_key(ours)]


def _hf_key(ours: str) -> str:
    for a, b in _HF_NAMES.items():
        if ours.startswith(a):
            return b + ours[len(a) :]
    _, i, rest = ours.split(".", 2)
    for a, b in _HF_LAYER.items():
        if rest.startswith(a):
            return f"encoder.layer.{i}.{b}{rest[len(a) :]}"
    raise KeyError(ours)
