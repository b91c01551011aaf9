//! Actors from the caller's side: creation through the head, and each actor's ordered
//! sender (CORE-4) that resolves the actor's address, numbers calls per incarnation,
//! resends calls that never reached it and decides what a lost call becomes.
//!
//! In full:
//! - CORE-4: one ordered sender per actor per caller; the actor releases calls by
//!   per-caller sequence number (reset per incarnation); calls that never reached a
//!   dead instance are resent to its restart.
//! - CORE-13 (`Core::call_actor`): a caller's unfinished calls to one actor are
//!   counted per actor (`ActorConn::pending`, until each call's result or failure is
//!   recorded); one more than the handle's `max_pending_calls` is refused at submission
//!   with `PendingCallsLimitExceeded`, nothing sent.

use super::*;

/// How long the caller of an actor call lost mid-call waits for the head to say whether
/// the actor died or restarts ([`Core::lost_call_error`]); Ray waits
/// `timeout_ms_task_wait_for_death_info` the same way.
pub(super) const ACTOR_DEATH_INFO_WAIT: Duration = Duration::from_secs(5);

/// A call, its pinned arguments, delivery attempts so far, retries left after the actor
/// dies mid-call or the method raises, and whether the method's exceptions are retried:
/// what the ordered sender sends again ([`ActorConn::retry_tx`]).
pub(super) type Resend = (pb::TaskSpec, Vec<RawRef>, u32, i32, bool);

/// Per-actor caller state: the ordered sender (CORE-4).
pub(super) struct ActorConn {
    /// (call, its arguments being resolved, retries left, retry on the method's own
    /// exceptions).
    pub(super) tx: tokio::sync::mpsc::UnboundedSender<(pb::TaskSpec, ResolvedArgs, i32, bool)>,
    /// Calls that never reached the actor (connection refused: it died or moved), or are
    /// retried, go back to the sender here and out again before newer calls.
    pub(super) retry_tx: tokio::sync::mpsc::UnboundedSender<Resend>,
    /// Task ids of this process's calls to the actor that are not finished (CORE-13:
    /// what `max_pending_calls` bounds).
    pub(super) pending: Mutex<std::collections::HashSet<String>>,
    /// What the sender knows, shared with callers that send on their own thread.
    pub(super) state: Mutex<SenderState>,
}

/// The ordered sender's state (CORE-4). A caller's thread sends a call itself over the
/// direct connection (CORE-15) only while `backlog` is 0: every call before it has its
/// sequence number, so the actor's per-caller order is the submission order either way.
#[derive(Default)]
pub(super) struct SenderState {
    /// The actor's (worker address, incarnation, node id), once known; cleared when a
    /// call is lost.
    pub(super) current: Option<(String, u32, String)>,
    /// The incarnation `seq` counts in (numbers restart at 0 with each).
    pub(super) incarnation: Option<u32>,
    pub(super) seq: u64,
    /// Calls handed to the sender task (new or to resend) and not numbered yet.
    pub(super) backlog: usize,
    /// The direct connection to `current`'s address, when open.
    pub(super) direct: Option<Arc<crate::direct::DirectConn>>,
}

/// One call in flight: what deciding its outcome needs ([`Core::settle_actor_call`]).
pub(super) struct InFlight {
    pub(super) conn: Arc<ActorConn>,
    pub(super) actor_id: String,
    pub(super) spec: pb::TaskSpec,
    pub(super) pins: Vec<RawRef>,
    pub(super) attempts: u32,
    pub(super) retries: i32,
    pub(super) retry_exceptions: bool,
    /// The incarnation it was sent to.
    pub(super) inc: u32,
}

impl ActorConn {
    /// Queues a call for the sender to send again.
    fn resend(&self, r: Resend) {
        self.state.lock().unwrap().backlog += 1;
        let _ = self.retry_tx.send(r);
    }

    /// Takes `d` as the direct connection when it leads to the actor's current address
    /// (the actor may have moved while it was opened).
    fn adopt(&self, d: Arc<crate::direct::DirectConn>) {
        let mut st = self.state.lock().unwrap();
        if st.current.as_ref().is_some_and(|c| c.0 == d.address) {
            st.direct = Some(d);
        }
    }

