//! Submitting a task (CORE-3): its spec, its arguments resolved (by value or by
//! ref, pinned while it runs), its scheduling class, and its place in the class's
//! queue.
//!
//! In full:
//! - CORE-11: a task whose argument failed with a task error fails with that same
//!   error, its serialized exception included, and is not retried (Ray raises the
//!   upstream's exception class at `get`): on the owner's path (`Core::resolve_args`,
//!   before submitting) and the executor's (`executor::resolve_args`, a borrowed ref).

use super::*;

/// A submitted task, as its caller needs it.
pub(crate) struct Submitted {
    pub task_id: String,
    /// Its display name.
    pub name: String,
    /// The ids of its returns (none for a streaming task).
    pub return_ids: Vec<String>,
}

/// A by-value task argument and the refs nested inside it.
pub(super) fn value_arg(v: Vec<u8>, nested: &[RawRef]) -> pb::TaskArg {
    let nested = nested
        .iter()
        .map(|r| pb::ObjectRefMsg {
            object_id: r.id().to_string(),
            owner_address: r.owner().to_string(),
        })
        .collect();
    pb::TaskArg { kind: Some(pb::task_arg::Kind::Value(v)), nested }
}

/// The group a Rust task running on this thread captures what it submits into (Ray's
/// `placement_group_capture_child_tasks`). Other languages decide it themselves (Python
/// tells an explicit `"DEFAULT"` strategy from none, which the core cannot).
pub(super) fn captured_group() -> Option<String> {
    if crate::foreign::language() != "rust" {
        return None;
    }
    crate::executor::current_capture_group()
}

/// `opts` for a task submitted now by a Rust task whose group captures its children:
/// without a strategy of its own, it goes to that group (any bundle) and captures too.
pub(super) fn captured_options(opts: &TaskOptions) -> Option<TaskOptions> {
    if opts.scheduling != Scheduling::Default {
        return None;
    }
    let pg = captured_group()?;
    Some(TaskOptions {
        scheduling: Scheduling::PlacementGroup { placement_group_id: pg, bundle_index: -1 },
        capture_child_tasks: true,
        ..opts.clone()
    })
}

impl Core {
    /// Resolves arguments: owned inline values are copied in; everything
    /// else travels as a reference the executor resolves.
    /// The arguments as [`Core::resolve_args`] makes them, when that needs no waiting: every
    /// one is a value (refs only nested inside) and no placement group is being created.
    /// Hands `args` back otherwise.
    pub(super) fn resolve_args_now(
        args: Vec<Arg>,
    ) -> Result<(Vec<pb::TaskArg>, Vec<RawRef>), Vec<Arg>> {
        if crate::placement_group::creating() || args.iter().any(|a| matches!(a, Arg::Ref(_))) {
            return Err(args);
        }
        let mut out = Vec::with_capacity(args.len());
        let mut pins = Vec::new();
        for a in args {
            if let Arg::Value(v, nested) = a {
                out.push(value_arg(v, &nested));
                pins.extend(nested);
            }
        }
        Ok((out, pins))
    }

