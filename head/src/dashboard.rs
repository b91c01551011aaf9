//! The dashboard's pages on the head's HTTP server (DESIGN.md §13; Ray's dashboard at port
//! 8265, plus what Ray does not draw: TPU slices host by host with every chip). Routes:
//! `/` (overview), `/nodes`, `/nodes/{id}`, `/slices`, `/actors`, `/tasks`,
//! `/placement-groups`, `/jobs`, `/jobs/{id}` (with the job's log), `/serve`,
//! `/replicas`, `/timeline`, Ray's `/api/v0/tasks/timeline` (Chrome trace JSON,
//! `tpuray_head::timeline`), `/login`, `/logout` and the two assets under `/static/`
//! (built into the binary with `include_str!`). They join `http::router` beside the Jobs
//! API.
//!
//! - DASH-1: pages are rendered on the server (`render.rs`): each is complete HTML without
//!   running a script (`/` names every node by its id and address). The one script only
//!   re-fetches the page it is on every few seconds and swaps its `<main>`.
//! - DASH-2: every value from the cluster is escaped (`render::esc`, `render::enc`).
//! - DASH-3 (HTTP-2 for pages): with token auth on, a page needs the cluster token, as the
//!   Jobs API does: `Authorization: Bearer`, `X-Ray-Authorization`, or the cookie Ray's
//!   dashboard uses, `ray-authentication-token`. A browser without it is sent (303) to a
//!   small login form at `/login` (a wrong token gets the form with a 403), which posts
//!   the token to `/login`; that sets the cookie
//!   (`HttpOnly; SameSite=Strict`, so other sites' pages cannot use it) and goes back to
//!   the page. A link may carry the token once as `?token=...`: the server sets the
//!   cookie and redirects to the same address without it, so it does not stay in the
//!   address bar or the history. `/api/...` routes answer Ray's texts instead of the
//!   form. `/login` and `/logout` need no token.
//! - DASH-4: the data comes from the serving leader through the leader-following gRPC
//!   client (HTTP-1), so a follower's pages show the leader's data; the line under the
//!   header says which head served the page and which one leads. Per-node data (workers
//!   and their chips, object stores, job logs) is asked of the node agents directly, each
//!   call with a deadline. A call that fails shows up on the page as what failed and why;
//!   no input stops the head (bad ids are 404 pages, bad queries are ignored).
//!
//! Async: every handler runs on the head's tokio runtime and only awaits gRPC calls; none
//! blocks a thread.
//!
//! Numbers and choices: the script swaps `<main>` every 5 s; per-node calls have a 2 s
//! deadline; reads of tasks take the newest 20,000 (the pages say so when they hit it).
//! `/serve` draws the serve controller's status document in the KV. Chosen (DASH-3): a
//! redirect to the form rather than a 401 page, since browsers log every 4xx page as a
//! console error.

mod render;

use std::collections::HashMap;
use std::sync::Arc;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use axum::Router;
use axum::body::Bytes;
use axum::extract::{Path, Request, State};
use axum::http::{HeaderMap, HeaderValue, StatusCode, header};
use axum::middleware::{self, Next};
use axum::response::{IntoResponse, Response};
use axum::routing::get;
use tpuray_proto::pb;

use crate::http::{Api, cookie};
use render::{TasksRead, esc, param, parse_query};

type Shared = State<Arc<Api>>;

const CSS: &str = include_str!("dashboard/dashboard.css");
const JS: &str = include_str!("dashboard/dashboard.js");
/// The cookie Ray's dashboard reads the token from.
const TOKEN_COOKIE: &str = "ray-authentication-token";
/// Deadline of each call to the head cluster.
const RPC_TIMEOUT: Duration = Duration::from_secs(5);
/// Deadline of each call to a node agent (a dead or frozen one must not hold a page).
const AGENT_TIMEOUT: Duration = Duration::from_secs(2);
/// Tasks read for the counts of the overview, tasks and timeline pages (the head keeps up
/// to 100,000): the newest ones.
const TASKS_READ: u32 = 20_000;
/// Task rows a tasks page shows.
const TASK_ROWS: usize = 500;
/// The end of a job's log a job page shows.
const LOG_TAIL_BYTES: u64 = 256 * 1024;
/// Seconds between the script's refreshes.
const REFRESH_S: u32 = 5;

