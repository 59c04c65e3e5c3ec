"""The SSE feeds over real HTTP on loopback: framing, resume without skips or repeats, type
filters, cursor validation, workspace isolation, redaction, slow consumers and shutdown."""

from __future__ import annotations

import asyncio
import logging
import os
import socket
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, cast

import aiohttp
import orjson
import pytest
from platform_support import access_logged
from test_admin_support import (
    Frame,
    Service,
    SseReader,
    open_feed,
    service,
    start_service,
    uid,
)
from yarl import URL

from eventstore.cursor import LogPoint, encode_cursor
from eventstore.errors import StoreError, StoreUnavailable
from eventstore.records import NewEvent, RecordedEvent
from gateway import feed_fanout, feeds
from gateway.feed_frames import redact_model
from gateway.metrics import HTTP_ERRORS
from gateway.state import DATABASE, STORE, TAILER
from schemas.workspace import WorkspaceSettingChanged

__all__ = ["service"]

# Closing the store's LISTEN connection warns (asyncpg InterfaceWarning); under the suite's
# warnings-as-errors that warning aborts the platform's shutdown and the server never closes.
pytestmark = pytest.mark.filterwarnings("ignore::asyncpg.InterfaceWarning")

EVENTS = "/v1/events/stream"
WEB = "/v1/web/stream"


async def workspace_log(
    svc: Service, workspace_id: str, types: list[str] | None = None
) -> list[RecordedEvent]:
    """The workspace's events, every one it has committed. A read of the log is gap-free
    (ARCHITECTURE.md decision 3): it stops short of any transaction still open that began
    before the newest events committed (the service's own projection batches, under load),
    so a read at once after an append may leave them out, and a test would expect too few
    frames. So this waits until a gap-free reader (the projections) has passed the newest."""
    async with svc.app[DATABASE].acquire() as conn:
        newest = await conn.fetchrow(
            "SELECT tx::text AS tx, position FROM events WHERE workspace_id = $1 "
            "ORDER BY tx DESC, position DESC LIMIT 1",
            workspace_id,
        )
    if newest is not None:
        await svc.settle(encode_cursor(LogPoint(int(newest["tx"]), newest["position"])))
    return await svc.app[STORE].read_all(None, 10_000, workspace_id=workspace_id, types=types)


async def log_cursors(svc: Service, workspace_id: str, types: list[str] | None = None) -> list[str]:
    """The sealed cursors of the workspace's events, as its feed must give them."""
    return [svc.sealed(r.cursor) for r in await workspace_log(svc, workspace_id, types)]


def ids(frames: list[Frame]) -> list[str]:
    out = []
    for frame in frames:
        assert frame.id is not None
        assert frame.json()["cursor"] == frame.id
        out.append(frame.id)
    return out


async def test_frames_carry_cursor_type_and_payload(service: Service) -> None:
    ws = uid("ws-")
    key = await service.issue_key(ws)
    await service.append_pings(ws, 3)
    expected = await log_cursors(service, ws)
    resp, reader = await open_feed(service, EVENTS, key)
    first = await reader.frame()
    assert first is not None and first.retry == 3000
    frames = await reader.events(len(expected))
    resp.close()
    assert ids(frames) == expected
    ping = frames[-1]
    assert ping.event == "test.ping"
    body = ping.json()
    assert set(body) == {"type", "stream_id", "version", "data", "recorded_at", "cursor"}
    assert body["type"] == "test.ping" and body["version"] == 3
    assert body["stream_id"].startswith("test:") and body["data"]["n"] == 2


@pytest.mark.parametrize(
    ("request_line", "connection"),
    [("HTTP/1.1\r\nConnection: close", "close"), ("HTTP/1.0", None)],
)
async def test_a_feed_says_the_connection_closes_when_it_will(
    service: Service, request_line: str, connection: str | None
) -> None:
    """The feed said `Connection: keep-alive` whatever the client asked, to HTTP/1.0 too
    (whose stream ends with the connection): a pooling proxy then reused a connection the
    server was closing."""
    key = await service.issue_key(uid("ws-"))
    url = URL(service.url(EVENTS))
    reader, writer = await asyncio.open_connection(url.host, url.port)
    try:
        writer.write(
            f"GET {EVENTS} {request_line}\r\nHost: x\r\n"
            f"Authorization: Bearer {key}\r\n\r\n".encode()
        )
        head = (await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 30)).decode().lower()
    finally:
        writer.close()
    assert head.startswith(("http/1.1 200", "http/1.0 200")), head
    assert "connection: keep-alive" not in head, head
    if connection is not None:
        assert f"connection: {connection}" in head, head


@pytest.mark.parametrize("how", ["last_event_id", "cursor"])
async def test_resume_never_skips_or_repeats(service: Service, how: str) -> None:
    ws = uid("ws-")
    key = await service.issue_key(ws)
    await service.append_pings(ws, 30)
    resp, reader = await open_feed(service, EVENTS, key)
    seen = ids(await reader.events(12))
    resp.close()

    await service.append_pings(ws, 20)
    expected = await log_cursors(service, ws)
    if how == "last_event_id":
        resp, reader = await open_feed(service, EVENTS, key, last_event_id=seen[-1])
    else:
        resp, reader = await open_feed(service, EVENTS, key, cursor=seen[-1])
    seen += ids(await reader.events(len(expected) - len(seen)))
    assert seen == expected

    # Live: the next frame is the next event, not a repeat.
    sentinel = await service.append_pings(ws, 1, kind="test.sentinel")
    (frame,) = await reader.events(1)
    resp.close()
    assert frame.event == "test.sentinel" and frame.id == sentinel


