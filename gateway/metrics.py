"""Prometheus metrics of the gateway and the /metrics rendering.

Only non-sensitive series: build info, process uptime and runtime, the database pool, the
readiness gauge, error counts by status, and the in-process actor table (active actors,
commands handled; with the Ray runtime, the same per actor host). No tenant, key or
per-request label, ever. The
store, projections and chat register their own series (store append latency, projection lag,
turn latency) in the default registry; /metrics renders that registry plus this app's own.
"""

from __future__ import annotations

import platform
import time
from collections.abc import Callable, Iterator, Mapping
from importlib import metadata

from prometheus_client import REGISTRY, CollectorRegistry, Counter, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from actors.table import TableStats
from eventstore.db import PoolStats

HTTP_ERRORS = Counter(
    "svc_http_errors",
    "Non-2xx responses sent by the gateway, by HTTP status.",
    ["status"],
)
ANSWERED_STATUSES = (
    *(400, 401, 403, 404, 405, 406, 408, 409, 411, 413, 415, 417, 429, 499),
    *(500, 501, 502, 503, 504),
)
"""The statuses the gateway answers errors with, exported at 0 from the start: `rate()` needs
two samples of a series, so a series that first appeared with a burst in it would keep that
burst from the error-rate alerts (ops/prometheus/svc-rules.yaml)."""
for _status in ANSWERED_STATUSES:
    HTTP_ERRORS.labels(status=str(_status))


def build_version() -> str:
    try:
        return metadata.version("svc")
    except metadata.PackageNotFoundError:
        return "0.0.0+unknown"


class GatewayCollector(Collector):
    """Per-app gauges read at scrape time (several apps may live in one test process)."""

    def __init__(
        self,
        pool_stats: Callable[[], PoolStats | None],
        ready: Callable[[], bool],
        actor_stats: Callable[[], TableStats | None],
        started_monotonic: float | None = None,
    ) -> None:
        self._pool_stats = pool_stats
        self._ready = ready
        self._actor_stats = actor_stats
        self._started = time.monotonic() if started_monotonic is None else started_monotonic

    def collect(self) -> Iterator[Metric]:
        info = GaugeMetricFamily(
            "svc_build_info", "Build of the running service.", labels=["version", "python"]
        )
        info.add_metric([build_version(), platform.python_version()], 1.0)
        yield info
        yield GaugeMetricFamily(
            "svc_process_uptime_seconds",
            "Seconds since this gateway started.",
            value=time.monotonic() - self._started,
        )
        yield GaugeMetricFamily(
            "svc_ready",
            "1 when the last readiness check found the database answering, or the pool "
            "saturated (busy), else 0.",
            value=1.0 if self._ready() else 0.0,
        )
        yield from self._pool()
        yield from self._actors()

    def _pool(self) -> Iterator[GaugeMetricFamily]:
        stats = self._pool_stats()
        if stats is None:
            return
        pool = GaugeMetricFamily(
            "svc_db_pool_connections", "Database pool connections by state.", labels=["state"]
        )
        pool.add_metric(["open"], float(stats.size))
        pool.add_metric(["idle"], float(stats.idle))
        pool.add_metric(["in_use"], float(stats.size - stats.idle))
        pool.add_metric(["max"], float(stats.max))
        yield pool

    def _actors(self) -> Iterator[Metric]:
        # Only an actor table in this process is counted here: with the Ray runtime the actors
        # live in the host processes, reported per host by ActorHostsCollector.
        stats = self._actor_stats()
        if stats is None:
            return
        yield GaugeMetricFamily(
            "svc_actor_active", "Logical actors active in this process.", value=stats.active
        )
        yield CounterMetricFamily(
            "svc_actor_commands",
            "Commands the actors of this process have handled (succeeded or failed).",
            value=stats.commands_processed + stats.commands_failed,
        )


class ActorHostsCollector(Collector):
    """The actor tables of the Ray runtime's host processes, by host, as one scrape read them.

    Every gateway of a cluster reports every host, so a dashboard takes `max by (host)`.
    With the local runtime the families are declared and empty."""

    def __init__(self, hosts: Mapping[str, TableStats]) -> None:
        self._hosts = hosts

    def collect(self) -> Iterator[Metric]:
        active = GaugeMetricFamily(
            "svc_actor_host_active",
            "Logical actors active in each Ray actor host (hosts that answered this scrape).",
            labels=["host"],
        )
        commands = CounterMetricFamily(
            "svc_actor_host_commands",
            "Commands each Ray actor host has handled since it started (succeeded or failed).",
            labels=["host"],
        )
        for host, stats in sorted(self._hosts.items()):
            active.add_metric([host], float(stats.active))
            commands.add_metric([host], float(stats.commands_processed + stats.commands_failed))
        yield active
        yield commands


def render(app_registry: CollectorRegistry, hosts: Mapping[str, TableStats]) -> bytes:
    per_scrape = CollectorRegistry(auto_describe=False)
    per_scrape.register(ActorHostsCollector(hosts))
    return generate_latest(REGISTRY) + generate_latest(app_registry) + generate_latest(per_scrape)