/// The dashboard's routes (merged into `http::router`, which adds the state).
pub(crate) fn routes(api: Arc<Api>) -> Router<Arc<Api>> {
    let guarded = Router::new()
        .route("/", get(overview))
        .route("/nodes", get(nodes_page))
        .route("/nodes/{id}", get(node_page))
        .route("/slices", get(slices_page))
        .route("/actors", get(actors_page))
        .route("/tasks", get(tasks_page))
        .route("/placement-groups", get(groups_page))
        .route("/jobs", get(jobs_page))
        .route("/jobs/{id}", get(job_page))
        .route("/serve", get(serve_page))
        .route("/replicas", get(replicas_page))
        .route("/timeline", get(timeline_page))
        .route("/api/v0/tasks/timeline", get(timeline_json))
        .route("/static/dashboard.css", get(|| async { asset("text/css; charset=utf-8", CSS) }))
        .route(
            "/static/dashboard.js",
            get(|| async { asset("text/javascript; charset=utf-8", JS) }),
        )
        .layer(middleware::from_fn_with_state(api, page_auth));
    Router::new()
        .route("/login", get(login_form).post(login))
        .route("/logout", get(logout))
        .merge(guarded)
}

fn asset(content_type: &'static str, body: &'static str) -> Response {
    ([(header::CONTENT_TYPE, content_type), (header::CACHE_CONTROL, "no-cache")], body)
        .into_response()
}

fn html(status: StatusCode, body: String) -> Response {
    (
        status,
        [(header::CONTENT_TYPE, "text/html; charset=utf-8"), (header::CACHE_CONTROL, "no-store")],
        body,
    )
        .into_response()
}

fn now_ms() -> u64 {
    SystemTime::now().duration_since(UNIX_EPOCH).map(|d| d.as_millis() as u64).unwrap_or(0)
}

// ---------------------------------------------------------------------------------------
// DASH-3: the token.
// ---------------------------------------------------------------------------------------

/// Whether `given` is the cluster token (compared in constant time).
fn same_token(given: &str, want: Option<&str>) -> bool {
    let Some(want) = want else { return false };
    let (a, b) = (given.as_bytes(), want.as_bytes());
    a.len() == b.len() && a.iter().zip(b).fold(0u8, |acc, (x, y)| acc | (x ^ y)) == 0
}

/// The token a request presents: a header, else the cookie.
fn presented(headers: &HeaderMap) -> Option<String> {
    let from_header = |name: &str| {
        headers.get(name).and_then(|v| v.to_str().ok()).map(str::trim).filter(|v| !v.is_empty())
    };
    from_header("authorization")
        .or_else(|| from_header("x-ray-authorization"))
        .map(|v| v.strip_prefix("Bearer ").unwrap_or(v).trim().to_string())
        .or_else(|| cookie(headers, TOKEN_COOKIE).map(|c| render::decode(&c)))
}

fn set_cookie(token: &str) -> HeaderValue {
    HeaderValue::from_str(&format!(
        "{TOKEN_COOKIE}={}; Path=/; HttpOnly; SameSite=Strict",
        render::enc(token)
    ))
    .unwrap_or_else(|_| HeaderValue::from_static(""))
}

/// A local path to go back to after signing in; anything else (another site, a scheme)
/// becomes `/`.
fn safe_next(next: &str) -> &str {
    let ok = next.starts_with('/')
        && !next.starts_with("//")
        && !next.contains('\\')
        && next.chars().all(|c| c.is_ascii_graphic());
    if ok { next } else { "/" }
}

