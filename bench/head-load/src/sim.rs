//! The simulated node agents of `head_load`: each node's state (resources, actor
//! stand-ins, bundles, leases), one `NodeAgentService` server for all of them, and each
//! node's heartbeat loop.
//!
//! A node is told apart by the loopback address the head dialled: node `i` advertises
//! `127.64.0.0 + i + 1` on the server's one port (the whole of 127/8 reaches `lo` on
//! Linux), so the server reads the connection's local address (`Request::local_addr`).
//! The listener is bound to every address of the host, and connections from anywhere
//! but loopback are closed at once.
//!
//! What is real: the wire protocol (registration, heartbeats with the head's interval and
//! the real agent's request timeout, the head's calls to the agent), the resource
//! accounting of AGENT-2/AGENT-6 (prepare sets aside all or nothing, commit adds the
//! bundle's renamed resources to the node's total, return gives both back; a started
//! actor holds its resources until killed). What is simulated: an actor is a record and
//! a worker id (no process runs), a lease is a record (no worker), and the head's cluster
//! view in heartbeat replies is counted, its entries kept as bytes and not parsed (no
//! spillback decisions; see [`HeartbeatReplySkim`]).
//! Runs on the caller's tokio runtime; nothing here blocks.

use std::collections::HashMap;
use std::net::{IpAddr, Ipv4Addr};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use tonic::{Request, Response, Status};
use tpuray_proto::convert::{resources_from_proto, resources_to_proto};
use tpuray_proto::ids::NodeId;
use tpuray_proto::pb;
use tpuray_proto::pb::node_agent_service_server::NodeAgentService;
use tpuray_scheduler::{Labels, ResourceSet};

/// Node `i` advertises `127.64.0.0 + i + 1`.
const BASE_IP: u32 = 0x7F40_0000;
/// Most nodes one harness can address (the rest of 127/8 above `BASE_IP`).
pub const MAX_NODES: usize = (0x7FFF_FFFE - BASE_IP - 1) as usize;

/// The loopback address of node `i`.
pub fn node_ip(i: usize) -> Ipv4Addr {
    Ipv4Addr::from(BASE_IP + 1 + i as u32)
}

/// The node whose address is `ip`, if it is one of ours.
pub fn node_index(ip: IpAddr) -> Option<usize> {
    let v4 = match ip {
        IpAddr::V4(v) => v,
        IpAddr::V6(v) => v.to_ipv4_mapped()?,
    };
    u32::from(v4).checked_sub(BASE_IP + 1).map(|i| i as usize)
}

/// One simulated node.
pub struct SimNode {
    pub node_id: NodeId,
    /// `127.64.x.y:PORT`, as registered.
    pub address: String,
    pub labels: Labels,
    /// What the node registered with.
    pub registered: ResourceSet,
    pub state: Mutex<NodeState>,
    /// The head refused a heartbeat: it declared this node dead.
    pub declared_dead: AtomicBool,
}

/// A node's resources and what holds them.
#[derive(Default)]
pub struct NodeState {
    /// Registered resources plus committed bundles' renamed ones (SCHED-19).
    pub total: ResourceSet,
    pub available: ResourceSet,
    /// Actor stand-ins: actor id -> (worker id, resources held while it runs).
    pub actors: HashMap<String, (String, ResourceSet)>,
    /// (group, bundle index) -> (demand, committed).
    pub bundles: HashMap<(String, u32), (ResourceSet, bool)>,
    /// Lease id -> resources held.
    pub leases: HashMap<String, ResourceSet>,
}

/// Ends a lease on a node (its resources available again); an unknown id changes nothing.
fn give_back(st: &mut NodeState, lease_id: &str) {
    if let Some(r) = st.leases.remove(lease_id) {
        st.available.add(&r);
    }
}

