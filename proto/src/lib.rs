//! tpuray's wire protocol: the generated gRPC services (one per role), the
//! protocol version, typed ids and the cluster-token auth interceptors.
//!
//! Domain code converts generated messages at the edge; nothing here blocks or
//! needs a runtime except the generated clients and servers themselves.

pub mod auth;
pub mod client;
pub mod convert;
pub mod h2grpc;
pub mod ids;
pub mod metrics;
pub mod net;
pub mod packages;
pub mod registry;
pub mod runtime_env;
pub mod tls;

/// Generated messages and services of package `tpuray.v1`.
#[allow(clippy::all, missing_docs)]
pub mod pb {
    tonic::include_proto!("tpuray.v1");
}

/// Protocol version spoken by this build. A node, worker or driver whose
/// version differs is refused at registration with a message naming both
/// versions (PROTO-1). 2: borrower changes travel as ordered `UpdateBorrowers` batches.
pub const PROTOCOL_VERSION: u32 = 2;

/// Largest message any tpuray server accepts, in bytes (64 MiB). Larger ones
/// are refused with `OUT_OF_RANGE` (tonic's code for it) and a message naming
/// the size and this limit (PROTO-2).
pub const MAX_MESSAGE_BYTES: usize = 64 * 1024 * 1024;

/// Largest Raft message between head replicas, in bytes (1 GiB): a snapshot carries
/// the whole durable state, KV values included.
pub const MAX_PEER_MESSAGE_BYTES: usize = 1024 * 1024 * 1024;

/// The connections `listener` accepts, with `TCP_NODELAY` set on each (NET-1). tonic's
/// `Server::tcp_nodelay` is ignored for a listener handed to `serve_with_incoming*`, and
/// with Nagle's algorithm on, a reply written in two pieces waits for the peer's delayed
/// ACK (about 40 ms on Linux) before its second piece goes out. Every tonic server of
/// tpuray serves through this ([`h2grpc::serve`] sets it itself). Needs a runtime.
pub fn incoming(listener: tokio::net::TcpListener) -> tonic::transport::server::TcpIncoming {
    tonic::transport::server::TcpIncoming::from(listener).with_nodelay(Some(true))
}

/// Checks a peer's protocol version against [`PROTOCOL_VERSION`].
///
/// # Errors
/// `FAILED_PRECONDITION` naming both versions when they differ.
pub fn check_protocol_version(what: &str, theirs: u32) -> Result<(), tonic::Status> {
    if theirs == PROTOCOL_VERSION {
        Ok(())
    } else {
        Err(tonic::Status::failed_precondition(format!(
            "protocol version mismatch: {what} speaks version {theirs}, this server speaks version {PROTOCOL_VERSION}; run the same tpuray build everywhere"
        )))
    }
}

/// Milliseconds since the Unix epoch, for timestamps on the wire.
pub fn now_ms() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_millis() as u64)
        .unwrap_or(0)
}

/// A fresh request id for a mutating call (a UUID v4 string).
pub fn new_request_id() -> String {
    uuid::Uuid::new_v4().to_string()
}
