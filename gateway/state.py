"""Typed application state: every long-lived resource the handlers share, set by the one
composition root (gateway.app.create_app) inside a cleanup_ctx and read through these keys."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from aiohttp import web

if TYPE_CHECKING:
    from actors.models.registry import ProviderSet
    from actors.runtime import ActorRuntime
    from eventstore.db import Database
    from eventstore.store import PostgresEventStore
    from eventstore.tailer import LogTailer
    from gateway.auth import Authenticator
    from gateway.cursor_seal import CursorSeal
    from gateway.settings import Settings, SettingsService
    from projections.runner import ProjectionRunner

SETTINGS: web.AppKey[Settings] = web.AppKey("svc_settings")
SETTINGS_SERVICE: web.AppKey[SettingsService] = web.AppKey("svc_settings_service")
DATABASE: web.AppKey[Database] = web.AppKey("svc_database")
STORE: web.AppKey[PostgresEventStore] = web.AppKey("svc_store")
RUNTIME: web.AppKey[ActorRuntime] = web.AppKey("svc_runtime")
TAILER: web.AppKey[LogTailer] = web.AppKey("svc_tailer")
"""The process's one log tailer (the store's `subscribe` fans out from it)."""
CURSORS: web.AppKey[CursorSeal] = web.AppKey("svc_cursors")
"""Seals every cursor a response carries and opens every cursor a request brings."""
AUTH: web.AppKey[Authenticator] = web.AppKey("svc_auth")
PROJECTIONS: web.AppKey[ProjectionRunner] = web.AppKey("svc_projections")
MODEL_PROVIDERS: web.AppKey[ProviderSet] = web.AppKey("svc_model_providers")
"""The model providers the conversation actor uses, routed by model name."""


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

    def owner(self) -> str:
        """Who is behind the credential, within its workspace: its user (through any of
        their keys or sessions), else its API key, else its OAuth client, else the static
        compatibility key's holders (one credential, so one owner)."""
        if self.user_id:
            return f"user/{self.user_id}"
        if self.key_id:
            return f"key/{self.key_id}"
        client_id = self.attributes.get("client_id")
        if client_id:
            return f"oauth/{client_id}"
        return "static"
