//! An actor's calls: each caller's calls released in sequence order (CORE-4), each to
//! its concurrency group's executor threads, or (an async method of a foreign runtime
//! whose arguments all came inline) straight onto that runtime's event loop, within the
//! group's limit.

use std::sync::Arc;
use std::sync::atomic::AtomicU8;

use tokio::sync::oneshot;
use tpuray_proto::pb;
use tpuray_proto::pb::task_error::Kind;

use super::context::task_cancelled;
use super::invoke::{foreign_of, task_info};
use super::replies::{failure, stopped};
use super::{Executor, Job, QUEUED, Replier};
use crate::codec::Encoded;
use crate::error::TaskFailure;
use crate::foreign::ForeignRuntime;

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

impl Executor {
    /// Accepts a pushed task; the reply arrives when it has run, or (a task queued behind
    /// another, CORE-9) when it is handed back unrun: `not_run` set.
    pub(crate) async fn push(self: &Arc<Self>, spec: pb::TaskSpec) -> pb::PushTaskReply {
        if spec.actor_id.is_empty() {
            return self.enqueue_task(spec).reply().await;
        }
        let (tx, rx) = oneshot::channel();
        self.push_call(spec, Replier::Rpc(tx));
        rx.await.unwrap_or_else(|_| stopped())
    }

    /// Accepts an actor call (`spec.actor_id` set): released in its caller's sequence
    /// order (CORE-4) to its concurrency group, and answered through `reply` from the
    /// thread that finishes it.
    pub(crate) fn push_call(self: &Arc<Self>, spec: pb::TaskSpec, reply: Replier) {
        let job = Job { spec, reply, state: Arc::new(AtomicU8::new(QUEUED)) };
        let Some(actor) = &self.actor else {
            let failed = failure(
                &job.spec,
                &self.core,
                TaskFailure::new(Kind::ActorDied, "this worker hosts no actor"),
            );
            job.reply.send(failed);
            return;
        };
        self.running.lock().unwrap().insert(job.spec.task_id.clone(), ());
        // CORE-4: release each caller's calls in sequence order.
        let mut callers = actor.callers.lock().unwrap();
        let q = callers.entry(job.spec.caller_id.clone()).or_default();
        q.arrive(job.spec.sequence_no, job);
        while let Some(j) = q.release() {
            let group = match self.group_of(&j.spec) {
                Ok(g) => g,
                Err(message) => {
                    let reply =
                        failure(&j.spec, &self.core, TaskFailure::new(Kind::Application, message));
                    self.running.lock().unwrap().remove(&j.spec.task_id);
                    j.reply.send(reply);
                    continue;
                }
            };
            match loop_runtime(&j.spec) {
                Some(rt) => self.start_on_loop(rt, j, group),
                None => match self.groups.get(&group) {
                    Some((_, tx)) => {
                        let _ = tx.send(j);
                    }
                    None => self.queue(j),
                },
            }
        }
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
        let start = {
            let limit = self.group_limit(&group);
            let mut on_loop = self.on_loop.lock().unwrap();
            on_loop.entry(group.clone()).or_default().start(limit, job)
        };
        if let Some(job) = start {
            self.launch_on_loop(rt, job, group);
        }
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
            reply.send(self.finish(&spec, Err(failed)));
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
                reply.send(ex.finish(&spec, result.map(Encoded::Foreign)));
                if let Some(j) = ex.next_on_loop(&group) {
                    ex.launch_on_loop(rt, j, group);
                }
            }),
        );
    }

    /// The call of `group` waiting first for the place a call just gave up (which it
    /// takes), or `None` (the place is free again).
    fn next_on_loop(&self, group: &str) -> Option<Job> {
        self.on_loop.lock().unwrap().entry(group.to_string()).or_default().ended()
    }
}