    /// Closes the direct connection, if any (its calls in flight fail as lost).
    pub(super) fn close_direct(&self) {
        if let Some(d) = self.state.lock().unwrap().direct.take() {
            d.close(None);
        }
    }
}

/// True when a call failed before reaching the server (nothing ran).
pub(super) fn is_connect_error(s: &tonic::Status) -> bool {
    let m = s.message();
    s.code() == tonic::Code::Unavailable
        && (m.contains("connect")
            || m.contains("Connection refused")
            || m.contains("connection refused"))
}

pub(super) type ResolvedArgs =
    tokio::sync::oneshot::Receiver<Result<(Vec<pb::TaskArg>, Vec<RawRef>), pb::TaskError>>;

pub(super) fn short_class(class: &str) -> &str {
    class.rsplit("::").next().unwrap_or(class)
}

impl Core {
    /// This process's unfinished calls to `actor_id` (CORE-13).
    pub(crate) fn pending_actor_calls(&self, actor_id: &str) -> usize {
        let conn = self.actors.lock().unwrap().get(actor_id).cloned();
        conn.map(|c| c.pending.lock().unwrap().len()).unwrap_or(0)
    }

    /// An actor call ended (CORE-13): it no longer counts against `max_pending_calls`.
    pub(super) fn actor_call_done(&self, spec: &pb::TaskSpec) {
        if spec.actor_id.is_empty() || spec.actor_creation {
            return;
        }
        let conn = self.actors.lock().unwrap().get(&spec.actor_id).cloned();
        if let Some(c) = conn {
            c.pending.lock().unwrap().remove(&spec.task_id);
        }
    }

    // ---- actors ----

    pub(crate) async fn create_actor(
        self: &Arc<Self>,
        class: &str,
        args: Vec<Arg>,
        opts: &crate::options::ActorOptions,
    ) -> Result<crate::actor::ActorHandle, Error> {
        self.create_actor_as(class, class, args, opts).await
    }

    /// Creates an actor of class `class` (the worker's key for it: a registry name, or a
    /// function-table key for Python) shown as `display`.
    pub(crate) async fn create_actor_as(
        self: &Arc<Self>,
        class: &str,
        display: &str,
        args: Vec<Arg>,
        opts: &crate::options::ActorOptions,
    ) -> Result<crate::actor::ActorHandle, Error> {
        let captured =
            captured_group().filter(|_| opts.scheduling == Scheduling::Default).map(|pg| {
                crate::options::ActorOptions {
                    scheduling: Scheduling::PlacementGroup {
                        placement_group_id: pg,
                        bundle_index: -1,
                    },
                    capture_child_tasks: true,
                    ..opts.clone()
                }
            });
        let opts = captured.as_ref().unwrap_or(opts);
        let mut spec = self.base_spec(class, Some(display), 0, false);
        spec.actor_creation = true;
        spec.function = Some(pb::FunctionDescriptor {
            language: crate::foreign::language().into(),
            name: class.into(),
            class_name: display.into(),
        });
        spec.max_concurrency = opts.max_concurrency.max(1);
        spec.runtime_env_hash = opts.runtime_env_hash.clone();
        for (group, limit) in &opts.concurrency_groups {
            if group.is_empty() || *limit == 0 {
                return Err(Error::Cluster(format!(
                    "concurrency group {group:?} of actor {display}: a group needs a name and a max_concurrency of 1 or more (got {limit})"
                )));
            }
        }
        for (method, group) in &opts.method_groups {
            if !opts.concurrency_groups.contains_key(group) {
                return Err(Error::Cluster(format!(
                    "method {method} of actor {display} runs in concurrency group {group:?}, which the actor does not define (defined: {:?})",
                    opts.concurrency_groups.keys().collect::<Vec<_>>()
                )));
            }
        }
        spec.concurrency_groups =
            opts.concurrency_groups.iter().map(|(k, v)| (k.clone(), *v)).collect();
        spec.method_groups =
            opts.method_groups.iter().map(|(k, v)| (k.clone(), v.clone())).collect();
        spec.capture_child_tasks = opts.capture_child_tasks;
        if let Scheduling::PlacementGroup { placement_group_id, .. } = &opts.scheduling {
            spec.placement_group_id = placement_group_id.clone();
        }
        let (args, _pins) =
            self.resolve_args(args, class).await.map_err(|e| Error::from_wire(&e, class))?;
        spec.args = args;
        let mut resources: HashMap<String, f64> =
            opts.resources.iter().map(|(k, v)| (k.clone(), *v)).collect();
        if let Some(c) = opts.num_cpus {
            resources.insert("CPU".into(), c);
        }
        if opts.num_gpus > 0.0 {
            resources.insert("GPU".into(), opts.num_gpus);
        }
        // The creation task carries what the actor asked for, explicitly (Ray's
        // `get_assigned_resources` in its methods; the head and agent account with
        // the request's `resources`, which the placement default is added to).
        spec.resources = resources.clone();
        let labels = tpuray_scheduler::parse_label_selector(&opts.label_selector)
            .map_err(|e| Error::Cluster(format!("label_selector: {e}")))?;
        let mut head = self.head_client().map_err(|e| Error::Cluster(e.to_string()))?;
        let reply = head
            .create_actor(pb::CreateActorRequest {
                request_id: tpuray_proto::new_request_id(),
                job_id: self.job_id.clone(),
                name: opts.name.clone().unwrap_or_default(),
                namespace: opts.namespace.clone().unwrap_or_default(),
                class_name: display.to_string(),
                resources,
                max_restarts: opts.max_restarts,
                detached: opts.detached,
                label_selector: tpuray_proto::convert::labels_to_proto(&labels),
                strategy: Some(opts.scheduling.to_proto()),
                get_if_exists: opts.get_if_exists,
                creation_task: prost::Message::encode_to_vec(&spec),
            })
            .await
            .map_err(|s| Error::Cluster(format!("creating actor {display}: {}", s.message())))?
            .into_inner();
        let a = reply.actor.unwrap_or_default();
        Ok(crate::actor::ActorHandle {
            actor_id: a.actor_id,
            class: display.to_string(),
            name: a.name,
            max_task_retries: opts.max_task_retries,
            max_pending_calls: opts.max_pending_calls,
        })
    }

