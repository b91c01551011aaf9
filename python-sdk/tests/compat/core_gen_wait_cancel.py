"""ray.wait and ray.cancel take an ObjectRefGenerator (Ray 2.60): wait counts it ready
once its next item is there; cancel stops its task, and the generator ends with a ref
that raises TaskCancelledError."""

import ray
from ray.exceptions import TaskCancelledError

ray.init(num_cpus=4)


@ray.remote
class Gate:
    def __init__(self):
        self.open = False

    def release(self):
        self.open = True

    def is_open(self):
        return self.open


@ray.remote
def gated(gate):
    yield "before"
    while not ray.get(gate.is_open.remote()):
        pass
    yield "after"


@ray.remote
def endless():
    import time

    i = 0
    while True:
        yield i
        i += 1
        time.sleep(0.01)


gate = Gate.remote()
gen = gated.remote(gate)
ready, not_ready = ray.wait([gen], timeout=60)
print("first item ready", len(ready), len(not_ready), ready[0] is gen)
print("first", ray.get(next(gen)))
ready, not_ready = ray.wait([gen], timeout=0.5)
print("second not ready while gated", len(ready), len(not_ready))
ray.get(gate.release.remote())
ready, _ = ray.wait([gen], timeout=60)
print("second ready after release", len(ready))
print("second", ray.get(next(gen)))
ready, _ = ray.wait([gen], timeout=60)
print("end counts as ready", len(ready))
try:
    next(gen)
except StopIteration:
    print("then StopIteration")

gen = endless.remote()
print("endless first", ray.get(next(gen)))
ray.cancel(gen)
outcome = None
for ref in gen:
    try:
        ray.get(ref)
    except TaskCancelledError:
        outcome = "a ref raises TaskCancelledError"
print("after cancel:", outcome)
