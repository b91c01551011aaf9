//! The core worker: one per process (driver or worker). It owns the objects
//! this process creates, submits tasks through worker leases, calls actors
//! directly, and fetches objects from the node's store or other nodes.
//!
//! Invariants:
//! - CORE-2: an owned object lives while a reference to it exists in this
//!   process or an in-flight task uses it as an argument; then it is freed,
//!   including the copies in node stores.
//! - CORE-3: the head is never asked per task: a task goes to a worker leased
//!   from the local node agent (or the node it spills to); leases are reused
//!   for every queued task of the same scheduling class and returned when the
//!   queue drains.
//! - CORE-4: calls from one caller to one actor execute in submission order
//!   (sent by one ordered sender; the actor releases them by sequence number).
//! - CORE-5: a task whose worker dies is retried up to `max_retries`;
//!   application errors only with `retry_exceptions`.
//! - CORE-6: the owner keeps the spec (and pinned arguments) of the task that
//!   made each stored object it owns while the object lives; when every copy
//!   is lost with its node, the task runs again (same return ids) if retries
//!   remain, and readers wait for the new copy. Arguments lost too are made
//!   again the same way when the new run reads them. A lost `put` object fails
//!   with `ObjectLost`; a borrower whose owner is gone gets an `ObjectLost`
//!   saying the owner died ([`OWNER_DIED`]).
//! - CORE-12: a cancelled task (`cancel`) is never retried and its `get` fails
//!   with `Cancelled`, whether it was queued here, queued on its worker, or
//!   running (then told to stop, or its worker killed with `force`); a finished
//!   one is left alone. `recursive` reaches what it submitted.
//! - CORE-13: calls to one actor from this process that are unfinished number
//!   at most the handle's `max_pending_calls`; one more is refused at
//!   submission, before anything is registered or sent.
//!
//! In full (moved here from ARCHITECTURE.md):
//! - CORE-14 (`core::install`/`uninstall`, `Core::release`): a driver may `init`
//!   again after `shutdown` in the same process (Ray's `ray.init()` after
//!   `ray.shutdown()`; the Python SDK and the Rust SDK alike). The process's core is an
//!   atomic pointer to a core that is leaked on install and never freed, so every
//!   `&'static Arc<Core>` handed out stays valid: `shutdown` uninstalls it (later calls
//!   find none, a later `init` installs a new one with a new job) and releases it: its
//!   runtime stops (servers, node watch, flushers, calls in flight end), its
//!   connections close and its tables empty, so what one stopped core keeps is a few
//!   hundred bytes. A second `init` while one is installed is refused before any job is
//!   registered. A ref from the old job dropped later is a no-op or a borrower release
//!   that nobody answers.
//! - Results up to 100 KiB travel inline; larger ones sit in the executing node's
//!   store and are pulled in chunks by other nodes. Channels are cached per address.
//!
//! Threads: all networking runs on this module's tokio runtime; user code
//! calls the blocking API (`get`, `wait`, submission) from its own threads.
//!
//! Modules: `ownership` (the owner's table and freeing), `borrowing` (the borrower
//! protocol, both sides), `objects` (put, get, pulls between nodes), `lineage` (lost
//! copies made again), `submit` (task specs and arguments), `leasing` (leases and
//! pipelined pushes), `completion` (how a pushed task ends: retry, hand-back, failure),
//! `generators`, `cancel`, `actors` (creation and each actor's ordered sender) and
//! `events` (task events to the head). This file keeps the `Core` itself, its runtime,
//! the node-death watch and the connections it reuses.

use std::collections::{HashMap, VecDeque};
use std::sync::atomic::{AtomicBool, AtomicPtr, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, OnceLock};
use std::time::{Duration, Instant};

use tokio::sync::Notify;
use tonic::Request;
use tpuray_objectstore::{CopyKind, CreateOptions, LocalStore, ObjectView, Writer};
use tpuray_proto::pb;
use tpuray_proto::pb::task_error::Kind;

