"""Runtime environments (Ray's ``runtime_env``), checked and uploaded by the submitting
process: ``working_dir``, ``py_modules``, ``pip``, ``uv``, ``env_vars``, ``excludes``
and ``config``, for a whole job (``init``) and per task or actor alike.

The submitting process packs a local ``working_dir`` or ``py_modules`` folder as Ray's
client does (the Rust packer, ``tpuray._tpuray.package_local``: ``excludes`` are gitignore
patterns, Ray's default excludes ``.git``, ``.venv``, ``venv``, ``__pycache__`` left out of
a working_dir, a content-hash URI ``gcs://_ray_pkg_<hash>.zip``), stores it in the head's
KV in chunks (namespace ``packages``, the layout of ``tpuray_proto::packages``, the one
the Jobs API uses) unless it is there already, and replaces the path with the URI. A
task's or actor's environment is merged over the job's as Ray merges them
(``ray/runtime_env/runtime_env.py``, ``_merge_runtime_env(job, task, override=True)``:
the task's fields replace the job's, ``env_vars`` merged per variable), stored as JSON
under its hash (namespace ``runtime_env``) and passed with the task; node agents build
it (packages unpacked, a pip or uv venv, cached per node) and start the workers in it
(AGENT-13..15). A failed build fails the task with ``RuntimeEnvSetupError``.

The environment's hash is part of the worker pool key (AGENT-3), so workers of different
environments are never shared.
"""

from __future__ import annotations

import copy
import hashlib
import json
import logging
import os
import warnings
from pathlib import Path
from types import ModuleType

from tpuray import _tpuray

logger = logging.getLogger(__name__)

RUNTIME_ENV_NAMESPACE = "runtime_env"
#: The KV namespace of uploaded packages (``tpuray_proto::packages``).
PACKAGES_NAMESPACE = "packages"
#: Bytes per KV value of a package (``tpuray_proto::packages::CHUNK_BYTES``).
CHUNK_BYTES = 8 * 1024 * 1024
SUPPORTED = ("working_dir", "py_modules", "pip", "uv", "env_vars", "excludes", "config")
#: Fields Ray's clients add as bookkeeping (no effect).
_BOOKKEEPING = ("_ray_commit",)
_URI_PROTOCOLS = ("gcs", "conda", "pip", "uv", "http", "https", "s3", "gs", "azure", "abfss", "file", "local")

#: (field, absolute path, excludes) -> URI, for packages this process uploaded.
_uploaded: dict = {}


def _is_uri(s: str) -> bool:
    scheme, sep, _ = s.partition("://")
    return bool(sep) and scheme.lower() in _URI_PROTOCOLS


def _requirements(v, what: str) -> list:
    """A list of requirement lines, from a list or a requirements file (Ray's client reads
    the file into its lines)."""
    if isinstance(v, (str, Path)):
        if not os.path.isfile(v):
            raise ValueError(f"{what} {str(v)!r} is not a requirements file")
        with open(v) as f:
            return [ln.strip() for ln in f if ln.strip() and not ln.lstrip().startswith("#")]
    if isinstance(v, (list, tuple)) and all(isinstance(x, str) for x in v):
        return list(v)
    raise TypeError(f"{what} must be a list of requirements or a requirements file (got {v!r})")


def _pip(pip):
    """Ray's ``pip`` forms: a list of requirements, a requirements file, or a dict with
    ``packages`` (which may itself be a file), ``pip_check``, ``pip_version``,
    ``pip_install_options``."""
    if isinstance(pip, dict):
        unknown = set(pip) - {"packages", "pip_check", "pip_version", "pip_install_options"}
        if unknown:
            raise ValueError(
                "runtime_env['pip'] can only have these fields: packages, pip_check, pip_version "
                f"and pip_install_options, but got: {sorted(unknown)}"
            )
        if "packages" not in pip:
            raise ValueError(f"runtime_env['pip'] must include field 'packages', but got {pip}")
        out = dict(pip)
        out["packages"] = _requirements(pip["packages"], "runtime_env['pip']['packages']")
        if not isinstance(out.get("pip_check", False), bool):
            raise TypeError("runtime_env['pip']['pip_check'] must be of type bool")
        return out
    return _requirements(pip, "runtime_env['pip']")


