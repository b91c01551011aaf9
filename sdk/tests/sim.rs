//! Deterministic simulation of the core worker's pure state machines (issue 22): seeded
//! schedules drive the production code of `tpuray::core::retry` (what becomes of a task
//! or actor call after each attempt), `tpuray::core::pipeline` (how many leases a
//! scheduling class asks for and how many tasks a leased worker holds),
//! `tpuray::core::refs` (the owner's reference counts under the borrowing protocol),
//! `tpuray::core::outbox` (a borrower's batches of changes to an owner),
//! `tpuray::core::transfer` (which copy each pulling node copies from) and
//! `tpuray::core::actor_order` (the order an actor releases and starts calls), with
//! events reordered, replies and changes duplicated and lost, workers and nodes dying and
//! tasks blocking on one another at any step, and check the invariants after every step.
//! Four regression cases replay the event sequences of bugs, against the old logic
//! (which breaks) and the production one: three found before by flaky multi-process
//! tests, the lease that waited for ever for a handed-back task (da44a84), the
//! blocked-thread deadlock (a0b60fe) and async actor calls starting out of order
//! (d6562ad), and one found reading the code, borrower changes dropped when their call
//! went unanswered (`tpuray::core::outbox`).
//!
//! Run: `cargo test -p tpuray --test sim -- --nocapture` prints
//! `sim: <N> schedules, <F> failures`; a failing schedule prints its seed, and
//! `TPURAY_SIM_SEED=<s>` replays just that seed (every machine) with a step trace.
//! `TPURAY_SIM_SCHEDULES=<n>` changes how many schedules each machine runs (default
//! 6,000, 30,000 in all). Seeds are fixed, so CI runs the same schedules every time.
//!
//! What is checked (the numbers are ARCHITECTURE.md's):
//! - CORE-5: a task or call is run again only while its retry budget lasts (never more
//!   than `max_retries` extra attempts; unlimited stays unlimited), application errors
//!   only with `retry_exceptions` and never when marked not retryable;
//! - CORE-12: a cancelled task or call is never run again and fails `Cancelled`;
//! - every submitted task or call ends (finished, or failed with an error) once the
//!   failures stop: nothing is lost or left waiting;
//! - CORE-3/CORE-9: a class never holds or asks for more than `MAX_LEASES_PER_CLASS`
//!   leases, a queued task always has a lease that can take it or a lease request on
//!   its way (no deadlock, even when a running task blocks on a task queued behind it),
//!   and every lease is returned once the queue drains (no lease leaked);
//! - CORE-2: no object is freed while any process (owner or borrower) holds a ref, and
//!   nothing is left in the owner's table once every ref is dropped, with borrowers'
//!   batches of changes (`tpuray::core::outbox`) lost or applied twice and resent;
//! - CORE-4: an actor's calls start in each caller's sequence order, within the
//!   group's concurrency limit, and every one starts and ends;
//! - OBJ-8: at most `MAX_PULLS_PER_SOURCE` pulls from one copy at once, one pull per
//!   node at a time, and every process on a live node gets the object while a copy
//!   survives.

use std::collections::VecDeque;
use std::io::Write;
use std::time::Instant;

use tpuray_proto::pb;

use tpuray::core::actor_order::{CallerQueue, Places};
use tpuray::core::outbox::{AfterFailure, Failure, MAX_RESENDS, Outbox};
use tpuray::core::pipeline::{self, MAX_LEASES_PER_CLASS};
use tpuray::core::refs::{OwnerTable, Settled};
use tpuray::core::retry::{self, Attempt, Decision, MAX_UNDELIVERED_RESENDS, Outcome, Work};
use tpuray::core::transfer::{MAX_PULLS_PER_SOURCE, Pulls};

/// A small seeded generator (splitmix64): the whole schedule follows from the seed.
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }
    fn below(&mut self, n: u64) -> u64 {
        self.next() % n.max(1)
    }
    fn chance(&mut self, percent: u64) -> bool {
        self.below(100) < percent
    }
}

/// One failed schedule: what broke, and the steps that led there.
type SimResult = Result<(), String>;

/// A machine's schedule: run the one a seed names (with a step trace when asked).
type Schedule = fn(u64, bool) -> SimResult;

// ---- the retry machine -------------------------------------------------------------

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum End {
    Finished,
    Failed,
    Cancelled,
}

/// A task or actor call as its owner tracks it, with what the model expects of it.
#[derive(Debug)]
struct Work1 {
    work: Work,
    max_retries: i32,
    retry_exceptions: bool,
    retries_left: i32,
    cancelled: bool,
    undelivered: u32,
    /// Attempts run again after a failure (counted against `max_retries`).
    retried: i32,
    /// The attempt number replies must carry; a reply of an older one is stale.
    attempt: u32,
    end: Option<End>,
    /// Finished with a stored return that a node death may lose (CORE-6).
    stored: bool,
}

/// A reply on its way to the owner: for which item and attempt, and how it ended.
#[derive(Clone, Copy, Debug)]
struct Reply {
    item: usize,
    attempt: u32,
    outcome: Outcome,
}

/// The outcome the model draws for an attempt while failures are on (`stormy`), or the
/// successful one once they stop.
fn draw_outcome(rng: &mut Rng, work: Work, stormy: bool) -> Outcome {
    if !stormy {
        return Outcome::Returned;
    }
    match rng.below(6) {
        0 => Outcome::Returned,
        1 => Outcome::Raised { application: rng.chance(80), no_retry: rng.chance(20) },
        2 if work == Work::Task => Outcome::HandedBack,
        3 => Outcome::Lost { reached: work == Work::Task || rng.chance(50) },
        _ => Outcome::Lost { reached: true },
    }
}

