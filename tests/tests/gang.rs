//! Multi-host slice gangs (TPU.md "Multi-host slice gangs", GANG-1..3) through the Rust SDK
//! on simulated hosts: two v6e-16 slices of 4 hosts, one v6e-8 host and a CPU node. The
//! `gang` scenario of `tpuray-test-driver` runs the gangs; this test checks every member's
//! environment against TPU.md, then kills one host's node agent while a gang runs on its
//! slice and checks that the whole gang ran again, on the other slice.

use std::collections::{BTreeMap, BTreeSet};
use std::path::PathBuf;
use std::time::Duration;

use tpuray_tests::*;

type Env = BTreeMap<String, String>;

fn driver_bin() -> PathBuf {
    PathBuf::from(env!("CARGO_BIN_EXE_tpuray-test-driver"))
}

fn tpu_host(c: &mut Cluster, ty: &str, name: &str, topology: &str, worker: u32, chips: u32) {
    c.set_env("TPU_ACCELERATOR_TYPE", ty);
    c.set_env("TPU_NAME", name);
    c.set_env("TPU_TOPOLOGY", topology);
    c.set_env("TPU_WORKER_ID", &worker.to_string());
    let res = format!(r#"{{"TPU": {chips}}}"#);
    c.add_node(&["--num-cpus", "1", "--resources", &res]);
}

fn members(out: &DriverOutput, tag: &str) -> Vec<Env> {
    let prefix = format!("{tag} ");
    out.stdout
        .iter()
        .filter_map(|l| l.strip_prefix(&prefix))
        .map(|j| serde_json::from_str(j).unwrap_or_else(|e| panic!("{tag} line {j:?}: {e}")))
        .collect()
}

/// Every value of `key` over `ms` is the same; returns it.
fn same<'a>(ms: &'a [Env], key: &str) -> &'a str {
    let first = ms[0].get(key).unwrap_or_else(|| panic!("{key} not set: {:?}", ms[0]));
    for m in ms {
        assert_eq!(m.get(key), Some(first), "{key} differs between members");
    }
    first
}

/// The values of `key` over `ms` are exactly `0..n`.
fn permutation(ms: &[Env], key: &str) {
    let mut v: Vec<u32> = ms.iter().map(|m| m[key].parse().expect(key)).collect();
    v.sort();
    assert_eq!(v, (0..ms.len() as u32).collect::<Vec<_>>(), "{key} is not a permutation");
}

/// GANG-2: no `host:port` twice among the gang's own addresses.
fn no_duplicate_ports(ms: &[Env]) {
    let mut used = BTreeSet::new();
    let mut add = |a: String, what: &str| {
        assert!(used.insert(a.clone()), "{a} used twice ({what})");
    };
    let first = &ms[0];
    add(format!("{}:{}", first["MASTER_ADDR"], first["MASTER_PORT"]), "master");
    add(first["JAX_COORDINATOR_ADDRESS"].clone(), "jax");
    if let Some(p) = first.get("MEGASCALE_PORT") {
        add(format!("{}:{p}", first["MEGASCALE_COORDINATOR_ADDRESS"]), "megascale");
    }
    let builders: BTreeSet<&String> =
        ms.iter().map(|m| &m["TORCH_TPU_SLICEBUILDER_ADDRESSES"]).collect();
    for b in builders {
        for a in b.split(',') {
            add(a.to_string(), "slice builder");
        }
    }
    for m in ms {
        if let Some(p) = m.get("TPU_PROCESS_PORT") {
            add(format!("{}:{p}", m["MASTER_ADDR"]), "libtpu process");
        }
    }
}

/// TPU.md's gang section for one v6e-16 slice, one process per host.
fn check_one_slice_per_host(ms: &[Env]) {
    assert_eq!(ms.len(), 4, "{ms:?}");
    permutation(ms, "TPU_WORKER_ID");
    for m in ms {
        assert_eq!(m["TPU_WORKER_ID"], m["NODE_RANK"], "simulated host sets NODE_RANK");
        assert_eq!(m["NODE_RANK"], m["JOB_COMPLETION_INDEX"]);
        assert_eq!(m["TPU_VISIBLE_CHIPS"], "0,1,2,3", "whole host");
        assert!(!m.contains_key("TPU_CHIPS_PER_PROCESS_BOUNDS"), "whole host: bounds unset");
        assert!(!m.contains_key("RANK") && !m.contains_key("MEGASCALE_NUM_SLICES"));
    }
    let nodes: BTreeSet<&String> = ms.iter().map(|m| &m["NODE"]).collect();
    assert_eq!(nodes.len(), 4, "one member per host");
    same(ms, "TPU_NAME");
    assert_eq!(same(ms, "TPU_WORKER_HOSTNAMES"), "127.0.0.1,127.0.0.1,127.0.0.1,127.0.0.1");
    assert_eq!(same(ms, "TORCH_TPU_SLICEBUILDER_ADDRESSES").split(',').count(), 16);
    assert_eq!(same(ms, "TORCH_TPU_TOPOLOGY"), "4,4,1");
    same(ms, "TORCH_TPU_XPROF_SESSION_ID");
    assert_eq!(same(ms, "NNODES"), "4");
    assert_eq!(same(ms, "WORLD_SIZE"), "16");
    assert_eq!(same(ms, "MASTER_ADDR"), "127.0.0.1");
    same(ms, "MASTER_PORT");
    same(ms, "JAX_COORDINATOR_ADDRESS");
    assert_eq!(same(ms, "JAX_PLATFORMS"), "cpu", "simulated hosts have no TPU devices");
    assert_eq!(same(ms, "TPU_ACCELERATOR_TYPE"), "v6e-16");
    no_duplicate_ports(ms);
}

