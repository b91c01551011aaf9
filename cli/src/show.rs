//! `tpuray status` and `tpuray list`: read the head's state and print it as
//! a table or as JSON (a list of objects).

use std::collections::BTreeMap;
use std::time::Duration;

use anyhow::{Context, Result, anyhow};
use serde_json::json;
use tonic::Request;
use tpuray_proto::pb;

use crate::args::{Format, ListKind};

fn runtime() -> Result<tokio::runtime::Runtime> {
    Ok(tokio::runtime::Builder::new_current_thread().enable_all().build()?)
}

fn head_client(
    address: &str,
) -> Result<pb::head_service_client::HeadServiceClient<tpuray_proto::client::AuthChannel>> {
    let token = tpuray_proto::auth::load_token()?;
    Ok(tpuray_proto::client::head(address, token.as_deref())?)
}

/// Each head replica's Raft status, asked of each replica itself: the addresses given,
/// then any other replica the answers name. Unreachable replicas are listed with why.
async fn replica_statuses(
    address: &str,
) -> Vec<(String, Result<pb::GetReplicaStatusReply, String>)> {
    let token = tpuray_proto::auth::load_token().ok().flatten();
    let mut todo: Vec<String> = address.split(',').map(|a| a.trim().to_string()).collect();
    let mut out: Vec<(String, Result<pb::GetReplicaStatusReply, String>)> = Vec::new();
    while let Some(addr) = todo.first().cloned() {
        todo.remove(0);
        if out.iter().any(|(a, _)| *a == addr) {
            continue;
        }
        let r = async {
            let mut c = tpuray_proto::client::head_replica(&addr, token.as_deref())
                .map_err(|e| e.to_string())?;
            let mut req = Request::new(pb::GetReplicaStatusRequest {});
            req.set_timeout(Duration::from_secs(3));
            c.get_replica_status(req)
                .await
                .map(|r| r.into_inner())
                .map_err(|s| s.message().to_string())
        }
        .await;
        if let Ok(st) = &r {
            for other in &st.replicas {
                if !out.iter().any(|(a, _)| a == other) && !todo.contains(other) && *other != addr {
                    todo.push(other.clone());
                }
            }
        }
        out.push((addr, r));
    }
    out.sort_by_key(|(a, r)| (r.as_ref().map(|s| s.id).unwrap_or(u64::MAX), a.clone()));
    out
}

fn print_replicas(replicas: &[(String, Result<pb::GetReplicaStatusReply, String>)]) {
    let leader = replicas.iter().find_map(|(_, r)| r.as_ref().ok().filter(|s| s.role == "leader"));
    match leader {
        Some(l) => println!("Head replicas (leader: {} at {}, term {})", l.id, l.address, l.term),
        None => println!("Head replicas (no leader)"),
    }
    for (addr, r) in replicas {
        match r {
            Ok(s) => {
                let serving = if s.leader_ready { ", serving" } else { "" };
                println!(
                    " {} {addr} {}{serving} -- term {}, commit {}, applied {}, log {}..{}, snapshot {}",
                    s.id,
                    s.role,
                    s.term,
                    s.commit_index,
                    s.applied_index,
                    s.first_index,
                    s.last_index,
                    s.snapshot_index
                );
            }
            Err(e) => println!(" ? {addr} unreachable -- {e}"),
        }
    }
    if let Some(l) = leader {
        let matched: Vec<String> =
            l.peers.iter().map(|p| format!("{}: {}", p.id, p.matched_index)).collect();
        if !matched.is_empty() {
            println!(
                " replicated up to (per replica, as the leader knows): {}",
                matched.join(", ")
            );
        }
    }
}

fn call_err(address: &str, s: tonic::Status) -> anyhow::Error {
    anyhow!("the head at {address} answered {:?}: {}", s.code(), s.message())
}

fn fmt_amount(name: &str, v: f64) -> String {
    if name.contains("memory") {
        fmt_bytes(v)
    } else if v.fract() == 0.0 {
        format!("{v:.1}")
    } else {
        format!("{v}")
    }
}

fn fmt_bytes(v: f64) -> String {
    const UNITS: [&str; 5] = ["B", "KiB", "MiB", "GiB", "TiB"];
    let mut v = v;
    let mut i = 0;
    while v >= 1024.0 && i < UNITS.len() - 1 {
        v /= 1024.0;
        i += 1;
    }
    format!("{v:.2}{}", UNITS[i])
}

fn fmt_shape(m: &std::collections::HashMap<String, f64>) -> String {
    let s: BTreeMap<_, _> = m.iter().collect();
    let parts: Vec<String> = s.iter().map(|(k, v)| format!("{k}: {v}")).collect();
    format!("{{{}}}", parts.join(", "))
}

/// A placement group bundle's renamed resource (`CPU_group_0_<pg>`): a share of the
/// node's own resources, not more of them.
fn is_bundle_resource(name: &str) -> bool {
    tpuray_scheduler::bundles::parse_bundle_resource(name).is_some()
}

