//! `tpuray serve status`: prints the state that the `tpuray.serve` controller keeps in
//! the head's KV (namespace `serve`, key `status`, one JSON document) in the YAML-ish
//! form of Ray's `serve status`: proxies, then each application with its deployments
//! and each deployment's replicas.
//!
//! The document's shape (written by `python/tpuray/serve/_controller.py`):
//! `{"controller": {"updated_at": unix s, ...}, "proxies": {node: state},
//! "http": {"host", "port"}, "applications": {name: {"status", "message",
//! "route_prefix", "ingress", "last_deployed_time_s", "deployments": {name: {"status",
//! "status_trigger", "message", "target_replicas", "replica_states": {state: n},
//! "replicas": [{"replica_id", "state", "actor_id", "node_id", "pid"}],
//! "autoscaling": null | {...}}}}}}`. Fields it does not know are printed as they come.

use std::time::{Duration, SystemTime, UNIX_EPOCH};

use anyhow::{Context, Result, anyhow};
use serde_json::Value;
use tpuray_proto::pb;

/// KV namespace and key of the controller's status document.
pub const SERVE_NAMESPACE: &str = "serve";
pub const STATUS_KEY: &[u8] = b"status";

/// Seconds after which a status the controller has not refreshed is called stale (it
/// refreshes every 2 s while alive).
const STALE_AFTER_S: f64 = 15.0;

/// Reads the status document from the head at `address` and prints it (or, with
/// `json`, prints the document itself). Returns the exit code: 0, also when no serve
/// application is running (a message says so).
pub fn status(address: &str, json: bool) -> Result<i32> {
    let rt = tokio::runtime::Builder::new_current_thread().enable_all().build()?;
    let doc = rt.block_on(async {
        let token = tpuray_proto::auth::load_token()?;
        let mut head = tpuray_proto::client::head(address, token.as_deref())?;
        let mut req = tonic::Request::new(pb::KvGetRequest {
            namespace: SERVE_NAMESPACE.into(),
            key: STATUS_KEY.to_vec(),
        });
        req.set_timeout(Duration::from_secs(10));
        let reply = head.kv_get(req).await.map_err(|s| {
            match tpuray_proto::tls::why_failed(address, "head", &s) {
                Some(why) => anyhow!(why),
                None => anyhow!("the head at {address} answered {:?}: {}", s.code(), s.message()),
            }
        })?;
        Ok::<_, anyhow::Error>(reply.into_inner())
    })?;
    if !doc.found {
        println!(
            "no serve application is running on the cluster at {address} (no serve controller has started there; start one with serve.run)"
        );
        return Ok(0);
    }
    let v: Value = serde_json::from_slice(&doc.value)
        .context("the serve status in the head's KV (namespace serve, key status) is not JSON")?;
    if json {
        println!("{}", serde_json::to_string_pretty(&v)?);
        return Ok(0);
    }
    let now = SystemTime::now().duration_since(UNIX_EPOCH).map(|d| d.as_secs_f64()).unwrap_or(0.0);
    print!("{}", render(&v, now));
    Ok(0)
}

