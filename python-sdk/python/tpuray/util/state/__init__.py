"""Ray's state API (``ray.util.state``): list, get and summarize the cluster's tasks,
actors, nodes, placement groups, jobs, workers and objects.

Every call reads the head's state API over HTTP (``/api/v0/...`` on the dashboard port,
Ray 2.60's routes, which Ray's own ``ray.util.state`` reads as well), through the
extension's HTTP client (``tpuray._tpuray.JobClient``: address resolution and the
cluster token as for ``tpuray.job_submission``). With no ``address``, a driver or worker
asks its own cluster, as Ray's do. Filters are applied by the head to
every row before ``limit`` cuts the answer (ray#50378), and an answer the head had to
truncate raises unless ``raise_on_missing_output=False``, as Ray's does.

Rows come back as Ray's state classes (``TaskState``, ``ActorState``, ...), with Ray's
field names, readable by attribute, by ``[key]`` and by ``.get(key)``.
"""

from __future__ import annotations

import dataclasses
import json
import urllib.parse
import warnings
from typing import TYPE_CHECKING, Any, Dict, List, Optional, Tuple, Union, cast

if TYPE_CHECKING:
    from _typeshed import DataclassInstance

from tpuray import _tpuray
from tpuray.util.state.exception import RayStateApiException

__all__ = [
    "ActorState", "TaskState", "NodeState", "PlacementGroupState", "JobState", "WorkerState",
    "ObjectState", "StateResource", "list_actors", "list_tasks", "list_nodes", "list_objects",
    "list_placement_groups", "list_jobs", "list_workers", "get_actor", "get_task", "get_node",
    "get_objects", "get_placement_group", "get_job", "get_worker", "summarize_tasks",
    "summarize_actors", "summarize_objects", "RayStateApiException", "DEFAULT_LIMIT",
    "DEFAULT_RPC_TIMEOUT", "get_log", "list_logs",
]

#: Ray's defaults (``ray/util/state/common.py``).
DEFAULT_LIMIT = 100
DEFAULT_RPC_TIMEOUT = 30

PredicateType = str
SupportedFilterType = Union[str, bool, int, float]


class StateSchema:
    """A state row: fields by attribute, by ``[key]`` and by ``.get(key, default)``."""

    def __getitem__(self, key: str) -> Any:
        if not isinstance(key, str) or key not in self._field_names():
            raise KeyError(key)
        return getattr(self, key)

    def get(self, key: str, default: Any = None) -> Any:
        return getattr(self, key, default) if key in self._field_names() else default

    def __contains__(self, key: str) -> bool:
        return key in self._field_names()

    def keys(self):
        return list(self._field_names())

    def asdict(self) -> Dict[str, Any]:
        # Every StateSchema is a dataclass (the row classes below).
        return dataclasses.asdict(cast("DataclassInstance", self))

    @classmethod
    def _field_names(cls):
        return [f.name for f in dataclasses.fields(cls)]

    @classmethod
    def from_dict(cls, d: Dict[str, Any]) -> "StateSchema":
        names = set(cls._field_names())
        return cls(**{k: v for k, v in d.items() if k in names})


def _o():
    return dataclasses.field(default=None)


@dataclasses.dataclass
class ActorState(StateSchema):
    actor_id: str = ""
    class_name: str = ""
    state: str = ""
    job_id: str = ""
    name: Optional[str] = _o()
    node_id: Optional[str] = _o()
    pid: Optional[int] = _o()
    ray_namespace: Optional[str] = _o()
    serialized_runtime_env: Optional[str] = _o()
    required_resources: Optional[dict] = _o()
    death_cause: Optional[dict] = _o()
    is_detached: Optional[bool] = _o()
    placement_group_id: Optional[str] = _o()
    repr_name: Optional[str] = _o()
    num_restarts: int = 0
    num_restarts_due_to_lineage_reconstruction: int = 0
    num_restarts_due_to_node_preemption: int = 0
    call_site: Optional[str] = _o()
    label_selector: Optional[dict] = _o()
    fallback_strategy: Optional[dict] = _o()


@dataclasses.dataclass
class PlacementGroupState(StateSchema):
    placement_group_id: str = ""
    name: str = ""
    creator_job_id: str = ""
    state: str = ""
    bundles: Optional[List[dict]] = _o()
    is_detached: Optional[bool] = _o()
    stats: Optional[dict] = _o()
    topology_strategy: Optional[dict] = _o()
    topology_assignments: Optional[dict] = _o()


