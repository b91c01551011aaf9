//! The node agent's resource ledger: what the node has, what is free, the
//! placement-group bundles reserved here, the CPUs a blocked worker lends back, and the
//! TPU chips and GPUs handed to worker processes.
//!
//! A plain state machine (issue 22's shape for the agent): no locks, clocks, sockets or
//! processes of its own. The agent holds it under its state lock, passes the time in
//! where a rule needs one, carries out what a call returns (stopping workers, waking
//! waiters) and turns a [`LedgerError`] into a gRPC status at the service edge
//! (`agent/service.rs`, `ledger_status`).
//!
//! Invariants (the agent's numbering, `agent/mod.rs`):
//! - AGENT-2: `available` never exceeds `total`, whatever is given back, and a release
//!   of what was never taken is capped rather than inflating the node.
//! - AGENT-6: bundles are reserved in two phases: [`Ledger::prepare_bundles`] sets a
//!   request's resources aside all or none; [`Ledger::commit_bundles`] adds the group's
//!   renamed resources (SCHED-19) to `total` and `available`; [`Ledger::return_bundles`]
//!   takes those away again and gives the bundle's plain resources back.
//! - AGENT-7 / AGENT-10: chips and GPUs come from their allocators (aligned chip blocks,
//!   SCHED-12; GPU shares) and go back with [`Ledger::release_devices`].
//! - AGENT-11: a blocked worker's lease lends its CPUs to the node once, and takes them
//!   back once when it runs again (the node may be oversubscribed for a moment).

use std::collections::{BTreeSet, HashMap};
use std::time::{Duration, Instant};

use tpuray_proto::pb;
use tpuray_scheduler::gpu::{GpuAllocator, GpuError};
use tpuray_scheduler::{Amount, ChipAllocator, ChipError, ResourceSet};

/// How long a prepared bundle waits for its commit (AGENT-6).
pub const PREPARED_BUNDLE_TTL: Duration = Duration::from_secs(60);

/// Why the ledger refused a request. Each names what was asked and what the node has.
#[derive(Clone, Debug, PartialEq, thiserror::Error)]
pub enum LedgerError {
    /// `need` is not free now (`available` is).
    #[error("cannot reserve {what}: needs {need}, available {available}")]
    Exhausted { what: String, need: ResourceSet, available: ResourceSet },
    /// A commit named a bundle that is not prepared here.
    #[error(
        "bundle {index} of placement group {pg} is not prepared (it expired after {PREPARED_BUNDLE_TTL:?} or was returned)"
    )]
    BundleNotPrepared { pg: String, index: u32 },
    /// The node has none of the device kind (`"TPU chips"`, `"GPUs"`).
    #[error("the node has no {0} to hand out")]
    NoDevices(&'static str),
    /// A device request that can never be served as asked (a chip count other than 1,
    /// 2, 4, 8 or the host; a fractional GPU count above one; an exact chip list of the
    /// wrong length).
    #[error("{0}")]
    Invalid(String),
    /// A valid device request for which nothing is free now; the caller may stop idle
    /// workers holding such devices and ask again.
    #[error("{0}")]
    DevicesBusy(String),
}

/// What a lease holds now, and the CPUs it lent back while its worker is blocked.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Hold {
    /// What the lease holds now (without the CPUs lent back).
    pub resources: ResourceSet,
    /// CPUs given back while the worker is blocked in get/wait (AGENT-11).
    pub lent_cpu: Amount,
}

impl Hold {
    /// A hold of `resources`, nothing lent.
    pub fn new(resources: ResourceSet) -> Self {
        Self { resources, lent_cpu: Amount::ZERO }
    }
}

/// A placement-group bundle reserved on this node (AGENT-6).
#[derive(Clone, Debug)]
struct BundleReservation {
    /// The bundle's plain resources, set aside from `available`.
    demand: ResourceSet,
    committed: bool,
    prepared_at: Instant,
}

