"""The model settings of a Ray host (gateway/bootstrap.py `HostBehaviours`), without Ray:
what travels to the host, and how new settings replace its providers."""

from __future__ import annotations

import pickle
from collections.abc import Sequence

import pytest

from actors.models.port import ModelProvider
from actors.models.registry import ModelConfig
from gateway import bootstrap
from gateway.bootstrap import HostBehaviours
from schemas.errors import FeatureDisabled


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
    factory = HostBehaviours(ModelConfig(model="first", api_key="sk-secret"))
    factory()
    copy = pickle.loads(pickle.dumps(factory))
    assert copy.config == factory.config and copy._providers is None
    assert "sk-secret" not in repr(factory.config)


async def test_replaced_providers_close_after_the_old_call_timeout(
    closes: list[tuple[list[str], float]],
) -> None:
    factory = HostBehaviours(ModelConfig(model="first", call_timeout_s=600))
    factory()
    factory.reconfigure(ModelConfig(model="second", call_timeout_s=30))
    factory.reconfigure(ModelConfig(model="third", call_timeout_s=0))
    factory.reconfigure(ModelConfig(model="fourth", call_timeout_s=30))
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
    factory = HostBehaviours(before)
    factory()
    with pytest.raises(FeatureDisabled):
        factory.reconfigure(ModelConfig(provider="nope"))
    assert factory.config == before and closes == []
    assert factory._providers is not None and factory._providers.serves("first")
