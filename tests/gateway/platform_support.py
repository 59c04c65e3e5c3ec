"""Shared by the platform tests: the whole service (create_app) on a real loopback TCP site over
the session's PostgreSQL, and keys issued through the workspace actor."""

from __future__ import annotations

import asyncio
import logging
import re
import socket
import time
import uuid
from collections.abc import AsyncIterator, Mapping, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import aiohttp
import orjson
from aiohttp import web
from multidict import CIMultiDict

from actors.workspace import workspace_key
from eventstore import PostgresEventStore
from eventstore.records import NewEvent
from gateway.app import RouteInstaller, create_app
from gateway.auth import authenticate, generate_key, hash_key
from gateway.bootstrap import ensure_workspace
from gateway.http_server import GatewayRunner
from gateway.settings import Settings
from gateway.state import PROJECTIONS, RUNTIME
from schemas.workspace import IssueApiKey, RevokeApiKey

WHOAMI = "/test/whoami"
BOOM = "/test/boom"
ECHO = "/test/echo"
STORE_BOOM = "/test/store-boom"
NAMED_BOOM = "/test/boom/{name}"
BROKEN_STREAM = "/test/broken-stream"


def uid(prefix: str = "") -> str:
    return prefix + uuid.uuid4().hex[:10]


async def stop_the_api_keys_model(store: PostgresEventStore) -> None:
    """Append an event the `api_keys` read model cannot apply (its data does not fit its
    schema): that read model stops there, as on a poison event."""
    await store.append(
        uid("workspace:"),
        [NewEvent("workspace.api_key_issued", {"workspace_id": "x"}, 1)],
        expected_version=0,
        command_id=uid("cmd-"),
        workspace_id=uid("ws-"),
    )


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


async def wait_healthy(base: str, server: asyncio.subprocess.Process) -> None:
    """Poll `svc serve` (a subprocess) until /healthz answers; fail if it exits first."""
    async with aiohttp.ClientSession() as http:
        for _ in range(600):
            assert server.returncode is None, "svc serve exited early"
            try:
                async with http.get(base + "/healthz") as resp:
                    if resp.status == 200:
                        return
            except aiohttp.ClientError:
                pass
            await asyncio.sleep(0.1)
    raise AssertionError("svc serve did not become healthy")


async def serving_url(server: asyncio.subprocess.Process, log_path: Path, offset: int = 0) -> str:
    """The base URL of `svc serve` started on `SVC_GATEWAY_ADDR=127.0.0.1:0` with its output
    in `log_path` (from byte `offset` on), read from its "svc listening on" line, once
    /healthz answers. A port picked beforehand (bound, closed, reused) could be taken by
    another test worker's server in between."""
    async with asyncio.timeout(180):
        while True:
            assert server.returncode is None, "svc serve exited early"
            text = (await asyncio.to_thread(log_path.read_bytes))[offset:]
            if found := re.search(rb"svc listening on 127\.0\.0\.1:(\d+)", text):
                break
            await asyncio.sleep(0.05)
    base = f"http://127.0.0.1:{int(found.group(1))}"
    await wait_healthy(base, server)
    return base


async def access_logged(records: Sequence[logging.LogRecord], needle: str) -> None:
    """Until the access log has a line naming `needle`: aiohttp writes it once the request's
    handler has returned and its answer was sent or found undeliverable, the positive sign a
    test needs before it checks that nothing else (an error line, a counter) followed."""
    async with asyncio.timeout(10):
        while True:
            lines = (r.getMessage() for r in records if r.name == "aiohttp.access")
            if any(needle in line for line in lines):
                return
            await asyncio.sleep(0.02)


def settings_for(database_url: str, **env: str) -> Settings:
    return Settings({"SVC_DATABASE_URL": database_url, **env})


async def whoami(request: web.Request) -> web.Response:
    principal = await authenticate(request)
    return web.json_response(
        {"workspace_id": principal.workspace_id, "scopes": sorted(principal.scopes)}
    )


async def boom(request: web.Request) -> web.Response:
    raise RuntimeError("kaboom: an unexpected failure")


async def store_boom(request: web.Request) -> web.Response:
    from eventstore.errors import StoreError

    raise StoreError("event store query failed (invalid input for $1: 'hunter2-param')")


async def echo(request: web.Request) -> web.Response:
    from pydantic import BaseModel, Field

    from gateway.errors import read_json

    class Body(BaseModel):
        name: str = Field(min_length=1)
        count: int = Field(ge=0)

    body = await read_json(request, Body)
    return web.json_response(body.model_dump())


async def broken_stream(request: web.Request) -> web.StreamResponse:
    """A stream that fails after its first frame went out."""
    response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
    await response.prepare(request)
    await response.write(b"data: one\n\n")
    raise RuntimeError("kaboom: a failure in mid-stream")


def test_routes(app: web.Application) -> None:
    app.router.add_get(WHOAMI, whoami)
    app.router.add_get(BOOM, boom)
    app.router.add_get(NAMED_BOOM, boom)
    app.router.add_get(BROKEN_STREAM, broken_stream)
    app.router.add_post(ECHO, echo)
    app.router.add_get(STORE_BOOM, store_boom)


