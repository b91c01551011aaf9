//! Leasing workers for a scheduling class and pushing its queued tasks to them
//! (CORE-3, CORE-9): how many leases a class asks for, the lease loop (spillback,
//! infeasible, set-up failures), and the pipelined pushes to one leased worker.
//!
//! In full:
//! - CORE-3: tasks of one scheduling class share leases from the local agent
//!   (following spillback), as many leases as queued tasks (up to 32); an idle lease
//!   lingers 100 ms for the next task.
//! - CORE-9: one task in flight per worker (Ray's default
//!   `max_tasks_in_flight_per_worker`), except while a lease request of the class waits
//!   for resources (the node has no CPU left for it) and the class's pushes average at
//!   most 2 ms: then up to 256 per worker, fewer as pushes slow (about 32 ms of the
//!   class's average push queued per worker), sent in batches of up to 128 tasks and ~4
//!   MiB (`PushTasks`, whose replies stream back as each task ends, those ready
//!   together in one message), so quick tasks stop paying a round trip each. The owner
//!   handles every answer already in before it pushes again, and tops a worker's
//!   pipeline up only once a quarter of it is free, so answers arriving one by one
//!   still go out as batches. Arguments that need no waiting (values, no top-level
//!   refs) are resolved on the caller's thread, with no runtime task per call.
//!   `TPURAY_MAX_TASKS_IN_FLIGHT_PER_WORKER` fixes the depth instead. A task queued
//!   behind another on a worker goes back to its owner unrun (`PushTaskReply.not_run`,
//!   no attempt counted) when the running task blocks in get/wait (it may wait for that
//!   very task) or after 50 ms in the queue (the one in front is slow); the owner
//!   queues it first again, sends nothing more to that worker until it answers, and
//!   pushes one task at a time for a second.

use super::*;

/// Tasks pushed to one leased worker before the first one finishes, when
/// `TPURAY_MAX_TASKS_IN_FLIGHT_PER_WORKER` fixes it (Ray's
/// `max_tasks_in_flight_per_worker`). Unset: adaptive (CORE-9), see
/// [`Class::depth`].
pub(super) fn fixed_pipeline_depth() -> Option<usize> {
    static DEPTH: OnceLock<Option<usize>> = OnceLock::new();
    *DEPTH.get_or_init(|| {
        std::env::var("TPURAY_MAX_TASKS_IN_FLIGHT_PER_WORKER")
            .ok()
            .and_then(|v| v.parse().ok())
            .filter(|&d| d >= 1)
    })
}

/// Tasks sent to one worker in one `PushTasks` call at most (CORE-9): half the deep
/// pipeline, so the worker runs one batch while the next is on its way.
pub(super) const PUSH_BATCH_MAX: usize = DEEP_PIPELINE / 2;

/// A `PushTasks` call carries tasks up to about this many bytes of specs (their inline
/// arguments included), at least one, far below the servers' message limit.
pub(super) const PUSH_BATCH_BYTES: usize = 4 * 1024 * 1024;

/// How long a class pushes one task at a time after a task of it came back
/// unrun (CORE-9).
pub(super) const SHALLOW_AFTER_GIVE_BACK: Duration = Duration::from_secs(1);

/// How long an idle lease waits for another task of its class before it
/// is returned.
pub(super) const LEASE_LINGER: Duration = Duration::from_millis(100);

pub(super) struct Queued {
    pub(super) spec: pb::TaskSpec,
    pub(super) retries_left: i32,
    pub(super) retry_exceptions: bool,
    /// Argument refs kept alive until the task ends (CORE-2), then by its
    /// lineage (CORE-6).
    pub(super) pins: Vec<RawRef>,
}