    pub(super) async fn resolve_args(
        &self,
        args: Vec<Arg>,
        function: &str,
    ) -> Result<(Vec<pb::TaskArg>, Vec<RawRef>), pb::TaskError> {
        if crate::placement_group::creating() {
            // PG-1: the arguments may name a group this process is still creating.
            crate::placement_group::all_created().await;
        }
        let mut out = Vec::with_capacity(args.len());
        let mut pins = Vec::new();
        for a in args {
            match a {
                Arg::Value(v, nested) => {
                    out.push(value_arg(v, &nested));
                    pins.extend(nested);
                }
                Arg::Ref(r) => {
                    if r.owner() == self.address {
                        // A stored value travels as a ref: the executor pulls it
                        // (this process never copies it in just to look).
                        match self.wait_owned(r.id(), "", None).await {
                            Ok(Ready::Inline(b)) => {
                                out.push(pb::TaskArg {
                                    kind: Some(pb::task_arg::Kind::Value(b.to_vec())),
                                    nested: vec![],
                                });
                                continue;
                            }
                            Ok(Ready::Stored(_)) => {}
                            // CORE-11: an argument that failed with a task error fails
                            // this task with that same error (Ray's: `get` raises the
                            // upstream's exception, its type included).
                            Err(crate::Error::Task {
                                function: upstream,
                                message,
                                node,
                                pid,
                                payload,
                            }) => {
                                return Err(pb::TaskError {
                                    kind: Kind::Application as i32,
                                    message,
                                    function_name: upstream,
                                    node_id: node,
                                    pid,
                                    payload,
                                    no_retry: true,
                                });
                            }
                            Err(e) => {
                                return Err(err(
                                    Kind::Application,
                                    format!("an argument failed: {e}"),
                                    function,
                                ));
                            }
                        }
                    }
                    out.push(pb::TaskArg {
                        kind: Some(pb::task_arg::Kind::ObjectRef(pb::ObjectRefMsg {
                            object_id: r.id().to_string(),
                            owner_address: r.owner().to_string(),
                        })),
                        nested: vec![],
                    });
                    pins.push(r);
                }
            }
        }
        Ok((out, pins))
    }

    pub(super) fn base_spec(
        &self,
        function: &str,
        name: Option<&str>,
        num_returns: u32,
        streaming: bool,
    ) -> pb::TaskSpec {
        let task_id = tpuray_proto::ids::TaskId::random().to_string();
        let return_ids = (0..num_returns as u64).map(|i| return_id(&task_id, i)).collect();
        pb::TaskSpec {
            task_id,
            job_id: self.job_id.clone(),
            function: Some(pb::FunctionDescriptor {
                language: crate::foreign::language().into(),
                name: function.into(),
                class_name: String::new(),
            }),
            num_returns,
            streaming,
            owner_address: self.address.clone(),
            caller_id: self.worker_id.clone(),
            name: name.unwrap_or(function).to_string(),
            return_ids,
            ..Default::default()
        }
    }

    /// The scheduling class of tasks submitted with `opts`: the queue and leases they
    /// share. The last options and their class are kept, so a caller submitting in a
    /// loop skips checking the options and building the class key.
    ///
    /// # Errors
    /// Bad options (resources, label selector, bundle index), naming the problem.
    pub(super) fn class_for(&self, opts: &TaskOptions) -> Result<Arc<Class>, Error> {
        if let Some((last, class)) = &*self.last_class.lock().unwrap()
            && last == opts
        {
            return Ok(Arc::clone(class));
        }
        let mut resources: HashMap<String, f64> =
            opts.resources.iter().map(|(k, v)| (k.clone(), *v)).collect();
        if opts.num_cpus > 0.0 {
            resources.insert("CPU".into(), opts.num_cpus);
        }
        if opts.num_gpus > 0.0 {
            resources.insert("GPU".into(), opts.num_gpus);
        }
        let plain = tpuray_proto::convert::resources_from_proto(&resources)
            .map_err(|e| Error::Cluster(format!("task options: {e}")))?;
        tpuray_scheduler::tpu::check_tpu_demand(&plain)
            .map_err(|e| Error::Cluster(format!("task options: {e}")))?;
        tpuray_scheduler::gpu::check_gpu_demand(&plain)
            .map_err(|e| Error::Cluster(format!("task options: {e}")))?;
        let pg = match &opts.scheduling {
            Scheduling::PlacementGroup { placement_group_id, bundle_index } => {
                if *bundle_index < -1 {
                    return Err(Error::Cluster(format!(
                        "bundle index {bundle_index} is invalid (expected -1 for any bundle, or 0 and up)"
                    )));
                }
                // SCHED-19: ask for the bundle's renamed resources.
                let demand = tpuray_scheduler::bundles::demand_in_bundle(
                    &plain,
                    placement_group_id,
                    u32::try_from(*bundle_index).ok(),
                );
                resources = tpuray_proto::convert::resources_to_proto(&demand);
                Some((placement_group_id.clone(), *bundle_index))
            }
            _ => None,
        };
        let labels = tpuray_scheduler::parse_label_selector(&opts.label_selector)
            .map_err(|e| Error::Cluster(format!("label_selector: {e}")))?;
        // Agents see work in a group as ordinary work needing the bundle's resources.
        let strategy = match &pg {
            Some(_) => Scheduling::Default.to_proto(),
            None => opts.scheduling.to_proto(),
        };
        let labels = tpuray_proto::convert::labels_to_proto(&labels);
        let mut key_res: Vec<_> = resources.iter().map(|(k, v)| format!("{k}={v}")).collect();
        key_res.sort();
        let key =
            format!("{}|{:?}|{:?}|{}", key_res.join(","), strategy, labels, opts.runtime_env_hash);
        let class = {
            let mut classes = self.classes.lock().unwrap();
            Arc::clone(classes.entry(key).or_insert_with(|| {
                Arc::new(Class {
                    resources,
                    strategy,
                    labels,
                    pg,
                    runtime_env_hash: opts.runtime_env_hash.clone(),
                    queue: Mutex::new(VecDeque::new()),
                    leases: AtomicUsize::new(0),
                    in_flight: AtomicUsize::new(0),
                    warned: AtomicBool::new(false),
                    queued: Notify::new(),
                    asking: AtomicUsize::new(0),
                    push_us: AtomicU64::new(u64::MAX),
                    shallow_until_ms: AtomicU64::new(0),
                    stalled: AtomicUsize::new(0),
                })
            }))
        };
        *self.last_class.lock().unwrap() = Some((opts.clone(), Arc::clone(&class)));
        Ok(class)
    }

