//! How a pushed task ends (CORE-5, CORE-12): handed back unrun, retried, failed with
//! its cause, or finished with its returns set in the owner's table.

use super::*;

/// How long the owner waits for a node agent's answer when deciding whether a broken
/// worker means a dead node ([`Core::failure_cause`]).
pub(super) const FAILURE_CAUSE_TIMEOUT: Duration = Duration::from_secs(3);

impl Core {
    /// Finishes a task that was cancelled while it ran; true if it was.
    pub(super) fn finish_if_cancelled(&self, spec: &pb::TaskSpec) -> bool {
        let running = self.running.lock().unwrap().remove(&spec.task_id);
        if running.is_some_and(|r| r.cancelled) {
            self.finish_failed(spec, err(Kind::Cancelled, "cancelled", &spec.name));
            return true;
        }
        false
    }

    /// Queues a task the worker handed back unrun (CORE-9) again, first in line, without
    /// counting an attempt; the class pushes one task at a time for a while.
    pub(super) fn given_back(self: &Arc<Self>, class: &Arc<Class>, q: Queued) {
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
    pub(super) fn retry(self: &Arc<Self>, class: &Arc<Class>, mut q: Queued, detail: &str) {
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
    pub(super) fn worker_died(
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

    pub(super) fn complete(
        self: &Arc<Self>,
        class: &Arc<Class>,
        q: Queued,
        mut reply: pb::PushTaskReply,
    ) {
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
