"""ray.data splitting and combining: split (equal or not), split_at_indices,
train_test_split, union, zip, repartition, materialize, random_shuffle(seed=),
random_sample."""

import ray

ray.init(num_cpus=4)

ds = ray.data.range(100, override_num_blocks=7)

parts = ds.split(3)
print("split", [p.count() for p in parts], sorted(r["id"] for p in parts for r in p.take_all()) == list(range(100)))
parts = ds.split(3, equal=True)
print("split equal", [p.count() for p in parts])
parts = ds.split_at_indices([10, 35, 35, 90])
print("split_at_indices", [p.count() for p in parts], [p.take(2) for p in parts])
train, test = ds.train_test_split(test_size=0.25)
print("train_test_split", train.count(), test.count(), test.take(3))
train, test = ds.train_test_split(test_size=10, shuffle=True, seed=7)
print("train_test_split shuffled", train.count(), test.count(),
      sorted(r["id"] for r in train.take_all() + test.take_all()) == list(range(100)))

u = ds.limit(3).union(ray.data.range(2), ray.data.from_items([{"id": 99}]))
print("union", sorted(r["id"] for r in u.take_all()), u.count())

left = ray.data.range(6, override_num_blocks=2)
right = ray.data.from_items([{"sq": i * i, "id": -i} for i in range(6)], override_num_blocks=3)
print("zip", left.zip(right).take_all())

rp = ds.repartition(4).materialize()
print("repartition", rp.num_blocks(), rp.count(), rp.take(3))

m = ds.map(lambda r: {"id": r["id"], "double": r["id"] * 2}).materialize()
print("materialize", type(m).__name__, m.count(), m.take(2), m.count())

sh = ds.random_shuffle(seed=42)
ids = [r["id"] for r in sh.take_all()]
print("shuffle", sorted(ids) == list(range(100)), ids != list(range(100)))
again = [r["id"] for r in ds.random_shuffle(seed=42).take_all()]
print("shuffle same seed", again == ids)

big = ray.data.range(10_000, override_num_blocks=10)
sample = big.random_sample(0.1, seed=5)
n = sample.count()
vals = [r["id"] for r in sample.take_all()]
print("random_sample", 700 < n < 1300, len(set(vals)) == len(vals), all(0 <= v < 10_000 for v in vals))
print("random_sample all", ds.random_sample(1.0).count(), "none", ds.random_sample(0.0).count())
for name, call in [
    ("split zero", lambda: ds.split(0)),
    ("bad fraction", lambda: ds.random_sample(1.5)),
    ("test_size", lambda: ds.train_test_split(test_size=2.0)),
]:
    try:
        call()
        print(name, "no error")
    except Exception as e:
        print(name, type(e).__name__)
