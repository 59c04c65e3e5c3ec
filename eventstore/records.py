"""Plain records crossing the store's boundary. Slotted dataclasses: cheap to build by the
hundred thousand on catch-up reads, picklable across the Ray runtime."""

from __future__ import annotations

import uuid
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

from eventstore.cursor import LogPoint, encode_cursor


@dataclass(frozen=True, slots=True)
class NewEvent:
    type: str
    data: dict[str, Any]
    schema_version: int = 1
    metadata: dict[str, Any] = field(default_factory=dict)
    event_id: uuid.UUID = field(default_factory=uuid.uuid4)


@dataclass(frozen=True, slots=True)
class RecordedEvent:
    position: int
    tx: int
    stream_id: str
    version: int
    event_id: uuid.UUID
    workspace_id: str
    type: str
    schema_version: int
    data: dict[str, Any]
    metadata: dict[str, Any]
    recorded_at: datetime

    @property
    def point(self) -> LogPoint:
        return LogPoint(self.tx, self.position)

    @property
    def cursor(self) -> str:
        return encode_cursor(self.point)


@dataclass(frozen=True, slots=True)
class AppendResult:
    """Outcome of an append. `duplicate` is true when the command id was already processed:
    then nothing was written and the fields describe the first append."""

    stream_id: str
    first_version: int
    last_version: int
    cursor: str
    duplicate: bool = False


@dataclass(frozen=True, slots=True)
class Snapshot:
    stream_id: str
    version: int
    schema_version: int
    state: dict[str, Any]
