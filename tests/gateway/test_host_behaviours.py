"""The model settings of a Ray host (gateway/bootstrap.py `HostBehaviours`), without Ray:
what travels to the host, and how new settings replace its providers."""

from __future__ import annotations

import asyncio
import pickle
import re
import subprocess
import sys
from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path

import pytest

from actors.models.port import ModelProvider
from actors.models.registry import ModelConfig
from gateway import bootstrap
from gateway.bootstrap import HostBehaviours, HostConfig
from schemas.errors import FeatureDisabled

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture
def closes(monkeypatch: pytest.MonkeyPatch) -> list[tuple[list[str], float]]:
    """The replaced providers' close, recorded (model names and delay) instead of waited."""
    recorded: list[tuple[list[str], float]] = []

    async def record(providers: Sequence[ModelProvider], delay_s: float) -> None:
        names = [n for p in providers for n in getattr(p, "model_names", ())]
        recorded.append((names, delay_s))

    monkeypatch.setattr(bootstrap, "_close_after", record)
    return recorded


def test_only_the_settings_travel() -> None:
    factory = HostBehaviours(HostConfig(ModelConfig(model="first", api_key="sk-secret")))
    factory()
    copy = pickle.loads(pickle.dumps(factory))
    assert copy.config == factory.config and copy._providers is None
    assert "sk-secret" not in repr(factory.config)


async def test_replaced_providers_close_after_the_old_call_timeout(
    closes: list[tuple[list[str], float]],
) -> None:
    factory = HostBehaviours(HostConfig(ModelConfig(model="first", call_timeout_s=600)))
    factory()
    factory.reconfigure(HostConfig(ModelConfig(model="second", call_timeout_s=30)))
    factory.reconfigure(HostConfig(ModelConfig(model="third", call_timeout_s=0)))
    factory.reconfigure(HostConfig(ModelConfig(model="fourth", call_timeout_s=30)))
    for task in list(factory._closing):
        await task
    assert sorted(closes) == sorted(
        [
            (["svc-offline", "first"], 605.0),
            (["svc-offline", "second"], 35.0),
            (["svc-offline", "third"], bootstrap.UNBOUNDED_CALLS_CLOSED_AFTER_S),
        ]
    )
    assert factory._providers is not None and factory._providers.serves("fourth")


async def test_settings_that_cannot_be_built_change_nothing(
    closes: list[tuple[list[str], float]],
) -> None:
    before = ModelConfig(model="first")
    factory = HostBehaviours(HostConfig(before))
    factory()
    with pytest.raises(FeatureDisabled):
        factory.reconfigure(HostConfig(ModelConfig(provider="nope")))
    assert factory.config.model == before and closes == []
    assert factory._providers is not None and factory._providers.serves("first")


async def test_a_gateway_not_restarted_does_not_put_its_old_restart_values_back(
    closes: list[tuple[list[str], float]],
) -> None:
    """Review finding: every gateway sends its whole model config to every host, on a live
    change and whenever it sees a host restart. A gateway not restarted since the upstream
    key changed (stored at version 5) still runs with the old key; sent last, it put that
    key back on the hosts a restarted gateway had given the new one. Each part now comes
    from the sender that read the newer stored settings."""
    restarted = ModelConfig(model="m", api_key="sk-new", started_at=5, read_at=5)
    factory = HostBehaviours(HostConfig(restarted))
    factory()
    stale = ModelConfig(model="m", api_key="sk-old", temperature=0.2, started_at=3, read_at=7)
    factory.reconfigure(
        HostConfig(stale)
    )  # a live change (temperature, at version 7) from that gateway
    assert factory.config.model.api_key == "sk-new" and factory.config.model.started_at == 5
    assert factory.config.model.temperature == 0.2 and factory.config.model.read_at == 7
    factory.reconfigure(HostConfig(replace(stale, temperature=None, read_at=6)))  # an older read
    assert factory.config.model.temperature == 0.2
    # Equal versions: the later sender wins, as before (two gateways' environments differ).
    factory.reconfigure(HostConfig(replace(restarted, model="other", read_at=7)))
    assert factory.config.model.model == "other"


async def test_the_same_values_read_at_another_version_rebuild_nothing(
    closes: list[tuple[list[str], float]],
) -> None:
    factory = HostBehaviours(HostConfig(ModelConfig(model="m", started_at=1, read_at=1)))
    factory()
    factory.reconfigure(HostConfig(ModelConfig(model="m", started_at=2, read_at=4)))
    # A rebuild swaps the providers inside the one set and schedules the old ones' close.
    assert not factory._closing
    await asyncio.sleep(0)
    assert closes == []
    assert (factory.config.model.started_at, factory.config.model.read_at) == (2, 4)


def test_a_host_follows_the_newest_log_level(monkeypatch: pytest.MonkeyPatch) -> None:
    """SVC_LOG_LEVEL changed through the API reached the gateways only: the hosts, where
    turns and model calls run, logged at Ray's default whatever it said."""
    applied: list[str] = []
    monkeypatch.setattr(bootstrap, "apply_log_level", applied.append)
    model = ModelConfig(model="m")
    factory = HostBehaviours(HostConfig(model, "warning", log_read_at=3))
    factory.reconfigure(HostConfig(model, "debug", log_read_at=4))  # not built: kept only
    assert applied == [] and factory.config.log_level == "debug"
    factory()  # the host builds its behaviours: at the level it holds
    assert applied == ["debug"]
    factory.reconfigure(HostConfig(model, "error", log_read_at=2))  # read before: ignored
    factory.reconfigure(HostConfig(model, "debug", log_read_at=5))  # the same level
    assert applied == ["debug"] and factory.config.log_read_at == 5
    factory.reconfigure(HostConfig(model, "info", log_read_at=6))
    assert applied == ["debug", "info"]
    assert factory._providers is not None and not factory._closing  # the model part stayed


def test_a_hosts_lines_carry_their_time_and_level() -> None:
    """QA finding: in a Ray worker, where nothing sets logging up, a host's lines were the
    bare message (Python's last-resort handler): no time, level or logger."""
    program = (
        "import logging\n"
        "from gateway.bootstrap import HostBehaviours, HostConfig\n"
        "from actors.models.registry import ModelConfig\n"
        "HostBehaviours(HostConfig(ModelConfig(model='m'), 'info'))()\n"
        "logging.getLogger('actors.ray.host').warning('a host line')\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", program], capture_output=True, text=True, timeout=60, cwd=ROOT
    )
    assert done.returncode == 0, done.stderr
    assert re.search(
        r"^\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d+ WARNING actors.ray.host: a host line$",
        done.stderr,
        re.M,
    ), done.stderr
