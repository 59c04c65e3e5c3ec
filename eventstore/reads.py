"""Gap-free reads of the global log (ARCHITECTURE.md decision 3).

Positions come from a sequence and are taken at insert time, but transactions commit in any
order: a reader paging by `position > cursor` alone skips the rows of a transaction that
commits after a higher position became visible (measured: 3 to 5 percent of events missed with
16 writers). So the log is ordered by `(tx, position)` and a reader only looks below
`pg_snapshot_xmin(pg_current_snapshot())`, the oldest transaction still running: every
transaction below it has finished, so nothing can ever appear behind the cursor. A long open
writing transaction delays readers; it never makes them lose an event.

Rows are turned into `RecordedEvent`s positionally, without validation, because catch-up reads
must sustain hundreds of thousands of events per second; jsonb is decoded by the pool's orjson
codec, `tx` (xid8) arrives as a plain int and `recorded_at` as raw bytes decoded on first use.
Store reads borrow their connection `stateless` (eventstore/db.py): no reset round trip.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Sequence
from itertools import starmap
from typing import Any, NamedTuple

from eventstore.cursor import ORIGIN, LogPoint
from eventstore.db import Connection
from eventstore.records import RecordedEvent

# Column order matches RecordedEvent's fields, so a row unpacks straight into one.
# `recorded_at` travels as the raw bytes of PostgreSQL's binary timestamptz (the same bytes the
# binary protocol would send; bytea decodes for nothing) and RecordedEvent turns it into a
# datetime only when asked: decoding a datetime per row cost about 0.8 us on catch-up.
_FIELDS = (
    "position",
    "tx",
    "stream_id",
    "version",
    "event_id",
    "workspace_id",
    "type",
    "schema_version",
    "data",
    "metadata",
    "recorded_at",
)
EVENT_COLUMNS = ", ".join(_FIELDS[:-1]) + ", timestamptz_send(recorded_at) AS recorded_at"
if tuple(f.name.lstrip("_") for f in dataclasses.fields(RecordedEvent)) != _FIELDS:
    raise ImportError("eventstore.reads: EVENT_COLUMNS no longer matches RecordedEvent's fields")


def row_to_event(row: Sequence[Any]) -> RecordedEvent:
    return RecordedEvent(*row)


def rows_to_events(rows: Iterable[Sequence[Any]]) -> list[RecordedEvent]:
    """Rows of EVENT_COLUMNS -> RecordedEvents, positionally: `starmap` calls the slotted
    dataclass's plain `__init__` straight from C, with no Python frame of ours per row."""
    return list(starmap(RecordedEvent, rows))


_VISIBLE = "tx < pg_snapshot_xmin(pg_current_snapshot())"

# The parameters are typed in SQL so the planner compares xid8 with xid8 and bigint with
# bigint and keeps the `(tx, position)` / `(workspace_id, tx, position)` index range scans.
_READ_ALL = f"""
SELECT {EVENT_COLUMNS} FROM events
WHERE (tx, position) > ($1::xid8, $2::int8) AND {_VISIBLE}
ORDER BY tx, position
LIMIT $3
"""
_READ_ALL_TYPES = f"""
SELECT {EVENT_COLUMNS} FROM events
WHERE (tx, position) > ($1::xid8, $2::int8) AND {_VISIBLE} AND type = ANY($4::text[])
ORDER BY tx, position
LIMIT $3
"""
# Per workspace, the scan must run on `(workspace_id, tx, position)`. Written as an equality,
# `workspace_id = $4` lets a generic (cached) plan pick the `(tx, position)` index and filter
# a whole log for a small workspace. Written as a row range over the whole index key,
# `(workspace_id, tx, position) > ($4, tx0, pos0) AND workspace_id <= $4` means the same rows,
# and the ORDER BY only that index provides keeps every plan on it.
#
# `tx >= $1` says nothing new, but it keeps the scan's start at the cursor when the reader is
# `svc_log_reader`: its row-level policy adds `workspace_id = <setting>`, an equality on the
# index's first column, with which the planner starts the scan at the workspace's first
# entry and only filters by the row range, so each page read the workspace from its start
# (a catch-up quadratic in the workspace's length).
_IN_WORKSPACE = (
    "(workspace_id, tx, position) > ($4, $1::xid8, $2::int8) AND workspace_id <= $4 "
    f"AND tx >= $1::xid8 AND {_VISIBLE}"
)
_READ_WORKSPACE = f"""
SELECT {EVENT_COLUMNS} FROM events
WHERE {_IN_WORKSPACE}
ORDER BY workspace_id, tx, position
LIMIT $3
"""
_READ_WORKSPACE_TYPES = f"""
SELECT {EVENT_COLUMNS} FROM events
WHERE {_IN_WORKSPACE} AND type = ANY($5::text[])
ORDER BY workspace_id, tx, position
LIMIT $3
"""
_HEAD = f"""
SELECT tx, position FROM events WHERE {_VISIBLE}
ORDER BY tx DESC, position DESC
LIMIT 1
"""
# One descent of `(workspace_id, tx, position)`, backwards from the workspace's end.
_WORKSPACE_HEAD = f"""
SELECT tx, position FROM events WHERE workspace_id = $1 AND {_VISIBLE}
ORDER BY workspace_id DESC, tx DESC, position DESC
LIMIT 1
"""


