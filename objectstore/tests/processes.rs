//! One store shared by several real processes: a writer killed mid-write
//! (OBJ-1), writers in several processes against one capacity (OBJ-3), and a
//! reader in another process pinning its object (OBJ-6).
//!
//! Children are this test binary run again with `--exact child_process_entry`
//! and `TPURAY_OBJSTORE_TEST_ROLE` saying what to do; they attach with
//! `LocalStore::open`, so they also check that the parent's capacity and
//! spill folder reach them through the ledger.

use std::io::{BufRead, BufReader, Write};
use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::sync::mpsc;
use std::time::{Duration, Instant};

use tpuray_objectstore::{CreateOptions, LocalStore, Location, StoreConfig, StoreError};

const MIB: u64 = 1024 * 1024;
const ROLE: &str = "TPURAY_OBJSTORE_TEST_ROLE";
const DIR: &str = "TPURAY_OBJSTORE_TEST_DIR";
const ARG: &str = "TPURAY_OBJSTORE_TEST_ARG";
/// Every wait on a child gives up after this, failing the test.
const TIMEOUT: Duration = Duration::from_secs(60);

fn pattern(id: &str, len: u64) -> Vec<u8> {
    let seed = id.bytes().fold(17u32, |h, b| h.wrapping_mul(31).wrapping_add(b as u32));
    (0..len).map(|i| (seed.wrapping_add(i as u32).wrapping_mul(2654435761) >> 24) as u8).collect()
}

/// Size of object `i` of a writer child: 40 KB to 400 KB, so that three
/// children each holding one view or one writer never pin the whole 2 MiB
/// store and every write finds room (no `Full` by design).
fn child_size(i: u64) -> u64 {
    40_000 + (i * 97_213) % 360_000
}

/// Prints `@@marker` on its own line (libtest may have started the line with
/// `test child_process_entry ... `, so the parent looks for the `@@` part).
fn say(marker: &str) {
    let mut out = std::io::stdout().lock();
    writeln!(out, "@@{marker}").unwrap();
    out.flush().unwrap();
}

fn wait_for_parent() {
    let mut s = String::new();
    let _ = std::io::stdin().read_line(&mut s);
}

/// The child side; a no-op in the normal test run.
#[test]
fn child_process_entry() {
    let Ok(role) = std::env::var(ROLE) else { return };
    let store = LocalStore::open(std::env::var(DIR).unwrap()).unwrap();
    let arg = std::env::var(ARG).unwrap_or_default();
    match role.as_str() {
        // Reserve 3 MiB, write half of it, then wait to be killed.
        "half-write" => {
            let opts = CreateOptions { size: Some(3 * MIB), ..Default::default() };
            let mut w = store.create_with("dead", &opts).unwrap();
            w.write(&pattern("dead", 3 * MIB / 2)).unwrap();
            say("HALF");
            wait_for_parent();
            std::mem::forget(w);
        }
        // An object larger than the store, half written through to disk.
        "half-through" => {
            let opts = CreateOptions { size: Some(8 * MIB), ..Default::default() };
            let mut w = store.create_with("huge", &opts).unwrap();
            assert!(w.is_on_disk());
            w.write(&pattern("huge", MIB)).unwrap();
            say("HALF");
            wait_for_parent();
            std::mem::forget(w);
        }
        "writer" => {
            let capacity = store.capacity().unwrap().expect("the parent's capacity");
            for i in 0..15 {
                let id = format!("{arg}-{i}");
                let data = pattern(&id, child_size(i));
                if i % 2 == 0 {
                    store.put(&id, &data).unwrap();
                } else {
                    let mut w = store.create(&id).unwrap();
                    for c in data.chunks(64 * 1024) {
                        w.write(c).unwrap();
                    }
                    w.seal(Some(data.len() as u64)).unwrap();
                }
                let u = store.usage().unwrap();
                assert!(u.used_bytes <= capacity, "OBJ-3 broken: {u:?}");
                let back = format!("{arg}-{}", i / 2);
                let v = store.get(&back).unwrap().unwrap();
                assert!(*v == *pattern(&back, child_size(i / 2)), "{back} differs");
            }
            say("DONE");
        }
        // Map object `arg`, say so, hold it until the parent answers.
        "reader" => {
            let v = store.get(&arg).unwrap().unwrap();
            say("MAPPED");
            wait_for_parent();
            assert!(*v == *pattern(&arg, MIB), "{arg} changed under its reader");
            say("OK");
        }
        other => panic!("unknown role {other}"),
    }
}

/// A child process with its stdout read line by line on a thread, so every
/// wait has a timeout; killed when dropped.
struct Kid {
    child: Child,
    lines: mpsc::Receiver<String>,
}

impl Kid {
    fn spawn(role: &str, dir: &Path, arg: &str) -> Kid {
        let mut child = Command::new(std::env::current_exe().unwrap())
            .args(["--exact", "child_process_entry", "--nocapture", "--test-threads=1"])
            .env(ROLE, role)
            .env(DIR, dir)
            .env(ARG, arg)
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .spawn()
            .unwrap();
        let out = child.stdout.take().unwrap();
        let (tx, lines) = mpsc::channel();
        std::thread::spawn(move || {
            for line in BufReader::new(out).lines().map_while(Result::ok) {
                if tx.send(line).is_err() {
                    break;
                }
            }
        });
        Kid { child, lines }
    }

