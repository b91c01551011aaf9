"""Aggregations (Ray Data's ``ray.data.aggregate``): ``Count``, ``Sum``, ``Min``, ``Max``,
``Mean``, ``Std``, ``AbsMax``, ``Unique`` and the general ``AggregateFn``.

Each aggregation works in three steps, so a dataset-wide aggregate runs one small task per
block and merges only the partial results in the driver: ``accumulate_block(acc, block)``
folds a block (a dict of numpy arrays) into an accumulator, ``merge(a, b)`` joins two, and
``finalize(acc)`` gives the value. Output columns are named as in Ray: ``count()``,
``sum(x)``, ``mean(x)``, ... or ``alias_name`` when given.
"""

from __future__ import annotations

from typing import Any, Callable, Optional, cast

import numpy as np


class AggregateFn:
    """A user-defined aggregation (Ray's ``AggregateFn``).

    Args:
        init: ``init(key) -> accumulator`` (``key`` is the group's key, ``None`` for a
            dataset-wide aggregate).
        merge: ``merge(a, b) -> accumulator``.
        accumulate_row: ``accumulate_row(acc, row_dict) -> accumulator`` (one of this or
            ``accumulate_block`` is needed).
        accumulate_block: ``accumulate_block(acc, block) -> accumulator``; the block is a
            dict of numpy arrays.
        finalize: ``finalize(acc) -> value`` (default: the accumulator itself).
        name: the output column (required).

    Raises:
        ValueError: neither or both of ``accumulate_row``/``accumulate_block``, or no name.
    """

    def __init__(self, init: Callable, merge: Callable, accumulate_row: Optional[Callable] = None,
                 accumulate_block: Optional[Callable] = None, finalize: Optional[Callable] = None,
                 name: Optional[str] = None):
        if (accumulate_row is None) == (accumulate_block is None):
            raise ValueError("Exactly one of accumulate_row or accumulate_block must be provided.")
        if not name:
            raise ValueError("AggregateFn needs a name (its output column)")
        self._init_fn = init
        self._merge_fn = merge
        self._row_fn = accumulate_row
        self._block_fn = accumulate_block
        self._finalize_fn = finalize
        self.name = name

    def columns(self) -> list:
        """The input columns this aggregation reads (checked before running)."""
        return []

    def init(self, key):
        return self._init_fn(key)

    def accumulate_block(self, acc, block: dict):
        if self._block_fn is not None:
            return self._block_fn(acc, block)
        from tpuray.data.block import rows

        # Exactly one of the two functions is set (checked in __init__).
        row_fn = cast(Callable, self._row_fn)
        for r in rows(block):
            acc = row_fn(acc, r)
        return acc

    def merge(self, a, b):
        return self._merge_fn(a, b)

    def finalize(self, acc):
        return self._finalize_fn(acc) if self._finalize_fn is not None else acc


def _values(block: dict, on: str, ignore_nulls: bool) -> np.ndarray:
    v = block[on]
    if ignore_nulls:
        if v.dtype == object:
            v = np.array([x for x in v if x is not None and not (isinstance(x, float) and x != x)],
                         dtype=object)
        elif v.dtype.kind == "f":
            v = v[~np.isnan(v)]
    return v


def _py(v):
    return v.item() if isinstance(v, np.generic) else v


class _Column(AggregateFn):
    """An aggregation of one column."""

    prefix = ""

    def __init__(self, on: Optional[str] = None, ignore_nulls: bool = True,
                 alias_name: Optional[str] = None):
        if on is not None and not isinstance(on, str):
            raise TypeError(f"{type(self).__name__}(on=...) takes a column name, got {on!r}")
        self.on = on
        self.ignore_nulls = ignore_nulls
        self.name = alias_name or f"{self.prefix}({on or ''})"

    def columns(self) -> list:
        return [self.on] if self.on else []

    def _need_on(self):
        if self.on is None:
            raise ValueError(f"{type(self).__name__} needs a column (on=...)")


class Count(_Column):
    """Rows (``on=None``) or non-null values of ``on`` (Ray's ``Count``); column ``count()``."""

    prefix = "count"

    def __init__(self, on: Optional[str] = None, ignore_nulls: bool = False,
                 alias_name: Optional[str] = None):
        super().__init__(on, ignore_nulls, alias_name)

    def init(self, key):
        return 0

    def accumulate_block(self, acc, block):
        if self.on is None:
            from tpuray.data.block import num_rows

            return acc + num_rows(block)
        return acc + len(_values(block, self.on, self.ignore_nulls))

    def merge(self, a, b):
        return a + b

    def finalize(self, acc):
        return int(acc)


