"""The admin API over real HTTP on loopback against create_app on the embedded PostgreSQL."""

from __future__ import annotations

import asyncio
from datetime import UTC, datetime
from typing import Any

import aiohttp
import asyncpg
import orjson
import pytest
from test_admin_support import Service, service, uid
from yarl import URL

import gateway.admin_common
import gateway.admin_conversations
import gateway.admin_history
import gateway.admin_keys
from actors.conversation import ConversationBehaviour, conversation_key
from actors.workspace import workspace_key
from eventstore.cursor import LogPoint, decode_cursor, encode_cursor
from eventstore.errors import StoreUnavailable
from eventstore.records import NewEvent, RecordedEvent, Snapshot
from gateway.state import STORE
from schemas.events import EVENTS
from schemas.workspace import ApiKeyRevoked

__all__ = ["service"]

# See test_feeds.py: the store's LISTEN connection warns on close, which must not abort shutdown.
pytestmark = pytest.mark.filterwarnings("ignore::asyncpg.InterfaceWarning")


async def chatty_workspace(svc: Service) -> tuple[str, str, str]:
    """A workspace with an admin key and one conversation of two turns."""
    ws = uid("ws-")
    key = await svc.issue_key(ws, ("admin:read", "admin:write"))
    cid = await svc.start_conversation(ws, "Quarterly numbers")
    await svc.run_turn(ws, cid, "What were the numbers?")
    await svc.run_turn(ws, cid, "And last year?")
    return ws, key, cid


def assert_error(body: dict[str, object], code: str | None = None) -> None:
    error = body["error"]
    assert isinstance(error, dict) and error["message"]
    if code is not None:
        assert error["code"] == code, error


async def test_conversations_list_shape_and_paging(service: Service) -> None:
    ws, key, cid = await chatty_workspace(service)
    other = await service.start_conversation(ws, "Second")
    body = await service.get_json("/v1/admin/conversations", key)
    assert (body["total"], body["limit"], body["offset"]) == (2, 50, 0)
    assert [c["id"] for c in body["conversations"]] == [other, cid]
    item = body["conversations"][1]
    for name in ("id", "title", "folder", "tags", "updated_at", "created_at", "workspace_id"):
        assert name in item
    assert item["title"] == "Quarterly numbers" and item["workspace_id"] == ws
    page = await service.get_json("/v1/admin/conversations", key, limit=1, offset=1)
    assert [c["id"] for c in page["conversations"]] == [cid]
    assert (page["total"], page["limit"], page["offset"]) == (2, 1, 1)
    # QA finding: a conversation without a title was listed with `title: null`; the spec's
    # Conversation.title is a string.
    untitled = await service.start_conversation(ws, None)
    body = await service.get_json("/v1/admin/conversations", key)
    assert [c["title"] for c in body["conversations"] if c["id"] == untitled] == [""]


async def test_a_walk_by_after_meets_each_conversation_once_while_they_change(
    service: Service,
) -> None:
    """By offset, a conversation updated during a walk moves to the front and shifts every
    page after it: the walk meets one twice. By `after`, it goes on from the last row seen."""
    ws = uid("ws-")
    key = await service.issue_key(ws, ("admin:read",))
    made = [await service.start_conversation(ws, f"c{i}") for i in range(7)]
    walked: list[str] = []
    moved_ahead: set[str] = set()  # updated before the walk met them: now behind it
    page = await service.get_json("/v1/admin/conversations", key, limit=3)
    while True:
        walked += [c["id"] for c in page["conversations"]]
        assert page["total"] == 7
        # Updated meanwhile: one already met, and one the walk has yet to meet.
        await service.run_turn(ws, walked[0], "again")
        unseen = [c for c in made if c not in walked]
        if unseen:
            await service.rename(ws, unseen[-1], "renamed")
            moved_ahead.add(unseen[-1])
        if page["next_after"] is None:
            break
        page = await service.get_json(
            "/v1/admin/conversations", key, limit=3, after=page["next_after"]
        )
    assert len(walked) == len(set(walked)), walked  # none met twice
    assert set(made) - moved_ahead <= set(walked), walked  # none that stayed put skipped
    assert moved_ahead and set(walked) <= set(made)
    # A walk with nothing changing meets every conversation, and the last page says so.
    first = await service.get_json("/v1/admin/conversations", key, limit=4)
    rest = await service.get_json(
        "/v1/admin/conversations", key, limit=4, after=first["next_after"]
    )
    listed = [c["id"] for c in first["conversations"] + rest["conversations"]]
    assert sorted(listed) == sorted(made) and rest["next_after"] is None
    exact = await service.get_json("/v1/admin/conversations", key, limit=7)
    assert exact["next_after"] is None  # a page that ends the list exactly


@pytest.mark.parametrize(
    ("params", "says"),
    [
        ({"after": "not-a-position!"}, "is not a next_after of the conversation list"),
        ({"after": "bm9jb2xvbg"}, "is not a next_after of the conversation list"),  # "nocolon"
        ({"after": "OTk5OTk5OTk5OTk5OTk5OTk5OmM"}, "is not a next_after"),  # past year 9999
        ({"after": "MTpj", "offset": 1}, "give after or offset, not both"),
        ({"after": "MDphAGI"}, "is not a next_after"),  # "0:a\x00b": no NUL reaches SQL
    ],
)
async def test_conversations_after_validation(
    service: Service, params: dict[str, object], says: str
) -> None:
    key = await service.issue_key(uid("ws-"), ("admin:read",))
    body = await service.get_json("/v1/admin/conversations", key, 400, **params)
    assert_error(body, "invalid_request")
    assert says in body["error"]["message"], body


@pytest.mark.parametrize(
    "params",
    [
        {"limit": 0},
        {"limit": 201},
        {"limit": "ten"},
        {"offset": -1},
        {"offset": "x"},
        {"offset": 10**20},  # beyond the database's integers: a 400, not a 500
        {"limt": 5},
        {"lmit": ""},  # empty, but unknown: not taken for absent
        # QA finding: pydantic read these as 10, 1 and 5 (`at_version=3_0` asked for 30).
        {"limit": "1_0"},
        {"limit": "1.0"},
        {"offset": " 5"},
        {"limit": "+5"},
    ],
)
async def test_conversations_paging_validation(service: Service, params: dict[str, object]) -> None:
    key = await service.issue_key(uid("ws-"), ("admin:read",))
    body = await service.get_json("/v1/admin/conversations", key, 400, **params)
    assert_error(body, "invalid_request")
    assert body["error"]["type"] == "invalid_request_error"
    assert next(iter(params)) in body["error"]["message"]


