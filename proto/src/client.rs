//! Client channels to tpuray servers: lazy connections that carry the cluster token on
//! every call, and for the head, leader following.
//!
//! [`AuthChannel`] routes a call one of two ways:
//! - to one server (node agents, workers, object transfer, and a head named by one
//!   address): one HTTP/2 channel, the token added as a header, nothing else;
//! - to a replicated head (`host:port,host:port,...`, CLIENT-1): each call goes to the
//!   head believed to lead; a head that is not the leader answers `UNAVAILABLE` with the
//!   [`LEADER_HEADER`] naming the leader (empty while an election runs), and the call is
//!   sent again there; a head that cannot be reached (refused, reset, or silent past the
//!   HTTP/2 keepalive timeout, as a SIGSTOPped process is) is skipped for the next one.
//!   Retries keep the request's bytes, so its request id, and stop at the request's
//!   deadline (`grpc-timeout`) or after [`FAILOVER_BUDGET`]. A head named by a single
//!   address is followed to the leader it names too, but a connection failure is
//!   returned at once, as before replication.
//!
//! Every call needs a tokio runtime; building a client does not block.
//!
//! CLIENT-1 in numbers: a head is given up as silent after the 1 s + 2 s HTTP/2
//! keepalive, and a call without a deadline retries for [`FAILOVER_BUDGET`] (30 s).
//! Callers in `worker/` and `sdk/` pass the whole address list and change nothing else;
//! agent, worker and object clients keep one plain channel (no retry layer).

use std::collections::HashMap;
use std::future::Future;
use std::pin::Pin;
use std::sync::{Arc, Mutex, OnceLock};
use std::task::{Context, Poll};
use std::time::{Duration, Instant};

use bytes::Bytes;
use http_body_util::BodyExt;
use tonic::body::Body;
use tonic::codegen::Service;
use tonic::codegen::http;
use tonic::transport::{Channel, Endpoint};

use crate::MAX_MESSAGE_BYTES;
use crate::h2grpc::H2Channel;
use crate::pb::head_service_client::HeadServiceClient;
use crate::pb::node_agent_service_client::NodeAgentServiceClient;
use crate::pb::object_transfer_service_client::ObjectTransferServiceClient;
use crate::pb::worker_service_client::WorkerServiceClient;

/// Response metadata a head that cannot serve a call (not the leader, or a leader still
/// catching up) sets, naming the leader's address ("" while unknown).
pub const LEADER_HEADER: &str = "tpuray-leader";

/// Keepalive of a head channel (CLIENT-1): a PING after 1 s without an answer, and the
/// head given up when it does not answer that PING within 2 s.
const HEAD_KEEPALIVE: crate::h2grpc::Keepalive =
    crate::h2grpc::Keepalive { interval: Duration::from_secs(1), timeout: Duration::from_secs(2) };

/// How long a call to a replicated head without its own deadline keeps trying heads.
pub const FAILOVER_BUDGET: Duration = Duration::from_secs(30);

type BoxError = Box<dyn std::error::Error + Send + Sync>;
type BoxFuture = Pin<Box<dyn Future<Output = Result<http::Response<Body>, BoxError>> + Send>>;

/// The `UNAVAILABLE` status a head answers when it cannot serve a call: `leader` is the
/// leader's address when known.
pub fn not_leader(leader: Option<&str>, detail: impl Into<String>) -> tonic::Status {
    let mut s = tonic::Status::unavailable(detail);
    if let Ok(v) = leader.unwrap_or("").parse() {
        s.metadata_mut().insert(LEADER_HEADER, v);
    }
    s
}

/// A channel whose calls carry the cluster token (and, for a replicated head, follow
/// the leader).
#[derive(Clone)]
pub struct AuthChannel(Route);

#[derive(Clone)]
enum Route {
    Direct {
        ch: Channel,
        auth: Option<http::HeaderValue>,
    },
    /// Workers: h2 directly (see [`crate::h2grpc`]).
    H2 {
        ch: H2Channel,
        auth: Option<http::HeaderValue>,
    },
    Heads(Arc<HeadGroup>),
}

/// What an [`AuthChannel`] call returns.
pub enum AuthFuture {
    Direct(tonic::transport::channel::ResponseFuture),
    Boxed(BoxFuture),
}

