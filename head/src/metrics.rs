//! The head's Prometheus endpoint, `GET /metrics` on the dashboard port, and the
//! service-discovery file that lists every target (`prom_metrics_service_discovery.json`
//! in the session folder, Ray's name and shape).
//!
//! - METRICS-1: `/metrics` needs no token (Ray's metrics endpoints need none, and
//!   Prometheus and Kubernetes scrape without secrets); it only reads.
//! - METRICS-2: a series this head exported once stays in every later scrape, as 0 when
//!   its count went away ([`tpuray_proto::metrics::SeenSeries`]).
//! - METRICS-3: cluster series (`ray_tasks` from the task table, `ray_actors`,
//!   `ray_placement_groups`, nodes, TPU slices and chips, gangs) come from the serving
//!   leader only, so a sum over every head counts each once; every head exports its own
//!   Raft position (`tpuray_raft_*`) and its process (`ray_component_*`, `gcs`).
//!   `ray_tasks` here has `Source="owner"` and the states the owner knows (pending,
//!   finished, failed); running tasks are exported by the node agent whose worker runs
//!   them (`Source="executor"`), as Ray splits them, so no task counts twice.
//!
//! Scrapes run on a blocking thread; under the head's lock they read the task tally
//! ([`TaskTally`], kept as task events arrive: one entry per job and task name) and the
//! state machine's actors, groups and nodes, never the whole task table.
//!
//! METRICS-2 in detail: the memory is `SeenSeries`, at most 10,000 series per family
//! (ray#50735), and every scrape has the same series (ray#63131). METRICS-3 in detail:
//! the owner's states are PENDING_NODE_ASSIGNMENT (for SUBMITTED and RETRYING), FINISHED
//! and FAILED, tallied per job and name as task events arrive, so a scrape never walks
//! the 100,000-task table, and finished tasks the table forgets stay counted. Each head
//! exports its own Raft term, commit and applied index and apply lag.
//!
//! Service discovery: every head writes `<session>/prom_metrics_service_discovery.json`
//! (Ray's file and shape, `[{"labels": {"job": "ray"}, "targets": [...]}]`: live nodes'
//! metrics addresses from the durable node table, every head's dashboard address from
//! `GetHeadInfo`), atomically, when it changes (checked every 2 s). The autoscaler's
//! launches and removals by node type (`tpuray_autoscaler_{launches,removals}_total
//! {NodeType}`) come from its report in the KV.
//!
//! Deliberately absent: Ray's autoscaler metrics, GPU and TPU utilisation (libtpu's
//! runtime metrics), the memory monitor's OOM kills.

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use axum::extract::State;
use axum::http::{StatusCode, header};
use axum::response::{IntoResponse, Response};
use tpuray_proto::metrics::{Exposition, Labels, Sampler, SeenSeries, labels};
use tpuray_proto::pb;
use tpuray_scheduler::labels::TPURAY_PREFIX;

use crate::http::Api;
use crate::server::Head;
use crate::state::{ActorStatus, NodeStatus, PgStatus};

/// The file Ray's Prometheus configuration reads (`ray_constants.py`).
pub const DISCOVERY_FILE: &str = "prom_metrics_service_discovery.json";
/// How often the discovery file is checked against the cluster (Ray: every 5 s).
const DISCOVERY_EVERY: Duration = Duration::from_secs(2);

/// Ray's task states as the owner reports them, for tpuray's task-table states
/// (`RUNNING` is the executor's, exported by node agents).
const OWNER_TASK_STATES: [&str; 3] = ["PENDING_NODE_ASSIGNMENT", "FINISHED", "FAILED"];
const ACTOR_STATES: [&str; 4] = ["PENDING_CREATION", "ALIVE", "RESTARTING", "DEAD"];
const PG_STATES: [&str; 4] = ["PENDING", "CREATED", "REMOVED", "RESCHEDULING"];

/// Ray's owner-side state of a task-table state; `None` for states owners do not report.
fn owner_state(s: &str) -> Option<&'static str> {
    match s {
        "SUBMITTED" | "RETRYING" => Some("PENDING_NODE_ASSIGNMENT"),
        "FINISHED" => Some("FINISHED"),
        "FAILED" => Some("FAILED"),
        _ => None,
    }
}

