//! The driver side: `tpuray::init` joins a cluster as a job. It uploads the
//! program's own binary to the cluster (content-addressed, so node agents can
//! start it as the job's worker without a shared filesystem), registers the
//! job, attaches to the node agent of this machine, and serves the owner side
//! of `WorkerService`.
//!
//! In detail: `init` uploads the binary to the head's KV (namespace `binaries`,
//! sha256-addressed chunks), registers the job with that hash, attaches to this
//! machine's node agent (the head node's when several share the address) and serves
//! `WorkerService` as the owner of the objects it creates. In a process started by a
//! node agent (`TPURAY_WORKER_ID` set) `init` runs the worker loop and never returns:
//! a Rust job's binary is its own worker.
//!
//! Blocking: these functions block the calling thread on the SDK's runtime.

use std::collections::BTreeMap;
use std::sync::{Arc, OnceLock};
use std::time::Duration;

use sha2::Digest;
use tonic::Request;
use tpuray_objectstore::LocalStore;
use tpuray_proto::pb;

use crate::core::Core;
use crate::error::Error;
use crate::service::Svc;

/// KV namespace holding uploaded worker binaries: `<sha256>/meta` (JSON with
/// `chunks` and `size`, written last) and `<sha256>/<i>` chunks.
pub const BINARIES_NAMESPACE: &str = "binaries";
const CHUNK_BYTES: usize = 8 * 1024 * 1024;

/// One node as `nodes()` reports it (Ray's keys: `NodeID`, `Alive`, ...).
#[derive(Clone, Debug, PartialEq, serde::Serialize)]
pub struct NodeSummary {
    #[serde(rename = "NodeID")]
    pub node_id: String,
    #[serde(rename = "Alive")]
    pub alive: bool,
    #[serde(rename = "NodeManagerAddress")]
    pub address: String,
    #[serde(rename = "Resources")]
    pub resources: BTreeMap<String, f64>,
    #[serde(rename = "Labels")]
    pub labels: BTreeMap<String, String>,
    /// The port of the node agent's `/metrics` (Ray's `MetricsExportPort`).
    #[serde(rename = "MetricsExportPort")]
    pub metrics_export_port: u32,
    /// The node agent's gRPC port (Ray's `NodeManagerPort`, the raylet's port).
    #[serde(rename = "NodeManagerPort")]
    pub node_manager_port: u16,
    /// The host name the node agent reported (Ray's `NodeManagerHostname`).
    #[serde(rename = "NodeManagerHostname")]
    pub hostname: String,
    /// Why the node died, `""` while it lives (Ray's `DeathReasonMessage`).
    #[serde(rename = "DeathReasonMessage")]
    pub death_reason: String,
}

fn current_cluster_address() -> Option<String> {
    tpuray_proto::registry::current_cluster().map(|c| c.address)
}

/// The addresses of the node agents running on this host, from its process
/// registry (`tpuray start` records every agent it starts, REG-1), or from
/// `registry` (a private cluster's).
fn local_agent_addresses(registry: Option<&std::path::Path>) -> Vec<String> {
    let dir = registry
        .map(std::path::Path::to_path_buf)
        .unwrap_or_else(tpuray_proto::registry::registry_dir);
    tpuray_proto::registry::live_agents_in(&dir).into_iter().map(|e| e.address).collect()
}

/// The node this driver attaches to (NET-3): one whose agent runs on this host
/// (this host's process registry), the head node's first when several do.
fn local_node<'a>(
    alive: &[&'a pb::NodeInfo],
    registry: Option<&std::path::Path>,
) -> Option<&'a pb::NodeInfo> {
    let local = local_agent_addresses(registry);
    let here = |n: &&&pb::NodeInfo| local.contains(&n.address);
    alive.iter().filter(here).find(|n| n.is_head_node).or_else(|| alive.iter().find(here)).copied()
}

fn cluster_err(what: &str, s: tonic::Status) -> Error {
    Error::Cluster(format!("{what}: {}", tpuray_proto::client::status_chain(&s)))
}

