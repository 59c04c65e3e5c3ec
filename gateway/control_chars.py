"""Control characters of someone else's text, written as visible escapes where the text is
shown: a line break must not start a line of its own in the service log or in a listing of the
CLI (a forged entry), and an ESC sequence must not run in the terminal that shows an export.
"""

from __future__ import annotations

import re

from schemas.admin import DIRECTION_CONTROLS, INVISIBLE

_C0_C1 = [*range(0x20), 0x7F, *range(0x80, 0xA0)]

_IN_A_BLOCK = {code: f"\\x{code:02x}" for code in _C0_C1 if chr(code) not in "\n\t"}
_ON_ONE_LINE = (
    _IN_A_BLOCK
    | {code: f"\\u{code:04x}" for code in (0x2028, 0x2029)}
    # Marks and overrides of the text's direction and characters that show as nothing: a
    # key name stored before they were refused, a conversation's title, a message's name.
    | {ord(c): f"\\u{ord(c):04x}" for c in DIRECTION_CONTROLS | INVISIBLE}
    | {ord("\n"): "\\n", ord("\t"): "\\t", ord("\r"): "\\r"}
)


# What else shows as nothing on one line: Unicode's format characters (but the joiners, which
# emoji and several scripts need), the combining grapheme joiner, the Mongolian and the text
# variation selectors (not U+FE0F, an emoji's), blank braille, and the tag characters that
# can spell hidden words after a visible one.
_SHOWS_AS_NOTHING = re.compile(
    "[\u0600-\u0605\u06dd\u070f\u0890\u0891\u08e2\u034f\u180b-\u180f\u2065"
    "\u206a-\u206f\u2800\ufe00-\ufe0e\ufff9-\ufffb\U000110bd\U000110cd"
    "\U00013430-\U0001343f\U0001bca0-\U0001bca3\U0001d173-\U0001d17a"
    "\U000e0000-\U000e0fff]"
)


def _escape(found: re.Match[str]) -> str:
    code = ord(found.group())
    return f"\\u{code:04x}" if code <= 0xFFFF else f"\\U{code:08x}"


def one_line(text: str) -> str:
    """`text` on one line: every control character (line breaks and tabs too), the Unicode
    line and paragraph separators, and the characters that show as nothing, as escapes
    (`\\n`, `\\x1b`, `\\u2028`, `\\u200b`, `\\U000e0069`)."""
    shown = text.translate(_ON_ONE_LINE)
    if _SHOWS_AS_NOTHING.search(shown) is None:  # the usual text: one scan, no copy
        return shown
    return _SHOWS_AS_NOTHING.sub(_escape, shown)


def visible_controls(text: str) -> str:
    """`text` as lines: line breaks (CRLF and a lone CR, as old Mac text ends its lines,
    made LF) and tabs stay; every other control character becomes an escape (`\\x1b`)."""
    return text.replace("\r\n", "\n").replace("\r", "\n").translate(_IN_A_BLOCK)


# In JSON text a C0 character is already escaped by the encoder; C1 characters and the
# Unicode separators are not, and they can only occur inside strings there.
_IN_JSON = {code: f"\\u{code:04x}" for code in (*range(0x7F, 0xA0), 0x2028, 0x2029)}


def json_visible(json_text: str) -> str:
    """JSON text (from `json.dumps(..., ensure_ascii=False)`) with the control characters
    the encoder leaves as they are written as `\\u` escapes: still the same JSON, and a
    terminal that shows it runs no escape sequence."""
    return json_text.translate(_IN_JSON)
