"""Objects a user names on the command line as ``MODULE:NAME`` (``--workload``, ``--model``)."""

from __future__ import annotations


def import_object(spec: str, flag: str, example: str):
    """The attribute ``NAME`` of module ``MODULE`` for ``spec`` = ``"MODULE:NAME"``; a module in the
    current folder is found (as uvicorn does).

    Raises:
        ValueError: ``spec`` is not ``MODULE:NAME`` (or names a relative module), the module is not
            found or fails while it is imported (a syntax error, an exception, ``sys.exit``), or it
            has no ``NAME``; the message names ``flag``, the module and what went wrong, and shows
            ``example``.
    """
    import importlib
    import os
    import sys

    module, sep, name = spec.partition(":")
    if not sep or not module or not name.isidentifier():
        raise ValueError(f"{flag} must be MODULE:CLASS ({example}), got {spec!r}")
    if module.startswith("."):
        raise ValueError(f"{flag} {spec}: a relative module name cannot be imported; give its full name ({example})")
    if os.getcwd() not in sys.path:
        sys.path.insert(0, os.getcwd())
    try:
        mod = importlib.import_module(module)
    except ImportError as e:
        raise ValueError(f"{flag} {spec}: cannot import {module}: {e}") from None
    except SyntaxError as e:
        raise ValueError(f"{flag} {spec}: {module} has a syntax error: {e}") from None
    except (Exception, SystemExit) as e:  # the user's module failing at import: its own error, named
        raise ValueError(f"{flag} {spec}: importing {module} failed: {raised(e)}") from None
    try:
        return getattr(mod, name)
    except AttributeError:
        raise ValueError(f"{flag} {spec}: {module} has no {name}") from None


def raised(e: BaseException) -> str:
    """What the user's code raised, in one phrase: ``"exit(3)"`` for ``sys.exit(3)``, else
    ``"TypeError: message"``."""
    if isinstance(e, SystemExit):
        return f"exit({e.code})"
    return f"{type(e).__name__}: {e}" if str(e) else type(e).__name__
