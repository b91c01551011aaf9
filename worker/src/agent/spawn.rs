//! Starting worker processes: the command (the job's binary, BIN-1, or a Python
//! interpreter from the job's runtime record, AGENT-8), its environment (runtime env,
//! AGENT-13/14/15; chips, AGENT-7; GPUs, AGENT-10), its log files (LOGS-2), waiting for it
//! to register, and pre-starting idle workers.
//!
//! AGENT-9: a worker whose runtime environment names `TPU_VISIBLE_CHIPS` (a gang member
//! planned for one chip) gets exactly that aligned block or a clear error, and the
//! environment's `TPU_*` variables win over the independent-process defaults of AGENT-7
//! (process bounds of a gang spread over a host's processes, the gang's ports).
//!
//! Python workers run in their runtime environment (AGENT-13): a task's or actor's own
//! record (`runtime_env/<hash>` in the KV, already merged over the job's by the SDK as
//! Ray merges them), else the job's, built on their node on first use.
//!
//! LOGS-2: worker log files carry Ray's names, `worker-<worker id>-<job
//! id>-<pid>.{out,err}`; the agent opens them before the pid is known and renames them
//! once it is.

use std::process::Stdio;

use tpuray_proto::pb;

use super::*;
use crate::registry;

/// mimalloc's environment variable for its `allow_thp` option (ALLOC-2).
const MIMALLOC_THP: &str = "MIMALLOC_ALLOW_THP";

impl Agent {
    /// A worker process this agent started registered from `address` with `pid`: the
    /// start waiting for it goes on.
    ///
    /// # Errors
    /// [`AgentError::NotFound`] for a worker id this agent did not start (or gave up on).
    pub(super) fn worker_registered(
        &self,
        worker_id: &WorkerId,
        address: String,
        pid: u32,
    ) -> Result<(), AgentError> {
        let tx = self.lock().starting.remove(worker_id).ok_or_else(|| {
            AgentError::NotFound(format!(
                "unknown worker id {worker_id}: this node agent did not start it"
            ))
        })?;
        let _ = tx.send((address, pid));
        Ok(())
    }

    /// Starts up to `count` idle workers of `key` in the background, up to the node's
    /// CPUs counting the workers of `key` already here; returns how many it starts.
    pub(super) fn prestart_workers(self: &Arc<Self>, key: PoolKey, count: u32) -> u32 {
        // Up to the node's CPUs, counting workers this job already has here.
        let cpus = (self.lock().ledger.total().get("CPU").0
            / tpuray_scheduler::resources::UNITS_PER_WHOLE)
            .max(1) as u32;
        let have = self.lock().workers.values().filter(|w| w.key == key).count() as u32;
        let n = count.min(cpus).saturating_sub(have);
        for _ in 0..n {
            let agent = Arc::clone(self);
            let key = key.clone();
            tokio::spawn(async move {
                let _permit = Arc::clone(&agent.starts).acquire_owned().await;
                let idle = WorkerState::Idle { since: Instant::now() };
                if let Err(e) = agent.start_worker(key, 0, Amount::ZERO, idle, None).await {
                    tracing::warn!(%e, "pre-starting a worker failed");
                }
            });
        }
        n
    }

