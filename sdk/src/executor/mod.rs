//! The executing side of a worker process: runs pushed tasks on executor
//! threads (never on the runtime threads that answer RPCs), hosts at most one
//! actor, releases each caller's actor calls in sequence order (CORE-4), and
//! stores large results in the node's object store.
//!
//! Here: the executor's state ([`Executor`], its queued jobs, the hosted actor) and its
//! start. The rest, by seam: `threads.rs` (the executor threads' loop, the task queue
//! and CORE-9's hand-back, running one call), `actor_calls.rs` (an actor's calls:
//! CORE-4's per-caller order, concurrency groups, async methods on a foreign event
//! loop), `invoke.rs` (calling the function: arguments resolved, Rust registry or
//! foreign runtime), `replies.rs` (results stored and handed over, streamed items,
//! failures) and `context.rs` (the task running on this thread, and cancellation).
//!
//! An actor's constructor runs from the creation task before the worker registers;
//! when it fails the worker exits with code 3, and the head marks the actor dead
//! instead of retrying. An async actor's `async def` calls whose arguments came inline
//! skip the executor threads: the RPC's thread queues them on the foreign runtime's
//! event loop in sequence order (`ForeignRuntime::start_async_method`), at most
//! `max_concurrency` at once, and the loop's thread stores the result and answers.
//! Concurrency groups (Ray's `concurrency_groups`, from the creation task): each group
//! has its own queue and executor threads (its limit of them) and its own limit on the
//! event loop; a call goes to the group it names, else its method's (`method_groups`),
//! else the default group of `max_concurrency`; an unknown group fails the call naming
//! it. `max_calls` (Ray's): after a task's function ran that many times here, the reply
//! says `worker_exiting`, what is queued goes back unrun, and the owner returns the
//! lease with the worker disconnected.

mod actor_calls;
mod context;
mod invoke;
mod replies;
mod threads;

pub(crate) use replies::stopped;

pub(crate) use context::{
    current_capture_group, current_placement_group, current_task_cancelled, current_task_id,
    task_cancelled,
};

use std::collections::{BTreeMap, HashMap};
use std::panic::AssertUnwindSafe;
use std::sync::atomic::{AtomicBool, AtomicU8};
use std::sync::{Arc, Mutex};

use tokio::sync::oneshot;
use tpuray_proto::pb;

use crate::core::Core;
use crate::registry::{self, ActorClass};

use invoke::{foreign_of, panic_message, resolve_args, task_info};
use threads::spawn_threads;

use crate::core::actor_order::{CallerQueue, Places};

struct Job {
    spec: pb::TaskSpec,
    reply: Replier,
    /// [`QUEUED`], [`STARTED`] or [`HANDED_BACK`]: a task (not an actor call) queued
    /// behind another is handed back unrun when that one blocks or runs long (CORE-9).
    state: Arc<AtomicU8>,
}

/// Where a call's reply goes: the RPC handler awaiting it, or (an actor call that came
/// on a direct connection, `crate::direct`) a writer the finishing thread answers on
/// itself.
pub(crate) enum Replier {
    Rpc(oneshot::Sender<pb::PushTaskReply>),
    Direct(Box<dyn FnOnce(pb::PushTaskReply) + Send>),
    /// Whichever comes first answers: the executor thread, or the CORE-9 hand-back of a
    /// task queued behind another ([`Executor::enqueue_task_to`]).
    Either(Arc<Mutex<Option<Replier>>>),
}

impl Replier {
    fn send(self, reply: pb::PushTaskReply) {
        match self {
            Replier::Rpc(tx) => {
                let _ = tx.send(reply);
            }
            Replier::Direct(answer) => answer(reply),
            Replier::Either(slot) => {
                let first = slot.lock().unwrap().take();
                if let Some(r) = first {
                    r.send(reply);
                }
            }
        }
    }
}

const QUEUED: u8 = 0;
const STARTED: u8 = 1;
const HANDED_BACK: u8 = 2;

struct ActorHost {
    /// The class in this binary's registry; `None` for an actor of a foreign runtime.
    class: Option<&'static ActorClass>,
    state: Mutex<Box<dyn std::any::Any + Send>>,
    /// Each caller's calls, released in sequence order (CORE-4).
    callers: Mutex<HashMap<String, CallerQueue<Job>>>,
}

pub(crate) struct Executor {
    core: Arc<Core>,
    /// The default group's queue (every call of a task worker).
    tx: std::sync::mpsc::Sender<Job>,
    actor: Option<ActorHost>,
    /// Task ids pushed here and not answered yet (queued or running), for cancellation.
    running: Mutex<HashMap<String, ()>>,
    /// The actor's concurrency groups (Ray's `concurrency_groups`): each one's limit
    /// and the queue of its own executor threads.
    groups: HashMap<String, (usize, std::sync::mpsc::Sender<Job>)>,
    /// The group of each method whose calls name none (`@ray.method(concurrency_group)`).
    method_groups: HashMap<String, String>,
    /// Calls of each function name run here so far, for `max_calls`.
    calls: Mutex<HashMap<String, u32>>,
    /// Set once a task's `max_calls` ran out: this worker runs nothing more (what is
    /// queued goes back unrun) and exits when its lease returns.
    retiring: AtomicBool,
    /// The hosted actor's placement group ("" for none) and whether it captures what
    /// its methods submit.
    actor_group: (String, bool),
    /// The actor's `max_concurrency` (1 for a task worker): how many of its calls run at
    /// once, on executor threads (at most [`MAX_EXECUTOR_THREADS`]) or on its event loop.
    max_concurrency: usize,
    /// Per concurrency group ("" the default): calls running on the foreign runtime's
    /// event loop, started without an executor thread (see [`Executor::start_on_loop`]),
    /// and those waiting for one of the group's places.
    on_loop: Mutex<HashMap<String, Places<Job>>>,
    /// An actor whose calls run on one executor thread: what that thread reads while it
    /// waits for its next call (a direct connection, issue 35).
    idle_reader: Option<crate::direct::IdleReader>,
}