class _Reduce(_Column):
    """An aggregation that reduces each block's values of ``on`` with ``_block`` and
    combines partial results with ``_combine``; ``None`` when there are no values."""

    _block: Callable = staticmethod(np.sum)
    _combine: Callable = staticmethod(lambda a, b: a + b)

    def init(self, key):
        self._need_on()
        return None

    def accumulate_block(self, acc, block):
        v = _values(block, self.on, self.ignore_nulls)
        if len(v) == 0:
            return acc
        r = self._block(v)
        return r if acc is None else self._combine(acc, r)

    def merge(self, a, b):
        return b if a is None else a if b is None else self._combine(a, b)

    def finalize(self, acc):
        return _py(acc)


class Sum(_Reduce):
    """Sum of ``on`` (Ray's ``Sum``); column ``sum(on)``; ``None`` when there are no values."""

    prefix = "sum"


class Min(_Reduce):
    """Smallest value of ``on`` (Ray's ``Min``); column ``min(on)``."""

    prefix = "min"
    _block = staticmethod(np.min)
    _combine = staticmethod(min)


class Max(_Reduce):
    """Largest value of ``on`` (Ray's ``Max``); column ``max(on)``."""

    prefix = "max"
    _block = staticmethod(np.max)
    _combine = staticmethod(max)


class AbsMax(_Reduce):
    """Largest absolute value of ``on`` (Ray's ``AbsMax``); column ``abs_max(on)``."""

    prefix = "abs_max"
    _block = staticmethod(lambda v: np.abs(v).max())
    _combine = staticmethod(max)


class Mean(_Column):
    """Mean of ``on`` (Ray's ``Mean``); column ``mean(on)``."""

    prefix = "mean"

    def init(self, key):
        self._need_on()
        return (0.0, 0)

    def accumulate_block(self, acc, block):
        v = _values(block, self.on, self.ignore_nulls)
        return (acc[0] + float(v.sum()) if len(v) else acc[0], acc[1] + len(v))

    def merge(self, a, b):
        return (a[0] + b[0], a[1] + b[1])

    def finalize(self, acc):
        return acc[0] / acc[1] if acc[1] else None


class Std(_Column):
    """Standard deviation of ``on`` with ``ddof`` (Ray's ``Std``, default ``ddof=1``);
    column ``std(on)``. Partial results merge with Chan et al.'s parallel algorithm."""

    prefix = "std"

    def __init__(self, on: Optional[str] = None, ddof: int = 1, ignore_nulls: bool = True,
                 alias_name: Optional[str] = None):
        super().__init__(on, ignore_nulls, alias_name)
        self.ddof = ddof

    def init(self, key):
        self._need_on()
        return (0, 0.0, 0.0)  # count, mean, M2

    def accumulate_block(self, acc, block):
        v = _values(block, self.on, self.ignore_nulls).astype(np.float64)
        if len(v) == 0:
            return acc
        part = (len(v), float(v.mean()), float(((v - v.mean()) ** 2).sum()))
        return self.merge(acc, part)

    def merge(self, a, b):
        na, ma, m2a = a
        nb, mb, m2b = b
        n = na + nb
        if n == 0:
            return (0, 0.0, 0.0)
        d = mb - ma
        return (n, ma + d * nb / n, m2a + m2b + d * d * na * nb / n)

    def finalize(self, acc):
        n, _, m2 = acc
        if n - self.ddof <= 0:
            return None
        return float(np.sqrt(m2 / (n - self.ddof)))


class Unique(_Column):
    """The distinct values of ``on`` (Ray's ``Unique``); column ``unique(on)``."""

    prefix = "unique"

    def __init__(self, on: Optional[str] = None, ignore_nulls: bool = False,
                 alias_name: Optional[str] = None):
        super().__init__(on, ignore_nulls, alias_name)

    def init(self, key):
        self._need_on()
        return set()

    def accumulate_block(self, acc, block):
        vals = _values(block, self.on, self.ignore_nulls)
        return acc | {_py(x) for x in vals}

    def merge(self, a, b):
        return a | b

    def finalize(self, acc):
        return list(acc)


def run_on_block(aggs: list, block: dict, key: Any = None) -> list:
    """Every aggregation's accumulator for ``block`` (the partial result of one block)."""
    return [a.accumulate_block(a.init(key), block) for a in aggs]


def check_columns(aggs: list, columns) -> None:
    """Raises ``ValueError`` naming an aggregation's column that is not in ``columns``."""
    columns = list(columns)
    for a in aggs:
        for c in a.columns():
            if c not in columns:
                raise ValueError(
                    f"{type(a).__name__}: column {c!r} is not in the dataset's columns {columns}"
                )


__all__ = ["AbsMax", "AggregateFn", "Count", "Max", "Mean", "Min", "Std", "Sum", "Unique"]
