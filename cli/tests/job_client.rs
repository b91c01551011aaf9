//! The Jobs REST API client (`tpuray_cli::job`) and `tpuray job` against a fake job
//! server speaking Ray 2.60's routes and JSON (axum, in this process), so the client's
//! side of the contract is checked without a cluster: uploads only when a package is
//! missing, Ray's submit request, the log tail through a server that closes the stream
//! early, auth errors, and the CLI's lines and exit codes.

use std::collections::HashMap;
use std::net::SocketAddr;
use std::path::Path;
use std::process::Command;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use axum::Router;
use axum::body::Bytes;
use axum::extract::ws::{Message, WebSocket, WebSocketUpgrade};
use axum::extract::{Path as UrlPath, Request, State};
use axum::http::StatusCode;
use axum::middleware::{self, Next};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use serde_json::{Value, json};
use tpuray_cli::job::address::HttpAddress;
use tpuray_cli::job::{ClientOptions, JobClient, JobError, package, runtime_env};

const TOKEN: &str = "fake-cluster-token";
/// Lines every fake job prints, one per 30 ms.
const LINES: usize = 8;

#[derive(Default)]
struct Fake {
    packages: HashMap<String, Vec<u8>>,
    puts: usize,
    jobs: HashMap<String, Value>,
    logs: HashMap<String, String>,
    requests: Vec<Value>,
    tails: usize,
}

type S = Arc<Mutex<Fake>>;

async fn auth(req: Request, next: Next) -> Response {
    match req.headers().get("authorization").and_then(|v| v.to_str().ok()) {
        None => {
            (StatusCode::UNAUTHORIZED, "Unauthorized: Missing authentication token").into_response()
        }
        Some(v) if v != format!("Bearer {TOKEN}") => {
            (StatusCode::FORBIDDEN, "Forbidden: Invalid authentication token").into_response()
        }
        Some(_) => next.run(req).await,
    }
}

async fn version() -> Response {
    axum::Json(
        json!({"version": "3", "ray_version": "2.60.0", "ray_commit": "fake", "session_name": "s"}),
    )
    .into_response()
}

async fn get_package(State(s): State<S>, UrlPath((p, n)): UrlPath<(String, String)>) -> StatusCode {
    if s.lock().unwrap().packages.contains_key(&format!("{p}://{n}")) {
        StatusCode::OK
    } else {
        StatusCode::NOT_FOUND
    }
}

async fn put_package(
    State(s): State<S>,
    UrlPath((p, n)): UrlPath<(String, String)>,
    body: Bytes,
) -> StatusCode {
    let mut f = s.lock().unwrap();
    f.puts += 1;
    f.packages.insert(format!("{p}://{n}"), body.to_vec());
    StatusCode::OK
}

async fn submit(State(s): State<S>, axum::Json(req): axum::Json<Value>) -> Response {
    let id = req["submission_id"]
        .as_str()
        .map(String::from)
        .unwrap_or_else(|| format!("raysubmit_{}", s.lock().unwrap().jobs.len() + 1));
    let entrypoint = req["entrypoint"].as_str().unwrap_or_default().to_string();
    {
        let mut f = s.lock().unwrap();
        if f.jobs.contains_key(&id) {
            return (
                StatusCode::BAD_REQUEST,
                format!("Job with submission_id {id} already exists."),
            )
                .into_response();
        }
        f.requests.push(req.clone());
        f.jobs.insert(
            id.clone(),
            json!({"type": "SUBMISSION", "job_id": null, "submission_id": id, "driver_info": null,
                   "status": "RUNNING", "entrypoint": entrypoint, "message": "Job is currently running.",
                   "error_type": null, "start_time": 1, "end_time": null, "metadata": req["metadata"],
                   "runtime_env": req["runtime_env"], "driver_agent_http_address": null,
                   "driver_node_id": null, "driver_exit_code": null}),
        );
        f.logs.insert(id.clone(), String::new());
    }
    let (s2, id2) = (s.clone(), id.clone());
    tokio::spawn(async move {
        for i in 0..LINES {
            tokio::time::sleep(Duration::from_millis(30)).await;
            let mut f = s2.lock().unwrap();
            if f.jobs.get(&id2).is_none_or(|j| j["status"] == "STOPPED") {
                return;
            }
            f.logs.get_mut(&id2).unwrap().push_str(&format!("line {i}\n"));
        }
        let mut f = s2.lock().unwrap();
        let Some(job) = f.jobs.get_mut(&id2) else { return };
        if entrypoint.contains("fail") {
            job["status"] = json!("FAILED");
            job["message"] = json!(
                "Job entrypoint command failed with exit code 1, last available logs (truncated to 20,000 chars):\nline 7\n"
            );
        } else {
            job["status"] = json!("SUCCEEDED");
            job["message"] = json!("Job finished successfully.");
        }
    });
    axum::Json(json!({"job_id": id, "submission_id": id})).into_response()
}

