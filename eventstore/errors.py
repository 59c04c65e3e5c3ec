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


class InvalidCursor(StoreError, InvalidInput):
    default_code = "invalid_cursor"


class InvalidAppend(StoreError, InvalidInput):
    """An append request that can never succeed (empty batch, bad ids, wrong workspace)."""

    default_code = "invalid_append"
