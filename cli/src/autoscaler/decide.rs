//! The autoscaler's decisions as one pure function, [`decide`]: the cluster as the head
//! sees it, the provider's instances, what waits and `request_resources`, in; launches,
//! terminations and a report (with the reason for each) out. No clocks (`now_ms` is an
//! input), no I/O, no randomness: instance ids come from a counter in [`Memory`], which
//! the caller carries from one call to the next.
//!
//! An *instance* is the unit a node type scales by: one host for a CPU type, every host
//! of one slice for a TPU type (its counts are in slices). Invariants, each with a unit
//! test named after it:
//! - AUTOSCALE-1: a slice type is launched in whole slices: one launch brings every host
//!   of the slice, with one slice name.
//! - AUTOSCALE-2: an instance is idle only when every one of its hosts is up and has all
//!   its resources free; an idle instance is removed as a unit after `idle_timeout`, never
//!   below `min_workers`, never while waiting work or `request_resources` needs it.
//! - AUTOSCALE-3: an instance that was whole and lost a host (its node died, or the
//!   provider lost the process or pod) is removed whole, and a slice is replaced whole.
//! - AUTOSCALE-4: demand no node type could ever hold (and no live node holds) is
//!   reported infeasible and never scaled for.
//! - AUTOSCALE-5: a node type never has more than `max_workers` instances.
//! - AUTOSCALE-6: CPU-only demand never launches a TPU slice while a node type without
//!   TPUs could hold it (TPU.md's known failure: CPU work filling TPU hosts).
//! - AUTOSCALE-7: each node type keeps at least `min_workers` instances.
//!
//! Details: an instance that did not come up within 10 minutes is removed whole too
//! (AUTOSCALE-3), and a slice that was whole is replaced by a new slice at once. The
//! `max_workers` count of AUTOSCALE-5 includes instances still starting; what does not
//! fit is reported waiting. Under AUTOSCALE-6 a CPU-only `request_resources` is never
//! fitted onto slice hosts either. A demand's `placement_group_id` (`ResourceDemand`)
//! keeps a group's demand from being counted twice.

use std::collections::{BTreeMap, BTreeSet};

use serde::{Deserialize, Serialize};
use tpuray_scheduler::resources::ResourceSet;

use super::config::{AutoscalingConfig, INSTANCE_LABEL, NodeType};

/// How long an instance may take to bring every host up before it is given up.
pub const LAUNCH_TIMEOUT_MS: u64 = 10 * 60_000;

/// A live node as the head sees it (dead nodes are left out).
#[derive(Clone, Debug, Default)]
pub struct NodeView {
    pub node_id: String,
    pub total: ResourceSet,
    pub available: ResourceSet,
    pub labels: BTreeMap<String, String>,
}

impl NodeView {
    fn instance(&self) -> Option<&str> {
        self.labels.get(INSTANCE_LABEL).map(String::as_str)
    }
    fn worker_id(&self) -> u32 {
        self.labels.get("tpuray.io/tpu-worker-id").and_then(|w| w.parse().ok()).unwrap_or(0)
    }
}

/// An instance the provider runs (launched by an earlier decision).
#[derive(Clone, Debug)]
pub struct InstanceView {
    pub id: String,
    pub node_type: String,
    pub launched_ms: u64,
    /// Set when the provider lost one of its hosts (a process exited, a pod failed).
    pub lost: Option<String>,
}

/// How the bundles of one demand must be placed.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Placement {
    /// Each bundle anywhere (tasks, actors, PACK and SPREAD groups).
    Any,
    /// All bundles on one host (STRICT_PACK).
    StrictPack,
    /// Each bundle on a different host (STRICT_SPREAD).
    StrictSpread,
}

/// Something that waits.
#[derive(Clone, Debug)]
pub enum Demand {
    /// Resource bundles: tasks and actors (one bundle per waiting one), placement groups
    /// (their unplaced bundles).
    Bundles { what: String, bundles: Vec<ResourceSet>, placement: Placement },
    /// A slice placement group: `num_slices` whole slices of `accelerator_type` (and
    /// `topology` when given), each host holding `host_bundle`.
    Slices {
        what: String,
        accelerator_type: String,
        topology: Option<String>,
        num_slices: u32,
        host_bundle: ResourceSet,
    },
}

/// What the autoscaler remembers between calls.
#[derive(Clone, Debug, Default, Serialize, Deserialize, PartialEq)]
pub struct Memory {
    /// The next instance number.
    pub next_seq: u64,
    /// Instances seen with every host up (so a missing host means a lost one).
    pub complete: BTreeSet<String>,
    /// Since when each instance has been idle.
    pub idle_since: BTreeMap<String, u64>,
    /// Why each instance was launched.
    pub launch_reason: BTreeMap<String, String>,
    /// Launches and removals so far, by node type.
    pub launched: BTreeMap<String, u64>,
    pub removed: BTreeMap<String, u64>,
}

/// Everything [`decide`] reads.
pub struct Input<'a> {
    pub config: &'a AutoscalingConfig,
    pub nodes: &'a [NodeView],
    pub instances: &'a [InstanceView],
    pub demands: &'a [Demand],
    /// `request_resources` bundles (Ray's semantics: the cluster's total resources should
    /// hold them all at once, whatever runs now).
    pub requested: &'a [ResourceSet],
    pub now_ms: u64,
    /// Prefix of new instance ids (unique per cluster).
    pub id_prefix: &'a str,
}

