//! The driver side of the SDK: `tpuray::init` joins a cluster as a job (the
//! head records it), and the handle reads the cluster's nodes and resources
//! the way Ray's `ray.nodes()` / `ray.cluster_resources()` do.
//!
//! Blocking: every method blocks the calling thread on the SDK's own runtime;
//! never call them from inside another tokio runtime's async context.

use std::collections::BTreeMap;
use std::time::Duration;

use tonic::Request;
use tpuray_proto::pb;

/// Errors joining or reading a cluster.
#[derive(Debug, thiserror::Error)]
pub enum InitError {
    #[error(
        "no cluster address: pass one to init(), set TPURAY_ADDRESS, or start a cluster with `tpuray start --head`"
    )]
    NoAddress,
    #[error("invalid cluster address {0:?}: {1}")]
    BadAddress(String, String),
    #[error("cannot read the cluster token: {0}")]
    Token(String),
    #[error("the head at {address} answered: {detail}")]
    Head { address: String, detail: String },
    #[error("cannot start the SDK runtime: {0}")]
    Runtime(String),
}

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
}

/// A connection to a cluster, registered as one job.
pub struct Cluster {
    rt: tokio::runtime::Runtime,
    address: String,
    token: Option<String>,
    job_id: String,
}

/// Joins the cluster at `address` (`host:port[,...]`), or at
/// `TPURAY_ADDRESS`, or the one `tpuray start --head` left on this machine.
///
/// # Errors
/// [`InitError`] naming the missing address, bad token or head refusal.
pub fn init(address: Option<&str>) -> Result<Cluster, InitError> {
    let address = match address.map(str::to_string).or_else(|| std::env::var("TPURAY_ADDRESS").ok())
    {
        Some(a) if !a.is_empty() => a,
        _ => current_cluster_address().ok_or(InitError::NoAddress)?,
    };
    let token = tpuray_proto::auth::load_token().map_err(|e| InitError::Token(e.to_string()))?;
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .map_err(|e| InitError::Runtime(e.to_string()))?;
    let first = address.split(',').next().unwrap_or_default().to_string();
    let job_id = rt.block_on(async {
        let mut head = tpuray_proto::client::head(&first, token.as_deref())
            .map_err(|e| InitError::BadAddress(first.clone(), e.to_string()))?;
        let mut req = Request::new(pb::RegisterJobRequest {
            request_id: tpuray_proto::new_request_id(),
            protocol_version: tpuray_proto::PROTOCOL_VERSION,
            driver_address: String::new(),
            entrypoint: std::env::args().collect::<Vec<_>>().join(" "),
            namespace: String::new(),
            driver_pid: std::process::id(),
        });
        req.set_timeout(Duration::from_secs(10));
        let reply = head.register_job(req).await.map_err(|s| InitError::Head {
            address: first.clone(),
            detail: s.message().to_string(),
        })?;
        Ok::<_, InitError>(reply.into_inner().job.map(|j| j.job_id).unwrap_or_default())
    })?;
    Ok(Cluster { rt, address: first, token, job_id })
}

fn current_cluster_address() -> Option<String> {
    let dir = std::env::var_os("TPURAY_REGISTRY_DIR")
        .map(std::path::PathBuf::from)
        .unwrap_or_else(|| std::path::PathBuf::from("/tmp/tpuray/registry"));
    let b = std::fs::read(dir.join("current_cluster.json")).ok()?;
    let v: serde_json::Value = serde_json::from_slice(&b).ok()?;
    v.get("address")?.as_str().map(str::to_string)
}

impl Cluster {
    /// This driver's job id.
    pub fn job_id(&self) -> &str {
        &self.job_id
    }

    fn status(&self) -> Result<pb::GetClusterStatusReply, InitError> {
        self.rt.block_on(async {
            let mut head = tpuray_proto::client::head(&self.address, self.token.as_deref())
                .map_err(|e| InitError::BadAddress(self.address.clone(), e.to_string()))?;
            head.get_cluster_status(pb::GetClusterStatusRequest {})
                .await
                .map(|r| r.into_inner())
                .map_err(|s| InitError::Head {
                    address: self.address.clone(),
                    detail: s.message().to_string(),
                })
        })
    }

    /// Every node the head knows, alive or dead.
    ///
    /// # Errors
    /// [`InitError::Head`] when the head cannot be reached.
    pub fn nodes(&self) -> Result<Vec<NodeSummary>, InitError> {
        Ok(self
            .status()?
            .nodes
            .into_iter()
            .map(|n| NodeSummary {
                alive: n.state == pb::NodeState::Alive as i32,
                node_id: n.node_id,
                address: n
                    .address
                    .rsplit_once(':')
                    .map(|(h, _)| h.to_string())
                    .unwrap_or(n.address),
                resources: n.total.into_iter().collect(),
                labels: n.labels.into_iter().collect(),
            })
            .collect())
    }

    /// Total resources of the live nodes (`ray.cluster_resources()`).
    ///
    /// # Errors
    /// [`InitError::Head`] when the head cannot be reached.
    pub fn cluster_resources(&self) -> Result<BTreeMap<String, f64>, InitError> {
        Ok(self.status()?.total.into_iter().collect())
    }

    /// Resources free right now (`ray.available_resources()`).
    ///
    /// # Errors
    /// [`InitError::Head`] when the head cannot be reached.
    pub fn available_resources(&self) -> Result<BTreeMap<String, f64>, InitError> {
        Ok(self.status()?.available.into_iter().collect())
    }

    /// Marks this job finished (non-detached actors end with it).
    pub fn shutdown(self) {
        let Cluster { rt, address, token, job_id } = self;
        rt.block_on(async {
            if let Ok(mut head) = tpuray_proto::client::head(&address, token.as_deref()) {
                let mut req = Request::new(pb::FinishJobRequest {
                    request_id: tpuray_proto::new_request_id(),
                    job_id,
                });
                req.set_timeout(Duration::from_secs(5));
                let _ = head.finish_job(req).await;
            }
        });
    }
}
