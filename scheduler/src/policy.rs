//! Placement policy: picks a node for one request from a snapshot of the cluster.

use std::fmt::Debug;
use std::hash::Hash;

use crate::labels::{LabelConstraint, Labels, format_label_selector, selector_matches};
use crate::resources::{Amount, ResourceSet};

/// Utilisation (0..=1, after placement) up to which the default policy packs, and above
/// which it spreads.
pub const SPREAD_THRESHOLD: f64 = 0.5;
/// Most candidates the default policy picks among at random (seeded).
pub const MAX_TOP_K: usize = 5;
/// Resource names that mark an accelerator host (SCHED-6).
pub const ACCELERATOR_RESOURCES: [&str; 2] = ["GPU", "TPU"];

/// One node as the scheduler sees it. Amounts in whole-resource fixed point.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct NodeView<K> {
    pub id: K,
    /// Everything the node has.
    pub total: ResourceSet,
    /// What is free now (<= `total`).
    pub available: ResourceSet,
    pub labels: Labels,
    /// Dead nodes are never chosen (SCHED-3).
    pub alive: bool,
}

/// How to choose among nodes that fit.
#[derive(Clone, Debug, PartialEq, Eq, Default)]
pub enum Strategy<K> {
    /// Hybrid: prefer the local node, pack up to [`SPREAD_THRESHOLD`], then spread.
    #[default]
    Default,
    /// The least utilised node; consecutive seeds rotate among ties.
    Spread,
    /// Only `node` when `soft` is false (SCHED-9). When soft, `node` whenever it is alive
    /// and could ever hold the demand (waiting there while it is busy), else `Default`:
    /// Ray's `NodeAffinitySchedulingStrategy(soft=True)` without `_spill_on_unavailable`
    /// (ray `src/ray/raylet/scheduling/policy/node_affinity_scheduling_policy.cc`).
    NodeAffinity { node: K, soft: bool },
}

/// What one task, actor or bundle asks for.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Request<K> {
    pub demand: ResourceSet,
    pub strategy: Strategy<K>,
    /// Every constraint must match the node's labels.
    pub label_selector: Vec<LabelConstraint>,
}

/// The scheduler's answer.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Decision<K> {
    /// Run on this node; its `available` covers the demand (SCHED-4).
    Place(K),
    /// Feasible somewhere but no node has it free now (SCHED-4).
    Queue { reason: String },
    /// No alive node could ever run it; `reason` names the missing resource (SCHED-5).
    Infeasible { reason: String },
}

/// Chooses a node for `req` among `nodes`. `local` is the node making the decision
/// (preferred when it fits, for the default policy, up to the spread threshold). `seed`
/// drives the random pick among the best few (same inputs + seed → same answer, SCHED-7).
/// Cost: O(nodes × resources in the demand).
pub fn schedule<K: Clone + Eq + Hash + Ord + Debug>(
    req: &Request<K>,
    nodes: &[NodeView<K>],
    local: Option<&K>,
    seed: u64,
) -> Decision<K> {
    // SCHED-3: dead nodes never count.
    let alive: Vec<&NodeView<K>> = nodes.iter().filter(|n| n.alive).collect();
    if let Strategy::NodeAffinity { node, soft } = &req.strategy {
        let target = alive.iter().copied().find(|n| &n.id == node);
        if !soft || target.is_some_and(|t| is_feasible(req, t)) {
            return hard_affinity(req, node, target);
        }
    }
    let feasible: Vec<&NodeView<K>> =
        alive.iter().copied().filter(|n| is_feasible(req, n)).collect();
    if feasible.is_empty() {
        return Decision::Infeasible { reason: infeasible_reason(req, &alive) };
    }
    // SCHED-4: only nodes with the demand free now.
    let mut avail: Vec<&NodeView<K>> =
        feasible.iter().copied().filter(|n| n.available.is_superset_of(&req.demand)).collect();
    if avail.is_empty() {
        let n = feasible.len();
        let reason =
            format!("no node has {} available now ({n} feasible node(s) busy)", req.demand);
        return Decision::Queue { reason };
    }
    // SCHED-6: CPU-only work never fills accelerator hosts while other nodes can take it.
    if !uses_accelerator(&req.demand) && avail.iter().any(|n| !is_accelerator_node(n)) {
        avail.retain(|n| !is_accelerator_node(n));
    }
    let scored: Vec<(f64, &NodeView<K>)> =
        avail.into_iter().map(|n| (utilisation(&req.demand, n), n)).collect();
    match req.strategy {
        Strategy::Spread => spread(scored, seed),
        _ => hybrid(scored, local, seed),
    }
}

