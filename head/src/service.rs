//! `HeadService`: the gRPC face of the head. Node and actor calls are `Head` methods in
//! `nodes.rs` and `actors.rs`; the others are answered here.

use std::pin::Pin;
use std::sync::Arc;

use tokio::sync::broadcast;
use tokio_stream::Stream;
use tonic::{Request, Response, Status};
use tpuray_proto::ids::JobId;
use tpuray_proto::pb::head_service_server::HeadService;
use tpuray_proto::{PROTOCOL_VERSION, check_protocol_version, now_ms, pb};

use crate::convert::{actor_to_proto, job_to_proto};
use crate::state::{Command, CommandKind, DEFAULT_NAMESPACE, JobRecord, JobStatus, Outcome};

use crate::server::{Head, MAX_TASKS_KEPT, rejection_status, require_id};

/// The gRPC service; wraps the shared [`Head`].
#[derive(Clone)]
pub struct HeadSvc(pub Arc<Head>);

type ChangeStream = Pin<Box<dyn Stream<Item = Result<pb::StateChange, Status>> + Send>>;

#[tonic::async_trait]
impl HeadService for HeadSvc {
    async fn get_head_info(
        &self,
        _req: Request<pb::GetHeadInfoRequest>,
    ) -> Result<Response<pb::GetHeadInfoReply>, Status> {
        let h = &self.0;
        Ok(Response::new(pb::GetHeadInfoReply {
            protocol_version: PROTOCOL_VERSION,
            auth_required: h.config.auth_required,
            tls: tpuray_proto::tls::enabled(),
            cluster_id: h.cluster_id(),
            version: env!("CARGO_PKG_VERSION").to_string(),
            heartbeat_interval_ms: h.config.heartbeat_interval.as_millis() as u64,
            node_death_timeout_ms: h.config.node_death_timeout.as_millis() as u64,
            dashboard_url: h.dashboard_url.get().cloned().unwrap_or_default(),
        }))
    }

    async fn register_node(
        &self,
        req: Request<pb::RegisterNodeRequest>,
    ) -> Result<Response<pb::RegisterNodeReply>, Status> {
        self.0.register_node(req).await
    }

    async fn heartbeat(
        &self,
        req: Request<pb::HeartbeatRequest>,
    ) -> Result<Response<pb::HeartbeatReply>, Status> {
        self.0.heartbeat(req).await
    }

    async fn unregister_node(
        &self,
        req: Request<pb::UnregisterNodeRequest>,
    ) -> Result<Response<pb::UnregisterNodeReply>, Status> {
        self.0.unregister_node(req).await
    }

    async fn get_cluster_status(
        &self,
        _req: Request<pb::GetClusterStatusRequest>,
    ) -> Result<Response<pb::GetClusterStatusReply>, Status> {
        self.0.get_cluster_status(_req).await
    }

    async fn register_job(
        &self,
        req: Request<pb::RegisterJobRequest>,
    ) -> Result<Response<pb::RegisterJobReply>, Status> {
        let req = req.into_inner();
        check_protocol_version("driver", req.protocol_version)?; // PROTO-1
        let job = JobRecord {
            job_id: JobId::random(),
            status: JobStatus::Running,
            driver_address: req.driver_address,
            driver_pid: req.driver_pid,
            entrypoint: req.entrypoint,
            namespace: if req.namespace.is_empty() {
                DEFAULT_NAMESPACE.to_string()
            } else {
                req.namespace
            },
            start_time_ms: now_ms(),
            end_time_ms: 0,
            worker_binary_hash: req.worker_binary_hash,
            submission_id: req.submission_id,
        };
        let id = match self
            .0
            .commit(Command { request_id: req.request_id, kind: CommandKind::RegisterJob(job) })
            .await?
        {
            Outcome::Job(id) => id,
            Outcome::Rejected(r) => return Err(rejection_status(r)),
            o => return Err(Status::internal(format!("unexpected outcome {o:?}"))),
        };
        let job = self.0.lock().sm.jobs.get(&id).map(job_to_proto);
        Ok(Response::new(pb::RegisterJobReply { job }))
    }

