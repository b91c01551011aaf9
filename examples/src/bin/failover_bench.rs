//! `failover_bench`: how long the cluster is without a head that can create an actor
//! after its Raft leader is killed. Starts its own cluster (three head replicas with
//! `--head-only` and one node, in a private temp folder, auth disabled), joins it as a
//! driver, then ROUNDS times (default 20): SIGKILLs the leader and measures the time
//! to the first actor creation committed by the new leader, and to that actor's first
//! answered call; restarts the killed head from its data folder and waits until it
//! caught up. Prints every sample and the medians.
//!
//!   cargo build --release -p tpuray-cli -p tpuray-examples
//!   target/release/failover_bench [ROUNDS]
//!
//! Uses the `tpuray` binary next to its own (or `TPURAY_BIN`).

use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::{Duration, Instant};

use anyhow::{Context, bail};
use tpuray_proto::pb;

#[derive(Default)]
pub struct Probe;

#[tpuray::actor]
impl Probe {
    pub fn new() -> Self {
        Probe
    }
    pub fn ping(&self) -> u32 {
        std::process::id()
    }
}

struct Bench {
    bin: PathBuf,
    dir: PathBuf,
    peers: Vec<String>,
    starts: usize,
}

impl Bench {
    fn cli(&self) -> Command {
        let mut c = Command::new(&self.bin);
        c.env("HOME", self.dir.join("home"))
            .env("TPURAY_REGISTRY_DIR", self.dir.join("registry"))
            .env_remove("TPURAY_ADDRESS");
        c
    }

    fn start_head(&mut self, id: usize) -> Command {
        self.starts += 1;
        let port =
            self.peers[id - 1].rsplit_once(':').map(|(_, p)| p.to_string()).unwrap_or_default();
        let mut c = self.cli();
        c.args(["start", "--head", "--head-only", "--auth-mode", "disabled", "--head-peers"])
            .arg(self.peers.join(","))
            .args(["--head-id", &id.to_string(), "--port", &port, "--head-data-dir"])
            .arg(self.dir.join(format!("data-{id}")))
            .arg("--temp-dir")
            .arg(self.dir.join(format!("head{id}-{}", self.starts)))
            .stdout(std::process::Stdio::null());
        c
    }

    /// The pid of the head listening on `addr`, from the private process registry.
    fn head_pid(&self, addr: &str) -> Option<u32> {
        let rd = std::fs::read_dir(self.dir.join("registry")).ok()?;
        for e in rd.flatten() {
            let Ok(b) = std::fs::read(e.path()) else { continue };
            let Ok(v) = serde_json::from_slice::<serde_json::Value>(&b) else { continue };
            if v["kind"] == "head" && v["address"] == addr {
                let pid = v["pid"].as_u64()? as u32;
                if Path::new(&format!("/proc/{pid}")).exists() {
                    return Some(pid);
                }
            }
        }
        None
    }
}

/// Each replica's status (`None`: no answer).
async fn statuses(peers: &[String]) -> Vec<Option<pb::GetReplicaStatusReply>> {
    let mut out = Vec::new();
    for p in peers {
        let r = async {
            let mut c = tpuray_proto::client::head_replica(p, None).ok()?;
            let mut req = tonic::Request::new(pb::GetReplicaStatusRequest {});
            req.set_timeout(Duration::from_secs(1));
            c.get_replica_status(req).await.ok().map(|r| r.into_inner())
        }
        .await;
        out.push(r);
    }
    out
}

fn free_port() -> anyhow::Result<u16> {
    Ok(std::net::TcpListener::bind("127.0.0.1:0")?.local_addr()?.port())
}

fn median(v: &mut [f64]) -> f64 {
    v.sort_by(|a, b| a.total_cmp(b));
    let n = v.len();
    if n % 2 == 1 { v[n / 2] } else { (v[n / 2 - 1] + v[n / 2]) / 2.0 }
}

