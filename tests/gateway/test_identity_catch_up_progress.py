"""A start that waits on the identity read model says how far behind it is while it waits:
after a migration emptied it, rebuilding it from a long log takes minutes."""

from __future__ import annotations

import asyncio
import logging
from typing import Any, cast

import pytest

from gateway import bootstrap
from projections.identity import IdentityProjector
from projections.runner import ProjectionStatus


class _Behind:
    """A runner whose identity catch-up ends once its lag has been asked twice."""

    def __init__(self) -> None:
        self.asked = 0
        self._caught_up = asyncio.Event()

    async def catch_up(self, *, names: list[str]) -> None:
        assert names == [IdentityProjector.name]
        await self._caught_up.wait()

    async def status(self) -> list[ProjectionStatus]:
        self.asked += 1
        if self.asked == 2:
            self._caught_up.set()
        lag = 5_000 if self.asked == 1 else 20
        behind = ProjectionStatus(
            IdentityProjector.name, "c1", lag, 12.0, running=False, failure=None
        )
        return [behind, ProjectionStatus("other", "", 0, 0.0, running=False, failure=None)]


async def test_a_start_waiting_on_the_identity_model_reports_its_lag(
    caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(bootstrap, "CATCH_UP_PROGRESS_EVERY_S", 0.01)
    runner = _Behind()
    with caplog.at_level(logging.INFO, logger=bootstrap.log.name):
        await bootstrap._identity_up_to_date(cast(Any, runner))
    lines = [r.getMessage() for r in caplog.records if r.name == bootstrap.log.name]
    assert "identity read model: still catching up, 5,000 events behind" in " ".join(lines)
    assert any("20 events behind" in line for line in lines), lines