/// Uploads `path` to the head's KV unless a copy with the same hash is
/// there; returns the sha256 hex.
async fn upload_binary(
    head: &mut pb::head_service_client::HeadServiceClient<tpuray_proto::client::AuthChannel>,
    path: &std::path::Path,
) -> Result<String, Error> {
    let bytes = std::fs::read(path).map_err(|e| {
        Error::Cluster(format!("cannot read this program's binary {}: {e}", path.display()))
    })?;
    let hash = format!("{:x}", sha2::Sha256::digest(&bytes));
    let meta_key = format!("{hash}/meta").into_bytes();
    let have = head
        .kv_get(pb::KvGetRequest { namespace: BINARIES_NAMESPACE.into(), key: meta_key.clone() })
        .await
        .map_err(|s| cluster_err("checking the job binary", s))?
        .into_inner()
        .found;
    if have {
        return Ok(hash);
    }
    let chunks: Vec<&[u8]> = bytes.chunks(CHUNK_BYTES).collect();
    for (i, c) in chunks.iter().enumerate() {
        head.kv_put(pb::KvPutRequest {
            request_id: tpuray_proto::new_request_id(),
            namespace: BINARIES_NAMESPACE.into(),
            key: format!("{hash}/{i}").into_bytes(),
            value: c.to_vec(),
            overwrite: true,
        })
        .await
        .map_err(|s| cluster_err("uploading the job binary", s))?;
    }
    let meta = serde_json::json!({ "chunks": chunks.len(), "size": bytes.len() }).to_string();
    head.kv_put(pb::KvPutRequest {
        request_id: tpuray_proto::new_request_id(),
        namespace: BINARIES_NAMESPACE.into(),
        key: meta_key,
        value: meta.into_bytes(),
        overwrite: true,
    })
    .await
    .map_err(|s| cluster_err("uploading the job binary", s))?;
    Ok(hash)
}

/// Joins the cluster at `address` (`host:port[,...]`), or at
/// `TPURAY_ADDRESS`, or the one `tpuray start --head` left on this machine.
/// In a worker process (started by a node agent) this runs the worker loop
/// and exits the process instead of returning. After [`shutdown`] a driver may
/// call it again: a new core and a new job (CORE-14).
///
/// # Errors
/// [`Error::Cluster`] naming the missing address, token or head refusal, or
/// `tpuray::init was already called in this process` while a core is installed
/// (call [`shutdown`] first).
pub fn init(address: Option<&str>) -> Result<(), Error> {
    init_with(address, &DriverOptions { upload_binary: true, ..Default::default() })
}

/// How a driver joins: [`init`] uploads the program's binary (a Rust job is its own
/// worker); a Python driver does not (its workers are Python processes).
#[derive(Clone, Debug, Default)]
pub struct DriverOptions {
    pub upload_binary: bool,
    /// The job's namespace for named actors and groups (default "default").
    pub namespace: Option<String>,
    /// The process registry that lists this host's node agents (NET-3), when it is
    /// not this machine's (a private cluster started with a registry of its own).
    pub registry_dir: Option<std::path::PathBuf>,
}

