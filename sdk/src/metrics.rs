//! Metrics a process records for its node agent to export (METRICS-4): user metrics
//! (Ray's `ray.util.metrics` `Counter`, `Gauge`, `Histogram`; Python's
//! `tpuray.util.metrics` is built on [`define`] and [`record`]) and the tasks this
//! process runs now (`ray_tasks{Source="executor"}`).
//!
//! Recording touches only this process's memory (one mutex); the core's flush loop
//! sends what changed to the node agent every half second ([`flush`]), as the process's
//! totals (so a repeated report counts once). A driver on a host without a node of its
//! own reports to the node agent it leases from (the head node's, NET-3), which then
//! exports its metrics; [`destination`] says which agent that is. Metrics recorded
//! before `init` wait in memory and go out with the first flush.

use std::collections::{BTreeMap, HashMap, HashSet};
use std::sync::{Mutex, MutexGuard, OnceLock};
use std::time::Duration;

use tpuray_proto::pb;
use tpuray_proto::pb::metric_def::Kind;

use crate::core::Core;

/// Errors of metric definitions and records, each naming the metric at fault.
#[derive(Clone, Debug, PartialEq, thiserror::Error)]
pub enum MetricError {
    #[error("invalid metric name {0:?}: use letters, digits and _, not starting with a digit")]
    InvalidName(String),
    #[error("metric {name:?} is already defined as {existing}; it cannot also be {wanted}")]
    Conflict { name: String, existing: String, wanted: String },
    #[error("metric {0:?} is not defined in this process")]
    Undefined(String),
    #[error("metric {name:?} has tag keys {keys:?}; {got} tag values were given")]
    Tags { name: String, keys: Vec<String>, got: usize },
    #[error("histogram {name:?}: {detail}")]
    Boundaries { name: String, detail: String },
    #[error("metric {name:?}: {detail}")]
    Value { name: String, detail: String },
}

/// At most this many series per process; further records are dropped (the agent
/// bounds its own too).
const MAX_SERIES: usize = 10_000;

#[derive(Clone, Debug, Default)]
struct Point {
    value: f64,
    buckets: Vec<u64>,
    sum: f64,
    count: u64,
}

#[derive(Default)]
struct Recorder {
    defs: BTreeMap<String, pb::MetricDef>,
    /// Definitions the agent has (sent and acknowledged).
    sent: HashSet<String>,
    series: HashMap<SeriesKey, Point>,
    dirty: HashSet<SeriesKey>,
    /// Task name → tasks running now: [first attempts, retries].
    running: HashMap<String, [u32; 2]>,
    running_changed: bool,
    actor_class: String,
    dropped: u64,
}

fn recorder() -> MutexGuard<'static, Recorder> {
    static R: OnceLock<Mutex<Recorder>> = OnceLock::new();
    R.get_or_init(Default::default).lock().unwrap_or_else(|p| p.into_inner())
}

fn valid_name(name: &str) -> bool {
    let mut chars = name.chars();
    matches!(chars.next(), Some(c) if c.is_ascii_alphabetic() || c == '_' || c == ':')
        && chars.all(|c| c.is_ascii_alphanumeric() || c == '_' || c == ':')
}

fn describe(d: &pb::MetricDef) -> String {
    let kind = match Kind::try_from(d.kind).unwrap_or_default() {
        Kind::Counter => "a Counter",
        Kind::Gauge => "a Gauge",
        Kind::Histogram => "a Histogram",
        Kind::Unspecified => "unknown",
    };
    if d.boundaries.is_empty() {
        format!("{kind} with tag keys {:?}", d.tag_keys)
    } else {
        format!("{kind} with tag keys {:?} and boundaries {:?}", d.tag_keys, d.boundaries)
    }
}

/// Defines a metric in this process (again is fine when the definition is the same).
///
/// # Errors
/// [`MetricError::InvalidName`], [`MetricError::Boundaries`] (a histogram needs
/// positive, ascending boundaries), or [`MetricError::Conflict`] when the name is
/// defined differently.
pub fn define(
    kind: Kind,
    name: &str,
    description: &str,
    tag_keys: &[String],
    boundaries: &[f64],
) -> Result<(), MetricError> {
    if !valid_name(name) {
        return Err(MetricError::InvalidName(name.to_string()));
    }
    if kind == Kind::Histogram {
        if boundaries.is_empty() {
            return Err(MetricError::Boundaries {
                name: name.into(),
                detail: "boundaries are required".into(),
            });
        }
        if let Some(b) = boundaries.iter().find(|b| b.is_nan() || **b <= 0.0 || b.is_infinite()) {
            return Err(MetricError::Boundaries {
                name: name.into(),
                detail: format!("boundary {b} is not a positive number"),
            });
        }
        if boundaries.windows(2).any(|w| w[0] >= w[1]) {
            return Err(MetricError::Boundaries {
                name: name.into(),
                detail: format!("boundaries {boundaries:?} are not strictly ascending"),
            });
        }
    }
    let def = pb::MetricDef {
        name: name.to_string(),
        description: description.to_string(),
        kind: kind as i32,
        tag_keys: tag_keys.to_vec(),
        boundaries: if kind == Kind::Histogram { boundaries.to_vec() } else { vec![] },
    };
    let mut r = recorder();
    match r.defs.get(name) {
        Some(d)
            if d.kind != def.kind
                || d.tag_keys != def.tag_keys
                || d.boundaries != def.boundaries =>
        {
            Err(MetricError::Conflict {
                name: name.into(),
                existing: describe(d),
                wanted: describe(&def),
            })
        }
        Some(_) => Ok(()),
        None => {
            r.defs.insert(name.to_string(), def);
            Ok(())
        }
    }
}