/// The node's resources, bundles and devices (see the module docs).
pub struct Ledger {
    /// The node's own resources plus those of committed bundles.
    total: ResourceSet,
    available: ResourceSet,
    /// (group id, bundle index) → reservation.
    bundles: HashMap<(String, u32), BundleReservation>,
    /// This host's TPU chips, when it has any (AGENT-7).
    chips: Option<ChipAllocator>,
    /// This node's GPUs, when it has any (AGENT-10).
    gpus: Option<GpuAllocator>,
}

impl Ledger {
    /// A node with `total` resources, all free; chips when `TPU` is a whole host's count
    /// (1..=64), GPUs when `GPU` has whole ones.
    pub fn new(total: ResourceSet) -> Self {
        Self {
            available: total.clone(),
            bundles: HashMap::new(),
            chips: tpu_host_chips(&total).map(ChipAllocator::new),
            gpus: node_gpus(&total).map(GpuAllocator::new),
            total,
        }
    }

    /// The node's own resources plus those of committed bundles.
    pub fn total(&self) -> &ResourceSet {
        &self.total
    }

    /// What is free now.
    pub fn available(&self) -> &ResourceSet {
        &self.available
    }

    /// Chips on this host, when it has any.
    pub fn host_chips(&self) -> Option<u32> {
        self.chips.as_ref().map(ChipAllocator::chips)
    }

    /// Whether `demand` is free now.
    pub fn fits_now(&self, demand: &ResourceSet) -> bool {
        self.available.is_superset_of(demand)
    }

    /// Takes `r` from what is free, all or none (`what` names it in the error).
    ///
    /// # Errors
    /// [`LedgerError::Exhausted`] when it is not all free.
    pub fn take(&mut self, what: &str, r: &ResourceSet) -> Result<(), LedgerError> {
        if !self.available.is_superset_of(r) {
            return Err(LedgerError::Exhausted {
                what: what.to_string(),
                need: r.clone(),
                available: self.available.clone(),
            });
        }
        self.available.saturating_sub(r);
        Ok(())
    }

    /// Takes `r` even when it is not all free (an amount short is taken as what is
    /// left): for a grant already decided against a fresher view.
    pub fn take_anyway(&mut self, r: &ResourceSet) {
        self.available.saturating_sub(r);
    }

    /// Gives `r` back, never above `total` (AGENT-2).
    pub fn release(&mut self, r: &ResourceSet) {
        self.available.add(r);
        let mut capped = ResourceSet::new();
        for (name, amt) in self.available.iter() {
            capped.set(name, amt.min(self.total.get(name)));
        }
        self.available = capped;
    }

    /// AGENT-11: a blocked worker's `hold` lends its CPUs to the node (`blocked`), or
    /// takes them back (`!blocked`). Whether anything changed: a hold without CPUs, a
    /// second notice of the same state, change nothing.
    pub fn lend_cpus(&mut self, hold: &mut Hold, blocked: bool) -> bool {
        let mut cpu = ResourceSet::new();
        if blocked && hold.lent_cpu == Amount::ZERO {
            let amount = hold.resources.get("CPU");
            if amount == Amount::ZERO {
                return false;
            }
            hold.resources.set("CPU", Amount::ZERO);
            hold.lent_cpu = amount;
            cpu.set("CPU", amount);
            self.release(&cpu);
        } else if !blocked && hold.lent_cpu != Amount::ZERO {
            let amount = std::mem::replace(&mut hold.lent_cpu, Amount::ZERO);
            hold.resources.set("CPU", amount);
            cpu.set("CPU", amount);
            self.available.saturating_sub(&cpu);
        } else {
            return false;
        }
        true
    }

    /// AGENT-6 phase one: sets the bundles' resources aside, all or none, at `now`.
    /// Bundles already prepared here are left as they are (a retried request).
    ///
    /// # Errors
    /// [`LedgerError::Exhausted`] naming what is missing when they do not all fit now.
    pub fn prepare_bundles(
        &mut self,
        pg: &str,
        bundles: &[(u32, ResourceSet)],
        now: Instant,
    ) -> Result<(), LedgerError> {
        let fresh: Vec<&(u32, ResourceSet)> = bundles
            .iter()
            .filter(|(i, _)| !self.bundles.contains_key(&(pg.to_string(), *i)))
            .collect();
        let mut need = ResourceSet::new();
        for (_, d) in &fresh {
            need.add(d);
        }
        self.take(&format!("{} bundle(s) of placement group {pg}", fresh.len()), &need)?;
        for (i, d) in fresh {
            self.bundles.insert(
                (pg.to_string(), *i),
                BundleReservation { demand: d.clone(), committed: false, prepared_at: now },
            );
        }
        Ok(())
    }

