//! [`JobClient`]: Ray 2.60's Jobs REST API over HTTP/1.1 (one connection per call, as
//! Ray's `requests` calls are), and [`LogTail`], the log stream over a WebSocket.
//!
//! Routes (Ray's `dashboard/modules/job/sdk.py` and `dashboard_sdk.py`): `GET
//! /api/version`; `GET|PUT /api/packages/{protocol}/{name}` (200 exists, 404 missing;
//! the PUT body is the package's bytes); `POST /api/jobs/` (a `JobSubmitRequest`,
//! answered `{"job_id", "submission_id"}`); `GET /api/jobs/` (a list of `JobDetails`);
//! `GET|DELETE /api/jobs/{id}` (`{"deleted": bool}`); `POST /api/jobs/{id}/stop`
//! (`{"stopped": bool}`); `GET /api/jobs/{id}/logs` (`{"logs": str}`); WebSocket `GET
//! /api/jobs/{id}/logs/tail` (text frames, closed once the job ended and every line was
//! sent). Any status but 200 is an error whose text body is the server's message; 401
//! and 403 are auth errors.
//!
//! Auth: `Authorization: Bearer <cluster token>` on every request (`TPURAY_AUTH_TOKEN`,
//! then Ray's `RAY_AUTH_TOKEN`, then `~/.tpuray/auth_token`), unless the caller's headers
//! carry an `Authorization` header of their own (Ray's rule).
//!
//! HTTP is hyper (one HTTP/1.1 connection per call); the log tail is tokio-tungstenite.
//!
//! JOBC-2 ([`LogTail`]): a log tail delivers every byte once, in order, and ends only
//! when the job is terminal; a stream that closes early or breaks is reopened and the
//! bytes already delivered are skipped (five failed reconnects in a row end it with the
//! error).

use std::collections::BTreeMap;
use std::time::Duration;

use bytes::Bytes;
use http::header::{AUTHORIZATION, CONTENT_TYPE, HOST, HeaderName, HeaderValue};
use http::{Method, Request, StatusCode};
use http_body_util::{BodyExt, Full};
use hyper_util::rt::TokioIo;
use serde_json::{Value, json};
use tokio::net::TcpStream;
use tokio_stream::StreamExt;
use tokio_tungstenite::WebSocketStream;
use tokio_tungstenite::tungstenite::Message;
use tokio_tungstenite::tungstenite::client::IntoClientRequest;
use tpuray_proto::tls::ClientStream;

use super::address::{self, HttpAddress};
use super::{JobError, block_on};

/// How long connecting to the server may take.
const CONNECT_TIMEOUT: Duration = Duration::from_secs(10);
/// How long one request may take once connected (an upload of a large package included).
const REQUEST_TIMEOUT: Duration = Duration::from_secs(600);
/// Ray's environment variable for the token its clients send in token auth mode.
const RAY_TOKEN_ENV: &str = "RAY_AUTH_TOKEN";

/// How a [`JobClient`] is made; every field is optional.
#[derive(Clone, Debug, Default)]
pub struct ClientOptions {
    /// The server's address (see [`address`]); `None`: the environment, then this
    /// machine's cluster.
    pub address: Option<String>,
    /// Ray's rule for `JobSubmissionClient`: `RAY_API_SERVER_ADDRESS`/`RAY_ADDRESS`
    /// override `address`. The CLI passes `false` (its `--address` wins).
    pub env_overrides: bool,
    /// Headers sent with every request (Ray's `headers`).
    pub headers: BTreeMap<String, String>,
    /// Cookies sent with every request (Ray's `cookies`).
    pub cookies: BTreeMap<String, String>,
    /// Metadata merged into every submitted job's (Ray's `metadata`).
    pub metadata: BTreeMap<String, String>,
}

/// A client of one job server. Cheap to clone. Every method blocks (see the module doc
/// of [`super`]).
#[derive(Clone, Debug)]
pub struct JobClient {
    address: HttpAddress,
    headers: Vec<(HeaderName, HeaderValue)>,
    metadata: BTreeMap<String, String>,
}