async fn list(State(s): State<S>) -> Response {
    let mut jobs: Vec<Value> = s.lock().unwrap().jobs.values().cloned().collect();
    jobs.sort_by_key(|j| j["submission_id"].as_str().unwrap_or_default().to_string());
    axum::Json(Value::Array(jobs)).into_response()
}

fn missing(id: &str) -> Response {
    (StatusCode::NOT_FOUND, format!("Job {id} does not exist")).into_response()
}

async fn info(State(s): State<S>, UrlPath(id): UrlPath<String>) -> Response {
    match s.lock().unwrap().jobs.get(&id) {
        Some(j) => axum::Json(j.clone()).into_response(),
        None => missing(&id),
    }
}

async fn delete(State(s): State<S>, UrlPath(id): UrlPath<String>) -> Response {
    match s.lock().unwrap().jobs.remove(&id) {
        Some(_) => axum::Json(json!({"deleted": true})).into_response(),
        None => missing(&id),
    }
}

async fn stop(State(s): State<S>, UrlPath(id): UrlPath<String>) -> Response {
    let mut f = s.lock().unwrap();
    let Some(j) = f.jobs.get_mut(&id) else { return missing(&id) };
    let running = j["status"] == "RUNNING";
    if running {
        j["status"] = json!("STOPPED");
        j["message"] = json!("Job was intentionally stopped.");
    }
    axum::Json(json!({"stopped": running})).into_response()
}

async fn logs(State(s): State<S>, UrlPath(id): UrlPath<String>) -> Response {
    match s.lock().unwrap().logs.get(&id) {
        Some(l) => axum::Json(json!({"logs": l})).into_response(),
        None => missing(&id),
    }
}

/// Streams the job's logs; the first tail of each server closes after its first chunk
/// (a server or proxy that hangs up early), later ones run until the job ended.
async fn tail(State(s): State<S>, UrlPath(id): UrlPath<String>, ws: WebSocketUpgrade) -> Response {
    let first = {
        let mut f = s.lock().unwrap();
        if !f.jobs.contains_key(&id) {
            return missing(&id);
        }
        f.tails += 1;
        f.tails == 1
    };
    ws.on_upgrade(move |socket| stream_logs(socket, s, id, first))
}

