//! The autoscaler of `tpuray start --head --autoscaling-config FILE`: a thread of the head
//! process that, about once a second, reads what the head knows (live nodes, demand that
//! waits, placement groups, `request_resources`), asks the pure [`decide::decide`] what to
//! do, has the provider do it, and publishes its report for `tpuray status`.
//!
//! - [`config`]: the file (Ray's cluster-config shape), checked.
//! - [`decide`]: the decisions (AUTOSCALE-1..7), no I/O.
//! - [`provider`]: the trait; [`local`] (processes on this machine) and [`k8s`]
//!   (StatefulSets and a Deployment through the Kubernetes API).
//!
//! Where the demand comes from (the head's `GetClusterStatus` and `ListPlacementGroups`):
//! tasks waiting at node agents (their heartbeats), actors waiting for a node (serve
//! replicas are actors), placement groups waiting (their unplaced bundles and strategy),
//! slice placement groups (`run_on_slice`, `slice_placement_group`: whole slices), and
//! `tpuray.autoscaler.sdk.request_resources`, stored in the head's KV ([`KV_NAMESPACE`],
//! [`REQUEST_KEY`]: a JSON list of bundles, replaced by each call as in Ray). Shapes
//! naming a placement group's bundle resources (`CPU_group_...`) wait inside a group that
//! already has its nodes and are never scaled for.
//!
//! The report goes to the KV ([`STATUS_KEY`]) only when it changes (each put is a
//! replicated command).
//!
//! The provider acts outside any runtime (a provider may block on one of its own). The
//! report is read by `tpuray status` and the head's `/metrics`. The `kube` client of the
//! `k8s` provider sits behind the `kubernetes` cargo feature, off by default, and is
//! untested against a live API server.
//!
//! Deliberately absent: autoscaling for replicated heads (`--head-peers` with
//! `--autoscaling-config` is refused), Ray's `upscaling_speed`, `head_node_type`, docker
//! and setup commands, cluster-wide `max_workers` (refused as unknown keys), label
//! selectors of `request_resources` (refused by name).

pub mod config;
pub mod decide;
pub mod k8s;
pub mod local;
pub mod provider;

use std::collections::HashMap;
use std::path::PathBuf;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use anyhow::{Context, Result, anyhow};
use tonic::Request;
use tpuray_proto::pb;
use tpuray_scheduler::bundles::{parse_bundle_resource, without_bundle_resources};
use tpuray_scheduler::resources::ResourceSet;

use config::{AutoscalingConfig, ProviderConfig};
use decide::{Demand, Memory, NodeView, Placement};
use provider::Provider;

/// The head KV namespace of the autoscaler's keys.
pub const KV_NAMESPACE: &str = "autoscaler";
/// `request_resources`' bundles: a JSON list of `{resource: amount}` maps.
pub const REQUEST_KEY: &[u8] = b"request_resources";
/// The autoscaler's report ([`decide::Report`] as JSON), read by `tpuray status`.
pub const STATUS_KEY: &[u8] = b"status";

/// The running autoscaler; [`Autoscaler::stop`] stops it and everything it started.
pub struct Autoscaler {
    stop: Arc<AtomicBool>,
    thread: std::thread::JoinHandle<()>,
}

impl Autoscaler {
    /// Starts the autoscaler's thread for the head at `head_address` (which this process
    /// serves), with hosts' session folders and logs under `session_dir`.
    ///
    /// # Errors
    /// The provider cannot be set up (the Kubernetes client's configuration).
    pub fn start(
        config: AutoscalingConfig,
        head_address: String,
        token: Option<String>,
        session_dir: PathBuf,
    ) -> Result<Autoscaler> {
        let node_ip = head_address.rsplit_once(':').map(|(h, _)| h.to_string()).unwrap_or_default();
        let provider: Box<dyn Provider> = match &config.provider {
            ProviderConfig::Local => Box::new(local::LocalProvider::new(
                &head_address,
                &node_ip,
                session_dir,
                crate::procs::self_command()?,
            )),
            #[cfg(feature = "kubernetes")]
            ProviderConfig::Kubernetes { namespace, cluster_name, image } => Box::new(
                k8s::KubernetesProvider::new(namespace, cluster_name, image, &head_address)?,
            ),
            #[cfg(not(feature = "kubernetes"))]
            ProviderConfig::Kubernetes { .. } => {
                anyhow::bail!(
                    "provider type kubernetes: this tpuray was built without the `kubernetes` cargo feature"
                )
            }
        };
        let stop = Arc::new(AtomicBool::new(false));
        let flag = stop.clone();
        let thread = std::thread::Builder::new()
            .name("autoscaler".into())
            .spawn(move || run(config, provider, head_address, token, flag))
            .context("cannot start the autoscaler thread")?;
        Ok(Autoscaler { stop, thread })
    }

