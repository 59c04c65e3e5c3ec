"""An outage in a retry loop is logged once as it starts, once a minute, and once as it ends."""

from __future__ import annotations

import asyncio
import logging
import math
from typing import Any, cast

import pytest

from eventstore import outage_log
from eventstore.db import Database
from eventstore.errors import StoreUnavailable
from eventstore.metrics import OLDEST_OPEN_TX_AGE, OpenTxAgeSampler
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


class _Unreachable:
    """A database that never answers (its pool refuses every borrow)."""

    def acquire(self) -> Any:
        raise StoreUnavailable("the event store database is unavailable")


async def test_an_open_transaction_age_that_cannot_be_sampled_is_unknown_not_the_last() -> None:
    """Through a whole outage the gauge said the last age it had read (0: all clear)."""
    OLDEST_OPEN_TX_AGE.set(0.0)
    sampler = OpenTxAgeSampler(cast(Database, _Unreachable()), interval_s=3600)
    sampler.start()
    try:
        async with asyncio.timeout(10):
            while True:  # the sampler's first round fails at once
                if math.isnan(OLDEST_OPEN_TX_AGE.collect()[0].samples[0].value):
                    break
                await asyncio.sleep(0.01)
    finally:
        await sampler.stop()
