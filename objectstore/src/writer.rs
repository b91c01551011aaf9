//! [`Writer`]: an object being written into a locked temporary, reserving
//! memory before each write (OBJ-3) and sealed by a hard link (OBJ-1). A
//! writer that knows its size starts from a recycled file when the pool has
//! one (OBJ-9) and writes it through a populated mapping.
//!
//! OBJ-12: a write of 32 MiB or more into a mapping is split across up to four threads
//! (no more than the process's CPUs): one thread does not saturate memory bandwidth
//! (Ray's plasma client copies large buffers in parallel too).

use std::fs::File;
use std::io::{self, Read, Seek, SeekFrom, Write};
use std::os::unix::fs::MetadataExt;
use std::path::PathBuf;

use memmap2::{MmapMut, MmapOptions};

use crate::ledger::Guard;
use crate::pool::open_taken;
use crate::pressure::{link_new, new_temp, temp_path};
use crate::{CopyKind, CreateOptions, LocalStore, Result, StoreError};

/// An object being written; visible to readers only after [`Writer::seal`].
/// Dropping it unsealed removes the temporary and returns its reservation.
///
/// In memory, the temporary's length is the reservation (holes on tmpfs take
/// no memory), so a scan can count a live writer's reservation from the
/// folder alone. Once the object outgrows the store, or when it is created
/// larger than the store, it is written through to the spill folder and
/// reserves no memory.
pub struct Writer {
    store: LocalStore,
    id: String,
    copy: CopyKind,
    owner: Option<String>,
    /// `None` once sealed or discarded.
    file: Option<File>,
    tmp: PathBuf,
    /// Writing through to the spill folder.
    on_disk: bool,
    written: u64,
    /// Bytes counted in the ledger for this writer (0 on disk).
    reserved: u64,
    /// A recycled file's pages, mapped up front (writes copy into it until
    /// the object outgrows it).
    map: Option<MmapMut>,
}

impl Writer {
    /// Creates the temporary and reserves `opts.size` (see
    /// [`LocalStore::create_with`]). The caller holds the ledger lock.
    pub(crate) fn start(
        store: LocalStore,
        g: &mut Guard<'_>,
        id: &str,
        opts: &CreateOptions,
    ) -> Result<Self> {
        let size = opts.size.unwrap_or(0);
        let on_disk = size > g.settings.capacity;
        let dir = match (&g.settings.spill, on_disk) {
            (_, false) => store.dir().to_path_buf(),
            (Some(s), true) => s.clone(),
            (None, true) => {
                return Err(StoreError::TooLarge {
                    id: id.into(),
                    size,
                    capacity: g.settings.capacity,
                });
            }
        };
        let dio = |e| StoreError::Io { dir: dir.clone(), source: e };
        let reserve = if on_disk { 0 } else { size };
        // A pool file comes with its own bytes counted (OBJ-9); from_pool
        // counts the difference to `reserve`.
        let pooled =
            if !on_disk && reserve > 0 { from_pool(&store, g, id, reserve)? } else { None };
        let (tmp, file, map) = match pooled {
            Some(x) => x,
            None => {
                if on_disk {
                    std::fs::create_dir_all(&dir).map_err(dio)?;
                } else if reserve > 0 {
                    store.make_room(g, id, reserve, true)?;
                    // Count first: a crash before the file grows leaves the
                    // counter too high, which the next scan corrects (ledger.rs).
                    g.add(reserve).map_err(dio)?;
                }
                let made = new_temp(&dir, id).and_then(|(tmp, file)| {
                    if reserve > 0
                        && let Err(e) = file.set_len(reserve)
                    {
                        let _ = std::fs::remove_file(&tmp);
                        return Err(e);
                    }
                    Ok((tmp, file, None))
                });
                match made {
                    Ok(x) => x,
                    Err(e) => {
                        let _ = g.sub(reserve);
                        return Err(dio(e));
                    }
                }
            }
        };
        Ok(Self {
            store,
            id: id.to_string(),
            copy: opts.copy,
            owner: opts.owner.clone(),
            file: Some(file),
            tmp,
            on_disk,
            written: 0,
            reserved: reserve,
            map,
        })
    }

