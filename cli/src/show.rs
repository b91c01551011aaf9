//! `tpuray status`, `tpuray list` and `tpuray memory`: read the head's state (and,
//! for objects, each alive node agent's store) and print it as a table or as JSON (a
//! list of objects). `status` also draws each TPU slice as its hosts
//! ([`render_tpu_slices`]), from the nodes' TPU labels and the placement groups.

use std::collections::BTreeMap;
use std::time::Duration;

use anyhow::{Context, Result, anyhow};
use serde_json::json;
use tonic::Request;
use tpuray_head::slices::{self, node_accelerator_type, plural, short_id, tpu_label};
use tpuray_proto::pb;

use crate::args::{Format, ListKind};

fn runtime() -> Result<tokio::runtime::Runtime> {
    Ok(tokio::runtime::Builder::new_current_thread().enable_all().build()?)
}

fn head_client(
    address: &str,
) -> Result<pb::head_service_client::HeadServiceClient<tpuray_proto::client::AuthChannel>> {
    let token = tpuray_proto::auth::load_token()?;
    Ok(tpuray_proto::client::head(address, token.as_deref())?)
}

/// Each head replica's Raft status, asked of each replica itself: the addresses given,
/// then any other replica the answers name. Unreachable replicas are listed with why.
async fn replica_statuses(
    address: &str,
) -> Vec<(String, Result<pb::GetReplicaStatusReply, String>)> {
    let token = tpuray_proto::auth::load_token().ok().flatten();
    let mut todo: Vec<String> = address.split(',').map(|a| a.trim().to_string()).collect();
    let mut out: Vec<(String, Result<pb::GetReplicaStatusReply, String>)> = Vec::new();
    while let Some(addr) = todo.first().cloned() {
        todo.remove(0);
        if out.iter().any(|(a, _)| *a == addr) {
            continue;
        }
        let r = async {
            let mut c = tpuray_proto::client::head_replica(&addr, token.as_deref())
                .map_err(|e| e.to_string())?;
            let mut req = Request::new(pb::GetReplicaStatusRequest {});
            req.set_timeout(Duration::from_secs(3));
            c.get_replica_status(req)
                .await
                .map(|r| r.into_inner())
                .map_err(|s| s.message().to_string())
        }
        .await;
        if let Ok(st) = &r {
            for other in &st.replicas {
                if !out.iter().any(|(a, _)| a == other) && !todo.contains(other) && *other != addr {
                    todo.push(other.clone());
                }
            }
        }
        out.push((addr, r));
    }
    out.sort_by_key(|(a, r)| (r.as_ref().map(|s| s.id).unwrap_or(u64::MAX), a.clone()));
    out
}

fn print_replicas(replicas: &[(String, Result<pb::GetReplicaStatusReply, String>)]) {
    let leader = replicas.iter().find_map(|(_, r)| r.as_ref().ok().filter(|s| s.role == "leader"));
    match leader {
        Some(l) => println!("Head replicas (leader: {} at {}, term {})", l.id, l.address, l.term),
        None => println!("Head replicas (no leader)"),
    }
    for (addr, r) in replicas {
        match r {
            Ok(s) => {
                let serving = if s.leader_ready { ", serving" } else { "" };
                println!(
                    " {} {addr} {}{serving} -- term {}, commit {}, applied {}, log {}..{}, snapshot {}",
                    s.id,
                    s.role,
                    s.term,
                    s.commit_index,
                    s.applied_index,
                    s.first_index,
                    s.last_index,
                    s.snapshot_index
                );
            }
            Err(e) => println!(" ? {addr} unreachable -- {e}"),
        }
    }
    if let Some(l) = leader {
        let matched: Vec<String> =
            l.peers.iter().map(|p| format!("{}: {}", p.id, p.matched_index)).collect();
        if !matched.is_empty() {
            println!(
                " replicated up to (per replica, as the leader knows): {}",
                matched.join(", ")
            );
        }
    }
}

fn call_err(address: &str, s: tonic::Status) -> anyhow::Error {
    match tpuray_proto::tls::why_failed(address, "head", &s) {
        Some(why) => anyhow!(why),
        None => anyhow!("the head at {address} answered {:?}: {}", s.code(), s.message()),
    }
}

fn fmt_amount(name: &str, v: f64) -> String {
    if name.contains("memory") {
        fmt_bytes(v)
    } else if v.fract() == 0.0 {
        format!("{v:.1}")
    } else {
        format!("{v}")
    }
}

fn fmt_bytes(v: f64) -> String {
    const UNITS: [&str; 5] = ["B", "KiB", "MiB", "GiB", "TiB"];
    let mut v = v;
    let mut i = 0;
    while v >= 1024.0 && i < UNITS.len() - 1 {
        v /= 1024.0;
        i += 1;
    }
    format!("{v:.2}{}", UNITS[i])
}

fn fmt_shape(m: &std::collections::HashMap<String, f64>) -> String {
    let s: BTreeMap<_, _> = m.iter().collect();
    let parts: Vec<String> = s.iter().map(|(k, v)| format!("{k}: {v}")).collect();
    format!("{{{}}}", parts.join(", "))
}

/// A placement group bundle's renamed resource (`CPU_group_0_<pg>`): a share of the
/// node's own resources, not more of them.
fn is_bundle_resource(name: &str) -> bool {
    tpuray_scheduler::bundles::parse_bundle_resource(name).is_some()
}

fn node_state(n: &pb::NodeInfo) -> &'static str {
    if n.state == pb::NodeState::Alive as i32 { "ALIVE" } else { "DEAD" }
}

// ---------------------------------------------------------------------------------------
// TPU slices: text rendering of the head's slice model (`tpuray_head::slices`, which the
// dashboard draws too), proto messages in, text out (unit-tested below).
// ---------------------------------------------------------------------------------------

/// `[####....]`: one cell per chip, `#` used (by work or reserved by a placement group
/// bundle), `.` free. Hosts of more than [`BAR_CELLS`] chips get that many cells, scaled.
fn chip_bar(used: u32, total: u32) -> String {
    const BAR_CELLS: u32 = 16;
    let (used, total) = if total > BAR_CELLS {
        ((used * BAR_CELLS).div_ceil(total), BAR_CELLS)
    } else {
        (used, total)
    };
    let used = used.min(total);
    format!("[{}{}]", "#".repeat(used as usize), ".".repeat((total - used) as usize))
}

