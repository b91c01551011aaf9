//! Multi-host TPU slice gangs (TPU.md "Multi-host slice gangs", DESIGN.md §7): processes on
//! every host of intact slices, all started together and stopped together.
//!
//! A gang runs in *generations*. [`GangGeneration::reserve`] reserves every host of
//! `num_slices` intact slices (a slice placement group named `gang:<name>:<generation>`),
//! claims a block of ports no other live gang holds, and decides every member's environment
//! once ([`tpuray_scheduler::gang::gang_members`]). Members run with `num_cpus=0` and the
//! host's chips (all of them, or one per-chip) in their bundle, as Ray 2.60's
//! `run_on_slice` runs them, and with that environment as their runtime environment.
//!
//! If a member or its host dies, [`run_on_slice`] and [`ActorGang`] remove the whole
//! reservation (which stops every member: agents kill the workers of a returned bundle) and,
//! while restarts remain, reserve a new generation — which can only land on intact slices —
//! and start every member again with `TPURAY_GANG_GENERATION` one higher. An error raised
//! by the member's own code stops the gang without a restart and is returned as it is.
//!
//! Ports: a gang's block is claimed in the head's KV (namespace [`PORTS_NAMESPACE`], one key
//! per 64-port block of [`PORT_RANGE`], value the claiming placement group's id) with
//! add-if-absent writes; a block whose group is gone is taken over, so a driver that died
//! without releasing leaks nothing for long.
//!
//! The reservation's slice group is named `gang:<name>:<gen>` (`tpuray status` draws it
//! on the slice's hosts). `start_task_gang` returns one *promise* ref per member (an
//! owned object the core settles later, `Core::promise/fulfil`) and supervises on a
//! thread: when a member or its host dies (worker died, actor died, object lost) it
//! cancels the rest, removes the reservation and starts the next generation; a member's
//! own error ends the gang and settles the unfinished promises with it. `run_on_slice`
//! (Rust, blocking) and `ActorGang` (one actor per member; `call_all` restarts the gang
//! and repeats the call) sit on it; Python's `run_on_slice` uses `start_task_gang`
//! through the binding, and `SliceActorGroup` supervises in Python over
//! `gang_reserve`/`gang_release`.

use std::collections::BTreeMap;
use std::time::Duration;

use serde::de::DeserializeOwned;
use tpuray_scheduler::gang::{GangHost, GangLayout, gang_members, ports_needed};
use tpuray_scheduler::{AcceleratorType, Topology};

pub use tpuray_scheduler::gang::{GangMember, GangMode};

use crate::core::core;
use crate::error::Error;
use crate::object_ref::ObjectRef;
use crate::object_ref::RawRef;
use crate::options::{ActorOptions, Scheduling, TaskOptions};
use crate::placement_group::{SlicePlacementGroup, slice_placement_group_named, state_of_id};

/// KV namespace of the gangs' port claims.
pub const PORTS_NAMESPACE: &str = "gang_ports";
/// Ports gangs are given: below Linux's ephemeral range (32768 and up), above the usual
/// service ports.
pub const PORT_RANGE: (u16, u16) = (10_000, 32_000);
const BLOCK: u32 = 64;
/// The label a TPU host carries saying how its chips were found: `accel`, `vfio` or
/// `simulated` (set by the node agent).
pub const DEVICES_LABEL: &str = "tpuray.io/tpu-devices";

/// What a gang runs on and how it recovers.
#[derive(Clone, Debug, PartialEq)]
pub struct GangOptions {
    /// Slice topology, e.g. `"4x4"`.
    pub topology: String,
    /// TPU version, e.g. `"v6e"`.
    pub accelerator_version: String,
    /// Slices working as one job (multislice: `MEGASCALE_*` is set when above 1).
    pub num_slices: u32,
    /// One process per host (default) or one per chip.
    pub mode: GangMode,
    /// Times the whole gang is started again after a member or host died.
    pub max_restarts: u32,
    /// Shown in `tpuray status` and in the placement group's name (`gang:<name>:<gen>`).
    pub name: String,
    /// How long one generation waits for its slices (hosts may still be registering).
    pub ready_timeout: Duration,
}

impl GangOptions {
    /// A one-slice, one-process-per-host gang with 3 restarts, waiting up to 10 minutes
    /// for its slice.
    pub fn new(topology: &str, accelerator_version: &str) -> Self {
        GangOptions {
            topology: topology.into(),
            accelerator_version: accelerator_version.into(),
            num_slices: 1,
            mode: GangMode::PerHost,
            max_restarts: 3,
            name: "gang".into(),
            ready_timeout: Duration::from_secs(600),
        }
    }
}