/// One schedule of the retry machine: items submitted, attempts answered in a random
/// order (replies reordered, duplicated, lost with their worker), cancellations and
/// node deaths losing stored returns at random steps, then the failures stop and every
/// item must end.
fn retry_schedule(seed: u64, trace: bool) -> SimResult {
    let mut rng = Rng(seed);
    let n = 1 + rng.below(8) as usize;
    let mut items: Vec<Work1> = (0..n)
        .map(|_| {
            let max_retries = rng.below(5) as i32 - 1; // -1 (unlimited) .. 3
            Work1 {
                work: if rng.chance(50) { Work::Task } else { Work::ActorCall },
                max_retries,
                retry_exceptions: rng.chance(50),
                retries_left: max_retries,
                cancelled: false,
                undelivered: 0,
                retried: 0,
                attempt: 0,
                end: None,
                stored: false,
            }
        })
        .collect();
    let mut wire: Vec<Reply> = Vec::new();
    let stormy_steps = 5 + rng.below(60);
    for (i, it) in items.iter().enumerate() {
        let outcome = draw_outcome(&mut rng, it.work, true);
        wire.push(Reply { item: i, attempt: 0, outcome });
    }
    let mut step = 0u64;
    loop {
        step += 1;
        if step > 100_000 {
            return Err(format!("retry: no end after {step} steps: {items:?}"));
        }
        let stormy = step < stormy_steps;
        // Occasional events besides replies: a cancel, or a node death losing the
        // stored returns of a finished task.
        if stormy && rng.chance(5) {
            let i = rng.below(n as u64) as usize;
            if items[i].end.is_none() && !items[i].cancelled {
                items[i].cancelled = true;
                if trace {
                    eprintln!("step {step}: cancel item {i}");
                }
            }
        }
        if stormy && rng.chance(5) {
            let i = rng.below(n as u64) as usize;
            if items[i].end == Some(End::Finished) && items[i].stored {
                let it = &mut items[i];
                let a = Attempt {
                    work: it.work,
                    retries_left: it.retries_left,
                    retry_exceptions: it.retry_exceptions,
                    cancelled: false,
                    undelivered: 0,
                };
                let d = retry::decide(&a, Outcome::ReturnsLost);
                if trace {
                    eprintln!("step {step}: item {i}'s stored returns lost: {d:?}");
                }
                match d {
                    Decision::Retry { retries_left } => {
                        check_retry(i, it, retries_left)?;
                        it.end = None;
                        it.stored = false;
                        it.attempt += 1;
                        let outcome = draw_outcome(&mut rng, it.work, stormy);
                        wire.push(Reply { item: i, attempt: it.attempt, outcome });
                    }
                    Decision::Fail => {
                        if it.retries_left != 0 {
                            return Err(format!(
                                "retry: item {i}'s lost returns failed with retries left: {it:?}"
                            ));
                        }
                        it.end = Some(End::Failed);
                    }
                    other => return Err(format!("retry: lost returns decided {other:?}")),
                }
            }
        }
        if wire.is_empty() {
            break;
        }
        // Any reply may come next (reordering); some are duplicated or dropped with
        // their connection (then the owner sees the connection break instead).
        let k = rng.below(wire.len() as u64) as usize;
        let mut r = wire.swap_remove(k);
        if stormy && rng.chance(5) {
            wire.push(r);
        }
        if stormy && rng.chance(5) {
            r.outcome = Outcome::Lost { reached: true };
        }
        let it = &mut items[r.item];
        if r.attempt != it.attempt || it.end.is_some() {
            continue; // stale or duplicated: the owner no longer waits for it
        }
        let a = Attempt {
            work: it.work,
            retries_left: it.retries_left,
            retry_exceptions: it.retry_exceptions,
            cancelled: it.cancelled,
            undelivered: it.undelivered,
        };
        let d = retry::decide(&a, r.outcome);
        if trace {
            eprintln!(
                "step {step}: item {} attempt {}: {:?} -> {d:?}",
                r.item, r.attempt, r.outcome
            );
        }
        // CORE-12 first: a cancelled item ends cancelled, whatever came back.
        if it.cancelled && d != Decision::FailCancelled {
            return Err(format!("retry: cancelled item {} decided {d:?}", r.item));
        }
        match d {
            Decision::FailCancelled => it.end = Some(End::Cancelled),
            Decision::Finish => {
                if r.outcome != Outcome::Returned {
                    return Err(format!("retry: finished after {:?}", r.outcome));
                }
                it.end = Some(End::Finished);
                it.stored = it.work == Work::Task && rng.chance(50) && it.retries_left != 0;
            }
            Decision::Requeue | Decision::Resend => {
                let ok = match d {
                    Decision::Requeue => it.work == Work::Task && r.outcome == Outcome::HandedBack,
                    _ => {
                        it.work == Work::ActorCall
                            && r.outcome == Outcome::Lost { reached: false }
                            && it.undelivered < MAX_UNDELIVERED_RESENDS
                    }
                };
                if !ok {
                    return Err(format!("retry: {d:?} of {it:?} after {:?}", r.outcome));
                }
                if d == Decision::Resend {
                    it.undelivered += 1;
                }
                it.attempt += 1;
                let outcome = draw_outcome(&mut rng, it.work, stormy);
                wire.push(Reply { item: r.item, attempt: it.attempt, outcome });
            }
            Decision::Retry { retries_left } => {
                let retryable = match r.outcome {
                    Outcome::Raised { application, no_retry } => {
                        application && !no_retry && it.retry_exceptions
                    }
                    Outcome::Lost { .. } => true,
                    _ => false,
                };
                if !retryable {
                    return Err(format!("retry: retried after {:?}: {it:?}", r.outcome));
                }
                check_retry(r.item, it, retries_left)?;
                it.undelivered = 0;
                it.attempt += 1;
                let outcome = draw_outcome(&mut rng, it.work, stormy);
                wire.push(Reply { item: r.item, attempt: it.attempt, outcome });
            }
            Decision::Fail => {
                // A failure with retries left is only right for an error that is not
                // retried, or an actor call unreachable past the cap.
                let must = match r.outcome {
                    Outcome::Raised { application, no_retry } => {
                        !(application && !no_retry && it.retry_exceptions) || it.retries_left == 0
                    }
                    Outcome::Lost { reached: false } if it.work == Work::ActorCall => {
                        it.undelivered >= MAX_UNDELIVERED_RESENDS
                    }
                    Outcome::Lost { .. } => it.retries_left == 0,
                    _ => false,
                };
                if !must {
                    return Err(format!("retry: failed after {:?} with budget: {it:?}", r.outcome));
                }
                it.end = Some(End::Failed);
            }
        }
    }
    // Every item ended: nothing lost, nothing waiting.
    if let Some((i, it)) = items.iter().enumerate().find(|(_, it)| it.end.is_none()) {
        return Err(format!("retry: item {i} never ended: {it:?}"));
    }
    Ok(())
}

/// CORE-5: one more attempt, within the budget, and the budget spent by one (unlimited
/// stays unlimited).
fn check_retry(i: usize, it: &mut Work1, retries_left: i32) -> SimResult {
    it.retried += 1;
    if it.max_retries >= 0 && it.retried > it.max_retries {
        return Err(format!("retry: item {i} ran {} extra attempts: {it:?}", it.retried));
    }
    let expected = if it.retries_left < 0 { it.retries_left } else { it.retries_left - 1 };
    if retries_left != expected {
        return Err(format!("retry: item {i} left {retries_left} retries, not {expected}"));
    }
    it.retries_left = retries_left;
    Ok(())
}

// ---- the lease pool of one scheduling class -----------------------------------------

/// A task of the class: it runs, and may block on another task of the class (a nested
/// `get`) until that one finishes.
#[derive(Clone, Copy, Debug)]
struct SimTask {
    waits_for: Option<usize>,
    done: bool,
}

/// A leased worker: the tasks pushed to it (the first runs; the rest wait behind it),
/// whether its running task is blocked, and whether it handed tasks back (it takes no
/// more until what it holds is answered).
#[derive(Debug, Default)]
struct Lease {
    held: VecDeque<usize>,
    blocked: bool,
    handing_back: bool,
}

