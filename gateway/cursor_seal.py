"""Cursors as clients see them: sealed, so that a cursor names a point of the log without
telling anyone where that point is.

Inside the service a cursor is the store's `(tx, position)` (eventstore/cursor.py). Both are
instance-wide counters: a tenant reading them off its own feed, or off the `X-SVC-Cursor` of
each chat turn, would learn how many transactions and events every other workspace wrote in
between. So every cursor that crosses the HTTP boundary is sealed on the way out and opened
on the way in; the audit log's page cursors (event positions too) likewise.

A sealed cursor is one AES block under a 128-bit key that every process of the deployment
reads from the database (`load_cursor_seal` in gateway/bootstrap.py): a tag naming what the
cursor points into, then the two numbers, 7 bytes each. One block of a block cipher is a
keyed permutation of 16 bytes, so sealing is deterministic, as a resumable feed needs (an
event has one id for every reader, in every process), and no one without the key can tell
or choose the point inside. The tag makes a cursor edited or made up fail to open (but for
a 1 in 65,536 chance, and then it opens to a point no one can steer to), and keeps a cursor
of one kind from being taken for the other.

A rotation (`svc cursors rotate-key`, gateway/cursor_keys.py) keeps the key before it: a
cursor sealed under that one still opens, so clients holding cursors resume across it; new
cursors are sealed under the new key, and the same event then has a new id. With two keys a
cursor may open under both (the tag matches under the wrong key for 1 in 65,536 cursors):
every opening whose tag matches is a candidate, and the log's check of what it issued
(`open_issued`) picks the one it issued; a cursor made up is then taken for 2 in 65,536.
A process not yet restarted after a rotation meets cursors sealed under the new key by one
that was: it reads the keys again (`reload`, at most every RELOAD_EVERY_S) before refusing.
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import logging
import threading
import time
from collections.abc import Awaitable, Callable
from typing import Final, TypeVar

from cryptography.hazmat.primitives.ciphers import Cipher, algorithms, modes

from eventstore.cursor import ORIGIN, LogPoint, decode_cursor, encode_cursor
from eventstore.errors import InvalidCursor, StoreError
from eventstore.tailer import LogTailer

log = logging.getLogger(__name__)

KEY_BYTES = 16
_BLOCK = 16
_NUMBER_BYTES = 7
MAX_NUMBER = 2 ** (8 * _NUMBER_BYTES) - 1
"""The largest tx or position a cursor carries: 7.2e16, decades of appends at any rate."""

_LOG_TAG: Final = b"\x5c\x01"
_AUDIT_TAG: Final = b"\x5c\x02"
_LOG_PREFIX: Final = "c2"
_AUDIT_PREFIX: Final = "a2"
_PLAIN_LOG_PREFIX: Final = "c1"  # the unsealed form of earlier builds
_BODY_CHARS = 22  # 16 bytes in url-safe base64 without padding
RELOAD_EVERY_S = 5.0
"""How often at most a cursor no key opens makes the process read the keys again."""

Keys = tuple[bytes, bytes | None]
"""The current key and the one before the last rotation (None before any)."""

START_OVER = (
    "omit it to start from the beginning of your workspace's log, or use start=latest for new "
    "events only"
)
"""What a feed's client can do instead of resuming from a cursor refused; a read's
`min_cursor` has its own (gateway/admin_common.py)."""


def _not_issued(instead: str) -> str:
    return (
        "malformed cursor, or one sealed under a cursor key rotated out since: pass it back "
        f"exactly as this service returned it (an SSE id or a cursor field), or {instead}"
    )


def _old_form(instead: str) -> str:
    return (
        "this cursor is in the plain form, which the service's own tools print (svc "
        "projections status) and its API no longer takes: the API's cursors are sealed, so "
        "that they tell nothing of other workspaces; pass one the API returned (an SSE id or "
        f"a cursor field), or {instead}"
    )


_NOT_ISSUED_AUDIT = (
    "malformed cursor, or one sealed under a cursor key rotated out since: pass back a "
    "next_cursor or an entry's id exactly as this service returned it, or omit it for the "
    "newest entries"
)


class CursorSeal:
    """Seals and opens the cursors of one deployment. Thread-safe; a few microseconds a
    cursor."""

    def __init__(
        self,
        key: bytes,
        previous: bytes | None = None,
        reload: Callable[[], Awaitable[Keys]] | None = None,
    ) -> None:
        """`previous`: the key before the last rotation, whose cursors still open. `reload`:
        reads the deployment's keys as they are now."""
        self._lock = threading.Lock()  # a context's `update` is not safe across threads
        self._use((key, previous))
        self._reload = reload
        self._reloaded_at: float | None = None
        self._reading: asyncio.Future[None] | None = None

    def _use(self, keys: Keys) -> None:
        key, previous = keys
        ciphers = [_cipher(key)] + ([] if previous is None else [_cipher(previous)])
        with self._lock:
            self._keys = keys
            self._encrypt = ciphers[0].encryptor()
            self._decrypts = [cipher.decryptor() for cipher in ciphers]

    @property
    def keys(self) -> Keys:
        """The keys in use: what a caller compares `reloaded` with."""
        return self._keys

    async def reloaded(self, used: Keys | None = None) -> bool:
        """Whether the keys are now others than `used` (by default those in use now): those a
        cursor no key opened was tried with, which a rotation since may have replaced. The
        keys are read again first, at most once every RELOAD_EVERY_S; callers meanwhile
        wait for the read under way and share it, so that none is refused for a key another
        caller's read is fetching."""
        used = self._keys if used is None else used
        if self._reload is not None:
            now = time.monotonic()
            due = self._reloaded_at is None or now - self._reloaded_at >= RELOAD_EVERY_S
            if self._reading is None and due:
                self._reloaded_at = now
                self._reading = asyncio.ensure_future(self._read_keys())
            if self._reading is not None:
                await asyncio.shield(self._reading)
        return self._keys != used

    async def _read_keys(self) -> None:
        assert self._reload is not None
        try:
            keys = await self._reload()
        except StoreError as exc:  # the cursor is refused as it would be without a reload
            log.warning("could not read the cursor keys again: %s", exc.message)
            return
        finally:
            self._reading = None
        if keys != self._keys:
            self._use(keys)

    # -- the log's cursors ------------------------------------------------------------------

    def seal(self, cursor: str) -> str:
        """An internal cursor (`AppendResult.cursor`, a record's) in its public form; the
        empty cursor ("none") stays empty. The log's origin spelled as a point (the head of
        an empty workspace) is sealed like any point: a feed's frame that names it must
        carry an id, since an empty `id:` clears an EventSource's last event id."""
        return self.seal_point(decode_cursor(cursor)) if cursor else ""

    def seal_point(self, point: LogPoint) -> str:
        return _LOG_PREFIX + self._seal(_LOG_TAG, point.tx, point.position)

    def open(self, public: str) -> str:
        """A client's cursor as the internal one; "" for none. InvalidCursor (a 400) for a
        cursor this deployment did not issue. With two keys, the first of `openings`."""
        return self.openings(public)[0]

    def openings(self, public: str, instead: str = START_OVER) -> list[str]:
        """Every internal cursor `public` opens to, under the current key first. A refusal
        ends with `instead`, what the client can do without the cursor."""
        if not public:
            return [""]
        if public.startswith(_PLAIN_LOG_PREFIX):
            raise InvalidCursor(_old_form(instead))
        refusal = _not_issued(instead)
        points = (LogPoint(*pair) for pair in self._open(_LOG_PREFIX, _LOG_TAG, public, refusal))
        return ["" if point == ORIGIN else encode_cursor(point) for point in points]

    # -- the audit log's page cursors -------------------------------------------------------

    def seal_audit(self, position: int) -> str:
        return _AUDIT_PREFIX + self._seal(_AUDIT_TAG, 0, position)

    def open_audit(self, public: str) -> int:
        pairs = self._open(_AUDIT_PREFIX, _AUDIT_TAG, public, _NOT_ISSUED_AUDIT)
        positions = [position for zero, position in pairs if zero == 0]
        if not positions:
            raise InvalidCursor(_NOT_ISSUED_AUDIT)
        return positions[0]

    # -- the block --------------------------------------------------------------------------

    def _seal(self, tag: bytes, first: int, second: int) -> str:
        if not (0 <= first <= MAX_NUMBER and 0 <= second <= MAX_NUMBER):
            raise ValueError(f"cursor numbers run from 0 to {MAX_NUMBER}")
        block = tag + first.to_bytes(_NUMBER_BYTES, "big") + second.to_bytes(_NUMBER_BYTES, "big")
        with self._lock:
            sealed = self._encrypt.update(block)
        return _spelling(sealed)

    def _open(self, prefix: str, tag: bytes, public: str, refusal: str) -> list[tuple[int, int]]:
        body = public[len(prefix) :]
        if not public.startswith(prefix) or len(body) != _BODY_CHARS:
            raise InvalidCursor(refusal)
        try:
            sealed = base64.urlsafe_b64decode(body + "==")
        except (binascii.Error, ValueError):
            raise InvalidCursor(refusal) from None
        # The decoder also takes `+` and `/` and ignores the last character's spare bits: only
        # the one spelling the service issues stands, so a cursor is also a stable key.
        if len(sealed) != _BLOCK or _spelling(sealed) != body:
            raise InvalidCursor(refusal)
        with self._lock:
            blocks = [decrypt.update(sealed) for decrypt in self._decrypts]
        # The current key first; the tag tells whose a cursor is (but for 1 in 65,536).
        pairs = [
            (
                int.from_bytes(block[2 : 2 + _NUMBER_BYTES], "big"),
                int.from_bytes(block[2 + _NUMBER_BYTES :], "big"),
            )
            for block in blocks
            if block[:2] == tag
        ]
        if not pairs:
            raise InvalidCursor(refusal)
        return pairs