/// AGENT-9: a per-chip gang member gets exactly its planned `TPU_VISIBLE_CHIPS`, and the
/// gang's `TPU_PROCESS_BOUNDS` win over the independent-process defaults.
#[test]
fn slice_gangs_get_tpu_md_environment_and_restart_whole_on_an_intact_slice() {
    let mut c = Cluster::new();
    c.start_head(&["--num-cpus", "2"]);
    for name in ["sa", "sb"] {
        for w in 0..4 {
            tpu_host(&mut c, "v6e-16", name, "4x4", w, 4);
        }
    }
    tpu_host(&mut c, "v6e-8", "sc", "2x4", 0, 8);
    for k in ["TPU_ACCELERATOR_TYPE", "TPU_NAME", "TPU_TOPOLOGY", "TPU_WORKER_ID"] {
        c.set_env(k, "");
    }
    let hold = c.dir().join("hold");
    std::fs::create_dir_all(&hold).expect("hold dir");
    let addr = c.head_addr();
    let d =
        Driver::start(&c, &driver_bin(), &["gang", &addr, hold.to_str().expect("utf-8 path")], &[]);

    // The survivor gang's generation 0 reports its hosts' agents, then blocks: kill one.
    let mut held = Vec::new();
    wait_until(Duration::from_secs(240), "the survivor gang's members to start", || {
        held = std::fs::read_dir(&hold)
            .map(|r| {
                r.filter_map(|e| e.ok())
                    .map(|e| e.file_name().to_string_lossy().to_string())
                    .filter(|n| !n.ends_with(".tmp"))
                    .collect()
            })
            .unwrap_or_default();
        held.len() == 4
    });
    held.sort();
    let first_slice = held[0].split('-').next().expect("slice-worker").to_string();
    let victim: u32 = std::fs::read_to_string(hold.join(&held[2]))
        .expect("hold file")
        .trim()
        .parse()
        .expect("agent pid");
    signal(victim, libc::SIGKILL);
    let out = d.finish(Duration::from_secs(240));
    out.assert_success();

    check_one_slice_per_host(&members(&out, "HOST"));

    // One process per chip on the v6e-8 host: chips 0..7, ranks, process addresses.
    let chip = members(&out, "CHIP");
    assert_eq!(chip.len(), 8, "{out}");
    permutation(&chip, "RANK");
    permutation(&chip, "LOCAL_RANK");
    permutation(&chip, "TPU_VISIBLE_CHIPS");
    for m in &chip {
        assert_eq!(m["TPU_VISIBLE_CHIPS"], m["LOCAL_RANK"], "{m:?}");
        assert_eq!(m["CLOUD_TPU_TASK_ID"], m["RANK"]);
        assert_eq!(m["TPU_CHIPS_PER_PROCESS_BOUNDS"], "1,1,1");
        assert_eq!(m["TPU_PROCESS_BOUNDS"], "2,4,1");
        assert_eq!(m["TPU_NAME"], "sc");
    }
    assert_eq!(same(&chip, "TPU_PROCESS_ADDRESSES").split(',').count(), 8);
    assert_eq!(same(&chip, "WORLD_SIZE"), "8");
    no_duplicate_ports(&chip);

    // Two slices: megascale variables, ranks continued across slices.
    let multi = members(&out, "MULTI");
    assert_eq!(multi.len(), 8, "{out}");
    permutation(&multi, "NODE_RANK");
    assert_eq!(same(&multi, "MEGASCALE_NUM_SLICES"), "2");
    same(&multi, "MEGASCALE_PORT");
    let slice_ids: BTreeSet<&String> = multi.iter().map(|m| &m["MEGASCALE_SLICE_ID"]).collect();
    assert_eq!(slice_ids.len(), 2);
    let names: BTreeSet<&String> = multi.iter().map(|m| &m["TPU_NAME"]).collect();
    assert_eq!(names.len(), 2, "both v6e-16 slices");
    no_duplicate_ports(&multi);

    // The actor form: one actor per host, generation 0.
    let actors = members(&out, "ACTOR");
    assert_eq!(actors.len(), 4, "{out}");
    permutation(&actors, "TPU_WORKER_ID");
    assert_eq!(same(&actors, "TPURAY_GANG_GENERATION"), "0");

    assert!(out.line("BADTOPO ").contains("3x3"), "{out}");

    // The killed host's gang ran again, whole, on the other slice.
    let survived = members(&out, "SURVIVED");
    check_one_slice_per_host(&survived);
    assert_eq!(same(&survived, "TPURAY_GANG_GENERATION"), "1", "{out}");
    assert_ne!(same(&survived, "TPU_NAME"), first_slice, "ran again on an intact slice");
}