fn main() -> anyhow::Result<()> {
    // Started by a node agent as this job's worker: serve and never return.
    if tpuray::worker::is_worker_process() {
        tpuray::init(None)?;
        unreachable!("init returns only in a driver");
    }
    let rounds: usize = std::env::args().nth(1).map(|s| s.parse()).transpose()?.unwrap_or(20);
    let bin = match std::env::var_os("TPURAY_BIN") {
        Some(b) => PathBuf::from(b),
        None => std::env::current_exe()?.parent().context("exe folder")?.join("tpuray"),
    };
    let dir = std::env::temp_dir().join(format!("tpuray-failover-{}", std::process::id()));
    std::fs::create_dir_all(dir.join("home"))?;
    let peers: Vec<String> =
        (0..3).map(|_| free_port().map(|p| format!("127.0.0.1:{p}"))).collect::<Result<_, _>>()?;
    let mut b = Bench { bin, dir: dir.clone(), peers, starts: 0 };
    let result = run(&mut b, rounds);
    let _ = b.cli().args(["stop", "--force"]).stdout(std::process::Stdio::null()).status();
    let _ = std::fs::remove_dir_all(&dir);
    result
}

fn run(b: &mut Bench, rounds: usize) -> anyhow::Result<()> {
    let mut children = Vec::new();
    for id in 1..=3 {
        children.push(b.start_head(id).spawn()?);
    }
    for mut c in children {
        anyhow::ensure!(c.wait()?.success(), "a head did not start");
    }
    let address = b.peers.join(",");
    let st = b
        .cli()
        .args(["start", "--address", &address, "--num-cpus", "4", "--temp-dir"])
        .arg(b.dir.join("node"))
        .stdout(std::process::Stdio::null())
        .status()?;
    anyhow::ensure!(st.success(), "the node did not start");
    // The bench's registry is its own: it lists the node this driver attaches to.
    let opts = tpuray::DriverOptions {
        upload_binary: true,
        registry_dir: Some(b.dir.join("registry")),
        ..Default::default()
    };
    tpuray::init_with(Some(&address), &opts)?;
    let rt = tokio::runtime::Builder::new_current_thread().enable_all().build()?;
    // Warm up: the first actor pays for the job binary and a worker start.
    let warm = Probe::remote()?;
    tpuray::get(&warm.ping())?;
    tpuray::kill_actor(&warm.handle().actor_id, true)?;

    let (mut created, mut answered) = (Vec::new(), Vec::new());
    for round in 1..=rounds {
        let leader = rt
            .block_on(statuses(&b.peers))
            .into_iter()
            .flatten()
            .find(|s| s.role == "leader" && s.leader_ready)
            .map(|s| s.id as usize)
            .context("no serving leader")?;
        let pid = b.head_pid(&b.peers[leader - 1]).context("leader pid")?;
        let t0 = Instant::now();
        // SAFETY: kill(2) has no memory-safety preconditions.
        unsafe {
            libc::kill(pid as i32, libc::SIGKILL);
        }
        let probe = Probe::remote()?;
        let c = t0.elapsed();
        tpuray::get_timeout(&probe.ping(), Duration::from_secs(60))?;
        let a = t0.elapsed();
        created.push(c.as_secs_f64() * 1e3);
        answered.push(a.as_secs_f64() * 1e3);
        println!(
            "round {round}: killed head {leader}; actor created after {:.0} ms, first call answered after {:.0} ms",
            c.as_secs_f64() * 1e3,
            a.as_secs_f64() * 1e3
        );
        tpuray::kill_actor(&probe.handle().actor_id, true)?;
        while Path::new(&format!("/proc/{pid}")).exists() {
            std::thread::sleep(Duration::from_millis(10));
        }
        anyhow::ensure!(b.start_head(leader).status()?.success(), "head {leader} did not restart");
        // Next round once the restarted head holds everything committed.
        let deadline = Instant::now() + Duration::from_secs(60);
        loop {
            let st = rt.block_on(statuses(&b.peers));
            let lead = st.iter().flatten().find(|s| s.role == "leader" && s.leader_ready);
            let back = st[leader - 1].as_ref();
            if let (Some(l), Some(r)) = (lead, back)
                && r.applied_index >= l.commit_index
            {
                break;
            }
            if Instant::now() > deadline {
                bail!("head {leader} did not catch up within 60 s");
            }
            std::thread::sleep(Duration::from_millis(50));
        }
    }
    tpuray::shutdown();
    println!(
        "kill leader -> first actor created through the new leader: median {:.0} ms over {rounds} kills (min {:.0}, max {:.0})",
        median(&mut created),
        created.first().copied().unwrap_or_default(),
        created.last().copied().unwrap_or_default()
    );
    println!(
        "kill leader -> that actor's first call answered: median {:.0} ms (min {:.0}, max {:.0})",
        median(&mut answered),
        answered.first().copied().unwrap_or_default(),
        answered.last().copied().unwrap_or_default()
    );
    Ok(())
}
