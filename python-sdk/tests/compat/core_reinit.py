"""init() after shutdown() in one process (pytest fixtures, notebooks): functions and
classes defined before keep working; init() twice is refused with Ray's message unless
ignore_reinit_error; `with ray.init():` shuts down at exit."""

import ray


@ray.remote
def square(x):
    return x * x


@ray.remote
class Box:
    def __init__(self, v):
        self.v = v

    def get(self):
        return self.v


for round_ in range(3):
    ray.init(num_cpus=2)
    print("round", round_, ray.get([square.remote(i) for i in range(4)]),
          ray.get(Box.remote(round_).get.remote()))
    try:
        ray.init(num_cpus=2)
    except RuntimeError as e:
        print("twice:", e)
    again = ray.init(ignore_reinit_error=True)
    print("ignore_reinit_error returns a context", again is not None)
    ray.shutdown()
    print("initialized after shutdown", ray.is_initialized())

with ray.init(num_cpus=1) as ctx:
    print("inside with", ray.is_initialized(), ray.get(square.remote(7)))
print("after with", ray.is_initialized())
ray.shutdown()  # a second shutdown is harmless
print("shutdown twice ok")
