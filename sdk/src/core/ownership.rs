//! The owner's table of the objects this process owns (CORE-2, CORE-6): their state,
//! references (local and one per borrowing process), the lineage that can make a lost
//! copy again, and what freeing one does (its store copies deleted, the refs nested in
//! its value released).
//!
//! In full (moved here from ARCHITECTURE.md):
//! - CORE-2: an owned object lives while a ref exists in this process, an in-flight
//!   task pins it (top-level arguments and refs nested inside argument values), or
//!   another process borrows it; then it and its store copies are freed. A process that
//!   deserializes a ref it does not own registers as a borrower with the owner and
//!   deregisters when its last copy drops; an executor waits for those registrations
//!   before it replies. Borrower changes for one owner travel in that owner's queue
//!   (`UpdateBorrowers` batches, one on the wire at a time, applied in order; a batch
//!   whose call went unanswered is sent again, `outbox.rs`), so a release never
//!   overtakes the registration before it and none is lost to a timeout; the refs of one deserialized
//!   value (`codec::decode`, Python's `deserialize`) are queued together and waited for
//!   once. Refs nested in a task's return value are handed over: before replying, the
//!   executor registers the caller with each owner as borrower `<caller>#ret:<return
//!   id>`, which the caller releases when it frees the return object. While such a
//!   return object lives, refs read out of it need no registration of their own (it
//!   *covers* them, as Ray's contained-in borrows); when the last covering object goes
//!   and refs remain, the process registers itself first, in the same queue, and only
//!   then releases `#ret`. A borrowing process that dies without deregistering is found
//!   by the owner's check (`Core::watch_borrowers`, every 5 s once anything is
//!   borrowed: its connection refused) and loses every registration it held. Not yet:
//!   generator items carrying refs, and borrowers on a node that stops answering
//!   without refusing (a partition, a frozen host): theirs are kept, and leak if the
//!   process never comes back.

use super::*;

/// How an `ObjectLost` error whose owner process is gone begins (Python raises
/// `OwnerDiedError` for it).
pub const OWNER_DIED: &str = "owner died";

/// How the `ObjectLost` error of an object freed with [`Core::free`] begins (Python
/// raises `ObjectFreedError` for it).
pub const OBJECT_FREED: &str = "freed explicitly";

/// Bytes of an object: inline in memory or mapped from a node store.
#[derive(Clone)]
pub enum Data {
    Inline(Arc<Vec<u8>>),
    Mapped(Arc<ObjectView>),
}

impl std::ops::Deref for Data {
    type Target = [u8];
    fn deref(&self) -> &[u8] {
        match self {
            Data::Inline(v) => v,
            Data::Mapped(m) => m,
        }
    }
}

#[derive(Clone)]
pub(super) enum ObjState {
    Pending,
    Inline(Arc<Vec<u8>>),
    Stored {
        locations: Vec<pb::ObjectLocation>,
        size: u64,
    },
    /// Boxed: the error is rare and large, and every pending return (one per queued
    /// task) is as big as the largest variant.
    Failed(Box<pb::TaskError>),
}

impl ObjState {
    pub(super) fn failed(e: pb::TaskError) -> Self {
        ObjState::Failed(Box::new(e))
    }

    /// The state a task's reply gives a return object.
    pub(super) fn from_return(r: pb::ReturnObject) -> Self {
        match r.data {
            Some(pb::return_object::Data::InlineValue(v)) => ObjState::Inline(Arc::new(v)),
            Some(pb::return_object::Data::Location(l)) => {
                ObjState::Stored { locations: vec![l], size: r.size }
            }
            None => ObjState::Inline(Arc::new(vec![])),
        }
    }
}

/// What the owner keeps to make a task's stored returns again (CORE-6).
pub(super) struct Lineage {
    /// The spec as it last ran (arguments resolved).
    pub(super) spec: pb::TaskSpec,
    pub(super) class: Arc<Class>,
    /// Retries left after that run (negative: unlimited).
    pub(super) retries_left: i32,
    pub(super) retry_exceptions: bool,
    /// Argument refs, kept alive (and so reconstructible) with the returns.
    pub(super) pins: Vec<RawRef>,
}

/// An owned object that is ready.
pub(super) enum Ready {
    Inline(Arc<Vec<u8>>),
    Stored(Vec<pb::ObjectLocation>),
}

/// What waiting for an owned object found.
pub(super) enum Got {
    /// Ready, with its size in bytes.
    Ready(Ready, u64),
    Failed(pb::TaskError),
    /// Not in the table (freed, or never owned here).
    Unknown,
    TimedOut,
}

