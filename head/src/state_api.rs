//! Ray 2.60's state API over HTTP (`/api/v0/{resource}` and
//! `/api/v0/{tasks,actors,objects}/summarize`, `ray/dashboard/state_api_utils.py`), so
//! `ray.util.state`, `ray list|get|summary --address http://HEAD:8265`,
//! `tpuray.util.state` and `tpuray list|get|summary` read the same rows.
//!
//! STATE-1: rows carry Ray's column names (`ray/util/state/common.py`: `TaskState`,
//! `ActorState`, `NodeState`, `PlacementGroupState`, `JobState`, `WorkerState`,
//! `ObjectState`); without `detail` only Ray's default columns are sent.
//! STATE-2: filters (`filter_keys`/`filter_predicates`/`filter_values`, `=` and `!=`,
//! strings compared without case, as Ray's `do_filter`) are applied to every row the
//! head has before `limit` cuts the answer (ray#50378), and the answer says how many rows
//! there were (`total`), how many the source kept (`num_after_truncation`: less than
//! `total` when the head's bounded task table dropped some) and how many matched
//! (`num_filtered`), with a warning when `limit` cut the matches.
//!
//! The filter is `row_matches`, which `tpuray list --filter` shares.
//! `partial_failure_warning` names the node agents that did not answer (workers and
//! objects are read from them).

use std::collections::BTreeMap;
use std::sync::Arc;

use axum::Router;
use axum::extract::{Path, RawQuery, State};
use axum::http::{StatusCode, header};
use axum::response::{IntoResponse, Response};
use axum::routing::get;
use serde_json::{Value, json};
use tpuray_proto::pb;

use crate::http::Api;

mod rows;
pub(crate) use rows::host;
pub use rows::ray_task_state;
use rows::*;

/// Ray's default `limit` (`DEFAULT_LIMIT`).
const DEFAULT_LIMIT: usize = 100;
/// Ray's `RAY_MAX_LIMIT_FROM_API_SERVER` default.
const MAX_LIMIT: usize = 10_000;

/// A column of a state schema: (name, detail only, filterable), in Ray's order.
type Column = (&'static str, bool, bool);

const TASK: &[Column] = &[
    ("task_id", false, true),
    ("attempt_number", false, true),
    ("name", false, true),
    ("state", false, true),
    ("job_id", false, true),
    ("actor_id", false, true),
    ("type", false, true),
    ("func_or_class_name", false, true),
    ("parent_task_id", false, true),
    ("node_id", false, true),
    ("worker_id", false, true),
    ("worker_pid", false, true),
    ("error_type", false, true),
    ("language", true, true),
    ("required_resources", true, false),
    ("runtime_env_info", true, false),
    ("placement_group_id", true, true),
    ("events", true, false),
    ("profiling_data", true, false),
    ("creation_time_ms", true, false),
    ("start_time_ms", true, false),
    ("end_time_ms", true, false),
    ("task_log_info", true, false),
    ("error_message", true, false),
    ("is_debugger_paused", true, true),
    ("call_site", true, false),
    ("label_selector", true, false),
    ("fallback_strategy", true, false),
];
const ACTOR: &[Column] = &[
    ("actor_id", false, true),
    ("class_name", false, true),
    ("state", false, true),
    ("job_id", false, true),
    ("name", false, true),
    ("node_id", false, true),
    ("pid", false, true),
    ("ray_namespace", false, true),
    ("serialized_runtime_env", true, false),
    ("required_resources", true, false),
    ("death_cause", true, false),
    ("is_detached", true, false),
    ("placement_group_id", true, true),
    ("repr_name", true, true),
    ("num_restarts", true, false),
    ("num_restarts_due_to_lineage_reconstruction", true, false),
    ("num_restarts_due_to_node_preemption", true, false),
    ("call_site", true, false),
    ("label_selector", true, false),
    ("fallback_strategy", true, false),
];
const NODE: &[Column] = &[
    ("node_id", false, true),
    ("node_ip", false, true),
    ("is_head_node", false, true),
    ("state", false, true),
    ("state_message", false, false),
    ("node_name", false, true),
    ("resources_total", false, false),
    ("labels", false, false),
    ("start_time_ms", true, false),
    ("end_time_ms", true, false),
];
const PLACEMENT_GROUP: &[Column] = &[
    ("placement_group_id", false, true),
    ("name", false, true),
    ("creator_job_id", false, true),
    ("state", false, true),
    ("bundles", true, false),
    ("is_detached", true, true),
    ("stats", true, false),
    ("topology_strategy", true, false),
    ("topology_assignments", true, false),
];
const JOB: &[Column] = &[
    ("job_id", false, true),
    ("submission_id", false, true),
    ("entrypoint", false, false),
    ("type", false, true),
    ("status", false, true),
    ("message", false, false),
    ("error_type", false, false),
    ("driver_info", false, false),
    ("start_time", true, false),
    ("end_time", true, false),
    ("metadata", true, false),
    ("runtime_env", true, false),
    ("driver_agent_http_address", true, false),
    ("driver_node_id", true, false),
    ("driver_exit_code", true, false),
];
const WORKER: &[Column] = &[
    ("worker_id", false, true),
    ("is_alive", false, true),
    ("worker_type", false, true),
    ("exit_type", false, true),
    ("node_id", false, true),
    ("ip", false, true),
    ("pid", false, true),
    ("exit_detail", true, false),
    ("worker_launch_time_ms", true, false),
    ("worker_launched_time_ms", true, false),
    ("start_time_ms", true, false),
    ("end_time_ms", true, false),
    ("debugger_port", true, true),
    ("num_paused_threads", true, true),
];
const OBJECT: &[Column] = &[
    ("object_id", false, true),
    ("object_size", false, true),
    ("task_status", false, true),
    ("attempt_number", false, true),
    ("reference_type", false, true),
    ("call_site", false, true),
    ("type", false, true),
    ("pid", false, true),
    ("ip", false, true),
];

fn schema(resource: &str) -> Option<&'static [Column]> {
    Some(match resource {
        "tasks" => TASK,
        "actors" => ACTOR,
        "nodes" => NODE,
        "placement_groups" => PLACEMENT_GROUP,
        "jobs" => JOB,
        "workers" => WORKER,
        "objects" => OBJECT,
        _ => return None,
    })
}

