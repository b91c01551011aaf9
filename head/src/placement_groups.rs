//! Placement groups on the head: the placement pass, the two-phase reservation on node
//! agents (AGENT-6), removal, and the RPC bodies of `HeadService`'s group calls.
//!
//! - HEAD-5: a group's bundles are recorded as placed only after every agent involved has
//!   prepared and committed them; when any step fails, every bundle this attempt touched
//!   is returned and the group stays waiting. A group removed while its reservation is in
//!   flight gets its bundles returned when the reservation ends. A group whose bundles all
//!   land on one node is prepared and committed there in one call (`commit` set): one
//!   agent is all or nothing on its own.
//!
//! Groups are placed in the same loop as actors, before them (`place_group`,
//! `replace_lost_bundles`, and `place_slice_group` for TPU slice groups, whose bundles
//! are then pinned to their slice and worker id and whose worker-0 bundle also takes the
//! slice's `TPU-<type>-head`). The groups waiting for placement are indexed beside the
//! state machine (`pg_waiting`, kept by applied changes and rebuilt from a snapshot), so
//! a pass does not scan every group ever made, and a pass with nothing waiting builds no
//! node views. A node's death sends its bundles back to placement (RESCHEDULING); removal
//! (or the end of a non-detached group's job) marks the group's actors dead and returns
//! every bundle, which stops what ran inside. `tpuray status` lists waiting groups as
//! pending or infeasible demand by bundle shape, with the reason.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::{Duration, Instant};

use tonic::{Request, Status};
use tpuray_proto::convert::{labels_from_proto, resources_from_proto, resources_to_proto};
use tpuray_proto::ids::{JobId, NodeId, PlacementGroupId};
use tpuray_proto::{now_ms, pb};
use tpuray_scheduler::labels::TPURAY_PREFIX;
use tpuray_scheduler::{
    AcceleratorType, Bundle, LabelConstraint, LabelOp, NodeView, PgDecision, PgStrategy,
    ResourceSet,
};

use crate::server::{Head, Inner, mark_waiting};
use crate::state::{
    Command, CommandKind, DEFAULT_NAMESPACE, Outcome, PgStatus, PlacementGroupRecord, SliceSpec,
};

/// The most `more_ids` one `GetPlacementGroup` answers (PG-3).
pub(crate) const MORE_IDS_MAX: usize = 1000;

/// Per node of a reservation attempt: its agent address and (bundle index, demand) pairs.
type ByNode = BTreeMap<NodeId, (String, Vec<(u32, ResourceSet)>)>;

/// One bundle to reserve in a reservation attempt.
struct Assignment {
    index: u32,
    node_id: NodeId,
    address: String,
    demand: ResourceSet,
}

impl Head {
    /// The wire form of a group, with its soft pending reason.
    pub(crate) fn pg_info(
        &self,
        inner: &Inner,
        pg: &PlacementGroupRecord,
    ) -> pb::PlacementGroupInfo {
        let (state, removal_reason) = match &pg.status {
            PgStatus::Pending => (pb::PlacementGroupState::Pending, String::new()),
            PgStatus::Created => (pb::PlacementGroupState::Created, String::new()),
            PgStatus::Rescheduling => (pb::PlacementGroupState::Rescheduling, String::new()),
            PgStatus::Removed { reason } => (pb::PlacementGroupState::Removed, reason.clone()),
        };
        let (pending_reason, infeasible) = match inner.pg_pending.get(&pg.pg_id) {
            Some((r, inf)) if pg.wants_placement() => (r.clone(), *inf),
            _ => (String::new(), false),
        };
        pb::PlacementGroupInfo {
            placement_group_id: pg.pg_id.to_string(),
            name: pg.name.clone(),
            state: state as i32,
            bundles: pg
                .bundles
                .iter()
                .map(|b| pb::Bundle {
                    resources: resources_to_proto(&b.demand),
                    label_selector: tpuray_proto::convert::labels_to_proto(&b.label_selector),
                })
                .collect(),
            strategy: pg.strategy.name().to_string(),
            job_id: pg.job_id.to_string(),
            namespace: pg.namespace.clone(),
            detached: pg.detached,
            bundle_node_ids: pg
                .bundle_nodes
                .iter()
                .map(|n| n.as_ref().map(ToString::to_string).unwrap_or_default())
                .collect(),
            bundle_node_addresses: pg
                .bundle_nodes
                .iter()
                .map(|n| {
                    n.as_ref()
                        .and_then(|n| inner.sm.nodes.get(n))
                        .map(|n| n.address.clone())
                        .unwrap_or_default()
                })
                .collect(),
            pending_reason,
            infeasible,
            slice: pg.slice.as_ref().map(|s| pb::SliceSpec {
                accelerator_type: s.accelerator_type.clone(),
                topology: s.topology.clone().unwrap_or_default(),
                num_slices: s.num_slices,
            }),
            create_time_ms: pg.create_time_ms,
            removal_reason,
        }
    }