    /// Submits an actor method call through the actor's ordered sender (CORE-4).
    ///
    /// # Errors
    /// [`Error::PendingCallsLimitExceeded`] when this process already has the handle's
    /// `max_pending_calls` unfinished calls to the actor (CORE-13: refused here, before
    /// anything is registered or sent).
    pub(crate) fn call_actor(
        self: &Arc<Self>,
        handle: &crate::actor::ActorHandle,
        method: &str,
        args: Vec<Arg>,
        streaming: bool,
        num_returns: u32,
        call: &crate::options::CallOptions,
    ) -> Result<pb::TaskSpec, Error> {
        let display = format!("{}.{method}", short_class(&handle.class));
        let conn = self.actor_conn(&handle.actor_id);
        if handle.max_pending_calls >= 0 {
            let pending = conn.pending.lock().unwrap().len();
            if pending >= handle.max_pending_calls as usize {
                return Err(Error::PendingCallsLimitExceeded {
                    function: display,
                    message: format!(
                        "the call {}.{method} could not be submitted to actor {}: {pending} of its calls from this process are unfinished (max_pending_calls={})",
                        short_class(&handle.class),
                        handle.actor_id,
                        handle.max_pending_calls
                    ),
                });
            }
        }
        let mut spec = self.base_spec(
            method,
            Some(&display),
            if streaming { 0 } else { num_returns },
            streaming,
        );
        spec.actor_id = handle.actor_id.clone();
        spec.concurrency_group = call.concurrency_group.clone();
        spec.function = Some(pb::FunctionDescriptor {
            language: crate::foreign::language().into(),
            name: method.into(),
            class_name: handle.class.clone(),
        });
        conn.pending.lock().unwrap().insert(spec.task_id.clone());
        self.register_submitted(&spec);
        let retries = call.max_task_retries.unwrap_or(handle.max_task_retries);
        // Resolve arguments at once, in parallel with earlier calls; the
        // sender awaits them in submission order.
        let (tx, rx) = tokio::sync::oneshot::channel();
        match Self::resolve_args_now(args) {
            Ok((args, pins)) => {
                let mut st = conn.state.lock().unwrap();
                let direct = st.direct.clone().filter(|d| d.alive());
                match (st.current.clone(), direct) {
                    // CORE-15: nothing queued before it, the actor's address known and a
                    // direct connection to it open: sent from this thread.
                    (Some((address, inc, node_id)), Some(d))
                        if st.backlog == 0
                            && st.incarnation == Some(inc)
                            && d.address == address
                            && !self.deaths.is_dead(&node_id) =>
                    {
                        spec.sequence_no = st.seq;
                        st.seq += 1;
                        let mut sent = spec.clone();
                        sent.args = args;
                        let frame = crate::direct::encode_call(&sent);
                        self.running.lock().unwrap().insert(
                            spec.task_id.clone(),
                            Running { worker_address: address, cancelled: false, actor: true },
                        );
                        let call = InFlight {
                            conn: Arc::clone(&conn),
                            actor_id: handle.actor_id.clone(),
                            spec: sent,
                            pins,
                            attempts: 0,
                            retries,
                            retry_exceptions: call.retry_exceptions,
                            inc,
                        };
                        let core = Arc::clone(self);
                        // Written under the state's lock: calls leave in their order.
                        // A sync get on this thread may read the reply itself, unless
                        // this is a runtime thread (which never blocks in one).
                        let mine = tokio::runtime::Handle::try_current()
                            .is_err()
                            .then(|| spec.return_ids.clone());
                        let sent = d.call(
                            frame,
                            Box::new(move |result| core.settle_actor_call(call, result)),
                            mine,
                        );
                        drop(st);
                        match sent {
                            crate::direct::Sent::Yes => {}
                            // Numbered already: the same call over gRPC, so the actor
                            // sees no gap in this caller's sequence.
                            crate::direct::Sent::Not(done, frame) => {
                                let core = Arc::clone(self);
                                let address = d.address.clone();
                                let spec = crate::direct::decode_call(&frame);
                                self.rt.spawn(async move {
                                    done(core.push_over_grpc(&spec, &address, &node_id).await)
                                });
                            }
                            crate::direct::Sent::Lost(done, status) => done(Err(status)),
                        }
                        return Ok(spec);
                    }
                    _ => {
                        st.backlog += 1;
                        let _ = tx.send(Ok((args, pins)));
                    }
                }
            }
            Err(args) => {
                conn.state.lock().unwrap().backlog += 1;
                let core = Arc::clone(self);
                self.rt.spawn(async move {
                    let _ = tx.send(core.resolve_args(args, &display).await);
                });
            }
        }
        let _ = conn.tx.send((spec.clone(), rx, retries, call.retry_exceptions));
        Ok(spec)
    }