pub(super) struct Class {
    pub(super) resources: HashMap<String, f64>,
    pub(super) strategy: pb::SchedulingStrategy,
    pub(super) labels: Vec<pb::LabelConstraint>,
    /// The placement group and bundle index the class runs in (SCHED-19).
    pub(super) pg: Option<(String, i32)>,
    pub(super) runtime_env_hash: String,
    pub(super) queue: Mutex<VecDeque<Queued>>,
    pub(super) leases: AtomicUsize,
    /// Tasks pushed to this class's leased workers and not answered yet.
    pub(super) in_flight: AtomicUsize,
    pub(super) warned: AtomicBool,
    /// Signalled when a task is queued (a lingering lease picks it up).
    pub(super) queued: Notify,
    /// Lease requests of this class waiting for an agent's answer: while one
    /// waits, the node has no resources for another worker of the class.
    pub(super) asking: AtomicUsize,
    /// Moving average of a push's round trip, in microseconds (`u64::MAX`
    /// before the first).
    pub(super) push_us: AtomicU64,
    /// Until when (`now_ms`) the class pushes one task at a time.
    pub(super) shallow_until_ms: AtomicU64,
    /// Leases whose worker handed tasks back and takes no more until it answers.
    pub(super) stalled: AtomicUsize,
}

impl Class {
    /// Tasks one leased worker of this class may hold at once now ([`pipeline::depth`]).
    pub(super) fn depth(&self) -> usize {
        pipeline::depth(
            fixed_pipeline_depth(),
            self.push_us.load(Ordering::Relaxed),
            self.asking.load(Ordering::Relaxed),
            now_ms(),
            self.shallow_until_ms.load(Ordering::Relaxed),
        )
    }

    pub(super) fn note_push(&self, took: Duration) {
        let us = took.as_micros().min(u128::from(u64::MAX / 8)) as u64;
        let old = self.push_us.load(Ordering::Relaxed);
        let new = if old == u64::MAX { us } else { (old * 7 + us) / 8 };
        self.push_us.store(new, Ordering::Relaxed);
    }
}

/// A pushed task's answer: the task, its reply or the call's failure, and the time it
/// took (for a batch: since the batch went out, divided by the answers so far).
pub(super) type Pushed = (Queued, Result<pb::PushTaskReply, tonic::Status>, Duration);

/// Pushes one task (`PushTask`) or a batch (`PushTasks`) to a leased worker and sends
/// each task's answer to `done` as it comes (CORE-9); tasks a broken stream left
/// unanswered get the failure.
pub(super) async fn push_batch(
    core: Arc<Core>,
    node_id: String,
    mut c: pb::worker_service_client::WorkerServiceClient<tpuray_proto::client::AuthChannel>,
    batch: Vec<Queued>,
    done: tokio::sync::mpsc::UnboundedSender<Pushed>,
) {
    let t = Instant::now();
    if let [q] = batch.as_slice() {
        let push = c.push_task(pb::PushTaskRequest { spec: Some(q.spec.clone()) });
        let r = core.unless_node_dies(&node_id, push).await;
        let q = batch.into_iter().next().expect("one task");
        let _ = done.send((q, r.map(tonic::Response::into_inner), t.elapsed()));
        return;
    }
    let specs = batch.iter().map(|q| q.spec.clone()).collect();
    let mut slots: Vec<Option<Queued>> = batch.into_iter().map(Some).collect();
    let mut answered = 0u32;
    let pushed = core.unless_node_dies(&node_id, c.push_tasks(pb::PushTasksRequest { specs }));
    let failure = match pushed.await {
        Ok(r) => {
            let mut items = r.into_inner();
            loop {
                match core.unless_node_dies(&node_id, items.message()).await {
                    Ok(Some(ready)) => {
                        for item in ready.items {
                            let q = slots.get_mut(item.index as usize).and_then(Option::take);
                            if let Some(q) = q {
                                answered += 1;
                                let reply = item.reply.unwrap_or_default();
                                let _ = done.send((q, Ok(reply), t.elapsed() / answered));
                            }
                        }
                    }
                    Ok(None) => {
                        break tonic::Status::internal(
                            "the worker's answers ended before every pushed task was answered",
                        );
                    }
                    Err(s) => break s,
                }
            }
        }
        Err(s) => s,
    };
    for q in slots.into_iter().flatten() {
        let _ = done.send((q, Err(failure.clone()), t.elapsed()));
    }
}

