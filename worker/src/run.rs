//! Starting a node agent: resources from flags and detection, joining the
//! head (with retries), the heartbeat thread, serving, and shutdown.
//!
//! Resources come from `--num-cpus`, `--num-gpus`, `--resources` JSON (which may not
//! carry `CPU`, `GPU`, `memory` or `object_store_memory`, as on Ray: those have their own
//! flags), `--labels`, `--memory` and `--object-store-memory` in bytes. Joining the head
//! is retried for ~30 s. The agent opens the node's object store with `open_with`
//! (capacity `--object-store-memory`, default 30% of available memory, the same number it
//! advertises as `object_store_memory`; spill folder `--spill-dir`, default
//! `<session>/spill`), serves `ObjectTransferService` over it and removes the folder and
//! its spill subfolder when it stops. It sweeps stale store folders at start (OBJ-13). It
//! exits when the head declares its node dead, or after `TPURAY_HEAD_LOST_TIMEOUT_MS` (60
//! s) without a successful heartbeat.
//!
//! AGENT-9 (here and `agent/spawn.rs`): a TPU host labels how its chips were found,
//! `tpuray.io/tpu-devices` = `accel`, `vfio` or `simulated`.
//!
//! AGENT-16 (here, [`serve_agent`], and `agent/lifecycle.rs` `wait_drained`): SIGTERM
//! drains the node. In order: the agent sets `draining` (leases are refused, heartbeats
//! stop, `/readyz` on `--metrics-export-port` answers 503), calls the existing
//! `UnregisterNode` (the head marks the node dead at once, so its owners' pushes fail
//! with the node-death error and they retry the unfinished tasks elsewhere, as on a node
//! death, and actors restart elsewhere), waits up to `--drain-grace-period` (default 25
//! s) until no live worker reports a running task or actor call (the 0.5 s
//! `ReportMetrics` reports; a leased worker counts as running for the first second), then
//! stops its workers. A task that finishes on the draining node has already been retried
//! elsewhere: its result there is dropped, so side effects happen at least once (as with
//! any retry). `tpuray start --block` gives its agent the grace period plus 10 s before
//! SIGKILL; `tpuray stop` stops workers first, so its agents drain at once.
//!
//! Pod start-up: `POD_IP` is the node address unless `--node-ip-address` is given;
//! [`with_pod_worker_id`] fills `TPU_WORKER_ID` of a multi-host TPU host from
//! `JOB_COMPLETION_INDEX`, else the ordinal ending `HOSTNAME`.

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::{Duration, Instant};

use tonic::Request;
use tonic::service::interceptor::InterceptedService;
use tpuray_proto::auth::ServerAuth;
use tpuray_proto::convert::resources_to_proto;
use tpuray_proto::ids::NodeId;
use tpuray_proto::pb;
use tpuray_proto::pb::node_agent_service_server::NodeAgentServiceServer;
use tpuray_scheduler::labels::{RAY_PREFIX, TPURAY_PREFIX};
use tpuray_scheduler::{Amount, Labels, ResourceSet};

use crate::agent::{Agent, AgentConfig, AgentSvc};
use crate::detect;

/// Errors starting a node agent; each names what is wrong.
#[derive(Debug, thiserror::Error)]
pub enum StartError {
    #[error("{0}")]
    BadFlag(String),
    #[error("cannot reach the head at {address} after {waited:?}: {detail}")]
    HeadUnreachable { address: String, waited: Duration, detail: String },
    #[error("the head at {address} refused this node: {detail}")]
    Refused { address: String, detail: String },
    /// TLS-3/TLS-4: the modes differ, or a certificate was refused.
    #[error("cannot join the head at {address}: {detail}")]
    Tls { address: String, detail: String },
    #[error("cannot listen on {addr}: {detail}")]
    Listen { addr: String, detail: String },
    #[error("node agent server failed: {0}")]
    Serve(String),
}

/// Resource flags as given on the command line.
#[derive(Clone, Debug, Default)]
pub struct AgentOptions {
    pub num_cpus: Option<f64>,
    pub num_gpus: Option<f64>,
    /// `--resources` JSON, e.g. `{"special": 1}`.
    pub resources_json: Option<String>,
    /// `--labels k=v,...`.
    pub labels: Option<String>,
    /// `--object-store-memory` in bytes.
    pub object_store_memory: Option<u64>,
    /// `--memory` in bytes.
    pub memory: Option<u64>,
    /// The process environment (`TPU_*` variables describe a TPU host).
    pub env: std::collections::BTreeMap<String, String>,
}

