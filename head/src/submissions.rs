//! Jobs submitted through the Jobs API (Ray's "submission" jobs) as durable state
//! (HEAD-11): the record of each, and how the state machine changes it.
//!
//! A job is submitted PENDING and unplaced; the leader places its supervisor on a node
//! (`AssignJob`, then `StartJobSupervisor` on that node's agent); the agent reports
//! RUNNING and the end (`JobStatusReport`). Ray's status names and messages
//! (`ray/dashboard/modules/job/common.py`, `JobStatus`, `JobInfo.__post_init__`).
//! The record never stays RUNNING with nothing behind it: the leader fails a job whose
//! supervisor's node died or whose agent no longer lists it (`jobs.rs`, the sweep).
//!
//! HEAD-11 in detail: a refused `StartJobSupervisor` unassigns the job, and it is placed
//! again. Statuses only move forward (PENDING → RUNNING → STOPPED | SUCCEEDED | FAILED),
//! and a report from a node the job is not placed on is ignored. A job that ends finishes
//! the driver jobs its entrypoint registered (`RegisterJob.submission_id`), so their
//! actors and groups end with it. A job whose agent has not listed it in heartbeats for
//! 10 s fails, and a stop asked while placed is sent to the agent again every 5 s until
//! the job ends.

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};
use tpuray_proto::ids::{JobId, NodeId};

use crate::state::{Changed, CommandKind, JobStatus, Outcome, Rejection, StateMachine};

/// Ray's `JobStatus` (a job moves PENDING → RUNNING → one of the three terminal ones).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub enum SubmissionStatus {
    Pending,
    Running,
    Stopped,
    Succeeded,
    Failed,
}

impl SubmissionStatus {
    /// Ray's name (`"PENDING"`, ...).
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Pending => "PENDING",
            Self::Running => "RUNNING",
            Self::Stopped => "STOPPED",
            Self::Succeeded => "SUCCEEDED",
            Self::Failed => "FAILED",
        }
    }

    /// The status named `s` (Ray's names).
    ///
    /// # Errors
    /// A message naming `s` and the names expected.
    pub fn parse(s: &str) -> Result<Self, String> {
        Ok(match s {
            "PENDING" => Self::Pending,
            "RUNNING" => Self::Running,
            "STOPPED" => Self::Stopped,
            "SUCCEEDED" => Self::Succeeded,
            "FAILED" => Self::Failed,
            other => {
                return Err(format!(
                    "unknown job status {other:?} (expected PENDING, RUNNING, STOPPED, SUCCEEDED or FAILED)"
                ));
            }
        })
    }

    /// STOPPED, SUCCEEDED and FAILED (Ray's `JobStatus.is_terminal`).
    pub fn is_terminal(self) -> bool {
        matches!(self, Self::Stopped | Self::Succeeded | Self::Failed)
    }

    /// Ray's default message for a status (`JobInfo.__post_init__`).
    pub fn default_message(self) -> &'static str {
        match self {
            Self::Pending => "Job has not started yet.",
            Self::Running => "Job is currently running.",
            Self::Stopped => "Job was intentionally stopped.",
            Self::Succeeded => "Job finished successfully.",
            Self::Failed => "Job failed.",
        }
    }
}

/// One submitted job (fields as Ray's `JobInfo`; times in Unix ms, 0 for none).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct SubmissionRecord {
    pub submission_id: String,
    pub status: SubmissionStatus,
    pub entrypoint: String,
    pub message: String,
    /// Ray's `JobErrorType` name ("" for none).
    pub error_type: String,
    pub submit_time_ms: u64,
    pub start_time_ms: u64,
    pub end_time_ms: u64,
    pub metadata: BTreeMap<String, String>,
    /// JSON ("" for none).
    pub runtime_env_json: String,
    pub entrypoint_num_cpus: Option<f64>,
    pub entrypoint_num_gpus: Option<f64>,
    pub entrypoint_memory: Option<u64>,
    pub entrypoint_resources: BTreeMap<String, f64>,
    pub entrypoint_label_selector: BTreeMap<String, String>,
    /// Where its supervisor runs: (node, the node agent's address).
    pub placed: Option<(NodeId, String)>,
    pub driver_exit_code: Option<i32>,
    /// The driver job its entrypoint registered, and that driver's address and pid.
    pub driver: Option<(JobId, String, u32)>,
    pub stop_requested: bool,
}

