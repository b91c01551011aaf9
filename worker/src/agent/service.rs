//! The node agent's gRPC service: each `NodeAgentService` handler reads its wire
//! message, calls the agent, and answers; [`AgentError`]s, the ledger's errors and the
//! log files' [`LogFileError`]s become gRPC statuses here and nowhere else.

use std::sync::Arc;
use std::time::{Duration, Instant};

use tonic::{Request, Response, Status};
use tpuray_proto::check_protocol_version;
use tpuray_proto::convert::{labels_from_proto, resources_from_proto};
use tpuray_proto::ids::{ActorId, JobId, LeaseId, NodeId, WorkerId};
use tpuray_proto::pb;
use tpuray_proto::pb::node_agent_service_server::NodeAgentService;
use tpuray_proto::runtime_env::SETUP_FAILED_PREFIX;

use super::{Agent, AgentError, PoolKey};
use crate::ledger::LedgerError;
use crate::logfiles::LogFileError;

/// The gRPC status an [`AgentError`] is answered with (each variant's doc names its
/// code); a ledger refusal as [`ledger_status`] says.
pub(super) fn to_status(e: AgentError) -> Status {
    match e {
        AgentError::Unavailable(m) => Status::unavailable(m),
        AgentError::BadRequest(m) => Status::invalid_argument(m),
        AgentError::Refused(m) => Status::failed_precondition(m),
        AgentError::SetupFailed(m) => {
            Status::failed_precondition(format!("{SETUP_FAILED_PREFIX}{m}"))
        }
        AgentError::NotFound(m) => Status::not_found(m),
        AgentError::Timeout(m) => Status::deadline_exceeded(m),
        AgentError::Ledger { node, error } => ledger_status(error, &node),
        AgentError::Head { code, message } => Status::new(code, message),
        AgentError::Internal(m) => Status::internal(m),
    }
}

/// The gRPC status a ledger refusal on node `node` is answered with, its message
/// prefixed with the node: `RESOURCE_EXHAUSTED`, `NOT_FOUND` (a bundle not prepared),
/// `FAILED_PRECONDITION` (no such devices), `INVALID_ARGUMENT` or `UNAVAILABLE` (devices
/// busy: retry shortly).
fn ledger_status(e: LedgerError, node: &NodeId) -> Status {
    let msg = format!("node {node}: {e}");
    match e {
        LedgerError::Exhausted { .. } => Status::resource_exhausted(msg),
        LedgerError::BundleNotPrepared { .. } => Status::not_found(msg),
        LedgerError::NoDevices(_) => Status::failed_precondition(msg),
        LedgerError::Invalid(_) => Status::invalid_argument(msg),
        LedgerError::DevicesBusy(_) => Status::unavailable(msg),
    }
}

/// The gRPC status a [`LogFileError`] is answered with: `INVALID_ARGUMENT` for a glob
/// or name the request got wrong, `INTERNAL` when the node cannot read the file.
fn log_status(e: LogFileError) -> Status {
    let msg = e.to_string();
    match e {
        LogFileError::BadGlob { .. }
        | LogFileError::NameOutside(_)
        | LogFileError::NotPlainFile(_)
        | LogFileError::ResolvesOutside(_) => Status::invalid_argument(msg),
        LogFileError::Io { .. } => Status::internal(msg),
    }
}

impl From<Status> for AgentError {
    /// A failed call to the head (or to another process) while serving a request: its
    /// code and message, passed on as given.
    fn from(s: Status) -> Self {
        AgentError::Head { code: s.code(), message: s.message().to_string() }
    }
}

/// The gRPC service over a shared [`Agent`].
#[derive(Clone)]
pub struct AgentSvc(pub Arc<Agent>);

#[tonic::async_trait]
impl NodeAgentService for AgentSvc {
    async fn get_node_info(
        &self,
        _req: Request<pb::GetNodeInfoRequest>,
    ) -> Result<Response<pb::GetNodeInfoReply>, Status> {
        Ok(Response::new(pb::GetNodeInfoReply { node: Some(self.0.node_info()) }))
    }

