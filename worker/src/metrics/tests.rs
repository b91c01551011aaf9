//! Unit tests of the agent's metrics: user-metric reports (METRICS-4) and the executor
//! series (METRICS-2).

use tpuray_proto::metrics::Exposition;

use super::exposition::{executor, user_metrics};
use super::*;

fn def(name: &str, kind: pb::metric_def::Kind, keys: &[&str], bounds: &[f64]) -> pb::MetricDef {
    pb::MetricDef {
        name: name.into(),
        description: "d".into(),
        kind: kind as i32,
        tag_keys: keys.iter().map(|k| k.to_string()).collect(),
        boundaries: bounds.to_vec(),
    }
}

fn point(name: &str, tags: &[&str], value: f64) -> pb::MetricPoint {
    pb::MetricPoint {
        name: name.into(),
        tag_values: tags.iter().map(|t| t.to_string()).collect(),
        value,
        ..Default::default()
    }
}

fn text(m: &AgentMetrics) -> String {
    let mut e = Exposition::new(vec![]);
    user_metrics(&mut e, &lock(&m.reports));
    e.encode()
}

/// METRICS-4.
#[test]
fn counters_sum_processes_count_repeated_reports_once_and_survive_exits() {
    use pb::metric_def::Kind;
    let m = AgentMetrics::default();
    let d = def("reqs", Kind::Counter, &["route"], &[]);
    let report = |w: &str, v: f64, defs: Vec<pb::MetricDef>| pb::ReportMetricsRequest {
        worker_id: w.into(),
        pid: 0,
        defs,
        points: vec![point("reqs", &["/a"], v)],
        ..Default::default()
    };
    assert!(!m.report(report("w1", 2.0, vec![])), "an unknown definition is said so");
    assert!(m.report(report("w1", 2.0, vec![d.clone()])));
    assert!(m.report(report("w1", 2.0, vec![])), "the same total again counts once");
    assert!(m.report(report("w2", 3.0, vec![d])));
    assert!(text(&m).contains(r#"ray_reqs_total{route="/a"} 5"#), "{}", text(&m));
    m.retire_gone(|id, _| id == "w2");
    assert!(
        text(&m).contains(r#"ray_reqs_total{route="/a"} 5"#),
        "an exited process's total stays"
    );
    m.report(report("w2", 4.0, vec![]));
    assert!(text(&m).contains(r#"ray_reqs_total{route="/a"} 6"#), "{}", text(&m));
}

#[test]
fn gauges_read_the_last_value_set_and_histograms_add_buckets() {
    use pb::metric_def::Kind;
    let m = AgentMetrics::default();
    let g = def("temp", Kind::Gauge, &[], &[]);
    let h = def("lat", Kind::Histogram, &[], &[1.0, 10.0]);
    let hp = |b: Vec<u64>, sum, count| pb::MetricPoint {
        name: "lat".into(),
        bucket_counts: b,
        sum,
        count,
        ..Default::default()
    };
    m.report(pb::ReportMetricsRequest {
        worker_id: "a".into(),
        defs: vec![g, h],
        points: vec![point("temp", &[], 1.0), hp(vec![1, 0, 1], 20.5, 2)],
        ..Default::default()
    });
    m.report(pb::ReportMetricsRequest {
        worker_id: "b".into(),
        points: vec![point("temp", &[], 7.0), hp(vec![0, 2, 0], 8.0, 2)],
        ..Default::default()
    });
    let t = text(&m);
    assert!(t.contains("ray_temp 7\n"), "{t}");
    assert!(t.contains(r#"ray_lat_bucket{le="1"} 1"#), "{t}");
    assert!(t.contains(r#"ray_lat_bucket{le="10"} 3"#), "{t}");
    assert!(t.contains(r#"ray_lat_bucket{le="+Inf"} 4"#), "{t}");
    assert!(t.contains("ray_lat_sum 28.5"), "{t}");
    // A histogram point with the wrong number of buckets is not taken.
    m.report(pb::ReportMetricsRequest {
        worker_id: "c".into(),
        points: vec![hp(vec![5], 1.0, 5)],
        ..Default::default()
    });
    assert!(text(&m).contains("ray_lat_count 4"));
}

#[test]
fn executor_series_fall_to_zero_when_the_task_ends() {
    let m = AgentMetrics::default();
    let v = AgentView {
        workers: vec![WorkerView {
            worker_id: "w".into(),
            pid: 1,
            job_id: "j".into(),
            state: "LEASED",
            tpu_chips: vec![],
        }],
        ..Default::default()
    };
    let run = |n: u32| pb::ReportMetricsRequest {
        worker_id: "w".into(),
        job_id: "j".into(),
        running: if n > 0 {
            vec![pb::RunningTasks { name: "f".into(), is_retry: false, count: n }]
        } else {
            vec![]
        },
        ..Default::default()
    };
    let mut seen = SeenSeries::default();
    let scrape = |seen: &mut SeenSeries| {
        let mut e = Exposition::new(vec![]);
        executor(&mut e, seen, &v, &lock(&m.reports));
        e.encode()
    };
    m.report(run(2));
    m.report(run(0));
    let line = r#"ray_tasks{State="RUNNING",Name="f",IsRetry="0",Source="executor",JobId="j"}"#;
    // Reported running once, never scraped while running: still a series, at 0.
    assert!(scrape(&mut seen).contains(&format!("{line} 0")));
    m.report(run(2));
    assert!(scrape(&mut seen).contains(&format!("{line} 2")));
    m.report(run(0));
    assert!(scrape(&mut seen).contains(&format!("{line} 0")), "METRICS-2");
}
