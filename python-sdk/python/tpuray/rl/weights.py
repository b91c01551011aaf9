"""``WeightStore``: policy weights as named, versioned objects in the object store.

The trainer publishes each version (whole, or one shard per trainer member), samplers pull
a version by number. A detached named actor (threaded, so a sampler waiting for a version
does not block the trainer publishing it) holds the refs of the newest ``keep`` complete
versions of each name; dropping an older version drops the store's refs, and the objects
are freed once no sampler still holds them (reference counting, as in Ray: the store is a
borrower of refs owned by the processes that put the shards).

The actor takes 0 CPUs and holds only refs: ``versions[name][version]`` = one ref per
shard. The publisher (``publish``, whole, or ``publish_shard``, one shard per trainer
member) puts the shard into its own node's store and owns it. A version is visible to
``fetch`` once all its shards are in; ``fetch(name, v, wait=s)`` blocks on a condition
until ``v`` is complete (a sampler asking for the version the trainer is about to
publish). Weights move between nodes by the object store's pulls, never through the
store actor or the driver.
"""

from __future__ import annotations

import threading
import time
from typing import Any, Optional, Sequence

import tpuray


@tpuray.remote(num_cpus=0, max_concurrency=64)
class _WeightStoreActor:
    """``versions[name][version] = {"n": shards expected, "refs": {index: [ref]}}``."""

    def __init__(self, keep: int):
        self._keep = keep
        self._versions: dict[str, dict[int, dict]] = {}
        self._cond = threading.Condition()

    def _complete(self, name: str) -> list:
        return sorted(v for v, e in self._versions.get(name, {}).items() if len(e["refs"]) == e["n"])

    def _trim(self, name: str) -> None:
        done = self._complete(name)
        if len(done) <= self._keep:
            return
        oldest_kept = done[-self._keep]
        for v in [v for v in self._versions[name] if v < oldest_kept]:
            del self._versions[name][v]  # the refs go: the objects are freed when unused

    def publish_shard(self, name: str, version: int, index: int, num_shards: int, shard: list):
        """Records shard ``index`` of ``num_shards`` (``shard`` is ``[ref]``); returns the
        versions of ``name`` now complete."""
        with self._cond:
            if num_shards < 1 or not 0 <= index < num_shards:
                raise ValueError(f"shard index {index} is not in 0..{num_shards - 1}")
            done = self._complete(name)
            if len(done) >= self._keep and version < done[-self._keep]:
                raise ValueError(
                    f"{name!r} version {version} is older than every version kept ({done[-self._keep:]})"
                )
            entry = self._versions.setdefault(name, {}).setdefault(
                version, {"n": num_shards, "refs": {}}
            )
            if entry["n"] != num_shards:
                raise ValueError(
                    f"{name!r} version {version} was published in {entry['n']} shards, not {num_shards}"
                )
            entry["refs"][index] = shard[0]
            self._trim(name)
            self._cond.notify_all()
            return self._complete(name)

    def fetch(self, name: str, version: Optional[int], wait: float):
        """``(version, [ref per shard])``, ``("missing", kept)`` or ``None`` (nothing yet)."""
        deadline = time.monotonic() + max(0.0, wait)
        with self._cond:
            while True:
                done = self._complete(name)
                if version is None and done:
                    v = done[-1]
                    break
                if version is not None and version in done:
                    v = version
                    break
                older = version is not None and done and version < done[0]
                left = deadline - time.monotonic()
                if older or left <= 0:
                    return ("missing", done) if done else None
                self._cond.wait(left)
            refs = self._versions[name][v]["refs"]
            return v, [refs[i] for i in range(len(refs))]

    def versions(self, name: str) -> list:
        with self._cond:
            return self._complete(name)


class WeightStore:
    """Named, versioned weights in the object store: the trainer publishes, samplers pull a
    version by number.

    Every process that opens ``WeightStore(store_name)`` sees the same store (a detached
    named actor, created by the first). A version may be published whole
    (:meth:`publish`, a list of shards) or one shard at a time by several processes
    (:meth:`publish_shard`, e.g. each trainer member its slice of the state dict); it
    becomes visible to :meth:`fetch` once all its shards are in. The newest ``keep``
    complete versions of each name are kept; older ones are dropped, and their objects are
    freed once no one else holds them.

    Args:
        store_name: the actor's name (one store per name per namespace).
        keep: complete versions kept per name (>= 1).

    Raises:
        ValueError: ``keep < 1``.
    """

    def __init__(self, store_name: str = "tpuray-weights", keep: int = 2):
        if int(keep) < 1:
            raise ValueError(f"keep must be >= 1, got {keep}")
        self.store_name = store_name
        # @tpuray.remote made the class an ActorClass; mypy keeps a decorated class's own type.
        self._actor = _WeightStoreActor.options(  # type: ignore[attr-defined]
            name=store_name, get_if_exists=True, lifetime="detached"
        ).remote(int(keep))

    @staticmethod
    def _ref(value) -> "tpuray.ObjectRef":
        return value if isinstance(value, tpuray.ObjectRef) else tpuray.put(value)

    def publish(self, name: str, version: int, shards: Sequence[Any]) -> int:
        """Puts every shard (refs are kept as they are) and records them, in order, as
        ``name`` at ``version``. Returns ``version``.

        Raises:
            ValueError: no shards, or ``version`` older than every version kept.
        """
        shards = list(shards)
        if not shards:
            raise ValueError(f"publish of {name!r} version {version} got no shards")
        for i, s in enumerate(shards):
            self.publish_shard(name, version, i, len(shards), s)
        return int(version)

    def publish_shard(self, name: str, version: int, index: int, num_shards: int, shard: Any) -> list:
        """Puts ``shard`` (or keeps it, when it is a ref) as shard ``index`` of
        ``num_shards`` of ``name`` at ``version``; the process that calls this owns the
        object (it must live while the version is in use, as the owner of any Ray object).
        Returns the complete versions of ``name`` kept after this call.

        Raises:
            ValueError: an index outside ``0..num_shards-1``, a shard count that differs from
                the version's other shards, or ``version`` older than every version kept.
        """
        ref = self._ref(shard)
        # Nested in a list, the ref travels as a ref: the store borrows it.
        return tpuray.get(
            self._actor.publish_shard.remote(name, int(version), int(index), int(num_shards), [ref])
        )

    def fetch(self, name: str, version: Optional[int] = None, *, wait: float = 0.0,
              timeout: Optional[float] = None) -> tuple:
        """``(version, shards)``: ``version`` of ``name`` (default: the newest complete one),
        shards in index order.

        Args:
            wait: seconds to wait for a version not published (complete) yet, e.g. a sampler
                asking for the version the trainer is about to publish.
            timeout: seconds for ``get`` of the shards.

        Raises:
            KeyError: nothing published under ``name`` (within ``wait``), or that version is
                gone or not there (naming the versions kept).
        """
        got = tpuray.get(self._actor.fetch.remote(name, None if version is None else int(version),
                                                  float(wait)))
        if got is None:
            raise KeyError(f"no weights published under {name!r}")
        if got[0] == "missing":
            raise KeyError(f"{name!r} has no version {version} (kept: {got[1]})")
        v, refs = got
        return v, tpuray.get(list(refs), timeout=timeout)

    def versions(self, name: str) -> list:
        """The complete versions of ``name`` kept, oldest first."""
        return tpuray.get(self._actor.versions.remote(name))

    def destroy(self) -> None:
        """Kills the store's actor (every version of every name goes with it)."""
        tpuray.kill(self._actor)
