//! `object_bench`: object store bandwidth from the Rust SDK, next to a plain
//! `copy_from_slice` of the same size measured in the same run: put and get of
//! 100 MB and 800 MB objects (or the sizes given, in MB), one client and 4
//! clients (tasks, each in its own worker process) putting at once, and a
//! second node agent on this machine reading an object put on the first
//! (pulled between the two stores over gRPC).
//!
//! Starts its own two-node cluster with the `tpuray` binary next to this one
//! (its own registry folder, stopped at the end):
//!
//!   cargo build --release -p tpuray-examples -p tpuray-cli
//!   target/release/object_bench [SIZE_MB ...]
//!
//! Figures are medians of ROUNDS rounds (default 5), bandwidths in GB/s
//! (10^9 bytes/s). `put` is `tpuray::put(&Blob)` (encoded, then written into
//! the store) and `raw::put_parts` (the bytes written straight into the store);
//! `get` is `tpuray::get_bytes`, which maps a local object without copying.

use std::path::PathBuf;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use anyhow::{Context, Result, ensure};
use tpuray::{Blob, ObjectRef, TaskOptions};

const MB: usize = 1 << 20;
const CLIENTS: usize = 4;

fn rounds() -> usize {
    std::env::var("ROUNDS").ok().and_then(|r| r.parse().ok()).unwrap_or(5)
}

fn median(mut v: Vec<Duration>) -> Duration {
    v.sort();
    v[v.len() / 2]
}

fn gbps(bytes: usize, d: Duration) -> f64 {
    bytes as f64 / d.as_secs_f64() / 1e9
}

fn timed(n: usize, mut f: impl FnMut() -> Result<()>) -> Result<Duration> {
    let mut times = Vec::with_capacity(n);
    for _ in 0..n {
        let t = Instant::now();
        f()?;
        times.push(t.elapsed());
    }
    Ok(median(times))
}

/// One of the clients putting at once: puts `rounds` objects of `size` bytes
/// (each dropped at once); seconds spent putting (not making the buffer).
#[tpuray::remote]
fn put_many(size: usize, rounds: usize) -> Result<f64, String> {
    let data = vec![5u8; size];
    let t = Instant::now();
    for _ in 0..rounds {
        tpuray::raw::put_parts(&[&data], vec![]).map_err(|e| e.to_string())?;
    }
    Ok(t.elapsed().as_secs_f64())
}

/// On the second node: seconds to get (pull, then map) the object in `refs`.
#[tpuray::remote]
fn fetch(refs: Vec<ObjectRef<Blob>>) -> Result<(f64, String), String> {
    let t = Instant::now();
    let data = tpuray::get_bytes(&refs[0]).map_err(|e| e.to_string())?;
    let secs = t.elapsed().as_secs_f64();
    std::hint::black_box(&data);
    Ok((secs, tpuray::node_id().unwrap_or_default()))
}

fn bench_size(size: usize) -> Result<()> {
    let n = rounds();
    let label = format!("{} MB", size / MB);
    let src = vec![7u8; size];

    // memcpy into fresh memory (what a put into new store pages competes
    // with) and into memory already touched.
    let fresh = timed(n, || {
        let mut dst = Vec::<u8>::with_capacity(size);
        dst.extend_from_slice(&src);
        std::hint::black_box(&dst);
        Ok(())
    })?;
    let mut dst = vec![0u8; size];
    let reused = timed(n, || {
        dst.copy_from_slice(&src);
        std::hint::black_box(&dst);
        Ok(())
    })?;
    drop(dst);
    println!(
        "{label}: memcpy (copy_from_slice) {:.2} GB/s into new memory, {:.2} GB/s into reused memory",
        gbps(size, fresh),
        gbps(size, reused)
    );

    let blob = Blob(src.clone());
    let put = timed(n, || {
        tpuray::put(&blob)?;
        Ok(())
    })?;
    let raw_put = timed(n, || {
        tpuray::raw::put_parts(&[&src], vec![])?;
        Ok(())
    })?;
    println!(
        "{label}: put, 1 client: tpuray::put(&Blob) {:.2} GB/s, raw::put_parts {:.2} GB/s \
         ({:.0}% of memcpy into reused memory, {:.0}% of memcpy into new memory)",
        gbps(size, put),
        gbps(size, raw_put),
        100.0 * reused.as_secs_f64() / raw_put.as_secs_f64(),
        100.0 * fresh.as_secs_f64() / raw_put.as_secs_f64()
    );

    let r = tpuray::put(&blob)?;
    ensure!(tpuray::get_bytes(&r)?.len() > size, "object smaller than its blob");
    let get = timed(n.max(20), || {
        std::hint::black_box(tpuray::get_bytes(&r)?);
        Ok(())
    })?;
    println!(
        "{label}: get_bytes of a local object {:.0} us (median), zero-copy",
        get.as_secs_f64() * 1e6
    );
    drop(r);
    drop(blob);

    tpuray::get_all(&(0..CLIENTS).map(|_| put_many::remote(size, 1)).collect::<Vec<_>>())?;
    let mut slowest = Vec::new();
    for _ in 0..n.div_ceil(2) {
        let refs: Vec<_> = (0..CLIENTS).map(|_| put_many::remote(size, 2)).collect();
        let secs = tpuray::get_all(&refs)?;
        slowest.push(Duration::from_secs_f64(secs.into_iter().fold(0.0, f64::max)));
    }
    println!(
        "{label}: put, {CLIENTS} clients at once {:.2} GB/s aggregate (all bytes / the slowest client's put time)",
        gbps(CLIENTS * 2 * size, median(slowest))
    );

    let here = tpuray::node_id()?;
    let other = TaskOptions::default().resource("other", 1.0);
    let mut times = Vec::new();
    for _ in 0..n {
        let r = tpuray::put(&Blob(src.clone()))?;
        let (secs, node) = tpuray::get(&fetch::options(other.clone()).remote(vec![r]))?;
        ensure!(node != here, "the reader must run on the second node");
        times.push(Duration::from_secs_f64(secs));
    }
    println!(
        "{label}: node-to-node get (pull into the second node's store) {:.2} GB/s",
        gbps(size, median(times))
    );
    Ok(())
}