impl Core {
    /// Pushes a batch of one task on the direct connection (CORE-15) to the leased
    /// worker when one is open, its answer going to `done` as [`push_batch`]'s do; else
    /// (a larger batch, or no connection yet: one is opened for later) hands the batch
    /// back for gRPC.
    fn push_direct(
        self: &Arc<Self>,
        g: &pb::request_worker_lease_reply::Granted,
        mut batch: Vec<Queued>,
        done: &tokio::sync::mpsc::UnboundedSender<Pushed>,
    ) -> Option<Vec<Queued>> {
        if batch.len() != 1 {
            return Some(batch);
        }
        let Some(d) = self.direct_to(&g.worker_address, &g.node_id, |_| {}) else {
            return Some(batch);
        };
        let q = batch.pop().expect("one task");
        let frame = crate::direct::encode_call(&q.spec);
        let slot = Arc::new(Mutex::new(Some(q)));
        let (answer, tx, t) = (Arc::clone(&slot), done.clone(), Instant::now());
        let sent = d.call(
            frame,
            Box::new(move |result| {
                if let Some(q) = answer.lock().unwrap().take() {
                    let _ = tx.send((q, result, t.elapsed()));
                }
            }),
            None,
        );
        match sent {
            crate::direct::Sent::Yes => None,
            crate::direct::Sent::Lost(done, status) => {
                done(Err(status));
                None
            }
            // The connection closed first: unsent, so over gRPC after all.
            crate::direct::Sent::Not(unsent, _) => {
                drop(unsent);
                let q = slot.lock().unwrap().take().expect("an unsent task is still here");
                Some(vec![q])
            }
        }
    }

    pub(super) fn ensure_leases(self: &Arc<Self>, class: &Arc<Class>) {
        self.watch_nodes();
        let queued = class.queue.lock().unwrap().len();
        loop {
            let cur = class.leases.load(Ordering::SeqCst);
            let want = pipeline::leases_wanted(
                queued,
                class.in_flight.load(Ordering::SeqCst),
                class.stalled.load(Ordering::SeqCst),
                fixed_pipeline_depth().unwrap_or(1),
            );
            if queued == 0 || cur >= want {
                return;
            }
            if class
                .leases
                .compare_exchange(cur, cur + 1, Ordering::SeqCst, Ordering::SeqCst)
                .is_ok()
            {
                let core = Arc::clone(self);
                let class = Arc::clone(class);
                self.rt.spawn(async move {
                    core.lease_loop(&class).await;
                    class.leases.fetch_sub(1, Ordering::SeqCst);
                    // Tasks may have arrived while this loop was ending.
                    core.ensure_leases(&class);
                });
            }
        }
    }

