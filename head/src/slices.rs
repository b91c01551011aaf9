//! TPU slices as hosts and chips, from what the head knows: the nodes' TPU labels
//! (TPU.md: `tpu-slice-name`, `tpu-worker-id`, `tpu-pod-type`, `tpu-topology`), their `TPU`
//! totals and availability, the placement groups holding bundles on them (gangs are groups
//! named `gang:<name>:<generation>`), and, when the node agents answer `ListWorkers`, the
//! chip indices each worker process holds. A pure model: proto messages in, plain structs
//! out, no I/O. `tpuray status` prints it as text (`cli/src/show.rs`) and the dashboard
//! draws it as HTML (`dashboard.rs`), so both show the same slices the same way.
//!
//! SLICE-1: a host's chips add up: every chip index `0..chips` is in exactly one state, and
//! the chips counted busy, reserved or used never exceed what the head's view says is taken
//! (plus what worker processes hold), so a drawing never invents a chip or loses one.
//!
//! Hosts are in worker-id order. A chip's state, in this order of precedence: held by a
//! worker process (the agents' `ListWorkers`: `tpu_chips` and the bundle resources naming
//! its group) at its index; then reserved by a bundle with no process yet; then counted
//! used by the head; then free, in index order.

use std::collections::{BTreeMap, HashMap};

use tpuray_proto::pb;
use tpuray_scheduler::bundles;

/// A TPU label of TPU.md (`tpu-slice-name`, `tpu-worker-id`, ...) read under `tpuray.io/`,
/// then under `ray.io/`; `None` when absent or empty.
pub fn tpu_label<'a>(n: &'a pb::NodeInfo, key: &str) -> Option<&'a str> {
    [tpuray_scheduler::labels::TPURAY_PREFIX, tpuray_scheduler::labels::RAY_PREFIX]
        .iter()
        .find_map(|p| n.labels.get(&format!("{p}{key}")).filter(|v| !v.is_empty()))
        .map(String::as_str)
}

/// The first 8 characters of an id, as `NodeId::short` shows it.
pub fn short_id(id: &str) -> &str {
    id.char_indices().nth(8).map_or(id, |(i, _)| &id[..i])
}

/// Chips of the plain `TPU` resource the node advertises (bundle-renamed `TPU_group_*`
/// resources are shares of these, not more).
pub fn tpu_chips(n: &pb::NodeInfo) -> f64 {
    n.total.get("TPU").copied().unwrap_or(0.0).max(0.0)
}

/// The accelerator type a node shows: its slice type label (`v6e-16`), else its
/// generation label (`TPU-V6E`); empty for a node with neither (not a TPU host).
pub fn node_accelerator_type(n: &pb::NodeInfo) -> &str {
    tpu_label(n, "tpu-pod-type").or_else(|| tpu_label(n, "accelerator-type")).unwrap_or("")
}

/// How a placement group is named on screen. Gangs are placement groups named
/// `gang:<name>:<generation>` and show as `gang <name> (gen <generation>)`
/// (`gang:<name>` without a numeric generation shows as `gang <name>`); other groups show
/// their name, or their short id when unnamed.
pub fn group_display(pg: &pb::PlacementGroupInfo) -> String {
    if let Some(rest) = pg.name.strip_prefix("gang:") {
        return match rest.rsplit_once(':') {
            Some((name, generation)) if generation.parse::<u64>().is_ok() => {
                format!("gang {name} (gen {generation})")
            }
            _ => format!("gang {rest}"),
        };
    }
    if pg.name.is_empty() { short_id(&pg.placement_group_id).to_string() } else { pg.name.clone() }
}

/// A placement group state as a lowercase word (`pending`, `created`, `removed`,
/// `rescheduling`); `unknown` for a value this build does not know.
pub fn group_state_word(state: i32) -> String {
    pb::PlacementGroupState::try_from(state)
        .map(|s| s.as_str_name().trim_start_matches("PLACEMENT_GROUP_STATE_").to_ascii_lowercase())
        .unwrap_or_else(|_| "unknown".into())
}

/// `n one` or `n many`.
pub fn plural(n: usize, one: &str, many: &str) -> String {
    format!("{n} {}", if n == 1 { one } else { many })
}

/// A placement group holding a bundle on a host.
#[derive(Clone, Debug, PartialEq)]
pub struct Holder {
    pub placement_group_id: String,
    /// As [`group_display`] names it.
    pub display: String,
    /// TPU chips the group's bundles reserve on this host (0: a bundle without chips).
    pub chips: u32,
    /// `None` when the group is created; else its state word (`pending`, `rescheduling`).
    pub state: Option<String>,
}

