//! Ray 2.60's logs API on the head's HTTP server (`/api/v0/logs`,
//! `/api/v0/logs/{file,stream}`; `ray/dashboard/modules/state/state_head.py`,
//! `ray/dashboard/modules/log/log_manager.py`), so `tpuray logs`,
//! `tpuray.util.state.get_log`/`list_logs` and Ray's own `ray.util.state.get_log` read
//! the files of every node. The head resolves what is asked for (a file name, an
//! actor, a task attempt, a worker pid, a submission) to a node and a file, and reads it
//! from that node's agent (`ListLogs`, `ReadLog`; `worker/src/logfiles.rs`).
//!
//! - LOGS-5: parameters are Ray's `GetLogOptions` (`node_id`, `node_ip`, `filename`,
//!   `actor_id`, `task_id`, `attempt_number`, `pid`, `submission_id`, `lines` (default
//!   1000, -1 the whole file), `interval`, `suffix`, `timeout`, `media_type`,
//!   `download_filename`, `filter_ansi_code`), checked as Ray checks them; any other
//!   parameter is refused by name (400); `media_type` in the query (Ray's client sends
//!   it) must agree with the path. A resolution that finds nothing is 404 with
//!   Ray's text, a node that does not answer 503.
//! - `stream` follows the file: after its end it looks again every `interval` seconds
//!   (default 1, Ray's `DEFAULT_KEEP_ALIVE_INTERVAL_SEC`) until the client goes away.
//! - A task's output is the byte range its executor recorded (LOGS-3); an actor
//!   task's only with `RAY_ENABLE_RECORD_ACTOR_TASK_LOGGING=1` on the worker, as Ray.
//!
//! `/api/v0/logs` lists a node's files grouped as Ray's `_categorize_log_files`. The head
//! resolves an actor by its worker id and node (a dead one by its last node and pid), a
//! task attempt by the byte range its executor recorded (without
//! `RAY_ENABLE_RECORD_ACTOR_TASK_LOGGING` an actor task gets Ray's message), and reads
//! the file in pieces. Ray's own `ray.util.state.get_log` works once given the URL, but
//! Ray's client looks the URL up in its GCS, which tpuray does not serve, so `ray logs`
//! itself cannot reach a tpuray cluster.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Duration;

use axum::Router;
use axum::body::Body;
use axum::extract::{Path, RawQuery, State};
use axum::http::{StatusCode, header};
use axum::response::{IntoResponse, Response};
use axum::routing::get;
use serde_json::{Value, json};
use tpuray_proto::pb;

use crate::http::Api;
use crate::state_api::{host, pairs, reply};

/// Ray's `DEFAULT_RPC_TIMEOUT`, in seconds.
const DEFAULT_TIMEOUT_S: u64 = 30;
/// Ray's `DEFAULT_LOG_LIMIT`: lines sent when `lines` is not given.
const DEFAULT_LINES: i64 = 1000;
/// Ray's `DEFAULT_KEEP_ALIVE_INTERVAL_SEC`.
const DEFAULT_INTERVAL_S: f64 = 1.0;
/// Ray's `DEFAULT_DOWNLOAD_FILENAME`.
const DEFAULT_DOWNLOAD: &str = "file.txt";

const GET_PARAMS: &[&str] = &[
    "media_type",
    "timeout",
    "node_id",
    "node_ip",
    "filename",
    "download_filename",
    "actor_id",
    "task_id",
    "submission_id",
    "pid",
    "lines",
    "interval",
    "suffix",
    "attempt_number",
    "filter_ansi_code",
];
const LIST_PARAMS: &[&str] = &["node_id", "node_ip", "glob", "timeout"];

pub(crate) fn routes() -> Router<Arc<Api>> {
    Router::new()
        .route("/api/v0/logs", get(list_logs))
        .route("/api/v0/logs/{media_type}", get(get_log))
}

