"""max_pending_calls (Ray 2.60): a caller with that many unfinished calls to the actor
gets PendingCallsLimitExceeded at .remote(); once calls finish, calls go through again."""

import ray
from ray.exceptions import PendingCallsLimitExceeded

ray.init(num_cpus=2)


@ray.remote
class Gate:
    def __init__(self):
        self.open = False

    def release(self):
        self.open = True

    def is_open(self):
        return self.open


@ray.remote(max_pending_calls=2)
class Limited:
    def wait_for(self, gate):
        while not ray.get(gate.is_open.remote()):
            pass
        return "through"

    def ping(self):
        return "pong"


gate = Gate.remote()
a = Limited.remote()
first = [a.wait_for.remote(gate), a.wait_for.remote(gate)]
try:
    a.ping.remote()
    print("third call accepted")
except PendingCallsLimitExceeded:
    print("third call: PendingCallsLimitExceeded")
ray.get(gate.release.remote())
print("first two", ray.get(first))
print("after they finished", ray.get(a.ping.remote()), ray.get(a.ping.remote()))
b = Limited.options(max_pending_calls=-1).remote()
print("no limit", len(ray.get([b.ping.remote() for _ in range(10)])))