/// Executor threads of one actor at most (`max_concurrency` above this shares them).
const MAX_EXECUTOR_THREADS: u32 = 256;

impl Executor {
    /// What an actor's only executor thread reads while idle, if it is one.
    pub(crate) fn idle_reader(&self) -> Option<&crate::direct::IdleReader> {
        self.idle_reader.as_ref()
    }

    /// Queues `job` on the default group's executor threads.
    fn queue(&self, job: Job) {
        let _ = self.tx.send(job);
        if let Some(r) = &self.idle_reader {
            r.queued();
        }
    }

    /// Starts `threads` executor threads. For an actor worker, `creation`
    /// is the actor's creation task, run here before anything else.
    ///
    /// # Errors
    /// The actor's class is not in this binary, or its constructor failed.
    pub(crate) fn start(
        core: Arc<Core>,
        creation: Option<pb::TaskSpec>,
    ) -> Result<Arc<Self>, String> {
        let mut threads = 1;
        let mut max_concurrency = 1;
        let mut group_limits: BTreeMap<String, u32> = BTreeMap::new();
        let mut method_groups = HashMap::new();
        let mut actor_group = (String::new(), false);
        if let Some(spec) = &creation {
            group_limits = spec.concurrency_groups.iter().map(|(k, v)| (k.clone(), *v)).collect();
            method_groups = spec.method_groups.clone().into_iter().collect();
            actor_group = (spec.placement_group_id.clone(), spec.capture_child_tasks);
        }
        if let Some(f) = creation.as_ref().and_then(|s| s.function.as_ref()) {
            crate::metrics::set_actor_class(&f.class_name);
        }
        let actor = match creation {
            Some(spec) if foreign_of(&spec).is_some() => {
                let rt = foreign_of(&spec).expect("checked");
                let args = resolve_args(&core, &spec).map_err(|f| f.message)?;
                let info = task_info(&spec);
                std::panic::catch_unwind(AssertUnwindSafe(|| rt.create_actor(&info, args)))
                    .map_err(|p| format!("{} constructor {}", info.class_name, panic_message(p)))?
                    .map_err(|f| f.message)?;
                threads = spec.max_concurrency.clamp(1, MAX_EXECUTOR_THREADS) as usize;
                max_concurrency = spec.max_concurrency.max(1) as usize;
                Some(ActorHost {
                    class: None,
                    state: Mutex::new(Box::new(())),
                    callers: Mutex::new(HashMap::new()),
                })
            }
            Some(spec) => {
                let class_name =
                    spec.function.as_ref().map(|f| f.class_name.clone()).unwrap_or_default();
                let class = registry::class(&class_name).ok_or_else(|| {
                    format!("actor class {class_name} is not registered in this worker's binary")
                })?;
                let args = resolve_args(&core, &spec).map_err(|f| f.message)?;
                let state = std::panic::catch_unwind(AssertUnwindSafe(|| (class.construct)(&args)))
                    .map_err(|p| format!("{class_name} constructor {}", panic_message(p)))?
                    .map_err(|f| format!("{class_name} constructor failed: {}", f.message))?;
                threads = spec.max_concurrency.clamp(1, MAX_EXECUTOR_THREADS) as usize;
                max_concurrency = spec.max_concurrency.max(1) as usize;
                Some(ActorHost {
                    class: Some(class),
                    state: Mutex::new(state),
                    callers: Mutex::new(HashMap::new()),
                })
            }
            None => None,
        };
        let idle_reader = (threads == 1 && group_limits.is_empty())
            .then(crate::direct::IdleReader::new)
            .flatten();
        let (tx, rx) = std::sync::mpsc::channel::<Job>();
        let mut groups = HashMap::new();
        let mut group_rx = Vec::new();
        for (name, limit) in group_limits {
            let (gtx, grx) = std::sync::mpsc::channel::<Job>();
            let limit = limit.max(1) as usize;
            groups.insert(name.clone(), (limit, gtx));
            group_rx.push((name, limit, grx));
        }
        let ex = Arc::new(Self {
            core,
            tx,
            actor,
            running: Mutex::new(HashMap::new()),
            groups,
            method_groups,
            calls: Mutex::new(HashMap::new()),
            retiring: AtomicBool::new(false),
            actor_group,
            max_concurrency,
            on_loop: Mutex::new(HashMap::new()),
            idle_reader,
        });
        spawn_threads(&ex, rx, threads, "");
        for (name, limit, grx) in group_rx {
            spawn_threads(&ex, grx, limit.min(MAX_EXECUTOR_THREADS as usize), &name);
        }
        Ok(ex)
    }
}
