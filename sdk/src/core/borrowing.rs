//! The borrowing protocol (CORE-2): this process's holds on objects other processes
//! own, the ordered queues of borrower changes sent to each owner, and the owner's side
//! that applies them.

use super::outbox::{self, Outbox};
use super::*;

/// An open borrow batch: its depth, and per owner queue the last registration queued in it.
pub(super) type BorrowBatch = (usize, Vec<(Arc<BorrowQueue>, u64)>);

/// Waits until the owners confirmed every borrow this thread started.
pub(crate) fn confirm_borrows(core: &Core) {
    let pending: Vec<_> = PENDING_BORROWS.with(|p| std::mem::take(&mut *p.borrow_mut()));
    for h in pending {
        let _ = core.rt.block_on(h);
    }
}

/// Opens a borrow batch on this thread: until the matching [`end_borrow_batch`], the
/// borrower registrations of refs made here (a value being deserialized) are queued
/// without waiting, and go to each owner together (CORE-2). Batches nest.
pub(crate) fn begin_borrow_batch() {
    BORROW_BATCH.with(|b| b.borrow_mut().0 += 1);
}

/// Closes the batch [`begin_borrow_batch`] opened; the outermost one waits until every
/// owner confirmed the registrations queued inside it (on an executor thread, inside the
/// runtime, the wait is left to [`confirm_borrows`] as for single registrations).
pub(crate) fn end_borrow_batch() {
    let waits = BORROW_BATCH.with(|b| {
        let mut b = b.borrow_mut();
        b.0 = b.0.saturating_sub(1);
        if b.0 == 0 { std::mem::take(&mut b.1) } else { Vec::new() }
    });
    if waits.is_empty() {
        return;
    }
    let Some(c) = try_core() else { return };
    let all = async move {
        for (q, seq) in waits {
            q.confirmed(seq).await;
        }
    };
    wait_registered(c, all);
}

/// Waits for a borrower registration: on an executor thread (inside the runtime) it is
/// recorded for [`confirm_borrows`]; elsewhere this thread blocks until it is confirmed.
pub(super) fn wait_registered(
    c: &Core,
    fut: impl std::future::Future<Output = ()> + Send + 'static,
) {
    if tokio::runtime::Handle::try_current().is_ok() {
        let h = c.rt.spawn(fut);
        PENDING_BORROWS.with(|p| p.borrow_mut().push(h));
    } else {
        c.rt.block_on(fut);
    }
}

/// This process's hold on an object another process owns (CORE-2).
#[derive(Default)]
pub(super) struct Borrow {
    /// Counted refs alive here.
    pub(super) refs: usize,
    /// Whether the owner counts this process as a borrower (registered, not yet
    /// released).
    pub(super) registered: bool,
    /// Objects this process owns whose value nests this one and which hold it on this
    /// process's behalf (the executor registered `<this process>#ret:<object>` with its
    /// owner before replying): while one lives, refs here need no registration of their
    /// own; the last one to go registers this process first if refs remain.
    pub(super) covers: usize,
}

/// A queued borrower registration to wait for ([`Core::queue_borrower`]).
pub(crate) struct BorrowWait((Arc<BorrowQueue>, u64));

/// Returns once every registration in `waits` was answered (or failed).
pub(crate) async fn all_confirmed(waits: Vec<BorrowWait>) {
    // Changes to one owner are answered in order: its last one covers the rest.
    let mut last: Vec<(Arc<BorrowQueue>, u64)> = Vec::new();
    for BorrowWait((q, seq)) in waits {
        match last.iter_mut().find(|(x, _)| Arc::ptr_eq(x, &q)) {
            Some(w) => w.1 = w.1.max(seq),
            None => last.push((q, seq)),
        }
    }
    for (q, seq) in last {
        q.confirmed(seq).await;
    }
}

/// Borrower changes this process sends one owner (CORE-2): the [`Outbox`] machine
/// (order, one batch on the wire, resend or give up) under a lock, and a watch of how
/// far the owner has answered for the threads waiting on a registration.
pub(super) struct BorrowQueue {
    pub(super) outbox: Mutex<Outbox<pb::BorrowerUpdate>>,
    /// The sequence number of the last change the owner answered (or given up).
    pub(super) done: tokio::sync::watch::Sender<u64>,
}

/// Changes in one `UpdateBorrowers` call at most (about 3 MiB).
pub(super) const MAX_BORROWER_UPDATES_PER_CALL: usize = 50_000;

/// How long one `UpdateBorrowers` call may take before it counts as unanswered.
const UPDATE_BORROWERS_TIMEOUT: Duration = Duration::from_secs(10);