/// One generation of a gang: its reservation, hosts and members.
#[derive(Debug)]
pub struct GangGeneration {
    pub gang_id: String,
    /// 0 for the first start; one more per restart.
    pub number: u32,
    pub slice: SlicePlacementGroup,
    pub hosts: Vec<GangHost>,
    pub members: Vec<GangMember>,
    /// First port of the gang's block.
    pub base_port: u16,
    port_keys: Vec<String>,
    /// Whether releasing removes the slice group (false for an adopted one).
    owns_slice: bool,
}

impl GangGeneration {
    /// Reserves the slices, claims ports and decides every member's environment. Blocks until
    /// the slices are reserved.
    ///
    /// # Errors
    /// A bad topology or version (naming the valid ones); the slices not reserved within
    /// `ready_timeout` (naming why the group waits); no free port block.
    pub fn reserve(opts: &GangOptions, gang_id: &str, number: u32) -> Result<Self, Error> {
        let ty = AcceleratorType::from_topology(&opts.topology, &opts.accelerator_version)
            .map_err(|e| Error::Cluster(e.to_string()))?;
        let slice = slice_placement_group_named(
            &opts.topology,
            &opts.accelerator_version,
            None,
            opts.num_slices.max(1),
            &format!("gang:{}:{number}", opts.name),
        )?;
        let pg = slice.placement_group.clone();
        let waited = pg.wait(opts.ready_timeout);
        if !matches!(waited, Ok(true)) {
            let why =
                state_of_id(pg.id(), Duration::ZERO).map(|s| s.pending_reason).unwrap_or_default();
            let _ = slice.shutdown();
            waited?;
            return Err(Error::Cluster(format!(
                "gang {:?}: {} x{} was not reserved within {:?}: {why}",
                opts.name, ty, opts.num_slices, opts.ready_timeout
            )));
        }
        match Self::adopt(opts, slice.clone(), gang_id, number) {
            Ok(mut g) => {
                g.owns_slice = true;
                Ok(g)
            }
            Err(e) => {
                let _ = slice.shutdown();
                Err(e)
            }
        }
    }

    /// A generation in a slice group the caller reserved and keeps (Ray's
    /// `run_on_slice(..., tpu_slice=...)`): [`GangGeneration::release`] then leaves the group
    /// in place. Waits for the group as `reserve` does.
    ///
    /// # Errors
    /// As [`GangGeneration::reserve`].
    pub fn adopt(
        opts: &GangOptions,
        slice: SlicePlacementGroup,
        gang_id: &str,
        number: u32,
    ) -> Result<Self, Error> {
        let ty = AcceleratorType::from_topology(&opts.topology, &opts.accelerator_version)
            .map_err(|e| Error::Cluster(e.to_string()))?;
        let topology =
            Topology::parse(&opts.topology).map_err(|e| Error::Cluster(e.to_string()))?;
        let pg = slice.placement_group.clone();
        if !pg.wait(opts.ready_timeout)? {
            return Err(Error::Timeout(opts.ready_timeout, 1));
        }
        let result = (|| {
            let state = state_of_id(pg.id(), Duration::ZERO)?;
            let nodes = crate::driver::nodes()?;
            let hosts = state
                .bundle_nodes
                .iter()
                .map(|id| {
                    let n = nodes.iter().find(|n| &n.node_id == id).ok_or_else(|| {
                        Error::Cluster(format!("node {id} of the gang's slice is not known"))
                    })?;
                    let label = |k: &str| n.labels.get(&format!("tpuray.io/{k}")).cloned();
                    Ok(GangHost {
                        address: n.address.clone(),
                        slice_name: label("tpu-slice-name").unwrap_or_default(),
                        worker_id: label("tpu-worker-id").and_then(|w| w.parse().ok()).unwrap_or(0),
                        real_devices: n
                            .labels
                            .get(DEVICES_LABEL)
                            .is_some_and(|d| d == "accel" || d == "vfio"),
                    })
                })
                .collect::<Result<Vec<_>, Error>>()?;
            let needed = ports_needed(&ty, hosts.len(), opts.mode);
            let (base_port, port_keys) = claim_ports(needed, pg.id())?;
            let layout = GangLayout {
                gang_id: gang_id.to_string(),
                generation: number,
                accelerator_type: ty,
                topology,
                hosts: hosts.clone(),
                mode: opts.mode,
                base_port,
            };
            let members = match gang_members(&layout) {
                Ok(m) => m,
                Err(e) => {
                    release_ports(&port_keys);
                    return Err(Error::Cluster(format!("gang {:?}: {e}", opts.name)));
                }
            };
            Ok((hosts, members, base_port, port_keys))
        })();
        let (hosts, members, base_port, port_keys) = result?;
        Ok(GangGeneration {
            gang_id: gang_id.to_string(),
            number,
            slice,
            hosts,
            members,
            base_port,
            port_keys,
            owns_slice: false,
        })
    }