/// The node's total resources and labels from flags and detection.
///
/// CPU defaults to the detected logical CPUs; GPU to the NVIDIA GPUs found
/// ([`detect::detect_gpus_in`], 0 without any); TPU to the chips found under
/// the accelerator root (`TPURAY_ACCELERATOR_ROOT`, default `/`;
/// [`detect::detect_tpus`]) unless `--resources` names `"TPU"` (a simulated
/// host, TPU.md); `memory` and `object_store_memory` to Ray's shares of
/// available memory (bytes).
///
/// # Errors
/// [`StartError::BadFlag`] naming the flag: unparsable `--resources` JSON,
/// negative or non-numeric amounts, `CPU`/`GPU` inside `--resources` (as Ray,
/// use `--num-cpus`/`--num-gpus`), malformed `--labels`.
pub fn build_resources(o: &AgentOptions) -> Result<(ResourceSet, Labels), StartError> {
    let bad = StartError::BadFlag;
    let mut total = match &o.resources_json {
        Some(j) => ResourceSet::from_json(j).map_err(|e| {
            let e = e.to_string();
            // The JSON error already names the flag.
            bad(if e.contains("--resources") { e } else { format!("--resources: {e}") })
        })?,
        None => ResourceSet::new(),
    };
    for reserved in ["CPU", "GPU", "memory", "object_store_memory"] {
        if total.get(reserved) != Amount::ZERO {
            let flag = match reserved {
                "CPU" => "--num-cpus",
                "GPU" => "--num-gpus",
                "memory" => "--memory",
                _ => "--object-store-memory",
            };
            return Err(bad(format!(
                "--resources: use {flag} to set {reserved:?}, not --resources"
            )));
        }
    }
    let amount = |flag: &str, name: &str, v: f64| {
        Amount::from_f64(name, v).map_err(|e| bad(format!("{flag}: {e}")))
    };
    let cpus = o.num_cpus.unwrap_or(detect::num_cpus() as f64);
    total.set("CPU", amount("--num-cpus", "CPU", cpus)?);
    let mut labels_from_detection: Vec<String> = Vec::new();
    let root = std::path::PathBuf::from(
        o.env.get("TPURAY_ACCELERATOR_ROOT").map(String::as_str).unwrap_or("/"),
    );
    let gpus = match o.num_gpus {
        // GPU ids are whole devices (AGENT-10); Ray's `--num-gpus` is an integer too.
        Some(g) if g.fract() != 0.0 || g < 0.0 => {
            return Err(bad(format!("--num-gpus: {g} is not a whole number of GPUs")));
        }
        Some(g) => g,
        None => f64::from(detect::detect_gpus_in(&root)),
    };
    if gpus > 0.0 {
        total.set("GPU", amount("--num-gpus", "GPU", gpus)?);
    }
    // How this host's chips were found (`accel`, `vfio`), or `simulated` when `--resources`
    // declares chips that detection does not see; gangs read it (NODE_RANK, JAX_PLATFORMS).
    let mut devices_source = "simulated";
    if total.get("TPU") != Amount::ZERO {
        let found = detect::detect_tpus(&root);
        if found.chips > 0 {
            devices_source = found.source;
        }
    } else {
        let found = detect::detect_tpus(&root);
        devices_source = found.source;
        tracing::info!(
            chips = found.chips,
            source = found.source,
            "TPU detection: {}",
            found.reason
        );
        if found.chips > 0 {
            total.set("TPU", Amount::whole(u64::from(found.chips)));
            if let Some(g) = found.generation
                && !o.env.contains_key("TPU_ACCELERATOR_TYPE")
            {
                // Without slice metadata the host still says what it is (Ray
                // adds `accelerator_type:<type>` the same way).
                total.set(&format!("accelerator_type:{}", g.accelerator_label()), Amount::whole(1));
                labels_from_detection.push(g.accelerator_label());
            }
        }
    }
    let (_, avail_mem) = detect::memory_bytes();
    let store = object_store_bytes(o);
    let mem = o.memory.unwrap_or_else(|| detect::memory_resource_bytes(avail_mem, store));
    total.set("memory", amount("--memory", "memory", mem as f64)?);
    total.set(
        "object_store_memory",
        amount("--object-store-memory", "object_store_memory", store as f64)?,
    );
    let mut labels = match &o.labels {
        Some(l) => Labels::parse(l).map_err(|e| bad(format!("--labels: {e}")))?,
        None => Labels::default(),
    };
    for accelerator in labels_from_detection {
        labels.0.insert(format!("{TPURAY_PREFIX}accelerator-type"), accelerator.clone());
        labels.0.insert(format!("{RAY_PREFIX}accelerator-type"), accelerator);
    }
    // A TPU host (TPU.md): the chip count from `--resources '{"TPU": N}'`,
    // the slice from the `TPU_*` environment, exactly as on Ray.
    let tpu = total.get("TPU");
    if tpu != Amount::ZERO {
        let chips = tpuray_scheduler::tpu::chip_count(tpu, None)
            .map_err(|e| bad(format!("--resources: \"TPU\": {e}")))?;
        if o.env.contains_key("TPU_ACCELERATOR_TYPE") {
            let env = with_pod_worker_id(&o.env).map_err(bad)?;
            let host = tpuray_scheduler::tpu::TpuHostInfo::from_env(&env, chips)
                .map_err(|e| bad(format!("TPU host environment: {e}")))?;
            for (name, amount) in host.resources().iter() {
                total.set(name, amount);
            }
            for (k, v) in host.labels().0 {
                labels.0.insert(k, v);
            }
        }
        // AGENT-9: how the chips were found: `accel`, `vfio` or `simulated`.
        labels.0.insert(format!("{TPURAY_PREFIX}tpu-devices"), devices_source.to_string());
    }
    Ok((total, labels))
}

