"""Server-Sent Events framing, shared by the chat stream and the event feeds.

`open_sse` prepares a `text/event-stream` response that proxies must not buffer or cache;
`send_event` writes one frame (`id:`, `event:`, one `data:` line per line of data, blank line);
`send_comment` writes a `:` comment line, used as a heartbeat. Each write is flushed to the
transport at once. A client that has gone away surfaces as a `ConnectionError` from the write
(reset, broken pipe, or aiohttp's "Connection lost" when it hangs up while a write waits to
drain), which callers treat as the end of the stream.
"""

from __future__ import annotations

from collections.abc import Mapping

from aiohttp import web

# No `Connection` header: aiohttp writes the one that is true of the connection (`close` to
# a client that asked for it, or to HTTP/1.0, whose stream ends with the connection), and
# one set here would override it.
SSE_HEADERS: Mapping[str, str] = {
    "Content-Type": "text/event-stream; charset=utf-8",
    "Cache-Control": "no-cache, no-transform",
    "X-Accel-Buffering": "no",
}


async def open_sse(
    request: web.Request, *, headers: Mapping[str, str] | None = None
) -> web.StreamResponse:
    """Start a 200 event stream; `headers` are added to the SSE ones (e.g. ids, cursors)."""
    response = web.StreamResponse(status=200, headers={**SSE_HEADERS, **(headers or {})})
    await response.prepare(request)
    return response


async def send_event(
    resp: web.StreamResponse,
    data: bytes | str,
    *,
    event: str | None = None,
    id: str | None = None,
) -> None:
    await resp.write(encode_event(data, event=event, id=id))


async def send_comment(resp: web.StreamResponse, text: str = "") -> None:
    await resp.write(b"".join(b": " + line + b"\n" for line in _lines(text.encode())) + b"\n")


def encode_event(data: bytes | str, *, event: str | None = None, id: str | None = None) -> bytes:
    payload = data.encode() if isinstance(data, str) else data
    parts: list[bytes] = []
    if id is not None:
        parts.append(b"id: " + _field(id) + b"\n")
    if event is not None:
        parts.append(b"event: " + _field(event) + b"\n")
    if b"\n" in payload or b"\r" in payload:
        parts.extend(b"data: " + line + b"\n" for line in _lines(payload))
    else:
        # The usual frame (compact JSON has no raw line break): one data line, no splitting.
        parts.append(b"data: " + payload + b"\n")
    parts.append(b"\n")
    return b"".join(parts)


def _lines(payload: bytes) -> list[bytes]:
    return payload.replace(b"\r\n", b"\n").replace(b"\r", b"\n").split(b"\n")


def _field(value: str) -> bytes:
    """`id` and `event` are single-line fields; a newline would forge another field."""
    return value.replace("\r", " ").replace("\n", " ").encode()
