//! The head's HTTP server on the dashboard port (DESIGN.md §13, HTTP-1..3), built on
//! axum. Routes now: health (`/healthz`, `/readyz`, Ray's `/api/gcs_healthz` and
//! `/api/healthz`), Prometheus's `/metrics` (`metrics.rs`) and Ray
//! 2.60's Jobs REST API (`ray/dashboard/modules/job/job_head.py`), so Ray's own
//! `JobSubmissionClient` and `ray job ...` work against tpuray unchanged. The dashboard's
//! pages (`dashboard.rs`) and Serve's REST API (`serve_api.rs`) join [`router`].
//!
//! - HTTP-1: every head serves it. The Jobs API calls the head cluster through a
//!   leader-following gRPC client (CLIENT-1), so on a head that is not the serving
//!   leader it reaches the leader without a redirect the HTTP client would have to follow.
//! - HTTP-2: with token auth on, every route except the health ones and `/metrics`
//!   (METRICS-1) needs the cluster token as `Authorization: Bearer <token>` (or Ray's
//!   `X-Ray-Authorization` header, or its `ray-authentication-token` cookie); a missing
//!   token is 401, a wrong one 403, with Ray's texts
//!   (`ray/_private/authentication/http_token_authentication.py`).
//! - HTTP-3: a request the API cannot serve gets a status and a text body that names
//!   what was wrong (Ray's client shows the body); no request stops the head.
//!
//! The port is `--dashboard-port` (default 8265; a free port with a warning when the
//! default is taken, an error when a given one is) on `--dashboard-host` (default: where
//! the gRPC server binds, NET-3). The Jobs API routes include `/api/version` (answering
//! `ray_version` 2.60.0; `/api/ray/version` answers the same for Ray's Serve client),
//! `/api/packages/gcs/<name>`, `/api/jobs/...` and the WebSocket log tail. HTTP-2 covers
//! Serve's REST API (`serve_api.rs`, SERVE-API-1..3) too. HTTP-3 examples: unknown fields
//! of Ray's `JobSubmitRequest`, runtime-environment fields tpuray does not honour,
//! packages never uploaded; Ray's client's `_ray_commit` key is the one field dropped
//! without effect. Packages live in the KV in 8 MiB chunks (`tpuray_proto::packages`).

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use axum::Router;
use axum::body::Bytes;
use axum::extract::ws::{Message, WebSocket, WebSocketUpgrade};
use axum::extract::{Path, Request, State};
use axum::http::{HeaderMap, StatusCode, header};
use axum::middleware::{self, Next};
use axum::response::{IntoResponse, Response};
use axum::routing::get;
use serde::Deserialize;
use serde_json::{Value, json};
use tonic::Code;
use tpuray_proto::client::AuthChannel;
use tpuray_proto::packages::{self, PACKAGES_NAMESPACE};
use tpuray_proto::pb;
use tpuray_proto::pb::head_service_client::HeadServiceClient;
use tpuray_proto::runtime_env::JobRuntimeEnv;

use crate::server::Head;

/// The Ray version whose API this server speaks (the client refuses older ones).
pub const RAY_API_VERSION: &str = "2.60.0";
/// Ray's Jobs API version (`ray/dashboard/modules/version.py`, `CURRENT_VERSION`).
const JOBS_API_VERSION: &str = "4";
/// How often a log tail looks for new bytes.
const TAIL_POLL: Duration = Duration::from_millis(200);

/// What the handlers share.
pub(crate) struct Api {
    pub(crate) head: Arc<Head>,
    /// Leader-following client of the head cluster (HTTP-1).
    pub(crate) grpc: HeadServiceClient<AuthChannel>,
    pub(crate) token: Option<String>,
    pub(crate) auth_required: bool,
}

type Shared = State<Arc<Api>>;

/// An error answer: a status and a text body.
struct Fail(StatusCode, String);

impl IntoResponse for Fail {
    fn into_response(self) -> Response {
        (self.0, [(header::CONTENT_TYPE, "text/plain; charset=utf-8")], self.1).into_response()
    }
}

