//! tpuray's per-node object store (DESIGN.md §4): one file per sealed object
//! in a shared-memory folder (`/dev/shm/tpuray-<node>` by default), written
//! and read by every process of the node (agent, driver, workers) through
//! [`LocalStore`] directly, with no server in between. Readers map sealed
//! objects read-only without copying.
//!
//! # Capacity and memory pressure
//!
//! A store opened with [`LocalStore::open_with`] has a capacity in bytes
//! (`--object-store-memory`; [`default_capacity`] gives Ray's default) and
//! optionally a spill folder (`--spill-dir`). Both are written to the store's
//! ledger, so every process that later attaches with [`LocalStore::open`]
//! follows them. Memory is used lazily: tmpfs pages exist only once written.
//!
//! When a write needs room, the store first evicts *secondary* copies
//! (copies pulled from another node, [`CopyKind::Secondary`]), oldest first,
//! then spills *primary* copies to the spill folder, oldest first. Objects
//! mapped by a reader are never moved (OBJ-6). [`LocalStore::get`] restores
//! a spilled object into memory when it fits without spilling anything, and
//! otherwise maps the spill file directly. An object larger than the whole
//! store is written through to the spill folder, or refused with
//! [`StoreError::TooLarge`] when there is none. Nothing waits for room: when
//! what is left is pinned, the write fails at once with [`StoreError::Full`].
//!
//! # Files
//!
//! In the store folder: `<id>` (a sealed object), `.w.<pid>.<n>.<id>` (an
//! object being written, `flock`ed exclusively by its writer, its length the
//! bytes reserved), `.m.<id>` (a sidecar with the copy kind and the owner,
//! only when not primary or an owner is set), `.lock` (the ledger, see
//! `ledger.rs`), `.pool/<size>.<pid>.<n>` (recycled files, `pool.rs`),
//! `.agent` (the creator's pid, `flock`ed shared by every live
//! [`LocalStore::open_with`] of the folder, `sweep.rs`). In the spill
//! folder: `<id>` and `.w.*` temporaries.
//!
//! # Invariants
//!
//! - OBJ-1: an object is visible only once sealed. Writers fill a hidden
//!   temporary and seal it by a hard link to its final name, so a reader
//!   never sees a partial object. A writer that dies leaves only its
//!   temporary, which no lookup sees; its `flock` died with it, so the next
//!   scan removes the file and reclaims its reservation.
//! - OBJ-2: sealed objects are immutable; a second seal of the same id keeps
//!   the first copy, wherever it lives now (objects are content-addressed by
//!   id). Links never replace an existing name.
//! - OBJ-3: bytes in memory (sealed objects plus live writers' reservations)
//!   never exceed the capacity. Every reservation is made while holding the
//!   ledger's exclusive `flock`, after making room; writers reserve before
//!   they write.
//! - OBJ-4: under pressure secondary copies are evicted before primary
//!   copies are spilled. A spill copies to a temporary in the spill folder,
//!   renames it, then unlinks the memory copy, all under the ledger lock, so
//!   an object is always visible in memory or in the spill folder.
//! - OBJ-5: [`LocalStore::delete`] removes the memory copy, the spill file
//!   and the sidecar.
//! - OBJ-6: an [`ObjectView`] holds a shared `flock` on its file; eviction
//!   and spilling take a non-blocking exclusive one and skip what they cannot
//!   lock, so a mapped object is never moved out from under its reader. A
//!   reader that opened a file just before it was moved sees its link count
//!   at 0 and looks again under the ledger lock.
//! - OBJ-7: nothing waits for room: a reservation that cannot be met fails
//!   at once naming the requested size, the capacity and the pinned bytes.
//!
//! - OBJ-9 to OBJ-11: freed objects' files are recycled for later writes,
//!   with their pages, and a process keeps its mappings of a few of them
//!   (the arena of DESIGN.md §11; see `pool.rs`).
//! - OBJ-13: a store folder outlives its agent only until the next
//!   [`sweep_stale_stores`] (an agent starting, `tpuray stop`): a store made
//!   by [`LocalStore::open_with`] holds a shared `flock` on `.agent` while it
//!   lives, and a sweep removes the folder and its recorded spill folder
//!   only while it holds the exclusive one, so a live agent's store is never
//!   removed. Folders without `.agent` (older versions) are removed only
//!   when unchanged for [`LEGACY_MIN_AGE`] and open in no process.
//!
//! All functions block on the filesystem; none needs a runtime. Locks are
//! held only for bookkeeping and for copying an object being spilled or
//! restored, never while waiting on another process.
//!
//! [`LocalStore::usage`] reports capacity, bytes in memory, being written, spilled and
//! pinned, and the largest objects with their owners (for `tpuray memory`). OBJ-7's error
//! names the requested bytes, the capacity and the bytes pinned, being written and
//! unspillable. Deliberately absent: a store server (every process of the node works on
//! the folder directly).

mod ledger;
mod pool;
mod pressure;
mod sweep;
pub mod transfer;
mod writer;

use std::fs::File;
use std::io;
use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use memmap2::Mmap;

