//! tpuray's Rust SDK and core worker, shared by drivers and worker processes
//! of both languages (DESIGN.md §1, §2, §8).
//!
//! ```ignore
//! #[tpuray::remote]
//! fn add(a: i64, b: i64) -> i64 { a + b }
//!
//! fn main() -> Result<(), tpuray::Error> {
//!     tpuray::init(None)?;              // in a worker process: never returns
//!     let x = add::remote(1, 2);        // ObjectRef<i64>
//!     let y = add::remote(&x, 10);      // refs pass straight into tasks
//!     assert_eq!(tpuray::get(&y)?, 13);
//!     tpuray::shutdown();
//!     Ok(())
//! }
//! ```
//!
//! Modules: [`core`] (ownership, submission through leases, actor calls,
//! object fetches; invariants CORE-2..5), `executor` (running pushed tasks,
//! hosting an actor), [`worker`] (the worker process, CORE-1), [`driver`]
//! (`init`, binary upload, cluster queries), [`codec`] (postcard encoding of
//! serde values), [`registry`] (the binary's function table).
//!
//! Blocking: `init`, `get`, `wait`, `put`, submission and actor creation
//! block the calling thread; call them from plain threads, never from inside
//! another async runtime. User functions run on executor threads.

pub mod actor;
pub mod codec;
pub mod core;
mod direct;
pub mod driver;
pub mod error;
mod executor;
pub mod foreign;
pub mod gang;
pub mod logs;
pub mod metrics;
mod node_watch;
pub mod object_ref;
pub mod options;
pub mod placement_group;
pub mod raw;
pub mod registry;
mod service;
mod thp;
pub mod worker;

use std::time::{Duration, Instant};

use serde::Serialize;
use serde::de::DeserializeOwned;

pub use actor::ActorHandle;
pub use codec::{Blob, IntoArg};
pub use driver::{
    DriverOptions, NodeSummary, available_resources, available_resources_per_node,
    cluster_resources, init, init_with, nodes, shutdown,
};
pub use error::{Error, TaskFailure};
pub use object_ref::{Generator, ObjectRef, ObjectRefGenerator, RawRef};
pub use options::{ActorOptions, CallOptions, Scheduling, TaskOptions};
pub use placement_group::{
    PlacementGroup, PlacementGroupOptions, SlicePlacementGroup, get_placement_group,
    placement_group, placement_group_table, placement_group_with, remove_placement_group,
    slice_placement_group,
};
pub use tpuray_macros::{actor, remote};

#[doc(hidden)]
pub use inventory;
#[doc(hidden)]
pub use serde;

/// Waits for the value of `r`.
///
/// # Errors
/// The task's error (naming the function and carrying its message), a lost
/// object, or a decode mismatch.
pub fn get<T: DeserializeOwned>(r: &ObjectRef<T>) -> Result<T, Error> {
    get_inner(r, None)
}

/// Waits at most `timeout` for the value of `r`.
///
/// # Errors
/// [`Error::Timeout`] when it is not ready in time; else as [`get`].
pub fn get_timeout<T: DeserializeOwned>(r: &ObjectRef<T>, timeout: Duration) -> Result<T, Error> {
    get_inner(r, Some(Instant::now() + timeout))
}

fn get_inner<T: DeserializeOwned>(r: &ObjectRef<T>, deadline: Option<Instant>) -> Result<T, Error> {
    let core = core::core()?;
    let _blocked =
        if core.rt.block_on(core.is_ready(r.raw())) { None } else { raw::Blocked::enter() };
    // An owned object is waited for on this thread, which may read its reply itself.
    let forever = || Instant::now() + Duration::from_secs(365 * 24 * 3600);
    core.settle_owned(std::slice::from_ref(r.raw()), deadline.unwrap_or_else(forever));
    let data = core.rt.block_on(core.get_data(r.raw(), deadline)).map_err(|e| match e {
        Error::Timeout(..) => Error::Timeout(
            deadline.map(|d| d.saturating_duration_since(Instant::now())).unwrap_or_default(),
            1,
        ),
        e => e,
    })?;
    codec::decode(&data).map_err(Error::Decode)
}

