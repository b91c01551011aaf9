//! [`LogStore`]: the Raft log, hard state, conf state and latest snapshot over a
//! [`KvStore`], and raft-rs's `Storage` (its six read methods) on top.
//!
//! Writes happen only in the Ready loop ([`crate::node`]): each write method adds to a
//! [`Batch`], and [`LogStore::persist`] writes the batch atomically and flushes it
//! (RAFT-2). Layout (keys big-endian, so they sort by index):
//!
//! | key | value |
//! | --- | --- |
//! | `e` + index (8 bytes) | term (8 bytes) + the entry's protobuf |
//! | `m/hard` | `HardState` protobuf |
//! | `m/conf` | `ConfState` protobuf |
//! | `m/trunc` | index + term of the last entry compacted away |
//! | `m/snapmeta`, `m/snapdata` | the latest snapshot's metadata and data |

use std::collections::VecDeque;

use protobuf::Message as _;
use raft::eraftpb::{ConfState, Entry, HardState, Snapshot, SnapshotMetadata};
use raft::{GetEntriesContext, RaftState, Storage, StorageError};

use crate::kv::{Batch, KvStore, StoreError};

const ENTRY: u8 = b'e';
const ENTRY_END: u8 = b'f';
const HARD: &[u8] = b"m/hard";
const CONF: &[u8] = b"m/conf";
const TRUNC: &[u8] = b"m/trunc";
const SNAP_META: &[u8] = b"m/snapmeta";
/// The snapshot's bytes, kept apart from the often-written keys (see [`crate::kv::APART`]).
const SNAP_DATA: &[u8] = b"~apart/snapdata";
/// Where stores written before the snapshot moved apart kept it (read, then deleted).
const OLD_SNAP_DATA: &[u8] = b"m/snapdata";

fn entry_key(index: u64) -> [u8; 9] {
    let mut k = [0u8; 9];
    k[0] = ENTRY;
    k[1..].copy_from_slice(&index.to_be_bytes());
    k
}

fn corrupt(key: &[u8], detail: impl std::fmt::Display) -> StoreError {
    StoreError::Corrupt {
        key: String::from_utf8_lossy(key).into_owned(),
        detail: detail.to_string(),
    }
}

fn parse<M: protobuf::Message>(key: &[u8], bytes: &[u8]) -> Result<M, StoreError> {
    M::parse_from_bytes(bytes).map_err(|e| corrupt(key, e))
}

fn encode<M: protobuf::Message>(m: &M) -> Vec<u8> {
    m.write_to_bytes().expect("raft protobuf messages always encode")
}

fn u64_pair(key: &[u8], v: &[u8]) -> Result<(u64, u64), StoreError> {
    if v.len() != 16 {
        return Err(corrupt(key, format!("expected 16 bytes, found {}", v.len())));
    }
    let a = u64::from_be_bytes(v[..8].try_into().expect("8 bytes"));
    let b = u64::from_be_bytes(v[8..].try_into().expect("8 bytes"));
    Ok((a, b))
}

/// The Raft log of one replica.
pub struct LogStore<K> {
    kv: K,
    hard: HardState,
    conf: ConfState,
    /// The last index compacted away (0: none) and its term.
    trunc_index: u64,
    trunc_term: u64,
    /// `terms[i]` is the term of entry `trunc_index + 1 + i`; its length is the log's.
    terms: VecDeque<u64>,
    snap_meta: SnapshotMetadata,
}

impl<K: KvStore> LogStore<K> {
    /// Opens the log in `kv`. A store that has never been used starts with `voters` as
    /// its configuration (every replica of a group starts the same way).
    ///
    /// # Errors
    /// [`StoreError`] when the store fails or holds corrupt records.
    pub fn open(kv: K, voters: &[u64]) -> Result<Self, StoreError> {
        let hard = match kv.get(HARD)? {
            Some(b) => parse(HARD, &b)?,
            None => HardState::default(),
        };
        let conf = match kv.get(CONF)? {
            Some(b) => parse(CONF, &b)?,
            None => {
                let cs = ConfState { voters: voters.to_vec(), ..Default::default() };
                let mut batch = Batch::default();
                batch.put(CONF, encode(&cs));
                kv.write(batch)?;
                kv.flush()?;
                cs
            }
        };
        let (trunc_index, trunc_term) = match kv.get(TRUNC)? {
            Some(v) => u64_pair(TRUNC, &v)?,
            None => (0, 0),
        };
        let snap_meta = match kv.get(SNAP_META)? {
            Some(b) => parse(SNAP_META, &b)?,
            None => SnapshotMetadata::default(),
        };
        let mut terms = VecDeque::new();
        let mut bad = None;
        let mut expect = trunc_index + 1;
        kv.scan(&entry_key(trunc_index + 1), &[ENTRY_END], &mut |k, v| {
            let index = u64::from_be_bytes(k[1..9].try_into().unwrap_or_default());
            if index != expect || v.len() < 8 {
                bad = Some(format!("entry {index} where {expect} was expected"));
                return false;
            }
            terms.push_back(u64::from_be_bytes(v[..8].try_into().expect("8 bytes")));
            expect += 1;
            true
        })?;
        if let Some(detail) = bad {
            return Err(corrupt(b"e", detail));
        }
        Ok(Self { kv, hard, conf, trunc_index, trunc_term, terms, snap_meta })
    }

