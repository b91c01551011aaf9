"""The serve controller: one detached named actor that owns every application.

It is a threaded actor (``max_concurrency`` 256): calls from drivers, handles and the
proxy run on executor threads under one lock, and a control-loop thread reconciles
every ~0.1 s:

- starts replicas until each deployment has its target number (STARTING until the
  replica's ``initialize`` returns; a constructor that raises three times in a row
  fails the deployment with its error, DEPLOY_FAILED);
- health-checks each RUNNING replica every ``health_check_period_s`` by calling its
  ``check_health`` (which checks that replica only) and replaces it when the call
  raises, or takes longer than ``health_check_timeout_s``, or its actor is dead
  (handles that see a replica die report it, so that is checked at once);
- autoscales: the target follows Ray's queue-length policy on the sum of the ongoing
  requests that handles report, after ``upscale_delay_s``/``downscale_delay_s``
  (from zero replicas, at once);
- stops replicas gracefully (out of routing first, then ``prepare_for_shutdown``,
  then killed) when scaling down, redeploying or deleting;
- keeps the HTTP proxy actor alive while an application has a route prefix;
- writes its status document (JSON) to the head's KV, namespace ``serve``, key
  ``status``, on every change and every 2 s (``tpuray serve status`` prints it).

Handles and the proxy long-poll ``listen_for_replicas``/``listen_for_routes``.
SERVE-1: a replica's health is its own: nothing here looks at a replica's downstream
deployments when judging it.
SERVE-2: the controller checkpoints its applications, deployments and replica names to
the KV (key ``checkpoint``) whenever they change; it is restarted when its process dies
(``max_restarts=-1``) and a new incarnation adopts the live RUNNING replicas and the
proxy, so a controller crash does not interrupt serving.

The controller takes 0 CPUs. A replica left unplaced for 30 s is reported with the
resources it needs. SERVE-1 is checked by
``test_a_dead_downstream_replica_never_gets_a_healthy_upstream_replaced``. SERVE-2 in
detail: the checkpoint holds the pickled class and init arguments, config and target of
each deployment; a restarted incarnation (``_restore``) adopts the live RUNNING replicas
by name and the proxy, replaces the rest, and starts its version numbers at a random
base so no router mistakes an old version for a new one (test
``test_a_killed_controller_restarts_and_adopts_the_running_replicas``).

In-place updates: a deployment whose pickled class and arguments are unchanged keeps its
replicas when only ``user_config`` changes; the controller calls each replica's
``reconfigure`` and reports the deployment UPDATING until every call returned (a failing
one replaces that replica).

Per-replica placement groups (``placement_group_bundles``/``_strategy``): the replica
runs in bundle 0 and sees the group as its current one; bundles that name a slice's
``TPU-<type>-head`` are reserved as a slice group (SCHED-15: the hosts of one intact
slice or nothing), so each replica's gang is one slice and a further replica waits for
another (test
``test_a_replica_gets_a_whole_slice_as_a_gang_and_the_next_waits_for_another``). The
group is removed with its replica.

SERVE-API-1: the head's Serve REST API (``head/src/serve_api.rs``) stores a declaration
in the KV (key ``declared``) that this controller polls and applies as ``tpuray serve
deploy`` would.
"""

from __future__ import annotations

import hashlib
import json
import os
import random
import re
import sys
import threading
import time
import traceback
import uuid
from typing import Any

import tpuray
from tpuray import _tpuray
from tpuray.serve import _common
from tpuray.serve._common import RUNNING, STARTING, STOPPING, UNHEALTHY
from tpuray.serve import config as _config

_TICK_S = 0.1
_STATUS_REFRESH_S = 2.0
_MAX_CONSTRUCTOR_FAILURES = 3
_SLOW_START_S = 30.0
_METRIC_STALE_S = 5.0
_LISTEN_S = 10.0
_DECLARED_POLL_S = 0.5


class _Replica:
    def __init__(self, rid, actor):
        self.rid = rid
        self.actor = actor
        self.state = STARTING
        self.created = time.monotonic()
        self.init_ref = actor.initialize.remote()
        self.info: dict = {}
        self.health_ref = None
        self.health_sent = 0.0
        self.next_check = 0.0
        self.stop_ref = None
        self.stop_deadline = 0.0
        self.suspect = False
        self.ongoing = 0
        self.reconf_ref = None
        self.models: list = []
        self.started_at = time.time()

    @classmethod
    def adopt(cls, rid, actor, info):
        """A RUNNING replica that a previous incarnation of the controller started."""
        r = cls.__new__(cls)
        r.rid, r.actor, r.state, r.created = rid, actor, RUNNING, time.monotonic()
        r.init_ref = r.health_ref = r.stop_ref = None
        r.info = dict(info or {})
        r.health_sent = r.next_check = r.stop_deadline = 0.0
        r.suspect = False
        r.ongoing = 0
        r.reconf_ref = None
        r.models = []
        r.started_at = time.time()
        return r


class _Deployment:
    def __init__(self, app, name, target_bytes, init_bytes, cfg, code_hash):
        self.app = app
        self.name = name
        self.target_bytes = target_bytes
        self.init_bytes = init_bytes
        self.cfg = cfg
        self.code_hash = code_hash
        self.replicas: dict = {}
        self.target = _config.initial_target(cfg)
        self.failures = 0
        self.failed = False
        self.deleting = False
        self.message = ""
        self.trigger = "CONFIG_UPDATE_STARTED"
        self.scaling = None  # "UPSCALING" | "DOWNSCALING" while a decision is carried out
        self.wish = None  # (direction, since) of a pending autoscaling decision
        self.ever_healthy = False
        self.unhealthy = False
        self.total_ongoing = 0.0