def _uv(uv):
    """Ray's ``uv`` forms (``parse_and_validate_uv``): a list of requirements, a
    requirements file, or a dict with ``packages``, ``uv_check``, ``uv_version``,
    ``uv_pip_install_options``."""
    if not isinstance(uv, dict):
        return {"packages": _requirements(uv, "runtime_env['uv']"), "uv_check": False}
    unknown = set(uv) - {"packages", "uv_check", "uv_version", "uv_pip_install_options"}
    if unknown:
        raise ValueError(
            "runtime_env['uv'] can only have these fields: packages, uv_check, uv_version and "
            f"uv_pip_install_options, but got: {sorted(unknown)}"
        )
    if "packages" not in uv:
        raise ValueError(f"runtime_env['uv'] must include field 'packages', but got {uv}")
    if "uv_check" in uv and not isinstance(uv["uv_check"], bool):
        raise TypeError(f"runtime_env['uv']['uv_check'] must be of type bool, got {type(uv['uv_check'])}")
    if "uv_version" in uv and not isinstance(uv["uv_version"], str):
        raise TypeError(f"runtime_env['uv']['uv_version'] must be of type str, got {type(uv['uv_version'])}")
    opts = uv.get("uv_pip_install_options")
    if opts is not None and not (isinstance(opts, list) and all(isinstance(o, str) for o in opts)):
        raise TypeError(f"runtime_env['uv']['uv_pip_install_options'] must be of type list[str], got {opts!r}")
    out = dict(uv)
    out["packages"] = _requirements(uv["packages"], "runtime_env['uv']['packages']")
    out["uv_check"] = uv.get("uv_check", False)
    return out


def _module_path(m) -> str:
    """A ``py_modules`` entry as a path or URI (Ray accepts imported modules too)."""
    if isinstance(m, Path):
        return str(m)
    if isinstance(m, ModuleType):
        if not hasattr(m, "__path__"):
            # A single-file module; a built-in or in-memory one has no file to ship.
            file = getattr(m, "__file__", None)
            if file is None:
                raise ValueError(
                    f"py_modules: module {m.__name__!r} has no file (a built-in or in-memory "
                    "module cannot be shipped); give its path instead"
                )
            return file
        paths = list(m.__path__)
        if len(paths) > 1:
            raise ValueError(
                "py_modules only supports modules whose __path__ has length 1 or those who are single-file."
            )
        return paths[0]
    if isinstance(m, str):
        return m
    raise TypeError(f"py_modules must be a list of file paths, URIs, or imported modules, got {type(m)}.")


def _config(c) -> dict:
    from tpuray.runtime_env import RuntimeEnvConfig

    return dict(RuntimeEnvConfig.parse_and_validate_runtime_env_config(c))


def validate(env, job: bool = False) -> dict:
    """Checks a runtime_env (a dict or ``tpuray.runtime_env.RuntimeEnv``; ``job``: a
    whole job's, from ``init``, which allows the same fields); returns a plain copy with
    requirements files read into their lines and ``py_modules`` modules as paths.

    Raises:
        TypeError: not a dict; a field of the wrong type (``env_vars`` not a dict of
            strings, ``pip``/``uv`` not a list, file or dict, ``excludes`` not a list).
        ValueError: a field tpuray does not support (naming the supported ones), ``pip``
            and ``uv`` together (Ray's rule), a ``working_dir`` that is neither a folder,
            a .zip file nor a URI.
    """
    del job  # the same fields are allowed for a job and per task (Ray's rules)
    if env is None:
        return {}
    if not isinstance(env, dict):
        raise TypeError(f"runtime_env must be a dict (got {type(env).__name__})")
    for k in env:
        if not isinstance(k, str):
            raise TypeError(f"runtime_env keys must be strings, got {type(k)}")
        if k not in SUPPORTED and k not in _BOOKKEEPING:
            raise ValueError(
                f"runtime_env field {k!r} is not supported by tpuray (supported: {', '.join(SUPPORTED)})"
            )
    env = {k: copy.deepcopy(v) for k, v in env.items() if v is not None and k not in _BOOKKEEPING}
    if "pip" in env and "uv" in env:
        raise ValueError(
            "The 'pip' field, 'uv' field, and 'conda' field of runtime_env cannot be specified at the same time.\n"
            f"specified pip field: {env['pip']}\nspecified uv field: {env['uv']}"
        )
    if "pip" in env:
        env["pip"] = _pip(env["pip"])
    if "uv" in env:
        env["uv"] = _uv(env["uv"])
    ev = env.get("env_vars")
    if ev is not None:
        if not isinstance(ev, dict) or not all(isinstance(k, str) and isinstance(v, str) for k, v in ev.items()):
            raise TypeError("runtime_env['env_vars'] must be a dict of str to str")
    ex = env.get("excludes")
    if ex is not None and not (isinstance(ex, list) and all(isinstance(p, str) for p in ex)):
        raise TypeError(f"runtime_env['excludes'] must be a list of gitignore patterns (str), got {ex!r}")
    wd = env.get("working_dir")
    if wd is not None:
        wd = str(wd)
        if not _is_uri(wd) and not os.path.isdir(wd) and not (os.path.isfile(wd) and wd.endswith(".zip")):
            raise ValueError(f"runtime_env['working_dir'] {wd!r} is not a folder, a .zip file or a URI")
        env["working_dir"] = wd
    mods = env.get("py_modules")
    if mods is not None:
        if not isinstance(mods, (list, tuple)):
            raise TypeError(f"runtime_env['py_modules'] must be a list of paths, URIs or modules, got {mods!r}")
        env["py_modules"] = [_module_path(m) for m in mods]
        for m in env["py_modules"]:
            if not _is_uri(m) and not os.path.exists(m):
                raise ValueError(f"runtime_env['py_modules'] entry {m!r} is neither an existing path nor a URI")
    if "config" in env:
        env["config"] = _config(env["config"])
    return env


