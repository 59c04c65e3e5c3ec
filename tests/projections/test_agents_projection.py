"""The `agents` read model: built from the agent events, rebuilt from the log, scoped by
workspace in the database (ARCHITECTURE.md decision 6)."""

from __future__ import annotations

from projection_events import append, at

from eventstore import Database, PostgresEventStore
from projections import ProjectionRunner, agent_queries
from projections.agents import AgentsProjector
from schemas.agent import (
    AgentArchived,
    AgentCreated,
    AgentModelChanged,
    AgentParameters,
    AgentParametersChanged,
    AgentProfileUpdated,
)

A, B = "ws-a", "ws-b"


def created(ws: str, agent_id: str, name: str) -> AgentCreated:
    return AgentCreated(
        agent_id=agent_id,
        workspace_id=ws,
        name=name,
        description="",
        model="m1",
        system_prompt="be kind",
        parameters=AgentParameters(temperature=0.1),
        command_id=f"create-{agent_id}",
        at=at(0),
    )


async def _history(store: PostgresEventStore) -> None:
    for ws in (A, B):
        await append(store, ws, f"agent:{ws}-1", created(ws, f"{ws}-1", "ada"))
    stream = f"agent:{A}-1"
    await append(
        store,
        A,
        stream,
        AgentProfileUpdated(
            agent_id=f"{A}-1", name="ada2", description="d", system_prompt="p", at=at(1)
        ),
        AgentModelChanged(agent_id=f"{A}-1", model="m2", at=at(2)),
        AgentParametersChanged(
            agent_id=f"{A}-1", parameters=AgentParameters(max_tokens=9), at=at(3)
        ),
    )
    await append(store, A, f"agent:{A}-2", created(A, f"{A}-2", "bob"))
    await append(store, A, f"agent:{A}-2", AgentArchived(agent_id=f"{A}-2", at=at(4)))


async def test_agents_follow_their_events_and_rebuild_alike(
    store: PostgresEventStore, db: Database
) -> None:
    await _history(store)
    runner = ProjectionRunner(db, [AgentsProjector()])
    await runner.catch_up()
    first = await agent_queries.list_agents(db, A, include_archived=True)
    ada, bob = first
    assert (ada.name, ada.description, ada.model, ada.system_prompt) == ("ada2", "d", "m2", "p")
    assert ada.parameters == AgentParameters(max_tokens=9) and ada.updated_at == at(3)
    assert bob.archived and bob.archived_at == at(4)
    assert [a.agent_id for a in await agent_queries.list_agents(db, A)] == [f"{A}-1"]
    assert await agent_queries.find_active_agent(db, A, "ada2") == ada
    assert await agent_queries.find_active_agent(db, A, "bob") is None

    await runner.rebuild("agents")
    assert await agent_queries.list_agents(db, A, include_archived=True) == first


async def test_a_workspace_sees_only_its_agents(store: PostgresEventStore, db: Database) -> None:
    await _history(store)
    await ProjectionRunner(db, [AgentsProjector()]).catch_up()
    assert [a.agent_id for a in await agent_queries.list_agents(db, B)] == [f"{B}-1"]
    assert await agent_queries.get_agent(db, B, f"{A}-1") is None
    assert (await agent_queries.find_active_agent(db, B, "ada")) is not None
    assert await agent_queries.find_active_agent(db, A, "ada") is None
    async with db.scoped(B) as conn:
        # Hostile: no WHERE at all; row-level security still filters.
        rows = await conn.fetch("SELECT workspace_id FROM agents")
    assert {r["workspace_id"] for r in rows} == {B}


async def test_updated_at_never_goes_back_with_a_clock_that_did(
    store: PostgresEventStore, db: Database
) -> None:
    """Events apply in commit order; their times are each writer's clock, which may step
    back (NTP) or lag another host's: the last change's time is the latest one seen."""
    stream = f"agent:{A}-9"
    await append(store, A, stream, created(A, f"{A}-9", "cy"))
    await append(store, A, stream, AgentModelChanged(agent_id=f"{A}-9", model="m2", at=at(5)))
    for late in (
        AgentModelChanged(agent_id=f"{A}-9", model="m3", at=at(2)),
        AgentParametersChanged(agent_id=f"{A}-9", parameters=AgentParameters(), at=at(2)),
        AgentProfileUpdated(
            agent_id=f"{A}-9", name="cy", description="", system_prompt="", at=at(2)
        ),
        AgentArchived(agent_id=f"{A}-9", at=at(3)),
    ):
        await append(store, A, stream, late)
    await ProjectionRunner(db, [AgentsProjector()]).catch_up()
    agent = await agent_queries.get_agent(db, A, f"{A}-9")
    assert agent is not None and agent.model == "m3" and agent.archived
    assert agent.updated_at == at(5)
