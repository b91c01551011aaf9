"""ray.data sort (one key, several keys, descending per key), limit, unique and the
dataset-wide sum/min/max/mean/std."""

import ray

ray.init(num_cpus=4)

rows = [{"a": (i * 37) % 11, "b": (i * 13) % 7, "name": f"n{(i * 29) % 50:02d}", "x": i * 0.5} for i in range(50)]
ds = ray.data.from_items(rows, override_num_blocks=5)

print("by a", [r["a"] for r in ds.sort("a").take_all()])
print("by a desc", [r["a"] for r in ds.sort("a", descending=True).take_all()])
print("by a,b", [(r["a"], r["b"]) for r in ds.sort(["a", "b"]).take_all()])
print("by a asc b desc", [(r["a"], r["b"]) for r in ds.sort(["a", "b"], descending=[False, True]).take_all()])
print("by name", [r["name"] for r in ds.sort("name").take(10)])
big = ray.data.range(10_000, override_num_blocks=8)
out = big.random_shuffle(seed=3).sort("id", descending=True).take_all()
print("big sorted", len(out), out[:3], all(out[i]["id"] > out[i + 1]["id"] for i in range(len(out) - 1)))

print("limit", ray.data.range(100).limit(5).take_all())
print("limit count", ray.data.range(1000, override_num_blocks=10).limit(333).count())
print("limit then map", ray.data.range(20).limit(3).map(lambda r: {"v": r["id"] * 10}).take_all())
print("unique", sorted(ds.unique("b")))
print("unique names", len(ds.unique("name")))

print("sum", ds.sum("a"), "min", ds.min("a"), "max", ds.max("a"))
print("mean", round(ds.mean("x"), 6), "std", round(ds.std("x"), 6), "std0", round(ds.std("x", ddof=0), 6))
print("sum many", {k: round(v, 6) for k, v in sorted(ds.sum(["a", "x"]).items())})
print("mean many", {k: round(v, 6) for k, v in sorted(ds.mean(["a", "b"]).items())})
print("min many", sorted(ds.min(["a", "b"]).items()))
print("range sum", ray.data.range(1001).sum("id"))
for name, call in [
    ("sort missing", lambda: ds.sort("zzz").take_all()),
    ("unique missing", lambda: ds.unique("zzz")),
]:
    try:
        call()
        print(name, "no error")
    except Exception as e:
        print(name, type(e).__name__, "zzz" in str(e))
