//! Nodes at the head: registration, heartbeats (soft state, HEAD-13's view), the death
//! monitor (HEAD-4) and reconciliation with the agents (HEAD-8). The decisions are the
//! pure functions of `liveness.rs`; this module reads the clock and does the I/O.

use std::collections::HashMap;
use std::sync::Arc;
use std::time::{Duration, Instant};

use tonic::{Request, Response, Status};
use tpuray_proto::convert::{resources_from_proto, resources_to_proto};
use tpuray_proto::ids::{ActorId, NodeId, PlacementGroupId, WorkerId};
use tpuray_proto::{check_protocol_version, now_ms, pb};
use tpuray_scheduler::{Labels, NodeView, ResourceSet};

use crate::convert::node_to_proto;
use crate::state::{Command, CommandKind, NodeRecord, NodeStatus as NodeLife, Outcome};
use crate::view::ViewUpdate;

use crate::liveness::{self, Heard, NodeSoft, RECONCILE_EVERY, Report};
use crate::server::{Head, Inner, rejection_status, require_id};

impl Head {
    pub(crate) fn node_info(&self, inner: &Inner, n: &NodeRecord) -> pb::NodeInfo {
        node_entry(n, inner.soft.get(&n.node_id))
    }

    /// The live nodes placement may use: those that reported their resources to this
    /// leader (a new leader waits for each node's heartbeat, HEAD-8).
    pub(crate) fn alive_views(inner: &Inner) -> Vec<NodeView<String>> {
        inner
            .sm
            .nodes
            .values()
            .filter(|n| n.status == NodeLife::Alive)
            .filter_map(|n| {
                let s = inner.soft.get(&n.node_id).filter(|s| s.reported)?;
                Some(NodeView {
                    id: n.node_id.to_string(),
                    total: s.total.clone(),
                    available: s.available.clone(),
                    labels: n.labels.clone(),
                    alive: true,
                })
            })
            .collect()
    }

    /// HEAD-4: declares dead every node whose last heartbeat is older than
    /// the death timeout. Runs on its own task, on the leader only; takes the lock briefly.
    pub(crate) async fn check_node_deaths(&self) {
        if !self.is_leader() {
            return;
        }
        let timeout = self.config.node_death_timeout;
        let expired = {
            let inner = self.lock();
            let alive = inner.sm.nodes.values().filter(|n| n.status == NodeLife::Alive);
            liveness::expired(alive.map(|n| &n.node_id), &inner.soft, Instant::now(), timeout)
        };
        for (node_id, age) in expired {
            tracing::warn!(%node_id, ?age, "node missed heartbeats; marking it dead");
            let r = self
                .commit(Command {
                    request_id: String::new(),
                    kind: CommandKind::MarkNodeDead {
                        node_id: node_id.clone(),
                        reason: format!(
                            "no heartbeat for {:.1}s (timeout {:.1}s)",
                            age.as_secs_f64(),
                            timeout.as_secs_f64()
                        ),
                    },
                })
                .await;
            if let Err(s) = r {
                tracing::warn!(%node_id, %s, "marking the node dead failed");
                return;
            }
            self.lock().soft.remove(&node_id);
        }
    }

    /// HEAD-8: compares a node agent's actor workers with the durable state. An actor
    /// recorded alive there whose worker is gone (its exit report was lost, e.g. while
    /// every head was down) is restarted or dies per its `max_restarts`; a worker
    /// hosting an actor that no record places there (started by a leader that failed
    /// before recording it) is stopped.
    pub(crate) async fn reconcile_node(self: Arc<Self>, node_id: NodeId, address: String) {
        if !self.is_leader() {
            return;
        }
        let alive_here = |inner: &Inner| inner.sm.alive_actors_on(&node_id);
        // Recorded before asking: a worker recorded alive now existed when the agent answers.
        let before = alive_here(&self.lock());
        let listed = async {
            let mut c = self.agent_client(&address)?;
            let mut r = Request::new(pb::ListWorkersRequest {});
            r.set_timeout(Duration::from_secs(5));
            c.list_workers(r).await.map(|r| r.into_inner().workers)
        }
        .await;
        let workers = match listed {
            Ok(w) => w,
            Err(s) => {
                tracing::info!(%node_id, %s, "cannot list the node's workers; will try again");
                if let Some(soft) = self.lock().soft.get_mut(&node_id) {
                    soft.reconciled_at = None;
                }
                return;
            }
        };
        let hosted: HashMap<ActorId, WorkerId> = workers
            .into_iter()
            .filter(|w| !w.actor_id.is_empty())
            .map(|w| (ActorId::from_wire(w.actor_id), WorkerId::from_wire(w.worker_id)))
            .collect();
        let (gone, orphans) = {
            let inner = self.lock();
            let now = alive_here(&inner);
            let gone: Vec<(ActorId, WorkerId)> = before
                .into_iter()
                .filter(|(a, w)| hosted.get(a) != Some(w) && now.get(a) == Some(w))
                .collect();
            let orphans: Vec<ActorId> = hosted
                .iter()
                .filter(|(a, w)| now.get(*a) != Some(*w) && !inner.placing.contains(*a))
                .map(|(a, _)| a.clone())
                .collect();
            (gone, orphans)
        };
        for (actor_id, worker_id) in gone {
            tracing::warn!(%actor_id, %worker_id, %node_id, "an actor's worker is gone from its node; restarting the actor");
            let r = self
                .commit(Command {
                    request_id: String::new(),
                    kind: CommandKind::ActorWorkerExited {
                        actor_id: actor_id.clone(),
                        worker_id: Some(worker_id.clone()),
                        intended: false,
                        cause: format!(
                            "the actor's worker {worker_id} was gone from node {node_id} (its exit was not reported)"
                        ),
                    },
                })
                .await;
            if let Err(s) = r {
                tracing::warn!(%actor_id, %s, "recording the lost actor worker failed");
            }
        }
        for actor_id in orphans {
            tracing::warn!(%actor_id, %node_id, "stopping an actor worker that no record places on its node");
            let _ = self.kill_actor_worker(&address, &actor_id, None, false).await;
        }
    }

