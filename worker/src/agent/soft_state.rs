//! The agent's soft state as others read it: this node's info, the heartbeat's resources
//! and demand, `/metrics`' view of the workers, `ListWorkers`, and the head's view of the
//! other nodes (whole or as HEAD-13 deltas) that lease decisions spill to.

use tonic::Request;
use tpuray_proto::convert::{resources_from_proto, resources_to_proto};
use tpuray_proto::{now_ms, pb};

use super::*;

impl Agent {
    /// Every worker process of this node as `ListWorkers` answers: state, lease or actor,
    /// and what it holds.
    pub(super) fn list_workers(&self) -> Vec<pb::WorkerInfo> {
        let st = self.lock();
        st.workers
            .iter()
            .map(|(id, w)| {
                let (state, lease_id, actor_id, resources) = match &w.state {
                    WorkerState::Starting => {
                        ("STARTING", String::new(), String::new(), ResourceSet::new())
                    }
                    WorkerState::Idle { .. } => {
                        ("IDLE", String::new(), String::new(), ResourceSet::new())
                    }
                    WorkerState::Leased(l) => (
                        "LEASED",
                        l.to_string(),
                        String::new(),
                        st.leases.get(l).map(|l| l.hold.resources.clone()).unwrap_or_default(),
                    ),
                    WorkerState::Actor(a) => (
                        "ACTOR",
                        String::new(),
                        a.to_string(),
                        st.actor_resources.get(a).map(|r| r.1.clone()).unwrap_or_default(),
                    ),
                };
                pb::WorkerInfo {
                    worker_id: id.to_string(),
                    pid: w.pid,
                    address: w.address.clone(),
                    key: Some(pb::WorkerPoolKey {
                        job_id: w.key.job_id.clone(),
                        language: w.key.language.clone(),
                        runtime_env_hash: w.key.runtime_env_hash.clone(),
                        tpu_chips: w.key.tpu_chips.clone(),
                    }),
                    state: state.to_string(),
                    lease_id,
                    actor_id,
                    resources: resources_to_proto(&resources),
                }
            })
            .collect()
    }

    /// This node's info as sent at registration.
    pub fn node_info(&self) -> pb::NodeInfo {
        let st = self.lock();
        pb::NodeInfo {
            node_id: self.config.node_id.to_string(),
            address: self.config.advertise_address.clone(),
            hostname: hostname(),
            total: resources_to_proto(&self.config.total),
            available: resources_to_proto(st.ledger.available()),
            labels: self.config.labels.0.clone().into_iter().collect(),
            state: pb::NodeState::Alive as i32,
            is_head_node: self.config.is_head_node,
            death_reason: String::new(),
            start_time_ms: now_ms(),
            last_heartbeat_ms: 0,
            pending: vec![],
            num_workers: st.workers.len() as u32,
            session_dir: self.config.session_dir.display().to_string(),
            pid: std::process::id(),
            object_store_dir: self.config.store.dir().display().to_string(),
            metrics_export_port: u32::from(self.metrics.port.get().copied().unwrap_or(0)),
        }
    }

    /// What `/metrics` reads from the agent's state (`metrics.rs`).
    pub fn metrics_view(&self) -> crate::metrics::AgentView {
        let st = self.lock();
        crate::metrics::AgentView {
            total: st.ledger.total().clone(),
            available: st.ledger.available().clone(),
            workers: st
                .workers
                .iter()
                .map(|(id, w)| crate::metrics::WorkerView {
                    worker_id: id.to_string(),
                    pid: w.pid,
                    job_id: w.key.job_id.clone(),
                    state: match w.state {
                        WorkerState::Starting => "STARTING",
                        WorkerState::Idle { .. } => "IDLE",
                        WorkerState::Leased(_) => "LEASED",
                        WorkerState::Actor(_) => "ACTOR",
                    },
                    tpu_chips: w.key.tpu_chips.clone(),
                })
                .collect(),
            tpu_chips: st.ledger.host_chips(),
        }
    }

    /// What a heartbeat carries: total and available resources, demand, worker count.
    pub fn heartbeat_snapshot(&self) -> (ResourceSet, ResourceSet, Vec<pb::ResourceDemand>, u32) {
        let mut st = self.lock();
        st.demands.retain(|_, d| {
            d.waiting > 0 || (d.infeasible && d.last_seen.elapsed() < INFEASIBLE_TTL)
        });
        let demands = st
            .demands
            .values()
            .map(|d| pb::ResourceDemand {
                shape: resources_to_proto(&d.shape),
                count: d.waiting.max(1),
                infeasible: d.infeasible,
                reason: d.reason.clone(),
                placement_group_id: String::new(),
            })
            .collect();
        (st.ledger.total().clone(), st.ledger.available().clone(), demands, st.workers.len() as u32)
    }

