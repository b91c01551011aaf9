"""Deployment options with Ray Serve's names, defaults and checks.

Sources: Ray Serve's ``@serve.deployment`` reference
(https://docs.ray.io/en/latest/serve/api/doc/ray.serve.deployment.html) and
``AutoscalingConfig`` (https://docs.ray.io/en/latest/serve/api/doc/ray.serve.config.AutoscalingConfig.html).
Every check raises ``TypeError``/``ValueError`` naming the option, what it got and what
it expects.
"""

from __future__ import annotations

import copy
import math
import numbers
from typing import Any

#: Ray Serve's defaults (Ray >= 2.32: ``max_ongoing_requests`` 5; health checks every 10 s
#: with a 30 s timeout; graceful shutdown waits up to 20 s).
DEFAULTS = {
    "num_replicas": 1,
    "max_ongoing_requests": 5,
    "max_queued_requests": -1,
    "health_check_period_s": 10.0,
    "health_check_timeout_s": 30.0,
    "graceful_shutdown_wait_loop_s": 2.0,
    "graceful_shutdown_timeout_s": 20.0,
    "user_config": None,
    "autoscaling_config": None,
    "ray_actor_options": None,
    "request_router": "pow2",
    "request_router_kwargs": None,
    "placement_group_bundles": None,
    "placement_group_strategy": None,
}

#: Options accepted for compatibility and ignored (documented in the package README).
IGNORED = {"logging_config", "max_replicas_per_node"}
UNSUPPORTED = {
    "placement_group_bundle_label_selector": "tpuray picks a slice's hosts itself (a bundle "
    "naming a slice's TPU-<type>-head reserves one whole intact slice)",
    "gang_scheduling_config": "use placement_group_bundles for a replica that spans hosts",
    "route_prefix": "route_prefix is set per application: serve.run(app, route_prefix=...)",
    "request_router_config": "use request_router='prefix_affinity' and request_router_kwargs={...}",
    # As Ray 2.60: "`version` in `@serve.deployment` has been removed".
    "version": "it was removed from Ray Serve; serve manages deployment versions internally",
}
DEPLOYMENT_OPTIONS = set(DEFAULTS) | IGNORED | {"name"}

#: ``ray_actor_options`` keys Ray Serve accepts for replicas.
ACTOR_OPTIONS = {
    "num_cpus", "num_gpus", "memory", "resources", "accelerator_type", "runtime_env",
    "label_selector", "object_store_memory",
}

#: Request routers: ``pow2`` (power of two choices on ongoing requests, Ray's default) and
#: ``prefix_affinity`` (same prompt prefix -> same replica while it is not overloaded).
ROUTERS = {"pow2", "prefix_affinity"}
ROUTER_KWARGS = {"prefix_chars": 64, "imbalanced_threshold": 4}

AUTOSCALING_DEFAULTS = {
    "min_replicas": 1,
    "initial_replicas": None,
    "max_replicas": 1,
    "target_ongoing_requests": 2.0,
    "metrics_interval_s": 10.0,
    "look_back_period_s": 30.0,
    "smoothing_factor": 1.0,
    "upscale_smoothing_factor": None,
    "downscale_smoothing_factor": None,
    "upscaling_factor": None,
    "downscaling_factor": None,
    "downscale_delay_s": 600.0,
    "downscale_to_zero_delay_s": None,
    "upscale_delay_s": 30.0,
    "aggregation_function": "mean",
}
_AUTOSCALING_ALIASES = {"target_num_ongoing_requests_per_replica": "target_ongoing_requests"}


def _number(name, v, *, minimum=None, strict=False, integer=False):
    if isinstance(v, bool) or not isinstance(v, numbers.Real):
        raise TypeError(f"{name} must be a {'integer' if integer else 'number'} (got {v!r})")
    if integer and int(v) != v:
        raise TypeError(f"{name} must be an integer (got {v!r})")
    if minimum is not None and (v <= minimum if strict else v < minimum):
        raise ValueError(f"{name} must be {'>' if strict else '>='} {minimum} (got {v!r})")
    return int(v) if integer else float(v)


