"""Sealed cursors (gateway/cursor_seal.py): what a client holds names a point of the log
without telling where it is, opens back to exactly that point, and nothing else opens."""

from __future__ import annotations

import asyncio
import base64
import itertools
import string

import pytest
from platform_support import running, settings_for

from eventstore.cursor import LogPoint, decode_cursor, encode_cursor
from eventstore.db import Database
from eventstore.errors import InvalidCursor, StoreUnavailable
from eventstore.migrate import apply_migrations
from gateway.bootstrap import MIGRATIONS
from gateway.cursor_keys import load_cursor_seal, rotate_cursor_key
from gateway.cursor_seal import MAX_NUMBER, CursorSeal, open_audit_issued
from gateway.state import CURSORS, DATABASE, STORE

KEY = bytes(range(16))
OTHER_KEY = bytes(range(16, 32))
POINTS = [
    LogPoint(1, 1),
    LogPoint(742, 9_001),
    LogPoint(2**40 + 3, 2**33 + 5),
    LogPoint(MAX_NUMBER, MAX_NUMBER),
    LogPoint(0, 7),
]


def test_a_sealed_cursor_opens_to_the_point_it_was_made_from() -> None:
    seal = CursorSeal(KEY)
    for point in POINTS:
        public = seal.seal_point(point)
        assert public.startswith("c2") and len(public) == 24, public
        assert decode_cursor(seal.open(public)) == point
        assert seal.seal(encode_cursor(point)) == public  # the same from the internal form
        assert CursorSeal(KEY).seal_point(point) == public  # deterministic: any process


def test_no_cursor_stays_none_and_the_origin_as_a_point_is_sealed() -> None:
    """The empty cursor (none given) stays empty both ways. The origin spelled as a point
    (an empty workspace's head) is sealed, since a feed frame that names it must carry an
    id, and opens to the start of the log."""
    seal = CursorSeal(KEY)
    assert seal.seal("") == "" and seal.open("") == ""
    origin = seal.seal_point(LogPoint(0, 0))
    assert origin.startswith("c2") and seal.seal(encode_cursor(LogPoint(0, 0))) == origin
    assert seal.open(origin) == ""


def test_neighbouring_points_look_unrelated() -> None:
    """Positions one apart differ in most characters: nothing of the order or the distance
    between two cursors shows (the plain form shares all but the last few)."""
    seal = CursorSeal(KEY)
    tokens = [seal.seal_point(LogPoint(1_000, position)) for position in range(1_000, 1_050)]
    for a, b in itertools.pairwise(tokens):
        assert sum(x != y for x, y in zip(a[2:], b[2:], strict=True)) >= 12, (a, b)
    plain = [encode_cursor(LogPoint(1_000, position)) for position in (1_000, 1_001)]
    assert sum(x != y for x, y in zip(*plain, strict=True)) <= 2
    assert sorted(tokens) != tokens


def test_a_cursor_edited_in_any_one_character_is_refused() -> None:
    seal = CursorSeal(KEY)
    public = seal.seal_point(LogPoint(31_337, 4_242))
    alphabet = string.ascii_letters + string.digits + "-_"
    tried = 0
    for index in range(2, len(public)):
        for char in alphabet:
            edited = public[:index] + char + public[index + 1 :]
            if edited == public:
                continue
            tried += 1
            with pytest.raises(InvalidCursor, match="malformed cursor"):
                seal.open(edited)
    assert tried == 22 * 63


def test_only_the_one_spelling_issued_opens() -> None:
    """Base64 decoders take `+` and `/`, padding, and a last character whose spare bits
    differ: each would open to the same point, so each is refused."""
    seal = CursorSeal(KEY)
    # A cursor whose body has a `-` or `_`, so that the standard alphabet spells it otherwise.
    public = next(
        token
        for token in (seal.seal_point(LogPoint(5, n)) for n in range(1, 100))
        if "-" in token[2:] or "_" in token[2:]
    )
    raw = base64.urlsafe_b64decode(public[2:] + "==")
    standard = "c2" + base64.b64encode(raw).decode().rstrip("=")
    spare_bits = public[:-1] + alphabet_neighbour(public[-1])
    variants = [public + "==", standard, spare_bits, public + "A", public[:-1]]
    assert public not in variants and base64.urlsafe_b64decode(spare_bits[2:] + "==") == raw
    for variant in variants:
        with pytest.raises(InvalidCursor):
            seal.open(variant)


