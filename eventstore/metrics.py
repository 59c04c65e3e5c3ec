"""Prometheus metrics of the event store, registered in the default registry at import."""

from __future__ import annotations

import asyncio
import logging

from prometheus_client import Gauge, Histogram

from eventstore.db import Connection, Database
from eventstore.errors import StoreError
from eventstore.outage_log import OutageLog
from eventstore.tasks import cancel_and_wait

log = logging.getLogger(__name__)

APPEND_SECONDS = Histogram(
    "svc_store_append_seconds",
    "Latency of event store appends (one transaction each), including conflicts and duplicates.",
    buckets=(0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0),
)

OLDEST_OPEN_TX_AGE = Gauge(
    "svc_store_oldest_open_tx_age_seconds",
    "Age of the oldest open transaction holding a transaction id in the database cluster. "
    "Gap-free log readers cannot see past it, so a high value delays every feed.",
)

# Cluster-wide on purpose: the snapshot xmin that bounds gap-free readers is cluster-wide.
# Only transactions that hold an xid (have written) hold readers back, and so does a prepared
# (two-phase) one, which has no session in pg_stat_activity: an orphan left by another
# application of the cluster freezes every feed while the gauge read 0.
_OLDEST_OPEN_TX_AGE_SQL = """
SELECT coalesce(extract(epoch FROM clock_timestamp() - least(
    (SELECT min(xact_start) FROM pg_stat_activity WHERE backend_xid IS NOT NULL),
    (SELECT min(prepared) FROM pg_prepared_xacts)
)), 0)::float8
"""


async def oldest_open_tx_age_s(conn: Connection) -> float:
    value: float = await conn.fetchval(_OLDEST_OPEN_TX_AGE_SQL)
    return value


class OpenTxAgeSampler:
    """Keeps `svc_store_oldest_open_tx_age_seconds` current by sampling every few seconds.

    The gauge is read synchronously by the Prometheus exposition, so the value is sampled by
    a background task rather than queried in a collect callback.
    """

    def __init__(self, db: Database, interval_s: float = 5.0) -> None:
        self._db = db
        self._interval_s = interval_s
        self._task: asyncio.Task[None] | None = None

    async def sample(self) -> float:
        async with self._db.acquire() as conn:
            age = await oldest_open_tx_age_s(conn)
        OLDEST_OPEN_TX_AGE.set(age)
        return age

    async def _run(self) -> None:
        # While the database is away: a warning, then one a minute, and a line when it is back.
        outage = OutageLog(log, "sampling the oldest open transaction")
        while True:
            try:
                await self.sample()
            except StoreError as exc:
                outage.failed(exc)
            else:
                outage.succeeded()
            await asyncio.sleep(self._interval_s)

    def start(self) -> None:
        if self._task is None:
            self._task = asyncio.create_task(self._run(), name="svc-store-open-tx-sampler")

    async def stop(self) -> None:
        task, self._task = self._task, None
        await cancel_and_wait(task)