    /// Stops the loop, then every instance the provider started (blocking until they
    /// exited: AUTOSCALE-8).
    pub fn stop(self) {
        self.stop.store(true, Ordering::SeqCst);
        let _ = self.thread.join();
    }
}

/// Milliseconds since the epoch.
pub fn now_ms() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_millis() as u64)
        .unwrap_or(0)
}

fn run(
    config: AutoscalingConfig,
    mut provider: Box<dyn Provider>,
    head_address: String,
    token: Option<String>,
    stop: Arc<AtomicBool>,
) {
    let interval = tpuray_worker::run::env_duration_ms("TPURAY_AUTOSCALER_INTERVAL_MS", 1000);
    let rt = match tokio::runtime::Builder::new_current_thread().enable_all().build() {
        Ok(rt) => rt,
        Err(e) => {
            tracing::error!("autoscaler: cannot build a runtime: {e}");
            return;
        }
    };
    let mut memory = Memory::default();
    let mut published = String::new();
    let client = tpuray_proto::client::head(&head_address, token.as_deref());
    while !stop.load(Ordering::SeqCst) {
        match &client {
            Ok(head) => {
                if let Err(e) =
                    round(&rt, &config, provider.as_mut(), head, &mut memory, &mut published)
                {
                    tracing::warn!("autoscaler: {e:#}");
                }
            }
            Err(e) => tracing::error!("autoscaler: head client: {e}"),
        }
        let until = std::time::Instant::now() + interval;
        while !stop.load(Ordering::SeqCst) && std::time::Instant::now() < until {
            std::thread::sleep(Duration::from_millis(20));
        }
    }
    tracing::info!("autoscaler: stopping every instance it started");
    provider.shutdown();
}

type Head = pb::head_service_client::HeadServiceClient<tpuray_proto::client::AuthChannel>;

fn req<T>(m: T) -> Request<T> {
    let mut r = Request::new(m);
    r.set_timeout(Duration::from_secs(10));
    r
}

/// What one round reads from the head.
struct Seen {
    status: pb::GetClusterStatusReply,
    groups: Vec<pb::PlacementGroupInfo>,
    requested: Vec<ResourceSet>,
}

async fn read(mut head: Head) -> Result<Seen> {
    let status = head.get_cluster_status(req(pb::GetClusterStatusRequest {})).await?.into_inner();
    let groups = head
        .list_placement_groups(req(pb::ListPlacementGroupsRequest {}))
        .await?
        .into_inner()
        .placement_groups;
    let kv = pb::KvGetRequest { namespace: KV_NAMESPACE.into(), key: REQUEST_KEY.to_vec() };
    let r = head.kv_get(req(kv)).await?.into_inner();
    let requested = if r.found { parse_request(&r.value)? } else { Vec::new() };
    Ok(Seen { status, groups, requested })
}