    pub(super) fn actor_conn(self: &Arc<Self>, actor_id: &str) -> Arc<ActorConn> {
        let mut actors = self.actors.lock().unwrap();
        if let Some(c) = actors.get(actor_id) {
            return Arc::clone(c);
        }
        let (tx, rx) = tokio::sync::mpsc::unbounded_channel();
        let (retry_tx, retry_rx) = tokio::sync::mpsc::unbounded_channel();
        let conn = Arc::new(ActorConn {
            tx,
            retry_tx,
            pending: Mutex::new(Default::default()),
            state: Mutex::new(SenderState::default()),
        });
        actors.insert(actor_id.to_string(), Arc::clone(&conn));
        let core = Arc::clone(self);
        let id = actor_id.to_string();
        let sender = Arc::clone(&conn);
        self.rt.spawn(async move { core.actor_sender(id, sender, rx, retry_rx).await });
        conn
    }

    /// The open direct connection (CORE-15) to the worker at `address` on `node_id`, or
    /// `None` while there is none: then one is opened in the background (one attempt per
    /// address at a time) and handed to `opened`. Its calls fail as lost when the head
    /// declares the node dead (CORE-10). A worker that refuses it, or cannot be reached,
    /// leaves the calls on gRPC (asked again on a later call).
    pub(super) fn direct_to(
        self: &Arc<Self>,
        address: &str,
        node_id: &str,
        opened: impl FnOnce(Arc<crate::direct::DirectConn>) + Send + 'static,
    ) -> Option<Arc<crate::direct::DirectConn>> {
        if !crate::direct::enabled() {
            return None;
        }
        {
            let mut direct = self.direct.lock().unwrap();
            match direct.get(address) {
                Some(Some(d)) if d.alive() => return Some(Arc::clone(d)),
                Some(None) => return None,
                _ => {}
            }
            direct.insert(address.to_string(), None);
        }
        let core = Arc::clone(self);
        let (address, node_id) = (address.to_string(), node_id.to_string());
        let rt = self.rt.clone();
        self.rt.spawn(async move {
            let (a, token) = (address.clone(), core.token.clone());
            let d = tokio::task::spawn_blocking(move || {
                crate::direct::DirectConn::connect(&a, token.as_deref(), rt)
            })
            .await;
            let Ok(Ok(d)) = d else {
                core.direct.lock().unwrap().remove(&address);
                return;
            };
            core.direct.lock().unwrap().insert(address.clone(), Some(Arc::clone(&d)));
            opened(Arc::clone(&d));
            // CORE-10: calls on a node the head declares dead are lost with it.
            while d.alive() {
                tokio::select! {
                    () = core.deaths.died(&node_id) => {
                        d.close(Some(node_died(&node_id)));
                        break;
                    }
                    () = tokio::time::sleep(Duration::from_secs(1)) => {}
                }
            }
            let mut direct = core.direct.lock().unwrap();
            if direct.get(&address).is_some_and(|e| e.as_ref().is_some_and(|e| Arc::ptr_eq(e, &d)))
            {
                direct.remove(&address);
            }
        });
        None
    }