/// One instance to start.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Launch {
    pub instance: String,
    pub node_type: String,
    pub reason: String,
}

/// One instance to stop (all its hosts).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Terminate {
    pub instance: String,
    pub node_type: String,
    pub reason: String,
}

/// What `tpuray status` shows.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct Report {
    /// Instances not yet whole: (instance, node type, hosts up, hosts, why launched).
    pub pending_launches: Vec<(String, String, u32, u32, String)>,
    /// Idle instances: (instance, node type, idle since (ms since the epoch), why kept or
    /// when removed).
    pub idle: Vec<(String, String, u64, String)>,
    /// Demand no node type can hold, with why.
    pub infeasible: Vec<String>,
    /// Demand that waits for a reason other than a launch in progress (max_workers).
    pub waiting: Vec<String>,
    pub launched: BTreeMap<String, u64>,
    pub removed: BTreeMap<String, u64>,
}

/// The decision of one round.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Decision {
    pub launch: Vec<Launch>,
    pub terminate: Vec<Terminate>,
    pub report: Report,
}

/// One host in the simulation: a live node, or a host of an instance not up yet.
#[derive(Clone, Debug)]
struct SimHost {
    instance: Option<String>,
    free: ResourceSet,
    total: ResourceSet,
    /// (slice name, accelerator type, topology, worker id) of a TPU slice host.
    slice: Option<(String, String, String, u32)>,
}

impl SimHost {
    fn has_accelerator(&self) -> bool {
        self.total.iter().any(|(k, _)| k == "TPU" || k == "GPU")
    }
}

/// True when `b` asks for nothing but CPU, memory and custom resources: no TPU, no GPU.
fn cpu_only(b: &ResourceSet) -> bool {
    b.iter().all(|(k, _)| {
        k != "TPU" && k != "GPU" && !k.starts_with("accelerator_type:") && !k.starts_with("TPU-")
    })
}

struct Sim<'a> {
    config: &'a AutoscalingConfig,
    hosts: Vec<SimHost>,
    /// Instances by type: the provider's, minus terminations, plus launches.
    count: BTreeMap<String, u32>,
    launch: Vec<Launch>,
    memory: &'a mut Memory,
    id_prefix: &'a str,
    /// Instances the simulation put work (or requested bundles) on.
    used: BTreeSet<String>,
}

impl Sim<'_> {
    fn add_instance_hosts(&mut self, t: &NodeType, id: &str, up: &BTreeSet<u32>) {
        for w in 0..t.hosts() {
            if up.contains(&w) {
                continue;
            }
            let total = t.host_resources(id, w);
            let slice = t.slice.as_ref().map(|s| {
                (id.to_string(), s.accelerator_type.to_string(), s.topology.to_string(), w)
            });
            self.hosts.push(SimHost {
                instance: Some(id.to_string()),
                free: total.clone(),
                total,
                slice,
            });
        }
    }

    /// Launches one instance of `t` (AUTOSCALE-1: all its hosts at once), unless the type
    /// is at `max_workers` (AUTOSCALE-5); returns whether it did.
    fn try_launch(&mut self, t: &NodeType, reason: String) -> bool {
        let n = self.count.entry(t.name.clone()).or_default();
        if *n >= t.max_workers {
            return false;
        }
        *n += 1;
        self.memory.next_seq += 1;
        let id = format!("{}{}-{}", self.id_prefix, t.name, self.memory.next_seq);
        self.add_instance_hosts(t, &id, &BTreeSet::new());
        self.memory.launch_reason.insert(id.clone(), reason.clone());
        *self.memory.launched.entry(t.name.clone()).or_default() += 1;
        self.launch.push(Launch { instance: id, node_type: t.name.clone(), reason });
        true
    }

    /// First fit of `b` on the hosts not in `skip`, taking from `left` (each host's free
    /// resources, or its totals for `request_resources`). CPU-only work tries hosts
    /// without accelerators first (SCHED-6); with `plain_only` it never takes an
    /// accelerator host (AUTOSCALE-6: a CPU-only request must not keep a slice).
    fn place(
        &mut self,
        b: &ResourceSet,
        left: &mut [ResourceSet],
        skip: &BTreeSet<usize>,
        plain_only: bool,
    ) -> Option<usize> {
        let cpu = cpu_only(b);
        let mut order: Vec<usize> = (0..self.hosts.len())
            .filter(|i| !skip.contains(i))
            .filter(|&i| !(plain_only && cpu && self.hosts[i].has_accelerator()))
            .collect();
        if cpu {
            order.sort_by_key(|&i| self.hosts[i].has_accelerator());
        }
        let i = order.into_iter().find(|&i| left[i].is_superset_of(b))?;
        left[i].saturating_sub(b);
        if let Some(inst) = &self.hosts[i].instance {
            self.used.insert(inst.clone());
        }
        Some(i)
    }

    /// Node types whose hosts could hold `b`, best first: for CPU-only work the types
    /// without TPUs, and TPU types only when none of those could (AUTOSCALE-6).
    fn types_for(&self, b: &ResourceSet) -> Vec<&NodeType> {
        let fits =
            |t: &&NodeType| (0..t.hosts()).any(|w| t.host_resources("x", w).is_superset_of(b));
        let mut plain: Vec<&NodeType> =
            self.config.node_types.values().filter(|t| t.slice.is_none()).filter(fits).collect();
        if plain.is_empty() || !cpu_only(b) {
            plain
                .extend(self.config.node_types.values().filter(|t| t.slice.is_some()).filter(fits));
        }
        plain
    }

    /// Whether a live node could ever hold `b` (then it is not infeasible, only waiting).
    fn live_could_hold(&self, b: &ResourceSet) -> bool {
        self.hosts.iter().any(|h| h.total.is_superset_of(b))
    }
}

