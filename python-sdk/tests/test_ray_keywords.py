"""Every keyword of Ray 2.60's ``@ray.remote``/``.options`` (functions and actors),
``@ray.method`` and a method call's ``.options`` is honoured or refused by name: none is
accepted and ignored, none merely warns (issue 23).

The keyword lists are data copied from Ray 2.60's source (named at each list); the
behaviour of each honoured keyword is checked on what tpuray hands its core (below) and,
end to end, by the ``compat/core_*`` scripts recorded under Ray. No cluster is started:
options are checked where they are given, as Ray checks them.
"""

from __future__ import annotations

import warnings

import pytest

import tpuray
from tpuray import actor as _actor
from tpuray._private import options as _options
from tpuray.util.placement_group import PlacementGroup
from tpuray.util.scheduling_strategies import (
    NodeAffinitySchedulingStrategy,
    NodeLabelSchedulingStrategy,
    PlacementGroupSchedulingStrategy,
)

# ray/_common/ray_option_utils.py (Ray 2.60): task_options = {**_common_options,
# **_task_only_options}.
RAY_TASK_OPTIONS = [
    "label_selector", "fallback_strategy", "accelerator_type", "memory", "name", "num_cpus",
    "num_gpus", "object_store_memory", "placement_group", "placement_group_bundle_index",
    "placement_group_capture_child_tasks", "resources", "runtime_env", "scheduling_strategy",
    "enable_task_events", "_labels", "max_calls", "max_retries", "num_returns",
    "retry_exceptions", "_generator_backpressure_num_objects", "_num_objects_per_yield",
]
# ray/_common/ray_option_utils.py (Ray 2.60): actor_options = {**_common_options,
# **_actor_only_options}.
RAY_ACTOR_OPTIONS = [
    "label_selector", "fallback_strategy", "accelerator_type", "memory", "name", "num_cpus",
    "num_gpus", "object_store_memory", "placement_group", "placement_group_bundle_index",
    "placement_group_capture_child_tasks", "resources", "runtime_env", "scheduling_strategy",
    "enable_task_events", "_labels", "concurrency_groups", "enable_tensor_transport",
    "lifetime", "max_concurrency", "max_restarts", "max_task_retries", "max_pending_calls",
    "namespace", "get_if_exists", "allow_out_of_order_execution",
    "_actor_generator_backpressure_num_objects",
]
# ray/actor.py (Ray 2.60), ``method``: valid_kwargs.
RAY_METHOD_OPTIONS = [
    "num_returns", "concurrency_group", "max_task_retries", "retry_exceptions",
    "_generator_backpressure_num_objects", "_num_objects_per_yield", "enable_task_events",
    "tensor_transport",
]
# ray/actor.py (Ray 2.60), ``ActorMethod._remote``'s keywords (what ``.options`` on a
# method call forwards; ``_num_objects_per_yield`` is refused there by Ray itself).
RAY_METHOD_CALL_OPTIONS = [
    "name", "num_returns", "max_task_retries", "retry_exceptions", "concurrency_group",
    "_generator_backpressure_num_objects", "enable_task_events", "tensor_transport",
    "_labels",
]

_PG = PlacementGroup("ab" * 14, 2)


def _gen():
    yield 1


def _plain():
    return 1


