"""Domain events as registered, versioned pydantic records.

An event class names its wire `type_name` and `schema_version`. The registry encodes events to
`(type, schema_version, data)` for the store and decodes stored rows back, running upcasters
first so that code only ever sees the current version of each event.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any, ClassVar, TypeVar

from pydantic import BaseModel, ConfigDict, ValidationError

from schemas.errors import InvalidInput, SvcError, Unavailable


class Event(BaseModel):
    """Base of every domain event. Subclasses are past-tense, frozen and registered."""

    model_config = ConfigDict(frozen=True, extra="forbid")
    type_name: ClassVar[str] = ""
    schema_version: ClassVar[int] = 1


E = TypeVar("E", bound=type[Event])
Upcaster = Callable[[dict[str, Any]], dict[str, Any]]


class UnknownEventType(InvalidInput):
    pass


class StoredEventUnreadable(SvcError):
    """A stored event this process cannot read (no upcaster for its version, data that does
    not match its schema): a fault of the log or of this code, never of the client's request,
    so a 500 and not a 400."""

    default_code = "stored_event_unreadable"


class EventFromNewerVersion(StoredEventUnreadable, Unavailable):
    """A stored event written by a newer version of SVC than this process runs (its schema
    version is ahead of this code's, or its type is unknown here): after a rollback, or while
    a deploy mixes versions. Reading it as if current would misread it; the fix is to upgrade
    this process, so it is a 503 (another process may serve the request), and projections wait
    on it instead of stopping on it as a poison event."""

    default_code = "event_from_newer_version"

    def __init__(self, type_name: str, detail: str) -> None:
        super().__init__(
            f"stored {type_name!r} event was written by a newer version of SVC ({detail}); "
            "upgrade this process to the version that wrote it (docs/operations.md, "
            "'Upgrading')"
        )
        self.type_name = type_name


class EventRegistry:
    def __init__(self) -> None:
        self._types: dict[str, type[Event]] = {}
        self._upcasters: dict[tuple[str, int], Upcaster] = {}

    def register(self, cls: E) -> E:
        name = cls.type_name
        if not name:
            raise TypeError(f"{cls.__name__} needs a type_name")
        existing = self._types.get(name)
        if existing is not None and existing is not cls:
            raise TypeError(f"event type {name!r} registered twice")
        self._types[name] = cls
        return cls

    def upcaster(self, type_name: str, from_version: int) -> Callable[[Upcaster], Upcaster]:
        """Register a function turning `from_version` data into `from_version + 1` data."""

        def add(fn: Upcaster) -> Upcaster:
            self._upcasters[(type_name, from_version)] = fn
            return fn

        return add

    def event_class(self, type_name: str) -> type[Event]:
        try:
            return self._types[type_name]
        except KeyError:
            raise UnknownEventType(f"unknown event type {type_name!r}") from None

    def known_types(self) -> list[str]:
        return sorted(self._types)

    def knows(self, type_name: str) -> bool:
        return type_name in self._types

    def encode(self, event: Event) -> tuple[str, int, dict[str, Any]]:
        cls = type(event)
        if self._types.get(cls.type_name) is not cls:
            raise TypeError(f"{cls.__name__} is not registered")
        return cls.type_name, cls.schema_version, event.model_dump(mode="json")

    def upcast(self, type_name: str, version: int, data: Mapping[str, Any]) -> dict[str, Any]:
        """Stored data of `version` as data of the current schema version."""
        current = self._stored_class(type_name).schema_version
        if version > current:  # no upcaster can go back: this code does not know that shape
            raise EventFromNewerVersion(
                type_name, f"schema version {version}; this process knows up to {current}"
            )
        out = dict(data)
        while version < current:
            step = self._upcasters.get((type_name, version))
            if step is None:
                raise StoredEventUnreadable(
                    f"no upcaster for {type_name!r} from schema version {version} to {current}"
                )
            out = step(out)
            version += 1
        return out

    def decode(self, type_name: str, version: int, data: Mapping[str, Any]) -> Event:
        """A stored event as its current class (upcast first)."""
        cls = self._stored_class(type_name)
        try:
            return cls.model_validate(self.upcast(type_name, version, data))
        except ValidationError as exc:
            raise StoredEventUnreadable(
                f"stored {type_name!r} event does not match its schema: {exc}"
            ) from exc

    def _stored_class(self, type_name: str) -> type[Event]:
        """The class of a stored event's type. Event classes are not removed while the log
        holds their events, so a stored type unknown here comes from a newer version."""
        cls = self._types.get(type_name)
        if cls is None:
            raise EventFromNewerVersion(type_name, "a type this process does not know")
        return cls


EVENTS = EventRegistry()
"""The process-wide registry; event modules register their classes here at import."""


def event(cls: E) -> E:
    """Class decorator: register an event class in the default registry."""
    return EVENTS.register(cls)
