"""The whole service (gateway.app.create_app plus gateway.identity.routes.add_routes) on a real
loopback TCP site over the test's PostgreSQL, with helpers to bootstrap keys and users."""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator, Iterator, Mapping, Sequence
from contextlib import asynccontextmanager, contextmanager
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

import aiohttp
from aiohttp import web

from actors.workspace import workspace_key
from gateway.app import create_app
from gateway.auth import generate_key, hash_key
from gateway.bootstrap import ensure_workspace
from gateway.identity.authn import identify
from gateway.identity.roles import require_access
from gateway.identity.routes import add_routes
from gateway.settings import Settings
from gateway.state import PROJECTIONS, RUNTIME
from schemas.workspace import IssueApiKey

WHOAMI = "/test/identity/whoami"
GUARDED = "/test/identity/guarded/{domain}"
WS = "default"


def uid(prefix: str = "") -> str:
    return prefix + uuid.uuid4().hex[:10]


def settings_for(database_url: str, **env: str) -> Settings:
    return Settings({"SVC_DATABASE_URL": database_url, **env})


async def whoami(request: web.Request) -> web.Response:
    p = await identify(request)
    return web.json_response(
        {
            "workspace_id": p.workspace_id,
            "user_id": p.user_id,
            "scopes": sorted(p.scopes),
            "auth": p.attributes.get("auth"),
        }
    )


async def guarded(request: web.Request) -> web.Response:
    """Reads need read, writes need write on the path's domain: an admin endpoint stand-in."""
    p = await identify(request)
    require_access(p, request.match_info["domain"], "read" if request.method == "GET" else "write")
    return web.json_response({"ok": True})


def test_routes(app: web.Application) -> None:
    app.router.add_get(WHOAMI, whoami)
    app.router.add_route("*", GUARDED, guarded)


@dataclass
class Running:
    app: web.Application
    base: str
    http: aiohttp.ClientSession

    def url(self, path: str) -> str:
        return self.base + path

    async def request(
        self,
        method: str,
        path: str,
        key: str | None = None,
        *,
        session: aiohttp.ClientSession | None = None,
        **kw: Any,
    ) -> tuple[int, Any, Mapping[str, str]]:
        headers = dict(kw.pop("headers", {}))
        if key is not None:
            headers["Authorization"] = f"Bearer {key}"
        client = session or self.http
        async with client.request(method, self.url(path), headers=headers, **kw) as resp:
            text = await resp.text()
            try:
                body: Any = await resp.json(content_type=None)
            except ValueError:
                body = text
            return resp.status, body, resp.headers

    async def issue_key(self, workspace_id: str = WS, scopes: Sequence[str] = ("*",)) -> str:
        runtime = self.app[RUNTIME]
        await ensure_workspace(runtime, workspace_id)
        key = generate_key()
        command = IssueApiKey(
            command_id=uid("cmd-"),
            workspace_id=workspace_id,
            key_id=uid("key_"),
            name="test",
            key_hash=hash_key(key),
            prefix=key[:8],
            scopes=tuple(scopes),
            at=datetime.now(UTC),
        )
        outcome = await runtime.ask(workspace_key(workspace_id), command)
        assert await self.app[PROJECTIONS].wait_for(outcome.cursor, 10.0)
        return key

    async def issue_user_key(
        self, admin_key: str, user_id: str, scopes: Sequence[str], name: str = "personal"
    ) -> dict[str, Any]:
        """A key that belongs to `user_id` (POST /v1/admin/users/{id}/apikeys): the answer."""
        body = {"name": name, "scopes": list(scopes)}
        path = f"/v1/admin/users/{user_id}/apikeys"
        status, issued, _ = await self.request("POST", path, admin_key, json=body)
        assert status == 201, issued
        return dict(issued)

    async def create_user(
        self, key: str, user_name: str, password: str | None = None, roles: Sequence[str] = ()
    ) -> dict[str, Any]:
        body: dict[str, Any] = {"user_name": user_name, "roles": list(roles)}
        if password is not None:
            body["password"] = password
        status, out, _ = await self.request("POST", "/v1/admin/users", key, json=body)
        assert status == 201, out
        return dict(out)

    async def login(
        self, user_name: str, password: str, **extra: Any
    ) -> tuple[int, Any, aiohttp.ClientSession]:
        """Log in with a fresh cookie jar (unsafe=True: the site is an IP address)."""
        jar = aiohttp.CookieJar(unsafe=True)
        session = aiohttp.ClientSession(cookie_jar=jar)
        status, body, _ = await self.request(
            "POST",
            "/v1/admin/auth/login",
            session=session,
            json={"username": user_name, "password": password, **extra},
        )
        return status, body, session


@asynccontextmanager
async def running(settings: Settings) -> AsyncIterator[Running]:
    app = create_app(settings, extra_routes=(add_routes, test_routes))
    runner = web.AppRunner(app, shutdown_timeout=5.0)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = runner.addresses[0][1]
    try:
        async with aiohttp.ClientSession(cookie_jar=aiohttp.DummyCookieJar()) as http:
            yield Running(app, f"http://127.0.0.1:{port}", http)
    finally:
        await runner.cleanup()


@contextmanager
def asks_failing(ident: Any, command_type: type, error: Exception) -> Iterator[None]:
    """While the block runs, `ident.ask` raises `error` for a command of `command_type`
    (the database away a moment, a read model that did not catch up) and runs the others."""
    ask = ident.ask

    async def failing(actor: Any, command: Any) -> Any:
        if isinstance(command, command_type):
            raise error
        return await ask(actor, command)

    ident.ask = failing
    try:
        yield
    finally:
        ident.ask = ask
