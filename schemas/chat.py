"""Wire records of the chat-completions-compatible endpoint (POST /v1/chat/completions).

The shapes follow the OpenAI `chat.completion` / `chat.completion.chunk` convention so that
stock OpenAI clients work unchanged. Request fields those clients commonly send that this
service does not act on (`user`, `seed`, `stop`, penalties, `metadata`, ...) are accepted and
ignored; fields whose silent omission would change the answer (`n` > 1, `tools`, `logprobs`)
are refused with a 400.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    SerializerFunctionWrapHandler,
    field_validator,
    model_serializer,
    model_validator,
)

Role = Literal["system", "user", "assistant", "tool"]


class ChatMessageIn(BaseModel):
    model_config = ConfigDict(frozen=True, extra="ignore")

    role: Role
    content: str = Field(max_length=1_000_000)
    name: str | None = Field(default=None, max_length=200)


class StreamOptions(BaseModel):
    model_config = ConfigDict(frozen=True, extra="ignore")

    include_usage: bool = Field(default=False, strict=True)


class ChatCompletionRequest(BaseModel):
    model_config = ConfigDict(frozen=True, extra="ignore")

    model: str = Field(min_length=1, max_length=200)
    messages: list[ChatMessageIn] = Field(min_length=1, max_length=10_000)
    # Strict like OpenAI's own API: "1" is not a temperature and `true` is not a token count.
    stream: bool = Field(default=False, strict=True)
    temperature: float | None = Field(default=None, ge=0, le=2, strict=True)
    top_p: float | None = Field(default=None, ge=0, le=1, strict=True)
    max_tokens: int | None = Field(default=None, gt=0, strict=True)
    max_completion_tokens: int | None = Field(default=None, gt=0, strict=True)
    stream_options: StreamOptions | None = None
    n: int | None = Field(default=None, strict=True)
    tools: list[Any] | None = None
    logprobs: bool | None = Field(default=None, strict=True)
    user: str | None = None

    @field_validator("n")
    @classmethod
    def _single_choice(cls, value: int | None) -> int | None:
        if value is not None and value != 1:
            raise ValueError("only n=1 is supported: one choice per completion")
        return value

    @field_validator("tools")
    @classmethod
    def _no_tools(cls, value: list[Any] | None) -> list[Any] | None:
        if value:
            raise ValueError("client-defined tools are not supported on this endpoint")
        return value

    @field_validator("logprobs")
    @classmethod
    def _no_logprobs(cls, value: bool | None) -> bool | None:
        if value:
            raise ValueError("logprobs are not supported")
        return value

    @model_validator(mode="after")
    def _one_token_limit(self) -> ChatCompletionRequest:
        if (
            self.max_tokens is not None
            and self.max_completion_tokens is not None
            and self.max_tokens != self.max_completion_tokens
        ):
            raise ValueError("max_tokens and max_completion_tokens disagree; send one of them")
        return self

    @property
    def token_limit(self) -> int | None:
        """`max_tokens`, or its newer OpenAI name `max_completion_tokens`."""
        return self.max_tokens if self.max_tokens is not None else self.max_completion_tokens

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage


class CompletionUsage(BaseModel):
    model_config = ConfigDict(frozen=True)

    prompt_tokens: int
    completion_tokens: int
    total_tokens: int


class ChatMessageOut(BaseModel):
    model_config = ConfigDict(frozen=True)

    role: Literal["assistant"] = "assistant"
    content: str


class ChatCompletionChoice(BaseModel):
    model_config = ConfigDict(frozen=True)

    index: int = 0
    message: ChatMessageOut
    finish_reason: str
    logprobs: None = None


class ChatCompletionResponse(BaseModel):
    """The OpenAI `chat.completion` object."""

    model_config = ConfigDict(frozen=True)

    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int
    model: str
    choices: list[ChatCompletionChoice]
    usage: CompletionUsage
    system_fingerprint: str | None = None


class ChoiceDelta(BaseModel):
    """A chunk's `delta`: only the keys that carry something are sent, as OpenAI does."""

    model_config = ConfigDict(frozen=True)

    role: Literal["assistant"] | None = None
    content: str | None = None

    @model_serializer(mode="wrap")
    def _drop_empty(self, handler: SerializerFunctionWrapHandler) -> dict[str, Any]:
        data: dict[str, Any] = handler(self)
        return {key: value for key, value in data.items() if value is not None}


class ChunkChoice(BaseModel):
    model_config = ConfigDict(frozen=True)

    index: int = 0
    delta: ChoiceDelta
    finish_reason: str | None = None
    logprobs: None = None


class ChatCompletionChunk(BaseModel):
    """The OpenAI `chat.completion.chunk` object; one per SSE `data:` line.

    With `stream_options.include_usage`, every chunk carries `usage: null` and one last chunk
    carries an empty `choices` list and the usage, as OpenAI streams it.
    """

    model_config = ConfigDict(frozen=True)

    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChunkChoice]
    usage: CompletionUsage | None = None
    system_fingerprint: str | None = None


class ModelCard(BaseModel):
    """One entry of GET /v1/models, in the OpenAI `model` shape."""

    model_config = ConfigDict(frozen=True)

    id: str
    object: Literal["model"] = "model"
    created: int = 0
    owned_by: str


class ModelList(BaseModel):
    model_config = ConfigDict(frozen=True)

    object: Literal["list"] = "list"
    data: list[ModelCard]