    /// The placement-group scheduling of `member`'s bundle, `num_cpus=0` and its chips
    /// (Ray 2.60's `run_on_slice` member options).
    pub fn scheduling(&self, member: &GangMember) -> (Scheduling, BTreeMap<String, f64>) {
        (
            Scheduling::PlacementGroup {
                placement_group_id: self.slice.placement_group.id().to_string(),
                bundle_index: i32::try_from(member.bundle_index).unwrap_or(i32::MAX),
            },
            BTreeMap::from([("TPU".to_string(), f64::from(member.chips))]),
        )
    }

    /// Task options for `member`: its bundle, chips, no CPU, no retries of its own (the gang
    /// restarts as a whole), and its environment as a runtime environment registered in the
    /// cluster's KV.
    ///
    /// # Errors
    /// The head cannot be reached.
    pub fn task_options(&self, member: &GangMember) -> Result<TaskOptions, Error> {
        let (scheduling, resources) = self.scheduling(member);
        Ok(TaskOptions {
            num_cpus: 0.0,
            resources,
            max_retries: 0,
            scheduling,
            runtime_env_hash: self.register_env(member, &BTreeMap::new())?,
            ..TaskOptions::default()
        })
    }

    /// Actor options for `member`, as [`GangGeneration::task_options`].
    ///
    /// # Errors
    /// The head cannot be reached.
    pub fn actor_options(&self, member: &GangMember) -> Result<ActorOptions, Error> {
        let (scheduling, resources) = self.scheduling(member);
        Ok(ActorOptions {
            num_cpus: Some(0.0),
            resources,
            scheduling,
            runtime_env_hash: self.register_env(member, &BTreeMap::new())?,
            ..ActorOptions::default()
        })
    }

    /// Registers `member`'s environment plus `extra` (a runtime environment's other fields,
    /// JSON) under a key unique to the gang, generation and member; returns the key.
    ///
    /// # Errors
    /// The head cannot be reached.
    pub fn register_env(
        &self,
        member: &GangMember,
        extra: &BTreeMap<String, serde_json::Value>,
    ) -> Result<String, Error> {
        let mut record: serde_json::Map<String, serde_json::Value> =
            extra.iter().map(|(k, v)| (k.clone(), v.clone())).collect();
        let mut vars: serde_json::Map<String, serde_json::Value> =
            record.get("env_vars").and_then(|v| v.as_object()).cloned().unwrap_or_default();
        for (k, v) in &member.env {
            vars.insert(k.clone(), serde_json::Value::String(v.clone()));
        }
        record.insert("env_vars".into(), serde_json::Value::Object(vars));
        let key = format!("gang-{}-{}-{}", self.gang_id, self.number, member.index);
        let value = serde_json::to_vec(&serde_json::Value::Object(record))
            .map_err(|e| Error::Cluster(e.to_string()))?;
        crate::raw::kv_put(crate::raw::RUNTIME_ENV_NAMESPACE, key.as_bytes(), value, true)?;
        Ok(key)
    }

    /// Stops every member (removing the reservation makes the agents kill their workers)
    /// and gives the ports and the member environments back.
    pub fn release(&self) {
        if self.owns_slice {
            let _ = self.slice.shutdown();
        }
        release_ports(&self.port_keys);
        for m in &self.members {
            let key = format!("gang-{}-{}-{}", self.gang_id, self.number, m.index);
            let _ = crate::raw::kv_delete(crate::raw::RUNTIME_ENV_NAMESPACE, key.as_bytes());
        }
    }
}

/// Whether `e` means a member or its host died (the gang restarts), rather than the
/// member's own code failing (the gang stops and the error is returned).
pub fn is_member_death(e: &Error) -> bool {
    matches!(
        e,
        Error::WorkerDied { .. }
            | Error::NodeDied { .. }
            | Error::ActorDied { .. }
            | Error::ActorUnavailable { .. }
            | Error::ObjectLost { .. }
    )
}

