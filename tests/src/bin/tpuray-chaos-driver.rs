//! `tpuray-chaos-driver SCENARIO HEAD_ADDRS DIR [ARGS...]`: the job binary of the
//! head-availability and chaos tests (`tests/ha.rs`, `tests/chaos.rs`). Node agents
//! start this same binary as the job's workers.
//!
//! Scenarios:
//! - `keeper DIR NODE NODE`: detached named actors `keeper` and `lost` on node a (the
//!   one of the two this driver attached to), `moved` on node b; prints `NODES a= b=`, `ACTOR name= id= pid=` for each, `READY`, waits for
//!   `DIR/go`, then calls each through the handle it kept (`OLD_HANDLE name= pid=`)
//!   and `keeper` by name (`BY_NAME id= pid=`).
//! - `workload DIR ROUNDS`: four workloads at once, each `ROUNDS` long: nested tasks
//!   (`max_retries=-1`), numbered messages to an actor (`max_restarts=-1`,
//!   `max_task_retries=-1`), placement
//!   group create/remove churn, 10 MB objects passed between tasks. Prints
//!   `PROGRESS workload= n=` as it goes, one `CHECK workload= ok= detail=` per
//!   workload, then `DONE`.
//!
//! The message actor has `max_task_retries=-1`, so a call cut by a crash goes to the
//! restart by itself; should one still fail, this driver sends it again with the same
//! number (`resent=` counts those) and the check is still at-least-once delivery.

use std::io::Write;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use anyhow::{Context, bail};
use tpuray::{ActorOptions, TaskOptions};

fn say(line: &str) {
    let mut out = std::io::stdout().lock();
    let _ = writeln!(out, "{line}");
    let _ = out.flush();
}

fn arg(args: &[String], i: usize, what: &str) -> anyhow::Result<String> {
    args.get(i).cloned().with_context(|| format!("missing argument {i}: {what}"))
}

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

/// Appends every message number it receives to a file, which outlives restarts.
pub struct Ledger {
    path: String,
}

#[tpuray::actor]
impl Ledger {
    pub fn new(path: String) -> Self {
        Ledger { path }
    }
    pub fn record(&mut self, n: u64) -> Result<u64, String> {
        let mut f = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(&self.path)
            .map_err(|e| e.to_string())?;
        writeln!(f, "{n}").map_err(|e| e.to_string())?;
        Ok(n)
    }
    pub fn pid(&self) -> u32 {
        std::process::id()
    }
}

fn nested_opts() -> TaskOptions {
    TaskOptions { max_retries: -1, ..Default::default() }.num_cpus(0.0)
}

/// A tree of tasks `depth` deep and `fanout` wide; returns its number of leaves.
#[tpuray::remote]
fn tree(depth: u32, fanout: u32) -> Result<u64, String> {
    if depth == 0 {
        return Ok(1);
    }
    let kids: Vec<_> =
        (0..fanout).map(|_| tree::options(nested_opts()).remote(depth - 1, fanout)).collect();
    let counts = tpuray::get_all(&kids).map_err(|e| e.to_string())?;
    Ok(counts.iter().sum())
}

const BLOB: usize = 10 * 1024 * 1024;

fn pattern(seed: u64, i: usize) -> u8 {
    (seed as usize).wrapping_mul(31).wrapping_add(i) as u8
}

#[tpuray::remote]
fn make_blob(seed: u64) -> tpuray::Blob {
    tpuray::Blob((0..BLOB).map(|i| pattern(seed, i)).collect())
}

#[tpuray::remote]
fn byte_sum(b: tpuray::Blob) -> (u64, u64) {
    (b.0.len() as u64, b.0.iter().map(|x| u64::from(*x)).sum())
}

fn blob_expect(seed: u64) -> (u64, u64) {
    (BLOB as u64, (0..BLOB).map(|i| u64::from(pattern(seed, i))).sum())
}

