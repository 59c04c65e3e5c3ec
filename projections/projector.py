"""The projector contract: a named consumer of the global log that owns some read-model tables.

A projector only says how one event changes its tables. Reading the log, batching, the
checkpoint and crash safety belong to the runner (runner.py), which calls `apply` inside the
transaction that also moves the projector's checkpoint.
"""

from __future__ import annotations

import functools
from abc import ABC, abstractmethod
from collections.abc import Awaitable, Callable
from typing import Any, ClassVar, TypeVar

from eventstore.db import Connection
from eventstore.records import RecordedEvent
from schemas.events import EVENTS, Event

E = TypeVar("E", bound=Event)


@functools.cache
def _every_event_type_registered() -> None:
    """Import every event module: whether a stored type is known (`handles`) must not depend
    on which modules this process happened to import."""
    from schemas.catalogue import load_all_event_modules

    load_all_event_modules()


def namespace_of(event_type: str) -> str:
    """`identity` for `identity.user_updated`: event types are `<namespace>.<what happened>`."""
    return event_type.partition(".")[0]


Handler = Callable[[Connection, RecordedEvent, Any], Awaitable[None]]


class Projector(ABC):
    """Base of every projector.

    Subclasses set `name` (the checkpoint key, stable forever) and `tables` (every table its
    handlers write or read: a rebuild replays into copies of them), and map event classes to
    handlers in `handlers()`. Events of other types are passed over (the checkpoint still
    moves past them), except a type this process does not know in a namespace the projector
    reads (the `identity` of `identity.totp_reset`): a newer version wrote it, and it may be
    the projector's, so the projector waits on it (EventFromNewerVersion) rather than pass
    it for good.

    Handlers get the batch's connection or a stand-in for it (pipeline.Pipeline) that offers
    `execute`, `fetch`, `fetchrow` and `fetchval`: use only those, and `pipeline.fold`, which
    takes either. They must not commit, open transactions or swallow database errors: the
    runner owns the transaction.
    """

    name: ClassVar[str]
    tables: ClassVar[tuple[str, ...]]

    def __init__(self) -> None:
        _every_event_type_registered()
        self._handlers: dict[str, Handler] = {
            cls.type_name: handler for cls, handler in self.handlers().items()
        }
        self._namespaces = frozenset(namespace_of(t) for t in self._handlers)

    @abstractmethod
    def handlers(self) -> dict[type[Event], Handler]:
        """Event class -> `async handler(conn, recorded, decoded_event)`."""

    @property
    def event_types(self) -> frozenset[str]:
        return frozenset(self._handlers)

    @property
    def namespaces(self) -> frozenset[str]:
        """The namespaces of the types it handles: `identity` for `identity.user_updated`."""
        return self._namespaces

    def handles(self, event_type: str) -> bool:
        """Whether `apply` has anything to do with an event of this type: a handler, or the
        type is unknown here in one of the projector's namespaces."""
        return event_type in self._handlers or (
            not EVENTS.knows(event_type) and namespace_of(event_type) in self._namespaces
        )

    async def apply(self, conn: Connection, event: RecordedEvent) -> None:
        """Apply one event. It is decoded through the registry so upcasters run first and
        handlers only ever see the current schema version; an unknown type raises
        EventFromNewerVersion there."""
        handler = self._handlers.get(event.type)
        if handler is None:
            if self.handles(event.type):
                EVENTS.decode(event.type, event.schema_version, event.data)
            return
        decoded = EVENTS.decode(event.type, event.schema_version, event.data)
        await handler(conn, event, decoded)