fn claim_ports(needed: u32, pg_id: &str) -> Result<(u16, Vec<String>), Error> {
    let blocks = needed.div_ceil(BLOCK);
    let (lo, hi) = (u32::from(PORT_RANGE.0), u32::from(PORT_RANGE.1));
    let total = (hi - lo) / BLOCK;
    let key = |b: u32| (lo + b * BLOCK).to_string();
    let mut start = 0;
    while start + blocks <= total {
        let mut claimed = Vec::new();
        let mut taken_at = None;
        for b in start..start + blocks {
            let k = key(b);
            let mut ok = crate::raw::kv_put(PORTS_NAMESPACE, k.as_bytes(), pg_id.into(), false)?;
            if !ok && holder_is_gone(&k) {
                let _ = crate::raw::kv_delete(PORTS_NAMESPACE, k.as_bytes());
                ok = crate::raw::kv_put(PORTS_NAMESPACE, k.as_bytes(), pg_id.into(), false)?;
            }
            if !ok {
                taken_at = Some(b);
                break;
            }
            claimed.push(k);
        }
        match taken_at {
            None => return Ok(((lo + start * BLOCK) as u16, claimed)),
            Some(b) => {
                release_ports(&claimed);
                start = b + 1;
            }
        }
    }
    Err(Error::Cluster(format!(
        "no free block of {needed} ports in {}..{} for the gang (every block is held by a live gang)",
        PORT_RANGE.0, PORT_RANGE.1
    )))
}

fn holder_is_gone(key: &str) -> bool {
    match crate::raw::kv_get(PORTS_NAMESPACE, key.as_bytes()) {
        Ok(Some(pg)) => {
            let pg = String::from_utf8_lossy(&pg).to_string();
            match state_of_id(&pg, Duration::ZERO) {
                Ok(s) => s.state == "REMOVED",
                // The head answers "no placement group with id ..." for one it never had
                // or has forgotten; any other failure (head unreachable) keeps the claim.
                Err(e) => e.to_string().contains("no placement group"),
            }
        }
        Ok(None) => true,
        Err(_) => false,
    }
}

fn release_ports(keys: &[String]) {
    for k in keys {
        let _ = crate::raw::kv_delete(PORTS_NAMESPACE, k.as_bytes());
    }
}

/// Waits for every ref; the first failure ends the wait (the others may still run).
fn gather<R: DeserializeOwned>(refs: &[ObjectRef<R>]) -> Result<Vec<R>, Error> {
    let mut pending: Vec<usize> = (0..refs.len()).collect();
    let mut out: Vec<Option<R>> = (0..refs.len()).map(|_| None).collect();
    while !pending.is_empty() {
        let waiting: Vec<ObjectRef<R>> = pending.iter().map(|&i| refs[i].clone()).collect();
        let (ready, _) = crate::wait(&waiting, 1, None)?;
        let ready_ids: Vec<&str> = ready.iter().map(|r| r.id()).collect();
        let mut still = Vec::new();
        for i in pending {
            if ready_ids.contains(&refs[i].id()) {
                out[i] = Some(crate::get(&refs[i])?);
            } else {
                still.push(i);
            }
        }
        pending = still;
    }
    Ok(out.into_iter().map(|v| v.expect("every member gathered")).collect())
}

/// Starts a task gang: reserves generation 0 (blocking until its slices are reserved),
/// launches one task per member with `launch`, and returns one ref per member at once (in
/// member order) that a supervisor thread settles: with each member's result when every
/// member succeeded; after a member or host died, by stopping the gang and starting a new
/// generation (while `max_restarts` remain); else with the failing member's error (members
/// that had already succeeded keep their values).
///
/// `launch` gets the generation and the member and submits the member's task with
/// [`GangGeneration::task_options`] (or options it builds from [`GangGeneration::scheduling`]
/// and the member's environment); it runs on the caller's thread for generation 0 and on the
/// supervisor's thread after restarts.
///
/// Values are copied into the returned refs, so refs nested inside a member's result are
/// not kept alive by them.
///
/// # Errors
/// As [`GangGeneration::reserve`]; the first error `launch` returns.
pub fn start_task_gang(
    opts: GangOptions,
    launch: impl Fn(&GangGeneration, &GangMember) -> Result<RawRef, Error> + Send + 'static,
) -> Result<Vec<RawRef>, Error> {
    let core = core()?;
    let gang_id = tpuray_proto::ids::TaskId::random().to_string();
    let first = GangGeneration::reserve(&opts, &gang_id, 0)?;
    let refs = match launch_members(&first, &launch) {
        Ok(r) => r,
        Err(e) => {
            first.release();
            return Err(e);
        }
    };
    let promises: Vec<RawRef> = first.members.iter().map(|_| core.promise()).collect();
    let settle = promises.clone();
    std::thread::Builder::new()
        .name(format!("tpuray-gang-{}", opts.name))
        .spawn(move || supervise(opts, gang_id, first, refs, settle, launch))
        .map_err(|e| Error::Cluster(format!("cannot start the gang's supervisor: {e}")))?;
    Ok(promises)
}

