"""``tpuray serve run|deploy|build``: Ray's ``serve run``, ``serve deploy`` and ``serve
build`` with Ray's config file schema (``ServeDeploySchema``,
https://docs.ray.io/en/latest/serve/production-guide/config.html). ``tpuray serve
status`` is the Rust CLI's (it prints the controller's status document).

- ``run TARGET`` deploys ``module:app`` (an ``Application``, or a function taking the
  ``key=value`` arguments that returns one) or a config file, and blocks until Ctrl-C
  (then shuts serve down), unless ``--non-blocking``;
- ``deploy CONFIG`` deploys every application of a config file and returns (the
  applications keep running: serve's actors are detached). It is declarative, as Ray's
  (``ServeController.apply_config``): applications an earlier config deployed that this
  one omits are deleted; those ``serve.run``/``serve run`` deployed stay. http_options
  that differ from the running serve's are kept, with a warning (as Ray's dashboard,
  ``ServeHead.validate_http_options``). With ``--address
  http://HEAD:DASHBOARD_PORT`` it sends the config to the head's Serve REST API
  instead, as Ray's ``serve deploy`` does (a serve instance must run there);
- ``build IMPORT_PATH...`` prints (or writes, ``-o``) the config file that deploys
  them, with each deployment's options.

Config keys honoured: ``http_options`` (``host``, ``port``), ``applications[]``
(``name``, ``route_prefix``, ``import_path``, ``args``, ``deployments[]`` options by
deployment name, ``runtime_env`` only when empty); others are refused by name. Needs
PyYAML.
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys
import time

_APP_KEYS = {"name", "route_prefix", "import_path", "args", "deployments", "runtime_env",
             "logging_config", "external_scaler_enabled"}
_TOP_KEYS = {"http_options", "applications", "proxy_location", "grpc_options", "logging_config",
             "target_capacity"}


def _import_target(path: str, args: dict | None = None):
    from tpuray.serve.deployment import Application, Deployment

    if ":" in path:
        mod, attr = path.split(":", 1)
    elif "." in path:
        mod, attr = path.rsplit(".", 1)
    else:
        raise ValueError(f"import path {path!r} must be 'module:attribute' (or 'module.attribute')")
    if os.getcwd() not in sys.path:
        sys.path.insert(0, os.getcwd())
    obj = importlib.import_module(mod)
    for part in attr.split("."):
        obj = getattr(obj, part)
    if isinstance(obj, Application):
        if args:
            raise ValueError(f"{path!r} is an Application already: it takes no args (got {sorted(args)})")
        return obj
    if isinstance(obj, Deployment):
        raise TypeError(f"{path!r} is a Deployment, not an Application: point at {attr}.bind() instead")
    if callable(obj):
        app = obj(args or {})
        if not isinstance(app, Application):
            raise TypeError(f"the builder {path!r} returned a {type(app).__name__}, not an Application")
        return app
    raise TypeError(f"{path!r} is a {type(obj).__name__}, not an Application or a builder function")


def _walk(app, fn, seen=None):
    from tpuray.serve.deployment import Application

    seen = set() if seen is None else seen
    if id(app) in seen:
        return
    seen.add(id(app))
    fn(app)

    def visit(v):
        if isinstance(v, Application):
            _walk(v, fn, seen)
        elif isinstance(v, (list, tuple)):
            for x in v:
                visit(x)
        elif isinstance(v, dict):
            for x in v.values():
                visit(x)

    visit(app._args)
    visit(app._kwargs)


def _apply_overrides(app, deployments: list) -> None:
    """Applies a config's per-deployment options (by name) to the graph under ``app``.

    Raises:
        ValueError: a deployment the graph does not have.
    """
    by_name = {}
    for d in deployments or []:
        if not isinstance(d, dict) or "name" not in d:
            raise ValueError(f"each entry of 'deployments' needs a 'name' (got {d!r})")
        by_name[d["name"]] = {k: v for k, v in d.items() if k != "name"}
    found = set()

    def fix(a):
        ov = by_name.get(a._deployment.name)
        if ov is not None:
            found.add(a._deployment.name)
            a._deployment = a._deployment.options(**ov)

    _walk(app, fix)
    missing = sorted(set(by_name) - found)
    if missing:
        raise ValueError(f"the config names deployments {missing} that the application does not have")


def load_config(path: str) -> dict:
    import yaml

    with open(path) as f:
        doc = yaml.safe_load(f) or {}
    if not isinstance(doc, dict):
        raise ValueError(f"{path}: expected a mapping with 'applications' at the top")
    bad = sorted(set(doc) - _TOP_KEYS)
    if bad:
        raise ValueError(f"{path}: unknown top-level keys {bad}; expected some of {sorted(_TOP_KEYS)}")
    apps = doc.get("applications")
    if not isinstance(apps, list) or not apps:
        raise ValueError(f"{path}: 'applications' must be a non-empty list")
    for a in apps:
        bad = sorted(set(a) - _APP_KEYS)
        if bad:
            raise ValueError(f"{path}: unknown application keys {bad}; expected some of {sorted(_APP_KEYS)}")
        if "import_path" not in a:
            raise ValueError(f"{path}: application {a.get('name', '?')!r} has no 'import_path'")
        if a.get("runtime_env"):
            raise ValueError(f"{path}: application {a.get('name', '?')!r}: runtime_env in a serve config "
                             "is not supported by tpuray (install the code where the cluster runs)")
    return doc


def deploy_config(doc: dict, declarative: bool = False) -> list:
    """Deploys every application of a parsed config; returns their names.

    ``declarative`` (``serve deploy``): as Ray's ``serve deploy`` (the controller's
    ``apply_config``), the applications an earlier config deployed that this one omits
    are deleted first; those ``serve.run`` deployed stay. Without it (``serve run
    CONFIG``, which Ray runs through ``serve.run``), the applications are deployed
    imperatively and nothing is deleted. http_options that differ from the running
    controller's are kept as they are, with a warning (as Ray).
    """
    import tpuray
    from tpuray import serve
    from tpuray.serve import _common

    serve.start(http_options=doc.get("http_options"))
    ctrl = _common.get_controller(create=False)
    built = []
    for a in doc["applications"]:
        app = _import_target(a["import_path"], a.get("args"))
        _apply_overrides(app, a.get("deployments"))
        built.append((a.get("name", "default"), app, a.get("route_prefix", "/")))
    names = [b[0] for b in built]
    warning = None
    if declarative:
        warning = tpuray.get(ctrl.check_http_options.remote(doc.get("http_options")))
        gone = tpuray.get(ctrl.delete_undeclared.remote(names))
        if gone:
            print(f"deleting applications {gone} (deployed by an earlier config, not in this one)")
    for name, app, prefix in built:
        serve.run(app, name=name, route_prefix=prefix)
    if declarative:
        tpuray.get(ctrl.mark_declared.remote(names, warning))
    return names


def _kv(pairs):
    out = {}
    for p in pairs:
        if "=" not in p:
            raise ValueError(f"argument {p!r} must be key=value")
        k, v = p.split("=", 1)
        out[k] = v
    return out


def _build_doc(paths) -> dict:
    from tpuray.serve import config as _config

    apps = []
    for i, path in enumerate(paths):
        app = _import_target(path)
        deps = []

        def add(a):
            opts = a._deployment._options
            d = {"name": a._deployment.name}
            for k in ("num_replicas", "max_ongoing_requests", "max_queued_requests", "user_config",
                      "autoscaling_config", "ray_actor_options", "health_check_period_s",
                      "health_check_timeout_s", "graceful_shutdown_wait_loop_s",
                      "graceful_shutdown_timeout_s"):
                if opts.get(k) != _config.DEFAULTS.get(k) and opts.get(k) is not None:
                    d[k] = opts[k]
            deps.append(d)

        _walk(app, add)
        apps.append({"name": f"app{i + 1}" if len(paths) > 1 else "default",
                     "route_prefix": "/" if len(paths) == 1 else f"/app{i + 1}",
                     "import_path": path, "runtime_env": {}, "deployments": deps})
    return {"proxy_location": "EveryNode", "http_options": {"host": "0.0.0.0", "port": 8000},
            "applications": apps}


def _deploy_rest(url: str, doc: dict) -> int:
    """PUTs a config to the head's Serve REST API (``PUT /api/serve/applications/``)
    with the cluster token (``TPURAY_AUTH_TOKEN`` or ``~/.tpuray/auth_token``)."""
    import json
    import urllib.error
    import urllib.request

    token = os.environ.get("TPURAY_AUTH_TOKEN")
    path = os.path.expanduser("~/.tpuray/auth_token")
    if not token and os.path.exists(path):
        with open(path) as f:
            token = f.read().strip()
    req = urllib.request.Request(url.rstrip("/") + "/api/serve/applications/", method="PUT",
                                 data=json.dumps(doc).encode(),
                                 headers={"Content-Type": "application/json",
                                          **({"Authorization": f"Bearer {token}"} if token else {})})
    context = None
    if url.startswith("https://"):
        # A TLS cluster's head (mutual TLS, TLS-2): the CA and this process's certificate.
        import ssl
        cert, key, ca = (os.environ.get(v) for v in
                         ("TPURAY_TLS_CERT", "TPURAY_TLS_KEY", "TPURAY_TLS_CA"))
        if not (cert and key and ca):
            print(f"tpuray serve deploy: {url} is a TLS cluster's: set TPURAY_TLS_CERT, "
                  "TPURAY_TLS_KEY and TPURAY_TLS_CA", file=sys.stderr)
            return 1
        context = ssl.create_default_context(cafile=ca)
        context.load_cert_chain(cert, key)
    try:
        with urllib.request.urlopen(req, timeout=60, context=context):
            pass
    except urllib.error.HTTPError as e:
        print(f"tpuray serve deploy: {url} answered {e.code}: {e.read().decode(errors='replace')}",
              file=sys.stderr)
        return 1
    print("sent the deploy request; `tpuray serve status` shows the applications")
    return 0


def main(argv: list) -> int:
    """``argv``: the words after ``tpuray serve``. Returns the exit code."""
    ap = argparse.ArgumentParser(
        prog="tpuray serve", description="Ray Serve's run/deploy/build on tpuray (`tpuray serve "
        "status` is the Rust CLI's: `tpuray serve status --help`).")
    sub = ap.add_subparsers(dest="cmd", required=True)
    addr_help = ("the cluster to use, HOST:PORT of its head (default: TPURAY_ADDRESS, then the "
                 "cluster `tpuray start` started on this machine)")
    r = sub.add_parser(
        "run", help="deploy module:app or a config file, block until Ctrl-C",
        description="Deploys an application (as Ray's `serve run`) and blocks until Ctrl-C, "
        "which shuts serve down; --non-blocking returns once it runs.")
    r.add_argument("target", help="module:attribute (an Application from .bind(), or a function "
                   "taking a dict of the key=value arguments that returns one), or a .yaml config "
                   "file (Ray's ServeDeploySchema)")
    r.add_argument("args", nargs="*", help="key=value arguments for a builder function")
    r.add_argument("--address", default=None, help=addr_help)
    r.add_argument("--route-prefix", default="/", help="the HTTP path prefix (default: /)")
    r.add_argument("--name", default="default", help="the application's name (default: default)")
    r.add_argument("--non-blocking", action="store_true", help="return once the application runs")
    d = sub.add_parser(
        "deploy", help="deploy a config file's applications and return",
        description="Deploys a config file's applications (Ray's ServeDeploySchema) and returns. "
        "As Ray's `serve deploy` it is declarative: applications an earlier config deployed "
        "that this one omits are deleted (those serve.run deployed stay).")
    d.add_argument("config", help="the .yaml config file (e.g. from `tpuray serve build`)")
    d.add_argument("--address", default=None,
                   help=addr_help + "; or http://HEAD:DASHBOARD_PORT to send the config to the "
                   "head's Serve REST API, as Ray's `serve deploy -a`")
    b = sub.add_parser(
        "build", help="print the config file for import paths",
        description="Prints (or writes) the config file (Ray's ServeDeploySchema) that deploys "
        "the applications at these import paths, with each deployment's options.")
    b.add_argument("import_paths", nargs="+", help="module:attribute of each application")
    b.add_argument("-o", "--output-path", default=None, help="write the config here, not to stdout")
    a = ap.parse_args(argv)
    import tpuray
    from tpuray import serve

    try:
        if a.cmd == "build":
            import yaml

            text = yaml.safe_dump(_build_doc(a.import_paths), sort_keys=False)
            if a.output_path:
                with open(a.output_path, "w") as f:
                    f.write(text)
            else:
                sys.stdout.write(text)
            return 0
        if a.cmd == "deploy" and (a.address or "").startswith(("http://", "https://")):
            # As Ray's `serve deploy -a http://HEAD:8265`: through the head's REST API.
            return _deploy_rest(a.address, load_config(a.config))
        tpuray.init(address=a.address or os.environ.get("TPURAY_ADDRESS") or "auto")
        if a.cmd == "deploy":
            names = deploy_config(load_config(a.config), declarative=True)
            print(f"deployed applications {names}")
            return 0
        if a.target.endswith((".yaml", ".yml")):
            names = deploy_config(load_config(a.target))
        else:
            app = _import_target(a.target, _kv(a.args) or None)
            serve.run(app, name=a.name, route_prefix=a.route_prefix)
            names = [a.name]
        print(f"running applications {names}", flush=True)
        if a.non_blocking:
            return 0
        try:
            while True:
                time.sleep(1)
        except KeyboardInterrupt:
            serve.shutdown()
        return 0
    except (ValueError, TypeError, ImportError, AttributeError, OSError) as e:
        print(f"tpuray serve {a.cmd}: {e}", file=sys.stderr)
        return 1
