//! Placement groups: atomic bundle placement with PACK, SPREAD, STRICT_PACK, STRICT_SPREAD
//! ([`place_group`], [`place_group_in`]), re-placement of bundles lost with a dead node
//! ([`replace_lost_bundles`]), and TPU slice groups ([`place_slice_group`]).
//!
//! A group is placed whole or not at all (SCHED-10): every assignment is computed against
//! the nodes' available resources minus what earlier bundles of the same group took.

use std::collections::{BTreeMap, HashMap, HashSet};
use std::fmt::Debug;
use std::hash::Hash;

use crate::cluster::ClusterView;
use crate::labels::{
    LabelConstraint, LabelOp, TPURAY_PREFIX, format_label_selector, selector_matches,
};
use crate::policy::{
    NodeView, Request, Strategy, infeasible_reason, is_accelerator_node, utilisation,
};
use crate::resources::ResourceSet;
use crate::tpu::{AcceleratorType, Topology};

/// One bundle of a placement group: resources reserved together on one node.
#[derive(Clone, Debug, Default, PartialEq, Eq, Hash, serde::Serialize, serde::Deserialize)]
pub struct Bundle {
    pub demand: ResourceSet,
    /// Every constraint must match the node's labels.
    pub label_selector: Vec<LabelConstraint>,
}

/// How a group's bundles spread over nodes (Ray's names).
#[derive(
    Clone, Copy, Debug, PartialEq, Eq, Hash, Default, serde::Serialize, serde::Deserialize,
)]
pub enum PgStrategy {
    /// As few nodes as possible (one when it fits), else best effort.
    #[default]
    Pack,
    /// Distinct nodes where possible, else best effort.
    Spread,
    /// All bundles on one node, or nothing.
    StrictPack,
    /// Every bundle on a different node, or nothing.
    StrictSpread,
}

/// The answer for a placement group.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum PgDecision<K> {
    /// One node per bundle, in bundle order; the whole group fits now (SCHED-10).
    Placed(Vec<K>),
    /// Could fit the alive nodes, but not with what is free now.
    Pending { reason: String },
    /// No arrangement fits the alive nodes' totals (SCHED-16); `reason` names the problem.
    Infeasible { reason: String },
}

/// Where candidate nodes for a bundle shape come from: a scan of a slice, or a
/// [`ClusterView`] class index.
trait Candidates {
    /// Slots whose available covers shape `s`, non-accelerator nodes first, emptiest first.
    fn available(&self, s: usize) -> Box<dyn Iterator<Item = usize> + '_>;
    /// Slots whose total covers shape `s` (alive, labels matching).
    fn members(&self, s: usize) -> Box<dyn Iterator<Item = usize> + '_>;
    fn member_count(&self, s: usize) -> usize;
    fn infeasible_reason(&self, s: usize) -> String;
}

/// Candidates found by scanning a slice of nodes once per shape.
struct Scan {
    /// Per shape: (available slots, member slots, infeasible reason).
    shapes: Vec<(Vec<usize>, Vec<usize>, String)>,
}

impl Scan {
    fn new<K: Clone + Eq + Hash + Ord + Debug>(nodes: &[NodeView<K>], shapes: &[Bundle]) -> Scan {
        let shapes = shapes
            .iter()
            .map(|b| {
                let mut members: Vec<(bool, u64, &K, usize)> = nodes
                    .iter()
                    .enumerate()
                    .filter(|(_, n)| {
                        n.alive
                            && n.total.is_superset_of(&b.demand)
                            && selector_matches(&b.label_selector, &n.labels)
                    })
                    .map(|(i, n)| {
                        let score = (utilisation(&b.demand, n) + 0.0).to_bits();
                        (is_accelerator_node(n), score, &n.id, i)
                    })
                    .collect();
                members.sort();
                let avail = members
                    .iter()
                    .filter(|m| nodes[m.3].available.is_superset_of(&b.demand))
                    .map(|m| m.3)
                    .collect();
                let reason = if members.is_empty() {
                    let alive: Vec<&NodeView<K>> = nodes.iter().filter(|n| n.alive).collect();
                    let req = Request {
                        demand: b.demand.clone(),
                        strategy: Strategy::Default,
                        label_selector: b.label_selector.clone(),
                    };
                    infeasible_reason(&req, &alive)
                } else {
                    String::new()
                };
                (avail, members.iter().map(|m| m.3).collect(), reason)
            })
            .collect();
        Scan { shapes }
    }
}

impl Candidates for Scan {
    fn available(&self, s: usize) -> Box<dyn Iterator<Item = usize> + '_> {
        Box::new(self.shapes[s].0.iter().copied())
    }
    fn members(&self, s: usize) -> Box<dyn Iterator<Item = usize> + '_> {
        Box::new(self.shapes[s].1.iter().copied())
    }
    fn member_count(&self, s: usize) -> usize {
        self.shapes[s].1.len()
    }
    fn infeasible_reason(&self, s: usize) -> String {
        self.shapes[s].2.clone()
    }
}

