"""The gateway on the Ray runtime, built by the composition root from settings alone: a chat
turn over HTTP runs on a Ray actor host, /metrics reports each host's actor table, and
`svc serve` joined to Ray still shuts down gracefully on SIGTERM."""

from __future__ import annotations

import asyncio
import json
import os
import re
import shutil
import socket
import sys
import tempfile
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
import ray
import stub_upstream
from platform_support import StallingUpstream, running, settings_for
from ray.cluster_utils import Cluster
from test_graceful_shutdown import _config as shutdown_config
from test_graceful_shutdown import sigterm_mid_turn

from actors import conversation_key
from actors.ray import RayRuntime
from actors.shards import host_name, shard_of
from gateway.state import RUNTIME, SETTINGS_SERVICE

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


async def test_hosts_follow_the_model_settings_of_the_gateway(
    ray_cluster: Cluster, database_url: str, cluster_name: str
) -> None:
    """The hosts are detached and outlive a gateway that joined a running Ray: a gateway
    started again with other model settings, or a model setting changed live, must reach
    the hosts, which make the model calls."""
    stub = await stub_upstream.StubUpstream(tokens=3).start()
    ray_mode = {
        "SVC_ACTOR_RUNTIME": "ray",
        "SVC_RAY_ADDRESS": ray_cluster.address,
        "SVC_RAY_CLUSTER": cluster_name,
        "SVC_ACTOR_HOSTS": str(HOSTS),
    }
    ask = {"model": "stub-model", "messages": [{"role": "user", "content": "hi"}]}
    try:
        async with running(settings_for(database_url, **ray_mode)) as svc:  # offline model
            key, _ = await svc.issue_key(f"ws-{uuid.uuid4().hex[:8]}", ["chat"])
            status, body, _ = await svc.request("POST", "/v1/chat/completions", key, json=ask)
            assert status == 404, body

        upstream = {"SVC_LLM_GATEWAY_URL": stub.base_url, "SVC_LLM_MODEL": "stub-model"}
        async with running(settings_for(database_url, **ray_mode, **upstream)) as svc:
            for _ in range(4):  # new conversations, on the shards of both hosts
                status, body, _ = await svc.request("POST", "/v1/chat/completions", key, json=ask)
                assert status == 200, body
                assert body["choices"][0]["message"]["content"] == "tok0 tok1 tok2 "
            assert stub.calls == 4 and "temperature" not in stub.bodies[-1]

            await svc.app[SETTINGS_SERVICE].set("SVC_LLM_TEMPERATURE", "0.3")
            async with asyncio.timeout(30):  # sent to the hosts in the background
                while stub.bodies[-1].get("temperature") != 0.3:
                    await asyncio.sleep(0.2)
                    status, body, _ = await svc.request(
                        "POST", "/v1/chat/completions", key, json=ask
                    )
                    assert status == 200, body
            runtime = svc.app[RUNTIME]
            assert isinstance(runtime, RayRuntime) and runtime.shard_map is not None
            hosts_seen: set[str] = set()
            async with asyncio.timeout(30):
                while len(hosts_seen) < HOSTS:  # new conversations until both hosts answered
                    status, body, headers = await svc.request(
                        "POST", "/v1/chat/completions", key, json=ask
                    )
                    assert status == 200, body
                    assert stub.bodies[-1]["temperature"] == 0.3
                    shard = shard_of(conversation_key(headers["X-SVC-Conversation-Id"]))
                    hosts_seen.add(runtime.shard_map.route(shard)[0])

            # The log level too, a live setting: the hosts logged at Ray's default whatever
            # it said.
            service = svc.app[SETTINGS_SERVICE]
            for level in ("debug", "warning"):
                await service.set("SVC_LOG_LEVEL", level)
                async with asyncio.timeout(30):
                    while True:
                        hosts = (await runtime.status())["hosts"]
                        if {host.get("log_level") for host in hosts} == {level}:
                            break
                        await asyncio.sleep(0.2)
            await service.unset("SVC_LOG_LEVEL")
    finally:
        await stub.stop()


async def test_sigterm_shuts_a_ray_gateway_down_gracefully(
    ray_cluster: Cluster, database_url: str, cluster_name: str, tmp_path: Path
) -> None:
    """ray.init installs a SIGTERM handler that exits at once; `svc serve` must keep its own,
    so a turn in flight is answered within the grace and the shutdown report is written. The
    hosts of a shared cluster are not this process's to stop: the turn goes on there, and its
    client is told to collect the answer with the same Idempotency-Key."""
    log_path = tmp_path / "serve.log"
    async with StallingUpstream().running() as stub:
        env = {
            **{k: v for k, v in os.environ.items() if not k.startswith("SVC_")},
            **shutdown_config(database_url, stub.base_url, tmp_path),
            "SVC_GATEWAY_ADDR": "127.0.0.1:0",
            "SVC_ACTOR_RUNTIME": "ray",
            "SVC_RAY_ADDRESS": ray_cluster.address,
            "SVC_RAY_CLUSTER": cluster_name,
            "SVC_ACTOR_HOSTS": "1",
        }
        code, _ = await sigterm_mid_turn(env, stub, log_path, left_running)
    log = log_path.read_text(errors="replace")
    assert code == 0, log
    stopped = next(line for line in log.splitlines() if "svc stopped in" in line)
    assert "1 left running on the shared actor hosts" in stopped, stopped


