//! Direct calls (CORE-15): a plain TCP connection from a caller process to a worker that
//! carries actor calls and single task pushes, and their replies, as length-prefixed
//! protobuf frames written and read by the threads that make and finish the calls.
//!
//! Over the gRPC channel (`h2grpc`), a sync actor call crosses six threads: the caller
//! hands it to the actor's sender task, that to the HTTP/2 connection task, which writes;
//! on the worker the connection task hands it to the handler, that to an executor thread,
//! which hands the reply back to the runtime to write; and the reply's way back in the
//! caller crosses the connection task and the call's task before the caller wakes. Each
//! hand-off is a thread wake; where the CPUs are idle between calls (a VM whose idle
//! vCPUs halt, as the 2-core VM of issue 35, where waking one cost about half of a 55 µs
//! raw loopback round trip) the wakes are most of a sync call's time. Here the
//! caller's own thread writes an actor call (when the actor's sender has nothing queued,
//! see `core::actors`), one reader thread per connection on each side reads, and the
//! executor thread (or an async actor's event loop) writes the reply itself: two
//! hand-offs a side fewer. A push of a single task to a leased worker goes on it from the
//! lease's task (`core::leasing`); pipelined batches of several stay on `PushTasks`, and
//! so does a push made before the connection is open. The worker answers from
//! the executor thread and handing a queued task back unrun as over gRPC (CORE-9).
//!
//! The connection shares the worker's gRPC port: its first byte, [`FIRST_BYTE`], is never
//! the first byte of HTTP/2's preface (`P`), and the worker's server hands it here
//! ([`tpuray_proto::h2grpc::Divert`]). Never with TLS (TLS-2): the server diverts nothing
//! and callers do not connect, so calls stay on the TLS gRPC channel.
//! `TPURAY_DIRECT_CALLS=0` in a caller's environment keeps its calls on gRPC too (for
//! comparisons).
//!
//! Wire format, little-endian:
//! - opening, caller to worker: [`MAGIC`] (8 bytes), the cluster token's length (u16) and
//!   bytes (length 0: none); the worker answers one byte, 1 accepted or 0 refused (a
//!   missing or wrong token where auth is required, as `ServerAuth` decides, or
//!   [`MAX_CONNECTIONS`] open already), then closes a refused connection. A refused
//!   caller keeps its calls on gRPC: with a wrong token they fail there with the named
//!   UNAUTHENTICATED error, past the connection limit they simply run there.
//! - a frame: its length (u32, what follows), the call id (u64, the caller's), a kind
//!   (u8), the body. Caller to worker: kind 0, an encoded `TaskSpec`. Worker to caller:
//!   kind 0, an encoded `PushTaskReply`; kind 1, a refusal: a gRPC code (u32) and a UTF-8
//!   message, as the gRPC handler's `Status` would be. A call a stopping worker did not
//!   take is refused `UNAVAILABLE` with "connect error" in its message: never run, so
//!   it is sent again like a call whose connection was refused.
//!
//! Failures: a connection that breaks (read or write error, end of stream, or the worker's
//! node declared dead, CORE-10) fails every call in flight on it as a call whose
//! connection was lost under it (`UNKNOWN` "transport error"; for a dead node the same
//! `node died` status as the gRPC path), which the actor's sender decides as before
//! (resend, retry or fail, CORE-4/5). TCP keepalive finds a silent peer after about 30 s
//! (10 s idle, then 4 probes 5 s apart), as the gRPC channel's 10 s + 20 s keepalive does.
//! A frame above [`tpuray_proto::MAX_MESSAGE_BYTES`] breaks the connection.

use std::collections::HashMap;
use std::io::{self, BufReader, Read, Write};
use std::net::{Shutdown, TcpStream};
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use prost::Message;
use tonic::Status;
use tpuray_proto::pb;

use crate::executor::{Replier, stopped};
use crate::service::Svc;

/// The first byte of a direct connection (HTTP/2's preface starts with `P`).
pub(crate) const FIRST_BYTE: u8 = 0;
/// What a direct connection opens with.
pub(crate) const MAGIC: &[u8; 8] = b"\0TPRYDC1";
const KIND_CALL: u8 = 0;
const KIND_REPLY: u8 = 0;
const KIND_REFUSED: u8 = 1;
/// Bytes before a frame's body: length, call id, kind.
const HEADER: usize = 4 + 8 + 1;
/// How long connecting and the opening exchange may take.
const CONNECT_TIMEOUT: Duration = Duration::from_secs(5);
/// Direct connections a process opens at most, and a worker takes at most: each holds a
/// reader thread, so a driver calling thousands of actors (or an actor called by
/// thousands of processes) keeps the rest of its calls on gRPC.
pub(crate) const MAX_CONNECTIONS: usize = 256;
/// A direct connection's reader thread's stack: it decodes replies and records results
/// (which may run a foreign runtime's completion callbacks).
const READER_STACK: usize = 2 * 1024 * 1024;
/// Direct connections this process opened that are not closed yet.
static OPEN: AtomicUsize = AtomicUsize::new(0);