pub(crate) fn routes() -> Router<Arc<Api>> {
    Router::new()
        .route("/api/v0/{resource}", get(list))
        .route("/api/v0/{resource}/summarize", get(summarize))
}

/// Ray's answer envelope (`rest_response` without google-style keys).
pub(crate) fn reply(code: StatusCode, msg: &str, result: Value) -> Response {
    let body = json!({"result": code == StatusCode::OK, "msg": msg, "data": {"result": result}});
    (code, [(header::CONTENT_TYPE, "application/json")], body.to_string()).into_response()
}

fn bad(msg: impl Into<String>) -> Response {
    reply(StatusCode::BAD_REQUEST, &msg.into(), Value::Null)
}

/// The query's pairs, in order (repeated keys kept).
pub(crate) fn pairs(q: Option<&str>) -> Vec<(String, String)> {
    let decode = |s: &str| {
        percent_encoding::percent_decode_str(&s.replace('+', " ")).decode_utf8_lossy().into_owned()
    };
    q.unwrap_or("")
        .split('&')
        .filter(|p| !p.is_empty())
        .map(|p| match p.split_once('=') {
            Some((k, v)) => (decode(k), decode(v)),
            None => (decode(p), String::new()),
        })
        .collect()
}

/// A list request's options, checked as Ray's `options_from_req` checks them.
#[derive(Debug)]
struct Options {
    limit: usize,
    detail: bool,
    filters: Vec<(String, String, String)>,
}

fn options(q: &[(String, String)]) -> Result<Options, String> {
    let all =
        |k: &str| q.iter().filter(|(kk, _)| kk == k).map(|(_, v)| v.clone()).collect::<Vec<_>>();
    let one = |k: &str| q.iter().find(|(kk, _)| kk == k).map(|(_, v)| v.clone());
    let limit = match one("limit") {
        None => DEFAULT_LIMIT,
        Some(v) => v.parse::<usize>().map_err(|_| format!("limit {v:?} is not a whole number"))?,
    };
    if limit > MAX_LIMIT {
        return Err(format!(
            "Given limit {limit} exceeds the supported limit {MAX_LIMIT}. Use a lower limit."
        ));
    }
    let detail = one("detail").is_some_and(|v| matches!(v.to_lowercase().as_str(), "true" | "1"));
    let (keys, preds, vals) = (all("filter_keys"), all("filter_predicates"), all("filter_values"));
    if keys.len() != vals.len() || keys.len() != preds.len() {
        return Err(format!(
            "filters need as many filter_keys, filter_predicates and filter_values (got {}, {}, {})",
            keys.len(),
            preds.len(),
            vals.len()
        ));
    }
    let filters = keys.into_iter().zip(preds).zip(vals).map(|((k, p), v)| (k, p, v)).collect();
    Ok(Options { limit, detail, filters })
}

