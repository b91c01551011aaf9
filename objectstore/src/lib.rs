//! tpuray's per-node object store (DESIGN.md §4), first version: one file
//! per sealed object in a shared-memory folder (`/dev/shm/...` by default),
//! mapped read-only by readers on the same node.
//!
//! Invariants:
//! - OBJ-1: an object is visible only once sealed. Writers fill a hidden
//!   temporary file and seal it by an atomic rename, so a reader never sees a
//!   partial object, and a writer that dies mid-write leaves nothing visible.
//! - OBJ-2: sealed objects are immutable; a second seal of the same id keeps
//!   the first copy (objects are content-addressed by id).
//!
//! The object-store issue replaces the file-per-object layout with a
//! recycled, pre-faulted arena, adds spilling and capacity enforcement.
//! All functions block on the filesystem.

use std::fs::File;
use std::io::Write;
use std::path::{Path, PathBuf};

use memmap2::Mmap;

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

/// Errors of the store, naming the object and the path at fault.
#[derive(Debug, thiserror::Error)]
pub enum StoreError {
    #[error("object store {dir}: {source}")]
    Io { dir: PathBuf, source: std::io::Error },
    #[error("invalid object id {0:?} (expected letters, digits, '-' or '_')")]
    BadId(String),
    #[error("object {id} is {got} bytes, expected {want}")]
    SizeMismatch { id: String, got: u64, want: u64 },
}

/// One node's store folder.
#[derive(Clone, Debug)]
pub struct LocalStore {
    dir: PathBuf,
}

/// A sealed object mapped read-only: derefs to its bytes without copying.
pub struct ObjectView {
    map: Option<Mmap>,
}

impl std::ops::Deref for ObjectView {
    type Target = [u8];
    fn deref(&self) -> &[u8] {
        self.map.as_deref().unwrap_or(&[])
    }
}

/// An object being written; visible to readers only after [`Writer::seal`].
pub struct Writer {
    tmp: PathBuf,
    path: PathBuf,
    file: File,
    written: u64,
    id: String,
}

fn check_id(id: &str) -> Result<(), StoreError> {
    if !id.is_empty() && id.chars().all(|c| c.is_ascii_alphanumeric() || c == '-' || c == '_') {
        Ok(())
    } else {
        Err(StoreError::BadId(id.to_string()))
    }
}

impl LocalStore {
    /// Opens (creating) the store folder `dir`.
    ///
    /// # Errors
    /// [`StoreError::Io`] when the folder cannot be created.
    pub fn open(dir: impl Into<PathBuf>) -> Result<Self, StoreError> {
        let dir = dir.into();
        std::fs::create_dir_all(&dir)
            .map_err(|e| StoreError::Io { dir: dir.clone(), source: e })?;
        Ok(Self { dir })
    }

    /// The default folder for a node: `/dev/shm/tpuray-<node>` when
    /// `/dev/shm` exists, else `<fallback>/objects`.
    pub fn default_dir(node_id: &str, fallback: &Path) -> PathBuf {
        let shm = Path::new("/dev/shm");
        if shm.is_dir() { shm.join(format!("tpuray-{node_id}")) } else { fallback.join("objects") }
    }

    pub fn dir(&self) -> &Path {
        &self.dir
    }

    fn io(&self, e: std::io::Error) -> StoreError {
        StoreError::Io { dir: self.dir.clone(), source: e }
    }

    fn path(&self, id: &str) -> PathBuf {
        self.dir.join(id)
    }

    /// Starts writing object `id`.
    ///
    /// # Errors
    /// A bad id, or the temporary file cannot be created.
    pub fn create(&self, id: &str) -> Result<Writer, StoreError> {
        check_id(id)?;
        let tmp = self.dir.join(format!(
            ".{id}.{}.{}",
            std::process::id(),
            std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .map(|d| d.subsec_nanos())
                .unwrap_or(0)
        ));
        let file = File::create(&tmp).map_err(|e| self.io(e))?;
        Ok(Writer { tmp, path: self.path(id), file, written: 0, id: id.to_string() })
    }

    /// Writes and seals `data` as object `id` in one step.
    ///
    /// # Errors
    /// As [`LocalStore::create`] and [`Writer::seal`].
    pub fn put(&self, id: &str, data: &[u8]) -> Result<(), StoreError> {
        let mut w = self.create(id)?;
        w.write(data).map_err(|e| self.io(e))?;
        w.seal(None)
    }