    /// AGENT-6 phase two: the prepared bundles become the group's resources (SCHED-19);
    /// committing one twice changes nothing.
    ///
    /// # Errors
    /// [`LedgerError::BundleNotPrepared`] when one is not prepared here (nothing is
    /// committed then).
    pub fn commit_bundles(&mut self, pg: &str, indexes: &[u32]) -> Result<(), LedgerError> {
        if let Some(i) = indexes.iter().find(|i| !self.bundles.contains_key(&(pg.to_string(), **i)))
        {
            return Err(LedgerError::BundleNotPrepared { pg: pg.to_string(), index: *i });
        }
        for i in indexes {
            let b = self.bundles.get_mut(&(pg.to_string(), *i)).expect("checked above");
            if !b.committed {
                b.committed = true;
                let added = tpuray_scheduler::bundles::bundle_resources(&b.demand, pg, *i);
                self.total.add(&added);
                self.available.add(&added);
            }
        }
        Ok(())
    }

    /// Gives back bundles of `pg` here (all of them when `indexes` is empty): a
    /// committed one's renamed resources leave `total`, its plain ones come back.
    /// Returns how many were returned. The agent then stops the workers that used them
    /// ([`uses_bundles`]).
    pub fn return_bundles(&mut self, pg: &str, indexes: &[u32]) -> usize {
        let keys: Vec<(String, u32)> = self
            .bundles
            .keys()
            .filter(|(g, i)| g == pg && (indexes.is_empty() || indexes.contains(i)))
            .cloned()
            .collect();
        for key in &keys {
            let b = self.bundles.remove(key).expect("listed above");
            if b.committed {
                let added = tpuray_scheduler::bundles::bundle_resources(&b.demand, pg, key.1);
                self.total.saturating_sub(&added);
                self.available.saturating_sub(&added);
            }
            self.release(&b.demand);
        }
        keys.len()
    }

    /// Prepared bundles whose commit has not come within [`PREPARED_BUNDLE_TTL`] of
    /// `now` (the head gave up): the agent returns them.
    pub fn expired_bundles(&self, now: Instant) -> Vec<(String, u32)> {
        self.bundles
            .iter()
            .filter(|(_, b)| {
                !b.committed && now.saturating_duration_since(b.prepared_at) >= PREPARED_BUNDLE_TTL
            })
            .map(|(k, _)| k.clone())
            .collect()
    }

    /// The (group, index) of every bundle here, committed or not.
    pub fn bundle_keys(&self) -> impl Iterator<Item = &(String, u32)> {
        self.bundles.keys()
    }

    /// The names bundles `indexes` of `pg` here touch (all of its bundles here when
    /// `indexes` is empty): their resources and the renamed ones a commit adds.
    pub fn bundle_names(&self, pg: &str, indexes: &[u32]) -> BTreeSet<String> {
        let mut names = BTreeSet::new();
        for ((g, i), b) in &self.bundles {
            if g == pg && (indexes.is_empty() || indexes.contains(i)) {
                names.extend(b.demand.iter().map(|(k, _)| k.to_string()));
                let added = tpuray_scheduler::bundles::bundle_resources(&b.demand, pg, *i);
                names.extend(added.iter().map(|(k, _)| k.to_string()));
            }
        }
        names
    }

    /// The amounts of `names` now, for the head's view (`partial`: a bundle change touches
    /// a few names; the whole sets grow with every group on the node).
    pub fn resources_of(&self, names: &BTreeSet<String>) -> pb::NodeResourcesNow {
        let amounts =
            |set: &ResourceSet| names.iter().map(|n| (n.clone(), set.get(n).to_f64())).collect();
        pb::NodeResourcesNow {
            total: amounts(&self.total),
            available: amounts(&self.available),
            partial: true,
        }
    }