/// An answer other than the log: a status and a text.
struct Fail(StatusCode, String);

impl Fail {
    fn bad(m: impl Into<String>) -> Fail {
        Fail(StatusCode::BAD_REQUEST, m.into())
    }
    fn missing(m: impl Into<String>) -> Fail {
        Fail(StatusCode::NOT_FOUND, m.into())
    }
}

fn query(q: Option<&str>, known: &[&str]) -> Result<BTreeMap<String, String>, Fail> {
    let mut out = BTreeMap::new();
    for (k, v) in pairs(q) {
        if !known.contains(&k.as_str()) {
            return Err(Fail::bad(format!(
                "unknown parameter {k:?} (expected one of {})",
                known.join(", ")
            )));
        }
        out.insert(k, v);
    }
    Ok(out)
}

fn parse<T: std::str::FromStr>(
    q: &BTreeMap<String, String>,
    k: &str,
    what: &str,
) -> Result<Option<T>, Fail> {
    match q.get(k).filter(|v| !v.is_empty()) {
        None => Ok(None),
        Some(v) => v.parse().map(Some).map_err(|_| Fail::bad(format!("{k}={v:?} is not {what}"))),
    }
}

fn nonempty<'a>(q: &'a BTreeMap<String, String>, k: &str) -> Option<&'a str> {
    q.get(k).map(String::as_str).filter(|v| !v.is_empty())
}

/// A live node: (node id, agent address, head node).
type Node = (String, String, bool);

async fn nodes(api: &Api) -> Result<Vec<Node>, Fail> {
    let mut grpc = api.grpc.clone();
    let r = grpc.get_cluster_status(pb::GetClusterStatusRequest {}).await.map_err(|s| {
        Fail(StatusCode::SERVICE_UNAVAILABLE, format!("the head did not answer: {}", s.message()))
    })?;
    Ok(r.into_inner()
        .nodes
        .into_iter()
        .filter(|n| n.state == pb::NodeState::Alive as i32)
        .map(|n| (n.node_id, n.address, n.is_head_node))
        .collect())
}

/// The live node with this id, or with an id this prefix names alone.
fn by_id(all: &[Node], id: &str) -> Result<Node, Fail> {
    if let Some(n) = all.iter().find(|n| n.0 == id) {
        return Ok(n.clone());
    }
    let hits: Vec<&Node> = all.iter().filter(|n| n.0.starts_with(id)).collect();
    match hits.as_slice() {
        [n] => Ok((*n).clone()),
        [] => Err(Fail::missing(format!("no live node has id {id}"))),
        _ => Err(Fail::bad(format!("node id prefix {id} names {} nodes", hits.len()))),
    }
}

/// The live nodes at this address, the head node first (Ray's `ip_to_node_id` takes
/// one; several tpuray nodes can share a host).
fn by_ip(all: &[Node], ip: &str) -> Result<Vec<Node>, Fail> {
    let mut hits: Vec<Node> = all.iter().filter(|n| host(&n.1) == ip).cloned().collect();
    hits.sort_by_key(|n| !n.2);
    if hits.is_empty() {
        return Err(Fail::missing(format!(
            "Cannot find matching node_id for a given node ip {ip}"
        )));
    }
    Ok(hits)
}

/// The nodes a request names with `node_id` or `node_ip` (none when it names neither).
fn named_nodes(all: &[Node], q: &BTreeMap<String, String>) -> Result<Vec<Node>, Fail> {
    match (nonempty(q, "node_id"), nonempty(q, "node_ip")) {
        (Some(id), Some(ip)) => Err(Fail::bad(format!(
            "Both node_id and node_ip are given. Only one of them can be provided. Given node id: {id}, given node ip: {ip}"
        ))),
        (Some(id), None) => Ok(vec![by_id(all, id)?]),
        (None, Some(ip)) => by_ip(all, ip),
        (None, None) => Ok(Vec::new()),
    }
}

