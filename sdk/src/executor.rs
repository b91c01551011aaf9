//! The executing side of a worker process: runs pushed tasks on executor
//! threads (never on the runtime threads that answer RPCs), hosts at most one
//! actor, releases each caller's actor calls in sequence order (CORE-4), and
//! stores large results in the node's object store.

use std::cell::RefCell;
use std::collections::{BTreeMap, HashMap, HashSet};
use std::panic::AssertUnwindSafe;
use std::sync::atomic::{AtomicBool, AtomicU8, Ordering};
use std::sync::{Arc, Mutex, OnceLock};
use std::time::Duration;

use tokio::sync::oneshot;
use tpuray_proto::pb;
use tpuray_proto::pb::task_error::Kind;

use crate::codec::Encoded;
use crate::core::{Core, INLINE_MAX_BYTES};
use crate::error::TaskFailure;
use crate::foreign::ForeignRuntime;
use crate::object_ref::RawRef;
use crate::registry::{self, ActorClass};

struct Job {
    spec: pb::TaskSpec,
    reply: oneshot::Sender<pb::PushTaskReply>,
    /// [`QUEUED`], [`STARTED`] or [`HANDED_BACK`]: a task (not an actor call) queued
    /// behind another is handed back unrun when that one blocks or runs long (CORE-9).
    state: Arc<AtomicU8>,
}

/// A task in the executor's queue (see [`Executor::enqueue_task`]).
pub(crate) struct QueuedTask {
    core: Arc<Core>,
    rx: oneshot::Receiver<pb::PushTaskReply>,
    state: Arc<AtomicU8>,
}

impl QueuedTask {
    /// The task's reply once it ran, or `not_run` when it was handed back (CORE-9): a task
    /// waiting behind one that blocks in get/wait (it may be waiting for this very task)
    /// or runs long goes back to its owner.
    pub(crate) async fn reply(mut self) -> pb::PushTaskReply {
        let blocked = self.core.blocked_now.notified();
        tokio::pin!(blocked);
        blocked.as_mut().enable();
        tokio::select! {
            r = &mut self.rx => return r.unwrap_or_else(|_| stopped()),
            () = &mut blocked => {}
            () = tokio::time::sleep(QUEUED_MAX) => {}
            () = async {}, if self.core.is_blocked() => {}
        }
        if self
            .state
            .compare_exchange(QUEUED, HANDED_BACK, Ordering::SeqCst, Ordering::SeqCst)
            .is_ok()
        {
            return pb::PushTaskReply { not_run: true, ..Default::default() };
        }
        self.rx.await.unwrap_or_else(|_| stopped())
    }
}

/// The task or actor call an executor thread runs: its id, the placement group it runs
/// in ("" for none), and whether that group captures what it submits.
#[derive(Clone)]
struct Current {
    task_id: String,
    placement_group: String,
    capture: bool,
}

thread_local! {
    /// The task or actor call this executor thread runs now.
    static CURRENT_TASK: RefCell<Option<Current>> = const { RefCell::new(None) };
}

/// Tasks of this process told to stop (`cancel` without `force`, CORE-12), until they end.
fn cancelled_set() -> &'static Mutex<HashSet<String>> {
    static CANCELLED: OnceLock<Mutex<HashSet<String>>> = OnceLock::new();
    CANCELLED.get_or_init(Default::default)
}

/// The task or actor call running on this thread, if any (a task submitted from here is
/// its child, for `cancel(recursive=True)`).
pub(crate) fn current_task_id() -> Option<String> {
    CURRENT_TASK.with(|c| c.borrow().as_ref().map(|t| t.task_id.clone()))
}

/// The placement group of the task or actor call running on this thread (Ray's
/// `get_current_placement_group`), if it runs in one.
pub(crate) fn current_placement_group() -> Option<String> {
    CURRENT_TASK.with(|c| {
        c.borrow().as_ref().map(|t| t.placement_group.clone()).filter(|pg| !pg.is_empty())
    })
}

