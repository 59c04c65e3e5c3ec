"""The `ray` actor runtime (SVC_ACTOR_RUNTIME=ray): logical actors on N Ray actor hosts.

See docs/ray.md. Importing this package imports Ray; `actors` itself never does.
"""

from actors.ray.host import ActorHost, BehaviourFactory, BehaviourSource, HostSpec
from actors.ray.runtime import (
    ClusterInUse,
    HostUnavailable,
    RayRuntime,
    RaySettings,
    cluster_scale,
    cluster_status,
    connect_ray,
)
from actors.ray.wire import HostStatus, WrongEpoch

__all__ = [
    "ActorHost",
    "BehaviourFactory",
    "BehaviourSource",
    "ClusterInUse",
    "HostSpec",
    "HostStatus",
    "HostUnavailable",
    "RayRuntime",
    "RaySettings",
    "WrongEpoch",
    "cluster_scale",
    "cluster_status",
    "connect_ray",
]