/// An attempt of a task of the lease pool, as `retry::decide` sees it.
const TASK: Attempt = Attempt {
    work: Work::Task,
    retries_left: 0,
    retry_exceptions: false,
    cancelled: false,
    undelivered: 0,
};

/// How many leases the class wants: the production rule, or the one before da44a84.
type Wanted = fn(usize, usize, usize, usize) -> usize;

/// The rule before da44a84: a stalled lease was not counted, so a task handed back by
/// a worker whose running task waits for it could wait for ever.
fn leases_wanted_before_da44a84(queued: usize, in_flight: usize, _: usize, per: usize) -> usize {
    if queued == 0 {
        return 0;
    }
    (queued + in_flight).div_ceil(per.max(1)).clamp(1, MAX_LEASES_PER_CLASS)
}

struct Pool {
    tasks: Vec<SimTask>,
    queue: VecDeque<usize>,
    leases: Vec<Lease>,
    /// Lease requests waiting for the agent (they count as leases the class holds).
    asking: usize,
    /// CPUs of the node free for another worker (a blocked worker lends its CPU back,
    /// AGENT-11).
    free_cpus: usize,
    fixed: Option<usize>,
    push_us: u64,
    shallow_until: u64,
    now: u64,
    wanted: Wanted,
    trace: bool,
}

impl Pool {
    fn in_flight(&self) -> usize {
        self.leases.iter().map(|l| l.held.len()).sum()
    }
    fn stalled(&self) -> usize {
        self.leases.iter().filter(|l| l.handing_back).count()
    }

    /// The owner's `ensure_leases`: ask for leases up to what the class wants.
    fn ensure_leases(&mut self) -> SimResult {
        let per_lease = self.fixed.unwrap_or(1);
        loop {
            let want = (self.wanted)(self.queue.len(), self.in_flight(), self.stalled(), per_lease);
            let cur = self.leases.len() + self.asking;
            if self.queue.is_empty() || cur >= want {
                break;
            }
            self.asking += 1;
        }
        if self.leases.len() + self.asking > MAX_LEASES_PER_CLASS {
            return Err(format!(
                "leases: {} held and {} asked for, above {MAX_LEASES_PER_CLASS}",
                self.leases.len(),
                self.asking
            ));
        }
        Ok(())
    }

    /// The owner's `run_on_worker` top-up: push queued tasks to lease `l` while its
    /// pipeline has room.
    fn push(&mut self, l: usize) -> SimResult {
        let lease = &self.leases[l];
        let depth = if lease.handing_back {
            1
        } else {
            pipeline::depth(self.fixed, self.push_us, self.asking, self.now, self.shallow_until)
        };
        let top_up = pipeline::top_up(depth, lease.held.len());
        while self.leases[l].held.len() + top_up <= depth {
            let Some(t) = self.queue.pop_front() else { break };
            self.leases[l].held.push_back(t);
        }
        if self.leases[l].blocked {
            // A worker blocked in get takes nothing new (QueuedTask::reply).
            self.hand_back(l)?;
        }
        Ok(())
    }

    /// The worker of lease `l` hands back every task queued behind its running one
    /// (CORE-9: it is blocked); each is decided as handed back and queued again first.
    fn hand_back(&mut self, l: usize) -> SimResult {
        let behind: Vec<usize> = self.leases[l].held.drain(1..).collect();
        if behind.is_empty() {
            return Ok(());
        }
        self.leases[l].handing_back = true;
        self.shallow_until = self.now + 50;
        for &t in behind.iter().rev() {
            if retry::decide(&TASK, Outcome::HandedBack) != Decision::Requeue {
                return Err("leases: a handed-back task was not requeued".into());
            }
            self.queue.push_front(t);
        }
        if self.trace {
            eprintln!("  lease {l} handed back {behind:?}");
        }
        self.ensure_leases()
    }

    fn check(&self, step: u64) -> SimResult {
        let queued_or_held: usize = self.queue.len() + self.in_flight();
        let open = self.tasks.iter().filter(|t| !t.done).count();
        if queued_or_held != open {
            return Err(format!(
                "leases: step {step}: {open} tasks unfinished but {queued_or_held} queued or held"
            ));
        }
        Ok(())
    }
}

/// One schedule of a class's lease pool on a node of a few CPUs: tasks (some blocking on
/// a later task of the class) are submitted over time; lease grants, task completions,
/// blocks and lingering leases' returns happen in a random order; a worker whose
/// running task blocks hands back what waits behind it (CORE-9). Ends when nothing can
/// happen: then every task must be done and every lease returned.
fn lease_schedule(seed: u64, wanted: Wanted, trace: bool) -> SimResult {
    let mut rng = Rng(seed);
    let cpus = 1 + rng.below(4) as usize;
    let fixed = if rng.chance(50) { Some(1 + rng.below(4) as usize) } else { None };
    let total = 1 + rng.below(24) as usize;
    let mut pool = Pool {
        tasks: Vec::new(),
        queue: VecDeque::new(),
        leases: Vec::new(),
        asking: 0,
        free_cpus: cpus,
        fixed,
        push_us: if rng.chance(70) { 50 + rng.below(1_000) } else { 5_000 },
        shallow_until: 0,
        now: 0,
        wanted,
        trace,
    };
    let mut step = 0u64;
    loop {
        step += 1;
        pool.now += 1;
        if step > 200_000 {
            return Err("leases: no end after 200,000 steps".into());
        }
        // What can happen now.
        let mut events: Vec<(u8, usize)> = Vec::new();
        if pool.tasks.len() < total {
            events.push((0, 0)); // submit
        }
        if pool.asking > 0 && pool.free_cpus > 0 {
            events.push((1, 0)); // a lease request granted
        }
        for (l, lease) in pool.leases.iter().enumerate() {
            match lease.held.front() {
                Some(&t) => {
                    let waits = pool.tasks[t]
                        .waits_for
                        .filter(|&w| pool.tasks.get(w).is_none_or(|x| !x.done));
                    match (waits, lease.blocked) {
                        (None, _) => events.push((2, l)), // runs to the end (or unblocks)
                        (Some(_), false) => events.push((3, l)), // blocks
                        (Some(_), true) => {}             // waits for its task
                    }
                }
                None if pool.queue.is_empty() => events.push((4, l)), // linger ends
                None => {}
            }
        }
        if events.is_empty() {
            break;
        }
        let (kind, l) = events[rng.below(events.len() as u64) as usize];
        match kind {
            0 => {
                let id = pool.tasks.len();
                // A task that blocks waits for one submitted after it (as a nested
                // task's caller does), when more are to come.
                let waits_for = (id + 1 < total && rng.chance(30)).then_some(id + 1);
                pool.tasks.push(SimTask { waits_for, done: false });
                pool.queue.push_back(id);
                if trace {
                    eprintln!("step {step}: submit task {id} (waits for {waits_for:?})");
                }
                pool.ensure_leases()?;
                for l in 0..pool.leases.len() {
                    pool.push(l)?;
                }
            }
            1 => {
                pool.asking -= 1;
                pool.free_cpus -= 1;
                pool.leases.push(Lease::default());
                let l = pool.leases.len() - 1;
                pool.push(l)?;
                if trace {
                    eprintln!("step {step}: lease {l} granted, holds {:?}", pool.leases[l].held);
                }
                pool.ensure_leases()?;
            }
            2 => {
                let lease = &mut pool.leases[l];
                if lease.blocked {
                    lease.blocked = false;
                    pool.free_cpus = pool.free_cpus.saturating_sub(1);
                }
                let t = lease.held.pop_front().expect("a held task");
                pool.tasks[t].done = true;
                // retry::decide of a returned attempt finishes it.
                if retry::decide(&TASK, Outcome::Returned) != Decision::Finish {
                    return Err("leases: a returned task was not finished".into());
                }
                if lease.held.is_empty() && lease.handing_back {
                    lease.handing_back = false;
                }
                if trace {
                    eprintln!("step {step}: task {t} done on lease {l}");
                }
                pool.push(l)?;
                pool.ensure_leases()?;
            }
            3 => {
                // The running task blocks in get: the worker lends its CPU back and hands
                // back every task queued behind it (the executor, CORE-9).
                pool.leases[l].blocked = true;
                pool.free_cpus += 1;
                if trace {
                    eprintln!("step {step}: lease {l}'s task blocks");
                }
                pool.hand_back(l)?;
                pool.ensure_leases()?;
                for l in 0..pool.leases.len() {
                    pool.push(l)?;
                }
            }
            _ => {
                pool.leases.remove(l);
                pool.free_cpus += 1;
                if trace {
                    eprintln!("step {step}: lease {l} returned (lingered)");
                }
            }
        }
        pool.check(step)?;
    }
    if let Some(t) = pool.tasks.iter().position(|t| !t.done) {
        return Err(format!(
            "leases: stuck with task {t} unfinished: queue {:?}, leases {:?}, {} asked for, {} CPUs free",
            pool.queue, pool.leases, pool.asking, pool.free_cpus
        ));
    }
    if !pool.leases.is_empty() || pool.asking > 0 {
        return Err(format!("leases: {} leases leaked, {} asks", pool.leases.len(), pool.asking));
    }
    Ok(())
}