/// The TPU environment of a pod: `env` with `TPU_WORKER_ID` filled in when it is unset
/// on a multi-host slice, from an Indexed Job's `JOB_COMPLETION_INDEX`, else from the
/// StatefulSet ordinal that ends the pod's `HOSTNAME` (`sa-2` → 2), as KubeRay's TPU
/// webhook and GKE's JobSet give each host its index. A given `TPU_WORKER_ID` always
/// wins; single-host slices need none (worker 0).
///
/// # Errors
/// A `JOB_COMPLETION_INDEX` that is not an integer >= 0, named.
pub fn with_pod_worker_id(
    env: &std::collections::BTreeMap<String, String>,
) -> Result<std::collections::BTreeMap<String, String>, String> {
    let get = |k: &str| env.get(k).map(|v| v.trim()).filter(|v| !v.is_empty());
    let multi_host = get("TPU_ACCELERATOR_TYPE")
        .and_then(|t| tpuray_scheduler::tpu::AcceleratorType::parse(t).ok())
        .is_some_and(|a| a.hosts() > 1);
    if get("TPU_WORKER_ID").is_some() || !multi_host {
        return Ok(env.clone());
    }
    let id = if let Some(i) = get("JOB_COMPLETION_INDEX") {
        Some(i.parse::<u32>().map_err(|_| {
            format!("JOB_COMPLETION_INDEX={i:?} is not a worker id (expected an integer >= 0)")
        })?)
    } else {
        get("HOSTNAME").and_then(statefulset_ordinal)
    };
    let mut out = env.clone();
    if let Some(id) = id {
        out.insert("TPU_WORKER_ID".into(), id.to_string());
    }
    Ok(out)
}

/// The ordinal a StatefulSet pod's name ends with: `sa-2` → 2, `sa` → none.
pub fn statefulset_ordinal(hostname: &str) -> Option<u32> {
    // A hostname may be a FQDN; the pod name is its first label.
    let pod = hostname.split('.').next()?;
    let (_, n) = pod.rsplit_once('-')?;
    if n.is_empty() || !n.bytes().all(|b| b.is_ascii_digit()) {
        return None;
    }
    n.parse().ok()
}

/// The object store's capacity in bytes: `--object-store-memory`, else Ray's
/// share of the memory available now ([`detect::default_object_store_bytes`]).
/// The node advertises it as its `object_store_memory` resource and its store
/// holds at most that much in memory.
pub fn object_store_bytes(o: &AgentOptions) -> u64 {
    o.object_store_memory.unwrap_or_else(|| {
        let (_, avail_mem) = detect::memory_bytes();
        detect::default_object_store_bytes(avail_mem)
    })
}

/// The node's object store settings (OBJ-3, OBJ-4).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct StoreOptions {
    /// `--object-store-memory`: bytes the store holds in memory.
    pub capacity_bytes: u64,
    /// `--spill-dir`: where primary copies go under pressure (the store uses
    /// its own subfolder, removed when the agent stops).
    pub spill_dir: std::path::PathBuf,
}

