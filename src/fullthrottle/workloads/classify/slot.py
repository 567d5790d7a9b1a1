"""One entry of the compute stage's staging ring (:class:`~fullthrottle.workloads.classify.compute.Engine`):
a batch's host and device buffers, its top-k outputs and the events that order them."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch


@dataclass
class Slot:
    """One entry of the staging ring: host and device buffers plus the events that order them."""

    index: int
    host_in: torch.Tensor  # (maxB, S, S, 3) uint8, pinned on CUDA
    host_np: np.ndarray  # numpy view of host_in (filled without torch ops)
    dev_in: torch.Tensor  # (maxB, S, S, 3) uint8 on the device (host_in itself on CPU)
    out_probs: torch.Tensor | None = None  # (maxB, k) float32, pinned on CUDA (fit_outputs)
    out_idx: torch.Tensor | None = None  # (maxB, k) int64, pinned on CUDA
    copied: torch.cuda.Event | None = None
    done: torch.cuda.Event | None = None
    n: int = 0
    k: int = 0
    error: str | None = None
    host_rows: torch.Tensor | None = None  # (maxB,) int64, pinned: crop-pool rows of this batch
    dev_rows: torch.Tensor | None = None  # the same on the device (gather indices)
    mapped_rows: torch.Tensor | None = None  # host_rows as the device reads it in place (zero-copy)
    pool_rows: list | None = None  # crop-pool rows to give back when the slot is released
    row_errors: dict | None = None  # row -> its error, when the batch failed and its rows ran one by one

    def fit_outputs(self, k: int, pinned: bool) -> None:
        """Make :attr:`out_probs` and :attr:`out_idx` ``(maxB, k)`` (``maxB``: the rows of
        :attr:`host_in`; ``pinned``: in pinned memory) unless they are that wide already. ``k`` is
        the top-k clamped to the model's classes (``min(top_k, C)``), never the top-k as configured,
        which may be any integer: the buffers stay as small as the model's output."""
        if self.out_probs is not None and self.out_probs.shape[1] >= k:
            return
        rows = self.host_in.shape[0]
        self.out_probs = torch.zeros((rows, k), dtype=torch.float32, pin_memory=pinned)
        self.out_idx = torch.zeros((rows, k), dtype=torch.int64, pin_memory=pinned)