fn main() -> anyhow::Result<()> {
    let args: Vec<String> = std::env::args().collect();
    if tpuray::worker::is_worker_process() {
        tpuray::init(None)?;
        unreachable!("init returns only in a driver");
    }
    let scenario = arg(&args, 1, "scenario")?;
    let addr = arg(&args, 2, "head addresses")?;
    let dir = PathBuf::from(arg(&args, 3, "work dir")?);
    tpuray::init(Some(&addr))?;
    say(&format!("INFO node={}", tpuray::node_id()?));
    let r = match scenario.as_str() {
        "keeper" => keeper(&dir, &arg(&args, 4, "node a")?, &arg(&args, 5, "node b")?),
        "workload" => workload(&dir, arg(&args, 4, "rounds")?.parse()?),
        other => Err(anyhow::anyhow!("unknown scenario {other:?}")),
    };
    tpuray::shutdown();
    r
}

/// Detached named actors that the test finds again after every head restarted:
/// `keeper` and `lost` on node `a`, `moved` on node `b`. While the heads are down the
/// test kills `lost`'s worker and `b`'s agent.
fn keeper(dir: &Path, x: &str, y: &str) -> anyhow::Result<()> {
    // Node a is this driver's own (the test spares its agent), b the other one.
    let me = tpuray::node_id()?;
    let (a, b) = if me == y { (y, x) } else { (x, y) };
    say(&format!("NODES a={a} b={b}"));
    let log = dir.join("keeper.log").display().to_string();
    let on = |node: &str| tpuray::Scheduling::NodeAffinity { node_id: node.into(), soft: true };
    let mut actors = Vec::new();
    for (name, node) in [("keeper", a), ("lost", a), ("moved", b)] {
        let h = Ledger::options(ActorOptions {
            name: Some(name.into()),
            detached: true,
            max_restarts: -1,
            scheduling: on(node),
            ..Default::default()
        })
        .remote(log.clone())?;
        tpuray::get(&h.record(1))?;
        let pid = tpuray::get(&h.pid())?;
        say(&format!("ACTOR name={name} id={} pid={pid}", h.handle().actor_id));
        actors.push((name, h));
    }
    say("READY");
    wait_for_file(&dir.join("go"), Duration::from_secs(180))?;
    for (name, h) in &actors {
        tpuray::get_timeout(&h.record(2), Duration::from_secs(60))?;
        let pid = tpuray::get_timeout(&h.pid(), Duration::from_secs(60))?;
        say(&format!("OLD_HANDLE name={name} pid={pid}"));
    }
    let found = LedgerHandle(tpuray::get_actor("keeper", None)?);
    tpuray::get_timeout(&found.record(3), Duration::from_secs(60))?;
    let pid = tpuray::get_timeout(&found.pid(), Duration::from_secs(60))?;
    say(&format!("BY_NAME id={} pid={pid}", found.0.actor_id));
    Ok(())
}

/// Runs `f` until it succeeds, at most `tries` times; returns the result and the
/// number of failed attempts.
fn retry<T>(tries: u32, mut f: impl FnMut() -> anyhow::Result<T>) -> anyhow::Result<(T, u32)> {
    let mut failed = 0;
    loop {
        match f() {
            Ok(v) => return Ok((v, failed)),
            Err(e) if failed + 1 < tries => {
                failed += 1;
                say(&format!("RETRY after: {}", e.to_string().replace('\n', " | ")));
                std::thread::sleep(Duration::from_millis(200));
            }
            Err(e) => return Err(e),
        }
    }
}

fn check(name: &str, r: anyhow::Result<String>) -> bool {
    match r {
        Ok(detail) => {
            say(&format!("CHECK workload={name} ok=true detail={detail}"));
            true
        }
        Err(e) => {
            say(&format!(
                "CHECK workload={name} ok=false detail={}",
                e.to_string().replace('\n', " | ")
            ));
            false
        }
    }
}

