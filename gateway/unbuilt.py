"""The interface's endpoints this build does not serve: 501, not 404.

The spec lists endpoints of capabilities this build does not have yet (inbound channels,
plugins, device pairing, MCP, A2A, media). A client calling one gets 501 `not_built`,
naming the capability, where a 404 would have it hunt for a typo in its path. The admin
paths want the credential and rights of every admin route first (401, 403), and /v1/mcp a
key with the mcp scope (401 without, as the spec says); the others answer anyone, telling
nothing the published interface does not. A 501 carries `x-should-retry: false`, and is
not logged as a server's fault. A method the spec
does not give such a path is a 405, as on any route. docs/gateway-platform.md lists them.
They are left out of the OpenAPI document, which describes what the service does.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable

from aiohttp import web

from gateway.admin_common import READ, WRITE, acting
from gateway.auth import authenticate, require_scope
from gateway.openapi import REGISTRY
from schemas.errors import FeatureDisabled

UNBUILT: tuple[tuple[str, str, str], ...] = (
    ("GET", "/v1/admin/channels", "inbound channels"),
    ("POST", "/v1/admin/modules/upload", "modules and plugins"),
    ("POST", "/v1/pairing/redeem", "device pairing"),
    ("POST", "/v1/pairing/device/validate", "device pairing"),
    ("POST", "/v1/mcp", "the MCP server"),
    ("GET", "/.well-known/agent.json", "A2A"),
    ("POST", "/a2a/message", "A2A"),
    ("PUT", "/v1/media/{id}/content", "media"),
    ("GET", "/v1/files/{id}", "media and files"),
)
"""(method, path, capability) of each endpoint of the spec's interface not served here."""


def _refusal(
    method: str, path: str, capability: str
) -> Callable[[web.Request], Awaitable[web.StreamResponse]]:
    message = (
        f"{method} {path} is part of the interface, but {capability} is not in this build of "
        "SVC yet (docs/gateway-platform.md lists what is not)"
    )

    async def refuse(request: web.Request) -> web.StreamResponse:
        if path.startswith("/v1/admin/"):
            await acting(request, READ if method == "GET" else WRITE)
        elif path == "/v1/mcp":
            require_scope(await authenticate(request), "mcp")
        raise FeatureDisabled(message, code="not_built")

    return refuse


def add_routes(app: web.Application) -> None:
    for method, path, capability in UNBUILT:
        # No HEAD beside a GET: there is nothing to describe.
        app.router.add_route(method, path, _refusal(method, path, capability))
        REGISTRY.unserved.add((method, path))
