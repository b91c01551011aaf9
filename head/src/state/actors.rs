//! Actor commands (HEAD-3, ACTOR-1): created (one live actor per name), alive, exited
//! (restarted while restarts remain, else dead).
//!
//! ACTOR-1: any exit not asked for with `kill` counts against `max_restarts`, exit code 0
//! included; stale reports about an older worker are ignored. Non-detached actors die
//! with their job. An actor that exits through `exit_actor()` is killed with `no_restart`
//! and so is recorded dead (intended: no restart).

use super::*;

impl StateMachine {
    pub(super) fn apply_create_actor(
        &mut self,
        actor: ActorRecord,
        get_if_exists: bool,
        changed: &mut Vec<Changed>,
    ) -> Outcome {
        if !actor.name.is_empty() {
            let key = (actor.namespace.clone(), actor.name.clone());
            if let Some(existing) = self.named_actors.get(&key) {
                if get_if_exists {
                    return Outcome::Actor(existing.clone());
                }
                return Outcome::Rejected(Rejection::AlreadyExists(format!(
                    "actor named {:?} already exists in namespace {:?}",
                    actor.name, actor.namespace
                )));
            }
            self.named_actors.insert(key, actor.actor_id.clone());
        }
        let id = actor.actor_id.clone();
        if actor.wants_placement() {
            self.waiting_actors.insert(id.clone());
        }
        self.actors.insert(id.clone(), actor);
        changed.push(Changed::Actor(id.clone()));
        Outcome::Actor(id)
    }

    pub(super) fn apply_actor_alive(
        &mut self,
        actor_id: ActorId,
        node_id: NodeId,
        worker_id: WorkerId,
        address: String,
        pid: u32,
        changed: &mut Vec<Changed>,
    ) -> Outcome {
        let Some(actor) = self.actors.get_mut(&actor_id) else {
            return Outcome::Rejected(Rejection::NotFound(format!("no actor {actor_id}")));
        };
        if actor.is_dead() {
            return Outcome::Rejected(Rejection::Invalid(format!("actor {actor_id} is dead")));
        }
        // HEAD-8: two starts of one attempt can both succeed (a start in flight when its
        // leader lost the term, and the new leader's own placement): the first recorded
        // worker is the actor's; the other is refused, and its starter stops it.
        if let ActorStatus::Alive { worker_id: running, .. } = &actor.status {
            if *running == worker_id {
                return Outcome::Actor(actor_id);
            }
            return Outcome::Rejected(Rejection::AlreadyExists(format!(
                "actor {actor_id} already runs in worker {running}"
            )));
        }
        actor.last_placement = Some((node_id.clone(), pid));
        self.set_actor_status(&actor_id, ActorStatus::Alive { node_id, worker_id, address, pid });
        changed.push(Changed::Actor(actor_id.clone()));
        Outcome::Actor(actor_id)
    }

    pub(super) fn apply_actor_worker_exited(
        &mut self,
        actor_id: ActorId,
        worker_id: Option<WorkerId>,
        intended: bool,
        cause: String,
        changed: &mut Vec<Changed>,
    ) -> Outcome {
        if !self.actors.contains_key(&actor_id) {
            return Outcome::Rejected(Rejection::NotFound(format!("no actor {actor_id}")));
        }
        self.actor_exited(&actor_id, worker_id.as_ref(), intended, cause, changed);
        Outcome::Actor(actor_id)
    }

    /// ACTOR-1: an exit that was not asked for counts against
    /// `max_restarts`, whatever its exit code; a stale report about an older
    /// worker of the same actor changes nothing.
    pub(super) fn actor_exited(
        &mut self,
        actor_id: &ActorId,
        worker_id: Option<&WorkerId>,
        intended: bool,
        cause: String,
        changed: &mut Vec<Changed>,
    ) {
        let Some(actor) = self.actors.get_mut(actor_id) else {
            return;
        };
        if actor.is_dead() {
            return;
        }
        if let Some(w) = worker_id {
            match &actor.status {
                ActorStatus::Alive { worker_id: cur, .. } if cur == w => {}
                _ => return,
            }
        }
        if !intended && actor.restarts_left() {
            actor.num_restarts += 1;
            self.set_actor_status(actor_id, ActorStatus::Restarting { cause });
        } else {
            let cause = if intended || actor.max_restarts == 0 {
                cause
            } else {
                format!(
                    "{cause} (restarted {} times, max_restarts={})",
                    actor.num_restarts, actor.max_restarts
                )
            };
            if !actor.name.is_empty() {
                self.named_actors.remove(&(actor.namespace.clone(), actor.name.clone()));
            }
            self.set_actor_status(actor_id, ActorStatus::Dead { cause });
        }
        changed.push(Changed::Actor(actor_id.clone()));
    }
}