    /// Gives the actor's sender the direct connection to `address` once there is one.
    fn open_direct(self: &Arc<Self>, conn: &Arc<ActorConn>, address: &str, node_id: &str) {
        {
            let st = conn.state.lock().unwrap();
            if st.direct.as_ref().is_some_and(|d| d.alive() && d.address == address) {
                return;
            }
        }
        // Set now when open; when being opened, set once open (unless the actor moved).
        let later = Arc::clone(conn);
        if let Some(d) = self.direct_to(address, node_id, move |d| later.adopt(d)) {
            conn.adopt(d);
        }
    }

    /// Waits until the actor is ALIVE on a node not known dead (CORE-10): (worker
    /// address, incarnation, node id).
    /// The error of a call lost mid-call on incarnation `inc` (its `num_restarts`) of
    /// `actor_id` with no retries left, as Ray's actor submitter decides it: the actor is
    /// dead by the head's record (waited for up to [`ACTOR_DEATH_INFO_WAIT`]) →
    /// `ActorDied`; restarting, restarted, or no news by then → `ActorUnavailable` (the
    /// call may or may not have run). Ray: `actor_task_submitter.cc`, the push-failure
    /// path and `timeout_ms_task_wait_for_death_info`.
    pub(super) async fn lost_call_error(
        &self,
        actor_id: &str,
        inc: u32,
        status: &tonic::Status,
        function: &str,
    ) -> pb::TaskError {
        let why = tpuray_proto::client::status_chain(status);
        let deadline = Instant::now() + ACTOR_DEATH_INFO_WAIT;
        let mut dead = None;
        if let Ok(mut head) = self.head_client() {
            while Instant::now() < deadline {
                let mut req = Request::new(pb::GetActorRequest {
                    actor_id: actor_id.to_string(),
                    ..Default::default()
                });
                req.set_timeout(ACTOR_DEATH_INFO_WAIT);
                match head.get_actor(req).await.map(|r| r.into_inner().actor) {
                    Ok(Some(a)) if a.state == pb::ActorState::Dead as i32 => {
                        dead = Some(a.death_cause);
                        break;
                    }
                    Ok(Some(a))
                        if a.state == pb::ActorState::Restarting as i32
                            || a.state == pb::ActorState::PendingCreation as i32
                            || a.num_restarts != inc =>
                    {
                        break;
                    }
                    Err(s) if s.code() == tonic::Code::NotFound => {
                        dead = Some(s.message().to_string());
                        break;
                    }
                    _ => tokio::time::sleep(Duration::from_millis(100)).await,
                }
            }
        }
        match dead {
            Some(cause) => err(
                Kind::ActorDied,
                format!("the actor died while running the call ({why}): {cause}"),
                function,
            ),
            None => err(
                Kind::ActorUnavailable,
                format!(
                    "The actor {actor_id} is unavailable: The actor is temporarily \
                     unavailable: {why}. The task may or may not have been executed on the actor."
                ),
                function,
            ),
        }
    }

