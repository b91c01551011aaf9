"""Ray Serve: user_config reaches reconfigure() at start and on every change (whether
the replica is kept is not compared: Ray's serve.run gives each deploy a new code
version and so new replicas, tpuray keeps replicas whose code is the same and
reconfigures them in place; test_serve.py checks that)."""

import os

import ray
from ray import serve


@serve.deployment(ray_actor_options={"num_cpus": 0}, user_config={"greeting": "hello"})
class Greeter:
    def __init__(self):
        self.pid = os.getpid()
        self.greeting = None
        self.reconfigured = 0

    def reconfigure(self, config):
        self.greeting = config["greeting"]
        self.reconfigured += 1

    def __call__(self, name):
        return f"{self.greeting} {name}"

    def info(self):
        return self.pid, self.reconfigured


ray.init(num_cpus=2)
h = serve.run(Greeter.bind(), name="greet", route_prefix=None)
print(h.remote("ann").result())
pid, n = h.info.remote().result()
print("reconfigured", n)

h = serve.run(Greeter.options(user_config={"greeting": "bonjour"}).bind(), name="greet", route_prefix=None)
print(h.remote("ann").result())
pid2, n2 = h.info.remote().result()
print("reconfigured", n2 >= 1)

h = serve.run(Greeter.options(user_config={"greeting": "hola"}).bind(), name="greet", route_prefix=None)
print(h.remote("bo").result())
pid3, n3 = h.info.remote().result()
print("reconfigured", n3 >= 1)
print(serve.status().applications["greet"].status)


@serve.deployment(ray_actor_options={"num_cpus": 0})
class NoReconfigure:
    def __call__(self):
        return 1


try:
    serve.run(NoReconfigure.options(user_config={"a": 1}).bind(), name="bad", route_prefix=None)
except Exception as e:
    print("no reconfigure method:", isinstance(e, RuntimeError))
serve.shutdown()
ray.shutdown()
