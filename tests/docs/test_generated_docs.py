"""docs/events.md is generated from the event registry; it must match the code."""

from pathlib import Path

from schemas.catalogue import render, render_settings_table
from schemas.events import EVENTS

DOC = Path(__file__).resolve().parents[2] / "docs" / "events.md"


def test_event_catalogue_matches_the_registry() -> None:
    assert DOC.read_text() == render(), (
        "docs/events.md is stale: run `python -m schemas.catalogue > docs/events.md`"
    )


def test_every_registered_event_is_documented() -> None:
    text = render()
    product = [
        n for n in EVENTS.known_types() if EVENTS.event_class(n).__module__.startswith("schemas.")
    ]
    missing = [name for name in product if f"`{name}`" not in text]
    assert missing == []


SETTINGS_DOC = DOC.parent / "settings.md"


def test_settings_doc_lists_the_catalog_as_it_is() -> None:
    text = SETTINGS_DOC.read_text()
    assert text[text.index("## Catalog") :] == render_settings_table(), (
        "docs/settings.md is stale: run `python -m schemas.catalogue settings`"
    )
