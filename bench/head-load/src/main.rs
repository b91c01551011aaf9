//! `head_load`: N simulated node agents against one real tpuray head, to measure what the
//! head costs per node and how long placing work takes at scale (issue 34). A benchmark
//! tool, not a test mode of the product.
//!
//! ```text
//! cargo build --release -p tpuray-cli -p tpuray-head-load
//! target/release/head_load --nodes 1000 --seconds 30 [--actors 20000] [--pgs 1000] [--slices 100]
//!     [--tasks 15000 --task-seconds 10 --task-window 30]
//! ```
//!
//! It starts a head (`tpuray start --head --head-only`, the `tpuray` binary next to its
//! own or `--tpuray`, in a private temp folder with auth disabled) or uses `--address`
//! (with `--head-pid` for its CPU and memory), registers N nodes over the real protocol
//! (`sim.rs` says what is real and what is a stand-in), keeps every node's heartbeat loop
//! running for the whole run, then: measures S seconds of heartbeats alone (head CPU and
//! RSS, the harness's own CPU, client-side heartbeat latency), creates the actors,
//! placement groups and TPU slice groups asked for and times until the head records all
//! of them placed, keeps `--tasks` 1-CPU tasks running at once for `--task-window` seconds
//! (lease records on random nodes, each replaced on another node when it ends, so the
//! head sees a busy cluster's availability changing; tasks never reach the head) while
//! measuring the head's CPU and the heartbeats' latency, times `tpuray status` and
//! `tpuray list`, reads the head's Raft snapshot
//! figures, and counts false node deaths (nodes the head declared dead while their
//! heartbeats ran). The last line is
//! `head_load: nodes N false_deaths D head_cpu_cores C head_rss_mib M harness_cpu_cores H`.
//! Exits 1 when any node was falsely declared dead.
//!
//! Nodes may be TPU hosts of v6e-16 slices, with the resources and labels
//! `worker/src/run.rs` gives a simulated host. It also measures the longest gap between
//! one node's heartbeats, and times placement through the head's state-change stream.
//! Heartbeat connections are shared by a few nodes only when both processes would
//! otherwise pass the open-file limit (the head holds one connection per node agent).
//! `tests/smoke.rs` runs 20 nodes for 5 s (no timing asserted).

mod sim;

use std::collections::{BTreeMap, HashSet};
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use anyhow::{Context, ensure};
use clap::Parser;
use tokio_stream::StreamExt;
use tonic::Request;
use tpuray_proto::convert::resources_to_proto;
use tpuray_proto::ids::NodeId;
use tpuray_proto::pb;
use tpuray_scheduler::{Amount, Labels, ResourceSet};

use crate::sim::{HeadClient, Sim, SimNode, SimSvc};

#[derive(Parser, Debug)]
#[command(name = "head_load", about = "N simulated node agents against one real tpuray head")]
struct Args {
    /// How many simulated nodes to register.
    #[arg(long)]
    nodes: usize,
    /// Seconds of heartbeats alone to measure (after every node registered).
    #[arg(long)]
    seconds: u64,
    /// Actors to create and time until the head records every one alive.
    #[arg(long, default_value_t = 0)]
    actors: usize,
    /// Placement groups (2 bundles of 1 CPU, PACK) to create and time until all are CREATED.
    #[arg(long, default_value_t = 0)]
    pgs: usize,
    /// TPU slice groups (v6e-16: 4 hosts x 4 chips) to create; the first 4 x K nodes
    /// are then simulated TPU hosts of K slices.
    #[arg(long, default_value_t = 0)]
    slices: usize,
    /// Tasks running at once for `--task-window` seconds after placement (1 CPU each, a
    /// lease record on a random node, held for 0.5-1.5 x `--task-seconds` and then given
    /// back and replaced on another node): the head sees them only as availability in
    /// heartbeats.
    #[arg(long, default_value_t = 0)]
    tasks: usize,
    /// Mean seconds one `--tasks` task runs.
    #[arg(long, default_value_t = 10.0)]
    task_seconds: f64,
    /// Seconds the `--tasks` phase lasts.
    #[arg(long, default_value_t = 30)]
    task_window: u64,
    /// CPUs each simulated node advertises.
    #[arg(long, default_value_t = 4.0)]
    cpus_per_node: f64,
    /// An existing head (`HOST:PORT`) instead of starting one; needs `--head-pid`.
    #[arg(long)]
    address: Option<String>,
    /// The pid of the head at `--address` (its CPU and memory are read from /proc).
    #[arg(long)]
    head_pid: Option<u32>,
    /// The `tpuray` binary that starts the head and runs `status`/`list` (default: the
    /// one next to this executable, or `TPURAY_BIN`).
    #[arg(long)]
    tpuray: Option<PathBuf>,
    /// Nodes sharing one HTTP/2 connection to the head (default: 1, or the fewest that
    /// keep both processes under their open-file limit).
    #[arg(long)]
    nodes_per_connection: Option<usize>,
    /// Registrations in flight at once.
    #[arg(long, default_value_t = 64)]
    register_concurrency: usize,
    /// Actor and group creations in flight at once.
    #[arg(long, default_value_t = 128)]
    create_concurrency: usize,
    /// Seconds to wait for placement before giving up on it (reported as not placed).
    #[arg(long, default_value_t = 600)]
    place_timeout: u64,
    /// Keep the started head's folder (its logs) instead of removing it at the end.
    #[arg(long)]
    keep_head_dir: bool,
}

