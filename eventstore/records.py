"""Plain records crossing the store's boundary. Slotted dataclasses: cheap to build by the
hundred thousand on catch-up reads, picklable across the Ray runtime."""

from __future__ import annotations

import itertools
import os
import struct
import time
import uuid
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from typing import Any, Final

from asyncpg.pgproto.pgproto import UUID as _DriverUUID

from eventstore.cursor import LogPoint, encode_cursor

_COUNTER_BITS = 62
_pack_uuid = struct.Struct(">QQ").pack


def _draw_process_bits() -> tuple[int, itertools.count[int]]:
    seed = int.from_bytes(os.urandom(10)) >> 6  # 74 bits: 12 process bits, 62 counter bits
    return seed >> _COUNTER_BITS, itertools.count(seed & ((1 << _COUNTER_BITS) - 1))


_process_bits, _counter = _draw_process_bits()


def _redraw_after_fork() -> None:
    # A forked child would otherwise continue the parent's sequence: same ids, same ms.
    global _process_bits, _counter
    _process_bits, _counter = _draw_process_bits()


os.register_at_fork(after_in_child=_redraw_after_fork)


def new_event_id() -> uuid.UUID:
    """A time-ordered event id: a UUIDv7 (RFC 9562) with a 48-bit Unix millisecond timestamp,
    12 random bits drawn once per process, and a 62-bit counter started at a random value.

    Ids sort by the wall-clock millisecond they were made in, then (within a process) by the
    counter, so the UNIQUE event_id index grows at its right edge instead of splitting and
    dirtying random leaf pages. Uniqueness never depends on the clock: within a process the
    counter never repeats (2**62 values; `next()` on an itertools.count is atomic, so threads
    need no lock); two processes collide only with the same 12 process bits and overlapping
    counter ranges in the same millisecond. It costs about a fifth of `uuid.uuid4()` (no
    system call per id), and is the driver's own `uuid.UUID` subclass, which it encodes by
    copying 16 bytes.
    """
    high = (time.time_ns() // 1_000_000) << 16 | 0x7000 | _process_bits
    low = 0x8000_0000_0000_0000 | (next(_counter) & 0x3FFF_FFFF_FFFF_FFFF)
    event_id: uuid.UUID = _DriverUUID(_pack_uuid(high, low))
    return event_id


@dataclass(slots=True, init=False)
class NewEvent:
    """An event to append. Built once per event on every append path, so it is not frozen at
    run time (the fields are `Final` for the type checker: read-only all the same), for the
    same reason as `RecordedEvent`: a frozen dataclass's `__init__` sets each field through
    `object.__setattr__`, which made building one cost twice as much."""

    type: Final[str]
    data: Final[dict[str, Any]]
    schema_version: Final[int]
    metadata: Final[dict[str, Any]]
    event_id: Final[uuid.UUID]

    def __init__(
        self,
        type: str,
        data: dict[str, Any],
        schema_version: int = 1,
        metadata: dict[str, Any] | None = None,
        event_id: uuid.UUID | None = None,
    ) -> None:
        self.type = type
        self.data = data
        self.schema_version = schema_version
        self.metadata = {} if metadata is None else metadata
        self.event_id = new_event_id() if event_id is None else event_id


_PG_EPOCH = datetime(2000, 1, 1, tzinfo=UTC)
_PG_INFINITY = 2**63 - 1
_PG_MINUS_INFINITY = -(2**63)


def _decode_timestamptz(raw: bytes) -> datetime:
    """PostgreSQL's binary timestamptz (microseconds since 2000-01-01 UTC, big-endian int8)
    as asyncpg would decode it: an aware UTC datetime, infinities clamped."""
    micros = int.from_bytes(raw, "big", signed=True)
    if micros == _PG_INFINITY:
        return datetime.max.replace(tzinfo=UTC)
    if micros == _PG_MINUS_INFINITY:
        return datetime.min.replace(tzinfo=UTC)
    return _PG_EPOCH + timedelta(microseconds=micros)


@dataclass(slots=True, init=False, eq=False)
class RecordedEvent:
    """One event as the log recorded it. Catch-up reads build hundreds of thousands per
    second (eventstore/reads.py), so two costs are avoided:

    - It is not frozen at run time (the fields are `Final` for the type checker: read-only all
      the same). A frozen dataclass's `__init__` sets every field through
      `object.__setattr__`, which made building one cost about 2.4 us, as much as fetching and
      decoding its row; this plain slotted `__init__` costs about 0.3 us.
    - `recorded_at` is decoded on first use, not per row: the store reads it as the 8 raw
      bytes of PostgreSQL's binary timestamptz (decoding a datetime per row cost about
      0.8 us, and most consumers never look at it). `recorded_at` is a property computing the
      same aware UTC datetime asyncpg would have; the constructor takes either form.
    """

    position: Final[int]
    tx: Final[int]
    stream_id: Final[str]
    version: Final[int]
    event_id: Final[uuid.UUID]
    workspace_id: Final[str]
    type: Final[str]
    schema_version: Final[int]
    data: Final[dict[str, Any]]
    metadata: Final[dict[str, Any]]
    _recorded_at: Final[datetime | bytes]

    def __init__(
        self,
        position: int,
        tx: int,
        stream_id: str,
        version: int,
        event_id: uuid.UUID,
        workspace_id: str,
        type: str,
        schema_version: int,
        data: dict[str, Any],
        metadata: dict[str, Any],
        recorded_at: datetime | bytes,
    ) -> None:
        self.position = position
        self.tx = tx
        self.stream_id = stream_id
        self.version = version
        self.event_id = event_id
        self.workspace_id = workspace_id
        self.type = type
        self.schema_version = schema_version
        self.data = data
        self.metadata = metadata
        self._recorded_at = recorded_at

    @property
    def recorded_at(self) -> datetime:
        at = self._recorded_at
        return at if isinstance(at, datetime) else _decode_timestamptz(at)

    @property
    def point(self) -> LogPoint:
        return LogPoint(self.tx, self.position)

    @property
    def cursor(self) -> str:
        return encode_cursor(self.point)

    def _key(self) -> tuple[object, ...]:
        return (
            self.position,
            self.tx,
            self.stream_id,
            self.version,
            self.event_id,
            self.workspace_id,
            self.type,
            self.schema_version,
            self.data,
            self.metadata,
            self.recorded_at,
        )

    def __eq__(self, other: object) -> bool:
        # By value, whichever form `recorded_at` came in.
        if other.__class__ is not self.__class__:
            return NotImplemented
        assert isinstance(other, RecordedEvent)
        return self._key() == other._key()

    def __repr__(self) -> str:
        return (
            f"RecordedEvent(position={self.position!r}, tx={self.tx!r}, "
            f"stream_id={self.stream_id!r}, version={self.version!r}, "
            f"event_id={self.event_id!r}, workspace_id={self.workspace_id!r}, "
            f"type={self.type!r}, schema_version={self.schema_version!r}, data={self.data!r}, "
            f"metadata={self.metadata!r}, recorded_at={self.recorded_at!r})"
        )


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