    /// The lowest free aligned block of `k` chips (AGENT-7, SCHED-12), or exactly
    /// `exact` (a gang member's planned `TPU_VISIBLE_CHIPS`, AGENT-9).
    ///
    /// # Errors
    /// [`LedgerError::NoDevices`] on a host without chips; [`LedgerError::Invalid`] for
    /// a count that is never valid or an `exact` list of another length;
    /// [`LedgerError::DevicesBusy`] when no such block is free now.
    pub fn allocate_chips(
        &mut self,
        k: u32,
        exact: Option<&[u32]>,
    ) -> Result<Vec<u32>, LedgerError> {
        let alloc = self.chips.as_mut().ok_or(LedgerError::NoDevices("TPU chips"))?;
        let got = match exact {
            Some(chips) if chips.len() == k as usize => alloc.allocate_exact(chips),
            Some(chips) => {
                return Err(LedgerError::Invalid(format!(
                    "TPU_VISIBLE_CHIPS={chips:?} in the runtime environment names {} chip(s), the request holds {k}",
                    chips.len()
                )));
            }
            None => alloc.allocate(k),
        };
        got.map_err(|e| match e {
            ChipError::InvalidCount { .. } => LedgerError::Invalid(e.to_string()),
            ChipError::Busy { .. } => LedgerError::DevicesBusy(e.to_string()),
        })
    }

    /// GPU ids and shares for a worker needing `amount` of GPU (AGENT-10).
    ///
    /// # Errors
    /// [`LedgerError::NoDevices`] on a node without GPUs; [`LedgerError::Invalid`] for
    /// a fractional amount above one; [`LedgerError::DevicesBusy`] when not free now.
    pub fn allocate_gpus(&mut self, amount: Amount) -> Result<Vec<(u32, Amount)>, LedgerError> {
        let alloc = self.gpus.as_mut().ok_or(LedgerError::NoDevices("GPUs"))?;
        alloc.allocate(amount).map_err(|e| match e {
            GpuError::NotWhole(_) => LedgerError::Invalid(e.to_string()),
            GpuError::Busy { .. } => LedgerError::DevicesBusy(e.to_string()),
        })
    }

    /// Gives back the chips and GPU shares a worker held (AGENT-7, AGENT-10).
    pub fn release_devices(&mut self, chips: &[u32], gpus: &[(u32, Amount)]) {
        if let Some(a) = self.chips.as_mut() {
            a.release(chips);
        }
        if let Some(g) = self.gpus.as_mut() {
            g.release(gpus);
        }
    }
}

/// Whether a hold of `r` uses bundles `indexes` of `pg` (any of its bundles when
/// `indexes` is empty): a worker holding it is stopped when they are returned (AGENT-6).
pub fn uses_bundles(r: &ResourceSet, pg: &str, indexes: &[u32]) -> bool {
    r.iter().any(|(name, _)| match tpuray_scheduler::bundles::parse_bundle_resource(name) {
        Some((_, idx, g)) if g == pg => {
            indexes.is_empty() || idx.is_some_and(|i| indexes.contains(&i))
        }
        _ => false,
    })
}

/// Whole GPUs of a node with `total` (AGENT-10), when it has any.
fn node_gpus(total: &ResourceSet) -> Option<u32> {
    let whole = total.get("GPU").0 / tpuray_scheduler::resources::UNITS_PER_WHOLE;
    (whole > 0).then_some(whole.min(1024) as u32)
}

