//! Client channels to tpuray servers: lazy connections that carry the
//! cluster token on every call.

use std::time::Duration;

use tonic::service::interceptor::InterceptedService;
use tonic::transport::{Channel, Endpoint};

use crate::MAX_MESSAGE_BYTES;
use crate::auth::ClientAuth;
use crate::pb::head_service_client::HeadServiceClient;
use crate::pb::node_agent_service_client::NodeAgentServiceClient;
use crate::pb::object_transfer_service_client::ObjectTransferServiceClient;
use crate::pb::worker_service_client::WorkerServiceClient;

/// A channel whose calls carry the cluster token.
pub type AuthChannel = InterceptedService<Channel, ClientAuth>;

/// Errors building a client.
#[derive(Debug, thiserror::Error)]
pub enum ClientError {
    #[error("invalid address {addr:?}: {detail} (expected HOST:PORT)")]
    BadAddress { addr: String, detail: String },
}

/// A lazily connecting channel to `addr` (`HOST:PORT`).
///
/// # Errors
/// [`ClientError::BadAddress`] when `addr` is not a valid `HOST:PORT`.
pub fn channel(addr: &str) -> Result<Channel, ClientError> {
    check_address(addr)?;
    let ep = Endpoint::from_shared(format!("http://{addr}"))
        .map_err(|e| ClientError::BadAddress { addr: addr.to_string(), detail: e.to_string() })?
        .connect_timeout(Duration::from_secs(5))
        .tcp_nodelay(true)
        .http2_keep_alive_interval(Duration::from_secs(10))
        .keep_alive_timeout(Duration::from_secs(20));
    Ok(ep.connect_lazy())
}

/// Checks that `addr` is `HOST:PORT`; needs no runtime.
///
/// # Errors
/// [`ClientError::BadAddress`] naming what is missing.
pub fn check_address(addr: &str) -> Result<(), ClientError> {
    let bad = |detail: String| ClientError::BadAddress { addr: addr.to_string(), detail };
    let (host, port) = addr.rsplit_once(':').ok_or_else(|| bad("missing port".into()))?;
    if host.is_empty() {
        return Err(bad("missing host".into()));
    }
    port.parse::<u16>().map_err(|e| bad(format!("port {port:?}: {e}")))?;
    Ok(())
}

fn authed(addr: &str, token: Option<&str>) -> Result<AuthChannel, ClientError> {
    Ok(InterceptedService::new(channel(addr)?, ClientAuth::new(token)))
}

/// A client of the head at `addr`.
pub fn head(
    addr: &str,
    token: Option<&str>,
) -> Result<HeadServiceClient<AuthChannel>, ClientError> {
    Ok(HeadServiceClient::new(authed(addr, token)?)
        .max_decoding_message_size(MAX_MESSAGE_BYTES)
        .max_encoding_message_size(usize::MAX))
}

/// A client of the node agent at `addr`.
pub fn agent(
    addr: &str,
    token: Option<&str>,
) -> Result<NodeAgentServiceClient<AuthChannel>, ClientError> {
    Ok(NodeAgentServiceClient::new(authed(addr, token)?)
        .max_decoding_message_size(MAX_MESSAGE_BYTES)
        .max_encoding_message_size(usize::MAX))
}

/// A client of the worker process at `addr`.
pub fn worker(
    addr: &str,
    token: Option<&str>,
) -> Result<WorkerServiceClient<AuthChannel>, ClientError> {
    Ok(WorkerServiceClient::new(authed(addr, token)?)
        .max_decoding_message_size(MAX_MESSAGE_BYTES)
        .max_encoding_message_size(usize::MAX))
}

/// A client of the object transfer service at `addr`.
pub fn objects(
    addr: &str,
    token: Option<&str>,
) -> Result<ObjectTransferServiceClient<AuthChannel>, ClientError> {
    Ok(ObjectTransferServiceClient::new(authed(addr, token)?)
        .max_decoding_message_size(MAX_MESSAGE_BYTES)
        .max_encoding_message_size(usize::MAX))
}
