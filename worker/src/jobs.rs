//! Job supervisors (AGENT-13): the node agent side of the Jobs API. The head places a
//! submitted job here (`StartJobSupervisor`); the agent builds its runtime environment,
//! runs the entrypoint with `/bin/sh -c` in its own process group, in the unpacked
//! `working_dir`, with `TPURAY_ADDRESS`/`RAY_ADDRESS` naming the cluster and
//! `TPURAY_SUBMISSION_ID` naming the job (so `init()` inside joins as this job), writes
//! its output to `<session>/logs/job-driver-<submission id>.log` (Ray's name), and
//! reports RUNNING and the end to the head, retrying until the head has it.
//!
//! - A stop is SIGTERM to the process group, then SIGKILL after
//!   `RAY_JOB_STOP_WAIT_TIME_S` (Ray's variable; 3 s by default).
//! - The entrypoint's `entrypoint_*` resources are held while it runs (taken at start, or
//!   the start is refused and the head places the job again later) and given back once.
//! - Every job known here (running, or ended with the end not yet reported) is listed
//!   in heartbeats; the head fails a placed job its agent stops listing.
//!
//! AGENT-13 in detail: the job's runtime environment (`tpuray_proto::runtime_env`) is
//! built by `runtime_env/` (one build per environment at a time; a failed or timed-out
//! build is removed and fails the job with pip's output). The entrypoint gets the
//! environment as `TPURAY_JOB_RUNTIME_ENV_JSON` (the Python driver makes it its job's
//! environment). Each report goes out with its own request id until the head has it.

use std::collections::HashMap;
use std::path::PathBuf;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use tokio::sync::watch;
use tpuray_proto::pb;
use tpuray_proto::runtime_env::JobRuntimeEnv;
use tpuray_scheduler::ResourceSet;

use crate::agent::{Agent, AgentError};

/// Ray's default `RAY_JOB_STOP_WAIT_TIME_S`.
const DEFAULT_STOP_WAIT: Duration = Duration::from_secs(3);
/// How much of the log's end a failed job's message carries (Ray: 20,000 characters).
const LOG_TAIL_CHARS: usize = 20_000;
/// Largest piece `ReadJobLogs` answers with.
const MAX_LOG_READ: u64 = 4 * 1024 * 1024;

/// The jobs this agent supervises, by submission id.
#[derive(Default)]
pub struct Supervisors {
    jobs: Mutex<HashMap<String, Supervised>>,
    pub(crate) envs: crate::runtime_env::Builder,
}

struct Supervised {
    stop: watch::Sender<bool>,
    /// The entrypoint's process (and process group) id once it runs; 0 before.
    pid: Arc<std::sync::atomic::AtomicU32>,
}

impl Supervisors {
    fn lock(&self) -> std::sync::MutexGuard<'_, HashMap<String, Supervised>> {
        self.jobs.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Submission ids of the jobs known here, for heartbeats.
    pub fn listed(&self) -> Vec<String> {
        self.lock().keys().cloned().collect()
    }

    /// The process groups of the running entrypoints (the agent stops them when it stops).
    pub fn process_groups(&self) -> Vec<u32> {
        self.lock()
            .values()
            .map(|s| s.pid.load(std::sync::atomic::Ordering::SeqCst))
            .filter(|p| *p > 0)
            .collect()
    }
}

/// Where job `submission_id`'s log lives.
pub fn log_path(session_dir: &std::path::Path, submission_id: &str) -> PathBuf {
    session_dir.join("logs").join(format!("job-driver-{submission_id}.log"))
}

fn stop_wait() -> Duration {
    tpuray_proto::runtime_env::env_seconds("RAY_JOB_STOP_WAIT_TIME_S", DEFAULT_STOP_WAIT)
}

/// A submission id safe to use in a file name.
fn check_id(id: &str) -> Result<(), AgentError> {
    if id.is_empty() || id.len() > 255 || id.contains(['/', '\0']) || id.starts_with('.') {
        return Err(AgentError::BadRequest(format!(
            "submission id {id:?} cannot name a log file (expected no '/', not starting with '.')"
        )));
    }
    Ok(())
}

