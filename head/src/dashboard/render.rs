//! The dashboard's HTML, rendered on the server from proto messages: pure functions, no
//! I/O, unit-tested below. DASH-2: every value that comes from the cluster (ids, names,
//! addresses, errors, logs, labels) goes into the page through [`esc`] (text and
//! attributes) or [`enc`] (URL components); nothing else is interpolated but numbers and
//! this file's own constants.

use std::collections::{BTreeMap, HashMap};
use std::fmt::Write as _;

use serde_json::Value;
use tpuray_proto::pb;

use crate::slices::{self, group_display, short_id, tpu_label};

/// HTML-escapes `s` for text and for double- or single-quoted attribute values.
pub(crate) fn esc(s: &str) -> String {
    let mut out = String::with_capacity(s.len());
    for c in s.chars() {
        match c {
            '&' => out.push_str("&amp;"),
            '<' => out.push_str("&lt;"),
            '>' => out.push_str("&gt;"),
            '"' => out.push_str("&quot;"),
            '\'' => out.push_str("&#39;"),
            c => out.push(c),
        }
    }
    out
}

/// Percent-encodes `s` as one URL component (everything but RFC 3986's unreserved
/// characters).
pub(crate) fn enc(s: &str) -> String {
    let mut out = String::with_capacity(s.len());
    for b in s.bytes() {
        if b.is_ascii_alphanumeric() || matches!(b, b'-' | b'_' | b'.' | b'~') {
            out.push(b as char);
        } else {
            let _ = write!(out, "%{b:02X}");
        }
    }
    out
}

/// Decodes one `application/x-www-form-urlencoded` component (`+` is a space, `%XX` a
/// byte); a malformed escape is kept as written, bytes that are not UTF-8 are replaced.
pub(crate) fn decode(s: &str) -> String {
    let b = s.as_bytes();
    let mut out = Vec::with_capacity(b.len());
    let mut i = 0;
    while i < b.len() {
        match b[i] {
            b'+' => out.push(b' '),
            b'%' if i + 2 < b.len() => {
                let hex = std::str::from_utf8(&b[i + 1..i + 3]).ok();
                match hex.and_then(|h| u8::from_str_radix(h, 16).ok()) {
                    Some(v) => {
                        out.push(v);
                        i += 2;
                    }
                    None => out.push(b'%'),
                }
            }
            c => out.push(c),
        }
        i += 1;
    }
    String::from_utf8_lossy(&out).into_owned()
}

/// The pairs of a query string or form body, decoded, in order.
pub(crate) fn parse_query(q: &str) -> Vec<(String, String)> {
    q.split('&')
        .filter(|kv| !kv.is_empty())
        .map(|kv| match kv.split_once('=') {
            Some((k, v)) => (decode(k), decode(v)),
            None => (decode(kv), String::new()),
        })
        .collect()
}

/// The first value of `key` in `pairs`.
pub(crate) fn param<'a>(pairs: &'a [(String, String)], key: &str) -> Option<&'a str> {
    pairs.iter().find(|(k, _)| k == key).map(|(_, v)| v.as_str())
}

pub(crate) use crate::timeline::utc;

/// Unix ms as `2026-11-01 12:00:05 UTC`; `-` for 0.
pub(crate) fn time(ms: u64) -> String {
    if ms == 0 {
        return "-".into();
    }
    let (y, m, d, h, mi, s) = utc(ms / 1000);
    // No-break spaces: a time never wraps in a table cell.
    format!("{y:04}-{m:02}-{d:02}\u{a0}{h:02}:{mi:02}:{s:02}\u{a0}UTC")
}

/// A duration in ms as `850 ms`, `12.3 s`, `4 min 2 s`, `3 h 20 min`.
pub(crate) fn duration(ms: u64) -> String {
    match ms {
        0..1_000 => format!("{ms}\u{a0}ms"),
        1_000..60_000 => format!("{:.1}\u{a0}s", ms as f64 / 1000.0),
        60_000..3_600_000 => format!("{}\u{a0}min {}\u{a0}s", ms / 60_000, ms % 60_000 / 1000),
        _ => format!("{}\u{a0}h {}\u{a0}min", ms / 3_600_000, ms % 3_600_000 / 60_000),
    }
}

/// How long ago `ms` was, seen at `now_ms`: `3.2 s ago`; `-` for 0.
pub(crate) fn ago(ms: u64, now_ms: u64) -> String {
    if ms == 0 { "-".into() } else { format!("{} ago", duration(now_ms.saturating_sub(ms))) }
}

fn fmt_bytes(v: f64) -> String {
    const UNITS: [&str; 5] = ["B", "KiB", "MiB", "GiB", "TiB"];
    let mut v = v;
    let mut i = 0;
    while v >= 1024.0 && i < UNITS.len() - 1 {
        v /= 1024.0;
        i += 1;
    }
    if i == 0 { format!("{v:.0} B") } else { format!("{v:.2} {}", UNITS[i]) }
}

/// A resource amount: bytes for memory resources, else the number (`4`, `0.5`).
pub(crate) fn amount(name: &str, v: f64) -> String {
    if name.contains("memory") {
        fmt_bytes(v)
    } else if v.fract() == 0.0 {
        format!("{v:.0}")
    } else {
        format!("{}", (v * 10_000.0).round() / 10_000.0)
    }
}

/// `{CPU: 1, TPU: 4}`, names sorted.
fn shape(m: &HashMap<String, f64>) -> String {
    let s: BTreeMap<_, _> = m.iter().collect();
    let parts: Vec<String> = s.iter().map(|(k, v)| format!("{k}: {}", amount(k, **v))).collect();
    format!("{{{}}}", parts.join(", "))
}

/// A usage bar: `used` of `total`, with the numbers beside it.
fn bar(name: &str, used: f64, total: f64) -> String {
    let pct = if total > 0.0 { (used / total * 100.0).clamp(0.0, 100.0) } else { 0.0 };
    format!(
        "<span class=\"usage\"><span class=\"bar\"><span style=\"width:{pct:.0}%\"></span></span> \
         {} / {}</span>",
        esc(&amount(name, used)),
        esc(&amount(name, total))
    )
}

