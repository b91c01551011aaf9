"""A task error reaching the caller through nested gets is still an instance of the
original exception class at every depth (Ray's RayTaskError.as_instanceof_cause)."""

import ray

ray.init(num_cpus=4)


class MyError(ValueError):
    def __init__(self, code):
        super().__init__(f"code {code}")
        self.code = code


@ray.remote
def fail(kind):
    if kind == "zero":
        return 1 / 0
    raise MyError(7)


@ray.remote
def middle(kind):
    return ray.get(fail.remote(kind))


@ray.remote
def outer(kind):
    return ray.get(middle.remote(kind))


for depth, f in ((1, fail), (2, middle), (3, outer)):
    for kind in ("zero", "mine"):
        try:
            ray.get(f.remote(kind))
        except Exception as e:  # noqa: BLE001
            print(depth, kind, type(e).__name__,
                  isinstance(e, ray.exceptions.RayTaskError),
                  isinstance(e, ZeroDivisionError), isinstance(e, MyError),
                  getattr(e, "code", None), isinstance(e.cause, Exception))
try:
    ray.get(outer.remote("zero"))
except ZeroDivisionError:
    print("except ZeroDivisionError catches a depth-3 error")


@ray.remote
class Relay:
    def call(self, kind):
        return ray.get(middle.remote(kind))


try:
    ray.get(Relay.remote().call.remote("mine"))
except MyError as e:
    print("through an actor", type(e).__name__, e.code)
ray.shutdown()
