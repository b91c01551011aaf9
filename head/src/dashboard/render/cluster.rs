//! The cluster pages: the overview, the nodes and one node (with its store and the
//! TPU slices drawn).

use super::*;

/// Tasks read from the head: the newest ones, and whether there may be more.
pub(crate) struct TasksRead {
    pub tasks: Vec<pb::TaskSummary>,
    /// The read hit its limit: counts cover the newest `tasks.len()` only.
    pub truncated: bool,
    pub dropped: u64,
}

pub(super) fn count_by<T>(items: &[T], key: impl Fn(&T) -> String) -> BTreeMap<String, usize> {
    let mut m = BTreeMap::new();
    for i in items {
        *m.entry(key(i)).or_default() += 1;
    }
    m
}

pub(super) fn counts_line(counts: &BTreeMap<String, usize>) -> String {
    if counts.is_empty() {
        return "none".into();
    }
    counts.iter().map(|(s, n)| format!("{n} {}", badge(s))).collect::<Vec<_>>().join(" ")
}

/// Cluster-wide usage of every shown resource (alive nodes).
pub(super) fn resources_table(st: &pb::GetClusterStatusReply) -> String {
    let total: BTreeMap<&String, &f64> =
        st.total.iter().filter(|(k, _)| shown_resource(k)).collect();
    let rows: Vec<String> = total
        .iter()
        .map(|(name, t)| {
            let avail = st.available.get(*name).copied().unwrap_or(0.0);
            tr(&[esc(name), bar(name, (**t - avail).max(0.0), **t)])
        })
        .collect();
    table(&["resource", "used / total"], &rows, "no resources")
}

pub(super) fn demand_list(st: &pb::GetClusterStatusReply) -> String {
    let mut out = String::new();
    if st.pending.is_empty() && st.infeasible.is_empty() {
        return "<p>No pending or infeasible demand.</p>".into();
    }
    out.push_str("<ul class=\"demand\">");
    for d in &st.pending {
        let _ = write!(
            out,
            "<li>{} {}× pending{}</li>",
            esc(&shape(&d.shape)),
            d.count.max(1),
            if d.reason.is_empty() { String::new() } else { format!(" — {}", esc(&d.reason)) }
        );
    }
    for d in &st.infeasible {
        let _ = write!(
            out,
            "<li>{} {}× {} — {}</li>",
            esc(&shape(&d.shape)),
            d.count.max(1),
            badge("INFEASIBLE"),
            esc(&d.reason)
        );
    }
    out.push_str("</ul>");
    out
}