impl Future for AuthFuture {
    type Output = Result<http::Response<Body>, BoxError>;

    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        match self.get_mut() {
            AuthFuture::Direct(f) => Pin::new(f).poll(cx).map_err(Into::into),
            AuthFuture::Boxed(f) => f.as_mut().poll(cx),
        }
    }
}

impl Service<http::Request<Body>> for AuthChannel {
    type Response = http::Response<Body>;
    type Error = BoxError;
    type Future = AuthFuture;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        match &mut self.0 {
            Route::Direct { ch, .. } => ch.poll_ready(cx).map_err(Into::into),
            Route::H2 { .. } | Route::Heads(_) => Poll::Ready(Ok(())),
        }
    }

    fn call(&mut self, mut req: http::Request<Body>) -> Self::Future {
        match &mut self.0 {
            Route::Direct { ch, auth } => {
                add_auth(&mut req, auth);
                AuthFuture::Direct(ch.call(req))
            }
            Route::H2 { ch, auth } => {
                add_auth(&mut req, auth);
                AuthFuture::Boxed(Box::pin(ch.clone().call(req)))
            }
            Route::Heads(g) => AuthFuture::Boxed(Box::pin(Arc::clone(g).call(req))),
        }
    }
}

/// A status's message followed by the errors under it, as in "transport error: stream
/// closed because of a broken pipe" or "tcp connect error: Connection refused (os error
/// 111)" (tonic's message alone says only "transport error").
pub fn status_chain(s: &tonic::Status) -> String {
    let mut out = s.message().to_string();
    let mut cur: Option<&dyn std::error::Error> = std::error::Error::source(s);
    while let Some(e) = cur {
        let m = e.to_string();
        if !out.contains(&m) {
            out.push_str(": ");
            out.push_str(&m);
        }
        cur = e.source();
    }
    // TLS-4: a failed handshake says why in words.
    if let Some(src) = std::error::Error::source(s)
        && let Some(why) = crate::tls::explain_chain(src, "the server")
    {
        out.push_str(" (");
        out.push_str(&why);
        out.push(')');
    }
    out
}

/// Errors building a client.
#[derive(Debug, thiserror::Error)]
pub enum ClientError {
    #[error("invalid address {addr:?}: {detail} (expected HOST:PORT)")]
    BadAddress { addr: String, detail: String },
    /// This process's TLS identity cannot be used (TLS-1).
    #[error("{0}")]
    Tls(String),
}

/// An endpoint for `addr`: `http://`, or with this process's TLS identity (TLS-1)
/// `https://` verifying the server's certificate against the host dialled (TLS-2).
fn endpoint(addr: &str) -> Result<Endpoint, ClientError> {
    check_address(addr)?;
    let bad = |e: &dyn std::fmt::Display| ClientError::BadAddress {
        addr: addr.to_string(),
        detail: e.to_string(),
    };
    let tls = crate::tls::current().map_err(ClientError::Tls)?;
    let ep = match tls {
        None => Endpoint::from_shared(format!("http://{addr}")).map_err(|e| bad(&e))?,
        Some(t) => Endpoint::from_shared(format!("https://{addr}"))
            .map_err(|e| bad(&e))?
            .tls_config(t.tonic_client())
            .map_err(|e| ClientError::Tls(format!("TLS for {addr}: {e}")))?,
    };
    Ok(ep.connect_timeout(Duration::from_secs(5)).tcp_nodelay(true))
}

/// A lazily connecting channel to `addr` (`HOST:PORT`).
///
/// # Errors
/// [`ClientError::BadAddress`] when `addr` is not a valid `HOST:PORT`.
pub fn channel(addr: &str) -> Result<Channel, ClientError> {
    Ok(endpoint(addr)?
        .http2_keep_alive_interval(Duration::from_secs(10))
        .keep_alive_timeout(Duration::from_secs(20))
        .connect_lazy())
}

/// Checks that `addr` is `HOST:PORT`; needs no runtime.
///
/// # Errors
/// [`ClientError::BadAddress`] naming what is missing.
pub fn check_address(addr: &str) -> Result<(), ClientError> {
    let bad = |detail: String| ClientError::BadAddress { addr: addr.to_string(), detail };
    let (host, port) = addr.rsplit_once(':').ok_or_else(|| bad("missing port".into()))?;
    if host.is_empty() {
        return Err(bad("missing host".into()));
    }
    port.parse::<u16>().map_err(|e| bad(format!("port {port:?}: {e}")))?;
    Ok(())
}

