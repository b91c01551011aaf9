"""Remote options with Ray's names and defaults, turned into what the core takes."""

from __future__ import annotations

_TASK_KEYS = {
    "num_cpus", "num_gpus", "resources", "memory", "accelerator_type", "max_retries",
    "retry_exceptions", "num_returns", "name", "scheduling_strategy", "label_selector",
    "runtime_env", "placement_group", "placement_group_bundle_index",
    "placement_group_capture_child_tasks", "max_calls", "_metadata", "concurrency_groups",
    "enable_task_events",
}
_ACTOR_KEYS = {
    "num_cpus", "num_gpus", "resources", "memory", "accelerator_type", "name", "namespace",
    "lifetime", "max_restarts", "max_task_retries", "max_concurrency", "scheduling_strategy",
    "label_selector", "get_if_exists", "runtime_env", "placement_group",
    "placement_group_bundle_index", "placement_group_capture_child_tasks",
    "max_pending_calls", "concurrency_groups", "_metadata", "enable_task_events",
}


def check(options: dict, actor: bool) -> None:
    allowed = _ACTOR_KEYS if actor else _TASK_KEYS
    for k in options:
        if k not in allowed:
            kind = "actors" if actor else "remote functions"
            raise ValueError(
                f"Invalid option keyword {k} for {kind}. Valid ones are {sorted(allowed)}."
            )
    warn_unhonoured(options, "actor" if actor else "remote function")


# Ray's options that tpuray takes but does not act on yet (issue 23), each with the values
# that change nothing (Ray's defaults): any other value is named in a warning once per
# process, so a script that relies on one is told, never silently ignored.
_UNHONOURED = {
    "max_calls": (None, 0),
    "concurrency_groups": (None, {}),
    "max_pending_calls": (None, -1),
}
# The same for ``@method``'s keywords (tpuray honours its ``num_returns``).
UNHONOURED_METHOD = {
    "concurrency_group": (None,),
    "max_task_retries": (None,),
    "retry_exceptions": (None,),
    "_generator_backpressure_num_objects": (None, -1),
    "_num_objects_per_yield": (None,),
    "enable_task_events": (None, True),
    "tensor_transport": (None, "OBJECT_STORE", "object_store"),
}
_warned: set[tuple[str, str]] = set()


def warn_unhonoured(options: dict, what: str, table: dict = _UNHONOURED) -> None:
    """Warns (once per option of ``what``) about each option of ``options`` in ``table``
    whose value is not one of those that change nothing there."""
    for k, v in options.items():
        if k not in table or (what, k) in _warned:
            continue
        if any(v is d or (type(v) is type(d) and v == d) for d in table[k]):
            continue
        _warned.add((what, k))
        import warnings

        warnings.warn(
            f"tpuray does not honour the {what} option {k}={v!r} yet: it is accepted for "
            "Ray compatibility and has no effect (see python-sdk/README.md)",
            stacklevel=4,
        )


def _resources(o: dict) -> dict:
    res = dict(o.get("resources") or {})
    for reserved in ("CPU", "GPU"):
        if reserved in res:
            raise ValueError(
                f"Use the '{reserved.lower()}s' argument (num_cpus/num_gpus) instead of "
                f"resources['{reserved}']"
            )
    if o.get("memory"):
        res["memory"] = float(o["memory"])
    if o.get("accelerator_type"):
        res[f"accelerator_type:{o['accelerator_type']}"] = 0.001
    for k, v in res.items():
        if not isinstance(v, (int, float)) or v < 0:
            raise ValueError(f"resource {k!r} must be a number >= 0 (got {v!r})")
    return res