/// Candidates from a [`ClusterView`]'s class indexes (O(log nodes) to the first one).
struct Indexed<'a, K> {
    view: &'a ClusterView<K>,
    classes: Vec<u32>,
}

impl<K: Clone + Eq + Hash + Ord + Debug> Candidates for Indexed<'_, K> {
    fn available(&self, s: usize) -> Box<dyn Iterator<Item = usize> + '_> {
        Box::new(self.view.class(self.classes[s]).available())
    }
    fn members(&self, s: usize) -> Box<dyn Iterator<Item = usize> + '_> {
        Box::new(self.view.class(self.classes[s]).members())
    }
    fn member_count(&self, s: usize) -> usize {
        self.view.class(self.classes[s]).member_count()
    }
    fn infeasible_reason(&self, s: usize) -> String {
        self.view.class(self.classes[s]).infeasible_reason().to_string()
    }
}

/// The distinct bundle shapes, each bundle's shape index, and (last) the combined shape: the
/// sum of all demands with every selector, i.e. "one node holds the whole group".
fn shapes_of(bundles: &[Bundle]) -> (Vec<Bundle>, Vec<usize>) {
    let mut shapes: Vec<Bundle> = Vec::new();
    let mut index: HashMap<&Bundle, usize> = HashMap::new();
    let mut of = Vec::with_capacity(bundles.len());
    for b in bundles {
        let next = shapes.len();
        let i = *index.entry(b).or_insert(next);
        if i == next {
            shapes.push(b.clone());
        }
        of.push(i);
    }
    let mut combined = Bundle::default();
    for b in bundles {
        combined.demand.add(&b.demand);
        for c in &b.label_selector {
            if !combined.label_selector.contains(c) {
                combined.label_selector.push(c.clone());
            }
        }
    }
    shapes.push(combined);
    (shapes, of)
}

/// Places `bundles` with `strategy` on `nodes`: all or nothing (SCHED-10). `Infeasible`
/// when no arrangement fits the alive nodes' totals (a bundle no node can hold, STRICT_SPREAD
/// with more bundles than nodes that can hold them, STRICT_PACK with no node big enough,
/// SCHED-16); `Pending` when one would fit but not with what is free now. `seed` is kept for
/// symmetry with [`crate::schedule`]; the answer is deterministic. Cost: O(nodes × distinct
/// bundle shapes) for the scan plus O(bundles²) at worst; use [`place_group_in`] at scale.
pub fn place_group<K: Clone + Eq + Hash + Ord + Debug>(
    bundles: &[Bundle],
    strategy: PgStrategy,
    nodes: &[NodeView<K>],
    seed: u64,
) -> PgDecision<K> {
    let _ = seed;
    let (shapes, of) = shapes_of(bundles);
    let scan = Scan::new(nodes, &shapes);
    let fixed = vec![None; bundles.len()];
    to_ids(solve(nodes, &scan, bundles, &of, shapes.len() - 1, strategy, &fixed), nodes)
}

/// Like [`place_group`] over `view`'s nodes using its class indexes, and on `Placed`
/// reserves every bundle (SCHED-10). Release with [`release_group_in`].
pub fn place_group_in<K: Clone + Eq + Hash + Ord + Debug>(
    view: &mut ClusterView<K>,
    bundles: &[Bundle],
    strategy: PgStrategy,
    seed: u64,
) -> PgDecision<K> {
    let _ = seed;
    let (shapes, of) = shapes_of(bundles);
    let classes: Vec<u32> =
        shapes.iter().map(|b| view.class_id(&b.demand, &b.label_selector)).collect();
    let fixed = vec![None; bundles.len()];
    let d = {
        let src = Indexed { view, classes };
        let r = solve(view.nodes(), &src, bundles, &of, shapes.len() - 1, strategy, &fixed);
        to_ids(r, view.nodes())
    };
    if let PgDecision::Placed(ids) = &d {
        for (b, id) in bundles.iter().zip(ids) {
            let ok = view.allocate(id, &b.demand);
            debug_assert!(ok, "placed bundles fit together (SCHED-10)");
        }
    }
    d
}

/// Gives back every bundle of a group placed by [`place_group_in`] (removal frees all).
pub fn release_group_in<K: Clone + Eq + Hash + Ord + Debug>(
    view: &mut ClusterView<K>,
    bundles: &[Bundle],
    placed: &[K],
) {
    for (b, id) in bundles.iter().zip(placed) {
        view.release(id, &b.demand);
    }
}

