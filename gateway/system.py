"""System endpoints: /healthz, /readyz, /v1/ping, /v1/time, /v1/client-log, /metrics,
/openapi.json and the /docs explorer. None of them needs a credential."""

from __future__ import annotations

import asyncio
import hmac
import logging
import re
import time
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from importlib import resources

import orjson
from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry
from pydantic import BaseModel

from actors.local import LocalRuntime
from actors.table import TableStats
from eventstore.db import Database, PoolStats
from gateway import openapi
from gateway.auth import InvalidCredential, authorization_header
from gateway.control_chars import json_visible, one_line
from gateway.errors import read_json
from gateway.metrics import GatewayCollector, build_version, render
from gateway.security import address_group, client_ip
from gateway.state import DATABASE, RUNTIME, SETTINGS, TAILER
from schemas.errors import PayloadTooLarge, RateLimited, Unauthorized, Unavailable
from schemas.redaction import REDACTED, redact
from schemas.system import (
    ClientLogAccepted,
    ClientLogBatch,
    ClientLogEntry,
    Health,
    Pong,
    Readiness,
    ServerTime,
)

log = logging.getLogger(__name__)
client_log = logging.getLogger("svc.client")

READY_TIMEOUT_S = 2.0
CLIENT_LOG_MAX_BYTES = 64 * 1024
CLIENT_LOG_PER_MINUTE = 60
_SECRET_NAME = re.compile(r"(?i)(pass|secret|token|key|auth|cookie|session|credential|dsn)")
_LEVELS = {"debug": 10, "info": 20, "warn": 30, "warning": 30, "error": 40}


BUSY_TRUSTED_S = 10.0
"""How recently a pooled connection's work must have ended for a probe that found every
connection lent to count the process as busy, not stuck on a frozen database."""


class ReadinessProbe:
    """Asks the database with a short timeout; no state but the last answer, so it recovers
    by itself as soon as the database answers again."""

    def __init__(self, timeout_s: float = READY_TIMEOUT_S) -> None:
        self.timeout_s = timeout_s
        self.ready = False
        self.reason = "not checked yet"
        self._checking: asyncio.Future[bool] | None = None

    async def check(self, db: Database | None) -> bool:
        """Whether the database answers. Calls that come while a check runs share its answer:
        a flood of probes (the endpoints need no key) borrows one connection, not one each."""
        if self._checking is None:
            self._checking = asyncio.ensure_future(self._check(db))
            self._checking.add_done_callback(self._checked)
        return await asyncio.shield(self._checking)

    def _checked(self, _done: asyncio.Future[bool]) -> None:
        self._checking = None

    async def _check(self, db: Database | None) -> bool:
        if db is None:
            self.ready, self.reason = False, "the database is not open yet"
            return False
        try:
            async with asyncio.timeout(self.timeout_s), db.acquire(stateless=True) as conn:
                try:
                    await conn.fetchval("SELECT 1")
                except asyncio.CancelledError:
                    # Out of time on a server that does not answer: handing the connection
                    # back would wait on it again (the pool's reset), so drop it instead.
                    conn.terminate()
                    raise
        except (TimeoutError, Exception) as exc:
            if (
                isinstance(exc, TimeoutError)
                and _saturated(db.pool_stats())
                and db.answered_within(BUSY_TRUSTED_S)
            ):
                # Every pooled connection is at work and their work still ends: the database
                # answers, this process is busy. Not ready would take every busy replica out
                # of the Service at once, turning load into an outage; its requests wait for
                # a connection instead. When none has ended for BUSY_TRUSTED_S, the connections
                # are stuck on a database that froze: not ready.
                self.ready, self.reason = True, "busy"
                return True
            self.ready, self.reason = False, _reason(exc)
            return False
        self.ready, self.reason = True, "ok"
        return True


def _saturated(stats: PoolStats) -> bool:
    return stats.size >= stats.max and stats.idle == 0


def _reason(exc: BaseException) -> str:
    if isinstance(exc, TimeoutError):
        return "the database did not answer in time"
    return type(exc).__name__


CLIENT_LOG_TRACKED = 10_000
"""Client addresses counted apart in one minute; beyond them, new ones share one count."""