use crate::codec::Arg;
use crate::error::Error;
use crate::object_ref::RawRef;
use crate::options::{Scheduling, TaskOptions};

pub mod actor_order;
mod actors;
mod borrowing;
mod cancel;
mod completion;
mod events;
mod generators;
mod leasing;
mod lineage;
mod objects;
pub mod outbox;
mod ownership;
pub mod pipeline;
pub mod refs;
pub mod retry;
mod submit;
pub mod transfer;

use actors::*;
use borrowing::*;
pub(crate) use borrowing::{all_confirmed, begin_borrow_batch, confirm_borrows, end_borrow_batch};
use cancel::*;
use completion::Ended;
use generators::*;
pub(crate) use generators::{drop_generator, next_generator_item, next_generator_item_ref};
use leasing::*;
use objects::*;
use ownership::*;
pub use ownership::{Data, OBJECT_FREED, OWNER_DIED};
pub(crate) use ownership::{add_ref, release_ref};
use pipeline::DEEP_PIPELINE;
use submit::*;

/// Results up to this size travel inline in replies; larger ones go to the
/// executing node's object store (DESIGN.md §2).
pub const INLINE_MAX_BYTES: usize = 100 * 1024;
/// The environment variable that sets how many threads run the SDK's runtime in a
/// driver or worker process (see [`build_runtime`]).
pub const RUNTIME_THREADS_ENV: &str = "TPURAY_RUNTIME_THREADS";

/// The tokio runtime of a driver or worker process: its RPCs, owner bookkeeping and
/// actor senders. Tasks and actor calls never run on it (executor threads do).
///
/// Two threads unless [`RUNTIME_THREADS_ENV`] says otherwise. With two, tokio wakes the
/// idle thread whenever new work is queued, so a sync call's wake-ups bounce between
/// them: 3.5 context switches per actor call in a driver's runtime, against 2 with one
/// thread (over `tpuray_proto::h2grpc`; 5.4 before it). On the 2-core machine of issue
/// 10, one thread was within run-to-run noise (about 6%) of two for Python sync actor
/// calls, and slower for throughput (Python 1:1 actor calls async 13.2k against 11.1k
/// per second; before h2grpc, Rust tasks async 17.6k against ~23k). Hence two by
/// default.
///
/// # Errors
/// The variable is not a whole number from 1 to 256, or the runtime cannot start.
pub(crate) fn build_runtime() -> Result<tokio::runtime::Runtime, String> {
    let threads = runtime_threads(std::env::var(RUNTIME_THREADS_ENV).ok().as_deref())?;
    tokio::runtime::Builder::new_multi_thread()
        .worker_threads(threads)
        .enable_all()
        .build()
        .map_err(|e| format!("cannot start the SDK's runtime: {e}"))
}

/// The runtime's thread count for [`RUNTIME_THREADS_ENV`]'s value (`None`: unset).
fn runtime_threads(value: Option<&str>) -> Result<usize, String> {
    match value.map(|v| (v, v.trim().parse::<usize>())) {
        None => Ok(2),
        Some((_, Ok(n @ 1..=256))) => Ok(n),
        Some((v, _)) => Err(format!(
            "{RUNTIME_THREADS_ENV}={v:?}: expected a whole number of threads from 1 to 256"
        )),
    }
}

/// CORE-14: the process's core worker, null before `init` and after `shutdown`. Each
/// installed core is leaked (`Box::leak`), so a `&'static Arc<Core>` handed out stays
/// valid for ever: a thread still inside a call when the driver shuts down, or a ref
/// dropped afterwards, reads a core whose runtime is stopped and whose tables are empty
/// ([`Core::release`]), never freed memory. A driver may `init` again after
/// `shutdown` (Ray's `ray.init()` after `ray.shutdown()` in one process); what one
/// stopped core keeps is a few hundred bytes of empty tables.
static CORE: AtomicPtr<Arc<Core>> = AtomicPtr::new(std::ptr::null_mut());

