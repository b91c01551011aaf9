"""ray.cancel on actor calls (Ray 2.60): a running async method's coroutine is cancelled
(asyncio.CancelledError inside it) and its get raises TaskCancelledError; a sync method
is not interrupted but sees get_runtime_context().is_canceled(); force=True for an actor
call is refused with ValueError."""

import asyncio
import time

import ray
from ray.exceptions import TaskCancelledError

ray.init(num_cpus=2)


@ray.remote
class AsyncWorker:
    def __init__(self):
        self.events = []

    async def wait_forever(self):
        self.events.append("started")
        try:
            await asyncio.sleep(120)
        except asyncio.CancelledError:
            self.events.append("CancelledError")
            raise
        return "done"

    async def read(self):
        return self.events


@ray.remote
class SyncWorker:
    def __init__(self):
        self.started = False

    def poll(self):
        self.started = True
        deadline = time.time() + 60
        while time.time() < deadline:
            if ray.get_runtime_context().is_canceled():
                return "saw is_canceled"
            time.sleep(0.01)
        return "never cancelled"

    def is_started(self):
        return self.started


a = AsyncWorker.remote()
ref = a.wait_forever.remote()
while "started" not in ray.get(a.read.remote()):
    time.sleep(0.05)
ray.cancel(ref)
try:
    ray.get(ref, timeout=60)
    print("async: returned")
except TaskCancelledError:
    print("async: TaskCancelledError")
time.sleep(0.5)
print("async events", ray.get(a.read.remote()))

try:
    ray.cancel(a.read.remote(), force=True)
    print("force on an actor call accepted")
except ValueError:
    print("force on an actor call: ValueError")

s = SyncWorker.options(max_concurrency=2).remote()
ref = s.poll.remote()
while not ray.get(s.is_started.remote()):
    time.sleep(0.05)
ray.cancel(ref)
try:
    print("sync:", ray.get(ref, timeout=60))
except TaskCancelledError:
    print("sync: TaskCancelledError")
