//! Removing the store folders of node agents that died (OBJ-13).
//!
//! A store opened with [`crate::LocalStore::open_with`] (the node agent's)
//! holds a shared `flock` on `<store>/.agent` for as long as the
//! [`crate::LocalStore`] lives in its process; the file also says the pid,
//! for people. A flock dies with its process however the process ends
//! (SIGKILL included) and cannot be confused with a later process that got
//! the same pid, so "nobody holds `.agent`" is exactly "the agent is gone".
//! Several `open_with`s of one folder may hold it at once (shared locks);
//! [`sweep_stale_stores`] takes a non-blocking exclusive one, which succeeds
//! only when none of them is alive, and keeps it while it removes the
//! folder. `open_with` checks, once it holds its lock, that `.agent` is still
//! the file of that name, and starts again when a sweep removed it first, so
//! a store is never swept between its creation and its lock.
//!
//! Folders made by a version without `.agent` are judged by what can be
//! seen: they are stale when they hold a valid ledger, nothing in them
//! changed for [`LEGACY_MIN_AGE`], and no process this user can inspect has
//! a file of theirs open (every process attached to a store keeps its ledger
//! open). When in doubt, a folder is kept.

use std::ffi::OsStr;
use std::fs::{File, OpenOptions, TryLockError};
use std::io::{self, Write};
use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};
use std::time::{Duration, SystemTime};

use crate::ledger::{self, LEDGER};

/// Where node agents put their stores, and what [`sweep_stale_stores`]
/// normally sweeps: store folders are `<STORE_ROOT>/tpuray-<node id>`.
pub const STORE_ROOT: &str = "/dev/shm";

/// The prefix of store folder names under [`STORE_ROOT`].
pub const STORE_PREFIX: &str = "tpuray-";

/// The file whose shared `flock` marks a store's creator as alive.
pub(crate) const CREATOR: &str = ".agent";

/// How long a folder without `.agent` (made by an older version) must have
/// been left unchanged before [`sweep_stale_stores`] may remove it.
pub const LEGACY_MIN_AGE: Duration = Duration::from_secs(3600);

/// Creates `dir` if needed and takes the creator's shared lock on
/// `dir/.agent`, writing this process's pid into it. The returned file holds
/// the lock; dropping it (or the process ending) releases it.
///
/// # Errors
/// When the folder or the file cannot be created or locked.
pub(crate) fn hold_creator(dir: &Path) -> io::Result<File> {
    let path = dir.join(CREATOR);
    loop {
        std::fs::create_dir_all(dir)?;
        let mut f =
            OpenOptions::new().read(true).write(true).create(true).truncate(false).open(&path)?;
        // Blocks only while a sweep that found the folder stale removes it.
        f.lock_shared()?;
        let md = f.metadata()?;
        let same = std::fs::metadata(&path)
            .is_ok_and(|now| (now.dev(), now.ino()) == (md.dev(), md.ino()));
        if md.nlink() == 0 || !same {
            // A sweep removed the folder between our open and our lock.
            continue;
        }
        f.set_len(0)?;
        f.write_all(format!("{}\n", std::process::id()).as_bytes())?;
        return Ok(f);
    }
}

/// Removes every store folder `root/tpuray-*` whose creating agent is gone,
/// with its spill folder, and returns the folders removed (store folders and
/// spill folders, each one once it is gone). `root` is normally
/// [`STORE_ROOT`]; the node agent calls this when it starts and `tpuray stop`
/// after the processes it stopped exited.
///
/// A folder is a store when it is a real directory (not a symlink) named
/// `tpuray-*` holding `.agent` or a valid ledger `.lock`; nothing else under
/// `root` is touched. It is stale when no process holds the lock on
/// `.agent`, or, without `.agent`, as the module docs say. The spill folder
/// removed is the one the ledger records, and only when it is an absolute
/// path to a real directory named like the store folder (`<spill dir>/tpuray-<node>`, as
/// `open_with` makes it); a spill folder that cannot be identified is left.
///
/// Never fails: a folder that cannot be read, locked or removed (another
/// user's, say) is left and not returned; a partly removed one is swept
/// again next time.
pub fn sweep_stale_stores(root: &Path) -> Vec<PathBuf> {
    let Ok(entries) = std::fs::read_dir(root) else { return vec![] };
    let mut candidates: Vec<PathBuf> =
        entries.flatten().filter(|e| is_store_name(&e.file_name())).map(|e| e.path()).collect();
    candidates.sort();
    let mut open_paths: Option<Option<Vec<PathBuf>>> = None;
    let mut removed = vec![];
    for dir in candidates {
        // Not following symlinks: only real folders directly under root.
        if !std::fs::symlink_metadata(&dir).is_ok_and(|m| m.is_dir()) {
            continue;
        }
        let creator = dir.join(CREATOR);
        let _held = match std::fs::symlink_metadata(&creator) {
            Ok(m) if m.is_file() => match creator_gone(&creator) {
                Some(lock) => lock,
                None => continue,
            },
            Ok(_) => continue,
            Err(e) if e.kind() == io::ErrorKind::NotFound => {
                // Without /proc nobody can tell who uses the folder: keep it.
                let Some(open) = open_paths.get_or_insert_with(|| open_files_under(root)) else {
                    continue;
                };
                match legacy_stale(&dir, open) {
                    Some(lock) => lock,
                    None => continue,
                }
            }
            Err(_) => continue,
        };
        // The spill folder first: while the store folder remains, its ledger
        // still says where the spill folder is.
        if let Some(spill) = ledger::read_settings(&dir.join(LEDGER)).and_then(|s| s.spill)
            && spill.is_absolute()
            && spill != dir
            && spill.file_name() == dir.file_name()
            && std::fs::symlink_metadata(&spill).is_ok_and(|m| m.is_dir())
        {
            if std::fs::remove_dir_all(&spill).is_err() {
                continue;
            }
            removed.push(spill);
        }
        if std::fs::remove_dir_all(&dir).is_ok() {
            removed.push(dir);
        }
    }
    removed
}