/// The YAML-ish text of a status document, `now` in Unix seconds (for staleness).
pub fn render(v: &Value, now: f64) -> String {
    let mut out = String::new();
    let controller = &v["controller"];
    let stopped = controller["state"].as_str() == Some("STOPPED");
    let apps = v["applications"].as_object();
    if stopped || apps.is_none_or(|a| a.is_empty()) {
        out.push_str("no serve application is running");
        if stopped {
            out.push_str(" (serve was shut down)");
        }
        out.push('\n');
        return out;
    }
    if let Some(t) = controller["updated_at"].as_f64()
        && now - t > STALE_AFTER_S
    {
        out.push_str(&format!(
            "# the serve controller last reported {:.0} s ago: it may be dead; what follows may be stale\n",
            now - t
        ));
    }
    out.push_str("proxies:\n");
    match v["proxies"].as_object() {
        Some(p) if !p.is_empty() => {
            for (node, state) in p {
                out.push_str(&format!("  {node}: {}\n", scalar(state)));
            }
        }
        _ => out.push_str("  {}\n"),
    }
    if let (Some(h), Some(p)) = (v["http"]["host"].as_str(), v["http"]["port"].as_u64()) {
        out.push_str(&format!("http: {h}:{p}\n"));
    }
    out.push_str("applications:\n");
    for (name, app) in apps.into_iter().flatten() {
        out.push_str(&format!("  {name}:\n"));
        for key in ["status", "message", "route_prefix", "ingress", "last_deployed_time_s"] {
            if let Some(x) = app.get(key) {
                out.push_str(&format!("    {key}: {}\n", scalar(x)));
            }
        }
        out.push_str("    deployments:\n");
        for (dname, d) in app["deployments"].as_object().into_iter().flatten() {
            out.push_str(&format!("      {dname}:\n"));
            for key in ["status", "status_trigger", "target_replicas", "message"] {
                if let Some(x) = d.get(key) {
                    out.push_str(&format!("        {key}: {}\n", scalar(x)));
                }
            }
            out.push_str("        replica_states:\n");
            match d["replica_states"].as_object() {
                Some(s) if !s.is_empty() => {
                    for (state, n) in s {
                        out.push_str(&format!("          {state}: {}\n", scalar(n)));
                    }
                }
                _ => out.push_str("          {}\n"),
            }
            if let Some(a) = d["autoscaling"].as_object() {
                out.push_str("        autoscaling:\n");
                for (k, x) in a {
                    out.push_str(&format!("          {k}: {}\n", scalar(x)));
                }
            }
            if let Some(rs) = d["replicas"].as_array()
                && !rs.is_empty()
            {
                out.push_str("        replicas:\n");
                for r in rs {
                    let Some(fields) = r.as_object() else { continue };
                    // The id and state first, then whatever else the controller reports.
                    let lead_keys = ["replica_id", "state", "node_id", "pid", "actor_id"];
                    let ordered = lead_keys
                        .iter()
                        .filter_map(|k| fields.get_key_value(*k))
                        .chain(fields.iter().filter(|(k, _)| !lead_keys.contains(&k.as_str())));
                    for (i, (k, x)) in ordered.enumerate() {
                        let lead = if i == 0 { "          - " } else { "            " };
                        out.push_str(&format!("{lead}{k}: {}\n", scalar(x)));
                    }
                }
            }
        }
    }
    out
}

/// One value as YAML writes a scalar: strings bare unless empty or ambiguous, others as
/// JSON.
fn scalar(v: &Value) -> String {
    match v {
        Value::String(s) => {
            let plain = !s.is_empty()
                && !s.contains([':', '#', '\n', '\'', '"', '{', '}', '[', ']'])
                && !s.starts_with([' ', '-', '*', '&', '!', '|', '>', '%', '@'])
                && !s.ends_with(' ')
                && s.parse::<f64>().is_err()
                && !matches!(s.as_str(), "true" | "false" | "null" | "~");
            if plain { s.clone() } else { format!("'{}'", s.replace('\'', "''")) }
        }
        Value::Null => "null".into(),
        other => other.to_string(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn a_running_app_prints_its_deployments_and_replicas() {
        let v = json!({
            "controller": {"updated_at": 100.0, "state": "RUNNING"},
            "proxies": {"n1": "HEALTHY"},
            "http": {"host": "127.0.0.1", "port": 8000},
            "applications": {"default": {
                "status": "RUNNING", "message": "", "route_prefix": "/",
                "deployments": {"Model": {
                    "status": "HEALTHY", "replica_states": {"RUNNING": 2},
                    "replicas": [{"state": "RUNNING", "pid": 7, "replica_id": "abc", "extra": 1}]
                }}
            }}
        });
        let s = render(&v, 101.0);
        assert!(s.contains("http: 127.0.0.1:8000\n"), "{s}");
        assert!(s.contains("    status: RUNNING\n    message: ''\n    route_prefix: /\n"), "{s}");
        assert!(s.contains("      Model:\n        status: HEALTHY\n"), "{s}");
        assert!(s.contains("          RUNNING: 2\n"), "{s}");
        assert!(
            s.contains("          - replica_id: abc\n            state: RUNNING\n            pid: 7\n            extra: 1\n"),
            "{s}"
        );
        assert!(!s.contains("stale"), "{s}");
    }

    #[test]
    fn no_applications_or_a_stopped_controller_says_nothing_runs() {
        assert!(render(&json!({"applications": {}}), 0.0).starts_with("no serve application"));
        let s = render(&json!({"controller": {"state": "STOPPED"}, "applications": {}}), 0.0);
        assert!(s.contains("shut down"), "{s}");
    }

    #[test]
    fn an_old_status_is_marked_stale() {
        let v = json!({"controller": {"updated_at": 0.0},
                       "applications": {"a": {"status": "RUNNING", "deployments": {}}}});
        assert!(render(&v, 100.0).contains("may be stale"));
    }

    #[test]
    fn scalars_are_quoted_when_yaml_would_misread_them() {
        assert_eq!(scalar(&json!("")), "''");
        assert_eq!(scalar(&json!("a: b")), "'a: b'");
        assert_eq!(scalar(&json!("12")), "'12'");
        assert_eq!(scalar(&json!("it's")), "'it''s'");
        assert_eq!(scalar(&json!("plain")), "plain");
        assert_eq!(scalar(&json!(3)), "3");
    }
}