/// Whether this process's actor calls and task pushes may use direct connections: not
/// with TLS, and not when `TPURAY_DIRECT_CALLS` is `0` (read once per process).
pub(crate) fn enabled() -> bool {
    static ON: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *ON.get_or_init(|| {
        std::env::var("TPURAY_DIRECT_CALLS").as_deref() != Ok("0") && !tpuray_proto::tls::enabled()
    })
}

/// One frame: header and `body` in one buffer (one write).
fn frame(id: u64, kind: u8, body_len: usize, body: impl FnOnce(&mut Vec<u8>)) -> Vec<u8> {
    let mut buf = Vec::with_capacity(HEADER + body_len);
    buf.extend_from_slice(&((8 + 1 + body_len) as u32).to_le_bytes());
    buf.extend_from_slice(&id.to_le_bytes());
    buf.push(kind);
    body(&mut buf);
    buf
}

/// Reads one frame into `body`: (call id, kind).
fn read_frame(r: &mut impl Read, body: &mut Vec<u8>) -> io::Result<(u64, u8)> {
    let mut head = [0u8; HEADER];
    r.read_exact(&mut head)?;
    let len = u32::from_le_bytes(head[0..4].try_into().expect("4 bytes")) as usize;
    if !(9..=tpuray_proto::MAX_MESSAGE_BYTES + 9).contains(&len) {
        return Err(io::Error::new(
            io::ErrorKind::InvalidData,
            format!(
                "a direct-call frame of {len} bytes (expected 9 to {})",
                tpuray_proto::MAX_MESSAGE_BYTES + 9
            ),
        ));
    }
    let id = u64::from_le_bytes(head[4..12].try_into().expect("8 bytes"));
    body.clear();
    body.resize(len - 9, 0);
    r.read_exact(body)?;
    Ok((id, head[12]))
}

fn refusal(id: u64, status: &Status) -> Vec<u8> {
    let msg = status.message().as_bytes();
    frame(id, KIND_REFUSED, 4 + msg.len(), |b| {
        b.extend_from_slice(&(status.code() as i32 as u32).to_le_bytes());
        b.extend_from_slice(msg);
    })
}

/// TCP keepalive: 10 s idle, then 4 probes 5 s apart.
fn keepalive(s: &TcpStream) {
    use std::os::fd::AsRawFd;
    let fd = s.as_raw_fd();
    let set = |level, name, v: libc::c_int| {
        // SAFETY: fd is an open socket; the value is a c_int of the size given.
        unsafe {
            libc::setsockopt(
                fd,
                level,
                name,
                (&v as *const libc::c_int).cast(),
                std::mem::size_of::<libc::c_int>() as libc::socklen_t,
            )
        };
    };
    set(libc::SOL_SOCKET, libc::SO_KEEPALIVE, 1);
    set(libc::IPPROTO_TCP, libc::TCP_KEEPIDLE, 10);
    set(libc::IPPROTO_TCP, libc::TCP_KEEPINTVL, 5);
    set(libc::IPPROTO_TCP, libc::TCP_KEEPCNT, 4);
}

// ---- the worker's side ----

/// The worker's end: takes diverted connections, one reader thread each, and answers
/// from the threads that finish the calls.
pub(crate) struct DirectServer {
    svc: Arc<Svc>,
    auth: tpuray_proto::auth::ServerAuth,
    /// Set when the worker's server stops: calls arriving after it are refused unrun.
    stopping: AtomicBool,
    /// Calls taken and not answered yet.
    in_flight: Arc<AtomicUsize>,
    /// Each open connection (a clone of its socket), to close them when the server stops.
    conns: Mutex<Vec<TcpStream>>,
}

impl DirectServer {
    pub(crate) fn new(svc: Arc<Svc>, auth: tpuray_proto::auth::ServerAuth) -> Arc<Self> {
        Arc::new(Self {
            svc,
            auth,
            stopping: AtomicBool::new(false),
            in_flight: Arc::new(AtomicUsize::new(0)),
            conns: Mutex::new(Vec::new()),
        })
    }

