"""pydantic's validation errors in the words of the wire: what a JSON client sent and should
send, not the names of the Python types that read it."""

from __future__ import annotations

import re
from collections.abc import Sequence
from typing import Any

_UNION_MEMBER = re.compile(r"(str|int|float|bool|none|list\[.*\]|dict\[.*\]|[A-Z]\w*)")
"""The last part of an error's location when pydantic tried one member of a union."""
_BUILTIN_MEMBER = re.compile(r"(str|int|float|bool|none|list\[.*\]|dict\[.*\])")
"""Of those, the ones no client's key can be mistaken for (a dict's keys `Foo` and `Bar`
look like model names): a union is merged only when one member is such."""

_MEMBER_WORDS = {"str": "a string", "int": "an integer", "float": "a number", "bool": "a boolean"}

EXACT_INTEGERS = 2**53
"""A JSON number at least this large arrives as a float (orjson reads an integer beyond 64
bits as one), which no integer field takes: it is out of range, not "not an integer"."""


def said(error: Any) -> str:
    """One error's message, as a person reading the request would put it."""
    kind, given = error["type"], error.get("input")
    if kind in ("model_type", "model_attributes_type", "dict_type"):
        return "must be a JSON object"
    if kind == "int_type" and isinstance(given, float) and abs(given) >= EXACT_INTEGERS:
        return "is out of range: far beyond any value it takes"
    return str(error["msg"]).removeprefix("Value error, ")


def merged_unions(errors: Sequence[Any]) -> list[Any]:
    """The errors, with those of a value that matched no member of a union (one error per
    member, at `field.str`, `field.list[TextPart]`) told once, at the field, naming what it
    may be: `messages.0.content: must be a string or an array`."""
    members: dict[tuple[Any, ...], list[str]] = {}
    for error in errors:
        loc = tuple(error["loc"])
        if loc and _is_member(loc[-1]) and str(error["type"]).endswith("_type"):
            members.setdefault(loc[:-1], []).append(str(loc[-1]))
    merged = {
        field
        for field, tried in members.items()
        if len(tried) > 1 and any(_BUILTIN_MEMBER.fullmatch(m) for m in tried)
    }
    out: list[Any] = []
    for error in errors:
        loc = tuple(error["loc"])
        field = loc[:-1]
        if field not in merged:
            out.append(error)
        elif members.get(field) is not None:
            kinds = " or ".join(_member_words(m) for m in members.pop(field))
            out.append({**error, "loc": field, "type": "union", "msg": f"must be {kinds}"})
    return out


def _is_member(part: Any) -> bool:
    return isinstance(part, str) and _UNION_MEMBER.fullmatch(part) is not None


def _member_words(member: str) -> str:
    if member in _MEMBER_WORDS:
        return _MEMBER_WORDS[member]
    if member.startswith("list["):
        return "an array"
    return "an object"