fn launch_members(
    g: &GangGeneration,
    launch: &impl Fn(&GangGeneration, &GangMember) -> Result<RawRef, Error>,
) -> Result<Vec<RawRef>, Error> {
    g.members.iter().map(|m| launch(g, m)).collect()
}

/// What became of one generation's members: the values of those that finished, and the
/// first failure (member index and error), if any.
struct Outcome {
    values: Vec<Option<Vec<u8>>>,
    failure: Option<(usize, Error)>,
}

/// Waits for every member's result; stops at the first failure.
fn outcomes(refs: &[RawRef]) -> Outcome {
    let mut out = Outcome { values: vec![None; refs.len()], failure: None };
    let core = match core() {
        Ok(c) => c,
        Err(e) => {
            out.failure = Some((0, e));
            return out;
        }
    };
    let mut pending: Vec<usize> = (0..refs.len()).collect();
    while !pending.is_empty() {
        let waiting: Vec<RawRef> = pending.iter().map(|&i| refs[i].clone()).collect();
        let ready = match crate::raw::wait(&waiting, 1, None) {
            Ok(r) => r,
            Err(e) => {
                out.failure = Some((pending[0], e));
                return out;
            }
        };
        let mut still = Vec::new();
        for (k, i) in pending.into_iter().enumerate() {
            if !ready[k] {
                still.push(i);
                continue;
            }
            match core.rt.block_on(core.get_data(&refs[i], None)) {
                Ok(data) => out.values[i] = Some(data.to_vec()),
                Err(e) => {
                    out.failure = Some((i, e));
                    return out;
                }
            }
        }
        pending = still;
    }
    out
}

fn supervise(
    opts: GangOptions,
    gang_id: String,
    mut g: GangGeneration,
    mut refs: Vec<RawRef>,
    promises: Vec<RawRef>,
    launch: impl Fn(&GangGeneration, &GangMember) -> Result<RawRef, Error>,
) {
    let Ok(core) = core() else { return };
    let fail_all = |message: String| {
        for p in &promises {
            core.fulfil_message(p.id(), &message, &opts.name);
        }
    };
    loop {
        let Outcome { values, failure } = outcomes(&refs);
        match failure {
            None => {
                g.release();
                for (p, v) in promises.iter().zip(values) {
                    core.fulfil(p.id(), Ok(v.unwrap_or_default()));
                }
                return;
            }
            Some((failed, e)) => {
                // Stop the members still running (removing an owned slice would too; an
                // adopted one stays, so cancel them here).
                for (r, v) in refs.iter().zip(&values) {
                    if v.is_none() {
                        let _ = core.rt.block_on(core.cancel(r.id(), r.owner(), true, false));
                    }
                }
                g.release();
                if is_member_death(&e) && g.number < opts.max_restarts {
                    tracing::warn!(gang = %opts.name, generation = g.number, "gang member {failed} died ({e}); restarting the gang");
                    let next = g.number + 1;
                    g = match GangGeneration::reserve(&opts, &gang_id, next) {
                        Ok(n) => n,
                        Err(e) => {
                            return fail_all(format!(
                                "gang {:?} lost a member and could not be reserved again: {e}",
                                opts.name
                            ));
                        }
                    };
                    refs = match launch_members(&g, &launch) {
                        Ok(r) => r,
                        Err(e) => {
                            g.release();
                            return fail_all(format!(
                                "gang {:?} could not start generation {next}: {e}",
                                opts.name
                            ));
                        }
                    };
                    continue;
                }
                for (p, v) in promises.iter().zip(values) {
                    core.fulfil(p.id(), v.ok_or_else(|| refs[failed].id().to_string()));
                }
                return;
            }
        }
    }
}

