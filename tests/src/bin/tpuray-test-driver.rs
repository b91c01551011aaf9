//! `tpuray-test-driver SCENARIO HEAD_ADDR [ARGS...]`: the job binary of the
//! failure-path tests (`tests/core.rs`). Node agents start this same binary
//! as the job's workers, so every remote function and actor lives here.
//!
//! Output is line-oriented for the tests to parse: `READY`, `INFO key=value`,
//! `RESULT ...`, `ERROR kind=<variant> ms=<elapsed> msg=<message>`. It exits
//! 0 when the scenario ran to its end (an expected error is not a failure;
//! the test judges the printed lines), non-zero on anything unexpected.

use std::io::Write;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use anyhow::{Context, bail};
use tpuray::{ActorOptions, Error, Scheduling, TaskOptions};

/// Writes `pid node_id` to `path` atomically (temp file, then rename).
fn write_pid_file(path: &str) {
    let tmp = format!("{path}.tmp{}", std::process::id());
    let body = format!("{} {}\n", std::process::id(), tpuray::node_id().unwrap_or_default());
    std::fs::write(&tmp, body).expect("write pid file");
    std::fs::rename(&tmp, path).expect("rename pid file");
}

#[tpuray::remote]
fn add(a: i64, b: i64) -> i64 {
    a + b
}

/// Records its pid (and node) in `pid_file`, sleeps `ms`, returns `value`.
#[tpuray::remote]
fn pid_then_sleep(pid_file: String, ms: u64, value: i64) -> i64 {
    write_pid_file(&pid_file);
    std::thread::sleep(Duration::from_millis(ms));
    value
}

/// Records its pid (and node) in `pid_file`, then spins until it is cancelled
/// (CORE-12's cooperative form, `tpuray::is_cancelled`), at most 60 s.
#[tpuray::remote]
fn spin_until_cancelled(pid_file: String) -> String {
    write_pid_file(&pid_file);
    let deadline = Instant::now() + Duration::from_secs(60);
    while Instant::now() < deadline {
        if tpuray::is_cancelled() {
            return "saw the cancel".into();
        }
        std::thread::sleep(Duration::from_millis(10));
    }
    "never cancelled".into()
}

/// Records its pid (and node) in `pid_file`; the first attempt (no pid file yet) then
/// sleeps `ms`, a retry returns at once. Returns `value`.
#[tpuray::remote]
fn slow_first_attempt(pid_file: String, ms: u64, value: i64) -> i64 {
    let first = !Path::new(&pid_file).exists();
    write_pid_file(&pid_file);
    if first {
        std::thread::sleep(Duration::from_millis(ms));
    }
    value
}

#[tpuray::remote]
fn fail_with(code: i64) -> Result<i64, String> {
    Err(format!("boom {code}"))
}

/// Puts an object in this worker and returns only a ref to it.
#[tpuray::remote]
fn make_ref(bytes: usize) -> Result<tpuray::ObjectRef<tpuray::Blob>, String> {
    tpuray::put(&tpuray::Blob(vec![3u8; bytes])).map_err(|e| e.to_string())
}

/// Puts `n` objects (0..n) in this worker and returns refs to them.
#[tpuray::remote]
fn make_refs(n: u64) -> Result<Vec<tpuray::ObjectRef<u64>>, String> {
    (0..n).map(|i| tpuray::put(&i).map_err(|e| e.to_string())).collect()
}

/// Fails until it has been attempted `fail_times` times (counted in a file).
#[tpuray::remote]
fn flaky(counter_file: String, fail_times: u32) -> Result<u32, String> {
    let n = std::fs::read_to_string(&counter_file)
        .ok()
        .and_then(|s| s.trim().parse::<u32>().ok())
        .unwrap_or(0)
        + 1;
    std::fs::write(&counter_file, n.to_string()).map_err(|e| e.to_string())?;
    if n <= fail_times { Err(format!("flaky failure {n}")) } else { Ok(n) }
}

/// The total length of six byte vectors (each small enough to travel inline).
#[tpuray::remote]
fn six_lengths(a: Vec<u8>, b: Vec<u8>, c: Vec<u8>, d: Vec<u8>, e: Vec<u8>, f: Vec<u8>) -> u64 {
    [a, b, c, d, e, f].iter().map(|v| v.len() as u64).sum()
}

#[tpuray::remote]
fn sleep_ms(ms: u64) -> u64 {
    std::thread::sleep(Duration::from_millis(ms));
    ms
}

#[tpuray::remote]
fn where_am_i() -> String {
    tpuray::node_id().unwrap_or_default()
}

/// An actor that keeps refs handed to it (it borrows them, CORE-2).
#[derive(Default)]
pub struct Keeper {
    kept: Vec<tpuray::ObjectRef<tpuray::Blob>>,
}

#[tpuray::actor]
impl Keeper {
    pub fn new() -> Self {
        Keeper::default()
    }
    pub fn keep(&mut self, refs: Vec<tpuray::ObjectRef<tpuray::Blob>>) -> usize {
        self.kept.extend(refs);
        self.kept.len()
    }
    /// Total bytes of every kept object, fetched now.
    pub fn total_bytes(&self) -> Result<usize, String> {
        let blobs = tpuray::get_all(&self.kept).map_err(|e| e.to_string())?;
        Ok(blobs.iter().map(|b| b.0.len()).sum())
    }
}

#[derive(Default)]
pub struct Journal {
    entries: Vec<u64>,
}

#[tpuray::actor]
impl Journal {
    pub fn new() -> Self {
        Journal::default()
    }
    pub fn append(&mut self, x: u64) -> usize {
        self.entries.push(x);
        self.entries.len()
    }
    pub fn entries(&self) -> Vec<u64> {
        self.entries.clone()
    }
    /// (node id, pid) of the process hosting the actor.
    pub fn whereabouts(&self) -> (String, u32) {
        (tpuray::node_id().unwrap_or_default(), std::process::id())
    }
}

/// The placement group this task runs in ("" for none).
#[tpuray::remote]
fn my_group() -> String {
    tpuray::current_placement_group_id().unwrap_or_default()
}

/// (its own group, its child's, its grandchild's): children are submitted with no
/// strategy, so they run in the group only when it captures them.
#[tpuray::remote]
fn family_groups() -> Result<(String, String, String), String> {
    let e = |e: tpuray::Error| e.to_string();
    let own = tpuray::current_placement_group_id().unwrap_or_default();
    let opts = TaskOptions::default().num_cpus(0.0);
    let child = tpuray::get(&my_group::options(opts.clone()).remote()).map_err(e)?;
    let grandchild = tpuray::get(&child_group::options(opts).remote()).map_err(e)?;
    Ok((own, child, grandchild))
}

/// Its child's group (the grandchild of [`family_groups`]).
#[tpuray::remote]
fn child_group() -> Result<String, String> {
    let opts = TaskOptions::default().num_cpus(0.0);
    tpuray::get(&my_group::options(opts).remote()).map_err(|e| e.to_string())
}

/// Waits for files to appear (CORE-13's test: calls that stay unfinished).
#[derive(Default)]
pub struct Waiter;

#[tpuray::actor]
impl Waiter {
    pub fn new() -> Self {
        Waiter
    }
    /// Waits (at most 60 s) for `path`; returns whether it appeared.
    pub fn wait_file(&self, path: String) -> bool {
        wait_for_file(Path::new(&path), Duration::from_secs(60)).is_ok()
    }
    /// The name of the executor thread running this call (its concurrency group's).
    pub fn thread(&self) -> String {
        std::thread::current().name().unwrap_or_default().to_string()
    }
}

/// Holds refs posted by one process for another to take (CORE-9's test: a task
/// learns the ref of a task submitted after it).
#[derive(Default)]
pub struct Mailbox {
    refs: Vec<tpuray::ObjectRef<u64>>,
}

