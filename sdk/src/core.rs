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
//! Threads: all networking runs on this module's tokio runtime; user code
//! calls the blocking API (`get`, `wait`, submission) from its own threads.

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

/// Why `cancel(force=True)` of an actor call is refused (Ray 2.60 refuses it too).
const FORCE_ACTOR: &str =
    "force=True is not supported for actor tasks: use kill() on the actor instead";

/// Results up to this size travel inline in replies; larger ones go to the
/// executing node's object store (DESIGN.md §2).
pub const INLINE_MAX_BYTES: usize = 100 * 1024;
/// Tasks pushed to one leased worker before the first one finishes, when
/// `TPURAY_MAX_TASKS_IN_FLIGHT_PER_WORKER` fixes it (Ray's
/// `max_tasks_in_flight_per_worker`). Unset: adaptive (CORE-9), see
/// [`Class::depth`].
fn fixed_pipeline_depth() -> Option<usize> {
    static DEPTH: OnceLock<Option<usize>> = OnceLock::new();
    *DEPTH.get_or_init(|| {
        std::env::var("TPURAY_MAX_TASKS_IN_FLIGHT_PER_WORKER")
            .ok()
            .and_then(|v| v.parse().ok())
            .filter(|&d| d >= 1)
    })
}
/// CORE-9: the most tasks pushed to one leased worker at once while the node has no
/// CPU left for another lease of the class and its tasks are quick; fewer for slower
/// ones, so that what waits on a worker takes about [`PIPELINE_BUDGET_US`].
const DEEP_PIPELINE: usize = 256;
/// The work a deep pipeline keeps queued on one worker (CORE-9), in microseconds of
/// the class's average push: 16 tasks of the slowest quick class.
const PIPELINE_BUDGET_US: u64 = 16 * QUICK_TASK_US;
/// A class whose pushes (round trip included) take at most this long on
/// average counts as quick (CORE-9), in microseconds.
const QUICK_TASK_US: u64 = 2_000;
/// Tasks sent to one worker in one `PushTasks` call at most (CORE-9): half the deep
/// pipeline, so the worker runs one batch while the next is on its way.
const PUSH_BATCH_MAX: usize = DEEP_PIPELINE / 2;
/// A `PushTasks` call carries tasks up to about this many bytes of specs (their inline
/// arguments included), at least one, far below the servers' message limit.
const PUSH_BATCH_BYTES: usize = 4 * 1024 * 1024;
/// How long a class pushes one task at a time after a task of it came back
/// unrun (CORE-9).
const SHALLOW_AFTER_GIVE_BACK: Duration = Duration::from_secs(1);
/// How an `ObjectLost` error whose owner process is gone begins (Python raises
/// `OwnerDiedError` for it).
pub const OWNER_DIED: &str = "owner died";
/// How the `ObjectLost` error of an object freed with [`Core::free`] begins (Python
/// raises `ObjectFreedError` for it).
pub const OBJECT_FREED: &str = "freed explicitly";

/// Pulls of one object the owner lets run at once from one copy; later
/// pullers wait for a copy to finish and then pull from it (a tree broadcast).
const MAX_PULLS_PER_SOURCE: usize = 2;
/// An assigned pull not reported done within this long no longer holds its
/// source (its puller died or hung).
const PULL_SLOT_TTL: Duration = Duration::from_secs(120);
/// Pulls one process runs at once. Each has at most the agent's channel of
/// chunks plus the one being written in flight (about 20 MiB), so a process
/// holds at most about 80 MiB of object bytes in transit.
const MAX_PULLS_PER_PROCESS: usize = 4;

/// How long an idle lease waits for another task of its class before it
/// is returned.
const LEASE_LINGER: Duration = Duration::from_millis(100);
/// Leases one scheduling class may hold or ask for at once.
const MAX_LEASES_PER_CLASS: usize = 32;

/// How long the owner waits for a node agent's answer when deciding whether a broken
/// worker means a dead node ([`Core::failure_cause`]).
const FAILURE_CAUSE_TIMEOUT: Duration = Duration::from_secs(3);

/// How long the caller of an actor call lost mid-call waits for the head to say whether
/// the actor died or restarts ([`Core::lost_call_error`]); Ray waits
/// `timeout_ms_task_wait_for_death_info` the same way.
const ACTOR_DEATH_INFO_WAIT: Duration = Duration::from_secs(5);

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

/// Bytes of an object: inline in memory or mapped from a node store.
#[derive(Clone)]
pub enum Data {
    Inline(Arc<Vec<u8>>),
    Mapped(Arc<ObjectView>),
}

impl std::ops::Deref for Data {
    type Target = [u8];
    fn deref(&self) -> &[u8] {
        match self {
            Data::Inline(v) => v,
            Data::Mapped(m) => m,
        }
    }
}

#[derive(Clone)]
enum ObjState {
    Pending,
    Inline(Arc<Vec<u8>>),
    Stored {
        locations: Vec<pb::ObjectLocation>,
        size: u64,
    },
    /// Boxed: the error is rare and large, and every pending return (one per queued
    /// task) is as big as the largest variant.
    Failed(Box<pb::TaskError>),
}

impl ObjState {
    fn failed(e: pb::TaskError) -> Self {
        ObjState::Failed(Box::new(e))
    }

    /// The state a task's reply gives a return object.
    fn from_return(r: pb::ReturnObject) -> Self {
        match r.data {
            Some(pb::return_object::Data::InlineValue(v)) => ObjState::Inline(Arc::new(v)),
            Some(pb::return_object::Data::Location(l)) => {
                ObjState::Stored { locations: vec![l], size: r.size }
            }
            None => ObjState::Inline(Arc::new(vec![])),
        }
    }
}

/// What the owner keeps to make a task's stored returns again (CORE-6).
struct Lineage {
    /// The spec as it last ran (arguments resolved).
    spec: pb::TaskSpec,
    class: Arc<Class>,
    /// Retries left after that run (negative: unlimited).
    retries_left: i32,
    retry_exceptions: bool,
    /// Argument refs, kept alive (and so reconstructible) with the returns.
    pins: Vec<RawRef>,
}

/// An owned object that is ready.
enum Ready {
    Inline(Arc<Vec<u8>>),
    Stored(Vec<pb::ObjectLocation>),
}

/// What waiting for an owned object found.
enum Got {
    /// Ready, with its size in bytes.
    Ready(Ready, u64),
    Failed(pb::TaskError),
    /// Not in the table (freed, or never owned here).
    Unknown,
    TimedOut,
}

/// A pull the owner assigned: `puller` (a node) copies from `source` (a node).
struct PullSlot {
    source: String,
    puller: String,
    since: Instant,
}

struct Owned {
    state: ObjState,
    /// The task that made it, when it can run again (CORE-6).
    lineage: Option<Arc<Lineage>>,
    /// References alive in this process plus one per borrowing process
    /// (CORE-2).
    refs: usize,
    /// Processes that borrow the object (their WorkerService addresses).
    borrowers: std::collections::HashSet<String>,
    /// Refs nested in this object's value that this process was registered
    /// to borrow on its behalf (id, owner); released when it is freed.
    nested: Vec<(String, String)>,
    /// Refs nested in a `put` value, held while the object lives.
    pins: Vec<RawRef>,
    /// The task that makes it, for cancellation.
    task_id: Option<String>,
    /// The pulls of a stored object (OBJ-8); `None` until the first is assigned (boxed:
    /// most objects are never pulled, and every queued task's return is an entry).
    pulls: Option<Box<Pulls>>,
}

/// The pulls of one stored object (OBJ-8).
#[derive(Default)]
struct Pulls {
    /// Pulls assigned and not reported done.
    slots: Vec<PullSlot>,
    /// Pulls assigned to each source node so far (ties go to the least used).
    served: HashMap<String, u32>,
}

struct GenState {
    items: Vec<String>,
    finished: bool,
    error: Option<pb::TaskError>,
}

struct Queued {
    spec: pb::TaskSpec,
    retries_left: i32,
    retry_exceptions: bool,
    /// Argument refs kept alive until the task ends (CORE-2), then by its
    /// lineage (CORE-6).
    pins: Vec<RawRef>,
}

struct Class {
    resources: HashMap<String, f64>,
    strategy: pb::SchedulingStrategy,
    labels: Vec<pb::LabelConstraint>,
    /// The placement group and bundle index the class runs in (SCHED-19).
    pg: Option<(String, i32)>,
    runtime_env_hash: String,
    queue: Mutex<VecDeque<Queued>>,
    leases: AtomicUsize,
    /// Tasks pushed to this class's leased workers and not answered yet.
    in_flight: AtomicUsize,
    warned: AtomicBool,
    /// Signalled when a task is queued (a lingering lease picks it up).
    queued: Notify,
    /// Lease requests of this class waiting for an agent's answer: while one
    /// waits, the node has no resources for another worker of the class.
    asking: AtomicUsize,
    /// Moving average of a push's round trip, in microseconds (`u64::MAX`
    /// before the first).
    push_us: AtomicU64,
    /// Until when (`now_ms`) the class pushes one task at a time.
    shallow_until_ms: AtomicU64,
    /// Leases whose worker handed tasks back and takes no more until it answers.
    stalled: AtomicUsize,
}

impl Class {
    /// Tasks one leased worker of this class may hold at once (CORE-3, CORE-9):
    /// `TPURAY_MAX_TASKS_IN_FLIGHT_PER_WORKER` when set; else 1 (as Ray's
    /// default), and [`DEEP_PIPELINE`] while a lease request of the class waits
    /// for resources (every CPU it could use is busy) and its tasks are quick,
    /// so quick tasks stop paying a round trip each without ever waiting behind
    /// a slow one while a CPU is free. A task queued behind another that
    /// blocks or runs long comes back unrun (the executor hands it back).
    fn depth(&self) -> usize {
        if let Some(d) = fixed_pipeline_depth() {
            return d;
        }
        let push_us = self.push_us.load(Ordering::Relaxed);
        let quick = push_us <= QUICK_TASK_US;
        let busy_node = self.asking.load(Ordering::Relaxed) > 0;
        if quick && busy_node && now_ms() >= self.shallow_until_ms.load(Ordering::Relaxed) {
            (PIPELINE_BUDGET_US / push_us.max(1)).clamp(2, DEEP_PIPELINE as u64) as usize
        } else {
            1
        }
    }

    fn note_push(&self, took: Duration) {
        let us = took.as_micros().min(u128::from(u64::MAX / 8)) as u64;
        let old = self.push_us.load(Ordering::Relaxed);
        let new = if old == u64::MAX { us } else { (old * 7 + us) / 8 };
        self.push_us.store(new, Ordering::Relaxed);
    }
}

/// Per-actor caller state: the ordered sender (CORE-4).
struct ActorConn {
    /// (call, its arguments being resolved, retries left, retry on the method's own
    /// exceptions).
    tx: tokio::sync::mpsc::UnboundedSender<(pb::TaskSpec, ResolvedArgs, i32, bool)>,
    /// Task ids of this process's calls to the actor that are not finished (CORE-13:
    /// what `max_pending_calls` bounds).
    pending: Mutex<std::collections::HashSet<String>>,
}

/// A submitted task, as its caller needs it.
pub(crate) struct Submitted {
    pub task_id: String,
    /// Its display name.
    pub name: String,
    /// The ids of its returns (none for a streaming task).
    pub return_ids: Vec<String>,
}

