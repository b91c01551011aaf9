//! Actor handles: typed handles (`CounterHandle`) wrap an [`ActorHandle`],
//! which names the actor and sends calls through this process's ordered
//! sender for it (CORE-4).

use serde::{Deserialize, Serialize};

use crate::codec::Arg;
use crate::error::Error;
use crate::object_ref::{ObjectRef, ObjectRefGenerator, RawRef};
use crate::options::CallOptions;

/// An untyped actor handle: serializable, so it can be passed to tasks.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct ActorHandle {
    pub actor_id: String,
    /// The registered class path.
    pub class: String,
    /// Empty for unnamed actors.
    pub name: String,
    /// Times a call is sent again when the actor dies while running it and restarts
    /// (Ray's `max_task_retries`; -1: forever; default 0).
    #[serde(default)]
    pub max_task_retries: i32,
    /// Calls through this process that may be unfinished at once (Ray's
    /// `max_pending_calls`, counted per caller process; -1: no limit).
    #[serde(default = "no_limit")]
    pub max_pending_calls: i32,
}

fn no_limit() -> i32 {
    -1
}

impl ActorHandle {
    /// Calls `method`; a call refused at submission (the handle's `max_pending_calls`
    /// reached) yields a ref whose `get` returns that error (use
    /// [`ActorHandle::try_call`] to see it at once).
    #[doc(hidden)]
    pub fn call<T>(&self, method: &str, args: Vec<Arg>) -> ObjectRef<T> {
        let core = crate::core::core().expect("tpuray::init must run before calling actors");
        match self.try_call(method, args, &CallOptions::default()) {
            Ok(r) => r,
            Err(e) => ObjectRef::from_raw(core.put_failed_with(method, e)),
        }
    }

    /// Calls `method` with per-call options (its concurrency group, retries).
    ///
    /// # Errors
    /// [`Error::PendingCallsLimitExceeded`] when this process already has the handle's
    /// `max_pending_calls` unfinished calls to the actor; [`Error::Cluster`] when not
    /// initialised.
    pub fn try_call<T>(
        &self,
        method: &str,
        args: Vec<Arg>,
        call: &CallOptions,
    ) -> Result<ObjectRef<T>, Error> {
        let core = crate::core::core()?;
        let spec = core.call_actor(self, method, args, false, 1, call)?;
        Ok(ObjectRef::from_raw(RawRef::adopt(spec.return_ids[0].clone(), core.address.clone())))
    }

    /// The calls from this process to the actor that are not finished yet (what
    /// `max_pending_calls` bounds).
    pub fn pending_calls(&self) -> usize {
        crate::core::core().map(|c| c.pending_actor_calls(&self.actor_id)).unwrap_or(0)
    }

    #[doc(hidden)]
    pub fn call_streaming<T>(&self, method: &str, args: Vec<Arg>) -> ObjectRefGenerator<T> {
        let core = crate::core::core().expect("tpuray::init must run before calling actors");
        let spec = core
            .call_actor(self, method, args, true, 0, &CallOptions::default())
            .expect("a streaming call under max_pending_calls");
        ObjectRefGenerator {
            task_id: spec.task_id,
            function: spec.name,
            next: 0,
            _t: std::marker::PhantomData,
        }
    }

    /// Kills the actor (Ray's `kill`): with `no_restart`, it stays dead.
    ///
    /// # Errors
    /// The head cannot be reached or does not know the actor.
    pub fn kill(&self, no_restart: bool) -> Result<(), Error> {
        crate::kill_actor(&self.actor_id, no_restart)
    }
}
