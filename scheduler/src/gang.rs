//! The launch environment of a multi-host TPU slice gang (TPU.md "Multi-host slice gangs"):
//! given the hosts a slice placement group reserved, in bundle order, decide once for the
//! whole gang every member's environment, so that all ranks agree on hostnames, slice-builder
//! addresses, ports, session id and ranks.
//!
//! Invariants (checked by the tests below and by `tests/tests/gang.rs` on a cluster):
//! - GANG-1: every member sees the same `TPU_WORKER_HOSTNAMES` of its slice (reachable node
//!   addresses in worker-id order), the same `TORCH_TPU_SLICEBUILDER_ADDRESSES` (one
//!   `host:port` per device over the slice's hosts), the same `TORCH_TPU_XPROF_SESSION_ID`,
//!   `MASTER_ADDR`/`MASTER_PORT` and JAX coordinator.
//! - GANG-2: no `host:port` is used twice within a gang; ports come from the gang's own port
//!   block (`base_port .. base_port + ports_needed`), which the SDK claims cluster-wide, so two
//!   gangs, or simulated hosts sharing one address, never collide.
//! - GANG-3: ranks (`NODE_RANK`/`JOB_COMPLETION_INDEX` per host, `RANK` per chip process) are
//!   a permutation of `0..n`; `NODE_RANK` is set only on hosts without real TPU devices
//!   (TorchTPU derives it from device coordinates and falls back to `JOB_COMPLETION_INDEX`).

use std::collections::BTreeMap;

use crate::tpu::{
    AcceleratorType, Topology, TpuGeneration, chips_per_process_bounds, per_host_topology,
};

/// One host of a gang, as the placement group reserved it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct GangHost {
    /// The address every member can reach the host at: the node agent's IP or hostname,
    /// without port (`"10.0.0.7"`; `"127.0.0.1"` for simulated hosts).
    pub address: String,
    /// The slice name (`TPU_NAME`).
    pub slice_name: String,
    /// `TPU_WORKER_ID` of the host within its slice.
    pub worker_id: u32,
    /// Whether the host's chips were found as devices (`/dev/accel*`, VFIO) rather than
    /// declared for a simulated host.
    pub real_devices: bool,
}

/// What a gang runs: one process per host (holding all its chips), or one per chip.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum GangMode {
    PerHost,
    PerChip,
}

/// Everything the environment of a gang's members is decided from.
#[derive(Clone, Debug)]
pub struct GangLayout {
    /// The gang's id (stable across restarts).
    pub gang_id: String,
    /// Starts at 0; every restart adds one.
    pub generation: u32,
    pub accelerator_type: AcceleratorType,
    pub topology: Topology,
    /// Hosts in bundle order: slices in order, hosts in worker-id order within each.
    pub hosts: Vec<GangHost>,
    pub mode: GangMode,
    /// First port of the gang's block; see [`ports_needed`].
    pub base_port: u16,
}

/// One process of a gang.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct GangMember {
    /// The member's index (0-based, = its global rank among the gang's processes).
    pub index: u32,
    /// The placement-group bundle (= host) it runs in.
    pub bundle_index: u32,
    /// Chips it holds (all of the host's, or 1 per-chip).
    pub chips: u32,
    /// Its chip within the host when one process per chip.
    pub local_rank: Option<u32>,
    /// The environment to start it with (on top of the node's chip environment).
    pub env: BTreeMap<String, String>,
}

/// A layout that cannot be turned into a gang.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum GangError {
    #[error("a gang on {accelerator_type} x{slices} needs {expected} hosts, the group gave {got}")]
    HostCount { accelerator_type: String, slices: u32, expected: usize, got: usize },
    #[error(
        "host {index} of the gang is worker {got} of slice {slice:?}, expected worker {expected} (bundles must be in worker-id order)"
    )]
    WorkerOrder { index: usize, slice: String, got: u32, expected: u32 },
    #[error("the gang needs ports {base}..{end}, beyond 65535")]
    PortRange { base: u32, end: u32 },
}

