"""ray.data writers: write_parquet, write_csv, write_json, write_numpy to local paths and
file:// URIs, each read back."""

import os
import tempfile

import numpy as np

import ray

ray.init(num_cpus=4)
root = tempfile.mkdtemp()
ds = ray.data.from_items([{"k": i, "v": f"v{i}", "f": i / 4} for i in range(10)], override_num_blocks=3)


def files(path, ext):
    names = [n for n in os.listdir(path) if not n.startswith(".")]
    return len(names) > 0 and all(n.endswith(ext) for n in names)


out = os.path.join(root, "pq")
print("write_parquet", ds.write_parquet(out))
print("  files", files(out, ".parquet"), sorted(ray.data.read_parquet(out).take_all(), key=lambda r: r["k"])[:3])
out = os.path.join(root, "csv")
ds.write_csv("file://" + out)
print("write_csv", files(out, ".csv"), sorted(ray.data.read_csv(out).take_all(), key=lambda r: r["k"])[:3])
out = os.path.join(root, "json")
ds.write_json(out)
back = sorted(ray.data.read_json(out).take_all(), key=lambda r: r["k"])
print("write_json", files(out, ".json"), back[:3], len(back))
out = os.path.join(root, "npy")
ray.data.from_numpy(np.arange(12).reshape(6, 2)).write_numpy(out, column="data")
back = ray.data.read_numpy(out)
print("write_numpy", files(out, ".npy"), back.count(), sorted(r["data"].tolist() for r in back.take_all()))
out = os.path.join(root, "pq2")
ds.map(lambda r: {"k": r["k"], "sq": r["k"] ** 2}).write_parquet("file://" + out)
print("write_parquet uri", ray.data.read_parquet(out).sum("sq"))
try:
    ds.write_numpy(os.path.join(root, "bad"), column="zzz")
    print("numpy missing column no error")
except Exception as e:
    print("numpy missing column", type(e).__name__)