/// The v6e-16 slice the simulated TPU hosts form (TPU.md: 4x4 = 16 chips = 4 hosts x 4).
const SLICE_TYPE: &str = "v6e-16";
const SLICE_TOPOLOGY: &str = "4x4";
const SLICE_HOSTS: usize = 4;
const SLICE_CHIPS: u32 = 4;

/// CPU seconds (user + system) of a process, from `/proc/PID/stat`.
fn cpu_seconds(pid: &str) -> anyhow::Result<f64> {
    let s = std::fs::read_to_string(format!("/proc/{pid}/stat"))
        .with_context(|| format!("reading /proc/{pid}/stat"))?;
    // Fields after the command name (which may hold spaces) start at state (field 3).
    let rest = s.rsplit_once(')').context("malformed stat")?.1;
    let f: Vec<&str> = rest.split_whitespace().collect();
    let utime: f64 = f[11].parse()?;
    let stime: f64 = f[12].parse()?;
    // SAFETY: sysconf has no memory-safety preconditions.
    let tck = unsafe { libc::sysconf(libc::_SC_CLK_TCK) } as f64;
    Ok((utime + stime) / tck)
}

/// Seconds a process's threads spent running and waiting for a CPU (on a run queue),
/// summed over its threads (`/proc/PID/task/*/schedstat`): the wait tells a process
/// starved by a loaded machine from one slow by itself.
fn sched_seconds(pid: &str) -> (f64, f64) {
    let (mut run, mut wait) = (0u64, 0u64);
    if let Ok(rd) = std::fs::read_dir(format!("/proc/{pid}/task")) {
        for t in rd.flatten() {
            if let Ok(s) = std::fs::read_to_string(t.path().join("schedstat")) {
                let f: Vec<u64> = s.split_whitespace().filter_map(|x| x.parse().ok()).collect();
                if f.len() >= 2 {
                    run += f[0];
                    wait += f[1];
                }
            }
        }
    }
    (run as f64 / 1e9, wait as f64 / 1e9)
}

/// The machine's load average over the last minute (`/proc/loadavg`).
fn loadavg() -> f64 {
    std::fs::read_to_string("/proc/loadavg")
        .ok()
        .and_then(|s| s.split_whitespace().next().and_then(|v| v.parse().ok()))
        .unwrap_or(f64::NAN)
}

/// Resident memory of a process in MiB (`VmRSS` of `/proc/PID/status`).
fn rss_mib(pid: &str) -> anyhow::Result<f64> {
    let s = std::fs::read_to_string(format!("/proc/{pid}/status"))?;
    let kb: f64 = s
        .lines()
        .find_map(|l| l.strip_prefix("VmRSS:"))
        .context("no VmRSS")?
        .trim()
        .trim_end_matches("kB")
        .trim()
        .parse()?;
    Ok(kb / 1024.0)
}

/// CPU use of the head and of this process over a stretch of wall time.
struct CpuMeter {
    head: String,
    t0: Instant,
    head0: f64,
    self0: f64,
}

impl CpuMeter {
    fn start(head: &str) -> anyhow::Result<Self> {
        Ok(Self {
            head: head.to_string(),
            t0: Instant::now(),
            head0: cpu_seconds(head)?,
            self0: cpu_seconds("self")?,
        })
    }
    /// (head cores, harness cores, wall seconds) since `start`.
    fn read(&self) -> anyhow::Result<(f64, f64, f64)> {
        let wall = self.t0.elapsed().as_secs_f64();
        let h = (cpu_seconds(&self.head)? - self.head0) / wall;
        let s = (cpu_seconds("self")? - self.self0) / wall;
        Ok((h, s, wall))
    }
}

fn percentile(sorted: &[u32], p: f64) -> f64 {
    if sorted.is_empty() {
        return f64::NAN;
    }
    let i = ((sorted.len() as f64 - 1.0) * p).round() as usize;
    f64::from(sorted[i]) / 1000.0
}

/// Raises this process's open-file limit to its hard limit (the head started from here
/// inherits it); returns the limit now.
fn raise_nofile() -> u64 {
    let mut r = libc::rlimit { rlim_cur: 0, rlim_max: 0 };
    // SAFETY: getrlimit/setrlimit write/read the struct we pass.
    unsafe {
        if libc::getrlimit(libc::RLIMIT_NOFILE, &mut r) != 0 {
            return 1024;
        }
        r.rlim_cur = r.rlim_max;
        libc::setrlimit(libc::RLIMIT_NOFILE, &r);
        libc::getrlimit(libc::RLIMIT_NOFILE, &mut r);
    }
    r.rlim_cur
}

