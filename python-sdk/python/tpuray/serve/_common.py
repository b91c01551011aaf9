"""Names and small helpers shared by the serve controller, replicas, proxy and handles.

The controller, the HTTP proxy and every replica are detached named actors in the
namespace :data:`SERVE_NAMESPACE`, so they outlive the driver that called
``serve.run`` (as in Ray Serve) and any process of the cluster can find them.
"""

from __future__ import annotations

import json
import threading

#: Namespace of serve's actors and of its key in the head's KV.
SERVE_NAMESPACE = "serve"
#: Name of the controller actor (Ray's ``SERVE_CONTROLLER_ACTOR``).
CONTROLLER_NAME = "SERVE_CONTROLLER_ACTOR"
#: Name of the HTTP proxy actor.
PROXY_NAME = "SERVE_PROXY_ACTOR"
#: KV key (namespace :data:`SERVE_NAMESPACE`) of the controller's status document, JSON;
#: ``tpuray serve status`` prints it.
STATUS_KEY = b"status"
#: KV key of the controller's checkpoint (pickled applications, deployments and replica
#: names), read by a restarted controller.
CHECKPOINT_KEY = b"checkpoint"
#: KV key of the applications declared through Ray's REST API (``PUT
#: /api/serve/applications/`` on the head's dashboard port): JSON ``{"seq", "config"}`` or
#: ``{"seq", "shutdown": true}``, written by the head, applied by the controller.
DECLARED_KEY = b"declared"
#: Ray Serve's default application name.
DEFAULT_APP_NAME = "default"

#: Replica states, as Ray's ``ReplicaState``.
STARTING, RUNNING, UNHEALTHY, STOPPING = "STARTING", "RUNNING", "UNHEALTHY", "STOPPING"

_controller_lock = threading.Lock()
_controller = None


def get_controller(create: bool = False, http_options: dict | None = None):
    """The controller's actor handle (cached per process).

    Args:
        create: start the controller when none runs (``serve.run``/``serve.start``).
        http_options: the proxy's ``{"host", "port"}`` for a new controller.

    Raises:
        RayServeException: no controller runs and ``create`` is false.
    """
    global _controller
    import tpuray

    from tpuray.serve.exceptions import RayServeException

    with _controller_lock:
        if _controller is not None:
            return _controller
        tpuray._private.worker.auto_init() if create else tpuray._private.worker.check_connected()
        try:
            _controller = tpuray.get_actor(CONTROLLER_NAME, namespace=SERVE_NAMESPACE)
            return _controller
        except ValueError:
            if not create:
                raise RayServeException(
                    "there is no serve instance running on this cluster: start one with "
                    "serve.run(app) or serve.start()"
                ) from None
        from tpuray.serve._controller import ServeController

        _controller = (
            tpuray.remote(ServeController)
            .options(
                name=CONTROLLER_NAME,
                namespace=SERVE_NAMESPACE,
                lifetime="detached",
                num_cpus=0,
                max_concurrency=256,
                max_restarts=-1,
                get_if_exists=True,
            )
            .remote(http_options or {})
        )
        tpuray.get(_controller.ready.remote(), timeout=120)
        return _controller


def forget_controller() -> None:
    """Drops the cached controller handle (after ``serve.shutdown``)."""
    global _controller
    with _controller_lock:
        _controller = None


def read_status_from_kv() -> dict | None:
    """The controller's last status document from the head's KV, or None."""
    from tpuray import _tpuray

    raw = _tpuray.kv_get(SERVE_NAMESPACE, STATUS_KEY)
    return None if raw is None else json.loads(raw)


def is_actor_death(e: BaseException) -> bool:
    """Whether ``e`` says the replica's process is gone (worth a retry on another
    replica), as opposed to an error the user's code raised there."""
    from tpuray import exceptions as ex

    if isinstance(e, ex.RayTaskError):
        return False
    return isinstance(e, (ex.RayActorError, ex.WorkerCrashedError, ex.NodeDiedError))
