//! Memory pressure: scanning the folders (reclaiming dead writers), making
//! room by evicting secondary copies and spilling primary ones, and
//! restoring spilled objects. Every function here runs with the ledger lock
//! held by the caller (its [`Guard`] is passed in).

use std::collections::HashSet;
use std::fs::{File, OpenOptions, TryLockError};
use std::io;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::SystemTime;

use crate::ledger::Guard;
use crate::{CopyKind, LocalStore, Result, StoreError, check_id, not_found_ok};

/// A sealed object found by a scan.
pub(crate) struct Entry {
    pub id: String,
    /// Bytes.
    pub size: u64,
    pub mtime: SystemTime,
}

/// What [`LocalStore::rescan`] found.
#[derive(Default)]
pub(crate) struct Scan {
    pub memory: Vec<Entry>,
    pub spilled: Vec<Entry>,
    /// Bytes reserved by live writers in the memory folder.
    pub writing: u64,
    /// Bytes of the files waiting in the pool (pool.rs, OBJ-9).
    pub pooled: u64,
}

static NEXT_TEMP: AtomicU64 = AtomicU64::new(0);

/// `<pid>.<n>`, a name part no other live process uses.
pub(crate) fn next_temp_name() -> String {
    format!("{}.{}", std::process::id(), NEXT_TEMP.fetch_add(1, Ordering::Relaxed))
}

/// `dir/.w.<pid>.<n>.<id>`: the name of a new temporary of object `id`.
pub(crate) fn temp_path(dir: &Path, id: &str) -> PathBuf {
    dir.join(format!(".w.{}.{id}", next_temp_name()))
}

/// Creates `dir/.w.<pid>.<n>.<id>` and locks it exclusively: the lock lives
/// as long as the writer's process, which is how a scan tells a live writer
/// from a dead one's leftovers (OBJ-1). Callers hold the ledger lock, so no
/// scan sees the file before it is locked.
pub(crate) fn new_temp(dir: &Path, id: &str) -> io::Result<(PathBuf, File)> {
    loop {
        let path = temp_path(dir, id);
        match OpenOptions::new().read(true).write(true).create_new(true).open(&path) {
            Ok(f) => {
                if let Err(e) = f.lock() {
                    let _ = std::fs::remove_file(&path);
                    return Err(e);
                }
                return Ok((path, f));
            }
            // A dead process with our pid left this name: take the next.
            Err(e) if e.kind() == io::ErrorKind::AlreadyExists => continue,
            Err(e) => return Err(e),
        }
    }
}

/// Gives the temporary `tmp` its final name `target` without ever replacing
/// an existing one (OBJ-2): a hard link, or a rename where the filesystem
/// has no hard links (callers hold the ledger lock, so the existence check
/// cannot race another store user). `AlreadyExists` when `target` exists.
pub(crate) fn link_new(tmp: &Path, target: &Path) -> io::Result<()> {
    match std::fs::hard_link(tmp, target) {
        Ok(()) => Ok(()),
        Err(e) if e.kind() == io::ErrorKind::AlreadyExists => Err(e),
        Err(_) if target.exists() => Err(io::ErrorKind::AlreadyExists.into()),
        Err(_) => std::fs::rename(tmp, target),
    }
}

/// Truncates the file at `path` to nothing before it is unlinked, so that
/// its pages go back even while a writer's cached mapping (OBJ-11) still
/// covers them. Only for files nobody reads: the caller holds the file's
/// exclusive lock, or it is in the pool. Best effort.
pub(crate) fn free_pages(path: &Path) {
    if let Ok(f) = OpenOptions::new().write(true).open(path) {
        let _ = f.set_len(0);
    }
}

/// Whether someone holds a lock on `path` (a reader's shared pin, OBJ-6).
/// Absent or unreadable files are not pinned.
pub(crate) fn is_pinned(path: &Path) -> bool {
    let Ok(f) = File::open(path) else { return false };
    matches!(f.try_lock(), Err(TryLockError::WouldBlock))
}

/// For a temporary: `Some(length)` when its writer is alive; when it is dead
/// the file is removed and `None` returned (OBJ-1).
fn live_temp(path: &Path) -> io::Result<Option<u64>> {
    let f = match File::open(path) {
        Ok(f) => f,
        Err(e) if e.kind() == io::ErrorKind::NotFound => return Ok(None),
        Err(e) => return Err(e),
    };
    match f.try_lock() {
        Ok(()) => {
            not_found_ok(std::fs::remove_file(path))?;
            Ok(None)
        }
        Err(TryLockError::WouldBlock) => Ok(Some(f.metadata()?.len())),
        Err(TryLockError::Error(e)) => Err(e),
    }
}