/// Re-places the bundles of a group whose node died. `placed[i]` is bundle i's node;
/// bundles on nodes that are still alive stay (their resources are already taken from
/// those nodes' available) and the others are placed anew, honouring `strategy` against the
/// survivors (STRICT_SPREAD avoids their nodes, PACK prefers them). All lost bundles are
/// placed or none (SCHED-10). Returns the full assignment.
pub fn replace_lost_bundles<K: Clone + Eq + Hash + Ord + Debug>(
    bundles: &[Bundle],
    strategy: PgStrategy,
    placed: &[K],
    nodes: &[NodeView<K>],
) -> PgDecision<K> {
    let slot: HashMap<&K, usize> = nodes.iter().enumerate().map(|(i, n)| (&n.id, i)).collect();
    let fixed: Vec<Option<usize>> = placed
        .iter()
        .map(|id| slot.get(id).copied().filter(|&s| nodes[s].alive))
        .chain(std::iter::repeat(None))
        .take(bundles.len())
        .collect();
    let lost: Vec<Bundle> =
        bundles.iter().zip(&fixed).filter(|(_, f)| f.is_none()).map(|(b, _)| b.clone()).collect();
    let (shapes, _) = shapes_of(if lost.is_empty() { bundles } else { &lost });
    let (mut all_shapes, of) = shapes_of(bundles);
    // The combined shape of a re-placement is the lost bundles only.
    *all_shapes.last_mut().expect("combined shape") = shapes.last().expect("combined").clone();
    let scan = Scan::new(nodes, &all_shapes);
    to_ids(solve(nodes, &scan, bundles, &of, all_shapes.len() - 1, strategy, &fixed), nodes)
}

fn to_ids<K: Clone>(r: Result<Vec<usize>, (bool, String)>, nodes: &[NodeView<K>]) -> PgDecision<K> {
    match r {
        Ok(slots) => PgDecision::Placed(slots.into_iter().map(|s| nodes[s].id.clone()).collect()),
        Err((true, reason)) => PgDecision::Infeasible { reason },
        Err((false, reason)) => PgDecision::Pending { reason },
    }
}

fn strategy_name(s: PgStrategy) -> &'static str {
    s.name()
}

impl PgStrategy {
    /// Ray's name: `PACK`, `SPREAD`, `STRICT_PACK`, `STRICT_SPREAD`.
    pub fn name(self) -> &'static str {
        match self {
            PgStrategy::Pack => "PACK",
            PgStrategy::Spread => "SPREAD",
            PgStrategy::StrictPack => "STRICT_PACK",
            PgStrategy::StrictSpread => "STRICT_SPREAD",
        }
    }

    /// Parses Ray's names (case-insensitive); empty means `PACK`, Ray's default.
    ///
    /// # Errors
    /// A message naming the strategy given and the four valid ones.
    pub fn parse(s: &str) -> Result<PgStrategy, String> {
        match s.to_ascii_uppercase().as_str() {
            "" | "PACK" => Ok(PgStrategy::Pack),
            "SPREAD" => Ok(PgStrategy::Spread),
            "STRICT_PACK" => Ok(PgStrategy::StrictPack),
            "STRICT_SPREAD" => Ok(PgStrategy::StrictSpread),
            _ => Err(format!(
                "unknown placement strategy {s:?} (expected PACK, SPREAD, STRICT_PACK or STRICT_SPREAD)"
            )),
        }
    }
}

/// The assignment (slot per bundle) or (infeasible?, reason). `fixed[i]` pins bundle i.
#[allow(clippy::too_many_arguments)]
fn solve<K>(
    nodes: &[NodeView<K>],
    src: &dyn Candidates,
    bundles: &[Bundle],
    of: &[usize],
    combined: usize,
    strategy: PgStrategy,
    fixed: &[Option<usize>],
) -> Result<Vec<usize>, (bool, String)> {
    let name = strategy_name(strategy);
    let todo: Vec<usize> = (0..bundles.len()).filter(|&i| fixed[i].is_none()).collect();
    if todo.is_empty() {
        return Ok(fixed.iter().map(|f| f.expect("all fixed")).collect());
    }
    for &i in &todo {
        if src.member_count(of[i]) == 0 {
            let why = src.infeasible_reason(of[i]);
            return Err((true, format!("bundle {i} {}: {why}", bundles[i].demand)));
        }
    }
    let b = todo.len();
    let sum = &src_shape_demand(bundles, &todo);
    let kept: Vec<usize> = fixed.iter().flatten().copied().collect();
    let mut out: Vec<Option<usize>> = fixed.to_vec();
    let assign = |slot: usize, out: &mut Vec<Option<usize>>| {
        for &i in &todo {
            out[i] = Some(slot);
        }
    };
    match strategy {
        PgStrategy::StrictPack | PgStrategy::Pack
            if kept.is_empty() || strategy == PgStrategy::StrictPack =>
        {
            let target = match kept.first() {
                // STRICT_PACK survivors pin the node.
                Some(&k) => Some(k).filter(|&k| fits_all(&nodes[k], bundles, &todo, false)),
                None => src.available(combined).next(),
            };
            if let Some(slot) = target {
                assign(slot, &mut out);
                return Ok(out.into_iter().map(|s| s.expect("assigned")).collect());
            }
            if strategy == PgStrategy::StrictPack {
                let ever = match kept.first() {
                    Some(&k) => fits_all(&nodes[k], bundles, &todo, true),
                    None => src.member_count(combined) > 0,
                };
                if !ever {
                    return Err((
                        true,
                        format!(
                            "STRICT_PACK: no alive node can hold all {b} bundles together ({sum})"
                        ),
                    ));
                }
                return Err((
                    false,
                    format!("STRICT_PACK: no node has all {b} bundles ({sum}) available now"),
                ));
            }
        }
        _ => {}
    }
    if strategy == PgStrategy::StrictSpread {
        let union: usize = if todo.iter().all(|&i| of[i] == of[todo[0]]) {
            src.members(of[todo[0]]).filter(|s| !kept.contains(s)).count()
        } else {
            let mut u = HashSet::new();
            for &i in &todo {
                u.extend(src.members(of[i]).filter(|s| !kept.contains(s)));
            }
            u.len()
        };
        if union < b {
            return Err((
                true,
                format!(
                    "STRICT_SPREAD needs {b} distinct nodes but only {union} alive node(s) can hold a bundle"
                ),
            ));
        }
    }
    if let Some(done) = greedy(nodes, src, bundles, of, strategy, &out, &todo, false) {
        return Ok(done);
    }
    if strategy == PgStrategy::StrictSpread {
        if let Some(done) = matching(src, of, &out, &todo, false) {
            return Ok(done);
        }
        if matching(src, of, &out, &todo, true).is_none() {
            let why = "no assignment of bundles to distinct alive nodes fits their totals";
            return Err((true, format!("STRICT_SPREAD: {why}")));
        }
        return Err((
            false,
            format!("{name}: not enough distinct nodes have the {b} bundles available now"),
        ));
    }
    if greedy(nodes, src, bundles, of, strategy, &out, &todo, true).is_none() {
        return Err((
            true,
            format!("{name}: the {b} bundles ({sum}) do not fit the alive nodes' total resources"),
        ));
    }
    Err((false, format!("{name}: not enough resources available now for all {b} bundles ({sum})")))
}