/// Connects to the head, retrying connection failures for up to `retry_for`
/// (DESIGN.md §6: about 30 s); auth and version errors fail at once.
async fn join_head(
    agent: &Agent,
    retry_for: Duration,
) -> Result<pb::RegisterNodeReply, StartError> {
    let address = agent.config.head_address.clone();
    let started = Instant::now();
    let mut client = tpuray_proto::client::head(&address, agent.config.token.as_deref())
        .map_err(|e| StartError::BadFlag(format!("--address: {e}")))?;
    let request_id = tpuray_proto::new_request_id();
    let mut attempts = 0u32;
    loop {
        attempts += 1;
        let req = pb::RegisterNodeRequest {
            request_id: request_id.clone(),
            protocol_version: tpuray_proto::PROTOCOL_VERSION,
            node: Some(agent.node_info()),
        };
        let mut req = Request::new(req);
        req.set_timeout(Duration::from_secs(5));
        match client.register_node(req).await {
            // TLS-3: the head's mode, learnt at registration as its auth mode is.
            Ok(r) if r.get_ref().tls != tpuray_proto::tls::enabled() => {
                let detail = if r.get_ref().tls {
                    "TLS mismatch: the head uses TLS but this node is plain".to_string()
                } else {
                    "TLS mismatch: this node uses TLS but the head is plain".to_string()
                };
                return Err(StartError::Tls { address, detail });
            }
            Ok(r) => return Ok(r.into_inner()),
            Err(s)
                if matches!(
                    s.code(),
                    tonic::Code::Unavailable | tonic::Code::DeadlineExceeded | tonic::Code::Unknown
                ) =>
            {
                // TLS-4: a refused certificate does not get better by waiting.
                if let Some(why) = tpuray_proto::tls::status_reason(&s) {
                    return Err(StartError::Tls { address, detail: why });
                }
                // TLS-3/TLS-4: a head that speaks otherwise (TLS or plain), or refuses
                // this node's certificate, is named at once.
                if attempts % 10 == 1
                    && let Some(m) = diagnose_heads(&address).await
                {
                    return Err(StartError::Tls { address, detail: m });
                }
                if started.elapsed() >= retry_for {
                    return Err(StartError::HeadUnreachable {
                        address,
                        waited: Duration::from_secs(started.elapsed().as_secs()),
                        detail: tpuray_proto::client::status_chain(&s),
                    });
                }
                tokio::time::sleep(Duration::from_millis(200)).await;
            }
            Err(s) => {
                if matches!(s.code(), tonic::Code::Cancelled | tonic::Code::Internal)
                    && let Some(m) = diagnose_heads(&address).await
                {
                    return Err(StartError::Tls { address, detail: m });
                }
                return Err(StartError::Refused { address, detail: s.message().to_string() });
            }
        }
    }
}

/// TLS-3/TLS-4: why TLS keeps this process from the heads at `address` (a list), when
/// it does.
pub async fn diagnose_heads(address: &str) -> Option<String> {
    for a in address.split(',').map(str::trim).filter(|a| !a.is_empty()) {
        if let Some(m) = tpuray_proto::tls::diagnose(a, &format!("the head at {a}")).await {
            return Some(m);
        }
    }
    None
}

/// AGENT-1: how long one heartbeat call may take: at least the interval, at most 2 s,
/// and no more than a third of the node death timeout (`death`, 0 when the head did not
/// say), so that a call stuck on a head that cannot answer now (one restarting after a
/// kill, or a loaded one) is given up, and the next heartbeat tried, well before the
/// leader declares this node dead. Heartbeats go one at a time: with a 2 s call and a
/// 1.5 s death timeout, one stuck call was enough to lose the node.
fn heartbeat_call_timeout(interval: Duration, death: Duration) -> Duration {
    let cap = Duration::from_secs(2);
    let cap = if death.is_zero() { cap } else { cap.min(death / 3) };
    interval.max(cap)
}

/// AGENT-1: heartbeats on a dedicated OS thread with its own runtime, so
/// nothing the agent's main runtime does can delay them; each call is bounded by
/// [`heartbeat_call_timeout`]. Stops the process when the head declares this node dead,
/// or after `head_lost_after` without a successful heartbeat.
fn spawn_heartbeat_thread(
    agent: Arc<Agent>,
    interval: Duration,
    call_timeout: Duration,
    head_lost_after: Duration,
) {
    std::thread::Builder::new()
        .name("tpuray-heartbeat".into())
        .spawn(move || {
            let rt = tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()
                .expect("heartbeat runtime");
            rt.block_on(async move {
                let address = agent.config.head_address.clone();
                let Ok(mut client) = tpuray_proto::client::head(&address, agent.config.token.as_deref()) else {
                    return;
                };
                let mut last_ok = Instant::now();
                let mut seq = 0u64;
                // The cluster view held: the head's (epoch, version), (0, 0) for none.
                let mut view = (0u64, 0u64);
                let mut iv = tokio::time::interval(interval);
                iv.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
                loop {
                    iv.tick().await;
                    // AGENT-16: a draining node told the head it is leaving; a heartbeat
                    // now would only be refused.
                    if agent.is_draining() {
                        return;
                    }
                    seq += 1;
                    let (total, available, pending, num_workers) = agent.heartbeat_snapshot();
                    let mut req = Request::new(pb::HeartbeatRequest {
                        node_id: agent.config.node_id.to_string(),
                        total: resources_to_proto(&total),
                        available: resources_to_proto(&available),
                        pending,
                        num_workers,
                        seq,
                        job_submissions: agent.supervisors.listed(),
                        view_epoch: view.0,
                        view_version: view.1,
                    });
                    req.set_timeout(call_timeout);
                    match client.heartbeat(req).await {
                        Ok(r) => {
                            let r = r.into_inner();
                            if !r.accepted {
                                tracing::error!(reason = %r.reason, "head refused heartbeat; node agent exits");
                                eprintln!("tpuray node agent: the head refused this node: {}", r.reason);
                                terminate_self(&agent);
                                return;
                            }
                            last_ok = Instant::now();
                            // HEAD-13: a delta applies over the view held; a whole view
                            // (from a head without deltas too) replaces it.
                            view = (r.view_epoch, r.view_version);
                            agent.set_cluster_view(r.cluster, r.view_delta, &r.view_removed);
                        }
                        Err(s) => {
                            tracing::warn!(%s, "heartbeat failed");
                            if last_ok.elapsed() > head_lost_after {
                                eprintln!(
                                    "tpuray node agent: no answer from the head at {address} for {:?}; exiting",
                                    last_ok.elapsed()
                                );
                                terminate_self(&agent);
                                return;
                            }
                        }
                    }
                }
            });
        })
        .expect("spawn heartbeat thread");
}

