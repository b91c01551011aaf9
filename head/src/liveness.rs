//! The leader's soft state of each node (HEAD-8) and the decisions made from it: what a
//! heartbeat changes (HEAD-13's view, reconciliation due), and which nodes are dead
//! (HEAD-4). Pure: the caller passes the time and carries out what is decided
//! (`nodes.rs` commits deaths, starts reconciliations, touches the view).
//!
//! HEAD-4: a node without heartbeats for the death timeout is dead, even with its TCP
//! connection open (a frozen process).
//!
//! HEAD-8 in detail: a head that starts serving gives every live node a fresh death clock
//! (plus 5 s for a node it has not heard from yet, whose heartbeat may still hang on the
//! old leader), places work only on nodes that reported to it, and reconciles: on each
//! node's first heartbeat (and every 30 s) it lists the agent's workers, so an actor
//! recorded alive whose worker is gone restarts (per `max_restarts`) and a worker hosting
//! an actor no record places there is stopped; and bundles a node's heartbeat shows that
//! no record holds (a reservation whose outcome was lost, a removal whose release was)
//! are given back. After every head restarts, surviving actors keep their process and
//! address.

use std::collections::{HashMap, HashSet};
use std::time::{Duration, Instant};

use tpuray_proto::ids::NodeId;
use tpuray_proto::pb;
use tpuray_scheduler::ResourceSet;

/// Extra time a new leader gives nodes it has not heard from before declaring them dead
/// (HEAD-8: a node's heartbeat may still be stuck on the old leader).
pub(crate) const FAILOVER_GRACE: Duration = Duration::from_secs(5);
/// How often the leader compares a node agent's actor workers with the durable state
/// (HEAD-8).
pub(crate) const RECONCILE_EVERY: Duration = Duration::from_secs(30);

/// What the leader knows of one live node between heartbeats (soft: rebuilt from node
/// reports by a new leader, HEAD-8).
pub(crate) struct NodeSoft {
    /// When the last heartbeat was handled; the death clock (HEAD-4) runs from it.
    pub(crate) last_heartbeat: Instant,
    /// The same, as milliseconds since the Unix epoch (shown by `status` and `list`);
    /// 0 before the first report to this leader.
    pub(crate) last_heartbeat_ms: u64,
    /// Registered resources plus committed bundles' (from the agent).
    pub(crate) total: ResourceSet,
    pub(crate) available: ResourceSet,
    pub(crate) pending: Vec<pb::ResourceDemand>,
    pub(crate) num_workers: u32,
    /// Whether the node reported since this head became leader (its resources are known).
    pub(crate) reported: bool,
    /// When this leader last compared the node's actor workers with the state (HEAD-8);
    /// `None`: at the next heartbeat.
    pub(crate) reconciled_at: Option<Instant>,
    /// The jobs the node's agent supervises, from its last heartbeat (HEAD-11).
    pub(crate) job_submissions: HashSet<String>,
}

/// One heartbeat's report, as the head keeps it.
pub(crate) struct Report {
    /// The node's total (registered plus committed bundles).
    pub(crate) total: ResourceSet,
    pub(crate) available: ResourceSet,
    pub(crate) pending: Vec<pb::ResourceDemand>,
    pub(crate) num_workers: u32,
    pub(crate) job_submissions: HashSet<String>,
}

/// What a heartbeat asks the caller to do.
#[derive(Debug, PartialEq, Eq)]
pub(crate) struct Heard {
    /// The node's first report to this leader: placement may now use it (HEAD-8).
    pub(crate) first_report: bool,
    /// Compare the node's actor workers with the state now (HEAD-8).
    pub(crate) reconcile: bool,
    /// What the cluster view shows of the node changed (HEAD-13).
    pub(crate) view_changed: bool,
}

