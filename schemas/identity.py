"""Identity commands and events: users, roles, role bindings, sessions, SCIM tokens, OAuth
clients and the security audit trail.

Three actor kinds carry them (actors/identity.py):

- `identity:<workspace_id>`, the workspace's directory: users, their role bindings, custom
  roles, the SCIM token and the OAuth clients. One stream per workspace, so user names stay
  unique and a workspace's identity history replays in order; every user event carries
  `user_id`, so one user's history is that stream filtered by it.
- `session:<session_id>`: one admin session (started, revoked).
- `audit:<workspace_id>`: login outcomes, which change no state but must be on record.

Secrets never enter the log. Passwords and TOTP seeds live in the `identity_secrets` vault
(gateway/identity/vault.py) and the log records only markers (`PasswordSet`, `TotpEnrolled`).
Bearer secrets we generate (session tokens, SCIM tokens, OAuth client secrets) are recorded as
their sha256 hex digest, like API keys (schemas/workspace.py).
"""

from __future__ import annotations

import unicodedata
from dataclasses import dataclass
from typing import Annotated, Any, ClassVar, Literal

from pydantic import (
    AfterValidator,
    AwareDatetime,
    BaseModel,
    ConfigDict,
    Field,
    GetCoreSchemaHandler,
    GetJsonSchemaHandler,
    SecretStr,
)
from pydantic.json_schema import JsonSchemaValue
from pydantic_core import core_schema

from schemas.commands import Command
from schemas.events import EVENTS, Event, event

Id = Annotated[str, Field(min_length=1, max_length=200)]
UserName = Annotated[str, Field(min_length=1, max_length=256)]


def user_name_key(user_name: str) -> str:
    """The one spelling by which user names are unique, looked up and locked out: NFKC, runs
    of white space as one space, case folded. Computed here, never in SQL: PostgreSQL's
    `lower()` folds differently (`lower('İnfo')` is `info`, which `casefold()` keeps apart), and
    a read model keyed one way under actors deciding the other stopped on the difference."""
    return " ".join(unicodedata.normalize("NFKC", user_name).split()).casefold()


Text = Annotated[str, Field(max_length=500)]
Hash = Annotated[str, Field(pattern=r"^[0-9a-f]{64}$")]
Prefix = Annotated[str, Field(min_length=1, max_length=12)]
ROLE_NAME_PATTERN = r"^[a-z][a-z0-9_.-]*$"
MAX_ROLE_NAME = 64
RoleName = Annotated[str, Field(min_length=1, max_length=MAX_ROLE_NAME, pattern=ROLE_NAME_PATTERN)]
Access = Literal["read", "write"]
UserSource = Literal["local", "scim", "ldap", "saml", "oidc"]
SIGNS_IN_ELSEWHERE: frozenset[str] = frozenset({"ldap", "saml", "oidc"})
"""Sources whose users prove who they are to a directory or an IdP, never with a password
kept here: a local password on such an account is neither set nor accepted."""
LoginMethod = Literal["password", "ldap", "saml"]

DOMAINS: tuple[str, ...] = (
    "agents",
    "analytics",
    "apikeys",
    "artifacts",
    "audit",
    "channels",
    "conversations",
    "knowledge",
    "media",
    "memory",
    "modules",
    "security",
    "settings",
    "system",
    "users",
    "voice",
)
"""Resource domains of the admin API that roles grant read or write on."""

_OPERATOR_READ_ONLY = frozenset({"apikeys", "audit", "security", "settings", "users"})

BUILTIN_ROLES: dict[str, dict[str, Access]] = {
    "owner": dict.fromkeys(DOMAINS, "write"),
    "admin": dict.fromkeys(DOMAINS, "write"),
    "operator": {d: ("read" if d in _OPERATOR_READ_ONLY else "write") for d in DOMAINS},
    "member": dict.fromkeys(DOMAINS, "read"),
}
"""The fixed roles. `owner` and `admin` grant the same rights except that only an owner may
grant or remove the owner role; `member` is read-only."""


def _known_domains(perms: dict[str, Access]) -> dict[str, Access]:
    unknown = sorted(set(perms) - set(DOMAINS))
    if unknown:
        raise ValueError(f"unknown resource domains {unknown}; known: {list(DOMAINS)}")
    return perms