/// (job id, name, is retry, Ray state) → tasks.
type TaskKey = (String, String, bool, &'static str);

/// `ray_tasks{Source="owner"}`, counted as task events change the task table
/// (server.rs, `report_task_events`), so a scrape costs the number of (job, name) pairs,
/// not the table's up to 100,000 tasks; finished and failed tasks the bounded table
/// forgets stay counted, so FINISHED keeps counting past the table's size.
#[derive(Debug, Default)]
pub(crate) struct TaskTally {
    /// job → name → tasks per slot ([`TaskTally::slot`]: owner state × retry), and
    /// whether a retry of the name was ever counted (its retry series exist from then).
    counts: HashMap<String, HashMap<String, ([u64; 6], bool)>>,
    pairs: usize,
}

/// At most this many (job, name) pairs are counted; tasks of further pairs are not.
const MAX_TALLY_PAIRS: usize = 10_000;

impl TaskTally {
    /// Where a task counts: `OWNER_TASK_STATES[i / 2]`, a retry when `i` is odd; `None`
    /// for states the owner does not report (running: its executor's agent does).
    pub(crate) fn slot(t: &pb::TaskSummary) -> Option<usize> {
        let state = owner_state(&t.state)?;
        let i = OWNER_TASK_STATES.iter().position(|s| *s == state)?;
        Some(2 * i + usize::from(t.attempt > 0))
    }

    /// A task of (`job`, `name`) moved from slot `from` to slot `to`.
    pub(crate) fn moved(&mut self, job: &str, name: &str, from: Option<usize>, to: Option<usize>) {
        let full = self.pairs >= MAX_TALLY_PAIRS;
        let names = match self.counts.get_mut(job) {
            Some(n) => n,
            None if full || to.is_none() => return,
            None => self.counts.entry(job.to_string()).or_default(),
        };
        let c = match names.get_mut(name) {
            Some(c) => c,
            None if full || to.is_none() => return,
            None => {
                self.pairs += 1;
                names.entry(name.to_string()).or_default()
            }
        };
        if let Some(f) = from {
            c.0[f] = c.0[f].saturating_sub(1);
        }
        if let Some(t) = to {
            c.0[t] += 1;
            c.1 |= t % 2 == 1;
        }
    }

    /// A task leaves the table: a pending one stops counting, a finished or failed one
    /// stays counted.
    pub(crate) fn forget(&mut self, t: &pb::TaskSummary) {
        if let Some(s) = Self::slot(t).filter(|s| s / 2 == 0) {
            self.moved(&t.job_id, &t.name, Some(s), None);
        }
    }

    fn entries(&self) -> impl Iterator<Item = (TaskKey, u64)> + '_ {
        self.counts.iter().flat_map(|(job, names)| {
            names.iter().flat_map(move |(name, (c, retried))| {
                (0..6).filter(move |i| i % 2 == 0 || *retried).map(move |i| {
                    ((job.clone(), name.clone(), i % 2 == 1, OWNER_TASK_STATES[i / 2]), c[i])
                })
            })
        })
    }
}

/// What scrapes remember between them (on [`Head`]).
#[derive(Default)]
pub(crate) struct HeadMetrics {
    state: Mutex<ScrapeMemory>,
}

#[derive(Default)]
struct ScrapeMemory {
    seen: SeenSeries,
    sampler: Sampler,
    /// Gang → highest generation seen (the groups of old generations may be forgotten).
    gangs: BTreeMap<String, u64>,
}

/// `GET /metrics` (METRICS-1: no token).
pub(crate) async fn scrape(State(api): State<Arc<Api>>) -> Response {
    let head = Arc::clone(&api.head);
    match tokio::task::spawn_blocking(move || render(&head)).await {
        Ok(text) => {
            (StatusCode::OK, [(header::CONTENT_TYPE, tpuray_proto::metrics::CONTENT_TYPE)], text)
                .into_response()
        }
        Err(e) => {
            (StatusCode::INTERNAL_SERVER_ERROR, format!("metrics failed: {e}\n")).into_response()
        }
    }
}

/// One TPU host as the slice metrics need it.
#[derive(Clone, Debug)]
pub(crate) struct TpuHost {
    pub labels: BTreeMap<String, String>,
    pub alive: bool,
    /// Chips: total and free, from the node's last heartbeat (0, 0 when unknown).
    pub chips: f64,
    pub free: f64,
}

