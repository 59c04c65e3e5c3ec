"""`SVC_LOG_LEVEL` applied: the service's own loggers at that level, everyone else's at
INFO at most. Libraries log what they handle at DEBUG, and what they handle is often a
secret or a user's data (pysaml2 logs every SAML response whole, its assertion and the
user's attributes): an operator debugging SVC must not get that in its log."""

from __future__ import annotations

import logging
import sys
import time
from datetime import UTC, datetime

import orjson

LOG_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"


class JsonLines(logging.Formatter):
    """A record as one JSON object on one line (SVC_LOG_FORMAT=json), for log collectors:
    `time` (UTC, ISO 8601, microseconds), `level`, `logger`, `message`, and `exc` with the
    traceback when there is one. A line break in a message stays inside its string."""

    def format(self, record: logging.LogRecord) -> str:
        line: dict[str, str] = {
            "time": datetime.fromtimestamp(record.created, UTC).isoformat(),
            "level": record.levelname,
            "logger": record.name,
            "message": record.getMessage(),
        }
        if record.exc_info:
            line["exc"] = self.formatException(record.exc_info)
        elif record.exc_text:
            line["exc"] = record.exc_text
        try:
            return orjson.dumps(line).decode()
        except TypeError:
            # A lone surrogate (a header byte that is not UTF-8, kept so by aiohttp, in an
            # access line): JSON cannot carry it, so it is written as its escape.
            escaped = {k: v.encode("utf-8", "backslashreplace").decode() for k, v in line.items()}
            return orjson.dumps(escaped).decode()


def log_to_stderr(log_format: str = "text") -> None:
    """One line per record on standard error, with its time, level and logger, as text or
    (`json`) as one JSON object; a no-op where logging is already set up. An actor host
    calls it too: without a handler, Python wrote only each record's message to a Ray
    worker's log."""
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(JsonLines() if log_format == "json" else logging.Formatter(LOG_FORMAT))
    logging.basicConfig(handlers=[handler])


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


TELEMETRY_LINE_EVERY_S = 60.0
EXPORT_LOGGERS = (
    "opentelemetry.exporter",
    "opentelemetry.sdk.trace.export",
    "opentelemetry.sdk._shared_internal",
)
"""Where OpenTelemetry's span export logs its failures (the exporter; the batch processor,
whose home moved between releases). Its other warnings (a context not detached, an
attribute of a bad type) are not export failures, and pass as they are."""
_JUDGED = "svc_telemetry_line_passes"


class _TelemetryExportThrottled(logging.Filter):
    """OpenTelemetry's exporter logs each batch it could not send (an ERROR a batch and a
    WARNING a retry: twenty lines a minute while a collector is down, an ERROR a batch while
    it answers 500). Its lines pass as warnings, one per TELEMETRY_LINE_EVERY_S, without a
    traceback, the next one saying how many were held back: an outage of the collector is
    not the service's error, and spans are dropped, never requests slowed."""

    def __init__(self) -> None:
        super().__init__()
        self._passed_at = float("-inf")
        self._held = 0

    def filter(self, record: logging.LogRecord) -> bool:
        if not record.name.startswith(EXPORT_LOGGERS) or record.levelno < logging.WARNING:
            return True
        # Each handler asks: the record's first answer is every handler's.
        judged: bool | None = getattr(record, _JUDGED, None)
        if judged is None:
            judged = self._judge(record)
            setattr(record, _JUDGED, judged)
        return judged

    def _judge(self, record: logging.LogRecord) -> bool:
        now = time.monotonic()
        if now - self._passed_at < TELEMETRY_LINE_EVERY_S:
            self._held += 1
            return False
        self._passed_at = now
        said = " ".join(record.getMessage().split()).rstrip(".")
        if record.exc_info and record.exc_info[1] is not None:
            said += f" ({type(record.exc_info[1]).__name__})"
        if self._held:
            said += f" ({self._held} more such lines in the last {TELEMETRY_LINE_EVERY_S:.0f} s)"
        self._held = 0
        record.msg, record.args = f"telemetry export: {said}; spans are dropped", None
        record.exc_info = record.exc_text = None
        record.levelno, record.levelname = logging.WARNING, "WARNING"
        return True


_TELEMETRY = _TelemetryExportThrottled()


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
    for handler in logging.getLogger().handlers:
        # On the handlers: a logger's filter sees only the records of that very logger, and
        # the exporter's modules (and their names) change between its releases.
        handler.addFilter(_TELEMETRY)
