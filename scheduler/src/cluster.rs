//! [`ClusterView`]: the cluster's nodes plus per-request-class indexes, so a decision costs
//! O(log nodes) instead of a scan; [`schedule_in`] decides and applies the allocation.
//!
//! A *class* is one (demand, label selector) pair. Its index holds every alive node whose
//! total covers the demand and whose labels match (SCHED-3), keyed by the node's utilisation
//! after placement, split into nodes without and with accelerators (SCHED-6). Allocations
//! and releases move the node inside each class it belongs to; adding, removing or killing
//! a node drops all indexes, which are rebuilt lazily on the next request of each class.
//! Decisions equal [`crate::schedule`]'s over the same nodes (SCHED-17).

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::fmt::Debug;
use std::hash::{Hash, Hasher};

use crate::labels::{LabelConstraint, selector_matches};
use crate::policy::{
    Decision, MAX_TOP_K, NodeView, Request, SPREAD_THRESHOLD, Strategy, hard_affinity,
    infeasible_reason, is_accelerator_node, is_feasible, splitmix64, utilisation,
};
use crate::resources::ResourceSet;

/// Most class indexes kept at once; the least recently used one is dropped beyond this.
pub const MAX_CLASSES: usize = 256;

const HALF_BITS: u64 = SPREAD_THRESHOLD.to_bits();
const ONE_BITS: u64 = 1.0f64.to_bits();

/// Nodes of one class with one accelerator-ness, by utilisation bits (non-negative f64
/// bits order like the numbers), then id.
type ScoreIndex<K> = BTreeMap<u64, BTreeSet<(K, u32)>>;

/// One (demand, selector) class and the nodes that could ever run it.
#[derive(Clone, Debug)]
pub(crate) struct Class<K> {
    demand: ResourceSet,
    selector: Vec<LabelConstraint>,
    hash: u64,
    members: usize,
    /// [nodes without GPU/TPU, accelerator nodes] (SCHED-6).
    sets: [ScoreIndex<K>; 2],
    /// Why no node is feasible, when `members == 0` (SCHED-5).
    infeasible: String,
    last_used: u64,
}

impl<K: Clone + Ord> Class<K> {
    /// Slots of members whose available covers the demand, non-accelerator nodes first, each
    /// part emptiest first.
    pub(crate) fn available(&self) -> impl Iterator<Item = usize> + '_ {
        self.sets.iter().flat_map(|s| {
            s.range(..=ONE_BITS).flat_map(|(_, ids)| ids.iter().map(|(_, slot)| *slot as usize))
        })
    }

    /// Slots of every member (total covers the demand), in the same order.
    pub(crate) fn members(&self) -> impl Iterator<Item = usize> + '_ {
        self.sets
            .iter()
            .flat_map(|s| s.values().flat_map(|ids| ids.iter().map(|(_, s)| *s as usize)))
    }

    /// How many alive nodes could ever run this class.
    pub(crate) fn member_count(&self) -> usize {
        self.members
    }

    /// Why none could, when [`Self::member_count`] is 0.
    pub(crate) fn infeasible_reason(&self) -> &str {
        &self.infeasible
    }
}

/// The cluster's nodes with lazily built per-class indexes. Amounts change through
/// [`ClusterView::allocate`] / [`ClusterView::release`] / [`ClusterView::set_available`].
#[derive(Clone, Debug)]
pub struct ClusterView<K> {
    nodes: Vec<NodeView<K>>,
    slot_of: HashMap<K, u32>,
    /// Per slot: (class id, utilisation bits, set index) of every class the node is in.
    memberships: Vec<Vec<(u32, u64, u8)>>,
    classes: Vec<Option<Class<K>>>,
    class_by_hash: HashMap<u64, Vec<u32>>,
    live_classes: usize,
    clock: u64,
}

impl<K: Clone + Eq + Hash + Ord + Debug> Default for ClusterView<K> {
    fn default() -> Self {
        Self::new(Vec::new())
    }
}

