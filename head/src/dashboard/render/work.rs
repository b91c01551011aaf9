//! The work pages: actors, tasks and placement groups.

use super::*;

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
