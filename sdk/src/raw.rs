//! The language-binding layer: untyped calls over the core worker, for SDKs of other
//! languages (the Python SDK's extension module). Values are bytes the binding encodes
//! itself; refs are [`RawRef`]s; everything else (leases, ownership, borrowing, actor
//! ordering, placement groups) is the same core the Rust SDK uses.
//!
//! Blocking: every function blocks the calling thread on the SDK's runtime; bindings
//! release their interpreter lock around them.

use std::time::{Duration, Instant};

use tpuray_proto::pb;

pub use crate::codec::Arg;
pub use crate::core::Data;
pub use crate::object_ref::RawRef;

use crate::actor::ActorHandle;
use crate::core::core;
use crate::error::Error;
use crate::options::{ActorOptions, TaskOptions};

/// Who this process is in the cluster.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ProcessInfo {
    pub job_id: String,
    pub node_id: String,
    pub worker_id: String,
    /// This process's `WorkerService` address (the owner address of its objects).
    pub address: String,
    /// The local node agent's address.
    pub agent_address: String,
    pub head_address: String,
}

/// This process's identity.
///
/// # Errors
/// [`Error::Cluster`] when not initialised.
pub fn process_info() -> Result<ProcessInfo, Error> {
    let c = core()?;
    Ok(ProcessInfo {
        job_id: c.job_id.clone(),
        node_id: c.node_id.clone(),
        worker_id: c.worker_id.clone(),
        address: c.address.clone(),
        agent_address: c.agent_address.clone(),
        head_address: c.head_address.clone(),
    })
}

/// The head's dashboard (its HTTP server), `http://HOST:PORT`, or `""` when it serves
/// none (Ray's `RayContext.dashboard_url`, without the scheme there).
///
/// # Errors
/// [`Error::Cluster`] when not initialised or the head cannot be reached.
pub fn dashboard_url() -> Result<String, Error> {
    let c = core()?;
    let mut head = c.head_client()?;
    c.rt.block_on(async move {
        head.get_head_info(pb::GetHeadInfoRequest {})
            .await
            .map(|r| r.into_inner().dashboard_url)
            .map_err(|s| Error::Cluster(format!("the head: {}", s.message())))
    })
}

/// Whether the core worker is running in this process.
pub fn is_initialized() -> bool {
    crate::core::try_core().is_some()
}

/// Submits a task of `function` (the worker's key for it); returns its return refs.
///
/// # Errors
/// Bad options (resources, label selector, bundle index), naming the problem.
pub fn submit(function: &str, args: Vec<Arg>, opts: &TaskOptions) -> Result<Vec<RawRef>, Error> {
    let c = core()?;
    let spec = c.submit(function, args, opts, false)?;
    Ok(spec.return_ids.into_iter().map(|id| RawRef::adopt(id, c.address.clone())).collect())
}

/// Submits a streaming generator task; returns its task id, for [`next_item`].
///
/// # Errors
/// As [`submit`].
pub fn submit_streaming(
    function: &str,
    args: Vec<Arg>,
    opts: &TaskOptions,
) -> Result<String, Error> {
    Ok(core()?.submit(function, args, opts, true)?.task_id)
}

/// Calls a streaming actor method; returns its task id, for [`next_item`].
///
/// # Errors
/// [`Error::Cluster`] when not initialised.
pub fn call_actor_streaming(
    handle: &ActorHandle,
    method: &str,
    args: Vec<Arg>,
) -> Result<String, Error> {
    Ok(core()?
        .call_actor(handle, method, args, true, 0, &crate::options::CallOptions::default())?
        .task_id)
}

/// As [`call_actor_streaming`], with per-call options (its concurrency group).
///
/// # Errors
/// [`Error::PendingCallsLimitExceeded`] over the handle's `max_pending_calls`;
/// [`Error::Cluster`] when not initialised.
pub fn call_actor_streaming_with(
    handle: &ActorHandle,
    method: &str,
    args: Vec<Arg>,
    call: &crate::options::CallOptions,
) -> Result<String, Error> {
    Ok(core()?.call_actor(handle, method, args, true, 0, call)?.task_id)
}

/// The `index`-th item of streaming task `task_id` once it exists; `None` after the last
/// one; the task's error when it failed there. Blocks.
pub fn next_item(task_id: &str, name: &str, index: u64) -> Option<Result<RawRef, Error>> {
    crate::core::next_generator_item(task_id, name, index)
}

