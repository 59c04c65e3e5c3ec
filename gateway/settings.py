"""The one typed settings object, and the service that changes settings through the settings actor.

Precedence of the effective value, lowest first (docs/settings.md):

1. the catalog default (schemas/settings_catalog.py);
2. the env file (`SVC_ENV_FILE`, default `<SVC_DATA_DIR>/svc.env` when present);
3. the process environment (wins over the env file);
4. the stored value (`svc settings set` / the admin API: events of `settings:instance`).

This module is the only place that reads `os.environ`. Secret values never appear in a repr,
a listing, an error message or a log line.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import os
import re
import shlex
import uuid
from collections.abc import Callable, Iterable, Mapping
from contextlib import AbstractAsyncContextManager, nullcontext
from dataclasses import dataclass
from datetime import UTC, datetime
from enum import StrEnum
from pathlib import Path
from typing import Protocol

from actors.behaviour import ActorKey
from actors.runtime import ActorRuntime
from actors.settings import KIND, SettingsBehaviour
from eventstore.errors import StoreError
from eventstore.records import RecordedEvent
from schemas.errors import InvalidInput
from schemas.events import EVENTS
from schemas.setting_rules import port_number
from schemas.settings import (
    INSTANCE_WORKSPACE_ID,
    SETTINGS_STREAM_ID,
    SetSetting,
    SettingChangeResult,
    SettingList,
    SettingsState,
    SettingView,
    StoredSetting,
    UnsetSetting,
)
from schemas.settings_catalog import (
    CATALOG,
    SPEC_TOTAL,
    SettingSpec,
    SettingValue,
    check_given,
    check_set,
    check_stored_length,
    dialect_surprise,
    display_value,
    get_spec,
    parse,
    parse_or_coerce,
    stored_text,
)
from schemas.text import is_utf8

log = logging.getLogger(__name__)

ENV_FILE_NAME = "svc.env"


class Source(StrEnum):
    DEFAULT = "default"
    ENV_FILE = "env_file"
    ENVIRONMENT = "environment"
    STORED = "stored"


@dataclass(frozen=True, slots=True)
class Resolved:
    raw: str
    source: Source


def read_env_file(path: Path) -> dict[str, str]:
    """KEY=VALUE lines; `#` comments, blank lines, `export ` and surrounding quotes allowed."""
    out: dict[str, str] = {}
    try:
        # utf-8-sig: an editor's byte-order mark would otherwise become part of the first key,
        # which then names no setting and was dropped without a word.
        text_of_file = path.read_text(encoding="utf-8-sig")
    except UnicodeDecodeError:
        raise InvalidInput(f"{path}: the env file is not UTF-8 text") from None
    except OSError as exc:  # unreadable by this user, a directory, an I/O error
        raise InvalidInput(
            f"{path}: the env file is not a readable file ({exc.strerror or exc}); check "
            "SVC_ENV_FILE and the file's permissions for the user svc runs as"
        ) from None
    for number, line in enumerate(text_of_file.splitlines(), start=1):
        text = line.strip()
        if not text or text.startswith("#"):
            continue
        text = text.removeprefix("export ").strip()
        key, sep, value = text.partition("=")
        if not sep or _ENV_NAME.fullmatch(key.strip()) is None:
            # Not quoted back: the line may be a secret with a space where `=` should be.
            raise InvalidInput(
                f"{path}:{number}: expected KEY=VALUE, KEY a variable name (letters, digits and _)"
            )
        out[key.strip()] = _unquote(value.strip())
    return out


_ENV_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")


def _unquote(value: str) -> str:
    if len(value) >= 2 and value[0] == value[-1] and value[0] in "'\"":
        return value[1:-1]
    return value


NOT_SETTINGS = frozenset({"SVC_RAY_HEAD"})
"""Variables of ours that are not settings: `SVC_RAY_HEAD` is read by `svc-ray-node`
(ops/docker) before `svc` starts, in the same environment."""


def _known_layer(values: Mapping[str, str], source: Source) -> dict[str, str]:
    """Keep catalog keys allowed from this source; validate them; warn (names only) otherwise."""
    out: dict[str, str] = {}
    for key, raw in values.items():
        spec = CATALOG.get(key)
        if spec is None:
            if (
                key.startswith("SVC_")
                and not key.startswith("SVC_TEST_")
                and key not in NOT_SETTINGS
            ):
                log.warning("ignoring unknown setting %s from the %s", key, source.value)
            continue
        if not spec.from_env:
            log.warning("ignoring %s from the %s: %s", key, source.value, spec.note)
            continue
        try:
            parse_or_coerce(spec, raw)
            check_given(spec, raw)
        except InvalidInput as exc:
            raise InvalidInput(f"{exc.message} (from the {source.value})", code=exc.code) from None
        out[key] = raw
    return out


def _usable(spec: SettingSpec, raw: str) -> bool:
    """Whether a stored value applies: its key may be stored and the value is still valid."""
    return spec.storable and _still_valid(spec, raw)


def _still_valid(spec: SettingSpec, raw: str) -> bool:
    try:
        parse_or_coerce(spec, raw)
    except Exception as exc:  # whatever a check raises, a stored value must not stop the start
        reason = exc.message if isinstance(exc, InvalidInput) else type(exc).__name__
        log.warning(
            "ignoring the stored value of %s: %s; unset it with `svc settings unset %s` or set "
            "a valid one",
            spec.key,
            reason,
            spec.key,
        )
        return False
    return True


def default_workspace_of(raw: str) -> str:
    """The default workspace a value of SVC_DEFAULT_WORKSPACE_ID names: blank is `default`."""
    return raw.strip() or "default"


class Settings:
    """Effective settings of this process, typed accessors over the catalog.

    Live (L) settings change in place when a stored value changes; restart (R) settings keep
    the value the process started with, and `pending_restart` lists the ones that differ.
    """

    def __init__(
        self,
        environment: Mapping[str, str] | None = None,
        env_file: Mapping[str, str] | None = None,
        stored: Mapping[str, str] | None = None,
        *,
        env_file_path: Path | None = None,
    ) -> None:
        self._layers: dict[Source, dict[str, str]] = {
            Source.ENV_FILE: _known_layer(env_file or {}, Source.ENV_FILE),
            Source.ENVIRONMENT: _known_layer(environment or {}, Source.ENVIRONMENT),
            Source.STORED: {},
        }
        self._running: dict[str, str] = {}
        self._listeners: list[Callable[[str], None]] = []
        self.stored_version_at_start = 0
        """The settings stream's version when the stored layer was loaded: the restart
        settings in force are those of that version."""
        self.stored_version = 0
        """The settings stream's version this process has applied up to (the live ones)."""
        self.env_file_path = env_file_path
        self.load_stored(stored or {})

    @classmethod
    def from_environment(cls, environ: Mapping[str, str] | None = None) -> Settings:
        """Build from the process environment (or `environ`) and the env file it names."""
        env = dict(os.environ if environ is None else environ)
        path = _env_file_path(env)
        file_values = read_env_file(path) if path is not None else {}
        return cls(env, file_values, env_file_path=path)

    def load_stored(self, stored: Mapping[str, str], version: int = 0) -> None:
        """Set the stored layer at startup: every stored value applies, R and L alike, except
        one that is no longer valid (stored before its key's check existed): that one is
        skipped with a warning, so it can neither stop the service nor lock out the `svc`
        commands that would unset it."""
        layer = {k: v for k, v in stored.items() if k in CATALOG and _usable(CATALOG[k], v)}
        self._layers[Source.STORED] = layer
        self.stored_version_at_start = self.stored_version = version
        self._running = {key: self.resolve(key).raw for key in CATALOG}
        self._parsed: dict[str, SettingValue] = {}
        self._secrets: tuple[str, ...] | None = None

    def apply_stored(self, key: str, raw: str | None, version: int) -> bool:
        """Record a stored change, read at the settings stream's `version`; apply it now when
        the key is live. True when applied. A value no longer valid is skipped as at startup
        (`load_stored`): the next layer applies."""
        spec = get_spec(key)
        self.stored_version = max(self.stored_version, version)
        layer = self._layers[Source.STORED]
        if raw is None or not _usable(spec, raw):
            layer.pop(key, None)
        else:
            layer[key] = raw
        if spec.secret:
            self._secrets = None
        if not spec.live:
            return False
        self._running[key] = self.resolve(key).raw
        self._parsed.pop(key, None)
        for listener in list(self._listeners):
            listener(key)
        return True

    def stored_layer(self) -> Mapping[str, str]:
        return dict(self._layers[Source.STORED])

    def on_live_change(self, listener: Callable[[str], None]) -> None:
        self._listeners.append(listener)

    def resolve(self, key: str) -> Resolved:
        """The value the next start would use, and where it comes from."""
        spec = get_spec(key)
        for source in (Source.STORED, Source.ENVIRONMENT, Source.ENV_FILE):
            raw = self._layers[source].get(key)
            if raw is not None:
                return Resolved(raw, source)
        return Resolved(spec.default, Source.DEFAULT)

    def secret_values(self) -> tuple[str, ...]:
        """What no log line may show: every secret setting's value, the running one and the
        one the next start would use (a secret changed since start is a secret already), of
        4 characters or more, longest first (a secret that holds another is replaced
        whole). Kept until a stored secret changes: the access log asks on every request."""
        if self._secrets is None:
            secret = [k for k, spec in CATALOG.items() if spec.secret]
            values = {self.raw(k) for k in secret} | {self.resolve(k).raw for k in secret}
            kept = (v for v in values if len(v) >= 4)
            self._secrets = tuple(sorted(kept, key=len, reverse=True))
        return self._secrets

    def pending_restart(self) -> list[str]:
        return sorted(
            key
            for key, spec in CATALOG.items()
            if not same_setting(spec, self._running.get(key), self.resolve(key).raw)
        )

    # --- typed accessors (running values) --------------------------------------------------

    def raw(self, key: str) -> str:
        get_spec(key)
        return self._running[key]

    def value(self, key: str) -> SettingValue:
        if key not in self._parsed:
            self._parsed[key] = parse_or_coerce(get_spec(key), self.raw(key))
        return self._parsed[key]

    def flag(self, key: str) -> bool:
        return bool(self._typed(key, "bool"))

    def integer(self, key: str) -> int:
        value = self._typed(key, "int")
        assert isinstance(value, int)
        return value

    def text(self, key: str) -> str:
        return str(self._typed(key, "text", "enum"))

    def duration(self, key: str) -> float | None:
        value = self._typed(key, "duration")
        return None if value is None else float(value)

    def items(self, key: str) -> list[str]:
        """A comma-list text setting as its non-empty, stripped items."""
        return [part.strip() for part in self.text(key).split(",") if part.strip()]

    def _typed(self, key: str, *types: str) -> SettingValue:
        spec = get_spec(key)
        if spec.type not in types:
            raise TypeError(f"{key} is a {spec.type} setting, not {'/'.join(types)}")
        return self.value(key)

    # --- the operational keys, named -------------------------------------------------------

    @property
    def data_dir(self) -> Path:
        # Blank is the default, as for the env file's lookup (not the current directory).
        raw = self.text("SVC_DATA_DIR").strip() or CATALOG["SVC_DATA_DIR"].default
        return Path(raw).expanduser()

    @property
    def database_url(self) -> str | None:
        return self.text("SVC_DATABASE_URL").strip() or None

    @property
    def default_workspace_id(self) -> str:
        return default_workspace_of(self.text("SVC_DEFAULT_WORKSPACE_ID"))

    @property
    def gateway_addr(self) -> tuple[str | None, int]:
        return parse_listen_addr(self.text("SVC_GATEWAY_ADDR"))

    @property
    def shutdown_grace_s(self) -> float:
        return float(self.integer("SVC_SHUTDOWN_GRACE_SEC"))

    @property
    def max_body_bytes(self) -> int:
        return self.integer("SVC_MAX_BODY_BYTES")

    def __repr__(self) -> str:
        shown = {k: display_value(CATALOG[k], v) for k, v in self._running.items() if v}
        return f"Settings({shown})"


