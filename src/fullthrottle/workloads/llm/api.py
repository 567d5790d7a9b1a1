"""LLM completions as a :class:`~fullthrottle.core.workload.Workload` (``fullthrottle run``, Ray,
``serve --workload``), and the request checks it shares with the server's ``POST /v1/completions``
(:func:`completion_request`). Non-streaming: one answer per request, in OpenAI's completions shape.
Requests batched together run as one static batch of
:meth:`~fullthrottle.workloads.llm.generate.Generator.generate` (per-row sampling values and seeds).
"""

from __future__ import annotations

import os

from ...core import env
from ...core.workload import Workload


def completion_request(p: dict, gen, tok) -> dict:
    """A completions body checked against the generator ``gen`` and tokenizer ``tok`` (or None):
    ``{"ids", "max_tokens", "temperature", "top_k", "top_p", "seed", "eos"}``.

    Raises:
        ValueError: the reason, as the client should read it (the server: 400).
    """
    prompt = p.get("prompt")
    if isinstance(prompt, str):
        if tok is None:
            raise ValueError("this model has no tokenizer: send prompt as a list of token ids")
        ids = tok.encode(prompt).ids
    elif isinstance(prompt, list) and prompt and all(isinstance(i, int) and not isinstance(i, bool) for i in prompt):
        ids = prompt
    else:
        raise ValueError("prompt must be a string or a non-empty list of token ids")
    vocab = gen.model.cfg.vocab_size
    max_tokens = p.get("max_tokens", 16)
    if not isinstance(max_tokens, int) or isinstance(max_tokens, bool) or max_tokens < 1:
        raise ValueError("max_tokens must be a positive integer")
    if any(i < 0 or i >= vocab for i in ids):
        raise ValueError(f"token ids must be in [0, {vocab})")
    if len(ids) + max_tokens > gen.max_seq_len:
        raise ValueError(
            f"prompt ({len(ids)} tokens) + max_tokens ({max_tokens}) exceeds the context of {gen.max_seq_len}"
        )
    if not isinstance(p.get("stream", False), bool):
        raise ValueError("stream must be true or false")
    seed = p.get("seed")
    if seed is not None and (not isinstance(seed, int) or isinstance(seed, bool)):
        raise ValueError("seed must be an integer")
    try:
        temperature, top_k, top_p = float(p.get("temperature", 1.0)), int(p.get("top_k", 0)), float(p.get("top_p", 1.0))
        gen.check_sampling(temperature, top_k, top_p)
    except (TypeError, ValueError) as e:
        raise ValueError(str(e)) from None
    eos = gen.model.cfg.eos_token_id
    return {
        "ids": ids,
        "max_tokens": max_tokens,
        "temperature": temperature,
        "top_p": top_p,
        "top_k": top_k,
        "seed": seed,
        "eos": eos[0] if isinstance(eos, list) else eos,
    }


class Completions(Workload):
    """``{"prompt": "text" | [ids], "max_tokens", "temperature", "top_k", "top_p", "seed"}`` ->
    ``{"object": "text_completion", "choices": [{"index": 0, "text", "token_ids", "finish_reason"}],
    "usage"}``.

    Args:
        model_dir: a Hugging Face Llama folder (config.json, safetensors, tokenizer.json for text);
            ``None``: ``$FULLTHROTTLE_LLM_MODEL``.
        max_batch: requests per generate call (the KV cache's rows); max_seq_len: its length
            (default: the model's context, at most 4096).
        model: a :class:`~fullthrottle.workloads.llm.llama.Llama` already built (tests), instead of a folder.

    Raises (in :meth:`setup`):
        ValueError: no folder given or in the environment, or one that does not load.
    """

    name = "completions_offline"
    max_wait_ms = 5.0
    max_items_per_request = 1

    def __init__(self, model_dir: str | None = None, max_batch: int = 8, max_seq_len: int | None = None, model=None):
        self.model_dir = model_dir or env.get(env.LLM_MODEL) or None
        self.max_batch, self.max_seq_len, self.model = max_batch, max_seq_len, model
        self.gen = self.tok = None
        self.stats = {}

    def setup(self, device: str) -> None:
        import torch

        from .generate import Generator
        from .llama import load_hf

        model = self.model
        if model is None:
            if not self.model_dir:
                raise ValueError(f"no model: pass model_dir or set {env.LLM_MODEL} to a Llama folder")
            dtype = torch.bfloat16 if str(device).startswith("cuda") else torch.float32
            model = load_hf(self.model_dir, device, dtype)
            tj = os.path.join(self.model_dir, "tokenizer.json")
            if os.path.isfile(tj):
                from tokenizers import Tokenizer

                self.tok = Tokenizer.from_file(tj)
        seq = self.max_seq_len or min(model.cfg.max_position_embeddings, 4096)
        self.gen = Generator(model, self.max_batch, seq)
        self.max_batch = self.gen.max_batch
        self.stats = self.gen.stats  # prefill, decode

    def decode_request(self, body: dict) -> list:
        return [completion_request(body, self.gen, self.tok)]

    def predict(self, items: list) -> list:
        toks = self.gen.generate(
            [r["ids"] for r in items],
            max(r["max_tokens"] for r in items),
            [r["temperature"] for r in items],
            [r["top_k"] for r in items],
            [r["top_p"] for r in items],
            seed=[r["seed"] for r in items],
            eos_id=items[0]["eos"],
        )
        out = []
        for r, t in zip(items, toks):
            t = t[: r["max_tokens"]]
            stop = r["eos"] is not None and bool(t) and t[-1] == r["eos"]
            out.append({"prompt_tokens": len(r["ids"]), "token_ids": t, "finish_reason": "stop" if stop else "length"})
        return out

    def encode_response(self, outputs: list) -> dict:
        (o,) = outputs
        text = self.tok.decode(o["token_ids"]) if self.tok is not None else None
        n, k = o["prompt_tokens"], len(o["token_ids"])
        return {
            "object": "text_completion",
            "choices": [{"index": 0, "text": text, "token_ids": o["token_ids"], "finish_reason": o["finish_reason"]}],
            "usage": {"prompt_tokens": n, "completion_tokens": k, "total_tokens": n + k},
        }