class ClientLogLimiter:
    """In-process fixed-minute counter per client address (an IPv6 one by its /64, see
    `address_group`); client logs are best effort. Its table holds CLIENT_LOG_TRACKED
    addresses at most: a crowd of fresh addresses shares one count beyond that."""

    def __init__(self, per_minute: int = CLIENT_LOG_PER_MINUTE) -> None:
        self.per_minute = per_minute
        self._window = 0
        self._counts: dict[str, int] = {}

    def hit(self, ip: str) -> None:
        window = int(time.time() // 60)
        if window != self._window:
            self._window, self._counts = window, {}
        key = address_group(ip)
        if key not in self._counts and len(self._counts) >= CLIENT_LOG_TRACKED:
            key = "(others)"
        count = self._counts.get(key, 0) + 1
        self._counts[key] = count
        if count > self.per_minute:
            raise RateLimited(
                f"too many client-log requests: at most {self.per_minute} per minute",
                retry_after_s=60 - time.time() % 60,
            )


READINESS: web.AppKey[ReadinessProbe] = web.AppKey("svc_readiness", ReadinessProbe)
CLIENT_LOG_LIMITER: web.AppKey[ClientLogLimiter] = web.AppKey(
    "svc_client_log_limiter", ClientLogLimiter
)
METRICS_REGISTRY: web.AppKey[CollectorRegistry] = web.AppKey(
    "svc_metrics_registry", CollectorRegistry
)


@dataclass
class _OpenApiBody:
    """The OpenAPI document, serialised on first use. Building it renders every model's
    JSON schema (about 50 ms, on the event loop), and the routes it describes are fixed
    once the app serves, so it is built once per process rather than per request."""

    body: bytes | None = None


OPENAPI_BODY: web.AppKey[_OpenApiBody] = web.AppKey("svc_openapi_body", _OpenApiBody)


def json_response(model: BaseModel, status: int = 200) -> web.Response:
    return web.Response(
        status=status, body=model.model_dump_json(), content_type="application/json"
    )


async def healthz(request: web.Request) -> web.Response:
    """Liveness. A process whose log tailer has stopped is not alive in the sense that
    matters: its feeds get no live event again until it restarts, which is what a failed
    liveness probe brings (readiness would only take it out of service, for good)."""
    tailer = request.app.get(TAILER)
    if tailer is not None and not tailer.running:
        # Its reading task ended: no feed of this process would get another live event.
        raise Unavailable(
            "the log tailer has stopped (its error is in the log); restart the process",
            code="tailer_stopped",
        )
    return json_response(Health(version=build_version()))


async def readyz(request: web.Request) -> web.Response:
    probe = request.app[READINESS]
    if not await probe.check(request.app.get(DATABASE)):
        raise Unavailable(f"not ready: {probe.reason}", code="database_unavailable")
    return json_response(Readiness(database="busy" if probe.reason == "busy" else "ok"))


async def ping(request: web.Request) -> web.Response:
    return json_response(Pong())


async def server_time(request: web.Request) -> web.Response:
    now = time.time()
    return json_response(
        ServerTime(time=datetime.fromtimestamp(now, UTC), unix=now, unix_ms=int(now * 1000))
    )


def _log_entry(entry: ClientLogEntry, ip: str, secrets: Sequence[str]) -> None:
    context = {
        redact(k, secrets): REDACTED if _SECRET_NAME.search(k) else redact(str(v), secrets)
        for k, v in entry.context.items()
    }
    client_log.log(
        _LEVELS[entry.level],
        "client log from %s [%s]: %s %s",
        one_line(ip),  # from X-Forwarded-For behind a trusted proxy: the client's writing
        one_line(redact(entry.source or "-", secrets)),
        one_line(redact(entry.message, secrets)),
        # orjson escapes C0 controls but writes C1 controls and U+2028/9 as they are.
        json_visible(orjson.dumps(context).decode()) if context else "",
    )


async def ingest_client_log(request: web.Request) -> web.Response:
    ip = client_ip(request)
    request.app[CLIENT_LOG_LIMITER].hit(ip)
    if (request.content_length or 0) > CLIENT_LOG_MAX_BYTES:
        raise PayloadTooLarge(f"client-log bodies are limited to {CLIENT_LOG_MAX_BYTES} bytes")
    # A chunked body has no length to check first: it is cut off as it arrives.
    batch = await read_json(request, ClientLogBatch, max_bytes=CLIENT_LOG_MAX_BYTES)
    secrets = request.app[SETTINGS].secret_values()
    for entry in batch.entries:
        _log_entry(entry, ip, secrets)
    return json_response(ClientLogAccepted(accepted=len(batch.entries)), status=202)


async def metrics(request: web.Request) -> web.Response:
    _metrics_allowed(request)
    await request.app[READINESS].check(request.app.get(DATABASE))
    runtime = request.app.get(RUNTIME)
    hosts = {} if runtime is None else await runtime.host_stats()
    body = render(request.app[METRICS_REGISTRY], hosts)
    return web.Response(body=body, headers={"Content-Type": CONTENT_TYPE_LATEST})


def _metrics_allowed(request: web.Request) -> None:
    """With SVC_METRICS_TOKEN set, only a scraper sending it as its bearer token reads the
    metrics (compared in constant time); blank, /metrics is open, as Prometheus expects."""
    expected = request.app[SETTINGS].text("SVC_METRICS_TOKEN")
    if not expected:
        return
    scheme, _, token = authorization_header(request).partition(" ")
    given = token.strip().encode() if scheme.lower() == "bearer" else b""
    if not hmac.compare_digest(given, expected.encode()):
        message = (
            "/metrics needs the scraper's token: send Authorization: Bearer <SVC_METRICS_TOKEN>"
        )
        # A token sent and not good says so (RFC 6750 section 3), as an API key's refusal does.
        raise InvalidCredential(message) if given else Unauthorized(message)


async def openapi_json(request: web.Request) -> web.Response:
    cached = request.app[OPENAPI_BODY]
    if cached.body is None:
        cached.body = orjson.dumps(openapi.build_document(request.app, build_version()))
    return web.Response(body=cached.body, content_type="application/json")


def _asset(name: str) -> str:
    return resources.files("gateway.static").joinpath(name).read_text(encoding="utf-8")


async def docs_page(request: web.Request) -> web.Response:
    return web.Response(text=_asset("docs.html"), content_type="text/html")


async def docs_script(request: web.Request) -> web.Response:
    return web.Response(text=_asset("docs.js"), content_type="text/javascript")


async def docs_style(request: web.Request) -> web.Response:
    return web.Response(text=_asset("docs.css"), content_type="text/css")


def _pool_stats(app: web.Application) -> PoolStats | None:
    db = app.get(DATABASE)
    return None if db is None else db.pool_stats()


def setup_metrics(app: web.Application) -> None:
    registry = CollectorRegistry(auto_describe=True)
    probe = app[READINESS]

    def pool() -> PoolStats | None:
        return _pool_stats(app)

    def actors() -> TableStats | None:
        runtime = app.get(RUNTIME)
        return runtime.table.stats() if isinstance(runtime, LocalRuntime) else None

    registry.register(GatewayCollector(pool, lambda: probe.ready, actors))
    app[METRICS_REGISTRY] = registry


def _document_routes() -> None:
    doc = openapi.document
    doc(
        "GET",
        "/healthz",
        summary="Liveness and version (503 tailer_stopped once the log tailer has died)",
        tag="System",
        response=Health,
        auth="none",
        extra_statuses=(503,),
    )
    doc(
        "GET",
        "/readyz",
        summary="Readiness: checks the database (503 when down)",
        tag="System",
        response=Readiness,
        auth="none",
        extra_statuses=(503,),
    )
    doc("GET", "/v1/ping", summary="Reachability check", tag="System", response=Pong, auth="none")
    doc("GET", "/v1/time", summary="Server time", tag="System", response=ServerTime, auth="none")
    doc(
        "POST",
        "/v1/client-log",
        summary="Ingest client-side log events (size and rate limited)",
        tag="System",
        request=ClientLogBatch,
        response=ClientLogAccepted,
        auth="none",
        response_status=202,
        extra_statuses=(413, 429),
    )
    doc(
        "GET",
        "/metrics",
        summary="Prometheus text metrics (non-sensitive series only); with SVC_METRICS_TOKEN "
        "set, only for a bearer of that token",
        tag="System",
        auth="none",
        content_type="text/plain",
        extra_statuses=(401,),
    )
    doc("GET", "/openapi.json", summary="This OpenAPI 3.1 document", tag="System", auth="none")
    doc(
        "GET",
        "/docs",
        summary="Interactive API explorer",
        tag="System",
        auth="none",
        content_type="text/html",
    )
    for asset, kind in (("explorer.js", "text/javascript"), ("explorer.css", "text/css")):
        doc(
            "GET",
            f"/docs/{asset}",
            summary="Static asset of the API explorer",
            tag="System",
            auth="none",
            content_type=kind,
        )


def add_routes(app: web.Application) -> None:
    app[READINESS] = ReadinessProbe()
    app[CLIENT_LOG_LIMITER] = ClientLogLimiter()
    app[OPENAPI_BODY] = _OpenApiBody()
    setup_metrics(app)
    router = app.router
    router.add_get("/healthz", healthz)
    router.add_get("/readyz", readyz)
    router.add_get("/v1/ping", ping)
    router.add_get("/v1/time", server_time)
    router.add_post("/v1/client-log", ingest_client_log)
    router.add_get("/metrics", metrics)
    router.add_get("/openapi.json", openapi_json)
    router.add_get("/docs", docs_page)
    router.add_get("/docs/explorer.js", docs_script)
    router.add_get("/docs/explorer.css", docs_style)
    _document_routes()
