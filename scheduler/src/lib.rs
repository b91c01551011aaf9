//! tpuray's pure scheduling library: resources, labels and placement decisions.
//!
//! State in, decision out: no I/O, no clocks, no threads, no randomness of its own (callers
//! pass a `u64` seed). Nothing here blocks or needs a runtime.
//!
//! - [`resources`]: [`Amount`] (exact fixed point, 1/10_000 of a resource) and [`ResourceSet`].
//! - [`labels`]: node [`Labels`] and Ray 2.x label selectors ([`parse_label_selector`]).
//! - [`policy`]: [`schedule`] picks a node for one [`Request`] from [`NodeView`]s.
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

pub mod labels;
pub mod policy;
pub mod resources;

pub use labels::{LabelConstraint, LabelError, LabelOp, Labels, parse_label_selector};
pub use policy::{Decision, NodeView, Request, SPREAD_THRESHOLD, Strategy, schedule};
pub use resources::{Amount, ResourceError, ResourceSet};
