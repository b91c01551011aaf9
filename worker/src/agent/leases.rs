//! Worker leases: a request is decided against this node and the head's view of the
//! others, then granted (reusing an idle worker of the same pool key, AGENT-3, or starting
//! one within the start limit, AGENT-8), spilled, queued as pending demand or answered
//! infeasible (AGENT-4); returned leases give their resources back once (AGENT-2).
//!
//! AGENT-12: a lease request with node affinity to a node missing from the agent's view
//! of the cluster (it joined after the last heartbeat's view, HEAD-13) reads the live
//! nodes from the head before deciding, so a soft affinity does not fall back to another
//! node and a hard one is not refused while the node is there (a soft-affinity task
//! landed on the head node in the multi-host benchmark).

use std::collections::HashMap;
use std::sync::Arc;
use std::time::{Duration, Instant};

use pb::request_worker_lease_reply::{Busy, Infeasible, Outcome, SetupFailed, Spillback};
use tpuray_proto::ids::{LeaseId, WorkerId};
use tpuray_proto::{now_ms, pb};
use tpuray_scheduler::{Amount, Decision, NodeView, ResourceSet};

use super::resources::chips_wanted;
use super::soft_state::WaitingGuard;
use super::{Agent, AgentError, AgentState, Lease, PoolKey, WorkerEntry, WorkerState, signal};
use crate::ledger::Hold;

impl Agent {
    /// AGENT-16: a draining node takes no new work; the head already counts it dead, so
    /// the caller's next request goes elsewhere.
    ///
    /// # Errors
    /// [`AgentError::Unavailable`] naming the node while it drains.
    pub(super) fn refuse_if_draining(&self) -> Result<(), AgentError> {
        if self.is_draining() {
            return Err(AgentError::Unavailable(format!(
                "node {} is draining (it received SIGTERM) and grants no leases",
                self.config.node_id
            )));
        }
        Ok(())
    }

    /// Answers a lease request for a worker of `key` (AGENT-4): granted here, spilled to
    /// the node the head's view names, infeasible (listed as infeasible demand), busy once
    /// `deadline` passes while it queued (listed as pending demand until then), or its
    /// runtime environment's setup failure (AGENT-14). `grant_or_reject`: decide on this
    /// node alone (a spilled request's second hop). `owner`: the lease holder's address.
    ///
    /// # Errors
    /// What granting failed with, other than a runtime environment setup failure.
    pub(super) async fn request_lease(
        self: &Arc<Self>,
        key: PoolKey,
        request: tpuray_scheduler::Request<String>,
        deadline: Option<Instant>,
        grant_or_reject: bool,
        owner: String,
    ) -> Result<Outcome, AgentError> {
        let agent = self;
        let demand = request.demand.clone();
        let local_id = agent.config.node_id.to_string();
        // AGENT-12: node affinity to a node this agent's view lacks (it joined after the
        // last heartbeat's view) asks the head first, so a soft affinity does not fall
        // back and a hard one is not refused for a node that is there.
        if let tpuray_scheduler::Strategy::NodeAffinity { node, .. } = &request.strategy
            && *node != local_id
            && !grant_or_reject
            && !agent.lock().cluster.iter().any(|(v, _)| v.id == *node)
        {
            agent.refresh_cluster_view().await;
        }
        // Counts this request as pending demand while it waits; if the
        // request is dropped mid-wait (the client hung up), the guard takes
        // it off the books (AGENT-4).
        let guard =
            WaitingGuard { agent, demand: demand.clone(), waiting: std::cell::Cell::new(false) };
        let outcome = loop {
            let freed = agent.freed.notified();
            tokio::pin!(freed);
            freed.as_mut().enable();
            let decision = {
                let mut st = agent.lock();
                let mut views: Vec<NodeView<String>> = vec![agent.local_view(&st)];
                if !grant_or_reject {
                    views.extend(st.cluster.iter().map(|(v, _)| v.clone()));
                }
                let d = tpuray_scheduler::schedule(&request, &views, Some(&local_id), now_ms());
                match &d {
                    Decision::Place(n) if *n == local_id => {
                        if guard.waiting.get() {
                            agent.note_demand(&mut st, &demand, false, "", -1);
                        }
                        guard.waiting.set(false);
                        // AGENT-2: take the demand now, under the lock the decision saw the
                        // node under; taken later (at grant), two requests deciding at once
                        // both fitted the same free CPU, the second subtraction saturated at
                        // 0, and the node's available resources stayed above the truth after
                        // both returned (phantom CPUs, seen in `ray_resources`).
                        st.ledger.take_anyway(&demand);
                    }
                    Decision::Infeasible { reason } => {
                        if guard.waiting.get() {
                            agent.note_demand(&mut st, &demand, false, "", -1);
                            guard.waiting.set(false);
                        }
                        agent.note_demand(&mut st, &demand, true, reason, 0);
                    }
                    Decision::Queue { reason } => {
                        if !guard.waiting.get() {
                            agent.note_demand(&mut st, &demand, false, reason, 1);
                            guard.waiting.set(true);
                        }
                    }
                    Decision::Place(_) => {
                        if guard.waiting.get() {
                            agent.note_demand(&mut st, &demand, false, "", -1);
                        }
                        guard.waiting.set(false);
                    }
                }
                // Feasible here but busy: queue locally. Feasible only elsewhere: spill there.
                if let Decision::Queue { .. } = &d {
                    let local_fits = st.ledger.total().is_superset_of(&demand)
                        && request.label_selector.iter().all(|c| c.matches(&agent.config.labels));
                    if !local_fits && !grant_or_reject {
                        let best = st
                            .cluster
                            .iter()
                            .filter(|(v, _)| {
                                v.total.is_superset_of(&demand)
                                    && request.label_selector.iter().all(|c| c.matches(&v.labels))
                            })
                            .min_by_key(|(v, _)| v.id.clone())
                            .map(|(v, a)| (v.id.clone(), a.clone()));
                        if let Some((node_id, address)) = best {
                            if guard.waiting.get() {
                                agent.note_demand(&mut st, &demand, false, "", -1);
                            }
                            break Outcome::Spillback(Spillback { node_id, address });
                        }
                    }
                }
                (
                    d,
                    st.cluster
                        .iter()
                        .map(|(v, a)| (v.id.clone(), a.clone()))
                        .collect::<HashMap<_, _>>(),
                )
            };
            match decision {
                (Decision::Place(n), _) if n == local_id => {
                    match agent.grant_lease(key.clone(), demand.clone(), owner.clone()).await {
                        Ok(g) => break Outcome::Granted(g),
                        // AGENT-14: a failed environment is an answer, not an RPC error
                        // (which the owner would retry forever).
                        Err(AgentError::SetupFailed(message)) => {
                            break Outcome::SetupFailed(SetupFailed { message });
                        }
                        Err(e) => return Err(e),
                    }
                }
                (Decision::Place(n), addrs) => {
                    let address = addrs.get(&n).cloned().unwrap_or_default();
                    break Outcome::Spillback(Spillback { node_id: n, address });
                }
                (Decision::Infeasible { reason }, _) => {
                    break Outcome::Infeasible(Infeasible { reason });
                }
                (Decision::Queue { reason }, _) => {
                    // Wake when resources free up here, and re-check every
                    // 200 ms anyway: other nodes' views change with heartbeats
                    // and the request may now spill to one of them.
                    let _ = tokio::time::timeout(Duration::from_millis(200), freed).await;
                    if deadline.is_some_and(|d| Instant::now() >= d) {
                        // The guard takes it off the pending demand.
                        break Outcome::Busy(Busy { reason });
                    }
                }
            }
        };
        Ok(outcome)
    }