    async fn request_worker_lease(
        &self,
        req: Request<pb::RequestWorkerLeaseRequest>,
    ) -> Result<Response<pb::RequestWorkerLeaseReply>, Status> {
        let req = req.into_inner();
        let agent = &self.0;
        agent.refuse_if_draining().map_err(to_status)?;
        let demand = resources_from_proto(&req.resources)
            .map_err(|e| Status::invalid_argument(format!("lease resources: {e}")))?;
        let label_selector =
            labels_from_proto(&req.label_selector).map_err(Status::invalid_argument)?;
        let strategy = tpuray_proto::convert::strategy_from_proto(req.strategy.as_ref());
        let key = PoolKey {
            job_id: req.job_id.clone(),
            language: if req.language.is_empty() { "rust".into() } else { req.language.clone() },
            runtime_env_hash: req.runtime_env_hash.clone(),
            tpu_chips: vec![],
            gpus: vec![],
        };
        let request = tpuray_scheduler::Request { demand, strategy, label_selector };
        let deadline = (req.queue_timeout_ms > 0)
            .then(|| Instant::now() + Duration::from_millis(req.queue_timeout_ms));
        let outcome = agent
            .request_lease(key, request, deadline, req.grant_or_reject, req.owner_address)
            .await
            .map_err(to_status)?;
        Ok(Response::new(pb::RequestWorkerLeaseReply { outcome: Some(outcome) }))
    }

    async fn notify_worker_blocked(
        &self,
        req: Request<pb::NotifyWorkerBlockedRequest>,
    ) -> Result<Response<pb::NotifyWorkerBlockedReply>, Status> {
        let req = req.into_inner();
        self.0.set_blocked(&WorkerId::from_wire(req.worker_id), req.blocked);
        Ok(Response::new(pb::NotifyWorkerBlockedReply {}))
    }

    async fn return_worker_lease(
        &self,
        req: Request<pb::ReturnWorkerLeaseRequest>,
    ) -> Result<Response<pb::ReturnWorkerLeaseReply>, Status> {
        let req = req.into_inner();
        self.0.return_lease(&LeaseId::from_wire(req.lease_id), req.disconnect_worker);
        Ok(Response::new(pb::ReturnWorkerLeaseReply {}))
    }

    async fn report_metrics(
        &self,
        req: Request<pb::ReportMetricsRequest>,
    ) -> Result<Response<pb::ReportMetricsReply>, Status> {
        let defs_known = self.0.metrics.report(req.into_inner());
        Ok(Response::new(pb::ReportMetricsReply { defs_known }))
    }

    async fn register_worker(
        &self,
        req: Request<pb::RegisterWorkerRequest>,
    ) -> Result<Response<pb::RegisterWorkerReply>, Status> {
        let req = req.into_inner();
        check_protocol_version("worker", req.protocol_version)?; // PROTO-1
        self.0
            .worker_registered(&WorkerId::from_wire(req.worker_id), req.address, req.pid)
            .map_err(to_status)?;
        Ok(Response::new(pb::RegisterWorkerReply {
            node_id: self.0.config.node_id.to_string(),
            head_address: self.0.config.head_address.clone(),
        }))
    }

    async fn start_actor_worker(
        &self,
        req: Request<pb::StartActorWorkerRequest>,
    ) -> Result<Response<pb::StartActorWorkerReply>, Status> {
        let req = req.into_inner();
        let actor_id = ActorId::from_wire(req.actor_id);
        let resources = resources_from_proto(&req.resources)
            .map_err(|e| Status::invalid_argument(format!("actor resources: {e}")))?;
        let job_id = JobId::from_wire(req.job_id);
        let (worker_id, worker_address, pid) = self
            .0
            .start_actor_worker(&actor_id, &job_id, resources, &req.creation_task)
            .await
            .map_err(to_status)?;
        Ok(Response::new(pb::StartActorWorkerReply {
            worker_id: worker_id.to_string(),
            worker_address,
            pid,
        }))
    }

    async fn kill_actor_worker(
        &self,
        req: Request<pb::KillActorWorkerRequest>,
    ) -> Result<Response<pb::KillActorWorkerReply>, Status> {
        let req = req.into_inner();
        let actor_id = ActorId::from_wire(req.actor_id);
        let only = (!req.worker_id.is_empty()).then(|| WorkerId::from_wire(req.worker_id));
        let killed = self.0.kill_actor_worker(&actor_id, only.as_ref(), req.restart, req.force);
        Ok(Response::new(pb::KillActorWorkerReply { killed }))
    }