    pub(super) async fn wait_actor_alive(
        &self,
        actor_id: &str,
    ) -> Result<(String, u32, String), String> {
        let mut head = self.head_client().map_err(|e| e.to_string())?;
        let mut warned = false;
        let started = Instant::now();
        loop {
            let mut req = Request::new(pb::GetActorRequest {
                actor_id: actor_id.to_string(),
                wait_alive_ms: 5_000,
                ..Default::default()
            });
            req.set_timeout(Duration::from_secs(30));
            let a = match head.get_actor(req).await {
                Ok(r) => r.into_inner().actor.unwrap_or_default(),
                Err(s) if s.code() == tonic::Code::NotFound => return Err(s.message().to_string()),
                Err(_) => {
                    tokio::time::sleep(Duration::from_millis(200)).await;
                    continue;
                }
            };
            if a.state == pb::ActorState::Alive as i32 {
                if self.deaths.is_dead(&a.node_id) {
                    // The head's record is about to move it (its node died).
                    tokio::time::sleep(Duration::from_millis(100)).await;
                    continue;
                }
                return Ok((a.worker_address, a.num_restarts, a.node_id));
            }
            if a.state == pb::ActorState::Dead as i32 {
                return Err(a.death_cause);
            }
            if !warned && started.elapsed() > Duration::from_secs(5) && !a.pending_reason.is_empty()
            {
                warned = true;
                eprintln!(
                    "tpuray: warning: actor {} is not placed yet: {}",
                    a.class_name, a.pending_reason
                );
            }
        }
    }

    pub(super) async fn actor_sender(
        self: Arc<Self>,
        actor_id: String,
        conn: Arc<ActorConn>,
        mut rx: tokio::sync::mpsc::UnboundedReceiver<(pb::TaskSpec, ResolvedArgs, i32, bool)>,
        mut retry_rx: tokio::sync::mpsc::UnboundedReceiver<Resend>,
    ) {
        self.watch_nodes();
        loop {
            let (mut spec, pins, attempts, retries, retry_exceptions) = tokio::select! {
                biased;
                Some(r) = retry_rx.recv() => r,
                next = rx.recv() => {
                    let Some((mut spec, resolved, retries, retry_exceptions)) = next else {
                        conn.close_direct();
                        return;
                    };
                    match resolved.await {
                        Ok(Ok((args, pins))) => {
                            spec.args = args;
                            (spec, pins, 0, retries, retry_exceptions)
                        }
                        Ok(Err(e)) => {
                            conn.state.lock().unwrap().backlog -= 1;
                            self.finish_failed(&spec, e);
                            continue;
                        }
                        Err(_) => {
                            conn.state.lock().unwrap().backlog -= 1;
                            continue;
                        }
                    }
                }
            };
            if attempts > 0 {
                tokio::time::sleep(Duration::from_millis(100 * u64::from(attempts.min(5)))).await;
            }
            let known = conn.state.lock().unwrap().current.clone();
            let (address, inc, node_id) = match known {
                Some(a) => a,
                None => match self.wait_actor_alive(&actor_id).await {
                    Ok(a) => {
                        conn.state.lock().unwrap().current = Some(a.clone());
                        a
                    }
                    Err(cause) => {
                        conn.state.lock().unwrap().backlog -= 1;
                        let e =
                            err(Kind::ActorDied, format!("the actor is dead: {cause}"), &spec.name);
                        self.finish_failed(&spec, e);
                        continue;
                    }
                },
            };
            {
                let mut st = conn.state.lock().unwrap();
                if st.incarnation != Some(inc) {
                    st.incarnation = Some(inc);
                    st.seq = 0;
                }
                spec.sequence_no = st.seq;
                st.seq += 1;
                st.backlog -= 1;
            }
            self.open_direct(&conn, &address, &node_id);
            let core = Arc::clone(&self);
            self.running.lock().unwrap().insert(
                spec.task_id.clone(),
                Running { worker_address: address.clone(), cancelled: false, actor: true },
            );
            let call = InFlight {
                conn: Arc::clone(&conn),
                actor_id: actor_id.clone(),
                spec,
                pins,
                attempts,
                retries,
                retry_exceptions,
                inc,
            };
            self.rt.spawn(async move {
                let result = core.push_over_grpc(&call.spec, &address, &node_id).await;
                core.settle_actor_call(call, result);
            });
        }
    }

