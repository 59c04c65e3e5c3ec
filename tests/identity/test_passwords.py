"""Password hashing stays off the event loop (gateway/identity/passwords.py)."""

from __future__ import annotations

import threading

import pytest

from gateway.identity import passwords


async def test_an_unknown_users_first_check_hashes_in_a_worker(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Review finding: the dummy hash an unknown user is checked against was made on the
    loop at its first use, one scrypt that stalled every request of the process."""
    passwords._dummy_hash.cache_clear()
    hashed_on: list[threading.Thread] = []
    real = passwords.hash_password_sync

    def recorded(password: str) -> str:
        hashed_on.append(threading.current_thread())
        return real(password)

    monkeypatch.setattr(passwords, "hash_password_sync", recorded)
    try:
        assert not await passwords.verify_password("a guess", None)
    finally:
        passwords._dummy_hash.cache_clear()
    assert hashed_on and threading.main_thread() not in hashed_on, hashed_on