/// The exclusive lock on `.agent` when no creator holds it (the caller keeps
/// it while removing the folder); `None` when a creator is alive or the file
/// cannot be opened or locked.
fn creator_gone(path: &Path) -> Option<File> {
    let f = File::open(path).ok()?;
    match f.try_lock() {
        Ok(()) => Some(f),
        Err(TryLockError::WouldBlock | TryLockError::Error(_)) => None,
    }
}

/// For a folder without `.agent`: the exclusive ledger lock when the folder
/// holds a valid ledger, neither it nor the ledger changed for
/// [`LEGACY_MIN_AGE`], and no file in it is among `open` (the files some
/// process has open); `None` otherwise.
fn legacy_stale(dir: &Path, open: &[PathBuf]) -> Option<File> {
    let ledger_path = dir.join(LEDGER);
    if !std::fs::symlink_metadata(&ledger_path).is_ok_and(|m| m.is_file()) {
        return None;
    }
    ledger::read_settings(&ledger_path)?;
    let now = SystemTime::now();
    for p in [dir, ledger_path.as_path()] {
        let modified = std::fs::metadata(p).and_then(|m| m.modified()).ok()?;
        if now.duration_since(modified).unwrap_or_default() < LEGACY_MIN_AGE {
            return None;
        }
    }
    let real = std::fs::canonicalize(dir).ok()?;
    if open.iter().any(|p| p.starts_with(&real)) {
        return None;
    }
    // Not in the middle of an accounting change by anyone.
    let f = File::open(&ledger_path).ok()?;
    f.try_lock().ok()?;
    Some(f)
}

/// The files under `root` that some process this user may inspect has open,
/// from `/proc/<pid>/fd` (an unlinked file's target ends in " (deleted)",
/// which keeps its folder as a prefix); `None` when `/proc` cannot be read.
fn open_files_under(root: &Path) -> Option<Vec<PathBuf>> {
    let real_root = std::fs::canonicalize(root).ok()?;
    let procs = std::fs::read_dir("/proc").ok()?;
    let mut out = vec![];
    for p in procs.flatten() {
        if !p.file_name().to_str().is_some_and(|n| n.bytes().all(|b| b.is_ascii_digit())) {
            continue;
        }
        let Ok(fds) = std::fs::read_dir(p.path().join("fd")) else { continue };
        for fd in fds.flatten() {
            if let Ok(target) = std::fs::read_link(fd.path())
                && target.starts_with(&real_root)
            {
                out.push(target);
            }
        }
    }
    Some(out)
}

