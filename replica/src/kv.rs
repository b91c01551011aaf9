//! The narrow storage trait under the Raft log ([`KvStore`]): ordered byte keys, atomic
//! batches, an explicit flush. Two implementations run the same test suite: [`SledKv`]
//! (durable, a `sled` tree) and [`MemKv`] (its in-memory twin, for tests and simulations).
//!
//! Every call blocks (sled does disk I/O); callers keep them off async executors' threads.

use std::collections::BTreeMap;
use std::ops::Bound;
use std::path::Path;
use std::sync::{Arc, Mutex};

/// A storage failure, as data.
#[derive(Clone, Debug, thiserror::Error)]
pub enum StoreError {
    #[error("storage i/o failed: {0}")]
    Io(String),
    #[error("storage holds a corrupt record under {key}: {detail}")]
    Corrupt { key: String, detail: String },
}

impl From<sled::Error> for StoreError {
    fn from(e: sled::Error) -> Self {
        StoreError::Io(e.to_string())
    }
}

/// One write of a [`Batch`].
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Op {
    Put(Vec<u8>, Vec<u8>),
    Delete(Vec<u8>),
    /// Every key in `[start, end)`.
    DeleteRange(Vec<u8>, Vec<u8>),
}

/// Writes applied together: all or none, in order.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Batch(pub Vec<Op>);

impl Batch {
    pub fn put(&mut self, key: impl Into<Vec<u8>>, value: impl Into<Vec<u8>>) {
        self.0.push(Op::Put(key.into(), value.into()));
    }
    pub fn delete(&mut self, key: impl Into<Vec<u8>>) {
        self.0.push(Op::Delete(key.into()));
    }
    pub fn delete_range(&mut self, start: impl Into<Vec<u8>>, end: impl Into<Vec<u8>>) {
        self.0.push(Op::DeleteRange(start.into(), end.into()));
    }
    pub fn is_empty(&self) -> bool {
        self.0.is_empty()
    }
}

/// A key and its value.
pub type Pair = (Vec<u8>, Vec<u8>);

/// Keys under this prefix hold large values written rarely (a state machine snapshot).
/// [`SledKv`] keeps them in a tree of their own: sled writes a page whole when it
/// consolidates it, so a large value sharing a page with keys written at every Raft
/// round (the hard state, the newest entries) was written out again many times a
/// second (a 2.4 MB snapshot, ~60 times a second under a placement-group loop).
/// `get` and batches reach them as any key; scans and `last_in` must not span them.
pub const APART: &[u8] = b"~apart/";

fn is_apart(key: &[u8]) -> bool {
    key.starts_with(APART)
}

/// Ordered byte-keyed storage. Keys compare as bytes (callers encode numbers big-endian).
pub trait KvStore: Send + 'static {
    /// The value under `key`.
    ///
    /// # Errors
    /// [`StoreError::Io`] when the backend fails.
    fn get(&self, key: &[u8]) -> Result<Option<Vec<u8>>, StoreError>;

    /// Visits the pairs with keys in `[start, end)` in ascending order until `visit`
    /// returns false.
    ///
    /// # Errors
    /// [`StoreError::Io`] when the backend fails.
    fn scan(
        &self,
        start: &[u8],
        end: &[u8],
        visit: &mut dyn FnMut(&[u8], &[u8]) -> bool,
    ) -> Result<(), StoreError>;

    /// The last pair with a key in `[start, end)`.
    ///
    /// # Errors
    /// [`StoreError::Io`] when the backend fails.
    fn last_in(&self, start: &[u8], end: &[u8]) -> Result<Option<Pair>, StoreError>;

    /// Applies `batch` atomically (visible at once; durable after [`KvStore::flush`]).
    ///
    /// # Errors
    /// [`StoreError::Io`] when the backend fails; nothing of the batch is applied then.
    fn write(&self, batch: Batch) -> Result<(), StoreError>;

    /// Makes every write so far durable.
    ///
    /// # Errors
    /// [`StoreError::Io`] when the backend fails.
    fn flush(&self) -> Result<(), StoreError>;
}

/// The in-memory twin of [`SledKv`]. Clones share the same data, so a simulated crash
/// can drop a node and reopen its storage.
#[derive(Clone, Default)]
pub struct MemKv(Arc<Mutex<BTreeMap<Vec<u8>, Vec<u8>>>>);