impl From<tonic::Status> for Fail {
    fn from(s: tonic::Status) -> Self {
        let code = match s.code() {
            Code::NotFound => StatusCode::NOT_FOUND,
            Code::InvalidArgument | Code::AlreadyExists | Code::FailedPrecondition => {
                StatusCode::BAD_REQUEST
            }
            Code::OutOfRange => StatusCode::PAYLOAD_TOO_LARGE,
            Code::Unavailable | Code::DeadlineExceeded => StatusCode::SERVICE_UNAVAILABLE,
            Code::Unauthenticated => StatusCode::UNAUTHORIZED,
            Code::PermissionDenied => StatusCode::FORBIDDEN,
            _ => StatusCode::INTERNAL_SERVER_ERROR,
        };
        Fail(code, s.message().to_string())
    }
}

fn json_ok(v: Value) -> Response {
    (StatusCode::OK, [(header::CONTENT_TYPE, "application/json")], v.to_string()).into_response()
}

/// The router for `head`; `addresses` are every head's gRPC address.
///
/// # Errors
/// A message when a head address is malformed.
pub(crate) fn router(head: Arc<Head>, addresses: &str) -> Result<Router, String> {
    let token = head.config.token.clone();
    let grpc =
        tpuray_proto::client::head(addresses, token.as_deref()).map_err(|e| e.to_string())?;
    let api = Arc::new(Api { auth_required: head.config.auth_required, head, grpc, token });
    let jobs = Router::new()
        .route("/api/version", get(version))
        // Ray's Serve client checks this one (`ray/dashboard/modules/serve/sdk.py`).
        .route("/api/ray/version", get(version))
        .route("/api/packages/{protocol}/{name}", get(package_exists).put(upload_package))
        .route("/api/jobs/", get(list_jobs).post(submit_job))
        .route("/api/jobs/{id}", get(job_info).delete(delete_job))
        .route("/api/jobs/{id}/stop", axum::routing::post(stop_job))
        .route("/api/jobs/{id}/logs", get(job_logs))
        .route("/api/jobs/{id}/logs/tail", get(tail_logs))
        .merge(crate::logs_api::routes())
        .merge(crate::state_api::routes())
        .merge(crate::serve_api::routes())
        .layer(middleware::from_fn_with_state(Arc::clone(&api), require_token))
        // Packages up to Ray's limit, plus room for the request around them.
        .layer(axum::extract::DefaultBodyLimit::max(packages::MAX_PACKAGE_BYTES + (1 << 20)));
    Ok(Router::new()
        .route("/healthz", get(|| async { "ok" }))
        .route("/api/gcs_healthz", get(|| async { "success" }))
        .route("/api/healthz", get(|| async { "success" }))
        .route("/readyz", get(ready))
        // METRICS-1: scraped without a token, as Ray's; read-only.
        .route("/metrics", get(crate::metrics::scrape))
        .merge(jobs)
        .merge(crate::dashboard::routes(Arc::clone(&api)))
        .with_state(api))
}

/// HTTP-2: the cluster token on every route but the health ones.
async fn require_token(State(api): Shared, req: Request, next: Next) -> Response {
    if !api.auth_required {
        return next.run(req).await;
    }
    let headers = req.headers();
    let from_header = |name: &str| {
        headers.get(name).and_then(|v| v.to_str().ok()).map(str::trim).filter(|v| !v.is_empty())
    };
    let presented = from_header("authorization")
        .or_else(|| from_header("x-ray-authorization"))
        .map(|v| v.strip_prefix("Bearer ").unwrap_or(v).trim().to_string())
        .or_else(|| cookie(headers, "ray-authentication-token"));
    match presented {
        None => Fail(StatusCode::UNAUTHORIZED, "Unauthorized: Missing authentication token".into())
            .into_response(),
        Some(t) if Some(t.as_str()) == api.token.as_deref() => next.run(req).await,
        Some(_) => Fail(StatusCode::FORBIDDEN, "Forbidden: Invalid authentication token".into())
            .into_response(),
    }
}