/// The simulated nodes: CPU-only hosts, the first `4 x slices` TPU hosts of v6e-16 slices
/// with the resources and labels a simulated TPU host advertises (`TPU_*` environment
/// plus `{"TPU": 4}`, as `worker/src/run.rs` builds them).
fn make_nodes(args: &Args, port: u16) -> anyhow::Result<Vec<SimNode>> {
    let mut out = Vec::with_capacity(args.nodes);
    for i in 0..args.nodes {
        let mut total = ResourceSet::new();
        total.set("CPU", Amount::from_f64("CPU", args.cpus_per_node)?);
        total.set("memory", Amount::whole(8 << 30));
        total.set("object_store_memory", Amount::whole(2 << 30));
        let mut labels = Labels::default();
        if i < args.slices * SLICE_HOSTS {
            let env: BTreeMap<String, String> = [
                ("TPU_ACCELERATOR_TYPE", SLICE_TYPE.to_string()),
                ("TPU_NAME", format!("head-load-slice-{}", i / SLICE_HOSTS)),
                ("TPU_WORKER_ID", (i % SLICE_HOSTS).to_string()),
                ("TPU_TOPOLOGY", SLICE_TOPOLOGY.to_string()),
            ]
            .into_iter()
            .map(|(k, v)| (k.to_string(), v))
            .collect();
            let host = tpuray_scheduler::tpu::TpuHostInfo::from_env(&env, SLICE_CHIPS)?;
            for (name, amount) in host.resources().iter() {
                total.set(name, amount);
            }
            labels = host.labels();
            labels.0.insert("tpuray.io/tpu-devices".into(), "simulated".into());
        }
        let state =
            sim::NodeState { total: total.clone(), available: total.clone(), ..Default::default() };
        out.push(SimNode {
            node_id: NodeId::random(),
            address: format!("{}:{port}", sim::node_ip(i)),
            labels,
            registered: total,
            state: std::sync::Mutex::new(state),
            declared_dead: Default::default(),
        });
    }
    Ok(out)
}

/// A head started by this tool, stopped (with everything under its folder) on drop.
struct OwnHead {
    bin: PathBuf,
    dir: PathBuf,
    keep: bool,
}

impl OwnHead {
    fn cli(bin: &Path, dir: &Path) -> Command {
        let mut c = Command::new(bin);
        c.env("HOME", dir.join("home"))
            .env("TPURAY_REGISTRY_DIR", dir.join("registry"))
            .env_remove("TPURAY_ADDRESS");
        c
    }

    fn start(bin: &Path, keep: bool) -> anyhow::Result<(Self, String, u32)> {
        let dir = std::env::temp_dir().join(format!("tpuray-head-load-{}", std::process::id()));
        std::fs::create_dir_all(dir.join("home"))?;
        let port = std::net::TcpListener::bind("127.0.0.1:0")?.local_addr()?.port();
        let own = OwnHead { bin: bin.to_path_buf(), dir: dir.clone(), keep };
        let st = Self::cli(bin, &dir)
            .args(["start", "--head", "--head-only", "--auth-mode", "disabled"])
            .args(["--node-ip-address", "127.0.0.1"])
            .args(["--port", &port.to_string(), "--dashboard-port", "0", "--temp-dir"])
            .arg(dir.join("session"))
            .stdout(Stdio::null())
            .status()
            .with_context(|| format!("running {}", bin.display()))?;
        ensure!(st.success(), "`tpuray start --head` failed");
        let address = format!("127.0.0.1:{port}");
        let pid = tpuray_proto::registry::list_in(&dir.join("registry"))
            .into_iter()
            .find(|e| e.kind == "head" && e.is_alive())
            .map(|e| e.pid)
            .context("the started head is not in its registry")?;
        Ok((own, address, pid))
    }
}

impl Drop for OwnHead {
    fn drop(&mut self) {
        let _ = Self::cli(&self.bin, &self.dir)
            .args(["stop", "--force"])
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .status();
        if self.keep {
            println!("head_load: the head's folder (logs) is kept: {}", self.dir.display());
        } else {
            let _ = std::fs::remove_dir_all(&self.dir);
        }
    }
}

/// Median wall time of `tpuray ARGS --address A` over 3 runs, and its output's size.
fn time_cli(bin: &Path, env_dir: Option<&Path>, address: &str, args: &[&str]) -> (f64, usize) {
    let mut times = Vec::new();
    let mut bytes = 0;
    for _ in 0..3 {
        let mut c = match env_dir {
            Some(d) => OwnHead::cli(bin, d),
            None => Command::new(bin),
        };
        c.args(args).args(["--address", address]).stderr(Stdio::null());
        let t0 = Instant::now();
        match c.output() {
            Ok(o) if o.status.success() => {
                times.push(t0.elapsed().as_secs_f64() * 1e3);
                bytes = o.stdout.len();
            }
            Ok(o) => {
                eprintln!("head_load: `tpuray {}` failed: {}", args.join(" "), o.status);
                return (f64::NAN, 0);
            }
            Err(e) => {
                eprintln!("head_load: `tpuray {}`: {e}", args.join(" "));
                return (f64::NAN, 0);
            }
        }
    }
    times.sort_by(f64::total_cmp);
    (times[1], bytes)
}

/// Counts what the head's state-change stream reports placed, resubscribing when the
/// stream ends or lags (a resync replays the current state). `placed` decides, per change,
/// which key (if any) it places.
async fn count_placed(
    head: HeadClient,
    after_seq: u64,
    want: usize,
    deadline: Instant,
    placed: impl Fn(&pb::StateChange) -> Option<String>,
) -> usize {
    let mut seen: HashSet<String> = HashSet::new();
    let mut after = after_seq;
    while seen.len() < want && Instant::now() < deadline {
        let mut c = head.clone();
        let stream = match c.subscribe(pb::SubscribeRequest { after_seq: after }).await {
            Ok(s) => s.into_inner(),
            Err(_) => {
                tokio::time::sleep(Duration::from_millis(200)).await;
                continue;
            }
        };
        let mut stream =
            std::pin::pin!(stream.timeout(deadline.saturating_duration_since(Instant::now())));
        while let Some(item) = stream.next().await {
            match item {
                Ok(Ok(change)) => {
                    after = after.max(change.seq);
                    if let Some(k) = placed(&change) {
                        seen.insert(k);
                        if seen.len() >= want {
                            return seen.len();
                        }
                    }
                }
                Ok(Err(_)) | Err(_) => break,
            }
        }
    }
    seen.len()
}