pub(super) struct Owned {
    pub(super) state: ObjState,
    /// The task that made it, when it can run again (CORE-6).
    pub(super) lineage: Option<Arc<Lineage>>,
    /// Refs nested in this object's value that this process was registered
    /// to borrow on its behalf (id, owner); released when it is freed.
    pub(super) nested: Vec<(String, String)>,
    /// Refs nested in a `put` value, held while the object lives.
    pub(super) pins: Vec<RawRef>,
    /// The task that makes it, for cancellation.
    pub(super) task_id: Option<String>,
    /// The pulls of a stored object (OBJ-8); `None` until the first is assigned (boxed:
    /// most objects are never pulled, and every queued task's return is an entry).
    pub(super) pulls: Option<Box<transfer::Pulls>>,
}

impl refs::Settled for Owned {
    fn settled(&self) -> bool {
        !matches!(self.state, ObjState::Pending)
    }
}

/// Called when a counted [`RawRef`] is made in this process: the owner
/// counts it; a borrower tells the owner when it starts holding the object,
/// unless an object this process owns already holds it on this process's behalf
/// (a return value it was nested in, [`Borrow::covers`]).
pub(crate) fn add_ref(id: &str, owner: &str) {
    let Some(c) = try_core() else { return };
    if c.address == owner {
        c.objects.lock().unwrap().add_local(id);
        return;
    }
    let queued = {
        let mut b = c.borrowed.lock().unwrap();
        let e = b.entry(id.to_string()).or_default();
        e.refs += 1;
        if e.refs == 1 && e.covers == 0 && !e.registered {
            e.registered = true;
            // Queued under the lock: this process's changes of one id reach the owner
            // in the order they happened here.
            Some(c.queue_borrow_update(owner, id.to_string(), String::new(), true))
        } else {
            None
        }
    };
    if let Some((q, seq)) = queued {
        let batched = BORROW_BATCH.with(|b| {
            let mut b = b.borrow_mut();
            if b.0 == 0 {
                return false;
            }
            match b.1.iter_mut().find(|(x, _)| Arc::ptr_eq(x, &q)) {
                Some(w) => w.1 = seq,
                None => b.1.push((q.clone(), seq)),
            }
            true
        });
        if !batched {
            wait_registered(c, async move { q.confirmed(seq).await });
        }
    }
}

/// Called when the last clone of a counted [`RawRef`] drops in this process.
pub(crate) fn release_ref(id: &str, owner: &str) {
    let Some(c) = try_core() else { return };
    if c.address != owner {
        let mut b = c.borrowed.lock().unwrap();
        if let Some(e) = b.get_mut(id) {
            e.refs = e.refs.saturating_sub(1);
            if e.refs == 0 {
                if e.registered {
                    e.registered = false;
                    // Queued behind this process's registration of it (same owner, in order).
                    c.queue_borrow_update(owner, id.to_string(), String::new(), false);
                }
                if e.covers == 0 {
                    b.remove(id);
                }
            }
        }
        return;
    }
    let freed = c.objects.lock().unwrap().release_local(id);
    if let Some(o) = freed {
        c.on_freed(id, o);
    }
}

impl Core {
    /// Registers an owned object holding one reference, which the caller
    /// hands to a [`RawRef::adopt`] (so a result that arrives before the
    /// caller has its ref cannot free the object).
    pub(super) fn register_owned(&self, id: &str, state: ObjState, task_id: Option<String>) {
        self.objects.lock().unwrap().register(
            id.to_string(),
            Owned { state, lineage: None, pulls: None, task_id, nested: vec![], pins: vec![] },
        );
    }

    pub(super) fn set_state(&self, id: &str, state: ObjState) {
        self.set_state_with(id, state, None);
    }

    /// Sets an owned object's state and the lineage that can make it again.
    pub(super) fn set_state_with(&self, id: &str, state: ObjState, lineage: Option<Arc<Lineage>>) {
        // Nobody holds a ref any more: freed at once (CORE-2).
        let freed = self.objects.lock().unwrap().settle(id, |o| {
            o.state = state;
            o.lineage = lineage;
        });
        if let Some(o) = freed {
            self.on_freed(id, o);
        }
        self.objects_changed.notify_waiters();
    }

    /// Frees owned objects `ids` now, whatever refs remain (Ray's
    /// `ray._private.internal_api.free`): their store copies are deleted on every
    /// node and a later `get` fails with an `ObjectLost` error beginning
    /// [`OBJECT_FREED`]. The table entries stay until their last ref goes, as usual.
    ///
    /// # Errors
    /// An id this process does not own (its owner frees it), naming it.
    pub(crate) fn free(&self, ids: &[(String, String)]) -> Result<(), Error> {
        if let Some((id, owner)) = ids.iter().find(|(_, owner)| *owner != self.address) {
            return Err(Error::Cluster(format!(
                "free: object {id} is owned by the process at {owner}, not this one (only \
                 an object's owner can free it)"
            )));
        }
        let mut copies = Vec::new();
        {
            let mut objs = self.objects.lock().unwrap();
            for (id, _) in ids {
                let Some(o) = objs.get_mut(id) else { continue };
                let failed = ObjState::failed(pb::TaskError {
                    kind: Kind::ObjectLost as i32,
                    message: format!("{OBJECT_FREED} (free() was called on it)"),
                    function_name: id.clone(),
                    ..Default::default()
                });
                if let ObjState::Stored { locations, .. } = std::mem::replace(&mut o.state, failed)
                {
                    copies.push((id.clone(), locations));
                }
                o.lineage = None;
            }
        }
        for (id, locations) in copies {
            self.free_copies(id, locations);
        }
        self.objects_changed.notify_waiters();
        Ok(())
    }

