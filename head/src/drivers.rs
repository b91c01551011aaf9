//! HEAD-12: a driver job whose driver process is gone ends, as Ray's GCS ends the job of
//! a driver that died (SIGKILL, the OOM killer, a pod eviction: a driver that exits
//! normally says so with `FinishJob`). The serving leader probes every running job's
//! driver address (its `WorkerService`, open for the driver's whole life) every
//! [`CHECK_EVERY`]: a refused connection twice in a row means the process is gone (its
//! port closed); no answer at all for [`SILENT_FOR`] means its host is gone or cut off.
//! Either way the job finishes as if its driver had called `FinishJob`: its non-detached
//! actors and placement groups end and its unfinished tasks fail, naming why. Jobs
//! registered without a driver address are not watched.

use std::sync::Arc;
use std::time::{Duration, Instant};

use tpuray_proto::ids::JobId;

use crate::server::Head;
use crate::state::JobStatus;

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