fn unavailable(node: &Node, e: tonic::Status) -> Fail {
    Fail(
        StatusCode::SERVICE_UNAVAILABLE,
        format!("node {} (agent {}) did not answer: {}", node.0, node.1, e.message()),
    )
}

async fn list_files(
    api: &Api,
    node: &Node,
    glob: &str,
    timeout: Duration,
) -> Result<Vec<String>, Fail> {
    let mut agent = api.head.agent_client(&node.1).map_err(|e| unavailable(node, e))?;
    let mut req = tonic::Request::new(pb::ListLogsRequest { glob: glob.to_string() });
    req.set_timeout(timeout);
    match agent.list_logs(req).await {
        Ok(r) => Ok(r.into_inner().files),
        Err(e) if e.code() == tonic::Code::InvalidArgument => Err(Fail::bad(e.message())),
        Err(e) => Err(unavailable(node, e)),
    }
}

/// Ray's `_categorize_log_files`: {group: [file, ...]}.
fn categorize(files: &[String]) -> Value {
    let mut groups: BTreeMap<&str, Vec<&str>> = BTreeMap::new();
    for f in files {
        let group = if f.contains("worker") && f.ends_with(".out") {
            "worker_out"
        } else if f.contains("worker") && f.ends_with(".err") {
            "worker_err"
        } else if f.contains("core-worker") && f.ends_with(".log") {
            "core_worker"
        } else if f.contains("core-driver") && f.ends_with(".log") {
            "driver"
        } else if f.contains("raylet.") {
            "raylet"
        } else if f.contains("gcs_server.") {
            "gcs_server"
        } else if f.contains("log_monitor") {
            "internal"
        } else if f.contains("monitor") {
            "autoscaler"
        } else if f.contains("agent.") {
            "agent"
        } else if f.contains("dashboard.") {
            "dashboard"
        } else {
            "internal"
        };
        groups.entry(group).or_default().push(f);
    }
    json!(groups)
}

async fn list_logs(State(api): State<Arc<Api>>, RawQuery(q): RawQuery) -> Response {
    match list_inner(&api, q.as_deref()).await {
        Ok(v) => reply(StatusCode::OK, "", v),
        Err(Fail(code, msg)) => reply(code, &msg, Value::Null),
    }
}

async fn list_inner(api: &Api, q: Option<&str>) -> Result<Value, Fail> {
    let q = query(q, LIST_PARAMS)?;
    let timeout = Duration::from_secs(
        parse(&q, "timeout", "a whole number of seconds")?.unwrap_or(DEFAULT_TIMEOUT_S),
    );
    let all = nodes(api).await?;
    let named = named_nodes(&all, &q)?;
    let Some(node) = named.first() else {
        return Err(Fail::bad(
            "Both node id and node ip are not provided. Please provide at least one of them.",
        ));
    };
    let glob = nonempty(&q, "glob").unwrap_or("*");
    Ok(categorize(&list_files(api, node, glob, timeout).await?))
}

/// What a request resolved to: a file on a node and the byte range to send.
#[derive(Clone)]
struct Resolved {
    node: Node,
    filename: String,
    start: u64,
    /// 0: the file's end.
    end: u64,
}

/// `worker-<worker id>-<job id>-<pid>.<suffix>` (LOGS-2): (worker id, pid).
fn worker_file(name: &str, suffix: &str) -> Option<(String, u32)> {
    let stem = name.strip_prefix("worker-")?.strip_suffix(&format!(".{suffix}"))?;
    let (rest, pid) = stem.rsplit_once('-')?;
    let (worker, _job) = rest.split_once('-')?;
    Some((worker.to_string(), pid.parse().ok()?))
}