impl NodeSoft {
    /// A node this head has not heard from yet (it became leader): its death clock starts
    /// at `now`, with [`FAILOVER_GRACE`] added until it reports.
    pub(crate) fn unheard(total: ResourceSet, now: Instant) -> Self {
        Self {
            last_heartbeat: now,
            last_heartbeat_ms: 0,
            total,
            available: ResourceSet::new(),
            pending: vec![],
            num_workers: 0,
            reported: false,
            reconciled_at: None,
            job_submissions: HashSet::new(),
        }
    }

    /// A node that just registered with this leader. It runs no actors yet, so there is
    /// nothing to reconcile: its first comparison is due `first_reconcile_in` (at most
    /// [`RECONCILE_EVERY`]) after `now`. Callers spread that over the period, so that a
    /// join storm's nodes are not all reconciled in the same second thereafter.
    pub(crate) fn registered(
        total: ResourceSet,
        available: ResourceSet,
        now: Instant,
        now_ms: u64,
        first_reconcile_in: Duration,
    ) -> Self {
        let due_in = first_reconcile_in.min(RECONCILE_EVERY);
        Self {
            last_heartbeat: now,
            last_heartbeat_ms: now_ms,
            available: if available.is_empty() { total.clone() } else { available },
            total,
            pending: vec![],
            num_workers: 0,
            reported: true,
            reconciled_at: Some(now.checked_sub(RECONCILE_EVERY - due_in).unwrap_or(now)),
            job_submissions: HashSet::new(),
        }
    }

    /// The soft state after a heartbeat handled at `now` (`now_ms` on the wall clock),
    /// and what the caller is to do. `prev` is the state before (`None` for a node this
    /// leader holds none for).
    pub(crate) fn heard(
        prev: Option<&NodeSoft>,
        report: Report,
        now: Instant,
        now_ms: u64,
    ) -> (NodeSoft, Heard) {
        let first_report = prev.is_none_or(|s| !s.reported);
        let reconcile = prev
            .and_then(|s| s.reconciled_at)
            .is_none_or(|t| now.saturating_duration_since(t) >= RECONCILE_EVERY);
        let reconciled_at = if reconcile { Some(now) } else { prev.and_then(|s| s.reconciled_at) };
        // HEAD-13: only a change of what the view shows is a change of the view.
        let view_changed = prev.is_none_or(|s| {
            !s.reported || s.total != report.total || s.available != report.available
        });
        let soft = NodeSoft {
            last_heartbeat: now,
            last_heartbeat_ms: now_ms,
            total: report.total,
            available: report.available,
            pending: report.pending,
            num_workers: report.num_workers,
            reported: true,
            reconciled_at,
            job_submissions: report.job_submissions,
        };
        (soft, Heard { first_report, reconcile, view_changed })
    }
}

