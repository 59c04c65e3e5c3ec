"""Reads of the read models for the gateway, returning typed records.

Every tenant read runs in `Database.scoped(workspace_id)`: a transaction as the least-privilege
role `svc_reader` with `svc.workspace_id` set, so row-level security filters every table even
if a query here forgot its `WHERE workspace_id` (ARCHITECTURE.md decision 6). The queries still
name the workspace: it lets the planner use the `(workspace_id, ...)` indexes.

The exceptions are `find_api_key_by_hash` and `stale_running_turns`, see there.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime
from typing import Any, Literal

from eventstore.db import Database
from eventstore.paging import cut_page
from schemas.errors import InvalidInput

Bucket = Literal["hour", "day"]
MAX_BUCKETS = 10_000


@dataclass(frozen=True, slots=True)
class Conversation:
    id: str
    workspace_id: str
    title: str | None
    project_id: str | None
    folder: str | None
    tags: list[str]
    agent: str | None
    model: str | None
    created_at: datetime
    updated_at: datetime
    message_count: int
    deleted: bool


@dataclass(frozen=True, slots=True)
class Message:
    conversation_id: str
    seq: int
    message_id: str
    role: str
    content: str
    name: str | None
    turn_id: str | None
    created_at: datetime


@dataclass(frozen=True, slots=True)
class Turn:
    turn_id: str
    conversation_id: str
    status: str
    """running, completed or failed (see projections/turns.py)."""
    model: str | None
    prompt_tokens: int | None
    completion_tokens: int | None
    total_tokens: int | None
    duration_ms: int | None
    error_code: str | None
    error_message: str | None
    started_at: datetime | None
    finished_at: datetime | None
    command_id: str | None


@dataclass(frozen=True, slots=True)
class Workspace:
    id: str
    name: str
    created_at: datetime


@dataclass(frozen=True, slots=True)
class ApiKey:
    """An issued key as recorded: never the key, never its hash."""

    key_id: str
    workspace_id: str
    name: str
    prefix: str
    scopes: list[str]
    rate_limit_rpm: int | None
    created_at: datetime
    expires_at: datetime | None
    revoked_at: datetime | None
    user_id: str | None = None
    """The user the key acts as (`POST /v1/admin/users/{id}/apikeys`); None for a workspace
    key. Only the listings read it: authentication looks a key's user up on its own."""

    def usable_at(self, now: datetime) -> bool:
        return self.revoked_at is None and (self.expires_at is None or now < self.expires_at)


@dataclass(frozen=True, slots=True)
class Overview:
    conversations: int
    messages: int
    turns: int
    turns_running: int
    turns_failed: int
    total_tokens: int
    api_keys_active: int


@dataclass(frozen=True, slots=True)
class UsageFigures:
    turns: int
    completed: int
    failed: int
    running: int
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    avg_duration_ms: float | None
    """Mean duration of finished turns, abandoned ones left out; None when there are none."""
    p95_duration_ms: float | None


@dataclass(frozen=True, slots=True)
class UsageBucket:
    start: datetime
    figures: UsageFigures


@dataclass(frozen=True, slots=True)
class Analytics:
    since: datetime
    until: datetime
    bucket: Bucket
    totals: UsageFigures
    series: list[UsageBucket]
    """Every bucket from the one holding `since` up to `until`, empty ones included."""


_CONVERSATION_COLUMNS = (
    "id, workspace_id, title, project_id, folder, tags, agent, model, created_at, updated_at, "
    "message_count, deleted"
)
_TURN_COLUMNS = (
    "turn_id, conversation_id, status, model, prompt_tokens, completion_tokens, total_tokens, "
    "duration_ms, error_code, error_message, started_at, finished_at, command_id"
)
_KEY_COLUMNS = (
    "key_id, workspace_id, name, prefix, scopes, rate_limit_rpm, created_at, expires_at, revoked_at"
)

_LISTED_KEYS = "api_keys LEFT JOIN identity_user_api_keys USING (workspace_id, key_id)"
"""Keys with the user each acts as: a key is linked to one user at most (the link's key is
(workspace_id, key_id)), so the join neither drops nor repeats a key."""
_LISTED_KEY_COLUMNS = f"{_KEY_COLUMNS}, user_id"


def _conversation(row: Any) -> Conversation:
    return Conversation(*row)


@dataclass(frozen=True, slots=True)
class Keyset:
    """Where a page starts in a listing's order, past the last row of the page before:
    `sql` (the code's own text, placeholders from $4) and the values it compares with."""

    sql: str
    args: tuple[Any, ...]


