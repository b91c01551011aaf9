//! Placement groups (Ray's `ray.util.placement_group`) and TPU slice groups (Ray 2.60's
//! `ray.util.tpu.slice_placement_group`).
//!
//! ```ignore
//! let pg = tpuray::placement_group(&[json!({"CPU": 1}), json!({"CPU": 1})], "STRICT_SPREAD")?;
//! assert!(pg.wait(Duration::from_secs(10))?);
//! let r = f::options(TaskOptions::default().scheduling(Scheduling::placement_group(&pg, 0)))
//!     .remote();
//! tpuray::remove_placement_group(&pg)?;
//! ```
//!
//! A group is reserved by the head all or nothing (two-phase with the node agents); work
//! scheduled into a bundle uses the resources the bundle reserved, and removing the group
//! stops what runs inside it.
//!
//! PG-1: an unnamed, non-detached group is created in the background: `placement_group`
//! checks the request here, picks the group's id and returns at once, and its
//! `CreatePlacementGroup` goes out on the runtime (so a loop creating groups sends them
//! together, and the head records them in a few log entries instead of one each). Every
//! later use of such a group by this process first waits until the head answered the
//! creation: `wait`/`state`/removal (which report a refused creation), the table, tasks
//! and actors scheduled into it, and any task or actor submitted meanwhile (its arguments
//! may carry the id to another process). Named groups (whose name may be taken) and
//! detached ones (which must outlive this process) are created before the call returns.
//!
//! PG-2: removing a group this process created in the background (PG-1) is in the
//! background too: `remove_placement_group` returns once the removal is queued, and the
//! `RemovePlacementGroup` goes out on the runtime (so a loop removing groups sends them
//! together, and the head makes them durable in a few log flushes). Every later use by this
//! process that could observe the group or what ran inside it first waits until every
//! removal queued so far is answered: `wait`/`state`/removal, the table,
//! `get_placement_group`, tasks and actors scheduled into any group, and any task or actor
//! submitted or actor called meanwhile (the same points PG-1 waits at), and `shutdown`
//! (Python calls it at exit; a Rust driver that ends without it may leave queued
//! removals unsent, as it leaves its last task events).
//! So work inside a removed group is stopped before a later call of this process runs,
//! as when the removal was synchronous. A removal the head refused (or could not be
//! sent) is reported by the next `wait`/`state`/removal/table call of this process (and
//! logged at shutdown). Removing a group this process does not know as its own (made
//! elsewhere, named, detached, or removed already) is synchronous, so an unknown id is
//! reported by the call itself; so is every removal in a worker process (the task's
//! caller may count on the group being gone when the task returns).
//!
//! PG-3: `wait` asks the head, in its own `GetPlacementGroup`, for the states of this
//! process's other background groups not yet seen CREATED or REMOVED (`more_ids`); the
//! next `wait` of a group seen CREATED that way within a second takes that state instead
//! of asking again (once). So waiting for a batch of groups is a few calls, not one each;
//! `state` and the table always ask the head.

use std::collections::{BTreeMap, HashMap, HashSet};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{LazyLock, Mutex};
use std::time::{Duration, Instant};

use tokio::sync::watch;
use tpuray_proto::pb;
use tpuray_scheduler::AcceleratorType;

use crate::core::core;
use crate::error::Error;

/// Creations of this process's groups (PG-1): group id -> the head's answer once known.
/// Answered successes are dropped; refusals stay, for later uses to report.
static CREATING: LazyLock<Mutex<HashMap<String, Creation>>> =
    LazyLock::new(|| Mutex::new(HashMap::new()));

/// The head's answer to one background creation, once it came.
type Creation = watch::Receiver<Option<Result<(), String>>>;
/// Creations not answered yet.
static CREATING_NOW: AtomicUsize = AtomicUsize::new(0);

/// Groups this process created in the background (PG-1) and has not removed: their
/// removal can go in the background too (PG-2).
static MINE: LazyLock<Mutex<HashSet<String>>> = LazyLock::new(|| Mutex::new(HashSet::new()));