fn src_shape_demand(bundles: &[Bundle], todo: &[usize]) -> ResourceSet {
    let mut sum = ResourceSet::new();
    for &i in todo {
        sum.add(&bundles[i].demand);
    }
    sum
}

/// True when `n` can hold every bundle in `todo` at once (by total when `ever`).
fn fits_all<K>(n: &NodeView<K>, bundles: &[Bundle], todo: &[usize], ever: bool) -> bool {
    let have = if ever { &n.total } else { &n.available };
    n.alive
        && have.is_superset_of(&src_shape_demand(bundles, todo))
        && todo.iter().all(|&i| selector_matches(&bundles[i].label_selector, &n.labels))
}

/// Bundle by bundle: PACK/STRICT_PACK reuse nodes the group already holds; SPREAD and
/// STRICT_SPREAD take a new node first (STRICT_SPREAD only new ones). `ever` checks
/// against totals instead of available.
#[allow(clippy::too_many_arguments)]
fn greedy<K>(
    nodes: &[NodeView<K>],
    src: &dyn Candidates,
    bundles: &[Bundle],
    of: &[usize],
    strategy: PgStrategy,
    fixed: &[Option<usize>],
    todo: &[usize],
    ever: bool,
) -> Option<Vec<usize>> {
    let base = |s: usize| if ever { &nodes[s].total } else { &nodes[s].available };
    // What each node the group holds has left: SCHED-10, earlier bundles count.
    let mut left: Vec<(usize, ResourceSet)> = Vec::new();
    for f in fixed.iter().flatten() {
        if !left.iter().any(|(s, _)| s == f) {
            left.push((*f, base(*f).clone()));
        }
    }
    if ever {
        // Survivors' resources are part of the totals: take them out again.
        for (i, f) in fixed.iter().enumerate() {
            if let Some(f) = f
                && let Some((_, l)) = left.iter_mut().find(|(s, _)| s == f)
            {
                l.saturating_sub(&bundles[i].demand);
            }
        }
    }
    let mut iters: HashMap<usize, Box<dyn Iterator<Item = usize> + '_>> = HashMap::new();
    let mut out = fixed.to_vec();
    let prefer_held = matches!(strategy, PgStrategy::Pack | PgStrategy::StrictPack);
    for &i in todo {
        let b = &bundles[i];
        let held = |left: &[(usize, ResourceSet)]| {
            left.iter().position(|(s, l)| {
                l.is_superset_of(&b.demand)
                    && selector_matches(&b.label_selector, &nodes[*s].labels)
            })
        };
        let mut pos = if prefer_held { held(&left) } else { None };
        if pos.is_none() {
            let it = iters
                .entry(of[i])
                .or_insert_with(|| if ever { src.members(of[i]) } else { src.available(of[i]) });
            // Candidates the group does not hold yet still have their whole base free.
            if let Some(s) = it.by_ref().find(|s| !left.iter().any(|(h, _)| h == s)) {
                left.push((s, base(s).clone()));
                pos = Some(left.len() - 1);
            }
        }
        if pos.is_none() && strategy == PgStrategy::Spread {
            pos = held(&left);
        }
        let p = pos?;
        left[p].1.saturating_sub(&b.demand);
        out[i] = Some(left[p].0);
    }
    Some(out.into_iter().map(|s| s.expect("assigned")).collect())
}

