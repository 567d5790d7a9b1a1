"""The answer for one image: what every front end (library, CLI, server, Ray) gives back per item."""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from functools import lru_cache
from json.encoder import encode_basestring_ascii

from ...core.errors import error_info


@dataclass(slots=True)  # (no per-instance dict: made and read once per image, under the GIL)
class Result:
    """The answer for one input item.

    Attributes:
        index: position in the input stream once folders and globs are expanded into their files (0-based).
        id: the file path, URL, or ``<bytes #i>`` name of the item.
        labels / class_ids / probs: the top-k classes, most probable first (probs sum to <= 1).
        error: why this item failed (then the three lists are empty); :attr:`error_stage` and
            :attr:`error_kind` say where and what (:mod:`fullthrottle.core.errors`).
        latency_ms: from the start of its load to its result (ms).
    """

    index: int
    id: str
    labels: list[str] = field(default_factory=list)
    class_ids: list[int] = field(default_factory=list)
    probs: list[float] = field(default_factory=list)
    error: str | None = None
    latency_ms: float = 0.0

    @property
    def ok(self) -> bool:
        return self.error is None

    @property
    def error_stage(self) -> str | None:
        """The stage that failed the item (``load``, ``preprocess``, ``compute``, ``pipeline``), or None."""
        return error_info(self.error, self.id)[0]

    @property
    def error_kind(self) -> str | None:
        """The kind of failure (``not_found``, ``corrupt``, ... :data:`fullthrottle.core.errors.KINDS`), or None."""
        return error_info(self.error, self.id)[1]

    def to_dict(self) -> dict:
        d = {"index": self.index, "id": utf8_text(self.id)}
        if self.error is None:
            d["top_k"] = [
                {"label": lab, "class_id": c, "prob": round(p, 6)}
                for lab, c, p in zip(self.labels, self.class_ids, self.probs)
            ]
        else:
            d["error"] = utf8_text(self.error)
            d["error_stage"], d["error_kind"] = error_info(self.error, self.id)
        return d

    def to_json(self) -> str:
        """``json.dumps(self.to_dict())``, the same string, made several times faster for results
        (the per-image cost of writing JSON lines is paid under the GIL of the process that runs the
        pipeline): each label's JSON text is made once, the rest by string formatting."""
        try:
            if self.error is None and math.isfinite(sum(self.probs)):
                top = ", ".join(
                    [
                        _entry_head(lab, c) + repr(round(p, 6)) + "}"
                        for lab, c, p in zip(self.labels, self.class_ids, self.probs)
                    ]
                )
                if type(self.index) is int:
                    return f'{{"index": {self.index}, "id": {encode_basestring_ascii(utf8_text(self.id))}, "top_k": [{top}]}}'
        except TypeError:  # (labels or id not str, class ids not int: the general encoder decides)
            pass
        return json.dumps(self.to_dict())


def utf8_text(s):
    """``s`` if it is a str UTF-8 can hold, else with the bytes a file name held that were not UTF-8
    (read by Python as lone surrogates, which strict JSON readers refuse) written as ``\\xNN``."""
    if type(s) is not str:
        return s
    try:
        s.encode("utf-8")
        return s
    except UnicodeEncodeError:
        try:
            return s.encode("utf-8", "surrogateescape").decode("utf-8", "backslashreplace")
        except UnicodeEncodeError:
            return s.encode("utf-8", "backslashreplace").decode("utf-8")


@lru_cache(maxsize=4096, typed=True)
def _entry_head(label: str, class_id: int) -> str:
    """A top-k entry's JSON text up to its probability (made once per class; a few thousand at most).

    Raises:
        TypeError: ``label`` is not a str or ``class_id`` not an int.
    """
    if type(class_id) is not int:
        raise TypeError(f"class id {class_id!r} is not an int")
    return f'{{"label": {encode_basestring_ascii(label)}, "class_id": {class_id}, "prob": '
