"""Requests and responses of the admin API (/v1/admin/*) and the frames of the SSE feeds.

These models are the wire contract: handlers validate query strings and bodies with them and
serialise responses through them, and the OpenAPI document is generated from them.
"""

from __future__ import annotations

import base64
import binascii
import re
import unicodedata
from datetime import UTC, datetime, timedelta
from typing import Annotated, Any, Literal

from pydantic import (
    AfterValidator,
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    TypeAdapter,
    ValidationError,
    field_validator,
    model_validator,
)
from pydantic.json_schema import WithJsonSchema

from schemas.workspace import unknown_scopes


class _Wire(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")


# -- paging -----------------------------------------------------------------------------------

MAX_PAGE = 200
DEFAULT_PAGE = 50
MAX_OFFSET = 1_000_000_000
"""Beyond any real read model, and far inside the database's 64-bit integer."""
MAX_RATE_LIMIT_RPM = 1_000_000
"""The highest per-key limit, in requests a minute."""


class NoQuery(_Wire):
    """The query of a route that takes no parameter: any is refused, as a typo is."""


class AdminRead(_Wire):
    """Query parameters every admin read accepts."""

    min_cursor: str | None = Field(
        default=None,
        description="read-your-writes: wait (up to 5 s) until the read models applied this "
        "cursor (from a write's response or a feed frame); 503 projection_lagging otherwise",
    )


class PageQuery(AdminRead):
    limit: int = Field(default=DEFAULT_PAGE, ge=1, le=MAX_PAGE)
    offset: int = Field(default=0, ge=0, le=MAX_OFFSET)


# -- overview and analytics -------------------------------------------------------------------


class ProjectionHealth(_Wire):
    name: str
    status: Literal["ok", "lagging", "stopped", "failed"]
    lag_seconds: float


class HealthStatus(_Wire):
    status: Literal["ok", "degraded"]
    database: Literal["ok"]
    projections: list[ProjectionHealth]


class OverviewCounts(_Wire):
    conversations: int
    messages: int
    turns: int
    turns_running: int
    turns_failed: int
    total_tokens: int
    api_keys_active: int


class OverviewResponse(_Wire):
    workspace_id: str
    workspace_name: str | None = None
    counts: OverviewCounts
    health: HealthStatus


def _as_utc(value: datetime | None) -> datetime | None:
    """The instant in UTC, as the buckets are; ISO-8601 without an offset is read as UTC."""
    if value is None:
        return None
    if value.tzinfo is None:
        return value.replace(tzinfo=UTC)
    try:
        return value.astimezone(UTC)
    except OverflowError:  # the year 1 at +14:00 is before the year 1 in UTC
        raise ValueError(_RANGE_MESSAGE) from None


_RANGE_MESSAGE = "must lie between 1970-01-01T00:00:00Z and 9000-01-01T00:00:00Z"
MAX_WINDOW = {"hour": timedelta(days=31), "day": timedelta(days=366)}
EARLIEST = datetime(1970, 1, 1, tzinfo=UTC)
LATEST = datetime(9000, 1, 1, tzinfo=UTC)
"""Bounds of `since`/`until`: the window and its buckets stay representable in the database
and in Python (the year 1 or 9999 with an offset is neither)."""


_ISO_DATE = re.compile(r"[0-9]{4}-[0-9]{2}-[0-9]{2}")


_SPACED_OFFSET = re.compile(r"[0-9]{2}:[0-9]{2}(:[0-9]{2}(\.[0-9]+)?)? [0-9]{2}(:?[0-9]{2})?$")
"""A date-time whose `+hh:mm` came through a query string as a space."""


def _iso_text(value: Any) -> Any:
    """Only ISO-8601 text: pydantic also reads a number ("0", "20261126") as Unix seconds,
    so a date typed without its dashes would silently become an instant of 1970. A value
    Python cannot read either way is refused with the reason (an hour of 25), where
    pydantic's own message spoke of "extra characters"."""
    if not isinstance(value, str) or not _ISO_DATE.match(value):
        raise ValueError(
            "must be an ISO-8601 date or date-time such as 2026-11-26 or "
            f"2026-11-26T08:00:00Z{' (not a number)' if _NUMBER.fullmatch(str(value)) else ''}"
        )
    if _SPACED_OFFSET.search(value):
        raise ValueError(
            "has a space where its UTC offset's sign goes: a '+' in a query string reads as "
            "a space, so write it %2B (2026-11-26T08:00:00%2B05:00), or give the time in "
            "UTC with Z"
        )
    try:
        # Read as the field would read it (and handed on read): a refusal said in words.
        return _DATE_OR_TIME.validate_python(value)
    except ValidationError:
        raise ValueError(
            f"is not a date or date-time{_why_not(value)}; use the form 2026-11-26 or "
            "2026-11-26T08:00:00Z (an offset as +05:00, written %2B05:00 in a URL)"
        ) from None


_NUMBER = re.compile(r"[+-]?[0-9]+(\.[0-9]*)?")
_DATE_OR_TIME: TypeAdapter[datetime] = TypeAdapter(datetime)


def _why_not(value: str) -> str:
    """Python's reason a date-time does not read (an hour of 25, a day of 31 in June), when
    it has one a person can use; pydantic's own spoke of "extra characters"."""
    try:
        # RFC 3339 takes a lower-case z, as pydantic does; Python 3.11's parser does not.
        datetime.fromisoformat(value[:-1] + "Z" if value.endswith("z") else value)
    except ValueError as exc:
        reason = str(exc)
        if "timedelta" in reason:
            return " (a UTC offset is under 24 hours)"
        return "" if "isoformat string" in reason else f" ({reason})"
    return ""


def _in_range(value: datetime | None) -> datetime | None:
    if value is not None and not EARLIEST <= value < LATEST:
        raise ValueError(_RANGE_MESSAGE)
    return value


class AnalyticsQuery(AdminRead):
    """Window `[since, until)`; default `until` is now, default `since` 24 hours (bucket=hour)
    or 7 days (bucket=day) before `until`."""

    since: datetime | None = None
    until: datetime | None = None
    bucket: Literal["hour", "day"] = "day"

    _iso = field_validator("since", "until", mode="before")(_iso_text)
    _utc = field_validator("since", "until")(_as_utc)
    _range = field_validator("since", "until", mode="after")(_in_range)

    def window(self, now: datetime) -> tuple[datetime, datetime]:
        until = self.until or now
        default = timedelta(hours=24) if self.bucket == "hour" else timedelta(days=7)
        # The default window stops at the earliest instant a caller may name.
        since = self.since or max(until - default, EARLIEST)
        if until <= since:
            if self.until is None:
                raise ValueError("since must be in the past: until defaults to now")
            raise ValueError("until must be later than since")
        if until - since > MAX_WINDOW[self.bucket]:
            days = MAX_WINDOW[self.bucket].days
            raise ValueError(f"with bucket={self.bucket} the window may span at most {days} days")
        return since, until


class UsageFigures(_Wire):
    turns: int
    completed: int
    failed: int
    running: int
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    avg_duration_ms: float | None
    p95_duration_ms: float | None


class UsageBucket(UsageFigures):
    start: datetime


class AnalyticsResponse(_Wire):
    since: datetime
    until: datetime
    bucket: Literal["hour", "day"]
    totals: UsageFigures
    series: list[UsageBucket] = Field(description="every bucket of the window, empty ones too")


# -- conversations ----------------------------------------------------------------------------


class ConversationSummary(_Wire):
    id: str
    title: str = Field(
        description="empty until the conversation has one (its first message's words)"
    )
    workspace_id: str
    project_id: str | None = None
    folder: str | None = None
    tags: list[str] = Field(default_factory=list)
    agent: str | None = None
    model: str | None = None
    message_count: int = 0
    deleted: bool = False
    created_at: datetime
    updated_at: datetime


_EPOCH = datetime(1970, 1, 1, tzinfo=UTC)
_POSITION = re.compile(r"(-?[0-9]{1,19}):([^\x00]{1,200})", re.DOTALL)
"""No NUL in the id: PostgreSQL text cannot hold one (its parameter would be a 500)."""
_NOT_A_POSITION = (
    "is not a next_after of the conversation list: pass the next_after of the page before, "
    "as it came, or start again without after"
)


def conversation_position(updated_at: datetime, conversation_id: str) -> str:
    """The `next_after` of a page of the conversation list whose last row is this one:
    opaque to clients, exact to the microsecond the read model keeps."""
    micros = (updated_at - _EPOCH) // timedelta(microseconds=1)
    text = f"{micros}:{conversation_id}".encode()
    return base64.urlsafe_b64encode(text).rstrip(b"=").decode()


def _read_position(token: str | None) -> tuple[datetime, str] | None:
    if token is None:
        return None
    try:
        padded = token + "=" * (-len(token) % 4)
        text = base64.b64decode(padded, altchars=b"-_", validate=True).decode()
        found = _POSITION.fullmatch(text)
        if found is None:
            raise ValueError(_NOT_A_POSITION)
        return _EPOCH + timedelta(microseconds=int(found[1])), found[2]
    except (binascii.Error, UnicodeDecodeError, OverflowError) as exc:
        raise ValueError(_NOT_A_POSITION) from exc


class ConversationListQuery(PageQuery):
    after: Annotated[
        tuple[datetime, str] | None,
        BeforeValidator(_read_position),
        WithJsonSchema({"type": "string", "description": "a page's next_after, as it came"}),
    ] = Field(
        default=None,
        description="list the conversations after this one (next_after of a page)",
    )

    @model_validator(mode="after")
    def _one_way_to_page(self) -> ConversationListQuery:
        if self.after is not None and self.offset:
            raise ValueError(
                "give after or offset, not both: after (a page's next_after) already says "
                "where the page starts"
            )
        return self


class ConversationList(_Wire):
    conversations: list[ConversationSummary] = Field(description="most recently updated first")
    total: int
    limit: int
    offset: int
    next_after: str | None = Field(
        description="pass as after for the next page; null on the last. A walk by after "
        "meets each conversation at most once, however many are updated meanwhile"
    )


MAX_MESSAGES_PAGE = 1000


class MessagesQuery(AdminRead):
    """A conversation's messages in pages: `after` the `seq` of the last one read."""

    id: str = Field(min_length=1, max_length=200)
    after: int = Field(
        default=0,
        ge=0,
        le=2**31 - 1,  # the largest seq there can be
        description="list the messages after this seq (next_after of a page)",
    )
    limit: int = Field(default=MAX_MESSAGES_PAGE, ge=1, le=MAX_MESSAGES_PAGE)


class ConversationMessage(_Wire):
    seq: int = Field(description="the message's place in its conversation: 1, 2, 3...")
    role: Literal["system", "user", "assistant", "tool"]
    content: str
    name: str | None = None
    turn_id: str | None = None
    created_at: datetime


class ConversationMessages(_Wire):
    conversation_id: str
    messages: list[ConversationMessage] = Field(
        description="oldest first; at most limit of them, and about 8 MiB of text"
    )
    next_after: int | None = Field(description="pass as after for the next page; null on the last")


class TurnsQuery(AdminRead):
    """Without `conversation_id`, the workspace's most recent turns."""

    conversation_id: str | None = Field(default=None, min_length=1, max_length=200)
    limit: int = Field(default=DEFAULT_PAGE, ge=1, le=MAX_PAGE)


class TurnError(_Wire):
    code: str | None
    message: str | None


class TurnRecord(_Wire):
    turn_id: str
    conversation_id: str
    status: Literal["running", "completed", "failed"]
    model: str | None = None
    prompt_tokens: int | None = None
    completion_tokens: int | None = None
    tokens: int | None = Field(default=None, description="total tokens of the turn")
    duration_ms: int | None = None
    error: TurnError | None = None
    started_at: datetime | None = None
    finished_at: datetime | None = None


class TurnList(_Wire):
    conversation_id: str | None
    turns: list[TurnRecord] = Field(description="most recent first")


class ExportQuery(AdminRead):
    conversation_id: str = Field(min_length=1, max_length=200)
    format: Literal["md", "json"] = "json"


class ConversationExport(_Wire):
    """The JSON export: the conversation record plus every message, oldest first."""

    conversation: ConversationSummary
    messages: list[ConversationMessage]
    exported_at: datetime


MAX_HISTORY_PAGE = 1000


class HistoryQuery(_Wire):
    id: str = Field(min_length=1, max_length=200)
    at_version: int | None = Field(default=None, ge=0)
    after_version: int = Field(default=0, ge=0, description="list the events after this one")
    limit: int = Field(default=MAX_HISTORY_PAGE, ge=1, le=MAX_HISTORY_PAGE)
    state: bool = Field(
        default=True,
        description="false: no state (null), and no fold of the stream; for the pages after "
        "the first of a listing at a fixed at_version",
    )


class HistoryEvent(_Wire):
    version: int
    type: str
    data: dict[str, Any]
    recorded_at: datetime
    cursor: str = Field(
        description="the event's point in the log: a min_cursor for the other admin reads; "
        "not a point to resume a feed from (events of transactions open at its commit sort "
        "before it)"
    )


class ConversationHistory(_Wire):
    conversation_id: str
    version: int = Field(description="newest version of the stream")
    at_version: int = Field(description="version the state was rebuilt up to")
    events: list[HistoryEvent] = Field(
        description="the events after after_version up to at_version, oldest first, at most "
        "limit of them"
    )
    next_after_version: int | None = Field(
        description="pass as after_version for the next page; null on the last"
    )
    state: dict[str, Any] | None = Field(
        description="state folded by the conversation's evolve over every event up to "
        "at_version, whatever page of them is listed; null when asked for none (state=false)"
    )


# -- api keys ---------------------------------------------------------------------------------


DIRECTION_CONTROLS = frozenset(
    "\u061c\u200e\u200f\u202a\u202b\u202c\u202d\u202e\u2066\u2067\u2068\u2069"
)
"""Marks and overrides of the text's direction: U+202E shows `key-gnp.exe` as `key-exe.png`
in any listing that prints the name."""


INVISIBLE = frozenset(
    "\u00ad\u115f\u1160\u180e\u200b\u2060\u2061\u2062\u2063\u2064\u3164\ufeff\uffa0"
)
"""Characters that show as nothing (a zero-width space, a soft hyphen, a word joiner, Hangul
fillers): `hel\u200bper` lists as `helper` beside the real one. The zero-width joiner and
non-joiner are not among them: emoji sequences and Persian and Indic scripts need them."""


def shown_text(value: str) -> str:
    """Text shown in listings, logs and terminals as the person typed it: no control
    character (a line break, a tab, ESC, the C1 set), no mark or override of the text's
    direction. (Only where clients give it: events recorded before the check still read.)"""
    if any(unicodedata.category(c) == "Cc" for c in value):
        raise ValueError("must not contain control characters (line breaks, tabs, escapes)")
    if any(c in DIRECTION_CONTROLS for c in value):
        raise ValueError(
            "must not contain marks or overrides of the text's direction (U+202E and the "
            "like): they make a listing read other than the name is"
        )
    return value


JOINERS = frozenset("\u200c\u200d")
"""The zero-width non-joiner and joiner: needed in emoji sequences and in Arabic, Persian and
Indic writing, invisible between Latin, Greek or Cyrillic letters."""


def distinct_name(value: str) -> str:
    """A name that must not read as another one: no character that shows as nothing
    (`hel\u200bper` listed as a second `helper`), and a joiner only where a script or an
    emoji sequence uses it. For names only: a display name may hold the spaces of Khmer or
    Thai text, which no one signs in with."""
    if any(c in INVISIBLE for c in value) or any(
        c in JOINERS and not _joins(value[i - 1 : i], value[i + 1 : i + 2])
        for i, c in enumerate(value)
    ):
        raise ValueError(
            "must not contain characters that show as nothing (U+200B zero-width space, a "
            "joiner between Latin letters, and the like): two names would look the same"
        )
    return value


_UNJOINED_SCRIPTS = ("LATIN", "GREEK", "CYRILLIC", "FULLWIDTH")
"""Scripts (by their characters' names) that no joiner joins: one between their letters
only hides, `Nguyễ\u200dn` beside `Nguyễn`."""


def _joins(before: str, after: str) -> bool:
    """Whether a joiner between `before` and `after` (a character each, or empty) joins what
    a script or an emoji sequence joins."""
    if not before or not after:
        return False
    if any(unicodedata.name(c, "").startswith(_UNJOINED_SCRIPTS) for c in (before, after)):
        return False
    kind = unicodedata.category(before)
    emoji = kind == "So" or before == "\ufe0f" or "\U0001f3fb" <= before <= "\U0001f3ff"
    return emoji or (ord(before) >= 0x0600 and kind[0] in "LM")


def shown_name(value: str) -> str:
    """A name a person signs in with and others see: `shown_text`, and not white space only
    (a user named three spaces signed in as such)."""
    if not value.strip():
        raise ValueError("must not be blank (white space only)")
    return distinct_name(shown_text(value))


def printable_name(value: str) -> str:
    """A name shown on one line in listings and terminals (svc apikeys list, GET /v1/models):
    `shown_text`, with no white space at either end (so none of spaces only)."""
    if value != value.strip():
        raise ValueError("must not begin or end with white space")
    return distinct_name(shown_text(value))


OneLineName = Annotated[
    str,
    # The pattern is for the OpenAPI document; `printable_name` checks it, with a message
    # that says what to change.
    Field(min_length=1, max_length=200, json_schema_extra={"pattern": r"^\S(.*\S)?$"}),
    AfterValidator(printable_name),
]
"""An API key's or an agent's name."""
ApiKeyName = OneLineName
MAX_SCOPES = 16


class ApiKeyCreate(_Wire):
    name: ApiKeyName
    scopes: list[str] = Field(min_length=1)
    rate_limit_rpm: int | None = Field(default=None, ge=1, le=MAX_RATE_LIMIT_RPM, strict=True)
    expires_at: datetime | None = None

    @field_validator("scopes")
    @classmethod
    def _scopes(cls, value: list[str]) -> list[str]:
        problem = unknown_scopes(value)
        if problem:
            raise ValueError(problem)
        # Counted once repeats are dropped: ["chat"] * 17 is one scope.
        distinct = list(dict.fromkeys(value))
        if len(distinct) > MAX_SCOPES:
            raise ValueError(f"at most {MAX_SCOPES} distinct scopes")
        return distinct

    @field_validator("expires_at")
    @classmethod
    def _expiry(cls, value: datetime | None) -> datetime | None:
        if value is None:
            return None
        if value.tzinfo is None:
            raise ValueError("must carry a UTC offset, e.g. 2027-01-01T00:00:00Z")
        # Kept in UTC and bounded: 9999-12-31T23:59:59-14:00 is past what PostgreSQL's
        # timestamptz holds, and a read model that cannot store it stops applying events.
        _in_range(value)  # compared first: converting 9999-12-31T23:59:59-14:00 overflows
        if value <= datetime.now(UTC):
            raise ValueError("must lie in the future")
        return value.astimezone(UTC)


class ApiKeyRecord(_Wire):
    """An API key as listed: never the key itself, never its hash."""

    id: str
    name: str
    prefix: str
    scopes: list[str]
    rate_limit_rpm: int | None = None
    expires_at: datetime | None = None
    created_at: datetime | None = None
    revoked_at: datetime | None = None
    user_id: str | None = Field(
        default=None,
        description="the user the key acts as (POST /v1/admin/users/{id}/apikeys); "
        "null for a workspace key",
    )


class NewApiKey(ApiKeyRecord):
    key: str = Field(description="the bearer key; shown once, never retrievable again")
    cursor: str = Field(description="log cursor of the issue; pass as min_cursor to read it")


class RevokedApiKey(_Wire):
    id: str
    revoked_at: datetime
    cursor: str = Field(description="log cursor of the revocation")


MAX_KEYS_PAGE = 1000


class KeyListQuery(AdminRead):
    """Keys in pages; the default page holds a thousand."""

    limit: int = Field(default=MAX_KEYS_PAGE, ge=1, le=MAX_KEYS_PAGE)
    offset: int = Field(default=0, ge=0, le=MAX_OFFSET)


class ApiKeyList(_Wire):
    api_keys: list[ApiKeyRecord] = Field(description="newest first")
    total: int = Field(description="keys of the workspace, revoked ones included")
    limit: int
    offset: int


# -- feeds ------------------------------------------------------------------------------------


class FeedQuery(_Wire):
    """Describes, for the OpenAPI document, the query a feed accepts; the feed parses it
    itself (gateway/feeds.py, whose FEED_PARAMETERS the tests hold to these fields).
    Where it resumes: the `Last-Event-ID` header, else `lastEventId`, else `cursor`."""

    cursor: str | None = Field(default=None, description="resume after this cursor (an SSE id)")
    last_event_id: str | None = Field(
        default=None,
        alias="lastEventId",
        description="resume after this cursor, as the Last-Event-ID header does (for "
        "EventSource polyfills, which reconnect with it); wins over cursor",
    )
    types: list[str] = Field(
        default_factory=list,
        description="event types to keep, comma-separated; the parameter may repeat "
        "(?types=a,b&types=c); at most 64 distinct; empty or absent: every type",
    )
    start: Literal["earliest", "latest"] = Field(
        default="earliest",
        description="without a cursor: the start of the workspace's log, or its current head",
    )
    cache_buster: str | None = Field(default=None, alias="_", description="a cache-buster, ignored")


class FeedEvent(_Wire):
    """The `data:` of one SSE frame on /v1/events/stream and /v1/web/stream."""

    type: str
    stream_id: str
    version: int
    data: dict[str, Any]
    recorded_at: datetime
    cursor: str


class FeedErrorBody(_Wire):
    message: str
    type: str
    code: str


class FeedClosing(_Wire):
    """The last frame of a feed the service ends (`event: feed_error` or `event: shutdown`):
    resume from `cursor` to continue without skipping or repeating anything."""

    error: FeedErrorBody
    cursor: str
