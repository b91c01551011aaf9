//! The one decision of what becomes of a task or an actor call after an attempt ends
//! (CORE-5, CORE-12): finished, queued or sent again without counting an attempt, run
//! again as its next attempt, or failed. Pure: no clocks, locks or I/O; the tokio layer
//! (`completion`, `actors`) carries the decision out, and `sdk/tests/sim.rs` drives it
//! with seeded outcomes.
//!
//! Ray's rules, which these follow: a task is retried after a system failure (its worker
//! or node died) while `max_retries` lasts, after an application exception only with
//! `retry_exceptions` (an error marked not retryable never is); an actor call is sent
//! again while `max_task_retries` lasts when the actor died mid-call, and a call refused
//! before it reached the actor (its process gone or moving) is sent again to the
//! restarted actor without counting (ray `task_manager.cc`, `actor_task_submitter.cc`).
//!
//! In full:
//! - CORE-5: a task whose worker dies is retried `max_retries` times (default 3);
//!   application errors only with `retry_exceptions`.

/// What ran: a normal task, or a call to an actor method.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Work {
    /// A task pushed to a leased worker.
    Task,
    /// A call sent to an actor's worker by its ordered sender (CORE-4).
    ActorCall,
}

/// What is known about the attempt that just ended.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Attempt {
    pub work: Work,
    /// Retries left before this decision (negative: unlimited, Ray's `-1`).
    pub retries_left: i32,
    /// Whether application exceptions are retried (Ray's `retry_exceptions`).
    pub retry_exceptions: bool,
    /// Cancelled (`cancel`) while it was queued on its worker or running (CORE-12).
    pub cancelled: bool,
    /// How many times this actor call was sent and refused before it reached the actor
    /// (a connection refused); 0 for tasks.
    pub undelivered: u32,
}

/// How the attempt ended.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Outcome {
    /// It ran and returned its values.
    Returned,
    /// It ran and failed with an error: `application` when user code raised (Ray's
    /// `RayTaskError`), `no_retry` when the error says it must not be retried.
    Raised { application: bool, no_retry: bool },
    /// The worker handed it back unrun: it was queued behind a task that blocked or ran
    /// long (CORE-9).
    HandedBack,
    /// The connection to its worker broke; `reached`: the request may have reached the
    /// worker (false only for an actor call refused at connect).
    Lost { reached: bool },
    /// It had returned, and every copy of a stored return was lost with its node since
    /// (CORE-6: lineage reconstruction runs it again, as an attempt).
    ReturnsLost,
}

/// What to do with it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Decision {
    /// Set its returns from the reply.
    Finish,
    /// Fail it with `Cancelled` (CORE-12: never retried, whatever happened).
    FailCancelled,
    /// Queue the task again, first in line, counting no attempt (it never ran).
    Requeue,
    /// Send the actor call again to wherever the actor lives next, counting no attempt
    /// (it never reached the actor).
    Resend,
    /// Run it again as its next attempt, with this many retries left afterwards.
    Retry { retries_left: i32 },
    /// Fail it: with the reply's error after `Raised`, with the cause the caller finds
    /// (worker died, node died, actor died or unavailable) after `Lost`.
    Fail,
}

/// Times an actor call refused at connect is sent again (about 60 s with the sender's
/// back-off: the head's node-death timeout plus a restart elsewhere).
pub const MAX_UNDELIVERED_RESENDS: u32 = 120;

