"""Who may read the SSE feeds, for how long, and from where: the rights each feed needs, open
feeds closed once their key is revoked or expires, and cursors this log never issued."""

from __future__ import annotations

import asyncio
from datetime import timedelta
from typing import Any

import aiohttp
import pytest
from test_admin_support import Frame, Service, SseReader, now, open_feed, service, uid

from eventstore.cursor import LogPoint, decode_cursor, encode_cursor
from gateway import feeds
from gateway.auth import RECHECK
from gateway.state import DATABASE, SETTINGS_SERVICE, STORE

__all__ = ["service"]

pytestmark = pytest.mark.filterwarnings("ignore::asyncpg.InterfaceWarning")

EVENTS = "/v1/events/stream"
WEB = "/v1/web/stream"
KEYS = "/v1/admin/apikeys"


async def new_key(svc: Service, admin: str, scopes: list[str], **fields: Any) -> tuple[str, str]:
    """A key issued through the admin API, as a client would: (its id, its text)."""
    body = {"name": uid("k-"), "scopes": scopes, **fields}
    issued = await svc.post_json(KEYS, admin, body, status=201)
    return issued["id"], issued["key"]


async def revoke(svc: Service, admin: str, key_id: str) -> None:
    await svc.post_json(f"{KEYS}/{key_id}/revoke", admin, None)


async def until_closed(
    resp: aiohttp.ClientResponse, reader: SseReader, wait_s: float = 20.0
) -> tuple[list[Frame], Frame]:
    """Events up to the feed's final frame, and that frame; the stream must end after it.
    Fails if that takes over `wait_s` (heartbeats do not count as progress). The response is
    closed either way."""
    events: list[Frame] = []
    try:
        async with asyncio.timeout(wait_s):
            while True:
                frame = await reader.frame()
                assert frame is not None, "the feed ended without its final frame"
                if frame.event in ("feed_error", "shutdown"):
                    break
                if frame.is_event:
                    events.append(frame)
            assert await reader.frame() is None, "something was sent after the final frame"
    finally:
        resp.close()
    return events, frame


async def new_workspace(svc: Service) -> tuple[str, str]:
    """A fresh workspace and a `*` key of it: (workspace id, key)."""
    ws = uid("ws-")
    return ws, await svc.issue_key(ws)


