//! Harness for tpuray's integration tests: real head, node agent and worker
//! processes on loopback, each cluster with its own temp dir, free port,
//! `HOME` (so its cluster token is private) and process registry (so
//! `tpuray stop` in one test never touches another test's processes).
//!
//! Every wait has a timeout ([`wait_until`], [`eventually`]); a [`Cluster`]
//! stops and, if need be, SIGKILLs what it started when dropped, and prints
//! the tail of every process log when the test is failing
//! (`TPURAY_TEST_KEEP_LOGS=<dir>` also copies every whole log of a failing test there).
//!
//! The suites (`tests/tests/`), each running the real binary: `cluster.rs` (the control
//! plane); `core.rs` (tasks, actors and failures); `recovery.rs` (lineage reconstruction
//! after a node is killed, a lost put, a dead owner); `transfer.rs` (a 1 GiB broadcast to
//! four nodes that pulls from copies, not only the origin); `placement.rs` (placement
//! groups, TPU slice groups and chip blocks on simulated TPU hosts); these four through
//! `src/bin/tpuray-test-driver.rs`, a Rust job whose scenarios the tests drive.
//! `gang.rs`: slice gangs on two simulated v6e-16 slices and a v6e-8 host, every member
//! variable checked against TPU.md, a host killed mid-run. `dashboard.rs`: the dashboard
//! on three heads, a follower's pages showing the leader's data, before and after the
//! leader dies. `ha.rs`: three head replicas, failover with retried request ids, catch-up
//! from disk, a frozen leader, a partition through loopback proxies, every head restarted
//! from disk. `chaos.rs`: the chaos suite, the workloads of
//! `src/bin/tpuray-chaos-driver.rs` under a bounded fault schedule, one short schedule by
//! default and long ones with `TPURAY_CHAOS=1`. `readme.rs`: the README's shell blocks
//! and Rust snippets as written. `invariants.rs`: every tag ARCHITECTURE.md names is
//! written at its code and its test. Also: `objects.rs` and `stale_stores.rs` (the object
//! store under real processes), `tls.rs`, `addresses.rs`, `hosts.rs` and `multihost.rs`
//! (nodes on simulated hosts with addresses of their own), `jobs.rs`, `autoscaler.rs` and
//! `k8s.rs`; each suite's doc says what it covers. Each test has its own temp dir, `HOME` (so its own
//! token), registry folder and free ports, uses short heartbeat timeouts, and prints the
//! tail of every log when it fails.

pub mod hosts;

use std::future::Future;
use std::path::{Path, PathBuf};
use std::process::{Command, Output};
use std::sync::Once;
use std::time::{Duration, Instant};

use tpuray_proto::client::AuthChannel;
use tpuray_proto::pb;
use tpuray_proto::pb::head_service_client::HeadServiceClient;
use tpuray_proto::pb::node_agent_service_client::NodeAgentServiceClient;

/// Heartbeat interval the tests give the head (ms).
pub const HEARTBEAT_MS: u64 = 100;
/// Node death timeout the tests give the head (ms).
pub const DEATH_TIMEOUT_MS: u64 = 1500;
/// Generous bound for anything that should happen "soon" on a loaded 2-core machine.
pub const SOON: Duration = Duration::from_secs(20);

static BUILD: Once = Once::new();

/// Path of the `tpuray` binary, built once per test process when missing.
/// `TPURAY_BIN` overrides it.
pub fn tpuray_bin() -> PathBuf {
    if let Some(p) = std::env::var_os("TPURAY_BIN") {
        return PathBuf::from(p);
    }
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("..");
    let target = std::env::var_os("CARGO_TARGET_DIR")
        .map(|t| root.join(t))
        .unwrap_or_else(|| root.join("target"));
    let bin = target.join("debug").join("tpuray");
    BUILD.call_once(|| {
        if !bin.exists() {
            let cargo = std::env::var("CARGO").unwrap_or_else(|_| "cargo".into());
            let st = Command::new(cargo)
                .args(["build", "-p", "tpuray-cli"])
                .current_dir(&root)
                .status()
                .expect("run cargo build -p tpuray-cli");
            assert!(st.success(), "cargo build -p tpuray-cli failed");
        }
    });
    assert!(bin.exists(), "tpuray binary not found at {}", bin.display());
    bin
}

/// A free loopback port (bound, read, released).
pub fn free_port() -> u16 {
    let l = std::net::TcpListener::bind("127.0.0.1:0").expect("bind 127.0.0.1:0");
    l.local_addr().expect("local addr").port()
}

/// A free loopback port below the kernel's ephemeral range, for servers a test stops
/// and starts again on the same port (a port from [`free_port`] may meanwhile become
/// the source port of some other process's connection).
pub fn stable_port() -> u16 {
    let low = std::fs::read_to_string("/proc/sys/net/ipv4/ip_local_port_range")
        .ok()
        .and_then(|s| s.split_whitespace().next().and_then(|p| p.parse::<u16>().ok()))
        .unwrap_or(32768);
    if low <= 12_000 {
        return free_port();
    }
    use rand::Rng;
    let mut rng = rand::rng();
    for _ in 0..1000 {
        let p = rng.random_range(10_000..low);
        if std::net::TcpListener::bind(("127.0.0.1", p)).is_ok() {
            return p;
        }
    }
    free_port()
}

