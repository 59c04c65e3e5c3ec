"""`add_routes(app)`: every identity endpoint, and the identity subsystem's lifetime.

Installing the routes also appends `identity_ctx` to the app's cleanup contexts, so it must be
called after the platform's context is registered (gateway.app.create_app does that first).
"""

from __future__ import annotations

from aiohttp import web

from gateway.identity import admin, login
from gateway.identity.oauth import token_endpoint
from gateway.identity.saml import add_saml_routes
from gateway.identity.scim import add_scim_routes
from gateway.identity.service import identity_ctx

ADMIN = "/v1/admin"


def add_routes(app: web.Application) -> None:
    app.cleanup_ctx.append(identity_ctx)
    r = app.router
    r.add_post(f"{ADMIN}/auth/login", login.login)
    r.add_post(f"{ADMIN}/auth/logout", login.logout)
    r.add_get(f"{ADMIN}/auth/session", login.current)
    r.add_post(f"{ADMIN}/auth/totp/enrol", login.totp_enrol)
    r.add_post(f"{ADMIN}/auth/totp/verify", login.totp_verify)
    r.add_get(f"{ADMIN}/users", admin.list_users_handler)
    r.add_post(f"{ADMIN}/users", admin.create_user)
    r.add_get(f"{ADMIN}/users/{{id}}", admin.get_user_handler)
    r.add_patch(f"{ADMIN}/users/{{id}}", admin.patch_user)
    r.add_delete(f"{ADMIN}/users/{{id}}", admin.delete_user)
    r.add_put(f"{ADMIN}/users/{{id}}/password", admin.put_password)
    r.add_post(f"{ADMIN}/users/{{id}}/roles", admin.bind_role)
    r.add_post(f"{ADMIN}/users/{{id}}/apikeys", admin.issue_user_key)
    r.add_delete(f"{ADMIN}/users/{{id}}/roles/{{role}}", admin.unbind_role)
    r.add_get(f"{ADMIN}/roles", admin.list_roles)
    r.add_post(f"{ADMIN}/roles", admin.define_role)
    r.add_post(f"{ADMIN}/scim/token", admin.scim_token)
    r.add_post(f"{ADMIN}/oauth/clients", admin.register_client)
    r.add_delete(f"{ADMIN}/oauth/clients/{{id}}", admin.revoke_client)
    r.add_get(f"{ADMIN}/audit", admin.audit_log)
    r.add_put(f"{ADMIN}/identity/secrets/{{scope}}/{{name}}", admin.put_secret)
    r.add_post("/v1/oauth/token", token_endpoint)
    add_scim_routes(app)
    add_saml_routes(app)
