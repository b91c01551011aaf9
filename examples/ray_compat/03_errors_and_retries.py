"""Exceptions re-raised at get, retries of application errors, actor restarts."""
import os
import signal
import tempfile

import tpuray as ray

ray.init(num_cpus=2)


class InsufficientFunds(Exception):
    pass


@ray.remote
def withdraw(amount):
    if amount > 100:
        raise InsufficientFunds(f"cannot withdraw {amount}")
    return amount


try:
    ray.get(withdraw.remote(500))
except InsufficientFunds as e:
    print("caught user exception:", type(e).__name__, "| is RayTaskError:",
          isinstance(e, ray.exceptions.RayTaskError), "|", e.args)

print("small withdrawal:", ray.get(withdraw.remote(50)))

counter_file = os.path.join(tempfile.mkdtemp(), "attempts")


@ray.remote(max_retries=3, retry_exceptions=True)
def flaky(path):
    n = int(open(path).read()) if os.path.exists(path) else 0
    with open(path, "w") as f:
        f.write(str(n + 1))
    if n < 2:
        raise ValueError(f"attempt {n} fails")
    return f"succeeded on attempt {n}"


print("retried:", ray.get(flaky.remote(counter_file)))

kill_file = os.path.join(tempfile.mkdtemp(), "killed")


@ray.remote(max_retries=2)
def dies_once(path):
    if not os.path.exists(path):
        open(path, "w").close()
        os.kill(os.getpid(), signal.SIGKILL)
    return "survived a worker crash"


print("worker crash retried:", ray.get(dies_once.remote(kill_file)))


@ray.remote(max_restarts=1)
class Phoenix:
    def __init__(self):
        self.calls = 0

    def call(self):
        self.calls += 1
        return self.calls

    def pid(self):
        return os.getpid()


p = Phoenix.remote()
print("before crash:", ray.get(p.call.remote()), ray.get(p.call.remote()))
os.kill(ray.get(p.pid.remote()), signal.SIGKILL)
for _ in range(100):
    try:
        print("after restart:", ray.get(p.call.remote()))
        break
    except ray.exceptions.RayActorError:
        import time
        time.sleep(0.2)
ray.shutdown()
