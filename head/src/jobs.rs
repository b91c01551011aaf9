//! The Jobs API on the head's gRPC side (HEAD-11): submission, stop, delete, the agents'
//! status reports, and the leader's sweep that places each job's supervisor and makes
//! sure no job stays RUNNING with nothing behind it (kuberay#2161).
//!
//! The sweep runs with the placement loop (about once a second, leader only):
//! - a PENDING job with no node is placed on a node with its entrypoint resources (the
//!   head node when it asks for none, as Ray runs such a driver on the head node),
//!   recorded durably (`Assign`), then started with `StartJobSupervisor`;
//! - a job on a node that died, or that the node's agent has not listed in its
//!   heartbeats for [`SUPERVISOR_LOST_AFTER`], fails naming why;
//! - a PENDING job not started within Ray's `RAY_JOB_START_TIMEOUT_SECONDS` (900 s)
//!   fails with `JOB_SUPERVISOR_ACTOR_START_TIMEOUT`;
//! - a job asked to stop while placed is told to its agent again until it ends, so a stop
//!   survives a failover.

use std::collections::{BTreeMap, HashMap, HashSet};
use std::sync::Arc;
use std::time::{Duration, Instant};

use tonic::Status;
use tpuray_proto::ids::NodeId;
use tpuray_proto::{now_ms, pb};
use tpuray_scheduler::{Decision, ResourceSet};

use crate::convert::submission_to_proto;
use crate::server::{Head, rejection_status};
use crate::state::{Command, NodeStatus, Outcome};
use crate::submissions::{StatusChange, SubmissionCommand, SubmissionRecord, SubmissionStatus};

/// A placed job its agent has not listed for this long is failed (covers a
/// `StartJobSupervisor` still in flight, and one heartbeat lost).
pub const SUPERVISOR_LOST_AFTER: Duration = Duration::from_secs(10);
/// Ray's default for `RAY_JOB_START_TIMEOUT_SECONDS`.
const DEFAULT_START_TIMEOUT: Duration = Duration::from_secs(900);
/// How often a stop is told again to the agent of a job that has not ended.
const STOP_RESEND: Duration = Duration::from_secs(5);

/// The leader's soft state about jobs (one leadership term).
#[derive(Default)]
pub(crate) struct JobsSoft {
    /// Jobs whose `StartJobSupervisor` is in flight.
    starting: HashSet<String>,
    /// When a placed job was first missing from its agent's heartbeat.
    missing_since: HashMap<String, Instant>,
    /// When a stop was last sent to a job's agent.
    stop_sent: HashMap<String, Instant>,
    /// Jobs with a status command in flight from the sweep.
    failing: HashSet<String>,
}

/// Ray's submission id: `raysubmit_` and 16 characters without look-alikes
/// (`ray/dashboard/modules/job/job_manager.py`, `generate_job_id`).
pub fn new_submission_id() -> String {
    use rand::Rng;
    const CHARS: &[u8] = b"ABCDEFGHJKMNPQRSTUVWXYZabcdefghijkmnpqrstuvwxyz123456789";
    let mut rng = rand::rng();
    let id: String = (0..16).map(|_| CHARS[rng.random_range(0..CHARS.len())] as char).collect();
    format!("raysubmit_{id}")
}

/// `RAY_JOB_START_TIMEOUT_SECONDS` (Ray's name), else 900 s.
fn start_timeout() -> Duration {
    tpuray_proto::runtime_env::env_seconds("RAY_JOB_START_TIMEOUT_SECONDS", DEFAULT_START_TIMEOUT)
}