    pub fn hard_state(&self) -> &HardState {
        &self.hard
    }

    pub fn conf_state(&self) -> &ConfState {
        &self.conf
    }

    pub fn first(&self) -> u64 {
        self.trunc_index + 1
    }

    pub fn last(&self) -> u64 {
        self.trunc_index + self.terms.len() as u64
    }

    /// Index of the latest stored snapshot (0: none).
    pub fn snapshot_index(&self) -> u64 {
        self.snap_meta.index
    }

    /// The latest stored snapshot, if any.
    ///
    /// # Errors
    /// [`StoreError`] when the store fails.
    pub fn stored_snapshot(&self) -> Result<Option<Snapshot>, StoreError> {
        if self.snap_meta.index == 0 {
            return Ok(None);
        }
        let data = match self.kv.get(SNAP_DATA)? {
            Some(d) => d,
            None => self.kv.get(OLD_SNAP_DATA)?.unwrap_or_default(),
        };
        let mut s = Snapshot::default();
        s.set_metadata(self.snap_meta.clone());
        s.data = data.into();
        Ok(Some(s))
    }

    /// Appends `entries` (contiguous), replacing any conflicting suffix.
    pub fn append(&mut self, batch: &mut Batch, entries: &[Entry]) {
        let Some(first) = entries.first() else { return };
        assert!(
            first.index > self.trunc_index,
            "appending entry {} over the compacted log (compacted up to {})",
            first.index,
            self.trunc_index
        );
        assert!(
            first.index <= self.last() + 1,
            "appending entry {} leaves a gap after {}",
            first.index,
            self.last()
        );
        if first.index <= self.last() {
            batch.delete_range(entry_key(first.index).to_vec(), vec![ENTRY_END]);
            self.terms.truncate((first.index - self.trunc_index - 1) as usize);
        }
        for e in entries {
            let mut v = Vec::with_capacity(8 + e.compute_size() as usize);
            v.extend_from_slice(&e.term.to_be_bytes());
            v.extend_from_slice(&encode(e));
            batch.put(entry_key(e.index).to_vec(), v);
            self.terms.push_back(e.term);
        }
    }

    pub fn set_hard_state(&mut self, batch: &mut Batch, hs: &HardState) {
        self.hard = hs.clone();
        batch.put(HARD, encode(hs));
    }

    pub fn set_commit(&mut self, batch: &mut Batch, commit: u64) {
        self.hard.commit = commit;
        batch.put(HARD, encode(&self.hard));
    }

    /// Replaces the whole log with a snapshot received from the leader.
    pub fn apply_snapshot(&mut self, batch: &mut Batch, snap: &Snapshot) {
        let meta = snap.get_metadata();
        batch.delete_range(vec![ENTRY], vec![ENTRY_END]);
        self.terms.clear();
        self.trunc_index = meta.index;
        self.trunc_term = meta.term;
        batch.put(TRUNC, [meta.index.to_be_bytes(), meta.term.to_be_bytes()].concat());
        self.conf = meta.get_conf_state().clone();
        batch.put(CONF, encode(&self.conf));
        self.hard.term = self.hard.term.max(meta.term);
        self.hard.commit = self.hard.commit.max(meta.index);
        batch.put(HARD, encode(&self.hard));
        self.snap_meta = meta.clone();
        batch.put(SNAP_META, encode(meta));
        batch.put(SNAP_DATA, snap.data.to_vec());
        batch.delete(OLD_SNAP_DATA);
    }