/// Chips on a host with `total`: the whole `TPU` amount (1..=64), if any.
fn tpu_host_chips(total: &ResourceSet) -> Option<u32> {
    let a = total.get("TPU");
    let whole = a.0 / tpuray_scheduler::resources::UNITS_PER_WHOLE;
    (a.0 > 0 && a.0 % tpuray_scheduler::resources::UNITS_PER_WHOLE == 0 && whole <= 64)
        .then_some(whole as u32)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn set(json: &str) -> ResourceSet {
        ResourceSet::from_json(json).expect("resource set")
    }

    fn amt(v: f64) -> Amount {
        Amount::from_f64("GPU", v).expect("amount")
    }

    fn amount(r: &ResourceSet, name: &str) -> f64 {
        r.get(name).to_f64()
    }

    #[test]
    fn agent_2_a_take_is_all_or_none_and_a_release_never_exceeds_the_total() {
        let mut l = Ledger::new(set(r#"{"CPU": 4, "memory": 100}"#));
        assert_eq!(l.take("a lease", &set(r#"{"CPU": 3}"#)), Ok(()));
        let e = l.take("a lease", &set(r#"{"CPU": 2, "memory": 10}"#)).unwrap_err();
        assert!(matches!(e, LedgerError::Exhausted { .. }), "{e:?}");
        assert_eq!(amount(l.available(), "memory"), 100.0, "nothing taken on refusal");
        assert!(e.to_string().starts_with("cannot reserve a lease: needs"), "{e}");
        l.release(&set(r#"{"CPU": 3}"#));
        l.release(&set(r#"{"CPU": 3, "memory": 5}"#));
        assert_eq!(amount(l.available(), "CPU"), 4.0);
        assert_eq!(amount(l.available(), "memory"), 100.0);
    }

    #[test]
    fn agent_11_a_blocked_hold_lends_its_cpus_once_and_takes_them_back_once() {
        let mut l = Ledger::new(set(r#"{"CPU": 2}"#));
        let mut hold = Hold::new(set(r#"{"CPU": 2}"#));
        l.take("a lease", &hold.resources).unwrap();
        assert!(l.lend_cpus(&mut hold, true));
        assert!(!l.lend_cpus(&mut hold, true), "a second notice changes nothing");
        assert_eq!(amount(l.available(), "CPU"), 2.0);
        assert_eq!((amount(&hold.resources, "CPU"), hold.lent_cpu.to_f64()), (0.0, 2.0));
        // The lent CPUs went to another lease meanwhile: the node is oversubscribed.
        l.take("another lease", &set(r#"{"CPU": 2}"#)).unwrap();
        assert!(l.lend_cpus(&mut hold, false));
        assert!(!l.lend_cpus(&mut hold, false));
        assert_eq!(amount(l.available(), "CPU"), 0.0);
        assert_eq!(amount(&hold.resources, "CPU"), 2.0);
        let mut none = Hold::new(set(r#"{"GPU": 1}"#));
        assert!(!l.lend_cpus(&mut none, true), "a hold without CPUs lends nothing");
    }

    #[test]
    fn agent_6_bundles_prepare_all_or_none_commit_adds_group_resources_and_return_undoes_both() {
        let t0 = Instant::now();
        let mut l = Ledger::new(set(r#"{"CPU": 4}"#));
        let two = [(0, set(r#"{"CPU": 2}"#)), (1, set(r#"{"CPU": 3}"#))];
        let e = l.prepare_bundles("pg1", &two, t0).unwrap_err();
        assert!(e.to_string().contains("2 bundle(s) of placement group pg1"), "{e}");
        assert_eq!(amount(l.available(), "CPU"), 4.0, "none prepared");
        l.prepare_bundles("pg1", &two[..1], t0).unwrap();
        l.prepare_bundles("pg1", &two[..1], t0).unwrap(); // a retry takes nothing more
        assert_eq!(amount(l.available(), "CPU"), 2.0);
        let e = l.commit_bundles("pg1", &[0, 1]).unwrap_err();
        assert_eq!(e, LedgerError::BundleNotPrepared { pg: "pg1".into(), index: 1 });
        l.commit_bundles("pg1", &[0]).unwrap();
        l.commit_bundles("pg1", &[0]).unwrap();
        let names = l.bundle_names("pg1", &[]);
        let group: Vec<&String> = names.iter().filter(|n| n.starts_with("CPU_group_")).collect();
        assert_eq!(group.len(), 2, "indexed and wildcard: {names:?}");
        for n in &group {
            assert_eq!(amount(l.total(), n), 2.0, "{n} once, not per commit");
        }
        let now = l.resources_of(&names);
        assert!(now.partial && now.total.get("CPU") == Some(&4.0), "{now:?}");
        assert_eq!(l.return_bundles("pg1", &[]), 1);
        assert_eq!(l.return_bundles("pg1", &[]), 0);
        assert_eq!(l.available(), &set(r#"{"CPU": 4}"#));
        assert_eq!(l.total(), &set(r#"{"CPU": 4}"#));
    }

    #[test]
    fn agent_6_an_uncommitted_bundle_expires_after_the_ttl_and_a_committed_one_never() {
        let t0 = Instant::now();
        let mut l = Ledger::new(set(r#"{"CPU": 4}"#));
        l.prepare_bundles("a", &[(0, set(r#"{"CPU": 1}"#))], t0).unwrap();
        l.prepare_bundles("b", &[(0, set(r#"{"CPU": 1}"#))], t0).unwrap();
        l.commit_bundles("b", &[0]).unwrap();
        assert!(l.expired_bundles(t0 + PREPARED_BUNDLE_TTL / 2).is_empty());
        assert_eq!(l.expired_bundles(t0 + PREPARED_BUNDLE_TTL), vec![("a".to_string(), 0)]);
    }

    #[test]
    fn uses_bundles_matches_the_group_and_indexes_of_renamed_resources() {
        let pg = "0123456789abcdef0123456789abcdef";
        let mut l = Ledger::new(set(r#"{"CPU": 4}"#));
        l.prepare_bundles(
            pg,
            &[(0, set(r#"{"CPU": 1}"#)), (1, set(r#"{"CPU": 1}"#))],
            Instant::now(),
        )
        .unwrap();
        l.commit_bundles(pg, &[0, 1]).unwrap();
        let in_one: ResourceSet = {
            let mut r = ResourceSet::new();
            let name = l
                .bundle_names(pg, &[1])
                .into_iter()
                .find(|n| n.contains("_group_1_"))
                .expect("an indexed name");
            r.set(&name, amt(1.0));
            r
        };
        assert!(uses_bundles(&in_one, pg, &[]));
        assert!(uses_bundles(&in_one, pg, &[1]));
        assert!(!uses_bundles(&in_one, pg, &[0]));
        assert!(!uses_bundles(&in_one, "another", &[]));
        assert!(!uses_bundles(&set(r#"{"CPU": 1}"#), pg, &[]));
    }

    /// AGENT-10: GPUs are handed out, refused while busy or fractional above one, and given
    /// back.
    #[test]
    fn agent_7_10_devices_are_handed_out_refused_by_kind_and_given_back() {
        let mut cpu_only = Ledger::new(set(r#"{"CPU": 4}"#));
        assert_eq!(cpu_only.allocate_chips(1, None), Err(LedgerError::NoDevices("TPU chips")));
        assert_eq!(cpu_only.allocate_gpus(amt(1.0)), Err(LedgerError::NoDevices("GPUs")));
        let mut l = Ledger::new(set(r#"{"CPU": 8, "TPU": 4, "GPU": 2}"#));
        assert_eq!(l.host_chips(), Some(4));
        assert_eq!(l.allocate_chips(2, None), Ok(vec![0, 1]));
        assert!(matches!(l.allocate_chips(3, None), Err(LedgerError::Invalid(_))));
        assert!(matches!(l.allocate_chips(2, Some(&[0])), Err(LedgerError::Invalid(_))));
        assert!(matches!(l.allocate_chips(4, None), Err(LedgerError::DevicesBusy(_))));
        let gpus = l.allocate_gpus(amt(2.0)).unwrap();
        assert!(matches!(l.allocate_gpus(amt(1.5)), Err(LedgerError::Invalid(_))));
        assert!(matches!(l.allocate_gpus(amt(0.5)), Err(LedgerError::DevicesBusy(_))));
        l.release_devices(&[0, 1], &gpus);
        assert_eq!(l.allocate_chips(4, None), Ok(vec![0, 1, 2, 3]));
        assert!(l.allocate_gpus(amt(0.5)).is_ok());
    }
}