#[tpuray::actor]
impl Mailbox {
    pub fn new() -> Self {
        Mailbox::default()
    }
    pub fn post(&mut self, refs: Vec<tpuray::ObjectRef<u64>>) -> usize {
        self.refs.extend(refs);
        self.refs.len()
    }
    pub fn take(&mut self) -> Vec<tpuray::ObjectRef<u64>> {
        std::mem::take(&mut self.refs)
    }
}

/// `value`, or (with a mailbox name) the value of the ref posted there plus `value`:
/// waits in `get` for a task that may be queued behind this one on its worker.
#[tpuray::remote]
fn value_or_posted(value: u64, mailbox: String) -> Result<u64, String> {
    if mailbox.is_empty() {
        return Ok(value);
    }
    let e = |e: tpuray::Error| e.to_string();
    let m = MailboxHandle(tpuray::get_actor(&mailbox, None).map_err(e)?);
    loop {
        let refs = tpuray::get(&m.take()).map_err(e)?;
        if let Some(r) = refs.first() {
            return Ok(value + tpuray::get(r).map_err(e)?);
        }
        std::thread::sleep(Duration::from_millis(5));
    }
}

/// (node id, TPU_WORKER_ID, TPU_NAME) of the host running it.
#[tpuray::remote]
fn tpu_host() -> (String, String, String) {
    let env = |k: &str| std::env::var(k).unwrap_or_default();
    (tpuray::node_id().unwrap_or_default(), env("TPU_WORKER_ID"), env("TPU_NAME"))
}

/// Sleeps `ms`, then says which node it ran on.
#[tpuray::remote]
fn sleep_where(ms: u64) -> String {
    std::thread::sleep(Duration::from_millis(ms));
    tpuray::node_id().unwrap_or_default()
}

/// Runs `tpu_host` in every bundle of `pg` and prints one MEMBER line per bundle.
fn print_members(tag: &str, pg: &tpuray::PlacementGroup) -> anyhow::Result<Vec<String>> {
    let refs: Vec<_> = (0..pg.bundle_count())
        .map(|i| {
            let opts = TaskOptions::default()
                .num_cpus(0.0)
                .scheduling(Scheduling::placement_group(pg, i as i32));
            tpu_host::options(opts).remote()
        })
        .collect();
    let mut nodes = Vec::new();
    for (i, r) in refs.iter().enumerate() {
        let (node, worker, slice) = tpuray::get_timeout(r, Duration::from_secs(30))?;
        say(&format!("MEMBER pg={tag} bundle={i} node={node} worker={worker} slice={slice}"));
        nodes.push(node);
    }
    Ok(nodes)
}

/// A gang member: the gang and TPU variables it sees, plus `NODE` (its node) and `PPID`
/// (its node agent). With `hold_dir` set, generation 0 records `<dir>/<slice>-<worker>`
/// holding its agent's pid and then blocks, so the test can kill a host mid-run.
#[tpuray::remote]
fn gang_member(hold_dir: String) -> std::collections::BTreeMap<String, String> {
    let mut env: std::collections::BTreeMap<String, String> = std::env::vars()
        .filter(|(k, _)| {
            k.starts_with("TPU")
                || k.starts_with("TORCH_TPU")
                || k.starts_with("MEGASCALE")
                || k.starts_with("JAX_")
                || [
                    "NNODES",
                    "NODE_RANK",
                    "JOB_COMPLETION_INDEX",
                    "MASTER_ADDR",
                    "MASTER_PORT",
                    "WORLD_SIZE",
                    "RANK",
                    "LOCAL_RANK",
                    "CLOUD_TPU_TASK_ID",
                ]
                .contains(&k.as_str())
        })
        .filter(|(k, _)| !["TPURAY_WORKER_ID", "TPURAY_JOB_ID"].contains(&k.as_str()))
        .collect();
    env.insert("NODE".into(), tpuray::node_id().unwrap_or_default());
    let ppid = std::os::unix::process::parent_id();
    env.insert("PPID".into(), ppid.to_string());
    if !hold_dir.is_empty() && env.get("TPURAY_GANG_GENERATION").map(String::as_str) == Some("0") {
        let name = format!(
            "{}-{}",
            env.get("TPU_NAME").cloned().unwrap_or_default(),
            env.get("TPU_WORKER_ID").cloned().unwrap_or_default()
        );
        let path = format!("{hold_dir}/{name}");
        std::fs::write(format!("{path}.tmp"), ppid.to_string()).expect("write hold file");
        std::fs::rename(format!("{path}.tmp"), &path).expect("rename hold file");
        std::thread::sleep(Duration::from_secs(300));
    }
    env
}

/// An actor-gang member: reports the environment it was started with.
pub struct GangActor {
    env: std::collections::BTreeMap<String, String>,
}

#[tpuray::actor]
impl GangActor {
    #[allow(clippy::new_without_default)]
    pub fn new() -> Self {
        GangActor { env: gang_member_env() }
    }
    pub fn env(&self) -> std::collections::BTreeMap<String, String> {
        self.env.clone()
    }
}

fn gang_member_env() -> std::collections::BTreeMap<String, String> {
    ["TPU_WORKER_ID", "TPU_NAME", "TPURAY_GANG_GENERATION", "TPU_VISIBLE_CHIPS", "NODE_RANK"]
        .iter()
        .map(|k| (k.to_string(), std::env::var(k).unwrap_or_default()))
        .collect()
}

fn print_envs(tag: &str, members: &[std::collections::BTreeMap<String, String>]) {
    for m in members {
        say(&format!("{tag} {}", serde_json::to_string(m).expect("json")));
    }
}

/// The TPU.md variables a process holding chips sees.
fn chip_vars() -> String {
    let env = |k: &str| std::env::var(k).unwrap_or_else(|_| "-".into());
    format!(
        "chips={} port={} bounds={} process_bounds={}",
        env("TPU_VISIBLE_CHIPS"),
        env("TPU_MESH_CONTROLLER_PORT"),
        env("TPU_CHIPS_PER_PROCESS_BOUNDS"),
        env("TPU_PROCESS_BOUNDS")
    )
}

#[tpuray::remote]
fn chip_task() -> String {
    chip_vars()
}

/// An actor holding TPU chips for life.
#[derive(Default)]
pub struct ChipHolder;

#[tpuray::actor]
impl ChipHolder {
    pub fn new() -> Self {
        ChipHolder
    }
    pub fn vars(&self) -> String {
        chip_vars()
    }
}

fn kind(e: &Error) -> &'static str {
    match e {
        Error::Task { .. } => "Task",
        Error::WorkerDied { .. } => "WorkerDied",
        Error::NodeDied { .. } => "NodeDied",
        Error::ActorDied { .. } => "ActorDied",
        Error::ActorUnavailable { .. } => "ActorUnavailable",
        Error::Cancelled { .. } => "Cancelled",
        Error::Timeout(..) => "Timeout",
        Error::ObjectLost { .. } => "ObjectLost",
        Error::Decode(_) => "Decode",
        Error::Infeasible(_) => "Infeasible",
        Error::RuntimeEnvSetup { .. } => "RuntimeEnvSetup",
        Error::PendingCallsLimitExceeded { .. } => "PendingCallsLimitExceeded",
        Error::Cluster(_) => "Cluster",
    }
}

fn say(line: &str) {
    let mut out = std::io::stdout().lock();
    let _ = writeln!(out, "{line}");
    let _ = out.flush();
}

/// Cancels running task `r` (`force` or not), prints its `get` (`RESULT` or the error),
/// then runs another task and prints `AFTER 42 ms=...`: the worker or its replacement
/// still serves.
fn cancel_then_add<T>(r: &tpuray::ObjectRef<T>, force: bool) -> Result<(), Error>
where
    T: tpuray::serde::de::DeserializeOwned + std::fmt::Display,
{
    let t = Instant::now();
    tpuray::cancel(r, force)?;
    match tpuray::get_timeout(r, Duration::from_secs(30)) {
        Ok(v) => say(&format!("RESULT {v}")),
        Err(e) => print_error(&e, t),
    }
    let t = Instant::now();
    match tpuray::get_timeout(&add::remote(40, 2), Duration::from_secs(30)) {
        Ok(v) => say(&format!("AFTER {v} ms={}", t.elapsed().as_millis())),
        Err(e) => print_error(&e, t),
    }
    Ok(())
}

