"""``tpuray.serve``: Ray Serve's core API on tpuray (``from tpuray import serve``).

Deployments (classes and functions) with replicas and per-replica resources (TPU chips
included: ``ray_actor_options={"resources": {"TPU": 4}}``, or a whole slice per replica
through ``placement_group_bundles``), composition by binding deployments into others,
handles whose responses can be awaited or passed on, streaming responses, HTTP through
Starlette and ``@serve.ingress(fastapi_app)`` (ASGI in the replica, ``http.py``),
``@serve.batch``, ``@serve.multiplexed``, in-place ``user_config`` updates, autoscaling
on ongoing requests (down to zero), replica health checks and replacement, a
prefix-affinity request router for LLM-style requests, ``tpuray serve
run|deploy|build`` (``_cli.py``) and Ray's Serve REST API on the head.

Processes: a detached controller actor (``_controller.py``), one detached replica actor
per replica (``_replica.py``), a detached HTTP proxy actor (``_proxy.py``); handles
route in the calling process (``handle.py``). The controller's status is JSON in the
head's KV (namespace ``serve``, key ``status``), printed by ``tpuray serve status``.

Sources: https://docs.ray.io/en/latest/serve/ (the API reference and the guides named
in each module).

Absent: gRPC, ``max_replicas_per_node``, runtime environments in serve configs (see the
package README's deviations).
"""

from __future__ import annotations

import re
import sys
import time

import tpuray
from tpuray.serve import _common, exceptions
from tpuray.serve._common import DEFAULT_APP_NAME
from tpuray.serve._replica import ReplicaContext, ReplicaID
from tpuray.serve.batching import batch
from tpuray.serve.deployment import Application, Deployment, deployment
from tpuray.serve.exceptions import RayServeException
from tpuray.serve.handle import DeploymentHandle, DeploymentResponse, DeploymentResponseGenerator
from tpuray.serve._ingress import ingress
from tpuray.serve.http import Request
from tpuray.serve.multiplex import get_multiplexed_model_id, multiplexed
from tpuray.serve.schema import (
    ApplicationStatus,
    ApplicationStatusOverview,
    DeploymentStatus,
    DeploymentStatusOverview,
    ServeStatus,
    status_from_doc,
)

__all__ = [
    "Application", "Deployment", "DeploymentHandle", "DeploymentResponse", "ReplicaID",
    "DeploymentResponseGenerator", "ReplicaContext", "Request", "batch", "delete",
    "deployment", "exceptions", "get_app_handle", "get_deployment_handle",
    "get_multiplexed_model_id", "get_replica_context", "ingress", "multiplexed", "run",
    "shutdown", "start", "status", "ApplicationStatus", "DeploymentStatus",
]

_HTTP_KEYS = {"host", "port"}
_HTTP_IGNORED = {"location", "root_path", "request_timeout_s", "keep_alive_timeout_s", "middlewares"}


def _http_options(http_options) -> dict:
    if http_options is None:
        return {}
    if not isinstance(http_options, dict):
        http_options = {k: v for k, v in vars(http_options).items() if not k.startswith("_")}
    out = {}
    for k, v in http_options.items():
        if k in _HTTP_IGNORED:
            continue
        if k not in _HTTP_KEYS:
            raise ValueError(f"unknown http_options key {k!r}; expected some of {sorted(_HTTP_KEYS)}")
        out[k] = v
    if "port" in out and (isinstance(out["port"], bool) or not isinstance(out["port"], int)
                          or not 0 <= out["port"] <= 65535):
        raise ValueError(f"http_options['port'] must be an integer port 0..65535 (got {out['port']!r})")
    if "host" in out and not isinstance(out["host"], str):
        raise TypeError(f"http_options['host'] must be a string (got {out['host']!r})")
    return out


def start(http_options=None, **_ignored) -> None:
    """Starts serve's controller on the cluster (``serve.run`` does it too): HTTP on
    ``http_options["host"]`` (default ``127.0.0.1``) and ``["port"]`` (default 8000;
    0: any free port, see ``serve.status().http``). A controller that already runs
    keeps its options (a message says so when they differ)."""
    opts = _http_options(http_options)
    ctrl = _common.get_controller(create=True, http_options=opts)
    cur = tpuray.get(ctrl.ready.remote())["http"]
    for k, v in opts.items():
        if cur.get(k) != v and not (k == "port" and v == 0):
            print(f"serve: the running controller keeps http_options {cur} (asked for {opts})", file=sys.stderr)
            break


def _check_route_prefix(route_prefix):
    if route_prefix is None:
        return
    if not isinstance(route_prefix, str):
        raise TypeError(f"route_prefix must be a string or None (got {route_prefix!r})")
    if not route_prefix.startswith("/"):
        raise ValueError(f"route_prefix must start with '/' (got {route_prefix!r})")
    if route_prefix != "/" and route_prefix.endswith("/"):
        raise ValueError(f"route_prefix must not end with '/' unless it is '/' (got {route_prefix!r})")
    if re.search(r"[{}\s?#]", route_prefix):
        raise ValueError(f"route_prefix may not contain braces, spaces, '?' or '#' (got {route_prefix!r})")


def _payload(target: Application, name: str):
    """``(ingress name, [{"name", "target", "init", "config"}])``: the application's
    deployments, pickled, for the controller's ``deploy_application``.

    Raises:
        TypeError: a deployment or its arguments cannot be pickled.
    """
    from tpuray._private.serialization import serialize

    ingress, deps = target._build(name)
    payload = []
    for d in deps:
        try:
            target_bytes = serialize(d["target"])[0]
            init_bytes = serialize((d["args"], d["kwargs"]))[0]
        except Exception as e:
            raise TypeError(f"deployment {d['name']!r} or its bind() arguments cannot be pickled: {e}") from e
        payload.append({"name": d["name"], "target": target_bytes, "init": init_bytes, "config": d["config"]})
    return ingress, payload