/// One alive TPU host of a slice.
#[derive(Clone, Debug)]
pub struct Host<'a> {
    pub node: &'a pb::NodeInfo,
    /// Its `tpu-worker-id` label, as given.
    pub worker_id: Option<&'a str>,
    /// Another alive host of the same slice claims the same worker id (HEAD-10 refuses
    /// that at registration; shown if it ever happens).
    pub duplicate_worker_id: bool,
    /// Chips of the host (the plain `TPU` resource).
    pub chips: u32,
    /// Chips the head's view counts as taken: by work, or reserved by a bundle.
    pub used: u32,
    /// Live (not removed) groups holding a bundle here, in the groups' order.
    pub holders: Vec<Holder>,
}

/// One drawn slice: the alive hosts that share a `tpu-slice-name` label, or a single TPU
/// host without one.
#[derive(Clone, Debug)]
pub struct Slice<'a> {
    /// The slice name; `None` for a lone TPU host without one.
    pub name: Option<&'a str>,
    /// The heading `tpuray status` prints: name, accelerator type, topology, hosts present
    /// of the hosts the type has.
    pub heading: String,
    /// `v6e-16` (or the generation label, or `TPU` when neither is set).
    pub accelerator_type: String,
    /// `4x4`, or `-` when the label is absent.
    pub topology: String,
    /// Hosts the accelerator type has, when it parses.
    pub expected_hosts: Option<u32>,
    /// In worker-id order.
    pub hosts: Vec<Host<'a>>,
}

/// Every slice of the cluster: named slices in name order, then lone TPU hosts by
/// hostname. Alive nodes only; CPU-only nodes are not drawn. Empty when the cluster has no
/// TPU host.
pub fn slices<'a>(nodes: &'a [pb::NodeInfo], groups: &[pb::PlacementGroupInfo]) -> Vec<Slice<'a>> {
    let alive = nodes.iter().filter(|n| n.state == pb::NodeState::Alive as i32);
    let mut named: BTreeMap<&str, Vec<&pb::NodeInfo>> = BTreeMap::new();
    let mut single: Vec<&pb::NodeInfo> = Vec::new();
    for n in alive {
        match tpu_label(n, "tpu-slice-name") {
            Some(slice) => named.entry(slice).or_default().push(n),
            None if tpu_chips(n) > 0.0 => single.push(n),
            None => {}
        }
    }
    let live: Vec<&pb::PlacementGroupInfo> =
        groups.iter().filter(|g| g.state != pb::PlacementGroupState::Removed as i32).collect();
    let mut out = Vec::new();
    for (slice, mut hosts) in named {
        let worker = |n: &pb::NodeInfo| {
            tpu_label(n, "tpu-worker-id").and_then(|w| w.parse::<u32>().ok()).unwrap_or(u32::MAX)
        };
        hosts.sort_by(|a, b| (worker(a), &a.node_id).cmp(&(worker(b), &b.node_id)));
        let first = hosts[0];
        let accel = node_accelerator_type(first);
        let expected = tpuray_scheduler::tpu::AcceleratorType::parse(accel).ok().map(|t| t.hosts());
        let count = match expected {
            Some(e) if e as usize != hosts.len() => format!("{} of {e} hosts", hosts.len()),
            _ => plural(hosts.len(), "host", "hosts"),
        };
        let accel = if accel.is_empty() { "TPU" } else { accel };
        let topology = tpu_label(first, "tpu-topology").unwrap_or("-");
        let ids: Vec<Option<&str>> = hosts.iter().map(|n| tpu_label(n, "tpu-worker-id")).collect();
        let dup = |w: Option<&str>| w.is_some() && ids.iter().filter(|x| **x == w).count() > 1;
        out.push(Slice {
            name: Some(slice),
            heading: format!("slice {slice}: {accel}, topology {topology}, {count}"),
            accelerator_type: accel.to_string(),
            topology: topology.to_string(),
            expected_hosts: expected,
            hosts: hosts.iter().zip(&ids).map(|(n, w)| host(n, *w, dup(*w), &live)).collect(),
        });
    }
    single.sort_by(|a, b| (&a.hostname, &a.node_id).cmp(&(&b.hostname, &b.node_id)));
    for n in single {
        let name = if n.hostname.is_empty() { short_id(&n.node_id) } else { &n.hostname };
        let accel = node_accelerator_type(n);
        let accel = if accel.is_empty() { "TPU" } else { accel };
        let topology = tpu_label(n, "tpu-topology").unwrap_or("-");
        out.push(Slice {
            name: None,
            heading: format!("host {name} (no slice name): {accel}, topology {topology}, 1 host"),
            accelerator_type: accel.to_string(),
            topology: topology.to_string(),
            expected_hosts: Some(1),
            hosts: vec![host(n, tpu_label(n, "tpu-worker-id"), false, &live)],
        });
    }
    out
}

