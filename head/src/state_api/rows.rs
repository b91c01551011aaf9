//! The rows of each resource in Ray's column names (STATE-1), fetched from the head's
//! tables and, for workers and objects, from every live node agent.

use super::*;

pub(super) fn opt_str(s: &str) -> Value {
    if s.is_empty() { Value::Null } else { json!(s) }
}

pub(super) fn opt_ms(ms: u64) -> Value {
    if ms == 0 { Value::Null } else { json!(ms) }
}

pub(crate) fn host(addr: &str) -> String {
    addr.rsplit_once(':').map(|(h, _)| h).unwrap_or(addr).to_string()
}

/// Ray's task state for a tpuray task event's state (`SUBMITTED` is Ray's
/// `PENDING_NODE_ASSIGNMENT`; the others have Ray's names).
pub fn ray_task_state(s: &str) -> &str {
    match s {
        "SUBMITTED" => "PENDING_NODE_ASSIGNMENT",
        other => other,
    }
}

/// Every row of `resource` the cluster has, how many the source had before it dropped
/// any, and which sources did not answer.
pub(super) struct Fetched {
    pub(super) rows: Vec<Value>,
    pub(super) total: usize,
    pub(super) unreachable: Vec<String>,
}

impl Fetched {
    pub(super) fn all(rows: Vec<Value>) -> Self {
        Self { total: rows.len(), rows, unreachable: Vec::new() }
    }
}

pub(super) async fn fetch(api: &Api, resource: &str) -> Result<Fetched, String> {
    let mut grpc = api.grpc.clone();
    let err = |s: tonic::Status| format!("the head did not answer: {}", s.message());
    match resource {
        "tasks" => {
            let r =
                grpc.list_tasks(pb::ListTasksRequest { limit: 0 }).await.map_err(err)?.into_inner();
            let actors =
                grpc.list_actors(pb::ListActorsRequest {}).await.map_err(err)?.into_inner();
            let class_of: BTreeMap<String, String> =
                actors.actors.into_iter().map(|a| (a.actor_id, a.class_name)).collect();
            let rows: Vec<Value> = r.tasks.iter().map(|t| task_row(t, &class_of)).collect();
            let total = rows.len() + r.dropped as usize;
            Ok(Fetched { rows, total, unreachable: Vec::new() })
        }
        "actors" => {
            let r = grpc.list_actors(pb::ListActorsRequest {}).await.map_err(err)?.into_inner();
            let rows: Vec<Value> = r.actors.iter().map(actor_row).collect();
            Ok(Fetched::all(rows))
        }
        "nodes" => {
            let r = grpc
                .get_cluster_status(pb::GetClusterStatusRequest {})
                .await
                .map_err(err)?
                .into_inner();
            let rows: Vec<Value> = r.nodes.iter().map(node_row).collect();
            Ok(Fetched::all(rows))
        }
        "placement_groups" => {
            let r = grpc
                .list_placement_groups(pb::ListPlacementGroupsRequest {})
                .await
                .map_err(err)?
                .into_inner();
            let rows: Vec<Value> = r.placement_groups.iter().map(group_row).collect();
            Ok(Fetched::all(rows))
        }
        "jobs" => {
            let subs =
                grpc.list_job_submissions(pb::ListJobSubmissionsRequest {}).await.map_err(err)?;
            let drivers = grpc.list_jobs(pb::ListJobsRequest {}).await.map_err(err)?.into_inner();
            let mut rows: Vec<Value> =
                subs.into_inner().jobs.iter().map(crate::http::submission_details).collect();
            rows.extend(
                drivers
                    .jobs
                    .iter()
                    .filter(|j| j.submission_id.is_empty())
                    .map(crate::http::driver_details),
            );
            Ok(Fetched::all(rows))
        }
        "workers" => workers(api).await,
        "objects" => objects(api).await,
        other => Err(format!("no listing of {other}")),
    }
}

pub(super) fn task_row(t: &pb::TaskSummary, class_of: &BTreeMap<String, String>) -> Value {
    // Ray names an actor task `Class.method` in func_or_class_name too.
    let ty = if t.actor_id.is_empty() {
        "NORMAL_TASK"
    } else if t.name.ends_with("__init__") {
        "ACTOR_CREATION_TASK"
    } else {
        "ACTOR_TASK"
    };
    let func = match class_of.get(&t.actor_id) {
        Some(class) if ty == "ACTOR_TASK" && !t.name.contains('.') => format!("{class}.{}", t.name),
        _ => t.name.clone(),
    };
    let state = ray_task_state(&t.state);
    json!({
        "task_id": t.task_id,
        "attempt_number": t.attempt,
        "name": t.name,
        "state": state,
        "job_id": t.job_id,
        "actor_id": opt_str(&t.actor_id),
        "type": ty,
        "func_or_class_name": func,
        "parent_task_id": "",
        "node_id": opt_str(&t.node_id),
        "worker_id": opt_str(&t.worker_id),
        "worker_pid": Value::Null,
        "error_type": if state == "FAILED" { json!("TASK_EXECUTION_EXCEPTION") } else { Value::Null },
        "language": Value::Null,
        "required_resources": Value::Null,
        "runtime_env_info": Value::Null,
        "placement_group_id": Value::Null,
        "events": Value::Null,
        "profiling_data": Value::Null,
        "creation_time_ms": opt_ms(t.submitted_ms),
        "start_time_ms": Value::Null,
        "end_time_ms": opt_ms(t.finished_ms),
        "task_log_info": t.log_info.as_ref().map_or(Value::Null, task_log_info),
        "error_message": opt_str(&t.error),
        "is_debugger_paused": Value::Null,
        "call_site": Value::Null,
        "label_selector": Value::Null,
        "fallback_strategy": Value::Null,
    })
}