fn redirect(to: &str, cookie: Option<HeaderValue>) -> Response {
    let mut r = StatusCode::SEE_OTHER.into_response();
    let to = HeaderValue::from_str(safe_next(to)).unwrap_or_else(|_| HeaderValue::from_static("/"));
    r.headers_mut().insert(header::LOCATION, to);
    if let Some(c) = cookie {
        r.headers_mut().insert(header::SET_COOKIE, c);
    }
    r
}

/// `query` without its `token` pairs (raw, as written).
fn without_token(query: &str) -> String {
    query
        .split('&')
        .filter(|kv| !kv.is_empty())
        .filter(|kv| render::decode(kv.split_once('=').map_or(*kv, |(k, _)| k)) != "token")
        .collect::<Vec<_>>()
        .join("&")
}

fn text(status: StatusCode, body: &str) -> Response {
    (status, [(header::CONTENT_TYPE, "text/plain; charset=utf-8")], body.to_string())
        .into_response()
}

/// DASH-3 for the pages, their assets and the timeline API.
async fn page_auth(State(api): Shared, req: Request, next: Next) -> Response {
    if !api.auth_required {
        return next.run(req).await;
    }
    let path = req.uri().path().to_string();
    let raw_query = req.uri().query().unwrap_or("").to_string();
    let here = req.uri().path_and_query().map(|p| p.as_str().to_string()).unwrap_or(path.clone());
    let is_api = path.starts_with("/api/");
    let want = api.token.as_deref();
    if !is_api && let Some(t) = param(&parse_query(&raw_query), "token") {
        if same_token(t, want) {
            let rest = without_token(&raw_query);
            let to = if rest.is_empty() { path } else { format!("{path}?{rest}") };
            return redirect(&to, Some(set_cookie(t)));
        }
        let next = {
            let rest = without_token(&raw_query);
            if rest.is_empty() { path.clone() } else { format!("{path}?{rest}") }
        };
        return html(
            StatusCode::FORBIDDEN,
            render::login_page(
                &next,
                Some("The token in the address is not this cluster's token."),
            ),
        );
    }
    match presented(req.headers()) {
        Some(t) if same_token(&t, want) => next.run(req).await,
        None if is_api => {
            text(StatusCode::UNAUTHORIZED, "Unauthorized: Missing authentication token")
        }
        Some(_) if is_api => text(StatusCode::FORBIDDEN, "Forbidden: Invalid authentication token"),
        // To the form's own address (a 200 page), not a 401 answer here: a browser
        // reports every 4xx page it loads as an error in its console.
        None => redirect(&format!("/login?next={}", render::enc(safe_next(&here))), None),
        Some(_) => html(
            StatusCode::FORBIDDEN,
            render::login_page(&here, Some("That token is not this cluster's token.")),
        ),
    }
}

async fn login_form(req: Request) -> Response {
    let q = parse_query(req.uri().query().unwrap_or(""));
    html(StatusCode::OK, render::login_page(safe_next(param(&q, "next").unwrap_or("/")), None))
}

async fn login(State(api): Shared, body: Bytes) -> Response {
    let form = parse_query(&String::from_utf8_lossy(&body));
    let next = safe_next(param(&form, "next").unwrap_or("/")).to_string();
    if !api.auth_required {
        return redirect(&next, None);
    }
    let token = param(&form, "token").unwrap_or("").trim();
    if same_token(token, api.token.as_deref()) {
        return redirect(&next, Some(set_cookie(token)));
    }
    let why = if token.is_empty() {
        "Enter the cluster token."
    } else {
        "That token is not this cluster's token."
    };
    html(StatusCode::FORBIDDEN, render::login_page(&next, Some(why)))
}

async fn logout() -> Response {
    let mut r = html(StatusCode::OK, render::login_page("/", Some("Signed out.")));
    r.headers_mut().insert(
        header::SET_COOKIE,
        HeaderValue::from_static(
            "ray-authentication-token=; Path=/; Max-Age=0; HttpOnly; SameSite=Strict",
        ),
    );
    r
}

