//! Ownership and recovery (CORE-6) through the public SDK: results whose only
//! copies die with their node are made again from lineage (nested ones too),
//! a lost `put` object fails as lost, and a borrower whose owner died is told
//! so. The job binary is `tpuray-test-driver` (scenarios `lineage` and
//! `owner-died`).

use std::path::PathBuf;
use std::time::Duration;

use tpuray_tests::*;

fn driver_bin() -> PathBuf {
    PathBuf::from(env!("CARGO_BIN_EXE_tpuray-test-driver"))
}

/// Bound for each step of a driver run.
const STEP: Duration = Duration::from_secs(120);

/// The value of `key=` in a `KIND key=value ...` line (`msg=` runs to the end).
fn field<'a>(line: &'a str, key: &str) -> &'a str {
    let pat = format!(" {key}=");
    let i = line.find(&pat).unwrap_or_else(|| panic!("no {key}= in {line:?}")) + pat.len();
    let rest = &line[i..];
    if key == "msg" { rest } else { rest.split(' ').next().unwrap_or_default() }
}

/// CORE-6: a head node, a plain node and node X (resource `x`). On X, task `a` makes
/// 10 MB, task `b` reads `a` and makes 10 MB more, and a task puts 10 MB and returns the
/// ref. The driver holds only `b` and the put's ref. X's agent is SIGKILLed (its workers
/// follow it, CORE-1) and its store folder removed; a new node with `x` joins. Reading `b`
/// runs `b` again, whose read of `a` runs `a` again: each ran exactly twice and the bytes
/// are right. The put object cannot be made again: `ObjectLost`.
#[test]
fn results_lost_with_their_node_are_made_again_from_lineage_and_a_lost_put_fails() {
    let mut c = Cluster::new();
    c.start_head(&["--num-cpus", "1"]);
    c.add_node(&["--num-cpus", "1"]);
    let x = c.add_node(&["--num-cpus", "2", "--resources", r#"{"x": 4}"#]);
    let work = c.dir().join("work");
    std::fs::create_dir_all(&work).expect("work dir");
    let addr = c.head_addr();
    let mut d =
        Driver::start(&c, &driver_bin(), &["lineage", &addr, &work.display().to_string()], &[]);
    let ready = d.wait_line("READY", STEP);
    assert_eq!(ready, "READY a_runs=1 b_runs=1");

    signal(x.pid, libc::SIGKILL);
    wait_until(SOON, "node X is declared dead", || node_state(&c.list_node(&x.node_id)) == "DEAD");
    // Its copies are gone, not merely unreachable.
    let _ = std::fs::remove_dir_all(format!("/dev/shm/tpuray-{}", x.node_id));
    let x2 = c.add_node(&["--num-cpus", "2", "--resources", r#"{"x": 4}"#]);
    assert_ne!(x2.node_id, x.node_id);
    std::fs::write(work.join("go"), "").expect("write go file");

    let result = d.wait_line("RESULT", STEP);
    assert_eq!(field(&result, "ok"), "true", "{result}");
    assert_eq!(field(&result, "len"), "10000000", "{result}");
    assert_eq!(field(&result, "a_runs"), "2", "a ran again (nested reconstruction): {result}");
    assert_eq!(field(&result, "b_runs"), "2", "b ran again: {result}");
    let put = d.wait_line("PUTLOST", STEP);
    assert_eq!(field(&put, "kind"), "ObjectLost", "{put}");
    d.finish(STEP).assert_success();
}

/// A borrower's read of an object whose owner (an actor's process) was SIGKILLed fails
/// at once with `ObjectLost` saying the owner died (Python: `OwnerDiedError`).
#[test]
fn borrower_of_an_object_whose_owner_died_gets_owner_died() {
    let mut c = Cluster::new();
    c.start_head(&["--num-cpus", "2"]);
    let addr = c.head_addr();
    let mut d = Driver::start(&c, &driver_bin(), &["owner-died", &addr], &[]);
    let borrowed = d.wait_line("BORROWED", STEP);
    assert_eq!(field(&borrowed, "len"), "10000000", "{borrowed}");
    let line = d.wait_line("OWNERDIED", STEP);
    assert_eq!(field(&line, "kind"), "ObjectLost", "{line}");
    assert!(field(&line, "msg").contains("owner died"), "{line}");
    let ms: u64 = field(&line, "ms").parse().expect("ms");
    assert!(ms < 10_000, "the error came at once, not after a timeout: {line}");
    d.finish(STEP).assert_success();
}
