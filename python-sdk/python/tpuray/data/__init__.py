"""``tpuray.data``: streaming datasets over tasks and actors (Ray Data's API, 2.60 names).

    import tpuray as ray
    ds = ray.data.range(10_000).map_batches(lambda b: {"x": b["id"] * 2})
    for batch in ds.iter_batches(batch_size=512):
        ...

Sources: :func:`range`, :func:`range_tensor`, :func:`from_items`, :func:`from_pandas`,
:func:`from_arrow`, :func:`from_numpy`, :func:`from_torch` (and the ``*_refs`` forms),
and readers of files on local paths, ``file://``, ``s3://``, ``gs://`` URIs (through
``pyarrow.fs``): :func:`read_csv`, :func:`read_json`, :func:`read_parquet`,
:func:`read_text`, :func:`read_images` (Pillow), :func:`read_binary_files`,
:func:`read_numpy`. Blocks are dicts of numpy arrays (``tpuray.data.block``); pandas and
pyarrow do the block work; ``tqdm`` draws a progress bar per operator when installed.
Install with ``pip install 'tpuray[data]'`` (numpy, pandas, pyarrow, tqdm, pillow).
"""

from __future__ import annotations

import builtins
import random as _random
from typing import Any, Optional

from tpuray.data import block as B
from tpuray.data._executor import BlockMeta, PhysicalOp  # noqa: F401 - BlockMeta: public
from tpuray.data.context import DataContext, ExecutionOptions, ExecutionResources
from tpuray.data.dataset import Dataset, MaterializedDataset, Schema
from tpuray.data.grouped_data import GroupedData
from tpuray.data.iterator import DataIterator

DatasetContext = DataContext  # Ray's backwards-compatible alias
DatasetIterator = DataIterator


class ActorPoolStrategy:
    """Runs a callable class on an autoscaling pool of ``min_size..max_size`` actors
    (Ray's ``ActorPoolStrategy``; ``size`` fixes both, ``initial_size`` is accepted).

    Raises:
        ValueError: sizes below 1, ``min_size > max_size``, or ``size`` with min/max.
    """

    def __init__(self, *, size: Optional[int] = None, min_size: Optional[int] = None,
                 max_size: Optional[int] = None, initial_size: Optional[int] = None,
                 max_tasks_in_flight_per_actor: Optional[int] = None):
        if size is not None:
            if min_size is not None or max_size is not None:
                raise ValueError("min_size and max_size cannot be set at the same time as size")
            if size < 1:
                raise ValueError(f"size must be >= 1, got {size}")
            min_size = max_size = size
        min_size = 1 if min_size is None else min_size
        if min_size < 1:
            raise ValueError(f"min_size must be >= 1, got {min_size}")
        if max_size is None:
            import tpuray

            max_size = max(min_size, int(tpuray.cluster_resources().get("CPU", 1)))
        if max_size < min_size:
            raise ValueError(f"min_size ({min_size}) must be <= max_size ({max_size})")
        if max_tasks_in_flight_per_actor is not None:
            raise ValueError("ActorPoolStrategy(max_tasks_in_flight_per_actor=...) is not supported; "
                             "set DataContext.max_tasks_in_flight_per_actor")
        self.min_size = min_size
        self.max_size = max_size
        self.initial_size = initial_size

    def as_concurrency(self) -> tuple:
        return (self.min_size, self.max_size)

    def __repr__(self) -> str:
        return f"ActorPoolStrategy(min_size={self.min_size}, max_size={self.max_size})"


class TaskPoolStrategy:
    """Runs a function as tasks, at most ``size`` at once (Ray's ``TaskPoolStrategy``)."""

    def __init__(self, size: Optional[int] = None):
        if size is not None and (not isinstance(size, int) or size < 1):
            raise ValueError(f"TaskPoolStrategy size must be an int >= 1, got {size!r}")
        self.size = size


