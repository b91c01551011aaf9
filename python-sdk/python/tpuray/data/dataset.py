"""``Dataset``: a lazy, streaming pipeline of blocks (Ray Data's ``Dataset``).

Transformations (``map``, ``map_batches``, ``filter``, ``flat_map``, column operations,
``random_shuffle``, ``repartition``, ``sort``, ``groupby``, ``limit``, ...) only record an
operator; consuming (``iter_batches``, ``take``, ``count``, ``write_*``, ...) runs the
pipeline with the streaming executor (``tpuray.data._executor``): consecutive task
operators are fused into one task per block, a callable class runs on an autoscaling actor
pool, all-to-all operators (shuffle, sort, groupby, repartition) exchange block parts
through the object store in tasks, and backpressure bounds the bytes the pipeline holds
in the object store.

Names, signatures, defaults and output shapes follow Ray Data 2.60 (``ray/data/dataset.py``):
``map_batches(batch_size=None)`` hands whole blocks, ``batch_format="default"`` is a dict
of numpy arrays, aggregate columns are named ``sum(x)``, ``count()``, ...
"""

from __future__ import annotations

import inspect
import queue
import threading
import uuid
from typing import Any, Callable, Iterator, List, Optional, Union

import tpuray
from tpuray.data import block as B
from tpuray.data._executor import PhysicalOp, StreamingExecutor
from tpuray.data.context import DataContext

#: Ray Data's ``iter_batches`` default batch size.
DEFAULT_ITER_BATCH_SIZE = 256

_REMOTE_KEYS = ("num_cpus", "num_gpus", "resources", "memory", "accelerator_type",
                "scheduling_strategy", "label_selector", "runtime_env", "max_retries",
                "retry_exceptions", "name")
# Ray options tpuray.data does not implement: refused by name when set.
_REFUSED_KEYS = ("fallback_strategy", "max_calls", "ray_remote_args_fn", "max_task_retries")


def _compose(first: Optional[Callable], second: Callable) -> Callable:
    if first is None:
        return second

    def both(*blocks):
        return second(first(*blocks))

    return both


def _user_error():
    from tpuray.exceptions import UserCodeException

    return UserCodeException("UDF failed to process a data block.")


def _call_udf(fn, *args, **kwargs):
    """Calls a user function; what it raises becomes Ray's ``UserCodeException`` with
    the user's exception as its cause (so its traceback reaches the driver)."""
    try:
        return fn(*args, **kwargs)
    except Exception as e:
        raise _user_error() from e


def _batch_outputs(out) -> list:
    """What a batch UDF returned (a batch, or a generator of batches) as blocks."""
    if inspect.isgenerator(out) or (hasattr(out, "__next__") and hasattr(out, "__iter__")
                                    and not isinstance(out, (dict, list))):
        blocks = []
        while True:
            try:
                item = next(out)
            except StopIteration:
                break
            except Exception as e:
                raise _user_error() from e
            blocks.append(B.from_batch(item))
        return blocks
    return [B.from_batch(out)]


def _batched(fn: Callable, batch_size, batch_format, fn_args, fn_kwargs,
             zero_copy_batch: bool = True) -> Callable:
    """A block transform applying ``fn`` to batches of ``batch_size`` rows (``None``:
    the whole block) in ``batch_format``."""

    def transform(block):
        n = B.num_rows(block)
        if n == 0:
            return block
        size = n if batch_size is None else max(1, int(batch_size))
        outs = []
        for start in range(0, n, size):
            part = B.slice_block(block, start, min(n, start + size))
            if not zero_copy_batch:
                part = {k: v.copy() for k, v in part.items()}
            outs.extend(_batch_outputs(_call_udf(fn, B.to_format(part, batch_format),
                                                 *fn_args, **fn_kwargs)))
        return B.concat(outs)

    return transform


def _row_map(fn, fn_args, fn_kwargs):
    def transform(block):
        out = []
        for r in B.rows(block):
            v = _call_udf(fn, r, *fn_args, **fn_kwargs)
            if not isinstance(v, dict):
                raise ValueError(
                    f"The `fn` you passed to `map` must return a dict (a row), got {type(v)}"
                )
            out.append(v)
        return B.from_rows(out)

    return transform


def _row_filter(fn, fn_args, fn_kwargs):
    def transform(block):
        import numpy as np

        keep = np.array([bool(_call_udf(fn, r, *fn_args, **fn_kwargs)) for r in B.rows(block)],
                        dtype=bool)
        return B.take_indices(block, np.nonzero(keep)[0]) if len(keep) else block

    return transform


def _row_flat_map(fn, fn_args, fn_kwargs):
    def transform(block):
        out = []
        for r in B.rows(block):
            out.extend(_call_udf(fn, r, *fn_args, **fn_kwargs))
        return B.from_rows(out)

    return transform


class _Logical:
    """One recorded operator."""

    def __init__(self, kind: str, name: str, **kw):
        self.kind = kind
        self.name = name
        self.kw = kw


def _remote_args(where: str, num_cpus, num_gpus, memory, extra: dict) -> dict:
    out = {}
    for k, v in (("num_cpus", num_cpus), ("num_gpus", num_gpus), ("memory", memory)):
        if v is not None:
            out[k] = v
    for k, v in extra.items():
        if k in _REFUSED_KEYS:
            if v is not None:
                raise ValueError(f"{where}: the option {k!r} is not supported by tpuray.data")
            continue
        if k not in _REMOTE_KEYS:
            raise ValueError(
                f"{where} got an unknown option {k!r} (remote options: {', '.join(_REMOTE_KEYS)})"
            )
        if v is not None:
            out[k] = v
    return out


def _pool_size(where: str, compute, concurrency) -> tuple:
    """``(min, max)`` actors for a callable class."""
    from tpuray.data import ActorPoolStrategy

    if compute is not None and concurrency is not None:
        raise ValueError(f"{where}: pass either compute= or concurrency=, not both")
    if isinstance(compute, ActorPoolStrategy):
        return compute.as_concurrency()
    if compute is not None and compute != "actors":
        raise ValueError(f"{where}: compute must be an ActorPoolStrategy for a callable class, got {compute!r}")
    if concurrency is None:
        return (1, max(1, int(tpuray.cluster_resources().get("CPU", 1))))
    if isinstance(concurrency, int):
        lo = hi = concurrency
    elif isinstance(concurrency, tuple) and len(concurrency) in (2, 3):
        lo, hi = concurrency[0], concurrency[1]
    else:
        raise ValueError(f"{where}: concurrency must be an int, (min, max) or (min, max, initial), got {concurrency!r}")
    if not (isinstance(lo, int) and isinstance(hi, int) and 1 <= lo <= hi):
        raise ValueError(f"{where}: concurrency must be >= 1 and min <= max, got {concurrency!r}")
    return (lo, hi)