/// Sets the request's `authorization` header to `auth`, when there is one.
fn add_auth<B>(req: &mut http::Request<B>, auth: &Option<http::HeaderValue>) {
    if let Some(h) = auth {
        req.headers_mut().insert(http::header::AUTHORIZATION, h.clone());
    }
}

fn auth_header(token: Option<&str>) -> Option<http::HeaderValue> {
    token.and_then(|t| format!("Bearer {t}").parse().ok())
}

fn authed(addr: &str, token: Option<&str>) -> Result<AuthChannel, ClientError> {
    Ok(AuthChannel(Route::Direct { ch: channel(addr)?, auth: auth_header(token) }))
}

/// The heads of one address list: their channels (made at first use, inside the
/// caller's runtime) and the one believed to lead.
struct HeadGroup {
    key: String,
    addrs: Vec<String>,
    auth: Option<http::HeaderValue>,
    channels: Mutex<HashMap<String, H2Channel>>,
}

/// The last leader seen per address list, shared by every client of the process, so a
/// new client starts at the leader.
fn leaders() -> &'static Mutex<HashMap<String, String>> {
    static L: OnceLock<Mutex<HashMap<String, String>>> = OnceLock::new();
    L.get_or_init(|| Mutex::new(HashMap::new()))
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

/// Parses a `grpc-timeout` header value (`<digits><unit>`).
pub(crate) fn parse_grpc_timeout(v: &str) -> Option<Duration> {
    let (n, unit) = v.split_at(v.len().checked_sub(1)?);
    let n: u64 = n.parse().ok()?;
    Some(match unit {
        "H" => Duration::from_secs(n * 3600),
        "M" => Duration::from_secs(n * 60),
        "S" => Duration::from_secs(n),
        "m" => Duration::from_millis(n),
        "u" => Duration::from_micros(n),
        "n" => Duration::from_nanos(n),
        _ => return None,
    })
}

impl HeadGroup {
    fn leader_hint(&self) -> String {
        lock(leaders()).get(&self.key).cloned().unwrap_or_else(|| self.addrs[0].clone())
    }

    fn set_leader(&self, addr: &str) {
        let mut l = lock(leaders());
        if l.get(&self.key).map(String::as_str) != Some(addr) {
            l.insert(self.key.clone(), addr.to_string());
        }
    }

    fn next_after(&self, addr: &str) -> String {
        let i = self.addrs.iter().position(|a| a == addr).map_or(0, |i| i + 1);
        self.addrs[i % self.addrs.len()].clone()
    }

    fn channel(&self, addr: &str) -> Result<H2Channel, BoxError> {
        let mut chans = lock(&self.channels);
        if let Some(c) = chans.get(addr) {
            return Ok(c.clone());
        }
        // Short keepalives: a frozen head is given up within seconds (CLIENT-1).
        let tls = crate::tls::current().map_err(ClientError::Tls)?;
        let c = H2Channel::with_keepalive(addr, tls.map(|t| &**t), HEAD_KEEPALIVE)
            .map_err(|e| ClientError::BadAddress { addr: addr.to_string(), detail: e })?;
        chans.insert(addr.to_string(), c.clone());
        Ok(c)
    }

    fn request(
        parts: &http::request::Parts,
        body: &Bytes,
        left: Duration,
        auth: &Option<http::HeaderValue>,
    ) -> http::Request<Body> {
        let mut req = http::Request::new(Body::new(http_body_util::Full::new(body.clone())));
        *req.method_mut() = parts.method.clone();
        *req.uri_mut() = parts.uri.clone();
        *req.version_mut() = parts.version;
        *req.headers_mut() = parts.headers.clone();
        let ms = left.as_millis().clamp(1, 99_999_999);
        if let Ok(v) = format!("{ms}m").parse() {
            req.headers_mut().insert("grpc-timeout", v);
        }
        add_auth(&mut req, auth);
        req
    }