/// Asks this process to shut down as on SIGTERM, without a drain: the head already
/// counts this node dead (or is gone), its tasks are being retried elsewhere, so its
/// workers stop at once (AGENT-16).
fn terminate_self(agent: &Agent) {
    agent.exit_without_drain.store(true, std::sync::atomic::Ordering::SeqCst);
    crate::agent::signal(std::process::id(), libc::SIGTERM);
}

/// Runs a node agent: listens on `listen`, joins the head, then serves until
/// `shutdown` resolves; then drains (AGENT-16): tells the head the node is leaving (the
/// head marks it dead at once, so owners retry its unfinished work elsewhere as on node
/// death), grants no more leases, lets running tasks finish for up to `drain_grace`
/// (zero: not at all), then stops its workers. `ready` gets the bound address once the
/// node is registered.
///
/// # Errors
/// [`StartError`] naming what failed: the listen address, the head, the token.
#[allow(clippy::too_many_arguments)]
pub async fn serve_agent(
    listen: SocketAddr,
    advertise_host: &str,
    head_address: &str,
    total: ResourceSet,
    labels: Labels,
    is_head_node: bool,
    session_dir: std::path::PathBuf,
    token: Option<String>,
    worker_command: Vec<String>,
    store: StoreOptions,
    metrics_export_port: u16,
    drain_grace: Duration,
    ready: impl FnOnce(SocketAddr, &NodeId),
    shutdown: impl std::future::Future<Output = ()> + Send + 'static,
) -> Result<(), StartError> {
    // NET-3: an agent advertising a non-loopback address serves on every address, so
    // drivers and workers of its host reach it through 127.0.0.1 too.
    let listener = tokio::net::TcpListener::bind(tpuray_proto::net::bind_address(listen))
        .await
        .map_err(|e| StartError::Listen { addr: listen.to_string(), detail: e.to_string() })?;
    let bound = listener
        .local_addr()
        .map_err(|e| StartError::Listen { addr: listen.to_string(), detail: e.to_string() })?;
    // `/metrics` and the health routes (`metrics.rs`), on the node's address: bound before
    // registering, so the port the node registers with is served (0: a free port).
    let metrics_addr = SocketAddr::new(listen.ip(), metrics_export_port);
    let metrics_listener =
        tokio::net::TcpListener::bind(tpuray_proto::net::bind_address(metrics_addr))
            .await
            .map_err(|e| StartError::Listen {
                addr: format!("{metrics_addr} (--metrics-export-port)"),
                detail: e.to_string(),
            })?;
    let metrics_port = metrics_listener
        .local_addr()
        .map_err(|e| StartError::Listen { addr: metrics_addr.to_string(), detail: e.to_string() })?
        .port();
    let node_id = NodeId::random();
    let max_idle = total.get("CPU").to_f64().ceil().max(1.0) as usize;
    // Drivers and workers of this node attach with `LocalStore::join` and
    // follow the capacity and spill folder written here.
    let store = tpuray_objectstore::LocalStore::open_with(tpuray_objectstore::StoreConfig {
        dir: tpuray_objectstore::LocalStore::default_dir(node_id.as_str(), &session_dir),
        capacity_bytes: Some(store.capacity_bytes),
        spill_dir: Some(store.spill_dir),
    })
    .map_err(|e| StartError::BadFlag(format!("object store: {e}")))?;
    // OBJ-13: stores left by this machine's agents that died go now (never a live one's).
    let swept = tokio::task::spawn_blocking(|| {
        tpuray_objectstore::sweep_stale_stores(std::path::Path::new(tpuray_objectstore::STORE_ROOT))
    })
    .await
    .unwrap_or_default();
    if !swept.is_empty() {
        tracing::info!(removed = ?swept, "removed object store folders of node agents that died");
    }
    let config = AgentConfig {
        node_id: node_id.clone(),
        head_address: head_address.to_string(),
        advertise_address: format!("{advertise_host}:{}", bound.port()),
        total,
        labels,
        is_head_node,
        session_dir,
        token: token.clone(),
        worker_command,
        max_idle_workers: max_idle,
        idle_worker_timeout: env_duration_ms("TPURAY_IDLE_WORKER_TIMEOUT_MS", 10_000),
        worker_register_timeout: env_duration_ms("TPURAY_WORKER_REGISTER_TIMEOUT_MS", 30_000),
        store: store.clone(),
    };
    let agent = Agent::new(config);
    let _ = agent.metrics.port.set(metrics_port);
    // TLS-1: this process's identity (from the environment `tpuray start` sets).
    let tls = tpuray_proto::tls::current().map_err(StartError::BadFlag)?;
    let (metrics_stop, metrics_stopped) = tokio::sync::oneshot::channel::<()>();
    let metrics_router = crate::metrics::router(Arc::clone(&agent));
    tokio::spawn(async move {
        let stopped = async {
            let _ = metrics_stopped.await;
        };
        // TLS-2: HTTPS with the node's certificate when it uses TLS.
        let served = match tls {
            None => {
                axum::serve(metrics_listener, metrics_router).with_graceful_shutdown(stopped).await
            }
            Some(t) => {
                match tpuray_proto::tls::HttpsListener::new(metrics_listener, t, "metrics server") {
                    Ok(l) => axum::serve(l, metrics_router).with_graceful_shutdown(stopped).await,
                    Err(e) => Err(e),
                }
            }
        };
        if let Err(e) = served {
            tracing::error!("the metrics HTTP server stopped: {e}");
        }
    });
    // Serve before registering so the head can call back at once.
    let auth = ServerAuth::new(token.as_deref().unwrap_or(""), token.is_some());
    let svc = NodeAgentServiceServer::new(AgentSvc(Arc::clone(&agent)))
        .max_decoding_message_size(tpuray_proto::MAX_MESSAGE_BYTES)
        .max_encoding_message_size(tpuray_proto::MAX_MESSAGE_BYTES);
    let svc = InterceptedService::new(svc, auth.clone());
    let objects = tonic::service::interceptor::InterceptedService::new(
        tpuray_proto::pb::object_transfer_service_server::ObjectTransferServiceServer::new(
            tpuray_objectstore::transfer::ObjectsSvc { store: store.clone() },
        )
        .max_decoding_message_size(tpuray_proto::MAX_MESSAGE_BYTES)
        .max_encoding_message_size(tpuray_proto::MAX_MESSAGE_BYTES),
        auth.clone(),
    );
    let (stop_tx, stop_rx) = tokio::sync::oneshot::channel::<()>();
    let server = tokio::spawn(async move {
        let router = tonic::transport::Server::builder()
            .tcp_nodelay(true)
            .add_service(svc)
            .add_service(objects);
        let stopped = async {
            let _ = stop_rx.await;
        };
        match tls {
            None => {
                router.serve_with_incoming_shutdown(tokio_stream_listener(listener), stopped).await
            }
            Some(t) => {
                router
                    .serve_with_incoming_shutdown(
                        tpuray_proto::tls::incoming(listener, t, "node agent"),
                        stopped,
                    )
                    .await
            }
        }
    });

    let retry_for = env_duration_ms("TPURAY_HEAD_CONNECT_TIMEOUT_MS", 30_000);
    let reply = match join_head(&agent, retry_for).await {
        Ok(r) => r,
        Err(e) => {
            let _ = stop_tx.send(());
            let _ = metrics_stop.send(());
            // A node that never joined leaves no store folder behind.
            store.destroy();
            return Err(e);
        }
    };
    // AUTH-1: follow the head's auth mode.
    auth.set_required(reply.auth_required && token.is_some());
    agent.auth_required.store(auth.required(), std::sync::atomic::Ordering::SeqCst);
    agent.metrics.set_cluster_id(&reply.cluster_id);
    crate::metrics::spawn_sampler(Arc::clone(&agent));
    let interval = Duration::from_millis(reply.heartbeat_interval_ms.max(10));
    let death = Duration::from_millis(reply.node_death_timeout_ms);
    spawn_heartbeat_thread(
        Arc::clone(&agent),
        interval,
        heartbeat_call_timeout(interval, death),
        env_duration_ms("TPURAY_HEAD_LOST_TIMEOUT_MS", 60_000),
    );
    let reaper = Arc::clone(&agent);
    tokio::spawn(async move {
        let mut tick = 0u64;
        loop {
            tokio::time::sleep(Duration::from_secs(1)).await;
            reaper.reap_idle_workers();
            reaper.expire_prepared_bundles();
            tick += 1;
            if tick.is_multiple_of(2) {
                reaper.reclaim_orphaned_leases().await;
            }
        }
    });
    tracing::info!(%node_id, address = %agent.config.advertise_address, "node agent joined the cluster");
    agent.joined.store(true, std::sync::atomic::Ordering::SeqCst);
    ready(SocketAddr::new(listen.ip(), bound.port()), &node_id);

    shutdown.await;
    // AGENT-16: first the head (the node is dead for schedulers and owners at once, not
    // after the heartbeat timeout), then the running tasks, then the workers.
    agent.draining.store(true, std::sync::atomic::Ordering::SeqCst);
    tracing::info!(grace = ?drain_grace, "node agent draining: telling the head this node leaves");
    let told = Instant::now();
    if let Ok(mut head) = tpuray_proto::client::head(head_address, token.as_deref()) {
        let mut req = Request::new(pb::UnregisterNodeRequest {
            request_id: tpuray_proto::new_request_id(),
            node_id: node_id.to_string(),
            reason: if agent.exit_without_drain.load(std::sync::atomic::Ordering::SeqCst) {
                "node agent stopped (the head refused it or was lost)".to_string()
            } else {
                format!(
                    "node agent drained (SIGTERM; running tasks had up to {}s to finish)",
                    drain_grace.as_secs()
                )
            },
        });
        req.set_timeout(Duration::from_secs(5));
        match head.unregister_node(req).await {
            Ok(_) => tracing::info!(
                ms = told.elapsed().as_millis() as u64,
                "the head marked this node dead"
            ),
            Err(s) => tracing::warn!(%s, "could not tell the head this node leaves"),
        }
    }
    if agent.exit_without_drain.load(std::sync::atomic::Ordering::SeqCst) {
        tracing::info!("the head refused this node or is gone: no drain");
    } else if !drain_grace.is_zero() {
        let waited = Instant::now();
        let left = agent.wait_drained(drain_grace).await;
        if left == 0 {
            tracing::info!(
                ms = waited.elapsed().as_millis() as u64,
                "drained: no task runs on this node any more"
            );
        } else {
            tracing::warn!(
                running = left,
                "drain grace period ({}s) over with tasks still running; stopping them (their owners retry them elsewhere)",
                drain_grace.as_secs()
            );
        }
    }
    tracing::info!("node agent stopping");
    agent.stop_all_workers(Duration::from_secs(3)).await;
    let _ = stop_tx.send(());
    let _ = metrics_stop.send(());
    store.destroy();
    match tokio::time::timeout(Duration::from_secs(3), server).await {
        Ok(Ok(Err(e))) => Err(StartError::Serve(e.to_string())),
        _ => Ok(()),
    }
}