def _env_file_path(env: Mapping[str, str]) -> Path | None:
    named = env.get("SVC_ENV_FILE", "").strip()
    if named:
        path = Path(named).expanduser()
        if not _is_file(path):
            raise InvalidInput(f"SVC_ENV_FILE names {path}, which is not a readable file")
        return path
    data_dir = Path(env.get("SVC_DATA_DIR", "").strip() or CATALOG["SVC_DATA_DIR"].default)
    default = data_dir.expanduser() / ENV_FILE_NAME
    return default if _is_file(default) else None


def _is_file(path: Path) -> bool:
    """`path.is_file()`, a directory this user may not enter named rather than raised
    (pathlib lets a PermissionError through)."""
    try:
        return path.is_file()
    except OSError as exc:
        raise InvalidInput(
            f"{path}: cannot look for the env file there ({exc.strerror or exc}); check "
            "SVC_ENV_FILE or SVC_DATA_DIR and the permissions of the directories on the way "
            "for the user svc runs as"
        ) from None


def parse_listen_addr(addr: str) -> tuple[str | None, int]:
    """`:8780` -> (None = all interfaces, 8780); `127.0.0.1:9000`; `[::1]:9000`.

    Port 0 is a free port chosen by the system. A host holding ':' (an IPv6 address) must be
    bracketed: unbracketed, `localhost:9162:1` or `::1:8780` would split at the last colon
    into a host nothing can listen on, found only after the database is up and migrated."""
    host, sep, port_text = addr.strip().rpartition(":")
    bracketed = host.startswith("[") and host.endswith("]")
    port = port_number(port_text)
    if (
        not sep
        or port is None
        or not 0 <= port <= 65535
        or ("[" in host or "]" in host) != bracketed
        or (":" in host and not bracketed)
    ):
        raise InvalidInput(
            f"invalid listen address {addr!r} (SVC_GATEWAY_ADDR): expected [host]:port, "
            "e.g. :8780, 127.0.0.1:8780 or [::1]:8780 (an IPv6 host in brackets)"
        )
    host = host[1:-1] if bracketed else host
    return (host or None), port