class ServeController:
    """See the module doc. Created by ``serve.run``/``serve.start`` with
    ``http_options`` ``{"host": "127.0.0.1", "port": 8000}`` (port 0: any free port)."""

    def __init__(self, http_options: dict):
        self._cv = threading.Condition(threading.RLock())
        self._apps: dict = {}
        self._deps: dict = {}
        self._versions: dict = {}
        # Versions start at a random base, so a router holding a version from a previous
        # incarnation of the controller never mistakes it for the current one.
        self._base = random.randrange(1 << 40) * 1000
        self._routes_version = self._base + 1
        self._metrics: dict = {}
        host = http_options.get("host") or "127.0.0.1"
        port = http_options.get("port", 8000)
        self._http = {"host": str(host), "port": int(port)}
        self._proxy: Any = None  # the proxy's ActorHandle
        self._proxy_ref: Any = None  # its pending ready/check_health call
        self._proxy_state: str | None = None
        self._proxy_info: dict = {}
        self._proxy_error = ""
        self._proxy_retry_at = 0.0
        self._proxy_next_check = 0.0
        self._shutting_down = False
        self._stopped = False
        self._last_doc = None
        self._last_write = 0.0
        self._node_id = tpuray.get_runtime_context().get_node_id()
        self._last_checkpoint = None
        self._declared_seq = None
        self._declared_error: str | None = None
        self._declared_failed: dict = {}  # app name -> the error of its last declaration
        # Ray's api_type DECLARATIVE: the applications the last config (``serve deploy``,
        # REST PUT) deployed; only these are deleted when a later config omits them.
        self._declared_apps: set = set()
        self._declared_warning: str | None = None
        with self._cv:
            self._restore()
        try:
            # SERVE-API-1: declarations older than this controller were applied (or not)
            # by its predecessor; only newer ones are applied here.
            raw = _tpuray.kv_get(_common.SERVE_NAMESPACE, _common.DECLARED_KEY)
            self._declared_seq = json.loads(raw)["seq"] if raw else None
        except Exception:  # noqa: BLE001 - a bad document: the next one is applied
            pass
        threading.Thread(target=self._run, daemon=True, name="serve-controller").start()
        threading.Thread(target=self._watch_declared, daemon=True, name="serve-declared").start()

    # ---- checkpoint (SERVE-2: a restarted controller adopts what its predecessor ran) ----

    def _checkpoint_state(self) -> dict:
        deps = {}
        for key, d in self._deps.items():
            deps[key] = {
                "target_bytes": d.target_bytes, "init_bytes": d.init_bytes, "cfg": d.cfg,
                "code_hash": d.code_hash, "target": d.target, "failed": d.failed,
                "message": d.message, "deleting": d.deleting,
                "replicas": [(r.rid, r.state, _replica_name(d, r.rid), r.info)
                             for r in d.replicas.values()],
            }
        return {"apps": self._apps, "deps": deps, "http": self._http,
                "proxy": self._proxy is not None, "declared": sorted(self._declared_apps)}

    def _checkpoint_signature(self):
        return (
            tuple(sorted((n, a["deleting"], a["last_deployed_time_s"]) for n, a in self._apps.items())),
            tuple(sorted(
                (k, d.code_hash, d.target, d.failed, d.deleting,
                 tuple(sorted((r.rid, r.state) for r in d.replicas.values())))
                for k, d in self._deps.items()
            )),
            self._proxy is not None,
            tuple(sorted(self._declared_apps)),
        )

    def _maybe_checkpoint(self) -> None:
        """Writes the applications, deployments and replica names to the head's KV
        (namespace ``serve``, key ``checkpoint``) when they changed (lock held)."""
        sig = self._checkpoint_signature()
        if sig == self._last_checkpoint:
            return
        from tpuray._private.serialization import serialize

        try:
            _tpuray.kv_put(_common.SERVE_NAMESPACE, _common.CHECKPOINT_KEY,
                           serialize(self._checkpoint_state())[0], True)
            self._last_checkpoint = sig
        except Exception as e:  # noqa: BLE001 - retried on the next tick
            print(f"serve controller: could not write the checkpoint: {e}", file=sys.stderr)

    def _restore(self) -> None:
        """Adopts the applications of a previous controller (after this actor restarted,
        or a new one replaced a dead one): RUNNING replicas that are still alive are
        kept (and health-checked at once), others are replaced; the proxy is kept."""
        from tpuray._private.serialization import deserialize

        try:
            raw = _tpuray.kv_get(_common.SERVE_NAMESPACE, _common.CHECKPOINT_KEY)
            ck = deserialize(raw) if raw else None
        except Exception as e:  # noqa: BLE001 - start empty rather than not at all
            print(f"serve controller: could not read the checkpoint: {e}", file=sys.stderr)
            return
        if not ck or not ck.get("apps"):
            return
        self._http = ck.get("http") or self._http
        self._declared_apps = set(ck.get("declared") or ())
        for name, a in ck["apps"].items():
            self._apps[name] = dict(a)
        for key, dd in ck["deps"].items():
            d = _Deployment(key[0], key[1], dd["target_bytes"], dd["init_bytes"], dd["cfg"], dd["code_hash"])
            d.target, d.failed, d.message, d.deleting = dd["target"], dd["failed"], dd["message"], dd["deleting"]
            d.ever_healthy = True
            for rid, state, actor_name, info in dd["replicas"]:
                try:
                    actor = tpuray.get_actor(actor_name, namespace=_common.SERVE_NAMESPACE)
                except ValueError:
                    continue
                pg = _find_pg(actor_name) if d.cfg.get("placement_group_bundles") else None
                if state == RUNNING and not d.deleting:
                    d.replicas[rid] = _Replica.adopt(rid, actor, info)
                    d.replicas[rid].pg = pg  # removed with the replica, as before the restart
                else:
                    self._kill_actor(actor)
                    _remove_pg(pg)
            self._deps[key] = d
            self._bump(key)
        if ck.get("proxy"):
            try:
                self._proxy = tpuray.get_actor(_common.PROXY_NAME, namespace=_common.SERVE_NAMESPACE)
                self._proxy_ref = self._proxy.ready.remote()
                self._proxy_state = "STARTING"
            except ValueError:
                self._proxy = None
        print(f"serve controller: recovered {len(self._apps)} application(s) from the checkpoint",
              file=sys.stderr)

    # ---- API for drivers ----

    def ready(self) -> dict:
        return {"http": dict(self._http)}

    def deploy_application(self, name: str, route_prefix, ingress: str, deployments: list) -> None:
        """Deploys (or updates) application ``name``.

        Args:
            route_prefix: ``"/x"`` or None (no HTTP).
            ingress: the name of the deployment that HTTP requests reach.
            deployments: ``{"name", "target": pickled class or function, "init":
                pickled (args, kwargs), "config": checked options}`` per deployment.

        Raises:
            ValueError: another application has this route prefix.
        """
        with self._cv:
            if self._shutting_down:
                raise RuntimeError("serve is shutting down")
            if route_prefix is not None:
                for other, a in self._apps.items():
                    if other != name and a["route_prefix"] == route_prefix and not a["deleting"]:
                        raise ValueError(
                            f"route_prefix {route_prefix!r} is already used by application "
                            f"{other!r}; give each application its own prefix"
                        )
            old = self._apps.get(name)
            names = [d["name"] for d in deployments]
            if old is not None:
                for dname in old["deployments"]:
                    if dname not in names:
                        self._delete_deployment(self._deps.get((name, dname)))
            for d in deployments:
                key = (name, d["name"])
                cfg = d["config"]
                # The code's identity: the pickled class and its arguments. user_config
                # is not part of it: a change of it alone is applied in place through
                # reconfigure (Ray does so for config-file deploys, whose code version
                # is the import path; its serve.run gives every deploy a new version).
                code = d["target"] + d["init"]
                code_hash = hashlib.sha256(
                    code + json.dumps([cfg.get("ray_actor_options"), cfg.get("placement_group_bundles"),
                                       cfg.get("placement_group_strategy")],
                                      sort_keys=True, default=repr).encode()
                ).hexdigest()
                cur = self._deps.get(key)
                if cur is not None and not cur.deleting and cur.code_hash == code_hash:
                    if cfg.get("user_config") != cur.cfg.get("user_config"):
                        # Ray's in-place update: the replicas stay, reconfigure() gets the
                        # new user_config (calls from here reach a STARTING replica after
                        # its initialize, actor calls being ordered per caller).
                        for r in cur.replicas.values():
                            if r.state in (STARTING, RUNNING):
                                r.reconf_ref = r.actor.reconfigure.remote(cfg.get("user_config"))
                    cur.cfg = cfg
                    cur.target = (
                        _config.initial_target(cfg) if cfg.get("autoscaling_config") is None
                        else max(cfg["autoscaling_config"]["min_replicas"],
                                 min(cfg["autoscaling_config"]["max_replicas"], cur.target))
                    )
                    cur.trigger = "CONFIG_UPDATE_STARTED"
                    cur.failed = False
                    cur.failures = 0
                else:
                    new = _Deployment(name, d["name"], d["target"], d["init"], cfg, code_hash)
                    if cur is not None:
                        # A new version: the old replicas stop once out of routing.
                        for r in list(cur.replicas.values()):
                            self._stop_replica(cur, r)
                        new.replicas = cur.replicas
                    self._deps[key] = new
                self._bump(key)
            # Ray: serve.run makes an application imperative (a later config that
            # omits it leaves it running) until a config deploys it again.
            self._declared_apps.discard(name)
            self._apps[name] = {
                "route_prefix": route_prefix,
                "ingress": ingress,
                "deployments": names,
                "deleting": False,
                "last_deployed_time_s": time.time(),
                "status": "DEPLOYING",
                "message": "",
                "was_running": False,
            }
            self._routes_version += 1
            self._cv.notify_all()

    def delete_apps(self, names: list) -> None:
        """Starts deleting the named applications (replicas stop gracefully); unknown
        names are ignored, as in Ray."""
        with self._cv:
            for name in names:
                a = self._apps.get(name)
                if a is None:
                    continue
                a["deleting"] = True
                self._declared_apps.discard(name)
                for dname in a["deployments"]:
                    self._delete_deployment(self._deps.get((name, dname)))
            self._routes_version += 1
            self._cv.notify_all()

    def delete_undeclared(self, names: list) -> list:
        """The first step of applying a config (Ray's ``apply_config``): deletes the
        applications an earlier config deployed that ``names`` (the new config's
        application names) omits; applications ``serve.run`` deployed stay, as in Ray
        (``ApplicationStateManager.apply_app_configs`` deletes only those of
        ``APIType.DECLARATIVE``). Returns the names deleted."""
        with self._cv:
            gone = sorted(self._declared_apps - set(names))
            self.delete_apps(gone)
            return gone

    def mark_declared(self, names: list, warning: str | None = None) -> None:
        """The last step of applying a config: its applications are now declarative
        (their status ``source``), so the next config that omits them deletes them.
        ``warning`` (from :meth:`check_http_options`) is shown as their status message
        while they have none of their own, and as the status' ``declared_warning``."""
        with self._cv:
            self._declared_warning = warning
            self._declared_apps = {n for n in names if n in self._apps}
            self._declared_error = None
            self._declared_failed = {}

    def check_http_options(self, http_options) -> str | None:
        """Compares a config's ``http_options`` with the running ones. As Ray's dashboard
        (``ServeHead.validate_http_options``), the running options are kept (they cannot
        change without restarting serve) and a warning names the differing ones; it is
        printed to this actor's log and returned (None when they agree).

        Raises:
            ValueError/TypeError: an unknown key or a bad value (see ``serve.start``)."""
        from tpuray.serve import _http_options

        asked = _http_options(http_options) if http_options else {}
        diff = sorted(k for k, v in asked.items()
                      if self._http.get(k) != v and not (k == "port" and v == 0))
        if not diff:
            return None
        msg = (f"serve is already running with http_options {self._http}; they cannot change "
               f"without restarting serve, so the config's {diff} "
               f"({ {k: asked[k] for k in diff} }) are not applied")
        print(f"serve controller: warning: {msg}", file=sys.stderr)
        return msg

    def app_status(self, name: str):
        """``{"status", "message", "ingress", "route_prefix", "proxy"}`` of one
        application, or None when it does not exist."""
        with self._cv:
            a = self._apps.get(name)
            if a is None:
                return None
            return {"status": a["status"], "message": a["message"], "ingress": a["ingress"],
                    "route_prefix": a["route_prefix"], "proxy_state": self._proxy_state,
                    "proxy_error": self._proxy_error, "http": self._http_info()}

    def list_apps(self) -> list:
        with self._cv:
            return list(self._apps)

    def status(self) -> dict:
        """The status document (what ``tpuray serve status`` prints)."""
        with self._cv:
            return self._status_doc()

    def shutdown(self, timeout_s: float = 30.0) -> None:
        """Deletes every application, waits (at most ``timeout_s``) for their replicas to
        stop, stops the proxy and records a STOPPED status."""
        with self._cv:
            self._shutting_down = True
        self.delete_apps(self.list_apps())
        deadline = time.monotonic() + timeout_s
        with self._cv:
            while self._deps and time.monotonic() < deadline:
                self._cv.wait(0.1)
            for d in list(self._deps.values()):
                for r in list(d.replicas.values()):
                    self._kill(r)
            self._deps.clear()
            self._apps.clear()
            if self._proxy is not None:
                self._kill_actor(self._proxy)
                self._proxy = None
            self._maybe_checkpoint()
            self._stopped = True
            doc = self._status_doc()
            doc["controller"]["state"] = "STOPPED"
            self._write(doc)
            self._cv.notify_all()

    # ---- Ray's REST API (SERVE-API-1: the head stores a declaration, this applies it) ----

    def _watch_declared(self):
        while not self._stopped:
            time.sleep(_DECLARED_POLL_S)
            try:
                raw = _tpuray.kv_get(_common.SERVE_NAMESPACE, _common.DECLARED_KEY)
                if raw is None:
                    continue
                doc = json.loads(raw)
                if doc.get("seq") == self._declared_seq:
                    continue
                self._declared_seq = doc.get("seq")
                if doc.get("shutdown"):
                    self._shutdown_from_rest()
                    return
                self._apply_declared(doc.get("config") or {})
            except Exception as e:  # noqa: BLE001 - reported in the status, never fatal
                self._declared_error = f"{type(e).__name__}: {e}"
                # As Ray: the applications of a declaration that fails show
                # DEPLOY_FAILED with the error; what ran before keeps serving.
                names = [a.get("name", _common.DEFAULT_APP_NAME) for a in
                         ((doc.get("config") or {}).get("applications") or []) if isinstance(a, dict)]
                with self._cv:
                    self._declared_failed = {n: self._declared_error for n in names}
                print(f"serve controller: the declared config failed: {self._declared_error}", file=sys.stderr)

    def _apply_declared(self, config: dict) -> None:
        """Deploys every application of a declaration (Ray's ``ServeDeploySchema``) and
        deletes the applications it no longer names (Ray's declarative update).

        Raises:
            ValueError/TypeError/ImportError: a bad config or import path (reported in
                the status document's ``declared_error``, shown by the REST API).
        """
        from tpuray.serve import _cli, _payload

        apps = config.get("applications") or []
        for a in apps:
            bad = sorted(set(a) - _cli._APP_KEYS)
            if bad:
                raise ValueError(f"unknown application keys {bad}; expected some of {sorted(_cli._APP_KEYS)}")
            if a.get("runtime_env"):
                raise ValueError(f"application {a.get('name', 'default')!r}: runtime_env is not supported "
                                 "by tpuray's serve config (install the code where the cluster runs)")
        built = []
        for a in apps:
            app = _cli._import_target(a["import_path"], a.get("args"))
            _cli._apply_overrides(app, a.get("deployments"))
            name = a.get("name", _common.DEFAULT_APP_NAME)
            built.append((name, a.get("route_prefix", "/"), *_payload(app, name)))
        warning = self.check_http_options(config.get("http_options"))
        names = [b[0] for b in built]
        self.delete_undeclared(names)
        for name, prefix, ingress, payload in built:
            self.deploy_application(name, prefix, ingress, payload)
        self.mark_declared(names, warning)

    def _shutdown_from_rest(self) -> None:
        """``DELETE /api/serve/applications/``: as ``serve.shutdown()``, then this actor
        ends for good."""
        self.shutdown()
        try:
            tpuray.kill(tpuray.get_actor(_common.CONTROLLER_NAME, namespace=_common.SERVE_NAMESPACE),
                        no_restart=True)
        except Exception:  # noqa: BLE001 - already going
            pass

    # ---- API for handles and the proxy ----

    def listen_for_replicas(self, app: str, deployment: str, version: int):
        """Long poll: returns ``(version, {"exists", "replicas": [(id, actor)],
        "config"})`` once the deployment's routing state differs from ``version``, or
        after ``_LISTEN_S`` seconds."""
        key = (app, deployment)
        deadline = time.monotonic() + _LISTEN_S
        with self._cv:
            while self._versions.get(key, self._base) == version and not self._stopped:
                left = deadline - time.monotonic()
                if left <= 0:
                    break
                self._cv.wait(left)
            d = self._deps.get(key)
            live = d if d is not None and not d.deleting else None
            snap = {
                "exists": live is not None,
                "failed": d.message if d is not None and d.failed else None,
                "replicas": [(r.rid, r.actor) for r in live.replicas.values() if r.state == RUNNING]
                if live is not None else [],
                "models": {r.rid: list(r.models) for r in live.replicas.values() if r.models}
                if live is not None else {},
                "config": {k: d.cfg[k] for k in ("max_ongoing_requests", "max_queued_requests",
                                                  "request_router", "request_router_kwargs")}
                if d is not None else None,
            }
            return self._versions.get(key, self._base), snap

    def listen_for_routes(self, version: int):
        """Long poll: ``(version, {route_prefix: (app, ingress deployment)})``."""
        deadline = time.monotonic() + _LISTEN_S
        with self._cv:
            while self._routes_version == version and not self._stopped:
                left = deadline - time.monotonic()
                if left <= 0:
                    break
                self._cv.wait(left)
            routes = {a["route_prefix"]: (name, a["ingress"]) for name, a in self._apps.items()
                      if a["route_prefix"] is not None and not a["deleting"]}
            return self._routes_version, routes

    def record_handle_metrics(self, app: str, deployment: str, handle_id: str, ongoing: float) -> None:
        """A handle's count of requests it has queued or running at the deployment."""
        with self._cv:
            self._metrics.setdefault((app, deployment), {})[handle_id] = (float(ongoing), time.monotonic())

    def record_multiplexed_models(self, app: str, deployment: str, replica_id: str, model_ids: list) -> None:
        """A replica's multiplexed model ids (it sends them after each load)."""
        with self._cv:
            d = self._deps.get((app, deployment))
            if d is not None and replica_id in d.replicas:
                d.replicas[replica_id].models = list(model_ids)
                self._bump((app, deployment))

    def report_replica_failure(self, app: str, deployment: str, replica_id: str) -> None:
        """A handle saw a request fail because the replica's actor died: look at once."""
        with self._cv:
            d = self._deps.get((app, deployment))
            if d is not None and replica_id in d.replicas:
                d.replicas[replica_id].suspect = True

    # ---- the control loop ----

    def _run(self):
        while not self._stopped:
            try:
                self._tick()
            except Exception:  # noqa: BLE001 - the loop must survive anything
                print("serve controller: control loop error:\n" + traceback.format_exc(), file=sys.stderr)
                time.sleep(0.5)

    def _outstanding(self) -> list:
        refs = []
        with self._cv:
            for d in self._deps.values():
                for r in d.replicas.values():
                    for ref in (r.init_ref, r.health_ref, r.stop_ref, r.reconf_ref):
                        if ref is not None:
                            refs.append(ref)
            if self._proxy_ref is not None:
                refs.append(self._proxy_ref)
        return refs

    def _tick(self):
        refs = self._outstanding()
        ready: set = set()
        if refs:
            done, _ = tpuray.wait(refs, num_returns=len(refs), timeout=_TICK_S)
            ready = set(done)
        else:
            time.sleep(_TICK_S)
        now = time.monotonic()
        with self._cv:
            if self._stopped:
                return
            for key, d in list(self._deps.items()):
                self._reconcile(key, d, ready, now)
            self._manage_proxy(ready, now)
            self._update_apps()
            self._maybe_checkpoint()
            doc = self._status_doc()
            self._cv.notify_all()
        self._maybe_write(doc)

    def _reconcile(self, key, d: _Deployment, ready: set, now: float):
        for r in list(d.replicas.values()):
            if r.state == STARTING and r.init_ref in ready:
                ref, r.init_ref = r.init_ref, None
                try:
                    r.info = tpuray.get(ref)
                    r.state = RUNNING
                    r.next_check = now + float(r_cfg(d)["health_check_period_s"])
                    d.failures = 0
                    self._bump(key)
                except Exception as e:  # noqa: BLE001
                    d.failures += 1
                    d.message = f"replica {r.rid} failed to start: {_short(e)}"
                    self._kill(r)
                    del d.replicas[r.rid]
                    if d.failures >= _MAX_CONSTRUCTOR_FAILURES:
                        d.failed = True
                        d.trigger = "REPLICA_STARTUP_FAILED"
                        d.message = (
                            f"the deployment failed to start {d.failures} replicas in a row; "
                            f"the last error: {_short(e)}"
                        )
                        self._bump(key)
            elif r.state == STARTING and now - r.created > _SLOW_START_S:
                n = sum(1 for x in d.replicas.values() if x.state == STARTING and now - x.created > _SLOW_START_S)
                d.message = (
                    f"Deployment {d.name!r} in application {d.app!r} has {n} replicas that have taken "
                    f"more than {_SLOW_START_S:.0f}s to be scheduled. Resources required for each "
                    f"replica: {_replica_resources(d.cfg)}, total resources available: "
                    f"{_safe(tpuray.available_resources)}."
                )
            elif r.state == RUNNING:
                if r.reconf_ref is not None and r.reconf_ref in ready:
                    ref, r.reconf_ref = r.reconf_ref, None
                    try:
                        tpuray.get(ref)
                    except Exception as e:  # noqa: BLE001
                        self._replace(key, d, r, f"failed to apply the new user_config: {_short(e)}")
                        continue
                self._health(key, d, r, ready, now)
            elif r.state == STOPPING:
                if r.stop_ref in ready or now >= r.stop_deadline:
                    self._kill(r)
                    del d.replicas[r.rid]
        if d.deleting:
            if not d.replicas:
                del self._deps[key]
                self._bump(key)
            return
        self._autoscale(key, d, now)
        active = [r for r in d.replicas.values() if r.state in (STARTING, RUNNING)]
        if len(active) < d.target and not d.failed:
            for _ in range(d.target - len(active)):
                self._start_replica(key, d)
        elif len(active) > d.target:
            extra = len(active) - d.target
            starting = [r for r in active if r.state == STARTING]
            running = sorted((r for r in active if r.state == RUNNING), key=lambda r: -r.created)
            for r in (starting + running)[:extra]:
                self._stop_replica(d, r)
            self._bump(key)
        n_running = sum(1 for r in d.replicas.values() if r.state == RUNNING)
        if n_running >= d.target and not d.failed:
            if not d.ever_healthy or d.unhealthy or d.scaling:
                d.trigger = "CONFIG_UPDATE_COMPLETED" if not d.ever_healthy else (
                    "AUTOSCALING" if d.scaling else "HEALTH_CHECK_RECOVERED")
                if not d.message.startswith("replica") or not d.unhealthy:
                    d.message = ""
            d.ever_healthy = True
            d.unhealthy = False
            d.scaling = None

    def _health(self, key, d, r, ready, now):
        cfg = d.cfg
        if r.suspect:
            r.suspect = False
            try:
                state = _tpuray.actor_state(r.actor._actor_id, 0)[0]
            except Exception:  # noqa: BLE001
                state = ""
            if state == "DEAD":
                self._replace(key, d, r, "died (its actor is dead)")
                return
            r.next_check = 0.0
        if r.health_ref is not None and r.health_ref in ready:
            ref, r.health_ref = r.health_ref, None
            try:
                r.ongoing = tpuray.get(ref).get("ongoing", 0)
                r.next_check = now + float(cfg["health_check_period_s"])
            except Exception as e:  # noqa: BLE001
                why = "died" if _common.is_actor_death(e) else "failed its health check"
                self._replace(key, d, r, f"{why}: {_short(e)}")
            return
        if r.health_ref is not None:
            if now - r.health_sent > float(cfg["health_check_timeout_s"]):
                self._replace(key, d, r, f"did not answer its health check within {cfg['health_check_timeout_s']} s")
            return
        if now >= r.next_check:
            r.health_ref = r.actor.check_health.remote()
            r.health_sent = now

    def _replace(self, key, d, r, why):
        r.state = UNHEALTHY
        self._kill(r)
        del d.replicas[r.rid]
        d.unhealthy = True
        d.trigger = "HEALTH_CHECK_FAILED"
        d.message = f"replica {r.rid} {why}; it was replaced"
        print(f"serve controller: deployment {d.app}#{d.name}: {d.message}", file=sys.stderr)
        self._bump(key)

    def _autoscale(self, key, d, now):
        ac = d.cfg.get("autoscaling_config")
        if ac is None or d.failed:
            return
        per = self._metrics.get(key, {})
        for hid in [h for h, (_, ts) in per.items() if now - ts > _METRIC_STALE_S]:
            del per[hid]
        total = sum(v for v, _ in per.values())
        d.total_ongoing = total
        cur = d.target
        want = _config.autoscale_desired(ac, cur, total)
        if want == cur:
            d.wish = None
            return
        up = want > cur
        if up:
            delay = 0.0 if cur == 0 else ac["upscale_delay_s"]
        else:
            delay = ac["downscale_delay_s"]
            if want == 0 and ac.get("downscale_to_zero_delay_s") is not None:
                delay = ac["downscale_to_zero_delay_s"]
        if d.wish is None or d.wish[0] != up:
            d.wish = (up, now)
        if now - d.wish[1] >= delay:
            d.target = want
            d.wish = None
            d.scaling = "UPSCALING" if up else "DOWNSCALING"
            d.trigger = "AUTOSCALING"
            d.message = f"{'upscaling' if up else 'downscaling'} from {cur} to {want} replicas ({total:g} ongoing requests)"
            self._bump(key)

    def _start_replica(self, key, d):
        from tpuray.serve._replica import ServeReplica

        rid = uuid.uuid4().hex[:8]
        cfg = d.cfg
        ao = dict(cfg.get("ray_actor_options") or {})
        opts = {
            "name": _replica_name(d, rid),
            "namespace": _common.SERVE_NAMESPACE,
            "lifetime": "detached",
            "max_concurrency": max(32, min(256, 2 * int(cfg["max_ongoing_requests"]) + 16)),
            "num_cpus": ao.pop("num_cpus", 1),
        }
        ao.pop("object_store_memory", None)
        opts.update({k: v for k, v in ao.items() if v is not None})
        pg = None
        try:
            if cfg.get("placement_group_bundles"):
                from tpuray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

                pg = _replica_placement_group(cfg, _replica_name(d, rid))
                opts["scheduling_strategy"] = PlacementGroupSchedulingStrategy(
                    pg, placement_group_bundle_index=0, placement_group_capture_child_tasks=True)
            rcfg = r_cfg(d)
            if pg is not None:
                rcfg["placement_group_id"] = pg.id.hex()
            actor = tpuray.remote(ServeReplica).options(**opts).remote(
                d.app, d.name, rid, d.target_bytes, d.init_bytes, rcfg
            )
        except _NoSliceYet as e:
            d.message = str(e)
            return
        except Exception as e:  # noqa: BLE001 - e.g. a bad runtime_env
            _remove_pg(pg)
            d.failures += 1
            d.message = f"could not create a replica: {_short(e)}"
            if d.failures >= _MAX_CONSTRUCTOR_FAILURES:
                d.failed = True
                d.trigger = "REPLICA_STARTUP_FAILED"
                self._bump(key)
            return
        d.replicas[rid] = _Replica(rid, actor)
        d.replicas[rid].pg = pg

    def _stop_replica(self, d, r):
        if r.state == STARTING:
            self._kill(r)
            d.replicas.pop(r.rid, None)
            return
        if r.state == STOPPING:
            return
        r.state = STOPPING
        r.health_ref = None
        try:
            r.stop_ref = r.actor.prepare_for_shutdown.remote()
        except Exception:  # noqa: BLE001 - dead already
            r.stop_ref = None
        r.stop_deadline = time.monotonic() + float(d.cfg["graceful_shutdown_timeout_s"]) + 2.0

    def _delete_deployment(self, d):
        if d is None or d.deleting:
            return
        d.deleting = True
        d.target = 0
        for r in list(d.replicas.values()):
            self._stop_replica(d, r)
        self._bump((d.app, d.name))

    def _kill(self, r):
        self._kill_actor(r.actor)
        r.init_ref = r.health_ref = r.stop_ref = r.reconf_ref = None
        _remove_pg(getattr(r, "pg", None))
        r.pg = None

    @staticmethod
    def _kill_actor(actor):
        try:
            tpuray.kill(actor, no_restart=True)
        except Exception:  # noqa: BLE001 - already dead
            pass

    def _bump(self, key):
        self._versions[key] = self._versions.get(key, self._base) + 1
        self._cv.notify_all()

    # ---- the proxy ----

    def _http_info(self):
        port = self._proxy_info.get("port", self._http["port"])
        return {"host": self._http["host"], "port": port}

    def _manage_proxy(self, ready, now):
        want = any(a["route_prefix"] is not None and not a["deleting"] for a in self._apps.values())
        if not want or self._shutting_down:
            return
        if self._proxy is None:
            if now < self._proxy_retry_at:
                return
            from tpuray.serve._proxy import ProxyActor

            self._proxy = tpuray.remote(ProxyActor).options(
                name=_common.PROXY_NAME, namespace=_common.SERVE_NAMESPACE, lifetime="detached",
                num_cpus=0, max_concurrency=16,
            ).remote(self._http["host"], self._http["port"])
            self._proxy_ref = self._proxy.ready.remote()
            self._proxy_state = "STARTING"
            return
        if self._proxy_ref is not None and self._proxy_ref in ready:
            ref, self._proxy_ref = self._proxy_ref, None
            try:
                info = tpuray.get(ref)
                if self._proxy_state == "STARTING":
                    self._proxy_info = info
                self._proxy_state = "HEALTHY"
                self._proxy_error = ""
                self._proxy_next_check = now + 10.0
            except Exception as e:  # noqa: BLE001
                self._proxy_error = f"the HTTP proxy failed: {_short(e)}"
                print(f"serve controller: {self._proxy_error}", file=sys.stderr)
                self._proxy_state = "UNHEALTHY"
                self._kill_actor(self._proxy)
                self._proxy = None
                self._proxy_retry_at = now + 5.0
            return
        if self._proxy_ref is None and now >= self._proxy_next_check:
            self._proxy_ref = self._proxy.check_health.remote()

    # ---- status ----

    def _dep_status(self, d: _Deployment) -> str:
        if d.failed:
            return "DEPLOY_FAILED"
        running = sum(1 for r in d.replicas.values() if r.state == RUNNING and r.reconf_ref is None)
        if running >= d.target and not d.scaling:
            return "HEALTHY"
        if d.unhealthy:
            return "UNHEALTHY"
        if d.scaling:
            return d.scaling
        return "UPDATING"

    def _update_apps(self):
        for name, a in list(self._apps.items()):
            deps = [self._deps.get((name, dn)) for dn in a["deployments"]]
            if a["deleting"]:
                if all(d is None for d in deps):
                    del self._apps[name]
                    self._routes_version += 1
                else:
                    a["status"] = "DELETING"
                continue
            states = [self._dep_status(d) for d in deps if d is not None]
            failed = [d for d in deps if d is not None and d.failed]
            if failed:
                a["status"] = "DEPLOY_FAILED"
                a["message"] = f"deployment {failed[0].name!r} failed: {failed[0].message}"
            elif all(s == "HEALTHY" for s in states) or (
                a["was_running"] and all(s in ("HEALTHY", "UPSCALING", "DOWNSCALING") for s in states)
            ):
                a["status"] = "RUNNING"
                a["was_running"] = True
                a["message"] = ""
            elif any(s == "UNHEALTHY" for s in states):
                a["status"] = "UNHEALTHY"
                a["message"] = "; ".join(d.message for d in deps if d is not None and d.unhealthy)
            else:
                a["status"] = "DEPLOYING" if not a["was_running"] else a["status"]
                slow = [d.message for d in deps if d is not None and "taken more than" in d.message]
                a["message"] = slow[0] if slow else ""

    def _status_doc(self) -> dict:
        apps = {}
        for name, a in self._apps.items():
            deps = {}
            for dn in a["deployments"]:
                d = self._deps.get((name, dn))
                if d is None:
                    continue
                counts: dict = {}
                for r in d.replicas.values():
                    counts[r.state] = counts.get(r.state, 0) + 1
                ac = d.cfg.get("autoscaling_config")
                deps[dn] = {
                    "required_resources": _replica_resources(d.cfg),
                    "deployment_config": _deployment_config(dn, d.cfg),
                    "status": self._dep_status(d),
                    "status_trigger": d.trigger,
                    "message": d.message,
                    "target_replicas": d.target,
                    "replica_states": counts,
                    "replicas": [
                        {"replica_id": r.rid, "state": r.state, "start_time_s": r.started_at,
                         "actor_id": r.actor._actor_id,
                         "node_id": r.info.get("node_id", ""), "pid": r.info.get("pid", 0)}
                        for r in d.replicas.values()
                    ],
                    "autoscaling": None if ac is None else {
                        "min_replicas": ac["min_replicas"], "max_replicas": ac["max_replicas"],
                        "target_ongoing_requests": ac["target_ongoing_requests"],
                        "ongoing_requests": d.total_ongoing,
                    },
                }
            failed = self._declared_failed.get(name)
            message = failed or a["message"]
            if not message and name in self._declared_apps and self._declared_warning:
                message = self._declared_warning
            apps[name] = {
                "source": "declarative" if name in self._declared_apps else "imperative",
                "status": "DEPLOY_FAILED" if failed else a["status"],
                "message": message, "route_prefix": a["route_prefix"],
                "ingress": a["ingress"], "last_deployed_time_s": a["last_deployed_time_s"],
                "deployments": deps,
            }
        proxies: dict[str, str] = {}
        if self._proxy_state is not None:
            proxies[self._proxy_info.get("node_id") or self._node_id] = self._proxy_state
        for name, err in self._declared_failed.items():
            if name not in apps:
                apps[name] = {"source": "declarative", "status": "DEPLOY_FAILED", "message": err,
                              "route_prefix": None, "ingress": "", "last_deployed_time_s": time.time(),
                              "deployments": {}}
        return {
            "controller": {"state": "STOPPED" if self._stopped else "RUNNING",
                           "node_id": self._node_id, "pid": os.getpid(), "updated_at": time.time()},
            "proxies": proxies,
            "http": self._http_info(),
            "applications": apps,
            "target_capacity": None,
            "declared_error": self._declared_error,
            "declared_warning": self._declared_warning,
        }

    def _maybe_write(self, doc):
        cmp = dict(doc)
        cmp["controller"] = {k: v for k, v in doc["controller"].items() if k != "updated_at"}
        now = time.monotonic()
        if cmp != self._last_doc or now - self._last_write >= _STATUS_REFRESH_S:
            self._last_doc = cmp
            self._last_write = now
            self._write(doc)

    def _write(self, doc):
        try:
            _tpuray.kv_put(_common.SERVE_NAMESPACE, _common.STATUS_KEY, json.dumps(doc).encode(), True)
        except Exception as e:  # noqa: BLE001 - the head is briefly unreachable
            print(f"serve controller: could not write the status to the KV: {e}", file=sys.stderr)