def alphabet_neighbour(last: str) -> str:
    """A character that decodes to the same bytes as `last`: the last of the 22 base64
    characters of 16 bytes carries 2 bits of them and 4 spare ones."""
    alphabet = string.ascii_uppercase + string.ascii_lowercase + string.digits + "-_"
    index = alphabet.index(last)
    return alphabet[index ^ 1]


def test_a_cursor_of_another_deployment_is_refused() -> None:
    ours, theirs = CursorSeal(KEY), CursorSeal(OTHER_KEY)
    for point in POINTS:
        with pytest.raises(InvalidCursor, match="malformed cursor"):
            ours.open(theirs.seal_point(point))


def test_the_key_before_a_rotation_still_opens_its_cursors() -> None:
    before, rotated = CursorSeal(KEY), CursorSeal(OTHER_KEY, previous=KEY)
    for point in POINTS:
        held = before.seal_point(point)  # a cursor a client holds across the rotation
        assert decode_cursor(rotated.open(held)) == point
        assert rotated.seal_point(point) == CursorSeal(OTHER_KEY).seal_point(point) != held
    audit = before.seal_audit(4_242)
    assert rotated.open_audit(audit) == 4_242
    with pytest.raises(InvalidCursor):  # a key two rotations back: refused
        CursorSeal(bytes(16), previous=OTHER_KEY).open(before.seal_point(POINTS[0]))


def test_a_cursor_that_opens_under_both_keys_is_tried_as_both() -> None:
    """1 in 65,536 cursors of the previous key also pass the tag check under the current
    one, always the same ones: each opening is a candidate, so the log's check of what it
    issued can take the right one, where the first match alone refused them for good."""
    before, rotated = CursorSeal(KEY), CursorSeal(OTHER_KEY, previous=KEY)
    for position in itertools.count():  # about 65,536 points until one, a fixed search
        held = before.seal_point(LogPoint(1, position))
        openings = rotated.openings(held)
        if len(openings) == 2:
            break
    assert openings[1] == encode_cursor(LogPoint(1, position)) != openings[0]


def test_the_plain_form_of_earlier_builds_is_refused_with_what_to_do() -> None:
    """Accepting it would let anyone probe positions at will (a cursor ahead of the log is
    refused, one behind it is not), which is the leak sealing closes."""
    seal = CursorSeal(KEY)
    with pytest.raises(InvalidCursor, match=r"no longer takes.*omit it.*start=latest"):
        seal.open(encode_cursor(LogPoint(10, 20)))


def test_audit_and_log_cursors_do_not_stand_for_each_other() -> None:
    seal = CursorSeal(KEY)
    audit = seal.seal_audit(4_242)
    assert audit.startswith("a2") and seal.open_audit(audit) == 4_242
    log_cursor = seal.seal_point(LogPoint(0, 4_242))
    with pytest.raises(InvalidCursor):
        seal.open_audit(log_cursor)
    # Each body under the other's prefix: refused by the tag inside (the keys are fixed, so
    # this is not left to the 1 in 65,536 a random key would give).
    with pytest.raises(InvalidCursor):
        seal.open_audit("a2" + log_cursor[2:])
    with pytest.raises(InvalidCursor):
        seal.open("c2" + audit[2:])


def test_garbage_is_a_malformed_cursor() -> None:
    seal = CursorSeal(KEY)
    for garbage in ("garbage", "c2" + "!" * 22, "c2" + "A" * 21 + "\u00e9", "c2", "x" * 500):
        with pytest.raises(InvalidCursor, match="malformed cursor"):
            seal.open(garbage)


def test_a_key_is_sixteen_bytes() -> None:
    with pytest.raises(ValueError):
        CursorSeal(b"short")


async def test_every_process_loads_the_same_key_and_the_first_makes_it(
    store_db: Database,
) -> None:
    await apply_migrations(store_db, list(MIGRATIONS))
    async with store_db.acquire() as conn:
        assert await conn.fetchval("SELECT count(*) FROM identity_secrets") == 0
    seals = await asyncio.gather(*(load_cursor_seal(store_db) for _ in range(8)))
    point = LogPoint(77, 88)
    assert len({seal.seal_point(point) for seal in seals}) == 1
    again = await load_cursor_seal(store_db)
    assert decode_cursor(again.open(seals[0].seal_point(point))) == point
    async with store_db.acquire() as conn:
        readable = await conn.fetchval(
            "SELECT has_table_privilege('svc_reader', 'identity_secrets', 'SELECT')"
        )
    assert readable is False  # the tenant-scoped role never sees the key


