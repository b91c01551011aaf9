//! `WorkerService` as every driver and worker serves it: the owner side
//! (`GetObject`, `ReportGeneratorItem`) and, in workers, the executor side
//! (`PushTask`, `CancelTask`).

use std::sync::{Arc, OnceLock};
use std::time::Duration;

use tonic::{Request, Response, Status};
use tpuray_proto::pb;
use tpuray_proto::pb::worker_service_server::WorkerService;

use crate::core::Core;
use crate::executor::Executor;

/// The service handle tonic holds.
#[derive(Clone)]
pub(crate) struct SvcRef(pub Arc<Svc>);

pub(crate) struct Svc {
    pub core: Arc<Core>,
    pub executor: OnceLock<Arc<Executor>>,
    pub actor_id: String,
    pub exit: tokio::sync::mpsc::Sender<()>,
}

/// A pushed task's spec names as many return ids as it declares returns.
pub(crate) fn check_spec(spec: &pb::TaskSpec) -> Result<(), Status> {
    if spec.return_ids.len() != spec.num_returns as usize {
        return Err(Status::invalid_argument(format!(
            "task {} declares {} returns but names {} return ids",
            spec.task_id,
            spec.num_returns,
            spec.return_ids.len()
        )));
    }
    Ok(())
}

impl SvcRef {
    fn executor(&self) -> Result<&std::sync::Arc<crate::executor::Executor>, Status> {
        self.0.executor.get().ok_or_else(|| {
            Status::failed_precondition("this process is a driver and does not execute tasks")
        })
    }
}

#[tonic::async_trait]
impl WorkerService for SvcRef {
    async fn get_worker_info(
        &self,
        _req: Request<pb::GetWorkerInfoRequest>,
    ) -> Result<Response<pb::GetWorkerInfoReply>, Status> {
        Ok(Response::new(pb::GetWorkerInfoReply {
            worker_id: self.0.core.worker_id.clone(),
            pid: std::process::id(),
            node_id: self.0.core.node_id.clone(),
            actor_id: self.0.actor_id.clone(),
        }))
    }

    async fn report_logs(
        &self,
        req: Request<pb::ReportLogsRequest>,
    ) -> Result<Response<pb::ReportLogsReply>, Status> {
        let req = req.into_inner();
        let mut wanted = true;
        for b in req.batches {
            let source = crate::logs::Source { name: b.name, pid: req.pid, ip: req.ip.clone() };
            wanted = crate::logs::print_batch(&source, &b.lines, req.is_err);
            if !wanted {
                break;
            }
        }
        Ok(Response::new(pb::ReportLogsReply { unwanted: !wanted }))
    }

    async fn exit(&self, req: Request<pb::ExitRequest>) -> Result<Response<pb::ExitReply>, Status> {
        if req.into_inner().force {
            std::process::exit(0);
        }
        let _ = self.0.exit.try_send(());
        Ok(Response::new(pb::ExitReply {}))
    }

    async fn push_task(
        &self,
        req: Request<pb::PushTaskRequest>,
    ) -> Result<Response<pb::PushTaskReply>, Status> {
        let spec =
            req.into_inner().spec.ok_or_else(|| Status::invalid_argument("missing task spec"))?;
        check_spec(&spec)?;
        let ex = self.executor()?;
        Ok(Response::new(ex.push(spec).await))
    }

    type PushTasksStream = std::pin::Pin<
        Box<dyn tokio_stream::Stream<Item = Result<pb::PushTasksReplies, Status>> + Send>,
    >;

    async fn push_tasks(
        &self,
        req: Request<pb::PushTasksRequest>,
    ) -> Result<Response<Self::PushTasksStream>, Status> {
        let specs = req.into_inner().specs;
        for spec in &specs {
            check_spec(spec)?;
            if !spec.actor_id.is_empty() {
                return Err(Status::invalid_argument(format!(
                    "task {} is an actor call; actor calls go one per PushTask (CORE-4)",
                    spec.task_id
                )));
            }
        }
        let ex = self.executor()?;
        // Queued in order at once (each runs after the one before it); each reply goes
        // out when it is ready, so a task handed back (CORE-9) is not held up by the one
        // it was queued behind.
        let (tx, rx) = tokio::sync::mpsc::unbounded_channel();
        for (i, spec) in specs.into_iter().enumerate() {
            let queued = ex.enqueue_task(spec);
            let tx = tx.clone();
            tokio::spawn(async move {
                let reply = queued.reply().await;
                let _ = tx.send(pb::PushTasksItem { index: i as u32, reply: Some(reply) });
            });
        }
        Ok(Response::new(Box::pin(ReadyReplies(rx)) as Self::PushTasksStream))
    }

    async fn get_object(
        &self,
        req: Request<pb::GetObjectRequest>,
    ) -> Result<Response<pb::GetObjectReply>, Status> {
        let req = req.into_inner();
        let wait = Duration::from_millis(req.timeout_ms.min(60_000));
        Ok(Response::new(
            self.0
                .core
                .serve_get_object(&req.object_id, wait, &req.lost_node_ids, &req.puller_node_id)
                .await,
        ))
    }