async def test_a_sigterm_to_the_whole_group_stops_a_gateway_with_its_own_ray(
    database_url: str, tmp_path: Path
) -> None:
    """QA finding: `kill -TERM -- -PGID` of a gateway that started its own Ray ended Ray's
    processes with it, and Ray's driver in the gateway exits the moment its raylet dies: the
    turn was not recorded as interrupted, no `svc stopped` line was written, and the embedded
    PostgreSQL was left running. Ray's processes lead groups of their own, so the gateway
    stops them itself, after the turn."""
    ray_dir = tempfile.mkdtemp(prefix="svc-ray-", dir="/tmp")  # Ray's socket paths are short
    log_path = tmp_path / "serve.log"
    try:
        async with StallingUpstream().running() as stub:
            env = {
                **{k: v for k, v in os.environ.items() if not k.startswith("SVC_")},
                **shutdown_config(database_url, stub.base_url, tmp_path),
                "SVC_GATEWAY_ADDR": "127.0.0.1:0",
                "SVC_ACTOR_RUNTIME": "ray",
                "SVC_ACTOR_HOSTS": "1",
                "RAY_TMPDIR": ray_dir,
            }

            rays_groups: set[int] = set()

            async def outside_its_group(pid: int) -> None:
                groups = {int(line.split()[0]) for line in await _processes_under(ray_dir)}
                assert groups and os.getpgid(pid) not in groups, (pid, groups)
                rays_groups.update(groups)

            code, _ = await sigterm_mid_turn(
                env, stub, log_path, whole_group=True, before_signal=outside_its_group
            )
        log = log_path.read_text(errors="replace")
        assert code == 0, log
        stopped = next((line for line in log.splitlines() if "svc stopped in" in line), None)
        assert stopped is not None, log[-3000:]
        # Nothing of its Ray outlives it: its raylet's workers (the actor hosts, renamed
        # `ray::...`) are in the raylet's group, not named by their command lines.
        async with asyncio.timeout(30):
            while await _processes_under(ray_dir) or await _in_groups(rays_groups):  # noqa: ASYNC110
                await asyncio.sleep(0.5)
    finally:
        shutil.rmtree(ray_dir, ignore_errors=True)


TOO_MANY_HOSTS = (os.cpu_count() or 1) * 4 + 64
"""More actor hosts than this machine's CPUs, whatever the machine."""


async def test_more_hosts_than_a_local_ray_has_cpus_is_refused_at_once(
    database_url: str, tmp_path: Path
) -> None:
    """QA finding: SVC_ACTOR_HOSTS above the CPUs of the Ray a gateway starts itself held
    the start two minutes, the port unbound, before saying so."""
    ray_dir = tempfile.mkdtemp(prefix="svc-ray-", dir="/tmp")
    env = {
        **{k: v for k, v in os.environ.items() if not k.startswith("SVC_")},
        "SVC_DATABASE_URL": database_url,
        "SVC_DATA_DIR": str(tmp_path),
        "SVC_GATEWAY_ADDR": "127.0.0.1:0",
        "SVC_ACTOR_RUNTIME": "ray",
        "SVC_ACTOR_HOSTS": str(TOO_MANY_HOSTS),
        "RAY_TMPDIR": ray_dir,
    }
    try:
        proc = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "gateway.cli", "serve",
            env=env, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT,
        )  # fmt: skip
        try:
            out, _ = await asyncio.wait_for(proc.communicate(), 90)
        finally:
            if proc.returncode is None:
                proc.kill()
                await proc.wait()
        text = out.decode(errors="replace")
        assert proc.returncode != 0, text
        assert f"SVC_ACTOR_HOSTS={TOO_MANY_HOSTS} asks for" in text, text[-2000:]
        assert "lower SVC_ACTOR_HOSTS" in text and "Traceback" not in text, text[-2000:]
        assert not await _processes_under(ray_dir)
    finally:
        shutil.rmtree(ray_dir, ignore_errors=True)


async def _in_groups(groups: set[int]) -> list[str]:
    """`pgid args` of each process in one of the process groups `groups`."""
    return [row for row in await _processes() if int(row.split()[0]) in groups]


async def _processes_under(directory: str) -> list[str]:
    """`pgid args` of each process whose command line names `directory`."""
    return [row for row in await _processes() if directory in row]


async def _processes() -> list[str]:
    """`pgid args` of every process."""
    ps = await asyncio.create_subprocess_exec(
        "ps", "-ww", "-eo", "pgid,args", stdout=asyncio.subprocess.PIPE
    )
    out, _ = await ps.communicate()
    return [line.strip() for line in out.decode().splitlines()[1:]]


def left_running(status: int, raw: bytes) -> None:
    assert status == 503, raw
    error = json.loads(raw)["error"]
    assert error["code"] == "answer_abandoned", error
    assert "same Idempotency-Key to get its answer" in error["message"], error


async def test_a_ray_address_nobody_listens_on_fails_fast(tmp_path: Path) -> None:
    with socket.socket() as closed:
        closed.bind(("127.0.0.1", 0))
        address = f"127.0.0.1:{closed.getsockname()[1]}"
    env = {
        **{k: v for k, v in os.environ.items() if not k.startswith("SVC_")},
        "SVC_DATA_DIR": str(tmp_path),
        "SVC_RAY_ADDRESS": address,
    }
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "gateway.cli", "cluster", "status",
        env=env, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
    )  # fmt: skip
    _, err = await asyncio.wait_for(proc.communicate(), 60)
    assert proc.returncode == 1, err
    assert f"no Ray cluster answers at {address} (SVC_RAY_ADDRESS)" in err.decode()
