//! The processes' reports (`ReportMetrics`, METRICS-4): each one's user-metric totals,
//! running tasks and hosted actor taken in, and what exited processes leave folded into
//! the series.

use std::collections::{HashMap, HashSet};

use tpuray_proto::pb;

use super::{AgentMetrics, MAX_USER_SERIES, Point, lock};

impl AgentMetrics {
    /// Tasks and actor calls each reporting process (by pid) last said it runs.
    pub fn running_by_pid(&self) -> HashMap<u32, u32> {
        let r = lock(&self.reports);
        let mut out = HashMap::new();
        for rep in r.reporters.values() {
            let n: u32 = rep.running.iter().map(|t| t.count).sum();
            *out.entry(rep.pid).or_default() += n;
        }
        out
    }

    /// Takes one process's report (METRICS-4). Returns whether every definition its
    /// points name is known here.
    pub fn report(&self, req: pb::ReportMetricsRequest) -> bool {
        let mut r = lock(&self.reports);
        let r = &mut *r;
        for d in req.defs {
            r.defs.entry(d.name.clone()).or_insert(d);
        }
        for t in &req.running {
            if r.running_seen.len() < MAX_USER_SERIES {
                r.running_seen.insert((req.job_id.clone(), t.name.clone(), t.is_retry));
            }
        }
        if !req.actor_class.is_empty() && r.actors_seen.len() < MAX_USER_SERIES {
            r.actors_seen.insert((req.job_id.clone(), req.actor_class.clone()));
        }
        let rep = r.reporters.entry(req.worker_id.clone()).or_default();
        rep.pid = req.pid;
        rep.job_id = req.job_id;
        rep.running = req.running;
        rep.actor_class = req.actor_class;
        let mut known = true;
        for p in req.points {
            let Some(def) = r.defs.get(&p.name) else {
                known = false;
                continue;
            };
            let kind = pb::metric_def::Kind::try_from(def.kind).unwrap_or_default();
            let shape_ok = p.tag_values.len() == def.tag_keys.len()
                && (kind != pb::metric_def::Kind::Histogram
                    || p.bucket_counts.len() == def.boundaries.len() + 1);
            if !shape_ok {
                continue; // another process defined the name differently: first wins
            }
            let key = (p.name.clone(), p.tag_values.clone());
            if !r.series.contains_key(&key) && r.series.len() >= MAX_USER_SERIES {
                r.dropped_series += 1;
                continue;
            }
            let s = r.series.entry(key).or_default();
            s.by_process.insert(
                req.worker_id.clone(),
                Point { value: p.value, buckets: p.bucket_counts, sum: p.sum, count: p.count },
            );
            s.last_writer = req.worker_id.clone();
        }
        known
    }

    /// Folds the series of processes that are gone into what they left, and forgets
    /// those processes (METRICS-4).
    pub(super) fn retire_gone(&self, alive: impl Fn(&str, u32) -> bool) {
        let mut r = lock(&self.reports);
        let gone: HashSet<String> = r
            .reporters
            .iter()
            .filter(|(id, rep)| !alive(id, rep.pid))
            .map(|(id, _)| id.clone())
            .collect();
        if gone.is_empty() {
            return;
        }
        r.reporters.retain(|id, _| !gone.contains(id));
        let defs = r.defs.clone();
        for ((name, _), s) in r.series.iter_mut() {
            let gauge = defs.get(name).map(|d| d.kind) == Some(pb::metric_def::Kind::Gauge as i32);
            for id in &gone {
                if let Some(p) = s.by_process.remove(id) {
                    if gauge {
                        if s.last_writer == *id {
                            s.retired = p; // a gauge keeps its last value (as Ray's)
                        }
                    } else {
                        s.retired.add(&p);
                    }
                }
            }
        }
    }
}