async def test_a_polyfills_last_event_id_parameter_resumes_like_the_header(
    service: Service,
) -> None:
    ws = uid("ws-")
    key = await service.issue_key(ws)
    first = await service.append_pings(ws, 1)
    second = await service.append_pings(ws, 1)
    resp = await service.http.get(
        service.url(f"{EVENTS}?lastEventId={first}&_=123"), headers=service.auth(key)
    )
    reader = SseReader(resp)
    while True:
        frame = await reader.frame()
        assert frame is not None
        if frame.event == "test.ping":
            break
    resp.close()
    assert frame.id == second  # resumed after the first
    # A blank one is absent: it does not win over ?cursor= (and start at the log's origin).
    resp, reader = await open_feed(service, EVENTS, key, cursor=first, lastEventId=" ")
    (frame,) = await reader.events(1)
    resp.close()
    assert frame.id == second


async def test_last_event_id_wins_over_cursor_parameter(service: Service) -> None:
    ws = uid("ws-")
    key = await service.issue_key(ws)
    await service.append_pings(ws, 5)
    expected = await log_cursors(service, ws)
    resp, reader = await open_feed(
        service, EVENTS, key, last_event_id=expected[-2], cursor=expected[0]
    )
    (frame,) = await reader.events(1)
    resp.close()
    assert frame.id == expected[-1]


async def test_types_filter(service: Service) -> None:
    ws = uid("ws-")
    key = await service.issue_key(ws)
    for _ in range(3):
        await service.append_pings(ws, 2, kind="test.a")
        await service.append_pings(ws, 2, kind="test.b")
        await service.append_pings(ws, 2, kind="test.c")
    expected = await log_cursors(service, ws, ["test.a", "test.c"])
    resp, reader = await open_feed(service, EVENTS, key, types="test.a,test.c")
    frames = await reader.events(len(expected))
    assert ids(frames) == expected
    assert {f.event for f in frames} == {"test.a", "test.c"}
    # Resuming a filtered feed from its last id is exact too.
    resp.close()
    await service.append_pings(ws, 1, kind="test.b")
    last = await service.append_pings(ws, 1, kind="test.c")
    resp, reader = await open_feed(
        service, EVENTS, key, types="test.a,test.c", cursor=frames[-1].id or ""
    )
    (frame,) = await reader.events(1)
    resp.close()
    assert frame.id == last


@pytest.mark.parametrize("path", [EVENTS, WEB])
@pytest.mark.parametrize(
    ("where", "value"),
    [
        ("header", "nonsense"),
        ("query", "c1AAAA"),
        ("query", "c1" + "_" * 22),  # the plain form of earlier builds
        ("query", "c1__________________8"),
        ("query", "c2AAAA"),
        ("header", "c2" + "!" * 22),
        # Sealed-shaped, and refused by its spelling whatever the key: the last character's
        # spare bits are set (the tag check would let 1 in 65,536 canonical bodies through).
        ("query", "c2" + "A" * 21 + "B"),
        ("query", "c2" + "A" * 23),
    ],
)
async def test_malformed_cursor_is_a_400_before_the_stream(
    service: Service, path: str, where: str, value: str
) -> None:
    key = await service.issue_key(uid("ws-"))
    headers = service.auth(key)
    params = {}
    if where == "header":
        headers["Last-Event-ID"] = value
    else:
        params["cursor"] = value
    resp = await service.http.get(service.url(path), headers=headers, params=params)
    assert resp.status == 400
    assert resp.headers["Content-Type"].startswith("application/json")
    body = await resp.json()
    assert body["error"]["code"] == "invalid_cursor"
    assert body["error"]["type"] == "invalid_request_error"


async def test_bad_types_and_start_are_400(service: Service) -> None:
    key = await service.issue_key(uid("ws-"))
    for params in ({"types": "a b"}, {"start": "yesterday"}, {"types": ",,"}, {"types": " , "}):
        resp = await service.http.get(service.url(EVENTS), headers=service.auth(key), params=params)
        assert resp.status == 400, params
        assert (await resp.json())["error"]["type"] == "invalid_request_error"


async def test_a_type_named_many_times_counts_once(service: Service) -> None:
    key = await service.issue_key(uid("ws-"))
    params = [("types", "workspace.created")] * 65
    resp = await service.http.get(service.url(EVENTS), headers=service.auth(key), params=params)
    assert resp.status == 200
    resp.close()


async def test_a_misspelt_or_repeated_parameter_is_a_400_not_the_whole_log(
    service: Service,
) -> None:
    key = await service.issue_key(uid("ws-"))
    for query, said in (
        ("type=conversation.turn_failed", "unknown query parameter 'type'"),
        ("cursor=&cursor=", "cursor is given more than once"),
        ("start=latest&start=earliest", "start is given more than once"),
    ):
        resp = await service.http.get(service.url(f"{EVENTS}?{query}"), headers=service.auth(key))
        assert resp.status == 400, query
        assert said in (await resp.json())["error"]["message"], query
    # `types` may repeat, an empty `start` is no start (as empty values are elsewhere), and
    # an EventSource polyfill's `lastEventId` and a cache-buster `_` are taken.
    for query in ("types=a.b&types=c.d", "start=", "lastEventId=&_=1700000000"):
        resp = await service.http.get(service.url(f"{EVENTS}?{query}"), headers=service.auth(key))
        assert resp.status == 200, query
        resp.close()