def autoscaling_config(cfg) -> dict:
    """Ray's ``autoscaling_config`` as a dict with every key filled in.

    Raises:
        TypeError/ValueError: an unknown key, a value of the wrong type, or
            ``min_replicas <= initial_replicas <= max_replicas`` broken.
    """
    if hasattr(cfg, "__dict__") and not isinstance(cfg, dict):
        cfg = {k: v for k, v in vars(cfg).items() if not k.startswith("_")}
    if not isinstance(cfg, dict):
        raise TypeError(f"autoscaling_config must be a dict (got {type(cfg).__name__})")
    out: dict[str, Any] = dict(AUTOSCALING_DEFAULTS)
    for k, v in cfg.items():
        k = _AUTOSCALING_ALIASES.get(k, k)
        if k not in AUTOSCALING_DEFAULTS:
            raise ValueError(
                f"unknown autoscaling_config key {k!r}; expected one of {sorted(AUTOSCALING_DEFAULTS)}"
            )
        out[k] = v
    out["min_replicas"] = _number("autoscaling_config.min_replicas", out["min_replicas"], minimum=0, integer=True)
    out["max_replicas"] = _number("autoscaling_config.max_replicas", out["max_replicas"], minimum=1, integer=True)
    if out["max_replicas"] < out["min_replicas"]:
        raise ValueError(
            f"autoscaling_config.max_replicas ({out['max_replicas']}) must be >= min_replicas "
            f"({out['min_replicas']})"
        )
    if out["initial_replicas"] is not None:
        ir = _number("autoscaling_config.initial_replicas", out["initial_replicas"], minimum=0, integer=True)
        if not out["min_replicas"] <= ir <= out["max_replicas"]:
            raise ValueError(
                f"autoscaling_config.initial_replicas ({ir}) must lie between min_replicas and max_replicas"
            )
        out["initial_replicas"] = ir
    out["target_ongoing_requests"] = _number(
        "autoscaling_config.target_ongoing_requests", out["target_ongoing_requests"], minimum=0, strict=True
    )
    for k in ("metrics_interval_s", "look_back_period_s", "upscale_delay_s", "downscale_delay_s"):
        out[k] = _number(f"autoscaling_config.{k}", out[k], minimum=0)
    for k in ("downscale_to_zero_delay_s",):
        if out[k] is not None:
            out[k] = _number(f"autoscaling_config.{k}", out[k], minimum=0)
    for k in ("smoothing_factor", "upscale_smoothing_factor", "downscale_smoothing_factor",
              "upscaling_factor", "downscaling_factor"):
        if out[k] is not None:
            out[k] = _number(f"autoscaling_config.{k}", out[k], minimum=0, strict=True)
    return out


def deployment_options(opts: dict, base: dict | None = None) -> dict:
    """Checks ``@serve.deployment``/``.options`` keyword options and merges them over
    ``base`` (the deployment's current options, else :data:`DEFAULTS`).

    Raises:
        TypeError/ValueError: naming the option at fault and what it expects.
    """
    out: dict[str, Any] = copy.deepcopy(base) if base is not None else copy.deepcopy(DEFAULTS)
    for k, v in opts.items():
        if k in UNSUPPORTED:
            raise ValueError(f"deployment option {k!r} is not supported: {UNSUPPORTED[k]}")
        if k not in DEPLOYMENT_OPTIONS:
            raise TypeError(
                f"unknown deployment option {k!r}; expected one of {sorted(DEPLOYMENT_OPTIONS - IGNORED)}"
            )
        if k in IGNORED:
            continue
        out[k] = v
    if "name" in out and out["name"] is not None and not isinstance(out["name"], str):
        raise TypeError(f"name must be a string (got {out['name']!r})")
    if "num_replicas" in opts and opts["num_replicas"] is not None and "autoscaling_config" in opts \
            and opts["autoscaling_config"] is not None and opts["num_replicas"] != "auto":
        raise ValueError(
            "Manually setting num_replicas is not allowed when autoscaling_config is provided."
        )
    if "autoscaling_config" in opts and opts["autoscaling_config"] is not None:
        out["num_replicas"] = None
    elif "num_replicas" in opts:
        out["autoscaling_config"] = None
    nr = out["num_replicas"]
    if nr == "auto":
        # Ray's num_replicas="auto": autoscaling between 1 and 100 replicas.
        ac = {"min_replicas": 1, "max_replicas": 100}
        ac.update(out["autoscaling_config"] or {})
        out["autoscaling_config"] = ac
        out["num_replicas"] = None
    elif nr is None:
        if out["autoscaling_config"] is None:
            out["num_replicas"] = 1
    else:
        out["num_replicas"] = _number("num_replicas", nr, minimum=0, integer=True)
    if out["autoscaling_config"] is not None:
        out["autoscaling_config"] = autoscaling_config(out["autoscaling_config"])
    out["max_ongoing_requests"] = _number("max_ongoing_requests", out["max_ongoing_requests"], minimum=1, integer=True)
    mq = _number("max_queued_requests", out["max_queued_requests"], integer=True)
    if mq < -1 or mq == 0:
        raise ValueError(f"max_queued_requests must be -1 (no limit) or >= 1 (got {mq})")
    out["max_queued_requests"] = mq
    for k in ("health_check_period_s", "health_check_timeout_s"):
        out[k] = _number(k, out[k], minimum=0, strict=True)
    for k in ("graceful_shutdown_wait_loop_s", "graceful_shutdown_timeout_s"):
        out[k] = _number(k, out[k], minimum=0)
    ao = out["ray_actor_options"]
    if ao is not None:
        if not isinstance(ao, dict):
            raise TypeError(f"ray_actor_options must be a dict (got {type(ao).__name__})")
        bad = set(ao) - ACTOR_OPTIONS
        if bad:
            raise ValueError(
                f"ray_actor_options keys {sorted(bad)} are not allowed for replicas; expected some of {sorted(ACTOR_OPTIONS)}"
            )
        res = ao.get("resources")
        if res is not None and not isinstance(res, dict):
            raise TypeError(f"ray_actor_options['resources'] must be a dict (got {res!r})")
        for k in ("num_cpus", "num_gpus", "memory"):
            if ao.get(k) is not None:
                _number(f"ray_actor_options[{k!r}]", ao[k], minimum=0)
    pgb = out["placement_group_bundles"]
    if pgb is not None:
        if not isinstance(pgb, list) or not pgb or not all(isinstance(b, dict) and b for b in pgb):
            raise ValueError(
                f"placement_group_bundles must be a non-empty list of non-empty resource dicts (got {pgb!r})"
            )
        for i, b in enumerate(pgb):
            for k, v in b.items():
                _number(f"placement_group_bundles[{i}][{k!r}]", v, minimum=0)
        bundle0 = pgb[0]
        want = _replica_resources(out["ray_actor_options"] or {})
        short = {k: v for k, v in want.items() if v and bundle0.get(k, 0) < v}
        if short:
            raise ValueError(
                f"the replica's resources {want} must fit in placement_group_bundles[0] {bundle0} "
                f"(Ray places the replica in bundle 0); short of {short}"
            )
    if out["placement_group_strategy"] is not None:
        if pgb is None:
            raise ValueError("placement_group_strategy is set but placement_group_bundles is not")
        if out["placement_group_strategy"] not in PG_STRATEGIES:
            raise ValueError(
                f"placement_group_strategy must be one of {sorted(PG_STRATEGIES)} "
                f"(got {out['placement_group_strategy']!r})"
            )
    rr = out["request_router"]
    if rr not in ROUTERS:
        raise ValueError(f"request_router must be one of {sorted(ROUTERS)} (got {rr!r})")
    kw = dict(ROUTER_KWARGS)
    for k, v in (out["request_router_kwargs"] or {}).items():
        if k not in ROUTER_KWARGS:
            raise ValueError(f"unknown request_router_kwargs key {k!r}; expected one of {sorted(ROUTER_KWARGS)}")
        kw[k] = _number(f"request_router_kwargs[{k!r}]", v, minimum=0, integer=True)
    out["request_router_kwargs"] = kw
    return out