impl MemKv {
    pub fn new() -> Self {
        Self::default()
    }
    fn map(&self) -> std::sync::MutexGuard<'_, BTreeMap<Vec<u8>, Vec<u8>>> {
        self.0.lock().unwrap_or_else(|p| p.into_inner())
    }
}

fn range_of<'a>(start: &'a [u8], end: &'a [u8]) -> (Bound<&'a [u8]>, Bound<&'a [u8]>) {
    (Bound::Included(start), Bound::Excluded(end))
}

impl KvStore for MemKv {
    fn get(&self, key: &[u8]) -> Result<Option<Vec<u8>>, StoreError> {
        Ok(self.map().get(key).cloned())
    }

    fn scan(
        &self,
        start: &[u8],
        end: &[u8],
        visit: &mut dyn FnMut(&[u8], &[u8]) -> bool,
    ) -> Result<(), StoreError> {
        if start >= end {
            return Ok(());
        }
        let map = self.map();
        for (k, v) in map.range::<[u8], _>(range_of(start, end)) {
            if !visit(k, v) {
                break;
            }
        }
        Ok(())
    }

    fn last_in(&self, start: &[u8], end: &[u8]) -> Result<Option<Pair>, StoreError> {
        if start >= end {
            return Ok(None);
        }
        let map = self.map();
        Ok(map
            .range::<[u8], _>(range_of(start, end))
            .next_back()
            .map(|(k, v)| (k.clone(), v.clone())))
    }

    fn write(&self, batch: Batch) -> Result<(), StoreError> {
        let mut map = self.map();
        for op in batch.0 {
            match op {
                Op::Put(k, v) => {
                    map.insert(k, v);
                }
                Op::Delete(k) => {
                    map.remove(&k);
                }
                Op::DeleteRange(s, e) => {
                    if s < e {
                        let keys: Vec<Vec<u8>> = map
                            .range::<[u8], _>(range_of(&s, &e))
                            .map(|(k, _)| k.clone())
                            .collect();
                        for k in keys {
                            map.remove(&k);
                        }
                    }
                }
            }
        }
        Ok(())
    }

    fn flush(&self) -> Result<(), StoreError> {
        Ok(())
    }
}

/// [`KvStore`] over a `sled` database in a folder of its own: one tree for the keys,
/// another for the keys under [`APART`].
pub struct SledKv {
    db: sled::Db,
    apart: sled::Tree,
}

impl SledKv {
    /// Opens (creating when missing) the database in `dir`.
    ///
    /// # Errors
    /// [`StoreError::Io`] naming the folder when sled cannot open it (in use by another
    /// process, unreadable, not a sled database).
    pub fn open(dir: &Path) -> Result<Self, StoreError> {
        // sled lets go of its file lock when the last handle to a dropped database goes,
        // its flusher thread's included, a moment after the drop: a reopen in the same
        // process (a restarted replica in tests) waits for that, up to about 2 s.
        let mut tries = 0;
        let db = loop {
            match sled::Config::new().path(dir).mode(sled::Mode::HighThroughput).open() {
                // sled 0.34 wraps the lock's EWOULDBLOCK in an error of kind `Other`
                // whose text says so ("could not acquire lock on ...").
                Err(sled::Error::Io(e))
                    if tries < 200
                        && (e.kind() == std::io::ErrorKind::WouldBlock
                            || e.to_string().contains("could not acquire lock")) =>
                {
                    tries += 1;
                    std::thread::sleep(std::time::Duration::from_millis(10));
                }
                r => {
                    break r.map_err(|e| {
                        StoreError::Io(format!("cannot open {}: {e}", dir.display()))
                    })?;
                }
            }
        };
        let apart = db
            .open_tree(APART)
            .map_err(|e| StoreError::Io(format!("cannot open {}: {e}", dir.display())))?;
        Ok(Self { db, apart })
    }
}

impl KvStore for SledKv {
    fn get(&self, key: &[u8]) -> Result<Option<Vec<u8>>, StoreError> {
        let tree: &sled::Tree = if is_apart(key) { &self.apart } else { &self.db };
        Ok(tree.get(key)?.map(|v| v.to_vec()))
    }

