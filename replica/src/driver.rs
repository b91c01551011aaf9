//! [`Replica`]: a [`Node`] owned by one dedicated OS thread (RAFT-1) that ticks it on a
//! wall clock, feeds it proposals and peer messages from a channel, runs the Ready loop
//! and hands outgoing messages to a [`Transport`].
//!
//! Storage calls block, so they run on this thread, never on an async executor. The
//! methods of [`Replica`] never block (they post to the thread) except [`Replica::stop`].
//! Replies to proposals are called on the Raft thread: they must be quick (send on a
//! channel).

use std::sync::mpsc::{self, RecvTimeoutError};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use raft::eraftpb::Message;

use crate::kv::KvStore;
use crate::node::{Machine, Node, NodeConfig, NodeError, NodeStatus, ProposeError, Role};

/// Called once with a proposal's outcome.
pub type Reply<O> = Box<dyn FnOnce(Result<O, ProposeError>) + Send>;

/// Sends Raft messages to peers. Called on the Raft thread: must not block. Delivery
/// may fail silently (Raft retries); report failures with [`Replica::report_unreachable`].
pub trait Transport: Send + 'static {
    fn send(&mut self, messages: Vec<Message>);
}

enum Input<O> {
    Propose(Vec<u8>, Reply<O>),
    Step(Box<Message>),
    Unreachable(u64),
    Snapshot(u64, bool),
    Stop,
}

/// A running replica; cheap to share behind an `Arc`.
pub struct Replica<O> {
    tx: mpsc::Sender<Input<O>>,
    status: Arc<Mutex<NodeStatus>>,
    thread: Mutex<Option<JoinHandle<()>>>,
}

impl<O: Send + 'static> Replica<O> {
    /// Opens the replica on the calling thread (so storage errors surface here), then
    /// starts its Raft thread. `on_change` runs on that thread whenever the role, term,
    /// leader or leader readiness changes; `on_fatal` runs once if storage fails, after
    /// which the replica is stopped.
    ///
    /// # Errors
    /// [`NodeError`] when the replica cannot be opened.
    #[allow(clippy::too_many_arguments)]
    pub fn start<K, M>(
        cfg: NodeConfig,
        tick: Duration,
        kv: K,
        machine: M,
        incarnation: u64,
        mut transport: impl Transport,
        mut on_change: impl FnMut(&NodeStatus) + Send + 'static,
        on_fatal: impl FnOnce(NodeError) + Send + 'static,
    ) -> Result<Self, NodeError>
    where
        K: KvStore,
        M: Machine<Output = O> + Send + 'static,
    {
        let logger = crate::logger::raft_logger();
        let mut node: Node<K, M, Reply<O>> =
            Node::open(cfg.clone(), kv, machine, incarnation, &logger)?;
        let status = Arc::new(Mutex::new(node.status()));
        let (tx, rx) = mpsc::channel::<Input<O>>();
        let shared = Arc::clone(&status);
        let thread = std::thread::Builder::new()
            .name(format!("tpuray-raft-{}", cfg.id))
            .spawn(move || {
                let mut next_tick = Instant::now() + tick;
                let mut last = node.status();
                on_change(&last);
                let mut fatal = None;
                'run: loop {
                    let wait = next_tick.saturating_duration_since(Instant::now());
                    let mut inputs = Vec::new();
                    match rx.recv_timeout(wait) {
                        Ok(i) => {
                            inputs.push(i);
                            while inputs.len() < 1024 {
                                match rx.try_recv() {
                                    Ok(i) => inputs.push(i),
                                    Err(_) => break,
                                }
                            }
                        }
                        Err(RecvTimeoutError::Timeout) => {}
                        Err(RecvTimeoutError::Disconnected) => break 'run,
                    }
                    for i in inputs {
                        match i {
                            Input::Propose(data, reply) => {
                                if let Err((reply, e)) = node.propose(data, reply) {
                                    reply(Err(e));
                                }
                            }
                            Input::Step(m) => node.step(*m),
                            Input::Unreachable(id) => node.report_unreachable(id),
                            Input::Snapshot(id, ok) => node.report_snapshot(id, ok),
                            Input::Stop => break 'run,
                        }
                    }
                    let now = Instant::now();
                    if now >= next_tick {
                        node.tick();
                        next_tick += tick;
                        if next_tick < now {
                            next_tick = now + tick;
                        }
                    }
                    match node.handle_ready() {
                        Ok(fx) => {
                            if !fx.messages.is_empty() {
                                transport.send(fx.messages);
                            }
                            for (reply, out) in fx.applied {
                                reply(Ok(out));
                            }
                            for (reply, e) in fx.dropped {
                                reply(Err(e));
                            }
                        }
                        Err(e) => {
                            tracing::error!(%e, "raft storage failed; this replica stops");
                            fatal = Some(e);
                            break 'run;
                        }
                    }
                    let st = node.status();
                    let changed = (st.role, st.term, st.leader_id, st.leader_ready)
                        != (last.role, last.term, last.leader_id, last.leader_ready);
                    *shared.lock().unwrap_or_else(|p| p.into_inner()) = st.clone();
                    if changed {
                        on_change(&st);
                    }
                    last = st;
                }
                // Whatever is still queued gets an answer.
                while let Ok(i) = rx.try_recv() {
                    if let Input::Propose(_, reply) = i {
                        reply(Err(ProposeError::Stopped));
                    }
                }
                let mut st = node.status();
                st.role = Role::Follower;
                st.leader_ready = false;
                st.leader_id = 0;
                *shared.lock().unwrap_or_else(|p| p.into_inner()) = st.clone();
                on_change(&st);
                if let Some(e) = fatal {
                    on_fatal(e);
                }
            })
            .map_err(|e| {
                NodeError::Store(crate::kv::StoreError::Io(format!(
                    "cannot start the raft thread: {e}"
                )))
            })?;
        Ok(Self { tx, status, thread: Mutex::new(Some(thread)) })
    }

    fn post(&self, i: Input<O>) -> Result<(), Input<O>> {
        self.tx.send(i).map_err(|e| e.0)
    }

    /// Proposes `data`; `reply` gets the machine's output once the entry is applied.
    pub fn propose(&self, data: Vec<u8>, reply: Reply<O>) {
        if let Err(Input::Propose(_, reply)) = self.post(Input::Propose(data, reply)) {
            reply(Err(ProposeError::Stopped));
        }
    }

    /// A message from a peer.
    pub fn step(&self, m: Message) {
        let _ = self.post(Input::Step(Box::new(m)));
    }

    pub fn report_unreachable(&self, id: u64) {
        let _ = self.post(Input::Unreachable(id));
    }

    pub fn report_snapshot(&self, id: u64, delivered: bool) {
        let _ = self.post(Input::Snapshot(id, delivered));
    }

    /// The replica's status after its last Ready round.
    pub fn status(&self) -> NodeStatus {
        self.status.lock().unwrap_or_else(|p| p.into_inner()).clone()
    }

    /// Stops the Raft thread and waits for it (blocks briefly).
    pub fn stop(&self) {
        let _ = self.post(Input::Stop);
        let t = self.thread.lock().unwrap_or_else(|p| p.into_inner()).take();
        if let Some(t) = t
            && t.thread().id() != std::thread::current().id()
        {
            let _ = t.join();
        }
    }
}
