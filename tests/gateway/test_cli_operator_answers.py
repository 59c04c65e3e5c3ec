"""What the operator commands answer in process: exit codes a script can act on, and tables
that say what they show."""

from __future__ import annotations

import argparse

import pytest
from platform_support import settings_for, stop_the_api_keys_model

from actors.errors import ConflictRetriesExhausted
from eventstore.errors import ConcurrencyConflict, StoreUnavailable
from gateway import cli
from gateway.bootstrap import open_platform
from projections.errors import ProjectionFailed
from schemas.errors import Conflict, InvalidInput, SvcError


async def test_status_exits_1_while_a_projection_is_stopped(
    database_url: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """The runbooks send operators (and deploy checks) to this command: it printed STOPPED
    and exited 0, so `svc projections status || alert` passed over a stalled read model."""
    settings = settings_for(database_url)
    args = argparse.Namespace(action="status")
    assert await cli.cmd_projections(args, settings) == 0
    async with open_platform(settings, background=False) as platform:
        await stop_the_api_keys_model(platform.store)
        with pytest.raises(ProjectionFailed):
            await platform.projections.catch_up(names=["api_keys"])
    capsys.readouterr()
    assert await cli.cmd_projections(args, settings) == cli.FAILURE
    assert "STOPPED" in capsys.readouterr().out


@pytest.mark.parametrize(
    ("error", "code"),
    [
        (ConflictRetriesExhausted("other writers kept the stream moving"), cli.FAILURE),
        (ConcurrencyConflict("conversation:c1", 3), cli.FAILURE),
        (Conflict("the name is taken"), cli.USAGE_ERROR),
        (InvalidInput("no such scope"), cli.USAGE_ERROR),
        (StoreUnavailable("the database went away"), cli.FAILURE),
    ],
)
def test_a_conflict_that_passes_exits_1_not_2(error: SvcError, code: int) -> None:
    """Exit 2 says the same command fails again; a write that lost to other writers'
    appends each time it was retried is worth running again (exit 1)."""
    assert cli.exit_code(error) == code


def test_cluster_status_shows_each_hosts_state() -> None:
    """A host that did not answer showed as a row of `None`s, alive as far as anyone could
    tell from the table."""
    status = {
        "hosts": [
            {"name": "svc-host-0", "state": "alive", "node": "n1", "pid": 41, "shards": 512},
            {"name": "svc-host-1", "state": "unreachable (ActorDiedError)", "shards": 512},
        ]
    }
    header, alive, dead = cli._status_table(status).splitlines()
    assert header.split("\t")[:2] == ["host", "state"]
    assert alive.split("\t")[:4] == ["svc-host-0", "alive", "n1", "41"]
    assert dead.split("\t")[:4] == ["svc-host-1", "unreachable (ActorDiedError)", "-", "-"]
