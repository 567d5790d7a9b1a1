"""A classifier's output: its contract (one row of float logits per image, :func:`check_logits`) and
its class names (the ones given, the module's own, ImageNet's, or ids: :class:`ClassLabels`)."""

from __future__ import annotations

import numpy as np
import torch

from .models import imagenet_labels


class ClassLabels:
    """Names for the columns of a model's logits ``(B, C)``.

    Args:
        given: names from the config (a sequence of str), or None.
        own: the module's own ``labels`` attribute, or None; used when nothing is given.
        owner: the module's class name (for the error).

    Without either, ImageNet's 1000 names, until :meth:`check` sees a model of another number of
    classes: then each class is named by its id (``"0"``, ``"1"``, ...).

    Raises:
        ValueError: ``own`` is not a sequence of str.
    """

    def __init__(self, given, own, owner: str):
        if own is not None and (isinstance(own, str) or not all(isinstance(x, str) for x in own)):
            raise ValueError(f"{owner}.labels must be a sequence of class names (str)")
        self.names: list[str] = list(given) if given is not None else list(own) if own is not None else None
        #: names given (the config's or the module's): their count must be the model's classes
        self.given = self.names is not None
        if self.names is None:
            self.names = imagenet_labels()
        #: classes of the model's output, once :meth:`check` has seen one
        self.num_classes: int | None = None
        self._arr: np.ndarray | None = None  # names as an object array, for lists()
        self._src, self._n = None, 0  # the list it was built from, and its length then

    def check(self, classes: int) -> None:
        """Note the model's ``classes``.

        Raises:
            ValueError: names were given for another number of classes.
        """
        if self.given and classes != len(self.names):
            raise ValueError(f"the model gives {classes} classes, its labels name {len(self.names)}")
        if self.num_classes is None and not self.given and classes != len(self.names):
            self.names = []  # (no names given, and not ImageNet's 1000 classes: named by their ids)
        self.num_classes = classes

    def lists(self, idx: np.ndarray) -> list[list[str]]:
        """Class ids ``(n, k)`` int64 -> their names, one list per row, by one numpy gather (a class
        past the end of :attr:`names` is named by its id)."""
        hi = int(idx.max()) + 1 if idx.size else 0
        src = self.names
        if self._arr is None or len(self._arr) < hi or self._src is not src or self._n != len(src):
            names = src + [str(c) for c in range(len(src), hi)]  # (names replaced or changed: built again)
            self._arr = np.empty(len(names), dtype=object)
            self._arr[:] = names
            self._src, self._n = src, len(src)
        return self._arr[idx].tolist()


class ModelOutputError(ValueError):
    """The model's output breaks the contract (not one row of float logits per image, or labels for
    another number of classes): every batch fails alike, so its rows are not tried one by one."""


def check_logits(logits, batch: int, labels: ClassLabels) -> torch.Tensor:
    """``logits`` if the model's output for a batch of ``batch`` is ``(batch, C)`` float logits, ``C``
    the count of the labels given (which learn ``C``: :meth:`ClassLabels.check`).

    Raises:
        ModelOutputError: another shape or type, or labels given for another number of classes.
    """
    if (
        not isinstance(logits, torch.Tensor)
        or logits.ndim != 2
        or logits.shape[0] != batch
        or not logits.shape[1]
        or not logits.dtype.is_floating_point
    ):
        got = (
            f"{tuple(logits.shape)} {logits.dtype}".replace("torch.", "")
            if isinstance(logits, torch.Tensor)
            else type(logits).__name__
        )
        raise ModelOutputError(
            f"the model must map a batch of {batch} image{'' if batch == 1 else 's'} (B, 3, H, W) to float "
            f"logits (B, C), one row per image; it gave {got}"
        )
    try:
        labels.check(logits.shape[1])
    except ValueError as e:
        raise ModelOutputError(str(e)) from None
    return logits


def compute_failed(e: BaseException, limit: int = 1000) -> str:
    """An item's error for the model's exception ``e``: its type and message, at most ``limit`` characters
    of it (a model may raise with a huge message; it goes into every failed item's line and answer)."""
    msg = str(e)
    msg = msg if len(msg) <= limit else msg[:limit] + f"... ({len(msg)} characters)"
    return f"compute failed: {type(e).__name__}: {msg}" if msg else f"compute failed: {type(e).__name__}"