/// One round: read the head (async), decide, then call the provider outside the runtime
/// (a provider may run a runtime of its own), then publish the report.
fn round(
    rt: &tokio::runtime::Runtime,
    config: &AutoscalingConfig,
    provider: &mut dyn Provider,
    head: &Head,
    memory: &mut Memory,
    published: &mut String,
) -> Result<()> {
    let seen = rt.block_on(read(head.clone()))?;
    let nodes = node_views(&seen.status.nodes);
    let demands = demands(&seen.status, &seen.groups);
    let instances = provider.instances()?;
    let now = now_ms();
    let input = decide::Input {
        config,
        nodes: &nodes,
        instances: &instances,
        demands: &demands,
        requested: &seen.requested,
        now_ms: now,
        id_prefix: &provider.id_prefix(),
    };
    let decision = decide::decide(&input, memory);
    for t in &decision.terminate {
        tracing::info!(instance = %t.instance, node_type = %t.node_type, "autoscaler: removing: {}", t.reason);
        provider.terminate(&t.instance)?;
    }
    for l in &decision.launch {
        tracing::info!(instance = %l.instance, node_type = %l.node_type, "autoscaler: launching: {}", l.reason);
        if let Err(e) = provider.launch(&config.node_types[&l.node_type], &l.instance, now) {
            tracing::warn!(instance = %l.instance, "autoscaler: launch failed: {e:#}");
            if let Some(n) = memory.launched.get_mut(&l.node_type) {
                *n = n.saturating_sub(1);
            }
            memory.launch_reason.remove(&l.instance);
        }
    }
    let text = serde_json::to_string(&decision.report)?;
    if text != *published {
        let put = pb::KvPutRequest {
            request_id: uuid_like(),
            namespace: KV_NAMESPACE.into(),
            key: STATUS_KEY.to_vec(),
            value: text.clone().into_bytes(),
            overwrite: true,
        };
        let mut head = head.clone();
        rt.block_on(head.kv_put(req(put)))?;
        *published = text;
    }
    Ok(())
}

fn uuid_like() -> String {
    use std::sync::atomic::AtomicU64;
    static N: AtomicU64 = AtomicU64::new(0);
    format!("autoscaler-{}-{}-{}", std::process::id(), now_ms(), N.fetch_add(1, Ordering::SeqCst))
}

/// `request_resources`' stored bundles. Errors: not a JSON list of resource maps.
pub fn parse_request(bytes: &[u8]) -> Result<Vec<ResourceSet>> {
    let v: Vec<HashMap<String, f64>> = serde_json::from_slice(bytes)
        .map_err(|e| anyhow!("request_resources in the KV is not a list of bundles: {e}"))?;
    v.iter()
        .map(|b| ResourceSet::from_f64_map(b).map_err(|e| anyhow!("request_resources bundle: {e}")))
        .filter(|b| b.as_ref().map_or(true, |b| !b.is_empty()))
        .collect()
}

fn set(m: &HashMap<String, f64>) -> ResourceSet {
    without_bundle_resources(&ResourceSet::from_f64_map(m).unwrap_or_default())
}

/// The live nodes, resources without placement-group bundle names.
pub fn node_views(nodes: &[pb::NodeInfo]) -> Vec<NodeView> {
    nodes
        .iter()
        .filter(|n| n.state == pb::NodeState::Alive as i32)
        .map(|n| NodeView {
            node_id: n.node_id.clone(),
            total: set(&n.total),
            available: set(&n.available),
            labels: n.labels.iter().map(|(k, v)| (k.clone(), v.clone())).collect(),
        })
        .collect()
}

fn names_bundle(m: &HashMap<String, f64>) -> bool {
    m.keys().any(|k| parse_bundle_resource(k).is_some())
}

