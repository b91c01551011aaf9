//! HEAD-13: the cluster view that heartbeat replies carry, sent as bounded deltas.
//!
//! Every heartbeat reply used to carry every live node (`NodeInfo` with its resources),
//! so N nodes heartbeating once a second made the head build and encode N² entries a
//! second: at 1,000 nodes the head fell behind its own heartbeats and declared nodes
//! dead that were sending them (`head_load`). Now the head numbers each change of a
//! node's entry (it joined, left, or its total or available resources changed) and an
//! agent sends back the version it holds; the reply carries only what changed since, in
//! version order, at most a budget of entries ([`entries_per_reply`]), and brings the
//! agent to the version of the last entry it carries. An agent holding nothing, a version
//! from another leadership term (`epoch`), or one older than the removals still
//! remembered, starts over: a whole view, sent the same way in parts (the first replaces
//! what the agent held). So an idle cluster sends nothing, and a join storm of N nodes
//! costs the head a bounded number of entries a second instead of N per heartbeat; a
//! fresh agent's view fills in over a few heartbeats at large N. Soft state of the
//! leader, like the views themselves (HEAD-8). No I/O, no clocks.
//!
//! The numbers: the budget is 50,000 entries a second for the head, shared by the nodes'
//! heartbeats, 8 to 10,000 per reply; an agent sends back the (epoch, version) of the
//! last reply it applied and gets the entries changed since, oldest first, with the
//! version of the last one sent. A new epoch starts per leadership term and per snapshot
//! restore, and its log starts with every live node; the last 10,000 removals are kept.
//! The price: during a join storm of N nodes a fresh agent's view fills in over N /
//! (budget per reply) heartbeats (at 10,000 nodes, about 1,250 s to see every node,
//! oldest changes first); spillback meanwhile chooses among the nodes it knows, and node
//! affinity to a node it does not know yet reads the head (AGENT-12).

use std::collections::{BTreeMap, HashMap, VecDeque};
use std::hash::Hash;

/// Removals remembered for deltas; an agent further behind gets the whole view.
const REMOVALS_KEPT: usize = 10_000;
/// View entries the head sends per second over all heartbeat replies, when that many
/// changed: a bound on the head's view work whatever the cluster does (a join storm, a
/// new leader); [`entries_per_reply`] shares it among the nodes.
pub(crate) const VIEW_ENTRIES_PER_SECOND: f64 = 50_000.0;
/// Entries any reply may carry, whatever the cluster's size.
pub(crate) const MIN_ENTRIES_PER_REPLY: usize = 8;
pub(crate) const MAX_ENTRIES_PER_REPLY: usize = 10_000;

/// At most how many view entries one heartbeat reply carries: the per-second budget
/// shared by `nodes` heartbeating every `interval_s`, within the bounds above (so up to
/// 5,000 nodes at a 1 s interval a reply can still carry 10 changes, and up to 5 nodes a
/// whole 10,000-entry view).
pub(crate) fn entries_per_reply(nodes: usize, interval_s: f64) -> usize {
    let share = VIEW_ENTRIES_PER_SECOND * interval_s.max(0.001) / nodes.max(1) as f64;
    (share as usize).clamp(MIN_ENTRIES_PER_REPLY, MAX_ENTRIES_PER_REPLY)
}

/// What one reply carries to an agent.
#[derive(Debug, PartialEq, Eq)]
pub(crate) struct ViewUpdate<K> {
    /// The agent starts over: `changed` replaces the view it holds.
    pub(crate) full: bool,
    /// Nodes whose current entries to send, in change order.
    pub(crate) changed: Vec<K>,
    /// Nodes gone from the view.
    pub(crate) removed: Vec<K>,
    /// The version the agent holds once it applied this.
    pub(crate) to: u64,
}

/// Change numbers of the nodes' view entries (one per node, its latest). Every node in
/// the view has one (a log for a new term starts with every live node touched).
#[derive(Debug)]
pub(crate) struct ViewLog<K> {
    epoch: u64,
    version: u64,
    /// version -> node, for the latest change of each node.
    changed: BTreeMap<u64, K>,
    /// node -> the version of its latest change.
    at: HashMap<K, u64>,
    /// (version, node) of removals, oldest first, at most `REMOVALS_KEPT`.
    removed: VecDeque<(u64, K)>,
    /// Removals at or below this version are forgotten: older agents start over.
    floor: u64,
}

