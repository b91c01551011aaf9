//! Ray Serve's REST API on the dashboard port (`ray/dashboard/modules/serve/serve_head.py`):
//! `PUT /api/serve/applications/` declares the applications (Ray's `ServeDeploySchema` as
//! JSON, what `serve deploy` sends), `GET` answers serve's state (Ray's
//! `ServeInstanceDetails`), `DELETE` shuts serve down.
//! Behind the cluster token as the other API routes (HTTP-2).
//!
//! - SERVE-API-1: the head runs no Python and imports no user code. It writes the
//!   declaration to its KV (namespace `serve`, key `declared`: `{"seq": ms, "config": doc}`
//!   or `{"seq": ms, "shutdown": true}`) and the serve controller (a Python actor),
//!   which polls that key, applies it: imports each `import_path`, deploys the
//!   applications and deletes the ones the declaration no longer names.
//! - SERVE-API-2: so a declaration needs a running controller: without one (its status
//!   document in the KV is missing, stopped, or older than [`CONTROLLER_STALE_S`]) `PUT`
//!   is 503 naming how to start serve, rather than a declaration nobody would apply.
//!   `DELETE` without a controller does nothing (200), as Ray's.
//! - SERVE-API-3: `GET` answers in the shape of Ray's `ServeInstanceDetails` (see
//!   [`ray_details`]); a declaration that failed shows as its applications'
//!   `DEPLOY_FAILED` status with the error as their message.

use std::sync::Arc;
use std::time::{SystemTime, UNIX_EPOCH};

use axum::Router;
use axum::body::Bytes;
use axum::extract::State;
use axum::http::{StatusCode, header};
use axum::response::{IntoResponse, Response};
use axum::routing::get;
use serde_json::{Value, json};
use tpuray_proto::pb;

use crate::http::Api;

/// KV namespace of serve's documents (`tpuray.serve._common.SERVE_NAMESPACE`).
const SERVE_NAMESPACE: &str = "serve";
/// Seconds after which a controller that stopped writing its status counts as gone (it
/// writes every 2 s).
pub const CONTROLLER_STALE_S: f64 = 30.0;
/// Top-level keys of Ray's `ServeDeploySchema`.
const DEPLOY_KEYS: &[&str] = &[
    "proxy_location",
    "http_options",
    "grpc_options",
    "logging_config",
    "applications",
    "target_capacity",
];

type Shared = State<Arc<Api>>;

pub(crate) fn routes() -> Router<Arc<Api>> {
    Router::new().route("/api/serve/applications/", get(details).put(declare).delete(shut_down))
}

fn text(code: StatusCode, msg: String) -> Response {
    (code, [(header::CONTENT_TYPE, "text/plain; charset=utf-8")], msg).into_response()
}

fn now_s() -> f64 {
    SystemTime::now().duration_since(UNIX_EPOCH).map(|d| d.as_secs_f64()).unwrap_or(0.0)
}

async fn status_doc(api: &Api) -> Result<Option<Value>, Response> {
    let r = api
        .grpc
        .clone()
        .kv_get(pb::KvGetRequest { namespace: SERVE_NAMESPACE.into(), key: b"status".to_vec() })
        .await
        .map_err(|e| {
            text(
                StatusCode::SERVICE_UNAVAILABLE,
                format!("cannot read serve's status: {}", e.message()),
            )
        })?
        .into_inner();
    if !r.found {
        return Ok(None);
    }
    serde_json::from_slice(&r.value).map(Some).map_err(|e| {
        text(
            StatusCode::INTERNAL_SERVER_ERROR,
            format!("serve's status in the KV is not JSON: {e}"),
        )
    })
}

/// SERVE-API-2: whether a controller wrote a RUNNING status lately.
fn controller_runs(doc: Option<&Value>) -> bool {
    let Some(c) = doc.and_then(|d| d.get("controller")) else { return false };
    c.get("state").and_then(Value::as_str) == Some("RUNNING")
        && c.get("updated_at")
            .and_then(Value::as_f64)
            .is_some_and(|t| now_s() - t < CONTROLLER_STALE_S)
}

async fn put_declared(api: &Api, doc: Value) -> Result<(), Response> {
    api.grpc
        .clone()
        .kv_put(pb::KvPutRequest {
            request_id: tpuray_proto::new_request_id(),
            namespace: SERVE_NAMESPACE.into(),
            key: b"declared".to_vec(),
            value: doc.to_string().into_bytes(),
            overwrite: true,
        })
        .await
        .map(|_| ())
        .map_err(|e| {
            text(
                StatusCode::SERVICE_UNAVAILABLE,
                format!("cannot store the declaration: {}", e.message()),
            )
        })
}

