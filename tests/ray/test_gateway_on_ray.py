"""The gateway on the Ray runtime, built by the composition root from settings alone: a chat
turn over HTTP runs on a Ray actor host, and /metrics reports each host's actor table."""

from __future__ import annotations

import re
import uuid
from collections.abc import Iterator

import pytest
import ray
from platform_support import running, settings_for
from ray.cluster_utils import Cluster

from actors.shards import host_name

HOSTS = 2


@pytest.fixture
def cluster_name() -> Iterator[str]:
    """A cluster of its own; its hosts are ended afterwards (a gateway that joined a running
    Ray leaves its detached hosts up, as in production)."""
    name = f"g{uuid.uuid4().hex[:10]}"
    yield name
    for index in range(HOSTS):
        try:
            ray.kill(ray.get_actor(host_name(name, index), namespace="svc"))
        except ValueError:
            pass  # never started


def host_series(text: str, metric: str) -> dict[str, float]:
    return {
        host: float(value)
        for host, value in re.findall(rf'^{metric}\{{host="([^"]+)"\}} (\S+)$', text, re.M)
    }


async def test_chat_runs_on_ray_hosts_and_metrics_report_each_host(
    ray_cluster: Cluster, database_url: str, cluster_name: str
) -> None:
    settings = settings_for(
        database_url,
        SVC_ACTOR_RUNTIME="ray",
        SVC_RAY_ADDRESS=ray_cluster.address,
        SVC_RAY_CLUSTER=cluster_name,
        SVC_ACTOR_HOSTS=str(HOSTS),
    )
    async with running(settings) as svc:
        key, _ = await svc.issue_key(f"ws-{uuid.uuid4().hex[:8]}", ["chat", "admin:read"])
        hello = {"model": "svc-offline", "messages": [{"role": "user", "content": "hi"}]}
        for _ in range(3):
            status, body, _ = await svc.request("POST", "/v1/chat/completions", key, json=hello)
            assert status == 200, body
            assert body["choices"][0]["message"]["content"]

        status, text, _ = await svc.request("GET", "/metrics")
        assert status == 200
        active = host_series(text, "svc_actor_host_active")
        commands = host_series(text, "svc_actor_host_commands_total")
        hosts = {host_name(cluster_name, i) for i in range(HOSTS)}
        assert set(active) == hosts and set(commands) == hosts
        # The workspace actor (the key) and three conversations, wherever the shards put them.
        assert sum(active.values()) >= 4
        assert sum(commands.values()) >= 4
        # This process hosts no actors: its own table's series are absent.
        assert not re.search(r"^svc_actor_active ", text, re.M)
