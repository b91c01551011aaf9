"""ray.data consumption: iter_batches (batch_size, prefetch_batches, drop_last, formats),
iter_torch_batches (dtypes, device), iter_rows, DataContext settings Ray scripts set,
and a UDF that raises failing the dataset with its error."""

import numpy as np
import torch

import ray
from ray.data import DataContext

ray.init(num_cpus=4)

ctx = DataContext.get_current()
ctx.enable_progress_bars = False
ctx.execution_options.preserve_order = True
ctx.target_max_block_size = 64 * 1024 * 1024
print("context", ctx.execution_options.preserve_order, ctx.enable_progress_bars)

ds = ray.data.range(1000, override_num_blocks=7)
sizes = [len(b["id"]) for b in ds.iter_batches()]
print("iter_batches default", sizes, sum(sizes))
sizes = [len(b["id"]) for b in ds.iter_batches(batch_size=300, prefetch_batches=2)]
print("iter_batches 300", sizes)
sizes = [len(b["id"]) for b in ds.iter_batches(batch_size=300, drop_last=True, prefetch_batches=0)]
print("drop_last", sizes)
first = next(iter(ds.iter_batches(batch_size=5, batch_format="pandas")))
print("pandas batch", type(first).__name__, first["id"].tolist())
first = next(iter(ds.iter_batches(batch_size=3, batch_format="pyarrow")))
print("pyarrow batch", type(first).__name__, first.column("id").to_pylist())
print("ordered", [b["id"][0].item() for b in ds.iter_batches(batch_size=250)])
print("iter_rows", [r for _, r in zip(range(3), ds.iter_rows())])

tds = ray.data.from_items([{"x": float(i), "y": i % 2} for i in range(10)])
b = next(iter(tds.iter_torch_batches(batch_size=4)))
print("torch", sorted(b), type(b["x"]).__name__, b["x"].dtype, b["y"].dtype, b["x"].tolist(), str(b["x"].device))
b = next(iter(tds.iter_torch_batches(batch_size=4, dtypes=torch.float16, device="cpu")))
print("torch dtypes one", b["x"].dtype, b["y"].dtype)
b = next(iter(tds.iter_torch_batches(batch_size=4, dtypes={"x": torch.float64, "y": torch.int32})))
print("torch dtypes dict", b["x"].dtype, b["y"].dtype)
print("torch sizes", [len(b["x"]) for b in tds.iter_torch_batches(batch_size=4, drop_last=True)])
img = ray.data.from_numpy(np.zeros((6, 2, 2), dtype=np.uint8))
print("torch tensor column", next(iter(img.iter_torch_batches(batch_size=3)))["data"].shape)


def boom(batch):
    if batch["id"][0] >= 500:
        raise ValueError("bad row at the UDF")
    return batch


try:
    ds.map_batches(boom).take_all()
    print("no error")
except Exception as e:
    print("udf error", "bad row at the UDF" in str(e), isinstance(e, ValueError) or "ValueError" in str(e))


def row_boom(row):
    raise KeyError("missing_thing")


try:
    ds.map(row_boom).take_all()
    print("map no error")
except Exception as e:
    print("map error", "missing_thing" in str(e), "KeyError" in str(e))
