"""Shared by the feed and admin tests: the whole service (create_app) on loopback HTTP over the
embedded PostgreSQL, keys issued through the workspace actor, and a small SSE reader.

No tests live here; test_feeds*.py and test_admin*.py import what they need.
"""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import aiohttp
import orjson
import pytest
from aiohttp import web
from aiohttp.test_utils import TestServer

from actors.behaviour import CommandOutcome
from actors.conversation import conversation_key
from actors.workspace import workspace_key
from eventstore.records import NewEvent
from gateway.app import create_app
from gateway.auth import generate_key, hash_key
from gateway.bootstrap import ensure_workspace
from gateway.http_server import GatewayRunner
from gateway.settings import Settings
from gateway.state import CURSORS, PROJECTIONS, RUNTIME, STORE
from schemas.conversation import RenameConversation, RunTurn, StartConversation
from schemas.workspace import IssueApiKey

READ_TIMEOUT_S = 20.0


def now() -> datetime:
    return datetime.now(UTC)


def uid(prefix: str = "") -> str:
    return prefix + uuid.uuid4().hex[:12]


@dataclass
class Service:
    app: web.Application
    server: TestServer
    http: aiohttp.ClientSession
    keys: dict[str, str] = field(default_factory=dict)

    def url(self, path: str) -> str:
        return str(self.server.make_url(path))

    @staticmethod
    def auth(key: str, **headers: str) -> dict[str, str]:
        return {"Authorization": f"Bearer {key}", **headers}

    async def get(self, path: str, key: str, **params: Any) -> aiohttp.ClientResponse:
        clean = {k: str(v) for k, v in params.items() if v is not None}
        return await self.http.get(self.url(path), headers=self.auth(key), params=clean)

    async def get_json(self, path: str, key: str, status: int = 200, **params: Any) -> Any:
        resp = await self.get(path, key, **params)
        body = await resp.read()
        assert resp.status == status, body
        return orjson.loads(body)

    async def post_json(
        self, path: str, key: str, body: Any, status: int = 200, **headers: str
    ) -> Any:
        resp = await self.http.post(
            self.url(path), headers={**self.auth(key), **headers}, json=body
        )
        data = await resp.read()
        assert resp.status == status, data
        return orjson.loads(data)

    async def settle(self, cursor: str) -> None:
        assert await self.app[PROJECTIONS].wait_for(cursor, 10.0)

    def sealed(self, cursor: str) -> str:
        """An internal cursor as a response would carry it."""
        return self.app[CURSORS].seal(cursor)

    def opened(self, public: str) -> str:
        """A cursor a response carried, as the store's internal one."""
        return self.app[CURSORS].open(public)

    async def issue_key(self, workspace_id: str, scopes: tuple[str, ...] = ("*",)) -> str:
        await ensure_workspace(self.app[RUNTIME], workspace_id)
        key = generate_key()
        outcome = await self.app[RUNTIME].ask(
            workspace_key(workspace_id),
            IssueApiKey(
                command_id=uid("cmd-"),
                workspace_id=workspace_id,
                key_id=uid("key-"),
                name="test key",
                key_hash=hash_key(key),
                prefix=key[:8],
                scopes=scopes,
                at=now(),
            ),
        )
        assert isinstance(outcome, CommandOutcome)
        await self.settle(outcome.cursor)
        return key

    async def append_pings(
        self, workspace_id: str, count: int, *, kind: str = "test.ping", size: int = 0
    ) -> str:
        """Append `count` events of type `kind` to a fresh test stream; returns the last
        one's cursor as a response would carry it (sealed)."""
        stream = uid("test:")
        pad = "x" * size
        result = await self.app[STORE].append(
            stream,
            [NewEvent(kind, {"n": n, "pad": pad}) for n in range(count)],
            expected_version=0,
            command_id=uid("cmd-"),
            workspace_id=workspace_id,
        )
        return self.sealed(result.cursor)

    async def start_conversation(self, workspace_id: str, title: str | None = "hello") -> str:
        cid = uid("c-")
        outcome = await self.app[RUNTIME].ask(
            conversation_key(cid),
            StartConversation(
                command_id=uid("cmd-"), workspace_id=workspace_id, title=title, at=now()
            ),
        )
        await self.settle(outcome.cursor)
        return cid

    async def rename(self, workspace_id: str, cid: str, title: str) -> None:
        outcome = await self.app[RUNTIME].ask(
            conversation_key(cid),
            RenameConversation(
                command_id=uid("cmd-"), workspace_id=workspace_id, title=title, at=now()
            ),
        )
        await self.settle(outcome.cursor)

    async def run_turn(
        self, workspace_id: str, cid: str, text: str, command_id: str | None = None
    ) -> Any:
        result = await self.app[RUNTIME].ask(
            conversation_key(cid),
            RunTurn(
                command_id=command_id or uid("cmd-"),
                workspace_id=workspace_id,
                turn_id=uid("t-"),
                message_id=uid("m-"),
                model="svc-offline",
                messages=({"role": "user", "content": text},),
                at=now(),
            ),
        )
        if result.cursor:
            await self.settle(result.cursor)
        return result