/// Waits for every value, in order.
///
/// # Errors
/// The first failure, as [`get`].
pub fn get_all<T: DeserializeOwned>(refs: &[ObjectRef<T>]) -> Result<Vec<T>, Error> {
    refs.iter().map(get).collect()
}

/// The raw bytes of an object without decoding: mapped from the node's
/// shared-memory store for large objects (no copy), inline otherwise.
///
/// # Errors
/// As [`get`].
pub fn get_bytes<T>(r: &ObjectRef<T>) -> Result<core::Data, Error> {
    let core = core::core()?;
    core.rt.block_on(core.get_data(r.raw(), None))
}

/// Stores `value` as an object owned by this process.
///
/// # Errors
/// The node's object store cannot take it.
pub fn put<T: Serialize>(value: &T) -> Result<ObjectRef<T>, Error> {
    let core = core::core()?;
    // A pass that only counts (the refs it meets are dropped: the writing pass captures them).
    let (size, _) = object_ref::capture_nested(|| codec::encoded_len(value));
    if size <= core::INLINE_MAX_BYTES {
        let (bytes, nested) = object_ref::capture_nested(|| codec::encode(value));
        return core.put_bytes(bytes, nested).map(ObjectRef::from_raw);
    }
    // Large: encoded straight into the store (one copy of the bytes, no encoded Vec).
    core.put_streamed(size, |out| {
        let (r, nested) = object_ref::capture_nested(|| codec::encode_to(value, out));
        r.map(|()| nested)
    })
    .map(ObjectRef::from_raw)
}

/// Ready and not-ready refs, as [`wait`] returns them.
pub type WaitResult<T> = (Vec<ObjectRef<T>>, Vec<ObjectRef<T>>);

/// Splits `refs` into (ready, not ready) once `num_returns` are ready or
/// `timeout` passes (Ray's `wait`; order within each list is kept).
///
/// # Errors
/// [`Error::Cluster`] when not initialised.
pub fn wait<T>(
    refs: &[ObjectRef<T>],
    num_returns: usize,
    timeout: Option<Duration>,
) -> Result<WaitResult<T>, Error> {
    let raws: Vec<RawRef> = refs.iter().map(|r| r.raw().clone()).collect();
    let first = raw::wait(&raws, num_returns, Some(Duration::ZERO))?;
    let enough = first.iter().filter(|x| **x).count() >= num_returns.min(raws.len());
    let ready = if enough || timeout == Some(Duration::ZERO) {
        first
    } else {
        let _blocked = raw::Blocked::enter();
        raw::wait(&raws, num_returns, timeout)?
    };
    let (a, b): (Vec<_>, Vec<_>) = refs.iter().cloned().zip(ready).partition(|(_, r)| *r);
    Ok((a.into_iter().map(|x| x.0).collect(), b.into_iter().map(|x| x.0).collect()))
}

/// Cancels the task that makes `r` and the tasks it submitted (Ray's `cancel` with
/// `recursive=True`): a queued task never runs; a running one is stopped when `force`
/// (its worker exits), else told to stop: [`is_cancelled`] turns true inside it, and a
/// Python task gets `KeyboardInterrupt`. `get` then fails with [`Error::Cancelled`]. A
/// finished task is left as it is.
///
/// # Errors
/// The worker running it cannot be reached; `force` for an actor call (Ray refuses it
/// too: kill the actor instead).
pub fn cancel<T>(r: &ObjectRef<T>, force: bool) -> Result<(), Error> {
    cancel_with(r, force, true)
}

/// As [`cancel`], with `recursive` choosing whether the tasks it submitted go too.
///
/// # Errors
/// As [`cancel`].
pub fn cancel_with<T>(r: &ObjectRef<T>, force: bool, recursive: bool) -> Result<(), Error> {
    let core = core::core()?;
    core.rt.block_on(core.cancel(r.id(), r.raw().owner(), force, recursive))
}

/// Whether the task or actor call running on this thread was cancelled (`cancel`
/// without `force`): a long task checks it and stops early (cooperative cancellation;
/// Ray's `get_runtime_context().is_canceled()`). False outside a task.
pub fn is_cancelled() -> bool {
    executor::current_task_cancelled()
}

