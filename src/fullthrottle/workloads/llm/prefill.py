"""Prefill: prompts into the KV cache, packed with no padding (variable-length attention).

The prompts (or prompt chunks) of one forward are laid end to end as one sequence of T tokens, each
piece attending causally to its own cache row (:func:`~fullthrottle.core.kernels.prefill_attention`),
so the matrix products take T rows, whatever the mix of lengths, and the forward costs what its
tokens cost. A piece may start past position 0 (a chunk of a long prompt, or a context prefilled
again after a preemption): it reads the keys its row already holds.

Forwards of up to ``graph_tokens`` tokens replay CUDA graphs, one per token bucket (16, 32, 64, ...):
short forwards are bound by the host's kernel launches. A graph's padding tokens go to the spare
cache row, its padding pieces are empty.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from ...core.kernels.varlen import max_query_blocks, query_blocks

#: one piece of prefill work: (cache row, the context's tokens, first position, stop position):
#: tokens ``ctx[start:stop]`` into ``row`` at positions ``[start, stop)``
Piece = tuple[int, Sequence[int], int, int]


def token_buckets(graph_tokens: int) -> list[int]:
    """The token counts prefill graphs are captured for: 16, 32, 64, ... up to ``graph_tokens``."""
    return [16 * 2**i for i in range(20) if 16 * 2**i <= graph_tokens]


@dataclass
class Packed:
    """One packed forward's index tensors, all int64 views of one flat buffer (one H2D copy):

    ``ids``, ``pos``, ``tok_rows`` ``(T,)``: each token's id, position and cache row; ``rows``,
    ``start`` ``(N,)``: each piece's cache row and first position; ``cu`` ``(N+1,)``: the pieces'
    offsets in the sequence; ``last`` ``(N,)``: each piece's last token; ``blk_seg``, ``blk_m0``
    ``(NB,)``: the attention kernel's grid (:func:`~fullthrottle.core.kernels.prefill_attention.query_blocks`).
    """

    ids: torch.Tensor
    pos: torch.Tensor
    tok_rows: torch.Tensor
    rows: torch.Tensor
    start: torch.Tensor
    cu: torch.Tensor
    last: torch.Tensor
    blk_seg: torch.Tensor
    blk_m0: torch.Tensor

    @staticmethod
    def size(T: int, N: int, NB: int) -> int:
        return 3 * T + 4 * N + 1 + 2 * NB

    @classmethod
    def view(cls, flat: torch.Tensor, T: int, N: int, NB: int) -> Packed:
        parts = flat[: cls.size(T, N, NB)].split([T, T, T, N, N, N + 1, N, NB, NB])
        return cls(*parts)

    @staticmethod
    def build(pieces: Sequence[Piece], T: int, N: int, NB: int, pad_row: int) -> torch.Tensor:
        """The flat host buffer of ``pieces`` padded to ``T`` tokens, ``N`` pieces and ``NB`` blocks
        (padding tokens: position 0 of ``pad_row``; padding pieces: empty; padding blocks: -1)."""
        ids, pos, tok_rows, cu = [], [], [], [0]
        for row, ctx, a, b in pieces:
            ids += ctx[a:b]
            pos += range(a, b)
            tok_rows += [row] * (b - a)
            cu.append(cu[-1] + b - a)
        n = len(pieces)
        seg, m0 = query_blocks([b - a for _, _, a, b in pieces])
        flat = (
            ids + [0] * (T - len(ids)),
            pos + [0] * (T - len(pos)),
            tok_rows + [pad_row] * (T - len(tok_rows)),
            [p[0] for p in pieces] + [pad_row] * (N - n),
            [p[2] for p in pieces] + [0] * (N - n),
            cu + [cu[-1]] * (N - n),
            [c - 1 for c in cu[1:]] + [0] * (N - n),
            seg + [-1] * (NB - len(seg)),
            m0 + [0] * (NB - len(m0)),
        )
        return torch.tensor([x for part in flat for x in part], dtype=torch.long)


class Prefill:
    """Packed prefill forwards on ``model`` (a Llama with its cache set up), graphs for the small ones.

    Args:
        model: the :class:`~fullthrottle.workloads.llm.llama.Llama`.
        max_pieces: most pieces per forward (the cache rows in use).
        graph_tokens: forwards up to this many tokens replay a CUDA graph (0: none; CUDA only).
        pad_row: the spare cache row that a graph's padding tokens write into.
    """

    def __init__(self, model, max_pieces: int, graph_tokens: int = 0, pad_row: int = 0):
        self.model, self.max_pieces, self.pad_row = model, max_pieces, pad_row
        self.device = next(model.parameters()).device
        #: token buckets with a captured graph, smallest first
        self.buckets = token_buckets(graph_tokens) if graph_tokens else []
        self.graphs = None  # GraphSet keyed by token bucket

    def _sizes(self, T: int) -> tuple[int, int, int]:
        N = min(self.max_pieces, T)
        return T, N, max_query_blocks(T, N)

    @torch.inference_mode()
    def capture(self) -> None:
        """Capture a graph per token bucket, largest first, into one pool."""
        from ...core.graphs import GraphSet

        self.graphs = GraphSet(self.device)
        top = self._sizes(self.buckets[-1])
        self.flat = Packed.build([], *top, self.pad_row).to(self.device)  # all padding: a valid empty pack
        for T in reversed(self.buckets):
            pk = Packed.view(self.flat, *self._sizes(T))
            self.graphs.capture(T, lambda pk=pk: self.model.prefill(pk))
        torch.cuda.synchronize(self.device)

    @torch.inference_mode()
    def __call__(self, pieces: Sequence[Piece]) -> torch.Tensor:
        """One forward of ``pieces`` (at most ``max_pieces``, each row once): the logits of each piece's
        last token ``(len(pieces), vocab)`` float32."""
        T = sum(b - a for _, _, a, b in pieces)
        bucket = next((x for x in self.buckets if x >= T), None) if self.graphs is not None else None
        if bucket is None:  # eager, the exact sizes
            sizes = (T, len(pieces), len(query_blocks([b - a for _, _, a, b in pieces])[0]))
            flat = self._host(Packed.build(pieces, *sizes, self.pad_row)).to(self.device, non_blocking=True)
            return self.model.prefill(Packed.view(flat, *sizes))
        sizes = self._sizes(bucket)
        self.flat[: Packed.size(*sizes)].copy_(
            self._host(Packed.build(pieces, *sizes, self.pad_row)), non_blocking=True
        )
        return self.graphs.replay(bucket)[: len(pieces)]

    def _host(self, flat: torch.Tensor) -> torch.Tensor:
        # pinned for CUDA: CUDA may make a copy from pageable memory past some tens of KB (a long
        # forward's index tensors) wait for the work queued on the stream, the decode launched before
        return flat.pin_memory() if self.device.type == "cuda" else flat
