"""The offline model and provider selection."""

from __future__ import annotations

import pytest

from actors.models.offline import OFFLINE_MODEL, OfflineProvider
from actors.models.openai_compat import OpenAICompatProvider
from actors.models.port import ChatMessage, Finished, ModelEvent, ModelRequest, TextDelta
from actors.models.registry import (
    ModelConfig,
    ProviderSet,
    build_providers,
    optional_float,
    select,
)
from schemas.errors import FeatureDisabled, InvalidInput, NotFound


def request(text: str, max_tokens: int | None = None) -> ModelRequest:
    messages = (
        ChatMessage("system", "be nice"),
        ChatMessage("user", "first question"),
        ChatMessage("assistant", "first answer"),
        ChatMessage("user", text),
    )
    return ModelRequest(OFFLINE_MODEL, messages, max_tokens=max_tokens)


async def run(req: ModelRequest) -> list[ModelEvent]:
    return [event async for event in OfflineProvider().stream(req)]


async def test_offline_reply_names_itself_and_reflects_the_last_user_message() -> None:
    events = await run(request("what is the capital of France?"))
    deltas = [e.text for e in events if isinstance(e, TextDelta)]
    text = "".join(deltas)
    assert OFFLINE_MODEL in text and "offline" in text
    assert "what is the capital of France?" in text
    assert "first question" not in text
    assert all(len(d.split()) == 1 for d in deltas)
    finished = events[-1]
    assert isinstance(finished, Finished)
    assert finished.finish_reason == "stop"
    assert finished.usage.completion_tokens == len(deltas) == len(text.split())
    assert finished.usage.prompt_tokens == 2 + 2 + 2 + 6 + 4 * 3


@pytest.mark.parametrize("message", ["a" * 999_990, "word " * 199_000])
async def test_offline_quotes_a_bounded_part_of_a_long_message(message: str) -> None:
    """A message as long as a message may be (one word of it, or many) is answered with a
    reply of ordinary length, never one over what a recorded message holds."""
    events = await run(request(message))
    text = "".join(e.text for e in events if isinstance(e, TextDelta))
    assert len(text) < 1_000 and text.count("...") == 1
    assert isinstance(events[-1], Finished) and events[-1].finish_reason == "stop"


async def test_offline_is_deterministic() -> None:
    assert await run(request("same words")) == await run(request("same words"))


async def test_offline_honours_max_tokens() -> None:
    events = await run(request("hello", max_tokens=3))
    assert len([e for e in events if isinstance(e, TextDelta)]) == 3
    finished = events[-1]
    assert isinstance(finished, Finished)
    assert finished.finish_reason == "length"
    assert finished.usage.completion_tokens == 3


def test_offline_serves_its_name_and_configured_names() -> None:
    provider = OfflineProvider(["my-model"])
    assert provider.serves(OFFLINE_MODEL) and provider.serves("my-model")
    assert not provider.serves("gpt-4o")


def test_default_is_offline_serving_configured_model() -> None:
    (only,) = build_providers(ModelConfig(model="house-model"))
    assert isinstance(only, OfflineProvider)
    assert only.model_names == (OFFLINE_MODEL, "house-model")


def test_gateway_url_selects_upstream_and_keeps_offline() -> None:
    providers = build_providers(ModelConfig(gateway_url="http://127.0.0.1:9/v1", model="m"))
    assert select(providers, "m") is providers[1]
    assert isinstance(providers[1], OpenAICompatProvider)
    assert select(providers, OFFLINE_MODEL) is providers[0]


def test_upstream_without_model_serves_any_name_but_offline_keeps_its_own() -> None:
    providers = build_providers(ModelConfig(gateway_url="http://127.0.0.1:9/v1"))
    assert select(providers, "anything") is providers[1]
    assert isinstance(select(providers, OFFLINE_MODEL), OfflineProvider)


def test_unknown_model_lists_valid_names() -> None:
    providers = build_providers(ModelConfig(model="house-model"))
    with pytest.raises(NotFound) as caught:
        select(providers, "gpt-9")
    assert caught.value.code == "model_not_found"
    assert "svc-offline" in caught.value.message and "house-model" in caught.value.message


def test_unknown_provider_kind_is_refused() -> None:
    with pytest.raises(FeatureDisabled):
        build_providers(ModelConfig(provider="subscription"))


def test_api_key_not_in_repr() -> None:
    config = ModelConfig(gateway_url="http://x", api_key="sk-very-secret")
    assert "sk-very-secret" not in repr(config)
    assert "sk-very-secret" not in repr(build_providers(config))


def test_optional_float() -> None:
    assert optional_float("", low=0, high=2, key="T") is None
    assert optional_float(" 0.7 ", low=0, high=2, key="T") == 0.7
    with pytest.raises(InvalidInput):
        optional_float("3", low=0, high=2, key="SVC_LLM_TEMPERATURE")
    with pytest.raises(InvalidInput):
        optional_float("warm", low=0, high=2, key="SVC_LLM_TEMPERATURE")


async def test_provider_set_routes_by_model() -> None:
    models = ProviderSet.from_config(ModelConfig())
    events = [e async for e in models.stream(request("hi"))]
    assert isinstance(events[-1], Finished)
    with pytest.raises(NotFound):
        models.stream(ModelRequest("nope", (ChatMessage("user", "x"),)))
    await models.aclose()


def test_a_provider_set_serves_from_its_replacements_at_once() -> None:
    providers = ProviderSet.from_config(ModelConfig(model="first"))
    previous = providers.replace(build_providers(ModelConfig(model="second")))
    assert providers.serves("second") and not providers.serves("first")
    assert "second" in providers.model_names and "first" not in providers.model_names
    assert any(p.serves("first") for p in previous)  # the caller closes these later
