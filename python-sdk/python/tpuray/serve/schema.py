"""Serve's status types with Ray's names and shapes (``ray.serve.schema``): what
``serve.status()`` returns.

The statuses are ``str`` enums as in Ray, so ``print(app.status)`` shows
``ApplicationStatus.RUNNING`` and ``app.status == "RUNNING"`` holds.

Source: ``ray/serve/schema.py`` and ``ray/serve/_private/common.py`` (Ray 2.60).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum


class ApplicationStatus(str, Enum):
    NOT_STARTED = "NOT_STARTED"
    DEPLOYING = "DEPLOYING"
    DEPLOY_FAILED = "DEPLOY_FAILED"
    RUNNING = "RUNNING"
    UNHEALTHY = "UNHEALTHY"
    DELETING = "DELETING"


class DeploymentStatus(str, Enum):
    UPDATING = "UPDATING"
    HEALTHY = "HEALTHY"
    UNHEALTHY = "UNHEALTHY"
    DEPLOY_FAILED = "DEPLOY_FAILED"
    UPSCALING = "UPSCALING"
    DOWNSCALING = "DOWNSCALING"


class DeploymentStatusTrigger(str, Enum):
    UNSPECIFIED = "UNSPECIFIED"
    CONFIG_UPDATE_STARTED = "CONFIG_UPDATE_STARTED"
    CONFIG_UPDATE_COMPLETED = "CONFIG_UPDATE_COMPLETED"
    UPSCALE_COMPLETED = "UPSCALE_COMPLETED"
    DOWNSCALE_COMPLETED = "DOWNSCALE_COMPLETED"
    AUTOSCALING = "AUTOSCALING"
    REPLICA_STARTUP_FAILED = "REPLICA_STARTUP_FAILED"
    HEALTH_CHECK_FAILED = "HEALTH_CHECK_FAILED"
    INTERNAL_ERROR = "INTERNAL_ERROR"
    HEALTH_CHECK_RECOVERED = "HEALTH_CHECK_RECOVERED"
    DELETING = "DELETING"


class ReplicaState(str, Enum):
    STARTING = "STARTING"
    UPDATING = "UPDATING"
    RECOVERING = "RECOVERING"
    RUNNING = "RUNNING"
    STOPPING = "STOPPING"
    STOPPED = "STOPPED"
    UNHEALTHY = "UNHEALTHY"


class ProxyStatus(str, Enum):
    STARTING = "STARTING"
    HEALTHY = "HEALTHY"
    UNHEALTHY = "UNHEALTHY"
    DRAINING = "DRAINING"
    DRAINED = "DRAINED"


def _enum(cls, v):
    try:
        return cls(v)
    except ValueError:  # a state this version does not name: keep the text
        return v


@dataclass
class DeploymentStatusOverview:
    """One deployment's status (Ray's ``DeploymentStatusOverview``, plus tpuray's
    ``target_replicas``, ``replicas`` (``{"replica_id", "state", "actor_id", "node_id",
    "pid"}`` each) and ``autoscaling``)."""

    status: DeploymentStatus
    status_trigger: DeploymentStatusTrigger
    replica_states: dict
    message: str
    target_replicas: int = 0
    replicas: list = field(default_factory=list)
    autoscaling: dict | None = None


@dataclass
class ApplicationStatusOverview:
    """One application's status (Ray's ``ApplicationStatusOverview``)."""

    status: ApplicationStatus
    message: str
    last_deployed_time_s: float
    deployments: dict
    route_prefix: str | None = None
    ingress: str = ""


@dataclass
class ServeStatus:
    """``serve.status()`` (Ray's ``ServeStatus``): ``proxies`` ``{node id:
    ProxyStatus}``, ``applications`` ``{name: ApplicationStatusOverview}``. tpuray adds
    ``http`` (``{"host", "port"}`` the proxy serves) and ``to_dict()``, the JSON document
    ``tpuray serve status`` prints."""

    proxies: dict = field(default_factory=dict)
    applications: dict = field(default_factory=dict)
    target_capacity: float | None = None
    http: dict | None = None
    _doc: dict | None = None

    def to_dict(self) -> dict:
        return dict(self._doc or {})


def status_from_doc(doc: dict) -> ServeStatus:
    """The :class:`ServeStatus` of the controller's status document."""
    apps = {}
    for name, a in (doc.get("applications") or {}).items():
        deps = {
            dn: DeploymentStatusOverview(
                status=_enum(DeploymentStatus, d["status"]),
                status_trigger=_enum(DeploymentStatusTrigger, d["status_trigger"]),
                replica_states=dict(d["replica_states"]),
                message=d["message"],
                target_replicas=d.get("target_replicas", 0), replicas=list(d.get("replicas", [])),
                autoscaling=d.get("autoscaling"),
            )
            for dn, d in a["deployments"].items()
        }
        apps[name] = ApplicationStatusOverview(
            status=_enum(ApplicationStatus, a["status"]), message=a["message"],
            last_deployed_time_s=a["last_deployed_time_s"], deployments=deps,
            route_prefix=a.get("route_prefix"), ingress=a.get("ingress", ""),
        )
    return ServeStatus(proxies={k: _enum(ProxyStatus, v) for k, v in (doc.get("proxies") or {}).items()},
                       applications=apps, target_capacity=doc.get("target_capacity"),
                       http=doc.get("http"), _doc=doc)