# --- the settings service ------------------------------------------------------------------


class _StreamReader(Protocol):
    async def read_stream(
        self,
        stream_id: str,
        from_version: int = 1,
        *,
        workspace_id: str | None = None,
        to_version: int | None = None,
    ) -> list[RecordedEvent]: ...


class SecretVault(Protocol):
    """Where secret setting values live, outside the log, by version (gateway/secrets.py)."""

    async def put(self, key: str, value: str, version: str) -> None: ...

    async def prune(self, key: str, keep: str) -> None: ...

    async def delete(self, key: str) -> None: ...

    async def all(self) -> dict[str, dict[str, str]]: ...

    def changing(self, key: str) -> AbstractAsyncContextManager[None]:
        """Held, by every process on the database, across one change of the key: its value's
        write, the event, and the deletion of the versions no event names any more."""
        ...


def settings_actor_key() -> ActorKey:
    return ActorKey(KIND, SETTINGS_STREAM_ID)


def replay_settings(events: Iterable[RecordedEvent]) -> SettingsState:
    """Rebuild the settings actor's state from its recorded events."""
    behaviour = SettingsBehaviour()
    state = behaviour.initial_state(settings_actor_key())
    for recorded in events:
        decoded = EVENTS.decode(recorded.type, recorded.schema_version, recorded.data)
        state = behaviour.evolve(state, decoded)
    return state


