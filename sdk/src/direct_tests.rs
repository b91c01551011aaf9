//! Tests of the caller's end of direct connections against a fake worker.
use super::*;
use std::net::TcpListener;
use std::sync::mpsc;
use std::thread::{self, ThreadId};

const FIVE_S: Duration = Duration::from_secs(5);

/// What the fake worker does with each call it reads.
enum Mode {
    /// Answers at once with a default reply.
    Reply,
    /// Answers once told to (through the channel); ends when the sender is dropped.
    Hold(mpsc::Receiver<()>),
    /// Closes the connection instead of answering.
    Close,
}

/// A fake worker on a port of its own that takes one direct connection; its address.
fn worker(mode: Mode) -> String {
    let listener = TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = listener.local_addr().unwrap().to_string();
    thread::spawn(move || {
        let (mut w, _) = listener.accept().unwrap();
        let mut r = BufReader::new(w.try_clone().unwrap());
        let mut opening = [0u8; 10];
        r.read_exact(&mut opening).unwrap();
        assert_eq!(&opening[..8], MAGIC);
        let mut token = vec![0; u16::from_le_bytes([opening[8], opening[9]]) as usize];
        r.read_exact(&mut token).unwrap();
        w.write_all(&[1]).unwrap();
        let mut body = Vec::new();
        while let Ok((id, kind)) = read_frame(&mut r, &mut body) {
            assert_eq!(kind, KIND_CALL);
            pb::TaskSpec::decode(body.as_slice()).expect("a call's body is a TaskSpec");
            match &mode {
                Mode::Close => return,
                Mode::Hold(release) if release.recv().is_err() => return,
                _ => {}
            }
            let reply = pb::PushTaskReply::default();
            let bytes = frame(id, KIND_REPLY, reply.encoded_len(), |b| reply.encode(b).unwrap());
            if w.write_all(&bytes).is_err() {
                return;
            }
        }
    });
    addr
}

/// A connection to a fresh fake worker, with its runtime; closed when dropped.
struct Fixture {
    conn: Arc<DirectConn>,
    _rt: tokio::runtime::Runtime,
}

impl Fixture {
    fn new(mode: Mode) -> Self {
        let rt = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(1)
            .enable_all()
            .build()
            .unwrap();
        let conn = DirectConn::connect(&worker(mode), None, rt.handle().clone()).unwrap();
        Self { conn, _rt: rt }
    }

    /// Sends a default call whose return is `r1`; `mine`: from this (a caller's) thread.
    fn call(&self, mine: bool) -> (mpsc::Receiver<Outcome>, Arc<AtomicBool>) {
        let (tx, rx) = mpsc::channel();
        let ran = Arc::new(AtomicBool::new(false));
        let flag = Arc::clone(&ran);
        let done: Done = Box::new(move |result| {
            let t = thread::current();
            let err = result.err();
            let _ = tx.send(Outcome {
                err: err.map(|s| (s.code(), s.message().to_string())),
                thread: t.name().unwrap_or_default().to_string(),
                id: t.id(),
            });
            flag.store(true, Ordering::SeqCst);
        });
        let frame = encode_call(&pb::TaskSpec::default());
        let sent = self.conn.call(frame, done, mine.then(|| vec!["r1".to_string()]));
        assert!(matches!(sent, Sent::Yes));
        (rx, ran)
    }

    /// Waits (up to 5 s) until the connection's thread parks, idle for `IDLE`.
    fn wait_parked(&self) {
        let since = Instant::now();
        loop {
            let st = self.conn.read.lock().unwrap();
            if st.parked && st.last_call.elapsed() >= IDLE {
                return;
            }
            drop(st);
            assert!(since.elapsed() < FIVE_S, "the connection's thread never parked");
            thread::sleep(Duration::from_millis(20));
        }
    }
}

impl Drop for Fixture {
    fn drop(&mut self) {
        self.conn.close(None);
    }
}

/// What a call's `Done` got, and on which thread.
struct Outcome {
    err: Option<(tonic::Code, String)>,
    thread: String,
    id: ThreadId,
}

fn outcome(rx: &mpsc::Receiver<Outcome>) -> Outcome {
    rx.recv_timeout(FIVE_S).expect("the call's Done ran within 5 s")
}

/// Calls for `r1` from this thread and waits for it with `read_own_replies`, as a sync
/// `get` does, until this thread read the outcome itself: the connection's thread takes
/// the read half first when this one stalls for `LAZY` between the two (rare; retried).
fn call_and_read_own(mode: fn() -> Mode) -> (Fixture, Outcome) {
    for _ in 0..5 {
        let f = Fixture::new(mode());
        let (rx, ran) = f.call(true);
        let read =
            read_own_replies(&["r1"], &|| ran.load(Ordering::SeqCst), Instant::now() + FIVE_S);
        let o = outcome(&rx);
        if read && o.id == thread::current().id() {
            return (f, o);
        }
    }
    panic!("in 5 tries, this thread never read its own call's outcome");
}

