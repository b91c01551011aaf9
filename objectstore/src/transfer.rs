//! `ObjectTransferService` over a [`LocalStore`]: other nodes pull its object
//! copies in chunks; owners free them; the CLI reads the store's usage. A node
//! agent serves its node's store with it, and a driver on a host without a node
//! serves its private store (NET-3).
//!
//! Store calls block on the filesystem (a `get` may restore a spilled object,
//! megabytes of copying; `usage` scans both folders), so every one runs under
//! `spawn_blocking`, never on the runtime threads that answer RPCs.
//!
//! `Pull` sends 4 MiB chunks through a four-chunk channel; `FreeObjects` deletes copies
//! for their owner; `GetStoreUsage` answers `tpuray memory` and `tpuray list objects`,
//! with the bytes this process served (`bytes_served`).
//!
//! OBJ-8 (kept by the owner, `sdk/src/core/transfer.rs`; this is the serving side): a
//! node that needs an object pulls it from any node with a copy. The owner tracks the
//! copies (a puller that finished reports its copy with `ReportObjectCopy`, and it
//! becomes a source; a source a puller could not read is reported with the next
//! `GetObject`, `lost_node_ids`, and dropped) and assigns each puller one source: the
//! copy with the fewest pulls in flight (at most two per copy), then the one that served
//! least, then the newest; while every copy is busy the puller's long poll waits, so a
//! broadcast spreads as a tree instead of all hitting the origin. An assignment not
//! reported within 120 s is forgotten. A process runs at most four pulls at once, each
//! holding at most this server's four-chunk channel plus one chunk in flight. Copies the
//! core worker pulls from another node are secondary; `put`s and task returns are primary
//! and record the owner's address.

use std::pin::Pin;
use std::sync::atomic::{AtomicU64, Ordering};

use crate::{CopyKind, LocalStore, Location, StoreUsage};
use tokio_stream::Stream;
use tonic::{Request, Response, Status};
use tpuray_proto::pb;
use tpuray_proto::pb::object_transfer_service_server::ObjectTransferService;

/// Chunk size of a pull when the puller names none (4 MiB).
const DEFAULT_CHUNK: usize = 4 * 1024 * 1024;

/// Object bytes this process sent to pullers (one served store per process), in
/// `GetStoreUsage` as `bytes_served`.
static BYTES_SERVED: AtomicU64 = AtomicU64::new(0);

/// The service over one store.
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
        let store = self.store.clone();
        let size = blocking(move || store.size(&id)).await?;
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
        let store = self.store.clone();
        let id = req.object_id.clone();
        let view = blocking(move || store.get(&id))
            .await?
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
                BYTES_SERVED.fetch_add((end - offset) as u64, Ordering::Relaxed);
                offset = end;
            }
        });
        Ok(Response::new(Box::pin(tokio_stream::wrappers::ReceiverStream::new(rx))))
    }

    async fn free_objects(
        &self,
        req: Request<pb::FreeObjectsRequest>,
    ) -> Result<Response<pb::FreeObjectsReply>, Status> {
        let store = self.store.clone();
        let ids = req.into_inner().object_ids;
        blocking(move || {
            for id in ids {
                store.delete(&id);
            }
        })
        .await?;
        Ok(Response::new(pb::FreeObjectsReply {}))
    }

    async fn get_store_usage(
        &self,
        req: Request<pb::GetStoreUsageRequest>,
    ) -> Result<Response<pb::GetStoreUsageReply>, Status> {
        let limit = match req.into_inner().limit {
            0 => usize::MAX,
            n => n as usize,
        };
        let store = self.store.clone();
        let (usage, spill) = blocking(move || {
            let usage = store.usage_top(limit)?;
            let spill = store.spill_dir()?;
            Ok::<_, crate::StoreError>((usage, spill))
        })
        .await?
        .map_err(|e| Status::internal(e.to_string()))?;
        let mut reply = usage_to_proto(usage);
        reply.store_dir = self.store.dir().display().to_string();
        reply.spill_dir = spill.map(|s| s.display().to_string()).unwrap_or_default();
        reply.bytes_served = BYTES_SERVED.load(Ordering::Relaxed);
        Ok(Response::new(reply))
    }
}

/// Runs a blocking store call off the runtime threads.
async fn blocking<T: Send + 'static>(f: impl FnOnce() -> T + Send + 'static) -> Result<T, Status> {
    tokio::task::spawn_blocking(f)
        .await
        .map_err(|e| Status::internal(format!("object store call failed: {e}")))
}

/// The wire form of a store snapshot (`store_dir` and `spill_dir` left empty).
fn usage_to_proto(u: StoreUsage) -> pb::GetStoreUsageReply {
    pb::GetStoreUsageReply {
        capacity_bytes: u.capacity_bytes,
        used_bytes: u.used_bytes,
        writing_bytes: u.writing_bytes,
        pooled_bytes: u.pooled_bytes,
        spilled_bytes: u.spilled_bytes,
        pinned_bytes: u.pinned_bytes,
        object_count: u.object_count,
        spilled_count: u.spilled_count,
        store_dir: String::new(),
        spill_dir: String::new(),
        bytes_served: 0,
        objects: u
            .largest
            .into_iter()
            .map(|o| pb::StoreObject {
                object_id: o.id,
                size: o.size,
                location: match o.location {
                    Location::Memory => pb::StoreLocation::Memory,
                    Location::Spilled => pb::StoreLocation::Spilled,
                } as i32,
                secondary: o.copy == CopyKind::Secondary,
                owner: o.owner.unwrap_or_default(),
                pinned: o.pinned,
            })
            .collect(),
    }
}