/// The retry decision for tasks and actor calls alike (CORE-5, CORE-12). Cancellation
/// wins over every outcome; a retry spends one retry unless retries are unlimited.
pub fn decide(a: &Attempt, outcome: Outcome) -> Decision {
    if a.cancelled {
        return Decision::FailCancelled;
    }
    let retry = || Decision::Retry {
        retries_left: if a.retries_left < 0 { a.retries_left } else { a.retries_left - 1 },
    };
    match outcome {
        Outcome::Returned => Decision::Finish,
        Outcome::HandedBack => Decision::Requeue,
        Outcome::Raised { application, no_retry } => {
            if application && !no_retry && a.retry_exceptions && a.retries_left != 0 {
                retry()
            } else {
                Decision::Fail
            }
        }
        // Never reached the actor: sent again without counting, until the cap; then it
        // fails whatever its retries (the actor stayed unreachable).
        Outcome::Lost { reached: false } if a.work == Work::ActorCall => {
            if a.undelivered < MAX_UNDELIVERED_RESENDS { Decision::Resend } else { Decision::Fail }
        }
        Outcome::Lost { .. } | Outcome::ReturnsLost if a.retries_left != 0 => retry(),
        Outcome::Lost { .. } | Outcome::ReturnsLost => Decision::Fail,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn attempt(work: Work, retries_left: i32) -> Attempt {
        Attempt { work, retries_left, retry_exceptions: false, cancelled: false, undelivered: 0 }
    }

    #[test]
    fn a_cancelled_attempt_fails_cancelled_whatever_it_ended_with() {
        for work in [Work::Task, Work::ActorCall] {
            let a = Attempt { cancelled: true, ..attempt(work, -1) };
            for o in [
                Outcome::Returned,
                Outcome::HandedBack,
                Outcome::Raised { application: true, no_retry: false },
                Outcome::Lost { reached: true },
                Outcome::Lost { reached: false },
            ] {
                assert_eq!(decide(&a, o), Decision::FailCancelled, "{work:?} {o:?}");
            }
        }
    }

    #[test]
    fn a_lost_attempt_is_retried_while_retries_last_and_unlimited_stays_unlimited() {
        let lost = Outcome::Lost { reached: true };
        assert_eq!(decide(&attempt(Work::Task, 2), lost), Decision::Retry { retries_left: 1 });
        assert_eq!(decide(&attempt(Work::Task, 0), lost), Decision::Fail);
        assert_eq!(decide(&attempt(Work::Task, -1), lost), Decision::Retry { retries_left: -1 });
        assert_eq!(decide(&attempt(Work::ActorCall, 1), lost), Decision::Retry { retries_left: 0 });
        assert_eq!(decide(&attempt(Work::ActorCall, 0), lost), Decision::Fail);
    }

    #[test]
    fn application_errors_are_retried_only_with_retry_exceptions_and_never_when_marked() {
        let raised = Outcome::Raised { application: true, no_retry: false };
        let a = attempt(Work::Task, 3);
        assert_eq!(decide(&a, raised), Decision::Fail);
        let a = Attempt { retry_exceptions: true, ..a };
        assert_eq!(decide(&a, raised), Decision::Retry { retries_left: 2 });
        let marked = Outcome::Raised { application: true, no_retry: true };
        assert_eq!(decide(&a, marked), Decision::Fail);
        let system = Outcome::Raised { application: false, no_retry: false };
        assert_eq!(decide(&a, system), Decision::Fail);
        let spent = Attempt { retries_left: 0, ..a };
        assert_eq!(decide(&spent, raised), Decision::Fail);
    }

    #[test]
    fn an_actor_call_refused_at_connect_is_resent_without_counting_until_the_cap() {
        let refused = Outcome::Lost { reached: false };
        let a = attempt(Work::ActorCall, 0);
        assert_eq!(decide(&a, refused), Decision::Resend);
        let capped = Attempt { undelivered: MAX_UNDELIVERED_RESENDS, ..a };
        assert_eq!(decide(&capped, refused), Decision::Fail);
        let capped_with_retries = Attempt { retries_left: 3, ..capped };
        assert_eq!(decide(&capped_with_retries, refused), Decision::Fail);
        // A task's broken connection is an attempt, refused at connect or not.
        assert_eq!(decide(&attempt(Work::Task, 0), refused), Decision::Fail);
    }

    #[test]
    fn lost_returns_are_made_again_while_the_task_has_retries() {
        let lost = Outcome::ReturnsLost;
        assert_eq!(decide(&attempt(Work::Task, 1), lost), Decision::Retry { retries_left: 0 });
        assert_eq!(decide(&attempt(Work::Task, -1), lost), Decision::Retry { retries_left: -1 });
        assert_eq!(decide(&attempt(Work::Task, 0), lost), Decision::Fail);
    }

    #[test]
    fn a_handed_back_task_is_requeued_and_a_returned_one_finishes() {
        let a = attempt(Work::Task, 0);
        assert_eq!(decide(&a, Outcome::HandedBack), Decision::Requeue);
        assert_eq!(decide(&a, Outcome::Returned), Decision::Finish);
    }
}
