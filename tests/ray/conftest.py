"""Fixtures of the Ray runtime tests: one real multi-node Ray cluster per test session.

The cluster is `ray.cluster_utils.Cluster` on this machine (a head now, worker nodes added by
the fault tests), shared by every test because starting Ray costs seconds. Each runtime a
test builds gets its own cluster name, so its hosts, shard map and tables are its own; its
hosts are stopped and ended with it. Host processes reach the embedded PostgreSQL through the
same Unix-socket URL as the tests.

`make_runtime`/`runtime`/`store` have the meaning of tests/actors/conftest.py, so the runtime
contract suite (tests/actors/test_runtime_contract.py) runs here unchanged against `ray`.
"""

from __future__ import annotations

import sys
import tempfile
from collections.abc import AsyncIterator, Iterator, Sequence
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]


# The actor doubles and the contract suites live in tests/actors, the gateway's test helpers in
# tests/gateway: importable by name when tests/ray runs alone (pyproject's `pythonpath = ["."]`
# already puts the project first).
for helpers in ("actors", "gateway"):
    if str(ROOT / "tests" / helpers) not in sys.path:
        sys.path.insert(0, str(ROOT / "tests" / helpers))

import pytest  # noqa: E402
import ray  # noqa: E402
from actor_doubles import (  # noqa: E402
    CounterBehaviour,
    MakeRuntime,
    RuntimeUnderTest,
    ScriptedProvider,
)
from ray.cluster_utils import Cluster  # noqa: E402
from ray_support import fixed_behaviours, ray_settings  # noqa: E402

from actors import Behaviour, ConversationBehaviour  # noqa: E402
from actors.ray import RayRuntime  # noqa: E402
from actors.ray import runtime as ray_runtime  # noqa: E402
from eventstore import PostgresEventStore, open_store  # noqa: E402


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "ray: needs a real Ray cluster (tests/ray)")
    # Ray's cluster utilities leave an unbound probe socket to the garbage collector.
    config.addinivalue_line(
        "filterwarnings",
        "default:Exception ignored in. <socket.socket:pytest.PytestUnraisableExceptionWarning",
    )


@pytest.hookimpl(tryfirst=True)  # before xdist's, which reads the group
def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    here = Path(__file__).parent
    for item in items:
        if here in Path(str(item.fspath)).parents:
            item.add_marker(pytest.mark.ray)
            # Under pytest-xdist, one worker runs them all: one Ray cluster per test run.
            item.add_marker(pytest.mark.xdist_group("ray"))


@pytest.fixture(autouse=True)
def patient_host_reports(monkeypatch: pytest.MonkeyPatch) -> None:
    """`stats` and `status` leave out a host that has not answered within 2-3 s, which a
    loaded machine's Ray calls can take: the tests' exact counts would then come out short
    rather than wait. No test here needs a host left out for slowness."""
    monkeypatch.setattr(ray_runtime, "_STATS_TIMEOUT_S", 30.0)
    monkeypatch.setattr(ray_runtime, "_STATUS_TIMEOUT_S", 30.0)


@pytest.fixture(scope="session")
def ray_cluster() -> Iterator[Cluster]:
    cluster = Cluster(
        initialize_head=True,
        # No dashboard: nothing here reads it, and on a loaded machine its start can outlast
        # Ray's wait for it, which then drops the still-running process's handle.
        head_node_args={
            "num_cpus": 2,
            "object_store_memory": 96 * 1024 * 1024,
            "include_dashboard": False,
        },
    )
    paths = [str(ROOT), str(ROOT / "tests" / "actors"), str(ROOT / "tests" / "ray")]
    ray.init(
        address=cluster.address,
        namespace="svc",
        log_to_driver=False,
        runtime_env={"env_vars": {"PYTHONPATH": ":".join(paths)}},
    )
    try:
        yield cluster
    finally:
        ray.shutdown()
        cluster.shutdown()


@pytest.fixture
async def store(database_url: str) -> AsyncIterator[PostgresEventStore]:
    opened = await open_store(database_url)
    try:
        yield opened
    finally:
        await opened.close()


@pytest.fixture
async def make_runtime(
    ray_cluster: Cluster, store: PostgresEventStore, database_url: str
) -> AsyncIterator[MakeRuntime]:
    started: list[RayRuntime] = []

    async def make(behaviours: Sequence[Behaviour[Any]], **options: Any) -> RuntimeUnderTest:
        settings = ray_settings(ray_cluster.address, table_options=options)
        runtime = RayRuntime(database_url, fixed_behaviours(behaviours), settings)
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


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    """Write failures out as they happen: a Ray component that loses its GCS at session end
    may end the process before pytest prints its summary."""
    if report.failed:
        path = Path(tempfile.gettempdir()) / "svc-pytest-ray-failures.txt"
        with path.open("a", encoding="utf-8") as out:
            out.write(f"=== {report.nodeid} ({report.when})\n{report.longreprtext}\n")