_HEAD_RESOURCE = re.compile(r"^TPU-(.+)-head$")


def _replica_placement_group(cfg: dict, name: str):
    """The placement group of one replica (Ray's ``placement_group_bundles`` and
    ``placement_group_strategy``, default ``PACK``; the replica runs in bundle 0 and its
    tasks and actors in the group).

    A bundle naming a slice's ``TPU-<type>-head`` (e.g. ``TPU-v6e-16-head``) asks for a
    whole slice: the bundles must then be one per host of that slice, each with all of
    its chips (``{"TPU": 4}`` for v6e-16), and the group is a slice group (TPU.md:
    every host of one intact slice, in worker-id order, or nothing; SCHED-15), so
    the replica's gang is always the four hosts of one slice.

    Raises:
        ValueError: slice bundles that do not match the slice's shape.
    """
    from tpuray.util.placement_group import PlacementGroup, placement_group

    bundles = [dict(b) for b in cfg["placement_group_bundles"]]
    strategy = cfg.get("placement_group_strategy") or "PACK"
    pod = None
    for b in bundles:
        for k in b:
            m = _HEAD_RESOURCE.match(k)
            if m:
                pod = m.group(1)
    if pod is None:
        return placement_group(bundles, strategy=strategy, name=name)
    version = pod.split("-")[0]
    topology = None
    for node in tpuray.nodes():
        labels = node.get("Labels") or {}
        if labels.get("tpuray.io/tpu-pod-type") == pod and labels.get("tpuray.io/tpu-topology"):
            topology = labels["tpuray.io/tpu-topology"]
            break
    if topology is None:
        raise _NoSliceYet(f"no {pod} slice has joined the cluster yet (placement_group_bundles name "
                         f"TPU-{pod}-head); the replica starts once one has")
    _ty, _chips, hosts, per_host = _tpuray.tpu_slice_shape(topology=topology, version=version)
    extra = [{k: v for k, v in b.items() if k != "TPU" and not _HEAD_RESOURCE.match(k)} for b in bundles]
    if len(bundles) != hosts or any(b.get("TPU") != per_host for b in bundles):
        raise ValueError(
            f"placement_group_bundles name TPU-{pod}-head, so they ask for a whole {pod} slice: "
            f"that is {hosts} bundles of {{'TPU': {per_host}}} (one per host), got {bundles}"
        )
    if any(e != extra[0] for e in extra):
        raise ValueError(f"the bundles of a whole-slice replica must ask for the same other resources (got {extra})")
    if strategy not in ("PACK", "SPREAD", "STRICT_SPREAD"):
        raise ValueError(f"placement_group_strategy {strategy!r} cannot hold a slice: one bundle per host")
    custom = dict(bundles[0], TPU=float(per_host))
    custom = {k: float(v) for k, v in custom.items() if not _HEAD_RESOURCE.match(k)}
    pg_id, n, _, _, _ = _tpuray.slice_placement_group(topology, version, custom if extra[0] else None, 1, name)
    return PlacementGroup(pg_id, n)


