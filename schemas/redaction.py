"""Credentials taken out of text before it is logged or answered: the secret settings'
values however a URL encodes them, what looks like a credential by its shape (an `svc_` key,
a bearer token, a URL's password, a JSON Web Token, HTTP Basic), and the value of every
`name=value` or `name: value` pair whose name says it is a secret. The gateway applies it to
access-log URLs and client logs; the model client to a model server's error messages."""

from __future__ import annotations

import base64
import functools
import re
from collections.abc import Sequence
from urllib.parse import unquote, unquote_plus

REDACTED = "[redacted]"
# Every pattern here runs on text a client chose (a URL, a Referer, a client log), on the
# event loop: each run starts only where a run of its characters starts (a lookbehind) and is
# taken whole (possessive), so the time grows with the text's length, never with its square
# or cube (`token.` repeated through an 8 KB URL took minutes with nested runs).
_SECRET_TEXT = re.compile(
    r"(?i)(svc_[A-Za-z0-9_\-]{16,}+|bearer\s++\S++"
    r"|(?<![a-z])[a-z]++://[^\s/:@]*+:[^\s/@]++@"  # the user may be empty: redis://:pw@
    # A JSON Web Token (an OIDC access or ID token): three base64url parts, the first JSON;
    # at a token's start, also after a percent-encoded byte or an escaped line break.
    r"|(?:(?<![A-Za-z0-9_\-])|(?<=%[0-9A-Fa-f]{2})|(?<=\\[nrt]))"
    r"eyJ[A-Za-z0-9_\-]{8,}+\.[A-Za-z0-9_\-]{8,}+\.[A-Za-z0-9_\-]*+)"
)
# name=value or name: value with a secret's name (a cookie header a page logged,
# `svc_session=...`; a query string's `access_token=...`; a header, `X-Api-Key: ...`; JSON or
# a repr, `"password": "..."`): the value goes, quoted or not, the name stays to say what was
# there. Every name is looked at, inside other pairs' values too (`?next=/cb?access_token=`),
# percent-encoded ones as well (`?next=%2Fcb%3Faccess_token%3D...`, the name then read with
# the encoded byte before it, `3Faccess_token`, which still says what it is).
# A name may close a bracket and be followed by indexes (`user[password]=`, `password[]=`,
# `password[0]=`, encoded as `qs` and Rails write them) or an escaped quote (JSON logged as
# a string: `{\"token\":\"...\"}`).
_NAME_EQ = re.compile(
    r"(?i)(?<![a-z0-9_.\-])([a-z0-9_.\-]++)(?:\]|%5d)?+"
    r"(?:\[[0-9]{0,9}+\]|%5b[0-9]{0,9}+%5d)*+\\?+[\"']?+\s*+"
    r"(?:[=:]|%3[ad])(?:\s|%20)*+"
)
# A value as written after its name: quoted, or a run of characters, after the scheme word
# of an Authorization-style value (`X-Auth-Token: Bearer abc`: the token, not the word).
# An unquoted value ends where the next pair begins; after an encoded `=`, an encoded `&`
# (`%26`) begins one too, while in a value written plainly it is the value's own byte.
# JSON logged as a string writes a value's quotes as `\"`, and a quote inside the value as
# `\\\"` (its escaping backslash escaped too): that is a character of the value, not its end.
# A quote never closed (a message cut short) goes on to the end of the text.
_ESCAPED_QUOTED = r"\\\"(?:[^\"\\]|\\[^\"\\]|\\\\(?:\\.|[^\"\\]))*+(?:\\\")?+"
_QUOTED = r"\"(?:[^\"\\]|\\.)*+\"?+|'(?:[^'\\]|\\.)*+'?+|" + _ESCAPED_QUOTED
_SCHEME = r"((?i:(?:bearer|basic|token)(?:\s|%20)++)?+)"
_VALUE = re.compile(_QUOTED + "|" + _SCHEME + r"[^\s;&,\"']++")
_ENCODED_VALUE = re.compile(_QUOTED + "|" + _SCHEME + r"(?:[^\s;&,\"'%]|%(?!26))++")
# A cookie header's value is every cookie to the end of its line: any of them may be a
# session's, whatever its name.
_COOKIE_LINE = re.compile(r"[^\r\n]++")
_COOKIE_HEADER = re.compile(r"(?i)(?:set-)?cookie")
# The names a pair's value is a secret under. Short ones (`pass`, `pwd`, `auth`) only as
# the whole name: inside a longer one they are other words (`passenger`, `author`).
_SECRET_PAIR_NAME = re.compile(
    r"(?i)session|csrf|token|secret|passw(?:or)?d|passphrase|api[_\-]?key|private[_\-]?key"
    r"|authorization|credential|cookie|(?<![a-z])(?:pass|pwd|auth)$"
)
_BASIC = re.compile(r"(?i)\bbasic\s+([A-Za-z0-9+/]{4,}={0,2})(?![A-Za-z0-9+/=])")


