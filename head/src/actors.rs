//! Actors at the head: the placement loop (groups first, then actors), starting and
//! killing actor workers on agents, and the actor calls of `HeadService`.
//!
//! The placement loop runs the scheduler over the live nodes' heartbeat views (a
//! `ClusterView`, SCHED-17: O(log nodes) per actor instead of a scan of every node), then
//! calls `StartActorWorker` on the chosen agent. A heartbeat wakes the loop only when
//! something waits and the node's resources changed, and `CreateActor` wakes it instead
//! of running a pass itself, so a burst of creations is placed in a few passes.

use std::sync::Arc;
use std::time::{Duration, Instant};

use tonic::{Request, Response, Status};
use tpuray_proto::convert::{labels_from_proto, resources_from_proto, resources_to_proto};
use tpuray_proto::ids::{ActorId, JobId, NodeId, WorkerId};
use tpuray_proto::{now_ms, pb};
use tpuray_scheduler::{Decision, ResourceSet};

use crate::convert::actor_to_proto;
use crate::state::{
    ActorRecord, ActorStatus, Command, CommandKind, DEFAULT_NAMESPACE, NodeStatus as NodeLife,
    Outcome,
};

use crate::server::{Head, mark_waiting, rejection_status, require_id};

impl Head {
    /// One pass of placement: every placement group, then every actor, waiting
    /// for a node gets a decision; placed groups get reserved on their agents
    /// (HEAD-5), placed actors get a worker started on their node.
    pub(crate) fn place_actors(self: &Arc<Self>) {
        if !self.is_leader() {
            return;
        }
        let mut starts = Vec::new();
        {
            let mut inner = self.lock();
            // Nothing waits: skip building the views (they hold every node's resources,
            // and a pass runs after every group and bundle change).
            let groups_wait = inner.pg_waiting.iter().any(|id| !inner.pg_placing.contains(id));
            let actors_wait =
                || inner.sm.waiting_actors().any(|a| !inner.placing.contains(&a.actor_id));
            if !groups_wait && !actors_wait() {
                return;
            }
            let mut views = Self::alive_views(&inner);
            self.place_groups(&mut inner, &mut views);
            // Indexed by request class: a decision costs O(log nodes), not a scan of every
            // node per actor (SCHED-17: the same decisions as `schedule`).
            let mut views = tpuray_scheduler::ClusterView::new(views);
            let waiting: Vec<ActorRecord> = inner
                .sm
                .waiting_actors()
                .filter(|a| !inner.placing.contains(&a.actor_id))
                .cloned()
                .collect();
            for a in waiting {
                if let Some((pg_id, index)) = &a.placement_group {
                    // SCHED-19: the actor's resources already name the bundle; wait
                    // until the bundle is reserved somewhere.
                    let ready =
                        inner.sm.placement_groups.get(pg_id).is_some_and(
                            |p| match usize::try_from(*index) {
                                Ok(i) => p.bundle_nodes.get(i).is_some_and(Option::is_some),
                                Err(_) => p.bundle_nodes.iter().any(Option::is_some),
                            },
                        );
                    if !ready {
                        let reason = format!("waiting for placement group {pg_id} to be created");
                        inner.actor_pending.insert(a.actor_id.clone(), (reason, false));
                        continue;
                    }
                }
                let strategy = a.strategy();
                // HEAD-8: a node alive in the records that has not reported to this leader
                // yet is not gone: its resources are unknown until its first heartbeat (or
                // its death clock runs out). An actor bound to it, softly too, waits for
                // that rather than falling back elsewhere after every head failover.
                if let tpuray_scheduler::Strategy::NodeAffinity { node, .. } = &strategy {
                    let id = NodeId::from_wire(node.clone());
                    let alive =
                        inner.sm.nodes.get(&id).is_some_and(|n| n.status == NodeLife::Alive);
                    if alive && inner.soft.get(&id).is_some_and(|s| !s.reported) {
                        let reason = format!("waiting for node {id}'s first report to this head");
                        mark_waiting(&mut inner.actor_pending, &a.actor_id, reason, false);
                        continue;
                    }
                }
                let req = tpuray_scheduler::Request {
                    demand: a.placement_resources.clone(),
                    strategy,
                    label_selector: a.label_selector.clone(),
                };
                let seed = now_ms() ^ a.num_restarts as u64;
                // `schedule_in` books the placement in this pass's view, so two actors do
                // not both take the last slot before the next heartbeat.
                match tpuray_scheduler::schedule_in(&mut views, &req, None, seed) {
                    Decision::Place(node) => {
                        let node_id = NodeId::from_wire(node);
                        let Some(address) = inner.sm.nodes.get(&node_id).map(|n| n.address.clone())
                        else {
                            continue;
                        };
                        inner.placing.insert(a.actor_id.clone());
                        inner.actor_pending.remove(&a.actor_id);
                        starts.push((a, node_id, address));
                    }
                    Decision::Queue { reason } => {
                        mark_waiting(&mut inner.actor_pending, &a.actor_id, reason, false);
                    }
                    Decision::Infeasible { reason } => {
                        if mark_waiting(&mut inner.actor_pending, &a.actor_id, reason.clone(), true)
                        {
                            tracing::warn!(actor_id = %a.actor_id, %reason, "actor is infeasible; it stays pending until a node that fits joins");
                        }
                    }
                }
            }
        }
        for (actor, node_id, address) in starts {
            let head = Arc::clone(self);
            tokio::spawn(async move { head.start_actor_worker(actor, node_id, address).await });
        }
    }