/// One multi-host slice: name, type, topology, hosts expected, distinct alive worker ids,
/// and the chips of its alive hosts (total, free).
#[derive(Clone, Debug, PartialEq)]
pub(crate) struct SliceRow {
    pub name: String,
    pub accelerator_type: String,
    pub topology: String,
    pub hosts: u32,
    pub alive_hosts: u32,
    /// Every worker id 0..hosts-1 held by exactly one alive host (SCHED-15's "intact").
    pub intact: bool,
    pub chips: f64,
    pub free: f64,
}

fn label<'a>(l: &'a BTreeMap<String, String>, k: &str) -> Option<&'a str> {
    l.get(&format!("{TPURAY_PREFIX}{k}")).map(String::as_str)
}

/// The slices the TPU hosts form (pure: unit-tested below).
pub(crate) fn slices(hosts: &[TpuHost]) -> Vec<SliceRow> {
    let mut by: BTreeMap<String, Vec<&TpuHost>> = BTreeMap::new();
    for h in hosts {
        if let Some(name) = label(&h.labels, "tpu-slice-name") {
            by.entry(name.to_string()).or_default().push(h);
        }
    }
    by.into_iter()
        .map(|(name, members)| {
            let first = members[0];
            let ty = members
                .iter()
                .find_map(|h| label(&h.labels, "tpu-pod-type"))
                .unwrap_or("")
                .to_string();
            let topology = label(&first.labels, "tpu-topology").unwrap_or("").to_string();
            let expected = tpuray_scheduler::tpu::AcceleratorType::parse(&ty)
                .map(|t| t.hosts())
                .unwrap_or(members.len() as u32);
            let mut ids: BTreeMap<u32, u32> = BTreeMap::new();
            let (mut chips, mut free, mut alive) = (0.0, 0.0, 0);
            for h in members.iter().filter(|h| h.alive) {
                alive += 1;
                chips += h.chips;
                free += h.free;
                if let Some(w) = label(&h.labels, "tpu-worker-id").and_then(|w| w.parse().ok()) {
                    *ids.entry(w).or_default() += 1;
                }
            }
            let intact = ids.len() as u32 == expected
                && (0..expected).all(|w| ids.get(&w) == Some(&1))
                && alive == expected;
            SliceRow {
                name,
                accelerator_type: ty,
                topology,
                hosts: expected,
                alive_hosts: alive,
                intact,
                chips,
                free,
            }
        })
        .collect()
}

/// `gang:<name>:<generation>` → (name, generation).
fn gang_of(group_name: &str) -> Option<(&str, u64)> {
    let (name, generation) = group_name.strip_prefix("gang:")?.rsplit_once(':')?;
    Some((name, generation.parse().ok()?))
}