pub(crate) fn cookie(headers: &HeaderMap, name: &str) -> Option<String> {
    headers.get_all(header::COOKIE).iter().filter_map(|v| v.to_str().ok()).find_map(|v| {
        v.split(';').find_map(|kv| {
            let (k, val) = kv.trim().split_once('=')?;
            (k == name).then(|| val.to_string())
        })
    })
}

/// Ready once this head knows a leader that is serving and has applied what was
/// committed (a Kubernetes readiness probe: joined the group and caught up).
async fn ready(State(api): Shared) -> Response {
    match api.head.replica_status() {
        Some(st) if st.leader_id != 0 && st.applied >= st.commit => {
            (StatusCode::OK, "ready").into_response()
        }
        Some(st) => Fail(
            StatusCode::SERVICE_UNAVAILABLE,
            format!(
                "not ready: leader {} (0: none known), applied {} of {} committed entries",
                st.leader_id, st.applied, st.commit
            ),
        )
        .into_response(),
        None => Fail(StatusCode::SERVICE_UNAVAILABLE, "not ready: the head is starting".into())
            .into_response(),
    }
}

async fn version(State(api): Shared) -> Response {
    let cluster = api.head.lock().sm.cluster_id.clone();
    json_ok(json!({
        "version": JOBS_API_VERSION,
        "ray_version": RAY_API_VERSION,
        "ray_commit": format!("tpuray-{}", env!("CARGO_PKG_VERSION")),
        "session_name": format!("session_{cluster}"),
    }))
}

/// `{protocol}/{name}` as the package URI Ray's client means (`gcs://name`).
fn package_uri(protocol: &str, name: &str) -> Result<String, Fail> {
    if protocol != "gcs" {
        return Err(Fail(
            StatusCode::BAD_REQUEST,
            format!("package protocol {protocol:?} is not supported (expected gcs)"),
        ));
    }
    if name.is_empty() || name.contains('/') {
        return Err(Fail(StatusCode::BAD_REQUEST, format!("bad package name {name:?}")));
    }
    Ok(format!("gcs://{name}"))
}

async fn package_exists(
    State(api): Shared,
    Path((protocol, name)): Path<(String, String)>,
) -> Result<Response, Fail> {
    let uri = package_uri(&protocol, &name)?;
    let mut grpc = api.grpc.clone();
    if packages::exists(&mut grpc, PACKAGES_NAMESPACE, &uri).await? {
        Ok(StatusCode::OK.into_response())
    } else {
        Err(Fail(StatusCode::NOT_FOUND, format!("Package {uri} does not exist")))
    }
}

async fn upload_package(
    State(api): Shared,
    Path((protocol, name)): Path<(String, String)>,
    body: Bytes,
) -> Result<Response, Fail> {
    let uri = package_uri(&protocol, &name)?;
    let mut grpc = api.grpc.clone();
    packages::put(&mut grpc, PACKAGES_NAMESPACE, &uri, &body).await?;
    Ok(StatusCode::OK.into_response())
}

/// Ray's `JobSubmitRequest` (`ray/dashboard/modules/job/common.py`); unknown fields are
/// refused by name.
#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct SubmitBody {
    entrypoint: String,
    #[serde(default)]
    submission_id: Option<String>,
    /// Deprecated alias of `submission_id` (Ray still accepts it).
    #[serde(default)]
    job_id: Option<String>,
    #[serde(default)]
    runtime_env: Option<Value>,
    #[serde(default)]
    metadata: Option<BTreeMap<String, String>>,
    #[serde(default)]
    entrypoint_num_cpus: Option<f64>,
    #[serde(default)]
    entrypoint_num_gpus: Option<f64>,
    #[serde(default)]
    entrypoint_memory: Option<u64>,
    #[serde(default)]
    entrypoint_resources: Option<BTreeMap<String, f64>>,
    #[serde(default)]
    entrypoint_label_selector: Option<BTreeMap<String, String>>,
}

