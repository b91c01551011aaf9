//! The head's replicated log: [`HeadMachine`] puts the [`StateMachine`] under a
//! `tpuray-replica` [`Replica`] (HEAD-6); [`PeerTransport`] carries Raft messages to the
//! other heads over `HeadPeerService`; [`LeaderGate`] answers clients of a head that is
//! not the serving leader with the leader's address (HEAD-7).
//!
//! The Raft thread calls [`HeadMachine`] (apply, snapshot, restore) and the status
//! callback; peer sends run as tokio tasks, one per peer, on the head's runtime.
//!
//! [`StateMachine`]: crate::state::StateMachine
//!
//! Commands are log entries (a version byte, then postcard); snapshots are the serialized
//! `StateMachine` (HEAD-2's dedup memory included); Raft messages travel as bytes over
//! `HeadPeerService` on the head's own port. One head is a group of one voter on the same
//! code path (it elects itself at once). Membership is fixed by `--head-peers` (no conf
//! changes).
//!
//! HEAD-7 in detail: the serving leader is a leader that applied every entry before its
//! own term. Reads stay local to it, so a partitioned old leader serves stale reads until
//! check-quorum makes it step down (one election timeout).
//!
//! The log is durable before the head answers (RAFT-2). It lives in `--head-data-dir`
//! (default `<session>/head-data-<id>`); a restarted head recovers from it and catches up
//! from its peers.

use std::collections::HashMap;
use std::convert::Infallible;
use std::future::Future;
use std::pin::Pin;
use std::sync::{Arc, OnceLock, Weak};
use std::task::{Context, Poll};
use std::time::Duration;

use tonic::body::Body;
use tonic::codegen::{Service, http};
use tonic::server::NamedService;
use tonic::{Request, Response, Status};
use tpuray_proto::pb;
use tpuray_proto::pb::head_peer_service_server::HeadPeerService;
use tpuray_replica::{Machine, Message, MessageType, Replica, Transport};

use crate::server::Head;
use crate::state::{Outcome, Rejection, decode_command};

/// The head's state machine as the log sees it.
pub(crate) struct HeadMachine(pub Arc<Head>);

impl Machine for HeadMachine {
    type Output = Outcome;

    fn apply(&mut self, index: u64, data: &[u8]) -> Outcome {
        match decode_command(data) {
            Ok(cmd) => self.0.apply_committed(cmd),
            // Every head reads the same bytes, so every head refuses them alike.
            Err(e) => {
                tracing::error!(index, %e, "a log entry is not a command; skipped");
                Outcome::Rejected(Rejection::Invalid(format!("log entry {index}: {e}")))
            }
        }
    }

    fn snapshot(&mut self) -> Vec<u8> {
        self.0.snapshot_state()
    }

    fn restore(&mut self, _index: u64, data: &[u8]) -> Result<(), String> {
        self.0.restore_state(data)
    }
}

/// The replica, once started (peer senders report failures to it).
pub(crate) type ReplicaCell = Arc<OnceLock<Weak<Replica<Outcome>>>>;

/// Queues Raft messages to one sender task per peer.
pub(crate) struct PeerTransport {
    queues: HashMap<u64, tokio::sync::mpsc::UnboundedSender<Message>>,
}

impl Transport for PeerTransport {
    fn send(&mut self, messages: Vec<Message>) {
        for m in messages {
            if let Some(q) = self.queues.get(&m.to) {
                let _ = q.send(m);
            }
        }
    }
}

impl PeerTransport {
    /// Starts a sender task for every other replica in `peers` (by id, 1-based).
    pub(crate) fn start(
        my_id: u64,
        peers: &[String],
        token: Option<String>,
        rt: &tokio::runtime::Handle,
        replica: ReplicaCell,
    ) -> Self {
        let mut queues = HashMap::new();
        for (i, addr) in peers.iter().enumerate() {
            let id = i as u64 + 1;
            if id == my_id {
                continue;
            }
            let (tx, rx) = tokio::sync::mpsc::unbounded_channel();
            queues.insert(id, tx);
            rt.spawn(send_to_peer(my_id, id, addr.clone(), token.clone(), rx, replica.clone()));
        }
        Self { queues }
    }
}