    /// Appends bytes, first reserving room for them in memory (making room
    /// as described in the crate docs) or switching to the spill folder when
    /// the object outgrows the whole store.
    ///
    /// # Errors
    /// The write failed (disk or shared memory full); the store's own
    /// refusals ([`StoreError::Full`], [`StoreError::TooLarge`]) come wrapped
    /// in the [`io::Error`] (`io::Error::downcast::<StoreError>`).
    pub fn write(&mut self, data: &[u8]) -> io::Result<()> {
        let need = self.written + data.len() as u64;
        if let Some(map) = self.map.as_mut() {
            if need <= map.len() as u64 {
                copy_parallel(&mut map[self.written as usize..need as usize], data);
                self.written = need;
                return Ok(());
            }
            // Outgrowing the mapping: go on with writes at the same offset.
            self.map = None;
            if let Some(f) = self.file.as_mut() {
                f.seek(SeekFrom::Start(self.written))?;
            }
        }
        if !self.on_disk && need > self.reserved {
            self.grow(need).map_err(io::Error::other)?;
        }
        let Some(file) = self.file.as_mut() else {
            return Err(io::Error::other("object writer already sealed"));
        };
        file.write_all(data)?;
        self.written = need;
        Ok(())
    }

    /// Bytes written so far.
    pub fn written(&self) -> u64 {
        self.written
    }

    /// Whether the object is being written through to the spill folder.
    pub fn is_on_disk(&self) -> bool {
        self.on_disk
    }

    fn grow(&mut self, need: u64) -> Result<()> {
        let store = self.store.clone();
        let mut g = store.lock()?;
        if need > g.settings.capacity {
            return match g.settings.spill.clone() {
                Some(dir) => self.move_to_disk(&mut g, dir),
                None => Err(StoreError::TooLarge {
                    id: self.id.clone(),
                    size: need,
                    capacity: g.settings.capacity,
                }),
            };
        }
        // OBJ-3: reserve (making room) before the bytes are written.
        let delta = need - self.reserved;
        store.make_room(&mut g, &self.id, delta, true)?;
        g.add(delta).map_err(|e| store.io(e))?;
        if let Some(f) = &self.file
            && let Err(e) = f.set_len(need)
        {
            let _ = g.sub(delta);
            return Err(store.io(e));
        }
        self.reserved = need;
        Ok(())
    }

    /// Copies what was written so far to a temporary in the spill folder and
    /// continues there, giving back the memory reservation.
    fn move_to_disk(&mut self, g: &mut Guard<'_>, dir: PathBuf) -> Result<()> {
        self.map = None;
        let dio = |e| StoreError::Io { dir: dir.clone(), source: e };
        std::fs::create_dir_all(&dir).map_err(dio)?;
        let (tmp, mut file) = new_temp(&dir, &self.id).map_err(dio)?;
        let copied = File::open(&self.tmp)
            .and_then(|src| io::copy(&mut src.take(self.written), &mut file))
            .and_then(|_| file.seek(SeekFrom::Start(self.written)));
        if let Err(e) = copied {
            let _ = std::fs::remove_file(&tmp);
            return Err(dio(e));
        }
        let _ = std::fs::remove_file(&self.tmp);
        g.sub(self.reserved).map_err(|e| self.store.io(e))?;
        self.reserved = 0;
        self.file = Some(file);
        self.tmp = tmp;
        self.on_disk = true;
        Ok(())
    }

