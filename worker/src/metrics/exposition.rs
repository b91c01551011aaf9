//! The text of one scrape (Prometheus exposition): the node's resources, object store,
//! host, processes, running tasks and actors, user metrics, workers and TPU chips, with
//! series once exported kept at 0 (METRICS-2).

use std::collections::{BTreeMap, HashSet};

use tpuray_proto::metrics::{Exposition, Labels, SeenSeries, labels};
use tpuray_proto::pb;

use super::{AgentView, Reporter, Reports, Sample, WorkerView, lock};
use crate::agent::Agent;

fn pid_alive(pid: u32) -> bool {
    pid != 0 && std::path::Path::new(&format!("/proc/{pid}")).exists()
}

/// The text of one scrape. Blocking (reads the store's folder).
pub fn render(agent: &Agent) -> String {
    let view = agent.metrics_view();
    let m = &agent.metrics;
    let live: HashSet<&str> = view.workers.iter().map(|w| w.worker_id.as_str()).collect();
    // A reporter is a worker of this agent, or a driver whose process still runs.
    m.retire_gone(|id, pid| live.contains(id) || pid_alive(pid));
    let session = m.session.get().cloned().unwrap_or_else(|| "session_unknown".into());
    let ip = agent
        .config
        .advertise_address
        .rsplit_once(':')
        .map_or(agent.config.advertise_address.clone(), |(h, _)| h.to_string());
    let mut e = Exposition::new(labels(&[
        ("SessionName", &session),
        ("Version", env!("CARGO_PKG_VERSION")),
        ("NodeAddress", &ip),
    ]));
    let mut seen = lock(&m.seen);
    let seen = &mut *seen;
    resources(&mut e, seen, &view);
    store(&mut e, &agent.config.store);
    let sample = lock(&m.sample).clone();
    let head = agent.config.is_head_node;
    node(&mut e, &sample, &ip, head);
    let reports = lock(&m.reports);
    executor(&mut e, seen, &view, &reports);
    components(&mut e, seen, &view, &reports, &sample, &ip);
    user_metrics(&mut e, &reports);
    drop(reports);
    workers(&mut e, &view);
    tpu(&mut e, seen, &view, &agent.config.labels);
    e.encode()
}

fn resources(e: &mut Exposition, seen: &mut SeenSeries, v: &AgentView) {
    let mut cur = BTreeMap::new();
    for (name, total) in v.total.iter() {
        let avail = v.available.get(name).to_f64();
        let used = (total.to_f64() - avail).max(0.0);
        cur.insert(labels(&[("Name", name), ("State", "AVAILABLE")]), avail);
        cur.insert(labels(&[("Name", name), ("State", "USED")]), used);
    }
    e.gauges_remembered(
        seen,
        "ray_resources",
        "Logical Ray resources broken per state {AVAILABLE, USED}",
        cur,
    );
}

fn store(e: &mut Exposition, store: &tpuray_objectstore::LocalStore) {
    let Ok(u) = store.usage_top(0) else { return };
    let help = "Object store memory by various sub-kinds on this node";
    let sealed = u.used_bytes.saturating_sub(u.writing_bytes) as f64;
    for (loc, st, v) in [
        ("MMAP_SHM", "SEALED", sealed),
        ("MMAP_SHM", "UNSEALED", u.writing_bytes as f64),
        ("SPILLED", "SEALED", u.spilled_bytes as f64),
    ] {
        e.gauge(
            "ray_object_store_memory",
            help,
            &labels(&[("Location", loc), ("ObjectState", st)]),
            v,
        );
    }
    let cap = u.capacity_bytes.map_or(0.0, |c| c as f64);
    e.gauge(
        "tpuray_object_store_capacity_bytes",
        "The store's capacity in memory (0: unlimited)",
        &[],
        cap,
    );
    e.gauge(
        "tpuray_object_store_pinned_bytes",
        "Bytes of objects mapped by a reader",
        &[],
        u.pinned_bytes as f64,
    );
    e.gauge(
        "tpuray_object_store_pooled_bytes",
        "Freed objects' memory kept for reuse (OBJ-9)",
        &[],
        u.pooled_bytes as f64,
    );
    for (loc, n) in [("MMAP_SHM", u.object_count), ("SPILLED", u.spilled_count)] {
        e.gauge(
            "tpuray_object_store_objects",
            "Sealed objects by location",
            &labels(&[("Location", loc)]),
            n as f64,
        );
    }
}

