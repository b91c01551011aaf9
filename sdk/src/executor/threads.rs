//! The executor threads: each takes jobs from its group's queue until the executor
//! stops; a task (not an actor call) queued behind another is handed back unrun when
//! that one blocks or runs long (CORE-9); running one call on a thread.

use std::sync::atomic::{AtomicU8, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use tokio::sync::oneshot;
use tpuray_proto::pb;
use tpuray_proto::pb::task_error::Kind;

use super::context::{Current, CurrentTask, task_cancelled};
use super::invoke::task_info;
use super::replies::stopped;
use super::{Executor, HANDED_BACK, Job, QUEUED, Replier, STARTED};
use crate::core::Core;
use crate::error::TaskFailure;

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

/// A task queued behind another on this worker longer than this goes back to
/// its owner unrun (CORE-9): owners queue several only while their tasks are
/// quick, so a wait this long means the one in front is slow.
const QUEUED_MAX: Duration = Duration::from_millis(50);

/// Executor threads taking jobs from `rx` until the executor stops.
pub(super) fn spawn_threads(
    ex: &Arc<Executor>,
    rx: std::sync::mpsc::Receiver<Job>,
    threads: usize,
    group: &str,
) {
    let rx = Arc::new(Mutex::new(rx));
    let default_group = group.is_empty();
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
                    let job = {
                        let rx = rx.lock().unwrap();
                        match ex.idle_reader.as_ref().filter(|_| default_group) {
                            Some(idle) => idle.next_job(&rx),
                            None => rx.recv(),
                        }
                    };
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
                            job.reply
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
                    job.reply.send(reply);
                }
            })
            .expect("spawn executor thread");
    }
}

impl Executor {
    /// Queues a task (not an actor call) behind those queued before it; its reply comes
    /// from [`QueuedTask::reply`].
    pub(crate) fn enqueue_task(&self, spec: pb::TaskSpec) -> QueuedTask {
        let (tx, rx) = oneshot::channel();
        let state = Arc::new(AtomicU8::new(QUEUED));
        self.running.lock().unwrap().insert(spec.task_id.clone(), ());
        self.queue(Job { spec, reply: Replier::Rpc(tx), state: Arc::clone(&state) });
        QueuedTask { core: Arc::clone(&self.core), rx, state }
    }

    /// Queues a task (not an actor call) as [`Executor::enqueue_task`] does, with its
    /// reply going to `reply` from the executor thread that ran it (a direct connection,
    /// CORE-15). Queued behind another task, it is handed back unrun (`not_run`) when that
    /// one blocks or after 50 ms, as there (CORE-9): a runtime task watches it until then.
    pub(crate) fn enqueue_task_to(&self, spec: pb::TaskSpec, reply: Replier) {
        let state = Arc::new(AtomicU8::new(QUEUED));
        let idle = {
            let mut running = self.running.lock().unwrap();
            let idle = running.is_empty();
            running.insert(spec.task_id.clone(), ());
            idle
        };
        if idle {
            // Nothing in front of it: it starts at once, and nothing can hand it back.
            self.queue(Job { spec, reply, state });
            return;
        }
        let slot = Arc::new(Mutex::new(Some(reply)));
        let watched = (Arc::clone(&self.core), Arc::clone(&slot), Arc::clone(&state));
        self.queue(Job { spec, reply: Replier::Either(slot), state });
        self.core.rt.spawn(async move {
            let (core, slot, state) = watched;
            let blocked = core.blocked_now.notified();
            tokio::pin!(blocked);
            blocked.as_mut().enable();
            tokio::select! {
                () = &mut blocked => {}
                () = tokio::time::sleep(QUEUED_MAX) => {}
                () = async {}, if core.is_blocked() => {}
            }
            if state
                .compare_exchange(QUEUED, HANDED_BACK, Ordering::SeqCst, Ordering::SeqCst)
                .is_ok()
            {
                Replier::Either(slot)
                    .send(pb::PushTaskReply { not_run: true, ..Default::default() });
            }
        });
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
}
