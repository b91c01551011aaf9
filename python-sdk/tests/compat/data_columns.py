"""ray.data column operations and conversions: add_column, drop_columns,
rename_columns, select_columns (one name or several), take_batch in each format,
to_pandas, to_arrow_refs, stats, schema columns."""

import numpy as np
import pandas as pd
import pyarrow as pa

import ray

ray.init(num_cpus=4)

ds = ray.data.from_items([{"a": i, "b": i * 1.5, "c": f"s{i}"} for i in range(8)], override_num_blocks=2)

print("add_column", ds.add_column("d", lambda df: df["a"] * 2).take(3))
print("add_column numpy", ds.add_column("e", lambda b: b["a"] + 100, batch_format="numpy").take(2))
print("drop_columns", ds.drop_columns(["b"]).take(2))
print("drop_columns str", ds.drop_columns("c").take(2))
print("rename_columns", ds.rename_columns({"a": "alpha", "c": "gamma"}).take(2))
print("select_columns", ds.select_columns(["c", "a"]).take(2))
print("select_columns str", ds.select_columns("c").take(2))
print("columns", ds.columns(), ds.schema().names)

batch = ds.take_batch(3)
print("take_batch default", type(batch).__name__, sorted(batch), batch["a"].tolist(), batch["a"].dtype)
batch = ds.take_batch(4, batch_format="pandas")
print("take_batch pandas", type(batch).__name__, list(batch.columns), batch["a"].tolist())
batch = ds.take_batch(2, batch_format="pyarrow")
print("take_batch pyarrow", type(batch).__name__, batch.num_rows, batch.column_names, batch.column("b").to_pylist())
batch = ds.take_batch(5, batch_format="numpy")
print("take_batch numpy", {k: v.tolist() for k, v in sorted(batch.items())})

df = ds.to_pandas()
print("to_pandas", type(df).__name__, df.shape, list(df.columns), df["a"].tolist(), df["b"].sum())
refs = ds.to_arrow_refs()
tables = ray.get(refs)
print("to_arrow_refs", all(isinstance(r, ray.ObjectRef) for r in refs),
      all(isinstance(t, pa.Table) for t in tables), sum(t.num_rows for t in tables),
      pa.concat_tables(tables).column("a").to_pylist())

m = ds.map_batches(lambda b: {"a": b["a"] + 1}).materialize()
s = m.stats()
print("stats", type(s).__name__, len(s) > 0)

tensors = ray.data.from_numpy(np.arange(12).reshape(6, 2))
print("tensor take_batch", tensors.take_batch(2)["data"].tolist())
print("from_items scalars", ray.data.from_items([1, 2, 3]).take_all())

for name, call in [
    ("select missing", lambda: ds.select_columns(["zzz"]).take(1)),
    ("drop missing", lambda: ds.drop_columns(["zzz"]).take(1)),
    ("rename missing", lambda: ds.rename_columns({"zzz": "y"}).take(1)),
    ("add existing", lambda: ds.add_column("a", lambda df: df["a"]).take(1)),
]:
    try:
        call()
        print(name, "no error")
    except Exception as e:
        print(name, type(e).__name__, "zzz" in str(e) or "'a'" in str(e) or "a" in str(e))
