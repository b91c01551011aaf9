//! `tpuray k8s manifests`: the Kubernetes (GKE) objects of one tpuray cluster, built as
//! typed `k8s-openapi` structs (API version 1.34) and printed as YAML on stdout.
//!
//! What is rendered (DESIGN.md §13, issue 31):
//! - the head: a headless Service (`publishNotReadyAddresses`, so replicas find each
//!   other before they are ready), a StatefulSet of 1 or 3 with a PVC each for
//!   `--head-data-dir`, a PodDisruptionBudget, probes on the head's token-free `/readyz`
//!   (joined the Raft group and caught up) and `/healthz` (the process answers);
//! - CPU workers: a Deployment of node agents;
//! - per slice: a headless Service and a StatefulSet whose replicas are the hosts of the
//!   slice's topology (`podManagementPolicy: Parallel`, never scaled: a slice is created
//!   or deleted whole), `google.com/tpu` = chips per host, GKE's TPU node selectors and
//!   toleration, affinity that keeps one slice in one node pool and other slices out, the
//!   `TPU_*` environment of TPU.md, and the ports libtpu, JAX and Megascale use.
//!
//! Slice shapes come from the scheduler's TPU model ([`tpuray_scheduler::tpu`]); nothing
//! about TPUs is decided here except GKE's names for the generations.
//! Pure: nothing here touches the network; [`render`] returns the YAML text.
//!
//! Built with `k8s-openapi` (feature `v1_34` only) and printed with `serde_yaml_ng`;
//! GKE's accelerator label values are its only TPU table. The rendered examples in
//! `deploy/k8s/examples/` are checked by `tests/tests/k8s.rs`.

use std::collections::BTreeMap;

use anyhow::{Result, anyhow, bail};
use k8s_openapi::api::apps::v1::{Deployment, DeploymentSpec, StatefulSet, StatefulSetSpec};
use k8s_openapi::api::core::v1::{
    Affinity, Container, ContainerPort, EmptyDirVolumeSource, EnvVar, EnvVarSource, HTTPGetAction,
    ObjectFieldSelector, PersistentVolumeClaim, PersistentVolumeClaimSpec, Pod, PodAffinity,
    PodAffinityTerm, PodAntiAffinity, PodSpec, PodTemplateSpec, Probe, ResourceRequirements,
    SecretKeySelector, Service, ServicePort, ServiceSpec, Toleration, Volume, VolumeMount,
    VolumeResourceRequirements,
};
use k8s_openapi::api::policy::v1::{PodDisruptionBudget, PodDisruptionBudgetSpec};
use k8s_openapi::apimachinery::pkg::api::resource::Quantity;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{
    LabelSelector, LabelSelectorRequirement, ObjectMeta,
};
use k8s_openapi::apimachinery::pkg::util::intstr::IntOrString;
use tpuray_scheduler::tpu::{AcceleratorType, TpuGeneration};

/// The Kubernetes version the objects are built for (k8s-openapi's `v1_34` feature) and
/// the examples are validated against (`kubernetes-validate -k 1.34.0 --strict`).
pub const KUBERNETES_VERSION: &str = "1.34.0";

/// The head's gRPC port (Ray's 6379, `tpuray start --head`'s default).
pub const HEAD_PORT: i32 = 6379;
/// The head's HTTP port: dashboard, Jobs API, `/healthz`, `/readyz` (DESIGN.md §13).
pub const DASHBOARD_PORT: i32 = 8265;
/// The node agents' gRPC port (`--node-manager-port`), pinned so pods declare it.
pub const AGENT_PORT: i32 = 6380;
/// The node agents' `/metrics`, `/healthz` and `/readyz` (`--metrics-export-port`; the
/// manifests pin 8080, DESIGN.md §13).
pub const METRICS_PORT: i32 = 8080;
/// libtpu's port between the TPU VMs of a slice (GKE's multi-host TPU examples declare
/// `containerPort: 8471`).
pub const TPU_RUNTIME_PORT: i32 = 8471;
/// The TPU runtime's metrics port (GKE's examples declare 8431).
pub const TPU_METRICS_PORT: i32 = 8431;
/// JAX's coordinator port on TPU clusters (`jax/_src/clusters/cloud_tpu_cluster.py`:
/// worker 0's address, port 8476).
pub const JAX_COORDINATOR_PORT: i32 = 8476;
/// Megascale's port for multislice (`MEGASCALE_PORT`, TPU.md).
pub const MEGASCALE_PORT: i32 = 8081;
/// How long a draining node agent lets running tasks finish (`--drain-grace-period`,
/// the agent's default); the pods' `terminationGracePeriodSeconds` is this plus
/// [`TERMINATION_MARGIN_S`], so Kubernetes never SIGKILLs a drain that keeps its promise.
pub const DRAIN_GRACE_S: i64 = 25;
/// What the agent needs after its grace period: stop its workers (3 s) and tell the head.
pub const TERMINATION_MARGIN_S: i64 = 5;
/// The Secret (key `token`) every pod reads `TPURAY_AUTH_TOKEN` from: `<name>-auth-token`.
pub const TOKEN_SECRET_KEY: &str = "token";
/// The PVC size of each head's `--head-data-dir`.
pub const HEAD_DATA_SIZE: &str = "10Gi";
/// A CPU worker pod's size, advertised to tpuray as `--num-cpus` and `--memory`.
pub const CPU_WORKER_CPUS: u32 = 4;
pub const CPU_WORKER_MEMORY_GIB: u64 = 16;
/// A CPU worker's object store (`--object-store-memory`), inside its pod memory.
pub const CPU_WORKER_STORE_GIB: u64 = 4;

