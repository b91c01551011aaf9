"""Ray's ``ray.runtime_env``: :class:`RuntimeEnv` and :class:`RuntimeEnvConfig`, dicts with
Ray 2.60's shapes (``ray/runtime_env/runtime_env.py``), accepted wherever a
``runtime_env`` dict is (``init``, ``.options``, ``@remote``, the Jobs API).

Fields tpuray honours: ``working_dir``, ``py_modules``, ``pip``, ``uv``, ``env_vars``,
``excludes``, ``config``. Ray's others (``conda``, ``container``, ``image_uri``,
``py_executable``, ``java_jars``, ``worker_process_setup_hook``, ``nsight``) are refused
by name when the environment is constructed.
"""

from __future__ import annotations

import json
from typing import Any, Dict, List, Optional, Union

from tpuray._private import runtime_env as _rt

__all__ = ["RuntimeEnv", "RuntimeEnvConfig"]

#: Ray's ``DEFAULT_RUNTIME_ENV_TIMEOUT_SECONDS``.
DEFAULT_RUNTIME_ENV_TIMEOUT_SECONDS = 600


class RuntimeEnvConfig(dict):
    """Options of a runtime environment's setup (Ray's ``RuntimeEnvConfig``).

    Args:
        setup_timeout_seconds: seconds the setup may take on a node (an int > 0, or -1
            for no limit; default 600). A setup past it fails the task, actor or job with
            ``RuntimeEnvSetupError``.
        eager_install: build the job's environment on the driver's node at ``init``,
            before the first task asks for a worker (default True); with False it is
            built when the first worker needs it.
        log_files: Ray's list of log files to show in its dashboard; tpuray's dashboard
            does not list them, so only an empty list is accepted by the cluster.

    Raises:
        TypeError: ``setup_timeout_seconds`` not an int, ``eager_install`` not a bool,
            ``log_files`` not a list of strings.
        ValueError: ``setup_timeout_seconds`` <= 0 and not -1.
    """

    known_fields = {"setup_timeout_seconds", "eager_install", "log_files"}

    def __init__(self, setup_timeout_seconds: int = DEFAULT_RUNTIME_ENV_TIMEOUT_SECONDS,
                 eager_install: bool = True, log_files: Optional[List[str]] = None):
        super().__init__()
        if not isinstance(setup_timeout_seconds, int) or isinstance(setup_timeout_seconds, bool):
            raise TypeError(f"setup_timeout_seconds must be of type int, got: {type(setup_timeout_seconds)}")
        if setup_timeout_seconds <= 0 and setup_timeout_seconds != -1:
            raise ValueError(
                f"setup_timeout_seconds must be greater than zero or equals to -1, got: {setup_timeout_seconds}"
            )
        self["setup_timeout_seconds"] = setup_timeout_seconds
        if not isinstance(eager_install, bool):
            raise TypeError(f"eager_install must be a boolean. got {type(eager_install)}")
        self["eager_install"] = eager_install
        if log_files is None:
            log_files = []
        if not isinstance(log_files, list) or not all(isinstance(f, str) for f in log_files):
            raise TypeError(f"log_files must be a list of strings or None, got {log_files!r}")
        self["log_files"] = log_files

    @staticmethod
    def parse_and_validate_runtime_env_config(config: Union[Dict, "RuntimeEnvConfig"]) -> "RuntimeEnvConfig":
        """A ``RuntimeEnvConfig`` from a dict (unknown keys warned about and dropped, as
        Ray does) or itself.

        Raises:
            TypeError: neither a dict nor a ``RuntimeEnvConfig``; a field's type.
        """
        if isinstance(config, RuntimeEnvConfig):
            return config
        if isinstance(config, dict):
            unknown = set(config) - RuntimeEnvConfig.known_fields
            if unknown:
                _rt.warn_unknown_config(unknown)
            return RuntimeEnvConfig(**{k: v for k, v in config.items() if k in RuntimeEnvConfig.known_fields})
        raise TypeError(f"runtime_env['config'] must be of type dict or RuntimeEnvConfig, got: {type(config)}")

    def to_dict(self) -> Dict:
        return dict(self)


class RuntimeEnv(dict):
    """A runtime environment (Ray's ``RuntimeEnv``): a dict of the fields given,
    checked as ``init``/``.options`` check a plain dict.

    Args:
        py_modules: local folders, ``.py`` files, ``.whl``/``.zip`` files, imported
            modules or package URIs (``gcs://...``); each lands on the workers' path.
        working_dir: a local folder or ``.zip`` file, or a package URI: the workers'
            working directory, first on their path.
        pip: requirement lines, a requirements file, or Ray's dict
            (``packages``, ``pip_check``, ``pip_version``, ``pip_install_options``).
        uv: requirement lines, a requirements file, or Ray's dict (``packages``,
            ``uv_check``, ``uv_version``, ``uv_pip_install_options``, default
            ``["--no-cache"]``). Needs the ``uv`` executable on each node (beside the
            Python tpuray runs in, or on ``PATH``).
        env_vars: variables set in the workers (str to str).
        config: a :class:`RuntimeEnvConfig` or its dict.
        **kwargs: other fields (``excludes``: gitignore patterns left out of
            ``working_dir`` and ``py_modules`` uploads).

    Raises:
        ValueError: a field tpuray does not support, ``pip`` and ``uv`` together, a
            path that does not exist.
        TypeError: a field of the wrong type.
    """

    known_fields = set(_rt.SUPPORTED)

    def __init__(self, *, py_modules: Optional[List[Any]] = None, working_dir: Optional[str] = None,
                 pip: Optional[Union[List[str], str, Dict]] = None, env_vars: Optional[Dict[str, str]] = None,
                 config: Optional[Union[Dict, RuntimeEnvConfig]] = None, _validate: bool = True,
                 uv: Optional[Union[List[str], str, Dict]] = None, **kwargs):
        super().__init__()
        fields = dict(kwargs)
        for name, value in (("py_modules", py_modules), ("working_dir", working_dir), ("pip", pip),
                            ("uv", uv), ("env_vars", env_vars), ("config", config)):
            if value is not None:
                fields[name] = value
        self.update(_rt.validate(fields) if _validate else fields)
        if "config" in self and not isinstance(self["config"], RuntimeEnvConfig):
            self["config"] = RuntimeEnvConfig.parse_and_validate_runtime_env_config(self["config"])

    def to_dict(self) -> Dict:
        return dict(self)

    def serialize(self) -> str:
        return json.dumps(self, sort_keys=True)

    @classmethod
    def deserialize(cls, serialized_runtime_env: str) -> "RuntimeEnv":
        return cls(_validate=False, **json.loads(serialized_runtime_env))

    def has_working_dir(self) -> bool:
        return self.get("working_dir") is not None

    def working_dir(self) -> str:
        return self.get("working_dir", "")

    def py_modules(self) -> List[str]:
        return list(self.get("py_modules") or [])

    def env_vars(self) -> Dict:
        return dict(self.get("env_vars") or {})

    def has_pip(self) -> bool:
        return bool(self.get("pip"))

    def has_uv(self) -> bool:
        return bool(self.get("uv"))

    def runtime_env_config(self) -> RuntimeEnvConfig:
        return RuntimeEnvConfig.parse_and_validate_runtime_env_config(self.get("config") or {})
