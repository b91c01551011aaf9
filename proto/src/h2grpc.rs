//! gRPC on the `h2` crate directly, for the `WorkerService` of workers and drivers: every
//! task push and actor call goes through it, so it is the hot path of the whole system.
//! tonic stays the codec and the generated client and service; only hyper's layer is
//! left out. [`serve`] is the server half; the channel is what
//! [`crate::client::worker`] builds on.
//!
//! tonic's `Channel` sends a unary request through a tower `Buffer` task, hyper's
//! dispatcher and a per-request body pipe task, and puts it on the wire as three frames in
//! three writes: HEADERS, DATA, and an empty DATA that ends the stream. Here the caller's
//! task hands h2 the HEADERS and one DATA frame that ends the stream, and the connection
//! task writes both at once. The request body is the encoded message tonic's codec made;
//! the response body is h2's stream, read frame by frame (server streaming works too).
//!
//! What it keeps from tonic's channel:
//! - connecting lazily, and again on the next call after the connection is lost (the
//!   call that finds it lost fails);
//! - a 5 s connect timeout and `TCP_NODELAY`;
//! - HTTP/2 keepalive: a PING once 10 s pass without an answer (head channels: 1 s); a
//!   peer silent for 20 s more (head channels: 2 s) is given up and its calls fail;
//! - the `grpc-timeout` header as a client-side deadline on the response headers;
//! - errors as `tonic::Status`: a call that never left (connect failed) is `UNAVAILABLE`
//!   with "tcp connect error" or "connect error" in its message; a connection lost under a
//!   call is `UNKNOWN` "transport error" with the cause as its source (as through hyper);
//!   a stream reset is coded after its reason as tonic codes h2 errors (gRPC's
//!   PROTOCOL-HTTP2.md, "Errors").
//!
//! Sending the body as one DATA frame that ends the stream also keeps clear of h2's
//! budget for small DATA frames that do not end their stream (h2 ≥ 0.4.16 closes a
//! connection with `ENHANCE_YOUR_CALM` when a lagging server exceeds it).
//!
//! Measured on the 2-core machine of issue 10 (3 x 1.5 s microbenchmark trials): the
//! channel took Rust 1:1 actor calls sync from ~2,750 to ~3,800 per second and Python's
//! from ~2,400 to ~2,850; the server took ~5-10 us of CPU per call off the worker's
//! runtime threads.
//!
//! NET-2: the `WorkerService` (task pushes, actor calls, owner RPCs) and the head's
//! services (heartbeats and every other head call, Raft between replicas) run on `h2`
//! directly, client and server; a unary call leaves as HEADERS plus one DATA frame that
//! ends the stream, in one write. A failed connect is never delivered, so an actor call
//! is sent again. A request the client resets has its handler dropped; a server told to
//! stop sends GOAWAY and answers the calls in flight. Agent and object-transfer traffic,
//! and a client of one named head replica, keep tonic's channel and server.
//!
//! Measured for the head (issue 34, `head_load --nodes 3000 --seconds 40`, 2-core
//! machine): with tonic's server and channel a heartbeat cost the head about 110-120 µs
//! of CPU and the simulated agents about 130-140 µs; on h2 (with keepalive PINGs only on
//! a connection without answers) about 89 µs and 97 µs. At 10,000 nodes: head 0.63-0.71
//! cores, agents 0.62-0.87 cores, no false deaths.

use std::future::Future;
use std::pin::Pin;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll, ready};
use std::time::Duration;

use bytes::Bytes;
use http_body_util::BodyExt;
use tonic::body::Body;
use tonic::codegen::http;

type BoxError = Box<dyn std::error::Error + Send + Sync>;

/// How long a TCP connect may take.
const CONNECT_TIMEOUT: Duration = Duration::from_secs(5);
/// Keepalive of a worker channel: a PING after 10 s without an answer, given up 20 s later.
const WORKER_KEEPALIVE: Keepalive =
    Keepalive { interval: Duration::from_secs(10), timeout: Duration::from_secs(20) };
/// Receive windows (hyper's client defaults): per stream, and for the connection.
const STREAM_WINDOW: u32 = 2 * 1024 * 1024;
const CONNECTION_WINDOW: u32 = 5 * 1024 * 1024;
/// How long a server waits for a new connection's HTTP/2 preface.
const HANDSHAKE_TIMEOUT: Duration = Duration::from_secs(10);
/// The server's receive windows (hyper's server defaults, which tonic's server keeps).
const SERVER_WINDOW: u32 = 1024 * 1024;
/// The largest request header block the server takes, in bytes (hyper's server default).
const SERVER_MAX_HEADER_LIST: u32 = 16 * 1024;

/// HTTP/2 keepalive: a PING once `interval` has passed without an answer on the
/// connection (a call's response headers, or the last PING's reply), and the connection
/// given up, failing its calls, when that PING goes unanswered for `timeout`. A busy
/// connection so sends no PINGs (hyper's keepalive counts any frame read; this counts
/// answers); a silent peer is found `interval + timeout` after it last answered.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Keepalive {
    pub interval: Duration,
    pub timeout: Duration,
}