/// The id of the placement group the task or actor call running on this thread runs in
/// (Ray's `get_current_placement_group`); `None` outside one, and in a driver.
pub fn current_placement_group_id() -> Option<String> {
    executor::current_placement_group()
}

/// Kills an actor by id (Ray's `kill`).
///
/// # Errors
/// The head cannot be reached or does not know the actor.
pub fn kill_actor(actor_id: &str, no_restart: bool) -> Result<(), Error> {
    kill_actor_because(actor_id, no_restart, "")
}

/// As [`kill_actor`], recording `reason` as the actor's death cause ("": killed by
/// `kill()`), e.g. an actor ending itself with `exit_actor()`.
///
/// # Errors
/// As [`kill_actor`].
pub fn kill_actor_because(actor_id: &str, no_restart: bool, reason: &str) -> Result<(), Error> {
    let core = core::core()?;
    core.rt.block_on(async {
        let mut head = core.head_client()?;
        head.kill_actor(tpuray_proto::pb::KillActorRequest {
            request_id: tpuray_proto::new_request_id(),
            actor_id: actor_id.to_string(),
            no_restart,
            reason: reason.to_string(),
        })
        .await
        .map_err(|s| Error::Cluster(s.message().to_string()))?;
        Ok(())
    })
}

/// The live actor named `name` in `namespace` (default: "default").
///
/// # Errors
/// [`Error::Cluster`] naming the actor when there is none.
pub fn get_actor(name: &str, namespace: Option<&str>) -> Result<ActorHandle, Error> {
    let core = core::core()?;
    core.rt.block_on(async {
        let mut head = core.head_client()?;
        let a = head
            .get_actor(tpuray_proto::pb::GetActorRequest {
                name: name.to_string(),
                namespace: namespace.unwrap_or_default().to_string(),
                ..Default::default()
            })
            .await
            .map_err(|s| Error::Cluster(s.message().to_string()))?
            .into_inner()
            .actor
            .unwrap_or_default();
        Ok(ActorHandle {
            actor_id: a.actor_id,
            class: a.class_name,
            name: a.name,
            max_task_retries: 0,
            max_pending_calls: -1,
        })
    })
}

#[doc(hidden)]
pub fn submit_task<T>(function: &str, args: Vec<codec::Arg>, opts: &TaskOptions) -> ObjectRef<T> {
    let core = core::core().expect("tpuray::init must run before submitting tasks");
    match core.submit(function, args, opts, false) {
        Ok(mut task) => {
            ObjectRef::from_raw(RawRef::adopt(task.return_ids.swap_remove(0), core.address.clone()))
        }
        Err(e) => failed_ref(core, function, e),
    }
}

fn failed_ref<T>(core: &std::sync::Arc<core::Core>, function: &str, e: Error) -> ObjectRef<T> {
    // Bad options: a ref whose get() names the problem.
    let r = core.put_failed(function, &e.to_string());
    ObjectRef::from_raw(r)
}

#[doc(hidden)]
pub fn submit_streaming<T>(
    function: &str,
    args: Vec<codec::Arg>,
    opts: &TaskOptions,
) -> ObjectRefGenerator<T> {
    let core = core::core().expect("tpuray::init must run before submitting tasks");
    let spec = core.submit(function, args, opts, true).expect("valid task options");
    ObjectRefGenerator {
        task_id: spec.task_id,
        function: spec.name,
        next: 0,
        _t: std::marker::PhantomData,
    }
}

#[doc(hidden)]
pub fn create_actor(
    class: &str,
    args: Vec<codec::Arg>,
    opts: &ActorOptions,
) -> Result<ActorHandle, Error> {
    let core = core::core()?;
    core.rt.block_on(core.create_actor(class, args, opts))
}

/// This driver's or worker's job id.
///
/// # Errors
/// [`Error::Cluster`] when not initialised.
pub fn job_id() -> Result<String, Error> {
    Ok(core::core()?.job_id.clone())
}

/// The id of the node this process runs on.
///
/// # Errors
/// [`Error::Cluster`] when not initialised.
pub fn node_id() -> Result<String, Error> {
    Ok(core::core()?.node_id.clone())
}