/// FNV-1a over the `Hash` of a class key; fast for the short keys classes have.
struct Fnv(u64);

impl Hasher for Fnv {
    fn finish(&self) -> u64 {
        self.0
    }
    fn write(&mut self, bytes: &[u8]) {
        for b in bytes {
            self.0 = (self.0 ^ u64::from(*b)).wrapping_mul(0x0100_0000_01b3);
        }
    }
}

fn class_hash(demand: &ResourceSet, selector: &[LabelConstraint]) -> u64 {
    let mut h = Fnv(0xcbf2_9ce4_8422_2325);
    demand.hash(&mut h);
    selector.hash(&mut h);
    h.finish()
}

fn score_bits<K>(demand: &ResourceSet, n: &NodeView<K>) -> u64 {
    // Utilisation is >= 0, so its bits order like the number; +0.0 for -0.0.
    (utilisation(demand, n) + 0.0).to_bits()
}

impl<K: Clone + Eq + Hash + Ord + Debug> ClusterView<K> {
    /// A view of `nodes` (ids must be distinct; a later duplicate replaces an earlier one).
    pub fn new(nodes: Vec<NodeView<K>>) -> Self {
        let mut v = ClusterView {
            nodes: Vec::with_capacity(nodes.len()),
            slot_of: HashMap::with_capacity(nodes.len()),
            memberships: Vec::with_capacity(nodes.len()),
            classes: Vec::new(),
            class_by_hash: HashMap::new(),
            live_classes: 0,
            clock: 0,
        };
        for n in nodes {
            v.upsert_node(n);
        }
        v
    }

    /// The nodes, in insertion order (removal moves the last node into the gap).
    pub fn nodes(&self) -> &[NodeView<K>] {
        &self.nodes
    }

    /// The node with `id`.
    pub fn node(&self, id: &K) -> Option<&NodeView<K>> {
        self.slot_of.get(id).map(|&s| &self.nodes[s as usize])
    }

    pub(crate) fn slot(&self, id: &K) -> Option<usize> {
        self.slot_of.get(id).map(|&s| s as usize)
    }

    /// Adds `node`, or replaces the node with its id. Drops every class index.
    pub fn upsert_node(&mut self, node: NodeView<K>) {
        self.invalidate();
        match self.slot_of.get(&node.id) {
            Some(&s) => self.nodes[s as usize] = node,
            None => {
                let slot = u32::try_from(self.nodes.len()).expect("at most 2^32 nodes");
                self.slot_of.insert(node.id.clone(), slot);
                self.nodes.push(node);
                self.memberships.push(Vec::new());
            }
        }
    }

    /// Removes the node with `id`; returns it. Drops every class index.
    pub fn remove_node(&mut self, id: &K) -> Option<NodeView<K>> {
        let slot = self.slot_of.remove(id)? as usize;
        self.invalidate();
        let node = self.nodes.swap_remove(slot);
        self.memberships.swap_remove(slot);
        if let Some(moved) = self.nodes.get(slot) {
            self.slot_of.insert(moved.id.clone(), slot as u32);
        }
        Some(node)
    }

    /// Marks the node alive or dead (dead nodes are never chosen, SCHED-3). Returns false
    /// when there is no such node.
    pub fn set_alive(&mut self, id: &K, alive: bool) -> bool {
        let Some(slot) = self.slot(id) else { return false };
        if self.nodes[slot].alive != alive {
            self.invalidate();
            self.nodes[slot].alive = alive;
        }
        true
    }

    /// Takes `demand` from the node's available resources when it has them all free; false
    /// (and no change) otherwise or when there is no such node.
    pub fn allocate(&mut self, id: &K, demand: &ResourceSet) -> bool {
        let Some(slot) = self.slot(id) else { return false };
        let Some(left) = self.nodes[slot].available.checked_sub(demand) else { return false };
        self.nodes[slot].available = left;
        self.reindex(slot);
        true
    }