fn node(e: &mut Exposition, s: &Sample, ip: &str, head: bool) {
    let l = labels(&[
        ("ip", ip),
        ("IsHeadNode", if head { "true" } else { "false" }),
        ("RayNodeType", if head { "head" } else { "worker" }),
    ]);
    let h = &s.host;
    let used = h.mem_total.saturating_sub(h.mem_available) as f64;
    let mut g = |name: &str, help: &str, v: f64| e.gauge(name, help, &l, v);
    g("ray_node_cpu_utilization", "Total CPU usage on a ray node (percent)", s.rates.cpu_percent);
    g("ray_node_cpu_count", "Total CPUs available on a ray node", h.cpu_count as f64);
    g("ray_node_mem_used", "Memory usage on a ray node", used);
    g("ray_node_mem_available", "Memory available on a ray node", h.mem_available as f64);
    g("ray_node_mem_total", "Total memory on a ray node", h.mem_total as f64);
    g("ray_node_mem_used_host", "Host memory usage on a ray node", used);
    g("ray_node_mem_total_host", "Total host memory on a ray node", h.mem_total as f64);
    g("ray_node_mem_shared_bytes", "Total shared memory usage on a ray node", h.mem_shared as f64);
    if let Some((cur, max)) = h.cgroup_mem {
        g("ray_node_cgroup_mem_used", "Container memory usage on a ray node", cur as f64);
        g("ray_node_cgroup_mem_total", "Container memory limit on a ray node", max as f64);
    }
    if let Some((used, free)) = s.disk {
        g("ray_node_disk_usage", "Total disk usage (bytes) on a ray node", used as f64);
        g("ray_node_disk_free", "Total disk free (bytes) on a ray node", free as f64);
        let pct = if used + free > 0 { 100.0 * used as f64 / (used + free) as f64 } else { 0.0 };
        g(
            "ray_node_disk_utilization_percentage",
            "Total disk utilization (percentage) on a ray node",
            pct,
        );
    }
    g("ray_node_disk_io_read", "Total read from disk", h.disk_read as f64);
    g("ray_node_disk_io_write", "Total written to disk", h.disk_written as f64);
    g("ray_node_disk_io_read_speed", "Disk read speed (bytes/sec)", s.rates.disk_read_speed);
    g("ray_node_disk_io_write_speed", "Disk write speed (bytes/sec)", s.rates.disk_write_speed);
    g("ray_node_network_received", "Total network received", h.net_received as f64);
    g("ray_node_network_sent", "Total network sent", h.net_sent as f64);
    g(
        "ray_node_network_receive_speed",
        "Network receive speed (bytes/sec)",
        s.rates.net_receive_speed,
    );
    g("ray_node_network_send_speed", "Network send speed (bytes/sec)", s.rates.net_send_speed);
}

fn task_labels(job: &str, name: &str, is_retry: bool) -> Labels {
    labels(&[
        ("State", "RUNNING"),
        ("Name", name),
        ("IsRetry", if is_retry { "1" } else { "0" }),
        ("Source", "executor"),
        ("JobId", job),
    ])
}

fn actor_labels(job: &str, class: &str, state: &str) -> Labels {
    labels(&[("State", state), ("Name", class), ("Source", "executor"), ("JobId", job)])
}

