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

mod cluster;
mod jobs;
mod work;
pub(crate) use cluster::*;
pub(crate) use jobs::*;
pub(crate) use work::*;

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
mod tests;
