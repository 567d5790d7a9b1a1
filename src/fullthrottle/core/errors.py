"""Structured per-item errors: the stage that failed an item, and the kind of failure.

An item's error is one message that names the item (``Result.error``, worded where it happened);
:func:`error_info` reads the stage and the kind from it, for every workload and front end alike
(``Result.error_stage`` / ``Result.error_kind``, the CLI's JSON lines, the server's per-image
results). The kinds, by stage:

- ``load``: ``not_found`` (missing file, empty folder, pattern matching nothing), ``not_a_file``,
  ``too_large`` (over ``max_file_bytes``), ``unreadable`` (permission, symlink loop, ...),
  ``fetch_failed`` (HTTP status, timeout, connection), ``unsupported_input`` (a URL scheme, a URL
  or path that cannot name a file, text that is not base64, an object that names no image, a
  multipart form field where a file was expected);
- ``preprocess``: ``empty``, ``corrupt`` (truncated, bad header), ``unsupported_format``,
  ``too_many_pixels`` (over ``max_image_pixels``, as decoded or once resized: an extreme aspect
  ratio), ``decoder_crashed``, ``decode_timeout``, ``gpu_decode_failed``, ``cannot_decode`` (the
  decoder raised);
- ``compute``: ``compute_failed`` (the model raised on the item's batch), ``non_finite`` (the
  model's output for the item holds NaN or Inf): faults of the model, not of the input (the server
  answers them 500);
- ``pipeline``: ``other`` (anything else).
"""

from __future__ import annotations

import re

#: (kind, stage, pattern searched in the message), first match wins
KINDS: tuple[tuple[str, str, str], ...] = (
    (
        "not_found",
        "load",
        r"file not found: |no image files \(.*\) in directory |no files match the pattern |empty path",
    ),
    ("not_a_file", "load", r"not a regular file: "),
    ("too_large", "load", r"file too large: |download too large: "),
    ("fetch_failed", "load", r"HTTP \d{3} .* for |timeout fetching |timeout after .* fetching |cannot fetch "),
    (
        "unsupported_input",
        "load",
        r"unsupported URL scheme |cannot load an input of type |invalid URL |invalid path |not base64: |not a file part: ",
    ),
    ("unreadable", "load", r"cannot read "),
    ("empty", "preprocess", r"empty file \(0 bytes\)"),
    ("too_many_pixels", "preprocess", r"image too large: |extreme aspect ratio: "),
    ("corrupt", "preprocess", r"truncated or corrupt |corrupt .* header|corrupt or unsupported "),
    ("unsupported_format", "preprocess", r"not a supported image"),
    ("decoder_crashed", "preprocess", r"decoder process died on this "),
    ("decode_timeout", "preprocess", r"took longer than .* \(decode_timeout_s\)"),
    ("gpu_decode_failed", "preprocess", r"GPU decode failed: "),
    ("cannot_decode", "preprocess", r"cannot decode image: "),
    ("compute_failed", "compute", r"compute failed: "),
    ("non_finite", "compute", r"model output is not finite"),
)
_COMPILED = tuple((kind, stage, re.compile(p)) for kind, stage, p in KINDS)


def error_info(message: str | None, item_id: str | None = None) -> tuple[str, str] | tuple[None, None]:
    """``(stage, kind)`` of an item's error message; ``(None, None)`` for no error;
    ``("pipeline", "other")`` for a message of no known kind.

    ``item_id``: the item's id, which the message names. It is taken out before the message is
    read, so that an id holding a kind's words (a file named ``cannot read this.jpg``, an id sent
    by a client) does not set the kind; where taking it out leaves no kind (an id that is a part of
    the message's own words, such as ``e``), the whole message is read."""
    if message is None:
        return None, None
    if isinstance(item_id, str) and item_id and item_id in message:
        found = _kind(message.replace(item_id, "\0"))
        if found is not None:
            return found
    return _kind(message) or ("pipeline", "other")


def _kind(message: str) -> tuple[str, str] | None:
    for kind, stage, pattern in _COMPILED:
        if pattern.search(message):
            return stage, kind
    return None


class Overloaded(RuntimeError):
    """A bounded queue of requests is full: the caller should retry later (the server answers 503
    with Retry-After)."""