/// PG-3: groups this process created in the background and has not seen settled
/// (CREATED or REMOVED) yet: a `wait` asks the head for their states too, in its call.
static UNSETTLED: LazyLock<Mutex<HashSet<String>>> = LazyLock::new(|| Mutex::new(HashSet::new()));

/// PG-3: CREATED states learned that way, and when; the next `wait` of such a group within
/// [`SEEN_FOR`] takes it instead of asking the head (once).
static SEEN: LazyLock<Mutex<HashMap<String, (PlacementGroupState, Instant)>>> =
    LazyLock::new(|| Mutex::new(HashMap::new()));

/// How long a state learned for a later `wait` stands in for asking the head (PG-3);
/// shorter than the head takes to notice a dead node (HEAD-4).
const SEEN_FOR: Duration = Duration::from_secs(1);

/// The most other groups one `wait` asks about (PG-3).
const MORE_IDS: usize = 256;

/// Background removals not answered yet (PG-2).
static REMOVING: LazyLock<watch::Sender<usize>> = LazyLock::new(|| watch::channel(0).0);

/// Background removals that failed, for the next use to report (PG-2).
static REMOVE_FAILED: Mutex<Vec<String>> = Mutex::new(Vec::new());

/// Forgets this process's groups (a driver's `shutdown`, after [`flush_removals`]): the
/// job that made them is over, and a later `init` starts with none (CORE-12).
pub(crate) fn forget_all() {
    CREATING.lock().unwrap().clear();
    MINE.lock().unwrap().clear();
    UNSETTLED.lock().unwrap().clear();
    SEEN.lock().unwrap().clear();
    REMOVE_FAILED.lock().unwrap().clear();
}

/// Waits until the head answered the creation of group `id` if this process created it
/// in the background (PG-1), and every removal queued so far (PG-2); the refusal's
/// message when the creation was refused.
pub(crate) async fn created(id: &str) -> Result<(), String> {
    all_removed().await;
    let rx = CREATING.lock().unwrap().get(id).cloned();
    let Some(mut rx) = rx else { return Ok(()) };
    match rx.wait_for(Option::is_some).await {
        Ok(v) => v.clone().unwrap_or(Ok(())),
        Err(_) => Ok(()),
    }
}

/// Whether some background creation (PG-1) or removal (PG-2) is not answered yet.
pub(crate) fn creating() -> bool {
    CREATING_NOW.load(Ordering::SeqCst) > 0 || *REMOVING.borrow() > 0
}

/// Waits until the head answered every background creation (PG-1) and removal (PG-2)
/// started so far.
pub(crate) async fn all_created() {
    all_removed().await;
    let pending: Vec<_> = CREATING.lock().unwrap().values().cloned().collect();
    for mut rx in pending {
        let _ = rx.wait_for(Option::is_some).await;
    }
}

/// Waits until every background removal queued so far is answered (PG-2).
pub(crate) async fn all_removed() {
    if *REMOVING.borrow() == 0 {
        return;
    }
    let mut rx = REMOVING.subscribe();
    let _ = rx.wait_for(|n| *n == 0).await;
}

/// [`all_removed`], then the failures of background removals not reported yet (PG-2).
async fn removals_settled() -> Result<(), Error> {
    all_removed().await;
    let failed = std::mem::take(&mut *REMOVE_FAILED.lock().unwrap());
    if failed.is_empty() { Ok(()) } else { Err(Error::Cluster(failed.join("; "))) }
}

/// Waits for the background removals at shutdown (PG-2); logs those that failed.
pub(crate) async fn flush_removals() {
    all_removed().await;
    for e in std::mem::take(&mut *REMOVE_FAILED.lock().unwrap()) {
        tracing::warn!("{e}");
    }
}

/// A placement group handle (cheap to clone; the group lives in the head).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct PlacementGroup {
    id: String,
    bundle_count: usize,
}

/// One bundle: resource name → amount, e.g. `{"CPU": 1, "TPU": 4}`.
pub type BundleSpec = BTreeMap<String, f64>;

