"""Fixtures of the actor tests: every runtime, over a real event store.

`make_runtime(behaviours, **table_options)` builds and starts a runtime of the current
parameter (runtimes built by one test share its database); `runtime` is one with the default
test behaviours. A runtime parameter must provide the `ActorRuntime` port plus
`async stats() -> actors.TableStats` (summed over its hosts), and accept the table options
`snapshot_every`, `idle_s`, `max_active`, `conflict_retries`.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Sequence
from typing import Any

import pytest
from actor_doubles import (
    CounterBehaviour,
    MakeRuntime,
    RuntimeUnderTest,
    ScriptedProvider,
)

from actors import ActivationTable, Behaviour, ConversationBehaviour, LocalRuntime
from eventstore import (
    Database,
    PostgresEventStore,
)

RUNTIMES = ["local"]


@pytest.fixture
def store(store_db: Database) -> PostgresEventStore:
    """The real PostgreSQL store; actors need no log tailer, so none is started."""
    return PostgresEventStore(store_db)


@pytest.fixture(params=RUNTIMES)
async def make_runtime(
    request: pytest.FixtureRequest, store: PostgresEventStore
) -> AsyncIterator[MakeRuntime]:
    started: list[RuntimeUnderTest] = []

    async def make(behaviours: Sequence[Behaviour[Any]], **options: Any) -> RuntimeUnderTest:
        if request.param == "local":
            runtime = LocalRuntime(ActivationTable(store, behaviours, **options))
        else:
            raise AssertionError(f"unknown runtime {request.param}")
        await runtime.start()
        started.append(runtime)
        return runtime

    yield make
    for runtime in started:
        await runtime.stop(deadline_s=5.0)


@pytest.fixture
def provider() -> ScriptedProvider:
    return ScriptedProvider()


@pytest.fixture
async def runtime(make_runtime: MakeRuntime, provider: ScriptedProvider) -> RuntimeUnderTest:
    return await make_runtime([CounterBehaviour(), ConversationBehaviour([provider])])
