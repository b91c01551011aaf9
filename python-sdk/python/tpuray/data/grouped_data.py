"""``GroupedData``: what ``Dataset.groupby`` returns (Ray Data's ``GroupedData``).

Every aggregation is a hash-partitioned shuffle through the object store: map tasks cut
each block by the hash of its key values into ``num_partitions`` parts, and one reduce
task per partition joins its parts (every row of a key is in one partition) and
aggregates each group. Output columns: the key columns, then one per aggregation named as
Ray names them (``count()``, ``sum(x)``, ``mean(x)``, ...). Output rows come key-sorted
within each partition; partitions are in hash order (as in Ray, sort afterwards for a
global order).
"""

from __future__ import annotations

from typing import Callable, List, Optional, Union

from tpuray.data import aggregate as A
from tpuray.data import block as B


def _group_indices(block: dict, keys: list) -> list:
    """``[(key, row indices)]`` of every group of ``block`` by ``keys``, keys sorted;
    ``key`` is a value for one key column, a tuple for several."""
    import pandas as pd

    n = B.num_rows(block)
    if n == 0:
        return []
    if not keys:
        import numpy as np

        return [(None, np.arange(n))]
    df = pd.DataFrame({f"k{i}": block[k] for i, k in enumerate(keys)})
    groups = df.groupby([f"k{i}" for i in range(len(keys))], sort=True, dropna=False).indices
    out = []
    for key, idx in groups.items():
        if len(keys) == 1 and isinstance(key, tuple) and len(key) == 1:
            key = key[0]
        out.append((B._py(key) if not isinstance(key, tuple) else tuple(B._py(k) for k in key), idx))
    return out


_VECTORIZED = (A.Count, A.Sum, A.Min, A.Max, A.Mean, A.Std)


def _vectorized(block: dict, keys: list, aggs: list) -> Optional[dict]:
    """``GroupedData.aggregate``'s result computed by one pandas ``groupby`` (no Python
    loop over groups), or ``None`` when an aggregation needs the general path: a
    user-defined one, ``ignore_nulls=False`` on a value aggregation, or a column of
    objects or tensors."""
    import numpy as np
    import pandas as pd

    if not keys:
        return None
    for a in aggs:
        if type(a) not in _VECTORIZED:
            return None
        if a.on is not None:
            col = block[a.on]
            if col.dtype == object or col.ndim > 1 or col.dtype.kind not in "biuf":
                return None
            if type(a) is not A.Count and not a.ignore_nulls:
                return None
    kcols = [f"k{i}" for i in range(len(keys))]
    frame = {c: block[k] for c, k in zip(kcols, keys)}
    for j, a in enumerate(aggs):
        if a.on is not None:
            frame[f"v{j}"] = block[a.on]
    g = pd.DataFrame(frame).groupby(kcols, sort=True, dropna=False)
    results = []
    for j, a in enumerate(aggs):
        v = f"v{j}"
        t = type(a)
        if t is A.Count:
            r = g.size() if a.on is None or not a.ignore_nulls else g[v].count()
        elif t is A.Sum:
            r = g[v].sum(min_count=1)
        elif t is A.Min:
            r = g[v].min()
        elif t is A.Max:
            r = g[v].max()
        elif t is A.Mean:
            r = g[v].mean()
        else:
            r = g[v].std(ddof=a.ddof)
        results.append(r)
    index = results[0].index
    out = {}
    for i, k in enumerate(keys):
        level = index.get_level_values(i) if len(keys) > 1 else index
        out[k] = B._as_column(level.to_numpy())
    for a, r in zip(aggs, results):
        col = r.to_numpy()
        if col.dtype == object:
            col = np.asarray(col.tolist())
        out[a.name] = col
    return out


def _aggregate_groups(keys: list, aggs: list) -> Callable:
    """The reduce step of ``GroupedData.aggregate``: a block -> one row per group."""

    def finish(block):
        if B.num_rows(block) == 0:
            return {}
        fast = _vectorized(block, keys, aggs)
        if fast is not None:
            return fast
        groups = _group_indices(block, keys)
        if not groups:
            return {}
        rows = []
        for key, idx in groups:
            sub = B.take_indices(block, idx)
            row = {}
            kv = key if isinstance(key, tuple) else (key,)
            for k, v in zip(keys, kv):
                row[k] = sub[k][0]
            for a in aggs:
                row[a.name] = a.finalize(a.accumulate_block(a.init(key), sub))
            rows.append(row)
        return B.from_rows(rows)

    return finish


