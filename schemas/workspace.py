"""Workspace commands and events: the tenant, its settings and its API keys.

A workspace is one logical actor (`workspace:<id>`). As in every actor kind, commands carry
`at`, stamped by the caller, so that `decide()` stays pure (see schemas/conversation.py).

Secrets never enter the log: an API key is hashed by the gateway before the command is built
(`key_hash` is the sha256 hex digest; `prefix` its first 8 characters for display), and a
secret setting is recorded only as a marker (`secret=True`, `value=None`).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Annotated, ClassVar, Self

from pydantic import AfterValidator, AwareDatetime, Field, field_validator, model_validator

from schemas.commands import Command
from schemas.errors import quoted
from schemas.events import Event, event

API_KEY_SCOPES: frozenset[str] = frozenset({"*", "admin:read", "admin:write", "mcp", "chat"})
"""Scopes an API key may carry. `chat` is the end-user ability to call /v1/chat/completions."""

ID_MAX_CHARS = 200
Id = Annotated[str, Field(min_length=1, max_length=ID_MAX_CHARS)]
Name = Annotated[str, Field(min_length=1, max_length=200)]
SettingKey = Annotated[str, Field(min_length=1, max_length=100, pattern=r"^[A-Z][A-Z0-9_]*$")]
KeyHash = Annotated[str, Field(pattern=r"^[0-9a-f]{64}$")]
KeyPrefix = Annotated[str, Field(min_length=1, max_length=8)]


def unknown_scopes(scopes: Iterable[str]) -> str | None:
    """What is wrong with `scopes` that names one no key can hold, or None. The names are
    quoted as `quoted` does: a key pasted as a scope is not said back."""
    unknown = sorted(set(scopes) - API_KEY_SCOPES)
    if not unknown:
        return None
    named = ", ".join(quoted(scope) for scope in unknown[:5])
    return f"unknown scope {named}; the scopes are {', '.join(sorted(API_KEY_SCOPES))}"


def _known_scopes(scopes: tuple[str, ...]) -> tuple[str, ...]:
    problem = unknown_scopes(scopes)
    if problem:
        raise ValueError(problem)
    if len(set(scopes)) != len(scopes):
        raise ValueError("scopes must be unique")
    return scopes


Scopes = Annotated[
    tuple[str, ...], Field(min_length=1, max_length=16), AfterValidator(_known_scopes)
]
SettingValue = Annotated[str, Field(max_length=100_000)]


def _secret_has_no_value(secret: bool, value: str | None) -> None:
    if secret and value is not None:
        raise ValueError("a secret setting is recorded as a marker: value must be None")


# --- commands -------------------------------------------------------------------------------


RESERVED_WORKSPACE_ID = "_instance"
"""The workspace id of the service's own records (schemas/settings.py INSTANCE_WORKSPACE_ID is
this one): no tenant's workspace may take it, or its
keys would read the instance's events. Only this id: others starting with `_` may already
be in use."""


class CreateWorkspace(Command):
    name: Name
    at: AwareDatetime

    @field_validator("workspace_id")
    @classmethod
    def _printable(cls, workspace_id: str) -> str:
        return new_workspace_id(workspace_id)


def new_workspace_id(workspace_id: str) -> str:
    """`workspace_id` if a workspace may be created under it, else a ValueError saying why.
    A new workspace's id ends up in keys, logs, feeds and exports: no control or invisible
    characters, no spaces around it (ids recorded earlier stay readable)."""
    if not workspace_id.isprintable() or workspace_id != workspace_id.strip():
        raise ValueError(
            "a workspace id must be printable text without control characters or "
            "leading and trailing spaces"
        )
    if workspace_id == RESERVED_WORKSPACE_ID:
        raise ValueError(
            f"{RESERVED_WORKSPACE_ID!r} is the service's own workspace id (its instance "
            "settings are recorded under it); choose another id"
        )
    return workspace_id


class ChangeWorkspaceSetting(Command):
    """Set `key` to `value`; `value=None` with `secret=False` resets it to its default.
    For a secret the value itself is kept outside the log and only the marker is recorded."""

    target_fields = ("key",)
    key: SettingKey
    value: SettingValue | None
    secret: bool = False
    at: AwareDatetime

    @model_validator(mode="after")
    def _check(self) -> Self:
        _secret_has_no_value(self.secret, self.value)
        return self


# Who acted, for the audit log ("user:<id>", "key:<id>", "oauth:<client>"); never a secret.
IssuedBy = Annotated[str, Field(min_length=1, max_length=200)] | None


class IssueApiKey(Command):
    key_id: Id
    name: Name
    key_hash: KeyHash
    prefix: KeyPrefix
    scopes: Scopes
    rate_limit_rpm: int | None = Field(default=None, ge=1, le=1_000_000)
    expires_at: AwareDatetime | None = None
    at: AwareDatetime
    by: IssuedBy = None


class RevokeApiKey(Command):
    target_fields = ("key_id",)
    key_id: Id
    at: AwareDatetime
    by: IssuedBy = None


# --- events ---------------------------------------------------------------------------------


@event
class WorkspaceCreated(Event):
    type_name: ClassVar[str] = "workspace.created"
    workspace_id: Id
    name: Name
    # The creating command's id: a retried create is recognised even after a replay.
    command_id: Id | None = None
    at: AwareDatetime


@event
class WorkspaceSettingChanged(Event):
    type_name: ClassVar[str] = "workspace.setting_changed"
    workspace_id: Id
    key: SettingKey
    value: SettingValue | None
    secret: bool
    at: AwareDatetime

    @model_validator(mode="after")
    def _check(self) -> Self:
        _secret_has_no_value(self.secret, self.value)
        return self


@event
class ApiKeyIssued(Event):
    type_name: ClassVar[str] = "workspace.api_key_issued"
    workspace_id: Id
    key_id: Id
    name: Name
    key_hash: KeyHash
    prefix: KeyPrefix
    scopes: Scopes
    rate_limit_rpm: int | None = Field(ge=1, le=1_000_000)
    expires_at: AwareDatetime | None
    at: AwareDatetime
    by: IssuedBy = None


@event
class ApiKeyRevoked(Event):
    type_name: ClassVar[str] = "workspace.api_key_revoked"
    workspace_id: Id
    key_id: Id
    at: AwareDatetime
    by: IssuedBy = None
