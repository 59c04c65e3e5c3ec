"""Typed application state: every long-lived resource the handlers share, set by the one
composition root (gateway.app.create_app) and read by handlers through these keys."""

from __future__ import annotations

from dataclasses import dataclass, field

from aiohttp import web

# Concrete types are imported lazily by users of these keys to keep this module import-light;
# the composition root sets each key exactly once inside a cleanup_ctx.
SETTINGS: web.AppKey[object] = web.AppKey("svc_settings", object)
DATABASE: web.AppKey[object] = web.AppKey("svc_database", object)
STORE: web.AppKey[object] = web.AppKey("svc_store", object)
RUNTIME: web.AppKey[object] = web.AppKey("svc_runtime", object)
TAILER: web.AppKey[object] = web.AppKey("svc_tailer", object)


@dataclass(frozen=True, slots=True)
class Principal:
    """Who is acting: resolved by gateway.auth from a bearer key, static key or session."""

    workspace_id: str
    scopes: frozenset[str]
    key_id: str | None = None
    user_id: str | None = None
    rate_limit_rpm: int | None = None
    attributes: dict[str, str] = field(default_factory=dict)

    def allows(self, scope: str) -> bool:
        return "*" in self.scopes or scope in self.scopes