/// What [`run_tasks`] saw.
struct TaskRun {
    /// Running once the first `tasks` had started, and how long that took.
    running: usize,
    ramp_s: f64,
    /// The fewest running at any moment after that.
    min_running: usize,
    /// Tasks started during the window (the first ones not counted).
    started: usize,
    /// Starts whose first node had no free CPU (another was tried).
    retries: usize,
}

/// `--tasks`: `tasks` tasks of 1 CPU running at once on random simulated nodes for
/// `window`, each held 0.5-1.5 x `mean` and then replaced by a new one on another random
/// node, so the nodes' availability changes as a busy cluster's does. Every lease is given
/// back at the end.
async fn run_tasks(sim: &Arc<Sim>, tasks: usize, mean: Duration, window: Duration) -> TaskRun {
    use std::cmp::Reverse;
    use std::collections::BinaryHeap;
    let mut cpu = ResourceSet::new();
    cpu.set("CPU", Amount::whole(1));
    let n = sim.nodes.len();
    let mut retries = 0;
    // One start: a random node with a free CPU (up to 4 x nodes tries).
    let start = |retries: &mut usize| -> Option<(usize, String)> {
        for k in 0..4 * n {
            let i = rand::random::<u64>() as usize % n;
            if let Some(l) = sim.take_lease(i, &cpu) {
                return Some((i, l));
            }
            if k == 0 {
                *retries += 1;
            }
        }
        None
    };
    let hold = || mean.mul_f64(0.5 + rand::random::<f64>());
    let t0 = Instant::now();
    let mut running: BinaryHeap<Reverse<(Instant, usize, String)>> = BinaryHeap::new();
    for _ in 0..tasks {
        match start(&mut retries) {
            Some((i, l)) => running.push(Reverse((Instant::now() + hold(), i, l))),
            None => break,
        }
    }
    let (first, ramp_s) = (running.len(), t0.elapsed().as_secs_f64());
    let (mut min_running, mut started) = (first, 0);
    let end = Instant::now() + window;
    let mut tick = tokio::time::interval(Duration::from_millis(10));
    while Instant::now() < end {
        tick.tick().await;
        let now = Instant::now();
        let mut ended = 0;
        while running.peek().is_some_and(|Reverse((t, _, _))| *t <= now) {
            let Reverse((_, i, l)) = running.pop().expect("peeked");
            sim.return_lease(i, &l);
            ended += 1;
        }
        for _ in 0..ended {
            if let Some((i, l)) = start(&mut retries) {
                running.push(Reverse((now + hold(), i, l)));
                started += 1;
            }
        }
        min_running = min_running.min(running.len());
    }
    for Reverse((_, i, l)) in running.drain() {
        sim.return_lease(i, &l);
    }
    TaskRun { running: first, ramp_s, min_running, started, retries }
}

/// The head's current change sequence number (the stream's backlog's last entry).
async fn current_seq(head: &HeadClient) -> u64 {
    let mut c = head.clone();
    let Ok(s) = c.subscribe(pb::SubscribeRequest { after_seq: 0 }).await else {
        return 0;
    };
    let mut s = std::pin::pin!(s.into_inner().timeout(Duration::from_millis(300)));
    let mut last = 0;
    while let Some(Ok(Ok(ch))) = s.next().await {
        last = ch.seq;
    }
    last
}

/// Runs `n` creations with `conc` in flight; returns how many succeeded and the first error.
async fn create_all<F, Fut>(n: usize, conc: usize, make: F) -> (usize, Option<String>)
where
    F: Fn(usize) -> Fut,
    Fut: std::future::Future<Output = Result<(), tonic::Status>> + Send + 'static,
{
    let permits = Arc::new(tokio::sync::Semaphore::new(conc.max(1)));
    let mut set = tokio::task::JoinSet::new();
    for i in 0..n {
        let permit = Arc::clone(&permits).acquire_owned().await.expect("never closed");
        let fut = make(i);
        set.spawn(async move {
            let r = fut.await;
            drop(permit);
            r
        });
    }
    let mut ok = 0;
    let mut first_err = None;
    while let Some(r) = set.join_next().await {
        match r {
            Ok(Ok(())) => ok += 1,
            Ok(Err(e)) => {
                first_err.get_or_insert_with(|| format!("{}: {}", e.code(), e.message()));
            }
            Err(e) => {
                first_err.get_or_insert_with(|| format!("task failed: {e}"));
            }
        }
    }
    (ok, first_err)
}