/// A state word as a colored badge (`ALIVE`, `FAILED`, ...).
pub(crate) fn badge(state: &str) -> String {
    let class = match state {
        "ALIVE" | "RUNNING" | "CREATED" | "FINISHED" | "SUCCEEDED" | "HEALTHY" | "leader" => "ok",
        "DEAD" | "FAILED" | "DEPLOY_FAILED" | "UNHEALTHY" | "unreachable" | "INFEASIBLE" => "bad",
        "PENDING" | "PENDING_CREATION" | "RESTARTING" | "RESCHEDULING" | "SUBMITTED"
        | "DEPLOYING" | "RETRYING" | "STARTING" | "UPDATING" | "candidate" | "pre-candidate" => {
            "wait"
        }
        _ => "plain",
    };
    format!("<span class=\"badge {class}\">{}</span>", esc(state))
}

fn node_state(n: &pb::NodeInfo) -> &'static str {
    if n.state == pb::NodeState::Alive as i32 { "ALIVE" } else { "DEAD" }
}

/// A proto enum value's name without its prefix (`ACTOR_STATE_ALIVE` → `ALIVE`).
fn enum_word(name: Option<&'static str>, prefix: &str) -> String {
    name.map(|n| n.trim_start_matches(prefix).to_string()).unwrap_or_else(|| "UNKNOWN".into())
}

pub(crate) fn actor_state(s: i32) -> String {
    enum_word(pb::ActorState::try_from(s).ok().map(|s| s.as_str_name()), "ACTOR_STATE_")
}

pub(crate) fn group_state(s: i32) -> String {
    enum_word(
        pb::PlacementGroupState::try_from(s).ok().map(|s| s.as_str_name()),
        "PLACEMENT_GROUP_STATE_",
    )
}

fn job_state(s: i32) -> String {
    enum_word(pb::JobState::try_from(s).ok().map(|s| s.as_str_name()), "JOB_STATE_")
}

/// A node named by its short id (linked to its page) and its address; an id the head does
/// not know shows as itself.
fn node_ref(id: &str, nodes: &HashMap<&str, &pb::NodeInfo>) -> String {
    if id.is_empty() {
        return "-".into();
    }
    match nodes.get(id) {
        Some(n) => format!(
            "<a href=\"/nodes/{}\" title=\"{}\"><code>{}</code></a> <span class=\"addr\">{}</span>",
            enc(id),
            esc(id),
            esc(short_id(id)),
            esc(&n.address)
        ),
        None => format!("<code title=\"{}\">{}</code>", esc(id), esc(short_id(id))),
    }
}

fn by_id(nodes: &[pb::NodeInfo]) -> HashMap<&str, &pb::NodeInfo> {
    nodes.iter().map(|n| (n.node_id.as_str(), n)).collect()
}

/// Resources shown for a node or the cluster: not the renamed bundle resources (shares of
/// the plain ones) nor the bundle markers.
fn shown_resource(name: &str) -> bool {
    tpuray_scheduler::bundles::parse_bundle_resource(name).is_none() && name != "bundle"
}

/// Error text in a page (a call that failed), never raw.
pub(crate) fn error_box(what: &str, err: &str) -> String {
    format!("<div class=\"error\"><b>{}</b>: {}</div>", esc(what), esc(err))
}

fn table(head: &[&str], rows: &[String], empty: &str) -> String {
    let mut out = String::from("<table><thead><tr>");
    for h in head {
        let _ = write!(out, "<th>{}</th>", esc(h));
    }
    out.push_str("</tr></thead><tbody>");
    for r in rows {
        out.push_str(r);
    }
    if rows.is_empty() {
        let _ = write!(
            out,
            "<tr><td colspan=\"{}\" class=\"empty\">{}</td></tr>",
            head.len(),
            esc(empty)
        );
    }
    out.push_str("</tbody></table>");
    out
}

fn tr(cells: &[String]) -> String {
    let mut out = String::from("<tr>");
    for c in cells {
        let _ = write!(out, "<td>{c}</td>");
    }
    out.push_str("</tr>");
    out
}

/// Links to filter a list by state, with counts: `all (12) · RUNNING (3) · ...`.
fn state_filter(path: &str, counts: &BTreeMap<String, usize>, current: Option<&str>) -> String {
    let total: usize = counts.values().sum();
    let mut parts = vec![if current.is_none() {
        format!("<b>all ({total})</b>")
    } else {
        format!("<a href=\"{path}\">all ({total})</a>")
    }];
    for (s, n) in counts {
        if current == Some(s.as_str()) {
            parts.push(format!("<b>{} ({n})</b>", badge(s)));
        } else {
            parts.push(format!("<a href=\"{path}?state={}\">{} ({n})</a>", enc(s), badge(s)));
        }
    }
    format!("<p class=\"filters\">{}</p>", parts.join(" · "))
}

// ---------------------------------------------------------------------------------------
// The frame of every page.
// ---------------------------------------------------------------------------------------

const NAV: &[(&str, &str)] = &[
    ("/", "Overview"),
    ("/nodes", "Nodes"),
    ("/slices", "TPU slices"),
    ("/actors", "Actors"),
    ("/tasks", "Tasks"),
    ("/placement-groups", "Placement groups"),
    ("/jobs", "Jobs"),
    ("/serve", "Serve"),
    ("/replicas", "Head replicas"),
    ("/timeline", "Timeline"),
];

