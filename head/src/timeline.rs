//! Task timelines as Chrome trace JSON (the Trace Event Format's JSON array form, which
//! Perfetto and `chrome://tracing` open), shaped as Ray 2.60's `ray timeline`
//! (`ray/_private/profiling.py`, `chrome_tracing_dump`): one complete event (`"ph": "X"`)
//! per task that ran, `pid` a node and `tid` a worker process on it (integers, named by
//! `process_name`/`thread_name` metadata events, as Perfetto wants), `ts`/`dur` in
//! microseconds, and Ray's `args` (`task_id`, `job_id`, `attempt_number`,
//! `func_or_class_name`, `actor_id`). A pure function of the head's task summaries
//! (`ListTasks`) and nodes; `tpuray timeline`, `tpuray.timeline()` and the dashboard's
//! `/api/v0/tasks/timeline` all call it.
//!
//! Deviation from Ray: Ray groups rows by node IP; simulated nodes share an IP, so a row
//! group here is a node (named by its address and short id). A span runs from the
//! executor's RUNNING event to the owner's FINISHED/FAILED event (millisecond clocks; on
//! different hosts a skew shorter than the span's start is cut to a zero duration). A task
//! still running when the trace is taken ends at `now_ms` and says `"state": "RUNNING"`.
//!
//! The RUNNING event's time is `TaskSummary.started_ms`, kept by `report_task_events`.

use std::collections::{BTreeMap, HashMap};

use serde_json::{Value, json};
use tpuray_proto::pb;

use crate::slices::short_id;

/// The trace events of `tasks` (those that started running; of job `job` only, when
/// given), nodes named from `nodes`.
pub fn chrome_trace(
    tasks: &[pb::TaskSummary],
    nodes: &[pb::NodeInfo],
    job: Option<&str>,
    now_ms: u64,
) -> Vec<Value> {
    let address: HashMap<&str, &str> =
        nodes.iter().map(|n| (n.node_id.as_str(), n.address.as_str())).collect();
    let mut ran: Vec<&pb::TaskSummary> =
        tasks.iter().filter(|t| t.started_ms > 0 && job.is_none_or(|j| t.job_id == j)).collect();
    ran.sort_by(|a, b| (a.started_ms, &a.task_id).cmp(&(b.started_ms, &b.task_id)));
    // Indices in order of first appearance, as Ray numbers them.
    let mut node_index: BTreeMap<&str, usize> = BTreeMap::new();
    let mut worker_index: BTreeMap<(usize, &str), usize> = BTreeMap::new();
    let mut node_order: Vec<&str> = Vec::new();
    let mut worker_order: Vec<(usize, &str)> = Vec::new();
    let mut out = Vec::with_capacity(ran.len() + 16);
    for t in ran {
        let next = node_index.len();
        let pid = *node_index.entry(&t.node_id).or_insert_with(|| {
            node_order.push(&t.node_id);
            next
        });
        let next = worker_index.len();
        let tid = *worker_index.entry((pid, &t.worker_id)).or_insert_with(|| {
            worker_order.push((pid, &t.worker_id));
            next
        });
        let finished = t.finished_ms > 0 && matches!(t.state.as_str(), "FINISHED" | "FAILED");
        let end = if finished { t.finished_ms } else { now_ms.max(t.started_ms) };
        let cat = if t.actor_id.is_empty() { "task" } else { "actor_task" };
        let cname = match t.state.as_str() {
            "FAILED" => "terrible",
            "FINISHED" => "rail_animation",
            _ => "rail_response",
        };
        let mut args = json!({
            "task_id": t.task_id,
            "job_id": t.job_id,
            "attempt_number": t.attempt,
            "func_or_class_name": t.name,
            "actor_id": if t.actor_id.is_empty() { Value::Null } else { json!(t.actor_id) },
            "state": t.state,
            "node_id": t.node_id,
            "worker_id": t.worker_id,
        });
        if !t.error.is_empty() {
            args["error"] = json!(t.error);
        }
        out.push(json!({
            "cat": cat,
            "name": t.name,
            "pid": pid,
            "tid": tid,
            "ts": t.started_ms * 1000,
            "dur": end.saturating_sub(t.started_ms) * 1000,
            "ph": "X",
            "cname": cname,
            "args": args,
        }));
    }
    for (pid, node) in node_order.iter().enumerate() {
        let name = match address.get(node) {
            Some(a) => format!("Node {a} ({})", short_id(node)),
            None if node.is_empty() => "Node (unknown)".to_string(),
            None => format!("Node {}", short_id(node)),
        };
        out.push(json!({"name": "process_name", "ph": "M", "pid": pid, "args": {"name": name}}));
    }
    for (tid, (pid, worker)) in worker_order.iter().enumerate() {
        let name = if worker.is_empty() {
            "worker:(unknown)".to_string()
        } else {
            format!("worker:{worker}")
        };
        out.push(
            json!({"name": "thread_name", "ph": "M", "pid": pid, "tid": tid, "args": {"name": name}}),
        );
    }
    out
}

