//! Placement groups and TPU slice groups through the public Rust SDK on a local cluster of
//! simulated TPU hosts (TPU.md): two v6e-16 slices of 4 hosts, one v6e-8 host and two CPU
//! nodes. The `slices` scenario of `tpuray-test-driver` drives the groups; this test reads
//! its lines, `tpuray status` and `tpuray list placement-groups` around it.

use std::collections::{BTreeMap, HashSet};
use std::path::PathBuf;
use std::time::Duration;

use tpuray_tests::*;

fn driver_bin() -> PathBuf {
    PathBuf::from(env!("CARGO_BIN_EXE_tpuray-test-driver"))
}

/// The value of `key=` in a `KIND key=value ...` line.
fn field<'a>(line: &'a str, key: &str) -> &'a str {
    let pat = format!(" {key}=");
    let i = line.find(&pat).unwrap_or_else(|| panic!("no {key}= in {line:?}")) + pat.len();
    let rest = &line[i..];
    if key == "reason" { rest } else { rest.split(' ').next().unwrap_or_default() }
}

/// Starts one simulated host of slice `name` (`TPU_*` environment plus `--resources
/// '{"TPU": N}'`, exactly TPU.md's line).
fn tpu_host(
    c: &mut Cluster,
    ty: &str,
    name: &str,
    topology: &str,
    worker: u32,
    chips: u32,
) -> String {
    c.set_env("TPU_ACCELERATOR_TYPE", ty);
    c.set_env("TPU_NAME", name);
    c.set_env("TPU_TOPOLOGY", topology);
    c.set_env("TPU_WORKER_ID", &worker.to_string());
    let res = format!(r#"{{"TPU": {chips}}}"#);
    c.add_node(&["--num-cpus", "1", "--resources", &res]).node_id
}

/// SCHED-15: a slice group takes every host of one intact slice in worker-id order, never a
/// mix; a third waits. SCHED-6: one-CPU tasks land on the CPU nodes only.
#[test]
fn slice_groups_take_whole_slices_in_worker_order_and_wait_their_turn() {
    let mut c = Cluster::new();
    let head = c.start_head(&["--num-cpus", "2"]).node_id;
    let cpu2 = c.add_node(&["--num-cpus", "2"]).node_id;
    // slice name -> node ids in worker-id order
    let mut slices: BTreeMap<String, Vec<String>> = BTreeMap::new();
    for name in ["sa", "sb"] {
        for w in 0..4 {
            let id = tpu_host(&mut c, "v6e-16", name, "4x4", w, 4);
            slices.entry(name.to_string()).or_default().push(id);
        }
    }
    let single = tpu_host(&mut c, "v6e-8", "sc", "2x4", 0, 8);
    for k in ["TPU_ACCELERATOR_TYPE", "TPU_NAME", "TPU_TOPOLOGY", "TPU_WORKER_ID"] {
        c.set_env(k, "");
    }

    let go = c.dir().join("go");
    let go_s = go.display().to_string();
    let addr = c.head_addr();
    let mut d = Driver::start(&c, &driver_bin(), &["slices", &addr, &go_s], &[]);

    // A slice group lands on one slice, bundles in worker-id order; a second on the other.
    let pg1 = d.wait_line("PG1 ", Duration::from_secs(60));
    assert_eq!(field(&pg1, "hosts"), "4", "{pg1}");
    assert_eq!(field(&pg1, "chips"), "4", "{pg1}");
    let pg2 = d.wait_line("PG2 ", Duration::from_secs(60));
    let actor = d.wait_line("ACTOR ", Duration::from_secs(60));
    let members = |tag: &str, d: &Driver| -> Vec<(String, String, String)> {
        let mut m: Vec<(usize, (String, String, String))> = d
            .stdout()
            .iter()
            .filter(|l| l.starts_with(&format!("MEMBER pg={tag} ")))
            .map(|l| {
                let b: usize = field(l, "bundle").parse().expect("bundle index");
                (b, (field(l, "node").into(), field(l, "worker").into(), field(l, "slice").into()))
            })
            .collect();
        m.sort();
        m.into_iter().map(|x| x.1).collect()
    };
    let m1 = members("1", &d);
    let m2 = members("2", &d);
    for (tag, m) in [("1", &m1), ("2", &m2)] {
        assert_eq!(m.len(), 4, "group {tag}: {m:?}");
        let slice = &m[0].2;
        let nodes: Vec<String> = m.iter().map(|x| x.0.clone()).collect();
        assert_eq!(Some(&nodes), slices.get(slice), "group {tag} is one whole slice in order");
        for (i, (_, worker, s)) in m.iter().enumerate() {
            assert_eq!(worker, &i.to_string(), "bundle {i} of group {tag} runs on worker {i}");
            assert_eq!(s, slice, "group {tag} never mixes slices");
        }
    }
    assert_ne!(m1[0].2, m2[0].2, "the second group takes the other slice");
    assert_eq!(field(&actor, "node"), m2[1].0, "an actor in bundle 1 runs on its host");

    // A third waits, shown as pending in status and in the group list.
    let pg3 = d.wait_line("PG3_PENDING ", Duration::from_secs(60));
    assert_eq!(field(&pg3, "created"), "false", "{pg3}");
    let pg3_id = field(&pg3, "id").to_string();
    let status = c.status();
    assert!(
        status.lines().any(|l| l.contains("pending") && l.contains(&pg3_id) && l.contains("TPU")),
        "status shows the third group's demand as pending:\n{status}"
    );
    let groups = c.list("placement-groups");
    let row = groups
        .as_array()
        .expect("list placement-groups is a JSON list")
        .iter()
        .find(|g| g["placement_group_id"] == pg3_id.as_str())
        .unwrap_or_else(|| panic!("group {pg3_id} not listed: {groups:#}"))
        .clone();
    assert_eq!(row["state"], "PENDING", "{row:#}");
    assert!(row["pending_reason"].as_str().unwrap_or("").contains("v6e-16"), "{row:#}");
    let table = c.cli_ok(&["list", "placement-groups", "--address", &addr]);
    assert!(table.contains("PENDING") && table.contains("CREATED"), "{table}");
    let pg1_id = field(&pg1, "id");
    let pg2_id = field(&pg2, "id");
    assert!(table.contains(&pg1_id[..8.min(pg1_id.len())]) || table.contains(pg1_id), "{table}");
    assert!(table.contains(pg2_id), "{table}");

    // Removing the first lets the third proceed, on the freed slice.
    std::fs::write(&go, "go").expect("write go file");
    let same = d.wait_line("PG3 ", Duration::from_secs(60));
    assert_eq!(field(&same, "same_hosts_as_pg1"), "true", "{same}");

    // What ran inside a removed group is stopped.
    let task = d.wait_line("TASK_AFTER_REMOVE ", Duration::from_secs(60));
    assert_eq!(field(&task, "kind"), "WorkerDied", "{task}");
    let actor = d.wait_line("ACTOR_AFTER_REMOVE ", Duration::from_secs(60));
    assert_eq!(field(&actor, "kind"), "ActorDied", "{actor}");

    // STRICT_SPREAD with more bundles than nodes is infeasible at once, not hung.
    let big = d.wait_line("BIG ", Duration::from_secs(60));
    assert_eq!(field(&big, "created"), "false", "{big}");
    assert!(field(&big, "reason").contains("STRICT_SPREAD"), "{big}");

    // Four concurrent one-CPU tasks land on the CPU nodes only.
    let cpu = d.wait_line("CPU ", Duration::from_secs(60));
    let cpu_nodes: HashSet<&str> = field(&cpu, "nodes").split(',').collect();
    let allowed: HashSet<&str> = [head.as_str(), cpu2.as_str()].into();
    assert!(cpu_nodes.is_subset(&allowed), "CPU tasks ran on {cpu_nodes:?}, CPU nodes {allowed:?}");
    assert!(!cpu_nodes.contains(single.as_str()));
    let out = d.finish(Duration::from_secs(30));
    out.assert_success();
    eprintln!("{out}");

    // Every bundle was given back: TPU hosts are whole again.
    wait_until(Duration::from_secs(10), "all TPU chips free again", || {
        let nodes = c.list("nodes");
        nodes.as_array().expect("nodes").iter().all(|n| {
            let total = n["resources_total"]["TPU"].as_f64().unwrap_or(0.0);
            let avail = n["resources_available"]["TPU"].as_f64().unwrap_or(0.0);
            total == avail
                && !n["resources_total"]
                    .as_object()
                    .expect("map")
                    .keys()
                    .any(|k| k.contains("_group_"))
        })
    });
}

/// AGENT-7 on one simulated v6e-8 host: eight one-chip actors see chips 0..7, one each,
/// with distinct libtpu ports; a 4-chip task gets an aligned block (SCHED-12) and the bounds
/// of TPU.md; a 3-chip request is refused naming the valid counts.
#[test]
fn chips_are_handed_out_as_aligned_blocks_with_their_environment() {
    let mut c = Cluster::new();
    c.start_head(&["--num-cpus", "1"]);
    tpu_host(&mut c, "v6e-8", "sc", "2x4", 0, 8);
    let addr = c.head_addr();
    let out =
        Driver::start(&c, &driver_bin(), &["chips", &addr], &[]).finish(Duration::from_secs(90));
    out.assert_success();
    let holders: Vec<&String> = out.stdout.iter().filter(|l| l.starts_with("HOLDER ")).collect();
    assert_eq!(holders.len(), 8, "{out}");
    let mut chips: Vec<u32> =
        holders.iter().map(|l| field(l, "chips").parse().expect("one chip index")).collect();
    chips.sort();
    assert_eq!(chips, (0..8).collect::<Vec<_>>(), "{out}");
    let ports: HashSet<&str> = holders.iter().map(|l| field(l, "port")).collect();
    assert_eq!(ports.len(), 8, "distinct libtpu ports: {out}");
    for l in &holders {
        assert_eq!(field(l, "bounds"), "1,1,1", "{l}");
        assert_eq!(field(l, "process_bounds"), "1,1,1", "{l}");
    }
    let four = out.line("FOUR ");
    assert!(["0,1,2,3", "4,5,6,7"].contains(&field(four, "chips")), "{four}");
    assert_eq!(field(four, "bounds"), "2,2,1", "{four}");
    let three = out.line("THREE ");
    assert!(three.contains("valid counts: 1, 2, 4, 8"), "{three}");
}