    pub(super) async fn start_worker(
        self: &Arc<Self>,
        key: PoolKey,
        chips: u32,
        gpus: Amount,
        state: WorkerState,
        actor: Option<(&ActorId, &[u8])>,
    ) -> Result<(WorkerId, String, u32), AgentError> {
        if self.stopping.load(std::sync::atomic::Ordering::SeqCst) {
            return Err(AgentError::Unavailable("node agent is stopping".into()));
        }
        let worker_id = WorkerId::random();
        let logs = self.config.session_dir.join("logs");
        let _ = std::fs::create_dir_all(&logs);
        // Named as Ray names them once the pid is known (LOGS-2, below).
        let out_path = logs.join(format!("worker-{}-{}.out", worker_id.as_str(), key.job_id));
        let err_path = logs.join(format!("worker-{}-{}.err", worker_id.as_str(), key.job_id));
        let open = |p: &PathBuf| {
            std::fs::File::create(p).map_err(|e| {
                AgentError::Internal(format!("cannot create worker log {}: {e}", p.display()))
            })
        };
        let (out, err) = (open(&out_path)?, open(&err_path)?);
        // The task's or actor's environment (already merged with its job's by the SDK).
        let task_env = if key.runtime_env_hash.is_empty() {
            None
        } else {
            Some(self.runtime_env_record(&key.runtime_env_hash).await?)
        };
        let (command, env_uses) = if key.language == "python" {
            self.python_worker_command(&key.job_id, task_env.as_ref()).await?
        } else {
            (
                WorkerCommand {
                    argv: self.worker_command_for(&key.job_id).await?,
                    ..Default::default()
                },
                None,
            )
        };
        let (prog, args) = command
            .argv
            .split_first()
            .ok_or_else(|| AgentError::Internal("no worker command configured".into()))?;
        let mut cmd = tokio::process::Command::new(prog);
        // Where the worker sends its output (Python workers; Ray prints it at the driver).
        if let Ok((_, driver)) = self.job_record(&key.job_id).await
            && !driver.is_empty()
        {
            cmd.env("TPURAY_DRIVER_ADDRESS", driver);
        }
        if let Some(dir) = &command.cwd {
            cmd.current_dir(dir);
        }
        cmd.envs(command.env.iter().map(|(k, v)| (k.as_str(), v.as_str())));
        let runtime_vars = task_env.as_ref().map(runtime_env_vars).unwrap_or_default();
        for (k, v) in &runtime_vars {
            cmd.env(k, v);
        }
        // ALLOC-2: the worker's mimalloc (ALLOC-1) asks for no transparent huge pages
        // unless the node's environment or the runtime environment's env_vars say
        // otherwise. With them, a worker zeroed a 2 MiB page at each of its first
        // allocations: a fifth of a starting Python worker's CPU and 10 MiB of RSS each;
        // 200 actors created at once: 19-23 -> 31-34 a second (bench/limits.py --cases
        // actors). `MIMALLOC_ALLOW_THP` is mimalloc's option `allow_thp`. mimalloc turns
        // them off for the whole process, so the worker narrows that to its heap
        // (ALLOC-3, `tpuray::thp`) when the choice was this default.
        let thp_chosen = std::env::var_os(MIMALLOC_THP).is_some()
            || runtime_vars.iter().any(|(k, _)| k == MIMALLOC_THP);
        if thp_chosen {
            cmd.env_remove(tpuray_proto::THP_EXCEPT_ADVISED_ENV);
        } else {
            cmd.env(MIMALLOC_THP, "0").env(tpuray_proto::THP_EXCEPT_ADVISED_ENV, "1");
        }
        cmd.args(args)
            .env("TPURAY_AGENT_ADDRESS", &self.config.advertise_address)
            .env("TPURAY_HEAD_ADDRESS", &self.config.head_address)
            .env("TPURAY_NODE_ID", self.config.node_id.as_str())
            .env("TPURAY_WORKER_ID", worker_id.as_str())
            .env("TPURAY_JOB_ID", &key.job_id)
            .env("TPURAY_SESSION_DIR", &self.config.session_dir)
            .env("TPURAY_AGENT_PID", std::process::id().to_string())
            .env("TPURAY_OBJECT_STORE_DIR", self.config.store.dir())
            .stdin(Stdio::null())
            .stdout(out)
            .stderr(err)
            .kill_on_drop(false);
        if let Some(t) = &self.config.token {
            cmd.env(tpuray_proto::auth::TOKEN_ENV, t);
        }
        let required = self.auth_required.load(std::sync::atomic::Ordering::SeqCst);
        cmd.env(tpuray_proto::auth::AUTH_MODE_ENV, if required { "token" } else { "disabled" });
        if let Some((a, creation)) = actor {
            cmd.env("TPURAY_ACTOR_ID", a.as_str());
            if !creation.is_empty() {
                let path = self.config.session_dir.join(format!(
                    "actor-{}-{}.task",
                    a.short(),
                    worker_id.short()
                ));
                std::fs::write(&path, creation).map_err(|e| {
                    AgentError::Internal(format!(
                        "cannot write actor creation task {}: {e}",
                        path.display()
                    ))
                })?;
                cmd.env("TPURAY_ACTOR_CREATION_FILE", &path);
            }
        }
        let mut key = key;
        if gpus.0 > 0 {
            key.gpus = self.allocate_gpus(gpus)?;
            cmd.env("CUDA_VISIBLE_DEVICES", tpuray_scheduler::gpu::cuda_visible_devices(&key.gpus));
        }
        if chips > 0 {
            // AGENT-9: a gang member started for one chip names it (TPU_VISIBLE_CHIPS) and
            // gets exactly that block or a clear error.
            let exact: Option<Vec<u32>> = runtime_vars
                .iter()
                .find(|(k, _)| k == "TPU_VISIBLE_CHIPS")
                .map(|(_, v)| v.split(',').filter_map(|c| c.trim().parse().ok()).collect());
            key.tpu_chips = match self.allocate_chips(chips, exact.as_deref()) {
                Ok(c) => c,
                Err(e) => {
                    self.release_devices(&key);
                    return Err(e);
                }
            };
            let port = free_local_port();
            let port = match port {
                Ok(p) => p,
                Err(e) => {
                    self.release_devices(&key);
                    return Err(e);
                }
            };
            let host_chips = self.lock().ledger.host_chips().unwrap_or(chips);
            for (k, v) in
                tpuray_scheduler::chip_env(self.tpu_generation(), host_chips, &key.tpu_chips, port)
            {
                cmd.env(k, v);
            }
            // AGENT-9: a gang's own environment (process bounds of a gang spread over a host's
            // processes, its ports) wins over the independent-process defaults.
            for (k, v) in runtime_vars.iter().filter(|(k, _)| k.starts_with("TPU_")) {
                cmd.env(k, v);
            }
        }
        let (tx, rx) = oneshot::channel();
        self.lock().starting.insert(worker_id.clone(), tx);
        let mut child = match cmd.spawn() {
            Ok(c) => c,
            Err(e) => {
                self.lock().starting.remove(&worker_id);
                self.release_devices(&key);
                return Err(AgentError::Internal(format!(
                    "cannot start worker process {prog:?}: {e}"
                )));
            }
        };
        let pid = child.id().unwrap_or(0);
        // LOGS-2: a worker's output files are `worker-<worker id>-<job id>-<pid>.out|err`
        // under `<session>/logs`, Ray's names, so `tpuray logs worker --pid` and the
        // actor and task lookups find them by name (the open descriptors follow).
        let named = |ext: &str| {
            logs.join(format!("worker-{}-{}-{pid}.{ext}", worker_id.as_str(), key.job_id))
        };
        let _ = std::fs::rename(&out_path, named("out"));
        let err_path =
            if std::fs::rename(&err_path, named("err")).is_ok() { named("err") } else { err_path };
        if let Some(e) = registry::ProcEntry::for_pid(
            pid,
            "worker",
            &self.config.session_dir.display().to_string(),
            "",
        ) {
            let _ = registry::record(&e);
        }
        self.lock().workers.insert(
            worker_id.clone(),
            WorkerEntry {
                pid,
                key,
                address: String::new(),
                state: WorkerState::Starting,
                exit_intended: false,
                _env_uses: env_uses,
            },
        );
        // Wait for registration, or for the process to die first.
        let registered = tokio::select! {
            r = rx => r.ok(),
            status = child.wait() => {
                let status = status.ok();
                self.on_worker_exit(&worker_id, pid, status);
                let tail = tail_of(&err_path, 2000);
                // Exit code 3: the actor's constructor failed; not worth retrying.
                let constructor_failed = status.and_then(|s| s.code()) == Some(3);
                let msg = if constructor_failed {
                    format!("its constructor raised:\n{}", tail.trim_start_matches("tpuray worker: "))
                } else {
                    format!(
                        "worker process exited before registering ({}); stderr tail:\n{tail}",
                        describe_exit(status)
                    )
                };
                return Err(if constructor_failed {
                    AgentError::Refused(msg)
                } else {
                    AgentError::Internal(msg)
                });
            }
            _ = tokio::time::sleep(self.config.worker_register_timeout) => None,
        };
        let Some((address, _)) = registered else {
            let _ = child.start_kill();
            self.lock().starting.remove(&worker_id);
            let agent = Arc::clone(self);
            let wid = worker_id.clone();
            tokio::spawn(async move {
                let status = child.wait().await.ok();
                agent.on_worker_exit(&wid, pid, status);
            });
            return Err(AgentError::Timeout(format!(
                "worker process {pid} did not register within {:?}; see {}",
                self.config.worker_register_timeout,
                err_path.display()
            )));
        };
        {
            let mut st = self.lock();
            if let Some(w) = st.workers.get_mut(&worker_id) {
                w.address = address.clone();
                w.state = state;
            }
        }
        // A pre-started worker is idle now: a waiting lease may take it.
        self.freed.notify_waiters();
        // Reap the process whenever it exits (AGENT-2).
        let agent = Arc::clone(self);
        let wid = worker_id.clone();
        tokio::spawn(async move {
            let status = child.wait().await.ok();
            agent.on_worker_exit(&wid, pid, status);
        });
        Ok((worker_id, address, pid))
    }

