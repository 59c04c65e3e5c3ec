"""Admin endpoints for instance settings (the HTTP twin of `svc settings`).

GET /v1/admin/settings, GET|PUT|DELETE /v1/admin/settings/{key}. Instance settings belong to
the whole instance, so only admin keys of the default workspace (SVC_DEFAULT_WORKSPACE_ID) may
use them. Secrets are never returned: listings show "********" or "unset".
"""

from __future__ import annotations

from aiohttp import web
from pydantic import BaseModel

from gateway.auth import authenticate, holds_owner_power, require_instance_admin
from gateway.errors import read_json, read_query, refuse_body
from gateway.identity.common import describe
from gateway.identity.roles import domain_for_path, require_access
from gateway.openapi import document
from gateway.state import SETTINGS_SERVICE, Principal
from schemas.admin import NoQuery
from schemas.errors import Forbidden
from schemas.settings import SetSettingRequest, SettingChangeResult, SettingList, SettingView


async def _admin(request: web.Request, scope: str) -> Principal:
    """The caller, allowed `scope` on instance settings."""
    principal = await authenticate(request)
    read_query(request, NoQuery)  # none of these routes takes a parameter
    # Keys pass by their admin:read/admin:write scopes; users by read/write on `settings`.
    writing = scope == "admin:write"
    require_access(principal, domain_for_path(request.path), "write" if writing else "read")
    require_instance_admin(principal, request, "instance settings")
    if writing and not holds_owner_power(principal):
        # Instance settings decide how everyone signs in (an OIDC issuer, the directory's role
        # mappings): an admin who could change them could sign in as the owner.
        raise Forbidden(
            "changing instance settings is an owner's (or a key of no user's)", code="owner_only"
        )
    return principal


def _json(model: BaseModel) -> web.Response:
    return web.Response(body=model.model_dump_json(), content_type="application/json")


async def list_settings(request: web.Request) -> web.Response:
    await _admin(request, "admin:read")
    return _json(request.app[SETTINGS_SERVICE].list())


async def get_setting(request: web.Request) -> web.Response:
    await _admin(request, "admin:read")
    return _json(request.app[SETTINGS_SERVICE].get(request.match_info["key"]))


async def put_setting(request: web.Request) -> web.Response:
    principal = await _admin(request, "admin:write")
    body = await read_json(request, SetSettingRequest)
    service = request.app[SETTINGS_SERVICE]
    return _json(await service.set(request.match_info["key"], body.value, describe(principal)))


async def delete_setting(request: web.Request) -> web.Response:
    principal = await _admin(request, "admin:write")
    await refuse_body(request)
    service = request.app[SETTINGS_SERVICE]
    return _json(await service.unset(request.match_info["key"], describe(principal)))


def add_routes(app: web.Application) -> None:
    base, one = "/v1/admin/settings", "/v1/admin/settings/{key}"
    app.router.add_get(base, list_settings)
    app.router.add_get(one, get_setting)
    app.router.add_put(one, put_setting)
    app.router.add_delete(one, delete_setting)
    tag = "Admin"
    document(
        "GET",
        base,
        summary="Every setting, secrets masked (admin:read)",
        tag=tag,
        response=SettingList,
    )
    document(
        "GET",
        one,
        summary="One setting and where its value comes from (admin:read)",
        tag=tag,
        response=SettingView,
    )
    document(
        "PUT",
        one,
        summary="Set a setting; says whether a restart is required (admin:write)",
        tag=tag,
        request=SetSettingRequest,
        response=SettingChangeResult,
    )
    document(
        "DELETE",
        one,
        summary="Unset a stored value (admin:write)",
        tag=tag,
        response=SettingChangeResult,
    )
