"""Wire records of the chat-completions-compatible endpoint (POST /v1/chat/completions).

The shapes follow the OpenAI `chat.completion` / `chat.completion.chunk` convention so that
stock OpenAI clients work unchanged. Sampling fields reach the model (`temperature`, `top_p`,
`max_tokens`, `stop`, `seed`, the penalties); fields that do not change the answer (`user`,
`metadata`, `store`, ...) are accepted and ignored; fields whose silent omission would change
the answer (`n` > 1, tools in either form, JSON or schema output, logprobs, logit bias, audio)
are refused with a 400 naming the field.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    SerializerFunctionWrapHandler,
    ValidationInfo,
    field_validator,
    model_serializer,
    model_validator,
)

from schemas.conversation import (
    MAX_CONTENT,
    MAX_STOP,
    MAX_STOP_CHARS,
    MAX_TOKEN_LIMIT,
    ReasoningEffort,
    Verbosity,
)
from schemas.conversation import Role as ModelRole
from schemas.errors import echoed

Role = Literal["system", "developer", "user", "assistant", "tool"]
"""`developer` is OpenAI's newer name for `system` (the SDK's
ChatCompletionDeveloperMessageParam): read as a system message from here on
(`ChatMessageIn.model_role`), since not every model server knows the name. `tool` is one of
the spec's roles: a tool's output as text, which the model server is sent as a labelled user
message (actors/models/openai_compat.py), since no tool call of this endpoint's precedes it."""
_REFUSED_ROLES = {
    "function": "role 'function' (the legacy function-calling result) is not supported: "
    "client-defined functions are not; send its text in a user message instead",
}
_NO_TOOL_CALLS = (
    "an assistant message with {field} is not supported: client-defined tools are not; send "
    "the assistant's text only (drop {field}; the tool messages answering it are read as text)"
)


class ContentPart(BaseModel):
    """One part of a message's content in the array form: `{"type": "text", "text": ...}`,
    or, in an assistant's content, `{"type": "refusal", "refusal": ...}`, a part in which
    the model declined, as OpenAI returns it and its clients send it back as history (the
    refusal is the assistant's text). One model for both, so that a part missing its field
    is one error naming it, not one per kind of part."""

    model_config = ConfigDict(frozen=True, extra="ignore")

    type: Literal["text", "refusal"]
    # Bounded with the others, joined (ChatMessageIn._content_fits).
    text_field: str | None = Field(default=None, alias="text")
    refusal: str | None = None

    @model_validator(mode="before")
    @classmethod
    def _own_kinds_field_only(cls, value: object) -> object:
        # The other kind's field is no part of this one: ignored as any unknown key is.
        if isinstance(value, dict):
            other = {"text": "refusal", "refusal": "text"}.get(str(value.get("type")))
            if other is not None and other in value:
                return {k: v for k, v in value.items() if k != other}
        return value

    @model_validator(mode="after")
    def _has_its_field(self) -> ContentPart:
        if self._own_field() is None:  # each kind's field is named as the kind is
            raise ValueError(f'a {self.type} part needs "{self.type}" (a string)')
        return self

    def _own_field(self) -> str | None:
        return self.text_field if self.type == "text" else self.refusal

    @property
    def text(self) -> str:
        return self._own_field() or ""


_PART_TYPES = {"text": "text parts", "refusal": "an assistant's refusal parts"}


