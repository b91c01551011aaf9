"""What ray.init() returns: a RayContext (a Mapping over address_info) with
dashboard_url, python_version, ray_version, ray_commit; disconnect() shuts down."""

import sys
from collections.abc import Mapping

import ray

ctx = ray.init(num_cpus=1)
print("type", type(ctx).__name__, isinstance(ctx, Mapping))
print("python_version", ctx.python_version == "{}.{}.{}".format(*sys.version_info[:3]))
print("ray_version is str", isinstance(ctx.ray_version, str))
print("ray_commit is str", isinstance(ctx.ray_commit, str))
print("dashboard_url", type(ctx.dashboard_url).__name__, "://" not in (ctx.dashboard_url or ""))
info = ctx.address_info
for key in ("node_ip_address", "gcs_address", "address", "webui_url", "node_id"):
    print("address_info has", key, key in info)
print("node_id matches", info["node_id"] == ray.get_runtime_context().get_node_id())
print("getitem", ctx["node_id"] == info["node_id"], len(ctx) == len(info),
      sorted(ctx) == sorted(info))
print("gcs_address is host:port", info["gcs_address"].rsplit(":", 1)[1].isdigit())
ctx.disconnect()
print("disconnect shuts down", ray.is_initialized())
