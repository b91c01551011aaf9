//! The recycled arena of DESIGN.md §11: freed objects' files, with their
//! tmpfs pages still allocated, kept in `<store>/.pool/` and handed to the
//! next writers.
//!
//! Writing into a fresh tmpfs file costs a page allocation and zeroing per
//! 4 KiB page (about 1 GB/s here, a third of a `memcpy` into new memory);
//! writing into pages that already exist runs near `memcpy` speed. So
//! [`LocalStore::delete`] moves an object's file into the pool instead of
//! unlinking it, when nobody maps it (its exclusive `flock` can be taken,
//! OBJ-6) and the pool has room; [`crate::Writer`] takes the best-fitting
//! pool file, renames it to its temporary and writes through a mapping
//! populated up front (`MAP_POPULATE`: one call instead of a fault per page).
//!
//! A process keeps its mappings of the last [`CACHED_MAPS`] files it wrote
//! this way (OBJ-11), and takes those files from the pool first: writing
//! through a mapping whose page tables already exist runs at `memcpy`
//! speed (Plasma's clients map their arena once for the same reason).
//!
//! Invariants:
//! - OBJ-9: the pool's bytes count in the ledger (they are memory), so
//!   OBJ-3 holds with them; making room gives them back before any object
//!   is evicted or spilled. [`crate::StoreUsage::used_bytes`] leaves them
//!   out and [`crate::StoreUsage::pooled_bytes`] shows them.
//! - OBJ-10: a reader never maps a recycled file as the object it asked
//!   for: a file is recycled only under its exclusive lock, and a reader,
//!   once it holds its shared lock, checks that the object's name still
//!   points at the inode it opened (`open_view`).
//!
//! - OBJ-11: a cached mapping never keeps memory the ledger gave back:
//!   files that leave memory while nobody reads them (pool trimming,
//!   eviction, spilling, a delete that does not recycle) are truncated
//!   before they are unlinked, which takes their pages out of every
//!   mapping; a mapping of a file unlinked while a reader held it is
//!   dropped at the process's next sized write.
//!
//! Pool files are named `<size>.<pid>.<n>`; the pool holds at most
//! [`POOL_FILES`] files and [`pool_limit`] bytes. Every function here runs
//! with the ledger lock held by the caller.
//!
//! The numbers: a sized writer takes the best fit among pool files of half to twice its
//! size, and only for objects of at least 1 MiB; the pool is bounded by half the
//! capacity, at most 8 GiB and 32 files; `tpuray memory` shows pool bytes as reusable.
//! Cached mappings come from a second, unlocked handle: a mapping keeps its file
//! description, and with it any `flock`, alive. The owner deletes its own node's copy of
//! a freed object at once (other nodes' through their agents), so a put loop reuses the
//! pages.

use std::fs::File;
use std::io;
use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};

use memmap2::MmapMut;

use crate::ledger::Guard;
use crate::pressure::{free_pages, list, next_temp_name};
use crate::{LocalStore, not_found_ok};

/// Mappings a process keeps (OBJ-11).
pub(crate) const CACHED_MAPS: usize = 4;

/// A file's identity: (device, inode).
pub(crate) type FileKey = (u64, u64);

/// A mapping this process wrote an object through, kept for the next write
/// into the same file (OBJ-11).
#[derive(Debug)]
pub(crate) struct CachedMap {
    key: FileKey,
    /// An unlocked handle of the file, to see whether it still exists.
    file: File,
    map: MmapMut,
}

/// The pool's folder inside the store folder.
pub(crate) const POOL: &str = ".pool";
/// At most this many files wait in the pool.
pub(crate) const POOL_FILES: usize = 32;
/// At most this many bytes wait in the pool, whatever the capacity.
const POOL_MAX_BYTES: u64 = 8 << 30;
/// Smaller objects are neither recycled nor written into pool files: their
/// few pages cost less than the pool's bookkeeping.
pub(crate) const POOL_MIN_BYTES: u64 = 1 << 20;

/// Bytes the pool may hold for a store of `capacity` bytes: half of it, at
/// most 8 GiB.
pub(crate) fn pool_limit(capacity: u64) -> u64 {
    (capacity / 2).min(POOL_MAX_BYTES)
}

/// One file waiting in the pool.
pub(crate) struct Pooled {
    pub path: PathBuf,
    /// Bytes (its length; every page of it was written once).
    pub size: u64,
    pub key: FileKey,
}

impl LocalStore {
    pub(crate) fn pool_dir(&self) -> PathBuf {
        self.dir().join(POOL)
    }

    /// The files waiting in the pool.
    pub(crate) fn pool_list(&self) -> io::Result<Vec<Pooled>> {
        let mut out = vec![];
        for (_, ent) in list(&self.pool_dir())? {
            match ent.metadata() {
                Ok(m) if m.is_file() => {
                    out.push(Pooled { path: ent.path(), size: m.len(), key: (m.dev(), m.ino()) })
                }
                Ok(_) => {}
                Err(e) if e.kind() == io::ErrorKind::NotFound => {}
                Err(e) => return Err(e),
            }
        }
        Ok(out)
    }