Permissions = Annotated[dict[str, Access], AfterValidator(_known_domains)]


class Email(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")
    value: Annotated[str, Field(min_length=3, max_length=320)]
    primary: bool = False
    type: Annotated[str, Field(max_length=40)] | None = None


@dataclass(frozen=True, slots=True)
class secret_sized:  # lower case: read as `Annotated[SecretStr, secret_sized(8, 1024)]`
    """The bound of a secret of `lo` to `hi` characters (a password, a secret setting's
    value): refused in characters, not in the "items" pydantic's own bound names for a
    SecretStr, and never with the value; and stated in the JSON schema (minLength,
    maxLength), as pydantic's own bound was."""

    lo: int
    hi: int

    def __get_pydantic_core_schema__(
        self, source: Any, handler: GetCoreSchemaHandler
    ) -> core_schema.CoreSchema:
        return core_schema.no_info_after_validator_function(self._sized, handler(source))

    def __get_pydantic_json_schema__(
        self, schema: core_schema.CoreSchema, handler: GetJsonSchemaHandler
    ) -> JsonSchemaValue:
        described = handler(schema)
        described.update(maxLength=self.hi, **({"minLength": self.lo} if self.lo else {}))
        return described

    def _sized(self, value: SecretStr) -> SecretStr:
        if not self.lo <= len(value.get_secret_value()) <= self.hi:
            bound = f"{self.lo} to {self.hi}" if self.lo else f"at most {self.hi}"
            raise ValueError(f"must be {bound} characters")
        return value


MAX_EMAILS = 100
"""The most addresses a request may give one user (SCIM and the admin API). Not a bound of
UserProfile itself: a profile recorded before the bound must still read."""


def _one_primary(emails: tuple[Email, ...]) -> tuple[Email, ...]:
    # RFC 7643 section 2.4, which SCIM checks too: primary true appears no more than once.
    if sum(email.primary for email in emails) > 1:
        raise ValueError("at most one email may be primary")
    return emails


Emails = Annotated[tuple[Email, ...], Field(max_length=MAX_EMAILS), AfterValidator(_one_primary)]


class UserProfile(BaseModel):
    """What a user is, as SCIM and the admin API set it (a full replacement on update)."""

    model_config = ConfigDict(frozen=True, extra="forbid")
    user_name: UserName
    display_name: Text | None = None
    given_name: Text | None = None
    family_name: Text | None = None
    emails: tuple[Email, ...] = ()
    external_id: Text | None = None
    active: bool | None = True
    """None: not stated (SCIM lets a client remove it); only False disables the user."""


Actor = Annotated[str, Field(min_length=1, max_length=200)]
"""Who asked for a change, for the audit log: `user:<id>`, `key:<id>`, `oauth:<client id>`,
`scim:<token id>`, `ldap`, `saml` or `system`. Never a secret."""


class IdentityCommand(Command):
    by: Actor | None = None


class IdentityEvent(Event):
    by: Actor | None = None


# --- commands: directory (`identity:<workspace_id>`) -----------------------------------------


class ProvisionUser(IdentityCommand):
    # The user id is drawn per attempt: what the request asked for names it. A key reused
    # for another user (another name, other roles) is refused, not answered with the first
    # user, on whom a retry may set a password.
    target_fields = ("profile", "source", "roles")
    user_id: Id
    profile: UserProfile
    source: UserSource
    roles: tuple[RoleName, ...] = ()
    at: AwareDatetime


class UpdateUser(IdentityCommand):
    target_fields = ("user_id",)
    user_id: Id
    profile: UserProfile
    at: AwareDatetime
    base: UserProfile | None = None
    """The profile `profile` was made from (read from the read model): when the user's is
    another by now, the command is refused (`USER_CHANGED`) rather than undo that change."""


USER_CHANGED = "user_changed"
"""The code of an UpdateUser refused because its `base` is no longer the user's profile."""


class DeprovisionUser(IdentityCommand):
    target_fields = ("user_id",)
    user_id: Id
    at: AwareDatetime


class BindRole(IdentityCommand):
    target_fields = ("user_id", "role")
    user_id: Id
    role: RoleName
    at: AwareDatetime


class UnbindRole(IdentityCommand):
    target_fields = ("user_id", "role")
    user_id: Id
    role: RoleName
    at: AwareDatetime


class DefineCustomRole(IdentityCommand):
    target_fields = ("role", "permissions")  # a redefinition under the same key is no retry
    role: RoleName
    permissions: Permissions
    at: AwareDatetime


class RecordPasswordSet(IdentityCommand):
    """The password's hash is already in the vault; this records that it changed."""

    target_fields = ("user_id",)

    user_id: Id
    at: AwareDatetime


class LinkApiKey(IdentityCommand):
    """Record that API key `key_id` (issued through the workspace actor) belongs to the user:
    it is revoked when the user is deactivated or deprovisioned."""

    target_fields = ("user_id", "key_id")

    user_id: Id
    key_id: Id
    at: AwareDatetime


class RecordTotpEnrolled(IdentityCommand):
    target_fields = ("user_id",)
    user_id: Id
    at: AwareDatetime


class ResetTotp(IdentityCommand):
    """An administrator's removal of a user's TOTP second factor (a lost authenticator, or
    one an intruder enrolled): the user signs in with the password alone until enrolling
    again. Nothing when none is enrolled."""

    target_fields = ("user_id",)
    user_id: Id
    at: AwareDatetime


class RecordSsoSecretSet(IdentityCommand):
    """An instance SSO secret (the LDAP bind password, the SAML key) is already in the
    vault; this records who set which one, for the audit log. Never the value."""

    target_fields = ("scope", "name")
    scope: Annotated[str, Field(min_length=1, max_length=40)]
    name: Annotated[str, Field(min_length=1, max_length=40)]
    at: AwareDatetime


class IssueScimToken(IdentityCommand):
    """Issue the workspace's SCIM token, replacing (rotating) any current one."""

    token_id: Id
    token_hash: Hash
    prefix: Prefix
    at: AwareDatetime


class RevokeScimToken(IdentityCommand):
    at: AwareDatetime


class RegisterOAuthClient(IdentityCommand):
    client_id: Id
    name: Annotated[str, Field(min_length=1, max_length=200)]
    secret_hash: Hash
    scopes: tuple[str, ...]
    at: AwareDatetime


class RevokeOAuthClient(IdentityCommand):
    target_fields = ("client_id",)
    client_id: Id
    at: AwareDatetime


# --- commands: sessions and audit ------------------------------------------------------------


class StartSession(Command):
    session_id: Id
    user_id: Id
    token_hash: Hash
    method: LoginMethod
    second_factor: bool
    expires_at: AwareDatetime
    at: AwareDatetime


class RevokeSession(IdentityCommand):
    reason: Annotated[str, Field(max_length=100)]
    at: AwareDatetime


class RecordLogin(Command):
    """A login attempt's outcome. `user_name` is what was typed (never the password)."""

    user_name: Annotated[str, Field(max_length=256)]
    user_id: Id | None
    method: LoginMethod
    succeeded: bool
    reason: Annotated[str, Field(max_length=100)]
    client_ip: Annotated[str, Field(max_length=100)]
    at: AwareDatetime


# --- events ----------------------------------------------------------------------------------


@event
class UserProvisioned(IdentityEvent):
    type_name: ClassVar[str] = "identity.user_provisioned"
    workspace_id: Id
    user_id: Id
    profile: UserProfile
    source: UserSource
    at: AwareDatetime


@event
class UserUpdated(IdentityEvent):
    type_name: ClassVar[str] = "identity.user_updated"
    workspace_id: Id
    user_id: Id
    profile: UserProfile
    at: AwareDatetime


@event
class UserDeprovisioned(IdentityEvent):
    type_name: ClassVar[str] = "identity.user_deprovisioned"
    workspace_id: Id
    user_id: Id
    at: AwareDatetime


@event
class RoleBound(IdentityEvent):
    type_name: ClassVar[str] = "identity.role_bound"
    workspace_id: Id
    user_id: Id
    role: RoleName
    at: AwareDatetime


@event
class RoleUnbound(IdentityEvent):
    type_name: ClassVar[str] = "identity.role_unbound"
    workspace_id: Id
    user_id: Id
    role: RoleName
    at: AwareDatetime


@event
class CustomRoleDefined(IdentityEvent):
    type_name: ClassVar[str] = "identity.custom_role_defined"
    workspace_id: Id
    role: RoleName
    permissions: Permissions
    at: AwareDatetime


@event
class PasswordSet(IdentityEvent):
    type_name: ClassVar[str] = "identity.password_set"
    workspace_id: Id
    user_id: Id
    at: AwareDatetime


@event
class UserApiKeyLinked(IdentityEvent):
    type_name: ClassVar[str] = "identity.user_api_key_linked"
    workspace_id: Id
    user_id: Id
    key_id: Id
    at: AwareDatetime


@event
class TotpEnrolled(IdentityEvent):
    type_name: ClassVar[str] = "identity.totp_enrolled"
    workspace_id: Id
    user_id: Id
    at: AwareDatetime


@event
class TotpReset(IdentityEvent):
    type_name: ClassVar[str] = "identity.totp_reset"
    workspace_id: Id
    user_id: Id
    at: AwareDatetime


@event
class SsoSecretSet(IdentityEvent):
    """An instance SSO secret was set (`scope`/`name`, as `ldap`/`bind_password`): who set
    it and when. Its value is in the vault only."""

    type_name: ClassVar[str] = "identity.sso_secret_set"
    workspace_id: Id
    scope: Annotated[str, Field(min_length=1, max_length=40)]
    name: Annotated[str, Field(min_length=1, max_length=40)]
    at: AwareDatetime


@event
class ScimTokenIssued(IdentityEvent):
    type_name: ClassVar[str] = "identity.scim_token_issued"
    workspace_id: Id
    token_id: Id
    token_hash: Hash
    prefix: Prefix
    at: AwareDatetime


@event
class ScimTokenRotated(IdentityEvent):
    """A new token replaced `old_token_id`, which stops working at once."""

    type_name: ClassVar[str] = "identity.scim_token_rotated"
    workspace_id: Id
    old_token_id: Id
    token_id: Id
    token_hash: Hash
    prefix: Prefix
    at: AwareDatetime


@event
class ScimTokenRevoked(IdentityEvent):
    type_name: ClassVar[str] = "identity.scim_token_revoked"
    workspace_id: Id
    token_id: Id
    at: AwareDatetime


@event
class OAuthClientRegistered(IdentityEvent):
    type_name: ClassVar[str] = "identity.oauth_client_registered"
    workspace_id: Id
    client_id: Id
    name: Annotated[str, Field(min_length=1, max_length=200)]
    secret_hash: Hash
    scopes: tuple[str, ...]
    at: AwareDatetime


@event
class OAuthClientRevoked(IdentityEvent):
    type_name: ClassVar[str] = "identity.oauth_client_revoked"
    workspace_id: Id
    client_id: Id
    at: AwareDatetime


@event
class SessionStarted(Event):
    type_name: ClassVar[str] = "identity.session_started"
    workspace_id: Id
    session_id: Id
    user_id: Id
    token_hash: Hash
    method: LoginMethod
    second_factor: bool
    expires_at: AwareDatetime
    at: AwareDatetime


@event
class SessionRevoked(IdentityEvent):
    type_name: ClassVar[str] = "identity.session_revoked"
    schema_version: ClassVar[int] = 2
    workspace_id: Id
    session_id: Id
    reason: Annotated[str, Field(max_length=100)]
    at: AwareDatetime
    # Whose session it was, for the audit log (version 2 on; None before).
    user_id: Id | None = None


@EVENTS.upcaster(SessionRevoked.type_name, 1)
def _session_revoked_v1(data: dict[str, Any]) -> dict[str, Any]:
    """Version 2 added `user_id`: a revocation recorded before names no user, which its
    default says (the session's start does)."""
    return data


@event
class LoginSucceeded(Event):
    type_name: ClassVar[str] = "identity.login_succeeded"
    workspace_id: Id
    user_name: Annotated[str, Field(max_length=256)]
    user_id: Id | None
    method: LoginMethod
    client_ip: Annotated[str, Field(max_length=100)]
    at: AwareDatetime


@event
class LoginFailed(Event):
    type_name: ClassVar[str] = "identity.login_failed"
    workspace_id: Id
    user_name: Annotated[str, Field(max_length=256)]
    user_id: Id | None
    method: LoginMethod
    reason: Annotated[str, Field(max_length=100)]
    client_ip: Annotated[str, Field(max_length=100)]
    at: AwareDatetime