fn main() -> anyhow::Result<()> {
    let args = Args::parse();
    // Benchmarks run release builds only (as every `bench/*` script); the smoke test opts in.
    if cfg!(debug_assertions) {
        ensure!(
            std::env::var("TPURAY_ALLOW_DEBUG_BUILD").is_ok_and(|v| v == "1"),
            "head_load is a debug build: its figures would not be tpuray's; build it with \
             `cargo build --release -p tpuray-head-load -p tpuray-cli` (or set \
             TPURAY_ALLOW_DEBUG_BUILD=1 to run it anyway)"
        );
        eprintln!(
            "head_load: warning: a debug build (TPURAY_ALLOW_DEBUG_BUILD=1); figures are not tpuray's"
        );
    }
    ensure!(args.nodes >= 1, "--nodes must be at least 1");
    ensure!(args.seconds >= 1, "--seconds must be at least 1 (the steady heartbeat phase)");
    let cpus = args.nodes as f64 * args.cpus_per_node;
    ensure!(
        args.tasks as f64 <= cpus,
        "--tasks {} needs {} CPUs but the {} nodes have {cpus} (--cpus-per-node {})",
        args.tasks,
        args.tasks,
        args.nodes,
        args.cpus_per_node
    );
    ensure!(args.nodes <= sim::MAX_NODES, "--nodes must be at most {}", sim::MAX_NODES);
    ensure!(
        args.slices * SLICE_HOSTS <= args.nodes,
        "--slices {} needs {} simulated TPU hosts ({} per {SLICE_TYPE} slice) but --nodes is {}",
        args.slices,
        args.slices * SLICE_HOSTS,
        SLICE_HOSTS,
        args.nodes
    );
    let limit = raise_nofile();
    // The head holds a connection to every node's address plus one per heartbeat
    // connection; so does this process (the other ends), plus its own few hundred.
    let margin = 400u64;
    ensure!(
        args.nodes as u64 + margin < limit,
        "--nodes {} needs more than {} open files in the head and in head_load, one per node's \
         agent connection (the open-file limit here is {limit}; raise it with `ulimit -n`)",
        args.nodes,
        args.nodes as u64 + margin
    );
    let per_conn = match args.nodes_per_connection {
        Some(k) => k.max(1),
        None => (1..=args.nodes)
            .find(|k| args.nodes as u64 + args.nodes.div_ceil(*k) as u64 + margin <= limit)
            .unwrap_or(args.nodes),
    };
    let rt = tokio::runtime::Builder::new_multi_thread().enable_all().build()?;
    rt.block_on(run(args, per_conn, limit))
}