/// TorchTPU's default slice-builder base port (`TORCH_TPU_BASE_PORT`), the usual start of a
/// gang's port block when nothing else holds it.
pub const TORCH_TPU_BASE_PORT: u16 = 8070;

/// Ports a gang's block holds: one slice-builder port per device of every host, then the
/// torch master, JAX coordinator and megascale ports, then (per-chip gangs) one libtpu
/// process port per chip.
pub fn ports_needed(ty: &AcceleratorType, hosts: usize, mode: GangMode) -> u32 {
    let chips_per_host = ty.chips_per_host();
    let devices = chips_per_host * ty.generation.devices_per_chip();
    let hosts = u32::try_from(hosts).unwrap_or(u32::MAX);
    let per_chip = if mode == GangMode::PerChip { hosts * chips_per_host } else { 0 };
    hosts * devices + 3 + per_chip
}

/// `TORCH_TPU_TOPOLOGY` of a slice: its chip mesh as three values (`4x4` → `4,4,1`,
/// `2x2x4` → `2,2,4`), with v7x's devices per chip as a fourth (as TPU.md's per-host strings).
pub fn torch_tpu_topology(generation: TpuGeneration, topology: &Topology) -> String {
    let mut dims: Vec<String> = topology.0.iter().map(u32::to_string).collect();
    while dims.len() < 3 {
        dims.push("1".into());
    }
    if generation == TpuGeneration::V7x {
        dims.push(generation.devices_per_chip().to_string());
    }
    dims.join(",")
}

