//! The autoscaling configuration (`tpuray start --head --autoscaling-config FILE`), in the
//! shape of Ray's cluster config: `provider`, `idle_timeout_minutes` and
//! `available_node_types`, YAML or JSON (YAML is a superset of JSON, so one parser reads
//! both).
//!
//! Counts of a TPU node type (`min_workers`, `max_workers`) are in slices: every host of
//! a slice is launched and removed together. The shape of a slice (hosts, chips per host,
//! topology) comes from the scheduler's TPU model ([`tpuray_scheduler::tpu`], TPU.md);
//! nothing about TPUs is decided here.
//!
//! Unknown keys are refused by name (serde's `deny_unknown_fields`); bad values get an
//! error naming the field and what was expected. Pure: [`parse`] takes text.

use std::collections::BTreeMap;
use std::fmt;

use anyhow::{Context, Result, anyhow, bail};
use serde::Deserialize;
use tpuray_scheduler::labels::{Labels, TPURAY_PREFIX};
use tpuray_scheduler::resources::{Amount, ResourceSet};
use tpuray_scheduler::tpu::{AcceleratorType, Topology, TpuHostInfo};

/// The label every node the autoscaler launches carries: its node type's name.
pub const NODE_TYPE_LABEL: &str = "tpuray.io/autoscaler-node-type";
/// The label naming the instance (a CPU worker, or a whole slice) a node belongs to.
pub const INSTANCE_LABEL: &str = "tpuray.io/autoscaler-instance";

/// The file as written.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct RawConfig {
    provider: RawProvider,
    #[serde(default)]
    idle_timeout_minutes: Option<f64>,
    available_node_types: BTreeMap<String, RawNodeType>,
}

#[derive(Debug, Deserialize)]
#[serde(tag = "type", rename_all = "lowercase", deny_unknown_fields)]
enum RawProvider {
    Local {},
    Kubernetes {
        /// The namespace the cluster's objects live in (default `default`).
        #[serde(default)]
        namespace: Option<String>,
        /// The name `tpuray k8s manifests --name` was given (default `tpuray`).
        #[serde(default)]
        cluster_name: Option<String>,
        /// The container image of the node agents.
        image: String,
    },
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct RawNodeType {
    #[serde(default)]
    resources: BTreeMap<String, f64>,
    #[serde(default)]
    labels: BTreeMap<String, String>,
    #[serde(default)]
    min_workers: Option<u32>,
    max_workers: u32,
    #[serde(default)]
    tpu: Option<RawTpu>,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct RawTpu {
    accelerator_type: String,
    #[serde(default)]
    topology: Option<String>,
}

/// Where nodes come from.
#[derive(Clone, Debug, PartialEq)]
pub enum ProviderConfig {
    /// Node agents started as processes on the head's machine (`tpuray start --address`),
    /// slice hosts with the simulated TPU environment of TPU.md.
    Local,
    /// StatefulSets (slices) and a Deployment (CPU workers) through the Kubernetes API.
    Kubernetes { namespace: String, cluster_name: String, image: String },
}

/// The slice a TPU node type launches: every field from the scheduler's TPU model.
#[derive(Clone, Debug, PartialEq)]
pub struct SliceShape {
    pub accelerator_type: AcceleratorType,
    pub topology: Topology,
}

impl SliceShape {
    /// Hosts in one slice (TPU.md: v6e-16 = 4, v6e-64 = 16).
    pub fn hosts(&self) -> u32 {
        self.accelerator_type.hosts()
    }

    /// Chips on each host.
    pub fn chips_per_host(&self) -> u32 {
        self.accelerator_type.chips_per_host()
    }

    /// What host `worker_id` of a slice named `name` advertises (TPU.md): the TPU
    /// resources and labels a node agent derives from the same `TPU_*` environment.
    pub fn host(&self, name: &str, worker_id: u32) -> TpuHostInfo {
        TpuHostInfo {
            accelerator_type: self.accelerator_type,
            topology: self.topology.clone(),
            slice_name: name.to_string(),
            worker_id,
            worker_hostnames: Vec::new(),
            chips: self.chips_per_host(),
        }
    }
}

impl fmt::Display for SliceShape {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{} ({}, {} hosts)", self.accelerator_type, self.topology, self.hosts())
    }
}

/// One entry of `available_node_types`.
#[derive(Clone, Debug, PartialEq)]
pub struct NodeType {
    pub name: String,
    /// Each host's resources as written (`CPU`, `GPU`, custom); a TPU type's hosts also get
    /// the TPU resources of [`SliceShape::host`].
    pub resources: ResourceSet,
    pub labels: BTreeMap<String, String>,
    /// Instances (CPU workers, or whole slices) kept at all times.
    pub min_workers: u32,
    /// Instances never exceeded.
    pub max_workers: u32,
    pub slice: Option<SliceShape>,
}

impl NodeType {
    /// `tpuray start`'s `--labels` for a host of instance `instance`: the type's labels
    /// and the autoscaler's two ([`NODE_TYPE_LABEL`], [`INSTANCE_LABEL`]).
    pub fn labels_arg(&self, instance: &str) -> [String; 2] {
        let mut labels: Vec<String> = self.labels.iter().map(|(k, v)| format!("{k}={v}")).collect();
        labels.push(format!("{NODE_TYPE_LABEL}={}", self.name));
        labels.push(format!("{INSTANCE_LABEL}={instance}"));
        ["--labels".into(), labels.join(",")]
    }