// ---------------------------------------------------------------------------------------
// DASH-4: reading the cluster.
// ---------------------------------------------------------------------------------------

fn req<T>(m: T) -> tonic::Request<T> {
    let mut r = tonic::Request::new(m);
    r.set_timeout(RPC_TIMEOUT);
    r
}

fn why(s: tonic::Status) -> String {
    format!("{:?}: {}", s.code(), s.message())
}

/// The line under the header: which head served the page, and whose data it shows.
fn served_by(api: &Api) -> String {
    let cfg = &api.head.config;
    let id = cfg.replica_id;
    let me = cfg.replica_address(id).unwrap_or_default();
    match api.head.replica_status() {
        None => format!("Served by head {id} at {}, which is starting.", esc(&me)),
        Some(st) if st.role.name() == "leader" && st.leader_ready && cfg.replicas().len() == 1 => {
            format!("Served by the head at {}.", esc(&me))
        }
        Some(st) if st.role.name() == "leader" && st.leader_ready => {
            format!("Served by head {id} at {}, the leader.", esc(&me))
        }
        Some(st) => {
            let leader = match cfg.replica_address(st.leader_id).filter(|_| st.leader_id != 0) {
                Some(a) => format!("head {} at {}", st.leader_id, esc(&a)),
                None => "none known yet".into(),
            };
            format!(
                "Served by head {id} at {} ({}); the data is the leader's (leader: {leader}).",
                esc(&me),
                st.role.name()
            )
        }
    }
}

/// A page, or an error page naming what could not be read.
fn page(
    api: &Api,
    title: &str,
    active: &str,
    main: Result<String, (StatusCode, String)>,
) -> Response {
    let (status, main, refresh) = match main {
        Ok(m) => (StatusCode::OK, m, REFRESH_S),
        Err((s, m)) => (s, m, REFRESH_S),
    };
    html(status, render::layout(title, active, &served_by(api), &main, refresh))
}

/// An error page's body: what could not be read from the leader, and why.
fn unreadable(what: &str, e: String) -> (StatusCode, String) {
    (
        StatusCode::SERVICE_UNAVAILABLE,
        render::error_box(&format!("{what} could not be read from the cluster's leader"), &e),
    )
}

async fn status(api: &Api) -> Result<pb::GetClusterStatusReply, String> {
    api.grpc
        .clone()
        .get_cluster_status(req(pb::GetClusterStatusRequest {}))
        .await
        .map(|r| r.into_inner())
        .map_err(why)
}

async fn actors(api: &Api) -> Result<Vec<pb::ActorInfo>, String> {
    api.grpc
        .clone()
        .list_actors(req(pb::ListActorsRequest {}))
        .await
        .map(|r| r.into_inner().actors)
        .map_err(why)
}

async fn groups(api: &Api) -> Result<Vec<pb::PlacementGroupInfo>, String> {
    api.grpc
        .clone()
        .list_placement_groups(req(pb::ListPlacementGroupsRequest {}))
        .await
        .map(|r| r.into_inner().placement_groups)
        .map_err(why)
}

async fn submissions(api: &Api) -> Result<Vec<pb::JobSubmission>, String> {
    api.grpc
        .clone()
        .list_job_submissions(req(pb::ListJobSubmissionsRequest {}))
        .await
        .map(|r| r.into_inner().jobs)
        .map_err(why)
}

async fn drivers(api: &Api) -> Result<Vec<pb::JobInfo>, String> {
    api.grpc
        .clone()
        .list_jobs(req(pb::ListJobsRequest {}))
        .await
        .map(|r| r.into_inner().jobs)
        .map_err(why)
}

async fn tasks(api: &Api, limit: u32) -> Result<TasksRead, String> {
    let r = api
        .grpc
        .clone()
        .list_tasks(req(pb::ListTasksRequest { limit }))
        .await
        .map_err(why)?
        .into_inner();
    Ok(TasksRead {
        truncated: limit > 0 && r.tasks.len() >= limit as usize,
        tasks: r.tasks,
        dropped: r.dropped,
    })
}