class Schema:
    """Column names and types of a dataset (Ray's ``Schema``): ``names``, ``types``
    (pyarrow types)."""

    def __init__(self, names: list, types: list):
        self.names = list(names)
        self.types = list(types)

    def __repr__(self) -> str:
        w = max([len("Column")] + [len(n) for n in self.names])
        lines = [f"{'Column':<{w}}  Type", f"{'------':<{w}}  ----"]
        lines += [f"{n:<{w}}  {t}" for n, t in zip(self.names, self.types)]
        return "\n".join(lines)

    def __eq__(self, other):
        return isinstance(other, Schema) and self.names == other.names and self.types == other.types


class Dataset:
    """A lazy dataset: a source and the operators applied to it. Cheap to copy; every
    consuming call runs the pipeline anew."""

    def __init__(self, source: PhysicalOp, ops: Optional[list] = None):
        self._source = source
        self._ops: list[_Logical] = list(ops or [])

    def _with(self, op: _Logical) -> "Dataset":
        return Dataset(self._source, self._ops + [op])

    def __getstate__(self):
        # The last execution's stats stay with this process (they hold live state).
        state = dict(self.__dict__)
        state.pop("_last_executor", None)
        return state

    def _udf_op(self, where: str, fn, make: Callable, *, compute, concurrency,
                fn_args, fn_kwargs, fn_constructor_args, fn_constructor_kwargs,
                remote_args: dict) -> "Dataset":
        """An operator applying ``make(callable, fn_args, fn_kwargs)`` (a block transform)
        with ``fn``: tasks for a function, an actor pool for a callable class."""
        fn_args = tuple(fn_args or ())
        fn_kwargs = dict(fn_kwargs or {})
        if inspect.isclass(fn):
            lo_hi = _pool_size(where, compute, concurrency)

            def on_actor(instance, block, _make=make, _a=fn_args, _k=fn_kwargs):
                return _make(instance, _a, _k)(block)

            return self._with(_Logical(
                "actors", f"{where}({fn.__name__})", fn=on_actor, args=remote_args, cls=fn,
                cls_args=tuple(fn_constructor_args or ()),
                cls_kwargs=dict(fn_constructor_kwargs or {}), concurrency=lo_hi,
            ))
        if not callable(fn):
            raise TypeError(f"{where} needs a function or a callable class, got {fn!r}")
        from tpuray.data import TaskPoolStrategy

        if isinstance(compute, TaskPoolStrategy):
            if concurrency is not None:
                raise ValueError(f"{where}: pass either compute= or concurrency=, not both")
            concurrency = compute.size
        elif compute is not None and compute != "tasks":
            raise ValueError(f"{where}: compute={compute!r} needs a callable class (actors); "
                             f"a function runs as tasks (compute=TaskPoolStrategy(size=n))")
        if fn_constructor_args or fn_constructor_kwargs:
            raise ValueError(f"{where}: fn_constructor_args/kwargs apply to callable classes only")
        max_conc = None
        if concurrency is not None:
            if not isinstance(concurrency, int) or concurrency < 1:
                raise ValueError(f"{where}: concurrency for a function must be an int >= 1, got {concurrency!r}")
            max_conc = concurrency
        return self._with(_Logical("task", f"{where}({_name(fn)})", fn=make(fn, fn_args, fn_kwargs),
                                   args=remote_args, max_concurrency=max_conc))

    # ---- row and batch transformations ----

    def map(self, fn, *, compute=None, fn_args=None, fn_kwargs=None, fn_constructor_args=None,
            fn_constructor_kwargs=None, num_cpus=None, num_gpus=None, memory=None,
            concurrency=None, **ray_remote_args) -> "Dataset":
        """Applies ``fn`` to every row (a dict); it returns the new row (a dict). A callable
        class runs on an actor pool (``concurrency``: size or ``(min, max)``); a function
        as tasks (``concurrency``: at most that many at once).

        Raises:
            ValueError: a bad option (named); at execution, a row that is not a dict.
            UserCodeException: (inside ``RayTaskError``) what ``fn`` raised, as its cause.
        """
        remote = _remote_args("map", num_cpus, num_gpus, memory, ray_remote_args)
        return self._udf_op("Map", fn, _row_map, compute=compute, concurrency=concurrency,
                            fn_args=fn_args, fn_kwargs=fn_kwargs,
                            fn_constructor_args=fn_constructor_args,
                            fn_constructor_kwargs=fn_constructor_kwargs, remote_args=remote)

    def filter(self, fn=None, expr=None, *, compute=None, fn_args=None, fn_kwargs=None,
               fn_constructor_args=None, fn_constructor_kwargs=None, num_cpus=None,
               num_gpus=None, memory=None, concurrency=None, **ray_remote_args) -> "Dataset":
        """Keeps the rows for which ``fn(row)`` is true (functions or callable classes, as
        in :meth:`map`).

        Raises:
            ValueError: ``expr=`` (Ray's expression filters are not implemented), or no ``fn``.
        """
        if expr is not None:
            raise ValueError("filter(expr=...) is not supported by tpuray.data; pass fn=")
        if fn is None:
            raise ValueError("filter needs fn")
        remote = _remote_args("filter", num_cpus, num_gpus, memory, ray_remote_args)
        return self._udf_op("Filter", fn, _row_filter, compute=compute, concurrency=concurrency,
                            fn_args=fn_args, fn_kwargs=fn_kwargs,
                            fn_constructor_args=fn_constructor_args,
                            fn_constructor_kwargs=fn_constructor_kwargs, remote_args=remote)

    def flat_map(self, fn, *, compute=None, fn_args=None, fn_kwargs=None,
                 fn_constructor_args=None, fn_constructor_kwargs=None, num_cpus=None,
                 num_gpus=None, memory=None, concurrency=None, **ray_remote_args) -> "Dataset":
        """Replaces every row with the rows (dicts) ``fn(row)`` returns."""
        remote = _remote_args("flat_map", num_cpus, num_gpus, memory, ray_remote_args)
        return self._udf_op("FlatMap", fn, _row_flat_map, compute=compute,
                            concurrency=concurrency, fn_args=fn_args, fn_kwargs=fn_kwargs,
                            fn_constructor_args=fn_constructor_args,
                            fn_constructor_kwargs=fn_constructor_kwargs, remote_args=remote)

    def map_batches(self, fn, *, batch_size: Union[int, None, str] = None, compute=None,
                    batch_format: Optional[str] = "default", zero_copy_batch: bool = True,
                    fn_args=None, fn_kwargs=None, fn_constructor_args=None,
                    fn_constructor_kwargs=None, num_cpus=None, num_gpus=None, memory=None,
                    concurrency=None, udf_modifying_row_count: bool = True,
                    **ray_remote_args) -> "Dataset":
        """Applies ``fn`` to batches of ``batch_size`` rows (Ray 2.60's default ``None``:
        one batch per block; ``"auto"``: also whole blocks here) in ``batch_format`` (``"default"``/``"numpy"``: dict of
        numpy arrays, ``"pandas"``: DataFrame, ``"pyarrow"``/``None``: Table). ``fn``
        returns a batch (dict of arrays, DataFrame or Table) or is a generator yielding
        batches.

        A function runs as stateless tasks (``concurrency``: at most that many at once). A
        callable class runs on a pool of actors, each constructing it once with
        ``fn_constructor_args/kwargs``; the pool size is ``compute=ActorPoolStrategy(...)``
        or ``concurrency`` (an int, or ``(min, max)`` to autoscale between; default ``(1,
        cluster CPUs)``). ``num_cpus``, ``num_gpus``, ``resources`` (e.g. ``{"TPU": 4}``)
        apply per task or per actor. A pool never grows so far that the tasks feeding it
        have no CPU left. ``zero_copy_batch=False`` hands the UDF copies it may modify.

        Raises:
            ValueError: an unknown batch format, a bad batch size or option (named).
        """
        if num_gpus is not None and num_gpus > 0 and (batch_size is None or batch_size == "auto"):
            raise ValueError("You must provide `batch_size` to `map_batches` when requesting GPUs.")
        if batch_size == "auto":
            batch_size = None  # whole blocks (Ray sizes "auto" batches from the row size)
        if batch_size is not None and (isinstance(batch_size, bool) or not isinstance(batch_size, int)
                                       or batch_size < 1):
            raise ValueError(f"batch_size must be a positive int, None or 'auto', got {batch_size!r}")
        B.check_batch_format(batch_format)
        remote = _remote_args("map_batches", num_cpus, num_gpus, memory, ray_remote_args)

        def make(f, a, k):
            return _batched(f, batch_size, batch_format, a, k, zero_copy_batch)

        return self._udf_op("MapBatches", fn, make, compute=compute, concurrency=concurrency,
                            fn_args=fn_args, fn_kwargs=fn_kwargs,
                            fn_constructor_args=fn_constructor_args,
                            fn_constructor_kwargs=fn_constructor_kwargs, remote_args=remote)

    # ---- column operations ----

    def _known_columns(self) -> Optional[list]:
        """The columns when they are known without running anything (in-memory sources
        with no operator yet), else ``None``."""
        if not self._ops and self._source.blocks:
            for _, m in self._source.blocks:
                if m.num_rows:
                    return list(m.columns)
        return None

    def add_column(self, col: str, fn: Callable, *, batch_format: Optional[str] = "pandas",
                   compute=None, concurrency=None, **ray_remote_args) -> "Dataset":
        """Adds (or replaces) column ``col`` computed by ``fn(batch)`` from each batch in
        ``batch_format`` (Ray's default ``"pandas"``)."""
        B.check_batch_format(batch_format)

        def add(batch):
            if batch_format == "pandas":
                batch = batch.copy()
                batch[col] = fn(batch)
                return batch
            if batch_format in ("pyarrow", None):
                value = fn(batch)
                if col in batch.column_names:
                    return batch.set_column(batch.column_names.index(col), col, value)
                return batch.append_column(col, value)
            batch = dict(batch)
            batch[col] = fn(batch)
            return batch

        if compute is not None:
            raise ValueError("add_column: compute= is not supported (the UDF is a function; use concurrency=)")
        return self.map_batches(add, batch_format=batch_format, concurrency=concurrency,
                                **ray_remote_args)

    def drop_columns(self, cols: Union[str, List[str]], *, compute=None, concurrency=None,
                     **ray_remote_args) -> "Dataset":
        """Removes ``cols`` (one name or a list).

        Raises:
            ValueError: duplicate names. KeyError: a column the dataset lacks (raised at
                once when the columns are known, else at execution).
        """
        cols = [cols] if isinstance(cols, str) else list(cols)
        if len(set(cols)) != len(cols):
            raise ValueError(f"drop_columns: duplicate column names in {cols}")
        known = self._known_columns()
        if known is not None:
            missing = [c for c in cols if c not in known]
            if missing:
                raise KeyError(f"Column(s) {missing} not in the dataset's columns {known}")

        def drop(batch):
            missing = [c for c in cols if c not in batch]
            if missing:
                raise KeyError(f"Column(s) {missing} not in the dataset's columns {list(batch)}")
            return {k: v for k, v in batch.items() if k not in cols}

        return self.map_batches(drop, concurrency=concurrency, compute=compute, **ray_remote_args)

    def select_columns(self, cols: Union[str, List[str]], *, compute=None, concurrency=None,
                       **ray_remote_args) -> "Dataset":
        """Keeps only ``cols`` (one name or a list), in that order.

        Raises:
            ValueError: duplicate names; at execution a missing column (inside
                ``RayTaskError(UserCodeException)``, as Ray).
        """
        cols = [cols] if isinstance(cols, str) else list(cols)
        if len(set(cols)) != len(cols):
            raise ValueError(f"select_columns: duplicate column names in {cols}")

        def select(batch):
            missing = [c for c in cols if c not in batch]
            if missing:
                raise ValueError(f"Column(s) {missing} not in the dataset's columns {list(batch)}")
            return {c: batch[c] for c in cols}

        out = self.map_batches(select, concurrency=concurrency, compute=compute, **ray_remote_args)
        out._ops[-1].kw["project"] = cols  # its schema is known (repr), as Ray's Project
        return out

    def rename_columns(self, names: Union[dict, list], *, concurrency=None,
                       **ray_remote_args) -> "Dataset":
        """Renames columns: a dict old -> new, or a list of new names for every column.

        Raises:
            TypeError: neither a dict nor a list. ValueError: at execution, an old name the
                dataset lacks or a list of the wrong length.
        """
        if not isinstance(names, (dict, list)):
            raise TypeError(f"rename_columns takes a dict or a list, got {type(names).__name__}")

        def rename(batch):
            if isinstance(names, list):
                if len(names) != len(batch):
                    raise ValueError(f"rename_columns got {len(names)} names for {len(batch)} columns")
                return dict(zip(names, batch.values()))
            missing = [c for c in names if c not in batch]
            if missing:
                raise ValueError(f"Column(s) {missing} not in the dataset's columns {list(batch)}")
            return {names.get(k, k): v for k, v in batch.items()}

        return self.map_batches(rename, concurrency=concurrency, **ray_remote_args)

    # ---- all-to-all operators ----

    def random_shuffle(self, *, seed: Optional[int] = None, num_blocks: Optional[int] = None,
                       **ray_remote_args) -> "Dataset":
        """Shuffles all rows through the object store (map tasks scatter each block's rows
        to random parts, reduce tasks join and permute them); the same ``seed`` gives the
        same order. ``num_blocks``: output blocks (default: as many as the input)."""
        if ray_remote_args:
            raise ValueError(f"random_shuffle: options {sorted(ray_remote_args)} are not supported")
        if num_blocks is not None and num_blocks < 1:
            raise ValueError(f"num_blocks must be >= 1, got {num_blocks}")
        return self._with(_Logical("all_to_all", "RandomShuffle", how=("shuffle", num_blocks, seed)))

    def repartition(self, num_blocks: Optional[int] = None,
                    target_num_rows_per_block: Optional[int] = None, *, strict: bool = False,
                    shuffle: bool = False, keys: Optional[List[str]] = None,
                    sort: bool = False) -> "Dataset":
        """Re-cuts the rows, in order, into ``num_blocks`` blocks of near-equal size (or
        blocks of ``target_num_rows_per_block`` rows); ``shuffle=True`` shuffles on the
        way; ``keys`` hash-partitions by those columns (``sort=True``: sorted by them).

        Raises:
            ValueError: both or neither of ``num_blocks`` and ``target_num_rows_per_block``.
        """
        if (num_blocks is None) == (target_num_rows_per_block is None):
            raise ValueError("Exactly one of num_blocks or target_num_rows_per_block must be set")
        if num_blocks is not None and num_blocks < 1:
            raise ValueError(f"num_blocks must be >= 1, got {num_blocks}")
        if target_num_rows_per_block is not None and target_num_rows_per_block < 1:
            raise ValueError(f"target_num_rows_per_block must be >= 1, got {target_num_rows_per_block}")
        if keys is not None:
            keys = [keys] if isinstance(keys, str) else list(keys)
            if num_blocks is None:
                raise ValueError("repartition(keys=...) needs num_blocks")
            finish = _sorted_by(keys) if sort else _identity
            return self._with(_Logical("all_to_all", "Repartition",
                                       how=("groupby", num_blocks, (keys, finish))))
        if shuffle:
            if num_blocks is None:
                raise ValueError("repartition(shuffle=True) needs num_blocks")
            return self.random_shuffle(num_blocks=num_blocks)
        return self._with(_Logical("all_to_all", "Repartition",
                                   how=("repartition", num_blocks, target_num_rows_per_block)))

    def sort(self, key: Union[str, List[str]], descending: Union[bool, List[bool]] = False,
             boundaries: Optional[list] = None) -> "Dataset":
        """Sorts by ``key`` (a column or several), each ascending or descending.

        A distributed sort: a few sampled values of the first key from every block choose
        range boundaries (or ``boundaries`` gives them), map tasks cut each block into
        ranges, and one reduce task per range joins and sorts it; blocks leave in range
        order. Only the samples reach the driver.

        Raises:
            ValueError: ``descending`` of another length than ``key``; at execution, a key
                the dataset lacks (naming it and the columns there are).
        """
        keys = [key] if isinstance(key, str) else list(key)
        if not keys:
            raise ValueError("sort needs at least one key")
        desc = [descending] * len(keys) if isinstance(descending, bool) else list(descending)
        if len(desc) != len(keys):
            raise ValueError(f"Length of `descending` ({len(desc)}) does not match the length of the sort key ({len(keys)})")
        bounds = None
        if boundaries is not None:
            bounds = sorted(boundaries)
        return self._with(_Logical("all_to_all", f"Sort({', '.join(keys)})",
                                   how=("sort", None, (keys, desc, bounds))))

    def groupby(self, key: Union[str, List[str], None], num_partitions: Optional[int] = None):
        """Groups rows by ``key`` (a column, several, or ``None`` for one group of every
        row) for an aggregation (:class:`tpuray.data.grouped_data.GroupedData`): a
        hash-partitioned shuffle, ``num_partitions`` reduce tasks (default: one per
        input block)."""
        from tpuray.data.grouped_data import GroupedData

        if num_partitions is not None and num_partitions < 1:
            raise ValueError(f"num_partitions must be >= 1, got {num_partitions}")
        return GroupedData(self, key, num_partitions)

    def random_sample(self, fraction: float, *, seed: Optional[int] = None) -> "Dataset":
        """Keeps each row with probability ``fraction`` (per-block random draws; with
        ``seed`` the same rows every run).

        Raises:
            ValueError: ``fraction`` outside [0, 1].
        """
        if not (0 <= fraction <= 1):
            raise ValueError("Fraction must be between 0 and 1.")

        def sample(block):
            import zlib

            import numpy as np

            n = B.num_rows(block)
            if n == 0:
                return block
            if seed is None:
                rng = np.random.default_rng()
            else:
                first = next(iter(block.values()))
                digest = zlib.crc32(repr(first[:4].tolist()).encode()) if first.dtype == object \
                    else zlib.crc32(np.ascontiguousarray(first[:64]).tobytes())
                rng = np.random.default_rng([seed, n, digest])
            return B.take_indices(block, np.nonzero(rng.random(n) < fraction)[0])

        return self._with(_Logical("task", "RandomSample", fn=sample, args={}, max_concurrency=None))

    def limit(self, limit: int) -> "Dataset":
        """The first ``limit`` rows; once they went by, the operators before stop
        (no more reads)."""
        if not isinstance(limit, int) or limit < 0:
            raise ValueError(f"limit must be an int >= 0, got {limit!r}")
        return self._with(_Logical("limit", f"Limit[{limit}]", limit=limit))

    # ---- combining and splitting (materialize first) ----

    def union(self, *other: "Dataset") -> "Dataset":
        """The rows of this dataset then those of each of ``other`` (each is run and its
        blocks kept in the object store)."""
        blocks = list(self._execute())
        for o in other:
            blocks.extend(o._execute())
        return MaterializedDataset(PhysicalOp(name="Union", kind="source", blocks=blocks))

    def zip(self, *other: "Dataset") -> "Dataset":
        """Joins the columns of datasets with the same number of rows, row by row; a name
        already taken gets the suffix ``_1``, ``_2``, ... of its dataset (as Ray).

        Raises:
            ValueError: row counts that differ.
        """
        left = list(self._execute())
        total = sum(m.num_rows for _, m in left)
        rights = []
        for k, o in enumerate(other, start=1):
            blocks = list(o._execute())
            n = sum(m.num_rows for _, m in blocks)
            if n != total:
                raise ValueError(f"Cannot zip datasets of different number of rows: {total}, {n}")
            rights.append(_cut_like(blocks, [m.num_rows for _, m in left]))
        out = []
        for i, (ref, _) in enumerate(left):
            pieces = [r[i] for r in rights]
            counts = [len(p) for p in pieces]
            b, m = _zip_blocks.remote(counts, ref, *[x for p in pieces for x in p])
            out.append((b, tpuray.get(m)))
        return MaterializedDataset(PhysicalOp(name="Zip", kind="source", blocks=out))

    def split(self, n: int, *, equal: bool = False, locality_hints=None) -> list:
        """``n`` materialized datasets: whole blocks dealt as ``numpy.array_split`` of the
        block list (Ray's rule); ``equal=True`` cuts rows so each has ``total // n``
        (the rest dropped). ``locality_hints`` (actors) must be ``n`` long; on one node it
        does not change the split.

        Raises:
            ValueError: ``n`` < 1, or ``locality_hints`` of another length.
        """
        if not isinstance(n, int) or n <= 0:
            raise ValueError(f"The number of splits {n} is not positive.")
        if locality_hints is not None and len(locality_hints) != n:
            raise ValueError(f"The length of locality_hints {len(locality_hints)} doesn't equal the number of splits {n}.")
        blocks = list(self._execute())
        if equal:
            total = sum(m.num_rows for _, m in blocks)
            share = total // n
            return _split_rows(blocks, [share * i for i in range(1, n + 1)])[:n]
        out, start = [], 0
        for i in range(n):
            size = len(blocks) // n + (1 if i < len(blocks) % n else 0)
            out.append(MaterializedDataset(PhysicalOp(name="Split", kind="source",
                                                      blocks=blocks[start:start + size])))
            start += size
        return out

    def split_at_indices(self, indices: List[int]) -> list:
        """``len(indices) + 1`` materialized datasets cut at the given row indices.

        Raises:
            ValueError: indices not sorted or negative.
        """
        if not indices:
            raise ValueError("indices must be at least of length 1")
        if sorted(indices) != list(indices):
            raise ValueError("indices must be sorted")
        if indices[0] < 0:
            raise ValueError("indices must be positive")
        return _split_rows(list(self._execute()), list(indices))

    def split_proportionately(self, proportions: List[float]) -> list:
        """Cuts into ``len(proportions) + 1`` datasets of those fractions of the rows (the
        last takes the rest)."""
        if not proportions or any(p <= 0 for p in proportions) or sum(proportions) >= 1:
            raise ValueError("proportions must be positive and sum to less than 1")
        blocks = list(self._execute())
        total = sum(m.num_rows for _, m in blocks)
        cuts, acc = [], 0.0
        for p in proportions:
            acc += p
            cuts.append(int(total * acc))
        return _split_rows(blocks, cuts)

    def train_test_split(self, test_size: Union[int, float], *, shuffle: bool = False,
                         seed: Optional[int] = None, stratify: Optional[str] = None) -> tuple:
        """``(train, test)``: ``test_size`` a fraction in (0, 1) or a row count of the
        last rows (after a shuffle with ``seed`` when ``shuffle``).

        Raises:
            ValueError: a bad ``test_size``; ``stratify`` (not implemented).
        """
        if stratify is not None:
            raise ValueError("train_test_split(stratify=...) is not supported by tpuray.data")
        if isinstance(test_size, float):
            if not (0 < test_size < 1):
                raise ValueError(f"If `test_size` is a float, it must be bigger than 0 and smaller than 1. Got {test_size}.")
        elif isinstance(test_size, int):
            if test_size <= 0:
                raise ValueError(f"If `test_size` is an int, it must be bigger than 0. Got {test_size}.")
        else:
            raise TypeError(f"`test_size` must be a float or an int, got {type(test_size).__name__}")
        ds = self.random_shuffle(seed=seed) if shuffle else self
        blocks = list(ds._execute())
        total = sum(m.num_rows for _, m in blocks)
        if isinstance(test_size, float):
            cut = int(total * (1 - test_size))
        else:
            if test_size > total:
                raise ValueError(f"`test_size` ({test_size}) is bigger than the dataset ({total} rows)")
            cut = total - test_size
        train, test = _split_rows(blocks, [cut])
        return train, test

    def streaming_split(self, n: int, *, equal: bool = False, locality_hints=None) -> list:
        """``n`` iterators that share one streaming execution: blocks go to the consumers
        in turn (with ``equal=True`` every consumer gets the same number of rows; extra
        rows are dropped), for feeding a trainer gang one iterator per member. Each
        iterator can be passed to a task or actor; every member must iterate each epoch.
        """
        from tpuray.data.iterator import SplitIterator, _SplitCoordinator

        if n < 1:
            raise ValueError(f"streaming_split needs n >= 1, got {n}")
        # @tpuray.remote made the class an ActorClass; mypy keeps a decorated class's own type.
        coord = _SplitCoordinator.options(  # type: ignore[attr-defined]
            num_cpus=0, max_concurrency=max(4, 2 * n)
        ).remote(self, n, equal)
        return [SplitIterator(coord, i) for i in range(n)]

    # ---- aggregations over the whole dataset ----

    def aggregate(self, *aggs) -> dict:
        """Every aggregation (``tpuray.data.aggregate``) over all rows: ``{name: value}``.
        One small task per block computes partial results; only those reach the driver.

        Raises:
            ValueError: (inside ``RayTaskError``) a column the dataset lacks.
        """
        from tpuray.data import aggregate as A

        if not aggs:
            raise ValueError("aggregate needs at least one aggregation")
        agg_list = list(aggs)

        def partial(block, _aggs=agg_list):
            import numpy as np

            if B.num_rows(block):
                A.check_columns(_aggs, block.keys())
            out = np.empty(1, dtype=object)
            out[0] = A.run_on_block(_aggs, block) if B.num_rows(block) else None
            return {"partial": out}

        acc = [a.init(None) for a in aggs]
        ds = self._with(_Logical("task", "Aggregate", fn=partial, args={}, max_concurrency=None))
        for ref, _ in ds._execute():
            p = tpuray.get(ref)["partial"][0]
            if p is not None:
                acc = [a.merge(x, y) for a, x, y in zip(aggs, acc, p)]
        return {a.name: a.finalize(x) for a, x in zip(aggs, acc)}

    def _aggregate_on(self, cls, on, ignore_nulls, **kw):
        if on is None:
            on = self.columns()
        names = [on] if isinstance(on, str) else list(on)
        out = self.aggregate(*[cls(c, ignore_nulls=ignore_nulls, **kw) for c in names])
        return next(iter(out.values())) if len(out) == 1 else out

    def sum(self, on: Union[str, List[str], None] = None, ignore_nulls: bool = True):
        """The sum of column ``on`` (a value), or of several (``{"sum(a)": ...}``)."""
        from tpuray.data.aggregate import Sum

        return self._aggregate_on(Sum, on, ignore_nulls)

    def min(self, on: Union[str, List[str], None] = None, ignore_nulls: bool = True):
        from tpuray.data.aggregate import Min

        return self._aggregate_on(Min, on, ignore_nulls)

    def max(self, on: Union[str, List[str], None] = None, ignore_nulls: bool = True):
        from tpuray.data.aggregate import Max

        return self._aggregate_on(Max, on, ignore_nulls)

    def mean(self, on: Union[str, List[str], None] = None, ignore_nulls: bool = True):
        from tpuray.data.aggregate import Mean

        return self._aggregate_on(Mean, on, ignore_nulls)

    def std(self, on: Union[str, List[str], None] = None, ddof: int = 1,
            ignore_nulls: bool = True):
        """Standard deviation with ``ddof`` (Ray's default 1)."""
        from tpuray.data.aggregate import Std

        return self._aggregate_on(Std, on, ignore_nulls, ddof=ddof)

    def unique(self, column: str, ignore_nulls: bool = False) -> list:
        """The distinct values of ``column`` (in no particular order, as Ray)."""
        from tpuray.data.aggregate import Unique

        return self.aggregate(Unique(column, ignore_nulls=ignore_nulls))[f"unique({column})"]

    # ---- execution ----

    def _physical(self) -> list[PhysicalOp]:
        """The operators to run: task operators fused into the one before (source included)
        when their remote options agree and neither has a concurrency cap."""
        ops = [PhysicalOp(**{**self._source.__dict__})]
        for lg in self._ops:
            prev = ops[-1]
            if lg.kind == "task":
                cap = lg.kw.get("max_concurrency")
                fusable = cap is None and prev.max_concurrency is None and prev.kind in (
                    "task", "source") and (
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
                                      remote_args=dict(lg.kw["args"]), max_concurrency=cap))
            elif lg.kind == "actors":
                args = dict(lg.kw["args"])
                ops.append(PhysicalOp(
                    name=lg.name, kind="actors", fn=lg.kw["fn"], remote_args=args,
                    actor_cls=lg.kw["cls"], actor_args=lg.kw["cls_args"],
                    actor_kwargs=lg.kw["cls_kwargs"], concurrency=lg.kw["concurrency"],
                ))
            elif lg.kind == "limit":
                ops.append(PhysicalOp(name=lg.name, kind="limit", limit=lg.kw["limit"]))
            else:
                ops.append(PhysicalOp(name=lg.name, kind="all_to_all", all_to_all=lg.kw["how"]))
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

    def _blocks(self, prefetch: int) -> Iterator[dict]:
        return _prefetched(self._execute(), prefetch)

    def iterator(self):
        """A :class:`tpuray.data.DataIterator` over this dataset (Ray's
        ``Dataset.iterator``)."""
        from tpuray.data.iterator import DatasetIterator

        return DatasetIterator(self)

    def iter_batches(self, *, prefetch_batches: int = 1, batch_size: Optional[int] = 256,
                     batch_format: Optional[str] = "default", drop_last: bool = False,
                     local_shuffle_buffer_size: Optional[int] = None,
                     local_shuffle_seed: Optional[int] = None,
                     _collate_fn=None) -> Iterator[Any]:
        """Batches of ``batch_size`` rows (``None``: one per block) in ``batch_format``.
        A background thread fetches up to ``prefetch_batches`` blocks ahead of the
        consumer (0: none); ``local_shuffle_buffer_size`` draws each batch at random from
        a buffer of at least that many rows.

        Raises:
            ValueError: a bad batch size, format or prefetch count.
        """
        return self.iterator().iter_batches(
            prefetch_batches=prefetch_batches, batch_size=batch_size, batch_format=batch_format,
            drop_last=drop_last, local_shuffle_buffer_size=local_shuffle_buffer_size,
            local_shuffle_seed=local_shuffle_seed, _collate_fn=_collate_fn)

    def iter_torch_batches(self, *, prefetch_batches: int = 1, batch_size: Optional[int] = 256,
                           dtypes=None, device: str = "auto", collate_fn=None,
                           drop_last: bool = False,
                           local_shuffle_buffer_size: Optional[int] = None,
                           local_shuffle_seed: Optional[int] = None) -> Iterator[Any]:
        """Batches as dicts of ``torch.Tensor`` on ``device`` (``"auto"``: the CPU in a
        driver, as Ray's outside a Train worker), cast to ``dtypes`` (one ``torch.dtype``
        for every column or a dict per column); ``collate_fn(numpy_batch)`` replaces the
        conversion."""
        return self.iterator().iter_torch_batches(
            prefetch_batches=prefetch_batches, batch_size=batch_size, dtypes=dtypes,
            device=device, collate_fn=collate_fn, drop_last=drop_last,
            local_shuffle_buffer_size=local_shuffle_buffer_size,
            local_shuffle_seed=local_shuffle_seed)

    def iter_rows(self) -> Iterator[dict]:
        for block in self._blocks(1):
            yield from B.rows(block)

    def take(self, limit: int = 20) -> list[dict]:
        """The first ``limit`` rows as dicts (stops the pipeline once they are there)."""
        return list(B.rows(B.concat([tpuray.get(r) for r, _ in self.limit(limit)._execute()])))

    def take_all(self, limit: Optional[int] = None) -> list[dict]:
        """Every row as a dict.

        Raises:
            ValueError: more than ``limit`` rows.
        """
        out = []
        for block in self._blocks(1):
            out.extend(B.rows(block))
            if limit is not None and len(out) > limit:
                raise ValueError(f"The dataset has more than the given limit of {limit} records.")
        return out

    def take_batch(self, batch_size: int = 20, *, batch_format: Optional[str] = "default"):
        """The first ``batch_size`` rows as one batch in ``batch_format``."""
        B.check_batch_format(batch_format)
        block = B.concat([tpuray.get(r) for r, _ in self.limit(batch_size)._execute()])
        return B.to_format(block, batch_format)

    def count(self) -> int:
        """Rows in the dataset (runs the pipeline; blocks are not fetched)."""
        if not self._ops and self._source.blocks:
            return sum(m.num_rows for _, m in self._source.blocks)
        return sum(meta.num_rows for _, meta in self._execute())

    def schema(self) -> Optional[Schema]:
        """Column names and (pyarrow) types, from the first non-empty block."""
        for ref, meta in self.limit(1)._execute():
            if meta.num_rows:
                t = B.to_arrow(tpuray.get(ref))
                return Schema(t.column_names, [f.type for f in t.schema])
        return None

    def columns(self, fetch_if_missing: bool = True) -> Optional[list]:
        known = self._known_columns()
        if known is not None:
            return known
        s = self.schema()
        return s.names if s is not None else None

    def show(self, limit: int = 20) -> None:
        for row in self.take(limit):
            print(row)

    def materialize(self) -> "MaterializedDataset":
        """Runs the pipeline and keeps its blocks in the object store."""
        blocks = list(self._execute())
        out = MaterializedDataset(PhysicalOp(name="Materialized", kind="source", blocks=blocks))
        out._last_executor = self._last_executor
        return out

    def num_blocks(self) -> int:
        return self._num_source_blocks() if not self._ops else len(self.materialize()._source.blocks)

    def size_bytes(self) -> int:
        """Approximate bytes of the dataset's blocks."""
        return sum(m.size_bytes for _, m in self._execute())

    def to_pandas(self, limit: Optional[int] = None):
        """Every row in one pandas DataFrame (in the driver).

        Raises:
            ValueError: more than ``limit`` rows.
        """
        import pandas as pd

        blocks = [tpuray.get(r) for r, _ in self._execute()]
        block = B.concat(blocks)
        if limit is not None and B.num_rows(block) > limit:
            raise ValueError(f"the dataset has more than the given limit of {limit} rows")
        return B.to_pandas(block) if block else pd.DataFrame()

    def to_arrow_refs(self) -> list:
        """One ``ObjectRef`` to a ``pyarrow.Table`` per block (converted by tasks)."""
        return [_to_arrow_remote.remote(r) for r, _ in self._execute()]

    def to_pandas_refs(self) -> list:
        """One ``ObjectRef`` to a ``pandas.DataFrame`` per block."""
        return [_to_pandas_remote.remote(r) for r, _ in self._execute()]

    def to_numpy_refs(self, *, column: Optional[str] = None) -> list:
        """One ``ObjectRef`` per block: its dict of arrays, or the array of ``column``."""
        return [_to_numpy_remote.remote(r, column) for r, _ in self._execute()]

    def stats(self) -> str:
        """What the last execution did, per operator: blocks, rows, bytes, seconds."""
        ex = getattr(self, "_last_executor", None)
        if ex is None:
            return "Dataset has not been executed yet (no stats)."
        lines = []
        for i, (name, blocks, rows, nbytes, secs) in enumerate(ex.op_stats):
            lines.append(f"Operator {i} {name}: {blocks} blocks produced in {secs:.3f}s, "
                         f"{rows} rows, {nbytes} bytes")
        lines.append(f"Peak bytes held in the object store: {ex.peak_bytes}")
        return "\n".join(lines)

    # ---- writing ----

    def _write(self, what: str, path: str, ext: str, write_one: Callable, filesystem,
               try_create_dir: bool, ray_remote_args, concurrency, unsupported: dict) -> None:
        from tpuray.data import _io

        for k, v in unsupported.items():
            if v is not None:
                raise ValueError(f"{what}: the option {k!r} is not supported by tpuray.data")
        fs, base = _io.resolve_dir(path, filesystem)
        if try_create_dir:
            fs.create_dir(base, recursive=True)
        prefix = uuid.uuid4().hex[:16]

        def write(block, _fs=fs, _base=base):
            if B.num_rows(block) == 0:
                return {}
            name = f"{_base}/{prefix}_{uuid.uuid4().hex[:12]}.{ext}"
            write_one(block, _fs, name)
            return {}

        remote = _remote_args(what, None, None, None, dict(ray_remote_args or {}))
        ds = self._with(_Logical("task", f"Write[{what}]", fn=write, args=remote,
                                 max_concurrency=concurrency))
        for _ in ds._execute():
            pass

    def write_parquet(self, path: str, *, partition_cols=None, filesystem=None,
                      try_create_dir: bool = True, arrow_open_stream_args=None,
                      filename_provider=None, arrow_parquet_args_fn=None,
                      min_rows_per_file=None, max_rows_per_file=None, ray_remote_args=None,
                      concurrency=None, num_rows_per_file=None, mode=None,
                      **arrow_parquet_args) -> None:
        """One Parquet file per block under the folder ``path`` (local, ``file://``,
        ``s3://``, ``gs://`` through ``pyarrow.fs``), written by tasks;
        ``arrow_parquet_args`` go to ``pyarrow.parquet.write_table``."""
        open_args = dict(arrow_open_stream_args or {})

        def write_one(block, fs, name):
            import pyarrow.parquet as pq

            args = dict(arrow_parquet_args)
            if arrow_parquet_args_fn is not None:
                args.update(arrow_parquet_args_fn())
            with fs.open_output_stream(name, **open_args) as f:
                pq.write_table(B.to_arrow(block), f, **args)

        self._write("write_parquet", path, "parquet", write_one, filesystem, try_create_dir,
                    ray_remote_args, concurrency, dict(partition_cols=partition_cols,
                    filename_provider=filename_provider, min_rows_per_file=min_rows_per_file,
                    max_rows_per_file=max_rows_per_file, num_rows_per_file=num_rows_per_file,
                    mode=mode))

    def write_csv(self, path: str, *, filesystem=None, try_create_dir: bool = True,
                  arrow_open_stream_args=None, filename_provider=None,
                  arrow_csv_args_fn=None, min_rows_per_file=None, ray_remote_args=None,
                  concurrency=None, num_rows_per_file=None, mode=None,
                  **arrow_csv_args) -> None:
        """One CSV file (with a header line) per block under the folder ``path``."""
        open_args = dict(arrow_open_stream_args or {})

        def write_one(block, fs, name):
            import pyarrow.csv as pcsv

            args = dict(arrow_csv_args)
            if arrow_csv_args_fn is not None:
                args.update(arrow_csv_args_fn())
            with fs.open_output_stream(name, **open_args) as f:
                pcsv.write_csv(B.to_arrow(block), f, **args)

        self._write("write_csv", path, "csv", write_one, filesystem, try_create_dir,
                    ray_remote_args, concurrency, dict(filename_provider=filename_provider,
                    min_rows_per_file=min_rows_per_file, num_rows_per_file=num_rows_per_file,
                    mode=mode))

    def write_json(self, path: str, *, filesystem=None, try_create_dir: bool = True,
                   arrow_open_stream_args=None, filename_provider=None,
                   pandas_json_args_fn=None, min_rows_per_file=None, ray_remote_args=None,
                   concurrency=None, num_rows_per_file=None, mode=None,
                   **pandas_json_args) -> None:
        """One JSON-lines file per block under the folder ``path`` (pandas ``to_json``
        with ``orient="records", lines=True`` unless ``pandas_json_args`` say otherwise)."""
        open_args = dict(arrow_open_stream_args or {})

        def write_one(block, fs, name):
            args = {"orient": "records", "lines": True, **pandas_json_args}
            if pandas_json_args_fn is not None:
                args.update(pandas_json_args_fn())
            text = B.to_pandas(block).to_json(**args)
            with fs.open_output_stream(name, **open_args) as f:
                f.write(text.encode("utf-8"))

        self._write("write_json", path, "json", write_one, filesystem, try_create_dir,
                    ray_remote_args, concurrency, dict(filename_provider=filename_provider,
                    min_rows_per_file=min_rows_per_file, num_rows_per_file=num_rows_per_file,
                    mode=mode))

    def write_numpy(self, path: str, *, column: str, filesystem=None,
                    try_create_dir: bool = True, arrow_open_stream_args=None,
                    filename_provider=None, min_rows_per_file=None, ray_remote_args=None,
                    concurrency=None, num_rows_per_file=None, mode=None) -> None:
        """One ``.npy`` file per block of column ``column`` under the folder ``path``.

        Raises:
            ValueError: (inside ``RayTaskError``) a column the dataset lacks.
        """
        open_args = dict(arrow_open_stream_args or {})

        def write_one(block, fs, name):
            import io

            import numpy as np

            if column not in block:
                raise ValueError(f"write_numpy: column {column!r} is not in the dataset's columns {list(block)}")
            buf = io.BytesIO()
            np.save(buf, block[column])
            with fs.open_output_stream(name, **open_args) as f:
                f.write(buf.getvalue())

        self._write("write_numpy", path, "npy", write_one, filesystem, try_create_dir,
                    ray_remote_args, concurrency, dict(filename_provider=filename_provider,
                    min_rows_per_file=min_rows_per_file, num_rows_per_file=num_rows_per_file,
                    mode=mode))

    def __repr__(self) -> str:
        """As Ray 2.60 prints a dataset, without running it: a table of the schema (and, once
        materialized, of the first and last rows) when the schema is known, else the plan
        over the source's ``Dataset(num_rows=..., schema=...)`` (see ``tpuray.data._repr``)."""
        from tpuray.data._repr import dataset_repr

        return dataset_repr(self)