/// [`init`] with options.
///
/// # Errors
/// As [`init`].
pub fn init_with(address: Option<&str>, opts: &DriverOptions) -> Result<(), Error> {
    if crate::worker::is_worker_process() {
        let code = match crate::worker::run_worker() {
            Ok(()) => 0,
            Err(e) => {
                eprintln!("tpuray worker: {e}");
                1
            }
        };
        std::process::exit(code);
    }
    // CORE-14: one core at a time; refused before a job is registered for nothing.
    if crate::core::try_core().is_some() {
        return Err(Error::Cluster("tpuray::init was already called in this process".into()));
    }
    let address = match address.map(str::to_string).or_else(|| std::env::var("TPURAY_ADDRESS").ok()) {
        Some(a) if !a.is_empty() => a,
        _ => current_cluster_address().ok_or_else(|| {
            Error::Cluster("no cluster address: pass one to init(), set TPURAY_ADDRESS, or start a cluster with `tpuray start --head`".into())
        })?,
    };
    let head_address = address.clone(); // every head: the client follows the leader
    let token = tpuray_proto::auth::load_token().map_err(|e| Error::Cluster(e.to_string()))?;
    let fail_on_infeasible =
        matches!(std::env::var("TPURAY_FAIL_ON_INFEASIBLE").as_deref(), Ok("1") | Ok("true"));
    let rt = crate::core::build_runtime().map_err(Error::Cluster)?;
    let (job_id, node, listener, remote) = rt.block_on(async {
        let mut head = tpuray_proto::client::head(&head_address, token.as_deref())
            .map_err(|e| Error::Cluster(e.to_string()))?;
        let status = match head.get_cluster_status(pb::GetClusterStatusRequest {}).await {
            Ok(r) => r.into_inner(),
            Err(s) => {
                // TLS-3: a head that speaks otherwise (TLS or plain) is named as such.
                for a in head_address.split(',').map(str::trim).filter(|a| !a.is_empty()) {
                    let what = format!("the head at {a}");
                    if let Some(m) = tpuray_proto::tls::diagnose(a, &what).await {
                        return Err(Error::Cluster(m));
                    }
                }
                return Err(cluster_err(&format!("the head at {head_address}"), s));
            }
        };
        // Attach to this machine's node agent, found through its process registry
        // (NET-3); with several (a simulated cluster), to the head node's (DESIGN.md §4).
        let alive: Vec<&pb::NodeInfo> =
            status.nodes.iter().filter(|n| n.state == pb::NodeState::Alive as i32).collect();
        // A host without a node: leases from the head node's agent, objects in a
        // private store served from here (NET-3).
        let (node, remote) = match local_node(&alive, opts.registry_dir.as_deref()) {
            Some(n) => ((*n).clone(), false),
            None => {
                let n = alive
                    .iter()
                    .find(|n| n.is_head_node)
                    .or_else(|| alive.first())
                    .map(|n| (*n).clone())
                    .ok_or_else(|| {
                        Error::Cluster(format!("the cluster at {head_address} has no live node"))
                    })?;
                eprintln!(
                    "tpuray: no node of the cluster at {head_address} runs on this host (none in \
                     its process registry); this driver leases workers through the node at {} \
                     and serves its own objects",
                    n.address
                );
                (n, true)
            }
        };
        let exe = std::env::current_exe()
            .map_err(|e| Error::Cluster(format!("cannot find this program's binary: {e}")))?;
        let hash =
            if opts.upload_binary { upload_binary(&mut head, &exe).await? } else { String::new() };
        // Listen first: the job record carries the driver's address (workers send
        // their output there): the local node's address, one of this host's, or
        // without one the address that routes to the head.
        let host = if remote {
            tpuray_proto::net::advertise_address_toward(&head_address).to_string()
        } else {
            node.address.rsplit_once(':').map(|(h, _)| h.to_string()).unwrap_or("127.0.0.1".into())
        };
        // Worker lines print here by Ray's rules (LOGS-1); a bad RAY_DEDUP_LOGS_* is
        // refused before the job exists.
        crate::logs::configure(&host, None).map_err(Error::Cluster)?;
        let listener = tokio::net::TcpListener::bind((host.as_str(), 0)).await.map_err(|e| {
            Error::Cluster(format!(
                "cannot listen on {host} (this host's address for the cluster): {e}"
            ))
        })?;
        let driver_address =
            listener.local_addr().map_err(|e| Error::Cluster(e.to_string()))?.to_string();
        let mut req = Request::new(pb::RegisterJobRequest {
            request_id: tpuray_proto::new_request_id(),
            protocol_version: tpuray_proto::PROTOCOL_VERSION,
            driver_address,
            entrypoint: std::env::args().collect::<Vec<_>>().join(" "),
            namespace: opts.namespace.clone().unwrap_or_default(),
            driver_pid: std::process::id(),
            worker_binary_hash: hash,
            // A Jobs API entrypoint's driver: its supervisor names the job (AGENT-13).
            submission_id: std::env::var("TPURAY_SUBMISSION_ID").unwrap_or_default(),
        });
        req.set_timeout(Duration::from_secs(10));
        let job = head
            .register_job(req)
            .await
            .map_err(|s| cluster_err("registering the job", s))?
            .into_inner()
            .job
            .unwrap_or_default();
        Ok::<_, Error>((job.job_id, node, listener, remote))
    })?;
    let own = listener.local_addr().map_err(|e| Error::Cluster(e.to_string()))?.to_string();
    let worker_id = tpuray_proto::ids::WorkerId::random().to_string();
    let (store, node_id, store_address) = if remote {
        let (store, served) = rt.block_on(serve_private_store(&worker_id, &own, token.clone()))?;
        (store, format!("driver-{worker_id}"), served)
    } else {
        let store =
            LocalStore::join(&node.object_store_dir).map_err(|e| Error::Cluster(e.to_string()))?;
        (store, node.node_id.clone(), node.address.clone())
    };
    let mut core = Core::new(
        rt,
        job_id,
        worker_id,
        node_id,
        own,
        node.address.clone(),
        head_address,
        token.clone(),
        store,
        fail_on_infeasible,
    );
    core.store_address = store_address;
    let core = crate::core::install(Arc::new(core))?;
    // CORE-10: a driver acts on node deaths from the start.
    core.watch_nodes();
    let (exit_tx, _exit_rx) = tokio::sync::mpsc::channel(1);
    let svc = Arc::new(Svc {
        core: Arc::clone(core),
        executor: OnceLock::new(),
        actor_id: String::new(),
        exit: exit_tx,
    });
    core.rt.spawn(crate::service::serve(listener, svc, token, true, std::future::pending()));
    let flusher = Arc::clone(core);
    core.rt.spawn(async move {
        loop {
            tokio::time::sleep(Duration::from_millis(500)).await;
            flusher.flush_events().await;
            crate::metrics::flush(&flusher).await;
        }
    });
    Ok(())
}