fn seq() -> u64 {
    SystemTime::now().duration_since(UNIX_EPOCH).map(|d| d.as_millis() as u64).unwrap_or(0)
}

/// Checks the shape the controller relies on; the controller checks the rest (it names
/// unknown application keys and deployment options).
fn check_config(doc: &Value) -> Result<(), String> {
    let Some(obj) = doc.as_object() else {
        return Err("the body must be a JSON object (Ray's ServeDeploySchema)".into());
    };
    if let Some(bad) = obj.keys().find(|k| !DEPLOY_KEYS.contains(&k.as_str())) {
        return Err(format!("unknown field {bad:?}; expected some of {DEPLOY_KEYS:?}"));
    }
    let Some(apps) = obj.get("applications").and_then(Value::as_array) else {
        return Err("field \"applications\" must be a list of applications".into());
    };
    for (i, a) in apps.iter().enumerate() {
        if a.get("import_path").and_then(Value::as_str).is_none() {
            return Err(format!(
                "applications[{i}] needs an \"import_path\" string (module:attribute)"
            ));
        }
    }
    Ok(())
}

async fn declare(State(api): Shared, body: Bytes) -> Response {
    let doc: Value = match serde_json::from_slice(&body) {
        Ok(v) => v,
        Err(e) => return text(StatusCode::BAD_REQUEST, format!("the body is not JSON: {e}")),
    };
    if let Err(msg) = check_config(&doc) {
        return text(StatusCode::BAD_REQUEST, msg);
    }
    match status_doc(&api).await {
        Err(r) => return r,
        Ok(st) if !controller_runs(st.as_ref()) => {
            return text(
                StatusCode::SERVICE_UNAVAILABLE,
                "no serve controller runs on this cluster: start serve first (serve.start() in a \
                 driver, or `tpuray serve deploy CONFIG`); the head itself runs no Python"
                    .into(),
            );
        }
        Ok(_) => {}
    }
    match put_declared(&api, json!({"seq": seq(), "config": doc})).await {
        Ok(()) => StatusCode::OK.into_response(),
        Err(r) => r,
    }
}

async fn shut_down(State(api): Shared) -> Response {
    match status_doc(&api).await {
        Err(r) => r,
        Ok(st) if !controller_runs(st.as_ref()) => StatusCode::OK.into_response(),
        Ok(_) => match put_declared(&api, json!({"seq": seq(), "shutdown": true})).await {
            Ok(()) => StatusCode::OK.into_response(),
            Err(r) => r,
        },
    }
}

async fn details(State(api): Shared) -> Response {
    let st = match status_doc(&api).await {
        Ok(st) => st,
        Err(r) => return r,
    };
    let running = controller_runs(st.as_ref());
    let body = ray_details(&st.unwrap_or(Value::Null), running);
    (StatusCode::OK, [(header::CONTENT_TYPE, "application/json")], body.to_string()).into_response()
}

fn field(v: &Value, k: &str) -> Value {
    v.get(k).cloned().unwrap_or(Value::Null)
}