#: Ray's placement group strategies (default ``PACK``).
PG_STRATEGIES = {"PACK", "SPREAD", "STRICT_PACK", "STRICT_SPREAD"}


def _replica_resources(ao: dict) -> dict:
    """The resources a replica's actor asks for (Ray's default ``num_cpus`` 1)."""
    res = {"CPU": ao.get("num_cpus", 1) if ao.get("num_cpus") is not None else 1}
    if ao.get("num_gpus"):
        res["GPU"] = ao["num_gpus"]
    if ao.get("memory"):
        res["memory"] = ao["memory"]
    res.update(ao.get("resources") or {})
    return res


def initial_target(cfg: dict) -> int:
    """How many replicas a newly deployed deployment starts with."""
    ac = cfg.get("autoscaling_config")
    if ac is None:
        return int(cfg["num_replicas"])
    if ac.get("initial_replicas") is not None:
        return int(ac["initial_replicas"])
    return int(ac["min_replicas"])


def autoscale_desired(ac: dict, current: int, total_ongoing: float) -> int:
    """Ray's replica-queue-length policy: enough replicas that each has about
    ``target_ongoing_requests`` ongoing requests, moved toward that number by the
    up/downscaling factor, clamped to ``[min_replicas, max_replicas]``; from zero
    replicas any request asks for at least one.

    Source: https://docs.ray.io/en/latest/serve/advanced-guides/advanced-autoscaling.html
    """
    lo, hi = ac["min_replicas"], ac["max_replicas"]
    if current == 0:
        want = 0 if total_ongoing <= 0 else max(1, math.ceil(total_ongoing / ac["target_ongoing_requests"]))
        return max(lo, min(hi, want))
    raw = total_ongoing / ac["target_ongoing_requests"]
    if raw > current:
        f = ac.get("upscaling_factor") or ac.get("upscale_smoothing_factor") or ac.get("smoothing_factor") or 1.0
        want = math.ceil(current + (raw - current) * f)
    elif raw < current:
        f = ac.get("downscaling_factor") or ac.get("downscale_smoothing_factor") or ac.get("smoothing_factor") or 1.0
        want = math.ceil(current - (current - raw) * f)
    else:
        want = current
    return max(lo, min(hi, want))
