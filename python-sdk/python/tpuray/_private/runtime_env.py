"""Runtime environments (Ray's ``runtime_env``): ``env_vars``, ``working_dir`` and, for a
whole job, ``pip``.

The submitting process uploads a local ``working_dir`` to the head's KV (a zip,
content-addressed), stores the environment as JSON under its hash, and passes the hash
with the task; node agents start workers with its ``env_vars`` set, pool them per
environment, and the worker unpacks the ``working_dir`` into its session folder before
the first task and runs there (nothing is read from a shared disk). A job's ``pip``
(given to ``init`` or to the Jobs API) is built by each node agent into a cached venv
that the job's workers run in (AGENT-13); per task or actor it is refused.
"""

from __future__ import annotations

import hashlib
import io
import json
import os
import shutil
import sys
import tempfile
import zipfile

from tpuray import _tpuray

RUNTIME_ENV_NAMESPACE = "runtime_env"
PACKAGE_NAMESPACE = "pkg"
SUPPORTED = ("env_vars", "working_dir", "config")
#: Fields a whole job's environment (``init(runtime_env=...)``) may have besides.
JOB_ONLY = ("pip",)
_EXCLUDE = {"__pycache__", ".git", ".venv", "node_modules"}
#: Largest working_dir accepted (Ray's limit is 100 MiB as well).
MAX_WORKING_DIR_BYTES = 100 * 1024 * 1024

_uploaded: dict[str, str] = {}


def validate(env, job: bool = False) -> dict:
    """Checks a runtime_env dict (``job``: a whole job's, from ``init``); returns a copy,
    with a ``pip`` requirements file read into its lines (as Ray's client does).

    Raises:
        TypeError: not a dict, or ``env_vars`` not a dict of strings, or ``pip`` not a
            list, a requirements file or Ray's dict form.
        ValueError: a field tpuray does not support (naming the supported ones), ``pip``
            per task or actor, or a ``working_dir`` that is not a folder.
    """
    if env is None:
        return {}
    if not isinstance(env, dict):
        raise TypeError(f"runtime_env must be a dict (got {type(env).__name__})")
    allowed = SUPPORTED + (JOB_ONLY if job else ())
    for k in env:
        if k in JOB_ONLY and not job:
            raise ValueError(
                f"runtime_env field {k!r} is supported for a whole job only (tpuray.init(runtime_env=...) "
                "or the Jobs API), not per task or actor"
            )
        if k not in allowed:
            raise ValueError(
                f"runtime_env field {k!r} is not supported by tpuray (supported: {', '.join(allowed)})"
            )
    env = dict(env)
    if "pip" in env:
        env["pip"] = _pip(env["pip"])
    ev = env.get("env_vars")
    if ev is not None:
        if not isinstance(ev, dict) or not all(isinstance(k, str) and isinstance(v, str) for k, v in ev.items()):
            raise TypeError("runtime_env['env_vars'] must be a dict of str to str")
    wd = env.get("working_dir")
    if wd is not None and not str(wd).startswith("pkg://") and not os.path.isdir(wd):
        raise ValueError(f"runtime_env['working_dir'] {wd!r} is not a folder")
    return env


def _pip(pip):
    """Ray's ``pip`` forms: a list of requirements, a requirements file, or a dict with
    ``packages`` (which may itself be a file)."""
    def lines(v, what):
        if isinstance(v, str):
            if not os.path.isfile(v):
                raise ValueError(f"{what} {v!r} is not a requirements file")
            with open(v) as f:
                return [ln.strip() for ln in f if ln.strip() and not ln.lstrip().startswith("#")]
        if isinstance(v, (list, tuple)) and all(isinstance(x, str) for x in v):
            return list(v)
        raise TypeError(f"{what} must be a list of requirements or a requirements file (got {v!r})")

    if isinstance(pip, dict):
        out = dict(pip)
        out["packages"] = lines(pip.get("packages", []), "runtime_env['pip']['packages']")
        return out
    return lines(pip, "runtime_env['pip']")


def _zip_dir(path: str) -> bytes:
    buf = io.BytesIO()
    total = 0
    with zipfile.ZipFile(buf, "w", zipfile.ZIP_DEFLATED) as z:
        for root, dirs, files in os.walk(path):
            dirs[:] = sorted(d for d in dirs if d not in _EXCLUDE)
            for f in sorted(files):
                full = os.path.join(root, f)
                total += os.path.getsize(full)
                if total > MAX_WORKING_DIR_BYTES:
                    raise ValueError(
                        f"working_dir {path!r} is larger than {MAX_WORKING_DIR_BYTES} bytes"
                    )
                info = zipfile.ZipInfo(os.path.relpath(full, path))
                info.external_attr = (os.stat(full).st_mode & 0xFFFF) << 16
                with open(full, "rb") as fh:
                    z.writestr(info, fh.read())
    return buf.getvalue()


def upload(env: dict) -> dict:
    """``env`` with a local ``working_dir`` replaced by ``pkg://<sha256>`` after uploading
    it (once per process per folder)."""
    env = dict(env)
    wd = env.get("working_dir")
    if wd and not str(wd).startswith("pkg://"):
        path = os.path.abspath(wd)
        key = _uploaded.get(path)
        if key is None:
            data = _zip_dir(path)
            key = hashlib.sha256(data).hexdigest()
            _tpuray.kv_put(PACKAGE_NAMESPACE, key.encode(), data, False)
            _uploaded[path] = key
        env["working_dir"] = f"pkg://{key}"
    return env


def merge(job: dict, task: dict) -> dict:
    """Task fields over the job's; ``env_vars`` merged key by key (as Ray does)."""
    out = dict(job)
    for k, v in task.items():
        if k == "env_vars":
            out["env_vars"] = {**job.get("env_vars", {}), **v}
        else:
            out[k] = v
    return out


def register(env: dict) -> str:
    """Stores an uploaded environment under its hash; returns the hash ("" for none)."""
    if not env:
        return ""
    body = json.dumps(env, sort_keys=True).encode()
    key = hashlib.sha256(body).hexdigest()
    _tpuray.kv_put(RUNTIME_ENV_NAMESPACE, key.encode(), body, False)
    return key


_applied = False


def apply_in_worker() -> None:
    """In a worker, before its first task: unpack the job's and the task's working_dir
    (the task's wins) and run from there."""
    global _applied
    if _applied:
        return
    _applied = True
    for var in ("TPURAY_JOB_RUNTIME_ENV", "TPURAY_RUNTIME_ENV"):
        raw = os.environ.get(var)
        if not raw:
            continue
        env = json.loads(raw)
        wd = env.get("working_dir")
        if wd and wd.startswith("pkg://"):
            _enter(wd[len("pkg://"):])


def _enter(key: str) -> None:
    base = os.path.join(os.environ.get("TPURAY_SESSION_DIR") or tempfile.gettempdir(), "runtime_resources")
    target = os.path.join(base, key)
    if not os.path.isdir(target):
        data = _tpuray.kv_get(PACKAGE_NAMESPACE, key.encode())
        if data is None:
            raise RuntimeError(f"working_dir package {key} is not in the cluster's KV")
        os.makedirs(base, exist_ok=True)
        tmp = tempfile.mkdtemp(dir=base, prefix=".unpack-")
        with zipfile.ZipFile(io.BytesIO(data)) as z:
            z.extractall(tmp)
        try:
            os.rename(tmp, target)
        except OSError:
            shutil.rmtree(tmp, ignore_errors=True)  # another worker got there first
    os.chdir(target)
    if target not in sys.path:
        sys.path.insert(0, target)