/// Every member's environment (TPU.md "Multi-host slice gangs"; GANG-1..3).
///
/// Common to all members: `TPURAY_GANG_ID`, `TPURAY_GANG_GENERATION`, `TPURAY_GANG_SIZE`,
/// `TORCH_TPU_TOPOLOGY`, `TORCH_TPU_XPROF_SESSION_ID` (`<gang id>-<generation>`), `NNODES`
/// (hosts), `MASTER_ADDR` (host 0), `MASTER_PORT`, `WORLD_SIZE` (total ranks: one per
/// device, TorchTPU's launcher model, or one per chip process), `JAX_COORDINATOR_ADDRESS`,
/// `JAX_NUM_PROCESSES`, `JAX_PLATFORMS` (`tpu` on hosts with real devices, else `cpu`), and
/// with several slices `MEGASCALE_COORDINATOR_ADDRESS` (slice 0's worker 0),
/// `MEGASCALE_PORT` (from the gang's block rather than libtpu's default 8081, so simulated
/// hosts sharing an address never collide), `MEGASCALE_NUM_SLICES`.
///
/// Per host: `TPU_WORKER_ID`, `TPU_NAME`, `TPU_WORKER_HOSTNAMES` (its slice's hosts),
/// `TORCH_TPU_SLICEBUILDER_ADDRESSES` (its slice's devices), `JOB_COMPLETION_INDEX` (the
/// host's index in the gang; slices continue each other's numbering), `NODE_RANK` (same,
/// only without real devices), `MEGASCALE_SLICE_ID`.
///
/// Per chip process: `RANK`, `LOCAL_RANK`, `TPU_VISIBLE_CHIPS` (its chip),
/// `TPU_CHIPS_PER_PROCESS_BOUNDS` (`1,1,1`), `TPU_PROCESS_BOUNDS` (the slice's chip mesh:
/// one process per chip), `TPU_PROCESS_ADDRESSES` (every process of the gang, rank order),
/// `TPU_PROCESS_PORT`, `CLOUD_TPU_TASK_ID` (its rank).
///
/// # Errors
/// The hosts do not make up whole slices of the type in worker-id order, or the port block
/// runs past 65535.
pub fn gang_members(layout: &GangLayout) -> Result<Vec<GangMember>, GangError> {
    let ty = &layout.accelerator_type;
    let hosts_per_slice = ty.hosts() as usize;
    let slices = (layout.hosts.len() / hosts_per_slice.max(1)).max(1);
    if layout.hosts.len() != slices * hosts_per_slice || layout.hosts.is_empty() {
        return Err(GangError::HostCount {
            accelerator_type: ty.to_string(),
            slices: slices as u32,
            expected: slices * hosts_per_slice,
            got: layout.hosts.len(),
        });
    }
    for (i, h) in layout.hosts.iter().enumerate() {
        let expected = (i % hosts_per_slice) as u32;
        if h.worker_id != expected {
            return Err(GangError::WorkerOrder {
                index: i,
                slice: h.slice_name.clone(),
                got: h.worker_id,
                expected,
            });
        }
    }
    let n_hosts = layout.hosts.len();
    let needed = ports_needed(ty, n_hosts, layout.mode);
    let base = u32::from(layout.base_port);
    if base + needed > 65536 {
        return Err(GangError::PortRange { base, end: base + needed });
    }
    let port = |offset: u32| (base + offset).to_string();
    let generation = ty.generation;
    let chips_per_host = ty.chips_per_host();
    let devices_per_host = chips_per_host * generation.devices_per_chip();
    let after_devices = n_hosts as u32 * devices_per_host;
    let (master_port, jax_port, megascale_port) =
        (port(after_devices), port(after_devices + 1), port(after_devices + 2));
    let process_port = |rank: u32| port(after_devices + 3 + rank);
    let per_chip = layout.mode == GangMode::PerChip;
    let processes = if per_chip { n_hosts as u32 * chips_per_host } else { n_hosts as u32 };
    let world = if per_chip { processes } else { n_hosts as u32 * devices_per_host };
    let first = &layout.hosts[0];

    let mut common = BTreeMap::new();
    let set = |m: &mut BTreeMap<String, String>, k: &str, v: String| {
        m.insert(k.to_string(), v);
    };
    set(&mut common, "TPURAY_GANG_ID", layout.gang_id.clone());
    set(&mut common, "TPURAY_GANG_GENERATION", layout.generation.to_string());
    set(&mut common, "TPURAY_GANG_SIZE", processes.to_string());
    set(&mut common, "TPU_ACCELERATOR_TYPE", ty.to_string());
    set(&mut common, "TPU_TOPOLOGY", layout.topology.to_string());
    set(&mut common, "TORCH_TPU_TOPOLOGY", torch_tpu_topology(generation, &layout.topology));
    set(
        &mut common,
        "TORCH_TPU_XPROF_SESSION_ID",
        format!("{}-{}", layout.gang_id, layout.generation),
    );
    set(&mut common, "NNODES", n_hosts.to_string());
    set(&mut common, "MASTER_ADDR", first.address.clone());
    set(&mut common, "MASTER_PORT", master_port);
    set(&mut common, "WORLD_SIZE", world.to_string());
    set(&mut common, "JAX_COORDINATOR_ADDRESS", format!("{}:{jax_port}", first.address));
    set(&mut common, "JAX_NUM_PROCESSES", processes.to_string());
    if slices > 1 {
        set(&mut common, "MEGASCALE_COORDINATOR_ADDRESS", first.address.clone());
        set(&mut common, "MEGASCALE_PORT", megascale_port);
        set(&mut common, "MEGASCALE_NUM_SLICES", slices.to_string());
    }
    let process_addresses: Vec<String> = (0..processes)
        .map(|rank| {
            let host = &layout.hosts[(rank / chips_per_host.max(1)) as usize];
            format!("{}:{}", host.address, process_port(rank))
        })
        .collect();

    let mut members = Vec::new();
    for (h, host) in layout.hosts.iter().enumerate() {
        let slice = h / hosts_per_slice;
        let slice_hosts = &layout.hosts[slice * hosts_per_slice..(slice + 1) * hosts_per_slice];
        let hostnames: Vec<&str> = slice_hosts.iter().map(|s| s.address.as_str()).collect();
        let builders: Vec<String> = (0..hosts_per_slice)
            .flat_map(|i| {
                let g = (slice * hosts_per_slice + i) as u32;
                let addr = &slice_hosts[i].address;
                (0..devices_per_host)
                    .map(move |d| format!("{addr}:{}", base + g * devices_per_host + d))
            })
            .collect();
        let mut env = common.clone();
        set(&mut env, "TPU_WORKER_ID", host.worker_id.to_string());
        set(&mut env, "TPU_NAME", host.slice_name.clone());
        set(&mut env, "TPU_WORKER_HOSTNAMES", hostnames.join(","));
        set(&mut env, "TORCH_TPU_SLICEBUILDER_ADDRESSES", builders.join(","));
        set(&mut env, "JOB_COMPLETION_INDEX", h.to_string());
        if !host.real_devices {
            set(&mut env, "NODE_RANK", h.to_string());
        }
        set(&mut env, "JAX_PLATFORMS", if host.real_devices { "tpu" } else { "cpu" }.into());
        if slices > 1 {
            set(&mut env, "MEGASCALE_SLICE_ID", slice.to_string());
        }
        if per_chip {
            for c in 0..chips_per_host {
                let rank = h as u32 * chips_per_host + c;
                let mut env = env.clone();
                set(&mut env, "RANK", rank.to_string());
                set(&mut env, "LOCAL_RANK", c.to_string());
                set(&mut env, "JAX_PROCESS_ID", rank.to_string());
                set(&mut env, "TPU_VISIBLE_CHIPS", c.to_string());
                if let Some(b) = chips_per_process_bounds(generation, 1) {
                    set(&mut env, "TPU_CHIPS_PER_PROCESS_BOUNDS", b.clone());
                    set(&mut env, "TPU_CHIPS_PER_HOST_BOUNDS", b);
                }
                let mesh = if n_hosts == 1 {
                    per_host_topology(generation, chips_per_host)
                        .map(str::to_string)
                        .unwrap_or_else(|| torch_tpu_topology(generation, &layout.topology))
                } else {
                    torch_tpu_topology(generation, &layout.topology)
                };
                set(&mut env, "TPU_PROCESS_BOUNDS", mesh.clone());
                set(&mut env, "TPU_HOST_BOUNDS", mesh);
                set(&mut env, "TPU_PROCESS_ADDRESSES", process_addresses.join(","));
                set(&mut env, "TPU_PROCESS_PORT", process_port(rank));
                set(&mut env, "TPU_MESH_CONTROLLER_PORT", process_port(rank));
                set(
                    &mut env,
                    "TPU_MESH_CONTROLLER_ADDRESS",
                    format!("localhost:{}", process_port(rank)),
                );
                set(&mut env, "CLOUD_TPU_TASK_ID", rank.to_string());
                members.push(GangMember {
                    index: rank,
                    bundle_index: h as u32,
                    chips: 1,
                    local_rank: Some(c),
                    env,
                });
            }
        } else {
            set(&mut env, "JAX_PROCESS_ID", h.to_string());
            members.push(GangMember {
                index: h as u32,
                bundle_index: h as u32,
                chips: chips_per_host,
                local_rank: None,
                env,
            });
        }
    }
    Ok(members)
}

