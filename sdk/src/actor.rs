//! Actor handles: typed handles (`CounterHandle`) wrap an [`ActorHandle`],
//! which names the actor and sends calls through this process's ordered
//! sender for it (CORE-4).

use serde::{Deserialize, Serialize};

use crate::codec::Arg;
use crate::error::Error;
use crate::object_ref::{ObjectRef, ObjectRefGenerator, RawRef};

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
}

impl ActorHandle {
    #[doc(hidden)]
    pub fn call<T>(&self, method: &str, args: Vec<Arg>) -> ObjectRef<T> {
        let core = crate::core::core().expect("tpuray::init must run before calling actors");
        let spec = core.call_actor(self, method, args, false, 1);
        ObjectRef::from_raw(RawRef::adopt(spec.return_ids[0].clone(), core.address.clone()))
    }

    #[doc(hidden)]
    pub fn call_streaming<T>(&self, method: &str, args: Vec<Arg>) -> ObjectRefGenerator<T> {
        let core = crate::core::core().expect("tpuray::init must run before calling actors");
        let spec = core.call_actor(self, method, args, true, 0);
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