/// The overview: counts of everything, cluster usage, every node by id and address, the
/// TPU slices drawn small, and demand.
#[allow(clippy::too_many_arguments)]
pub(crate) fn overview(
    st: &pb::GetClusterStatusReply,
    actors: Result<&[pb::ActorInfo], &str>,
    tasks: Result<&TasksRead, &str>,
    subs: Result<&[pb::JobSubmission], &str>,
    drivers: Result<&[pb::JobInfo], &str>,
    groups: Result<&[pb::PlacementGroupInfo], &str>,
    workers: &HashMap<String, Result<Vec<pb::WorkerInfo>, String>>,
    now_ms: u64,
) -> String {
    let mut out = String::new();
    let alive = st.nodes.iter().filter(|n| n.state == pb::NodeState::Alive as i32).count();
    let _ = write!(
        out,
        "<p class=\"meta\">cluster <code>{}</code> · head up since {} ({})</p>",
        esc(&st.cluster_id),
        esc(&time(st.head_start_time_ms)),
        esc(&ago(st.head_start_time_ms, now_ms))
    );
    out.push_str("<div class=\"cards\">");
    let card = |out: &mut String, href: &str, title: &str, body: String| {
        let _ = write!(
            out,
            "<a class=\"card\" href=\"{href}\"><span class=\"title\">{title}</span>{body}</a>"
        );
    };
    card(
        &mut out,
        "/nodes",
        "Nodes",
        format!("<span class=\"num\">{alive}</span> alive, {} dead", st.nodes.len() - alive),
    );
    let tpu_hosts = slices::slices(&st.nodes, groups.unwrap_or_default());
    card(
        &mut out,
        "/slices",
        "TPU slices",
        format!(
            "<span class=\"num\">{}</span> {}",
            tpu_hosts.len(),
            esc(&slices::plural(tpu_hosts.iter().map(|s| s.hosts.len()).sum(), "host", "hosts"))
        ),
    );
    let body = |r: Result<BTreeMap<String, usize>, &str>| match r {
        Ok(c) => {
            format!("<span class=\"num\">{}</span> {}", c.values().sum::<usize>(), counts_line(&c))
        }
        Err(e) => format!("<span class=\"bad\">unavailable: {}</span>", esc(e)),
    };
    card(
        &mut out,
        "/actors",
        "Actors",
        body(actors.map(|a| count_by(a, |a| actor_state(a.state)))),
    );
    let task_body = match tasks {
        Ok(t) => {
            let mut b = body(Ok(count_by(&t.tasks, |t| t.state.clone())));
            if t.truncated {
                b.push_str(" <small>(newest tasks only)</small>");
            }
            b
        }
        Err(e) => body(Err(e)),
    };
    card(&mut out, "/tasks", "Tasks", task_body);
    let jobs = match (subs, drivers) {
        (Ok(s), Ok(d)) => {
            let mut c = count_by(s, |s| s.status.clone());
            for j in d.iter().filter(|j| j.submission_id.is_empty()) {
                *c.entry(format!("DRIVER {}", job_state(j.state))).or_default() += 1;
            }
            Ok(c)
        }
        (Err(e), _) | (_, Err(e)) => Err(e),
    };
    card(&mut out, "/jobs", "Jobs", body(jobs));
    card(
        &mut out,
        "/placement-groups",
        "Placement groups",
        body(groups.map(|g| count_by(g, |g| group_state(g.state)))),
    );
    out.push_str("</div>");

    out.push_str("<section><h2>Nodes</h2>");
    let rows: Vec<String> = st
        .nodes
        .iter()
        .map(|n| {
            let mut res = String::new();
            for r in ["CPU", "GPU", "TPU"] {
                if let Some(t) = n.total.get(r).filter(|t| **t > 0.0) {
                    let a = n.available.get(r).copied().unwrap_or(0.0);
                    let _ = write!(res, "<div>{r} {}</div>", bar(r, (t - a).max(0.0), *t));
                }
            }
            tr(&[
                format!(
                    "<a href=\"/nodes/{}\"><code>{}</code></a>",
                    enc(&n.node_id),
                    esc(&n.node_id)
                ),
                esc(&n.address),
                badge(node_state(n)),
                if n.is_head_node { "head".into() } else { String::new() },
                esc(slices::node_accelerator_type(n)),
                res,
            ])
        })
        .collect();
    out.push_str(&table(
        &["node id", "address", "state", "", "accelerator", "usage"],
        &rows,
        "no node has joined",
    ));
    out.push_str("</section>");

    if !tpu_hosts.is_empty() {
        out.push_str("<section><h2>TPU slices</h2>");
        out.push_str(&slices_drawing(&tpu_hosts, workers, actors.unwrap_or_default(), true));
        out.push_str("</section>");
    }
    out.push_str("<section class=\"two\"><div><h2>Cluster resources</h2>");
    out.push_str(&resources_table(st));
    out.push_str("</div><div><h2>Demand</h2>");
    out.push_str(&demand_list(st));
    out.push_str("</div></section>");
    out
}

/// Every node with its resources (used / total), workers, TPU labels and heartbeat.
pub(crate) fn nodes(st: &pb::GetClusterStatusReply, now_ms: u64) -> String {
    let rows: Vec<String> = st
        .nodes
        .iter()
        .map(|n| {
            let names: BTreeMap<&String, &f64> =
                n.total.iter().filter(|(k, _)| shown_resource(k)).collect();
            let mut res = String::new();
            for (name, t) in names {
                let a = n.available.get(name).copied().unwrap_or(0.0);
                let _ = write!(
                    res,
                    "<div class=\"res\"><span>{}</span> {}</div>",
                    esc(name),
                    bar(name, (t - a).max(0.0), *t)
                );
            }
            let tpu = match tpu_label(n, "tpu-slice-name") {
                Some(s) => format!(
                    "{} · slice <b>{}</b> · worker {}",
                    esc(slices::node_accelerator_type(n)),
                    esc(s),
                    esc(tpu_label(n, "tpu-worker-id").unwrap_or("-"))
                ),
                None => esc(slices::node_accelerator_type(n)),
            };
            let state = if n.death_reason.is_empty() {
                badge(node_state(n))
            } else {
                format!("{}<div class=\"why\">{}</div>", badge(node_state(n)), esc(&n.death_reason))
            };
            tr(&[
                format!(
                    "<a href=\"/nodes/{}\"><code>{}</code></a>{}",
                    enc(&n.node_id),
                    esc(&n.node_id),
                    if n.is_head_node { " <span class=\"badge plain\">head</span>" } else { "" }
                ),
                format!("{}<div class=\"addr\">{}</div>", esc(&n.address), esc(&n.hostname)),
                state,
                n.num_workers.to_string(),
                tpu,
                res,
                esc(&ago(n.last_heartbeat_ms, now_ms)),
            ])
        })
        .collect();
    table(
        &["node id", "address", "state", "workers", "TPU", "resources (used / total)", "heartbeat"],
        &rows,
        "no node has joined",
    )
}