    async fn finish_job(
        &self,
        req: Request<pb::FinishJobRequest>,
    ) -> Result<Response<pb::FinishJobReply>, Status> {
        let req = req.into_inner();
        require_id("job_id", &req.job_id)?;
        let job_id = JobId::from_wire(req.job_id);
        self.0.finish_job(req.request_id, job_id, "finished").await?;
        Ok(Response::new(pb::FinishJobReply {}))
    }

    async fn list_jobs(
        &self,
        _req: Request<pb::ListJobsRequest>,
    ) -> Result<Response<pb::ListJobsReply>, Status> {
        let inner = self.0.lock();
        Ok(Response::new(pb::ListJobsReply {
            jobs: inner.sm.jobs.values().map(job_to_proto).collect(),
        }))
    }

    async fn submit_job(
        &self,
        req: Request<pb::SubmitJobRequest>,
    ) -> Result<Response<pb::SubmitJobReply>, Status> {
        self.0.submit_job(req.into_inner()).await.map(Response::new)
    }

    async fn get_job_submission(
        &self,
        req: Request<pb::GetJobSubmissionRequest>,
    ) -> Result<Response<pb::GetJobSubmissionReply>, Status> {
        Ok(Response::new(self.0.get_job_submission(&req.into_inner().id)))
    }

    async fn list_job_submissions(
        &self,
        _req: Request<pb::ListJobSubmissionsRequest>,
    ) -> Result<Response<pb::ListJobSubmissionsReply>, Status> {
        Ok(Response::new(self.0.list_job_submissions()))
    }

    async fn stop_job(
        &self,
        req: Request<pb::StopJobRequest>,
    ) -> Result<Response<pb::StopJobReply>, Status> {
        let stopped = self.0.stop_job(req.into_inner()).await?;
        Ok(Response::new(pb::StopJobReply { stopped }))
    }

    async fn delete_job(
        &self,
        req: Request<pb::DeleteJobRequest>,
    ) -> Result<Response<pb::DeleteJobReply>, Status> {
        let deleted = self.0.delete_job(req.into_inner()).await?;
        Ok(Response::new(pb::DeleteJobReply { deleted }))
    }

    async fn report_job_status(
        &self,
        req: Request<pb::ReportJobStatusRequest>,
    ) -> Result<Response<pb::ReportJobStatusReply>, Status> {
        self.0.report_job_status(req.into_inner()).await?;
        Ok(Response::new(pb::ReportJobStatusReply {}))
    }

    async fn create_actor(
        &self,
        req: Request<pb::CreateActorRequest>,
    ) -> Result<Response<pb::CreateActorReply>, Status> {
        self.0.create_actor(req).await
    }

    async fn get_actor(
        &self,
        req: Request<pb::GetActorRequest>,
    ) -> Result<Response<pb::GetActorReply>, Status> {
        self.0.get_actor(req).await
    }

    async fn list_actors(
        &self,
        _req: Request<pb::ListActorsRequest>,
    ) -> Result<Response<pb::ListActorsReply>, Status> {
        self.0.list_actors(_req).await
    }

    async fn kill_actor(
        &self,
        req: Request<pb::KillActorRequest>,
    ) -> Result<Response<pb::KillActorReply>, Status> {
        self.0.kill_actor(req).await
    }

    async fn report_actor_worker_exit(
        &self,
        req: Request<pb::ReportActorWorkerExitRequest>,
    ) -> Result<Response<pb::ReportActorWorkerExitReply>, Status> {
        self.0.report_actor_worker_exit(req).await
    }