# keyword -> (a value other than Ray's default, check of the task's core options, or
# None for a refusal). A check returning True shows the value reaches the core.
TASK_CASES = {
    "label_selector": ({"zone": "a"}, lambda c: c["label_selector"] == {"zone": "a"}),
    "fallback_strategy": ([{"label_selector": {"zone": "b"}}], None),
    "accelerator_type": ("TPU-V6E", lambda c: "accelerator_type:TPU-V6E" in c["resources"]),
    "memory": (2**20, lambda c: c["resources"]["memory"] == 2**20),
    "name": ("renamed", lambda c: c["name"] == "renamed"),
    "num_cpus": (2, lambda c: c["num_cpus"] == 2.0),
    "num_gpus": (1, lambda c: c["num_gpus"] == 1.0 and c["max_calls"] == 1),
    "object_store_memory": (2**20, None),
    "placement_group": (_PG, lambda c: c["scheduling"] == ("pg", _PG.id.hex(), -1)),
    "placement_group_bundle_index": (1, lambda c: c["scheduling"] == ("pg", _PG.id.hex(), 1)),
    "placement_group_capture_child_tasks": (True, lambda c: c["capture_child_tasks"] is True),
    "resources": ({"special": 1}, lambda c: c["resources"] == {"special": 1}),
    # Checked end to end by compat/runtime_env_basics (it needs a cluster to upload to).
    "runtime_env": ({"env_vars": {"A": "1"}}, "needs-cluster"),
    "scheduling_strategy": ("SPREAD", lambda c: c["scheduling"] == "SPREAD"),
    "enable_task_events": (False, None),
    "_labels": ({"k": "v"}, None),
    "max_calls": (3, lambda c: c["max_calls"] == 3),
    "max_retries": (7, lambda c: c["max_retries"] == 7),
    "num_returns": (2, lambda c: c["num_returns"] == 2),
    "retry_exceptions": (True, lambda c: c["retry_exceptions"] is True),
    "_generator_backpressure_num_objects": (4, None),
    "_num_objects_per_yield": (2, None),
}

ACTOR_CASES = {
    "label_selector": ({"zone": "a"}, lambda c: c["label_selector"] == {"zone": "a"}),
    "fallback_strategy": ([{"label_selector": {"zone": "b"}}], None),
    "accelerator_type": ("TPU-V6E", lambda c: "accelerator_type:TPU-V6E" in c["resources"]),
    "memory": (2**20, lambda c: c["resources"]["memory"] == 2**20),
    "name": ("named", lambda c: c["name"] == "named"),
    "num_cpus": (2, lambda c: c["num_cpus"] == 2.0),
    "num_gpus": (1, lambda c: c["num_gpus"] == 1.0),
    "object_store_memory": (2**20, None),
    "placement_group": (_PG, lambda c: c["scheduling"] == ("pg", _PG.id.hex(), -1)),
    "placement_group_bundle_index": (1, lambda c: c["scheduling"] == ("pg", _PG.id.hex(), 1)),
    "placement_group_capture_child_tasks": (True, lambda c: c["capture_child_tasks"] is True),
    "resources": ({"special": 1}, lambda c: c["resources"] == {"special": 1}),
    "runtime_env": ({"env_vars": {"A": "1"}}, "needs-cluster"),
    "scheduling_strategy": ("SPREAD", lambda c: c["scheduling"] == "SPREAD"),
    "enable_task_events": (False, None),
    "_labels": ({"k": "v"}, None),
    "concurrency_groups": ({"io": 2}, lambda c: c["concurrency_groups"] == {"io": 2}),
    "enable_tensor_transport": (True, None),
    "lifetime": ("detached", lambda c: c["detached"] is True),
    "max_concurrency": (4, lambda c: c["max_concurrency"] == 4),
    "max_restarts": (2, lambda c: c["max_restarts"] == 2),
    # The handle's retries (ActorClass.remote reads them); end to end in
    # compat/core_limits_retries.
    "max_task_retries": (2, lambda c: True),
    "max_pending_calls": (5, lambda c: c["max_pending_calls"] == 5),
    "namespace": ("ns", lambda c: c["namespace"] == "ns"),
    "get_if_exists": (True, lambda c: c["get_if_exists"] is True),
    "allow_out_of_order_execution": (True, None),
    "_actor_generator_backpressure_num_objects": (4, None),
}

# @ray.method keyword -> (value, attribute it sets on the method, or None for a refusal).
METHOD_CASES = {
    "num_returns": (2, "__tpuray_num_returns__"),
    "concurrency_group": ("io", "__tpuray_concurrency_group__"),
    "max_task_retries": (3, "__tpuray_max_task_retries__"),
    "retry_exceptions": (True, "__tpuray_retry_exceptions__"),
    "_generator_backpressure_num_objects": (4, None),
    "_num_objects_per_yield": (2, None),
    "enable_task_events": (False, None),
    "tensor_transport": ("nccl", None),
}

