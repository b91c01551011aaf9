//! Capacity, eviction, spilling, restoring, write-through and the recycled
//! pool of one store, in one process (OBJ-3 to OBJ-10). Cross-process cases are in
//! `processes.rs`.

use std::path::{Path, PathBuf};

use tpuray_objectstore::{
    CopyKind, CreateOptions, LocalStore, Location, StoreConfig, StoreError, StoreUsage,
};

const MIB: u64 = 1024 * 1024;

/// Deterministic bytes for object `id`: a reader can check them byte-exact.
fn pattern(id: &str, len: u64) -> Vec<u8> {
    let seed = id.bytes().fold(17u32, |h, b| h.wrapping_mul(31).wrapping_add(b as u32));
    (0..len).map(|i| (seed.wrapping_add(i as u32).wrapping_mul(2654435761) >> 24) as u8).collect()
}

struct Fixture {
    _mem: tempfile::TempDir,
    _disk: tempfile::TempDir,
    store: LocalStore,
}

impl Fixture {
    fn new(capacity: u64, spill: bool) -> Self {
        let mem = tempfile::tempdir().unwrap();
        let disk = tempfile::tempdir().unwrap();
        let store = LocalStore::open_with(StoreConfig {
            dir: mem.path().join("tpuray-node"),
            capacity_bytes: Some(capacity),
            spill_dir: spill.then(|| disk.path().to_path_buf()),
        })
        .unwrap();
        Self { _mem: mem, _disk: disk, store }
    }

    fn spill_dir(&self) -> PathBuf {
        self.store.spill_dir().unwrap().unwrap()
    }

    fn usage(&self) -> StoreUsage {
        let u = self.store.usage().unwrap();
        assert!(u.used_bytes + u.pooled_bytes <= u.capacity_bytes.unwrap(), "OBJ-3 broken: {u:?}");
        u
    }

    fn location(&self, id: &str) -> Location {
        self.store.info(id).unwrap().unwrap().location
    }

    fn assert_exact(&self, id: &str, len: u64) {
        let v = self.store.get(id).unwrap().unwrap_or_else(|| panic!("{id} is gone"));
        assert!(*v == *pattern(id, len), "{id} differs");
    }
}

fn secondary() -> CreateOptions {
    CreateOptions { copy: CopyKind::Secondary, ..Default::default() }
}

fn visible(dir: &Path) -> Vec<String> {
    let mut v: Vec<String> = std::fs::read_dir(dir)
        .map(|rd| rd.map(|e| e.unwrap().file_name().into_string().unwrap()).collect())
        .unwrap_or_default();
    v.retain(|n| n != ".lock" && n != ".agent");
    v.sort();
    v
}

#[test]
fn capacity_is_enforced_by_spilling_primaries_oldest_first_obj_3_obj_4() {
    let f = Fixture::new(4 * MIB, true);
    for i in 0..6 {
        f.store.put(&format!("p{i}"), &pattern(&format!("p{i}"), MIB)).unwrap();
        f.usage();
    }
    let u = f.usage();
    assert_eq!(u.used_bytes, 4 * MIB);
    assert_eq!((u.object_count, u.spilled_count), (4, 2));
    assert_eq!(u.spilled_bytes, 2 * MIB);
    assert_eq!(f.location("p0"), Location::Spilled);
    assert_eq!(f.location("p1"), Location::Spilled);
    assert_eq!(f.location("p5"), Location::Memory);
    assert!(f.spill_dir().join("p0").is_file());
}

#[test]
fn secondaries_are_evicted_before_primaries_are_spilled_obj_4() {
    let f = Fixture::new(3 * MIB, true);
    f.store.put("a", &pattern("a", MIB)).unwrap();
    f.store.put_with("b", &pattern("b", MIB), &secondary()).unwrap();
    f.store.put_with("c", &pattern("c", MIB), &secondary()).unwrap();
    f.store.put("d", &pattern("d", MIB)).unwrap();
    assert!(f.store.get("b").unwrap().is_none(), "the oldest secondary goes first");
    assert_eq!(f.location("a"), Location::Memory);
    assert_eq!(f.location("c"), Location::Memory);
    f.store.put("e", &pattern("e", MIB)).unwrap();
    assert!(f.store.get("c").unwrap().is_none());
    assert_eq!(f.location("a"), Location::Memory);
    let u = f.usage();
    assert_eq!((u.object_count, u.spilled_count), (3, 0));
    assert!(visible(&f.spill_dir()).is_empty(), "secondaries are never spilled");
}

