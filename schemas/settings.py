"""Instance settings as events: the `settings:instance` stream (ARCHITECTURE.md decision 7).

The effective value of a setting is catalog default < environment / env file < stored value;
stored values are these events. Like workspace settings (schemas/workspace.py), a secret value
never enters the log: the event records a marker (`secret=True`, `value=None`) and the value is
kept in the gateway's `instance_secrets` table.
"""

from __future__ import annotations

from typing import Annotated, ClassVar, Self

import orjson
from pydantic import AwareDatetime, BaseModel, ConfigDict, Field, field_validator, model_validator

from schemas.commands import Command
from schemas.events import Event, event
from schemas.workspace import RESERVED_WORKSPACE_ID

SETTINGS_STREAM_ID = "instance"
"""Id of the one settings actor: its stream is `settings:instance`."""

INSTANCE_WORKSPACE_ID = RESERVED_WORKSPACE_ID
"""Workspace id carried by instance-level events; never a tenant's id, so no tenant feed or
read model ever shows them."""

SettingKey = Annotated[str, Field(min_length=1, max_length=100, pattern=r"^[A-Z][A-Z0-9_]*$")]
SettingText = Annotated[str, Field(max_length=100_000)]


Author = Annotated[str, Field(min_length=1, max_length=300)]
"""Who changed a setting, as the audit log names a principal (`key:<id>`, `user:<id>`) or
`cli:<operating-system user>`; None in events recorded before authors were."""

SecretVersion = Annotated[str, Field(min_length=1, max_length=100)]
"""Names the vault row holding a secret's value (gateway/secrets.py); None in events recorded
before versions existed, whose value is the row of version ''."""


def _marker_only(secret: bool, value: str | None, secret_version: str | None = None) -> None:
    if secret and value is not None:
        raise ValueError("a secret setting is recorded as a marker: value must be None")
    if not secret and value is None:
        raise ValueError("a non-secret setting needs a value")
    if not secret and secret_version is not None:
        raise ValueError("only a secret setting names a secret_version")


class SetSetting(Command):
    target_fields = ("key",)
    key: SettingKey
    value: SettingText | None
    secret: bool = False
    secret_version: SecretVersion | None = None
    at: AwareDatetime
    by: Author | None = None

    @model_validator(mode="after")
    def _check(self) -> Self:
        _marker_only(self.secret, self.value, self.secret_version)
        return self


class UnsetSetting(Command):
    target_fields = ("key",)
    key: SettingKey
    at: AwareDatetime
    by: Author | None = None


@event
class SettingChanged(Event):
    type_name: ClassVar[str] = "settings.changed"
    key: SettingKey
    value: SettingText | None
    secret: bool
    at: AwareDatetime
    secret_version: SecretVersion | None = None
    by: Author | None = None

    @model_validator(mode="after")
    def _check(self) -> Self:
        _marker_only(self.secret, self.value, self.secret_version)
        return self


@event
class SettingUnset(Event):
    type_name: ClassVar[str] = "settings.unset"
    key: SettingKey
    at: AwareDatetime
    by: Author | None = None


class StoredSetting(BaseModel):
    """One stored value in the settings actor's state (`value` is None for a secret)."""

    model_config = ConfigDict(frozen=True, extra="forbid")
    value: SettingText | None
    secret: bool
    at: AwareDatetime
    secret_version: str | None = None
    by: str | None = None


class SettingsState(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")
    values: dict[str, StoredSetting] = Field(default_factory=dict)


# --- HTTP / CLI views ----------------------------------------------------------------------


class SettingView(BaseModel):
    """A setting as listings show it: secrets are "********" or "unset", never the value."""

    key: str
    group: str
    type: str
    value: str = Field(description="the value in effect from the next start (stored, else ...)")
    source: str = Field(description="default, environment, env_file or stored")
    running_value: str = Field(
        description="the value the answering process runs with; differs from `value` while "
        "a restart (R) key's change waits for the restart"
    )
    restart_pending: bool = Field(description="`value` takes effect only at the next start")
    default: str
    apply: str = Field(description="R (restart), L (live) or blank (not stated, treated as R)")
    secret: bool
    choices: list[str] = Field(default_factory=list)
    effect: str
    note: str = ""
    changed_at: AwareDatetime | None = Field(
        default=None, description="when the stored value was set; null unless source is stored"
    )
    changed_by: str | None = Field(
        default=None,
        description="who set the stored value (`key:<id>`, `user:<id>`, `cli:<os user>`); null "
        "unless source is stored, or for a value stored before authors were recorded",
    )


class SettingList(BaseModel):
    settings: list[SettingView]
    catalog_total_stated: int = Field(description="the total the spec states for its catalog")


class SetSettingRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")
    value: SettingText

    # Every value travels as text, as the environment holds it: a bare value, or a number
    # or a boolean for `value`, is told the form that is taken.
    @model_validator(mode="before")
    @classmethod
    def _an_object(cls, data: object) -> object:
        if not isinstance(data, dict):
            raise ValueError('send {"value": "..."}: the value as a string, in an object')
        return data

    @field_validator("value", mode="before")
    @classmethod
    def _text(cls, given: object) -> object:
        if isinstance(given, bool | int | float):
            text = orjson.dumps(given).decode()
            raise ValueError(f'must be a string: send {{"value": "{text}"}}')
        return given


class SettingChangeResult(BaseModel):
    key: str
    value: str
    applied: bool = Field(description="true when the running service already uses the value")
    restart_required: bool
    message: str
