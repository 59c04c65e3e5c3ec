"""Text as the wire and the database can carry it."""

from __future__ import annotations


def is_utf8(text: str) -> bool:
    """Whether `text` has a UTF-8 form. A lone surrogate has none: aiohttp keeps undecodable
    header bytes as such, Python keeps the environment's and the command line's that way,
    and a JSON `\\ud800` escape decodes to one."""
    if text.isascii():
        return True
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True
