"""`add_routes(app)`: every identity endpoint, and the identity subsystem's lifetime.

Installing the routes also appends `identity_ctx` to the app's cleanup contexts, so it must be
called after the platform's context is registered (gateway.app.create_app does that first).
"""

from __future__ import annotations

from aiohttp import web
from pydantic import BaseModel

from gateway.identity import admin, login
from gateway.identity.oauth import OAuthErrorBody, TokenRequestForm, TokenResponse, token_endpoint
from gateway.identity.saml import METADATA_CONTENT_TYPE, SamlLoginQuery, add_saml_routes
from gateway.identity.scim import CONTENT_TYPE as SCIM_CONTENT_TYPE
from gateway.identity.scim import PREFIX as SCIM_PREFIX
from gateway.identity.scim import ScimListQuery, ScimReadQuery, add_scim_routes
from gateway.identity.service import identity_ctx
from gateway.openapi import IDEMPOTENCY_KEY, document
from schemas import identity_api as views
from schemas.admin import ApiKeyCreate
from schemas.scim_api import (
    ScimErrorBody,
    ScimListResponse,
    ScimPatchOp,
    ScimSearchRequest,
    ScimUser,
)

ADMIN = "/v1/admin"
AUTH_TAG = "Auth & SSO"
SCIM_TAG = "SCIM"
SECURITY_TAG = "Security & governance"

TOKEN_ROUTE = ("POST", "/v1/oauth/token")
"""Described on its own: a form body and RFC 6749 errors, which `ROUTE_DOCS` cannot say."""

_Doc = tuple[str, str, str, str, type[BaseModel] | None, str, int]
"""method, path, summary, tag, request model, auth ("bearer"/"none"), success status"""

