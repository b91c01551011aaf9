"""Paths and files for the readers and writers, through ``pyarrow.fs``: local paths,
``file://`` and any URI pyarrow knows (``s3://``, ``gs://``, ``hdfs://``, ...) when
pyarrow was built with that filesystem."""

from __future__ import annotations

import os
from typing import Optional, Tuple


def _fs_and_path(path: str, filesystem):
    import pyarrow.fs as pafs

    path = os.fspath(path)
    if filesystem is not None:
        if "://" in path:
            _, path = pafs.FileSystem.from_uri(path)
        return filesystem, path
    if "://" in path:
        return pafs.FileSystem.from_uri(path)
    return pafs.LocalFileSystem(), os.path.abspath(path)


def resolve_files(paths, filesystem=None, extensions: Optional[tuple] = None,
                  ignore_missing_paths: bool = False) -> Tuple[object, list]:
    """``(filesystem, [file paths])`` for ``paths`` (one or a list of files, folders
    (walked recursively; hidden files, names starting with ``.`` or ``_``, skipped) or
    glob patterns of local paths); folders keep only names ending in one of
    ``extensions`` (case-insensitive) when given.

    Raises:
        FileNotFoundError: a path that does not exist ("no such file or folder"), or no
            files at all.
        ValueError: paths on different filesystems.
    """
    import glob

    import pyarrow.fs as pafs

    if isinstance(paths, (str, os.PathLike)):
        paths = [paths]
    paths = [os.fspath(p) for p in paths]
    if not paths:
        raise ValueError("no paths given")
    fs = None
    out: list[str] = []
    exts = tuple(e.lower().lstrip(".") for e in extensions) if extensions else None

    def wanted(name: str) -> bool:
        base = name.rsplit("/", 1)[-1]
        if base.startswith(".") or base.startswith("_"):
            return False
        return exts is None or base.lower().rsplit(".", 1)[-1] in exts

    for p in paths:
        this_fs, path = _fs_and_path(p, filesystem)
        if fs is None:
            fs = this_fs
        elif type(fs) is not type(this_fs):
            raise ValueError(f"paths on different filesystems: {paths}")
        if isinstance(this_fs, pafs.LocalFileSystem) and any(ch in path for ch in "*?["):
            matches = sorted(glob.glob(path))
            if not matches and not ignore_missing_paths:
                raise FileNotFoundError(f"no such file or folder: {p!r}")
            out.extend(os.path.abspath(m) for m in matches if os.path.isfile(m))
            continue
        info = fs.get_file_info(path)
        if info.type == pafs.FileType.NotFound:
            if ignore_missing_paths:
                continue
            raise FileNotFoundError(f"no such file or folder: {p!r}")
        if info.type == pafs.FileType.Directory:
            found = fs.get_file_info(pafs.FileSelector(path, recursive=True))
            out.extend(sorted(f.path for f in found
                              if f.type == pafs.FileType.File and wanted(f.path)))
        else:
            out.append(info.path)
    if not out and not ignore_missing_paths:
        raise FileNotFoundError(
            f"no {'/'.join(exts) + ' ' if exts else ''}files in {paths!r}")
    return fs, out


def resolve_dir(path: str, filesystem=None):
    """``(filesystem, folder path)`` for a writer's output folder."""
    return _fs_and_path(path, filesystem)


def read_bytes(fs, path: str) -> bytes:
    with fs.open_input_stream(path) as f:
        return f.read()