async def read_stored_settings(store: _StreamReader, vault: SecretVault) -> dict[str, str]:
    """The stored layer: the settings stream's values, secrets filled from the vault."""
    return (await read_stored_layer(store, vault)).values


@dataclass(frozen=True, slots=True)
class StoredLayer:
    values: dict[str, str]
    """Each stored key's value, a secret's from the vault."""
    changes: dict[str, StoredSetting]
    """Each stored key's last change as the stream records it (when, by whom)."""
    version: int
    """The settings stream's version it was read at (0: no setting ever stored)."""
    recorded: frozenset[str]
    """Every key the stream holds a value of, `values` or not (a secret whose vault row is
    missing, a value no longer valid): what an unset has to record the end of."""


async def read_stored_layer(store: _StreamReader, vault: SecretVault) -> StoredLayer:
    """The stored layer: the settings stream's values, secrets filled from the vault, with
    when and by whom each was set.

    The stream and the vault are two reads: a set in between (its new row written, its
    event recorded, the row the first read named pruned) leaves a secret's named version
    missing from the vault read. The two are read again then, a few times at most; a
    version still missing (its row deleted by hand) is said, by key, and the key unset."""
    for _ in range(STORED_READ_TRIES):
        events = await store.read_stream(
            f"{KIND}:{SETTINGS_STREAM_ID}", workspace_id=INSTANCE_WORKSPACE_ID
        )
        state = replay_settings(events)
        secrets = await vault.all()
        missing = [
            key
            for key, stored in state.values.items()
            if stored.secret and (stored.secret_version or "") not in secrets.get(key, {})
        ]
        if not missing:
            break
    for key in missing:
        log.warning(
            "the stored value of %s is missing from the secrets table; set it again "
            "(svc settings set %s)",
            key,
            key,
        )
    out: dict[str, str] = {}
    for key, stored in state.values.items():
        # A secret's value is the vault row of the version its newest event names.
        version = stored.secret_version or ""
        value = secrets.get(key, {}).get(version) if stored.secret else stored.value
        if value is not None and key in CATALOG:
            out[key] = value
    read_at = events[-1].version if events else 0
    changes = {key: state.values[key] for key in out}
    return StoredLayer(out, changes, read_at, frozenset(state.values))


