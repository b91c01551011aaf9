"""ray.data Dataset repr (and str): a table of the schema when it is known without
running anything (range, materialized datasets with their first and last rows,
schema-keeping operators), else the plan with `+-` lines over the source's
Dataset(num_rows=..., schema=...), split over lines when long."""

import csv
import os
import tempfile

import pandas as pd

import ray

ray.init(num_cpus=2)


def f(batch):
    return batch


ds = ray.data.range(5)
cases = [
    ("range", ds),
    ("materialized 150 rows", ray.data.range(150, override_num_blocks=3).materialize()),
    ("map_batches", ds.map_batches(f)),
    ("filter", ds.filter(lambda r: r["id"] > 1)),
    ("map_batches then filter", ds.map_batches(f).filter(lambda r: True)),
    ("map", ds.map(lambda r: r)),
    ("flat_map", ds.flat_map(lambda r: [r])),
    ("limit", ds.limit(2)),
    ("map_batches then limit", ds.map_batches(f).limit(3)),
    ("limit then map_batches", ds.limit(3).map_batches(f)),
    ("filter then limit", ds.filter(lambda r: True).limit(3)),
    ("random_shuffle", ds.random_shuffle()),
    ("repartition", ds.repartition(2)),
    ("sort", ds.sort("id")),
    ("select_columns", ds.select_columns(["id"])),
    ("map_batches materialized", ds.map_batches(f).materialize()),
    ("materialized 20 rows", ray.data.range(20, override_num_blocks=4).materialize()),
    ("from_items ints", ray.data.from_items([1, 2, 3])),
    ("from_items dicts", ray.data.from_items([{"x": 1, "y": "a"}])),
    ("from_items then map_batches", ray.data.from_items([{"a": 1}]).map_batches(f)),
    ("from_items then filter", ray.data.from_items([{"a": 1}]).filter(lambda r: True)),
    ("from_pandas", ray.data.from_pandas(pd.DataFrame({"a": [1.5, 2.0], "s": ["x", "y"]}))),
    ("range 0", ray.data.range(0)),
    ("long schema", ray.data.from_items([{"a_very_long_column_name_number_one": 1,
                                          "another_long_column_name_two": "x",
                                          "third_col_name_xx": 2.5}]).map_batches(f)),
]
for name, d in cases:
    print(f"== {name}")
    print(repr(d))

with tempfile.TemporaryDirectory() as tmp:
    path = os.path.join(tmp, "x.csv")
    with open(path, "w", newline="") as fh:
        w = csv.writer(fh)
        w.writerow(["a", "b"])
        for i in range(5):
            w.writerow([i, f"s{i}"])
    print("== read_csv")
    print(ray.data.read_csv(path))
    print("== read_csv then map_batches")
    print(ray.data.read_csv(path).map_batches(f))
print("== str is repr", str(ds) == repr(ds))