@dataclass(frozen=True, slots=True)
class PagedSelect:
    """A workspace's rows of one read model, a page at a time. Every part is the code's own
    SQL text, never a client's: the client gives only the workspace, limit and offset."""

    columns: str
    table: str
    order: str
    where: str = ""
    """More of the WHERE clause after `workspace_id = $1` (`AND NOT deleted`)."""

    async def fetch(
        self, db: Database, workspace_id: str, limit: int, offset: int, after: Keyset | None = None
    ) -> tuple[list[Any], int]:
        """The page's rows (past `after` if given), and how many rows the query selects over
        every page, as of one snapshot (`Database.scoped` is a REPEATABLE READ transaction)."""
        selected = f"FROM {self.table} WHERE workspace_id = $1 {self.where}"
        past = "" if after is None else f"AND {after.sql}"
        async with db.scoped(workspace_id) as conn:
            rows = await conn.fetch(
                f"SELECT {self.columns} {selected} {past} ORDER BY {self.order} LIMIT $2 OFFSET $3",
                workspace_id,
                limit,
                offset,
                *(() if after is None else after.args),
            )
            total = await conn.fetchval(f"SELECT count(*) {selected}", workspace_id)
        return list(rows), int(total)


async def list_conversations(
    db: Database,
    workspace_id: str,
    *,
    limit: int = 50,
    offset: int = 0,
    include_deleted: bool = False,
    after: tuple[datetime, str] | None = None,
) -> tuple[list[Conversation], int]:
    """A page of conversations, most recently updated first, and the total count; with
    `after` (the `updated_at` and `id` of a page's last row), those that come after it in
    that order: a walk that pages so meets each conversation at most once, however many are
    updated meanwhile (an updated one moves to the front, before where the walk is)."""
    page = PagedSelect(
        _CONVERSATION_COLUMNS,
        "conversations",
        "updated_at DESC, id",
        "" if include_deleted else "AND NOT deleted",
    )
    past = None if after is None else Keyset(_AFTER_CONVERSATION, after)
    rows, total = await page.fetch(db, workspace_id, limit, offset, past)
    return [_conversation(r) for r in rows], total


_AFTER_CONVERSATION = "updated_at <= $4 AND (updated_at < $4 OR id > $5)"
"""Past a row in the order `updated_at DESC, id`. The first term bounds the scan of index
conversations_ws_updated (an OR alone would be read from the index's start on every page)."""


_CONVERSATION = (
    f"SELECT {_CONVERSATION_COLUMNS} FROM conversations WHERE workspace_id = $1 AND id = $2"
)


async def get_conversation(
    db: Database, workspace_id: str, conversation_id: str
) -> Conversation | None:
    """The conversation, deleted or not; None when this workspace has none by that id."""
    async with db.scoped(workspace_id) as conn:
        row = await conn.fetchrow(_CONVERSATION, workspace_id, conversation_id)
    return None if row is None else _conversation(row)


_MESSAGES = """
SELECT conversation_id, seq, message_id, role, content, name, turn_id, created_at
FROM messages WHERE workspace_id = $1 AND conversation_id = $2
ORDER BY seq
"""

MAX_SEQ = 2**31 - 1
"""`messages.seq` is an integer column: a page bound past it names no message."""

# The sizes first, without the text (octet_length reads a stored value's length, not the
# value), so that a page is cut by its bytes before any text is loaded.
_MESSAGE_SIZES = """
SELECT seq, octet_length(content) FROM messages
WHERE workspace_id = $1 AND conversation_id = $2 AND seq > $3 AND seq <= $4
ORDER BY seq LIMIT $5
"""
_MESSAGE_RANGE = """
SELECT conversation_id, seq, message_id, role, content, name, turn_id, created_at
FROM messages WHERE workspace_id = $1 AND conversation_id = $2 AND seq > $3 AND seq <= $4
ORDER BY seq
"""


@dataclass(frozen=True, slots=True)
class MessagePage:
    messages: list[Message]
    next_after: int | None
    """The `seq` to read on from (the last one here); None when no message follows."""