def _parallelism(n_items: int, override: Optional[int], parallelism: int = -1) -> int:
    if override is None and parallelism not in (-1, None):
        override = parallelism
    if override is not None:
        if override < 1:
            raise ValueError(f"override_num_blocks must be >= 1, got {override}")
        return override
    import tpuray
    from tpuray._private import worker

    worker.auto_init()
    cpus = int(tpuray.cluster_resources().get("CPU", 1))
    return max(1, min(n_items, max(2 * cpus, 8), 200))


def _put_blocks(blocks: list, name: str = "FromItems") -> MaterializedDataset:
    import tpuray
    from tpuray._private import worker
    from tpuray.data._executor import _meta

    worker.auto_init()
    refs = [(tpuray.put(b), _meta(b)) for b in blocks]
    return MaterializedDataset(PhysicalOp(name=name, kind="source", blocks=refs))


def from_items(items: list, *, parallelism: int = -1,
               override_num_blocks: Optional[int] = None) -> MaterializedDataset:
    """A dataset of ``items`` (dicts become rows; other values the column ``"item"``),
    cut into blocks as Ray does (sizes differ by at most one row)."""
    items = list(items)
    n = min(len(items), _parallelism(len(items), override_num_blocks, parallelism)) if items else 0
    if n == 0:
        return _put_blocks([])
    size, rem = divmod(len(items), n)
    blocks = []
    for i in builtins.range(n):
        start = i * size + min(i, rem)
        end = (i + 1) * size + min(i + 1, rem)
        blocks.append(B.from_rows(items[start:end]))
    return _put_blocks(blocks)


def range(n: int, *, parallelism: int = -1, concurrency: Optional[int] = None,  # noqa: A001
          override_num_blocks: Optional[int] = None) -> Dataset:
    """Rows ``{"id": i}`` for ``i`` in ``0..n``, made by read tasks (block sizes as Ray:
    ``n // num_blocks`` rows each, the rest in a last block; blocks over
    ``DataContext.target_max_block_size`` bytes are cut smaller)."""
    return _range(n, parallelism, concurrency, override_num_blocks, None)


def range_tensor(n: int, *, shape: tuple = (1,), parallelism: int = -1,
                 concurrency: Optional[int] = None,
                 override_num_blocks: Optional[int] = None) -> Dataset:
    """Rows ``{"data": array of shape`` ``shape`` ``filled with i}`` for ``i`` in ``0..n``."""
    return _range(n, parallelism, concurrency, override_num_blocks, tuple(shape))