impl Agent {
    /// `StartJobSupervisor`: starts the job unless it is known here already.
    ///
    /// # Errors
    /// [`AgentError::Ledger`] (`RESOURCE_EXHAUSTED`) when the entrypoint's resources are
    /// not free now (the head places it again), [`AgentError::BadRequest`] for a job
    /// without an id or with resources that do not parse.
    pub async fn start_job_supervisor(
        self: &Arc<Self>,
        job: pb::JobSubmission,
    ) -> Result<(), AgentError> {
        check_id(&job.submission_id)?;
        let id = job.submission_id.clone();
        let wanted = tpuray_proto::runtime_env::entrypoint_resources(
            job.entrypoint_num_cpus,
            job.entrypoint_num_gpus,
            job.entrypoint_memory,
            &job.entrypoint_resources,
        );
        let demand = ResourceSet::from_f64_map(&wanted)
            .map_err(|e| AgentError::BadRequest(format!("entrypoint resources: {e}")))?;
        let pid = Arc::new(std::sync::atomic::AtomicU32::new(0));
        let rx = {
            let mut jobs = self.supervisors.lock();
            if jobs.contains_key(&id) {
                return Ok(()); // a retried start
            }
            let (tx, rx) = watch::channel(job.stop_requested);
            if !demand.is_empty() {
                self.take_resources(&demand)?;
            }
            jobs.insert(id.clone(), Supervised { stop: tx, pid: Arc::clone(&pid) });
            rx
        };
        let agent = Arc::clone(self);
        tokio::spawn(async move {
            let end = agent.run_job(&job, rx, &pid).await;
            if !demand.is_empty() {
                agent.give_back_resources(&demand);
            }
            agent.report_job(&id, end).await;
            agent.supervisors.lock().remove(&id);
        });
        Ok(())
    }

    /// `StopJobSupervisor`: asks the job to stop; false when it is not known here.
    pub fn stop_job_supervisor(&self, submission_id: &str) -> bool {
        match self.supervisors.lock().get(submission_id) {
            Some(s) => {
                let _ = s.stop.send(true);
                true
            }
            None => false,
        }
    }