fn tokio_stream_listener(
    listener: tokio::net::TcpListener,
) -> tonic::transport::server::TcpIncoming {
    tpuray_proto::incoming(listener)
}

/// A duration from an environment variable in milliseconds, or a default.
pub fn env_duration_ms(var: &str, default_ms: u64) -> Duration {
    Duration::from_millis(
        std::env::var(var).ok().and_then(|v| v.parse().ok()).unwrap_or(default_ms),
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    /// AGENT-1: a heartbeat call ends well inside the death timeout, never before the
    /// next tick, and at 2 s when an older head states no death timeout.
    #[test]
    fn agent_1_a_heartbeat_call_is_given_up_well_inside_the_death_timeout() {
        let ms = Duration::from_millis;
        // The tests' cluster: 100 ms heartbeats, dead after 1.5 s.
        assert_eq!(heartbeat_call_timeout(ms(100), ms(1500)), ms(500));
        // The defaults: 1 s heartbeats, dead after 5 s.
        assert_eq!(heartbeat_call_timeout(ms(1000), ms(5000)), ms(5000) / 3);
        assert_eq!(heartbeat_call_timeout(ms(1000), ms(60_000)), ms(2000));
        assert_eq!(heartbeat_call_timeout(ms(1000), Duration::ZERO), ms(2000));
        // Never shorter than the interval itself.
        assert_eq!(heartbeat_call_timeout(ms(3000), ms(1500)), ms(3000));
    }

    #[test]
    fn cpu_inside_resources_json_is_refused_naming_the_flag() {
        let o = AgentOptions { resources_json: Some(r#"{"CPU": 2}"#.into()), ..Default::default() };
        let e = build_resources(&o).unwrap_err().to_string();
        assert!(e.contains("--num-cpus"), "{e}");
    }

    #[test]
    fn fractional_gpus_are_refused_naming_the_flag() {
        let o = AgentOptions { num_gpus: Some(1.5), ..Default::default() };
        let e = build_resources(&o).unwrap_err().to_string();
        assert!(e.contains("--num-gpus") && e.contains("whole number"), "{e}");
        let o = AgentOptions { num_gpus: Some(2.0), ..Default::default() };
        assert_eq!(build_resources(&o).unwrap().0.get("GPU").to_f64(), 2.0);
    }

    #[test]
    fn flags_become_resources_and_labels() {
        let o = AgentOptions {
            num_cpus: Some(2.0),
            resources_json: Some(r#"{"special": 1}"#.into()),
            labels: Some("zone=a,tier=gold".into()),
            object_store_memory: Some(268_435_456),
            ..Default::default()
        };
        let (r, l) = build_resources(&o).unwrap();
        assert_eq!(r.get("CPU").to_f64(), 2.0);
        assert_eq!(r.get("special").to_f64(), 1.0);
        assert_eq!(r.get("object_store_memory").to_f64(), 268_435_456.0);
        assert_eq!(l.get("zone"), Some("a"));
    }

    #[test]
    fn negative_and_unparsable_resources_are_refused() {
        for (json, want) in [
            (r#"{"x": -1}"#, "negative"),
            (r#"{"x": "abc"}"#, "non-numeric"),
            ("{not json", "invalid --resources JSON"),
        ] {
            let o = AgentOptions { resources_json: Some(json.into()), ..Default::default() };
            let e = build_resources(&o).unwrap_err().to_string();
            assert!(e.contains(want), "{json}: {e}");
        }
        let o = AgentOptions { num_cpus: Some(-2.0), ..Default::default() };
        assert!(build_resources(&o).unwrap_err().to_string().contains("--num-cpus"));
    }
}

#[cfg(test)]
mod tpu_tests {
    use super::*;

    fn tpu_options(worker_id: &str) -> AgentOptions {
        let env = [
            ("TPU_ACCELERATOR_TYPE", "v6e-16"),
            ("TPU_NAME", "sa"),
            ("TPU_WORKER_ID", worker_id),
            ("TPU_TOPOLOGY", "4x4"),
        ]
        .into_iter()
        .map(|(k, v)| (k.to_string(), v.to_string()))
        .collect();
        AgentOptions { resources_json: Some(r#"{"TPU": 4}"#.into()), env, ..Default::default() }
    }

    #[test]
    fn simulated_tpu_host_advertises_tpu_md_resources_and_labels() {
        let (r, l) = build_resources(&tpu_options("2")).unwrap();
        assert_eq!(r.get("TPU").to_f64(), 4.0);
        assert_eq!(r.get("accelerator_type:TPU-V6E").to_f64(), 1.0);
        assert_eq!(r.get("sa").to_f64(), 1.0);
        assert_eq!(r.get("TPU-v6e-16-head").to_f64(), 0.0, "only worker 0 has the head resource");
        assert_eq!(l.0.get("tpuray.io/tpu-worker-id").map(String::as_str), Some("2"));
        assert_eq!(l.0.get("ray.io/tpu-slice-name").map(String::as_str), Some("sa"));
        let (r0, _) = build_resources(&tpu_options("0")).unwrap();
        assert_eq!(r0.get("TPU-v6e-16-head").to_f64(), 1.0);
    }

    #[test]
    fn pod_worker_id_comes_from_job_completion_index_then_hostname_ordinal() {
        let mut o = tpu_options("2");
        o.env.remove("TPU_WORKER_ID");
        o.env.insert("HOSTNAME".into(), "sa-3".into());
        let (_, l) = build_resources(&o).unwrap();
        assert_eq!(l.0.get("tpuray.io/tpu-worker-id").map(String::as_str), Some("3"));
        o.env.insert("JOB_COMPLETION_INDEX".into(), "1".into());
        let (_, l) = build_resources(&o).unwrap();
        assert_eq!(l.0.get("tpuray.io/tpu-worker-id").map(String::as_str), Some("1"));
        o.env.insert("TPU_WORKER_ID".into(), "0".into());
        let (r, l) = build_resources(&o).unwrap();
        assert_eq!(l.0.get("tpuray.io/tpu-worker-id").map(String::as_str), Some("0"));
        assert_eq!(r.get("TPU-v6e-16-head").to_f64(), 1.0);
        o.env.remove("TPU_WORKER_ID");
        o.env.insert("JOB_COMPLETION_INDEX".into(), "x".into());
        let e = build_resources(&o).unwrap_err().to_string();
        assert!(e.contains("JOB_COMPLETION_INDEX=\"x\""), "{e}");
        assert_eq!(statefulset_ordinal("demo-v6e-16-0-2.demo.default.svc"), Some(2));
        assert_eq!(statefulset_ordinal("sa"), None);
        assert_eq!(statefulset_ordinal("sa-"), None);
    }

    #[test]
    fn inconsistent_tpu_environment_is_refused() {
        let e = build_resources(&tpu_options("9")).unwrap_err().to_string();
        assert!(e.contains("TPU"), "{e}");
        let o = AgentOptions { resources_json: Some(r#"{"TPU": 3}"#.into()), ..Default::default() };
        let e = build_resources(&o).unwrap_err().to_string();
        assert!(e.contains("TPU"), "{e}");
    }
}
