"""ray.data groupby: hash-partitioned aggregations with Ray's column names (sum(x),
count(), mean(x), min(x), max(x), std(x)), several keys, aggregate() with
ray.data.aggregate functions, map_groups in each batch format."""

import ray
from ray.data.aggregate import Count, Max, Mean, Min, Std, Sum

ray.init(num_cpus=4)

rows = [
    {"shop": ["north", "south", "east"][i % 3], "day": i % 2, "revenue": (i * 7) % 23, "qty": i}
    for i in range(60)
]
ds = ray.data.from_items(rows, override_num_blocks=6)


def show(title, d):
    out = sorted(d.take_all(), key=lambda r: tuple(str(r[k]) for k in sorted(r)))
    print(title, sorted(out[0].keys()) if out else [])
    for r in out:
        print("  ", {k: (round(v, 6) if isinstance(v, float) else v) for k, v in sorted(r.items())})


show("sum", ds.groupby("shop").sum("revenue"))
show("sum two", ds.groupby("shop").sum(["revenue", "qty"]))
show("count", ds.groupby("shop").count())
show("mean", ds.groupby("shop").mean("revenue"))
show("min", ds.groupby("shop").min("qty"))
show("max", ds.groupby("shop").max("qty"))
show("std", ds.groupby("shop").std("revenue"))
show("std ddof0", ds.groupby("shop").std("revenue", ddof=0))
show("two keys", ds.groupby(["shop", "day"]).sum("revenue"))
show("aggregate", ds.groupby("shop").aggregate(Count(), Sum("revenue"), Mean("qty"), Min("revenue"), Max("revenue"), Std("qty")))
show("aggregate alias", ds.groupby("day").aggregate(Sum("revenue", alias_name="total")))
show("partitions", ds.groupby("shop", num_partitions=2).count())


def top(batch):
    i = batch["revenue"].argmax()
    return {"shop": [batch["shop"][i]], "best": [int(batch["revenue"][i])], "n": [len(batch["shop"])]}


show("map_groups numpy", ds.groupby("shop").map_groups(top))


def pandas_top(df):
    return df.sort_values("qty", ascending=False).head(2)[["shop", "qty"]]


show("map_groups pandas", ds.groupby("shop").map_groups(pandas_top, batch_format="pandas"))

print("dataset aggregate", ds.aggregate(Count(), Sum("revenue"), Max("qty")))
print("groupby None count", ds.groupby(None).count().take_all())
try:
    ds.groupby("nope").count().take_all()
except Exception as e:
    print("missing key", type(e).__name__)