    /// Takes a connection the gRPC server diverted (it opened with [`FIRST_BYTE`]).
    pub(crate) fn take(self: &Arc<Self>, tcp: tokio::net::TcpStream) {
        let Ok(std) = tcp.into_std() else { return };
        if std.set_nonblocking(false).is_err() {
            return;
        }
        let me = Arc::clone(self);
        let _ = std::thread::Builder::new()
            .name("tpuray-direct-in".into())
            .stack_size(READER_STACK)
            .spawn(move || me.serve_connection(std));
    }

    /// Refuses what arrives from now on, waits until every call taken was answered, then
    /// closes the connections (as the gRPC server answers its calls in flight on GOAWAY).
    pub(crate) async fn stop(&self) {
        self.stopping.store(true, Ordering::SeqCst);
        while self.in_flight.load(Ordering::SeqCst) > 0 {
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
        for c in self.conns.lock().unwrap().drain(..) {
            let _ = c.shutdown(Shutdown::Both);
        }
    }

    fn serve_connection(self: Arc<Self>, s: TcpStream) {
        let _ = s.set_nodelay(true);
        keepalive(&s);
        let (Ok(writer), Ok(closer)) = (s.try_clone(), s.try_clone()) else { return };
        let mut reader = BufReader::with_capacity(64 * 1024, s);
        let writer = Arc::new(Mutex::new(writer));
        if !self.opening(&mut reader, &writer) {
            return;
        }
        self.conns.lock().unwrap().push(closer);
        let mut body = Vec::new();
        while let Ok((id, kind)) = read_frame(&mut reader, &mut body) {
            let refused = match self.call(id, kind, &body, &writer) {
                Ok(()) => continue,
                Err(status) => refusal(id, &status),
            };
            if writer.lock().unwrap().write_all(&refused).is_err() {
                break;
            }
        }
        let me = reader.get_ref();
        let _ = me.shutdown(Shutdown::Both);
        let mut conns = self.conns.lock().unwrap();
        if let (Ok(local), Ok(peer)) = (me.local_addr(), me.peer_addr()) {
            conns
                .retain(|c| c.local_addr().ok() != Some(local) || c.peer_addr().ok() != Some(peer));
        }
    }

    /// Reads the opening and answers it; false when refused or broken.
    fn opening(&self, r: &mut BufReader<TcpStream>, w: &Mutex<TcpStream>) -> bool {
        let _ = r.get_ref().set_read_timeout(Some(CONNECT_TIMEOUT));
        let mut magic = [0u8; 8];
        let mut len = [0u8; 2];
        if r.read_exact(&mut magic).is_err() || &magic != MAGIC || r.read_exact(&mut len).is_err() {
            return false;
        }
        let mut token = vec![0u8; u16::from_le_bytes(len) as usize];
        if r.read_exact(&mut token).is_err() {
            return false;
        }
        let mut md = tonic::metadata::MetadataMap::new();
        if !token.is_empty()
            && let Ok(v) = format!("Bearer {}", String::from_utf8_lossy(&token)).parse()
        {
            md.insert("authorization", v);
        }
        let ok = self.auth.check(&md).is_ok() && self.conns.lock().unwrap().len() < MAX_CONNECTIONS;
        let answered = w.lock().unwrap().write_all(&[u8::from(ok)]).is_ok();
        let _ = r.get_ref().set_read_timeout(None);
        ok && answered
    }

    /// Takes one call; `Err` is the refusal to send back.
    fn call(
        &self,
        id: u64,
        kind: u8,
        body: &[u8],
        w: &Arc<Mutex<TcpStream>>,
    ) -> Result<(), Status> {
        if kind != KIND_CALL {
            return Err(Status::invalid_argument(format!(
                "a direct-call frame of kind {kind} (expected {KIND_CALL}, a call)"
            )));
        }
        if self.stopping.load(Ordering::SeqCst) {
            return Err(Status::unavailable(
                "connect error: the worker is stopping and takes no new calls (not run)",
            ));
        }
        let spec = pb::TaskSpec::decode(body)
            .map_err(|e| Status::invalid_argument(format!("a direct call's task spec: {e}")))?;
        crate::service::check_spec(&spec)?;
        let ex = self.svc.executor.get().ok_or_else(|| {
            Status::failed_precondition("this process is a driver and does not execute tasks")
        })?;
        self.in_flight.fetch_add(1, Ordering::SeqCst);
        let answer = Answer {
            id,
            writer: Arc::clone(w),
            in_flight: Arc::clone(&self.in_flight),
            answered: false,
        };
        let reply = Replier::Direct(Box::new(move |reply| answer.send(reply)));
        if spec.actor_id.is_empty() {
            ex.enqueue_task_to(spec, reply);
        } else {
            ex.push_call(spec, reply);
        }
        Ok(())
    }
}

/// A call's way back; dropped unanswered (its executor stopped), it answers as the gRPC
/// handler does then: `executor stopped`.
struct Answer {
    id: u64,
    writer: Arc<Mutex<TcpStream>>,
    in_flight: Arc<AtomicUsize>,
    answered: bool,
}

impl Answer {
    fn send(mut self, reply: pb::PushTaskReply) {
        self.write(&reply);
    }

