//! `ObjectTransferService` on the node agent: other nodes pull this node's
//! object copies in chunks; owners free them.

use std::pin::Pin;

use tokio_stream::Stream;
use tonic::{Request, Response, Status};
use tpuray_objectstore::LocalStore;
use tpuray_proto::pb;
use tpuray_proto::pb::object_transfer_service_server::ObjectTransferService;

/// Chunk size of a pull when the puller names none (4 MiB).
const DEFAULT_CHUNK: usize = 4 * 1024 * 1024;

#[derive(Clone)]
pub struct ObjectsSvc {
    pub store: LocalStore,
}

type ChunkStream = Pin<Box<dyn Stream<Item = Result<pb::ObjectChunk, Status>> + Send>>;

#[tonic::async_trait]
impl ObjectTransferService for ObjectsSvc {
    async fn get_object_info(
        &self,
        req: Request<pb::GetObjectInfoRequest>,
    ) -> Result<Response<pb::GetObjectInfoReply>, Status> {
        let id = req.into_inner().object_id;
        let size = self.store.size(&id);
        Ok(Response::new(pb::GetObjectInfoReply {
            present: size.is_some(),
            data_size: size.unwrap_or(0),
            metadata_size: 0,
        }))
    }

    type PullStream = ChunkStream;

    async fn pull(
        &self,
        req: Request<pb::PullRequest>,
    ) -> Result<Response<Self::PullStream>, Status> {
        let req = req.into_inner();
        let chunk = if req.chunk_size == 0 {
            DEFAULT_CHUNK
        } else {
            (req.chunk_size as usize).clamp(64 * 1024, 32 * 1024 * 1024)
        };
        let view = self
            .store
            .get(&req.object_id)
            .map_err(|e| Status::invalid_argument(e.to_string()))?
            .ok_or_else(|| {
                Status::not_found(format!("object {} is not on this node", req.object_id))
            })?;
        let (tx, rx) = tokio::sync::mpsc::channel(4);
        tokio::task::spawn_blocking(move || {
            let total = view.len() as u64;
            if total == 0 {
                let _ = tx.blocking_send(Ok(pb::ObjectChunk {
                    offset: 0,
                    total_size: 0,
                    data: vec![],
                    metadata: vec![],
                }));
                return;
            }
            let mut offset = 0usize;
            while offset < view.len() {
                let end = (offset + chunk).min(view.len());
                let c = pb::ObjectChunk {
                    offset: offset as u64,
                    total_size: total,
                    data: view[offset..end].to_vec(),
                    metadata: vec![],
                };
                if tx.blocking_send(Ok(c)).is_err() {
                    return;
                }
                offset = end;
            }
        });
        Ok(Response::new(Box::pin(tokio_stream::wrappers::ReceiverStream::new(rx))))
    }

    async fn free_objects(
        &self,
        req: Request<pb::FreeObjectsRequest>,
    ) -> Result<Response<pb::FreeObjectsReply>, Status> {
        for id in req.into_inner().object_ids {
            self.store.delete(&id);
        }
        Ok(Response::new(pb::FreeObjectsReply {}))
    }
}