def _range(n, parallelism, concurrency, override, shape) -> Dataset:
    if not isinstance(n, int) or n < 0:
        raise ValueError(f"range needs an int n >= 0, got {n!r}")
    blocks = _parallelism(max(n, 1), override, parallelism)
    size = max(1, n // blocks)
    row_bytes = 8 * (int(__import__("numpy").prod(shape)) if shape else 1)
    target = DataContext.get_current().target_max_block_size
    if target:
        size = max(1, min(size, target // row_bytes))

    def reader(start, end):
        def read():
            import numpy as np

            ids = np.arange(start, end, dtype=np.int64)
            if shape is None:
                return {"id": ids}
            return {"data": np.ones((end - start,) + shape, dtype=np.int64)
                    * ids.reshape((-1,) + (1,) * len(shape))}

        return read

    fns = [reader(s, min(n, s + size)) for s in builtins.range(0, n, size)]
    # As Ray's range datasource: rows and (for range, not range_tensor) schema known.
    known = (["id"], ["int64"]) if shape is None and n > 0 else None
    return Dataset(PhysicalOp(name="ReadRange", kind="source", read_fns=fns,
                              max_concurrency=concurrency, known_schema=known, known_rows=n))


def from_numpy(ndarrays) -> MaterializedDataset:
    """A dataset with column ``"data"``, one row per entry of axis 0 (a list of arrays
    gives one block each)."""
    import numpy as np

    if isinstance(ndarrays, np.ndarray):
        ndarrays = [ndarrays]
    return _put_blocks([{"data": np.asarray(a)} for a in ndarrays], "FromNumpy")


def from_pandas(dfs, override_num_blocks: Optional[int] = None) -> MaterializedDataset:
    """A dataset of the rows of a pandas DataFrame (or of a list of them, one block each);
    the index is dropped."""
    if not isinstance(dfs, (list, tuple)):
        dfs = [dfs]
    blocks = [B.from_pandas(df) for df in dfs]
    if override_num_blocks is not None:
        return _put_blocks([B.concat(blocks)]).repartition(override_num_blocks).materialize()
    return _put_blocks(blocks, "FromPandas")


def from_arrow(tables, *, override_num_blocks: Optional[int] = None) -> MaterializedDataset:
    """A dataset of the rows of a pyarrow Table (or of a list of them, one block each)."""
    if not isinstance(tables, (list, tuple)):
        tables = [tables]
    blocks = [B.from_arrow(t) for t in tables]
    if override_num_blocks is not None:
        return _put_blocks([B.concat(blocks)]).repartition(override_num_blocks).materialize()
    return _put_blocks(blocks, "FromArrow")


def _from_refs(refs, convert, name: str) -> MaterializedDataset:
    import tpuray
    from tpuray.data._executor import _meta

    @tpuray.remote(num_returns=2)
    def to_block(x):
        b = convert(x)
        return b, _meta(b)

    if not isinstance(refs, (list, tuple)):
        refs = [refs]
    pairs = [to_block.remote(r) for r in refs]
    metas = tpuray.get([m for _, m in pairs])
    return MaterializedDataset(PhysicalOp(name=name, kind="source",
                                          blocks=[(b, m) for (b, _), m in zip(pairs, metas)]))


def from_pandas_refs(dfs) -> MaterializedDataset:
    """A dataset of DataFrames already in the object store (converted by tasks)."""
    return _from_refs(dfs, B.from_pandas, "FromPandas")


def from_arrow_refs(tables) -> MaterializedDataset:
    return _from_refs(tables, B.from_arrow, "FromArrow")


def from_numpy_refs(ndarrays) -> MaterializedDataset:
    import numpy as np

    return _from_refs(ndarrays, lambda a: {"data": np.asarray(a)}, "FromNumpy")


def from_torch(dataset, local_read: bool = False) -> MaterializedDataset:
    """A dataset with column ``"item"``: every sample of a ``torch.utils.data.Dataset``
    (map-style or iterable), read in the driver as Ray does."""
    if hasattr(dataset, "__len__") and hasattr(dataset, "__getitem__"):
        samples = [dataset[i] for i in builtins.range(len(dataset))]  # map-style
    else:
        samples = list(dataset)  # IterableDataset
    return from_items([{"item": x} for x in samples])


# ---- file readers ----


def _check_unsupported(where: str, **options) -> None:
    for k, v in options.items():
        if v is not None:
            raise ValueError(f"{where}: the option {k!r} is not supported by tpuray.data")


def _file_source(where: str, paths, read_one, *, filesystem, extensions, include_paths,
                 ignore_missing_paths, shuffle, ray_remote_args, num_cpus, concurrency,
                 override_num_blocks, **unsupported) -> Dataset:
    """One read task per group of files (``override_num_blocks`` groups, default one per
    file); ``read_one(fs, path) -> block`` runs in the task."""
    from tpuray.data import _io
    from tpuray.data.dataset import _remote_args

    _check_unsupported(where, **unsupported)
    fs, files = _io.resolve_files(paths, filesystem, extensions, ignore_missing_paths)
    if shuffle == "files":
        _random.shuffle(files)
    elif shuffle is not None:
        raise ValueError(f"{where}: shuffle must be None or 'files', got {shuffle!r}")
    groups = [[f] for f in files]
    if override_num_blocks is not None and files:
        k = max(1, min(len(files), override_num_blocks))
        groups = [files[i::k] for i in builtins.range(k)]

    def reader(group):
        def read():
            blocks = []
            for path in group:
                b = read_one(fs, path)
                if include_paths and B.num_rows(b):
                    import numpy as np

                    col = np.empty(B.num_rows(b), dtype=object)
                    col[:] = path
                    b = dict(b)
                    b["path"] = col
                blocks.append(b)
            return B.concat(blocks)

        return read

    remote = _remote_args(where, num_cpus, None, None, dict(ray_remote_args or {}))
    return Dataset(PhysicalOp(name=where, kind="source", read_fns=[reader(g) for g in groups],
                              remote_args=remote, max_concurrency=concurrency))


def _reader_kwargs(kw: dict) -> dict:
    defaults: dict[str, Any] = dict(filesystem=None, include_paths=False, ignore_missing_paths=False,
                    shuffle=None, ray_remote_args=None, num_cpus=None, concurrency=None,
                    override_num_blocks=None)
    for k in list(kw):
        if k in ("parallelism",):
            v = kw.pop(k)
            if v not in (-1, None):
                defaults["override_num_blocks"] = v
        elif k in ("meta_provider", "partition_filter", "partitioning", "num_gpus", "memory",
                   "arrow_open_file_args"):
            defaults.setdefault("_unsupported", {})[k] = kw.pop(k)
    defaults.update(kw)
    extra = defaults.pop("_unsupported", {})
    defaults.update(extra)
    return defaults


def read_text(paths, *, encoding: str = "utf-8", drop_empty_lines: bool = True,
              file_extensions=None, arrow_open_stream_args=None, **kwargs) -> Dataset:
    """Rows ``{"text": line}`` of text files (empty lines dropped unless
    ``drop_empty_lines=False``), one read task per file.

    Raises:
        FileNotFoundError: a path that does not exist.
    """
    def read_one(fs, path):
        import numpy as np

        with fs.open_input_stream(path, **dict(arrow_open_stream_args or {})) as f:
            text = f.read().decode(encoding)
        lines = text.splitlines()
        if drop_empty_lines:
            lines = [ln for ln in lines if ln.strip()]
        col = np.empty(len(lines), dtype=object)
        col[:] = lines
        return {"text": col} if lines else {}

    return _file_source("ReadText", paths, read_one, extensions=file_extensions,
                        **_reader_kwargs(kwargs))


_IMAGE_EXTENSIONS = ("png", "jpg", "jpeg", "tif", "tiff", "bmp", "gif")


def read_images(paths, *, size: Optional[tuple] = None, mode: Optional[str] = None,
                file_extensions=_IMAGE_EXTENSIONS, **kwargs) -> Dataset:
    """Rows ``{"image": uint8 array (height, width[, channels])}`` decoded with Pillow;
    ``size=(height, width)`` resizes, ``mode`` (a Pillow mode such as ``"RGB"``, ``"L"``)
    converts; ``include_paths=True`` adds ``"path"``.

    Raises:
        ImportError: Pillow is missing (``pip install pillow``).
        ValueError: a ``size`` that is not two positive ints.
    """
    try:
        import PIL  # noqa: F401 - checked here, used in the read tasks
    except ImportError as e:
        raise ImportError("read_images needs Pillow: pip install pillow") from e
    if size is not None and (len(size) != 2 or any(not isinstance(s, int) or s < 1 for s in size)):
        raise ValueError(f"size must be (height, width) of positive ints, got {size!r}")

    def read_one(fs, path):
        import io

        import numpy as np
        from PIL import Image

        with fs.open_input_stream(path) as f:
            img = Image.open(io.BytesIO(f.read()))
            img.load()
        if size is not None:
            img = img.resize((size[1], size[0]), resample=Image.BILINEAR)
        if mode is not None:
            img = img.convert(mode)
        arr = np.asarray(img)
        return {"image": arr[None, ...]}

    return _file_source("ReadImage", paths, read_one, extensions=file_extensions,
                        **_reader_kwargs(kwargs))


def read_binary_files(paths, *, file_extensions=None, arrow_open_stream_args=None,
                      **kwargs) -> Dataset:
    """Rows ``{"bytes": file contents}`` (``include_paths=True`` adds ``"path"``)."""
    def read_one(fs, path):
        import numpy as np

        with fs.open_input_stream(path, **dict(arrow_open_stream_args or {})) as f:
            data = f.read()
        col = np.empty(1, dtype=object)
        col[0] = data
        return {"bytes": col}

    return _file_source("ReadBinary", paths, read_one, extensions=file_extensions,
                        **_reader_kwargs(kwargs))


def read_numpy(paths, *, file_extensions=("npy",), **kwargs) -> Dataset:
    """Rows ``{"data": entry}`` along axis 0 of ``.npy`` files."""
    def read_one(fs, path):
        import io

        import numpy as np

        with fs.open_input_stream(path) as f:
            arr = np.load(io.BytesIO(f.read()), allow_pickle=False)
        return {"data": arr}

    return _file_source("ReadNumpy", paths, read_one, extensions=file_extensions,
                        **_reader_kwargs(kwargs))


def read_csv(paths, *, file_extensions=("csv",), arrow_open_stream_args=None,
             parse_options=None, read_options=None, convert_options=None,
             **kwargs) -> Dataset:
    """Rows of CSV files parsed by ``pyarrow.csv`` (a header line names the columns;
    types inferred), one read task per file; ``parse_options``/``read_options``/
    ``convert_options`` go to ``pyarrow.csv.read_csv``.

    Raises:
        FileNotFoundError: a path that does not exist ("no such file or folder").
    """
    def read_one(fs, path):
        import pyarrow.csv as pcsv

        with fs.open_input_stream(path, **dict(arrow_open_stream_args or {})) as f:
            t = pcsv.read_csv(f, parse_options=parse_options, read_options=read_options,
                              convert_options=convert_options)
        return B.from_arrow(t)

    return _file_source("ReadCSV", paths, read_one, extensions=file_extensions,
                        **_reader_kwargs(kwargs))


def read_json(paths, *, lines: Optional[bool] = None, file_extensions=("json", "jsonl"),
              arrow_open_stream_args=None, **kwargs) -> Dataset:
    """Rows of JSON files: JSON lines (one object per line, parsed by ``pyarrow.json``) or
    a file holding one JSON array or object (``lines=False``; ``None`` tries both)."""
    def read_one(fs, path):
        import io
        import json

        import pyarrow.json as pjson

        with fs.open_input_stream(path, **dict(arrow_open_stream_args or {})) as f:
            data = f.read()
        if lines is not False:
            try:
                return B.from_arrow(pjson.read_json(io.BytesIO(data)))
            except Exception:
                if lines:
                    raise
        value = json.loads(data.decode("utf-8"))
        return B.from_rows(value if isinstance(value, list) else [value])

    return _file_source("ReadJSON", paths, read_one, extensions=file_extensions,
                        **_reader_kwargs(kwargs))


def read_parquet(paths, *, columns: Optional[list] = None, file_extensions=("parquet",),
                 **kwargs) -> Dataset:
    """Rows of Parquet files through ``pyarrow.parquet`` (only ``columns`` when given),
    one read task per file."""
    def read_one(fs, path):
        import pyarrow.parquet as pq

        return B.from_arrow(pq.read_table(path, columns=columns, filesystem=fs))

    return _file_source("ReadParquet", paths, read_one, extensions=file_extensions,
                        **_reader_kwargs(kwargs))


__all__ = [
    "ActorPoolStrategy",
    "DataContext",
    "DataIterator",
    "Dataset",
    "DatasetContext",
    "DatasetIterator",
    "ExecutionOptions",
    "ExecutionResources",
    "GroupedData",
    "MaterializedDataset",
    "Schema",
    "TaskPoolStrategy",
    "from_arrow",
    "from_arrow_refs",
    "from_items",
    "from_numpy",
    "from_numpy_refs",
    "from_pandas",
    "from_pandas_refs",
    "from_torch",
    "range",
    "range_tensor",
    "read_binary_files",
    "read_csv",
    "read_images",
    "read_json",
    "read_numpy",
    "read_parquet",
    "read_text",
]