    async fn prepare_bundles(
        &self,
        req: Request<pb::PrepareBundlesRequest>,
    ) -> Result<Response<pb::PrepareBundlesReply>, Status> {
        let req = req.into_inner();
        if req.placement_group_id.is_empty() {
            return Err(Status::invalid_argument("missing placement_group_id"));
        }
        let bundles = req
            .bundles
            .iter()
            .map(|b| {
                resources_from_proto(&b.resources)
                    .map(|r| (b.index, r))
                    .map_err(|e| Status::invalid_argument(format!("bundle {}: {e}", b.index)))
            })
            .collect::<Result<Vec<_>, _>>()?;
        self.0.prepare_bundles(&req.placement_group_id, &bundles).map_err(to_status)?;
        if !req.commit {
            return Ok(Response::new(pb::PrepareBundlesReply { resources: None }));
        }
        let indexes: Vec<u32> = bundles.iter().map(|b| b.0).collect();
        self.0.commit_bundles(&req.placement_group_id, &indexes).map_err(to_status)?;
        let names = self.0.bundle_names(&req.placement_group_id, &indexes);
        Ok(Response::new(pb::PrepareBundlesReply { resources: Some(self.0.resources_of(&names)) }))
    }

    async fn commit_bundles(
        &self,
        req: Request<pb::CommitBundlesRequest>,
    ) -> Result<Response<pb::CommitBundlesReply>, Status> {
        let req = req.into_inner();
        self.0.commit_bundles(&req.placement_group_id, &req.indexes).map_err(to_status)?;
        let names = self.0.bundle_names(&req.placement_group_id, &req.indexes);
        Ok(Response::new(pb::CommitBundlesReply { resources: Some(self.0.resources_of(&names)) }))
    }

    async fn return_bundles(
        &self,
        req: Request<pb::ReturnBundlesRequest>,
    ) -> Result<Response<pb::ReturnBundlesReply>, Status> {
        let req = req.into_inner();
        let names = self.0.bundle_names(&req.placement_group_id, &req.indexes);
        let workers_stopped = self.0.return_bundles(&req.placement_group_id, &req.indexes);
        if workers_stopped > 0 {
            tracing::info!(pg = %req.placement_group_id, workers_stopped, "stopped workers of a returned placement group");
        }
        Ok(Response::new(pb::ReturnBundlesReply {
            workers_stopped,
            resources: Some(self.0.resources_of(&names)),
        }))
    }

    async fn start_job_supervisor(
        &self,
        req: Request<pb::StartJobSupervisorRequest>,
    ) -> Result<Response<pb::StartJobSupervisorReply>, Status> {
        let job = req.into_inner().job.ok_or_else(|| Status::invalid_argument("missing job"))?;
        self.0.start_job_supervisor(job).await.map_err(to_status)?;
        Ok(Response::new(pb::StartJobSupervisorReply {}))
    }

    async fn stop_job_supervisor(
        &self,
        req: Request<pb::StopJobSupervisorRequest>,
    ) -> Result<Response<pb::StopJobSupervisorReply>, Status> {
        let found = self.0.stop_job_supervisor(&req.into_inner().submission_id);
        Ok(Response::new(pb::StopJobSupervisorReply { found }))
    }

    async fn list_logs(
        &self,
        req: Request<pb::ListLogsRequest>,
    ) -> Result<Response<pb::ListLogsReply>, Status> {
        let dir = self.0.config.session_dir.join("logs");
        let glob = req.into_inner().glob;
        let files = tokio::task::spawn_blocking(move || crate::logfiles::list(&dir, &glob))
            .await
            .map_err(|e| Status::internal(e.to_string()))?
            .map_err(log_status)?;
        Ok(Response::new(pb::ListLogsReply { files }))
    }

    async fn read_log(
        &self,
        req: Request<pb::ReadLogRequest>,
    ) -> Result<Response<pb::ReadLogReply>, Status> {
        let dir = self.0.config.session_dir.join("logs");
        let req = req.into_inner();
        let r = tokio::task::spawn_blocking(move || crate::logfiles::read(&dir, &req))
            .await
            .map_err(|e| Status::internal(e.to_string()))?
            .map_err(log_status)?;
        Ok(Response::new(r))
    }