/// The process's core worker; `None` before `init` and after `shutdown`.
pub(crate) fn try_core() -> Option<&'static Arc<Core>> {
    let p = CORE.load(Ordering::Acquire);
    // SAFETY: a non-null pointer came from `Box::leak` in `install` and is never freed
    // (CORE-14).
    (!p.is_null()).then(|| unsafe { &*p })
}

pub(crate) fn core() -> Result<&'static Arc<Core>, Error> {
    try_core()
        .ok_or_else(|| Error::Cluster("tpuray is not initialised: call tpuray::init first".into()))
}

/// Makes `core` the process's core worker.
///
/// # Errors
/// [`Error::Cluster`] when one is installed already (`init` twice without `shutdown`).
pub(crate) fn install(core: Arc<Core>) -> Result<&'static Arc<Core>, Error> {
    let leaked: &'static mut Arc<Core> = Box::leak(Box::new(core));
    let p: *mut Arc<Core> = leaked;
    if CORE.compare_exchange(std::ptr::null_mut(), p, Ordering::AcqRel, Ordering::Acquire).is_err()
    {
        // SAFETY: `p` was never published, so this is its only reference.
        let core = unsafe { Box::from_raw(p) };
        // Its runtime goes with it, off any runtime thread (a runtime cannot drop there).
        core.release();
        return Err(Error::Cluster("tpuray::init was already called in this process".into()));
    }
    Ok(leaked)
}

/// Takes the process's core worker out (a driver's `shutdown`): later calls find none
/// and a later `init` installs a new one (CORE-14). The caller then calls
/// [`Core::release`] on it.
pub(crate) fn uninstall() -> Option<&'static Arc<Core>> {
    let p = CORE.swap(std::ptr::null_mut(), Ordering::AcqRel);
    // SAFETY: as in `try_core`.
    (!p.is_null()).then(|| unsafe { &*p })
}

pub(crate) struct Core {
    /// The handle of this core's runtime (owned by `runtime` until [`Core::release`]).
    pub rt: tokio::runtime::Handle,
    runtime: Mutex<Option<tokio::runtime::Runtime>>,
    pub job_id: String,
    pub worker_id: String,
    pub node_id: String,
    /// This process's WorkerService address (the owner address of its objects).
    pub address: String,
    pub agent_address: String,
    /// Where other nodes pull this process's stored objects: its node agent's
    /// address, or for a driver on a host without a node the object server of its
    /// private store (NET-3).
    pub store_address: String,
    pub head_address: String,
    pub token: Option<String>,
    pub store: LocalStore,
    pub fail_on_infeasible: bool,
    /// The objects this process owns, with their reference counts (CORE-2).
    objects: Mutex<refs::OwnerTable<Owned>>,
    objects_changed: Notify,
    classes: Mutex<HashMap<String, Arc<Class>>>,
    /// The options of the last task submitted, and their class ([`Core::class_for`]).
    last_class: Mutex<Option<(TaskOptions, Arc<Class>)>>,
    generators: Mutex<HashMap<String, GenState>>,
    actors: Mutex<HashMap<String, Arc<ActorConn>>>,
    /// Direct connections (CORE-15) to workers, by address: open, or being opened (None).
    direct: Mutex<HashMap<String, Option<Arc<crate::direct::DirectConn>>>>,
    running: Mutex<HashMap<String, Running>>,
    /// The tasks and actor calls each task running here submitted (parent task id ->
    /// child task ids), for `cancel(recursive=True)`; forgotten when the parent ends.
    children: Mutex<HashMap<String, Vec<String>>>,
    events: Mutex<Vec<pb::TaskEvent>>,
    /// Held while a batch of task events is on its way, so a flush (the last one, at
    /// shutdown) waits for the one in flight instead of finding the buffer empty and
    /// letting the process exit under it.
    events_sending: tokio::sync::Mutex<()>,
    clients: Mutex<Clients>,
    /// Objects this process borrows (owned elsewhere), by id. Lock order: `borrowed`,
    /// then `borrow_queues` and a queue's outbox.
    borrowed: Mutex<HashMap<String, Borrow>>,
    /// Threads of this worker blocked in get/wait (AGENT-11): the agent lends the lease's
    /// CPUs back while it is above zero. Changed only under `telling_agent`.
    blocked_threads: AtomicUsize,
    /// Held while `blocked_threads` changes and the agent is told, so the agent hears of
    /// blocks and unblocks in order. Runtime threads never take it (the telling needs
    /// them free): they read `blocked_threads`.
    telling_agent: Mutex<()>,
    /// Signalled when a thread of this worker starts waiting in get/wait: the
    /// executor hands back tasks queued behind the running one (CORE-9).
    pub(crate) blocked_now: Notify,
    /// Bounds the pulls this process runs at once.
    pull_permits: tokio::sync::Semaphore,
    /// Borrower changes on their way to each owner (by owner address).
    borrow_queues: Mutex<HashMap<String, Arc<BorrowQueue>>>,
    /// Nodes the head declared dead (CORE-10), fed by [`Core::watch_nodes`].
    pub(crate) deaths: crate::node_watch::NodeDeaths,
    /// Whether [`Core::watch_nodes`] runs.
    watching_nodes: AtomicBool,
    /// The check of borrowing processes runs (CORE-2, [`Core::watch_borrowers`]).
    watching_borrowers: AtomicBool,
    /// Ends [`Core::watch_nodes`] (a driver's `shutdown`): its stream would hold the
    /// head's graceful stop until `tpuray stop` gives up (10 s for a local cluster).
    stop_watching: Notify,
}