fn host<'a>(
    n: &'a pb::NodeInfo,
    worker_id: Option<&'a str>,
    duplicate_worker_id: bool,
    live: &[&pb::PlacementGroupInfo],
) -> Host<'a> {
    let total = tpu_chips(n);
    let avail = n.available.get("TPU").copied().unwrap_or(0.0).clamp(0.0, total);
    let chips = total.ceil() as u32;
    let used = ((total - avail).ceil() as u32).min(chips);
    let holders = live
        .iter()
        .filter(|g| g.bundle_node_ids.contains(&n.node_id))
        .map(|g| {
            let reserved = n
                .total
                .get(&bundles::wildcard_name("TPU", &g.placement_group_id))
                .copied()
                .unwrap_or(0.0);
            Holder {
                placement_group_id: g.placement_group_id.clone(),
                display: group_display(g),
                chips: reserved.max(0.0).ceil() as u32,
                state: (g.state != pb::PlacementGroupState::Created as i32)
                    .then(|| group_state_word(g.state)),
            }
        })
        .collect();
    Host { node: n, worker_id, duplicate_worker_id, chips, used, holders }
}

/// What one chip is doing.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ChipState {
    /// A worker process holds it and runs a task or hosts an actor (or is starting for one).
    Busy,
    /// An idle worker process still holds it (AGENT-7: a worker never changes chips); the
    /// agent stops that worker when a request needs the block.
    Idle,
    /// A placement group's bundle reserves it and no process holds it yet; the agent picks
    /// the index when a process starts inside the bundle.
    Reserved,
    /// The head counts it as taken, but no worker the agent listed holds it (a worker
    /// starting, or the agent's list was not available).
    Used,
    Free,
}

impl ChipState {
    /// A lowercase word for the state (also the CSS class of a chip).
    pub fn word(self) -> &'static str {
        match self {
            ChipState::Busy => "busy",
            ChipState::Idle => "idle",
            ChipState::Reserved => "reserved",
            ChipState::Used => "used",
            ChipState::Free => "free",
        }
    }
}

/// The worker process holding a chip.
#[derive(Clone, Debug, PartialEq)]
pub struct ChipWorker {
    pub worker_id: String,
    pub pid: u32,
    /// The agent's word: `LEASED`, `ACTOR`, `IDLE` or `STARTING`.
    pub state: String,
    /// The actor the worker hosts ("" for none).
    pub actor_id: String,
}

/// One chip of a host.
#[derive(Clone, Debug, PartialEq)]
pub struct Chip {
    pub index: u32,
    pub state: ChipState,
    /// The placement group the chip is in (its bundle reserves it, or the worker holding
    /// it runs inside that group).
    pub placement_group_id: Option<String>,
    pub worker: Option<ChipWorker>,
}

/// The group whose bundle resources `w` holds (`TPU_group_0_<pg>`, ...), if any.
fn worker_group(w: &pb::WorkerInfo) -> Option<String> {
    let mut names: Vec<&String> = w.resources.keys().collect();
    names.sort();
    names.into_iter().find_map(|k| bundles::parse_bundle_resource(k).map(|(_, _, pg)| pg.into()))
}