use ledger::{Guard, LEDGER, Ledger, Settings};
pub use sweep::{LEGACY_MIN_AGE, STORE_PREFIX, STORE_ROOT, sweep_stale_stores};
pub use writer::Writer;

/// Ray's default object store size: 30% of the memory available when the
/// node starts, capped at 200 GB (Ray's `ray_constants.py`
/// `DEFAULT_OBJECT_STORE_MEMORY_PROPORTION` and `..._MAX_BYTES`).
///
/// `available_bytes`: `MemAvailable` in bytes. Returns bytes.
pub fn default_capacity(available_bytes: u64) -> u64 {
    const PROPORTION: f64 = 0.3;
    const MAX_BYTES: u64 = 200_000_000_000;
    ((available_bytes as f64 * PROPORTION) as u64).min(MAX_BYTES)
}

/// `MemTotal` and `MemAvailable` from `/proc/meminfo`, in bytes (0 when unreadable).
pub fn memory_bytes() -> (u64, u64) {
    let Ok(s) = std::fs::read_to_string("/proc/meminfo") else {
        return (0, 0);
    };
    let field = |name: &str| {
        s.lines()
            .find(|l| l.starts_with(name))
            .and_then(|l| l.split_whitespace().nth(1))
            .and_then(|v| v.parse::<u64>().ok())
            .map(|kib| kib * 1024)
            .unwrap_or(0)
    };
    (field("MemTotal:"), field("MemAvailable:"))
}

/// How many objects [`LocalStore::usage`] lists in [`StoreUsage::largest`].
pub const USAGE_TOP: usize = 10;

/// Errors of the store, naming the object and the path at fault.
#[derive(Debug, thiserror::Error)]
pub enum StoreError {
    #[error("object store {dir}: {source}")]
    Io { dir: PathBuf, source: io::Error },
    #[error("invalid object id {0:?} (expected letters, digits, '-' or '_')")]
    BadId(String),
    #[error("object {id} is {got} bytes, expected {want}")]
    SizeMismatch { id: String, got: u64, want: u64 },
    /// The object alone is larger than the store and there is no spill
    /// folder to write it through to.
    #[error(
        "object {id} ({size} bytes) is larger than the whole object store ({capacity} bytes) \
         and no spill dir is set to write it through to"
    )]
    TooLarge { id: String, size: u64, capacity: u64 },
    /// Room for `requested` more bytes could not be made: what is left in
    /// memory is pinned by readers, being written, or primary copies with no
    /// spill folder to go to. All sizes in bytes.
    #[error(
        "object store full: {requested} bytes for object {id} do not fit in {capacity} bytes \
         ({pinned} pinned by readers, {writing} being written, {unspillable} in primary copies \
         that cannot be spilled without a spill dir)"
    )]
    Full { id: String, requested: u64, capacity: u64, pinned: u64, writing: u64, unspillable: u64 },
}

type Result<T> = std::result::Result<T, StoreError>;

/// How to open a store with [`LocalStore::open_with`].
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct StoreConfig {
    /// The store folder (a tmpfs path such as `/dev/shm/tpuray-<node>`).
    pub dir: PathBuf,
    /// Bytes the store may hold in memory; `None` for unlimited.
    pub capacity_bytes: Option<u64>,
    /// Where to spill: the store uses the subfolder named like the store
    /// folder (`<spill_dir>/tpuray-<node>`), so several stores may share
    /// one `--spill-dir`, and [`LocalStore::destroy`] removes only its own.
    /// `None`: primary copies are never spilled and objects larger than
    /// the store are refused.
    pub spill_dir: Option<PathBuf>,
}

/// Whether a sealed copy may be dropped under memory pressure.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum CopyKind {
    /// The copy created on this node (`put`, a task's return): spilled to
    /// disk under pressure, never dropped.
    #[default]
    Primary,
    /// A copy pulled from another node: evicted under pressure (the owner
    /// can pull it again).
    Secondary,
}

/// Options of [`LocalStore::create_with`].
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct CreateOptions {
    /// The final size in bytes when known: reserved at once (one lock instead
    /// of one per write), and an object larger than the store goes straight
    /// to the spill folder.
    pub size: Option<u64>,
    pub copy: CopyKind,
    /// Who owns the object (an address or a worker id), shown by
    /// [`LocalStore::usage`]; one line.
    pub owner: Option<String>,
}

/// Where a sealed object lives on this node.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Location {
    /// In the shared-memory folder.
    Memory,
    /// In the spill folder (spilled, or written through because it is larger
    /// than the store).
    Spilled,
}

/// One sealed object, as [`LocalStore::usage`] and [`LocalStore::info`] see it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ObjectInfo {
    pub id: String,
    /// Bytes.
    pub size: u64,
    pub location: Location,
    pub copy: CopyKind,
    pub owner: Option<String>,
    /// Mapped by a reader right now (cannot be spilled or evicted).
    pub pinned: bool,
}

