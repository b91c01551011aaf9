//! What a call's reply carries: its results stored (small ones inline, large ones in
//! the node's store), the refs nested in them handed over to the caller (CORE-2), a
//! generator's items reported to its owner one by one, or the failure.

use std::panic::AssertUnwindSafe;

use tpuray_proto::pb;
use tpuray_proto::pb::task_error::Kind;

use super::Executor;
use super::context::{cancelled_set, task_cancelled};
use super::invoke::panic_message;
use crate::codec::Encoded;
use crate::core::{Core, INLINE_MAX_BYTES};
use crate::error::TaskFailure;
use crate::object_ref::RawRef;

pub(super) fn failure(spec: &pb::TaskSpec, core: &Core, f: TaskFailure) -> pb::PushTaskReply {
    pb::PushTaskReply {
        returns: vec![],
        error: Some(pb::TaskError {
            kind: f.kind as i32,
            message: f.message,
            function_name: spec.name.clone(),
            node_id: core.node_id.clone(),
            pid: std::process::id(),
            payload: f.payload,
            no_retry: f.no_retry,
        }),
        ..Default::default()
    }
}

/// The reply of a call whose executor stopped before it answered.
pub(crate) fn stopped() -> pb::PushTaskReply {
    pb::PushTaskReply {
        error: Some(pb::TaskError {
            kind: Kind::WorkerDied as i32,
            message: "executor stopped".into(),
            ..Default::default()
        }),
        ..Default::default()
    }
}

impl Executor {
    /// The reply for a call that ran: its results stored (small ones inline), the refs in
    /// them handed over to the caller, and the refs it kept registered with their owners.
    /// Blocks (on owners' answers, and on the store for large results): not for the
    /// runtime's threads.
    pub(super) fn finish(
        &self,
        spec: &pb::TaskSpec,
        result: Result<Encoded, TaskFailure>,
    ) -> pb::PushTaskReply {
        let core = &self.core;
        let _guard = core.rt.enter();
        let reply = match result {
            Ok(Encoded::Value(bytes)) => {
                let nested = crate::codec::take_return_nested();
                match self.store_return(spec, &spec.return_ids[0], bytes) {
                    Ok(r) => pb::PushTaskReply {
                        returns: vec![r],
                        nested_in_return: self.hand_over(spec, nested),
                        ..Default::default()
                    },
                    Err(f) => failure(spec, core, f),
                }
            }
            Ok(Encoded::Stream(items)) => self.stream(spec, items),
            Ok(Encoded::Foreign(ret)) => self.store_foreign(spec, ret),
            Err(f) => failure(spec, core, f),
        };
        let mut reply = reply;
        reply.node_id = core.node_id.clone();
        reply.worker_id = core.worker_id.clone();
        // Refs the task kept (in an actor's state, say) are registered with
        // their owners before the reply unpins the arguments (CORE-2).
        crate::core::confirm_borrows(core);
        self.running.lock().unwrap().remove(&spec.task_id);
        cancelled_set().lock().unwrap().remove(&spec.task_id);
        core.forget_children(&spec.task_id);
        // The executor says FINISHED too (as Ray's does): the owner's own event can be
        // lost when the owner exits right after `get` returned the value.
        if reply.error.is_none() {
            core.event(spec, "FINISHED", "");
        }
        crate::metrics::task_ended(spec);
        reply
    }

    /// Stores a foreign runtime's return values, one per return id.
    fn store_foreign(
        &self,
        spec: &pb::TaskSpec,
        ret: crate::foreign::ForeignReturn,
    ) -> pb::PushTaskReply {
        if ret.values.len() != spec.return_ids.len() {
            return failure(
                spec,
                &self.core,
                TaskFailure::application(format!(
                    "{} returned {} value(s) but num_returns is {}",
                    spec.name,
                    ret.values.len(),
                    spec.return_ids.len()
                )),
            );
        }
        let mut returns = Vec::with_capacity(ret.values.len());
        for (id, bytes) in spec.return_ids.iter().zip(ret.values) {
            match self.store_return(spec, id, bytes) {
                Ok(r) => returns.push(r),
                Err(f) => return failure(spec, &self.core, f),
            }
        }
        let nested = if returns.is_empty() { vec![] } else { self.hand_over(spec, ret.nested) };
        pb::PushTaskReply { returns, nested_in_return: nested, ..Default::default() }
    }