/// What `tpuray k8s manifests` was asked for.
#[derive(Clone, Debug)]
pub struct ClusterSpec {
    /// `--name`: the prefix of every object (a DNS-1035 label).
    pub name: String,
    /// `--namespace`.
    pub namespace: String,
    /// `--image`: the image with `tpuray` on PATH (the Dockerfile's).
    pub image: String,
    /// `--heads`: 1 or 3.
    pub heads: u32,
    /// `--cpu-workers`.
    pub cpu_workers: u32,
    /// `--slice TYPE:COUNT`, in order.
    pub slices: Vec<(AcceleratorType, u32)>,
    /// `--multislice`: every slice is one Megascale job (`MEGASCALE_*`).
    pub multislice: bool,
}

/// GKE's `cloud.google.com/gke-tpu-accelerator` value for a generation (GKE's TPU docs).
///
/// # Errors
/// v7x: no GKE node selector value is known to this build, so it is refused by name.
pub fn gke_accelerator(g: TpuGeneration) -> Result<&'static str> {
    Ok(match g {
        TpuGeneration::V4 => "tpu-v4-podslice",
        TpuGeneration::V5p => "tpu-v5p-slice",
        TpuGeneration::V5e => "tpu-v5-lite-podslice",
        TpuGeneration::V6e => "tpu-v6e-slice",
        TpuGeneration::V7x => bail!(
            "--slice: {g} has no GKE node selector known to tpuray (expected v4, v5p, v5litepod/v5e or v6e)"
        ),
    })
}

/// Parses one `--slice ACCELERATOR_TYPE:COUNT` (`v6e-16:2`: two slices of v6e-16;
/// `:COUNT` may be left out for one). The type is spelled as TPU.md writes it
/// (`v6e-16`, `v5litepod-8`, `v4-32`, `v5p-16`; `v5e-N` is an alias of `v5litepod-N`).
///
/// # Errors
/// Naming the value at fault: an unknown accelerator type, a chip count that is no slice
/// size of its generation (no valid topology has it, TPU.md), a count that is not a
/// positive integer, a generation GKE has no selector for here.
pub fn parse_slice(s: &str) -> Result<(AcceleratorType, u32)> {
    let (ty, count) = match s.rsplit_once(':') {
        Some((t, c)) => (t.trim(), Some(c.trim())),
        None => (s.trim(), None),
    };
    let accel = AcceleratorType::parse(ty).map_err(|e| anyhow!("--slice {s:?}: {e}"))?;
    let Some(topology) = accel.default_topology() else {
        bail!(
            "--slice {s:?}: {ty:?} is not a slice size of {} ({} chips has no valid topology; \
             expected e.g. {})",
            accel.generation,
            accel.chips,
            examples_of(accel.generation)
        );
    };
    accel.check_topology(&topology).map_err(|e| anyhow!("--slice {s:?}: {e}"))?;
    gke_accelerator(accel.generation)?;
    let count = match count {
        None => 1,
        Some(c) => match c.parse::<u32>() {
            Ok(n) if n > 0 => n,
            _ => bail!("--slice {s:?}: count {c:?} is not a positive number of slices"),
        },
    };
    Ok((accel, count))
}

fn examples_of(g: TpuGeneration) -> String {
    let chips: &[u32] = if g.is_2d() { &[4, 8, 16, 32] } else { &[8, 16, 32, 64] };
    chips
        .iter()
        .map(|&c| AcceleratorType { generation: g, chips: c }.to_string())
        .collect::<Vec<_>>()
        .join(", ")
}

/// One slice as rendered: its StatefulSet (and Service) name, type and index.
struct SliceShape {
    /// `TPU_NAME`, the StatefulSet and headless Service name: `<name>-<type>-<i>`.
    name: String,
    accel: AcceleratorType,
}

fn check_name(what: &str, v: &str, max: usize) -> Result<()> {
    let ok = !v.is_empty()
        && v.len() <= max
        && v.starts_with(|c: char| c.is_ascii_lowercase())
        && !v.ends_with('-')
        && v.chars().all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || c == '-');
    if !ok {
        bail!(
            "{what} {v:?} is not a DNS label (expected at most {max} lowercase letters, digits \
             and '-', starting with a letter)"
        );
    }
    Ok(())
}