# A method call's .options keyword -> (value, key of the call's options, or None).
CALL_CASES = {
    "name": ("renamed", None),
    "num_returns": (2, "num_returns"),
    "max_task_retries": (3, "max_task_retries"),
    "retry_exceptions": (True, "retry_exceptions"),
    "concurrency_group": ("io", "concurrency_group"),
    "_generator_backpressure_num_objects": (4, None),
    "enable_task_events": (False, None),
    "tensor_transport": ("nccl", None),
    "_labels": ({"k": "v"}, None),
}


def test_the_walk_covers_exactly_rays_keywords():
    assert sorted(TASK_CASES) == sorted(RAY_TASK_OPTIONS)
    assert sorted(ACTOR_CASES) == sorted(RAY_ACTOR_OPTIONS)
    assert sorted(METHOD_CASES) == sorted(RAY_METHOD_OPTIONS)
    assert sorted(CALL_CASES) == sorted(RAY_METHOD_CALL_OPTIONS)
    # tpuray takes exactly Ray's keywords (an unknown one is Ray's ValueError).
    assert _options._TASK_KEYS == set(RAY_TASK_OPTIONS)
    assert _options._ACTOR_KEYS == set(RAY_ACTOR_OPTIONS)
    assert sorted(_actor._METHOD_KEYS) == sorted(RAY_METHOD_OPTIONS)
    assert _actor._CALL_KEYS == set(RAY_METHOD_CALL_OPTIONS)


def _refused(fn, keyword):
    with pytest.raises(ValueError) as e:
        fn()
    assert keyword in str(e.value), f"the refusal of {keyword} names it: {e.value}"


@pytest.mark.parametrize("keyword", RAY_TASK_OPTIONS)
def test_task_keyword_is_honoured_or_refused(keyword):
    value, check = TASK_CASES[keyword]
    opts = {keyword: value}
    if keyword == "placement_group_bundle_index":
        opts["placement_group"] = _PG  # the index of the legacy placement_group option
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a keyword that only warns fails here
        if check is None:
            _refused(lambda: tpuray.remote(**opts)(_plain), keyword)
            if keyword != "max_calls":
                _refused(lambda: tpuray.remote(_plain).options(**opts), keyword)
            return
        f = tpuray.remote(**opts)(_gen if keyword == "num_returns" else _plain)
        if keyword != "max_calls":
            tpuray.remote(_plain).options(**opts)
        if check == "needs-cluster":
            return
        core = _options.task_core_options(f._options, "f", f._is_generator)
        assert check(core), f"{keyword}={value!r} reaches the core: {core}"


@pytest.mark.parametrize("keyword", RAY_ACTOR_OPTIONS)
def test_actor_keyword_is_honoured_or_refused(keyword):
    value, check = ACTOR_CASES[keyword]
    opts = {keyword: value}
    if keyword == "placement_group_bundle_index":
        opts["placement_group"] = _PG

    class A:
        def m(self):
            return 1

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        if check is None:
            _refused(lambda: tpuray.remote(**opts)(A), keyword)
            _refused(lambda: tpuray.remote(A).options(**opts), keyword)
            return
        cls = tpuray.remote(**opts)(A)
        if keyword != "concurrency_groups":
            tpuray.remote(A).options(**opts)
        if check == "needs-cluster":
            return
        core = _options.actor_core_options(cls._options, False)
        assert check(core), f"{keyword}={value!r} reaches the core: {core}"


@pytest.mark.parametrize("keyword", RAY_METHOD_OPTIONS)
def test_method_keyword_is_honoured_or_refused(keyword):
    value, attr = METHOD_CASES[keyword]

    def m(self):
        return (1, 2)

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        if attr is None:
            _refused(lambda: tpuray.method(**{keyword: value}), keyword)
            return
        decorated = tpuray.method(**{keyword: value})(m)
        assert getattr(decorated, attr) == value