/// Bytes of a private store (a driver on a host without a node): a quarter of the
/// host's available memory, at least 64 MiB.
fn private_store_bytes() -> u64 {
    (tpuray_objectstore::memory_bytes().1 / 4).max(64 << 20)
}

/// NET-3: a driver on a host without a node keeps its objects in a store of its own
/// (`/dev/shm/tpuray-driver-<worker id>`, removed at [`shutdown`], or swept once its
/// process is gone) and serves it to other nodes with the node agents'
/// `ObjectTransferService`, on this host's address. Returns the store and the
/// server's address.
async fn serve_private_store(
    worker_id: &str,
    own_address: &str,
    token: Option<String>,
) -> Result<(LocalStore, String), Error> {
    let root = std::path::Path::new(tpuray_objectstore::STORE_ROOT);
    let _ = tokio::task::spawn_blocking(move || tpuray_objectstore::sweep_stale_stores(root)).await;
    let dir = root.join(format!("{}driver-{worker_id}", tpuray_objectstore::STORE_PREFIX));
    let store = LocalStore::open_with(tpuray_objectstore::StoreConfig {
        dir: dir.clone(),
        capacity_bytes: Some(private_store_bytes()),
        spill_dir: None,
    })
    .map_err(|e| Error::Cluster(format!("the driver's object store at {}: {e}", dir.display())))?;
    let host = own_address.rsplit_once(':').map(|(h, _)| h).unwrap_or("127.0.0.1");
    let listener = tokio::net::TcpListener::bind((host, 0))
        .await
        .map_err(|e| Error::Cluster(format!("cannot listen on {host} for object pulls: {e}")))?;
    let served = listener.local_addr().map_err(|e| Error::Cluster(e.to_string()))?.to_string();
    let auth = tpuray_proto::auth::ServerAuth::new(token.as_deref().unwrap_or(""), token.is_some());
    let svc = tonic::service::interceptor::InterceptedService::new(
        pb::object_transfer_service_server::ObjectTransferServiceServer::new(
            tpuray_objectstore::transfer::ObjectsSvc { store: store.clone() },
        )
        .max_decoding_message_size(tpuray_proto::MAX_MESSAGE_BYTES)
        .max_encoding_message_size(tpuray_proto::MAX_MESSAGE_BYTES),
        auth,
    );
    let router = tonic::transport::Server::builder().tcp_nodelay(true).add_service(svc);
    // TLS-2: with TLS, served as every tpuray server is.
    match tpuray_proto::tls::current().map_err(Error::Cluster)? {
        None => {
            tokio::spawn(router.serve_with_incoming(tpuray_proto::incoming(listener)));
        }
        Some(t) => {
            tokio::spawn(router.serve_with_incoming(tpuray_proto::tls::incoming(
                listener,
                t,
                "driver's object store",
            )));
        }
    }
    Ok((store, served))
}