    /// Sends an actor call over gRPC to the actor's worker at `address` on `node_id`.
    async fn push_over_grpc(
        &self,
        spec: &pb::TaskSpec,
        address: &str,
        node_id: &str,
    ) -> Result<pb::PushTaskReply, tonic::Status> {
        match self.worker_client(address) {
            // CORE-10: never sent to a dead node: resent to the restart.
            Ok(_) if self.deaths.is_dead(node_id) => Err(tonic::Status::unavailable(format!(
                "not sent: {}; tcp connect error",
                node_died(node_id).message()
            ))),
            Ok(mut c) => {
                let push = c.push_task(pb::PushTaskRequest { spec: Some(spec.clone()) });
                // Lost with its node mid-call: as a lost connection.
                self.unless_node_dies(node_id, push).await.map(|r| r.into_inner())
            }
            Err(e) => Err(tonic::Status::internal(e.to_string())),
        }
    }

    /// Decides what an actor call's reply or failure becomes (CORE-4/5/12), from the
    /// task that sent it over gRPC or a direct connection's reader thread (CORE-15): its
    /// result recorded, the call sent again, or failed.
    pub(super) fn settle_actor_call(
        self: &Arc<Self>,
        call: InFlight,
        result: Result<pb::PushTaskReply, tonic::Status>,
    ) {
        let InFlight { conn, actor_id, mut spec, pins, attempts, retries, retry_exceptions, inc } =
            call;
        let cancelled =
            self.running.lock().unwrap().remove(&spec.task_id).is_some_and(|r| r.cancelled);
        let attempt = retry::Attempt {
            work: retry::Work::ActorCall,
            retries_left: retries,
            retry_exceptions,
            cancelled,
            undelivered: attempts,
        };
        let outcome = match &result {
            Ok(reply) => match &reply.error {
                Some(e) => retry::Outcome::Raised {
                    application: e.kind == Kind::Application as i32,
                    no_retry: e.no_retry,
                },
                None => retry::Outcome::Returned,
            },
            Err(status) => retry::Outcome::Lost { reached: !is_connect_error(status) },
        };
        if result.is_err() {
            let mut st = conn.state.lock().unwrap();
            st.current = None;
            if let Some(d) = st.direct.take() {
                d.close(None);
            }
        }
        match (retry::decide(&attempt, outcome), result) {
            // CORE-12: a call cancelled while it ran is not retried, and its
            // get fails with Cancelled (Ray's TaskCancelledError).
            (retry::Decision::FailCancelled, _) => {
                self.finish_failed(&spec, err(Kind::Cancelled, "cancelled", &spec.name));
            }
            (retry::Decision::Finish, Ok(reply)) => self.finish_ok(&spec, reply),
            // Never reached the actor (it died or moved): sent again, before newer
            // calls, once its next address is known.
            (retry::Decision::Resend, _) => {
                conn.resend((spec, pins, attempts + 1, retries, retry_exceptions));
            }
            // The method raised with retry_exceptions (Ray's, per method or per
            // call), or the actor died mid-call: Ray's max_task_retries sends it
            // again to the restarted actor (which fails it if the actor stays dead).
            (retry::Decision::Retry { retries_left }, result) => {
                spec.attempt += 1;
                let backoff = u32::from(result.is_err());
                conn.resend((spec, pins, backoff, retries_left, retry_exceptions));
            }
            (retry::Decision::Fail, Ok(reply)) => {
                let e = reply.error.unwrap_or_default();
                self.finish_failed(&spec, e);
            }
            (retry::Decision::Fail, Err(status)) => {
                let core = Arc::clone(self);
                self.rt.spawn(async move {
                    let e = core.lost_call_error(&actor_id, inc, &status, &spec.name).await;
                    core.finish_failed(&spec, e);
                });
            }
            (decision, _) => {
                // decide() gives actor calls none of these (a Finish comes only
                // with a reply, a Requeue only for tasks): fail loudly.
                let e = err(
                    Kind::WorkerDied,
                    format!("internal error: retry decision {decision:?} for an actor call"),
                    &spec.name,
                );
                self.finish_failed(&spec, e);
            }
        }
    }
}
