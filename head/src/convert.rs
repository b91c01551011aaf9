//! Durable records → wire messages (`to_proto`).

use tpuray_proto::convert::{labels_to_proto, resources_to_proto, strategy_to_proto};
use tpuray_proto::pb;

use crate::state::{ActorRecord, ActorStatus, JobRecord, JobStatus, NodeRecord, NodeStatus};
use crate::submissions::SubmissionRecord;

pub fn node_to_proto(n: &NodeRecord) -> pb::NodeInfo {
    let (state, death_reason) = match &n.status {
        NodeStatus::Alive => (pb::NodeState::Alive, String::new()),
        NodeStatus::Dead { reason } => (pb::NodeState::Dead, reason.clone()),
    };
    pb::NodeInfo {
        node_id: n.node_id.to_string(),
        address: n.address.clone(),
        hostname: n.hostname.clone(),
        total: resources_to_proto(&n.total),
        available: Default::default(),
        labels: n.labels.0.clone().into_iter().collect(),
        state: state as i32,
        is_head_node: n.is_head_node,
        death_reason,
        start_time_ms: n.start_time_ms,
        last_heartbeat_ms: 0,
        pending: vec![],
        num_workers: 0,
        session_dir: n.session_dir.clone(),
        pid: n.pid,
        object_store_dir: n.object_store_dir.clone(),
        metrics_export_port: u32::from(n.metrics_export_port),
    }
}

pub fn job_to_proto(j: &JobRecord) -> pb::JobInfo {
    pb::JobInfo {
        job_id: j.job_id.to_string(),
        state: match j.status {
            JobStatus::Running => pb::JobState::Running,
            JobStatus::Finished => pb::JobState::Finished,
        } as i32,
        driver_address: j.driver_address.clone(),
        entrypoint: j.entrypoint.clone(),
        namespace: j.namespace.clone(),
        start_time_ms: j.start_time_ms,
        end_time_ms: j.end_time_ms,
        driver_pid: j.driver_pid,
        worker_binary_hash: j.worker_binary_hash.clone(),
        submission_id: j.submission_id.clone(),
    }
}

/// A submission as the wire carries it.
pub fn submission_to_proto(s: &SubmissionRecord) -> pb::JobSubmission {
    let (node, agent) =
        s.placed.as_ref().map(|(n, a)| (n.to_string(), a.clone())).unwrap_or_default();
    let (job_id, driver_address, driver_pid) =
        s.driver.as_ref().map(|(j, a, p)| (j.to_string(), a.clone(), *p)).unwrap_or_default();
    pb::JobSubmission {
        submission_id: s.submission_id.clone(),
        status: s.status.as_str().into(),
        entrypoint: s.entrypoint.clone(),
        message: s.message.clone(),
        error_type: s.error_type.clone(),
        start_time_ms: s.start_time_ms,
        end_time_ms: s.end_time_ms,
        metadata: s.metadata.clone().into_iter().collect(),
        runtime_env_json: s.runtime_env_json.clone(),
        entrypoint_num_cpus: s.entrypoint_num_cpus,
        entrypoint_num_gpus: s.entrypoint_num_gpus,
        entrypoint_memory: s.entrypoint_memory,
        entrypoint_resources: s.entrypoint_resources.clone().into_iter().collect(),
        entrypoint_label_selector: s.entrypoint_label_selector.clone().into_iter().collect(),
        driver_node_id: node,
        driver_agent_address: agent,
        driver_exit_code: s.driver_exit_code,
        job_id,
        driver_address,
        driver_pid,
        stop_requested: s.stop_requested,
        submit_time_ms: s.submit_time_ms,
    }
}

pub fn actor_to_proto(a: &ActorRecord, pending_reason: Option<&str>) -> pb::ActorInfo {
    let mut info = pb::ActorInfo {
        actor_id: a.actor_id.to_string(),
        job_id: a.job_id.to_string(),
        name: a.name.clone(),
        namespace: a.namespace.clone(),
        class_name: a.class_name.clone(),
        num_restarts: a.num_restarts,
        max_restarts: a.max_restarts,
        detached: a.detached,
        resources: resources_to_proto(&a.resources),
        label_selector: labels_to_proto(&a.label_selector),
        strategy: Some(match &a.placement_group {
            Some((pg, i)) => tpuray_proto::convert::placement_group_to_proto(pg.as_str(), *i),
            None => strategy_to_proto(&a.strategy()),
        }),
        pending_reason: pending_reason.unwrap_or_default().to_string(),
        ..Default::default()
    };
    match &a.status {
        ActorStatus::PendingCreation => info.state = pb::ActorState::PendingCreation as i32,
        ActorStatus::Alive { node_id, worker_id, address, pid } => {
            info.state = pb::ActorState::Alive as i32;
            info.node_id = node_id.to_string();
            info.worker_id = worker_id.to_string();
            info.worker_address = address.clone();
            info.pid = *pid;
        }
        ActorStatus::Restarting { cause } => {
            info.state = pb::ActorState::Restarting as i32;
            info.death_cause = cause.clone();
        }
        ActorStatus::Dead { cause } => {
            info.state = pb::ActorState::Dead as i32;
            info.death_cause = cause.clone();
        }
    }
    // A restarting or dead actor still shows where it last ran.
    if info.node_id.is_empty()
        && let Some((node, pid)) = &a.last_placement
    {
        info.node_id = node.to_string();
        info.pid = *pid;
    }
    info
}