/// Finishes this job (non-detached actors end with it) after sending the
/// last task events and the placement group removals still in the background (PG-2).
pub fn shutdown() {
    let Some(core) = crate::core::try_core() else { return };
    // Counts of repeated worker lines still held print now, as Ray's disconnect does.
    crate::logs::flush();
    core.rt.block_on(async {
        crate::placement_group::flush_removals().await;
        core.flush_events().await;
        crate::metrics::flush(core).await;
        if let Ok(mut head) = tpuray_proto::client::head(&core.head_address, core.token.as_deref())
        {
            let mut req = Request::new(pb::FinishJobRequest {
                request_id: tpuray_proto::new_request_id(),
                job_id: core.job_id.clone(),
            });
            req.set_timeout(Duration::from_secs(5));
            let _ = head.finish_job(req).await;
        }
    });
    // The job is over: its subscription to the head ends too (CORE-10's watch).
    core.stop_watching_nodes();
    // A driver without a node serves a store of its own (NET-3): it goes with the job.
    if core.store_address != core.agent_address {
        core.store.destroy();
    }
    // CORE-14: the core stops for good; a later `init` starts a new one.
    crate::placement_group::forget_all();
    if let Some(core) = crate::core::uninstall() {
        core.release();
    }
}

fn status() -> Result<pb::GetClusterStatusReply, Error> {
    let core = crate::core::core()?;
    core.rt.block_on(async {
        let mut head = tpuray_proto::client::head(&core.head_address, core.token.as_deref())
            .map_err(|e| Error::Cluster(e.to_string()))?;
        head.get_cluster_status(pb::GetClusterStatusRequest {})
            .await
            .map(|r| r.into_inner())
            .map_err(|s| cluster_err("the head", s))
    })
}

/// Every node the head knows, alive or dead (`ray.nodes()`).
///
/// # Errors
/// [`Error::Cluster`] when not initialised or the head cannot be reached.
pub fn nodes() -> Result<Vec<NodeSummary>, Error> {
    Ok(status()?
        .nodes
        .into_iter()
        .map(|n| {
            let (host, port) = match n.address.rsplit_once(':') {
                Some((h, p)) => (h.to_string(), p.parse().unwrap_or(0)),
                None => (n.address.clone(), 0),
            };
            NodeSummary {
                alive: n.state == pb::NodeState::Alive as i32,
                node_id: n.node_id,
                address: host,
                resources: n.total.into_iter().collect(),
                labels: n.labels.into_iter().collect(),
                metrics_export_port: n.metrics_export_port,
                node_manager_port: port,
                hostname: n.hostname,
                death_reason: n.death_reason,
            }
        })
        .collect())
}

/// Total resources of the live nodes (`ray.cluster_resources()`).
///
/// # Errors
/// As [`nodes`].
pub fn cluster_resources() -> Result<BTreeMap<String, f64>, Error> {
    Ok(status()?.total.into_iter().collect())
}

/// Resources free right now on each live node, by node id (Ray's
/// `ray._private.state.available_resources_per_node()`).
///
/// # Errors
/// As [`nodes`].
pub fn available_resources_per_node() -> Result<BTreeMap<String, BTreeMap<String, f64>>, Error> {
    Ok(status()?
        .nodes
        .into_iter()
        .filter(|n| n.state == pb::NodeState::Alive as i32)
        .map(|n| (n.node_id, n.available.into_iter().collect()))
        .collect())
}

/// Resources free right now (`ray.available_resources()`).
///
/// # Errors
/// As [`nodes`].
pub fn available_resources() -> Result<BTreeMap<String, f64>, Error> {
    Ok(status()?.available.into_iter().collect())
}
