"""Pages cut by their bytes before anything large is read.

A reader of long streams of large rows (a conversation's messages or events, each up to a
megabyte of text) first reads each row's key and size, which the database knows without
loading the value, picks the range a page may hold, and only then reads that range."""

from __future__ import annotations

from collections.abc import Sequence


def cut_page(
    sizes: Sequence[tuple[int, int]], limit: int, max_bytes: int
) -> tuple[int | None, bool]:
    """Of `(key, bytes)` rows in key order: the last key of the page they make, at most
    `limit` rows and `max_bytes`, the first row always taken (a page always moves on); and
    whether rows are left over. `(None, False)` for no rows."""
    last: int | None = None
    total = 0
    for taken, (key, size) in enumerate(sizes):
        if taken == limit or (last is not None and total + size > max_bytes):
            return last, True
        total += size
        last = key
    return last, False
