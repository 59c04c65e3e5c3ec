"""Which model providers an instance runs, and which one answers a given model name.

The composition root maps its Settings onto a `ModelConfig` (plain typed values, so this
module never reads the environment), calls `build_providers`, and hands the conversation
actor a `ProviderSet`: itself a `ModelProvider` that routes each request by model name.

Choice of providers (`SVC_LLM_PROVIDER`):
- blank or `auto`: the OpenAI-compatible upstream when `SVC_LLM_GATEWAY_URL` is set, else the
  offline model serving `svc-offline` and `SVC_LLM_MODEL`;
- `offline`: only the offline model (serving `svc-offline` and `SVC_LLM_MODEL`);
- `openai`, `openai-compat`, `compatible`: the upstream, at `SVC_LLM_GATEWAY_URL` or the
  provider default when blank.
The offline model stays reachable as `svc-offline` whatever upstream is configured.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterable, Sequence
from dataclasses import dataclass, field, replace
from typing import Protocol, runtime_checkable

from actors.models.offline import OfflineProvider
from actors.models.openai_compat import OpenAICompatProvider
from actors.models.port import ModelEvent, ModelProvider, ModelRequest
from schemas.errors import FeatureDisabled, InvalidInput, NotFound, quoted
from schemas.setting_rules import AUTO_PROVIDERS, OFFLINE_PROVIDERS, UPSTREAM_PROVIDERS


@dataclass(frozen=True, slots=True)
class ModelConfig:
    gateway_url: str = ""
    model: str = ""
    provider: str = ""
    call_timeout_s: float = 120.0
    retries: int = 3
    temperature: float | None = None
    top_p: float | None = None
    api_key: str | None = field(default=None, repr=False)
    started_at: int = 0
    """The version of the stored settings its sender started with: every value but the live
    ones (LIVE_FIELDS) is a restart setting, read at that version (and from the sender's
    environment)."""
    read_at: int = 0
    """The version of the stored settings its live values were read at."""

    def newest(self, sent: ModelConfig) -> ModelConfig:
        """What a Ray host holding this config keeps when `sent` arrives. Every gateway sends
        its own, and gateways restarted at different times hold different restart values: a
        gateway not restarted since a key changed must not put its old key back on hosts
        that a restarted one gave the new one. Each part comes from the sender that read
        the newer stored settings (the later sender on a tie)."""
        restart = sent if sent.started_at >= self.started_at else self
        live = sent if sent.read_at >= self.read_at else self
        return replace(
            restart, read_at=live.read_at, **{name: getattr(live, name) for name in LIVE_FIELDS}
        )

    def same_values(self, other: ModelConfig) -> bool:
        """Equal but for the versions they were read at: nothing to rebuild."""
        return replace(self, started_at=0, read_at=0) == replace(other, started_at=0, read_at=0)


LIVE_FIELDS = ("call_timeout_s", "temperature", "top_p")
"""The values a gateway applies without a restart (SVC_LLM_CALL_TIMEOUT_S, _TEMPERATURE,
_TOP_P)."""


@runtime_checkable
class NamedModels(Protocol):
    model_names: tuple[str, ...]


@runtime_checkable
class Closable(Protocol):
    async def aclose(self) -> None: ...


def optional_float(value: str | float | None, *, low: float, high: float, key: str) -> float | None:
    """A text setting such as SVC_LLM_TEMPERATURE: blank = not sent, else a number in range."""
    if value is None or (isinstance(value, str) and not value.strip()):
        return None
    try:
        number = float(value)
    except ValueError:
        raise InvalidInput(f"{key} must be a number or blank, got {value!r}") from None
    if not low <= number <= high:
        raise InvalidInput(f"{key} must be between {low:g} and {high:g}, got {number:g}")
    return number


def build_providers(config: ModelConfig) -> list[ModelProvider]:
    kind = config.provider.strip().lower()
    if kind in AUTO_PROVIDERS:
        kind = "openai" if config.gateway_url.strip() else "offline"
    if kind in OFFLINE_PROVIDERS:
        return [OfflineProvider([config.model] if config.model else [])]
    if kind in UPSTREAM_PROVIDERS:
        upstream = OpenAICompatProvider(
            base_url=config.gateway_url.strip(),
            model=config.model.strip(),
            api_key=config.api_key,
            call_timeout_s=config.call_timeout_s,
            retries=config.retries,
            temperature=config.temperature,
            top_p=config.top_p,
        )
        return [OfflineProvider(), upstream]
    raise FeatureDisabled(
        f"SVC_LLM_PROVIDER={config.provider!r} is not available in this build; "
        "use blank (auto), 'offline' or 'openai' (any OpenAI-compatible endpoint)"
    )


def served_names(providers: Iterable[ModelProvider]) -> list[str]:
    names: list[str] = []
    for provider in providers:
        if isinstance(provider, NamedModels):
            names.extend(provider.model_names)
    return list(dict.fromkeys(names))


def select(providers: Sequence[ModelProvider], model: str) -> ModelProvider:
    """The first provider serving `model`; the offline model is listed first so that
    `svc-offline` never reaches an upstream that would serve any name."""
    for provider in providers:
        if provider.serves(model):
            return provider
    valid = ", ".join(served_names(providers)) or "none"
    raise NotFound(
        f"The model {quoted(model)} does not exist on this instance; valid models: {valid}",
        code="model_not_found",
    )


class ProviderSet:
    """Every configured provider behind the one `ModelProvider` port, routed by model name."""

    name = "providers"

    def __init__(self, providers: Sequence[ModelProvider]) -> None:
        self.providers = tuple(providers)
        self.model_names: tuple[str, ...] = tuple(served_names(self.providers))

    @classmethod
    def from_config(cls, config: ModelConfig) -> ProviderSet:
        return cls(build_providers(config))

    def replace(self, providers: Sequence[ModelProvider]) -> tuple[ModelProvider, ...]:
        """Serve from `providers` from now on; returns the previous ones, which calls already
        under way keep using (the caller closes them once those are over)."""
        previous = self.providers
        self.providers = tuple(providers)
        self.model_names = tuple(served_names(self.providers))
        return previous

    def serves(self, model: str) -> bool:
        return any(p.serves(model) for p in self.providers)

    def select(self, model: str) -> ModelProvider:
        return select(self.providers, model)

    def stream(self, request: ModelRequest) -> AsyncIterator[ModelEvent]:
        return self.select(request.model).stream(request)

    def apply_live(self, config: ModelConfig) -> None:
        """Apply the live settings (call timeout, temperature, top_p) without a restart."""
        for provider in self.providers:
            if isinstance(provider, OpenAICompatProvider):
                provider.reconfigure(
                    call_timeout_s=config.call_timeout_s,
                    temperature=config.temperature,
                    top_p=config.top_p,
                )

    async def aclose(self) -> None:
        for provider in self.providers:
            if isinstance(provider, Closable):
                await provider.aclose()