    /// Stores a snapshot of the machine taken at applied index `index` and drops the
    /// entries up to `compact_to` (at most `index`), keeping the ones after it for
    /// followers that are only a little behind (RAFT-4).
    pub fn compact(&mut self, batch: &mut Batch, index: u64, data: Vec<u8>, compact_to: u64) {
        let term = self.term(index).expect("a snapshot is taken at an index still in the log");
        let mut meta = SnapshotMetadata { index, term, ..Default::default() };
        meta.set_conf_state(self.conf.clone());
        batch.put(SNAP_META, encode(&meta));
        batch.put(SNAP_DATA, data);
        batch.delete(OLD_SNAP_DATA);
        self.snap_meta = meta;
        let compact_to = compact_to.min(index);
        if compact_to > self.trunc_index {
            let term = self.term(compact_to).expect("compacting within the log");
            batch.delete_range(vec![ENTRY], entry_key(compact_to + 1).to_vec());
            self.terms.drain(..(compact_to - self.trunc_index) as usize);
            self.trunc_index = compact_to;
            self.trunc_term = term;
            batch.put(TRUNC, [compact_to.to_be_bytes(), term.to_be_bytes()].concat());
        }
    }

    /// Writes `batch` atomically and makes it durable (RAFT-2).
    ///
    /// # Errors
    /// [`StoreError`] when the store fails.
    pub fn persist(&mut self, batch: Batch, sync: bool) -> Result<(), StoreError> {
        if !batch.is_empty() {
            self.kv.write(batch)?;
        }
        if sync {
            self.kv.flush()?;
        }
        Ok(())
    }

    fn read_entries(
        &self,
        low: u64,
        high: u64,
        max_size: Option<u64>,
    ) -> Result<Vec<Entry>, StoreError> {
        let mut out = Vec::new();
        let mut size = 0u64;
        let mut err = None;
        self.kv.scan(
            &entry_key(low),
            &entry_key(high),
            &mut |k, v| match Entry::parse_from_bytes(&v[8..]) {
                Ok(e) => {
                    size += u64::from(e.compute_size());
                    if !out.is_empty() && max_size.is_some_and(|m| size > m) {
                        return false;
                    }
                    out.push(e);
                    true
                }
                Err(e) => {
                    err = Some(corrupt(k, e));
                    false
                }
            },
        )?;
        if let Some(e) = err {
            return Err(e);
        }
        Ok(out)
    }
}

fn store_err(e: StoreError) -> raft::Error {
    raft::Error::Store(StorageError::Other(Box::new(e)))
}

impl<K: KvStore> Storage for LogStore<K> {
    fn initial_state(&self) -> raft::Result<RaftState> {
        Ok(RaftState { hard_state: self.hard.clone(), conf_state: self.conf.clone() })
    }

    fn entries(
        &self,
        low: u64,
        high: u64,
        max_size: impl Into<Option<u64>>,
        _context: GetEntriesContext,
    ) -> raft::Result<Vec<Entry>> {
        if low <= self.trunc_index {
            return Err(raft::Error::Store(StorageError::Compacted));
        }
        if high > self.last() + 1 {
            return Err(raft::Error::Store(StorageError::Unavailable));
        }
        let ents = self.read_entries(low, high, max_size.into()).map_err(store_err)?;
        if ents.len() as u64 != high - low && ents.is_empty() {
            return Err(raft::Error::Store(StorageError::Unavailable));
        }
        Ok(ents)
    }

    fn term(&self, idx: u64) -> raft::Result<u64> {
        if idx == self.trunc_index {
            return Ok(self.trunc_term);
        }
        if idx == self.snap_meta.index && idx != 0 {
            return Ok(self.snap_meta.term);
        }
        if idx < self.trunc_index {
            return Err(raft::Error::Store(StorageError::Compacted));
        }
        self.terms
            .get((idx - self.trunc_index - 1) as usize)
            .copied()
            .ok_or(raft::Error::Store(StorageError::Unavailable))
    }

    fn first_index(&self) -> raft::Result<u64> {
        Ok(self.first())
    }

    fn last_index(&self) -> raft::Result<u64> {
        Ok(self.last())
    }