/// What one scrape reads under the head's lock.
#[derive(Default)]
struct ClusterSnapshot {
    tasks: HashMap<TaskKey, u64>,
    tasks_kept: usize,
    tasks_dropped: u64,
    actors: BTreeMap<(String, String, &'static str), u64>,
    actor_keys: BTreeSet<(String, String)>,
    pgs: BTreeMap<&'static str, u64>,
    nodes_alive: u64,
    nodes_dead: u64,
    tpu_hosts: Vec<TpuHost>,
    gangs: BTreeMap<String, (u64, bool)>,
    /// The autoscaler's launches and removals by node type (its report in the KV).
    autoscaler: Option<(BTreeMap<String, u64>, BTreeMap<String, u64>)>,
}

/// The KV namespace and key of the autoscaler's report (`cli/src/autoscaler`, which runs
/// in the head's process when `--autoscaling-config` is given).
pub(crate) const AUTOSCALER_REPORT: (&str, &[u8]) = ("autoscaler", b"status");

/// `launched` and `removed` (node type to count) of the autoscaler's report.
pub(crate) fn autoscaler_totals(
    report: &[u8],
) -> Option<(BTreeMap<String, u64>, BTreeMap<String, u64>)> {
    #[derive(serde::Deserialize)]
    struct Totals {
        #[serde(default)]
        launched: BTreeMap<String, u64>,
        #[serde(default)]
        removed: BTreeMap<String, u64>,
    }
    let t: Totals = serde_json::from_slice(report).ok()?;
    Some((t.launched, t.removed))
}

fn snapshot(head: &Head) -> (String, Option<ClusterSnapshot>) {
    let inner = head.lock();
    let session = format!("session_{}", inner.sm.cluster_id);
    if !head.is_leader() {
        return (session, None); // METRICS-3
    }
    let mut s = ClusterSnapshot {
        tasks: inner.task_tally.entries().collect(),
        tasks_kept: inner.tasks.len(),
        tasks_dropped: inner.tasks_dropped,
        autoscaler: inner
            .sm
            .kv
            .get(&(AUTOSCALER_REPORT.0.to_string(), AUTOSCALER_REPORT.1.to_vec()))
            .and_then(|r| autoscaler_totals(r)),
        ..Default::default()
    };
    for a in inner.sm.actors.values() {
        let state = match a.status {
            ActorStatus::PendingCreation => "PENDING_CREATION",
            ActorStatus::Alive { .. } => "ALIVE",
            ActorStatus::Restarting { .. } => "RESTARTING",
            ActorStatus::Dead { .. } => "DEAD",
        };
        let key = (a.class_name.clone(), a.job_id.to_string());
        *s.actors.entry((key.0.clone(), key.1.clone(), state)).or_default() += 1;
        s.actor_keys.insert(key);
    }
    for g in inner.sm.placement_groups.values() {
        let state = match g.status {
            PgStatus::Pending => "PENDING",
            PgStatus::Created => "CREATED",
            PgStatus::Rescheduling => "RESCHEDULING",
            PgStatus::Removed { .. } => "REMOVED",
        };
        *s.pgs.entry(state).or_default() += 1;
        if let Some((name, generation)) = gang_of(&g.name) {
            let e = s.gangs.entry(name.to_string()).or_insert((generation, false));
            if generation >= e.0 {
                *e = (generation, g.status == PgStatus::Created);
            }
        }
    }
    for n in inner.sm.nodes.values() {
        let alive = n.status == NodeStatus::Alive;
        if alive {
            s.nodes_alive += 1;
        } else {
            s.nodes_dead += 1;
        }
        let soft = inner.soft.get(&n.node_id).filter(|x| x.reported && alive);
        let chips = soft.map_or(n.total.get("TPU"), |x| x.total.get("TPU")).to_f64();
        if chips > 0.0 || label(&n.labels.0, "tpu-slice-name").is_some() {
            s.tpu_hosts.push(TpuHost {
                labels: n.labels.0.clone(),
                alive,
                chips: if alive { chips } else { 0.0 },
                free: soft.map_or(0.0, |x| x.available.get("TPU").to_f64()),
            });
        }
    }
    (session, Some(s))
}

/// The text of one scrape.
pub(crate) fn render(head: &Head) -> String {
    let (session, cluster) = snapshot(head);
    let host = head.config.listen.ip().to_string();
    let mut e = Exposition::new(labels(&[
        ("SessionName", &session),
        ("Version", env!("CARGO_PKG_VERSION")),
        ("NodeAddress", &host),
    ]));
    let mut mem = head.metrics.state.lock().unwrap_or_else(|p| p.into_inner());
    let mem = &mut *mem;
    let head_id = head.config.replica_id.to_string();
    let hid = labels(&[("HeadId", &head_id)]);
    // Every head: its Raft position and its process.
    if let Some(st) = head.replica_status() {
        let leader = st.role == tpuray_replica::Role::Leader;
        e.gauge("tpuray_raft_term", "The head's Raft term", &hid, st.term as f64);
        e.gauge("tpuray_raft_commit_index", "The last committed log index", &hid, st.commit as f64);
        e.gauge("tpuray_raft_applied_index", "The last applied log index", &hid, st.applied as f64);
        e.gauge(
            "tpuray_raft_apply_lag",
            "Committed log entries this head has not applied yet",
            &hid,
            st.commit.saturating_sub(st.applied) as f64,
        );
        e.gauge(
            "tpuray_raft_leader_id",
            "The leader this head knows (0: none)",
            &hid,
            st.leader_id as f64,
        );
        e.gauge(
            "tpuray_raft_is_leader",
            "1 when this head is the Raft leader",
            &hid,
            f64::from(u8::from(leader)),
        );
        for (peer, matched) in &st.peers {
            let l = labels(&[("HeadId", &head_id), ("Peer", &peer.to_string())]);
            e.gauge(
                "tpuray_raft_peer_match_index",
                "On the leader: the log index each head has matched",
                &l,
                *matched as f64,
            );
        }
    }
    e.gauge(
        "tpuray_head_serving",
        "1 when this head serves the cluster (the leader, caught up: HEAD-7)",
        &hid,
        f64::from(u8::from(head.is_leader())),
    );
    let pid = std::process::id();
    if let Some(p) = tpuray_proto::metrics::proc_stat(pid) {
        let cpu = mem.sampler.process(Instant::now(), pid, &p);
        let c = labels(&[("Component", "gcs"), ("pid", &pid.to_string()), ("ip", &host)]);
        e.gauge(
            "ray_component_cpu_percentage",
            "CPU use of the component (percent of one CPU)",
            &c,
            cpu,
        );
        e.gauge("ray_component_rss_bytes", "RSS of the component", &c, p.rss_bytes as f64);
        e.gauge("ray_component_rss_mb", "RSS of the component, MB", &c, p.rss_bytes as f64 / 1e6);
        e.gauge(
            "ray_component_uss_bytes",
            "USS of the component (RSS - shared)",
            &c,
            p.uss_bytes() as f64,
        );
        e.gauge("ray_component_uss_mb", "USS of the component, MB", &c, p.uss_bytes() as f64 / 1e6);
        e.gauge(
            "ray_component_shared_bytes",
            "Shared memory of the component",
            &c,
            p.shared_bytes as f64,
        );
        e.gauge(
            "ray_component_num_fds",
            "Open file descriptors of the component",
            &c,
            p.num_fds as f64,
        );
    }
    let Some(s) = cluster else { return e.encode() };
    cluster_families(&mut e, mem, s);
    e.encode()
}

fn cluster_families(e: &mut Exposition, mem: &mut ScrapeMemory, s: ClusterSnapshot) {
    let seen = &mut mem.seen;
    // ray_tasks: every (job, name, retry) seen gets every owner state (METRICS-2).
    let mut tasks: BTreeMap<Labels, f64> = BTreeMap::new();
    let keys: BTreeSet<(&str, &str, bool)> =
        s.tasks.keys().map(|(j, n, r, _)| (j.as_str(), n.as_str(), *r)).collect();
    for (j, n, r) in keys {
        for st in OWNER_TASK_STATES {
            let c = s.tasks.get(&(j.to_string(), n.to_string(), r, st)).copied().unwrap_or(0);
            tasks.insert(
                labels(&[
                    ("State", st),
                    ("Name", n),
                    ("IsRetry", if r { "1" } else { "0" }),
                    ("Source", "owner"),
                    ("JobId", j),
                ]),
                c as f64,
            );
        }
    }
    e.gauges_remembered(
        seen,
        "ray_tasks",
        "Current number of tasks in a particular state (owner side: pending, finished, failed)",
        tasks,
    );
    let mut actors: BTreeMap<Labels, f64> = BTreeMap::new();
    for (name, job) in &s.actor_keys {
        for st in ACTOR_STATES {
            let c = s.actors.get(&(name.clone(), job.clone(), st)).copied().unwrap_or(0);
            actors.insert(
                labels(&[("State", st), ("Name", name), ("Source", "gcs"), ("JobId", job)]),
                c as f64,
            );
        }
    }
    e.gauges_remembered(
        seen,
        "ray_actors",
        "Current number of actors in a particular state",
        actors,
    );
    for st in PG_STATES {
        e.gauge(
            "ray_placement_groups",
            "Number of placement groups broken down by state",
            &labels(&[("State", st)]),
            s.pgs.get(st).copied().unwrap_or(0) as f64,
        );
    }
    for (st, n) in [("ALIVE", s.nodes_alive), ("DEAD", s.nodes_dead)] {
        e.gauge(
            "tpuray_nodes",
            "Nodes the cluster has had, by state",
            &labels(&[("State", st)]),
            n as f64,
        );
    }
    e.gauge(
        "tpuray_head_tasks_kept",
        "Tasks in the head's bounded task table",
        &[],
        s.tasks_kept as f64,
    );
    e.counter(
        "tpuray_head_tasks_dropped_total",
        "Tasks the head's task table forgot to stay within its bound (still counted in ray_tasks when finished)",
        &[],
        s.tasks_dropped as f64,
    );
    // TPU: slices, and chips by state over every TPU host.
    let rows = slices(&s.tpu_hosts);
    let mut intact = BTreeMap::new();
    let mut busy = BTreeMap::new();
    let mut hosts = BTreeMap::new();
    let mut slice_chips = BTreeMap::new();
    for r in &rows {
        let id = [
            ("Slice", r.name.as_str()),
            ("AcceleratorType", r.accelerator_type.as_str()),
            ("Topology", r.topology.as_str()),
        ];
        let used = (r.chips - r.free).max(0.0);
        intact.insert(labels(&id), f64::from(u8::from(r.intact)));
        busy.insert(labels(&id), f64::from(u8::from(r.intact && used > 0.0)));
        for (st, v) in [
            ("ALIVE", f64::from(r.alive_hosts)),
            ("MISSING", f64::from(r.hosts.saturating_sub(r.alive_hosts))),
        ] {
            let mut l = labels(&id);
            l.push(("State".into(), st.into()));
            hosts.insert(l, v);
        }
        for (st, v) in [("USED", used), ("AVAILABLE", r.free)] {
            let mut l = labels(&id);
            l.push(("State".into(), st.into()));
            slice_chips.insert(l, v);
        }
    }
    e.gauges_remembered(
        seen,
        "tpuray_tpu_slice_intact",
        "1 when every host of the slice is alive, each worker id once",
        intact,
    );
    e.gauges_remembered(
        seen,
        "tpuray_tpu_slice_busy",
        "1 when the slice is intact and some of its chips are in use or reserved",
        busy,
    );
    e.gauges_remembered(
        seen,
        "tpuray_tpu_slice_hosts",
        "Hosts of the slice by state (MISSING: expected by its type, not alive)",
        hosts,
    );
    e.gauges_remembered(
        seen,
        "tpuray_tpu_slice_chips",
        "Chips of the slice's alive hosts by state",
        slice_chips,
    );
    let mut chips: BTreeMap<Labels, f64> = BTreeMap::new();
    for h in s.tpu_hosts.iter().filter(|h| h.alive) {
        let ty = label(&h.labels, "tpu-pod-type")
            .or_else(|| label(&h.labels, "accelerator-type"))
            .unwrap_or("TPU");
        for (st, v) in [("USED", (h.chips - h.free).max(0.0)), ("AVAILABLE", h.free)] {
            *chips.entry(labels(&[("AcceleratorType", ty), ("State", st)])).or_default() += v;
        }
    }
    e.gauges_remembered(
        seen,
        "tpuray_tpu_chips",
        "TPU chips of the alive TPU hosts by state",
        chips,
    );
    // Gangs: generations never go back, even when old generations' groups are forgotten.
    let mut reserved = BTreeMap::new();
    for (name, (generation, created)) in &s.gangs {
        let g = mem.gangs.entry(name.clone()).or_insert(*generation);
        *g = (*g).max(*generation);
        reserved.insert(labels(&[("Gang", name)]), f64::from(u8::from(*created)));
    }
    for (name, generation) in &mem.gangs {
        let l = labels(&[("Gang", name)]);
        e.gauge(
            "tpuray_gang_generation",
            "The gang's newest generation (0 until its first restart)",
            &l,
            *generation as f64,
        );
        e.counter(
            "tpuray_gang_restarts_total",
            "Times the gang was torn down and started again",
            &l,
            *generation as f64,
        );
    }
    e.gauges_remembered(
        seen,
        "tpuray_gang_reserved",
        "1 while the gang's newest generation holds its slices",
        reserved,
    );
    if let Some((launched, removed)) = &s.autoscaler {
        let types: BTreeSet<&String> = launched.keys().chain(removed.keys()).collect();
        for t in types {
            let l = labels(&[("NodeType", t)]);
            e.counter(
                "tpuray_autoscaler_launches_total",
                "Instances (CPU workers, or whole slices) the autoscaler launched, by node type",
                &l,
                launched.get(t).copied().unwrap_or(0) as f64,
            );
            e.counter(
                "tpuray_autoscaler_removals_total",
                "Instances the autoscaler removed (idle, lost a host, failed to start), by node type",
                &l,
                removed.get(t).copied().unwrap_or(0) as f64,
            );
        }
    }
}

// ---- service discovery ----

/// Ray's file: `[{"labels": {"job": "ray"}, "targets": ["ip:port", ...]}]`.
pub(crate) fn discovery_content(targets: &[String]) -> String {
    serde_json::json!([{"labels": {"job": "ray"}, "targets": targets}]).to_string()
}

/// `host:port` of a `http://host:port` URL.
fn url_target(url: &str) -> Option<String> {
    let rest = url.strip_prefix("http://").or_else(|| url.strip_prefix("https://"))?;
    Some(rest.trim_end_matches('/').to_string())
}

/// Writes `content` to `dir/DISCOVERY_FILE` atomically (a reader never sees half a file).
fn write_discovery(dir: &Path, content: &str) -> std::io::Result<()> {
    let tmp = dir.join(format!("tmp_{DISCOVERY_FILE}"));
    std::fs::write(&tmp, content)?;
    std::fs::rename(tmp, dir.join(DISCOVERY_FILE))
}

/// Keeps `<session_dir>/prom_metrics_service_discovery.json` listing every live node's
/// metrics address and every head's dashboard address, rewritten when they change.
/// Every head writes its own session folder's file from the durable node table.
pub(crate) fn spawn_discovery_writer(head: Arc<Head>, session_dir: PathBuf) {
    tokio::spawn(async move {
        let mut heads: BTreeMap<u64, String> = BTreeMap::new();
        let mut written = String::new();
        loop {
            if let Some(url) = head.dashboard_url.get().and_then(|u| url_target(u)) {
                heads.insert(head.config.replica_id, url);
            }
            for (i, addr) in head.config.peers.iter().enumerate() {
                let id = i as u64 + 1;
                if heads.contains_key(&id) || id == head.config.replica_id {
                    continue;
                }
                let Ok(mut c) =
                    tpuray_proto::client::head_replica(addr, head.config.token.as_deref())
                else {
                    continue;
                };
                let mut req = tonic::Request::new(pb::GetHeadInfoRequest {});
                req.set_timeout(Duration::from_secs(1));
                if let Ok(r) = c.get_head_info(req).await
                    && let Some(t) = url_target(&r.into_inner().dashboard_url)
                {
                    heads.insert(id, t);
                }
            }
            let mut targets: Vec<String> = {
                let inner = head.lock();
                inner
                    .sm
                    .nodes
                    .values()
                    .filter(|n| n.status == NodeStatus::Alive && n.metrics_export_port != 0)
                    .map(|n| {
                        let host =
                            n.address.rsplit_once(':').map_or(n.address.as_str(), |(h, _)| h);
                        format!("{host}:{}", n.metrics_export_port)
                    })
                    .collect()
            };
            targets.sort();
            targets.extend(heads.values().cloned());
            let content = discovery_content(&targets);
            if content != written {
                let dir = session_dir.clone();
                let c = content.clone();
                match tokio::task::spawn_blocking(move || write_discovery(&dir, &c)).await {
                    Ok(Ok(())) => written = content,
                    Ok(Err(e)) => tracing::warn!("cannot write {DISCOVERY_FILE}: {e}"),
                    Err(_) => {}
                }
            }
            tokio::time::sleep(DISCOVERY_EVERY).await;
        }
    });
}

#[cfg(test)]
mod tests {
    use super::*;