    /// The command that starts a Python worker of `job_id`: the interpreter the driver runs
    /// (from the job's runtime record in the KV, `job_runtime/<job id>`, written by the
    /// Python driver at `init`) with `-m tpuray._worker`, in the driver's working directory
    /// with its `sys.path`, when they exist on this node; `python3` otherwise.
    ///
    /// `task_env`: the task's or actor's runtime environment record (merged with the
    /// job's); it is built instead of the job's when given.
    pub(super) async fn python_worker_command(
        &self,
        job_id: &str,
        task_env: Option<&serde_json::Value>,
    ) -> Result<(WorkerCommand, Option<crate::runtime_env::EnvUses>), AgentError> {
        let mut head =
            tpuray_proto::client::head(&self.head_leader(), self.config.token.as_deref())
                .map_err(|e| AgentError::Internal(e.to_string()))?;
        let rec = head
            .kv_get(pb::KvGetRequest {
                namespace: JOB_RUNTIME_NAMESPACE.into(),
                key: job_id.as_bytes().to_vec(),
            })
            .await?
            .into_inner();
        let v: serde_json::Value = if rec.found {
            serde_json::from_slice(&rec.value).map_err(|e| {
                AgentError::Refused(format!("job {job_id}'s runtime record is not JSON: {e}"))
            })?
        } else {
            serde_json::Value::Null
        };
        // AGENT-13: a job submitted with `pip`, `uv`, `py_modules` or an uploaded
        // `working_dir` runs its workers in the same environment, built on this node on
        // first use; a task's or actor's own environment replaces it.
        let mut built = self.build_environment(task_env.unwrap_or(&v["runtime_env"])).await?;
        let python = built
            .python()
            .map(|p| p.display().to_string())
            .or_else(|| {
                v["python"].as_str().filter(|p| std::path::Path::new(p).exists()).map(String::from)
            })
            .unwrap_or_else(|| "python3".into());
        let mut env = built.env();
        let mut paths: Vec<String> = built.python_path();
        if let Some(sys_path) = v["sys_path"].as_array() {
            paths.extend(
                sys_path
                    .iter()
                    .filter_map(|p| p.as_str())
                    .filter(|p| !p.is_empty())
                    .map(String::from),
            );
        }
        if !paths.is_empty() {
            env.push(("PYTHONPATH".to_string(), paths.join(":")));
        }
        if let Some(vars) = v["env_vars"].as_object() {
            for (k, val) in vars {
                if let Some(val) = val.as_str() {
                    env.push((k.clone(), val.to_string()));
                }
            }
        }
        if let Some(rt) = v.get("runtime_env").filter(|r| r.is_object()) {
            env.push(("TPURAY_JOB_RUNTIME_ENV".to_string(), rt.to_string()));
        }
        env.push(("PYTHONUNBUFFERED".to_string(), "1".to_string()));
        let cwd = built.working_dir.clone().or_else(|| {
            v["cwd"].as_str().filter(|d| std::path::Path::new(d).is_dir()).map(PathBuf::from)
        });
        let uses = built.uses.take();
        Ok((
            WorkerCommand { argv: vec![python, "-m".into(), "tpuray._worker".into()], env, cwd },
            uses,
        ))
    }

