"""``free``: Ray's ``ray._private.internal_api.free`` of earlier releases (Ray 2.60 keeps the
call only inside its core worker, ``free_objects``), the one way to get ``ObjectFreedError``."""

from __future__ import annotations

from tpuray._private import worker
from tpuray._private.serialization import ObjectRef


def free(object_refs, local_only: bool = False) -> None:
    """Frees objects now, whatever refs to them remain (Ray's
    ``ray._private.internal_api.free``): their copies leave every node's store, and a
    later ``get`` raises ``ObjectFreedError``.

    Args:
        object_refs: An ``ObjectRef`` or a list of them, owned by this process.
        local_only: Ray's switch to free only this node's copies; not supported.

    Raises:
        TypeError: not ``ObjectRef``s (Ray's check).
        ValueError: ``local_only=True``, or a ref that another process owns (only its
            owner frees an object in tpuray).
    """
    from tpuray import _tpuray

    if isinstance(object_refs, ObjectRef):
        object_refs = [object_refs]
    if not isinstance(object_refs, list):
        raise TypeError(
            f"free() expects a list of ObjectRef, got {type(object_refs)}"
        )
    for ref in object_refs:
        if not isinstance(ref, ObjectRef):
            raise TypeError(
                f"free() expects a list of ObjectRef, got list containing {type(ref)}"
            )
    if local_only:
        raise ValueError(
            "free(local_only=True) is not supported by tpuray: an object is freed on every node"
        )
    worker.check_connected()
    if object_refs:
        _tpuray.free([r._core for r in object_refs])