/// The `TPU slices` section of `tpuray status`: each slice as a heading (name, accelerator
/// type, topology, hosts present of the hosts its type has) and one line per host in
/// worker-id order: worker id, agent address, short node id, chips used and free, a chip
/// bar, and the placement groups and gangs holding a bundle there (with the chips each
/// reserved on that host). Alive nodes only; CPU-only nodes are not drawn. Returns an empty
/// string when the cluster has no TPU host, so CPU clusters see no new section.
pub(crate) fn render_tpu_slices(
    nodes: &[pb::NodeInfo],
    groups: &[pb::PlacementGroupInfo],
) -> String {
    let views = slices::slices(nodes, groups);
    if views.is_empty() {
        return String::new();
    }
    // Host lines as cells first, so the columns line up across every slice.
    let host_cells = |h: &slices::Host| -> [String; 6] {
        let worker = match h.worker_id {
            Some(w) if h.duplicate_worker_id => format!("worker {w}!"),
            Some(w) => format!("worker {w}"),
            None => "worker -".to_string(),
        };
        let chips = format!("{} used, {} free", h.used, h.chips - h.used);
        let held: Vec<String> = h
            .holders
            .iter()
            .map(|g| {
                let mut s = g.display.clone();
                if g.chips > 0 {
                    s.push_str(&format!(": {}", plural(g.chips as usize, "chip", "chips")));
                }
                if let Some(state) = &g.state {
                    s.push_str(&format!(" ({state})"));
                }
                s
            })
            .collect();
        [
            worker,
            h.node.address.clone(),
            format!("node {}", short_id(&h.node.node_id)),
            chips,
            chip_bar(h.used, h.chips),
            held.join("; "),
        ]
    };
    let rows: Vec<Vec<[String; 6]>> =
        views.iter().map(|v| v.hosts.iter().map(host_cells).collect()).collect();
    let mut widths = [0usize; 6];
    for cells in rows.iter().flatten() {
        for (w, c) in widths.iter_mut().zip(cells) {
            *w = (*w).max(c.chars().count());
        }
    }
    let mut out = String::new();
    out.push_str(&format!(
        "TPU slices ({}, {})\n",
        plural(views.len(), "slice", "slices"),
        plural(views.iter().map(|v| v.hosts.len()).sum(), "host", "hosts")
    ));
    for (v, cells) in views.iter().zip(&rows) {
        out.push_str(&format!(" {}\n", v.heading));
        for c in cells {
            let parts: Vec<String> =
                c.iter().zip(&widths).map(|(s, w)| format!("{s:<w$}", w = *w)).collect();
            out.push_str(&format!("  {}\n", parts.join("  ").trim_end()));
        }
    }
    if views.iter().flat_map(|v| &v.hosts).any(|h| h.duplicate_worker_id) {
        out.push_str(" (! two alive hosts of one slice claim the same worker id)\n");
    }
    out
}

pub fn status(address: &str) -> Result<i32> {
    let rt = runtime()?;
    let replicas = rt.block_on(replica_statuses(address));
    let (st, groups, autoscaler_report) = rt.block_on(async {
        let mut head = head_client(address)?;
        let mut req = Request::new(pb::GetClusterStatusRequest {});
        req.set_timeout(Duration::from_secs(10));
        let st = head
            .get_cluster_status(req)
            .await
            .map(|r| r.into_inner())
            .map_err(|s| call_err(address, s))?;
        // Only for naming who holds the TPU chips: without it the slices are drawn anyway.
        let mut req = Request::new(pb::ListPlacementGroupsRequest {});
        req.set_timeout(Duration::from_secs(10));
        let groups = match head.list_placement_groups(req).await {
            Ok(r) => r.into_inner().placement_groups,
            Err(s) => {
                eprintln!("tpuray: placement groups not shown: {}", call_err(address, s));
                Vec::new()
            }
        };
        // The autoscaler's report, when the head runs one (`--autoscaling-config`).
        let key = crate::autoscaler::STATUS_KEY.to_vec();
        let kv = pb::KvGetRequest { namespace: crate::autoscaler::KV_NAMESPACE.into(), key };
        let mut req = Request::new(kv);
        req.set_timeout(Duration::from_secs(10));
        let report = match head.kv_get(req).await {
            Ok(r) if r.get_ref().found => serde_json::from_slice(&r.into_inner().value).ok(),
            _ => None,
        };
        Ok::<_, anyhow::Error>((st, groups, report))
    })?;
    let alive: Vec<&pb::NodeInfo> =
        st.nodes.iter().filter(|n| n.state == pb::NodeState::Alive as i32).collect();
    let dead = st.nodes.len() - alive.len();
    println!("======== Cluster status: {address} ========");
    println!("Nodes ({} alive, {dead} dead)", alive.len());
    for n in &st.nodes {
        let head = if n.is_head_node { " (head)" } else { "" };
        let res: BTreeMap<_, _> = n
            .total
            .iter()
            .filter(|(k, _)| !k.contains("memory") && !is_bundle_resource(k))
            .collect();
        let res: Vec<String> = res.iter().map(|(k, v)| format!("{k}: {v}")).collect();
        print!(" {} {} {}{head} {{{}}}", node_state(n), n.node_id, n.address, res.join(", "));
        if !n.death_reason.is_empty() {
            print!(" -- {}", n.death_reason);
        }
        println!();
    }
    let slices = render_tpu_slices(&st.nodes, &groups);
    if !slices.is_empty() {
        println!();
        print!("{slices}");
    }
    println!();
    println!("Resources");
    println!("---------------------------------------------------------------");
    println!("Usage:");
    let total: BTreeMap<_, _> = st.total.iter().collect();
    for (name, t) in total {
        let avail = st.available.get(name).copied().unwrap_or(0.0);
        let used = (t - avail).max(0.0);
        println!(" {}/{} {name}", fmt_amount(name, used), fmt_amount(name, *t));
    }
    println!();
    println!("Demands:");
    if st.pending.is_empty() {
        println!(" (no resource demands)");
    }
    for d in &st.pending {
        print!(" {}: {}+ pending", fmt_shape(&d.shape), d.count.max(1));
        if !d.reason.is_empty() {
            print!(" -- {}", d.reason);
        }
        println!();
    }
    // With an autoscaler, what no node holds now is the autoscaler's to launch for (its
    // section below says what it launches and what no node type could ever hold).
    if autoscaler_report.is_some() {
        println!("Waiting for a node (no node holds it now; see Autoscaler below):");
        if st.infeasible.is_empty() {
            println!(" (none)");
        }
        for d in &st.infeasible {
            println!(" {}: {}+ waiting -- {}", fmt_shape(&d.shape), d.count.max(1), d.reason);
        }
    } else {
        println!("Infeasible:");
        if st.infeasible.is_empty() {
            println!(" (no infeasible demand)");
        }
        for d in &st.infeasible {
            println!(" {}: {}+ infeasible -- {}", fmt_shape(&d.shape), d.count.max(1), d.reason);
        }
    }
    if let Some(report) = autoscaler_report {
        println!();
        print!("{}", crate::autoscaler::render_report(&report, crate::autoscaler::now_ms()));
    }
    println!();
    print_replicas(&replicas);
    Ok(0)
}