    /// `ReadJobLogs`.
    ///
    /// # Errors
    /// [`AgentError::BadRequest`] for an id that cannot name a log;
    /// [`AgentError::Internal`] when the log cannot be read.
    pub async fn read_job_logs(
        &self,
        req: pb::ReadJobLogsRequest,
    ) -> Result<pb::ReadJobLogsReply, AgentError> {
        check_id(&req.submission_id)?;
        let path = log_path(&self.config.session_dir, &req.submission_id);
        let max = if req.max_bytes == 0 { MAX_LOG_READ } else { req.max_bytes.min(MAX_LOG_READ) };
        tokio::task::spawn_blocking(move || {
            use std::io::{Read, Seek, SeekFrom};
            let mut f = match std::fs::File::open(&path) {
                Ok(f) => f,
                Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
                    return Ok(pb::ReadJobLogsReply { found: false, data: vec![], size: 0 });
                }
                Err(e) => return Err(AgentError::Internal(format!("{}: {e}", path.display()))),
            };
            let size = f.metadata().map(|m| m.len()).unwrap_or(0);
            let mut data = Vec::new();
            if req.offset < size {
                f.seek(SeekFrom::Start(req.offset))
                    .and_then(|_| f.take(max).read_to_end(&mut data))
                    .map_err(|e| AgentError::Internal(format!("{}: {e}", path.display())))?;
            }
            Ok(pb::ReadJobLogsReply { found: true, data, size })
        })
        .await
        .map_err(|e| AgentError::Internal(e.to_string()))?
    }

    /// Builds the environment, runs the entrypoint, and says how it ended.
    async fn run_job(
        self: &Arc<Self>,
        job: &pb::JobSubmission,
        mut stop: watch::Receiver<bool>,
        pid_out: &std::sync::atomic::AtomicU32,
    ) -> JobEnd {
        let id = &job.submission_id;
        let logs = self.config.session_dir.join("logs");
        let _ = std::fs::create_dir_all(&logs);
        let log = log_path(&self.config.session_dir, id);
        let setup_log = logs.join(format!("runtime_env_setup-{id}.log"));
        if *stop.borrow() {
            return JobEnd::stopped();
        }
        let env = match JobRuntimeEnv::parse_json(&job.runtime_env_json) {
            Ok(e) => e,
            Err(e) => return JobEnd::setup_failed(e),
        };
        let root = self.config.session_dir.join("runtime_resources");
        let prepared = tokio::select! {
            r = self.supervisors.envs.prepare(
                &self.config.head_address,
                self.config.token.as_deref(),
                &root,
                &env,
                &setup_log,
            ) => match r {
                Ok(p) => p,
                Err(e) => return JobEnd::setup_failed(e),
            },
            _ = stop_asked(&mut stop) => return JobEnd::stopped(),
        };
        let open = || std::fs::OpenOptions::new().create(true).append(true).open(&log);
        let (out, err) = match (open(), open()) {
            (Ok(o), Ok(e)) => (o, e),
            (Err(e), _) | (_, Err(e)) => {
                return JobEnd::start_failed(format!(
                    "cannot open the job's log {}: {e}",
                    log.display()
                ));
            }
        };
        let cwd = prepared.working_dir.clone().unwrap_or_else(|| self.config.session_dir.clone());
        let mut cmd = tokio::process::Command::new("/bin/sh");
        cmd.arg("-c")
            .arg(&job.entrypoint)
            .current_dir(&cwd)
            .stdin(std::process::Stdio::null())
            .stdout(out)
            .stderr(err)
            .process_group(0)
            .kill_on_drop(false);
        for (k, v) in &env.env_vars {
            cmd.env(k, v);
        }
        for (k, v) in prepared.env() {
            cmd.env(k, v);
        }
        let mut paths = prepared.python_path();
        if !paths.is_empty() {
            paths.extend(std::env::var("PYTHONPATH").ok().filter(|p| !p.is_empty()));
            cmd.env("PYTHONPATH", paths.join(":"));
        }
        cmd.env("TPURAY_ADDRESS", &self.config.head_address)
            .env("RAY_ADDRESS", &self.config.head_address)
            .env("TPURAY_SUBMISSION_ID", id)
            .env("TPURAY_JOB_RUNTIME_ENV_JSON", &job.runtime_env_json)
            .env("PYTHONUNBUFFERED", "1");
        if let Some(t) = &self.config.token {
            cmd.env(tpuray_proto::auth::TOKEN_ENV, t);
        }
        let mut child = match cmd.spawn() {
            Ok(c) => c,
            Err(e) => {
                return JobEnd::start_failed(format!(
                    "cannot start /bin/sh for the entrypoint: {e}"
                ));
            }
        };
        let pid = child.id().unwrap_or(0);
        pid_out.store(pid, std::sync::atomic::Ordering::SeqCst);
        if let Some(e) = crate::registry::ProcEntry::for_pid(
            pid,
            "job",
            &self.config.session_dir.display().to_string(),
            "",
        ) {
            let _ = crate::registry::record(&e);
        }
        self.send_report(id, "RUNNING", String::new(), String::new(), None).await;
        tokio::select! {
            status = child.wait() => {
                let code = status.ok().map(|s| {
                    use std::os::unix::process::ExitStatusExt;
                    s.code().unwrap_or_else(|| -s.signal().unwrap_or(0))
                });
                match code {
                    Some(0) => JobEnd { status: "SUCCEEDED", message: String::new(), error_type: "", exit_code: Some(0) },
                    c => {
                        let c = c.unwrap_or(-1);
                        let tail = log_tail(&log);
                        let message = if tail.is_empty() {
                            format!("Job entrypoint command failed with exit code {c}. No logs available.")
                        } else {
                            format!(
                                "Job entrypoint command failed with exit code {c}, last available logs (truncated to 20,000 chars):\n{tail}"
                            )
                        };
                        JobEnd { status: "FAILED", message, error_type: "JOB_ENTRYPOINT_COMMAND_ERROR", exit_code: Some(c) }
                    }
                }
            }
            _ = stop_asked(&mut stop) => {
                let group = -(pid as i32);
                // SAFETY: kill(2) on the entrypoint's own process group (process_group(0)).
                unsafe { libc::kill(group, libc::SIGTERM) };
                if tokio::time::timeout(stop_wait(), child.wait()).await.is_err() {
                    tracing::warn!(submission_id = %id, "the job did not stop within {:?} of SIGTERM; SIGKILL", stop_wait());
                }
                // The whole group, stragglers included.
                // SAFETY: as above.
                unsafe { libc::kill(group, libc::SIGKILL) };
                let _ = child.wait().await;
                JobEnd::stopped()
            }
        }
    }

    async fn report_job(&self, id: &str, end: JobEnd) {
        self.send_report(id, end.status, end.message, end.error_type.into(), end.exit_code).await;
    }

    /// Sends a status to the head until it has it (same request id on every try, so it
    /// applies once), or the head says the job is gone. A head client that cannot be
    /// made ([`AgentError::Internal`]) or a failed call ([`AgentError::Head`]) is
    /// logged and retried.
    async fn send_report(
        &self,
        submission_id: &str,
        status: &str,
        message: String,
        error_type: String,
        exit_code: Option<i32>,
    ) {
        let req = pb::ReportJobStatusRequest {
            request_id: tpuray_proto::new_request_id(),
            submission_id: submission_id.into(),
            node_id: self.config.node_id.to_string(),
            status: status.into(),
            message,
            error_type,
            exit_code,
        };
        loop {
            let client =
                tpuray_proto::client::head(&self.config.head_address, self.config.token.as_deref());
            let r = match client {
                Ok(mut head) => {
                    head.report_job_status(req.clone()).await.map(|_| ()).map_err(AgentError::from)
                }
                Err(e) => Err(AgentError::Internal(e.to_string())),
            };
            match r {
                Ok(()) => return,
                Err(AgentError::Head { code: tonic::Code::NotFound, .. }) => return,
                Err(e) => {
                    tracing::warn!(%submission_id, %status, "cannot report the job's status yet: {e}");
                    tokio::time::sleep(Duration::from_secs(1)).await;
                }
            }
        }
    }
}

