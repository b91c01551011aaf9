//! Object store folders left in `/dev/shm` by node agents that died (OBJ-13): a new
//! agent sweeps them at start, and `tpuray stop --force` removes the folders of the
//! agents it killed. Runs on one simulated host (`tpuray_tests::hosts`), whose
//! `/dev/shm` is its own, so the real one is never touched. Needs root.

use std::path::PathBuf;
use std::process::{Command, Output, Stdio};
use std::time::{Duration, Instant};

use tpuray_tests::hosts::{Host, Hosts};
use tpuray_tests::tpuray_bin;

fn run(host: &Host, args: &[&str]) -> Output {
    let mut c: Command = host.command(tpuray_bin());
    c.args(args).stdin(Stdio::null());
    let out = c.output().expect("run tpuray in the host");
    assert!(
        out.status.success(),
        "tpuray {args:?} failed: {}\n{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    out
}

/// The `tpuray-*` folders in the host's own `/dev/shm` (through its mount namespace).
fn shm_stores(host: &Host) -> Vec<String> {
    let out = host
        .command("sh")
        .args(["-c", "ls -1 /dev/shm | grep '^tpuray-' || true"])
        .output()
        .expect("list the host's /dev/shm");
    String::from_utf8_lossy(&out.stdout).lines().map(str::to_string).collect()
}

/// Pids of the host's node agents (`tpuray _agent`).
fn agent_pids(host: &Host) -> Vec<u32> {
    host.processes()
        .into_iter()
        .filter(|p| {
            std::fs::read(format!("/proc/{p}/cmdline"))
                .map(|c| c.split(|b| *b == 0).any(|a| a == b"_agent"))
                .unwrap_or(false)
        })
        .collect()
}

/// Whether every thread of `pid` has exited (only a zombie, or nothing, is left).
fn fully_exited(pid: u32) -> bool {
    let Ok(tasks) = std::fs::read_dir(format!("/proc/{pid}/task")) else { return true };
    tasks.flatten().all(|t| {
        let stat = std::fs::read_to_string(t.path().join("stat")).unwrap_or_default();
        matches!(stat.rfind(')').and_then(|i| stat.get(i + 2..i + 3)), None | Some("Z" | "X"))
    })
}

fn wait_until(what: &str, mut cond: impl FnMut() -> bool) {
    let deadline = Instant::now() + Duration::from_secs(30);
    while !cond() {
        assert!(Instant::now() < deadline, "timed out waiting until {what}");
        std::thread::sleep(Duration::from_millis(50));
    }
}

#[test]
fn obj13_an_agent_sweeps_stores_of_killed_agents_and_stop_force_removes_its_own() {
    let hosts = Hosts::new(1);
    let h = hosts.host(0);
    let tmp: PathBuf = PathBuf::from("/tmp/tpuray");
    let temp = |name: &str| tmp.join(name).display().to_string();
    run(h, &["start", "--head", "--port", "6379", "--num-cpus", "1", "--temp-dir", &temp("a")]);
    let first = shm_stores(h);
    assert_eq!(first.len(), 1, "one agent, one store folder: {first:?}");
    // Kill the agent the way a crash does: its folder stays behind.
    let pids = agent_pids(h);
    for &pid in &pids {
        // SAFETY: kill(2) on a process of the test's own simulated host.
        unsafe { libc::kill(pid as i32, libc::SIGKILL) };
    }
    // Every thread gone (a zombie leader's other threads still hold its files).
    wait_until("the agent is gone", || pids.iter().all(|&p| fully_exited(p)));
    assert_eq!(shm_stores(h), first, "a SIGKILLed agent leaves its folder");
    // A new agent on this machine sweeps it at start and keeps its own.
    let head = format!("{}:6379", h.address);
    run(h, &["start", "--address", &head, "--num-cpus", "1", "--temp-dir", &temp("b")]);
    let second = shm_stores(h);
    assert_eq!(second.len(), 1, "only the live agent's store is left: {second:?}");
    assert_ne!(second, first, "the dead agent's store was swept");
    // `stop --force` SIGKILLs everything and removes the folders of those agents.
    run(h, &["stop", "--force"]);
    assert!(shm_stores(h).is_empty(), "stop --force left {:?}", shm_stores(h));
}

#[test]
fn an_agent_that_cannot_join_leaves_no_store_folder() {
    let hosts = Hosts::new(1);
    let h = hosts.host(0);
    let mut c = h.command(tpuray_bin());
    // Nothing listens on port 9 of this host: the join fails after the short retry.
    c.args(["start", "--address", &format!("{}:9", h.address), "--temp-dir", "/tmp/tpuray/x"])
        .env("TPURAY_HEAD_CONNECT_TIMEOUT_MS", "300")
        .stdin(Stdio::null());
    let out = c.output().expect("run tpuray start");
    assert!(!out.status.success(), "joining a head that is not there succeeded");
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains(&format!("cannot reach the head at {}:9", h.address)), "{err}");
    assert!(shm_stores(h).is_empty(), "a failed join left {:?}", shm_stores(h));
}