/// `{CPU: 1} x 3` for a report line.
fn shapes(bundles: &[ResourceSet]) -> String {
    let mut groups: Vec<(&ResourceSet, usize)> = Vec::new();
    for b in bundles {
        match groups.iter_mut().find(|(s, _)| *s == b) {
            Some((_, n)) => *n += 1,
            None => groups.push((b, 1)),
        }
    }
    let parts: Vec<String> = groups
        .iter()
        .map(|(s, n)| if *n == 1 { s.to_string() } else { format!("{s} x {n}") })
        .collect();
    parts.join(", ")
}

/// The decision for one round. See the module doc for the invariants it keeps.
pub fn decide(input: &Input<'_>, memory: &mut Memory) -> Decision {
    let cfg = input.config;
    let mut terminate = Vec::new();
    let mut report = Report::default();
    // Hosts up, by instance.
    let mut up: BTreeMap<&str, Vec<&NodeView>> = BTreeMap::new();
    for n in input.nodes {
        if let Some(i) = n.instance() {
            up.entry(i).or_default().push(n);
        }
    }
    let mut broken: BTreeSet<String> = BTreeSet::new();
    let mut replace: Vec<(NodeType, String)> = Vec::new();
    let mut count: BTreeMap<String, u32> = BTreeMap::new();
    let mut live_instances: Vec<&InstanceView> = Vec::new();
    // Ids stay unique over a restart that found instances already running.
    for inst in input.instances {
        if let Some(n) = inst.id.rsplit('-').next().and_then(|n| n.parse::<u64>().ok()) {
            memory.next_seq = memory.next_seq.max(n);
        }
    }
    for inst in input.instances {
        let Some(t) = cfg.node_types.get(&inst.node_type) else {
            terminate.push(Terminate {
                instance: inst.id.clone(),
                node_type: inst.node_type.clone(),
                reason: format!("node type {:?} is not in the configuration", inst.node_type),
            });
            continue;
        };
        let hosts = up.get(inst.id.as_str()).map_or(&[][..], Vec::as_slice);
        let whole = hosts.len() as u32 >= t.hosts();
        let was_whole = memory.complete.contains(&inst.id);
        let why = if let Some(lost) = &inst.lost {
            Some(lost.clone())
        } else if was_whole && !whole {
            let have: BTreeSet<u32> = hosts.iter().map(|n| n.worker_id()).collect();
            let missing: Vec<String> =
                (0..t.hosts()).filter(|w| !have.contains(w)).map(|w| w.to_string()).collect();
            Some(format!("lost host(s) {} (node died)", missing.join(", ")))
        } else if !whole && input.now_ms.saturating_sub(inst.launched_ms) > LAUNCH_TIMEOUT_MS {
            Some(format!(
                "only {} of {} host(s) came up within {} s",
                hosts.len(),
                t.hosts(),
                LAUNCH_TIMEOUT_MS / 1000
            ))
        } else {
            None
        };
        if let Some(why) = why {
            // AUTOSCALE-3: removed whole; a slice that was whole is replaced whole.
            broken.insert(inst.id.clone());
            terminate.push(Terminate {
                instance: inst.id.clone(),
                node_type: t.name.clone(),
                reason: why.clone(),
            });
            if t.slice.is_some() && was_whole {
                replace.push((t.clone(), format!("replaces slice {} ({why})", inst.id)));
            }
            continue;
        }
        if whole {
            memory.complete.insert(inst.id.clone());
        }
        *count.entry(t.name.clone()).or_default() += 1;
        live_instances.push(inst);
    }
    let mut sim = Sim {
        config: cfg,
        hosts: Vec::new(),
        count,
        launch: Vec::new(),
        memory,
        id_prefix: input.id_prefix,
        used: BTreeSet::new(),
    };
    for n in input.nodes.iter().filter(|n| n.instance().is_none_or(|i| !broken.contains(i))) {
        let slice = match (
            n.labels.get("tpuray.io/tpu-slice-name"),
            n.labels.get("tpuray.io/tpu-pod-type"),
            n.labels.get("tpuray.io/tpu-topology"),
        ) {
            (Some(s), Some(ty), Some(topo)) => {
                Some((s.clone(), ty.clone(), topo.clone(), n.worker_id()))
            }
            _ => None,
        };
        sim.hosts.push(SimHost {
            instance: n.instance().map(str::to_string),
            free: n.available.clone(),
            total: n.total.clone(),
            slice,
        });
    }
    for inst in &live_instances {
        let t = &cfg.node_types[&inst.node_type];
        let have: BTreeSet<u32> = up
            .get(inst.id.as_str())
            .map(|v| v.iter().map(|n| n.worker_id()).collect())
            .unwrap_or_default();
        sim.add_instance_hosts(t, &inst.id, &have);
    }
    for (t, reason) in replace {
        if !sim.try_launch(&t, reason.clone()) {
            report.waiting.push(format!(
                "{reason}: not replaced, {} is at max_workers {}",
                t.name, t.max_workers
            ));
        }
    }

    // What waits.
    for d in input.demands {
        match d {
            Demand::Bundles { what, bundles, placement } => {
                place_bundles(&mut sim, what, bundles, *placement, &mut report)
            }
            Demand::Slices { what, accelerator_type, topology, num_slices, host_bundle } => {
                place_slices(
                    &mut sim,
                    what,
                    accelerator_type,
                    topology.as_deref(),
                    *num_slices,
                    host_bundle,
                    &mut report,
                )
            }
        }
    }

    // request_resources: the bundles against the hosts' totals.
    if !input.requested.is_empty() {
        let mut left: Vec<ResourceSet> = sim.hosts.iter().map(|h| h.total.clone()).collect();
        let mut unmet: Vec<ResourceSet> = Vec::new();
        for b in input.requested {
            if sim.place(b, &mut left, &BTreeSet::new(), true).is_some() {
                continue;
            }
            let types: Vec<NodeType> = sim.types_for(b).into_iter().cloned().collect();
            if types.is_empty() {
                report
                    .infeasible
                    .push(format!("request_resources bundle {b}: {}", no_type(cfg, b)));
                continue;
            }
            let launched =
                types.iter().any(|t| sim.try_launch(t, format!("request_resources: {b}")));
            if launched {
                let new = sim.hosts.len() - left.len();
                left.extend(sim.hosts[sim.hosts.len() - new..].iter().map(|h| h.total.clone()));
                if sim.place(b, &mut left, &BTreeSet::new(), true).is_some() {
                    continue;
                }
            }
            unmet.push(b.clone());
        }
        if !unmet.is_empty() {
            report.waiting.push(format!(
                "request_resources: {} not held: node types at max_workers ({})",
                shapes(&unmet),
                max_line(cfg)
            ));
        }
    }

    // AUTOSCALE-7: min_workers.
    for t in cfg.node_types.values() {
        while sim.count.get(&t.name).copied().unwrap_or(0) < t.min_workers {
            if !sim.try_launch(t, format!("min_workers {}", t.min_workers)) {
                break;
            }
        }
    }

    // AUTOSCALE-2: idle instances, removed whole after the timeout.
    let used = std::mem::take(&mut sim.used);
    let launch = std::mem::take(&mut sim.launch);
    let mut count = std::mem::take(&mut sim.count);
    let memory = sim.memory;
    for inst in &live_instances {
        let t = &cfg.node_types[&inst.node_type];
        let hosts = up.get(inst.id.as_str()).map_or(&[][..], Vec::as_slice);
        let idle = hosts.len() as u32 >= t.hosts() && hosts.iter().all(|n| n.available == n.total);
        if !idle {
            memory.idle_since.remove(&inst.id);
            continue;
        }
        let since = *memory.idle_since.entry(inst.id.clone()).or_insert(input.now_ms);
        let idle_ms = input.now_ms.saturating_sub(since);
        let n = count.get(&t.name).copied().unwrap_or(0);
        let note = if used.contains(&inst.id) {
            "kept: waiting work or request_resources needs it".to_string()
        } else if n <= t.min_workers {
            format!("kept: min_workers {}", t.min_workers)
        } else if idle_ms >= cfg.idle_timeout_ms {
            *count.entry(t.name.clone()).or_default() -= 1;
            terminate.push(Terminate {
                instance: inst.id.clone(),
                node_type: t.name.clone(),
                reason: format!("idle for {} s (idle_timeout_minutes)", idle_ms / 1000),
            });
            "removing".to_string()
        } else {
            format!("removed after {} s idle", cfg.idle_timeout_ms / 1000)
        };
        report.idle.push((inst.id.clone(), t.name.clone(), since, note));
    }
    for inst in &live_instances {
        let t = &cfg.node_types[&inst.node_type];
        let hosts = up.get(inst.id.as_str()).map_or(0, Vec::len) as u32;
        if !memory.complete.contains(&inst.id) {
            let reason = memory.launch_reason.get(&inst.id).cloned().unwrap_or_default();
            report.pending_launches.push((
                inst.id.clone(),
                t.name.clone(),
                hosts,
                t.hosts(),
                reason,
            ));
        }
    }
    for l in &launch {
        let t = &cfg.node_types[&l.node_type];
        report.pending_launches.push((
            l.instance.clone(),
            l.node_type.clone(),
            0,
            t.hosts(),
            l.reason.clone(),
        ));
    }
    for t in &terminate {
        *memory.removed.entry(t.node_type.clone()).or_default() += 1;
        memory.complete.remove(&t.instance);
        memory.idle_since.remove(&t.instance);
        memory.launch_reason.remove(&t.instance);
    }
    report.launched = memory.launched.clone();
    report.removed = memory.removed.clone();
    Decision { launch, terminate, report }
}