    async fn read_job_logs(
        &self,
        req: Request<pb::ReadJobLogsRequest>,
    ) -> Result<Response<pb::ReadJobLogsReply>, Status> {
        self.0.read_job_logs(req.into_inner()).await.map(Response::new).map_err(to_status)
    }

    async fn prestart_workers(
        &self,
        req: Request<pb::PrestartWorkersRequest>,
    ) -> Result<Response<pb::PrestartWorkersReply>, Status> {
        let req = req.into_inner();
        if req.job_id.is_empty() {
            return Err(Status::invalid_argument("missing job_id"));
        }
        let key = PoolKey {
            job_id: req.job_id,
            language: if req.language.is_empty() { "rust".into() } else { req.language },
            runtime_env_hash: req.runtime_env_hash,
            tpu_chips: vec![],
            gpus: vec![],
        };
        let n = self.0.prestart_workers(key, req.count);
        Ok(Response::new(pb::PrestartWorkersReply { started: n }))
    }

    async fn list_workers(
        &self,
        _req: Request<pb::ListWorkersRequest>,
    ) -> Result<Response<pb::ListWorkersReply>, Status> {
        let workers = self.0.list_workers();
        Ok(Response::new(pb::ListWorkersReply { workers }))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The codes a ledger refusal is answered with (moved here from the ledger's tests
    /// with the conversion).
    #[test]
    fn ledger_refusals_keep_their_codes_and_name_the_node() {
        let set = |json: &str| tpuray_scheduler::ResourceSet::from_json(json).unwrap();
        let mut l = crate::ledger::Ledger::new(set(r#"{"CPU": 4, "TPU": 4}"#));
        let n1 = NodeId::from_wire("n1");
        let cpus = set(r#"{"CPU": 8}"#);
        let s = ledger_status(l.take("a lease", &cpus).unwrap_err(), &n1);
        assert_eq!(s.code(), tonic::Code::ResourceExhausted);
        assert!(s.message().starts_with("node n1: cannot reserve a lease: needs"), "{s:?}");
        let s = ledger_status(l.commit_bundles("pg1", &[0]).unwrap_err(), &n1);
        assert_eq!(s.code(), tonic::Code::NotFound);
        l.allocate_chips(4, None).unwrap();
        let s = ledger_status(l.allocate_chips(4, None).unwrap_err(), &n1);
        assert_eq!(s.code(), tonic::Code::Unavailable);
        for (e, code) in [
            (LedgerError::NoDevices("GPUs"), tonic::Code::FailedPrecondition),
            (LedgerError::Invalid("3 chips".into()), tonic::Code::InvalidArgument),
        ] {
            let msg = format!("node n1: {e}");
            let s = ledger_status(e, &n1);
            assert_eq!((s.code(), s.message()), (code, msg.as_str()));
        }
    }

    #[test]
    fn log_file_errors_keep_their_codes_and_messages() {
        let d = tempfile::tempdir().unwrap();
        let glob = crate::logfiles::list(d.path(), "[").unwrap_err();
        let glob_msg = glob.to_string();
        let s = log_status(glob);
        assert_eq!((s.code(), s.message()), (tonic::Code::InvalidArgument, glob_msg.as_str()));
        for (e, code) in [
            (LogFileError::NameOutside("../x".into()), tonic::Code::InvalidArgument),
            (LogFileError::NotPlainFile("sub".into()), tonic::Code::InvalidArgument),
            (LogFileError::ResolvesOutside("up/x".into()), tonic::Code::InvalidArgument),
            (
                LogFileError::Io {
                    path: "/logs/a.out".into(),
                    error: std::io::Error::from(std::io::ErrorKind::PermissionDenied),
                },
                tonic::Code::Internal,
            ),
        ] {
            let msg = e.to_string();
            let s = log_status(e);
            assert_eq!((s.code(), s.message()), (code, msg.as_str()));
        }
        let io = LogFileError::Io {
            path: "/logs/a.out".into(),
            error: std::io::Error::from(std::io::ErrorKind::PermissionDenied),
        };
        assert_eq!(io.to_string(), "/logs/a.out: permission denied");
    }
}