// ---- ownership and borrowing (CORE-2) -----------------------------------------------

/// An owned object's value as the table sees it: pending until its task ends.
struct SimObj {
    settled: bool,
}

impl Settled for SimObj {
    fn settled(&self) -> bool {
        self.settled
    }
}

/// A borrower change on its way from a borrower to the owner.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct Change {
    object: usize,
    add: bool,
}

/// A process that borrows the owner's objects: its counted refs to each, whether the
/// owner counts it as a borrower of each (registered), and its changes to the owner in
/// the production [`Outbox`] (one per owner, as `BorrowQueue` keeps it).
#[derive(Default)]
struct Borrower {
    refs: Vec<usize>,
    /// Of those, the refs it kept after a task (the rest are held by running tasks).
    kept: Vec<usize>,
    registered: Vec<bool>,
    outbox: Outbox<Change>,
    /// The sequence number of the last change queued for each object.
    last_seq: Vec<u64>,
    /// The batch on the wire (sent, not yet answered or lost).
    wire: Option<Vec<Change>>,
    /// Calls in a row that carried the batch out and went unanswered.
    unanswered: u32,
}

impl Borrower {
    /// A counted ref made here (CORE-2: the first registers this process with the owner).
    fn take(&mut self, o: usize) {
        self.refs[o] += 1;
        if self.refs[o] == 1 && !self.registered[o] {
            self.registered[o] = true;
            self.last_seq[o] = self.outbox.push(Change { object: o, add: true }).0;
        }
    }

    /// The last clone of a counted ref dropped here: released behind the registration.
    fn drop_ref(&mut self, o: usize) {
        self.refs[o] -= 1;
        if self.refs[o] == 0 && self.registered[o] {
            self.registered[o] = false;
            self.last_seq[o] = self.outbox.push(Change { object: o, add: false }).0;
        }
    }

    /// Whether the owner has applied every change this process queued for `o`: an
    /// executor waits for that before it replies (`confirm_borrows`).
    fn confirmed(&self, o: usize) -> bool {
        self.outbox.done() >= self.last_seq[o]
    }
}

/// A task carrying a ref to `object` from `from` (the owner: `None`) to borrower `to`,
/// pinned by its sender until it replies.
#[derive(Clone, Copy, Debug)]
struct Carry {
    object: usize,
    from: Option<usize>,
    to: usize,
    /// The receiver deserialized the ref (and queued its registration).
    arrived: bool,
}

/// One schedule of the borrowing protocol against the owner's `OwnerTable`: the owner
/// makes objects (some pending until their task ends), clones and drops refs, passes
/// refs into tasks on borrowers, borrowers pass them on to each other and keep or drop
/// them, and each borrower's changes go out in batches from its [`Outbox`] and reach the
/// owner in order but interleaved with the others' at random. While the storm lasts a
/// call carrying a batch may go unanswered, lost on its way or applied with its answer
/// lost (so the resent batch is applied twice), up to the outbox's resend budget in a
/// row: an owner that lives answers within it (a batch given up is a failure here).
/// After every step: an object is freed only when no process holds a ref to it (the
/// owner's refs and pins and every borrower's, the ground truth kept here); at the end,
/// with every ref dropped, nothing is left in the table (no leak).
///
/// Not modelled: a borrower that dies without releasing (the owner's check drops its
/// registrations, `OwnerTable::drop_process`, unit-tested in `refs.rs` and end to end in
/// `tests/tests/core.rs`).
fn ownership_schedule(seed: u64, trace: bool) -> SimResult {
    borrowing_schedule(seed, Unanswered::Resent, trace)
}

/// What a borrower's sender does with a batch whose call went unanswered.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Unanswered {
    /// Production: the outbox sends it again ([`Outbox::failed`]).
    Resent,
    /// Before the outbox: the batch counted as done and was dropped.
    Dropped,
}

