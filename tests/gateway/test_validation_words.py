"""Validation problems in the words of the wire (gateway.validation_words): QA findings where
pydantic's own words named Python types or misread what was sent."""

from __future__ import annotations

from typing import Any

import orjson
import pytest
from pydantic import BaseModel, Field, ValidationError

from gateway.errors import describe_validation
from gateway.validation_words import merged_unions
from schemas.admin import ApiKeyCreate
from schemas.chat import ChatCompletionRequest
from schemas.settings import SetSettingRequest

HI = [{"role": "user", "content": "hi"}]


def problems(model: type[BaseModel], body: bytes) -> str:
    """What a client sending `body` (read as the gateway reads it, with orjson) is told."""
    with pytest.raises(ValidationError) as refused:
        model.model_validate(orjson.loads(body))
    return describe_validation(refused.value)


def chat_body(**fields: Any) -> bytes:
    return orjson.dumps({"model": "m", "messages": HI, **fields})


def test_a_body_or_a_field_that_is_no_object_is_said_so() -> None:
    assert problems(ChatCompletionRequest, b"[1, 2]") == (
        "invalid request: body: must be a JSON object"
    )  # was: "Input should be a valid dictionary or instance of ChatCompletionRequest"
    said = problems(ChatCompletionRequest, chat_body(stream_options=5))
    assert said == "invalid request: stream_options: must be a JSON object", said


def test_a_number_too_large_to_be_an_integer_is_out_of_range() -> None:
    """orjson reads an integer beyond 64 bits as a float: pydantic said "Input should be a
    valid integer" of a value that is one."""
    huge = b'{"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": '
    said = problems(ChatCompletionRequest, huge + b"99999999999999999999999999}")
    assert said == "invalid request: max_tokens: is out of range: far beyond any value it takes"
    said = problems(ApiKeyCreate, b'{"name": "k", "scopes": ["chat"], "rate_limit_rpm": 1e30}')
    assert "rate_limit_rpm: is out of range" in said, said
    said = problems(ApiKeyCreate, b'{"name": "k", "scopes": ["chat"], "rate_limit_rpm": 2.5}')
    assert "rate_limit_rpm: must be an integer" in said, said  # a true fraction


def test_a_value_no_member_of_a_union_takes_is_told_once_at_its_field() -> None:
    content = orjson.dumps({"model": "m", "messages": [{"role": "user", "content": 5}]})
    said = problems(ChatCompletionRequest, content)
    assert said == "invalid request: messages.0.content: must be a string or an array", said
    # A member's own deeper problem is still told as it is.
    parts = [{"role": "user", "content": [{"type": "image"}]}]
    said = problems(ChatCompletionRequest, orjson.dumps({"model": "m", "messages": parts}))
    assert "messages.0.content" in said and "must be a string or an array" not in said, said


def test_keys_that_look_like_type_names_are_not_a_union() -> None:
    """Review finding: a dict's keys `Foo` and `Bar` end their errors' locations as a
    union's model members do; only a union with a member no key can be is merged."""
    errors = [
        {"loc": ("counts", "Foo"), "type": "int_type", "msg": "Input should be a valid integer"},
        {"loc": ("counts", "Bar"), "type": "int_type", "msg": "Input should be a valid integer"},
    ]
    assert merged_unions(errors) == errors


class Few(BaseModel):
    items: list[int] = Field(max_length=2)


