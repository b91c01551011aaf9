//! Which copy a node pulls an object from (OBJ-8), pure: the owner of a stored object
//! assigns each pulling node one source among the object's copies, at most
//! [`MAX_PULLS_PER_SOURCE`] pulls from one copy at a time, so later pullers copy from
//! earlier ones (a tree broadcast) instead of all from the first. Time is passed in;
//! no locks or I/O: the owner's table keeps one [`Pulls`] per pulled object, and
//! `sdk/tests/sim.rs` drives it with seeded pulls, completions and node deaths. OBJ-8
//! in full (copies reported, sources dropped, the 120 s expiry, the serving side's
//! chunks) is in `objectstore/src/transfer.rs`'s doc.

use std::collections::HashMap;
use std::time::{Duration, Instant};

use tpuray_proto::pb;

/// Pulls of one object the owner lets run at once from one copy; later pullers wait
/// for a copy to finish and then pull from it (a tree broadcast).
pub const MAX_PULLS_PER_SOURCE: usize = 2;

/// An assigned pull not reported done within this long no longer holds its source
/// (its puller died or hung).
pub const PULL_SLOT_TTL: Duration = Duration::from_secs(120);

/// A pull the owner assigned: `puller` (a node) copies from `source` (a node).
struct PullSlot {
    source: String,
    puller: String,
    since: Instant,
}

/// The pulls of one stored object: those assigned and not reported done, and how many
/// each source served so far.
#[derive(Default)]
pub struct Pulls {
    slots: Vec<PullSlot>,
    /// Pulls assigned to each source node so far (ties go to the least used).
    served: HashMap<String, u32>,
}

impl Pulls {
    /// OBJ-8: the sources node `puller` may copy an object stored at `locations` from,
    /// at time `now`: every location when its own node has a copy (no pull); else the
    /// copy with the fewest pulls in flight, under [`MAX_PULLS_PER_SOURCE`], then the one
    /// that served least, then the newest, recorded as a pull in flight. `None` while
    /// every copy is busy or another process of the same node pulls it already: ask
    /// again when one finishes. `pulls` is created at the first pull (boxed: most
    /// objects are never pulled).
    pub fn assign(
        pulls: &mut Option<Box<Pulls>>,
        locations: &[pb::ObjectLocation],
        puller: &str,
        now: Instant,
    ) -> Option<Vec<pb::ObjectLocation>> {
        if locations.iter().any(|l| l.node_id == puller) {
            return Some(locations.to_vec());
        }
        let Pulls { slots, served } = &mut **pulls.get_or_insert_with(Default::default);
        slots.retain(|p| now.duration_since(p.since) < PULL_SLOT_TTL);
        if slots.iter().any(|p| p.puller == puller) {
            return None;
        }
        let in_flight = |n: &str| slots.iter().filter(|p| p.source == n).count();
        let best = locations
            .iter()
            .enumerate()
            .filter(|(_, l)| in_flight(&l.node_id) < MAX_PULLS_PER_SOURCE)
            .min_by_key(|(i, l)| {
                (
                    in_flight(&l.node_id),
                    served.get(&l.node_id).copied().unwrap_or(0),
                    std::cmp::Reverse(*i),
                )
            })
            .map(|(_, l)| l.clone())?;
        slots.push(PullSlot {
            source: best.node_id.clone(),
            puller: puller.to_string(),
            since: now,
        });
        *served.entry(best.node_id.clone()).or_default() += 1;
        Some(vec![best])
    }

    /// The pull of `puller` from `source` ended (copied or failed): the source is free
    /// for the next.
    pub fn done(&mut self, source: &str, puller: &str) {
        if let Some(i) = self.slots.iter().position(|p| p.source == source && p.puller == puller) {
            self.slots.remove(i);
        }
    }

    /// The copies on `nodes` were lost: pulls from them end.
    pub fn lost(&mut self, nodes: &[String]) {
        self.slots.retain(|p| !nodes.contains(&p.source));
    }
}