    async fn create_placement_group(
        &self,
        req: Request<pb::CreatePlacementGroupRequest>,
    ) -> Result<Response<pb::CreatePlacementGroupReply>, Status> {
        let info = self.0.create_placement_group(req.into_inner()).await?;
        Ok(Response::new(pb::CreatePlacementGroupReply { placement_group: Some(info) }))
    }

    async fn remove_placement_group(
        &self,
        req: Request<pb::RemovePlacementGroupRequest>,
    ) -> Result<Response<pb::RemovePlacementGroupReply>, Status> {
        self.0.remove_placement_group(req.into_inner()).await?;
        Ok(Response::new(pb::RemovePlacementGroupReply {}))
    }

    async fn get_placement_group(
        &self,
        req: Request<pb::GetPlacementGroupRequest>,
    ) -> Result<Response<pb::GetPlacementGroupReply>, Status> {
        let req = req.into_inner();
        let more_ids = req.more_ids.clone();
        let info = self.0.get_placement_group(req).await?;
        let more = self.0.pg_infos_by_id(&more_ids);
        Ok(Response::new(pb::GetPlacementGroupReply { placement_group: Some(info), more }))
    }

    async fn list_placement_groups(
        &self,
        _req: Request<pb::ListPlacementGroupsRequest>,
    ) -> Result<Response<pb::ListPlacementGroupsReply>, Status> {
        let inner = self.0.lock();
        let placement_groups =
            inner.sm.placement_groups.values().map(|p| self.0.pg_info(&inner, p)).collect();
        Ok(Response::new(pb::ListPlacementGroupsReply { placement_groups }))
    }

    async fn kv_put(
        &self,
        req: Request<pb::KvPutRequest>,
    ) -> Result<Response<pb::KvPutReply>, Status> {
        let req = req.into_inner();
        if req.key.is_empty() {
            return Err(Status::invalid_argument("kv key is empty"));
        }
        match self
            .0
            .commit(Command {
                request_id: req.request_id,
                kind: CommandKind::KvPut {
                    namespace: req.namespace,
                    key: req.key,
                    value: req.value,
                    overwrite: req.overwrite,
                },
            })
            .await?
        {
            Outcome::KvAdded(added) => Ok(Response::new(pb::KvPutReply { added })),
            Outcome::Rejected(r) => Err(rejection_status(r)),
            o => Err(Status::internal(format!("unexpected outcome {o:?}"))),
        }
    }

    async fn kv_get(
        &self,
        req: Request<pb::KvGetRequest>,
    ) -> Result<Response<pb::KvGetReply>, Status> {
        let req = req.into_inner();
        let inner = self.0.lock();
        let v = inner.sm.kv.get(&(req.namespace, req.key));
        Ok(Response::new(pb::KvGetReply {
            found: v.is_some(),
            value: v.cloned().unwrap_or_default(),
        }))
    }

    async fn kv_delete(
        &self,
        req: Request<pb::KvDeleteRequest>,
    ) -> Result<Response<pb::KvDeleteReply>, Status> {
        let req = req.into_inner();
        match self
            .0
            .commit(Command {
                request_id: req.request_id,
                kind: CommandKind::KvDelete { namespace: req.namespace, key: req.key },
            })
            .await?
        {
            Outcome::KvDeleted(deleted) => Ok(Response::new(pb::KvDeleteReply { deleted })),
            Outcome::Rejected(r) => Err(rejection_status(r)),
            o => Err(Status::internal(format!("unexpected outcome {o:?}"))),
        }
    }

    async fn kv_keys(
        &self,
        req: Request<pb::KvKeysRequest>,
    ) -> Result<Response<pb::KvKeysReply>, Status> {
        let req = req.into_inner();
        let inner = self.0.lock();
        let keys = inner
            .sm
            .kv
            .range((req.namespace.clone(), req.prefix.clone())..)
            .take_while(|((ns, k), _)| *ns == req.namespace && k.starts_with(&req.prefix))
            .map(|((_, k), _)| k.clone())
            .collect();
        Ok(Response::new(pb::KvKeysReply { keys }))
    }