async def get_message_page(
    db: Database,
    workspace_id: str,
    conversation_id: str,
    *,
    after: int,
    limit: int,
    max_bytes: int,
    through: int = MAX_SEQ,
) -> MessagePage:
    """The messages after `after` (a `seq`) up to `through`, oldest first: at most `limit`,
    and no more than `max_bytes` of text unless the first alone is larger (a page always
    moves on). A conversation of thousands of messages of up to a megabyte each is read in
    pages whose memory is bounded, wherever they go."""
    through = min(through, MAX_SEQ)
    async with db.scoped(workspace_id) as conn:
        sizes = await conn.fetch(
            _MESSAGE_SIZES, workspace_id, conversation_id, after, through, limit + 1
        )
        last, more = cut_page([(r[0], r[1]) for r in sizes], limit, max_bytes)
        if last is None:
            return MessagePage([], None)
        rows = await conn.fetch(_MESSAGE_RANGE, workspace_id, conversation_id, after, last)
    return MessagePage([Message(*r) for r in rows], last if more else None)


async def get_conversation_and_last_seq(
    db: Database, workspace_id: str, conversation_id: str
) -> tuple[Conversation, int] | None:
    """The conversation and the `seq` of its last message as of one snapshot: an export
    reads its messages up to that one, so its header and body agree while the
    conversation goes on. None when this workspace has no conversation by that id."""
    async with db.scoped(workspace_id) as conn:
        row = await conn.fetchrow(_CONVERSATION, workspace_id, conversation_id)
        if row is None:
            return None
        last = await conn.fetchval(
            "SELECT coalesce(max(seq), 0) FROM messages "
            "WHERE workspace_id = $1 AND conversation_id = $2",
            workspace_id,
            conversation_id,
        )
    return _conversation(row), int(last)


async def get_messages(db: Database, workspace_id: str, conversation_id: str) -> list[Message]:
    """Every message of the conversation, oldest first (empty for an unknown conversation)."""
    async with db.scoped(workspace_id) as conn:
        rows = await conn.fetch(_MESSAGES, workspace_id, conversation_id)
    return [Message(*r) for r in rows]


async def list_turns(
    db: Database, workspace_id: str, conversation_id: str | None = None, *, limit: int = 50
) -> list[Turn]:
    """The most recent turns, of one conversation or of the whole workspace, newest first
    (by start, or by finish for a turn that never started)."""
    of = "" if conversation_id is None else "AND conversation_id = $3"
    # The turns that started come off an index in this order (migration 0180), at most
    # `limit` of them; those that never started (few) are found by their own and sorted;
    # the merge then sorts at most 2 x limit rows.
    sql = f"""
        SELECT * FROM (
            (SELECT {_TURN_COLUMNS} FROM turns
             WHERE workspace_id = $1 AND started_at IS NOT NULL {of}
             ORDER BY started_at DESC, turn_id LIMIT $2)
            UNION ALL
            (SELECT {_TURN_COLUMNS} FROM turns
             WHERE workspace_id = $1 AND started_at IS NULL {of}
             ORDER BY finished_at DESC, turn_id LIMIT $2)
        ) AS t
        ORDER BY coalesce(started_at, finished_at) DESC, turn_id
        LIMIT $2
    """
    args: tuple[Any, ...] = (workspace_id, limit)
    if conversation_id is not None:
        args += (conversation_id,)
    async with db.scoped(workspace_id) as conn:
        rows = await conn.fetch(sql, *args)
    return [Turn(*r) for r in rows]


@dataclass(frozen=True, slots=True)
class RunningTurns:
    workspace_id: str
    conversation_id: str
    turn_ids: tuple[str, ...]
    due: datetime
    """When its soonest turn went stale: with the ids, the key a sweep goes on after."""

    @property
    def key(self) -> SweepKey:
        return SweepKey(self.due, self.workspace_id, self.conversation_id)


@dataclass(frozen=True, slots=True)
class SweepKey:
    """Where a sweep stopped, in its order (due, workspace, conversation)."""

    due: datetime
    workspace_id: str
    conversation_id: str


@dataclass(frozen=True, slots=True)
class SweepWindow:
    """Which running turns a sweep asks for: those whose recorded expiry falls in `expired`
    and, of the turns that recorded none (from before turns carried one), those that
    started in `started` (None: no such turn is stale). A window is [from, until); a from of
    None is open."""

    expired: tuple[datetime | None, datetime]
    started: tuple[datetime | None, datetime] | None