/// Records `value` for the series of `tag_values` (in the definition's tag-key order):
/// a counter adds it (it must be > 0), a gauge takes it, a histogram observes it.
///
/// # Errors
/// [`MetricError::Undefined`], [`MetricError::Tags`] (wrong number of values) or
/// [`MetricError::Value`] (a counter increment that is not > 0, a value that is NaN).
pub fn record(name: &str, tag_values: Vec<String>, value: f64) -> Result<(), MetricError> {
    let mut r = recorder();
    let r = &mut *r;
    let def = r.defs.get(name).ok_or_else(|| MetricError::Undefined(name.to_string()))?;
    if tag_values.len() != def.tag_keys.len() {
        return Err(MetricError::Tags {
            name: name.into(),
            keys: def.tag_keys.clone(),
            got: tag_values.len(),
        });
    }
    if value.is_nan() {
        return Err(MetricError::Value { name: name.into(), detail: "value is NaN".into() });
    }
    let kind = Kind::try_from(def.kind).unwrap_or_default();
    if kind == Kind::Counter && value <= 0.0 {
        return Err(MetricError::Value {
            name: name.into(),
            detail: format!("value must be >0, got {value}"),
        });
    }
    let key = (name.to_string(), tag_values);
    if !r.series.contains_key(&key) && r.series.len() >= MAX_SERIES {
        r.dropped += 1;
        return Ok(());
    }
    let bounds = def.boundaries.clone();
    let p = r.series.entry(key.clone()).or_default();
    match kind {
        Kind::Counter => p.value += value,
        Kind::Gauge => p.value = value,
        Kind::Histogram => {
            if p.buckets.is_empty() {
                p.buckets = vec![0; bounds.len() + 1];
            }
            let i = bounds.iter().position(|b| value <= *b).unwrap_or(bounds.len());
            p.buckets[i] += 1;
            p.sum += value;
            p.count += 1;
        }
        Kind::Unspecified => {}
    }
    r.dirty.insert(key);
    Ok(())
}

/// The executor started a task (`ray_tasks{State="RUNNING",Source="executor"}`).
pub(crate) fn task_started(spec: &pb::TaskSpec) {
    let mut r = recorder();
    let i = usize::from(spec.attempt > 0);
    // No allocation when the name is known already (the common case).
    match r.running.get_mut(&spec.name) {
        Some(n) => n[i] += 1,
        None => {
            let mut n = [0; 2];
            n[i] = 1;
            r.running.insert(spec.name.clone(), n);
        }
    }
    r.running_changed = true;
}

/// The executor finished (or gave up on) a task it started.
pub(crate) fn task_ended(spec: &pb::TaskSpec) {
    let mut r = recorder();
    if let Some(n) = r.running.get_mut(&spec.name) {
        let i = usize::from(spec.attempt > 0);
        n[i] = n[i].saturating_sub(1);
        if *n == [0, 0] {
            r.running.remove(&spec.name);
        }
    }
    r.running_changed = true;
}

/// This worker hosts an actor of `class` (`ray_actors{Source="executor"}`).
pub(crate) fn set_actor_class(class: &str) {
    let mut r = recorder();
    r.actor_class = class.to_string();
    r.running_changed = true;
}

/// Where this process's metrics are exported: the node agent it reports to
/// (`host:port` of its gRPC server), or `None` before `init`.
pub fn destination() -> Option<String> {
    crate::core::try_core().map(|c| c.agent_address.clone())
}

/// Whether this process runs on a host without a node of its own (a driver attached
/// to a remote cluster), whose metrics the head node's agent exports.
pub fn reports_to_another_host() -> bool {
    crate::core::try_core().is_some_and(|c| c.node_id.starts_with("driver-"))
}

/// Series dropped because this process held [`MAX_SERIES`].
pub fn dropped_series() -> u64 {
    recorder().dropped
}

