//! Cancelling tasks and actor calls (CORE-12): queued here, queued or running on a
//! worker, forwarded to a borrowed ref's owner, and recursively what a task submitted.
//!
//! In full:
//! - CORE-12 (`Core::cancel_task`, `Executor::cancel`): a cancelled task is never
//!   retried and its `get` fails with `Cancelled`, wherever it was: queued at the owner
//!   (removed), queued on its worker (never started), or running (`force`: the worker
//!   exits; else the worker marks it cancelled, which a Rust task reads with
//!   `tpuray::is_cancelled()` and a generator stops on, and `ForeignRuntime::cancel`
//!   tells the Python runtime, which raises `KeyboardInterrupt` in the task's thread or
//!   cancels an async method's asyncio task, as Ray does). `recursive` reaches the
//!   tasks it submitted: each worker records the children of the task running on each
//!   executor thread. `force` for an unfinished actor call is refused, as Ray refuses
//!   it.

use super::*;

/// Why `cancel(force=True)` of an actor call is refused (Ray 2.60 refuses it too).
pub(super) const FORCE_ACTOR: &str =
    "force=True is not supported for actor tasks: use kill() on the actor instead";

/// Where a running task is, for cancellation.
pub(super) struct Running {
    pub(super) worker_address: String,
    pub(super) cancelled: bool,
    /// An actor call (`force` is refused for those, as Ray refuses it).
    pub(super) actor: bool,
}

impl Core {
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
}