fn workload(dir: &Path, rounds: u64) -> anyhow::Result<()> {
    let wait = Duration::from_secs(120);
    let nested = std::thread::spawn(move || -> anyhow::Result<String> {
        for i in 0..rounds {
            let r = tree::options(nested_opts()).remote(2, 3);
            let leaves = tpuray::get_timeout(&r, wait).map_err(anyhow::Error::msg)?;
            anyhow::ensure!(leaves == 9, "round {i}: tree gave {leaves:?}, expected 9 leaves");
            say(&format!("PROGRESS workload=nested n={}", i + 1));
        }
        Ok(format!("rounds={rounds}"))
    });
    let log = dir.join("ledger.log");
    let log_s = log.display().to_string();
    let messages = std::thread::spawn(move || -> anyhow::Result<String> {
        let l = Ledger::options(ActorOptions {
            max_restarts: -1,
            max_task_retries: -1,
            ..Default::default()
        })
        .remote(log_s)?;
        let n = rounds * 5;
        let mut resent = 0;
        for i in 0..n {
            let (v, failed) =
                retry(60, || tpuray::get_timeout(&l.record(i), wait).map_err(anyhow::Error::msg))?;
            resent += failed;
            anyhow::ensure!(v == i, "message {i} answered {v:?}");
            if i % 5 == 4 {
                say(&format!("PROGRESS workload=messages n={}", i + 1));
            }
        }
        let text = std::fs::read_to_string(&log)?;
        let got: std::collections::BTreeSet<u64> =
            text.lines().filter_map(|l| l.trim().parse().ok()).collect();
        let missing: Vec<u64> = (0..n).filter(|i| !got.contains(i)).collect();
        anyhow::ensure!(missing.is_empty(), "messages never delivered: {missing:?}");
        Ok(format!("messages={n} resent={resent}"))
    });
    let churn = std::thread::spawn(move || -> anyhow::Result<String> {
        let job = tpuray::job_id()?;
        for i in 0..rounds {
            // A name makes a retried creation idempotent for this driver too.
            let name = format!("churn-{job}-{i}");
            let bundles = vec![tpuray::placement_group::BundleSpec::from([("CPU".into(), 0.5)]); 2];
            let opts = tpuray::placement_group::PlacementGroupOptions {
                name: Some(name.clone()),
                ..Default::default()
            };
            let (pg, _) = retry(30, || {
                match tpuray::placement_group::placement_group_with(&bundles, "PACK", &opts) {
                    Ok(pg) => Ok(pg),
                    Err(e) if e.to_string().contains("already exists") => {
                        Ok(tpuray::placement_group::get_placement_group(&name, None)?)
                    }
                    Err(e) => Err(e.into()),
                }
            })?;
            retry(30, || {
                anyhow::ensure!(pg.wait(Duration::from_secs(30))?, "group {name} not created");
                Ok(())
            })?;
            retry(30, || Ok(tpuray::placement_group::remove_placement_group(&pg)?))?;
            say(&format!("PROGRESS workload=churn n={}", i + 1));
        }
        Ok(format!("groups={rounds}"))
    });
    let objects = std::thread::spawn(move || -> anyhow::Result<String> {
        let opts = || TaskOptions { max_retries: -1, ..Default::default() };
        let mut redone = 0;
        for i in 0..rounds {
            let (got, failed) = retry(20, || {
                let blob = make_blob::options(opts()).remote(i);
                tpuray::get_timeout(&byte_sum::options(opts()).remote(&blob), wait)
                    .map_err(anyhow::Error::msg)
            })?;
            redone += failed;
            anyhow::ensure!(
                got == blob_expect(i),
                "round {i}: bytes {got:?}, expected {:?}",
                blob_expect(i)
            );
            say(&format!("PROGRESS workload=objects n={}", i + 1));
        }
        Ok(format!("rounds={rounds} redone={redone}"))
    });
    let mut all = true;
    for (name, h) in
        [("nested", nested), ("messages", messages), ("churn", churn), ("objects", objects)]
    {
        let r = h.join().unwrap_or_else(|_| Err(anyhow::anyhow!("{name} thread panicked")));
        all &= check(name, r);
    }
    say(&format!("DONE ok={all}"));
    Ok(())
}