impl ClusterSpec {
    fn check(&self) -> Result<()> {
        // Pod names add `-<ordinal>` and a StatefulSet's controller-revision label a hash
        // to the set's name; 40 leaves room for `-<type>-<i>` within 63.
        check_name("--name", &self.name, 40)?;
        check_name("--namespace", &self.namespace, 63)?;
        if self.image.trim().is_empty() {
            bail!("--image is empty (expected an image reference such as registry/tpuray:0.1.0)");
        }
        if self.heads != 1 && self.heads != 3 {
            bail!("--heads {}: expected 1 or 3 (a Raft group tolerating 0 or 1 loss)", self.heads);
        }
        if self.multislice {
            let n: u32 = self.slices.iter().map(|(_, c)| c).sum();
            if n < 2 {
                bail!("--multislice needs at least 2 slices (got {n}: give --slice TYPE:COUNT)");
            }
            let types: std::collections::BTreeSet<String> =
                self.slices.iter().map(|(a, _)| a.to_string()).collect();
            if types.len() > 1 {
                bail!(
                    "--multislice: every slice of a Megascale job has one accelerator type \
                     (got {})",
                    types.into_iter().collect::<Vec<_>>().join(", ")
                );
            }
        }
        Ok(())
    }

    fn slice_shapes(&self) -> Vec<SliceShape> {
        let mut out = Vec::new();
        let mut seen: BTreeMap<String, u32> = BTreeMap::new();
        for (accel, count) in &self.slices {
            for _ in 0..*count {
                let ty = accel.to_string();
                let i = seen.entry(ty.clone()).or_default();
                out.push(SliceShape { name: format!("{}-{ty}-{i}", self.name), accel: *accel });
                *i += 1;
            }
        }
        out
    }

    fn head_name(&self) -> String {
        format!("{}-head", self.name)
    }

    /// Every head's address as agents and peers use it:
    /// `<name>-head-<i>.<name>-head.<namespace>.svc:6379`, comma-separated.
    fn head_addresses(&self) -> String {
        let h = self.head_name();
        (0..self.heads)
            .map(|i| format!("{h}-{i}.{h}.{}.svc:{HEAD_PORT}", self.namespace))
            .collect::<Vec<_>>()
            .join(",")
    }

    fn labels(&self, component: &str) -> BTreeMap<String, String> {
        BTreeMap::from([
            ("app.kubernetes.io/name".to_string(), "tpuray".to_string()),
            ("app.kubernetes.io/instance".to_string(), self.name.clone()),
            ("app.kubernetes.io/component".to_string(), component.to_string()),
        ])
    }

    fn meta(&self, name: &str, labels: &BTreeMap<String, String>) -> ObjectMeta {
        ObjectMeta {
            name: Some(name.to_string()),
            namespace: Some(self.namespace.clone()),
            labels: Some(labels.clone()),
            ..Default::default()
        }
    }
}

fn env(name: &str, value: impl Into<String>) -> EnvVar {
    EnvVar { name: name.into(), value: Some(value.into()), ..Default::default() }
}

fn env_field(name: &str, path: &str) -> EnvVar {
    EnvVar {
        name: name.into(),
        value_from: Some(EnvVarSource {
            field_ref: Some(ObjectFieldSelector { field_path: path.into(), ..Default::default() }),
            ..Default::default()
        }),
        ..Default::default()
    }
}

fn port(name: &str, p: i32) -> ContainerPort {
    ContainerPort { name: Some(name.into()), container_port: p, ..Default::default() }
}

fn http_probe(path: &str, port: i32, period: i32, failures: i32) -> Probe {
    Probe {
        http_get: Some(HTTPGetAction {
            path: Some(path.into()),
            port: IntOrString::Int(port),
            ..Default::default()
        }),
        period_seconds: Some(period),
        failure_threshold: Some(failures),
        timeout_seconds: Some(5),
        ..Default::default()
    }
}

fn quantities(pairs: &[(&str, String)]) -> BTreeMap<String, Quantity> {
    pairs.iter().map(|(k, v)| (k.to_string(), Quantity(v.clone()))).collect()
}

fn selector(labels: &BTreeMap<String, String>) -> LabelSelector {
    LabelSelector { match_labels: Some(labels.clone()), ..Default::default() }
}

/// Environment every tpuray pod gets: its address (`POD_IP`, which `tpuray start` takes
/// as its node address) and the cluster token from the Secret `<name>-auth-token`.
fn common_env(spec: &ClusterSpec) -> Vec<EnvVar> {
    vec![
        env_field("POD_IP", "status.podIP"),
        EnvVar {
            name: "TPURAY_AUTH_TOKEN".into(),
            value_from: Some(EnvVarSource {
                secret_key_ref: Some(SecretKeySelector {
                    name: format!("{}-auth-token", spec.name),
                    key: TOKEN_SECRET_KEY.into(),
                    optional: Some(false),
                }),
                ..Default::default()
            }),
            ..Default::default()
        },
    ]
}