impl SubmissionRecord {
    /// The resources its entrypoint reserves on its node (Ray's `entrypoint_*`; `memory`
    /// in bytes, as Ray counts it).
    pub fn entrypoint_resource_map(&self) -> BTreeMap<String, f64> {
        tpuray_proto::runtime_env::entrypoint_resources(
            self.entrypoint_num_cpus,
            self.entrypoint_num_gpus,
            self.entrypoint_memory,
            &self.entrypoint_resources,
        )
    }
}

/// A new status, with Ray's message (empty: the status's default), error type ("" for
/// none), the entrypoint's exit code and when (Unix ms).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct StatusChange {
    pub status: SubmissionStatus,
    pub message: String,
    pub error_type: String,
    pub exit_code: Option<i32>,
    pub time_ms: u64,
}

impl StatusChange {
    /// `status` at `time_ms` with the default message and nothing else.
    pub fn plain(status: SubmissionStatus, time_ms: u64) -> Self {
        Self { status, message: String::new(), error_type: String::new(), exit_code: None, time_ms }
    }
}

/// A change the leader or an agent asks for, applied by [`StateMachine::apply_submission`].
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub enum SubmissionCommand {
    Submit(Box<SubmissionRecord>),
    /// The leader chose `node` (agent at `address`) for a PENDING, unplaced job.
    Assign {
        submission_id: String,
        node_id: NodeId,
        address: String,
    },
    /// The chosen agent refused or could not be reached: the job waits for placement again.
    Unassign {
        submission_id: String,
        node_id: NodeId,
        reason: String,
    },
    /// A status from the agent on `from` (a report from another node is stale and
    /// ignored), or from the leader itself (`from: None`: start timeout, lost supervisor).
    Status {
        submission_id: String,
        from: Option<NodeId>,
        change: StatusChange,
    },
    Stop {
        id: String,
        time_ms: u64,
    },
    Delete {
        id: String,
    },
}

impl StateMachine {
    /// The submission named by `id`: a submission id, or the job id of the driver
    /// a submission started (Ray's `find_job_by_ids`).
    pub fn find_submission(&self, id: &str) -> Option<&SubmissionRecord> {
        self.submissions.get(id).or_else(|| {
            self.submissions
                .values()
                .find(|s| s.driver.as_ref().is_some_and(|(j, _, _)| j.as_str() == id))
        })
    }

    pub(crate) fn apply_submission(
        &mut self,
        cmd: SubmissionCommand,
        changed: &mut Vec<Changed>,
    ) -> Outcome {
        match cmd {
            SubmissionCommand::Submit(rec) => {
                if self.submissions.contains_key(&rec.submission_id) {
                    return Outcome::Rejected(Rejection::AlreadyExists(format!(
                        "job with submission_id {} already exists; please use a different submission_id",
                        rec.submission_id
                    )));
                }
                let id = rec.submission_id.clone();
                self.submissions.insert(id.clone(), *rec);
                Outcome::Submission(id)
            }
            SubmissionCommand::Assign { submission_id, node_id, address } => {
                let Some(s) = self.submissions.get_mut(&submission_id) else {
                    return not_found(&submission_id);
                };
                if s.status != SubmissionStatus::Pending || s.placed.is_some() || s.stop_requested {
                    return Outcome::Rejected(Rejection::Invalid(format!(
                        "job {submission_id} is not waiting for placement"
                    )));
                }
                s.placed = Some((node_id, address));
                Outcome::Done
            }
            SubmissionCommand::Unassign { submission_id, node_id, reason } => {
                let Some(s) = self.submissions.get_mut(&submission_id) else {
                    return not_found(&submission_id);
                };
                if s.status == SubmissionStatus::Pending
                    && s.placed.as_ref().is_some_and(|(n, _)| *n == node_id)
                {
                    s.placed = None;
                    s.message = format!("Job has not started yet: {reason}");
                }
                Outcome::Done
            }
            SubmissionCommand::Status { submission_id, from, change } => {
                let Some(s) = self.submissions.get(&submission_id) else {
                    return not_found(&submission_id);
                };
                if let Some(node) = &from
                    && s.placed.as_ref().map(|(n, _)| n) != Some(node)
                {
                    return Outcome::Done; // a stale report about an older placement
                }
                self.set_submission_status(&submission_id, change, changed);
                Outcome::Done
            }
            SubmissionCommand::Stop { id, time_ms } => {
                let Some(s) = self.find_submission(&id) else {
                    return not_found(&id);
                };
                let sid = s.submission_id.clone();
                if s.status.is_terminal() {
                    return Outcome::Stopped(false);
                }
                let unplaced = s.placed.is_none();
                if let Some(s) = self.submissions.get_mut(&sid) {
                    s.stop_requested = true;
                }
                if unplaced {
                    self.set_submission_status(
                        &sid,
                        StatusChange::plain(SubmissionStatus::Stopped, time_ms),
                        changed,
                    );
                }
                Outcome::Stopped(true)
            }
            SubmissionCommand::Delete { id } => {
                let Some(s) = self.find_submission(&id) else {
                    return not_found(&id);
                };
                if !s.status.is_terminal() {
                    return Outcome::Rejected(Rejection::Invalid(format!(
                        "Attempted to delete job '{}', but it is in a non-terminal state {}",
                        s.submission_id,
                        s.status.as_str()
                    )));
                }
                let sid = s.submission_id.clone();
                self.submissions.remove(&sid);
                Outcome::Deleted(true)
            }
        }
    }

