//! The leasing decisions of one scheduling class (CORE-3, CORE-9), pure: how many leases
//! the class wants, how many tasks one leased worker may hold, and when a pipeline is
//! topped up. No clocks, atomics or I/O: `leasing` reads the class's counters and the
//! time and passes them in, and `sdk/tests/sim.rs` drives them with seeded schedules.

/// The most tasks pushed to one leased worker at once while the node has no CPU left
/// for another lease of the class and its tasks are quick (CORE-9); fewer for slower
/// ones, so that what waits on a worker takes about [`PIPELINE_BUDGET_US`].
pub const DEEP_PIPELINE: usize = 256;
/// A class whose pushes (round trip included) take at most this long on average counts
/// as quick (CORE-9), in microseconds.
pub const QUICK_TASK_US: u64 = 2_000;
/// The work a deep pipeline keeps queued on one worker (CORE-9), in microseconds of the
/// class's average push: 16 tasks of the slowest quick class.
pub const PIPELINE_BUDGET_US: u64 = 16 * QUICK_TASK_US;
/// Leases one scheduling class may hold or ask for at once.
pub const MAX_LEASES_PER_CLASS: usize = 32;

/// Leases a class wants (CORE-3): one per `per_lease` tasks queued or in flight (a task
/// queued behind a running one gets a lease of its own instead of waiting, as Ray
/// requests one per task), plus one for each lease whose worker handed tasks back and
/// takes no more until it answers (CORE-9: else a handed-back task could wait for ever
/// behind the blocked task it is needed by), at least 1 and at most
/// [`MAX_LEASES_PER_CLASS`]; 0 when nothing is queued (no new lease is asked for).
///
/// `queued`: tasks in the class's queue; `in_flight`: pushed and not answered;
/// `stalled`: leases handing back; `per_lease`: tasks one lease takes
/// (`TPURAY_MAX_TASKS_IN_FLIGHT_PER_WORKER`, else 1).
pub fn leases_wanted(queued: usize, in_flight: usize, stalled: usize, per_lease: usize) -> usize {
    if queued == 0 {
        return 0;
    }
    ((queued + in_flight).div_ceil(per_lease.max(1)) + stalled).clamp(1, MAX_LEASES_PER_CLASS)
}

/// Tasks one leased worker of the class may hold at once (CORE-3, CORE-9): `fixed`
/// (`TPURAY_MAX_TASKS_IN_FLIGHT_PER_WORKER`) when set; else 1 (Ray's default), and up to
/// [`DEEP_PIPELINE`] while a lease request of the class waits for resources (`asking`
/// above 0: every CPU it could use is busy) and its tasks are quick (`push_us`, the
/// average push in microseconds, `u64::MAX` before the first, at most
/// [`QUICK_TASK_US`]), unless a task came back unrun until `shallow_until_ms` (times in
/// ms, `now_ms` the present). So quick tasks stop paying a round trip each without ever
/// waiting behind a slow one while a CPU is free.
pub fn depth(
    fixed: Option<usize>,
    push_us: u64,
    asking: usize,
    now_ms: u64,
    shallow_until_ms: u64,
) -> usize {
    if let Some(d) = fixed {
        return d;
    }
    let quick = push_us <= QUICK_TASK_US;
    if quick && asking > 0 && now_ms >= shallow_until_ms {
        (PIPELINE_BUDGET_US / push_us.max(1)).clamp(2, DEEP_PIPELINE as u64) as usize
    } else {
        1
    }
}

/// How many free places a worker's pipeline of `depth` needs before more tasks are
/// pushed to it while it holds `in_flight` (CORE-9): one when it holds none, else a
/// quarter of the depth, so answers that come one by one still go out as batches.
pub fn top_up(depth: usize, in_flight: usize) -> usize {
    if in_flight == 0 { 1 } else { (depth / 4).max(1) }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn nothing_queued_wants_no_lease_and_a_queue_wants_one_per_task_within_the_cap() {
        assert_eq!(leases_wanted(0, 5, 1, 1), 0);
        assert_eq!(leases_wanted(1, 0, 0, 1), 1);
        assert_eq!(leases_wanted(3, 2, 0, 1), 5);
        assert_eq!(leases_wanted(3, 2, 0, 4), 2);
        assert_eq!(leases_wanted(1000, 0, 0, 1), MAX_LEASES_PER_CLASS);
    }

    /// CORE-9 regression (da44a84): with a fixed depth of 4 the one lease holding a
    /// blocked task seemed enough for the task it handed back; a stalled lease adds one.
    #[test]
    fn a_stalled_lease_makes_the_class_want_one_more() {
        assert_eq!(leases_wanted(1, 1, 0, 4), 1);
        assert_eq!(leases_wanted(1, 1, 1, 4), 2);
    }

    #[test]
    fn depth_is_one_unless_quick_tasks_wait_for_a_busy_node() {
        assert_eq!(depth(Some(7), 10, 0, 0, 0), 7);
        assert_eq!(depth(None, u64::MAX, 1, 0, 0), 1);
        assert_eq!(depth(None, 100, 0, 0, 0), 1);
        assert_eq!(depth(None, 100, 1, 0, 0), 256.min((PIPELINE_BUDGET_US / 100) as usize));
        assert_eq!(depth(None, 1, 1, 0, 0), DEEP_PIPELINE);
        assert_eq!(depth(None, QUICK_TASK_US, 1, 0, 0), 16);
        // Shallow for a while after a hand-back.
        assert_eq!(depth(None, 100, 1, 5, 10), 1);
        assert_eq!(depth(None, 100, 1, 10, 10), 320.min(DEEP_PIPELINE));
    }

    #[test]
    fn a_pipeline_is_topped_up_by_quarters() {
        assert_eq!(top_up(256, 0), 1);
        assert_eq!(top_up(256, 10), 64);
        assert_eq!(top_up(2, 1), 1);
    }
}