async fn run(args: Args, per_conn: usize, nofile: u64) -> anyhow::Result<()> {
    let bin = match (&args.tpuray, std::env::var_os("TPURAY_BIN")) {
        (Some(b), _) => b.clone(),
        (None, Some(b)) => PathBuf::from(b),
        (None, None) => std::env::current_exe()?.parent().context("exe folder")?.join("tpuray"),
    };
    let (own, address, head_pid) = match &args.address {
        Some(a) => {
            let pid = args.head_pid.context("--address needs --head-pid (for its CPU and RSS)")?;
            (None, a.clone(), pid)
        }
        None => {
            let (own, a, pid) = OwnHead::start(&bin, args.keep_head_dir)?;
            (Some(own), a, pid)
        }
    };
    let env_dir = own.as_ref().map(|o| o.dir.clone());
    let head_pid_s = head_pid.to_string();
    let head = tpuray_proto::client::head(&address, None)?;
    let info = head.clone().get_head_info(pb::GetHeadInfoRequest {}).await?.into_inner();
    let interval = Duration::from_millis(info.heartbeat_interval_ms);
    let death_timeout = Duration::from_millis(info.node_death_timeout_ms);
    println!(
        "head_load: head {address} (pid {head_pid}), heartbeat interval {:?}, node death timeout {:?}",
        interval, death_timeout
    );
    println!(
        "head_load: {} simulated nodes ({} CPU each{}), {} per heartbeat connection ({} connections), open-file limit {nofile}",
        args.nodes,
        args.cpus_per_node,
        if args.slices > 0 {
            format!(
                "; {} TPU hosts of {} {SLICE_TYPE} slices",
                args.slices * SLICE_HOSTS,
                args.slices
            )
        } else {
            String::new()
        },
        per_conn,
        args.nodes.div_ceil(per_conn)
    );
    println!(
        "head_load: simulated, not real: actors are records (a stand-in answers StartActorWorker; no worker process runs), leases are records, and the cluster view's entries in heartbeat replies are counted but not parsed"
    );
    let rss0 = rss_mib(&head_pid_s)?;

    // One server for every node (see sim.rs), on every address, loopback peers only.
    let listener = tokio::net::TcpListener::bind("0.0.0.0:0").await?;
    let port = listener.local_addr()?.port();
    let sim = Sim::new(make_nodes(&args, port)?);
    let svc = pb::node_agent_service_server::NodeAgentServiceServer::new(SimSvc(Arc::clone(&sim)))
        .max_decoding_message_size(tpuray_proto::MAX_MESSAGE_BYTES)
        .max_encoding_message_size(tpuray_proto::MAX_MESSAGE_BYTES);
    let incoming = tpuray_proto::incoming(listener).filter(|s| match s {
        Ok(s) => s.peer_addr().is_ok_and(|a: SocketAddr| a.ip().is_loopback()),
        Err(_) => true,
    });
    tokio::spawn(async move {
        if let Err(e) = tonic::transport::Server::builder()
            .tcp_nodelay(true)
            .add_service(svc)
            .serve_with_incoming(incoming)
            .await
        {
            eprintln!("head_load: the simulated nodes' server stopped: {e}");
        }
    });

    // Register; each node's heartbeat loop starts as soon as it is registered (as the
    // real agent's heartbeat thread does), at a random point of its first interval.
    // Per connection: the head client the node registers with, and the heartbeat client
    // on the same connection.
    let clients: Vec<(HeadClient, sim::HeartbeatClient)> = (0..args.nodes.div_ceil(per_conn))
        .map(|_| {
            let ch = tpuray_proto::client::head_channel(&address, None)?;
            let head = HeadClient::new(ch.clone())
                .max_decoding_message_size(tpuray_proto::MAX_MESSAGE_BYTES);
            Ok::<_, tpuray_proto::client::ClientError>((head, sim::HeartbeatClient::new(ch)))
        })
        .collect::<Result<_, _>>()?;
    let t_reg = Instant::now();
    let reg_meter = CpuMeter::start(&head_pid_s)?;
    let (registered, reg_err) = create_all(args.nodes, args.register_concurrency, |i| {
        let sim = Arc::clone(&sim);
        let (mut c, hb) = clients[i / per_conn].clone();
        async move {
            let mut req = Request::new(pb::RegisterNodeRequest {
                request_id: tpuray_proto::new_request_id(),
                protocol_version: tpuray_proto::PROTOCOL_VERSION,
                node: Some(sim.node_info(i)),
            });
            req.set_timeout(Duration::from_secs(60));
            c.register_node(req).await?;
            let first = interval.mul_f64(rand::random::<f64>());
            tokio::spawn(sim::heartbeat_loop(Arc::clone(&sim), i, hb, interval, first));
            Ok(())
        }
    })
    .await;
    let reg_s = t_reg.elapsed().as_secs_f64();
    let (reg_head_cpu, reg_self_cpu, _) = reg_meter.read()?;
    println!(
        "head_load: registered {} of {} nodes in {reg_s:.1} s ({:.0} nodes/s; head {reg_head_cpu:.2} cores, harness {reg_self_cpu:.2} cores){}",
        registered,
        args.nodes,
        registered as f64 / reg_s,
        reg_err.map(|e| format!("; first error: {e}")).unwrap_or_default()
    );

    // Heartbeats alone.
    tokio::time::sleep(interval * 2).await;
    let _ = sim.hb.take();
    let hb_sent0 = sim.hb.sent.load(Ordering::Relaxed);
    let view0 = sim.hb.view_entries.load(Ordering::Relaxed);
    let meter = CpuMeter::start(&head_pid_s)?;
    let (head_sched0, self_sched0) = (sched_seconds(&head_pid_s), sched_seconds("self"));
    tokio::time::sleep(Duration::from_secs(args.seconds)).await;
    let (head_cores, harness_cores, wall) = meter.read()?;
    let (head_sched1, self_sched1) = (sched_seconds(&head_pid_s), sched_seconds("self"));
    let rss = rss_mib(&head_pid_s)?;
    let (mut lat, max_gap_us) = sim.hb.take();
    lat.sort_unstable();
    let hbs = sim.hb.sent.load(Ordering::Relaxed) - hb_sent0;
    let views = sim.hb.view_entries.load(Ordering::Relaxed) - view0;
    println!(
        "head_load: steady {wall:.0} s: {:.0} heartbeats/s, latency ms p50 {:.2} p90 {:.2} p99 {:.2} max {:.2}; longest gap between one node's heartbeats {:.2} s (interval {:.2} s); {:.1} cluster-view entries per reply",
        hbs as f64 / wall,
        percentile(&lat, 0.5),
        percentile(&lat, 0.9),
        percentile(&lat, 0.99),
        percentile(&lat, 1.0),
        max_gap_us as f64 / 1e6,
        interval.as_secs_f64(),
        views as f64 / hbs.max(1) as f64,
    );
    println!(
        "head_load: steady head CPU {head_cores:.3} cores ({:.1} µs per node per second), RSS {rss:.0} MiB ({:.1} KiB per node over the {rss0:.0} MiB before registering); harness CPU {harness_cores:.3} cores",
        head_cores * 1e6 / args.nodes as f64,
        (rss - rss0) * 1024.0 / args.nodes as f64,
    );
    println!(
        "head_load: steady: threads waited for a CPU {:.2} s per s in the head, {:.2} s per s in the harness; machine load average {:.1} on {} CPUs",
        (head_sched1.1 - head_sched0.1) / wall,
        (self_sched1.1 - self_sched0.1) / wall,
        loadavg(),
        std::thread::available_parallelism().map(|n| n.get()).unwrap_or(1),
    );

    // Placement: actors, groups, slices.
    let deadline = || Instant::now() + Duration::from_secs(args.place_timeout);
    let mut job_id = String::new();
    if args.actors + args.pgs + args.slices > 0 {
        let job = head
            .clone()
            .register_job(pb::RegisterJobRequest {
                request_id: tpuray_proto::new_request_id(),
                protocol_version: tpuray_proto::PROTOCOL_VERSION,
                entrypoint: "head_load".into(),
                driver_pid: std::process::id(),
                ..Default::default()
            })
            .await?
            .into_inner()
            .job
            .context("no job in the reply")?;
        job_id = job.job_id;
    }
    if args.actors > 0 {
        let seq = current_seq(&head).await;
        let meter = CpuMeter::start(&head_pid_s)?;
        let t0 = Instant::now();
        let jid = job_id.clone();
        let counter = tokio::spawn(count_placed(
            head.clone(),
            seq,
            args.actors,
            deadline(),
            move |c| match &c.change {
                Some(pb::state_change::Change::Actor(a))
                    if a.job_id == jid && a.state == pb::ActorState::Alive as i32 =>
                {
                    Some(a.actor_id.clone())
                }
                _ => None,
            },
        ));
        let (ok, err) = create_all(args.actors, args.create_concurrency, |i| {
            let mut c = head.clone();
            let job_id = job_id.clone();
            async move {
                c.create_actor(pb::CreateActorRequest {
                    request_id: tpuray_proto::new_request_id(),
                    job_id,
                    class_name: format!("HeadLoadStandIn{}", i % 10),
                    max_restarts: 0,
                    ..Default::default()
                })
                .await
                .map(|_| ())
            }
        })
        .await;
        let submitted = t0.elapsed().as_secs_f64();
        let alive = counter.await?;
        let placed_s = t0.elapsed().as_secs_f64();
        let (hc, sc, _) = meter.read()?;
        println!(
            "head_load: actors: {ok} of {} created in {submitted:.1} s{}, {alive} alive after {placed_s:.1} s ({:.0} actors/s; head {hc:.2} cores, harness {sc:.2} cores; stand-in starts {})",
            args.actors,
            err.map(|e| format!(" (first error: {e})")).unwrap_or_default(),
            alive as f64 / placed_s,
            sim.actor_starts.load(Ordering::Relaxed),
        );
    }
    if args.pgs > 0 {
        let seq = current_seq(&head).await;
        let meter = CpuMeter::start(&head_pid_s)?;
        let t0 = Instant::now();
        let jid = job_id.clone();
        let counter =
            tokio::spawn(count_placed(head.clone(), seq, args.pgs, deadline(), move |c| match &c
                .change
            {
                Some(pb::state_change::Change::PlacementGroup(p))
                    if p.job_id == jid
                        && p.slice.is_none()
                        && p.state == pb::PlacementGroupState::Created as i32 =>
                {
                    Some(p.placement_group_id.clone())
                }
                _ => None,
            }));
        let mut bundle = ResourceSet::new();
        bundle.set("CPU", Amount::whole(1));
        let bundle = pb::Bundle { resources: resources_to_proto(&bundle), label_selector: vec![] };
        let (ok, err) = create_all(args.pgs, args.create_concurrency, |i| {
            let mut c = head.clone();
            let (job_id, bundle) = (job_id.clone(), bundle.clone());
            async move {
                c.create_placement_group(pb::CreatePlacementGroupRequest {
                    request_id: tpuray_proto::new_request_id(),
                    job_id,
                    name: format!("head-load-pg-{i}"),
                    bundles: vec![bundle.clone(), bundle],
                    strategy: "PACK".into(),
                    ..Default::default()
                })
                .await
                .map(|_| ())
            }
        })
        .await;
        let submitted = t0.elapsed().as_secs_f64();
        let created = counter.await?;
        let placed_s = t0.elapsed().as_secs_f64();
        let (hc, sc, _) = meter.read()?;
        println!(
            "head_load: placement groups (2 x {{CPU: 1}}, PACK): {ok} of {} submitted in {submitted:.1} s{}, {created} CREATED after {placed_s:.1} s (head {hc:.2} cores, harness {sc:.2} cores)",
            args.pgs,
            err.map(|e| format!(" (first error: {e})")).unwrap_or_default(),
        );
    }
    if args.slices > 0 {
        let seq = current_seq(&head).await;
        let t0 = Instant::now();
        let jid = job_id.clone();
        let counter = tokio::spawn(count_placed(
            head.clone(),
            seq,
            args.slices,
            deadline(),
            move |c| match &c.change {
                Some(pb::state_change::Change::PlacementGroup(p))
                    if p.job_id == jid
                        && p.slice.is_some()
                        && p.state == pb::PlacementGroupState::Created as i32 =>
                {
                    Some(p.placement_group_id.clone())
                }
                _ => None,
            },
        ));
        let mut bundle = ResourceSet::new();
        bundle.set("TPU", Amount::whole(u64::from(SLICE_CHIPS)));
        let bundle = pb::Bundle { resources: resources_to_proto(&bundle), label_selector: vec![] };
        let (ok, err) = create_all(args.slices, args.create_concurrency, |i| {
            let mut c = head.clone();
            let (job_id, bundle) = (job_id.clone(), bundle.clone());
            async move {
                c.create_placement_group(pb::CreatePlacementGroupRequest {
                    request_id: tpuray_proto::new_request_id(),
                    job_id,
                    name: format!("head-load-slice-group-{i}"),
                    bundles: vec![bundle],
                    strategy: "STRICT_SPREAD".into(),
                    slice: Some(pb::SliceSpec {
                        accelerator_type: SLICE_TYPE.into(),
                        topology: SLICE_TOPOLOGY.into(),
                        num_slices: 1,
                    }),
                    ..Default::default()
                })
                .await
                .map(|_| ())
            }
        })
        .await;
        let created = counter.await?;
        let placed_s = t0.elapsed().as_secs_f64();
        println!(
            "head_load: slice groups ({SLICE_TYPE} {SLICE_TOPOLOGY}, {SLICE_HOSTS} hosts each): {ok} of {} submitted{}, {created} CREATED after {placed_s:.1} s",
            args.slices,
            err.map(|e| format!(" (first error: {e})")).unwrap_or_default(),
        );
    }

    if args.tasks > 0 {
        let _ = sim.hb.take();
        let (hb_sent0, err0) =
            (sim.hb.sent.load(Ordering::Relaxed), sim.hb.errors.load(Ordering::Relaxed));
        let meter = CpuMeter::start(&head_pid_s)?;
        let mean = Duration::from_secs_f64(args.task_seconds.max(0.01));
        let t = run_tasks(&sim, args.tasks, mean, Duration::from_secs(args.task_window)).await;
        let (hc, sc, wall) = meter.read()?;
        let (mut lat, max_gap_us) = sim.hb.take();
        lat.sort_unstable();
        let hbs = sim.hb.sent.load(Ordering::Relaxed) - hb_sent0;
        println!(
            "head_load: tasks (1 CPU each, lease records, {:.1} s on average): {} of {} running at once after {:.1} s, at least {} running through the next {wall:.0} s ({:.0} started/s, {} starts found no free CPU at first try); heartbeats {:.0}/s, latency ms p50 {:.2} p99 {:.2} max {:.2}, longest gap {:.2} s, {} failed; head {hc:.2} cores, harness {sc:.2} cores",
            mean.as_secs_f64(),
            t.running,
            args.tasks,
            t.ramp_s,
            t.min_running,
            t.started as f64 / wall,
            t.retries,
            hbs as f64 / wall,
            percentile(&lat, 0.5),
            percentile(&lat, 0.99),
            percentile(&lat, 1.0),
            max_gap_us as f64 / 1e6,
            sim.hb.errors.load(Ordering::Relaxed) - err0,
        );
    }

    // The CLI against this cluster (a process start each time, as a user runs it).
    for cmd in [
        &["status"][..],
        &["list", "nodes"][..],
        &["list", "actors"][..],
        &["list", "placement-groups"][..],
    ] {
        let (ms, bytes) = time_cli(&bin, env_dir.as_deref(), &address, cmd);
        println!(
            "head_load: `tpuray {}`: {ms:.0} ms (median of 3), {bytes} bytes of output{}",
            cmd.join(" "),
            if cmd[0] == "list" {
                " (its first 100 rows, `tpuray list`'s default --limit)"
            } else {
                ""
            }
        );
    }

    // Raft snapshots (the head snapshots every TPURAY_HEAD_SNAPSHOT_EVERY applied commands).
    let first = address.split(',').next().unwrap_or(&address).to_string();
    if let Ok(mut r) = tpuray_proto::client::head_replica(&first, None)
        && let Ok(st) = r.get_replica_status(pb::GetReplicaStatusRequest {}).await
    {
        let st = st.into_inner();
        if st.snapshot_index > 0 {
            println!(
                "head_load: raft: applied {}, last snapshot at index {}: {:.2} MiB, taken in {:.1} ms ({} snapshots by this head)",
                st.applied_index,
                st.snapshot_index,
                st.last_snapshot_bytes as f64 / (1 << 20) as f64,
                st.last_snapshot_micros as f64 / 1e3,
                st.snapshots_taken,
            );
        } else {
            println!(
                "head_load: raft: applied {}, no snapshot taken yet (one every TPURAY_HEAD_SNAPSHOT_EVERY applied commands, 10,000 by default)",
                st.applied_index
            );
        }
    }

    // False deaths: nodes the head holds dead (or refused) while their heartbeats ran.
    let status =
        head.clone().get_cluster_status(pb::GetClusterStatusRequest {}).await?.into_inner();
    let ours: HashSet<String> = sim.nodes.iter().map(|n| n.node_id.to_string()).collect();
    let dead_in_status = status
        .nodes
        .iter()
        .filter(|n| ours.contains(&n.node_id) && n.state != pb::NodeState::Alive as i32)
        .count();
    let refused = sim.nodes.iter().filter(|n| n.declared_dead.load(Ordering::Relaxed)).count();
    let false_deaths = dead_in_status.max(refused);
    let errors = sim.hb.errors.load(Ordering::Relaxed);
    if errors > 0 {
        println!(
            "head_load: {errors} heartbeats failed (last: {})",
            sim.hb.last_error.lock().unwrap()
        );
    }
    println!(
        "head_load: head calls answered by the stand-ins: {} actor starts, {} kills, {} bundle prepares, {} commits, {} returns, {} ListWorkers",
        sim.actor_starts.load(Ordering::Relaxed),
        sim.actor_kills.load(Ordering::Relaxed),
        sim.bundle_prepares.load(Ordering::Relaxed),
        sim.bundle_commits.load(Ordering::Relaxed),
        sim.bundle_returns.load(Ordering::Relaxed),
        sim.list_workers.load(Ordering::Relaxed),
    );
    sim.stop.store(true, Ordering::Relaxed);
    drop(own);
    println!(
        "head_load: nodes {} false_deaths {false_deaths} head_cpu_cores {head_cores:.3} head_rss_mib {rss:.0} harness_cpu_cores {harness_cores:.3}",
        args.nodes
    );
    if false_deaths > 0 {
        std::process::exit(1);
    }
    Ok(())
}