/// Each listed node agent's workers (by node id), asked concurrently, each with
/// [`AGENT_TIMEOUT`].
async fn workers_of(
    api: &Api,
    nodes: &[&pb::NodeInfo],
) -> HashMap<String, Result<Vec<pb::WorkerInfo>, String>> {
    let mut set = tokio::task::JoinSet::new();
    for n in nodes {
        let client = api.head.agent_client(&n.address);
        let (id, address) = (n.node_id.clone(), n.address.clone());
        set.spawn(async move {
            let r = async {
                let mut c = client.map_err(why)?;
                let mut r = tonic::Request::new(pb::ListWorkersRequest {});
                r.set_timeout(AGENT_TIMEOUT);
                c.list_workers(r).await.map(|r| r.into_inner().workers).map_err(why)
            }
            .await
            .map_err(|e| format!("the agent at {address}: {e}"));
            (id, r)
        });
    }
    let mut out = HashMap::new();
    while let Some(r) = set.join_next().await {
        if let Ok((id, r)) = r {
            out.insert(id, r);
        }
    }
    out
}

// ---------------------------------------------------------------------------------------
// Pages.
// ---------------------------------------------------------------------------------------

async fn overview(State(api): Shared) -> Response {
    let (st, a, t, s, d, g) = tokio::join!(
        status(&api),
        actors(&api),
        tasks(&api, TASKS_READ),
        submissions(&api),
        drivers(&api),
        groups(&api)
    );
    let hosts: Vec<pb::NodeInfo> = match (&st, &g) {
        (Ok(st), Ok(g)) => crate::slices::slices(&st.nodes, g)
            .iter()
            .flat_map(|s| s.hosts.iter().map(|h| h.node.clone()))
            .collect(),
        _ => Vec::new(),
    };
    let workers = workers_of(&api, &hosts.iter().collect::<Vec<_>>()).await;
    let main = st.map_err(|e| unreadable("The cluster's status", e)).map(|st| {
        render::overview(
            &st,
            a.as_deref().map_err(String::as_str),
            t.as_ref().map_err(String::as_str),
            s.as_deref().map_err(String::as_str),
            d.as_deref().map_err(String::as_str),
            g.as_deref().map_err(String::as_str),
            &workers,
            now_ms(),
        )
    });
    page(&api, "Cluster overview", "/", main)
}

async fn nodes_page(State(api): Shared) -> Response {
    let main = status(&api)
        .await
        .map_err(|e| unreadable("The nodes", e))
        .map(|st| render::nodes(&st, now_ms()));
    page(&api, "Nodes", "/nodes", main)
}

async fn node_page(State(api): Shared, Path(id): Path<String>) -> Response {
    let (st, a) = tokio::join!(status(&api), actors(&api));
    let st = match st {
        Ok(st) => st,
        Err(e) => return page(&api, "Node", "/nodes", Err(unreadable("The nodes", e))),
    };
    let Some(n) = st.nodes.iter().find(|n| n.node_id == id) else {
        let msg = render::error_box("No such node", &format!("the cluster has no node {id}"));
        return page(&api, "Node", "/nodes", Err((StatusCode::NOT_FOUND, msg)));
    };
    let (workers, store) = if n.state == pb::NodeState::Alive as i32 {
        let w = workers_of(&api, &[n])
            .await
            .remove(&n.node_id)
            .unwrap_or_else(|| Err("no answer".into()));
        let s = async {
            let mut c = tpuray_proto::client::objects(&n.address, api.token.as_deref())
                .map_err(|e| e.to_string())?;
            let mut r = tonic::Request::new(pb::GetStoreUsageRequest { limit: 10 });
            r.set_timeout(AGENT_TIMEOUT);
            c.get_store_usage(r).await.map(|r| r.into_inner()).map_err(why)
        }
        .await;
        (w, s)
    } else {
        (Err("the node is dead".to_string()), Err("the node is dead".to_string()))
    };
    let main = render::node(
        n,
        workers.as_deref().map_err(String::as_str),
        store.as_ref().map_err(String::as_str),
        a.as_deref().unwrap_or_default(),
        now_ms(),
    );
    page(&api, &format!("Node {}", crate::slices::short_id(&n.node_id)), "/nodes", Ok(main))
}

