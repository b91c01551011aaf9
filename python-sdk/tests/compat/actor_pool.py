"""ray.util.ActorPool: map, map_unordered, submit with get_next / get_next_unordered,
has_next, has_free, push, pop_idle, timeouts and errors."""

import time

import ray
from ray.util import ActorPool
from ray.util.actor_pool import ActorPool as SameActorPool

ray.init(num_cpus=4)
print("same class", ActorPool is SameActorPool)


@ray.remote(num_cpus=0)
class Doubler:
    def double(self, v, delay=0.0):
        time.sleep(delay)
        return 2 * v

    def fail(self, v):
        raise ValueError(f"bad value {v}")


a1, a2, a3 = Doubler.remote(), Doubler.remote(), Doubler.remote()
pool = ActorPool([a1, a2])
print("map", list(pool.map(lambda a, v: a.double.remote(v), [1, 2, 3, 4, 5])))
print("map_unordered", sorted(pool.map_unordered(lambda a, v: a.double.remote(v), [1, 2, 3, 4, 5])))

# Completion order: the slow first value comes last.
delays = {1: 1.0, 2: 0.0, 3: 0.0}
print(
    "unordered completion",
    list(pool.map_unordered(lambda a, v: a.double.remote(v, delays[v]), [1, 2, 3]))[-1],
)

print("has_next empty", pool.has_next(), "has_free", pool.has_free())
pool.submit(lambda a, v: a.double.remote(v), 10)
pool.submit(lambda a, v: a.double.remote(v), 20)
print("both busy: has_free", pool.has_free(), "pop_idle", pool.pop_idle())
pool.submit(lambda a, v: a.double.remote(v), 30)  # queued until an actor is free
print("has_next", pool.has_next())
print("get_next", pool.get_next(), pool.get_next(), pool.get_next())
print("has_next after", pool.has_next())
try:
    pool.get_next()
except StopIteration as e:
    print("StopIteration:", e)

pool.submit(lambda a, v: a.double.remote(v, 0.5), 1)
pool.submit(lambda a, v: a.double.remote(v), 2)
print("get_next_unordered", pool.get_next_unordered(), pool.get_next_unordered())

pool.submit(lambda a, v: a.double.remote(v, 2.0), 7)
try:
    pool.get_next(timeout=0.1)
except TimeoutError as e:
    print("TimeoutError:", e)
print("still pending", pool.has_next(), "->", pool.get_next())

pool.submit(lambda a, v: a.double.remote(v, 2.0), 8)
try:
    pool.get_next_unordered(timeout=0.1)
except TimeoutError as e:
    print("unordered TimeoutError:", e)
print("unordered after timeout", pool.get_next_unordered())

# An error from the call reaches the caller; the actor goes back to the pool.
pool.submit(lambda a, v: a.fail.remote(v), 3)
try:
    pool.get_next()
except ValueError as e:
    print("ValueError from the call:", type(e).__name__, isinstance(e, ray.exceptions.RayTaskError))
print("after error has_free", pool.has_free())

# push adds an actor; pushing one already in the pool is refused.
pool.push(a3)
try:
    pool.push(a1)
except ValueError as e:
    print("ValueError:", e)
idle = [pool.pop_idle() for _ in range(4)]
print("popped", sum(x is not None for x in idle), "then", idle[-1], "has_free", pool.has_free())
for actor in idle[:3]:
    pool.push(actor)
print("map after push", list(pool.map(lambda a, v: a.double.remote(v), range(6))))
ray.shutdown()
