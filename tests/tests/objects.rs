//! The object store under memory pressure, through the public CLI and SDK: a
//! node started with `--object-store-memory` and `--spill-dir`, a driver (the
//! `tpuray-test-driver` binary, scenario `spill-objects`) holding four times
//! the store in live objects, `tpuray memory` and `tpuray list objects`
//! reading the agent's store, and the spill folder once the objects are freed.

use std::path::{Path, PathBuf};
use std::time::Duration;

use tpuray_tests::*;

fn driver_bin() -> PathBuf {
    PathBuf::from(env!("CARGO_BIN_EXE_tpuray-test-driver"))
}

/// Bound for each step of the driver (writing and reading 1 GiB in a debug build).
const STEP: Duration = Duration::from_secs(60);

const STORE_BYTES: u64 = 256 << 20;
const OBJECTS: u64 = 16;
/// A 64 MiB `Blob` as stored: postcard's 4-byte length prefix, then the bytes.
const OBJECT_BYTES: u64 = (64 << 20) + 4;

/// Every file under `dir`, recursively (empty when `dir` does not exist).
fn files_under(dir: &Path) -> Vec<PathBuf> {
    let Ok(rd) = std::fs::read_dir(dir) else { return vec![] };
    let mut out = Vec::new();
    for e in rd.flatten() {
        let p = e.path();
        if p.is_dir() { out.extend(files_under(&p)) } else { out.push(p) }
    }
    out
}

fn memory_json(c: &Cluster) -> serde_json::Value {
    let out = c.cli_ok(&["memory", "--format", "json", "--address", &c.head_addr()]);
    serde_json::from_str(&out)
        .unwrap_or_else(|e| panic!("`tpuray memory` is not JSON ({e}):\n{out}"))
}

fn u64_of(v: &serde_json::Value, key: &str) -> u64 {
    v[key].as_u64().unwrap_or_else(|| panic!("no number {key:?} in {v:#}"))
}

/// OBJ-3/OBJ-4/OBJ-5/OBJ-7 end to end: 16 objects of 64 MiB in a 256 MiB store
/// all live at once and read back byte-exact; `tpuray memory` shows the spilled
/// bytes and `tpuray list objects` every object with its owner; a store whose
/// memory is all pinned refuses a put naming the sizes; freeing the objects
/// removes their spill files.
#[test]
fn objects_four_times_the_store_spill_read_back_exact_and_leave_no_spill_files() {
    let mut c = Cluster::new();
    let spill = c.dir().join("spill");
    let spill_s = spill.display().to_string();
    let store_s = STORE_BYTES.to_string();
    let head = c.start_head(&[
        "--num-cpus",
        "1",
        "--object-store-memory",
        &store_s,
        "--spill-dir",
        &spill_s,
    ]);
    let go = c.dir().join("go");
    let done = c.dir().join("done");
    let addr = c.head_addr();
    let (go_s, done_s) = (go.display().to_string(), done.display().to_string());
    let mut d = Driver::start(&c, &driver_bin(), &["spill-objects", &addr, &go_s, &done_s], &[]);

    let holding = d.wait_line("HOLDING", STEP);
    assert!(holding.contains("n=16 verified=16"), "{holding}");

    // `tpuray memory`: the node's store, over capacity by three times, spilled.
    let mem = memory_json(&c);
    let nodes = mem.as_array().expect("`tpuray memory --format json` is a list");
    assert_eq!(nodes.len(), 1, "{mem:#}");
    let node = &nodes[0];
    assert_eq!(node["node_id"], head.node_id.as_str(), "{node:#}");
    assert_eq!(u64_of(node, "capacity_bytes"), STORE_BYTES, "{node:#}");
    assert!(u64_of(node, "used_bytes") <= STORE_BYTES, "{node:#}");
    let spilled = u64_of(node, "spilled_bytes");
    assert!(spilled >= OBJECTS * OBJECT_BYTES - STORE_BYTES, "too little spilled: {node:#}");
    assert_eq!(u64_of(node, "object_count") + u64_of(node, "spilled_count"), OBJECTS, "{node:#}");
    assert!(
        node["spill_dir"].as_str().is_some_and(|s| Path::new(s).starts_with(&spill)),
        "spill folder not under --spill-dir {}: {node:#}",
        spill.display()
    );
    let largest = node["largest"].as_array().expect("largest is a list");
    assert_eq!(largest.len(), 10, "{node:#}");
    assert!(largest.iter().all(|o| o["size"] == OBJECT_BYTES), "{node:#}");
    assert!(largest.iter().any(|o| o["location"] == "spilled"), "{node:#}");
    assert!(largest.iter().all(|o| o["owner"].as_str().is_some_and(|s| !s.is_empty())));
    assert_eq!(files_under(&spill).len() as u64, u64_of(node, "spilled_count"));
    let table = c.cli_ok(&["memory", "--address", &addr]);
    assert!(table.contains("spilled:") && table.contains("largest objects"), "{table}");
    assert!(table.contains(&head.node_id), "{table}");

    // `tpuray list objects`: every live object, its node, location and owner.
    let objects = c.list("objects");
    let objects = objects.as_array().expect("list objects is a JSON list");
    assert_eq!(objects.len() as u64, OBJECTS, "{objects:#?}");
    let owner = objects[0]["owner"].as_str().unwrap_or_default().to_string();
    assert!(!owner.is_empty(), "{objects:#?}");
    for o in objects {
        assert_eq!(o["size"], OBJECT_BYTES, "{o:#}");
        assert_eq!(o["node_id"], head.node_id.as_str(), "{o:#}");
        assert_eq!(o["owner"], owner.as_str(), "one driver owns them all: {o:#}");
        assert_eq!(o["copy"], "primary", "{o:#}");
        assert!(o["location"] == "memory" || o["location"] == "spilled", "{o:#}");
    }
    let spilled_rows = objects.iter().filter(|o| o["location"] == "spilled").count() as u64;
    assert!(spilled_rows >= OBJECTS - STORE_BYTES / OBJECT_BYTES, "{objects:#?}");
    let table = c.cli_ok(&["list", "objects", "--address", &addr]);
    assert!(table.starts_with("OBJECT_ID"), "{table}");
    assert_eq!(table.lines().count() as u64, OBJECTS + 1, "{table}");

    // OBJ-7: with every byte in memory mapped by the driver, a put fails at once naming
    // the sizes. Three objects fit in 256 MiB, so the fourth is refused.
    std::fs::write(&go, "").expect("write go file");
    let full = d.wait_line("FULL", STEP);
    assert!(full.starts_with("FULL after=4 "), "{full}");
    assert!(full.contains("object store full"), "{full}");
    assert!(full.contains(&OBJECT_BYTES.to_string()), "names the object's size: {full}");
    assert!(full.contains(&store_s), "names the capacity: {full}");

    // OBJ-5: once the owner drops its refs, the spill files go.
    d.wait_line("DROPPED", STEP);
    wait_until(SOON, "the spill folder is empty", || files_under(&spill).is_empty());
    wait_until(SOON, "`tpuray memory` shows an empty store", || {
        let node = &memory_json(&c)[0];
        u64_of(node, "spilled_bytes") == 0
            && u64_of(node, "object_count") == 0
            && u64_of(node, "used_bytes") == 0
    });
    std::fs::write(&done, "").expect("write done file");
    d.finish(STEP).assert_success();
}

