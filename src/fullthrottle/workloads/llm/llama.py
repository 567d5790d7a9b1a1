"""A Llama-architecture decoder in plain PyTorch, with a static KV cache (after gpt-fast's model.py).

RMSNorm, rotary embeddings (with Llama-3 frequency scaling), grouped-query attention, SwiGLU.
Module and parameter names mirror Hugging Face's ``LlamaForCausalLM`` (minus the ``model.`` prefix),
so its ``config.json`` + safetensors shards load directly, without transformers at run time.

Shapes: B batch rows, S new tokens, T cache length, H query heads, Hkv key/value heads, D head dim.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from ...core import kernels
from .kv_pages import PAGE


@dataclass
class LlamaConfig:
    vocab_size: int = 32000
    hidden_size: int = 4096
    intermediate_size: int = 11008
    num_hidden_layers: int = 32
    num_attention_heads: int = 32
    num_key_value_heads: int = 32
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    max_position_embeddings: int = 4096
    rope_scaling: dict | None = None
    tie_word_embeddings: bool = False
    bos_token_id: int | None = 1
    eos_token_id: int | list | None = 2
    head_dim: int | None = None
    extra: dict = field(default_factory=dict)

    def __post_init__(self):
        if self.head_dim is None:
            self.head_dim = self.hidden_size // self.num_attention_heads

    @classmethod
    def from_dict(cls, d: dict) -> LlamaConfig:
        """From a Hugging Face ``config.json`` dict (unknown keys kept in ``extra``).

        Reads both layouts: ``rope_theta`` + ``rope_scaling`` at top level (transformers 4), and
        ``rope_parameters`` (transformers 5).
        """
        d = dict(d)
        rp = d.get("rope_parameters")
        if isinstance(rp, dict):
            d.setdefault("rope_theta", rp.get("rope_theta", 10000.0))
            if rp.get("rope_type", "default") != "default":
                d.setdefault("rope_scaling", rp)
        names = set(cls.__dataclass_fields__) - {"extra"}
        return cls(**{k: v for k, v in d.items() if k in names}, extra={k: v for k, v in d.items() if k not in names})

    @classmethod
    def llama2_7b(cls) -> LlamaConfig:
        return cls()


def rope_inv_freq(cfg: LlamaConfig) -> torch.Tensor:
    """Inverse frequencies ``(D/2,)`` float32, scaled as ``rope_scaling`` asks.

    Supported: none / ``"default"``; ``"linear"`` (positions divided by ``factor``: every frequency
    divided by it, HF ``_compute_linear_scaling_rope_parameters``); ``"llama3"`` (Llama 3.1, Meta's
    reference code; HF ``_compute_llama3_parameters``): wavelengths longer than ``original_max /
    low_freq_factor`` are divided by ``factor``, shorter than ``original_max / high_freq_factor``
    kept, and those between interpolated smoothly.

    Raises:
        ValueError: another rope type (dynamic, yarn, longrope, ...), which would give wrong tokens.
    """
    d = cfg.head_dim
    inv = 1.0 / (cfg.rope_theta ** (torch.arange(0, d, 2, dtype=torch.int64).float() / d))
    rs = cfg.rope_scaling or {}
    kind = rs.get("rope_type", rs.get("type", "default"))
    if kind in ("default", None):
        return inv
    if kind == "linear":
        return inv / float(rs["factor"])
    if kind != "llama3":
        raise ValueError(f"rope_scaling type {kind!r} is not supported (default, linear and llama3 are)")
    factor, lo, hi = rs["factor"], rs["low_freq_factor"], rs["high_freq_factor"]
    old = rs["original_max_position_embeddings"]
    wavelen = 2 * math.pi / inv
    scaled = torch.where(wavelen > old / lo, inv / factor, inv)
    smooth = (old / wavelen - lo) / (hi - lo)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = (wavelen >= old / hi) & (wavelen <= old / lo)
    return torch.where(medium, smoothed, scaled)


#: largest batch whose decode-step attention runs as the Triton kernel (kernels.decode_attention);
#: larger batches use cuDNN's attention through F.scaled_dot_product_attention
DECODE_ATTENTION_MAX_BATCH = 1


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x, residual=None):
        # one kernel; float32 inside, like HF's x.float() * rsqrt(mean(x^2) + eps). With ``residual``:
        # returns (x + residual, norm(x + residual)), the add fused in
        return kernels.rms_norm(x, self.weight, self.eps, residual)


class Attention(nn.Module):
    def __init__(self, cfg: LlamaConfig):
        super().__init__()
        self.h, self.hkv, self.d = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        # q, k and v projections fused into one matmul (HF's q_proj, k_proj, v_proj stacked on load,
        # each head's rows pair-interleaved: kernels.PAIRED_LAYOUT)
        self.qkv_proj = nn.Linear(cfg.hidden_size, (self.h + 2 * self.hkv) * self.d, bias=False)
        self.o_proj = nn.Linear(self.h * self.d, cfg.hidden_size, bias=False)
        self.k_cache: torch.Tensor | None = None  # (maxB, Hkv, T, D)
        self.v_cache: torch.Tensor | None = None
        self.counters: torch.Tensor | None = None  # (maxB * H,) int32: decode attention's merge counts
        self.block_table: torch.Tensor | None = None  # paged KV memory: (rows, P) int64 (kv_pages.py)
        self.setting: dict = {}  # paged_decode_attention's warps, per and sub (kernels.paged_setting)

    def forward(self, x, cos, sin, pos, row0, mask, kv_len):
        if not isinstance(row0, int):  # a packed prefill (prefill.Packed)
            return self.prefill(x, cos, sin, row0)
        if self.block_table is not None:
            return self.forward_paged(x, cos, sin, pos, row0, mask, kv_len)
        B, S, _ = x.shape  # x: (B, S, dim)
        h, hkv, d = self.h, self.hkv, self.d
        # the q/k/v projection (B, S, (H+2*Hkv)*D), RoPE on q and k, k and v written into the cache at
        # ``pos``: one kernel for a single token on CUDA, two otherwise; cos, sin: (B, S, D/2)
        q = kernels.linear_rope_qkv_into_cache(
            x, self.qkv_proj.weight, cos, sin, pos, self.k_cache, self.v_cache, row0, h, hkv
        )  # (B, H, S, D)
        T = kv_len  # attend to cache slots [0, T) only
        if mask is None:
            # decode step: split-KV Triton kernels read each row's valid slots 0..pos only
            y = kernels.decode_attention(q, self.k_cache, self.v_cache, pos, row0, T, self.counters)  # (B, H, 1, D)
        else:
            kc, vc = self.k_cache[row0 : row0 + B, :, :T], self.v_cache[row0 : row0 + B, :, :T]  # (B, Hkv, T, D)
            rep = h // hkv  # grouped-query attention
            if rep > 1:  # (a copy: with rep == 1, as in Llama-2-7B, the cache is read in place)
                kc, vc = kc.repeat_interleave(rep, dim=1), vc.repeat_interleave(rep, dim=1)
            y = F.scaled_dot_product_attention(q, kc, vc, attn_mask=mask)  # mask: (B, 1, S, T) additive
        return kernels.linear(y.transpose(1, 2).reshape(B, S, h * d), self.o_proj.weight)

    def prefill(self, x, cos, sin, pk):
        # packed prompts (prefill.Packed): T tokens of N pieces end to end, each piece's k and v written
        # into its row at its positions, then each token attends to its row's positions up to its own
        _, T, _ = x.shape  # x: (1, T, dim); cos, sin: (1, T, D/2)
        h, hkv, d = self.h, self.hkv, self.d
        if self.block_table is not None:  # paged: RoPE, then k and v into the tokens' pages, one kernel
            return self._prefill_attention(self._qkv_into_pages(x, cos, sin, pk.pos[None], pk.tok_rows[None]), pk, T)
        kt = torch.empty(1, hkv, T, d, dtype=x.dtype, device=x.device)
        vt = torch.empty_like(kt)
        slots = torch.arange(T, device=x.device)[None]
        q = kernels.linear_rope_qkv_into_cache(
            x, self.qkv_proj.weight, cos, sin, slots, kt, vt, 0, h, hkv
        )  # (1, H, T, D); kt, vt: (1, Hkv, T, D)
        self.k_cache[pk.tok_rows, :, pk.pos] = kt[0].transpose(0, 1)  # (T, Hkv, D)
        self.v_cache[pk.tok_rows, :, pk.pos] = vt[0].transpose(0, 1)
        return self._prefill_attention(q, pk, T)

    def _qkv_into_pages(self, x, cos, sin, pos, rows):
        # x (B, S, dim) -> q (B, H, S, D), rotated; k, v into paged KV memory at pos, rows (B, S)
        qkv = kernels.linear(x, self.qkv_proj.weight)
        c, bt = (self.k_cache, self.v_cache), self.block_table
        return kernels.rope_qkv_into_pages(qkv, cos, sin, pos, *c, bt, rows, self.h, self.hkv)

    def _prefill_attention(self, q, pk, T):
        # each packed token over its row's keys up to its own position, then the output projection
        y = kernels.prefill_attention(
            q[0].transpose(0, 1),
            self.k_cache,
            self.v_cache,
            pk.rows,
            pk.start,
            pk.cu,
            pk.blk_seg,
            pk.blk_m0,
            self.block_table,
        )  # (T, H, D)
        return kernels.linear(y.reshape(1, T, self.h * self.d), self.o_proj.weight)

    def forward_paged(self, x, cos, sin, pos, row0, mask, kv_len):
        # as forward, over paged KV memory (kv_pages.py): the pages are k_cache, v_cache
        # (num_pages + 1, Hkv, PAGE, D), found through the block table (rows, P)
        B, S, _ = x.shape  # x: (B, S, dim); pos: (B, S); rows row0..row0+B
        h, hkv, d = self.h, self.hkv, self.d
        rows = torch.arange(row0, row0 + B, device=x.device)
        if B * S == 1:  # one token: the q/k/v GEMV with RoPE in its epilogue, into a one-slot cache, then its page
            kt = torch.empty(B, hkv, S, d, dtype=x.dtype, device=x.device)
            vt = torch.empty_like(kt)
            slots = torch.zeros(B, S, dtype=torch.long, device=x.device)
            q = kernels.linear_rope_qkv_into_cache(x, self.qkv_proj.weight, cos, sin, slots, kt, vt, 0, h, hkv)
            kernels.write_pages(self.k_cache, self.v_cache, self.block_table, rows, pos, kt, vt)
        else:  # RoPE, then k and v into their pages in one kernel
            q = self._qkv_into_pages(x, cos, sin, pos, rows[:, None].expand(B, S))  # (B, H, S, D)
        if mask is None:  # decode step: split-KV Triton kernels read each row's pages in place
            y = kernels.paged_decode_attention(
                q, self.k_cache, self.v_cache, self.block_table, pos, row0, kv_len, self.counters, **self.setting
            )  # (B, H, 1, D)
        else:  # (a copy of the rows' first kv_len positions)
            kc = kernels.gather_pages(self.k_cache, self.block_table, rows, kv_len)  # (B, Hkv, T, D)
            vc = kernels.gather_pages(self.v_cache, self.block_table, rows, kv_len)
            kc, vc = kc.to(q.dtype), vc.to(q.dtype)  # (float8 KV memory)
            if h // hkv > 1:
                kc, vc = kc.repeat_interleave(h // hkv, dim=1), vc.repeat_interleave(h // hkv, dim=1)
            y = F.scaled_dot_product_attention(q, kc, vc, attn_mask=mask)  # mask: (B, 1, S, T) additive
        return kernels.linear(y.transpose(1, 2).reshape(B, S, h * d), self.o_proj.weight)


class MLP(nn.Module):
    def __init__(self, cfg: LlamaConfig):
        super().__init__()
        # gate and up projections fused into one matmul (HF's gate_proj, up_proj rows alternating)
        self.gate_up_proj = nn.Linear(cfg.hidden_size, 2 * cfg.intermediate_size, bias=False)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)

    def forward(self, x):
        # SwiGLU: silu(x W_gate) * (x W_up), (B, S, I), one kernel for a single token on CUDA; down: (B, S, dim)
        return kernels.linear(kernels.linear_silu_mul(x, self.gate_up_proj.weight), self.down_proj.weight)


class Block(nn.Module):
    def __init__(self, cfg: LlamaConfig):
        super().__init__()
        self.self_attn = Attention(cfg)
        self.mlp = MLP(cfg)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(self, x, r, cos, sin, pos, row0, mask, kv_len):
        # x: the residual stream (B, S, dim); r: the previous block's MLP output, still to be added
        # (None in the first block), so that each residual add is fused into the RMSNorm after it
        if r is None:
            xn = self.input_layernorm(x)
        else:
            x, xn = self.input_layernorm(x, residual=r)  # x + r, and its norm
        a = self.self_attn(xn, cos, sin, pos, row0, mask, kv_len)
        x, hn = self.post_attention_layernorm(x, residual=a)  # x + a, and its norm
        return x, self.mlp(hn)  # the block's output is x + mlp


class Llama(nn.Module):
    """``forward(tokens (B, S) int64, pos (B, S) int64, row0)`` -> logits ``(B, S, vocab)`` float32.

    ``pos`` are the tokens' positions (also their KV-cache slots); rows ``row0..row0+B`` of the cache
    are used; attention reads cache slots ``[0, kv_len)`` (set ``kv_len`` > every position in ``pos``;
    it defaults to the whole cache). Call :meth:`setup_cache` first.
    """

    def __init__(self, cfg: LlamaConfig):
        super().__init__()
        self.cfg = cfg
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(Block(cfg) for _ in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight
        self.register_buffer("inv_freq", rope_inv_freq(cfg), persistent=False)
        self.max_seq_len = 0
        self.kv_len = 0  # cache slots attention reads (a static length per captured graph)
        self.block_table: torch.Tensor | None = None  # paged KV memory's (rows, P) int64, or None

    def setup_cache(self, max_batch: int, max_seq_len: int, owner=None) -> None:
        """Preallocate the static KV cache: per layer ``(max_batch, Hkv, max_seq_len, D)``, zeros.
        ``owner`` (kept as :attr:`cache_owner`): who uses it (a Generator checks that it still does)."""
        self.cache_owner = owner
        p = next(self.parameters())
        for blk in self.layers:
            a = blk.self_attn
            a.k_cache = torch.zeros(max_batch, a.hkv, max_seq_len, a.d, dtype=p.dtype, device=p.device)
            a.v_cache = torch.zeros_like(a.k_cache)
        # one set of merge counters for all layers (they run one after another; each leaves it zero)
        counters = torch.zeros(max_batch * self.cfg.num_attention_heads, dtype=torch.int32, device=p.device)
        for blk in self.layers:
            blk.self_attn.counters = counters
        self.max_seq_len = self.kv_len = max_seq_len
        self.block_table = None
        for blk in self.layers:
            blk.self_attn.block_table = None

    def setup_paged_cache(
        self, rows: int, max_seq_len: int, num_pages: int, owner=None, dtype: torch.dtype | None = None
    ) -> None:
        """Paged KV memory (:mod:`~fullthrottle.workloads.llm.kv_pages`) instead of the static cache:
        per layer ``(num_pages + 1, Hkv, PAGE, D)`` zeros (page 0: where unused entries point) in
        ``dtype`` (default: the model's; or float8 e4m3, :data:`~fullthrottle.workloads.llm.kv_pages.KV_DTYPES`)
        and one block table ``(rows, ceil(max_seq_len / PAGE))`` int64, zeros, shared by every layer."""
        self.setup_cache(rows, 1, owner)  # (the merge counters; its one-slot caches are replaced)
        p = next(self.parameters())
        self.block_table = torch.zeros(rows, -(-max_seq_len // PAGE), dtype=torch.long, device=p.device)
        for blk in self.layers:
            a = blk.self_attn
            a.k_cache = torch.zeros(num_pages + 1, a.hkv, PAGE, a.d, dtype=dtype or p.dtype, device=p.device)
            a.v_cache = torch.zeros_like(a.k_cache)
            a.block_table = self.block_table
            a.setting = kernels.paged_setting()  # (the decode attention kernel's, for trials)
        self.max_seq_len = self.kv_len = max_seq_len

    def forward(self, tokens: torch.Tensor, pos: torch.Tensor, row0: int = 0) -> torch.Tensor:
        x = self.embed_tokens(tokens)  # (B, S, dim)
        freqs = pos[..., None].float() * self.inv_freq  # (B, S, D/2) float32
        cos, sin = freqs.cos(), freqs.sin()
        B, S = tokens.shape
        paged = self.block_table is not None  # (paged: the kernel at every batch size)
        if S == 1 and (paged or B <= DECODE_ATTENTION_MAX_BATCH) and kernels.use_triton(x):
            mask = None  # decode step: the attention kernel bounds each row by its own position
        else:
            t = torch.arange(self.kv_len, device=tokens.device)
            causal = t[None, None, None, :] <= pos[:, None, :, None]  # (B, 1, S, T)
            # additive mask, made once here rather than converted from bool by every layer's attention
            mask = torch.zeros(causal.shape, dtype=x.dtype, device=x.device).masked_fill_(~causal, float("-inf"))
        r = None
        for blk in self.layers:
            x, r = blk(x, r, cos, sin, pos, row0, mask, self.kv_len)
        xn = self.norm(x) if r is None else self.norm(x, residual=r)[1]  # the last block's add, fused
        return kernels.linear(xn, self.lm_head.weight).float()  # (B, S, vocab)

    def prefill(self, pk) -> torch.Tensor:
        """Prompts (or chunks of them) into the KV cache, packed with no padding: ``pk`` a
        :class:`~fullthrottle.workloads.llm.prefill.Packed` of N pieces, T tokens. Each piece's keys and
        values go into its cache row at its positions and its tokens attend causally to the row's
        positions up to theirs (earlier chunks included). Returns the logits of each piece's last
        token ``(N, vocab)`` float32. Graph-safe (no host sync) on CUDA with Triton."""
        freqs = pk.pos[None, :, None].float() * self.inv_freq  # (1, T, D/2) float32
        cos, sin = freqs.cos(), freqs.sin()
        x = self.embed_tokens(pk.ids[None])  # (1, T, dim)
        r = None
        for blk in self.layers:
            x, r = blk(x, r, cos, sin, pk.pos, pk, None, 0)
        x, r = x[:, pk.last], r[:, pk.last]  # (1, N, dim): each piece's last token
        xn = self.norm(x, residual=r)[1]
        return kernels.linear(xn, self.lm_head.weight).float()[0]  # (N, vocab)


def fuse_hf_projections(sd: dict, head_dim: int) -> dict:
    """Stack HF's ``q_proj``/``k_proj``/``v_proj`` weights into ``qkv_proj`` and ``gate_proj``/``up_proj``
    into ``gate_up_proj``, rows pair-interleaved (:data:`fullthrottle.core.kernels.PAIRED_LAYOUT`): within
    each q/k/v head the rows of dims ``d`` and ``d + head_dim/2`` side by side, and gate and up rows
    alternating. One matmul gives the same outputs as HF's three (two), in that order."""
    out = dict(sd)
    for prefix in sorted({k.rsplit(".", 2)[0] for k in sd if k.endswith(".q_proj.weight")}):
        qkv = torch.cat([out.pop(f"{prefix}.{n}_proj.weight") for n in ("q", "k", "v")])  # (n*D, dim)
        out[f"{prefix}.qkv_proj.weight"] = kernels.interleave_pairs(qkv, head_dim, dim=0).contiguous()
    for prefix in sorted({k.rsplit(".", 2)[0] for k in sd if k.endswith(".gate_proj.weight")}):
        gate, up = out.pop(f"{prefix}.gate_proj.weight"), out.pop(f"{prefix}.up_proj.weight")  # (I, dim)
        out[f"{prefix}.gate_up_proj.weight"] = torch.stack([gate, up], dim=1).reshape(-1, gate.shape[1])
    return out


def load_hf(path: str | Path, device="cpu", dtype=torch.float32) -> Llama:
    """A Hugging Face Llama folder (``config.json`` + ``*.safetensors``) -> :class:`Llama`.

    Raises:
        FileNotFoundError: no such folder, no config.json or no safetensors shard. ValueError: weights
            that do not fit.
    """
    from safetensors.torch import load_file

    path = Path(path)
    if not path.is_dir():
        raise FileNotFoundError(f"model folder not found: {path}")
    if not (path / "config.json").is_file():
        raise FileNotFoundError(f"no config.json in {path}")
    shards = sorted(path.glob("*.safetensors"))
    if not shards:
        raise FileNotFoundError(f"no .safetensors weights in {path} (.bin pickles are not loaded)")
    cfg = LlamaConfig.from_dict(json.loads((path / "config.json").read_text()))
    with torch.device("meta"):
        model = Llama(cfg)
    sd = {}
    for s in shards:
        sd.update({k.removeprefix("model."): v for k, v in load_file(str(s)).items()})
    if cfg.tie_word_embeddings:
        sd.setdefault("lm_head.weight", sd["embed_tokens.weight"])
    sd = fuse_hf_projections({k: v for k, v in sd.items() if "rotary_emb" not in k}, cfg.head_dim)
    missing = set(model.state_dict()) - set(sd)
    unexpected = set(sd) - set(model.state_dict())
    if missing or unexpected:
        raise ValueError(
            f"weights in {path} do not fit: missing {sorted(missing)[:4]}, unexpected {sorted(unexpected)[:4]}"
        )
    model.load_state_dict(sd, assign=True)
    model.inv_freq = rope_inv_freq(cfg)
    if cfg.tie_word_embeddings:
        model.lm_head.weight = model.embed_tokens.weight
    return model.to(device, dtype).eval()
