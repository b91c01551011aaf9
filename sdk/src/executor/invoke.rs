//! Calling a task's function or an actor's method: its arguments resolved (inline, or
//! fetched, CORE-11), then run by this binary's registry or by the foreign runtime of
//! its language, a panic caught as the task's failure.
//!
//! PY-1: the executor hands every task whose descriptor names `python` to the Python
//! runtime (a `tpuray::foreign::ForeignRuntime` that `python -m tpuray._worker`
//! installs), with arguments already resolved to bytes; results come back one value per
//! return object. A Python worker runs the same `worker::run_worker` loop as a Rust
//! worker.

use std::panic::AssertUnwindSafe;
use std::sync::Arc;

use tpuray_proto::pb;
use tpuray_proto::pb::task_error::Kind;

use super::Executor;
use crate::codec::Encoded;
use crate::core::Core;
use crate::error::TaskFailure;
use crate::foreign::ForeignRuntime;
use crate::object_ref::RawRef;
use crate::registry;

/// The foreign runtime that runs `spec`, when its language is not Rust (PY-1: every task
/// whose descriptor names `python` goes to the Python runtime).
pub(super) fn foreign_of(spec: &pb::TaskSpec) -> Option<&'static dyn ForeignRuntime> {
    let lang = spec.function.as_ref().map(|f| f.language.as_str()).unwrap_or("rust");
    if lang == "rust" || lang.is_empty() { None } else { crate::foreign::runtime_for(lang) }
}

/// A request's resources by plain name (Ray's `parse_pg_formatted_resources_to_original`:
/// a bundle's indexed and wildcard names both stand for the plain one), sorted.
fn assigned_resources(request: &std::collections::HashMap<String, f64>) -> Vec<(String, f64)> {
    let mut out = std::collections::BTreeMap::new();
    for (k, v) in request {
        let plain = tpuray_scheduler::bundles::parse_bundle_resource(k).map_or(k.as_str(), |b| b.0);
        // `bundle_group_<pg>` is the group's own marker (Ray has one too), no resource
        // of the task's.
        if *v <= 0.0 || (plain == tpuray_scheduler::bundles::BUNDLE_MARKER && plain != k) {
            continue;
        }
        out.insert(plain.to_string(), *v);
    }
    out.into_iter().collect()
}

pub(super) fn task_info(spec: &pb::TaskSpec) -> crate::foreign::TaskInfo {
    let f = spec.function.clone().unwrap_or_default();
    crate::foreign::TaskInfo {
        task_id: spec.task_id.clone(),
        job_id: spec.job_id.clone(),
        function: f.name,
        class_name: f.class_name,
        name: spec.name.clone(),
        actor_id: spec.actor_id.clone(),
        attempt: spec.attempt,
        num_returns: spec.num_returns,
        streaming: spec.streaming,
        capture_child_tasks: spec.capture_child_tasks,
        placement_group_id: if spec.placement_group_id.is_empty() {
            spec.resources
                .keys()
                .find_map(|k| {
                    tpuray_scheduler::bundles::parse_bundle_resource(k).map(|(_, _, pg)| pg)
                })
                .unwrap_or_default()
                .to_string()
        } else {
            spec.placement_group_id.clone()
        },
        resources: assigned_resources(&spec.resources),
    }
}

pub(super) fn panic_message(p: Box<dyn std::any::Any + Send>) -> String {
    if let Some(s) = p.downcast_ref::<&str>() {
        format!("panicked: {s}")
    } else if let Some(s) = p.downcast_ref::<String>() {
        format!("panicked: {s}")
    } else {
        "panicked".to_string()
    }
}

impl Executor {
    pub(super) fn invoke(&self, spec: &pb::TaskSpec) -> Result<Encoded, TaskFailure> {
        let args = resolve_args(&self.core, spec)?;
        let f = spec.function.clone().unwrap_or_default();
        if let Some(rt) = foreign_of(spec) {
            let info = task_info(spec);
            if spec.streaming {
                let r = std::panic::catch_unwind(AssertUnwindSafe(|| rt.start_stream(&info, args)));
                return r
                    .map_err(|p| TaskFailure::application(panic_message(p)))?
                    .map(Encoded::Stream);
            }
            let r = std::panic::catch_unwind(AssertUnwindSafe(|| {
                if spec.actor_id.is_empty() {
                    rt.run_task(&info, args)
                } else {
                    rt.call_method(&info, args)
                }
            }));
            return r
                .map_err(|p| TaskFailure::application(panic_message(p)))?
                .map(Encoded::Foreign);
        }
        let result = if spec.actor_id.is_empty() {
            let invoke = registry::function(&f.name).ok_or_else(|| {
                TaskFailure::new(
                    Kind::FunctionNotFound,
                    format!(
                        "function {} is not registered in this worker's binary {:?}; is it marked #[tpuray::remote] in the driver's program?",
                        f.name,
                        std::env::current_exe().unwrap_or_default()
                    ),
                )
            })?;
            std::panic::catch_unwind(AssertUnwindSafe(|| invoke(&args)))
        } else {
            let actor = self
                .actor
                .as_ref()
                .ok_or_else(|| TaskFailure::new(Kind::ActorDied, "no actor here"))?;
            let class = actor.class.ok_or_else(|| {
                TaskFailure::new(Kind::FunctionNotFound, "this actor's language runtime is gone")
            })?;
            let method = class.method(&f.name).ok_or_else(|| {
                TaskFailure::new(
                    Kind::FunctionNotFound,
                    format!("actor class {} has no method {}", class.name, f.name),
                )
            })?;
            let mut state = actor.state.lock().unwrap_or_else(|p| p.into_inner());
            std::panic::catch_unwind(AssertUnwindSafe(|| method(&mut **state, &args)))
        };
        result.map_err(|p| TaskFailure::application(panic_message(p)))?
    }
}

/// Each argument's bytes: inline values as they are, refs fetched (from the
/// owner, this node's store, or another node).
pub(super) fn resolve_args(
    core: &Arc<Core>,
    spec: &pb::TaskSpec,
) -> Result<Vec<Vec<u8>>, TaskFailure> {
    spec.args
        .iter()
        .enumerate()
        .map(|(i, a)| match &a.kind {
            Some(pb::task_arg::Kind::Value(v)) => Ok(v.clone()),
            Some(pb::task_arg::Kind::ObjectRef(r)) => {
                // Pinned by the submitter while the task runs.
                let raw = RawRef::uncounted(r.object_id.clone(), r.owner_address.clone());
                core.rt.block_on(core.get_data(&raw, None)).map(|d| d.to_vec()).map_err(|e| {
                    let message = format!("argument {i} ({}) failed: {e}", r.object_id);
                    match e {
                        // CORE-11: the upstream's exception travels on (Ray raises it
                        // at `get`), and running this task again cannot change it.
                        crate::Error::Task { payload, .. } if !payload.is_empty() => TaskFailure {
                            no_retry: true,
                            ..TaskFailure::with_payload(message, payload)
                        },
                        _ => TaskFailure::new(Kind::Application, message),
                    }
                })
            }
            None => Err(TaskFailure::bad_arguments(format!("argument {i} is empty"))),
        })
        .collect()
}