/// A two-node cluster of the `tpuray` binary next to this one, private to this
/// run (its own registry folder); stopped when dropped.
struct Cluster {
    dir: PathBuf,
    address: String,
}

impl Cluster {
    fn cli(&self) -> Result<Command> {
        let exe = std::env::current_exe()?;
        let bin = exe.with_file_name("tpuray");
        ensure!(bin.exists(), "{} not found: cargo build --release -p tpuray-cli", bin.display());
        let mut c = Command::new(bin);
        c.env("TPURAY_REGISTRY_DIR", self.dir.join("registry")).env_remove("TPURAY_ADDRESS");
        Ok(c)
    }

    fn start(store_bytes: usize) -> Result<Self> {
        let dir = std::env::temp_dir().join(format!("tpuray-objbench-{}", std::process::id()));
        std::fs::create_dir_all(&dir)?;
        let port = std::net::TcpListener::bind("127.0.0.1:0")?.local_addr()?.port();
        let c = Cluster { address: format!("127.0.0.1:{port}"), dir };
        let store = store_bytes.to_string();
        let run = |args: &[&str]| -> Result<()> {
            let out = c.cli()?.args(args).stdin(Stdio::null()).output()?;
            ensure!(
                out.status.success(),
                "tpuray {args:?}: {}",
                String::from_utf8_lossy(&out.stderr)
            );
            Ok(())
        };
        let head = c.dir.join("head").display().to_string();
        let other = c.dir.join("other").display().to_string();
        let port = port.to_string();
        let store = &["--object-store-memory", &store];
        run(&[
            &[
                "start",
                "--head",
                "--node-ip-address",
                "127.0.0.1",
                "--port",
                &port,
                "--num-cpus",
                "8",
                "--temp-dir",
                &head,
            ],
            &store[..],
        ]
        .concat())?;
        run(&[
            &[
                "start",
                "--address",
                &c.address,
                "--num-cpus",
                "1",
                "--resources",
                r#"{"other": 1}"#,
            ],
            &["--temp-dir", &other][..],
            &store[..],
        ]
        .concat())?;
        Ok(c)
    }
}

impl Drop for Cluster {
    fn drop(&mut self) {
        if let Ok(mut c) = self.cli() {
            let _ = c.arg("stop").stdout(Stdio::null()).stderr(Stdio::null()).status();
        }
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

fn main() -> Result<()> {
    if std::env::var_os("TPURAY_WORKER_ID").is_some() {
        // Started by a node agent as a worker of this job: `init` serves tasks
        // and never returns.
        tpuray::init(None)?;
    }
    let sizes: Vec<usize> = std::env::args()
        .skip(1)
        .map(|a| a.parse::<usize>().map(|m| m * MB))
        .collect::<Result<_, _>>()
        .context("sizes are whole MB")?;
    let sizes = if sizes.is_empty() { vec![100 * MB, 800 * MB] } else { sizes };
    let max = sizes.iter().copied().max().unwrap_or(0);
    let cluster = Cluster::start(max * (CLIENTS + 3))?;
    // The cluster's registry is its own: it lists the node this driver attaches to.
    let opts = tpuray::DriverOptions {
        upload_binary: true,
        registry_dir: Some(cluster.dir.join("registry")),
        ..Default::default()
    };
    tpuray::init_with(Some(&cluster.address), &opts)?;
    for size in sizes {
        bench_size(size)?;
    }
    tpuray::shutdown();
    drop(cluster);
    Ok(())
}
