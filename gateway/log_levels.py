"""`SVC_LOG_LEVEL` applied: the service's own loggers at that level, everyone else's at
INFO at most. Libraries log what they handle at DEBUG, and what they handle is often a
secret or a user's data (pysaml2 logs every SAML response whole, its assertion and the
user's attributes): an operator debugging SVC must not get that in its log."""

from __future__ import annotations

import logging
import sys

LOG_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"


def log_to_stderr() -> None:
    """One line per record on standard error, with its time, level and logger; a no-op
    where logging is already set up. An actor host calls it too: without a handler, Python
    wrote only each record's message to a Ray worker's log."""
    logging.basicConfig(stream=sys.stderr, format=LOG_FORMAT)


PROJECT_LOGGERS = ("gateway", "actors", "eventstore", "projections", "schemas", "svc")
"""The loggers of SVC's packages (named by module) and `svc` (`svc.client`, the access log)."""


QUIET_LOGGERS = ("saml2",)
"""Libraries whose own error lines quote what a client sent: pysaml2 logs a refused SAML
response whole, at ERROR (a megabyte of an anonymous client's XML per request). SVC logs
their refusals itself (gateway/identity/saml.py)."""


ONE_LINE_LOGGERS = ("asyncpg.pool",)
"""Libraries that log a failure they retry with its whole traceback: asyncpg's pool, each try
to reconnect in a database outage (every 1 s at first), 40 lines apiece."""


class _CauseOnOneLine(logging.Filter):
    """Keeps a record's exception as its kind and text on the record's own line, without
    the traceback."""

    def filter(self, record: logging.LogRecord) -> bool:
        exc = record.exc_info[1] if record.exc_info else None
        if exc is not None:
            said = " ".join(str(exc).split())  # a server error's DETAIL and HINT lines too
            record.msg = f"{record.getMessage()} ({type(exc).__name__}: {said})"
            record.args = None
            record.exc_info = None
            record.exc_text = None
        return True


_ONE_LINE = _CauseOnOneLine()


def apply_log_level(level: str) -> None:
    numeric = logging.getLevelName(level.upper())
    if not isinstance(numeric, int):
        numeric = logging.INFO
    logging.getLogger().setLevel(max(numeric, logging.INFO))
    for name in PROJECT_LOGGERS:
        logging.getLogger(name).setLevel(numeric)
    for name in QUIET_LOGGERS:
        logging.getLogger(name).setLevel(logging.CRITICAL)
    for name in ONE_LINE_LOGGERS:
        logging.getLogger(name).addFilter(_ONE_LINE)  # once: a filter is added only once