async def test_a_repeated_query_parameter_is_refused(service: Service) -> None:
    key = await service.issue_key(uid("ws-"), ("admin:read",))
    for query in ("limit=1&limit=2", "limit=&limit=2", "limit=1&offset=0&offset=1"):
        resp = await service.http.get(
            service.url(f"/v1/admin/conversations?{query}"), headers=service.auth(key)
        )
        body = orjson.loads(await resp.read())
        assert resp.status == 400, body
        assert_error(body, "invalid_request")
        assert "is given more than once; give it once" in body["error"]["message"], query


async def test_messages_oldest_first(service: Service) -> None:
    _, key, cid = await chatty_workspace(service)
    body = await service.get_json("/v1/admin/conversations/messages", key, id=cid)
    assert body["conversation_id"] == cid
    messages = body["messages"]
    assert [m["role"] for m in messages] == ["user", "assistant", "user", "assistant"]
    assert messages[0]["content"] == "What were the numbers?"
    assert set(messages[0]) == {"seq", "role", "content", "name", "turn_id", "created_at"}
    assert [m["seq"] for m in messages] == [1, 2, 3, 4] and body["next_after"] is None
    assert messages[0]["turn_id"] == messages[1]["turn_id"]
    created = [m["created_at"] for m in messages]
    assert created == sorted(created)
    # Without its id, or with an empty one, the read says so in words (QA finding: pydantic's
    # "Field required" for `?id=`).
    for given, state in (({"id": ""}, "empty"), ({}, "missing")):
        refused = await service.get_json("/v1/admin/conversations/messages", key, 400, **given)
        message = refused["error"]["message"]
        assert message == f"query parameter id is {state}: give it a value", message
    # A misspelt one is named as the typo it is, with the names the request takes.
    refused = await service.get_json("/v1/admin/conversations/messages", key, 400, ID=cid)
    assert refused["error"]["message"] == (
        "query parameter ID is not one this request takes (did you mean id?); it takes after, "
        "id, limit, min_cursor"
    ), refused
    # The spec names the conversation `id` here and `conversation_id` in the export and the
    # turns: the other name is pointed to (QA finding: listed, not suggested).
    refused = await service.get_json(
        "/v1/admin/conversations/messages", key, 400, conversation_id=cid
    )
    assert "conversation_id is not one this request takes (did you mean id?)" in str(refused)
    refused = await service.get_json("/v1/admin/conversations/messages", key, 400, id=cid, limt="5")
    assert (
        "query parameter limt is not one this request takes (did you mean limit?)"
        in (refused["error"]["message"])
    ), refused
    odd = await service.get_json("/v1/admin/conversations/messages", key, 400, **{"ab": "1"})
    assert "query parameter 'a\\x1bb' is not one" in odd["error"]["message"], odd
    for path in ("/v1/admin/overview", "/v1/admin/apikeys"):
        refused = await service.get_json(path, key, 400, conversation_id=cid)
        assert (
            "query parameter conversation_id is not one this request takes"
            in (refused["error"]["message"])
        ), refused