@dataclasses.dataclass
class NodeState(StateSchema):
    node_id: str = ""
    node_ip: str = ""
    is_head_node: bool = False
    state: str = ""
    state_message: Optional[str] = _o()
    node_name: str = ""
    resources_total: dict = dataclasses.field(default_factory=dict)
    labels: dict = dataclasses.field(default_factory=dict)
    start_time_ms: Optional[int] = _o()
    end_time_ms: Optional[int] = _o()


@dataclasses.dataclass
class JobState(StateSchema):
    """A job (Ray's ``JobState``, the fields of ``JobDetails``)."""

    type: str = ""
    job_id: Optional[str] = _o()
    submission_id: Optional[str] = _o()
    driver_info: Optional[dict] = _o()
    status: str = ""
    entrypoint: str = ""
    message: Optional[str] = _o()
    error_type: Optional[str] = _o()
    start_time: Optional[int] = _o()
    end_time: Optional[int] = _o()
    metadata: Optional[Dict[str, str]] = _o()
    runtime_env: Optional[Dict[str, Any]] = _o()
    driver_agent_http_address: Optional[str] = _o()
    driver_node_id: Optional[str] = _o()
    driver_exit_code: Optional[int] = _o()


@dataclasses.dataclass
class WorkerState(StateSchema):
    worker_id: str = ""
    is_alive: bool = False
    worker_type: str = ""
    exit_type: Optional[str] = _o()
    node_id: str = ""
    ip: str = ""
    pid: int = 0
    exit_detail: Optional[str] = _o()
    worker_launch_time_ms: Optional[int] = _o()
    worker_launched_time_ms: Optional[int] = _o()
    start_time_ms: Optional[int] = _o()
    end_time_ms: Optional[int] = _o()
    debugger_port: Optional[int] = _o()
    num_paused_threads: Optional[int] = _o()


@dataclasses.dataclass
class TaskState(StateSchema):
    task_id: str = ""
    attempt_number: int = 0
    name: str = ""
    state: str = ""
    job_id: str = ""
    actor_id: Optional[str] = _o()
    type: str = ""
    func_or_class_name: str = ""
    parent_task_id: str = ""
    node_id: Optional[str] = _o()
    worker_id: Optional[str] = _o()
    worker_pid: Optional[int] = _o()
    error_type: Optional[str] = _o()
    language: Optional[str] = _o()
    required_resources: Optional[dict] = _o()
    runtime_env_info: Optional[dict] = _o()
    placement_group_id: Optional[str] = _o()
    events: Optional[List[dict]] = _o()
    profiling_data: Optional[dict] = _o()
    creation_time_ms: Optional[int] = _o()
    start_time_ms: Optional[int] = _o()
    end_time_ms: Optional[int] = _o()
    task_log_info: Optional[dict] = _o()
    error_message: Optional[str] = _o()
    is_debugger_paused: Optional[bool] = _o()
    call_site: Optional[str] = _o()
    label_selector: Optional[dict] = _o()
    fallback_strategy: Optional[dict] = _o()


@dataclasses.dataclass
class ObjectState(StateSchema):
    object_id: str = ""
    object_size: int = 0
    task_status: str = ""
    attempt_number: int = 0
    reference_type: str = ""
    call_site: str = ""
    type: str = ""
    pid: int = 0
    ip: str = ""


class StateResource:
    """Ray's resource names (``StateResource``'s values)."""

    ACTORS = "actors"
    JOBS = "jobs"
    PLACEMENT_GROUPS = "placement_groups"
    NODES = "nodes"
    WORKERS = "workers"
    TASKS = "tasks"
    OBJECTS = "objects"


_SCHEMA = {
    "actors": ActorState, "jobs": JobState, "placement_groups": PlacementGroupState,
    "nodes": NodeState, "workers": WorkerState, "tasks": TaskState, "objects": ObjectState,
}
_ID_KEY = {
    "nodes": "node_id", "actors": "actor_id", "placement_groups": "placement_group_id",
    "workers": "worker_id", "tasks": "task_id", "objects": "object_id", "jobs": "submission_id",
}