ROUTE_DOCS: tuple[_Doc, ...] = (
    (
        "POST",
        f"{ADMIN}/auth/login",
        "Admin login: starts a session (cookie)",
        AUTH_TAG,
        login.LoginRequest,
        "none",
        200,
    ),
    ("POST", f"{ADMIN}/auth/logout", "Ends the admin session", AUTH_TAG, None, "bearer", 200),
    ("GET", f"{ADMIN}/auth/session", "Who is signed in", AUTH_TAG, None, "bearer", 200),
    (
        "POST",
        f"{ADMIN}/auth/totp/enrol",
        "Starts TOTP enrolment (secret shown once); needs the password one signs in with",
        AUTH_TAG,
        login.TotpEnrolmentRequest,
        "bearer",
        200,
    ),
    (
        "POST",
        f"{ADMIN}/auth/totp/verify",
        "Confirms TOTP enrolment",
        AUTH_TAG,
        login.TotpCode,
        "bearer",
        200,
    ),
    ("GET", f"{ADMIN}/users", "Lists users", SECURITY_TAG, None, "bearer", 200),
    ("POST", f"{ADMIN}/users", "Creates a user", SECURITY_TAG, admin.NewUser, "bearer", 201),
    ("GET", f"{ADMIN}/users/{{id}}", "Reads a user", SECURITY_TAG, None, "bearer", 200),
    (
        "PATCH",
        f"{ADMIN}/users/{{id}}",
        "Updates a user",
        SECURITY_TAG,
        admin.UserPatch,
        "bearer",
        200,
    ),
    ("DELETE", f"{ADMIN}/users/{{id}}", "Deprovisions a user", SECURITY_TAG, None, "bearer", 204),
    (
        "PUT",
        f"{ADMIN}/users/{{id}}/password",
        "Sets a user's password",
        SECURITY_TAG,
        admin.PasswordBody,
        "bearer",
        204,
    ),
    (
        "DELETE",
        f"{ADMIN}/users/{{id}}/totp",
        "Removes a user's TOTP second factor and ends their sessions",
        SECURITY_TAG,
        None,
        "bearer",
        200,
    ),
    (
        "POST",
        f"{ADMIN}/users/{{id}}/roles",
        "Binds a role",
        SECURITY_TAG,
        admin.RoleBody,
        "bearer",
        200,
    ),
    (
        "POST",
        f"{ADMIN}/users/{{id}}/apikeys",
        "Issues a user's API key (shown once)",
        SECURITY_TAG,
        ApiKeyCreate,
        "bearer",
        201,
    ),
    (
        "DELETE",
        f"{ADMIN}/users/{{id}}/roles/{{role}}",
        "Unbinds a role",
        SECURITY_TAG,
        None,
        "bearer",
        200,
    ),
    ("GET", f"{ADMIN}/roles", "Lists built-in and custom roles", SECURITY_TAG, None, "bearer", 200),
    (
        "POST",
        f"{ADMIN}/roles",
        "Defines a custom role",
        SECURITY_TAG,
        admin.CustomRoleBody,
        "bearer",
        201,
    ),
    (
        "POST",
        f"{ADMIN}/scim/token",
        "Issues, rotates or revokes the SCIM token (shown once)",
        AUTH_TAG,
        admin.ScimTokenBody,
        "bearer",
        201,
    ),
    (
        "POST",
        f"{ADMIN}/oauth/clients",
        "Registers an OAuth client (secret shown once)",
        AUTH_TAG,
        admin.OAuthClientBody,
        "bearer",
        201,
    ),
    (
        "GET",
        f"{ADMIN}/oauth/clients",
        "Lists the workspace's OAuth clients (never a secret)",
        AUTH_TAG,
        None,
        "bearer",
        200,
    ),
    (
        "DELETE",
        f"{ADMIN}/oauth/clients/{{id}}",
        "Revokes an OAuth client",
        AUTH_TAG,
        None,
        "bearer",
        204,
    ),
    ("GET", f"{ADMIN}/audit", "The security audit log", SECURITY_TAG, None, "bearer", 200),
    (
        "PUT",
        f"{ADMIN}/identity/secrets/{{scope}}/{{name}}",
        "Sets an SSO secret (write-only)",
        SECURITY_TAG,
        admin.SecretBody,
        "bearer",
        204,
    ),
    ("GET", "/saml/metadata", "SAML service-provider metadata", AUTH_TAG, None, "none", 200),
    (
        "GET",
        "/saml/login",
        "Starts a SAML login (redirect to the IdP)",
        AUTH_TAG,
        None,
        "none",
        302,
    ),
    ("POST", "/saml/acs", "SAML assertion consumer (HTTP-POST)", AUTH_TAG, None, "none", 303),
)

RESPONSES: dict[tuple[str, str], type[BaseModel]] = {
    ("POST", f"{ADMIN}/auth/login"): views.LoginSession,
    ("POST", f"{ADMIN}/auth/logout"): views.LoggedOut,
    ("GET", f"{ADMIN}/auth/session"): views.SessionInfo,
    ("POST", f"{ADMIN}/auth/totp/enrol"): views.TotpEnrolment,
    ("POST", f"{ADMIN}/auth/totp/verify"): views.TotpEnrolled,
    ("GET", f"{ADMIN}/users"): views.UserPage,
    ("POST", f"{ADMIN}/users"): views.UserView,
    ("GET", f"{ADMIN}/users/{{id}}"): views.UserView,
    ("PATCH", f"{ADMIN}/users/{{id}}"): views.UserView,
    ("DELETE", f"{ADMIN}/users/{{id}}/totp"): views.UserView,
    ("POST", f"{ADMIN}/users/{{id}}/roles"): views.UserView,
    ("DELETE", f"{ADMIN}/users/{{id}}/roles/{{role}}"): views.UserView,
    ("POST", f"{ADMIN}/users/{{id}}/apikeys"): views.IssuedUserKey,
    ("GET", f"{ADMIN}/roles"): views.RoleList,
    ("POST", f"{ADMIN}/roles"): views.RoleView,
    ("POST", f"{ADMIN}/scim/token"): views.IssuedScimToken,
    ("POST", f"{ADMIN}/oauth/clients"): views.IssuedOAuthClient,
    ("GET", f"{ADMIN}/oauth/clients"): views.OAuthClientPage,
    ("GET", f"{ADMIN}/audit"): views.AuditPage,
}
"""The JSON body each route answers with on success (schemas/identity_api.py); the routes
not named here answer 204, a redirect, or XML (SAML metadata)."""