/// Heartbeat figures, shared by every node's loop.
#[derive(Default)]
pub struct HbStats {
    /// Client-side round trips in µs since the last [`HbStats::take`].
    lat_us: Mutex<Vec<u32>>,
    pub sent: AtomicU64,
    pub errors: AtomicU64,
    /// Heartbeats the head answered `accepted: false` (it declared the node dead).
    pub refused: AtomicU64,
    /// The longest time between two heartbeats of one node, in µs, since the last take.
    pub max_gap_us: AtomicU64,
    /// `NodeInfo` entries received in replies' cluster views.
    pub view_entries: AtomicU64,
    /// Replies whose cluster view was a delta (HEAD-13).
    pub view_deltas: AtomicU64,
    pub last_error: Mutex<String>,
}

impl HbStats {
    /// The round trips recorded since the last call (µs), and resets the gap maximum.
    pub fn take(&self) -> (Vec<u32>, u64) {
        let v = std::mem::take(&mut *self.lat_us.lock().unwrap());
        (v, self.max_gap_us.swap(0, Ordering::Relaxed))
    }
}

/// Every simulated node, and what the head asked of them.
pub struct Sim {
    pub nodes: Vec<SimNode>,
    pub hb: HbStats,
    /// Set to end every heartbeat loop.
    pub stop: AtomicBool,
    pub actor_starts: AtomicU64,
    pub actor_kills: AtomicU64,
    pub bundle_prepares: AtomicU64,
    pub bundle_commits: AtomicU64,
    pub bundle_returns: AtomicU64,
    pub list_workers: AtomicU64,
    pub leases: AtomicU64,
}

impl Sim {
    pub fn new(nodes: Vec<SimNode>) -> Arc<Self> {
        Arc::new(Self {
            nodes,
            hb: HbStats::default(),
            stop: AtomicBool::new(false),
            actor_starts: AtomicU64::new(0),
            actor_kills: AtomicU64::new(0),
            bundle_prepares: AtomicU64::new(0),
            bundle_commits: AtomicU64::new(0),
            bundle_returns: AtomicU64::new(0),
            list_workers: AtomicU64::new(0),
            leases: AtomicU64::new(0),
        })
    }

    /// `--tasks`: takes a lease of `want` on node `i` as the lease handler does (a record;
    /// no worker, and no RPC: a lease is the agent's own decision and never reaches the
    /// head, which sees the node's availability in its next heartbeat). `None` when the
    /// node lacks it now or the head declared it dead.
    pub fn take_lease(&self, i: usize, want: &ResourceSet) -> Option<String> {
        let n = &self.nodes[i];
        if n.declared_dead.load(Ordering::Relaxed) {
            return None;
        }
        let mut st = n.state.lock().unwrap();
        st.available.is_superset_of(want).then(|| self.grant(&mut st, want.clone()))
    }

    /// Gives back a lease [`Sim::take_lease`] took on node `i`.
    pub fn return_lease(&self, i: usize, lease_id: &str) {
        give_back(&mut self.nodes[i].state.lock().unwrap(), lease_id);
    }

    /// Records a lease of `want` on a node whose state `st` has it available; its id.
    fn grant(&self, st: &mut NodeState, want: ResourceSet) -> String {
        st.available.saturating_sub(&want);
        let lease_id = tpuray_proto::new_request_id();
        st.leases.insert(lease_id.clone(), want);
        self.leases.fetch_add(1, Ordering::Relaxed);
        lease_id
    }

    /// The node the request was sent to (by the address the head dialled).
    fn node<T>(&self, req: &Request<T>) -> Result<&SimNode, Status> {
        let ip = req
            .local_addr()
            .map(|a| a.ip())
            .ok_or_else(|| Status::internal("head_load: no local address on this connection"))?;
        node_index(ip)
            .and_then(|i| self.nodes.get(i))
            .ok_or_else(|| Status::not_found(format!("head_load: no simulated node at {ip}")))
    }