    /// Moves the sealed object at `path` (`size` bytes, opened as `file`
    /// and locked exclusively by the caller, so nobody maps it) into the
    /// pool when there is room. Returns whether it did; the ledger's
    /// counter is unchanged either way (OBJ-9).
    pub(crate) fn recycle(&self, g: &Guard<'_>, path: &Path, size: u64) -> io::Result<bool> {
        if size < POOL_MIN_BYTES {
            return Ok(false);
        }
        let pool = self.pool_list()?;
        let held: u64 = pool.iter().map(|p| p.size).sum();
        if pool.len() >= POOL_FILES || held + size > pool_limit(g.settings.capacity) {
            return Ok(false);
        }
        let dir = self.pool_dir();
        std::fs::create_dir_all(&dir)?;
        loop {
            let to = dir.join(format!("{size}.{}", next_temp_name()));
            // A hard link never replaces an existing name; then drop the old.
            match std::fs::hard_link(path, &to) {
                Ok(()) => {
                    if let Err(e) = std::fs::remove_file(path) {
                        let _ = std::fs::remove_file(&to);
                        return Err(e);
                    }
                    return Ok(true);
                }
                Err(e) if e.kind() == io::ErrorKind::AlreadyExists => continue,
                Err(e) => return Err(e),
            }
        }
    }

    /// Takes the pool file that best fits `want` bytes (one this process
    /// keeps a mapping of, else the smallest at least as large, else the
    /// largest smaller one; only files between half and twice `want`, so a
    /// large file is not cut down for a small object) and links it at `to`
    /// (a writer's temporary name), leaving it out of the pool. Returns its
    /// size; the caller adjusts the ledger from that size to its
    /// reservation.
    pub(crate) fn take_pooled(&self, want: u64, to: &Path) -> io::Result<Option<u64>> {
        if want < POOL_MIN_BYTES {
            return Ok(None);
        }
        let pool = self.pool_list()?;
        let near = || pool.iter().filter(|p| p.size >= want / 2 && p.size <= want * 2);
        let mapped: Vec<FileKey> = self.maps().iter().map(|c| c.key).collect();
        let fit =
            near().filter(|p| p.size >= want).min_by_key(|p| (!mapped.contains(&p.key), p.size));
        let Some(p) = fit.or_else(|| near().max_by_key(|p| p.size)) else {
            return Ok(None);
        };
        std::fs::hard_link(&p.path, to)?;
        std::fs::remove_file(&p.path)?;
        Ok(Some(p.size))
    }

    /// Removes pool files, largest first, until `needed` more bytes fit or
    /// the pool is empty (OBJ-9: the pool goes before any object).
    pub(crate) fn trim_pool(&self, g: &mut Guard<'_>, needed: u64) -> io::Result<()> {
        if g.fits(needed) {
            return Ok(());
        }
        let mut pool = self.pool_list()?;
        pool.sort_by_key(|p| std::cmp::Reverse(p.size));
        for p in pool {
            if g.fits(needed) {
                break;
            }
            free_pages(&p.path);
            not_found_ok(std::fs::remove_file(&p.path))?;
            g.sub(p.size)?;
        }
        Ok(())
    }

    /// Empties the pool (`tpuray stop`, tests): its pages go back to the
    /// system.
    pub fn release_pool(&self) -> crate::Result<()> {
        let mut g = self.lock()?;
        for p in self.pool_list().map_err(|e| self.io(e))? {
            free_pages(&p.path);
            not_found_ok(std::fs::remove_file(&p.path)).map_err(|e| self.io(e))?;
            g.sub(p.size).map_err(|e| self.io(e))?;
        }
        Ok(())
    }
}

impl LocalStore {
    fn maps(&self) -> std::sync::MutexGuard<'_, Vec<CachedMap>> {
        self.inner.maps.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Takes this process's mapping of the file `key`, when it covers at
    /// least `len` bytes. Drops, on the way, mappings of files that no
    /// longer exist (OBJ-11).
    pub(crate) fn cached_map(&self, key: FileKey, len: u64) -> Option<MmapMut> {
        let mut maps = self.maps();
        maps.retain(|c| c.file.metadata().is_ok_and(|m| m.nlink() > 0));
        let i = maps.iter().position(|c| c.key == key && c.map.len() as u64 >= len)?;
        Some(maps.remove(i).map)
    }

    /// Keeps `map`, a mapping of the file at `path` (just sealed), for the
    /// next write into that file; the oldest of more than [`CACHED_MAPS`]
    /// goes.
    pub(crate) fn cache_map(&self, path: &Path, map: MmapMut) {
        let Ok(file) = File::open(path) else { return };
        let Ok(m) = file.metadata() else { return };
        let mut maps = self.maps();
        let key = (m.dev(), m.ino());
        maps.retain(|c| c.key != key);
        if maps.len() >= CACHED_MAPS {
            maps.remove(0);
        }
        maps.push(CachedMap { key, file, map });
    }
}

/// Opens a file taken from the pool (now at the writer's temporary `path`)
/// for writing and locks it exclusively, as [`crate::pressure::new_temp`]
/// does for a new one.
pub(crate) fn open_taken(path: &Path) -> io::Result<File> {
    let f = std::fs::OpenOptions::new().read(true).write(true).open(path)?;
    f.lock()?;
    Ok(f)
}