class GatewayTestServer(TestServer):
    """aiohttp's TestServer serving through the gateway's own runner, as `svc serve` does. The
    difference that matters: TestServer cancels a handler whose client went away, the gateway
    does not (a turn's handler meets the closed connection and must take it quietly)."""

    async def _make_runner(self, **kwargs: Any) -> web.BaseRunner:
        kwargs["handler_cancellation"] = False
        return GatewayRunner(self.app, **kwargs)


async def start_service(database_url: str, data_dir: Path) -> Service:
    settings = Settings({"SVC_DATABASE_URL": database_url, "SVC_DATA_DIR": str(data_dir)})
    server = GatewayTestServer(create_app(settings), host="127.0.0.1")
    await server.start_server()
    http = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=None, sock_read=None))
    return Service(server.app, server, http)


@pytest.fixture
async def service(database_url: str, tmp_path: Path) -> AsyncIterator[Service]:
    svc = await start_service(database_url, tmp_path)
    try:
        yield svc
    finally:
        await svc.http.close()
        await svc.server.close()


# -- SSE --------------------------------------------------------------------------------------


@dataclass
class Frame:
    id: str | None = None
    event: str | None = None
    data: str = ""
    retry: int | None = None
    comment: str | None = None

    def json(self) -> Any:
        return orjson.loads(self.data)

    @property
    def is_event(self) -> bool:
        """An event of the log: not a comment, nor the feed's opening `cursor` frame."""
        return self.event not in (None, "cursor")


class SseReader:
    """Frames of an open event-stream response, one at a time."""

    def __init__(self, resp: aiohttp.ClientResponse) -> None:
        self.resp = resp

    async def frame(self, wait_s: float = READ_TIMEOUT_S) -> Frame | None:
        """The next frame; None at the end of the stream. A comment line before any field
        (a feed's heartbeat, which no blank line follows) is a frame of its own here."""
        async with asyncio.timeout(wait_s):
            frame, seen = Frame(), False
            data: list[str] = []
            while True:
                raw = await self.resp.content.readline()
                if not raw:
                    return None
                line = raw.decode().rstrip("\r\n")
                if line == "":
                    if seen:
                        frame.data = "\n".join(data)
                        return frame
                    continue
                name, _, value = line.partition(":")
                value = value[1:] if value.startswith(" ") else value
                if name == "" and not seen:
                    return Frame(comment=value)
                seen = True
                if name == "":
                    frame.comment = value
                elif name == "id":
                    frame.id = value
                elif name == "event":
                    frame.event = value
                elif name == "data":
                    data.append(value)
                elif name == "retry":
                    frame.retry = int(value)

    async def events(self, count: int, wait_s: float = READ_TIMEOUT_S) -> list[Frame]:
        """The next `count` event frames (comments and the opening `cursor` frame skipped)."""
        out: list[Frame] = []
        while len(out) < count:
            frame = await self.frame(wait_s)
            assert frame is not None, f"stream ended after {len(out)} of {count} events"
            if frame.is_event:
                out.append(frame)
        return out


async def open_feed(
    service: Service,
    path: str,
    key: str,
    *,
    last_event_id: str | None = None,
    **params: str,
) -> tuple[aiohttp.ClientResponse, SseReader]:
    headers = service.auth(key)
    if last_event_id is not None:
        headers["Last-Event-ID"] = last_event_id
    resp = await service.http.get(service.url(path), headers=headers, params=params)
    assert resp.status == 200, await resp.text()
    assert resp.headers["Content-Type"].startswith("text/event-stream")
    return resp, SseReader(resp)
