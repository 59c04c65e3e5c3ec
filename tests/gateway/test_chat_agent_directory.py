"""The chat endpoint's cache of active agents by name (gateway.chat.AgentDirectory)."""

from __future__ import annotations

from collections import Counter
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest

from gateway import chat
from projections.agent_queries import Agent
from schemas.agent import AgentParameters

T0 = datetime(2026, 1, 1, tzinfo=UTC)
DB: Any = None  # the read model is replaced below; no database is reached


def agent(agent_id: str, workspace_id: str, name: str, created_s: int = 0) -> Agent:
    at = T0 + timedelta(seconds=created_s)
    return Agent(agent_id, workspace_id, name, "", "m", "", AgentParameters(), False, at, at, None)


@pytest.fixture
def read_model(monkeypatch: pytest.MonkeyPatch) -> tuple[dict[str, list[Agent]], Counter[str]]:
    """The `agents` read model as a dict by workspace, and how often each was read."""
    agents: dict[str, list[Agent]] = {}
    reads: Counter[str] = Counter()

    async def list_agents(db: Any, workspace_id: str) -> list[Agent]:
        reads[workspace_id] += 1
        return list(agents.get(workspace_id, []))

    monkeypatch.setattr(chat.agent_queries, "list_agents", list_agents)
    return agents, reads


async def test_one_read_per_workspace_within_the_ttl(
    read_model: tuple[dict[str, list[Agent]], Counter[str]],
) -> None:
    agents, reads = read_model
    agents["ws-a"] = [agent("agt_1", "ws-a", "ada")]
    directory = chat.AgentDirectory(ttl_s=60.0)
    for _ in range(3):
        assert await directory.find(DB, "ws-a", "ada") == agents["ws-a"][0]
        assert await directory.find(DB, "ws-a", "gpt-x") is None
        assert await directory.find(DB, "ws-b", "ada") is None
    assert reads == {"ws-a": 1, "ws-b": 1}


async def test_forget_and_expiry_read_again(
    read_model: tuple[dict[str, list[Agent]], Counter[str]],
) -> None:
    agents, reads = read_model
    directory = chat.AgentDirectory(ttl_s=60.0)
    assert await directory.find(DB, "ws-a", "ada") is None
    agents["ws-a"] = [agent("agt_1", "ws-a", "ada")]
    directory.forget("ws-a")
    assert await directory.find(DB, "ws-a", "ada") == agents["ws-a"][0]

    expiring = chat.AgentDirectory(ttl_s=0.0)
    await expiring.find(DB, "ws-a", "ada")
    await expiring.find(DB, "ws-a", "ada")
    assert reads == {"ws-a": 4}


async def test_the_oldest_of_two_agents_with_one_name_wins(
    read_model: tuple[dict[str, list[Agent]], Counter[str]],
) -> None:
    agents, _ = read_model
    older, newer = agent("agt_2", "ws-a", "ada", 0), agent("agt_1", "ws-a", "ada", 5)
    agents["ws-a"] = [newer, older]
    assert await chat.AgentDirectory().find(DB, "ws-a", "ada") == older