/// STRICT_SPREAD by bipartite matching (Kuhn's augmenting paths): each bundle on its own
/// node, none on a survivor's node.
fn matching(
    src: &dyn Candidates,
    of: &[usize],
    fixed: &[Option<usize>],
    todo: &[usize],
    ever: bool,
) -> Option<Vec<usize>> {
    let kept: HashSet<usize> = fixed.iter().flatten().copied().collect();
    let adj: Vec<Vec<usize>> = todo
        .iter()
        .map(|&i| {
            let it = if ever { src.members(of[i]) } else { src.available(of[i]) };
            it.filter(|s| !kept.contains(s)).collect()
        })
        .collect();
    let mut owner: HashMap<usize, usize> = HashMap::new();
    fn augment(
        b: usize,
        adj: &[Vec<usize>],
        owner: &mut HashMap<usize, usize>,
        seen: &mut HashSet<usize>,
    ) -> bool {
        for &s in &adj[b] {
            if !seen.insert(s) {
                continue;
            }
            let free = match owner.get(&s) {
                None => true,
                Some(&other) => augment(other, adj, owner, seen),
            };
            if free {
                owner.insert(s, b);
                return true;
            }
        }
        false
    }
    for b in 0..todo.len() {
        if !augment(b, &adj, &mut owner, &mut HashSet::new()) {
            return None;
        }
    }
    let mut out = fixed.to_vec();
    for (s, b) in owner {
        out[todo[b]] = Some(s);
    }
    Some(out.into_iter().map(|s| s.expect("assigned")).collect())
}

/// Reserves every host of `num_slices` intact TPU slices of `accelerator_type` (and
/// `topology`, when given), or nothing (SCHED-15). A slice is intact when its alive nodes
/// carry `tpuray.io/tpu-pod-type` = the type and one `tpuray.io/tpu-slice-name`, and their
/// `tpuray.io/tpu-worker-id`s are exactly 0..hosts-1, once each. Each host must match
/// `bundle`'s selector and have its demand free. The answer lists one node per host,
/// slices in slice-name order, hosts in worker-id order; slices are never mixed with each
/// other or with single-host nodes of the same generation (their pod type differs).
pub fn place_slice_group<K: Clone + Eq + Hash + Ord + Debug>(
    accelerator_type: &str,
    topology: Option<&str>,
    num_slices: usize,
    bundle: &Bundle,
    nodes: &[NodeView<K>],
) -> PgDecision<K> {
    let ty = match AcceleratorType::parse(accelerator_type) {
        Ok(t) => t,
        Err(e) => return PgDecision::Infeasible { reason: e.to_string() },
    };
    let topo = match topology.map(Topology::parse).transpose() {
        Ok(t) => t,
        Err(e) => return PgDecision::Infeasible { reason: e.to_string() },
    };
    if let Some(t) = &topo
        && let Err(e) = ty.check_topology(t)
    {
        return PgDecision::Infeasible { reason: e.to_string() };
    }
    let hosts = ty.hosts() as usize;
    // The label keys, made once: this runs for every waiting slice group over every node
    // (issue 34: 100 groups x 10,000 nodes in one placement pass).
    let [pod_type, topology_key, slice_key, worker_key] =
        ["tpu-pod-type", "tpu-topology", "tpu-slice-name", "tpu-worker-id"]
            .map(|k| format!("{TPURAY_PREFIX}{k}"));
    // slice name → worker id → alive nodes claiming it.
    let mut slices: BTreeMap<&str, BTreeMap<u32, Vec<usize>>> = BTreeMap::new();
    for (i, n) in nodes.iter().enumerate().filter(|(_, n)| n.alive) {
        let (Some(name), Some(w)) = (n.labels.get(&slice_key), n.labels.get(&worker_key)) else {
            continue;
        };
        let same_type = n
            .labels
            .get(&pod_type)
            .and_then(|t| AcceleratorType::parse(t).ok())
            .is_some_and(|t| t == ty);
        let same_topo = topo.as_ref().is_none_or(|t| {
            n.labels.get(&topology_key).and_then(|s| Topology::parse(s).ok()).as_ref() == Some(t)
        });
        let Ok(w) = w.parse::<u32>() else { continue };
        if same_type && same_topo {
            slices.entry(name).or_default().entry(w).or_default().push(i);
        }
    }
    let (mut intact, mut free, mut notes) = (0, Vec::new(), Vec::new());
    for (name, workers) in &slices {
        let complete = workers.len() == hosts
            && (0..hosts as u32).all(|w| workers.get(&w).is_some_and(|v| v.len() == 1));
        if !complete {
            notes.push(format!("{name} is not intact ({} of {hosts} worker ids)", workers.len()));
            continue;
        }
        let order: Vec<usize> = workers.values().map(|v| v[0]).collect();
        let matches = |s: &usize| selector_matches(&bundle.label_selector, &nodes[*s].labels);
        if !order.iter().all(|s| matches(s) && nodes[*s].total.is_superset_of(&bundle.demand)) {
            notes.push(format!("{name} cannot hold the bundle on every host"));
            continue;
        }
        intact += 1;
        if order.iter().all(|s| nodes[*s].available.is_superset_of(&bundle.demand))
            && free.len() < num_slices
        {
            free.push(order);
        }
    }
    let sel = format_label_selector(&bundle.label_selector);
    let what = format!(
        "{num_slices} intact {ty} slice(s) with {} per host and selector {sel}",
        bundle.demand
    );
    let notes = if notes.is_empty() { String::new() } else { format!("; {}", notes.join(", ")) };
    if intact < num_slices {
        return PgDecision::Infeasible { reason: format!("need {what}, found {intact}{notes}") };
    }
    if free.len() < num_slices {
        let reason = format!(
            "need {what}: {} of the {intact} intact slice(s) are free now{notes}",
            free.len()
        );
        return PgDecision::Pending { reason };
    }
    PgDecision::Placed(free.into_iter().flatten().map(|s| nodes[s].id.clone()).collect())
}

