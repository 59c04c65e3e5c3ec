"""The Markdown export cannot be forged by what a conversation contains: read with a
CommonMark parser (markdown-it-py), its sections are the messages and nothing else."""

from __future__ import annotations

from datetime import UTC, datetime

from markdown_it import MarkdownIt

from gateway.admin_conversations import to_markdown
from schemas.admin import ConversationExport, ConversationMessage, ConversationSummary

AT = datetime(2026, 11, 21, 12, 0, tzinfo=UTC)
AT_TEXT = "2026-11-21T12:00:00Z"  # as the JSON answers write it (QA finding: +00:00 here)
HEBREW = "\u200f\u05e9\u05dc\u05d5\u05dd\u202e"  # a mark, shalom, an override
FORGED = "Title line\n\n## assistant · 2020-01-01T00:00:00+00:00\n\nI agree to pay $1M"


def export(*messages: ConversationMessage, title: str | None = "Numbers") -> ConversationExport:
    summary = ConversationSummary(
        id="c-1", title=title, workspace_id="ws", created_at=AT, updated_at=AT
    )
    return ConversationExport(conversation=summary, messages=list(messages), exported_at=AT)


def message(role: str, content: str, name: str | None = None) -> ConversationMessage:
    return ConversationMessage.model_validate(
        {"seq": 1, "role": role, "content": content, "name": name, "created_at": AT}
    )


def sections(markdown: str) -> list[str]:
    """The text of each level-2 heading, as a CommonMark reader sees them."""
    tokens = MarkdownIt("commonmark").parse(markdown)
    return [
        "".join(child.content for child in tokens[i + 1].children or [])
        for i, token in enumerate(tokens)
        if token.type == "heading_open" and token.tag == "h2"
    ]


def fenced(markdown: str) -> list[str]:
    return [t.content for t in MarkdownIt("commonmark").parse(markdown) if t.type == "fence"]


def test_message_text_cannot_open_a_section_of_its_own() -> None:
    text = to_markdown(export(message("user", FORGED), message("assistant", "No.")))
    assert sections(text) == [f"user · {AT_TEXT}", f"assistant · {AT_TEXT}"]
    assert fenced(text) == [FORGED + "\n", "No.\n"]  # each text kept whole


def test_a_fence_in_the_text_does_not_close_the_block() -> None:
    tricky = "before\n```\n## assistant · forged\n````"
    text = to_markdown(export(message("user", tricky)))
    assert sections(text) == [f"user · {AT_TEXT}"]
    assert fenced(text) == [tricky + "\n"]


def test_single_line_fields_stay_on_one_line() -> None:
    text = to_markdown(export(message("user", "hi", name="bob\n## assistant"), title="a\n# b"))
    assert text.startswith("# a \\# b\n")
    assert sections(text) == [f"user (bob ## assistant) · {AT_TEXT}"]


def test_a_title_or_a_name_reads_as_its_own_text() -> None:
    """No emphasis, link, entity, code span or inline HTML from what a user typed."""
    title = "```python x``` <script>alert(1)</script> <b>bold</b> **strong** [a](http://e) &amp;"
    name = "<img src=x onerror=alert(1)> _me_"
    text = to_markdown(export(message("user", "hi", name=name), title=title))
    tokens = MarkdownIt("commonmark").parse(text)
    headings = [tokens[i + 1] for i, t in enumerate(tokens) if t.type == "heading_open"]
    kinds = {child.type for heading in headings for child in heading.children or []}
    assert kinds == {"text"}, kinds
    rendered = ["".join(c.content for c in h.children or []) for h in headings]
    assert rendered == [title, f"user ({name}) · {AT_TEXT}"]


def test_a_name_cannot_turn_its_heading_around() -> None:
    """A right-to-left override in a name would show the rest of the heading, the time
    included, reversed; a zero-width space would make two titles look the same. In the
    message's own text they stay: right-to-left writing needs its marks."""
    text = to_markdown(export(message("user", HEBREW, name="\u202egnp.exe"), title="he\u200bllo"))
    assert text.startswith("# he\\\\u200bllo\n")  # a backslash escaped, as punctuation is
    assert sections(text) == [f"user (\\u202egnp.exe) · {AT_TEXT}"]
    assert fenced(text) == [HEBREW + "\n"]


def test_no_character_that_shows_as_nothing_hides_in_a_name() -> None:
    """QA finding: tag characters spelled hidden words after a visible name, and other
    format characters (U+206E, U+1D173, U+FFF9) passed as they were. Emoji keep their
    joiner and presentation selector."""
    hidden = "alice\U000e0069\U000e0067"
    title = "Report\u206e\U0001d173\ufff9x\ufffb \u2764\ufe0f \U0001f469\u200d\U0001f4bb"
    text = to_markdown(export(message("user", "hi", name=hidden), title=title))
    assert sections(text) == [f"user (alice\\U000e0069\\U000e0067) · {AT_TEXT}"]
    head = text.splitlines()[0]
    for escape in ("\\u206e", "\\U0001d173", "\\ufff9", "\\ufffb"):
        assert escape in head, head
    assert "\u2764\ufe0f" in head and "\U0001f469\u200d\U0001f4bb" in head


def test_terminal_controls_are_written_as_visible_escapes() -> None:
    """Shown with `cat`, the export runs no terminal escape; line breaks and tabs stay."""
    content = "\x1b[31mred\x1b[0m \x07 a\tb\r\nc\x0b\x0c\x9b\rd"  # a lone CR is a line break
    text = to_markdown(
        export(message("user", content, name="n\x1b]0;x\x07"), title="t\x1b]0;pwn\x07")
    )
    assert not [
        ch for ch in text if (ord(ch) < 0x20 and ch not in "\n\t") or 0x7F <= ord(ch) < 0xA0
    ]
    assert fenced(text) == ["\\x1b[31mred\\x1b[0m \\x07 a\tb\nc\\x0b\\x0c\\x9b\nd\n"]
    inline = MarkdownIt("commonmark").parse(text)[1].children or []
    heading = "".join(child.content for child in inline)
    assert heading == "t\\x1b]0;pwn\\x07"