enum Name<'a> {
    Temp,
    Meta(&'a str),
    Object(&'a str),
    Other,
}

fn classify(name: &str) -> Name<'_> {
    if name.starts_with(".w.") {
        Name::Temp
    } else if let Some(id) = name.strip_prefix(".m.") {
        Name::Meta(id)
    } else if check_id(name).is_ok() {
        Name::Object(name)
    } else {
        Name::Other
    }
}

/// The entries of `dir` with UTF-8 names; none when it does not exist.
pub(crate) fn list(dir: &Path) -> io::Result<Vec<(String, std::fs::DirEntry)>> {
    let rd = match std::fs::read_dir(dir) {
        Ok(rd) => rd,
        Err(e) if e.kind() == io::ErrorKind::NotFound => return Ok(vec![]),
        Err(e) => return Err(e),
    };
    let mut out = vec![];
    for ent in rd {
        let ent = ent?;
        if let Ok(name) = ent.file_name().into_string() {
            out.push((name, ent));
        }
    }
    Ok(out)
}

fn entry(id: &str, ent: &std::fs::DirEntry) -> io::Result<Option<Entry>> {
    match ent.metadata() {
        Ok(m) if m.is_file() => Ok(Some(Entry {
            id: id.to_string(),
            size: m.len(),
            mtime: m.modified().unwrap_or(SystemTime::UNIX_EPOCH),
        })),
        Ok(_) => Ok(None),
        Err(e) if e.kind() == io::ErrorKind::NotFound => Ok(None),
        Err(e) => Err(e),
    }
}

impl LocalStore {
    /// Lists both folders, removes dead writers' temporaries, spill copies
    /// that also exist in memory (left by a process that died mid-spill or
    /// mid-restore) and orphaned sidecars, and sets the ledger's counter to
    /// what is really in memory.
    pub(crate) fn rescan(&self, g: &mut Guard<'_>) -> Result<Scan> {
        let mut scan = Scan::default();
        let mut metas = vec![];
        for (name, ent) in list(self.dir()).map_err(|e| self.io(e))? {
            match classify(&name) {
                Name::Temp => {
                    if let Some(n) = live_temp(&ent.path()).map_err(|e| self.io(e))? {
                        scan.writing += n;
                    }
                }
                Name::Meta(id) => metas.push(id.to_string()),
                Name::Object(id) => scan.memory.extend(entry(id, &ent).map_err(|e| self.io(e))?),
                Name::Other => {}
            }
        }
        let in_memory: HashSet<&str> = scan.memory.iter().map(|e| e.id.as_str()).collect();
        let mut spilled = vec![];
        if let Some(spill) = g.settings.spill.clone() {
            let sio = |e| StoreError::Io { dir: spill.clone(), source: e };
            for (name, ent) in list(&spill).map_err(sio)? {
                match classify(&name) {
                    Name::Temp => {
                        live_temp(&ent.path()).map_err(sio)?;
                    }
                    Name::Object(id) if in_memory.contains(id) => {
                        not_found_ok(std::fs::remove_file(ent.path())).map_err(sio)?;
                    }
                    Name::Object(id) => spilled.extend(entry(id, &ent).map_err(sio)?),
                    _ => {}
                }
            }
        }
        let spilled_ids: HashSet<&str> = spilled.iter().map(|e| e.id.as_str()).collect();
        for id in metas {
            if !in_memory.contains(id.as_str()) && !spilled_ids.contains(id.as_str()) {
                let _ = std::fs::remove_file(self.meta_path(&id));
            }
        }
        scan.spilled = spilled;
        scan.pooled = self.pool_list().map_err(|e| self.io(e))?.iter().map(|p| p.size).sum();
        let used = scan.memory.iter().map(|e| e.size).sum::<u64>() + scan.writing + scan.pooled;
        g.set_used(used).map_err(|e| self.io(e))?;
        Ok(scan)
    }

