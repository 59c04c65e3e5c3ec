"""UpdateAgent (one PATCH of /v1/admin/agents): every given field in one atomic decision."""

from __future__ import annotations

from datetime import UTC, datetime

import pytest

from actors.agent import AgentBehaviour, AgentState, agent_key
from schemas.agent import (
    AgentModelChanged,
    AgentParameters,
    AgentParametersChanged,
    AgentProfileUpdated,
    ArchiveAgent,
    CreateAgent,
    UpdateAgent,
)
from schemas.errors import Conflict, InvalidInput, NotFound

WS = "ws-1"
T = datetime(2026, 1, 1, tzinfo=UTC)
agents = AgentBehaviour()


def created() -> AgentState:
    state = agents.initial_state(agent_key("a-1"))
    create = CreateAgent(
        command_id="c1", workspace_id=WS, name="ada", model="m1", system_prompt="p", at=T
    )
    for event in agents.decide(state, create):
        state = agents.evolve(state, event)
    return state


def update(**fields: object) -> UpdateAgent:
    return UpdateAgent.model_validate({"command_id": "u1", "workspace_id": WS, "at": T, **fields})


def test_update_records_each_changed_part_once() -> None:
    params = AgentParameters(top_p=0.3)
    events = agents.decide(created(), update(name="ada2", model="m2", parameters=params))
    assert [type(e) for e in events] == [
        AgentProfileUpdated,
        AgentModelChanged,
        AgentParametersChanged,
    ]
    state = created()
    for event in events:
        state = agents.evolve(state, event)
    assert (state.name, state.system_prompt, state.model, state.parameters) == (
        "ada2",
        "p",
        "m2",
        params,
    )


def test_update_to_the_same_values_records_nothing() -> None:
    assert agents.decide(created(), update(name="ada", model="m1")) == []


def test_update_refusals() -> None:
    with pytest.raises(InvalidInput, match="at least one"):
        agents.decide(created(), update())
    with pytest.raises(NotFound):
        agents.decide(created(), update(name="x", workspace_id="ws-2"))
    archived = created()
    for event in agents.decide(archived, ArchiveAgent(command_id="a", workspace_id=WS, at=T)):
        archived = agents.evolve(archived, event)
    with pytest.raises(Conflict, match="archived"):
        agents.decide(archived, update(model="m3"))