    pub(crate) async fn register_node(
        self: &Arc<Self>,
        req: Request<pb::RegisterNodeRequest>,
    ) -> Result<Response<pb::RegisterNodeReply>, Status> {
        let req = req.into_inner();
        check_protocol_version("node agent", req.protocol_version)?; // PROTO-1
        let node = req.node.ok_or_else(|| Status::invalid_argument("missing node info"))?;
        require_id("node_id", &node.node_id)?;
        require_id("node address", &node.address)?;
        let total = resources_from_proto(&node.total)
            .map_err(|e| Status::invalid_argument(format!("node resources: {e}")))?;
        let available = resources_from_proto(&node.available)
            .map_err(|e| Status::invalid_argument(format!("node available resources: {e}")))?;
        let node_id = NodeId::from_wire(node.node_id.clone());
        let rec = NodeRecord {
            node_id: node_id.clone(),
            address: node.address,
            hostname: node.hostname,
            total: total.clone(),
            labels: Labels(node.labels.into_iter().collect()),
            is_head_node: node.is_head_node,
            start_time_ms: node.start_time_ms,
            session_dir: node.session_dir,
            pid: node.pid,
            status: NodeLife::Alive,
            object_store_dir: node.object_store_dir,
            metrics_export_port: u16::try_from(node.metrics_export_port).unwrap_or(0),
        };
        if let Outcome::Rejected(r) = self
            .commit(Command { request_id: req.request_id, kind: CommandKind::RegisterNode(rec) })
            .await?
        {
            return Err(rejection_status(r));
        }
        self.lock().soft.insert(
            node_id.clone(),
            NodeSoft::registered(
                total,
                available,
                Instant::now(),
                now_ms(),
                RECONCILE_EVERY.mul_f64(rand::random::<f64>()),
            ),
        );
        tracing::info!(%node_id, "node registered");
        self.placement_wake.notify_one();
        Ok(Response::new(pb::RegisterNodeReply {
            cluster_id: self.cluster_id(),
            heartbeat_interval_ms: self.config.heartbeat_interval.as_millis() as u64,
            auth_required: self.config.auth_required,
            tls: tpuray_proto::tls::enabled(),
            node_death_timeout_ms: self.config.node_death_timeout.as_millis() as u64,
        }))
    }