/// Every chip of `host` (SLICE-1). With `workers` (the host agent's `ListWorkers`), chips
/// that a worker process holds sit at their real index; the chips a group reserves without
/// a process, then the chips the head counts as used, then the free ones fill the other
/// indices in order (their index is not decided until a process takes them). Without
/// `workers`, only the counts are known and the indices are nominal.
pub fn host_chips(host: &Host<'_>, workers: Option<&[pb::WorkerInfo]>) -> Vec<Chip> {
    let n = host.chips as usize;
    let mut cells: Vec<Option<Chip>> = vec![None; n];
    let mut held_in_group: HashMap<String, u32> = HashMap::new();
    let mut busy_outside_groups = 0u32;
    for w in workers.unwrap_or_default() {
        let Some(key) = &w.key else { continue };
        let group = worker_group(w);
        let mut chips: Vec<u32> = key.tpu_chips.clone();
        chips.sort_unstable();
        chips.dedup();
        for i in chips {
            let Some(cell) = cells.get_mut(i as usize) else { continue };
            if cell.is_some() {
                continue;
            }
            let state = if w.state == "IDLE" { ChipState::Idle } else { ChipState::Busy };
            match &group {
                Some(g) => *held_in_group.entry(g.clone()).or_default() += 1,
                None if state == ChipState::Busy => busy_outside_groups += 1,
                None => {}
            }
            *cell = Some(Chip {
                index: i,
                state,
                placement_group_id: group.clone(),
                worker: Some(ChipWorker {
                    worker_id: w.worker_id.clone(),
                    pid: w.pid,
                    state: w.state.clone(),
                    actor_id: w.actor_id.clone(),
                }),
            });
        }
    }
    // What is left to place, in index order: reservations without a process, then chips
    // the head counts as used by work outside groups, then free chips.
    let mut fill: Vec<(ChipState, Option<String>)> = Vec::new();
    let mut reserved_total = 0u32;
    for h in &host.holders {
        reserved_total += h.chips;
        let held = held_in_group.get(&h.placement_group_id).copied().unwrap_or(0);
        for _ in held.min(h.chips)..h.chips {
            fill.push((ChipState::Reserved, Some(h.placement_group_id.clone())));
        }
    }
    let plain_used = host.used.saturating_sub(reserved_total).saturating_sub(busy_outside_groups);
    fill.extend((0..plain_used).map(|_| (ChipState::Used, None)));
    let mut fill = fill.into_iter();
    for (i, cell) in cells.iter_mut().enumerate() {
        if cell.is_none() {
            let (state, group) = fill.next().unwrap_or((ChipState::Free, None));
            *cell = Some(Chip { index: i as u32, state, placement_group_id: group, worker: None });
        }
    }
    cells.into_iter().flatten().collect()
}

