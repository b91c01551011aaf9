"""Ray's Jobs SDK (``ray.job_submission``): submit a shell command to a cluster, follow
its logs, stop it.

``JobSubmissionClient`` speaks Ray 2.60's Jobs REST API to the head's dashboard port
through the extension's Rust client (``tpuray._tpuray.JobClient``, the one the ``tpuray
job`` CLI uses: HTTP, ``working_dir``/``py_modules`` packaging, auth headers and address
resolution are implemented once, there). It also talks to Ray's own job servers, and
Ray's client talks to tpuray's.

Addresses follow Ray's rules: ``RAY_API_SERVER_ADDRESS``, then ``RAY_ADDRESS``, override
the ``address`` argument; ``http://HOST:PORT`` is the dashboard itself, ``HOST:PORT`` a
head's address (its dashboard is asked of it); with neither, ``TPURAY_ADDRESS``, then the
cluster ``tpuray start --head`` left on this machine. The cluster token
(``TPURAY_AUTH_TOKEN``, ``RAY_AUTH_TOKEN`` or ``~/.tpuray/auth_token``) is sent as
``Authorization: Bearer ...`` unless ``headers`` carries an ``Authorization`` header.

Every method blocks without holding the GIL, except ``tail_job_logs``, an async
iterator whose waits run in the event loop's default executor.
"""

from __future__ import annotations

import asyncio
import copy
import dataclasses
import enum
import json
import logging
import os
from pathlib import Path
from typing import TYPE_CHECKING, Any, AsyncIterator, Dict, List, Optional, Union, cast

if TYPE_CHECKING:
    from _typeshed import DataclassInstance

from tpuray import _tpuray
from tpuray._private.runtime_env import _module_path

logger = logging.getLogger(__name__)

__all__ = [
    "JobSubmissionClient",
    "JobStatus",
    "JobErrorType",
    "JobInfo",
    "JobDetails",
    "DriverInfo",
    "JobType",
]


class JobStatus(str, enum.Enum):
    """The status of a job (Ray's ``JobStatus``)."""

    #: The job has not started yet, likely waiting for its runtime_env to be set up.
    PENDING = "PENDING"
    #: The job is running.
    RUNNING = "RUNNING"
    #: The job was intentionally stopped by the user.
    STOPPED = "STOPPED"
    #: The job finished successfully.
    SUCCEEDED = "SUCCEEDED"
    #: The job failed.
    FAILED = "FAILED"

    def __str__(self) -> str:
        return f"{self.value}"

    def is_terminal(self) -> bool:
        """Whether the status can no longer change: ``STOPPED``, ``SUCCEEDED``, ``FAILED``."""
        return self.value in {"STOPPED", "SUCCEEDED", "FAILED"}


class JobErrorType(str, enum.Enum):
    """Why a job failed (Ray's ``JobErrorType``)."""

    RUNTIME_ENV_SETUP_FAILURE = "RUNTIME_ENV_SETUP_FAILURE"
    JOB_SUPERVISOR_ACTOR_START_TIMEOUT = "JOB_SUPERVISOR_ACTOR_START_TIMEOUT"
    JOB_SUPERVISOR_ACTOR_START_FAILURE = "JOB_SUPERVISOR_ACTOR_START_FAILURE"
    JOB_SUPERVISOR_ACTOR_UNSCHEDULABLE = "JOB_SUPERVISOR_ACTOR_UNSCHEDULABLE"
    JOB_SUPERVISOR_ACTOR_UNKNOWN_FAILURE = "JOB_SUPERVISOR_ACTOR_UNKNOWN_FAILURE"
    JOB_SUPERVISOR_ACTOR_DIED = "JOB_SUPERVISOR_ACTOR_DIED"
    JOB_ENTRYPOINT_COMMAND_START_ERROR = "JOB_ENTRYPOINT_COMMAND_START_ERROR"
    JOB_ENTRYPOINT_COMMAND_ERROR = "JOB_ENTRYPOINT_COMMAND_ERROR"


class JobType(str, enum.Enum):
    """How a job was started (Ray's ``JobType``)."""

    #: Through the Jobs API.
    SUBMISSION = "SUBMISSION"
    #: By a driver script that called ``init``.
    DRIVER = "DRIVER"


def _fields_of(cls, data: Dict[str, Any]) -> Dict[str, Any]:
    """The entries of ``data`` that are fields of dataclass ``cls`` (the server may send
    more; Ray's pydantic models ignore extra fields too)."""
    names = {f.name for f in dataclasses.fields(cls)}
    return {k: v for k, v in data.items() if k in names}


