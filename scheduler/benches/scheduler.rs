//! Criterion benchmarks: default-policy decisions (decided against the whole cluster view and
//! applied, then released) and 64-bundle placement groups at 100, 1,000 and 10,000 nodes of
//! mixed CPU, GPU and TPU-slice hosts with labels.

use std::collections::BTreeMap;
use std::time::Duration;

use criterion::{BenchmarkId, Criterion, Throughput, criterion_group, criterion_main};
use tpuray_scheduler::{
    Bundle, ClusterView, Decision, Labels, NodeView, PgDecision, PgStrategy, Request, ResourceSet,
    Strategy, TpuHostInfo, place_group_in, release_group_in, schedule_in,
};

fn res(json: &str) -> ResourceSet {
    ResourceSet::from_json(json).unwrap()
}

/// `n` nodes: 60% CPU-only, 20% GPU, 20% hosts of 4-host v6e-16 slices; zone labels.
fn cluster(n: u32) -> Vec<NodeView<u32>> {
    (0..n)
        .map(|i| {
            let zone = format!("zone=z{}", i % 8);
            let (total, labels) = match i % 10 {
                0..=5 => (res(r#"{"CPU": 16, "memory": 64e9}"#), Labels::parse(&zone).unwrap()),
                6 | 7 => (
                    res(r#"{"CPU": 32, "GPU": 8, "memory": 256e9}"#),
                    Labels::parse(&format!("{zone},gpu=a100")).unwrap(),
                ),
                _ => {
                    let tpu_idx = (i / 10) * 2 + (i % 10 - 8);
                    let env: BTreeMap<String, String> = [
                        ("TPU_ACCELERATOR_TYPE", "v6e-16".to_string()),
                        ("TPU_NAME", format!("s{}", tpu_idx / 4)),
                        ("TPU_WORKER_ID", (tpu_idx % 4).to_string()),
                        ("TPU_TOPOLOGY", "4x4".to_string()),
                    ]
                    .into_iter()
                    .map(|(k, v)| (k.to_string(), v))
                    .collect();
                    let info = TpuHostInfo::from_env(&env, 4).unwrap();
                    let mut total = res(r#"{"CPU": 200, "memory": 512e9}"#);
                    total.add(&info.resources());
                    let mut labels = info.labels();
                    labels.0.insert("zone".into(), format!("z{}", i % 8));
                    (total, labels)
                }
            };
            NodeView { id: i, available: total.clone(), total, labels, alive: true }
        })
        .collect()
}

fn requests() -> Vec<Request<u32>> {
    let sel = |k: &str, v: &str| {
        tpuray_scheduler::parse_label_selector(&[(k.to_string(), v.to_string())].into()).unwrap()
    };
    let r = |d: &str, label_selector| Request {
        demand: res(d),
        strategy: Strategy::Default,
        label_selector,
    };
    vec![
        r(r#"{"CPU": 1}"#, vec![]),
        r(r#"{"CPU": 0.5, "memory": 1e9}"#, vec![]),
        r(r#"{"CPU": 1, "GPU": 1}"#, vec![]),
        r(r#"{"CPU": 2}"#, sel("zone", "in(z1,z3)")),
        r(r#"{"TPU": 1}"#, sel("ray.io/accelerator-type", "TPU-V6E")),
        r(r#"{"CPU": 1, "GPU": 0.25}"#, sel("gpu", "a100")),
    ]
}

fn decisions(c: &mut Criterion) {
    let mut g = c.benchmark_group("decision");
    g.sample_size(10).measurement_time(Duration::from_secs(3)).warm_up_time(Duration::from_secs(1));
    for n in [100u32, 1_000, 10_000] {
        let mut view = ClusterView::new(cluster(n));
        let reqs = requests();
        // A batch: 64 decisions applied, then released (the cluster returns to its state).
        const BATCH: usize = 64;
        g.throughput(Throughput::Elements(BATCH as u64));
        let mut seed = 0u64;
        let mut placed = Vec::with_capacity(BATCH);
        g.bench_function(BenchmarkId::from_parameter(n), |b| {
            b.iter(|| {
                for j in 0..BATCH {
                    seed += 1;
                    let r = &reqs[j % reqs.len()];
                    let local = (seed % u64::from(n)) as u32;
                    if let Decision::Place(id) = schedule_in(&mut view, r, Some(&local), seed) {
                        placed.push((id, j % reqs.len()));
                    }
                }
                for (id, r) in placed.drain(..) {
                    view.release(&id, &reqs[r].demand);
                }
            })
        });
    }
    g.finish();
}

fn groups(c: &mut Criterion) {
    let mut g = c.benchmark_group("pg64");
    g.sample_size(10).measurement_time(Duration::from_secs(3)).warm_up_time(Duration::from_secs(1));
    let bundle = |d: &str| Bundle { demand: res(d), label_selector: vec![] };
    let cases = [
        ("pack", PgStrategy::Pack, bundle(r#"{"CPU": 1}"#)),
        ("spread", PgStrategy::Spread, bundle(r#"{"CPU": 1, "memory": 1e9}"#)),
        ("strict_spread", PgStrategy::StrictSpread, bundle(r#"{"CPU": 2}"#)),
        ("spread_gpu", PgStrategy::Spread, bundle(r#"{"CPU": 1, "GPU": 1}"#)),
    ];
    for n in [100u32, 1_000, 10_000] {
        let mut view = ClusterView::new(cluster(n));
        for (name, strategy, b) in &cases {
            let bundles = vec![b.clone(); 64];
            let mut seed = 0u64;
            g.bench_function(BenchmarkId::new(*name, n), |bch| {
                bch.iter(|| {
                    seed += 1;
                    match place_group_in(&mut view, &bundles, *strategy, seed) {
                        PgDecision::Placed(ids) => release_group_in(&mut view, &bundles, &ids),
                        other => panic!("{name} at {n} nodes: {other:?}"),
                    }
                })
            });
        }
    }
    g.finish();
}

criterion_group!(benches, decisions, groups);
criterion_main!(benches);