#[test]
fn spilled_object_reads_back_byte_exact_and_is_restored_when_room_frees() {
    let f = Fixture::new(2 * MIB, true);
    let size = MIB + 12_345;
    f.store.put("old", &pattern("old", size)).unwrap();
    f.store.put("new", &pattern("new", MIB)).unwrap();
    assert_eq!(f.location("old"), Location::Spilled);
    assert_eq!(f.store.size("old"), Some(size));
    // No room without spilling "new": the spill file is mapped directly.
    f.assert_exact("old", size);
    assert_eq!(f.location("old"), Location::Spilled);
    assert_eq!(f.location("new"), Location::Memory);
    f.store.delete("new");
    // Now it fits: the read restores it into memory and drops the spill file.
    f.assert_exact("old", size);
    assert_eq!(f.location("old"), Location::Memory);
    assert!(!f.spill_dir().join("old").exists());
    assert_eq!(f.usage().used_bytes, size);
}

#[test]
fn restore_evicts_secondaries_but_never_spills_another_primary() {
    let f = Fixture::new(2 * MIB, true);
    f.store.put("p", &pattern("p", MIB)).unwrap();
    f.store.put("q", &pattern("q", MIB)).unwrap();
    f.store.put("r", &pattern("r", MIB)).unwrap();
    assert_eq!(f.location("p"), Location::Spilled);
    f.store.delete("q");
    f.store.put_with("s", &pattern("s", MIB), &secondary()).unwrap();
    f.assert_exact("p", MIB);
    assert_eq!(f.location("p"), Location::Memory);
    assert_eq!(f.location("r"), Location::Memory);
    assert!(f.store.get("s").unwrap().is_none());
}

#[test]
fn delete_removes_spill_files_obj_5() {
    let f = Fixture::new(MIB, true);
    f.store.put("a", &pattern("a", MIB)).unwrap();
    f.store.put("b", &pattern("b", MIB)).unwrap();
    f.store.put("big", &pattern("big", 3 * MIB)).unwrap();
    assert!(f.spill_dir().join("a").is_file());
    assert!(f.spill_dir().join("big").is_file());
    for id in ["a", "b", "big"] {
        f.store.delete(id);
        assert!(f.store.get(id).unwrap().is_none());
    }
    assert!(visible(&f.spill_dir()).is_empty());
    assert!(visible(f.store.dir()).is_empty());
    let u = f.usage();
    assert_eq!((u.used_bytes, u.spilled_bytes, u.object_count, u.spilled_count), (0, 0, 0, 0));
}

#[test]
fn mapped_object_is_not_spilled_out_from_under_its_reader_obj_6() {
    let f = Fixture::new(3 * MIB, true);
    f.store.put("pinned", &pattern("pinned", MIB)).unwrap();
    f.store.put("free", &pattern("free", MIB)).unwrap();
    f.store.put("young", &pattern("young", MIB)).unwrap();
    let view = f.store.get("pinned").unwrap().unwrap();
    f.store.put("more", &pattern("more", MIB)).unwrap();
    assert_eq!(f.location("pinned"), Location::Memory, "the oldest, but mapped");
    assert_eq!(f.location("free"), Location::Spilled);
    assert!(*view == *pattern("pinned", MIB));
    let u = f.usage();
    assert_eq!(u.pinned_bytes, MIB);
    assert!(u.largest.iter().any(|o| o.id == "pinned" && o.pinned));
    drop(view);
    f.store.put("last", &pattern("last", MIB)).unwrap();
    assert_eq!(f.location("pinned"), Location::Spilled);
}

