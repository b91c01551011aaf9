"""Throughput of `tpuray.data` pipelines on a local cluster, in rows per second.

    .venv/bin/python bench/data.py [--rows N] [--rounds R] [--address HOST:PORT]

Without --address it starts a private local cluster in this process (`tpuray.init()`,
every CPU of this machine). Cases, each over N rows (default 2,000,000) of an int64 `id`
column, timed end to end from building the dataset to the last row consumed by the
driver (median of R rounds, default 3):

- `map_batches`: range -> map_batches (numpy: id * 2 + 1, tasks) -> iter_batches
- `map_batches + filter`: the same with a row filter (keeps half) before iterating
- `actor pool`: range -> map_batches on a callable class (concurrency=(1, 2))
- `iter_batches only`: range -> iter_batches (reading and moving blocks)
- `row-wise map`: range -> map (one Python call per row) over N / 20 rows
- `parquet`: read_parquet of N rows written by pyarrow beforehand -> map_batches

Needs numpy and pyarrow (`pip install ./python-sdk[data]`).
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time

import numpy as np

import tpuray
import tpuray.data as rd


def affine(batch):
    return {"id": batch["id"] * 2 + 1}


def plus_one(row):
    return {"id": row["id"] + 1}


class Scale:
    def __init__(self):
        self.k = 3

    def __call__(self, batch):
        return {"id": batch["id"] * self.k}


def consume(ds) -> int:
    rows = 0
    for batch in ds.iter_batches(batch_size=65536):
        rows += len(batch["id"])
    return rows


def timed(build, expect: int, rounds: int) -> float:
    times = []
    for _ in range(rounds):
        t0 = time.perf_counter()
        got = consume(build())
        times.append(time.perf_counter() - t0)
        if got != expect:
            raise SystemExit(f"expected {expect} rows, the pipeline gave {got}")
    return statistics.median(times)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", type=int, default=2_000_000)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--address", default=None)
    args = ap.parse_args()
    n, r = args.rows, args.rounds
    tpuray.init(address=args.address)
    rd.DataContext.get_current().enable_progress_bars = False
    with tempfile.TemporaryDirectory(prefix="tpuray-databench-") as tmp:
        import pyarrow as pa
        import pyarrow.parquet as pq

        files = 8
        for i in range(files):
            lo, hi = i * n // files, (i + 1) * n // files
            pq.write_table(pa.table({"id": np.arange(lo, hi, dtype=np.int64)}),
                           os.path.join(tmp, f"part-{i}.parquet"))
        cases = [
            ("map_batches", lambda: rd.range(n).map_batches(affine), n, n),
            ("map_batches + filter", lambda: rd.range(n).map_batches(affine).filter(
                lambda row: row["id"] % 4 == 1), n, n // 2),
            ("actor pool", lambda: rd.range(n).map_batches(Scale, concurrency=(1, 2)), n, n),
            ("iter_batches only", lambda: rd.range(n), n, n),
            ("row-wise map", lambda: rd.range(n // 20).map(plus_one), n // 20, n // 20),
            ("parquet", lambda: rd.read_parquet(tmp).map_batches(affine), n, n),
        ]
        for name, build, rows, out in cases:
            secs = timed(build, out, r)
            print(f"{name}: {rows / secs:,.0f} input rows/s ({rows:,} rows in {secs:.2f} s, "
                  f"median of {r})", flush=True)
    tpuray.shutdown()


if __name__ == "__main__":
    main()