    /// What `runtime_env` (a job's record, or a task's merged one) needs built on this
    /// node (cached, AGENT-15), within its `setup_timeout_seconds` (AGENT-14).
    ///
    /// # Errors
    /// [`AgentError::SetupFailed`] carrying the setup error (the installer's output, a
    /// missing package, a malformed environment).
    pub(super) async fn build_environment(
        &self,
        runtime_env: &serde_json::Value,
    ) -> Result<crate::runtime_env::Prepared, AgentError> {
        let failed = AgentError::SetupFailed;
        if !runtime_env.is_object() {
            return Ok(Default::default());
        }
        let env = tpuray_proto::runtime_env::JobRuntimeEnv::parse(runtime_env).map_err(failed)?;
        if !env.needs_build() {
            return Ok(Default::default());
        }
        let logs = self.config.session_dir.join("logs");
        let _ = std::fs::create_dir_all(&logs);
        self.supervisors
            .envs
            .prepare(
                &self.head_leader(),
                self.config.token.as_deref(),
                &self.config.session_dir.join("runtime_resources"),
                &env,
                &logs.join("runtime_env_setup-workers.log"),
            )
            .await
            .map_err(failed)
    }

    /// The record of runtime environment `hash` (KV namespace `runtime_env`, JSON written
    /// by the submitting SDK: the task's environment merged with its job's).
    ///
    /// # Errors
    /// [`AgentError::Refused`] when the record is missing or not a JSON object.
    pub(super) async fn runtime_env_record(
        &self,
        hash: &str,
    ) -> Result<serde_json::Value, AgentError> {
        let mut head =
            tpuray_proto::client::head(&self.head_leader(), self.config.token.as_deref())
                .map_err(|e| AgentError::Internal(e.to_string()))?;
        let rec = head
            .kv_get(pb::KvGetRequest {
                namespace: RUNTIME_ENV_NAMESPACE.into(),
                key: hash.as_bytes().to_vec(),
            })
            .await?
            .into_inner();
        if !rec.found {
            return Err(AgentError::Refused(format!(
                "runtime environment {hash} is not in the cluster's KV (namespace {RUNTIME_ENV_NAMESPACE:?})"
            )));
        }
        serde_json::from_slice(&rec.value).map_err(|e| {
            AgentError::Refused(format!("runtime environment {hash} is not JSON: {e}"))
        })
    }