/// A lazily connecting HTTP/2 channel to one server, shared by its clones.
#[derive(Clone)]
pub(crate) struct H2Channel(Arc<Shared>);

struct Shared {
    addr: String,
    keepalive: Keepalive,
    /// With TLS (TLS-2): the connector and the name the server's certificate must hold.
    tls: Option<(tokio_rustls::TlsConnector, rustls::pki_types::ServerName<'static>)>,
    authority: http::uri::Authority,
    /// The current connection attempt: every call waits for the same one; a failed or
    /// lost one is replaced by the next call.
    attempt: Mutex<Arc<tokio::sync::OnceCell<Result<Conn, tonic::Status>>>>,
}

#[derive(Clone)]
struct Conn {
    send: h2::client::SendRequest<Bytes>,
    /// False once the connection task has ended (closed, failed or dropped).
    alive: Arc<AtomicBool>,
    /// When the peer last answered ([`since_start`] µs): what [`keep_alive`] reads.
    heard: Arc<AtomicU64>,
}

/// Microseconds since this process first asked (a monotonic clock that fits an atomic).
fn since_start() -> u64 {
    static START: std::sync::OnceLock<std::time::Instant> = std::sync::OnceLock::new();
    START.get_or_init(std::time::Instant::now).elapsed().as_micros() as u64
}

/// Sets `alive` to false when the connection task ends or is dropped with its runtime.
struct AliveGuard(Arc<AtomicBool>);

impl Drop for AliveGuard {
    fn drop(&mut self) {
        self.0.store(false, Ordering::Release);
    }
}

impl H2Channel {
    /// A channel to `addr` (`HOST:PORT`, already checked), over TLS with `tls`;
    /// connects at the first call. Keepalive as a worker's: 10 s, then 20 s.
    pub(crate) fn new(addr: &str, tls: Option<&crate::tls::Tls>) -> Result<Self, String> {
        Self::with_keepalive(addr, tls, WORKER_KEEPALIVE)
    }

    /// [`H2Channel::new`] with its own keepalive.
    pub(crate) fn with_keepalive(
        addr: &str,
        tls: Option<&crate::tls::Tls>,
        keepalive: Keepalive,
    ) -> Result<Self, String> {
        let authority = addr.parse().map_err(|e: http::uri::InvalidUri| e.to_string())?;
        let tls = match tls {
            Some(t) => Some((t.grpc_connector(), crate::tls::server_name(addr)?)),
            None => None,
        };
        Ok(H2Channel(Arc::new(Shared {
            addr: addr.to_string(),
            keepalive,
            tls,
            authority,
            attempt: Mutex::new(Arc::new(tokio::sync::OnceCell::new())),
        })))
    }

    /// Sends one gRPC call and returns its response, whose body streams the reply frames
    /// and the trailers.
    pub(crate) async fn call(
        self,
        req: http::Request<Body>,
    ) -> Result<http::Response<Body>, BoxError> {
        let deadline = req
            .headers()
            .get("grpc-timeout")
            .and_then(|v| v.to_str().ok())
            .and_then(crate::client::parse_grpc_timeout);
        let sent = self.send(req);
        let r = match deadline {
            Some(d) => tokio::time::timeout(d, sent).await.unwrap_or_else(|_| {
                Err(tonic::Status::deadline_exceeded(format!(
                    "no answer from {} within the call's {d:?} deadline",
                    self.0.addr
                )))
            }),
            None => sent.await,
        };
        r.map_err(|s| -> BoxError { Box::new(s) })
    }

    async fn send(&self, req: http::Request<Body>) -> Result<http::Response<Body>, tonic::Status> {
        let (mut parts, body) = req.into_parts();
        // tonic encodes a unary request as one frame, handed on without a copy.
        let data = body.collect().await?.to_bytes();
        let conn = self.conn().await?;
        let mut send = conn.send;
        if let Err(e) = std::future::poll_fn(|cx| send.poll_ready(cx)).await {
            self.forget(&conn.alive);
            return Err(transport_status(e));
        }
        let path = parts.uri.path_and_query().cloned();
        let mut uri = http::uri::Parts::default();
        uri.scheme = Some(http::uri::Scheme::HTTP);
        uri.authority = Some(self.0.authority.clone());
        uri.path_and_query = path;
        parts.uri = http::Uri::from_parts(uri)
            .map_err(|e| tonic::Status::internal(format!("request URI: {e}")))?;
        parts.version = http::Version::HTTP_2;
        let (response, mut stream) = send
            .send_request(http::Request::from_parts(parts, ()), data.is_empty())
            .map_err(|e| {
                self.forget(&conn.alive);
                transport_status(e)
            })?;
        // NET-2: HEADERS plus one DATA frame that ends the stream, written together.
        // A server may answer from the headers alone (a refused token) and reset the
        // stream before the DATA frame leaves: then the answer, when one came, is the
        // call's, not the failed send.
        let unsent = match data.is_empty() {
            true => None,
            false => stream.send_data(data, true).err(),
        };
        let answered = response.await;
        let (parts, recv) = match (answered, unsent) {
            (Ok(r), _) => r.into_parts(),
            (Err(_), Some(e)) | (Err(e), None) => return Err(transport_status(e)),
        };
        conn.heard.store(since_start(), Ordering::Relaxed);
        Ok(http::Response::from_parts(parts, Body::new(RecvBody { recv, data_done: false })))
    }

