"""``tpuray.data`` on the session's local cluster (conftest.py, 4 CPUs): sources, transformations, actor pools,
all-to-all operators, streaming_split, and the two properties the streaming executor
promises: backpressure bounds the bytes in the object store, and an actor pool never
starves the tasks that feed it."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time

import pytest

np = pytest.importorskip("numpy")

import tpuray as ray  # noqa: E402
import tpuray.data as data  # noqa: E402
from tpuray.data import DataContext  # noqa: E402


@pytest.fixture(scope="module", autouse=True)
def _shared_cluster(cluster):
    """The session's in-process cluster (conftest.py)."""
    return cluster


def run_with_timeout(fn, timeout=120):
    """Runs ``fn`` on a thread; fails (instead of hanging) when it does not finish."""
    out = {}

    def target():
        try:
            out["value"] = fn()
        except BaseException as e:  # re-raised below
            out["error"] = e

    t = threading.Thread(target=target, daemon=True)
    t.start()
    t.join(timeout)
    assert not t.is_alive(), f"pipeline did not finish within {timeout}s (starved or deadlocked)"
    if "error" in out:
        raise out["error"]
    return out["value"]


def test_row_and_batch_transforms_keep_order_and_values():
    """DATA-2: rows of blocks made in parallel reach the consumer in source order."""
    ds = data.range(1000).map(lambda r: {"id": r["id"], "sq": r["id"] ** 2})
    ds = ds.filter(lambda r: r["id"] % 3 == 0)
    rows = ds.take_all()
    assert [r["id"] for r in rows] == list(range(0, 1000, 3))
    assert all(r["sq"] == r["id"] ** 2 for r in rows)
    assert ds.count() == 334
    doubled = data.range(100).map_batches(lambda b: {"x": b["id"] * 2}, batch_size=7)
    assert [r["x"] for r in doubled.take(5)] == [0, 2, 4, 6, 8]
    fm = data.from_items(["a", "bb"]).flat_map(lambda r: [r, {"item": r["item"].upper()}])
    assert [r["item"] for r in fm.take_all()] == ["a", "A", "bb", "BB"]
    batches = list(data.range(10).iter_batches(batch_size=4))
    assert [len(b["id"]) for b in batches] == [4, 4, 2]
    assert [len(b["id"]) for b in data.range(10).iter_batches(batch_size=4, drop_last=True)] == [4, 4]


def test_callable_class_runs_on_an_actor_pool_constructed_once_per_actor():
    class AddPid:
        def __init__(self, k):
            self.k = k
            self.pid = os.getpid()

        def __call__(self, batch):
            return {"y": batch["id"] + self.k, "pid": np.full(len(batch["id"]), self.pid)}

    rows = data.range(400).map_batches(
        AddPid, fn_constructor_args=(5,), concurrency=(1, 2), batch_size=50, num_cpus=1
    ).take_all()
    assert [r["y"] for r in rows] == [i + 5 for i in range(400)]
    pids = {r["pid"] for r in rows}
    assert 1 <= len(pids) <= 2 and os.getpid() not in pids
    with pytest.raises(ValueError, match="concurrency"):
        data.range(4).map_batches(lambda b: b, concurrency=(1, 2))


def test_actor_pool_asking_for_every_cpu_still_gets_its_input():
    class Slow:
        def __call__(self, batch):
            time.sleep(0.01)
            return {"v": batch["id"] * 10}

    # The reads and the map feeding the pool need a CPU each; the pool asks for every CPU.
    cpus = int(ray.cluster_resources()["CPU"])
    ds = data.range(2000, override_num_blocks=20).map(lambda r: {"id": r["id"] + 1})
    ds = ds.map_batches(Slow, concurrency=cpus, num_cpus=1, batch_size=100)
    total = run_with_timeout(lambda: sum(int(r["v"]) for r in ds.iter_rows()))
    assert total == 10 * sum(range(1, 2001))