impl<K: Clone + Eq + Hash> ViewLog<K> {
    /// An empty log for a leadership term; `epoch` tells this log's versions from any
    /// other's (a random number per term; never 0, which agents send for "none").
    pub(crate) fn new(epoch: u64) -> Self {
        Self {
            epoch: epoch.max(1),
            version: 0,
            changed: BTreeMap::new(),
            at: HashMap::new(),
            removed: VecDeque::new(),
            floor: 0,
        }
    }

    /// The epoch of this log (what a reply names).
    pub(crate) fn epoch(&self) -> u64 {
        self.epoch
    }

    /// How many nodes the view holds.
    pub(crate) fn len(&self) -> usize {
        self.at.len()
    }

    /// The version of node `k`'s latest change (`None`: not in the view).
    pub(crate) fn version_of(&self, k: &K) -> Option<u64> {
        self.at.get(k).copied()
    }

    /// Node `k`'s entry changed (it joined, or its resources changed).
    pub(crate) fn touch(&mut self, k: &K) {
        self.version += 1;
        if let Some(old) = self.at.insert(k.clone(), self.version) {
            self.changed.remove(&old);
        }
        self.changed.insert(self.version, k.clone());
    }

    /// Node `k` left the view (it died).
    pub(crate) fn remove(&mut self, k: &K) {
        if let Some(old) = self.at.remove(k) {
            self.changed.remove(&old);
        }
        self.version += 1;
        self.removed.push_back((self.version, k.clone()));
        while self.removed.len() > REMOVALS_KEPT {
            if let Some((v, _)) = self.removed.pop_front() {
                self.floor = v;
            }
        }
    }