/// Options of [`placement_group_with`] (Ray's `name`, `lifetime`, bundle label selectors).
#[derive(Clone, Debug, Default, PartialEq)]
pub struct PlacementGroupOptions {
    /// A name makes the group findable with [`get_placement_group`].
    pub name: Option<String>,
    pub namespace: Option<String>,
    /// Keep the group after its job ends (Ray's `lifetime="detached"`).
    pub detached: bool,
    /// One selector per bundle (Ray's `bundle_label_selector`), in Ray's syntax: `{"zone":
    /// "a"}`, `"!a"`, `"in(a,b)"`. Empty: no constraints.
    pub bundle_label_selector: Vec<BTreeMap<String, String>>,
}

/// A group's state as the head reports it (Ray's `placement_group_table` entry).
#[derive(Clone, Debug, PartialEq)]
pub struct PlacementGroupState {
    pub id: String,
    pub name: String,
    /// `PENDING`, `CREATED`, `RESCHEDULING` or `REMOVED`.
    pub state: String,
    pub strategy: String,
    pub bundles: Vec<BundleSpec>,
    /// The node id of each bundle ("" while not placed).
    pub bundle_nodes: Vec<String>,
    /// Why it waits, when it does.
    pub pending_reason: String,
}

impl PlacementGroup {
    /// The group's id (hex).
    pub fn id(&self) -> &str {
        &self.id
    }

    /// How many bundles the group has.
    pub fn bundle_count(&self) -> usize {
        self.bundle_count
    }

    /// Waits up to `timeout` for every bundle to be reserved (Ray's `pg.wait(timeout)`).
    /// Returns `Ok(false)` on timeout.
    ///
    /// # Errors
    /// The group was removed (the message says why), or the head cannot be reached.
    pub fn wait(&self, timeout: Duration) -> Result<bool, Error> {
        let deadline = Instant::now() + timeout;
        loop {
            let left = deadline.saturating_duration_since(Instant::now());
            let info = fetch(&self.id, left.min(Duration::from_secs(5)))?;
            if info.state == "CREATED" {
                return Ok(true);
            }
            if info.state == "REMOVED" {
                return Err(Error::Cluster(format!("placement group {} was removed", self.id)));
            }
            if Instant::now() >= deadline {
                return Ok(false);
            }
        }
    }

    /// Like [`PlacementGroup::wait`], but a timeout is an error naming why the group waits
    /// (Ray's `ray.get(pg.ready(), timeout=...)`).
    ///
    /// # Errors
    /// [`Error::Timeout`] after `timeout`; as [`PlacementGroup::wait`] otherwise.
    pub fn ready(&self, timeout: Duration) -> Result<(), Error> {
        if self.wait(timeout)? { Ok(()) } else { Err(Error::Timeout(timeout, 1)) }
    }

    /// The group's current state.
    ///
    /// # Errors
    /// The head cannot be reached or no longer knows the group.
    pub fn state(&self) -> Result<PlacementGroupState, Error> {
        fetch(&self.id, Duration::ZERO)
    }
}

fn state_of(info: pb::PlacementGroupInfo) -> PlacementGroupState {
    let state = match pb::PlacementGroupState::try_from(info.state) {
        Ok(pb::PlacementGroupState::Created) => "CREATED",
        Ok(pb::PlacementGroupState::Removed) => "REMOVED",
        Ok(pb::PlacementGroupState::Rescheduling) => "RESCHEDULING",
        _ => "PENDING",
    };
    PlacementGroupState {
        id: info.placement_group_id,
        name: info.name,
        state: state.to_string(),
        strategy: info.strategy,
        bundles: info.bundles.into_iter().map(|b| b.resources.into_iter().collect()).collect(),
        bundle_nodes: info.bundle_node_ids,
        pending_reason: info.pending_reason,
    }
}

/// The state of group `id`, waiting up to `wait` for it to be created or removed.
///
/// # Errors
/// The head cannot be reached or does not know the group.
pub fn state_of_id(id: &str, wait: Duration) -> Result<PlacementGroupState, Error> {
    fetch(id, wait)
}