/// How `list` filters and shows rows.
pub struct ListOptions {
    pub format: Format,
    /// At most this many rows (0: all), after the filters.
    pub limit: usize,
    /// `(key, "=" | "!=", value)`.
    pub filters: Vec<(String, String, String)>,
    /// Every field in the table.
    pub detail: bool,
}

/// `--filter` arguments, `KEY=VALUE` or `KEY!=VALUE`.
///
/// # Errors
/// A message naming an argument of another shape.
pub fn parse_filters(args: &[String]) -> Result<Vec<(String, String, String)>> {
    args.iter()
        .map(|a| {
            let (k, p, v) = if let Some((k, v)) = a.split_once("!=") {
                (k, "!=", v)
            } else if let Some((k, v)) = a.split_once('=') {
                (k, "=", v)
            } else {
                return Err(anyhow!("--filter {a:?}: expected KEY=VALUE or KEY!=VALUE"));
            };
            let k = k.trim();
            if k.is_empty() {
                return Err(anyhow!(
                    "--filter {a:?}: the key is empty (expected KEY=VALUE or KEY!=VALUE)"
                ));
            }
            Ok((k.to_string(), p.to_string(), v.trim().to_string()))
        })
        .collect()
}

/// The rows that pass `filters` (Ray's value rules, `tpuray_head::state_api::row_matches`).
///
/// # Errors
/// A filter on a field the rows do not have (naming the fields they have), or a value
/// of the wrong type.
fn filter_rows(
    rows: Vec<serde_json::Value>,
    filters: &[(String, String, String)],
) -> Result<Vec<serde_json::Value>> {
    if filters.is_empty() {
        return Ok(rows);
    }
    if let Some(serde_json::Value::Object(first)) = rows.first() {
        for (k, _, _) in filters {
            if !first.contains_key(&k.to_lowercase()) {
                let have: Vec<&str> = first.keys().map(String::as_str).collect();
                return Err(anyhow!(
                    "--filter: the rows have no field {k:?} (they have {})",
                    have.join(", ")
                ));
            }
        }
    }
    let mut out = Vec::new();
    for r in rows {
        if tpuray_head::state_api::row_matches(&r, filters).map_err(|e| anyhow!("--filter: {e}"))? {
            out.push(r);
        }
    }
    Ok(out)
}

pub fn list(address: &str, kind: ListKind, opts: &ListOptions) -> Result<i32> {
    let rows = filter_rows(list_rows(address, kind)?, &opts.filters)?;
    let (format, limit) = (opts.format, opts.limit);
    let total = rows.len();
    let rows: Vec<serde_json::Value> =
        if limit > 0 { rows.into_iter().take(limit).collect() } else { rows };
    if rows.len() < total && format == Format::Table {
        eprintln!("(showing {} of {total}; use --limit 0 for all)", rows.len());
    }
    match format {
        Format::Json => println!("{}", serde_json::to_string_pretty(&rows).context("encode json")?),
        Format::Table if opts.detail => print!("{}", render_detail(&rows)),
        Format::Table => print_table(&rows, kind),
    }
    Ok(0)
}

/// The field naming a row of `kind`.
fn id_field(kind: ListKind) -> &'static str {
    match kind {
        ListKind::Nodes => "node_id",
        ListKind::Actors => "actor_id",
        ListKind::Jobs => "job_id",
        ListKind::Tasks => "task_id",
        ListKind::PlacementGroups => "placement_group_id",
        ListKind::Objects => "object_id",
    }
}

/// `tpuray get KIND ID`: the row with that id (or the one whose id starts with it),
/// every field, as JSON; exit 1 naming the id when there is none.
pub fn get(address: &str, kind: ListKind, id: &str) -> Result<i32> {
    let field = id_field(kind);
    let rows = list_rows(address, kind)?;
    let exact: Vec<&serde_json::Value> = rows.iter().filter(|r| r[field] == id).collect();
    let found: Vec<&serde_json::Value> = if !exact.is_empty() || id.len() < 6 {
        exact
    } else {
        rows.iter().filter(|r| r[field].as_str().is_some_and(|v| v.starts_with(id))).collect()
    };
    match found.as_slice() {
        [] => {
            eprintln!("tpuray: no {field} {id} in the cluster");
            Ok(1)
        }
        [one] => {
            println!("{}", serde_json::to_string_pretty(one).context("encode json")?);
            Ok(0)
        }
        many => {
            // A task's attempts share its id: all of them.
            if many.iter().all(|r| r[field] == many[0][field]) {
                println!("{}", serde_json::to_string_pretty(&many).context("encode json")?);
                return Ok(0);
            }
            let ids: Vec<String> = many.iter().map(|r| r[field].to_string()).collect();
            eprintln!("tpuray: {id} is the start of several ids: {}", ids.join(", "));
            Ok(1)
        }
    }
}