/// Whether `row` passes every filter (Ray's `do_filter`).
fn matches(
    row: &Value,
    filters: &[(String, String, String)],
    columns: &[Column],
) -> Result<bool, String> {
    for (key, _, _) in filters {
        let col = key.to_lowercase();
        if !columns.iter().any(|(n, _, f)| *n == col && *f) {
            let filterable: Vec<&str> = columns.iter().filter(|c| c.2).map(|c| c.0).collect();
            return Err(format!(
                "The given filter column {col} is not supported. Enter filters with --filter key=value or \
                 --filter key!=value Supported filter columns: {filterable:?}"
            ));
        }
    }
    row_matches(row, filters)
}

/// Whether a JSON row passes every `(key, "=" | "!=", value)` filter, with Ray's value
/// rules (`do_filter`): strings compare without case, booleans take `true`/`1`/
/// `false`/`0`, numbers parse, a null or missing field equals nothing. Shared with the
/// CLI's `tpuray list --filter`.
///
/// # Errors
/// A message for an unknown predicate or a value of the wrong type for its field.
pub fn row_matches(row: &Value, filters: &[(String, String, String)]) -> Result<bool, String> {
    for (key, pred, want) in filters {
        let col = key.to_lowercase();
        let got = &row[col.as_str()];
        let equal = match got {
            Value::String(s) => s.to_lowercase() == want.to_lowercase(),
            Value::Bool(b) => match want.to_lowercase().as_str() {
                "true" | "1" => *b,
                "false" | "0" => !*b,
                _ => {
                    return Err(format!(
                        "Invalid filter `--filter {col} {want}` for a boolean type column"
                    ));
                }
            },
            Value::Number(n) => match want.parse::<f64>() {
                Ok(w) => n.as_f64() == Some(w),
                Err(_) => {
                    return Err(format!(
                        "Invalid filter `--filter {col} {want}` for a number type column"
                    ));
                }
            },
            Value::Null => false,
            other => *other == Value::String(want.clone()),
        };
        let keep = match pred.as_str() {
            "=" => equal,
            "!=" => !equal,
            other => {
                return Err(format!(
                    "Unsupported filter predicate {other} is given. Available predicates: =, !="
                ));
            }
        };
        if !keep {
            return Ok(false);
        }
    }
    Ok(true)
}

/// Only the columns `detail` asks for, in the schema's order.
fn project(row: &Value, columns: &[Column], detail: bool) -> Value {
    let mut out = serde_json::Map::new();
    for (name, only_detail, _) in columns {
        if detail || !only_detail {
            out.insert((*name).into(), row.get(*name).cloned().unwrap_or(Value::Null));
        }
    }
    Value::Object(out)
}

