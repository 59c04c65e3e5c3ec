"""The settings actor (`settings:instance`): the one writer of instance setting values.

Its pure core checks each change against the catalog (known key, storable, valid value) and
records it; the gateway's SettingsService asks it and applies live (L) settings on change.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import ClassVar

from pydantic import BaseModel

from actors.behaviour import ActorKey, Behaviour
from schemas.commands import Command
from schemas.errors import InvalidInput
from schemas.events import Event
from schemas.settings import (
    SetSetting,
    SettingChanged,
    SettingsState,
    SettingUnset,
    StoredSetting,
    UnsetSetting,
)
from schemas.settings_catalog import get_spec, parse

KIND = "settings"


def _check_storable(key: str) -> None:
    spec = get_spec(key)
    if not spec.storable:
        raise InvalidInput(f"{key} cannot be stored: {spec.note}", code="setting_not_storable")


def _decide_set(state: SettingsState, command: SetSetting) -> list[Event]:
    _check_storable(command.key)
    spec = get_spec(command.key)
    if spec.secret != command.secret:
        raise InvalidInput(f"{command.key}: secret flag does not match the catalog")
    if command.value is not None:
        parse(spec, command.value)
    current = state.values.get(command.key)
    if current is not None and not command.secret and current.value == command.value:
        return []
    return [
        SettingChanged(
            key=command.key,
            value=command.value,
            secret=spec.secret,
            at=command.at,
            secret_version=command.secret_version,
            by=command.by,
        )
    ]


def _decide_unset(state: SettingsState, command: UnsetSetting) -> list[Event]:
    get_spec(command.key)
    if command.key not in state.values:
        return []
    return [SettingUnset(key=command.key, at=command.at, by=command.by)]


class SettingsBehaviour(Behaviour[SettingsState]):
    kind: ClassVar[str] = KIND
    state_type: ClassVar[type[BaseModel]] = SettingsState

    def initial_state(self, key: ActorKey) -> SettingsState:
        return SettingsState()

    def decide(self, state: SettingsState, command: Command) -> Sequence[Event]:
        if isinstance(command, SetSetting):
            return _decide_set(state, command)
        if isinstance(command, UnsetSetting):
            return _decide_unset(state, command)
        raise InvalidInput(f"the settings actor does not handle {type(command).__name__}")

    def evolve(self, state: SettingsState, event: Event) -> SettingsState:
        values = dict(state.values)
        if isinstance(event, SettingChanged):
            values[event.key] = StoredSetting(
                value=event.value,
                secret=event.secret,
                at=event.at,
                secret_version=event.secret_version,
                by=event.by,
            )
        elif isinstance(event, SettingUnset):
            values.pop(event.key, None)
        return SettingsState(values=values)