    /// One pass of group placement over `views` (booked in place, so actors placed in the
    /// same pass see what the groups took). Placed groups get their reservation started.
    pub(crate) fn place_groups(
        self: &Arc<Self>,
        inner: &mut Inner,
        views: &mut [NodeView<String>],
    ) {
        let waiting: Vec<PlacementGroupRecord> = inner
            .pg_waiting
            .iter()
            .filter(|id| !inner.pg_placing.contains(*id))
            .filter_map(|id| inner.sm.placement_groups.get(id))
            .filter(|p| p.wants_placement())
            .cloned()
            .collect();
        for pg in waiting {
            let (decision, slice_bundles) = decide(&pg, views);
            match decision {
                PgDecision::Placed(nodes) => {
                    let bundles = slice_bundles.as_ref().unwrap_or(&pg.bundles);
                    let mut todo = Vec::new();
                    for (i, node) in nodes.iter().enumerate() {
                        if pg.bundle_nodes.get(i).is_some_and(Option::is_some) {
                            continue; // a survivor of a node death keeps its place
                        }
                        let node_id = NodeId::from_wire(node.clone());
                        let Some(address) = inner.sm.nodes.get(&node_id).map(|n| n.address.clone())
                        else {
                            continue;
                        };
                        let demand = bundles[i].demand.clone();
                        if let Some(v) = views.iter_mut().find(|v| v.id == *node) {
                            v.available.saturating_sub(&demand);
                        }
                        todo.push(Assignment { index: i as u32, node_id, address, demand });
                    }
                    inner.pg_placing.insert(pg.pg_id.clone());
                    let head = Arc::clone(self);
                    tokio::spawn(async move { head.reserve(pg.pg_id, todo, slice_bundles).await });
                }
                PgDecision::Pending { reason } => {
                    mark_waiting(&mut inner.pg_pending, &pg.pg_id, reason, false);
                }
                PgDecision::Infeasible { reason } => {
                    if mark_waiting(&mut inner.pg_pending, &pg.pg_id, reason.clone(), true) {
                        tracing::warn!(pg = %pg.pg_id, %reason, "placement group is infeasible; it stays pending until nodes that fit join");
                    }
                }
            }
        }
    }

    /// HEAD-5: prepare every bundle, then commit every bundle, then record the placement;
    /// on any failure return what this attempt reserved.
    async fn reserve(
        self: Arc<Self>,
        pg_id: PlacementGroupId,
        todo: Vec<Assignment>,
        slice_bundles: Option<Vec<Bundle>>,
    ) {
        let mut by_node = ByNode::new();
        for a in &todo {
            by_node
                .entry(a.node_id.clone())
                .or_insert_with(|| (a.address.clone(), Vec::new()))
                .1
                .push((a.index, a.demand.clone()));
        }
        let result = self.prepare_and_commit(&pg_id, &by_node).await;
        let outcome = match result {
            Ok(()) => {
                let placed = todo.iter().map(|a| (a.index, a.node_id.clone())).collect();
                let r = self
                    .commit(Command {
                        request_id: String::new(),
                        kind: CommandKind::PlacementGroupPlaced {
                            pg_id: pg_id.clone(),
                            bundles: placed,
                            slice_bundles,
                        },
                    })
                    .await;
                match r {
                    Ok(Outcome::Rejected(r)) => Err(r.to_string()),
                    Ok(_) => Ok(()),
                    Err(s) => {
                        // The outcome is unknown (leadership changed): the bundles stay
                        // where they are; the next leader gives back any that no record
                        // names (HEAD-8).
                        tracing::warn!(pg = %pg_id, %s, "recording a placement group's bundles failed");
                        self.lock().pg_placing.remove(&pg_id);
                        return;
                    }
                }
            }
            Err(e) => Err(e),
        };
        if let Err(reason) = outcome {
            tracing::info!(pg = %pg_id, %reason, "placement group reservation failed; returning its bundles");
            for (node_id, (address, bundles)) in &by_node {
                let indexes: Vec<u32> = bundles.iter().map(|b| b.0).collect();
                self.return_bundles_on(node_id, address, &pg_id, indexes).await;
            }
            let removed =
                self.lock().sm.placement_groups.get(&pg_id).is_none_or(|p| p.is_removed());
            if !removed {
                self.lock().pg_pending.insert(pg_id.clone(), (reason, false));
                let head = Arc::clone(&self);
                tokio::spawn(async move {
                    tokio::time::sleep(Duration::from_millis(300)).await;
                    head.placement_wake.notify_one();
                });
            }
        } else {
            self.lock().pg_pending.remove(&pg_id);
        }
        self.lock().pg_placing.remove(&pg_id);
        self.placement_wake.notify_one();
    }