OTHER_RESPONSES: dict[tuple[str, str], tuple[tuple[int, type[BaseModel]], ...]] = {
    ("POST", f"{ADMIN}/scim/token"): ((200, views.ScimTokenRevoked),),
}
"""(status, body) of the other successful answers of a route, beside the one in RESPONSES."""

QUERIES: dict[tuple[str, str], type[BaseModel]] = {
    ("GET", f"{ADMIN}/users"): admin.UserListQuery,
    ("GET", f"{ADMIN}/audit"): admin.AuditQuery,
    ("GET", f"{ADMIN}/oauth/clients"): admin.OAuthClientListQuery,
    ("GET", "/saml/login"): SamlLoginQuery,
}
"""The query parameters of the routes that take any."""

IDEMPOTENT: frozenset[tuple[str, str]] = frozenset(
    {
        ("POST", f"{ADMIN}/auth/logout"),
        ("POST", f"{ADMIN}/auth/totp/verify"),
        ("POST", f"{ADMIN}/users"),
        ("PATCH", f"{ADMIN}/users/{{id}}"),
        ("DELETE", f"{ADMIN}/users/{{id}}"),
        ("DELETE", f"{ADMIN}/users/{{id}}/totp"),
        ("POST", f"{ADMIN}/users/{{id}}/roles"),
        ("DELETE", f"{ADMIN}/users/{{id}}/roles/{{role}}"),
        ("POST", f"{ADMIN}/users/{{id}}/apikeys"),
        ("POST", f"{ADMIN}/roles"),
        ("POST", f"{ADMIN}/scim/token"),
        ("POST", f"{ADMIN}/oauth/clients"),
        ("DELETE", f"{ADMIN}/oauth/clients/{{id}}"),
    }
)
"""The writes whose command id is the request's Idempotency-Key (gateway/identity/common.py)."""

SCIM_QUERIES: dict[tuple[str, str], type[BaseModel]] = {
    ("GET", "/Users"): ScimListQuery,
    ("GET", "/Users/{id}"): ScimReadQuery,
}

SAML_METADATA = ("GET", "/saml/metadata")
JSON = "application/json"

SCIM_DOCS: tuple[tuple[str, str, str], ...] = (
    ("GET", "/ServiceProviderConfig", "SCIM service provider configuration"),
    ("GET", "/ResourceTypes", "SCIM resource types"),
    ("GET", "/ResourceTypes/{id}", "A SCIM resource type"),
    ("GET", "/Schemas", "SCIM schemas"),
    ("GET", "/Schemas/{id}", "A SCIM schema"),
    ("GET", "/Users", "Lists SCIM users (filter, startIndex, count)"),
    ("POST", "/Users", "Creates a SCIM user"),
    ("POST", "/Users/.search", "Searches SCIM users"),
    ("POST", "/.search", "Searches SCIM resources"),
    ("GET", "/Users/{id}", "Reads a SCIM user"),
    ("PUT", "/Users/{id}", "Replaces a SCIM user"),
    ("PATCH", "/Users/{id}", "Patches a SCIM user"),
    ("DELETE", "/Users/{id}", "Deprovisions a SCIM user"),
)


SCIM_BODIES: dict[tuple[str, str], tuple[type[BaseModel] | None, type[BaseModel] | None]] = {
    ("GET", "/Users"): (None, ScimListResponse),
    ("POST", "/Users"): (ScimUser, ScimUser),
    ("POST", "/Users/.search"): (ScimSearchRequest, ScimListResponse),
    ("POST", "/.search"): (ScimSearchRequest, ScimListResponse),
    ("GET", "/Users/{id}"): (None, ScimUser),
    ("PUT", "/Users/{id}"): (ScimUser, ScimUser),
    ("PATCH", "/Users/{id}"): (ScimPatchOp, ScimUser),
}
"""(request, response) of the SCIM routes that have them, as RFC 7643 and 7644 shape them."""