/// The cluster token, if this process has one.
fn cluster_token() -> Result<Option<String>, JobError> {
    if let Ok(t) = std::env::var(tpuray_proto::auth::TOKEN_ENV)
        && !t.trim().is_empty()
    {
        return Ok(Some(t.trim().to_string()));
    }
    if let Ok(t) = std::env::var(RAY_TOKEN_ENV)
        && !t.trim().is_empty()
    {
        return Ok(Some(t.trim().to_string()));
    }
    tpuray_proto::auth::load_token().map_err(|e| JobError::Invalid(e.to_string()))
}

fn header_pair(k: &str, v: &str) -> Result<(HeaderName, HeaderValue), JobError> {
    let name = HeaderName::from_bytes(k.as_bytes()).map_err(|_| {
        JobError::Invalid(format!("header name {k:?} is not a valid HTTP header name"))
    })?;
    let value = HeaderValue::from_str(v).map_err(|_| {
        JobError::Invalid(format!("header {k:?} has a value that is not valid in HTTP: {v:?}"))
    })?;
    Ok((name, value))
}

/// Percent-encodes one path segment (a job or package id) or query value: every byte
/// but RFC 3986's unreserved characters.
pub(crate) fn segment(s: &str) -> String {
    let mut out = String::with_capacity(s.len());
    for b in s.bytes() {
        if b.is_ascii_alphanumeric() || b"-._~".contains(&b) {
            out.push(b as char);
        } else {
            out.push_str(&format!("%{b:02X}"));
        }
    }
    out
}

fn parse_json(what: &str, body: &[u8]) -> Result<Value, JobError> {
    serde_json::from_slice(body).map_err(|e| {
        JobError::Protocol(format!(
            "the job server's answer to {what} is not JSON ({e}): {:?}",
            String::from_utf8_lossy(&body[..body.len().min(200)])
        ))
    })
}

fn field<'a>(what: &str, v: &'a Value, key: &str) -> Result<&'a Value, JobError> {
    v.get(key).ok_or_else(|| {
        JobError::Protocol(format!("the job server's answer to {what} has no {key:?}: {v}"))
    })
}

/// An error for a status other than 200.
fn status_error(status: StatusCode, body: &[u8]) -> JobError {
    let body = String::from_utf8_lossy(body).into_owned();
    match status.as_u16() {
        s @ (401 | 403) => JobError::Auth { status: s, body },
        s => JobError::Status { status: s, body },
    }
}

impl JobClient {
    /// Resolves the server's address and checks that it serves the Jobs API (`GET
    /// /api/version`, as Ray's client does on construction).
    pub fn connect(opts: ClientOptions) -> Result<Self, JobError> {
        let token = cluster_token()?;
        let addr = block_on(address::resolve(
            opts.address.as_deref(),
            opts.env_overrides,
            token.as_deref(),
        ))?;
        let client = Self::with_address(addr, &opts, token.as_deref())?;
        client.version()?;
        Ok(client)
    }

    /// A client of the server at `address` sending `token` (unless `opts.headers` has an
    /// `Authorization` header); no request is made.
    pub fn with_address(
        address: HttpAddress,
        opts: &ClientOptions,
        token: Option<&str>,
    ) -> Result<Self, JobError> {
        let mut headers = Vec::new();
        for (k, v) in &opts.headers {
            headers.push(header_pair(k, v)?);
        }
        if !headers.iter().any(|(k, _)| k == AUTHORIZATION)
            && let Some(t) = token
        {
            headers.push(header_pair("authorization", &format!("Bearer {t}"))?);
        }
        if !opts.cookies.is_empty() {
            let c: Vec<String> = opts.cookies.iter().map(|(k, v)| format!("{k}={v}")).collect();
            headers.push(header_pair("cookie", &c.join("; "))?);
        }
        Ok(Self { address, headers, metadata: opts.metadata.clone() })
    }