async def read_log(
    conn: Connection,
    after: LogPoint,
    limit: int,
    workspace_id: str | None = None,
    types: Sequence[str] | None = None,
) -> list[RecordedEvent]:
    """Up to `limit` committed events strictly after `after`, in gap-free log order.

    `types=None` means every type; an empty sequence matches nothing.
    """
    if types is not None and not types:
        return []
    statement, args = _PAGE.pick(after, limit, workspace_id, types)
    return rows_to_events(await conn.fetch(statement, *args))


class _PageReads(NamedTuple):
    """A page of the log in its four statements: the whole log or a workspace's, every type
    or some. Their parameters: the point after, the limit, then the workspace and the types
    where they have them (a cut page's byte budget last)."""

    whole: str
    whole_types: str
    workspace: str
    workspace_types: str

    def pick(
        self,
        after: LogPoint,
        limit: int,
        workspace_id: str | None,
        types: Sequence[str] | None,
    ) -> tuple[str, tuple[object, ...]]:
        args: tuple[object, ...] = (after.tx, after.position, limit)
        if workspace_id is not None:
            args += (workspace_id,)
        if types is not None:
            args += (list(types),)
        if workspace_id is None:
            return (self.whole if types is None else self.whole_types), args
        return (self.workspace if types is None else self.workspace_types), args


_PAGE = _PageReads(_READ_ALL, _READ_ALL_TYPES, _READ_WORKSPACE, _READ_WORKSPACE_TYPES)


def _cut_by_bytes(read: str, order: str, budget: str) -> str:
    """`read` (a page of EVENT_COLUMNS, `LIMIT $3`) cut to the rows that begin within a
    budget of stored bytes (`budget`, a parameter), the first row always taken (a page
    always moves on). The sizes are the columns' stored sizes (`pg_column_size`: compressed
    and out of line, read without loading the value), so the rows left out are never
    loaded or sent. A last column says whether more may follow: the page was full, or rows
    were left out (the total then passes the budget; a page that merely ends past it is
    said to be cut too, which costs the reader one more read, never an event)."""
    sized = read.replace(
        f"SELECT {EVENT_COLUMNS} FROM events",
        "SELECT events.*, pg_column_size(data) + pg_column_size(metadata) AS bytes FROM events",
    )
    return f"""
SELECT {EVENT_COLUMNS}, (rows_read >= $3 OR bytes_read > {budget}) AS more FROM (
    SELECT page.*,
           sum(bytes) OVER (ORDER BY {order} ROWS UNBOUNDED PRECEDING) - bytes AS before,
           count(*) OVER () AS rows_read,
           sum(bytes) OVER () AS bytes_read
    FROM ({sized}) page
) sized
WHERE before < {budget}
ORDER BY {order}
"""


_PAGE_CUT = _PageReads(
    _cut_by_bytes(_READ_ALL, "tx, position", "$4"),
    _cut_by_bytes(_READ_ALL_TYPES, "tx, position", "$5"),
    _cut_by_bytes(_READ_WORKSPACE, "workspace_id, tx, position", "$5"),
    _cut_by_bytes(_READ_WORKSPACE_TYPES, "workspace_id, tx, position", "$6"),
)


async def read_log_cut(
    conn: Connection,
    after: LogPoint,
    limit: int,
    max_bytes: int,
    types: Sequence[str] | None = None,
    workspace_id: str | None = None,
    timeout: float | None = None,
) -> tuple[list[RecordedEvent], bool]:
    """Like `read_log`, the page also bounded by `max_bytes` of stored event data (the first
    event always taken), and whether more may follow it: for the readers that hold a whole
    page at once (the projections, a feed catching up), where a page of a thousand
    one-megabyte messages held a gigabyte. `timeout`: the client's wait for the answer, when
    not the connection's (a page of rare `types` may scan the rest of the log)."""
    if types is not None and not types:
        return [], False
    statement, args = _PAGE_CUT.pick(after, limit, workspace_id, types)
    rows = await conn.fetch(statement, *args, max_bytes, timeout=timeout)
    if not rows:
        return [], False
    width = len(_FIELDS)
    return [RecordedEvent(*row[:width]) for row in rows], bool(rows[0][width])


# A point was issued by this log when its transaction id was ever assigned (below the
# snapshot's xmax, the first id not yet assigned) and its position was ever drawn from the
# positions sequence (NULL before the first draw). Such a point may still be ahead of every
# reader (its transaction may not have committed, or an older one holds xmin back); one that
# fails either test comes from another database or was made up.
_ISSUED = """
SELECT $1::xid8 < pg_snapshot_xmax(pg_current_snapshot())
   AND $2::int8 <= coalesce(pg_sequence_last_value('events_position_seq'::regclass), 0)
"""


async def point_issued(conn: Connection, point: LogPoint) -> bool:
    """Whether `point` names a transaction and a position this log has handed out."""
    issued = await conn.fetchval(_ISSUED, point.tx, point.position)
    return bool(issued)


async def log_head(conn: Connection, workspace_id: str | None = None) -> LogPoint:
    """The newest point visible to gap-free readers, of one workspace's events if given;
    `ORIGIN` for an empty log."""
    if workspace_id is None:
        row = await conn.fetchrow(_HEAD)
    else:
        row = await conn.fetchrow(_WORKSPACE_HEAD, workspace_id)
    return ORIGIN if row is None else LogPoint(row[0], row[1])