#[test]
fn full_store_with_everything_pinned_fails_at_once_naming_sizes_obj_7() {
    let f = Fixture::new(2 * MIB, true);
    f.store.put("a", &pattern("a", MIB)).unwrap();
    f.store.put("b", &pattern("b", MIB)).unwrap();
    let _va = f.store.get("a").unwrap().unwrap();
    let _vb = f.store.get("b").unwrap().unwrap();
    let err = f.store.put("c", &pattern("c", MIB)).unwrap_err();
    match &err {
        StoreError::Full { requested, capacity, pinned, .. } => {
            assert_eq!((*requested, *capacity, *pinned), (MIB, 2 * MIB, 2 * MIB));
        }
        other => panic!("expected Full, got {other}"),
    }
    let msg = err.to_string();
    assert!(msg.contains("object store full"), "{msg}");
    assert!(msg.contains(&MIB.to_string()) && msg.contains(&(2 * MIB).to_string()), "{msg}");
    assert!(f.store.get("c").unwrap().is_none());
    assert_eq!(f.usage().used_bytes, 2 * MIB);
}

#[test]
fn growing_writer_fails_cleanly_when_the_rest_is_pinned() {
    let f = Fixture::new(2 * MIB, true);
    f.store.put("a", &pattern("a", MIB)).unwrap();
    let _va = f.store.get("a").unwrap().unwrap();
    let mut w = f.store.create("w").unwrap();
    w.write(&pattern("w", MIB)).unwrap();
    let err = w.write(b"x").unwrap_err();
    let inner = err.downcast::<StoreError>().unwrap();
    assert!(matches!(inner, StoreError::Full { requested: 1, .. }), "{inner}");
    drop(w);
    assert_eq!(f.usage().used_bytes, MIB);
    assert!(visible(f.store.dir()).iter().all(|n| !n.starts_with(".w.")));
}

#[test]
fn without_a_spill_dir_primaries_are_never_dropped_and_the_error_says_why() {
    let f = Fixture::new(2 * MIB, false);
    f.store.put("a", &pattern("a", MIB)).unwrap();
    f.store.put_with("s", &pattern("s", MIB), &secondary()).unwrap();
    f.store.put("b", &pattern("b", MIB)).unwrap();
    assert!(f.store.get("s").unwrap().is_none());
    let err = f.store.put("c", &pattern("c", MIB)).unwrap_err();
    assert!(
        matches!(err, StoreError::Full { unspillable, pinned: 0, .. } if unspillable == 2 * MIB),
        "{err}"
    );
    assert!(err.to_string().contains("without a spill dir"), "{err}");
    f.assert_exact("a", MIB);
    f.assert_exact("b", MIB);
}

#[test]
fn object_larger_than_the_store_is_written_through_to_disk() {
    let f = Fixture::new(MIB, true);
    // Known size: straight to the spill folder, memory untouched.
    f.store.put("sized", &pattern("sized", 3 * MIB)).unwrap();
    // Unknown size: moves to disk once it outgrows the store.
    let mut w = f.store.create("streamed").unwrap();
    let data = pattern("streamed", 2 * MIB + 7);
    for chunk in data.chunks(300_000) {
        w.write(chunk).unwrap();
    }
    assert!(w.is_on_disk());
    w.seal(Some(data.len() as u64)).unwrap();
    f.store.put("small", &pattern("small", MIB / 2)).unwrap();
    assert_eq!(f.location("sized"), Location::Spilled);
    assert_eq!(f.location("streamed"), Location::Spilled);
    assert_eq!(f.location("small"), Location::Memory);
    f.assert_exact("sized", 3 * MIB);
    f.assert_exact("streamed", 2 * MIB + 7);
    let u = f.usage();
    assert_eq!(u.used_bytes, MIB / 2);
    assert_eq!(u.spilled_bytes, 5 * MIB + 7);
    assert_eq!(u.largest[0].id, "sized");
}

#[test]
fn object_larger_than_the_store_without_spill_dir_is_refused_naming_both_sizes() {
    let f = Fixture::new(MIB, false);
    let err = f.store.put("big", &pattern("big", 2 * MIB)).unwrap_err();
    assert!(
        matches!(err, StoreError::TooLarge { size, capacity, .. } if size == 2 * MIB && capacity == MIB),
        "{err}"
    );
    let msg = err.to_string();
    assert!(msg.contains("2097152") && msg.contains("1048576"), "{msg}");
    let mut w = f.store.create("streamed").unwrap();
    w.write(&pattern("streamed", MIB)).unwrap();
    let err = w.write(b"!").unwrap_err().downcast::<StoreError>().unwrap();
    assert!(matches!(err, StoreError::TooLarge { size, .. } if size == MIB + 1), "{err}");
    drop(w);
    assert!(f.store.get("big").unwrap().is_none());
    assert_eq!(f.usage().used_bytes, 0);
}