    /// An owned object was dropped from the table: delete its store copies
    /// and stop borrowing the refs its value carried (CORE-2).
    pub(super) fn on_freed(&self, id: &str, o: Owned) {
        if let ObjState::Stored { locations, .. } = o.state {
            self.free_copies(id.to_string(), locations);
        }
        // CORE-2: a registration this process queued for one of these refs (say, of a
        // ref just read out of this very value) reaches the ref's owner before this
        // release does: both travel in that owner's queue, in order.
        // The last object nesting a ref that refs here still use registers this process
        // as its borrower first, in the same queue (Borrow::covers).
        let key = format!("{}#ret:{id}", self.address);
        for (nid, owner) in o.nested {
            if owner == self.address {
                self.serve_update_borrower(&nid, &key, false);
                continue;
            }
            self.uncover(&nid, &owner);
            self.queue_borrow_update(&owner, nid, key.clone(), false);
        }
    }

    pub(super) fn free_copies(&self, id: String, mut locations: Vec<pb::ObjectLocation>) {
        // This node's copy goes at once, on the caller's thread: a few system calls,
        // and the next put (`ray.put` in a loop) then reuses its pages (OBJ-9) instead
        // of racing a background free. Other nodes' copies go through their agents.
        let before = locations.len();
        locations.retain(|loc| loc.agent_address != self.store_address);
        if locations.len() < before {
            self.store.delete(&id);
        }
        if locations.is_empty() {
            return;
        }
        let token = self.token.clone();
        self.rt.spawn(async move {
            for loc in locations {
                if let Ok(mut c) =
                    tpuray_proto::client::objects(&loc.agent_address, token.as_deref())
                {
                    let _ = c
                        .free_objects(pb::FreeObjectsRequest { object_ids: vec![id.clone()] })
                        .await;
                }
            }
        });
    }

    /// A new owned object that stays pending until [`Core::fulfil`] settles it: the
    /// results of work this process supervises (a slice gang's members, which may run
    /// several times before they succeed).
    pub(crate) fn promise(&self) -> RawRef {
        let id = tpuray_proto::ids::ObjectId::random().to_string();
        self.register_owned(&id, ObjState::Pending, None);
        RawRef::adopt(id, self.address.clone())
    }

    /// Settles promise `id` with a value (bytes, stored inline or in this node's store) or
    /// with the error of an owned object that failed (copied as it is, so its language's
    /// exception survives).
    pub(crate) fn fulfil(&self, id: &str, outcome: Result<Vec<u8>, String>) {
        let state = match outcome {
            Ok(bytes) => self
                .make_state(id, bytes)
                .unwrap_or_else(|e| ObjState::failed(err(Kind::ObjectLost, e.to_string(), ""))),
            Err(failed) => self
                .objects
                .lock()
                .unwrap()
                .get(&failed)
                .and_then(|o| match &o.state {
                    ObjState::Failed(e) => Some(ObjState::Failed(e.clone())),
                    _ => None,
                })
                .unwrap_or_else(|| {
                    ObjState::failed(err(Kind::WorkerDied, format!("{failed} failed"), ""))
                }),
        };
        self.set_state(id, state);
    }

    /// Settles promise `id` with an error of this process's own: a gang whose slices could
    /// not be reserved again (reported as infeasible).
    pub(crate) fn fulfil_message(&self, id: &str, message: &str, function: &str) {
        self.set_state(id, ObjState::failed(err(Kind::Infeasible, message, function)));
    }

    /// An owned object that failed before any task ran (bad options).
    /// A new owned object failed with `e` (a call refused at submission).
    pub(crate) fn put_failed_with(&self, function: &str, e: Error) -> RawRef {
        let kind = match &e {
            Error::PendingCallsLimitExceeded { .. } => Kind::PendingCallsLimitExceeded,
            Error::Cancelled { .. } => Kind::Cancelled,
            _ => Kind::BadArguments,
        };
        let id = tpuray_proto::ids::ObjectId::random().to_string();
        let message = match e {
            Error::PendingCallsLimitExceeded { message, .. } => message,
            other => other.to_string(),
        };
        self.register_owned(&id, ObjState::failed(err(kind, message, function)), None);
        RawRef::adopt(id, self.address.clone())
    }

    pub(crate) fn put_failed(&self, function: &str, message: &str) -> RawRef {
        let id = tpuray_proto::ids::ObjectId::random().to_string();
        self.register_owned(
            &id,
            ObjState::failed(err(Kind::BadArguments, message, function)),
            None,
        );
        RawRef::adopt(id, self.address.clone())
    }
}