/// The state of group `id` from the head; a wait (`wait` above zero) first takes a CREATED
/// state learned in the last [`SEEN_FOR`], and asks about this process's other unsettled
/// groups in the same call (PG-3).
fn fetch(id: &str, wait: Duration) -> Result<PlacementGroupState, Error> {
    let core = core()?;
    core.rt.block_on(async {
        removals_settled().await?;
        created(id).await.map_err(Error::Cluster)?;
        let mut more_ids = Vec::new();
        if !wait.is_zero() {
            let seen = SEEN.lock().unwrap().remove(id);
            if let Some((st, at)) = seen
                && at.elapsed() < SEEN_FOR
            {
                return Ok(st);
            }
            let unsettled = UNSETTLED.lock().unwrap();
            more_ids.extend(unsettled.iter().filter(|x| *x != id).take(MORE_IDS).cloned());
        }
        let mut head = core.head_client()?;
        let reply = head
            .get_placement_group(pb::GetPlacementGroupRequest {
                placement_group_id: id.to_string(),
                wait_ready_ms: wait.as_millis() as u64,
                more_ids,
                ..Default::default()
            })
            .await
            .map_err(|s| Error::Cluster(s.message().to_string()))?
            .into_inner();
        let now = Instant::now();
        let mut unsettled = UNSETTLED.lock().unwrap();
        let mut seen = SEEN.lock().unwrap();
        for st in reply.more.into_iter().map(state_of) {
            if st.state == "CREATED" || st.state == "REMOVED" {
                unsettled.remove(&st.id);
            }
            if st.state == "CREATED" {
                seen.insert(st.id.clone(), (st, now));
            }
        }
        let st = state_of(reply.placement_group.unwrap_or_default());
        if st.state == "CREATED" || st.state == "REMOVED" {
            unsettled.remove(id);
        }
        Ok(st)
    })
}

/// Forgets what PG-3 learned about group `id` (it is being removed).
fn forget(id: &str) {
    UNSETTLED.lock().unwrap().remove(id);
    SEEN.lock().unwrap().remove(id);
}

fn create(mut req: pb::CreatePlacementGroupRequest) -> Result<PlacementGroup, Error> {
    let core = core()?;
    if req.name.is_empty() && !req.detached && req.slice.is_none() {
        // PG-1: in the background, with the head's checks made here first.
        check_request(&req)
            .map_err(|e| Error::Cluster(format!("creating placement group: {e}")))?;
        let id = tpuray_proto::ids::PlacementGroupId::random().to_string();
        req.placement_group_id = id.clone();
        let bundle_count = req.bundles.len();
        let (tx, rx) = watch::channel(None);
        CREATING.lock().unwrap().insert(id.clone(), rx);
        MINE.lock().unwrap().insert(id.clone());
        UNSETTLED.lock().unwrap().insert(id.clone());
        CREATING_NOW.fetch_add(1, Ordering::SeqCst);
        let head = core.head_client();
        let key = id.clone();
        core.rt.spawn(async move {
            let out = match head {
                Ok(mut h) => h
                    .create_placement_group(req)
                    .await
                    .map(|_| ())
                    .map_err(|s| format!("creating placement group: {}", s.message())),
                Err(e) => Err(format!("creating placement group: {e}")),
            };
            let ok = out.is_ok();
            let _ = tx.send(Some(out));
            if ok {
                CREATING.lock().unwrap().remove(&key);
            } else {
                UNSETTLED.lock().unwrap().remove(&key);
            }
            CREATING_NOW.fetch_sub(1, Ordering::SeqCst);
        });
        return Ok(PlacementGroup { id, bundle_count });
    }
    core.rt.block_on(async {
        let mut head = core.head_client()?;
        let info = head
            .create_placement_group(req)
            .await
            .map_err(|s| Error::Cluster(format!("creating placement group: {}", s.message())))?
            .into_inner()
            .placement_group
            .unwrap_or_default();
        Ok(PlacementGroup { id: info.placement_group_id, bundle_count: info.bundles.len() })
    })
}

