//! How a pushed task ends (CORE-5, CORE-12): handed back unrun, retried, failed with
//! its cause, or finished with its returns set in the owner's table.

use super::*;

/// How long the owner waits for a node agent's answer when deciding whether a broken
/// worker means a dead node ([`Core::failure_cause`]).
pub(super) const FAILURE_CAUSE_TIMEOUT: Duration = Duration::from_secs(3);

/// How an attempt of a pushed task ended, with what carrying out the decision needs.
pub(super) enum Ended {
    /// The worker answered: the task returned, or raised (the reply's `error`).
    Replied(pb::PushTaskReply),
    /// The worker handed it back unrun (CORE-9).
    HandedBack,
    /// The worker's connection broke: `detail` names the worker, and the node's agent
    /// is asked whether the node died ([`Core::failure_cause`]).
    Lost { detail: String, node_id: String, agent_address: String },
}

impl Core {
    /// An attempt of task `q` of `class` ended: [`retry::decide`] says what follows
    /// (CORE-5, CORE-12), and this carries it out.
    pub(super) fn task_ended(self: &Arc<Self>, class: &Arc<Class>, mut q: Queued, ended: Ended) {
        let cancelled =
            self.running.lock().unwrap().remove(&q.spec.task_id).is_some_and(|r| r.cancelled);
        let attempt = retry::Attempt {
            work: retry::Work::Task,
            retries_left: q.retries_left,
            retry_exceptions: q.retry_exceptions,
            cancelled,
            undelivered: 0,
        };
        let outcome = match &ended {
            Ended::Replied(reply) => match &reply.error {
                Some(e) => retry::Outcome::Raised {
                    application: e.kind == Kind::Application as i32,
                    no_retry: e.no_retry,
                },
                None => retry::Outcome::Returned,
            },
            Ended::HandedBack => retry::Outcome::HandedBack,
            Ended::Lost { .. } => retry::Outcome::Lost { reached: true },
        };
        match (retry::decide(&attempt, outcome), ended) {
            (retry::Decision::FailCancelled, _) => {
                self.finish_failed(&q.spec, err(Kind::Cancelled, "cancelled", &q.spec.name));
            }
            (retry::Decision::Finish, Ended::Replied(reply)) => self.complete(class, q, reply),
            (retry::Decision::Requeue, _) => {
                // Queued again first in line; the class pushes one task at a time for a
                // while.
                class.shallow_until_ms.store(
                    now_ms() + SHALLOW_AFTER_GIVE_BACK.as_millis() as u64,
                    Ordering::Relaxed,
                );
                class.queue.lock().unwrap().push_front(q);
                class.queued.notify_one();
                self.ensure_leases(class);
            }
            (retry::Decision::Retry { retries_left }, ended) => {
                let detail = match ended {
                    Ended::Replied(r) => r.error.map(|e| e.message).unwrap_or_default(),
                    Ended::Lost { detail, .. } => detail,
                    Ended::HandedBack => String::new(),
                };
                q.retries_left = retries_left;
                q.spec.attempt += 1;
                self.event(&q.spec, "RETRYING", &detail);
                class.queue.lock().unwrap().push_back(q);
                class.queued.notify_one();
                self.ensure_leases(class);
            }
            (retry::Decision::Fail, Ended::Replied(mut reply)) => {
                let e = reply.error.take().unwrap_or_default();
                self.finish_failed(&q.spec, e);
            }
            (retry::Decision::Fail, Ended::Lost { detail, node_id, agent_address }) => {
                let core = Arc::clone(self);
                self.rt.spawn(async move {
                    let e = match core.failure_cause(&node_id, &agent_address).await {
                        Some(node_dead) => err(Kind::NodeDied, node_dead, &q.spec.name),
                        None => err(
                            Kind::WorkerDied,
                            format!("{detail} (no retries left)"),
                            &q.spec.name,
                        ),
                    };
                    core.finish_failed(&q.spec, e);
                });
            }
            (decision, _) => {
                // decide() gives tasks none of these (a Finish comes only with a reply,
                // a Resend only for actor calls): fail loudly rather than lose the task.
                let e = err(
                    Kind::WorkerDied,
                    format!("internal error: retry decision {decision:?} for a task"),
                    &q.spec.name,
                );
                self.finish_failed(&q.spec, e);
            }
        }
    }

    /// Why a worker on `node_id` broke, as Ray's owner decides it: the node's agent is
    /// asked (Ray asks the raylet for the task's failure cause); when the head already
    /// declared the node dead, or its agent does not answer within
    /// [`FAILURE_CAUSE_TIMEOUT`], the node died (the message, for `NodeDiedError`);
    /// otherwise only the worker did (`None`). Ray's rule:
    /// `GetErrorInfoFromGetTaskFailureCauseReply`, ray `src/ray/core_worker/`.
    pub(super) async fn failure_cause(&self, node_id: &str, agent_address: &str) -> Option<String> {
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

    /// Sets the returns of task `q`, which returned (`reply` has no error).
    pub(super) fn complete(
        self: &Arc<Self>,
        class: &Arc<Class>,
        q: Queued,
        reply: pb::PushTaskReply,
    ) {
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

    pub(super) fn finish_ok(&self, spec: &pb::TaskSpec, reply: pb::PushTaskReply) {
        self.finish_ok_with(spec, reply, None);
    }

    pub(super) fn finish_ok_with(
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
                        task_id: None,
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

    pub(super) fn finish_failed(&self, spec: &pb::TaskSpec, mut e: pb::TaskError) {
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
}