    /// Takes an idle worker with `key`, if any, and marks it leased.
    pub(super) fn take_idle(
        &self,
        st: &mut AgentState,
        key: &PoolKey,
        chips: u32,
        gpus: Amount,
        lease: &LeaseId,
    ) -> Option<(WorkerId, String, u32)> {
        // AGENT-3/7: same job, language and env, and a block of the same size.
        let fits = |w: &WorkerEntry| {
            w.key.job_id == key.job_id
                && w.key.language == key.language
                && w.key.runtime_env_hash == key.runtime_env_hash
                && w.key.tpu_chips.len() == chips as usize
                && w.key.gpus.iter().map(|(_, a)| a.0).sum::<i64>() == gpus.0
        };
        let id = st
            .workers
            .iter()
            .filter(|(_, w)| fits(w) && matches!(w.state, WorkerState::Idle { .. }))
            .map(|(id, _)| id.clone())
            .next()?;
        let w = st.workers.get_mut(&id)?;
        w.state = WorkerState::Leased(lease.clone());
        Some((id, w.address.clone(), w.pid))
    }

    /// Grants a lease. The grant runs as a task of its own; if the caller's
    /// request is dropped before the answer (the client hung up), the lease
    /// is returned as soon as the grant finishes (AGENT-2).
    pub(super) async fn grant_lease(
        self: &Arc<Self>,
        key: PoolKey,
        demand: ResourceSet,
        owner: String,
    ) -> Result<pb::request_worker_lease_reply::Granted, AgentError> {
        struct ReturnIfDropped {
            agent: Arc<Agent>,
            handle: Option<
                tokio::task::JoinHandle<
                    Result<pb::request_worker_lease_reply::Granted, AgentError>,
                >,
            >,
        }
        impl Drop for ReturnIfDropped {
            fn drop(&mut self) {
                if let Some(h) = self.handle.take() {
                    let agent = Arc::clone(&self.agent);
                    tokio::spawn(async move {
                        if let Ok(Ok(g)) = h.await {
                            agent.return_lease(&LeaseId::from_wire(g.lease_id), false);
                        }
                    });
                }
            }
        }
        let agent = Arc::clone(self);
        let mut guard = ReturnIfDropped {
            agent: Arc::clone(self),
            handle: Some(tokio::spawn(
                async move { agent.grant_lease_now(key, demand, owner).await },
            )),
        };
        let result = guard.handle.as_mut().expect("handle is set").await;
        guard.handle = None;
        result.map_err(|e| AgentError::Internal(format!("lease grant failed: {e}")))?
    }