/// Total ⊇ demand and labels match the selector (SCHED-3).
pub(crate) fn is_feasible<K>(req: &Request<K>, n: &NodeView<K>) -> bool {
    n.total.is_superset_of(&req.demand) && selector_matches(&req.label_selector, &n.labels)
}

/// True when the demand asks for any GPU or TPU.
pub(crate) fn uses_accelerator(demand: &ResourceSet) -> bool {
    ACCELERATOR_RESOURCES.iter().any(|r| demand.get(r) > Amount::ZERO)
}

/// True when the node has any GPU or TPU.
pub(crate) fn is_accelerator_node<K>(n: &NodeView<K>) -> bool {
    uses_accelerator(&n.total)
}

/// Utilisation after placement, 0..=1: the max over the demanded resources of
/// (total - available + demand) / total; the CPU utilisation for an empty demand.
pub(crate) fn utilisation<K>(demand: &ResourceSet, n: &NodeView<K>) -> f64 {
    let ratio = |name: &str, extra: Amount| {
        let total = n.total.get(name).0;
        if total <= 0 {
            return if extra.0 > 0 { 1.0 } else { 0.0 };
        }
        let used = (total - n.available.get(name).0).max(0) + extra.0;
        used as f64 / total as f64
    };
    if demand.is_empty() {
        return ratio("CPU", Amount::ZERO);
    }
    demand.iter().map(|(name, d)| ratio(name, d)).fold(0.0, f64::max)
}

/// Hybrid pack-then-spread (Ray's default): local node if at or under the threshold; else
/// the fullest nodes at or under the threshold; else the emptiest. Seeded pick among top-k.
fn hybrid<K: Clone + Ord>(
    mut scored: Vec<(f64, &NodeView<K>)>,
    local: Option<&K>,
    seed: u64,
) -> Decision<K> {
    if let Some(l) = local
        && scored.iter().any(|(s, n)| &n.id == l && *s <= SPREAD_THRESHOLD)
    {
        return Decision::Place(l.clone());
    }
    let packing = scored.iter().any(|(s, _)| *s <= SPREAD_THRESHOLD);
    if packing {
        scored.retain(|(s, _)| *s <= SPREAD_THRESHOLD);
    }
    let order = |a: &(f64, &NodeView<K>), b: &(f64, &NodeView<K>)| {
        let by_score = if packing { b.0.total_cmp(&a.0) } else { a.0.total_cmp(&b.0) };
        by_score.then_with(|| a.1.id.cmp(&b.1.id))
    };
    let k = scored.len().div_ceil(5).clamp(1, MAX_TOP_K).min(scored.len());
    if scored.len() > k {
        scored.select_nth_unstable_by(k - 1, order);
        scored.truncate(k);
    }
    scored.sort_by(order);
    let pick = (splitmix64(seed) % k as u64) as usize;
    Decision::Place(scored[pick].1.id.clone())
}

/// The least utilised node; ties sorted by id and chosen by `seed % ties`.
fn spread<K: Clone + Ord>(scored: Vec<(f64, &NodeView<K>)>, seed: u64) -> Decision<K> {
    let min = scored.iter().map(|(s, _)| *s).fold(f64::INFINITY, f64::min);
    let mut ties: Vec<&K> = scored.iter().filter(|(s, _)| *s == min).map(|(_, n)| &n.id).collect();
    ties.sort();
    Decision::Place(ties[(seed % ties.len() as u64) as usize].clone())
}