async fn resolve(
    api: &Api,
    q: &BTreeMap<String, String>,
    timeout: Duration,
) -> Result<Resolved, Fail> {
    let suffix = q.get("suffix").map(String::as_str).unwrap_or("out");
    if suffix != "out" && suffix != "err" {
        return Err(Fail::bad(format!("Invalid suffix: {suffix}. Must be one of 'out' or 'err'.")));
    }
    let all = nodes(api).await?;
    let named = named_nodes(&all, q)?;
    let (actor, task, pid, file, sub) = (
        nonempty(q, "actor_id"),
        nonempty(q, "task_id"),
        parse::<u32>(q, "pid", "a process id")?,
        nonempty(q, "filename"),
        nonempty(q, "submission_id"),
    );
    if named.is_empty() && actor.is_none() && task.is_none() {
        return Err(Fail::bad(
            "node_id or node_ip must be provided as constructor arguments when no actor or task_id is supplied as arguments.",
        ));
    }
    let mut grpc = api.grpc.clone();
    let head_err = |s: tonic::Status| {
        Fail(StatusCode::SERVICE_UNAVAILABLE, format!("the head did not answer: {}", s.message()))
    };
    if let Some(actor) = actor {
        let actors =
            grpc.list_actors(pb::ListActorsRequest {}).await.map_err(head_err)?.into_inner().actors;
        let hits: Vec<&pb::ActorInfo> = actors
            .iter()
            .filter(|a| a.actor_id == actor || (actor.len() >= 6 && a.actor_id.starts_with(actor)))
            .collect();
        let a = match hits.as_slice() {
            [a] => *a,
            [] => return Err(Fail::missing(format!("Actor ID {actor} not found."))),
            _ => {
                return Err(Fail::bad(format!(
                    "actor id prefix {actor} names {} actors",
                    hits.len()
                )));
            }
        };
        // A dead or restarting actor has no worker id any more, but its last node and
        // pid, which name its file too (LOGS-2).
        if a.node_id.is_empty() || (a.worker_id.is_empty() && a.pid == 0) {
            return Err(Fail::missing(format!(
                "Worker ID for Actor ID {} not found. Actor is not scheduled yet.",
                a.actor_id
            )));
        }
        let node = all.iter().find(|n| n.0 == a.node_id).cloned().ok_or_else(|| {
            Fail::missing(format!(
                "actor {} ran on node {}, which is no longer alive: its log files went with it",
                a.actor_id, a.node_id
            ))
        })?;
        let (glob, by_pid) = if a.worker_id.is_empty() {
            (format!("worker-*-{}-{}.{suffix}", a.job_id, a.pid), true)
        } else {
            (format!("worker-{}-*.{suffix}", a.worker_id), false)
        };
        let files = list_files(api, &node, &glob, timeout).await?;
        let filename = files.into_iter().find(|f| {
            worker_file(f, suffix)
                .is_some_and(|w| if by_pid { w.1 == a.pid } else { w.0 == a.worker_id })
        });
        let Some(filename) = filename else {
            return Err(not_found(q, Some(&node.0)));
        };
        return Ok(Resolved { node, filename, start: 0, end: 0 });
    }
    if let Some(task) = task {
        let attempt: u32 = parse(q, "attempt_number", "a whole number")?.unwrap_or(0);
        let tasks = grpc
            .list_tasks(pb::ListTasksRequest { limit: 0 })
            .await
            .map_err(head_err)?
            .into_inner()
            .tasks;
        let hits: Vec<&pb::TaskSummary> = tasks
            .iter()
            .filter(|t| t.task_id == task || (task.len() >= 6 && t.task_id.starts_with(task)))
            .collect();
        let t = match hits.as_slice() {
            [t] => *t,
            [] => {
                return Err(Fail::missing(format!(
                    "Could not find log file for task: {task} (attempt {attempt}) with suffix: {suffix}"
                )));
            }
            _ => {
                return Err(Fail::bad(format!("task id prefix {task} names {} tasks", hits.len())));
            }
        };
        if t.attempt != attempt {
            return Err(Fail::missing(format!(
                "Could not find log file for task attempt:{}({attempt}) (its latest attempt is {})",
                t.task_id, t.attempt
            )));
        }
        if t.node_id.is_empty() {
            return Err(Fail::missing(format!(
                "Could not find log file for task attempt.{}({attempt}) due to missing node info.",
                t.task_id
            )));
        }
        let Some(info) = &t.log_info else {
            return Err(Fail::missing(if t.actor_id.is_empty() {
                format!(
                    "Could not find log file for task attempt:{}({attempt}).Worker id = {}, node id = {},log_info = None",
                    t.task_id, t.worker_id, t.node_id
                )
            } else {
                format!(
                    "For actor task, please query actor log for actor({}): e.g. ray logs actor --id {} . Or set RAY_ENABLE_RECORD_ACTOR_TASK_LOGGING=1 in actor's runtime env or when starting the cluster. Recording actor task's log could be expensive, so Ray turns it off by default.",
                    t.actor_id, t.actor_id
                )
            }));
        };
        let node = all.iter().find(|n| n.0 == t.node_id).cloned().ok_or_else(|| {
            Fail::missing(format!(
                "task {} ran on node {}, which is no longer alive: its log files went with it",
                t.task_id, t.node_id
            ))
        })?;
        let (filename, start, end) = if suffix == "out" {
            (info.stdout_file.clone(), info.stdout_start, info.stdout_end)
        } else {
            (info.stderr_file.clone(), info.stderr_start, info.stderr_end)
        };
        if info.ended && end == start {
            // It printed nothing: an empty answer, nothing to read.
            return Ok(Resolved { node, filename: String::new(), start, end });
        }
        // A task still running: to the file's end (0) for now.
        let end = if info.ended { end } else { 0 };
        return Ok(Resolved { node, filename, start, end });
    }
    if let Some(sub) = sub {
        let r = grpc
            .get_job_submission(pb::GetJobSubmissionRequest { id: sub.to_string() })
            .await
            .map_err(|s| {
                if s.code() == tonic::Code::NotFound {
                    Fail::missing(format!("Submission job ID {sub} not found."))
                } else {
                    head_err(s)
                }
            })?;
        let Some(job) = r.into_inner().job else {
            return Err(Fail::missing(format!("Submission job ID {sub} not found.")));
        };
        let node = all.iter().find(|n| n.0 == job.driver_node_id).cloned().ok_or_else(|| {
            Fail::missing(format!(
                "job {sub} has no driver on a live node (driver node: {:?})",
                job.driver_node_id
            ))
        })?;
        return Ok(Resolved {
            node,
            filename: format!("job-driver-{}.log", job.submission_id),
            start: 0,
            end: 0,
        });
    }
    if let Some(pid) = pid {
        if named.is_empty() {
            return Err(Fail::bad(format!(
                "Node id needs to be specified for resolving filenames of pid {pid}"
            )));
        }
        for node in &named {
            let files = list_files(api, node, &format!("worker-*-{pid}.{suffix}"), timeout).await?;
            if let Some(f) =
                files.into_iter().find(|f| worker_file(f, suffix).is_some_and(|w| w.1 == pid))
            {
                return Ok(Resolved { node: node.clone(), filename: f, start: 0, end: 0 });
            }
        }
        return Err(not_found(q, named.first().map(|n| n.0.as_str())));
    }
    let Some(file) = file else {
        return Err(Fail::bad(
            "None of actor_id, task_id, pid, submission_id or filename is provided. At least one of them is required to fetch logs.",
        ));
    };
    // The first named node holding the file (nodes on one host hold different files).
    for node in &named {
        if list_files(api, node, &globset::escape(file), timeout).await?.iter().any(|f| f == file) {
            return Ok(Resolved {
                node: node.clone(),
                filename: file.to_string(),
                start: 0,
                end: 0,
            });
        }
    }
    Err(not_found(q, named.first().map(|n| n.0.as_str())))
}