/// The group that what the running task submits without a strategy goes to (Ray's
/// `placement_group_capture_child_tasks`), if it captures.
pub(crate) fn current_capture_group() -> Option<String> {
    CURRENT_TASK.with(|c| {
        c.borrow()
            .as_ref()
            .filter(|t| t.capture && !t.placement_group.is_empty())
            .map(|t| t.placement_group.clone())
    })
}

/// Whether the task running on this thread was cancelled (see [`crate::is_cancelled`]).
pub(crate) fn current_task_cancelled() -> bool {
    current_task_id().is_some_and(|t| task_cancelled(&t))
}

/// Whether task `task_id`, running in this process, was cancelled.
pub(crate) fn task_cancelled(task_id: &str) -> bool {
    cancelled_set().lock().unwrap().contains(task_id)
}

/// Sets [`CURRENT_TASK`] while it lives.
struct CurrentTask;

impl CurrentTask {
    fn enter(current: Current) -> Self {
        CURRENT_TASK.with(|c| *c.borrow_mut() = Some(current));
        CurrentTask
    }
}

impl Drop for CurrentTask {
    fn drop(&mut self) {
        CURRENT_TASK.with(|c| *c.borrow_mut() = None);
    }
}

const QUEUED: u8 = 0;
const STARTED: u8 = 1;
const HANDED_BACK: u8 = 2;
/// A task queued behind another on this worker longer than this goes back to
/// its owner unrun (CORE-9): owners queue several only while their tasks are
/// quick, so a wait this long means the one in front is slow.
const QUEUED_MAX: Duration = Duration::from_millis(50);

struct CallerQueue {
    next: u64,
    waiting: BTreeMap<u64, Job>,
}

struct ActorHost {
    /// The class in this binary's registry; `None` for an actor of a foreign runtime.
    class: Option<&'static ActorClass>,
    state: Mutex<Box<dyn std::any::Any + Send>>,
    callers: Mutex<HashMap<String, CallerQueue>>,
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
    on_loop: Mutex<HashMap<String, (usize, std::collections::VecDeque<Job>)>>,
}

/// Executor threads taking jobs from `rx` until the executor stops.
fn spawn_threads(
    ex: &Arc<Executor>,
    rx: std::sync::mpsc::Receiver<Job>,
    threads: usize,
    group: &str,
) {
    let rx = Arc::new(Mutex::new(rx));
    for i in 0..threads {
        let ex = Arc::clone(ex);
        let rx = Arc::clone(&rx);
        let name = if group.is_empty() {
            format!("tpuray-exec-{i}")
        } else {
            format!("tpuray-{group}-{i}")
        };
        std::thread::Builder::new()
            .name(name)
            .spawn(move || {
                loop {
                    let job = { rx.lock().unwrap().recv() };
                    let Ok(job) = job else { return };
                    if ex.retiring.load(Ordering::SeqCst) && job.spec.actor_id.is_empty() {
                        // max_calls ran out: back to the owner unrun (CORE-9's path).
                        if job
                            .state
                            .compare_exchange(
                                QUEUED,
                                HANDED_BACK,
                                Ordering::SeqCst,
                                Ordering::SeqCst,
                            )
                            .is_ok()
                        {
                            let _ = job
                                .reply
                                .send(pb::PushTaskReply { not_run: true, ..Default::default() });
                        }
                        ex.running.lock().unwrap().remove(&job.spec.task_id);
                        continue;
                    }
                    if job
                        .state
                        .compare_exchange(QUEUED, STARTED, Ordering::SeqCst, Ordering::SeqCst)
                        .is_err()
                    {
                        ex.running.lock().unwrap().remove(&job.spec.task_id);
                        continue; // handed back unrun (CORE-9)
                    }
                    let reply = ex.run(&job.spec);
                    let _ = job.reply.send(reply);
                }
            })
            .expect("spawn executor thread");
    }
}

