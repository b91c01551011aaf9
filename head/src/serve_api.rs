//! Ray Serve's REST API on the dashboard port (`ray/dashboard/modules/serve/serve_head.py`):
//! `PUT /api/serve/applications/` declares the applications (Ray's `ServeDeploySchema` as
//! JSON, what `serve deploy` sends), `GET` answers serve's state (Ray's
//! `ServeInstanceDetails` keys: `controller_info`, `proxy_location`, `http_options`,
//! `proxies`, `applications` by name, `target_capacity`), `DELETE` shuts serve down.
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
    let st = st.unwrap_or(Value::Null);
    let mut apps = serde_json::Map::new();
    if running && let Some(a) = st.get("applications").and_then(Value::as_object) {
        for (name, app) in a {
            let mut app = app.clone();
            if let Some(o) = app.as_object_mut() {
                o.insert("name".into(), json!(name));
                if let Some(deps) = o.get_mut("deployments").and_then(Value::as_object_mut) {
                    for (dn, d) in deps.iter_mut() {
                        if let Some(d) = d.as_object_mut() {
                            d.insert("name".into(), json!(dn));
                        }
                    }
                }
            }
            apps.insert(name.clone(), app);
        }
    }
    let body = json!({
        "controller_info": if running { st.get("controller").cloned().unwrap_or(Value::Null) } else { Value::Null },
        "proxy_location": "EveryNode",
        "http_options": st.get("http").cloned().unwrap_or(Value::Null),
        "proxies": if running { st.get("proxies").cloned().unwrap_or(json!({})) } else { json!({}) },
        "applications": apps,
        "target_capacity": Value::Null,
        "deploy_error": st.get("declared_error").cloned().unwrap_or(Value::Null),
    });
    (StatusCode::OK, [(header::CONTENT_TYPE, "application/json")], body.to_string()).into_response()
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