    async fn report_generator_item(
        &self,
        req: Request<pb::ReportGeneratorItemRequest>,
    ) -> Result<Response<pb::ReportGeneratorItemReply>, Status> {
        let req = req.into_inner();
        if let Some(item) = req.item {
            self.0.core.generator_item(&req.task_id, req.index, item);
        }
        Ok(Response::new(pb::ReportGeneratorItemReply {}))
    }

    async fn update_borrower(
        &self,
        req: Request<pb::UpdateBorrowerRequest>,
    ) -> Result<Response<pb::UpdateBorrowerReply>, Status> {
        let req = req.into_inner();
        if req.add {
            self.0.core.watch_borrowers();
        }
        let known =
            self.0.core.serve_update_borrower(&req.object_id, &req.borrower_address, req.add);
        Ok(Response::new(pb::UpdateBorrowerReply { known }))
    }

    async fn update_borrowers(
        &self,
        req: Request<pb::UpdateBorrowersRequest>,
    ) -> Result<Response<pb::UpdateBorrowersReply>, Status> {
        let req = req.into_inner();
        if req.updates.iter().any(|u| u.add) {
            self.0.core.watch_borrowers();
        }
        self.0.core.serve_update_borrowers(&req.borrower_address, &req.updates);
        Ok(Response::new(pb::UpdateBorrowersReply {}))
    }

    async fn report_object_copy(
        &self,
        req: Request<pb::ReportObjectCopyRequest>,
    ) -> Result<Response<pb::ReportObjectCopyReply>, Status> {
        let req = req.into_inner();
        self.0.core.copy_done(&req.object_id, &req.source_node_id, &req.puller_node_id, req.copy);
        Ok(Response::new(pb::ReportObjectCopyReply {}))
    }

    async fn cancel_task(
        &self,
        req: Request<pb::CancelTaskRequest>,
    ) -> Result<Response<pb::CancelTaskReply>, Status> {
        let req = req.into_inner();
        let found = self
            .0
            .executor
            .get()
            .map(|e| e.cancel(&req.task_id, req.force, req.recursive))
            .unwrap_or(false);
        Ok(Response::new(pb::CancelTaskReply { found }))
    }

    async fn cancel_owned(
        &self,
        req: Request<pb::CancelOwnedRequest>,
    ) -> Result<Response<pb::CancelOwnedReply>, Status> {
        let req = req.into_inner();
        if req.object_id.is_empty() {
            return Err(Status::invalid_argument("cancel of an owned object: object_id is empty"));
        }
        // This process owns it: never forwarded again (no loop between owners).
        let refused = match self.0.core.cancel(&req.object_id, "", req.force, req.recursive).await {
            Ok(()) => String::new(),
            Err(e) => e.to_string(),
        };
        Ok(Response::new(pb::CancelOwnedReply { refused }))
    }
}

/// Serves `svc` on `listener` until `shutdown` resolves.
pub(crate) async fn serve(
    listener: tokio::net::TcpListener,
    svc: Arc<Svc>,
    token: Option<String>,
    auth_required: bool,
    shutdown: impl std::future::Future<Output = ()> + Send + 'static,
) {
    let server = pb::worker_service_server::WorkerServiceServer::new(SvcRef(Arc::clone(&svc)))
        .max_decoding_message_size(tpuray_proto::MAX_MESSAGE_BYTES)
        .max_encoding_message_size(tpuray_proto::MAX_MESSAGE_BYTES);
    let auth = tpuray_proto::auth::ServerAuth::new(
        token.as_deref().unwrap_or(""),
        auth_required && token.is_some(),
    );
    let direct = crate::direct::DirectServer::new(Arc::clone(&svc), auth.clone());
    let server = tonic::service::interceptor::InterceptedService::new(server, auth);
    // CORE-15: direct actor-call connections share the port.
    let take = Arc::clone(&direct);
    let divert = tpuray_proto::h2grpc::Divert {
        first_byte: crate::direct::FIRST_BYTE,
        take: Arc::new(move |tcp| take.take(tcp)),
    };
    tpuray_proto::h2grpc::serve_diverting("worker", listener, server, shutdown, Some(divert)).await;
    direct.stop().await;
}

/// The replies of one `PushTasks` call as a stream of messages: each message carries the
/// first reply that is ready and every other one ready by then, so replies that finish
/// close together share one HTTP/2 frame and one write.
struct ReadyReplies(tokio::sync::mpsc::UnboundedReceiver<pb::PushTasksItem>);

impl tokio_stream::Stream for ReadyReplies {
    type Item = Result<pb::PushTasksReplies, Status>;

    fn poll_next(
        mut self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<Option<Self::Item>> {
        let first = std::task::ready!(self.0.poll_recv(cx));
        std::task::Poll::Ready(first.map(|first| {
            let mut items = vec![first];
            while let Ok(more) = self.0.try_recv() {
                items.push(more);
            }
            Ok(pb::PushTasksReplies { items })
        }))
    }
}