fn node_state(n: &pb::NodeInfo) -> &'static str {
    if n.state == pb::NodeState::Alive as i32 { "ALIVE" } else { "DEAD" }
}

pub fn status(address: &str) -> Result<i32> {
    let rt = runtime()?;
    let replicas = rt.block_on(replica_statuses(address));
    let st = rt.block_on(async {
        let mut head = head_client(address)?;
        let mut req = Request::new(pb::GetClusterStatusRequest {});
        req.set_timeout(Duration::from_secs(10));
        head.get_cluster_status(req).await.map(|r| r.into_inner()).map_err(|s| call_err(address, s))
    })?;
    let alive: Vec<&pb::NodeInfo> =
        st.nodes.iter().filter(|n| n.state == pb::NodeState::Alive as i32).collect();
    let dead = st.nodes.len() - alive.len();
    println!("======== Cluster status: {address} ========");
    println!("Nodes ({} alive, {dead} dead)", alive.len());
    for n in &st.nodes {
        let head = if n.is_head_node { " (head)" } else { "" };
        let res: BTreeMap<_, _> = n
            .total
            .iter()
            .filter(|(k, _)| !k.contains("memory") && !is_bundle_resource(k))
            .collect();
        let res: Vec<String> = res.iter().map(|(k, v)| format!("{k}: {v}")).collect();
        print!(" {} {} {}{head} {{{}}}", node_state(n), n.node_id, n.address, res.join(", "));
        if !n.death_reason.is_empty() {
            print!(" -- {}", n.death_reason);
        }
        println!();
    }
    println!();
    println!("Resources");
    println!("---------------------------------------------------------------");
    println!("Usage:");
    let total: BTreeMap<_, _> = st.total.iter().collect();
    for (name, t) in total {
        let avail = st.available.get(name).copied().unwrap_or(0.0);
        let used = (t - avail).max(0.0);
        println!(" {}/{} {name}", fmt_amount(name, used), fmt_amount(name, *t));
    }
    println!();
    println!("Demands:");
    if st.pending.is_empty() {
        println!(" (no resource demands)");
    }
    for d in &st.pending {
        print!(" {}: {}+ pending", fmt_shape(&d.shape), d.count.max(1));
        if !d.reason.is_empty() {
            print!(" -- {}", d.reason);
        }
        println!();
    }
    println!("Infeasible:");
    if st.infeasible.is_empty() {
        println!(" (no infeasible demand)");
    }
    for d in &st.infeasible {
        println!(" {}: {}+ infeasible -- {}", fmt_shape(&d.shape), d.count.max(1), d.reason);
    }
    println!();
    print_replicas(&replicas);
    Ok(0)
}

