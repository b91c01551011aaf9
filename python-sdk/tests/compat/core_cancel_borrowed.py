"""ray.cancel on a borrowed ref (one passed inside a list, so the callee holds it
without its value) reaches the task through its owner: the owner's get raises
TaskCancelledError, and the task is not retried."""

import time

import ray

ray.init(num_cpus=2)


@ray.remote
class Flag:
    def __init__(self):
        self.n = 0

    def hit(self):
        self.n += 1

    def count(self):
        return self.n


@ray.remote(max_retries=3)
def slow(flag):
    ray.get(flag.hit.remote())
    for _ in range(600):
        time.sleep(0.1)
    return "finished"


@ray.remote
def canceller(refs):
    ray.cancel(refs[0])
    return "sent"


flag = Flag.remote()
r = slow.remote(flag)
deadline = time.time() + 60
while ray.get(flag.count.remote()) == 0 and time.time() < deadline:
    time.sleep(0.1)
print("running:", ray.get(flag.count.remote()))
print("canceller:", ray.get(canceller.remote([r]), timeout=60))
try:
    ray.get(r, timeout=60)
    print("not cancelled")
except ray.exceptions.TaskCancelledError:
    print("owner's get: TaskCancelledError")
time.sleep(1)
print("attempts:", ray.get(flag.count.remote()))
ray.shutdown()
print("done")