    /// The registration message of node `i`.
    pub fn node_info(&self, i: usize) -> pb::NodeInfo {
        let n = &self.nodes[i];
        pb::NodeInfo {
            node_id: n.node_id.to_string(),
            address: n.address.clone(),
            hostname: format!("head-load-{i}"),
            total: resources_to_proto(&n.registered),
            available: resources_to_proto(&n.registered),
            labels: n.labels.0.clone().into_iter().collect(),
            state: pb::NodeState::Alive as i32,
            is_head_node: false,
            start_time_ms: tpuray_proto::now_ms(),
            pid: std::process::id(),
            ..Default::default()
        }
    }
}

/// The amounts of `names` in the node's sets now (`partial`, as the real agent answers
/// bundle calls).
fn resources_now(st: &NodeState, names: &[String]) -> pb::NodeResourcesNow {
    let amounts =
        |set: &ResourceSet| names.iter().map(|n| (n.clone(), set.get(n).to_f64())).collect();
    pb::NodeResourcesNow {
        total: amounts(&st.total),
        available: amounts(&st.available),
        partial: true,
    }
}

/// The names a bundle touches: its own resources and the renamed ones a commit adds.
fn bundle_names(pg: &str, index: u32, demand: &ResourceSet, out: &mut Vec<String>) {
    out.extend(demand.iter().map(|(k, _)| k.to_string()));
    let added = tpuray_scheduler::bundles::bundle_resources(demand, pg, index);
    out.extend(added.iter().map(|(k, _)| k.to_string()));
}

fn commit_in(st: &mut NodeState, pg: &str, index: u32) -> Result<(), Status> {
    let st = &mut *st;
    let Some((demand, committed)) = st.bundles.get_mut(&(pg.to_string(), index)) else {
        return Err(Status::not_found(format!(
            "bundle {index} of placement group {pg} is not prepared on this node"
        )));
    };
    if !*committed {
        *committed = true;
        let added = tpuray_scheduler::bundles::bundle_resources(demand, pg, index);
        st.total.add(&added);
        st.available.add(&added);
    }
    Ok(())
}

/// The service answering for every simulated node.
#[derive(Clone)]
pub struct SimSvc(pub Arc<Sim>);

fn not_simulated(what: &str) -> Status {
    Status::unimplemented(format!(
        "head_load's simulated node does not {what} (it stands in for the head's calls only)"
    ))
}

#[tonic::async_trait]
impl NodeAgentService for SimSvc {
    async fn get_node_info(
        &self,
        req: Request<pb::GetNodeInfoRequest>,
    ) -> Result<Response<pb::GetNodeInfoReply>, Status> {
        let n = self.0.node(&req)?;
        let i = self.0.nodes.iter().position(|m| std::ptr::eq(m, n)).unwrap_or(0);
        let mut info = self.0.node_info(i);
        let st = n.state.lock().unwrap();
        info.total = resources_to_proto(&st.total);
        info.available = resources_to_proto(&st.available);
        Ok(Response::new(pb::GetNodeInfoReply { node: Some(info) }))
    }

    async fn request_worker_lease(
        &self,
        req: Request<pb::RequestWorkerLeaseRequest>,
    ) -> Result<Response<pb::RequestWorkerLeaseReply>, Status> {
        use pb::request_worker_lease_reply::{Busy, Granted, Infeasible, Outcome};
        let n = self.0.node(&req)?;
        let req = req.into_inner();
        let want = resources_from_proto(&req.resources)
            .map_err(|e| Status::invalid_argument(format!("lease resources: {e}")))?;
        let mut st = n.state.lock().unwrap();
        let outcome = if !st.total.is_superset_of(&want) {
            Outcome::Infeasible(Infeasible {
                reason: format!("simulated node {} has {} in all", n.node_id, st.total),
            })
        } else if !st.available.is_superset_of(&want) {
            Outcome::Busy(Busy { reason: format!("{want} is not available now") })
        } else {
            Outcome::Granted(Granted {
                lease_id: self.0.grant(&mut st, want),
                // A stand-in: no worker process is behind this lease.
                worker_id: format!("head-load-standin-{}", tpuray_proto::new_request_id()),
                worker_address: n.address.clone(),
                worker_pid: 0,
                node_id: n.node_id.to_string(),
            })
        };
        Ok(Response::new(pb::RequestWorkerLeaseReply { outcome: Some(outcome) }))
    }