    /// Refs nested in a return value outlive this task's own copies: each
    /// owner learns, before the reply goes out, that the caller borrows them
    /// (as `<caller>#ret:<return id>`), and the caller releases that when it
    /// frees the return object (CORE-2).
    fn hand_over(&self, spec: &pb::TaskSpec, nested: Vec<RawRef>) -> Vec<pb::ObjectRefMsg> {
        let core = &self.core;
        let key = format!("{}#ret:{}", spec.owner_address, spec.return_ids[0]);
        let mut seen = std::collections::HashSet::new();
        let mut out = Vec::new();
        // Registrations with other owners go out in one batch per owner.
        let mut waits = Vec::new();
        for r in nested {
            if !seen.insert(r.id().to_string()) {
                continue;
            }
            if r.owner() == core.address {
                core.watch_borrowers();
                core.serve_update_borrower(r.id(), &key, true);
            } else {
                waits.push(core.queue_borrower(r.owner(), r.id(), &key));
            }
            out.push(pb::ObjectRefMsg {
                object_id: r.id().to_string(),
                owner_address: r.owner().to_string(),
            });
        }
        if !waits.is_empty() {
            core.rt.block_on(crate::core::all_confirmed(waits));
        }
        out
    }

    /// Inline when small, else a primary copy in this node's store recording
    /// the task's owner (shown by `tpuray memory`).
    fn store_return(
        &self,
        spec: &pb::TaskSpec,
        id: &str,
        bytes: Vec<u8>,
    ) -> Result<pb::ReturnObject, TaskFailure> {
        let size = bytes.len() as u64;
        if bytes.len() <= INLINE_MAX_BYTES {
            return Ok(pb::ReturnObject {
                object_id: id.to_string(),
                data: Some(pb::return_object::Data::InlineValue(bytes)),
                size,
            });
        }
        let opts = tpuray_objectstore::CreateOptions {
            owner: (!spec.owner_address.is_empty()).then(|| spec.owner_address.clone()),
            ..Default::default()
        };
        self.core.store.put_with(id, &bytes, &opts).map_err(|e| {
            TaskFailure::new(Kind::Application, format!("cannot store the result: {e}"))
        })?;
        Ok(pb::ReturnObject {
            object_id: id.to_string(),
            data: Some(pb::return_object::Data::Location(pb::ObjectLocation {
                node_id: self.core.node_id.clone(),
                agent_address: self.core.agent_address.clone(),
                store_dir: self.core.store.dir().display().to_string(),
            })),
            size,
        })
    }

    fn stream(
        &self,
        spec: &pb::TaskSpec,
        items: Box<dyn Iterator<Item = Result<Vec<u8>, TaskFailure>> + Send>,
    ) -> pb::PushTaskReply {
        let core = &self.core;
        let mut owner = match core.worker_client(&spec.owner_address) {
            Ok(c) => c,
            Err(e) => return failure(spec, core, TaskFailure::application(e.to_string())),
        };
        let mut items = items;
        let mut index = 0u64;
        loop {
            if task_cancelled(&spec.task_id) {
                // CORE-12: a cancelled generator produces nothing more.
                let f = TaskFailure::new(Kind::Cancelled, "cancelled while it streamed");
                return failure(spec, core, f);
            }
            let next = std::panic::catch_unwind(AssertUnwindSafe(|| items.next()));
            let item = match next {
                Ok(Some(Ok(bytes))) => bytes,
                Ok(None) => break,
                Ok(Some(Err(f))) => return failure(spec, core, f),
                Err(p) => return failure(spec, core, TaskFailure::application(panic_message(p))),
            };
            let id = Core::streaming_item_id(&spec.task_id, index);
            let ret = match self.store_return(spec, &id, item) {
                Ok(r) => r,
                Err(f) => return failure(spec, core, f),
            };
            let req = pb::ReportGeneratorItemRequest {
                task_id: spec.task_id.clone(),
                index,
                item: Some(ret),
                finished: false,
                error: None,
                attempt: spec.attempt,
            };
            if let Err(s) = core.rt.block_on(owner.report_generator_item(req)) {
                return failure(
                    spec,
                    core,
                    TaskFailure::application(format!(
                        "the generator's owner is gone: {}",
                        s.message()
                    )),
                );
            }
            index += 1;
        }
        pb::PushTaskReply::default()
    }
}
