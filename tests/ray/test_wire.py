"""Errors cross the Ray boundary as values and come back as the project's own errors."""

from __future__ import annotations

import logging
import pickle
import traceback

import pytest

from actors.errors import RuntimeStopping, TurnCrashed, UnknownActorKind
from actors.ray.runtime import HostUnavailable, _ray_failures_said_plainly
from actors.ray.wire import pack_error
from schemas.errors import Conflict, InvalidInput, RateLimited, SvcError


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


def test_a_failure_ray_raises_is_told_in_one_line() -> None:
    """`svc cluster` printed the str() of Ray's errors, which is a whole remote traceback."""
    from ray.exceptions import RayActorError, RayTaskError

    try:
        raise ValueError("the shard map\nis gone")
    except ValueError as exc:
        task_error = RayTaskError("Host.status", traceback.format_exc(), exc)
    actor_error = RayActorError(
        error_msg='The actor died in its creation task.\n  File "host.py", line 3, in ready\n'
        "StoreError: relation actor_shards does not exist"
    )
    try:
        raise task_error
    except RayTaskError:
        nested = RayTaskError("Router.call", traceback.format_exc(), task_error)
    told = {
        "task": (task_error, "ValueError: the shard map is gone"),
        "a nested call's": (nested, "ValueError: the shard map is gone"),
        "task as its cause's class": (task_error.as_instanceof_cause(), "ValueError: the"),
        "actor": (actor_error, "StoreError: relation actor_shards does not exist"),
    }
    for case, (error, expected) in told.items():
        with pytest.raises(HostUnavailable) as said:
            with _ray_failures_said_plainly("svc cluster status"):
                raise error
        message = said.value.message
        assert "\n" not in message and "\x1b" not in message, (case, message)
        assert "File " not in message, (case, message)
        assert message.startswith("the Ray cluster failed `svc cluster status`: "), case
        assert expected in message, (case, message)


def test_a_ray_client_url_is_refused_before_joining() -> None:
    """Ray Client joins, then fails every streaming generator: each streamed chat a 500."""
    from actors.ray.runtime import _probe

    for address in ("ray://ray-head:10001", "http://ray-head:6379"):
        with pytest.raises(InvalidInput, match="Ray Client"):
            _probe(address)


def test_a_fault_of_the_code_is_logged_with_its_traceback_where_it_happened(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Review finding: a behaviour's bug raised on a host crossed the wire as its type and
    message only, and no log anywhere named the file or line that failed."""

    def behaviour_with_a_bug() -> None:
        raise AttributeError("'NoneType' object has no attribute 'x'")

    caplog.set_level(logging.ERROR, logger="actors.ray.wire")
    try:
        behaviour_with_a_bug()
    except AttributeError as exc:
        failure = pack_error(exc)
    assert isinstance(failure.rebuild(), AttributeError)
    (logged,) = caplog.records
    assert logged.exc_info is not None and "behaviour_with_a_bug" in caplog.text
    caplog.clear()
    pack_error(Conflict("the name is taken"))  # the project's own errors are answers
    assert not caplog.records
    try:  # a turn that crashed on a fault: the project's error, internal, the fault its cause
        try:
            behaviour_with_a_bug()
        except AttributeError as exc:
            raise TurnCrashed.of(exc, "") from exc
    except TurnCrashed as crashed:
        pack_error(crashed)
    assert "behaviour_with_a_bug" in caplog.text