type AuthChannel = tpuray_proto::client::AuthChannel;

/// Connections reused across calls: one HTTP/2 channel per address.
#[derive(Default)]
struct Clients {
    workers: HashMap<String, pb::worker_service_client::WorkerServiceClient<AuthChannel>>,
    agents: HashMap<String, pb::node_agent_service_client::NodeAgentServiceClient<AuthChannel>>,
    objects: HashMap<
        String,
        pb::object_transfer_service_client::ObjectTransferServiceClient<AuthChannel>,
    >,
    head: Option<pb::head_service_client::HeadServiceClient<AuthChannel>>,
}

macro_rules! cached_client {
    ($name:ident, $field:ident, $make:path, $ty:ty) => {
        pub(crate) fn $name(&self, addr: &str) -> Result<$ty, Error> {
            let mut c = self.clients.lock().unwrap();
            if let Some(x) = c.$field.get(addr) {
                return Ok(x.clone());
            }
            // A channel spawns its connection task on the current runtime: a caller on a
            // thread of its own (a Python thread in a worker) has none, so enter ours.
            let _rt = self.rt.enter();
            let x =
                $make(addr, self.token.as_deref()).map_err(|e| Error::Cluster(e.to_string()))?;
            c.$field.insert(addr.to_string(), x.clone());
            Ok(x)
        }
    };
}

/// Sets `flag`; true only for the first caller. A plain load first, so the many later
/// calls (one per submission, say) never write the shared cache line.
pub(super) fn first_time(flag: &AtomicBool) -> bool {
    !(flag.load(Ordering::Relaxed) || flag.swap(true, Ordering::SeqCst))
}

/// The error of a call to a node the head declared dead (CORE-10).
fn node_died(node_id: &str) -> tonic::Status {
    tonic::Status::unavailable(format!("node {node_id} died (the head declared it dead)"))
}

fn now_ms() -> u64 {
    tpuray_proto::now_ms()
}

fn return_id(task_id: &str, index: u64) -> String {
    format!("{}{:08x}", &task_id[..24], index + 1)
}

fn err(kind: Kind, message: impl Into<String>, function: &str) -> pb::TaskError {
    pb::TaskError {
        kind: kind as i32,
        message: message.into(),
        function_name: function.to_string(),
        ..Default::default()
    }
}