    /// Hosts per instance: a slice's hosts, else 1.
    pub fn hosts(&self) -> u32 {
        self.slice.as_ref().map_or(1, SliceShape::hosts)
    }

    /// The resources host `worker_id` of instance `instance` advertises once up.
    pub fn host_resources(&self, instance: &str, worker_id: u32) -> ResourceSet {
        let mut r = self.resources.clone();
        if let Some(s) = &self.slice {
            r.add(&s.host(instance, worker_id).resources());
        }
        r
    }

    /// The labels host `worker_id` of instance `instance` carries once up.
    pub fn host_labels(&self, instance: &str, worker_id: u32) -> Labels {
        let mut l = Labels(self.labels.clone());
        l.0.insert(NODE_TYPE_LABEL.to_string(), self.name.clone());
        l.0.insert(INSTANCE_LABEL.to_string(), instance.to_string());
        if let Some(s) = &self.slice {
            l.0.extend(s.host(instance, worker_id).labels().0);
        }
        l
    }
}

/// A checked configuration.
#[derive(Clone, Debug, PartialEq)]
pub struct AutoscalingConfig {
    pub provider: ProviderConfig,
    /// How long an instance stays idle before it is removed (Ray's default: 5 minutes).
    pub idle_timeout_ms: u64,
    /// By name.
    pub node_types: BTreeMap<String, NodeType>,
}

/// Ray's default `idle_timeout_minutes`.
pub const DEFAULT_IDLE_TIMEOUT_MINUTES: f64 = 5.0;

/// Reads and checks the file at `path` (YAML or JSON).
pub fn load(path: &std::path::Path) -> Result<AutoscalingConfig> {
    let text = std::fs::read_to_string(path)
        .with_context(|| format!("cannot read the autoscaling config {}", path.display()))?;
    parse(&text).with_context(|| format!("autoscaling config {}", path.display()))
}

/// Parses and checks a configuration. Errors name the field at fault and what was
/// expected: an unknown key, a missing `provider` or `max_workers`, a negative or
/// non-finite `idle_timeout_minutes`, `min_workers` above `max_workers`, a resource amount
/// that is negative, `TPU` in a TPU type's `resources` (it comes from `tpu`), an unknown
/// accelerator type or a topology not valid for it, a label key or value that a node
/// agent's `--labels` cannot carry.
pub fn parse(text: &str) -> Result<AutoscalingConfig> {
    let raw: RawConfig = serde_yaml_ng::from_str(text).map_err(|e| anyhow!("{e}"))?;
    let idle_min = raw.idle_timeout_minutes.unwrap_or(DEFAULT_IDLE_TIMEOUT_MINUTES);
    if !idle_min.is_finite() || idle_min < 0.0 {
        bail!(
            "idle_timeout_minutes: {idle_min} is not a number of minutes >= 0 (fractions allowed, e.g. 0.5)"
        );
    }
    let provider = match raw.provider {
        RawProvider::Local {} => ProviderConfig::Local,
        RawProvider::Kubernetes { namespace, cluster_name, image } => {
            if image.trim().is_empty() {
                bail!("provider.image is empty (expected the node agents' container image)");
            }
            ProviderConfig::Kubernetes {
                namespace: namespace.unwrap_or_else(|| "default".into()),
                cluster_name: cluster_name.unwrap_or_else(|| "tpuray".into()),
                image,
            }
        }
    };
    if raw.available_node_types.is_empty() {
        bail!("available_node_types is empty (expected at least one node type)");
    }
    let mut node_types = BTreeMap::new();
    for (name, t) in raw.available_node_types {
        let at = |field: &str| format!("available_node_types.{name}.{field}");
        if name.is_empty()
            || !name.chars().all(|c| c.is_ascii_alphanumeric() || c == '-' || c == '_')
        {
            bail!(
                "available_node_types: node type name {name:?} is not made of letters, digits, '-' and '_'"
            );
        }
        let min_workers = t.min_workers.unwrap_or(0);
        if min_workers > t.max_workers {
            bail!("{}: {min_workers} is above max_workers {}", at("min_workers"), t.max_workers);
        }
        let resources = ResourceSet::from_f64_map(&t.resources)
            .map_err(|e| anyhow!("{}: {e}", at("resources")))?;
        for (k, v) in &t.labels {
            if k.is_empty() || k.contains([',', '=']) || v.contains([',', '=']) {
                bail!(
                    "{}: {k:?}: {v:?} (expected a non-empty key and a value without ',' or '=')",
                    at("labels")
                );
            }
            if k.starts_with(TPURAY_PREFIX) || k.starts_with("ray.io/") {
                bail!(
                    "{}: {k:?} is reserved (keys under tpuray.io/ and ray.io/ are set by tpuray)",
                    at("labels")
                );
            }
        }
        let slice = match t.tpu {
            None => None,
            Some(tpu) => {
                let accelerator_type = AcceleratorType::parse(&tpu.accelerator_type)
                    .map_err(|e| anyhow!("{}: {e}", at("tpu.accelerator_type")))?;
                let topology = match &tpu.topology {
                    Some(s) => Topology::parse(s).map_err(|e| anyhow!("{}: {e}", at("tpu.topology")))?,
                    None => accelerator_type.default_topology().ok_or_else(|| {
                        anyhow!("{}: {accelerator_type} has no default topology (expected one, e.g. \"4x4\")", at("tpu.topology"))
                    })?,
                };
                accelerator_type
                    .check_topology(&topology)
                    .map_err(|e| anyhow!("{}: {e}", at("tpu.topology")))?;
                if resources.get("TPU") != Amount::ZERO {
                    bail!(
                        "{}: \"TPU\" comes from tpu.accelerator_type ({} chips per host); leave it out",
                        at("resources"),
                        accelerator_type.chips_per_host()
                    );
                }
                Some(SliceShape { accelerator_type, topology })
            }
        };
        if slice.is_none() && resources.get("TPU") != Amount::ZERO {
            bail!(
                "{}: \"TPU\" needs a tpu: {{accelerator_type, topology}} section (TPU hosts come in slices)",
                at("resources")
            );
        }
        node_types.insert(
            name.clone(),
            NodeType {
                name,
                resources,
                labels: t.labels,
                min_workers,
                max_workers: t.max_workers,
                slice,
            },
        );
    }
    Ok(AutoscalingConfig {
        provider,
        idle_timeout_ms: (idle_min * 60_000.0).round() as u64,
        node_types,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    const EXAMPLE: &str = r#"
provider:
  type: local
idle_timeout_minutes: 0.1
available_node_types:
  cpu:
    resources: {CPU: 1}
    min_workers: 0
    max_workers: 4
  v6e-16:
    resources: {CPU: 1}
    max_workers: 2
    tpu: {accelerator_type: v6e-16, topology: 4x4}
"#;

    #[test]
    fn ray_shaped_yaml_parses_with_slice_shapes_from_the_tpu_model() {
        let c = parse(EXAMPLE).unwrap();
        assert_eq!(c.provider, ProviderConfig::Local);
        assert_eq!(c.idle_timeout_ms, 6_000);
        let t = &c.node_types["v6e-16"];
        let s = t.slice.as_ref().unwrap();
        assert_eq!((s.hosts(), s.chips_per_host(), s.topology.to_string()), (4, 4, "4x4".into()));
        let r = t.host_resources("sl-1", 0);
        assert_eq!(r.get("TPU"), Amount::whole(4));
        assert_eq!(r.get("TPU-v6e-16-head"), Amount::whole(1));
        assert_eq!(t.host_resources("sl-1", 1).get("TPU-v6e-16-head"), Amount::ZERO);
        assert_eq!(t.host_labels("sl-1", 2).get("tpuray.io/tpu-worker-id"), Some("2"));
        assert_eq!(c.node_types["cpu"].hosts(), 1);
        // v6e-64 is 16 hosts of 4 chips, 8x8, by the same model.
        let big = parse(&EXAMPLE.replace("v6e-16, topology: 4x4", "v6e-64")).unwrap();
        let s = big.node_types["v6e-16"].slice.clone().unwrap();
        assert_eq!((s.hosts(), s.topology.to_string()), (16, "8x8".into()));
    }

    #[test]
    fn json_is_read_too() {
        let c = parse(r#"{"provider": {"type": "local"}, "available_node_types": {"cpu": {"resources": {"CPU": 2}, "max_workers": 3}}}"#).unwrap();
        assert_eq!(c.idle_timeout_ms, 300_000, "Ray's default 5 minutes");
        assert_eq!(c.node_types["cpu"].max_workers, 3);
    }

    #[test]
    fn unknown_keys_and_bad_values_are_refused_by_name() {
        let cases = [
            (EXAMPLE.replace("idle_timeout_minutes", "idle_timeout_minute"), "idle_timeout_minute"),
            (EXAMPLE.replace("min_workers: 0", "min_worker: 0"), "min_worker"),
            (EXAMPLE.replace("type: local", "type: aws"), "aws"),
            (
                EXAMPLE.replace("topology: 4x4", "topology: 3x3"),
                "available_node_types.v6e-16.tpu.topology",
            ),
            (EXAMPLE.replace("topology: 4x4", "topology: 8x8"), "has 64 chips but v6e-16 has 16"),
            (
                EXAMPLE.replace("accelerator_type: v6e-16", "accelerator_type: v9-1"),
                "tpu.accelerator_type",
            ),
            (
                EXAMPLE.replace("min_workers: 0", "min_workers: 9"),
                "available_node_types.cpu.min_workers: 9 is above max_workers 4",
            ),
            (EXAMPLE.replace("0.1", "-1"), "idle_timeout_minutes: -1"),
            (
                EXAMPLE.replace("resources: {CPU: 1}\n    min", "resources: {CPU: -1}\n    min"),
                "available_node_types.cpu.resources",
            ),
            (EXAMPLE.replace("max_workers: 2", "max_workers: 2\n    labels: {a: 'x,y'}"), "labels"),
            (EXAMPLE.replace("max_workers: 4", ""), "max_workers"),
            (EXAMPLE.replace("max_workers: 2", "max_workers: 2\n    tpu_x: 1"), "tpu_x"),
        ];
        for (text, needle) in cases {
            let e = format!("{:#}", parse(&text).unwrap_err());
            assert!(e.contains(needle), "{needle:?} not in {e:?}");
        }
    }
}
