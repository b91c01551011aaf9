"""``Dataset``: a lazy, streaming pipeline of blocks (Ray Data's ``Dataset``).

Transformations (``map``, ``map_batches``, ``filter``, ``flat_map``, ``random_shuffle``,
``repartition``, ...) only record an operator; consuming (``iter_batches``, ``take``,
``count``, ``streaming_split``, ...) runs the pipeline with the streaming executor
(``tpuray.data._executor``): consecutive task operators are fused into one task per block,
a callable class in ``map_batches`` runs on an autoscaling actor pool, and backpressure
bounds the bytes the pipeline holds in the object store.
"""

from __future__ import annotations

import inspect
from typing import Any, Callable, Iterator, Optional

import tpuray
from tpuray.data import block as B
from tpuray.data._executor import BlockMeta, PhysicalOp, StreamingExecutor
from tpuray.data.context import DataContext

#: Rows per batch when ``batch_size="default"`` (Ray Data's default for map_batches).
DEFAULT_BATCH_SIZE = 1024

_REMOTE_KEYS = ("num_cpus", "num_gpus", "resources", "memory", "accelerator_type",
                "scheduling_strategy", "label_selector", "runtime_env", "max_retries")


def _compose(first: Optional[Callable], second: Callable) -> Callable:
    if first is None:
        return second

    def both(*blocks):
        return second(first(*blocks))

    return both


def _batched(fn: Callable, batch_size, batch_format: str, fn_args, fn_kwargs) -> Callable:
    """A block transform applying ``fn`` to batches of ``batch_size`` rows."""

    def transform(block):
        n = B.num_rows(block)
        size = n if batch_size is None else max(1, int(batch_size))
        outs = []
        for start in range(0, max(n, 1), size):
            part = B.slice_block(block, start, min(n, start + size)) if n else block
            if n == 0:
                break
            outs.append(B.from_batch(fn(B.to_format(part, batch_format), *fn_args, **fn_kwargs)))
        return B.concat(outs)

    return transform


class _Logical:
    """One recorded operator."""

    def __init__(self, kind: str, name: str, **kw):
        self.kind = kind
        self.name = name
        self.kw = kw