/// `/dev/shm` as memory: the object store lives there and a container's default is 64 MiB.
fn shm_volume(limit: Option<String>) -> (Volume, VolumeMount) {
    (
        Volume {
            name: "dshm".into(),
            empty_dir: Some(EmptyDirVolumeSource {
                medium: Some("Memory".into()),
                size_limit: limit.map(Quantity),
            }),
            ..Default::default()
        },
        VolumeMount { name: "dshm".into(), mount_path: "/dev/shm".into(), ..Default::default() },
    )
}

/// `tpuray start --address HEADS --block ...` of a node agent pod. Pods give their
/// command as `args`, so the image's entrypoint (the Dockerfile's `tini`, which forwards
/// SIGTERM and reaps orphans as PID 1) runs it.
fn agent_command(spec: &ClusterSpec, extra: &[String]) -> Vec<String> {
    let mut c: Vec<String> = [
        "tpuray",
        "start",
        "--block",
        "--address",
        &spec.head_addresses(),
        "--node-manager-port",
        &AGENT_PORT.to_string(),
        "--metrics-export-port",
        &METRICS_PORT.to_string(),
        "--drain-grace-period",
        &DRAIN_GRACE_S.to_string(),
    ]
    .iter()
    .map(|s| s.to_string())
    .collect();
    c.extend(extra.iter().cloned());
    c
}

fn agent_probes(c: &mut Container) {
    c.readiness_probe = Some(http_probe("/readyz", METRICS_PORT, 5, 3));
    c.liveness_probe = Some(http_probe("/healthz", METRICS_PORT, 10, 6));
}

fn head_objects(spec: &ClusterSpec) -> (Service, StatefulSet, PodDisruptionBudget) {
    let name = spec.head_name();
    let labels = spec.labels("head");
    let service = Service {
        metadata: spec.meta(&name, &labels),
        spec: Some(ServiceSpec {
            cluster_ip: Some("None".into()),
            // Replicas must reach each other to elect a leader before any is ready.
            publish_not_ready_addresses: Some(true),
            selector: Some(labels.clone()),
            ports: Some(vec![
                ServicePort { name: Some("gcs".into()), port: HEAD_PORT, ..Default::default() },
                ServicePort {
                    name: Some("dashboard".into()),
                    port: DASHBOARD_PORT,
                    ..Default::default()
                },
            ]),
            ..Default::default()
        }),
        ..Default::default()
    };
    let mut command: Vec<String> = [
        "tpuray",
        "start",
        "--head",
        "--head-only",
        "--block",
        "--port",
        &HEAD_PORT.to_string(),
        "--dashboard-port",
        &DASHBOARD_PORT.to_string(),
        "--dashboard-host",
        "0.0.0.0",
        "--head-data-dir",
        "/data/head",
    ]
    .iter()
    .map(|s| s.to_string())
    .collect();
    if spec.heads > 1 {
        // Each replica finds its --head-id as the entry whose host starts with its
        // HOSTNAME (the pod name).
        command.extend(["--head-peers".to_string(), spec.head_addresses()]);
    }
    let container = Container {
        name: "head".into(),
        image: Some(spec.image.clone()),
        args: Some(command),
        env: Some(common_env(spec)),
        ports: Some(vec![port("gcs", HEAD_PORT), port("dashboard", DASHBOARD_PORT)]),
        readiness_probe: Some(http_probe("/readyz", DASHBOARD_PORT, 5, 3)),
        liveness_probe: Some(http_probe("/healthz", DASHBOARD_PORT, 10, 6)),
        resources: Some(ResourceRequirements {
            requests: Some(quantities(&[("cpu", "1".into()), ("memory", "2Gi".into())])),
            limits: Some(quantities(&[("memory", "4Gi".into())])),
            ..Default::default()
        }),
        volume_mounts: Some(vec![VolumeMount {
            name: "data".into(),
            mount_path: "/data".into(),
            ..Default::default()
        }]),
        ..Default::default()
    };
    let claim = PersistentVolumeClaim {
        metadata: ObjectMeta { name: Some("data".into()), ..Default::default() },
        spec: Some(PersistentVolumeClaimSpec {
            access_modes: Some(vec!["ReadWriteOnce".into()]),
            resources: Some(VolumeResourceRequirements {
                requests: Some(quantities(&[("storage", HEAD_DATA_SIZE.into())])),
                ..Default::default()
            }),
            ..Default::default()
        }),
        ..Default::default()
    };
    let set = StatefulSet {
        metadata: spec.meta(&name, &labels),
        spec: Some(StatefulSetSpec {
            replicas: Some(spec.heads as i32),
            service_name: Some(name.clone()),
            // Replicas start together: a majority must be up before any serves.
            pod_management_policy: Some("Parallel".into()),
            selector: selector(&labels),
            template: PodTemplateSpec {
                metadata: Some(ObjectMeta { labels: Some(labels.clone()), ..Default::default() }),
                spec: Some(PodSpec {
                    containers: vec![container],
                    termination_grace_period_seconds: Some(DRAIN_GRACE_S + TERMINATION_MARGIN_S),
                    ..Default::default()
                }),
            },
            volume_claim_templates: Some(vec![claim]),
            ..Default::default()
        }),
        ..Default::default()
    };
    // A lone head must not be evicted voluntarily; three keep their majority.
    let min_available = if spec.heads == 3 { 2 } else { 1 };
    let pdb = PodDisruptionBudget {
        metadata: spec.meta(&name, &labels),
        spec: Some(PodDisruptionBudgetSpec {
            min_available: Some(IntOrString::Int(min_available)),
            selector: Some(selector(&labels)),
            ..Default::default()
        }),
        ..Default::default()
    };
    (service, set, pdb)
}