/// Runs one task per member of a gang on `opts`'s slices and gathers the results in member
/// order (Ray 2.60's `run_on_slice`, plus gang semantics; see [`start_task_gang`]).
/// `launch` submits the member's task with the options it is given, e.g.
/// `|_, o| train::options(o).remote(steps)`.
///
/// # Errors
/// As [`start_task_gang`]; a member's own error (no restart); the last member death once
/// `max_restarts` restarts are spent.
pub fn run_on_slice<R, F>(opts: &GangOptions, launch: F) -> Result<Vec<R>, Error>
where
    R: DeserializeOwned,
    F: Fn(&GangMember, TaskOptions) -> ObjectRef<R> + Send + 'static,
{
    let promises =
        start_task_gang(opts.clone(), move |g, m| Ok(launch(m, g.task_options(m)?).raw().clone()))?;
    let typed: Vec<ObjectRef<R>> = promises.into_iter().map(ObjectRef::from_raw).collect();
    crate::get_all(&typed)
}

type Create<H> = Box<dyn Fn(&GangMember, ActorOptions) -> Result<H, Error> + Send + Sync>;

/// One actor per gang member, created together and restarted together (the actor-group
/// form of a slice gang). `H` is the actor's handle type.
pub struct ActorGang<H> {
    opts: GangOptions,
    gang_id: String,
    create: Create<H>,
    current: Option<(GangGeneration, Vec<H>)>,
    restarts_used: u32,
}

impl<H> ActorGang<H> {
    /// Reserves the slices and creates one actor per member with `create` (called with the
    /// member and the options to create it with).
    ///
    /// # Errors
    /// As [`GangGeneration::reserve`]; the first constructor failure.
    pub fn new(
        opts: GangOptions,
        create: impl Fn(&GangMember, ActorOptions) -> Result<H, Error> + Send + Sync + 'static,
    ) -> Result<Self, Error> {
        let mut g = ActorGang {
            opts,
            gang_id: tpuray_proto::ids::TaskId::random().to_string(),
            create: Box::new(create),
            current: None,
            restarts_used: 0,
        };
        g.start(0)?;
        Ok(g)
    }

    fn start(&mut self, number: u32) -> Result<(), Error> {
        if let Some((old, _)) = self.current.take() {
            old.release();
        }
        let g = GangGeneration::reserve(&self.opts, &self.gang_id, number)?;
        let actors = g
            .members
            .iter()
            .map(|m| (self.create)(m, g.actor_options(m)?))
            .collect::<Result<Vec<_>, Error>>();
        match actors {
            Ok(a) => {
                self.current = Some((g, a));
                Ok(())
            }
            Err(e) => {
                g.release();
                Err(e)
            }
        }
    }

    /// The current generation (0 until the first restart).
    pub fn generation(&self) -> Option<&GangGeneration> {
        self.current.as_ref().map(|c| &c.0)
    }

    /// The members' actor handles, in member order.
    pub fn actors(&self) -> &[H] {
        self.current.as_ref().map(|c| c.1.as_slice()).unwrap_or(&[])
    }

    /// Calls `call` on every member's actor and gathers the results in member order. When a
    /// member died, the whole gang is restarted (while restarts remain) and the call made
    /// again on the new generation, so calls should be safe to repeat.
    ///
    /// # Errors
    /// A method's own error; a member death once restarts are spent; the gang shut down.
    pub fn call_all<R: DeserializeOwned>(
        &mut self,
        call: impl Fn(&H) -> ObjectRef<R>,
    ) -> Result<Vec<R>, Error> {
        loop {
            let Some((_, actors)) = &self.current else {
                return Err(Error::Cluster("the actor gang was shut down".into()));
            };
            let refs: Vec<_> = actors.iter().map(&call).collect();
            match gather(&refs) {
                Err(e) if is_member_death(&e) && self.restarts_used < self.opts.max_restarts => {
                    self.restarts_used += 1;
                    tracing::warn!(gang = %self.opts.name, "gang member died ({e}); restarting the gang");
                    let n = self.restarts_used;
                    self.start(n)?;
                }
                other => return other,
            }
        }
    }

    /// Stops every member and releases the slices.
    pub fn shutdown(&mut self) {
        if let Some((g, _)) = self.current.take() {
            g.release();
        }
    }
}

impl<H> Drop for ActorGang<H> {
    fn drop(&mut self) {
        self.shutdown();
    }
}
