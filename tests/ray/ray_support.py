"""Helpers of the Ray runtime tests (settings for a throw-away cluster, behaviour factories)."""

from __future__ import annotations

import uuid
from collections.abc import Sequence
from functools import partial
from typing import Any

from actors import Behaviour
from actors.ray import RaySettings

HOST_CPUS = 0.2
"""Each host's CPU reservation here: many hosts fit the two cores of a test machine."""


def ray_settings(address: str, **overrides: Any) -> RaySettings:
    values: dict[str, Any] = {
        "address": address,
        "cluster": f"t{uuid.uuid4().hex[:10]}",
        "hosts": 1,
        "host_num_cpus": HOST_CPUS,
        "stop_hosts": True,
        "retry_deadline_s": 30.0,
        "dead_after_s": 3.0,
        "supervise_every_s": 0.5,
        "store_pool_size": 4,
    }
    values.update(overrides)
    return RaySettings(**values)


def fixed_behaviours(behaviours: Sequence[Behaviour[Any]]) -> partial[list[Behaviour[Any]]]:
    """A picklable factory: each host unpickles its own copy of these behaviours."""
    return partial(list, tuple(behaviours))
