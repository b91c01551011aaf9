"""``tpuray.data``: streaming datasets over tasks and actors (Ray Data's core API).

    import tpuray.data as data
    ds = data.range(10_000).map_batches(lambda b: {"x": b["id"] * 2})
    for batch in ds.iter_batches(batch_size=512):
        ...

Sources: :func:`from_items`, :func:`range`, :func:`from_numpy`, :func:`read_csv`,
:func:`read_json` (JSON lines), :func:`read_parquet` (needs pyarrow). Blocks are dicts of
numpy arrays (``tpuray.data.block``); ``numpy`` is required, ``tqdm`` draws a progress bar
per operator when installed.
"""

from __future__ import annotations

import builtins
import glob
import os
from typing import Optional

from tpuray.data import block as B
from tpuray.data._executor import BlockMeta, PhysicalOp
from tpuray.data.context import DataContext
from tpuray.data.dataset import Dataset
from tpuray.data.iterator import DataIterator


def _parallelism(n_items: int, override: Optional[int]) -> int:
    if override is not None:
        if override < 1:
            raise ValueError(f"override_num_blocks must be >= 1, got {override}")
        return override
    import tpuray
    from tpuray._private import worker

    worker.auto_init()
    cpus = int(tpuray.cluster_resources().get("CPU", 1))
    return max(1, min(n_items, max(2 * cpus, 8), 200))


def _put_blocks(blocks: list) -> Dataset:
    import tpuray
    from tpuray._private import worker

    worker.auto_init()
    refs = [(tpuray.put(b), BlockMeta(B.num_rows(b), B.size_bytes(b))) for b in blocks]
    return Dataset(PhysicalOp(name="FromItems", kind="source", blocks=refs))


def from_items(items: list, *, override_num_blocks: Optional[int] = None) -> Dataset:
    """A dataset of ``items`` (dicts become rows; other values the column ``"item"``)."""
    items = list(items)
    n = _parallelism(len(items), override_num_blocks) if items else 1
    size = max(1, -(-len(items) // n))
    return _put_blocks([B.from_rows(items[i:i + size]) for i in builtins.range(0, len(items), size)])


def range(n: int, *, override_num_blocks: Optional[int] = None) -> Dataset:  # noqa: A001
    """Rows ``{"id": i}`` for ``i`` in ``0..n``, made by read tasks."""
    if n < 0:
        raise ValueError(f"range needs n >= 0, got {n}")
    blocks = _parallelism(max(n, 1), override_num_blocks)
    size = max(1, -(-n // blocks))

    def reader(start, end):
        def read():
            import numpy as np

            return {"id": np.arange(start, end, dtype=np.int64)}

        return read

    fns = [reader(s, min(n, s + size)) for s in builtins.range(0, n, size)]
    return Dataset(PhysicalOp(name="ReadRange", kind="source", read_fns=fns))


def from_numpy(arrays, *, column: str = "data") -> Dataset:
    """A dataset with one row per entry of axis 0 of each array (a list of arrays gives
    one block each)."""
    import numpy as np

    if isinstance(arrays, np.ndarray):
        arrays = [arrays]
    return _put_blocks([{column: np.asarray(a)} for a in arrays])


def _files(paths, suffixes: tuple) -> list:
    if isinstance(paths, (str, os.PathLike)):
        paths = [paths]
    out = []
    for p in paths:
        p = os.fspath(p)
        if os.path.isdir(p):
            out.extend(sorted(f for f in glob.glob(os.path.join(p, "*")) if f.endswith(suffixes)))
        elif any(ch in p for ch in "*?["):
            out.extend(sorted(glob.glob(p)))
        elif os.path.exists(p):
            out.append(p)
        else:
            raise FileNotFoundError(f"no such file or folder: {p!r}")
    if not out:
        raise FileNotFoundError(f"no {'/'.join(suffixes)} files in {list(paths)!r}")
    return [os.path.abspath(f) for f in out]


def _file_source(name: str, files: list, read_one) -> Dataset:
    def reader(path):
        def read():
            return read_one(path)

        return read

    return Dataset(PhysicalOp(name=name, kind="source", read_fns=[reader(f) for f in files]))


def _convert(v: str):
    for conv in (int, float):
        try:
            return conv(v)
        except ValueError:
            pass
    return v


def read_csv(paths, **_ignored) -> Dataset:
    """Rows of CSV files (a header line names the columns; numbers become int/float), one
    read task per file. The files must be readable from every node (a shared path).

    Raises:
        FileNotFoundError: a path that does not exist.
    """

    def read_one(path):
        import csv

        with open(path, newline="") as f:
            rows = [{k: _convert(v) for k, v in r.items()} for r in csv.DictReader(f)]
        return B.from_rows(rows)

    return _file_source("ReadCSV", _files(paths, (".csv",)), read_one)


def read_json(paths, **_ignored) -> Dataset:
    """Rows of JSON-lines files (one object per line), one read task per file."""

    def read_one(path):
        import json

        with open(path) as f:
            return B.from_rows(json.loads(line) for line in f if line.strip())

    return _file_source("ReadJSON", _files(paths, (".json", ".jsonl")), read_one)


def read_parquet(paths, **_ignored) -> Dataset:
    """Rows of Parquet files through pyarrow, one read task per file.

    Raises:
        ImportError: pyarrow is not installed (``pip install pyarrow``).
    """
    try:
        import pyarrow  # noqa: F401
    except ImportError as e:
        raise ImportError("read_parquet needs pyarrow: pip install pyarrow") from e

    def read_one(path):
        import pyarrow.parquet as pq

        table = pq.read_table(path)
        return {name: table.column(name).to_numpy(zero_copy_only=False) for name in table.column_names}

    return _file_source("ReadParquet", _files(paths, (".parquet",)), read_one)


class ActorPoolStrategy:
    """Ray's ``ActorPoolStrategy(min_size, max_size)``; pass ``concurrency=(min, max)``."""

    def __init__(self, min_size: int = 1, max_size: Optional[int] = None, size: Optional[int] = None):
        if size is not None:
            min_size = max_size = size
        self.min_size = min_size
        self.max_size = max_size or min_size

    def as_concurrency(self) -> tuple:
        return (self.min_size, self.max_size)


__all__ = [
    "ActorPoolStrategy",
    "DataContext",
    "DataIterator",
    "Dataset",
    "from_items",
    "from_numpy",
    "range",
    "read_csv",
    "read_json",
    "read_parquet",
]

