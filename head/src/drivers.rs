//! HEAD-12: a driver job whose driver process is gone ends, as Ray's GCS ends the job of
//! a driver that died (SIGKILL, the OOM killer, a pod eviction: a driver that exits
//! normally says so with `FinishJob`). The serving leader probes every running job's
//! driver address (its `WorkerService`, open for the driver's whole life) every
//! [`CHECK_EVERY`]: a refused connection twice in a row means the process is gone (its
//! port closed); no answer at all for [`SILENT_FOR`] means its host is gone or cut off.
//! Either way the job finishes as if its driver had called `FinishJob`: its non-detached
//! actors and placement groups end and its unfinished tasks fail, naming why. Jobs
//! registered without a driver address are not watched. Ending a job (`Head::finish_job`,
//! also `FinishJob` itself) is here too.

use std::sync::Arc;
use std::time::{Duration, Instant};

use std::collections::HashMap;

use tonic::Status;
use tpuray_proto::ids::{ActorId, JobId};
use tpuray_proto::now_ms;

use crate::server::{Head, rejection_status};
use crate::state::{ActorRecord, ActorStatus, Command, CommandKind, JobStatus, Outcome};

/// How often running drivers are probed.
pub const CHECK_EVERY: Duration = Duration::from_secs(2);
/// How long a driver may not answer at all before its job ends.
pub const SILENT_FOR: Duration = Duration::from_secs(30);
/// How long one probe waits for the connection.
const PROBE_TIMEOUT: Duration = Duration::from_secs(1);

/// What one probe of a driver's address found.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Probe {
    Alive,
    /// Connection refused: nothing listens there (the process is gone).
    Refused,
    /// No answer (timeout, unreachable host).
    Silent,
}

async fn probe(address: &str) -> Probe {
    match tokio::time::timeout(PROBE_TIMEOUT, tokio::net::TcpStream::connect(address)).await {
        Ok(Ok(_)) => Probe::Alive,
        Ok(Err(e)) if e.kind() == std::io::ErrorKind::ConnectionRefused => Probe::Refused,
        _ => Probe::Silent,
    }
}

impl Head {
    /// One round of HEAD-12 (leader only).
    pub(crate) async fn check_drivers(self: &Arc<Self>) {
        if !self.is_leader() {
            self.driver_misses.lock().unwrap_or_else(|p| p.into_inner()).clear();
            return;
        }
        let running: Vec<(JobId, String)> = {
            let inner = self.lock();
            inner
                .sm
                .jobs
                .values()
                .filter(|j| j.status == JobStatus::Running && !j.driver_address.is_empty())
                .map(|j| (j.job_id.clone(), j.driver_address.clone()))
                .collect()
        };
        // Concurrently: a round takes at most one probe timeout.
        let handles: Vec<_> = running
            .iter()
            .map(|(_, a)| {
                let a = a.clone();
                tokio::spawn(async move { probe(&a).await })
            })
            .collect();
        let mut results = Vec::with_capacity(handles.len());
        for h in handles {
            results.push(h.await.unwrap_or(Probe::Silent));
        }
        let mut dead = Vec::new();
        {
            let mut misses = self.driver_misses.lock().unwrap_or_else(|p| p.into_inner());
            misses.retain(|id, _| running.iter().any(|(j, _)| j == id));
            for ((job_id, address), result) in running.iter().zip(results) {
                match result {
                    Probe::Alive => {
                        misses.remove(job_id);
                    }
                    Probe::Refused => match misses.get(job_id) {
                        Some((_, true)) => dead.push((
                            job_id.clone(),
                            format!("lost its driver (nothing listens at {address} any more)"),
                        )),
                        _ => {
                            misses.insert(job_id.clone(), (Instant::now(), true));
                        }
                    },
                    Probe::Silent => {
                        let (since, _) =
                            *misses.entry(job_id.clone()).or_insert((Instant::now(), false));
                        if since.elapsed() >= SILENT_FOR {
                            dead.push((
                                job_id.clone(),
                                format!(
                                    "lost its driver (no answer from {address} for {} s)",
                                    SILENT_FOR.as_secs()
                                ),
                            ));
                        }
                    }
                }
            }
            for (job_id, _) in &dead {
                misses.remove(job_id);
            }
        }
        for (job_id, why) in dead {
            tracing::warn!(%job_id, "the job {why}; it ends");
            if let Err(e) =
                self.finish_job(tpuray_proto::new_request_id(), job_id.clone(), &why).await
            {
                tracing::warn!(%job_id, "cannot end the job yet: {}", e.message());
            }
        }
    }
}

impl Head {
    /// Ends driver job `job_id` (its non-detached actors' workers are stopped, its
    /// groups removed, its unfinished tasks failed); `how` says why in the tasks' error
    /// ("finished", "lost its driver ...").
    ///
    /// # Errors
    /// As [`Head::commit`]; `NOT_FOUND` for an unknown job.
    pub(crate) async fn finish_job(
        self: &Arc<Self>,
        request_id: String,
        job_id: JobId,
        how: &str,
    ) -> Result<(), Status> {
        let finished = job_id.to_string();
        // Remember which actors die with the job, to stop their workers.
        let before: Vec<(ActorId, String)> =
            self.alive_actor_agents(|a| a.job_id == job_id && !a.detached);
        if let Outcome::Rejected(r) = self
            .commit(Command {
                request_id,
                kind: CommandKind::FinishJob { job_id, end_time_ms: now_ms() },
            })
            .await?
        {
            return Err(rejection_status(r));
        }
        let why = format!("the task's job {finished} {how} before the task ended");
        self.after_jobs_ended(before, &HashMap::from([(finished, why)]));
        Ok(())
    }

    /// What the end of driver jobs does beyond their durable records (which ended their
    /// actors and groups): stops the workers of the actors that were alive (`actors`,
    /// read before the commit), and marks the jobs' tasks that are not FINISHED or FAILED
    /// as FAILED with the job's reason from `ended` (Ray's GCS does the same when a job
    /// ends); an owner's late FINISHED event still wins.
    pub(crate) fn after_jobs_ended(
        self: &Arc<Self>,
        actors: Vec<(ActorId, String)>,
        ended: &HashMap<String, String>,
    ) {
        for (actor_id, addr) in actors {
            let head = Arc::clone(self);
            tokio::spawn(async move {
                let _ = head.kill_actor_worker(&addr, &actor_id, None, false).await;
            });
        }
        if ended.is_empty() {
            return;
        }
        let now = now_ms();
        let mut inner = self.lock();
        for t in inner.tasks.values_mut() {
            if let Some(why) = ended.get(&t.job_id)
                && !matches!(t.state.as_str(), "FINISHED" | "FAILED")
            {
                t.state = "FAILED".into();
                t.error = why.clone();
                t.finished_ms = now;
            }
        }
    }

    /// The live actors matching `pred`, with their node agent's address.
    pub(crate) fn alive_actor_agents(
        &self,
        pred: impl Fn(&ActorRecord) -> bool,
    ) -> Vec<(ActorId, String)> {
        let inner = self.lock();
        inner
            .sm
            .actors
            .values()
            .filter(|a| pred(a))
            .filter_map(|a| match &a.status {
                ActorStatus::Alive { node_id, .. } => {
                    inner.sm.nodes.get(node_id).map(|n| (a.actor_id.clone(), n.address.clone()))
                }
                _ => None,
            })
            .collect()
    }
}