    /// Waits for the child to [`say`] `marker`.
    fn expect(&mut self, marker: &str) {
        let deadline = Instant::now() + TIMEOUT;
        loop {
            let left = deadline.saturating_duration_since(Instant::now());
            match self.lines.recv_timeout(left) {
                Ok(l) if l.trim_end().ends_with(&format!("@@{marker}")) => return,
                Ok(_) => {}
                Err(e) => panic!("child never said {marker} ({e:?}): {:?}", self.child.try_wait()),
            }
        }
    }

    fn answer(&mut self) {
        let stdin = self.child.stdin.as_mut().unwrap();
        stdin.write_all(b"go\n").unwrap();
        stdin.flush().unwrap();
    }

    fn kill(&mut self) {
        self.child.kill().unwrap();
        self.child.wait().unwrap();
    }

    /// Waits (with the timeout) for a clean exit.
    fn finish(&mut self) {
        let deadline = Instant::now() + TIMEOUT;
        loop {
            if let Some(st) = self.child.try_wait().unwrap() {
                assert!(st.success(), "child failed: {st}");
                return;
            }
            assert!(Instant::now() < deadline, "child did not exit within {TIMEOUT:?}");
            std::thread::sleep(Duration::from_millis(10));
        }
    }
}

impl Drop for Kid {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

fn temps(dir: &Path) -> Vec<String> {
    std::fs::read_dir(dir)
        .map(|rd| {
            rd.map(|e| e.unwrap().file_name().into_string().unwrap())
                .filter(|n| n.starts_with(".w."))
                .collect()
        })
        .unwrap_or_default()
}

fn store(capacity: u64) -> (tempfile::TempDir, LocalStore) {
    let root = tempfile::tempdir().unwrap();
    let s = LocalStore::open_with(StoreConfig {
        dir: root.path().join("tpuray-node"),
        capacity_bytes: Some(capacity),
        spill_dir: Some(root.path().join("spill")),
    })
    .unwrap();
    (root, s)
}

#[test]
fn writer_killed_between_create_and_seal_leaves_nothing_and_its_reservation_is_reclaimed_obj_1() {
    let (_root, s) = store(4 * MIB);
    let mut kid = Kid::spawn("half-write", s.dir(), "");
    kid.expect("HALF");
    // Alive: invisible, and its reservation counts against the capacity.
    assert!(s.get("dead").unwrap().is_none());
    assert_eq!(s.usage().unwrap().writing_bytes, 3 * MIB);
    let err = s.put("other", &pattern("other", 2 * MIB)).unwrap_err();
    assert!(matches!(err, StoreError::Full { writing, .. } if writing == 3 * MIB), "{err}");
    kid.kill();
    // Dead: still invisible, and the whole store is free again.
    assert!(s.get("dead").unwrap().is_none());
    s.put("full", &pattern("full", 4 * MIB)).unwrap();
    assert!(temps(s.dir()).is_empty());
    let u = s.usage().unwrap();
    assert_eq!((u.used_bytes, u.writing_bytes, u.object_count), (4 * MIB, 0, 1));
    assert!(s.get("dead").unwrap().is_none());
}

#[test]
fn writer_killed_while_writing_through_to_disk_leaves_nothing_obj_1() {
    let (_root, s) = store(4 * MIB);
    let spill = s.spill_dir().unwrap().unwrap();
    let mut kid = Kid::spawn("half-through", s.dir(), "");
    kid.expect("HALF");
    assert_eq!(temps(&spill).len(), 1);
    assert_eq!(s.usage().unwrap().used_bytes, 0, "a write-through reserves no memory");
    kid.kill();
    assert!(s.get("huge").unwrap().is_none());
    let u = s.usage().unwrap();
    assert!(temps(&spill).is_empty());
    assert_eq!((u.spilled_bytes, u.spilled_count), (0, 0));
}

#[test]
fn writers_in_several_processes_never_exceed_capacity_obj_3() {
    let (_root, s) = store(2 * MIB);
    let mut kids: Vec<Kid> =
        (0..3).map(|k| Kid::spawn("writer", s.dir(), &format!("c{k}"))).collect();
    for kid in &mut kids {
        kid.expect("DONE");
        kid.finish();
    }
    let u = s.usage().unwrap();
    assert!(u.used_bytes <= 2 * MIB, "{u:?}");
    assert_eq!(u.object_count + u.spilled_count, 45);
    assert!(u.spilled_count > 0);
    for k in 0..3 {
        for i in 0..15 {
            let id = format!("c{k}-{i}");
            let v = s.get(&id).unwrap().unwrap();
            assert!(*v == *pattern(&id, child_size(i)), "{id} differs");
        }
    }
}

#[test]
fn object_mapped_in_another_process_is_not_spilled_obj_6() {
    let (_root, s) = store(2 * MIB);
    s.put("held", &pattern("held", MIB)).unwrap();
    s.put("other", &pattern("other", MIB)).unwrap();
    let mut kid = Kid::spawn("reader", s.dir(), "held");
    kid.expect("MAPPED");
    assert!(s.info("held").unwrap().unwrap().pinned);
    // "held" is the oldest, but mapped elsewhere: "other" goes instead.
    s.put("new", &pattern("new", MIB)).unwrap();
    assert_eq!(s.info("held").unwrap().unwrap().location, Location::Memory);
    assert_eq!(s.info("other").unwrap().unwrap().location, Location::Spilled);
    s.put("newer", &pattern("newer", MIB)).unwrap();
    assert_eq!(s.info("held").unwrap().unwrap().location, Location::Memory);
    kid.answer();
    kid.expect("OK");
    kid.finish();
    // Unpinned now: the next write spills it.
    s.put("last", &pattern("last", MIB)).unwrap();
    assert_eq!(s.info("held").unwrap().unwrap().location, Location::Spilled);
}
