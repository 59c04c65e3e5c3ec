"""Opaque cursors over the global log.

A cursor names a point `(tx, position)` in the gap-free global order (see reads.py). Clients
see only a url-safe token; its layout is private and may change with a new prefix letter.
"""

from __future__ import annotations

import base64
import struct
from typing import NamedTuple

from eventstore.errors import InvalidCursor

_PREFIX = "c1"
_LAYOUT = struct.Struct(">QQ")
_MAX_INT8 = 2**63 - 1


class LogPoint(NamedTuple):
    tx: int
    position: int


ORIGIN = LogPoint(0, 0)


def encode_cursor(point: LogPoint) -> str:
    raw = _LAYOUT.pack(point.tx, point.position)
    return _PREFIX + base64.urlsafe_b64encode(raw).rstrip(b"=").decode("ascii")


def decode_cursor(cursor: str | None) -> LogPoint:
    """Turn a client's cursor back into a log point; `None` or "" means the start of the log."""
    if not cursor:
        return ORIGIN
    if not cursor.startswith(_PREFIX) or len(cursor) != len(_PREFIX) + 22:
        raise InvalidCursor(
            "malformed cursor: pass back a cursor exactly as the service returned it "
            "(an SSE id or a next_cursor), or omit it to start from the beginning"
        )
    body = cursor[len(_PREFIX) :] + "=="
    try:
        tx, position = _LAYOUT.unpack(base64.urlsafe_b64decode(body))
    except (ValueError, struct.error):
        raise InvalidCursor("malformed cursor: it does not decode; omit it to start over") from None
    if max(tx, position) > _MAX_INT8:  # xid8 and bigint: the log holds nothing out there
        raise InvalidCursor("malformed cursor: it points outside the log; omit it to start over")
    point = LogPoint(tx, position)
    # The decoder also takes `+` and `/` and ignores the last character's spare bits, so an
    # edited cursor could decode to some other point; only the one spelling issued stands.
    if encode_cursor(point) != cursor:
        raise InvalidCursor(
            "malformed cursor: it was not issued by the service; pass it back unchanged"
        )
    return point
