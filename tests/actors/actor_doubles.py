"""Behaviours and model providers used by the actor tests.

The counter is a minimal actor kind whose state records the order commands were applied in.
The providers stand in for the upstream model server only; the store is always the real one.
Everything here is importable by module path and picklable, so a runtime hosting actors in
other processes (ray) can build the same behaviours.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar, Protocol

from pydantic import BaseModel, ConfigDict, Field

from actors.behaviour import ActorContext, ActorKey, Behaviour
from actors.models.port import Finished, ModelEvent, ModelRequest, TextDelta, Usage
from actors.runtime import ActorRuntime
from actors.table import TableStats
from schemas.commands import Command
from schemas.errors import InvalidInput, UpstreamError
from schemas.events import Event, event

COUNTER = "counter"


class RuntimeUnderTest(ActorRuntime, Protocol):
    """The port plus the stats every runtime exposes for metrics and `svc cluster status`."""

    async def stats(self) -> TableStats: ...


MakeRuntime = Callable[..., Awaitable[RuntimeUnderTest]]


@event
class CounterAdded(Event):
    type_name: ClassVar[str] = "test.counter_added"
    amount: int
    note: str


class AddToCounter(Command):
    amount: int = 1
    note: str = ""
    delay_s: float = Field(default=0.0, ge=0.0)
    """The handler sleeps this long before deciding: a command that stays in progress."""


class ReadCounter(Command):
    """A query: answered from the actor's state, records nothing."""


class CounterState(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")
    total: int = 0
    notes: tuple[str, ...] = ()


@dataclass(frozen=True, slots=True)
class CounterView:
    total: int
    notes: tuple[str, ...]
    version: int


class CounterBehaviour(Behaviour[CounterState]):
    kind: ClassVar[str] = COUNTER
    state_type: ClassVar[type[BaseModel]] = CounterState

    def initial_state(self, key: ActorKey) -> CounterState:
        return CounterState()

    def decide(self, state: CounterState, command: Command) -> Sequence[Event]:
        if not isinstance(command, AddToCounter):
            raise InvalidInput(f"a counter does not handle {type(command).__name__}")
        if command.amount == 0:
            raise InvalidInput("adding 0 changes nothing")
        if command.amount < 0:
            raise ValueError(f"a counter cannot take {command.amount}")  # a defect, not a 4xx
        return [CounterAdded(amount=command.amount, note=command.note)]

    def evolve(self, state: CounterState, e: Event) -> CounterState:
        assert isinstance(e, CounterAdded)
        return CounterState(total=state.total + e.amount, notes=(*state.notes, e.note))

    async def handle(self, ctx: ActorContext[CounterState], command: Command) -> AsyncIterator[Any]:
        if isinstance(command, ReadCounter):
            yield CounterView(ctx.state.total, ctx.state.notes, ctx.version)
            return
        if isinstance(command, AddToCounter) and command.delay_s:
            await asyncio.sleep(command.delay_s)
        yield await ctx.execute(command)


class CounterBehaviourV2(CounterBehaviour):
    """Same kind with a newer state schema: older snapshots are ignored (full replay)."""

    state_schema_version: ClassVar[int] = 2


# --- model providers ------------------------------------------------------------------------


class ScriptedProvider:
    """Serves `model`; answers with `deltas`, then stop with fixed usage. The last delta names
    the call number, so a second model call for one turn would be visible in the answer."""

    name = "scripted"

    def __init__(
        self,
        model: str = "scripted",
        deltas: Sequence[str] = ("Hel", "lo", " world"),
        delay_s: float = 0.0,
        fail_after: int | None = None,
        failure: Exception | None = None,
    ) -> None:
        """`fail_after`: raise `failure` (an upstream 502 by default) before that delta."""
        self.model = model
        self.deltas = tuple(deltas)
        self.delay_s = delay_s
        self.fail_after = fail_after
        self.failure = failure or UpstreamError("the upstream model server answered 502")
        self.calls = 0
        self.requests: list[ModelRequest] = []

    def serves(self, model: str) -> bool:
        return model == self.model

    async def stream(self, request: ModelRequest) -> AsyncIterator[ModelEvent]:
        self.calls += 1
        self.requests.append(request)
        for i, text in enumerate(self.deltas):
            if self.fail_after is not None and i == self.fail_after:
                raise self.failure
            if self.delay_s:
                await asyncio.sleep(self.delay_s)
            yield TextDelta(text)
        yield TextDelta(f" #{self.calls}")
        prompt = sum(len(m.content.split()) for m in request.messages)
        yield Finished("stop", Usage(prompt_tokens=prompt, completion_tokens=len(self.deltas) + 1))


def answer(provider: ScriptedProvider, call: int) -> str:
    return "".join(provider.deltas) + f" #{call}"