/// The checks the head makes of an unnamed group's request (same messages), so that a
/// group created in the background (PG-1) is refused at the call as before.
fn check_request(req: &pb::CreatePlacementGroupRequest) -> Result<(), String> {
    tpuray_scheduler::PgStrategy::parse(&req.strategy)?;
    if req.bundles.is_empty() {
        return Err("a placement group needs at least one bundle (got an empty list)".into());
    }
    for (i, b) in req.bundles.iter().enumerate() {
        let demand = tpuray_proto::convert::resources_from_proto(&b.resources)
            .map_err(|e| format!("bundle {i}: {e}"))?;
        if demand.is_empty() {
            return Err(format!(
                "bundle {i} is empty (expected at least one resource with an amount above 0, e.g. {{\"CPU\": 1}})"
            ));
        }
        tpuray_proto::convert::labels_from_proto(&b.label_selector)
            .map_err(|e| format!("bundle {i}: {e}"))?;
    }
    Ok(())
}

fn bundle_to_proto(
    b: &BundleSpec,
    selector: Option<&BTreeMap<String, String>>,
) -> Result<pb::Bundle, Error> {
    let label_selector = match selector {
        Some(s) => tpuray_scheduler::parse_label_selector(s)
            .map_err(|e| Error::Cluster(format!("bundle_label_selector: {e}")))?,
        None => vec![],
    };
    Ok(pb::Bundle {
        resources: b.iter().map(|(k, v)| (k.clone(), *v)).collect(),
        label_selector: tpuray_proto::convert::labels_to_proto(&label_selector),
    })
}

/// Creates a placement group of `bundles` with `strategy` (`PACK`, `SPREAD`,
/// `STRICT_PACK`, `STRICT_SPREAD`; Ray's names). Returns at once; the group is reserved in
/// the background ([`PlacementGroup::wait`]).
///
/// # Errors
/// An empty list, an empty or negative bundle, an unknown strategy, a name already taken
/// in its namespace; each message names the problem.
pub fn placement_group(bundles: &[BundleSpec], strategy: &str) -> Result<PlacementGroup, Error> {
    placement_group_with(bundles, strategy, &PlacementGroupOptions::default())
}

/// [`placement_group`] with a name, namespace, lifetime or bundle label selectors.
///
/// # Errors
/// As [`placement_group`]; also a selector list whose length differs from the bundles'.
pub fn placement_group_with(
    bundles: &[BundleSpec],
    strategy: &str,
    opts: &PlacementGroupOptions,
) -> Result<PlacementGroup, Error> {
    let sel = &opts.bundle_label_selector;
    if !sel.is_empty() && sel.len() != bundles.len() {
        return Err(Error::Cluster(format!(
            "bundle_label_selector has {} entries but there are {} bundles (expected one per bundle)",
            sel.len(),
            bundles.len()
        )));
    }
    let core = core()?;
    let bundles = bundles
        .iter()
        .enumerate()
        .map(|(i, b)| bundle_to_proto(b, sel.get(i)))
        .collect::<Result<Vec<_>, _>>()?;
    create(pb::CreatePlacementGroupRequest {
        request_id: tpuray_proto::new_request_id(),
        job_id: core.job_id.clone(),
        name: opts.name.clone().unwrap_or_default(),
        namespace: opts.namespace.clone().unwrap_or_default(),
        bundles,
        strategy: strategy.to_string(),
        detached: opts.detached,
        slice: None,
        placement_group_id: String::new(),
    })
}

/// Removes a group: its bundles are given back and the tasks and actors running inside
/// are stopped (Ray's `remove_placement_group`). Removing twice is harmless.
///
/// # Errors
/// The head cannot be reached or does not know the group.
pub fn remove_placement_group(pg: &PlacementGroup) -> Result<(), Error> {
    remove_by_id(&pg.id)
}