async fn slices_page(State(api): Shared) -> Response {
    let (st, g, a) = tokio::join!(status(&api), groups(&api), actors(&api));
    let main = match st {
        Err(e) => Err(unreadable("The nodes", e)),
        Ok(st) => {
            let mut note = String::new();
            let g = g.unwrap_or_else(|e| {
                note =
                    render::error_box("Placement groups could not be read (holders not shown)", &e);
                Vec::new()
            });
            let hosts: Vec<&pb::NodeInfo> = crate::slices::slices(&st.nodes, &g)
                .iter()
                .flat_map(|s| s.hosts.iter().map(|h| h.node))
                .collect();
            let workers = workers_of(&api, &hosts).await;
            Ok(note
                + &render::slices_page(&st.nodes, &g, &workers, a.as_deref().unwrap_or_default()))
        }
    };
    page(&api, "TPU slices", "/slices", main)
}

fn query_of(req: &Request) -> Vec<(String, String)> {
    parse_query(req.uri().query().unwrap_or(""))
}

async fn actors_page(State(api): Shared, r: Request) -> Response {
    let q = query_of(&r);
    let (a, st) = tokio::join!(actors(&api), status(&api));
    let nodes = st.map(|s| s.nodes).unwrap_or_default();
    let main = a
        .map_err(|e| unreadable("The actors", e))
        .map(|a| render::actors(&a, &nodes, param(&q, "state").filter(|s| !s.is_empty())));
    page(&api, "Actors", "/actors", main)
}

async fn tasks_page(State(api): Shared, r: Request) -> Response {
    let q = query_of(&r);
    let (t, st) = tokio::join!(tasks(&api, TASKS_READ), status(&api));
    let nodes = st.map(|s| s.nodes).unwrap_or_default();
    let limit = param(&q, "limit")
        .and_then(|l| l.parse().ok())
        .unwrap_or(TASK_ROWS)
        .min(TASKS_READ as usize);
    let main = t.map_err(|e| unreadable("The tasks", e)).map(|t| {
        render::tasks(
            &t,
            &nodes,
            param(&q, "state").filter(|s| !s.is_empty()),
            param(&q, "job").filter(|s| !s.is_empty()),
            limit,
        )
    });
    page(&api, "Tasks", "/tasks", main)
}

async fn groups_page(State(api): Shared) -> Response {
    let (g, st) = tokio::join!(groups(&api), status(&api));
    let nodes = st.map(|s| s.nodes).unwrap_or_default();
    let main = g
        .map_err(|e| unreadable("The placement groups", e))
        .map(|g| render::groups(&g, &nodes, now_ms()));
    page(&api, "Placement groups", "/placement-groups", main)
}

async fn jobs_page(State(api): Shared) -> Response {
    let (s, d, st) = tokio::join!(submissions(&api), drivers(&api), status(&api));
    let nodes = st.map(|s| s.nodes).unwrap_or_default();
    let main = match (s, d) {
        (Ok(s), Ok(d)) => Ok(render::jobs(&s, &d, &nodes)),
        (Err(e), _) | (_, Err(e)) => Err(unreadable("The jobs", e)),
    };
    page(&api, "Jobs", "/jobs", main)
}