    pub(super) async fn lease_loop(self: &Arc<Self>, class: &Arc<Class>) {
        use pb::request_worker_lease_reply::Outcome;
        let mut failures = 0u32;
        // Infeasible answers in a row: the first is asked again after a second before
        // anyone is told, as an agent's view of the cluster can lag a node that joined
        // a moment ago.
        let mut infeasible = 0u32;
        while !class.queue.lock().unwrap().is_empty() {
            let mut target = self.agent_address.clone();
            // The node of `target`, when known ("" never counts as dead, CORE-10).
            let mut target_node = self.node_id.clone();
            let mut grant_or_reject = false;
            if let Some((pg, index)) = &class.pg {
                // Ask the node that holds the bundle (an indexed bundle: only there).
                match self.bundle_agent(pg, *index).await {
                    Ok(Some(address)) => {
                        target = address;
                        target_node = String::new();
                        grant_or_reject = *index >= 0;
                    }
                    Ok(None) => continue, // not created yet: asked again after a wait
                    Err(reason) => {
                        let drained: Vec<Queued> = class.queue.lock().unwrap().drain(..).collect();
                        for q in drained {
                            self.finish_failed(
                                &q.spec,
                                err(Kind::Infeasible, reason.clone(), &q.spec.name),
                            );
                        }
                        return;
                    }
                }
            }
            let outcome = loop {
                let req = pb::RequestWorkerLeaseRequest {
                    request_id: tpuray_proto::new_request_id(),
                    job_id: self.job_id.clone(),
                    language: crate::foreign::language().into(),
                    runtime_env_hash: class.runtime_env_hash.clone(),
                    resources: class.resources.clone(),
                    label_selector: class.labels.clone(),
                    strategy: Some(class.strategy.clone()),
                    grant_or_reject,
                    queue_timeout_ms: 2000,
                    owner_address: self.address.clone(),
                };
                class.asking.fetch_add(1, Ordering::SeqCst);
                let reply = match self.agent_client(&target) {
                    Ok(mut c) => self
                        .unless_node_dies(&target_node, c.request_worker_lease(req))
                        .await
                        .map(|r| r.into_inner().outcome),
                    Err(e) => Err(tonic::Status::internal(e.to_string())),
                };
                class.asking.fetch_sub(1, Ordering::SeqCst);
                match reply {
                    Ok(Some(Outcome::Spillback(s))) if !grant_or_reject => {
                        target = s.address;
                        target_node = s.node_id;
                        grant_or_reject = true;
                    }
                    other => break other,
                }
            };
            match outcome {
                Ok(Some(Outcome::Granted(g))) => {
                    failures = 0;
                    infeasible = 0;
                    let broken = self.run_on_worker(class, &g, &target).await;
                    // A dead node's agent is not asked (it may be silent, CORE-10).
                    if !self.deaths.is_dead(&g.node_id)
                        && let Ok(mut c) = self.agent_client(&target)
                    {
                        let returned = c.return_worker_lease(pb::ReturnWorkerLeaseRequest {
                            request_id: tpuray_proto::new_request_id(),
                            lease_id: g.lease_id,
                            disconnect_worker: broken,
                        });
                        let _ = self.unless_node_dies(&g.node_id, returned).await;
                    }
                }
                Ok(Some(Outcome::Infeasible(_))) if infeasible == 0 => {
                    infeasible = 1;
                    tokio::time::sleep(Duration::from_secs(1)).await;
                }
                Ok(Some(Outcome::Infeasible(i))) => {
                    if !class.warned.swap(true, Ordering::SeqCst) {
                        // A cluster with an autoscaler (its report in the head's KV,
                        // tpuray_cli::autoscaler::{KV_NAMESPACE, STATUS_KEY}) may launch a
                        // node for it: say so, and do not suggest failing such work.
                        let autoscaled = match self.head_client() {
                            Ok(mut h) => h
                                .kv_get(pb::KvGetRequest {
                                    namespace: "autoscaler".into(),
                                    key: b"status".to_vec(),
                                })
                                .await
                                .is_ok_and(|r| r.into_inner().found),
                            Err(_) => false,
                        };
                        let then = if autoscaled {
                            "the cluster's autoscaler launches a node for it if a node type \
                             can hold it (tpuray status, section Autoscaler)"
                        } else if self.fail_on_infeasible {
                            "it stays pending until a node that fits joins"
                        } else {
                            "it stays pending until a node that fits joins (set \
                             TPURAY_FAIL_ON_INFEASIBLE=1 to fail instead)"
                        };
                        eprintln!(
                            "tpuray: warning: a task needing {:?} is infeasible: {}; {then}",
                            class.resources, i.reason,
                        );
                    }
                    if self.fail_on_infeasible {
                        let drained: Vec<Queued> = class.queue.lock().unwrap().drain(..).collect();
                        for q in drained {
                            self.finish_failed(
                                &q.spec,
                                err(Kind::Infeasible, i.reason.clone(), &q.spec.name),
                            );
                        }
                        return;
                    }
                    tokio::time::sleep(Duration::from_secs(1)).await;
                }
                Ok(Some(Outcome::SetupFailed(f))) => {
                    // AGENT-14: the environment could not be built on that node; what
                    // waits for it fails with the installer's message (Ray fails them
                    // with RuntimeEnvSetupError), and later submissions try again.
                    let drained: Vec<Queued> = class.queue.lock().unwrap().drain(..).collect();
                    for q in drained {
                        self.finish_failed(
                            &q.spec,
                            err(Kind::RuntimeEnvSetupFailed, f.message.clone(), &q.spec.name),
                        );
                    }
                    return;
                }
                Ok(Some(Outcome::Busy(_))) | Ok(Some(Outcome::Spillback(_))) | Ok(None) => {}
                Err(s) => {
                    failures += 1;
                    if failures % 50 == 1 {
                        eprintln!(
                            "tpuray: warning: cannot lease a worker from {target}: {}",
                            s.message()
                        );
                    }
                    tokio::time::sleep(Duration::from_millis(200)).await;
                }
            }
        }
    }