class MaterializedDataset(Dataset):
    """A dataset whose blocks are already in the object store (Ray's
    ``MaterializedDataset``): what ``materialize``, ``split`` and friends return."""



def _identity(block):
    return block


def _sorted_by(keys):
    def finish(block):
        if B.num_rows(block) < 2:
            return block
        return B.take_indices(block, B.sort_indices(block, keys, [False] * len(keys)))

    return finish


@tpuray.remote
def _to_arrow_remote(block):
    return B.to_arrow(block)


@tpuray.remote
def _to_pandas_remote(block):
    return B.to_pandas(block)


@tpuray.remote
def _to_numpy_remote(block, column):
    if column is None:
        return block
    if column not in block:
        raise ValueError(f"column {column!r} is not in the dataset's columns {list(block)}")
    return block[column]


@tpuray.remote(num_returns=2)
def _zip_blocks(counts, left, *pieces):
    out = dict(left)
    i = 0
    for k, c in enumerate(counts, start=1):
        right = B.concat(list(pieces[i:i + c]))
        i += c
        for name, col in right.items():
            new = name
            if new in out:
                new = f"{name}_{k}"
            out[new] = col
    from tpuray.data._executor import _meta

    return out, _meta(out)


def _cut_like(blocks: list, row_counts: list) -> list:
    """The rows of ``blocks`` cut into pieces lined up with ``row_counts``: for output
    ``i``, a list of block refs (slices made by tasks) holding exactly its rows."""
    from tpuray.data._executor import _split

    bounds = [0]
    for c in row_counts:
        bounds.append(bounds[-1] + c)
    per_output: list[list] = [[] for _ in row_counts]
    offset = 0
    for ref, m in blocks:
        ranges = []
        for j in range(len(row_counts)):
            lo, hi = max(bounds[j], offset), min(bounds[j + 1], offset + m.num_rows)
            if lo < hi:
                ranges.append((j, lo - offset, hi - offset))
        offset += m.num_rows
        if not ranges:
            continue
        if len(ranges) == 1 and ranges[0][1] == 0 and ranges[0][2] == m.num_rows:
            per_output[ranges[0][0]].append(ref)
            continue
        sp = _split(ref, "repartition", ranges, len(ranges))
        for k, (j, _, _) in enumerate(ranges):
            per_output[j].append(sp[k])
    return per_output


