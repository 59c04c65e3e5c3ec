"""The deployment's cursor keys, kept with the instance's other secrets (`identity_secrets`):
never in the log, never in a response.

`seal_key` seals every cursor; `seal_key_previous`, the key before the last rotation, still
opens the cursors it sealed (gateway/cursor_seal.py). Each process reads both when it starts,
so a rotation takes effect as the processes restart; until every one has, some seal under
the old key, which every process still opens, and one not yet restarted reads the keys again
when a cursor opens under none of its own.
"""

from __future__ import annotations

import secrets

from eventstore.db import Database
from gateway.cursor_seal import KEY_BYTES, CursorSeal, Keys
from gateway.identity.vault import INSTANCE, IdentityVault

_SUBJECT = "cursors"
_CURRENT = "seal_key"
_PREVIOUS = "seal_key_previous"


def _new_key() -> str:
    return secrets.token_hex(KEY_BYTES)


async def load_cursor_seal(db: Database) -> CursorSeal:
    """The deployment's cursor seal. Its key is made once, by whichever process first asks;
    the seal reads the keys again when a cursor opens under none (a rotation since)."""

    async def keys() -> Keys:
        vault = IdentityVault(db)
        current = await vault.get_or_create(INSTANCE, _SUBJECT, _CURRENT, _new_key())
        previous = await vault.get(INSTANCE, _SUBJECT, _PREVIOUS)
        return bytes.fromhex(current), bytes.fromhex(previous) if previous else None

    current, previous = await keys()
    return CursorSeal(current, previous, reload=keys)


async def rotate_cursor_key(db: Database) -> None:
    """A new key seals from each process's next start; the current one becomes the previous,
    whose cursors still open, and the one before it is dropped: its cursors are refused."""
    await IdentityVault(db).rotate(INSTANCE, _SUBJECT, _CURRENT, _PREVIOUS, _new_key)
