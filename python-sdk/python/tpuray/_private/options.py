"""Remote options with Ray's names and defaults, turned into what the core takes."""

from __future__ import annotations

from typing import Any

# Ray 2.60's keywords of ``@ray.remote``/``.options`` (``ray/_common/ray_option_utils.py``:
# ``task_options`` and ``actor_options``), each honoured or refused by name below.
_COMMON_KEYS = {
    "label_selector", "fallback_strategy", "accelerator_type", "memory", "name", "num_cpus",
    "num_gpus", "object_store_memory", "placement_group", "placement_group_bundle_index",
    "placement_group_capture_child_tasks", "resources", "runtime_env", "scheduling_strategy",
    "enable_task_events", "_labels",
}
_TASK_KEYS = _COMMON_KEYS | {
    "max_calls", "max_retries", "num_returns", "retry_exceptions",
    "_generator_backpressure_num_objects", "_num_objects_per_yield",
}
_ACTOR_KEYS = _COMMON_KEYS | {
    "concurrency_groups", "enable_tensor_transport", "lifetime", "max_concurrency",
    "max_restarts", "max_task_retries", "max_pending_calls", "namespace", "get_if_exists",
    "allow_out_of_order_execution", "_actor_generator_backpressure_num_objects",
}

# Ray options tpuray refuses, each with the values that change nothing (Ray's defaults,
# accepted) and the reason any other value is refused (ValueError naming the option).
_REFUSED: dict[str, tuple[tuple[Any, ...], str]] = {
    "object_store_memory": (
        (None,),
        "tpuray reserves no object store memory per task or actor (Ray 2.60 refuses it for "
        "tasks and ignores it for actors)",
    ),
    "fallback_strategy": ((None, []), "fallback scheduling strategies are not implemented"),
    "_labels": ((None, {}), "task labels for Ray's internal metrics have no tpuray counterpart"),
    "enable_task_events": (
        (None, True), "task events are always recorded (the dashboard and state API read them)"
    ),
    "_generator_backpressure_num_objects": (
        (None, -1), "generator backpressure is not implemented: items stream as produced"
    ),
    "_num_objects_per_yield": ((None, 1), "every yield is one object"),
    "enable_tensor_transport": (
        (None, False), "tensors travel through the object store (no direct transport)"
    ),
    "allow_out_of_order_execution": (
        (None, False),
        "calls from one caller run in submission order unless max_concurrency > 1",
    ),
    "_actor_generator_backpressure_num_objects": (
        (None, -1), "generator backpressure is not implemented: items stream as produced"
    ),
    "tensor_transport": (
        (None, "OBJECT_STORE", "object_store"),
        "tensors travel through the object store (no direct transport)",
    ),
}


def _is_default(v, defaults) -> bool:
    return any(v is d or (type(v) is type(d) and v == d) for d in defaults)


def refuse_unsupported(options: dict, what: str) -> None:
    """Raises ``ValueError`` naming the first option of ``options`` that tpuray does not
    implement and that is given a value other than Ray's default (which changes nothing).
    """
    for k, v in options.items():
        if k in _REFUSED and not _is_default(v, _REFUSED[k][0]):
            raise ValueError(
                f"tpuray does not support the {what} option {k}={v!r}: {_REFUSED[k][1]} "
                "(see python-sdk/README.md)"
            )


def check(options: dict, actor: bool, in_options: bool = False) -> None:
    """Ray's option checks (``validate_task_options``/``validate_actor_options``): an
    unknown keyword, ``max_calls`` or ``concurrency_groups`` in ``.options()``, and the
    options tpuray refuses raise ``ValueError``."""
    allowed = _ACTOR_KEYS if actor else _TASK_KEYS
    for k in options:
        if k not in allowed:
            kind = "actors" if actor else "remote functions"
            raise ValueError(
                f"Invalid option keyword {k} for {kind}. Valid ones are {sorted(allowed)}."
            )
    if in_options and not actor and "max_calls" in options:
        raise ValueError("Setting 'max_calls' is not supported in '.options()'.")
    if in_options and actor and "concurrency_groups" in options:
        raise ValueError("Setting 'concurrency_groups' is not supported in '.options()'.")
    if not actor and options.get("object_store_memory") is not None:
        # Ray's own refusal, its text (ray_option_utils, task_options).
        raise ValueError("Setting 'object_store_memory' is not implemented for tasks")
    mc = options.get("max_calls")
    if mc is not None and (not isinstance(mc, int) or isinstance(mc, bool) or mc < 0):
        raise ValueError(f"max_calls must be an int >= 0 (got {mc!r})")
    mpc = options.get("max_pending_calls")
    if mpc is not None and (not isinstance(mpc, int) or isinstance(mpc, bool) or mpc < -1):
        raise ValueError(f"max_pending_calls must be -1 or an int >= 0 (got {mpc!r})")
    refuse_unsupported(options, "actor" if actor else "remote function")