class ChatMessageIn(BaseModel):
    """A message of the request. `content` takes OpenAI's three forms: a string, an array of
    text parts (joined without a separator, as OpenAI-compatible gateways flatten them), or
    null on an assistant message. Other part types (images, audio, files) are refused, and
    so are assistant tool_calls, client-defined tools being so; a `tool` message is taken as
    text (its `tool_call_id`, answering a call the endpoint never made, is ignored)."""

    model_config = ConfigDict(frozen=True, extra="ignore")

    role: Role
    # No max_length here: on the union it spoke of "items" for a string too long; the text's
    # length, parts joined, is checked by `_content_fits` (the body's 4 MiB bounds the parse).
    content: str | list[ContentPart] | None
    name: str | None = Field(default=None, max_length=200)
    # An assistant message the model refused to write, as OpenAI returns it (content null):
    # sent back as history, the refusal is the assistant's text (as this service answers one).
    refusal: str | None = Field(default=None, max_length=MAX_CONTENT)
    # Refused unless absent or empty: dropped on the way to the model server, they would
    # leave a history it refuses (or misreads).
    tool_calls: list[Any] | None = None
    function_call: Any = None

    @field_validator("tool_calls", "function_call")
    @classmethod
    def _no_tool_calls(cls, value: object, info: ValidationInfo) -> object:
        if value:
            raise ValueError(_NO_TOOL_CALLS.format(field=info.field_name))
        return value

    @field_validator("role", mode="before")
    @classmethod
    def _supported_role(cls, value: object) -> object:
        # A clear word for the roles of features this endpoint does not have, rather than
        # pydantic's list of the roles it takes.
        if isinstance(value, str) and value in _REFUSED_ROLES:
            raise ValueError(_REFUSED_ROLES[value])
        return value

    @field_validator("content", mode="before")
    @classmethod
    def _text_parts_only(cls, value: object) -> object:
        if isinstance(value, list):
            for index, part in enumerate(value):
                if not isinstance(part, dict):
                    raise ValueError(f'part {index} must be an object: {{"type": "text", ...}}')
                kind = part.get("type")
                if kind is None:
                    raise ValueError(f'part {index} needs "type": "text"')
                if kind not in _PART_TYPES:
                    raise ValueError(
                        f"part {index} is of type {echoed(str(kind))}, which is not "
                        f"supported: only {' and '.join(_PART_TYPES.values())}"
                    )
        return value

    @model_validator(mode="after")
    def _content_fits(self) -> ChatMessageIn:
        if self.content is None and self.role != "assistant":
            raise ValueError(f"a {self.role} message needs content: null is for assistant only")
        if (
            self.role != "assistant"
            and isinstance(self.content, list)
            and any(part.type == "refusal" for part in self.content)
        ):
            raise ValueError(f"a refusal part is an assistant's: a {self.role} message sends text")
        if len(self.text) > MAX_CONTENT:
            raise ValueError(f"a message's content is at most {MAX_CONTENT:,} characters")
        return self

    @property
    def model_role(self) -> ModelRole:
        """The role the turn records and the model server is sent: `developer` is `system`."""
        return "system" if self.role == "developer" else self.role

    @property
    def text(self) -> str:
        content = self.content
        if content is None:
            return self.refusal or ""
        if isinstance(content, str):
            return content
        return "".join(part.text for part in content)


class StreamOptions(BaseModel):
    model_config = ConfigDict(frozen=True, extra="ignore")

    include_usage: bool = Field(default=False, strict=True)

    @field_validator("include_usage", mode="before")
    @classmethod
    def _null_is_false(cls, value: object) -> object:
        return False if value is None else value