    pub(crate) async fn heartbeat(
        self: &Arc<Self>,
        req: Request<pb::HeartbeatRequest>,
    ) -> Result<Response<pb::HeartbeatReply>, Status> {
        let req = req.into_inner();
        let node_id = NodeId::from_wire(req.node_id);
        let available = resources_from_proto(&req.available)
            .map_err(|e| Status::invalid_argument(format!("heartbeat available resources: {e}")))?;
        let mut inner = self.lock();
        let status = inner.sm.nodes.get(&node_id).map(|n| n.status.clone());
        match status {
            None => {
                return Ok(Response::new(pb::HeartbeatReply {
                    accepted: false,
                    reason: format!("unknown node {node_id}: register first"),
                    ..Default::default()
                }));
            }
            Some(NodeLife::Dead { reason }) => {
                return Ok(Response::new(pb::HeartbeatReply {
                    accepted: false,
                    reason: format!("node {node_id} was declared dead: {reason}"),
                    ..Default::default()
                }));
            }
            Some(NodeLife::Alive) => {}
        }
        let had_pending = !inner.actor_pending.is_empty() || !inner.pg_pending.is_empty();
        let total = if req.total.is_empty() {
            inner.sm.nodes.get(&node_id).map(|n| n.total.clone()).unwrap_or_default()
        } else {
            resources_from_proto(&req.total)
                .map_err(|e| Status::invalid_argument(format!("heartbeat total resources: {e}")))?
        };
        let orphans = orphan_bundles(&inner, &node_id, &total);
        for (pg, _) in &orphans {
            inner.returning.insert((pg.clone(), node_id.clone()));
        }
        let report = Report {
            total,
            available,
            pending: req.pending,
            num_workers: req.num_workers,
            job_submissions: req.job_submissions.into_iter().collect(),
        };
        let (soft, Heard { first_report, reconcile, view_changed }) =
            NodeSoft::heard(inner.soft.get(&node_id), report, Instant::now(), now_ms());
        inner.soft.insert(node_id.clone(), soft);
        if view_changed {
            inner.view.touch(&node_id);
        }
        // HEAD-13: the view as the changes since the version this agent holds, at most
        // this reply's share of the head's per-second budget.
        let limit = crate::view::entries_per_reply(
            inner.view.len(),
            self.config.heartbeat_interval.as_secs_f64(),
        );
        let ViewUpdate { full, changed, removed, to } =
            inner.view.since(req.view_epoch, req.view_version, limit);
        let cluster = {
            let Inner { sm, soft, view, view_entries, .. } = &mut *inner;
            changed
                .iter()
                .filter_map(|id| {
                    let n = sm.nodes.get(id).filter(|n| n.status == NodeLife::Alive)?;
                    let at = view.version_of(id)?;
                    if let Some((built, e)) = view_entries.get(id)
                        && *built == at
                    {
                        return Some(e.clone());
                    }
                    let e = node_entry(n, soft.get(id));
                    view_entries.insert(id.clone(), (at, e.clone()));
                    Some(e)
                })
                .collect()
        };
        let (view_epoch, view_version) = (inner.view.epoch(), to);
        let (view_delta, view_removed) = (!full, removed.iter().map(ToString::to_string).collect());
        let address = inner.sm.nodes.get(&node_id).map(|n| n.address.clone()).unwrap_or_default();
        drop(inner);
        // A pass can only place more when some node's resources changed (every heartbeat
        // waking it made each heartbeat of a large cluster a placement pass).
        if (had_pending && view_changed) || first_report {
            self.placement_wake.notify_one();
        }
        if reconcile {
            let head = Arc::clone(self);
            let (n, a) = (node_id.clone(), address.clone());
            tokio::spawn(async move { head.reconcile_node(n, a).await });
        }
        for (pg, indexes) in orphans {
            let head = Arc::clone(self);
            let (n, a) = (node_id.clone(), address.clone());
            tokio::spawn(async move {
                tracing::warn!(%pg, node_id = %n, ?indexes, "node holds placement group bundles no record names; giving them back");
                head.return_bundles_on(&n, &a, &pg, indexes).await;
                head.lock().returning.remove(&(pg, n));
            });
        }
        Ok(Response::new(pb::HeartbeatReply {
            accepted: true,
            reason: String::new(),
            cluster,
            view_epoch,
            view_version,
            view_delta,
            view_removed,
        }))
    }

    pub(crate) async fn unregister_node(
        self: &Arc<Self>,
        req: Request<pb::UnregisterNodeRequest>,
    ) -> Result<Response<pb::UnregisterNodeReply>, Status> {
        let req = req.into_inner();
        require_id("node_id", &req.node_id)?;
        let node_id = NodeId::from_wire(req.node_id);
        let reason =
            if req.reason.is_empty() { "node agent stopped".to_string() } else { req.reason };
        if let Outcome::Rejected(r) = self
            .commit(Command {
                request_id: req.request_id,
                kind: CommandKind::MarkNodeDead { node_id: node_id.clone(), reason },
            })
            .await?
        {
            return Err(rejection_status(r));
        }
        self.lock().soft.remove(&node_id);
        Ok(Response::new(pb::UnregisterNodeReply {}))
    }