    /// The live connection, connecting when there is none.
    async fn conn(&self) -> Result<Conn, tonic::Status> {
        let cell = {
            let mut attempt = self.0.attempt.lock().unwrap_or_else(|p| p.into_inner());
            if let Some(Ok(c)) = attempt.get()
                && !c.alive.load(Ordering::Acquire)
            {
                *attempt = Arc::new(tokio::sync::OnceCell::new());
            }
            Arc::clone(&attempt)
        };
        let r = cell
            .get_or_init(|| connect(self.0.addr.clone(), self.0.tls.clone(), self.0.keepalive))
            .await
            .clone();
        if r.is_err() {
            // The next call tries again.
            let mut attempt = self.0.attempt.lock().unwrap_or_else(|p| p.into_inner());
            if Arc::ptr_eq(&attempt, &cell) {
                *attempt = Arc::new(tokio::sync::OnceCell::new());
            }
        }
        r
    }

    /// Drops the connection behind `alive` from use: the next call connects again.
    fn forget(&self, alive: &Arc<AtomicBool>) {
        let mut attempt = self.0.attempt.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(Ok(c)) = attempt.get()
            && Arc::ptr_eq(&c.alive, alive)
        {
            *attempt = Arc::new(tokio::sync::OnceCell::new());
        }
    }
}

async fn connect(
    addr: String,
    tls: Option<(tokio_rustls::TlsConnector, rustls::pki_types::ServerName<'static>)>,
    keepalive: Keepalive,
) -> Result<Conn, tonic::Status> {
    let tcp = match tokio::time::timeout(CONNECT_TIMEOUT, tokio::net::TcpStream::connect(&addr))
        .await
    {
        Ok(Ok(s)) => s,
        Ok(Err(e)) => return Err(tonic::Status::unavailable(format!("tcp connect error: {e}"))),
        Err(_) => {
            return Err(tonic::Status::unavailable(format!(
                "tcp connect error: {addr} did not answer within {CONNECT_TIMEOUT:?}"
            )));
        }
    };
    let _ = tcp.set_nodelay(true);
    match tls {
        None => handshake(tcp, keepalive).await,
        Some((connector, name)) => {
            let s = match tokio::time::timeout(CONNECT_TIMEOUT, connector.connect(name, tcp)).await
            {
                Ok(Ok(s)) => s,
                Ok(Err(e)) => {
                    let why = crate::tls::explain_chain(&e, "the server")
                        .unwrap_or_else(|| e.to_string());
                    return Err(tonic::Status::unavailable(format!(
                        "connect error: TLS handshake with {addr}: {why}"
                    )));
                }
                Err(_) => {
                    return Err(tonic::Status::unavailable(format!(
                        "connect error: no TLS handshake from {addr} within {CONNECT_TIMEOUT:?}"
                    )));
                }
            };
            handshake(s, keepalive).await
        }
    }
}

/// The HTTP/2 handshake on a connected stream (TCP, or TLS over it).
async fn handshake<IO>(io: IO, keepalive: Keepalive) -> Result<Conn, tonic::Status>
where
    IO: tokio::io::AsyncRead + tokio::io::AsyncWrite + Unpin + Send + 'static,
{
    let (send, mut conn) = h2::client::Builder::new()
        .initial_window_size(STREAM_WINDOW)
        .initial_connection_window_size(CONNECTION_WINDOW)
        .handshake::<_, Bytes>(io)
        .await
        .map_err(|e| tonic::Status::unavailable(format!("connect error: HTTP/2 handshake: {e}")))?;
    let alive = Arc::new(AtomicBool::new(true));
    let heard = Arc::new(AtomicU64::new(since_start()));
    let pings = conn.ping_pong();
    let guard = AliveGuard(Arc::clone(&alive));
    let task = tokio::spawn(async move {
        let _guard = guard;
        let _ = conn.await;
    });
    if let Some(pings) = pings {
        let watch = Watch { alive: Arc::clone(&alive), heard: Arc::clone(&heard) };
        tokio::spawn(keep_alive(pings, watch, keepalive, task.abort_handle()));
    }
    Ok(Conn { send, alive, heard })
}

/// What [`keep_alive`] watches of a connection.
struct Watch {
    alive: Arc<AtomicBool>,
    heard: Arc<AtomicU64>,
}

/// While the connection lives, pings the peer once `ka.interval` has passed since it
/// last answered ([`Keepalive`]), and ends the connection (failing its calls) when a ping
/// goes unanswered for `ka.timeout`.
async fn keep_alive(
    mut pings: h2::PingPong,
    watch: Watch,
    ka: Keepalive,
    connection: tokio::task::AbortHandle,
) {
    let interval_us = ka.interval.as_micros() as u64;
    loop {
        // Sleep until `interval` after the last answer (the connection's start at first).
        let idle = since_start().saturating_sub(watch.heard.load(Ordering::Relaxed));
        if idle < interval_us {
            tokio::time::sleep(Duration::from_micros(interval_us - idle)).await;
            continue;
        }
        if !watch.alive.load(Ordering::Acquire) {
            return;
        }
        match tokio::time::timeout(ka.timeout, pings.ping(h2::Ping::opaque())).await {
            Ok(Ok(_)) => watch.heard.store(since_start(), Ordering::Relaxed),
            _ => {
                watch.alive.store(false, Ordering::Release);
                connection.abort();
                return;
            }
        }
    }
}

/// The status of a call that failed in h2 (after it left, or with the connection gone).
fn transport_status(e: h2::Error) -> tonic::Status {
    let code = match e.reason() {
        _ if e.is_io() => tonic::Code::Unknown,
        Some(h2::Reason::REFUSED_STREAM) => tonic::Code::Unavailable,
        Some(h2::Reason::CANCEL) => tonic::Code::Cancelled,
        Some(h2::Reason::ENHANCE_YOUR_CALM) => tonic::Code::ResourceExhausted,
        Some(h2::Reason::INADEQUATE_SECURITY) => tonic::Code::PermissionDenied,
        Some(_) => tonic::Code::Internal,
        None => tonic::Code::Unknown,
    };
    let mut s = tonic::Status::new(code, "transport error");
    s.set_source(Arc::new(e));
    s
}

/// A response body read from h2: the DATA frames (each released back to the flow-control
/// window as it is handed on), then the trailers.
struct RecvBody {
    recv: h2::RecvStream,
    data_done: bool,
}

impl http_body::Body for RecvBody {
    type Data = Bytes;
    type Error = tonic::Status;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<http_body::Frame<Bytes>, tonic::Status>>> {
        let me = &mut *self;
        if !me.data_done {
            match ready!(me.recv.poll_data(cx)) {
                Some(Ok(d)) => {
                    let _ = me.recv.flow_control().release_capacity(d.len());
                    return Poll::Ready(Some(Ok(http_body::Frame::data(d))));
                }
                Some(Err(e)) => return Poll::Ready(Some(Err(transport_status(e)))),
                None => me.data_done = true,
            }
        }
        match ready!(me.recv.poll_trailers(cx)) {
            Ok(Some(t)) => Poll::Ready(Some(Ok(http_body::Frame::trailers(t)))),
            Ok(None) => Poll::Ready(None),
            Err(e) => Poll::Ready(Some(Err(transport_status(e)))),
        }
    }

    fn is_end_stream(&self) -> bool {
        self.recv.is_end_stream()
    }
}

/// Serves gRPC service `svc` over h2 on `listener` (every connection with
/// `TCP_NODELAY`) until `shutdown` resolves; then each connection is sent GOAWAY, and
/// this returns once their calls in flight have been answered. A failed accept (out of
/// file descriptors) waits 50 ms and goes on, as tonic's server does.
///
/// As hyper does for tonic's server, each request runs in a task of its own, and a
/// request the client resets (it gave up, or its deadline passed) has its handler
/// dropped. Settings are those tonic's server gets from hyper: 1 MiB stream and
/// connection windows, 16 KiB of request headers, no limit on concurrent streams. A
/// reply is queued whole (HEADERS, DATA, trailers) before the connection task writes,
/// so a unary reply is one write. A connection that sends no HTTP/2 preface within
/// 10 s is dropped.
pub async fn serve<S, RB>(
    name: &'static str,
    listener: tokio::net::TcpListener,
    svc: S,
    shutdown: impl Future<Output = ()>,
) where
    S: tower_service::Service<http::Request<Body>, Response = http::Response<RB>>
        + Clone
        + Send
        + 'static,
    S::Error: Into<BoxError>,
    S::Future: Send + 'static,
    RB: http_body::Body<Data = Bytes> + Send + 'static,
    RB::Error: Into<BoxError>,
{
    serve_diverting(name, listener, svc, shutdown, None).await
}

/// Another protocol on the same port as a gRPC server: a plain-TCP connection whose first
/// byte is `first_byte` is handed to `take` instead of served as HTTP/2 (whose
/// connections open with the preface's `P`). Only without TLS: with TLS every
/// connection is a TLS handshake and nothing is diverted.
#[derive(Clone)]
pub struct Divert {
    pub first_byte: u8,
    pub take: Arc<dyn Fn(tokio::net::TcpStream) + Send + Sync>,
}

/// [`serve`], with connections that open with `divert`'s first byte handed to it.
pub async fn serve_diverting<S, RB>(
    name: &'static str,
    listener: tokio::net::TcpListener,
    svc: S,
    shutdown: impl Future<Output = ()>,
    divert: Option<Divert>,
) where
    S: tower_service::Service<http::Request<Body>, Response = http::Response<RB>>
        + Clone
        + Send
        + 'static,
    S::Error: Into<BoxError>,
    S::Future: Send + 'static,
    RB: http_body::Body<Data = Bytes> + Send + 'static,
    RB::Error: Into<BoxError>,
{
    let (stop_tx, stop_rx) = tokio::sync::watch::channel(false);
    let mut connections = tokio::task::JoinSet::new();
    tokio::pin!(shutdown);
    // TLS-2: with TLS, each connection's handshake runs in its own task first.
    let tls = match crate::tls::current() {
        Ok(t) => t.map(|t| t.grpc_acceptor()),
        Err(e) => {
            tracing::error!("the {name}'s server cannot start: {e}");
            return;
        }
    };
    loop {
        tokio::select! {
            () = &mut shutdown => break,
            Some(_) = connections.join_next(), if !connections.is_empty() => {}
            accepted = listener.accept() => match accepted {
                Ok((tcp, peer)) => {
                    let _ = tcp.set_nodelay(true);
                    match (&tls, &divert) {
                        (None, None) => {
                            connections.spawn(serve_connection(tcp, svc.clone(), stop_rx.clone()));
                        }
                        (None, Some(divert)) => {
                            let (svc, stop, divert) = (svc.clone(), stop_rx.clone(), divert.clone());
                            connections.spawn(async move {
                                let mut first = [0u8; 1];
                                match tokio::time::timeout(HANDSHAKE_TIMEOUT, tcp.peek(&mut first)).await {
                                    Ok(Ok(1)) if first[0] == divert.first_byte => (divert.take)(tcp),
                                    Ok(Ok(1)) => serve_connection(tcp, svc, stop).await,
                                    _ => {}
                                }
                            });
                        }
                        (Some(acceptor), _) => {
                            let acceptor = acceptor.clone();
                            let (svc, stop) = (svc.clone(), stop_rx.clone());
                            connections.spawn(async move {
                                match tokio::time::timeout(HANDSHAKE_TIMEOUT, acceptor.accept(tcp)).await {
                                    Ok(Ok(s)) => serve_connection(s, svc, stop).await,
                                    Ok(Err(e)) => tracing::warn!(
                                        "the {name} refused a TLS connection from {peer}: {}",
                                        crate::tls::explain_chain(&e, "the client")
                                            .unwrap_or_else(|| e.to_string())
                                    ),
                                    Err(_) => tracing::warn!(
                                        "the {name} dropped a connection from {peer}: no TLS handshake within {HANDSHAKE_TIMEOUT:?}"
                                    ),
                                }
                            });
                        }
                    }
                }
                Err(_) => tokio::time::sleep(Duration::from_millis(50)).await,
            },
        }
    }
    drop(listener);
    let _ = stop_tx.send(true);
    while connections.join_next().await.is_some() {}
}

async fn serve_connection<IO, S, RB>(io: IO, svc: S, mut stop: tokio::sync::watch::Receiver<bool>)
where
    S: tower_service::Service<http::Request<Body>, Response = http::Response<RB>>
        + Clone
        + Send
        + 'static,
    S::Error: Into<BoxError>,
    S::Future: Send + 'static,
    RB: http_body::Body<Data = Bytes> + Send + 'static,
    RB::Error: Into<BoxError>,
    IO: tokio::io::AsyncRead + tokio::io::AsyncWrite + Unpin + Send + 'static,
{
    let handshake = h2::server::Builder::new()
        .initial_window_size(SERVER_WINDOW)
        .initial_connection_window_size(SERVER_WINDOW)
        .max_header_list_size(SERVER_MAX_HEADER_LIST)
        .handshake::<_, Bytes>(io);
    // A peer that never sends the HTTP/2 preface is dropped, and does not hold up a stop.
    let conn = tokio::select! {
        c = tokio::time::timeout(HANDSHAKE_TIMEOUT, handshake) => c,
        _ = stop.wait_for(|s| *s) => return,
    };
    let Ok(Ok(mut conn)) = conn else { return };
    let mut stopping = *stop.borrow();
    if stopping {
        conn.graceful_shutdown();
    }
    loop {
        tokio::select! {
            next = conn.accept() => match next {
                Some(Ok((req, respond))) => {
                    tokio::spawn(answer(req, respond, svc.clone()));
                }
                _ => return,
            },
            changed = stop.changed(), if !stopping => {
                stopping = true;
                if changed.is_err() || *stop.borrow() {
                    // NET-2: GOAWAY; the calls in flight are still answered.
                    conn.graceful_shutdown();
                }
            }
        }
    }
}

/// Runs one request through `svc` and sends its reply, unless the client resets the
/// stream first.
async fn answer<S, RB>(
    req: http::Request<h2::RecvStream>,
    mut respond: h2::server::SendResponse<Bytes>,
    mut svc: S,
) where
    S: tower_service::Service<http::Request<Body>, Response = http::Response<RB>>,
    S::Error: Into<BoxError>,
    RB: http_body::Body<Data = Bytes>,
    RB::Error: Into<BoxError>,
{
    let (parts, recv) = req.into_parts();
    let req = http::Request::from_parts(parts, Body::new(RecvBody { recv, data_done: false }));
    let reply = async {
        std::future::poll_fn(|cx| svc.poll_ready(cx)).await.map_err(Into::into)?;
        svc.call(req).await.map_err(Into::into)
    };
    tokio::pin!(reply);
    let reset = std::future::poll_fn(|cx| respond.poll_reset(cx));
    let reply: Result<http::Response<RB>, BoxError> = tokio::select! {
        r = &mut reply => r,
        _ = reset => return,
    };
    let Ok(reply) = reply else {
        respond.send_reset(h2::Reason::INTERNAL_ERROR);
        return;
    };
    let (parts, body) = reply.into_parts();
    let end = body.is_end_stream();
    let Ok(mut send) = respond.send_response(http::Response::from_parts(parts, ()), end) else {
        return;
    };
    if end {
        return;
    }
    tokio::pin!(body);
    loop {
        let frame = tokio::select! {
            f = body.frame() => f,
            _ = std::future::poll_fn(|cx| send.poll_reset(cx)) => return,
        };
        let sent = match frame {
            None => send.send_data(Bytes::new(), true),
            Some(Err(_)) => {
                send.send_reset(h2::Reason::INTERNAL_ERROR);
                return;
            }
            Some(Ok(frame)) => match frame.into_data() {
                Ok(d) => {
                    let last = body.is_end_stream();
                    let sent = send.send_data(d, last);
                    if last {
                        return;
                    }
                    sent
                }
                Err(frame) => match frame.into_trailers() {
                    Ok(t) => {
                        let _ = send.send_trailers(t);
                        return;
                    }
                    Err(_) => continue,
                },
            },
        };
        if sent.is_err() {
            return;
        }
    }
}

#[cfg(test)]
mod tests {
    use std::time::{Duration, Instant};

    use tonic::codegen::tokio_stream::{self, Stream};
    use tonic::{Request, Response, Status};

    use crate::pb;
    use crate::pb::worker_service_server::{WorkerService, WorkerServiceServer};

    /// A worker server whose calls answer what the tests below need.
    struct Fake;

    /// How many "hang" calls are running in a [`Fake`] (their handlers not dropped).
    static HANGING: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);

    struct Hanging;

    impl Hanging {
        fn enter() -> Self {
            HANGING.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
            Hanging
        }
    }

    impl Drop for Hanging {
        fn drop(&mut self) {
            HANGING.fetch_sub(1, std::sync::atomic::Ordering::SeqCst);
        }
    }

    type Replies =
        std::pin::Pin<Box<dyn Stream<Item = Result<pb::PushTasksReplies, Status>> + Send>>;

    #[tonic::async_trait]
    impl WorkerService for Fake {
        type PushTasksStream = Replies;

        async fn get_worker_info(
            &self,
            _: Request<pb::GetWorkerInfoRequest>,
        ) -> Result<Response<pb::GetWorkerInfoReply>, Status> {
            Ok(Response::new(pb::GetWorkerInfoReply { pid: 7, ..Default::default() }))
        }
        async fn exit(
            &self,
            _: Request<pb::ExitRequest>,
        ) -> Result<Response<pb::ExitReply>, Status> {
            Err(Status::unimplemented("exit"))
        }
        /// Echoes the task's name and its first argument's length; "hang" never answers.
        async fn push_task(
            &self,
            r: Request<pb::PushTaskRequest>,
        ) -> Result<Response<pb::PushTaskReply>, Status> {
            let spec = r.into_inner().spec.unwrap_or_default();
            if spec.name == "hang" {
                let _running = Hanging::enter();
                std::future::pending::<()>().await;
            }
            if spec.name == "slow" {
                tokio::time::sleep(Duration::from_millis(500)).await;
            }
            if spec.name == "refuse" {
                return Err(Status::failed_precondition("refused by the fake"));
            }
            let len = match spec.args.first().and_then(|a| a.kind.as_ref()) {
                Some(pb::task_arg::Kind::Value(v)) => v.len(),
                _ => 0,
            };
            Ok(Response::new(pb::PushTaskReply {
                worker_id: format!("{}:{len}", spec.name),
                ..Default::default()
            }))
        }
        /// One reply message per task, each carrying 100 KiB.
        async fn push_tasks(
            &self,
            r: Request<pb::PushTasksRequest>,
        ) -> Result<Response<Replies>, Status> {
            let n = r.into_inner().specs.len() as u32;
            let items = (0..n).map(|index| {
                Ok(pb::PushTasksReplies {
                    items: vec![pb::PushTasksItem {
                        index,
                        reply: Some(pb::PushTaskReply {
                            worker_id: "x".repeat(100 * 1024),
                            ..Default::default()
                        }),
                    }],
                })
            });
            Ok(Response::new(Box::pin(tokio_stream::iter(items.collect::<Vec<_>>()))))
        }
        async fn get_object(
            &self,
            _: Request<pb::GetObjectRequest>,
        ) -> Result<Response<pb::GetObjectReply>, Status> {
            Err(Status::unimplemented("get_object"))
        }
        async fn report_generator_item(
            &self,
            _: Request<pb::ReportGeneratorItemRequest>,
        ) -> Result<Response<pb::ReportGeneratorItemReply>, Status> {
            Err(Status::unimplemented("report_generator_item"))
        }
        async fn cancel_task(
            &self,
            _: Request<pb::CancelTaskRequest>,
        ) -> Result<Response<pb::CancelTaskReply>, Status> {
            Err(Status::unimplemented("cancel_task"))
        }
        async fn cancel_owned(
            &self,
            _: Request<pb::CancelOwnedRequest>,
        ) -> Result<Response<pb::CancelOwnedReply>, Status> {
            Err(Status::unimplemented("cancel_owned"))
        }
        async fn update_borrower(
            &self,
            _: Request<pb::UpdateBorrowerRequest>,
        ) -> Result<Response<pb::UpdateBorrowerReply>, Status> {
            Err(Status::unimplemented("update_borrower"))
        }
        async fn update_borrowers(
            &self,
            _: Request<pb::UpdateBorrowersRequest>,
        ) -> Result<Response<pb::UpdateBorrowersReply>, Status> {
            Err(Status::unimplemented("update_borrowers"))
        }
        async fn report_object_copy(
            &self,
            _: Request<pb::ReportObjectCopyRequest>,
        ) -> Result<Response<pb::ReportObjectCopyReply>, Status> {
            Err(Status::unimplemented("report_object_copy"))
        }
        async fn report_logs(
            &self,
            _: Request<pb::ReportLogsRequest>,
        ) -> Result<Response<pb::ReportLogsReply>, Status> {
            Err(Status::unimplemented("report_logs"))
        }
    }

    /// Serves [`Fake`] on `listener` (with tonic's server, or with [`super::serve`] when
    /// `ours`) until the returned sender is dropped or fired; the task ends when serving
    /// has.
    fn serve(
        listener: tokio::net::TcpListener,
        ours: bool,
    ) -> (tokio::sync::oneshot::Sender<()>, tokio::task::JoinHandle<()>) {
        let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
        let stopped = async {
            let _ = stopped.await;
        };
        let task = if ours {
            tokio::spawn(async move {
                super::serve("worker", listener, WorkerServiceServer::new(Fake), stopped).await;
            })
        } else {
            tokio::spawn(async move {
                tonic::transport::Server::builder()
                    .add_service(WorkerServiceServer::new(Fake))
                    .serve_with_incoming_shutdown(crate::incoming(listener), stopped)
                    .await
                    .unwrap();
            })
        };
        (stop, task)
    }

    fn task(name: &str, arg_bytes: usize) -> pb::PushTaskRequest {
        pb::PushTaskRequest {
            spec: Some(pb::TaskSpec {
                name: name.to_string(),
                args: vec![pb::TaskArg {
                    kind: Some(pb::task_arg::Kind::Value(vec![7; arg_bytes])),
                    ..Default::default()
                }],
                ..Default::default()
            }),
        }
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn calls_go_through_h2_to_tonics_server() {
        calls_go_through_h2(false).await;
    }

    /// NET-2: the h2 channel against the h2 server: unary calls, large bodies, server streams
    /// and statuses as tonic's.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn calls_go_through_h2_to_our_server() {
        calls_go_through_h2(true).await;
    }

    /// tonic's own client (hyper) against our server.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn tonics_channel_is_served_by_our_server() {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap().to_string();
        let _stop = serve(listener, true);
        let mut c = pb::worker_service_client::WorkerServiceClient::new(
            crate::client::channel(&addr).unwrap(),
        );
        assert_eq!(
            c.get_worker_info(pb::GetWorkerInfoRequest {}).await.unwrap().into_inner().pid,
            7
        );
        let r = c.push_task(task("big", 3 << 20)).await.unwrap().into_inner();
        assert_eq!(r.worker_id, format!("big:{}", 3 << 20));
        let e = c.push_task(task("refuse", 1)).await.unwrap_err();
        assert_eq!(e.code(), tonic::Code::FailedPrecondition);
    }

