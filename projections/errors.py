"""The projections' own errors."""

from __future__ import annotations

from eventstore.errors import StoreError
from schemas.errors import Unavailable

_MAX_REASON_CHARS = 500


class ProjectionFailed(Unavailable):
    """A projection is stopped on an event it cannot apply; its read model is stale."""

    default_code = "projection_failed"


def failure_reason(exc: Exception) -> str:
    """Why a handler failed on an event, as reported and recorded: the store's own message,
    else the exception's type and text, on one line (a validation error spans many) and
    bounded."""
    reason = exc.message if isinstance(exc, StoreError) else f"{type(exc).__name__}: {exc}"
    return " ".join(reason.split())[:_MAX_REASON_CHARS]