    /// Gives `demand` back to the node's available resources (exact, SCHED-1). False when
    /// there is no such node.
    pub fn release(&mut self, id: &K, demand: &ResourceSet) -> bool {
        let Some(slot) = self.slot(id) else { return false };
        self.nodes[slot].available.add(demand);
        self.reindex(slot);
        true
    }

    /// Replaces the node's available resources (a heartbeat). False when there is no such
    /// node.
    pub fn set_available(&mut self, id: &K, available: ResourceSet) -> bool {
        let Some(slot) = self.slot(id) else { return false };
        self.nodes[slot].available = available;
        self.reindex(slot);
        true
    }

    /// Chooses a node for `req` like [`crate::schedule`] over [`Self::nodes`] would (SCHED-17),
    /// without applying it. Cost: O(log nodes) once the class index exists; building one
    /// scans the nodes once.
    pub fn decide(&mut self, req: &Request<K>, local: Option<&K>, seed: u64) -> Decision<K> {
        if let Strategy::NodeAffinity { node, soft } = &req.strategy {
            let target = self.node(node).filter(|n| n.alive);
            // SCHED-9: a soft target that is alive and feasible is waited for (Ray).
            if !soft || target.is_some_and(|t| is_feasible(req, t)) {
                return hard_affinity(req, node, target);
            }
        }
        let cid = self.class_id(&req.demand, &req.label_selector);
        let class = self.classes[cid as usize].as_ref().expect("live class");
        if class.members == 0 {
            return Decision::Infeasible { reason: class.infeasible.clone() };
        }
        // SCHED-6: nodes without accelerators first while any has the demand free.
        let has_free = |s: &ScoreIndex<K>| s.range(..=ONE_BITS).next().is_some();
        let set_idx = if has_free(&class.sets[0]) { 0 } else { 1 };
        let set = &class.sets[set_idx];
        if !has_free(set) {
            let reason = format!(
                "no node has {} available now ({} feasible node(s) busy)",
                req.demand, class.members
            );
            return Decision::Queue { reason };
        }
        if matches!(req.strategy, Strategy::Spread) {
            let (_, ties) = set.iter().next().expect("a free node");
            let pick = (seed % ties.len() as u64) as usize;
            let (id, _) = ties.iter().nth(pick).expect("pick < ties");
            return Decision::Place(id.clone());
        }
        if let Some(l) = local
            && let Some(slot) = self.slot(l)
            && self.memberships[slot]
                .iter()
                .any(|&(c, bits, s)| c == cid && s as usize == set_idx && bits <= HALF_BITS)
        {
            return Decision::Place(l.clone());
        }
        let packing = set.keys().next().is_some_and(|&b| b <= HALF_BITS);
        let limit = if packing { HALF_BITS } else { ONE_BITS };
        // k = ceil(n / 5) clamped to 1..=MAX_TOP_K needs n only up to 5 * MAX_TOP_K + 1.
        let mut n = 0;
        for ids in set.range(..=limit).map(|(_, ids)| ids) {
            n += ids.len();
            if n > 5 * MAX_TOP_K {
                break;
            }
        }
        let k = n.div_ceil(5).clamp(1, MAX_TOP_K).min(n);
        let pick = (splitmix64(seed) % k as u64) as usize;
        let chosen = if packing {
            set.range(..=limit).rev().flat_map(|(_, ids)| ids.iter()).nth(pick)
        } else {
            set.range(..=limit).flat_map(|(_, ids)| ids.iter()).nth(pick)
        };
        Decision::Place(chosen.expect("pick < k <= n").0.clone())
    }