STORED_READ_TRIES = 3


def storable_spec(key: str) -> SettingSpec:
    """The catalog entry of a key that may be stored (set or unset), else InvalidInput."""
    spec = get_spec(key)
    if not spec.storable:
        raise InvalidInput(f"{key} cannot be stored: {spec.note}", code="setting_not_storable")
    return spec


def storable_value(key: str, raw: str) -> str:
    """`raw` as a stored value of `key` holds it (" 3 " is "3"), or InvalidInput naming
    what is wrong: checked before anything is opened or written."""
    spec = storable_spec(key)
    if not is_utf8(raw):
        # A byte the locale could not decode (standard input): the driver's refusal would
        # quote the value, a secret's included. Never quoted here. (The environment may hold
        # such bytes, a Latin-1 path: it is read, not stored.)
        raise InvalidInput(
            f"invalid value for {key}: not UTF-8 text; write the value in UTF-8",
            code="invalid_setting_value",
        )
    check_stored_length(spec, raw)
    value = parse(spec, raw)
    check_given(spec, raw)
    check_set(spec, raw)
    return stored_text(spec, raw, value)


class SettingsService:
    """set / get / list / unset, written through the settings actor, applied to `Settings`."""

    def __init__(
        self,
        settings: Settings,
        runtime: ActorRuntime,
        store: _StreamReader,
        vault: SecretVault,
        *,
        serving: bool = True,
    ) -> None:
        """`serving`: this process is the service (the admin API), whose running values a
        change is judged against; a CLI process (False) runs nothing a restart would
        change, so a restart key's change always says a restart is required."""
        self._settings = settings
        self._serving = serving
        self._runtime = runtime
        self._store = store
        self._vault = vault
        self._stored: dict[str, str] = dict(settings.stored_layer())
        self._changes: dict[str, StoredSetting] = {}
        self._recorded: frozenset[str] = frozenset(self._stored)
        # A refresh reads the stored layer, then applies it: a set committed between the two
        # was undone by the stale read until the next refresh. One change at a time.
        self._changing = asyncio.Lock()

    @property
    def settings(self) -> Settings:
        return self._settings

    async def stored_values(self) -> dict[str, str]:
        """The stored layer's values; who set each, and when, is kept for the listings."""
        return (await self._read_layer()).values

    async def _read_layer(self) -> StoredLayer:
        layer = await read_stored_layer(self._store, self._vault)
        self._changes = layer.changes
        self._recorded = layer.recorded
        return layer

    async def load(self) -> None:
        """At startup: apply every stored value."""
        layer = await self._read_layer()
        self._stored = layer.values
        self._settings.load_stored(self._stored, layer.version)

    async def refresh(self) -> list[str]:
        """Re-read the stored layer (after a change by another process); returns changed keys."""
        async with self._changing:
            return await self._refresh()

    async def _refresh(self) -> list[str]:
        layer = await self._read_layer()
        fresh = layer.values
        changed = sorted(
            k for k in set(fresh) | set(self._stored) if fresh.get(k) != self._stored.get(k)
        )
        self._stored = fresh
        for key in changed:
            self._settings.apply_stored(key, fresh.get(key), layer.version)
        return changed

    async def set(self, key: str, raw: str, by: str | None = None) -> SettingChangeResult:
        """`by`: who sets it, recorded with the change (`key:<id>`, `user:<id>`, `cli:...`)."""
        raw = storable_value(key, raw)
        spec = get_spec(key)
        async with self._changing, self._secret_changing(spec):
            return await self._set(spec, key, raw, by)

    async def _set(
        self, spec: SettingSpec, key: str, raw: str, by: str | None
    ) -> SettingChangeResult:
        # A secret's value is written first, under a version of its own that the event then
        # names: if the event is never recorded, the version in force stays in force.
        version = uuid.uuid4().hex if spec.secret else None
        if version is not None:
            await self._vault.put(key, raw, version)
        command = SetSetting(
            command_id=_command_id(),
            workspace_id=INSTANCE_WORKSPACE_ID,
            key=key,
            value=None if spec.secret else raw,
            secret=spec.secret,
            secret_version=version,
            at=datetime.now(UTC),
            by=by,
        )
        outcome = await self._runtime.ask(settings_actor_key(), command)
        if version is not None:
            await self._prune(key, version)
        self._stored[key] = raw
        if outcome.events:  # a set to the value stored records nothing: its author stays
            self._changes[key] = StoredSetting(
                value=command.value, secret=spec.secret, at=command.at, by=by
            )
        self._settings.apply_stored(key, raw, outcome.last_version)
        return _change_result(spec, self._settings, self._serving)

    async def unset(self, key: str, by: str | None = None) -> SettingChangeResult:
        spec = storable_spec(key)
        async with self._changing, self._secret_changing(spec):
            return await self._unset(spec, key, by)

    async def _unset(self, spec: SettingSpec, key: str, by: str | None) -> SettingChangeResult:
        await self._refresh()
        # The stream, not the values in force, says whether there is something to unset: a
        # secret whose vault row went missing is in force nowhere, yet stays stored (and
        # warned of at every start) until an unset is recorded.
        if key not in self._recorded:
            if spec.secret:
                # An unset recorded before its values were deleted (the delete failed, or
                # the ask timed out and the command went on): this retry deletes them.
                await self._vault.delete(key)
            shown = display_value(spec, self._settings.resolve(key).raw)
            return SettingChangeResult(
                key=key,
                value=shown,
                applied=True,
                restart_required=False,
                message=f"{key}: nothing stored to unset; it stays {_blank_shown(shown)}",
            )
        command = UnsetSetting(
            command_id=_command_id(),
            workspace_id=INSTANCE_WORKSPACE_ID,
            key=key,
            at=datetime.now(UTC),
            by=by,
        )
        outcome = await self._runtime.ask(settings_actor_key(), command)
        if spec.secret:
            await self._vault.delete(key)
        self._stored.pop(key, None)
        self._changes.pop(key, None)
        self._settings.apply_stored(key, None, outcome.last_version)
        return _change_result(spec, self._settings, self._serving, removed=True)

    def _secret_changing(self, spec: SettingSpec) -> AbstractAsyncContextManager[None]:
        """A secret's changes, one at a time across processes: an unset deletes every
        version of the value, and one racing another process's set deleted the version
        that set's event (the newer) names, leaving the key set to nothing."""
        return self._vault.changing(spec.key) if spec.secret else nullcontext()

    async def _prune(self, key: str, keep: str) -> None:
        """The key's older versions: only the one the newest event names is ever read."""
        try:
            await self._vault.prune(key, keep)
        except StoreError as exc:  # they are never read; the next set tries again
            log.warning("could not delete the older values of %s: %s", key, exc.message)

    def get(self, key: str) -> SettingView:
        return self._view(get_spec(key))

    def list(self) -> SettingList:
        return SettingList(
            settings=[self._view(spec) for spec in CATALOG.values()],
            catalog_total_stated=SPEC_TOTAL,
        )

    def _view(self, spec: SettingSpec) -> SettingView:
        return view(self._settings, spec, self._changes.get(spec.key))


