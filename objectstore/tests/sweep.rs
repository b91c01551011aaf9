//! OBJ-13 with real processes: a store whose creating process is alive is
//! kept by `sweep_stale_stores`, and removed with its spill folder once that
//! process is SIGKILLed (what `tpuray stop --force` does to an agent).
//!
//! The child is this test binary run again with `--exact
//! sweep_child_entry` and `TPURAY_SWEEP_TEST_DIR` naming the store folder
//! (and `TPURAY_SWEEP_TEST_SPILL` its spill dir); it opens the store as an
//! agent does, says `@@READY` and waits to be killed.

use std::io::{BufRead, BufReader, Write};
use std::path::PathBuf;
use std::process::{Command, Stdio};

use tpuray_objectstore::{LocalStore, StoreConfig, sweep_stale_stores};

const DIR: &str = "TPURAY_SWEEP_TEST_DIR";
const SPILL: &str = "TPURAY_SWEEP_TEST_SPILL";

/// The child side; a no-op in the normal test run.
#[test]
fn sweep_child_entry() {
    let Ok(dir) = std::env::var(DIR) else { return };
    let store = LocalStore::open_with(StoreConfig {
        dir: dir.into(),
        capacity_bytes: Some(1000),
        spill_dir: Some(std::env::var(SPILL).unwrap().into()),
    })
    .unwrap();
    store.put("big", &[1u8; 4000]).unwrap();
    let mut out = std::io::stdout().lock();
    writeln!(out, "@@READY").unwrap();
    out.flush().unwrap();
    let mut s = String::new();
    let _ = std::io::stdin().read_line(&mut s);
    // Not reached when killed; a parent that went away ends us here.
    std::mem::forget(store);
    std::process::exit(0);
}

#[test]
fn a_killed_creators_store_is_swept_and_a_live_ones_is_not_obj_13() {
    let (root, spill) = (tempfile::tempdir().unwrap(), tempfile::tempdir().unwrap());
    let dir = root.path().join("tpuray-child");
    let mut child = Command::new(std::env::current_exe().unwrap())
        .args(["--exact", "sweep_child_entry", "--nocapture", "--test-threads=1"])
        .env(DIR, &dir)
        .env(SPILL, spill.path())
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .spawn()
        .unwrap();
    let mut lines = BufReader::new(child.stdout.take().unwrap()).lines();
    assert!(
        lines.by_ref().map_while(Result::ok).any(|l| l.contains("@@READY")),
        "the child did not open its store"
    );
    let spilled: PathBuf = spill.path().join("tpuray-child");
    assert!(spilled.join("big").exists());
    assert!(sweep_stale_stores(root.path()).is_empty(), "the creator is alive");
    assert!(dir.join(".lock").exists());

    child.kill().unwrap();
    child.wait().unwrap();
    assert_eq!(sweep_stale_stores(root.path()), vec![spilled.clone(), dir.clone()]);
    assert!(!dir.exists());
    assert!(!spilled.exists());
    assert!(spill.path().exists(), "the shared spill dir itself stays");
}