/// [`remove_placement_group`] by group id.
///
/// # Errors
/// As [`remove_placement_group`].
pub fn remove_by_id(id: &str) -> Result<(), Error> {
    let core = core()?;
    let req = pb::RemovePlacementGroupRequest {
        request_id: tpuray_proto::new_request_id(),
        placement_group_id: id.to_string(),
    };
    // A worker's removal stays synchronous: its task's caller may rely on it when the
    // task returns.
    let mine = MINE.lock().unwrap().remove(id) && !crate::worker::is_worker_process();
    forget(id);
    if mine {
        // PG-2: the creation's answer first (a refusal is reported here, as before).
        let creating = CREATING.lock().unwrap().get(id).cloned();
        if let Some(mut rx) = creating
            && let Ok(v) = core.rt.block_on(rx.wait_for(Option::is_some))
        {
            v.clone().unwrap_or(Ok(())).map_err(Error::Cluster)?;
        }
        let head = core.head_client();
        REMOVING.send_modify(|n| *n += 1);
        core.rt.spawn(async move {
            let id = req.placement_group_id.clone();
            let out = match head {
                Ok(mut h) => h
                    .remove_placement_group(req)
                    .await
                    .map(|_| ())
                    .map_err(|s| format!("removing placement group {id}: {}", s.message())),
                Err(e) => Err(format!("removing placement group {id}: {e}")),
            };
            if let Err(e) = out {
                REMOVE_FAILED.lock().unwrap().push(e);
            }
            REMOVING.send_modify(|n| *n -= 1);
        });
        return Ok(());
    }
    core.rt.block_on(async {
        removals_settled().await?;
        created(id).await.map_err(Error::Cluster)?;
        let mut head = core.head_client()?;
        head.remove_placement_group(req)
            .await
            .map_err(|s| Error::Cluster(s.message().to_string()))?;
        Ok(())
    })
}

/// The group named `name` in `namespace` (default "default"), unless removed.
///
/// # Errors
/// [`Error::Cluster`] naming the group when there is none.
pub fn get_placement_group(name: &str, namespace: Option<&str>) -> Result<PlacementGroup, Error> {
    let core = core()?;
    core.rt.block_on(async {
        removals_settled().await?;
        let mut head = core.head_client()?;
        let info = head
            .get_placement_group(pb::GetPlacementGroupRequest {
                name: name.to_string(),
                namespace: namespace.unwrap_or_default().to_string(),
                ..Default::default()
            })
            .await
            .map_err(|s| Error::Cluster(s.message().to_string()))?
            .into_inner()
            .placement_group
            .unwrap_or_default();
        Ok(PlacementGroup { id: info.placement_group_id, bundle_count: info.bundles.len() })
    })
}

/// Every group the head knows (Ray's `placement_group_table()`), removed ones included.
///
/// # Errors
/// The head cannot be reached.
pub fn placement_group_table() -> Result<Vec<PlacementGroupState>, Error> {
    let core = core()?;
    core.rt.block_on(async {
        removals_settled().await?;
        all_created().await;
        let mut head = core.head_client()?;
        let groups = head
            .list_placement_groups(pb::ListPlacementGroupsRequest {})
            .await
            .map_err(|s| Error::Cluster(s.message().to_string()))?
            .into_inner()
            .placement_groups;
        Ok(groups.into_iter().map(state_of).collect())
    })
}

/// Every host of `num_slices` intact TPU slices, reserved together (Ray 2.60's
/// `SlicePlacementGroup`). Bundle `i` is host `i`: slices in slice-name order, hosts in
/// `TPU_WORKER_ID` order (TPU.md); worker 0's bundle also holds the slice's
/// `TPU-<type>-head` resource, as Ray's `reserve_tpu_slice` does.
#[derive(Clone, Debug)]
pub struct SlicePlacementGroup {
    pub placement_group: PlacementGroup,
    pub accelerator_type: String,
    pub num_slices: u32,
    pub num_hosts: u32,
    pub chips_per_host: u32,
}

impl SlicePlacementGroup {
    /// The handle of slice group `id` (with `bundle_count` bundles) reserved elsewhere for
    /// `num_slices` slices of `topology` on `accelerator_version`.
    ///
    /// # Errors
    /// An unknown version or a topology not valid for it.
    pub fn from_id(
        id: &str,
        bundle_count: usize,
        topology: &str,
        accelerator_version: &str,
        num_slices: u32,
    ) -> Result<Self, Error> {
        let ty = AcceleratorType::from_topology(topology, accelerator_version)
            .map_err(|e| Error::Cluster(e.to_string()))?;
        Ok(SlicePlacementGroup {
            placement_group: PlacementGroup { id: id.to_string(), bundle_count },
            accelerator_type: ty.to_string(),
            num_slices,
            num_hosts: ty.hosts(),
            chips_per_host: ty.chips_per_host(),
        })
    }