/// Hard affinity: only `node` (SCHED-9).
pub(crate) fn hard_affinity<K: Clone + Debug>(
    req: &Request<K>,
    node: &K,
    target: Option<&NodeView<K>>,
) -> Decision<K> {
    let Some(t) = target else {
        return Decision::Infeasible {
            reason: format!("node affinity target {node:?} is not alive"),
        };
    };
    if !selector_matches(&req.label_selector, &t.labels) {
        let sel = format_label_selector(&req.label_selector);
        return Decision::Infeasible {
            reason: format!("node affinity target {node:?} does not match label selector {sel}"),
        };
    }
    if let Some((name, want, total)) = req.demand.first_missing(&t.total) {
        return Decision::Infeasible {
            reason: format!(
                "node affinity target {node:?} lacks resource {name:?} (requested {want}, node total {total})"
            ),
        };
    }
    if t.available.is_superset_of(&req.demand) {
        return Decision::Place(t.id.clone());
    }
    Decision::Queue {
        reason: format!("node affinity target {node:?} does not have {} available now", req.demand),
    }
}

/// First demanded resource (name order) that no node in `nodes` has enough of in total,
/// with the sum of it over `nodes`.
fn missing_resource<'a, K>(
    demand: &'a ResourceSet,
    nodes: &[&NodeView<K>],
) -> Option<(&'a str, Amount, Amount)> {
    let (name, want) = demand.iter().find(|(r, a)| !nodes.iter().any(|n| n.total.get(r) >= *a))?;
    let sum = nodes.iter().fold(0i64, |acc, n| acc.saturating_add(n.total.get(name).0));
    Some((name, want, Amount(sum)))
}

/// Why no alive node is feasible (SCHED-5): a missing resource with the cluster total, else
/// the label selector, else the resource missing among label-matching nodes.
pub(crate) fn infeasible_reason<K>(req: &Request<K>, alive: &[&NodeView<K>]) -> String {
    if let Some((name, want, total)) = missing_resource(&req.demand, alive) {
        return format!("no node has resource {name:?} (requested {want}, cluster total {total})");
    }
    let sel = format_label_selector(&req.label_selector);
    let matching: Vec<&NodeView<K>> = alive
        .iter()
        .copied()
        .filter(|n| selector_matches(&req.label_selector, &n.labels))
        .collect();
    if alive.is_empty() {
        return "no node is alive".to_string();
    }
    if matching.is_empty() {
        return format!("no node matches label selector {sel}");
    }
    if let Some((name, want, total)) = missing_resource(&req.demand, &matching) {
        return format!(
            "no node matching label selector {sel} has resource {name:?} (requested {want}, total {total} on those nodes)"
        );
    }
    format!(
        "no single node has all of {} (each resource exists, but on different nodes)",
        req.demand
    )
}

