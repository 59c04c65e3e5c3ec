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


_KIND_WORDS = {
    "missing": "is required",
    "extra_forbidden": "is not a field this request takes",
    "string_type": "must be a string",
    "int_type": "must be an integer",
    "int_parsing": "must be an integer",
    "int_from_float": "must be a whole number",
    "float_type": "must be a number",
    "float_parsing": "must be a number",
    "bool_type": "must be true or false",
    "bool_parsing": "must be true or false",
    "list_type": "must be an array",
    "tuple_type": "must be an array",
    "set_type": "must be an array",
    "datetime_type": "must be a date-time such as 2027-01-01T00:00:00Z",
    "datetime_parsing": "must be a date-time such as 2027-01-01T00:00:00Z",
    "datetime_from_date_parsing": "must be a date-time such as 2027-01-01T00:00:00Z",
}
"""pydantic's error kinds whose own words name Python's types or its parsing ("Input should
be a valid integer, unable to parse string as an integer"), told as the wire's."""

_BOUND_WORDS = {
    "greater_than_equal": ("ge", "must be at least {}"),
    "less_than_equal": ("le", "must be at most {}"),
    "greater_than": ("gt", "must be more than {}"),
    "less_than": ("lt", "must be less than {}"),
}


def said(error: Any) -> str:
    """One error's message, as a person reading the request would put it."""
    kind, given = error["type"], error.get("input")
    if kind in ("model_type", "model_attributes_type", "dict_type"):
        return "must be a JSON object"
    if kind == "int_type" and isinstance(given, float) and abs(given) >= EXACT_INTEGERS:
        return "is out of range: far beyond any value it takes"
    if kind in _KIND_WORDS:
        return _KIND_WORDS[kind]
    context = error.get("ctx") or {}
    if kind in _BOUND_WORDS and _BOUND_WORDS[kind][0] in context:
        bound, words = _BOUND_WORDS[kind]
        return words.format(context[bound])
    if kind == "string_pattern_mismatch" and "pattern" in context:
        return f"must match the pattern {context['pattern']}"
    if kind in ("too_short", "too_long", "string_too_short", "string_too_long"):
        return _sized(kind, context) or str(error["msg"])
    message = str(error["msg"]).removeprefix("Value error, ")
    if message.startswith("Input should be "):  # a literal's or an enum's choices
        return "must be " + message.removeprefix("Input should be ")
    return message


def _sized(kind: str, context: dict[str, Any]) -> str | None:
    """A length outside its bounds: items for an array, characters for a string."""
    longest = kind.endswith("too_long")
    bound = context.get("max_length" if longest else "min_length")
    if not isinstance(bound, int):
        return None
    if not longest and bound == 1:
        return "must not be empty"
    side = "most" if longest else "least"
    if kind.startswith("string"):
        return f"must be at {side} {bound:,} characters long"
    actual = context.get("actual_length")
    held = f", not {actual:,}" if isinstance(actual, int) else ""
    return f"must hold at {side} {bound:,} items{held}"


def merged_unions(errors: Sequence[Any]) -> list[Any]:
    """The errors, with those of a value that matched no member of a union (errors at
    `field.str`, `field.list[str].0`) told in the value's terms: when the value was of one
    member's kind and only its content failed (`stop: [1]`), that member's problems, at the
    field (`stop.0: must be a string`); otherwise once, at the field, naming what it may be
    (`messages.0.content: must be a string or an array`)."""
    unions = _union_fields(errors)
    told: set[tuple[Any, ...]] = set()
    out: list[Any] = []
    for error in errors:
        loc = tuple(error["loc"])
        field = next((loc[:i] for i in range(len(loc)) if loc[:i] in unions), None)
        if field is None:
            out.append(error)
        elif field not in told:
            told.add(field)
            out.extend(_union_told(field, unions[field], errors))
    return out


def _union_fields(errors: Sequence[Any]) -> dict[tuple[Any, ...], list[str]]:
    """The fields whose value matched no member of a union, with the members tried, in the
    order tried. Only a union with a member no client's key can be (`str`, `list[...]`) is
    one: a dict's keys `Foo` and `Bar` end their errors' locations as model members do."""
    tried: dict[tuple[Any, ...], list[str]] = {}
    for error in errors:
        loc = tuple(error["loc"])
        for i, part in enumerate(loc):
            if _is_member(part):
                members = tried.setdefault(loc[:i], [])
                if part not in members:
                    members.append(part)
    return {
        field: members
        for field, members in tried.items()
        if len(members) > 1 and any(_BUILTIN_MEMBER.fullmatch(m) for m in members)
    }


def _union_told(field: tuple[Any, ...], members: list[str], errors: Sequence[Any]) -> list[Any]:
    depth = len(field)
    by_member: dict[str, list[Any]] = {member: [] for member in members}
    for error in errors:
        loc = tuple(error["loc"])
        if loc[:depth] == field and len(loc) > depth and loc[depth] in by_member:
            by_member[str(loc[depth])].append(error)
    for member_errors in by_member.values():
        kind_refused = any(
            len(e["loc"]) == depth + 1 and str(e["type"]).endswith("_type") for e in member_errors
        )
        if member_errors and not kind_refused:
            # The value was of this member's kind: its content is what to fix, which may
            # hold a union of its own (`x: str | list[str | list[int]]`).
            inner = [{**e, "loc": field + tuple(e["loc"][depth + 1 :])} for e in member_errors]
            return merged_unions(inner)
    kinds = " or ".join(_member_words(m) for m in members)
    first = by_member[members[0]][0] if by_member[members[0]] else {}
    return [{**first, "loc": field, "type": "union", "msg": f"must be {kinds}"}]


def _is_member(part: Any) -> bool:
    return isinstance(part, str) and _UNION_MEMBER.fullmatch(part) is not None


def _member_words(member: str) -> str:
    if member in _MEMBER_WORDS:
        return _MEMBER_WORDS[member]
    if member.startswith("list["):
        return "an array"
    return "an object"