/// A snapshot of the store (for `tpuray memory`). Sizes in bytes.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct StoreUsage {
    /// `None` when unlimited.
    pub capacity_bytes: Option<u64>,
    /// In memory: sealed objects plus `writing_bytes`. With `pooled_bytes`,
    /// at most the capacity.
    pub used_bytes: u64,
    /// Reserved by writers that are still writing (part of `used_bytes`).
    pub writing_bytes: u64,
    /// In the spill folder.
    pub spilled_bytes: u64,
    /// Of sealed objects mapped by a reader, in memory or spilled.
    pub pinned_bytes: u64,
    /// Sealed objects in memory.
    pub object_count: u64,
    /// Sealed objects in the spill folder.
    pub spilled_count: u64,
    /// The largest sealed objects, largest first: [`USAGE_TOP`] of them from
    /// [`LocalStore::usage`], as many as asked from [`LocalStore::usage_top`].
    pub largest: Vec<ObjectInfo>,
    /// Freed objects' memory kept for reuse by later writes (OBJ-9), given
    /// back first when room is needed; not part of `used_bytes`.
    pub pooled_bytes: u64,
}

/// One node's store folder. Cheap to clone (clones share the ledger file).
#[derive(Clone, Debug)]
pub struct LocalStore {
    inner: Arc<Inner>,
}

#[derive(Debug)]
struct Inner {
    dir: PathBuf,
    ledger: Ledger,
    /// This process's mappings of files it wrote (pool.rs, OBJ-11).
    maps: std::sync::Mutex<Vec<pool::CachedMap>>,
    /// For a store opened with [`LocalStore::open_with`]: `.agent`, with
    /// the creator's shared `flock` held while the store lives (OBJ-13).
    _creator: Option<File>,
}

/// A sealed object mapped read-only: derefs to its bytes without copying.
///
/// While it lives, the object is pinned: it is not spilled or evicted
/// (OBJ-6). A deleted object stays readable through views made before.
pub struct ObjectView {
    // Field order matters: unmap first, then release the pin.
    map: Option<Mmap>,
    _pin: Option<File>,
}

impl std::ops::Deref for ObjectView {
    type Target = [u8];
    fn deref(&self) -> &[u8] {
        self.map.as_deref().unwrap_or(&[])
    }
}

pub(crate) fn check_id(id: &str) -> Result<()> {
    if !id.is_empty() && id.chars().all(|c| c.is_ascii_alphanumeric() || c == '-' || c == '_') {
        Ok(())
    } else {
        Err(StoreError::BadId(id.to_string()))
    }
}

/// Opens `path` and maps it with a shared `flock` held (OBJ-6); `None` when
/// it does not exist or was moved (spilled, evicted, deleted, recycled)
/// between the open and the lock: once locked, `path` must still name the
/// inode opened (OBJ-10). Blocks only while a spiller copies the object.
fn open_view(path: &Path) -> io::Result<Option<ObjectView>> {
    match File::open(path) {
        Ok(f) => view_of(path, f),
        Err(e) if e.kind() == io::ErrorKind::NotFound => Ok(None),
        Err(e) => Err(e),
    }
}

/// The second half of [`open_view`]: `f` was opened from `path` some time
/// ago.
fn view_of(path: &Path, f: File) -> io::Result<Option<ObjectView>> {
    f.lock_shared()?;
    let md = f.metadata()?;
    if md.nlink() == 0 {
        return Ok(None);
    }
    match std::fs::metadata(path) {
        Ok(now) if (now.dev(), now.ino()) == (md.dev(), md.ino()) => {}
        Ok(_) => return Ok(None),
        Err(e) if e.kind() == io::ErrorKind::NotFound => return Ok(None),
        Err(e) => return Err(e),
    }
    if md.len() == 0 {
        return Ok(Some(ObjectView { map: None, _pin: None }));
    }
    // SAFETY: sealed objects are never written again (OBJ-2) and the shared
    // lock keeps spillers away, so the mapping cannot change under the reader.
    let map = unsafe { Mmap::map(&f) }?;
    Ok(Some(ObjectView { map: Some(map), _pin: Some(f) }))
}

fn not_found_ok(r: io::Result<()>) -> io::Result<()> {
    match r {
        Err(e) if e.kind() == io::ErrorKind::NotFound => Ok(()),
        r => r,
    }
}

impl LocalStore {
    /// Opens (creating) the store folder `dir` and attaches to its settings:
    /// the capacity and spill folder a [`LocalStore::open_with`] wrote there
    /// (the node agent's), or unlimited capacity and no spill folder when
    /// there are none yet.
    ///
    /// # Errors
    /// [`StoreError::Io`] when the folder or its ledger cannot be created.
    pub fn open(dir: impl Into<PathBuf>) -> Result<Self> {
        Self::attach(dir.into(), None)?.with_settings()
    }

    /// Gives a store whose ledger is new the default settings.
    fn with_settings(self) -> Result<Self> {
        let mut g = self.lock()?;
        if g.fresh {
            g.write_settings(Settings::default()).map_err(|e| self.io(e))?;
            self.rescan(&mut g)?;
        }
        drop(g);
        Ok(self)
    }

