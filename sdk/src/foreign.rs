//! The seam for other languages (the Python SDK): a language runtime embedded in a worker
//! process runs the tasks and actor calls whose function descriptor names its language,
//! while the Rust core worker does everything else (leases, ownership, objects, ordering).
//!
//! Arguments reach the runtime as bytes, one entry per argument, object refs already
//! resolved to their values' bytes (Ray resolves top-level refs the same way); results go
//! back as bytes, one per return object, with the refs nested inside them (CORE-2 hands
//! those over to the caller).

use std::sync::OnceLock;

use crate::error::TaskFailure;
use crate::object_ref::RawRef;

/// What a runtime gets to know about the task it runs.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct TaskInfo {
    pub task_id: String,
    pub job_id: String,
    /// The function (or actor class, or method) as the submitter named it: a function-table
    /// key for Python.
    pub function: String,
    /// The actor class's display name ("" for plain tasks).
    pub class_name: String,
    /// Display name (`module.f`, `Class.method`).
    pub name: String,
    /// The actor this call is for ("" for plain tasks).
    pub actor_id: String,
    pub attempt: u32,
    pub num_returns: u32,
    /// A streaming generator task (Ray's `num_returns="streaming"`).
    pub streaming: bool,
    /// The placement group the task runs in ("" for none), from its bundle resources.
    pub placement_group_id: String,
    /// What the task (or the actor, for its creation) submits without a scheduling
    /// strategy goes to its placement group (Ray's
    /// `placement_group_capture_child_tasks`).
    pub capture_child_tasks: bool,
    /// What the task asked for, by plain resource name (a bundle's `CPU_group_0_<pg>`
    /// counted as `CPU`, as Ray's `get_assigned_resources` names them), zero amounts
    /// left out.
    pub resources: Vec<(String, f64)>,
}

/// The items of a streaming task, each a value's bytes, produced as the consumer pulls.
pub type ForeignStream = Box<dyn Iterator<Item = Result<Vec<u8>, TaskFailure>> + Send>;

/// The values a task produced, one per return object, and the refs nested in them.
#[derive(Clone, Debug, Default)]
pub struct ForeignReturn {
    pub values: Vec<Vec<u8>>,
    pub nested: Vec<RawRef>,
}

/// A language runtime hosted by this worker process.
pub trait ForeignRuntime: Send + Sync + 'static {
    /// Runs a plain task.
    ///
    /// # Errors
    /// The task's failure (with the serialized exception as payload).
    fn run_task(&self, task: &TaskInfo, args: Vec<Vec<u8>>) -> Result<ForeignReturn, TaskFailure>;
    /// Constructs this process's actor (runs once per incarnation, before any call).
    ///
    /// # Errors
    /// The constructor's failure.
    fn create_actor(&self, task: &TaskInfo, args: Vec<Vec<u8>>) -> Result<(), TaskFailure>;
    /// Calls a method of this process's actor; may be called from several threads at once
    /// when the actor's `max_concurrency` is above 1.
    ///
    /// # Errors
    /// The method's failure.
    fn call_method(
        &self,
        task: &TaskInfo,
        args: Vec<Vec<u8>>,
    ) -> Result<ForeignReturn, TaskFailure>;
    /// Starts a streaming task or method (`task.actor_id` set for a method); each item of
    /// the stream becomes an object as soon as it is produced.
    ///
    /// # Errors
    /// The call failed before producing a stream.
    fn start_stream(
        &self,
        task: &TaskInfo,
        args: Vec<Vec<u8>>,
    ) -> Result<ForeignStream, TaskFailure>;

    /// Whether calls of this actor's method `function` run on the runtime's own event loop
    /// (an async actor's `async def` methods, as Ray runs them), so that
    /// [`ForeignRuntime::start_async_method`] can take them straight from the RPC that
    /// brought them, without an executor thread in between. Default: none do.
    fn is_async_method(&self, function: &str) -> bool {
        let _ = function;
        false
    }

    /// Starts a call [`ForeignRuntime::is_async_method`] said yes to on the runtime's event
    /// loop and returns at once, without blocking (it is called on the worker's RPC
    /// thread); `done` gets the call's result, on the loop's thread, when it ends.
    fn start_async_method(&self, task: &TaskInfo, args: Vec<Vec<u8>>, done: AsyncDone) {
        let _ = (task, args);
        done(Err(TaskFailure::application(
            "this language runtime runs no methods on an event loop",
        )));
    }

    /// Tells task `task_id`, if it runs in this runtime now, to stop (`cancel` without
    /// `force`, CORE-12): Python raises `KeyboardInterrupt` in a task's thread and
    /// cancels an async method's coroutine, as Ray does. Called on an RPC thread; must
    /// not block. Default: nothing (the task can still read [`crate::is_cancelled`]).
    fn cancel(&self, task_id: &str) {
        let _ = task_id;
    }
}

/// Where the result of a call started by [`ForeignRuntime::start_async_method`] goes.
pub type AsyncDone = Box<dyn FnOnce(Result<ForeignReturn, TaskFailure>) + Send>;

static RUNTIME: OnceLock<(String, Box<dyn ForeignRuntime>)> = OnceLock::new();

/// Installs the runtime for `language` (once per process, before `worker::run_worker`).
///
/// # Errors
/// A runtime is already installed.
pub fn set_runtime(language: &str, rt: Box<dyn ForeignRuntime>) -> Result<(), String> {
    RUNTIME
        .set((language.to_string(), rt))
        .map_err(|_| "a language runtime is already installed in this process".to_string())
}

/// The runtime this process hosts, whatever its language.
pub(crate) fn installed_runtime() -> Option<&'static dyn ForeignRuntime> {
    RUNTIME.get().map(|(_, rt)| rt.as_ref())
}

/// The runtime for `language`, if this process hosts one.
pub(crate) fn runtime_for(language: &str) -> Option<&'static dyn ForeignRuntime> {
    RUNTIME.get().filter(|(l, _)| l == language).map(|(_, rt)| rt.as_ref())
}

/// Which language this process submits work in (`rust` unless set before `init`).
static LANGUAGE: OnceLock<String> = OnceLock::new();

/// Sets the language of the functions this process submits (once, before `init`): node
/// agents start workers of that language for its tasks.
///
/// # Errors
/// It was already set to another language.
pub fn set_language(language: &str) -> Result<(), String> {
    let got = LANGUAGE.get_or_init(|| language.to_string());
    if got == language {
        Ok(())
    } else {
        Err(format!("this process already submits {got} functions"))
    }
}

/// This process's submission language.
pub fn language() -> &'static str {
    LANGUAGE.get().map(String::as_str).unwrap_or("rust")
}