async fn list(
    State(api): State<Arc<Api>>,
    Path(resource): Path<String>,
    RawQuery(q): RawQuery,
) -> Response {
    let Some(columns) = schema(&resource) else {
        return bad(format!(
            "tpuray has no state listing of {resource:?} (it has tasks, actors, nodes, placement_groups, jobs, workers, objects)"
        ));
    };
    let opts = match options(&pairs(q.as_deref())) {
        Ok(o) => o,
        Err(e) => return bad(e),
    };
    let Fetched { rows, total: source_total, unreachable } = match fetch(&api, &resource).await {
        Ok(r) => r,
        Err(e) => return reply(StatusCode::INTERNAL_SERVER_ERROR, &e, Value::Null),
    };
    let kept = rows.len();
    let mut matched = Vec::new();
    for row in &rows {
        match matches(row, &opts.filters, columns) {
            Ok(true) => matched.push(row),
            Ok(false) => {}
            Err(e) => return bad(e),
        }
    }
    let num_filtered = matched.len();
    let result: Vec<Value> =
        matched.into_iter().take(opts.limit).map(|r| project(r, columns, opts.detail)).collect();
    let mut warnings = Vec::new();
    if num_filtered > result.len() {
        warnings.push(format!(
            "{} ({num_filtered}) > limit ({}). Only {} {resource} are returned; set a higher limit to see more.",
            resource,
            opts.limit,
            result.len()
        ));
    }
    if source_total > kept {
        warnings.push(format!(
            "the head keeps the {kept} most recent {resource} of {source_total}: the oldest {} were dropped",
            source_total - kept
        ));
    }
    let partial = unreachable_warning(&unreachable);
    reply(
        StatusCode::OK,
        "",
        json!({
            "total": source_total,
            "num_after_truncation": kept,
            "num_filtered": num_filtered,
            "result": result,
            "partial_failure_warning": partial,
            "warnings": if warnings.is_empty() { Value::Null } else { json!(warnings) },
        }),
    )
}

async fn summarize(State(api): State<Arc<Api>>, Path(resource): Path<String>) -> Response {
    let Fetched { rows, total: source_total, unreachable } = match resource.as_str() {
        "tasks" | "actors" | "objects" => match fetch(&api, &resource).await {
            Ok(r) => r,
            Err(e) => return reply(StatusCode::INTERNAL_SERVER_ERROR, &e, Value::Null),
        },
        other => return bad(format!("no summary of {other:?} (tasks, actors or objects)")),
    };
    let cluster = match resource.as_str() {
        "tasks" => task_summary(&rows),
        "actors" => actor_summary(&rows),
        _ => object_summary(&rows),
    };
    reply(
        StatusCode::OK,
        "",
        json!({
            "total": source_total,
            "num_after_truncation": rows.len(),
            "num_filtered": rows.len(),
            "result": {"node_id_to_summary": {"cluster": cluster}},
            "partial_failure_warning": unreachable_warning(&unreachable),
            "warnings": Value::Null,
        }),
    )
}

/// Ray's `partial_failure_warning`: the nodes that did not answer (null when all did).
fn unreachable_warning(unreachable: &[String]) -> Value {
    if unreachable.is_empty() {
        Value::Null
    } else {
        json!(format!("some nodes did not answer: {}", unreachable.join("; ")))
    }
}

/// Ray's `TaskSummaries` by function or class name.
fn task_summary(rows: &[Value]) -> Value {
    let mut by: BTreeMap<String, (String, BTreeMap<String, u64>)> = BTreeMap::new();
    let (mut actor_tasks, mut actor_scheduled) = (0u64, 0u64);
    for r in rows {
        let name = r["func_or_class_name"].as_str().unwrap_or("").to_string();
        let ty = r["type"].as_str().unwrap_or("NORMAL_TASK").to_string();
        match ty.as_str() {
            "ACTOR_TASK" => actor_tasks += 1,
            "ACTOR_CREATION_TASK" => actor_scheduled += 1,
            _ => {}
        }
        let e = by.entry(name).or_insert_with(|| (ty, BTreeMap::new()));
        *e.1.entry(r["state"].as_str().unwrap_or("").to_string()).or_default() += 1;
    }
    let summary: serde_json::Map<String, Value> = by
        .into_iter()
        .map(|(name, (ty, counts))| {
            (name.clone(), json!({"func_or_class_name": name, "type": ty, "state_counts": counts}))
        })
        .collect();
    json!({
        "summary": summary,
        "total_tasks": rows.len(),
        "total_actor_tasks": actor_tasks,
        "total_actor_scheduled": actor_scheduled,
        "summary_by": "func_name",
    })
}

/// Ray's `ActorSummaries` by class.
fn actor_summary(rows: &[Value]) -> Value {
    let mut by: BTreeMap<String, BTreeMap<String, u64>> = BTreeMap::new();
    for r in rows {
        let class = r["class_name"].as_str().unwrap_or("").to_string();
        *by.entry(class)
            .or_default()
            .entry(r["state"].as_str().unwrap_or("").to_string())
            .or_default() += 1;
    }
    let summary: serde_json::Map<String, Value> = by
        .into_iter()
        .map(|(class, counts)| {
            (class.clone(), json!({"class_name": class, "state_counts": counts}))
        })
        .collect();
    json!({"summary": summary, "total_actors": rows.len(), "summary_by": "class"})
}