/// Ray's "Could not find a log file" answer, naming what was asked.
fn not_found(q: &BTreeMap<String, String>, node: Option<&str>) -> Fail {
    let g = |k: &str| q.get(k).cloned().unwrap_or_else(|| "None".into());
    Fail::missing(format!(
        "Could not find a log file. Please make sure the given option exists in the cluster.\n\tnode_id: {}\n\tfilename: {}\n\tactor_id: {}\n\ttask_id: {}\n\tpid: {}\n\tsuffix: {}\n\tsubmission_id: {}\n\tattempt_number: {}\n",
        node.unwrap_or("None"),
        g("filename"),
        g("actor_id"),
        g("task_id"),
        g("pid"),
        q.get("suffix").cloned().unwrap_or_else(|| "out".into()),
        g("submission_id"),
        q.get("attempt_number").cloned().unwrap_or_else(|| "0".into()),
    ))
}

/// Drops `ESC [ digits/; m` sequences (Ray's `ANSI_ESC_PATTERN`).
fn strip_ansi(data: &[u8]) -> Vec<u8> {
    let mut out = Vec::with_capacity(data.len());
    let mut i = 0;
    while i < data.len() {
        if data[i] == 0x1b && data.get(i + 1) == Some(&b'[') {
            let mut j = i + 2;
            while j < data.len() && (data[j].is_ascii_digit() || data[j] == b';') {
                j += 1;
            }
            if j > i + 2 && data.get(j) == Some(&b'm') {
                i = j + 1;
                continue;
            }
        }
        out.push(data[i]);
        i += 1;
    }
    out
}