async fn submit_job(State(api): Shared, body: Bytes) -> Result<Response, Fail> {
    let req: SubmitBody = serde_json::from_slice(&body).map_err(|e| {
        Fail(
            StatusCode::BAD_REQUEST,
            format!("the job submission is not a valid JobSubmitRequest: {e}"),
        )
    })?;
    let runtime_env = req.runtime_env.unwrap_or(Value::Null);
    let mut env_json = String::new();
    if !runtime_env.is_null() {
        let parsed =
            JobRuntimeEnv::parse(&runtime_env).map_err(|e| Fail(StatusCode::BAD_REQUEST, e))?;
        if let Some(uri) = &parsed.working_dir {
            let mut grpc = api.grpc.clone();
            if !packages::exists(&mut grpc, PACKAGES_NAMESPACE, uri).await? {
                return Err(Fail(
                    StatusCode::BAD_REQUEST,
                    format!("runtime_env['working_dir'] {uri} was never uploaded to this cluster"),
                ));
            }
        }
        let mut env = runtime_env;
        if let Some(m) = env.as_object_mut() {
            m.remove("_ray_commit");
        }
        env_json = env.to_string();
    }
    let job = pb::JobSubmission {
        submission_id: req.submission_id.or(req.job_id).unwrap_or_default(),
        entrypoint: req.entrypoint,
        metadata: req.metadata.unwrap_or_default().into_iter().collect(),
        runtime_env_json: env_json,
        entrypoint_num_cpus: req.entrypoint_num_cpus,
        entrypoint_num_gpus: req.entrypoint_num_gpus,
        entrypoint_memory: req.entrypoint_memory,
        entrypoint_resources: req.entrypoint_resources.unwrap_or_default().into_iter().collect(),
        entrypoint_label_selector: req
            .entrypoint_label_selector
            .unwrap_or_default()
            .into_iter()
            .collect(),
        ..Default::default()
    };
    let mut grpc = api.grpc.clone();
    let reply = grpc
        .submit_job(pb::SubmitJobRequest {
            request_id: tpuray_proto::new_request_id(),
            job: Some(job),
        })
        .await?
        .into_inner();
    Ok(json_ok(json!({"job_id": reply.submission_id, "submission_id": reply.submission_id})))
}

fn opt_ms(ms: u64) -> Value {
    if ms == 0 { Value::Null } else { json!(ms) }
}

fn host_of(address: &str) -> String {
    address.rsplit_once(':').map(|(h, _)| h).unwrap_or(address).to_string()
}

/// Ray's `JobDetails` of a submission.
pub(crate) fn submission_details(s: &pb::JobSubmission) -> Value {
    let runtime_env: Value = if s.runtime_env_json.is_empty() {
        json!({})
    } else {
        serde_json::from_str(&s.runtime_env_json).unwrap_or_else(|_| json!({}))
    };
    let driver_info = if s.job_id.is_empty() {
        Value::Null
    } else {
        json!({"id": s.job_id, "node_ip_address": host_of(&s.driver_address), "pid": s.driver_pid.to_string()})
    };
    let opt = |v: &str| if v.is_empty() { Value::Null } else { json!(v) };
    json!({
        "type": "SUBMISSION",
        "job_id": opt(&s.job_id),
        "submission_id": s.submission_id,
        "driver_info": driver_info,
        "status": s.status,
        "entrypoint": s.entrypoint,
        "message": opt(&s.message),
        "error_type": opt(&s.error_type),
        // Ray sets start_time when the job is submitted.
        "start_time": opt_ms(s.submit_time_ms),
        "end_time": opt_ms(s.end_time_ms),
        "metadata": s.metadata,
        "runtime_env": runtime_env,
        // Ray's job agent speaks HTTP; tpuray's node agent speaks gRPC only.
        "driver_agent_http_address": Value::Null,
        "driver_node_id": opt(&s.driver_node_id),
        "driver_exit_code": s.driver_exit_code,
    })
}