    /// Seals the object (OBJ-1), checking its size when `expect` is given.
    /// When this node already has a sealed copy of the id (in memory or
    /// spilled), that copy is kept and this one dropped (OBJ-2).
    ///
    /// # Errors
    /// A size mismatch or a failed link; the temporary is removed either way.
    pub fn seal(mut self, expect: Option<u64>) -> Result<()> {
        if let Some(want) = expect
            && want != self.written
        {
            return Err(StoreError::SizeMismatch { id: self.id.clone(), got: self.written, want });
        }
        let store = self.store.clone();
        let mut g = store.lock()?;
        let r = self.seal_locked(&mut g);
        // Whatever happened, nothing of this writer is left behind.
        self.discard(&mut g);
        r
    }

    fn seal_locked(&mut self, g: &mut Guard<'_>) -> Result<()> {
        let map = self.map.take();
        let store = self.store.clone();
        if !self.on_disk && self.written < self.reserved {
            if let Some(f) = &self.file {
                f.set_len(self.written).map_err(|e| store.io(e))?;
            }
            g.sub(self.reserved - self.written).map_err(|e| store.io(e))?;
            self.reserved = self.written;
        }
        let spill = g.settings.spill.clone();
        let exists = store.path(&self.id).exists()
            || spill.as_ref().is_some_and(|s| s.join(&self.id).exists());
        if exists {
            return Ok(());
        }
        let (dir, target) = match (&spill, self.on_disk) {
            (Some(s), true) => (s.clone(), s.join(&self.id)),
            _ => (store.dir().to_path_buf(), store.path(&self.id)),
        };
        match link_new(&self.tmp, &target) {
            Ok(()) => {}
            Err(e) if e.kind() == io::ErrorKind::AlreadyExists => return Ok(()),
            Err(e) => return Err(StoreError::Io { dir, source: e }),
        }
        // The sealed copy now holds the bytes: the reservation is its size.
        self.reserved = 0;
        if let Some(map) = map {
            store.cache_map(&target, map);
        }
        store.write_meta(&self.id, self.copy, self.owner.as_deref()).map_err(|e| store.io(e))
    }

    /// Removes the temporary, gives back any reservation and releases the
    /// writer's lock. Idempotent.
    fn discard(&mut self, g: &mut Guard<'_>) {
        self.map = None;
        if self.file.is_none() {
            return;
        }
        let _ = std::fs::remove_file(&self.tmp);
        if self.reserved > 0 {
            let _ = g.sub(self.reserved);
            self.reserved = 0;
        }
        self.file = None;
    }
}

impl Drop for Writer {
    fn drop(&mut self) {
        // An unsealed writer leaves nothing behind (OBJ-1).
        if self.file.is_none() {
            return;
        }
        let store = self.store.clone();
        match store.lock() {
            Ok(mut g) => self.discard(&mut g),
            Err(_) => {
                let _ = std::fs::remove_file(&self.tmp);
                self.file = None;
            }
        }
    }
}

