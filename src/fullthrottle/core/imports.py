"""Objects a user names on the command line as ``MODULE:NAME`` (``--workload``, ``--model``)."""

from __future__ import annotations


def import_object(spec: str, flag: str, example: str):
    """The attribute ``NAME`` of module ``MODULE`` for ``spec`` = ``"MODULE:NAME"``; a module in the
    current folder is found (as uvicorn does).

    Raises:
        ValueError: ``spec`` is not ``MODULE:NAME``, or the module or the name is not found (the
            message names ``flag`` and shows ``example``).
    """
    import importlib
    import os
    import sys

    module, sep, name = spec.partition(":")
    if not sep or not module or not name.isidentifier():
        raise ValueError(f"{flag} must be MODULE:CLASS ({example}), got {spec!r}")
    if os.getcwd() not in sys.path:
        sys.path.insert(0, os.getcwd())
    try:
        return getattr(importlib.import_module(module), name)
    except ImportError as e:
        raise ValueError(f"{flag} {spec}: cannot import {module}: {e}") from None
    except AttributeError:
        raise ValueError(f"{flag} {spec}: {module} has no {name}") from None
