//! Placement group commands (HEAD-5, HEAD-9): created, placed bundle by bundle, removed
//! (its actors die with it); removed groups kept only up to a bound.
//!
//! HEAD-9: the state keeps at most 1,000 removed placement groups; applying a removal
//! beyond that forgets the oldest removed one (by creation time, then id, so every
//! replica forgets the same), whose id then answers "no placement group". Before, each
//! group ever made stayed in the state and in every snapshot, and a create/remove loop
//! slowed down at each snapshot (40 ms per 100 groups at first, 120 ms after 16,000).

use super::*;

impl StateMachine {
    pub(super) fn apply_create_group(
        &mut self,
        pg: PlacementGroupRecord,
        changed: &mut Vec<Changed>,
    ) -> Outcome {
        // Clients may choose the id: never let one replace another group.
        if self.placement_groups.contains_key(&pg.pg_id) {
            return Outcome::Rejected(Rejection::AlreadyExists(format!(
                "placement group {} already exists",
                pg.pg_id
            )));
        }
        if !pg.name.is_empty() {
            let key = (pg.namespace.clone(), pg.name.clone());
            if self.named_placement_groups.contains_key(&key) {
                return Outcome::Rejected(Rejection::AlreadyExists(format!(
                    "placement group named {:?} already exists in namespace {:?}",
                    pg.name, pg.namespace
                )));
            }
            self.named_placement_groups.insert(key, pg.pg_id.clone());
        }
        let id = pg.pg_id.clone();
        self.placement_groups.insert(id.clone(), pg);
        changed.push(Changed::PlacementGroup(id.clone()));
        Outcome::PlacementGroup(id)
    }

    pub(super) fn apply_group_placed(
        &mut self,
        pg_id: PlacementGroupId,
        bundles: Vec<(u32, NodeId)>,
        slice_bundles: Option<Vec<Bundle>>,
        changed: &mut Vec<Changed>,
    ) -> Outcome {
        let Some(pg) = self.placement_groups.get_mut(&pg_id) else {
            return Outcome::Rejected(Rejection::NotFound(format!("no placement group {pg_id}")));
        };
        if pg.is_removed() {
            return Outcome::Rejected(Rejection::Invalid(format!(
                "placement group {pg_id} was removed"
            )));
        }
        if let Some(b) = slice_bundles {
            pg.bundle_nodes = vec![None; b.len()];
            pg.bundles = b;
        }
        for (i, node) in bundles {
            match pg.bundle_nodes.get_mut(i as usize) {
                Some(slot) if slot.is_none() => *slot = Some(node),
                _ => {
                    return Outcome::Rejected(Rejection::Invalid(format!(
                        "bundle {i} of placement group {pg_id} is not waiting for a node"
                    )));
                }
            }
        }
        if pg.bundle_nodes.iter().all(Option::is_some) {
            pg.status = PgStatus::Created;
        }
        changed.push(Changed::PlacementGroup(pg_id.clone()));
        Outcome::PlacementGroup(pg_id)
    }

    pub(super) fn apply_remove_group(
        &mut self,
        pg_id: PlacementGroupId,
        reason: String,
        changed: &mut Vec<Changed>,
    ) -> Outcome {
        if !self.placement_groups.contains_key(&pg_id) {
            return Outcome::Rejected(Rejection::NotFound(format!("no placement group {pg_id}")));
        }
        self.remove_group(&pg_id, reason, changed);
        Outcome::PlacementGroup(pg_id)
    }

    /// Marks a group removed (keeping where its bundles were, for the agents to give them
    /// back) and its actors dead: what ran inside a removed group never restarts.
    pub(super) fn remove_group(
        &mut self,
        pg_id: &PlacementGroupId,
        reason: String,
        changed: &mut Vec<Changed>,
    ) {
        let Some(pg) = self.placement_groups.get_mut(pg_id) else {
            return;
        };
        if pg.is_removed() {
            return;
        }
        pg.status = PgStatus::Removed { reason: reason.clone() };
        if !pg.name.is_empty() {
            self.named_placement_groups.remove(&(pg.namespace.clone(), pg.name.clone()));
        }
        changed.push(Changed::PlacementGroup(pg_id.clone()));
        let inside: Vec<ActorId> = self
            .actors
            .values()
            .filter(|a| !a.is_dead() && a.placement_group.as_ref().is_some_and(|p| p.0 == *pg_id))
            .map(|a| a.actor_id.clone())
            .collect();
        for actor_id in inside {
            self.actor_exited(
                &actor_id,
                None,
                true,
                format!("the actor's placement group {pg_id} was removed ({reason})"),
                changed,
            );
        }
        self.forget_old_removed_groups();
    }

    /// HEAD-9: keeps at most [`MAX_REMOVED_PLACEMENT_GROUPS`] plus
    /// [`REMOVED_PLACEMENT_GROUPS_SLACK`] removed groups; past that, forgets the oldest (by
    /// creation time, then id: the same choice on every replica) down to the maximum.
    /// Without it the state, and with it every snapshot, grows with each group ever made
    /// (a create/remove loop slowed down at each snapshot). Each removal costs one pass
    /// over the groups; the sort runs once per slack's worth of removals (it ran at every
    /// removal, cloning every id, and took 17% of the Raft thread in a create/remove loop).
    pub(super) fn forget_old_removed_groups(&mut self) {
        let removed = self.placement_groups.values().filter(|p| p.is_removed()).count();
        if removed <= MAX_REMOVED_PLACEMENT_GROUPS + REMOVED_PLACEMENT_GROUPS_SLACK {
            return;
        }
        let mut by_age: Vec<(u64, &PlacementGroupId)> = self
            .placement_groups
            .values()
            .filter(|p| p.is_removed())
            .map(|p| (p.create_time_ms, &p.pg_id))
            .collect();
        by_age.sort_unstable();
        let oldest: Vec<PlacementGroupId> = by_age[..removed - MAX_REMOVED_PLACEMENT_GROUPS]
            .iter()
            .map(|(_, id)| (*id).clone())
            .collect();
        for id in oldest {
            self.placement_groups.remove(&id);
        }
    }
}