    /// Registers a task or actor call being submitted: its returns as owned and pending,
    /// a streaming task's generator state, and its SUBMITTED event.
    pub(super) fn register_submitted(&self, spec: &pb::TaskSpec) {
        if let Some(parent) = crate::executor::current_task_id() {
            self.children.lock().unwrap().entry(parent).or_default().push(spec.task_id.clone());
        }
        for id in &spec.return_ids {
            self.register_owned(id, ObjState::Pending, Some(spec.task_id.clone()));
        }
        if spec.streaming {
            self.generators.lock().unwrap().insert(
                spec.task_id.clone(),
                GenState { items: vec![], finished: false, error: None },
            );
        }
        self.event(spec, "SUBMITTED", "");
    }

    /// Submits a task (CORE-3); returns its id, name and return ids.
    ///
    /// # Errors
    /// Bad options (resources, label selector, bundle index), naming the problem.
    pub(crate) fn submit(
        self: &Arc<Self>,
        function: &str,
        args: Vec<Arg>,
        opts: &TaskOptions,
        streaming: bool,
    ) -> Result<Submitted, Error> {
        let captured = captured_options(opts);
        let opts = captured.as_ref().unwrap_or(opts);
        let class = self.class_for(opts)?;
        let mut spec = self.base_spec(
            function,
            opts.name.as_deref(),
            if streaming { 0 } else { opts.num_returns },
            streaming,
        );
        spec.resources = class.resources.clone();
        spec.max_calls = opts.max_calls;
        spec.capture_child_tasks = opts.capture_child_tasks;
        self.register_submitted(&spec);
        let core = Arc::clone(self);
        let retries = opts.max_retries;
        let retry_exceptions = opts.retry_exceptions;
        let out = Submitted {
            task_id: spec.task_id.clone(),
            name: spec.name.clone(),
            return_ids: spec.return_ids.clone(),
        };
        let enqueue = move |core: &Arc<Core>, mut spec: pb::TaskSpec, args, pins| {
            spec.args = args;
            class.queue.lock().unwrap().push_back(Queued {
                spec,
                retries_left: retries,
                retry_exceptions,
                pins,
            });
            class.queued.notify_one();
            core.ensure_leases(&class);
        };
        match Self::resolve_args_now(args) {
            Ok((args, pins)) => enqueue(&core, spec, args, pins),
            Err(args) => {
                self.rt.spawn(async move {
                    let function = spec.name.clone();
                    match core.resolve_args(args, &function).await {
                        Ok((args, pins)) => enqueue(&core, spec, args, pins),
                        Err(e) => core.finish_failed(&spec, e),
                    }
                });
            }
        }
        Ok(out)
    }
}