    async fn return_worker_lease(
        &self,
        req: Request<pb::ReturnWorkerLeaseRequest>,
    ) -> Result<Response<pb::ReturnWorkerLeaseReply>, Status> {
        let n = self.0.node(&req)?;
        give_back(&mut n.state.lock().unwrap(), &req.into_inner().lease_id);
        Ok(Response::new(pb::ReturnWorkerLeaseReply {}))
    }

    async fn notify_worker_blocked(
        &self,
        _req: Request<pb::NotifyWorkerBlockedRequest>,
    ) -> Result<Response<pb::NotifyWorkerBlockedReply>, Status> {
        Err(not_simulated("run workers that block"))
    }

    async fn register_worker(
        &self,
        _req: Request<pb::RegisterWorkerRequest>,
    ) -> Result<Response<pb::RegisterWorkerReply>, Status> {
        Err(not_simulated("start worker processes"))
    }

    /// The actor stand-in: the resources are taken and a worker id recorded; no process
    /// starts.
    async fn start_actor_worker(
        &self,
        req: Request<pb::StartActorWorkerRequest>,
    ) -> Result<Response<pb::StartActorWorkerReply>, Status> {
        let n = self.0.node(&req)?;
        let req = req.into_inner();
        let resources = resources_from_proto(&req.resources)
            .map_err(|e| Status::invalid_argument(format!("actor resources: {e}")))?;
        let mut st = n.state.lock().unwrap();
        if let Some((wid, _)) = st.actors.get(&req.actor_id) {
            let worker_id = wid.clone();
            return Ok(Response::new(pb::StartActorWorkerReply {
                worker_id,
                worker_address: n.address.clone(),
                pid: 0,
            }));
        }
        if !st.available.is_superset_of(&resources) {
            return Err(Status::resource_exhausted(format!(
                "simulated node {} cannot host actor {}: needs {resources}, available {}",
                n.node_id, req.actor_id, st.available
            )));
        }
        st.available.saturating_sub(&resources);
        let worker_id = tpuray_proto::ids::WorkerId::random().to_string();
        st.actors.insert(req.actor_id, (worker_id.clone(), resources));
        self.0.actor_starts.fetch_add(1, Ordering::Relaxed);
        Ok(Response::new(pb::StartActorWorkerReply {
            worker_id,
            worker_address: n.address.clone(),
            pid: 0,
        }))
    }

    async fn kill_actor_worker(
        &self,
        req: Request<pb::KillActorWorkerRequest>,
    ) -> Result<Response<pb::KillActorWorkerReply>, Status> {
        let n = self.0.node(&req)?;
        let req = req.into_inner();
        let mut st = n.state.lock().unwrap();
        let killed = match st.actors.get(&req.actor_id) {
            Some((w, _)) if req.worker_id.is_empty() || *w == req.worker_id => {
                let (_, r) = st.actors.remove(&req.actor_id).expect("found above");
                st.available.add(&r);
                true
            }
            _ => false,
        };
        self.0.actor_kills.fetch_add(u64::from(killed), Ordering::Relaxed);
        Ok(Response::new(pb::KillActorWorkerReply { killed }))
    }