thread_local! {
    /// Borrower registrations started on this thread and not yet confirmed;
    /// an executor waits for them before it replies (CORE-2).
    static PENDING_BORROWS: std::cell::RefCell<Vec<tokio::task::JoinHandle<()>>> = const { std::cell::RefCell::new(Vec::new()) };
    /// An open borrow batch on this thread ([`begin_borrow_batch`]): its depth, and per
    /// owner queue the last registration queued inside it.
    static BORROW_BATCH: std::cell::RefCell<BorrowBatch> = const { std::cell::RefCell::new((0, Vec::new())) };
}

impl Core {
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn new(
        rt: tokio::runtime::Runtime,
        job_id: String,
        worker_id: String,
        node_id: String,
        address: String,
        agent_address: String,
        head_address: String,
        token: Option<String>,
        store: LocalStore,
        fail_on_infeasible: bool,
    ) -> Self {
        Self {
            rt: rt.handle().clone(),
            runtime: Mutex::new(Some(rt)),
            job_id,
            worker_id,
            node_id,
            address,
            store_address: agent_address.clone(),
            agent_address,
            head_address,
            token,
            store,
            fail_on_infeasible,
            objects: Mutex::new(refs::OwnerTable::default()),
            objects_changed: Notify::new(),
            classes: Mutex::new(HashMap::new()),
            last_class: Mutex::new(None),
            generators: Mutex::new(HashMap::new()),
            actors: Mutex::new(HashMap::new()),
            direct: Mutex::new(HashMap::new()),
            running: Mutex::new(HashMap::new()),
            children: Mutex::new(HashMap::new()),
            events: Mutex::new(Vec::new()),
            events_sending: tokio::sync::Mutex::new(()),
            clients: Mutex::new(Clients::default()),
            borrowed: Mutex::new(HashMap::new()),
            blocked_threads: AtomicUsize::new(0),
            telling_agent: Mutex::new(()),
            blocked_now: Notify::new(),
            pull_permits: tokio::sync::Semaphore::new(MAX_PULLS_PER_PROCESS),
            borrow_queues: Mutex::new(HashMap::new()),
            deaths: crate::node_watch::NodeDeaths::default(),
            watching_nodes: AtomicBool::new(false),
            watching_borrowers: AtomicBool::new(false),
            stop_watching: Notify::new(),
        }
    }

    /// CORE-10: follows the head's state changes (once per process, from the first
    /// call on) and acts on every node death at once: pushes to the node's workers and
    /// pulls from its store end with an error (a running task is retried, an actor
    /// call resent or failed as on a lost connection), and owned objects whose only
    /// copies were there are made again from lineage. Resumes after the last change
    /// seen when the stream breaks (a head failover).
    pub(crate) fn watch_nodes(self: &Arc<Self>) {
        // Called on every submission.
        if !first_time(&self.watching_nodes) {
            return;
        }
        let core = Arc::clone(self);
        self.rt.spawn(async move {
            let stop = Arc::clone(&core);
            tokio::select! {
                () = Self::follow_node_changes(core) => {}
                () = stop.stop_watching.notified() => {}
            }
        });
    }

    /// Stops this core for good (CORE-14, after [`uninstall`]): every task on its runtime
    /// (RPC servers, the node watch, flushers, calls in flight) ends, its connections
    /// close, and its tables of objects, actors and borrows are emptied. A thread still
    /// blocked in a call on it gets an error or a value it already had; nothing it asks
    /// afterwards reaches the cluster.
    pub(crate) fn release(&self) {
        self.stop_watching_nodes();
        let rt = self.runtime.lock().unwrap().take();
        if let Some(rt) = rt {
            if tokio::runtime::Handle::try_current().is_ok() {
                // On a runtime thread a runtime cannot wait for another to stop.
                rt.shutdown_background();
            } else {
                rt.shutdown_timeout(Duration::from_secs(2));
            }
        }
        std::mem::take(&mut *self.objects.lock().unwrap());
        std::mem::take(&mut *self.classes.lock().unwrap());
        self.last_class.lock().unwrap().take();
        std::mem::take(&mut *self.generators.lock().unwrap());
        std::mem::take(&mut *self.actors.lock().unwrap());
        for d in std::mem::take(&mut *self.direct.lock().unwrap()).into_values().flatten() {
            d.close(None);
        }
        std::mem::take(&mut *self.running.lock().unwrap());
        std::mem::take(&mut *self.events.lock().unwrap());
        *self.clients.lock().unwrap() = Clients::default();
        std::mem::take(&mut *self.borrowed.lock().unwrap());
        std::mem::take(&mut *self.borrow_queues.lock().unwrap());
        self.objects_changed.notify_waiters();
    }