fn cpu_workers(spec: &ClusterSpec) -> Deployment {
    let name = format!("{}-cpu-worker", spec.name);
    let labels = spec.labels("cpu-worker");
    Deployment {
        metadata: spec.meta(&name, &labels),
        spec: Some(DeploymentSpec {
            replicas: Some(spec.cpu_workers as i32),
            selector: selector(&labels),
            template: cpu_worker_template(spec, &labels, CPU_WORKER_CPUS, &[]),
            ..Default::default()
        }),
        ..Default::default()
    }
}

/// The pod of one CPU worker: a node agent with `cpus` CPUs (`--num-cpus`, and the pod's
/// request), the manifests' memory and object store, and `extra` agent flags.
fn cpu_worker_template(
    spec: &ClusterSpec,
    labels: &BTreeMap<String, String>,
    cpus: u32,
    extra: &[String],
) -> PodTemplateSpec {
    let gib = 1u64 << 30;
    let (shm, shm_mount) = shm_volume(Some(format!("{CPU_WORKER_STORE_GIB}Gi")));
    let mut args = vec![
        "--num-cpus".into(),
        cpus.to_string(),
        "--memory".into(),
        ((CPU_WORKER_MEMORY_GIB - CPU_WORKER_STORE_GIB) * gib).to_string(),
        "--object-store-memory".into(),
        (CPU_WORKER_STORE_GIB * gib).to_string(),
    ];
    args.extend(extra.iter().cloned());
    let mut container = Container {
        name: "agent".into(),
        image: Some(spec.image.clone()),
        args: Some(agent_command(spec, &args)),
        env: Some(common_env(spec)),
        ports: Some(vec![port("agent", AGENT_PORT), port("metrics", METRICS_PORT)]),
        resources: Some(ResourceRequirements {
            requests: Some(quantities(&[
                ("cpu", cpus.to_string()),
                ("memory", format!("{CPU_WORKER_MEMORY_GIB}Gi")),
            ])),
            limits: Some(quantities(&[("memory", format!("{CPU_WORKER_MEMORY_GIB}Gi"))])),
            ..Default::default()
        }),
        volume_mounts: Some(vec![shm_mount]),
        ..Default::default()
    };
    agent_probes(&mut container);
    PodTemplateSpec {
        metadata: Some(ObjectMeta { labels: Some(labels.clone()), ..Default::default() }),
        spec: Some(PodSpec {
            containers: vec![container],
            volumes: Some(vec![shm]),
            termination_grace_period_seconds: Some(DRAIN_GRACE_S + TERMINATION_MARGIN_S),
            ..Default::default()
        }),
    }
}