    /// The agent address of the node holding bundle `index` of group `pg` (-1: the local
    /// node when it holds one, else the first placed bundle's). `Ok(None)` after waiting up
    /// to a second for a group not created yet; `Err` when the group was removed or is
    /// unknown.
    pub(super) async fn bundle_agent(
        &self,
        pg: &str,
        index: i32,
    ) -> Result<Option<String>, String> {
        crate::placement_group::created(pg).await?;
        let mut head = self.head_client().map_err(|e| e.to_string())?;
        let reply = head
            .get_placement_group(pb::GetPlacementGroupRequest {
                placement_group_id: pg.to_string(),
                wait_ready_ms: 1000,
                ..Default::default()
            })
            .await;
        let info = match reply {
            Ok(r) => r.into_inner().placement_group.unwrap_or_default(),
            Err(s) if s.code() == tonic::Code::NotFound => return Err(s.message().to_string()),
            Err(_) => {
                tokio::time::sleep(Duration::from_millis(200)).await;
                return Ok(None);
            }
        };
        if info.state == pb::PlacementGroupState::Removed as i32 {
            return Err(format!("placement group {pg} was removed ({})", info.removal_reason));
        }
        if index >= info.bundle_node_addresses.len() as i32 {
            return Err(format!(
                "bundle index {index} is out of range for placement group {pg} (it has {} bundles)",
                info.bundle_node_addresses.len()
            ));
        }
        let placed = |i: usize| Some(&info.bundle_node_addresses[i]).filter(|a| !a.is_empty());
        Ok(match usize::try_from(index) {
            Ok(i) => placed(i).cloned(),
            Err(_) => info
                .bundle_node_ids
                .iter()
                .position(|n| *n == self.node_id)
                .and_then(placed)
                .or_else(|| (0..info.bundle_node_addresses.len()).find_map(placed))
                .cloned(),
        })
    }