async def test_the_openapi_document_names_every_parameter_a_feed_takes(
    service: Service,
) -> None:
    """A client generated from /openapi.json could not resume as a polyfill does, nor send a
    cache-buster, and took `types` for one value: the document lists what the feed reads."""
    async with service.http.get(service.url("/openapi.json")) as resp:
        doc = await resp.json()
    for path in (EVENTS, WEB):
        params = doc["paths"][path]["get"]["parameters"]
        query = {p["name"]: p for p in params if p["in"] == "query"}
        assert set(query) == set(feeds.FEED_PARAMETERS), path
        types = query["types"]
        assert types["schema"]["type"] == "array" and types["explode"] is True
        assert "comma-separated" in types["description"]
        assert f"at most {feeds.MAX_TYPES} distinct" in types["description"]
        assert "Last-Event-ID" in query["lastEventId"]["description"]
        assert "ignored" in query["_"]["description"]
        assert not any(p["required"] for p in query.values())
        assert {p["name"] for p in params if p["in"] == "header"} == {"Last-Event-ID"}


@pytest.mark.parametrize("path", [EVENTS, WEB])
async def test_feeds_need_a_valid_key(service: Service, path: str) -> None:
    resp = await service.http.get(service.url(path))
    assert resp.status == 401
    resp = await service.http.get(service.url(path), headers=service.auth("svc_nope"))
    assert resp.status == 401
    assert (await resp.json())["error"]["code"] == "unauthorized"


@pytest.mark.parametrize("path", [EVENTS, WEB])
async def test_head_on_a_feed_is_405_without_a_body(service: Service, path: str) -> None:
    """A feed is all body; after HEAD a body would be read as the next response."""
    key = await service.issue_key(uid("ws-"))
    await service.append_pings(uid("ws-"), 1)
    resp = await service.http.head(service.url(path), headers=service.auth(key))
    assert resp.status == 405 and resp.headers["Allow"] == "GET"
    assert await resp.read() == b""


async def test_start_latest_skips_history(service: Service) -> None:
    ws = uid("ws-")
    key = await service.issue_key(ws)
    await service.append_pings(ws, 5)
    resp, reader = await open_feed(service, EVENTS, key, start="latest")
    await reader.frame()
    last = await service.append_pings(ws, 1, kind="test.live")
    (frame,) = await reader.events(1)
    resp.close()
    assert frame.id == last and frame.event == "test.live"


async def test_the_first_frame_names_where_the_feed_starts(service: Service) -> None:
    """An EventSource that reconnects before the first event its filter selects sends the
    first frame's id back: a `start=latest` feed resumes where it began, and skips nothing
    committed while it was away, instead of starting again at the new head."""
    ws = uid("ws-")
    key = await service.issue_key(ws)
    await service.append_pings(ws, 3)
    resp, reader = await open_feed(service, EVENTS, key, start="latest", types="test.rare")
    first = await reader.frame()
    resp.close()
    assert first is not None and first.retry == 3000 and first.id and first.event == "cursor"
    assert first.json() == {"cursor": first.id}  # data, or npm's EventSource ignores the id
    missed = await service.append_pings(ws, 1, kind="test.rare")
    await service.append_pings(ws, 2)
    resp, reader = await open_feed(
        service, EVENTS, key, last_event_id=first.id, start="latest", types="test.rare"
    )
    again = await reader.frame()
    (frame,) = await reader.events(1)
    resp.close()
    assert again is not None and again.id == first.id
    assert (frame.id, frame.event) == (missed, "test.rare")
    # From the start of the log, the first frame names the origin: resuming there is
    # reading the log from its start.
    resp, reader = await open_feed(service, EVENTS, key)
    first = await reader.frame()
    resp.close()
    assert first is not None and first.retry == 3000 and first.event == "cursor" and first.id
    expected = await log_cursors(service, ws)
    resp, reader = await open_feed(service, EVENTS, key, last_event_id=first.id)
    frames = await reader.events(len(expected))
    resp.close()
    assert ids(frames) == expected