def scheduling(o: dict):
    """The core's form of ``scheduling_strategy`` (or the legacy ``placement_group``)."""
    from tpuray.util.placement_group import PlacementGroup
    from tpuray.util.scheduling_strategies import (
        NodeAffinitySchedulingStrategy,
        NodeLabelSchedulingStrategy,
        PlacementGroupSchedulingStrategy,
    )

    s = o.get("scheduling_strategy")
    pg = o.get("placement_group")
    if pg is not None and pg != "default" and s is None:
        s = PlacementGroupSchedulingStrategy(pg, o.get("placement_group_bundle_index", -1))
    if s is None or s == "DEFAULT":
        return None, {}
    if s == "SPREAD":
        return "SPREAD", {}
    if isinstance(s, PlacementGroupSchedulingStrategy):
        if not isinstance(s.placement_group, PlacementGroup):
            raise TypeError("PlacementGroupSchedulingStrategy needs a PlacementGroup")
        idx = s.placement_group_bundle_index
        if idx is None:
            idx = -1
        n = s.placement_group.bundle_count
        if idx < -1 or idx >= n:
            raise ValueError(
                f"placement_group_bundle_index {idx} is out of range: the group has {n} "
                "bundle(s) (expected -1 for any, or 0..n-1)"
            )
        return ("pg", s.placement_group.id.hex(), idx), {}
    if isinstance(s, NodeAffinitySchedulingStrategy):
        return ("node", s.node_id, bool(s.soft)), {}
    if isinstance(s, NodeLabelSchedulingStrategy):
        return None, dict(s.hard)
    raise ValueError(f"unknown scheduling_strategy {s!r}")


def runtime_env_hash(o: dict) -> str:
    """The KV key of this call's runtime environment (the job's merged with the
    call's), or "" when the call names none (the job's then comes with every worker)."""
    env = o.get("runtime_env")
    if not env:
        return ""
    from tpuray._private import runtime_env as _rt
    from tpuray._private import worker

    task_env = _rt.upload(_rt.validate(env))
    return _rt.register(_rt.merge(worker.state.runtime_env or {}, task_env))


def retry_filter(o: dict):
    """The exception classes of ``retry_exceptions=[...]`` (None for a bool).

    Raises:
        TypeError: a list holding something that is not an exception class.
    """
    r = o.get("retry_exceptions")
    if isinstance(r, (list, tuple)):
        for c in r:
            if not (isinstance(c, type) and issubclass(c, BaseException)):
                raise TypeError(f"retry_exceptions must list exception classes (got {c!r})")
        return list(r)
    return None


def task_core_options(o: dict, default_name: str) -> dict:
    sched, labels = scheduling(o)
    label_selector = dict(o.get("label_selector") or {})
    label_selector.update(labels)
    num_returns = o.get("num_returns", 1)
    if num_returns == "dynamic":
        raise ValueError('num_returns="dynamic" is deprecated in Ray; use num_returns="streaming"')
    if num_returns == "streaming":
        num_returns = 1
    elif not isinstance(num_returns, int) or num_returns < 0:
        raise ValueError(f"num_returns must be an int >= 0 or \"streaming\" (got {num_returns!r})")
    return {
        "num_cpus": float(o.get("num_cpus", 1) if o.get("num_cpus") is not None else 1),
        "num_gpus": float(o.get("num_gpus") or 0),
        "resources": _resources(o),
        "max_retries": int(o.get("max_retries", 3)),
        "retry_exceptions": bool(o.get("retry_exceptions", False)),  # a list counts as True
        "num_returns": int(num_returns),
        "name": o.get("name") or default_name,
        "label_selector": label_selector,
        "scheduling": sched,
        "runtime_env_hash": runtime_env_hash(o),
    }


def _job_namespace():
    from tpuray._private import worker

    return worker.state.namespace


def actor_core_options(o: dict, is_async: bool) -> dict:
    sched, labels = scheduling(o)
    label_selector = dict(o.get("label_selector") or {})
    label_selector.update(labels)
    lifetime = o.get("lifetime")
    if lifetime not in (None, "detached", "non_detached"):
        raise ValueError(f"lifetime must be 'detached' or 'non_detached' (got {lifetime!r})")
    max_concurrency = o.get("max_concurrency")
    if max_concurrency is None:
        max_concurrency = 1000 if is_async else 1
    if max_concurrency < 1:
        raise ValueError(f"max_concurrency must be >= 1 (got {max_concurrency})")
    resources = _resources(o)
    num_cpus = o.get("num_cpus")
    num_gpus = o.get("num_gpus")
    return {
        "num_cpus": None if num_cpus is None else float(num_cpus),
        "num_gpus": float(num_gpus or 0),
        "resources": resources,
        "name": o.get("name"),
        # Ray: a named actor without a namespace lives in the job's.
        "namespace": o.get("namespace") or _job_namespace(),
        "detached": lifetime == "detached",
        "max_restarts": int(o.get("max_restarts", 0)),
        "max_concurrency": int(max_concurrency),
        "get_if_exists": bool(o.get("get_if_exists", False)),
        "label_selector": label_selector,
        "scheduling": sched,
        "runtime_env_hash": runtime_env_hash(o),
    }
