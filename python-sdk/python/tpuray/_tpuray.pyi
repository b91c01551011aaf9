"""Type stubs for ``tpuray._tpuray``, the Rust extension module.

It exposes the tpuray command line and the Rust core worker (``tpuray::raw``): the
Python package builds Ray's API on these calls. Values cross as bytes that Python
pickles itself; blocking calls release the GIL; ``get`` and ``wait`` check for signals
every 100 ms, so Ctrl-C interrupts them.
"""

from typing import Any, List, Optional, Tuple, final

__all__ = [
    "run",
    "RefCore",
    "ObjectBuffer",
    "AsyncReply",
    "init_driver",
    "process_info",
    "tpu_slice_shape",
    "is_initialized",
    "dashboard_url",
    "free",
    "metric_define",
    "metric_record",
    "metric_destination",
    "shutdown",
    "submit",
    "create_actor",
    "call_actor",
    "get",
    "put",
    "wait",
    "deserialize_ref",
    "begin_borrow_batch",
    "end_borrow_batch",
    "cancel",
    "cancel_task",
    "is_cancelled",
    "generator_ready",
    "kv_get",
    "kv_put",
    "kv_delete",
    "list_actors",
    "available_resources_per_node",
    "kill_actor",
    "get_actor",
    "actor_state",
    "actor_record",
    "nodes",
    "timeline_json",
    "cluster_resources",
    "available_resources",
    "create_placement_group",
    "placement_group_state",
    "placement_group_table",
    "remove_placement_group",
    "get_placement_group",
    "slice_placement_group",
    "run_worker",
    "report_logs",
    "set_log_to_driver",
    "submit_streaming",
    "call_actor_streaming",
    "next_item",
    "drop_stream",
    "prestart_workers",
    "enable_async_calls",
    "take_async_calls",
    "gang_start",
    "gang_reserve",
    "gang_release",
    "gang_adopt",
    "JobClient",
    "LogTail",
    "package_local",
    "BodyStream",
    "__version__",
    "OPTIMIZED",
]

__version__: str
#: Compiled with optimisations (cargo's release profile); Ray's ``ray._raylet.OPTIMIZED``.
OPTIMIZED: bool
"""The version of the tpuray Rust crates this module was built from."""

def run(argv: list[str]) -> int:
    """Runs the tpuray command line (program name first, e.g. ``["tpuray", "status"]``).

    Returns the exit code: 0 on success, 1 on an error (printed to stderr as
    ``tpuray: <message>``), 2 on a usage error. Long-running verbs (``start --block``,
    ``_head``, ``_agent``, ``_worker``) return only when their process is asked to stop.
    """

@final
class RefCore:
    """An object reference held by the core: id and owner. Dropping the last Python
    reference releases it."""

    def id(self) -> str:
        """The object id, 32 hex characters."""
    def owner(self) -> str:
        """The owner's ``host:port``."""

_Arg = tuple[str, bytes, list[RefCore]] | tuple[str, RefCore]
"""``("v", pickled value, nested refs)`` or ``("r", ref)`` (resolved before the call)."""

_Scheduling = Optional[str | tuple[str, str, bool] | tuple[str, str, int]]
"""``None``/``"DEFAULT"``, ``"SPREAD"``, ``("node", node_id, soft)`` or
``("pg", group_id, bundle_index)``."""

def init_driver(
    address: Optional[str] = None,
    namespace: Optional[str] = None,
    registry_dir: Optional[str] = None,
) -> dict[str, str]:
    """Joins the cluster at ``address`` as a Python driver (attaching to the node that
    this machine's process registry, or ``registry_dir``, lists); returns ``job_id``,
    ``node_id``, ``worker_id``, ``address``, ``agent_address``, ``head_address``.

    Raises RuntimeError naming the missing address, token or head refusal."""
def process_info() -> dict[str, str]: ...
def is_initialized() -> bool: ...
def dashboard_url() -> str: ...
def free(refs: list) -> None: ...
def shutdown() -> None:
    """Finishes the job: its non-detached actors and placement groups end."""