fn failure(spec: &pb::TaskSpec, core: &Core, f: TaskFailure) -> pb::PushTaskReply {
    pb::PushTaskReply {
        returns: vec![],
        error: Some(pb::TaskError {
            kind: f.kind as i32,
            message: f.message,
            function_name: spec.name.clone(),
            node_id: core.node_id.clone(),
            pid: std::process::id(),
            payload: f.payload,
            no_retry: f.no_retry,
        }),
        ..Default::default()
    }
}

/// Executor threads of one actor at most (`max_concurrency` above this shares them).
const MAX_EXECUTOR_THREADS: u32 = 256;

/// The foreign runtime that runs `spec`, when its language is not Rust.
fn stopped() -> pb::PushTaskReply {
    pb::PushTaskReply {
        error: Some(pb::TaskError {
            kind: Kind::WorkerDied as i32,
            message: "executor stopped".into(),
            ..Default::default()
        }),
        ..Default::default()
    }
}

fn foreign_of(spec: &pb::TaskSpec) -> Option<&'static dyn ForeignRuntime> {
    let lang = spec.function.as_ref().map(|f| f.language.as_str()).unwrap_or("rust");
    if lang == "rust" || lang.is_empty() { None } else { crate::foreign::runtime_for(lang) }
}

/// The foreign runtime that runs `spec` on its own event loop, when it does: a
/// non-streaming call of an async actor method whose arguments all came inline (one that
/// must fetch an argument first goes through an executor thread, which may block).
fn loop_runtime(spec: &pb::TaskSpec) -> Option<&'static dyn ForeignRuntime> {
    let inline = spec.args.iter().all(|a| matches!(a.kind, Some(pb::task_arg::Kind::Value(_))));
    if spec.streaming || spec.actor_id.is_empty() || !inline {
        return None;
    }
    let rt = foreign_of(spec)?;
    let function = spec.function.as_ref().map(|f| f.name.as_str()).unwrap_or_default();
    rt.is_async_method(function).then_some(rt)
}

/// Each inline argument's bytes (all of them, for a call [`loop_runtime`] takes).
fn inline_args(spec: &pb::TaskSpec) -> Vec<Vec<u8>> {
    spec.args
        .iter()
        .filter_map(|a| match &a.kind {
            Some(pb::task_arg::Kind::Value(v)) => Some(v.clone()),
            _ => None,
        })
        .collect()
}

/// A request's resources by plain name (Ray's `parse_pg_formatted_resources_to_original`:
/// a bundle's indexed and wildcard names both stand for the plain one), sorted.
fn assigned_resources(request: &std::collections::HashMap<String, f64>) -> Vec<(String, f64)> {
    let mut out = std::collections::BTreeMap::new();
    for (k, v) in request {
        let plain = tpuray_scheduler::bundles::parse_bundle_resource(k).map_or(k.as_str(), |b| b.0);
        // `bundle_group_<pg>` is the group's own marker (Ray has one too), no resource
        // of the task's.
        if *v <= 0.0 || (plain == tpuray_scheduler::bundles::BUNDLE_MARKER && plain != k) {
            continue;
        }
        out.insert(plain.to_string(), *v);
    }
    out.into_iter().collect()
}

fn task_info(spec: &pb::TaskSpec) -> crate::foreign::TaskInfo {
    let f = spec.function.clone().unwrap_or_default();
    crate::foreign::TaskInfo {
        task_id: spec.task_id.clone(),
        job_id: spec.job_id.clone(),
        function: f.name,
        class_name: f.class_name,
        name: spec.name.clone(),
        actor_id: spec.actor_id.clone(),
        attempt: spec.attempt,
        num_returns: spec.num_returns,
        streaming: spec.streaming,
        capture_child_tasks: spec.capture_child_tasks,
        placement_group_id: if spec.placement_group_id.is_empty() {
            spec.resources
                .keys()
                .find_map(|k| {
                    tpuray_scheduler::bundles::parse_bundle_resource(k).map(|(_, _, pg)| pg)
                })
                .unwrap_or_default()
                .to_string()
        } else {
            spec.placement_group_id.clone()
        },
        resources: assigned_resources(&spec.resources),
    }
}