#[cfg(test)]
mod tests {
    use std::collections::BTreeSet;

    use super::*;

    fn layout(ty: &str, topo: &str, slices: &[&str], mode: GangMode, real: bool) -> GangLayout {
        let ty = AcceleratorType::parse(ty).unwrap();
        let hosts = slices
            .iter()
            .flat_map(|s| {
                (0..ty.hosts()).map(move |w| GangHost {
                    address: "127.0.0.1".into(),
                    slice_name: s.to_string(),
                    worker_id: w,
                    real_devices: real,
                })
            })
            .collect();
        GangLayout {
            gang_id: "g1".into(),
            generation: 2,
            accelerator_type: ty,
            topology: Topology::parse(topo).unwrap(),
            hosts,
            mode,
            base_port: 20000,
        }
    }

    fn all_ports(members: &[GangMember]) -> Vec<String> {
        let mut used = BTreeSet::new();
        for m in members {
            let e = &m.env;
            // Per-member ports; addresses shared by all members count once.
            used.insert(format!("master {}", e["MASTER_PORT"]));
            used.insert(format!("jax {}", e["JAX_COORDINATOR_ADDRESS"]));
            for a in e["TORCH_TPU_SLICEBUILDER_ADDRESSES"].split(',') {
                used.insert(format!("sb {a}"));
            }
            if let Some(p) = e.get("TPU_PROCESS_PORT") {
                used.insert(format!("proc 127.0.0.1:{p}"));
            }
            if let Some(p) = e.get("MEGASCALE_PORT") {
                used.insert(format!("ms 127.0.0.1:{p}"));
            }
        }
        used.into_iter().map(|s| s.split_once(' ').unwrap().1.to_string()).collect()
    }