def submit(function: str, args: list[_Arg], options: dict[str, Any]) -> list[RefCore]:
    """Submits a task of function-table key ``function``; options: ``num_cpus``,
    ``num_gpus``, ``resources``, ``max_retries``, ``retry_exceptions``, ``num_returns``,
    ``name``, ``label_selector``, ``scheduling``. Raises RuntimeError on bad options."""
def create_actor(class_key: str, display: str, args: list[_Arg], options: dict[str, Any]) -> tuple[str, str]:
    """Creates an actor; returns ``(actor_id, name)``. Options: ``num_cpus`` (None: 1 to
    place, 0 to run), ``num_gpus``, ``resources``, ``name``, ``namespace``, ``detached``,
    ``max_restarts``, ``max_concurrency``, ``get_if_exists``, ``label_selector``,
    ``scheduling``."""
def call_actor(
    actor_id: str, display: str, method: str, args: list[_Arg], num_returns: int,
    max_task_retries: int = 0, concurrency_group: str = ..., retry_exceptions: bool = False,
    max_pending_calls: int = ...,
) -> list[RefCore]:
    """Raises ``PendingCallsLimitExceeded`` over ``max_pending_calls``."""
@final
class ObjectBuffer:
    """A store object mapped read-only (what ``get`` returns for large objects). Keep it
    alive for as long as its memory is read; the object stays pinned in memory until
    then."""

    def address(self) -> int:
        """The address of the first byte of the mapping."""
    def __len__(self) -> int:
        """The object's size in bytes."""

def get(refs: list[RefCore], timeout: Optional[float] = None) -> list[tuple[int, Any]]:
    """Per ref ``(0, bytes)`` (inline), ``(2, ObjectBuffer)`` (mapped from the node's
    store, not copied) or ``(1, (kind, message, payload, function, node, pid))`` where
    kind is one of ``task``, ``worker_died``, ``actor_died``, ``cancelled``, ``timeout``,
    ``object_lost``, ``infeasible``, ``decode``, ``cluster``."""
def put(parts: list[Any], nested: list[RefCore]) -> RefCore:
    """Stores the concatenation of ``parts`` (bytes-like objects, each one contiguous
    buffer) as an object owned by this process; large ones are written into the node's
    store part by part, without the GIL."""
def wait(refs: list[RefCore], num_returns: int, timeout: Optional[float] = None) -> list[bool]: ...
def begin_borrow_batch() -> None:
    """Opens a borrow batch around unpickling one value (refs register together)."""

def end_borrow_batch() -> None:
    """Closes it; the outermost waits until the owners confirmed the registrations."""

def deserialize_ref(id: str, owner: str) -> RefCore:
    """A ref rebuilt while unpickling; registers this process as a borrower."""
def cancel(r: RefCore, force: bool, recursive: bool = True) -> None:
    """Raises ``ValueError`` for ``force`` on an unfinished actor call."""
def cancel_task(task_id: str, force: bool, recursive: bool) -> None: ...
def is_cancelled(task_id: Optional[str] = None) -> bool: ...
def generator_ready(task_id: str, index: int) -> bool: ...
def kv_get(namespace: str, key: bytes) -> Optional[bytes]: ...
def package_local(field: str, path: str, excludes: List[str], cwd: str) -> Optional[Tuple[str, bytes]]: ...
def kv_put(namespace: str, key: bytes, value: bytes, overwrite: bool) -> bool: ...
def kv_delete(namespace: str, key: bytes) -> bool:
    """Deletes a key; returns whether it existed."""
def list_actors() -> list[tuple[str, str, str, str, str]]:
    """Every actor the head knows: ``(actor_id, class_name, name, namespace, state)``, state
    one of ``PENDING_CREATION``, ``ALIVE``, ``RESTARTING``, ``DEAD``."""
def kill_actor(actor_id: str, no_restart: bool, reason: str = ...) -> None:
    """``reason`` (default none) becomes the actor's death cause."""