    async fn prepare_and_commit(
        &self,
        pg_id: &PlacementGroupId,
        by_node: &ByNode,
    ) -> Result<(), String> {
        if let [(node_id, (address, bundles))] = by_node.iter().collect::<Vec<_>>()[..] {
            // HEAD-5: every bundle on one node: that agent prepares and commits in one
            // call (all or nothing there), so no second phase is needed.
            let mut c = self.agent_client(address).map_err(|e| e.message().to_string())?;
            let mut r = Request::new(pb::PrepareBundlesRequest {
                placement_group_id: pg_id.to_string(),
                bundles: bundles
                    .iter()
                    .map(|(i, d)| pb::BundleOnNode { index: *i, resources: resources_to_proto(d) })
                    .collect(),
                commit: true,
            });
            r.set_timeout(Duration::from_secs(10));
            let reply = c
                .prepare_bundles(r)
                .await
                .map_err(|s| format!("reserving on node {node_id}: {}", s.message()))?
                .into_inner();
            self.note_node_resources(node_id, reply.resources);
            return Ok(());
        }
        let mut prepares = tokio::task::JoinSet::new();
        for (node_id, (address, bundles)) in by_node {
            let req = pb::PrepareBundlesRequest {
                placement_group_id: pg_id.to_string(),
                bundles: bundles
                    .iter()
                    .map(|(i, d)| pb::BundleOnNode { index: *i, resources: resources_to_proto(d) })
                    .collect(),
                commit: false,
            };
            let node_id = node_id.clone();
            let client = self.agent_client(address);
            prepares.spawn(async move {
                let mut c = client.map_err(|e| e.message().to_string())?;
                let mut r = Request::new(req);
                r.set_timeout(Duration::from_secs(10));
                c.prepare_bundles(r)
                    .await
                    .map(|_| ())
                    .map_err(|s| format!("preparing on node {node_id}: {}", s.message()))
            });
        }
        let mut first_err = None;
        while let Some(r) = prepares.join_next().await {
            if let Err(e) = r.unwrap_or_else(|e| Err(e.to_string())) {
                first_err.get_or_insert(e);
            }
        }
        if let Some(e) = first_err {
            return Err(e);
        }
        for (node_id, (address, bundles)) in by_node {
            let mut c = self.agent_client(address).map_err(|e| e.message().to_string())?;
            let mut r = Request::new(pb::CommitBundlesRequest {
                placement_group_id: pg_id.to_string(),
                indexes: bundles.iter().map(|b| b.0).collect(),
            });
            r.set_timeout(Duration::from_secs(10));
            let reply = c
                .commit_bundles(r)
                .await
                .map_err(|s| format!("committing on node {node_id}: {}", s.message()))?
                .into_inner();
            self.note_node_resources(node_id, reply.resources);
        }
        Ok(())
    }

    /// Takes an agent's word for its resources right after a bundle change.
    fn note_node_resources(&self, node_id: &NodeId, now: Option<pb::NodeResourcesNow>) {
        let Some(now) = now else { return };
        if now.partial {
            // Only the names the change touched, each with its amount now (0: gone).
            let mut inner = self.lock();
            let Some(s) = inner.soft.get_mut(node_id) else { return };
            for (map, set) in [(&now.total, &mut s.total), (&now.available, &mut s.available)] {
                for (name, v) in map {
                    if let Ok(a) = tpuray_scheduler::Amount::from_f64(name, *v) {
                        set.set(name, a);
                    }
                }
            }
            inner.view.touch(node_id); // HEAD-13
            return;
        }
        let (Ok(total), Ok(available)) =
            (resources_from_proto(&now.total), resources_from_proto(&now.available))
        else {
            return;
        };
        let mut inner = self.lock();
        if let Some(s) = inner.soft.get_mut(node_id) {
            s.total = total;
            s.available = available;
            inner.view.touch(node_id); // HEAD-13
        }
    }