/// `tpuray summary KIND`: the head's state-API summary (Ray's `ray summary`).
pub fn summary(address: &str, kind: crate::args::SummaryKind, format: Format) -> Result<i32> {
    use crate::args::SummaryKind;
    let resource = match kind {
        SummaryKind::Tasks => "tasks",
        SummaryKind::Actors => "actors",
        SummaryKind::Objects => "objects",
    };
    let client = crate::job::JobClient::connect(crate::job::ClientOptions {
        address: Some(address.to_string()),
        env_overrides: false,
        ..Default::default()
    })
    .map_err(|e| anyhow!("{e}"))?;
    let body = client
        .get(&format!("/api/v0/{resource}/summarize"), Duration::from_secs(30))
        .map_err(|e| anyhow!("{e}"))?;
    let v: serde_json::Value =
        serde_json::from_str(&body).context("the head's summary is not JSON")?;
    let cluster = &v["data"]["result"]["result"]["node_id_to_summary"]["cluster"];
    match format {
        Format::Json => {
            println!("{}", serde_json::to_string_pretty(cluster).context("encode json")?)
        }
        Format::Table => print!("{}", render_summary(kind, cluster)),
    }
    Ok(0)
}

/// A summary as Ray's CLI lays it out: the totals, then a table of the groups.
fn render_summary(kind: crate::args::SummaryKind, s: &serde_json::Value) -> String {
    use crate::args::SummaryKind;
    let mut out = String::new();
    let counts = |v: &serde_json::Value| {
        v.as_object()
            .map(|m| m.iter().map(|(k, n)| format!("{k}: {n}")).collect::<Vec<_>>().join(", "))
            .unwrap_or_default()
    };
    let (totals, cols, rows): (Vec<&str>, Vec<&str>, Vec<Vec<String>>) = match kind {
        SummaryKind::Tasks => (
            vec!["total_tasks", "total_actor_tasks", "total_actor_scheduled"],
            vec!["FUNC_OR_CLASS_NAME", "STATE_COUNTS", "TYPE"],
            s["summary"]
                .as_object()
                .into_iter()
                .flatten()
                .map(|(name, g)| {
                    vec![
                        name.clone(),
                        counts(&g["state_counts"]),
                        g["type"].as_str().unwrap_or("").into(),
                    ]
                })
                .collect(),
        ),
        SummaryKind::Actors => (
            vec!["total_actors"],
            vec!["CLASS_NAME", "STATE_COUNTS"],
            s["summary"]
                .as_object()
                .into_iter()
                .flatten()
                .map(|(name, g)| vec![name.clone(), counts(&g["state_counts"])])
                .collect(),
        ),
        SummaryKind::Objects => (
            vec!["total_objects", "total_size_mb"],
            vec![
                "CALLSITE",
                "TOTAL_OBJECTS",
                "TOTAL_SIZE_MB",
                "TASK_STATE_COUNTS",
                "REF_TYPE_COUNTS",
            ],
            s["summary"]
                .as_object()
                .into_iter()
                .flatten()
                .map(|(site, g)| {
                    vec![
                        site.clone(),
                        g["total_objects"].to_string(),
                        format!("{:.2}", g["total_size_mb"].as_f64().unwrap_or(0.0)),
                        counts(&g["task_state_counts"]),
                        counts(&g["ref_type_counts"]),
                    ]
                })
                .collect(),
        ),
    };
    for t in totals {
        out.push_str(&format!("{t}: {}\n", s[t]));
    }
    out.push('\n');
    let widths: Vec<usize> = cols
        .iter()
        .enumerate()
        .map(|(i, c)| rows.iter().map(|r| r[i].len()).max().unwrap_or(0).max(c.len()))
        .collect();
    let mut line = |vals: Vec<String>| {
        let parts: Vec<String> =
            vals.iter().zip(&widths).map(|(v, w)| format!("{v:<w$}", w = *w)).collect();
        out.push_str(parts.join("  ").trim_end());
        out.push('\n');
    };
    line(cols.iter().map(|c| c.to_string()).collect());
    for r in rows {
        line(r);
    }
    out
}

/// Rows with every field: one block per row, `field: value` lines.
fn render_detail(rows: &[serde_json::Value]) -> String {
    if rows.is_empty() {
        return "(none)\n".into();
    }
    let mut out = String::new();
    for (i, r) in rows.iter().enumerate() {
        if i > 0 {
            out.push('\n');
        }
        if let serde_json::Value::Object(m) = r {
            let w = m.keys().map(String::len).max().unwrap_or(0);
            for (k, v) in m {
                let v = match v {
                    serde_json::Value::String(s) => s.clone(),
                    v => v.to_string(),
                };
                out.push_str(&format!("{k:<w$}  {v}\n"));
            }
        }
    }
    out
}