    fn host(slice: &str, worker: &str, alive: bool, chips: f64, free: f64) -> TpuHost {
        let labels = [
            ("tpu-slice-name", slice),
            ("tpu-worker-id", worker),
            ("tpu-pod-type", "v6e-16"),
            ("tpu-topology", "4x4"),
        ]
        .into_iter()
        .map(|(k, v)| (format!("{TPURAY_PREFIX}{k}"), v.to_string()))
        .collect();
        TpuHost { labels, alive, chips, free }
    }

    #[test]
    fn a_slice_is_intact_only_with_every_worker_id_alive_once() {
        let all: Vec<TpuHost> =
            (0..4).map(|w| host("sa", &w.to_string(), true, 4.0, 4.0)).collect();
        let r = &slices(&all)[0];
        assert!(r.intact && r.hosts == 4 && r.alive_hosts == 4 && r.chips == 16.0, "{r:?}");
        let mut one_dead = all.clone();
        one_dead[2].alive = false;
        let r = &slices(&one_dead)[0];
        assert!(!r.intact && r.alive_hosts == 3 && r.chips == 12.0, "{r:?}");
        let mut duplicate = all[..3].to_vec();
        duplicate.push(host("sa", "1", true, 4.0, 4.0));
        assert!(!slices(&duplicate)[0].intact);
    }

