//! tpuray's pure scheduling library: resources, labels and placement decisions.
//!
//! State in, decision out: no I/O, no clocks, no threads, no randomness of its own (callers
//! pass a `u64` seed). Nothing here blocks or needs a runtime.
//!
//! - [`resources`]: [`Amount`] (exact fixed point, 1/10_000 of a resource) and [`ResourceSet`].
//! - [`labels`]: node [`Labels`] and Ray 2.x label selectors ([`parse_label_selector`]).
//! - [`policy`]: [`schedule`] picks a node for one [`Request`] from [`NodeView`]s.
//! - [`cluster`]: [`ClusterView`] indexes nodes per request class; [`schedule_in`] decides in
//!   O(log nodes) and applies the allocation.
//! - [`placement`]: placement groups ([`place_group`], [`place_group_in`],
//!   [`replace_lost_bundles`]) and TPU slice groups ([`place_slice_group`]).
//! - [`gpu`]: GPU ids per worker process (`CUDA_VISIBLE_DEVICES`), GPU-1/2.
//! - [`gang`]: the launch environment of a multi-host slice gang ([`gang::gang_members`]).
//! - [`bundles`]: the resource names of committed bundles (Ray's `CPU_group_<i>_<pg>`).
//! - [`tpu`]: the TPU model of TPU.md: accelerator types, topologies, what a host advertises
//!   ([`TpuHostInfo::from_env`]), aligned chip blocks ([`ChipAllocator`]), [`chip_env`].
//!
//! Invariants (the number appears at the code that enforces it and in the tests that check it):
//!
//! - SCHED-1: amounts are fixed-point integers, so arithmetic is exact (0.1 + 0.2 == 0.3).
//! - SCHED-2: a [`ResourceSet`] never stores a zero or negative amount; subtraction stops at 0.
//! - SCHED-3: only alive nodes whose total covers the demand and whose labels match the
//!   selector are ever chosen.
//! - SCHED-4: `Place` only on a node whose available covers the demand; feasible-but-busy
//!   requests `Queue`, never `Infeasible`.
//! - SCHED-5: an infeasible reason names the first missing resource and the cluster's total
//!   of it, e.g. `no node has resource "GPU" (requested 1, cluster total 0)`.
//! - SCHED-6: CPU-only work (no GPU/TPU demand) never fills GPU/TPU hosts while a node without
//!   accelerators can take it.
//! - SCHED-7: same inputs and seed give the same decision.
//! - SCHED-8: label keys `ray.io/K` and `tpuray.io/K` are aliases.
//! - SCHED-9: hard node affinity never places anywhere but its target.
//! - SCHED-10: a placement group is placed whole or not at all: `Placed` lists one node per
//!   bundle and all bundles fit that node's available together (earlier bundles count).
//! - SCHED-11: a TPU slice advertises exactly one `TPU-<type>-head` resource (worker 0).
//! - SCHED-12: chips are handed out as the lowest free aligned block ({i}, {2k,2k+1},
//!   {4k..4k+3}, all 8), never a ragged set.
//! - SCHED-13: a process gets 1, 2, 4, 8 chips or the whole host; other counts (3, 0.5)
//!   are rejected with a message naming the valid counts.
//! - SCHED-14: a process holding k < n chips gets the bounds variables (and their older
//!   names); k == n leaves them unset.
//! - SCHED-15: a slice group reserves every host of N intact slices (bundles in worker-id
//!   order) or nothing; never mixes slices or single-host nodes of the same generation.
//! - SCHED-16: a group no arrangement of alive nodes could hold (e.g. STRICT_SPREAD with more
//!   bundles than nodes) is `Infeasible` at once, never left pending forever.
//! - SCHED-17: [`ClusterView`] decisions equal [`schedule`]'s over the same nodes.
//! - SCHED-18: allocate/release round trips restore availability exactly (fixed point).
//! - SCHED-19: work inside a placement-group bundle asks for the bundle's renamed resources
//!   ([`bundles`]), so it runs only where the bundle is committed and never uses more than
//!   the bundle reserved.
//!
//! Who uses it: node agents advertise TPU hosts from [`tpu`] (the `TPU_*` environment
//! plus `--resources '{"TPU": N}'`, as on Ray) and hand out chip blocks and GPU ids with
//! it; the head places actors and placement groups with [`ClusterView`] and
//! [`placement`]; the SDK rewrites the resources of work inside a bundle with
//! [`bundles`].

pub mod bundles;
pub mod cluster;
pub mod gang;
pub mod gpu;
pub mod labels;
pub mod placement;
pub mod policy;
pub mod resources;
pub mod tpu;

pub use cluster::{ClusterView, schedule_in};
pub use labels::{LabelConstraint, LabelError, LabelOp, Labels, parse_label_selector};
pub use placement::{
    Bundle, PgDecision, PgStrategy, place_group, place_group_in, place_slice_group,
    release_group_in, replace_lost_bundles, slice_name_selector,
};
pub use policy::{Decision, NodeView, Request, SPREAD_THRESHOLD, Strategy, schedule};
pub use resources::{Amount, ResourceError, ResourceSet};
pub use tpu::{
    AcceleratorType, ChipAllocator, ChipError, Topology, TpuError, TpuGeneration, TpuHostInfo,
    chip_count, chip_env,
};

/// Helpers shared by the unit tests of several modules.
#[cfg(test)]
pub(crate) mod test_util {
    use crate::labels::Labels;
    use crate::policy::NodeView;
    use crate::resources::ResourceSet;

    /// A resource set from JSON (panics on bad input: tests only).
    pub fn res(json: &str) -> ResourceSet {
        ResourceSet::from_json(json).unwrap()
    }

    /// An alive node with everything available.
    pub fn node(id: u32, total: &str, labels: &str) -> NodeView<u32> {
        let labels = Labels::parse(labels).unwrap();
        NodeView { id, total: res(total), available: res(total), labels, alive: true }
    }
}
