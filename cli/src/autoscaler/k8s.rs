//! The `kubernetes` provider (cargo feature `kubernetes`): a slice is the headless Service
//! and StatefulSet that `tpuray k8s manifests` renders for one slice (its hosts created
//! and deleted together, `podManagementPolicy: Parallel`), a CPU worker is one Pod of the
//! manifests' CPU worker template; both built by [`crate::k8s::autoscaled_objects`] and
//! sent through the API with the `kube` client (rustls, no OpenSSL), from the in-cluster
//! service account or `~/.kube/config` (`kube::Client::try_default`).
//!
//! Objects are named by the instance id, which the autoscaler prefixes with the cluster's
//! name (`<name>-v6e-16-3`), labelled `tpuray.io/autoscaler-instance`,
//! `tpuray.io/autoscaler-node-type` and `app.kubernetes.io/instance: <name>`, and listed
//! by those labels, so a restarted head finds the instances it had. A pod that failed or
//! whose agent container restarted counts as a lost host (AUTOSCALE-3).
//! [`Provider::shutdown`] deletes nothing: the pods belong to the cluster, not to the head
//! process (a head pod that restarts finds them again).
//!
//! Untested against a live cluster (no API server is reachable where it was written): the
//! request bodies are unit-tested, the calls are `kube`'s own.
//! Blocking: each call runs the provider's own runtime (the autoscaler calls it outside
//! its runtime).

use std::collections::BTreeMap;

use anyhow::{Result, anyhow};
use k8s_openapi::api::core::v1::Pod;

use super::config::{INSTANCE_LABEL, NODE_TYPE_LABEL, NodeType};
use crate::k8s::{AutoscaledObjects, ClusterSpec, autoscaled_objects};
#[cfg(feature = "kubernetes")]
pub use client::KubernetesProvider;

/// The Kubernetes label naming the tpuray cluster an object belongs to.
const CLUSTER_LABEL: &str = "app.kubernetes.io/instance";

/// The Kubernetes labels of an instance's objects.
pub fn object_labels(cluster: &str, t: &NodeType, instance: &str) -> BTreeMap<String, String> {
    BTreeMap::from([
        (CLUSTER_LABEL.to_string(), cluster.to_string()),
        (NODE_TYPE_LABEL.to_string(), t.name.clone()),
        (INSTANCE_LABEL.to_string(), instance.to_string()),
    ])
}

/// The node agent flags of an instance's hosts: `--labels` (the node type's labels and the
/// autoscaler's two), `--num-cpus` when the type names CPUs (a CPU worker always has it),
/// `--resources` for custom resources. A slice's TPU chips are the hosts' own, detected.
pub fn agent_args(t: &NodeType, instance: &str) -> Vec<String> {
    let mut args = Vec::new();
    if t.slice.is_some() && t.resources.get("CPU").0 > 0 {
        args.extend(["--num-cpus".into(), t.resources.get("CPU").to_f64().to_string()]);
    }
    let custom: serde_json::Map<String, serde_json::Value> = t
        .resources
        .iter()
        .filter(|(k, _)| !["CPU", "GPU", "memory", "object_store_memory"].contains(k))
        .map(|(k, v)| (k.to_string(), serde_json::json!(v.to_f64())))
        .collect();
    if !custom.is_empty() {
        args.extend(["--resources".into(), serde_json::Value::Object(custom).to_string()]);
    }
    args.extend(t.labels_arg(instance));
    args
}

/// The objects of `instance` of type `t`. Errors: a slice topology other than the
/// accelerator type's default (the manifests render the default), a bad name.
pub fn objects(spec: &ClusterSpec, t: &NodeType, instance: &str) -> Result<AutoscaledObjects> {
    if let Some(s) = &t.slice
        && s.accelerator_type.default_topology().as_ref() != Some(&s.topology)
    {
        return Err(anyhow!(
            "node type {}: the kubernetes provider renders {}'s default topology, not {}",
            t.name,
            s.accelerator_type,
            s.topology
        ));
    }
    let cpus = t.resources.get("CPU").to_f64().ceil().max(1.0) as u32;
    autoscaled_objects(
        spec,
        instance,
        t.slice.as_ref().map(|s| s.accelerator_type),
        cpus,
        &object_labels(&spec.name, t, instance),
        &agent_args(t, instance),
    )
}