async fn get_log(
    State(api): State<Arc<Api>>,
    Path(media_type): Path<String>,
    RawQuery(q): RawQuery,
) -> Response {
    match get_inner(api, &media_type, q.as_deref()).await {
        Ok(r) => r,
        Err(Fail(code, msg)) => {
            (code, [(header::CONTENT_TYPE, "text/plain; charset=utf-8")], msg).into_response()
        }
    }
}

async fn get_inner(api: Arc<Api>, media_type: &str, q: Option<&str>) -> Result<Response, Fail> {
    let q = query(q, GET_PARAMS)?;
    let follow = match media_type {
        "file" => false,
        "stream" => true,
        other => return Err(Fail::bad(format!("Invalid media type: {other}"))),
    };
    // Ray's client repeats the path's media type in the query.
    if let Some(m) = nonempty(&q, "media_type")
        && m != media_type
    {
        return Err(Fail::bad(format!(
            "media_type={m} in the query but /{media_type} in the path"
        )));
    }
    let timeout = Duration::from_secs(
        parse(&q, "timeout", "a whole number of seconds")?.unwrap_or(DEFAULT_TIMEOUT_S),
    );
    let lines: i64 = parse(&q, "lines", "a whole number of lines")?.unwrap_or(DEFAULT_LINES);
    let interval: Option<f64> = parse(&q, "interval", "a number of seconds")?;
    if interval.is_some() && !follow {
        return Err(Fail::bad("interval is only for following a log (media type stream)"));
    }
    let interval = interval.unwrap_or(DEFAULT_INTERVAL_S);
    if !(interval > 0.0 && interval.is_finite()) {
        return Err(Fail::bad(format!(
            "interval must be a positive number of seconds, got {interval}"
        )));
    }
    let ansi = q.get("filter_ansi_code").is_some_and(|v| v.eq_ignore_ascii_case("true"));
    let download = q.get("download_filename").cloned().unwrap_or_else(|| DEFAULT_DOWNLOAD.into());
    let r = resolve(&api, &q, timeout).await?;
    // The first piece before answering, so a node that cannot read it answers with an error.
    let first = if r.filename.is_empty() {
        None
    } else {
        Some(read_piece(&api, &r, r.start, lines, timeout).await?)
    };
    let (tx, rx) = tokio::sync::mpsc::channel::<Result<Vec<u8>, std::io::Error>>(4);
    tokio::spawn(async move {
        let Some(first) = first else { return };
        let send = |data: Vec<u8>| {
            let data = if ansi { strip_ansi(&data) } else { data };
            tx.send(Ok(data))
        };
        let mut at = first.offset + first.data.len() as u64;
        // `file` sends up to the range's end as it was when asked; `stream` goes on
        // past it (Ray's keep-alive reads beyond the end offset).
        let range = Resolved {
            end: if follow {
                0
            } else if r.end == 0 {
                first.size
            } else {
                r.end
            },
            ..r
        };
        if !first.data.is_empty() && send(first.data).await.is_err() {
            return;
        }
        loop {
            if !follow && at >= range.end {
                return;
            }
            let piece = match read_piece(&api, &range, at, -1, timeout).await {
                Ok(p) => p,
                Err(Fail(_, msg)) => {
                    let _ = tx.send(Err(std::io::Error::other(msg))).await;
                    return;
                }
            };
            if piece.data.is_empty() {
                if !follow || tx.is_closed() {
                    return;
                }
                tokio::time::sleep(Duration::from_secs_f64(interval)).await;
                continue;
            }
            at = piece.offset + piece.data.len() as u64;
            if send(piece.data).await.is_err() {
                return;
            }
        }
    });
    let body = Body::from_stream(tokio_stream::wrappers::ReceiverStream::new(rx));
    Ok((
        StatusCode::OK,
        [
            (header::CONTENT_TYPE, "text/plain".to_string()),
            (header::CONTENT_DISPOSITION, format!("attachment; filename=\"{download}\"")),
        ],
        body,
    )
        .into_response())
}

