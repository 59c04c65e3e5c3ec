"""`cut_page`: where a page of `(key, bytes)` rows ends, by count and by bytes."""

from __future__ import annotations

from eventstore.paging import cut_page

ROWS = [(1, 10), (2, 10), (3, 10)]


def test_a_page_ends_at_its_count() -> None:
    assert cut_page(ROWS, 3, 1000) == (3, False)  # exactly `limit` rows: nothing left over
    assert cut_page(ROWS, 2, 1000) == (2, True)  # `limit` + 1 rows: one left over
    assert cut_page(ROWS[:2], 3, 1000) == (2, False)


def test_a_page_ends_at_its_bytes() -> None:
    assert cut_page(ROWS, 10, 30) == (3, False)  # exactly `max_bytes`: all taken
    assert cut_page(ROWS, 10, 29) == (2, True)
    assert cut_page(ROWS, 10, 20) == (2, True)


def test_the_first_row_is_always_taken_and_no_rows_make_no_page() -> None:
    assert cut_page([(7, 5_000)], 10, 1) == (7, False)
    assert cut_page([(7, 5_000), (8, 1)], 10, 1) == (7, True)
    assert cut_page([], 10, 100) == (None, False)