/// SplitMix64: spreads consecutive seeds over the top-k (SCHED-7: no randomness of our own).
pub(crate) fn splitmix64(seed: u64) -> u64 {
    let mut z = seed.wrapping_add(0x9E37_79B9_7F4A_7C15);
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::labels::parse_label_selector;

    /// `"CPU=4,GPU=0.5"` → resources.
    fn res(s: &str) -> ResourceSet {
        let m = Labels::parse(s).unwrap().0;
        let m: Vec<(String, f64)> = m.into_iter().map(|(k, v)| (k, v.parse().unwrap())).collect();
        ResourceSet::from_f64_map(m.iter().map(|(k, v)| (k, v))).unwrap()
    }

    /// A live node; `avail` "=" means all of `total` is free.
    fn node(id: u32, total: &str, avail: &str, labels: &str) -> NodeView<u32> {
        let available = res(if avail == "=" { total } else { avail });
        let labels = Labels::parse(labels).unwrap();
        NodeView { id, total: res(total), available, labels, alive: true }
    }

    fn dead(mut n: NodeView<u32>) -> NodeView<u32> {
        n.alive = false;
        n
    }

    fn req(demand: &str, strategy: Strategy<u32>, sel: &[(&str, &str)]) -> Request<u32> {
        let map = sel.iter().map(|(k, v)| (k.to_string(), v.to_string())).collect();
        Request {
            demand: res(demand),
            strategy,
            label_selector: parse_label_selector(&map).unwrap(),
        }
    }

    /// Renders the decision as `place N`, `queue: <reason>` or `infeasible: <reason>`.
    fn run(r: &Request<u32>, nodes: &[NodeView<u32>], local: Option<u32>, seed: u64) -> String {
        match schedule(r, nodes, local.as_ref(), seed) {
            Decision::Place(n) => format!("place {n}"),
            Decision::Queue { reason } => format!("queue: {reason}"),
            Decision::Infeasible { reason } => format!("infeasible: {reason}"),
        }
    }

    /// A label selector as written in a test table.
    type Sel = &'static [(&'static str, &'static str)];
    /// (total CPU, available CPU) per node.
    type Shapes = &'static [(u32, u32)];
    const D: Strategy<u32> = Strategy::Default;
    const HARD: fn(u32) -> Strategy<u32> = |node| Strategy::NodeAffinity { node, soft: false };
    const SOFT: fn(u32) -> Strategy<u32> = |node| Strategy::NodeAffinity { node, soft: true };

    /// SCHED-5: the infeasible reason names the missing resource and the cluster total.
    #[test]
    fn request_for_missing_gpu_is_infeasible_naming_cluster_total_sched_5() {
        let nodes = [node(1, "CPU=4", "=", ""), node(2, "CPU=8", "=", "")];
        let want = r#"no node has resource "GPU" (requested 1, cluster total 0)"#;
        let d = schedule(&req("CPU=1,GPU=1", D, &[]), &nodes, None, 0);
        assert_eq!(d, Decision::Infeasible { reason: want.into() });
    }

    /// SCHED-5: infeasible reasons name the missing resource and the (cluster) total.
    #[test]
    fn infeasible_queue_and_place_cases_ignore_dead_nodes_sched_3_4_5() {
        let nodes = [
            node(1, "CPU=4", "CPU=0.5", "zone=a"),
            node(2, "CPU=2,GPU=1", "=", "zone=b"),
            dead(node(9, "CPU=64,GPU=8", "=", "zone=a")),
        ];
        let cases: &[(&str, Sel, &str)] = &[
            (
                "CPU=8",
                &[],
                r#"infeasible: no node has resource "CPU" (requested 8, cluster total 6)"#,
            ),
            (
                "GPU=2",
                &[],
                r#"infeasible: no node has resource "GPU" (requested 2, cluster total 1)"#,
            ),
            (
                "CPU=1",
                &[("zone", "c")],
                r#"infeasible: no node matches label selector {"zone": "c"}"#,
            ),
            (
                "GPU=1",
                &[("zone", "a")],
                r#"infeasible: no node matching label selector {"zone": "a"} has resource "GPU" (requested 1, total 0 on those nodes)"#,
            ),
            (
                "CPU=3,GPU=1",
                &[],
                "infeasible: no single node has all of {CPU: 3, GPU: 1} (each resource exists, but on different nodes)",
            ),
            (
                "CPU=1",
                &[("zone", "a")],
                "queue: no node has {CPU: 1} available now (1 feasible node(s) busy)",
            ),
            ("CPU=0.5", &[("zone", "a")], "place 1"),
            ("CPU=0.5,GPU=0.5", &[], "place 2"),
        ];
        for (demand, sel, want) in cases {
            assert_eq!(run(&req(demand, D, sel), &nodes, Some(9), 0), *want, "{demand}");
        }
        assert_eq!(run(&req("", D, &[]), &nodes[2..], None, 0), "infeasible: no node is alive");
    }

    /// SCHED-6: CPU-only work avoids GPU/TPU hosts while another node can take it.
    #[test]
    fn cpu_task_avoids_tpu_host_when_cpu_node_free_sched_6() {
        let tpu = node(1, "CPU=200,TPU=4", "=", "");
        let gpu = node(2, "CPU=200,GPU=8", "=", "");
        let nodes = [tpu.clone(), gpu.clone(), node(3, "CPU=4", "CPU=1", "")];
        for seed in 0..20 {
            for strategy in [D, Strategy::Spread, SOFT(7)] {
                assert_eq!(run(&req("CPU=1", strategy, &[]), &nodes, Some(1), seed), "place 3");
            }
        }
        // Accelerator hosts still take CPU work when nothing else can, and their own work.
        let nodes = [tpu, gpu, node(3, "CPU=4", "", "")];
        assert_eq!(run(&req("CPU=1", D, &[]), &nodes, Some(1), 0), "place 1");
        assert_eq!(run(&req("TPU=4", D, &[]), &nodes, Some(3), 0), "place 1");
        assert_eq!(run(&req("CPU=1,GPU=1", D, &[]), &nodes, Some(1), 0), "place 2");
    }

    #[test]
    fn default_policy_prefers_local_then_packs_then_spreads() {
        // (case, (total CPU, available CPU) per node, local, demanded CPU, expected placement)
        let cases: &[(&str, Shapes, Option<u32>, &str, &str)] = &[
            ("local node under threshold wins", &[(8, 8), (8, 8)], Some(1), "1", "place 1"),
            ("local node at threshold wins", &[(8, 8), (8, 5)], Some(1), "1", "place 1"),
            ("local node above threshold loses", &[(8, 8), (8, 3)], Some(1), "1", "place 0"),
            ("packs onto fullest node under threshold", &[(8, 8), (8, 6)], None, "1", "place 1"),
            ("spreads to emptiest when all above", &[(8, 2), (8, 3)], None, "1", "place 1"),
            ("empty demand is scored by cpu", &[(8, 1), (8, 2)], Some(0), "0", "place 1"),
        ];
        for (case, shapes, local, demand, want) in cases {
            let nodes: Vec<_> = (0..)
                .zip(shapes.iter())
                .map(|(i, (t, a))| node(i, &format!("CPU={t}"), &format!("CPU={a}"), ""))
                .collect();
            assert_eq!(
                run(&req(&format!("CPU={demand}"), D, &[]), &nodes, *local, 7),
                *want,
                "{case}"
            );
        }
    }

    #[test]
    fn spread_rotates_across_equal_nodes_with_consecutive_seeds() {
        let r = req("CPU=1", Strategy::Spread, &[]);
        let nodes: Vec<_> = (0..4).map(|i| node(i, "CPU=4", "=", "")).collect();
        let picks: Vec<_> = (0..8).map(|s| run(&r, &nodes, Some(0), s)).collect();
        assert_eq!(picks, (0..8).map(|s| format!("place {}", s % 4)).collect::<Vec<_>>());
        let nodes = [node(0, "CPU=4", "CPU=2", ""), node(1, "CPU=4", "=", "")];
        assert!((0..5).all(|seed| run(&r, &nodes, Some(0), seed) == "place 1"));
    }

    #[test]
    fn node_affinity_hard_never_places_elsewhere_and_soft_falls_back_only_from_dead_or_infeasible_targets_sched_9()
     {
        let nodes = [
            node(1, "CPU=4", "=", ""),
            node(2, "CPU=4", "", "zone=a"),
            dead(node(3, "CPU=4", "=", "")),
        ];
        let cases: &[(Strategy<u32>, &str, Sel, &str)] = &[
            (HARD(1), "CPU=1", &[], "place 1"),
            (
                HARD(2),
                "CPU=1",
                &[],
                "queue: node affinity target 2 does not have {CPU: 1} available now",
            ),
            (HARD(3), "CPU=1", &[], "infeasible: node affinity target 3 is not alive"),
            (HARD(4), "CPU=1", &[], "infeasible: node affinity target 4 is not alive"),
            (
                HARD(1),
                "CPU=5",
                &[],
                r#"infeasible: node affinity target 1 lacks resource "CPU" (requested 5, node total 4)"#,
            ),
            (
                HARD(1),
                "",
                &[("zone", "a")],
                r#"infeasible: node affinity target 1 does not match label selector {"zone": "a"}"#,
            ),
            // Alive and feasible but busy: a soft target is waited for, as in Ray.
            (
                SOFT(2),
                "CPU=1",
                &[],
                "queue: node affinity target 2 does not have {CPU: 1} available now",
            ),
            (SOFT(2), "CPU=1", &[("zone", "!a")], "place 1"),
            (SOFT(3), "CPU=1", &[], "place 1"),
            (
                SOFT(1),
                "CPU=1",
                &[("zone", "a")],
                "queue: no node has {CPU: 1} available now (1 feasible node(s) busy)",
            ),
        ];
        for (strategy, demand, sel, want) in cases {
            assert_eq!(
                run(&req(demand, strategy.clone(), sel), &nodes, Some(1), 0),
                *want,
                "{strategy:?}"
            );
        }
    }

    /// SCHED-8: a `ray.io/` selector matches a node's `tpuray.io/` label.
    #[test]
    fn label_selector_restricts_placement_with_prefix_aliases_sched_8() {
        let nodes =
            [node(1, "CPU=8", "=", ""), node(2, "CPU=8,TPU=4", "=", "tpuray.io/tpu-slice-name=s1")];
        let on_slice = req("CPU=1", D, &[("ray.io/tpu-slice-name", "s1")]);
        assert_eq!(run(&on_slice, &nodes, Some(1), 0), "place 2");
        let off_slice = req("CPU=1", D, &[("ray.io/tpu-slice-name", "!s1")]);
        assert_eq!(run(&off_slice, &nodes, Some(2), 0), "place 1");
    }

    #[test]
    fn same_inputs_and_seed_give_same_decision_and_seeds_vary_top_k_sched_7() {
        let nodes: Vec<_> = (0..50).map(|i| node(i, "CPU=8", "CPU=2", "")).collect();
        let r = req("CPU=1", D, &[]);
        let picks: std::collections::BTreeSet<_> = (0..100)
            .map(|seed| {
                let d = run(&r, &nodes, None, seed);
                assert_eq!(d, run(&r, &nodes, None, seed));
                d
            })
            .collect();
        // All tie above the threshold: the top k = 5 by id.
        assert_eq!(picks, (0..5).map(|i| format!("place {i}")).collect());
    }

    #[test]
    fn ten_thousand_nodes_schedule_in_process() {
        let mut nodes: Vec<_> = (0..10_000u32)
            .map(|i| {
                let gpu = u8::from(i % 3 == 0);
                let total = format!("CPU=16,memory=64e9,GPU={gpu}");
                let avail = format!("CPU={},memory=32e9,GPU={gpu}", i % 17);
                node(i, &total, &avail, &format!("zone=z{}", i % 10))
            })
            .collect();
        nodes[41].alive = false;
        let r = req("CPU=4,memory=1e9", D, &[("zone", "in(z1,z3)")]);
        for seed in 0..100 {
            let Decision::Place(n) = schedule(&r, &nodes, Some(&7), seed) else { panic!() };
            let n = &nodes[n as usize];
            assert!(n.alive && n.available.is_superset_of(&r.demand));
            assert!(
                n.total.get("GPU") == Amount::ZERO
                    && matches!(n.labels.get("zone"), Some("z1" | "z3"))
            );
        }
        let gpu = req("GPU=1", Strategy::Spread, &[]);
        assert!(matches!(schedule(&gpu, &nodes, None, 3), Decision::Place(n) if n % 3 == 0));
    }
}