/// A submitted job's record from the request, checked.
///
/// # Errors
/// `INVALID_ARGUMENT` naming the field: an empty entrypoint, a runtime environment that
/// is not a JSON object, a negative or non-finite entrypoint resource, a label selector
/// that does not parse.
fn record_from_request(job: pb::JobSubmission) -> Result<SubmissionRecord, Status> {
    if job.entrypoint.trim().is_empty() {
        return Err(Status::invalid_argument("entrypoint must be a non-empty shell command"));
    }
    let runtime_env_json = if job.runtime_env_json.trim().is_empty() {
        String::new()
    } else {
        let v: serde_json::Value = serde_json::from_str(&job.runtime_env_json)
            .map_err(|e| Status::invalid_argument(format!("runtime_env is not JSON: {e}")))?;
        if !v.is_object() {
            return Err(Status::invalid_argument(format!(
                "runtime_env must be a JSON object (got {v})"
            )));
        }
        v.to_string()
    };
    let check = |what: &str, v: Option<f64>| match v {
        Some(x) if !x.is_finite() || x < 0.0 => {
            Err(Status::invalid_argument(format!("{what} must be a non-negative number (got {x})")))
        }
        _ => Ok(()),
    };
    check("entrypoint_num_cpus", job.entrypoint_num_cpus)?;
    check("entrypoint_num_gpus", job.entrypoint_num_gpus)?;
    for (k, v) in &job.entrypoint_resources {
        check(&format!("entrypoint_resources[{k:?}]"), Some(*v))?;
    }
    let selector: BTreeMap<String, String> = job.entrypoint_label_selector.into_iter().collect();
    tpuray_scheduler::labels::parse_label_selector(&selector)
        .map_err(|e| Status::invalid_argument(format!("entrypoint_label_selector: {e}")))?;
    let submission_id =
        if job.submission_id.is_empty() { new_submission_id() } else { job.submission_id };
    let rec = SubmissionRecord {
        submission_id,
        status: SubmissionStatus::Pending,
        entrypoint: job.entrypoint,
        message: String::new(),
        error_type: String::new(),
        submit_time_ms: now_ms(),
        start_time_ms: 0,
        end_time_ms: 0,
        metadata: job.metadata.into_iter().collect(),
        runtime_env_json,
        entrypoint_num_cpus: job.entrypoint_num_cpus,
        entrypoint_num_gpus: job.entrypoint_num_gpus,
        entrypoint_memory: job.entrypoint_memory,
        entrypoint_resources: job.entrypoint_resources.into_iter().collect(),
        entrypoint_label_selector: selector,
        placed: None,
        driver_exit_code: None,
        driver: None,
        stop_requested: false,
    };
    ResourceSet::from_f64_map(&rec.entrypoint_resource_map())
        .map_err(|e| Status::invalid_argument(format!("entrypoint resources: {e}")))?;
    Ok(SubmissionRecord { message: pending_message(&rec), ..rec })
}

/// Ray's PENDING message, with its hints about resources and the runtime environment.
fn pending_message(rec: &SubmissionRecord) -> String {
    let mut m = SubmissionStatus::Pending.default_message().to_string();
    if !rec.entrypoint_resource_map().is_empty() {
        m.push_str(
            " It may be waiting for resources (CPUs, GPUs, memory, custom resources) to become available.",
        );
    }
    if !rec.runtime_env_json.is_empty() && rec.runtime_env_json != "{}" {
        m.push_str(" It may be waiting for the runtime environment to be set up.");
    }
    m
}

impl Head {
    pub(crate) async fn submit_job(
        &self,
        req: pb::SubmitJobRequest,
    ) -> Result<pb::SubmitJobReply, Status> {
        let job = req.job.ok_or_else(|| Status::invalid_argument("missing job"))?;
        let rec = record_from_request(job)?;
        match self
            .commit(Command {
                request_id: req.request_id,
                kind: SubmissionCommand::Submit(Box::new(rec)).into(),
            })
            .await?
        {
            Outcome::Submission(submission_id) => {
                self.placement_wake.notify_one();
                Ok(pb::SubmitJobReply { submission_id })
            }
            Outcome::Rejected(r) => Err(rejection_status(r)),
            o => Err(Status::internal(format!("unexpected outcome {o:?}"))),
        }
    }

    pub(crate) fn get_job_submission(&self, id: &str) -> pb::GetJobSubmissionReply {
        let inner = self.lock();
        match inner.sm.find_submission(id) {
            Some(s) => pb::GetJobSubmissionReply { found: true, job: Some(submission_to_proto(s)) },
            None => pb::GetJobSubmissionReply { found: false, job: None },
        }
    }

    pub(crate) fn list_job_submissions(&self) -> pb::ListJobSubmissionsReply {
        let inner = self.lock();
        let mut jobs: Vec<pb::JobSubmission> =
            inner.sm.submissions.values().map(submission_to_proto).collect();
        jobs.sort_by_key(|j| j.submit_time_ms);
        pb::ListJobSubmissionsReply { jobs }
    }

    pub(crate) async fn stop_job(
        self: &Arc<Self>,
        req: pb::StopJobRequest,
    ) -> Result<bool, Status> {
        let stopped = match self
            .commit(Command {
                request_id: req.request_id,
                kind: SubmissionCommand::Stop { id: req.id.clone(), time_ms: now_ms() }.into(),
            })
            .await?
        {
            Outcome::Stopped(b) => b,
            Outcome::Rejected(r) => return Err(rejection_status(r)),
            o => return Err(Status::internal(format!("unexpected outcome {o:?}"))),
        };
        // Tell its agent now rather than at the next sweep.
        let placed = {
            let inner = self.lock();
            inner.sm.find_submission(&req.id).and_then(|s| {
                let (_, addr) = s.placed.as_ref()?;
                (!s.status.is_terminal()).then(|| (s.submission_id.clone(), addr.clone()))
            })
        };
        if let Some((sid, addr)) = placed {
            self.lock().jobs_soft.stop_sent.insert(sid.clone(), Instant::now());
            self.send_stop(&sid, &addr).await;
        }
        Ok(stopped)
    }

