//! Worker processes ending and the agent ending: a worker's exit gives back what it held
//! (AGENT-2) and reports an actor's to the head; idle workers are reaped, orphaned leases
//! reclaimed (AGENT-5); draining waits for running work (AGENT-16) and shutdown stops
//! every worker.
//!
//! AGENT-16's drain, in order, is described in `run.rs`: refuse leases, `UnregisterNode`,
//! wait up to `--drain-grace-period` for running work (`Agent::wait_drained`), stop the
//! workers.

use tonic::Request;
use tpuray_proto::pb;

use super::spawn::describe_exit;
use super::*;
use crate::registry;

impl Agent {
    /// Called once per worker process exit: frees what it held, reports an
    /// actor worker's exit to the head.
    pub(super) fn on_worker_exit(
        self: &Arc<Self>,
        worker_id: &WorkerId,
        pid: u32,
        status: Option<std::process::ExitStatus>,
    ) {
        registry::remove(pid);
        let mut report = None;
        {
            let mut st = self.lock();
            st.starting.remove(worker_id);
            let Some(entry) = st.workers.remove(worker_id) else {
                return;
            };
            // AGENT-7/10: chips and GPUs come back however the process ended.
            st.ledger.release_devices(&entry.key.tpu_chips, &entry.key.gpus);
            match &entry.state {
                WorkerState::Leased(lease_id) => {
                    if let Some(lease) = st.leases.remove(lease_id) {
                        st.ledger.release(&lease.hold.resources);
                    }
                }
                WorkerState::Actor(actor_id) => {
                    if let Some((_, r)) = st.actor_resources.remove(actor_id) {
                        st.ledger.release(&r);
                    }
                    report = Some((actor_id.clone(), entry.exit_intended));
                }
                WorkerState::Starting | WorkerState::Idle { .. } => {}
            }
        }
        self.freed.notify_waiters();
        let detail = describe_exit(status);
        tracing::info!(%worker_id, pid, %detail, "worker exited");
        if let Some((actor_id, intended)) = report {
            let agent = Arc::clone(self);
            let worker_id = worker_id.clone();
            tokio::spawn(async move {
                agent.report_actor_exit(actor_id, worker_id, intended, detail).await;
            });
        }
    }

    pub(super) async fn report_actor_exit(
        &self,
        actor_id: ActorId,
        worker_id: WorkerId,
        intended: bool,
        detail: String,
    ) {
        let req = pb::ReportActorWorkerExitRequest {
            request_id: tpuray_proto::new_request_id(),
            node_id: self.config.node_id.to_string(),
            actor_id: actor_id.to_string(),
            worker_id: worker_id.to_string(),
            intended,
            detail: format!("the actor's worker process {detail}"),
        };
        // Retry with the same request id until the head takes it (HEAD-2).
        for attempt in 0..30 {
            let Ok(mut head) =
                tpuray_proto::client::head(&self.head_leader(), self.config.token.as_deref())
            else {
                return;
            };
            match head.report_actor_worker_exit(req.clone()).await {
                Ok(_) => return,
                Err(s) if s.code() == tonic::Code::NotFound => return,
                Err(s) => {
                    tracing::warn!(%actor_id, attempt, %s, "reporting actor exit failed; retrying");
                    tokio::time::sleep(Duration::from_millis(500)).await;
                }
            }
        }
    }

    /// Stops idle workers beyond the pool's soft limit once they have been
    /// idle for the idle timeout.
    pub fn reap_idle_workers(&self) {
        let mut victims = Vec::new();
        {
            let mut st = self.lock();
            let mut idle: Vec<(Instant, WorkerId)> = st
                .workers
                .iter()
                .filter_map(|(id, w)| match w.state {
                    WorkerState::Idle { since } => Some((since, id.clone())),
                    _ => None,
                })
                .collect();
            if idle.len() <= self.config.max_idle_workers {
                return;
            }
            idle.sort();
            let excess = idle.len() - self.config.max_idle_workers;
            for (since, id) in idle.into_iter().take(excess) {
                if since.elapsed() >= self.config.idle_worker_timeout
                    && let Some(w) = st.workers.get_mut(&id)
                {
                    w.exit_intended = true;
                    // Not idle any more: nobody may lease it while it exits.
                    w.state = WorkerState::Starting;
                    victims.push(w.pid);
                }
            }
        }
        for pid in victims {
            signal(pid, libc::SIGTERM);
        }
    }