class _NoSliceYet(Exception):
    """No slice of the asked-for type has joined yet: the replica waits (not a failure)."""


def _find_pg(name: str):
    """A replica's placement group by its name (the replica's actor name), or None."""
    from tpuray.util.placement_group import get_placement_group

    try:
        return get_placement_group(name)
    except ValueError:
        return None


def _remove_pg(pg) -> None:
    if pg is None:
        return
    from tpuray.util.placement_group import remove_placement_group

    try:
        remove_placement_group(pg)
    except Exception:  # noqa: BLE001 - gone already
        pass


def _replica_name(d: _Deployment, rid: str) -> str:
    return f"SERVE_REPLICA::{d.app}#{d.name}#{rid}"


def r_cfg(d: _Deployment) -> dict:
    """The options a replica needs."""
    return {k: d.cfg[k] for k in ("max_ongoing_requests", "health_check_timeout_s",
                                  "graceful_shutdown_timeout_s", "user_config",
                                  "health_check_period_s", "graceful_shutdown_wait_loop_s")}


def _replica_resources(cfg) -> dict:
    ao = cfg.get("ray_actor_options") or {}
    res = {"CPU": ao.get("num_cpus", 1)}
    if ao.get("num_gpus"):
        res["GPU"] = ao["num_gpus"]
    res.update(ao.get("resources") or {})
    return res


def _deployment_config(name: str, cfg: dict) -> dict:
    """The deployment's options as Ray's ``DeploymentSchema`` names them (JSON)."""
    out = {"name": name}
    for k in ("num_replicas", "max_ongoing_requests", "max_queued_requests", "user_config",
              "autoscaling_config", "graceful_shutdown_wait_loop_s", "graceful_shutdown_timeout_s",
              "health_check_period_s", "health_check_timeout_s", "ray_actor_options",
              "placement_group_bundles", "placement_group_strategy"):
        v = cfg.get(k)
        if v is not None:
            out[k] = v
    try:
        json.dumps(out)
    except TypeError:
        out = {"name": name}
    return out


def _safe(f):
    try:
        return f()
    except Exception:  # noqa: BLE001
        return "unknown"


def _short(e: BaseException) -> str:
    s = str(e).strip()
    lines = [ln for ln in s.splitlines() if ln.strip()]
    # A remote traceback: its last line names the exception.
    return lines[-1] if len(lines) > 3 else s