fn panic_message(p: Box<dyn std::any::Any + Send>) -> String {
    if let Some(s) = p.downcast_ref::<&str>() {
        format!("panicked: {s}")
    } else if let Some(s) = p.downcast_ref::<String>() {
        format!("panicked: {s}")
    } else {
        "panicked".to_string()
    }
}

impl Executor {
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
        });
        spawn_threads(&ex, rx, threads, "");
        for (name, limit, grx) in group_rx {
            spawn_threads(&ex, grx, limit.min(MAX_EXECUTOR_THREADS as usize), &name);
        }
        Ok(ex)
    }

    /// Accepts a pushed task; the reply arrives when it has run, or (a task queued behind
    /// another, CORE-9) when it is handed back unrun: `not_run` set.
    pub(crate) async fn push(self: &Arc<Self>, spec: pb::TaskSpec) -> pb::PushTaskReply {
        if spec.actor_id.is_empty() {
            return self.enqueue_task(spec).reply().await;
        }
        let (tx, rx) = oneshot::channel();
        let job = Job { spec, reply: tx, state: Arc::new(AtomicU8::new(QUEUED)) };
        let Some(actor) = &self.actor else {
            return failure(
                &job.spec,
                &self.core,
                TaskFailure::new(Kind::ActorDied, "this worker hosts no actor"),
            );
        };
        self.running.lock().unwrap().insert(job.spec.task_id.clone(), ());
        // CORE-4: release each caller's calls in sequence order.
        {
            let mut callers = actor.callers.lock().unwrap();
            let q = callers
                .entry(job.spec.caller_id.clone())
                .or_insert_with(|| CallerQueue { next: 0, waiting: BTreeMap::new() });
            q.waiting.insert(job.spec.sequence_no, job);
            while let Some(j) = q.waiting.remove(&q.next) {
                q.next += 1;
                let group = match self.group_of(&j.spec) {
                    Ok(g) => g,
                    Err(message) => {
                        let reply = failure(
                            &j.spec,
                            &self.core,
                            TaskFailure::new(Kind::Application, message),
                        );
                        self.running.lock().unwrap().remove(&j.spec.task_id);
                        let _ = j.reply.send(reply);
                        continue;
                    }
                };
                match loop_runtime(&j.spec) {
                    Some(rt) => self.start_on_loop(rt, j, group),
                    None => {
                        let tx = self.groups.get(&group).map_or(&self.tx, |(_, tx)| tx);
                        let _ = tx.send(j);
                    }
                }
            }
        }
        rx.await.unwrap_or_else(|_| stopped())
    }

    /// The concurrency group a call runs in: the one it names, else its method's, else
    /// the default group ("").
    ///
    /// # Errors
    /// The call names a group the actor does not define.
    fn group_of(&self, spec: &pb::TaskSpec) -> Result<String, String> {
        if !spec.concurrency_group.is_empty() {
            if self.groups.contains_key(&spec.concurrency_group) {
                return Ok(spec.concurrency_group.clone());
            }
            let mut defined: Vec<&String> = self.groups.keys().collect();
            defined.sort();
            return Err(format!(
                "{} was called in concurrency group {:?}, which the actor does not define (defined: {defined:?})",
                spec.name, spec.concurrency_group
            ));
        }
        let method = spec.function.as_ref().map(|f| f.name.as_str()).unwrap_or_default();
        Ok(self.method_groups.get(method).cloned().unwrap_or_default())
    }

    /// How many calls of `group` run at once.
    fn group_limit(&self, group: &str) -> usize {
        self.groups.get(group).map_or(self.max_concurrency, |(limit, _)| *limit)
    }

    /// Starts an actor call on its foreign runtime's event loop (an async actor's `async
    /// def` method): from the RPC's thread straight to the loop, and the result from the
    /// loop's thread straight to the reply, two thread hand-offs fewer than through an
    /// executor thread. At most the group's limit run at once (`max_concurrency` for the
    /// default group, Ray's limit for async actors); the rest wait here in order.
    fn start_on_loop(self: &Arc<Self>, rt: &'static dyn ForeignRuntime, job: Job, group: String) {
        {
            let limit = self.group_limit(&group);
            let mut on_loop = self.on_loop.lock().unwrap();
            let slot = on_loop.entry(group.clone()).or_default();
            if slot.0 >= limit {
                slot.1.push_back(job);
                return;
            }
            slot.0 += 1;
        }
        self.launch_on_loop(rt, job, group);
    }

    /// Hands a call holding one of the `max_concurrency` places to the loop. When it
    /// ends, its place passes straight to the first call waiting, if any: were the place
    /// given back first, a call arriving in between could take it and start ahead of
    /// the calls waiting before it (CORE-4 order).
    fn launch_on_loop(self: &Arc<Self>, rt: &'static dyn ForeignRuntime, job: Job, group: String) {
        let Job { spec, reply, .. } = job;
        if task_cancelled(&spec.task_id) {
            // Cancelled while it waited for a place (CORE-12): it never runs.
            let failed = TaskFailure::new(Kind::Cancelled, "cancelled before it ran");
            let _ = reply.send(self.finish(&spec, Err(failed)));
            if let Some(j) = self.next_on_loop(&group) {
                self.launch_on_loop(rt, j, group);
            }
            return;
        }
        crate::metrics::task_started(&spec);
        self.core.event(&spec, "RUNNING", "");
        let args = inline_args(&spec);
        let info = task_info(&spec);
        let ex = Arc::clone(self);
        rt.start_async_method(
            &info,
            args,
            Box::new(move |result| {
                let _ = reply.send(ex.finish(&spec, result.map(Encoded::Foreign)));
                if let Some(j) = ex.next_on_loop(&group) {
                    ex.launch_on_loop(rt, j, group);
                }
            }),
        );
    }

    /// The call of `group` waiting first for the place a call just gave up (which it
    /// takes), or `None` (the place is free again).
    fn next_on_loop(&self, group: &str) -> Option<Job> {
        let mut on_loop = self.on_loop.lock().unwrap();
        let slot = on_loop.entry(group.to_string()).or_default();
        let next = slot.1.pop_front();
        if next.is_none() {
            slot.0 -= 1;
        }
        next
    }

    /// Queues a task (not an actor call) behind those queued before it; its reply comes
    /// from [`QueuedTask::reply`].
    pub(crate) fn enqueue_task(&self, spec: pb::TaskSpec) -> QueuedTask {
        let (tx, rx) = oneshot::channel();
        let state = Arc::new(AtomicU8::new(QUEUED));
        self.running.lock().unwrap().insert(spec.task_id.clone(), ());
        let _ = self.tx.send(Job { spec, reply: tx, state: Arc::clone(&state) });
        QueuedTask { core: Arc::clone(&self.core), rx, state }
    }

    /// Cancels a task pushed here (CORE-12): with `force`, the process exits; else a
    /// queued one never runs and a running one is told to stop (a Python task gets
    /// `KeyboardInterrupt`, an async method's coroutine is cancelled, a Rust task sees
    /// [`crate::is_cancelled`]). With `recursive`, what it submitted is cancelled too.
    /// False when it is not here (finished, or never pushed).
    pub(crate) fn cancel(&self, task_id: &str, force: bool, recursive: bool) -> bool {
        let found = self.running.lock().unwrap().contains_key(task_id);
        if !found {
            return false;
        }
        if recursive {
            self.core.cancel_children(task_id, force);
        }
        if force {
            std::thread::spawn(|| {
                std::thread::sleep(Duration::from_millis(20));
                std::process::exit(137);
            });
            return true;
        }
        cancelled_set().lock().unwrap().insert(task_id.to_string());
        if let Some(rt) = crate::foreign::installed_runtime() {
            rt.cancel(task_id);
        }
        true
    }

    fn run(&self, spec: &pb::TaskSpec) -> pb::PushTaskReply {
        // Clients made here (generator reports, nested calls) need the runtime.
        let _guard = self.core.rt.enter();
        if task_cancelled(&spec.task_id) {
            // Cancelled while it waited here: it never runs.
            return self
                .finish(spec, Err(TaskFailure::new(Kind::Cancelled, "cancelled before it ran")));
        }
        crate::metrics::task_started(spec);
        self.core.event(spec, "RUNNING", "");
        let log = crate::logs::TaskLog::start(spec);
        let result = {
            let (placement_group, capture) = if spec.actor_id.is_empty() {
                (task_info(spec).placement_group_id, spec.capture_child_tasks)
            } else {
                self.actor_group.clone()
            };
            let _current = CurrentTask::enter(Current {
                task_id: spec.task_id.clone(),
                placement_group,
                capture,
            });
            self.invoke(spec)
        };
        if let Some(log) = log {
            self.core.log_event(spec, log.end());
        }
        let mut reply = self.finish(spec, result);
        if spec.max_calls > 0 && spec.actor_id.is_empty() {
            let f = spec.function.as_ref().map(|f| f.name.clone()).unwrap_or_default();
            let mut calls = self.calls.lock().unwrap();
            let n = calls.entry(f).or_insert(0);
            *n += 1;
            if *n >= spec.max_calls {
                // Ray's max_calls: this worker has run the function enough times; what
                // is queued here goes back unrun and the owner returns the lease with
                // the worker disconnected (the agent stops it).
                self.retiring.store(true, Ordering::SeqCst);
                reply.worker_exiting = true;
            }
        }
        reply
    }

    /// The reply for a call that ran: its results stored (small ones inline), the refs in
    /// them handed over to the caller, and the refs it kept registered with their owners.
    /// Blocks (on owners' answers, and on the store for large results): not for the
    /// runtime's threads.
    fn finish(
        &self,
        spec: &pb::TaskSpec,
        result: Result<Encoded, TaskFailure>,
    ) -> pb::PushTaskReply {
        let core = &self.core;
        let _guard = core.rt.enter();
        let reply = match result {
            Ok(Encoded::Value(bytes)) => {
                let nested = crate::codec::take_return_nested();
                match self.store_return(spec, &spec.return_ids[0], bytes) {
                    Ok(r) => pb::PushTaskReply {
                        returns: vec![r],
                        nested_in_return: self.hand_over(spec, nested),
                        ..Default::default()
                    },
                    Err(f) => failure(spec, core, f),
                }
            }
            Ok(Encoded::Stream(items)) => self.stream(spec, items),
            Ok(Encoded::Foreign(ret)) => self.store_foreign(spec, ret),
            Err(f) => failure(spec, core, f),
        };
        let mut reply = reply;
        reply.node_id = core.node_id.clone();
        reply.worker_id = core.worker_id.clone();
        // Refs the task kept (in an actor's state, say) are registered with
        // their owners before the reply unpins the arguments (CORE-2).
        crate::core::confirm_borrows(core);
        self.running.lock().unwrap().remove(&spec.task_id);
        cancelled_set().lock().unwrap().remove(&spec.task_id);
        core.forget_children(&spec.task_id);
        // The executor says FINISHED too (as Ray's does): the owner's own event can be
        // lost when the owner exits right after `get` returned the value.
        if reply.error.is_none() {
            core.event(spec, "FINISHED", "");
        }
        crate::metrics::task_ended(spec);
        reply
    }

    /// Stores a foreign runtime's return values, one per return id.
    fn store_foreign(
        &self,
        spec: &pb::TaskSpec,
        ret: crate::foreign::ForeignReturn,
    ) -> pb::PushTaskReply {
        if ret.values.len() != spec.return_ids.len() {
            return failure(
                spec,
                &self.core,
                TaskFailure::application(format!(
                    "{} returned {} value(s) but num_returns is {}",
                    spec.name,
                    ret.values.len(),
                    spec.return_ids.len()
                )),
            );
        }
        let mut returns = Vec::with_capacity(ret.values.len());
        for (id, bytes) in spec.return_ids.iter().zip(ret.values) {
            match self.store_return(spec, id, bytes) {
                Ok(r) => returns.push(r),
                Err(f) => return failure(spec, &self.core, f),
            }
        }
        let nested = if returns.is_empty() { vec![] } else { self.hand_over(spec, ret.nested) };
        pb::PushTaskReply { returns, nested_in_return: nested, ..Default::default() }
    }

    fn invoke(&self, spec: &pb::TaskSpec) -> Result<Encoded, TaskFailure> {
        let args = resolve_args(&self.core, spec)?;
        let f = spec.function.clone().unwrap_or_default();
        if let Some(rt) = foreign_of(spec) {
            let info = task_info(spec);
            if spec.streaming {
                let r = std::panic::catch_unwind(AssertUnwindSafe(|| rt.start_stream(&info, args)));
                return r
                    .map_err(|p| TaskFailure::application(panic_message(p)))?
                    .map(Encoded::Stream);
            }
            let r = std::panic::catch_unwind(AssertUnwindSafe(|| {
                if spec.actor_id.is_empty() {
                    rt.run_task(&info, args)
                } else {
                    rt.call_method(&info, args)
                }
            }));
            return r
                .map_err(|p| TaskFailure::application(panic_message(p)))?
                .map(Encoded::Foreign);
        }
        let result = if spec.actor_id.is_empty() {
            let invoke = registry::function(&f.name).ok_or_else(|| {
                TaskFailure::new(
                    Kind::FunctionNotFound,
                    format!(
                        "function {} is not registered in this worker's binary {:?}; is it marked #[tpuray::remote] in the driver's program?",
                        f.name,
                        std::env::current_exe().unwrap_or_default()
                    ),
                )
            })?;
            std::panic::catch_unwind(AssertUnwindSafe(|| invoke(&args)))
        } else {
            let actor = self
                .actor
                .as_ref()
                .ok_or_else(|| TaskFailure::new(Kind::ActorDied, "no actor here"))?;
            let class = actor.class.ok_or_else(|| {
                TaskFailure::new(Kind::FunctionNotFound, "this actor's language runtime is gone")
            })?;
            let method = class.method(&f.name).ok_or_else(|| {
                TaskFailure::new(
                    Kind::FunctionNotFound,
                    format!("actor class {} has no method {}", class.name, f.name),
                )
            })?;
            let mut state = actor.state.lock().unwrap_or_else(|p| p.into_inner());
            std::panic::catch_unwind(AssertUnwindSafe(|| method(&mut **state, &args)))
        };
        result.map_err(|p| TaskFailure::application(panic_message(p)))?
    }

    /// Refs nested in a return value outlive this task's own copies: each
    /// owner learns, before the reply goes out, that the caller borrows them
    /// (as `<caller>#ret:<return id>`), and the caller releases that when it
    /// frees the return object (CORE-2).
    fn hand_over(&self, spec: &pb::TaskSpec, nested: Vec<RawRef>) -> Vec<pb::ObjectRefMsg> {
        let core = &self.core;
        let key = format!("{}#ret:{}", spec.owner_address, spec.return_ids[0]);
        let mut seen = std::collections::HashSet::new();
        let mut out = Vec::new();
        // Registrations with other owners go out in one batch per owner.
        let mut waits = Vec::new();
        for r in nested {
            if !seen.insert(r.id().to_string()) {
                continue;
            }
            if r.owner() == core.address {
                core.serve_update_borrower(r.id(), &key, true);
            } else {
                waits.push(core.queue_borrower(r.owner(), r.id(), &key));
            }
            out.push(pb::ObjectRefMsg {
                object_id: r.id().to_string(),
                owner_address: r.owner().to_string(),
            });
        }
        if !waits.is_empty() {
            core.rt.block_on(crate::core::all_confirmed(waits));
        }
        out
    }

    /// Inline when small, else a primary copy in this node's store recording
    /// the task's owner (shown by `tpuray memory`).
    fn store_return(
        &self,
        spec: &pb::TaskSpec,
        id: &str,
        bytes: Vec<u8>,
    ) -> Result<pb::ReturnObject, TaskFailure> {
        let size = bytes.len() as u64;
        if bytes.len() <= INLINE_MAX_BYTES {
            return Ok(pb::ReturnObject {
                object_id: id.to_string(),
                data: Some(pb::return_object::Data::InlineValue(bytes)),
                size,
            });
        }
        let opts = tpuray_objectstore::CreateOptions {
            owner: (!spec.owner_address.is_empty()).then(|| spec.owner_address.clone()),
            ..Default::default()
        };
        self.core.store.put_with(id, &bytes, &opts).map_err(|e| {
            TaskFailure::new(Kind::Application, format!("cannot store the result: {e}"))
        })?;
        Ok(pb::ReturnObject {
            object_id: id.to_string(),
            data: Some(pb::return_object::Data::Location(pb::ObjectLocation {
                node_id: self.core.node_id.clone(),
                agent_address: self.core.agent_address.clone(),
                store_dir: self.core.store.dir().display().to_string(),
            })),
            size,
        })
    }

    fn stream(
        &self,
        spec: &pb::TaskSpec,
        items: Box<dyn Iterator<Item = Result<Vec<u8>, TaskFailure>> + Send>,
    ) -> pb::PushTaskReply {
        let core = &self.core;
        let mut owner = match core.worker_client(&spec.owner_address) {
            Ok(c) => c,
            Err(e) => return failure(spec, core, TaskFailure::application(e.to_string())),
        };
        let mut items = items;
        let mut index = 0u64;
        loop {
            if task_cancelled(&spec.task_id) {
                // CORE-12: a cancelled generator produces nothing more.
                let f = TaskFailure::new(Kind::Cancelled, "cancelled while it streamed");
                return failure(spec, core, f);
            }
            let next = std::panic::catch_unwind(AssertUnwindSafe(|| items.next()));
            let item = match next {
                Ok(Some(Ok(bytes))) => bytes,
                Ok(None) => break,
                Ok(Some(Err(f))) => return failure(spec, core, f),
                Err(p) => return failure(spec, core, TaskFailure::application(panic_message(p))),
            };
            let id = Core::streaming_item_id(&spec.task_id, index);
            let ret = match self.store_return(spec, &id, item) {
                Ok(r) => r,
                Err(f) => return failure(spec, core, f),
            };
            let req = pb::ReportGeneratorItemRequest {
                task_id: spec.task_id.clone(),
                index,
                item: Some(ret),
                finished: false,
                error: None,
                attempt: spec.attempt,
            };
            if let Err(s) = core.rt.block_on(owner.report_generator_item(req)) {
                return failure(
                    spec,
                    core,
                    TaskFailure::application(format!(
                        "the generator's owner is gone: {}",
                        s.message()
                    )),
                );
            }
            index += 1;
        }
        pb::PushTaskReply::default()
    }
}

