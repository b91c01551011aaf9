//! The worker process: started by a node agent with its identity in the
//! environment (`TPURAY_AGENT_ADDRESS`, `TPURAY_WORKER_ID`, ...), it serves
//! `WorkerService` on a free loopback port, registers with the agent, and
//! exits when the agent dies or asks it to (CORE-1: a worker never outlives
//! its node agent).
//!
//! Blocking: [`run_worker`] blocks the calling thread until the worker exits.

use std::time::Duration;

use tonic::service::interceptor::InterceptedService;
use tonic::{Request, Response, Status};
use tpuray_proto::auth::ServerAuth;
use tpuray_proto::pb;
use tpuray_proto::pb::worker_service_server::{WorkerService, WorkerServiceServer};

/// Errors of a worker process, each naming what is missing or failed.
#[derive(Debug, thiserror::Error)]
pub enum WorkerError {
    #[error("environment variable {0} is not set: worker processes are started by a node agent")]
    MissingEnv(&'static str),
    #[error("cannot listen: {0}")]
    Listen(std::io::Error),
    #[error("node agent refused registration: {0}")]
    Register(String),
    #[error("worker server failed: {0}")]
    Serve(String),
}

fn env(name: &'static str) -> Result<String, WorkerError> {
    std::env::var(name).map_err(|_| WorkerError::MissingEnv(name))
}

struct Svc {
    worker_id: String,
    node_id: String,
    actor_id: String,
    exit: tokio::sync::mpsc::Sender<()>,
}

#[tonic::async_trait]
impl WorkerService for Svc {
    async fn get_worker_info(
        &self,
        _req: Request<pb::GetWorkerInfoRequest>,
    ) -> Result<Response<pb::GetWorkerInfoReply>, Status> {
        Ok(Response::new(pb::GetWorkerInfoReply {
            worker_id: self.worker_id.clone(),
            pid: std::process::id(),
            node_id: self.node_id.clone(),
            actor_id: self.actor_id.clone(),
        }))
    }

    async fn exit(&self, req: Request<pb::ExitRequest>) -> Result<Response<pb::ExitReply>, Status> {
        if req.into_inner().force {
            std::process::exit(0);
        }
        let _ = self.exit.try_send(());
        Ok(Response::new(pb::ExitReply {}))
    }
}

/// Runs this process as a worker until its node agent dies, it receives
/// SIGTERM, or `Exit` is called. Blocks the calling thread.
///
/// # Errors
/// [`WorkerError`] when the environment lacks the agent's settings or the
/// agent refuses the registration.
pub fn run_worker() -> Result<(), WorkerError> {
    let agent_address = env("TPURAY_AGENT_ADDRESS")?;
    let worker_id = env("TPURAY_WORKER_ID")?;
    let node_id = env("TPURAY_NODE_ID").unwrap_or_default();
    let actor_id = std::env::var("TPURAY_ACTOR_ID").unwrap_or_default();
    let agent_pid: Option<i32> =
        std::env::var("TPURAY_AGENT_PID").ok().and_then(|p| p.parse().ok());
    let token = tpuray_proto::auth::load_token().ok().flatten();
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .map_err(|e| WorkerError::Serve(e.to_string()))?;
    rt.block_on(async move {
        let host = agent_address.rsplit_once(':').map(|(h, _)| h).unwrap_or("127.0.0.1");
        let listener =
            tokio::net::TcpListener::bind((host, 0)).await.map_err(WorkerError::Listen)?;
        let addr = listener.local_addr().map_err(WorkerError::Listen)?;
        let (exit_tx, mut exit_rx) = tokio::sync::mpsc::channel(1);
        let svc = WorkerServiceServer::new(Svc {
            worker_id: worker_id.clone(),
            node_id,
            actor_id,
            exit: exit_tx,
        })
        .max_decoding_message_size(tpuray_proto::MAX_MESSAGE_BYTES);
        let required = token.is_some()
            && std::env::var(tpuray_proto::auth::AUTH_MODE_ENV).as_deref() != Ok("disabled");
        let auth = ServerAuth::new(token.as_deref().unwrap_or(""), required);
        let svc = InterceptedService::new(svc, auth);
        let incoming = tokio_stream_wrap(listener);
        let server = tokio::spawn(async move {
            tonic::transport::Server::builder()
                .tcp_nodelay(true)
                .add_service(svc)
                .serve_with_incoming_shutdown(incoming, async move {
                    let mut term =
                        tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate())
                            .expect("SIGTERM handler");
                    tokio::select! {
                        _ = term.recv() => {}
                        _ = exit_rx.recv() => {}
                        _ = agent_gone(agent_pid) => {}
                    }
                })
                .await
        });
        let mut client = tpuray_proto::client::agent(&agent_address, token.as_deref())
            .map_err(|e| WorkerError::Register(e.to_string()))?;
        client
            .register_worker(pb::RegisterWorkerRequest {
                protocol_version: tpuray_proto::PROTOCOL_VERSION,
                worker_id,
                address: addr.to_string(),
                pid: std::process::id(),
            })
            .await
            .map_err(|s| WorkerError::Register(s.message().to_string()))?;
        match server.await {
            Ok(Ok(())) => Ok(()),
            Ok(Err(e)) => Err(WorkerError::Serve(e.to_string())),
            Err(e) => Err(WorkerError::Serve(e.to_string())),
        }
    })
}

/// Resolves when the node agent that started us is gone (CORE-1): our
/// parent pid changes (we were re-parented) or the agent pid stops existing.
async fn agent_gone(agent_pid: Option<i32>) {
    // SAFETY: getppid has no preconditions.
    let parent = unsafe { libc::getppid() };
    loop {
        tokio::time::sleep(Duration::from_millis(200)).await;
        // SAFETY: as above; kill with signal 0 only checks existence.
        let reparented = unsafe { libc::getppid() } != parent;
        let missing = agent_pid.is_some_and(|p| unsafe { libc::kill(p, 0) } != 0);
        if reparented || missing {
            return;
        }
    }
}

fn tokio_stream_wrap(
    listener: tokio::net::TcpListener,
) -> impl tokio_stream::Stream<Item = std::io::Result<tokio::net::TcpStream>> {
    tokio_stream::wrappers::TcpListenerStream::new(listener)
}