def _put_package(uri: str, data: bytes) -> None:
    """Stores ``data`` under ``uri`` in the KV (``tpuray_proto::packages``' layout: chunks
    ``<uri>/<i>``, then ``<uri>/meta``), unless it is stored already."""
    if _tpuray.kv_get(PACKAGES_NAMESPACE, f"{uri}/meta".encode()) is not None:
        logger.info("Package %s already exists, skipping upload.", uri)
        return
    logger.info("Pushing file package '%s' (%.2fMiB) to the cluster...", uri, len(data) / 2**20)
    chunks = [data[i:i + CHUNK_BYTES] for i in range(0, len(data), CHUNK_BYTES)] or [b""]
    for i, c in enumerate(chunks):
        _tpuray.kv_put(PACKAGES_NAMESPACE, f"{uri}/{i}".encode(), c, True)
    meta = {"size": len(data), "chunks": len(chunks), "sha256": hashlib.sha256(data).hexdigest()}
    _tpuray.kv_put(PACKAGES_NAMESPACE, f"{uri}/meta".encode(), json.dumps(meta).encode(), True)


def package_size(uri: str):
    """The size in bytes of uploaded package ``uri`` (``None`` when it is not stored)."""
    meta = _tpuray.kv_get(PACKAGES_NAMESPACE, f"{uri}/meta".encode())
    return None if meta is None else json.loads(meta)["size"]


def _upload_path(field: str, path: str, excludes: list) -> str:
    if _is_uri(path):
        return path
    full = os.path.abspath(path)
    key = (field, full, tuple(excludes))
    uri = _uploaded.get(key)
    if uri is None:
        got = _tpuray.package_local(field, full, list(excludes), os.getcwd())
        if got is None:
            return path
        uri, data = got
        _put_package(uri, data)
        _uploaded[key] = uri
    return uri


def upload(env: dict) -> dict:
    """``env`` (validated) with a local ``working_dir`` and local ``py_modules`` replaced
    by the URIs of their uploaded packages (``excludes`` applied; once per process per
    path)."""
    env = dict(env)
    excludes = list(env.get("excludes") or [])
    if env.get("working_dir"):
        env["working_dir"] = _upload_path("working_dir", env["working_dir"], excludes)
    if env.get("py_modules"):
        env["py_modules"] = [_upload_path("py_modules", m, excludes) for m in env["py_modules"]]
    return env


def needs_build(env: dict) -> bool:
    """Whether a node must build something for ``env`` (a package, a venv)."""
    return any(env.get(k) for k in ("working_dir", "py_modules", "pip", "uv"))


def merge(job: dict, task: dict) -> dict:
    """Ray's ``_merge_runtime_env(job, task, override=True)``: the task's fields replace
    the job's, ``env_vars`` merged key by key (the task's win)."""
    out = copy.deepcopy(job)
    job_vars = out.pop("env_vars", None) or {}
    task = copy.deepcopy(task)
    task_vars = task.pop("env_vars", None) or {}
    out.update(task)
    merged = {**job_vars, **task_vars}
    if merged:
        out["env_vars"] = merged
    return out


def register(env: dict) -> str:
    """Stores an uploaded environment under its hash; returns the hash ("" for none)."""
    if not env:
        return ""
    body = json.dumps(env, sort_keys=True).encode()
    key = hashlib.sha256(body).hexdigest()
    _tpuray.kv_put(RUNTIME_ENV_NAMESPACE, key.encode(), body, False)
    return key


def eager_install(env: dict) -> bool:
    """``config.eager_install`` (Ray's default: True)."""
    return bool((env.get("config") or {}).get("eager_install", True))


def warn_unknown_config(unknown) -> None:
    warnings.warn(
        f"The following unknown entries in the runtime_env_config dictionary will be ignored: {set(unknown)}.",
        stacklevel=3,
    )