/// The objects of one autoscaled instance (the autoscaler's `kubernetes` provider),
/// built by the same code as `tpuray k8s manifests`: a CPU worker is one Pod named
/// `instance` with the CPU workers' pod template; a slice (`accel`) is its headless
/// Service and StatefulSet named `instance` (its hosts, `podManagementPolicy: Parallel`).
/// Every pod carries `labels` (Kubernetes labels, for listing) and passes
/// `agent_args` (`--labels`, `--resources` of the node type) to its node agent.
///
/// # Errors
/// A name that is not a DNS-1035 label of at most 52 characters (a StatefulSet pod's
/// name adds `-<index>`), a generation GKE has no node selector for.
pub fn autoscaled_objects(
    spec: &ClusterSpec,
    instance: &str,
    accel: Option<AcceleratorType>,
    cpus: u32,
    labels: &BTreeMap<String, String>,
    agent_args: &[String],
) -> Result<AutoscaledObjects> {
    check_name("the instance name", instance, 52)?;
    match accel {
        None => {
            let mut all = spec.labels("cpu-worker");
            all.extend(labels.clone());
            let t = cpu_worker_template(spec, &all, cpus, agent_args);
            let pod =
                Pod { metadata: spec.meta(instance, &all), spec: t.spec, ..Default::default() };
            Ok(AutoscaledObjects::Worker(Box::new(pod)))
        }
        Some(accel) => {
            let shape = SliceShape { name: instance.to_string(), accel };
            let (mut svc, mut set) =
                slice_objects(spec, &shape, 0, std::slice::from_ref(&shape), agent_args)?;
            for meta in [&mut svc.metadata, &mut set.metadata] {
                meta.labels.get_or_insert_default().extend(labels.clone());
            }
            if let Some(s) = set.spec.as_mut()
                && let Some(m) = s.template.metadata.as_mut()
            {
                m.labels.get_or_insert_default().extend(labels.clone());
            }
            Ok(AutoscaledObjects::Slice(Box::new((svc, set))))
        }
    }
}

/// What [`autoscaled_objects`] builds.
#[derive(Clone, Debug)]
pub enum AutoscaledObjects {
    Worker(Box<Pod>),
    Slice(Box<(Service, StatefulSet)>),
}

impl ClusterSpec {
    /// The spec the autoscaler's `kubernetes` provider builds objects from: the cluster
    /// `tpuray k8s manifests --name NAME --namespace NS --image IMAGE` rendered (one head).
    pub fn for_autoscaler(name: &str, namespace: &str, image: &str) -> ClusterSpec {
        ClusterSpec {
            name: name.to_string(),
            namespace: namespace.to_string(),
            image: image.to_string(),
            heads: 1,
            cpu_workers: 0,
            slices: Vec::new(),
            multislice: false,
        }
    }
}

/// The label every pod of a slice carries, `tpuray.io/slice: <slice name>`.
const SLICE_LABEL: &str = "tpuray.io/slice";
/// GKE's node pool label: one multi-host TPU node pool is one slice.
const NODE_POOL_KEY: &str = "cloud.google.com/gke-nodepool";

