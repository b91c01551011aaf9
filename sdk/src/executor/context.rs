//! Which task or actor call each executor thread runs now (its id, placement group and
//! whether that group captures what it submits), and cancellation (CORE-12): the tasks
//! of this process told to stop, and [`Executor::cancel`].

use std::cell::RefCell;
use std::collections::HashSet;
use std::sync::{Mutex, OnceLock};
use std::time::Duration;

use super::Executor;

/// The task or actor call an executor thread runs: its id, the placement group it runs
/// in ("" for none), and whether that group captures what it submits.
#[derive(Clone)]
pub(super) struct Current {
    pub(super) task_id: String,
    pub(super) placement_group: String,
    pub(super) capture: bool,
}

thread_local! {
    /// The task or actor call this executor thread runs now.
    static CURRENT_TASK: RefCell<Option<Current>> = const { RefCell::new(None) };
}

/// Tasks of this process told to stop (`cancel` without `force`, CORE-12), until they end.
pub(super) fn cancelled_set() -> &'static Mutex<HashSet<String>> {
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
pub(super) struct CurrentTask;

impl CurrentTask {
    pub(super) fn enter(current: Current) -> Self {
        CURRENT_TASK.with(|c| *c.borrow_mut() = Some(current));
        CurrentTask
    }
}

impl Drop for CurrentTask {
    fn drop(&mut self) {
        CURRENT_TASK.with(|c| *c.borrow_mut() = None);
    }
}

impl Executor {
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
}
