"""Errors raised by the event store. asyncpg exceptions never leave this package."""

from __future__ import annotations

from schemas.errors import Conflict, InvalidInput, SvcError, Unavailable


class StoreError(SvcError):
    """Base of every event-store error."""


class ConcurrencyConflict(StoreError, Conflict):
    """Another writer appended to the stream first (unique violation on stream_id, version)."""

    default_code = "concurrency_conflict"

    def __init__(self, stream_id: str, expected_version: int | None) -> None:
        super().__init__(
            f"stream {stream_id!r} moved past expected version {expected_version}; "
            "reload the stream and decide again"
        )
        self.stream_id = stream_id
        self.expected_version = expected_version


class StoreUnavailable(StoreError, Unavailable):
    """The database cannot be reached or timed out; retry later."""

    default_code = "store_unavailable"


class StatementAborted(StoreUnavailable):
    """The database is up and answered, but gave up on one statement: a statement or lock
    timeout, a deadlock, a serialization failure. Like any unavailability a retry may succeed
    (contention passes), but the connection is sound, and a statement that fails so every
    time is itself at fault (too slow for the statement timeout, or waiting on a lock that is
    never released): a caller that can tell the statement from the database's health (the
    projections' runner) isolates it instead of waiting for the database to come back."""

    def __init__(self, reason: str) -> None:
        super().__init__(f"the database gave up on a statement ({reason}); retry shortly")
        self.reason = reason
        """The database's words: the SQLSTATE, the driver's class and the server's text."""


class InvalidCursor(StoreError, InvalidInput):
    default_code = "invalid_cursor"


class InvalidAppend(StoreError, InvalidInput):
    """An append request that can never succeed (empty batch, bad ids, wrong workspace)."""

    default_code = "invalid_append"
