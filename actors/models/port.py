"""The model-provider port used by the conversation actor's turn handler.

Implementations: the built-in offline provider (embedded default, no upstream) and an
OpenAI-compatible upstream over aiohttp. Deltas stream back to the caller; only the turn's
outcome (content, usage, finish reason) becomes an event.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Protocol


@dataclass(frozen=True, slots=True)
class ChatMessage:
    role: str
    content: str
    name: str | None = None


@dataclass(frozen=True, slots=True)
class ModelRequest:
    model: str
    messages: tuple[ChatMessage, ...]
    temperature: float | None = None
    top_p: float | None = None
    max_tokens: int | None = None
    max_tokens_as: str = "max_tokens"
    """The wire name of `max_tokens` (OpenAI's newer name is `max_completion_tokens`)."""
    stop: tuple[str, ...] = ()
    seed: int | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    reasoning_effort: str | None = None
    verbosity: str | None = None
    stream: bool = True
    """False when the caller reads only the outcome (an `ask`, not a `stream`): a provider may
    then fetch the answer in one piece, and yields its text as one delta before `Finished`."""
    call_timeout_s: float | None = None
    """The call's time budget (0: none), the one its turn recorded its expiry by; None: the
    provider's own (`SVC_LLM_CALL_TIMEOUT_S` when it was built or last reconfigured)."""
    traceparent: str | None = None
    """The W3C trace context of the turn (when the gateway traces): a provider that calls a
    server sends it, so the server's spans join the turn's trace."""


@dataclass(frozen=True, slots=True)
class Usage:
    prompt_tokens: int
    completion_tokens: int

    @property
    def total_tokens(self) -> int:
        return self.prompt_tokens + self.completion_tokens


@dataclass(frozen=True, slots=True)
class TextDelta:
    text: str


@dataclass(frozen=True, slots=True)
class Finished:
    finish_reason: str
    usage: Usage


ModelEvent = TextDelta | Finished


class ModelProvider(Protocol):
    name: str

    def serves(self, model: str) -> bool:
        """True when this provider answers for `model` (a model or agent name)."""
        ...

    def stream(self, request: ModelRequest) -> AsyncIterator[ModelEvent]:
        """Yield text deltas, then exactly one `Finished`. Raises `UpstreamError` or
        `UpstreamTimeout` (from schemas.errors) on failure."""
        ...


def well_formed(text: str) -> str:
    """`text` with each lone surrogate replaced by `?`. JSON's `\\ud83d` escape can make one
    (a model server cutting a message in the middle of an emoji), and it has no UTF-8 form,
    so no response, log line or event could carry it."""
    return text if text.isascii() else text.encode("utf-8", "replace").decode("utf-8")
