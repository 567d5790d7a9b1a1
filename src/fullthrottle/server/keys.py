"""The server's API keys: with any key configured, every route but ``/healthz`` needs
``Authorization: Bearer KEY``; keys are compared in constant time (``hmac.compare_digest``) so that
timing tells nothing about them."""

from __future__ import annotations

import hmac
import os

from ..core.env import API_KEY

API_KEY_ENV = API_KEY  #: API keys for ``serve`` (comma-separated), besides --api-key (core.env declares it)

#: the answer to a request without a valid API key: status, body, headers (the connection then closes,
#: its body never read)
NO_KEY = (
    401,
    {"detail": "missing or wrong API key: send Authorization: Bearer KEY"},
    {"WWW-Authenticate": "Bearer", "Connection": "close"},
)


def load_keys(keys=(), key_file: str | None = None, environ=os.environ) -> tuple[str, ...]:
    """Every API key from ``keys``, ``key_file`` (one per line; blank lines and ``#`` comments
    skipped) and :data:`API_KEY_ENV`.

    A key file, or a non-empty :data:`API_KEY_ENV`, that holds no key is an error, not a server
    without keys: whoever passes one means keys to be required.

    Raises:
        ValueError: an unreadable key file, a key file or a non-empty :data:`API_KEY_ENV` with no
            key in it, a key not of printable ASCII, or a key shorter than 16 characters.
    """
    out = [k.strip() for k in keys]
    if key_file is not None:
        try:
            with open(key_file, encoding="utf-8-sig") as f:  # (a byte-order mark is no part of a key)
                found = [line.strip() for line in f if line.strip() and not line.lstrip().startswith("#")]
        except (OSError, UnicodeDecodeError) as e:
            reason = f"not UTF-8 ({e.reason})" if isinstance(e, UnicodeDecodeError) else e.strerror or e
            raise ValueError(f"cannot read the API key file {key_file}: {reason}") from None
        if not found:
            raise ValueError(f"the API key file {key_file} holds no key (one per line)")
        out += found
    env = environ.get(API_KEY_ENV, "")
    if env:  # (set to the empty string: as unset)
        found = [k.strip() for k in env.split(",") if k.strip()]
        if not found:
            raise ValueError(f"${API_KEY_ENV} is set but holds no key (comma-separated keys; unset it for none)")
        out += found
    if not all(k.isascii() and k.isprintable() for k in out):  # (a header's bytes would never match)
        raise ValueError("API keys must be printable ASCII characters")
    short = [k for k in out if len(k) < 16]
    if short:
        raise ValueError(
            f"{len(short)} API key(s) shorter than 16 characters: use long random keys "
            "(python -c 'import secrets; print(secrets.token_urlsafe(32))')"
        )
    return tuple(dict.fromkeys(out))


def authorised(header: str | None, keys: tuple[str, ...]) -> bool:
    """Whether an ``Authorization`` header carries one of ``keys`` as a Bearer token (every key is
    compared, in constant time, whether or not an earlier one matched)."""
    if not header or not header.lower().startswith("bearer "):
        return False
    token = header[7:].strip().encode()
    return any([hmac.compare_digest(token, k.encode()) for k in keys])  # (a list: every key compared)
