//! The jobs, Serve and timeline pages.

use super::*;

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