/// Every row of `kind`, newest first for tasks and groups.
fn list_rows(address: &str, kind: ListKind) -> Result<Vec<serde_json::Value>> {
    let rt = runtime()?;
    let rows: Vec<serde_json::Value> = rt.block_on(async {
        let mut head = head_client(address)?;
        let rows = match kind {
            ListKind::Nodes => {
                let st = head
                    .get_cluster_status(pb::GetClusterStatusRequest {})
                    .await
                    .map_err(|s| call_err(address, s))?
                    .into_inner();
                st.nodes.iter().map(node_row).collect()
            }
            ListKind::PlacementGroups => {
                let mut groups = head
                    .list_placement_groups(pb::ListPlacementGroupsRequest {})
                    .await
                    .map_err(|s| call_err(address, s))?
                    .into_inner()
                    .placement_groups;
                // Newest first, as `list tasks`: removed groups do not bury new ones.
                groups.sort_by_key(|g| std::cmp::Reverse(g.create_time_ms));
                groups
                    .iter()
                    .map(|p| {
                        let state = pb::PlacementGroupState::try_from(p.state)
                            .map(|s| {
                                s.as_str_name()
                                    .trim_start_matches("PLACEMENT_GROUP_STATE_")
                                    .to_string()
                            })
                            .unwrap_or_default();
                        let bundles: Vec<String> =
                            p.bundles.iter().map(|b| fmt_shape(&b.resources)).collect();
                        let slice = p.slice.as_ref().map(|s| {
                            json!({
                                "accelerator_type": s.accelerator_type,
                                "topology": s.topology,
                                "num_slices": s.num_slices,
                            })
                        });
                        json!({
                            "placement_group_id": p.placement_group_id,
                            "name": p.name,
                            "state": state,
                            "strategy": p.strategy,
                            "num_bundles": p.bundles.len(),
                            "bundles": bundles,
                            "bundle_node_ids": p.bundle_node_ids,
                            "job_id": p.job_id,
                            "namespace": p.namespace,
                            "detached": p.detached,
                            "slice": slice,
                            "pending_reason": p.pending_reason,
                            "infeasible": p.infeasible,
                            "removal_reason": p.removal_reason,
                            "create_time_ms": p.create_time_ms,
                        })
                    })
                    .collect()
            }
            ListKind::Objects => {
                let mut rows: Vec<serde_json::Value> = Vec::new();
                for (node, usage) in store_usages(address, &mut head, 0).await? {
                    match usage {
                        Ok(u) => rows.extend(u.objects.iter().map(|o| object_row(&node, o))),
                        Err(e) => eprintln!("node {}: {e}", node.node_id),
                    }
                }
                rows.sort_by(|a, b| {
                    b["size"]
                        .as_u64()
                        .cmp(&a["size"].as_u64())
                        .then_with(|| a["object_id"].as_str().cmp(&b["object_id"].as_str()))
                });
                rows
            }
            ListKind::Actors => head
                .list_actors(pb::ListActorsRequest {})
                .await
                .map_err(|s| call_err(address, s))?
                .into_inner()
                .actors
                .iter()
                .map(|a| {
                    let state = pb::ActorState::try_from(a.state)
                        .map(|s| s.as_str_name().trim_start_matches("ACTOR_STATE_").to_string())
                        .unwrap_or_default();
                    json!({
                        "actor_id": a.actor_id,
                        "class_name": a.class_name,
                        "name": a.name,
                        "namespace": a.namespace,
                        "state": state,
                        "job_id": a.job_id,
                        "node_id": a.node_id,
                        "pid": a.pid,
                        "num_restarts": a.num_restarts,
                        "max_restarts": a.max_restarts,
                        "detached": a.detached,
                        "death_cause": a.death_cause,
                        "pending_reason": a.pending_reason,
                    })
                })
                .collect(),
            ListKind::Jobs => head
                .list_jobs(pb::ListJobsRequest {})
                .await
                .map_err(|s| call_err(address, s))?
                .into_inner()
                .jobs
                .iter()
                .map(|j| {
                    let state = pb::JobState::try_from(j.state)
                        .map(|s| s.as_str_name().trim_start_matches("JOB_STATE_").to_string())
                        .unwrap_or_default();
                    json!({
                        "job_id": j.job_id,
                        "state": state,
                        "entrypoint": j.entrypoint,
                        "namespace": j.namespace,
                        "driver_pid": j.driver_pid,
                        "start_time_ms": j.start_time_ms,
                        "end_time_ms": j.end_time_ms,
                    })
                })
                .collect(),
            ListKind::Tasks => head
                .list_tasks(pb::ListTasksRequest { limit: 0 })
                .await
                .map_err(|s| call_err(address, s))?
                .into_inner()
                .tasks
                .iter()
                .map(|t| {
                    json!({
                        "task_id": t.task_id,
                        "name": t.name,
                        // Ray's name, as the state API says it.
                        "state": tpuray_head::state_api::ray_task_state(&t.state),
                        "job_id": t.job_id,
                        "node_id": t.node_id,
                        "worker_id": t.worker_id,
                        "actor_id": t.actor_id,
                        "attempt": t.attempt,
                        "error": t.error,
                        "submitted_ms": t.submitted_ms,
                        "finished_ms": t.finished_ms,
                    })
                })
                .collect(),
        };
        Ok::<_, anyhow::Error>(rows)
    })?;
    Ok(rows)
}

/// One `list nodes` row. `accelerator_type` is the slice type (`v6e-16`), else the
/// generation label (`TPU-V6E`); it, `tpu_slice_name` and `tpu_worker_id` are empty strings
/// for nodes that are not TPU hosts.
/// Each alive node's store usage (at most `limit` objects each, 0: all), asked of its
/// agent; a node that does not answer within 5 s carries the error instead.
async fn store_usages(
    address: &str,
    head: &mut pb::head_service_client::HeadServiceClient<tpuray_proto::client::AuthChannel>,
    limit: u32,
) -> Result<Vec<(pb::NodeInfo, Result<pb::GetStoreUsageReply, String>)>> {
    let token = tpuray_proto::auth::load_token()?;
    let st = head
        .get_cluster_status(pb::GetClusterStatusRequest {})
        .await
        .map_err(|s| call_err(address, s))?
        .into_inner();
    let mut out = Vec::new();
    for n in st.nodes.into_iter().filter(|n| n.state == pb::NodeState::Alive as i32) {
        let usage = async {
            let mut c = tpuray_proto::client::objects(&n.address, token.as_deref())
                .map_err(|e| e.to_string())?;
            let mut req = Request::new(pb::GetStoreUsageRequest { limit });
            req.set_timeout(Duration::from_secs(5));
            c.get_store_usage(req).await.map(|r| r.into_inner()).map_err(|s| {
                format!("the node agent at {} answered {:?}: {}", n.address, s.code(), s.message())
            })
        }
        .await;
        out.push((n, usage));
    }
    out.sort_by_key(|(n, _)| (!n.is_head_node, n.node_id.clone()));
    Ok(out)
}

fn location_name(o: &pb::StoreObject) -> &'static str {
    match pb::StoreLocation::try_from(o.location) {
        Ok(pb::StoreLocation::Memory) => "memory",
        Ok(pb::StoreLocation::Spilled) => "spilled",
        _ => "unknown",
    }
}

fn object_row(n: &pb::NodeInfo, o: &pb::StoreObject) -> serde_json::Value {
    json!({
        "object_id": o.object_id,
        "size": o.size,
        "node_id": n.node_id,
        "location": location_name(o),
        "owner": o.owner,
        "copy": if o.secondary { "secondary" } else { "primary" },
        "pinned": o.pinned,
    })
}