@pytest.mark.parametrize("keyword", RAY_METHOD_CALL_OPTIONS)
def test_method_call_keyword_is_honoured_or_refused(keyword):
    value, key = CALL_CASES[keyword]
    handle = _actor.ActorHandle("0" * 32, "A", {}, 0, ["m"])
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        if key is None:
            _refused(lambda: handle.m.options(**{keyword: value}), keyword)
            return
        m = handle.m.options(**{keyword: value})
        got = m._num_returns if key == "num_returns" else m._call[key]
        assert got == value
        if key in ("concurrency_group", "max_task_retries", "retry_exceptions"):
            group, retries, retry_exceptions = m._effective()
            assert {"concurrency_group": group, "max_task_retries": retries,
                    "retry_exceptions": retry_exceptions}[key] == value


def test_defaults_of_refused_keywords_change_nothing_and_are_accepted():
    # Ray's defaults of what tpuray refuses are accepted (a script spelling them out
    # runs): e.g. enable_task_events=True, _num_objects_per_yield=1.
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        tpuray.remote(enable_task_events=True, _num_objects_per_yield=1,
                      _generator_backpressure_num_objects=-1, fallback_strategy=None)(_plain)
        tpuray.remote(enable_tensor_transport=False, allow_out_of_order_execution=False)(
            type("A", (), {})
        )
        tpuray.method(enable_task_events=True, tensor_transport=None)


def test_soft_label_constraints_are_refused_by_name():
    s = NodeLabelSchedulingStrategy(hard={"zone": "a"}, soft={"disk": "ssd"})
    f = tpuray.remote(scheduling_strategy=s)(_plain)
    with pytest.raises(ValueError, match="soft"):
        _options.task_core_options(f._options, "f")
    hard_only = tpuray.remote(scheduling_strategy=NodeLabelSchedulingStrategy({"zone": "a"}))
    core = _options.task_core_options(hard_only(_plain)._options, "f")
    assert core["label_selector"] == {"zone": "a"}


def test_num_returns_dynamic_is_refused_and_streaming_needs_a_generator():
    with pytest.raises(ValueError, match="dynamic"):
        tpuray.remote(num_returns="dynamic")(_gen)
    with pytest.raises(ValueError, match="streaming"):
        tpuray.remote(num_returns="streaming")(_plain)
    with pytest.raises(ValueError, match="num_returns"):
        tpuray.remote(num_returns=-1)(_plain)
    assert tpuray.remote(_gen)._is_generator


def test_max_calls_and_concurrency_groups_are_refused_in_options_as_ray_does():
    with pytest.raises(ValueError, match="max_calls"):
        tpuray.remote(_plain).options(max_calls=2)
    with pytest.raises(ValueError, match="concurrency_groups"):
        tpuray.remote(type("A", (), {})).options(concurrency_groups={"io": 1})
    with pytest.raises(ValueError, match="concurrency group"):
        _options.concurrency_groups({"concurrency_groups": {"io": 0}})


def test_node_affinity_and_pg_strategies_reach_the_core():
    f = tpuray.remote(scheduling_strategy=NodeAffinitySchedulingStrategy("n1", soft=True))(_plain)
    assert _options.task_core_options(f._options, "f")["scheduling"] == ("node", "n1", True)
    for private in ("_spill_on_unavailable", "_fail_on_unavailable"):
        with pytest.raises(ValueError, match=private):
            NodeAffinitySchedulingStrategy("n1", soft=True, **{private: True})
    s = PlacementGroupSchedulingStrategy(_PG, 1, placement_group_capture_child_tasks=True)
    core = _options.task_core_options(tpuray.remote(scheduling_strategy=s)(_plain)._options, "f")
    assert core["scheduling"] == ("pg", _PG.id.hex(), 1) and core["capture_child_tasks"]