/// Sends one peer's messages in order, batched; a failed send is reported to Raft
/// (which retries) and the messages are dropped.
async fn send_to_peer(
    from: u64,
    to: u64,
    addr: String,
    token: Option<String>,
    mut rx: tokio::sync::mpsc::UnboundedReceiver<Message>,
    replica: ReplicaCell,
) {
    let mut client = None;
    let mut failing = false;
    while let Some(first) = rx.recv().await {
        let mut batch = vec![first];
        while batch.len() < 256 {
            match rx.try_recv() {
                Ok(m) => batch.push(m),
                Err(_) => break,
            }
        }
        let snapshot = batch.iter().any(|m| m.get_msg_type() == MessageType::MsgSnapshot);
        let c = match &mut client {
            Some(c) => c,
            None => match tpuray_proto::client::head_peer(&addr, token.as_deref()) {
                Ok(c) => client.insert(c),
                Err(e) => {
                    tracing::error!(peer = to, %addr, %e, "bad peer address; raft messages to it are dropped");
                    continue;
                }
            },
        };
        let mut req = Request::new(pb::RaftStepRequest {
            from,
            to,
            messages: batch.iter().map(tpuray_replica::encode_message).collect(),
        });
        req.set_timeout(if snapshot { Duration::from_secs(120) } else { Duration::from_secs(2) });
        let result = c.step(req).await;
        let Some(r) = replica.get().and_then(Weak::upgrade) else { continue };
        match result {
            Ok(_) => {
                if failing {
                    tracing::info!(peer = to, %addr, "head peer reachable again");
                    failing = false;
                }
                if snapshot {
                    r.report_snapshot(to, true);
                }
            }
            Err(s) => {
                if !failing {
                    tracing::warn!(peer = to, %addr, %s, "cannot reach head peer");
                    failing = true;
                }
                r.report_unreachable(to);
                if snapshot {
                    r.report_snapshot(to, false);
                }
            }
        }
    }
}

/// `HeadPeerService`: Raft messages from the other heads.
pub(crate) struct PeerSvc(pub Arc<Head>);

#[tonic::async_trait]
impl HeadPeerService for PeerSvc {
    async fn step(
        &self,
        req: Request<pb::RaftStepRequest>,
    ) -> Result<Response<pb::RaftStepReply>, Status> {
        let req = req.into_inner();
        let me = self.0.config.replica_id;
        if req.to != me {
            return Err(Status::failed_precondition(format!(
                "head replica {} sent a raft message for replica {} to replica {me}: check that every head has the same --head-peers and its own --head-id",
                req.from, req.to
            )));
        }
        let replica = self.0.replica().ok_or_else(|| Status::unavailable("head is starting"))?;
        for b in req.messages {
            let m = tpuray_replica::decode_message(&b)
                .map_err(|e| Status::invalid_argument(format!("raft message: {e}")))?;
            replica.step(m);
        }
        Ok(Response::new(pb::RaftStepReply {}))
    }
}

/// Calls a follower (or a leader still catching up) serves itself; the rest are
/// answered with the leader's address (HEAD-7).
const SERVED_BY_ANY_HEAD: [&str; 2] = ["/GetReplicaStatus", "/GetHeadInfo"];

/// Wraps `HeadService`: a head that is not the serving leader answers every call except
/// [`SERVED_BY_ANY_HEAD`] with `UNAVAILABLE` and the leader's address (HEAD-7).
#[derive(Clone)]
pub(crate) struct LeaderGate<S> {
    pub(crate) inner: S,
    pub(crate) head: Arc<Head>,
}

impl<S: NamedService> NamedService for LeaderGate<S> {
    const NAME: &'static str = S::NAME;
}

type GateFuture<F> = Pin<Box<dyn Future<Output = F> + Send>>;

impl<S, B> Service<http::Request<B>> for LeaderGate<S>
where
    S: Service<http::Request<B>, Response = http::Response<Body>, Error = Infallible>,
    S::Future: Send + 'static,
{
    type Response = http::Response<Body>;
    type Error = Infallible;
    type Future = GateFuture<Result<http::Response<Body>, Infallible>>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Infallible>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, req: http::Request<B>) -> Self::Future {
        let path = req.uri().path();
        if !SERVED_BY_ANY_HEAD.iter().any(|m| path.ends_with(m))
            && let Err(status) = self.head.route()
        {
            return Box::pin(async move { Ok(status.into_http()) });
        }
        Box::pin(self.inner.call(req))
    }
}
