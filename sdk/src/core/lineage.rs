//! What the owner does when copies are lost (CORE-6, CORE-10): a stored object whose
//! every copy is gone is made again by running its task (same return ids) while
//! retries remain, else it fails.
//!
//! In full:
//! - CORE-6 (lineage): the owner keeps the spec and pinned arguments of the task that
//!   made each stored object while the object lives; when no copy can be read (every
//!   node holding one is gone), it runs the task again with the same return ids while
//!   retries remain (the same budget), and readers wait for the new copy; a lost
//!   argument is made again the same way when the new run reads it. A lost `put` fails
//!   with `ObjectLost`; a borrower whose owner cannot be reached gets `ObjectLost`
//!   beginning "owner died" (Python: `OwnerDiedError`). Not yet: actor-task results are
//!   not reconstructed.
//! - CORE-10 (`node_watch.rs`, `Core::watch_nodes`): drivers from `init`, and workers
//!   from their first submission, actor call or pull, follow the head's state changes
//!   (`Subscribe`, resumed after the last sequence number when the stream breaks) and
//!   act on a node's death at once rather than on a transport keep-alive: pushes to its
//!   workers end as worker deaths (retried per `max_retries`), actor calls there as
//!   lost connections (resent per `max_task_retries`, or not sent at all while the
//!   head's record still names the dead node), pulls from its store as a lost source,
//!   and owned objects whose copies were only there are made again from lineage (or
//!   fail as lost) without waiting for a reader; copies a dead node reports later are
//!   ignored, and a dead node's agent is not asked to take a lease back. A driver's
//!   `shutdown` ends its subscription (`Core::stop_watching_nodes`): an open stream
//!   held the head's graceful stop, so stopping a local `init()` cluster waited out
//!   `tpuray stop`'s 10 s grace.

use super::*;

impl Core {
    /// What an owner does when a node dies (CORE-10); waits on the node end by
    /// themselves through [`crate::node_watch::NodeDeaths::died`].
    pub(super) fn on_node_death(self: &Arc<Self>, node_id: &str) {
        let lost: Vec<String> = {
            let objs = self.objects.lock().unwrap();
            objs.iter()
                .filter(|(_, o)| match &o.state {
                    ObjState::Stored { locations, .. } => {
                        locations.iter().any(|l| l.node_id == node_id)
                    }
                    _ => false,
                })
                .map(|(id, _)| id.clone())
                .collect()
        };
        let dead = [node_id.to_string()];
        for id in lost {
            self.object_lost(&id, &dead);
        }
    }

    /// Copies of owned object `id` on the nodes `lost` cannot be read: drops
    /// those locations and, when none is left, runs the task that made it
    /// again (CORE-6) or, without lineage or retries, fails it as lost.
    pub(super) fn object_lost(self: &Arc<Self>, id: &str, lost: &[String]) {
        let redo = {
            let mut objs = self.objects.lock().unwrap();
            let Some(o) = objs.get_mut(id) else { return };
            if let Some(p) = o.pulls.as_mut() {
                p.lost(lost);
            }
            let ObjState::Stored { locations, .. } = &mut o.state else { return };
            locations.retain(|l| !lost.contains(&l.node_id));
            if !locations.is_empty() {
                return;
            }
            // CORE-6: the task that made it runs again while it has retries (the one
            // retry decision, as for a lost worker).
            let again = o.lineage.clone().and_then(|l| {
                let attempt = retry::Attempt {
                    work: retry::Work::Task,
                    retries_left: l.retries_left,
                    retry_exceptions: l.retry_exceptions,
                    cancelled: false,
                    undelivered: 0,
                };
                match retry::decide(&attempt, retry::Outcome::ReturnsLost) {
                    retry::Decision::Retry { retries_left } => Some((l, retries_left)),
                    _ => None,
                }
            });
            let had_lineage = o.lineage.is_some();
            match again {
                Some((l, left)) => {
                    // Every stored return of that task comes back with the new run.
                    for rid in &l.spec.return_ids {
                        if let Some(r) = objs.get_mut(rid)
                            && matches!(r.state, ObjState::Stored { .. })
                        {
                            r.state = ObjState::Pending;
                            r.lineage = None;
                        }
                    }
                    (l, left)
                }
                None => {
                    let why = if had_lineage {
                        "the task that made it has no retries left"
                    } else {
                        "it was made by put, so no task can make it again"
                    };
                    o.state = ObjState::failed(pb::TaskError {
                        kind: Kind::ObjectLost as i32,
                        message: format!("every copy was lost with its node and {why}"),
                        function_name: id.to_string(),
                        ..Default::default()
                    });
                    drop(objs);
                    self.objects_changed.notify_waiters();
                    return;
                }
            }
        };
        self.objects_changed.notify_waiters();
        let (redo, left) = redo;
        let mut spec = redo.spec.clone();
        spec.attempt += 1;
        self.event(&spec, "RETRYING", "reconstructing a lost return object");
        redo.class.queue.lock().unwrap().push_back(Queued {
            spec,
            retries_left: left,
            retry_exceptions: redo.retry_exceptions,
            pins: redo.pins.clone(),
        });
        redo.class.queued.notify_one();
        self.ensure_leases(&redo.class);
    }
}