    /// Ends [`Core::watch_nodes`] (now, or at once when it starts later).
    pub(crate) fn stop_watching_nodes(&self) {
        self.stop_watching.notify_one();
    }

    async fn follow_node_changes(core: Arc<Self>) {
        let mut after_seq = 0u64;
        loop {
            if let Ok(mut head) = core.head_client()
                && let Ok(r) = head.subscribe(pb::SubscribeRequest { after_seq }).await
            {
                let mut changes = r.into_inner();
                while let Ok(Some(c)) = changes.message().await {
                    after_seq = after_seq.max(c.seq);
                    if let Some(pb::state_change::Change::Node(n)) = c.change
                        && n.state == pb::NodeState::Dead as i32
                        && core.deaths.mark_dead(&n.node_id)
                    {
                        core.on_node_death(&n.node_id);
                    }
                }
            }
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
    }

    /// `fut`, or an `UNAVAILABLE` error naming the node once the head declares
    /// `node_id` dead (CORE-10).
    async fn unless_node_dies<T>(
        &self,
        node_id: &str,
        fut: impl std::future::Future<Output = Result<T, tonic::Status>>,
    ) -> Result<T, tonic::Status> {
        tokio::select! {
            r = fut => r,
            _ = self.deaths.died(node_id) => Err(node_died(node_id)),
        }
    }

    cached_client!(
        worker_client,
        workers,
        tpuray_proto::client::worker,
        pb::worker_service_client::WorkerServiceClient<AuthChannel>
    );

    cached_client!(
        agent_client,
        agents,
        tpuray_proto::client::agent,
        pb::node_agent_service_client::NodeAgentServiceClient<AuthChannel>
    );

    cached_client!(
        objects_client,
        objects,
        tpuray_proto::client::objects,
        pb::object_transfer_service_client::ObjectTransferServiceClient<AuthChannel>
    );

    /// The head's client (the first address of a replicated head).
    pub(crate) fn head_client(
        &self,
    ) -> Result<pb::head_service_client::HeadServiceClient<AuthChannel>, Error> {
        let mut c = self.clients.lock().unwrap();
        if let Some(h) = &c.head {
            return Ok(h.clone());
        }
        let _rt = self.rt.enter();
        let h = tpuray_proto::client::head(&self.head_address, self.token.as_deref())
            .map_err(|e| Error::Cluster(e.to_string()))?;
        c.head = Some(h.clone());
        Ok(h)
    }

    fn location(&self) -> pb::ObjectLocation {
        pb::ObjectLocation {
            node_id: self.node_id.clone(),
            agent_address: self.store_address.clone(),
            store_dir: self.store.dir().display().to_string(),
        }
    }

    /// A thread of this process starts (`true`) or stops waiting for objects. In a worker
    /// process, the first waiter tells the node agent, which lends the task's CPUs back to
    /// the node until the last waiter stops (AGENT-11; Ray releases a blocked worker's
    /// CPUs the same way, so nested `get`s cannot deadlock a full node). Call from a
    /// thread outside the runtime.
    pub(crate) fn set_blocked(&self, blocked: bool) {
        if !crate::worker::is_worker_process() {
            return;
        }
        let _telling = self.telling_agent.lock().unwrap();
        let depth = self.blocked_threads.load(Ordering::SeqCst);
        let depth = if blocked { depth + 1 } else { depth.saturating_sub(1) };
        self.blocked_threads.store(depth, Ordering::SeqCst);
        if blocked {
            self.blocked_now.notify_waiters();
        }
        let notify = if blocked { depth == 1 } else { depth == 0 };
        if notify && let Ok(mut c) = self.agent_client(&self.agent_address) {
            let req = pb::NotifyWorkerBlockedRequest { worker_id: self.worker_id.clone(), blocked };
            // Under the lock, so the agent sees blocked/unblocked in order.
            let _ = self.rt.block_on(c.notify_worker_blocked(req));
        }
    }

    /// Whether a thread of this worker waits in get/wait now (AGENT-11). Never blocks:
    /// runtime threads call it while [`Core::set_blocked`] holds its lock and waits for
    /// the runtime to tell the agent (a deadlock, had it taken the lock).
    pub(crate) fn is_blocked(&self) -> bool {
        self.blocked_threads.load(Ordering::SeqCst) > 0
    }
}

/// Runs `fut` on this thread, parking it between polls, until `fut` is done (`Some`) or
/// `deadline` passes (`None`). For futures that need no runtime (waits on `Notify`).
fn block_on_until<F: std::future::Future>(fut: F, deadline: Instant) -> Option<F::Output> {
    struct Unpark(std::thread::Thread);
    impl std::task::Wake for Unpark {
        fn wake(self: Arc<Self>) {
            self.0.unpark();
        }
    }
    let waker = std::task::Waker::from(Arc::new(Unpark(std::thread::current())));
    let mut cx = std::task::Context::from_waker(&waker);
    let mut fut = std::pin::pin!(fut);
    loop {
        if let std::task::Poll::Ready(v) = fut.as_mut().poll(&mut cx) {
            return Some(v);
        }
        let left = deadline.saturating_duration_since(Instant::now());
        if left.is_zero() {
            return None;
        }
        std::thread::park_timeout(left);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Issue 34's goal is 1,000,000 queued tasks in 2 GiB of driver memory: each queued
    /// task's return is an `Owned` entry, so its size is a budget (a rare field belongs
    /// behind a `Box`, as `Failed` and `pulls` are).
    #[test]
    fn an_owned_entry_fits_its_budget() {
        let size = std::mem::size_of::<refs::Counted<Owned>>();
        assert!(size <= 192, "Owned is {size} bytes; its budget is 192 (see the doc above)");
    }

    #[test]
    fn runtime_threads_default_to_two_and_reject_what_is_not_a_count() {
        assert_eq!(runtime_threads(None), Ok(2));
        assert_eq!(runtime_threads(Some("1")), Ok(1));
        assert_eq!(runtime_threads(Some(" 4 ")), Ok(4));
        for bad in ["0", "-1", "two", "", "257"] {
            let e = runtime_threads(Some(bad)).unwrap_err();
            assert!(e.contains(RUNTIME_THREADS_ENV) && e.contains("1 to 256"), "{bad}: {e}");
        }
    }

    #[test]
    fn block_on_until_answers_a_ready_future_and_gives_up_at_the_deadline() {
        let soon = Instant::now() + Duration::from_millis(20);
        assert_eq!(block_on_until(async { 7 }, soon), Some(7));
        let notify = Notify::new();
        assert_eq!(
            block_on_until(notify.notified(), Instant::now() + Duration::from_millis(20)),
            None
        );
        // A wake from another thread ends the park at once.
        let notify = Arc::new(Notify::new());
        let n = Arc::clone(&notify);
        let waker = std::thread::spawn(move || {
            std::thread::sleep(Duration::from_millis(20));
            n.notify_one(); // kept as a permit if nothing waits yet
        });
        let notified = notify.notified();
        assert_eq!(block_on_until(notified, Instant::now() + Duration::from_secs(60)), Some(()));
        waker.join().unwrap();
    }
}
