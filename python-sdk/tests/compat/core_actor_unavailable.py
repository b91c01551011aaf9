"""A call in flight when its actor's process dies, with no task retries: while the actor
may restart (max_restarts left) the call fails with ActorUnavailableError (a
RayActorError; the call may or may not have run) and the next call reaches the
restarted actor; with no restarts left it fails with ActorDiedError, as does the next
call."""

import os
import signal
import time

import ray

ray.init(num_cpus=2)


@ray.remote(max_task_retries=0)
class A:
    def pid(self):
        return os.getpid()

    def sleep(self, s):
        time.sleep(s)
        return "slept"

    def die(self):
        os._exit(1)


def call_when_back(f):
    # Ray fails a call made while the actor restarts (max_task_retries=0) with
    # ActorUnavailableError at once; calling again once it is back reaches it.
    deadline = time.time() + 60
    while True:
        try:
            return ray.get(f(), timeout=60)
        except ray.exceptions.ActorUnavailableError:
            if time.time() > deadline:
                raise
            time.sleep(0.2)


for restarts in (1, 0):
    a = A.options(max_restarts=restarts).remote()
    p = ray.get(a.pid.remote())
    r = a.sleep.remote(60)
    time.sleep(1)
    os.kill(p, signal.SIGKILL)
    try:
        ray.get(r, timeout=60)
    except ray.exceptions.RayActorError as e:
        msg = str(e)
        print(restarts, type(e).__name__, isinstance(e, ray.exceptions.ActorDiedError))
        print("  may or may not have run:", "may or may not have been executed" in msg)
    try:
        print("  next call reaches a new process:", call_when_back(a.pid.remote) != p)
    except ray.exceptions.RayActorError as e:
        print("  next call:", type(e).__name__)

# The actor's own method ends its process: the same rule.
b = A.options(max_restarts=1).remote()
try:
    ray.get(b.die.remote(), timeout=60)
except ray.exceptions.RayActorError as e:
    print("die:", type(e).__name__)
print("after die:", call_when_back(lambda: b.sleep.remote(0)))
ray.shutdown()
print("done")
