"""A server start that fails (the model cannot load, a workload's ``setup()`` raises) ends with one
clear message instead of the web framework's traceback through its own internals: the lifespan raises
:class:`StartupError`, and :func:`startup_error_only` (a filter on uvicorn's error logger) logs just
its message; uvicorn then prints "Application startup failed. Exiting." and the process exits with
status 3."""

from __future__ import annotations

import logging
import traceback

_MARK = "StartupError: "


class StartupError(RuntimeError):
    """Why the server could not start (the message is all that is logged)."""


def user_traceback(e: BaseException) -> str:
    """``e`` as a traceback of the frames outside this package, asyncio and the thread pool (the
    user's own code, where it raised), ending in ``Type: message``."""
    keep = [
        f
        for f in traceback.extract_tb(e.__traceback__)
        if not any(part in f.filename for part in ("/fullthrottle/", "/asyncio/", "/concurrent/futures/"))
    ]
    return "".join(traceback.format_list(keep)) + "".join(traceback.format_exception_only(type(e), e)).rstrip()


def startup_error_only(record: logging.LogRecord) -> bool:
    """Logging filter: a record holding a :class:`StartupError`'s traceback is rewritten to its message."""
    msg = record.getMessage()
    if msg.startswith("Traceback") and _MARK in msg:
        record.msg, record.args = msg.split(_MARK, 1)[1].rstrip(), ()
    return True