    /// Attaches to the store folder `dir` that a node agent made (with
    /// [`LocalStore::open_with`]), as drivers and workers of its node do. Unlike
    /// [`LocalStore::open`] it never creates the folder: when the agent is gone and its
    /// store was removed, attaching fails instead of leaving an orphan folder in
    /// `/dev/shm` that no sweep would know as an agent's (OBJ-13).
    ///
    /// # Errors
    /// [`StoreError::Io`] when the folder is missing (`NotFound`) or its ledger cannot
    /// be opened.
    pub fn join(dir: impl Into<PathBuf>) -> Result<Self> {
        let dir = dir.into();
        if !dir.is_dir() {
            return Err(StoreError::Io {
                source: io::Error::new(
                    io::ErrorKind::NotFound,
                    "no object store there: its node agent has exited",
                ),
                dir,
            });
        }
        Self::attach_existing(dir, None)?.with_settings()
    }

    /// Opens (creating) the store folder `config.dir` with a capacity and a
    /// spill folder, which every process attaching later with
    /// [`LocalStore::open`] follows. Leftovers of dead writers are reclaimed
    /// and the accounting is recomputed from the folder. Nothing is evicted
    /// when the folder already holds more than the new capacity; later writes
    /// make room.
    ///
    /// The returned store (and its clones) marks the folder as in use by a
    /// live creator until the last of them is dropped or the process ends,
    /// so [`sweep_stale_stores`] leaves it alone (OBJ-13).
    ///
    /// # Errors
    /// [`StoreError::Io`] when a folder, the ledger or `.agent` cannot be
    /// created.
    pub fn open_with(config: StoreConfig) -> Result<Self> {
        let creator = sweep::hold_creator(&config.dir)
            .map_err(|e| StoreError::Io { dir: config.dir.clone(), source: e })?;
        let store = Self::attach(config.dir, Some(creator))?;
        let spill = config.spill_dir.map(|s| {
            let name = store.dir().file_name().unwrap_or(std::ffi::OsStr::new("objects"));
            s.join(name)
        });
        if let Some(s) = &spill {
            std::fs::create_dir_all(s).map_err(|e| StoreError::Io { dir: s.clone(), source: e })?;
        }
        let mut g = store.lock()?;
        let settings = Settings { capacity: config.capacity_bytes.unwrap_or(u64::MAX), spill };
        g.write_settings(settings).map_err(|e| store.io(e))?;
        store.rescan(&mut g)?;
        drop(g);
        Ok(store)
    }

    fn attach(dir: PathBuf, creator: Option<File>) -> Result<Self> {
        std::fs::create_dir_all(&dir)
            .map_err(|e| StoreError::Io { dir: dir.clone(), source: e })?;
        Self::attach_existing(dir, creator)
    }

    /// [`LocalStore::attach`] without creating `dir` (the ledger cannot be opened in a
    /// folder removed meanwhile, so nothing is made again).
    fn attach_existing(dir: PathBuf, creator: Option<File>) -> Result<Self> {
        let ledger = Ledger::open(&dir.join(LEDGER))
            .map_err(|e| StoreError::Io { dir: dir.clone(), source: e })?;
        let inner = Inner { dir, ledger, maps: Default::default(), _creator: creator };
        Ok(Self { inner: Arc::new(inner) })
    }

    /// The default folder for a node: `/dev/shm/tpuray-<node>` when
    /// `/dev/shm` exists ([`STORE_ROOT`], [`STORE_PREFIX`]), else
    /// `<fallback>/objects`.
    pub fn default_dir(node_id: &str, fallback: &Path) -> PathBuf {
        let shm = Path::new(STORE_ROOT);
        if shm.is_dir() {
            shm.join(format!("{STORE_PREFIX}{node_id}"))
        } else {
            fallback.join("objects")
        }
    }

    pub fn dir(&self) -> &Path {
        &self.inner.dir
    }

    /// The folder this store spills to (`<spill_dir>/<store folder name>`),
    /// if any.
    ///
    /// # Errors
    /// [`StoreError::Io`] when the ledger cannot be read.
    pub fn spill_dir(&self) -> Result<Option<PathBuf>> {
        Ok(self.lock()?.settings.spill.clone())
    }

    /// The capacity in bytes, `None` when unlimited.
    ///
    /// # Errors
    /// [`StoreError::Io`] when the ledger cannot be read.
    pub fn capacity(&self) -> Result<Option<u64>> {
        let c = self.lock()?.settings.capacity;
        Ok((c != u64::MAX).then_some(c))
    }

    pub(crate) fn io(&self, e: io::Error) -> StoreError {
        StoreError::Io { dir: self.inner.dir.clone(), source: e }
    }

