"""Blocks: the unit of data that moves through the object store.

A block is a ``dict`` of column name to a 1-D-or-more ``numpy.ndarray``, all with the same
length along axis 0 (rows). Rows are ``dict``s of one value per column. Values that numpy
cannot hold natively (strings of any length, dicts, ...) sit in ``object`` arrays.
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
        if arr.dtype.kind in "US" or (arr.ndim > 1 and arr.dtype == object):
            raise ValueError
        return arr
    except (ValueError, TypeError):
        out = np.empty(len(values), dtype=object)
        for i, v in enumerate(values):
            out[i] = v
        return out


def from_rows(rows: Iterable[Any]) -> Block:
    """A block from rows: ``dict`` rows give their keys as columns; any other value becomes
    the column ``"item"`` (Ray Data's name for items without a schema).

    Raises:
        ValueError: ``dict`` rows with different keys.
    """
    rows = list(rows)
    if not rows:
        return {}
    if all(isinstance(r, dict) for r in rows):
        keys = list(rows[0].keys())
        for r in rows:
            if list(r.keys()) != keys and set(r.keys()) != set(keys):
                raise ValueError(f"rows have different columns: {sorted(keys)} and {sorted(r.keys())}")
        return {k: _column([r[k] for r in rows]) for k in keys}
    return {"item": _column(rows)}


def from_batch(batch: Any) -> Block:
    """A block from what a ``map_batches`` function returned: a dict of arrays/lists, a
    pandas DataFrame, or a list of rows.

    Raises:
        TypeError: anything else, naming what was expected.
        ValueError: columns of different lengths.
    """
    if isinstance(batch, dict):
        block = {k: v if isinstance(v, np.ndarray) else _column(list(v)) for k, v in batch.items()}
        lengths = {k: len(v) for k, v in block.items()}
        if len(set(lengths.values())) > 1:
            raise ValueError(f"batch columns have different lengths: {lengths}")
        return block
    if hasattr(batch, "to_dict") and hasattr(batch, "columns"):  # pandas.DataFrame
        return {str(c): batch[c].to_numpy() for c in batch.columns}
    if isinstance(batch, list):
        return from_rows(batch)
    raise TypeError(
        f"map_batches functions must return a dict of column -> array (or a pandas DataFrame "
        f"or a list of rows), got {type(batch).__name__}"
    )


def rows(block: Block):
    """The rows of ``block`` as dicts (numpy scalars turned into Python values)."""
    keys = list(block.keys())
    for i in range(num_rows(block)):
        yield {k: _py(block[k][i]) for k in keys}


def _py(v):
    return v.item() if isinstance(v, np.generic) else v


def slice_block(block: Block, start: int, end: int) -> Block:
    return {k: v[start:end] for k, v in block.items()}


def concat(blocks: list[Block]) -> Block:
    """Joins blocks with the same columns, in order."""
    blocks = [b for b in blocks if num_rows(b) > 0]
    if not blocks:
        return {}
    if len(blocks) == 1:
        return blocks[0]
    keys = list(blocks[0].keys())
    return {k: np.concatenate([b[k] for b in blocks]) for k in keys}


def take_indices(block: Block, idx: np.ndarray) -> Block:
    return {k: v[idx] for k, v in block.items()}


def to_format(block: Block, batch_format: str):
    """``block`` as a batch in ``batch_format``: ``"numpy"``/``"default"`` (dict of arrays),
    ``"pandas"`` (DataFrame), ``"torch"`` (dict of tensors; object columns stay arrays).

    Raises:
        ValueError: an unknown format.
    """
    if batch_format in ("numpy", "default", None):
        return block
    if batch_format == "pandas":
        import pandas as pd

        return pd.DataFrame({k: list(v) if v.ndim > 1 else v for k, v in block.items()})
    if batch_format == "torch":
        import torch

        return {k: (torch.as_tensor(v) if v.dtype != object else v) for k, v in block.items()}
    raise ValueError(f"unknown batch_format {batch_format!r} (expected 'numpy', 'pandas' or 'torch')")
