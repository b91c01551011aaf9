"""ray.cancel(force=False) on a running task raises KeyboardInterrupt inside it and its
get raises TaskCancelledError (Ray 2.60); a queued task never runs; cancelling a finished
task changes nothing; cancelled tasks are not retried."""

import time

import ray
from ray.exceptions import TaskCancelledError

ray.init(num_cpus=1)


@ray.remote
class Log:
    def __init__(self):
        self.lines = []

    def add(self, line):
        self.lines.append(line)

    def read(self):
        return self.lines


@ray.remote(max_retries=3)
def sleeper(log, tag):
    try:
        # Inside the try: the driver cancels once it reads this line, which can be before
        # this get returns here, and the interrupt fires at the next bytecode.
        ray.get(log.add.remote(f"{tag} started"))
        # Short sleeps: the interrupt fires between them (as in Ray, it does not cut a
        # time.sleep short).
        for _ in range(12000):
            time.sleep(0.01)
    except KeyboardInterrupt:
        ray.get(log.add.remote(f"{tag} got KeyboardInterrupt"))
        raise
    return "slept"


@ray.remote
def quick(x):
    return x * 2


log = Log.options(num_cpus=0).remote()
running = sleeper.remote(log, "first")
while "first started" not in ray.get(log.read.remote()):
    time.sleep(0.05)
queued = sleeper.remote(log, "second")  # one CPU: waits behind the first
ray.cancel(queued)
ray.cancel(running)
for name, ref in (("running", running), ("queued", queued)):
    try:
        ray.get(ref, timeout=60)
        print(name, "returned")
    except TaskCancelledError:
        print(name, "TaskCancelledError")
print("log", ray.get(log.read.remote()))

done = quick.remote(21)
print("finished", ray.get(done))
ray.cancel(done)
print("cancel after it finished", ray.get(done))
print("a task after the cancels", ray.get(quick.remote(4)))