fn memory_row(n: &pb::NodeInfo, u: &Result<pb::GetStoreUsageReply, String>) -> serde_json::Value {
    match u {
        Ok(u) => json!({
            "node_id": n.node_id,
            "address": n.address,
            "is_head_node": n.is_head_node,
            "capacity_bytes": u.capacity_bytes,
            "used_bytes": u.used_bytes,
            "writing_bytes": u.writing_bytes,
            "pooled_bytes": u.pooled_bytes,
            "spilled_bytes": u.spilled_bytes,
            "pinned_bytes": u.pinned_bytes,
            "object_count": u.object_count,
            "spilled_count": u.spilled_count,
            "store_dir": u.store_dir,
            "spill_dir": u.spill_dir,
            "largest": u.objects.iter().map(|o| object_row(n, o)).collect::<Vec<_>>(),
        }),
        Err(e) => json!({
            "node_id": n.node_id,
            "address": n.address,
            "is_head_node": n.is_head_node,
            "error": e,
        }),
    }
}

/// `tpuray memory`: per alive node, the store's capacity, what it holds in memory,
/// spilled and pinned, and its `top` largest objects (0: all) with size, location and
/// owner.
pub fn memory(address: &str, format: Format, top: u32) -> Result<i32> {
    let rt = runtime()?;
    let usages = rt.block_on(async {
        let mut head = head_client(address)?;
        store_usages(address, &mut head, top).await
    })?;
    let rows: Vec<serde_json::Value> = usages.iter().map(|(n, u)| memory_row(n, u)).collect();
    match format {
        Format::Json => println!("{}", serde_json::to_string_pretty(&rows).context("encode json")?),
        Format::Table => print!("{}", render_memory(&usages)),
    }
    Ok(0)
}

fn render_memory(usages: &[(pb::NodeInfo, Result<pb::GetStoreUsageReply, String>)]) -> String {
    let mut out = String::new();
    if usages.is_empty() {
        out.push_str("(no alive node)\n");
    }
    for (n, u) in usages {
        let head = if n.is_head_node { ", head" } else { "" };
        out.push_str(&format!("Node {} ({}{head})\n", n.node_id, n.address));
        let u = match u {
            Ok(u) => u,
            Err(e) => {
                out.push_str(&format!("  unreachable: {e}\n"));
                continue;
            }
        };
        let capacity = u.capacity_bytes.map(|c| fmt_bytes(c as f64)).unwrap_or("unlimited".into());
        out.push_str(&format!(
            "  object store: {} used of {capacity} ({} in memory, {} being written)\n",
            fmt_bytes(u.used_bytes as f64),
            plural(u.object_count as usize, "object", "objects"),
            fmt_bytes(u.writing_bytes as f64),
        ));
        out.push_str(&format!(
            "  spilled:      {} ({})\n",
            fmt_bytes(u.spilled_bytes as f64),
            plural(u.spilled_count as usize, "object", "objects"),
        ));
        out.push_str(&format!("  pinned:       {}\n", fmt_bytes(u.pinned_bytes as f64)));
        out.push_str(&format!(
            "  reusable:     {} (freed objects' pages kept for the next writes)\n",
            fmt_bytes(u.pooled_bytes as f64)
        ));
        let spill = if u.spill_dir.is_empty() { "(none)" } else { u.spill_dir.as_str() };
        out.push_str(&format!("  folders:      {} (spill: {spill})\n", u.store_dir));
        if u.objects.is_empty() {
            continue;
        }
        out.push_str("  largest objects:\n");
        let rows: Vec<[String; 4]> = u
            .objects
            .iter()
            .map(|o| {
                [
                    o.object_id.clone(),
                    fmt_bytes(o.size as f64),
                    location_name(o).to_string()
                        + if o.pinned { ", pinned" } else { "" }
                        + if o.secondary { ", secondary" } else { "" },
                    if o.owner.is_empty() { "-".into() } else { o.owner.clone() },
                ]
            })
            .collect();
        let header = ["OBJECT_ID", "SIZE", "LOCATION", "OWNER"];
        let widths: Vec<usize> = (0..4)
            .map(|i| rows.iter().map(|r| r[i].len()).max().unwrap_or(0).max(header[i].len()))
            .collect();
        for r in std::iter::once(header.map(String::from)).chain(rows) {
            let cells: Vec<String> =
                (0..4).map(|i| format!("{:<w$}", r[i], w = widths[i])).collect();
            out.push_str(&format!("    {}\n", cells.join("  ").trim_end()));
        }
    }
    out
}

fn node_row(n: &pb::NodeInfo) -> serde_json::Value {
    json!({
        "node_id": n.node_id,
        "state": node_state(n),
        "address": n.address,
        "hostname": n.hostname,
        "is_head_node": n.is_head_node,
        "accelerator_type": node_accelerator_type(n),
        "tpu_slice_name": tpu_label(n, "tpu-slice-name").unwrap_or(""),
        "tpu_worker_id": tpu_label(n, "tpu-worker-id").unwrap_or(""),
        "resources_total": n.total.iter().collect::<BTreeMap<_, _>>(),
        "resources_available": n.available.iter().collect::<BTreeMap<_, _>>(),
        "labels": n.labels.iter().collect::<BTreeMap<_, _>>(),
        "num_workers": n.num_workers,
        "death_reason": n.death_reason,
        "pid": n.pid,
    })
}

fn print_table(rows: &[serde_json::Value], kind: ListKind) {
    print!("{}", render_table(rows, kind));
}

