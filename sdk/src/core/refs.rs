//! The owner's reference counts (CORE-2) as a pure table: what keeps each owned object
//! alive (refs in this process, and one per process that borrows it) and when it is to
//! be freed. It takes events (registered, a ref made or dropped here, a borrower
//! registered or released, settled) and answers with the object to free, if any; the
//! caller frees it (store copies, nested refs). No clocks, locks or I/O: `Core` keeps it
//! under a mutex, and `sdk/tests/sim.rs` drives it with seeded borrowing schedules.

use std::collections::{HashMap, HashSet};

/// What the table needs to know of an object's value: whether it is settled (a value
/// or an error, not still pending). A pending object stays while its task runs, even
/// with no refs, so that its result has somewhere to go.
pub trait Settled {
    fn settled(&self) -> bool;
}

/// One owned object with its counts; derefs to the value.
pub struct Counted<T> {
    /// Refs alive in this process plus one per borrowing process.
    refs: usize,
    /// The processes (or borrower keys) that borrow it.
    borrowers: HashSet<String>,
    value: T,
}

impl<T> Counted<T> {
    /// Refs alive in this process plus one per borrower.
    pub fn refs(&self) -> usize {
        self.refs
    }
}

impl<T> std::ops::Deref for Counted<T> {
    type Target = T;
    fn deref(&self) -> &T {
        &self.value
    }
}

impl<T> std::ops::DerefMut for Counted<T> {
    fn deref_mut(&mut self) -> &mut T {
        &mut self.value
    }
}

/// The objects one process owns, by id. Entries are boxed: a queued task's return sits
/// here, and the map's empty buckets (up to half of them after it grows) then cost a
/// pointer each, not a whole entry (issue 34's 1,000,000 queued tasks).
pub struct OwnerTable<T> {
    entries: HashMap<String, Box<Counted<T>>>,
    /// Registrations held per borrowing process (its address: a borrower key up to its
    /// `#`), so the processes to check are known without walking every entry.
    by_process: HashMap<String, usize>,
}

impl<T> Default for OwnerTable<T> {
    fn default() -> Self {
        Self { entries: HashMap::new(), by_process: HashMap::new() }
    }
}

/// The process a borrower key names: the key up to its `#` (`<address>` for the process
/// itself, `<address>#ret:<object>` for a return value handed to it).
pub fn borrower_process(key: &str) -> &str {
    key.split_once('#').map_or(key, |(address, _)| address)
}

impl<T: Settled> OwnerTable<T> {
    /// A new owned object holding one ref, which the caller's handle takes (so a
    /// result that arrives before the caller has its handle cannot free it). Replaces
    /// an entry of the same id.
    pub fn register(&mut self, id: String, value: T) {
        self.entries.insert(id, Box::new(Counted { refs: 1, borrowers: HashSet::new(), value }));
    }

    pub fn get(&self, id: &str) -> Option<&Counted<T>> {
        self.entries.get(id).map(|b| &**b)
    }

    pub fn get_mut(&mut self, id: &str) -> Option<&mut Counted<T>> {
        self.entries.get_mut(id).map(|b| &mut **b)
    }

    pub fn iter(&self) -> impl Iterator<Item = (&String, &Counted<T>)> {
        self.entries.iter().map(|(k, v)| (k, &**v))
    }

    pub fn len(&self) -> usize {
        self.entries.len()
    }

    pub fn is_empty(&self) -> bool {
        self.entries.is_empty()
    }

    /// A ref to `id` was made in this process; false when `id` is not here (freed).
    pub fn add_local(&mut self, id: &str) -> bool {
        match self.entries.get_mut(id) {
            Some(o) => {
                o.refs += 1;
                true
            }
            None => false,
        }
    }

    /// The last clone of a ref to `id` dropped in this process: the object to free when
    /// that was its last ref and it is settled.
    pub fn release_local(&mut self, id: &str) -> Option<T> {
        let o = self.entries.get_mut(id)?;
        o.refs = o.refs.saturating_sub(1);
        self.free_if_unused(id)
    }

    /// Borrower `borrower` of `id` registered (`add`) or released: (whether `id` is
    /// here, the object to free when that was its last ref). Applying the same change
    /// twice changes nothing.
    pub fn update_borrower(&mut self, id: &str, borrower: &str, add: bool) -> (bool, Option<T>) {
        let Some(o) = self.entries.get_mut(id) else { return (false, None) };
        if add {
            if o.borrowers.insert(borrower.to_string()) {
                o.refs += 1;
                *self.by_process.entry(borrower_process(borrower).to_string()).or_default() += 1;
            }
            (true, None)
        } else if o.borrowers.remove(borrower) {
            o.refs = o.refs.saturating_sub(1);
            self.forget_registration(borrower);
            (true, self.free_if_unused(id))
        } else {
            (true, None)
        }
    }

