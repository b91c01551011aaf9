//! The order an actor starts its calls in (CORE-4), pure: each caller's calls are
//! released by sequence number whatever order they arrive in, and an async actor's
//! calls take the places of their concurrency group on the event loop in the order they
//! were released. No locks or I/O: the executor keeps these under its mutexes, and
//! `sdk/tests/sim.rs` drives them with seeded arrival and completion orders.

use std::collections::{BTreeMap, VecDeque};

/// One caller's calls to this actor, released in sequence order (numbers start at 0 for
/// each incarnation of the actor; the caller's ordered sender numbers them).
pub struct CallerQueue<J> {
    next: u64,
    waiting: BTreeMap<u64, J>,
}

impl<J> Default for CallerQueue<J> {
    fn default() -> Self {
        Self { next: 0, waiting: BTreeMap::new() }
    }
}

impl<J> CallerQueue<J> {
    /// Call number `seq` arrived; [`CallerQueue::release`] then gives what may start.
    pub fn arrive(&mut self, seq: u64, call: J) {
        self.waiting.insert(seq, call);
    }

    /// The next call in sequence when it has arrived (call until `None`).
    pub fn release(&mut self) -> Option<J> {
        let call = self.waiting.remove(&self.next)?;
        self.next += 1;
        Some(call)
    }

    /// Calls that arrived ahead of one still missing.
    pub fn held(&self) -> usize {
        self.waiting.len()
    }
}

/// The places of one concurrency group on an async actor's event loop: at most `limit`
/// calls run at once (`max_concurrency`), the rest wait in the order they were released.
pub struct Places<J> {
    used: usize,
    waiting: VecDeque<J>,
}

impl<J> Default for Places<J> {
    fn default() -> Self {
        Self { used: 0, waiting: VecDeque::new() }
    }
}

impl<J> Places<J> {
    /// A released call wants to start: `Some` when it takes a place now (start it),
    /// `None` when it waits behind the others.
    pub fn start(&mut self, limit: usize, call: J) -> Option<J> {
        if self.used >= limit.max(1) || !self.waiting.is_empty() {
            self.waiting.push_back(call);
            return None;
        }
        self.used += 1;
        Some(call)
    }

    /// A running call ended: the call that takes its place (start it now), or `None`
    /// (the place is free again). The place passes straight to the first call waiting:
    /// were it given back first, a call released in between could take it and start
    /// ahead of the calls waiting before it (d6562ad).
    pub fn ended(&mut self) -> Option<J> {
        let next = self.waiting.pop_front();
        if next.is_none() {
            self.used = self.used.saturating_sub(1);
        }
        next
    }

    /// Calls running now.
    pub fn running(&self) -> usize {
        self.used
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn core4_calls_are_released_in_sequence_whatever_order_they_arrive_in() {
        let mut q = CallerQueue::default();
        q.arrive(2, "c");
        q.arrive(1, "b");
        assert_eq!(q.release(), None);
        q.arrive(0, "a");
        let released: Vec<_> = std::iter::from_fn(|| q.release()).collect();
        assert_eq!(released, ["a", "b", "c"]);
        assert_eq!(q.held(), 0);
    }

    #[test]
    fn core4_a_place_passes_to_the_first_call_waiting() {
        let mut p = Places::default();
        assert_eq!(p.start(1, 1), Some(1));
        assert_eq!(p.start(1, 2), None);
        assert_eq!(p.ended(), Some(2), "the waiting call takes the place");
        assert_eq!(p.start(1, 3), None, "a later call waits");
        assert_eq!(p.ended(), Some(3));
        assert_eq!(p.ended(), None);
        assert_eq!(p.running(), 0);
    }
}