/// What waits, from the head's cluster status and its placement groups.
pub fn demands(st: &pb::GetClusterStatusReply, groups: &[pb::PlacementGroupInfo]) -> Vec<Demand> {
    let mut out = Vec::new();
    for d in st.pending.iter().chain(&st.infeasible) {
        if !d.placement_group_id.is_empty() || names_bundle(&d.shape) {
            continue;
        }
        let shape = set(&d.shape);
        if shape.is_empty() {
            continue;
        }
        let what = match d.reason.split_once(':') {
            Some((w, _)) if w.starts_with("actor ") => w.to_string(),
            _ => "tasks".to_string(),
        };
        let n = d.count.clamp(1, 10_000) as usize;
        out.push(Demand::Bundles { what, bundles: vec![shape; n], placement: Placement::Any });
    }
    for g in groups {
        let waiting = g.state == pb::PlacementGroupState::Pending as i32
            || g.state == pb::PlacementGroupState::Rescheduling as i32;
        if !waiting {
            continue;
        }
        let name = if g.name.is_empty() { g.placement_group_id.clone() } else { g.name.clone() };
        let what = format!("placement group {name}");
        match &g.slice {
            Some(s) if g.state == pb::PlacementGroupState::Pending as i32 => {
                let host_bundle = g.bundles.first().map(|b| set(&b.resources)).unwrap_or_default();
                out.push(Demand::Slices {
                    what,
                    accelerator_type: s.accelerator_type.clone(),
                    topology: (!s.topology.is_empty()).then(|| s.topology.clone()),
                    num_slices: s.num_slices,
                    host_bundle,
                });
            }
            // A slice group's lost bundles are pinned to their slice: no new node fits them.
            Some(_) => {}
            None => {
                let bundles: Vec<ResourceSet> = g
                    .bundles
                    .iter()
                    .enumerate()
                    .filter(|(i, _)| g.bundle_node_ids.get(*i).is_none_or(String::is_empty))
                    .map(|(_, b)| set(&b.resources))
                    .filter(|b| !b.is_empty())
                    .collect();
                let placement = match g.strategy.as_str() {
                    "STRICT_PACK" => Placement::StrictPack,
                    "STRICT_SPREAD" => Placement::StrictSpread,
                    _ => Placement::Any,
                };
                if !bundles.is_empty() {
                    out.push(Demand::Bundles { what, bundles, placement });
                }
            }
        }
    }
    out
}