    /// CLIENT-1: sends the call to the leader, following redirects and skipping heads
    /// that cannot be reached, until it is answered or its deadline passes.
    async fn call(
        self: Arc<Self>,
        req: http::Request<Body>,
    ) -> Result<http::Response<Body>, BoxError> {
        let (parts, body) = req.into_parts();
        let body = body.collect().await.map_err(|e| -> BoxError { Box::new(e) })?.to_bytes();
        let budget = parts
            .headers
            .get("grpc-timeout")
            .and_then(|v| v.to_str().ok())
            .and_then(parse_grpc_timeout)
            .unwrap_or(FAILOVER_BUDGET);
        let deadline = Instant::now() + budget;
        let many = self.addrs.len() > 1;
        let mut target = self.leader_hint();
        let mut pause = Duration::from_millis(10);
        let mut hops = 0;
        loop {
            let left = deadline.saturating_duration_since(Instant::now());
            let req = Self::request(&parts, &body, left, &self.auth);
            let result = self.channel(&target)?.call(req).await;
            let next = match result {
                Ok(resp) => {
                    let Some(hint) = resp.headers().get(LEADER_HEADER) else {
                        self.set_leader(&target);
                        return Ok(resp);
                    };
                    let hint = hint.to_str().unwrap_or("").to_string();
                    if Instant::now() + pause >= deadline {
                        return Ok(resp);
                    }
                    match hint {
                        h if !h.is_empty() && h != target && hops < 2 * self.addrs.len() + 2 => {
                            hops += 1;
                            target = h;
                            continue;
                        }
                        h if h == target => target.clone(), // a leader catching up
                        _ if many => self.next_after(&target),
                        _ => target.clone(),
                    }
                }
                Err(e) => {
                    if many {
                        // The next call starts elsewhere: this head may be gone or frozen.
                        self.set_leader(&self.next_after(&target));
                    }
                    if !many || Instant::now() >= deadline {
                        return Err(e);
                    }
                    self.next_after(&target)
                }
            };
            hops = 0;
            tokio::time::sleep(pause.min(deadline.saturating_duration_since(Instant::now()))).await;
            pause = (pause * 2).min(Duration::from_millis(100));
            target = next;
        }
    }
}

/// A client of the head at `addr`: one address, or every replica's as
/// `host:port,host:port,...` (CLIENT-1).
///
/// # Errors
/// [`ClientError::BadAddress`] when an address is not a valid `HOST:PORT`.
pub fn head(
    addr: &str,
    token: Option<&str>,
) -> Result<HeadServiceClient<AuthChannel>, ClientError> {
    Ok(HeadServiceClient::new(head_channel(addr, token)?)
        .max_decoding_message_size(MAX_MESSAGE_BYTES)
        .max_encoding_message_size(usize::MAX))
}

/// The channel under [`head`]'s client, for a caller that encodes or decodes a head call
/// its own way (`head_load` counts its simulated agents' view entries without decoding
/// them).
///
/// # Errors
/// [`ClientError::BadAddress`] when an address is not a valid `HOST:PORT`.
pub fn head_channel(addr: &str, token: Option<&str>) -> Result<AuthChannel, ClientError> {
    let addrs: Vec<String> =
        addr.split(',').map(str::trim).filter(|a| !a.is_empty()).map(String::from).collect();
    if addrs.is_empty() {
        return Err(ClientError::BadAddress { addr: addr.to_string(), detail: "empty".into() });
    }
    for a in &addrs {
        check_address(a)?;
    }
    let group = HeadGroup {
        key: addrs.join(","),
        addrs,
        auth: auth_header(token),
        channels: Mutex::new(HashMap::new()),
    };
    Ok(AuthChannel(Route::Heads(Arc::new(group))))
}

/// A client of one head replica only, never redirected (for per-replica status and
/// for Raft between heads).
///
/// # Errors
/// [`ClientError::BadAddress`] when `addr` is not a valid `HOST:PORT`.
pub fn head_replica(
    addr: &str,
    token: Option<&str>,
) -> Result<HeadServiceClient<AuthChannel>, ClientError> {
    Ok(HeadServiceClient::new(authed(addr, token)?)
        .max_decoding_message_size(MAX_MESSAGE_BYTES)
        .max_encoding_message_size(usize::MAX))
}