/// Where worker `w` of a slice sits on its host grid (TPU.md: a 2-D topology `X x Y` has
/// hosts `(X/2, Y/2)`, a 3-D one `(X/2, Y/2, Z)`; host coordinates run x fastest, z
/// slowest, as TorchTPU orders them): `(column, row)` with the z layers stacked as rows.
/// `None` when the topology does not parse or the grid does not have `w`.
pub fn host_grid_position(topology: &str, worker: u32) -> Option<(u32, u32)> {
    let t = tpuray_scheduler::tpu::Topology::parse(topology).ok()?;
    let gx = (t.0[0] / 2).max(1);
    let gy = (t.0[1] / 2).max(1);
    let gz = t.0.get(2).copied().unwrap_or(1).max(1);
    (worker < gx * gy * gz).then_some((worker % gx, worker / gx))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn tpu_node(id: &str, chips: f64, avail: f64) -> pb::NodeInfo {
        pb::NodeInfo {
            node_id: id.into(),
            state: pb::NodeState::Alive as i32,
            total: HashMap::from([("TPU".to_string(), chips)]),
            available: HashMap::from([("TPU".to_string(), avail)]),
            ..Default::default()
        }
    }

    fn worker(id: &str, state: &str, chips: &[u32], resources: &[&str]) -> pb::WorkerInfo {
        pb::WorkerInfo {
            worker_id: id.into(),
            pid: 7,
            state: state.into(),
            key: Some(pb::WorkerPoolKey { tpu_chips: chips.to_vec(), ..Default::default() }),
            resources: resources.iter().map(|r| (r.to_string(), 1.0)).collect(),
            ..Default::default()
        }
    }

    fn states(chips: &[Chip]) -> Vec<&'static str> {
        chips.iter().map(|c| c.state.word()).collect()
    }

    /// A group `pg` with one bundle of `chips` chips committed on `n`, as the agent does.
    fn hold(n: &mut pb::NodeInfo, pg: &str, chips: f64) -> pb::PlacementGroupInfo {
        *n.available.get_mut("TPU").unwrap() -= chips;
        n.total.insert(bundles::wildcard_name("TPU", pg), chips);
        pb::PlacementGroupInfo {
            placement_group_id: pg.into(),
            name: "gang:train:3".into(),
            state: pb::PlacementGroupState::Created as i32,
            bundle_node_ids: vec![n.node_id.clone()],
            ..Default::default()
        }
    }

    #[test]
    fn slice_1_chips_held_by_workers_sit_at_their_index_and_the_rest_fill_in_order() {
        let mut n = tpu_node("n1", 8.0, 8.0);
        let g = hold(&mut n, "pgA", 4.0);
        // The gang's member holds chips 0..3 (its bundle), a plain task chip 6, and an idle
        // worker still holds chip 4 (idle chips count as available to the head).
        *n.available.get_mut("TPU").unwrap() -= 1.0;
        let nodes = [n];
        let s = slices(&nodes, std::slice::from_ref(&g));
        let h = &s[0].hosts[0];
        assert_eq!((h.chips, h.used), (8, 5));
        let ws = [
            worker("w1", "ACTOR", &[0, 1, 2, 3], &["TPU_group_0_pgA", "TPU_group_pgA"]),
            worker("w2", "LEASED", &[6], &["TPU"]),
            worker("w3", "IDLE", &[4], &[]),
        ];
        let chips = host_chips(h, Some(&ws));
        assert_eq!(
            states(&chips),
            ["busy", "busy", "busy", "busy", "idle", "free", "busy", "free"],
            "{chips:?}"
        );
        assert_eq!(chips[0].placement_group_id.as_deref(), Some("pgA"));
        assert_eq!(chips[6].placement_group_id, None);
        assert_eq!(chips[6].worker.as_ref().unwrap().worker_id, "w2");
        assert!(chips.iter().enumerate().all(|(i, c)| c.index == i as u32));
    }

    #[test]
    fn slice_1_a_reservation_without_a_process_and_unknown_workers_are_counted() {
        let mut n = tpu_node("n1", 4.0, 4.0);
        let g = hold(&mut n, "pgA", 2.0);
        *n.available.get_mut("TPU").unwrap() -= 1.0;
        let nodes = [n];
        let s = slices(&nodes, std::slice::from_ref(&g));
        let h = &s[0].hosts[0];
        // Without the agent's list: 2 reserved, 1 used by work, 1 free.
        let chips = host_chips(h, None);
        assert_eq!(states(&chips), ["reserved", "reserved", "used", "free"]);
        assert_eq!(chips[1].placement_group_id.as_deref(), Some("pgA"));
        // One group member started on chip 3: it takes one of the two reserved chips.
        let ws = [worker("w1", "LEASED", &[3], &["TPU_group_pgA"])];
        let chips = host_chips(h, Some(&ws));
        assert_eq!(states(&chips), ["reserved", "used", "free", "busy"]);
    }

    #[test]
    fn slice_1_chip_indices_outside_the_host_or_held_twice_are_ignored() {
        let nodes = [tpu_node("n1", 4.0, 3.0)];
        let s = slices(&nodes, &[]);
        let ws = [worker("w1", "LEASED", &[1, 9], &[]), worker("w2", "LEASED", &[1], &[])];
        let chips = host_chips(&s[0].hosts[0], Some(&ws));
        assert_eq!(states(&chips), ["free", "busy", "free", "free"]);
        assert_eq!(chips[1].worker.as_ref().unwrap().worker_id, "w1");
    }

    #[test]
    fn gangs_show_their_name_and_generation_and_unnamed_groups_their_short_id() {
        let g = |name: &str| pb::PlacementGroupInfo {
            placement_group_id: format!("{:0<32}", "0f0f0f0f"),
            name: name.into(),
            ..Default::default()
        };
        assert_eq!(group_display(&g("gang:train:2")), "gang train (gen 2)");
        assert_eq!(group_display(&g("gang:a:b:7")), "gang a:b (gen 7)");
        assert_eq!(group_display(&g("gang:train")), "gang train");
        assert_eq!(group_display(&g("eval")), "eval");
        assert_eq!(group_display(&g("")), "0f0f0f0f");
    }

    #[test]
    fn hosts_sit_on_the_slice_host_grid_x_fastest() {
        // v6e-16, 4x4: 2x2 hosts.
        assert_eq!(host_grid_position("4x4", 0), Some((0, 0)));
        assert_eq!(host_grid_position("4x4", 1), Some((1, 0)));
        assert_eq!(host_grid_position("4x4", 2), Some((0, 1)));
        assert_eq!(host_grid_position("4x4", 3), Some((1, 1)));
        assert_eq!(host_grid_position("4x4", 4), None);
        // v4-32, 2x2x4: 1x1x4 hosts, stacked.
        assert_eq!(host_grid_position("2x2x4", 3), Some((0, 3)));
        assert_eq!(host_grid_position("bogus", 0), None);
    }
}