/// The label selector listing this cluster's autoscaled objects.
pub fn selector(cluster: &str) -> String {
    format!("{CLUSTER_LABEL}={cluster},{INSTANCE_LABEL}")
}

/// Why a pod counts as a lost host, if it does: failed, or its agent restarted.
pub fn pod_lost(p: &Pod) -> Option<String> {
    let name = p.metadata.name.clone().unwrap_or_default();
    let status = p.status.as_ref()?;
    if status.phase.as_deref() == Some("Failed") {
        return Some(format!("pod {name} failed"));
    }
    let restarts: i32 = status.container_statuses.iter().flatten().map(|c| c.restart_count).sum();
    (restarts > 0).then(|| format!("pod {name}'s node agent restarted ({restarts} time(s))"))
}

#[cfg(feature = "kubernetes")]
mod client {
    use std::collections::{BTreeMap, BTreeSet};

    use anyhow::{Context, Result};
    use k8s_openapi::api::apps::v1::StatefulSet;
    use k8s_openapi::api::core::v1::{Pod, Service};
    use kube::api::{Api, DeleteParams, ListParams, PostParams};

    use super::super::config::{INSTANCE_LABEL, NODE_TYPE_LABEL, NodeType};
    use super::super::decide::InstanceView;
    use super::super::provider::Provider;
    use super::{objects, pod_lost, selector};
    use crate::k8s::{AutoscaledObjects, ClusterSpec};

    /// Slices and CPU workers through the Kubernetes API.
    pub struct KubernetesProvider {
        rt: tokio::runtime::Runtime,
        client: kube::Client,
        spec: ClusterSpec,
        /// Launch times of the instances this head launched (others: when first seen).
        seen: BTreeMap<String, u64>,
    }

    impl KubernetesProvider {
        /// A client from the in-cluster service account or `~/.kube/config`.
        ///
        /// # Errors
        /// No Kubernetes configuration was found, or it cannot be used.
        pub fn new(namespace: &str, cluster_name: &str, image: &str, _head: &str) -> Result<Self> {
            let rt = tokio::runtime::Builder::new_current_thread().enable_all().build()?;
            let client = rt
                .block_on(kube::Client::try_default())
                .context("the kubernetes provider found no usable Kubernetes configuration")?;
            Ok(Self {
                rt,
                client,
                spec: ClusterSpec::for_autoscaler(cluster_name, namespace, image),
                seen: BTreeMap::new(),
            })
        }
    }

    impl Provider for KubernetesProvider {
        fn id_prefix(&self) -> String {
            format!("{}-", self.spec.name)
        }

        fn launch(&mut self, t: &NodeType, instance: &str, now_ms: u64) -> Result<()> {
            let ns = &self.spec.namespace;
            let pp = PostParams::default();
            match objects(&self.spec, t, instance)? {
                AutoscaledObjects::Worker(pod) => {
                    let pods: Api<Pod> = Api::namespaced(self.client.clone(), ns);
                    self.rt.block_on(pods.create(&pp, &pod)).context("create the worker pod")?;
                }
                AutoscaledObjects::Slice(objs) => {
                    let (svc, set) = *objs;
                    let svcs: Api<Service> = Api::namespaced(self.client.clone(), ns);
                    let sets: Api<StatefulSet> = Api::namespaced(self.client.clone(), ns);
                    self.rt
                        .block_on(svcs.create(&pp, &svc))
                        .context("create the slice's Service")?;
                    self.rt
                        .block_on(sets.create(&pp, &set))
                        .context("create the slice's StatefulSet")?;
                }
            }
            self.seen.insert(instance.to_string(), now_ms);
            Ok(())
        }

