"""An outage in a retry loop is logged once as it starts, once a minute, and once as it ends."""

from __future__ import annotations

import asyncio
import logging

import pytest

from eventstore import outage_log
from eventstore.db import Database
from eventstore.metrics import OpenTxAgeSampler
from eventstore.outage_log import OutageLog

log = logging.getLogger("svc.test.outage")


def test_an_outage_is_one_warning_then_reminders_then_its_end(
    caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    caplog.set_level(logging.DEBUG, logger=log.name)
    outage = OutageLog(log, "test read")
    for _ in range(50):
        outage.failed(ConnectionError("database away"))
    monkeypatch.setattr(outage_log, "OUTAGE_REMINDER_S", 0.0)  # a minute has passed
    outage.failed(ConnectionError("database away"))
    outage.succeeded()
    outage.succeeded()  # said once
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    infos = [r.getMessage() for r in caplog.records if r.levelno == logging.INFO]
    assert len(warnings) == 2, warnings
    assert "(1 in a row)" in warnings[0] and "(51 in a row)" in warnings[1]
    assert infos == ["test read works again after 51 failures"]
    assert outage.failures == 0
    outage.failed(ConnectionError("database away"))
    outage.succeeded()
    assert caplog.records[-1].getMessage() == "test read works again after 1 failure"  # QA


async def test_the_open_transaction_sampler_logs_an_outage_once(
    database_url: str, caplog: pytest.LogCaptureFixture
) -> None:
    """The sampler warned on every failed sample, every 5 s for as long as the database was
    away: about 720 lines an hour per process."""
    db = await Database.connect(database_url, min_size=1, max_size=1)
    await db.close()  # every sample now fails as the database being away would
    sampler = OpenTxAgeSampler(db, interval_s=0.01)
    sampler.start()
    await asyncio.sleep(0.3)
    await sampler.stop()
    warned = [r for r in caplog.records if r.levelno >= logging.WARNING]
    assert len(warned) == 1 and "oldest open transaction" in warned[0].getMessage(), warned