def _store_used_bytes() -> int:
    """Bytes in memory in every node's object store, from `tpuray memory --format json`."""
    from tpuray._private import worker

    head = worker.process_info()["head_address"]
    r = subprocess.run([sys.executable, "-m", "tpuray", "memory", "--format", "json",
                        "--address", head], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    nodes = json.loads(r.stdout)
    if isinstance(nodes, dict):
        nodes = nodes.get("nodes", [nodes])
    return sum(int(n.get("used_bytes", 0)) + int(n.get("writing_bytes", 0)) for n in nodes)


def test_backpressure_keeps_object_store_use_under_its_bound():
    """DATA-1: with a slow consumer, the bytes an execution holds stay under
    max_bytes_in_flight."""
    mb = 1024 * 1024
    bound = 8 * mb
    ctx = DataContext.get_current()
    old = ctx.max_bytes_in_flight
    ctx.max_bytes_in_flight = bound
    try:
        # 80 blocks of 1 MiB each: ten times the bound, made by read tasks and a map.
        ds = data.range(80, override_num_blocks=80).map_batches(
            lambda b: {"payload": np.full((len(b["id"]), mb // 8), b["id"][0], dtype=np.float64)},
            batch_size=None,
        )
        baseline = _store_used_bytes()
        peak = [0]
        stop = threading.Event()

        def sample():
            while not stop.is_set():
                peak[0] = max(peak[0], _store_used_bytes() - baseline)
                time.sleep(0.05)

        sampler = threading.Thread(target=sample, daemon=True)
        sampler.start()
        seen = 0
        for batch in ds.iter_batches(batch_size=None):
            assert batch["payload"].shape == (1, mb // 8)
            seen += 1
            time.sleep(0.05)  # a slow consumer
        stop.set()
        sampler.join()
    finally:
        ctx.max_bytes_in_flight = old
    assert seen == 80
    # The bound, plus one block being made when the bound was reached, plus one freed block
    # whose deletion was still on its way. A block in the store is its 1 MiB array plus its
    # serialization's framing (about 220 bytes here: ten blocks were 10 MiB + 2,176 bytes).
    block = mb + 4096
    assert 0 < peak[0] <= bound + 2 * block, f"object store held {peak[0]} bytes (bound {bound})"


def test_all_to_all_operators():
    ds = data.from_items([{"a": i} for i in range(50)])
    shuffled = [r["a"] for r in ds.random_shuffle(seed=3).take_all()]
    assert sorted(shuffled) == list(range(50)) and shuffled != list(range(50))
    assert [r["a"] for r in ds.random_shuffle(seed=3).take_all()] == shuffled, "same seed, same order"
    sizes = [len(b["id"]) for b in data.range(100).repartition(3).iter_batches(batch_size=None)]
    assert sizes == [33, 34, 33]
    assert [r["id"] for r in data.range(100).repartition(3).take_all()] == list(range(100))


def test_file_sources(tmp_path):
    (tmp_path / "a.csv").write_text("x,name\n1,one\n2,two\n")
    (tmp_path / "b.csv").write_text("x,name\n3,three\n")
    rows = data.read_csv(str(tmp_path)).take_all()
    assert rows == [{"x": 1, "name": "one"}, {"x": 2, "name": "two"}, {"x": 3, "name": "three"}]
    (tmp_path / "c.jsonl").write_text('{"k": 1}\n{"k": 2}\n')
    assert [r["k"] for r in data.read_json(str(tmp_path / "c.jsonl")).take_all()] == [1, 2]
    with pytest.raises(FileNotFoundError, match="no such file"):
        data.read_csv(str(tmp_path / "missing.csv"))
    pq = pytest.importorskip("pyarrow.parquet")
    import pyarrow as pa

    pq.write_table(pa.table({"v": [1.5, 2.5]}), tmp_path / "d.parquet")
    assert [r["v"] for r in data.read_parquet(str(tmp_path / "d.parquet")).take_all()] == [1.5, 2.5]
    arr = np.arange(12).reshape(6, 2)
    got = data.from_numpy(arr).take_all()
    assert [list(r["data"]) for r in got] == arr.tolist()


def test_streaming_split_feeds_each_consumer_a_share_once_per_epoch():
    its = data.range(1000, override_num_blocks=10).streaming_split(2)

    @ray.remote
    def consume(it, epochs):
        return [sorted(int(x) for b in it.iter_batches(batch_size=64) for x in b["id"])
                for _ in range(epochs)]

    a, b = ray.get([consume.remote(its[0], 2), consume.remote(its[1], 2)], timeout=120)
    for epoch in range(2):
        assert sorted(a[epoch] + b[epoch]) == list(range(1000))
        assert a[epoch] and b[epoch]
    equal = data.range(101, override_num_blocks=5).streaming_split(2, equal=True)
    counts = ray.get([consume.remote(it, 1) for it in equal], timeout=120)
    assert len(counts[0][0]) == len(counts[1][0]) == 50


def test_ray_data_is_an_attribute_of_the_package():
    import importlib

    import tpuray

    assert tpuray.data is importlib.import_module("tpuray.data")
    assert tpuray.data.range is data.range


def test_limit_stops_the_reads_upstream(tmp_path):
    # 40 read tasks, each leaving a file behind: a limit of 5 rows needs only the first.
    marks = str(tmp_path)

    def mark(batch):
        with open(os.path.join(marks, f"{int(batch['id'][0])}"), "w"):
            pass
        return batch

    ctx = DataContext.get_current()
    old = ctx.max_tasks_in_flight_per_op
    ctx.max_tasks_in_flight_per_op = 1
    try:
        rows = data.range(400, override_num_blocks=40).map_batches(mark).limit(5).take_all()
    finally:
        ctx.max_tasks_in_flight_per_op = old
    assert rows == [{"id": i} for i in range(5)]
    assert 1 <= len(os.listdir(marks)) < 40


def test_iter_batches_prefetches_on_a_thread():
    seen_threads = []

    def consume():
        out = []
        for b in data.range(100, override_num_blocks=5).iter_batches(batch_size=20, prefetch_batches=2):
            seen_threads.append({t.name for t in threading.enumerate()})
            out.append(len(b["id"]))
        return out

    assert run_with_timeout(consume) == [20] * 5
    assert any("tpuray-data-prefetch" in names for names in seen_threads)
    # Stopping early ends the prefetching thread instead of leaving it blocked.
    it = iter(data.range(100, override_num_blocks=10).iter_batches(batch_size=10, prefetch_batches=1))
    next(it)
    it.close()
    deadline = time.time() + 10
    while any(t.name == "tpuray-data-prefetch" for t in threading.enumerate()) and time.time() < deadline:
        time.sleep(0.05)
    assert not any(t.name == "tpuray-data-prefetch" for t in threading.enumerate())


def test_udf_errors_fail_the_dataset_with_the_udf_traceback():
    def bad(batch):
        raise ZeroDivisionError("no dividing here")

    with pytest.raises(ray.exceptions.RayTaskError) as info:
        run_with_timeout(lambda: data.range(10).map_batches(bad).take_all())
    e = info.value
    assert isinstance(e, ray.exceptions.UserCodeException)
    assert "no dividing here" in str(e) and "ZeroDivisionError" in str(e)
    assert "in bad" in str(e), "the UDF's own frame is in the traceback"


def test_data_context_refuses_settings_it_does_not_implement_by_name():
    ctx = DataContext.get_current()
    with pytest.raises(AttributeError, match="shuffle_strategy"):
        ctx.shuffle_strategy = "hash_shuffle"
    with pytest.raises(AttributeError, match="max_errored_blocks"):
        ctx.max_errored_blocks = 3
    with pytest.raises(ValueError, match="gpu"):
        ctx.execution_options.resource_limits.gpu = 1
    with pytest.raises(ValueError, match="max_calls"):
        data.range(3).map_batches(lambda b: b, max_calls=2)
    with pytest.raises(ValueError, match="unknown option 'bogus'"):
        data.range(3).map(lambda r: r, bogus=1)


def test_resource_limits_bound_the_bytes_in_flight():
    """DATA-1: the executor's peak bytes stay under the bound set through resource_limits."""
    ctx = DataContext.get_current()
    old = ctx.execution_options.resource_limits.object_store_memory
    ctx.execution_options.resource_limits.object_store_memory = 3 * 1024 * 1024
    try:
        assert ctx.resolved().max_bytes_in_flight == 3 * 1024 * 1024
        ds = data.range(40, override_num_blocks=40).map_batches(
            lambda b: {"x": np.zeros((len(b["id"]), 1024 * 1024 // 8))})
        assert ds.count() == 40
        assert ds._last_executor.peak_bytes <= 3 * 1024 * 1024 + 2 * 1024 * 1024
    finally:
        ctx.execution_options.resource_limits.object_store_memory = old


def test_sort_and_groupby_run_as_shuffles_with_many_output_blocks():
    ds = data.from_items([{"k": i % 13, "v": (i * 7) % 101} for i in range(500)], override_num_blocks=10)
    s = ds.sort("v", descending=True).materialize()
    assert s.num_blocks() >= 2
    vals = [r["v"] for r in s.take_all()]
    assert vals == sorted(vals, reverse=True)
    fixed = ds.sort("v", boundaries=[20, 50]).materialize()
    assert fixed.num_blocks() == 3
    assert [r["v"] for r in fixed.take_all()] == sorted(vals)
    g = ds.groupby("k", num_partitions=4).count().materialize()
    assert g.num_blocks() == 4
    assert sorted((r["k"], r["count()"]) for r in g.take_all()) == [
        (k, sum(1 for i in range(500) if i % 13 == k)) for k in range(13)]
    with pytest.raises(ValueError, match="zzz"):
        ds.groupby("zzz").sum("v").take_all()


def test_readers_and_writers_through_file_uris(tmp_path):
    ds = data.from_items([{"a": i, "s": f"x{i}"} for i in range(20)], override_num_blocks=4)
    ds.write_parquet(f"file://{tmp_path}/pq")
    assert len(os.listdir(tmp_path / "pq")) == 4
    back = data.read_parquet(f"file://{tmp_path}/pq", override_num_blocks=2)
    assert sorted(r["a"] for r in back.take_all()) == list(range(20))
    assert back.num_blocks() == 2
    ds.write_json(str(tmp_path / "js"))
    assert sorted(r["s"] for r in data.read_json(str(tmp_path / "js")).take_all()) == sorted(f"x{i}" for i in range(20))
    with pytest.raises(FileNotFoundError, match="no such file"):
        data.read_text(f"file://{tmp_path}/missing")


def test_local_shuffle_buffer_and_repartition_by_rows():
    rows = [int(x) for b in data.range(200, override_num_blocks=4).iter_batches(
        batch_size=50, local_shuffle_buffer_size=100, local_shuffle_seed=1) for x in b["id"]]
    assert sorted(rows) == list(range(200)) and rows != list(range(200))
    sizes = [len(b["id"]) for b in data.range(100).repartition(target_num_rows_per_block=30).iter_batches(batch_size=None)]
    assert sum(sizes) == 100 and len(sizes) == 4


def test_groupby_fast_path_agrees_with_the_per_group_path(monkeypatch):
    from tpuray.data import aggregate as A
    from tpuray.data import grouped_data as G

    rng = np.random.default_rng(0)
    blk = {"k": rng.integers(0, 5, 200), "j": rng.integers(0, 2, 200),
           "s": np.array([f"s{i % 3}" for i in range(200)], dtype=object),
           "v": rng.random(200), "i": rng.integers(0, 50, 200)}
    aggs = [A.Count(), A.Sum("i"), A.Sum("v"), A.Min("i"), A.Max("v"), A.Mean("i"),
            A.Std("v"), A.Std("i", ddof=0), A.Count("v")]
    for keys in (["k"], ["k", "j"], ["s"]):
        fast = G._vectorized(blk, keys, aggs)
        assert fast is not None
        with monkeypatch.context() as m:
            m.setattr(G, "_vectorized", lambda *a: None)
            slow = G._aggregate_groups(keys, aggs)(blk)
        assert list(fast) == list(slow)
        for c in slow:
            if slow[c].dtype.kind == "f":
                assert np.allclose(fast[c], slow[c]), c
            else:
                assert fast[c].tolist() == slow[c].tolist(), c
                assert fast[c].dtype == slow[c].dtype, c
    assert G._vectorized(blk, ["k"], [A.Unique("i")]) is None
    assert G._vectorized(blk, ["k"], [A.Sum("v", ignore_nulls=False)]) is None


def test_init_object_store_memory_sizes_a_new_local_clusters_store(tmp_path):
    # Ray's init(object_store_memory=) for the private cluster init() starts (bench/data.py
    # --shuffles limits the store this way); in a process of its own.
    env = {k: v for k, v in os.environ.items() if k not in ("TPURAY_ADDRESS", "RAY_ADDRESS")}
    env["TPURAY_REGISTRY_DIR"] = str(tmp_path / "registry")
    code = ("import tpuray; tpuray.init(num_cpus=1, object_store_memory=300 * 2**20); "
            "print(int(tpuray.cluster_resources()['object_store_memory'])); tpuray.shutdown()")
    r = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                       timeout=120)
    assert r.returncode == 0, r.stderr
    assert r.stdout.split()[-1] == str(300 * 2**20)
    limits = data.ExecutionResources.for_limits(object_store_memory=5)
    assert limits.object_store_memory == 5 and limits.cpu is None


def test_repr_of_a_materialized_dataset_shows_head_and_tail_rows_across_blocks_and_cuts_long_cells():
    # Ray 2.60's repr (ray/data/_internal/dataset_repr.py): at most 10 rows, the first 5
    # and the last 5 around a "…" row once there are more; cells cut to 40 characters.
    long = "x" * 45
    ds = data.from_items([{"i": i, "s": long if i == 0 else f"r{i}"} for i in range(13)],
                         override_num_blocks=4)
    lines = repr(ds).splitlines()
    assert lines[0] == "shape: (13, 2)"
    assert lines[-1] == "(Showing 10 of 13 rows)"
    cells = [[c.strip() for c in ln.strip("│").split("┆")] for ln in lines if ln.startswith("│")]
    assert cells[0] == ["i", "s"] and cells[2] == ["int64", "string"], cells
    rows = cells[3:]
    assert [r[0] for r in rows] == ["0", "1", "2", "3", "4", "…", "8", "9", "10", "11", "12"], rows
    assert rows[0][1] == "x" * 39 + "…"
    # A lazy dataset whose schema is unknown prints its plan over the source's line.
    lazy = ds.map_batches(lambda b: b)
    assert repr(lazy) == "MapBatches(<lambda>)\n+- Dataset(num_rows=13, schema={i: int64, s: string})"