/// [`ownership_schedule`] with the given handling of unanswered batches.
fn borrowing_schedule(seed: u64, unanswered_batch: Unanswered, trace: bool) -> SimResult {
    let mut rng = Rng(seed);
    let nb = 1 + rng.below(3) as usize;
    let max_objects = 1 + rng.below(6) as usize;
    let mut table: OwnerTable<SimObj> = OwnerTable::default();
    // Ground truth: the owner's counted refs (handles and pins) and whether each
    // object was freed.
    let mut owner_refs: Vec<usize> = Vec::new();
    // Of those, the pins of tasks in flight (the rest are handles the program holds).
    let mut owner_pins: Vec<usize> = Vec::new();
    let mut freed: Vec<bool> = Vec::new();
    let mut borrowers: Vec<Borrower> = (0..nb).map(|_| Borrower::default()).collect();
    let mut carries: Vec<Carry> = Vec::new();
    let mut step = 0u64;
    let stormy_steps = 20 + rng.below(200);
    loop {
        step += 1;
        if step > 100_000 {
            return Err("ownership: no end after 100,000 steps".into());
        }
        let stormy = step < stormy_steps;
        let objects = owner_refs.len();
        // What can happen now: (kind, a, b).
        let mut ev: Vec<(u8, usize, usize)> = Vec::new();
        if stormy && objects < max_objects {
            ev.push((0, 0, 0)); // create
        }
        for o in 0..objects {
            if freed[o] {
                continue;
            }
            if owner_refs[o] > owner_pins[o] {
                ev.push((2, o, 0)); // owner drops a ref (a handle or its clone)
                if stormy {
                    ev.push((1, o, 0)); // owner clones a counted ref
                    ev.push((5, o, rng.below(nb as u64) as usize)); // pass into a task
                }
            }
            if table.get(&o.to_string()).is_some_and(|e| !e.settled) {
                ev.push((3, o, 0)); // its task ends
            }
            for (b, br) in borrowers.iter().enumerate() {
                if br.kept[o] > 0 {
                    ev.push((8, o, b)); // a borrower drops a ref it kept
                }
                if br.refs[o] > 0 && stormy && nb > 1 {
                    ev.push((9, o, b)); // passes it on to another borrower
                }
            }
        }
        for (b, br) in borrowers.iter().enumerate() {
            if br.wire.is_none() && br.outbox.sending() {
                ev.push((6, b, 0)); // the borrower's sender sends its next batch
            }
            if br.wire.is_some() {
                ev.push((11, b, 0)); // the call carrying it ends
            }
        }
        for (i, c) in carries.iter().enumerate() {
            if !c.arrived {
                ev.push((7, i, 0)); // the task runs: the ref is deserialized
            } else if borrowers[c.to].confirmed(c.object) {
                ev.push((10, i, 0)); // the task replies
            }
        }
        if ev.is_empty() {
            break;
        }
        let (kind, a, b) = ev[rng.below(ev.len() as u64) as usize];
        if trace {
            let what = match kind {
                0 => "the owner makes an object".to_string(),
                1 => format!("the owner clones a ref to object {a}"),
                2 => format!("the owner drops a ref to object {a}"),
                3 => format!("object {a}'s task ends"),
                5 => format!("the owner passes object {a} into a task on b{b}"),
                6 => format!("b{a}'s sender sends its next batch"),
                7 => format!("task {a} runs: its ref is deserialized"),
                8 => format!("b{b} drops a ref to object {a} it kept"),
                9 => format!("b{b} passes object {a} into a task on another borrower"),
                10 => format!("task {a} replies"),
                _ => format!("the call carrying b{a}'s batch ends"),
            };
            eprintln!("step {step}: {what}");
        }
        let id = |o: usize| o.to_string();
        let mut free_now: Vec<(usize, Option<SimObj>)> = Vec::new();
        match kind {
            0 => {
                let o = owner_refs.len();
                table.register(id(o), SimObj { settled: rng.chance(50) });
                owner_refs.push(1);
                owner_pins.push(0);
                freed.push(false);
                for br in &mut borrowers {
                    br.refs.push(0);
                    br.kept.push(0);
                    br.registered.push(false);
                    br.last_seq.push(0);
                }
            }
            1 => {
                owner_refs[a] += 1;
                if !table.add_local(&id(a)) {
                    return Err(format!("ownership: object {a} was freed under a live ref"));
                }
            }
            2 => {
                owner_refs[a] -= 1;
                free_now.push((a, table.release_local(&id(a))));
            }
            3 => free_now.push((a, table.settle(&id(a), |v| v.settled = true))),
            5 => {
                // The owner pins the argument while the task is in flight.
                owner_refs[a] += 1;
                owner_pins[a] += 1;
                table.add_local(&id(a));
                carries.push(Carry { object: a, from: None, to: b, arrived: false });
            }
            6 => {
                let max = 1 + rng.below(3) as usize;
                borrowers[a].wire = borrowers[a].outbox.next(max);
            }
            11 => {
                let br = &mut borrowers[a];
                let batch = br.wire.take().expect("a batch on the wire");
                let unanswered = stormy && br.unanswered < MAX_RESENDS && rng.chance(20);
                if !unanswered || rng.chance(50) {
                    for c in batch {
                        let (_, f) = table.update_borrower(&id(c.object), &format!("b{a}"), c.add);
                        free_now.push((c.object, f));
                    }
                }
                if unanswered && unanswered_batch == Unanswered::Dropped {
                    br.outbox.answered();
                } else if unanswered {
                    br.unanswered += 1;
                    if let AfterFailure::GaveUp(_) = br.outbox.failed(Failure::NoAnswer) {
                        return Err(format!(
                            "ownership: step {step}: b{a} gave up a batch after {} calls without an answer",
                            br.unanswered
                        ));
                    }
                } else {
                    br.unanswered = 0;
                    br.outbox.answered();
                }
            }
            7 => {
                carries[a].arrived = true;
                let c = carries[a];
                borrowers[c.to].take(c.object);
            }
            8 => {
                borrowers[b].kept[a] -= 1;
                borrowers[b].drop_ref(a);
            }
            9 => {
                // Borrower b passes its ref into a task on another borrower: it pins it
                // (its own counted ref) until that task replies.
                let to = (b + 1 + rng.below(nb as u64 - 1) as usize) % nb;
                borrowers[b].take(a);
                carries.push(Carry { object: a, from: Some(b), to, arrived: false });
            }
            _ => {
                let c = carries.swap_remove(a);
                // The receiver keeps the ref (an actor's state) or drops it with the task.
                if stormy && rng.chance(40) {
                    borrowers[c.to].kept[c.object] += 1;
                } else {
                    borrowers[c.to].drop_ref(c.object);
                }
                match c.from {
                    None => {
                        owner_refs[c.object] -= 1;
                        owner_pins[c.object] -= 1;
                        free_now.push((c.object, table.release_local(&id(c.object))));
                    }
                    Some(from) => borrowers[from].drop_ref(c.object),
                }
            }
        }
        for (o, f) in free_now {
            if f.is_none() {
                continue;
            }
            freed[o] = true;
            let holders: Vec<usize> = (0..nb).filter(|&b| borrowers[b].refs[o] > 0).collect();
            if owner_refs[o] > 0 || !holders.is_empty() {
                return Err(format!(
                    "ownership: step {step}: object {o} freed while held (owner refs {}, borrowers {holders:?})",
                    owner_refs[o]
                ));
            }
        }
    }
    // Everything dropped and delivered: nothing left in the owner's table.
    if !table.is_empty() {
        let left: Vec<String> =
            table.iter().map(|(k, e)| format!("{k}({} refs)", e.refs())).collect();
        return Err(format!("ownership: leaked after every ref dropped: {left:?}"));
    }
    Ok(())
}