def _extra_statuses(path: str) -> tuple[int, ...]:
    """Beyond those of every route: a route open to all (auth "none") may still refuse the
    credentials it is given (401) and meet the database down (503)."""
    if path.endswith("/auth/login"):
        return (401, 429, 503)  # bad credentials; the login throttle
    if path == "/saml/acs":
        return (401, 501, 503)  # a response refused; SVC_SAML_ENABLED off
    if path.startswith("/saml/"):
        return (501, 503)
    return ()


def document_routes() -> None:
    """Describe every identity route for the OpenAPI document (gateway/openapi.py)."""
    for method, path, summary, tag, request, auth, status in ROUTE_DOCS:
        document(
            method,
            path,
            summary=summary,
            tag=tag,
            request=request,
            response=RESPONSES.get((method, path)),
            query=QUERIES.get((method, path)),
            request_headers=(IDEMPOTENCY_KEY,) if (method, path) in IDEMPOTENT else (),
            content_type=METADATA_CONTENT_TYPE if (method, path) == SAML_METADATA else JSON,
            auth=auth,
            response_status=status,
            extra_statuses=_extra_statuses(path),
            other_responses=OTHER_RESPONSES.get((method, path), ()),
        )
    document(
        *TOKEN_ROUTE,
        summary="OAuth 2.0 token endpoint (client credentials, RFC 6749 section 4.4): client "
        "authentication by HTTP Basic or in the form; errors in RFC 6749's own shape",
        tag=AUTH_TAG,
        request=TokenRequestForm,
        response=TokenResponse,
        auth="none",
        error=OAuthErrorBody,
        form_request=True,
        extra_statuses=(401, 503),
    )
    for method, path, summary in SCIM_DOCS:
        request, response = SCIM_BODIES.get((method, path), (None, None))
        document(
            method,
            SCIM_PREFIX + path,
            summary=summary,
            tag=SCIM_TAG,
            request=request,
            response=response,
            query=SCIM_QUERIES.get((method, path)),
            response_status=201
            if method == "POST" and path == "/Users"
            else (204 if method == "DELETE" else 200),
            content_type=SCIM_CONTENT_TYPE,
            error=ScimErrorBody,
            extra_statuses=(409,) if method in ("POST", "PUT", "PATCH") else (),
        )


def add_routes(app: web.Application) -> None:
    app.cleanup_ctx.append(identity_ctx)
    document_routes()
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
    r.add_delete(f"{ADMIN}/users/{{id}}/totp", admin.reset_totp)
    r.add_post(f"{ADMIN}/users/{{id}}/roles", admin.bind_role)
    r.add_post(f"{ADMIN}/users/{{id}}/apikeys", admin.issue_user_key)
    r.add_delete(f"{ADMIN}/users/{{id}}/roles/{{role}}", admin.unbind_role)
    r.add_get(f"{ADMIN}/roles", admin.list_roles)
    r.add_post(f"{ADMIN}/roles", admin.define_role)
    r.add_post(f"{ADMIN}/scim/token", admin.scim_token)
    r.add_post(f"{ADMIN}/oauth/clients", admin.register_client)
    r.add_get(f"{ADMIN}/oauth/clients", admin.list_clients)
    r.add_delete(f"{ADMIN}/oauth/clients/{{id}}", admin.revoke_client)
    r.add_get(f"{ADMIN}/audit", admin.audit_log)
    r.add_put(f"{ADMIN}/identity/secrets/{{scope}}/{{name}}", admin.put_secret)
    r.add_post("/v1/oauth/token", token_endpoint)
    add_scim_routes(app)
    add_saml_routes(app)