async fn stream_logs(mut socket: WebSocket, s: S, id: String, close_early: bool) {
    let mut sent = 0;
    loop {
        let (chunk, ended) = {
            let f = s.lock().unwrap();
            let logs = &f.logs[&id];
            let status = f.jobs[&id]["status"].as_str().unwrap_or_default().to_string();
            (
                logs[sent..].to_string(),
                matches!(status.as_str(), "SUCCEEDED" | "FAILED" | "STOPPED"),
            )
        };
        if !chunk.is_empty() {
            sent += chunk.len();
            if socket.send(Message::Text(chunk.into())).await.is_err() {
                return;
            }
            if close_early {
                let _ = socket.send(Message::Close(None)).await;
                return;
            }
        }
        if ended {
            let _ = socket.send(Message::Close(None)).await;
            return;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}

/// Starts a fake server on a free port; returns its address and state.
fn fake_server() -> (SocketAddr, S) {
    let state: S = Arc::default();
    let app = Router::new()
        .route("/api/version", get(version))
        .route("/api/packages/{protocol}/{name}", get(get_package).put(put_package))
        .route("/api/jobs/", post(submit).get(list))
        .route("/api/jobs/{id}", get(info).delete(delete))
        .route("/api/jobs/{id}/stop", post(stop))
        .route("/api/jobs/{id}/logs", get(logs))
        .route("/api/jobs/{id}/logs/tail", get(tail))
        .layer(middleware::from_fn(auth))
        .with_state(state.clone());
    let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    listener.set_nonblocking(true).unwrap();
    let addr = listener.local_addr().unwrap();
    std::thread::spawn(move || {
        let rt = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(2)
            .enable_all()
            .build()
            .unwrap();
        rt.block_on(async move {
            let l = tokio::net::TcpListener::from_std(listener).unwrap();
            axum::serve(l, app).await.unwrap();
        });
    });
    (addr, state)
}

fn client(addr: SocketAddr, token: Option<&str>) -> JobClient {
    let a = HttpAddress {
        host: addr.ip().to_string(),
        port: addr.port(),
        prefix: String::new(),
        https: false,
    };
    JobClient::with_address(a, &ClientOptions::default(), token).unwrap()
}

fn wait_terminal(c: &JobClient, id: &str) -> String {
    for _ in 0..200 {
        let s = c.job_status(id).unwrap();
        if matches!(s.as_str(), "SUCCEEDED" | "FAILED" | "STOPPED") {
            return s;
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    panic!("job {id} never ended");
}

fn prepare(c: &JobClient, env: Value, cwd: &Path) -> Value {
    runtime_env::prepare(c, env, cwd, &mut |_| {}).unwrap()
}

#[test]
fn a_local_working_dir_is_uploaded_once_and_sent_as_its_uri() {
    let (addr, state) = fake_server();
    let c = client(addr, Some(TOKEN));
    assert_eq!(c.version().unwrap(), "3");
    let d = tempfile::tempdir().unwrap();
    std::fs::write(d.path().join("train.py"), "print('hi')\n").unwrap();
    std::fs::write(d.path().join("requirements.txt"), "six==1.16.0\nidna\n").unwrap();
    let env = json!({"working_dir": ".", "pip": "requirements.txt", "env_vars": {"A": "1"}});
    let ready = prepare(&c, env.clone(), d.path());
    let expected =
        package::package_directory(d.path(), &package::default_excludes(), true, false).unwrap();
    assert_eq!(ready["working_dir"], expected.uri.as_str());
    assert_eq!(ready["pip"], json!(["six==1.16.0", "idna"]));
    assert_eq!(ready["env_vars"], json!({"A": "1"}));
    assert_eq!(state.lock().unwrap().packages[&expected.uri], expected.bytes);
    // Unchanged: found on the server, not uploaded again.
    prepare(&c, env, d.path());
    assert_eq!(state.lock().unwrap().puts, 1);
    // URIs pass as they are; a remote one must name an archive.
    let uri = json!({"working_dir": "https://example.invalid/src.zip"});
    assert_eq!(prepare(&c, uri.clone(), d.path()), uri);
    let e =
        runtime_env::prepare(&c, json!({"working_dir": "s3://bucket/src"}), d.path(), &mut |_| {});
    assert!(e.unwrap_err().to_string().contains("must name an archive"));
    let e = runtime_env::prepare(&c, json!({"working_dir": "nope"}), d.path(), &mut |_| {});
    assert!(e.unwrap_err().to_string().contains("\"nope\" must be an existing directory"));

    let id = c
        .submit(
            json!({"entrypoint": "python train.py", "runtime_env": ready, "submission_id": "mine",
                       "entrypoint_num_cpus": null, "metadata": {"k": "v"}}),
        )
        .unwrap();
    assert_eq!(id, "mine");
    let sent = state.lock().unwrap().requests[0].clone();
    assert!(
        sent.get("entrypoint_num_cpus").is_none(),
        "null fields are left out as Ray's client does: {sent}"
    );
    assert_eq!(sent["metadata"], json!({"k": "v"}));
    let e = c.submit(json!({"entrypoint": "x", "submission_id": "mine"})).unwrap_err();
    assert!(matches!(e, JobError::Status { status: 400, .. }), "{e}");
}

#[test]
fn jobc_2_the_tail_delivers_every_line_once_in_order_through_a_stream_closed_early() {
    let (addr, state) = fake_server();
    let c = client(addr, Some(TOKEN));
    let id = c.submit(json!({"entrypoint": "echo"})).unwrap();
    let mut tail = c.tail(&id);
    let mut all = String::new();
    while let Some(chunk) = tail.next_chunk().unwrap() {
        all.push_str(&chunk);
    }
    let expected: String = (0..LINES).map(|i| format!("line {i}\n")).collect();
    assert_eq!(all, expected);
    assert!(
        state.lock().unwrap().tails >= 2,
        "the first stream closed early, so the tail reconnected"
    );
    assert_eq!(c.job_status(&id).unwrap(), "SUCCEEDED");
    assert_eq!(c.logs(&id).unwrap(), expected);
    let jobs = c.list().unwrap();
    assert_eq!(jobs.len(), 1);
    // Other routes of the same server, raw.
    let raw = c.get(&format!("/api/jobs/{id}"), Duration::from_secs(5)).unwrap();
    assert_eq!(serde_json::from_str::<Value>(&raw).unwrap()["status"], "SUCCEEDED");
    assert!(matches!(
        c.get("/api/nope", Duration::from_secs(5)),
        Err(JobError::Status { status: 404, .. })
    ));
    assert!(matches!(c.get("api/version", Duration::from_secs(5)), Err(JobError::Invalid(_))));
    assert!(c.delete(&id).unwrap());
    let e = c.tail(&id).next_chunk().unwrap_err();
    assert!(
        matches!(&e, JobError::Status { status: 404, body } if body.contains("does not exist")),
        "{e}"
    );
}

#[test]
fn stop_and_missing_jobs_and_tokens_answer_as_rays_server_does() {
    let (addr, _state) = fake_server();
    let c = client(addr, Some(TOKEN));
    let id = c.submit(json!({"entrypoint": "sleep"})).unwrap();
    assert!(c.stop(&id).unwrap());
    assert_eq!(wait_terminal(&c, &id), "STOPPED");
    assert!(!c.stop(&id).unwrap(), "a job that ended is not stopped again");
    let e = c.job_info("nope").unwrap_err();
    assert_eq!(e.to_string(), "request failed with status code 404: Job nope does not exist");
    let e = client(addr, None).list().unwrap_err();
    assert!(matches!(e, JobError::Auth { status: 401, .. }), "{e}");
    assert!(e.to_string().contains("authentication required"), "{e}");
    let e = client(addr, Some("wrong")).version().unwrap_err();
    assert!(matches!(e, JobError::Auth { status: 403, .. }), "{e}");
    // A caller's own Authorization header wins over the cluster token.
    let a = HttpAddress {
        host: addr.ip().to_string(),
        port: addr.port(),
        prefix: String::new(),
        https: false,
    };
    let mut opts = ClientOptions::default();
    opts.headers.insert("Authorization".into(), "Bearer wrong".into());
    let e = JobClient::with_address(a, &opts, Some(TOKEN)).unwrap().list().unwrap_err();
    assert!(matches!(e, JobError::Auth { status: 403, .. }), "{e}");
    // Nothing listening.
    let closed = std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap();
    let e = client(closed, None).version().unwrap_err();
    assert!(matches!(e, JobError::Connect { .. }), "{e}");
}

fn tpuray(args: &[&str], cwd: &Path, token: &str) -> (i32, String, String) {
    let out = Command::new(env!("CARGO_BIN_EXE_tpuray"))
        .args(args)
        .current_dir(cwd)
        .env("TPURAY_AUTH_TOKEN", token)
        .env("TPURAY_REGISTRY_DIR", cwd.join("no-registry"))
        .env_remove("RAY_ADDRESS")
        .env_remove("RAY_API_SERVER_ADDRESS")
        .env_remove("TPURAY_ADDRESS")
        .env_remove("RAY_JOB_HEADERS")
        .output()
        .unwrap();
    (
        out.status.code().unwrap_or(-1),
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

#[test]
fn the_cli_prints_rays_lines_and_exits_1_when_the_job_failed() {
    let (addr, state) = fake_server();
    let url = format!("http://{addr}");
    let d = tempfile::tempdir().unwrap();
    std::fs::write(d.path().join("main.py"), "").unwrap();
    let (code, out, err) = tpuray(
        &[
            "job",
            "submit",
            "--address",
            &url,
            "--working-dir",
            ".",
            "--submission-id",
            "ok1",
            "--entrypoint-num-cpus",
            "1",
            "--",
            "python",
            "main.py",
            "a b",
        ],
        d.path(),
        TOKEN,
    );
    assert_eq!(code, 0, "{out}\n{err}");
    for line in [
        &format!("Job submission server address: {url}"),
        "Job 'ok1' submitted successfully",
        "    tpuray job logs ok1",
        "Tailing logs until the job exits (disable with --no-wait):",
        "line 0\n",
        "line 7\n",
        "Job 'ok1' succeeded",
    ] {
        assert!(out.contains(line), "{line:?} missing from:\n{out}");
    }
    let req = state.lock().unwrap().requests[0].clone();
    assert_eq!(req["entrypoint"], "python main.py 'a b'");
    assert_eq!(req["entrypoint_num_cpus"], 1.0);
    assert!(req["runtime_env"]["working_dir"].as_str().unwrap().starts_with("gcs://_ray_pkg_"));

    let (code, out, _) = tpuray(
        &["job", "submit", "--address", &url, "--submission-id", "bad", "--", "fail"],
        d.path(),
        TOKEN,
    );
    assert_eq!(code, 1, "{out}");
    assert!(
        out.contains("Job 'bad' failed")
            && out.contains("Status message: Job entrypoint command failed"),
        "{out}"
    );

    let (code, out, _) = tpuray(&["job", "status", "--address", &url, "ok1"], d.path(), TOKEN);
    assert_eq!(code, 0);
    assert!(out.contains("Job 'ok1' succeeded"), "{out}");
    let (code, out, _) = tpuray(&["job", "logs", "--address", &url, "ok1"], d.path(), TOKEN);
    assert_eq!(code, 0);
    assert!(out.ends_with("line 6\nline 7\n"), "{out}");
    let (code, out, _) = tpuray(&["job", "list", "--address", &url], d.path(), TOKEN);
    assert_eq!(code, 0);
    assert!(
        out.contains("JobDetails(type=<JobType.SUBMISSION: 'SUBMISSION'>")
            && out.contains("submission_id='ok1'"),
        "{out}"
    );

    let (code, out, _) = tpuray(
        &[
            "job",
            "submit",
            "--address",
            &url,
            "--no-wait",
            "--submission-id",
            "long",
            "--",
            "sleep",
        ],
        d.path(),
        TOKEN,
    );
    assert_eq!(code, 0);
    assert!(!out.contains("Tailing logs"), "{out}");
    let (code, out, _) = tpuray(&["job", "stop", "--address", &url, "long"], d.path(), TOKEN);
    assert_eq!(code, 0);
    assert!(
        out.contains("Attempting to stop job 'long'") && out.contains("Job 'long' was stopped"),
        "{out}"
    );
    let (code, out, _) = tpuray(&["job", "delete", "--address", &url, "long"], d.path(), TOKEN);
    assert_eq!(code, 0);
    assert!(out.contains("Job 'long' deleted successfully"), "{out}");

    // Errors name what was wrong.
    let (code, _, err) = tpuray(&["job", "status", "--address", &url, "nope"], d.path(), TOKEN);
    assert_eq!(code, 1);
    assert!(
        err.contains("tpuray: request failed with status code 404: Job nope does not exist"),
        "{err}"
    );
    let (code, _, err) = tpuray(&["job", "list", "--address", &url], d.path(), "wrong");
    assert_eq!(code, 1);
    assert!(err.contains("authentication failed (403"), "{err}");
    let (code, _, err) = tpuray(
        &[
            "job",
            "list",
            "--address",
            &url,
            "--headers",
            &format!(r#"{{"Authorization": "Bearer {TOKEN}"}}"#),
        ],
        d.path(),
        "wrong",
    );
    assert_eq!(code, 0, "--headers' Authorization wins: {err}");
    let (code, _, err) = tpuray(
        &["job", "submit", "--address", &url, "--entrypoint-resources", "[1]", "--", "x"],
        d.path(),
        TOKEN,
    );
    assert_eq!(code, 1);
    assert!(err.contains("--entrypoint-resources must be a JSON object"), "{err}");
    let (code, _, err) = tpuray(
        &["job", "submit", "--address", &url, "--log-style", "record", "--", "x"],
        d.path(),
        TOKEN,
    );
    assert_eq!(code, 2);
    assert!(err.contains("--log-style"), "{err}");
    // Words after the first one of the entrypoint are its own, flags included.
    let (code, out, _) = tpuray(
        &[
            "job",
            "submit",
            "--address",
            &url,
            "--no-wait",
            "--submission-id",
            "w",
            "python",
            "-c",
            "x",
            "--no-wait",
        ],
        d.path(),
        TOKEN,
    );
    assert_eq!(code, 0, "{out}");
    let req = state.lock().unwrap().requests.last().cloned().unwrap();
    assert_eq!(req["entrypoint"], "python -c x --no-wait");
    let (code, _, err) = tpuray(&["job", "list"], d.path(), TOKEN);
    assert_eq!(code, 1);
    assert!(
        err.contains("no job server address given and no cluster found on this machine"),
        "{err}"
    );
}