/// One node: everything the head knows, its labels, its workers (the agent's
/// `ListWorkers`) and its object store (`GetStoreUsage`).
pub(crate) fn node(
    n: &pb::NodeInfo,
    workers: Result<&[pb::WorkerInfo], &str>,
    store: Result<&pb::GetStoreUsageReply, &str>,
    actors: &[pb::ActorInfo],
    now_ms: u64,
) -> String {
    let mut out = String::new();
    let facts = [
        ("node id", format!("<code>{}</code>", esc(&n.node_id))),
        ("address", esc(&n.address)),
        ("hostname", esc(&n.hostname)),
        ("state", badge(node_state(n))),
        ("head node", if n.is_head_node { "yes".into() } else { "no".into() }),
        ("started", esc(&time(n.start_time_ms))),
        ("last heartbeat", esc(&ago(n.last_heartbeat_ms, now_ms))),
        ("agent pid", n.pid.to_string()),
        ("session", format!("<code>{}</code>", esc(&n.session_dir))),
        ("object store", format!("<code>{}</code>", esc(&n.object_store_dir))),
        ("death reason", esc(&n.death_reason)),
    ];
    out.push_str("<table class=\"facts\">");
    for (k, v) in facts {
        let _ = write!(out, "<tr><th>{k}</th><td>{v}</td></tr>");
    }
    out.push_str("</table>");
    out.push_str("<section class=\"two\"><div><h2>Resources</h2>");
    let names: BTreeMap<&String, &f64> = n.total.iter().collect();
    let rows: Vec<String> = names
        .iter()
        .map(|(name, t)| {
            let a = n.available.get(*name).copied().unwrap_or(0.0);
            tr(&[format!("<code>{}</code>", esc(name)), bar(name, (**t - a).max(0.0), **t)])
        })
        .collect();
    out.push_str(&table(&["resource", "used / total"], &rows, "none"));
    out.push_str("</div><div><h2>Labels</h2>");
    let labels: BTreeMap<&String, &String> = n.labels.iter().collect();
    let rows: Vec<String> =
        labels.iter().map(|(k, v)| tr(&[format!("<code>{}</code>", esc(k)), esc(v)])).collect();
    out.push_str(&table(&["label", "value"], &rows, "none"));
    out.push_str("</div></section>");
    if !n.pending.is_empty() {
        out.push_str("<h2>Waiting on this node</h2><ul class=\"demand\">");
        for d in &n.pending {
            let _ = write!(out, "<li>{} {}×</li>", esc(&shape(&d.shape)), d.count.max(1));
        }
        out.push_str("</ul>");
    }
    out.push_str("<h2>Worker processes</h2>");
    let class_of: HashMap<&str, &pb::ActorInfo> =
        actors.iter().map(|a| (a.actor_id.as_str(), a)).collect();
    match workers {
        Ok(ws) => {
            let mut ws: Vec<&pb::WorkerInfo> = ws.iter().collect();
            ws.sort_by_key(|w| (w.state.clone(), w.pid));
            let rows: Vec<String> = ws
                .iter()
                .map(|w| {
                    let key = w.key.clone().unwrap_or_default();
                    let actor = match class_of.get(w.actor_id.as_str()) {
                        Some(a) => format!(
                            "{} <code>{}</code>",
                            esc(&a.class_name),
                            esc(short_id(&a.actor_id))
                        ),
                        None => esc(short_id(&w.actor_id)),
                    };
                    let chips: Vec<String> = key.tpu_chips.iter().map(u32::to_string).collect();
                    let res: HashMap<String, f64> = w.resources.clone();
                    tr(&[
                        format!("<code>{}</code>", esc(&w.worker_id)),
                        w.pid.to_string(),
                        badge(&w.state),
                        esc(&key.language),
                        format!("<code>{}</code>", esc(short_id(&key.job_id))),
                        actor,
                        esc(&chips.join(",")),
                        esc(&if res.is_empty() { String::new() } else { shape(&res) }),
                    ])
                })
                .collect();
            out.push_str(&table(
                &[
                    "worker id",
                    "pid",
                    "state",
                    "language",
                    "job",
                    "actor",
                    "TPU chips",
                    "resources",
                ],
                &rows,
                "no worker process",
            ));
        }
        Err(e) => out.push_str(&error_box("the node agent did not list its workers", e)),
    }
    out.push_str("<h2>Object store</h2>");
    match store {
        Ok(u) => {
            let cap = u.capacity_bytes.map(|c| fmt_bytes(c as f64)).unwrap_or("unlimited".into());
            let _ = write!(
                out,
                "<p>{} used of {} in {} objects; {} spilled ({} objects); {} pinned; {} reusable.</p>",
                esc(&fmt_bytes(u.used_bytes as f64)),
                esc(&cap),
                u.object_count,
                esc(&fmt_bytes(u.spilled_bytes as f64)),
                u.spilled_count,
                esc(&fmt_bytes(u.pinned_bytes as f64)),
                esc(&fmt_bytes(u.pooled_bytes as f64)),
            );
            let rows: Vec<String> = u
                .objects
                .iter()
                .map(|o| {
                    tr(&[
                        format!("<code>{}</code>", esc(&o.object_id)),
                        esc(&fmt_bytes(o.size as f64)),
                        esc(&o.owner),
                    ])
                })
                .collect();
            out.push_str(&table(&["largest objects", "size", "owner"], &rows, "no object"));
        }
        Err(e) => out.push_str(&error_box("the node's object store did not answer", e)),
    }
    out
}

