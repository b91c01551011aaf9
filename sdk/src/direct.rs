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
//! see `core::actors`), and the executor thread (or an async actor's event loop) writes
//! the reply itself: two hand-offs a side fewer. Reading, too, is done where it can be by
//! the thread that needs what is read: a caller waiting in a sync `get` for the reply to
//! a call it sent reads that reply itself ([`read_own_replies`]), and a worker whose
//! calls and tasks run on one executor thread (a task worker, or an actor without
//! concurrency) has that thread read its next call while it waits ([`IdleReader`]);
//! otherwise each connection's own thread reads (issue 35: one thread wake fewer a side,
//! the call then wakes only the thread the socket wakes). A thread that waits for a
//! frame that is due (a reply to a call in flight, or an idle executor's next call)
//! polls for up to [`spin_budget`] before it sleeps (CORE-16), so on a VM the frame
//! finds it awake and wakes no halted vCPU. A push of a
//! single task to a leased worker goes on it from the lease's task (`core::leasing`);
//! pipelined batches of several stay on `PushTasks`, and so does a push made before the
//! connection is open. The worker answers from the executor thread and handing a queued
//! task back unrun as over gRPC (CORE-9).
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
use std::sync::{Arc, Condvar, Mutex};
use std::time::{Duration, Instant};

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
        let (local, peer) = (closer.local_addr().ok(), closer.peer_addr().ok());
        self.conns.lock().unwrap().push(closer);
        let conn = Arc::new(Incoming::new(Arc::clone(&self), reader, writer));
        match self.svc.executor.get().and_then(|ex| ex.idle_reader()) {
            Some(idle) if idle.adopt(&conn) => {
                conn.watch();
                idle.release(&conn);
            }
            _ => conn.read_all(),
        }
        let mut conns = self.conns.lock().unwrap();
        if let (Some(local), Some(peer)) = (local, peer) {
            conns
                .retain(|c| c.local_addr().ok() != Some(local) || c.peer_addr().ok() != Some(peer));
        }
    }

    /// Takes one call read from a connection, or sends its refusal; false when the
    /// connection broke.
    fn take_call(&self, id: u64, kind: u8, body: &[u8], writer: &Arc<Mutex<TcpStream>>) -> bool {
        let refused = match self.call(id, kind, body, writer) {
            Ok(()) => return true,
            Err(status) => refusal(id, &status),
        };
        writer.lock().unwrap().write_all(&refused).is_ok()
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

/// A connection to a worker whose calls run on one executor thread: that thread reads the
/// connection itself while it has nothing to run ([`IdleReader`]), and the connection's
/// own thread only reads what arrives while the executor runs a call for longer than
/// [`LAZY`] (to refuse it when the worker stops, and so a queued call can be cancelled).
struct Incoming {
    server: Arc<DirectServer>,
    reader: Mutex<BufReader<TcpStream>>,
    writer: Arc<Mutex<TcpStream>>,
    fd: std::os::fd::RawFd,
    broken: AtomicBool,
    /// The connection's own thread: (whether it waits without a timeout, the last call).
    ticking: Mutex<(bool, Instant)>,
    wake: Condvar,
}

impl Incoming {
    fn new(
        server: Arc<DirectServer>,
        reader: BufReader<TcpStream>,
        writer: Arc<Mutex<TcpStream>>,
    ) -> Self {
        use std::os::fd::AsRawFd;
        let fd = reader.get_ref().as_raw_fd();
        Self {
            server,
            reader: Mutex::new(reader),
            writer,
            fd,
            broken: AtomicBool::new(false),
            ticking: Mutex::new((false, Instant::now())),
            wake: Condvar::new(),
        }
    }

    /// Reads calls on this thread until the connection breaks.
    fn read_all(&self) {
        let mut r = self.reader.lock().unwrap();
        let mut body = Vec::new();
        while self.take_one(&mut r, &mut body) {}
    }

    /// Reads and takes one call (blocking until it is whole); false once the connection
    /// broke, which this then shuts down.
    fn take_one(&self, r: &mut BufReader<TcpStream>, body: &mut Vec<u8>) -> bool {
        if self.broken.load(Ordering::SeqCst) {
            return false;
        }
        let taken = match read_frame(r, body) {
            Ok((id, kind)) => self.server.take_call(id, kind, body, &self.writer),
            Err(_) => false,
        };
        if !taken {
            self.broken.store(true, Ordering::SeqCst);
            let _ = r.get_ref().shutdown(Shutdown::Both);
            self.wake.notify_one();
            return false;
        }
        let mut t = self.ticking.lock().unwrap();
        t.1 = Instant::now();
        if t.0 {
            // Its own thread waits without a timeout: it ticks again while calls come.
            self.wake.notify_one();
        }
        true
    }

    /// The connection's own thread: reads what arrives while the executor thread runs a
    /// call (it reads the connection itself while idle), until the connection breaks.
    /// While calls came in the last [`IDLE`] it looks every [`LAZY`]; after that it waits
    /// for a call on the socket while the executor runs one (so a call queued behind a
    /// long one is taken at once, and can be cancelled before it starts), and for the
    /// executor to take a call while the executor reads.
    fn watch(&self) {
        let mut body = Vec::new();
        loop {
            if self.broken.load(Ordering::SeqCst) {
                return;
            }
            // Free: the executor runs a call. Held: it waits for calls on the socket.
            let executor_reads = match self.reader.try_lock() {
                Ok(mut r) => {
                    while !r.buffer().is_empty() || ready(&[(self.fd, libc::POLLIN)], 0)[0] {
                        if !self.take_one(&mut r, &mut body) {
                            return;
                        }
                    }
                    false
                }
                Err(_) => true,
            };
            let mut t = self.ticking.lock().unwrap();
            if self.broken.load(Ordering::SeqCst) {
                return;
            }
            if t.1.elapsed() < IDLE {
                drop(self.wake.wait_timeout(t, LAZY).unwrap());
            } else if executor_reads {
                t.0 = true;
                t = self.wake.wait(t).unwrap();
                t.0 = false;
            } else {
                drop(t);
                // Readable: a call (or the connection's end) while the executor is busy;
                // if the executor reads again meanwhile, the lock says so next time.
                ready(&[(self.fd, libc::POLLIN)], IDLE.as_millis() as libc::c_int);
            }
        }
    }
}

/// What a worker's only executor thread (a task worker's, or an actor's without
/// concurrency groups) reads while it waits for its next call: one
/// direct connection (the first a caller opened; calls on others are read by their own
/// threads), besides its queue. A call arriving then wakes the thread that runs it, not
/// a reader thread that hands it over: one thread wake fewer for each call (issue 35).
pub(crate) struct IdleReader {
    /// Signalled when a job is queued while the executor thread waits in `poll`.
    event: Event,
    polling: AtomicBool,
    conn: Mutex<Option<Arc<Incoming>>>,
}

impl IdleReader {
    /// `None` when the system gives no eventfd.
    pub(crate) fn new() -> Option<Self> {
        Some(Self {
            event: Event::new().ok()?,
            polling: AtomicBool::new(false),
            conn: Mutex::new(None),
        })
    }

    /// Makes `conn` the connection the executor thread reads, unless it reads one.
    fn adopt(&self, conn: &Arc<Incoming>) -> bool {
        let mut c = self.conn.lock().unwrap();
        if c.as_ref().is_some_and(|c| !c.broken.load(Ordering::SeqCst)) {
            return false;
        }
        *c = Some(Arc::clone(conn));
        drop(c);
        self.queued();
        true
    }

    fn release(&self, conn: &Arc<Incoming>) {
        let mut c = self.conn.lock().unwrap();
        if c.as_ref().is_some_and(|c| Arc::ptr_eq(c, conn)) {
            *c = None;
        }
    }

    /// Call after queueing a job for the executor thread: wakes it if it waits in `poll`.
    pub(crate) fn queued(&self) {
        if self.polling.load(Ordering::SeqCst) {
            self.event.signal();
        }
    }

    /// The executor thread's next job from `rx`, reading the connection meanwhile.
    pub(crate) fn next_job<J>(
        &self,
        rx: &std::sync::mpsc::Receiver<J>,
    ) -> Result<J, std::sync::mpsc::RecvError> {
        use std::sync::mpsc::TryRecvError;
        let mut body = Vec::new();
        loop {
            match rx.try_recv() {
                Ok(j) => return Ok(j),
                Err(TryRecvError::Disconnected) => return Err(std::sync::mpsc::RecvError),
                Err(TryRecvError::Empty) => {}
            }
            let conn = self.conn.lock().unwrap().clone();
            let conn = conn.filter(|c| !c.broken.load(Ordering::SeqCst));
            let mut r = conn.as_ref().map(|c| c.reader.lock().unwrap());
            self.polling.store(true, Ordering::SeqCst);
            // A job queued before `polling` was set did not write the eventfd.
            if let Ok(j) = rx.try_recv() {
                self.polling.store(false, Ordering::SeqCst);
                return Ok(j);
            }
            let event = (self.event.fd(), libc::POLLIN);
            let call = match (&conn, &r) {
                (Some(_), Some(r)) if !r.buffer().is_empty() => true,
                (Some(c), Some(_)) => {
                    let fds = [(c.fd, libc::POLLIN), event];
                    spin_ready(&fds, far()) || ready(&fds, -1)[0]
                }
                // No connection yet: `adopt` signals the event.
                _ => {
                    ready(&[event], -1);
                    false
                }
            };
            self.polling.store(false, Ordering::SeqCst);
            self.event.drain();
            if let (true, Some(c), Some(r)) = (call, &conn, r.as_mut())
                && !c.take_one(r, &mut body)
            {
                self.release(c);
            }
        }
    }
}

/// Which of `fds` (each with the `poll` events it waits for) are ready, or broke, waiting
/// at most `ms` (-1: until one is).
fn ready(fds: &[(std::os::fd::RawFd, libc::c_short)], ms: libc::c_int) -> Vec<bool> {
    let mut polled: Vec<libc::pollfd> =
        fds.iter().map(|&(fd, events)| libc::pollfd { fd, events, revents: 0 }).collect();
    loop {
        // SAFETY: a live array of `fds.len()` pollfds for the duration of the call.
        let n = unsafe { libc::poll(polled.as_mut_ptr(), polled.len() as libc::nfds_t, ms) };
        if n >= 0 || io::Error::last_os_error().kind() != io::ErrorKind::Interrupted {
            return polled.iter().map(|p| n > 0 && p.revents != 0).collect();
        }
    }
}

/// Whether `fds[0]` turns ready (or broke) while polling `fds` without sleeping for up to
/// [`spin_budget`], yielding the CPU between polls; false as soon as another of `fds` is
/// ready. An executor does this after each call before it sleeps, so that a caller's next
/// call, often on its way, wakes nobody (see [`spin_budget`]).
fn spin_ready(fds: &[(std::os::fd::RawFd, libc::c_short)], deadline: Instant) -> bool {
    let until = deadline.min(Instant::now() + spin_budget());
    loop {
        let ready = ready(fds, 0);
        if ready[0] {
            return true;
        }
        if ready.iter().any(|r| *r) || Instant::now() >= until {
            return false;
        }
        std::thread::yield_now();
    }
}

/// An eventfd: one thread waits for it in `poll`, others signal it.
struct Event(std::os::fd::OwnedFd);

impl Event {
    fn new() -> io::Result<Self> {
        use std::os::fd::FromRawFd;
        // SAFETY: eventfd returns a new descriptor or -1.
        let fd = unsafe { libc::eventfd(0, libc::EFD_NONBLOCK | libc::EFD_CLOEXEC) };
        if fd < 0 {
            return Err(io::Error::last_os_error());
        }
        // SAFETY: a descriptor just opened and owned by nothing else.
        Ok(Self(unsafe { std::os::fd::OwnedFd::from_raw_fd(fd) }))
    }

    fn fd(&self) -> std::os::fd::RawFd {
        use std::os::fd::AsRawFd;
        self.0.as_raw_fd()
    }

    fn signal(&self) {
        let one = 1u64.to_ne_bytes();
        // SAFETY: writes 8 bytes from a live buffer to the eventfd.
        let _ = unsafe { libc::write(self.fd(), one.as_ptr().cast(), 8) };
    }

    fn drain(&self) {
        let mut count = [0u8; 8];
        // SAFETY: reads at most 8 bytes into a live buffer (nonblocking).
        let _ = unsafe { libc::read(self.fd(), count.as_mut_ptr().cast(), 8) };
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
///
/// Its replies are read by one thread at a time, the connection's reader: a caller waiting
/// in a sync `get` for the reply to a call it sent from its own thread reads it itself
/// ([`read_own_replies`]), saving the hand-off from a reader thread (issue 35: a thread
/// wake, about 50 µs on a 2-vCPU VM whose idle vCPUs halt). Otherwise the connection's
/// own thread reads: at once for a call sent from the runtime (the actor's sender task, a
/// lease's push) or when anything else waits for an owned object ([`kick`]), and for a
/// call sent from a caller's thread that no one waits for, after [`LAZY`].
pub(crate) struct DirectConn {
    pub(crate) address: String,
    writer: Mutex<TcpStream>,
    read: Mutex<ReadSide>,
    /// What the connection's thread waits for besides its socket.
    event: Event,
    next_id: AtomicU64,
    alive: AtomicBool,
    /// Why it was closed from this side (a dead node): what its calls fail with.
    closed_with: Mutex<Option<Status>>,
    rt: tokio::runtime::Handle,
}

/// A connection's calls in flight and who reads their replies.
struct ReadSide {
    calls: HashMap<u64, Done>,
    /// The read half while no thread reads (a reader takes it); `None` while one does, and
    /// for good once the connection broke.
    reader: Option<BufReader<TcpStream>>,
    /// Since when calls wait with no thread reading.
    unread_since: Option<Instant>,
    /// The connection's thread is to read now.
    kicked: bool,
    /// The connection's thread waits without a timeout (no call for [`IDLE`]).
    parked: bool,
    last_call: Instant,
    /// The connection broke: its thread ends.
    broken: bool,
}

/// A reply nobody waits for is read this long after its call at the latest (while its
/// thread ticks, every [`LAZY`], which it does while calls went out in the last [`IDLE`]).
const LAZY: Duration = Duration::from_millis(10);
/// How long a connection's thread keeps ticking after a call.
const IDLE: Duration = Duration::from_secs(1);
/// The longest a waiting caller reads in one go before it looks at its objects again.
const READ_SLICE: Duration = Duration::from_millis(100);

thread_local! {
    /// The connection of the last call this thread sent itself, and that call's returns:
    /// what a sync `get` on this thread may read itself.
    static SENT_HERE: std::cell::RefCell<Option<(std::sync::Weak<DirectConn>, Vec<String>)>> =
        const { std::cell::RefCell::new(None) };
}

/// Connections with calls sent from a caller's thread and not read yet, for [`kick`].
static UNREAD: Mutex<Vec<std::sync::Weak<DirectConn>>> = Mutex::new(Vec::new());
/// Whether [`UNREAD`] may hold any (read without its lock).
static ANY_UNREAD: AtomicBool = AtomicBool::new(false);

/// Something other than a caller reading its own replies waits for an owned object: every
/// connection with unread calls sent from a caller's thread starts reading them now.
pub(crate) fn kick() {
    if !ANY_UNREAD.load(Ordering::Acquire) {
        return;
    }
    let conns: Vec<_> = {
        let mut unread = UNREAD.lock().unwrap();
        ANY_UNREAD.store(false, Ordering::Release);
        unread.drain(..).collect()
    };
    for c in conns.iter().filter_map(std::sync::Weak::upgrade) {
        let mut st = c.read.lock().unwrap();
        if st.unread_since.is_some() {
            st.kicked = true;
            c.event.signal();
        }
    }
}

/// Reads replies on this thread, as its connection's reader, for a caller waiting for
/// owned objects `waiting` (ids) until `deadline`: when the last call this thread sent
/// itself went on a direct connection, returns one of `waiting`, and no other thread
/// reads that connection. Reads until `settled` answers true (asked after each reply),
/// the connection has no call in flight, or `deadline` (or [`READ_SLICE`]) passes
/// between replies. False when it read nothing: wait for the objects another way.
///
/// Every reply read runs its call's `Done` on this thread, also other calls' on the same
/// connection: a `Done` must not block waiting for an object (they record results and
/// start runtime tasks), or it would wait for the reads of the thread it runs on.
pub(crate) fn read_own_replies(
    waiting: &[&str],
    settled: &dyn Fn() -> bool,
    deadline: Instant,
) -> bool {
    let conn = SENT_HERE.with(|s| {
        let s = s.borrow();
        let (conn, returns) = s.as_ref()?;
        if !returns.iter().any(|r| waiting.contains(&r.as_str())) {
            return None;
        }
        conn.upgrade()
    });
    let Some(conn) = conn else { return false };
    let reader = {
        let mut st = conn.read.lock().unwrap();
        if st.calls.is_empty() {
            return false;
        }
        let Some(r) = st.reader.take() else { return false };
        st.unread_since = None;
        r
    };
    let until = deadline.min(Instant::now() + READ_SLICE);
    conn.read_replies(reader, Some(settled), Some(until));
    true
}

impl DirectConn {
    /// Connects to the worker at `address` and opens a direct connection (blocking, up to
    /// 5 s for each step); replies are read with `rt` entered, so what the calls'
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
        let reader = BufReader::with_capacity(64 * 1024, s.try_clone()?);
        let conn = Arc::new(Self {
            address: address.to_string(),
            writer: Mutex::new(s),
            read: Mutex::new(ReadSide {
                calls: HashMap::new(),
                reader: Some(reader),
                unread_since: None,
                kicked: false,
                parked: true,
                last_call: Instant::now(),
                broken: false,
            }),
            event: Event::new()?,
            next_id: AtomicU64::new(1),
            alive: AtomicBool::new(true),
            closed_with: Mutex::new(None),
            rt,
        });
        let me = Arc::clone(&conn);
        std::thread::Builder::new()
            .name("tpuray-direct-out".into())
            .stack_size(READER_STACK)
            .spawn(move || {
                me.reader_thread();
                OPEN.fetch_sub(1, Ordering::SeqCst);
            })?;
        Ok(conn)
    }

    /// Whether calls may still go out on it.
    pub(crate) fn alive(&self) -> bool {
        self.alive.load(Ordering::SeqCst)
    }

    /// Sends a call [`encode_call`] made, on the calling thread; `done` gets its reply or
    /// failure from the thread that reads it, unless this says otherwise. `mine`: the
    /// caller's own thread sends it (not the runtime), and a sync `get` on this thread
    /// may read the reply itself ([`read_own_replies`]); its return ids are `returns`.
    pub(crate) fn call(
        self: &Arc<Self>,
        mut frame: Vec<u8>,
        done: Done,
        mine: Option<Vec<String>>,
    ) -> Sent {
        if !self.alive() {
            return Sent::Not(done, frame);
        }
        let id = self.next_id.fetch_add(1, Ordering::Relaxed);
        frame[4..12].copy_from_slice(&id.to_le_bytes());
        {
            let mut st = self.read.lock().unwrap();
            st.calls.insert(id, done);
            st.last_call = Instant::now();
            if st.reader.is_some() && st.unread_since.is_none() {
                st.unread_since = Some(st.last_call);
            }
            if mine.is_none() {
                st.kicked = true;
                self.event.signal();
            } else if st.parked {
                // It starts ticking, to read the reply after `LAZY` if no one waits for it.
                self.event.signal();
            }
        }
        if let Some(returns) = mine {
            SENT_HERE.with(|s| *s.borrow_mut() = Some((Arc::downgrade(self), returns)));
            let mut unread = UNREAD.lock().unwrap();
            if !unread.iter().any(|w| std::ptr::eq(w.as_ptr(), Arc::as_ptr(self))) {
                unread.push(Arc::downgrade(self));
            }
            ANY_UNREAD.store(true, Ordering::Release);
        }
        let written = self.writer.lock().unwrap().write_all(&frame);
        match written {
            Ok(()) => Sent::Yes,
            Err(e) => {
                self.close(None);
                // The reader fails it, unless it finished failing the others first.
                let done = self.read.lock().unwrap().calls.remove(&id);
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
        // A connection no thread reads fails its calls on its own thread.
        let mut st = self.read.lock().unwrap();
        st.kicked = true;
        self.event.signal();
    }

    /// The connection's own thread: reads replies when kicked, when calls went unread
    /// for [`LAZY`], or when the worker closed the connection while no one reads it (its
    /// socket is watched for that, not for replies, which the thread waiting for them
    /// reads); ends once the connection broke.
    fn reader_thread(&self) {
        let mut st = self.read.lock().unwrap();
        loop {
            if st.broken {
                return;
            }
            let due = st.kicked || st.unread_since.is_some_and(|t| t.elapsed() >= LAZY);
            if (due && !st.calls.is_empty() || !self.alive())
                && let Some(r) = st.reader.take()
            {
                st.kicked = false;
                st.unread_since = None;
                drop(st);
                self.read_replies(r, None, None);
                st = self.read.lock().unwrap();
                continue;
            }
            st.kicked = false;
            st.parked = st.last_call.elapsed() >= IDLE;
            let ms = if st.parked { -1 } else { LAZY.as_millis() as libc::c_int };
            let watched = st.reader.as_ref().map(|r| {
                use std::os::fd::AsRawFd;
                r.get_ref().as_raw_fd()
            });
            drop(st);
            let event = (self.event.fd(), libc::POLLIN);
            let closed = match watched {
                Some(fd) => ready(&[(fd, libc::POLLRDHUP), event], ms)[0],
                None => {
                    ready(&[event], ms);
                    false
                }
            };
            self.event.drain();
            if closed {
                // What it sent before closing is still read, then its calls fail.
                self.alive.store(false, Ordering::SeqCst);
            }
            st = self.read.lock().unwrap();
            st.parked = false;
        }
    }

    /// Reads replies as the connection's one reader, handing each to its call's `Done`,
    /// until no call is in flight, or (a caller reading its own) `settled` answers true or
    /// `until` passes between replies; then gives the read half back (and kicks the
    /// connection's thread when calls are left). A broken connection fails every call.
    fn read_replies(
        &self,
        mut r: BufReader<TcpStream>,
        settled: Option<&dyn Fn() -> bool>,
        until: Option<Instant>,
    ) {
        let _rt = self.rt.enter();
        let mut body = Vec::new();
        let error = loop {
            if settled.is_some_and(|f| f()) {
                break None;
            }
            {
                let mut st = self.read.lock().unwrap();
                if st.calls.is_empty() && self.alive() {
                    st.reader = Some(r);
                    return;
                }
            }
            if let Some(until) = until
                && r.buffer().is_empty()
                && !readable(r.get_ref(), until)
            {
                break None;
            }
            if until.is_none() && r.buffer().is_empty() {
                use std::os::fd::AsRawFd;
                // The connection's thread, reading because calls are due: see spin_budget.
                spin_ready(&[(r.get_ref().as_raw_fd(), libc::POLLIN)], far());
            }
            let (id, kind) = match read_frame(&mut r, &mut body) {
                Ok(f) => f,
                Err(e) => break Some(e),
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
                    break Some(io::Error::new(
                        io::ErrorKind::InvalidData,
                        format!("frame kind {kind}"),
                    ));
                }
            };
            let done = self.read.lock().unwrap().calls.remove(&id);
            if let Some(done) = done {
                done(result);
            }
        };
        let Some(error) = error else {
            // A caller done reading its own: the rest goes to the connection's thread.
            let mut st = self.read.lock().unwrap();
            st.reader = Some(r);
            if !st.calls.is_empty() {
                st.kicked = true;
                self.event.signal();
            }
            return;
        };
        self.alive.store(false, Ordering::SeqCst);
        let _ = r.get_ref().shutdown(Shutdown::Both);
        let status = self.closed_with.lock().unwrap().clone();
        let failed: Vec<Done> = {
            let mut st = self.read.lock().unwrap();
            st.broken = true;
            self.event.signal();
            st.calls.drain().map(|(_, d)| d).collect()
        };
        for done in failed {
            done(Err(status.clone().unwrap_or_else(|| lost(&self.address, &error))));
        }
    }
}

/// How long a thread waiting for a direct frame that is due polls its socket before it
/// sleeps in `poll` (`TPURAY_DIRECT_SPIN_US`, microseconds, default [`DEFAULT_SPIN`]; 0:
/// never; read once per process; CORE-16).
///
/// Why: a thread asleep in `poll` is woken by the peer's `send`, and when its CPU is
/// idle that CPU halts. On a VM a halted vCPU is woken by an inter-processor interrupt
/// that exits to the hypervisor: measured on this project's 2-vCPU Firecracker VM, about
/// 28 µs in the sender's `send` (`sock_def_readable` -> `try_to_wake_up`) plus the
/// waiter's own exit from halt, per wake. A caller that keeps polling for a reply that is
/// on its way is not asleep, so the reply wakes nobody. It is the same trade as the
/// kernel's `haltpoll` cpuidle governor (`guest_halt_poll_ns`), made only where a frame
/// is due: a sync `get` of a direct call this thread just sent, a connection's thread
/// reading replies to calls in flight, and an idle executor's next call right after it
/// answered the last.
fn spin_budget() -> Duration {
    static SPIN: std::sync::OnceLock<Duration> = std::sync::OnceLock::new();
    *SPIN.get_or_init(|| {
        let given = std::env::var("TPURAY_DIRECT_SPIN_US").ok();
        match given.as_deref().map(|v| v.trim().parse::<u64>()) {
            Some(Ok(us)) => Duration::from_micros(us),
            Some(Err(_)) => {
                tracing::warn!(
                    "TPURAY_DIRECT_SPIN_US={:?} is not a whole number of microseconds; \
                     using the default {} µs",
                    given.unwrap_or_default(),
                    DEFAULT_SPIN.as_micros()
                );
                default_spin()
            }
            None => default_spin(),
        }
    })
}

/// A deadline that does not come (an hour away), for [`spin_ready`] without one.
fn far() -> Instant {
    Instant::now() + Duration::from_secs(3600)
}

/// The default of [`spin_budget`] on a machine with more than one CPU: a little more
/// than a small sync call's round trip.
const DEFAULT_SPIN: Duration = Duration::from_micros(200);

/// [`DEFAULT_SPIN`], or 0 where this process may use only one CPU: there a poller only
/// delays the peer it waits for.
fn default_spin() -> Duration {
    match std::thread::available_parallelism() {
        Ok(n) if n.get() > 1 => DEFAULT_SPIN,
        _ => Duration::ZERO,
    }
}

/// Whether `s` has bytes to read (or broke) before `until`: polls it without sleeping
/// for up to [`spin_budget`] first (yielding the CPU between polls), then sleeps in `poll`.
fn readable(s: &TcpStream, until: Instant) -> bool {
    use std::os::fd::AsRawFd;
    if spin_ready(&[(s.as_raw_fd(), libc::POLLIN)], until) {
        return true;
    }
    loop {
        let left = until.saturating_duration_since(Instant::now());
        let mut fd = libc::pollfd { fd: s.as_raw_fd(), events: libc::POLLIN, revents: 0 };
        let ms = left.as_micros().div_ceil(1000).min(i32::MAX as u128) as libc::c_int;
        // SAFETY: one valid pollfd, for the duration of the call.
        let n = unsafe { libc::poll(&mut fd, 1, ms) };
        if n == 0 {
            return false;
        }
        // Readable, or an error the read reports.
        if n > 0 || io::Error::last_os_error().kind() != io::ErrorKind::Interrupted {
            return true;
        }
    }
}

/// A call lost with its connection, as the gRPC channel reports one.
fn lost(address: &str, e: &io::Error) -> Status {
    Status::unknown(format!("transport error: the direct connection to {address} broke: {e}"))
}

#[cfg(test)]
#[path = "direct_tests.rs"]
mod tests;