fn max_line(cfg: &AutoscalingConfig) -> String {
    let v: Vec<String> =
        cfg.node_types.values().map(|t| format!("{} {}", t.name, t.max_workers)).collect();
    v.join(", ")
}

fn no_type(cfg: &AutoscalingConfig, b: &ResourceSet) -> String {
    let names: Vec<&str> = cfg.node_types.keys().map(String::as_str).collect();
    format!("no node type has {b} on one host (types: {})", names.join(", "))
}

fn place_bundles(
    sim: &mut Sim<'_>,
    what: &str,
    bundles: &[ResourceSet],
    placement: Placement,
    report: &mut Report,
) {
    // A strict pack is one bundle: their sum on one host.
    let bundles: Vec<ResourceSet> = if placement == Placement::StrictPack {
        let mut sum = ResourceSet::new();
        for b in bundles {
            sum.add(b);
        }
        vec![sum]
    } else {
        bundles.to_vec()
    };
    let mut taken: BTreeSet<usize> = BTreeSet::new();
    let mut waiting: Vec<ResourceSet> = Vec::new();
    for b in &bundles {
        let skip =
            if placement == Placement::StrictSpread { taken.clone() } else { BTreeSet::new() };
        let mut free: Vec<ResourceSet> = sim.hosts.iter().map(|h| h.free.clone()).collect();
        if let Some(i) = sim.place(b, &mut free, &skip, false) {
            sim.hosts[i].free = free[i].clone();
            taken.insert(i);
            continue;
        }
        let types: Vec<NodeType> = sim.types_for(b).into_iter().cloned().collect();
        if types.is_empty() {
            if !sim.live_could_hold(b) {
                // AUTOSCALE-4: reported, never scaled for.
                report.infeasible.push(format!("{what}: {}", no_type(sim.config, b)));
            }
            continue;
        }
        let before = sim.hosts.len();
        if types.iter().any(|t| sim.try_launch(t, format!("{what}: {b}"))) {
            let mut free: Vec<ResourceSet> = sim.hosts.iter().map(|h| h.free.clone()).collect();
            let skip: BTreeSet<usize> = (0..before).collect();
            if let Some(i) = sim.place(b, &mut free, &skip, false) {
                sim.hosts[i].free = free[i].clone();
                taken.insert(i);
                continue;
            }
        }
        waiting.push(b.clone());
    }
    if !waiting.is_empty() {
        report.waiting.push(format!(
            "{what}: {} waits: node types at max_workers ({})",
            shapes(&waiting),
            max_line(sim.config)
        ));
    }
}