    /// Makes room for `needed` more bytes in memory (OBJ-3, OBJ-4, OBJ-9):
    /// rescans when the counter says full, empties the pool as far as
    /// needed, then evicts unpinned secondary copies and,
    /// with `spill` and a spill folder, spills unpinned primary copies,
    /// oldest first, until the bytes fit. Never waits (OBJ-7).
    ///
    /// # Errors
    /// [`StoreError::Full`] naming what is pinned; [`StoreError::Io`] when a
    /// spill fails (the object then stays in memory).
    pub(crate) fn make_room(
        &self,
        g: &mut Guard<'_>,
        id: &str,
        needed: u64,
        spill: bool,
    ) -> Result<()> {
        if g.fits(needed) {
            return Ok(());
        }
        let scan = self.rescan(g)?;
        self.trim_pool(g, needed).map_err(|e| self.io(e))?;
        if g.fits(needed) {
            return Ok(());
        }
        let mut candidates: Vec<(CopyKind, Entry)> =
            scan.memory.into_iter().map(|e| (self.read_meta(&e.id).0, e)).collect();
        // Secondary copies first, then primaries; oldest first in each.
        candidates.sort_by(|(ka, a), (kb, b)| {
            (*ka == CopyKind::Primary, a.mtime, &a.id).cmp(&(
                *kb == CopyKind::Primary,
                b.mtime,
                &b.id,
            ))
        });
        let spill_dir = g.settings.spill.clone();
        let (mut pinned, mut unspillable) = (0, 0);
        for (kind, e) in candidates {
            if g.fits(needed) {
                break;
            }
            if kind == CopyKind::Primary && (spill_dir.is_none() || !spill) {
                if spill_dir.is_none() {
                    unspillable += e.size;
                }
                continue;
            }
            let path = self.path(&e.id);
            let f = match File::open(&path) {
                Ok(f) => f,
                Err(err) if err.kind() == io::ErrorKind::NotFound => continue,
                Err(err) => return Err(self.io(err)),
            };
            // OBJ-6: a reader's shared lock makes this fail; skip the object.
            match f.try_lock() {
                Ok(()) => {}
                Err(TryLockError::WouldBlock) => {
                    pinned += e.size;
                    continue;
                }
                Err(TryLockError::Error(err)) => return Err(self.io(err)),
            }
            match (kind, &spill_dir) {
                (CopyKind::Primary, Some(dir)) => self.spill_one(dir, &e.id, &f)?,
                _ => {
                    free_pages(&path);
                    not_found_ok(std::fs::remove_file(&path)).map_err(|err| self.io(err))?;
                    let _ = std::fs::remove_file(self.meta_path(&e.id));
                }
            }
            drop(f);
            g.sub(e.size).map_err(|err| self.io(err))?;
        }
        if g.fits(needed) {
            return Ok(());
        }
        Err(StoreError::Full {
            id: id.to_string(),
            requested: needed,
            capacity: g.settings.capacity,
            pinned,
            writing: scan.writing,
            unspillable,
        })
    }

    /// Copies object `id` (open as `src`, locked exclusively) to the spill
    /// folder, renames it into place, then unlinks the memory copy (OBJ-4).
    fn spill_one(&self, dir: &Path, id: &str, src: &File) -> Result<()> {
        let sio = |e| StoreError::Io { dir: dir.to_path_buf(), source: e };
        std::fs::create_dir_all(dir).map_err(sio)?;
        let (tmp, mut out) = new_temp(dir, id).map_err(sio)?;
        let copied = io::copy(&mut &*src, &mut out).and_then(|_| {
            drop(out);
            std::fs::rename(&tmp, dir.join(id))
        });
        if let Err(e) = copied {
            let _ = std::fs::remove_file(&tmp);
            return Err(sio(e));
        }
        free_pages(&self.path(id));
        not_found_ok(std::fs::remove_file(self.path(id))).map_err(|e| self.io(e))
    }

    /// Restores spilled object `id` (`size` bytes at `spilled`) into memory
    /// when it fits without spilling anything (secondary copies may be
    /// evicted). Returns whether it did; on `false` the caller maps the
    /// spill file instead.
    pub(crate) fn restore(
        &self,
        g: &mut Guard<'_>,
        id: &str,
        spilled: &Path,
        size: u64,
    ) -> Result<bool> {
        if size > g.settings.capacity {
            return Ok(false);
        }
        match self.make_room(g, id, size, false) {
            Ok(()) => {}
            Err(StoreError::Full { .. }) => return Ok(false),
            Err(e) => return Err(e),
        }
        g.add(size).map_err(|e| self.io(e))?;
        let mut tmp = None;
        let copied = (|| -> io::Result<()> {
            let (t, mut out) = new_temp(self.dir(), id)?;
            tmp = Some(t.clone());
            io::copy(&mut File::open(spilled)?, &mut out)?;
            // Release our exclusive lock before anyone (our caller) maps it.
            drop(out);
            link_new(&t, &self.path(id))?;
            not_found_ok(std::fs::remove_file(&t))?;
            not_found_ok(std::fs::remove_file(spilled))
        })();
        if copied.is_err() {
            // The spill file is intact: fall back to mapping it.
            if let Some(t) = tmp {
                let _ = std::fs::remove_file(t);
            }
            if !self.path(id).exists() {
                g.sub(size).map_err(|e| self.io(e))?;
                return Ok(false);
            }
        }
        Ok(true)
    }
}