async def test_a_latest_feed_of_a_workspace_with_no_event_yet_names_its_start(
    service: Service, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The head of a workspace with no event visible yet is the log's origin: its first
    frame went out with an empty id, which clears an EventSource's last event id, so the
    reconnection started again at the new head and skipped what was committed between."""
    ws = uid("ws-")
    key = await service.issue_key(ws)
    store = service.app[STORE]

    async def no_event_yet(workspace_id: str | None = None) -> str:
        return ""

    monkeypatch.setattr(store, "head", no_event_yet)
    resp, reader = await open_feed(service, EVENTS, key, start="latest", types="test.rare")
    first = await reader.frame()
    resp.close()
    monkeypatch.undo()
    assert first is not None and first.retry == 3000 and first.id, first
    missed = await service.append_pings(ws, 1, kind="test.rare")
    resp, reader = await open_feed(
        service, EVENTS, key, last_event_id=first.id, start="latest", types="test.rare"
    )
    await reader.frame()
    (frame,) = await reader.events(1)
    resp.close()
    assert (frame.id, frame.event) == (missed, "test.rare")


async def test_web_stream_carries_conversation_events_only(service: Service) -> None:
    ws = uid("ws-")
    key = await service.issue_key(ws)
    await service.append_pings(ws, 3)
    cid = await service.start_conversation(ws, "first")
    await service.rename(ws, cid, "second")
    expected = [
        service.sealed(r.cursor)
        for r in await workspace_log(service, ws)
        if r.stream_id.startswith("conversation:")
    ]
    resp, reader = await open_feed(service, WEB, key)
    frames = await reader.events(len(expected))
    resp.close()
    assert ids(frames) == expected
    assert [f.event for f in frames] == ["conversation.started", "conversation.renamed"]
    assert all(f.json()["stream_id"] == f"conversation:{cid}" for f in frames)


async def test_workspace_isolation_on_both_feeds(service: Service) -> None:
    a, b = uid("ws-a-"), uid("ws-b-")
    key_a = await service.issue_key(a)
    await service.issue_key(b)
    cid_b = await service.start_conversation(b, "secret plans of b")
    await service.append_pings(b, 5)
    await service.start_conversation(a, "a's chat")
    sentinel = await service.append_pings(a, 1, kind="test.sentinel")
    expected = await log_cursors(service, a)
    for path in (EVENTS, WEB):
        resp, reader = await open_feed(service, path, key_a)
        frames: list[Frame] = []
        while not frames or frames[-1].id != sentinel:
            frame = await reader.frame()
            if frame is None:
                break
            if frame.is_event:
                frames.append(frame)
            if path == WEB and frames and frames[-1].event == "conversation.started":
                break
        resp.close()
        assert frames
        for frame in frames:
            assert b not in frame.data and cid_b not in frame.data
            assert frame.id in expected


async def test_secret_fields_are_redacted(service: Service) -> None:
    ws = uid("ws-")
    key = await service.issue_key(ws)
    await service.app[STORE].append(
        uid("test:"),
        [
            feeds_event(
                {
                    "push_token": "tok",
                    "nested": {"clientSecret": "s", "password": "p", "prompt_tokens": 7},
                    # A flag or an absent value under a secret's name holds no secret.
                    "secret": True,
                    "refresh_token": None,
                }
            )
        ],
        expected_version=0,
        command_id=uid("cmd-"),
        workspace_id=ws,
    )
    resp, reader = await open_feed(service, EVENTS, key)
    frames = []
    while not frames or frames[-1].event != "test.secrets":
        frames += await reader.events(1)
    resp.close()
    issued = [f for f in frames if f.event == "workspace.api_key_issued"]
    assert issued and all(f.json()["data"]["key_hash"] == feeds.REDACTED for f in issued)
    data = frames[-1].json()["data"]
    assert data["push_token"] == feeds.REDACTED
    assert data["secret"] is True and data["refresh_token"] is None
    assert data["nested"] == {
        "clientSecret": feeds.REDACTED,
        "password": feeds.REDACTED,
        "prompt_tokens": 7,
    }


def test_a_models_flags_under_secret_names_are_shown() -> None:
    """The history's state and events go through `redact_model`: the setting's `secret`
    flag shows as it is, a secret-named text field does not."""
    at = datetime(2026, 11, 27, tzinfo=UTC)
    marker = WorkspaceSettingChanged(
        workspace_id="ws-1", key="SVC_NATIVE_API_KEY", value=None, secret=True, at=at
    )
    assert redact_model(marker)["secret"] is True
    plain = WorkspaceSettingChanged(
        workspace_id="ws-1", key="SVC_LLM_MODEL", value="m", secret=False, at=at
    )
    assert redact_model(plain)["secret"] is False and redact_model(plain)["value"] == "m"


def feeds_event(data: dict[str, Any]) -> NewEvent:
    return NewEvent("test.secrets", data)


def test_secret_field_names() -> None:
    for name in (
        *("key_hash", "push_token", "clientSecret", "password", "api-token", "hash"),
        *("APIToken", "JWTSecret", "DBPassword", "OAuthToken"),
        *("BOTTOKEN", "SLACK_BOTTOKEN", "dbpassword", "x-refreshtoken", "ClientCredential"),
    ):
        assert feeds.is_secret_field(name), name
    for name in (
        *("prompt_tokens", "total_tokens", "hashtag", "title", "tokenizer", "HTTPSProxy"),
        *("MAX_TOKENS", "TOKENIZER", "secretary"),
        # Identifiers of secrets, shown by the audit log too (QA finding).
        *("token_id", "old_token_id", "secretId"),
    ):
        assert not feeds.is_secret_field(name), name


async def test_slow_consumer_is_cut_off_with_its_cursor(
    service: Service, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A small unsent-bytes bound (above a round of the batches appended here, below what a
    # blocked socket leaves waiting) so that a few thousand events overflow it.
    hub = service.app[feeds.FEED_HUB]
    monkeypatch.setattr(hub, "max_buffer_bytes", 256 * 1024)
    monkeypatch.setattr(hub, "write_timeout_s", 120.0)
    ws = uid("ws-")
    key = await service.issue_key(ws)
    head = service.sealed(await service.app[STORE].head())
    slow, slow_reader = await open_feed(service, EVENTS, key, cursor=head)
    fast, fast_reader = await open_feed(service, EVENTS, key, cursor=head)
    assert (await slow_reader.frame()) is not None  # retry frame; then stop reading
    await fast_reader.frame()

    fast_frames: list[Frame] = []
    total = 0
    for _ in range(150):
        await service.append_pings(ws, 20, size=8000)
        total += 20
        fast_frames += await fast_reader.events(20)
    assert len(fast_frames) == total

    # Now the slow client reads: what it got is a prefix of the log, then the final frame.
    received: list[Frame] = []
    while True:
        frame = await slow_reader.frame()
        assert frame is not None, "the feed ended without its final frame"
        if frame.event == "feed_error":
            break
        if frame.is_event:
            received.append(frame)
    body = frame.json()
    assert body["error"]["code"] == "subscriber_too_slow"
    assert len(received) < total
    expected = ids(fast_frames)
    assert ids(received) == expected[: len(received)]
    cut = body["cursor"]
    assert frame.id == cut and cut == (received[-1].id if received else head)
    assert await slow_reader.frame() is None
    slow.close()

    # Resuming from the final frame's cursor continues exactly where it stopped.
    resp, reader = await open_feed(service, EVENTS, key, last_event_id=cut)
    rest = ids(await reader.events(total - len(received)))
    resp.close()
    fast.close()
    assert ids(received) + rest == expected


async def _final_frame(reader: Any) -> tuple[list[Frame], Frame]:
    """Every event frame up to the feed's final `error` frame, and that frame; the stream
    must then end cleanly."""
    received: list[Frame] = []
    while True:
        frame = await reader.frame()
        assert frame is not None, "the feed ended without its final frame"
        if frame.event == "feed_error":
            assert await reader.frame() is None
            return received, frame
        if frame.is_event:
            received.append(frame)


@pytest.mark.parametrize(
    ("failure", "code"),
    [
        (StoreUnavailable("the database went away"), "store_unavailable"),
        (StoreError("event store query failed (XX000 InternalError: detail)"), "internal_error"),
    ],
)
async def test_a_failed_history_read_ends_the_feed_with_a_frame(
    service: Service, monkeypatch: pytest.MonkeyPatch, failure: StoreError, code: str
) -> None:
    """The database failing under a feed that is catching up: the 200 and its headers are
    long sent, so the failure is the feed's final frame with its cursor, not a second HTTP
    response written into the event stream."""
    ws = uid("ws-")
    key = await service.issue_key(ws)
    await service.append_pings(ws, 300)
    tailer = service.app[TAILER]
    real_page = tailer.history_page
    pages: list[int] = []

    async def failing_page(*args: Any) -> tuple[list[RecordedEvent], bool]:
        pages.append(1)
        if len(pages) == 2:  # after a first page written
            raise failure
        return await real_page(*args)

    monkeypatch.setattr(tailer, "history_page", failing_page)
    resp, reader = await open_feed(service, EVENTS, key)
    received, final = await _final_frame(reader)
    resp.close()
    body = final.json()
    assert body["error"]["code"] == code
    assert "detail" not in body["error"]["message"]  # a 500's detail stays in the log
    first_page = feed_fanout.CATCH_UP_FIRST_PAGE
    assert len(received) == first_page and body["cursor"] == received[-1].id == final.id


async def test_catch_up_pages_are_sized_by_the_bytes_they_write(
    service: Service, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Large events make small pages (a page of a thousand one-megabyte messages held a
    gigabyte per feed catching up), and the feed is still exact."""
    monkeypatch.setattr(feed_fanout, "CATCH_UP_PAGE_BYTES", 1_000_000)
    ws = uid("ws-")
    key = await service.issue_key(ws)
    await service.append_pings(ws, 150, size=100_000)
    tailer = service.app[TAILER]
    real_page = tailer.history_page
    limits: list[int] = []

    async def recording_page(*args: Any) -> tuple[list[RecordedEvent], bool]:
        limits.append(args[3])
        return await real_page(*args)

    monkeypatch.setattr(tailer, "history_page", recording_page)
    resp, reader = await open_feed(service, EVENTS, key)
    numbers = await ping_numbers(reader, 150)
    resp.close()
    assert numbers == list(range(150))
    assert limits[0] == feed_fanout.CATCH_UP_FIRST_PAGE
    assert limits[1:] and all(8 <= limit <= 10 for limit in limits[1:]), limits


async def test_large_events_after_small_ones_are_cut_from_a_page_by_their_size(
    service: Service, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Pages are sized by the events met so far: after small ones, a page grew to hundreds
    of events, and a run of large ones filled all of it (hundreds of megabytes per feed).
    The read also cuts a page by the events' stored size."""
    monkeypatch.setattr(feed_fanout, "CATCH_UP_PAGE_BYTES", 256 * 1024)
    ws = uid("ws-")
    key = await service.issue_key(ws)
    await service.append_pings(ws, 700)
    large = [  # random text, so that its stored size is its size (no compression)
        NewEvent("test.ping", {"n": 700 + n, "pad": os.urandom(24_000).hex()}) for n in range(60)
    ]
    await service.app[STORE].append(
        uid("test:"), large, expected_version=0, command_id=uid("cmd-"), workspace_id=ws
    )
    tailer = service.app[TAILER]
    real_page = tailer.history_page
    page_bytes: list[int] = []

    async def measured_page(*args: Any) -> tuple[list[RecordedEvent], bool]:
        page, more = await real_page(*args)
        page_bytes.append(sum(len(orjson.dumps(e.data)) for e in page))
        return page, more

    monkeypatch.setattr(tailer, "history_page", measured_page)
    resp, reader = await open_feed(service, EVENTS, key)
    numbers = await ping_numbers(reader, 760)
    resp.close()
    assert numbers == list(range(760))
    # One event may pass the budget (a page always moves on), never a page's worth.
    assert max(page_bytes) <= 256 * 1024 + 48_100, page_bytes


async def ping_numbers(reader: SseReader, count: int) -> list[int]:
    """The `n` of the next `count` `test.ping` events the feed sends (other frames skipped)."""
    numbers: list[int] = []
    while len(numbers) < count:
        frame = await reader.frame()
        assert frame is not None, f"the feed ended after {len(numbers)} pings"
        if frame.event == "test.ping":
            numbers.append(frame.json()["data"]["n"])
    return numbers


async def test_feeds_catching_up_at_once_read_history_a_few_at_a_time(
    service: Service, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Clients reconnecting together (after a restart, say) read history a few at a time,
    so they neither take the database pool from chat turns nor hold a page of memory each;
    every one of them still gets the whole log."""
    hub = service.app[feeds.FEED_HUB]
    monkeypatch.setattr(hub, "catch_up_concurrency", 2)
    monkeypatch.setattr(hub, "_catch_up_slots", None)
    ws = uid("ws-")
    key = await service.issue_key(ws)
    await service.append_pings(ws, 250)
    tailer = service.app[TAILER]
    real_page = tailer.history_page
    reading = peak = 0

    async def slow_page(*args: Any) -> tuple[list[RecordedEvent], bool]:
        nonlocal reading, peak
        reading += 1
        peak = max(peak, reading)
        try:
            await asyncio.sleep(0.02)
            return await real_page(*args)
        finally:
            reading -= 1

    monkeypatch.setattr(tailer, "history_page", slow_page)
    opened = await asyncio.gather(*(open_feed(service, EVENTS, key) for _ in range(6)))
    for resp, reader in opened:
        numbers = await ping_numbers(reader, 250)
        resp.close()
        assert numbers == list(range(250))
    assert 1 <= peak <= 2


async def test_a_client_slow_to_read_its_catch_up_holds_no_one_else_back(
    service: Service, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Catch-ups take turns for their database reads only: a client that takes its history
    slowly (here not at all, and not cut off for a minute) keeps no other feed, of another
    workspace, from catching up."""
    hub = service.app[feeds.FEED_HUB]
    monkeypatch.setattr(hub, "catch_up_concurrency", 1)
    monkeypatch.setattr(hub, "_catch_up_slots", None)
    monkeypatch.setattr(hub, "write_timeout_s", 60.0)
    slow_ws, other_ws = uid("ws-"), uid("ws-")
    slow_key, other_key = await service.issue_key(slow_ws), await service.issue_key(other_ws)
    for _ in range(20):
        await service.append_pings(slow_ws, 100, size=8000)
    await service.append_pings(other_ws, 5)
    cut_before = hub.cut_off_total
    stalled, stalled_reader = await open_feed(service, EVENTS, slow_key)
    assert (await stalled_reader.frame()) is not None  # the retry frame; then no more reads
    await asyncio.sleep(0.5)  # its catch-up is writing into a full socket
    resp, reader = await open_feed(service, EVENTS, other_key)
    async with asyncio.timeout(20):  # well inside the stalled client's minute
        numbers = await ping_numbers(reader, 5)
    assert numbers == list(range(5))
    assert hub.cut_off_total == cut_before  # the stalled one is still there, not cut off
    resp.close()
    stalled.close()


async def test_a_catch_up_queues_only_what_it_selects_within_its_bounds(
    service: Service, monkeypatch: pytest.MonkeyPatch
) -> None:
    """While a filtered feed reads its history, the live events it does not select take no
    room in its queue (ten of them overflowed a queue of five, and the history was read
    again), yet the queue remembers the last one seen; what it selects is bounded by the
    bytes of their frames too."""
    hub = service.app[feeds.FEED_HUB]
    monkeypatch.setattr(hub, "max_pending", 5)
    monkeypatch.setattr(hub, "max_pending_bytes", 20_000)
    ws = uid("ws-")
    await service.append_pings(ws, 10, kind="test.other", size=5_000)
    await service.append_pings(ws, 1, kind="test.match", size=30_000)
    events = await workspace_log(service, ws)
    others = [event for event in events if event.type == "test.other"]
    large = [event for event in events if event.type == "test.match"]
    selected = feed_fanout.FeedFilter(ws, "events", lambda _: True, frozenset({"test.match"}))
    conn = feed_fanout.FeedConnection(selected, cast(Any, None), cast(Any, None), "", 0.0)
    hub._queue(conn, others)
    assert not conn.overflowed and conn.pending == []
    assert conn.pending_through == (others[-1].point, others[-1].cursor)
    hub._queue(conn, large)  # one frame past the byte bound
    assert conn.overflowed and conn.pending == [] and conn.pending_bytes == 0


async def test_a_client_that_stalls_while_catching_up_is_cut_off(
    service: Service, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A client that reads nothing while its history is written is cut off as on the live
    path: counted, let go, and given a final `subscriber_too_slow` frame with its cursor when
    its socket takes one in time (else the socket is dropped)."""
    hub = service.app[feeds.FEED_HUB]
    monkeypatch.setattr(hub, "write_timeout_s", 1.0)
    ws = uid("ws-")
    key = await service.issue_key(ws)
    for _ in range(30):
        await service.append_pings(ws, 100, size=8000)
    cut_before = hub.cut_off_total
    resp, reader = await open_feed(service, EVENTS, key)
    assert (await reader.frame()) is not None  # the retry frame; then stop reading
    for _ in range(400):
        if hub.cut_off_total > cut_before:
            break
        await asyncio.sleep(0.05)
    assert hub.cut_off_total == cut_before + 1
    received: list[Frame] = []
    final: Frame | None = None
    try:
        while (frame := await reader.frame()) is not None:
            if frame.event == "feed_error":
                final = frame
            elif frame.is_event:
                received.append(frame)
    except aiohttp.ClientPayloadError:
        pass  # dropped: the final frame did not fit either
    resp.close()
    assert 0 < len(received) < 3000
    if final is not None:
        assert final.json()["error"]["code"] == "subscriber_too_slow"
        assert final.json()["cursor"] == received[-1].id
    assert hub.connection_count == 0


def small_receive_buffer(addr_info: Any) -> socket.socket:
    """A client socket whose kernel takes little ahead of the reader, so the server's
    writes wait on what the client reads, as over a slow link."""
    family, type_, proto, _, _ = addr_info
    sock = socket.socket(family, type_, proto)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 8192)
    return sock


async def read_slowly(resp: aiohttp.ClientResponse, until: bytes) -> bytes:
    """The body, 8 KiB every 10 ms (under 1 MB/s), up to and including `until`."""
    body = b""
    async with asyncio.timeout(60):
        while until not in body:
            piece = await resp.content.read(8192)
            assert piece, f"the feed ended after {len(body)} bytes: {body[-300:]!r}"
            body += piece
            await asyncio.sleep(0.01)
    return body


@pytest.mark.parametrize("live", [False, True], ids=["catching-up", "live"])
async def test_a_client_reading_a_large_event_slowly_but_steadily_gets_it(
    service: Service, monkeypatch: pytest.MonkeyPatch, live: bool
) -> None:
    """A feed was cut off when its socket had not drained a write within write_timeout_s
    (or held unsent data at every sweep for as long), however steadily its client read: an
    event that takes longer than that to cross the client's link was never delivered, and
    each reconnect read and sent it again. Cut off now is a client that takes nothing."""
    hub = service.app[feeds.FEED_HUB]
    monkeypatch.setattr(hub, "write_timeout_s", 0.5)
    monkeypatch.setattr(hub, "tick_s", 0.1)
    ws = uid("ws-")
    key = await service.issue_key(ws)
    marker = os.urandom(8).hex()
    large = NewEvent("test.ping", {"n": 0, "pad": marker + os.urandom(750_000).hex()})

    async def append_large() -> None:
        await service.app[STORE].append(
            uid("test:"), [large], expected_version=0, command_id=uid("cmd-"), workspace_id=ws
        )

    if not live:
        await append_large()
    cut_before = hub.cut_off_total
    connector = aiohttp.TCPConnector(socket_factory=small_receive_buffer)
    async with aiohttp.ClientSession(connector=connector) as http:
        params = {"start": "latest"} if live else {}
        async with http.get(service.url(EVENTS), headers=service.auth(key), params=params) as resp:
            assert resp.status == 200
            await read_slowly(resp, b"retry:")
            for conns in hub._by_ws.values():  # the server's side of the socket too
                for conn in conns:
                    sock = conn.outlet.transport.get_extra_info("socket")
                    sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 8192)
            if live:
                await append_large()
            body = await read_slowly(resp, b"event: test.ping")
            body += await read_slowly(resp, b"\n\n")  # the whole frame, 1.5 MB
    assert marker.encode() in body and b"subscriber_too_slow" not in body
    assert hub.cut_off_total == cut_before


async def test_graceful_shutdown_sends_a_final_frame(database_url: str, tmp_path: Path) -> None:
    svc = await start_service(database_url, tmp_path)
    try:
        ws = uid("ws-")
        key = await svc.issue_key(ws)
        last = await svc.append_pings(ws, 3)
        _resp, reader = await open_feed(svc, EVENTS, key)
        frames = await reader.events(len(await log_cursors(svc, ws)))
        closing = asyncio.ensure_future(svc.server.close())
        (final,) = await reader.events(1)
        await closing
    finally:
        await svc.http.close()
        await svc.server.close()
    assert frames[-1].id == last
    assert final.event == "shutdown" and final.id == last
    body = final.json()
    assert body["cursor"] == last and body["error"]["code"] == "shutdown"


async def test_idle_feed_sends_heartbeat_comments(
    service: Service, monkeypatch: pytest.MonkeyPatch
) -> None:
    hub = service.app[feeds.FEED_HUB]
    monkeypatch.setattr(hub, "heartbeat_s", 0.2)
    monkeypatch.setattr(hub, "tick_s", 0.05)
    key = await service.issue_key(uid("ws-"))
    resp, reader = await open_feed(service, EVENTS, key, start="latest")
    first = await reader.frame()
    beat = await reader.frame()
    # No blank line after it: a parser that keeps the last id (httpx-sse, the openai SDK's)
    # would hand its consumer an empty event for each blank line.
    async with asyncio.timeout(10):
        after = await resp.content.readline()
    resp.close()
    assert first is not None and first.retry == 3000
    assert beat is not None and beat.comment == "heartbeat" and beat.event is None
    assert after == b": heartbeat\n"


async def feed_waiting_for_a_read_slot(
    service: Service, monkeypatch: pytest.MonkeyPatch, *, pings: int
) -> tuple[asyncio.Semaphore, aiohttp.ClientResponse, SseReader]:
    """A feed opened on `pings` events of history while every catch-up read slot is taken
    (the returned semaphore, held: release it to let the read go), heartbeats every 0.2 s."""
    hub = service.app[feeds.FEED_HUB]
    monkeypatch.setattr(hub, "heartbeat_s", 0.2)
    slots = asyncio.Semaphore(1)
    monkeypatch.setattr(hub, "_catch_up_slots", slots)
    ws = uid("ws-")
    key = await service.issue_key(ws)
    await service.append_pings(ws, pings)
    await slots.acquire()
    resp, reader = await open_feed(service, EVENTS, key)
    return slots, resp, reader


async def test_a_feed_waiting_to_read_its_history_sends_heartbeats(
    service: Service, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A feed whose catch-up waits (here for a read slot other feeds hold) is not silent
    meanwhile, so a proxy does not drop it as idle; it then gets its whole history."""
    slots, resp, reader = await feed_waiting_for_a_read_slot(service, monkeypatch, pings=5)
    async with asyncio.timeout(10):
        first = await reader.frame()
        beats = [await reader.frame(), await reader.frame()]
    assert first is not None and first.retry == 3000
    assert all(beat is not None and beat.comment == "heartbeat" for beat in beats)
    slots.release()
    numbers = await ping_numbers(reader, 5)
    resp.close()
    assert numbers == list(range(5))


async def test_a_feed_shut_down_while_waiting_for_its_history_ends_at_once(
    service: Service, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A catching-up feed writes its own final frame: one that is waiting for a read slot
    when the service shuts down gets it then, not once a slot frees."""
    slots, resp, reader = await feed_waiting_for_a_read_slot(service, monkeypatch, pings=3)
    try:
        async with asyncio.timeout(10):
            await reader.frame()  # the retry advice
            beat = await reader.frame()  # waiting for its slot
            assert beat is not None and beat.comment == "heartbeat"
            service.app[feeds.FEED_HUB].close_all()
            final = await reader.frame()
            assert final is not None and final.event == "shutdown"
            assert await reader.frame() is None  # and the response ends
        resp.close()
    finally:
        slots.release()


async def test_the_access_log_counts_a_feeds_live_bytes(
    service: Service, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A feed usually ends by its client leaving, and its live frames go out below aiohttp's
    response writer: the access log's size still counts every byte sent."""
    caplog.set_level(logging.INFO, logger="aiohttp.access")
    monkeypatch.setattr(service.app[feeds.FEED_HUB], "tick_s", 0.05)  # sees the client leave
    ws = uid("ws-")
    key = await service.issue_key(ws)
    resp, _ = await open_feed(service, EVENTS, key, start="latest")
    await service.append_pings(ws, 20, size=1000)
    received = 0
    async with asyncio.timeout(10):
        body = b""
        while b'"n":19' not in body:  # the last event, written by the live rounds
            body += await resp.content.readany()
        received = len(body)
    resp.close()
    async with asyncio.timeout(10):
        while True:  # logged once the handler has seen the client leave
            logged = _access_lines(caplog, EVENTS)
            if logged:
                break
            await asyncio.sleep(0.05)
    size = int(logged[0].split('" ')[1].split()[1])  # '"GET ..." 200 <size> ...'
    assert size >= received > 20_000


def _access_lines(caplog: pytest.LogCaptureFixture, path: str) -> list[str]:
    lines = [r.getMessage() for r in caplog.records if r.name == "aiohttp.access"]
    return [line for line in lines if f"GET {path}" in line]


async def test_feeds_joining_during_appends_get_the_exact_log(service: Service) -> None:
    # Feeds open one after another while writers append: each catches up from the database
    # and joins the shared live rounds without a gap or a repeat; a type-filtered feed and a
    # feed of another workspace ride the same rounds.
    ws, other = uid("ws-"), uid("ws-")
    key, other_key = await service.issue_key(ws), await service.issue_key(other)
    await service.append_pings(ws, 40)

    async def writer() -> None:
        for n in range(30):
            await service.append_pings(ws, 3, kind="test.odd" if n % 2 else "test.ping")
            await service.append_pings(other, 1)
            await asyncio.sleep(0.005)

    writing = asyncio.create_task(writer())
    feeds_open = []
    for _ in range(4):
        feeds_open.append(await open_feed(service, EVENTS, key))
        await asyncio.sleep(0.03)
    typed = await open_feed(service, EVENTS, key, types="test.odd")
    foreign = await open_feed(service, EVENTS, other_key)
    await writing

    expected = await log_cursors(service, ws)
    expected_odd = await log_cursors(service, ws, ["test.odd"])
    expected_other = await log_cursors(service, other)
    assert ids(await typed[1].events(len(expected_odd))) == expected_odd
    assert ids(await foreign[1].events(len(expected_other))) == expected_other
    for _resp, reader in feeds_open:
        assert ids(await reader.events(len(expected))) == expected
    # The next frame is the next event, not a repeat, on every feed.
    sentinel = await service.append_pings(ws, 1, kind="test.odd")
    other_sentinel = await service.append_pings(other, 1)
    for _resp, reader in [*feeds_open, typed]:
        assert ids(await reader.events(1)) == [sentinel]
    assert ids(await foreign[1].events(1)) == [other_sentinel]
    for resp, _reader in [*feeds_open, typed, foreign]:
        resp.close()


async def test_a_closed_client_leaves_the_fan_out(
    service: Service, monkeypatch: pytest.MonkeyPatch
) -> None:
    hub = service.app[feeds.FEED_HUB]
    monkeypatch.setattr(hub, "tick_s", 0.05)
    ws = uid("ws-")
    key = await service.issue_key(ws)
    resp, reader = await open_feed(service, EVENTS, key, start="latest")
    await service.append_pings(ws, 1)
    await reader.events(1)
    assert hub.connection_count == 1
    resp.close()
    # Noticed by the sweep or by the next round's write, whichever comes first.
    for _ in range(400):
        if hub.connection_count == 0:
            break
        await asyncio.sleep(0.05)
    assert hub.connection_count == 0


async def test_a_feed_its_client_closes_is_no_hang_up(
    service: Service, caplog: pytest.LogCaptureFixture
) -> None:
    """A feed ends when its client leaves: that is no error to count (a JSON request left
    unanswered is, as a 499)."""
    caplog.set_level(logging.INFO, logger="aiohttp.access")
    key = await service.issue_key(uid("ws-"))
    hang_ups = HTTP_ERRORS.labels(status="499")
    before = hang_ups._value.get()
    resp, reader = await open_feed(service, EVENTS, key)
    assert (await reader.frame()) is not None
    resp.close()
    hub = service.app[feeds.FEED_HUB]
    async with asyncio.timeout(10):
        while True:  # the feed leaves the fan-out as its handler returns
            if not hub.connection_count:
                break
            await asyncio.sleep(0.05)
    await access_logged(caplog.records, f"GET {EVENTS}")  # the middleware has seen it end
    assert hang_ups._value.get() == before