/// CORE-2 regression: `BorrowQueue::send_all` dropped a batch whose `UpdateBorrowers`
/// call failed (a timeout, a lost connection) and counted it done, so a registration
/// the owner never applied let it free an object a borrower still used (and a lost
/// release leaked one). Replayed against the old sender (some seed frees an object
/// while held) and the production outbox, which resends the batch (none does).
#[test]
fn core2_a_borrower_batch_without_an_answer_is_sent_again() {
    let broken = (0..5_000)
        .map(|i| seed(17, i))
        .find(|&s| borrowing_schedule(s, Unanswered::Dropped, false).is_err());
    let s = broken.expect("dropping unanswered batches frees a held object in some schedule");
    assert_eq!(borrowing_schedule(s, Unanswered::Resent, false), Ok(()), "seed {s}");
}

// ---- the order an actor starts its calls in (CORE-4) ----------------------------------

/// The places of a concurrency group as they worked before d6562ad: an ended call gave
/// its place back first, and the call waiting first was started again afterwards, so a
/// call released in between could take the place (and the waiter went to the back).
#[derive(Default)]
struct PlacesBeforeD6562ad {
    used: usize,
    waiting: VecDeque<(usize, u64)>,
}

/// A call: (its caller, its sequence number).
type Call = (usize, u64);

/// The group's places, production (`Places`) or as before d6562ad.
enum Group {
    Now(Places<Call>),
    Before(PlacesBeforeD6562ad),
}

impl Group {
    fn start(&mut self, limit: usize, call: (usize, u64)) -> Option<(usize, u64)> {
        match self {
            Group::Now(p) => p.start(limit, call),
            Group::Before(p) => {
                if p.used >= limit {
                    p.waiting.push_back(call);
                    return None;
                }
                p.used += 1;
                Some(call)
            }
        }
    }

    /// A call ended: (the call to start now, the call to offer its place again later).
    fn ended(&mut self) -> (Option<Call>, Option<Call>) {
        match self {
            Group::Now(p) => (p.ended(), None),
            Group::Before(p) => {
                p.used -= 1;
                (None, p.waiting.pop_front())
            }
        }
    }
}

/// One schedule of an async actor's calls: a few callers each send numbered calls,
/// which arrive in any order (each push is its own RPC); each caller's queue releases
/// them in sequence, and they take the group's places (`limit` of them) in release
/// order; running calls end at random, interleaved with arrivals. Checked: no call
/// starts before one released ahead of it (CORE-4: per caller, in sequence), never more
/// than `limit` run, and every call starts and ends.
fn actor_order_schedule(seed: u64, before_fix: bool, trace: bool) -> SimResult {
    let mut rng = Rng(seed);
    let callers = 1 + rng.below(3) as usize;
    let calls: Vec<u64> = (0..callers).map(|_| 1 + rng.below(8)).collect();
    let limit = 1 + rng.below(3) as usize;
    let mut queues: Vec<CallerQueue<(usize, u64)>> =
        (0..callers).map(|_| CallerQueue::default()).collect();
    let mut group = if before_fix {
        Group::Before(PlacesBeforeD6562ad::default())
    } else {
        Group::Now(Places::default())
    };
    let mut in_flight: Vec<(usize, u64)> =
        (0..callers).flat_map(|c| (0..calls[c]).map(move |s| (c, s))).collect();
    let mut running: Vec<(usize, u64)> = Vec::new();
    let mut offered: Vec<(usize, u64)> = Vec::new(); // before d6562ad: waiters to restart
    let (mut released, mut started) = (Vec::new(), Vec::new());
    let mut ended = 0usize;
    let total = in_flight.len();
    let mut step = 0u64;
    loop {
        step += 1;
        let mut ev: Vec<u8> = Vec::new();
        if !in_flight.is_empty() {
            ev.push(0);
        }
        if !running.is_empty() {
            ev.push(1);
        }
        if !offered.is_empty() {
            ev.push(2);
        }
        let Some(&kind) = ev.get(rng.below(ev.len().max(1) as u64) as usize) else { break };
        let mut to_start: Vec<(usize, u64)> = Vec::new();
        match kind {
            0 => {
                let call = in_flight.swap_remove(rng.below(in_flight.len() as u64) as usize);
                queues[call.0].arrive(call.1, call);
                while let Some(c) = queues[call.0].release() {
                    released.push(c);
                    to_start.extend(group.start(limit, c));
                }
            }
            1 => {
                running.swap_remove(rng.below(running.len() as u64) as usize);
                ended += 1;
                let (now, later) = group.ended();
                to_start.extend(now);
                offered.extend(later);
            }
            _ => {
                let c = offered.remove(0);
                to_start.extend(group.start(limit, c));
            }
        }
        for c in to_start {
            if trace {
                eprintln!("step {step}: call {c:?} starts");
            }
            started.push(c);
            running.push(c);
        }
        if running.len() > limit {
            return Err(format!("actor order: {} calls run at once, limit {limit}", running.len()));
        }
        if started[..] != released[..started.len()] {
            return Err(format!(
                "actor order: started {started:?} but released {released:?} (limit {limit})"
            ));
        }
    }
    if started.len() != total || ended != total {
        return Err(format!(
            "actor order: {total} calls, {} started, {ended} ended",
            started.len()
        ));
    }
    Ok(())
}

// ---- pulls between nodes (OBJ-8) ------------------------------------------------------

/// A process on a node that wants the object: waiting to ask, pulling, or done (it has
/// a local copy to read).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Want {
    /// Waiting; it asks the owner again once something changed after `seen`.
    Asks {
        seen: u64,
    },
    Pulling {
        from: usize,
    },
    Has,
}