async def stale_running_turns(
    db: Database, window: SweepWindow, *, limit: int, after: SweepKey | None = None
) -> list[RunningTurns]:
    """Turns still `running` in `window`, by conversation, soonest due first (by expiry, or
    by start for the turns without one), up to `limit` conversations, those after `after`
    (where the last page ended: conversations that stay stale, their command failing, must
    not hold the first page for good).

    Across workspaces, as the table owner (row-level security does not apply): the
    service's own sweep of abandoned turns, never a client's read (gateway/turn_sweep.py).
    Two range probes of the `(workspace_id, expires_at, started_at)` index per workspace.
    `status` is in no index, so a turn's completion stays a heap-only update."""
    (expired_from, expired_until), started = window.expired, window.started
    started_from, started_until = started if started is not None else (None, None)
    async with db.acquire(stateless=True) as conn:
        rows = await conn.fetch(
            """
            SELECT t.workspace_id, t.conversation_id, array_agg(t.turn_id ORDER BY t.turn_id),
                   min(t.due)
            FROM workspaces AS w
            CROSS JOIN LATERAL (
                SELECT workspace_id, conversation_id, turn_id, expires_at AS due FROM turns
                WHERE workspace_id = w.workspace_id
                  AND expires_at >= coalesce($1, '-infinity'::timestamptz)
                  AND expires_at < $2 AND status = 'running'
                UNION ALL
                SELECT workspace_id, conversation_id, turn_id, started_at FROM turns
                WHERE $4::timestamptz IS NOT NULL
                  AND workspace_id = w.workspace_id AND expires_at IS NULL
                  AND started_at >= coalesce($3, '-infinity'::timestamptz)
                  AND started_at < $4 AND status = 'running'
            ) AS t
            GROUP BY t.workspace_id, t.conversation_id
            HAVING $6::timestamptz IS NULL
                OR (min(t.due), t.workspace_id, t.conversation_id) > ($6, $7, $8)
            ORDER BY min(t.due), t.workspace_id, t.conversation_id
            LIMIT $5
            """,
            expired_from,
            expired_until,
            started_from,
            started_until,
            limit,
            None if after is None else after.due,
            None if after is None else after.workspace_id,
            None if after is None else after.conversation_id,
        )
    return [RunningTurns(r[0], r[1], tuple(r[2]), r[3]) for r in rows]


async def get_workspace(db: Database, workspace_id: str) -> Workspace | None:
    async with db.scoped(workspace_id) as conn:
        row = await conn.fetchrow(
            "SELECT id, name, created_at FROM workspaces WHERE id = $1", workspace_id
        )
    return None if row is None else Workspace(*row)


async def list_api_keys(
    db: Database, workspace_id: str, *, include_revoked: bool = True
) -> list[ApiKey]:
    """The workspace's keys, newest first. svc_reader cannot even select `key_hash`."""
    revoked = "" if include_revoked else "AND revoked_at IS NULL"
    async with db.scoped(workspace_id) as conn:
        rows = await conn.fetch(
            f"""
            SELECT {_LISTED_KEY_COLUMNS} FROM {_LISTED_KEYS} WHERE workspace_id = $1 {revoked}
            ORDER BY created_at DESC, key_id
            """,
            workspace_id,
        )
    return [ApiKey(*r) for r in rows]


async def page_api_keys(
    db: Database, workspace_id: str, *, limit: int, offset: int
) -> tuple[list[ApiKey], int]:
    """A page of the workspace's keys, newest first, and how many there are, revoked ones
    included, as of one snapshot."""
    page = PagedSelect(_LISTED_KEY_COLUMNS, _LISTED_KEYS, "created_at DESC, key_id")
    rows, total = await page.fetch(db, workspace_id, limit, offset)
    return [ApiKey(*r) for r in rows], total


async def get_api_key(db: Database, workspace_id: str, key_id: str) -> ApiKey | None:
    """One key of the workspace as the listings show it (with the user it acts as)."""
    async with db.scoped(workspace_id) as conn:
        row = await conn.fetchrow(
            f"SELECT {_LISTED_KEY_COLUMNS} FROM {_LISTED_KEYS} "
            "WHERE workspace_id = $1 AND key_id = $2",
            workspace_id,
            key_id,
        )
    return None if row is None else ApiKey(*row)


async def find_api_key_by_hash(db: Database, key_hash: str) -> ApiKey | None:
    """The key whose sha256 hex digest is `key_hash`, in whichever workspace; revoked and
    expired keys included (the caller decides with `usable_at`).

    This runs as the service role, outside row-level security, because it is what tells the
    gateway the workspace in the first place: before it there is no workspace to scope to.
    It cannot be used to browse other tenants: it matches one unique hash of a secret the
    caller must already hold, and returns that key's record only (never the hash).
    """
    async with db.acquire() as conn:
        row = await conn.fetchrow(
            f"SELECT {_KEY_COLUMNS} FROM api_keys WHERE key_hash = $1", key_hash
        )
    return None if row is None else ApiKey(*row)


