"""Ray's ``ray.util.state.common`` module path: the state classes."""

from tpuray.util.state import (  # noqa: F401
    DEFAULT_LIMIT,
    DEFAULT_RPC_TIMEOUT,
    ActorState,
    JobState,
    NodeState,
    ObjectState,
    PlacementGroupState,
    StateResource,
    StateSchema,
    TaskState,
    WorkerState,
)