/// Resolves once a stop is asked for (the watch's guard is not held across awaits).
async fn stop_asked(rx: &mut watch::Receiver<bool>) {
    let _ = rx.wait_for(|s| *s).await;
}

/// How a job ended, as reported.
struct JobEnd {
    status: &'static str,
    message: String,
    error_type: &'static str,
    exit_code: Option<i32>,
}

impl JobEnd {
    fn stopped() -> Self {
        Self { status: "STOPPED", message: String::new(), error_type: "", exit_code: None }
    }
    fn setup_failed(e: String) -> Self {
        Self {
            status: "FAILED",
            message: format!("runtime_env setup failed: {e}"),
            error_type: "RUNTIME_ENV_SETUP_FAILURE",
            exit_code: None,
        }
    }
    fn start_failed(e: String) -> Self {
        Self {
            status: "FAILED",
            message: e,
            error_type: "JOB_ENTRYPOINT_COMMAND_START_ERROR",
            exit_code: None,
        }
    }
}

/// The last [`LOG_TAIL_CHARS`] characters of a log.
fn log_tail(path: &std::path::Path) -> String {
    let text =
        std::fs::read(path).map(|b| String::from_utf8_lossy(&b).into_owned()).unwrap_or_default();
    let chars: Vec<char> = text.chars().collect();
    let start = chars.len().saturating_sub(LOG_TAIL_CHARS);
    chars[start..].iter().collect::<String>().trim_end().to_string()
}