    /// Returns bundles of `pg_id` on one node (all when `indexes` is empty); a node that
    /// cannot be reached is left alone (its prepared bundles expire, AGENT-6; a dead
    /// node's resources are gone anyway).
    pub(crate) async fn return_bundles_on(
        &self,
        node_id: &NodeId,
        address: &str,
        pg_id: &PlacementGroupId,
        indexes: Vec<u32>,
    ) {
        let Ok(mut c) = self.agent_client(address) else {
            return;
        };
        let mut r = Request::new(pb::ReturnBundlesRequest {
            placement_group_id: pg_id.to_string(),
            indexes,
        });
        r.set_timeout(Duration::from_secs(10));
        match c.return_bundles(r).await {
            Ok(reply) => self.note_node_resources(node_id, reply.into_inner().resources),
            Err(s) => {
                tracing::warn!(pg = %pg_id, %node_id, %s, "returning placement group bundles failed")
            }
        }
        self.placement_wake.notify_one();
    }

    /// Gives back every bundle of a removed group, on every node that holds one.
    pub(crate) async fn release_group(&self, pg_id: &PlacementGroupId) {
        let nodes: Vec<(NodeId, String)> = {
            let inner = self.lock();
            let Some(pg) = inner.sm.placement_groups.get(pg_id) else { return };
            let mut ids: Vec<NodeId> = pg.bundle_nodes.iter().flatten().cloned().collect();
            ids.sort();
            ids.dedup();
            ids.into_iter()
                .filter_map(|n| inner.sm.nodes.get(&n).map(|r| (n, r.address.clone())))
                .collect()
        };
        for (node_id, address) in nodes {
            self.return_bundles_on(&node_id, &address, pg_id, vec![]).await;
        }
    }

    /// `CreatePlacementGroup`: validates, records the group and wakes placement.
    pub(crate) async fn create_placement_group(
        &self,
        req: pb::CreatePlacementGroupRequest,
    ) -> Result<pb::PlacementGroupInfo, Status> {
        if req.job_id.is_empty() {
            return Err(Status::invalid_argument("missing job_id"));
        }
        let job_id = JobId::from_wire(req.job_id);
        if !self.lock().sm.jobs.contains_key(&job_id) {
            return Err(Status::not_found(format!("no job {job_id}: register the job first")));
        }
        let strategy = PgStrategy::parse(&req.strategy).map_err(Status::invalid_argument)?;
        let mut bundles = req
            .bundles
            .iter()
            .enumerate()
            .map(|(i, b)| {
                let demand = resources_from_proto(&b.resources)
                    .map_err(|e| Status::invalid_argument(format!("bundle {i}: {e}")))?;
                if demand.is_empty() {
                    return Err(Status::invalid_argument(format!(
                        "bundle {i} is empty (expected at least one resource with an amount above 0, e.g. {{\"CPU\": 1}})"
                    )));
                }
                let label_selector = labels_from_proto(&b.label_selector)
                    .map_err(|e| Status::invalid_argument(format!("bundle {i}: {e}")))?;
                Ok(Bundle { demand, label_selector })
            })
            .collect::<Result<Vec<_>, Status>>()?;
        if bundles.is_empty() {
            return Err(Status::invalid_argument(
                "a placement group needs at least one bundle (got an empty list)",
            ));
        }
        let slice = match req.slice {
            None => None,
            Some(s) => {
                let ty = AcceleratorType::parse(&s.accelerator_type)
                    .map_err(|e| Status::invalid_argument(e.to_string()))?;
                if s.num_slices == 0 {
                    return Err(Status::invalid_argument(
                        "num_slices is 0 (expected 1 or more slices)",
                    ));
                }
                if bundles.len() != 1 {
                    return Err(Status::invalid_argument(format!(
                        "a slice group takes one per-host bundle (got {})",
                        bundles.len()
                    )));
                }
                // One bundle per host, in worker-id order; fixed when placed.
                let n = ty.hosts() as usize * s.num_slices as usize;
                bundles = vec![bundles[0].clone(); n];
                Some(SliceSpec {
                    accelerator_type: s.accelerator_type,
                    topology: (!s.topology.is_empty()).then_some(s.topology),
                    num_slices: s.num_slices,
                })
            }
        };
        let n = bundles.len();
        let pg_id = if req.placement_group_id.is_empty() {
            PlacementGroupId::random()
        } else if req.placement_group_id.len() == 32
            && req
                .placement_group_id
                .bytes()
                .all(|b| b.is_ascii_digit() || (b'a'..=b'f').contains(&b))
        {
            PlacementGroupId::from_wire(req.placement_group_id)
        } else {
            return Err(Status::invalid_argument(format!(
                "placement group id {:?} is not 32 lowercase hex characters",
                req.placement_group_id
            )));
        };
        let pg = PlacementGroupRecord {
            pg_id,
            job_id,
            name: req.name,
            namespace: if req.namespace.is_empty() {
                DEFAULT_NAMESPACE.to_string()
            } else {
                req.namespace
            },
            strategy: if slice.is_some() { PgStrategy::StrictSpread } else { strategy },
            bundles,
            slice,
            detached: req.detached,
            status: PgStatus::Pending,
            bundle_nodes: vec![None; n],
            create_time_ms: now_ms(),
        };
        let id = match self
            .commit(Command {
                request_id: req.request_id,
                kind: CommandKind::CreatePlacementGroup(pg),
            })
            .await?
        {
            Outcome::PlacementGroup(id) => id,
            Outcome::Rejected(r) => return Err(crate::server::rejection_status(r)),
            o => return Err(Status::internal(format!("unexpected outcome {o:?}"))),
        };
        self.placement_wake.notify_one();
        self.pg_info_by_id(&id)
            .ok_or_else(|| Status::internal(format!("placement group {id} vanished")))
    }