/// A result made on another node is pulled into the reader's node as a secondary copy
/// (evictable under pressure, OBJ-4); both copies record the task's owner, the driver.
#[test]
fn pulled_copy_is_secondary_and_both_copies_name_the_owner() {
    let mut c = Cluster::new();
    let head = c.start_head(&["--num-cpus", "1"]);
    let far = c.add_node(&["--num-cpus", "1", "--resources", r#"{"far": 1}"#]);
    let done = c.dir().join("done");
    let (addr, done_s) = (c.head_addr(), done.display().to_string());
    let mut d = Driver::start(&c, &driver_bin(), &["pulled-copy", &addr, &done_s], &[]);
    let line = d.wait_line("PULLED", STEP);
    assert!(line.ends_with("ok=true"), "{line}");
    let id = line.split(' ').find_map(|w| w.strip_prefix("id=")).expect("id= in PULLED line");

    let objects = c.list("objects");
    let copies: Vec<&serde_json::Value> = objects
        .as_array()
        .expect("list objects is a JSON list")
        .iter()
        .filter(|o| o["object_id"] == id)
        .collect();
    assert_eq!(copies.len(), 2, "one copy per node: {objects:#}");
    let on = |node: &str| {
        *copies.iter().find(|o| o["node_id"] == node).unwrap_or_else(|| {
            panic!("no copy of {id} on node {node}: {objects:#}");
        })
    };
    let (made, pulled) = (on(&far.node_id), on(&head.node_id));
    assert_eq!(made["copy"], "primary", "{made:#}");
    assert_eq!(pulled["copy"], "secondary", "{pulled:#}");
    let owner = made["owner"].as_str().unwrap_or_default();
    assert!(!owner.is_empty(), "the task's return records its owner: {made:#}");
    assert_eq!(pulled["owner"], owner, "{pulled:#}");
    assert_eq!(made["size"], pulled["size"]);

    std::fs::write(&done, "").expect("write done file");
    d.finish(STEP).assert_success();
}