    #[test]
    fn gang_groups_name_their_gang_and_generation() {
        assert_eq!(gang_of("gang:train:3"), Some(("train", 3)));
        assert_eq!(gang_of("gang:a:b:0"), Some(("a:b", 0)));
        assert_eq!(gang_of("train:3"), None);
    }

    #[test]
    fn the_autoscaler_report_gives_launches_and_removals_by_node_type() {
        let (l, r) = autoscaler_totals(
            br#"{"pending_launches": [], "launched": {"cpu": 3, "v6e-16": 1}, "removed": {"cpu": 2}}"#,
        )
        .unwrap();
        assert_eq!((l["cpu"], l["v6e-16"], r["cpu"]), (3, 1, 2));
        assert!(autoscaler_totals(b"not json").is_none());
    }

    #[test]
    fn owner_states_are_rays() {
        assert_eq!(owner_state("SUBMITTED"), Some("PENDING_NODE_ASSIGNMENT"));
        assert_eq!(owner_state("RUNNING"), None, "the executor's agent exports running tasks");
    }

    #[test]
    fn the_task_tally_follows_the_table_and_keeps_forgotten_finished_tasks() {
        let mut tally = TaskTally::default();
        let t = |state: &str, attempt| pb::TaskSummary {
            job_id: "j".into(),
            name: "f".into(),
            state: state.into(),
            attempt,
            ..Default::default()
        };
        let count = |tally: &TaskTally, state: &str, retry: bool| {
            tally
                .entries()
                .find(|((_, _, r, s), _)| *r == retry && *s == state)
                .map_or(0, |(_, c)| c)
        };
        let step = |tally: &mut TaskTally, from: &pb::TaskSummary, to: &pb::TaskSummary| {
            tally.moved("j", "f", TaskTally::slot(from), TaskTally::slot(to));
        };
        let none = pb::TaskSummary::default();
        step(&mut tally, &none, &t("SUBMITTED", 0));
        step(&mut tally, &none, &t("SUBMITTED", 0));
        assert_eq!(count(&tally, "PENDING_NODE_ASSIGNMENT", false), 2);
        step(&mut tally, &t("SUBMITTED", 0), &t("RUNNING", 0));
        step(&mut tally, &t("RUNNING", 0), &t("FINISHED", 0));
        step(&mut tally, &t("SUBMITTED", 0), &t("RETRYING", 1));
        assert_eq!(count(&tally, "PENDING_NODE_ASSIGNMENT", false), 0);
        assert_eq!(count(&tally, "PENDING_NODE_ASSIGNMENT", true), 1);
        assert_eq!(count(&tally, "FINISHED", false), 1);
        tally.forget(&t("FINISHED", 0));
        assert_eq!(count(&tally, "FINISHED", false), 1, "a forgotten finished task still counts");
        tally.forget(&t("RETRYING", 1));
        assert_eq!(count(&tally, "PENDING_NODE_ASSIGNMENT", true), 0);
    }

    #[test]
    fn the_discovery_file_has_rays_shape() {
        let c = discovery_content(&["10.0.0.1:8080".into(), "10.0.0.1:8265".into()]);
        let v: serde_json::Value = serde_json::from_str(&c).unwrap();
        assert_eq!(v[0]["labels"]["job"], "ray");
        assert_eq!(v[0]["targets"][1], "10.0.0.1:8265");
        assert_eq!(url_target("http://1.2.3.4:8265").as_deref(), Some("1.2.3.4:8265"));
    }
}