/// Ray's `task_log_info` (LOGS-3): file names under the node's logs directory and byte
/// offsets; the ends are null while the task runs.
pub(super) fn task_log_info(l: &pb::TaskLogInfo) -> Value {
    let end = |v: u64| if l.ended { json!(v) } else { Value::Null };
    json!({
        "stdout_file": l.stdout_file,
        "stderr_file": l.stderr_file,
        "stdout_start": l.stdout_start,
        "stdout_end": end(l.stdout_end),
        "stderr_start": l.stderr_start,
        "stderr_end": end(l.stderr_end),
    })
}

pub(super) fn actor_state(s: i32) -> &'static str {
    match pb::ActorState::try_from(s).unwrap_or(pb::ActorState::Unspecified) {
        pb::ActorState::PendingCreation => "PENDING_CREATION",
        pb::ActorState::Alive => "ALIVE",
        pb::ActorState::Restarting => "RESTARTING",
        pb::ActorState::Dead => "DEAD",
        pb::ActorState::Unspecified => "DEPENDENCIES_UNREADY",
    }
}

pub(super) fn actor_row(a: &pb::ActorInfo) -> Value {
    let pg = match tpuray_proto::convert::placement_group_from_proto(a.strategy.as_ref()) {
        Some((id, _)) => opt_str(&id),
        None => Value::Null,
    };
    json!({
        "actor_id": a.actor_id,
        "class_name": a.class_name,
        "state": actor_state(a.state),
        "job_id": a.job_id,
        "name": a.name,
        "node_id": opt_str(&a.node_id),
        "pid": if a.pid == 0 { Value::Null } else { json!(a.pid) },
        "ray_namespace": a.namespace,
        "serialized_runtime_env": Value::Null,
        "required_resources": a.resources,
        "death_cause": if a.death_cause.is_empty() {
            Value::Null
        } else {
            json!({"actor_died_error_context": {"error_message": a.death_cause}})
        },
        "is_detached": a.detached,
        "placement_group_id": pg,
        "repr_name": "",
        "num_restarts": a.num_restarts,
        "num_restarts_due_to_lineage_reconstruction": 0,
        "num_restarts_due_to_node_preemption": 0,
        "call_site": Value::Null,
        "label_selector": Value::Null,
        "fallback_strategy": Value::Null,
    })
}

pub(super) fn node_row(n: &pb::NodeInfo) -> Value {
    let alive = n.state == pb::NodeState::Alive as i32;
    json!({
        "node_id": n.node_id,
        "node_ip": host(&n.address),
        "is_head_node": n.is_head_node,
        "state": if alive { "ALIVE" } else { "DEAD" },
        "state_message": opt_str(&n.death_reason),
        "node_name": n.hostname,
        "resources_total": n.total,
        "labels": n.labels,
        "start_time_ms": opt_ms(n.start_time_ms),
        "end_time_ms": Value::Null,
    })
}

pub(super) fn group_row(p: &pb::PlacementGroupInfo) -> Value {
    let state = match pb::PlacementGroupState::try_from(p.state)
        .unwrap_or(pb::PlacementGroupState::Unspecified)
    {
        pb::PlacementGroupState::Created => "CREATED",
        pb::PlacementGroupState::Removed => "REMOVED",
        pb::PlacementGroupState::Rescheduling => "RESCHEDULING",
        _ => "PENDING",
    };
    let bundles: Vec<Value> = p
        .bundles
        .iter()
        .enumerate()
        .map(|(i, b)| {
            json!({
                "bundle_id": format!("{}_{i}", p.placement_group_id),
                "node_id": opt_str(p.bundle_node_ids.get(i).map(String::as_str).unwrap_or("")),
                "unit_resources": b.resources,
            })
        })
        .collect();
    json!({
        "placement_group_id": p.placement_group_id,
        "name": p.name,
        "creator_job_id": p.job_id,
        "state": state,
        "bundles": bundles,
        "is_detached": p.detached,
        "stats": {"scheduling_state": if p.infeasible { "INFEASIBLE" } else { state }, "pending_reason": p.pending_reason},
        "topology_strategy": {"strategy": p.strategy},
        "topology_assignments": Value::Null,
    })
}