/// Whether `name` is a store folder's name (`tpuray-<node id>`).
fn is_store_name(name: &OsStr) -> bool {
    name.to_str().is_some_and(|n| n.len() > STORE_PREFIX.len() && n.starts_with(STORE_PREFIX))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{LocalStore, StoreConfig};

    /// A store `root/tpuray-<node>` spilling to `spill/tpuray-<node>`, with
    /// one object in memory and one spilled (larger than the store).
    fn agent_store(root: &Path, spill: &Path, node: &str) -> LocalStore {
        let s = LocalStore::open_with(StoreConfig {
            dir: root.join(format!("tpuray-{node}")),
            capacity_bytes: Some(1000),
            spill_dir: Some(spill.into()),
        })
        .unwrap();
        s.put("small", b"abc").unwrap();
        s.put("big", &[7u8; 5000]).unwrap();
        assert!(spill.join(format!("tpuray-{node}")).join("big").exists());
        s
    }

    fn age(path: &Path, by: Duration) {
        let t = SystemTime::now() - by;
        File::open(path).unwrap().set_modified(t).unwrap();
    }

    #[test]
    fn a_live_creators_store_is_kept_obj_13() {
        let (root, spill) = (tempfile::tempdir().unwrap(), tempfile::tempdir().unwrap());
        let s = agent_store(root.path(), spill.path(), "live");
        // Attachers and clones do not change anything.
        let attached = LocalStore::open(s.dir()).unwrap();
        assert!(sweep_stale_stores(root.path()).is_empty());
        let clone = s.clone();
        drop(s);
        assert!(sweep_stale_stores(root.path()).is_empty(), "a clone keeps the lock");
        assert_eq!(&*attached.get("big").unwrap().unwrap(), &[7u8; 5000][..]);
        assert_eq!(
            std::fs::read_to_string(clone.dir().join(CREATOR)).unwrap(),
            format!("{}\n", std::process::id())
        );
    }

    #[test]
    fn a_gone_creators_store_and_spill_folder_are_removed_obj_13() {
        let (root, spill) = (tempfile::tempdir().unwrap(), tempfile::tempdir().unwrap());
        let dead = agent_store(root.path(), spill.path(), "dead");
        let live = agent_store(root.path(), spill.path(), "live");
        let dead_dir = dead.dir().to_path_buf();
        drop(dead);
        let removed = sweep_stale_stores(root.path());
        assert_eq!(removed, vec![spill.path().join("tpuray-dead"), dead_dir.clone()]);
        assert!(!dead_dir.exists());
        assert!(!spill.path().join("tpuray-dead").exists());
        // The other store, its spill folder and the spill root stay.
        assert!(live.dir().join("small").exists());
        assert!(spill.path().join("tpuray-live").join("big").exists());
        assert!(sweep_stale_stores(root.path()).is_empty());
        // A new agent on the swept name starts afresh.
        let again = agent_store(root.path(), spill.path(), "dead");
        assert!(sweep_stale_stores(root.path()).is_empty());
        drop(again);
    }

    #[test]
    fn what_is_not_a_store_is_never_touched() {
        let (root, spill) = (tempfile::tempdir().unwrap(), tempfile::tempdir().unwrap());
        let r = root.path();
        // Not named tpuray-*: even a real, dead store.
        drop(
            LocalStore::open_with(StoreConfig { dir: r.join("mystore"), ..Default::default() })
                .unwrap(),
        );
        // Named tpuray-* but no .agent nor ledger; a file; a symlink to a dead store.
        std::fs::create_dir(r.join("tpuray-notes")).unwrap();
        std::fs::write(r.join("tpuray-notes").join("todo.txt"), "keep").unwrap();
        std::fs::write(r.join("tpuray-file"), "keep").unwrap();
        let elsewhere = tempfile::tempdir().unwrap();
        let target = elsewhere.path().join("tpuray-target");
        drop(
            LocalStore::open_with(StoreConfig { dir: target.clone(), ..Default::default() })
                .unwrap(),
        );
        std::os::unix::fs::symlink(&target, r.join("tpuray-link")).unwrap();
        // `.agent` that is a directory.
        std::fs::create_dir_all(r.join("tpuray-odd").join(CREATOR)).unwrap();
        // A dead store whose ledger names a spill folder of another name.
        let s = LocalStore::open_with(StoreConfig {
            dir: r.join("tpuray-tampered"),
            capacity_bytes: None,
            spill_dir: Some(spill.path().into()),
        })
        .unwrap();
        {
            let mut g = s.lock().unwrap();
            let bogus =
                crate::ledger::Settings { capacity: u64::MAX, spill: Some(spill.path().into()) };
            g.write_settings(bogus).unwrap();
        }
        std::fs::write(spill.path().join("precious"), "keep").unwrap();
        drop(s);
        assert_eq!(sweep_stale_stores(r), vec![r.join("tpuray-tampered")]);
        for kept in ["mystore", "tpuray-notes/todo.txt", "tpuray-file", "tpuray-link", "tpuray-odd"]
        {
            assert!(std::fs::symlink_metadata(r.join(kept)).is_ok(), "{kept} was removed");
        }
        assert!(target.join(CREATOR).exists());
        assert!(spill.path().join("precious").exists());
        assert!(spill.path().join("tpuray-tampered").exists(), "not the recorded spill folder");
        assert!(sweep_stale_stores(&r.join("missing")).is_empty());
    }

    #[test]
    fn a_store_without_creator_record_goes_only_when_old_and_unused() {
        let (root, spill) = (tempfile::tempdir().unwrap(), tempfile::tempdir().unwrap());
        let dir = root.path().join("tpuray-legacy");
        drop(agent_store(root.path(), spill.path(), "legacy"));
        // What an older version left: no .agent.
        std::fs::remove_file(dir.join(CREATOR)).unwrap();
        assert!(sweep_stale_stores(root.path()).is_empty(), "changed just now");
        let old = LEGACY_MIN_AGE + Duration::from_secs(60);
        age(&dir.join(LEDGER), old);
        age(&dir, old);
        // A process attached to it (here: this one) keeps it.
        let attached = LocalStore::open(&dir).unwrap();
        assert!(sweep_stale_stores(root.path()).is_empty(), "open in a process");
        drop(attached);
        age(&dir.join(LEDGER), old);
        age(&dir, old);
        let removed = sweep_stale_stores(root.path());
        assert_eq!(removed, vec![spill.path().join("tpuray-legacy"), dir.clone()]);
        assert!(!dir.exists());
    }
}