    fn write(&mut self, reply: &pb::PushTaskReply) {
        self.answered = true;
        let bytes = frame(self.id, KIND_REPLY, reply.encoded_len(), |b| {
            reply.encode(b).expect("a Vec grows")
        });
        // A write that fails means the caller is gone; its reader thread sees the break.
        let _ = self.writer.lock().unwrap().write_all(&bytes);
        self.in_flight.fetch_sub(1, Ordering::SeqCst);
    }
}

impl Drop for Answer {
    fn drop(&mut self) {
        if !self.answered {
            self.write(&stopped());
        }
    }
}

// ---- the caller's side ----

/// What a call's reply, or its failure, is handed to (on the connection's reader thread,
/// or on the calling thread when the write fails).
pub(crate) type Done = Box<dyn FnOnce(Result<pb::PushTaskReply, Status>) + Send>;

/// A call's frame, for [`DirectConn::call`] (which sets its id).
pub(crate) fn encode_call(spec: &pb::TaskSpec) -> Vec<u8> {
    frame(0, KIND_CALL, spec.encoded_len(), |b| spec.encode(b).expect("a Vec grows"))
}

/// The call in a frame [`encode_call`] made.
pub(crate) fn decode_call(frame: &[u8]) -> pb::TaskSpec {
    pb::TaskSpec::decode(&frame[HEADER..]).expect("encode_call's frame decodes")
}

/// What became of a call handed to [`DirectConn::call`].
pub(crate) enum Sent {
    /// On its way: its `Done` gets the outcome.
    Yes,
    /// Not sent, the connection being closed: send it another way (the frame's call is
    /// [`decode_call`]'s).
    Not(Done, Vec<u8>),
    /// The write failed part way: lost as under a broken connection (it may have
    /// reached the worker); hand `Done` the status.
    Lost(Done, Status),
}

/// A caller's direct connection to one worker address.
pub(crate) struct DirectConn {
    pub(crate) address: String,
    writer: Mutex<TcpStream>,
    calls: Mutex<HashMap<u64, Done>>,
    next_id: AtomicU64,
    alive: AtomicBool,
    /// Why it was closed from this side (a dead node): what its calls fail with.
    closed_with: Mutex<Option<Status>>,
}

impl DirectConn {
    /// Connects to the worker at `address` and opens a direct connection (blocking, up to
    /// 5 s for each step); its reader thread runs with `rt` entered, so what the calls'
    /// `Done`s start runs on that runtime.
    ///
    /// # Errors
    /// Connecting failed, or the worker refused (its cluster token differs) or does not
    /// speak this protocol.
    pub(crate) fn connect(
        address: &str,
        token: Option<&str>,
        rt: tokio::runtime::Handle,
    ) -> io::Result<Arc<Self>> {
        if OPEN.fetch_add(1, Ordering::SeqCst) >= MAX_CONNECTIONS {
            OPEN.fetch_sub(1, Ordering::SeqCst);
            return Err(io::Error::other(format!(
                "{MAX_CONNECTIONS} direct connections are open in this process"
            )));
        }
        let opened = Self::open(address, token, rt);
        if opened.is_err() {
            OPEN.fetch_sub(1, Ordering::SeqCst);
        }
        opened
    }