/// As [`next_item`], with the task's failure as a ref whose `get` fails with it (Ray
/// 2.60's streaming generators); `None` after that. Blocks.
pub fn next_item_ref(task_id: &str, name: &str, index: u64) -> Option<RawRef> {
    crate::core::next_generator_item_ref(task_id, name, index)
}

/// Forgets a streaming task's bookkeeping once its consumer took `consumed` items.
pub fn drop_stream(task_id: &str, consumed: u64) {
    crate::core::drop_generator(task_id, consumed);
}

/// Creates an actor of `class` (the worker's key for it) shown as `display`.
///
/// # Errors
/// Bad options, a name already taken, the head unreachable.
pub fn create_actor(
    class: &str,
    display: &str,
    args: Vec<Arg>,
    opts: &ActorOptions,
) -> Result<ActorHandle, Error> {
    let c = core()?;
    c.rt.block_on(c.create_actor_as(class, display, args, opts))
}

/// Calls `method` on an actor through this process's ordered sender (CORE-4); returns the
/// call's `num_returns` refs.
///
/// # Errors
/// [`Error::Cluster`] when not initialised.
pub fn call_actor(
    handle: &ActorHandle,
    method: &str,
    args: Vec<Arg>,
    num_returns: u32,
    call: &crate::options::CallOptions,
) -> Result<Vec<RawRef>, Error> {
    let c = core()?;
    let spec = c.call_actor(handle, method, args, false, num_returns, call)?;
    Ok(spec.return_ids.into_iter().map(|id| RawRef::adopt(id, c.address.clone())).collect())
}

/// The bytes of each ref, in order, waiting at most `timeout` for all of them together.
/// A failed object yields its error; refs not ready by the deadline yield
/// [`Error::Timeout`].
///
/// # Errors
/// [`Error::Cluster`] when not initialised.
pub fn get(refs: &[RawRef], timeout: Option<Duration>) -> Result<Vec<Result<Data, Error>>, Error> {
    let c = core()?;
    let deadline = timeout.map(|t| Instant::now() + t);
    if let Some(d) = deadline {
        // This process's own objects are waited for without a runtime timer.
        c.settle_owned(refs, d);
    }
    Ok(c.rt.block_on(async {
        let mut out = Vec::with_capacity(refs.len());
        for r in refs {
            out.push(c.get_data(r, deadline).await.map_err(|e| match e {
                Error::Timeout(..) => Error::Timeout(timeout.unwrap_or_default(), refs.len()),
                e => e,
            }));
        }
        out
    }))
}

/// While alive, this thread counts as blocked waiting for objects (a worker's CPUs go back
/// to its node meanwhile, AGENT-11). Create it only around a wait that did not complete at
/// once, on a thread outside the SDK's runtime.
pub struct Blocked(());

impl Blocked {
    /// Marks the calling thread blocked; `None` when not initialised.
    pub fn enter() -> Option<Blocked> {
        core().ok()?.set_blocked(true);
        Some(Blocked(()))
    }
}

impl Drop for Blocked {
    fn drop(&mut self) {
        if let Ok(c) = core() {
            c.set_blocked(false);
        }
    }
}

/// Stores `bytes` as an object owned by this process; `nested` are the refs inside it
/// (kept alive as long as it lives, CORE-2).
///
/// # Errors
/// The node's object store cannot take it.
pub fn put(bytes: Vec<u8>, nested: Vec<RawRef>) -> Result<RawRef, Error> {
    core()?.put_bytes(bytes, nested)
}

/// Stores the concatenation of `parts` as an object owned by this process, as [`put`]
/// does with one buffer: a value serialized in pieces (a pickle and the buffers it refers
/// to) is written piece by piece into the node's store, without joining them first.
///
/// # Errors
/// The node's object store cannot take it.
pub fn put_parts(parts: &[&[u8]], nested: Vec<RawRef>) -> Result<RawRef, Error> {
    core()?.put_parts(parts, nested)
}

