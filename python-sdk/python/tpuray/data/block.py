"""Blocks: the unit of data that moves through the object store.

A block is a ``dict`` of column name to a 1-D-or-more ``numpy.ndarray``, all with the same
length along axis 0 (rows). Rows are ``dict``s of one value per column. Values that numpy
cannot hold natively (strings of any length, bytes, dicts, ...) sit in ``object`` arrays.
pandas and pyarrow do the conversions (``to_format``, ``from_batch``, ``to_arrow``,
``from_arrow``).
"""

from __future__ import annotations

from typing import Any, Iterable

import numpy as np

Block = dict


def num_rows(block: Block) -> int:
    """Rows in ``block`` (0 for a block without columns)."""
    for v in block.values():
        return len(v)
    return 0


def size_bytes(block: Block) -> int:
    """Approximate bytes of ``block`` (numpy buffers; object columns estimated)."""
    total = 0
    for v in block.values():
        if v.dtype == object:
            total += 64 * len(v)
        else:
            total += v.nbytes
    return total


def _column(values: list) -> np.ndarray:
    try:
        arr = np.asarray(values)
        if arr.dtype.kind in "USV" or (arr.ndim > 1 and arr.dtype == object):
            raise ValueError
        return arr
    except (ValueError, TypeError):
        out = np.empty(len(values), dtype=object)
        for i, v in enumerate(values):
            out[i] = v
        return out


def _as_column(v) -> np.ndarray:
    """A column from an array-like: numpy arrays kept (strings as objects), tensors and
    pandas/arrow columns converted."""
    if isinstance(v, np.ndarray):
        if v.dtype.kind in "US":
            return v.astype(object)
        return v
    if hasattr(v, "to_numpy") and not isinstance(v, (list, tuple)):
        try:
            return _as_column(v.to_numpy(zero_copy_only=False))  # pyarrow
        except TypeError:
            return _as_column(v.to_numpy())  # pandas
    if hasattr(v, "detach") and hasattr(v, "cpu"):  # torch.Tensor
        return v.detach().cpu().numpy()
    return _column(list(v))


def from_rows(rows: Iterable[Any]) -> Block:
    """A block from rows: ``dict`` rows give their keys as columns; any other value becomes
    the column ``"item"`` (Ray Data's name for items without a schema).

    Raises:
        ValueError: ``dict`` rows with different keys.
    """
    rows = [r if isinstance(r, dict) else {"item": r} for r in rows]
    if not rows:
        return {}
    keys = list(rows[0].keys())
    for r in rows:
        if list(r.keys()) != keys and set(r.keys()) != set(keys):
            raise ValueError(f"rows have different columns: {sorted(keys)} and {sorted(r.keys())}")
    return {k: _column([r[k] for r in rows]) for k in keys}


def from_batch(batch: Any) -> Block:
    """A block from what a ``map_batches`` function returned: a dict of arrays/lists, a
    pandas DataFrame, a pyarrow Table, or a list of rows.

    Raises:
        ValueError: anything else (naming what was expected), or columns of different
            lengths (Ray raises ``ValueError`` for both).
    """
    if isinstance(batch, dict):
        block = {str(k): _as_column(v) for k, v in batch.items()}
        lengths = {k: len(v) for k, v in block.items()}
        if len(set(lengths.values())) > 1:
            raise ValueError(f"batch columns have different lengths: {lengths}")
        return block
    if _is_arrow_table(batch):
        return from_arrow(batch)
    if hasattr(batch, "to_dict") and hasattr(batch, "columns"):  # pandas.DataFrame
        return from_pandas(batch)
    if isinstance(batch, list):
        return from_rows(batch)
    raise ValueError(
        f"The `fn` you passed to `map_batches` returned a value of type {type(batch)}; "
        f"expected a dict of column name to array, a pandas.DataFrame or a pyarrow.Table"
    )


def _is_arrow_table(x) -> bool:
    mod = type(x).__module__ or ""
    return mod.startswith("pyarrow") and hasattr(x, "column_names") and hasattr(x, "num_rows")


def from_pandas(df) -> Block:
    """A block from a pandas DataFrame (its index is dropped, as in Ray)."""
    return {str(c): _as_column(df[c].to_numpy()) for c in df.columns}


def from_arrow(table) -> Block:
    """A block from a pyarrow Table (or RecordBatch): strings and nested values become
    object columns, fixed-shape tensors numpy arrays of their shape."""
    out = {}
    for name in table.column_names:
        col = table.column(name)
        if hasattr(col, "combine_chunks"):
            col = col.combine_chunks()
        if hasattr(col, "to_numpy_ndarray"):  # FixedShapeTensorArray
            out[name] = col.to_numpy_ndarray()
            continue
        arr = col.to_numpy(zero_copy_only=False)
        if arr.dtype == object and len(arr) and all(isinstance(x, np.ndarray) for x in arr):
            try:
                arr = np.stack(arr)
            except ValueError:
                pass
        out[name] = arr
    return out