    pub(crate) fn lock(&self) -> Result<Guard<'_>> {
        self.inner.ledger.lock().map_err(|e| self.io(e))
    }

    pub(crate) fn path(&self, id: &str) -> PathBuf {
        self.inner.dir.join(id)
    }

    pub(crate) fn meta_path(&self, id: &str) -> PathBuf {
        self.inner.dir.join(format!(".m.{id}"))
    }

    /// Starts writing primary object `id` of unknown size: each write
    /// reserves what it adds.
    ///
    /// # Errors
    /// As [`LocalStore::create_with`].
    pub fn create(&self, id: &str) -> Result<Writer> {
        self.create_with(id, &CreateOptions::default())
    }

    /// Starts writing object `id`. With `opts.size`, the room is reserved now
    /// (making room as described in the crate docs), and an object larger
    /// than the store goes to the spill folder; without it, each
    /// [`Writer::write`] reserves what it adds and switches to the spill
    /// folder once the object outgrows the store.
    ///
    /// # Errors
    /// [`StoreError::BadId`]; [`StoreError::TooLarge`] when `opts.size`
    /// exceeds the capacity and there is no spill folder;
    /// [`StoreError::Full`] when room cannot be made; [`StoreError::Io`].
    pub fn create_with(&self, id: &str, opts: &CreateOptions) -> Result<Writer> {
        check_id(id)?;
        let mut g = self.lock()?;
        Writer::start(self.clone(), &mut g, id, opts)
    }

    /// Writes and seals `data` as primary object `id` in one step.
    ///
    /// # Errors
    /// As [`LocalStore::create_with`] and [`Writer::seal`].
    pub fn put(&self, id: &str, data: &[u8]) -> Result<()> {
        self.put_with(id, data, &CreateOptions::default())
    }

    /// Writes and seals `data` as object `id` (`opts.size` is set to its
    /// length).
    ///
    /// # Errors
    /// As [`LocalStore::create_with`] and [`Writer::seal`].
    pub fn put_with(&self, id: &str, data: &[u8], opts: &CreateOptions) -> Result<()> {
        let opts = CreateOptions { size: Some(data.len() as u64), ..opts.clone() };
        let mut w = self.create_with(id, &opts)?;
        w.write(data).map_err(|e| match e.downcast::<StoreError>() {
            Ok(s) => s,
            Err(e) => self.io(e),
        })?;
        w.seal(Some(data.len() as u64))
    }

    /// Maps sealed object `id`, or `None` when this node has no copy. A
    /// spilled object is restored into memory when it fits without spilling
    /// anything else (evicting secondary copies is allowed); otherwise its
    /// spill file is mapped directly. The view pins the object (OBJ-6).
    ///
    /// # Errors
    /// A bad id, or the file exists but cannot be mapped.
    pub fn get(&self, id: &str) -> Result<Option<ObjectView>> {
        check_id(id)?;
        if let Some(v) = open_view(&self.path(id)).map_err(|e| self.io(e))? {
            return Ok(Some(v));
        }
        // Absent, or moved while we looked: decide under the lock, where an
        // object is in exactly one place and nobody holds an exclusive
        // flock on it.
        let mut g = self.lock()?;
        if let Some(v) = open_view(&self.path(id)).map_err(|e| self.io(e))? {
            return Ok(Some(v));
        }
        let Some(spill) = g.settings.spill.clone() else { return Ok(None) };
        let sp = spill.join(id);
        let size = match std::fs::metadata(&sp) {
            Ok(m) => m.len(),
            Err(e) if e.kind() == io::ErrorKind::NotFound => return Ok(None),
            Err(e) => return Err(StoreError::Io { dir: spill, source: e }),
        };
        if self.restore(&mut g, id, &sp, size)?
            && let Some(v) = open_view(&self.path(id)).map_err(|e| self.io(e))?
        {
            return Ok(Some(v));
        }
        open_view(&sp).map_err(|e| StoreError::Io { dir: spill, source: e })
    }

    /// Size of sealed object `id` in bytes, in memory or spilled.
    pub fn size(&self, id: &str) -> Option<u64> {
        check_id(id).ok()?;
        if let Ok(m) = std::fs::metadata(self.path(id)) {
            return Some(m.len());
        }
        let spill = self.spill_dir().ok()??;
        std::fs::metadata(spill.join(id)).ok().map(|m| m.len())
    }

    /// Where sealed object `id` is, its size, kind, owner and whether it is
    /// pinned; `None` when this node has no copy.
    ///
    /// # Errors
    /// A bad id or an unreadable ledger.
    pub fn info(&self, id: &str) -> Result<Option<ObjectInfo>> {
        check_id(id)?;
        let g = self.lock()?;
        let spill = g.settings.spill.clone();
        let mut places = vec![(self.path(id), Location::Memory)];
        places.extend(spill.map(|s| (s.join(id), Location::Spilled)));
        for (path, location) in places {
            if let Ok(m) = std::fs::metadata(&path) {
                let (copy, owner) = self.read_meta(id);
                let pinned = pressure::is_pinned(&path);
                return Ok(Some(ObjectInfo {
                    id: id.into(),
                    size: m.len(),
                    location,
                    copy,
                    owner,
                    pinned,
                }));
            }
        }
        Ok(None)
    }

    /// Marks the sealed copy of `id` primary or secondary (a secondary copy
    /// becomes primary when its owner makes it the one to keep). Returns
    /// whether this node has a copy.
    ///
    /// # Errors
    /// A bad id, or the sidecar cannot be written.
    pub fn set_copy_kind(&self, id: &str, copy: CopyKind) -> Result<bool> {
        check_id(id)?;
        let g = self.lock()?;
        let present = self.path(id).exists()
            || g.settings.spill.as_ref().is_some_and(|s| s.join(id).exists());
        if present {
            let (_, owner) = self.read_meta(id);
            self.write_meta(id, copy, owner.as_deref()).map_err(|e| self.io(e))?;
        }
        Ok(present)
    }

    /// Deletes this node's copy of `id`: from memory, from the spill folder
    /// and its sidecar (OBJ-5). Readers holding a mapping keep it; when there
    /// are none, the memory copy's file is recycled (OBJ-9).
    pub fn delete(&self, id: &str) {
        if check_id(id).is_err() {
            return;
        }
        let g = self.lock();
        let path = self.path(id);
        match g {
            Ok(mut g) => {
                if let Ok(f) = File::open(&path) {
                    let size = f.metadata().map(|m| m.len()).unwrap_or(0);
                    // OBJ-10: recycle only what no reader maps.
                    let unread = f.try_lock().is_ok();
                    let recycled = unread && self.recycle(&g, &path, size).unwrap_or(false);
                    if unread && !recycled {
                        pressure::free_pages(&path);
                    }
                    drop(f);
                    if !recycled && std::fs::remove_file(&path).is_ok() {
                        let _ = g.sub(size);
                    }
                }
                if let Some(s) = &g.settings.spill {
                    let _ = std::fs::remove_file(s.join(id));
                }
                let _ = std::fs::remove_file(self.meta_path(id));
            }
            Err(_) => {
                let _ = std::fs::remove_file(&path);
                let _ = std::fs::remove_file(self.meta_path(id));
            }
        }
    }

    /// Removes the whole folder and this store's spill folder (node
    /// shutdown).
    pub fn destroy(&self) {
        if let Ok(g) = self.lock()
            && let Some(s) = &g.settings.spill
        {
            let _ = std::fs::remove_dir_all(s);
        }
        let _ = std::fs::remove_dir_all(self.dir());
    }

    /// A snapshot of capacity, usage and the [`USAGE_TOP`] largest objects.
    /// Scans both folders under the ledger lock, reclaiming dead writers'
    /// leftovers and correcting the ledger's counter on the way; costs a few
    /// system calls per object.
    ///
    /// # Errors
    /// [`StoreError::Io`] when a folder cannot be read.
    pub fn usage(&self) -> Result<StoreUsage> {
        self.usage_top(USAGE_TOP)
    }

    /// As [`LocalStore::usage`], listing the `top` largest objects in
    /// [`StoreUsage::largest`] (`usize::MAX`: every object, for `tpuray list
    /// objects`). Reading owners costs one small file read per listed object.
    ///
    /// # Errors
    /// [`StoreError::Io`] when a folder cannot be read.
    pub fn usage_top(&self, top: usize) -> Result<StoreUsage> {
        let mut g = self.lock()?;
        let scan = self.rescan(&mut g)?;
        let capacity = g.settings.capacity;
        let spill = g.settings.spill.clone();
        let mut u = StoreUsage {
            capacity_bytes: (capacity != u64::MAX).then_some(capacity),
            used_bytes: g.used().saturating_sub(scan.pooled),
            writing_bytes: scan.writing,
            pooled_bytes: scan.pooled,
            ..StoreUsage::default()
        };
        let mut all = Vec::with_capacity(scan.memory.len() + scan.spilled.len());
        for (e, location) in scan
            .memory
            .iter()
            .map(|e| (e, Location::Memory))
            .chain(scan.spilled.iter().map(|e| (e, Location::Spilled)))
        {
            let path = match (location, &spill) {
                (Location::Spilled, Some(s)) => s.join(&e.id),
                _ => self.path(&e.id),
            };
            let pinned = pressure::is_pinned(&path);
            if pinned {
                u.pinned_bytes += e.size;
            }
            match location {
                Location::Memory => u.object_count += 1,
                Location::Spilled => {
                    u.spilled_count += 1;
                    u.spilled_bytes += e.size;
                }
            }
            all.push(ObjectInfo {
                id: e.id.clone(),
                size: e.size,
                location,
                copy: CopyKind::Primary,
                owner: None,
                pinned,
            });
        }
        all.sort_by(|a, b| b.size.cmp(&a.size).then_with(|| a.id.cmp(&b.id)));
        all.truncate(top);
        for o in &mut all {
            (o.copy, o.owner) = self.read_meta(&o.id);
        }
        u.largest = all;
        Ok(u)
    }

    /// The copy kind and owner from `.m.<id>` (primary, no owner when absent
    /// or unreadable).
    pub(crate) fn read_meta(&self, id: &str) -> (CopyKind, Option<String>) {
        let Ok(text) = std::fs::read_to_string(self.meta_path(id)) else {
            return (CopyKind::Primary, None);
        };
        let mut lines = text.lines();
        let copy = match lines.next() {
            Some("secondary") => CopyKind::Secondary,
            _ => CopyKind::Primary,
        };
        let owner = lines.next().filter(|o| !o.is_empty()).map(str::to_string);
        (copy, owner)
    }

    /// Writes `.m.<id>`, or removes it when it would say "primary, no owner".
    /// Callers hold the ledger lock, so readers never see half a sidecar.
    pub(crate) fn write_meta(
        &self,
        id: &str,
        copy: CopyKind,
        owner: Option<&str>,
    ) -> io::Result<()> {
        let path = self.meta_path(id);
        if copy == CopyKind::Primary && owner.is_none() {
            return not_found_ok(std::fs::remove_file(path));
        }
        let kind = match copy {
            CopyKind::Primary => "primary",
            CopyKind::Secondary => "secondary",
        };
        let owner = owner.unwrap_or("").replace(['\n', '\r'], " ");
        std::fs::write(path, format!("{kind}\n{owner}\n"))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn handles_cross_threads_and_await_points() {
        fn send_sync<T: Send + Sync>() {}
        fn send<T: Send>() {}
        send_sync::<LocalStore>();
        send_sync::<ObjectView>();
        send::<Writer>();
    }

    #[test]
    fn default_capacity_is_thirty_percent_capped_at_200_gb() {
        assert_eq!(default_capacity(1000), 300);
        assert_eq!(default_capacity(10_000_000_000_000), 200_000_000_000);
    }

    #[test]
    fn joining_a_removed_store_fails_and_makes_no_folder_obj_13() {
        let d = tempfile::tempdir().unwrap();
        let dir = d.path().join("tpuray-gone");
        let made = LocalStore::open_with(StoreConfig {
            dir: dir.clone(),
            capacity_bytes: Some(1 << 20),
            spill_dir: None,
        })
        .unwrap();
        assert_eq!(LocalStore::join(&dir).unwrap().dir(), dir.as_path());
        drop(made);
        std::fs::remove_dir_all(&dir).unwrap();
        let e = LocalStore::join(&dir).map(|_| ()).unwrap_err().to_string();
        assert!(e.contains("node agent has exited"), "{e}");
        assert!(!dir.exists(), "join made the folder again");
    }

    #[test]
    fn object_is_invisible_until_sealed_obj_1() {
        let d = tempfile::tempdir().unwrap();
        let s = LocalStore::open(d.path()).unwrap();
        let mut w = s.create("a1").unwrap();
        w.write(b"hello").unwrap();
        assert!(s.get("a1").unwrap().is_none());
        assert_eq!(s.size("a1"), None);
        w.seal(Some(5)).unwrap();
        assert_eq!(&*s.get("a1").unwrap().unwrap(), b"hello");
        assert_eq!(s.size("a1"), Some(5));
    }

    fn visible_files(dir: &Path) -> Vec<String> {
        let mut v: Vec<String> = std::fs::read_dir(dir)
            .unwrap()
            .map(|e| e.unwrap().file_name().into_string().unwrap())
            .filter(|n| n != LEDGER && n != sweep::CREATOR)
            .collect();
        v.sort();
        v
    }

    #[test]
    fn abandoned_writer_leaves_nothing_obj_1() {
        let d = tempfile::tempdir().unwrap();
        let s = LocalStore::open_with(StoreConfig {
            dir: d.path().into(),
            capacity_bytes: Some(1000),
            spill_dir: None,
        })
        .unwrap();
        let mut w = s.create("b").unwrap();
        w.write(b"partial").unwrap();
        assert_eq!(s.usage().unwrap().writing_bytes, 7);
        drop(w);
        assert!(s.get("b").unwrap().is_none());
        assert!(visible_files(d.path()).is_empty());
        assert_eq!(s.usage().unwrap().used_bytes, 0);
    }

    #[test]
    fn short_write_is_refused_at_seal() {
        let d = tempfile::tempdir().unwrap();
        let s = LocalStore::open(d.path()).unwrap();
        let mut w = s.create("c").unwrap();
        w.write(b"abc").unwrap();
        assert!(matches!(w.seal(Some(10)), Err(StoreError::SizeMismatch { .. })));
        assert!(s.get("c").unwrap().is_none());
        assert!(visible_files(d.path()).is_empty());
    }

    /// OBJ-2: a second seal of the same id keeps the first sealed copy.
    #[test]
    fn second_seal_keeps_the_first_copy_obj_2() {
        let d = tempfile::tempdir().unwrap();
        let s = LocalStore::open(d.path()).unwrap();
        let mut w1 = s.create("x").unwrap();
        let mut w2 = s.create("x").unwrap();
        w1.write(b"first").unwrap();
        w2.write(b"other").unwrap();
        w1.seal(None).unwrap();
        let v = s.get("x").unwrap().unwrap();
        w2.seal(None).unwrap();
        assert_eq!(&*v, b"first");
        assert_eq!(&*s.get("x").unwrap().unwrap(), b"first");
        assert_eq!(visible_files(d.path()), vec!["x".to_string()]);
    }

    #[test]
    fn a_reader_that_opened_a_recycled_file_sees_nothing_obj_10() {
        let d = tempfile::tempdir().unwrap();
        let s = LocalStore::open(d.path().join("s")).unwrap();
        let (a, b) = (vec![1u8; 2 << 20], vec![2u8; 2 << 20]);
        s.put("a", &a).unwrap();
        // A reader opens "a" and is descheduled before it locks ...
        let f = File::open(s.path("a")).unwrap();
        // ... while "a" is freed and its file reused for "b".
        s.delete("a");
        s.put("b", &b).unwrap();
        assert_eq!(f.metadata().unwrap().ino(), std::fs::metadata(s.path("b")).unwrap().ino());
        assert!(view_of(&s.path("a"), f).unwrap().is_none(), "the reader mapped b as a");
    }

    /// OBJ-9: a freed object's file goes to the pool, counted once in the ledger.
    #[test]
    fn a_recycled_file_is_counted_once_obj_9() {
        let d = tempfile::tempdir().unwrap();
        let s = LocalStore::open(d.path().join("s")).unwrap();
        let mib = 1 << 20;
        let used = || s.lock().unwrap().used();
        s.put("a", &vec![1u8; 2 * mib]).unwrap();
        s.delete("a");
        assert_eq!(used(), 2 * mib as u64, "the pool's bytes are counted");
        for (id, len) in [("b", 2 * mib), ("c", 3 * mib), ("d", 2 * mib)] {
            s.put(id, &vec![2u8; len]).unwrap();
            assert_eq!(used(), len as u64, "{id}: the ledger counts the object once");
            s.delete(id);
        }
    }

    #[test]
    fn empty_object_round_trips() {
        let d = tempfile::tempdir().unwrap();
        let s = LocalStore::open(d.path()).unwrap();
        s.put("e", b"").unwrap();
        assert_eq!(s.get("e").unwrap().unwrap().len(), 0);
    }

    #[test]
    fn path_traversal_ids_are_rejected() {
        let d = tempfile::tempdir().unwrap();
        let s = LocalStore::open(d.path()).unwrap();
        assert!(matches!(s.put("../x", b""), Err(StoreError::BadId(_))));
        assert!(matches!(s.put(".lock", b""), Err(StoreError::BadId(_))));
    }

    #[test]
    fn open_attaches_to_the_settings_of_open_with() {
        let d = tempfile::tempdir().unwrap();
        let sp = tempfile::tempdir().unwrap();
        let dir = d.path().join("tpuray-n1");
        let a = LocalStore::open_with(StoreConfig {
            dir: dir.clone(),
            capacity_bytes: Some(4096),
            spill_dir: Some(sp.path().into()),
        })
        .unwrap();
        let b = LocalStore::open(&dir).unwrap();
        assert_eq!(b.capacity().unwrap(), Some(4096));
        assert_eq!(b.spill_dir().unwrap(), Some(sp.path().join("tpuray-n1")));
        assert_eq!(a.spill_dir().unwrap(), b.spill_dir().unwrap());
        let fresh = LocalStore::open(d.path().join("other")).unwrap();
        assert_eq!(fresh.capacity().unwrap(), None);
        assert_eq!(fresh.spill_dir().unwrap(), None);
    }

    #[test]
    fn usage_top_lists_every_object_when_asked() {
        let d = tempfile::tempdir().unwrap();
        let s = LocalStore::open(d.path()).unwrap();
        for i in 0..(USAGE_TOP + 3) {
            let opts = CreateOptions { owner: Some("me".into()), ..Default::default() };
            s.put_with(&format!("o{i}"), &vec![1u8; i + 1], &opts).unwrap();
        }
        assert_eq!(s.usage().unwrap().largest.len(), USAGE_TOP);
        let all = s.usage_top(usize::MAX).unwrap();
        assert_eq!(all.largest.len(), USAGE_TOP + 3);
        assert_eq!(all.object_count, (USAGE_TOP + 3) as u64);
        assert_eq!(all.largest[0].size, (USAGE_TOP + 3) as u64);
        assert!(all.largest.iter().all(|o| o.owner.as_deref() == Some("me")));
    }

    #[test]
    fn owner_and_copy_kind_are_recorded() {
        let d = tempfile::tempdir().unwrap();
        let s = LocalStore::open(d.path()).unwrap();
        let opts = CreateOptions {
            copy: CopyKind::Secondary,
            owner: Some("10.0.0.1:7000".into()),
            ..Default::default()
        };
        s.put_with("o", b"abc", &opts).unwrap();
        let i = s.info("o").unwrap().unwrap();
        assert_eq!(i.copy, CopyKind::Secondary);
        assert_eq!(i.owner.as_deref(), Some("10.0.0.1:7000"));
        assert_eq!(i.location, Location::Memory);
        assert!(!i.pinned);
        let v = s.get("o").unwrap().unwrap();
        assert!(s.info("o").unwrap().unwrap().pinned);
        drop(v);
        assert!(s.set_copy_kind("o", CopyKind::Primary).unwrap());
        assert_eq!(s.info("o").unwrap().unwrap().copy, CopyKind::Primary);
        assert_eq!(s.info("o").unwrap().unwrap().owner.as_deref(), Some("10.0.0.1:7000"));
        s.delete("o");
        assert!(s.info("o").unwrap().is_none());
        assert!(visible_files(d.path()).is_empty());
    }
}