    /// Checks that work may be placed in bundle `index` (-1: any) of group `pg`.
    ///
    /// # Errors
    /// `NOT_FOUND` for an unknown group, `FAILED_PRECONDITION` for a removed one,
    /// `INVALID_ARGUMENT` for an index outside the group (naming its bundle count).
    pub(crate) fn check_bundle(&self, pg: &str, index: i32) -> Result<(), Status> {
        let inner = self.lock();
        let id = PlacementGroupId::from_wire(pg);
        let p = inner
            .sm
            .placement_groups
            .get(&id)
            .ok_or_else(|| Status::not_found(format!("no placement group with id {id}")))?;
        if p.is_removed() {
            return Err(Status::failed_precondition(format!(
                "placement group {id} was removed; nothing more can be scheduled in it"
            )));
        }
        if index < -1 || index >= p.bundles.len() as i32 {
            return Err(Status::invalid_argument(format!(
                "bundle index {index} is out of range for placement group {id} (expected -1 for any bundle, or 0..{})",
                p.bundles.len()
            )));
        }
        Ok(())
    }

    /// The groups of `ids` that exist (PG-3: `GetPlacementGroup`'s `more_ids`), at most
    /// [`MORE_IDS_MAX`]; malformed and unknown ids are skipped.
    pub(crate) fn pg_infos_by_id(&self, ids: &[String]) -> Vec<pb::PlacementGroupInfo> {
        if ids.is_empty() {
            return Vec::new();
        }
        let inner = self.lock();
        ids.iter()
            .take(MORE_IDS_MAX)
            .filter_map(|id| {
                let id = PlacementGroupId::from_wire(id.clone());
                inner.sm.placement_groups.get(&id).map(|p| self.pg_info(&inner, p))
            })
            .collect()
    }

    pub(crate) fn pg_info_by_id(&self, id: &PlacementGroupId) -> Option<pb::PlacementGroupInfo> {
        let inner = self.lock();
        inner.sm.placement_groups.get(id).map(|p| self.pg_info(&inner, p))
    }

    /// `GetPlacementGroup`: by id or name, waiting up to `wait_ready_ms` for it to be
    /// created or removed.
    pub(crate) async fn get_placement_group(
        &self,
        req: pb::GetPlacementGroupRequest,
    ) -> Result<pb::PlacementGroupInfo, Status> {
        let deadline = Instant::now() + Duration::from_millis(req.wait_ready_ms);
        loop {
            let notified = self.pg_changed.notified();
            let info = if !req.placement_group_id.is_empty() {
                let id = PlacementGroupId::from_wire(req.placement_group_id.clone());
                self.pg_info_by_id(&id)
                    .ok_or_else(|| Status::not_found(format!("no placement group with id {id}")))?
            } else if !req.name.is_empty() {
                let ns = if req.namespace.is_empty() { DEFAULT_NAMESPACE } else { &req.namespace };
                let inner = self.lock();
                let pg = inner.sm.named_placement_group(ns, &req.name).ok_or_else(|| {
                    Status::not_found(format!(
                        "no placement group named {:?} in namespace {ns:?}",
                        req.name
                    ))
                })?;
                self.pg_info(&inner, pg)
            } else {
                return Err(Status::invalid_argument(
                    "give a placement_group_id or a name to look up a placement group",
                ));
            };
            let settled = info.state == pb::PlacementGroupState::Created as i32
                || info.state == pb::PlacementGroupState::Removed as i32;
            if settled || Instant::now() >= deadline {
                return Ok(info);
            }
            let _ = tokio::time::timeout_at(deadline.into(), notified).await;
        }
    }