def _query(resource: str, path: str, params: List[Tuple[str, Any]], address, timeout) -> dict:
    """GETs ``/api/v0/<path>`` and returns Ray's ``data.result``."""
    if timeout is not None and (not isinstance(timeout, (int, float)) or timeout <= 0):
        raise ValueError(f"timeout must be a positive number of seconds (got {timeout!r})")
    from tpuray._private.api_address import default_address

    client = _tpuray.JobClient(default_address(address))
    query = urllib.parse.urlencode(
        [(k, str(v).lower() if isinstance(v, bool) else str(v)) for k, v in params]
    )
    body = client.get(f"/api/v0/{path}" + (f"?{query}" if query else ""), float(timeout or DEFAULT_RPC_TIMEOUT))
    reply = json.loads(body)
    if not reply.get("result"):
        raise RayStateApiException(f"API server internal error. Error: {reply.get('msg')}")
    return reply["data"]["result"]


def _filters(filters) -> List[Tuple[str, Any]]:
    out = []
    for f in filters or []:
        if not isinstance(f, (tuple, list)) or len(f) != 3:
            raise ValueError(
                f"The given filter has incorrect input type, {f}. Provide (key, predicate, value) tuples."
            )
        key, pred, val = f
        if pred not in ("=", "!="):
            raise ValueError(f"Unsupported filter predicate {pred} is given. Available predicates: =, !=.")
        out += [("filter_keys", key), ("filter_predicates", pred), ("filter_values", val)]
    return out


def _missing(resource: str, r: dict, raise_on_missing_output: bool) -> None:
    if r.get("partial_failure_warning"):
        if raise_on_missing_output:
            raise RayStateApiException(
                f"Failed to retrieve all {resource} from the cluster because they are not reachable due to "
                f"query failures to the data sources ({r['partial_failure_warning']}). To avoid raising an "
                "exception and allow having missing output, set `raise_on_missing_output=False`."
            )
        warnings.warn(r["partial_failure_warning"])
    if r.get("total") != r.get("num_after_truncation"):
        if raise_on_missing_output:
            raise RayStateApiException(
                f"Failed to retrieve all {r['total']} {resource} from the cluster because they are not "
                f"reachable due to data truncation (> {r['num_after_truncation']}). To avoid raising an "
                "exception and allow having missing output, set `raise_on_missing_output=False`."
            )
    for w in r.get("warnings") or []:
        warnings.warn(w)


def _list(resource, address, filters, limit, timeout, detail, raise_on_missing_output):
    if not isinstance(limit, int) or limit < 0:
        raise ValueError(f"limit must be a non-negative integer (got {limit!r})")
    params = [("limit", limit), ("timeout", int(timeout)), ("detail", bool(detail))] + _filters(filters)
    r = _query(resource, resource, params, address, timeout)
    _missing(resource, r, raise_on_missing_output)
    return [_SCHEMA[resource].from_dict(d) for d in r["result"]]


def _get(resource, id, address, timeout):
    params = [("timeout", int(timeout)), ("detail", True), ("filter_keys", _ID_KEY[resource]),
              ("filter_predicates", "="), ("filter_values", id)]
    rows = [_SCHEMA[resource].from_dict(d) for d in _query(resource, resource, params, address, timeout)["result"]]
    if resource == "objects":
        return rows
    if not rows:
        return None
    if resource == "tasks" and len(rows) > 1:
        return rows  # one row per attempt, as Ray's
    return rows[0]


def _summary(resource, address, timeout, raise_on_missing_output):
    r = _query(resource, f"{resource}/summarize", [("timeout", int(timeout))], address, timeout)
    _missing(resource, r, raise_on_missing_output)
    return r["result"]["node_id_to_summary"]


def _lister(resource: str):
    def fn(address: Optional[str] = None, filters: Optional[List[Tuple[str, PredicateType, SupportedFilterType]]] = None,
           limit: int = DEFAULT_LIMIT, timeout: int = DEFAULT_RPC_TIMEOUT, detail: bool = False,
           raise_on_missing_output: bool = True, _explain: bool = False):
        return _list(resource, address, filters, limit, timeout, detail, raise_on_missing_output)

    fn.__name__ = f"list_{resource}"
    fn.__doc__ = (
        f"Lists the cluster's {resource.replace('_', ' ')} as {_SCHEMA[resource].__name__}s (Ray's "
        f"``ray.util.state.list_{resource}``): ``filters`` are ``(key, '=' | '!=', value)`` applied by the "
        "head before ``limit``; ``detail`` adds Ray's detail-only fields.\n\nRaises:\n"
        "    RayStateApiException: the head could not list every row (``raise_on_missing_output``).\n"
        "    ValueError: a bad filter or limit."
    )
    return fn