#[test]
fn sized_writer_that_writes_less_gives_the_rest_back() {
    let f = Fixture::new(2 * MIB, true);
    let opts = CreateOptions { size: Some(2 * MIB), ..Default::default() };
    let mut w = f.store.create_with("a", &opts).unwrap();
    assert_eq!(f.usage().writing_bytes, 2 * MIB);
    w.write(&pattern("a", 1000)).unwrap();
    w.seal(None).unwrap();
    let u = f.usage();
    assert_eq!((u.used_bytes, u.writing_bytes), (1000, 0));
    f.assert_exact("a", 1000);
}

/// Object `i` of thread `t`: 50 KB to 510 KB, so that six threads, each
/// holding one view or one writer at a time, can never pin the whole 4 MiB
/// store between them and every write finds room (no `Full` by design).
fn size_of(t: u64, i: u64) -> u64 {
    50_000 + (t * 131_071 + i * 65_537) % 460_000
}

#[test]
fn concurrent_writers_in_threads_never_exceed_capacity_obj_3() {
    let f = Fixture::new(4 * MIB, true);
    let store = f.store.clone();
    let threads: Vec<_> = (0..6)
        .map(|t| {
            let store = store.clone();
            std::thread::spawn(move || {
                for i in 0..12u64 {
                    let id = format!("t{t}-{i}");
                    let len = size_of(t, i);
                    let data = pattern(&id, len);
                    if i % 3 == 0 {
                        // Unknown size: reserves chunk by chunk.
                        let mut w = store.create(&id).unwrap();
                        for c in data.chunks(100_000) {
                            w.write(c).unwrap();
                        }
                        w.seal(Some(len)).unwrap();
                    } else {
                        store.put(&id, &data).unwrap();
                    }
                    let u = store.usage().unwrap();
                    assert!(u.used_bytes <= 4 * MIB, "OBJ-3 broken: {u:?}");
                    // Read back an earlier one, restoring or mapping it.
                    let back = format!("t{t}-{}", i / 2);
                    let v = store.get(&back).unwrap().unwrap();
                    assert!(*v == *pattern(&back, size_of(t, i / 2)), "{back} differs");
                }
            })
        })
        .collect();
    for t in threads {
        t.join().unwrap();
    }
    let u = f.usage();
    assert_eq!(u.object_count + u.spilled_count, 72);
    assert_eq!(u.writing_bytes, 0);
}

fn inode(store: &LocalStore, id: &str) -> u64 {
    use std::os::unix::fs::MetadataExt;
    std::fs::metadata(store.dir().join(id)).unwrap().ino()
}

/// OBJ-9: freed files are reused by sized writers of half to twice their size.
#[test]
fn freed_files_are_recycled_with_their_bytes_replaced_obj_9() {
    let f = Fixture::new(64 * MIB, false);
    f.store.put("a", &pattern("a", 4 * MIB)).unwrap();
    let ino = inode(&f.store, "a");
    f.store.delete("a");
    let u = f.usage();
    assert_eq!((u.used_bytes, u.pooled_bytes, u.object_count), (0, 4 * MIB, 0));
    assert!(f.store.get("a").unwrap().is_none(), "a recycled object must be gone");
    // Same size, a bit smaller, a bit larger: each reuses the pool's file.
    for (id, len) in [("b", 4 * MIB), ("c", 3 * MIB), ("d", 5 * MIB)] {
        f.store.put(id, &pattern(id, len)).unwrap();
        assert_eq!(inode(&f.store, id), ino, "{id} did not reuse the pooled file");
        f.assert_exact(id, len);
        let u = f.usage();
        assert_eq!((u.used_bytes, u.pooled_bytes), (len, 0));
        f.store.delete(id);
    }
    // A writer of unknown size grows a new file, and small objects skip the pool.
    let mut w = f.store.create("e").unwrap();
    w.write(&pattern("e", 2 * MIB)).unwrap();
    w.seal(None).unwrap();
    assert_ne!(inode(&f.store, "e"), ino);
    f.assert_exact("e", 2 * MIB);
    f.store.put("small", b"tiny").unwrap();
    f.store.delete("small");
    assert_eq!(f.usage().pooled_bytes, 5 * MIB);
}

