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
    """The database cannot be reached or timed out; retry later.

    `message` is what a client is told; `detail`, what the driver said (the server's address,
    its own words), is for the log and the operator's terminal only: `str()` of the error
    carries both, and no client renders `str()`."""

    default_code = "store_unavailable"
    detail: str = ""

    @classmethod
    def with_detail(cls, message: str, detail: str) -> StoreUnavailable:
        error = cls(message)
        error.detail = detail
        return error

    def __str__(self) -> str:
        return f"{self.message} ({self.detail})" if self.detail else self.message


class StatementAborted(StoreUnavailable):
    """The database is up and answered, but gave up on one statement: a statement or lock
    timeout, a deadlock, a serialization failure. Like any unavailability a retry may succeed
    (contention passes), but the connection is sound, and a statement that fails so every
    time is itself at fault (too slow for the statement timeout, or waiting on a lock that is
    never released): a caller that can tell the statement from the database's health (the
    projections' runner) isolates it instead of waiting for the database to come back."""

    def __init__(self, reason: str) -> None:
        super().__init__(
            "the database gave up on a statement (a timeout, a lock wait or a conflict with "
            "another transaction); retry shortly"
        )
        # The database's words (the SQLSTATE, the driver's class, the server's text, which
        # names its tables, locks and processes): for the log and the operator only.
        self.detail = reason


class InvalidCursor(StoreError, InvalidInput):
    default_code = "invalid_cursor"


class InvalidAppend(StoreError, InvalidInput):
    """An append request that can never succeed (empty batch, bad ids, wrong workspace)."""

    default_code = "invalid_append"


class UnusableDataDirectory(StoreError, InvalidInput):
    """SVC_DATA_DIR names a path the embedded PostgreSQL cannot use (a space, too long for
    its socket): a setting to correct, as a malformed setting is."""

    default_code = "invalid_setting_value"