/// One schedule of an object pulled by several nodes (a broadcast): processes ask the
/// owner for a source (`Pulls::assign`), pulls finish (adding a copy) or fail, nodes die
/// (their copies and pulls lost) in a random order. Checked: at most
/// `MAX_PULLS_PER_SOURCE` pulls from one copy at once, never two pulls by one node, and
/// every process on a live node ends with a copy unless every copy was lost (then the
/// object is lost, which lineage handles).
fn transfer_schedule(seed: u64, trace: bool) -> SimResult {
    let mut rng = Rng(seed);
    let nodes = 2 + rng.below(7) as usize;
    let loc = |n: usize| pb::ObjectLocation {
        node_id: format!("n{n}"),
        agent_address: format!("10.0.0.{n}:1"),
        store_dir: String::new(),
    };
    let node_of = |l: &pb::ObjectLocation| l.node_id[1..].parse::<usize>().expect("a node id");
    let mut locations = vec![loc(0)];
    let mut pulls: Option<Box<Pulls>> = None;
    let mut dead = vec![false; nodes];
    // (node, what the process wants); 1 or 2 processes on each node but the first.
    let mut procs: Vec<(usize, Want)> = Vec::new();
    for n in 1..nodes {
        for _ in 0..1 + rng.below(2) {
            procs.push((n, Want::Asks { seen: u64::MAX }));
        }
    }
    let start = Instant::now();
    let mut generation = 0u64; // bumped by whatever changes what asking answers
    for step in 0..50_000u64 {
        let now = start + std::time::Duration::from_millis(10 * step);
        let mut ev: Vec<(u8, usize)> = Vec::new();
        for (i, (n, w)) in procs.iter().enumerate() {
            if dead[*n] {
                continue;
            }
            match w {
                Want::Asks { seen } if *seen != generation => ev.push((0, i)),
                Want::Pulling { .. } => ev.push((1, i)),
                _ => {}
            }
        }
        if rng.chance(2) && dead.iter().filter(|d| !**d).count() > 1 {
            ev.push((2, rng.below(nodes as u64) as usize));
        }
        if ev.is_empty() {
            break;
        }
        let (kind, i) = ev[rng.below(ev.len() as u64) as usize];
        match kind {
            0 => {
                let (n, _) = procs[i];
                let got = Pulls::assign(&mut pulls, &locations, &format!("n{n}"), now);
                procs[i].1 = match got {
                    None => Want::Asks { seen: generation },
                    Some(l) if l.iter().any(|l| node_of(l) == n) => Want::Has,
                    Some(l) if l.len() == 1 => Want::Pulling { from: node_of(&l[0]) },
                    Some(l) => return Err(format!("transfer: node {n} got {} sources", l.len())),
                };
                if trace {
                    eprintln!("step {step}: process {i} on n{n} asks: {:?}", procs[i].1);
                }
            }
            1 => {
                let (n, Want::Pulling { from }) = procs[i] else { unreachable!() };
                let p = pulls.as_mut().expect("a pull was assigned");
                p.done(&format!("n{from}"), &format!("n{n}"));
                if dead[from] {
                    procs[i].1 = Want::Asks { seen: u64::MAX }; // the source went: again
                } else {
                    if !locations.iter().any(|l| node_of(l) == n) {
                        locations.push(loc(n));
                    }
                    procs[i].1 = Want::Has;
                }
                generation += 1;
                if trace {
                    eprintln!("step {step}: n{n}'s pull from n{from} ends: {:?}", procs[i].1);
                }
            }
            _ => {
                if dead[i] {
                    continue;
                }
                dead[i] = true;
                locations.retain(|l| node_of(l) != i);
                if let Some(p) = pulls.as_mut() {
                    p.lost(&[format!("n{i}")]);
                }
                generation += 1;
                if trace {
                    eprintln!("step {step}: node n{i} dies");
                }
                if locations.is_empty() {
                    return Ok(()); // every copy lost: lineage's case, not this machine's
                }
            }
        }
        // Ground truth: pulls in flight per live source, and per pulling node.
        for src in 0..nodes {
            let from_src = procs
                .iter()
                .filter(|(n, w)| !dead[*n] && *w == Want::Pulling { from: src })
                .count();
            if !dead[src] && from_src > MAX_PULLS_PER_SOURCE {
                return Err(format!("transfer: {from_src} pulls from n{src} at once"));
            }
        }
        for n in 0..nodes {
            // A pull from a dead source is over (CORE-10 ends it at once), even before
            // its process hears.
            let by_node = procs
                .iter()
                .filter(|(m, w)| *m == n && matches!(w, Want::Pulling { from } if !dead[*from]))
                .count();
            if by_node > 1 {
                return Err(format!("transfer: node n{n} pulls {by_node} copies at once"));
            }
        }
    }
    if let Some((n, w)) = procs.iter().find(|(n, w)| !dead[*n] && *w != Want::Has) {
        return Err(format!("transfer: a process on n{n} never got the object: {w:?}"));
    }
    Ok(())
}

// ---- the runner ---------------------------------------------------------------------

fn schedules_per_machine() -> u64 {
    std::env::var("TPURAY_SIM_SCHEDULES").ok().and_then(|v| v.parse().ok()).unwrap_or(6_000)
}

fn replay_seed() -> Option<u64> {
    std::env::var("TPURAY_SIM_SEED").ok().map(|v| {
        v.trim()
            .parse()
            .unwrap_or_else(|_| panic!("TPURAY_SIM_SEED={v:?}: expected a whole number"))
    })
}

/// Seeds are fixed (a seed names one schedule for good), spread over the u64 range.
fn seed(machine: u64, i: u64) -> u64 {
    Rng(machine.wrapping_mul(1_000_003).wrapping_add(i)).next()
}

/// The seeded schedules of every machine; prints the summary line and each failing
/// seed, and fails when any schedule failed.
#[test]
fn seeded_schedules_keep_every_invariant() {
    let machines: [(&str, Schedule); 5] = [
        ("retry", retry_schedule),
        ("transfer", transfer_schedule),
        ("ownership", ownership_schedule),
        ("actor order", |s, trace| actor_order_schedule(s, false, trace)),
        ("leases", |s, trace| lease_schedule(s, pipeline::leases_wanted, trace)),
    ];
    let mut out = std::io::stderr();
    let (mut schedules, mut failures) = (0u64, 0u64);
    if let Some(s) = replay_seed() {
        for (name, run) in machines {
            schedules += 1;
            let _ = writeln!(out, "== {name}, seed {s}");
            if let Err(e) = run(s, true) {
                failures += 1;
                let _ = writeln!(out, "sim: {name} seed {s} fails: {e}");
            }
        }
    } else {
        for (m, (name, run)) in machines.iter().enumerate() {
            for i in 0..schedules_per_machine() {
                let s = seed(m as u64, i);
                schedules += 1;
                if let Err(e) = run(s, false) {
                    failures += 1;
                    if failures <= 10 {
                        let _ = writeln!(
                            out,
                            "sim: {name} seed {s} fails: {e} (replay: TPURAY_SIM_SEED={s} cargo test -p tpuray --test sim -- --nocapture)"
                        );
                    }
                }
            }
        }
    }
    let _ = writeln!(out, "sim: {schedules} schedules, {failures} failures");
    assert_eq!(failures, 0, "sim: {failures} of {schedules} schedules failed (seeds above)");
}