    #[test]
    fn per_host_gang_on_a_v6e_16_slice() {
        let m = gang_members(&layout("v6e-16", "4x4", &["sa"], GangMode::PerHost, false)).unwrap();
        assert_eq!(m.len(), 4);
        for (i, member) in m.iter().enumerate() {
            let e = &member.env;
            assert_eq!(member.chips, 4);
            assert_eq!(e["TPU_WORKER_ID"], i.to_string());
            assert_eq!(e["NODE_RANK"], i.to_string());
            assert_eq!(e["JOB_COMPLETION_INDEX"], i.to_string());
            assert_eq!(e["TPU_WORKER_HOSTNAMES"], "127.0.0.1,127.0.0.1,127.0.0.1,127.0.0.1");
            assert_eq!(e["TORCH_TPU_TOPOLOGY"], "4,4,1");
            assert_eq!(e["TORCH_TPU_XPROF_SESSION_ID"], "g1-2");
            assert_eq!(e["TPURAY_GANG_GENERATION"], "2");
            assert_eq!(e["NNODES"], "4");
            assert_eq!(e["WORLD_SIZE"], "16");
            assert_eq!(e["MASTER_ADDR"], "127.0.0.1");
            assert_eq!(e["JAX_PLATFORMS"], "cpu");
            assert!(!e.contains_key("RANK") && !e.contains_key("MEGASCALE_NUM_SLICES"));
            // One slice-builder address per device, identical everywhere.
            assert_eq!(e["TORCH_TPU_SLICEBUILDER_ADDRESSES"].split(',').count(), 16);
            assert_eq!(
                e["TORCH_TPU_SLICEBUILDER_ADDRESSES"],
                m[0].env["TORCH_TPU_SLICEBUILDER_ADDRESSES"]
            );
        }
        // GANG-2: 16 slice builders + master + jax, all distinct, inside the block.
        let ports = all_ports(&m);
        assert_eq!(ports.len(), 18);
        let needed = ports_needed(&AcceleratorType::parse("v6e-16").unwrap(), 4, GangMode::PerHost);
        for p in &ports {
            let p: u32 = p.rsplit_once(':').map_or(p.as_str(), |x| x.1).parse().unwrap();
            assert!((20000..20000 + needed).contains(&p), "{p}");
        }
    }

    #[test]
    fn real_devices_leave_node_rank_to_torch_tpu() {
        let m = gang_members(&layout("v4-32", "2x2x4", &["s"], GangMode::PerHost, true)).unwrap();
        assert_eq!(m.len(), 4);
        assert!(m.iter().all(|x| !x.env.contains_key("NODE_RANK")));
        assert_eq!(m[3].env["JOB_COMPLETION_INDEX"], "3");
        assert_eq!(m[0].env["TORCH_TPU_TOPOLOGY"], "2,2,4");
        assert_eq!(m[0].env["JAX_PLATFORMS"], "tpu");
    }