/// HEAD-4: the live nodes whose last heartbeat is older than `timeout` at `now`, with
/// how long ago it was. A node that has not reported to this leader gets
/// [`FAILOVER_GRACE`] more (HEAD-8); a node with no soft state is skipped (its record
/// is being made or removed).
pub(crate) fn expired<'a>(
    alive: impl Iterator<Item = &'a NodeId>,
    soft: &HashMap<NodeId, NodeSoft>,
    now: Instant,
    timeout: Duration,
) -> Vec<(NodeId, Duration)> {
    alive
        .filter_map(|id| {
            let s = soft.get(id)?;
            let age = now.saturating_duration_since(s.last_heartbeat);
            let limit = if s.reported { timeout } else { timeout + FAILOVER_GRACE };
            (age > limit).then(|| (id.clone(), age))
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use tpuray_scheduler::Amount;

    fn cpus(n: u64) -> ResourceSet {
        let mut r = ResourceSet::new();
        r.set("CPU", Amount::whole(n));
        r
    }

    fn report(total: u64, available: u64) -> Report {
        Report {
            total: cpus(total),
            available: cpus(available),
            pending: vec![],
            num_workers: 0,
            job_submissions: HashSet::new(),
        }
    }

    const S: Duration = Duration::from_secs(1);

    /// HEAD-4: a node without heartbeats past the timeout is dead (HEAD-8's grace for one
    /// not heard from yet).
    #[test]
    fn a_node_is_dead_only_past_the_timeout_and_an_unreported_one_gets_the_grace() {
        let t0 = Instant::now();
        let (a, b) = (NodeId::random(), NodeId::random());
        let mut soft = HashMap::new();
        soft.insert(a.clone(), NodeSoft::registered(cpus(4), cpus(4), t0, 1, RECONCILE_EVERY));
        soft.insert(b.clone(), NodeSoft::unheard(cpus(4), t0));
        let ids = [a.clone(), b.clone()];
        let timeout = 5 * S;
        assert!(expired(ids.iter(), &soft, t0 + timeout, timeout).is_empty(), "at the limit");
        let at = t0 + timeout + S;
        assert_eq!(expired(ids.iter(), &soft, at, timeout), vec![(a.clone(), timeout + S)]);
        let late = t0 + timeout + FAILOVER_GRACE + S;
        let dead: Vec<NodeId> =
            expired(ids.iter(), &soft, late, timeout).into_iter().map(|(n, _)| n).collect();
        assert_eq!(dead, vec![a.clone(), b.clone()]);
        // A heartbeat restarts the clock; a node with no soft state is not judged.
        let (s, _) = NodeSoft::heard(soft.get(&a), report(4, 4), at, 2);
        soft.insert(a.clone(), s);
        soft.remove(&b);
        assert!(expired(ids.iter(), &soft, at + timeout, timeout).is_empty());
    }

    #[test]
    fn reconciliation_comes_once_per_period_and_first_at_the_spread_point() {
        let t0 = Instant::now();
        let reg = NodeSoft::registered(cpus(4), ResourceSet::new(), t0, 1, 10 * S);
        assert_eq!(reg.available, cpus(4), "an empty availability is the whole node");
        let (s, h) = NodeSoft::heard(Some(&reg), report(4, 4), t0 + 9 * S, 2);
        assert!(!h.reconcile && !h.first_report);
        let (s, h) = NodeSoft::heard(Some(&s), report(4, 4), t0 + 10 * S, 3);
        assert!(h.reconcile, "due 10 s after registering");
        let (s, h) = NodeSoft::heard(Some(&s), report(4, 4), t0 + 39 * S, 4);
        assert!(!h.reconcile);
        let (_, h) = NodeSoft::heard(Some(&s), report(4, 4), t0 + 40 * S, 5);
        assert!(h.reconcile, "then every RECONCILE_EVERY");
        // A failed comparison is retried at the next heartbeat.
        let mut failed = NodeSoft::registered(cpus(4), cpus(4), t0, 1, S);
        failed.reconciled_at = None;
        assert!(NodeSoft::heard(Some(&failed), report(4, 4), t0, 2).1.reconcile);
    }

    /// HEAD-13: a heartbeat that reports the same resources changes nothing in the view.
    #[test]
    fn the_view_changes_only_when_what_it_shows_changes() {
        let t0 = Instant::now();
        let (s, h) = NodeSoft::heard(None, report(4, 4), t0, 1);
        assert_eq!(h, Heard { first_report: true, reconcile: true, view_changed: true });
        let (s, h) = NodeSoft::heard(Some(&s), report(4, 4), t0 + S, 2);
        assert!(!h.view_changed && !h.first_report);
        let (s, h) = NodeSoft::heard(Some(&s), report(4, 3), t0 + 2 * S, 3);
        assert!(h.view_changed, "availability changed");
        let (_, h) = NodeSoft::heard(Some(&s), report(5, 3), t0 + 3 * S, 4);
        assert!(h.view_changed, "total changed (a committed bundle)");
        // A node known only from the log (a new leader) changes the view at its report.
        let unheard = NodeSoft::unheard(cpus(4), t0);
        let (_, h) = NodeSoft::heard(Some(&unheard), report(4, 4), t0 + S, 5);
        assert!(h.first_report && h.view_changed && h.reconcile);
    }
}