async def overview(db: Database, workspace_id: str) -> Overview:
    """Tenant counts for the admin overview."""
    async with db.scoped(workspace_id) as conn:
        row = await conn.fetchrow(
            """
            SELECT
              (SELECT count(*) FROM conversations WHERE workspace_id = $1 AND NOT deleted),
              (SELECT count(*) FROM messages WHERE workspace_id = $1),
              (SELECT count(*) FROM turns WHERE workspace_id = $1),
              (SELECT count(*) FROM turns WHERE workspace_id = $1 AND status = 'running'),
              (SELECT count(*) FROM turns WHERE workspace_id = $1 AND status = 'failed'),
              (SELECT coalesce(sum(total_tokens), 0) FROM turns WHERE workspace_id = $1),
              (SELECT count(*) FROM api_keys WHERE workspace_id = $1 AND revoked_at IS NULL
                 AND (expires_at IS NULL OR expires_at > now()))
            """,
            workspace_id,
        )
    return Overview(*(int(v) for v in row))


_FIGURES = """
count(t.turn_id),
count(t.turn_id) FILTER (WHERE t.status = 'completed'),
count(t.turn_id) FILTER (WHERE t.status = 'failed'),
count(t.turn_id) FILTER (WHERE t.status = 'running'),
coalesce(sum(t.prompt_tokens), 0),
coalesce(sum(t.completion_tokens), 0),
coalesce(sum(t.total_tokens), 0),
avg(t.duration_ms) FILTER (WHERE t.error_code IS DISTINCT FROM 'turn_abandoned')::float8,
percentile_cont(0.95) WITHIN GROUP (ORDER BY t.duration_ms)
    FILTER (WHERE t.error_code IS DISTINCT FROM 'turn_abandoned')::float8
"""
# Durations leave out abandoned turns: theirs is the time until the turn was found abandoned
# (a restart later, say), not a model call's.
# A turn belongs to the bucket of its start (its finish when it never started).
_WHEN = "coalesce(t.started_at, t.finished_at)"
# The window [$2, $3), spelled so that each half is a range on an index (migration 0180):
# `_WHEN >= $2` itself is no range on any, and read every turn of the workspace.
_IN_WINDOW = """
t.workspace_id = $1
AND ((t.started_at >= $2 AND t.started_at < $3)
     OR (t.started_at IS NULL AND t.finished_at >= $2 AND t.finished_at < $3))
"""


def _figures(row: Any, offset: int = 0) -> UsageFigures:
    return UsageFigures(
        turns=int(row[offset]),
        completed=int(row[offset + 1]),
        failed=int(row[offset + 2]),
        running=int(row[offset + 3]),
        prompt_tokens=int(row[offset + 4]),
        completion_tokens=int(row[offset + 5]),
        total_tokens=int(row[offset + 6]),
        avg_duration_ms=row[offset + 7],
        p95_duration_ms=row[offset + 8],
    )


async def analytics(
    db: Database, workspace_id: str, *, since: datetime, until: datetime, bucket: Bucket = "day"
) -> Analytics:
    """Usage from the turns read model over [since, until), in UTC hour or day buckets."""
    if bucket not in ("hour", "day"):
        raise InvalidInput(f"bucket must be hour or day, not {bucket!r}")
    if since.tzinfo is None or until.tzinfo is None:
        raise InvalidInput("since and until must carry a UTC offset")
    if until <= since:
        raise InvalidInput("until must be later than since")
    width = 3600 if bucket == "hour" else 86400
    if (until - since).total_seconds() / width > MAX_BUCKETS:
        raise InvalidInput(f"the window spans more than {MAX_BUCKETS} {bucket} buckets")
    async with db.scoped(workspace_id) as conn:
        total = await conn.fetchrow(
            f"SELECT {_FIGURES} FROM turns t WHERE {_IN_WINDOW}", workspace_id, since, until
        )
        rows = await conn.fetch(
            f"""
            WITH windowed AS (
                SELECT t.*, date_trunc($4, {_WHEN}, 'UTC') AS bucket
                FROM turns t WHERE {_IN_WINDOW}
            )
            SELECT b.start, {_FIGURES}
            FROM generate_series(date_trunc($4, $2::timestamptz, 'UTC'),
                                 $3::timestamptz - interval '1 microsecond',
                                 ('1 ' || $4)::interval) AS b(start)
            LEFT JOIN windowed t ON t.bucket = b.start
            GROUP BY b.start ORDER BY b.start
            """,
            workspace_id,
            since,
            until,
            bucket,
        )
    series = [UsageBucket(start=r[0], figures=_figures(r, 1)) for r in rows]
    return Analytics(since, until, bucket, _figures(total), series)
