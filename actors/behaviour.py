"""What a logical actor kind is: a pure core (decide/evolve) and an optional handler shell.

`decide(state, command) -> events` and `evolve(state, event) -> state` do no I/O. A kind that
needs side effects (a model call, a tool) overrides `handle`, an async generator that calls
`ctx.execute(command)` for each durable step and yields whatever the caller should receive
(stream deltas, the final result). `ask` returns the last item yielded; `stream` yields all.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar, Generic, Protocol, TypeVar

from pydantic import BaseModel

from schemas.commands import Command
from schemas.errors import SvcError
from schemas.events import Event

S = TypeVar("S", bound=BaseModel)
S_co = TypeVar("S_co", bound=BaseModel, covariant=True)


@dataclass(frozen=True, slots=True)
class ActorKey:
    kind: str
    id: str

    @property
    def stream_id(self) -> str:
        return f"{self.kind}:{self.id}"

    def __str__(self) -> str:
        return self.stream_id


@dataclass(frozen=True, slots=True)
class CommandOutcome:
    """What one durable step produced. `duplicate`: the command id was processed before and
    `events` are the ones that first run recorded."""

    key: ActorKey
    events: tuple[Event, ...]
    first_version: int
    last_version: int
    cursor: str
    duplicate: bool = False


class ActorContext(Protocol[S_co]):
    @property
    def key(self) -> ActorKey: ...

    @property
    def state(self) -> S_co: ...

    @property
    def version(self) -> int: ...

    @property
    def streaming(self) -> bool:
        """Whether the running command has a reader for its intermediate items (a `stream`)
        or only for its last one (an `ask` or a `tell`)."""
        ...

    interruption: SvcError | None
    """What the caller is told if the runtime's stop cuts the running command short from
    here on (None: `CommandInterrupted`'s own message, which says nothing was recorded)."""

    async def execute(self, command: Command) -> CommandOutcome:
        """decide -> append (expected version, command id) -> evolve; on a concurrency
        conflict reload from the store and decide again, a bounded number of times."""
        ...

    async def recorded(self, command_id: str, workspace_id: str) -> tuple[Event, ...]:
        """The events `command_id` (of `workspace_id`) appended to this actor's stream, as
        the processed-commands ledger knows them; empty when it appended none here. For what
        a state keeps only a reference to (a long answer), read again when asked for."""
        ...

    async def earlier_run(self, command: Command) -> CommandOutcome | None:
        """What `command`'s id did when it ran before, by the ledger (None if it never
        ran); Conflict `idempotency_key_reused` when it ran for another request."""
        ...

    async def refresh(self) -> bool:
        """Apply what other writers appended to the stream since this state (another
        process hosting the same actor); True when there was anything. For an answer given
        from the state alone that must not be a stale one."""
        ...


class Behaviour(Generic[S]):
    kind: ClassVar[str]
    state_type: ClassVar[type[BaseModel]]
    state_schema_version: ClassVar[int] = 1

    def initial_state(self, key: ActorKey) -> S:
        raise NotImplementedError

    def decide(self, state: S, command: Command) -> Sequence[Event]:
        raise NotImplementedError

    def evolve(self, state: S, event: Event) -> S:
        raise NotImplementedError

    async def handle(self, ctx: ActorContext[S], command: Command) -> AsyncIterator[Any]:
        yield await ctx.execute(command)
