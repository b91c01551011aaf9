"""init()'s refusals and keywords as Ray 2.60 has them: unknown keywords, local_mode,
allow_multiple, storage, sizing options when joining an existing cluster, labels of a
new local cluster, a bad _system_config."""

import subprocess
import sys

import ray

for kwargs in ({"num_cpu": 2}, {"local_mode": True}, {"allow_multiple": True},
               {"storage": "/tmp/x"}, {"_system_config": [1]}):
    try:
        ray.init(**kwargs)
    except (RuntimeError, TypeError, ValueError) as e:
        print(sorted(kwargs), type(e).__name__, e)
print("nothing started", ray.is_initialized())

ctx = ray.init(num_cpus=2, labels={"zone": "z1", "tier": "gold"})


@ray.remote
def labels():
    node = ray.get_runtime_context().get_node_labels()
    return node.get("zone"), node.get("tier")


print("labels honoured", ray.get(labels.remote()))
print("nodes carry labels", [n["Labels"].get("zone") for n in ray.nodes()])
address = ctx.address_info["address"]
JOIN = """
import sys, ray
try:
    ray.init(address=sys.argv[1], **eval(sys.argv[2]))
    print("joined")
except ValueError as e:
    print("ValueError", e)
"""
for kw in ("{'num_cpus': 1}", "{'num_gpus': 1}", "{'resources': {'x': 1}}",
           "{'labels': {'a': 'b'}}", "{'object_store_memory': 10**8}", "{}"):
    out = subprocess.run([sys.executable, "-c", JOIN, address, kw],
                         capture_output=True, text=True, timeout=120)
    print(kw, out.stdout.strip())
ray.shutdown()
