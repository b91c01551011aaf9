"""ray.actor.exit_actor: the actor ends for good (no restart, whatever max_restarts),
the call that exits and the calls queued behind it fail with RayActorError, its name
is free again once no handle to it remains; __ray_terminate__ does the same after earlier calls; outside an actor
exit_actor raises TypeError."""

import time

import ray
from ray.actor import exit_actor

ray.init(num_cpus=4, namespace="exit_actor")


@ray.remote(max_restarts=2)
class Worker:
    def __init__(self):
        self.calls = 0

    def work(self):
        self.calls += 1
        return self.calls

    def leave(self):
        exit_actor()
        return "not reached"


w = Worker.options(name="w").remote()
print("before", ray.get([w.work.remote(), w.work.remote()]))
leave = w.leave.remote()
after = [w.work.remote() for _ in range(3)]
for ref in [leave] + after:
    try:
        ray.get(ref, timeout=60)
        print("returned")
    except ray.exceptions.RayActorError as e:
        print("RayActorError", isinstance(e, ray.exceptions.ActorDiedError))

# Not restarted: later calls fail too, and the name can be taken again.
try:
    ray.get(w.work.remote(), timeout=60)
except ray.exceptions.RayActorError:
    print("still dead")
# Ray keeps the dead actor's name while a handle to it lives; once none does, the
# name can be taken again.
del w
time.sleep(1)
try:
    ray.get_actor("w")
    print("name still taken")
except ValueError:
    print("name free")
w2 = Worker.options(name="w").remote()
print("new actor under the old name", ray.get(w2.work.remote()))


@ray.remote
class AsyncWorker:
    async def ping(self):
        return "pong"

    async def leave(self):
        exit_actor()


a = AsyncWorker.remote()
print("async", ray.get(a.ping.remote()))
try:
    ray.get(a.leave.remote(), timeout=60)
except ray.exceptions.RayActorError:
    print("async exit: RayActorError")
try:
    ray.get(a.ping.remote(), timeout=60)
except ray.exceptions.RayActorError:
    print("async actor stays dead")

# __ray_terminate__ runs after the calls sent before it.
t = Worker.remote()
earlier = [t.work.remote() for _ in range(3)]
ray.wait([t.__ray_terminate__.remote()], timeout=60)
print("earlier calls", ray.get(earlier))
try:
    ray.get(t.work.remote(), timeout=60)
except ray.exceptions.RayActorError:
    print("terminated actor: RayActorError")

try:
    exit_actor()
except TypeError:
    print("driver: TypeError")


@ray.remote
def in_a_task():
    try:
        exit_actor()
    except TypeError:
        return "task: TypeError"


print(ray.get(in_a_task.remote()))
ray.shutdown()