/// The table form of `list` rows: a header of upper-cased column names, then one line
/// per row, columns padded to their widest cell; `(none)` when there is no row.
fn render_table(rows: &[serde_json::Value], kind: ListKind) -> String {
    let cols: &[&str] = match kind {
        ListKind::Nodes => &[
            "node_id",
            "state",
            "address",
            "is_head_node",
            "num_workers",
            "accelerator_type",
            "tpu_slice_name",
            "tpu_worker_id",
        ],
        ListKind::Actors => {
            &["actor_id", "class_name", "name", "state", "node_id", "pid", "num_restarts"]
        }
        ListKind::Jobs => &["job_id", "state", "driver_pid", "entrypoint"],
        ListKind::Tasks => &["task_id", "name", "state", "attempt", "node_id", "error"],
        ListKind::PlacementGroups => {
            &["placement_group_id", "name", "state", "strategy", "num_bundles", "pending_reason"]
        }
        ListKind::Objects => &["object_id", "size", "node_id", "location", "owner"],
    };
    // A multi-line value (a `python -c` entrypoint) stays on its row.
    let cell = |r: &serde_json::Value, c: &str| match &r[c] {
        serde_json::Value::String(s) => s.replace('\n', "\\n"),
        v => v.to_string(),
    };
    let widths: Vec<usize> = cols
        .iter()
        .map(|c| rows.iter().map(|r| cell(r, c).len()).max().unwrap_or(0).max(c.len()))
        .collect();
    let mut out = String::new();
    let mut line = |vals: Vec<String>| {
        let parts: Vec<String> =
            vals.iter().zip(&widths).map(|(v, w)| format!("{v:<w$}", w = *w)).collect();
        out.push_str(parts.join("  ").trim_end());
        out.push('\n');
    };
    line(cols.iter().map(|c| c.to_uppercase()).collect());
    for r in rows {
        line(cols.iter().map(|c| cell(r, c)).collect());
    }
    if rows.is_empty() {
        out.push_str("(none)\n");
    }
    out
}

#[cfg(test)]
mod tests {
    use std::collections::HashMap;

    use super::*;

    /// A 32-hex-digit id whose first 8 characters are `short`.
    fn id(short: &str) -> String {
        format!("{short:0<32}")
    }

    fn node(short: &str, address: &str, tpu: Option<(f64, f64)>) -> pb::NodeInfo {
        let mut total = HashMap::from([("CPU".to_string(), 8.0)]);
        let mut available = total.clone();
        if let Some((t, a)) = tpu {
            total.insert("TPU".into(), t);
            available.insert("TPU".into(), a);
        }
        pb::NodeInfo {
            node_id: id(short),
            address: address.into(),
            hostname: format!("host-{short}"),
            total,
            available,
            state: pb::NodeState::Alive as i32,
            ..Default::default()
        }
    }

    /// A host of a slice, labelled as the node agent labels it (TPU.md, both prefixes).
    fn tpu_host(
        short: &str,
        address: &str,
        pod_type: &str,
        topology: &str,
        slice: Option<&str>,
        worker: Option<u32>,
        chips: (f64, f64),
    ) -> pb::NodeInfo {
        let mut n = node(short, address, Some(chips));
        let mut values = vec![
            ("accelerator-type", "TPU-V6E".to_string()),
            ("tpu-topology", topology.to_string()),
            ("tpu-pod-type", pod_type.to_string()),
        ];
        if let Some(s) = slice {
            values.push(("tpu-slice-name", s.to_string()));
        }
        if let Some(w) = worker {
            values.push(("tpu-worker-id", w.to_string()));
        }
        for (k, v) in values {
            n.labels.insert(format!("tpuray.io/{k}"), v.clone());
            n.labels.insert(format!("ray.io/{k}"), v);
        }
        n
    }

    /// Commits one bundle of group `pg` with `chips` TPU chips on `n`, as the node agent
    /// does: the plain chips leave `available`, the renamed ones join total and available.
    fn hold(n: &mut pb::NodeInfo, pg: &str, index: u32, chips: f64) {
        *n.available.get_mut("TPU").unwrap() -= chips;
        for name in [format!("TPU_group_{index}_{pg}"), format!("TPU_group_{pg}")] {
            *n.total.entry(name.clone()).or_default() += chips;
            *n.available.entry(name).or_default() += chips;
        }
    }

    fn group(pg: &str, name: &str, nodes: &[&pb::NodeInfo]) -> pb::PlacementGroupInfo {
        pb::PlacementGroupInfo {
            placement_group_id: pg.into(),
            name: name.into(),
            state: pb::PlacementGroupState::Created as i32,
            bundle_node_ids: nodes.iter().map(|n| n.node_id.clone()).collect(),
            ..Default::default()
        }
    }

    /// Two v6e-16 slices of 4 hosts (`sa` held whole by gang `train` generation 2, `sb`
    /// with one chip used by a plain task), one v6e-8 host without a slice name holding 2
    /// chips for group `eval`, one CPU node; nodes arrive out of order.
    fn cluster() -> (Vec<pb::NodeInfo>, Vec<pb::PlacementGroupInfo>) {
        let gang = id("9a9a9a9a");
        let eval = id("e7e7e7e7");
        let mut sa: Vec<pb::NodeInfo> = (0..4)
            .map(|w| {
                let addr = format!("10.0.0.{}:7001", w + 1);
                tpu_host(
                    &format!("a{w}a{w}a{w}a{w}"),
                    &addr,
                    "v6e-16",
                    "4x4",
                    Some("sa"),
                    Some(w),
                    (4.0, 4.0),
                )
            })
            .collect();
        for (i, n) in sa.iter_mut().enumerate() {
            hold(n, &gang, i as u32, 4.0);
        }
        let sb: Vec<pb::NodeInfo> = (0..4)
            .map(|w| {
                let addr = format!("10.0.1.{}:7001", w + 1);
                let avail = if w == 1 { 3.0 } else { 4.0 };
                tpu_host(
                    &format!("b{w}b{w}b{w}b{w}"),
                    &addr,
                    "v6e-16",
                    "4x4",
                    Some("sb"),
                    Some(w),
                    (4.0, avail),
                )
            })
            .collect();
        let mut v8 = tpu_host("c8c8c8c8", "10.0.2.1:7001", "v6e-8", "2x4", None, None, (8.0, 8.0));
        hold(&mut v8, &eval, 0, 2.0);
        let cpu = node("d0d0d0d0", "10.0.3.1:7001", None);
        let groups = vec![
            group(&gang, "gang:train:2", &sa.iter().collect::<Vec<_>>()),
            group(&eval, "eval", &[&v8]),
        ];
        let mut nodes = vec![cpu, v8];
        nodes.extend(sb.into_iter().rev());
        nodes.extend(sa.into_iter().rev());
        (nodes, groups)
    }