    /// The class index for (demand, selector), built when missing.
    pub(crate) fn class_id(&mut self, demand: &ResourceSet, selector: &[LabelConstraint]) -> u32 {
        self.clock += 1;
        let hash = class_hash(demand, selector);
        if let Some(ids) = self.class_by_hash.get(&hash) {
            for &id in ids {
                if let Some(c) = self.classes[id as usize].as_mut()
                    && c.demand == *demand
                    && c.selector == selector
                {
                    c.last_used = self.clock;
                    return id;
                }
            }
        }
        if self.live_classes >= MAX_CLASSES {
            self.evict_lru();
        }
        let id = match self.classes.iter().position(Option::is_none) {
            Some(free) => free as u32,
            None => {
                self.classes.push(None);
                (self.classes.len() - 1) as u32
            }
        };
        let mut class = Class {
            demand: demand.clone(),
            selector: selector.to_vec(),
            hash,
            members: 0,
            sets: [BTreeMap::new(), BTreeMap::new()],
            infeasible: String::new(),
            last_used: self.clock,
        };
        for (slot, n) in self.nodes.iter().enumerate() {
            // SCHED-3: alive, total covers the demand, labels match.
            if !n.alive || !n.total.is_superset_of(demand) || !selector_matches(selector, &n.labels)
            {
                continue;
            }
            let bits = score_bits(demand, n);
            let set = u8::from(is_accelerator_node(n));
            class.sets[set as usize].entry(bits).or_default().insert((n.id.clone(), slot as u32));
            self.memberships[slot].push((id, bits, set));
            class.members += 1;
        }
        if class.members == 0 {
            let alive: Vec<&NodeView<K>> = self.nodes.iter().filter(|n| n.alive).collect();
            let req = Request {
                demand: demand.clone(),
                strategy: Strategy::Default,
                label_selector: selector.to_vec(),
            };
            class.infeasible = infeasible_reason(&req, &alive);
        }
        self.classes[id as usize] = Some(class);
        self.class_by_hash.entry(hash).or_default().push(id);
        self.live_classes += 1;
        id
    }

    pub(crate) fn class(&self, id: u32) -> &Class<K> {
        self.classes[id as usize].as_ref().expect("live class")
    }

    fn evict_lru(&mut self) {
        let Some((victim, _)) = self
            .classes
            .iter()
            .enumerate()
            .filter_map(|(i, c)| c.as_ref().map(|c| (i, c.last_used)))
            .min_by_key(|&(_, used)| used)
        else {
            return;
        };
        let class = self.classes[victim].take().expect("live class");
        self.live_classes -= 1;
        if let Some(ids) = self.class_by_hash.get_mut(&class.hash) {
            ids.retain(|&i| i as usize != victim);
        }
        for m in &mut self.memberships {
            m.retain(|&(c, _, _)| c as usize != victim);
        }
    }

    fn invalidate(&mut self) {
        if self.live_classes == 0 {
            return;
        }
        self.classes.clear();
        self.class_by_hash.clear();
        self.live_classes = 0;
        for m in &mut self.memberships {
            m.clear();
        }
    }

    /// Moves the node in every class it belongs to after its available changed.
    fn reindex(&mut self, slot: usize) {
        let node = &self.nodes[slot];
        for (cid, bits, set) in self.memberships[slot].iter_mut() {
            let class = self.classes[*cid as usize].as_mut().expect("live class");
            let new_bits = score_bits(&class.demand, node);
            if new_bits == *bits {
                continue;
            }
            let index = &mut class.sets[*set as usize];
            let key = (node.id.clone(), slot as u32);
            if let Some(ids) = index.get_mut(bits) {
                ids.remove(&key);
                if ids.is_empty() {
                    index.remove(bits);
                }
            }
            index.entry(new_bits).or_default().insert(key);
            *bits = new_bits;
        }
    }
}