/// `(year, month, day, hour, minute, second)` in UTC of Unix seconds (Howard Hinnant's
/// `civil_from_days`).
pub fn utc(secs: u64) -> (i64, u32, u32, u32, u32, u32) {
    let days = (secs / 86_400) as i64;
    let rem = (secs % 86_400) as u32;
    let z = days + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z.rem_euclid(146_097);
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let d = (doy - (153 * mp + 2) / 5 + 1) as u32;
    let m = if mp < 10 { mp + 3 } else { mp - 9 } as u32;
    let y = yoe + era * 400 + i64::from(m <= 2);
    (y, m, d, rem / 3600, rem % 3600 / 60, rem % 60)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn task(
        id: &str,
        node: &str,
        worker: &str,
        state: &str,
        start: u64,
        end: u64,
    ) -> pb::TaskSummary {
        pb::TaskSummary {
            task_id: id.into(),
            job_id: "j1".into(),
            name: format!("f{id}"),
            state: state.into(),
            node_id: node.into(),
            worker_id: worker.into(),
            started_ms: start,
            finished_ms: end,
            ..Default::default()
        }
    }

    #[test]
    fn each_task_that_ran_is_one_complete_span_on_its_workers_row() {
        let nodes = [pb::NodeInfo {
            node_id: "aaaaaaaabbbb".into(),
            address: "10.0.0.1:7000".into(),
            ..Default::default()
        }];
        let tasks = [
            task("1", "aaaaaaaabbbb", "w1", "FINISHED", 1_000, 1_005),
            task("2", "aaaaaaaabbbb", "w2", "FAILED", 1_001, 1_002),
            task("3", "other", "w1", "RUNNING", 1_003, 0),
            task("4", "aaaaaaaabbbb", "w1", "SUBMITTED", 0, 0),
        ];
        let ev = chrome_trace(&tasks, &nodes, None, 1_010);
        let spans: Vec<&Value> = ev.iter().filter(|e| e["ph"] == "X").collect();
        assert_eq!(spans.len(), 3, "a task that never ran has no span");
        assert_eq!(spans[0]["ts"], 1_000_000);
        assert_eq!(spans[0]["dur"], 5_000);
        assert_eq!(spans[0]["name"], "f1");
        assert_eq!(spans[0]["args"]["task_id"], "1");
        assert_eq!(spans[0]["args"]["func_or_class_name"], "f1");
        assert_eq!((&spans[0]["pid"], &spans[0]["tid"]), (&json!(0), &json!(0)));
        assert_eq!((&spans[1]["pid"], &spans[1]["tid"]), (&json!(0), &json!(1)));
        // Same worker id on another node: another row.
        assert_eq!((&spans[2]["pid"], &spans[2]["tid"]), (&json!(1), &json!(2)));
        assert_eq!(spans[2]["dur"], 7_000, "a running task ends now");
        assert_eq!(spans[1]["cname"], "terrible");
        let meta: Vec<&Value> = ev.iter().filter(|e| e["ph"] == "M").collect();
        assert_eq!(meta[0]["args"]["name"], "Node 10.0.0.1:7000 (aaaaaaaa)");
        assert_eq!(meta[1]["args"]["name"], "Node other");
        assert_eq!(meta[2]["args"]["name"], "worker:w1");
        assert_eq!(meta.len(), 2 + 3);
        assert!(chrome_trace(&tasks, &nodes, Some("j2"), 1_010).is_empty());
    }

    #[test]
    fn a_clock_skew_never_makes_a_negative_duration() {
        let tasks = [task("1", "n", "w", "FINISHED", 2_000, 1_999)];
        let ev = chrome_trace(&tasks, &[], None, 0);
        assert_eq!(ev[0]["dur"], 0);
    }
}
