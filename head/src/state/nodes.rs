//! Node commands: a node joins (HEAD-10: one live host per slice and worker id), a node
//! dies (its actors lose their process, its bundles go back to placement).
//!
//! HEAD-10: a node registering as host `TPU_WORKER_ID=w` of slice `s` (its
//! `tpuray.io/tpu-slice-name` and `tpu-worker-id` labels) is refused while another live
//! node holds (s, w), naming it: a duplicate would also bring a second `TPU-<type>-head`
//! (TPU.md's known failures). A restarted host joins once its old node is declared dead.

use super::*;

impl StateMachine {
    pub(super) fn apply_register_node(
        &mut self,
        rec: NodeRecord,
        changed: &mut Vec<Changed>,
    ) -> Outcome {
        if let Some(existing) = self.nodes.get(&rec.node_id)
            && matches!(existing.status, NodeStatus::Dead { .. })
        {
            return Outcome::Rejected(Rejection::Invalid(format!(
                "node {} was already declared dead; start a new node agent",
                rec.node_id
            )));
        }
        // HEAD-10: one live host per (slice, worker id); a duplicate would also
        // bring a second slice-head resource (TPU.md's known failures).
        let slot = |r: &NodeRecord| {
            let l = &r.labels.0;
            Some((
                l.get("tpuray.io/tpu-slice-name")?.clone(),
                l.get("tpuray.io/tpu-worker-id")?.clone(),
            ))
        };
        if let Some(mine) = slot(&rec)
            && let Some(other) = self.nodes.values().find(|n| {
                n.node_id != rec.node_id
                    && n.status == NodeStatus::Alive
                    && slot(n).as_ref() == Some(&mine)
            })
        {
            return Outcome::Rejected(Rejection::AlreadyExists(format!(
                "TPU slice {:?} already has a live host with TPU_WORKER_ID={} (node {} at {}): \
                     each host of a slice needs its own worker id (a restarted host may join once \
                     its old node is declared dead)",
                mine.0, mine.1, other.node_id, other.address
            )));
        }
        let id = rec.node_id.clone();
        self.nodes.insert(id.clone(), rec);
        changed.push(Changed::Node(id.clone()));
        Outcome::Node(id)
    }

    pub(super) fn apply_mark_node_dead(
        &mut self,
        node_id: NodeId,
        reason: String,
        changed: &mut Vec<Changed>,
    ) -> Outcome {
        let Some(node) = self.nodes.get_mut(&node_id) else {
            return Outcome::Rejected(Rejection::NotFound(format!("no node {node_id}")));
        };
        if node.status == NodeStatus::Alive {
            node.status = NodeStatus::Dead { reason: reason.clone() };
            changed.push(Changed::Node(node_id.clone()));
            // Actors on the node lost their process with it.
            let mut on_node: Vec<ActorId> = self.alive_actors_on(&node_id).into_keys().collect();
            on_node.sort(); // in the order the scan of `actors` gave before the index
            for actor_id in on_node {
                self.actor_exited(
                    &actor_id,
                    None,
                    false,
                    format!("the actor's node {node_id} died: {reason}"),
                    changed,
                );
            }
            // Bundles on the node are lost; the group waits for them again.
            for pg in self.placement_groups.values_mut().filter(|p| !p.is_removed()) {
                let mut lost = false;
                for slot in pg.bundle_nodes.iter_mut() {
                    if slot.as_ref() == Some(&node_id) {
                        *slot = None;
                        lost = true;
                    }
                }
                if lost {
                    pg.status = PgStatus::Rescheduling;
                    changed.push(Changed::PlacementGroup(pg.pg_id.clone()));
                }
            }
        }
        Outcome::Done
    }
}