        fn terminate(&mut self, instance: &str) -> Result<()> {
            let ns = &self.spec.namespace;
            let dp = DeleteParams::foreground();
            let sets: Api<StatefulSet> = Api::namespaced(self.client.clone(), ns);
            let svcs: Api<Service> = Api::namespaced(self.client.clone(), ns);
            let pods: Api<Pod> = Api::namespaced(self.client.clone(), ns);
            let rt = &self.rt;
            // Whichever exists: a slice's set and service, or a worker's pod.
            let set = rt.block_on(sets.delete(instance, &dp));
            if set.is_ok() {
                let _ = rt.block_on(svcs.delete(instance, &dp));
            } else {
                rt.block_on(pods.delete(instance, &dp)).context("delete the worker pod")?;
            }
            self.seen.remove(instance);
            Ok(())
        }

        fn instances(&mut self) -> Result<Vec<InstanceView>> {
            let ns = &self.spec.namespace;
            let lp = ListParams::default().labels(&selector(&self.spec.name));
            let sets: Api<StatefulSet> = Api::namespaced(self.client.clone(), ns);
            let pods: Api<Pod> = Api::namespaced(self.client.clone(), ns);
            let sets = self.rt.block_on(sets.list(&lp)).context("list StatefulSets")?.items;
            let pods = self.rt.block_on(pods.list(&lp)).context("list pods")?.items;
            let now = crate::autoscaler::now_ms();
            let mut out: BTreeMap<String, InstanceView> = BTreeMap::new();
            let label = |m: &Option<BTreeMap<String, String>>, k: &str| {
                m.as_ref().and_then(|l| l.get(k)).cloned().unwrap_or_default()
            };
            let mut slices = BTreeSet::new();
            for s in &sets {
                let id = label(&s.metadata.labels, INSTANCE_LABEL);
                slices.insert(id.clone());
                let launched_ms = *self.seen.entry(id.clone()).or_insert(now);
                let node_type = label(&s.metadata.labels, NODE_TYPE_LABEL);
                out.insert(id.clone(), InstanceView { id, node_type, launched_ms, lost: None });
            }
            for p in &pods {
                let id = label(&p.metadata.labels, INSTANCE_LABEL);
                let node_type = label(&p.metadata.labels, NODE_TYPE_LABEL);
                let launched_ms = *self.seen.entry(id.clone()).or_insert(now);
                let e = out.entry(id.clone()).or_insert(InstanceView {
                    id,
                    node_type,
                    launched_ms,
                    lost: None,
                });
                if e.lost.is_none() {
                    e.lost = pod_lost(p);
                }
            }
            Ok(out.into_values().collect())
        }

        fn shutdown(&mut self) {}
    }
}

#[cfg(test)]
mod tests {
    use super::super::config::parse;
    use super::*;

    fn types() -> BTreeMap<String, NodeType> {
        parse(
            "provider: {type: kubernetes, image: img:1}\navailable_node_types:\n  cpu: {resources: {CPU: 2, special: 1}, labels: {tier: a}, max_workers: 4}\n  v6e-16: {resources: {CPU: 8}, max_workers: 2, tpu: {accelerator_type: v6e-16, topology: 4x4}}\n",
        )
        .unwrap()
        .node_types
    }

    fn json<T: serde::Serialize>(v: &T) -> serde_json::Value {
        serde_json::to_value(v).unwrap()
    }