def concurrency_groups(o: dict) -> dict:
    """``concurrency_groups`` as ``{name: max_concurrency}`` (Ray takes a dict).

    Raises:
        TypeError / ValueError: not a dict of names to ints >= 1.
    """
    groups = o.get("concurrency_groups") or {}
    if not isinstance(groups, dict):
        raise TypeError(
            f"concurrency_groups must be a dict of group name to max_concurrency (got {groups!r})"
        )
    out = {}
    for name, limit in groups.items():
        if not isinstance(name, str) or not name:
            raise ValueError(f"concurrency group names must be non-empty strings (got {name!r})")
        if not isinstance(limit, int) or isinstance(limit, bool) or limit < 1:
            raise ValueError(
                f"concurrency group {name!r} needs max_concurrency >= 1 (got {limit!r})"
            )
        out[name] = limit
    return out


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
    pg = o.get("placement_group", "default")
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
        if s.soft:
            raise ValueError(
                "tpuray does not support soft label constraints "
                f"(NodeLabelSchedulingStrategy(soft={s.soft!r})): only hard ones are "
                "matched; use hard= or label_selector"
            )
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


def capture_flag(o: dict) -> bool:
    """Whether what this task or actor creates without a strategy goes to its group:
    ``PlacementGroupSchedulingStrategy(placement_group_capture_child_tasks=...)`` or the
    legacy option (see :func:`captured`)."""
    from tpuray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    s = o.get("scheduling_strategy")
    if isinstance(s, PlacementGroupSchedulingStrategy):
        return bool(s.placement_group_capture_child_tasks)
    return bool(o.get("placement_group_capture_child_tasks"))


def captured(core: dict, o: dict) -> dict:
    """``core`` (options :func:`task_core_options` or :func:`actor_core_options` made
    from ``o``) for a call made now: inside a task or actor whose placement group
    captures its children, a call that names no strategy (and not
    ``placement_group=None``) goes to that group, any bundle, and captures its own
    children in turn (Ray 2.60: ``ray/_private/utils.py``,
    ``_configure_placement_group_based_on_context``)."""
    if core["scheduling"] is not None or o.get("scheduling_strategy") is not None:
        return core
    if o.get("placement_group", "default") != "default":
        return core
    if o.get("placement_group_capture_child_tasks") is False:
        return core  # opted out: Ray then schedules it outside any group
    from tpuray._private import worker

    group = worker.current_capture_group()
    if group is None:
        return core
    return {**core, "scheduling": ("pg", group, -1), "capture_child_tasks": True}


def check_num_returns(num_returns, is_generator: bool, where: str = "") -> None:
    """Ray's ``validate_num_returns``: an int >= 0, "streaming" for a generator, or
    None; tpuray refuses Ray's deprecated ``"dynamic"`` by name.

    Raises:
        ValueError: any other value, or "streaming" for a function that is no generator.
    """
    if num_returns is None:
        return
    if num_returns == "dynamic":
        raise ValueError(
            'tpuray does not support num_returns="dynamic" (deprecated in Ray 2.60): '
            'generators stream by default; use num_returns="streaming" (or leave it unset)'
        )
    if num_returns == "streaming":
        if not is_generator:
            raise ValueError(
                f'num_returns="streaming" is only for generator functions{where}, but the '
                "function is not a generator"
            )
        return
    if not isinstance(num_returns, int) or isinstance(num_returns, bool) or num_returns < 0:
        raise ValueError(
            f'num_returns must be an int >= 0 or "streaming" (got {num_returns!r})'
        )


def task_core_options(o: dict, default_name: str, is_generator: bool = False) -> dict:
    sched, labels = scheduling(o)
    label_selector = dict(o.get("label_selector") or {})
    label_selector.update(labels)
    num_returns = o.get("num_returns")
    check_num_returns(num_returns, is_generator)
    if num_returns is None or num_returns == "streaming":
        num_returns = 1
    max_calls = o.get("max_calls")
    if max_calls is None:
        # Ray 2.60 (remote_function.py): GPU tasks default to max_calls=1, so their
        # worker exits and gives the GPU memory back.
        max_calls = 1 if (o.get("num_gpus") or 0) > 0 else 0
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
        "max_calls": int(max_calls),
        "capture_child_tasks": capture_flag(o),
    }


def _job_namespace():
    from tpuray._private import worker

    return worker.state.namespace


def actor_core_options(o: dict, is_async: bool, method_groups: dict | None = None) -> dict:
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
        "max_pending_calls": int(-1 if o.get("max_pending_calls") is None else o["max_pending_calls"]),
        "concurrency_groups": concurrency_groups(o),
        "method_groups": dict(method_groups or {}),
        "capture_child_tasks": capture_flag(o),
    }