def fast_sweeps(svc: Service, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(svc.app[feeds.FEED_HUB], "tick_s", 0.1)


# -- rights -----------------------------------------------------------------------------------


@pytest.mark.parametrize("path", [EVENTS, WEB])
@pytest.mark.parametrize("scopes", [["chat"], ["mcp"], ["admin:write"]])
async def test_keys_without_read_rights_are_refused(
    service: Service, path: str, scopes: list[str]
) -> None:
    _, admin = await new_workspace(service)
    _, key = await new_key(service, admin, scopes)
    resp = await service.get(path, key, start="latest")
    assert resp.status == 403
    assert resp.headers["Content-Type"].startswith("application/json")
    assert (await resp.json())["error"]["code"] == "insufficient_scope"


@pytest.mark.parametrize("path", [EVENTS, WEB])
async def test_a_read_key_gets_the_feed(service: Service, path: str) -> None:
    ws, admin = await new_workspace(service)
    _, key = await new_key(service, admin, ["admin:read"])
    resp, reader = await open_feed(service, path, key, start="latest")
    await reader.frame()  # retry
    cid = await service.start_conversation(ws, "visible to readers")
    (frame,) = await reader.events(1)
    resp.close()
    assert frame.event == "conversation.started"
    assert frame.json()["stream_id"] == f"conversation:{cid}"


# -- credentials checked while a feed is open -------------------------------------------------


@pytest.mark.parametrize("path", [EVENTS, WEB])
async def test_revoking_a_key_closes_its_open_feeds(
    service: Service, monkeypatch: pytest.MonkeyPatch, path: str
) -> None:
    fast_sweeps(service, monkeypatch)
    ws, admin = await new_workspace(service)
    key_id, key = await new_key(service, admin, ["admin:read"])
    resp, reader = await open_feed(service, path, key, start="latest")
    other, other_reader = await open_feed(service, path, admin, start="latest")
    await service.start_conversation(ws, "before the revocation")
    (seen,) = await reader.events(1)

    await revoke(service, admin, key_id)
    events, final = await until_closed(resp, reader)
    body = final.json()
    assert final.event == "feed_error"
    assert body["error"]["code"] == "unauthorized"
    assert body["error"]["type"] == "authentication_error"
    delivered = [seen, *events]
    # Its cursor is the newest point it consumed: the last event sent, or on the web feed a
    # later event it does not carry (the revocation itself).
    assert final.id == body["cursor"]
    opened = [service.opened(cursor) for cursor in (body["cursor"], delivered[-1].id or "")]
    assert decode_cursor(opened[0]) >= decode_cursor(opened[1])

    # The admin's feed is untouched; what the revoked key missed, it would be refused.
    await service.start_conversation(ws, "after the revocation")
    frames = await other_reader.events(len(delivered) + 1)
    other.close()
    assert [f.id for f in frames[: len(delivered)]] == [f.id for f in delivered]
    assert "after the revocation" in frames[-1].data
    refused = await service.get(path, key, cursor=body["cursor"])
    refused.close()
    assert refused.status == 401


async def test_a_local_revocation_closes_feeds_at_once(
    service: Service, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The sweeps are made too far off to close it: the revocation itself (the
    # authenticator's forget_key) asks for the check, so the feed closes without one.
    hub = service.app[feeds.FEED_HUB]
    monkeypatch.setattr(hub, "tick_s", 600.0)
    _, admin = await new_workspace(service)
    key_id, key = await new_key(service, admin, ["*"])
    resp, reader = await open_feed(service, EVENTS, key, start="latest")
    await reader.frame()
    await revoke(service, admin, key_id)
    _, final = await until_closed(resp, reader)
    assert final.event == "feed_error" and final.json()["error"]["code"] == "unauthorized"
    assert hub.unauthorized_total == 1


async def test_a_slow_check_does_not_hold_back_another_feeds_revocation(
    service: Service, monkeypatch: pytest.MonkeyPatch
) -> None:
    """One credential whose check hangs (an identity provider that does not answer, say):
    the other feeds' checks go on in the next rounds, so a revoked key's feed still closes
    within a few seconds, not when the slow check ends."""
    fast_sweeps(service, monkeypatch)
    hub = service.app[feeds.FEED_HUB]
    _, admin = await new_workspace(service)
    _, slow_key = await new_key(service, admin, ["admin:read"])
    key_id, key = await new_key(service, admin, ["admin:read"])
    slow_resp, slow_reader = await open_feed(service, EVENTS, slow_key, start="latest")
    resp, reader = await open_feed(service, EVENTS, key, start="latest")
    await slow_reader.frame()
    await reader.frame()
    hanging = asyncio.Event()

    async def hang() -> None:
        hanging.set()
        await asyncio.sleep(60)

    (slow_conn,) = [
        conn
        for conns in hub._by_ws.values()
        for conn in conns
        if f"Bearer {slow_key}" in str(conn.credential.key)
    ]
    slow_conn.credential = feeds.Credential(slow_conn.credential.key, hang)
    async with asyncio.timeout(10):
        await hanging.wait()  # a sweep's check of it now hangs
    await revoke(service, admin, key_id)
    _, final = await until_closed(resp, reader, 8.0)
    assert final.json()["error"]["code"] == "unauthorized"
    slow_resp.close()


async def feed_of_a_read_key(service: Service) -> tuple[Any, str, Any, Any, Any]:
    """An open feed of a fresh admin:read key: its workspace's admin key, the key's id, the
    response, its reader (past the first frame) and the hub's connection for it."""
    hub = service.app[feeds.FEED_HUB]
    _, admin = await new_workspace(service)
    key_id, key = await new_key(service, admin, ["admin:read"])
    resp, reader = await open_feed(service, EVENTS, key, start="latest")
    await reader.frame()
    (conn,) = [c for conns in hub._by_ws.values() for c in conns if key in str(c.credential.key)]
    return admin, key_id, resp, reader, conn


async def test_a_check_that_never_ends_is_given_up_and_its_credential_checked_again(
    service: Service, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A check that never returns is cancelled after `check_timeout_s`; the credential then
    takes part in later rounds again, so its revocation still closes the feed."""
    fast_sweeps(service, monkeypatch)
    hub = service.app[feeds.FEED_HUB]
    monkeypatch.setattr(hub, "check_timeout_s", 0.3)
    admin, key_id, resp, reader, conn = await feed_of_a_read_key(service)
    real_check = conn.credential.check
    hanging = asyncio.Event()

    async def never_ends_once() -> None:
        conn.credential = feeds.Credential(conn.credential.key, real_check)
        hanging.set()
        await asyncio.Event().wait()

    conn.credential = feeds.Credential(conn.credential.key, never_ends_once)
    async with asyncio.timeout(10):
        await hanging.wait()
    await revoke(service, admin, key_id)
    _, final = await until_closed(resp, reader, 8.0)
    assert final.json()["error"]["code"] == "unauthorized"


async def test_a_revocation_during_a_running_check_gets_a_check_after_it(
    service: Service, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A local revocation asks for a check while one of the same credential still runs, one
    that read the state before the revocation: a further check follows it, without waiting
    for the next sweep (made too far off to help here)."""
    hub = service.app[feeds.FEED_HUB]
    monkeypatch.setattr(hub, "tick_s", 600.0)
    monkeypatch.setattr(hub, "recheck_round_s", 0.1)  # the round stops waiting for it
    admin, key_id, resp, reader, conn = await feed_of_a_read_key(service)
    real_check = conn.credential.check
    started, release = asyncio.Event(), asyncio.Event()

    async def stale_once() -> None:
        conn.credential = feeds.Credential(conn.credential.key, real_check)
        started.set()
        await release.wait()  # answers "still valid": it read before the revocation

    conn.credential = feeds.Credential(conn.credential.key, stale_once)
    hub.recheck_soon()
    async with asyncio.timeout(10):
        await started.wait()
    await asyncio.sleep(0.3)  # past the round's wait: that round has ended
    await revoke(service, admin, key_id)  # asks for a check: this credential's still runs
    release.set()
    _, final = await until_closed(resp, reader, 10.0)
    assert final.json()["error"]["code"] == "unauthorized"


async def test_an_expiring_key_closes_its_feed(
    service: Service, monkeypatch: pytest.MonkeyPatch
) -> None:
    fast_sweeps(service, monkeypatch)
    _, admin = await new_workspace(service)
    # Long enough for the issue and the feed's opening to land before it, on a loaded host.
    expires = now() + timedelta(seconds=8)
    _, key = await new_key(service, admin, ["admin:read"], expires_at=expires.isoformat())
    resp, reader = await open_feed(service, EVENTS, key)
    _, final = await until_closed(resp, reader)
    assert now() >= expires
    assert final.json()["error"]["code"] == "unauthorized"
    assert "expired" in final.json()["error"]["message"]


async def test_deactivating_the_owning_user_closes_the_feed(
    service: Service, monkeypatch: pytest.MonkeyPatch
) -> None:
    fast_sweeps(service, monkeypatch)
    _, admin = await new_workspace(service)
    # A member: a user's key reads only what the user's roles let it read.
    account = {"user_name": uid("u-"), "roles": ["member"]}
    user = await service.post_json("/v1/admin/users", admin, account, status=201)
    issued = await service.post_json(
        f"/v1/admin/users/{user['id']}/apikeys",
        admin,
        {"name": "feed", "scopes": ["admin:read"]},
        status=201,
    )
    resp, reader = await open_feed(service, WEB, issued["key"], start="latest")
    await reader.frame()
    patched = await service.http.patch(
        service.url(f"/v1/admin/users/{user['id']}"),
        headers=service.auth(admin),
        json={"active": False},
    )
    assert patched.status == 200, await patched.text()
    _, final = await until_closed(resp, reader)
    assert final.event == "feed_error" and final.json()["error"]["code"] == "unauthorized"


async def sign_in_member(
    svc: Service, browser: aiohttp.ClientSession, ws: str, admin: str
) -> tuple[str, str]:
    """A user with the read-only `member` role, signed in on `browser`: (its id, CSRF token)."""
    name, password = uid("u-"), "a long enough passphrase"
    user = {"user_name": name, "password": password, "roles": ["member"]}
    created = await svc.post_json("/v1/admin/users", admin, user, status=201)
    login = {"username": name, "password": password, "workspace_id": ws}
    signed_in = await browser.post(svc.url("/v1/admin/auth/login"), json=login)
    assert signed_in.status == 200, await signed_in.text()
    return created["id"], (await signed_in.json())["csrf_token"]


def browser() -> aiohttp.ClientSession:
    return aiohttp.ClientSession(cookie_jar=aiohttp.CookieJar(unsafe=True))


async def open_session_feed(
    service: Service, session: aiohttp.ClientSession, path: str
) -> tuple[aiohttp.ClientResponse, SseReader]:
    """A feed opened with the session's cookie, past its first frame (the retry advice)."""
    resp = await session.get(service.url(path), params={"start": "latest"})
    assert resp.status == 200, await resp.text()
    reader = SseReader(resp)
    await reader.frame()
    return resp, reader


async def test_logging_out_closes_a_session_feed(
    service: Service, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The web UI's own credential: a session cookie of a user whose role reads conversations.
    fast_sweeps(service, monkeypatch)
    ws, admin = await new_workspace(service)
    async with browser() as session:
        _, csrf = await sign_in_member(service, session, ws, admin)
        resp, reader = await open_session_feed(service, session, WEB)
        await service.start_conversation(ws, "seen by the member")
        (seen,) = await reader.events(1)
        logout = await session.post(
            service.url("/v1/admin/auth/logout"), headers={"X-CSRF-Token": csrf}
        )
        assert logout.status == 200, await logout.text()
        _, final = await until_closed(resp, reader)
    assert seen.event == "conversation.started"
    assert final.event == "feed_error" and final.json()["error"]["code"] == "unauthorized"


async def test_losing_the_right_closes_a_session_feed(
    service: Service, monkeypatch: pytest.MonkeyPatch
) -> None:
    fast_sweeps(service, monkeypatch)
    ws, admin = await new_workspace(service)
    async with browser() as session:
        user_id, _ = await sign_in_member(service, session, ws, admin)
        resp, reader = await open_session_feed(service, session, EVENTS)
        unbound = await service.http.delete(
            service.url(f"/v1/admin/users/{user_id}/roles/member"), headers=service.auth(admin)
        )
        assert unbound.status == 200, await unbound.text()
        _, final = await until_closed(resp, reader)
        again = await session.get(service.url(EVENTS), params={"start": "latest"})
        again.close()
    error = final.json()["error"]
    assert final.event == "feed_error"
    assert error["code"] == "insufficient_scope" and error["type"] == "permission_error"
    assert again.status == 403


async def test_valid_keys_keep_their_feeds_across_checks(
    service: Service, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Checks of an open feed do not count against the key's rate, and a key over its rate
    # would still be a valid key: the feed it opened stays open.
    fast_sweeps(service, monkeypatch)
    ws, admin = await new_workspace(service)
    _, key = await new_key(service, admin, ["admin:read"], rate_limit_rpm=2)
    checks = []
    authorize = feeds._authorize

    async def counted(request: Any, spec: Any) -> Any:
        checks.append(request.get(RECHECK, False))
        return await authorize(request, spec)

    monkeypatch.setattr(feeds, "_authorize", counted)
    resp, reader = await open_feed(service, EVENTS, key, start="latest")
    await reader.frame()
    async with asyncio.timeout(10):
        while True:  # more checks than the key's rate allows a minute
            if sum(checks) >= 3:
                break
            await asyncio.sleep(0.05)
    last = await service.append_pings(ws, 1)
    (frame,) = await reader.events(1)
    resp.close()
    assert frame.id == last
    assert service.app[feeds.FEED_HUB].unauthorized_total == 0
    second = await service.get("/v1/admin/overview", key)  # the key's second request
    second.close()
    assert second.status == 200


# -- cursors the log never issued -------------------------------------------------------------


@pytest.mark.parametrize("path", [EVENTS, WEB])
async def test_a_cursor_ahead_of_the_log_is_a_400(service: Service, path: str) -> None:
    """Sealed with this deployment's key yet ahead of its log: what a database restored from
    an older backup would meet. A feed from there would wait forever."""
    _, key = await new_workspace(service)
    head = decode_cursor(await service.app[STORE].head())
    ahead = [
        service.sealed(encode_cursor(LogPoint(10**12, 1))),
        service.sealed(encode_cursor(LogPoint(head.tx, head.position + 1_000_000))),
    ]
    for cursor in ahead:
        for headers in ({"Last-Event-ID": cursor}, {}):
            params = {} if headers else {"cursor": cursor}
            resp = await service.http.get(
                service.url(path), headers=service.auth(key, **headers), params=params
            )
            assert resp.status == 400, cursor
            error = (await resp.json())["error"]
            assert error["code"] == "invalid_cursor"
            assert "ahead of the log" in error["message"]
            # Named, for an EventSource's Last-Event-ID silently wins over ?cursor=.
            source = "the Last-Event-ID header: " if headers else "cursor: "
            assert error["message"].startswith(source), error["message"]


@pytest.mark.parametrize("path", [EVENTS, WEB])
async def test_a_plain_cursor_is_refused_so_it_cannot_probe_the_log(
    service: Service, path: str
) -> None:
    """The unsealed `(tx, position)` form is refused whether it is behind the log's head or
    ahead of it: the two answers would differ otherwise, and a tenant could find the head
    (the instance's event count) by bisection."""
    _, key = await new_workspace(service)
    head = decode_cursor(await service.app[STORE].head())
    messages = set()
    for point in (LogPoint(1, 1), head, LogPoint(head.tx, head.position + 1_000_000)):
        resp = await service.http.get(
            service.url(path), headers=service.auth(key), params={"cursor": encode_cursor(point)}
        )
        assert resp.status == 400
        error = (await resp.json())["error"]
        assert error["code"] == "invalid_cursor"
        messages.add(error["message"])
    (message,) = messages
    assert "its API no longer takes" in message and "start=latest" in message


async def test_a_fresh_cursor_behind_a_running_transaction_is_accepted(service: Service) -> None:
    # An older transaction still running holds xmin back: the event just appended is not yet
    # visible to readers, so its cursor is ahead of the tailer and of the visible head. It
    # was issued by this log, so a feed from it is valid and goes on after it.
    ws, key = await new_workspace(service)
    async with service.app[DATABASE].transaction() as holder:
        await holder.fetchval("SELECT pg_current_xact_id()")
        fresh = await service.append_pings(ws, 1)
        head = await service.app[STORE].head()
        assert decode_cursor(service.opened(fresh)) > decode_cursor(head)
        resp, reader = await open_feed(service, EVENTS, key, cursor=fresh)
    sentinel = await service.append_pings(ws, 1, kind="test.sentinel")
    (frame,) = await reader.events(1)
    resp.close()
    assert frame.id == sentinel


async def test_a_latest_start_tells_nothing_of_other_workspaces(service: Service) -> None:
    """Review finding: `start=latest` began at the instance's newest event, whose sealed
    cursor (the first frame's id) changed whenever any workspace wrote: a live signal of
    other tenants' activity. It begins at the workspace's own newest event, which misses
    none of the workspace's later events."""
    ws, key = await new_workspace(service)

    async def first_id(**params: str) -> str | None:
        resp, reader = await open_feed(service, EVENTS, key, **params)
        try:
            frame = await reader.frame()
        finally:
            resp.close()
        assert frame is not None
        return frame.id

    start = await first_id(start="latest")
    assert start is not None
    await service.issue_key(uid("ws-"))  # another workspace writes
    assert await first_id(start="latest") == start
    await service.issue_key(ws)  # this one writes
    resp, reader = await open_feed(service, EVENTS, key, last_event_id=start)
    try:
        frame = await reader.frame()
        while frame is not None and not frame.is_event:  # the start, heartbeats
            frame = await reader.frame()
    finally:
        resp.close()
    assert frame is not None and frame.event == "workspace.api_key_issued", frame
    assert await first_id(start="latest") != start


async def test_a_reconnection_gets_the_place_of_the_feed_it_dropped(
    service: Service, monkeypatch: pytest.MonkeyPatch
) -> None:
    """QA finding (a browser): a tab's connection dropped, its EventSource came back 3 s
    later, before the sweep had noticed the old feed gone, and got 429 too_many_feeds, after
    which an EventSource never tries again. The place of a feed whose socket is closed is
    given back to the owner asking for it."""
    hub = service.app[feeds.FEED_HUB]
    monkeypatch.setattr(hub, "_check", lambda conn, now: None)  # no sweep notices the close
    await service.app[SETTINGS_SERVICE].set("SVC_FEEDS_PER_OWNER", "1")
    _, admin = await new_workspace(service)
    _, key = await new_key(service, admin, ["admin:read"])
    dropped, reader = await open_feed(service, EVENTS, key, start="latest")
    first = await reader.frame()
    assert first is not None and first.event == "cursor"
    dropped.close()  # the socket closes; no sweep will notice it
    again, reader = await open_feed(service, EVENTS, key, last_event_id=first.id or "")
    try:
        frame = await reader.frame()
        assert frame is not None and frame.id == first.id
    finally:
        again.close()
        await service.app[SETTINGS_SERVICE].set("SVC_FEEDS_PER_OWNER", "32")


async def test_an_owner_holds_a_bounded_number_of_feeds(
    service: Service, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Review finding: nothing bounded the feeds one member could hold open, each with its
    socket, a page of history and a send buffer: a script could take the process's memory.
    Past the bound a feed is a 429 before it starts; another owner is not held back, and a
    place is free again once a feed closes."""
    fast_sweeps(service, monkeypatch)
    await service.app[SETTINGS_SERVICE].set("SVC_FEEDS_PER_OWNER", "2")  # a live setting
    _, admin = await new_workspace(service)
    _, key = await new_key(service, admin, ["admin:read"])
    opened = [await open_feed(service, EVENTS, key), await open_feed(service, WEB, key)]
    try:
        resp = await service.get(EVENTS, key)
        body = await resp.json()
        assert resp.status == 429 and body["error"]["code"] == "too_many_feeds", body
        assert "close one" in body["error"]["message"] and resp.headers["Retry-After"]
        other, _ = await open_feed(service, EVENTS, admin)  # another key: its own places
        other.close()
        opened.pop()[0].close()
        for _ in range(100):  # liveness bound: 10 s for the close to be noticed
            resp = await service.get(EVENTS, key)
            if resp.status == 200:
                break
            await resp.release()
            await asyncio.sleep(0.1)
        assert resp.status == 200
        resp.close()
        await service.app[SETTINGS_SERVICE].set("SVC_FEEDS_PER_OWNER", "0")  # no bound
        opened += [await open_feed(service, EVENTS, key) for _ in range(3)]
    finally:
        for resp, _ in opened:
            resp.close()
