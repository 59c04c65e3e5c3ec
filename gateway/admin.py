"""The admin API under /v1/admin: its routes and their OpenAPI descriptions.

Reads come from the read models of the acting workspace (projections.queries, row-level
security per workspace) or, for a conversation's event history, from its stream in the store;
writes are commands to actors. Handlers live in one module per concept (admin_*.py); every
error is raised as a `schemas.errors` type and rendered by the error middleware.
See docs/admin-api.md.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable

from aiohttp import web
from pydantic import BaseModel

from gateway import admin_conversations, admin_history, admin_keys, admin_overview
from gateway.openapi import IDEMPOTENCY_KEY, document
from schemas.admin import (
    AdminRead,
    AnalyticsQuery,
    AnalyticsResponse,
    ApiKeyCreate,
    ApiKeyList,
    ApiKeyRecord,
    ConversationExport,
    ConversationHistory,
    ConversationList,
    ConversationListQuery,
    ConversationMessages,
    ExportQuery,
    HistoryQuery,
    KeyListQuery,
    MessagesQuery,
    NewApiKey,
    OverviewResponse,
    RevokedApiKey,
    TurnList,
    TurnsQuery,
)

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


def _get(
    app: web.Application,
    path: str,
    handler: Handler,
    *,
    summary: str,
    tag: str,
    query: type[BaseModel],
    response: type[BaseModel],
    content_type: str = "application/json",
    extra_statuses: tuple[int, ...] = (503,),
    other_content_types: tuple[str, ...] = (),
) -> None:
    app.router.add_get(path, handler)
    document(
        "GET",
        path,
        summary=summary,
        tag=tag,
        query=query,
        response=response,
        content_type=content_type,
        extra_statuses=extra_statuses,
        other_content_types=other_content_types,
    )


def add_routes(app: web.Application) -> None:
    _get(
        app,
        "/v1/admin/overview",
        admin_overview.overview,
        summary="Tenant counts and health (admin:read)",
        tag="Admin",
        query=AdminRead,
        response=OverviewResponse,
    )
    _get(
        app,
        "/v1/admin/analytics",
        admin_overview.analytics,
        summary="Usage analytics over a window, in hour or day buckets (admin:read)",
        tag="Analytics",
        query=AnalyticsQuery,
        response=AnalyticsResponse,
    )
    _get(
        app,
        "/v1/admin/conversations",
        admin_conversations.list_conversations,
        summary="Conversations, most recently updated first (admin:read)",
        tag="Conversations",
        query=ConversationListQuery,
        response=ConversationList,
    )
    _get(
        app,
        "/v1/admin/conversations/messages",
        admin_conversations.conversation_messages,
        summary="Messages of a conversation, oldest first (admin:read)",
        tag="Conversations",
        query=MessagesQuery,
        response=ConversationMessages,
    )
    _get(
        app,
        "/v1/admin/conversations/turns",
        admin_conversations.conversation_turns,
        summary="Recent turns with status, model, tokens, duration and error (admin:read)",
        tag="Conversations",
        query=TurnsQuery,
        response=TurnList,
    )
    _get(
        app,
        "/v1/admin/conversations/export",
        admin_conversations.export_conversation,
        summary="Download a conversation as Markdown (format=md) or JSON (admin:read)",
        tag="Conversations",
        query=ExportQuery,
        response=ConversationExport,
        other_content_types=("text/markdown",),
    )
    _get(
        app,
        "/v1/admin/conversations/events",
        admin_history.conversation_events,
        summary="A conversation's events and its state rebuilt at a version (admin:read)",
        tag="Conversations",
        query=HistoryQuery,
        response=ConversationHistory,
        extra_statuses=(),
    )
    _get(
        app,
        "/v1/admin/apikeys",
        admin_keys.list_keys,
        summary="API keys of the workspace; never the key or its hash (admin:read)",
        tag="Admin",
        query=KeyListQuery,
        response=ApiKeyList,
    )
    _get(
        app,
        "/v1/admin/apikeys/{key_id}",
        admin_keys.get_key,
        summary="One API key as the list shows it; never the key or its hash (admin:read)",
        tag="Admin",
        query=AdminRead,
        response=ApiKeyRecord,
    )
    app.router.add_post("/v1/admin/apikeys", admin_keys.issue_key)
    document(
        "POST",
        "/v1/admin/apikeys",
        summary="Issue an API key; the key is returned once (admin:write)",
        tag="Admin",
        request=ApiKeyCreate,
        response=NewApiKey,
        response_status=201,
        extra_statuses=(409,),
        request_headers=(IDEMPOTENCY_KEY,),
    )
    app.router.add_post("/v1/admin/apikeys/{key_id}/revoke", admin_keys.revoke_key)
    document(
        "POST",
        "/v1/admin/apikeys/{key_id}/revoke",
        summary="Revoke an API key (admin:write); 503 projection_lagging until the read "
        "models that authenticate keys apply it",
        tag="Admin",
        response=RevokedApiKey,
        extra_statuses=(409,),
        request_headers=(IDEMPOTENCY_KEY,),
    )