    fn scan(
        &self,
        start: &[u8],
        end: &[u8],
        visit: &mut dyn FnMut(&[u8], &[u8]) -> bool,
    ) -> Result<(), StoreError> {
        if start >= end {
            return Ok(());
        }
        for kv in self.db.range::<&[u8], _>(range_of(start, end)) {
            let (k, v) = kv?;
            if !visit(&k, &v) {
                break;
            }
        }
        Ok(())
    }

    fn last_in(&self, start: &[u8], end: &[u8]) -> Result<Option<Pair>, StoreError> {
        if start >= end {
            return Ok(None);
        }
        match self.db.range::<&[u8], _>(range_of(start, end)).next_back() {
            Some(kv) => {
                let (k, v) = kv?;
                Ok(Some((k.to_vec(), v.to_vec())))
            }
            None => Ok(None),
        }
    }

    fn write(&self, batch: Batch) -> Result<(), StoreError> {
        let (mut main, mut apart) = (sled::Batch::default(), sled::Batch::default());
        let mut touches_apart = false;
        for op in batch.0 {
            match op {
                Op::Put(k, v) if is_apart(&k) => {
                    touches_apart = true;
                    apart.insert(k, v);
                }
                Op::Delete(k) if is_apart(&k) => {
                    touches_apart = true;
                    apart.remove(k);
                }
                Op::Put(k, v) => main.insert(k, v),
                Op::Delete(k) => main.remove(k),
                Op::DeleteRange(s, e) => {
                    if s < e {
                        for kv in self.db.range::<&[u8], _>(range_of(&s, &e)) {
                            let (k, _) = kv?;
                            main.remove(k);
                        }
                    }
                }
            }
        }
        if !touches_apart {
            self.db.apply_batch(main)?;
            return Ok(());
        }
        // Both trees at once, all or nothing (a snapshot and the log compaction it allows).
        use sled::Transactional;
        (&*self.db, &self.apart)
            .transaction(|(m, a)| {
                m.apply_batch(&main)?;
                a.apply_batch(&apart)?;
                Ok::<(), sled::transaction::ConflictableTransactionError<()>>(())
            })
            .map_err(|e| StoreError::Io(format!("{e:?}")))?;
        Ok(())
    }

    fn flush(&self) -> Result<(), StoreError> {
        self.db.flush()?;
        Ok(())
    }
}

/// The suite every [`KvStore`] passes; `open` gives a fresh empty store.
#[cfg(test)]
pub(crate) mod suite {
    use super::*;

    fn keys(kv: &dyn KvStore, start: &[u8], end: &[u8]) -> Vec<Vec<u8>> {
        let mut out = Vec::new();
        kv.scan(start, end, &mut |k, _| {
            out.push(k.to_vec());
            true
        })
        .unwrap();
        out
    }

    pub fn get_put_delete(kv: &dyn KvStore) {
        assert_eq!(kv.get(b"a").unwrap(), None);
        let mut b = Batch::default();
        b.put(b"a".to_vec(), b"1".to_vec());
        b.put(b"b".to_vec(), b"2".to_vec());
        kv.write(b).unwrap();
        kv.flush().unwrap();
        assert_eq!(kv.get(b"a").unwrap(), Some(b"1".to_vec()));
        let mut b = Batch::default();
        b.delete(b"a".to_vec());
        b.put(b"b".to_vec(), b"3".to_vec());
        kv.write(b).unwrap();
        assert_eq!(kv.get(b"a").unwrap(), None);
        assert_eq!(kv.get(b"b").unwrap(), Some(b"3".to_vec()));
    }

    pub fn big_endian_keys_scan_in_numeric_order(kv: &dyn KvStore) {
        let mut b = Batch::default();
        for i in [300u64, 2, 256, 1, 70_000] {
            let mut k = b"e".to_vec();
            k.extend_from_slice(&i.to_be_bytes());
            b.put(k, i.to_string().into_bytes());
        }
        b.put(b"f".to_vec(), b"other".to_vec());
        kv.write(b).unwrap();
        let mut seen = Vec::new();
        kv.scan(b"e", b"f", &mut |_, v| {
            seen.push(String::from_utf8(v.to_vec()).unwrap());
            true
        })
        .unwrap();
        assert_eq!(seen, ["1", "2", "256", "300", "70000"]);
        let (_, last) = kv.last_in(b"e", b"f").unwrap().unwrap();
        assert_eq!(last, b"70000");
        assert_eq!(kv.last_in(b"g", b"h").unwrap(), None);
        // A visitor may stop early.
        let mut n = 0;
        kv.scan(b"e", b"f", &mut |_, _| {
            n += 1;
            n < 2
        })
        .unwrap();
        assert_eq!(n, 2);
    }

