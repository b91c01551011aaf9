"""Namespaces: a job given none gets an anonymous one of its own, so two such drivers
never see each other's named actors; drivers in one named namespace do; inside an actor
made in another namespace, get_runtime_context().namespace is the job's."""

import subprocess
import sys
import uuid

import ray

ctx = ray.init(num_cpus=2)
address = ctx.address_info["address"]
ns = ray.get_runtime_context().namespace
print("anonymous namespace is a uuid", str(uuid.UUID(ns)) == ns)


@ray.remote(num_cpus=0)
class Probe:
    def namespace(self):
        return ray.get_runtime_context().namespace


p = Probe.options(name="probe", lifetime="detached").remote()
print("actor sees the job's namespace", ray.get(p.namespace.remote()) == ns)
q = Probe.options(name="probe2", namespace="other").remote()
print("actor in another namespace sees the job's", ray.get(q.namespace.remote()) == ns)

OTHER = """
import sys, ray
ray.init(address=sys.argv[1], namespace=sys.argv[2] or None)
for name, namespace in (("probe", None), ("probe2", "other"), ("probe", sys.argv[3])):
    try:
        ray.get_actor(name, namespace=namespace)
        print(name, namespace == sys.argv[3] and "job" or namespace, "found")
    except ValueError:
        print(name, namespace == sys.argv[3] and "job" or namespace, "not found")
ray.shutdown()
"""
for label, other_ns in (("anonymous driver", ""), ("same namespace", ns)):
    out = subprocess.run([sys.executable, "-c", OTHER, address, other_ns, ns],
                         capture_output=True, text=True, timeout=120)
    print(label, out.stdout.split("\n"), out.returncode)
ray.kill(p)
ray.shutdown()

ray.init(num_cpus=1, namespace="named")
print("given namespace", ray.get_runtime_context().namespace)
print("actor", ray.get(Probe.options(namespace="else").remote().namespace.remote()))
ray.shutdown()