class Dataset:
    """A lazy dataset: a source and the operators applied to it. Cheap to copy; every
    consuming call runs the pipeline anew."""

    def __init__(self, source: PhysicalOp, ops: Optional[list] = None):
        self._source = source
        self._ops: list[_Logical] = list(ops or [])

    def _with(self, op: _Logical) -> "Dataset":
        return Dataset(self._source, self._ops + [op])

    # ---- transformations ----

    def map(self, fn: Callable[[dict], dict], **ray_remote_args) -> "Dataset":
        """Applies ``fn`` to every row (a dict); it returns the new row (a dict)."""

        def transform(block):
            return B.from_rows(fn(r) for r in B.rows(block))

        return self._with(_Logical("task", f"Map({_name(fn)})", fn=transform, args=ray_remote_args))

    def filter(self, fn: Callable[[dict], bool], **ray_remote_args) -> "Dataset":
        """Keeps the rows for which ``fn(row)`` is true."""

        def transform(block):
            import numpy as np

            keep = np.array([bool(fn(r)) for r in B.rows(block)], dtype=bool)
            return B.take_indices(block, np.nonzero(keep)[0]) if len(keep) else block

        return self._with(_Logical("task", f"Filter({_name(fn)})", fn=transform, args=ray_remote_args))

    def flat_map(self, fn: Callable[[dict], list], **ray_remote_args) -> "Dataset":
        """Replaces every row with the rows (dicts) ``fn(row)`` returns."""

        def transform(block):
            return B.from_rows(out for r in B.rows(block) for out in fn(r))

        return self._with(_Logical("task", f"FlatMap({_name(fn)})", fn=transform, args=ray_remote_args))

    def map_batches(
        self,
        fn,
        *,
        batch_size="default",
        batch_format: str = "numpy",
        fn_args=(),
        fn_kwargs=None,
        fn_constructor_args=(),
        fn_constructor_kwargs=None,
        concurrency=None,
        **ray_remote_args,
    ) -> "Dataset":
        """Applies ``fn`` to batches of ``batch_size`` rows (``"default"``: 1024, ``None``:
        whole blocks) given in ``batch_format`` (``"numpy"``: dict of arrays, ``"pandas"``,
        ``"torch"``); ``fn`` returns a dict of arrays (or a DataFrame or rows).

        A function runs as stateless tasks. A callable class runs on a pool of actors, each
        constructing it once with ``fn_constructor_args/kwargs``; ``concurrency`` is the
        pool size, an ``int`` or ``(min, max)`` to autoscale between (default ``(1,
        cluster CPUs)``). ``num_cpus``, ``num_gpus``, ``resources`` (e.g. ``{"TPU": 4}``)
        and other remote options apply per task or per actor. A pool never grows so far
        that the tasks feeding it have no CPU left.

        Raises:
            ValueError: ``concurrency`` given for a plain function, or a bad batch size.
        """
        if batch_size == "default":
            batch_size = DEFAULT_BATCH_SIZE
        if batch_size is not None and (not isinstance(batch_size, int) or batch_size < 1):
            raise ValueError(f"batch_size must be a positive int, None or 'default', got {batch_size!r}")
        fn_kwargs = dict(fn_kwargs or {})
        for k in ray_remote_args:
            if k not in _REMOTE_KEYS:
                raise ValueError(f"map_batches got an unknown option {k!r} (remote options: {', '.join(_REMOTE_KEYS)})")
        if inspect.isclass(fn):
            if concurrency is None:
                lo, hi = 1, max(1, int(tpuray.cluster_resources().get("CPU", 1)))
            elif isinstance(concurrency, int):
                lo = hi = concurrency
            else:
                lo, hi = concurrency
            if not (1 <= lo <= hi):
                raise ValueError(f"concurrency must be >= 1 and min <= max, got {concurrency!r}")

            def on_actor(instance, block, _f=_batched):
                return _f(instance, batch_size, batch_format, fn_args, fn_kwargs)(block)

            return self._with(_Logical(
                "actors", f"MapBatches({fn.__name__})", fn=on_actor, args=ray_remote_args,
                cls=fn, cls_args=tuple(fn_constructor_args),
                cls_kwargs=dict(fn_constructor_kwargs or {}), concurrency=(lo, hi),
            ))
        if concurrency is not None:
            raise ValueError("concurrency applies to callable classes (actor pools), not functions")
        transform = _batched(fn, batch_size, batch_format, fn_args, fn_kwargs)
        return self._with(_Logical("task", f"MapBatches({_name(fn)})", fn=transform, args=ray_remote_args))

    def add_column(self, name: str, fn: Callable[[dict], Any]) -> "Dataset":
        """Adds column ``name`` computed by ``fn(batch)`` from each numpy batch."""

        def add(batch):
            batch = dict(batch)
            batch[name] = fn(batch)
            return batch

        return self.map_batches(add, batch_size=None)

    def select_columns(self, cols: list) -> "Dataset":
        """Keeps only ``cols``."""
        cols = list(cols)
        return self.map_batches(lambda b: {c: b[c] for c in cols}, batch_size=None)

    def random_shuffle(self, *, seed: Optional[int] = None, num_blocks: Optional[int] = None) -> "Dataset":
        """Shuffles all rows (an all-to-all operator: waits for its whole input)."""
        return self._with(_Logical("all_to_all", "RandomShuffle", how=("shuffle", num_blocks, seed)))

    def repartition(self, num_blocks: int) -> "Dataset":
        """Re-cuts the rows, in order, into ``num_blocks`` blocks of near-equal size."""
        if num_blocks < 1:
            raise ValueError(f"num_blocks must be >= 1, got {num_blocks}")
        return self._with(_Logical("all_to_all", "Repartition", how=("repartition", num_blocks)))

    # ---- execution ----

    def _physical(self) -> list[PhysicalOp]:
        """The operators to run: task operators fused into the one before (source included)
        when their remote options agree."""
        ops = [PhysicalOp(**{**self._source.__dict__})]
        for lg in self._ops:
            prev = ops[-1]
            if lg.kind == "task":
                fusable = prev.kind in ("task", "source") and (
                    prev.remote_args == lg.kw["args"] or (prev.kind == "source" and not lg.kw["args"])
                ) and not prev.blocks
                if fusable and prev.kind == "task":
                    prev.fn = _compose(prev.fn, lg.kw["fn"])
                    prev.name = f"{prev.name}->{lg.name}"
                    continue
                if fusable and prev.kind == "source" and prev.read_fns:
                    prev.read_fns = [_compose(r, lg.kw["fn"]) for r in prev.read_fns]
                    prev.name = f"{prev.name}->{lg.name}"
                    continue
                ops.append(PhysicalOp(name=lg.name, kind="task", fn=lg.kw["fn"],
                                      remote_args=dict(lg.kw["args"])))
            elif lg.kind == "actors":
                args = dict(lg.kw["args"])
                ops.append(PhysicalOp(
                    name=lg.name, kind="actors", fn=lg.kw["fn"], remote_args=args,
                    actor_cls=lg.kw["cls"], actor_args=lg.kw["cls_args"],
                    actor_kwargs=lg.kw["cls_kwargs"], concurrency=lg.kw["concurrency"],
                ))
            else:
                how = lg.kw["how"]
                if how[0] == "shuffle" and how[1] is None:
                    how = ("shuffle", max(1, self._num_source_blocks()), how[2])
                ops.append(PhysicalOp(name=lg.name, kind="all_to_all", all_to_all=how))
        return ops

    def _num_source_blocks(self) -> int:
        return len(self._source.read_fns) + len(self._source.blocks)

    def _execute(self, ctx: Optional[DataContext] = None) -> Iterator[tuple]:
        from tpuray._private import worker

        worker.auto_init()
        ctx = (ctx or DataContext.get_current()).resolved()
        ex = StreamingExecutor(self._physical(), ctx)
        self._last_executor = ex
        yield from ex.run()

    def iter_internal_ref_bundles(self) -> Iterator[tuple]:
        """``(block_ref, BlockMeta)`` pairs as the pipeline makes them."""
        return self._execute()

    def iter_batches(self, *, batch_size: Optional[int] = 256, batch_format: str = "numpy",
                     drop_last: bool = False, prefetch_batches: int = 1) -> Iterator[Any]:
        """Batches of ``batch_size`` rows (``None``: one per block) in ``batch_format``."""
        return _rebatch((tpuray.get(ref) for ref, _ in self._execute()), batch_size,
                        batch_format, drop_last)

    def iter_torch_batches(self, *, batch_size: Optional[int] = 256, drop_last: bool = False,
                           **_ignored) -> Iterator[dict]:
        """``iter_batches`` with ``batch_format="torch"``."""
        return self.iter_batches(batch_size=batch_size, batch_format="torch", drop_last=drop_last)

    def iter_rows(self) -> Iterator[dict]:
        for ref, _ in self._execute():
            yield from B.rows(tpuray.get(ref))

    def take(self, limit: int = 20) -> list[dict]:
        out = []
        for row in self.iter_rows():
            if len(out) >= limit:
                break
            out.append(row)
        return out

    def take_all(self) -> list[dict]:
        return list(self.iter_rows())

    def take_batch(self, batch_size: int = 20, *, batch_format: str = "numpy"):
        for b in self.iter_batches(batch_size=batch_size, batch_format=batch_format):
            return b
        return B.to_format({}, batch_format)

    def count(self) -> int:
        """Rows in the dataset (runs the pipeline; blocks are not fetched)."""
        return sum(meta.num_rows for _, meta in self._execute())

    def schema(self) -> dict:
        """Column name -> numpy dtype, from the first non-empty block."""
        for ref, meta in self._execute():
            if meta.num_rows:
                return {k: v.dtype for k, v in tpuray.get(ref).items()}
        return {}

    def columns(self) -> list:
        return list(self.schema().keys())

    def show(self, limit: int = 20) -> None:
        for row in self.take(limit):
            print(row)

    def materialize(self) -> "Dataset":
        """Runs the pipeline and keeps its blocks in the object store."""
        blocks = list(self._execute())
        return Dataset(PhysicalOp(name="Materialized", kind="source", blocks=blocks))

    def num_blocks(self) -> int:
        return self._num_source_blocks() if not self._ops else len(self.materialize()._source.blocks)

    def streaming_split(self, n: int, *, equal: bool = False, locality_hints=None) -> list:
        """``n`` iterators that share one streaming execution: blocks go to the consumers
        in turn (with ``equal=True`` every consumer gets the same number of rows; extra
        rows are dropped), for feeding a trainer gang one iterator per member. Each
        iterator can be passed to a task or actor; every member must iterate each epoch.
        """
        from tpuray.data.iterator import _SplitCoordinator, DataIterator

        if n < 1:
            raise ValueError(f"streaming_split needs n >= 1, got {n}")
        coord = _SplitCoordinator.options(num_cpus=0, max_concurrency=max(4, 2 * n)).remote(
            self, n, equal
        )
        return [DataIterator(coord, i) for i in range(n)]

    def stats(self) -> str:
        ex = getattr(self, "_last_executor", None)
        if ex is None:
            return "not executed yet"
        return f"peak bytes held in the object store: {ex.peak_bytes}"

    def __repr__(self) -> str:
        chain = " -> ".join([self._source.name] + [o.name for o in self._ops])
        return f"Dataset({chain})"


def _name(fn) -> str:
    return getattr(fn, "__name__", type(fn).__name__)


def _rebatch(blocks, batch_size, batch_format, drop_last):
    pending: list = []
    rows = 0
    for block in blocks:
        n = B.num_rows(block)
        if n == 0:
            continue
        if batch_size is None:
            yield B.to_format(block, batch_format)
            continue
        pending.append(block)
        rows += n
        while rows >= batch_size:
            whole = B.concat(pending)
            yield B.to_format(B.slice_block(whole, 0, batch_size), batch_format)
            rest = B.slice_block(whole, batch_size, rows)
            rows -= batch_size
            pending = [rest] if rows else []
    if rows and not drop_last:
        yield B.to_format(B.concat(pending), batch_format)
