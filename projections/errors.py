"""The projections' own errors."""

from __future__ import annotations

from eventstore.errors import StatementAborted, StoreError, StoreUnavailable
from schemas.errors import Unavailable

_MAX_REASON_CHARS = 500


class ProjectionFailed(Unavailable):
    """A projection is stopped on an event it cannot apply; its read model is stale."""

    default_code = "projection_failed"


def database_down(exc: Exception) -> bool:
    """The database itself is unavailable (the connection lost, the server down or refusing
    connections): retry the whole step later. Not a statement it gave up on in a sound
    session (`StatementAborted`), which is the statement's: a projector isolates it."""
    return isinstance(exc, StoreUnavailable) and not isinstance(exc, StatementAborted)


def failure_reason(exc: Exception) -> str:
    """Why a handler failed on an event, as reported and recorded for the operator: the
    store's own message with the database's words after it (a StoreUnavailable's detail),
    else the exception's type and text, on one line (a validation error spans many) and
    bounded."""
    reason = str(exc) if isinstance(exc, StoreError) else f"{type(exc).__name__}: {exc}"
    return _one_bounded_line(reason)


def aborted_reason(exc: StatementAborted, attempts: int, name: str) -> str:
    """Why projector `name` stopped on an event the database gave up on `attempts` times in
    a row (a statement or lock timeout, a deadlock): what to do first, the database's words
    after, so that the bound cuts those."""
    return _one_bounded_line(
        f"the database gave up on this event's statement {attempts} times in a row: the "
        "handler is too slow for the statement timeout or waits on a lock held elsewhere; "
        "fix the cause (a missing index, a long transaction), then restart the service or "
        f"run `svc projections rebuild {name}` (the last time: {exc.detail})"
    )


def _one_bounded_line(text: str) -> str:
    """One line, bounded, and storable: the stop is recorded as jsonb, which holds no NUL,
    and as UTF-8, which holds no lone surrogate. A reason quoting either (a handler's error
    about the event's own text) left the stop unrecorded: unseen by other processes, and
    taken for cleared here, so the event was tried again every second."""
    line = " ".join(text.replace("\x00", "\\0").split())[:_MAX_REASON_CHARS]
    return line.encode("utf-8", "replace").decode("utf-8")