    /// Pushes queued tasks to one leased worker, pipelined, until the queue
    /// is empty. Returns true when the worker broke.
    pub(super) async fn run_on_worker(
        self: &Arc<Self>,
        class: &Arc<Class>,
        g: &pb::request_worker_lease_reply::Granted,
        agent_address: &str,
    ) -> bool {
        let Ok(client) = self.worker_client(&g.worker_address) else {
            return true;
        };
        // Each pushed task's answer (from a push of one task, or of a batch), as it comes.
        let (done_tx, mut done_rx) = tokio::sync::mpsc::unbounded_channel::<Pushed>();
        let mut tasks_in_flight = 0usize;
        let mut broken = false;
        // A task came back unrun: its worker is blocked or slow, so nothing more goes to
        // it until what it holds is answered (else the same tasks would bounce back).
        let mut handing_back = false;
        loop {
            if tasks_in_flight == 0 && handing_back {
                handing_back = false;
                class.stalled.fetch_sub(1, Ordering::SeqCst);
            }
            let depth = if handing_back { 1 } else { class.depth() };
            // A deep pipeline is topped up once a quarter of it is free, so answers that
            // come one by one still go out as batches, not a push per answer.
            let top_up = pipeline::top_up(depth, tasks_in_flight);
            while !broken && tasks_in_flight + top_up <= depth {
                let batch: Vec<Queued> = {
                    let mut queue = class.queue.lock().unwrap();
                    let most = (depth - tasks_in_flight).min(PUSH_BATCH_MAX).min(queue.len());
                    let mut bytes = 0;
                    let n = queue
                        .iter()
                        .take(most)
                        .take_while(|q| {
                            let first = bytes == 0;
                            bytes += prost::Message::encoded_len(&q.spec);
                            first || bytes <= PUSH_BATCH_BYTES
                        })
                        .count();
                    queue.drain(..n).collect()
                };
                if batch.is_empty() {
                    break;
                }
                {
                    let mut running = self.running.lock().unwrap();
                    for q in &batch {
                        running.insert(
                            q.spec.task_id.clone(),
                            Running {
                                worker_address: g.worker_address.clone(),
                                cancelled: false,
                                actor: false,
                            },
                        );
                    }
                }
                tasks_in_flight += batch.len();
                class.in_flight.fetch_add(batch.len(), Ordering::SeqCst);
                // CORE-15: one task at a time goes on the direct connection once open.
                let batch = match self.push_direct(g, batch, &done_tx) {
                    Some(batch) => batch,
                    None => continue,
                };
                self.rt.spawn(push_batch(
                    Arc::clone(self),
                    g.node_id.clone(),
                    client.clone(),
                    batch,
                    done_tx.clone(),
                ));
            }
            if tasks_in_flight == 0 {
                if broken {
                    break;
                }
                // Keep the lease a moment for the next task of this class
                // (a driver calling in a loop), as Ray's leases linger.
                let queued = class.queued.notified();
                if !class.queue.lock().unwrap().is_empty() {
                    continue;
                }
                if tokio::time::timeout(LEASE_LINGER, queued).await.is_err() {
                    break;
                }
                continue;
            }
            let Some(first) = done_rx.recv().await else { break };
            // Every answer already here is handled before the next push.
            let mut next = Some(first);
            while let Some((q, result, took)) = next.take() {
                next = done_rx.try_recv().ok();
                tasks_in_flight -= 1;
                class.in_flight.fetch_sub(1, Ordering::SeqCst);
                match result {
                    Ok(reply) if reply.not_run => {
                        if !handing_back {
                            handing_back = true;
                            class.stalled.fetch_add(1, Ordering::SeqCst);
                        }
                        self.task_ended(class, q, Ended::HandedBack);
                    }
                    Ok(reply) => {
                        class.note_push(took);
                        // The worker exits after this (its task's max_calls ran out):
                        // nothing more goes to it, and its lease goes back.
                        broken |= reply.worker_exiting;
                        self.task_ended(class, q, Ended::Replied(reply));
                    }
                    Err(status) => {
                        broken = true;
                        let detail = format!(
                            "worker {} at {}: {}",
                            g.worker_id,
                            g.worker_address,
                            status.message()
                        );
                        let lost = Ended::Lost {
                            detail,
                            node_id: g.node_id.clone(),
                            agent_address: agent_address.to_string(),
                        };
                        self.task_ended(class, q, lost);
                    }
                }
            }
        }
        if handing_back {
            class.stalled.fetch_sub(1, Ordering::SeqCst);
        }
        broken
    }
}