    async fn list_workers(
        &self,
        req: Request<pb::ListWorkersRequest>,
    ) -> Result<Response<pb::ListWorkersReply>, Status> {
        let n = self.0.node(&req)?;
        self.0.list_workers.fetch_add(1, Ordering::Relaxed);
        let st = n.state.lock().unwrap();
        let workers = st
            .actors
            .iter()
            .map(|(actor_id, (worker_id, r))| pb::WorkerInfo {
                worker_id: worker_id.clone(),
                pid: 0,
                address: n.address.clone(),
                key: None,
                state: "ACTOR".into(),
                lease_id: String::new(),
                actor_id: actor_id.clone(),
                resources: resources_to_proto(r),
            })
            .collect();
        Ok(Response::new(pb::ListWorkersReply { workers }))
    }

    async fn prestart_workers(
        &self,
        _req: Request<pb::PrestartWorkersRequest>,
    ) -> Result<Response<pb::PrestartWorkersReply>, Status> {
        Ok(Response::new(pb::PrestartWorkersReply { started: 0 }))
    }

    async fn prepare_bundles(
        &self,
        req: Request<pb::PrepareBundlesRequest>,
    ) -> Result<Response<pb::PrepareBundlesReply>, Status> {
        let n = self.0.node(&req)?;
        let req = req.into_inner();
        let pg = req.placement_group_id;
        let mut bundles = Vec::new();
        for b in &req.bundles {
            let r = resources_from_proto(&b.resources)
                .map_err(|e| Status::invalid_argument(format!("bundle {}: {e}", b.index)))?;
            bundles.push((b.index, r));
        }
        let mut st = n.state.lock().unwrap();
        // AGENT-6: all of the request or none; bundles already here stay as they are.
        let fresh: Vec<&(u32, ResourceSet)> =
            bundles.iter().filter(|(i, _)| !st.bundles.contains_key(&(pg.clone(), *i))).collect();
        let mut need = ResourceSet::new();
        for (_, d) in &fresh {
            need.add(d);
        }
        if !st.available.is_superset_of(&need) {
            return Err(Status::resource_exhausted(format!(
                "simulated node {} cannot reserve {} bundle(s) of placement group {pg}: needs {need}, available {}",
                n.node_id,
                fresh.len(),
                st.available
            )));
        }
        st.available.saturating_sub(&need);
        for (i, d) in fresh {
            st.bundles.insert((pg.clone(), *i), (d.clone(), false));
        }
        self.0.bundle_prepares.fetch_add(1, Ordering::Relaxed);
        if !req.commit {
            return Ok(Response::new(pb::PrepareBundlesReply { resources: None }));
        }
        let mut names = Vec::new();
        for (i, d) in &bundles {
            commit_in(&mut st, &pg, *i)?;
            bundle_names(&pg, *i, d, &mut names);
        }
        self.0.bundle_commits.fetch_add(1, Ordering::Relaxed);
        Ok(Response::new(pb::PrepareBundlesReply { resources: Some(resources_now(&st, &names)) }))
    }

    async fn commit_bundles(
        &self,
        req: Request<pb::CommitBundlesRequest>,
    ) -> Result<Response<pb::CommitBundlesReply>, Status> {
        let n = self.0.node(&req)?;
        let req = req.into_inner();
        let pg = req.placement_group_id;
        let mut st = n.state.lock().unwrap();
        let mut names = Vec::new();
        for i in &req.indexes {
            commit_in(&mut st, &pg, *i)?;
            let d = st.bundles[&(pg.clone(), *i)].0.clone();
            bundle_names(&pg, *i, &d, &mut names);
        }
        self.0.bundle_commits.fetch_add(1, Ordering::Relaxed);
        Ok(Response::new(pb::CommitBundlesReply { resources: Some(resources_now(&st, &names)) }))
    }