fn slice_objects(
    spec: &ClusterSpec,
    slice: &SliceShape,
    index: usize,
    all: &[SliceShape],
    agent_args: &[String],
) -> Result<(Service, StatefulSet)> {
    let accel = slice.accel;
    let topology = accel.default_topology().ok_or_else(|| anyhow!("{accel}: no topology"))?;
    let hosts = accel.hosts();
    let chips = accel.chips_per_host();
    let name = &slice.name;
    let mut labels = spec.labels("tpu-slice");
    labels.insert(SLICE_LABEL.into(), name.clone());
    let hostnames: Vec<String> =
        (0..hosts).map(|i| format!("{name}-{i}.{name}.{}.svc", spec.namespace)).collect();
    let service = Service {
        metadata: spec.meta(name, &labels),
        spec: Some(ServiceSpec {
            cluster_ip: Some("None".into()),
            // libtpu resolves every host of the slice before any is ready.
            publish_not_ready_addresses: Some(true),
            selector: Some(labels.clone()),
            ports: Some(vec![
                ServicePort {
                    name: Some("tpu-runtime".into()),
                    port: TPU_RUNTIME_PORT,
                    ..Default::default()
                },
                ServicePort {
                    name: Some("jax-coord".into()),
                    port: JAX_COORDINATOR_PORT,
                    ..Default::default()
                },
            ]),
            ..Default::default()
        }),
        ..Default::default()
    };
    let mut envs = common_env(spec);
    envs.extend([
        env("TPU_ACCELERATOR_TYPE", accel.to_string()),
        env("TPU_TOPOLOGY", topology.to_string()),
        env("TPU_NAME", name.clone()),
        env("TPU_WORKER_HOSTNAMES", hostnames.join(",")),
        // The StatefulSet's pod-index label (Kubernetes >= 1.28): 0..hosts-1.
        env_field("TPU_WORKER_ID", "metadata.labels['apps.kubernetes.io/pod-index']"),
    ]);
    if spec.multislice {
        let first = &all[0].name;
        envs.extend([
            env(
                "MEGASCALE_COORDINATOR_ADDRESS",
                format!("{first}-0.{first}.{}.svc", spec.namespace),
            ),
            env("MEGASCALE_PORT", MEGASCALE_PORT.to_string()),
            env("MEGASCALE_NUM_SLICES", all.len().to_string()),
            env("MEGASCALE_SLICE_ID", index.to_string()),
        ]);
    }
    let mut ports = vec![
        port("agent", AGENT_PORT),
        port("metrics", METRICS_PORT),
        port("tpu-runtime", TPU_RUNTIME_PORT),
        port("tpu-metrics", TPU_METRICS_PORT),
        port("jax-coord", JAX_COORDINATOR_PORT),
    ];
    if spec.multislice {
        ports.push(port("megascale", MEGASCALE_PORT));
    }
    let tpu = quantities(&[("google.com/tpu", chips.to_string())]);
    let (shm, shm_mount) = shm_volume(None);
    let mut container = Container {
        name: "agent".into(),
        image: Some(spec.image.clone()),
        args: Some(agent_command(spec, agent_args)),
        env: Some(envs),
        ports: Some(ports),
        resources: Some(ResourceRequirements {
            requests: Some(tpu.clone()),
            limits: Some(tpu),
            ..Default::default()
        }),
        volume_mounts: Some(vec![shm_mount]),
        ..Default::default()
    };
    agent_probes(&mut container);
    let same_slice = LabelSelector {
        match_labels: Some(BTreeMap::from([(SLICE_LABEL.to_string(), name.clone())])),
        ..Default::default()
    };
    let other_slices = LabelSelector {
        match_expressions: Some(vec![
            LabelSelectorRequirement {
                key: SLICE_LABEL.into(),
                operator: "Exists".into(),
                values: None,
            },
            LabelSelectorRequirement {
                key: SLICE_LABEL.into(),
                operator: "NotIn".into(),
                values: Some(vec![name.clone()]),
            },
        ]),
        ..Default::default()
    };
    let affinity = Affinity {
        // Every host of this slice in one node pool (a GKE multi-host TPU node pool is one
        // slice, its ICI links inside it) ...
        pod_affinity: Some(PodAffinity {
            required_during_scheduling_ignored_during_execution: Some(vec![PodAffinityTerm {
                label_selector: Some(same_slice),
                topology_key: NODE_POOL_KEY.into(),
                ..Default::default()
            }]),
            ..Default::default()
        }),
        // ... and no host of another slice there.
        pod_anti_affinity: Some(PodAntiAffinity {
            required_during_scheduling_ignored_during_execution: Some(vec![PodAffinityTerm {
                label_selector: Some(other_slices),
                topology_key: NODE_POOL_KEY.into(),
                ..Default::default()
            }]),
            ..Default::default()
        }),
        ..Default::default()
    };
    let node_selector = BTreeMap::from([
        (
            "cloud.google.com/gke-tpu-accelerator".to_string(),
            gke_accelerator(accel.generation)?.to_string(),
        ),
        ("cloud.google.com/gke-tpu-topology".to_string(), topology.to_string()),
    ]);
    let set = StatefulSet {
        metadata: spec.meta(name, &labels),
        spec: Some(StatefulSetSpec {
            // The hosts of the topology, never scaled: a slice is created or deleted whole.
            replicas: Some(hosts as i32),
            service_name: Some(name.clone()),
            pod_management_policy: Some("Parallel".into()),
            selector: selector(&labels),
            template: PodTemplateSpec {
                metadata: Some(ObjectMeta { labels: Some(labels.clone()), ..Default::default() }),
                spec: Some(PodSpec {
                    containers: vec![container],
                    node_selector: Some(node_selector),
                    tolerations: Some(vec![Toleration {
                        key: Some("google.com/tpu".into()),
                        operator: Some("Exists".into()),
                        effect: Some("NoSchedule".into()),
                        ..Default::default()
                    }]),
                    affinity: Some(affinity),
                    volumes: Some(vec![shm]),
                    termination_grace_period_seconds: Some(DRAIN_GRACE_S + TERMINATION_MARGIN_S),
                    ..Default::default()
                }),
            },
            ..Default::default()
        }),
        ..Default::default()
    };
    Ok((service, set))
}

fn push_doc<T: serde::Serialize>(out: &mut String, what: &str, obj: &T) -> Result<()> {
    let yaml = serde_yaml_ng::to_string(obj).map_err(|e| anyhow!("cannot render {what}: {e}"))?;
    out.push_str("---\n");
    out.push_str(&yaml);
    Ok(())
}