    /// The command that starts a worker of `job_id`: the job's own binary
    /// (fetched through the cluster, BIN-1) or the default worker.
    /// The job's worker binary hash ("" without one) and its driver's address, asked of
    /// the head once per job.
    pub(super) async fn job_record(&self, job_id: &str) -> Result<(String, String), AgentError> {
        if let Some(r) = self.lock().job_binaries.get(job_id).cloned() {
            return Ok(r);
        }
        let mut head =
            tpuray_proto::client::head(&self.head_leader(), self.config.token.as_deref())
                .map_err(|e| AgentError::Internal(e.to_string()))?;
        let jobs = head.list_jobs(pb::ListJobsRequest {}).await?.into_inner().jobs;
        let r = jobs
            .iter()
            .find(|j| j.job_id == job_id)
            .map(|j| (j.worker_binary_hash.clone(), j.driver_address.clone()))
            .unwrap_or_default();
        self.lock().job_binaries.insert(job_id.to_string(), r.clone());
        Ok(r)
    }

    pub(super) async fn worker_command_for(&self, job_id: &str) -> Result<Vec<String>, AgentError> {
        let (hash, _) = self.job_record(job_id).await?;
        if hash.is_empty() {
            return Ok(self.config.worker_command.clone());
        }
        let mut head =
            tpuray_proto::client::head(&self.head_leader(), self.config.token.as_deref())
                .map_err(|e| AgentError::Internal(e.to_string()))?;
        let path = crate::binaries::ensure_binary(
            &mut head,
            &self.config.session_dir.join("binaries"),
            &hash,
        )
        .await
        .map_err(|e| {
            let msg = format!("cannot fetch the job's worker binary: {e}");
            // A binary that was never uploaded will not appear; anything else
            // (disk, network) may pass on a retry.
            if e.contains("never uploaded") {
                AgentError::Refused(msg)
            } else {
                AgentError::Unavailable(msg)
            }
        })?;
        Ok(vec![path.display().to_string()])
    }
}

