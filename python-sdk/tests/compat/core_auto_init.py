"""Ray's auto-init: put, get, wait and .remote() before any init() start a local
cluster (ray._private.auto_init_hook); cluster_resources() does not."""

import ray

print("initialized at start", ray.is_initialized())
try:
    ray.cluster_resources()
except Exception as e:  # noqa: BLE001 - Ray raises RaySystemError
    print("cluster_resources before init raises", type(e).__name__)
print("still not initialized", ray.is_initialized())
ref = ray.put(41)
print("put started a cluster", ray.is_initialized())
print("get", ray.get(ref))


@ray.remote
def add(a, b):
    return a + b


print("task", ray.get(add.remote(ref, 1)))
ready, rest = ray.wait([add.remote(1, 2)], timeout=60)
print("wait", len(ready), len(rest))
ray.shutdown()
print("after shutdown", ray.is_initialized())

# .remote() alone starts one too
print("remote alone", ray.get(add.remote(2, 3)), ray.is_initialized())
ray.shutdown()


@ray.remote
class Counter:
    def __init__(self):
        self.n = 0

    def incr(self):
        self.n += 1
        return self.n


c = Counter.options(name="auto-counter").remote()
print("actor", ray.get(c.incr.remote()), ray.is_initialized())
print("get_actor", ray.get(ray.get_actor("auto-counter").incr.remote()))
ray.shutdown()
ctx = ray.get_runtime_context()
print("get_runtime_context starts one", ray.is_initialized(), ctx.get_job_id() is not None)
ray.shutdown()