/// Each argument's bytes: inline values as they are, refs fetched (from the
/// owner, this node's store, or another node).
fn resolve_args(core: &Arc<Core>, spec: &pb::TaskSpec) -> Result<Vec<Vec<u8>>, TaskFailure> {
    spec.args
        .iter()
        .enumerate()
        .map(|(i, a)| match &a.kind {
            Some(pb::task_arg::Kind::Value(v)) => Ok(v.clone()),
            Some(pb::task_arg::Kind::ObjectRef(r)) => {
                // Pinned by the submitter while the task runs.
                let raw = RawRef::uncounted(r.object_id.clone(), r.owner_address.clone());
                core.rt.block_on(core.get_data(&raw, None)).map(|d| d.to_vec()).map_err(|e| {
                    let message = format!("argument {i} ({}) failed: {e}", r.object_id);
                    match e {
                        // CORE-11: the upstream's exception travels on (Ray raises it
                        // at `get`), and running this task again cannot change it.
                        crate::Error::Task { payload, .. } if !payload.is_empty() => TaskFailure {
                            no_retry: true,
                            ..TaskFailure::with_payload(message, payload)
                        },
                        _ => TaskFailure::new(Kind::Application, message),
                    }
                })
            }
            None => Err(TaskFailure::bad_arguments(format!("argument {i} is empty"))),
        })
        .collect()
}