    /// The server's address, `http://HOST:PORT` (Ray's `get_address()`).
    pub fn address(&self) -> String {
        self.address.url()
    }

    /// A connection to the server: TCP, and for an `https://` address TLS over it with
    /// this process's identity (TLS-2), the server's certificate checked against its host.
    async fn connect_tcp(&self) -> Result<ClientStream, JobError> {
        let a = &self.address;
        let err = |reason: String| JobError::Connect { address: a.url(), reason };
        let tls = if a.https {
            match tpuray_proto::tls::current().map_err(&err)? {
                Some(t) => Some(t.as_ref()),
                None => {
                    return Err(err(format!(
                        "an https:// job server (a TLS cluster's) needs this process's TLS identity: set {}, {} and {}",
                        tpuray_proto::tls::CERT_ENV,
                        tpuray_proto::tls::KEY_ENV,
                        tpuray_proto::tls::CA_ENV
                    )));
                }
            }
        } else {
            None
        };
        let tcp =
            tokio::time::timeout(CONNECT_TIMEOUT, TcpStream::connect((a.host.as_str(), a.port)))
                .await
                .map_err(|_| err(format!("no answer in {} s", CONNECT_TIMEOUT.as_secs())))?
                .map_err(|e| err(e.to_string()))?;
        let _ = tcp.set_nodelay(true);
        ClientStream::connect(tcp, &a.host, tls).await.map_err(err)
    }