class ChatCompletionRequest(BaseModel):
    model_config = ConfigDict(frozen=True, extra="ignore")

    model: str = Field(min_length=1, max_length=200)
    messages: list[ChatMessageIn] = Field(min_length=1, max_length=10_000)
    # Strict like OpenAI's own API: "1" is not a temperature and `true` is not a token count.
    stream: bool = Field(default=False, strict=True)
    temperature: float | None = Field(default=None, ge=0, le=2, strict=True)
    top_p: float | None = Field(default=None, ge=0, le=1, strict=True)
    max_tokens: int | None = Field(default=None, gt=0, le=MAX_TOKEN_LIMIT, strict=True)
    max_completion_tokens: int | None = Field(default=None, gt=0, le=MAX_TOKEN_LIMIT, strict=True)
    stream_options: StreamOptions | None = None
    stop: str | list[str] | None = None
    seed: int | None = Field(default=None, ge=-(2**63), le=2**63 - 1, strict=True)
    presence_penalty: float | None = Field(default=None, ge=-2, le=2, strict=True)
    frequency_penalty: float | None = Field(default=None, ge=-2, le=2, strict=True)
    n: int | None = Field(default=None, strict=True)
    user: str | None = None
    reasoning_effort: ReasoningEffort | None = None
    verbosity: Verbosity | None = None
    web_search_options: dict[str, Any] | None = None
    # Refused unless absent or a no-op: each would change the answer, and none is honoured.
    tools: list[Any] | None = None
    functions: list[Any] | None = None
    function_call: Any = None
    tool_choice: Any = None
    response_format: dict[str, Any] | None = None
    logprobs: bool | None = Field(default=None, strict=True)
    top_logprobs: int | None = Field(default=None, strict=True)
    logit_bias: dict[str, Any] | None = None
    modalities: list[str] | None = None
    audio: Any = None
    moderation: Any = None  # a policy that would block or change the answer

    @field_validator("stream", mode="before")
    @classmethod
    def _null_is_no_stream(cls, value: object) -> object:
        # OpenAI's API takes JSON null for `stream` (and `include_usage`) as false.
        return False if value is None else value

    @field_validator("n")
    @classmethod
    def _single_choice(cls, value: int | None) -> int | None:
        if value is not None and value != 1:
            raise ValueError("only n=1 is supported: one choice per completion")
        return value

    @field_validator("stop")
    @classmethod
    def _stop_sequences(cls, value: str | list[str] | None) -> str | list[str] | None:
        sequences = [value] if isinstance(value, str) else value or []
        if len(sequences) > MAX_STOP or not all(0 < len(s) <= MAX_STOP_CHARS for s in sequences):
            raise ValueError(
                f"at most {MAX_STOP} stop sequences of 1 to {MAX_STOP_CHARS} characters each"
            )
        return value

    @field_validator("tools", "functions")
    @classmethod
    def _no_tools(cls, value: object) -> object:
        if value:
            raise ValueError(
                "client-defined tools are not supported on this endpoint; send the request "
                "without them"
            )
        return value

    @field_validator("moderation")
    @classmethod
    def _no_moderation(cls, value: object) -> object:
        if value is not None:
            raise ValueError(
                "moderation policies are not supported on this endpoint; send the request "
                "without one"
            )
        return value

    @field_validator("tool_choice", "function_call")
    @classmethod
    def _no_tool_choice(cls, value: object) -> object:
        # function_call is tool_choice's legacy spelling: "none" and "auto" choose no tool.
        if value not in (None, "none", "auto"):
            raise ValueError(
                "only 'none' or 'auto' (or leave it out): client-defined tools are not supported"
            )
        return value

    @field_validator("response_format")
    @classmethod
    def _text_only(cls, value: dict[str, Any] | None) -> dict[str, Any] | None:
        if value is not None and value.get("type", "text") != "text":
            raise ValueError(
                "only {'type': 'text'} is supported: JSON mode and structured outputs are not"
            )
        return value

    @field_validator("logprobs", "top_logprobs", "logit_bias")
    @classmethod
    def _no_token_level_control(cls, value: object) -> object:
        if value:
            raise ValueError("token log probabilities and logit bias are not supported")
        return value

    @field_validator("web_search_options")
    @classmethod
    def _no_web_search(cls, value: object) -> object:
        if value is not None:
            raise ValueError("web search is not supported on this endpoint")
        return value

    @field_validator("modalities", "audio")
    @classmethod
    def _no_audio(cls, value: object) -> object:
        if value is not None and value != ["text"]:
            raise ValueError("only text output is supported")
        return value

    @field_validator("messages")
    @classmethod
    def _a_user_message(cls, value: list[ChatMessageIn]) -> list[ChatMessageIn]:
        # The conversation actor refuses such a turn too; checked here as well, it is refused
        # before a conversation id is drawn for it, so the 400 names none.
        if not any(m.role == "user" for m in value):
            raise ValueError("at least one message must have role 'user'")
        return value

    @model_validator(mode="after")
    def _stream_options_with_a_stream(self) -> ChatCompletionRequest:
        # As OpenAI's API answers: code that worked here would fail there.
        if self.stream_options is not None and not self.stream:
            raise ValueError("stream_options is only allowed when stream is true")
        return self

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
    def token_limit_name(self) -> Literal["max_completion_tokens"] | None:
        """`max_completion_tokens` when the client named the limit so (and not `max_tokens`
        as well): the upstream is sent the name the client chose."""
        named_new = self.max_tokens is None and self.max_completion_tokens is not None
        return "max_completion_tokens" if named_new else None

    @property
    def stop_sequences(self) -> tuple[str, ...]:
        return (self.stop,) if isinstance(self.stop, str) else tuple(self.stop or ())

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
    created: int
    owned_by: str


class ModelList(BaseModel):
    model_config = ConfigDict(frozen=True)

    object: Literal["list"] = "list"
    data: list[ModelCard]