    pub(crate) async fn delete_job(&self, req: pb::DeleteJobRequest) -> Result<bool, Status> {
        match self
            .commit(Command {
                request_id: req.request_id,
                kind: SubmissionCommand::Delete { id: req.id }.into(),
            })
            .await?
        {
            Outcome::Deleted(b) => Ok(b),
            Outcome::Rejected(r) => Err(rejection_status(r)),
            o => Err(Status::internal(format!("unexpected outcome {o:?}"))),
        }
    }

    pub(crate) async fn report_job_status(
        self: &Arc<Self>,
        req: pb::ReportJobStatusRequest,
    ) -> Result<(), Status> {
        let status = SubmissionStatus::parse(&req.status).map_err(Status::invalid_argument)?;
        if req.node_id.is_empty() {
            return Err(Status::invalid_argument("missing node_id"));
        }
        let change = StatusChange {
            status,
            message: req.message,
            error_type: req.error_type,
            exit_code: req.exit_code,
            time_ms: now_ms(),
        };
        self.set_job_status(
            req.request_id,
            req.submission_id,
            Some(NodeId::from_wire(req.node_id)),
            change,
        )
        .await
    }

    /// Commits a status; when the job ended, stops the actor workers of the drivers it
    /// started (their records ended with it, in the same command).
    async fn set_job_status(
        self: &Arc<Self>,
        request_id: String,
        submission_id: String,
        from: Option<NodeId>,
        change: StatusChange,
    ) -> Result<(), Status> {
        let terminal = change.status.is_terminal();
        let drivers: HashSet<_> = if terminal {
            let inner = self.lock();
            inner
                .sm
                .jobs
                .values()
                .filter(|j| j.submission_id == submission_id)
                .map(|j| j.job_id.clone())
                .collect()
        } else {
            HashSet::new()
        };
        let driver_actors = self.alive_actor_agents(|a| drivers.contains(&a.job_id) && !a.detached);
        let why = format!("the task's job (submission {submission_id}) ended before it did");
        let ended: HashMap<String, String> =
            drivers.into_iter().map(|j| (j.to_string(), why.clone())).collect();
        let cmd = SubmissionCommand::Status { submission_id, from, change };
        if let Outcome::Rejected(r) = self.commit(Command { request_id, kind: cmd.into() }).await? {
            return Err(rejection_status(r));
        }
        // The command finished the drivers' jobs too.
        self.after_jobs_ended(driver_actors, &ended);
        Ok(())
    }

    async fn send_stop(&self, submission_id: &str, address: &str) {
        let Ok(mut agent) = self.agent_client(address) else { return };
        let req = pb::StopJobSupervisorRequest { submission_id: submission_id.into() };
        if let Err(e) = agent.stop_job_supervisor(req).await {
            tracing::warn!(%submission_id, %address, "cannot stop the job's supervisor yet: {}", e.message());
        }
    }