class _Model:
    """Ray's pydantic models' dict views, for the dataclasses below."""

    def dict(self) -> Dict[str, Any]:
        """The fields as a dict (enums as their values, nested models as dicts)."""

        def plain(v):
            if isinstance(v, enum.Enum):
                return v.value
            if isinstance(v, _Model):
                return v.dict()
            return v

        # Every _Model is a dataclass (the classes below).
        fields = dataclasses.fields(cast("DataclassInstance", self))
        return {f.name: plain(getattr(self, f.name)) for f in fields}

    model_dump = dict

    def json(self) -> str:
        return json.dumps(self.dict())

    model_dump_json = json


@dataclasses.dataclass
class DriverInfo(_Model):
    """The driver of a job (Ray's ``DriverInfo``)."""

    #: The driver's id.
    id: str
    #: The address of the node the driver runs on.
    node_ip_address: str
    #: The driver process's pid, as a string.
    pid: str

    def __post_init__(self):
        self.pid = str(self.pid)


@dataclasses.dataclass
class JobDetails(_Model):
    """A job, as the Jobs API reports it (Ray's ``JobDetails``). Times are Unix ms."""

    type: JobType
    status: JobStatus
    entrypoint: str
    job_id: Optional[str] = None
    submission_id: Optional[str] = None
    driver_info: Optional[DriverInfo] = None
    message: Optional[str] = None
    error_type: Optional[str] = None
    start_time: Optional[int] = None
    end_time: Optional[int] = None
    metadata: Optional[Dict[str, str]] = None
    runtime_env: Optional[Dict[str, Any]] = None
    driver_agent_http_address: Optional[str] = None
    driver_node_id: Optional[str] = None
    driver_exit_code: Optional[int] = None

    def __post_init__(self):
        self.type = JobType(self.type)
        self.status = JobStatus(self.status)
        if isinstance(self.driver_info, dict):
            self.driver_info = DriverInfo(**_fields_of(DriverInfo, self.driver_info))

    @classmethod
    def _from_json(cls, data: Dict[str, Any]) -> "JobDetails":
        return cls(**_fields_of(cls, data))

    def __repr__(self) -> str:
        parts = ", ".join(
            f"{f}={getattr(self, f)!r}"
            for f in (
                "type", "job_id", "submission_id", "driver_info", "status", "entrypoint",
                "message", "error_type", "start_time", "end_time", "metadata", "runtime_env",
                "driver_agent_http_address", "driver_node_id", "driver_exit_code",
            )
        )
        return f"JobDetails({parts})"


@dataclasses.dataclass
class JobInfo:
    """A job's record (Ray's ``JobInfo``); the client's methods return
    :class:`JobDetails`, which carries the same fields and the driver's."""

    status: JobStatus
    entrypoint: str
    message: Optional[str] = None
    error_type: Optional[JobErrorType] = None
    start_time: Optional[int] = None
    end_time: Optional[int] = None
    metadata: Optional[Dict[str, str]] = None
    runtime_env: Optional[Dict[str, Any]] = None
    entrypoint_num_cpus: Optional[Union[int, float]] = None
    entrypoint_num_gpus: Optional[Union[int, float]] = None
    entrypoint_memory: Optional[int] = None
    entrypoint_resources: Optional[Dict[str, float]] = None
    driver_agent_http_address: Optional[str] = None
    driver_node_id: Optional[str] = None
    driver_exit_code: Optional[int] = None

    def __post_init__(self):
        if isinstance(self.status, str):
            self.status = JobStatus(self.status)
        if self.message is None:
            self.message = {
                JobStatus.PENDING: "Job has not started yet.",
                JobStatus.RUNNING: "Job is currently running.",
                JobStatus.STOPPED: "Job was intentionally stopped.",
                JobStatus.SUCCEEDED: "Job finished successfully.",
                JobStatus.FAILED: "Job failed.",
            }[self.status]


def _check_number(name: str, v) -> None:
    if v is not None and (isinstance(v, bool) or not isinstance(v, (int, float))):
        raise TypeError(f"{name} must be a number, got {type(v)}")


def _check_str_dict(name: str, d, values=str) -> None:
    if d is None:
        return
    if not isinstance(d, dict):
        raise TypeError(f"{name} must be a dict, got {type(d)}")
    for k, v in d.items():
        if not isinstance(k, str):
            raise TypeError(f"{name} keys must be strings, got {type(k)}")
        if not isinstance(v, values) or isinstance(v, bool) and values is not str:
            kind = "strings" if values is str else "numbers"
            raise TypeError(f"{name} values must be {kind}, got {type(v)}")