/// Decides like [`crate::schedule`] over `view`'s nodes and, on `Place`, takes the demand
/// from the chosen node (SCHED-4, SCHED-17). Release it with [`ClusterView::release`].
pub fn schedule_in<K: Clone + Eq + Hash + Ord + Debug>(
    view: &mut ClusterView<K>,
    req: &Request<K>,
    local: Option<&K>,
    seed: u64,
) -> Decision<K> {
    let d = view.decide(req, local, seed);
    if let Decision::Place(id) = &d {
        let ok = view.allocate(id, &req.demand);
        debug_assert!(ok, "a placed node has the demand free (SCHED-4)");
    }
    d
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::labels::parse_label_selector;
    use crate::policy::schedule;
    use crate::resources::Amount;

    use crate::test_util::{node, res};

    fn req(demand: &str, strategy: Strategy<u32>, sel: &[(&str, &str)]) -> Request<u32> {
        let map = sel.iter().map(|(k, v)| (k.to_string(), v.to_string())).collect();
        Request {
            demand: res(demand),
            strategy,
            label_selector: parse_label_selector(&map).unwrap(),
        }
    }

    /// Tiny deterministic generator for the randomised cases.
    fn next(s: &mut u64) -> u64 {
        *s = s.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
        *s >> 33
    }

    /// SCHED-17: `ClusterView` decisions equal `schedule`'s over the same nodes.
    #[test]
    fn indexed_decisions_equal_schedule_over_the_same_nodes_sched_17() {
        let shapes = [
            r#"{"CPU": 4}"#,
            r#"{"CPU": 8, "GPU": 2}"#,
            r#"{"CPU": 16, "TPU": 4}"#,
            r#"{"CPU": 2, "memory": 4e9}"#,
        ];
        let reqs = [
            req(r#"{"CPU": 1}"#, Strategy::Default, &[]),
            req(r#"{"CPU": 0.5}"#, Strategy::Spread, &[]),
            req(r#"{"CPU": 1, "GPU": 0.5}"#, Strategy::Default, &[]),
            req(r#"{"TPU": 1}"#, Strategy::Default, &[("zone", "!z1")]),
            req(r#"{"CPU": 2}"#, Strategy::Default, &[("zone", "in(z0,z2)")]),
            req("{}", Strategy::Default, &[]),
            req(r#"{"CPU": 1}"#, Strategy::NodeAffinity { node: 3, soft: true }, &[]),
            req(r#"{"CPU": 1}"#, Strategy::NodeAffinity { node: 5, soft: false }, &[]),
            req(r#"{"GPU": 9}"#, Strategy::Default, &[]),
            req(r#"{"CPU": 1}"#, Strategy::Default, &[("zone", "z9")]),
        ];
        let mut rng = 7u64;
        for round in 0..20 {
            let nodes: Vec<_> = (0..40)
                .map(|i| {
                    let shape = shapes[(next(&mut rng) % 4) as usize];
                    let mut n = node(i, shape, &format!("zone=z{}", next(&mut rng) % 3));
                    n.alive = !next(&mut rng).is_multiple_of(10);
                    n
                })
                .collect();
            let mut view = ClusterView::new(nodes);
            let mut held: Vec<(u32, ResourceSet)> = Vec::new();
            for step in 0..300u64 {
                let r = &reqs[(next(&mut rng) % reqs.len() as u64) as usize];
                let local = Some(next(&mut rng) as u32 % 45);
                let seed = next(&mut rng);
                let want = schedule(r, view.nodes(), local.as_ref(), seed);
                let got = schedule_in(&mut view, r, local.as_ref(), seed);
                assert_eq!(got, want, "round {round} step {step} {r:?}");
                if let Decision::Place(id) = got {
                    held.push((id, r.demand.clone()));
                }
                if next(&mut rng).is_multiple_of(3) && !held.is_empty() {
                    let (id, d) = held.swap_remove((next(&mut rng) % held.len() as u64) as usize);
                    assert!(view.release(&id, &d));
                }
                if step % 97 == 0 {
                    let id = next(&mut rng) as u32 % 40;
                    let alive = view.node(&id).is_some_and(|n| !n.alive);
                    view.set_alive(&id, alive);
                }
            }
        }
    }

    /// SCHED-6: CPU-only work fills nodes without accelerators before GPU/TPU hosts.
    #[test]
    fn cpu_only_work_fills_cpu_nodes_before_tpu_hosts_sched_6() {
        let mut nodes = vec![
            node(1, r#"{"CPU": 200, "TPU": 4}"#, ""),
            node(2, r#"{"CPU": 200, "GPU": 8}"#, ""),
        ];
        nodes.extend((3..6).map(|i| node(i, r#"{"CPU": 4}"#, "")));
        let mut view = ClusterView::new(nodes);
        let r = req(r#"{"CPU": 1}"#, Strategy::Default, &[]);
        // 12 CPUs on CPU-only nodes: the first 12 tasks land there, even with a TPU local node.
        for seed in 0..12 {
            let Decision::Place(id) = schedule_in(&mut view, &r, Some(&1), seed) else { panic!() };
            assert!((3..6).contains(&id), "task {seed} went to accelerator host {id}");
        }
        let Decision::Place(id) = schedule_in(&mut view, &r, None, 99) else { panic!() };
        assert!(id == 1 || id == 2, "only accelerator hosts have room now");
        // Freeing a CPU-only node brings work back to it.
        view.release(&4, &r.demand);
        assert_eq!(schedule_in(&mut view, &r, Some(&1), 5), Decision::Place(4));
    }

    /// SCHED-1: fractional amounts stay exact after a million allocate/release cycles.
    #[test]
    fn fractional_cpu_sums_stay_exact_after_a_million_add_remove_cycles_sched_1_18() {
        let total = res(r#"{"CPU": 3, "GPU": 1}"#);
        let parts = [
            res(r#"{"CPU": 0.1}"#),
            res(r#"{"CPU": 0.3333, "GPU": 0.25}"#),
            res(r#"{"CPU": 0.7}"#),
        ];
        let mut set = total.clone();
        for i in 0..1_000_000 {
            let p = &parts[i % 3];
            set = set.checked_sub(p).expect("fits");
            set.add(p);
        }
        assert_eq!(set, total);
        // The same through a view with a live class index.
        let mut view = ClusterView::new(vec![node(1, r#"{"CPU": 3, "GPU": 1}"#, "")]);
        let r = req(r#"{"CPU": 0.1}"#, Strategy::Default, &[]);
        assert_eq!(view.decide(&r, None, 0), Decision::Place(1));
        for i in 0..1_000_000 {
            let p = &parts[i % 3];
            assert!(view.allocate(&1, p));
            view.release(&1, p);
        }
        assert_eq!(view.node(&1).unwrap().available, total);
        assert_eq!(view.node(&1).unwrap().available.get("CPU"), Amount(30_000));
    }

    #[test]
    fn class_indexes_follow_membership_changes_and_eviction() {
        let mut view = ClusterView::new((0..3).map(|i| node(i, r#"{"CPU": 1}"#, "")).collect());
        let r = req(r#"{"CPU": 1}"#, Strategy::Spread, &[]);
        assert_eq!(schedule_in(&mut view, &r, None, 0), Decision::Place(0));
        view.remove_node(&1);
        assert_eq!(schedule_in(&mut view, &r, None, 0), Decision::Place(2));
        assert!(matches!(schedule_in(&mut view, &r, None, 0), Decision::Queue { .. }));
        view.upsert_node(node(7, r#"{"CPU": 2}"#, ""));
        assert_eq!(schedule_in(&mut view, &r, None, 0), Decision::Place(7));
        for i in 0..(MAX_CLASSES as u32 + 10) {
            let r = req(&format!(r#"{{"CPU": 0.{:04}}}"#, i + 1), Strategy::Default, &[]);
            assert!(matches!(view.decide(&r, None, 0), Decision::Place(7)));
        }
        assert_eq!(view.live_classes, MAX_CLASSES);
    }
}
