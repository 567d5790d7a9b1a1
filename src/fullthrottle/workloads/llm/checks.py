"""The LLM engine's argument checks: integer settings, prompts' token ids, and whether a KV cache fits
the device's free memory before it is allocated."""

from __future__ import annotations

import torch


def check_int(name: str, value, lowest: int) -> int:
    """``value`` if it is an int (not a bool) ``>= lowest``; else ValueError naming ``name``."""
    if not isinstance(value, int) or isinstance(value, bool) or value < lowest:
        raise ValueError(f"{name} must be an integer >= {lowest}, got {value!r}")
    return value


def check_prompt(prompt, vocab_size: int, what: str = "prompt") -> None:
    """ValueError unless ``prompt`` is a non-empty sequence of token ids, ints in ``[0, vocab_size)``."""
    if len(prompt) == 0:
        raise ValueError(f"{what} is empty")
    for t in prompt:
        if not isinstance(t, int) or isinstance(t, bool) or not 0 <= t < vocab_size:
            raise ValueError(f"{what}: token ids must be integers in [0, {vocab_size}), got {t!r}")


def free_bytes(device: torch.device) -> int | None:
    """Memory free for a new allocation on ``device`` (bytes): the GPU's free memory and the unused
    part of PyTorch's cache on it, or the host's MemAvailable (Linux); None where it cannot be read."""
    if device.type == "cuda":  # (and what PyTorch's caching allocator holds unused: it gives that back first)
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


def check_kv_memory(model, slots: int, what: str, hint: str) -> None:
    """ValueError when a KV cache of ``slots`` token positions in all (keys and values of every layer
    of ``model``, a Llama, in its dtype) needs more than 90% of its device's free memory, counting the
    cache it holds now as free (a new one replaces it); ``what``: the cache's shape in words, ``hint``:
    what to ask for instead, for the message. Nothing is allocated here."""
    cfg, p = model.cfg, next(model.parameters())
    need = 2 * cfg.num_hidden_layers * slots * cfg.num_key_value_heads * cfg.head_dim * p.dtype.itemsize
    free = free_bytes(p.device)
    if free is None:
        return
    for blk in model.layers:
        for t in (blk.self_attn.k_cache, blk.self_attn.v_cache):
            free += 0 if t is None else t.numel() * t.element_size()
    if need > 0.9 * free:
        raise ValueError(
            f"the KV cache ({what}) needs {need / 2**30:.1f} GiB and {p.device} has {free / 2**30:.1f} GiB free: {hint}"
        )