    #[test]
    fn per_chip_gang_ranks_and_process_addresses() {
        let m = gang_members(&layout("v6e-16", "4x4", &["sa"], GangMode::PerChip, false)).unwrap();
        assert_eq!(m.len(), 16);
        let ranks: BTreeSet<String> = m.iter().map(|x| x.env["RANK"].clone()).collect();
        assert_eq!(ranks.len(), 16);
        for x in &m {
            let e = &x.env;
            assert_eq!(e["WORLD_SIZE"], "16");
            assert_eq!(e["TPU_VISIBLE_CHIPS"], e["LOCAL_RANK"]);
            assert_eq!(e["CLOUD_TPU_TASK_ID"], e["RANK"]);
            assert_eq!(e["TPU_CHIPS_PER_PROCESS_BOUNDS"], "1,1,1");
            assert_eq!(e["TPU_PROCESS_BOUNDS"], "4,4,1");
            assert_eq!(e["TPU_PROCESS_ADDRESSES"].split(',').count(), 16);
            assert_eq!(x.bundle_index, x.index / 4);
        }
        let procs: BTreeSet<&str> = m[0].env["TPU_PROCESS_ADDRESSES"].split(',').collect();
        assert_eq!(procs.len(), 16);
        assert_eq!(all_ports(&m).len(), 16 + 2 + 16);
    }

    #[test]
    fn single_host_per_chip_uses_the_host_process_grid() {
        let m = gang_members(&layout("v6e-8", "2x4", &["h"], GangMode::PerChip, false)).unwrap();
        assert_eq!(m.len(), 8);
        assert_eq!(m[5].env["TPU_PROCESS_BOUNDS"], "2,4,1");
        assert_eq!(m[5].env["TPU_VISIBLE_CHIPS"], "5");
    }

    #[test]
    fn multislice_gets_megascale_and_continues_ranks() {
        let m = gang_members(&layout("v6e-16", "4x4", &["sa", "sb"], GangMode::PerHost, false))
            .unwrap();
        assert_eq!(m.len(), 8);
        assert_eq!(m[5].env["TPU_WORKER_ID"], "1");
        assert_eq!(m[5].env["TPU_NAME"], "sb");
        assert_eq!(m[5].env["MEGASCALE_SLICE_ID"], "1");
        assert_eq!(m[5].env["NODE_RANK"], "5");
        assert_eq!(m[0].env["MEGASCALE_NUM_SLICES"], "2");
        assert_eq!(m[0].env["MEGASCALE_PORT"], m[7].env["MEGASCALE_PORT"]);
        // Each slice lists its own hosts and devices; no port repeats across the gang.
        assert_ne!(
            m[0].env["TORCH_TPU_SLICEBUILDER_ADDRESSES"],
            m[4].env["TORCH_TPU_SLICEBUILDER_ADDRESSES"]
        );
        assert_eq!(all_ports(&m).len(), 32 + 3);
    }

    #[test]
    fn v7x_counts_two_devices_per_chip() {
        let m = gang_members(&layout("v7x-16", "2x2x2", &["x"], GangMode::PerHost, true)).unwrap();
        assert_eq!(m.len(), 2);
        assert_eq!(m[0].env["TORCH_TPU_TOPOLOGY"], "2,2,2,2");
        assert_eq!(m[0].env["TORCH_TPU_SLICEBUILDER_ADDRESSES"].split(',').count(), 16);
        assert_eq!(m[0].env["WORLD_SIZE"], "16");
    }

    #[test]
    fn bad_layouts_are_refused_with_the_reason() {
        let mut l = layout("v6e-16", "4x4", &["sa"], GangMode::PerHost, false);
        l.hosts.pop();
        assert!(gang_members(&l).unwrap_err().to_string().contains("needs 4 hosts"));
        let mut l = layout("v6e-16", "4x4", &["sa"], GangMode::PerHost, false);
        l.hosts.swap(1, 2);
        assert!(gang_members(&l).unwrap_err().to_string().contains("worker-id order"));
        let mut l = layout("v6e-16", "4x4", &["sa"], GangMode::PerHost, false);
        l.base_port = 65530;
        assert!(gang_members(&l).unwrap_err().to_string().contains("beyond 65535"));
    }
}
