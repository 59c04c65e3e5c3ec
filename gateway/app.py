"""The composition root: `create_app(settings)` wires the whole service into one aiohttp app.

Every long-lived resource is opened by a `cleanup_ctx` (gateway/bootstrap.py holds the order)
and published under a typed key of gateway/state.py. Middlewares, outermost first: tracing (only
with `SVC_OTEL_ENDPOINT`, gateway/telemetry.py), the error envelope, then transport security.
Routes: system endpoints, admin settings, chat, feeds, the admin API and identity (sessions,
SSO, SCIM, OAuth), each module's `add_routes`; identity's `identify` widens
`gateway.auth.authenticate` to sessions and OAuth/OIDC tokens.

Shutdown (aiohttp's runner, see gateway/cli.py): the listener stops accepting and idle
connections close; then the on_shutdown hooks, in order: the one budget of
`SVC_SHUTDOWN_GRACE_SEC` starts (if the signal did not start it already), feeds close with their
last cursor, and the actor runtime stops within what is left of the budget (turns still running
then are interrupted and recorded as failed). Only then does aiohttp drain the handlers, so a
handler waiting on an interrupted turn writes its 503 (or SSE error frame) instead of being
cancelled; aiohttp's own timeout (`HANDLER_DRAIN_S`) is a backstop for that last write. Last,
the platform closes in reverse order (projections flushed, store, database).
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable, Sequence

from aiohttp import web

from eventstore.db import Database
from gateway import admin, admin_agents, chat, feeds, settings_api, system, telemetry, unbuilt
from gateway.auth import IDENTIFY, Authenticator, KeyLookup, KeyRecord, add_rate_limit_headers
from gateway.bootstrap import open_platform
from gateway.errors import add_request_id, error_middleware, note_response_started
from gateway.feeds import FEED_HUB
from gateway.identity import routes as identity_routes
from gateway.identity.authn import identify
from gateway.security import add_security_headers, security_middleware
from gateway.settings import Settings
from gateway.shutdown import Shutdown
from gateway.state import (
    AUTH,
    CURSORS,
    DATABASE,
    MODEL_PROVIDERS,
    PROJECTIONS,
    RUNTIME,
    SETTINGS,
    SETTINGS_SERVICE,
    STORE,
    TAILER,
)
from projections import queries

SHUTDOWN: web.AppKey[Shutdown] = web.AppKey("svc_shutdown", Shutdown)
HANDLER_DRAIN_S = 5.0
"""aiohttp's shutdown timeout: once the runtime has stopped, handlers only write their last
bytes. aiohttp waits this long, then cancels a handler and waits as long again."""

RouteInstaller = Callable[[web.Application], None]
ROUTES: tuple[RouteInstaller, ...] = (
    system.add_routes,
    settings_api.add_routes,
    chat.add_routes,
    feeds.add_routes,
    admin.add_routes,
    admin_agents.add_routes,
    identity_routes.add_routes,  # after the platform's cleanup_ctx: it needs the store and runtime
    unbuilt.add_routes,
)


def key_lookup(db: Database) -> KeyLookup:
    async def find(key_hash: str) -> KeyRecord | None:
        found = await queries.find_api_key_by_hash(db, key_hash)
        if found is None:
            return None
        return KeyRecord(
            key_id=found.key_id,
            workspace_id=found.workspace_id,
            scopes=frozenset(found.scopes),
            rate_limit_rpm=found.rate_limit_rpm,
            expires_at=found.expires_at,
            revoked_at=found.revoked_at,
        )

    return find


async def platform_ctx(app: web.Application) -> AsyncIterator[None]:
    settings = app[SETTINGS]
    async with open_platform(settings) as platform:
        app[DATABASE] = platform.db
        app[STORE] = platform.store
        app[TAILER] = platform.tailer
        app[RUNTIME] = platform.runtime
        app[PROJECTIONS] = platform.projections
        app[MODEL_PROVIDERS] = platform.providers
        app[SETTINGS_SERVICE] = platform.settings_service
        app[AUTH] = Authenticator(settings, key_lookup(platform.db), platform.limiter)
        app[SHUTDOWN] = platform.shutdown
        app[CURSORS] = platform.cursors
        yield


async def begin_shutdown(app: web.Application) -> None:
    """The first on_shutdown hook: start the budget (unless the signal did) and count the
    feeds that the feeds module's hook, next, closes."""
    shutdown = app.get(SHUTDOWN)
    if shutdown is None:  # the platform never opened
        return
    shutdown.begin()
    if FEED_HUB in app:
        shutdown.report.feeds_closed = app[FEED_HUB].connection_count


async def stop_runtime(app: web.Application) -> None:
    """The last on_shutdown hook: in-flight turns get what is left of the budget, and their
    handlers an answer or a CommandInterrupted, before aiohttp drains the handlers."""
    shutdown = app.get(SHUTDOWN)
    if shutdown is not None:
        await shutdown.stop_runtime()


def create_app(
    settings: Settings, *, extra_routes: Sequence[RouteInstaller] = ()
) -> web.Application:
    """The service as one aiohttp application. `extra_routes` lets tests add handlers."""
    app = web.Application(
        middlewares=[error_middleware, security_middleware],
        client_max_size=settings.max_body_bytes,
    )
    app[SETTINGS] = settings
    app[IDENTIFY] = identify
    telemetry.install(app)  # first to open, last to close: spans of the shutdown get out
    app.cleanup_ctx.append(platform_ctx)
    app.on_response_prepare.append(note_response_started)
    app.on_response_prepare.append(add_request_id)
    app.on_response_prepare.append(add_security_headers)
    app.on_response_prepare.append(add_rate_limit_headers)
    app.on_shutdown.append(begin_shutdown)
    for install in (*ROUTES, *extra_routes):
        install(app)  # gateway/feeds.py adds the hook that closes the feeds
    app.on_shutdown.append(stop_runtime)
    return app