def _split_rows(blocks: list, indices: list) -> list:
    """Materialized datasets of the rows between consecutive ``indices`` (clamped to the
    row count), cutting blocks with slice tasks where an index falls inside one."""
    from tpuray.data._executor import _meta_remote

    total = sum(m.num_rows for _, m in blocks)
    cuts = [min(max(0, i), total) for i in indices]
    edges = [0] + cuts + [total]
    counts = [edges[i + 1] - edges[i] for i in range(len(edges) - 1)]
    pieces = _cut_like(blocks, counts)
    out = []
    for refs in pieces:
        metas = tpuray.get([_meta_remote.remote(r) for r in refs]) if refs else []
        out.append(MaterializedDataset(PhysicalOp(name="Split", kind="source",
                                                  blocks=list(zip(refs, metas)))))
    return out


def _prefetched(bundles: Iterator[tuple], prefetch: int) -> Iterator[dict]:
    """The blocks of ``(ref, meta)`` pairs, fetched by a background thread up to
    ``prefetch`` blocks ahead of the consumer (``prefetch`` <= 0: fetched in line)."""
    if prefetch is None or prefetch <= 0:
        for ref, _ in bundles:
            yield tpuray.get(ref)
        return
    q: queue.Queue = queue.Queue(maxsize=prefetch)
    stop = threading.Event()

    def put(item) -> bool:
        while not stop.is_set():
            try:
                q.put(item, timeout=0.1)
                return True
            except queue.Full:
                continue
        return False

    def produce():
        try:
            for ref, _ in bundles:
                if not put(("block", tpuray.get(ref))):
                    break
            put(("end", None))
        except BaseException as e:  # handed to the consumer
            put(("error", e))
        finally:
            try:
                bundles.close()
            except Exception:
                pass

    t = threading.Thread(target=produce, name="tpuray-data-prefetch", daemon=True)
    t.start()
    try:
        while True:
            kind, value = q.get()
            if kind == "block":
                yield value
            elif kind == "error":
                raise value
            else:
                return
    finally:
        stop.set()