async fn read_piece(
    api: &Api,
    r: &Resolved,
    start: u64,
    lines: i64,
    timeout: Duration,
) -> Result<pb::ReadLogReply, Fail> {
    let mut agent = api.head.agent_client(&r.node.1).map_err(|e| unavailable(&r.node, e))?;
    let mut req = tonic::Request::new(pb::ReadLogRequest {
        filename: r.filename.clone(),
        start,
        end: r.end,
        lines,
        max_bytes: 0,
    });
    req.set_timeout(timeout);
    let reply = match agent.read_log(req).await {
        Ok(r) => r.into_inner(),
        Err(e) if e.code() == tonic::Code::InvalidArgument => return Err(Fail::bad(e.message())),
        Err(e) => return Err(unavailable(&r.node, e)),
    };
    if !reply.found {
        return Err(Fail::missing(format!("no log file {} on node {}", r.filename, r.node.0)));
    }
    Ok(reply)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn worker_file_names_give_the_worker_and_pid() {
        assert_eq!(
            worker_file("worker-abc123-def456-4242.out", "out"),
            Some(("abc123".to_string(), 4242))
        );
        assert_eq!(worker_file("worker-abc123-def456-4242.out", "err"), None);
        assert_eq!(worker_file("agent.out", "out"), None);
    }

    #[test]
    fn ansi_colour_codes_are_dropped_and_other_text_kept() {
        assert_eq!(strip_ansi(b"\x1b[36m(f pid=1)\x1b[0m hi \x1b[x"), b"(f pid=1) hi \x1b[x");
    }

    #[test]
    fn files_group_as_rays_categories() {
        let v = categorize(&[
            "worker-a-b-1.out".into(),
            "worker-a-b-1.err".into(),
            "agent.out".into(),
            "head.err".into(),
        ]);
        assert_eq!(v["worker_out"], json!(["worker-a-b-1.out"]));
        assert_eq!(v["worker_err"], json!(["worker-a-b-1.err"]));
        assert_eq!(v["agent"], json!(["agent.out"]));
        assert_eq!(v["internal"], json!(["head.err"]));
    }
}
