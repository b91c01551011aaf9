//! The borrower side of CORE-2 as a machine: the changes this process sends one owner
//! (a borrower registered, a borrower released), in the order they were queued. No
//! clocks, locks or I/O: `BorrowQueue` (borrowing.rs) owns one per owner under a lock,
//! sends what [`Outbox::next`] hands it and reports how the call ended.
//!
//! CORE-2 (the borrower's side): one batch is on the wire at a time (whatever queued
//! while the previous batch was out, at most `max` changes), so the owner applies a
//! process's changes in the order they were made and a release never overtakes the
//! registration before it. A batch whose call failed without an answer (a timeout, a
//! connection lost under it: the owner may or may not have applied it) is sent again,
//! whole and before anything queued after it, up to [`MAX_RESENDS`] times with a
//! doubling pause; the owner applies a batch twice to the same effect (a borrower set
//! holds a borrower once; releasing one it does not hold changes nothing). Dropping it
//! instead would lose a registration (the owner could free an object this process
//! still uses) or a release (the object would never be freed). A batch is given up
//! when it cannot be delivered (the owner's process refused the connection, so it is
//! gone with its objects, or answered with an error) or the resends are spent; either way its waiters are
//! let go. Which failure is which is the thin layer's call (`failure_of` in
//! borrowing.rs).

use std::collections::VecDeque;
use std::time::Duration;

/// Times one batch is sent again after calls that ended without an answer.
pub const MAX_RESENDS: u32 = 6;

/// The pause before the first resend; each later one doubles it (0.1 s to 3.2 s).
pub const FIRST_RESEND_PAUSE: Duration = Duration::from_millis(100);

/// How a call carrying a batch ended without the owner's answer.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Failure {
    /// The batch cannot be delivered: the owner's process refused the connection (it
    /// is gone, and its objects with it) or answered with an error (resending the same
    /// batch would get the same answer).
    Refused,
    /// No answer (a timeout, a lost connection): the owner may or may not have applied
    /// the batch.
    NoAnswer,
}

/// What the sender does after a failed call.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum AfterFailure {
    /// Wait this long, then send the same batch again ([`Outbox::next`] returns it).
    Resend(Duration),
    /// The batch is dropped; changes up to this sequence number count as done.
    GaveUp(u64),
}

/// The changes queued for one owner, the batch on the wire, and how far the owner has
/// answered. Sequence numbers count changes from 1, in the order they were queued.
#[derive(Debug)]
pub struct Outbox<U> {
    queued: VecDeque<U>,
    /// The batch on the wire (or to be sent again), and the sequence number of its last
    /// change.
    out: Option<(Vec<U>, u64)>,
    /// Failed calls of the batch out so far.
    failures: u32,
    /// The sequence number of the last change queued.
    last: u64,
    /// The sequence number of the last change answered or given up.
    done: u64,
    /// A sender is running (between the [`Outbox::push`] that started it and the
    /// [`Outbox::next`] that found nothing to send).
    sending: bool,
}

impl<U> Default for Outbox<U> {
    fn default() -> Self {
        Outbox { queued: VecDeque::new(), out: None, failures: 0, last: 0, done: 0, sending: false }
    }
}

impl<U: Clone> Outbox<U> {
    /// Queues a change; returns its sequence number and whether a sender must be started
    /// (none was running).
    pub fn push(&mut self, change: U) -> (u64, bool) {
        self.queued.push_back(change);
        self.last += 1;
        let start = !self.sending;
        self.sending = true;
        (self.last, start)
    }

    /// The batch to send now: the one out again after a failure, else up to `max`
    /// (at least one) changes taken from the queue. `None`: nothing is left, and the
    /// sender stops (the next [`Outbox::push`] starts one).
    pub fn next(&mut self, max: usize) -> Option<Vec<U>> {
        if let Some((batch, _)) = &self.out {
            return Some(batch.clone());
        }
        if self.queued.is_empty() {
            self.sending = false;
            return None;
        }
        let n = self.queued.len().min(max.max(1));
        let batch: Vec<U> = self.queued.drain(..n).collect();
        let seq = self.last - self.queued.len() as u64;
        self.out = Some((batch.clone(), seq));
        Some(batch)
    }

    /// The owner answered the batch out: returns the sequence number now done.
    pub fn answered(&mut self) -> u64 {
        if let Some((_, seq)) = self.out.take() {
            self.done = seq;
        }
        self.failures = 0;
        self.done
    }

    /// The call carrying the batch out failed: send it again after a pause, or give it
    /// up (the owner is gone, or [`MAX_RESENDS`] are spent).
    pub fn failed(&mut self, how: Failure) -> AfterFailure {
        if self.out.is_none() {
            return AfterFailure::GaveUp(self.done);
        }
        self.failures += 1;
        if how == Failure::NoAnswer && self.failures <= MAX_RESENDS {
            return AfterFailure::Resend(FIRST_RESEND_PAUSE * (1 << (self.failures - 1)));
        }
        AfterFailure::GaveUp(self.answered())
    }

    /// The sequence number of the last change answered or given up.
    pub fn done(&self) -> u64 {
        self.done
    }

    /// Whether a sender is running.
    pub fn sending(&self) -> bool {
        self.sending
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn core2_batches_go_one_at_a_time_in_queue_order() {
        let mut o = Outbox::default();
        assert_eq!(o.push('a'), (1, true));
        assert_eq!(o.push('b'), (2, false));
        assert_eq!(o.next(10), Some(vec!['a', 'b']));
        assert_eq!(o.push('c'), (3, false));
        // The batch out is sent again until it is answered; 'c' waits behind it.
        assert_eq!(o.next(10), Some(vec!['a', 'b']));
        assert_eq!(o.answered(), 2);
        assert_eq!(o.next(1), Some(vec!['c']));
        assert_eq!(o.answered(), 3);
        assert_eq!(o.next(10), None);
        assert!(!o.sending());
        assert_eq!(o.push('d'), (4, true));
    }

    #[test]
    fn core2_a_batch_without_an_answer_is_resent_then_given_up() {
        let mut o = Outbox::default();
        o.push(1);
        o.push(2);
        assert_eq!(o.next(1), Some(vec![1]));
        for k in 0..MAX_RESENDS {
            assert_eq!(
                o.failed(Failure::NoAnswer),
                AfterFailure::Resend(FIRST_RESEND_PAUSE * (1 << k))
            );
            assert_eq!(o.next(1), Some(vec![1]));
        }
        assert_eq!(o.failed(Failure::NoAnswer), AfterFailure::GaveUp(1));
        assert_eq!(o.next(1), Some(vec![2]));
        // A later batch has its own budget.
        assert_eq!(o.failed(Failure::NoAnswer), AfterFailure::Resend(FIRST_RESEND_PAUSE));
    }

    #[test]
    fn core2_a_batch_to_a_gone_owner_is_given_up_at_once() {
        let mut o = Outbox::default();
        o.push("x");
        o.next(5);
        assert_eq!(o.failed(Failure::Refused), AfterFailure::GaveUp(1));
        assert_eq!(o.done(), 1);
        assert_eq!(o.next(5), None);
    }
}
