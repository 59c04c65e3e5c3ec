"""The event store port: the few methods the rest of SVC may use."""

from __future__ import annotations

from collections.abc import AsyncIterator, Sequence
from typing import Protocol

from eventstore.records import AppendResult, NewEvent, RecordedEvent, Snapshot

ANY_VERSION: int | None = None
"""expected_version meaning "do not check": the events land after whatever the stream holds
(the append is sent again when another writer takes the next version first); 0 means "the
stream must not exist yet"."""


class EventStore(Protocol):
    async def append(
        self,
        stream_id: str,
        events: Sequence[NewEvent],
        *,
        expected_version: int | None,
        command_id: str,
        workspace_id: str,
    ) -> AppendResult: ...

    async def processed(self, command_id: str, workspace_id: str) -> AppendResult | None:
        """The append `command_id` made (as a duplicate result), or None when it made none."""
        ...

    async def read_stream(
        self,
        stream_id: str,
        from_version: int = 1,
        *,
        workspace_id: str | None = None,
        to_version: int | None = None,
    ) -> list[RecordedEvent]:
        """The stream's events from `from_version` up to `to_version` (the end when None)."""
        ...

    async def stream_version(self, stream_id: str, *, workspace_id: str | None = None) -> int:
        """The stream's newest version; 0 when it has no events (or none in the workspace)."""
        ...

    async def stream_sizes(
        self,
        stream_id: str,
        from_version: int,
        to_version: int,
        *,
        workspace_id: str | None = None,
    ) -> list[tuple[int, int]]:
        """`(version, bytes)` of the stream's events in the range, oldest first, without
        sending them: their data and metadata as JSON text, which is what a reader cuts its
        reads by (eventstore.paging). The database renders each event to measure it: size
        no more events than are about to be read."""
        ...

    async def read_all(
        self,
        after: str | None = None,
        limit: int = 1000,
        *,
        workspace_id: str | None = None,
        types: Sequence[str] | None = None,
    ) -> list[RecordedEvent]: ...

    def subscribe(
        self,
        after: str | None = None,
        *,
        workspace_id: str | None = None,
        types: Sequence[str] | None = None,
    ) -> AsyncIterator[RecordedEvent]: ...

    async def save_snapshot(self, snapshot: Snapshot) -> None: ...

    async def load_snapshot(self, stream_id: str) -> Snapshot | None: ...

    async def head(self, workspace_id: str | None = None) -> str:
        """Cursor of the newest event visible to gap-free readers, of one workspace's events
        if given ("" for an empty log)."""
        ...