/// A Raft peer client of the head replica at `addr` (large messages: snapshots).
///
/// # Errors
/// [`ClientError::BadAddress`] when `addr` is not a valid `HOST:PORT`.
pub fn head_peer(
    addr: &str,
    token: Option<&str>,
) -> Result<crate::pb::head_peer_service_client::HeadPeerServiceClient<AuthChannel>, ClientError> {
    let ch = endpoint(addr)?
        .http2_keep_alive_interval(Duration::from_secs(1))
        .keep_alive_timeout(Duration::from_secs(2))
        .connect_lazy();
    Ok(crate::pb::head_peer_service_client::HeadPeerServiceClient::new(AuthChannel(
        Route::Direct { ch, auth: auth_header(token) },
    ))
    .max_decoding_message_size(crate::MAX_PEER_MESSAGE_BYTES)
    .max_encoding_message_size(usize::MAX))
}

/// A client of the node agent at `addr`.
pub fn agent(
    addr: &str,
    token: Option<&str>,
) -> Result<NodeAgentServiceClient<AuthChannel>, ClientError> {
    Ok(NodeAgentServiceClient::new(authed(addr, token)?)
        .max_decoding_message_size(MAX_MESSAGE_BYTES)
        .max_encoding_message_size(usize::MAX))
}

/// A client of the worker process at `addr`.
pub fn worker(
    addr: &str,
    token: Option<&str>,
) -> Result<WorkerServiceClient<AuthChannel>, ClientError> {
    check_address(addr)?;
    let tls = crate::tls::current().map_err(ClientError::Tls)?;
    let ch = H2Channel::new(addr, tls.map(|t| &**t))
        .map_err(|e| ClientError::BadAddress { addr: addr.to_string(), detail: e })?;
    Ok(WorkerServiceClient::new(AuthChannel(Route::H2 { ch, auth: auth_header(token) }))
        .max_decoding_message_size(MAX_MESSAGE_BYTES)
        .max_encoding_message_size(usize::MAX))
}

/// A client of the object transfer service at `addr`.
pub fn objects(
    addr: &str,
    token: Option<&str>,
) -> Result<ObjectTransferServiceClient<AuthChannel>, ClientError> {
    Ok(ObjectTransferServiceClient::new(authed(addr, token)?)
        .max_decoding_message_size(MAX_MESSAGE_BYTES)
        .max_encoding_message_size(usize::MAX))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn status_chain_names_each_cause_once() {
        #[derive(Debug)]
        struct Conn(std::io::Error);
        impl std::fmt::Display for Conn {
            fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
                write!(f, "connection error")
            }
        }
        impl std::error::Error for Conn {
            fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
                Some(&self.0)
            }
        }
        let pipe = std::io::Error::new(std::io::ErrorKind::BrokenPipe, "stream closed");
        let s = tonic::Status::from_error(Box::new(Conn(pipe)));
        assert_eq!(status_chain(&s), "connection error: stream closed");
        assert_eq!(status_chain(&tonic::Status::internal("plain")), "plain");
    }

    #[test]
    fn grpc_timeouts_parse_in_every_unit() {
        assert_eq!(parse_grpc_timeout("5S"), Some(Duration::from_secs(5)));
        assert_eq!(parse_grpc_timeout("250m"), Some(Duration::from_millis(250)));
        assert_eq!(parse_grpc_timeout("7u"), Some(Duration::from_micros(7)));
        assert_eq!(parse_grpc_timeout("2M"), Some(Duration::from_secs(120)));
        assert_eq!(parse_grpc_timeout("x"), None);
        assert_eq!(parse_grpc_timeout(""), None);
    }

    #[test]
    fn a_head_list_is_checked_address_by_address() {
        assert!(head("127.0.0.1:1,127.0.0.1:2", None).is_ok());
        let Err(e) = head("127.0.0.1:1,nope", None) else { panic!("a bad address is refused") };
        let e = e.to_string();
        assert!(e.contains("\"nope\""), "{e}");
    }

    /// HEAD-7: a head that does not serve answers `UNAVAILABLE` naming the leader.
    #[test]
    fn not_leader_status_names_the_leader_in_metadata() {
        let s = not_leader(Some("127.0.0.1:7"), "head 2 is not the leader");
        assert_eq!(s.code(), tonic::Code::Unavailable);
        assert_eq!(s.metadata().get(LEADER_HEADER).unwrap(), "127.0.0.1:7");
        let s = not_leader(None, "election in progress");
        assert_eq!(s.metadata().get(LEADER_HEADER).unwrap(), "");
    }
}
