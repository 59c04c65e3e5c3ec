"""What the SSE feeds send: an event's frame (redacted, serialised once per process) and the
final frame that closes a feed with its cursor.

A frame is `id: <cursor>`, `event: <type>`, `data: <FeedEvent JSON>` (gateway/sse.py framing).
Fields named like secrets are redacted at any depth before anything is serialised. Cursors
go out sealed (gateway/cursor_seal.py): the callers here are handed the public form.
"""

from __future__ import annotations

import re
from collections import OrderedDict
from collections.abc import Mapping
from typing import Any

import orjson
from pydantic import BaseModel

from eventstore.records import RecordedEvent
from gateway.cursor_seal import CursorSeal
from gateway.errors import error_body
from gateway.sse import encode_event
from schemas.errors import SvcError
from schemas.events import EVENTS
from schemas.redaction import REDACTED

_SECRET_WORDS = frozenset({"hash", "secret", "token", "password", "passwd", "credential"})
# Words: split at separators, at a lower-to-upper step (clientSecret) and before the last
# capital of an acronym that runs into a word (APIToken -> API, Token).
_WORD_SPLIT = re.compile(r"[_\-.\s]+|(?<=[a-z0-9])(?=[A-Z])|(?<=[A-Z])(?=[A-Z][a-z])")


def is_secret_field(name: str) -> bool:
    """True for a field named like a secret: a word of its name is, or ends in, hash,
    secret, token, password (key_hash, push_token, clientSecret, APIToken, and BOTTOKEN or
    dbpassword, whose words run together). A compound ends in its head noun, so counters
    such as `prompt_tokens` and names such as `tokenizer` stay; and a name that ends in `id`
    names an identifier (`token_id`, which the audit log shows), not the secret itself."""
    words = [word.lower() for word in _WORD_SPLIT.split(name) if word]
    if words and words[-1] in ("id", "ids"):
        return False
    return any(_ends_in_secret_word(word) for word in words)


def _ends_in_secret_word(word: str) -> bool:
    return any(word.endswith(secret) for secret in _SECRET_WORDS)


def _holds_no_secret(value: Any) -> bool:
    """A flag or an absent value, under a secret's name (`workspace.setting_changed`'s
    `secret: true`): shown as it is, for it holds nothing to hide."""
    return value is None or isinstance(value, bool)


def redact(value: Any) -> Any:
    if isinstance(value, dict):
        return {
            key: REDACTED
            if is_secret_field(str(key)) and not _holds_no_secret(item)
            else redact(item)
            for key, item in value.items()
        }
    if isinstance(value, list):
        return [redact(item) for item in value]
    return value


def redact_model(model: BaseModel) -> dict[str, Any]:
    """`model` as JSON with its secret-named fields redacted, at any depth. Only the names of
    fields are judged: the keys of a mapping field are data (ids, a client's idempotency
    keys), and a key such as `reset-password-1` is not a secret field."""
    redacted: dict[str, Any] = _redact_like(model, model.model_dump(mode="json"))
    return redacted


def _redact_like(instance: Any, dumped: Any) -> Any:
    if isinstance(instance, BaseModel):
        return {
            name: REDACTED
            if is_secret_field(name) and not _holds_no_secret(item)
            else _redact_like(getattr(instance, name, None), item)
            for name, item in dumped.items()
        }
    if isinstance(instance, Mapping):
        return {
            key: _redact_like(original, item)
            for original, (key, item) in zip(instance.values(), dumped.items(), strict=True)
        }
    if isinstance(instance, list | tuple):
        return [
            _redact_like(original, item) for original, item in zip(instance, dumped, strict=True)
        ]
    return dumped


def _current_data(record: RecordedEvent) -> dict[str, Any]:
    """The event's data at its current schema version (upcast), when the type is known."""
    try:
        return EVENTS.upcast(record.type, record.schema_version, record.data)
    except SvcError:
        return record.data


def frame_payload(record: RecordedEvent, cursor: str) -> dict[str, Any]:
    """The FeedEvent of `record`, whose public cursor is `cursor`."""
    return {
        "type": record.type,
        "stream_id": record.stream_id,
        "version": record.version,
        "data": redact(_current_data(record)),
        "recorded_at": record.recorded_at.isoformat(),
        "cursor": cursor,
    }


def closing_payload(cursor: str, message: str, error_type: str, code: str) -> str:
    body = {**error_body(message, error_type, code), "cursor": cursor}
    return orjson.dumps(body).decode()


FEED_ERROR_EVENT = "feed_error"
"""The event name of a final frame that ends a feed on an error. Not `error`: an
`EventSource` fires its own `error` event when the connection drops, and a handler that
closes on `error` would never resume from the frame's cursor. Like `cursor`, it has no dot,
so no event type of the log can take it."""
CURSOR_EVENT = "cursor"


def opening_frame(retry_ms: int, cursor: str) -> bytes:
    """The first frame: the reconnection delay, and where the feed starts as its id and its
    data (`{"cursor": ...}`). It carries data because a parser that dispatches only frames
    with data (npm `eventsource`) ignores a bare `id:`, and its EventSource, reconnecting
    before the first event the feed selects, would start a `start=latest` feed again at the
    new head, skipping what was committed between."""
    frame = encode_event(orjson.dumps({"cursor": cursor}), event=CURSOR_EVENT, id=cursor)
    return b"retry: %d\n" % max(0, retry_ms) + frame


def closing_frame(event: str, cursor: str, error: SvcError) -> bytes:
    """The last frame of a feed (`event: feed_error` or `event: shutdown`), carrying the
    public cursor to resume from as its `id` and in its body."""
    data = closing_payload(cursor, error.message, error.error_type, error.code)
    return encode_event(data, event=event, id=cursor or None)


# A comment line and no blank line after it: a blank line dispatches, and a parser that keeps
# the last id (httpx-sse, the openai SDK's) hands its consumer an empty event for each
# heartbeat. The comment joins the next frame, whose parsers skip it.
HEARTBEAT_FRAME = b": heartbeat\n"


class FrameCache:
    """Encoded SSE frame per log position, shared by every connection of the process: an
    event fanned out to a thousand feeds is redacted and serialised once. Bounded by count
    and by bytes (an assistant message may be large)."""

    def __init__(
        self, cursors: CursorSeal, size: int = 4096, max_bytes: int = 32 * 1024 * 1024
    ) -> None:
        self._cursors = cursors
        self._size = size
        self._max_bytes = max_bytes
        self._bytes = 0
        self._frames: OrderedDict[int, bytes] = OrderedDict()

    def frame(self, record: RecordedEvent) -> bytes:
        frame = self._frames.get(record.position)
        if frame is None:
            cursor = self._cursors.seal_point(record.point)
            data = orjson.dumps(frame_payload(record, cursor))
            frame = encode_event(data, event=record.type, id=cursor)
            self._frames[record.position] = frame
            self._bytes += len(frame)
            while len(self._frames) > self._size or self._bytes > self._max_bytes:
                self._bytes -= len(self._frames.popitem(last=False)[1])
        return frame