    /// Maps sealed object `id`, or `None` when this node has no copy.
    ///
    /// # Errors
    /// A bad id, or the file exists but cannot be mapped.
    pub fn get(&self, id: &str) -> Result<Option<ObjectView>, StoreError> {
        check_id(id)?;
        let f = match File::open(self.path(id)) {
            Ok(f) => f,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(None),
            Err(e) => return Err(self.io(e)),
        };
        let len = f.metadata().map_err(|e| self.io(e))?.len();
        if len == 0 {
            return Ok(Some(ObjectView { map: None }));
        }
        // SAFETY: sealed objects are never written again (OBJ-2), so the
        // mapping cannot change under the reader.
        let map = unsafe { Mmap::map(&f) }.map_err(|e| self.io(e))?;
        Ok(Some(ObjectView { map: Some(map) }))
    }

    /// Size of sealed object `id` in bytes, if present.
    pub fn size(&self, id: &str) -> Option<u64> {
        check_id(id).ok()?;
        std::fs::metadata(self.path(id)).ok().map(|m| m.len())
    }

    /// Deletes this node's copy of `id` (readers holding a mapping keep it).
    pub fn delete(&self, id: &str) {
        if check_id(id).is_ok() {
            let _ = std::fs::remove_file(self.path(id));
        }
    }

    /// Removes the whole folder (node shutdown).
    pub fn destroy(&self) {
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

impl Writer {
    /// Appends bytes.
    ///
    /// # Errors
    /// The write failed (disk or shared memory full).
    pub fn write(&mut self, data: &[u8]) -> std::io::Result<()> {
        self.file.write_all(data)?;
        self.written += data.len() as u64;
        Ok(())
    }

    /// Bytes written so far.
    pub fn written(&self) -> u64 {
        self.written
    }

    /// Seals the object (OBJ-1), checking its size when `expect` is given.
    ///
    /// # Errors
    /// A size mismatch (the temporary file is removed) or a failed rename.
    pub fn seal(self, expect: Option<u64>) -> Result<(), StoreError> {
        let dir = self.path.parent().map(Path::to_path_buf).unwrap_or_default();
        if let Some(want) = expect
            && want != self.written
        {
            let _ = std::fs::remove_file(&self.tmp);
            return Err(StoreError::SizeMismatch { id: self.id.clone(), got: self.written, want });
        }
        if self.path.exists() {
            // OBJ-2: keep the first sealed copy.
            let _ = std::fs::remove_file(&self.tmp);
            return Ok(());
        }
        std::fs::rename(&self.tmp, &self.path).map_err(|e| StoreError::Io { dir, source: e })
    }
}

impl Drop for Writer {
    fn drop(&mut self) {
        // An unsealed writer leaves nothing behind (OBJ-1); after a seal the
        // temporary name no longer exists and this is a no-op.
        let _ = std::fs::remove_file(&self.tmp);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn default_capacity_is_thirty_percent_capped_at_200_gb() {
        assert_eq!(default_capacity(1000), 300);
        assert_eq!(default_capacity(10_000_000_000_000), 200_000_000_000);
    }

    #[test]
    fn object_is_invisible_until_sealed_obj_1() {
        let d = tempfile::tempdir().unwrap();
        let s = LocalStore::open(d.path()).unwrap();
        let mut w = s.create("a1").unwrap();
        w.write(b"hello").unwrap();
        assert!(s.get("a1").unwrap().is_none());
        w.seal(Some(5)).unwrap();
        assert_eq!(&*s.get("a1").unwrap().unwrap(), b"hello");
    }

    #[test]
    fn abandoned_writer_leaves_nothing_obj_1() {
        let d = tempfile::tempdir().unwrap();
        let s = LocalStore::open(d.path()).unwrap();
        let mut w = s.create("b").unwrap();
        w.write(b"partial").unwrap();
        drop(w);
        assert!(s.get("b").unwrap().is_none());
        assert_eq!(std::fs::read_dir(d.path()).unwrap().count(), 0);
    }

    #[test]
    fn short_write_is_refused_at_seal() {
        let d = tempfile::tempdir().unwrap();
        let s = LocalStore::open(d.path()).unwrap();
        let mut w = s.create("c").unwrap();
        w.write(b"abc").unwrap();
        assert!(matches!(w.seal(Some(10)), Err(StoreError::SizeMismatch { .. })));
        assert!(s.get("c").unwrap().is_none());
    }

    #[test]
    fn path_traversal_ids_are_rejected() {
        let d = tempfile::tempdir().unwrap();
        let s = LocalStore::open(d.path()).unwrap();
        assert!(matches!(s.put("../x", b""), Err(StoreError::BadId(_))));
    }
}
