"""``JobConfig`` (Ray's ``ray.job_config.JobConfig``): a job's settings given to
``init(job_config=...)``.

tpuray honours ``runtime_env`` (used when ``init`` names none) and ``ray_namespace``
(used when ``init`` names none). ``init`` refuses by name the fields it cannot honour
when given other than Ray's defaults: ``jvm_options`` and ``code_search_path`` (tpuray
runs Python and Rust workers only), ``metadata`` (tpuray's job records keep only the Jobs
API's metadata), ``default_actor_lifetime="detached"`` (give ``lifetime="detached"`` per
actor), ``_disable_job_level_lineage_reconstruction`` (lineage reconstruction is always on).
"""

from __future__ import annotations

from typing import Optional


class JobConfig:
    """A job's settings (Ray 2.60's ``JobConfig``, same arguments).

    Raises:
        ValueError: ``default_actor_lifetime`` is neither ``"detached"`` nor
            ``"non_detached"`` (Ray's check).
    """

    def __init__(
        self,
        jvm_options: Optional[list] = None,
        code_search_path: Optional[list] = None,
        runtime_env: Optional[dict] = None,
        _client_job: bool = False,
        metadata: Optional[dict] = None,
        ray_namespace: Optional[str] = None,
        default_actor_lifetime: str = "non_detached",
        _disable_job_level_lineage_reconstruction: bool = False,
        _py_driver_sys_path: Optional[list] = None,
    ):
        self.jvm_options = jvm_options or []
        self.code_search_path = code_search_path or []
        self.runtime_env = runtime_env or {}
        self._client_job = _client_job
        self.metadata = metadata or {}
        self.ray_namespace = ray_namespace
        self.set_default_actor_lifetime(default_actor_lifetime)
        self._disable_job_level_lineage_reconstruction = _disable_job_level_lineage_reconstruction
        self._py_driver_sys_path = _py_driver_sys_path or []

    def set_metadata(self, key: str, value: str) -> None:
        self.metadata[key] = value

    def set_ray_namespace(self, ray_namespace: str) -> None:
        self.ray_namespace = ray_namespace

    def set_runtime_env(self, runtime_env: Optional[dict], validate: bool = False) -> None:
        self.runtime_env = dict(runtime_env) if runtime_env else {}

    def set_default_actor_lifetime(self, default_actor_lifetime: str) -> None:
        if default_actor_lifetime not in ("detached", "non_detached"):
            raise ValueError(
                "Default actor lifetime must be one of `detached`, `non_detached`"
            )
        self.default_actor_lifetime = default_actor_lifetime

    def _check_supported(self) -> None:
        """Refuses, by name, the fields given that tpuray cannot honour.

        Raises:
            ValueError: naming the field and why."""
        why = {
            "jvm_options": (self.jvm_options, "tpuray runs Python and Rust workers only"),
            "code_search_path": (self.code_search_path, "tpuray runs Python and Rust workers only"),
            "metadata": (self.metadata, "tpuray keeps job metadata only for Jobs API submissions "
                                        "(JobSubmissionClient.submit_job(metadata=...))"),
            "default_actor_lifetime": (
                self.default_actor_lifetime == "detached",
                "give lifetime=\"detached\" to each actor's options instead",
            ),
            "_disable_job_level_lineage_reconstruction": (
                self._disable_job_level_lineage_reconstruction,
                "lineage reconstruction is always on",
            ),
        }
        for name, (given, reason) in why.items():
            if given:
                raise ValueError(f"tpuray.init does not support JobConfig({name}=...): {reason}")

    @classmethod
    def from_json(cls, job_config_json: dict) -> "JobConfig":
        return cls(
            jvm_options=job_config_json.get("jvm_options"),
            code_search_path=job_config_json.get("code_search_path"),
            runtime_env=job_config_json.get("runtime_env"),
            metadata=job_config_json.get("metadata"),
            ray_namespace=job_config_json.get("ray_namespace"),
            default_actor_lifetime=job_config_json.get("default_actor_lifetime", "non_detached"),
        )