_LAYER_NAMES = {
    Source.DEFAULT: "the default",
    Source.ENVIRONMENT: "from the environment",
    Source.ENV_FILE: "from the env file",
    Source.STORED: "stored",
}
"""Where the value an unset leaves comes from, as its answer says it."""


def _blank_shown(shown: str) -> str:
    """A value as a message says it: a blank one as such, not as nothing."""
    return shown if shown else "(blank)"


def _command_id() -> str:
    return f"settings-{uuid.uuid4()}"


def _change_result(
    spec: SettingSpec, settings: Settings, serving: bool, *, removed: bool = False
) -> SettingChangeResult:
    """What the change means now: the value the next start uses, and whether the serving
    process already uses it (a live key applied, or a restart key set to what it runs).
    `removed`: the change was an unset, whose value is the next layer's."""
    resolved = settings.resolve(spec.key)
    raw = resolved.raw
    shown = display_value(spec, raw)
    runs_it = same_setting(spec, settings.raw(spec.key), raw)
    in_force = runs_it and (serving or spec.live)
    if in_force:
        effect = "applied"
    elif serving:
        effect = "restart required"
    else:
        # The CLI serves nothing: whether a running gateway already uses the value is that
        # gateway's to say (the CLI said "restart required" of a value it ran).
        effect = (
            f"{'' if removed else 'stored; '}a gateway uses it from its next start (a running "
            f"one says whether a restart is pending: GET /v1/admin/settings/{spec.key})"
        )
    if removed:
        # `KEY = 3; stored` read as if a value had been stored, not taken away.
        message = (
            f"{spec.key}: the stored value is removed; it is now {_blank_shown(shown)} "
            f"({_LAYER_NAMES[resolved.source]}); {effect}"
        )
    else:
        message = f"{spec.key} = {_blank_shown(shown)}; {effect}"
    surprise = dialect_surprise(spec, raw)
    if surprise is not None:
        message += f"; note: {surprise}"
    if spec.key not in _acted_on():
        # Said where the change is made, not only in docs/settings.md's Used column: an
        # operator who turns a capability on must not wait for what this build lacks.
        message += "; note: this build stores it but does not act on it yet (docs/settings.md)"
    if (
        spec.key == "SVC_DEFAULT_WORKSPACE_ID"
        and not runs_it
        and default_workspace_of(settings.raw(spec.key)) != default_workspace_of(raw)
    ):
        # The instance's settings and SSO secrets are managed from the default workspace
        # (gateway/auth.py require_instance_admin): after the restart, this admin's keys no
        # longer reach them, and the new workspace has none yet. (Judged by the value this
        # process read: a CLI serves nothing, so "restart required" says nothing here.)
        # The workspace the value names, as the next start reads it: blank is "default", and
        # spaces around it are not part of it.
        workspace = default_workspace_of(raw)
        message += (
            f"; note: after the restart, instance settings are managed by admins of "
            f"{workspace!r}: issue one a key first (svc apikeys create --scopes '*' "
            f"--workspace {shlex.quote(workspace)})"
        )
    return SettingChangeResult(
        key=spec.key, value=shown, applied=in_force, restart_required=not in_force, message=message
    )