    fn open(
        address: &str,
        token: Option<&str>,
        rt: tokio::runtime::Handle,
    ) -> io::Result<Arc<Self>> {
        use std::net::ToSocketAddrs;
        let addr = address
            .to_socket_addrs()?
            .next()
            .ok_or_else(|| io::Error::new(io::ErrorKind::NotFound, address.to_string()))?;
        let s = TcpStream::connect_timeout(&addr, CONNECT_TIMEOUT)?;
        s.set_nodelay(true)?;
        keepalive(&s);
        let token = token.unwrap_or("").as_bytes();
        let mut opening = MAGIC.to_vec();
        opening.extend_from_slice(&(token.len().min(u16::MAX as usize) as u16).to_le_bytes());
        opening.extend_from_slice(&token[..token.len().min(u16::MAX as usize)]);
        s.set_read_timeout(Some(CONNECT_TIMEOUT))?;
        s.set_write_timeout(Some(CONNECT_TIMEOUT))?;
        (&s).write_all(&opening)?;
        let mut answer = [0u8; 1];
        (&s).read_exact(&mut answer)?;
        if answer[0] != 1 {
            return Err(io::Error::new(
                io::ErrorKind::PermissionDenied,
                format!("the worker at {address} refused a direct connection"),
            ));
        }
        s.set_read_timeout(None)?;
        s.set_write_timeout(None)?;
        let reader = s.try_clone()?;
        let conn = Arc::new(Self {
            address: address.to_string(),
            writer: Mutex::new(s),
            calls: Mutex::new(HashMap::new()),
            next_id: AtomicU64::new(1),
            alive: AtomicBool::new(true),
            closed_with: Mutex::new(None),
        });
        let me = Arc::clone(&conn);
        std::thread::Builder::new()
            .name("tpuray-direct-out".into())
            .stack_size(READER_STACK)
            .spawn(move || {
                let _rt = rt.enter();
                me.read_replies(reader);
                OPEN.fetch_sub(1, Ordering::SeqCst);
            })?;
        Ok(conn)
    }

    /// Whether calls may still go out on it.
    pub(crate) fn alive(&self) -> bool {
        self.alive.load(Ordering::SeqCst)
    }

    /// Sends a call [`encode_call`] made, on the calling thread; `done` gets its reply or
    /// failure from the reader thread, unless this says otherwise.
    pub(crate) fn call(&self, mut frame: Vec<u8>, done: Done) -> Sent {
        if !self.alive() {
            return Sent::Not(done, frame);
        }
        let id = self.next_id.fetch_add(1, Ordering::Relaxed);
        frame[4..12].copy_from_slice(&id.to_le_bytes());
        self.calls.lock().unwrap().insert(id, done);
        let written = self.writer.lock().unwrap().write_all(&frame);
        match written {
            Ok(()) => Sent::Yes,
            Err(e) => {
                self.close(None);
                // The reader fails it, unless it finished failing the others first.
                let done = self.calls.lock().unwrap().remove(&id);
                match done {
                    Some(done) => Sent::Lost(done, lost(&self.address, &e)),
                    None => Sent::Yes,
                }
            }
        }
    }

    /// Closes it: the reader fails every call in flight, with `status` when given.
    pub(crate) fn close(&self, status: Option<Status>) {
        if let Some(s) = status {
            self.closed_with.lock().unwrap().get_or_insert(s);
        }
        self.alive.store(false, Ordering::SeqCst);
        let _ = self.writer.lock().unwrap().shutdown(Shutdown::Both);
    }

    fn read_replies(&self, s: TcpStream) {
        let mut r = BufReader::with_capacity(64 * 1024, s);
        let mut body = Vec::new();
        let error = loop {
            let (id, kind) = match read_frame(&mut r, &mut body) {
                Ok(f) => f,
                Err(e) => break e,
            };
            let result = match kind {
                KIND_REPLY => pb::PushTaskReply::decode(body.as_slice()).map_err(|e| {
                    Status::internal(format!("a direct call's reply does not decode: {e}"))
                }),
                KIND_REFUSED if body.len() >= 4 => {
                    let code = u32::from_le_bytes(body[0..4].try_into().expect("4 bytes"));
                    Err(Status::new(
                        tonic::Code::from_i32(code as i32),
                        String::from_utf8_lossy(&body[4..]).into_owned(),
                    ))
                }
                _ => {
                    break io::Error::new(io::ErrorKind::InvalidData, format!("frame kind {kind}"));
                }
            };
            let done = self.calls.lock().unwrap().remove(&id);
            if let Some(done) = done {
                done(result);
            }
        };
        self.alive.store(false, Ordering::SeqCst);
        let _ = r.get_ref().shutdown(Shutdown::Both);
        let status = self.closed_with.lock().unwrap().clone();
        let failed: Vec<Done> = self.calls.lock().unwrap().drain().map(|(_, d)| d).collect();
        for done in failed {
            done(Err(status.clone().unwrap_or_else(|| lost(&self.address, &error))));
        }
    }
}

/// A call lost with its connection, as the gRPC channel reports one.
fn lost(address: &str, e: &io::Error) -> Status {
    Status::unknown(format!("transport error: the direct connection to {address} broke: {e}"))
}
