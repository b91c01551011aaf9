"""ray.data readers over local paths and file:// URIs: read_text, read_images,
read_binary_files, read_numpy, read_csv/read_json/read_parquet, and the in-memory
sources from_pandas, from_arrow, from_numpy, from_torch, from_items."""

import os
import tempfile

import numpy as np
import pandas as pd
import pyarrow as pa
import pyarrow.parquet as pq
import torch
from PIL import Image

import ray

ray.init(num_cpus=4)
root = tempfile.mkdtemp()

text = os.path.join(root, "text")
os.makedirs(text)
with open(os.path.join(text, "a.txt"), "w") as f:
    f.write("alpha\nbeta\n\ngamma\n")
with open(os.path.join(text, "b.txt"), "w") as f:
    f.write("delta\n")
print("read_text", sorted(r["text"] for r in ray.data.read_text(text).take_all()))
print("read_text file", ray.data.read_text(os.path.join(text, "b.txt")).take_all())
print("read_text uri", sorted(r["text"] for r in ray.data.read_text("file://" + text).take_all()))

imgs = os.path.join(root, "imgs")
os.makedirs(imgs)
for i in range(3):
    arr = np.full((4, 6, 3), i * 40, dtype=np.uint8)
    Image.fromarray(arr).save(os.path.join(imgs, f"im{i}.png"))
ds = ray.data.read_images(imgs)
rows = sorted(ds.take_all(), key=lambda r: int(r["image"][0, 0, 0]))
print("read_images", len(rows), sorted(rows[0]), [(r["image"].shape, str(r["image"].dtype), int(r["image"].max())) for r in rows])
rows = ray.data.read_images(imgs, size=(2, 3), include_paths=True).take_all()
print("read_images size", sorted(rows[0]), sorted((r["image"].shape, os.path.basename(r["path"])) for r in rows))
gray = ray.data.read_images(imgs, mode="L").take(1)[0]["image"]
print("read_images mode L", gray.shape)

bins = os.path.join(root, "bins")
os.makedirs(bins)
for i in range(2):
    with open(os.path.join(bins, f"f{i}.bin"), "wb") as f:
        f.write(bytes(range(i, i + 5)))
rows = ray.data.read_binary_files(bins, include_paths=True).take_all()
print("read_binary_files", sorted((os.path.basename(r["path"]), r["bytes"]) for r in rows))
print("read_binary_files plain", sorted(sorted(r) for r in ray.data.read_binary_files("file://" + bins).take_all()))

npy = os.path.join(root, "arr.npy")
np.save(npy, np.arange(10).reshape(5, 2))
ds = ray.data.read_numpy(npy)
print("read_numpy", ds.count(), ds.columns(), [r["data"].tolist() for r in ds.take(2)])

csvp = os.path.join(root, "t.csv")
pd.DataFrame({"k": [1, 2, 3], "v": ["x", "y", "z"], "f": [0.5, 1.5, 2.5]}).to_csv(csvp, index=False)
print("read_csv", ray.data.read_csv(csvp).take_all())
jsp = os.path.join(root, "t.jsonl")
with open(jsp, "w") as f:
    f.write('{"k": 1, "v": "x"}\n{"k": 2, "v": "y"}\n')
print("read_json", ray.data.read_json(jsp).take_all())
pqp = os.path.join(root, "t.parquet")
pq.write_table(pa.table({"k": [5, 6], "s": ["p", "q"]}), pqp)
print("read_parquet", ray.data.read_parquet("file://" + pqp).take_all())

df = pd.DataFrame({"x": [1, 2, 3], "y": ["a", "b", "c"]})
print("from_pandas", ray.data.from_pandas(df).take_all())
print("from_pandas list", ray.data.from_pandas([df, df.head(1)]).count())
print("from_arrow", ray.data.from_arrow(pa.table({"n": [1, 2], "m": [3.0, 4.0]})).take_all())
print("from_arrow list", ray.data.from_arrow([pa.table({"n": [1]}), pa.table({"n": [2, 3]})]).sum("n"))
ds = ray.data.from_numpy(np.ones((4, 3), dtype=np.float32))
print("from_numpy", ds.count(), ds.columns(), ds.take(1)[0]["data"].tolist())
print("from_numpy list", ray.data.from_numpy([np.arange(3), np.arange(2)]).count())


class Squares(torch.utils.data.Dataset):
    def __len__(self):
        return 4

    def __getitem__(self, i):
        return i * i


print("from_torch", ray.data.from_torch(Squares()).take_all())
tds = torch.utils.data.TensorDataset(torch.arange(3))
rows = ray.data.from_torch(tds).take_all()
print("from_torch tensors", len(rows), sorted(rows[0]), [[int(t) for t in r["item"]] for r in rows])

for name, call in [
    ("missing path", lambda: ray.data.read_text(os.path.join(root, "nope")).take_all()),
]:
    try:
        call()
        print(name, "no error")
    except Exception as e:
        print(name, type(e).__name__)