/// Whether a call failed because the peer refused the connection: nothing listens at
/// its address, so its process is gone (a connect that timed out says nothing).
fn is_refused_connect(e: &tonic::Status) -> bool {
    e.code() == tonic::Code::Unavailable
        && e.message().starts_with("tcp connect error")
        && e.message().contains("refused")
}

/// How often an owner checks that the processes borrowing its objects still run (CORE-2).
const BORROWER_CHECK_INTERVAL: Duration = Duration::from_secs(5);

/// How long that check's call may take; a process that does not answer in time counts
/// as alive (only a refused connection counts as gone).
const BORROWER_CHECK_TIMEOUT: Duration = Duration::from_secs(5);

/// How an `UpdateBorrowers` call that got no answer ended, for [`Outbox::failed`]: a
/// refused connection (the owner's process is gone) or the owner's own error status is
/// [`outbox::Failure::Refused`]; a timeout, a connect that timed out or a connection
/// lost under the call (NET-2's `UNKNOWN` "transport error") left the batch's fate
/// unknown, [`outbox::Failure::NoAnswer`].
fn failure_of(e: &tonic::Status) -> outbox::Failure {
    use tonic::Code;
    match e.code() {
        _ if is_refused_connect(e) => outbox::Failure::Refused,
        Code::Unavailable | Code::Unknown | Code::DeadlineExceeded | Code::Cancelled => {
            outbox::Failure::NoAnswer
        }
        _ => outbox::Failure::Refused,
    }
}

impl BorrowQueue {
    /// Sends the outbox's batches until it is empty, each again after a call without an
    /// answer, as [`Outbox::failed`] decides.
    pub(super) async fn send_all(
        &self,
        client: Result<pb::worker_service_client::WorkerServiceClient<AuthChannel>, Error>,
        owner: String,
        me: String,
    ) {
        loop {
            let Some(updates) = self.outbox.lock().unwrap().next(MAX_BORROWER_UPDATES_PER_CALL)
            else {
                return;
            };
            let failure = match &client {
                Ok(c) => {
                    let mut c = c.clone();
                    let mut req = Request::new(pb::UpdateBorrowersRequest {
                        borrower_address: me.clone(),
                        updates,
                    });
                    req.set_timeout(UPDATE_BORROWERS_TIMEOUT);
                    match c.update_borrowers(req).await {
                        Ok(_) => None,
                        Err(e) => Some((failure_of(&e), e.message().to_string())),
                    }
                }
                Err(e) => Some((outbox::Failure::Refused, e.to_string())),
            };
            let Some((how, why)) = failure else {
                let done = self.outbox.lock().unwrap().answered();
                self.done.send_replace(done);
                continue;
            };
            let after = self.outbox.lock().unwrap().failed(how);
            match after {
                outbox::AfterFailure::Resend(pause) => {
                    tracing::debug!(%owner, %why, ?pause, "UpdateBorrowers unanswered; resending");
                    tokio::time::sleep(pause).await;
                }
                outbox::AfterFailure::GaveUp(done) => {
                    tracing::warn!(%owner, %why, "borrower changes for this owner given up");
                    self.done.send_replace(done);
                }
            }
        }
    }

    /// Returns once the change numbered `seq` was answered (or given up).
    pub(super) async fn confirmed(&self, seq: u64) {
        let mut rx = self.done.subscribe();
        let _ = rx.wait_for(|d| *d >= seq).await;
    }
}

impl Core {
    /// Queues a borrower change for `owner` (`borrower` empty: this process) and starts
    /// its sender when idle; returns the queue and the change's sequence number, for
    /// [`BorrowQueue::confirmed`].
    pub(super) fn queue_borrow_update(
        &self,
        owner: &str,
        id: String,
        borrower: String,
        add: bool,
    ) -> (Arc<BorrowQueue>, u64) {
        let q = {
            let mut qs = self.borrow_queues.lock().unwrap();
            match qs.get(owner) {
                Some(q) => Arc::clone(q),
                None => {
                    let q = Arc::new(BorrowQueue {
                        outbox: Mutex::new(Outbox::default()),
                        done: tokio::sync::watch::Sender::new(0),
                    });
                    qs.insert(owner.to_string(), Arc::clone(&q));
                    q
                }
            }
        };
        let (seq, start) =
            q.outbox.lock().unwrap().push(pb::BorrowerUpdate { object_id: id, borrower, add });
        if start {
            let client = self.worker_client(owner);
            let (owner, me) = (owner.to_string(), self.address.clone());
            let sender = Arc::clone(&q);
            self.rt.spawn(async move { sender.send_all(client, owner, me).await });
        }
        (q, seq)
    }