/// The nodes alive now: (node id, agent address).
pub(super) async fn alive_nodes(api: &Api) -> Result<Vec<(String, String)>, String> {
    let mut grpc = api.grpc.clone();
    let r = grpc
        .get_cluster_status(pb::GetClusterStatusRequest {})
        .await
        .map_err(|s| format!("the head did not answer: {}", s.message()))?;
    Ok(r.into_inner()
        .nodes
        .into_iter()
        .filter(|n| n.state == pb::NodeState::Alive as i32)
        .map(|n| (n.node_id, n.address))
        .collect())
}

/// Worker processes of every live node (from their agents) and the running drivers.
pub(super) async fn workers(api: &Api) -> Result<Fetched, String> {
    let mut rows = Vec::new();
    let mut unreachable = Vec::new();
    let nodes = alive_nodes(api).await?;
    for (node_id, address) in nodes.clone() {
        let r = match api.head.agent_client(&address) {
            Ok(mut agent) => agent
                .list_workers(pb::ListWorkersRequest {})
                .await
                .map_err(|s| s.message().to_string()),
            Err(e) => Err(e.message().to_string()),
        };
        let r = match r {
            Ok(r) => r,
            Err(e) => {
                unreachable.push(format!("node {node_id} at {address}: {e}"));
                continue;
            }
        };
        for w in r.into_inner().workers {
            rows.push(json!({
                "worker_id": w.worker_id,
                "is_alive": true,
                "worker_type": "WORKER",
                "exit_type": Value::Null,
                "node_id": node_id,
                "ip": host(&address),
                "pid": w.pid,
                "exit_detail": Value::Null,
                "worker_launch_time_ms": Value::Null,
                "worker_launched_time_ms": Value::Null,
                "start_time_ms": Value::Null,
                "end_time_ms": Value::Null,
                "debugger_port": Value::Null,
                "num_paused_threads": Value::Null,
            }));
        }
    }
    let mut grpc = api.grpc.clone();
    let jobs = grpc
        .list_jobs(pb::ListJobsRequest {})
        .await
        .map_err(|s| format!("the head did not answer: {}", s.message()))?;
    for j in jobs.into_inner().jobs.iter().filter(|j| j.state == pb::JobState::Running as i32) {
        // The driver's node: the first live node on its host ("" for a host without one).
        let ip = host(&j.driver_address);
        let node =
            nodes.iter().find(|(_, a)| host(a) == ip).map(|(n, _)| n.clone()).unwrap_or_default();
        rows.push(json!({
            "worker_id": j.job_id,
            "is_alive": true,
            "worker_type": "DRIVER",
            "exit_type": Value::Null,
            "node_id": node,
            "ip": host(&j.driver_address),
            "pid": j.driver_pid,
            "exit_detail": Value::Null,
            "worker_launch_time_ms": Value::Null,
            "worker_launched_time_ms": Value::Null,
            "start_time_ms": opt_ms(j.start_time_ms),
            "end_time_ms": Value::Null,
            "debugger_port": Value::Null,
            "num_paused_threads": Value::Null,
        }));
    }
    Ok(Fetched { total: rows.len(), rows, unreachable })
}

/// Objects in every live node's store (from their agents).
pub(super) async fn objects(api: &Api) -> Result<Fetched, String> {
    let mut rows = Vec::new();
    let mut unreachable = Vec::new();
    let token = api.head.config.token.clone();
    for (node_id, address) in alive_nodes(api).await? {
        let r = match tpuray_proto::client::objects(&address, token.as_deref()) {
            Ok(mut store) => store
                .get_store_usage(pb::GetStoreUsageRequest { limit: 0 })
                .await
                .map_err(|s| s.message().to_string()),
            Err(e) => Err(e.to_string()),
        };
        let r = match r {
            Ok(r) => r,
            Err(e) => {
                unreachable.push(format!("node {node_id} at {address}: {e}"));
                continue;
            }
        };
        for o in r.into_inner().objects {
            rows.push(json!({
                "object_id": o.object_id,
                "object_size": o.size,
                "task_status": "FINISHED",
                "attempt_number": 0,
                "reference_type": if o.pinned { "PINNED_IN_MEMORY" } else { "LOCAL_REFERENCE" },
                "call_site": "disabled",
                "type": "WORKER",
                // Ray's schema needs a number; the store does not record the owner's pid.
                "pid": 0,
                "ip": host(if o.owner.is_empty() { &address } else { &o.owner }),
            }));
        }
    }
    Ok(Fetched { total: rows.len(), rows, unreachable })
}
