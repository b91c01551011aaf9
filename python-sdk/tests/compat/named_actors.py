"""ray.util.list_named_actors in Ray's two shapes; named actors live in the job's
namespace unless given one; dead ones leave the list; get_actor across namespaces."""

import time

import ray
from ray.util import list_named_actors

ray.init(num_cpus=4, namespace="compat")


@ray.remote(num_cpus=0)
class Named:
    def __init__(self, tag):
        self.tag = tag

    def tag_and_namespace(self):
        return self.tag, ray.get_runtime_context().namespace

    def spawn(self, name):
        # Created by an actor: lands in the job's namespace too.
        self.child = Named.options(name=name).remote("child")
        return ray.get(self.child.tag_and_namespace.remote())


print("none yet", list_named_actors(), list_named_actors(all_namespaces=True))
a = Named.options(name="alpha").remote("a")
b = Named.options(name="beta").remote("b")
c = Named.options(name="gamma", namespace="elsewhere").remote("c")
anonymous = Named.remote("anonymous")
print("calls", ray.get([x.tag_and_namespace.remote() for x in (a, b, c, anonymous)]))
print("spawned", ray.get(a.spawn.remote("delta")))

print("this namespace", sorted(list_named_actors()))
entries = list_named_actors(all_namespaces=True)
print("all namespaces", sorted(entries, key=lambda d: (d["namespace"], d["name"])))
print("entry keys", sorted(entries[0]))

print("get_actor here", ray.get(ray.get_actor("beta").tag_and_namespace.remote()))
print("get_actor there", ray.get(ray.get_actor("gamma", namespace="elsewhere").tag_and_namespace.remote()))
try:
    ray.get_actor("gamma")
except ValueError:
    print("gamma is not in this namespace")

for ns in (None, "elsewhere"):
    try:
        Named.options(name="gamma" if ns else "alpha", namespace=ns).remote("again")
    except ValueError as e:
        print("taken", type(e).__name__, isinstance(e, ray.exceptions.RayError), e)

ray.kill(b)
time.sleep(1)
print("after kill", sorted(list_named_actors()))
ray.shutdown()