    /// Queues registering `borrower` (a borrower key) of `id` with `owner`; the result is
    /// for [`all_confirmed`].
    pub(crate) fn queue_borrower(&self, owner: &str, id: &str, borrower: &str) -> BorrowWait {
        BorrowWait(self.queue_borrow_update(owner, id.to_string(), borrower.to_string(), true))
    }

    /// CORE-2: starts (once per process) the owner's check of its borrowing processes:
    /// every [`BORROWER_CHECK_INTERVAL`] each process that borrows an object here is
    /// asked `GetWorkerInfo`, and one whose connection is refused (its process is gone:
    /// killed, crashed, its node's agent stopped it) loses every registration it held,
    /// as if it had released them, so what only it held is freed. A process that does
    /// not answer (a partitioned or frozen node) keeps its registrations. Ray's owner
    /// learns the same from its `WaitForRefRemoved` long poll failing
    /// (`reference_count.cc`).
    pub(crate) fn watch_borrowers(self: &Arc<Self>) {
        if !first_time(&self.watching_borrowers) {
            return;
        }
        let core = Arc::clone(self);
        self.rt.spawn(async move {
            loop {
                tokio::time::sleep(BORROWER_CHECK_INTERVAL).await;
                let processes = core.objects.lock().unwrap().borrowing_processes();
                let mut checks = tokio::task::JoinSet::new();
                for p in processes.into_iter().filter(|p| *p != core.address) {
                    let client = core.worker_client(&p);
                    checks.spawn(async move {
                        let gone = match client {
                            Ok(mut c) => {
                                let mut req = Request::new(pb::GetWorkerInfoRequest {});
                                req.set_timeout(BORROWER_CHECK_TIMEOUT);
                                c.get_worker_info(req)
                                    .await
                                    .err()
                                    .is_some_and(|e| is_refused_connect(&e))
                            }
                            Err(_) => false,
                        };
                        (p, gone)
                    });
                }
                while let Some(Ok((p, gone))) = checks.join_next().await {
                    if !gone {
                        continue;
                    }
                    let freed = core.objects.lock().unwrap().drop_process(&p);
                    tracing::info!(
                        borrower = %p,
                        freed = freed.len(),
                        "a process borrowing objects here is gone; its borrows are dropped"
                    );
                    for (id, o) in freed {
                        core.on_freed(&id, o);
                    }
                }
            }
        });
    }

    /// Owner side of `UpdateBorrower`; false when the object is gone.
    pub(crate) fn serve_update_borrower(&self, id: &str, borrower: &str, add: bool) -> bool {
        let (known, freed) = self.objects.lock().unwrap().update_borrower(id, borrower, add);
        if let Some(o) = freed {
            self.on_freed(id, o);
        }
        known
    }

    /// Owner side of `UpdateBorrowers`: the changes in order (`default` is the borrower
    /// of changes that name none).
    pub(crate) fn serve_update_borrowers(&self, default: &str, updates: &[pb::BorrowerUpdate]) {
        let mut freed = Vec::new();
        {
            let mut objs = self.objects.lock().unwrap();
            for u in updates {
                let borrower = if u.borrower.is_empty() { default } else { &u.borrower };
                if let (_, Some(o)) = objs.update_borrower(&u.object_id, borrower, u.add) {
                    freed.push((u.object_id.as_str(), o));
                }
            }
        }
        for (id, o) in freed {
            self.on_freed(id, o);
        }
    }

    /// One object that covered borrowed `nid` no longer does: when it was the last and
    /// refs here still use `nid`, this process registers as its borrower (queued before
    /// anything the caller queues next for `owner`).
    pub(super) fn uncover(&self, nid: &str, owner: &str) {
        let mut b = self.borrowed.lock().unwrap();
        let Some(e) = b.get_mut(nid) else { return };
        e.covers = e.covers.saturating_sub(1);
        if e.covers > 0 {
            return;
        }
        if e.refs == 0 {
            b.remove(nid);
        } else if !e.registered {
            e.registered = true;
            self.queue_borrow_update(owner, nid.to_string(), String::new(), true);
        }
    }

    /// Records that an owned object's value nests `nested` and holds them for this
    /// process (Borrow::covers).
    pub(super) fn cover_nested(&self, nested: &[(String, String)]) {
        let mut b = self.borrowed.lock().unwrap();
        for (nid, owner) in nested {
            if *owner != self.address {
                b.entry(nid.clone()).or_default().covers += 1;
            }
        }
    }
}