@functools.cache
def _acted_on() -> frozenset[str]:
    """The catalog keys this build's code reads (as docs/settings.md's Used column says)."""
    from schemas.catalogue import keys_read_by_code

    return keys_read_by_code()


def same_setting(spec: SettingSpec, one: str | None, other: str | None) -> bool:
    """Whether two texts of `spec` are one value to its readers (`" 5"` and `5`, `DEBUG` and
    `debug`, `30s` and `30`): a restart to go from one to the other changes nothing."""
    if one == other:
        return True
    if one is None or other is None:
        return False
    try:
        return parse_or_coerce(spec, one) == parse_or_coerce(spec, other)
    except InvalidInput:
        return False


def view(settings: Settings, spec: SettingSpec, change: StoredSetting | None = None) -> SettingView:
    """`change`: the stored value's last change, shown while the stored value is in force."""
    resolved = settings.resolve(spec.key)
    shown = change if resolved.source is Source.STORED else None
    running = settings.raw(spec.key)
    return SettingView(
        key=spec.key,
        group=spec.group,
        type=spec.type,
        value=display_value(spec, resolved.raw),
        source=resolved.source.value,
        running_value=display_value(spec, running),
        restart_pending=not same_setting(spec, running, resolved.raw),
        default=display_value(spec, spec.default) if spec.secret else spec.default,
        apply=spec.apply,
        secret=spec.secret,
        choices=list(spec.choices),
        effect=spec.effect,
        note=spec.note,
        changed_at=shown.at if shown else None,
        changed_by=shown.by if shown else None,
    )