    #[test]
    fn status_draws_each_slice_as_its_hosts_in_worker_order() {
        let (nodes, groups) = cluster();
        let drawn = render_tpu_slices(&nodes, &groups);
        let expected = [
            "TPU slices (3 slices, 9 hosts)",
            " slice sa: v6e-16, topology 4x4, 4 hosts",
            "  worker 0  10.0.0.1:7001  node a0a0a0a0  4 used, 0 free  [####]      gang train (gen 2): 4 chips",
            "  worker 1  10.0.0.2:7001  node a1a1a1a1  4 used, 0 free  [####]      gang train (gen 2): 4 chips",
            "  worker 2  10.0.0.3:7001  node a2a2a2a2  4 used, 0 free  [####]      gang train (gen 2): 4 chips",
            "  worker 3  10.0.0.4:7001  node a3a3a3a3  4 used, 0 free  [####]      gang train (gen 2): 4 chips",
            " slice sb: v6e-16, topology 4x4, 4 hosts",
            "  worker 0  10.0.1.1:7001  node b0b0b0b0  0 used, 4 free  [....]",
            "  worker 1  10.0.1.2:7001  node b1b1b1b1  1 used, 3 free  [#...]",
            "  worker 2  10.0.1.3:7001  node b2b2b2b2  0 used, 4 free  [....]",
            "  worker 3  10.0.1.4:7001  node b3b3b3b3  0 used, 4 free  [....]",
            " host host-c8c8c8c8 (no slice name): v6e-8, topology 2x4, 1 host",
            "  worker -  10.0.2.1:7001  node c8c8c8c8  2 used, 6 free  [##......]  eval: 2 chips",
        ];
        assert_eq!(drawn.lines().collect::<Vec<_>>(), expected, "\n{drawn}");
        assert!(drawn.ends_with('\n'));
    }

    #[test]
    fn a_slice_with_a_dead_host_says_how_many_of_its_hosts_are_alive() {
        let (mut nodes, groups) = cluster();
        let sb2 = nodes.iter_mut().find(|n| n.node_id == id("b2b2b2b2")).unwrap();
        sb2.state = pb::NodeState::Dead as i32;
        let drawn = render_tpu_slices(&nodes, &groups);
        assert!(drawn.contains(" slice sb: v6e-16, topology 4x4, 3 of 4 hosts\n"), "{drawn}");
        assert!(!drawn.contains("b2b2b2b2"), "{drawn}");
        assert!(drawn.starts_with("TPU slices (3 slices, 8 hosts)\n"), "{drawn}");
    }

    #[test]
    fn two_hosts_claiming_one_worker_id_are_flagged() {
        let (mut nodes, groups) = cluster();
        let sb3 = nodes.iter_mut().find(|n| n.node_id == id("b3b3b3b3")).unwrap();
        sb3.labels.insert("tpuray.io/tpu-worker-id".into(), "2".into());
        let drawn = render_tpu_slices(&nodes, &groups);
        assert_eq!(drawn.matches("worker 2!").count(), 2, "{drawn}");
        assert!(drawn.contains("(! two alive hosts of one slice claim the same worker id)"));
    }

    #[test]
    fn removed_groups_are_not_shown_and_pending_ones_say_so() {
        let (nodes, mut groups) = cluster();
        groups[0].state = pb::PlacementGroupState::Removed as i32;
        groups[1].state = pb::PlacementGroupState::Rescheduling as i32;
        let drawn = render_tpu_slices(&nodes, &groups);
        assert!(!drawn.contains("gang train"), "{drawn}");
        assert!(drawn.contains("eval: 2 chips (rescheduling)"), "{drawn}");
    }

    #[test]
    fn ray_prefixed_labels_are_read_when_tpuray_ones_are_absent() {
        let mut n = tpu_host("a0a0a0a0", "h:1", "v6e-16", "4x4", Some("sa"), Some(0), (4.0, 4.0));
        n.labels.retain(|k, _| k.starts_with("ray.io/"));
        let drawn = render_tpu_slices(&[n], &[]);
        assert!(drawn.contains(" slice sa: v6e-16, topology 4x4, 1 of 4 hosts\n"), "{drawn}");
    }

    #[test]
    fn a_cluster_without_tpu_hosts_draws_no_slice_section() {
        let nodes = vec![node("d0d0d0d0", "10.0.3.1:7001", None)];
        assert_eq!(render_tpu_slices(&nodes, &[]), "");
    }

    #[test]
    fn chip_bars_have_one_cell_per_chip_up_to_sixteen() {
        assert_eq!(chip_bar(0, 4), "[....]");
        assert_eq!(chip_bar(2, 8), "[##......]");
        assert_eq!(chip_bar(4, 4), "[####]");
        assert_eq!(chip_bar(1, 64), "[#...............]");
        assert_eq!(chip_bar(64, 64), "[################]");
    }

    #[test]
    fn list_nodes_shows_accelerator_type_slice_and_worker_id() {
        let (nodes, _) = cluster();
        let rows: Vec<serde_json::Value> = nodes.iter().map(node_row).collect();
        let table = render_table(&rows, ListKind::Nodes);
        let lines: Vec<&str> = table.lines().collect();
        assert_eq!(
            lines[0],
            "NODE_ID                           STATE  ADDRESS        IS_HEAD_NODE  NUM_WORKERS  \
             ACCELERATOR_TYPE  TPU_SLICE_NAME  TPU_WORKER_ID"
        );
        assert_eq!(
            lines[1],
            "d0d0d0d0000000000000000000000000  ALIVE  10.0.3.1:7001  false         0"
        );
        assert_eq!(
            lines[2],
            "c8c8c8c8000000000000000000000000  ALIVE  10.0.2.1:7001  false         0            v6e-8"
        );
        assert_eq!(
            lines[3],
            "b3b3b3b3000000000000000000000000  ALIVE  10.0.1.4:7001  false         0            \
             v6e-16            sb              3"
        );
        assert_eq!(lines.len(), 11, "\n{table}");
        let sa2 = rows.iter().find(|r| r["node_id"] == id("a2a2a2a2")).unwrap();
        assert_eq!(sa2["accelerator_type"], "v6e-16");
        assert_eq!(sa2["tpu_slice_name"], "sa");
        assert_eq!(sa2["tpu_worker_id"], "2");
        let cpu = rows.iter().find(|r| r["node_id"] == id("d0d0d0d0")).unwrap();
        assert_eq!(cpu["accelerator_type"], "");
        assert_eq!(cpu["tpu_slice_name"], "");
        assert_eq!(cpu["tpu_worker_id"], "");
    }
}