def run(target, blocking: bool = False, name: str = DEFAULT_APP_NAME, route_prefix: str | None = "/",
        logging_config=None, _local_testing_mode: bool = False, http_options=None) -> DeploymentHandle:
    """Deploys an application and waits until it runs (Ray's ``serve.run``).

    Args:
        target: an ``Application`` (``MyDeployment.bind(...)``).
        blocking: after deploying, block until Ctrl-C.
        name: the application's name (unique; deploying a name again updates it).
        route_prefix: the HTTP path prefix of its ingress, or None for no HTTP.
        http_options: for a controller this call starts (see :func:`start`).

    Returns:
        A ``DeploymentHandle`` to the ingress deployment.

    Raises:
        TypeError/ValueError: bad arguments (a ``Deployment`` not bound, a bad prefix,
            a route prefix another application uses).
        RayServeException: the application failed to deploy (the error of its replicas'
            constructor, or the proxy could not bind its port).
    """
    if isinstance(target, Deployment):
        raise TypeError(
            f"serve.run expects an Application: call {target.name}.bind(...) and pass its result"
        )
    if not isinstance(target, Application):
        raise TypeError(f"serve.run expects an Application from Deployment.bind() (got {type(target).__name__})")
    if not isinstance(name, str) or not name:
        raise TypeError(f"the application name must be a non-empty string (got {name!r})")
    _check_route_prefix(route_prefix)
    ingress, payload = _payload(target, name)
    ctrl = _common.get_controller(create=True, http_options=_http_options(http_options))
    try:
        tpuray.get(ctrl.deploy_application.remote(name, route_prefix, ingress, payload))
    except tpuray.exceptions.RayTaskError as e:
        cause = getattr(e, "cause", None)
        if isinstance(cause, (ValueError, TypeError)):
            raise type(cause)(str(cause)) from None
        raise
    last_note = time.monotonic()
    while True:
        st = tpuray.get(ctrl.app_status.remote(name))
        if st is None:
            raise RayServeException(f"application {name!r} was deleted while it was being deployed")
        if st["status"] == "DEPLOY_FAILED":
            raise exceptions.DeployFailedError(f"application {name!r} failed to deploy: {st['message']}")
        if route_prefix is not None and st["proxy_error"] and st["proxy_state"] != "HEALTHY":
            raise RayServeException(f"application {name!r} has no HTTP ingress: {st['proxy_error']}")
        if st["status"] == "RUNNING" and (route_prefix is None or st["proxy_state"] == "HEALTHY"):
            break
        if time.monotonic() - last_note > 30:
            last_note = time.monotonic()
            print(f"serve: waiting for application {name!r} ({st['status']}): {st['message']}", file=sys.stderr)
        time.sleep(0.1)
    handle = DeploymentHandle(ingress, name)
    if blocking:
        try:
            while True:
                time.sleep(1)
        except KeyboardInterrupt:
            pass
    return handle


def delete(name: str, _blocking: bool = True) -> None:
    """Deletes an application (its replicas stop gracefully); waits until it is gone.
    Deleting a name that does not exist does nothing (as in Ray)."""
    ctrl = _common.get_controller()
    tpuray.get(ctrl.delete_apps.remote([name]))
    while _blocking and name in tpuray.get(ctrl.list_apps.remote()):
        time.sleep(0.1)


def shutdown() -> None:
    """Deletes every application and stops the controller and the proxy (Ray's
    ``serve.shutdown``). Does nothing when serve does not run."""
    try:
        ctrl = _common.get_controller()
    except RayServeException:
        return
    from tpuray.serve.handle import _stop_routers

    try:
        tpuray.get(ctrl.shutdown.remote(), timeout=90)
    finally:
        try:
            tpuray.kill(ctrl)
        except Exception:  # noqa: BLE001 - already gone
            pass
        _common.forget_controller()
        _stop_routers()


def get_app_handle(name: str) -> DeploymentHandle:
    """A handle to application ``name``'s ingress.

    Raises:
        RayServeException: no such application.
    """
    st = tpuray.get(_common.get_controller().app_status.remote(name))
    if st is None:
        raise RayServeException(f"Application '{name}' does not exist.")
    return DeploymentHandle(st["ingress"], name)


def get_deployment_handle(deployment_name: str, app_name: str | None = None) -> DeploymentHandle:
    """A handle to a deployment of an application (default: the caller's own
    application inside a replica, else ``"default"``)."""
    if app_name is None:
        ctx = _replica_context_or_none()
        app_name = ctx.app_name if ctx is not None else DEFAULT_APP_NAME
    return DeploymentHandle(deployment_name, app_name)


def _replica_context_or_none():
    from tpuray.serve import _replica

    return _replica.current_context()


def get_replica_context() -> ReplicaContext:
    """The replica's context (app name, deployment, replica id, the object itself).

    Raises:
        RayServeException: not called from within a replica.
    """
    ctx = _replica_context_or_none()
    if ctx is None:
        raise RayServeException(
            "`serve.get_replica_context()` may only be called from within a Ray Serve deployment."
        )
    return ctx


def status() -> ServeStatus:
    """The applications, their deployments and replicas, as the controller has them
    (or as it last wrote them to the KV when it no longer runs; empty when serve never
    ran here)."""
    tpuray._private.worker.check_connected()
    try:
        doc = tpuray.get(_common.get_controller().status.remote(), timeout=30)
    except RayServeException:
        doc = _common.read_status_from_kv() or {}
        if (doc.get("controller") or {}).get("state") == "STOPPED":
            doc = dict(doc, applications={})
    return status_from_doc(doc)