/// Where a running task is, for cancellation.
struct Running {
    worker_address: String,
    cancelled: bool,
    /// An actor call (`force` is refused for those, as Ray refuses it).
    actor: bool,
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
    /// Boxed: a queued task's return sits here, and the table's empty buckets (up to
    /// half of them after it grows) then cost a pointer each, not a whole entry.
    objects: Mutex<HashMap<String, Box<Owned>>>,
    objects_changed: Notify,
    classes: Mutex<HashMap<String, Arc<Class>>>,
    /// The options of the last task submitted, and their class ([`Core::class_for`]).
    last_class: Mutex<Option<(TaskOptions, Arc<Class>)>>,
    generators: Mutex<HashMap<String, GenState>>,
    actors: Mutex<HashMap<String, Arc<ActorConn>>>,
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
    /// then `borrow_queues` and a queue's state.
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

/// A pushed task's answer: the task, its reply or the call's failure, and the time it
/// took (for a batch: since the batch went out, divided by the answers so far).
type Pushed = (Queued, Result<pb::PushTaskReply, tonic::Status>, Duration);

/// Pushes one task (`PushTask`) or a batch (`PushTasks`) to a leased worker and sends
/// each task's answer to `done` as it comes (CORE-9); tasks a broken stream left
/// unanswered get the failure.
async fn push_batch(
    core: Arc<Core>,
    node_id: String,
    mut c: pb::worker_service_client::WorkerServiceClient<tpuray_proto::client::AuthChannel>,
    batch: Vec<Queued>,
    done: tokio::sync::mpsc::UnboundedSender<Pushed>,
) {
    let t = Instant::now();
    if let [q] = batch.as_slice() {
        let push = c.push_task(pb::PushTaskRequest { spec: Some(q.spec.clone()) });
        let r = core.unless_node_dies(&node_id, push).await;
        let q = batch.into_iter().next().expect("one task");
        let _ = done.send((q, r.map(tonic::Response::into_inner), t.elapsed()));
        return;
    }
    let specs = batch.iter().map(|q| q.spec.clone()).collect();
    let mut slots: Vec<Option<Queued>> = batch.into_iter().map(Some).collect();
    let mut answered = 0u32;
    let pushed = core.unless_node_dies(&node_id, c.push_tasks(pb::PushTasksRequest { specs }));
    let failure = match pushed.await {
        Ok(r) => {
            let mut items = r.into_inner();
            loop {
                match core.unless_node_dies(&node_id, items.message()).await {
                    Ok(Some(ready)) => {
                        for item in ready.items {
                            let q = slots.get_mut(item.index as usize).and_then(Option::take);
                            if let Some(q) = q {
                                answered += 1;
                                let reply = item.reply.unwrap_or_default();
                                let _ = done.send((q, Ok(reply), t.elapsed() / answered));
                            }
                        }
                    }
                    Ok(None) => {
                        break tonic::Status::internal(
                            "the worker's answers ended before every pushed task was answered",
                        );
                    }
                    Err(s) => break s,
                }
            }
        }
        Err(s) => s,
    };
    for q in slots.into_iter().flatten() {
        let _ = done.send((q, Err(failure.clone()), t.elapsed()));
    }
}

/// The error of a call to a node the head declared dead (CORE-10).
fn node_died(node_id: &str) -> tonic::Status {
    tonic::Status::unavailable(format!("node {node_id} died (the head declared it dead)"))
}

/// A by-value task argument and the refs nested inside it.
fn value_arg(v: Vec<u8>, nested: &[RawRef]) -> pb::TaskArg {
    let nested = nested
        .iter()
        .map(|r| pb::ObjectRefMsg {
            object_id: r.id().to_string(),
            owner_address: r.owner().to_string(),
        })
        .collect();
    pb::TaskArg { kind: Some(pb::task_arg::Kind::Value(v)), nested }
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

/// An open borrow batch: its depth, and per owner queue the last registration queued in it.
type BorrowBatch = (usize, Vec<(Arc<BorrowQueue>, u64)>);

thread_local! {
    /// Borrower registrations started on this thread and not yet confirmed;
    /// an executor waits for them before it replies (CORE-2).
    static PENDING_BORROWS: std::cell::RefCell<Vec<tokio::task::JoinHandle<()>>> = const { std::cell::RefCell::new(Vec::new()) };
    /// An open borrow batch on this thread ([`begin_borrow_batch`]): its depth, and per
    /// owner queue the last registration queued inside it.
    static BORROW_BATCH: std::cell::RefCell<BorrowBatch> = const { std::cell::RefCell::new((0, Vec::new())) };
}

/// Waits until the owners confirmed every borrow this thread started.
pub(crate) fn confirm_borrows(core: &Core) {
    let pending: Vec<_> = PENDING_BORROWS.with(|p| std::mem::take(&mut *p.borrow_mut()));
    for h in pending {
        let _ = core.rt.block_on(h);
    }
}

/// Opens a borrow batch on this thread: until the matching [`end_borrow_batch`], the
/// borrower registrations of refs made here (a value being deserialized) are queued
/// without waiting, and go to each owner together (CORE-2). Batches nest.
pub(crate) fn begin_borrow_batch() {
    BORROW_BATCH.with(|b| b.borrow_mut().0 += 1);
}

/// Closes the batch [`begin_borrow_batch`] opened; the outermost one waits until every
/// owner confirmed the registrations queued inside it (on an executor thread, inside the
/// runtime, the wait is left to [`confirm_borrows`] as for single registrations).
pub(crate) fn end_borrow_batch() {
    let waits = BORROW_BATCH.with(|b| {
        let mut b = b.borrow_mut();
        b.0 = b.0.saturating_sub(1);
        if b.0 == 0 { std::mem::take(&mut b.1) } else { Vec::new() }
    });
    if waits.is_empty() {
        return;
    }
    let Some(c) = try_core() else { return };
    let all = async move {
        for (q, seq) in waits {
            q.confirmed(seq).await;
        }
    };
    wait_registered(c, all);
}

/// Waits for a borrower registration: on an executor thread (inside the runtime) it is
/// recorded for [`confirm_borrows`]; elsewhere this thread blocks until it is confirmed.
fn wait_registered(c: &Core, fut: impl std::future::Future<Output = ()> + Send + 'static) {
    if tokio::runtime::Handle::try_current().is_ok() {
        let h = c.rt.spawn(fut);
        PENDING_BORROWS.with(|p| p.borrow_mut().push(h));
    } else {
        c.rt.block_on(fut);
    }
}

/// Called when a counted [`RawRef`] is made in this process: the owner
/// counts it; a borrower tells the owner when it starts holding the object,
/// unless an object this process owns already holds it on this process's behalf
/// (a return value it was nested in, [`Borrow::covers`]).
pub(crate) fn add_ref(id: &str, owner: &str) {
    let Some(c) = try_core() else { return };
    if c.address == owner {
        if let Some(o) = c.objects.lock().unwrap().get_mut(id) {
            o.refs += 1;
        }
        return;
    }
    let queued = {
        let mut b = c.borrowed.lock().unwrap();
        let e = b.entry(id.to_string()).or_default();
        e.refs += 1;
        if e.refs == 1 && e.covers == 0 && !e.registered {
            e.registered = true;
            // Queued under the lock: this process's changes of one id reach the owner
            // in the order they happened here.
            Some(c.queue_borrow_update(owner, id.to_string(), String::new(), true))
        } else {
            None
        }
    };
    if let Some((q, seq)) = queued {
        let batched = BORROW_BATCH.with(|b| {
            let mut b = b.borrow_mut();
            if b.0 == 0 {
                return false;
            }
            match b.1.iter_mut().find(|(x, _)| Arc::ptr_eq(x, &q)) {
                Some(w) => w.1 = seq,
                None => b.1.push((q.clone(), seq)),
            }
            true
        });
        if !batched {
            wait_registered(c, async move { q.confirmed(seq).await });
        }
    }
}

/// Called when the last clone of a counted [`RawRef`] drops in this process.
pub(crate) fn release_ref(id: &str, owner: &str) {
    let Some(c) = try_core() else { return };
    if c.address != owner {
        let mut b = c.borrowed.lock().unwrap();
        if let Some(e) = b.get_mut(id) {
            e.refs = e.refs.saturating_sub(1);
            if e.refs == 0 {
                if e.registered {
                    e.registered = false;
                    // Queued behind this process's registration of it (same owner, in order).
                    c.queue_borrow_update(owner, id.to_string(), String::new(), false);
                }
                if e.covers == 0 {
                    b.remove(id);
                }
            }
        }
        return;
    }
    let freed = {
        let mut objs = c.objects.lock().unwrap();
        match objs.get_mut(id) {
            Some(o) => {
                o.refs = o.refs.saturating_sub(1);
                if o.refs == 0 && !matches!(o.state, ObjState::Pending) {
                    objs.remove(id)
                } else {
                    None
                }
            }
            None => None,
        }
    };
    if let Some(o) = freed {
        c.on_freed(id, *o);
    }
}

/// This process's hold on an object another process owns (CORE-2).
#[derive(Default)]
struct Borrow {
    /// Counted refs alive here.
    refs: usize,
    /// Whether the owner counts this process as a borrower (registered, not yet
    /// released).
    registered: bool,
    /// Objects this process owns whose value nests this one and which hold it on this
    /// process's behalf (the executor registered `<this process>#ret:<object>` with its
    /// owner before replying): while one lives, refs here need no registration of their
    /// own; the last one to go registers this process first if refs remain.
    covers: usize,
}

/// A queued borrower registration to wait for ([`Core::queue_borrower`]).
pub(crate) struct BorrowWait((Arc<BorrowQueue>, u64));

/// Returns once every registration in `waits` was answered (or failed).
pub(crate) async fn all_confirmed(waits: Vec<BorrowWait>) {
    // Changes to one owner are answered in order: its last one covers the rest.
    let mut last: Vec<(Arc<BorrowQueue>, u64)> = Vec::new();
    for BorrowWait((q, seq)) in waits {
        match last.iter_mut().find(|(x, _)| Arc::ptr_eq(x, &q)) {
            Some(w) => w.1 = w.1.max(seq),
            None => last.push((q, seq)),
        }
    }
    for (q, seq) in last {
        q.confirmed(seq).await;
    }
}

/// Borrower changes this process sends one owner (CORE-2), in the order they were
/// queued: one batch on the wire at a time (whatever queued while the previous batch
/// was out), applied by the owner in order, so a release never overtakes the
/// registration before it.
struct BorrowQueue {
    state: Mutex<BorrowQueueState>,
    /// The sequence number of the last change the owner answered (or that failed).
    done: tokio::sync::watch::Sender<u64>,
}

#[derive(Default)]
struct BorrowQueueState {
    updates: VecDeque<pb::BorrowerUpdate>,
    /// The sequence number of the last change queued.
    last: u64,
    /// A task is sending this queue's batches.
    sending: bool,
}

/// Changes in one `UpdateBorrowers` call at most (about 3 MiB).
const MAX_BORROWER_UPDATES_PER_CALL: usize = 50_000;

impl BorrowQueue {
    /// Sends queued batches until the queue is empty.
    async fn send_all(
        &self,
        client: Result<pb::worker_service_client::WorkerServiceClient<AuthChannel>, Error>,
        me: String,
    ) {
        loop {
            let (updates, last) = {
                let mut st = self.state.lock().unwrap();
                if st.updates.is_empty() {
                    st.sending = false;
                    return;
                }
                let n = st.updates.len().min(MAX_BORROWER_UPDATES_PER_CALL);
                let batch: Vec<_> = st.updates.drain(..n).collect();
                (batch, st.last - st.updates.len() as u64)
            };
            if let Ok(c) = &client {
                let mut c = c.clone();
                let mut req = Request::new(pb::UpdateBorrowersRequest {
                    borrower_address: me.clone(),
                    updates,
                });
                req.set_timeout(Duration::from_secs(10));
                let _ = c.update_borrowers(req).await;
            }
            self.done.send_replace(last);
        }
    }

    /// Returns once the change numbered `seq` was answered (or failed).
    async fn confirmed(&self, seq: u64) {
        let mut rx = self.done.subscribe();
        let _ = rx.wait_for(|d| *d >= seq).await;
    }
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
            objects: Mutex::new(HashMap::new()),
            objects_changed: Notify::new(),
            classes: Mutex::new(HashMap::new()),
            last_class: Mutex::new(None),
            generators: Mutex::new(HashMap::new()),
            actors: Mutex::new(HashMap::new()),
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
        // Called on every submission: a plain load first, the swap only once.
        if self.watching_nodes.load(Ordering::Relaxed)
            || self.watching_nodes.swap(true, Ordering::SeqCst)
        {
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

    /// What an owner does when a node dies (CORE-10); waits on the node end by
    /// themselves through [`crate::node_watch::NodeDeaths::died`].
    fn on_node_death(self: &Arc<Self>, node_id: &str) {
        let lost: Vec<String> = {
            let objs = self.objects.lock().unwrap();
            objs.iter()
                .filter(|(_, o)| match &o.state {
                    ObjState::Stored { locations, .. } => {
                        locations.iter().any(|l| l.node_id == node_id)
                    }
                    _ => false,
                })
                .map(|(id, _)| id.clone())
                .collect()
        };
        let dead = [node_id.to_string()];
        for id in lost {
            self.object_lost(&id, &dead);
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

    /// Queues a borrower change for `owner` (`borrower` empty: this process) and starts
    /// its sender when idle; returns the queue and the change's sequence number, for
    /// [`BorrowQueue::confirmed`].
    fn queue_borrow_update(
        &self,
        owner: &str,
        id: String,
        borrower: String,
        add: bool,
    ) -> (Arc<BorrowQueue>, u64) {
        let q = {
            let mut qs = self.borrow_queues.lock().unwrap();
            match qs.get(owner) {
                Some(q) => Arc::clone(q),
                None => {
                    let q = Arc::new(BorrowQueue {
                        state: Mutex::new(BorrowQueueState::default()),
                        done: tokio::sync::watch::Sender::new(0),
                    });
                    qs.insert(owner.to_string(), Arc::clone(&q));
                    q
                }
            }
        };
        let (seq, start) = {
            let mut st = q.state.lock().unwrap();
            st.updates.push_back(pb::BorrowerUpdate { object_id: id, borrower, add });
            st.last += 1;
            let start = !st.sending;
            st.sending = true;
            (st.last, start)
        };
        if start {
            let client = self.worker_client(owner);
            let me = self.address.clone();
            let sender = Arc::clone(&q);
            self.rt.spawn(async move { sender.send_all(client, me).await });
        }
        (q, seq)
    }

    /// Queues registering `borrower` (a borrower key) of `id` with `owner`; the result is
    /// for [`all_confirmed`].
    pub(crate) fn queue_borrower(&self, owner: &str, id: &str, borrower: &str) -> BorrowWait {
        BorrowWait(self.queue_borrow_update(owner, id.to_string(), borrower.to_string(), true))
    }

    /// Owner side of `UpdateBorrower`; false when the object is gone.
    pub(crate) fn serve_update_borrower(&self, id: &str, borrower: &str, add: bool) -> bool {
        let (known, freed) = {
            let mut objs = self.objects.lock().unwrap();
            apply_borrower_update(&mut objs, id, borrower, add)
        };
        if let Some(o) = freed {
            self.on_freed(id, *o);
        }
        known
    }

    /// Owner side of `UpdateBorrowers`: the changes in order (`default` is the borrower
    /// of changes that name none).
    pub(crate) fn serve_update_borrowers(&self, default: &str, updates: &[pb::BorrowerUpdate]) {
        let mut freed = Vec::new();
        {
            let mut objs = self.objects.lock().unwrap();
            for u in updates {
                let borrower = if u.borrower.is_empty() { default } else { &u.borrower };
                if let (_, Some(o)) =
                    apply_borrower_update(&mut objs, &u.object_id, borrower, u.add)
                {
                    freed.push((u.object_id.as_str(), o));
                }
            }
        }
        for (id, o) in freed {
            self.on_freed(id, *o);
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

    pub(crate) fn event(&self, spec: &pb::TaskSpec, state: &str, error: &str) {
        self.event_at(spec, state, error, &self.node_id, &self.worker_id);
    }

    /// Where a task's output lies in this worker's log files (LOGS-3): an event
    /// that changes no state.
    pub(crate) fn log_event(&self, spec: &pb::TaskSpec, info: pb::TaskLogInfo) {
        let mut ev = self.events.lock().unwrap();
        if ev.len() < 100_000 {
            ev.push(pb::TaskEvent {
                task_id: spec.task_id.clone(),
                job_id: spec.job_id.clone(),
                name: spec.name.clone(),
                node_id: self.node_id.clone(),
                worker_id: self.worker_id.clone(),
                attempt: spec.attempt,
                time_ms: now_ms(),
                actor_id: spec.actor_id.clone(),
                log_info: Some(info),
                ..Default::default()
            });
        }
    }

    /// A task event naming where the task ran ("" when unknown).
    fn event_at(&self, spec: &pb::TaskSpec, state: &str, error: &str, node: &str, worker: &str) {
        let mut ev = self.events.lock().unwrap();
        if ev.len() < 100_000 {
            ev.push(pb::TaskEvent {
                task_id: spec.task_id.clone(),
                job_id: spec.job_id.clone(),
                name: spec.name.clone(),
                state: state.to_string(),
                node_id: node.to_string(),
                worker_id: worker.to_string(),
                attempt: spec.attempt,
                error: error.to_string(),
                time_ms: now_ms(),
                actor_id: spec.actor_id.clone(),
                log_info: None,
            });
        }
    }

    /// Sends buffered task events to the head (lossy, batched).
    pub(crate) async fn flush_events(&self) {
        let _sending = self.events_sending.lock().await;
        let batch = std::mem::take(&mut *self.events.lock().unwrap());
        if batch.is_empty() {
            return;
        }
        if let Ok(mut head) = self.head_client() {
            let mut req = Request::new(pb::ReportTaskEventsRequest { events: batch });
            req.set_timeout(Duration::from_secs(5));
            let _ = head.report_task_events(req).await;
        }
    }

    /// Registers an owned object holding one reference, which the caller
    /// hands to a [`RawRef::adopt`] (so a result that arrives before the
    /// caller has its ref cannot free the object).
    fn register_owned(&self, id: &str, state: ObjState, task_id: Option<String>) {
        self.objects.lock().unwrap().insert(
            id.to_string(),
            Box::new(Owned {
                state,
                lineage: None,
                pulls: None,
                refs: 1,
                task_id,
                borrowers: Default::default(),
                nested: vec![],
                pins: vec![],
            }),
        );
    }

    fn set_state(&self, id: &str, state: ObjState) {
        self.set_state_with(id, state, None);
    }

    /// Sets an owned object's state and the lineage that can make it again.
    fn set_state_with(&self, id: &str, state: ObjState, lineage: Option<Arc<Lineage>>) {
        let freed = {
            let mut objs = self.objects.lock().unwrap();
            match objs.get_mut(id) {
                Some(o) => {
                    o.state = state;
                    o.lineage = lineage;
                    // Nobody holds a ref any more: free at once (CORE-2).
                    if o.refs == 0 { objs.remove(id) } else { None }
                }
                None => None,
            }
        };
        if let Some(o) = freed {
            self.on_freed(id, *o);
        }
        self.objects_changed.notify_waiters();
    }

    /// Frees owned objects `ids` now, whatever refs remain (Ray's
    /// `ray._private.internal_api.free`): their store copies are deleted on every
    /// node and a later `get` fails with an `ObjectLost` error beginning
    /// [`OBJECT_FREED`]. The table entries stay until their last ref goes, as usual.
    ///
    /// # Errors
    /// An id this process does not own (its owner frees it), naming it.
    pub(crate) fn free(&self, ids: &[(String, String)]) -> Result<(), Error> {
        if let Some((id, owner)) = ids.iter().find(|(_, owner)| *owner != self.address) {
            return Err(Error::Cluster(format!(
                "free: object {id} is owned by the process at {owner}, not this one (only \
                 an object's owner can free it)"
            )));
        }
        let mut copies = Vec::new();
        {
            let mut objs = self.objects.lock().unwrap();
            for (id, _) in ids {
                let Some(o) = objs.get_mut(id) else { continue };
                let failed = ObjState::failed(pb::TaskError {
                    kind: Kind::ObjectLost as i32,
                    message: format!("{OBJECT_FREED} (free() was called on it)"),
                    function_name: id.clone(),
                    ..Default::default()
                });
                if let ObjState::Stored { locations, .. } = std::mem::replace(&mut o.state, failed)
                {
                    copies.push((id.clone(), locations));
                }
                o.lineage = None;
            }
        }
        for (id, locations) in copies {
            self.free_copies(id, locations);
        }
        self.objects_changed.notify_waiters();
        Ok(())
    }

    /// An owned object was dropped from the table: delete its store copies
    /// and stop borrowing the refs its value carried (CORE-2).
    fn on_freed(&self, id: &str, o: Owned) {
        if let ObjState::Stored { locations, .. } = o.state {
            self.free_copies(id.to_string(), locations);
        }
        // CORE-2: a registration this process queued for one of these refs (say, of a
        // ref just read out of this very value) reaches the ref's owner before this
        // release does: both travel in that owner's queue, in order.
        // The last object nesting a ref that refs here still use registers this process
        // as its borrower first, in the same queue (Borrow::covers).
        let key = format!("{}#ret:{id}", self.address);
        for (nid, owner) in o.nested {
            if owner == self.address {
                self.serve_update_borrower(&nid, &key, false);
                continue;
            }
            self.uncover(&nid, &owner);
            self.queue_borrow_update(&owner, nid, key.clone(), false);
        }
    }

    /// One object that covered borrowed `nid` no longer does: when it was the last and
    /// refs here still use `nid`, this process registers as its borrower (queued before
    /// anything the caller queues next for `owner`).
    fn uncover(&self, nid: &str, owner: &str) {
        let mut b = self.borrowed.lock().unwrap();
        let Some(e) = b.get_mut(nid) else { return };
        e.covers = e.covers.saturating_sub(1);
        if e.covers > 0 {
            return;
        }
        if e.refs == 0 {
            b.remove(nid);
        } else if !e.registered {
            e.registered = true;
            self.queue_borrow_update(owner, nid.to_string(), String::new(), true);
        }
    }

    /// Records that an owned object's value nests `nested` and holds them for this
    /// process (Borrow::covers).
    fn cover_nested(&self, nested: &[(String, String)]) {
        let mut b = self.borrowed.lock().unwrap();
        for (nid, owner) in nested {
            if *owner != self.address {
                b.entry(nid.clone()).or_default().covers += 1;
            }
        }
    }

    fn free_copies(&self, id: String, mut locations: Vec<pb::ObjectLocation>) {
        // This node's copy goes at once, on the caller's thread: a few system calls,
        // and the next put (`ray.put` in a loop) then reuses its pages (OBJ-9) instead
        // of racing a background free. Other nodes' copies go through their agents.
        let before = locations.len();
        locations.retain(|loc| loc.agent_address != self.store_address);
        if locations.len() < before {
            self.store.delete(&id);
        }
        if locations.is_empty() {
            return;
        }
        let token = self.token.clone();
        self.rt.spawn(async move {
            for loc in locations {
                if let Ok(mut c) =
                    tpuray_proto::client::objects(&loc.agent_address, token.as_deref())
                {
                    let _ = c
                        .free_objects(pb::FreeObjectsRequest { object_ids: vec![id.clone()] })
                        .await;
                }
            }
        });
    }

    /// Stores `bytes` as a new owned object (`put`).
    /// `nested`: refs serialized inside `bytes`, kept alive as long as this
    /// object lives (CORE-2).
    pub(crate) fn put_bytes(&self, bytes: Vec<u8>, nested: Vec<RawRef>) -> Result<RawRef, Error> {
        let id = tpuray_proto::ids::ObjectId::random().to_string();
        let state = self.make_state(&id, bytes)?;
        self.register_owned(&id, state, None);
        if !nested.is_empty()
            && let Some(o) = self.objects.lock().unwrap().get_mut(&id)
        {
            o.pins = nested;
        }
        Ok(RawRef::adopt(id, self.address.clone()))
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

    /// A new owned object that stays pending until [`Core::fulfil`] settles it: the
    /// results of work this process supervises (a slice gang's members, which may run
    /// several times before they succeed).
    pub(crate) fn promise(&self) -> RawRef {
        let id = tpuray_proto::ids::ObjectId::random().to_string();
        self.register_owned(&id, ObjState::Pending, None);
        RawRef::adopt(id, self.address.clone())
    }

    /// Settles promise `id` with a value (bytes, stored inline or in this node's store) or
    /// with the error of an owned object that failed (copied as it is, so its language's
    /// exception survives).
    pub(crate) fn fulfil(&self, id: &str, outcome: Result<Vec<u8>, String>) {
        let state = match outcome {
            Ok(bytes) => self
                .make_state(id, bytes)
                .unwrap_or_else(|e| ObjState::failed(err(Kind::ObjectLost, e.to_string(), ""))),
            Err(failed) => self
                .objects
                .lock()
                .unwrap()
                .get(&failed)
                .and_then(|o| match &o.state {
                    ObjState::Failed(e) => Some(ObjState::Failed(e.clone())),
                    _ => None,
                })
                .unwrap_or_else(|| {
                    ObjState::failed(err(Kind::WorkerDied, format!("{failed} failed"), ""))
                }),
        };
        self.set_state(id, state);
    }

    /// Settles promise `id` with an error of this process's own: a gang whose slices could
    /// not be reserved again (reported as infeasible).
    pub(crate) fn fulfil_message(&self, id: &str, message: &str, function: &str) {
        self.set_state(id, ObjState::failed(err(Kind::Infeasible, message, function)));
    }

    /// An owned object that failed before any task ran (bad options).
    /// A new owned object failed with `e` (a call refused at submission).
    pub(crate) fn put_failed_with(&self, function: &str, e: Error) -> RawRef {
        let kind = match &e {
            Error::PendingCallsLimitExceeded { .. } => Kind::PendingCallsLimitExceeded,
            Error::Cancelled { .. } => Kind::Cancelled,
            _ => Kind::BadArguments,
        };
        let id = tpuray_proto::ids::ObjectId::random().to_string();
        let message = match e {
            Error::PendingCallsLimitExceeded { message, .. } => message,
            other => other.to_string(),
        };
        self.register_owned(&id, ObjState::failed(err(kind, message, function)), None);
        RawRef::adopt(id, self.address.clone())
    }

    pub(crate) fn put_failed(&self, function: &str, message: &str) -> RawRef {
        let id = tpuray_proto::ids::ObjectId::random().to_string();
        self.register_owned(
            &id,
            ObjState::failed(err(Kind::BadArguments, message, function)),
            None,
        );
        RawRef::adopt(id, self.address.clone())
    }

    /// Stores the concatenation of `parts` as a new owned object (`put` of a
    /// value serialized in pieces: a pickle and the buffers it refers to). A
    /// large one is written part by part straight into this node's store,
    /// never joined in memory first. `nested` as for [`Core::put_bytes`].
    pub(crate) fn put_parts(&self, parts: &[&[u8]], nested: Vec<RawRef>) -> Result<RawRef, Error> {
        let size = parts.iter().map(|p| p.len()).sum::<usize>();
        if size <= INLINE_MAX_BYTES {
            return self.put_bytes(parts.concat(), nested);
        }
        self.put_streamed(size, |write| {
            for p in parts {
                write(p)?;
            }
            Ok(nested)
        })
    }

    /// Stores a new owned object of `size` bytes that `write` hands over piece by piece
    /// (`put` of a large value: its encoding goes straight into this node's store, never
    /// into a buffer of its own first). `write` returns the refs nested in the value.
    ///
    /// # Errors
    /// The store cannot take `size` bytes (OBJ-7), a write fails, or `write` handed over
    /// another number of bytes than `size`.
    pub(crate) fn put_streamed(
        &self,
        size: usize,
        write: impl FnOnce(&mut dyn FnMut(&[u8]) -> std::io::Result<()>) -> std::io::Result<Vec<RawRef>>,
    ) -> Result<RawRef, Error> {
        let id = tpuray_proto::ids::ObjectId::random().to_string();
        let size = size as u64;
        let opts = CreateOptions {
            size: Some(size),
            owner: Some(self.address.clone()),
            ..Default::default()
        };
        let cluster = |e: tpuray_objectstore::StoreError| Error::Cluster(e.to_string());
        // OBJ-7: a store that cannot take it fails at once, naming the sizes.
        let mut w = self.store.create_with(&id, &opts).map_err(cluster)?;
        let nested =
            write(&mut |piece| w.write(piece)).map_err(|e| Error::Cluster(e.to_string()))?;
        // A size that differs is refused here (the writer is dropped, its file removed).
        w.seal(Some(size)).map_err(cluster)?;
        let state = ObjState::Stored { locations: vec![self.location()], size };
        self.register_owned(&id, state, None);
        if !nested.is_empty()
            && let Some(o) = self.objects.lock().unwrap().get_mut(&id)
        {
            o.pins = nested;
        }
        Ok(RawRef::adopt(id, self.address.clone()))
    }

    /// Inline when small, else written to this node's store.
    fn make_state(&self, id: &str, bytes: Vec<u8>) -> Result<ObjState, Error> {
        if bytes.len() <= INLINE_MAX_BYTES {
            Ok(ObjState::Inline(Arc::new(bytes)))
        } else {
            let size = bytes.len() as u64;
            let opts = CreateOptions { owner: Some(self.address.clone()), ..Default::default() };
            // OBJ-7: a store that cannot take it fails at once, naming the sizes.
            self.store.put_with(id, &bytes, &opts).map_err(|e| Error::Cluster(e.to_string()))?;
            Ok(ObjState::Stored { locations: vec![self.location()], size })
        }
    }

    /// Waits until `r` is ready; its bytes. Copies that cannot be read are
    /// reported lost (to this process's table, or to the owner), which makes
    /// the object again from lineage or fails it (CORE-6).
    pub(crate) async fn get_data(
        self: &Arc<Self>,
        r: &RawRef,
        deadline: Option<Instant>,
    ) -> Result<Data, Error> {
        let id = r.id();
        let mut lost: Vec<String> = Vec::new();
        loop {
            let locations = if r.owner() == self.address {
                if !lost.is_empty() {
                    self.object_lost(id, &std::mem::take(&mut lost));
                }
                match self.wait_owned(id, &self.node_id, deadline).await? {
                    Ready::Inline(b) => return Ok(Data::Inline(b)),
                    Ready::Stored(locations) => locations,
                }
            } else {
                match self.ask_owner(r, deadline, std::mem::take(&mut lost)).await? {
                    Ready::Inline(b) => return Ok(Data::Inline(b)),
                    Ready::Stored(locations) => locations,
                }
            };
            match self.fetch(id, r.owner(), &locations).await {
                Ok(d) => return Ok(d),
                Err((e, failed)) if failed.is_empty() => return Err(e),
                Err((_, failed)) => lost = failed,
            }
        }
    }

    /// Waits until owned object `id` is ready (inline bytes or locations);
    /// `puller` as in [`Core::wait_ready`].
    async fn wait_owned(
        &self,
        id: &str,
        puller: &str,
        deadline: Option<Instant>,
    ) -> Result<Ready, Error> {
        match self.wait_ready(id, puller, deadline).await {
            Got::Ready(r, _) => Ok(r),
            Got::Failed(e) => Err(Error::from_wire(&e, id)),
            Got::Unknown => {
                Err(Error::ObjectLost { id: id.into(), message: "freed by its owner".into() })
            }
            Got::TimedOut => Err(Error::Timeout(Duration::ZERO, 1)),
        }
    }

    /// Waits until owned object `id` is ready or failed. For a stored object
    /// and a `puller` node ("" for none), waits also until a copy can serve
    /// it and answers with that one source ([`assign_source`], OBJ-8).
    async fn wait_ready(&self, id: &str, puller: &str, deadline: Option<Instant>) -> Got {
        loop {
            let notified = self.objects_changed.notified();
            {
                let mut objs = self.objects.lock().unwrap();
                let Some(o) = objs.get_mut(id) else { return Got::Unknown };
                match &o.state {
                    ObjState::Pending => {}
                    ObjState::Inline(b) => {
                        return Got::Ready(Ready::Inline(Arc::clone(b)), b.len() as u64);
                    }
                    ObjState::Failed(e) => return Got::Failed((**e).clone()),
                    ObjState::Stored { locations, size } => {
                        let size = *size;
                        if puller.is_empty() {
                            return Got::Ready(Ready::Stored(locations.clone()), size);
                        }
                        if let Some(l) = assign_source(o, puller) {
                            return Got::Ready(Ready::Stored(l), size);
                        }
                    }
                }
            }
            match deadline {
                Some(d) => {
                    if tokio::time::timeout_at(d.into(), notified).await.is_err() {
                        return Got::TimedOut;
                    }
                }
                None => notified.await,
            }
        }
    }

    /// A pull the owner assigned ended (owner side of `ReportObjectCopy`):
    /// frees its source and, when it succeeded, adds the puller's copy as a
    /// source for later pullers (OBJ-8).
    pub(crate) fn copy_done(
        &self,
        id: &str,
        source: &str,
        puller: &str,
        copy: Option<pb::ObjectLocation>,
    ) {
        let orphan = {
            let mut objs = self.objects.lock().unwrap();
            match objs.get_mut(id) {
                Some(o) => {
                    if let Some(p) = o.pulls.as_mut()
                        && let Some(i) =
                            p.slots.iter().position(|p| p.source == source && p.puller == puller)
                    {
                        p.slots.remove(i);
                    }
                    // CORE-10: a node the head declared dead holds no copy any more.
                    if let (Some(c), ObjState::Stored { locations, .. }) = (copy, &mut o.state)
                        && !locations.iter().any(|l| l.node_id == c.node_id)
                        && !self.deaths.is_dead(&c.node_id)
                    {
                        locations.push(c);
                    }
                    None
                }
                // Freed while it was pulled: that copy goes too (CORE-2).
                None => copy,
            }
        };
        if let Some(c) = orphan {
            self.free_copies(id.to_string(), vec![c]);
        }
        self.objects_changed.notify_waiters();
    }

    /// Tells `owner` that this node's pull of `id` from `source` ended.
    async fn report_copy(
        &self,
        id: &str,
        owner: &str,
        source: &str,
        copy: Option<pb::ObjectLocation>,
    ) {
        if owner == self.address {
            self.copy_done(id, source, &self.node_id, copy);
            return;
        }
        let Ok(mut c) = self.worker_client(owner) else { return };
        let mut req = Request::new(pb::ReportObjectCopyRequest {
            object_id: id.to_string(),
            source_node_id: source.to_string(),
            puller_node_id: self.node_id.clone(),
            copy,
        });
        req.set_timeout(Duration::from_secs(10));
        let _ = c.report_object_copy(req).await;
    }

    /// Copies of owned object `id` on the nodes `lost` cannot be read: drops
    /// those locations and, when none is left, runs the task that made it
    /// again (CORE-6) or, without lineage or retries, fails it as lost.
    fn object_lost(self: &Arc<Self>, id: &str, lost: &[String]) {
        let redo = {
            let mut objs = self.objects.lock().unwrap();
            let Some(o) = objs.get_mut(id) else { return };
            if let Some(p) = o.pulls.as_mut() {
                p.slots.retain(|p| !lost.contains(&p.source));
            }
            let ObjState::Stored { locations, .. } = &mut o.state else { return };
            locations.retain(|l| !lost.contains(&l.node_id));
            if !locations.is_empty() {
                return;
            }
            match o.lineage.clone() {
                Some(l) if l.retries_left != 0 => {
                    // Every stored return of that task comes back with the new run.
                    for rid in &l.spec.return_ids {
                        if let Some(r) = objs.get_mut(rid)
                            && matches!(r.state, ObjState::Stored { .. })
                        {
                            r.state = ObjState::Pending;
                            r.lineage = None;
                        }
                    }
                    l
                }
                l => {
                    let why = if l.is_some() {
                        "the task that made it has no retries left"
                    } else {
                        "it was made by put, so no task can make it again"
                    };
                    o.state = ObjState::failed(pb::TaskError {
                        kind: Kind::ObjectLost as i32,
                        message: format!("every copy was lost with its node and {why}"),
                        function_name: id.to_string(),
                        ..Default::default()
                    });
                    drop(objs);
                    self.objects_changed.notify_waiters();
                    return;
                }
            }
        };
        self.objects_changed.notify_waiters();
        let mut spec = redo.spec.clone();
        spec.attempt += 1;
        self.event(&spec, "RETRYING", "reconstructing a lost return object");
        let left = if redo.retries_left < 0 { redo.retries_left } else { redo.retries_left - 1 };
        redo.class.queue.lock().unwrap().push_back(Queued {
            spec,
            retries_left: left,
            retry_exceptions: redo.retry_exceptions,
            pins: redo.pins.clone(),
        });
        redo.class.queued.notify_one();
        self.ensure_leases(&redo.class);
    }

    /// A borrower asks the owner for the object (long poll), first reporting
    /// the nodes whose copies it could not read.
    async fn ask_owner(
        &self,
        r: &RawRef,
        deadline: Option<Instant>,
        mut lost: Vec<String>,
    ) -> Result<Ready, Error> {
        let mut client =
            self.worker_client(r.owner()).map_err(|e| Error::Cluster(e.to_string()))?;
        let mut asked_again = false;
        loop {
            let wait = match deadline {
                Some(d) => d.saturating_duration_since(Instant::now()).min(Duration::from_secs(10)),
                None => Duration::from_secs(10),
            };
            let mut req = Request::new(pb::GetObjectRequest {
                object_id: r.id().to_string(),
                timeout_ms: wait.as_millis() as u64,
                lost_node_ids: std::mem::take(&mut lost),
                puller_node_id: self.node_id.clone(),
            });
            req.set_timeout(wait + Duration::from_secs(10));
            let reply = client.get_object(req).await;
            // A connection lost under the call (the owner may have died just then) is
            // asked once more: a dead owner then refuses the connection.
            if let Err(s) = &reply
                && s.code() == tonic::Code::Unknown
                && !asked_again
            {
                asked_again = true;
                continue;
            }
            let reply = reply.map_err(|s| Error::ObjectLost {
                id: r.id().to_string(),
                message: if s.code() == tonic::Code::Unavailable {
                    format!(
                        "{OWNER_DIED}: its owner at {} cannot be reached: {}",
                        r.owner(),
                        s.message()
                    )
                } else {
                    format!("its owner at {} did not answer: {}", r.owner(), s.message())
                },
            })?;
            let reply = reply.into_inner();
            match pb::get_object_reply::Status::try_from(reply.status) {
                Ok(pb::get_object_reply::Status::Ready) => {
                    return Ok(if reply.locations.is_empty() {
                        Ready::Inline(Arc::new(reply.inline_value))
                    } else {
                        Ready::Stored(reply.locations)
                    });
                }
                Ok(pb::get_object_reply::Status::Failed) => {
                    return Err(Error::from_wire(&reply.error.unwrap_or_default(), r.id()));
                }
                Ok(pb::get_object_reply::Status::Unknown) => {
                    return Err(Error::ObjectLost {
                        id: r.id().to_string(),
                        message: "its owner no longer has it".into(),
                    });
                }
                _ => {
                    if deadline.is_some_and(|d| Instant::now() >= d) {
                        return Err(Error::Timeout(Duration::ZERO, 1));
                    }
                }
            }
        }
    }

    /// Maps the local copy, or pulls one from another node into this node's
    /// store first (a secondary copy, evictable, recording `owner`). On
    /// failure also the nodes whose copies could not be read (this node's
    /// own when its listed copy is gone): the caller reports them lost.
    async fn fetch(
        &self,
        id: &str,
        owner: &str,
        locations: &[pb::ObjectLocation],
    ) -> Result<Data, (Error, Vec<String>)> {
        let local_dir = self.store.dir().display().to_string();
        let mut failed = Vec::new();
        match self.map_local(id).await {
            Ok(Some(v)) => {
                if let Some(src) = locations
                    .first()
                    .filter(|_| !locations.iter().any(|l| l.store_dir == local_dir))
                {
                    // A copy here the owner did not know of: it frees the source
                    // it assigned and hands this one out from now on.
                    self.report_copy(id, owner, &src.node_id, Some(self.location())).await;
                }
                return Ok(Data::Mapped(Arc::new(v)));
            }
            Ok(None) => failed.extend(
                locations.iter().filter(|l| l.store_dir == local_dir).map(|l| l.node_id.clone()),
            ),
            Err(_) => {}
        }
        let mut last = String::from("no copy is known");
        for loc in locations.iter().filter(|l| l.store_dir != local_dir) {
            let pulled = self.pull(id, owner, loc).await;
            // The owner frees the source it assigned; a lost source is
            // reported with the next request instead (CORE-6).
            match &pulled {
                Ok(()) => self.report_copy(id, owner, &loc.node_id, Some(self.location())).await,
                Err(PullError::Local(_)) => self.report_copy(id, owner, &loc.node_id, None).await,
                Err(PullError::Source(_)) => {}
            }
            match pulled {
                Ok(()) => match self.map_local(id).await {
                    Ok(Some(v)) => return Ok(Data::Mapped(Arc::new(v))),
                    Ok(None) => last = "the pulled copy was evicted before it was read".into(),
                    Err(e) => last = e,
                },
                Err(PullError::Source(e)) => {
                    failed.push(loc.node_id.clone());
                    last = e;
                }
                Err(PullError::Local(e)) => last = e,
            }
        }
        Err((
            Error::ObjectLost {
                id: id.to_string(),
                message: format!("no node could provide it: {last}"),
            },
            failed,
        ))
    }

    /// Maps this node's copy of `id`. Off the runtime threads: a spilled
    /// object may be restored first (megabytes of copying).
    async fn map_local(&self, id: &str) -> Result<Option<ObjectView>, String> {
        let store = self.store.clone();
        let id = id.to_string();
        tokio::task::spawn_blocking(move || store.get(&id).map_err(|e| e.to_string()))
            .await
            .map_err(|e| e.to_string())?
    }

    /// Pulls `id` from the agent of `loc` into this node's store as a
    /// secondary copy; ends with a source error once the head declares that node
    /// dead (CORE-10). Store calls (reserving room may spill or evict) run
    /// off the runtime threads, one chunk at a time.
    async fn pull(&self, id: &str, owner: &str, loc: &pb::ObjectLocation) -> Result<(), PullError> {
        let agent = &loc.agent_address;
        let source = |m: String| PullError::Source(format!("{agent}: {m}"));
        if self.deaths.is_dead(&loc.node_id) {
            return Err(source(node_died(&loc.node_id).message().to_string()));
        }
        if let Some(core) = try_core() {
            core.watch_nodes();
        }
        let _permit =
            self.pull_permits.acquire().await.map_err(|e| PullError::Local(e.to_string()))?;
        let mut c = self.objects_client(agent).map_err(|e| source(e.to_string()))?;
        let request = c.pull(pb::PullRequest { object_id: id.to_string(), chunk_size: 0 });
        let mut stream = self
            .unless_node_dies(&loc.node_id, request)
            .await
            .map_err(|s| source(s.message().to_string()))?
            .into_inner();
        let mut w: Option<Writer> = None;
        let mut total = None;
        while let Some(chunk) = self
            .unless_node_dies(&loc.node_id, stream.message())
            .await
            .map_err(|s| source(s.message().to_string()))?
        {
            total = Some(chunk.total_size);
            let writer = w.take();
            let store = self.store.clone();
            let (id, owner) = (id.to_string(), owner.to_string());
            let size = chunk.total_size;
            w = Some(
                tokio::task::spawn_blocking(move || {
                    let mut w = match writer {
                        Some(w) => w,
                        None => {
                            let opts = CreateOptions {
                                size: Some(size),
                                copy: CopyKind::Secondary,
                                owner: (!owner.is_empty()).then_some(owner),
                            };
                            store.create_with(&id, &opts).map_err(|e| e.to_string())?
                        }
                    };
                    w.write(&chunk.data).map_err(|e| e.to_string())?;
                    Ok::<_, String>(w)
                })
                .await
                .map_err(|e| PullError::Local(e.to_string()))?
                .map_err(PullError::Local)?,
            );
        }
        let Some(w) = w else {
            return Err(source(format!("the pull of {id} ended without data")));
        };
        tokio::task::spawn_blocking(move || w.seal(total).map_err(|e| e.to_string()))
            .await
            .map_err(|e| PullError::Local(e.to_string()))?
            .map_err(PullError::Local)
    }

    /// Whether `r` is ready now (for `wait`).
    pub(crate) async fn is_ready(&self, r: &RawRef) -> bool {
        if r.owner() == self.address {
            !matches!(
                self.objects.lock().unwrap().get(r.id()).map(|o| &o.state),
                Some(ObjState::Pending)
            )
        } else {
            let Ok(mut c) = self.worker_client(r.owner()) else {
                return true;
            };
            match c
                .get_object(pb::GetObjectRequest {
                    object_id: r.id().to_string(),
                    ..Default::default()
                })
                .await
            {
                Ok(rep) => rep.into_inner().status != pb::get_object_reply::Status::Pending as i32,
                Err(_) => true,
            }
        }
    }

    /// Resolves when any owned object changes state. Create it before checking states,
    /// so a change between the check and the wait is not missed.
    pub(crate) fn objects_changed(&self) -> tokio::sync::futures::Notified<'_> {
        self.objects_changed.notified()
    }

    /// Blocks this thread (one outside the runtime) until none of `refs` that this
    /// process owns is pending any more, or until `deadline`.
    ///
    /// It parks the thread instead of setting a runtime timer: a timer set from outside
    /// the runtime wakes the runtime's driver thread, one more thread wake for every
    /// `get` that waits in slices (the Python SDK's do, to see Ctrl-C).
    pub(crate) fn settle_owned(&self, refs: &[RawRef], deadline: Instant) {
        let pending = || {
            let objs = self.objects.lock().unwrap();
            refs.iter()
                .any(|r| objs.get(r.id()).is_some_and(|o| matches!(o.state, ObjState::Pending)))
        };
        block_on_until(
            async {
                loop {
                    let changed = self.objects_changed();
                    tokio::pin!(changed);
                    changed.as_mut().enable();
                    if !pending() {
                        return;
                    }
                    changed.await;
                }
            },
            deadline,
        );
    }

    /// Owner side of `GetObject`; `lost`: nodes whose copies the caller
    /// could not read (CORE-6); `puller`: the caller's node when it will pull
    /// (answered with one assigned source, OBJ-8).
    pub(crate) async fn serve_get_object(
        self: &Arc<Self>,
        id: &str,
        timeout: Duration,
        lost: &[String],
        puller: &str,
    ) -> pb::GetObjectReply {
        use pb::get_object_reply::Status;
        if !lost.is_empty() {
            self.object_lost(id, lost);
        }
        let deadline = Instant::now() + timeout;
        match self.wait_ready(id, puller, Some(deadline)).await {
            Got::Ready(Ready::Inline(b), size) => pb::GetObjectReply {
                status: Status::Ready as i32,
                size,
                inline_value: b.to_vec(),
                ..Default::default()
            },
            Got::Ready(Ready::Stored(locations), size) => pb::GetObjectReply {
                status: Status::Ready as i32,
                locations,
                size,
                ..Default::default()
            },
            Got::Failed(e) => pb::GetObjectReply {
                status: Status::Failed as i32,
                error: Some(e),
                ..Default::default()
            },
            Got::Unknown => {
                pb::GetObjectReply { status: Status::Unknown as i32, ..Default::default() }
            }
            Got::TimedOut => {
                pb::GetObjectReply { status: Status::Pending as i32, ..Default::default() }
            }
        }
    }

    /// Resolves arguments: owned inline values are copied in; everything
    /// else travels as a reference the executor resolves.
    /// The arguments as [`Core::resolve_args`] makes them, when that needs no waiting: every
    /// one is a value (refs only nested inside) and no placement group is being created.
    /// Hands `args` back otherwise.
    fn resolve_args_now(args: Vec<Arg>) -> Result<(Vec<pb::TaskArg>, Vec<RawRef>), Vec<Arg>> {
        if crate::placement_group::creating() || args.iter().any(|a| matches!(a, Arg::Ref(_))) {
            return Err(args);
        }
        let mut out = Vec::with_capacity(args.len());
        let mut pins = Vec::new();
        for a in args {
            if let Arg::Value(v, nested) = a {
                out.push(value_arg(v, &nested));
                pins.extend(nested);
            }
        }
        Ok((out, pins))
    }

    async fn resolve_args(
        &self,
        args: Vec<Arg>,
        function: &str,
    ) -> Result<(Vec<pb::TaskArg>, Vec<RawRef>), pb::TaskError> {
        if crate::placement_group::creating() {
            // PG-1: the arguments may name a group this process is still creating.
            crate::placement_group::all_created().await;
        }
        let mut out = Vec::with_capacity(args.len());
        let mut pins = Vec::new();
        for a in args {
            match a {
                Arg::Value(v, nested) => {
                    out.push(value_arg(v, &nested));
                    pins.extend(nested);
                }
                Arg::Ref(r) => {
                    if r.owner() == self.address {
                        // A stored value travels as a ref: the executor pulls it
                        // (this process never copies it in just to look).
                        match self.wait_owned(r.id(), "", None).await {
                            Ok(Ready::Inline(b)) => {
                                out.push(pb::TaskArg {
                                    kind: Some(pb::task_arg::Kind::Value(b.to_vec())),
                                    nested: vec![],
                                });
                                continue;
                            }
                            Ok(Ready::Stored(_)) => {}
                            // CORE-11: an argument that failed with a task error fails
                            // this task with that same error (Ray's: `get` raises the
                            // upstream's exception, its type included).
                            Err(crate::Error::Task {
                                function: upstream,
                                message,
                                node,
                                pid,
                                payload,
                            }) => {
                                return Err(pb::TaskError {
                                    kind: Kind::Application as i32,
                                    message,
                                    function_name: upstream,
                                    node_id: node,
                                    pid,
                                    payload,
                                    no_retry: true,
                                });
                            }
                            Err(e) => {
                                return Err(err(
                                    Kind::Application,
                                    format!("an argument failed: {e}"),
                                    function,
                                ));
                            }
                        }
                    }
                    out.push(pb::TaskArg {
                        kind: Some(pb::task_arg::Kind::ObjectRef(pb::ObjectRefMsg {
                            object_id: r.id().to_string(),
                            owner_address: r.owner().to_string(),
                        })),
                        nested: vec![],
                    });
                    pins.push(r);
                }
            }
        }
        Ok((out, pins))
    }

    fn base_spec(
        &self,
        function: &str,
        name: Option<&str>,
        num_returns: u32,
        streaming: bool,
    ) -> pb::TaskSpec {
        let task_id = tpuray_proto::ids::TaskId::random().to_string();
        let return_ids = (0..num_returns as u64).map(|i| return_id(&task_id, i)).collect();
        pb::TaskSpec {
            task_id,
            job_id: self.job_id.clone(),
            function: Some(pb::FunctionDescriptor {
                language: crate::foreign::language().into(),
                name: function.into(),
                class_name: String::new(),
            }),
            num_returns,
            streaming,
            owner_address: self.address.clone(),
            caller_id: self.worker_id.clone(),
            name: name.unwrap_or(function).to_string(),
            return_ids,
            ..Default::default()
        }
    }

    /// The scheduling class of tasks submitted with `opts`: the queue and leases they
    /// share. The last options and their class are kept, so a caller submitting in a
    /// loop skips checking the options and building the class key.
    ///
    /// # Errors
    /// Bad options (resources, label selector, bundle index), naming the problem.
    fn class_for(&self, opts: &TaskOptions) -> Result<Arc<Class>, Error> {
        if let Some((last, class)) = &*self.last_class.lock().unwrap()
            && last == opts
        {
            return Ok(Arc::clone(class));
        }
        let mut resources: HashMap<String, f64> =
            opts.resources.iter().map(|(k, v)| (k.clone(), *v)).collect();
        if opts.num_cpus > 0.0 {
            resources.insert("CPU".into(), opts.num_cpus);
        }
        if opts.num_gpus > 0.0 {
            resources.insert("GPU".into(), opts.num_gpus);
        }
        let plain = tpuray_proto::convert::resources_from_proto(&resources)
            .map_err(|e| Error::Cluster(format!("task options: {e}")))?;
        tpuray_scheduler::tpu::check_tpu_demand(&plain)
            .map_err(|e| Error::Cluster(format!("task options: {e}")))?;
        tpuray_scheduler::gpu::check_gpu_demand(&plain)
            .map_err(|e| Error::Cluster(format!("task options: {e}")))?;
        let pg = match &opts.scheduling {
            Scheduling::PlacementGroup { placement_group_id, bundle_index } => {
                if *bundle_index < -1 {
                    return Err(Error::Cluster(format!(
                        "bundle index {bundle_index} is invalid (expected -1 for any bundle, or 0 and up)"
                    )));
                }
                // SCHED-19: ask for the bundle's renamed resources.
                let demand = tpuray_scheduler::bundles::demand_in_bundle(
                    &plain,
                    placement_group_id,
                    u32::try_from(*bundle_index).ok(),
                );
                resources = tpuray_proto::convert::resources_to_proto(&demand);
                Some((placement_group_id.clone(), *bundle_index))
            }
            _ => None,
        };
        let labels = tpuray_scheduler::parse_label_selector(&opts.label_selector)
            .map_err(|e| Error::Cluster(format!("label_selector: {e}")))?;
        // Agents see work in a group as ordinary work needing the bundle's resources.
        let strategy = match &pg {
            Some(_) => Scheduling::Default.to_proto(),
            None => opts.scheduling.to_proto(),
        };
        let labels = tpuray_proto::convert::labels_to_proto(&labels);
        let mut key_res: Vec<_> = resources.iter().map(|(k, v)| format!("{k}={v}")).collect();
        key_res.sort();
        let key =
            format!("{}|{:?}|{:?}|{}", key_res.join(","), strategy, labels, opts.runtime_env_hash);
        let class = {
            let mut classes = self.classes.lock().unwrap();
            Arc::clone(classes.entry(key).or_insert_with(|| {
                Arc::new(Class {
                    resources,
                    strategy,
                    labels,
                    pg,
                    runtime_env_hash: opts.runtime_env_hash.clone(),
                    queue: Mutex::new(VecDeque::new()),
                    leases: AtomicUsize::new(0),
                    in_flight: AtomicUsize::new(0),
                    warned: AtomicBool::new(false),
                    queued: Notify::new(),
                    asking: AtomicUsize::new(0),
                    push_us: AtomicU64::new(u64::MAX),
                    shallow_until_ms: AtomicU64::new(0),
                    stalled: AtomicUsize::new(0),
                })
            }))
        };
        *self.last_class.lock().unwrap() = Some((opts.clone(), Arc::clone(&class)));
        Ok(class)
    }

    /// Registers a task or actor call being submitted: its returns as owned and pending,
    /// a streaming task's generator state, and its SUBMITTED event.
    fn register_submitted(&self, spec: &pb::TaskSpec) {
        if let Some(parent) = crate::executor::current_task_id() {
            self.children.lock().unwrap().entry(parent).or_default().push(spec.task_id.clone());
        }
        for id in &spec.return_ids {
            self.register_owned(id, ObjState::Pending, Some(spec.task_id.clone()));
        }
        if spec.streaming {
            self.generators.lock().unwrap().insert(
                spec.task_id.clone(),
                GenState { items: vec![], finished: false, error: None },
            );
        }
        self.event(spec, "SUBMITTED", "");
    }

    /// Submits a task (CORE-3); returns its id, name and return ids.
    ///
    /// # Errors
    /// Bad options (resources, label selector, bundle index), naming the problem.
    pub(crate) fn submit(
        self: &Arc<Self>,
        function: &str,
        args: Vec<Arg>,
        opts: &TaskOptions,
        streaming: bool,
    ) -> Result<Submitted, Error> {
        let captured = captured_options(opts);
        let opts = captured.as_ref().unwrap_or(opts);
        let class = self.class_for(opts)?;
        let mut spec = self.base_spec(
            function,
            opts.name.as_deref(),
            if streaming { 0 } else { opts.num_returns },
            streaming,
        );
        spec.resources = class.resources.clone();
        spec.max_calls = opts.max_calls;
        spec.capture_child_tasks = opts.capture_child_tasks;
        self.register_submitted(&spec);
        let core = Arc::clone(self);
        let retries = opts.max_retries;
        let retry_exceptions = opts.retry_exceptions;
        let out = Submitted {
            task_id: spec.task_id.clone(),
            name: spec.name.clone(),
            return_ids: spec.return_ids.clone(),
        };
        let enqueue = move |core: &Arc<Core>, mut spec: pb::TaskSpec, args, pins| {
            spec.args = args;
            class.queue.lock().unwrap().push_back(Queued {
                spec,
                retries_left: retries,
                retry_exceptions,
                pins,
            });
            class.queued.notify_one();
            core.ensure_leases(&class);
        };
        match Self::resolve_args_now(args) {
            Ok((args, pins)) => enqueue(&core, spec, args, pins),
            Err(args) => {
                self.rt.spawn(async move {
                    let function = spec.name.clone();
                    match core.resolve_args(args, &function).await {
                        Ok((args, pins)) => enqueue(&core, spec, args, pins),
                        Err(e) => core.finish_failed(&spec, e),
                    }
                });
            }
        }
        Ok(out)
    }

    fn ensure_leases(self: &Arc<Self>, class: &Arc<Class>) {
        self.watch_nodes();
        let queued = class.queue.lock().unwrap().len();
        loop {
            let cur = class.leases.load(Ordering::SeqCst);
            // Busy leases count too: a task queued behind a running one gets a
            // lease of its own instead of waiting (as Ray requests one per task).
            let busy = class.in_flight.load(Ordering::SeqCst);
            let per_lease = fixed_pipeline_depth().unwrap_or(1);
            // A lease whose worker handed tasks back (it is blocked or slow) takes no more
            // until it answers: the tasks need a lease besides it (CORE-9).
            let stalled = class.stalled.load(Ordering::SeqCst);
            let want =
                ((queued + busy).div_ceil(per_lease) + stalled).clamp(1, MAX_LEASES_PER_CLASS);
            if queued == 0 || cur >= want {
                return;
            }
            if class
                .leases
                .compare_exchange(cur, cur + 1, Ordering::SeqCst, Ordering::SeqCst)
                .is_ok()
            {
                let core = Arc::clone(self);
                let class = Arc::clone(class);
                self.rt.spawn(async move {
                    core.lease_loop(&class).await;
                    class.leases.fetch_sub(1, Ordering::SeqCst);
                    // Tasks may have arrived while this loop was ending.
                    core.ensure_leases(&class);
                });
            }
        }
    }

    async fn lease_loop(self: &Arc<Self>, class: &Arc<Class>) {
        use pb::request_worker_lease_reply::Outcome;
        let mut failures = 0u32;
        // Infeasible answers in a row: the first is asked again after a second before
        // anyone is told, as an agent's view of the cluster can lag a node that joined
        // a moment ago.
        let mut infeasible = 0u32;
        while !class.queue.lock().unwrap().is_empty() {
            let mut target = self.agent_address.clone();
            // The node of `target`, when known ("" never counts as dead, CORE-10).
            let mut target_node = self.node_id.clone();
            let mut grant_or_reject = false;
            if let Some((pg, index)) = &class.pg {
                // Ask the node that holds the bundle (an indexed bundle: only there).
                match self.bundle_agent(pg, *index).await {
                    Ok(Some(address)) => {
                        target = address;
                        target_node = String::new();
                        grant_or_reject = *index >= 0;
                    }
                    Ok(None) => continue, // not created yet: asked again after a wait
                    Err(reason) => {
                        let drained: Vec<Queued> = class.queue.lock().unwrap().drain(..).collect();
                        for q in drained {
                            self.finish_failed(
                                &q.spec,
                                err(Kind::Infeasible, reason.clone(), &q.spec.name),
                            );
                        }
                        return;
                    }
                }
            }
            let outcome = loop {
                let req = pb::RequestWorkerLeaseRequest {
                    request_id: tpuray_proto::new_request_id(),
                    job_id: self.job_id.clone(),
                    language: crate::foreign::language().into(),
                    runtime_env_hash: class.runtime_env_hash.clone(),
                    resources: class.resources.clone(),
                    label_selector: class.labels.clone(),
                    strategy: Some(class.strategy.clone()),
                    grant_or_reject,
                    queue_timeout_ms: 2000,
                    owner_address: self.address.clone(),
                };
                class.asking.fetch_add(1, Ordering::SeqCst);
                let reply = match self.agent_client(&target) {
                    Ok(mut c) => self
                        .unless_node_dies(&target_node, c.request_worker_lease(req))
                        .await
                        .map(|r| r.into_inner().outcome),
                    Err(e) => Err(tonic::Status::internal(e.to_string())),
                };
                class.asking.fetch_sub(1, Ordering::SeqCst);
                match reply {
                    Ok(Some(Outcome::Spillback(s))) if !grant_or_reject => {
                        target = s.address;
                        target_node = s.node_id;
                        grant_or_reject = true;
                    }
                    other => break other,
                }
            };
            match outcome {
                Ok(Some(Outcome::Granted(g))) => {
                    failures = 0;
                    infeasible = 0;
                    let broken = self.run_on_worker(class, &g, &target).await;
                    // A dead node's agent is not asked (it may be silent, CORE-10).
                    if !self.deaths.is_dead(&g.node_id)
                        && let Ok(mut c) = self.agent_client(&target)
                    {
                        let returned = c.return_worker_lease(pb::ReturnWorkerLeaseRequest {
                            request_id: tpuray_proto::new_request_id(),
                            lease_id: g.lease_id,
                            disconnect_worker: broken,
                        });
                        let _ = self.unless_node_dies(&g.node_id, returned).await;
                    }
                }
                Ok(Some(Outcome::Infeasible(_))) if infeasible == 0 => {
                    infeasible = 1;
                    tokio::time::sleep(Duration::from_secs(1)).await;
                }
                Ok(Some(Outcome::Infeasible(i))) => {
                    if !class.warned.swap(true, Ordering::SeqCst) {
                        // A cluster with an autoscaler (its report in the head's KV,
                        // tpuray_cli::autoscaler::{KV_NAMESPACE, STATUS_KEY}) may launch a
                        // node for it: say so, and do not suggest failing such work.
                        let autoscaled = match self.head_client() {
                            Ok(mut h) => h
                                .kv_get(pb::KvGetRequest {
                                    namespace: "autoscaler".into(),
                                    key: b"status".to_vec(),
                                })
                                .await
                                .is_ok_and(|r| r.into_inner().found),
                            Err(_) => false,
                        };
                        let then = if autoscaled {
                            "the cluster's autoscaler launches a node for it if a node type \
                             can hold it (tpuray status, section Autoscaler)"
                        } else if self.fail_on_infeasible {
                            "it stays pending until a node that fits joins"
                        } else {
                            "it stays pending until a node that fits joins (set \
                             TPURAY_FAIL_ON_INFEASIBLE=1 to fail instead)"
                        };
                        eprintln!(
                            "tpuray: warning: a task needing {:?} is infeasible: {}; {then}",
                            class.resources, i.reason,
                        );
                    }
                    if self.fail_on_infeasible {
                        let drained: Vec<Queued> = class.queue.lock().unwrap().drain(..).collect();
                        for q in drained {
                            self.finish_failed(
                                &q.spec,
                                err(Kind::Infeasible, i.reason.clone(), &q.spec.name),
                            );
                        }
                        return;
                    }
                    tokio::time::sleep(Duration::from_secs(1)).await;
                }
                Ok(Some(Outcome::SetupFailed(f))) => {
                    // AGENT-14: the environment could not be built on that node; what
                    // waits for it fails with the installer's message (Ray fails them
                    // with RuntimeEnvSetupError), and later submissions try again.
                    let drained: Vec<Queued> = class.queue.lock().unwrap().drain(..).collect();
                    for q in drained {
                        self.finish_failed(
                            &q.spec,
                            err(Kind::RuntimeEnvSetupFailed, f.message.clone(), &q.spec.name),
                        );
                    }
                    return;
                }
                Ok(Some(Outcome::Busy(_))) | Ok(Some(Outcome::Spillback(_))) | Ok(None) => {}
                Err(s) => {
                    failures += 1;
                    if failures % 50 == 1 {
                        eprintln!(
                            "tpuray: warning: cannot lease a worker from {target}: {}",
                            s.message()
                        );
                    }
                    tokio::time::sleep(Duration::from_millis(200)).await;
                }
            }
        }
    }

    /// The agent address of the node holding bundle `index` of group `pg` (-1: the local
    /// node when it holds one, else the first placed bundle's). `Ok(None)` after waiting up
    /// to a second for a group not created yet; `Err` when the group was removed or is
    /// unknown.
    async fn bundle_agent(&self, pg: &str, index: i32) -> Result<Option<String>, String> {
        crate::placement_group::created(pg).await?;
        let mut head = self.head_client().map_err(|e| e.to_string())?;
        let reply = head
            .get_placement_group(pb::GetPlacementGroupRequest {
                placement_group_id: pg.to_string(),
                wait_ready_ms: 1000,
                ..Default::default()
            })
            .await;
        let info = match reply {
            Ok(r) => r.into_inner().placement_group.unwrap_or_default(),
            Err(s) if s.code() == tonic::Code::NotFound => return Err(s.message().to_string()),
            Err(_) => {
                tokio::time::sleep(Duration::from_millis(200)).await;
                return Ok(None);
            }
        };
        if info.state == pb::PlacementGroupState::Removed as i32 {
            return Err(format!("placement group {pg} was removed ({})", info.removal_reason));
        }
        if index >= info.bundle_node_addresses.len() as i32 {
            return Err(format!(
                "bundle index {index} is out of range for placement group {pg} (it has {} bundles)",
                info.bundle_node_addresses.len()
            ));
        }
        let placed = |i: usize| Some(&info.bundle_node_addresses[i]).filter(|a| !a.is_empty());
        Ok(match usize::try_from(index) {
            Ok(i) => placed(i).cloned(),
            Err(_) => info
                .bundle_node_ids
                .iter()
                .position(|n| *n == self.node_id)
                .and_then(placed)
                .or_else(|| (0..info.bundle_node_addresses.len()).find_map(placed))
                .cloned(),
        })
    }

    /// Pushes queued tasks to one leased worker, pipelined, until the queue
    /// is empty. Returns true when the worker broke.
    async fn run_on_worker(
        self: &Arc<Self>,
        class: &Arc<Class>,
        g: &pb::request_worker_lease_reply::Granted,
        agent_address: &str,
    ) -> bool {
        let Ok(client) = self.worker_client(&g.worker_address) else {
            return true;
        };
        // Each pushed task's answer (from a push of one task, or of a batch), as it comes.
        let (done_tx, mut done_rx) = tokio::sync::mpsc::unbounded_channel::<Pushed>();
        let mut tasks_in_flight = 0usize;
        let mut broken = false;
        // A task came back unrun: its worker is blocked or slow, so nothing more goes to
        // it until what it holds is answered (else the same tasks would bounce back).
        let mut handing_back = false;
        loop {
            if tasks_in_flight == 0 && handing_back {
                handing_back = false;
                class.stalled.fetch_sub(1, Ordering::SeqCst);
            }
            let depth = if handing_back { 1 } else { class.depth() };
            // A deep pipeline is topped up once a quarter of it is free, so answers that
            // come one by one still go out as batches, not a push per answer.
            let top_up = if tasks_in_flight == 0 { 1 } else { (depth / 4).max(1) };
            while !broken && tasks_in_flight + top_up <= depth {
                let batch: Vec<Queued> = {
                    let mut queue = class.queue.lock().unwrap();
                    let most = (depth - tasks_in_flight).min(PUSH_BATCH_MAX).min(queue.len());
                    let mut bytes = 0;
                    let n = queue
                        .iter()
                        .take(most)
                        .take_while(|q| {
                            let first = bytes == 0;
                            bytes += prost::Message::encoded_len(&q.spec);
                            first || bytes <= PUSH_BATCH_BYTES
                        })
                        .count();
                    queue.drain(..n).collect()
                };
                if batch.is_empty() {
                    break;
                }
                {
                    let mut running = self.running.lock().unwrap();
                    for q in &batch {
                        running.insert(
                            q.spec.task_id.clone(),
                            Running {
                                worker_address: g.worker_address.clone(),
                                cancelled: false,
                                actor: false,
                            },
                        );
                    }
                }
                tasks_in_flight += batch.len();
                class.in_flight.fetch_add(batch.len(), Ordering::SeqCst);
                self.rt.spawn(push_batch(
                    Arc::clone(self),
                    g.node_id.clone(),
                    client.clone(),
                    batch,
                    done_tx.clone(),
                ));
            }
            if tasks_in_flight == 0 {
                if broken {
                    break;
                }
                // Keep the lease a moment for the next task of this class
                // (a driver calling in a loop), as Ray's leases linger.
                let queued = class.queued.notified();
                if !class.queue.lock().unwrap().is_empty() {
                    continue;
                }
                if tokio::time::timeout(LEASE_LINGER, queued).await.is_err() {
                    break;
                }
                continue;
            }
            let Some(first) = done_rx.recv().await else { break };
            // Every answer already here is handled before the next push.
            let mut next = Some(first);
            while let Some((q, result, took)) = next.take() {
                next = done_rx.try_recv().ok();
                tasks_in_flight -= 1;
                class.in_flight.fetch_sub(1, Ordering::SeqCst);
                match result {
                    Ok(reply) if reply.not_run => {
                        if !handing_back {
                            handing_back = true;
                            class.stalled.fetch_add(1, Ordering::SeqCst);
                        }
                        self.given_back(class, q);
                    }
                    Ok(reply) => {
                        class.note_push(took);
                        // The worker exits after this (its task's max_calls ran out):
                        // nothing more goes to it, and its lease goes back.
                        broken |= reply.worker_exiting;
                        self.complete(class, q, reply);
                    }
                    Err(status) => {
                        broken = true;
                        let detail = format!(
                            "worker {} at {}: {}",
                            g.worker_id,
                            g.worker_address,
                            status.message()
                        );
                        self.worker_died(class, q, &detail, &g.node_id, agent_address);
                    }
                }
            }
        }
        if handing_back {
            class.stalled.fetch_sub(1, Ordering::SeqCst);
        }
        broken
    }

    /// Finishes a task that was cancelled while it ran; true if it was.
    fn finish_if_cancelled(&self, spec: &pb::TaskSpec) -> bool {
        let running = self.running.lock().unwrap().remove(&spec.task_id);
        if running.is_some_and(|r| r.cancelled) {
            self.finish_failed(spec, err(Kind::Cancelled, "cancelled", &spec.name));
            return true;
        }
        false
    }

    /// Queues a task the worker handed back unrun (CORE-9) again, first in line, without
    /// counting an attempt; the class pushes one task at a time for a while.
    fn given_back(self: &Arc<Self>, class: &Arc<Class>, q: Queued) {
        if self.finish_if_cancelled(&q.spec) {
            return;
        }
        class
            .shallow_until_ms
            .store(now_ms() + SHALLOW_AFTER_GIVE_BACK.as_millis() as u64, Ordering::Relaxed);
        class.queue.lock().unwrap().push_front(q);
        class.queued.notify_one();
        self.ensure_leases(class);
    }

    /// Queues a task again for its next attempt (CORE-5).
    fn retry(self: &Arc<Self>, class: &Arc<Class>, mut q: Queued, detail: &str) {
        q.retries_left -= 1;
        q.spec.attempt += 1;
        self.event(&q.spec, "RETRYING", detail);
        class.queue.lock().unwrap().push_back(q);
        class.queued.notify_one();
        self.ensure_leases(class);
    }

    /// The worker running `q` (leased from the agent at `agent_address` on `node_id`)
    /// broke its connection: the task is retried while it has retries, else it fails
    /// with the cause [`Core::failure_cause`] finds.
    fn worker_died(
        self: &Arc<Self>,
        class: &Arc<Class>,
        q: Queued,
        detail: &str,
        node_id: &str,
        agent_address: &str,
    ) {
        if self.finish_if_cancelled(&q.spec) {
            return;
        }
        if q.retries_left != 0 {
            self.retry(class, q, detail);
            return;
        }
        let core = Arc::clone(self);
        let (detail, node_id, agent) =
            (detail.to_string(), node_id.to_string(), agent_address.to_string());
        self.rt.spawn(async move {
            let e = match core.failure_cause(&node_id, &agent).await {
                Some(node_dead) => err(Kind::NodeDied, node_dead, &q.spec.name),
                None => err(Kind::WorkerDied, format!("{detail} (no retries left)"), &q.spec.name),
            };
            core.finish_failed(&q.spec, e);
        });
    }

    /// Why a worker on `node_id` broke, as Ray's owner decides it: the node's agent is
    /// asked (Ray asks the raylet for the task's failure cause); when the head already
    /// declared the node dead, or its agent does not answer within
    /// [`FAILURE_CAUSE_TIMEOUT`], the node died (the message, for `NodeDiedError`);
    /// otherwise only the worker did (`None`). Ray's rule:
    /// `GetErrorInfoFromGetTaskFailureCauseReply`, ray `src/ray/core_worker/`.
    async fn failure_cause(&self, node_id: &str, agent_address: &str) -> Option<String> {
        let ip = agent_address.rsplit_once(':').map_or(agent_address, |(h, _)| h);
        // The first sentence as Ray 2.60 words it (scripts match on it).
        let dead = format!(
            "Task failed because the node it was running on is dead or unavailable. \
             Node IP: {ip}, node ID: {node_id}. Its node agent did not answer when the \
             worker's connection broke; `tpuray list nodes` shows whether the head \
             declared it dead."
        );
        if self.deaths.is_dead(node_id) {
            return Some(dead);
        }
        let asked = async {
            let mut c = self.agent_client(agent_address).ok()?;
            let mut req = tonic::Request::new(pb::GetNodeInfoRequest {});
            req.set_timeout(FAILURE_CAUSE_TIMEOUT);
            c.get_node_info(req).await.ok()
        };
        match tokio::time::timeout(FAILURE_CAUSE_TIMEOUT, asked).await {
            Ok(Some(_)) if !self.deaths.is_dead(node_id) => None,
            _ => Some(dead),
        }
    }

    fn complete(self: &Arc<Self>, class: &Arc<Class>, q: Queued, mut reply: pb::PushTaskReply) {
        if self.finish_if_cancelled(&q.spec) {
            return;
        }
        if let Some(e) = reply.error.take() {
            let app = e.kind == Kind::Application as i32 && !e.no_retry;
            if app && q.retry_exceptions && q.retries_left != 0 {
                self.retry(class, q, &e.message);
                return;
            }
            self.finish_failed(&q.spec, e);
            return;
        }
        // CORE-6: stored returns keep what it takes to run the task again.
        let stored = reply
            .returns
            .iter()
            .any(|r| matches!(r.data, Some(pb::return_object::Data::Location(_))));
        if stored && !q.spec.streaming && q.retries_left != 0 {
            let lineage = Arc::new(Lineage {
                spec: q.spec,
                class: Arc::clone(class),
                retries_left: q.retries_left,
                retry_exceptions: q.retry_exceptions,
                pins: q.pins,
            });
            self.finish_ok_with(&lineage.spec, reply, Some(Arc::clone(&lineage)));
        } else {
            self.finish_ok_with(&q.spec, reply, None);
        }
    }

    fn finish_ok(&self, spec: &pb::TaskSpec, reply: pb::PushTaskReply) {
        self.finish_ok_with(spec, reply, None);
    }

    fn finish_ok_with(
        &self,
        spec: &pb::TaskSpec,
        reply: pb::PushTaskReply,
        lineage: Option<Arc<Lineage>>,
    ) {
        self.actor_call_done(spec);
        let (node, worker) = (reply.node_id, reply.worker_id);
        let returns = reply.returns;
        if let (Some(first), false) = (spec.return_ids.first(), reply.nested_in_return.is_empty()) {
            let nested: Vec<(String, String)> = reply
                .nested_in_return
                .into_iter()
                .map(|r| (r.object_id, r.owner_address))
                .collect();
            // Counted as covers before the object can be freed (on_freed uncovers them).
            self.cover_nested(&nested);
            let mut objs = self.objects.lock().unwrap();
            match objs.get_mut(first) {
                Some(o) => {
                    // A run again (CORE-6) registered the same `#ret` key anew: the refs
                    // of the earlier run's value are only no longer covered by it.
                    let old = std::mem::replace(&mut o.nested, nested);
                    drop(objs);
                    for (nid, owner) in old {
                        if owner != self.address {
                            self.uncover(&nid, &owner);
                        }
                    }
                }
                None => {
                    drop(objs);
                    // Already freed by the caller: release at once.
                    let o = Owned {
                        state: ObjState::Pending,
                        lineage: None,
                        pulls: None,
                        refs: 0,
                        task_id: None,
                        borrowers: Default::default(),
                        nested,
                        pins: vec![],
                    };
                    self.on_freed(first, o);
                }
            }
        }
        for r in returns {
            let id = r.object_id.clone();
            let state = ObjState::from_return(r);
            let keep = matches!(state, ObjState::Stored { .. }).then(|| lineage.clone()).flatten();
            self.set_state_with(&id, state, keep);
        }
        if spec.streaming {
            self.generators
                .lock()
                .unwrap()
                .entry(spec.task_id.clone())
                .and_modify(|g| g.finished = true);
            self.objects_changed.notify_waiters();
        }
        self.event_at(spec, "FINISHED", "", &node, &worker);
    }

    fn finish_failed(&self, spec: &pb::TaskSpec, mut e: pb::TaskError) {
        self.actor_call_done(spec);
        if e.function_name.is_empty() {
            e.function_name = spec.name.clone();
        }
        for id in &spec.return_ids {
            self.set_state(id, ObjState::failed(e.clone()));
        }
        if spec.streaming {
            if let Some(g) = self.generators.lock().unwrap().get_mut(&spec.task_id) {
                g.finished = true;
                g.error = Some(e.clone());
            }
            self.objects_changed.notify_waiters();
        }
        let node = e.node_id.clone();
        self.event_at(spec, "FAILED", &e.message, &node, "");
    }

    /// Owner side of `ReportGeneratorItem`.
    pub(crate) fn generator_item(&self, task_id: &str, index: u64, item: pb::ReturnObject) {
        let mut gens = self.generators.lock().unwrap();
        let Some(g) = gens.get_mut(task_id) else { return };
        if (index as usize) < g.items.len() {
            return; // a retried task re-reporting an item we have
        }
        let state = ObjState::from_return(item.clone());
        // Held by the generator until the consumer takes its ref.
        self.objects.lock().unwrap().insert(
            item.object_id.clone(),
            Box::new(Owned {
                state,
                lineage: None,
                pulls: None,
                refs: 1,
                task_id: None,
                borrowers: Default::default(),
                nested: vec![],
                pins: vec![],
            }),
        );
        g.items.push(item.object_id);
        drop(gens);
        self.objects_changed.notify_waiters();
    }

    pub(crate) fn streaming_item_id(task_id: &str, index: u64) -> String {
        return_id(task_id, index)
    }

    async fn next_item(
        &self,
        task_id: &str,
        function: &str,
        index: u64,
    ) -> Option<Result<RawRef, Error>> {
        loop {
            let notified = self.objects_changed.notified();
            {
                let gens = self.generators.lock().unwrap();
                let g = gens.get(task_id)?;
                if let Some(id) = g.items.get(index as usize) {
                    // The generator's hold becomes the consumer's ref.
                    return Some(Ok(RawRef::adopt(id.clone(), self.address.clone())));
                }
                if g.finished {
                    return g.error.as_ref().map(|e| Err(Error::from_wire(e, function)));
                }
            }
            notified.await;
        }
    }

    /// As [`Core::next_item`], but a failure comes as a ref (Ray 2.60's streaming
    /// generators): the item after the last one produced is a ref whose `get` fails with
    /// the task's error, and the one after that is `None`.
    async fn next_item_ref(&self, task_id: &str, function: &str, index: u64) -> Option<RawRef> {
        match self.next_item(task_id, function, index).await? {
            Ok(r) => Some(r),
            Err(_) => {
                let e = {
                    let gens = self.generators.lock().unwrap();
                    let g = gens.get(task_id)?;
                    if index as usize != g.items.len() {
                        return None; // the error was handed out already
                    }
                    g.error.clone()?
                };
                let id = Self::streaming_item_id(task_id, index);
                self.register_owned(&id, ObjState::failed(e), None);
                Some(RawRef::adopt(id, self.address.clone()))
            }
        }
    }

    /// Cancels the task that makes `id` (see [`Core::cancel_task`]). A ref another
    /// process owns (`owner`, its address) is cancelled by its owner: the request goes
    /// there, as Ray's borrower forwards it (`CancelRemoteTask`). A ref no task makes (a
    /// `put`) is left alone.
    ///
    /// # Errors
    /// As [`Core::cancel_task`], also when the owner refused; the owner cannot be reached.
    pub(crate) async fn cancel(
        self: &Arc<Self>,
        id: &str,
        owner: &str,
        force: bool,
        recursive: bool,
    ) -> Result<(), Error> {
        let task_id = self.objects.lock().unwrap().get(id).and_then(|o| o.task_id.clone());
        if let Some(task_id) = task_id {
            return self.cancel_task(&task_id, force, recursive).await;
        }
        if owner.is_empty() || owner == self.address {
            return Ok(());
        }
        let mut c = self.worker_client(owner).map_err(|e| Error::Cluster(e.to_string()))?;
        let reply = c
            .cancel_owned(pb::CancelOwnedRequest { object_id: id.to_string(), force, recursive })
            .await
            .map_err(|s| {
                Error::Cluster(format!(
                    "cannot cancel object {id}: its owner at {owner} did not answer: {}",
                    s.message()
                ))
            })?
            .into_inner();
        if reply.refused.is_empty() { Ok(()) } else { Err(Error::Cluster(reply.refused)) }
    }

    /// Cancels task (or actor call) `task_id` of this process (Ray's `cancel`): queued
    /// here, it never runs; running, its worker is asked to stop it (CORE-12: a Python
    /// task gets `KeyboardInterrupt`, an async actor method's coroutine is cancelled, a
    /// Rust task or sync actor method sees [`crate::is_cancelled`]), or with `force` the
    /// worker exits; either way its `get` fails with `Cancelled` and it is not retried.
    /// With `recursive`, the worker cancels the tasks it submitted too. A finished task
    /// is left as it is.
    ///
    /// # Errors
    /// `force` for an actor call (Ray: "use ray.kill"); the worker cannot be reached.
    pub(crate) async fn cancel_task(
        self: &Arc<Self>,
        task_id: &str,
        force: bool,
        recursive: bool,
    ) -> Result<(), Error> {
        if force {
            // An actor call not finished yet (Ray refuses force for those; a finished
            // one is left alone either way).
            let conns: Vec<Arc<ActorConn>> =
                self.actors.lock().unwrap().values().cloned().collect();
            if conns.iter().any(|c| c.pending.lock().unwrap().contains(task_id)) {
                return Err(Error::Cluster(FORCE_ACTOR.into()));
            }
        }
        let classes: Vec<Arc<Class>> = self.classes.lock().unwrap().values().cloned().collect();
        for c in classes {
            let mut q = c.queue.lock().unwrap();
            if let Some(pos) = q.iter().position(|t| t.spec.task_id == task_id) {
                let t = q.remove(pos).expect("position is valid");
                drop(q);
                self.finish_failed(
                    &t.spec,
                    err(Kind::Cancelled, "cancelled before it ran", &t.spec.name),
                );
                return Ok(());
            }
        }
        let target = {
            let mut running = self.running.lock().unwrap();
            match running.get_mut(task_id) {
                Some(r) if r.actor && force => return Err(Error::Cluster(FORCE_ACTOR.into())),
                Some(r) => {
                    r.cancelled = true;
                    Some(r.worker_address.clone())
                }
                None => None,
            }
        };
        if let Some(addr) = target {
            let mut c = self.worker_client(&addr).map_err(|e| Error::Cluster(e.to_string()))?;
            c.cancel_task(pb::CancelTaskRequest { task_id: task_id.to_string(), force, recursive })
                .await
                .map_err(|s| Error::Cluster(s.message().to_string()))?;
        }
        Ok(())
    }

    /// Cancels what task `parent` (running here) submitted, and what those submitted
    /// (`cancel(recursive=True)` reaching this worker). Force is not passed on to actor
    /// calls (Ray ignores it for child actor tasks too).
    pub(crate) fn cancel_children(self: &Arc<Self>, parent: &str, force: bool) {
        let children = self.children.lock().unwrap().get(parent).cloned().unwrap_or_default();
        for child in children {
            let core = Arc::clone(self);
            self.rt.spawn(async move {
                let actor = core.running.lock().unwrap().get(&child).is_some_and(|r| r.actor);
                let _ = core.cancel_task(&child, force && !actor, true).await;
            });
        }
    }

    /// Forgets what task `parent` submitted (it ended).
    pub(crate) fn forget_children(&self, parent: &str) {
        self.children.lock().unwrap().remove(parent);
    }

    /// Whether the next item of streaming task `task_id` after `index` items is there,
    /// or the stream ended (what `wait` on a generator answers). Unknown tasks: true.
    pub(crate) fn generator_ready(&self, task_id: &str, index: u64) -> bool {
        let gens = self.generators.lock().unwrap();
        gens.get(task_id).is_none_or(|g| g.items.len() as u64 > index || g.finished)
    }

    /// This process's unfinished calls to `actor_id` (CORE-13).
    pub(crate) fn pending_actor_calls(&self, actor_id: &str) -> usize {
        let conn = self.actors.lock().unwrap().get(actor_id).cloned();
        conn.map(|c| c.pending.lock().unwrap().len()).unwrap_or(0)
    }

    /// An actor call ended (CORE-13): it no longer counts against `max_pending_calls`.
    fn actor_call_done(&self, spec: &pb::TaskSpec) {
        if spec.actor_id.is_empty() || spec.actor_creation {
            return;
        }
        let conn = self.actors.lock().unwrap().get(&spec.actor_id).cloned();
        if let Some(c) = conn {
            c.pending.lock().unwrap().remove(&spec.task_id);
        }
    }

    // ---- actors ----

    pub(crate) async fn create_actor(
        self: &Arc<Self>,
        class: &str,
        args: Vec<Arg>,
        opts: &crate::options::ActorOptions,
    ) -> Result<crate::actor::ActorHandle, Error> {
        self.create_actor_as(class, class, args, opts).await
    }

    /// Creates an actor of class `class` (the worker's key for it: a registry name, or a
    /// function-table key for Python) shown as `display`.
    pub(crate) async fn create_actor_as(
        self: &Arc<Self>,
        class: &str,
        display: &str,
        args: Vec<Arg>,
        opts: &crate::options::ActorOptions,
    ) -> Result<crate::actor::ActorHandle, Error> {
        let captured =
            captured_group().filter(|_| opts.scheduling == Scheduling::Default).map(|pg| {
                crate::options::ActorOptions {
                    scheduling: Scheduling::PlacementGroup {
                        placement_group_id: pg,
                        bundle_index: -1,
                    },
                    capture_child_tasks: true,
                    ..opts.clone()
                }
            });
        let opts = captured.as_ref().unwrap_or(opts);
        let mut spec = self.base_spec(class, Some(display), 0, false);
        spec.actor_creation = true;
        spec.function = Some(pb::FunctionDescriptor {
            language: crate::foreign::language().into(),
            name: class.into(),
            class_name: display.into(),
        });
        spec.max_concurrency = opts.max_concurrency.max(1);
        spec.runtime_env_hash = opts.runtime_env_hash.clone();
        for (group, limit) in &opts.concurrency_groups {
            if group.is_empty() || *limit == 0 {
                return Err(Error::Cluster(format!(
                    "concurrency group {group:?} of actor {display}: a group needs a name and a max_concurrency of 1 or more (got {limit})"
                )));
            }
        }
        for (method, group) in &opts.method_groups {
            if !opts.concurrency_groups.contains_key(group) {
                return Err(Error::Cluster(format!(
                    "method {method} of actor {display} runs in concurrency group {group:?}, which the actor does not define (defined: {:?})",
                    opts.concurrency_groups.keys().collect::<Vec<_>>()
                )));
            }
        }
        spec.concurrency_groups =
            opts.concurrency_groups.iter().map(|(k, v)| (k.clone(), *v)).collect();
        spec.method_groups =
            opts.method_groups.iter().map(|(k, v)| (k.clone(), v.clone())).collect();
        spec.capture_child_tasks = opts.capture_child_tasks;
        if let Scheduling::PlacementGroup { placement_group_id, .. } = &opts.scheduling {
            spec.placement_group_id = placement_group_id.clone();
        }
        let (args, _pins) =
            self.resolve_args(args, class).await.map_err(|e| Error::from_wire(&e, class))?;
        spec.args = args;
        let mut resources: HashMap<String, f64> =
            opts.resources.iter().map(|(k, v)| (k.clone(), *v)).collect();
        if let Some(c) = opts.num_cpus {
            resources.insert("CPU".into(), c);
        }
        if opts.num_gpus > 0.0 {
            resources.insert("GPU".into(), opts.num_gpus);
        }
        // The creation task carries what the actor asked for, explicitly (Ray's
        // `get_assigned_resources` in its methods; the head and agent account with
        // the request's `resources`, which the placement default is added to).
        spec.resources = resources.clone();
        let labels = tpuray_scheduler::parse_label_selector(&opts.label_selector)
            .map_err(|e| Error::Cluster(format!("label_selector: {e}")))?;
        let mut head = self.head_client().map_err(|e| Error::Cluster(e.to_string()))?;
        let reply = head
            .create_actor(pb::CreateActorRequest {
                request_id: tpuray_proto::new_request_id(),
                job_id: self.job_id.clone(),
                name: opts.name.clone().unwrap_or_default(),
                namespace: opts.namespace.clone().unwrap_or_default(),
                class_name: display.to_string(),
                resources,
                max_restarts: opts.max_restarts,
                detached: opts.detached,
                label_selector: tpuray_proto::convert::labels_to_proto(&labels),
                strategy: Some(opts.scheduling.to_proto()),
                get_if_exists: opts.get_if_exists,
                creation_task: prost::Message::encode_to_vec(&spec),
            })
            .await
            .map_err(|s| Error::Cluster(format!("creating actor {display}: {}", s.message())))?
            .into_inner();
        let a = reply.actor.unwrap_or_default();
        Ok(crate::actor::ActorHandle {
            actor_id: a.actor_id,
            class: display.to_string(),
            name: a.name,
            max_task_retries: opts.max_task_retries,
            max_pending_calls: opts.max_pending_calls,
        })
    }

    /// Submits an actor method call through the actor's ordered sender (CORE-4).
    ///
    /// # Errors
    /// [`Error::PendingCallsLimitExceeded`] when this process already has the handle's
    /// `max_pending_calls` unfinished calls to the actor (CORE-13: refused here, before
    /// anything is registered or sent).
    pub(crate) fn call_actor(
        self: &Arc<Self>,
        handle: &crate::actor::ActorHandle,
        method: &str,
        args: Vec<Arg>,
        streaming: bool,
        num_returns: u32,
        call: &crate::options::CallOptions,
    ) -> Result<pb::TaskSpec, Error> {
        let display = format!("{}.{method}", short_class(&handle.class));
        let conn = self.actor_conn(&handle.actor_id);
        if handle.max_pending_calls >= 0 {
            let pending = conn.pending.lock().unwrap().len();
            if pending >= handle.max_pending_calls as usize {
                return Err(Error::PendingCallsLimitExceeded {
                    function: display,
                    message: format!(
                        "the call {}.{method} could not be submitted to actor {}: {pending} of its calls from this process are unfinished (max_pending_calls={})",
                        short_class(&handle.class),
                        handle.actor_id,
                        handle.max_pending_calls
                    ),
                });
            }
        }
        let mut spec = self.base_spec(
            method,
            Some(&display),
            if streaming { 0 } else { num_returns },
            streaming,
        );
        spec.actor_id = handle.actor_id.clone();
        spec.concurrency_group = call.concurrency_group.clone();
        spec.function = Some(pb::FunctionDescriptor {
            language: crate::foreign::language().into(),
            name: method.into(),
            class_name: handle.class.clone(),
        });
        conn.pending.lock().unwrap().insert(spec.task_id.clone());
        self.register_submitted(&spec);
        // Resolve arguments at once, in parallel with earlier calls; the
        // sender awaits them in submission order.
        let (tx, rx) = tokio::sync::oneshot::channel();
        match Self::resolve_args_now(args) {
            Ok(resolved) => {
                let _ = tx.send(Ok(resolved));
            }
            Err(args) => {
                let core = Arc::clone(self);
                self.rt.spawn(async move {
                    let _ = tx.send(core.resolve_args(args, &display).await);
                });
            }
        }
        let retries = call.max_task_retries.unwrap_or(handle.max_task_retries);
        let _ = conn.tx.send((spec.clone(), rx, retries, call.retry_exceptions));
        Ok(spec)
    }

    fn actor_conn(self: &Arc<Self>, actor_id: &str) -> Arc<ActorConn> {
        let mut actors = self.actors.lock().unwrap();
        if let Some(c) = actors.get(actor_id) {
            return Arc::clone(c);
        }
        let (tx, rx) = tokio::sync::mpsc::unbounded_channel();
        let conn = Arc::new(ActorConn { tx, pending: Mutex::new(Default::default()) });
        actors.insert(actor_id.to_string(), Arc::clone(&conn));
        let core = Arc::clone(self);
        let id = actor_id.to_string();
        self.rt.spawn(async move { core.actor_sender(id, rx).await });
        conn
    }

    /// Waits until the actor is ALIVE on a node not known dead (CORE-10): (worker
    /// address, incarnation, node id).
    /// The error of a call lost mid-call on incarnation `inc` (its `num_restarts`) of
    /// `actor_id` with no retries left, as Ray's actor submitter decides it: the actor is
    /// dead by the head's record (waited for up to [`ACTOR_DEATH_INFO_WAIT`]) →
    /// `ActorDied`; restarting, restarted, or no news by then → `ActorUnavailable` (the
    /// call may or may not have run). Ray: `actor_task_submitter.cc`, the push-failure
    /// path and `timeout_ms_task_wait_for_death_info`.
    async fn lost_call_error(
        &self,
        actor_id: &str,
        inc: u32,
        status: &tonic::Status,
        function: &str,
    ) -> pb::TaskError {
        let why = tpuray_proto::client::status_chain(status);
        let deadline = Instant::now() + ACTOR_DEATH_INFO_WAIT;
        let mut dead = None;
        if let Ok(mut head) = self.head_client() {
            while Instant::now() < deadline {
                let mut req = Request::new(pb::GetActorRequest {
                    actor_id: actor_id.to_string(),
                    ..Default::default()
                });
                req.set_timeout(ACTOR_DEATH_INFO_WAIT);
                match head.get_actor(req).await.map(|r| r.into_inner().actor) {
                    Ok(Some(a)) if a.state == pb::ActorState::Dead as i32 => {
                        dead = Some(a.death_cause);
                        break;
                    }
                    Ok(Some(a))
                        if a.state == pb::ActorState::Restarting as i32
                            || a.state == pb::ActorState::PendingCreation as i32
                            || a.num_restarts != inc =>
                    {
                        break;
                    }
                    Err(s) if s.code() == tonic::Code::NotFound => {
                        dead = Some(s.message().to_string());
                        break;
                    }
                    _ => tokio::time::sleep(Duration::from_millis(100)).await,
                }
            }
        }
        match dead {
            Some(cause) => err(
                Kind::ActorDied,
                format!("the actor died while running the call ({why}): {cause}"),
                function,
            ),
            None => err(
                Kind::ActorUnavailable,
                format!(
                    "The actor {actor_id} is unavailable: The actor is temporarily \
                     unavailable: {why}. The task may or may not have been executed on the actor."
                ),
                function,
            ),
        }
    }

    async fn wait_actor_alive(&self, actor_id: &str) -> Result<(String, u32, String), String> {
        let mut head = self.head_client().map_err(|e| e.to_string())?;
        let mut warned = false;
        let started = Instant::now();
        loop {
            let mut req = Request::new(pb::GetActorRequest {
                actor_id: actor_id.to_string(),
                wait_alive_ms: 5_000,
                ..Default::default()
            });
            req.set_timeout(Duration::from_secs(30));
            let a = match head.get_actor(req).await {
                Ok(r) => r.into_inner().actor.unwrap_or_default(),
                Err(s) if s.code() == tonic::Code::NotFound => return Err(s.message().to_string()),
                Err(_) => {
                    tokio::time::sleep(Duration::from_millis(200)).await;
                    continue;
                }
            };
            if a.state == pb::ActorState::Alive as i32 {
                if self.deaths.is_dead(&a.node_id) {
                    // The head's record is about to move it (its node died).
                    tokio::time::sleep(Duration::from_millis(100)).await;
                    continue;
                }
                return Ok((a.worker_address, a.num_restarts, a.node_id));
            }
            if a.state == pb::ActorState::Dead as i32 {
                return Err(a.death_cause);
            }
            if !warned && started.elapsed() > Duration::from_secs(5) && !a.pending_reason.is_empty()
            {
                warned = true;
                eprintln!(
                    "tpuray: warning: actor {} is not placed yet: {}",
                    a.class_name, a.pending_reason
                );
            }
        }
    }

    async fn actor_sender(
        self: Arc<Self>,
        actor_id: String,
        mut rx: tokio::sync::mpsc::UnboundedReceiver<(pb::TaskSpec, ResolvedArgs, i32, bool)>,
    ) {
        self.watch_nodes();
        let current: Arc<Mutex<Option<(String, u32, String)>>> = Arc::new(Mutex::new(None));
        // Calls that never reached the actor (connection refused: it died or
        // moved) come back here and go out again, before newer calls.
        // (call, pinned args, delivery attempts, retries left after the actor dies
        // mid-call or the method raises, retry on the method's exceptions)
        let (retry_tx, mut retry_rx) =
            tokio::sync::mpsc::unbounded_channel::<(pb::TaskSpec, Vec<RawRef>, u32, i32, bool)>();
        let mut incarnation: Option<u32> = None;
        let mut seq = 0u64;
        loop {
            let (mut spec, pins, attempts, retries, retry_exceptions) = tokio::select! {
                biased;
                Some(r) = retry_rx.recv() => r,
                next = rx.recv() => {
                    let Some((mut spec, resolved, retries, retry_exceptions)) = next else { return };
                    match resolved.await {
                        Ok(Ok((args, pins))) => {
                            spec.args = args;
                            (spec, pins, 0, retries, retry_exceptions)
                        }
                        Ok(Err(e)) => {
                            self.finish_failed(&spec, e);
                            continue;
                        }
                        Err(_) => continue,
                    }
                }
            };
            if attempts > 0 {
                tokio::time::sleep(Duration::from_millis(100 * u64::from(attempts.min(5)))).await;
            }
            let known = current.lock().unwrap().clone();
            let (address, inc, node_id) = match known {
                Some(a) => a,
                None => match self.wait_actor_alive(&actor_id).await {
                    Ok(a) => {
                        *current.lock().unwrap() = Some(a.clone());
                        a
                    }
                    Err(cause) => {
                        let e =
                            err(Kind::ActorDied, format!("the actor is dead: {cause}"), &spec.name);
                        self.finish_failed(&spec, e);
                        continue;
                    }
                },
            };
            if incarnation != Some(inc) {
                incarnation = Some(inc);
                seq = 0;
            }
            spec.sequence_no = seq;
            seq += 1;
            let core = Arc::clone(&self);
            let current = Arc::clone(&current);
            let retry_tx = retry_tx.clone();
            let actor_id = actor_id.clone();
            self.running.lock().unwrap().insert(
                spec.task_id.clone(),
                Running { worker_address: address.clone(), cancelled: false, actor: true },
            );
            self.rt.spawn(async move {
                let result = match core.worker_client(&address) {
                    // CORE-10: never sent to a dead node: resent to the restart.
                    Ok(_) if core.deaths.is_dead(&node_id) => Err(tonic::Status::unavailable(
                        format!("not sent: {}; tcp connect error", node_died(&node_id).message()),
                    )),
                    Ok(mut c) => {
                        let push = c.push_task(pb::PushTaskRequest { spec: Some(spec.clone()) });
                        // Lost with its node mid-call: as a lost connection.
                        core.unless_node_dies(&node_id, push).await
                    }
                    Err(e) => Err(tonic::Status::internal(e.to_string())),
                };
                let cancelled =
                    core.running.lock().unwrap().remove(&spec.task_id).is_some_and(|r| r.cancelled);
                match result {
                    // CORE-12: a call cancelled while it ran is not retried, and its
                    // get fails with Cancelled (Ray's TaskCancelledError).
                    Ok(_) if cancelled => {
                        core.finish_failed(&spec, err(Kind::Cancelled, "cancelled", &spec.name));
                    }
                    Ok(reply) => {
                        let mut reply = reply.into_inner();
                        match reply.error.take() {
                            // The method raised: with retry_exceptions (Ray's, per method
                            // or per call) it runs again while max_task_retries lasts.
                            Some(e)
                                if retry_exceptions
                                    && retries != 0
                                    && !e.no_retry
                                    && e.kind == Kind::Application as i32 =>
                            {
                                spec.attempt += 1;
                                let left = if retries < 0 { retries } else { retries - 1 };
                                let _ = retry_tx.send((spec, pins, 0, left, retry_exceptions));
                            }
                            Some(e) => core.finish_failed(&spec, e),
                            None => core.finish_ok(&spec, reply),
                        }
                    }
                    Err(status) => {
                        *current.lock().unwrap() = None;
                        let never_delivered = is_connect_error(&status);
                        // About 60 s of re-resolving covers the head's death
                        // timeout plus a restart elsewhere.
                        if never_delivered && attempts < 120 {
                            let _ = retry_tx.send((
                                spec,
                                pins,
                                attempts + 1,
                                retries,
                                retry_exceptions,
                            ));
                            return;
                        }
                        // Died mid-call: Ray's max_task_retries sends it again to the
                        // restarted actor (which fails it if the actor stays dead).
                        if !never_delivered && retries != 0 {
                            spec.attempt += 1;
                            let left = if retries < 0 { retries } else { retries - 1 };
                            let _ = retry_tx.send((spec, pins, 1, left, retry_exceptions));
                            return;
                        }
                        let e = core.lost_call_error(&actor_id, inc, &status, &spec.name).await;
                        core.finish_failed(&spec, e);
                    }
                }
            });
        }
    }
}

/// One borrower change on the owner's table: (whether the object is known, the object
/// when this change dropped its last reference and it is to be freed).
fn apply_borrower_update(
    objs: &mut HashMap<String, Box<Owned>>,
    id: &str,
    borrower: &str,
    add: bool,
) -> (bool, Option<Box<Owned>>) {
    let Some(o) = objs.get_mut(id) else { return (false, None) };
    if add {
        if o.borrowers.insert(borrower.to_string()) {
            o.refs += 1;
        }
        (true, None)
    } else if o.borrowers.remove(borrower) {
        o.refs = o.refs.saturating_sub(1);
        if o.refs == 0 && !matches!(o.state, ObjState::Pending) {
            (true, objs.remove(id))
        } else {
            (true, None)
        }
    } else {
        (true, None)
    }
}

/// OBJ-8: the source a puller on node `puller` copies stored object `o` from:
/// every location when its own node has a copy; else the copy with the fewest
/// pulls in flight, under [`MAX_PULLS_PER_SOURCE`], then the one that served
/// least, then the newest (so later pullers copy from earlier ones instead of
/// all from the first). `None` while every copy is busy or another process of
/// the same node is pulling it already: wait for one to finish.
fn assign_source(o: &mut Owned, puller: &str) -> Option<Vec<pb::ObjectLocation>> {
    let Owned { state, pulls, .. } = o;
    let ObjState::Stored { locations, .. } = state else { return None };
    if locations.iter().any(|l| l.node_id == puller) {
        return Some(locations.clone());
    }
    let Pulls { slots: pulls, served } = &mut **pulls.get_or_insert_with(Default::default);
    let now = Instant::now();
    pulls.retain(|p| now.duration_since(p.since) < PULL_SLOT_TTL);
    if pulls.iter().any(|p| p.puller == puller) {
        return None;
    }
    let in_flight = |n: &str| pulls.iter().filter(|p| p.source == n).count();
    let best = locations
        .iter()
        .enumerate()
        .filter(|(_, l)| in_flight(&l.node_id) < MAX_PULLS_PER_SOURCE)
        .min_by_key(|(i, l)| {
            (
                in_flight(&l.node_id),
                served.get(&l.node_id).copied().unwrap_or(0),
                std::cmp::Reverse(*i),
            )
        })
        .map(|(_, l)| l.clone())?;
    pulls.push(PullSlot { source: best.node_id.clone(), puller: puller.to_string(), since: now });
    *served.entry(best.node_id.clone()).or_default() += 1;
    Some(vec![best])
}

/// Why a pull failed: the source (its node is gone, or it no longer has the
/// object: that copy is lost) or this node (its store cannot take the copy).
enum PullError {
    Source(String),
    Local(String),
}

/// True when a call failed before reaching the server (nothing ran).
fn is_connect_error(s: &tonic::Status) -> bool {
    let m = s.message();
    s.code() == tonic::Code::Unavailable
        && (m.contains("connect")
            || m.contains("Connection refused")
            || m.contains("connection refused"))
}

type ResolvedArgs =
    tokio::sync::oneshot::Receiver<Result<(Vec<pb::TaskArg>, Vec<RawRef>), pb::TaskError>>;

/// Blocks for the next item of a streaming task (see [`crate::ObjectRefGenerator`]).
pub(crate) fn next_generator_item(
    task_id: &str,
    function: &str,
    index: u64,
) -> Option<Result<RawRef, Error>> {
    let c = try_core()?;
    c.rt.block_on(c.next_item(task_id, function, index))
}

/// The group a Rust task running on this thread captures what it submits into (Ray's
/// `placement_group_capture_child_tasks`). Other languages decide it themselves (Python
/// tells an explicit `"DEFAULT"` strategy from none, which the core cannot).
fn captured_group() -> Option<String> {
    if crate::foreign::language() != "rust" {
        return None;
    }
    crate::executor::current_capture_group()
}

/// `opts` for a task submitted now by a Rust task whose group captures its children:
/// without a strategy of its own, it goes to that group (any bundle) and captures too.
fn captured_options(opts: &TaskOptions) -> Option<TaskOptions> {
    if opts.scheduling != Scheduling::Default {
        return None;
    }
    let pg = captured_group()?;
    Some(TaskOptions {
        scheduling: Scheduling::PlacementGroup { placement_group_id: pg, bundle_index: -1 },
        capture_child_tasks: true,
        ..opts.clone()
    })
}

/// Blocks for the next item of a streaming task as a ref, a failure included (see
/// [`Core::next_item_ref`]).
pub(crate) fn next_generator_item_ref(task_id: &str, function: &str, index: u64) -> Option<RawRef> {
    let c = try_core()?;
    c.rt.block_on(c.next_item_ref(task_id, function, index))
}

/// Forgets a streaming task's bookkeeping once its consumer is gone.
pub(crate) fn drop_generator(task_id: &str, consumed: u64) {
    if let Some(c) = try_core() {
        let g = c.generators.lock().unwrap().remove(task_id);
        if let Some(g) = g {
            // Items never taken still carry the generator's hold.
            for id in g.items.into_iter().skip(consumed as usize) {
                release_ref(&id, &c.address.clone());
            }
        }
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

fn short_class(class: &str) -> &str {
    class.rsplit("::").next().unwrap_or(class)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Issue 34's goal is 1,000,000 queued tasks in 2 GiB of driver memory: each queued
    /// task's return is an `Owned` entry, so its size is a budget (a rare field belongs
    /// behind a `Box`, as `Failed` and `pulls` are).
    #[test]
    fn an_owned_entry_fits_its_budget() {
        let size = std::mem::size_of::<Owned>();
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
