//! The machine-wide process registry (like Ray's `/tmp/ray`): every process
//! that `tpuray start` or a node agent starts is recorded here, whatever
//! `--temp-dir` says, so `tpuray stop` finds them all (REG-1).
//!
//! One JSON file per process under [`registry_dir`]; entries carry the
//! process start time from `/proc` so a reused pid is never mistaken for ours.
//! All functions block on the filesystem; call them off async hot paths.

use std::path::PathBuf;

use serde::{Deserialize, Serialize};

/// Overrides the registry folder (tests give each cluster its own).
pub const REGISTRY_ENV: &str = "TPURAY_REGISTRY_DIR";

/// `$TPURAY_REGISTRY_DIR`, or `/tmp/tpuray/registry`.
pub fn registry_dir() -> PathBuf {
    std::env::var_os(REGISTRY_ENV)
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from("/tmp/tpuray/registry"))
}

/// One registered process.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct ProcEntry {
    pub pid: u32,
    /// Clock ticks since boot at which the process started (`/proc/PID/stat` field 22).
    pub start_time: u64,
    /// `head`, `agent` or `worker`.
    pub kind: String,
    pub session_dir: String,
    pub address: String,
    /// For the node agent of a head's node: which head (its address, or for a
    /// replicated head `<peers>#<head id>`), so a restarted head does not start a
    /// second agent for the same machine.
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub head_of: String,
}

/// The cluster `tpuray start --head` last started on this machine.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct CurrentCluster {
    pub address: String,
    pub session_dir: String,
}

/// The start time of a live process, or `None` once it has exited. A zombie counts as
/// exited only when all its threads have: the thread-group leader of a SIGKILLed
/// multi-threaded process shows `Z` while its other threads are still exiting and
/// still hold its files (an agent's store lock among them).
pub fn proc_start_time(pid: u32) -> Option<u64> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    // The command name (field 2) may hold spaces; fields after it follow ')'.
    let rest = &stat[stat.rfind(')')? + 2..];
    let fields: Vec<&str> = rest.split_whitespace().collect();
    // rest starts at field 3 (state); field 22 is index 19.
    if matches!(fields.first(), Some(&"Z") | Some(&"X")) && !threads_exiting(pid) {
        return None;
    }
    fields.get(19)?.parse().ok()
}

/// Whether some thread of `pid` other than its leader has not finished exiting.
fn threads_exiting(pid: u32) -> bool {
    let Ok(tasks) = std::fs::read_dir(format!("/proc/{pid}/task")) else { return false };
    tasks.flatten().any(|t| {
        let tid = t.file_name();
        if tid.to_string_lossy() == pid.to_string() {
            return false;
        }
        let stat = std::fs::read_to_string(t.path().join("stat")).unwrap_or_default();
        let state = stat.rfind(')').and_then(|i| stat.get(i + 2..i + 3));
        !matches!(state, None | Some("Z") | Some("X"))
    })
}

impl ProcEntry {
    /// An entry for the running process `pid`.
    pub fn for_pid(pid: u32, kind: &str, session_dir: &str, address: &str) -> Option<Self> {
        Some(Self {
            pid,
            start_time: proc_start_time(pid)?,
            kind: kind.to_string(),
            session_dir: session_dir.to_string(),
            address: address.to_string(),
            head_of: String::new(),
        })
    }

    /// The entry, as the node agent of head `key`.
    pub fn head_of(self, key: &str) -> Self {
        Self { head_of: key.to_string(), ..self }
    }

    /// True while the very process this entry names is running.
    pub fn is_alive(&self) -> bool {
        proc_start_time(self.pid) == Some(self.start_time)
    }
}

fn entry_path(pid: u32) -> PathBuf {
    registry_dir().join(format!("proc-{pid}.json"))
}

/// Records a process.
///
/// # Errors
/// When the registry folder cannot be created or written.
pub fn record(entry: &ProcEntry) -> std::io::Result<()> {
    let dir = registry_dir();
    std::fs::create_dir_all(&dir)?;
    // Unique per writer: an agent records itself while `tpuray start` records it too.
    let tmp = dir.join(format!(".proc-{}.{}.{}.tmp", entry.pid, std::process::id(), unique()));
    std::fs::write(&tmp, serde_json::to_vec(entry).expect("entry serializes"))?;
    std::fs::rename(tmp, entry_path(entry.pid))
}

/// A number no other call in this process returns.
fn unique() -> u64 {
    static NEXT: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);
    NEXT.fetch_add(1, std::sync::atomic::Ordering::Relaxed)
}

/// Forgets a process (after it exited).
pub fn remove(pid: u32) {
    let _ = std::fs::remove_file(entry_path(pid));
}

/// Every recorded process, live or not.
pub fn list() -> Vec<ProcEntry> {
    list_in(&registry_dir())
}

/// The node agents recorded in `dir` that still run.
pub fn live_agents_in(dir: &std::path::Path) -> Vec<ProcEntry> {
    list_in(dir).into_iter().filter(|e| e.kind == "agent" && e.is_alive()).collect()
}

/// Every process recorded in the registry folder `dir` (a private cluster's).
pub fn list_in(dir: &std::path::Path) -> Vec<ProcEntry> {
    let Ok(rd) = std::fs::read_dir(dir) else {
        return vec![];
    };
    rd.filter_map(|e| e.ok())
        .filter(|e| {
            let n = e.file_name();
            let n = n.to_string_lossy();
            n.starts_with("proc-") && n.ends_with(".json")
        })
        .filter_map(|e| std::fs::read(e.path()).ok())
        .filter_map(|b| serde_json::from_slice(&b).ok())
        .collect()
}

/// Records the cluster that `tpuray start --head` started.
///
/// # Errors
/// When the registry folder cannot be written.
pub fn set_current_cluster(c: &CurrentCluster) -> std::io::Result<()> {
    let dir = registry_dir();
    std::fs::create_dir_all(&dir)?;
    let tmp = dir.join(format!(".current_cluster.{}.tmp", std::process::id())); // heads may start together
    std::fs::write(&tmp, serde_json::to_vec(c).expect("serializes"))?;
    std::fs::rename(tmp, dir.join("current_cluster.json"))
}

/// The cluster `tpuray start --head` left on this machine, if any.
pub fn current_cluster() -> Option<CurrentCluster> {
    let b = std::fs::read(registry_dir().join("current_cluster.json")).ok()?;
    serde_json::from_slice(&b).ok()
}

/// Forgets the current cluster.
pub fn clear_current_cluster() {
    let _ = std::fs::remove_file(registry_dir().join("current_cluster.json"));
}

#[cfg(test)]
mod tests {
    use super::*;

    /// REG-1: an entry carries the process start time, so a reused pid is never taken for ours.
    #[test]
    fn own_process_has_a_start_time_and_is_alive() {
        let me = std::process::id();
        let e = ProcEntry::for_pid(me, "test", "/tmp", "").unwrap();
        assert!(e.is_alive());
        let other = ProcEntry { start_time: e.start_time + 1, ..e };
        assert!(!other.is_alive(), "a reused pid must not look like ours");
    }
}
