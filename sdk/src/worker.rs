//! The worker process: started by a node agent with its identity in the
//! environment (`TPURAY_AGENT_ADDRESS`, `TPURAY_WORKER_ID`, ...). It builds
//! its core worker, runs its actor's constructor when it hosts one, serves
//! `WorkerService` on a free port, registers with the agent, and exits when
//! the agent dies or asks it to (CORE-1: a worker never outlives its agent).
//!
//! A Rust job's own binary is its worker: `tpuray::init` calls
//! [`run_worker`] when `TPURAY_WORKER_ID` is set and never returns.
//! Exit code 3 means the actor's constructor failed (the agent reports it).

use std::sync::{Arc, OnceLock};
use std::time::Duration;

use tpuray_objectstore::LocalStore;
use tpuray_proto::pb;

use crate::core::Core;
use crate::executor::Executor;
use crate::service::Svc;

/// Exit code of a worker whose actor constructor failed.
pub const EXIT_ACTOR_CONSTRUCTOR_FAILED: i32 = 3;

/// Errors of a worker process, each naming what is missing or failed.
#[derive(Debug, thiserror::Error)]
pub enum WorkerError {
    #[error("environment variable {0} is not set: worker processes are started by a node agent")]
    MissingEnv(&'static str),
    #[error("cannot listen: {0}")]
    Listen(std::io::Error),
    #[error("node agent refused registration: {0}")]
    Register(String),
    #[error("worker failed: {0}")]
    Serve(String),
}

fn env(name: &'static str) -> Result<String, WorkerError> {
    std::env::var(name).map_err(|_| WorkerError::MissingEnv(name))
}

/// True when this process was started by a node agent as a worker.
pub fn is_worker_process() -> bool {
    std::env::var_os("TPURAY_WORKER_ID").is_some()
}

/// Runs this process as a worker until its node agent dies, it receives
/// SIGTERM, or `Exit` is called. Blocks the calling thread.
///
/// # Errors
/// [`WorkerError`] when the environment lacks the agent's settings or the
/// agent refuses the registration.
pub fn run_worker() -> Result<(), WorkerError> {
    crate::thp::narrow_disable();
    let agent_address = env("TPURAY_AGENT_ADDRESS")?;
    let worker_id = env("TPURAY_WORKER_ID")?;
    let node_id = env("TPURAY_NODE_ID").unwrap_or_default();
    let job_id = env("TPURAY_JOB_ID").unwrap_or_default();
    let head_address = env("TPURAY_HEAD_ADDRESS").unwrap_or_default();
    let store_dir = env("TPURAY_OBJECT_STORE_DIR")?;
    let actor_id = std::env::var("TPURAY_ACTOR_ID").unwrap_or_default();
    let agent_pid: Option<i32> =
        std::env::var("TPURAY_AGENT_PID").ok().and_then(|p| p.parse().ok());
    let token = tpuray_proto::auth::load_token().ok().flatten();
    let auth_required =
        std::env::var(tpuray_proto::auth::AUTH_MODE_ENV).as_deref() != Ok("disabled");
    let rt = crate::core::build_runtime().map_err(WorkerError::Serve)?;
    let host =
        agent_address.rsplit_once(':').map(|(h, _)| h.to_string()).unwrap_or("127.0.0.1".into());
    let listener = rt
        .block_on(tokio::net::TcpListener::bind((host.as_str(), 0)))
        .map_err(WorkerError::Listen)?;
    let address = listener.local_addr().map_err(WorkerError::Listen)?.to_string();
    let store = LocalStore::join(&store_dir).map_err(|e| WorkerError::Serve(e.to_string()))?;
    let core = Core::new(
        rt,
        job_id,
        worker_id.clone(),
        node_id,
        address.clone(),
        agent_address.clone(),
        head_address,
        token.clone(),
        store,
        false,
    );
    let core =
        crate::core::install(Arc::new(core)).map_err(|e| WorkerError::Serve(e.to_string()))?;
    spawn_agent_watchdog(agent_pid);
    let (exit_tx, mut exit_rx) = tokio::sync::mpsc::channel(1);
    let svc = Arc::new(Svc {
        core: Arc::clone(core),
        executor: OnceLock::new(),
        actor_id: actor_id.clone(),
        exit: exit_tx,
    });
    let server = core.rt.spawn(crate::service::serve(
        listener,
        Arc::clone(&svc),
        token.clone(),
        auth_required,
        async move {
            let mut term =
                tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate())
                    .expect("SIGTERM handler");
            tokio::select! {
                _ = term.recv() => {}
                _ = exit_rx.recv() => {}
            }
        },
    ));

    let creation = match std::env::var("TPURAY_ACTOR_CREATION_FILE") {
        Ok(path) => {
            let bytes = std::fs::read(&path)
                .map_err(|e| WorkerError::Serve(format!("cannot read {path}: {e}")))?;
            Some(
                <pb::TaskSpec as prost::Message>::decode(bytes.as_slice())
                    .map_err(|e| WorkerError::Serve(format!("bad creation task: {e}")))?,
            )
        }
        Err(_) => None,
    };
    match Executor::start(Arc::clone(core), creation) {
        Ok(ex) => {
            let _ = svc.executor.set(ex);
        }
        Err(msg) => {
            eprintln!("tpuray worker: {msg}");
            std::process::exit(EXIT_ACTOR_CONSTRUCTOR_FAILED);
        }
    }

    core.rt.block_on(async {
        let mut client = tpuray_proto::client::agent(&agent_address, token.as_deref())
            .map_err(|e| WorkerError::Register(e.to_string()))?;
        client
            .register_worker(pb::RegisterWorkerRequest {
                protocol_version: tpuray_proto::PROTOCOL_VERSION,
                worker_id,
                address,
                pid: std::process::id(),
            })
            .await
            .map_err(|s| WorkerError::Register(s.message().to_string()))?;
        Ok::<_, WorkerError>(())
    })?;
    let flusher = Arc::clone(core);
    core.rt.spawn(async move {
        loop {
            tokio::time::sleep(Duration::from_millis(500)).await;
            flusher.flush_events().await;
            crate::metrics::flush(&flusher).await;
        }
    });
    let result = core.rt.block_on(server);
    core.rt.block_on(async {
        core.flush_events().await;
        crate::metrics::flush(core).await;
    });
    result.map_err(|e| WorkerError::Serve(e.to_string()))
}

/// CORE-1: a thread of its own exits the process as soon as the node agent
/// that started us is gone (we were re-parented, or its pid vanished): the
/// node is gone with its agent, and a running task must not finish here (its
/// owner retries it elsewhere). A plain thread, so no runtime state or user
/// code can delay it.
fn spawn_agent_watchdog(agent_pid: Option<i32>) {
    // SAFETY: getppid has no preconditions.
    let parent = unsafe { libc::getppid() };
    std::thread::Builder::new()
        .name("tpuray-agent-watchdog".into())
        .spawn(move || {
            loop {
                std::thread::sleep(Duration::from_millis(100));
                // SAFETY: as above; kill with signal 0 only checks existence.
                let reparented = unsafe { libc::getppid() } != parent;
                let missing = agent_pid.is_some_and(|p| unsafe { libc::kill(p, 0) } != 0);
                if reparented || missing {
                    eprintln!("tpuray worker: the node agent exited; exiting");
                    // SAFETY: _exit skips atexit handlers and destructors, which
                    // could block on locks held by other threads.
                    unsafe { libc::_exit(1) };
                }
            }
        })
        .expect("spawn agent watchdog");
}