    /// AGENT-16: waits until no worker of this node runs a task or an actor call, at most
    /// `grace`; returns how many still ran when it gave up (0: all finished). What runs is
    /// what each live worker last reported (every 0.5 s, `ReportMetrics`); a live worker
    /// holding a lease counts as running for the first second, until its first report
    /// can arrive.
    pub async fn wait_drained(&self, grace: Duration) -> usize {
        let started = Instant::now();
        loop {
            let running = self.metrics.running_by_pid();
            let (busy, leased): (usize, usize) = {
                let st = self.lock();
                // Workers that exited (`tpuray stop` stops workers before agents) run
                // nothing, whatever they last reported.
                let live: Vec<&WorkerEntry> = st
                    .workers
                    .values()
                    .filter(|w| registry::proc_start_time(w.pid).is_some())
                    .collect();
                let busy =
                    live.iter().filter(|w| running.get(&w.pid).copied().unwrap_or(0) > 0).count();
                let leased =
                    live.iter().filter(|w| matches!(w.state, WorkerState::Leased(_))).count();
                (busy, leased)
            };
            let settling = leased > 0 && started.elapsed() < Duration::from_secs(1);
            if busy == 0 && !settling {
                return 0;
            }
            if started.elapsed() >= grace {
                return busy.max(usize::from(settling));
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }

    /// Stops every worker (agent shutdown) and waits up to `grace` for them.
    pub async fn stop_all_workers(&self, grace: Duration) {
        self.stopping.store(true, std::sync::atomic::Ordering::SeqCst);
        let pids: Vec<u32> = {
            let mut st = self.lock();
            st.workers
                .values_mut()
                .map(|w| {
                    w.exit_intended = true;
                    w.pid
                })
                .collect()
        };
        for &pid in &pids {
            signal(pid, libc::SIGTERM);
        }
        // Job entrypoints: their whole process groups (AGENT-13).
        let groups = self.supervisors.process_groups();
        for &g in &groups {
            // SAFETY: kill(2) on an entrypoint's own process group.
            unsafe { libc::kill(-(g as i32), libc::SIGTERM) };
        }
        let deadline = Instant::now() + grace;
        while Instant::now() < deadline
            && pids.iter().any(|&p| registry::proc_start_time(p).is_some())
        {
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        for &pid in &pids {
            if registry::proc_start_time(pid).is_some() {
                signal(pid, libc::SIGKILL);
            }
            registry::remove(pid);
        }
        for &g in &groups {
            // SAFETY: as above; whatever of the group is left.
            unsafe { libc::kill(-(g as i32), libc::SIGKILL) };
        }
    }

    /// AGENT-5: returns the leases of holders that no longer answer (a
    /// driver or worker that exited without returning them). Their workers
    /// may still run the dead holder's task, so they are stopped.
    pub async fn reclaim_orphaned_leases(&self) {
        let owners: std::collections::HashSet<String> = self
            .lock()
            .leases
            .values()
            .map(|l| l.owner.clone())
            .filter(|o| !o.is_empty())
            .collect();
        for owner in owners {
            let Ok(mut c) = tpuray_proto::client::worker(&owner, self.config.token.as_deref())
            else {
                continue;
            };
            let mut req = Request::new(pb::GetWorkerInfoRequest {});
            req.set_timeout(Duration::from_secs(2));
            let gone = matches!(c.get_worker_info(req).await, Err(s) if s.code() == tonic::Code::Unavailable);
            if gone {
                let ids: Vec<LeaseId> = self
                    .lock()
                    .leases
                    .iter()
                    .filter(|(_, l)| l.owner == owner)
                    .map(|(id, _)| id.clone())
                    .collect();
                tracing::info!(%owner, leases = ids.len(), "lease holder is gone; reclaiming its leases");
                for id in ids {
                    self.return_lease(&id, true);
                }
            }
        }
    }
}
