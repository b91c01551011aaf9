//! The store's ledger file `.lock`: an exclusive `flock` on it serializes
//! every change to the store's memory accounting across all processes of a
//! node (OBJ-3), and its header holds the capacity, the spill folder and the
//! bytes counted in memory.
//!
//! Header layout (little-endian): magic `TPRYOBJ1` (8 bytes), capacity in
//! bytes (u64, `u64::MAX` for unlimited), bytes counted in memory (u64),
//! length of the spill folder path (u32), the path's bytes.
//!
//! The counter is a cache of what a scan of the folder finds (sealed objects
//! plus the reservations of live writers). Every update is ordered so that a
//! process dying between a file operation and the counter update leaves the
//! counter too high, never too low; a store that looks full is rescanned
//! before anything is spilled, which heals the counter.

use std::ffi::OsStr;
use std::fs::{File, OpenOptions};
use std::io;
use std::os::unix::ffi::OsStrExt;
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};
use std::sync::{Mutex, MutexGuard};

/// The ledger's file name inside the store folder.
pub(crate) const LEDGER: &str = ".lock";
const MAGIC: &[u8; 8] = b"TPRYOBJ1";
const USED_AT: u64 = 16;
const FIXED: usize = 28;
const MAX_PATH: usize = 4096;

/// What the ledger says about the store.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct Settings {
    /// Bytes; `u64::MAX` means unlimited.
    pub capacity: u64,
    /// The folder spilled and written-through objects live in.
    pub spill: Option<PathBuf>,
}

impl Default for Settings {
    fn default() -> Self {
        Self { capacity: u64::MAX, spill: None }
    }
}

/// The open ledger file of one [`crate::LocalStore`] (shared by its clones).
///
/// Threads of one process take the mutex, processes the `flock`.
#[derive(Debug)]
pub(crate) struct Ledger {
    file: Mutex<File>,
}

/// The held lock, with the header as read when it was taken.
pub(crate) struct Guard<'a> {
    file: MutexGuard<'a, File>,
    pub settings: Settings,
    used: u64,
    /// The file held no valid header: the caller must initialize it.
    pub fresh: bool,
}

impl Ledger {
    /// Opens (creating) the ledger at `path`.
    pub fn open(path: &Path) -> io::Result<Self> {
        let file =
            OpenOptions::new().read(true).write(true).create(true).truncate(false).open(path)?;
        Ok(Self { file: Mutex::new(file) })
    }

    /// Takes the store-wide lock, blocking until no other thread or process
    /// holds it. Holders never wait on anything else, so the wait is bounded.
    pub fn lock(&self) -> io::Result<Guard<'_>> {
        let file = self.file.lock().unwrap_or_else(|p| p.into_inner());
        file.lock()?;
        let mut buf = vec![0u8; FIXED + MAX_PATH];
        let mut n = 0;
        while n < buf.len() {
            match file.read_at(&mut buf[n..], n as u64) {
                Ok(0) => break,
                Ok(k) => n += k,
                Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                Err(e) => {
                    let _ = file.unlock();
                    return Err(e);
                }
            }
        }
        let parsed = parse(&buf[..n]);
        let fresh = parsed.is_none();
        let (settings, used) = parsed.unwrap_or_default();
        Ok(Guard { file, settings, used, fresh })
    }
}

/// The settings in the header of the ledger at `path`, read without taking
/// its lock (for [`crate::sweep_stale_stores`], on a store nobody runs);
/// `None` when the file is absent, unreadable or holds no valid header.
pub(crate) fn read_settings(path: &Path) -> Option<Settings> {
    use std::io::Read;
    let mut buf = Vec::with_capacity(FIXED + MAX_PATH);
    File::open(path).ok()?.take((FIXED + MAX_PATH) as u64).read_to_end(&mut buf).ok()?;
    parse(&buf).map(|(settings, _)| settings)
}

fn parse(b: &[u8]) -> Option<(Settings, u64)> {
    if b.len() < FIXED || &b[..8] != MAGIC {
        return None;
    }
    let u = |at: usize| u64::from_le_bytes(b[at..at + 8].try_into().unwrap());
    let len = u32::from_le_bytes(b[24..28].try_into().unwrap()) as usize;
    if len > MAX_PATH || b.len() < FIXED + len {
        return None;
    }
    let spill = (len > 0).then(|| PathBuf::from(OsStr::from_bytes(&b[FIXED..FIXED + len])));
    Some((Settings { capacity: u(8), spill }, u(16)))
}

impl Guard<'_> {
    /// Bytes counted in memory: sealed objects and live writers' reservations.
    pub fn used(&self) -> u64 {
        self.used
    }

    /// Whether `n` more bytes fit under the capacity.
    pub fn fits(&self, n: u64) -> bool {
        self.used.checked_add(n).is_some_and(|t| t <= self.settings.capacity)
    }

    /// Counts `n` more bytes in memory.
    pub fn add(&mut self, n: u64) -> io::Result<()> {
        self.set_used(self.used.saturating_add(n))
    }

    /// Counts `n` fewer bytes in memory.
    pub fn sub(&mut self, n: u64) -> io::Result<()> {
        self.set_used(self.used.saturating_sub(n))
    }

    /// Sets the counter (after a scan).
    pub fn set_used(&mut self, n: u64) -> io::Result<()> {
        self.used = n;
        self.file.write_all_at(&n.to_le_bytes(), USED_AT)
    }

    /// Writes the whole header: `settings` and the current counter.
    ///
    /// # Errors
    /// The spill path is longer than 4096 bytes, or the write failed.
    pub fn write_settings(&mut self, settings: Settings) -> io::Result<()> {
        let path = settings.spill.as_deref().map(|p| p.as_os_str().as_bytes()).unwrap_or(&[]);
        if path.len() > MAX_PATH {
            return Err(io::Error::new(io::ErrorKind::InvalidInput, "spill dir path too long"));
        }
        let mut b = Vec::with_capacity(FIXED + path.len());
        b.extend_from_slice(MAGIC);
        b.extend_from_slice(&settings.capacity.to_le_bytes());
        b.extend_from_slice(&self.used.to_le_bytes());
        b.extend_from_slice(&(path.len() as u32).to_le_bytes());
        b.extend_from_slice(path);
        self.file.write_all_at(&b, 0)?;
        self.file.set_len(b.len() as u64)?;
        self.settings = settings;
        self.fresh = false;
        Ok(())
    }
}

impl Drop for Guard<'_> {
    fn drop(&mut self) {
        let _ = self.file.unlock();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn header_round_trips_and_a_fresh_file_is_detected() {
        let d = tempfile::tempdir().unwrap();
        let l = Ledger::open(&d.path().join(LEDGER)).unwrap();
        {
            let mut g = l.lock().unwrap();
            assert!(g.fresh);
            g.set_used(5).unwrap();
            g.write_settings(Settings { capacity: 100, spill: Some("/x/y".into()) }).unwrap();
            g.add(7).unwrap();
        }
        let g = l.lock().unwrap();
        assert!(!g.fresh);
        assert_eq!(g.used(), 12);
        assert_eq!(g.settings, Settings { capacity: 100, spill: Some("/x/y".into()) });
        assert!(g.fits(88));
        assert!(!g.fits(89));
    }
}
