"""A server start that fails (the model cannot load, a workload's ``setup()`` raises) ends with one
clear message instead of the web framework's traceback through its own internals: the lifespan raises
:class:`StartupError`, and :func:`startup_error_only` (a filter on uvicorn's error logger) logs just
its message; uvicorn then prints "Application startup failed. Exiting." and exits with status 3,
which ``fullthrottle serve`` turns into its usage-error status, 2."""

from __future__ import annotations

import logging

_MARK = "StartupError: "


class StartupError(RuntimeError):
    """Why the server could not start (the message is all that is logged)."""


def startup_error_only(record: logging.LogRecord) -> bool:
    """Logging filter: a record holding a :class:`StartupError`'s traceback is rewritten to its message."""
    msg = record.getMessage()
    if msg.startswith("Traceback") and _MARK in msg:
        record.msg, record.args = msg.split(_MARK, 1)[1].rstrip(), ()
    return True