@dataclass
class Running:
    app: web.Application
    runner: GatewayRunner
    base: str
    http: aiohttp.ClientSession

    def url(self, path: str) -> str:
        return self.base + path

    async def request(
        self, method: str, path: str, key: str | None = None, **kw: Any
    ) -> tuple[int, Any, Mapping[str, str]]:
        headers = CIMultiDict(kw.pop("headers", {}))  # a header may come twice
        if key is not None:
            headers["Authorization"] = f"Bearer {key}"
        async with self.http.request(method, self.url(path), headers=headers, **kw) as resp:
            text = await resp.text()
            try:
                body: Any = await resp.json(content_type=None)
            except ValueError:
                body = text
            return resp.status, body, resp.headers

    async def issue_key(
        self,
        workspace_id: str,
        scopes: Sequence[str] = ("*",),
        rate_limit_rpm: int | None = None,
    ) -> tuple[str, str]:
        return await issue_key(self.app, workspace_id, scopes, rate_limit_rpm)


async def issue_key(
    app: web.Application,
    workspace_id: str,
    scopes: Sequence[str] = ("*",),
    rate_limit_rpm: int | None = None,
) -> tuple[str, str]:
    """(key, key_id), usable as soon as this returns (the read model has applied it)."""
    runtime = app[RUNTIME]
    await ensure_workspace(runtime, workspace_id)
    key, key_id = generate_key(), uid("key_")
    command = IssueApiKey(
        command_id=uid("cmd-"),
        workspace_id=workspace_id,
        key_id=key_id,
        name="test",
        key_hash=hash_key(key),
        prefix=key[:8],
        scopes=tuple(scopes),
        rate_limit_rpm=rate_limit_rpm,
        at=datetime.now(UTC),
    )
    outcome = await runtime.ask(workspace_key(workspace_id), command)
    assert await app[PROJECTIONS].wait_for(outcome.cursor, 10.0)
    return key, key_id


async def revoke_key(app: web.Application, workspace_id: str, key_id: str) -> None:
    command = RevokeApiKey(
        command_id=uid("cmd-"), workspace_id=workspace_id, key_id=key_id, at=datetime.now(UTC)
    )
    outcome = await app[RUNTIME].ask(workspace_key(workspace_id), command)
    assert await app[PROJECTIONS].wait_for(outcome.cursor, 10.0)


@asynccontextmanager
async def running(
    settings: Settings, extra_routes: Sequence[RouteInstaller] = (test_routes,)
) -> AsyncIterator[Running]:
    app = create_app(settings, extra_routes=extra_routes)
    runner = GatewayRunner(app, shutdown_timeout=5.0)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = runner.addresses[0][1]
    try:
        async with aiohttp.ClientSession() as http:
            yield Running(app, runner, f"http://127.0.0.1:{port}", http)
    finally:
        await runner.cleanup()


async def clear_of_minute_boundary(margin_s: float = 8.0) -> None:
    """Rate-limit windows are epoch minutes: start a burst well inside one (not an assertion
    on timing, just a guard so a burst does not straddle two windows)."""
    into = time.time() % 60
    if into > 60 - margin_s:
        await asyncio.sleep(60 - into + 0.5)


class StallingUpstream:
    """An OpenAI-compatible model server that never finishes an answer: a JSON call gets
    nothing, a streaming call its first chunk. Its handlers end when the test leaves."""

    def __init__(self, model: str = "stub-model") -> None:
        self.model = model
        self.calls = 0
        self._called = asyncio.Event()
        self._release = asyncio.Event()
        self._runner: web.AppRunner | None = None
        self.base_url = ""

    async def chat(self, request: web.Request) -> web.StreamResponse:
        self.calls += 1
        self._called.set()
        body = await request.json()
        if not body.get("stream"):
            await self._release.wait()
            raise web.HTTPServiceUnavailable()
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        chunk = {
            "id": "chatcmpl-stall",
            "object": "chat.completion.chunk",
            "created": int(time.time()),
            "model": self.model,
            "choices": [
                {
                    "index": 0,
                    "delta": {"role": "assistant", "content": "Hel"},
                    "finish_reason": None,
                }
            ],
        }
        await resp.write(b"data: " + orjson.dumps(chunk) + b"\n\n")
        await self._release.wait()
        return resp

    def release(self) -> None:
        """End the answers: a JSON call gets 503, a stream ends without finishing."""
        self._release.set()

    async def until_calls(self, calls: int) -> None:
        """Wait until the turns have reached the model, so they are in flight."""
        async with asyncio.timeout(30):
            while self.calls < calls:
                self._called.clear()
                await self._called.wait()

    @asynccontextmanager
    async def running(self) -> AsyncIterator[StallingUpstream]:
        app = web.Application()
        app.router.add_post("/v1/chat/completions", self.chat)
        self._runner = web.AppRunner(app, access_log=None)
        await self._runner.setup()
        site = web.TCPSite(self._runner, "127.0.0.1", 0)
        await site.start()
        self.base_url = f"http://127.0.0.1:{self._runner.addresses[0][1]}/v1"
        try:
            yield self
        finally:
            self._release.set()
            await self._runner.cleanup()