/// Running tasks and actors of this node's workers, as their processes reported them.
pub(super) fn executor(e: &mut Exposition, seen: &mut SeenSeries, v: &AgentView, r: &Reports) {
    let live: HashSet<&str> = v.workers.iter().map(|w| w.worker_id.as_str()).collect();
    let mut tasks: BTreeMap<Labels, f64> =
        r.running_seen.iter().map(|(j, n, retry)| (task_labels(j, n, *retry), 0.0)).collect();
    let mut actors: BTreeMap<Labels, f64> = BTreeMap::new();
    for (j, class) in &r.actors_seen {
        for st in ["IDLE", "RUNNING_TASK"] {
            actors.insert(actor_labels(j, class, st), 0.0);
        }
    }
    for (id, rep) in &r.reporters {
        if !live.contains(id.as_str()) {
            continue; // workers of this agent only
        }
        let job = rep.job_id.as_str();
        for t in &rep.running {
            *tasks.entry(task_labels(job, &t.name, t.is_retry)).or_default() += f64::from(t.count);
        }
        if !rep.actor_class.is_empty() {
            let busy = !rep.running.is_empty();
            for (st, on) in [("IDLE", !busy), ("RUNNING_TASK", busy)] {
                *actors.entry(actor_labels(job, &rep.actor_class, st)).or_default() +=
                    f64::from(u8::from(on));
            }
        }
    }
    e.gauges_remembered(
        seen,
        "ray_tasks",
        "Current number of tasks in a particular state (executor side: running)",
        tasks,
    );
    e.gauges_remembered(
        seen,
        "ray_actors",
        "Current number of actors in a particular state",
        actors,
    );
}

/// What a worker process runs, as Ray names worker processes (`ray::IDLE`, ...).
fn component_name(w: &WorkerView, rep: Option<&Reporter>) -> String {
    match rep {
        Some(r) if !r.actor_class.is_empty() => format!("ray::{}", r.actor_class),
        Some(r) if !r.running.is_empty() => format!("ray::{}", r.running[0].name),
        _ if w.state == "STARTING" => "ray::STARTING".into(),
        _ => "ray::IDLE".into(),
    }
}

/// One component family's value from (cpu %, rss, shared, fds).
type ComponentValue = fn(&[f64; 4]) -> f64;

fn components(
    e: &mut Exposition,
    seen: &mut SeenSeries,
    v: &AgentView,
    r: &Reports,
    s: &Sample,
    ip: &str,
) {
    // (component, pid label) → (cpu %, rss, shared, fds)
    let mut by: BTreeMap<(String, String), [f64; 4]> = BTreeMap::new();
    let mut add = |name: String, pid: String, p: u32| {
        if let Some((st, cpu)) = s.procs.get(&p) {
            let x = by.entry((name, pid)).or_default();
            x[0] += cpu;
            x[1] += st.rss_bytes as f64;
            x[2] += st.shared_bytes as f64;
            x[3] += st.num_fds as f64;
        }
    };
    let me = std::process::id();
    add("raylet".into(), me.to_string(), me);
    for w in &v.workers {
        add(component_name(w, r.reporters.get(&w.worker_id)), String::new(), w.pid);
    }
    let fams: [(&str, &str, ComponentValue); 7] = [
        ("ray_component_cpu_percentage", "CPU use of the components (percent of one CPU)", |x| {
            x[0]
        }),
        ("ray_component_rss_bytes", "RSS of the components", |x| x[1]),
        ("ray_component_rss_mb", "RSS of the components, MB", |x| x[1] / 1e6),
        ("ray_component_shared_bytes", "Shared memory of the components (top's SHR)", |x| x[2]),
        ("ray_component_uss_bytes", "USS of the components (RSS - shared)", |x| {
            (x[1] - x[2]).max(0.0)
        }),
        ("ray_component_uss_mb", "USS of the components, MB", |x| (x[1] - x[2]).max(0.0) / 1e6),
        ("ray_component_num_fds", "Open file descriptors of the components", |x| x[3]),
    ];
    for (name, help, f) in fams {
        let cur: BTreeMap<Labels, f64> = by
            .iter()
            .map(|((c, pid), x)| {
                let mut l = labels(&[("Component", c), ("ip", ip)]);
                if !pid.is_empty() {
                    l.push(("pid".into(), pid.clone()));
                }
                (l, f(x))
            })
            .collect();
        e.gauges_remembered(seen, name, help, cur);
    }
}