    /// Records the head's view of the other nodes from a heartbeat reply: the whole view,
    /// or with `delta` (HEAD-13) the nodes that changed, applied over the view held, and
    /// the ids of those `removed`.
    pub fn set_cluster_view(&self, nodes: Vec<pb::NodeInfo>, delta: bool, removed: &[String]) {
        let views: Vec<(NodeView<String>, String)> = nodes
            .into_iter()
            .filter(|n| n.node_id != self.config.node_id.as_str())
            .filter_map(|n| {
                let total = resources_from_proto(&n.total).ok()?;
                let available = resources_from_proto(&n.available).ok()?;
                Some((
                    NodeView {
                        id: n.node_id,
                        total,
                        available,
                        labels: Labels(n.labels.into_iter().collect()),
                        alive: true,
                    },
                    n.address,
                ))
            })
            .collect();
        let mut st = self.lock();
        if !delta {
            st.cluster = views;
            return;
        }
        apply_view_delta(&mut st.cluster, views, removed);
    }

    /// Reads the live nodes from the head now, instead of waiting for the next
    /// heartbeat's view (a node that joined a moment ago, named by node affinity).
    pub(super) async fn refresh_cluster_view(&self) {
        let Ok(mut head) =
            tpuray_proto::client::head(&self.head_leader(), self.config.token.as_deref())
        else {
            return;
        };
        let mut req = Request::new(pb::GetClusterStatusRequest {});
        req.set_timeout(Duration::from_secs(2));
        if let Ok(r) = head.get_cluster_status(req).await {
            let alive = r
                .into_inner()
                .nodes
                .into_iter()
                .filter(|n| n.state == pb::NodeState::Alive as i32)
                .collect();
            self.set_cluster_view(alive, false, &[]);
        }
    }

    pub(super) fn local_view(&self, st: &AgentState) -> NodeView<String> {
        NodeView {
            id: self.config.node_id.to_string(),
            total: st.ledger.total().clone(),
            available: st.ledger.available().clone(),
            labels: self.config.labels.clone(),
            alive: true,
        }
    }

    pub(super) fn note_demand(
        &self,
        st: &mut AgentState,
        shape: &ResourceSet,
        infeasible: bool,
        reason: &str,
        delta: i32,
    ) {
        let key = format!("{shape}|{infeasible}");
        let d = st.demands.entry(key).or_insert_with(|| Demand {
            shape: shape.clone(),
            infeasible,
            reason: reason.to_string(),
            waiting: 0,
            last_seen: Instant::now(),
        });
        d.last_seen = Instant::now();
        d.reason = reason.to_string();
        d.waiting = (d.waiting as i32 + delta).max(0) as u32;
    }
}

/// Takes a waiting lease request off the pending demand when it is dropped
/// while still counted.
pub(super) struct WaitingGuard<'a> {
    pub(super) agent: &'a Agent,
    pub(super) demand: ResourceSet,
    pub(super) waiting: std::cell::Cell<bool>,
}

impl Drop for WaitingGuard<'_> {
    fn drop(&mut self) {
        if self.waiting.get() {
            let mut st = self.agent.lock();
            self.agent.note_demand(&mut st, &self.demand, false, "", -1);
        }
    }
}

/// HEAD-13: `changed` nodes replace their entries in `view` (or join it), `removed` ones
/// leave it; the other entries stay as they are.
pub(super) fn apply_view_delta(
    view: &mut Vec<(NodeView<String>, String)>,
    changed: Vec<(NodeView<String>, String)>,
    removed: &[String],
) {
    if changed.is_empty() && removed.is_empty() {
        return;
    }
    let gone: std::collections::HashSet<&str> = removed.iter().map(String::as_str).collect();
    let fresh: std::collections::HashSet<&str> =
        changed.iter().map(|(v, _)| v.id.as_str()).collect();
    view.retain(|(v, _)| !gone.contains(v.id.as_str()) && !fresh.contains(v.id.as_str()));
    view.extend(changed);
}

#[cfg(test)]
mod view_tests {
    use super::*;

    fn entry(id: &str, cpu: u64) -> (NodeView<String>, String) {
        let mut total = ResourceSet::new();
        total.set("CPU", tpuray_scheduler::Amount::whole(cpu));
        let view = NodeView {
            id: id.to_string(),
            total: total.clone(),
            available: total,
            labels: Labels::default(),
            alive: true,
        };
        (view, format!("{id}:1"))
    }

    #[test]
    fn a_view_delta_replaces_changed_nodes_drops_removed_ones_and_keeps_the_rest() {
        let mut view = vec![entry("a", 1), entry("b", 1), entry("c", 1)];
        apply_view_delta(&mut view, vec![entry("b", 8), entry("d", 2)], &["c".to_string()]);
        let mut got: Vec<(String, f64)> =
            view.iter().map(|(v, _)| (v.id.clone(), v.total.get("CPU").to_f64())).collect();
        got.sort_by(|x, y| x.0.cmp(&y.0));
        let want = [("a", 1.0), ("b", 8.0), ("d", 2.0)].map(|(k, v)| (k.to_string(), v));
        assert_eq!(got, want.to_vec());
        // An empty delta changes nothing.
        apply_view_delta(&mut view, vec![], &[]);
        assert_eq!(view.len(), 3);
    }
}