async def test_messages_in_pages_by_count_and_by_size(
    service: Service, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A long conversation is read in pages: `limit` messages, and no more text than a page
    holds (the first message of a page always fits, so paging always moves on)."""
    _, key, cid = await chatty_workspace(service)
    path = "/v1/admin/conversations/messages"
    page = await service.get_json(path, key, id=cid, limit=3)
    assert [m["seq"] for m in page["messages"]] == [1, 2, 3] and page["next_after"] == 3
    page = await service.get_json(path, key, id=cid, limit=3, after=3)
    assert [m["seq"] for m in page["messages"]] == [4] and page["next_after"] is None
    page = await service.get_json(path, key, id=cid, after=4)
    assert page["messages"] == [] and page["next_after"] is None
    whole = await service.get_json(path, key, id=cid)
    # Every message is longer than a page's text: one message a page.
    monkeypatch.setattr(gateway.admin_conversations, "MESSAGE_PAGE_BYTES", 5)
    seen, after = [], 0
    while after is not None:
        page = await service.get_json(path, key, id=cid, after=after)
        assert len(page["messages"]) == 1
        seen.append(page["messages"][0]["content"])
        after = page["next_after"]
    assert seen == [m["content"] for m in whole["messages"]] and len(seen) == 4
    for bad in ({"limit": 0}, {"limit": 1001}, {"after": -1}, {"after": 2**31}, {"after": "x"}):
        body = await service.get_json(path, key, 400, id=cid, **bad)
        assert_error(body, "invalid_request")
        assert next(iter(bad)) in body["error"]["message"]


async def test_unknown_conversation_is_404(service: Service) -> None:
    key = await service.issue_key(uid("ws-"), ("admin:read",))
    for path, params in (
        ("/v1/admin/conversations/messages", {"id": "nope"}),
        ("/v1/admin/conversations/turns", {"conversation_id": "nope"}),
        ("/v1/admin/conversations/export", {"conversation_id": "nope"}),
        ("/v1/admin/conversations/events", {"id": "nope"}),
    ):
        body = await service.get_json(path, key, 404, **params)
        assert_error(body, "conversation_not_found")
    body = await service.get_json("/v1/admin/conversations/messages", key, 400)
    assert_error(body, "invalid_request")


async def test_turns(service: Service) -> None:
    _, key, cid = await chatty_workspace(service)
    body = await service.get_json("/v1/admin/conversations/turns", key, conversation_id=cid)
    assert body["conversation_id"] == cid
    turns = body["turns"]
    assert len(turns) == 2
    for turn in turns:
        assert turn["status"] == "completed"
        assert turn["model"] == "svc-offline"
        assert turn["tokens"] == turn["prompt_tokens"] + turn["completion_tokens"] > 0
        assert turn["duration_ms"] is not None and turn["error"] is None
    limited = await service.get_json(
        "/v1/admin/conversations/turns", key, conversation_id=cid, limit=1
    )
    assert [t["turn_id"] for t in limited["turns"]] == [turns[0]["turn_id"]]
    everywhere = await service.get_json("/v1/admin/conversations/turns", key)
    assert everywhere["conversation_id"] is None and len(everywhere["turns"]) == 2
    await service.get_json("/v1/admin/conversations/turns", key, 400, limit=0)
    # Empty (review finding: read as absent, every conversation's turns answered).
    empty = await service.get_json("/v1/admin/conversations/turns", key, 400, conversation_id="")
    assert "conversation_id" in empty["error"]["message"], empty


async def test_export_markdown_and_json(service: Service) -> None:
    _, key, cid = await chatty_workspace(service)
    resp = await service.get(
        "/v1/admin/conversations/export", key, conversation_id=cid, format="md"
    )
    assert resp.status == 200
    assert resp.headers["Content-Type"].startswith("text/markdown")
    assert resp.headers["Content-Disposition"] == f'attachment; filename="conversation-{cid}.md"'
    text = await resp.text()
    assert text.startswith("# Quarterly numbers\n")
    assert "What were the numbers?" in text and "## assistant" in text

    resp = await service.get("/v1/admin/conversations/export", key, conversation_id=cid)
    assert resp.status == 200
    assert resp.headers["Content-Disposition"].endswith('.json"')
    body = await resp.json()
    assert body["conversation"]["id"] == cid
    assert [m["role"] for m in body["messages"]] == ["user", "assistant", "user", "assistant"]

    bad = await service.get_json(
        "/v1/admin/conversations/export", key, 400, conversation_id=cid, format="pdf"
    )
    assert "format" in bad["error"]["message"]


async def test_head_on_an_export_answers_its_headers_and_no_body(service: Service) -> None:
    """Sent pipelined with a second request on one connection: the second's answer must come
    right after the HEAD's headers (a body after HEAD would be read as the next answer)."""
    _, key, cid = await chatty_workspace(service)
    url = URL(service.url("/"))
    auth = f"Authorization: Bearer {key}\r\nHost: x\r\n"
    export = f"/v1/admin/conversations/export?conversation_id={cid}&format=md"
    reader, writer = await asyncio.open_connection(url.host, url.port)
    try:
        writer.write(
            f"HEAD {export} HTTP/1.1\r\n{auth}\r\n"
            f"GET /healthz HTTP/1.1\r\n{auth}Connection: close\r\n\r\n".encode()
        )
        raw = await asyncio.wait_for(reader.read(), timeout=10.0)
    finally:
        writer.close()
    head, _, rest = raw.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 200 ") and b"text/markdown" in head
    assert rest.startswith(b"HTTP/1.1 200 "), rest[:80]
    unknown = await service.http.head(
        service.url("/v1/admin/conversations/export"),
        headers=service.auth(key),
        params={"conversation_id": "c-none"},
    )
    assert unknown.status == 404


@pytest.mark.parametrize("page_bytes", [5, 8 * 1024 * 1024])
async def test_an_export_is_written_a_page_at_a_time(
    service: Service, monkeypatch: pytest.MonkeyPatch, page_bytes: int
) -> None:
    """One message a page, or all of them in one: the same document either way."""
    _, key, cid = await chatty_workspace(service)
    whole = await service.get_json("/v1/admin/conversations/messages", key, id=cid)
    monkeypatch.setattr(gateway.admin_conversations, "MESSAGE_PAGE_BYTES", page_bytes)
    read = gateway.admin_conversations.queries.get_message_page
    pages: list[int] = []

    async def counted(*args: Any, **kwargs: Any) -> Any:
        page = await read(*args, **kwargs)
        pages.append(len(page.messages))
        return page

    monkeypatch.setattr(gateway.admin_conversations.queries, "get_message_page", counted)
    path = "/v1/admin/conversations/export"
    body = orjson.loads(await (await service.get(path, key, conversation_id=cid)).read())
    # A page holds at least one message, the limit notwithstanding.
    assert pages == ([1, 1, 1, 1] if page_bytes == 5 else [4]), pages
    assert set(body) == {"conversation", "messages", "exported_at"}
    assert body["conversation"]["id"] == cid and body["conversation"]["message_count"] == 4
    assert body["messages"] == whole["messages"]
    assert datetime.fromisoformat(body["exported_at"]).tzinfo is not None
    text = await (await service.get(path, key, conversation_id=cid, format="md")).text()
    assert text.count("\n## ") == 4 and text.endswith("```\n")
    for m in whole["messages"]:
        assert m["content"] in text


async def test_an_export_whose_read_fails_midway_is_cut_short_not_completed(
    service: Service, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A failed first page is an ordinary error answer. Once the download has begun no error
    can be answered: the connection is aborted, so the client sees an incomplete transfer
    rather than a file that looks whole, whatever failed (the store, or a defect)."""
    _, key, cid = await chatty_workspace(service)
    monkeypatch.setattr(gateway.admin_conversations, "MESSAGE_PAGE_BYTES", 5)
    pages = gateway.admin_conversations.queries.get_message_page
    outage = StoreUnavailable("the event store database is unavailable")
    plan: dict[str, Any] = {"calls": 0, "failing": 1, "failure": outage}

    async def failing_page(*args: Any, **kw: Any) -> Any:
        plan["calls"] += 1
        if plan["calls"] == plan["failing"]:
            raise plan["failure"]
        return await pages(*args, **kw)

    monkeypatch.setattr(gateway.admin_conversations.queries, "get_message_page", failing_page)
    path = "/v1/admin/conversations/export"
    body = await service.get_json(path, key, 503, conversation_id=cid)
    assert_error(body, "store_unavailable")
    for failing, failure in ((2, outage), (3, RuntimeError("a defect"))):
        for format in ("json", "md"):
            plan.update(calls=0, failing=failing, failure=failure)
            resp = await service.get(path, key, conversation_id=cid, format=format)
            assert resp.status == 200
            with pytest.raises(aiohttp.ClientPayloadError):
                await resp.read()


async def test_event_history_rebuilds_state_at_a_version(service: Service) -> None:
    ws = uid("ws-")
    key = await service.issue_key(ws, ("admin:read",))
    cid = await service.start_conversation(ws, "first")
    await service.rename(ws, cid, "second")
    await service.rename(ws, cid, "third")
    path = "/v1/admin/conversations/events"
    full = await service.get_json(path, key, id=cid)
    assert (full["version"], full["at_version"]) == (3, 3)
    assert [e["version"] for e in full["events"]] == [1, 2, 3]
    assert [e["type"] for e in full["events"]] == [
        "conversation.started",
        "conversation.renamed",
        "conversation.renamed",
    ]
    assert full["state"]["title"] == "third"
    at2 = await service.get_json(path, key, id=cid, at_version=2)
    assert (at2["version"], at2["at_version"]) == (3, 2)
    assert len(at2["events"]) == 2 and at2["state"]["title"] == "second"
    at1 = await service.get_json(path, key, id=cid, at_version=1)
    assert at1["state"]["title"] == "first"
    assert_error(await service.get_json(path, key, 400, id=cid, at_version=4), "invalid_version")
    assert_error(await service.get_json(path, key, 400, id=cid, at_version=-1))
    assert full["next_after_version"] is None

    # A page at a time; the state is the whole fold up to at_version on every page.
    pages, after = [], 0
    for _ in range(5):
        page = await service.get_json(path, key, id=cid, limit=2, after_version=after)
        pages.append([e["version"] for e in page["events"]])
        assert page["state"]["title"] == "third"
        if page["next_after_version"] is None:
            break
        after = page["next_after_version"]
    assert pages == [[1, 2], [3]]
    page = await service.get_json(path, key, id=cid, at_version=2, after_version=1)
    assert [e["version"] for e in page["events"]] == [2] and page["next_after_version"] is None
    assert page["state"]["title"] == "second"
    for bad in ({"limit": 0}, {"limit": 1001}, {"after_version": -1}):
        assert_error(await service.get_json(path, key, 400, id=cid, **bad))


async def test_event_history_reads_only_the_page_and_folds_from_the_snapshot(
    service: Service, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A long conversation's stream is not read whole for every page: the page is read by
    its versions, the state folded from the snapshot (as an actor activates) in bounded
    pages, and the answer is the same as a fold from the first event."""
    ws = uid("ws-")
    key = await service.issue_key(ws, ("admin:read",))
    cid = await service.start_conversation(ws, "t0")
    for n in range(1, 6):
        await service.rename(ws, cid, f"t{n}")
    path = "/v1/admin/conversations/events"
    store = service.app[STORE]
    before = {
        at: await service.get_json(path, key, id=cid, at_version=at, after_version=3, limit=2)
        for at in (6, 5, 3)
    }
    stream_id = f"conversation:{cid}"
    records = await store.read_stream(stream_id)
    state = ConversationBehaviour().initial_state(conversation_key(cid))
    for r in records[:4]:
        state = ConversationBehaviour().evolve(state, EVENTS.decode(r.type, 1, r.data))
    await store.save_snapshot(
        Snapshot(stream_id, 4, ConversationBehaviour.state_schema_version, state.model_dump())
    )
    reads: list[tuple[int, int]] = []
    real = store.read_stream

    async def spy(stream: str, first: int = 1, **kw: Any) -> list[RecordedEvent]:
        got = await real(stream, first, **kw)
        reads.append((first, kw.get("to_version") or 0))
        assert len(got) <= 2, (first, kw)  # no read beyond the page or a fold page
        return got

    monkeypatch.setattr(gateway.admin_history, "FOLD_PAGE", 2, raising=False)
    monkeypatch.setattr(store, "read_stream", spy)
    for at, expected in before.items():
        reads.clear()
        assert (
            await service.get_json(path, key, id=cid, at_version=at, after_version=3, limit=2)
            == expected
        )
        assert not [r for r in reads if r[1] == 0], reads  # every read bounded
        if at >= 4:  # folded on from the snapshot at 4: versions 2 and 3 are never read
            assert not [r for r in reads if r[0] in (2, 3)], reads


async def test_event_history_reads_are_cut_by_the_events_stored_sizes(
    service: Service, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Events may carry a megabyte of text each: every read is cut to PAGE_BYTES by the
    events' sizes, asked for first, and a listing ends there, naming where to go on."""
    _, key, cid = await chatty_workspace(service)
    path = "/v1/admin/conversations/events"
    whole = await service.get_json(path, key, id=cid)
    assert whole["next_after_version"] is None and len(whole["events"]) == whole["version"]
    store = service.app[STORE]
    sizes = await store.stream_sizes(f"conversation:{cid}", 1, whole["version"])
    assert [v for v, _ in sizes] == list(range(1, whole["version"] + 1))
    assert all(n > 0 for _, n in sizes)
    spans: list[int] = []
    real = store.read_stream

    async def spy(stream: str, first: int = 1, **kw: Any) -> list[RecordedEvent]:
        spans.append(kw["to_version"] - first + 1)
        return await real(stream, first, **kw)

    monkeypatch.setattr(store, "read_stream", spy)
    # Room for the first two events: a listing of two, then two at a time while they fit.
    monkeypatch.setattr(gateway.admin_history, "PAGE_BYTES", sizes[0][1] + sizes[1][1])
    page = await service.get_json(path, key, id=cid)
    assert [e["version"] for e in page["events"]] == [1, 2]
    assert page["next_after_version"] == 2 and page["state"] == whole["state"]
    # Room for none: one event a read, whatever came before.
    monkeypatch.setattr(gateway.admin_history, "PAGE_BYTES", 1)
    listed, after = [], 0
    while after is not None:
        spans.clear()
        page = await service.get_json(path, key, id=cid, after_version=after)
        assert len(page["events"]) == 1 and page["state"] == whole["state"]
        assert spans and set(spans) == {1}, spans
        listed += page["events"]
        after = page["next_after_version"]
    assert listed == whole["events"]
    # Without the state, a page reads its own events and nothing else: no fold.
    spans.clear()
    page = await service.get_json(path, key, id=cid, after_version=2, state="false")
    assert page["state"] is None and [e["version"] for e in page["events"]] == [3]
    assert spans == [1], spans
    assert (await service.get_json(path, key, id=cid, state="true"))["state"] == whole["state"]
    body = await service.get_json(path, key, 400, id=cid, state="maybe")
    assert_error(body, "invalid_request")
    # Only a page's first event may take it past PAGE_BYTES: a later read of the page
    # whose first event does not fit ends the page there.
    monkeypatch.setattr(gateway.admin_history, "FIRST_LOOKAHEAD", 1)
    monkeypatch.setattr(gateway.admin_history, "PAGE_BYTES", sizes[0][1] + sizes[1][1] - 1)
    page = await service.get_json(path, key, id=cid, state="false")
    assert [e["version"] for e in page["events"]] == [1] and page["next_after_version"] == 1


async def test_event_history_state_keeps_client_keys_that_sound_secret(service: Service) -> None:
    """Secret-named fields are redacted from the rebuilt state, but the keys of its mappings
    are data: a client's idempotency key that mentions a password is shown with its turn."""
    ws = uid("ws-")
    key = await service.issue_key(ws, ("admin:read",))
    cid = await service.start_conversation(ws)
    result = await service.run_turn(ws, cid, "hello", command_id="retry-password-reset-1")
    body = await service.get_json("/v1/admin/conversations/events", key, id=cid)
    assert body["state"]["turn_by_command"] == {"retry-password-reset-1": result.turn_id}


async def test_overview_and_analytics(service: Service) -> None:
    _, key, _ = await chatty_workspace(service)
    body = await service.get_json("/v1/admin/overview", key)
    counts = body["counts"]
    assert counts["conversations"] == 1 and counts["messages"] == 4 and counts["turns"] == 2
    assert counts["api_keys_active"] == 1
    assert body["health"]["database"] == "ok"
    assert {p["name"] for p in body["health"]["projections"]} >= {"conversations", "turns"}

    body = await service.get_json("/v1/admin/analytics", key, bucket="hour")
    assert body["bucket"] == "hour"
    assert body["totals"]["turns"] == 2 and body["totals"]["completed"] == 2
    assert len(body["series"]) in (24, 25)
    assert sum(b["turns"] for b in body["series"]) == 2
    day = await service.get_json(
        "/v1/admin/analytics", key, since="2026-01-01T00:00:00Z", until="2026-01-08T00:00:00Z"
    )
    assert day["bucket"] == "day" and len(day["series"]) == 7
    assert day["totals"]["turns"] == 0
    # Answered in UTC, as the buckets are, whatever offset the window was given in.
    shifted = await service.get_json(
        "/v1/admin/analytics",
        key,
        since="2026-01-01T14:00:00+14:00",
        until="2026-01-07T19:00:00-05:00",
    )
    assert (shifted["since"], shifted["until"]) == (
        "2026-01-01T00:00:00Z",
        "2026-01-08T00:00:00Z",
    ), shifted


@pytest.mark.parametrize(
    "params",
    [
        {"bucket": "week"},
        {"since": "yesterday"},
        {"until": "2026-13-01"},
        {"since": "2026-02-01T00:00:00Z", "until": "2026-01-01T00:00:00Z"},
        {"since": "2020-01-01T00:00:00Z", "until": "2026-01-01T00:00:00Z"},
        {"since": "2026-01-01T00:00:00Z", "until": "2026-03-01T00:00:00Z", "bucket": "hour"},
        # Dates the database or Python cannot represent once read as UTC: 400, not 500.
        {"since": "0001-01-01T00:00:00+14:00", "until": "0001-01-02T00:00:00+14:00"},
        {"since": "9999-12-31T00:00:00-14:00", "until": "9999-12-31T23:00:00-14:00"},
        {"since": "9999-12-31T00:00:00Z", "until": "9999-12-31T23:59:59.999999Z"},
    ],
)
async def test_analytics_validation(service: Service, params: dict[str, str]) -> None:
    key = await service.issue_key(uid("ws-"), ("admin:read",))
    body = await service.get_json("/v1/admin/analytics", key, 400, **params)
    assert body["error"]["type"] == "invalid_request_error"


async def test_analytics_window_takes_iso_text_and_says_what_is_wrong(service: Service) -> None:
    """A number was read as Unix seconds (since=20261126 is a day of 1970), though the docs
    say ISO-8601; and a future since without until was told "until must be later"."""
    key = await service.issue_key(uid("ws-"), ("admin:read",))
    for since in ("0", "20261126", "1764144000.5", "-1"):
        body = await service.get_json("/v1/admin/analytics", key, 400, since=since)
        assert_error(body, "invalid_request")
        assert "since: " in body["error"]["message"] and "ISO-8601" in body["error"]["message"]
    body = await service.get_json("/v1/admin/analytics", key, 400, until="1764144000")
    assert "until: " in body["error"]["message"] and "ISO-8601" in body["error"]["message"]
    body = await service.get_json("/v1/admin/analytics", key, 400, since="8999-01-01")
    assert "since must be in the past: until defaults to now" in body["error"]["message"]
    body = await service.get_json(
        "/v1/admin/analytics", key, 400, since="2026-02-01", until="2026-01-01"
    )
    assert "until must be later than since" in body["error"]["message"]
    # QA findings: an offset's '+' typed into the URL arrives as a space, and an hour of 25
    # was told as "unexpected extra characters at the end of the input".
    resp = await service.http.get(
        service.url("/v1/admin/analytics?since=2026-11-26T08:00:00+05:00"),
        headers=service.auth(key),
    )
    message = orjson.loads(await resp.read())["error"]["message"]
    assert resp.status == 400 and "write it %2B" in message, message
    body = await service.get_json("/v1/admin/analytics", key, 400, since="2026-11-28T25:00:00Z")
    assert "hour must be in 0..23" in body["error"]["message"], body
    for wrong in ("2026-11-28T10:00:00Zjunk", "2026-11-28T10:00:00+01:60", "2026-11-28T10Z"):
        body = await service.get_json("/v1/admin/analytics", key, 400, since=wrong)
        message = body["error"]["message"]
        assert "since: is not a date or date-time; use the form 2026-11-26" in message, message
        assert "extra characters" not in message and "isoformat" not in message, message
    body = await service.get_json(
        "/v1/admin/analytics", key, 400, since="2026-11-28T10:00:00+25:00"
    )
    assert "(a UTC offset is under 24 hours)" in body["error"]["message"], body
    for written in ("2026-11-26T08:00:00z", "2026-11-26t08:00:00.123z", "2026-11-26T08:00Z"):
        await service.get_json("/v1/admin/analytics", key, since=written)  # RFC 3339 forms


async def test_default_window_starts_no_earlier_than_1970(service: Service) -> None:
    key = await service.issue_key(uid("ws-"), ("admin:read",))
    body = await service.get_json("/v1/admin/analytics", key, until="1970-01-02T00:00:00Z")
    assert body["since"].startswith("1970-01-01T00:00:00")


async def test_scopes(service: Service) -> None:
    ws = uid("ws-")
    chat = await service.issue_key(ws, ("chat",))
    reader = await service.issue_key(ws, ("admin:read",))
    body = await service.get_json("/v1/admin/overview", chat, 403)
    assert_error(body, "insufficient_scope")
    body = await service.post_json(
        "/v1/admin/apikeys", reader, {"name": "x", "scopes": ["chat"]}, 403
    )
    assert_error(body, "insufficient_scope")
    # Listing keys is a read (admin:read, the spec's rule), revoking one a write.
    listed = await service.get_json("/v1/admin/apikeys", reader)
    assert sorted(k["scopes"][0] for k in listed["api_keys"]) == ["admin:read", "chat"]
    assert not any("key" in k or "key_hash" in k for k in listed["api_keys"])
    key_id = listed["api_keys"][0]["id"]
    body = await service.post_json(f"/v1/admin/apikeys/{key_id}/revoke", reader, {}, 403)
    assert_error(body, "insufficient_scope")
    resp = await service.http.get(service.url("/v1/admin/overview"))
    assert resp.status == 401


async def test_api_keys_issue_list_revoke(
    service: Service, monkeypatch: pytest.MonkeyPatch
) -> None:
    ws = uid("ws-")
    admin = await service.issue_key(ws, ("admin:read", "admin:write"))
    issued = await service.post_json(
        "/v1/admin/apikeys",
        admin,
        {"name": "ci", "scopes": ["admin:read"], "rate_limit_rpm": 600},
        201,
    )
    assert issued["key"].startswith("svc_") and issued["prefix"] == issued["key"][:8]
    resp = await service.http.post(
        service.url("/v1/admin/apikeys"),
        headers=service.auth(admin),
        json={"name": "cached?", "scopes": ["admin:read"]},
    )
    assert resp.status == 201 and resp.headers["Cache-Control"] == "no-store"
    assert issued["scopes"] == ["admin:read"] and issued["rate_limit_rpm"] == 600
    new_key = issued["key"]

    # The new key works at once.
    assert (await service.get_json("/v1/admin/overview", new_key))["workspace_id"] == ws

    listing = await service.get_json("/v1/admin/apikeys", admin)
    by_id = {k["id"]: k for k in listing["api_keys"]}
    assert issued["id"] in by_id
    # Three keys (the admin's, "ci", "cached?"), newest first, in pages.
    assert (listing["total"], listing["limit"], listing["offset"]) == (3, 1000, 0)
    pages = [
        await service.get_json("/v1/admin/apikeys", admin, limit=2, offset=offset)
        for offset in (0, 2)
    ]
    assert [k["id"] for page in pages for k in page["api_keys"]] == list(by_id)
    assert [len(page["api_keys"]) for page in pages] == [2, 1]
    for bad in ({"limit": 0}, {"limit": 1001}, {"offset": -1}, {"offset": 10**20}):
        assert_error(await service.get_json("/v1/admin/apikeys", admin, 400, **bad))
    for record in listing["api_keys"]:
        assert "key" not in record and "key_hash" not in record
    assert new_key not in str(listing)
    assert by_id[issued["id"]]["revoked_at"] is None

    revoked = await service.post_json(f"/v1/admin/apikeys/{issued['id']}/revoke", admin, None)
    assert revoked["id"] == issued["id"] and revoked["revoked_at"]
    listing = await service.get_json("/v1/admin/apikeys", admin, min_cursor=revoked["cursor"])
    listed = {k["id"]: k for k in listing["api_keys"]}[issued["id"]]
    assert listed["revoked_at"] == revoked["revoked_at"]
    # Revoking again changes nothing and says so: the revocation that stands, its cursor,
    # found looking back through the workspace's stream (here one event at a time).
    monkeypatch.setattr(gateway.admin_keys, "REVOCATION_SEARCH_PAGE", 1)
    await service.post_json("/v1/admin/apikeys", admin, {"name": "later", "scopes": ["chat"]}, 201)
    again = await service.post_json(f"/v1/admin/apikeys/{issued['id']}/revoke", admin, None)
    assert again == revoked

    # The process that revoked it drops it from its key cache: refused at once (other
    # processes within gateway/auth.py CACHE_TTL_S).
    resp = await service.get("/v1/admin/overview", new_key)
    assert resp.status == 401
    assert_error(await resp.json(), "unauthorized")

    body = await service.post_json("/v1/admin/apikeys/key_nope/revoke", admin, None, 404)
    assert_error(body)
    # A key pasted where its id goes: as unknown, and not quoted back, whatever its length.
    for pasted in ("svc_" + "P" * 40, "svc_" + "P" * 240):
        body = await service.post_json(f"/v1/admin/apikeys/{pasted}/revoke", admin, None, 404)
        assert_error(body, "not_found")
        assert "PPPP" not in body["error"]["message"]


async def test_a_revocation_the_read_models_have_not_applied_is_not_confirmed(
    service: Service, database_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Keys are authenticated from the read models: a revoke answered 200 while they lag
    would tell the operator a key is dead that still works."""
    ws = uid("ws-")
    admin = await service.issue_key(ws, ("admin:read", "admin:write"))
    issued = await service.post_json(
        "/v1/admin/apikeys", admin, {"name": "doomed", "scopes": ["admin:read"]}, 201
    )
    monkeypatch.setattr(gateway.admin_common, "READ_YOUR_WRITES_TIMEOUT_S", 0.5)
    holder = await asyncpg.connect(database_url)
    try:
        lock = holder.transaction()
        await lock.start()
        await holder.execute("LOCK TABLE api_keys IN EXCLUSIVE MODE")  # the projector waits
        path = f"/v1/admin/apikeys/{issued['id']}/revoke"
        body = await service.post_json(path, admin, None, 503)
        assert_error(body, "projection_lagging")
        assert "repeat the request to confirm" in body["error"]["message"]
        assert (await service.get("/v1/admin/overview", issued["key"])).status == 200
        await lock.rollback()
    finally:
        await holder.close()
    # The confirmation waits as long as any write does: the held batch commits first.
    monkeypatch.setattr(gateway.admin_common, "READ_YOUR_WRITES_TIMEOUT_S", 5.0)
    confirmed = await service.post_json(path, admin, None)
    assert confirmed["id"] == issued["id"] and confirmed["revoked_at"]
    assert (await service.get("/v1/admin/overview", issued["key"])).status == 401


async def test_a_stopped_read_model_holds_up_only_the_reads_that_draw_on_it(
    service: Service,
) -> None:
    """An event the turns read model cannot apply (one a newer version wrote, say; the others
    do not read it) stops it for every workspace. Key writes and reads of other read models
    go on; a read that needs the stopped one says it is stopped, which no retry cures,
    instead of "lagging"."""
    ws = uid("ws-")
    admin = await service.issue_key(ws, ("admin:read", "admin:write"))
    poisoned = uid("ws-")
    await service.app[STORE].append(
        f"conversation:{uid()}",
        [NewEvent("conversation.turn_started", {"conversation_id": "x"}, 1)],
        expected_version=0,
        command_id=uid("cmd-"),
        workspace_id=poisoned,
    )
    issued = await service.post_json(
        "/v1/admin/apikeys", admin, {"name": "n", "scopes": ["admin:read"]}, 201
    )
    path = f"/v1/admin/apikeys/{issued['id']}/revoke"
    revoked = await service.post_json(path, admin, None)
    listing = await service.get_json("/v1/admin/apikeys", admin, min_cursor=revoked["cursor"])
    assert any(k["revoked_at"] for k in listing["api_keys"])
    cursor = revoked["cursor"]
    await service.get_json("/v1/admin/conversations", admin, min_cursor=cursor)  # not turns'
    for needs_turns in ("/v1/admin/conversations/turns", "/v1/admin/analytics"):
        body = await service.get_json(needs_turns, admin, 503, min_cursor=cursor)
        assert_error(body, "projection_failed")
        message = body["error"]["message"]
        assert "turns" in message and "svc projections status" in message


async def _two_issued_keys(service: Service) -> tuple[str, str, Any, Any]:
    """A fresh workspace, its admin key, and two admin:read keys issued through the API."""
    ws = uid("ws-")
    admin = await service.issue_key(ws, ("admin:read", "admin:write"))
    first, second = [
        await service.post_json(
            "/v1/admin/apikeys", admin, {"name": n, "scopes": ["admin:read"]}, 201
        )
        for n in ("first", "second")
    ]
    return ws, admin, first, second


async def test_an_idempotency_key_reused_for_another_revocation_is_refused(
    service: Service,
) -> None:
    """A key already used (for an issue, or for revoking another key) does not make a
    revocation answer as done: 409, and the key it names stays valid. The same revocation
    retried with its own key gets its first result."""
    ws, admin, first, second = await _two_issued_keys(service)
    used_for_issue = {"Idempotency-Key": uid("issue-")}
    await service.post_json(
        "/v1/admin/apikeys", admin, {"name": "third", "scopes": ["chat"]}, 201, **used_for_issue
    )
    revoke_first = {"Idempotency-Key": uid("revoke-")}
    done = await service.post_json(
        f"/v1/admin/apikeys/{first['id']}/revoke", admin, None, **revoke_first
    )
    assert done == await service.post_json(
        f"/v1/admin/apikeys/{first['id']}/revoke", admin, None, **revoke_first
    )
    for reused in (used_for_issue, revoke_first):
        for target in (second["id"], "key_nope"):
            body = await service.post_json(
                f"/v1/admin/apikeys/{target}/revoke", admin, None, 409, **reused
            )
            assert_error(body, "idempotency_key_reused")
    await service.settle(service.opened(done["cursor"]))
    assert (await service.get_json("/v1/admin/overview", second["key"]))["workspace_id"] == ws


async def test_a_key_used_before_revocations_named_their_request_is_judged_by_the_event(
    service: Service,
) -> None:
    """A revocation recorded before events carried `request_digest` (appended here as an
    older release did): its key reused to revoke another key is still a different request."""
    ws, admin, first, second = await _two_issued_keys(service)
    old = ApiKeyRevoked(workspace_id=ws, key_id=first["id"], at=datetime.now(UTC), by=None)
    type_name, version, data = EVENTS.encode(old)
    metadata = {"command_type": "RevokeApiKey", "command_id": "old-revoke"}
    await service.app[STORE].append(
        workspace_key(ws).stream_id,
        [NewEvent(type_name, data, version, metadata)],
        expected_version=None,
        command_id="old-revoke",
        workspace_id=ws,
    )
    reused = {"Idempotency-Key": "old-revoke"}
    body = await service.post_json(
        f"/v1/admin/apikeys/{second['id']}/revoke", admin, None, 409, **reused
    )
    assert_error(body, "idempotency_key_reused")
    again = await service.post_json(
        f"/v1/admin/apikeys/{first['id']}/revoke", admin, None, **reused
    )
    assert again["id"] == first["id"]


@pytest.mark.parametrize(
    "body",
    [
        {},
        {"name": "x"},
        {"name": "x", "scopes": []},
        {"name": "x", "scopes": ["root"]},
        {"name": "x", "scopes": ["chat"], "rate_limit_rpm": 0},
        {"name": "x", "scopes": ["chat"], "rate_limit_rpm": True},
        {"name": "x", "scopes": ["chat"], "rate_limit_rpm": "60"},
        {"name": "x", "scopes": ["chat"], "expires_at": "soon"},
        {"name": "x", "scopes": ["chat"], "expires_at": "2001-01-01T00:00:00Z"},
        # Past what the read model's timestamptz holds: it used to stop the api_keys projection.
        {"name": "x", "scopes": ["chat"], "expires_at": "9999-12-31T23:59:59-14:00"},
        {"name": "x", "scopes": ["chat"], "expires_at": "9000-01-01T00:00:00Z"},
        {"name": "", "scopes": ["chat"]},
        # The agents' rule for names, and no control characters (listings are one line each).
        {"name": "   ", "scopes": ["chat"]},
        {"name": " x", "scopes": ["chat"]},
        {"name": "a\nb", "scopes": ["chat"]},
        {"name": "a\x1b[31mb", "scopes": ["chat"]},
        {"name": "a\u0085b", "scopes": ["chat"]},  # NEXT LINE (C1)
        {"name": "x", "scopes": ["chat"], "extra": 1},
    ],
)
async def test_api_key_validation(service: Service, body: dict[str, object]) -> None:
    admin = await service.issue_key(uid("ws-"), ("admin:write",))
    assert_error(await service.post_json("/v1/admin/apikeys", admin, body, 400))


async def test_repeated_scopes_count_once(service: Service) -> None:
    """The 16-scope bound was checked before repeats were dropped: ["chat"] * 17 is one."""
    admin = await service.issue_key(uid("ws-"), ("admin:write",))
    body = {"name": "x", "scopes": ["chat"] * 17 + ["mcp"] * 3}
    issued = await service.post_json("/v1/admin/apikeys", admin, body, 201)
    assert issued["scopes"] == ["chat", "mcp"]


async def test_cross_tenant_isolation(service: Service) -> None:
    """A key of workspace A sees nothing of workspace B through any admin endpoint."""
    ws_b, key_b, cid_b = await chatty_workspace(service)
    ws_a = uid("ws-")
    key_a = await service.issue_key(ws_a, ("*",))
    cid_a = await service.start_conversation(ws_a, "mine")
    b_keys = await service.get_json("/v1/admin/apikeys", key_b)
    b_key_id = b_keys["api_keys"][0]["id"]

    listing = await service.get_json("/v1/admin/conversations", key_a)
    assert [c["id"] for c in listing["conversations"]] == [cid_a] and listing["total"] == 1
    for path, params in (
        ("/v1/admin/conversations/messages", {"id": cid_b}),
        ("/v1/admin/conversations/turns", {"conversation_id": cid_b}),
        ("/v1/admin/conversations/export", {"conversation_id": cid_b, "format": "md"}),
        ("/v1/admin/conversations/export", {"conversation_id": cid_b, "format": "json"}),
        ("/v1/admin/conversations/events", {"id": cid_b}),
    ):
        body = await service.get_json(path, key_a, 404, **params)
        assert cid_b in body["error"]["message"] and ws_b not in str(body)
    turns = await service.get_json("/v1/admin/conversations/turns", key_a)
    assert turns["turns"] == []
    overview = await service.get_json("/v1/admin/overview", key_a)
    assert overview["workspace_id"] == ws_a
    assert overview["counts"]["conversations"] == 1 and overview["counts"]["turns"] == 0
    assert overview["counts"]["messages"] == 0
    analytics = await service.get_json("/v1/admin/analytics", key_a)
    assert analytics["totals"]["turns"] == 0
    a_keys = await service.get_json("/v1/admin/apikeys", key_a)
    assert b_key_id not in {k["id"] for k in a_keys["api_keys"]}
    body = await service.post_json(f"/v1/admin/apikeys/{b_key_id}/revoke", key_a, None, 404)
    assert_error(body)
    # B's key still works: A could not revoke it.
    assert (await service.get_json("/v1/admin/overview", key_b))["workspace_id"] == ws_b


async def test_min_cursor(service: Service) -> None:
    ws = uid("ws-")
    key = await service.issue_key(ws, ("admin:read",))
    head = await service.app[STORE].head()
    body = await service.get_json("/v1/admin/conversations", key, min_cursor=service.sealed(head))
    assert body["total"] == 0
    point = decode_cursor(head)
    for refused, words in (
        ("garbage", "malformed cursor"),
        # The plain form, as `svc projections status` prints it: it would tell where the log
        # is, so the API takes only sealed ones, and says where this one came from.
        (head, "plain form, which the service's own tools print"),
        ("c1_____________________w", "its API no longer takes"),
        # Sealed, yet never issued: waiting for the read models to reach it would only time
        # out (a 503).
        (service.sealed(encode_cursor(LogPoint(point.tx, point.position + 1_000_000))), "ahead"),
    ):
        error = await service.get_json("/v1/admin/overview", key, 400, min_cursor=refused)
        assert_error(error, "invalid_cursor")
        assert error["error"]["message"].startswith("min_cursor: "), error
        assert words in error["error"]["message"], error
        # What to do is a read's, not a feed's (QA finding: "start=latest" is no parameter
        # of a read).
        assert "start" not in error["error"]["message"], error
        if words != "ahead":
            assert "leave min_cursor out" in error["error"]["message"], error


async def test_a_key_cannot_mint_a_key_with_admin_scopes_it_lacks(service: Service) -> None:
    ws = uid("ws-")
    writer = await service.issue_key(ws, ("admin:write",))
    for scopes in (["*"], ["admin:read"]):
        refused = await service.post_json(
            "/v1/admin/apikeys", writer, {"name": "up", "scopes": scopes}, 403
        )
        assert refused["error"]["code"] == "insufficient_scope"
    chat_only = await service.post_json(
        "/v1/admin/apikeys", writer, {"name": "chat", "scopes": ["chat"]}, 201
    )
    assert chat_only["scopes"] == ["chat"]


async def test_a_refused_field_is_named_with_the_projects_own_message(service: Service) -> None:
    admin = await service.issue_key(uid("ws-"), ("admin:write",))
    body = {"name": "x", "scopes": ["root"]}
    error = (await service.post_json("/v1/admin/apikeys", admin, body, 400))["error"]
    assert error["message"].startswith("invalid request: scopes: unknown scope 'root'; the")
    # A key pasted as a scope is not said back (QA finding).
    body = {"name": "x", "scopes": [admin]}
    error = (await service.post_json("/v1/admin/apikeys", admin, body, 400))["error"]
    assert admin not in error["message"] and "not repeated" in error["message"], error