    fn snapshot(&self, request_index: u64, _to: u64) -> raft::Result<Snapshot> {
        match self.stored_snapshot().map_err(store_err)? {
            Some(s) if s.get_metadata().index >= request_index => Ok(s),
            _ => Err(raft::Error::Store(StorageError::SnapshotTemporarilyUnavailable)),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::kv::{MemKv, SledKv};

    #[test]
    fn the_snapshot_is_kept_apart_from_the_often_written_keys() {
        assert!(SNAP_DATA.starts_with(crate::kv::APART));
        for k in [HARD, CONF, TRUNC, SNAP_META] {
            assert!(!k.starts_with(crate::kv::APART));
        }
    }

    fn entry(index: u64, term: u64, data: &[u8]) -> Entry {
        Entry { index, term, data: data.to_vec().into(), ..Default::default() }
    }

    fn write<K: KvStore>(log: &mut LogStore<K>, f: impl FnOnce(&mut LogStore<K>, &mut Batch)) {
        let mut b = Batch::default();
        f(log, &mut b);
        log.persist(b, true).unwrap();
    }

    /// The log suite, run against both stores; `open` reopens the same store.
    fn suite<K: KvStore>(open: impl Fn() -> K) {
        let mut log = LogStore::open(open(), &[1, 2, 3]).unwrap();
        assert_eq!(log.initial_state().unwrap().conf_state.voters, vec![1, 2, 3]);
        assert_eq!((log.first(), log.last()), (1, 0));
        let ents: Vec<Entry> = (1..=5).map(|i| entry(i, 1, &[i as u8])).collect();
        write(&mut log, |l, b| l.append(b, &ents));
        // A conflicting suffix is replaced.
        write(&mut log, |l, b| {
            l.append(b, &[entry(4, 2, b"x"), entry(5, 2, b"y"), entry(6, 2, b"z")])
        });
        assert_eq!(log.term(3).unwrap(), 1);
        assert_eq!(log.term(6).unwrap(), 2);
        let got = log.entries(2, 7, None, GetEntriesContext::empty(false)).unwrap();
        assert_eq!(got.iter().map(|e| e.index).collect::<Vec<_>>(), [2, 3, 4, 5, 6]);
        assert_eq!(&got[2].data[..], b"x");
        // max_size limits the batch but never below one entry.
        let one = log.entries(2, 7, Some(1), GetEntriesContext::empty(false)).unwrap();
        assert_eq!(one.len(), 1);
        let hs = HardState { term: 2, vote: 3, commit: 5, ..Default::default() };
        write(&mut log, |l, b| l.set_hard_state(b, &hs));
        // Snapshot at 5, compacting to 4: entry 5 and 6 stay, term(4) is remembered.
        write(&mut log, |l, b| l.compact(b, 5, b"state@5".to_vec(), 4));
        assert_eq!((log.first(), log.last()), (5, 6));
        assert_eq!(log.term(4).unwrap(), 2);
        assert!(matches!(log.term(3), Err(raft::Error::Store(StorageError::Compacted))));
        assert!(matches!(
            log.entries(4, 6, None, GetEntriesContext::empty(false)),
            Err(raft::Error::Store(StorageError::Compacted))
        ));
        assert_eq!(&log.snapshot(0, 2).unwrap().data[..], b"state@5");
        assert!(log.snapshot(6, 2).is_err(), "a snapshot older than requested is not offered");
        drop(log);
        // Everything survives a reopen.
        let log = LogStore::open(open(), &[9]).unwrap();
        assert_eq!(log.initial_state().unwrap().hard_state, hs);
        assert_eq!(log.conf_state().voters, vec![1, 2, 3], "the stored conf state wins");
        assert_eq!((log.first(), log.last(), log.snapshot_index()), (5, 6, 5));
        assert_eq!(log.term(6).unwrap(), 2);
        assert_eq!(&log.stored_snapshot().unwrap().unwrap().data[..], b"state@5");
        // A snapshot from the leader replaces the whole log.
        let mut log = log;
        let mut snap = Snapshot::default();
        snap.mut_metadata().index = 10;
        snap.mut_metadata().term = 3;
        snap.mut_metadata().mut_conf_state().voters = vec![1, 2, 3];
        snap.data = b"state@10".to_vec().into();
        write(&mut log, |l, b| l.apply_snapshot(b, &snap));
        assert_eq!((log.first(), log.last()), (11, 10));
        assert_eq!(log.term(10).unwrap(), 3);
        assert_eq!(log.hard_state().commit, 10);
        write(&mut log, |l, b| l.append(b, &[entry(11, 3, b"after")]));
        drop(log);
        let log = LogStore::open(open(), &[]).unwrap();
        assert_eq!((log.first(), log.last()), (11, 11));
        assert_eq!(&log.stored_snapshot().unwrap().unwrap().data[..], b"state@10");
    }

    #[test]
    fn mem_log_keeps_entries_hard_state_and_snapshots() {
        let kv = MemKv::new();
        suite(|| kv.clone());
    }

    /// RAFT-2: entries and hard state persisted (written and flushed) survive a reopen of the
    /// sled store.
    #[test]
    fn sled_log_keeps_entries_hard_state_and_snapshots_across_reopen() {
        let d = tempfile::tempdir().unwrap();
        suite(|| SledKv::open(d.path()).unwrap());
    }
}
