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


def apply_log_level(level: str) -> None:
    numeric = logging.getLevelName(level.upper())
    if not isinstance(numeric, int):
        numeric = logging.INFO
    logging.getLogger().setLevel(max(numeric, logging.INFO))
    for name in PROJECT_LOGGERS:
        logging.getLogger(name).setLevel(numeric)
    for name in QUIET_LOGGERS:
        logging.getLogger(name).setLevel(logging.CRITICAL)