#[test]
fn a_mapped_object_is_never_recycled_obj_10() {
    let f = Fixture::new(64 * MIB, false);
    f.store.put("a", &pattern("a", 2 * MIB)).unwrap();
    let view = f.store.get("a").unwrap().unwrap();
    f.store.delete("a");
    assert_eq!(f.usage().pooled_bytes, 0, "a mapped file went to the pool");
    f.store.put("b", &pattern("b", 2 * MIB)).unwrap();
    assert!(*view == *pattern("a", 2 * MIB), "a reader's bytes changed");
}

#[test]
fn readers_racing_recycling_see_only_their_own_object_obj_10() {
    let f = Fixture::new(64 * MIB, false);
    let len = 2 * MIB;
    let (a, b) = (pattern("a", len), pattern("b", len));
    let stop = std::sync::atomic::AtomicBool::new(false);
    let seen = std::sync::atomic::AtomicU64::new(0);
    std::thread::scope(|s| {
        let reader = s.spawn(|| {
            while !stop.load(std::sync::atomic::Ordering::Relaxed) {
                if let Some(v) = f.store.get("a").unwrap() {
                    assert!(*v == *a, "a reader saw another object's bytes under id a");
                    seen.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                }
            }
        });
        // At least 300 rounds, and on until the reader has found "a" 50 times
        // (a descheduled reader may miss the first rounds), for at most 60 s.
        let start = std::time::Instant::now();
        let mut rounds = 0;
        while rounds < 300
            || (seen.load(std::sync::atomic::Ordering::Relaxed) < 50
                && start.elapsed() < std::time::Duration::from_secs(60))
        {
            f.store.put("a", &a).unwrap();
            f.store.delete("a");
            f.store.put("b", &b).unwrap();
            f.store.delete("b");
            rounds += 1;
        }
        stop.store(true, std::sync::atomic::Ordering::Relaxed);
        reader.join().unwrap();
    });
    assert!(seen.into_inner() > 0, "the reader never found the object");
}

/// OBJ-9: the pool is bounded (half the capacity) and goes first when room is needed.
#[test]
fn the_pool_is_bounded_and_given_back_before_objects_move_obj_9() {
    // Capacity 8 MiB: the pool holds at most half, 4 MiB.
    let f = Fixture::new(8 * MIB, true);
    for id in ["a", "b", "c"] {
        f.store.put(id, &pattern(id, 2 * MIB)).unwrap();
    }
    for id in ["a", "b", "c"] {
        f.store.delete(id);
    }
    assert_eq!(f.usage().pooled_bytes, 4 * MIB);
    f.store.put("keep", &pattern("keep", MIB)).unwrap();
    // 7 MiB does not fit beside 4 MiB pooled + 1 MiB: the pool goes, not "keep".
    f.store.put("big", &pattern("big", 7 * MIB)).unwrap();
    let u = f.usage();
    assert_eq!((u.used_bytes, u.pooled_bytes, u.spilled_count), (8 * MIB, 0, 0));
    f.assert_exact("keep", MIB);
    f.assert_exact("big", 7 * MIB);
    f.store.release_pool().unwrap();
}

/// OBJ-11: a kept mapping never holds pages the ledger gave back.
#[test]
fn a_writer_keeps_its_mapping_only_while_the_file_lives_obj_11() {
    let f = Fixture::new(64 * MIB, false);
    let len = 4 * MIB;
    // The second put writes through a mapping this process then keeps; the
    // third through the kept one.
    for id in ["a", "b", "c"] {
        f.store.put(id, &pattern(id, len)).unwrap();
        f.assert_exact(id, len);
        f.store.delete(id);
    }
    // The pool is emptied while the mapping is kept: its pages go (the file
    // is truncated), and the next writes make new files, byte-exact.
    f.store.release_pool().unwrap();
    let u = f.usage();
    assert_eq!((u.used_bytes, u.pooled_bytes), (0, 0));
    for id in ["d", "e"] {
        f.store.put(id, &pattern(id, len)).unwrap();
        f.assert_exact(id, len);
        f.store.delete(id);
    }
    f.store.put("f", &pattern("f", len)).unwrap();
    f.assert_exact("f", len);
}