def get_actor(name: str, namespace: Optional[str] = None) -> tuple[str, str, str]:
    """``(actor_id, class, name)``; RuntimeError when no live actor has the name."""
def actor_state(actor_id: str, wait: float) -> tuple[str, str, str, int]:
    """``(state, death_cause, node_id, pid)``."""
def actor_record(actor_id: str) -> tuple[str, str, int]:
    """``(name, namespace, num_restarts)`` of the actor, as the head has them."""
def nodes() -> list[dict[str, Any]]:
    """Ray's keys: ``NodeID``, ``Alive``, ``alive``, ``NodeManagerAddress``,
    ``NodeManagerPort``, ``NodeManagerHostname``, ``NodeName``, ``Resources``, ``Labels``,
    ``MetricsExportPort``, ``DeathReasonMessage``."""
def timeline_json(job_id: str | None = None) -> str:
    """The cluster's task events as Chrome trace JSON text (a JSON array)."""
def cluster_resources() -> dict[str, float]: ...
def metric_define(
    kind: str, name: str, description: str, tag_keys: list[str], boundaries: list[float]
) -> None:
    """Defines a user metric (``counter``, ``gauge``, ``histogram``); ValueError on a bad
    name or boundaries, or a name already defined differently."""
def metric_record(name: str, tag_values: list[str], value: float) -> None:
    """Records a value for one series; ValueError on bad values or tag counts."""
def metric_destination() -> tuple[str, bool] | None:
    """(node agent address, whether it is on another host), or None before init."""
def available_resources() -> dict[str, float]: ...
def available_resources_per_node() -> dict[str, dict[str, float]]:
    """Free resources of each live node, by node id."""
def create_placement_group(
    bundles: list[dict[str, float]],
    strategy: str,
    name: Optional[str] = None,
    namespace: Optional[str] = None,
    detached: bool = False,
    bundle_label_selector: Optional[list[dict[str, str]]] = None,
) -> tuple[str, int]:
    """Returns ``(group_id, bundle_count)``."""
def placement_group_state(id: str, wait: float) -> dict[str, Any]:
    """A ``placement_group_table`` entry, waiting up to ``wait`` seconds for CREATED or
    REMOVED."""
def placement_group_table() -> list[dict[str, Any]]: ...
def remove_placement_group(id: str) -> None: ...
def get_placement_group(name: str, namespace: Optional[str] = None) -> tuple[str, int]: ...
def tpu_slice_shape(
    accelerator_type: Optional[str] = None,
    topology: Optional[str] = None,
    version: Optional[str] = None,
) -> tuple[str, int, int, int]:
    """TPU.md's slice arithmetic: ``(normalised type, chips, hosts, chips per host)`` of an
    accelerator type (``"tpu7x-16"`` -> ``("v7x-16", 8, 2, 4)``) or of a topology and a
    version. Raises ``ValueError`` naming what is wrong."""

def slice_placement_group(
    topology: str,
    accelerator_version: str,
    resources_per_bundle: Optional[dict[str, float]] = None,
    num_slices: int = 1,
    name: str = ...,
) -> tuple[str, int, str, int, int]:
    """``(group_id, bundle_count, accelerator_type, num_hosts, chips_per_host)``; ``name``
    is the group's (as ``tpuray status`` shows it);
    ValueError for an unknown version or a topology not valid for it."""
def gang_start(
    topology: str, accelerator_version: str, num_slices: int, per_chip: bool,
    max_restarts: int, name: str, timeout: float, launch: Any,
) -> list[RefCore]:
    """Starts a slice gang: ``launch(generation: dict, member: dict) -> RefCore`` submits one
    member; returns one ref per member, settled by the gang's supervisor (restarts included).
    ValueError for a bad topology/version or slices not reserved within ``timeout`` s."""
def gang_reserve(
    topology: str, accelerator_version: str, num_slices: int, per_chip: bool, name: str,
    timeout: float, gang_id: str, generation: int,
) -> tuple[str, dict[str, Any], list[dict[str, Any]]]:
    """One generation of a gang: ``(handle, generation, members)``; members carry ``index``,
    ``bundle_index``, ``chips``, ``local_rank`` and ``env``."""