list_actors = _lister("actors")
list_tasks = _lister("tasks")
list_nodes = _lister("nodes")
list_objects = _lister("objects")
list_placement_groups = _lister("placement_groups")
list_jobs = _lister("jobs")
list_workers = _lister("workers")


def get_actor(id: str, address: Optional[str] = None, timeout: int = DEFAULT_RPC_TIMEOUT,
              _explain: bool = False) -> Optional[ActorState]:
    """The actor with this id, or None."""
    return _get("actors", id, address, timeout)


def get_task(id, address: Optional[str] = None, timeout: int = DEFAULT_RPC_TIMEOUT,
             _explain: bool = False):
    """The task with this id (a ``TaskState``; a list when it ran several attempts), or None."""
    return _get("tasks", id if isinstance(id, str) else id.hex(), address, timeout)


def get_node(id: str, address: Optional[str] = None, timeout: int = DEFAULT_RPC_TIMEOUT,
             _explain: bool = False) -> Optional[NodeState]:
    """The node with this id, or None."""
    return _get("nodes", id, address, timeout)


def get_placement_group(id: str, address: Optional[str] = None, timeout: int = DEFAULT_RPC_TIMEOUT,
                        _explain: bool = False) -> Optional[PlacementGroupState]:
    """The placement group with this id, or None."""
    return _get("placement_groups", id, address, timeout)


def get_worker(id: str, address: Optional[str] = None, timeout: int = DEFAULT_RPC_TIMEOUT,
               _explain: bool = False) -> Optional[WorkerState]:
    """The worker with this id, or None."""
    return _get("workers", id, address, timeout)


def get_job(id: str, address: Optional[str] = None, timeout: int = DEFAULT_RPC_TIMEOUT,
            _explain: bool = False) -> Optional[JobState]:
    """The job with this submission id, or None."""
    return _get("jobs", id, address, timeout)


def get_objects(id: str, address: Optional[str] = None, timeout: int = DEFAULT_RPC_TIMEOUT,
                _explain: bool = False) -> List[ObjectState]:
    """Every copy of the object with this id (empty when there is none)."""
    return _get("objects", id, address, timeout)


def summarize_tasks(address: Optional[str] = None, timeout: int = DEFAULT_RPC_TIMEOUT,
                    raise_on_missing_output: bool = True, _explain: bool = False) -> Dict:
    """Tasks counted by function (or actor class) and state (Ray's ``TaskSummaries``), under
    the key ``"cluster"``."""
    return _summary("tasks", address, timeout, raise_on_missing_output)


def summarize_actors(address: Optional[str] = None, timeout: int = DEFAULT_RPC_TIMEOUT,
                     raise_on_missing_output: bool = True, _explain: bool = False) -> Dict:
    """Actors counted by class and state (Ray's ``ActorSummaries``), under ``"cluster"``."""
    return _summary("actors", address, timeout, raise_on_missing_output)


def summarize_objects(address: Optional[str] = None, timeout: int = DEFAULT_RPC_TIMEOUT,
                      raise_on_missing_output: bool = True, _explain: bool = False) -> Dict:
    """Objects counted and sized (Ray's ``ObjectSummaries``), under ``"cluster"``."""
    return _summary("objects", address, timeout, raise_on_missing_output)


def list_logs(address: Optional[str] = None, node_id: Optional[str] = None,
              node_ip: Optional[str] = None, glob_filter: Optional[str] = None,
              timeout: int = DEFAULT_RPC_TIMEOUT) -> Dict[str, List[str]]:
    """The log files of one node (Ray's ``ray.util.state.list_logs``), grouped as Ray
    groups them: ``{"worker_out": [...], "worker_err": [...], "agent": [...], ...}``;
    names are relative to the node's ``<session>/logs``. ``glob_filter`` (default ``*``)
    selects by name, e.g. ``"*worker*"``.

    Raises:
        AssertionError: neither ``node_id`` nor ``node_ip`` is given (as Ray's).
        RayStateApiException: the head or the node could not list them.
    """
    assert node_ip is not None or node_id is not None, "At least one of node ip and node id is required"
    params: List[Tuple[str, Any]] = []
    if node_ip:
        params.append(("node_ip", node_ip))
    if node_id:
        params.append(("node_id", node_id))
    params.append(("glob", glob_filter or "*"))
    params.append(("timeout", int(timeout)))
    try:
        return _query("logs", "logs", params, address, timeout)
    except RuntimeError as e:
        if isinstance(e, RayStateApiException):
            raise
        raise RayStateApiException(str(e)) from None