    /// Moves a submission to `status` when that is a forward move (PENDING → RUNNING →
    /// terminal; terminal is final); an empty `message` takes Ray's default. A job that
    /// ends also ends the driver jobs it started (their actors and groups die with them).
    /// Returns whether anything changed.
    fn set_submission_status(
        &mut self,
        submission_id: &str,
        change: StatusChange,
        changed: &mut Vec<Changed>,
    ) -> bool {
        let StatusChange { status, message, error_type, exit_code, time_ms } = change;
        let Some(s) = self.submissions.get_mut(submission_id) else {
            return false;
        };
        let forward = match (s.status, status) {
            (a, _) if a.is_terminal() => false,
            (SubmissionStatus::Pending, _) => status != SubmissionStatus::Pending,
            (SubmissionStatus::Running, b) => b.is_terminal(),
            _ => false,
        };
        if !forward {
            return false;
        }
        s.status = status;
        s.message = if message.is_empty() { status.default_message().into() } else { message };
        s.error_type = error_type;
        if exit_code.is_some() {
            s.driver_exit_code = exit_code;
        }
        if status == SubmissionStatus::Running && s.start_time_ms == 0 {
            s.start_time_ms = time_ms;
        }
        if status.is_terminal() {
            if s.start_time_ms == 0 {
                s.start_time_ms = time_ms;
            }
            s.end_time_ms = time_ms;
            let drivers: Vec<JobId> = self
                .jobs
                .values()
                .filter(|j| j.submission_id == submission_id && j.status == JobStatus::Running)
                .map(|j| j.job_id.clone())
                .collect();
            for job_id in drivers {
                // FinishJob's own effects: the job's actors and groups end with it.
                let _ = self.apply_finish_job(job_id, time_ms, changed);
            }
        }
        true
    }
}

fn not_found(id: &str) -> Outcome {
    Outcome::Rejected(Rejection::NotFound(format!("Job {id} does not exist")))
}