/// The environment of a worker started for a task's runtime environment record: its
/// `env_vars`, and the whole record as `TPURAY_RUNTIME_ENV` for the worker's language
/// runtime.
pub(super) fn runtime_env_vars(v: &serde_json::Value) -> Vec<(String, String)> {
    let mut out = Vec::new();
    if let Some(vars) = v.get("env_vars").and_then(|e| e.as_object()) {
        for (k, val) in vars {
            let val = match val {
                serde_json::Value::String(s) => s.clone(),
                other => other.to_string(),
            };
            out.push((k.clone(), val));
        }
    }
    out.push(("TPURAY_RUNTIME_ENV".to_string(), v.to_string()));
    out
}

/// How to start a worker process.
#[derive(Clone, Debug, Default)]
pub(super) struct WorkerCommand {
    pub(super) argv: Vec<String>,
    pub(super) env: Vec<(String, String)>,
    pub(super) cwd: Option<PathBuf>,
}

/// AGENT-8: worker processes started at once on a node with `total` resources: its
/// CPUs, at least 1 (Ray's `maximum_startup_concurrency` default).
pub(super) fn startup_concurrency(total: &ResourceSet) -> usize {
    let cpus = total.get("CPU").0 / tpuray_scheduler::resources::UNITS_PER_WHOLE;
    usize::try_from(cpus).unwrap_or(1).max(1)
}

/// A TCP port free on this host now, for a process's libtpu services (TPU.md: one port per
/// process, or processes on one host collide on the default).
pub(super) fn free_local_port() -> Result<u16, AgentError> {
    std::net::TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .map(|a| a.port())
        .map_err(|e| AgentError::Internal(format!("cannot find a free port for libtpu: {e}")))
}

pub(super) fn describe_exit(status: Option<std::process::ExitStatus>) -> String {
    use std::os::unix::process::ExitStatusExt;
    match status {
        Some(s) => match (s.code(), s.signal()) {
            (Some(c), _) => format!("exited with code {c}"),
            (None, Some(sig)) => format!("was killed by signal {sig}"),
            _ => "exited".to_string(),
        },
        None => "exited (status unknown)".to_string(),
    }
}

pub(super) fn tail_of(path: &PathBuf, max: usize) -> String {
    let s = std::fs::read_to_string(path).unwrap_or_default();
    let start = s.len().saturating_sub(max);
    let start = (start..s.len()).find(|&i| s.is_char_boundary(i)).unwrap_or(s.len());
    s[start..].to_string()
}