    #[test]
    fn a_slice_is_the_manifests_statefulset_of_its_hosts_named_and_labelled_by_instance() {
        let spec = ClusterSpec::for_autoscaler("tr", "ml", "img:1");
        let t = &types()["v6e-16"];
        let AutoscaledObjects::Slice(objs) = objects(&spec, t, "tr-v6e-16-3").unwrap() else {
            panic!("a slice")
        };
        let (svc, set) = *objs;
        let (svc, set) = (json(&svc), json(&set));
        assert_eq!(svc["metadata"]["name"], "tr-v6e-16-3");
        assert_eq!(svc["spec"]["clusterIP"], "None");
        assert_eq!(set["metadata"]["name"], "tr-v6e-16-3");
        assert_eq!(set["metadata"]["namespace"], "ml");
        assert_eq!(set["spec"]["replicas"], 4, "the four hosts of v6e-16");
        assert_eq!(set["spec"]["podManagementPolicy"], "Parallel");
        let pod = &set["spec"]["template"];
        assert_eq!(pod["metadata"]["labels"][INSTANCE_LABEL], "tr-v6e-16-3");
        assert_eq!(pod["metadata"]["labels"][NODE_TYPE_LABEL], "v6e-16");
        assert_eq!(pod["metadata"]["labels"][CLUSTER_LABEL], "tr");
        let c = &pod["spec"]["containers"][0];
        assert_eq!(c["resources"]["limits"]["google.com/tpu"], "4");
        let env: BTreeMap<String, String> = c["env"]
            .as_array()
            .unwrap()
            .iter()
            .filter_map(|e| Some((e["name"].as_str()?.into(), e["value"].as_str()?.into())))
            .collect();
        assert_eq!(env["TPU_NAME"], "tr-v6e-16-3");
        assert_eq!(env["TPU_TOPOLOGY"], "4x4");
        let args: Vec<&str> =
            c["args"].as_array().unwrap().iter().map(|a| a.as_str().unwrap()).collect();
        let at = |f: &str| args[args.iter().position(|a| *a == f).unwrap() + 1];
        assert_eq!(at("--num-cpus"), "8");
        assert_eq!(
            at("--labels"),
            "tpuray.io/autoscaler-node-type=v6e-16,tpuray.io/autoscaler-instance=tr-v6e-16-3"
        );
        assert_eq!(pod["spec"]["nodeSelector"]["cloud.google.com/gke-tpu-topology"], "4x4");
    }

    #[test]
    fn a_cpu_worker_is_one_pod_of_the_manifests_template() {
        let spec = ClusterSpec::for_autoscaler("tr", "ml", "img:1");
        let AutoscaledObjects::Worker(pod) = objects(&spec, &types()["cpu"], "tr-cpu-1").unwrap()
        else {
            panic!("a pod")
        };
        let pod = json(&*pod);
        assert_eq!(pod["metadata"]["name"], "tr-cpu-1");
        assert_eq!(pod["metadata"]["labels"][INSTANCE_LABEL], "tr-cpu-1");
        let c = &pod["spec"]["containers"][0];
        assert_eq!(c["resources"]["requests"]["cpu"], "2");
        let args: Vec<&str> =
            c["args"].as_array().unwrap().iter().map(|a| a.as_str().unwrap()).collect();
        assert_eq!(&args[..3], ["tpuray", "start", "--block"]);
        let at = |f: &str| args[args.iter().position(|a| *a == f).unwrap() + 1];
        assert_eq!(at("--num-cpus"), "2");
        assert_eq!(at("--resources"), r#"{"special":1.0}"#);
        assert!(at("--labels").starts_with("tier=a,"));
        assert_eq!(selector("tr"), "app.kubernetes.io/instance=tr,tpuray.io/autoscaler-instance");
    }

    #[test]
    fn a_failed_pod_or_a_restarted_agent_is_a_lost_host() {
        let mut p: Pod = serde_json::from_value(serde_json::json!({
            "metadata": {"name": "s-0"},
            "status": {"phase": "Running", "containerStatuses": [{"name": "agent", "image": "i", "imageID": "", "ready": true, "restartCount": 0}]}
        }))
        .unwrap();
        assert_eq!(pod_lost(&p), None);
        p.status.as_mut().unwrap().container_statuses.as_mut().unwrap()[0].restart_count = 1;
        assert!(pod_lost(&p).unwrap().contains("restarted"));
        p.status.as_mut().unwrap().phase = Some("Failed".into());
        assert!(pod_lost(&p).unwrap().contains("failed"));
    }

    #[test]
    fn a_slice_topology_other_than_the_default_is_refused_by_name() {
        let mut t = types()["v6e-16"].clone();
        t.slice.as_mut().unwrap().topology = tpuray_scheduler::tpu::Topology(vec![2, 8]);
        let spec = ClusterSpec::for_autoscaler("tr", "ml", "img:1");
        let e = objects(&spec, &t, "tr-x-1").err().unwrap().to_string();
        assert!(e.contains("default topology"), "{e}");
    }
}