async def test_a_rotation_seals_anew_and_keeps_the_key_before_it(store_db: Database) -> None:
    await apply_migrations(store_db, list(MIGRATIONS))
    point = LogPoint(77, 88)
    first = await load_cursor_seal(store_db)
    held = first.seal_point(point)
    await asyncio.gather(rotate_cursor_key(store_db), rotate_cursor_key(store_db))
    # Two at once are two in a row: the key before them is now two back, its cursors refused.
    twice = await load_cursor_seal(store_db)
    with pytest.raises(InvalidCursor):
        twice.open(held)
    held = twice.seal_point(point)
    await rotate_cursor_key(store_db)
    once = await load_cursor_seal(store_db)
    assert decode_cursor(once.open(held)) == point  # one rotation back: still opens
    assert once.seal_point(point) != held


async def test_a_gateway_not_restarted_after_a_rotation_opens_the_new_key_s_cursors(
    database_url: str,
) -> None:
    """A client moves from a gateway restarted after a rotation (sealing under the new key)
    to one not yet restarted: that one reads the keys again rather than refuse the cursor.
    The cursor it held from before the rotation opens on both."""
    async with running(settings_for(database_url)) as svc:
        key, _ = await svc.issue_key("ws-rotation", ("admin:read",))
        head = await svc.app[STORE].head()
        held = svc.app[CURSORS].seal(head)
        await rotate_cursor_key(svc.app[DATABASE])
        restarted = await load_cursor_seal(svc.app[DATABASE])  # as the next start loads it
        sealed_anew = restarted.seal(head)
        assert held and sealed_anew != held
        for cursor in (sealed_anew, held):
            status, body, _ = await svc.request(
                "GET", "/v1/admin/conversations", key, params={"min_cursor": cursor}
            )
            assert status == 200, (cursor, body)
        # This gateway now seals under the new key too.
        assert svc.app[CURSORS].seal(head) == sealed_anew


async def test_keys_that_cannot_be_read_again_leave_the_cursor_refused_not_a_503() -> None:
    """A cursor no key opens makes the seal read the keys again; with the database away,
    the cursor is refused as it would have been (a 400 the client can act on)."""
    reads = 0

    async def away() -> tuple[bytes, bytes | None]:
        nonlocal reads
        reads += 1
        raise StoreUnavailable("the database is away")

    seal = CursorSeal(KEY, reload=away)
    assert await seal.reloaded() is False
    assert await seal.reloaded() is False  # and not read again within RELOAD_EVERY_S
    assert reads == 1


async def test_callers_meeting_a_new_key_together_share_one_read_of_the_keys() -> None:
    """Review finding: the first caller's read of the keys marked the reload done before it
    had the keys, so others arriving meanwhile (tabs reconnecting after a rotation) were
    refused their cursors with a 400, after which a browser's EventSource gives up."""
    reads = 0

    async def rotated() -> tuple[bytes, bytes | None]:
        nonlocal reads
        reads += 1
        await asyncio.sleep(0.1)
        return OTHER_KEY, KEY

    seal = CursorSeal(KEY, reload=rotated)
    assert await asyncio.gather(*(seal.reloaded() for _ in range(3))) == [True] * 3
    assert reads == 1 and seal.keys == (OTHER_KEY, KEY)


async def test_an_audit_cursor_of_a_key_not_read_yet_opens_after_a_reload() -> None:
    """Review finding: audit page cursors never read the keys again, so paging across two
    gateways, one restarted after a rotation, was refused at the next page."""
    restarted = CursorSeal(OTHER_KEY, previous=KEY)
    cursor = restarted.seal_audit(4_242)

    async def rotated() -> tuple[bytes, bytes | None]:
        return OTHER_KEY, KEY

    not_restarted = CursorSeal(KEY, reload=rotated)
    with pytest.raises(InvalidCursor):
        not_restarted.open_audit(cursor)
    assert await open_audit_issued(not_restarted, cursor) == 4_242
    with pytest.raises(InvalidCursor):  # a cursor no key opens is still refused
        await open_audit_issued(not_restarted, "a2" + "A" * (len(cursor) - 2))
