//! Actor workers for the head: one worker process per actor, started with the actor's
//! resources taken from the node (AGENT-2) and its creation task, and killed on the
//! head's word (intended, or for a restart).

use std::sync::Arc;

use tpuray_proto::ids::{ActorId, JobId, WorkerId};
use tpuray_proto::pb;

use super::resources::chips_wanted;
use super::{Agent, AgentError, PoolKey, WorkerState, signal};

/// The worker id an actor's resources are held under while its worker starts.
fn starting() -> WorkerId {
    WorkerId::from_wire("")
}

/// Gives an actor's resources back when its start is dropped half-way (the request's
/// handler cancelled), so a later request starts it afresh instead of waiting for it.
struct StartGuard<'a> {
    agent: &'a Arc<Agent>,
    actor_id: &'a ActorId,
    armed: bool,
}

impl Drop for StartGuard<'_> {
    fn drop(&mut self) {
        if !self.armed {
            return;
        }
        let mut st = self.agent.lock();
        if st.actor_resources.get(self.actor_id).is_some_and(|(w, _)| *w == starting())
            && let Some((_, r)) = st.actor_resources.remove(self.actor_id)
        {
            st.ledger.release(&r);
        }
        drop(st);
        self.agent.freed.notify_waiters();
    }
}

impl Agent {
    /// Starts the worker of actor `actor_id` of job `job_id`, holding `resources` (taken
    /// from the node now, given back when the worker exits or fails to start, AGENT-2),
    /// and returns `(worker id, address, pid)`. `creation_task`: the encoded creation
    /// `TaskSpec`; its function's language and runtime environment pick the worker. A
    /// retried request for an actor already running here gets the same answer, and one
    /// for an actor whose worker is still starting waits for that start (two requests
    /// once started two workers for one actor, and the head recorded one while callers
    /// had reached the other).
    ///
    /// # Errors
    /// [`AgentError::Ledger`] when the resources are not free, what starting the worker
    /// failed with otherwise ([`AgentError::Refused`] when the constructor raised).
    pub(super) async fn start_actor_worker(
        self: &Arc<Self>,
        actor_id: &ActorId,
        job_id: &JobId,
        resources: tpuray_scheduler::ResourceSet,
        creation_task: &[u8],
    ) -> Result<(WorkerId, String, u32), AgentError> {
        loop {
            let starting = {
                let mut st = self.lock();
                match st.actor_resources.get(actor_id) {
                    // A retried request for an actor already running here: same answer.
                    Some((wid, _))
                        if st.workers.get(wid).is_some_and(|w| !w.address.is_empty()) =>
                    {
                        let w = &st.workers[wid];
                        return Ok((wid.clone(), w.address.clone(), w.pid));
                    }
                    Some(_) => true,
                    None => {
                        st.ledger
                            .take(&format!("actor {actor_id}"), &resources)
                            .map_err(|e| AgentError::ledger(&self.config.node_id, e))?;
                        st.actor_resources
                            .insert(actor_id.clone(), (starting(), resources.clone()));
                        false
                    }
                }
            };
            if !starting {
                break;
            }
            // One whose worker is still starting (the head asked again meanwhile): it
            // waits for that start, never a second worker for the same actor.
            tokio::time::sleep(std::time::Duration::from_millis(20)).await;
        }
        let mut unfinished = StartGuard { agent: self, actor_id, armed: true };
        let started = self.start_actor_started(actor_id, job_id, resources, creation_task).await;
        unfinished.armed = false;
        started
    }

    /// [`Agent::start_actor_worker`] once the actor's resources are held here.
    async fn start_actor_started(
        self: &Arc<Self>,
        actor_id: &ActorId,
        job_id: &JobId,
        resources: tpuray_scheduler::ResourceSet,
        creation_task: &[u8],
    ) -> Result<(WorkerId, String, u32), AgentError> {
        // The actor's language and runtime environment are its creation task's.
        let creation = <pb::TaskSpec as prost::Message>::decode(creation_task).ok();
        let language = creation
            .as_ref()
            .and_then(|t| t.function.as_ref())
            .map(|f| f.language.clone())
            .filter(|l| !l.is_empty())
            .unwrap_or_else(|| "rust".into());
        let key = PoolKey {
            job_id: job_id.to_string(),
            language,
            runtime_env_hash: creation.map(|t| t.runtime_env_hash).unwrap_or_default(),
            tpu_chips: vec![],
            gpus: vec![],
        };
        let chips = match chips_wanted(&resources, self.lock().ledger.host_chips()) {
            Ok(c) => c,
            Err(e) => {
                let mut st = self.lock();
                if let Some((_, r)) = st.actor_resources.remove(actor_id) {
                    st.ledger.release(&r);
                }
                return Err(e);
            }
        };
        match self
            .start_worker(
                key,
                chips,
                tpuray_scheduler::bundles::plain_amount(&resources, "GPU"),
                WorkerState::Actor(actor_id.clone()),
                Some((actor_id, creation_task)),
            )
            .await
        {
            Ok((wid, address, pid)) => {
                if let Some(e) = self.lock().actor_resources.get_mut(actor_id) {
                    e.0 = wid.clone();
                }
                tracing::info!(%actor_id, worker_id = %wid, pid, "actor worker started");
                Ok((wid, address, pid))
            }
            Err(e) => {
                let mut st = self.lock();
                if let Some((_, r)) = st.actor_resources.remove(actor_id) {
                    st.ledger.release(&r);
                }
                drop(st);
                self.freed.notify_waiters();
                Err(e)
            }
        }
    }

    /// Stops the worker of actor `actor_id` (only worker `only`, when given): SIGKILL
    /// with `force`, SIGTERM otherwise; `restart` marks the exit as not intended, so the
    /// head restarts the actor. Returns whether such a worker runs here.
    pub(super) fn kill_actor_worker(
        &self,
        actor_id: &ActorId,
        only: Option<&WorkerId>,
        restart: bool,
        force: bool,
    ) -> bool {
        let pid = {
            let mut st = self.lock();
            st.workers
                .iter_mut()
                .find(|(id, w)| {
                    w.state == WorkerState::Actor(actor_id.clone()) && only.is_none_or(|o| o == *id)
                })
                .map(|(_, w)| {
                    w.exit_intended = !restart;
                    w.pid
                })
        };
        if let Some(pid) = pid {
            signal(pid, if force { libc::SIGKILL } else { libc::SIGTERM });
        }
        pid.is_some()
    }
}