class JobSubmissionClient:
    """Submits jobs to a cluster and follows them over its Jobs REST API (Ray's
    ``JobSubmissionClient``, same signature).

    Args:
        address: ``http://HOST:DASHBOARD_PORT``, a head's ``HOST:PORT``, or ``None``
            (see the module doc; ``RAY_API_SERVER_ADDRESS``/``RAY_ADDRESS`` override it).
        create_cluster_if_needed: accepted for Ray's signature; tpuray never starts a
            cluster here.
        cookies: cookies sent with every request.
        metadata: merged into every submitted job's metadata.
        headers: headers sent with every request (an ``Authorization`` header replaces
            the cluster token).
        verify: TLS verification (``True``/``False``, or a CA file or folder); this
            client speaks plain http.

    Raises:
        ConnectionError: the server cannot be reached.
        tpuray.exceptions.AuthenticationError: the server refused the token.
        ValueError: the address is not usable.
        TypeError: an argument of the wrong type.
    """

    def __init__(
        self,
        address: Optional[str] = None,
        create_cluster_if_needed: bool = False,
        cookies: Optional[Dict[str, Any]] = None,
        metadata: Optional[Dict[str, Any]] = None,
        headers: Optional[Dict[str, Any]] = None,
        verify: Optional[Union[str, bool]] = True,
        **kwargs,
    ):
        if address is not None and not isinstance(address, str):
            raise TypeError(f"address must be a string, got {type(address)}")
        if not isinstance(create_cluster_if_needed, bool):
            raise TypeError(
                f"create_cluster_if_needed must be a bool, got {type(create_cluster_if_needed)}"
            )
        if cookies is not None and not isinstance(cookies, dict):
            raise TypeError(f"cookies must be a dict, got {type(cookies)}")
        if metadata is not None and not isinstance(metadata, dict):
            raise TypeError(f"metadata must be a dict, got {type(metadata)}")
        if headers is not None and not isinstance(headers, dict):
            raise TypeError(f"headers must be a dict, got {type(headers)}")
        if not isinstance(verify, (str, bool)):
            raise TypeError(f"verify must be a str or bool, got {type(verify)}")
        if isinstance(verify, str) and not os.path.exists(verify):
            raise FileNotFoundError(f"Path to CA certificates: '{verify}', does not exist.")
        if kwargs:
            raise TypeError(
                f"JobSubmissionClient got arguments tpuray does not support: {', '.join(sorted(kwargs))}"
            )
        from tpuray._private.api_address import default_address

        self._client = _tpuray.JobClient(
            default_address(address),
            {str(k): str(v) for k, v in (headers or {}).items()},
            {str(k): str(v) for k, v in (cookies or {}).items()},
            {str(k): str(v) for k, v in (metadata or {}).items()},
        )

    def submit_job(
        self,
        *,
        entrypoint: str,
        job_id: Optional[str] = None,
        runtime_env: Optional[Dict[str, Any]] = None,
        metadata: Optional[Dict[str, str]] = None,
        submission_id: Optional[str] = None,
        entrypoint_num_cpus: Optional[Union[int, float]] = None,
        entrypoint_num_gpus: Optional[Union[int, float]] = None,
        entrypoint_memory: Optional[int] = None,
        entrypoint_resources: Optional[Dict[str, float]] = None,
        entrypoint_label_selector: Optional[Dict[str, str]] = None,
    ) -> str:
        """Submits a shell command to run on the cluster, once.

        A local ``runtime_env["working_dir"]`` (a folder, or a .zip/.tar.gz/.tgz/.tar.xz
        file) and local ``py_modules`` are uploaded first (only when the cluster lacks
        them), paths relative to the current folder; a ``pip`` requirements file is read
        into its list.

        Args:
            entrypoint: the shell command (run with ``/bin/sh -c`` in the working dir).
            job_id: deprecated name of ``submission_id``.
            runtime_env: the job's runtime environment (``working_dir``, ``pip``,
                ``env_vars``, ``py_modules``, ``excludes``, ...).
            metadata: strings stored with the job.
            submission_id: the job's id (default: one is generated).
            entrypoint_num_cpus: CPUs reserved for the command itself (default 0).
            entrypoint_num_gpus: GPUs reserved for the command itself (default 0).
            entrypoint_memory: bytes of memory reserved for the command itself.
            entrypoint_resources: custom resources reserved for the command itself.
            entrypoint_label_selector: labels the command's node must have.

        Returns:
            The submission id.

        Raises:
            RuntimeError: the server refused the job (a used submission id, ...).
            ValueError: a runtime_env that cannot be prepared (a missing folder, ...).
            TypeError: an argument of the wrong type.
        """
        if job_id:
            logger.warning("job_id kwarg is deprecated. Please use submission_id instead.")
        if not isinstance(entrypoint, str):
            raise TypeError(f"entrypoint must be a string, got {type(entrypoint)}")
        submission_id = submission_id or job_id
        if submission_id is not None and not isinstance(submission_id, str):
            raise TypeError(f"submission_id must be a string if provided, got {type(submission_id)}")
        runtime_env = copy.deepcopy(runtime_env or {})
        if not isinstance(runtime_env, dict):
            raise TypeError(f"runtime_env must be a dict, got {type(runtime_env)}")
        for k in runtime_env:
            if not isinstance(k, str):
                raise TypeError(f"runtime_env keys must be strings, got {type(k)}")
        if isinstance(runtime_env.get("working_dir"), Path):
            runtime_env["working_dir"] = str(runtime_env["working_dir"])
        if isinstance(runtime_env.get("py_modules"), list):
            runtime_env["py_modules"] = [_module_path(m) for m in runtime_env["py_modules"]]
        metadata = dict(metadata or {})
        _check_str_dict("metadata", metadata)
        _check_number("entrypoint_num_cpus", entrypoint_num_cpus)
        _check_number("entrypoint_num_gpus", entrypoint_num_gpus)
        if entrypoint_memory is not None and (
            isinstance(entrypoint_memory, bool) or not isinstance(entrypoint_memory, int)
        ):
            raise TypeError(f"entrypoint_memory must be an int, got {type(entrypoint_memory)}")
        _check_str_dict("entrypoint_resources", entrypoint_resources, values=(int, float))
        _check_str_dict("entrypoint_label_selector", entrypoint_label_selector)
        request = {
            "entrypoint": entrypoint,
            "submission_id": submission_id,
            "runtime_env": runtime_env,
            "metadata": metadata,
            "entrypoint_num_cpus": entrypoint_num_cpus,
            "entrypoint_num_gpus": entrypoint_num_gpus,
            "entrypoint_memory": entrypoint_memory,
            "entrypoint_resources": entrypoint_resources,
            "entrypoint_label_selector": entrypoint_label_selector,
        }
        try:
            body = json.dumps(request)
        except TypeError as e:
            raise TypeError(f"the job's runtime_env and metadata must be JSON-serializable: {e}") from None
        return self._client.submit(body, os.getcwd())

    def stop_job(self, job_id: str) -> bool:
        """Asks a job to stop (its entrypoint and what it started are killed).

        Returns:
            True if the job was running, else False.

        Raises:
            RuntimeError: the job does not exist, or the request failed.
        """
        return self._client.stop(job_id)

    def delete_job(self, job_id: str) -> bool:
        """Deletes a job that ended, and its record (not its logs on disk).

        Returns:
            True if the job was deleted.

        Raises:
            RuntimeError: the job does not exist or has not ended.
        """
        return self._client.delete(job_id)

    def get_job_info(self, job_id: str) -> JobDetails:
        """The job's latest status and details.

        Raises:
            RuntimeError: the job does not exist, or the request failed.
        """
        return JobDetails._from_json(json.loads(self._client.job_info(job_id)))

    def list_jobs(self) -> List[JobDetails]:
        """Every job the cluster ran or runs, submitted or started by a driver."""
        return [JobDetails._from_json(j) for j in json.loads(self._client.list())]

    def get_job_status(self, job_id: str) -> JobStatus:
        """The job's status."""
        return self.get_job_info(job_id).status

    def get_job_logs(self, job_id: str) -> str:
        """Everything the job's entrypoint wrote so far (stdout and stderr)."""
        return self._client.logs(job_id)

    async def tail_job_logs(self, job_id: str) -> AsyncIterator[str]:
        """Follows the job's logs: yields chunks of text as the job writes them, and
        ends once the job ended and every chunk was yielded.

        Raises:
            RuntimeError: the job does not exist.
            ConnectionError: the server stayed unreachable.
        """
        tail = self._client.tail(job_id)
        loop = asyncio.get_running_loop()
        while True:
            chunk = await loop.run_in_executor(None, tail.next_chunk)
            if chunk is None:
                return
            yield chunk

    def get_version(self) -> str:
        """The Jobs API version the server speaks (Ray's ``version`` field of
        ``/api/version``)."""
        return str(json.loads(self._client.version_info()).get("version"))

    def get_address(self) -> str:
        """The server's address, ``http://HOST:PORT``."""
        return self._client.address()