    async fn request_async(
        &self,
        method: Method,
        path: &str,
        body: Option<(&'static str, Bytes)>,
    ) -> Result<(StatusCode, Bytes), JobError> {
        self.request_within(method, path, body, REQUEST_TIMEOUT).await
    }

    /// An HTTP/1 connection to the server (driven by a task of its own) and a request to
    /// `path` with this client's headers, ready for its body.
    async fn http1(
        &self,
        method: Method,
        path: &str,
    ) -> Result<
        (hyper::client::conn::http1::SendRequest<Full<Bytes>>, http::request::Builder),
        JobError,
    > {
        let tcp = self.connect_tcp().await?;
        let (sender, conn) = hyper::client::conn::http1::handshake(TokioIo::new(tcp))
            .await
            .map_err(|e| self.broken(e))?;
        tokio::spawn(async move {
            let _ = conn.await;
        });
        let mut req = Request::builder()
            .method(method)
            .uri(format!("{}{}", self.address.prefix, path))
            .header(HOST, self.address.authority());
        for (k, v) in &self.headers {
            req = req.header(k, v);
        }
        Ok((sender, req))
    }

    /// The error of a connection that broke mid-exchange.
    fn broken(&self, e: hyper::Error) -> JobError {
        JobError::Connect {
            address: self.address.url(),
            reason: format!("the connection failed: {e}"),
        }
    }

    async fn request_within(
        &self,
        method: Method,
        path: &str,
        body: Option<(&'static str, Bytes)>,
        timeout: Duration,
    ) -> Result<(StatusCode, Bytes), JobError> {
        let (mut sender, mut req) = self.http1(method, path).await?;
        let broken = |e| self.broken(e);
        let data = match body {
            Some((content_type, data)) => {
                req = req.header(CONTENT_TYPE, content_type);
                data
            }
            None => Bytes::new(),
        };
        let req = req
            .body(Full::new(data))
            .map_err(|e| JobError::Invalid(format!("cannot build the request for {path}: {e}")))?;
        let exchange = async {
            let resp = sender.send_request(req).await.map_err(broken)?;
            let status = resp.status();
            let body = resp.into_body().collect().await.map_err(broken)?.to_bytes();
            Ok::<_, JobError>((status, body))
        };
        tokio::time::timeout(timeout, exchange).await.map_err(|_| JobError::Connect {
            address: self.address.url(),
            reason: format!("no answer to {path} in {:.1} s", timeout.as_secs_f64()),
        })?
    }

    /// One request; returns the body of a 200 answer, an error for any other.
    fn call(
        &self,
        method: Method,
        path: &str,
        body: Option<(&'static str, Bytes)>,
    ) -> Result<Bytes, JobError> {
        let (status, body) = block_on(self.request_async(method, path, body))?;
        if status == StatusCode::OK { Ok(body) } else { Err(status_error(status, &body)) }
    }

    /// `GET path_and_query` on the same server (routes beyond the Jobs API, such as
    /// Ray's state API `/api/v0/...`): the body of a 200 answer as text, an error for any
    /// other; `timeout` bounds the exchange once connected.
    pub fn get(&self, path_and_query: &str, timeout: Duration) -> Result<String, JobError> {
        if !path_and_query.starts_with('/') {
            return Err(JobError::Invalid(format!(
                "request path {path_and_query:?} must start with /"
            )));
        }
        let (status, body) =
            block_on(self.request_within(Method::GET, path_and_query, None, timeout))?;
        if status != StatusCode::OK {
            return Err(status_error(status, &body));
        }
        Ok(String::from_utf8_lossy(&body).into_owned())
    }

    /// `GET path_and_query`, the body read as it arrives (the logs API's
    /// `/api/v0/logs/{file,stream}`): an error for a status other than 200 (with the
    /// server's text), else a [`BodyStream`]. `timeout` bounds the wait for the status.
    pub fn get_stream(
        &self,
        path_and_query: &str,
        timeout: Duration,
    ) -> Result<BodyStream, JobError> {
        if !path_and_query.starts_with('/') {
            return Err(JobError::Invalid(format!(
                "request path {path_and_query:?} must start with /"
            )));
        }
        block_on(async {
            let (mut sender, req) = self.http1(Method::GET, path_and_query).await?;
            let url = self.address.url();
            let broken = |e| self.broken(e);
            let req = req.body(Full::new(Bytes::new())).map_err(|e| {
                JobError::Invalid(format!("cannot build the request for {path_and_query}: {e}"))
            })?;
            let resp = tokio::time::timeout(timeout, sender.send_request(req))
                .await
                .map_err(|_| JobError::Connect {
                    address: url.clone(),
                    reason: format!(
                        "no answer to {path_and_query} in {:.1} s",
                        timeout.as_secs_f64()
                    ),
                })?
                .map_err(broken)?;
            let status = resp.status();
            if status != StatusCode::OK {
                let body = resp.into_body().collect().await.map_err(broken)?.to_bytes();
                return Err(status_error(status, &body));
            }
            Ok(BodyStream { body: resp.into_body(), url })
        })
    }

    /// `GET /api/version`: `{"version", "ray_version", "ray_commit", "session_name"}`.
    pub fn version_info(&self) -> Result<Value, JobError> {
        let (status, body) = block_on(self.request_async(Method::GET, "/api/version", None))?;
        if status == StatusCode::NOT_FOUND {
            return Err(JobError::Protocol(format!(
                "{} answered 404 to /api/version: it serves no Jobs API (is this a head's dashboard port?)",
                self.address()
            )));
        }
        if status != StatusCode::OK {
            return Err(status_error(status, &body));
        }
        parse_json("GET /api/version", &body)
    }

    /// The job API's version (Ray's `get_version()`: the `version` field, e.g. "3").
    pub fn version(&self) -> Result<String, JobError> {
        let v = self.version_info()?;
        Ok(match field("GET /api/version", &v, "version")? {
            Value::String(s) => s.clone(),
            other => other.to_string(),
        })
    }

    /// Whether the server holds the package `uri` (`gcs://NAME`).
    pub fn package_exists(&self, uri: &str) -> Result<bool, JobError> {
        let path = package_path(uri)?;
        let (status, body) = block_on(self.request_async(Method::GET, &path, None))?;
        match status {
            StatusCode::OK => Ok(true),
            StatusCode::NOT_FOUND => Ok(false),
            s => Err(status_error(s, &body)),
        }
    }

    /// Uploads a package's bytes under `uri`.
    pub fn upload_package(&self, uri: &str, bytes: Vec<u8>) -> Result<(), JobError> {
        let path = package_path(uri)?;
        self.call(Method::PUT, &path, Some(("application/octet-stream", Bytes::from(bytes))))?;
        Ok(())
    }

    /// Submits a job (`request`: a `JobSubmitRequest` object, `runtime_env` already
    /// prepared, see [`super::runtime_env`]); this client's metadata is merged into the
    /// job's (Ray: `metadata.update(default_metadata)`). Keys whose value is null are
    /// left out. Returns the submission id.
    pub fn submit(&self, mut request: Value) -> Result<String, JobError> {
        let Some(obj) = request.as_object_mut() else {
            return Err(JobError::Invalid("the job submit request must be a JSON object".into()));
        };
        if !self.metadata.is_empty() {
            let md = obj.entry("metadata").or_insert_with(|| json!({}));
            if md.is_null() {
                *md = json!({});
            }
            let Some(m) = md.as_object_mut() else {
                return Err(JobError::Invalid(format!(
                    "metadata must be a dict of str to str, got {md}"
                )));
            };
            for (k, v) in &self.metadata {
                m.insert(k.clone(), Value::String(v.clone()));
            }
        }
        obj.retain(|_, v| !v.is_null());
        let body = serde_json::to_vec(&request).expect("a JSON value serializes");
        let reply =
            self.call(Method::POST, "/api/jobs/", Some(("application/json", Bytes::from(body))))?;
        let v = parse_json("POST /api/jobs/", &reply)?;
        match field("POST /api/jobs/", &v, "submission_id")? {
            Value::String(s) => Ok(s.clone()),
            other => Err(JobError::Protocol(format!(
                "the job server's answer to POST /api/jobs/ has a submission_id that is not a string: {other}"
            ))),
        }
    }

    /// `GET /api/jobs/{id}`: the job's `JobDetails` object.
    pub fn job_info(&self, job_id: &str) -> Result<Value, JobError> {
        let what = format!("GET /api/jobs/{job_id}");
        let body = self.call(Method::GET, &format!("/api/jobs/{}", segment(job_id)), None)?;
        let v = parse_json(&what, &body)?;
        field(&what, &v, "status")?;
        Ok(v)
    }

    /// The job's status (`PENDING`, `RUNNING`, `STOPPED`, `SUCCEEDED`, `FAILED`).
    pub fn job_status(&self, job_id: &str) -> Result<String, JobError> {
        let v = self.job_info(job_id)?;
        Ok(v["status"].as_str().unwrap_or_default().to_string())
    }

    /// `GET /api/jobs/`: every job's `JobDetails`.
    pub fn list(&self) -> Result<Vec<Value>, JobError> {
        let body = self.call(Method::GET, "/api/jobs/", None)?;
        match parse_json("GET /api/jobs/", &body)? {
            Value::Array(a) => Ok(a),
            other => Err(JobError::Protocol(format!(
                "the job server's answer to GET /api/jobs/ is not a list: {other}"
            ))),
        }
    }

    /// Asks the job to stop; `true` if it was running.
    pub fn stop(&self, job_id: &str) -> Result<bool, JobError> {
        let what = format!("POST /api/jobs/{job_id}/stop");
        let body = self.call(Method::POST, &format!("/api/jobs/{}/stop", segment(job_id)), None)?;
        let v = parse_json(&what, &body)?;
        Ok(field(&what, &v, "stopped")?.as_bool().unwrap_or(false))
    }

    /// Deletes a job that ended; `true` if it was deleted.
    pub fn delete(&self, job_id: &str) -> Result<bool, JobError> {
        let what = format!("DELETE /api/jobs/{job_id}");
        let body = self.call(Method::DELETE, &format!("/api/jobs/{}", segment(job_id)), None)?;
        let v = parse_json(&what, &body)?;
        Ok(field(&what, &v, "deleted")?.as_bool().unwrap_or(false))
    }

    /// Every log line the job wrote so far, as one string.
    pub fn logs(&self, job_id: &str) -> Result<String, JobError> {
        let what = format!("GET /api/jobs/{job_id}/logs");
        let body = self.call(Method::GET, &format!("/api/jobs/{}/logs", segment(job_id)), None)?;
        let v = parse_json(&what, &body)?;
        Ok(field(&what, &v, "logs")?.as_str().unwrap_or_default().to_string())
    }

    /// Follows the job's logs until it ends (see [`LogTail`]).
    pub fn tail(&self, job_id: &str) -> LogTail {
        LogTail {
            client: self.clone(),
            job_id: job_id.to_string(),
            ws: None,
            sent: 0,
            skip: 0,
            failures: 0,
            done: false,
        }
    }

    async fn open_tail(&self, job_id: &str) -> Result<WebSocketStream<ClientStream>, JobError> {
        let path = format!("{}/api/jobs/{}/logs/tail", self.address.prefix, segment(job_id));
        let scheme = if self.address.https { "wss" } else { "ws" };
        let url = format!("{scheme}://{}{}", self.address.authority(), path);
        let mut req = url.as_str().into_client_request().map_err(|e| {
            JobError::Invalid(format!("cannot build the WebSocket request for {url}: {e}"))
        })?;
        for (k, v) in &self.headers {
            req.headers_mut().insert(k.clone(), v.clone());
        }
        let tcp = self.connect_tcp().await?;
        let handshake = tokio_tungstenite::client_async(req, tcp);
        match tokio::time::timeout(REQUEST_TIMEOUT, handshake).await {
            Err(_) => Err(JobError::Connect {
                address: self.address.url(),
                reason: format!("no answer to the WebSocket handshake for {path}"),
            }),
            Ok(Ok((ws, _))) => Ok(ws),
            Ok(Err(tokio_tungstenite::tungstenite::Error::Http(resp))) => {
                Err(status_error(resp.status(), resp.body().as_deref().unwrap_or_default()))
            }
            Ok(Err(e)) => Err(JobError::Connect {
                address: self.address.url(),
                reason: format!("the WebSocket handshake for {path} failed: {e}"),
            }),
        }
    }
}

/// The server's path for a package URI: `gcs://NAME` → `/api/packages/gcs/NAME`.
fn package_path(uri: &str) -> Result<String, JobError> {
    let (protocol, name) = uri
        .split_once("://")
        .ok_or_else(|| JobError::Invalid(format!("package URI {uri:?} is not PROTOCOL://NAME")))?;
    Ok(format!("/api/packages/{}/{}", segment(protocol), segment(name)))
}

/// Whether a job status is terminal (Ray's `JobStatus.is_terminal`).
pub fn is_terminal(status: &str) -> bool {
    matches!(status, "STOPPED" | "SUCCEEDED" | "FAILED")
}

/// A job's log stream: chunks of text in the order the job wrote them, until the job
/// ended and every chunk was delivered; never a chunk twice (JOBC-2).
///
/// The stream is the server's WebSocket (`/logs/tail`, which starts at the first line).
/// When it closes before the job is terminal, or breaks, the tail reconnects and skips
/// the bytes it already delivered, so a follower never stops early (a server that closes
/// too soon only costs a reconnect); five failed reconnects in a row end it with the
/// last error.
pub struct LogTail {
    client: JobClient,
    job_id: String,
    ws: Option<WebSocketStream<ClientStream>>,
    /// Bytes delivered so far.
    sent: usize,
    /// Bytes of the current stream still to skip (delivered through an earlier one).
    skip: usize,
    failures: u32,
    done: bool,
}

/// The body of a [`JobClient::get_stream`] answer, chunk by chunk.
pub struct BodyStream {
    body: hyper::body::Incoming,
    url: String,
}

impl BodyStream {
    /// The next piece of the body, `None` at its end. Blocks until there is one.
    ///
    /// # Errors
    /// The connection broke before the body ended.
    pub fn next_chunk(&mut self) -> Result<Option<Bytes>, JobError> {
        block_on(async {
            while let Some(frame) = self.body.frame().await {
                let frame = frame.map_err(|e| JobError::Connect {
                    address: self.url.clone(),
                    reason: format!("the answer broke off: {e}"),
                })?;
                if let Ok(data) = frame.into_data()
                    && !data.is_empty()
                {
                    return Ok(Some(data));
                }
            }
            Ok(None)
        })
    }
}

/// Reconnects in a row that may fail before the tail gives up.
const MAX_TAIL_FAILURES: u32 = 5;

impl LogTail {
    /// The next chunk, `None` once the job ended and its logs were all delivered. Blocks.
    pub fn next_chunk(&mut self) -> Result<Option<String>, JobError> {
        block_on(self.next_chunk_async())
    }

    /// The job this tail follows.
    pub fn job_id(&self) -> &str {
        &self.job_id
    }

    async fn next_chunk_async(&mut self) -> Result<Option<String>, JobError> {
        loop {
            if self.done {
                return Ok(None);
            }
            let ws = match &mut self.ws {
                Some(ws) => ws,
                None => match self.client.open_tail(&self.job_id).await {
                    Ok(ws) => {
                        self.skip = self.sent;
                        self.ws.insert(ws)
                    }
                    // The job is not there, or we may not see it: no retry helps.
                    Err(e @ (JobError::Status { .. } | JobError::Auth { .. })) => {
                        self.done = true;
                        return Err(e);
                    }
                    Err(e) => {
                        self.failures += 1;
                        if self.failures >= MAX_TAIL_FAILURES {
                            self.done = true;
                            return Err(e);
                        }
                        tokio::time::sleep(Duration::from_secs(1)).await;
                        continue;
                    }
                },
            };
            match ws.next().await {
                Some(Ok(Message::Text(t))) => {
                    if let Some(s) = self.take(t.as_bytes()) {
                        return Ok(Some(s));
                    }
                }
                Some(Ok(Message::Binary(b))) => {
                    if let Some(s) = self.take(&b) {
                        return Ok(Some(s));
                    }
                }
                Some(Ok(Message::Ping(_) | Message::Pong(_) | Message::Frame(_))) => {}
                Some(Ok(Message::Close(_))) | None => {
                    self.ws = None;
                    // A clean close: the server sent everything, if the job ended.
                    let status = self.client.job_status_async(&self.job_id).await;
                    match status {
                        Ok(s) if is_terminal(&s) => {
                            self.done = true;
                            return Ok(None);
                        }
                        Ok(_) => tokio::time::sleep(Duration::from_millis(500)).await,
                        Err(e @ (JobError::Status { .. } | JobError::Auth { .. })) => {
                            self.done = true;
                            return Err(e);
                        }
                        Err(e) => {
                            self.failures += 1;
                            if self.failures >= MAX_TAIL_FAILURES {
                                self.done = true;
                                return Err(e);
                            }
                            tokio::time::sleep(Duration::from_secs(1)).await;
                        }
                    }
                }
                Some(Err(e)) => {
                    // Broken: reconnect (the new stream repeats what we have, skipped).
                    self.ws = None;
                    self.failures += 1;
                    if self.failures >= MAX_TAIL_FAILURES {
                        self.done = true;
                        return Err(JobError::Connect {
                            address: self.client.address(),
                            reason: format!("the log stream of job {} broke: {e}", self.job_id),
                        });
                    }
                    tokio::time::sleep(Duration::from_millis(500)).await;
                }
            }
        }
    }

    /// Drops what an earlier stream delivered; returns the rest, if any (JOBC-2).
    fn take(&mut self, bytes: &[u8]) -> Option<String> {
        self.failures = 0;
        let skip = self.skip.min(bytes.len());
        self.skip -= skip;
        let rest = &bytes[skip..];
        if rest.is_empty() {
            return None;
        }
        self.sent += rest.len();
        Some(String::from_utf8_lossy(rest).into_owned())
    }
}

impl JobClient {
    async fn job_status_async(&self, job_id: &str) -> Result<String, JobError> {
        let path = format!("/api/jobs/{}", segment(job_id));
        let (status, body) = self.request_async(Method::GET, &path, None).await?;
        if status != StatusCode::OK {
            return Err(status_error(status, &body));
        }
        let v = parse_json(&format!("GET /api/jobs/{job_id}"), &body)?;
        Ok(v["status"].as_str().unwrap_or_default().to_string())
    }
}

#[cfg(test)]
mod tests {
    use http::header::COOKIE;

    use super::*;

    #[test]
    fn ids_and_package_names_are_percent_encoded_in_paths() {
        assert_eq!(segment("raysubmit_AbC-1.2~"), "raysubmit_AbC-1.2~");
        assert_eq!(segment("a b/c"), "a%20b%2Fc");
        assert_eq!(
            package_path("gcs://_ray_pkg_0123abcd.zip").unwrap(),
            "/api/packages/gcs/_ray_pkg_0123abcd.zip"
        );
        assert!(package_path("_ray_pkg.zip").is_err());
    }

    #[test]
    fn the_cluster_token_is_sent_unless_the_caller_sends_an_authorization_header() {
        let addr = HttpAddress { host: "h".into(), port: 1, prefix: String::new(), https: false };
        let c =
            JobClient::with_address(addr.clone(), &ClientOptions::default(), Some("tok")).unwrap();
        assert_eq!(c.headers, vec![(AUTHORIZATION, HeaderValue::from_static("Bearer tok"))]);
        let mut opts = ClientOptions::default();
        opts.headers.insert("AUTHORIZATION".into(), "Bearer mine".into());
        opts.cookies.insert("a".into(), "1".into());
        opts.cookies.insert("b".into(), "2".into());
        let c = JobClient::with_address(addr.clone(), &opts, Some("tok")).unwrap();
        assert_eq!(
            c.headers,
            vec![
                (AUTHORIZATION, HeaderValue::from_static("Bearer mine")),
                (COOKIE, HeaderValue::from_static("a=1; b=2")),
            ]
        );
        let mut bad = ClientOptions::default();
        bad.headers.insert("bad header".into(), "x".into());
        let e = JobClient::with_address(addr, &bad, None).unwrap_err().to_string();
        assert!(e.contains("\"bad header\""), "{e}");
    }

    #[test]
    fn jobc_2_a_tail_skips_what_an_earlier_stream_delivered() {
        let addr = HttpAddress { host: "h".into(), port: 1, prefix: String::new(), https: false };
        let c = JobClient::with_address(addr, &ClientOptions::default(), None).unwrap();
        let mut t = c.tail("j");
        assert_eq!(t.take(b"one\ntwo\n").as_deref(), Some("one\ntwo\n"));
        // A reconnect repeats the stream from its start.
        t.skip = t.sent;
        assert_eq!(t.take(b"one\n"), None);
        assert_eq!(t.take(b"two\nthree\n").as_deref(), Some("three\n"));
        assert_eq!(t.sent, "one\ntwo\nthree\n".len());
    }

    #[test]
    fn auth_answers_are_told_apart_from_other_errors() {
        assert!(matches!(
            status_error(StatusCode::UNAUTHORIZED, b"x"),
            JobError::Auth { status: 401, .. }
        ));
        assert!(matches!(
            status_error(StatusCode::FORBIDDEN, b"x"),
            JobError::Auth { status: 403, .. }
        ));
        let e = status_error(StatusCode::NOT_FOUND, b"Job j does not exist");
        assert_eq!(e.to_string(), "request failed with status code 404: Job j does not exist");
    }
}