    pub(crate) async fn start_actor_worker(
        self: Arc<Self>,
        actor: ActorRecord,
        node_id: NodeId,
        address: String,
    ) {
        let result = async {
            let mut client = self.agent_client(&address)?;
            let req = pb::StartActorWorkerRequest {
                request_id: tpuray_proto::new_request_id(),
                actor_id: actor.actor_id.to_string(),
                job_id: actor.job_id.to_string(),
                resources: resources_to_proto(&actor.resources),
                class_name: actor.class_name.clone(),
                attempt: actor.num_restarts,
                creation_task: actor.creation_task.clone(),
            };
            let mut req = Request::new(req);
            req.set_timeout(Duration::from_secs(60));
            client.start_actor_worker(req).await.map(|r| r.into_inner())
        }
        .await;
        match result {
            Ok(reply) => {
                let worker_id = WorkerId::from_wire(reply.worker_id.clone());
                let outcome = self
                    .commit(Command {
                        request_id: String::new(),
                        kind: CommandKind::ActorAlive {
                            actor_id: actor.actor_id.clone(),
                            node_id: node_id.clone(),
                            worker_id: worker_id.clone(),
                            address: reply.worker_address,
                            pid: reply.pid,
                        },
                    })
                    .await;
                // Only now: until the record names the worker, reconciliation must not
                // take it for an orphan (HEAD-8).
                self.lock().placing.remove(&actor.actor_id);
                match outcome {
                    Ok(Outcome::Rejected(r)) => {
                        // Killed while starting, or another start of it was recorded
                        // first: stop the worker we just made, and only that one.
                        tracing::info!(actor_id = %actor.actor_id, %worker_id, %r, "the actor's record refused the started worker; stopping it");
                        let _ = self
                            .kill_actor_worker(&address, &actor.actor_id, Some(&worker_id), false)
                            .await;
                    }
                    Ok(_) => {}
                    // Not leader any more: the next leader finds the worker when it
                    // reconciles this node (HEAD-8).
                    Err(s) => {
                        tracing::warn!(actor_id = %actor.actor_id, %s, "recording the started actor failed")
                    }
                }
            }
            Err(status) if status.code() == tonic::Code::FailedPrecondition => {
                self.lock().placing.remove(&actor.actor_id);
                // The constructor failed or the binary is missing: retrying
                // elsewhere would fail the same way.
                tracing::warn!(actor_id = %actor.actor_id, %status, "actor creation failed");
                let r = self
                    .commit(Command {
                        request_id: String::new(),
                        kind: CommandKind::ActorWorkerExited {
                            actor_id: actor.actor_id.clone(),
                            worker_id: None,
                            intended: true,
                            cause: format!("the actor's creation failed: {}", status.message()),
                        },
                    })
                    .await;
                if let Err(s) = r {
                    tracing::warn!(actor_id = %actor.actor_id, %s, "recording the failed creation failed");
                }
            }
            Err(status) => {
                self.lock().placing.remove(&actor.actor_id);
                tracing::warn!(actor_id = %actor.actor_id, %node_id, %status, "starting actor worker failed; will retry placement");
                self.lock().actor_pending.insert(
                    actor.actor_id.clone(),
                    (
                        format!("starting a worker on node {node_id} failed: {}", status.message()),
                        false,
                    ),
                );
                // Try again after a pause, on whatever node fits then.
                let head = Arc::clone(&self);
                tokio::spawn(async move {
                    tokio::time::sleep(Duration::from_millis(500)).await;
                    head.placement_wake.notify_one();
                });
            }
        }
    }