def redact(text: str, secrets: Sequence[str]) -> str:
    """`text` without `secrets` (the secret settings' values, as they are or however a URL
    encodes them) and without what looks like a credential."""
    text = _without_secret_values(text, secrets)
    text = _without_secret_pairs(text)
    return _BASIC.sub(_basic_credentials, _SECRET_TEXT.sub(REDACTED, text))


def _without_secret_values(text: str, secrets: Sequence[str]) -> str:
    """`text` with every one of `secrets` in it redacted, however it is percent-encoded.
    The decoded text is searched first (a substring test a secret): text that holds none,
    nearly all, costs no more, and no pattern is built for a secret never met."""
    if not secrets:
        return text
    decoded = {unquote(text), unquote_plus(text)}
    found = tuple(v for v in secrets if any(v in plain for plain in decoded))
    return _in_a_url(found).sub(REDACTED, text) if found else text


@functools.lru_cache(maxsize=16)
def _in_a_url(secrets: tuple[str, ...]) -> re.Pattern[str]:
    """The secrets however a URL may carry them: each character as it is or percent-encoded
    (either case of hex; a space also as `+`), as clients encode some characters and not
    others. Longest first (as given): a secret that holds another goes whole."""
    return re.compile("|".join(_spelled_in_urls(v) for v in secrets))


def _spelled_in_urls(secret: str) -> str:
    def one(char: str) -> str:
        escaped = "".join(f"%{byte:02X}" for byte in char.encode())
        forms = [re.escape(char), "(?i:" + re.escape(escaped) + ")"]
        if char == " ":
            forms.append(r"\+")
        return "(?:" + "|".join(forms) + ")"

    return "".join(one(char) for char in secret)


def _without_secret_pairs(text: str) -> str:
    kept: list[str] = []
    done = 0
    for name in _NAME_EQ.finditer(text):  # each search goes on right after the `=`
        said = name.group(1)
        encoded = text[name.start() - 1 : name.start()] == "%"
        if encoded:
            said = said[2:]  # `%3Fpwd`: the name after the encoded byte, `pwd`
        if name.start() < done or not _SECRET_PAIR_NAME.search(said):
            continue
        quoted = text[name.end() : name.end() + 1] in ("'", '"')
        if _COOKIE_HEADER.fullmatch(said) and ":" in name.group(0) and not quoted:
            value = _COOKIE_LINE.match(text, name.end())
        elif encoded or "%" in name.group(0):
            value = _ENCODED_VALUE.match(text, name.end())
        else:
            value = _VALUE.match(text, name.end())
        if value is not None:
            quote = _quote_of(value.group(0))
            scheme = (value.group(1) if value.re.groups else None) or ""
            kept += [text[done : name.end()], f"{quote}{scheme}{REDACTED}{quote}"]
            done = value.end()
    kept.append(text[done:])
    return "".join(kept)


def _quote_of(value: str) -> str:
    """The quote a value was written in (an escaped one, `\\"`, inside JSON logged as a
    string), to write the redacted value in; empty for a bare one."""
    if value.startswith('\\"'):
        return '\\"'
    return value[0] if value[0] in "\"'" else ""


def _basic_credentials(match: re.Match[str]) -> str:
    """HTTP Basic credentials (base64 of `user:password`), not the word "basic" before
    some other word: only a token that decodes to text with a colon is redacted."""
    token = match.group(1)
    try:  # padding is often left out (or cut off): restored before decoding
        decoded = base64.b64decode(token + "=" * (-len(token) % 4), validate=True).decode()
    except (ValueError, UnicodeDecodeError):
        return match.group(0)
    return REDACTED if ":" in decoded else match.group(0)