    async fn return_bundles(
        &self,
        req: Request<pb::ReturnBundlesRequest>,
    ) -> Result<Response<pb::ReturnBundlesReply>, Status> {
        let n = self.0.node(&req)?;
        let req = req.into_inner();
        let pg = req.placement_group_id;
        let mut st = n.state.lock().unwrap();
        let st = &mut *st;
        let keys: Vec<(String, u32)> = st
            .bundles
            .keys()
            .filter(|(g, i)| *g == pg && (req.indexes.is_empty() || req.indexes.contains(i)))
            .cloned()
            .collect();
        let mut names = Vec::new();
        for key in keys {
            let (demand, committed) = st.bundles.remove(&key).expect("listed above");
            if committed {
                let added = tpuray_scheduler::bundles::bundle_resources(&demand, &pg, key.1);
                st.total.saturating_sub(&added);
                st.available.saturating_sub(&added);
            }
            st.available.add(&demand);
            bundle_names(&pg, key.1, &demand, &mut names);
        }
        self.0.bundle_returns.fetch_add(1, Ordering::Relaxed);
        Ok(Response::new(pb::ReturnBundlesReply {
            workers_stopped: 0,
            resources: Some(resources_now(st, &names)),
        }))
    }

    async fn start_job_supervisor(
        &self,
        _req: Request<pb::StartJobSupervisorRequest>,
    ) -> Result<Response<pb::StartJobSupervisorReply>, Status> {
        Err(not_simulated("run job supervisors"))
    }

    async fn stop_job_supervisor(
        &self,
        _req: Request<pb::StopJobSupervisorRequest>,
    ) -> Result<Response<pb::StopJobSupervisorReply>, Status> {
        Ok(Response::new(pb::StopJobSupervisorReply { found: false }))
    }

    async fn read_job_logs(
        &self,
        _req: Request<pb::ReadJobLogsRequest>,
    ) -> Result<Response<pb::ReadJobLogsReply>, Status> {
        Ok(Response::new(pb::ReadJobLogsReply { found: false, data: vec![], size: 0 }))
    }

    async fn list_logs(
        &self,
        _req: Request<pb::ListLogsRequest>,
    ) -> Result<Response<pb::ListLogsReply>, Status> {
        Ok(Response::new(pb::ListLogsReply { files: vec![] }))
    }

    async fn read_log(
        &self,
        _req: Request<pb::ReadLogRequest>,
    ) -> Result<Response<pb::ReadLogReply>, Status> {
        Ok(Response::new(pb::ReadLogReply { found: false, ..Default::default() }))
    }

    async fn report_metrics(
        &self,
        _req: Request<pb::ReportMetricsRequest>,
    ) -> Result<Response<pb::ReportMetricsReply>, Status> {
        Err(not_simulated("host workers that report metrics"))
    }
}

/// A head client shared by a group of nodes (one HTTP/2 connection).
pub type HeadClient = pb::head_service_client::HeadServiceClient<tpuray_proto::client::AuthChannel>;

/// `HeartbeatReply` as the simulated nodes read it: the same wire fields, but the cluster
/// view's entries (`NodeInfo`, field 3) are kept as their encoded bytes, counted and not
/// parsed. A real agent parses the few entries each reply brings for its one node; here
/// thousands of nodes share the harness's cores, and parsing was a fifth of its CPU.
#[derive(Clone, PartialEq, prost::Message)]
pub struct HeartbeatReplySkim {
    #[prost(bool, tag = "1")]
    pub accepted: bool,
    #[prost(string, tag = "2")]
    pub reason: String,
    #[prost(bytes = "bytes", repeated, tag = "3")]
    pub cluster: Vec<prost::bytes::Bytes>,
    #[prost(uint64, tag = "4")]
    pub view_epoch: u64,
    #[prost(uint64, tag = "5")]
    pub view_version: u64,
    #[prost(bool, tag = "6")]
    pub view_delta: bool,
}

/// The heartbeat call of the simulated nodes: `HeadService/Heartbeat` on a head client's
/// connection, its reply read as [`HeartbeatReplySkim`].
#[derive(Clone)]
pub struct HeartbeatClient(tonic::client::Grpc<tpuray_proto::client::AuthChannel>);