    /// Kills the actor's worker on the node at `agent_address`: `worker` only, when given,
    /// else whichever runs it. With `restart` the worker's exit is reported as not
    /// intended, so the head restarts the actor if it may (`kill(no_restart=False)`).
    /// Returns whether a worker was found to kill.
    pub(crate) async fn kill_actor_worker(
        &self,
        agent_address: &str,
        actor_id: &ActorId,
        worker: Option<&WorkerId>,
        restart: bool,
    ) -> Result<bool, Status> {
        let mut client = self.agent_client(agent_address)?;
        let mut req = Request::new(pb::KillActorWorkerRequest {
            request_id: tpuray_proto::new_request_id(),
            actor_id: actor_id.to_string(),
            force: true,
            worker_id: worker.map(ToString::to_string).unwrap_or_default(),
            restart,
        });
        req.set_timeout(Duration::from_secs(10));
        Ok(client.kill_actor_worker(req).await?.into_inner().killed)
    }

    pub(crate) fn actor_info(&self, id: &ActorId) -> Option<pb::ActorInfo> {
        let inner = self.lock();
        inner
            .sm
            .actors
            .get(id)
            .map(|a| actor_to_proto(a, inner.actor_pending.get(id).map(|p| p.0.as_str())))
    }

    pub(crate) async fn create_actor(
        self: &Arc<Self>,
        req: Request<pb::CreateActorRequest>,
    ) -> Result<Response<pb::CreateActorReply>, Status> {
        let req = req.into_inner();
        require_id("job_id", &req.job_id)?;
        let resources = resources_from_proto(&req.resources)
            .map_err(|e| Status::invalid_argument(format!("actor resources: {e}")))?;
        tpuray_scheduler::tpu::check_tpu_demand(&resources)
            .map_err(|e| Status::invalid_argument(format!("actor resources: {e}")))?;
        tpuray_scheduler::gpu::check_gpu_demand(&resources)
            .map_err(|e| Status::invalid_argument(format!("actor resources: {e}")))?;
        let label_selector =
            labels_from_proto(&req.label_selector).map_err(Status::invalid_argument)?;
        if req.max_restarts < -1 {
            return Err(Status::invalid_argument(format!(
                "max_restarts is {} (expected -1 for infinite, or a number >= 0)",
                req.max_restarts
            )));
        }
        let job_id = JobId::from_wire(req.job_id);
        if !self.lock().sm.jobs.contains_key(&job_id) {
            return Err(Status::not_found(format!("no job {job_id}: register the job first")));
        }
        // Ray: an actor needs 1 CPU to be placed and 0 while it runs, unless
        // it names resources itself, `num_cpus=0` included (DESIGN.md §3;
        // Ray's `DEFAULT_ACTOR_CREATION_CPU_SIMPLE`).
        let placement_resources = if req.resources.is_empty() {
            ResourceSet::from_json(r#"{"CPU": 1}"#).expect("static resource set")
        } else {
            resources.clone()
        };
        let placement_group =
            tpuray_proto::convert::placement_group_from_proto(req.strategy.as_ref());
        let (placement_resources, resources) = match &placement_group {
            Some((pg, index)) => {
                self.check_bundle(pg, *index)?;
                let i = u32::try_from(*index).ok();
                (
                    tpuray_scheduler::bundles::demand_in_bundle(&placement_resources, pg, i),
                    tpuray_scheduler::bundles::demand_in_bundle(&resources, pg, i),
                )
            }
            None => (placement_resources, resources),
        };
        let strategy = tpuray_proto::convert::strategy_from_proto(req.strategy.as_ref());
        let (affinity, spread) = match strategy {
            tpuray_scheduler::Strategy::NodeAffinity { node, soft } => {
                (Some((NodeId::from_wire(node), soft)), false)
            }
            tpuray_scheduler::Strategy::Spread => (None, true),
            tpuray_scheduler::Strategy::Default => (None, false),
        };
        let actor = ActorRecord {
            actor_id: ActorId::random(),
            job_id,
            name: req.name,
            namespace: if req.namespace.is_empty() {
                DEFAULT_NAMESPACE.to_string()
            } else {
                req.namespace
            },
            class_name: req.class_name,
            resources,
            placement_resources,
            label_selector,
            affinity,
            spread,
            max_restarts: req.max_restarts,
            num_restarts: 0,
            detached: req.detached,
            status: ActorStatus::PendingCreation,
            creation_task: req.creation_task,
            last_placement: None,
            placement_group: placement_group
                .map(|(pg, i)| (tpuray_proto::ids::PlacementGroupId::from_wire(pg), i)),
        };
        let id = match self
            .commit(Command {
                request_id: req.request_id,
                kind: CommandKind::CreateActor { actor, get_if_exists: req.get_if_exists },
            })
            .await?
        {
            Outcome::Actor(id) => id,
            Outcome::Rejected(r) => return Err(rejection_status(r)),
            o => return Err(Status::internal(format!("unexpected outcome {o:?}"))),
        };
        // The placement loop takes every actor created since its last pass in one pass
        // (a pass per creation scanned every actor and node each time).
        self.placement_wake.notify_one();
        Ok(Response::new(pb::CreateActorReply { actor: self.actor_info(&id) }))
    }

    pub(crate) async fn get_actor(
        self: &Arc<Self>,
        req: Request<pb::GetActorRequest>,
    ) -> Result<Response<pb::GetActorReply>, Status> {
        let req = req.into_inner();
        let deadline = Instant::now() + Duration::from_millis(req.wait_alive_ms);
        loop {
            let notified = self.actor_changed.notified();
            let info = if !req.actor_id.is_empty() {
                let id = ActorId::from_wire(req.actor_id.clone());
                self.actor_info(&id)
                    .ok_or_else(|| Status::not_found(format!("no actor with id {id}")))?
            } else if !req.name.is_empty() {
                let ns = if req.namespace.is_empty() { DEFAULT_NAMESPACE } else { &req.namespace };
                let id = self
                    .lock()
                    .sm
                    .named_actor(ns, &req.name)
                    .map(|a| a.actor_id.clone())
                    .ok_or_else(|| {
                        Status::not_found(format!(
                            "no actor named {:?} in namespace {:?}",
                            req.name, ns
                        ))
                    })?;
                self.actor_info(&id)
                    .ok_or_else(|| Status::not_found(format!("no actor with id {id}")))?
            } else {
                return Err(Status::invalid_argument(
                    "give an actor_id or a name to look up an actor",
                ));
            };
            let settled = info.state == pb::ActorState::Alive as i32
                || info.state == pb::ActorState::Dead as i32;
            if settled || Instant::now() >= deadline {
                return Ok(Response::new(pb::GetActorReply { actor: Some(info) }));
            }
            let _ = tokio::time::timeout_at(deadline.into(), notified).await;
        }
    }

    pub(crate) async fn list_actors(
        self: &Arc<Self>,
        _req: Request<pb::ListActorsRequest>,
    ) -> Result<Response<pb::ListActorsReply>, Status> {
        let inner = self.lock();
        Ok(Response::new(pb::ListActorsReply {
            actors: inner
                .sm
                .actors
                .values()
                .map(|a| {
                    actor_to_proto(a, inner.actor_pending.get(&a.actor_id).map(|p| p.0.as_str()))
                })
                .collect(),
        }))
    }

    pub(crate) async fn kill_actor(
        self: &Arc<Self>,
        req: Request<pb::KillActorRequest>,
    ) -> Result<Response<pb::KillActorReply>, Status> {
        let req = req.into_inner();
        require_id("actor_id", &req.actor_id)?;
        let actor_id = ActorId::from_wire(req.actor_id);
        let target = {
            let inner = self.lock();
            let a = inner
                .sm
                .actors
                .get(&actor_id)
                .ok_or_else(|| Status::not_found(format!("no actor with id {actor_id}")))?;
            match &a.status {
                ActorStatus::Alive { node_id, worker_id, .. } => {
                    inner.sm.nodes.get(node_id).map(|n| (n.address.clone(), worker_id.clone()))
                }
                _ => None,
            }
        };
        // kill(no_restart=False) of a running actor: the node kills its worker and reports
        // the exit as not intended, and the head restarts the actor as after a crash. (Doing
        // it the other way round, a commit first, let the restart land on the very worker
        // the kill then ended, since the node still ran it for that actor.)
        if !req.no_restart
            && req.reason.is_empty()
            && let Some((addr, worker_id)) = &target
            && let Ok(true) = self.kill_actor_worker(addr, &actor_id, Some(worker_id), true).await
        {
            return Ok(Response::new(pb::KillActorReply {}));
        }
        let cause = if !req.reason.is_empty() {
            req.reason.clone()
        } else if req.no_restart {
            "killed by kill()".to_string()
        } else {
            "killed by kill(no_restart=False)".to_string()
        };
        if let Outcome::Rejected(r) = self
            .commit(Command {
                request_id: req.request_id,
                kind: CommandKind::ActorWorkerExited {
                    actor_id: actor_id.clone(),
                    worker_id: target.as_ref().map(|t| t.1.clone()),
                    intended: req.no_restart,
                    cause,
                },
            })
            .await?
        {
            return Err(rejection_status(r));
        }
        if let Some((addr, worker_id)) = target {
            self.kill_actor_worker(&addr, &actor_id, Some(&worker_id), false).await.map_err(
                |s| {
                    Status::unavailable(format!(
                        "actor {actor_id} is marked dead but its node did not confirm the kill: {}",
                        s.message()
                    ))
                },
            )?;
        }
        Ok(Response::new(pb::KillActorReply {}))
    }

    pub(crate) async fn report_actor_worker_exit(
        self: &Arc<Self>,
        req: Request<pb::ReportActorWorkerExitRequest>,
    ) -> Result<Response<pb::ReportActorWorkerExitReply>, Status> {
        let req = req.into_inner();
        require_id("actor_id", &req.actor_id)?;
        let outcome = self
            .commit(Command {
                request_id: req.request_id,
                kind: CommandKind::ActorWorkerExited {
                    actor_id: ActorId::from_wire(req.actor_id),
                    worker_id: (!req.worker_id.is_empty())
                        .then(|| WorkerId::from_wire(req.worker_id)),
                    intended: req.intended,
                    cause: req.detail,
                },
            })
            .await?;
        if let Outcome::Rejected(r) = outcome {
            return Err(rejection_status(r));
        }
        Ok(Response::new(pb::ReportActorWorkerExitReply {}))
    }
}
