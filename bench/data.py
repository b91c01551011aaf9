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

    .venv/bin/python bench/data.py --shuffles [--rows 10000000] [--store-bytes 1073741824]
    /path/to/ray-venv/bin/python bench/data.py --shuffles --ray

`--shuffles` runs the all-to-all cases instead, on a fresh local cluster whose object
store is limited to --store-bytes (default 1 GiB; `init(object_store_memory=...)`), over
N rows (default 10,000,000) of three columns (`id` int64, `key` int64 in 0..999, `value`
float64; 24 bytes a row, 240 MB in all) made by range -> map_batches in 50
blocks, each consumed with iter_batches:

- `groupby`: groupby("key").sum("value") (a hash-partitioned shuffle; 1,000 rows out)
- `sort`: sort("value") (sample-based range partitioning)
- `random_shuffle`: random_shuffle(seed=1)

Under tpuray a sampler reads `tpuray memory --format json` every 0.2 s and the peak bytes
in memory (and spilled) are printed beside the rows/s; `--ray` runs the same cases under
Ray (`import ray`; run it with Ray's venv), for rows/s next to Ray's.
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time

import numpy as np


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


def columns(batch):
    ids = batch["id"]
    return {"id": ids, "key": (ids * 7919) % 1000, "value": ((ids * 31) % 100_003).astype(np.float64)}


def consume_rows(ds) -> int:
    rows = 0
    for batch in ds.iter_batches(batch_size=None):
        rows += len(next(iter(batch.values())))
    return rows


class StoreSampler:
    """Peak bytes of every node's object store in memory (used + being written) and
    spilled, from `tpuray memory --format json`, sampled on a thread."""

    def __init__(self, head: str):
        import threading

        self.head = head
        self.peak_mem = 0
        self.peak_spilled = 0
        self.capacity = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _sample(self) -> None:
        import json
        import subprocess
        import sys

        r = subprocess.run([sys.executable, "-m", "tpuray", "memory", "--format", "json",
                            "--address", self.head], capture_output=True, text=True, timeout=60)
        if r.returncode != 0:
            return
        nodes = json.loads(r.stdout)
        if isinstance(nodes, dict):
            nodes = nodes.get("nodes", [nodes])
        mem = sum(int(x.get("used_bytes", 0)) + int(x.get("writing_bytes", 0)) for x in nodes)
        spilled = sum(int(x.get("spilled_bytes", 0)) for x in nodes)
        self.capacity = sum(int(x.get("capacity_bytes", 0) or 0) for x in nodes)
        self.peak_mem = max(self.peak_mem, mem)
        self.peak_spilled = max(self.peak_spilled, spilled)

    def _run(self) -> None:
        while not self._stop.is_set():
            self._sample()
            time.sleep(0.2)

    def __enter__(self):
        self._thread.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join()


def shuffles(args) -> None:
    n, store = args.rows or 10_000_000, args.store_bytes
    if args.ray:
        import ray
        import ray.data as rd

        ray.init(num_cpus=args.num_cpus, object_store_memory=store)
        ctx = rd.DataContext.get_current()
        ctx.enable_progress_bars = False
        ctx.execution_options.preserve_order = True
        system = f"Ray {ray.__version__}"
    else:
        import tpuray
        import tpuray.data as rd
        from tpuray._private import worker
        from tpuray._private.build import require_optimized_build

        require_optimized_build("bench/data.py --shuffles")

        tpuray.init(num_cpus=args.num_cpus, object_store_memory=store)
        rd.DataContext.get_current().enable_progress_bars = False
        system = "tpuray"

    def source():
        return rd.range(n, override_num_blocks=50).map_batches(columns)

    cases = [
        ("groupby", lambda: source().groupby("key").sum("value"), 1000),
        ("sort", lambda: source().sort("value"), n),
        ("random_shuffle", lambda: source().random_shuffle(seed=1), n),
    ]
    print(f"{system}: {n:,} rows, object store {store / 2**30:.2f} GiB, "
          f"{args.num_cpus} CPUs", flush=True)
    for name, build, out in cases:
        times, peak, spilled, cap = [], 0, 0, 0
        for _ in range(args.rounds):
            t0 = time.perf_counter()
            if args.ray:
                got = consume_rows(build())
            else:
                with StoreSampler(worker.process_info()["head_address"]) as s:
                    got = consume_rows(build())
                peak, spilled, cap = max(peak, s.peak_mem), max(spilled, s.peak_spilled), s.capacity
            times.append(time.perf_counter() - t0)
            if got != out:
                raise SystemExit(f"{name}: expected {out} rows, got {got}")
        secs = statistics.median(times)
        line = f"{name}: {n / secs:,.0f} input rows/s ({secs:.2f} s, median of {args.rounds})"
        if not args.ray:
            line += (f"; peak object store in memory {peak / 2**20:,.0f} MiB of "
                     f"{cap / 2**20:,.0f} MiB, peak spilled {spilled / 2**20:,.0f} MiB")
        print(line, flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", type=int, default=None)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--address", default=None)
    ap.add_argument("--shuffles", action="store_true", help="the groupby/sort/random_shuffle cases")
    ap.add_argument("--ray", action="store_true", help="with --shuffles: run them under Ray")
    ap.add_argument("--store-bytes", type=int, default=1 << 30)
    ap.add_argument("--num-cpus", type=int, default=os.cpu_count())
    args = ap.parse_args()
    if args.shuffles:
        shuffles(args)
        return
    import tpuray
    import tpuray.data as rd
    from tpuray._private.build import require_optimized_build

    require_optimized_build("bench/data.py")
    n, r = args.rows or 2_000_000, args.rounds
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