/// The `Autoscaler` section of `tpuray status`: pending launches, idle instances and
/// demand it cannot or will not scale for, each with its reason; launches and removals so
/// far by node type. `now_ms` turns idle-since times into durations.
pub fn render_report(r: &decide::Report, now_ms: u64) -> String {
    use std::fmt::Write;
    let mut s = String::new();
    let _ = writeln!(s, "Autoscaler");
    let _ = writeln!(s, "---------------------------------------------------------------");
    let _ = writeln!(s, "Pending launches:");
    if r.pending_launches.is_empty() {
        let _ = writeln!(s, " (none)");
    }
    for (id, ty, up, hosts, why) in &r.pending_launches {
        let _ = writeln!(s, " {id} ({ty}): {up} of {hosts} host(s) up -- {why}");
    }
    let _ = writeln!(s, "Idle:");
    if r.idle.is_empty() {
        let _ = writeln!(s, " (none)");
    }
    for (id, ty, since, note) in &r.idle {
        let secs = now_ms.saturating_sub(*since) / 1000;
        let _ = writeln!(s, " {id} ({ty}): idle {secs} s -- {note}");
    }
    for (title, lines) in
        [("Infeasible (never scaled for):", &r.infeasible), ("Waiting:", &r.waiting)]
    {
        if !lines.is_empty() {
            let _ = writeln!(s, "{title}");
            for l in lines {
                let _ = writeln!(s, " {l}");
            }
        }
    }
    let types: std::collections::BTreeSet<&String> =
        r.launched.keys().chain(r.removed.keys()).collect();
    if !types.is_empty() {
        let parts: Vec<String> = types
            .iter()
            .map(|t| {
                let l = r.launched.get(*t).copied().unwrap_or(0);
                let d = r.removed.get(*t).copied().unwrap_or(0);
                format!("{t}: {l} launched, {d} removed")
            })
            .collect();
        let _ = writeln!(s, "Totals: {}", parts.join("; "));
    }
    s
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_status_section_names_each_pending_launch_idle_instance_and_reason() {
        let r = decide::Report {
            pending_launches: vec![(
                "v6e-16-1".into(),
                "v6e-16".into(),
                2,
                4,
                "placement group gang:g:0: v6e-16 slice(s) of topology 4x4".into(),
            )],
            idle: vec![("cpu-2".into(), "cpu".into(), 1_000, "removed after 6 s idle".into())],
            infeasible: vec!["placement group gang:big:0: no node type has v6e-64 slice(s)".into()],
            waiting: vec![],
            launched: [("v6e-16".to_string(), 1u64), ("cpu".to_string(), 1)].into(),
            removed: [("cpu".to_string(), 0u64)].into(),
        };
        let text = render_report(&r, 5_000);
        assert!(
            text.contains(" v6e-16-1 (v6e-16): 2 of 4 host(s) up -- placement group gang:g:0"),
            "{text}"
        );
        assert!(text.contains(" cpu-2 (cpu): idle 4 s -- removed after 6 s idle"), "{text}");
        assert!(
            text.contains("Infeasible (never scaled for):\n placement group gang:big:0"),
            "{text}"
        );
        assert!(
            text.contains("Totals: cpu: 1 launched, 0 removed; v6e-16: 1 launched, 0 removed"),
            "{text}"
        );
        assert!(!text.contains("Waiting:"), "{text}");
    }

    #[test]
    fn demand_is_read_once_per_waiting_thing_and_bundle_resources_are_skipped() {
        let shape =
            |pairs: &[(&str, f64)]| pairs.iter().map(|(k, v)| (k.to_string(), *v)).collect();
        let st = pb::GetClusterStatusReply {
            pending: vec![
                pb::ResourceDemand {
                    shape: shape(&[("CPU", 1.0)]),
                    count: 3,
                    ..Default::default()
                },
                pb::ResourceDemand {
                    shape: shape(&[("CPU_group_0_abc", 1.0)]),
                    count: 1,
                    ..Default::default()
                },
                pb::ResourceDemand {
                    shape: shape(&[("CPU", 2.0)]),
                    count: 1,
                    placement_group_id: "abc".into(),
                    ..Default::default()
                },
            ],
            infeasible: vec![pb::ResourceDemand {
                shape: shape(&[("GPU", 1.0)]),
                count: 1,
                infeasible: true,
                reason: "actor Model: no node has resource \"GPU\"".into(),
                ..Default::default()
            }],
            ..Default::default()
        };
        let groups = vec![
            pb::PlacementGroupInfo {
                name: "gang:g:0".into(),
                state: pb::PlacementGroupState::Pending as i32,
                bundles: vec![
                    pb::Bundle { resources: shape(&[("TPU", 4.0)]), ..Default::default() };
                    4
                ],
                slice: Some(pb::SliceSpec {
                    accelerator_type: "v6e-16".into(),
                    topology: "4x4".into(),
                    num_slices: 1,
                }),
                ..Default::default()
            },
            pb::PlacementGroupInfo {
                name: "pg".into(),
                state: pb::PlacementGroupState::Pending as i32,
                strategy: "STRICT_PACK".into(),
                bundles: vec![
                    pb::Bundle { resources: shape(&[("CPU", 2.0)]), ..Default::default() };
                    2
                ],
                bundle_node_ids: vec![String::new(), String::new()],
                ..Default::default()
            },
            pb::PlacementGroupInfo {
                name: "done".into(),
                state: pb::PlacementGroupState::Created as i32,
                bundles: vec![pb::Bundle {
                    resources: shape(&[("CPU", 2.0)]),
                    ..Default::default()
                }],
                ..Default::default()
            },
        ];
        let d = demands(&st, &groups);
        assert_eq!(d.len(), 4, "{d:?}");
        assert!(matches!(&d[0], Demand::Bundles { bundles, .. } if bundles.len() == 3));
        assert!(matches!(&d[1], Demand::Bundles { what, .. } if what == "actor Model"));
        assert!(
            matches!(&d[2], Demand::Slices { num_slices: 1, topology: Some(t), .. } if t == "4x4")
        );
        assert!(
            matches!(&d[3], Demand::Bundles { placement: Placement::StrictPack, bundles, .. } if bundles.len() == 2)
        );
    }

    #[test]
    fn request_resources_is_a_list_of_bundles() {
        let b = parse_request(br#"[{"CPU": 1}, {"CPU": 1, "GPU": 2}]"#).unwrap();
        assert_eq!(b.len(), 2);
        assert!(parse_request(br#"{"CPU": 1}"#).is_err());
        assert!(parse_request(br#"[{"CPU": -1}]"#).is_err());
    }
}