/// Ray's `ObjectSummaries` (tpuray records no call sites: one group, "disabled", as
/// Ray's without `RAY_record_ref_creation_sites`).
fn object_summary(rows: &[Value]) -> Value {
    let total_bytes: u64 = rows.iter().filter_map(|r| r["object_size"].as_u64()).sum();
    let mb = total_bytes as f64 / (1024.0 * 1024.0);
    let mut ref_types: BTreeMap<String, u64> = BTreeMap::new();
    let mut states: BTreeMap<String, u64> = BTreeMap::new();
    let mut nodes = std::collections::BTreeSet::new();
    let mut pids = std::collections::BTreeSet::new();
    for r in rows {
        *ref_types.entry(r["reference_type"].as_str().unwrap_or("").into()).or_default() += 1;
        *states.entry(r["task_status"].as_str().unwrap_or("").into()).or_default() += 1;
        nodes.insert(r["ip"].as_str().unwrap_or("").to_string());
        pids.insert(r["pid"].to_string());
    }
    let summary = if rows.is_empty() {
        json!({})
    } else {
        json!({"disabled": {
            "total_objects": rows.len(),
            "total_size_mb": mb,
            "total_num_workers": pids.len(),
            "total_num_nodes": nodes.len(),
            "task_state_counts": states,
            "ref_type_counts": ref_types,
        }})
    };
    json!({
        "summary": summary,
        "total_objects": rows.len(),
        "total_size_mb": mb,
        "callsite_enabled": false,
        "summary_by": "callsite",
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    /// STATE-2: filters compare as Ray's `do_filter` (`=`, `!=`, strings without case).
    #[test]
    fn filters_match_as_rays_do_filter() {
        let row = json!({"state": "RUNNING", "attempt_number": 0, "is_alive": true, "name": null});
        let f = |k: &str, p: &str, v: &str| vec![(k.to_string(), p.to_string(), v.to_string())];
        let cols: &[Column] = &[
            ("state", false, true),
            ("attempt_number", false, true),
            ("is_alive", false, true),
            ("name", false, true),
            ("x", true, false),
        ];
        assert!(matches(&row, &f("STATE", "=", "running"), cols).unwrap());
        assert!(!matches(&row, &f("state", "!=", "Running"), cols).unwrap());
        assert!(matches(&row, &f("attempt_number", "=", "0"), cols).unwrap());
        assert!(matches(&row, &f("is_alive", "=", "True"), cols).unwrap());
        assert!(!matches(&row, &f("name", "=", "x"), cols).unwrap());
        assert!(matches(&row, &f("name", "!=", "x"), cols).unwrap());
        assert!(matches(&row, &f("x", "=", "1"), cols).unwrap_err().contains("not supported"));
        assert!(matches(&row, &f("state", ">", "1"), cols).unwrap_err().contains("predicate"));
    }

    #[test]
    fn options_are_checked_and_repeated_filters_kept() {
        let q = pairs(Some(
            "limit=5&detail=true&filter_keys=state&filter_predicates=%3D&filter_values=RUNNING&filter_keys=name&filter_predicates=!%3D&filter_values=a+b",
        ));
        let o = options(&q).unwrap();
        assert_eq!((o.limit, o.detail), (5, true));
        assert_eq!(o.filters[1], ("name".into(), "!=".into(), "a b".into()));
        assert!(options(&pairs(Some("limit=10001"))).unwrap_err().contains("exceeds"));
        assert_eq!(options(&pairs(None)).unwrap().limit, DEFAULT_LIMIT);
    }

    /// STATE-1: without `detail` only Ray's default columns are sent.
    #[test]
    fn without_detail_only_default_columns_are_sent() {
        let row = json!({"task_id": "t", "state": "RUNNING", "language": "PYTHON"});
        let p = project(&row, TASK, false);
        assert!(p.get("language").is_none());
        assert_eq!(p["state"], "RUNNING");
        assert_eq!(project(&row, TASK, true)["language"], "PYTHON");
    }
}