def _rebatch(blocks, batch_size, batch_format, drop_last, shuffle_buffer=None,
             shuffle_seed=None):
    """Batches of ``batch_size`` rows from ``blocks`` (``None``: one per block) in
    ``batch_format``; with ``shuffle_buffer``, each batch is drawn at random from a buffer
    holding at least that many rows (Ray's local shuffle)."""
    import numpy as np

    if shuffle_buffer:
        if batch_size is None:
            raise ValueError("local_shuffle_buffer_size needs a batch_size")
        rng = np.random.default_rng(shuffle_seed)
        buf: dict = {}
        for block in blocks:
            if B.num_rows(block) == 0:
                continue
            buf = B.concat([buf, block]) if buf else block
            while B.num_rows(buf) >= shuffle_buffer + batch_size:
                buf = B.take_indices(buf, rng.permutation(B.num_rows(buf)))
                yield B.to_format(B.slice_block(buf, 0, batch_size), batch_format)
                buf = B.slice_block(buf, batch_size, B.num_rows(buf))
        if buf:
            buf = B.take_indices(buf, rng.permutation(B.num_rows(buf)))
        n = B.num_rows(buf)
        for start in range(0, n, batch_size):
            if drop_last and start + batch_size > n:
                break
            yield B.to_format(B.slice_block(buf, start, min(n, start + batch_size)), batch_format)
        return
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


def _name(fn) -> str:
    return getattr(fn, "__name__", type(fn).__name__)