/// The end of a submitted job's log, from its node's agent; `None`: not started on a node.
async fn log_tail(api: &Api, s: &pb::JobSubmission) -> Result<Option<render::LogTail>, String> {
    if s.driver_agent_address.is_empty() {
        return Ok(None);
    }
    let mut agent = api.head.agent_client(&s.driver_agent_address).map_err(why)?;
    let read = |offset: u64| {
        let mut r = tonic::Request::new(pb::ReadJobLogsRequest {
            submission_id: s.submission_id.clone(),
            offset,
            max_bytes: LOG_TAIL_BYTES,
        });
        r.set_timeout(AGENT_TIMEOUT);
        r
    };
    let fail = |e: tonic::Status| {
        format!(
            "the log is kept on node {} ({}), which did not answer: {}",
            s.driver_node_id,
            s.driver_agent_address,
            why(e)
        )
    };
    let first = agent.read_job_logs(read(0)).await.map_err(fail)?.into_inner();
    if !first.found {
        return Ok(None);
    }
    if first.size <= LOG_TAIL_BYTES {
        return Ok(Some(render::LogTail {
            text: String::from_utf8_lossy(&first.data).into_owned(),
            offset: 0,
            size: first.size,
        }));
    }
    let offset = first.size - LOG_TAIL_BYTES;
    let last = agent.read_job_logs(read(offset)).await.map_err(fail)?.into_inner();
    Ok(Some(render::LogTail {
        text: String::from_utf8_lossy(&last.data).into_owned(),
        offset,
        size: last.size.max(first.size),
    }))
}

async fn job_page(State(api): Shared, Path(id): Path<String>) -> Response {
    let sub = api
        .grpc
        .clone()
        .get_job_submission(req(pb::GetJobSubmissionRequest { id: id.clone() }))
        .await;
    let nodes = status(&api).await.map(|s| s.nodes).unwrap_or_default();
    match sub.map(|r| r.into_inner().job) {
        Err(e) => page(&api, "Job", "/jobs", Err(unreadable("The job", why(e)))),
        Ok(Some(s)) => {
            let log = log_tail(&api, &s).await;
            let title = format!("Job {}", s.submission_id);
            page(&api, &title, "/jobs", Ok(render::submission(&s, log, &nodes)))
        }
        Ok(None) => match drivers(&api).await {
            Err(e) => page(&api, "Job", "/jobs", Err(unreadable("The jobs", e))),
            Ok(d) => match d.iter().find(|j| j.job_id == id) {
                Some(j) => page(&api, &format!("Job {}", j.job_id), "/jobs", Ok(render::driver(j))),
                None => {
                    let msg =
                        render::error_box("No such job", &format!("the cluster has no job {id}"));
                    page(&api, "Job", "/jobs", Err((StatusCode::NOT_FOUND, msg)))
                }
            },
        },
    }
}

async fn serve_page(State(api): Shared) -> Response {
    let r = api
        .grpc
        .clone()
        .kv_get(req(pb::KvGetRequest { namespace: "serve".into(), key: b"status".to_vec() }))
        .await;
    let now_s = now_ms() as f64 / 1000.0;
    let main = match r.map(|r| r.into_inner()) {
        Err(e) => Err(unreadable("The serve status", why(e))),
        Ok(doc) if !doc.found => Ok(render::serve(None, now_s)),
        Ok(doc) => match serde_json::from_slice::<serde_json::Value>(&doc.value) {
            Ok(v) => Ok(render::serve(Some(&v), now_s)),
            Err(e) => Ok(render::error_box(
                "The serve status in the KV (namespace serve, key status) is not JSON",
                &e.to_string(),
            )),
        },
    };
    page(&api, "Serve applications", "/serve", main)
}

async fn replicas_page(State(api): Shared) -> Response {
    let mut set = tokio::task::JoinSet::new();
    for (i, address) in api.head.config.replicas().into_iter().enumerate() {
        let token = api.token.clone();
        set.spawn(async move {
            let r = async {
                let mut c = tpuray_proto::client::head_replica(&address, token.as_deref())
                    .map_err(|e| e.to_string())?;
                let mut r = tonic::Request::new(pb::GetReplicaStatusRequest {});
                r.set_timeout(AGENT_TIMEOUT);
                c.get_replica_status(r).await.map(|r| r.into_inner()).map_err(why)
            }
            .await;
            (i as u64 + 1, address, r)
        });
    }
    let mut rows = Vec::new();
    while let Some(r) = set.join_next().await {
        if let Ok(r) = r {
            rows.push(r);
        }
    }
    rows.sort_by_key(|r| r.0);
    page(
        &api,
        "Head replicas",
        "/replicas",
        Ok(render::replicas(&rows, api.head.config.replica_id)),
    )
}