def _sort_groups(keys: list) -> Callable:
    """The reduce step of ``map_groups``: the partition sorted by the keys, so each
    group's rows are contiguous for the map step."""

    def finish(block):
        if B.num_rows(block) < 2 or not keys:
            return block
        return B.take_indices(block, B.sort_indices(block, keys, [False] * len(keys)))

    return finish


class GroupedData:
    """Rows of a dataset grouped by ``key`` (a column, several, or ``None``: one group)."""

    def __init__(self, dataset, key: Union[str, List[str], None], num_partitions: Optional[int]):
        if key is not None and not isinstance(key, (str, list, tuple)):
            raise TypeError(f"groupby key must be a column name, a list of them or None, got {key!r}")
        self._ds = dataset
        self._keys = [] if key is None else ([key] if isinstance(key, str) else list(key))
        self._num_partitions = num_partitions

    def _shuffled(self, finish: Callable, name: str):
        from tpuray.data.dataset import _Logical

        n = 1 if not self._keys else self._num_partitions
        return self._ds._with(_Logical(
            "all_to_all", name, how=("groupby", n, (list(self._keys), finish))))

    def aggregate(self, *aggs):
        """One row per group with the key columns and each aggregation's column.

        Raises:
            ValueError: no aggregation; at execution, a key or aggregated column the
                dataset lacks (naming it).
        """
        if not aggs:
            raise ValueError("aggregate needs at least one aggregation")
        aggs = list(aggs)
        keys = list(self._keys)

        def finish(block, _f=_aggregate_groups(keys, aggs)):
            if B.num_rows(block):
                A.check_columns(aggs, block.keys())
            return _f(block)

        return self._shuffled(finish, f"Aggregate({', '.join(a.name for a in aggs)})")

    def _each(self, cls, on, ignore_nulls, **kw):
        if on is None:
            raise ValueError(f"{cls.__name__.lower()}() on a grouped dataset needs on= (a column or a list)")
        names = [on] if isinstance(on, str) else list(on)
        return self.aggregate(*[cls(c, ignore_nulls=ignore_nulls, **kw) for c in names])

    def count(self):
        """Rows per group, column ``count()``."""
        return self.aggregate(A.Count())

    def sum(self, on: Union[str, List[str], None] = None, ignore_nulls: bool = True):
        return self._each(A.Sum, on, ignore_nulls)

    def min(self, on: Union[str, List[str], None] = None, ignore_nulls: bool = True):
        return self._each(A.Min, on, ignore_nulls)

    def max(self, on: Union[str, List[str], None] = None, ignore_nulls: bool = True):
        return self._each(A.Max, on, ignore_nulls)

    def mean(self, on: Union[str, List[str], None] = None, ignore_nulls: bool = True):
        return self._each(A.Mean, on, ignore_nulls)

    def std(self, on: Union[str, List[str], None] = None, ddof: int = 1,
            ignore_nulls: bool = True):
        """Standard deviation per group with ``ddof`` (Ray's default 1)."""
        return self._each(A.Std, on, ignore_nulls, ddof=ddof)

    def map_groups(self, fn, *, compute=None, batch_format: Optional[str] = "default",
                   fn_args=None, fn_kwargs=None, fn_constructor_args=None,
                   fn_constructor_kwargs=None, num_cpus=None, num_gpus=None, memory=None,
                   concurrency=None, **ray_remote_args):
        """Applies ``fn`` to each group's rows as one batch in ``batch_format``; ``fn``
        returns a batch (its rows become the output). After the hash shuffle each
        partition is sorted by the keys, then a map step (tasks, or an actor pool for a
        callable class, as ``map_batches``) calls ``fn`` once per group."""
        B.check_batch_format(batch_format)
        keys = list(self._keys)
        ds = self._shuffled(_sort_groups(keys), "MapGroups[shuffle]")

        def make(f, a, k):
            from tpuray.data.dataset import _batch_outputs, _call_udf

            def per_group(block):
                outs = []
                for _, idx in _group_indices(block, keys):
                    sub = B.take_indices(block, idx)
                    outs.extend(_batch_outputs(_call_udf(f, B.to_format(sub, batch_format),
                                                         *a, **k)))
                return B.concat(outs)

            return per_group

        from tpuray.data.dataset import _remote_args

        remote = _remote_args("map_groups", num_cpus, num_gpus, memory, ray_remote_args)
        return ds._udf_op("MapGroups", fn, make, compute=compute, concurrency=concurrency,
                          fn_args=fn_args, fn_kwargs=fn_kwargs,
                          fn_constructor_args=fn_constructor_args,
                          fn_constructor_kwargs=fn_constructor_kwargs, remote_args=remote)