    /// One pass of the leader's job sweep (see the module docs). Takes the lock briefly;
    /// the calls it makes run on their own tasks.
    pub(crate) fn sweep_jobs(self: &Arc<Self>) {
        if !self.is_leader() {
            return;
        }
        enum Act {
            Fail(String, String, &'static str),
            Place(Box<SubmissionRecord>),
            Stop(String, String),
        }
        let timeout = start_timeout();
        let now = now_ms();
        let mut acts = Vec::new();
        {
            let mut guard = self.lock();
            let inner = &mut *guard;
            if inner.sm.submissions.values().all(|s| s.status.is_terminal()) {
                inner.jobs_soft = JobsSoft::default();
                return;
            }
            let soft = &mut inner.jobs_soft;
            for s in inner.sm.submissions.values().filter(|s| !s.status.is_terminal()) {
                let id = &s.submission_id;
                if soft.failing.contains(id) || soft.starting.contains(id) {
                    continue;
                }
                match &s.placed {
                    None if s.stop_requested => {}
                    None => {
                        let waited = Duration::from_millis(now.saturating_sub(s.submit_time_ms));
                        if waited > timeout {
                            acts.push(Act::Fail(
                                id.clone(),
                                format!(
                                    "Job supervisor actor failed to start within {:.1} seconds. This timeout can be \
                                     configured by setting the environment variable RAY_JOB_START_TIMEOUT_SECONDS. \
                                     This may be because the job entrypoint's specified resources (entrypoint_num_cpus, \
                                     entrypoint_num_gpus, entrypoint_resources, entrypoint_memory) aren't available on \
                                     the cluster: {}",
                                    timeout.as_secs_f64(),
                                    s.message
                                ),
                                "JOB_SUPERVISOR_ACTOR_START_TIMEOUT",
                            ));
                        } else {
                            acts.push(Act::Place(Box::new(s.clone())));
                        }
                    }
                    Some((node_id, address)) => {
                        let node = inner.sm.nodes.get(node_id);
                        if let Some(reason) = node.and_then(|n| match &n.status {
                            NodeStatus::Dead { reason } => Some(reason.clone()),
                            NodeStatus::Alive => None,
                        }) {
                            acts.push(Act::Fail(
                                id.clone(),
                                format!(
                                    "Job supervisor actor died: the node running the job's entrypoint ({node_id} at \
                                     {address}) died: {reason}"
                                ),
                                "JOB_SUPERVISOR_ACTOR_DIED",
                            ));
                            continue;
                        }
                        let listed = inner
                            .soft
                            .get(node_id)
                            .filter(|n| n.reported)
                            .map(|n| n.job_submissions.contains(id));
                        match listed {
                            Some(false) => {
                                let since = *soft
                                    .missing_since
                                    .entry(id.clone())
                                    .or_insert_with(Instant::now);
                                if since.elapsed() >= SUPERVISOR_LOST_AFTER {
                                    acts.push(Act::Fail(
                                        id.clone(),
                                        format!(
                                            "Job supervisor actor died: the node agent at {address} (node {node_id}) \
                                             no longer runs the job's entrypoint"
                                        ),
                                        "JOB_SUPERVISOR_ACTOR_DIED",
                                    ));
                                }
                            }
                            Some(true) => {
                                soft.missing_since.remove(id);
                            }
                            None => {} // not heard from yet this term
                        }
                        if s.stop_requested
                            && soft.stop_sent.get(id).is_none_or(|t| t.elapsed() >= STOP_RESEND)
                        {
                            soft.stop_sent.insert(id.clone(), Instant::now());
                            acts.push(Act::Stop(id.clone(), address.clone()));
                        }
                    }
                }
            }
            for a in &acts {
                match a {
                    Act::Fail(id, _, _) => {
                        soft.failing.insert(id.clone());
                    }
                    Act::Place(s) => {
                        soft.starting.insert(s.submission_id.clone());
                    }
                    Act::Stop(..) => {}
                }
            }
        }
        let mut placing = Vec::new();
        for a in acts {
            let head = Arc::clone(self);
            match a {
                Act::Fail(id, message, error_type) => {
                    tokio::spawn(async move {
                        let change = StatusChange {
                            message,
                            error_type: error_type.into(),
                            ..StatusChange::plain(SubmissionStatus::Failed, now_ms())
                        };
                        let r = head
                            .set_job_status(
                                tpuray_proto::new_request_id(),
                                id.clone(),
                                None,
                                change,
                            )
                            .await;
                        if let Err(e) = r {
                            tracing::warn!(submission_id = %id, "cannot fail the job yet: {}", e.message());
                        }
                        head.lock().jobs_soft.failing.remove(&id);
                    });
                }
                Act::Stop(id, address) => {
                    tokio::spawn(async move { head.send_stop(&id, &address).await });
                }
                Act::Place(s) => placing.push(*s),
            }
        }
        if !placing.is_empty() {
            self.place_job_supervisors(placing);
        }
    }

    /// Chooses a node for each job and starts its supervisor there.
    fn place_job_supervisors(self: &Arc<Self>, jobs: Vec<SubmissionRecord>) {
        let mut starts = Vec::new();
        {
            let inner = self.lock();
            let mut views = Self::alive_views(&inner);
            for s in jobs {
                let demand =
                    ResourceSet::from_f64_map(&s.entrypoint_resource_map()).unwrap_or_default();
                let label_selector =
                    tpuray_scheduler::labels::parse_label_selector(&s.entrypoint_label_selector)
                        .unwrap_or_default();
                // Ray runs an entrypoint that asks for nothing on the head node.
                let head_node = inner
                    .sm
                    .nodes
                    .values()
                    .find(|n| n.is_head_node && n.status == NodeStatus::Alive)
                    .map(|n| n.node_id.to_string());
                let strategy = match head_node {
                    Some(node) if demand.is_empty() && label_selector.is_empty() => {
                        tpuray_scheduler::Strategy::NodeAffinity { node, soft: true }
                    }
                    _ => tpuray_scheduler::Strategy::Default,
                };
                let req =
                    tpuray_scheduler::Request { demand: demand.clone(), strategy, label_selector };
                match tpuray_scheduler::schedule(&req, &views, None, now_ms()) {
                    Decision::Place(node) => {
                        if let Some(v) = views.iter_mut().find(|v| v.id == node) {
                            v.available.saturating_sub(&demand);
                        }
                        let node_id = NodeId::from_wire(node);
                        if let Some(n) = inner.sm.nodes.get(&node_id) {
                            starts.push((s, node_id, n.address.clone()));
                            continue;
                        }
                        starts_failed(self, &s.submission_id);
                    }
                    Decision::Queue { reason } | Decision::Infeasible { reason } => {
                        tracing::debug!(submission_id = %s.submission_id, %reason, "job waits for a node");
                        starts_failed(self, &s.submission_id);
                    }
                }
            }
        }
        for (s, node_id, address) in starts {
            let head = Arc::clone(self);
            tokio::spawn(async move { head.start_job_supervisor(s, node_id, address).await });
        }
    }

    async fn start_job_supervisor(
        self: Arc<Self>,
        s: SubmissionRecord,
        node_id: NodeId,
        address: String,
    ) {
        let id = s.submission_id.clone();
        let result = async {
            let assign = SubmissionCommand::Assign {
                submission_id: id.clone(),
                node_id: node_id.clone(),
                address: address.clone(),
            };
            match self
                .commit(Command { request_id: tpuray_proto::new_request_id(), kind: assign.into() })
                .await?
            {
                Outcome::Done => {}
                Outcome::Rejected(r) => return Err(rejection_status(r)),
                o => return Err(Status::internal(format!("unexpected outcome {o:?}"))),
            }
            let placed = {
                let inner = self.lock();
                inner.sm.submissions.get(&id).map(submission_to_proto)
            };
            let mut agent = self.agent_client(&address)?;
            agent.start_job_supervisor(pb::StartJobSupervisorRequest { job: placed }).await?;
            Ok::<(), Status>(())
        }
        .await;
        if let Err(e) = result {
            tracing::warn!(submission_id = %id, %address, "job supervisor did not start: {}", e.message());
            let un = SubmissionCommand::Unassign {
                submission_id: id.clone(),
                node_id,
                reason: format!("the node agent at {address} did not start it: {}", e.message()),
            };
            let _ = self
                .commit(Command { request_id: tpuray_proto::new_request_id(), kind: un.into() })
                .await;
        }
        self.lock().jobs_soft.starting.remove(&id);
    }
}

fn starts_failed(head: &Head, submission_id: &str) {
    head.lock().jobs_soft.starting.remove(submission_id);
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn submission_ids_look_like_rays() {
        let id = new_submission_id();
        assert!(id.starts_with("raysubmit_"), "{id}");
        assert_eq!(id.len(), "raysubmit_".len() + 16);
        assert!(!id[10..].contains(['I', 'l', 'o', 'O', '0']), "{id}");
    }

    /// HTTP-3: a bad submission is refused with a message naming the field.
    #[test]
    fn a_request_is_checked_field_by_field() {
        let ok = pb::JobSubmission { entrypoint: "echo hi".into(), ..Default::default() };
        let rec = record_from_request(ok.clone()).unwrap();
        assert_eq!(rec.message, "Job has not started yet.");
        let e =
            record_from_request(pb::JobSubmission { entrypoint: " ".into(), ..Default::default() })
                .unwrap_err();
        assert!(e.message().contains("entrypoint"), "{e}");
        let e =
            record_from_request(pb::JobSubmission { runtime_env_json: "[1]".into(), ..ok.clone() })
                .unwrap_err();
        assert!(e.message().contains("runtime_env must be a JSON object"), "{e}");
        let e = record_from_request(pb::JobSubmission {
            entrypoint_num_cpus: Some(-1.0),
            ..ok.clone()
        })
        .unwrap_err();
        assert!(e.message().contains("entrypoint_num_cpus"), "{e}");
        let rec = record_from_request(pb::JobSubmission {
            entrypoint_num_cpus: Some(1.0),
            runtime_env_json: r#"{"pip": ["x"]}"#.into(),
            ..ok
        })
        .unwrap();
        assert!(rec.message.contains("waiting for resources"), "{}", rec.message);
        assert!(rec.message.contains("runtime environment"), "{}", rec.message);
    }
}