def get_log(address: Optional[str] = None, node_id: Optional[str] = None,
            node_ip: Optional[str] = None, filename: Optional[str] = None,
            actor_id: Optional[str] = None, task_id: Optional[str] = None,
            pid: Optional[int] = None, follow: bool = False, tail: int = -1,
            timeout: int = DEFAULT_RPC_TIMEOUT, suffix: str = "out",
            encoding: Optional[str] = "utf-8", errors: Optional[str] = "strict",
            submission_id: Optional[str] = None, attempt_number: int = 0,
            _interval: Optional[float] = None, filter_ansi_code: bool = False):
    """Yields a log's text as it is read (Ray's ``ray.util.state.get_log``): a file of a
    node (``filename`` with ``node_id`` or ``node_ip``), an actor's worker log
    (``actor_id``), the part of its worker's log a task wrote (``task_id``,
    ``attempt_number``), a worker's log by ``pid`` (with a node), or a submitted job's
    driver log (``submission_id``, with a node). ``tail``: lines from the end (-1: all);
    ``follow``: keep yielding what is appended (``_interval`` seconds between looks,
    default 1); ``suffix``: ``"out"`` or ``"err"``; ``encoding=None`` yields bytes;
    ``filter_ansi_code`` drops terminal colour codes.

    Raises:
        ValueError: the options do not name one log (Ray's ``GetLogOptions`` checks).
        RayStateApiException: the head could not find or read it (its message says why).
    """
    if _interval is not None and not follow:
        raise ValueError("_interval is only for follow=True")
    if not (node_id or node_ip) and not (actor_id or task_id):
        raise ValueError(
            "node_id or node_ip must be provided as constructor arguments when no "
            "actor or task_id is supplied as arguments."
        )
    if node_id and node_ip:
        raise ValueError(
            "Both node_id and node_ip are given. Only one of them can be provided. "
            f"Given node id: {node_id}, given node ip: {node_ip}"
        )
    if not (actor_id or task_id or pid or filename or submission_id):
        raise ValueError(
            "None of actor_id, task_id, pid, submission_id or filename "
            "is provided. At least one of them is required to fetch logs."
        )
    if suffix not in ("out", "err"):
        raise ValueError(f"Invalid suffix: {suffix}. Must be one of 'out' or 'err'.")
    if timeout is not None and (not isinstance(timeout, (int, float)) or timeout <= 0):
        raise ValueError(f"timeout must be a positive number of seconds (got {timeout!r})")
    import codecs

    from tpuray._private.api_address import default_address

    decoder = None if encoding is None else codecs.getincrementaldecoder(encoding)(errors or "strict")
    params = [("node_id", node_id), ("node_ip", node_ip), ("filename", filename),
              ("actor_id", actor_id), ("task_id", task_id), ("pid", pid), ("lines", int(tail)),
              ("interval", _interval), ("timeout", int(timeout)), ("suffix", suffix),
              ("submission_id", submission_id), ("attempt_number", int(attempt_number)),
              ("filter_ansi_code", "true" if filter_ansi_code else "false")]
    query = urllib.parse.urlencode([(k, str(v)) for k, v in params if v is not None])
    media = "stream" if follow else "file"
    client = _tpuray.JobClient(default_address(address))
    try:
        body = client.get_stream(f"/api/v0/logs/{media}?{query}", float(timeout) + 5)
    except RuntimeError as e:
        raise RayStateApiException(str(e)) from None
    while True:
        try:
            chunk = body.next_chunk()
        except RuntimeError as e:
            raise RayStateApiException(str(e)) from None
        if chunk is None:
            break
        if decoder is None:
            yield chunk
        else:
            text = decoder.decode(chunk)
            if text:
                yield text
    if decoder is not None:
        rest = decoder.decode(b"", final=True)
        if rest:
            yield rest