/// Ray's `JobDetails` of a driver started by hand (type DRIVER).
pub(crate) fn driver_details(j: &pb::JobInfo) -> Value {
    let finished = j.state == pb::JobState::Finished as i32;
    json!({
        "type": "DRIVER",
        "job_id": j.job_id,
        "submission_id": Value::Null,
        "driver_info": {"id": j.job_id, "node_ip_address": host_of(&j.driver_address), "pid": j.driver_pid.to_string()},
        "status": if finished { "SUCCEEDED" } else { "RUNNING" },
        "entrypoint": j.entrypoint,
        "message": Value::Null,
        "error_type": Value::Null,
        "start_time": opt_ms(j.start_time_ms),
        "end_time": opt_ms(j.end_time_ms),
        "metadata": {},
        "runtime_env": {},
        "driver_agent_http_address": Value::Null,
        "driver_node_id": Value::Null,
        "driver_exit_code": Value::Null,
    })
}

async fn list_jobs(State(api): Shared) -> Result<Response, Fail> {
    let mut grpc = api.grpc.clone();
    let subs = grpc.list_job_submissions(pb::ListJobSubmissionsRequest {}).await?.into_inner();
    let drivers = grpc.list_jobs(pb::ListJobsRequest {}).await?.into_inner();
    let mut out: Vec<Value> = subs.jobs.iter().map(submission_details).collect();
    out.extend(drivers.jobs.iter().filter(|j| j.submission_id.is_empty()).map(driver_details));
    Ok(json_ok(Value::Array(out)))
}

/// A job by submission id or driver job id: its submission, or a driver job.
enum Found {
    Submission(Box<pb::JobSubmission>),
    Driver(pb::JobInfo),
}

async fn find_job(api: &Api, id: &str) -> Result<Found, Fail> {
    let mut grpc = api.grpc.clone();
    let r = grpc.get_job_submission(pb::GetJobSubmissionRequest { id: id.into() }).await?;
    if let Some(s) = r.into_inner().job {
        return Ok(Found::Submission(Box::new(s)));
    }
    let drivers = grpc.list_jobs(pb::ListJobsRequest {}).await?.into_inner();
    drivers
        .jobs
        .into_iter()
        .find(|j| j.job_id == id)
        .map(Found::Driver)
        .ok_or_else(|| Fail(StatusCode::NOT_FOUND, format!("Job {id} does not exist")))
}

async fn find_submission(api: &Api, id: &str, what: &str) -> Result<pb::JobSubmission, Fail> {
    match find_job(api, id).await? {
        Found::Submission(s) => Ok(*s),
        Found::Driver(_) => {
            Err(Fail(StatusCode::BAD_REQUEST, format!("Can only {what} submission type jobs")))
        }
    }
}

async fn job_info(State(api): Shared, Path(id): Path<String>) -> Result<Response, Fail> {
    Ok(json_ok(match find_job(&api, &id).await? {
        Found::Submission(s) => submission_details(&s),
        Found::Driver(j) => driver_details(&j),
    }))
}

async fn stop_job(State(api): Shared, Path(id): Path<String>) -> Result<Response, Fail> {
    let s = find_submission(&api, &id, "stop").await?;
    let mut grpc = api.grpc.clone();
    let r = grpc
        .stop_job(pb::StopJobRequest {
            request_id: tpuray_proto::new_request_id(),
            id: s.submission_id,
        })
        .await?;
    Ok(json_ok(json!({"stopped": r.into_inner().stopped})))
}

async fn delete_job(State(api): Shared, Path(id): Path<String>) -> Result<Response, Fail> {
    let s = find_submission(&api, &id, "delete").await?;
    let mut grpc = api.grpc.clone();
    let r = grpc
        .delete_job(pb::DeleteJobRequest {
            request_id: tpuray_proto::new_request_id(),
            id: s.submission_id,
        })
        .await?;
    Ok(json_ok(json!({"deleted": r.into_inner().deleted})))
}

/// Reads a job's log from `offset` on the agent that ran it. `Ok(None)`: the job never
/// reached a node, so it has no log.
async fn read_log(
    api: &Api,
    s: &pb::JobSubmission,
    offset: u64,
) -> Result<Option<(Vec<u8>, u64)>, Fail> {
    if s.driver_agent_address.is_empty() {
        return Ok(None);
    }
    let mut agent = api.head.agent_client(&s.driver_agent_address)?;
    let r = agent
        .read_job_logs(pb::ReadJobLogsRequest {
            submission_id: s.submission_id.clone(),
            offset,
            max_bytes: 0,
        })
        .await
        .map_err(|e| {
            Fail(
                StatusCode::INTERNAL_SERVER_ERROR,
                format!(
                    "the logs of job {} are kept on node {} ({}), which did not answer: {}",
                    s.submission_id,
                    s.driver_node_id,
                    s.driver_agent_address,
                    e.message()
                ),
            )
        })?
        .into_inner();
    Ok(r.found.then_some((r.data, r.size)))
}