/// The YAML of every object of `spec`, `---`-separated, in the order `kubectl apply -f`
/// creates them (Services before the sets that name them).
///
/// # Errors
/// A flag at fault, named: `--name`/`--namespace` not DNS labels, an empty `--image`,
/// `--heads` other than 1 or 3, `--multislice` with fewer than two slices or mixed types.
pub fn render(spec: &ClusterSpec) -> Result<String> {
    spec.check()?;
    let mut out = String::new();
    let (svc, set, pdb) = head_objects(spec);
    push_doc(&mut out, "the head Service", &svc)?;
    push_doc(&mut out, "the head StatefulSet", &set)?;
    push_doc(&mut out, "the head PodDisruptionBudget", &pdb)?;
    if spec.cpu_workers > 0 {
        push_doc(&mut out, "the CPU workers", &cpu_workers(spec))?;
    }
    let slices = spec.slice_shapes();
    for (i, s) in slices.iter().enumerate() {
        let (svc, set) = slice_objects(spec, s, i, &slices, &[])?;
        push_doc(&mut out, &format!("slice {}'s Service", s.name), &svc)?;
        push_doc(&mut out, &format!("slice {}'s StatefulSet", s.name), &set)?;
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn spec(slices: &[&str]) -> ClusterSpec {
        ClusterSpec {
            name: "demo".into(),
            namespace: "default".into(),
            image: "tpuray:dev".into(),
            heads: 1,
            cpu_workers: 0,
            slices: slices.iter().map(|s| parse_slice(s).unwrap()).collect(),
            multislice: false,
        }
    }

    #[test]
    fn accelerator_types_as_tpu_md_writes_them_parse_with_v5e_as_alias() {
        for (s, hosts, chips) in [
            ("v6e-16", 4, 4),
            ("v5litepod-8", 1, 8),
            ("v5e-8", 1, 8),
            ("v4-32", 4, 4),
            ("v5p-16", 2, 4),
            ("v6e-16:2", 4, 4),
        ] {
            let (a, _) = parse_slice(s).unwrap();
            assert_eq!((a.hosts(), a.chips_per_host()), (hosts, chips), "{s}");
        }
        assert_eq!(parse_slice("v5e-8").unwrap().0.to_string(), "v5litepod-8");
        assert_eq!(parse_slice("v6e-16:3").unwrap().1, 3);
    }

    #[test]
    fn bad_slice_shapes_are_refused_naming_the_value() {
        for (s, needle) in [
            ("v9z-16", "v9z-16"),
            ("v6e-12", "\"v6e-12\" is not a slice size"),
            ("v4-12", "\"v4-12\" is not a slice size"),
            ("v6e-16:0", "count \"0\""),
            ("v6e-16:two", "count \"two\""),
            ("v7x-8", "v7x"),
        ] {
            let e = parse_slice(s).unwrap_err().to_string();
            assert!(e.contains(needle), "{s}: {e}");
        }
    }

    #[test]
    fn slice_statefulset_has_one_replica_per_host_and_the_tpu_environment() {
        let y = render(&spec(&["v6e-16"])).unwrap();
        assert!(y.contains("name: demo-v6e-16-0\n"), "{y}");
        assert!(y.contains("replicas: 4\n"), "{y}");
        assert!(y.contains("google.com/tpu: '4'"), "{y}");
        assert!(y.contains("cloud.google.com/gke-tpu-accelerator: tpu-v6e-slice"), "{y}");
        assert!(y.contains("cloud.google.com/gke-tpu-topology: 4x4"), "{y}");
        assert!(y.contains("value: demo-v6e-16-0-0.demo-v6e-16-0.default.svc,"), "{y}");
        assert!(y.contains("metadata.labels['apps.kubernetes.io/pod-index']"), "{y}");
        assert!(!y.contains("MEGASCALE"), "{y}");
    }

    #[test]
    fn pods_grace_period_covers_the_agents_drain_grace_and_its_default() {
        let mut s = spec(&["v6e-16"]);
        s.cpu_workers = 1;
        let y = render(&s).unwrap();
        let grace = DRAIN_GRACE_S + TERMINATION_MARGIN_S;
        assert_eq!(y.matches(&format!("terminationGracePeriodSeconds: {grace}\n")).count(), 3);
        assert_eq!(
            y.matches(&format!("- --drain-grace-period\n        - '{DRAIN_GRACE_S}'")).count(),
            2
        );
        assert_eq!(crate::args::DEFAULT_DRAIN_GRACE_S, DRAIN_GRACE_S as u64);
        assert_eq!(y.matches("- --metrics-export-port\n        - '8080'").count(), 2, "{y}");
    }

    #[test]
    fn multislice_sets_megascale_and_needs_two_slices_of_one_type() {
        let mut s = spec(&["v6e-16:2"]);
        s.multislice = true;
        let y = render(&s).unwrap();
        assert!(y.contains("MEGASCALE_NUM_SLICES"), "{y}");
        assert!(y.contains("value: demo-v6e-16-0-0.demo-v6e-16-0.default.svc\n"), "{y}");
        let mut one = spec(&["v6e-16"]);
        one.multislice = true;
        assert!(render(&one).unwrap_err().to_string().contains("at least 2"));
        let mut mixed = spec(&["v6e-16", "v4-32"]);
        mixed.multislice = true;
        assert!(render(&mixed).unwrap_err().to_string().contains("v4-32, v6e-16"));
    }

    #[test]
    fn heads_other_than_one_or_three_and_bad_names_are_refused() {
        let mut s = spec(&[]);
        s.heads = 2;
        assert!(render(&s).unwrap_err().to_string().contains("--heads 2"));
        let mut s = spec(&[]);
        s.name = "Demo_1".into();
        assert!(render(&s).unwrap_err().to_string().contains("--name \"Demo_1\""));
    }
}
