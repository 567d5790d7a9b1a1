"""Paged KV memory (after vLLM's PagedAttention, Kwon et al., 2023): the keys and values of every
sequence live in fixed-size pages of one pool per layer, found through a block table, so that a
sequence holds the pages its own tokens need, not a whole ``max_seq_len`` row of a static cache.

Layout, per layer: ``pages (num_pages + 1, Hkv, PAGE, D)``; page 0 is never handed out: the block
table's unused entries point to it, so writes of padding and of idle rows land there harmlessly
(nothing reads it unmasked). ``table (rows, P)`` int64, ``P = ceil(max_seq_len / PAGE)``: entry
``[row, i]`` is the page holding the row's positions ``[i*PAGE, (i+1)*PAGE)``.
"""

from __future__ import annotations

import math

import torch

from ...core.kernels.common import KV_FP8
from .step_records import h2d

#: tokens per page: the Triton decode-attention kernel's split size, so a split reads one page
PAGE = 64
#: the KV memory's dtypes by name: ``auto`` the model's; ``fp8`` float8 e4m3, half the bytes of
#: bf16 per token (as vLLM's ``--kv-cache-dtype fp8`` with its default scale of 1: values are stored
#: as they are, saturated at e4m3's largest finite value, 448)
KV_DTYPES = {"auto": None, "fp8": KV_FP8}


class PagedKV:
    """The host side of the page pool: which pages are free, which rows hold which.

    Args:
        table: the model's block table ``(rows, P)`` int64 (on its device; rows' entries are set
            here, all 0 when the row holds nothing).
        num_pages: pages that can be handed out (page 0 excluded).
        page: tokens per page.

    The scheduler gives a row the pages of its prompt when it admits it and more as its tokens grow
    (:meth:`grow`); a static batch (``Generator.generate``) reserves each row's whole length at once.
    """

    def __init__(self, table: torch.Tensor, num_pages: int, page: int = PAGE):
        self.table, self.page, self.num_pages = table, page, num_pages
        self.free = list(range(num_pages, 0, -1))  # (popped from the end: page 1 first)
        self.held: dict[int, list[int]] = {}

    def pages_for(self, tokens: int) -> int:
        """Pages that ``tokens`` positions take."""
        return math.ceil(tokens / self.page)

    def check_pool(self, what: str, tokens: int) -> None:
        """Raises ValueError if ``tokens`` positions need more pages than the whole pool has (``what``:
        the request, in words, for the message)."""
        if self.pages_for(tokens) > self.num_pages:
            raise ValueError(
                f"{what} needs more KV memory than there is: {self.num_pages} page{'s' * (self.num_pages != 1)} "
                f"of {self.page} tokens "
                f"(at most {self.num_pages * self.page} tokens)"
            )

    def reserve(self, row: int, tokens: int) -> None:
        """Pages for positions ``[0, tokens)`` of ``row`` (which holds none).

        Raises:
            RuntimeError: not enough free pages (the caller checks :meth:`pages_for` against :attr:`free`).
        """
        if row in self.held or not self.grow(row, tokens):
            n = self.pages_for(tokens)
            raise RuntimeError(f"row {row}: {n} KV pages asked, {len(self.free)} free (or the row holds some)")

    def grow(self, row: int, tokens: int) -> bool:
        """``row``'s pages extended to hold positions ``[0, tokens)``; False (none taken) if too few are free."""
        got = self.held.get(row, [])
        n = self.pages_for(tokens) - len(got)
        if n <= 0:
            return True
        if n > len(self.free):
            return False
        new = [self.free.pop() for _ in range(n)]
        self.table[row, len(got) : len(got) + n] = h2d(new, self.table.device, self.table.dtype)
        self.held[row] = got + new
        return True

    def reserve_rows(self, tokens: list[int]) -> None:
        """Rows ``0..len(tokens)-1``, row ``i`` the pages of ``tokens[i]`` positions.

        Raises:
            ValueError: they do not fit in the free pages (nothing is reserved then).
        """
        need = sum(self.pages_for(t) for t in tokens)
        if need > len(self.free):
            raise ValueError(f"these prompts need {need} KV pages of {self.page} tokens, {len(self.free)} are free")
        for row, t in enumerate(tokens):
            self.reserve(row, t)

    def release(self, row: int) -> None:
        """``row``'s pages back to the pool (nothing if it holds none)."""
        got = self.held.pop(row, None)
        if got:
            self.free += reversed(got)
            self.table[row, : len(got)] = 0

    def reset(self) -> None:
        """Every page back to the pool (whoever held them: a new owner of the engine starts clean)."""
        self.free = list(range(self.num_pages, 0, -1))
        self.held.clear()
        self.table.zero_()

    @property
    def pages_used(self) -> int:
        return self.num_pages - len(self.free)


def kv_dtype(name: str, model_dtype: torch.dtype) -> torch.dtype:
    """The dtype of KV memory named ``name`` (:data:`KV_DTYPES`) for a model in ``model_dtype``.

    Raises:
        ValueError: an unknown name.
    """
    if not isinstance(name, str) or name not in KV_DTYPES:
        raise ValueError(f"kv_dtype must be one of {', '.join(KV_DTYPES)}, got {name!r}")
    return KV_DTYPES[name] or model_dtype