fn place_slices(
    sim: &mut Sim<'_>,
    what: &str,
    accelerator_type: &str,
    topology: Option<&str>,
    num_slices: u32,
    host_bundle: &ResourceSet,
    report: &mut Report,
) {
    let Ok(ty) = tpuray_scheduler::tpu::AcceleratorType::parse(accelerator_type) else {
        report.infeasible.push(format!("{what}: unknown accelerator type {accelerator_type:?}"));
        return;
    };
    let wanted = ty.to_string();
    let matches = |sty: &str, stopo: &str| sty == wanted && topology.is_none_or(|t| t == stopo);
    let mut found = 0u32;
    // Free whole slices in the simulation: every host present and holding the bundle, the
    // slice's head resource free on worker 0.
    let mut slices: BTreeMap<String, Vec<usize>> = BTreeMap::new();
    for (i, h) in sim.hosts.iter().enumerate() {
        if let Some((name, sty, stopo, _)) = &h.slice
            && matches(sty, stopo)
        {
            slices.entry(name.clone()).or_default().push(i);
        }
    }
    let head = ty.head_resource_name();
    for (_, idx) in slices {
        if found == num_slices {
            break;
        }
        let ok = idx.len() as u32 == ty.hosts()
            && idx.iter().all(|&i| {
                let h = &sim.hosts[i];
                let mut need = host_bundle.clone();
                if h.slice.as_ref().is_some_and(|s| s.3 == 0) {
                    need.set(&head, tpuray_scheduler::resources::Amount::whole(1));
                }
                h.free.is_superset_of(&need)
            });
        if ok {
            found += 1;
            for &i in &idx {
                let h = &mut sim.hosts[i];
                h.free.saturating_sub(host_bundle);
                if h.slice.as_ref().is_some_and(|s| s.3 == 0) {
                    let mut hr = ResourceSet::new();
                    hr.set(&head, tpuray_scheduler::resources::Amount::whole(1));
                    h.free.saturating_sub(&hr);
                }
                if let Some(inst) = &h.instance {
                    sim.used.insert(inst.clone());
                }
            }
        }
    }
    if found == num_slices {
        return;
    }
    let types: Vec<NodeType> = sim
        .config
        .node_types
        .values()
        .filter(|t| {
            t.slice.as_ref().is_some_and(|s| {
                matches(&s.accelerator_type.to_string(), &s.topology.to_string())
                    && (0..s.hosts()).all(|w| t.host_resources("x", w).is_superset_of(host_bundle))
            })
        })
        .cloned()
        .collect();
    let shape = match topology {
        Some(t) => format!("{wanted} slice(s) of topology {t}"),
        None => format!("{wanted} slice(s)"),
    };
    if types.is_empty() {
        let slice_types: Vec<String> = sim
            .config
            .node_types
            .values()
            .filter_map(|t| t.slice.as_ref().map(|s| format!("{} = {s}", t.name)))
            .collect();
        // AUTOSCALE-4.
        report.infeasible.push(format!(
            "{what}: no node type has {shape} with {host_bundle} per host (slice types: {})",
            if slice_types.is_empty() { "none".to_string() } else { slice_types.join(", ") }
        ));
        return;
    }
    let mut short = num_slices - found;
    while short > 0 {
        let reason = format!("{what}: {shape}");
        if !types.iter().any(|t| sim.try_launch(t, reason.clone())) {
            report.waiting.push(format!(
                "{what}: {short} more {shape} wait: node types at max_workers ({})",
                max_line(sim.config)
            ));
            return;
        }
        // The new slice's hosts are taken by this demand.
        let n = ty.hosts() as usize;
        let len = sim.hosts.len();
        for h in &mut sim.hosts[len - n..] {
            h.free.saturating_sub(host_bundle);
        }
        short -= 1;
    }
}