impl From<SubmissionCommand> for CommandKind {
    fn from(c: SubmissionCommand) -> Self {
        CommandKind::Submission(c)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::state::{Command, JobRecord};

    fn cmd(kind: impl Into<CommandKind>) -> Command {
        Command { request_id: String::new(), kind: kind.into() }
    }

    fn submitted(id: &str) -> SubmissionRecord {
        SubmissionRecord {
            submission_id: id.into(),
            status: SubmissionStatus::Pending,
            entrypoint: "python x.py".into(),
            message: SubmissionStatus::Pending.default_message().into(),
            error_type: String::new(),
            submit_time_ms: 1,
            start_time_ms: 0,
            end_time_ms: 0,
            metadata: BTreeMap::new(),
            runtime_env_json: String::new(),
            entrypoint_num_cpus: None,
            entrypoint_num_gpus: None,
            entrypoint_memory: None,
            entrypoint_resources: BTreeMap::new(),
            entrypoint_label_selector: BTreeMap::new(),
            placed: None,
            driver_exit_code: None,
            driver: None,
            stop_requested: false,
        }
    }

    fn status(id: &str, from: &NodeId, status: SubmissionStatus) -> SubmissionCommand {
        SubmissionCommand::Status {
            submission_id: id.into(),
            from: Some(from.clone()),
            change: StatusChange::plain(status, 5),
        }
    }

    #[test]
    fn a_job_moves_forward_only_and_reports_from_other_nodes_are_ignored() {
        let mut sm = StateMachine::new();
        let (a, b) = (NodeId::random(), NodeId::random());
        sm.apply(cmd(SubmissionCommand::Submit(Box::new(submitted("s")))));
        let (o, _) = sm.apply(cmd(SubmissionCommand::Submit(Box::new(submitted("s")))));
        assert!(matches!(o, Outcome::Rejected(Rejection::AlreadyExists(_))), "{o:?}");
        sm.apply(cmd(SubmissionCommand::Assign {
            submission_id: "s".into(),
            node_id: a.clone(),
            address: "a:1".into(),
        }));
        sm.apply(cmd(status("s", &b, SubmissionStatus::Running)));
        assert_eq!(sm.submissions["s"].status, SubmissionStatus::Pending);
        sm.apply(cmd(status("s", &a, SubmissionStatus::Running)));
        assert_eq!(sm.submissions["s"].status, SubmissionStatus::Running);
        assert_eq!(sm.submissions["s"].message, "Job is currently running.");
        sm.apply(cmd(status("s", &a, SubmissionStatus::Succeeded)));
        sm.apply(cmd(status("s", &a, SubmissionStatus::Failed)));
        let s = &sm.submissions["s"];
        assert_eq!(s.status, SubmissionStatus::Succeeded);
        assert_eq!((s.start_time_ms, s.end_time_ms), (5, 5));
    }

    #[test]
    fn stopping_an_unplaced_job_ends_it_and_a_placed_one_waits_for_its_agent() {
        let mut sm = StateMachine::new();
        sm.apply(cmd(SubmissionCommand::Submit(Box::new(submitted("u")))));
        sm.apply(cmd(SubmissionCommand::Submit(Box::new(submitted("p")))));
        let n = NodeId::random();
        sm.apply(cmd(SubmissionCommand::Assign {
            submission_id: "p".into(),
            node_id: n.clone(),
            address: "a:1".into(),
        }));
        let (o, _) = sm.apply(cmd(SubmissionCommand::Stop { id: "u".into(), time_ms: 9 }));
        assert_eq!(o, Outcome::Stopped(true));
        assert_eq!(sm.submissions["u"].status, SubmissionStatus::Stopped);
        let (o, _) = sm.apply(cmd(SubmissionCommand::Stop { id: "p".into(), time_ms: 9 }));
        assert_eq!(o, Outcome::Stopped(true));
        assert_eq!(sm.submissions["p"].status, SubmissionStatus::Pending);
        assert!(sm.submissions["p"].stop_requested);
        let (o, _) = sm.apply(cmd(SubmissionCommand::Delete { id: "p".into() }));
        assert!(matches!(o, Outcome::Rejected(Rejection::Invalid(_))), "{o:?}");
        let (o, _) = sm.apply(cmd(SubmissionCommand::Stop { id: "u".into(), time_ms: 9 }));
        assert_eq!(o, Outcome::Stopped(false));
        let (o, _) = sm.apply(cmd(SubmissionCommand::Delete { id: "u".into() }));
        assert_eq!(o, Outcome::Deleted(true));
        assert!(!sm.submissions.contains_key("u"));
    }

    #[test]
    fn a_job_that_ends_finishes_the_driver_jobs_it_started() {
        let mut sm = StateMachine::new();
        let n = NodeId::random();
        sm.apply(cmd(SubmissionCommand::Submit(Box::new(submitted("s")))));
        sm.apply(cmd(SubmissionCommand::Assign {
            submission_id: "s".into(),
            node_id: n.clone(),
            address: "a:1".into(),
        }));
        sm.apply(cmd(status("s", &n, SubmissionStatus::Running)));
        let job_id = JobId::random();
        sm.apply(cmd(CommandKind::RegisterJob(JobRecord {
            job_id: job_id.clone(),
            status: JobStatus::Running,
            driver_address: "d:1".into(),
            driver_pid: 7,
            entrypoint: String::new(),
            namespace: "default".into(),
            start_time_ms: 1,
            end_time_ms: 0,
            worker_binary_hash: String::new(),
            submission_id: "s".into(),
        })));
        assert_eq!(
            sm.find_submission(job_id.as_str()).map(|s| s.submission_id.as_str()),
            Some("s")
        );
        sm.apply(cmd(SubmissionCommand::Status {
            submission_id: "s".into(),
            from: None,
            change: StatusChange {
                message: "the node died".into(),
                error_type: "JOB_SUPERVISOR_ACTOR_DIED".into(),
                ..StatusChange::plain(SubmissionStatus::Failed, 11)
            },
        }));
        let s = &sm.submissions["s"];
        assert_eq!(s.status, SubmissionStatus::Failed);
        assert!(s.message.contains("died"), "{}", s.message);
        assert_eq!(sm.jobs[&job_id].status, JobStatus::Finished);
    }
}