/// Which refs are ready once `num_returns` of them are or `timeout` passes (Ray's `wait`).
///
/// # Errors
/// [`Error::Cluster`] when not initialised.
pub fn wait(
    refs: &[RawRef],
    num_returns: usize,
    timeout: Option<Duration>,
) -> Result<Vec<bool>, Error> {
    let c = core()?;
    let deadline = timeout.map(|t| Instant::now() + t);
    let want = num_returns.min(refs.len());
    Ok(c.rt.block_on(async {
        loop {
            let changed = c.objects_changed();
            tokio::pin!(changed);
            changed.as_mut().enable();
            let mut ready = vec![false; refs.len()];
            let mut n = 0;
            for (i, r) in refs.iter().enumerate() {
                if n >= want {
                    break;
                }
                if c.is_ready(r).await {
                    ready[i] = true;
                    n += 1;
                }
            }
            if n >= want || deadline.is_some_and(|d| Instant::now() >= d) {
                return ready;
            }
            // Borrowed refs change state elsewhere: look again at least every 20 ms.
            let _ = tokio::time::timeout(Duration::from_millis(20), changed).await;
        }
    }))
}

/// A ref to an object named in a serialized value (the binding's unpickling): counted,
/// and registered with its owner as borrowed when this process is not the owner (CORE-2).
pub fn deserialized_ref(id: String, owner: String) -> RawRef {
    RawRef::new(id, owner)
}

/// Opens a borrow batch on this thread (around deserializing one value): refs made by
/// [`deserialized_ref`] until the matching [`end_borrow_batch`] register with their
/// owners together, one call per owner, instead of one call each (CORE-2). Batches nest.
pub fn begin_borrow_batch() {
    crate::core::begin_borrow_batch();
}

/// Closes a batch [`begin_borrow_batch`] opened; the outermost one returns once every
/// owner confirmed the registrations made inside it. Blocks; call without the GIL.
pub fn end_borrow_batch() {
    crate::core::end_borrow_batch();
}

/// Cancels the task that makes `r` (Ray's `cancel`, see [`crate::cancel`]; `force`
/// kills its worker, `recursive` cancels what it submitted too).
///
/// # Errors
/// The worker running it cannot be reached; `force` for an actor call.
pub fn cancel(r: &RawRef, force: bool, recursive: bool) -> Result<(), Error> {
    let c = core()?;
    c.rt.block_on(c.cancel(r.id(), r.owner(), force, recursive))
}

/// Cancels streaming task `task_id` (a generator's), as [`cancel`].
///
/// # Errors
/// As [`cancel`].
pub fn cancel_task(task_id: &str, force: bool, recursive: bool) -> Result<(), Error> {
    let c = core()?;
    c.rt.block_on(c.cancel_task(task_id, force, recursive))
}

/// Whether streaming task `task_id` has an item after its first `index`, or ended:
/// what `wait` on a generator answers. Does not block.
pub fn generator_ready(task_id: &str, index: u64) -> bool {
    core().map(|c| c.generator_ready(task_id, index)).unwrap_or(true)
}

/// This process's unfinished calls to actor `actor_id` (what `max_pending_calls`
/// bounds).
pub fn pending_actor_calls(actor_id: &str) -> usize {
    core().map(|c| c.pending_actor_calls(actor_id)).unwrap_or(0)
}

/// Whether the task running on this thread was cancelled (see [`crate::is_cancelled`]);
/// `task_id` given: whether that task, running in this process, was.
pub fn is_cancelled(task_id: Option<&str>) -> bool {
    match task_id {
        Some(t) => crate::executor::task_cancelled(t),
        None => crate::executor::current_task_cancelled(),
    }
}

/// Frees objects this process owns now, whatever refs remain (Ray's
/// `ray._private.internal_api.free`); a later `get` fails with `ObjectLost` beginning
/// "freed explicitly".
///
/// # Errors
/// Not initialised, or a ref owned by another process.
pub fn free(refs: &[RawRef]) -> Result<(), Error> {
    let c = core()?;
    let ids: Vec<(String, String)> =
        refs.iter().map(|r| (r.id().to_string(), r.owner().to_string())).collect();
    c.free(&ids)
}

/// Sends a worker's output lines to its job's driver (`ReportLogs`): `batches` are
/// (task or actor name, lines) in the order printed; the pid and this node's address
/// go with them. Returns false when the driver takes no worker output
/// (`log_to_driver=False`): stop sending.
///
/// # Errors
/// The driver cannot be reached.
pub fn report_logs(
    driver: &str,
    batches: Vec<(String, Vec<String>)>,
    is_err: bool,
) -> Result<bool, Error> {
    let c = core()?;
    let ip = c.agent_address.rsplit_once(':').map(|(h, _)| h.to_string()).unwrap_or_default();
    c.rt.block_on(async {
        let mut w = c.worker_client(driver)?;
        let reply = w
            .report_logs(pb::ReportLogsRequest {
                is_err,
                pid: std::process::id(),
                ip,
                batches: batches
                    .into_iter()
                    .map(|(name, lines)| pb::LogBatch { name, lines })
                    .collect(),
            })
            .await
            .map_err(|s| Error::Cluster(s.message().to_string()))?;
        Ok(!reply.into_inner().unwanted)
    })
}