    /// Our server, told to stop, answers the call in flight and then returns.
    /// NET-2: a server told to stop sends GOAWAY and answers the calls in flight.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn our_server_stops_after_answering_calls_in_flight() {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap().to_string();
        let (stop, served) = serve(listener, true);
        let mut c = crate::client::worker(&addr, None).unwrap();
        // A connection that never speaks HTTP/2 does not hold up the stop.
        let _silent = tokio::net::TcpStream::connect(&addr).await.unwrap();
        let mut slow = c.clone();
        let call = tokio::spawn(async move { slow.push_task(task("slow", 1)).await });
        tokio::time::sleep(Duration::from_millis(100)).await;
        stop.send(()).unwrap();
        tokio::time::sleep(Duration::from_millis(100)).await;
        assert!(!served.is_finished(), "a call is still in flight");
        let r = call.await.unwrap().unwrap().into_inner();
        assert_eq!(r.worker_id, "slow:1");
        tokio::time::timeout(Duration::from_secs(5), served).await.unwrap().unwrap();
        // Nothing listens any more (a call may first find the old connection closed).
        let mut refused = false;
        for _ in 0..3 {
            let e = c.get_worker_info(pb::GetWorkerInfoRequest {}).await.unwrap_err();
            refused |= e.message().starts_with("tcp connect error");
        }
        assert!(refused);
    }

    async fn calls_go_through_h2(ours: bool) {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap().to_string();
        let _stop = serve(listener, ours);
        let mut c = crate::client::worker(&addr, None).unwrap();

        let info = c.get_worker_info(pb::GetWorkerInfoRequest {}).await.unwrap().into_inner();
        assert_eq!(info.pid, 7);
        // Larger than the server's stream and connection windows: sent as the window opens.
        let r = c.push_task(task("big", 3 << 20)).await.unwrap().into_inner();
        assert_eq!(r.worker_id, format!("big:{}", 3 << 20));
        // Many calls at once on the one connection.
        let calls = (0..64).map(|i| {
            let mut c = c.clone();
            async move { c.push_task(task(&format!("t{i}"), i)).await.unwrap().into_inner() }
        });
        let replies = futures_join_all(calls).await;
        for (i, r) in replies.iter().enumerate() {
            assert_eq!(r.worker_id, format!("t{i}:{i}"));
        }
        // A server stream of 6 MiB, more than this side's 5 MiB connection window: read
        // only because each frame's capacity goes back to the window.
        let mut s = c
            .push_tasks(pb::PushTasksRequest { specs: vec![pb::TaskSpec::default(); 60] })
            .await
            .unwrap()
            .into_inner();
        let mut n = 0;
        while let Some(m) = s.message().await.unwrap() {
            assert_eq!(m.items[0].index, n);
            assert_eq!(m.items[0].reply.as_ref().unwrap().worker_id.len(), 100 * 1024);
            n += 1;
        }
        assert_eq!(n, 60);
        // A status from the server arrives as it was sent.
        let e = c.push_task(task("refuse", 1)).await.unwrap_err();
        assert_eq!(e.code(), tonic::Code::FailedPrecondition);
        assert_eq!(e.message(), "refused by the fake");
    }

    /// NET-2: `grpc-timeout` is the client's deadline; the reset call's handler is dropped.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_deadline_ends_a_call_the_server_does_not_answer() {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap().to_string();
        let _stop = serve(listener, true);
        let mut c = crate::client::worker(&addr, None).unwrap();
        let mut req = Request::new(task("hang", 1));
        req.set_timeout(Duration::from_millis(200));
        let started = Instant::now();
        let e = c.push_task(req).await.unwrap_err();
        assert_eq!(e.code(), tonic::Code::DeadlineExceeded, "{e:?}");
        assert!(started.elapsed() < Duration::from_secs(10));
        // The client reset the stream, and the server dropped the handler.
        let mut left = HANGING.load(std::sync::atomic::Ordering::SeqCst);
        for _ in 0..100 {
            if left == 0 {
                break;
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
            left = HANGING.load(std::sync::atomic::Ordering::SeqCst);
        }
        assert_eq!(left, 0, "the abandoned call's handler is dropped");
        // The connection still serves other calls.
        assert_eq!(
            c.get_worker_info(pb::GetWorkerInfoRequest {}).await.unwrap().into_inner().pid,
            7
        );
    }

    /// NET-2: a failed connect is `UNAVAILABLE` "tcp connect error", a lost connection a
    /// "transport error", and a later call connects again.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn refused_calls_say_connect_and_a_restarted_server_is_reached_again() {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        drop(listener);
        let mut c = crate::client::worker(&addr.to_string(), None).unwrap();
        let e = c.get_worker_info(pb::GetWorkerInfoRequest {}).await.unwrap_err();
        assert_eq!(e.code(), tonic::Code::Unavailable, "{e:?}");
        assert!(e.message().starts_with("tcp connect error"), "{e:?}");

        // A server that takes the connection and drops it: the call fails as a transport
        // error, not a connect error (it may have been delivered).
        let raw = tokio::net::TcpListener::bind(addr).await.unwrap();
        let dropper = tokio::spawn(async move {
            let (mut s, _) = raw.accept().await.unwrap();
            let mut buf = [0u8; 64];
            let _ = tokio::io::AsyncReadExt::read(&mut s, &mut buf).await;
        });
        let e = c.push_task(task("lost", 1)).await.unwrap_err();
        assert!(!e.message().contains("connect"), "{e:?}");
        assert!(crate::client::status_chain(&e).starts_with("transport error: "), "{e:?}");
        dropper.await.unwrap();

        // A real server at the same address: a later call connects again (one made before
        // the connection task has seen the old connection close still fails on it).
        let _stop = serve(tokio::net::TcpListener::bind(addr).await.unwrap(), true);
        let mut reached = None;
        for _ in 0..50 {
            if let Ok(r) = c.get_worker_info(pb::GetWorkerInfoRequest {}).await {
                reached = Some(r.into_inner().pid);
                break;
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        assert_eq!(reached, Some(7));
    }

    /// Runs the futures concurrently and returns their outputs in order.
    async fn futures_join_all<F: std::future::Future + Send + 'static>(
        fs: impl Iterator<Item = F>,
    ) -> Vec<F::Output>
    where
        F::Output: Send + 'static,
    {
        let handles: Vec<_> = fs.map(tokio::spawn).collect();
        let mut out = Vec::with_capacity(handles.len());
        for h in handles {
            out.push(h.await.unwrap());
        }
        out
    }
}