    async fn report_task_events(
        &self,
        req: Request<pb::ReportTaskEventsRequest>,
    ) -> Result<Response<pb::ReportTaskEventsReply>, Status> {
        let mut guard = self.0.lock();
        let inner = &mut *guard;
        for e in req.into_inner().events {
            if !inner.tasks.contains_key(&e.task_id) {
                inner.task_order.push_back(e.task_id.clone());
                while inner.task_order.len() > MAX_TASKS_KEPT {
                    if let Some(old) = inner.task_order.pop_front() {
                        if let Some(t) = inner.tasks.remove(&old) {
                            inner.task_tally.forget(&t);
                        }
                        inner.tasks_dropped += 1;
                    }
                }
            }
            let t = inner.tasks.entry(e.task_id.clone()).or_insert_with(|| pb::TaskSummary {
                task_id: e.task_id.clone(),
                job_id: e.job_id.clone(),
                name: e.name.clone(),
                actor_id: e.actor_id.clone(),
                ..Default::default()
            });
            // LOGS-3: where the attempt's output lies; such an event changes no state.
            if let Some(info) = e.log_info {
                if e.attempt >= t.attempt {
                    t.log_info = Some(info);
                }
                if e.state.is_empty() {
                    continue;
                }
            }
            let counted = crate::metrics::TaskTally::slot(t);
            // Events from owner and executor may arrive in any order: a final
            // state is never overwritten by an earlier one.
            // A summary made from this very event has no state yet: any state wins.
            let rank = |s: &str| match s {
                "" => -1,
                "SUBMITTED" => 0,
                "RETRYING" => 1,
                "RUNNING" => 2,
                _ => 3,
            };
            if e.state == "SUBMITTED" {
                t.submitted_ms = e.time_ms;
            }
            if e.state == "RUNNING" && e.attempt >= t.attempt {
                t.started_ms = e.time_ms;
            }
            // Where it ran: the executor's RUNNING event, or the owner's
            // final event (the reply names the node) if that one was lost.
            if !e.node_id.is_empty() && (e.state == "RUNNING" || rank(&e.state) == 3) {
                t.node_id = e.node_id.clone();
                if !e.worker_id.is_empty() {
                    t.worker_id = e.worker_id.clone();
                }
            }
            if rank(&e.state) >= rank(&t.state) || e.attempt > t.attempt {
                t.state = e.state.clone();
                t.attempt = e.attempt;
                if rank(&e.state) == 3 {
                    t.finished_ms = e.time_ms;
                    t.error = e.error.clone();
                }
            }
            let now = crate::metrics::TaskTally::slot(t);
            if now != counted {
                inner.task_tally.moved(&t.job_id, &t.name, counted, now);
            }
        }
        Ok(Response::new(pb::ReportTaskEventsReply {}))
    }

    async fn list_tasks(
        &self,
        req: Request<pb::ListTasksRequest>,
    ) -> Result<Response<pb::ListTasksReply>, Status> {
        let limit = match req.into_inner().limit {
            0 => usize::MAX,
            n => n as usize,
        };
        let inner = self.0.lock();
        let tasks = inner
            .task_order
            .iter()
            .rev()
            .take(limit)
            .filter_map(|id| inner.tasks.get(id).cloned())
            .collect();
        Ok(Response::new(pb::ListTasksReply { tasks, dropped: inner.tasks_dropped }))
    }

