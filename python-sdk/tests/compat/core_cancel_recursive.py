"""ray.cancel(recursive=True), the default, cancels the tasks a cancelled task submitted;
recursive=False leaves them running (Ray 2.60)."""

import time

import ray
from ray.exceptions import TaskCancelledError

ray.init(num_cpus=4)


@ray.remote(num_cpus=0)
class Registry:
    def __init__(self):
        self.refs = {}

    def put(self, key, refs):
        self.refs[key] = refs[0]

    def get(self, key):
        r = self.refs.get(key)
        return None if r is None else [r]


@ray.remote
def child(seconds):
    # Short sleeps: a cancel's KeyboardInterrupt fires between them (as in Ray, it does
    # not cut a time.sleep short).
    for _ in range(int(seconds * 100)):
        time.sleep(0.01)
    return "child finished"


@ray.remote
def parent(registry, key, seconds):
    c = child.remote(seconds)
    ray.get(registry.put.remote(key, [c]))
    return ray.get(c)


def child_of(registry, key):
    while True:
        got = ray.get(registry.get.remote(key))
        if got is not None:
            return got[0]
        time.sleep(0.05)


reg = Registry.remote()
p = parent.remote(reg, "recursive", 120)
c = child_of(reg, "recursive")
ray.cancel(p)
for name, ref in (("parent", p), ("child", c)):
    try:
        ray.get(ref, timeout=60)
        print("recursive:", name, "returned")
    except TaskCancelledError:
        print("recursive:", name, "TaskCancelledError")

p = parent.remote(reg, "flat", 3)
c = child_of(reg, "flat")
ray.cancel(p, recursive=False)
try:
    ray.get(p, timeout=60)
    print("flat: parent returned")
except TaskCancelledError:
    print("flat: parent TaskCancelledError")
print("flat: child", ray.get(c, timeout=60))