    pub fn delete_range_removes_exactly_the_half_open_range(kv: &dyn KvStore) {
        let mut b = Batch::default();
        for k in [b"k1", b"k2", b"k3", b"k4"] {
            b.put(k.to_vec(), b"v".to_vec());
        }
        kv.write(b).unwrap();
        let mut b = Batch::default();
        b.delete_range(b"k2".to_vec(), b"k4".to_vec());
        b.put(b"k3".to_vec(), b"again".to_vec()); // later ops of a batch win
        kv.write(b).unwrap();
        assert_eq!(keys(kv, b"k", b"l"), [b"k1".to_vec(), b"k3".to_vec(), b"k4".to_vec()]);
        // An empty or inverted range is a no-op.
        let mut b = Batch::default();
        b.delete_range(b"k4".to_vec(), b"k1".to_vec());
        kv.write(b).unwrap();
        assert_eq!(keys(kv, b"k", b"l").len(), 3);
        assert!(keys(kv, b"l", b"k").is_empty());
    }

    pub fn run_all(open: &dyn Fn() -> Box<dyn KvStore>) {
        get_put_delete(&*open());
        big_endian_keys_scan_in_numeric_order(&*open());
        delete_range_removes_exactly_the_half_open_range(&*open());
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn mem_kv_passes_the_store_suite() {
        suite::run_all(&|| Box::new(MemKv::new()));
    }

    #[test]
    fn sled_kv_passes_the_store_suite() {
        let dirs = Mutex::new(Vec::new());
        suite::run_all(&|| {
            let d = tempfile::tempdir().unwrap();
            let kv = SledKv::open(d.path()).unwrap();
            dirs.lock().unwrap().push(d);
            Box::new(kv)
        });
    }

    #[test]
    fn sled_kv_keeps_flushed_writes_across_reopen() {
        let d = tempfile::tempdir().unwrap();
        {
            let kv = SledKv::open(d.path()).unwrap();
            let mut b = Batch::default();
            b.put(b"x".to_vec(), b"y".to_vec());
            kv.write(b).unwrap();
            kv.flush().unwrap();
        }
        let kv = SledKv::open(d.path()).unwrap();
        assert_eq!(kv.get(b"x").unwrap(), Some(b"y".to_vec()));
    }

    /// A key under [`APART`] lives in its own sled tree, is written in the same batch as
    /// the others and survives a reopen; scans of the other keys never see it.
    #[test]
    fn sled_kv_keeps_apart_keys_in_their_own_tree() {
        let d = tempfile::tempdir().unwrap();
        let big = [APART, b"snap"].concat();
        {
            let kv = SledKv::open(d.path()).unwrap();
            let mut b = Batch::default();
            b.put(b"m/meta".to_vec(), b"7".to_vec());
            b.put(big.clone(), vec![3u8; 100_000]);
            kv.write(b).unwrap();
            kv.flush().unwrap();
            assert_eq!(kv.db.get(&big).unwrap(), None, "not in the main tree");
            assert_eq!(kv.apart.get(&big).unwrap().map(|v| v.len()), Some(100_000));
        }
        let kv = SledKv::open(d.path()).unwrap();
        assert_eq!(kv.get(b"m/meta").unwrap(), Some(b"7".to_vec()));
        assert_eq!(kv.get(&big).unwrap(), Some(vec![3u8; 100_000]));
        let mut seen = 0;
        kv.scan(b"", b"\xff", &mut |_, _| {
            seen += 1;
            true
        })
        .unwrap();
        assert_eq!(seen, 1);
        let mut b = Batch::default();
        b.delete(big.clone());
        kv.write(b).unwrap();
        assert_eq!(kv.get(&big).unwrap(), None);
    }
}