impl HeartbeatClient {
    pub fn new(channel: tpuray_proto::client::AuthChannel) -> Self {
        Self(tonic::client::Grpc::new(channel))
    }

    pub async fn heartbeat(
        &mut self,
        req: Request<pb::HeartbeatRequest>,
    ) -> Result<Response<HeartbeatReplySkim>, Status> {
        self.0.ready().await.map_err(|e| Status::unavailable(format!("not ready: {e}")))?;
        let path = tonic::codegen::http::uri::PathAndQuery::from_static(
            "/tpuray.v1.HeadService/Heartbeat",
        );
        let codec = tonic_prost::ProstCodec::<pb::HeartbeatRequest, HeartbeatReplySkim>::default();
        self.0.unary(req, path, codec).await
    }
}

/// Node `i`'s heartbeat loop, as the real agent's (AGENT-1, `worker/src/run.rs`): every
/// `interval` (missed ticks delayed, not bunched), the node's totals and availability,
/// with the real agent's request timeout (`max(interval, 2 s)`). A refusal (the head
/// declared the node dead) ends the loop, as it ends the real agent; a failed call is
/// counted and the loop goes on.
pub async fn heartbeat_loop(
    sim: Arc<Sim>,
    i: usize,
    mut client: HeartbeatClient,
    interval: Duration,
    first_after: Duration,
) {
    tokio::time::sleep(first_after).await;
    let mut iv = tokio::time::interval(interval);
    iv.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    let mut seq = 0u64;
    let mut last_sent: Option<Instant> = None;
    let mut view = crate::sim::ViewCursor::default();
    loop {
        iv.tick().await;
        if sim.stop.load(Ordering::Relaxed) {
            return;
        }
        let n = &sim.nodes[i];
        seq += 1;
        let body = {
            let st = n.state.lock().unwrap();
            pb::HeartbeatRequest {
                node_id: n.node_id.to_string(),
                total: resources_to_proto(&st.total),
                available: resources_to_proto(&st.available),
                pending: vec![],
                num_workers: st.actors.len() as u32,
                seq,
                job_submissions: vec![],
                view_epoch: view.epoch,
                view_version: view.version,
            }
        };
        let mut req = Request::new(body);
        req.set_timeout(interval.max(Duration::from_secs(2)));
        let t0 = Instant::now();
        if let Some(prev) = last_sent {
            sim.hb.max_gap_us.fetch_max((t0 - prev).as_micros() as u64, Ordering::Relaxed);
        }
        last_sent = Some(t0);
        sim.hb.sent.fetch_add(1, Ordering::Relaxed);
        match client.heartbeat(req).await {
            Ok(r) => {
                let us = t0.elapsed().as_micros().min(u128::from(u32::MAX)) as u32;
                sim.hb.lat_us.lock().unwrap().push(us);
                let r = r.into_inner();
                if !r.accepted {
                    sim.hb.refused.fetch_add(1, Ordering::Relaxed);
                    n.declared_dead.store(true, Ordering::Relaxed);
                    eprintln!("head_load: the head refused node {i} ({}): {}", n.node_id, r.reason);
                    return;
                }
                sim.hb.view_entries.fetch_add(r.cluster.len() as u64, Ordering::Relaxed);
                if r.view_delta {
                    sim.hb.view_deltas.fetch_add(1, Ordering::Relaxed);
                }
                view = ViewCursor { epoch: r.view_epoch, version: r.view_version };
            }
            Err(s) => {
                sim.hb.errors.fetch_add(1, Ordering::Relaxed);
                *sim.hb.last_error.lock().unwrap() = format!("{}: {}", s.code(), s.message());
            }
        }
    }
}

/// Which cluster view a node holds (HEAD-13): the head's epoch and version, 0 for none.
#[derive(Clone, Copy, Default)]
pub struct ViewCursor {
    pub epoch: u64,
    pub version: u64,
}
