"""Response bodies of the identity routes (admin login, users, roles, credentials, audit), as
the OpenAPI document describes them (gateway/identity/routes.py). The handlers build these
bodies themselves; tests/identity/test_identity_responses.py holds every body a route
answers against its model here, so a field added on one side and not the other fails.

Request bodies live beside their handlers (gateway/identity/admin.py, login.py), the SCIM
resources follow RFC 7643, and the OAuth token endpoint's bodies are in oauth.py."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import AwareDatetime, BaseModel, ConfigDict, Field

from schemas.admin import NewApiKey
from schemas.identity import Access


class _Body(BaseModel):
    model_config = ConfigDict(extra="forbid")


class SessionUser(_Body):
    id: str
    user_name: str
    workspace_id: str
    roles: list[str]


class LoginSession(_Body):
    """A new admin session. The session and CSRF cookies are set as well; a browser sends
    `csrf_token` back in `X-CSRF-Token` with every unsafe request."""

    user: SessionUser
    session_id: str
    csrf_token: str
    expires_at: AwareDatetime
    second_factor: bool = Field(description="whether a TOTP code was checked")
    totp_enrolment_required: bool = Field(
        description="SVC_REQUIRE_2FA is on and the user has no TOTP yet"
    )
    totp_enrolment_url: str | None = Field(
        default=None, description="present when enrolment is required"
    )


class LoggedOut(_Body):
    logged_out: bool


AuthMethod = Literal["session", "oidc", "oauth", "api_key", "static"]


class SessionInfo(_Body):
    """Who the caller is: a session or a bearer key."""

    workspace_id: str
    user_id: str | None
    user_name: str | None
    auth: AuthMethod = Field(
        description="how this request was authenticated: session (an admin session cookie, "
        "from a password, LDAP or SAML login), oidc (an OIDC bearer token), oauth (an OAuth "
        "client-credentials token), api_key, or static (the SVC_NATIVE_COMPAT_KEY)"
    )
    scopes: list[str]


class TotpEnrolment(_Body):
    """Shown once; confirm it with a code from the authenticator."""

    secret: str
    otpauth_uri: str


class TotpEnrolled(_Body):
    totp_enrolled: bool


class UserView(_Body):
    id: str
    workspace_id: str
    user_name: str
    display_name: str | None
    given_name: str | None
    family_name: str | None
    emails: list[dict[str, Any]] = Field(description="SCIM-style: value, type, primary")
    external_id: str | None
    active: bool | None
    source: str = Field(description="local, scim, ldap, saml or oidc")
    roles: list[str]
    has_password: bool
    totp_enrolled: bool
    created_at: AwareDatetime
    updated_at: AwareDatetime


class UserPage(_Body):
    items: list[UserView]
    total: int = Field(ge=0)


class IssuedUserKey(NewApiKey):
    """The key is shown once: as `POST /v1/admin/apikeys` answers, and `key_id`, the id's
    name here before the two answers were made one."""

    model_config = ConfigDict(extra="forbid")
    key_id: str
    user_id: str


class RoleView(_Body):
    name: str
    builtin: bool
    permissions: dict[str, Access] = Field(description="domain -> read or write")


class RoleList(_Body):
    items: list[RoleView]


class IssuedScimToken(_Body):
    """Shown once (201)."""

    token: str
    token_id: str
    prefix: str


class ScimTokenRevoked(_Body):
    """The 200 answer to `{"action": "revoke"}`: the workspace has no SCIM token any more."""

    revoked: Literal[True]


class IssuedOAuthClient(_Body):
    """The secret is shown once."""

    client_id: str
    client_secret: str
    scopes: list[str]


class OAuthClientView(_Body):
    """A registered client, as listed: never its secret."""

    client_id: str
    name: str
    scopes: list[str]
    created_at: AwareDatetime
    revoked_at: AwareDatetime | None


class OAuthClientPage(_Body):
    items: list[OAuthClientView]
    total: int = Field(ge=0)


class AuditEntry(_Body):
    id: str = Field(description="sealed: pass it as `before` for the entries older than this one")
    at: AwareDatetime
    action: str
    user_id: str | None
    user_name: str | None
    client_ip: str | None
    detail: dict[str, Any]


class AuditPage(_Body):
    """Newest first; pass `next_cursor` as `before` for the next page (null: no more)."""

    items: list[AuditEntry]
    next_cursor: str | None
