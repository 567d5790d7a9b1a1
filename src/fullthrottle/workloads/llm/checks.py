"""The LLM engine's argument checks: integer settings, prompts' token ids, and whether a KV cache fits
the device's free memory before it is allocated."""

from __future__ import annotations

import numbers
import operator

import torch

from ...core.config import LlmSettings


def check_int(name: str, value, lowest: int) -> int:
    """``value`` as an int if it is an integer (not a bool; numpy's too) ``>= lowest``; else
    ValueError naming ``name``."""
    if not isinstance(value, numbers.Integral) or isinstance(value, bool) or value < lowest:
        raise ValueError(f"{name} must be an integer >= {lowest}, got {value!r}")
    return int(value)


def as_ids(prompt, what: str = "prompt") -> list:
    """A prompt's token ids as a list: a list or tuple as it is, a 1-D integer array or tensor (numpy,
    torch) as Python ints (:func:`check_prompt` then checks them).

    Raises:
        ValueError: anything else (a bare id, a string: ``generate`` takes a list of prompts)."""
    if not isinstance(prompt, (list, tuple)) and hasattr(prompt, "tolist") and getattr(prompt, "ndim", 0) == 1:
        prompt = prompt.tolist()
    if not isinstance(prompt, (list, tuple)):
        raise ValueError(
            f"{what} must be a list of token ids, got {type(prompt).__name__} (prompts are a list of them: "
            "one prompt alone is [ids])"
        )
    return [_index(t) for t in prompt]


def _index(t):
    """An integer-like id (numpy's, a 0-d tensor's) as an int; anything else as it is (for the check)."""
    if isinstance(t, int):
        return t
    try:
        return operator.index(t)
    except TypeError:
        return t


def check_prompt(prompt, vocab_size: int, what: str = "prompt") -> None:
    """ValueError unless ``prompt`` is a non-empty sequence of token ids, ints in ``[0, vocab_size)``."""
    if len(prompt) == 0:
        raise ValueError(f"{what} is empty")
    for t in prompt:
        if not isinstance(t, int) or isinstance(t, bool) or not 0 <= t < vocab_size:
            raise ValueError(f"{what}: token ids must be integers in [0, {vocab_size}), got {t!r}")


#: token ids that may end one request (the model's end-of-sequence ids and the request's own)
MAX_STOP_IDS = 16


def stop_ids(ids, vocab_size: int, what: str = "stop token ids") -> tuple[int, ...]:
    """``ids`` (None, one token id, or a sequence of them, as ``eos_token_id`` in a Hugging Face
    config.json) as a tuple without repeats, in order. ValueError unless each is a token id of the
    vocabulary and there are at most :data:`MAX_STOP_IDS`."""
    ids = () if ids is None else tuple(ids) if isinstance(ids, (list, tuple)) else (ids,)
    for t in ids:
        if not isinstance(t, int) or isinstance(t, bool) or not 0 <= t < vocab_size:
            raise ValueError(f"{what} must be token ids below {vocab_size}, got {t!r}")
    ids = tuple(dict.fromkeys(ids))
    if len(ids) > MAX_STOP_IDS:
        raise ValueError(f"{what}: at most {MAX_STOP_IDS}, got {len(ids)}")
    return ids


def check_request(gen, prompt, max_new_tokens, what: str = "prompt") -> None:
    """ValueError unless ``prompt`` (:func:`check_prompt`) and ``max_new_tokens`` (an integer >= 1)
    fit the Generator ``gen``: its KV cache's length and, paged, all its KV pages (``what``: the
    request, in words, for the messages)."""
    check_prompt(prompt, gen.model.cfg.vocab_size, what)
    check_int("max_new_tokens", max_new_tokens, 1)
    n = len(prompt)
    if n + max_new_tokens > gen.max_seq_len:
        raise ValueError(
            f"{what}: {n} tokens + max_new_tokens {max_new_tokens} exceeds max_seq_len {gen.max_seq_len}: "
            "they must fit the KV cache"
        )
    if gen.kv is not None:
        gen.kv.check_pool(f"{what}: {n} tokens + max_new_tokens {max_new_tokens}", n + max_new_tokens)


def free_bytes(device: torch.device) -> int | None:
    """Memory free for a new allocation on ``device`` (bytes): the GPU's free memory and the unused
    part of PyTorch's cache on it, or the host's MemAvailable (Linux); None where it cannot be read."""
    if device.type == "cuda":  # (the caching allocator gives its unused blocks back before failing)
        unused = torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device)
        return torch.cuda.mem_get_info(device)[0] + unused
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