    pub(crate) async fn get_cluster_status(
        self: &Arc<Self>,
        _req: Request<pb::GetClusterStatusRequest>,
    ) -> Result<Response<pb::GetClusterStatusReply>, Status> {
        let inner = self.lock();
        let mut total = ResourceSet::new();
        let mut available = ResourceSet::new();
        let mut pending = Vec::new();
        let mut infeasible = Vec::new();
        let nodes: Vec<pb::NodeInfo> =
            inner.sm.nodes.values().map(|n| self.node_info(&inner, n)).collect();
        for n in inner.sm.nodes.values().filter(|n| n.status == NodeLife::Alive) {
            total.add(&n.total);
            match inner.soft.get(&n.node_id) {
                Some(s) => {
                    // Bundle resources are a node's own, renamed (SCHED-19): not counted twice.
                    available
                        .add(&tpuray_scheduler::bundles::without_bundle_resources(&s.available));
                    for d in &s.pending {
                        if d.infeasible {
                            infeasible.push(d.clone());
                        } else {
                            pending.push(d.clone());
                        }
                    }
                }
                None => available.add(&n.total),
            }
        }
        for (id, (reason, is_infeasible)) in &inner.actor_pending {
            if let Some(a) = inner.sm.actors.get(id) {
                let d = pb::ResourceDemand {
                    shape: resources_to_proto(&a.placement_resources),
                    count: 1,
                    infeasible: *is_infeasible,
                    reason: format!("actor {}: {reason}", a.class_name),
                    placement_group_id: String::new(),
                };
                if *is_infeasible {
                    infeasible.push(d);
                } else {
                    pending.push(d);
                }
            }
        }
        for (id, (reason, is_infeasible)) in &inner.pg_pending {
            let Some(pg) = inner.sm.placement_groups.get(id).filter(|p| p.wants_placement()) else {
                continue;
            };
            // One demand per distinct bundle shape of the group.
            let mut shapes: Vec<(ResourceSet, u32)> = Vec::new();
            for (b, node) in pg.bundles.iter().zip(&pg.bundle_nodes) {
                if node.is_some() {
                    continue;
                }
                match shapes.iter_mut().find(|(s, _)| *s == b.demand) {
                    Some((_, n)) => *n += 1,
                    None => shapes.push((b.demand.clone(), 1)),
                }
            }
            let label = if pg.name.is_empty() { pg.pg_id.to_string() } else { pg.name.clone() };
            for (shape, count) in shapes {
                let d = pb::ResourceDemand {
                    shape: resources_to_proto(&shape),
                    count,
                    infeasible: *is_infeasible,
                    reason: format!("placement group {label} ({}): {reason}", pg.strategy.name()),
                    placement_group_id: pg.pg_id.to_string(),
                };
                if *is_infeasible {
                    infeasible.push(d);
                } else {
                    pending.push(d);
                }
            }
        }
        Ok(Response::new(pb::GetClusterStatusReply {
            nodes,
            total: resources_to_proto(&total),
            available: resources_to_proto(&available),
            pending,
            infeasible,
            cluster_id: inner.sm.cluster_id.clone(),
            head_start_time_ms: self.start_time_ms,
        }))
    }
}

/// HEAD-8: the bundles a node holds (its reported total names them, SCHED-19) that no
/// record places on it and no reservation in flight may be placing: (group, indexes).
fn orphan_bundles(
    inner: &Inner,
    node_id: &NodeId,
    total: &ResourceSet,
) -> Vec<(PlacementGroupId, Vec<u32>)> {
    let mut held: std::collections::BTreeMap<&str, Vec<u32>> = Default::default();
    for (name, _) in total.iter() {
        if let Some((_, Some(i), pg)) = tpuray_scheduler::bundles::parse_bundle_resource(name) {
            let v = held.entry(pg).or_default();
            if !v.contains(&i) {
                v.push(i);
            }
        }
    }
    let mut out = Vec::new();
    for (pg, indexes) in held {
        let pg_id = PlacementGroupId::from_wire(pg);
        if inner.pg_placing.contains(&pg_id)
            || inner.returning.contains(&(pg_id.clone(), node_id.clone()))
        {
            continue;
        }
        let orphan: Vec<u32> = match inner.sm.placement_groups.get(&pg_id) {
            Some(rec) if !rec.is_removed() => indexes
                .into_iter()
                .filter(|i| rec.bundle_nodes.get(*i as usize) != Some(&Some(node_id.clone())))
                .collect(),
            _ => indexes,
        };
        if !orphan.is_empty() {
            out.push((pg_id, orphan));
        }
    }
    out
}

/// Node `n`'s entry as `status`, `list` and the agents' cluster view show it: the record,
/// with the resources, demand and heartbeat time its agent last reported (`soft`) while
/// it is alive.
fn node_entry(n: &NodeRecord, soft: Option<&NodeSoft>) -> pb::NodeInfo {
    let mut info = node_to_proto(n);
    if let Some(s) = soft.filter(|s| s.reported)
        && n.status == NodeLife::Alive
    {
        info.total = resources_to_proto(&s.total);
        info.available = resources_to_proto(&s.available);
        info.pending = s.pending.clone();
        info.num_workers = s.num_workers;
        info.last_heartbeat_ms = s.last_heartbeat_ms;
    }
    info
}