/// A stable hue for a placement group (its chips and its name share a color).
pub(super) fn hue(pg: &str) -> u32 {
    pg.bytes().fold(2166136261u32, |h, b| (h ^ u32::from(b)).wrapping_mul(16777619)) % 360
}

/// The TPU slices drawn host by host: each slice a box with its heading; its hosts laid on
/// the slice's host grid (worker 0 top left, x fastest), each host with its worker id,
/// address, node id, the groups holding it, and every chip as a cell with its index, state
/// and the gang (generation) or group on it (`slices::host_chips`, SLICE-1). `workers`
/// holds each TPU host's `ListWorkers` answer by node id (missing: not asked; `Err`: the
/// agent did not answer, and chips are drawn from the head's counts). `compact` leaves the
/// per-chip text out (the overview).
pub(crate) fn slices_drawing(
    views: &[slices::Slice<'_>],
    workers: &HashMap<String, Result<Vec<pb::WorkerInfo>, String>>,
    actors: &[pb::ActorInfo],
    compact: bool,
) -> String {
    let actor_of: HashMap<&str, &pb::ActorInfo> =
        actors.iter().map(|a| (a.actor_id.as_str(), a)).collect();
    let mut out = String::new();
    for v in views {
        let grid_cols = v
            .hosts
            .iter()
            .filter_map(|h| h.worker_id?.parse::<u32>().ok())
            .filter_map(|w| slices::host_grid_position(&v.topology, w))
            .map(|(x, _)| x + 1)
            .max()
            .unwrap_or(1)
            .max(1);
        let _ = write!(
            out,
            "<div class=\"slice\" data-slice=\"{}\"><h3>{}</h3><div class=\"hosts\" style=\"grid-template-columns:repeat({grid_cols},minmax(15em,24em))\">",
            esc(v.name.unwrap_or("")),
            esc(&v.heading)
        );
        for h in &v.hosts {
            let pos = h
                .worker_id
                .and_then(|w| w.parse::<u32>().ok())
                .filter(|_| !h.duplicate_worker_id)
                .and_then(|w| slices::host_grid_position(&v.topology, w));
            let place = match pos {
                Some((x, y)) => format!(" style=\"grid-column:{};grid-row:{}\"", x + 1, y + 1),
                None => String::new(),
            };
            let known = workers.get(&h.node.node_id);
            let list = match known {
                Some(Ok(ws)) => Some(ws.as_slice()),
                _ => None,
            };
            let chips = slices::host_chips(h, list);
            let worker = match h.worker_id {
                Some(w) if h.duplicate_worker_id => format!("worker {}!", esc(w)),
                Some(w) => format!("worker {}", esc(w)),
                None => "worker -".into(),
            };
            let _ = write!(
                out,
                "<div class=\"host\"{place} data-node=\"{}\"><div class=\"hosthead\"><b>{worker}</b> \
                 <a href=\"/nodes/{}\"><code>{}</code></a> <span class=\"addr\">{}</span></div>\
                 <div class=\"hostsub\">{} used, {} free</div>",
                esc(&h.node.node_id),
                enc(&h.node.node_id),
                esc(short_id(&h.node.node_id)),
                esc(&h.node.address),
                h.used,
                h.chips - h.used,
            );
            let cols = if h.chips <= 1 { 1 } else { 2 };
            let _ = write!(
                out,
                "<div class=\"chips\" style=\"grid-template-columns:repeat({cols},1fr)\">"
            );
            let holder_name = |pg: &str| {
                h.holders
                    .iter()
                    .find(|g| g.placement_group_id == pg)
                    .map(|g| g.display.clone())
                    .unwrap_or_else(|| format!("group {}", short_id(pg)))
            };
            for c in &chips {
                let group = c.placement_group_id.as_deref().map(holder_name);
                let mut title = format!("chip {}: {}", c.index, c.state.word());
                if let Some(g) = &group {
                    title.push_str(&format!(" — {g}"));
                }
                let mut detail = String::new();
                if let Some(w) = &c.worker {
                    let what = match actor_of.get(w.actor_id.as_str()) {
                        Some(a) => format!("actor {} {}", a.class_name, short_id(&a.actor_id)),
                        None if !w.actor_id.is_empty() => {
                            format!("actor {}", short_id(&w.actor_id))
                        }
                        None => w.state.to_lowercase(),
                    };
                    title.push_str(&format!(
                        " — worker {} pid {} ({what})",
                        short_id(&w.worker_id),
                        w.pid
                    ));
                    detail = format!("pid {}", w.pid);
                }
                let style = match &c.placement_group_id {
                    Some(pg) => format!(" style=\"--g:{}\"", hue(pg)),
                    None => String::new(),
                };
                let grouped = if c.placement_group_id.is_some() { " grouped" } else { "" };
                let _ = write!(
                    out,
                    "<div class=\"chip {}{grouped}\"{style} title=\"{}\" data-chip=\"{}\" data-state=\"{}\"><span class=\"ix\">chip {}</span>",
                    c.state.word(),
                    esc(&title),
                    c.index,
                    c.state.word(),
                    c.index,
                );
                if !compact {
                    let _ = write!(
                        out,
                        "<span class=\"st\">{}</span><span class=\"gang\">{}</span><span class=\"pid\">{}</span>",
                        c.state.word(),
                        esc(group.as_deref().unwrap_or("")),
                        esc(&detail)
                    );
                }
                out.push_str("</div>");
            }
            out.push_str("</div>");
            {
                if !h.holders.is_empty() {
                    out.push_str("<ul class=\"holders\">");
                    for g in &h.holders {
                        let state = g
                            .state
                            .as_deref()
                            .map(|s| format!(" ({})", esc(s)))
                            .unwrap_or_default();
                        let _ = write!(
                            out,
                            "<li style=\"--g:{}\"><span class=\"swatch\"></span>{}: {}{state}</li>",
                            hue(&g.placement_group_id),
                            esc(&g.display),
                            esc(&slices::plural(g.chips as usize, "chip", "chips")),
                        );
                    }
                    out.push_str("</ul>");
                }
                match known {
                    Some(Err(e)) if !compact => {
                        let _ = write!(
                            out,
                            "<div class=\"why\">chip indices unknown (the agent did not list its workers: {}); counts from the head</div>",
                            esc(e)
                        );
                    }
                    _ => {}
                }
            }
            out.push_str("</div>");
        }
        out.push_str("</div></div>");
    }
    if views.iter().flat_map(|v| &v.hosts).any(|h| h.duplicate_worker_id) {
        out.push_str(
            "<p class=\"bad\">! two alive hosts of one slice claim the same worker id</p>",
        );
    }
    out
}

/// The slices page: the drawing plus its legend.
pub(crate) fn slices_page(
    nodes: &[pb::NodeInfo],
    groups: &[pb::PlacementGroupInfo],
    workers: &HashMap<String, Result<Vec<pb::WorkerInfo>, String>>,
    actors: &[pb::ActorInfo],
) -> String {
    let views = slices::slices(nodes, groups);
    if views.is_empty() {
        return "<p>No TPU host has joined this cluster. A TPU host is a node agent started with \
                the <code>TPU_*</code> environment and <code>--resources '{\"TPU\": N}'</code> \
                (TPU.md).</p>"
            .into();
    }
    let mut out = String::from(
        "<p class=\"legend\">Hosts sit on the slice's host grid (worker 0 top left). Chips: \
         <span class=\"chip busy\">busy</span> a worker process holds it for a task or actor · \
         <span class=\"chip idle\">idle</span> an idle worker still holds it · \
         <span class=\"chip reserved\">reserved</span> a placement group's bundle reserves it, no process yet \
         (its index is picked when one starts) · \
         <span class=\"chip used\">used</span> taken, no listed process · \
         <span class=\"chip free\">free</span>. A colored edge names the gang or group.</p>",
    );
    out.push_str(&slices_drawing(&views, workers, actors, false));
    out
}