/// A selector for `tpuray.io/tpu-slice-name` = `name` (what slice bundles carry).
pub fn slice_name_selector(name: &str) -> Vec<LabelConstraint> {
    vec![LabelConstraint {
        key: format!("{TPURAY_PREFIX}tpu-slice-name"),
        op: LabelOp::In(vec![name.to_string()]),
    }]
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::labels::parse_label_selector;
    use crate::tpu::TpuHostInfo;

    use crate::test_util::{node, res};

    fn bundle(demand: &str, sel: &[(&str, &str)]) -> Bundle {
        let map = sel.iter().map(|(k, v)| (k.to_string(), v.to_string())).collect();
        Bundle { demand: res(demand), label_selector: parse_label_selector(&map).unwrap() }
    }

    /// A TPU host of `ty` in slice `name`, as from the environment of TPU.md.
    fn tpu_host(id: u32, ty: &str, name: &str, worker: u32, chips: u32) -> NodeView<u32> {
        let env = [("TPU_ACCELERATOR_TYPE", ty), ("TPU_NAME", name)]
            .into_iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .chain([("TPU_WORKER_ID".to_string(), worker.to_string())])
            .collect();
        let info = TpuHostInfo::from_env(&env, chips).unwrap();
        let mut total = res(r#"{"CPU": 8}"#);
        total.add(&info.resources());
        NodeView { id, available: total.clone(), total, labels: info.labels(), alive: true }
    }

    fn show(d: PgDecision<u32>) -> String {
        match d {
            PgDecision::Placed(ids) => format!("placed {ids:?}"),
            PgDecision::Pending { reason } => format!("pending: {reason}"),
            PgDecision::Infeasible { reason } => format!("infeasible: {reason}"),
        }
    }

    /// Both entry points (slice scan and indexed view) must agree; returns the answer.
    fn both(bundles: &[Bundle], s: PgStrategy, nodes: &[NodeView<u32>]) -> String {
        let a = show(place_group(bundles, s, nodes, 0));
        let mut view = ClusterView::new(nodes.to_vec());
        let b = show(place_group_in(&mut view, bundles, s, 0));
        assert_eq!(a, b, "scan and index disagree");
        a
    }

    #[test]
    fn placement_groups_by_strategy_place_all_or_nothing_sched_10_16() {
        use PgStrategy::*;
        let nodes = [
            node(1, r#"{"CPU": 4}"#, "zone=a"),
            node(2, r#"{"CPU": 4}"#, "zone=b"),
            node(3, r#"{"CPU": 2, "GPU": 2}"#, "zone=a"),
        ];
        let cpu = |n: usize, c: &str| vec![bundle(&format!(r#"{{"CPU": {c}}}"#), &[]); n];
        // (case, bundles, strategy, expected)
        let cases: Vec<(&str, Vec<Bundle>, PgStrategy, &str)> = vec![
            ("pack fits one node", cpu(3, "1"), Pack, "placed [1, 1, 1]"),
            ("pack overflows to a second node", cpu(3, "2"), Pack, "placed [1, 1, 2]"),
            ("strict pack on one node", cpu(2, "2"), StrictPack, "placed [1, 1]"),
            (
                "strict pack too big for any node",
                cpu(3, "2"),
                StrictPack,
                "infeasible: STRICT_PACK: no alive node can hold all 3 bundles together ({CPU: 6})",
            ),
            ("spread uses distinct nodes", cpu(2, "1"), Spread, "placed [1, 2]"),
            ("spread takes a third node before reusing", cpu(3, "2"), Spread, "placed [1, 2, 3]"),
            ("strict spread distinct nodes", cpu(3, "1"), StrictSpread, "placed [1, 2, 3]"),
            (
                "strict spread with more bundles than nodes",
                cpu(4, "1"),
                StrictSpread,
                "infeasible: STRICT_SPREAD needs 4 distinct nodes but only 3 alive node(s) can hold a bundle",
            ),
            (
                "bundles exceed the cluster total",
                cpu(6, "2"),
                Pack,
                "infeasible: PACK: the 6 bundles ({CPU: 12}) do not fit the alive nodes' total resources",
            ),
            (
                "a bundle no node can hold",
                vec![bundle(r#"{"CPU": 1}"#, &[]), bundle(r#"{"TPU": 4}"#, &[])],
                Pack,
                r#"infeasible: bundle 1 {TPU: 4}: no node has resource "TPU" (requested 4, cluster total 0)"#,
            ),
            (
                "bundle selectors are honoured",
                vec![
                    bundle(r#"{"CPU": 1}"#, &[("zone", "b")]),
                    bundle(r#"{"CPU": 1}"#, &[("zone", "a")]),
                ],
                StrictSpread,
                "placed [2, 1]",
            ),
            (
                "strict spread needs matching, not greedy",
                vec![
                    bundle(r#"{"CPU": 1}"#, &[]),
                    bundle(r#"{"CPU": 1}"#, &[]),
                    bundle(r#"{"CPU": 1}"#, &[("zone", "b")]),
                ],
                StrictSpread,
                "placed [1, 3, 2]",
            ),
            (
                "gpu bundles go to the gpu node",
                vec![bundle(r#"{"GPU": 1}"#, &[]); 2],
                Pack,
                "placed [3, 3]",
            ),
        ];
        for (case, bundles, s, want) in cases {
            assert_eq!(both(&bundles, s, &nodes), want, "{case}");
        }
    }

    #[test]
    fn busy_groups_are_pending_and_reserve_nothing_sched_10() {
        let mut nodes = vec![node(1, r#"{"CPU": 4}"#, ""), node(2, r#"{"CPU": 4}"#, "")];
        nodes[0].available = res(r#"{"CPU": 1}"#);
        nodes[1].available = res(r#"{"CPU": 1}"#);
        let cases = [
            (
                PgStrategy::StrictPack,
                2,
                "pending: STRICT_PACK: no node has all 2 bundles ({CPU: 4}) available now",
            ),
            (
                PgStrategy::Pack,
                2,
                "pending: PACK: not enough resources available now for all 2 bundles ({CPU: 6})",
            ),
            (
                PgStrategy::StrictSpread,
                2,
                "pending: STRICT_SPREAD: not enough distinct nodes have the 2 bundles available now",
            ),
        ];
        for (s, n, want) in cases {
            let demand =
                if s == PgStrategy::StrictPack { r#"{"CPU": 2}"# } else { r#"{"CPU": 3}"# };
            let bundles = vec![bundle(demand, &[]); n];
            let mut view = ClusterView::new(nodes.clone());
            assert_eq!(show(place_group_in(&mut view, &bundles, s, 0)), want, "{s:?}");
            assert_eq!(view.nodes(), nodes.as_slice(), "nothing reserved for {s:?}");
        }
    }

    #[test]
    fn removing_a_group_frees_everything_it_reserved_sched_10() {
        let nodes: Vec<_> = (0..5).map(|i| node(i, r#"{"CPU": 4, "memory": 8e9}"#, "")).collect();
        let mut view = ClusterView::new(nodes.clone());
        let bundles = vec![bundle(r#"{"CPU": 1.5, "memory": 1e9}"#, &[]); 5];
        for s in [PgStrategy::Pack, PgStrategy::Spread, PgStrategy::StrictSpread] {
            let PgDecision::Placed(ids) = place_group_in(&mut view, &bundles, s, 0) else {
                panic!()
            };
            let used: i64 =
                view.nodes().iter().map(|n| n.total.get("CPU").0 - n.available.get("CPU").0).sum();
            assert_eq!(used, 75_000, "{s:?}");
            release_group_in(&mut view, &bundles, &ids);
            assert_eq!(view.nodes(), nodes.as_slice(), "{s:?}");
        }
    }

    #[test]
    fn bundles_lost_with_a_dead_node_are_replaced_keeping_survivors() {
        let mut nodes: Vec<_> = (0..4).map(|i| node(i, r#"{"CPU": 2}"#, "")).collect();
        let bundles = vec![bundle(r#"{"CPU": 1}"#, &[]); 3];
        // STRICT_SPREAD on 0, 1, 2; node 1 dies: the lost bundle goes to 3, not 0 or 2.
        for n in [0, 2] {
            nodes[n].available = res(r#"{"CPU": 1}"#);
        }
        nodes[1].alive = false;
        let d = replace_lost_bundles(&bundles, PgStrategy::StrictSpread, &[0, 1, 2], &nodes);
        assert_eq!(show(d), "placed [0, 3, 2]");
        // PACK on 0, 0, 1; node 1 dies: the lost bundle joins its survivors on 0.
        nodes[0].available = ResourceSet::new();
        nodes[0].total = res(r#"{"CPU": 3}"#);
        nodes[0].available = res(r#"{"CPU": 1}"#);
        let d = replace_lost_bundles(&bundles, PgStrategy::Pack, &[0, 0, 1], &nodes);
        assert_eq!(show(d), "placed [0, 0, 0]");
        // No node left for STRICT_SPREAD: infeasible, not hung.
        nodes[3].alive = false;
        let d = replace_lost_bundles(&bundles, PgStrategy::StrictSpread, &[0, 1, 2], &nodes);
        assert!(show(d).starts_with("infeasible: STRICT_SPREAD needs 1 distinct nodes but only 0"));
    }

    /// Two 4-host v6e-16 slices (ids 10.., 20..), four single-host v6e-4 nodes (ids 30..)
    /// of the same generation, and a CPU node.
    fn tpu_cluster() -> Vec<NodeView<u32>> {
        let mut nodes = vec![node(1, r#"{"CPU": 8}"#, "")];
        // Worker ids arrive out of order on purpose.
        for w in [2, 0, 3, 1] {
            nodes.push(tpu_host(10 + w, "v6e-16", "sa", w, 4));
            nodes.push(tpu_host(20 + w, "v6e-16", "sb", w, 4));
        }
        for i in 0..4 {
            nodes.push(tpu_host(30 + i, "v6e-4", &format!("single{i}"), 0, 4));
        }
        nodes
    }

    /// SCHED-15: a slice group takes every host of N intact slices, or nothing.
    #[test]
    fn slice_group_takes_every_host_of_intact_slices_in_worker_order_sched_15() {
        let b = bundle(r#"{"TPU": 4}"#, &[]);
        let mut nodes = tpu_cluster();
        let run = |nodes: &[NodeView<u32>], n: usize| {
            show(place_slice_group("v6e-16", Some("4x4"), n, &b, nodes))
        };
        assert_eq!(run(&nodes, 1), "placed [10, 11, 12, 13]");
        assert_eq!(run(&nodes, 2), "placed [10, 11, 12, 13, 20, 21, 22, 23]");
        assert!(
            run(&nodes, 3)
                .starts_with("infeasible: need 3 intact v6e-16 slice(s) with {TPU: 4} per host")
        );
        // One busy host in sa: sb only, never a mix, never the single-host nodes.
        let sa2 = nodes.iter().position(|n| n.id == 12).unwrap();
        nodes[sa2].available = res(r#"{"CPU": 8, "TPU": 2}"#);
        assert_eq!(run(&nodes, 1), "placed [20, 21, 22, 23]");
        assert!(
            run(&nodes, 2).starts_with("pending: need 2 intact v6e-16 slice(s)"),
            "{}",
            run(&nodes, 2)
        );
        // A dead host breaks its slice.
        let sb1 = nodes.iter().position(|n| n.id == 21).unwrap();
        nodes[sb1].alive = false;
        let got = run(&nodes, 1);
        assert!(
            got.starts_with("pending: need 1 intact")
                && got.contains("sb is not intact (3 of 4 worker ids)"),
            "{got}"
        );
        // Wrong topology for the type.
        assert!(
            show(place_slice_group("v6e-16", Some("2x4"), 1, &b, &nodes))
                .contains("has 8 chips but v6e-16 has 16")
        );
    }

    #[test]
    fn slice_name_selector_bundles_never_land_on_single_host_nodes_of_same_generation() {
        let nodes = tpu_cluster();
        for sel_key in ["tpuray.io/tpu-slice-name", "ray.io/tpu-slice-name"] {
            let bundles = vec![bundle(r#"{"TPU": 4}"#, &[(sel_key, "sa")]); 4];
            for s in [PgStrategy::Pack, PgStrategy::Spread, PgStrategy::StrictSpread] {
                let PgDecision::Placed(ids) = place_group(&bundles, s, &nodes, 0) else {
                    panic!("{s:?}")
                };
                let mut ids = ids;
                ids.sort();
                assert_eq!(ids, [10, 11, 12, 13], "{sel_key} {s:?}");
            }
            // A fifth bundle cannot spill onto a single-host v6e-4 node.
            let five = vec![bundle(r#"{"TPU": 4}"#, &[(sel_key, "sa")]); 5];
            let got = both(&five, PgStrategy::StrictSpread, &nodes);
            assert!(
                got.starts_with("infeasible: STRICT_SPREAD needs 5 distinct nodes but only 4"),
                "{got}"
            );
        }
        let b = Bundle { demand: res(r#"{"TPU": 4}"#), label_selector: slice_name_selector("sb") };
        assert_eq!(
            show(place_slice_group("v6e-16", None, 1, &b, &nodes)),
            "placed [20, 21, 22, 23]"
        );
        let none =
            Bundle { demand: res(r#"{"TPU": 4}"#), label_selector: slice_name_selector("single0") };
        assert!(
            show(place_slice_group("v6e-16", None, 1, &none, &nodes)).starts_with("infeasible")
        );
    }

    #[test]
    fn strict_spread_with_more_bundles_than_nodes_is_infeasible_at_scale_sched_16() {
        let nodes: Vec<_> = (0..1_000).map(|i| node(i, r#"{"CPU": 64}"#, "")).collect();
        let bundles = vec![bundle(r#"{"CPU": 1}"#, &[]); 1_001];
        let got = both(&bundles, PgStrategy::StrictSpread, &nodes);
        assert_eq!(
            got,
            "infeasible: STRICT_SPREAD needs 1001 distinct nodes but only 1000 alive node(s) can hold a bundle"
        );
    }
}