async fn job_logs(State(api): Shared, Path(id): Path<String>) -> Result<Response, Fail> {
    let s = find_submission(&api, &id, "get logs of").await?;
    let mut logs = Vec::new();
    while let Some((data, size)) = read_log(&api, &s, logs.len() as u64).await? {
        let done = data.is_empty() || logs.len() as u64 + data.len() as u64 >= size;
        logs.extend_from_slice(&data);
        if done {
            break;
        }
    }
    Ok(json_ok(json!({"logs": String::from_utf8_lossy(&logs)})))
}

async fn tail_logs(
    State(api): Shared,
    Path(id): Path<String>,
    ws: WebSocketUpgrade,
) -> Result<Response, Fail> {
    let s = find_submission(&api, &id, "get logs of").await?;
    Ok(ws.on_upgrade(move |socket| tail(api, s.submission_id, socket)))
}

/// Sends the log as it grows until the job is terminal and every byte went out
/// (never stopping early, ray#51601), then closes the socket.
async fn tail(api: Arc<Api>, submission_id: String, mut socket: WebSocket) {
    let mut offset = 0u64;
    let mut pending = Vec::new(); // an incomplete UTF-8 sequence at a read's end
    loop {
        let mut grpc = api.grpc.clone();
        let job = match grpc
            .get_job_submission(pb::GetJobSubmissionRequest { id: submission_id.clone() })
            .await
        {
            Ok(r) => r.into_inner().job,
            Err(e) if e.code() == Code::Unavailable => {
                tokio::time::sleep(TAIL_POLL).await; // a failover: the leader comes back
                continue;
            }
            Err(_) => None,
        };
        let Some(job) = job else { break };
        let terminal = matches!(job.status.as_str(), "STOPPED" | "SUCCEEDED" | "FAILED");
        let mut sent_any = false;
        match read_log(&api, &job, offset).await {
            Ok(Some((data, _))) if !data.is_empty() => {
                offset += data.len() as u64;
                pending.extend_from_slice(&data);
                let cut = match std::str::from_utf8(&pending) {
                    Ok(_) => pending.len(),
                    Err(e) if e.error_len().is_none() => e.valid_up_to(),
                    Err(_) => pending.len(),
                };
                let text = String::from_utf8_lossy(&pending[..cut]).into_owned();
                pending.drain(..cut);
                if !text.is_empty() && socket.send(Message::Text(text.into())).await.is_err() {
                    return;
                }
                sent_any = true;
            }
            Ok(_) => {}
            Err(Fail(_, msg)) if terminal => {
                let _ = socket.send(Message::Text(format!("{msg}\n").into())).await;
                break;
            }
            Err(_) => {} // the node may come back, or the job will fail: keep polling
        }
        if terminal && !sent_any {
            break;
        }
        if !sent_any {
            tokio::time::sleep(TAIL_POLL).await;
        }
    }
    if !pending.is_empty() {
        let _ =
            socket.send(Message::Text(String::from_utf8_lossy(&pending).into_owned().into())).await;
    }
    // A normal closure (1000, as Ray's server closes): Ray's client treats any other
    // ending as an error. Then wait (briefly) for the client's own close frame.
    let close = axum::extract::ws::CloseFrame { code: 1000, reason: "".into() };
    if socket.send(Message::Close(Some(close))).await.is_ok() {
        let _ = tokio::time::timeout(Duration::from_secs(5), async {
            while let Some(Ok(m)) = socket.recv().await {
                if matches!(m, Message::Close(_)) {
                    break;
                }
            }
        })
        .await;
    }
}