#[cfg(test)]
mod tests {
    use super::super::config::parse;
    use super::*;

    fn config() -> AutoscalingConfig {
        parse(
            r#"
provider: {type: local}
idle_timeout_minutes: 1
available_node_types:
  cpu: {resources: {CPU: 1}, min_workers: 0, max_workers: 4}
  v6e-16:
    resources: {CPU: 1}
    max_workers: 2
    tpu: {accelerator_type: v6e-16, topology: 4x4}
"#,
        )
        .unwrap()
    }

    fn res(j: &str) -> ResourceSet {
        ResourceSet::from_json(j).unwrap()
    }

    fn slice_demand(what: &str, ty: &str, topo: &str) -> Demand {
        Demand::Slices {
            what: what.into(),
            accelerator_type: ty.into(),
            topology: Some(topo.into()),
            num_slices: 1,
            host_bundle: res(r#"{"TPU": 4}"#),
        }
    }

    /// The nodes of every host of the launched instances, up, with `used` resources in use.
    fn up(cfg: &AutoscalingConfig, launches: &[Launch], busy: &[&str]) -> Vec<NodeView> {
        let mut v = Vec::new();
        for l in launches {
            let t = &cfg.node_types[&l.node_type];
            for w in 0..t.hosts() {
                let total = t.host_resources(&l.instance, w);
                let available = if busy.contains(&l.instance.as_str()) {
                    ResourceSet::new()
                } else {
                    total.clone()
                };
                v.push(NodeView {
                    node_id: format!("{}-{w}", l.instance),
                    total,
                    available,
                    labels: t.host_labels(&l.instance, w).0,
                });
            }
        }
        v
    }

    fn instances(launches: &[Launch], at: u64) -> Vec<InstanceView> {
        launches
            .iter()
            .map(|l| InstanceView {
                id: l.instance.clone(),
                node_type: l.node_type.clone(),
                launched_ms: at,
                lost: None,
            })
            .collect()
    }

    fn run(
        cfg: &AutoscalingConfig,
        nodes: &[NodeView],
        inst: &[InstanceView],
        demands: &[Demand],
        requested: &[ResourceSet],
        now_ms: u64,
        m: &mut Memory,
    ) -> Decision {
        decide(
            &Input {
                config: cfg,
                nodes,
                instances: inst,
                demands,
                requested,
                now_ms,
                id_prefix: "",
            },
            m,
        )
    }

    #[test]
    fn autoscale_1_a_slice_demand_launches_one_whole_slice_and_waits_for_it() {
        let cfg = config();
        let mut m = Memory::default();
        let d = [slice_demand("gang g", "v6e-16", "4x4")];
        let out = run(&cfg, &[], &[], &d, &[], 0, &mut m);
        assert_eq!(out.launch.len(), 1, "{out:?}");
        assert_eq!(out.launch[0].node_type, "v6e-16");
        assert_eq!(out.report.pending_launches[0].3, 4, "four hosts together");
        // Next round, two hosts are up: the launching slice is counted, nothing more starts.
        let inst = instances(&out.launch, 0);
        let mut nodes = up(&cfg, &out.launch, &[]);
        nodes.truncate(2);
        let again = run(&cfg, &nodes, &inst, &d, &[], 1000, &mut m);
        assert!(again.launch.is_empty() && again.terminate.is_empty(), "{again:?}");
        assert_eq!(again.report.pending_launches[0].2, 2, "two of four hosts up");
    }

    #[test]
    fn autoscale_2_a_slice_is_idle_only_when_every_host_is_and_goes_as_a_unit() {
        let cfg = config();
        let mut m = Memory::default();
        let first = run(&cfg, &[], &[], &[slice_demand("g", "v6e-16", "4x4")], &[], 0, &mut m);
        let inst = instances(&first.launch, 0);
        let mut nodes = up(&cfg, &first.launch, &[]);
        // One host still works: not idle, however long.
        nodes[3].available = ResourceSet::new();
        for t in [1_000, 200_000] {
            let out = run(&cfg, &nodes, &inst, &[], &[], t, &mut m);
            assert!(out.terminate.is_empty() && out.report.idle.is_empty(), "{out:?}");
        }
        nodes[3].available = nodes[3].total.clone();
        let out = run(&cfg, &nodes, &inst, &[], &[], 300_000, &mut m);
        assert!(out.terminate.is_empty(), "idle just now");
        let out = run(&cfg, &nodes, &inst, &[], &[], 360_000, &mut m);
        assert_eq!(out.terminate.len(), 1, "one removal for the whole slice: {out:?}");
        assert_eq!(out.terminate[0].instance, first.launch[0].instance);
        assert_eq!(m.removed["v6e-16"], 1);
    }

    #[test]
    fn autoscale_2_an_idle_instance_that_waiting_work_fits_is_kept() {
        let cfg = config();
        let mut m = Memory::default();
        let first = run(
            &cfg,
            &[],
            &[],
            &[Demand::Bundles {
                what: "task f".into(),
                bundles: vec![res(r#"{"CPU": 1}"#)],
                placement: Placement::Any,
            }],
            &[],
            0,
            &mut m,
        );
        let inst = instances(&first.launch, 0);
        let nodes = up(&cfg, &first.launch, &[]);
        run(&cfg, &nodes, &inst, &[], &[], 1_000, &mut m);
        let d = [Demand::Bundles {
            what: "task f".into(),
            bundles: vec![res(r#"{"CPU": 1}"#)],
            placement: Placement::Any,
        }];
        let out = run(&cfg, &nodes, &inst, &d, &[], 100_000, &mut m);
        assert!(out.terminate.is_empty() && out.launch.is_empty(), "{out:?}");
    }

    #[test]
    fn autoscale_3_a_slice_that_lost_a_host_is_removed_and_replaced_whole() {
        let cfg = config();
        let mut m = Memory::default();
        let first = run(&cfg, &[], &[], &[slice_demand("g", "v6e-16", "4x4")], &[], 0, &mut m);
        let inst = instances(&first.launch, 0);
        let mut nodes = up(&cfg, &first.launch, &[&first.launch[0].instance]);
        run(&cfg, &nodes, &inst, &[], &[], 1_000, &mut m);
        nodes.remove(2);
        let out = run(&cfg, &nodes, &inst, &[], &[], 2_000, &mut m);
        assert_eq!(out.terminate.len(), 1, "{out:?}");
        assert!(out.terminate[0].reason.contains("lost host(s) 2"), "{out:?}");
        assert_eq!(out.launch.len(), 1, "replaced whole: {out:?}");
        assert_eq!(out.launch[0].node_type, "v6e-16");
        assert_ne!(out.launch[0].instance, first.launch[0].instance, "a new slice name");
        // The provider losing a host process counts the same.
        let mut m2 = Memory::default();
        let f2 = run(&cfg, &[], &[], &[slice_demand("g", "v6e-16", "4x4")], &[], 0, &mut m2);
        let mut i2 = instances(&f2.launch, 0);
        let n2 = up(&cfg, &f2.launch, &[]);
        run(&cfg, &n2, &i2, &[], &[], 1_000, &mut m2);
        i2[0].lost = Some("host 1 exited".into());
        let out = run(&cfg, &n2, &i2, &[], &[], 2_000, &mut m2);
        assert_eq!((out.terminate.len(), out.launch.len()), (1, 1), "{out:?}");
    }

    #[test]
    fn autoscale_4_infeasible_demand_is_reported_and_never_scaled_for() {
        let cfg = config();
        let mut m = Memory::default();
        let d = [
            slice_demand("gang big", "v6e-64", "8x8"),
            Demand::Bundles {
                what: "task g".into(),
                bundles: vec![res(r#"{"GPU": 1}"#)],
                placement: Placement::Any,
            },
        ];
        let out = run(&cfg, &[], &[], &d, &[], 0, &mut m);
        assert!(out.launch.is_empty(), "{out:?}");
        assert_eq!(out.report.infeasible.len(), 2, "{out:?}");
        assert!(out.report.infeasible[0].contains("v6e-64"), "{:?}", out.report.infeasible);
        assert!(out.report.infeasible[1].contains("GPU"), "{:?}", out.report.infeasible);
    }

    #[test]
    fn autoscale_5_max_workers_is_never_exceeded_and_the_third_gang_waits() {
        let cfg = config();
        let mut m = Memory::default();
        let d: Vec<Demand> =
            (0..3).map(|i| slice_demand(&format!("gang {i}"), "v6e-16", "4x4")).collect();
        let out = run(&cfg, &[], &[], &d, &[], 0, &mut m);
        assert_eq!(out.launch.len(), 2, "{out:?}");
        assert!(out.report.waiting[0].contains("gang 2"), "{:?}", out.report.waiting);
        // With both slices up and busy, the third still waits and nothing starts.
        let inst = instances(&out.launch, 0);
        let busy: Vec<&str> = out.launch.iter().map(|l| l.instance.as_str()).collect();
        let nodes = up(&cfg, &out.launch, &busy);
        let again = run(&cfg, &nodes, &inst, &d[2..], &[], 1_000, &mut m);
        assert!(again.launch.is_empty(), "{again:?}");
        // CPU workers: six one-CPU bundles, four workers at most.
        let mut m = Memory::default();
        let req = vec![res(r#"{"CPU": 1}"#); 6];
        let out = run(&cfg, &[], &[], &[], &req, 0, &mut m);
        assert_eq!(out.launch.len(), 4, "{out:?}");
        assert!(out.launch.iter().all(|l| l.node_type == "cpu"));
        assert!(out.report.waiting[0].contains("{CPU: 1} x 2"), "{:?}", out.report.waiting);
    }

    #[test]
    fn autoscale_6_cpu_only_demand_never_launches_a_slice_while_a_cpu_type_could_hold_it() {
        let cfg = config();
        let mut m = Memory::default();
        let d: Vec<Demand> = (0..6)
            .map(|i| Demand::Bundles {
                what: format!("task {i}"),
                bundles: vec![res(r#"{"CPU": 1}"#)],
                placement: Placement::Any,
            })
            .collect();
        let out = run(&cfg, &[], &[], &d, &[], 0, &mut m);
        assert!(out.launch.iter().all(|l| l.node_type == "cpu"), "{out:?}");
        assert_eq!(out.launch.len(), 4);
        // A bundle no CPU type holds but a slice host does may launch a slice.
        let d = [Demand::Bundles {
            what: "task t".into(),
            bundles: vec![res(r#"{"CPU": 1, "TPU": 4}"#)],
            placement: Placement::Any,
        }];
        let out = run(&cfg, &[], &[], &d, &[], 0, &mut Memory::default());
        assert_eq!(out.launch.len(), 1);
        assert_eq!(out.launch[0].node_type, "v6e-16");
    }

    #[test]
    fn autoscale_7_min_workers_are_kept_and_not_removed_when_idle() {
        let mut cfg = config();
        cfg.node_types.get_mut("cpu").unwrap().min_workers = 2;
        let mut m = Memory::default();
        let out = run(&cfg, &[], &[], &[], &[], 0, &mut m);
        assert_eq!(out.launch.len(), 2);
        let inst = instances(&out.launch, 0);
        let nodes = up(&cfg, &out.launch, &[]);
        run(&cfg, &nodes, &inst, &[], &[], 1, &mut m);
        let later = run(&cfg, &nodes, &inst, &[], &[], 10_000_000, &mut m);
        assert!(later.terminate.is_empty() && later.launch.is_empty(), "{later:?}");
        assert!(later.report.idle.iter().all(|i| i.3.contains("min_workers")));
    }

    #[test]
    fn request_resources_counts_totals_and_keeps_what_it_needs() {
        let cfg = config();
        let mut m = Memory::default();
        let req = vec![res(r#"{"CPU": 1}"#); 2];
        let out = run(&cfg, &[], &[], &[], &req, 0, &mut m);
        assert_eq!(out.launch.len(), 2);
        // Up and busy: the request is met by the totals; nothing more starts.
        let inst = instances(&out.launch, 0);
        let busy: Vec<&str> = out.launch.iter().map(|l| l.instance.as_str()).collect();
        let nodes = up(&cfg, &out.launch, &busy);
        let again = run(&cfg, &nodes, &inst, &[], &req, 1_000, &mut m);
        assert!(again.launch.is_empty(), "{again:?}");
        // Idle past the timeout: kept while requested, removed once the request is gone.
        let idle = up(&cfg, &out.launch, &[]);
        run(&cfg, &idle, &inst, &[], &req, 2_000, &mut m);
        let kept = run(&cfg, &idle, &inst, &[], &req, 500_000, &mut m);
        assert!(kept.terminate.is_empty(), "{kept:?}");
        let gone = run(&cfg, &idle, &inst, &[], &[], 600_000, &mut m);
        assert_eq!(gone.terminate.len(), 2, "{gone:?}");
    }

    #[test]
    fn autoscale_6_a_cpu_request_is_not_held_by_slice_hosts_and_keeps_no_slice() {
        let cfg = config();
        let mut m = Memory::default();
        let first = run(&cfg, &[], &[], &[slice_demand("g", "v6e-16", "4x4")], &[], 0, &mut m);
        let inst = instances(&first.launch, 0);
        let nodes = up(&cfg, &first.launch, &[]);
        run(&cfg, &nodes, &inst, &[], &[], 1_000, &mut m);
        // Six one-CPU bundles: the slice's four hosts have a CPU each, but CPU workers come.
        let req = vec![res(r#"{"CPU": 1}"#); 6];
        let out = run(&cfg, &nodes, &inst, &[], &req, 2_000, &mut m);
        assert_eq!(out.launch.len(), 4, "{out:?}");
        assert!(out.launch.iter().all(|l| l.node_type == "cpu"));
        // And the idle slice still goes.
        let later = run(&cfg, &nodes, &inst, &[], &req, 200_000, &mut m);
        assert!(later.terminate.iter().any(|t| t.node_type == "v6e-16"), "{later:?}");
    }

    #[test]
    fn strict_spread_bundles_take_one_host_each() {
        let cfg = config();
        let d = [Demand::Bundles {
            what: "pg".into(),
            bundles: vec![res(r#"{"CPU": 0.5}"#); 3],
            placement: Placement::StrictSpread,
        }];
        let out = run(&cfg, &[], &[], &d, &[], 0, &mut Memory::default());
        assert_eq!(out.launch.len(), 3, "{out:?}");
        let d = [Demand::Bundles {
            what: "pg".into(),
            bundles: vec![res(r#"{"CPU": 0.5}"#); 2],
            placement: Placement::StrictPack,
        }];
        let out = run(&cfg, &[], &[], &d, &[], 0, &mut Memory::default());
        assert_eq!(out.launch.len(), 1, "{out:?}");
    }
}