async fn timeline_page(State(api): Shared) -> Response {
    let (d, t) = tokio::join!(drivers(&api), tasks(&api, TASKS_READ));
    let main = match (d, t) {
        (Ok(d), Ok(t)) => Ok(render::timeline(&d, &t)),
        (Err(e), _) | (_, Err(e)) => Err(unreadable("The tasks", e)),
    };
    page(&api, "Timeline", "/timeline", main)
}

/// Ray's `/api/v0/tasks/timeline?job_id=...&download=1`: the Chrome trace JSON.
async fn timeline_json(State(api): Shared, r: Request) -> Response {
    let q = query_of(&r);
    let job = param(&q, "job_id").filter(|j| !j.is_empty()).map(str::to_string);
    let (t, st) = tokio::join!(tasks(&api, 0), status(&api));
    let (t, st) = match (t, st) {
        (Ok(t), Ok(st)) => (t, st),
        (Err(e), _) | (_, Err(e)) => {
            return text(
                StatusCode::SERVICE_UNAVAILABLE,
                &format!("the tasks could not be read from the cluster's leader: {e}"),
            );
        }
    };
    let events = crate::timeline::chrome_trace(&t.tasks, &st.nodes, job.as_deref(), now_ms());
    let mut resp = (
        StatusCode::OK,
        [(header::CONTENT_TYPE, "application/json")],
        serde_json::Value::Array(events).to_string(),
    )
        .into_response();
    if param(&q, "download") == Some("1") {
        let (y, m, d, h, mi, s) = render::utc(now_ms() / 1000);
        let job = job.as_deref().map(render::enc).unwrap_or_else(|| "None".into());
        let name = format!("timeline-{job}-{y:04}-{m:02}-{d:02}_{h:02}-{mi:02}-{s:02}.json");
        if let Ok(v) = HeaderValue::from_str(&format!("attachment; filename=\"{name}\"")) {
            resp.headers_mut().insert(header::CONTENT_DISPOSITION, v);
        }
    }
    resp
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn dash_3_tokens_compare_whole() {
        assert!(same_token("abc", Some("abc")));
        assert!(!same_token("abd", Some("abc")));
        assert!(!same_token("ab", Some("abc")));
        assert!(!same_token("", None));
    }

    #[test]
    fn dash_3_sign_in_only_goes_back_to_a_local_page() {
        assert_eq!(safe_next("/tasks?state=FAILED"), "/tasks?state=FAILED");
        for bad in
            ["//evil.example/x", "https://evil.example", "/\\evil", "", "tasks", "/a b", "/é"]
        {
            assert_eq!(safe_next(bad), "/", "{bad}");
        }
    }

    #[test]
    fn dash_3_the_token_leaves_the_address_after_use() {
        assert_eq!(without_token("token=abc"), "");
        assert_eq!(without_token("state=FAILED&token=abc&job=j"), "state=FAILED&job=j");
        assert_eq!(without_token("to%6Ben=abc&tokens=1"), "tokens=1");
    }

    #[test]
    fn dash_3_the_cookie_is_http_only_and_same_site() {
        let c = set_cookie("0123abcd");
        assert_eq!(
            c.to_str().unwrap(),
            "ray-authentication-token=0123abcd; Path=/; HttpOnly; SameSite=Strict"
        );
        let mut h = HeaderMap::new();
        h.insert(header::COOKIE, "x=1; ray-authentication-token=a%20b".parse().unwrap());
        assert_eq!(presented(&h).as_deref(), Some("a b"));
        h.insert(header::AUTHORIZATION, "Bearer tok".parse().unwrap());
        assert_eq!(presented(&h).as_deref(), Some("tok"), "a header wins over the cookie");
    }
}