def test_pydantic_words_are_told_as_the_wire_s() -> None:
    """QA finding: `scopes: []` was told "List should have at least 1 item after validation,
    not 0", and a missing field "Field required"."""
    said = problems(ApiKeyCreate, b'{"name": "k", "scopes": []}')
    assert said == "invalid request: scopes: must not be empty", said
    said = problems(ApiKeyCreate, b'{"scopes": ["chat"], "rpm": 5}')
    assert said == ("invalid request: name: is required; rpm: is not a field this request takes"), (
        said
    )
    said = problems(ApiKeyCreate, b'{"name": "' + b"k" * 300 + b'", "scopes": "chat"}')
    assert said.startswith("invalid request: name: must be at most "), said
    assert said.endswith(" characters long; scopes: must be an array"), said
    said = problems(ChatCompletionRequest, chat_body(temperature=3, stream="yes", top_p=-1))
    assert said == (
        "invalid request: stream: must be true or false; temperature: must be at most 2.0; "
        "top_p: must be at least 0.0"
    ), said
    said = problems(Few, b'{"items": [1, 2, 3]}')
    assert said == "invalid request: items: must hold at most 2 items, not 3", said
    role = orjson.dumps({"model": "m", "messages": [{"role": "robot", "content": "x"}]})
    said = problems(ChatCompletionRequest, role)
    assert said.startswith("invalid request: messages.0.role: must be 'system', "), said


def test_a_setting_s_value_is_told_the_form_taken() -> None:
    """QA finding: a bare JSON string was "body: must be a JSON object", and a number
    "value: Input should be a valid string", neither showing the form to send."""
    said = problems(SetSettingRequest, b'"0.5"')
    assert (
        said == 'invalid request: body: send {"value": "..."}: the value as a string, in an object'
    )
    said = problems(SetSettingRequest, b'{"value": 0.5}')
    assert said == 'invalid request: value: must be a string: send {"value": "0.5"}', said


def test_a_union_value_of_one_members_kind_is_told_its_contents_problem() -> None:
    """QA finding: `stop: [1]` was told "stop.str: ...; stop.list[str].0: ...", naming
    Python's types, and a part without a type "content part of type None"."""
    assert problems(ChatCompletionRequest, chat_body(stop=[1])) == (
        "invalid request: stop.0: must be a string"
    )
    part = orjson.dumps(
        {"model": "m", "messages": [{"role": "user", "content": [{"type": "text"}]}]}
    )
    assert problems(ChatCompletionRequest, part) == (
        'invalid request: messages.0.content.0: a text part needs "text" (a string)'
    )
    untyped = orjson.dumps(
        {"model": "m", "messages": [{"role": "user", "content": [{"text": "a"}]}]}
    )
    assert problems(ChatCompletionRequest, untyped) == (
        'invalid request: messages.0.content: part 0 needs "type": "text"'
    )


class Nested(BaseModel):
    x: str | list[str | list[int]]


def test_a_union_inside_a_union_and_a_date_time_are_told_in_wire_words() -> None:
    """Review and QA findings: `x.0.str: ...; x.0.list[int]: ...` for a nested union, and
    "input is too short" for an expiry of `yesterday`."""
    assert problems(Nested, b'{"x": [1.5]}') == "invalid request: x.0: must be a string or an array"
    said = problems(ApiKeyCreate, b'{"name": "k", "scopes": ["chat"], "expires_at": "yesterday"}')
    assert said == "invalid request: expires_at: must be a date-time such as 2027-01-01T00:00:00Z"


def test_an_integer_with_bounds_in_a_union_is_still_an_integer() -> None:
    """Left from the last session: `Annotated[int, ...] | None` was not taken for an integer
    field, so `?n=3_0` would have read as 30 there."""
    from typing import Annotated

    from gateway.errors import _takes_integer

    assert _takes_integer(Annotated[int, Field(ge=1)] | None)
    assert _takes_integer(int | None) and _takes_integer(int)
    assert not _takes_integer(str | None) and not _takes_integer(Annotated[str, Field()])


def test_a_parts_other_kinds_field_is_ignored_as_any_unknown_key() -> None:
    """Review finding: with refusal parts taken, a text part carrying a non-string `refusal`
    (or a refusal part a `text`) was refused, where any other unknown key is ignored."""
    mixed = [
        {"role": "user", "content": [{"type": "text", "text": "a", "refusal": 5}]},
        {"role": "assistant", "content": [{"type": "refusal", "refusal": "no", "text": 7}]},
        {"role": "user", "content": "b"},
    ]
    request = ChatCompletionRequest.model_validate({"model": "m", "messages": mixed})
    assert [m.text for m in request.messages] == ["a", "no", "b"]
