"""Errors cross the Ray boundary as values and come back as the project's own errors."""

from __future__ import annotations

import pickle

import pytest

from actors.errors import RuntimeStopping, UnknownActorKind
from actors.ray.wire import pack_error
from schemas.errors import InvalidInput, RateLimited, SvcError


def _round_trip(error: BaseException) -> BaseException:
    return pickle.loads(pickle.dumps(pack_error(error))).rebuild()


def test_svc_errors_keep_class_message_code_and_attributes() -> None:
    for error in (
        UnknownActorKind.of("nope", ["counter"]),
        RuntimeStopping(),
        RateLimited("slow down", retry_after_s=2.5, code="tpm"),
    ):
        back = _round_trip(error)
        assert type(back) is type(error)
        assert isinstance(back, SvcError) and isinstance(error, SvcError)
        assert (back.message, back.code, str(back)) == (error.message, error.code, str(error))
    limited = _round_trip(RateLimited("slow down", retry_after_s=2.5))
    assert isinstance(limited, RateLimited) and limited.retry_after_s == 2.5


def test_other_errors_keep_their_class_when_they_can() -> None:
    back = _round_trip(KeyError("k"))
    assert isinstance(back, KeyError)


def test_a_ray_client_url_is_refused_before_joining() -> None:
    """Ray Client joins, then fails every streaming generator: each streamed chat a 500."""
    from actors.ray.runtime import _probe

    for address in ("ray://ray-head:10001", "http://ray-head:6379"):
        with pytest.raises(InvalidInput, match="Ray Client"):
            _probe(address)
