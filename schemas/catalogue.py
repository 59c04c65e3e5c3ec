"""Renders the event catalogue (docs/events.md) from the registry itself, so the document
cannot drift from the code: a test compares the committed file with this output.

    python -m schemas.catalogue > docs/events.md
    python -m schemas.catalogue settings   # rewrites the catalog table of docs/settings.md
"""

from __future__ import annotations

import importlib
import inspect
import pkgutil
import re
import sys
import types
import typing
from pathlib import Path
from typing import Any

import schemas
from schemas.events import EVENTS, Event
from schemas.settings_catalog import CATALOG, SettingSpec

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
    # Only the product's events: tests and benchmarks register their own in the same registry.
    classes = [
        cls
        for cls in (EVENTS.event_class(name) for name in EVENTS.known_types())
        if cls.__module__.startswith("schemas.")
    ]
    out = [_HEADER]
    for group in sorted({cls.type_name.split(".")[0] for cls in classes}):
        out += [f"## {group}", ""]
        for cls in classes:
            if cls.type_name.split(".")[0] == group:
                out += _event_section(cls)
    return "\n".join(out).rstrip() + "\n"


_CODE_PACKAGES = ("gateway", "actors", "eventstore", "projections")


def keys_read_by_code() -> frozenset[str]:
    """The catalog keys named in the code of the packages beside `schemas` (a key is read
    by its name: `settings.text("SVC_...")`). Read from the source files, not imported:
    `schemas` imports nothing of the project."""
    root = Path(schemas.__file__).resolve().parents[1]
    code = "".join(
        path.read_text(encoding="utf-8")
        for package in _CODE_PACKAGES
        for path in sorted((root / package).rglob("*.py"))
    )
    named = set(re.findall(r"""["'](\w+)["']""", code))
    return frozenset(key for key in CATALOG if key in named)


def _settings_row(spec: SettingSpec, used: bool) -> str:
    choices = "/".join(choice or "blank" for choice in spec.choices)
    kind = f"{spec.type} ({choices})" if spec.choices else spec.type
    default = f"`{spec.default}`" if spec.default else "-"
    effect = spec.effect + (f" *Note: {spec.note}*" if spec.note else "")
    secret = "yes" if spec.secret else ""
    cells = (
        f"`{spec.key}`",
        spec.group,
        kind,
        default,
        spec.apply or "-",
        secret,
        "yes" if used else "**no**",
        effect,
    )
    return "| " + " | ".join(cells) + " |"


def render_settings_table() -> str:
    """The catalog table of docs/settings.md (everything after its `## Catalog` heading)."""
    lines = [
        "## Catalog",
        "",
        "Apply: R restart, L live, - not stated (treated as R). Secret: values never shown.",
        "Used: **no** marks a key this build validates and stores but does not act on yet",
        "(the capability it configures is not built); the effect describes the spec's intent,",
        "and a change of it, with `svc settings set` or the API, answers with a note saying so.",
        "Generated from `schemas/settings_catalog.py` and the code that reads each key by",
        "`python -m schemas.catalogue settings`.",
        "",
        "| Key | Group | Type | Default | Apply | Secret | Used | Effect |",
        "| --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    used = keys_read_by_code()
    lines += [_settings_row(spec, spec.key in used) for spec in CATALOG.values()]
    return "\n".join(lines) + "\n"


def _rewrite_settings_doc(path: Path) -> None:
    text = path.read_text()
    head = text[: text.index("## Catalog")]
    path.write_text(head + render_settings_table())


if __name__ == "__main__":
    if sys.argv[1:] == ["settings"]:
        _rewrite_settings_doc(Path("docs/settings.md"))
    else:
        print(render(), end="")