/// SERVE-API-3: the controller's status document in the shape of Ray's
/// `ServeInstanceDetails` (`ray/serve/schema.py`, whose models refuse unknown fields),
/// so Ray's own `serve status --address http://HEAD:PORT` reads it.
fn ray_details(st: &Value, running: bool) -> Value {
    let mut apps = serde_json::Map::new();
    let mut proxies = serde_json::Map::new();
    if running {
        for (name, a) in st.get("applications").and_then(Value::as_object).into_iter().flatten() {
            let mut deps = serde_json::Map::new();
            for (dn, d) in a.get("deployments").and_then(Value::as_object).into_iter().flatten() {
                let replicas: Vec<Value> = d
                    .get("replicas")
                    .and_then(Value::as_array)
                    .into_iter()
                    .flatten()
                    .map(|r| {
                        json!({
                            "replica_id": field(r, "replica_id"), "state": field(r, "state"),
                            "pid": field(r, "pid"), "start_time_s": field(r, "start_time_s"),
                            "node_id": field(r, "node_id"), "actor_id": field(r, "actor_id"),
                        })
                    })
                    .collect();
                deps.insert(
                    dn.clone(),
                    json!({
                        "name": dn, "status": field(d, "status"),
                        "status_trigger": field(d, "status_trigger"), "message": field(d, "message"),
                        "deployment_config": d.get("deployment_config").cloned().unwrap_or(json!({"name": dn})),
                        "target_num_replicas": field(d, "target_replicas"),
                        "required_resources": d.get("required_resources").cloned().unwrap_or(json!({})),
                        "replicas": replicas,
                    }),
                );
            }
            apps.insert(
                name.clone(),
                json!({
                    "name": name, "route_prefix": field(a, "route_prefix"), "docs_path": Value::Null,
                    "status": field(a, "status"), "message": field(a, "message"),
                    "last_deployed_time_s": field(a, "last_deployed_time_s"),
                    "source": a.get("source").cloned().unwrap_or(json!("imperative")),
                    "deployments": deps, "external_scaler_enabled": false,
                }),
            );
        }
        for (node, s) in st.get("proxies").and_then(Value::as_object).into_iter().flatten() {
            proxies.insert(node.clone(), json!({"node_id": node, "status": s}));
        }
    }
    let controller = st
        .get("controller")
        .filter(|_| running)
        .map(|c| json!({"node_id": field(c, "node_id"), "actor_name": "SERVE_CONTROLLER_ACTOR"}));
    json!({
        "controller_info": controller.unwrap_or(Value::Null),
        "proxy_location": "EveryNode",
        "http_options": field(st, "http"),
        "proxies": proxies,
        "applications": apps,
        "target_capacity": Value::Null,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_declaration_without_applications_or_with_unknown_fields_is_refused_by_name() {
        assert!(check_config(&json!([])).unwrap_err().contains("JSON object"));
        assert!(check_config(&json!({"apps": []})).unwrap_err().contains("unknown field \"apps\""));
        assert!(check_config(&json!({})).unwrap_err().contains("\"applications\" must be a list"));
        let e = check_config(&json!({"applications": [{"name": "a"}]})).unwrap_err();
        assert!(e.contains("applications[0] needs an \"import_path\""), "{e}");
        assert!(check_config(&json!({"applications": [{"import_path": "m:app"}]})).is_ok());
    }

    /// SERVE-API-3: `GET` answers in the shape of Ray's `ServeInstanceDetails`.
    #[test]
    fn details_have_rays_shape_and_nothing_without_a_controller() {
        let st = json!({
            "controller": {"state": "RUNNING", "updated_at": now_s(), "node_id": "n1", "pid": 7},
            "proxies": {"n1": "HEALTHY"}, "http": {"host": "127.0.0.1", "port": 8000},
            "applications": {"a": {"status": "RUNNING", "message": "", "route_prefix": "/a",
                "last_deployed_time_s": 1.0, "ingress": "D", "source": "declarative",
                "deployments": {"D": {"status": "HEALTHY", "status_trigger": "CONFIG_UPDATE_COMPLETED",
                    "message": "", "target_replicas": 1, "replica_states": {"RUNNING": 1},
                    "required_resources": {"CPU": 1}, "deployment_config": {"name": "D"},
                    "replicas": [{"replica_id": "r", "state": "RUNNING", "start_time_s": 2.0,
                                  "actor_id": "x", "node_id": "n1", "pid": 9}]}}}},
        });
        let d = ray_details(&st, true);
        assert_eq!(d["proxies"]["n1"]["status"], "HEALTHY");
        let dep = &d["applications"]["a"]["deployments"]["D"];
        assert_eq!(dep["target_num_replicas"], 1);
        assert_eq!(dep["replicas"][0]["start_time_s"], 2.0);
        assert!(
            dep.get("replica_states").is_none() && d["applications"]["a"].get("ingress").is_none()
        );
        assert_eq!(d["applications"]["a"]["source"], "declarative");
        let none = ray_details(&st, false);
        assert_eq!(none["applications"], json!({}));
        assert_eq!(none["controller_info"], Value::Null);
    }

    #[test]
    fn a_controller_counts_as_running_only_with_a_fresh_running_status() {
        assert!(!controller_runs(None));
        let fresh = json!({"controller": {"state": "RUNNING", "updated_at": now_s()}});
        assert!(controller_runs(Some(&fresh)));
        let stopped = json!({"controller": {"state": "STOPPED", "updated_at": now_s()}});
        assert!(!controller_runs(Some(&stopped)));
        let stale = json!({"controller": {"state": "RUNNING", "updated_at": now_s() - 60.0}});
        assert!(!controller_runs(Some(&stale)));
    }
}
