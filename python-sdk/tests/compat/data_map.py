"""ray.data transforms: map/filter/flat_map with functions and callable classes
(concurrency, ActorPoolStrategy), map_batches with Ray 2.60's defaults (batch_size=None:
the whole block), each batch_format, generator UDFs, fn_args/fn_kwargs/constructor args."""

import os

import pandas as pd
import pyarrow as pa

import ray
from ray.data import ActorPoolStrategy

ray.init(num_cpus=4)

ds = ray.data.range(40, override_num_blocks=4)


def ids(d):
    return sorted(r["id"] for r in d.take_all())


print("map", ids(ds.map(lambda r: {"id": r["id"] * 3}))[:5])
print("filter", ids(ds.filter(lambda r: r["id"] % 7 == 0)))
print("flat_map", ids(ds.limit(3).flat_map(lambda r: [{"id": r["id"]}, {"id": r["id"] + 100}])))


class AddPid:
    def __init__(self, offset):
        self.offset = offset
        self.pid = os.getpid()

    def __call__(self, row):
        return {"id": row["id"] + self.offset, "pid": self.pid}


out = ds.map(AddPid, fn_constructor_args=(1000,), concurrency=2).take_all()
print("map class", sorted(r["id"] for r in out)[:3], len({r["pid"] for r in out}) <= 2)


class Keep:
    def __init__(self, mod):
        self.mod = mod

    def __call__(self, row):
        return row["id"] % self.mod == 0


print("filter class", ids(ds.filter(Keep, fn_constructor_kwargs={"mod": 9}, concurrency=1)))


class Twice:
    def __call__(self, row):
        return [row, row]


print("flat_map class", len(ds.flat_map(Twice, concurrency=(1, 2)).take_all()))


sizes = ds.map_batches(lambda b: {"n": [len(b["id"])]}).take_all()
print("batch_size None", sorted(r["n"] for r in sizes))
sizes = ds.map_batches(lambda b: {"n": [len(b["id"])]}, batch_size=4).take_all()
print("batch_size 4", sorted(r["n"] for r in sizes))


def kinds(b):
    return {"kind": [type(b).__name__]}


for fmt in ["default", "numpy", "pandas", "pyarrow"]:
    print("format", fmt, ds.map_batches(kinds, batch_format=fmt).take(1))


def pandas_double(df: pd.DataFrame) -> pd.DataFrame:
    df["id"] = df["id"] * 2
    return df


print("pandas udf", ids(ds.map_batches(pandas_double, batch_format="pandas"))[:4])


def arrow_udf(t: pa.Table) -> pa.Table:
    return t.append_column("neg", pa.compute.negate(t.column("id")))


print("pyarrow udf", sorted(ds.map_batches(arrow_udf, batch_format="pyarrow").take_all(), key=lambda r: r["id"])[:2])


def gen(b):
    for i in range(2):
        yield {"id": b["id"] + i * 1000}


print("generator udf", ds.map_batches(gen).count(), ids(ds.map_batches(gen))[-2:])


def scale(b, factor, *, shift):
    return {"id": b["id"] * factor + shift}


print("fn_args", ids(ds.map_batches(scale, fn_args=(10,), fn_kwargs={"shift": 1}))[:3])


class Model:
    def __init__(self, w):
        self.w = w

    def __call__(self, b):
        return {"id": b["id"], "y": b["id"] * self.w}


print("actor pool strategy", ds.map_batches(Model, fn_constructor_args=(2,), compute=ActorPoolStrategy(size=2), batch_size=8).sum("y"))
print("actor min max", ds.map_batches(Model, fn_constructor_args=(3,), compute=ActorPoolStrategy(min_size=1, max_size=2)).sum("y"))
print("actor concurrency", ds.map_batches(Model, fn_constructor_args=(1,), concurrency=2).sum("y"))
print("task concurrency", ds.map_batches(lambda b: b, concurrency=2).count())
print("num_cpus", ds.map_batches(lambda b: b, num_cpus=0.5).count())
for name, call in [
    ("class without concurrency", lambda: ds.map_batches(Model, fn_constructor_args=(1,)).count()),
    ("bad batch_format", lambda: ds.map_batches(lambda b: b, batch_format="xml").count()),
    ("bad return", lambda: ds.map_batches(lambda b: 5).count()),
]:
    try:
        call()
        print(name, "no error")
    except Exception as e:
        print(name, type(e).__name__)