/// CORE-9 regression, replayed as the event sequence of da44a84's deadlock: with a fixed
/// pipeline depth of 4 and one CPU, a task pushed with the task it waits for behind it
/// blocks; its worker hands that task back. The rule before da44a84 wanted no second
/// lease (one held, two tasks, depth 4), so the handed-back task waited for ever; the
/// production rule counts the stalled lease and asks for one.
#[test]
fn core9_a_handed_back_task_gets_a_lease_besides_its_blocked_worker() {
    let mut found = None;
    for i in 0..20_000 {
        let s = seed(7, i);
        let before = lease_schedule(s, leases_wanted_before_da44a84, false);
        if before.as_ref().is_err_and(|e| e.contains("stuck")) {
            found = Some(s);
            break;
        }
    }
    let s = found.expect("the old rule deadlocks in some schedule (it did in CI)");
    assert_eq!(lease_schedule(s, pipeline::leases_wanted, false), Ok(()), "seed {s}");
    // And the exact sequence: one CPU, depth 4, task 0 waits for task 1.
    for (wanted, deadlocks) in
        [(leases_wanted_before_da44a84 as Wanted, true), (pipeline::leases_wanted as Wanted, false)]
    {
        let mut pool = Pool {
            tasks: vec![
                SimTask { waits_for: Some(1), done: false },
                SimTask { waits_for: None, done: false },
            ],
            queue: VecDeque::from([0, 1]),
            leases: Vec::new(),
            asking: 0,
            free_cpus: 1,
            fixed: Some(4),
            push_us: 100,
            shallow_until: 0,
            now: 0,
            wanted,
            trace: false,
        };
        pool.ensure_leases().unwrap();
        assert_eq!(pool.asking, 1);
        // Granted: both tasks go to the one worker (depth 4).
        pool.asking -= 1;
        pool.free_cpus -= 1;
        pool.leases.push(Lease::default());
        pool.push(0).unwrap();
        assert_eq!(pool.leases[0].held, VecDeque::from([0, 1]));
        // Task 0 blocks on task 1: the CPU is lent back, task 1 handed back.
        pool.leases[0].blocked = true;
        pool.free_cpus += 1;
        pool.hand_back(0).unwrap();
        assert_eq!(pool.queue, VecDeque::from([1]));
        assert_eq!(pool.asking == 0, deadlocks);
    }
}

/// CORE-4 regression (d6562ad; test_async_actor_calls_answer failed 2 runs in 6-8 with
/// `max_concurrency=1`): an ended async call gave its place back before the call waiting
/// first took it, so a call released in between started ahead of it. Replayed against
/// the old places (some seed breaks the order) and the production ones (none does).
#[test]
fn core4_an_async_call_released_later_never_starts_ahead_of_one_waiting() {
    let broken =
        (0..5_000).map(|i| seed(11, i)).find(|&s| actor_order_schedule(s, true, false).is_err());
    let s = broken.expect("the old places break the start order in some schedule");
    assert_eq!(actor_order_schedule(s, false, false), Ok(()), "seed {s}");
}

/// How a runtime thread learns whether the worker is blocked (`Core::is_blocked`).
#[derive(Clone, Copy, PartialEq, Eq)]
enum IsBlocked {
    /// Production: a load of the blocked-thread count, never the telling lock.
    ReadsTheCount,
    /// Before a0b60fe: it took the lock `set_blocked` holds while it tells the agent.
    TakesTheTellingLock,
}

/// The threads of a worker whose task blocks in get (AGENT-11, CORE-9), as a schedule of
/// steps: the executor thread takes the telling lock, counts itself blocked and, being
/// the first, sends `NotifyWorkerBlocked`, which needs a free runtime thread to go out
/// and be answered, while the lock is held (so the agent hears blocks and unblocks in
/// order). Meanwhile the worker's two runtime threads answer the owner's pushes: each
/// task queued behind the blocked one asks `is_blocked` to decide whether it goes back
/// (`QueuedTask::reply`). Returns whether every thread got through (false: deadlock).
/// This checks the thin layer's locking rule, not a pure machine: the rule is the one
/// `Core::is_blocked`'s doc states.
fn blocked_threads_schedule(seed: u64, rule: IsBlocked) -> bool {
    #[derive(Clone, Copy, PartialEq, Eq)]
    enum Rt {
        Idle,
        WaitsForLock,
    }
    let mut rng = Rng(seed);
    let mut queued_polls = 1 + rng.below(4); // tasks behind the blocked one, to answer
    let mut lock_held = false;
    let mut rpc_pending = false;
    let mut exec_step = 0u8; // 0: take lock, 1: count + send, 2: wait answer, 3: done
    let mut rts = [Rt::Idle, Rt::Idle];
    for _ in 0..10_000 {
        if exec_step == 3 && queued_polls == 0 && rts.iter().all(|r| *r == Rt::Idle) {
            return true;
        }
        // Runnable steps: (thread, what).
        let mut can: Vec<(usize, u8)> = Vec::new();
        match exec_step {
            0 if !lock_held => can.push((0, 0)),
            1 => can.push((0, 1)),
            2 if !rpc_pending => can.push((0, 2)),
            _ => {}
        }
        for (i, r) in rts.iter().enumerate() {
            match r {
                Rt::Idle => {
                    if rpc_pending {
                        can.push((1 + i, 0)); // send the notification and get its answer
                    }
                    if queued_polls > 0 {
                        can.push((1 + i, 1)); // answer a queued task: is_blocked?
                    }
                }
                Rt::WaitsForLock if !lock_held => can.push((1 + i, 2)),
                Rt::WaitsForLock => {}
            }
        }
        let Some(&(thread, what)) = can.get(rng.below(can.len().max(1) as u64) as usize) else {
            return false; // nothing can run: deadlock
        };
        match (thread, what) {
            (0, 0) => {
                lock_held = true;
                exec_step = 1;
            }
            (0, 1) => {
                rpc_pending = true; // blocked_threads 0 -> 1: tell the agent
                exec_step = 2;
            }
            (0, _) => {
                lock_held = false;
                exec_step = 3;
            }
            (_, 0) => rpc_pending = false,
            (t, 1) => {
                queued_polls -= 1;
                if rule == IsBlocked::TakesTheTellingLock && lock_held {
                    rts[t - 1] = Rt::WaitsForLock;
                }
            }
            (t, _) => rts[t - 1] = Rt::Idle, // got the lock, read, let go
        }
    }
    false
}

/// CORE-9 regression (a0b60fe, the nested-get deadlock test hanging one run in five):
/// `is_blocked` took the lock that `set_blocked` holds while the runtime tells the agent,
/// so with both runtime threads asking it the notification could never go out. Replayed
/// as thread schedules: the old rule deadlocks in some, the production rule in none.
#[test]
fn core9_is_blocked_never_waits_for_the_agent_to_hear_of_a_block() {
    let seeds: Vec<u64> = (0..2_000).map(|i| seed(13, i)).collect();
    let old =
        seeds.iter().filter(|&&s| !blocked_threads_schedule(s, IsBlocked::TakesTheTellingLock));
    assert!(old.count() > 0, "the old rule deadlocks in some schedule");
    for s in seeds {
        assert!(blocked_threads_schedule(s, IsBlocked::ReadsTheCount), "seed {s} deadlocks");
    }
}