/// A whole page: header with navigation (`active` marked), a line saying which head
/// serves it, then `main`. `refresh_s` > 0 lets the script re-fetch the page that often and
/// swap its `<main>` (DASH-1: the page is complete without it).
pub(crate) fn layout(
    title: &str,
    active: &str,
    served_by: &str,
    main: &str,
    refresh_s: u32,
) -> String {
    let mut nav = String::new();
    for (href, name) in NAV {
        let class = if *href == active { " class=\"active\"" } else { "" };
        let _ = write!(nav, "<a href=\"{href}\"{class}>{name}</a>");
    }
    let refresh = if refresh_s > 0 {
        format!(
            "<span id=\"refresh\" hidden>refreshes every {refresh_s} s \
             <button type=\"button\" id=\"refresh-toggle\">pause</button> \
             <span id=\"refresh-status\"></span></span>"
        )
    } else {
        String::new()
    };
    format!(
        "<!DOCTYPE html>\n<html lang=\"en\"><head><meta charset=\"utf-8\">\
         <meta name=\"viewport\" content=\"width=device-width, initial-scale=1\">\
         <title>{title} · tpuray</title><link rel=\"icon\" href=\"data:,\">\
         <link rel=\"stylesheet\" href=\"/static/dashboard.css\"></head>\
         <body data-refresh=\"{refresh_s}\"><header><span class=\"brand\">tpuray</span>\
         <nav>{nav}</nav></header><div class=\"served\">{served_by} {refresh}</div>\
         <main><h1>{title}</h1>\n{main}</main>\
         <script src=\"/static/dashboard.js\"></script></body></html>\n",
        title = esc(title),
    )
}

/// The page a browser without the cluster token gets (DASH-3): a form that posts the token
/// to `/login`, which sets the cookie and goes back to `next`. No script, no asset (the
/// stylesheet needs the token too).
pub(crate) fn login_page(next: &str, message: Option<&str>) -> String {
    let message = message.map(|m| format!("<p class=\"msg\">{}</p>", esc(m))).unwrap_or_default();
    format!(
        "<!DOCTYPE html>\n<html lang=\"en\"><head><meta charset=\"utf-8\">\
         <title>Sign in · tpuray</title><link rel=\"icon\" href=\"data:,\"><style>\
         body{{font:15px system-ui,sans-serif;background:#f4f5f7;margin:0}}\
         form{{max-width:26em;margin:12vh auto;background:#fff;padding:1.5em 2em;\
         border-radius:8px;box-shadow:0 1px 4px #0002}}\
         input[type=password]{{width:100%;box-sizing:border-box;padding:.5em;margin:.5em 0}}\
         button{{padding:.5em 1.2em}}.msg{{color:#b00020}}code{{background:#eee;padding:0 .2em}}\
         </style></head><body><form method=\"post\" action=\"/login\">\
         <h1>tpuray dashboard</h1>{message}\
         <p>This cluster needs its token. It is in <code>~/.tpuray/auth_token</code> on the \
         machine that started the head (or in <code>TPURAY_AUTH_TOKEN</code>).</p>\
         <label for=\"token\">Cluster token</label>\
         <input type=\"password\" id=\"token\" name=\"token\" autocomplete=\"current-password\" autofocus>\
         <input type=\"hidden\" name=\"next\" value=\"{}\">\
         <button type=\"submit\">Open the dashboard</button></form></body></html>\n",
        esc(next)
    )
}

// ---------------------------------------------------------------------------------------
// Pages.
// ---------------------------------------------------------------------------------------

/// Tasks read from the head: the newest ones, and whether there may be more.
pub(crate) struct TasksRead {
    pub tasks: Vec<pb::TaskSummary>,
    /// The read hit its limit: counts cover the newest `tasks.len()` only.
    pub truncated: bool,
    pub dropped: u64,
}

fn count_by<T>(items: &[T], key: impl Fn(&T) -> String) -> BTreeMap<String, usize> {
    let mut m = BTreeMap::new();
    for i in items {
        *m.entry(key(i)).or_default() += 1;
    }
    m
}

fn counts_line(counts: &BTreeMap<String, usize>) -> String {
    if counts.is_empty() {
        return "none".into();
    }
    counts.iter().map(|(s, n)| format!("{n} {}", badge(s))).collect::<Vec<_>>().join(" ")
}