/// A caller's call nobody waits for is read by the connection's thread, parked or not.
#[test]
fn a_reply_no_one_waits_for_is_read_by_the_connections_thread() {
    let f = Fixture::new(Mode::Reply);
    f.wait_parked();
    for _ in 0..2 {
        let o = outcome(&f.call(true).0);
        assert!(o.err.is_none(), "{:?}", o.err);
        assert_eq!(o.thread, "tpuray-direct-out");
    }
}

/// A caller waiting for its own call's return reads the reply on its own thread.
#[test]
fn a_caller_waiting_for_its_own_call_reads_the_reply_on_its_own_thread() {
    let (f, o) = call_and_read_own(|| Mode::Reply);
    assert!(o.err.is_none(), "{:?}", o.err);
    assert!(f.conn.alive());
}

/// A wait for objects the last call from this thread does not return reads nothing, and
/// the reply still arrives, through the connection's thread.
#[test]
fn read_own_replies_declines_a_wait_for_objects_this_thread_did_not_call_for() {
    let f = Fixture::new(Mode::Reply);
    let (rx, _) = f.call(true);
    assert!(!read_own_replies(&["other"], &|| false, Instant::now() + FIVE_S));
    let o = outcome(&rx);
    assert!(o.err.is_none(), "{:?}", o.err);
    assert_eq!(o.thread, "tpuray-direct-out");
}

/// A call sent from the runtime wakes the connection's thread to read it, even when idle.
#[test]
fn a_call_sent_from_the_runtime_is_read_at_once() {
    let f = Fixture::new(Mode::Reply);
    f.wait_parked();
    let o = outcome(&f.call(false).0);
    assert!(o.err.is_none(), "{:?}", o.err);
    assert_eq!(o.thread, "tpuray-direct-out");
}

/// A connection that breaks under a caller reading its own replies fails the call as
/// lost, and takes no further calls.
#[test]
fn a_connection_that_breaks_while_its_caller_reads_fails_the_call() {
    let (f, o) = call_and_read_own(|| Mode::Close);
    let (code, msg) = o.err.expect("the call failed");
    assert_eq!(code, tonic::Code::Unknown);
    assert!(msg.contains("transport error"), "{msg}");
    assert!(!f.conn.alive());
    let done: Done = Box::new(|_| panic!("a call on a broken connection ran"));
    let sent = f.conn.call(encode_call(&pb::TaskSpec::default()), done, None);
    assert!(matches!(sent, Sent::Not(..)));
}

/// Closing a connection with a status (a dead node) fails its calls in flight with it.
#[test]
fn close_fails_the_calls_in_flight_with_its_status() {
    let (_release, held) = mpsc::channel();
    let f = Fixture::new(Mode::Hold(held));
    let (rx, _) = f.call(true);
    f.conn.close(Some(Status::unavailable("node died: x")));
    let (code, msg) = outcome(&rx).err.expect("the call failed");
    assert_eq!((code, msg.as_str()), (tonic::Code::Unavailable, "node died: x"));
}

/// A connected pair of loopback sockets.
fn socket_pair() -> (TcpStream, TcpStream) {
    let l = TcpListener::bind("127.0.0.1:0").unwrap();
    let a = TcpStream::connect(l.local_addr().unwrap()).unwrap();
    let (b, _) = l.accept().unwrap();
    (a, b)
}

#[test]
fn core_16_a_poller_sees_a_frame_that_arrives_while_it_spins() {
    use std::os::fd::AsRawFd;
    let (a, b) = socket_pair();
    let writer = thread::spawn(move || {
        thread::sleep(Duration::from_micros(50));
        (&b).write_all(b"x").unwrap();
        b
    });
    // A deadline of 5 s: with the spin (or without it, TPURAY_DIRECT_SPIN_US=0) the byte
    // is seen by `readable`, and `spin_ready` reports what it saw within its own budget.
    assert!(readable(&a, Instant::now() + Duration::from_secs(5)));
    assert!(spin_ready(&[(a.as_raw_fd(), libc::POLLIN)], far()));
    drop(writer.join().unwrap());
}

#[test]
fn core_16_a_poller_stops_at_its_budget_or_deadline_and_for_another_ready_fd() {
    use std::os::fd::AsRawFd;
    let (a, _b) = socket_pair();
    let (c, d) = socket_pair();
    // Nothing arrives: false, after at most the budget (or the deadline, here now).
    assert!(!spin_ready(&[(a.as_raw_fd(), libc::POLLIN)], Instant::now()));
    assert!(!spin_ready(&[(a.as_raw_fd(), libc::POLLIN)], far()));
    // Another of the fds (an executor's queued-job event) is ready: false at once.
    (&d).write_all(b"x").unwrap();
    while !ready(&[(c.as_raw_fd(), libc::POLLIN)], 1000)[0] {}
    assert!(!spin_ready(&[(a.as_raw_fd(), libc::POLLIN), (c.as_raw_fd(), libc::POLLIN)], far()));
    assert!(!readable(&a, Instant::now() + Duration::from_millis(20)));
}