    /// What an agent holding `(epoch, version)` gets next: at most `limit` entries
    /// (changes and removals together), oldest first.
    pub(crate) fn since(&self, epoch: u64, version: u64, limit: usize) -> ViewUpdate<K> {
        let full =
            epoch != self.epoch || version == 0 || version < self.floor || version > self.version;
        let from = if full { 0 } else { version };
        let limit = limit.max(1);
        let mut changes = self.changed.range(from + 1..).peekable();
        // A fresh view needs no removals: a removed node's change left the log with it.
        let first_removal = if full {
            self.removed.len()
        } else {
            self.removed.partition_point(|(v, _)| *v <= from)
        };
        let mut removals = self.removed.range(first_removal..).peekable();
        let mut out =
            ViewUpdate { full, changed: Vec::new(), removed: Vec::new(), to: self.version };
        let mut taken = 0;
        loop {
            let next_change = changes.peek().map(|(v, _)| **v);
            let next_removal = removals.peek().map(|(v, _)| *v);
            let take_change = match (next_change, next_removal) {
                (None, None) => break,
                (Some(c), Some(r)) => c < r,
                (Some(_), None) => true,
                (None, Some(_)) => false,
            };
            if taken == limit {
                // Stop before the next entry: the agent resumes from the last one sent.
                out.to = next_change.into_iter().chain(next_removal).min().unwrap_or(0) - 1;
                break;
            }
            if take_change {
                let (_, k) = changes.next().expect("peeked");
                out.changed.push(k.clone());
            } else {
                let (_, k) = removals.next().expect("peeked");
                if !self.at.contains_key(k) {
                    out.removed.push(k.clone());
                }
            }
            taken += 1;
        }
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn up(full: bool, changed: &[u32], removed: &[u32], to: u64) -> ViewUpdate<u32> {
        ViewUpdate { full, changed: changed.to_vec(), removed: removed.to_vec(), to }
    }

    /// HEAD-13: an agent holding nothing or another term's view gets the whole view.
    #[test]
    fn an_agent_holding_nothing_or_another_terms_view_starts_over_with_the_whole_view() {
        let mut log = ViewLog::new(7);
        log.touch(&1);
        log.touch(&2);
        assert_eq!(log.since(0, 0, 100), up(true, &[1, 2], &[], 2));
        assert_eq!(log.since(8, 1, 100), up(true, &[1, 2], &[], 2), "another epoch");
        assert_eq!(log.since(7, 3, 100), up(true, &[1, 2], &[], 2), "a version never reached");
        assert_eq!(log.epoch(), 7);
        assert_eq!(log.len(), 2);
    }

    /// HEAD-13: an idle cluster sends no entries.
    #[test]
    fn an_idle_cluster_sends_empty_deltas() {
        let mut log = ViewLog::new(1);
        for n in 0..1000 {
            log.touch(&n);
        }
        assert_eq!(log.since(1, 1000, 8), up(false, &[], &[], 1000));
    }

    /// HEAD-13: a delta holds the entries changed since the agent's version, oldest first.
    #[test]
    fn a_delta_holds_each_node_changed_since_once_in_change_order() {
        let mut log = ViewLog::new(1);
        log.touch(&1);
        log.touch(&2); // v2
        log.touch(&3);
        log.touch(&1);
        log.touch(&3); // v5
        assert_eq!(log.since(1, 2, 100), up(false, &[1, 3], &[], 5));
        // Node 2 did not change after v2.
        assert_eq!(log.since(1, 1, 100), up(false, &[2, 1, 3], &[], 5));
    }

    #[test]
    fn a_removed_node_is_named_once_and_a_rejoined_one_is_a_change() {
        let mut log = ViewLog::new(1);
        log.touch(&1);
        log.touch(&2); // v2
        log.remove(&1);
        log.remove(&2);
        log.touch(&2); // v5
        assert_eq!(log.since(1, 2, 100), up(false, &[2], &[1], 5));
        assert_eq!(log.since(1, 5, 100), up(false, &[], &[], 5));
        // A fresh view never names removals.
        assert_eq!(log.since(0, 0, 100), up(true, &[2], &[], 5));
    }

    /// HEAD-13: at most `entries_per_reply` entries, the next reply resuming after them.
    #[test]
    fn a_reply_carries_at_most_the_limit_and_the_next_resumes_where_it_stopped() {
        let mut log = ViewLog::new(1);
        for n in 1..=10 {
            log.touch(&n); // v1..v10
        }
        log.remove(&3); // v11
        // A fresh agent gets the view in parts: the first replaces, the rest are deltas.
        let a = log.since(0, 0, 4);
        assert_eq!(a, up(true, &[1, 2, 4, 5], &[], 5));
        let b = log.since(1, a.to, 4);
        assert_eq!(b, up(false, &[6, 7, 8, 9], &[], 9));
        let c = log.since(1, b.to, 4);
        assert_eq!(c, up(false, &[10], &[3], 11));
        // Changes and removals interleave in version order.
        let d = log.since(1, 2, 2);
        assert_eq!(d, up(false, &[4, 5], &[], 5));
    }

    /// HEAD-13: a version older than the removals kept starts over with the whole view.
    #[test]
    fn an_agent_behind_the_removals_kept_starts_over() {
        let mut log = ViewLog::new(1);
        log.touch(&0);
        for n in 1..=(REMOVALS_KEPT as u32 + 1) {
            log.touch(&n);
            log.remove(&n);
        }
        let now = 1 + 2 * (REMOVALS_KEPT as u64 + 1);
        assert_eq!(log.since(1, 1, 100), up(true, &[0], &[], now));
        assert_eq!(log.since(1, now, 100), up(false, &[], &[], now));
    }

    #[test]
    fn the_per_reply_budget_shrinks_with_the_cluster_within_its_bounds() {
        assert_eq!(entries_per_reply(1, 1.0), MAX_ENTRIES_PER_REPLY);
        assert_eq!(entries_per_reply(1_000, 1.0), 50);
        assert_eq!(entries_per_reply(5_000, 1.0), 10);
        assert_eq!(entries_per_reply(100_000, 1.0), MIN_ENTRIES_PER_REPLY);
    }
}