pub fn list(address: &str, kind: ListKind, format: Format, limit: usize) -> Result<i32> {
    let rt = runtime()?;
    let rows: Vec<serde_json::Value> = rt.block_on(async {
        let mut head = head_client(address)?;
        let rows = match kind {
            ListKind::Nodes => {
                let st = head
                    .get_cluster_status(pb::GetClusterStatusRequest {})
                    .await
                    .map_err(|s| call_err(address, s))?
                    .into_inner();
                st.nodes
                    .iter()
                    .map(|n| {
                        json!({
                            "node_id": n.node_id,
                            "state": node_state(n),
                            "address": n.address,
                            "hostname": n.hostname,
                            "is_head_node": n.is_head_node,
                            "resources_total": n.total.iter().collect::<BTreeMap<_, _>>(),
                            "resources_available": n.available.iter().collect::<BTreeMap<_, _>>(),
                            "labels": n.labels.iter().collect::<BTreeMap<_, _>>(),
                            "num_workers": n.num_workers,
                            "death_reason": n.death_reason,
                            "pid": n.pid,
                        })
                    })
                    .collect()
            }
            ListKind::PlacementGroups => {
                let mut groups = head
                    .list_placement_groups(pb::ListPlacementGroupsRequest {})
                    .await
                    .map_err(|s| call_err(address, s))?
                    .into_inner()
                    .placement_groups;
                // Newest first, as `list tasks`: removed groups do not bury new ones.
                groups.sort_by_key(|g| std::cmp::Reverse(g.create_time_ms));
                groups
                    .iter()
                    .map(|p| {
                        let state = pb::PlacementGroupState::try_from(p.state)
                            .map(|s| {
                                s.as_str_name()
                                    .trim_start_matches("PLACEMENT_GROUP_STATE_")
                                    .to_string()
                            })
                            .unwrap_or_default();
                        let bundles: Vec<String> =
                            p.bundles.iter().map(|b| fmt_shape(&b.resources)).collect();
                        let slice = p.slice.as_ref().map(|s| {
                            json!({
                                "accelerator_type": s.accelerator_type,
                                "topology": s.topology,
                                "num_slices": s.num_slices,
                            })
                        });
                        json!({
                            "placement_group_id": p.placement_group_id,
                            "name": p.name,
                            "state": state,
                            "strategy": p.strategy,
                            "num_bundles": p.bundles.len(),
                            "bundles": bundles,
                            "bundle_node_ids": p.bundle_node_ids,
                            "job_id": p.job_id,
                            "namespace": p.namespace,
                            "detached": p.detached,
                            "slice": slice,
                            "pending_reason": p.pending_reason,
                            "infeasible": p.infeasible,
                            "removal_reason": p.removal_reason,
                            "create_time_ms": p.create_time_ms,
                        })
                    })
                    .collect()
            }
            ListKind::Actors => head
                .list_actors(pb::ListActorsRequest {})
                .await
                .map_err(|s| call_err(address, s))?
                .into_inner()
                .actors
                .iter()
                .map(|a| {
                    let state = pb::ActorState::try_from(a.state)
                        .map(|s| s.as_str_name().trim_start_matches("ACTOR_STATE_").to_string())
                        .unwrap_or_default();
                    json!({
                        "actor_id": a.actor_id,
                        "class_name": a.class_name,
                        "name": a.name,
                        "namespace": a.namespace,
                        "state": state,
                        "job_id": a.job_id,
                        "node_id": a.node_id,
                        "pid": a.pid,
                        "num_restarts": a.num_restarts,
                        "max_restarts": a.max_restarts,
                        "detached": a.detached,
                        "death_cause": a.death_cause,
                        "pending_reason": a.pending_reason,
                    })
                })
                .collect(),
            ListKind::Jobs => head
                .list_jobs(pb::ListJobsRequest {})
                .await
                .map_err(|s| call_err(address, s))?
                .into_inner()
                .jobs
                .iter()
                .map(|j| {
                    let state = pb::JobState::try_from(j.state)
                        .map(|s| s.as_str_name().trim_start_matches("JOB_STATE_").to_string())
                        .unwrap_or_default();
                    json!({
                        "job_id": j.job_id,
                        "state": state,
                        "entrypoint": j.entrypoint,
                        "namespace": j.namespace,
                        "driver_pid": j.driver_pid,
                        "start_time_ms": j.start_time_ms,
                        "end_time_ms": j.end_time_ms,
                    })
                })
                .collect(),
            ListKind::Tasks => head
                .list_tasks(pb::ListTasksRequest { limit: 0 })
                .await
                .map_err(|s| call_err(address, s))?
                .into_inner()
                .tasks
                .iter()
                .map(|t| {
                    json!({
                        "task_id": t.task_id,
                        "name": t.name,
                        "state": t.state,
                        "job_id": t.job_id,
                        "node_id": t.node_id,
                        "worker_id": t.worker_id,
                        "actor_id": t.actor_id,
                        "attempt": t.attempt,
                        "error": t.error,
                        "submitted_ms": t.submitted_ms,
                        "finished_ms": t.finished_ms,
                    })
                })
                .collect(),
        };
        Ok::<_, anyhow::Error>(rows)
    })?;
    let total = rows.len();
    let rows: Vec<serde_json::Value> =
        if limit > 0 { rows.into_iter().take(limit).collect() } else { rows };
    if rows.len() < total && format == Format::Table {
        eprintln!("(showing {} of {total}; use --limit 0 for all)", rows.len());
    }
    match format {
        Format::Json => println!("{}", serde_json::to_string_pretty(&rows).context("encode json")?),
        Format::Table => print_table(&rows, kind),
    }
    Ok(0)
}

fn print_table(rows: &[serde_json::Value], kind: ListKind) {
    let cols: &[&str] = match kind {
        ListKind::Nodes => &["node_id", "state", "address", "is_head_node", "num_workers"],
        ListKind::Actors => {
            &["actor_id", "class_name", "name", "state", "node_id", "pid", "num_restarts"]
        }
        ListKind::Jobs => &["job_id", "state", "driver_pid", "entrypoint"],
        ListKind::Tasks => &["task_id", "name", "state", "attempt", "node_id", "error"],
        ListKind::PlacementGroups => {
            &["placement_group_id", "name", "state", "strategy", "num_bundles", "pending_reason"]
        }
    };
    let cell = |r: &serde_json::Value, c: &str| match &r[c] {
        serde_json::Value::String(s) => s.clone(),
        v => v.to_string(),
    };
    let widths: Vec<usize> = cols
        .iter()
        .map(|c| rows.iter().map(|r| cell(r, c).len()).max().unwrap_or(0).max(c.len()))
        .collect();
    let line = |vals: Vec<String>| {
        let parts: Vec<String> =
            vals.iter().zip(&widths).map(|(v, w)| format!("{v:<w$}", w = *w)).collect();
        println!("{}", parts.join("  ").trim_end());
    };
    line(cols.iter().map(|c| c.to_uppercase()).collect());
    for r in rows {
        line(cols.iter().map(|c| cell(r, c)).collect());
    }
    if rows.is_empty() {
        println!("(none)");
    }
}