    /// Releases every host of the slice(s), the head reservation included.
    ///
    /// # Errors
    /// As [`remove_placement_group`].
    pub fn shutdown(&self) -> Result<(), Error> {
        remove_placement_group(&self.placement_group)
    }
}

/// Reserves `num_slices` intact slices of `topology` (e.g. `"4x4"`) on
/// `accelerator_version` (e.g. `"v6e"`), each host's bundle `{"TPU": chips_per_host}` plus
/// `resources_per_bundle` when given (Ray 2.60's `slice_placement_group`). Returns at
/// once; call `.placement_group.wait(...)`.
///
/// # Errors
/// An unknown version, a topology not valid for it (naming the valid ones), zero slices.
pub fn slice_placement_group(
    topology: &str,
    accelerator_version: &str,
    resources_per_bundle: Option<&BundleSpec>,
    num_slices: u32,
) -> Result<SlicePlacementGroup, Error> {
    slice_placement_group_named(topology, accelerator_version, resources_per_bundle, num_slices, "")
}

/// [`slice_placement_group`] with a group name (shown by `tpuray status` and
/// `tpuray list placement-groups`; "" for none).
///
/// # Errors
/// As [`slice_placement_group`].
pub fn slice_placement_group_named(
    topology: &str,
    accelerator_version: &str,
    resources_per_bundle: Option<&BundleSpec>,
    num_slices: u32,
    name: &str,
) -> Result<SlicePlacementGroup, Error> {
    let ty = AcceleratorType::from_topology(topology, accelerator_version)
        .map_err(|e| Error::Cluster(e.to_string()))?;
    let chips_per_host = ty.chips_per_host();
    let bundle = match resources_per_bundle {
        Some(b) => b.clone(),
        None => BundleSpec::from([("TPU".to_string(), f64::from(chips_per_host))]),
    };
    let core = core()?;
    let pg = create(pb::CreatePlacementGroupRequest {
        request_id: tpuray_proto::new_request_id(),
        job_id: core.job_id.clone(),
        bundles: vec![bundle_to_proto(&bundle, None)?],
        name: name.to_string(),
        strategy: "STRICT_SPREAD".into(),
        slice: Some(pb::SliceSpec {
            accelerator_type: ty.to_string(),
            topology: topology.to_string(),
            num_slices,
        }),
        ..Default::default()
    })?;
    Ok(SlicePlacementGroup {
        num_hosts: pg.bundle_count as u32 / num_slices.max(1),
        placement_group: pg,
        accelerator_type: ty.to_string(),
        num_slices,
        chips_per_host,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn req(bundles: &[&[(&str, f64)]], strategy: &str) -> pb::CreatePlacementGroupRequest {
        pb::CreatePlacementGroupRequest {
            bundles: bundles
                .iter()
                .map(|b| pb::Bundle {
                    resources: b.iter().map(|(k, v)| (k.to_string(), *v)).collect(),
                    label_selector: vec![],
                })
                .collect(),
            strategy: strategy.into(),
            ..Default::default()
        }
    }

    /// PG-1: what the head would refuse is refused at the call, before a background
    /// creation could hide it.
    #[test]
    fn requests_the_head_would_refuse_are_refused_before_a_background_creation() {
        assert_eq!(check_request(&req(&[&[("CPU", 1.0)]], "STRICT_SPREAD")), Ok(()));
        let e = check_request(&req(&[&[("CPU", 1.0)]], "NOPE")).unwrap_err();
        assert!(e.contains("strategy \"NOPE\""), "{e}");
        let e = check_request(&req(&[], "PACK")).unwrap_err();
        assert!(e.contains("at least one bundle"), "{e}");
        let e = check_request(&req(&[&[("CPU", 1.0)], &[]], "PACK")).unwrap_err();
        assert!(e.starts_with("bundle 1 is empty"), "{e}");
        let e = check_request(&req(&[&[("CPU", -1.0)]], "PACK")).unwrap_err();
        assert!(e.starts_with("bundle 0: "), "{e}");
    }
}