/// Asks the local node agent to start `count` idle workers of this job (at most its
/// CPUs), so the first tasks do not wait for processes to boot. Returns how many it
/// starts.
///
/// # Errors
/// The agent cannot be reached.
pub fn prestart_workers(count: u32) -> Result<u32, Error> {
    let c = core()?;
    c.rt.block_on(async {
        let mut a = c.agent_client(&c.agent_address)?;
        let r = a
            .prestart_workers(pb::PrestartWorkersRequest {
                job_id: c.job_id.clone(),
                language: crate::foreign::language().to_string(),
                runtime_env_hash: String::new(),
                count,
            })
            .await
            .map_err(|s| Error::Cluster(s.message().to_string()))?;
        Ok(r.into_inner().started)
    })
}

/// A value from the head's KV store.
///
/// # Errors
/// The head cannot be reached.
pub fn kv_get(namespace: &str, key: &[u8]) -> Result<Option<Vec<u8>>, Error> {
    let c = core()?;
    c.rt.block_on(async {
        let r = c
            .head_client()?
            .kv_get(pb::KvGetRequest { namespace: namespace.into(), key: key.to_vec() })
            .await
            .map_err(|s| Error::Cluster(s.message().to_string()))?
            .into_inner();
        Ok(r.found.then_some(r.value))
    })
}

/// Stores a value in the head's KV store; returns whether it was added (false when the key
/// existed and `overwrite` is false).
///
/// # Errors
/// The head cannot be reached.
pub fn kv_put(namespace: &str, key: &[u8], value: Vec<u8>, overwrite: bool) -> Result<bool, Error> {
    let c = core()?;
    c.rt.block_on(async {
        let r = c
            .head_client()?
            .kv_put(pb::KvPutRequest {
                request_id: tpuray_proto::new_request_id(),
                namespace: namespace.into(),
                key: key.to_vec(),
                value,
                overwrite,
            })
            .await
            .map_err(|s| Error::Cluster(s.message().to_string()))?
            .into_inner();
        Ok(r.added)
    })
}

/// Deletes a key from the head's KV store; returns whether it existed.
///
/// # Errors
/// The head cannot be reached.
pub fn kv_delete(namespace: &str, key: &[u8]) -> Result<bool, Error> {
    let c = core()?;
    c.rt.block_on(async {
        let r = c
            .head_client()?
            .kv_delete(pb::KvDeleteRequest {
                request_id: tpuray_proto::new_request_id(),
                namespace: namespace.into(),
                key: key.to_vec(),
            })
            .await
            .map_err(|s| Error::Cluster(s.message().to_string()))?
            .into_inner();
        Ok(r.deleted)
    })
}

/// The KV namespace of runtime environments (the node agent reads a worker's environment
/// from key `TaskOptions::runtime_env_hash` there).
pub const RUNTIME_ENV_NAMESPACE: &str = "runtime_env";

/// The actor's current state from the head (`GetActor`), waiting up to `wait` for it to be
/// alive or dead.
///
/// # Errors
/// The head cannot be reached or does not know the actor.
pub fn actor_info(actor_id: &str, wait: Duration) -> Result<pb::ActorInfo, Error> {
    let c = core()?;
    c.rt.block_on(async {
        Ok(c.head_client()?
            .get_actor(pb::GetActorRequest {
                actor_id: actor_id.into(),
                wait_alive_ms: wait.as_millis() as u64,
                ..Default::default()
            })
            .await
            .map_err(|s| Error::Cluster(s.message().to_string()))?
            .into_inner()
            .actor
            .unwrap_or_default())
    })
}

/// Every actor the head knows, alive or dead (`ListActors`; Ray's
/// `list_named_actors` filters these).
///
/// # Errors
/// The head cannot be reached.
pub fn list_actors() -> Result<Vec<pb::ActorInfo>, Error> {
    let c = core()?;
    c.rt.block_on(async {
        Ok(c.head_client()?
            .list_actors(pb::ListActorsRequest {})
            .await
            .map_err(|s| Error::Cluster(s.message().to_string()))?
            .into_inner()
            .actors)
    })
}