/// The exported name of a user metric (Ray prefixes `ray_`; counters end in `_total`).
pub fn exported_name(def: &pb::MetricDef) -> String {
    match pb::metric_def::Kind::try_from(def.kind).unwrap_or_default() {
        pb::metric_def::Kind::Counter => format!("ray_{}_total", def.name),
        _ => format!("ray_{}", def.name),
    }
}

pub(super) fn user_metrics(e: &mut Exposition, r: &Reports) {
    use pb::metric_def::Kind;
    for ((name, tags), s) in &r.series {
        let Some(def) = r.defs.get(name) else { continue };
        let l: Labels = def.tag_keys.iter().cloned().zip(tags.iter().cloned()).collect();
        let out = exported_name(def);
        match Kind::try_from(def.kind).unwrap_or_default() {
            Kind::Gauge => {
                let v = s.by_process.get(&s.last_writer).unwrap_or(&s.retired).value;
                e.gauge(&out, &def.description, &l, v);
            }
            Kind::Counter => {
                let mut total = s.retired.clone();
                s.by_process.values().for_each(|p| total.add(p));
                e.counter(&out, &def.description, &l, total.value);
            }
            Kind::Histogram => {
                let mut total = s.retired.clone();
                s.by_process.values().for_each(|p| total.add(p));
                let mut cum = 0u64;
                let buckets: Vec<(f64, u64)> = def
                    .boundaries
                    .iter()
                    .zip(total.buckets.iter().chain(std::iter::repeat(&0)))
                    .map(|(le, n)| {
                        cum += n;
                        (*le, cum)
                    })
                    .collect();
                e.histogram(&out, &def.description, &l, &buckets, total.sum, total.count);
            }
            Kind::Unspecified => {}
        }
    }
    e.counter(
        "tpuray_metrics_dropped_series_total",
        "User metric series dropped because the node holds its maximum",
        &[],
        r.dropped_series as f64,
    );
}

fn workers(e: &mut Exposition, v: &AgentView) {
    for st in ["STARTING", "IDLE", "LEASED", "ACTOR"] {
        let n = v.workers.iter().filter(|w| w.state == st).count();
        e.gauge(
            "tpuray_workers",
            "Worker processes of this node by state",
            &labels(&[("State", st)]),
            n as f64,
        );
    }
}

/// Per chip of a TPU host: whether a worker process holds it, and whether that worker
/// runs work (leased or hosting an actor) rather than waiting idle (AGENT-7).
fn tpu(
    e: &mut Exposition,
    seen: &mut SeenSeries,
    v: &AgentView,
    node_labels: &tpuray_scheduler::Labels,
) {
    let Some(n) = v.tpu_chips else { return };
    let label = |k: &str| node_labels.get(&format!("tpuray.io/{k}")).unwrap_or("").to_string();
    let (ty, topo, slice, wid) = (
        label("tpu-pod-type"),
        label("tpu-topology"),
        label("tpu-slice-name"),
        label("tpu-worker-id"),
    );
    let mut held = vec![false; n as usize];
    let mut busy = vec![false; n as usize];
    for w in &v.workers {
        for &c in &w.tpu_chips {
            if let Some(h) = held.get_mut(c as usize) {
                *h = true;
                busy[c as usize] |= matches!(w.state, "LEASED" | "ACTOR");
            }
        }
    }
    let mut alloc = BTreeMap::new();
    let mut running = BTreeMap::new();
    for i in 0..n as usize {
        let l = labels(&[
            ("TpuIndex", &i.to_string()),
            ("TpuType", &ty),
            ("TpuTopology", &topo),
            ("Slice", &slice),
            ("TpuWorkerId", &wid),
        ]);
        alloc.insert(l.clone(), f64::from(u8::from(held[i])));
        running.insert(l, f64::from(u8::from(busy[i])));
    }
    e.gauges_remembered(
        seen,
        "tpuray_tpu_chip_allocated",
        "1 when a worker process holds the chip (TPU_VISIBLE_CHIPS)",
        alloc,
    );
    e.gauges_remembered(
        seen,
        "tpuray_tpu_chip_busy",
        "1 when the chip's worker runs work (leased, or hosting an actor)",
        running,
    );
}