def gang_release(handle: str) -> None:
    """Stops the generation's members and releases its slices and ports."""
def gang_adopt(
    placement_group_id: str, bundle_count: int, topology: str, accelerator_version: str,
    num_slices: int, per_chip: bool, name: str, timeout: float, gang_id: str,
) -> tuple[str, dict[str, Any], list[dict[str, Any]]]:
    """A gang generation inside a slice group the caller holds."""
def run_worker(runtime: Any) -> int:
    """A worker process's main loop; ``runtime`` has ``run_task``, ``create_actor`` and
    ``call_method``, each taking ``(info: dict, args: list[bytes])``."""
def report_logs(driver: str, batches: list[tuple[str, list[str]]], is_err: bool) -> bool:
    """False: the driver takes no worker output (stop sending)."""
def set_log_to_driver(on: bool) -> None: ...
def prestart_workers(count: int) -> int: ...
def submit_streaming(function: str, args: list[_Arg], options: dict[str, Any]) -> str:
    """Submits a streaming generator task; returns its task id."""
def call_actor_streaming(
    actor_id: str, display: str, method: str, args: list[_Arg], concurrency_group: str = ...,
    max_pending_calls: int = ...,
) -> str: ...
def next_item(task_id: str, name: str, index: int) -> Optional[RefCore]:
    """The item's ref, ``None`` after the last; a failure is one more ref whose get
    raises it."""
def drop_stream(task_id: str, consumed: int) -> None: ...

@final
class AsyncReply:
    """Where an async actor method's answer goes (from :func:`take_async_calls`)."""
    def send(self, reply: tuple) -> None:
        """``("ok", [bytes...], [RefCore...])`` or ``("err", message, payload[, no_retry])``."""

def enable_async_calls(methods: list[str], wake_fd: int) -> None:
    """Hands calls of ``methods`` to the event loop woken through ``wake_fd`` (taken over)."""
def take_async_calls() -> list[tuple[AsyncReply, str, int, list[bytes], str]]:
    """The queued calls: ``(reply, method, num_returns, args, task_id)``."""

@final
class JobClient:
    """The Jobs REST API client (``tpuray.job_submission`` wraps it). JSON crosses as str.

    Raises ``ConnectionError`` (unreachable), ``tpuray.exceptions.AuthenticationError``
    (401/403), ``RuntimeError`` (other non-200 answers) and ``ValueError`` (bad input)."""
    def __new__(
        cls,
        address: Optional[str] = None,
        headers: Optional[dict[str, str]] = None,
        cookies: Optional[dict[str, str]] = None,
        metadata: Optional[dict[str, str]] = None,
    ) -> "JobClient":
        """Resolves the address (Ray's rules) and checks ``/api/version``."""
    def address(self) -> str: ...
    def version_info(self) -> str: ...
    def submit(self, request_json: str, cwd: str) -> str:
        """Uploads the request's local runtime_env paths (relative to ``cwd``), submits;
        returns the submission id."""
    def job_info(self, job_id: str) -> str: ...
    def list(self) -> str: ...
    def stop(self, job_id: str) -> bool: ...
    def delete(self, job_id: str) -> bool: ...
    def logs(self, job_id: str) -> str: ...
    def get(self, path: str, timeout: Optional[float] = None) -> str:
        """``GET path`` (with its query) on the same server; the body of a 200 answer."""
    def get_stream(self, path: str, timeout: Optional[float] = None) -> BodyStream:
        """``GET path`` read as it arrives; raises for an answer other than 200."""
    def tail(self, job_id: str) -> LogTail: ...

@final
class BodyStream:
    def next_chunk(self) -> Optional[bytes]:
        """The next chunk of the body; ``None`` at its end. Blocks without the GIL."""

@final
class LogTail:
    def next_chunk(self) -> Optional[str]:
        """The next chunk of the job's logs; ``None`` once the job ended and all were sent."""
