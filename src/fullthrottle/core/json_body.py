"""A request body as JSON, as every route reads one: UTF-8 only, no NaN or Infinity (JSON has
neither), no float past the largest (``1e999``), every refusal a ``ValueError`` with its reason."""

from __future__ import annotations

import json
import math
import re
import sys


def _no_constant(name: str):
    raise ValueError(f"{name} is not JSON")


def _finite(text: str) -> float:
    if math.isinf(x := float(text)):  # (1e999: no NaN or Infinity in by the back door)
        raise ValueError(f"the number {text if len(text) <= 40 else text[:37] + '...'} is too large for a float")
    return x


def parse_body(body: bytes | str):
    """A request body as JSON (NaN and Infinity refused, as JSON has neither; 1e999 too); a UTF-8
    byte-order mark opening it is skipped.

    Raises:
        ValueError: not UTF-8, not JSON, NaN/Infinity, a float past the largest, an integer of
            more digits than Python converts, or nested too deep: the reason named.
    """
    try:
        if isinstance(body, (bytes, bytearray, memoryview)):
            body = bytes(body).decode("utf-8")  # (json.loads would take UTF-16 and UTF-32 bytes too)
        # (a UTF-8 byte-order mark, as Windows tools write it: RFC 8259 lets a reader skip it)
        body = body.removeprefix("\ufeff")
        if not body.strip():
            raise ValueError("it is empty")
        if re.match(r"[A-Za-z_][\w.\-\[\]]*=", body):  # (what curl -d name=value sends)
            raise ValueError("it is form-encoded (name=value), not JSON")
        return json.loads(body, parse_constant=_no_constant, parse_float=_finite)
    except RecursionError:
        raise ValueError("malformed JSON body: nested too deep") from None
    except UnicodeDecodeError as e:
        raise ValueError(f"malformed JSON body: not UTF-8 ({e.reason} at byte {e.start})") from None
    except ValueError as e:
        if "integer string conversion" in str(e):  # (Python's own words name its setting)
            raise ValueError(
                f"malformed JSON body: a number of more than {sys.get_int_max_str_digits()} digits"
            ) from None
        raise ValueError(f"malformed JSON body: {e}") from None


def json_type(x) -> str:
    """The JSON name of a parsed JSON value's type, with its article: ``null``, ``a boolean``,
    ``a number``, ``a string``, ``an object``, ``an array`` (for messages such as "a string is
    expected, not a number")."""
    if x is None:
        return "null"
    if isinstance(x, bool):
        return "a boolean"
    names = {int: "a number", float: "a number", str: "a string", dict: "an object", list: "an array"}
    return names.get(type(x), type(x).__name__)


def not_json(answer, e: BaseException) -> str:
    """Why ``json.dumps(answer, allow_nan=False)`` raised ``e``, for an error message: a NaN or
    infinity named with where it is (``results[0].output``), else the exception's own words."""

    def find(x, at: str):
        if isinstance(x, float) and not math.isfinite(x):
            return at, x
        items = x.items() if isinstance(x, dict) else enumerate(x) if isinstance(x, (list, tuple)) else ()
        for k, v in items:
            if (hit := find(v, f"{at}.{k}" if isinstance(k, str) else f"{at}[{k}]")) is not None:
                return hit
        return None

    if isinstance(e, ValueError) and "out of range float" in str(e).lower():
        try:
            hit = find(answer, "")
        except RecursionError:
            hit = None
        if hit is not None:
            return f"it holds {hit[1]!r} at {hit[0].lstrip('.') or 'its top'} (JSON has no NaN or Infinity)"
    return f"{type(e).__name__}: {e}"