/// A temporary for object `id` made from the pool file that best fits
/// `reserve` bytes, counted as `reserve` bytes in the ledger, with its pages
/// mapped when it is at least as large; `None` when the pool is empty or the
/// file cannot be taken (the caller makes a new file). The caller holds the
/// ledger lock.
fn from_pool(
    store: &LocalStore,
    g: &mut Guard<'_>,
    id: &str,
    reserve: u64,
) -> Result<Option<(PathBuf, File, Option<MmapMut>)>> {
    let tmp = temp_path(store.dir(), id);
    let Ok(Some(had)) = store.take_pooled(reserve, &tmp) else { return Ok(None) };
    // Locked before anything rescans the folder, which would take an
    // unlocked temporary for a dead writer's.
    let file = match open_taken(&tmp) {
        Ok(f) => f,
        Err(_) => {
            let _ = std::fs::remove_file(&tmp);
            let _ = g.sub(had);
            return Ok(None);
        }
    };
    let undo = |g: &mut Guard<'_>, counted: u64| {
        let _ = std::fs::remove_file(&tmp);
        let _ = g.sub(counted);
    };
    // The file's `had` bytes are counted already (OBJ-9): count the change.
    if reserve > had {
        if let Err(e) = store.make_room(g, id, reserve - had, true) {
            undo(g, had);
            return Err(e);
        }
        if let Err(e) = g.add(reserve - had) {
            undo(g, had);
            return Err(store.io(e));
        }
    }
    if reserve != had {
        if let Err(e) = file.set_len(reserve) {
            undo(g, had.max(reserve));
            return Err(store.io(e));
        }
        if reserve < had {
            let _ = g.sub(had - reserve);
        }
    }
    // This process's mapping of the file when it kept one (OBJ-11), else a
    // new one. SAFETY: the temporary is this writer's alone (its exclusive
    // flock; nobody maps a temporary), so nothing else changes the mapped
    // bytes, and nothing truncates it while it is written (pressure.rs
    // `free_pages` takes only unlocked files). MAP_POPULATE maps every
    // existing page in one call.
    // A new mapping is made from a second, unlocked handle: a mapping holds
    // its file handle open, and the writer's handle carries its exclusive
    // flock, which must end with the writer.
    let key = file.metadata().map(|m| (m.dev(), m.ino())).ok();
    let map = key.and_then(|k| store.cached_map(k, reserve)).or_else(|| {
        let unlocked = std::fs::OpenOptions::new().read(true).write(true).open(&tmp).ok()?;
        (had >= reserve)
            .then(|| unsafe {
                MmapOptions::new().len(reserve as usize).populate().map_mut(&unlocked)
            })
            .and_then(|m| m.ok())
    });
    Ok(Some((tmp, file, map)))
}

/// Copies below this size run on the calling thread; larger ones are split across
/// threads (OBJ-12).
const PARALLEL_COPY_MIN: usize = 32 << 20;
/// Threads one large copy uses at most (OBJ-12).
const PARALLEL_COPY_THREADS: usize = 4;

/// `dst.copy_from_slice(src)`, split across up to [`PARALLEL_COPY_THREADS`] threads
/// (no more than the CPUs this process may use) when `src` is at least
/// [`PARALLEL_COPY_MIN`] bytes (OBJ-12): one thread does not saturate memory bandwidth,
/// so a large put copies faster in parallel (Ray's plasma client does the same for large
/// buffers, `parallel_memcopy` in its serialization). `dst` and `src` have the same length.
pub(crate) fn copy_parallel(dst: &mut [u8], src: &[u8]) {
    static THREADS: std::sync::OnceLock<usize> = std::sync::OnceLock::new();
    let threads = *THREADS.get_or_init(|| {
        std::thread::available_parallelism().map_or(1, |n| n.get()).min(PARALLEL_COPY_THREADS)
    });
    if src.len() < PARALLEL_COPY_MIN || threads < 2 {
        dst.copy_from_slice(src);
        return;
    }
    // Chunks of whole 4 KiB pages.
    let chunk = src.len().div_ceil(threads).next_multiple_of(4096);
    std::thread::scope(|s| {
        let mut pieces = dst.chunks_mut(chunk).zip(src.chunks(chunk));
        let first = pieces.next();
        for (d, from) in pieces {
            s.spawn(move || d.copy_from_slice(from));
        }
        if let Some((d, from)) = first {
            d.copy_from_slice(from);
        }
    });
}

#[cfg(test)]
mod tests {
    use super::*;

    /// OBJ-12: the split copy of a large write (32 MiB and up) copies every byte.
    #[test]
    fn a_parallel_copy_copies_every_byte_obj_12() {
        for len in [0, 1, 4095, PARALLEL_COPY_MIN - 1, PARALLEL_COPY_MIN, PARALLEL_COPY_MIN + 4097]
        {
            let src: Vec<u8> = (0..len).map(|i| (i % 251) as u8).collect();
            let mut dst = vec![0u8; len];
            copy_parallel(&mut dst, &src);
            assert!(dst == src, "copy of {len} bytes differs");
        }
    }
}