def _cipher(key: bytes) -> Cipher[modes.ECB]:
    if len(key) != KEY_BYTES:
        raise ValueError(f"a cursor key is {KEY_BYTES} bytes")
    # ECB over a single block is the block cipher itself: the permutation wanted here, not a
    # mode for messages (there is never a second block to leak patterns across).
    return Cipher(algorithms.AES(key), modes.ECB())


async def open_issued(
    cursors: CursorSeal, tailer: LogTailer, public: str, source: str, instead: str = START_OVER
) -> str:
    """A client's log cursor as the internal one, refused (InvalidCursor, its message led by
    `source`, the input it came in, and ending with `instead`, what to do without it) unless
    this deployment sealed it and its log issued it: waiting for the events after a point
    never issued would never end."""
    try:
        return await _opened(cursors, lambda: _issued(cursors, tailer, public, instead))
    except InvalidCursor as exc:
        raise InvalidCursor(f"{source}: {exc.message}") from None


async def open_audit_issued(cursors: CursorSeal, public: str) -> int:
    """An audit page cursor's position, read as `open_issued` reads a log cursor: sealed
    under a key this process has not read yet (another gateway, restarted after a rotation,
    issued it), it opens once the keys are read again."""

    async def audit() -> int:
        return cursors.open_audit(public)

    return await _opened(cursors, audit)


_T = TypeVar("_T")


async def _opened(cursors: CursorSeal, opening: Callable[[], Awaitable[_T]]) -> _T:
    """`opening()`, tried again once the keys are read again when it refused the cursor
    and the keys turn out others than those it tried (a rotation this process had not
    read); the first refusal stands otherwise."""
    used = cursors.keys
    try:
        return await opening()
    except InvalidCursor as refused:
        try:
            if await cursors.reloaded(used):
                return await opening()
        except InvalidCursor:
            pass
        raise refused from None


async def _issued(cursors: CursorSeal, tailer: LogTailer, public: str, instead: str) -> str:
    """The opening of `public` the log issued; InvalidCursor, the first's refusal, if none."""
    refusal: InvalidCursor | None = None
    for cursor in cursors.openings(public, instead):
        try:
            await tailer.issued_cursor(cursor)
        except InvalidCursor as exc:
            refusal = refusal or exc
            continue
        return cursor
    assert refusal is not None  # openings() gives at least one, or raises
    raise refusal


def _spelling(sealed: bytes) -> str:
    return base64.urlsafe_b64encode(sealed).rstrip(b"=").decode("ascii")