    /// `RemovePlacementGroup`: records the removal (its actors die with it), then gives
    /// every bundle back, stopping the workers inside, before answering (so a call made
    /// after the removal returns never reaches what ran inside).
    pub(crate) async fn remove_placement_group(
        &self,
        req: pb::RemovePlacementGroupRequest,
    ) -> Result<(), Status> {
        if req.placement_group_id.is_empty() {
            return Err(Status::invalid_argument("missing placement_group_id"));
        }
        let pg_id = PlacementGroupId::from_wire(req.placement_group_id);
        if let Outcome::Rejected(r) = self
            .commit(Command {
                request_id: req.request_id,
                kind: CommandKind::RemovePlacementGroup {
                    pg_id: pg_id.clone(),
                    reason: "removed by remove_placement_group()".into(),
                },
            })
            .await?
        {
            return Err(crate::server::rejection_status(r));
        }
        self.lock().pg_pending.remove(&pg_id);
        self.release_group(&pg_id).await;
        Ok(())
    }
}

/// The decision for one waiting group, and for a slice group placed now its final bundle
/// list (one per host, each held to its slice and worker id, the slice's head resource in
/// the bundle of worker 0 as Ray's `reserve_tpu_slice` holds it).
fn decide(
    pg: &PlacementGroupRecord,
    views: &[NodeView<String>],
) -> (PgDecision<String>, Option<Vec<Bundle>>) {
    let placed: Vec<String> = pg
        .bundle_nodes
        .iter()
        .map(|n| n.as_ref().map(ToString::to_string).unwrap_or_default())
        .collect();
    let rescheduling = pg.bundle_nodes.iter().any(Option::is_some);
    match &pg.slice {
        Some(s) if !rescheduling => {
            let template = &pg.bundles[0];
            let decision = tpuray_scheduler::place_slice_group(
                &s.accelerator_type,
                s.topology.as_deref(),
                s.num_slices as usize,
                template,
                views,
            );
            let PgDecision::Placed(nodes) = &decision else {
                return (decision, None);
            };
            let head = AcceleratorType::parse(&s.accelerator_type)
                .map(|t| t.head_resource_name())
                .unwrap_or_default();
            let mut bundles = Vec::with_capacity(nodes.len());
            for id in nodes {
                let view = views.iter().find(|v| v.id == *id).expect("placed on a listed node");
                let mut b = template.clone();
                for key in ["tpu-slice-name", "tpu-worker-id"] {
                    let key = format!("{TPURAY_PREFIX}{key}");
                    let value = view.labels.get(&key).unwrap_or_default().to_string();
                    b.label_selector.push(LabelConstraint { key, op: LabelOp::In(vec![value]) });
                }
                if view.labels.get(&format!("{TPURAY_PREFIX}tpu-worker-id")) == Some("0")
                    && view.total.get(&head).0 > 0
                {
                    b.demand.set(&head, tpuray_scheduler::Amount::whole(1));
                }
                bundles.push(b);
            }
            // The head resource may be held by someone else: check the whole group again.
            let all_fit = nodes.iter().zip(&bundles).all(|(id, b)| {
                views.iter().any(|v| v.id == *id && v.available.is_superset_of(&b.demand))
            });
            if !all_fit {
                let reason = format!(
                    "a {} slice is free but its {head} resource is held by other work",
                    s.accelerator_type
                );
                return (PgDecision::Pending { reason }, None);
            }
            (decision, Some(bundles))
        }
        _ if rescheduling => {
            (tpuray_scheduler::replace_lost_bundles(&pg.bundles, pg.strategy, &placed, views), None)
        }
        _ => (tpuray_scheduler::place_group(&pg.bundles, pg.strategy, views, pg_seed(pg)), None),
    }
}

fn pg_seed(pg: &PlacementGroupRecord) -> u64 {
    pg.create_time_ms
}