fn print_error(e: &Error, since: Instant) {
    let msg = e.to_string().replace('\n', " | ");
    say(&format!("ERROR kind={} ms={} msg={msg}", kind(e), since.elapsed().as_millis()));
}

/// Waits (at most `timeout`) for `path` to exist.
fn wait_for_file(path: &Path, timeout: Duration) -> anyhow::Result<()> {
    let deadline = Instant::now() + timeout;
    while !path.exists() {
        if Instant::now() > deadline {
            bail!("timed out after {timeout:?} waiting for {}", path.display());
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    Ok(())
}

fn arg(args: &[String], i: usize, what: &str) -> anyhow::Result<String> {
    args.get(i).cloned().with_context(|| format!("missing argument {i}: {what}"))
}

fn main() -> anyhow::Result<()> {
    let args: Vec<String> = std::env::args().collect();
    // In a worker process (started by a node agent) init never returns.
    if tpuray::worker::is_worker_process() {
        tpuray::init(None)?;
        unreachable!("init returns only in a driver");
    }
    let scenario = arg(&args, 1, "scenario")?;
    let addr = arg(&args, 2, "head address")?;
    tpuray::init(Some(&addr))?;
    say(&format!("INFO node={}", tpuray::node_id()?));
    let r = run(&scenario, &args[3..]);
    tpuray::shutdown();
    r
}

fn run(scenario: &str, args: &[String]) -> anyhow::Result<()> {
    match scenario {
        // A task whose worker the test SIGKILLs; get must still return 42.
        "retry" => {
            let pid_file = arg(args, 0, "pid file")?;
            let r = pid_then_sleep::remote(pid_file, 3000, 42);
            say("SUBMITTED");
            let t = Instant::now();
            match tpuray::get(&r) {
                Ok(v) => say(&format!("RESULT {v} ms={}", t.elapsed().as_millis())),
                Err(e) => print_error(&e, t),
            }
        }
        // A task that records its pid and node, then sleeps MS on its first attempt
        // (tests/k8s.rs drains its node meanwhile); get must still return 42.
        "sleep-task" => {
            let pid_file = arg(args, 0, "pid file")?;
            let ms: u64 = arg(args, 1, "milliseconds")?.parse()?;
            let r = slow_first_attempt::remote(pid_file, ms, 42);
            say("SUBMITTED");
            let t = Instant::now();
            match tpuray::get_timeout(&r, Duration::from_secs(90)) {
                Ok(v) => say(&format!("RESULT {v} ms={}", t.elapsed().as_millis())),
                Err(e) => print_error(&e, t),
            }
            // Stay (and keep owning the task) until the test says so.
            if let Some(go) = args.get(2) {
                wait_for_file(Path::new(go), Duration::from_secs(90))?;
            }
        }
        // An actor (max_restarts 1) and a long task on the actor's node; the
        // test kills that node's agent, then creates the go file.
        "node-death" => {
            let dir = PathBuf::from(arg(args, 0, "work dir")?);
            let j = Journal::options(ActorOptions { max_restarts: 1, ..Default::default() })
                .remote()?;
            let (node, pid) = tpuray::get(&j.whereabouts())?;
            say(&format!("ACTOR id={} node={node} pid={pid}", j.handle().actor_id));
            let pid_file = dir.join("task.pid");
            let opts = TaskOptions {
                scheduling: Scheduling::NodeAffinity { node_id: node.clone(), soft: true },
                ..Default::default()
            };
            let r = pid_then_sleep::options(opts).remote(pid_file.display().to_string(), 5000, 7);
            wait_for_file(&pid_file, Duration::from_secs(30))?;
            let task = std::fs::read_to_string(&pid_file)?;
            say(&format!("TASK {}", task.trim()));
            say("READY");
            wait_for_file(&dir.join("go"), Duration::from_secs(60))?;
            // The first call after the restart, then (if that one failed)
            // a second one: the test tells the two apart.
            for attempt in 1..=2 {
                let t = Instant::now();
                match tpuray::get_timeout(&j.whereabouts(), Duration::from_secs(30)) {
                    Ok((n, p)) => {
                        say(&format!("ACTOR_AGAIN attempt={attempt} node={n} pid={p}"));
                        break;
                    }
                    Err(e) => print_error(&e, t),
                }
            }
            let t = Instant::now();
            match tpuray::get_timeout(&r, Duration::from_secs(40)) {
                Ok(v) => say(&format!("RESULT {v} ms={}", t.elapsed().as_millis())),
                Err(e) => print_error(&e, t),
            }
            let task = std::fs::read_to_string(&pid_file)?;
            say(&format!("TASK_AFTER {}", task.trim()));
        }
        "fail" => {
            let t = Instant::now();
            match tpuray::get_timeout(&fail_with::remote(42), Duration::from_secs(30)) {
                Ok(v) => say(&format!("RESULT {v}")),
                Err(e) => print_error(&e, t),
            }
        }
        // A task needing a GPU on a cluster without one. With a go-file
        // argument, waits for it before exiting (so the test can look at
        // `tpuray status` while the task is still pending).
        "infeasible" => {
            let opts = TaskOptions { num_gpus: 1.0, ..Default::default() };
            let r = add::options(opts).remote(1, 2);
            say("SUBMITTED");
            let wait = if std::env::var_os("TPURAY_FAIL_ON_INFEASIBLE").is_some() {
                Duration::from_secs(30)
            } else {
                Duration::from_secs(2)
            };
            let t = Instant::now();
            match tpuray::get_timeout(&r, wait) {
                Ok(v) => say(&format!("RESULT {v}")),
                Err(e) => print_error(&e, t),
            }
            if let Some(go) = args.first() {
                wait_for_file(Path::new(go), Duration::from_secs(60))?;
            }
        }
        // Slice groups on two v6e-16 slices (tests/placement.rs): two groups
        // take both slices, a third waits until the go file, then the first is
        // removed and the third takes its slice; an actor and a task inside
        // groups die with them; CPU tasks avoid the TPU hosts.
        "slices" => {
            let go = arg(args, 0, "go file")?;
            let wait = Duration::from_secs(30);
            let s1 = tpuray::slice_placement_group("4x4", "v6e", None, 1)?;
            anyhow::ensure!(s1.placement_group.wait(wait)?, "first slice group not created");
            say(&format!(
                "PG1 id={} hosts={} chips={}",
                s1.placement_group.id(),
                s1.num_hosts,
                s1.chips_per_host
            ));
            let n1 = print_members("1", &s1.placement_group)?;
            let s2 = tpuray::slice_placement_group("4x4", "v6e", None, 1)?;
            anyhow::ensure!(s2.placement_group.wait(wait)?, "second slice group not created");
            say(&format!("PG2 id={}", s2.placement_group.id()));
            print_members("2", &s2.placement_group)?;
            let actor = Journal::options(ActorOptions {
                num_cpus: Some(0.0),
                scheduling: Scheduling::placement_group(&s2.placement_group, 1),
                ..Default::default()
            })
            .remote()?;
            let (node, _) = tpuray::get_timeout(&actor.whereabouts(), wait)?;
            say(&format!("ACTOR node={node}"));
            let s3 = tpuray::slice_placement_group("4x4", "v6e", None, 1)?;
            let created = s3.placement_group.wait(Duration::from_secs(2))?;
            say(&format!("PG3_PENDING id={} created={created}", s3.placement_group.id()));
            wait_for_file(Path::new(&go), Duration::from_secs(60))?;
            s1.shutdown()?;
            anyhow::ensure!(s3.placement_group.wait(wait)?, "third slice group not created");
            let n3 = print_members("3", &s3.placement_group)?;
            say(&format!("PG3 same_hosts_as_pg1={}", n1 == n3));
            // Removing a group stops what runs inside it.
            let long = sleep_where::options(
                TaskOptions::default()
                    .num_cpus(0.0)
                    .max_retries(0)
                    .scheduling(Scheduling::placement_group(&s3.placement_group, 0)),
            )
            .remote(60_000);
            std::thread::sleep(Duration::from_millis(1500));
            s3.shutdown()?;
            s2.shutdown()?;
            let t = Instant::now();
            match tpuray::get_timeout(&long, wait) {
                Ok(v) => say(&format!("TASK_AFTER_REMOVE ok={v}")),
                Err(e) => say(&format!(
                    "TASK_AFTER_REMOVE kind={} ms={}",
                    kind(&e),
                    t.elapsed().as_millis()
                )),
            }
            match tpuray::get_timeout(&actor.append(1), wait) {
                Ok(v) => say(&format!("ACTOR_AFTER_REMOVE ok={v}")),
                Err(e) => say(&format!("ACTOR_AFTER_REMOVE kind={}", kind(&e))),
            }
            // More bundles than nodes, strictly spread: infeasible, reported at once.
            let bundles =
                vec![tpuray::placement_group::BundleSpec::from([("CPU".into(), 1.0)]); 20];
            let big = tpuray::placement_group(&bundles, "STRICT_SPREAD")?;
            let created = big.wait(Duration::from_secs(1))?;
            let st = big.state()?;
            say(&format!("BIG created={created} state={} reason={}", st.state, st.pending_reason));
            tpuray::remove_placement_group(&big)?;
            let cpu: Vec<_> = (0..4).map(|_| sleep_where::remote(1500)).collect();
            let nodes = tpuray::get_all(&cpu)?;
            say(&format!("CPU nodes={}", nodes.join(",")));
        }
        // Chip blocks on one v6e-8 host (tests/placement.rs): eight one-chip
        // actors, then (once they are gone) a 4-chip task; a 3-chip request
        // is refused at submission.
        "chips" => {
            let wait = Duration::from_secs(30);
            let opts = ActorOptions {
                num_cpus: Some(0.0),
                resources: [("TPU".to_string(), 1.0)].into(),
                ..Default::default()
            };
            let holders: Vec<_> = (0..8)
                .map(|_| ChipHolder::options(opts.clone()).remote())
                .collect::<Result<_, _>>()?;
            for h in &holders {
                say(&format!("HOLDER {}", tpuray::get_timeout(&h.vars(), wait)?));
            }
            for h in &holders {
                tpuray::kill_actor(&h.handle().actor_id, true)?;
            }
            let four = TaskOptions::default().num_cpus(0.0).resource("TPU", 4.0);
            say(&format!(
                "FOUR {}",
                tpuray::get_timeout(&chip_task::options(four).remote(), wait)?
            ));
            let three = TaskOptions::default().num_cpus(0.0).resource("TPU", 3.0);
            match tpuray::get_timeout(&chip_task::options(three).remote(), wait) {
                Ok(v) => say(&format!("THREE ok {v}")),
                Err(e) => say(&format!("THREE kind={} msg={e}", kind(&e))),
            }
        }
        // Slice gangs through the Rust SDK: a per-host gang, a per-chip gang on the v6e-8
        // host, a two-slice gang, an actor gang, then (with a hold dir) a gang whose host the
        // test kills mid-run.
        "gang" => {
            use tpuray::gang::{ActorGang, GangMode, GangOptions, run_on_slice};
            let hold = args.first().cloned().unwrap_or_default();
            let mut opts = GangOptions::new("4x4", "v6e");
            opts.name = "envs".into();
            opts.ready_timeout = Duration::from_secs(60);
            let per_host =
                run_on_slice(&opts, |_, o| gang_member::options(o).remote(String::new()))?;
            print_envs("HOST", &per_host);
            let mut chip = GangOptions::new("2x4", "v6e");
            chip.mode = GangMode::PerChip;
            chip.ready_timeout = Duration::from_secs(60);
            let per_chip =
                run_on_slice(&chip, |_, o| gang_member::options(o).remote(String::new()))?;
            print_envs("CHIP", &per_chip);
            let mut multi = opts.clone();
            multi.num_slices = 2;
            let both = run_on_slice(&multi, |_, o| gang_member::options(o).remote(String::new()))?;
            print_envs("MULTI", &both);
            let mut actors = ActorGang::new(opts.clone(), |_, o| GangActor::options(o).remote())?;
            let envs = actors.call_all(|a| a.env())?;
            print_envs("ACTOR", &envs);
            actors.shutdown();
            match tpuray::gang::run_on_slice(&GangOptions::new("3x3", "v6e"), |_, o| {
                gang_member::options(o).remote(String::new())
            }) {
                Ok(_) => say("BADTOPO ok"),
                Err(e) => say(&format!("BADTOPO {e}")),
            }
            if !hold.is_empty() {
                let mut killed = opts.clone();
                killed.name = "survivor".into();
                let out = run_on_slice(&killed, move |_, o| {
                    gang_member::options(o).remote(hold.clone())
                })?;
                print_envs("SURVIVED", &out);
            }
        }
        "timeout" => {
            let r = sleep_ms::remote(10_000);
            let t = Instant::now();
            match tpuray::get_timeout(&r, Duration::from_millis(500)) {
                Ok(v) => say(&format!("RESULT {v}")),
                Err(e) => print_error(&e, t),
            }
        }
        // CORE-15: calls in order whichever way they leave (the first over gRPC while the
        // direct connection opens, then direct), pipelined and one at a time; then, once
        // the test has sent the worker bad direct-call input (`go` file), more calls.
        "direct" => {
            let go = arg(args, 0, "go file")?;
            let j = Journal::options(ActorOptions { num_cpus: Some(0.0), ..Default::default() })
                .remote()?;
            for x in 1..=20u64 {
                tpuray::get_timeout(&j.append(x), Duration::from_secs(30))?;
            }
            let refs: Vec<_> = (21..=100u64).map(|x| j.append(x)).collect();
            let lens = tpuray::get_all(&refs)?;
            anyhow::ensure!(lens == (21..=100usize).collect::<Vec<_>>(), "lengths {lens:?}");
            let entries = tpuray::get_timeout(&j.entries(), Duration::from_secs(30))?;
            anyhow::ensure!(entries == (1..=100u64).collect::<Vec<_>>(), "order {entries:?}");
            say(&format!("ACTOR {}", j.handle().actor_id));
            wait_for_file(Path::new(&go), Duration::from_secs(60))?;
            let refs: Vec<_> = (101..=150u64).map(|x| j.append(x)).collect();
            tpuray::get_all(&refs)?;
            let entries = tpuray::get_timeout(&j.entries(), Duration::from_secs(30))?;
            anyhow::ensure!(entries == (1..=150u64).collect::<Vec<_>>(), "order {entries:?}");
            say(&format!("AFTER {}", entries.len()));
            // Tasks, one at a time (direct once the lease's connection is open) and
            // pipelined (batches over gRPC).
            for ms in 0..30u64 {
                anyhow::ensure!(tpuray::get(&sleep_ms::remote(ms % 3))? == ms % 3);
            }
            let refs: Vec<_> = (0..200u64).map(|ms| sleep_ms::remote(ms % 2)).collect();
            let got = tpuray::get_all(&refs)?;
            anyhow::ensure!(got == (0..200u64).map(|ms| ms % 2).collect::<Vec<_>>(), "{got:?}");
            say("TASKS 230");
        }
        // Cancels a running task, then runs another.
        "cancel" => {
            let pid_file = arg(args, 0, "pid file")?;
            let r = pid_then_sleep::remote(pid_file.clone(), 60_000, 1);
            wait_for_file(Path::new(&pid_file), Duration::from_secs(30))?;
            let task = std::fs::read_to_string(&pid_file)?;
            say(&format!("TASK {}", task.trim()));
            cancel_then_add(&r, true)?;
        }
        // CORE-12 cooperative: cancel without force reaches a running Rust task, which
        // sees tpuray::is_cancelled(); its get fails with Cancelled; the worker lives.
        "cancel-cooperative" => {
            let pid_file = arg(args, 0, "pid file")?;
            let r = spin_until_cancelled::remote(pid_file.clone());
            wait_for_file(Path::new(&pid_file), Duration::from_secs(30))?;
            cancel_then_add(&r, false)?;
        }
        // placement_group_capture_child_tasks for Rust tasks.
        "capture" => {
            let bundles = vec![tpuray::placement_group::BundleSpec::from([("CPU".into(), 2.0)])];
            let pg = tpuray::placement_group(&bundles, "PACK")?;
            anyhow::ensure!(pg.wait(Duration::from_secs(60))?, "group not created");
            say(&format!("GROUP {}", pg.id()));
            for capture in [true, false] {
                let opts = TaskOptions {
                    scheduling: Scheduling::placement_group(&pg, 0),
                    capture_child_tasks: capture,
                    ..TaskOptions::default()
                };
                let (own, child, grandchild) = tpuray::get_timeout(
                    &family_groups::options(opts).remote(),
                    Duration::from_secs(60),
                )?;
                say(&format!(
                    "FAMILY capture={capture} own={own} child={child:?} grandchild={grandchild:?}"
                ));
            }
        }
        // CORE-13 and concurrency groups through the Rust actor API.
        "pending-calls" => {
            let go = arg(args, 0, "go file")?;
            let mut groups = std::collections::BTreeMap::new();
            groups.insert("io".to_string(), 2u32);
            let mut method_groups = std::collections::BTreeMap::new();
            method_groups.insert("wait_file".to_string(), "io".to_string());
            let w = Waiter::options(ActorOptions {
                num_cpus: Some(0.0),
                max_pending_calls: 2,
                concurrency_groups: groups.clone(),
                method_groups,
                ..Default::default()
            })
            .remote()?;
            let first = [w.wait_file(go.clone()), w.wait_file(go.clone())];
            say(&format!("PENDING {}", w.handle().pending_calls()));
            let t = Instant::now();
            match w.handle().try_call::<String>("thread", vec![], &tpuray::CallOptions::default()) {
                Ok(_) => say("THIRD accepted"),
                Err(e) => print_error(&e, t),
            }
            // The typed handle's call: a ref whose get gives the same error.
            match tpuray::get_timeout(&w.thread(), Duration::from_secs(30)) {
                Ok(v) => say(&format!("TYPED accepted {v}")),
                Err(e) => say(&format!("TYPED kind={}", kind(&e))),
            }
            std::fs::write(&go, b"go")?;
            let done = tpuray::get_all(&first)?;
            say(&format!("FIRST {done:?}"));
            say(&format!("THREAD {}", tpuray::get_timeout(&w.thread(), Duration::from_secs(30))?));
            let io = tpuray::CallOptions { concurrency_group: "io".into(), ..Default::default() };
            let r = w.handle().try_call::<String>("thread", vec![], &io)?;
            say(&format!("IO {}", tpuray::get_timeout(&r, Duration::from_secs(30))?));
            let bad =
                tpuray::CallOptions { concurrency_group: "nope".into(), ..Default::default() };
            let r = w.handle().try_call::<String>("thread", vec![], &bad)?;
            match tpuray::get_timeout(&r, Duration::from_secs(30)) {
                Ok(v) => say(&format!("UNDEFINED accepted {v}")),
                Err(e) => say(&format!("UNDEFINED kind={} msg={e}", kind(&e))),
            }
            let mut wrong = std::collections::BTreeMap::new();
            wrong.insert("thread".to_string(), "missing".to_string());
            let created = Waiter::options(ActorOptions {
                num_cpus: Some(0.0),
                concurrency_groups: groups,
                method_groups: wrong,
                ..Default::default()
            })
            .remote();
            match created {
                Ok(_) => say("BADGROUP accepted"),
                Err(e) => say(&format!("BADGROUP {e}")),
            }
        }
        // Waits for the go file (the test moves this binary meanwhile), then runs tasks.
        "moved" => {
            let go = arg(args, 0, "go file")?;
            say("READY");
            wait_for_file(Path::new(&go), Duration::from_secs(60))?;
            let t = Instant::now();
            let refs: Vec<_> = (0..4).map(|i| add::remote(i, 100)).collect();
            let sum: i64 = tpuray::get_all(&refs)?.iter().sum();
            let node = tpuray::get(&where_am_i::remote())?;
            say(&format!("RESULT {sum} node={node} ms={}", t.elapsed().as_millis()));
        }
        // CORE-9: quick tasks pipelined onto one worker while the node is full; one of
        // them waits for a task submitted after it (learned through an actor), which
        // is queued behind it on the same worker: the executor hands that one back
        // when the first blocks, so both finish.
        "pipeline-nested-get" => {
            let m = Mailbox::options(ActorOptions {
                name: Some("mailbox".into()),
                num_cpus: Some(0.0),
                ..Default::default()
            })
            .remote()?;
            let t = Instant::now();
            let warm: Vec<_> =
                (0..100).map(|i| value_or_posted::remote(i, String::new())).collect();
            tpuray::get_all(&warm)?;
            say(&format!("WARM ms={}", t.elapsed().as_millis()));
            let mut refs: Vec<_> =
                (0..100).map(|i| value_or_posted::remote(i, String::new())).collect();
            // Not retried: a second attempt would find the mailbox emptied by the first.
            let once = TaskOptions { max_retries: 0, ..Default::default() };
            let waiter = value_or_posted::options(once).remote(1000, "mailbox".to_string());
            let awaited = value_or_posted::remote(7, String::new());
            refs.extend((0..100).map(|i| value_or_posted::remote(i, String::new())));
            tpuray::get(&m.post(vec![awaited.clone()]))?;
            let got = tpuray::get(&waiter)?;
            say(&format!("WAITER ms={}", t.elapsed().as_millis()));
            let sum: u64 = tpuray::get_all(&refs)?.iter().sum();
            say(&format!("RESULT waiter={got} sum={sum}"));
        }
        // CORE-9: quick tasks never wait behind a slow one of their class while a CPU is
        // free: they are all done before the slow one ends.
        // CORE-9: pipelined tasks with large inline arguments (6 x 90 KB each) all run:
        // a batch stops at about 4 MiB of specs, far below the worker's 64 MiB limit
        // (128 of them in one call would be 69 MB).
        "pipeline-big-args" => {
            let arg = || vec![1u8; 90 * 1024];
            let refs: Vec<_> = (0..300)
                .map(|_| six_lengths::remote(arg(), arg(), arg(), arg(), arg(), arg()))
                .collect();
            let total: u64 = tpuray::get_all(&refs)?.iter().sum();
            say(&format!("RESULT total={total}"));
        }
        "pipeline-slow-first" => {
            let warm: Vec<_> = (0..300).map(|_| sleep_ms::remote(0)).collect();
            tpuray::get_all(&warm)?;
            let slow = sleep_ms::remote(8_000);
            let quick: Vec<_> = (0..400).map(|_| sleep_ms::remote(0)).collect();
            tpuray::get_all(&quick)?;
            let (ready, _) = tpuray::wait(std::slice::from_ref(&slow), 1, Some(Duration::ZERO))?;
            say(&format!("RESULT quick={} slow_done={}", quick.len(), !ready.is_empty()));
            tpuray::get(&slow)?;
        }
        "named" => {
            let name = arg(args, 0, "actor name")?;
            let j =
                Journal::options(ActorOptions { name: Some(name.clone()), ..Default::default() })
                    .remote()?;
            let found = tpuray::get_actor(&name, None)?;
            say(&format!("CREATED id={}", j.handle().actor_id));
            say(&format!("FOUND id={} name={} class={}", found.actor_id, found.name, found.class));
            let found = JournalHandle(found);
            let refs: Vec<_> = (0..100u64).map(|i| found.append(i)).collect();
            let lens = tpuray::get_all(&refs)?;
            let entries = tpuray::get(&found.entries())?;
            let in_order = lens == (1..=100).collect::<Vec<usize>>()
                && entries == (0..100).collect::<Vec<u64>>();
            say(&format!("RESULT in_order={in_order} calls={}", lens.len()));
        }
        // The driver puts two objects (one inline-sized, one in the store),
        // hands refs to an actor inside a value, drops its own refs, and the
        // actor still reads both later (the actor borrows them).
        "borrow" => {
            let keeper = Keeper::remote()?;
            let small = tpuray::put(&tpuray::Blob(vec![7u8; 1000]))?;
            let big = tpuray::put(&tpuray::Blob(vec![9u8; 2_000_000]))?;
            let n = tpuray::get(&keeper.keep(vec![small, big]))?;
            // `small` and `big` were moved into the call and are gone here.
            std::thread::sleep(Duration::from_millis(500));
            match tpuray::get(&keeper.total_bytes()) {
                Ok(total) => say(&format!("RESULT kept={n} total={total}")),
                Err(e) => print_error(&e, Instant::now()),
            }
        }
        // CORE-2: an object only a killed actor borrowed is freed: the owner finds the
        // borrowing process gone and drops its registration.
        "borrower-dies" => {
            let keeper = Keeper::remote()?;
            let big = tpuray::put(&tpuray::Blob(vec![9u8; 2_000_000]))?;
            let id = big.id().to_string();
            let store = tpuray_objectstore::LocalStore::default_dir(
                &tpuray::node_id()?,
                &std::env::temp_dir(),
            );
            let n = tpuray::get(&keeper.keep(vec![big]))?;
            std::thread::sleep(Duration::from_millis(500));
            let held = store.join(&id).exists();
            tpuray::kill_actor(&keeper.handle().actor_id, true)?;
            let t = Instant::now();
            while store.join(&id).exists() && t.elapsed() < Duration::from_secs(60) {
                std::thread::sleep(Duration::from_millis(100));
            }
            let freed = !store.join(&id).exists();
            say(&format!("RESULT kept={n} held_while_borrowed={held} freed_after_kill={freed}"));
        }
        // retry_exceptions: a task failing twice succeeds on its third
        // attempt with max_retries 2; without retry_exceptions the first
        // failure is final.
        "retry-exceptions" => {
            let dir = PathBuf::from(arg(args, 0, "work dir")?);
            let opts = TaskOptions { retry_exceptions: true, max_retries: 2, ..Default::default() };
            let with = flaky::options(opts).remote(dir.join("a").display().to_string(), 2);
            match tpuray::get(&with) {
                Ok(n) => say(&format!("RETRIED attempts={n}")),
                Err(e) => print_error(&e, Instant::now()),
            }
            let without = flaky::remote(dir.join("b").display().to_string(), 2);
            match tpuray::get(&without) {
                Ok(n) => say(&format!("RESULT unexpected success attempts={n}")),
                Err(e) => print_error(&e, Instant::now()),
            }
        }
        // wait: two quick tasks and one slow; wait for two.
        "wait" => {
            let refs = vec![sleep_ms::remote(0), sleep_ms::remote(30_000), sleep_ms::remote(0)];
            let t = Instant::now();
            // Generous: starting worker processes on a loaded machine is slow.
            let (ready, rest) = tpuray::wait(&refs, 2, Some(Duration::from_secs(20)))?;
            let ids: Vec<bool> =
                refs.iter().map(|r| ready.iter().any(|x| x.id() == r.id())).collect();
            say(&format!(
                "RESULT ready={} rest={} which={ids:?} ms={}",
                ready.len(),
                rest.len(),
                t.elapsed().as_millis()
            ));
        }
        // A detached named actor outlives its creator's job; a plain one dies with it.
        "detached-create" => {
            let name = arg(args, 0, "actor name")?;
            let d = Journal::options(ActorOptions {
                name: Some(name.clone()),
                detached: true,
                ..Default::default()
            })
            .remote()?;
            let p = Journal::options(ActorOptions {
                name: Some(format!("{name}-plain")),
                ..Default::default()
            })
            .remote()?;
            tpuray::get(&d.append(5))?;
            tpuray::get(&p.append(6))?;
            say("CREATED");
        }
        // CORE-14: shutdown then init again in one process: a new job, whose tasks and
        // actors run, and the first job's (non-detached) named actor went with it.
        "reinit" => {
            let addr = arg(args, 0, "head address")?;
            let first = tpuray::job_id()?;
            let a = Journal::options(ActorOptions {
                name: Some("reinit-journal".into()),
                ..Default::default()
            })
            .remote()?;
            let before = tpuray::get(&add::remote(1, 2))? + tpuray::get(&a.append(7))? as i64;
            tpuray::shutdown();
            let down = tpuray::raw::is_initialized();
            let after_shutdown = match tpuray::job_id() {
                Ok(j) => format!("job {j}"),
                Err(e) => format!("{e}"),
            };
            say(&format!("INFO after_shutdown={after_shutdown}"));
            tpuray::init(Some(&addr))?;
            let second = tpuray::job_id()?;
            let after = tpuray::get(&add::remote(20, 22))?;
            let b = Journal::options(ActorOptions {
                name: Some("reinit-journal-2".into()),
                ..Default::default()
            })
            .remote()?;
            let entries = tpuray::get(&b.append(9))?;
            let old_actor = tpuray::get_actor("reinit-journal", None).is_ok();
            let twice = tpuray::init(Some(&addr)).map_err(|e| e.to_string());
            say(&format!(
                "RESULT before={before} down={down} new_job={} after={after} entries={entries} \
                 old_actor_found={old_actor} init_twice={twice:?}",
                first != second
            ));
        }
        "detached-use" => {
            let name = arg(args, 0, "actor name")?;
            let d = JournalHandle(tpuray::get_actor(&name, None)?);
            let entries = tpuray::get(&d.entries())?;
            say(&format!("RESULT entries={entries:?}"));
            match tpuray::get_actor(&format!("{name}-plain"), None) {
                Ok(h) => say(&format!("PLAIN found {}", h.actor_id)),
                Err(e) => print_error(&e, Instant::now()),
            }
        }
        // A task returns refs to objects it put; the caller reads them after
        // the task's own copies of the refs are long gone.
        "return-ref" => {
            let outers = vec![make_ref::remote(1000), make_ref::remote(2_000_000)];
            let inners: Vec<tpuray::ObjectRef<tpuray::Blob>> = tpuray::get_all(&outers)?;
            drop(outers);
            std::thread::sleep(Duration::from_millis(500));
            let sizes: Result<Vec<usize>, _> =
                inners.iter().map(|r| tpuray::get(r).map(|b| b.0.len())).collect();
            match sizes {
                Ok(s) => say(&format!("RESULT sizes={s:?}")),
                Err(e) => print_error(&e, Instant::now()),
            }
        }
        // A task returns 2,000 refs to objects it put; the caller reads the list twice
        // (refs in it need no registration of their own while the list lives), drops
        // the list and one copy, and still reads every object through the other: the
        // list's hold passed to the caller before it went (CORE-2).
        "return-many-refs" => {
            let outer = make_refs::remote(2000);
            let first: Vec<tpuray::ObjectRef<u64>> = tpuray::get(&outer)?;
            let second: Vec<tpuray::ObjectRef<u64>> = tpuray::get(&outer)?;
            drop(second);
            drop(outer);
            std::thread::sleep(Duration::from_millis(500));
            match tpuray::get_all(&first) {
                Ok(v) => say(&format!("RESULT count={} sum={}", v.len(), v.iter().sum::<u64>())),
                Err(e) => print_error(&e, Instant::now()),
            }
        }
        // An object put inside another stays alive while the outer lives.
        "nested-put" => {
            let inner = tpuray::put(&tpuray::Blob(vec![4u8; 300_000]))?;
            let outer = tpuray::put(&vec![inner])?;
            std::thread::sleep(Duration::from_millis(300));
            let inners = tpuray::get(&outer)?;
            match tpuray::get(&inners[0]) {
                Ok(b) => say(&format!("RESULT size={}", b.0.len())),
                Err(e) => print_error(&e, Instant::now()),
            }
        }
        // Objects four times the node's store (run with --object-store-memory 268435456):
        // see `spill_objects`.
        "spill-objects" => spill_objects(args)?,
        // A result made on the node with the `far` resource, read here: see `pulled_copy`.
        "pulled-copy" => pulled_copy(args)?,
        // A chain of results on the node with the `x` resource, made again after the test
        // kills that node: see `lineage`.
        "lineage" => lineage(args)?,
        // An object borrowed from an actor that is then killed: see `owner_died`.
        "owner-died" => owner_died(args)?,
        // One large object read on several nodes at once: see `broadcast`.
        "broadcast" => broadcast(args)?,
        "mesh" => mesh(args)?,
        other => bail!("unknown scenario {other:?}"),
    }
    Ok(())
}

/// Size of each object of the `spill-objects` scenario (64 MiB).
const SPILL_OBJECT_BYTES: usize = 64 << 20;

/// Object `k` of the `spill-objects` scenario: byte i is (i*7 + k) % 251. The pattern
/// repeats every 251 bytes, so it is built (and checked) one period at a time.
fn spill_period(k: usize) -> Vec<u8> {
    (0..251).map(|i| ((i * 7 + k) % 251) as u8).collect()
}

fn spill_pattern(k: usize, len: usize) -> Vec<u8> {
    let period = spill_period(k);
    let mut v = Vec::with_capacity(len);
    while v.len() < len {
        let n = (len - v.len()).min(period.len());
        v.extend_from_slice(&period[..n]);
    }
    v
}

fn spill_pattern_holds(k: usize, data: &[u8]) -> bool {
    let period = spill_period(k);
    data.len() == SPILL_OBJECT_BYTES && data.chunks(251).all(|c| c == &period[..c.len()])
}

/// `spill-objects GO_FILE DONE_FILE`: puts 16 objects of 64 MiB (four times a 256 MiB
/// store) and reads every one back byte-exact (`HOLDING`); after GO_FILE appears, puts
/// more while holding a mapped view of each until the store, all pinned, refuses one
/// (`FULL after=<attempt> msg=<error>`); then drops every ref (`DROPPED`) and waits for
/// DONE_FILE so the test can watch the spill folder empty while the owner still lives.
fn spill_objects(args: &[String]) -> anyhow::Result<()> {
    let go = PathBuf::from(arg(args, 0, "go file")?);
    let done = PathBuf::from(arg(args, 1, "done file")?);
    let t = Instant::now();
    let mut refs = Vec::new();
    for k in 0..16 {
        refs.push(tpuray::put(&tpuray::Blob(spill_pattern(k, SPILL_OBJECT_BYTES)))?);
    }
    let put_ms = t.elapsed().as_millis();
    for (k, r) in refs.iter().enumerate() {
        let b = tpuray::get(r)?;
        if !spill_pattern_holds(k, &b.0) {
            bail!("object {k} ({}) came back with other bytes ({} bytes)", r.id(), b.0.len());
        }
    }
    say(&format!(
        "HOLDING n={} verified={} put_ms={put_ms} ms={}",
        refs.len(),
        refs.len(),
        t.elapsed().as_millis()
    ));
    wait_for_file(&go, Duration::from_secs(60))?;
    let mut views = Vec::new();
    let mut full = None;
    for attempt in 1..=8 {
        match tpuray::put(&tpuray::Blob(spill_pattern(100 + attempt, SPILL_OBJECT_BYTES))) {
            Ok(r) => views.push((tpuray::get_bytes(&r)?, r)),
            Err(e) => {
                full = Some((attempt, e));
                break;
            }
        }
    }
    match full {
        Some((attempt, e)) => {
            let msg = e.to_string().replace('\n', " | ");
            say(&format!("FULL after={attempt} kind={} msg={msg}", kind(&e)));
        }
        None => say("FULL never"),
    }
    drop(views);
    drop(refs);
    say("DROPPED");
    wait_for_file(&done, Duration::from_secs(60))
}

/// `bytes` bytes of the `spill-objects` pattern for `k` (any length).
#[tpuray::remote]
fn pattern_blob(k: usize, bytes: usize) -> tpuray::Blob {
    tpuray::Blob(spill_pattern(k, bytes))
}

/// `pulled-copy DONE_FILE`: runs `pattern_blob` on the node with the `far` resource
/// (2 MB, stored in that node's store), reads it here (pulled into this node's store as
/// a secondary copy), prints `PULLED id=<object id> size=<bytes> ok=<bool>` and holds
/// the ref until DONE_FILE appears.
fn pulled_copy(args: &[String]) -> anyhow::Result<()> {
    let done = PathBuf::from(arg(args, 0, "done file")?);
    let opts = TaskOptions {
        resources: [("far".to_string(), 1.0)].into_iter().collect(),
        ..Default::default()
    };
    let r = pattern_blob::options(opts).remote(7, 2_000_000);
    let b = tpuray::get(&r)?;
    let ok = b.0.len() == 2_000_000 && b.0.chunks(251).all(|c| c == &spill_period(7)[..c.len()]);
    say(&format!("PULLED id={} size={} ok={ok}", r.id(), b.0.len()));
    wait_for_file(&done, Duration::from_secs(60))
}

/// Adds one to the number in `path` (0 when missing): how often a task ran.
fn bump(path: &str) {
    let n = std::fs::read_to_string(path).ok().and_then(|s| s.trim().parse::<u32>().ok());
    std::fs::write(path, (n.unwrap_or(0) + 1).to_string()).expect("write counter file");
}

fn runs(path: &Path) -> u32 {
    std::fs::read_to_string(path).ok().and_then(|s| s.trim().parse().ok()).unwrap_or(0)
}

/// Counts its run in `count_file`, then returns `bytes` bytes of pattern `k`.
#[tpuray::remote]
fn counted_pattern(count_file: String, k: usize, bytes: usize) -> tpuray::Blob {
    bump(&count_file);
    tpuray::Blob(spill_pattern(k, bytes))
}

/// Counts its run in `count_file`, then returns `src` with one added to every byte.
#[tpuray::remote]
fn counted_shift(count_file: String, src: tpuray::Blob) -> tpuray::Blob {
    bump(&count_file);
    tpuray::Blob(src.0.iter().map(|b| b.wrapping_add(1)).collect())
}

/// Size of the results of the `lineage` scenario (10 MB: stored, not inline).
const LINEAGE_BYTES: usize = 10_000_000;

/// `lineage WORK_DIR`: on the node with the `x` resource, `a` makes 10 MB of pattern 5 and
/// `b` shifts `a`'s bytes by one; a task there also puts 10 MB and returns the ref. Once
/// both results are ready (never read here, so their only copies stay on that node) it
/// drops its ref to `a` (`b`'s lineage keeps it) and prints `READY`; the test kills the
/// node and starts another with `x`, then creates `WORK_DIR/go`. Then `b` is read:
/// `RESULT ok=<bytes right> len=<bytes> a_runs=<n> b_runs=<n> ms=<elapsed>`, and the put
/// object: `PUTLOST kind=<error kind> msg=<message>` (or `PUTLOST ok` if it was read).
fn lineage(args: &[String]) -> anyhow::Result<()> {
    let dir = PathBuf::from(arg(args, 0, "work dir")?);
    let on_x = TaskOptions {
        resources: [("x".to_string(), 1.0)].into_iter().collect(),
        ..Default::default()
    };
    let (a_count, b_count) = (dir.join("a.count"), dir.join("b.count"));
    let a = counted_pattern::options(on_x.clone()).remote(
        a_count.display().to_string(),
        5,
        LINEAGE_BYTES,
    );
    let b = counted_shift::options(on_x.clone()).remote(b_count.display().to_string(), &a);
    let outer = make_ref::options(on_x).remote(LINEAGE_BYTES);
    let (ready, _) = tpuray::wait(&[a.clone(), b.clone()], 2, Some(Duration::from_secs(60)))?;
    if ready.len() != 2 {
        bail!("the results on node x were not ready in 60 s");
    }
    let put = tpuray::get_timeout(&outer, Duration::from_secs(60))?;
    drop((a, ready, outer));
    say(&format!("READY a_runs={} b_runs={}", runs(&a_count), runs(&b_count)));
    wait_for_file(&dir.join("go"), Duration::from_secs(120))?;
    let t = Instant::now();
    match tpuray::get_timeout(&b, Duration::from_secs(90)) {
        Ok(v) => {
            let want: Vec<u8> = spill_period(5).iter().map(|x| x + 1).collect();
            let ok = v.0.len() == LINEAGE_BYTES && v.0.chunks(251).all(|c| c == &want[..c.len()]);
            say(&format!(
                "RESULT ok={ok} len={} a_runs={} b_runs={} ms={}",
                v.0.len(),
                runs(&a_count),
                runs(&b_count),
                t.elapsed().as_millis()
            ));
        }
        Err(e) => print_error(&e, t),
    }
    match tpuray::get_timeout(&put, Duration::from_secs(30)) {
        Ok(_) => say("PUTLOST ok"),
        Err(e) => {
            let msg = e.to_string().replace('\n', " | ");
            say(&format!("PUTLOST kind={} msg={msg}", kind(&e)));
        }
    }
    Ok(())
}

/// An actor that puts objects: it owns them, its callers borrow them.
#[derive(Default)]
pub struct Putter;

#[tpuray::actor]
impl Putter {
    pub fn new() -> Self {
        Putter
    }
    /// Puts `bytes` bytes; the ref and this process's pid.
    pub fn put(&self, bytes: usize) -> Result<(tpuray::ObjectRef<tpuray::Blob>, u32), String> {
        let r = tpuray::put(&tpuray::Blob(vec![9u8; bytes])).map_err(|e| e.to_string())?;
        Ok((r, std::process::id()))
    }
}

/// `owner-died`: an actor puts 10 MB and hands back the ref; this driver reads it
/// (`BORROWED len=<bytes>`), SIGKILLs the actor's process, reads it again and prints
/// `OWNERDIED kind=<error kind> msg=<message>` (or `OWNERDIED ok` if that worked).
fn owner_died(_args: &[String]) -> anyhow::Result<()> {
    let p = Putter::remote()?;
    let (r, pid) = tpuray::get_timeout(&p.put(LINEAGE_BYTES), Duration::from_secs(60))?;
    let b = tpuray::get_timeout(&r, Duration::from_secs(30))?;
    say(&format!("BORROWED len={} pid={pid}", b.0.len()));
    drop(b);
    // SAFETY: kill(2) has no memory-safety preconditions.
    unsafe { libc::kill(pid as i32, libc::SIGKILL) };
    let deadline = Instant::now() + Duration::from_secs(20);
    while std::fs::read_to_string(format!("/proc/{pid}/stat"))
        .is_ok_and(|s| !s.rsplit(')').next().unwrap_or("").trim_start().starts_with('Z'))
    {
        if Instant::now() > deadline {
            bail!("the actor's process {pid} is still alive 20 s after SIGKILL");
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    let t = Instant::now();
    match tpuray::get_timeout(&r, Duration::from_secs(30)) {
        Ok(_) => say("OWNERDIED ok"),
        Err(e) => {
            let msg = e.to_string().replace('\n', " | ");
            say(&format!("OWNERDIED kind={} ms={} msg={msg}", kind(&e), t.elapsed().as_millis()));
        }
    }
    Ok(())
}

/// Maps the object in `refs[0]` (no decode copy) and checks that its last `bytes` bytes
/// are the `spill-objects` pattern `k`: (bytes right, object size, ms, node id).
#[tpuray::remote]
fn read_pattern(
    refs: Vec<tpuray::ObjectRef<tpuray::Blob>>,
    k: usize,
    bytes: usize,
) -> Result<(bool, usize, u64, String), String> {
    let t = Instant::now();
    let data = tpuray::get_bytes(&refs[0]).map_err(|e| e.to_string())?;
    let period = spill_period(k);
    let ok = data.len() >= bytes
        && data[data.len() - bytes..].chunks(251).all(|c| c == &period[..c.len()]);
    let ms = t.elapsed().as_millis() as u64;
    Ok((ok, data.len(), ms, tpuray::node_id().unwrap_or_default()))
}

/// `broadcast BYTES NAMES`: puts `BYTES` bytes of pattern 3 here (the head node), then
/// reads it at once from one task per custom resource in the comma-separated NAMES (one
/// node each), each checking every byte: `READ name=<n> ok=<bool> len=<object bytes>
/// ms=<read time> node=<node id>` per reader, then `DONE ms=<elapsed>`.
fn broadcast(args: &[String]) -> anyhow::Result<()> {
    let bytes: usize = arg(args, 0, "bytes")?.parse()?;
    let names = arg(args, 1, "resource names")?;
    let t = Instant::now();
    let r = tpuray::put(&tpuray::Blob(spill_pattern(3, bytes)))?;
    say(&format!("PUT ms={}", t.elapsed().as_millis()));
    let t = Instant::now();
    let readers: Vec<_> = names
        .split(',')
        .map(|n| {
            let opts = TaskOptions {
                resources: [(n.to_string(), 1.0)].into_iter().collect(),
                ..Default::default()
            };
            (n, read_pattern::options(opts).remote(vec![r.clone()], 3, bytes))
        })
        .collect();
    for (n, x) in readers {
        let (ok, len, ms, node) = tpuray::get_timeout(&x, Duration::from_secs(600))?;
        say(&format!("READ name={n} ok={ok} len={len} ms={ms} node={node}"));
    }
    say(&format!("DONE ms={}", t.elapsed().as_millis()));
    Ok(())
}

/// Makes a [`tpuray::Blob`] of `bytes` bytes of the `spill-objects` pattern `k` (stored
/// in the executing node's store when large).
#[tpuray::remote]
fn make_pattern(k: usize, bytes: usize) -> tpuray::Blob {
    tpuray::Blob(spill_pattern(k, bytes))
}

/// `mesh BYTES NAMES`: for each custom resource in the comma-separated NAMES (one per
/// host): a task there reports its node; a `Journal` actor pinned to that node takes
/// two calls; an object of BYTES made by a task there is read byte-exact here and by a
/// task on the next name's node. Prints one `MESH name=N task=NODE actor=NODE calls=2
/// here=BOOL next=BOOL next_node=NODE` line per name, then `DONE`.
fn mesh(args: &[String]) -> anyhow::Result<()> {
    let bytes: usize = arg(args, 0, "bytes")?.parse()?;
    let names: Vec<String> = arg(args, 1, "resource names")?.split(',').map(String::from).collect();
    let on = |n: &str| TaskOptions {
        resources: [(n.to_string(), 1.0)].into_iter().collect(),
        ..Default::default()
    };
    let t = Duration::from_secs(600);
    for (i, n) in names.iter().enumerate() {
        let next = &names[(i + 1) % names.len()];
        let node = tpuray::get_timeout(&where_am_i::options(on(n)).remote(), t)?;
        let j = Journal::options(ActorOptions {
            scheduling: Scheduling::NodeAffinity { node_id: node.clone(), soft: false },
            ..Default::default()
        })
        .remote()?;
        j.append(1);
        let calls = tpuray::get_timeout(&j.append(2), t)?;
        let (actor_node, _) = tpuray::get_timeout(&j.whereabouts(), t)?;
        j.handle().kill(true)?;
        let k = i + 1;
        let obj = make_pattern::options(on(n)).remote(k, bytes);
        let here = spill_pattern(k, bytes);
        let got = tpuray::get_bytes(&obj)?;
        let here_ok = got.len() >= bytes && got[got.len() - bytes..] == here[..];
        let (next_ok, _, _, next_node) =
            tpuray::get_timeout(&read_pattern::options(on(next)).remote(vec![obj], k, bytes), t)?;
        say(&format!(
            "MESH name={n} task={node} actor={actor_node} calls={calls} here={here_ok} next={next_ok} next_node={next_node}"
        ));
    }
    say("DONE");
    Ok(())
}