def to_arrow(block: Block):
    """``block`` as a pyarrow Table (tensor columns become pyarrow fixed-shape tensors)."""
    import pyarrow as pa

    arrays, names = [], []
    for k, v in block.items():
        names.append(k)
        if v.ndim > 1:
            arrays.append(pa.FixedShapeTensorArray.from_numpy_ndarray(np.ascontiguousarray(v)))
        elif v.dtype == object:
            arrays.append(pa.array(list(v)))
        else:
            arrays.append(pa.array(v))
    return pa.Table.from_arrays(arrays, names=names)


def to_pandas(block: Block):
    import pandas as pd

    return pd.DataFrame({k: list(v) if v.ndim > 1 else v for k, v in block.items()})


def rows(block: Block):
    """The rows of ``block`` as dicts (numpy scalars turned into Python values)."""
    keys = list(block.keys())
    cols = [block[k] for k in keys]
    plain = [c.tolist() if c.ndim == 1 and c.dtype != object else None for c in cols]
    for i in range(num_rows(block)):
        yield {k: (p[i] if p is not None else _py(c[i])) for k, c, p in zip(keys, cols, plain)}


def _py(v):
    return v.item() if isinstance(v, np.generic) else v


def slice_block(block: Block, start: int, end: int) -> Block:
    return {k: v[start:end] for k, v in block.items()}


def concat(blocks: list[Block]) -> Block:
    """Joins blocks with the same columns, in order.

    Raises:
        ValueError: blocks whose columns differ (naming both sets).
    """
    blocks = [b for b in blocks if num_rows(b) > 0]
    if not blocks:
        return {}
    if len(blocks) == 1:
        return blocks[0]
    keys = list(blocks[0].keys())
    for b in blocks[1:]:
        if set(b.keys()) != set(keys):
            raise ValueError(f"cannot join blocks with columns {keys} and {list(b.keys())}")
    out = {}
    for k in keys:
        parts = [b[k] for b in blocks]
        if any(p.dtype == object for p in parts) and not all(p.dtype == object for p in parts):
            parts = [p.astype(object) for p in parts]
        try:
            out[k] = np.concatenate(parts)
        except ValueError:  # tensors of different shapes: one object per row
            rows_ = [r for p in parts for r in p]
            col = np.empty(len(rows_), dtype=object)
            for i, r in enumerate(rows_):
                col[i] = r
            out[k] = col
    return out


def take_indices(block: Block, idx: np.ndarray) -> Block:
    return {k: v[idx] for k, v in block.items()}


BATCH_FORMATS = ("default", "numpy", "pandas", "pyarrow", None)


def to_format(block: Block, batch_format: str | None):
    """``block`` as a batch in ``batch_format``: ``"numpy"``/``"default"`` (dict of arrays),
    ``"pandas"`` (DataFrame), ``"pyarrow"`` (Table; ``None``, Ray's "native format", is
    pyarrow too), ``"torch"`` (dict of tensors; object columns stay arrays).

    Raises:
        ValueError: an unknown format, naming the ones there are.
    """
    if batch_format in ("numpy", "default"):
        return block
    if batch_format == "pandas":
        return to_pandas(block)
    if batch_format in ("pyarrow", None):
        return to_arrow(block)
    if batch_format == "torch":
        import torch

        return {k: (torch.as_tensor(v) if v.dtype != object else v) for k, v in block.items()}
    raise ValueError(
        f"The given batch format {batch_format!r} isn't allowed (must be one of "
        f"'default', 'numpy', 'pandas', 'pyarrow' or None)"
    )


def check_batch_format(batch_format) -> None:
    """Raises ``ValueError`` for a ``batch_format`` Ray does not know."""
    if batch_format not in BATCH_FORMATS:
        to_format({}, batch_format)


def check_columns(block: Block, cols, what: str) -> None:
    """Raises ``ValueError`` naming the columns of ``cols`` that ``block`` lacks."""
    missing = [c for c in cols if c not in block]
    if missing and num_rows(block):
        raise ValueError(f"{what}: column(s) {missing} not in the dataset's columns {list(block)}")


def sort_indices(block: Block, keys: list, descending: list) -> np.ndarray:
    """The row order that sorts ``block`` by ``keys`` (each ascending or descending),
    stable (pandas does the comparison, so strings and mixed numbers sort too)."""
    import pandas as pd

    n = num_rows(block)
    if n == 0:
        return np.arange(0)
    df = pd.DataFrame({f"k{i}": block[k] for i, k in enumerate(keys)})
    df = df.sort_values([f"k{i}" for i in range(len(keys))], ascending=[not d for d in descending],
                        kind="stable")
    return df.index.to_numpy()


def hash_partition(block: Block, keys: list, parts: int) -> np.ndarray:
    """For every row the partition (``0..parts-1``) its key values hash to; the hash
    (pandas' ``hash_pandas_object``) is the same in every process."""
    import pandas as pd

    n = num_rows(block)
    if n == 0 or parts == 1:
        return np.zeros(n, dtype=np.int64)
    df = pd.DataFrame({k: block[k] for k in keys})
    h = pd.util.hash_pandas_object(df, index=False).to_numpy()
    return (h % np.uint64(parts)).astype(np.int64)