/// Cluster-wide usage of every shown resource (alive nodes).
fn resources_table(st: &pb::GetClusterStatusReply) -> String {
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

fn demand_list(st: &pb::GetClusterStatusReply) -> String {
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
fn hue(pg: &str) -> u32 {
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

/// Actors, filterable by state, with why each waits or died.
pub(crate) fn actors(
    actors: &[pb::ActorInfo],
    nodes: &[pb::NodeInfo],
    state: Option<&str>,
) -> String {
    let nodes = by_id(nodes);
    let counts = count_by(actors, |a| actor_state(a.state));
    let mut out = state_filter("/actors", &counts, state);
    let rows: Vec<String> = actors
        .iter()
        .filter(|a| state.is_none_or(|s| actor_state(a.state) == s))
        .map(|a| {
            let restarts = if a.max_restarts < 0 {
                format!("{} / ∞", a.num_restarts)
            } else {
                format!("{} / {}", a.num_restarts, a.max_restarts)
            };
            let why = if !a.death_cause.is_empty() { &a.death_cause } else { &a.pending_reason };
            tr(&[
                format!("<code>{}</code>", esc(&a.actor_id)),
                esc(&a.class_name),
                format!(
                    "{}{}",
                    esc(&a.name),
                    if a.name.is_empty() || a.namespace.is_empty() {
                        String::new()
                    } else {
                        format!(" <span class=\"addr\">({})</span>", esc(&a.namespace))
                    }
                ),
                badge(&actor_state(a.state)),
                format!("<code>{}</code>", esc(short_id(&a.job_id))),
                node_ref(&a.node_id, &nodes),
                if a.pid == 0 { "-".into() } else { a.pid.to_string() },
                restarts,
                esc(&shape(&a.resources)),
                format!("<div class=\"why\">{}</div>", esc(why)),
            ])
        })
        .collect();
    out.push_str(&table(
        &[
            "actor id",
            "class",
            "name",
            "state",
            "job",
            "node",
            "pid",
            "restarts",
            "resources",
            "why",
        ],
        &rows,
        "no actor",
    ));
    out
}

/// Tasks by state, newest first, with their errors; `state` and `job` filter.
pub(crate) fn tasks(
    read: &TasksRead,
    nodes: &[pb::NodeInfo],
    state: Option<&str>,
    job: Option<&str>,
    limit: usize,
) -> String {
    let nodes = by_id(nodes);
    let of_job: Vec<&pb::TaskSummary> =
        read.tasks.iter().filter(|t| job.is_none_or(|j| t.job_id == j)).collect();
    let counts = count_by(&of_job, |t| t.state.clone());
    let path = match job {
        Some(j) => format!("/tasks?job={}&amp;", enc(j)),
        None => "/tasks?".to_string(),
    };
    let mut out = String::new();
    if let Some(j) = job {
        let _ = write!(
            out,
            "<p>Tasks of job <code>{}</code> · <a href=\"/tasks\">all jobs</a></p>",
            esc(j)
        );
    }
    // state_filter wants a path without a query; build the links here instead.
    let total: usize = counts.values().sum();
    let mut parts = vec![if state.is_none() {
        format!("<b>all ({total})</b>")
    } else {
        format!(
            "<a href=\"{}\">all ({total})</a>",
            path.trim_end_matches("&amp;").trim_end_matches('?')
        )
    }];
    for (s, n) in &counts {
        if state == Some(s.as_str()) {
            parts.push(format!("<b>{} ({n})</b>", badge(s)));
        } else {
            parts.push(format!("<a href=\"{path}state={}\">{} ({n})</a>", enc(s), badge(s)));
        }
    }
    let _ = write!(out, "<p class=\"filters\">{}</p>", parts.join(" · "));
    if read.truncated || read.dropped > 0 {
        let _ = write!(
            out,
            "<p class=\"meta\">Counts cover the newest {} tasks read{}.</p>",
            read.tasks.len(),
            if read.dropped > 0 {
                format!(
                    "; the head forgot {} older task events (it keeps a bounded number)",
                    read.dropped
                )
            } else {
                String::new()
            }
        );
    }
    let shown: Vec<&&pb::TaskSummary> =
        of_job.iter().filter(|t| state.is_none_or(|s| t.state == s)).collect();
    let rows: Vec<String> = shown
        .iter()
        .take(limit)
        .map(|t| {
            let ran = if t.started_ms > 0 && t.finished_ms >= t.started_ms {
                duration(t.finished_ms - t.started_ms)
            } else {
                "-".into()
            };
            let error = if t.error.is_empty() {
                String::new()
            } else {
                // A Python traceback ends with the exception: show that line.
                let first = t.error.lines().rev().find(|l| !l.trim().is_empty()).unwrap_or("");
                format!(
                    "<details class=\"err\"><summary>{}</summary><pre>{}</pre></details>",
                    esc(&first.chars().take(160).collect::<String>()),
                    esc(&t.error.chars().take(20_000).collect::<String>())
                )
            };
            tr(&[
                format!("<code>{}</code>", esc(&t.task_id)),
                esc(&t.name),
                badge(&t.state),
                t.attempt.to_string(),
                format!(
                    "<a href=\"/tasks?job={}\"><code>{}</code></a>",
                    enc(&t.job_id),
                    esc(short_id(&t.job_id))
                ),
                node_ref(&t.node_id, &nodes),
                format!("<code>{}</code>", esc(short_id(&t.worker_id))),
                esc(&time(t.submitted_ms)),
                ran,
                error,
            ])
        })
        .collect();
    if shown.len() > limit {
        let _ = write!(out, "<p class=\"meta\">Showing the newest {limit} of {}.</p>", shown.len());
    }
    out.push_str(&table(
        &[
            "task id",
            "name",
            "state",
            "attempt",
            "job",
            "node",
            "worker",
            "submitted",
            "ran",
            "error",
        ],
        &rows,
        "no task",
    ));
    out
}

/// Placement groups, newest first, with their bundles, nodes and why each waits.
pub(crate) fn groups(
    groups: &[pb::PlacementGroupInfo],
    nodes: &[pb::NodeInfo],
    now_ms: u64,
) -> String {
    let nodes = by_id(nodes);
    let mut gs: Vec<&pb::PlacementGroupInfo> = groups.iter().collect();
    gs.sort_by_key(|g| std::cmp::Reverse(g.create_time_ms));
    let counts = count_by(groups, |g| group_state(g.state));
    let mut out = format!("<p class=\"filters\">{}</p>", counts_line(&counts));
    let rows: Vec<String> = gs
        .iter()
        .map(|g| {
            let mut bundles = String::from("<ol class=\"bundles\" start=\"0\">");
            for (i, b) in g.bundles.iter().enumerate() {
                let node = g.bundle_node_ids.get(i).map(String::as_str).unwrap_or("");
                let _ = write!(
                    bundles,
                    "<li>{} → {}</li>",
                    esc(&shape(&b.resources)),
                    if node.is_empty() {
                        "<i>not placed</i>".into()
                    } else {
                        node_ref(node, &nodes)
                    }
                );
            }
            bundles.push_str("</ol>");
            let slice = g
                .slice
                .as_ref()
                .map(|s| {
                    format!(
                        "{} {} × {}",
                        esc(&s.accelerator_type),
                        esc(if s.topology.is_empty() { "any topology" } else { &s.topology }),
                        s.num_slices.max(1)
                    )
                })
                .unwrap_or_default();
            let why = if g.state == pb::PlacementGroupState::Removed as i32 {
                esc(&g.removal_reason)
            } else if g.pending_reason.is_empty() {
                String::new()
            } else {
                format!(
                    "{}{}",
                    if g.infeasible { badge("INFEASIBLE") + " " } else { String::new() },
                    esc(&g.pending_reason)
                )
            };
            tr(&[
                format!(
                    "<code>{}</code><div>{}</div>",
                    esc(&g.placement_group_id),
                    esc(&group_display(g))
                ),
                badge(&group_state(g.state)),
                esc(&g.strategy),
                bundles,
                slice,
                format!(
                    "<code>{}</code>{}",
                    esc(short_id(&g.job_id)),
                    if g.detached { " detached" } else { "" }
                ),
                esc(&ago(g.create_time_ms, now_ms)),
                format!("<div class=\"why\">{why}</div>"),
            ])
        })
        .collect();
    out.push_str(&table(
        &[
            "group",
            "state",
            "strategy",
            "bundles → nodes",
            "TPU slice",
            "job",
            "created",
            "why it waits",
        ],
        &rows,
        "no placement group",
    ));
    out
}

/// Jobs: Jobs API submissions, then drivers started by hand.
pub(crate) fn jobs(
    subs: &[pb::JobSubmission],
    drivers: &[pb::JobInfo],
    nodes: &[pb::NodeInfo],
) -> String {
    let nodes = by_id(nodes);
    let mut subs: Vec<&pb::JobSubmission> = subs.iter().collect();
    subs.sort_by_key(|s| std::cmp::Reverse(s.submit_time_ms));
    let rows: Vec<String> = subs
        .iter()
        .map(|s| {
            tr(&[
                format!(
                    "<a href=\"/jobs/{}\"><code>{}</code></a>",
                    enc(&s.submission_id),
                    esc(&s.submission_id)
                ),
                badge(&s.status),
                format!("<code>{}</code>", esc(&s.entrypoint)),
                node_ref(&s.driver_node_id, &nodes),
                esc(&time(s.submit_time_ms)),
                esc(&time(s.end_time_ms)),
                format!("<div class=\"why\">{}</div>", esc(&s.message)),
            ])
        })
        .collect();
    let mut out = String::from("<h2>Submitted jobs (Jobs API)</h2>");
    out.push_str(&table(
        &["submission id", "status", "entrypoint", "node", "submitted", "ended", "message"],
        &rows,
        "no job was submitted",
    ));
    let mut ds: Vec<&pb::JobInfo> = drivers.iter().collect();
    ds.sort_by_key(|j| std::cmp::Reverse(j.start_time_ms));
    let rows: Vec<String> = ds
        .iter()
        .map(|j| {
            tr(&[
                format!("<a href=\"/jobs/{}\"><code>{}</code></a>", enc(&j.job_id), esc(&j.job_id)),
                badge(&job_state(j.state)),
                format!("<code>{}</code>", esc(&j.entrypoint)),
                esc(&j.driver_address),
                j.driver_pid.to_string(),
                if j.submission_id.is_empty() {
                    "-".into()
                } else {
                    format!(
                        "<a href=\"/jobs/{}\">{}</a>",
                        enc(&j.submission_id),
                        esc(&j.submission_id)
                    )
                },
                esc(&time(j.start_time_ms)),
                esc(&time(j.end_time_ms)),
            ])
        })
        .collect();
    out.push_str("<h2>Drivers</h2>");
    out.push_str(&table(
        &[
            "job id",
            "state",
            "entrypoint",
            "driver address",
            "pid",
            "submission",
            "started",
            "ended",
        ],
        &rows,
        "no driver has connected",
    ));
    out
}

/// The end of a job's log, as read from its node's agent.
pub(crate) struct LogTail {
    pub text: String,
    /// Where `text` starts in the log (0: the whole log).
    pub offset: u64,
    pub size: u64,
}

/// A submitted job: its details and the end of its log.
pub(crate) fn submission(
    s: &pb::JobSubmission,
    log: Result<Option<LogTail>, String>,
    nodes: &[pb::NodeInfo],
) -> String {
    let nodes = by_id(nodes);
    let mut out = String::from("<table class=\"facts\">");
    let exit = s.driver_exit_code.map(|c| c.to_string()).unwrap_or_else(|| "-".into());
    let meta: BTreeMap<&String, &String> = s.metadata.iter().collect();
    let meta: Vec<String> = meta.iter().map(|(k, v)| format!("{}={}", esc(k), esc(v))).collect();
    let facts = [
        ("submission id", format!("<code>{}</code>", esc(&s.submission_id))),
        ("status", badge(&s.status)),
        ("entrypoint", format!("<code>{}</code>", esc(&s.entrypoint))),
        ("message", esc(&s.message)),
        ("error type", esc(&s.error_type)),
        ("node", node_ref(&s.driver_node_id, &nodes)),
        (
            "driver job",
            if s.job_id.is_empty() {
                "-".into()
            } else {
                format!(
                    "<a href=\"/tasks?job={}\"><code>{}</code></a> (its tasks)",
                    enc(&s.job_id),
                    esc(&s.job_id)
                )
            },
        ),
        ("submitted", esc(&time(s.submit_time_ms))),
        ("started", esc(&time(s.start_time_ms))),
        ("ended", esc(&time(s.end_time_ms))),
        ("exit code", esc(&exit)),
        ("runtime env", format!("<code>{}</code>", esc(&s.runtime_env_json))),
        ("metadata", meta.join(", ")),
    ];
    for (k, v) in facts {
        let _ = write!(out, "<tr><th>{k}</th><td>{v}</td></tr>");
    }
    out.push_str("</table><h2>Log</h2>");
    match log {
        Ok(Some(t)) => {
            if t.offset > 0 {
                let _ = write!(
                    out,
                    "<p class=\"meta\">The last {} of {} (<code>tpuray job logs</code> or \
                     <code>/api/jobs/{}/logs</code> has it all).</p>",
                    esc(&fmt_bytes((t.size - t.offset) as f64)),
                    esc(&fmt_bytes(t.size as f64)),
                    enc(&s.submission_id)
                );
            }
            let _ = write!(out, "<pre class=\"log\" id=\"log\">{}</pre>", esc(&t.text));
        }
        Ok(None) => out.push_str(
            "<p>No log yet: the job has not started on a node (its log is written there).</p>",
        ),
        Err(e) => out.push_str(&error_box("the log could not be read", &e)),
    }
    out
}

/// A driver job (not submitted through the Jobs API).
pub(crate) fn driver(j: &pb::JobInfo) -> String {
    let mut out = String::from("<table class=\"facts\">");
    let facts = [
        ("job id", format!("<code>{}</code>", esc(&j.job_id))),
        ("state", badge(&job_state(j.state))),
        ("entrypoint", format!("<code>{}</code>", esc(&j.entrypoint))),
        ("namespace", esc(&j.namespace)),
        ("driver", format!("{} pid {}", esc(&j.driver_address), j.driver_pid)),
        ("started", esc(&time(j.start_time_ms))),
        ("ended", esc(&time(j.end_time_ms))),
        ("tasks", format!("<a href=\"/tasks?job={}\">its tasks</a>", enc(&j.job_id))),
    ];
    for (k, v) in facts {
        let _ = write!(out, "<tr><th>{k}</th><td>{v}</td></tr>");
    }
    out.push_str("</table>");
    out.push_str(
        "<h2>Log</h2><p>This driver was started by hand, not through the Jobs API: its output \
         went to its own terminal, and the cluster keeps no copy (workers' output was sent \
         to that driver).</p>",
    );
    out
}

/// Serve applications from the controller's status document in the head's KV (namespace
/// `serve`, key `status`, written by `tpuray.serve`'s controller); `None`: no document.
pub(crate) fn serve(doc: Option<&Value>, now_s: f64) -> String {
    let Some(v) = doc else {
        return "<p>No serve application: no <code>tpuray.serve</code> controller has written a \
                status to this cluster's KV (namespace <code>serve</code>, key \
                <code>status</code>). <code>serve.run(...)</code> starts one.</p>"
            .into();
    };
    let mut out = String::new();
    let controller = &v["controller"];
    if let Some(t) = controller["updated_at"].as_f64() {
        let stale = now_s - t > 15.0;
        let _ = write!(
            out,
            "<p class=\"meta\">controller status written {:.0} s ago{}</p>",
            (now_s - t).max(0.0),
            if stale { " — <b>stale</b>: the controller may be down" } else { "" }
        );
    }
    if controller["state"].as_str() == Some("STOPPED") {
        out.push_str("<p>Serve was shut down.</p>");
    }
    let apps = v["applications"].as_object();
    if apps.is_none_or(|a| a.is_empty()) {
        out.push_str("<p>No serve application is running.</p>");
        return out;
    }
    let text = |v: &Value| match v {
        Value::String(s) => esc(s),
        Value::Null => String::new(),
        v => esc(&v.to_string()),
    };
    for (name, app) in apps.into_iter().flatten() {
        let _ = write!(
            out,
            "<section class=\"app\"><h2>{} {}</h2><p>route prefix <code>{}</code> · ingress {} {}</p>",
            esc(name),
            badge(app["status"].as_str().unwrap_or("UNKNOWN")),
            text(&app["route_prefix"]),
            text(&app["ingress"]),
            if app["message"].as_str().is_some_and(|m| !m.is_empty()) {
                format!("<div class=\"why\">{}</div>", text(&app["message"]))
            } else {
                String::new()
            }
        );
        let mut rows = Vec::new();
        for (dname, d) in app["deployments"].as_object().into_iter().flatten() {
            let states = d["replica_states"]
                .as_object()
                .map(|m| {
                    m.iter()
                        .map(|(s, n)| format!("{} {}", text(n), badge(s)))
                        .collect::<Vec<_>>()
                        .join(" ")
                })
                .unwrap_or_default();
            let replicas: Vec<String> = d["replicas"]
                .as_array()
                .into_iter()
                .flatten()
                .map(|r| {
                    format!(
                        "<li><code>{}</code> {} pid {} node <code>{}</code></li>",
                        text(&r["replica_id"]),
                        badge(r["state"].as_str().unwrap_or("")),
                        text(&r["pid"]),
                        esc(short_id(r["node_id"].as_str().unwrap_or("")))
                    )
                })
                .collect();
            rows.push(tr(&[
                esc(dname),
                badge(d["status"].as_str().unwrap_or("UNKNOWN")),
                text(&d["target_replicas"]),
                states,
                format!("<ul class=\"replicas\">{}</ul>", replicas.join("")),
                format!("<div class=\"why\">{}</div>", text(&d["message"])),
            ]));
        }
        out.push_str(&table(
            &["deployment", "status", "target", "replicas by state", "replicas", "message"],
            &rows,
            "no deployment",
        ));
        out.push_str("</section>");
    }
    out
}

/// The head replicas: each one's own Raft status (asked of it), the one serving this page
/// marked.
pub(crate) fn replicas(
    rows: &[(u64, String, Result<pb::GetReplicaStatusReply, String>)],
    this: u64,
) -> String {
    let leader = rows.iter().find_map(|(_, _, r)| r.as_ref().ok().filter(|s| s.role == "leader"));
    let mut out = match leader {
        Some(l) => format!(
            "<p>Leader: head {} at {}, term {}{}.</p>",
            l.id,
            esc(&l.address),
            l.term,
            if l.leader_ready { ", serving" } else { ", still applying its log" }
        ),
        None => "<p class=\"bad\">No replica reports itself leader.</p>".into(),
    };
    let matched: HashMap<u64, u64> = leader
        .map(|l| l.peers.iter().map(|p| (p.id, p.matched_index)).collect())
        .unwrap_or_default();
    let trs: Vec<String> = rows
        .iter()
        .map(|(id, addr, r)| {
            let me = if *id == this { " <span class=\"badge plain\">this head</span>" } else { "" };
            match r {
                Ok(s) => tr(&[
                    format!("{id}{me}"),
                    esc(addr),
                    badge(&s.role),
                    s.term.to_string(),
                    if s.leader_id == 0 {
                        "none known".into()
                    } else {
                        format!("{} ({})", s.leader_id, esc(&s.leader_address))
                    },
                    s.commit_index.to_string(),
                    s.applied_index.to_string(),
                    format!("{}..{}", s.first_index, s.last_index),
                    s.snapshot_index.to_string(),
                    matched.get(id).map(u64::to_string).unwrap_or_else(|| "-".into()),
                    format!("<code>{}</code>", esc(&s.data_dir)),
                ]),
                Err(e) => tr(&[
                    format!("{id}{me}"),
                    esc(addr),
                    badge("unreachable"),
                    format!("<span class=\"why\">{}</span>", esc(e)),
                    String::new(),
                    String::new(),
                    String::new(),
                    String::new(),
                    String::new(),
                    matched.get(id).map(u64::to_string).unwrap_or_else(|| "-".into()),
                    String::new(),
                ]),
            }
        })
        .collect();
    out.push_str(&table(
        &[
            "id",
            "address",
            "role",
            "term",
            "leader",
            "commit",
            "applied",
            "log",
            "snapshot",
            "matched (leader's view)",
            "data dir",
        ],
        &trs,
        "no replica",
    ));
    out
}

/// The timeline page: how to get the trace, per job.
pub(crate) fn timeline(drivers: &[pb::JobInfo], tasks: &TasksRead) -> String {
    let ran = tasks.tasks.iter().filter(|t| t.started_ms > 0).count();
    let mut out = format!(
        "<p>The timeline is Chrome trace JSON, as Ray's <code>ray timeline</code> writes it: one \
         span per task that ran ({ran} of the {} tasks read), a row per worker process, \
         grouped by node. Open it in <a href=\"https://ui.perfetto.dev\">Perfetto</a> or \
         <code>chrome://tracing</code>. The same file comes from <code>tpuray timeline</code> \
         and <code>tpuray.timeline(filename)</code>.</p>\
         <p><a class=\"button\" href=\"/api/v0/tasks/timeline?download=1\">Download the timeline of every job</a></p>",
        tasks.tasks.len()
    );
    let mut ds: Vec<&pb::JobInfo> = drivers.iter().collect();
    ds.sort_by_key(|j| std::cmp::Reverse(j.start_time_ms));
    let rows: Vec<String> = ds
        .iter()
        .map(|j| {
            let n = tasks.tasks.iter().filter(|t| t.job_id == j.job_id && t.started_ms > 0).count();
            tr(&[
                format!("<code>{}</code>", esc(&j.job_id)),
                format!("<code>{}</code>", esc(&j.entrypoint)),
                n.to_string(),
                format!(
                    "<a href=\"/api/v0/tasks/timeline?job_id={}&amp;download=1\">download</a>",
                    enc(&j.job_id)
                ),
            ])
        })
        .collect();
    out.push_str(&table(&["job", "entrypoint", "tasks that ran", "timeline"], &rows, "no job"));
    out
}

/// The slices drawing uses `ChipState` words as CSS classes; this keeps the stylesheet and
/// the code in step (tested).
#[cfg(test)]
const CHIP_CLASSES: [slices::ChipState; 5] = [
    slices::ChipState::Busy,
    slices::ChipState::Idle,
    slices::ChipState::Reserved,
    slices::ChipState::Used,
    slices::ChipState::Free,
];

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn dash_2_escape_covers_every_html_special_character() {
        assert_eq!(
            esc("<a href=\"x\">'&'</a>"),
            "&lt;a href=&quot;x&quot;&gt;&#39;&amp;&#39;&lt;/a&gt;"
        );
        assert_eq!(esc("plain ünïcode"), "plain ünïcode");
        assert_eq!(esc(""), "");
    }

    #[test]
    fn url_components_are_percent_encoded_and_forms_decoded() {
        assert_eq!(enc("a b/c?d=e&f"), "a%20b%2Fc%3Fd%3De%26f");
        assert_eq!(enc("raysubmit_AbC-1.2~"), "raysubmit_AbC-1.2~");
        assert_eq!(decode("a+b%2Fc%3d"), "a b/c=");
        assert_eq!(decode("100%"), "100%");
        assert_eq!(decode("%zz%4"), "%zz%4");
        assert_eq!(decode("%C3%A9"), "é");
        assert_eq!(decode("%FF"), "\u{FFFD}");
        let q = parse_query("state=FAILED&job=j%201&&flag&state=X");
        assert_eq!(param(&q, "state"), Some("FAILED"));
        assert_eq!(param(&q, "job"), Some("j 1"));
        assert_eq!(param(&q, "flag"), Some(""));
        assert_eq!(param(&q, "none"), None);
        for s in ["", "%", "a=%", "=%2", "&&&", "%%%%", "é=%E9"] {
            let _ = parse_query(s); // never panics
        }
    }

    #[test]
    fn times_and_durations_read_as_people_write_them() {
        assert_eq!(time(0), "-");
        let sp = |s: &str| s.replace('\u{a0}', " ");
        assert_eq!(sp(&time(951_782_400_000 + 3_723_000)), "2000-02-29 01:02:03 UTC");
        assert_eq!(utc(1_767_225_599), (2025, 12, 31, 23, 59, 59));
        assert_eq!(sp(&duration(850)), "850 ms");
        assert_eq!(sp(&duration(12_345)), "12.3 s");
        assert_eq!(sp(&duration(242_000)), "4 min 2 s");
        assert_eq!(sp(&duration(12_000_000)), "3 h 20 min");
        assert_eq!(sp(&ago(1_000, 4_200)), "3.2 s ago");
    }

    fn mk_node(id: &str, address: &str) -> pb::NodeInfo {
        pb::NodeInfo {
            node_id: id.into(),
            address: address.into(),
            state: pb::NodeState::Alive as i32,
            total: HashMap::from([("CPU".into(), 4.0), ("memory".into(), 2048.0)]),
            available: HashMap::from([("CPU".into(), 1.0), ("memory".into(), 1024.0)]),
            ..Default::default()
        }
    }

    #[test]
    fn dash_2_values_from_the_cluster_never_reach_the_page_raw() {
        let evil = "<script>alert(1)</script>";
        let mut n = mk_node(evil, evil);
        n.labels.insert(evil.into(), evil.into());
        n.death_reason = evil.into();
        let st = pb::GetClusterStatusReply { nodes: vec![n.clone()], ..Default::default() };
        let actor = pb::ActorInfo {
            actor_id: evil.into(),
            class_name: evil.into(),
            name: evil.into(),
            death_cause: evil.into(),
            ..Default::default()
        };
        let task = pb::TaskSummary {
            task_id: evil.into(),
            name: evil.into(),
            state: evil.into(),
            error: evil.into(),
            job_id: evil.into(),
            ..Default::default()
        };
        let read = TasksRead { tasks: vec![task], truncated: false, dropped: 0 };
        let sub = pb::JobSubmission {
            submission_id: evil.into(),
            status: evil.into(),
            entrypoint: evil.into(),
            message: evil.into(),
            ..Default::default()
        };
        let group = pb::PlacementGroupInfo {
            placement_group_id: evil.into(),
            name: evil.into(),
            pending_reason: evil.into(),
            bundles: vec![pb::Bundle {
                resources: HashMap::from([(evil.to_string(), 1.0)]),
                ..Default::default()
            }],
            bundle_node_ids: vec![evil.into()],
            ..Default::default()
        };
        let serve_doc = serde_json::json!({"applications": {evil: {"status": evil, "route_prefix": evil,
            "deployments": {evil: {"status": evil, "replicas": [{"replica_id": evil}]}}}}});
        let pages = [
            overview(
                &st,
                Ok(std::slice::from_ref(&actor)),
                Ok(&read),
                Ok(std::slice::from_ref(&sub)),
                Ok(&[]),
                Ok(std::slice::from_ref(&group)),
                &HashMap::new(),
                0,
            ),
            nodes(&st, 0),
            node(&n, Ok(&[]), Err(evil), &[], 0),
            actors(std::slice::from_ref(&actor), &st.nodes, None),
            actors(std::slice::from_ref(&actor), &st.nodes, Some(evil)),
            tasks(&read, &st.nodes, None, Some(evil), 10),
            tasks(&read, &st.nodes, Some(evil), None, 10),
            groups(std::slice::from_ref(&group), &st.nodes, 0),
            jobs(std::slice::from_ref(&sub), &[], &st.nodes),
            submission(
                &sub,
                Ok(Some(LogTail { text: evil.into(), offset: 0, size: 1 })),
                &st.nodes,
            ),
            serve(Some(&serve_doc), 0.0),
            replicas(&[(1, evil.into(), Err(evil.into()))], 1),
            layout(evil, "/", &esc(evil), "", 5),
            login_page(evil, Some(evil)),
            error_box(evil, evil),
        ];
        for (i, p) in pages.iter().enumerate() {
            assert!(!p.contains("<script>alert"), "page {i} has the value raw:\n{p}");
            assert!(!p.contains("<script>a"), "page {i}");
        }
        assert!(pages[3].contains("&lt;script&gt;"), "the actor page shows the value, escaped");
    }

    #[test]
    fn dash_1_the_overview_names_every_node_by_id_and_address() {
        let st = pb::GetClusterStatusReply {
            nodes: vec![
                mk_node("n1aaaaaaaaaa", "10.0.0.1:7001"),
                mk_node("n2bbbbbbbbbb", "10.0.0.2:7001"),
            ],
            ..Default::default()
        };
        let page =
            overview(&st, Ok(&[]), Err("down"), Ok(&[]), Ok(&[]), Ok(&[]), &HashMap::new(), 0);
        for (id, addr) in [("n1aaaaaaaaaa", "10.0.0.1:7001"), ("n2bbbbbbbbbb", "10.0.0.2:7001")] {
            assert!(page.contains(&format!("<code>{id}</code>")), "{page}");
            assert!(page.contains(addr));
        }
        assert!(page.contains("unavailable: down"), "a failed read is said, not hidden");
    }

    #[test]
    fn a_gang_on_a_slice_is_drawn_on_every_chip_it_holds() {
        let pg = "feedfeedfeedfeedfeedfeedfeedfeed";
        let mut hosts = Vec::new();
        for w in 0..4u32 {
            let mut n = mk_node(&format!("host{w}xxxxxxxx"), &format!("10.0.0.{w}:7001"));
            for (k, v) in [
                ("tpu-slice-name", "sa".to_string()),
                ("tpu-worker-id", w.to_string()),
                ("tpu-pod-type", "v6e-16".into()),
                ("tpu-topology", "4x4".into()),
            ] {
                n.labels.insert(format!("tpuray.io/{k}"), v);
            }
            n.total.insert("TPU".into(), 4.0);
            n.available.insert("TPU".into(), 0.0);
            n.total.insert(format!("TPU_group_{pg}"), 4.0);
            hosts.push(n);
        }
        let group = pb::PlacementGroupInfo {
            placement_group_id: pg.into(),
            name: "gang:train:1".into(),
            state: pb::PlacementGroupState::Created as i32,
            bundle_node_ids: hosts.iter().map(|n| n.node_id.clone()).collect(),
            ..Default::default()
        };
        let mut workers = HashMap::new();
        workers.insert(
            hosts[0].node_id.clone(),
            Ok(vec![pb::WorkerInfo {
                worker_id: "wk".into(),
                pid: 99,
                state: "ACTOR".into(),
                key: Some(pb::WorkerPoolKey { tpu_chips: vec![0, 1, 2, 3], ..Default::default() }),
                resources: HashMap::from([(format!("TPU_group_0_{pg}"), 4.0)]),
                ..Default::default()
            }]),
        );
        workers.insert(hosts[1].node_id.clone(), Err("agent gone".to_string()));
        let page = slices_page(&hosts, std::slice::from_ref(&group), &workers, &[]);
        assert!(page.contains("slice sa: v6e-16, topology 4x4, 4 hosts"), "{page}");
        assert_eq!(page.matches("class=\"chip busy grouped\"").count(), 4, "host 0's four chips");
        assert_eq!(page.matches("class=\"chip reserved grouped\"").count(), 12, "the others");
        assert_eq!(page.matches("<span class=\"gang\">gang train (gen 1)</span>").count(), 16);
        assert!(page.contains("grid-column:2;grid-row:2"), "worker 3 at the grid's corner");
        assert!(page.contains("agent gone"));
        for n in &hosts {
            assert!(page.contains(&n.address));
        }
    }

    #[test]
    fn the_stylesheet_styles_every_chip_state() {
        let css = include_str!("dashboard.css");
        for s in CHIP_CLASSES {
            assert!(css.contains(&format!(".chip.{}", s.word())), "{}", s.word());
        }
    }
}