#: the share of a device's free memory a KV cache may take (the rest: activations, graphs, the allocator's slack)
KV_MEMORY_SHARE = 0.9


def _kv_bytes_and_free(model, dtype: torch.dtype | None = None) -> tuple[int, int | None]:
    """Bytes of keys and values per token position of ``model`` (a Llama: every layer, in ``dtype``,
    default its own), and its device's free memory counting the KV cache it holds now as free (a new
    one replaces it)."""
    cfg, p = model.cfg, next(model.parameters())
    per_token = 2 * cfg.num_hidden_layers * cfg.num_key_value_heads * cfg.head_dim * (dtype or p.dtype).itemsize
    free = free_bytes(p.device)
    if free is not None:
        for blk in model.layers:
            for t in (blk.self_attn.k_cache, blk.self_attn.v_cache):
                free += 0 if t is None else t.numel() * t.element_size()
    return per_token, free


#: the KV cache length a server (or a stream of requests) gets where none is given: the model's
#: context, at most this many positions
SERVING_CONTEXT = 4096


def serving_context(cfg) -> int:
    """The KV cache length for requests not known in advance (``serve``, ``generate --prompts -`` on
    a pipe) where none is given: the model's context, at most :data:`SERVING_CONTEXT` positions."""
    return min(cfg.max_position_embeddings, SERVING_CONTEXT)


def check_kv_memory(
    model, slots: int, what: str, hint: str, dtype: torch.dtype | None = None, prefill_tokens: int = 0
) -> None:
    """ValueError when a KV cache of ``slots`` token positions in all (keys and values of every layer
    of ``model``, a Llama, in ``dtype``, default its own) needs more than :data:`KV_MEMORY_SHARE` of its
    device's free memory, counting the cache it holds now as free, once the activations of a prefill
    of ``prefill_tokens`` tokens (:func:`prefill_bytes`) are set aside; ``what``: the cache's shape in
    words, ``hint``: what to ask for instead, for the message. Nothing is allocated here."""
    per_token, free = _kv_bytes_and_free(model, dtype)
    need, aside = slots * per_token, prefill_bytes(model, prefill_tokens)
    if free is not None and need > KV_MEMORY_SHARE * (free - aside):
        also = f", {aside / 2**30:.1f} GiB of them set aside for a prefill of {prefill_tokens} tokens" if aside else ""
        raise ValueError(
            f"the KV cache ({what}) needs {need / 2**30:.1f} GiB and {next(model.parameters()).device} has "
            f"{free / 2**30:.1f} GiB free{also}: {hint}" + (" or a smaller max_prefill_tokens" if aside else "")
        )


def prefill_bytes(model, tokens: int) -> int:
    """An estimate of the activations one prefill forward of ``tokens`` tokens holds at once in a
    layer of ``model`` (a Llama): the residual stream, its norm, q/k/v, the attention output and the
    o-projection's (about 8 x hidden per token), and the MLP's gate, up and product (3 x intermediate),
    in the model's dtype."""
    cfg, p = model.cfg, next(model.parameters())
    return tokens * (8 * cfg.hidden_size + 3 * cfg.intermediate_size) * p.element_size()


def pages_that_fit(
    model, page: int, kv_dtype: str = "auto", prefill_tokens: int = LlmSettings.max_prefill_tokens
) -> int:
    """How many KV pages of ``page`` tokens (of the KV dtype named ``kv_dtype``:
    :data:`~fullthrottle.workloads.llm.kv_pages.KV_DTYPES`) fit in :data:`KV_MEMORY_SHARE` of the free
    memory of ``model``'s device (its current KV cache counted as free; one page of the pool is never
    handed out), as vLLM sizes its pool by ``gpu_memory_utilization``, once the activations of a
    prefill of ``prefill_tokens`` tokens (the Generator's ``max_prefill_tokens``: :func:`prefill_bytes`)
    are set aside.

    Raises:
        ValueError: the free memory cannot be read, not even one page fits, or an unknown ``kv_dtype``.
    """
    from .kv_pages import kv_dtype as dtype_of

    per_token, free = _kv_bytes_and_free(model, dtype_of(kv_dtype, next(model.parameters()).dtype))
    if free is None:
        raise ValueError("the free memory of this device cannot be read: give the number of KV pages")
    room = free - prefill_bytes(model, prefill_tokens)
    pages = int(KV_MEMORY_SHARE * room // (page * per_token)) - 1
    if pages < 1:
        raise ValueError(
            f"no KV page of {page} tokens fits in {free / 2**30:.2f} GiB free, with "
            f"{prefill_bytes(model, prefill_tokens) / 2**30:.2f} GiB set aside for a prefill of {prefill_tokens} tokens"
        )
    return pages