/// Where the dashboard listens: `--dashboard-host` and `--dashboard-port`.
#[derive(Clone, Debug)]
pub struct DashboardConfig {
    /// `None`: as the head's gRPC server binds (NET-3: its own address when that is a
    /// loopback one, else every address).
    pub host: Option<std::net::IpAddr>,
    /// 0 picks a free port.
    pub port: u16,
    /// Whether `port` was given: a taken explicit port is an error, a taken default
    /// port a warning and a free port instead.
    pub explicit: bool,
}

/// Binds the dashboard's listener (see [`DashboardConfig`]).
///
/// # Errors
/// A message naming the address when an explicit port is taken or nothing can be bound.
pub async fn bind(
    cfg: &DashboardConfig,
    head_ip: std::net::IpAddr,
) -> Result<tokio::net::TcpListener, String> {
    let host = cfg.host.unwrap_or_else(|| {
        tpuray_proto::net::bind_address(SocketAddr::new(head_ip, cfg.port)).ip()
    });
    let addr = SocketAddr::new(host, cfg.port);
    match tokio::net::TcpListener::bind(addr).await {
        Ok(l) => Ok(l),
        Err(e) if cfg.explicit || cfg.port == 0 => {
            Err(format!("cannot serve the dashboard on {addr} (--dashboard-port): {e}"))
        }
        Err(e) => {
            tracing::warn!(
                "dashboard port {} is taken ({e}); serving the dashboard on a free port",
                cfg.port
            );
            eprintln!(
                "tpuray: the default dashboard port {} is taken ({e}); the dashboard uses a free port instead",
                cfg.port
            );
            tokio::net::TcpListener::bind(SocketAddr::new(host, 0))
                .await
                .map_err(|e| format!("cannot serve the dashboard on {host}:0: {e}"))
        }
    }
}

/// Serves `router` on `listener` until `shutdown` resolves.
pub(crate) async fn serve(
    listener: tokio::net::TcpListener,
    router: Router,
    shutdown: impl std::future::Future<Output = ()> + Send + 'static,
) {
    // TLS-2: HTTPS with the head's certificate when the head uses TLS.
    let served = match tpuray_proto::tls::current() {
        Ok(Some(t)) => match tpuray_proto::tls::HttpsListener::new(listener, t, "dashboard") {
            Ok(l) => axum::serve(l, router).with_graceful_shutdown(shutdown).await,
            Err(e) => Err(e),
        },
        _ => axum::serve(listener, router).with_graceful_shutdown(shutdown).await,
    };
    if let Err(e) = served {
        tracing::error!("the dashboard's HTTP server stopped: {e}");
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn cookies_are_read_by_name() {
        let mut h = HeaderMap::new();
        h.insert(header::COOKIE, "a=1; ray-authentication-token=tok; b=2".parse().unwrap());
        assert_eq!(cookie(&h, "ray-authentication-token").as_deref(), Some("tok"));
        assert_eq!(cookie(&h, "c"), None);
    }

    #[test]
    fn package_routes_name_gcs_uris_only() {
        assert_eq!(
            package_uri("gcs", "_ray_pkg_ab.zip").ok().as_deref(),
            Some("gcs://_ray_pkg_ab.zip")
        );
        assert!(package_uri("s3", "x.zip").is_err());
    }

    #[test]
    fn a_submission_reads_as_rays_job_details() {
        let s = pb::JobSubmission {
            submission_id: "raysubmit_x".into(),
            status: "RUNNING".into(),
            entrypoint: "python a.py".into(),
            submit_time_ms: 5,
            job_id: "j1".into(),
            driver_address: "10.0.0.1:7000".into(),
            driver_pid: 42,
            ..Default::default()
        };
        let d = submission_details(&s);
        assert_eq!(d["type"], "SUBMISSION");
        assert_eq!(d["start_time"], 5);
        assert_eq!(d["end_time"], Value::Null);
        assert_eq!(d["driver_info"]["node_ip_address"], "10.0.0.1");
        assert_eq!(d["driver_info"]["pid"], "42");
        assert_eq!(d["runtime_env"], json!({}));
    }
}