    async fn get_replica_status(
        &self,
        _req: Request<pb::GetReplicaStatusRequest>,
    ) -> Result<Response<pb::GetReplicaStatusReply>, Status> {
        let h = &self.0;
        let st = h.replica_status().ok_or_else(|| Status::unavailable("the head is starting"))?;
        let addr = |id: u64| h.config.replica_address(id).unwrap_or_default();
        Ok(Response::new(pb::GetReplicaStatusReply {
            id: st.id,
            address: addr(st.id),
            role: st.role.name().to_string(),
            term: st.term,
            leader_id: st.leader_id,
            leader_address: if st.leader_id == 0 { String::new() } else { addr(st.leader_id) },
            leader_ready: st.leader_ready,
            commit_index: st.commit,
            applied_index: st.applied,
            first_index: st.first_index,
            last_index: st.last_index,
            snapshot_index: st.snapshot_index,
            peers: st
                .peers
                .iter()
                .map(|(id, m)| pb::ReplicaProgress {
                    id: *id,
                    address: addr(*id),
                    matched_index: *m,
                })
                .collect(),
            replicas: h.config.replicas(),
            data_dir: h
                .config
                .data_dir
                .as_ref()
                .map(|d| d.display().to_string())
                .unwrap_or_default(),
            last_snapshot_bytes: st.last_snapshot.bytes,
            last_snapshot_micros: st.last_snapshot.micros,
            snapshots_taken: st.snapshots_taken,
        }))
    }

    type SubscribeStream = ChangeStream;
    async fn subscribe(
        &self,
        req: Request<pb::SubscribeRequest>,
    ) -> Result<Response<Self::SubscribeStream>, Status> {
        let after = req.into_inner().after_seq;
        // Subscribe before reading the log so no change falls in between.
        let mut live = self.0.events.subscribe();
        let (backlog, resync) = {
            let inner = self.0.lock();
            let oldest = inner.changes.front().map(|c| c.seq).unwrap_or(inner.seq + 1);
            if after + 1 < oldest && after != 0 {
                // The client missed changes we no longer keep: send the current
                // state of everything instead, stamped with the latest seq.
                let seq = inner.seq;
                let mut snap: Vec<pb::StateChange> = Vec::new();
                for n in inner.sm.nodes.values() {
                    snap.push(pb::StateChange {
                        seq,
                        change: Some(pb::state_change::Change::Node(self.0.node_info(&inner, n))),
                    });
                }
                for j in inner.sm.jobs.values() {
                    snap.push(pb::StateChange {
                        seq,
                        change: Some(pb::state_change::Change::Job(job_to_proto(j))),
                    });
                }
                for a in inner.sm.actors.values() {
                    snap.push(pb::StateChange {
                        seq,
                        change: Some(pb::state_change::Change::Actor(actor_to_proto(a, None))),
                    });
                }
                for p in inner.sm.placement_groups.values() {
                    snap.push(pb::StateChange {
                        seq,
                        change: Some(pb::state_change::Change::PlacementGroup(
                            self.0.pg_info(&inner, p),
                        )),
                    });
                }
                (snap, true)
            } else {
                (inner.changes.iter().filter(|c| c.seq > after).cloned().collect::<Vec<_>>(), false)
            }
        };
        let mut last = backlog.last().map(|c| c.seq).unwrap_or(after);
        if resync {
            last = backlog.first().map(|c| c.seq).unwrap_or(after);
        }
        let (tx, rx) = tokio::sync::mpsc::channel(256);
        tokio::spawn(async move {
            for c in backlog {
                if tx.send(Ok(c)).await.is_err() {
                    return;
                }
            }
            loop {
                match live.recv().await {
                    Ok(c) if c.seq <= last => continue,
                    Ok(c) => {
                        last = c.seq;
                        if tx.send(Ok(c)).await.is_err() {
                            return;
                        }
                    }
                    Err(broadcast::error::RecvError::Lagged(n)) => {
                        let _ = tx
                            .send(Err(Status::data_loss(format!(
                                "subscriber fell behind by {n} changes; resubscribe after seq {last}"
                            ))))
                            .await;
                        return;
                    }
                    Err(broadcast::error::RecvError::Closed) => return,
                }
            }
        });
        Ok(Response::new(Box::pin(tokio_stream::wrappers::ReceiverStream::new(rx))))
    }
}
