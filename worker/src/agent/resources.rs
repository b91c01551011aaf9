//! The node's resources through the ledger (`ledger.rs`): what leases, actors and job
//! entrypoints take and give back (AGENT-2), CPUs lent while a worker is blocked
//! (AGENT-11), placement-group bundles (AGENT-6), TPU chips (AGENT-7) and GPUs
//! (AGENT-10), stopping idle workers that hold the devices a request needs.
//!
//! AGENT-10: a worker needing GPUs gets `CUDA_VISIBLE_DEVICES` with its own ids
//! (`tpuray_scheduler::gpu`: whole GPUs exclusive, lowest first; a fraction shares one
//! GPU up to its size; GPU-2: more than one must be whole, refused at submission), holds
//! them until it exits however it exits, and is reused only for work needing the same
//! amount; idle holders are stopped when a request could not otherwise get its GPUs.
//!
//! AGENT-11: a leased worker blocked in `get`/`wait` lends its lease's CPUs back to the
//! node until it runs again (`NotifyWorkerBlocked`, sent by the SDK when a wait does not
//! complete at once; Ray does the same), so tasks that wait for other tasks cannot
//! deadlock a full node.

use tpuray_proto::pb;

use super::*;
use crate::ledger::LedgerError;

impl Agent {
    /// Takes `r` from the node's available resources (a job entrypoint's), all or none.
    ///
    /// # Errors
    /// [`AgentError::Ledger`] (`Exhausted`) naming what is needed and what is free.
    pub(crate) fn take_resources(&self, r: &ResourceSet) -> Result<(), AgentError> {
        self.lock()
            .ledger
            .take("a job entrypoint's resources", r)
            .map_err(|e| AgentError::ledger(&self.config.node_id, e))
    }

    /// Gives back what [`Agent::take_resources`] took (once, AGENT-2).
    pub(crate) fn give_back_resources(&self, r: &ResourceSet) {
        self.lock().ledger.release(r);
        self.freed.notify_waiters();
    }

    /// AGENT-11: a leased worker blocked in get/wait lends its lease's CPUs back to the
    /// node (so the work it waits for can run here, as on Ray) and takes them back when it
    /// runs again (the node may be oversubscribed for a moment). Unknown or unleased
    /// workers are ignored; repeated notifications change nothing.
    pub(super) fn set_blocked(&self, worker: &WorkerId, blocked: bool) {
        if self.lend_cpus(worker, blocked) && blocked {
            self.freed.notify_waiters();
        }
    }

    /// [`Agent::set_blocked`]'s bookkeeping; whether anything changed.
    pub(super) fn lend_cpus(&self, worker: &WorkerId, blocked: bool) -> bool {
        let mut st = self.lock();
        let st = &mut *st;
        match st.leases.values_mut().find(|l| &l.worker_id == worker) {
            Some(lease) => st.ledger.lend_cpus(&mut lease.hold, blocked),
            None => false,
        }
    }

    /// The names the bundles `indexes` of `pg` here touch ([`Ledger::bundle_names`]).
    pub(super) fn bundle_names(
        &self,
        pg: &str,
        indexes: &[u32],
    ) -> std::collections::BTreeSet<String> {
        self.lock().ledger.bundle_names(pg, indexes)
    }

    /// The amounts of `names` now, for the head's view ([`Ledger::resources_of`]).
    pub(super) fn resources_of(
        &self,
        names: &std::collections::BTreeSet<String>,
    ) -> pb::NodeResourcesNow {
        self.lock().ledger.resources_of(names)
    }

    /// AGENT-6 phase one ([`Ledger::prepare_bundles`]).
    ///
    /// # Errors
    /// [`AgentError::Ledger`] (`Exhausted`) naming what is missing when they do not all fit
    /// now.
    pub fn prepare_bundles(
        &self,
        pg: &str,
        bundles: &[(u32, ResourceSet)],
    ) -> Result<(), AgentError> {
        self.lock()
            .ledger
            .prepare_bundles(pg, bundles, Instant::now())
            .map_err(|e| AgentError::ledger(&self.config.node_id, e))
    }

    /// AGENT-6 phase two ([`Ledger::commit_bundles`]).
    ///
    /// # Errors
    /// [`AgentError::Ledger`] (`BundleNotPrepared`) when a bundle is not prepared here (it
    /// expired or was returned).
    pub fn commit_bundles(&self, pg: &str, indexes: &[u32]) -> Result<(), AgentError> {
        self.lock()
            .ledger
            .commit_bundles(pg, indexes)
            .map_err(|e| AgentError::ledger(&self.config.node_id, e))?;
        self.freed.notify_waiters();
        Ok(())
    }