    fn forget_registration(&mut self, borrower: &str) {
        let process = borrower_process(borrower);
        if let Some(n) = self.by_process.get_mut(process) {
            *n -= 1;
            if *n == 0 {
                self.by_process.remove(process);
            }
        }
    }

    /// The processes that borrow at least one object here (their addresses).
    pub fn borrowing_processes(&self) -> Vec<String> {
        self.by_process.keys().cloned().collect()
    }

    /// The process at `address` is gone (CORE-2): every registration it held (as itself
    /// or through a return value handed to it) is dropped, as if released. Returns the
    /// objects to free, with their ids.
    pub fn drop_process(&mut self, address: &str) -> Vec<(String, T)> {
        if self.by_process.remove(address).is_none() {
            return Vec::new();
        }
        let mut unused = Vec::new();
        for (id, o) in &mut self.entries {
            let before = o.borrowers.len();
            o.borrowers.retain(|b| borrower_process(b) != address);
            let dropped = before - o.borrowers.len();
            if dropped > 0 {
                o.refs = o.refs.saturating_sub(dropped);
                unused.push(id.clone());
            }
        }
        unused.into_iter().filter_map(|id| self.free_if_unused(&id).map(|v| (id, v))).collect()
    }

    /// Changes `id`'s value with `f` (its task ended: a value, an error); the object to
    /// free when nobody holds a ref any more.
    pub fn settle(&mut self, id: &str, f: impl FnOnce(&mut T)) -> Option<T> {
        let o = self.entries.get_mut(id)?;
        f(&mut o.value);
        self.free_if_unused(id)
    }

    fn free_if_unused(&mut self, id: &str) -> Option<T> {
        let o = self.entries.get(id)?;
        if o.refs == 0 && o.value.settled() {
            self.entries.remove(id).map(|b| b.value)
        } else {
            None
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[derive(Debug, PartialEq)]
    struct V(bool);
    impl Settled for V {
        fn settled(&self) -> bool {
            self.0
        }
    }

    #[test]
    fn core2_a_gone_borrowing_process_loses_every_registration_it_held() {
        let mut t = OwnerTable::default();
        t.register("a".into(), V(true));
        t.register("b".into(), V(true));
        t.update_borrower("a", "w1:1", true);
        t.update_borrower("a", "w2:2", true);
        t.update_borrower("b", "w1:1#ret:r", true);
        assert!(t.release_local("a").is_none() && t.release_local("b").is_none());
        let mut ps = t.borrowing_processes();
        ps.sort();
        assert_eq!(ps, ["w1:1", "w2:2"]);
        // w1 is gone: "b" (held only through w1's return value) is freed; "a" stays for w2.
        let freed: Vec<String> = t.drop_process("w1:1").into_iter().map(|(id, _)| id).collect();
        assert_eq!(freed, ["b"]);
        assert_eq!(t.borrowing_processes(), ["w2:2"]);
        assert!(t.drop_process("w1:1").is_empty());
        // A release that arrives late changes nothing.
        assert_eq!(t.update_borrower("a", "w1:1", false), (true, None));
        assert_eq!(t.update_borrower("a", "w2:2", false).1, Some(V(true)));
        assert!(t.borrowing_processes().is_empty() && t.is_empty());
    }

    #[test]
    fn core2_an_object_is_freed_when_its_last_ref_or_borrower_goes_and_not_before() {
        let mut t = OwnerTable::default();
        t.register("a".into(), V(true));
        assert!(t.add_local("a"));
        assert_eq!(t.update_borrower("a", "w1", true), (true, None));
        assert!(t.release_local("a").is_none());
        assert!(t.release_local("a").is_none());
        assert_eq!(t.get("a").unwrap().refs(), 1);
        let (known, freed) = t.update_borrower("a", "w1", false);
        assert!(known && freed.is_some());
        assert!(t.is_empty());
        assert_eq!(t.update_borrower("a", "w1", true), (false, None));
        assert!(!t.add_local("a"));
    }

    #[test]
    fn core2_a_pending_object_waits_for_its_result_and_borrower_changes_are_idempotent() {
        let mut t = OwnerTable::default();
        t.register("r".into(), V(false));
        assert!(t.release_local("r").is_none(), "pending: kept for its result");
        assert_eq!(t.len(), 1);
        assert!(t.settle("r", |v| v.0 = true).is_some(), "settled with no refs: freed");
        t.register("s".into(), V(true));
        t.update_borrower("s", "w", true);
        t.update_borrower("s", "w", true);
        assert_eq!(t.get("s").unwrap().refs(), 2);
        t.update_borrower("s", "w", false);
        assert_eq!(t.update_borrower("s", "w", false), (true, None));
        assert!(t.release_local("s").is_some());
    }
}
