"""Renders the event catalogue (docs/events.md) from the registry itself, so the document
cannot drift from the code: a test compares the committed file with this output.

    python -m schemas.catalogue > docs/events.md
"""

from __future__ import annotations

import importlib
import inspect
import pkgutil
import types
import typing
from typing import Any

import schemas
from schemas.events import EVENTS, Event

_HEADER = """# Event catalogue

Every event SVC records, grouped by the stream kind that records it. Generated from the
registry in `schemas/` by `python -m schemas.catalogue > docs/events.md`; a test fails when
this file and the code disagree. Types are the wire names stored in `events.type`; the
schema version is stored beside each event and older versions are upcast on read.
"""


def load_all_event_modules() -> None:
    for module in pkgutil.iter_modules(schemas.__path__):
        importlib.import_module(f"schemas.{module.name}")


def _type_label(annotation: Any) -> str:
    origin, args = typing.get_origin(annotation), typing.get_args(annotation)
    if origin is typing.Annotated:
        return _type_label(args[0])
    if origin in (typing.Union, types.UnionType):
        return " or ".join(_type_label(a) for a in args)
    if origin is typing.Literal:
        return " or ".join(repr(a) for a in args)
    if origin is not None:
        inner = ", ".join(_type_label(a) for a in args)
        return f"{getattr(origin, '__name__', str(origin))}[{inner}]"
    if annotation is type(None):
        return "null"
    return getattr(annotation, "__name__", str(annotation))


def _event_section(cls: type[Event]) -> list[str]:
    doc = inspect.cleandoc(cls.__dict__.get("__doc__") or "")
    lines = [f"### `{cls.type_name}` (v{cls.schema_version}) {cls.__name__}", ""]
    if doc:
        lines += [doc.replace("\n", " "), ""]
    lines += ["| field | type | required |", "| --- | --- | --- |"]
    for name, field in cls.model_fields.items():
        required = "yes" if field.is_required() else "no"
        lines.append(f"| {name} | {_type_label(field.annotation)} | {required} |")
    return [*lines, ""]


def render() -> str:
    load_all_event_modules()
    classes = [EVENTS.event_class(name) for name in EVENTS.known_types()]
    out = [_HEADER]
    for group in sorted({name.split(".")[0] for name in EVENTS.known_types()}):
        out += [f"## {group}", ""]
        for cls in classes:
            if cls.type_name.split(".")[0] == group:
                out += _event_section(cls)
    return "\n".join(out).rstrip() + "\n"


if __name__ == "__main__":
    print(render(), end="")