    /// Gives back bundles of `pg` on this node (all of them when `indexes` is empty) and
    /// stops the workers that used them (AGENT-6). Returns how many workers were stopped.
    pub fn return_bundles(&self, pg: &str, indexes: &[u32]) -> u32 {
        let mut kill = Vec::new();
        {
            let mut st = self.lock();
            let st = &mut *st;
            st.ledger.return_bundles(pg, indexes);
            let uses = |r: &ResourceSet| crate::ledger::uses_bundles(r, pg, indexes);
            let mut doomed: Vec<WorkerId> = st
                .leases
                .values()
                .filter(|l| uses(&l.hold.resources))
                .map(|l| l.worker_id.clone())
                .collect();
            doomed.extend(
                st.actor_resources.values().filter(|(_, r)| uses(r)).map(|(w, _)| w.clone()),
            );
            for wid in doomed {
                if let Some(w) = st.workers.get_mut(&wid) {
                    w.exit_intended = true;
                    kill.push(w.pid);
                }
            }
        }
        for &pid in &kill {
            signal(pid, libc::SIGKILL);
        }
        self.freed.notify_waiters();
        kill.len() as u32
    }

    /// Returns prepared bundles whose commit never came (AGENT-6).
    pub fn expire_prepared_bundles(&self) {
        let expired = self.lock().ledger.expired_bundles(Instant::now());
        for (pg, i) in expired {
            tracing::warn!(%pg, bundle = i, "prepared bundle was never committed; returning it");
            self.return_bundles(&pg, &[i]);
        }
    }

    /// Takes the lowest free aligned block of `k` chips, or exactly `exact` (AGENT-7,
    /// [`Ledger::allocate_chips`]). When none is free but idle workers hold chips, stops
    /// them and asks the caller to retry ([`AgentError::Unavailable`]).
    pub(super) fn allocate_chips(
        &self,
        k: u32,
        exact: Option<&[u32]>,
    ) -> Result<Vec<u32>, AgentError> {
        let mut st = self.lock();
        match st.ledger.allocate_chips(k, exact) {
            Ok(c) => Ok(c),
            Err(LedgerError::DevicesBusy(e)) => {
                let stopped = stop_idle_holders(&mut st, |k| !k.tpu_chips.is_empty());
                Err(AgentError::Unavailable(format!(
                    "{e}; stopped {stopped} idle worker(s) holding chips, retry shortly"
                )))
            }
            Err(e) => Err(AgentError::ledger(&self.config.node_id, e)),
        }
    }

    /// Gives back the chips and GPUs a worker of `key` held (AGENT-7, AGENT-10).
    pub(super) fn release_devices(&self, key: &PoolKey) {
        self.lock().ledger.release_devices(&key.tpu_chips, &key.gpus);
    }

    /// GPU ids for a worker needing `amount` of GPU (AGENT-10, [`Ledger::allocate_gpus`]).
    /// When the GPUs are held by idle workers, stops them and asks the caller to retry,
    /// as for chips.
    pub(super) fn allocate_gpus(&self, amount: Amount) -> Result<Vec<(u32, Amount)>, AgentError> {
        let mut st = self.lock();
        match st.ledger.allocate_gpus(amount) {
            Ok(g) => Ok(g),
            Err(LedgerError::DevicesBusy(e)) => {
                let stopped = stop_idle_holders(&mut st, |k| !k.gpus.is_empty());
                Err(AgentError::Unavailable(format!(
                    "{e}; stopped {stopped} idle worker(s) holding GPUs, retry shortly"
                )))
            }
            Err(e) => Err(AgentError::ledger(&self.config.node_id, e)),
        }
    }

    /// This host's TPU generation, from its `accelerator-type` label (v6e when unknown: it
    /// only changes the bounds of v7x).
    pub(super) fn tpu_generation(&self) -> tpuray_scheduler::TpuGeneration {
        self.config
            .labels
            .get("tpuray.io/accelerator-type")
            .and_then(tpuray_scheduler::TpuGeneration::parse)
            .unwrap_or(tpuray_scheduler::TpuGeneration::V6e)
    }
}

/// Stops the idle workers whose pool key `holds` devices (chips or GPUs) that a request
/// could not otherwise get; they give them back when they exit (AGENT-7, AGENT-10).
/// Returns how many were stopped.
pub(super) fn stop_idle_holders(st: &mut AgentState, holds: impl Fn(&PoolKey) -> bool) -> usize {
    let mut stopped = 0;
    for w in st.workers.values_mut() {
        if holds(&w.key) && matches!(w.state, WorkerState::Idle { .. }) {
            w.exit_intended = true;
            w.state = WorkerState::Starting;
            signal(w.pid, libc::SIGKILL);
            stopped += 1;
        }
    }
    stopped
}

/// How many chips work needing `demand` takes (AGENT-7), directly or through a bundle.
///
/// # Errors
/// [`AgentError::BadRequest`] naming the valid counts (SCHED-13) for 3, 0.5, ...
pub(super) fn chips_wanted(
    demand: &ResourceSet,
    host_chips: Option<u32>,
) -> Result<u32, AgentError> {
    let amount = tpuray_scheduler::bundles::plain_amount(demand, "TPU");
    if amount.0 == 0 || host_chips.is_none() {
        return Ok(0);
    }
    tpuray_scheduler::chip_count(amount, host_chips)
        .map_err(|e| AgentError::BadRequest(e.to_string()))
}