    /// Returns a lease: its resources come back, its worker goes idle (or is
    /// killed with `disconnect`). Returning twice is harmless (AGENT-2).
    pub fn return_lease(&self, lease_id: &LeaseId, disconnect: bool) {
        let kill = {
            let mut st = self.lock();
            let Some(lease) = st.leases.remove(lease_id) else {
                return;
            };
            st.ledger.release(&lease.hold.resources);
            match st.workers.get_mut(&lease.worker_id) {
                Some(w) if disconnect => {
                    w.exit_intended = true;
                    w.state = WorkerState::Starting;
                    Some(w.pid)
                }
                Some(w) => {
                    w.state = WorkerState::Idle { since: Instant::now() };
                    None
                }
                None => None,
            }
        };
        if let Some(pid) = kill {
            signal(pid, libc::SIGKILL);
        }
        self.freed.notify_waiters();
    }

    /// Starts the worker of a lease. When the chips it needs are held by idle workers
    /// that are being stopped (AGENT-7), waits for them to exit and tries again (up to
    /// 10 s) rather than failing the lease.
    pub(super) async fn start_leased_worker(
        self: &Arc<Self>,
        key: PoolKey,
        chips: u32,
        gpus: Amount,
        lease_id: &LeaseId,
    ) -> Result<(WorkerId, String, u32), AgentError> {
        let deadline = Instant::now() + Duration::from_secs(10);
        loop {
            let freed = self.freed.notified();
            match self
                .start_worker(key.clone(), chips, gpus, WorkerState::Leased(lease_id.clone()), None)
                .await
            {
                Err(e)
                    if e.is_unavailable()
                        && (chips > 0 || gpus.0 > 0)
                        && Instant::now() < deadline =>
                {
                    tracing::debug!(%e, "waiting for TPU chips to be freed");
                    let _ = tokio::time::timeout(Duration::from_millis(200), freed).await;
                }
                other => return other,
            }
        }
    }

    pub(super) async fn grant_lease_now(
        self: &Arc<Self>,
        key: PoolKey,
        demand: ResourceSet,
        owner: String,
    ) -> Result<pb::request_worker_lease_reply::Granted, AgentError> {
        let lease_id = LeaseId::random();
        let chips = match chips_wanted(&demand, self.lock().ledger.host_chips()) {
            Ok(c) => c,
            Err(e) => {
                // The decision took the demand (AGENT-2): it goes back with the refusal.
                let mut st = self.lock();
                st.ledger.release(&demand);
                drop(st);
                self.freed.notify_waiters();
                return Err(e);
            }
        };
        let gpus = tpuray_scheduler::bundles::plain_amount(&demand, "GPU");
        let reused = {
            let mut st = self.lock();
            // The demand was taken from `available` when the lease was decided (under the
            // same lock as the decision: see `request_worker_lease`).
            st.leases.insert(
                lease_id.clone(),
                Lease {
                    worker_id: WorkerId::from_wire(""),
                    hold: Hold::new(demand.clone()),
                    owner,
                },
            );
            let reused = self.take_idle(&mut st, &key, chips, gpus, &lease_id);
            if let (Some((wid, _, _)), Some(l)) = (&reused, st.leases.get_mut(&lease_id)) {
                l.worker_id = wid.clone();
            }
            reused
        };
        // AGENT-8: wait for a start slot, taking an idle worker instead if one frees up.
        let mut permit = None;
        let mut reused = reused;
        while reused.is_none() && permit.is_none() {
            let freed = self.freed.notified();
            tokio::pin!(freed);
            freed.as_mut().enable();
            reused = {
                let mut st = self.lock();
                let r = self.take_idle(&mut st, &key, chips, gpus, &lease_id);
                if let (Some((wid, _, _)), Some(l)) = (&r, st.leases.get_mut(&lease_id)) {
                    l.worker_id = wid.clone();
                }
                r
            };
            if reused.is_none() {
                tokio::select! {
                    p = Arc::clone(&self.starts).acquire_owned() => permit = Some(p),
                    _ = freed => {}
                }
            }
        }
        let (worker_id, address, pid) = match reused {
            Some(w) => w,
            None => match self.start_leased_worker(key, chips, gpus, &lease_id).await {
                Ok(w) => {
                    if let Some(l) = self.lock().leases.get_mut(&lease_id) {
                        l.worker_id = w.0.clone();
                    }
                    w
                }
                Err(e) => {
                    let mut st = self.lock();
                    if let Some(l) = st.leases.remove(&lease_id) {
                        st.ledger.release(&l.hold.resources);
                    }
                    drop(st);
                    self.freed.notify_waiters();
                    return Err(e);
                }
            },
        };
        Ok(pb::request_worker_lease_reply::Granted {
            lease_id: lease_id.to_string(),
            worker_id: worker_id.to_string(),
            worker_address: address,
            worker_pid: pid,
            node_id: self.config.node_id.to_string(),
        })
    }
}