/// The report of what changed since the last one (`None`: nothing did).
/// A series: metric name and tag values.
type SeriesKey = (String, Vec<String>);

fn take_report(core: &Core) -> Option<(pb::ReportMetricsRequest, Vec<SeriesKey>)> {
    let mut r = recorder();
    if r.dirty.is_empty() && !r.running_changed {
        return None;
    }
    let keys: Vec<SeriesKey> = r.dirty.drain().collect();
    let mut defs = Vec::new();
    let mut named = HashSet::new();
    let points: Vec<pb::MetricPoint> = keys
        .iter()
        .filter_map(|k| {
            let p = r.series.get(k)?;
            if !r.sent.contains(&k.0) && named.insert(k.0.clone()) {
                defs.extend(r.defs.get(&k.0).cloned());
            }
            Some(pb::MetricPoint {
                name: k.0.clone(),
                tag_values: k.1.clone(),
                value: p.value,
                bucket_counts: p.buckets.clone(),
                sum: p.sum,
                count: p.count,
            })
        })
        .collect();
    r.running_changed = false;
    let running =
        r.running
            .iter()
            .flat_map(|(name, n)| {
                [(false, n[0]), (true, n[1])].into_iter().filter(|(_, c)| *c > 0).map(
                    |(is_retry, count)| pb::RunningTasks { name: name.clone(), is_retry, count },
                )
            })
            .collect();
    let req = pb::ReportMetricsRequest {
        worker_id: core.worker_id.clone(),
        pid: std::process::id(),
        defs,
        points,
        running,
        actor_class: r.actor_class.clone(),
        job_id: core.job_id.clone(),
    };
    Some((req, keys))
}

/// Sends what changed to the node agent. A failed report is sent again with the next
/// flush (its series stay marked changed); an agent that lacks a definition gets every
/// definition and series again.
pub(crate) async fn flush(core: &Core) {
    let Some((req, keys)) = take_report(core) else { return };
    let names: Vec<String> = req.defs.iter().map(|d| d.name.clone()).collect();
    let result = match core.agent_client(&core.agent_address) {
        Ok(mut agent) => {
            let mut call = tonic::Request::new(req);
            call.set_timeout(Duration::from_secs(5));
            agent.report_metrics(call).await.map(|r| r.into_inner().defs_known)
        }
        Err(e) => Err(tonic::Status::unavailable(e.to_string())),
    };
    let mut r = recorder();
    match result {
        Ok(true) => r.sent.extend(names),
        Ok(false) => {
            // The agent restarted or never got them: everything again.
            r.sent.clear();
            let all: Vec<_> = r.series.keys().cloned().collect();
            r.dirty.extend(all);
        }
        Err(_) => {
            r.dirty.extend(keys);
            r.running_changed = true;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn definitions_are_checked_and_must_agree() {
        assert!(matches!(
            define(Kind::Counter, "1bad", "", &[], &[]),
            Err(MetricError::InvalidName(_))
        ));
        let keys = vec!["route".to_string()];
        define(Kind::Counter, "t_reqs", "", &keys, &[]).unwrap();
        define(Kind::Counter, "t_reqs", "other description", &keys, &[]).unwrap();
        let e = define(Kind::Gauge, "t_reqs", "", &keys, &[]).unwrap_err();
        assert!(e.to_string().contains("already defined as a Counter"), "{e}");
        for bad in [&[][..], &[0.0][..], &[2.0, 1.0][..]] {
            assert!(define(Kind::Histogram, "t_h", "", &[], bad).is_err(), "{bad:?}");
        }
    }

    #[test]
    fn records_accumulate_per_kind() {
        define(Kind::Counter, "t_c", "", &["a".into()], &[]).unwrap();
        define(Kind::Histogram, "t_hist", "", &[], &[1.0, 5.0]).unwrap();
        record("t_c", vec!["x".into()], 2.0).unwrap();
        record("t_c", vec!["x".into()], 3.0).unwrap();
        assert!(record("t_c", vec!["x".into()], 0.0).is_err(), "counters only go up");
        assert!(matches!(record("t_c", vec![], 1.0), Err(MetricError::Tags { .. })));
        assert!(matches!(record("nope", vec![], 1.0), Err(MetricError::Undefined(_))));
        for v in [0.5, 3.0, 9.0, 1.0] {
            record("t_hist", vec![], v).unwrap();
        }
        let r = recorder();
        assert_eq!(r.series[&("t_c".to_string(), vec!["x".to_string()])].value, 5.0);
        let h = &r.series[&("t_hist".to_string(), vec![])];
        assert_eq!(h.buckets, vec![2, 1, 1]);
        assert_eq!((h.sum, h.count), (13.5, 4));
    }
}