/// Polls `cond` every 20 ms until it holds; panics naming `what` after `timeout`.
pub fn wait_until(timeout: Duration, what: &str, mut cond: impl FnMut() -> bool) {
    let deadline = Instant::now() + timeout;
    loop {
        if cond() {
            return;
        }
        assert!(Instant::now() < deadline, "timed out after {timeout:?} waiting until {what}");
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// Async [`wait_until`]: polls `f` until it yields `Some`, returns the value.
pub async fn eventually<T, F, Fut>(timeout: Duration, what: &str, mut f: F) -> T
where
    F: FnMut() -> Fut,
    Fut: Future<Output = Option<T>>,
{
    let deadline = Instant::now() + timeout;
    loop {
        if let Some(v) = f().await {
            return v;
        }
        assert!(Instant::now() < deadline, "timed out after {timeout:?} waiting until {what}");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// Runs `fut` with a timeout, panicking naming `what` when it expires.
pub async fn within<T>(timeout: Duration, what: &str, fut: impl Future<Output = T>) -> T {
    match tokio::time::timeout(timeout, fut).await {
        Ok(v) => v,
        Err(_) => panic!("timed out after {timeout:?}: {what}"),
    }
}

/// True while `pid` names a running, non-zombie process.
pub fn pid_alive(pid: u32) -> bool {
    proc_start_time(pid).is_some()
}

/// Start time (`/proc/PID/stat` field 22) of a live, non-zombie process.
pub fn proc_start_time(pid: u32) -> Option<u64> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    let rest = &stat[stat.rfind(')')? + 2..];
    let fields: Vec<&str> = rest.split_whitespace().collect();
    if matches!(fields.first(), Some(&"Z") | Some(&"X")) {
        return None;
    }
    fields.get(19)?.parse().ok()
}

/// Sends `sig` to `pid`.
pub fn signal(pid: u32, sig: i32) {
    // SAFETY: kill(2) has no memory-safety preconditions.
    unsafe {
        libc::kill(pid as i32, sig);
    }
}

/// One process recorded in a cluster's registry folder.
#[derive(Clone, Debug)]
pub struct RegEntry {
    pub pid: u32,
    pub start_time: u64,
    pub kind: String,
    /// The address it serves on (a head's listen address, an agent's address).
    pub address: String,
}

impl RegEntry {
    /// True while the very process this entry names is running.
    pub fn is_alive(&self) -> bool {
        proc_start_time(self.pid) == Some(self.start_time)
    }
}

/// A node started with `tpuray start`.
#[derive(Clone, Debug)]
pub struct NodeHandle {
    /// The node agent's pid.
    pub pid: u32,
    pub node_id: String,
    /// The node agent's gRPC address.
    pub address: String,
    pub temp_dir: PathBuf,
}

/// One head replica of a cluster started with [`Cluster::start_heads`].
#[derive(Clone, Debug)]
pub struct HeadReplica {
    /// 1-based replica id (its position in `--head-peers`).
    pub id: u64,
    /// The address it listens on.
    pub listen: String,
    /// The address clients use for it (its own, or its client-side proxy's).
    pub client_address: String,
    /// Its `--head-peers` list (its own entry first-hand, the others maybe proxied).
    pub peers: String,
    pub data_dir: PathBuf,
}

/// A tpuray cluster started through the CLI, private to one test.
pub struct Cluster {
    dir: tempfile::TempDir,
    port: u16,
    envs: Vec<(String, String)>,
    nodes: usize,
    heads: Vec<HeadReplica>,
    head_starts: usize,
    /// Loopback proxies between replicas (and in front of each for clients), when the
    /// heads were started behind them: `links[i][j]` carries replica i+1's traffic to
    /// replica j+1 (`i == j`: clients' traffic to it).
    links: Vec<Vec<Option<Proxy>>>,
    /// Nodes this cluster started: their shared-memory store folders are removed on drop
    /// (a node agent killed by a test cannot remove its own).
    node_ids: std::sync::Mutex<Vec<String>>,
}

impl Default for Cluster {
    fn default() -> Self {
        Self::new()
    }
}

impl Cluster {
    /// A cluster with nothing started yet, with short heartbeat and death timeouts.
    pub fn new() -> Self {
        let _ = tpuray_bin();
        let dir = tempfile::Builder::new().prefix("tpuray-it-").tempdir().expect("tempdir");
        std::fs::create_dir_all(dir.path().join("home")).expect("create home");
        let mut c = Self {
            dir,
            port: free_port(),
            envs: Vec::new(),
            nodes: 0,
            heads: Vec::new(),
            head_starts: 0,
            links: Vec::new(),
            node_ids: std::sync::Mutex::new(Vec::new()),
        };
        c.set_env("TPURAY_HEARTBEAT_INTERVAL_MS", &HEARTBEAT_MS.to_string());
        c.set_env("TPURAY_NODE_DEATH_TIMEOUT_MS", &DEATH_TIMEOUT_MS.to_string());
        c.set_env("TPURAY_HEAD_CONNECT_TIMEOUT_MS", "10000");
        c
    }

    /// Sets an environment variable for every later CLI call (and so for
    /// every process those calls start).
    pub fn set_env(&mut self, k: &str, v: &str) {
        self.envs.retain(|(kk, _)| kk != k);
        self.envs.push((k.to_string(), v.to_string()));
    }

    pub fn dir(&self) -> &Path {
        self.dir.path()
    }

    pub fn home(&self) -> PathBuf {
        self.dir.path().join("home")
    }

    pub fn registry_dir(&self) -> PathBuf {
        self.dir.path().join("registry")
    }

    /// The head's address; for replicated heads every replica's, comma-separated.
    pub fn head_addr(&self) -> String {
        if self.heads.is_empty() {
            format!("127.0.0.1:{}", self.port)
        } else {
            self.heads.iter().map(|h| h.client_address.clone()).collect::<Vec<_>>().join(",")
        }
    }

    /// The CLI as a command with this cluster's environment.
    pub fn command(&self, args: &[&str]) -> Command {
        let mut cmd = Command::new(tpuray_bin());
        cmd.args(args)
            .env("HOME", self.home())
            .env("TPURAY_REGISTRY_DIR", self.registry_dir())
            .env_remove("TPURAY_ADDRESS")
            .env_remove("TPURAY_AUTH_TOKEN")
            .env_remove("TPURAY_SELF_COMMAND")
            .env_remove("TPURAY_TLS_CERT")
            .env_remove("TPURAY_TLS_KEY")
            .env_remove("TPURAY_TLS_CA")
            .stdin(std::process::Stdio::null());
        for (k, v) in &self.envs {
            cmd.env(k, v);
        }
        cmd
    }

    /// Runs the CLI and returns its output, whatever its exit status.
    pub fn cli(&self, args: &[&str]) -> Output {
        self.command(args).output().expect("run tpuray")
    }

    /// Runs the CLI, panics (with its output) unless it exits 0; returns stdout.
    pub fn cli_ok(&self, args: &[&str]) -> String {
        let out = self.cli(args);
        assert!(
            out.status.success(),
            "tpuray {args:?} failed ({}):\nstdout:\n{}\nstderr:\n{}",
            out.status,
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
        String::from_utf8_lossy(&out.stdout).into_owned()
    }

    /// `tpuray start --head` on this cluster's port with its own temp dir.
    pub fn start_head(&mut self, extra: &[&str]) -> NodeHandle {
        let temp = self.dir.path().join("head");
        let port = self.port.to_string();
        let temp_s = temp.display().to_string();
        let mut args = vec!["start", "--head", "--port", &port, "--temp-dir", &temp_s];
        // Tests stay on loopback (NET-3's default would advertise this machine's address).
        args.extend(["--node-ip-address", "127.0.0.1"]);
        args.extend_from_slice(extra);
        let out = self.cli_ok(&args);
        let node_id = parse_after(&out, "(node ", ')')
            .unwrap_or_else(|| panic!("no node id in `tpuray start --head` output:\n{out}"));
        self.node_handle(node_id, temp)
    }

    /// `tpuray start --address HEAD` with its own temp dir.
    pub fn add_node(&mut self, extra: &[&str]) -> NodeHandle {
        self.nodes += 1;
        let temp = self.dir.path().join(format!("node{}", self.nodes));
        let addr = self.head_addr();
        let temp_s = temp.display().to_string();
        let mut args = vec!["start", "--address", &addr, "--temp-dir", &temp_s];
        args.extend_from_slice(extra);
        let out = self.cli_ok(&args);
        let node_id = parse_after(&out, "tpuray node ", ' ')
            .unwrap_or_else(|| panic!("no node id in `tpuray start --address` output:\n{out}"));
        self.node_handle(node_id, temp)
    }

    fn node_handle(&self, node_id: String, temp_dir: PathBuf) -> NodeHandle {
        let nodes = self.list("nodes");
        let n = nodes
            .as_array()
            .expect("list nodes is a JSON list")
            .iter()
            .find(|n| n["node_id"] == node_id.as_str())
            .unwrap_or_else(|| panic!("node {node_id} not in `tpuray list nodes`: {nodes:#}"))
            .clone();
        let pid = n["pid"].as_u64().expect("node pid") as u32;
        assert!(pid > 0 && pid_alive(pid), "agent pid {pid} of node {node_id} is not alive");
        let address = n["address"].as_str().expect("node address").to_string();
        self.node_ids.lock().unwrap().push(node_id.clone());
        NodeHandle { pid, node_id, address, temp_dir }
    }

    /// Starts `n` head replicas (`--head-only`, each with its own data folder) at
    /// once, as a majority must be up before any of them serves. With `proxied`, every
    /// replica reaches every other through its own loopback proxy and clients reach
    /// each through another, so a test can cut one off ([`Cluster::isolate_head`]).
    /// Nodes join with [`Cluster::add_node`].
    pub fn start_heads(&mut self, n: usize, proxied: bool) -> Vec<HeadReplica> {
        assert!(self.heads.is_empty(), "heads already started");
        let ports: Vec<u16> = (0..n).map(|_| stable_port()).collect();
        let real: Vec<String> = ports.iter().map(|p| format!("127.0.0.1:{p}")).collect();
        if proxied {
            self.links = (0..n)
                .map(|i| {
                    (0..n).map(|j| Some(Proxy::start(&real[j], &format!("{i}->{j}")))).collect()
                })
                .collect();
        }
        for i in 0..n {
            let peers: Vec<String> = (0..n)
                .map(|j| match (&self.links.get(i), i == j) {
                    (Some(row), false) => row[j].as_ref().expect("proxy").address(),
                    _ => real[j].clone(),
                })
                .collect();
            let client_address = match self.links.get(i) {
                Some(row) => row[i].as_ref().expect("proxy").address(),
                None => real[i].clone(),
            };
            self.heads.push(HeadReplica {
                id: i as u64 + 1,
                listen: real[i].clone(),
                client_address,
                peers: peers.join(","),
                data_dir: self.dir.path().join(format!("head-data-{}", i + 1)),
            });
        }
        let children: Vec<(u64, std::process::Child)> = self
            .heads
            .clone()
            .into_iter()
            .map(|h| (h.id, self.head_command(&h).spawn().expect("run tpuray start --head")))
            .collect();
        for (id, child) in children {
            let out = child.wait_with_output().expect("wait for tpuray start --head");
            assert!(
                out.status.success(),
                "starting head {id} failed ({}):\n{}\n{}",
                out.status,
                String::from_utf8_lossy(&out.stdout),
                String::from_utf8_lossy(&out.stderr)
            );
        }
        self.heads.clone()
    }

    fn head_command(&mut self, h: &HeadReplica) -> Command {
        self.head_starts += 1;
        let temp = self.dir.path().join(format!("head{}-{}", h.id, self.head_starts));
        let port = h.listen.rsplit_once(':').map(|(_, p)| p.to_string()).unwrap_or_default();
        let mut cmd = self.command(&[
            "start",
            "--head",
            "--head-only",
            "--head-peers",
            &h.peers,
            "--head-id",
            &h.id.to_string(),
            "--port",
            &port,
            "--head-data-dir",
            &h.data_dir.display().to_string(),
            "--temp-dir",
            &temp.display().to_string(),
        ]);
        cmd.stdout(std::process::Stdio::piped()).stderr(std::process::Stdio::piped());
        cmd
    }

    /// The head replicas started with [`Cluster::start_heads`].
    pub fn heads(&self) -> &[HeadReplica] {
        &self.heads
    }

    /// The pid of head replica `id` while it runs.
    pub fn head_pid(&self, id: u64) -> Option<u32> {
        let h = self.heads.iter().find(|h| h.id == id)?;
        self.registry()
            .into_iter()
            .find(|e| e.kind == "head" && e.address == h.listen && e.is_alive())
            .map(|e| e.pid)
    }

    /// SIGKILLs head replica `id` and waits until it is gone.
    pub fn kill_head(&self, id: u64) {
        let pid = self.head_pid(id).unwrap_or_else(|| panic!("head {id} is not running"));
        signal(pid, libc::SIGCONT);
        signal(pid, libc::SIGKILL);
        wait_until(SOON, &format!("head {id} (pid {pid}) exited"), || !pid_alive(pid));
    }

    /// Starts head replica `id` again on its data folder (it must not be running).
    pub fn restart_head(&mut self, id: u64) {
        let h = self.heads.iter().find(|h| h.id == id).cloned().expect("known head");
        let mut out = self.head_command(&h).output().expect("run tpuray start --head");
        // The port may still be held a moment by a connection of the killed process.
        let deadline = Instant::now() + Duration::from_secs(10);
        while !out.status.success()
            && String::from_utf8_lossy(&out.stderr).contains("in use")
            && Instant::now() < deadline
        {
            std::thread::sleep(Duration::from_millis(200));
            out = self.head_command(&h).output().expect("run tpuray start --head");
        }
        assert!(
            out.status.success(),
            "restarting head {id} failed ({}):\n{}\n{}",
            out.status,
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
    }

    /// Cuts head replica `id` off from the other replicas and from clients (its proxies
    /// swallow traffic, like a network partition) or, with `cut == false`, heals it.
    pub fn isolate_head(&self, id: u64, cut: bool) {
        let i = (id - 1) as usize;
        assert!(!self.links.is_empty(), "heads were not started behind proxies");
        for (a, row) in self.links.iter().enumerate() {
            for (b, p) in row.iter().enumerate() {
                if a == i || b == i {
                    p.as_ref().expect("proxy").set_up(!cut);
                }
            }
        }
    }

    /// Each head replica's Raft status as it answers itself (`None`: no answer).
    pub async fn replica_statuses(&self) -> Vec<Option<pb::GetReplicaStatusReply>> {
        let token = self.token_if_any();
        let mut out = Vec::new();
        for h in &self.heads {
            let r = async {
                let mut c = tpuray_proto::client::head_replica(&h.listen, token.as_deref()).ok()?;
                let mut req = tonic::Request::new(pb::GetReplicaStatusRequest {});
                req.set_timeout(Duration::from_secs(2));
                c.get_replica_status(req).await.ok().map(|r| r.into_inner())
            }
            .await;
            out.push(r);
        }
        out
    }

    /// Waits until a head leads and serves; returns its id.
    pub async fn wait_leader(&self, timeout: Duration) -> u64 {
        eventually(timeout, "a head replica leads and serves", || async {
            self.replica_statuses()
                .await
                .into_iter()
                .flatten()
                .find(|s| s.role == "leader" && s.leader_ready)
                .map(|s| s.id)
        })
        .await
    }

    /// `tpuray status --address HEAD`'s output.
    pub fn status(&self) -> String {
        self.cli_ok(&["status", "--address", &self.head_addr()])
    }

    /// `tpuray list KIND --format json --address HEAD`, parsed.
    pub fn list(&self, kind: &str) -> serde_json::Value {
        let out = self.cli_ok(&["list", kind, "--format", "json", "--address", &self.head_addr()]);
        serde_json::from_str(&out)
            .unwrap_or_else(|e| panic!("`tpuray list {kind}` is not JSON ({e}):\n{out}"))
    }

    /// The node named `node_id` in `tpuray list nodes --format json`.
    pub fn list_node(&self, node_id: &str) -> serde_json::Value {
        let nodes = self.list("nodes");
        nodes
            .as_array()
            .expect("list nodes is a JSON list")
            .iter()
            .find(|n| n["node_id"] == node_id)
            .cloned()
            .unwrap_or_else(|| panic!("node {node_id} not listed: {nodes:#}"))
    }

    /// The cluster token `tpuray start --head` wrote under this cluster's HOME.
    pub fn token(&self) -> String {
        let p = self.home().join(".tpuray").join("auth_token");
        std::fs::read_to_string(&p)
            .unwrap_or_else(|e| panic!("cannot read token {}: {e}", p.display()))
            .trim()
            .to_string()
    }

    /// A head client carrying this cluster's token (if it has one).
    pub fn head_client(&self) -> HeadServiceClient<AuthChannel> {
        let token = self.token_if_any();
        tpuray_proto::client::head(&self.head_addr(), token.as_deref()).expect("head client")
    }

    /// A node agent client carrying this cluster's token (if it has one).
    pub fn agent_client(&self, addr: &str) -> NodeAgentServiceClient<AuthChannel> {
        let token = self.token_if_any();
        tpuray_proto::client::agent(addr, token.as_deref()).expect("agent client")
    }

    fn token_if_any(&self) -> Option<String> {
        let p = self.home().join(".tpuray").join("auth_token");
        std::fs::read_to_string(p).ok().map(|s| s.trim().to_string())
    }

    /// Every process in this cluster's registry folder.
    pub fn registry(&self) -> Vec<RegEntry> {
        let Ok(rd) = std::fs::read_dir(self.registry_dir()) else {
            return vec![];
        };
        rd.filter_map(|e| e.ok())
            .filter(|e| {
                let n = e.file_name().to_string_lossy().into_owned();
                n.starts_with("proc-") && n.ends_with(".json")
            })
            .filter_map(|e| std::fs::read(e.path()).ok())
            .filter_map(|b| serde_json::from_slice::<serde_json::Value>(&b).ok())
            .filter_map(|v| {
                Some(RegEntry {
                    pid: v["pid"].as_u64()? as u32,
                    start_time: v["start_time"].as_u64()?,
                    kind: v["kind"].as_str()?.to_string(),
                    address: v["address"].as_str().unwrap_or_default().to_string(),
                })
            })
            .collect()
    }

    /// Paths of every `*.err` log of every process this cluster started.
    pub fn logs(&self) -> Vec<PathBuf> {
        let mut out = Vec::new();
        let Ok(tops) = std::fs::read_dir(self.dir.path()) else {
            return out;
        };
        for top in tops.filter_map(|e| e.ok()) {
            let Ok(sessions) = std::fs::read_dir(top.path()) else { continue };
            for s in sessions.filter_map(|e| e.ok()) {
                let name = s.file_name().to_string_lossy().into_owned();
                if !name.starts_with("session_") || name == "session_latest" {
                    continue;
                }
                let Ok(logs) = std::fs::read_dir(s.path().join("logs")) else { continue };
                for l in logs.filter_map(|e| e.ok()) {
                    if l.path().extension().is_some_and(|x| x == "err") {
                        out.push(l.path());
                    }
                }
            }
        }
        out.sort();
        out
    }

    /// Prints the last 40 lines of every log; with `TPURAY_TEST_KEEP_LOGS=<dir>` set, also
    /// copies every whole log into `<dir>/<cluster folder>/` for a later look.
    fn print_log_tails(&self) {
        let keep = std::env::var_os("TPURAY_TEST_KEEP_LOGS")
            .map(|d| PathBuf::from(d).join(self.dir.path().file_name().unwrap_or_default()));
        for p in self.logs() {
            if let Some(k) = &keep {
                let _ = std::fs::create_dir_all(k);
                let rel = p.strip_prefix(self.dir.path()).unwrap_or(&p);
                let _ = std::fs::copy(&p, k.join(rel.to_string_lossy().replace('/', "_")));
            }
            let s = std::fs::read_to_string(&p).unwrap_or_default();
            let lines: Vec<&str> = s.lines().collect();
            let tail = &lines[lines.len().saturating_sub(40)..];
            eprintln!("----- tail of {} -----", p.display());
            for l in tail {
                eprintln!("{l}");
            }
        }
    }
}

impl Drop for Cluster {
    fn drop(&mut self) {
        let panicking = std::thread::panicking();
        if panicking {
            self.print_log_tails();
        }
        if self.registry().iter().any(|e| e.is_alive()) {
            let _ = self.command(&["stop", "--force"]).output();
        }
        let left: Vec<RegEntry> = self.registry().into_iter().filter(|e| e.is_alive()).collect();
        for e in &left {
            signal(e.pid, libc::SIGCONT);
            signal(e.pid, libc::SIGKILL);
        }
        if !left.is_empty() {
            eprintln!("tpuray-tests: SIGKILLed processes `tpuray stop --force` left: {left:?}");
        }
        // Store folders of agents a test killed (a stopped agent removes its own).
        for id in self.node_ids.lock().unwrap().iter() {
            let dir = tpuray_objectstore::LocalStore::default_dir(id, &std::env::temp_dir());
            let _ = std::fs::remove_dir_all(dir);
        }
    }
}

/// A loopback TCP proxy that can swallow traffic like a network partition: while down,
/// nothing is forwarded in either direction (connections stay open, silent); when it
/// comes back up, connections that lost bytes are closed and new ones pass again.
pub struct Proxy {
    port: u16,
    up: std::sync::Arc<std::sync::atomic::AtomicBool>,
    /// Bumped on every cut: a connection from an older generation is closed.
    generation: std::sync::Arc<std::sync::atomic::AtomicU64>,
    stop: std::sync::Arc<std::sync::atomic::AtomicBool>,
}

impl Proxy {
    /// Listens on a free loopback port and forwards to `target`.
    pub fn start(target: &str, name: &str) -> Self {
        use std::sync::Arc;
        use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
        let listener = std::net::TcpListener::bind("127.0.0.1:0").expect("bind proxy");
        let port = listener.local_addr().expect("proxy addr").port();
        listener.set_nonblocking(true).expect("nonblocking proxy");
        let up = Arc::new(AtomicBool::new(true));
        let generation = Arc::new(AtomicU64::new(0));
        let stop = Arc::new(AtomicBool::new(false));
        let (u, g, st, target) = (up.clone(), generation.clone(), stop.clone(), target.to_string());
        std::thread::Builder::new()
            .name(format!("proxy-{name}"))
            .spawn(move || {
                while !st.load(Ordering::SeqCst) {
                    match listener.accept() {
                        Ok((client, _)) => {
                            let Ok(server) = std::net::TcpStream::connect(&target) else {
                                continue; // the target is down: like a refused connection
                            };
                            let born = g.load(Ordering::SeqCst);
                            for (from, to) in [
                                (client.try_clone(), server.try_clone()),
                                (server.try_clone(), client.try_clone()),
                            ] {
                                let (Ok(from), Ok(to)) = (from, to) else { continue };
                                let (u, g, st) = (u.clone(), g.clone(), st.clone());
                                std::thread::spawn(move || pump(from, to, born, &u, &g, &st));
                            }
                        }
                        Err(_) => std::thread::sleep(Duration::from_millis(5)),
                    }
                }
            })
            .expect("spawn proxy thread");
        Self { port, up, generation, stop }
    }

    /// The address to connect to.
    pub fn address(&self) -> String {
        format!("127.0.0.1:{}", self.port)
    }

    /// Passes traffic (`true`) or swallows it (`false`).
    pub fn set_up(&self, up: bool) {
        use std::sync::atomic::Ordering;
        if !up {
            self.generation.fetch_add(1, Ordering::SeqCst);
        }
        self.up.store(up, Ordering::SeqCst);
    }
}

impl Drop for Proxy {
    fn drop(&mut self) {
        self.stop.store(true, std::sync::atomic::Ordering::SeqCst);
    }
}

/// Copies `from` to `to` while the proxy is up and the connection is of the current
/// generation; swallows while down; closes both ends when the connection is stale.
fn pump(
    mut from: std::net::TcpStream,
    mut to: std::net::TcpStream,
    born: u64,
    up: &std::sync::atomic::AtomicBool,
    generation: &std::sync::atomic::AtomicU64,
    stop: &std::sync::atomic::AtomicBool,
) {
    use std::io::{Read, Write};
    use std::sync::atomic::Ordering;
    let _ = from.set_read_timeout(Some(Duration::from_millis(50)));
    let mut buf = vec![0u8; 64 * 1024];
    let mut lost = false;
    loop {
        if stop.load(Ordering::SeqCst) {
            break;
        }
        let is_up = up.load(Ordering::SeqCst);
        if is_up && (lost || generation.load(Ordering::SeqCst) != born) {
            break; // bytes were lost while down: this connection is broken for good
        }
        match from.read(&mut buf) {
            Ok(0) => break,
            Ok(n) => {
                if up.load(Ordering::SeqCst) && generation.load(Ordering::SeqCst) == born {
                    if to.write_all(&buf[..n]).is_err() {
                        break;
                    }
                } else {
                    lost = true;
                }
            }
            Err(e)
                if matches!(
                    e.kind(),
                    std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut
                ) => {}
            Err(_) => break,
        }
    }
    let _ = from.shutdown(std::net::Shutdown::Both);
    let _ = to.shutdown(std::net::Shutdown::Both);
}

fn parse_after(s: &str, prefix: &str, end: char) -> Option<String> {
    let i = s.find(prefix)? + prefix.len();
    let rest = &s[i..];
    let j = rest.find(end).unwrap_or(rest.len());
    let v = rest[..j].trim().to_string();
    (!v.is_empty()).then_some(v)
}

/// A driver process (a job binary such as `tpuray-test-driver`) started
/// with a cluster's environment, its stdout and stderr collected line by
/// line as it runs. Killed when dropped; when the test is failing, its
/// output is printed.
pub struct Driver {
    child: Option<std::process::Child>,
    what: String,
    stdout: std::sync::Arc<std::sync::Mutex<Vec<String>>>,
    stderr: std::sync::Arc<std::sync::Mutex<Vec<String>>>,
    readers: Vec<std::thread::JoinHandle<()>>,
    status: Option<std::process::ExitStatus>,
}

/// How a [`Driver`] ended.
#[derive(Debug)]
pub struct DriverOutput {
    pub status: std::process::ExitStatus,
    pub stdout: Vec<String>,
    pub stderr: Vec<String>,
}

impl DriverOutput {
    /// The first stdout line starting with `prefix`, or a panic showing the output.
    pub fn line(&self, prefix: &str) -> &str {
        self.stdout
            .iter()
            .find(|l| l.starts_with(prefix))
            .unwrap_or_else(|| panic!("driver printed no line starting with {prefix:?}:\n{self}"))
    }

    /// Panics (showing the output) unless the driver exited 0.
    pub fn assert_success(&self) {
        assert!(self.status.success(), "driver failed ({}):\n{self}", self.status);
    }
}

impl std::fmt::Display for DriverOutput {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        writeln!(f, "exit: {}\n--- stdout ---", self.status)?;
        for l in &self.stdout {
            writeln!(f, "{l}")?;
        }
        writeln!(f, "--- stderr ---")?;
        for l in &self.stderr {
            writeln!(f, "{l}")?;
        }
        Ok(())
    }
}

fn collect_lines(
    r: impl std::io::Read + Send + 'static,
    into: std::sync::Arc<std::sync::Mutex<Vec<String>>>,
) -> std::thread::JoinHandle<()> {
    std::thread::spawn(move || {
        use std::io::BufRead;
        for line in std::io::BufReader::new(r).lines() {
            let Ok(line) = line else { break };
            into.lock().unwrap_or_else(|e| e.into_inner()).push(line);
        }
    })
}

impl Driver {
    /// Starts `bin ARGS` with `cluster`'s environment (`HOME`, registry, timeouts)
    /// plus `envs`.
    pub fn start(cluster: &Cluster, bin: &Path, args: &[&str], envs: &[(&str, &str)]) -> Self {
        let mut cmd = Command::new(bin);
        cmd.args(args)
            .env("HOME", cluster.home())
            .env("TPURAY_REGISTRY_DIR", cluster.registry_dir())
            .env_remove("TPURAY_ADDRESS")
            .env_remove("TPURAY_AUTH_TOKEN")
            .env_remove("TPURAY_WORKER_ID")
            .env_remove("TPURAY_FAIL_ON_INFEASIBLE")
            .stdin(std::process::Stdio::null())
            .stdout(std::process::Stdio::piped())
            .stderr(std::process::Stdio::piped());
        for (k, v) in &cluster.envs {
            cmd.env(k, v);
        }
        for (k, v) in envs {
            cmd.env(k, v);
        }
        let mut child =
            cmd.spawn().unwrap_or_else(|e| panic!("cannot start {}: {e}", bin.display()));
        let stdout = std::sync::Arc::new(std::sync::Mutex::new(Vec::new()));
        let stderr = std::sync::Arc::new(std::sync::Mutex::new(Vec::new()));
        let readers = vec![
            collect_lines(child.stdout.take().expect("piped stdout"), stdout.clone()),
            collect_lines(child.stderr.take().expect("piped stderr"), stderr.clone()),
        ];
        Self {
            child: Some(child),
            what: format!("{} {args:?}", bin.display()),
            stdout,
            stderr,
            readers,
            status: None,
        }
    }

    /// The driver's pid.
    pub fn pid(&self) -> u32 {
        self.child.as_ref().map(|c| c.id()).unwrap_or(0)
    }

    /// Stdout lines so far.
    pub fn stdout(&self) -> Vec<String> {
        self.stdout.lock().unwrap_or_else(|e| e.into_inner()).clone()
    }

    /// Stderr lines so far.
    pub fn stderr(&self) -> Vec<String> {
        self.stderr.lock().unwrap_or_else(|e| e.into_inner()).clone()
    }

    fn exited(&mut self) -> bool {
        if self.status.is_none()
            && let Some(c) = self.child.as_mut()
        {
            self.status = c.try_wait().ok().flatten();
        }
        self.status.is_some()
    }

    fn output_so_far(&self) -> String {
        format!(
            "--- stdout of {} ---\n{}\n--- stderr ---\n{}",
            self.what,
            self.stdout().join("\n"),
            self.stderr().join("\n")
        )
    }

    /// Waits for a stdout line starting with `prefix` and returns it; panics
    /// (showing the output) after `timeout` or when the driver exits first.
    pub fn wait_line(&mut self, prefix: &str, timeout: Duration) -> String {
        self.wait_for(timeout, &format!("stdout line starting with {prefix:?}"), |d| {
            d.stdout().into_iter().find(|l| l.starts_with(prefix))
        })
    }

    /// Waits for a stderr line containing `needle` and returns it.
    pub fn wait_stderr(&mut self, needle: &str, timeout: Duration) -> String {
        self.wait_for(timeout, &format!("stderr line containing {needle:?}"), |d| {
            d.stderr().into_iter().find(|l| l.contains(needle))
        })
    }

    fn wait_for(
        &mut self,
        timeout: Duration,
        what: &str,
        mut f: impl FnMut(&Self) -> Option<String>,
    ) -> String {
        let deadline = Instant::now() + timeout;
        loop {
            if let Some(l) = f(self) {
                return l;
            }
            let exited = self.exited();
            if exited {
                // The readers may still hold the last lines.
                std::thread::sleep(Duration::from_millis(100));
                if let Some(l) = f(self) {
                    return l;
                }
            }
            assert!(
                !exited && Instant::now() < deadline,
                "{} before the driver printed a {what} (waited {timeout:?})\n{}",
                if exited { "driver exited" } else { "timed out" },
                self.output_so_far()
            );
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    /// Waits at most `timeout` for the driver to exit (SIGKILLing it after)
    /// and returns everything it printed.
    pub fn finish(mut self, timeout: Duration) -> DriverOutput {
        let deadline = Instant::now() + timeout;
        while !self.exited() {
            if Instant::now() >= deadline {
                let out = self.output_so_far();
                self.kill();
                panic!("driver still running after {timeout:?}, killed\n{out}");
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        for r in self.readers.drain(..) {
            let _ = r.join();
        }
        DriverOutput {
            status: self.status.expect("exited"),
            stdout: self.stdout(),
            stderr: self.stderr(),
        }
    }

    fn kill(&mut self) {
        if let Some(mut c) = self.child.take() {
            if self.status.is_none() {
                let _ = c.kill();
            }
            let _ = c.wait();
        }
    }
}

impl Drop for Driver {
    fn drop(&mut self) {
        if std::thread::panicking() && self.child.is_some() {
            eprintln!("{}", self.output_so_far());
        }
        self.kill();
    }
}

/// Busy-loop child processes, killed when dropped.
pub struct Burners(Vec<std::process::Child>);

impl Burners {
    /// Starts `n` `sh -c 'while :; do :; done'` processes.
    pub fn start(n: usize) -> Self {
        Self(
            (0..n)
                .map(|_| {
                    Command::new("sh")
                        .args(["-c", "while :; do :; done"])
                        .stdin(std::process::Stdio::null())
                        .spawn()
                        .expect("spawn busy loop")
                })
                .collect(),
        )
    }
}

impl Drop for Burners {
    fn drop(&mut self) {
        for c in &mut self.0 {
            let _ = c.kill();
            let _ = c.wait();
        }
    }
}

/// Number of CPUs this machine has.
pub fn nproc() -> usize {
    std::thread::available_parallelism().map(|n| n.get()).unwrap_or(1)
}

/// A lease request for `resources` with a fresh request id.
pub fn lease_request(job_id: &str, resources: &[(&str, f64)]) -> pb::RequestWorkerLeaseRequest {
    pb::RequestWorkerLeaseRequest {
        request_id: tpuray_proto::new_request_id(),
        job_id: job_id.to_string(),
        resources: resources.iter().map(|(k, v)| (k.to_string(), *v)).collect(),
        ..Default::default()
    }
}

/// The state string of a node in `tpuray list nodes --format json`.
pub fn node_state(n: &serde_json::Value) -> &str {
    n["state"].as_str().unwrap_or("")
}

/// Every node of the head's `GetClusterStatus` is ALIVE.
pub async fn all_alive(head: &mut HeadServiceClient<AuthChannel>) -> Result<bool, tonic::Status> {
    let st = head.get_cluster_status(pb::GetClusterStatusRequest {}).await?.into_inner();
    Ok(st.nodes.iter().all(|n| n.state == pb::NodeState::Alive as i32))
}

/// A plain HTTP/1.1 request to a head's HTTP server (no client crate needed), with the
/// token as `Authorization: Bearer` when given; returns (status, body).
pub fn http(url: &str, method: &str, path: &str, token: Option<&str>, body: &str) -> (u16, String) {
    use std::io::{Read, Write};
    let host = url.trim_start_matches("http://");
    let mut s = std::net::TcpStream::connect(host).expect("connect to the dashboard");
    s.set_read_timeout(Some(Duration::from_secs(15))).unwrap();
    let auth = token.map(|t| format!("Authorization: Bearer {t}\r\n")).unwrap_or_default();
    write!(
        s,
        "{method} {path} HTTP/1.1\r\nHost: {host}\r\n{auth}Content-Type: application/json\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{body}",
        body.len()
    )
    .unwrap();
    let mut out = String::new();
    s.read_to_string(&mut out).expect("read the response");
    let status = out.split_whitespace().nth(1).and_then(|c| c.parse().ok()).unwrap_or(0);
    let body = out.split_once("\r\n\r\n").map(|(_, b)| b.to_string()).unwrap_or_default();
    (status, body)
}

impl Cluster {
    /// Each head replica's HTTP server (`GetHeadInfo.dashboard_url`), by replica id.
    pub async fn dashboards(&self) -> Vec<(u64, String)> {
        let token = self.token();
        let mut out = Vec::new();
        for h in self.heads() {
            let mut client = tpuray_proto::client::head_replica(&h.listen, Some(&token)).unwrap();
            let info = client.get_head_info(pb::GetHeadInfoRequest {}).await.expect("head info");
            out.push((h.id, info.into_inner().dashboard_url));
        }
        out
    }
}
