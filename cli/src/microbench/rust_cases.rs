//! `tpuray microbenchmark --rust`: the task, actor and object cases of Ray's
//! `ray_perf.py` written with the Rust SDK, with the same names, workloads and
//! multipliers, timed by [`Timing::timeit`]. They run against a private local
//! cluster (a head and node on this machine, as `ray.init()` starts, with
//! `{"custom": 100}` for the placement group case) that [`run`] starts with this
//! CLI and stops afterwards.
//!
//! The remote functions and actors below are this crate's, so the cluster's
//! workers (`tpuray _worker`: this same CLI, DESIGN.md §8) find them by name; the
//! job registers without uploading a binary. Values: Ray's `b"ok"` is a [`Blob`],
//! its `np.zeros(n, int64)` a [`Zeros`] of `8 n` bytes. Ray's async-actor
//! cases are reported as skipped: the Rust SDK has no async actors.

use std::alloc::{GlobalAlloc, Layout, System};
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::ptr::NonNull;
use std::time::Duration;

use anyhow::{Context, Result, bail};
use tpuray::{ActorOptions, Blob, ObjectRef};

use super::Timing;

/// `np.zeros(n, dtype=np.int64)` as numpy makes it (`default_calloc` in numpy's
/// `_core/src/multiarray/alloc.c`): `8 n` zeroed bytes from the C library's `calloc`, which
/// for a block this large maps fresh pages the kernel zeroes lazily, advised
/// `MADV_HUGEPAGE` from its first whole page on when it is 4 MiB or more. So nothing writes
/// the bytes before the put reads them, and reading them maps the shared zero page. A
/// `vec![0u8; len]` from this binary's allocator (mimalloc, ALLOC-1) is zeroed with a
/// `memset` when mimalloc reuses a freed block: in the multi client case that `memset`
/// was a fifth of the workers' CPU (perf), a cost Ray's workload does not carry.
/// Serialized as bytes, as [`Blob`] is.
pub struct Zeros {
    ptr: NonNull<u8>,
    len: usize,
}

impl Zeros {
    /// `len` (at least 1) zeroed bytes.
    ///
    /// # Panics
    /// `len` is 0 or the C library cannot allocate it.
    pub fn new(len: usize) -> Self {
        /// numpy advises huge pages for arrays of this many bytes or more.
        const HUGEPAGE_MIN: usize = 4 << 20;
        const PAGE: usize = 4096;
        assert!(len > 0, "Zeros of 0 bytes");
        let layout = Layout::from_size_align(len, 1).expect("a byte array layout");
        // SAFETY: `layout` has a non-zero size.
        let ptr = NonNull::new(unsafe { System.alloc_zeroed(layout) })
            .unwrap_or_else(|| std::alloc::handle_alloc_error(layout));
        if len >= HUGEPAGE_MIN {
            // As numpy: from the next page boundary on, errors ignored (advice only).
            let offset = PAGE - ptr.as_ptr() as usize % PAGE;
            // SAFETY: the range lies inside the allocation; advice changes no contents.
            unsafe {
                libc::madvise(ptr.as_ptr().add(offset).cast(), len - offset, libc::MADV_HUGEPAGE)
            };
        }
        Self { ptr, len }
    }
}

impl Drop for Zeros {
    fn drop(&mut self) {
        // SAFETY: allocated by `System` with this layout in `new`.
        unsafe { System.dealloc(self.ptr.as_ptr(), Layout::from_size_align_unchecked(self.len, 1)) }
    }
}

impl serde::Serialize for Zeros {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        // SAFETY: `len` initialised (zeroed) bytes owned by `self` for its lifetime.
        s.serialize_bytes(unsafe { std::slice::from_raw_parts(self.ptr.as_ptr(), self.len) })
    }
}

fn ok() -> Blob {
    Blob(b"ok".to_vec())
}

#[tpuray::remote]
pub fn small_value() -> Blob {
    ok()
}

#[tpuray::remote]
pub fn do_put_small() -> Result<u8, String> {
    for _ in 0..100 {
        tpuray::put(&0i64).map_err(|e| e.to_string())?;
    }
    Ok(0)
}

#[tpuray::remote]
pub fn do_put() -> Result<u8, String> {
    for _ in 0..10 {
        tpuray::put(&Zeros::new(10 * 1024 * 1024 * 8)).map_err(|e| e.to_string())?;
    }
    Ok(0)
}

#[tpuray::remote]
pub fn create_object_containing_ref() -> Result<Vec<ObjectRef<i64>>, String> {
    (0..10_000).map(|_| tpuray::put(&1i64).map_err(|e| e.to_string())).collect()
}

#[tpuray::remote]
pub fn work(actors: Vec<ActorHandle>, n: u32) -> Result<u8, String> {
    let refs: Vec<_> = (0..n as usize).map(|i| actors[i % actors.len()].small_value()).collect();
    tpuray::get_all(&refs).map_err(|e| e.to_string())?;
    Ok(0)
}

/// Ray's `Actor` (created with `num_cpus=0`); `ActorHandle` below is the typed
/// handle `#[tpuray::actor]` generates for it, not `tpuray::ActorHandle`.
pub struct Actor;

#[tpuray::actor]
impl Actor {
    pub fn new() -> Self {
        Actor
    }
    pub fn small_value(&self) -> Blob {
        ok()
    }
    pub fn small_value_arg(&self, _x: i64) -> Blob {
        ok()
    }
    pub fn small_value_batch(&self, n: u32) -> Result<u8, String> {
        let refs: Vec<_> = (0..n).map(|_| small_value::remote()).collect();
        tpuray::get_all(&refs).map_err(|e| e.to_string())?;
        Ok(0)
    }
}

/// Ray's `Client`: calls its servers from inside an actor.
pub struct Client {
    servers: Vec<ActorHandle>,
}

#[tpuray::actor]
impl Client {
    pub fn new(servers: Vec<ActorHandle>) -> Self {
        Client { servers }
    }
    pub fn small_value_batch(&self, n: u32) -> Result<u8, String> {
        let mut results = Vec::new();
        for s in &self.servers {
            results.extend((0..n).map(|_| s.small_value()));
        }
        tpuray::get_all(&results).map_err(|e| e.to_string())?;
        Ok(0)
    }
    pub fn small_value_batch_arg(&self, n: u32) -> Result<u8, String> {
        let x = tpuray::put(&0i64).map_err(|e| e.to_string())?;
        let mut results = Vec::new();
        for s in &self.servers {
            results.extend((0..n).map(|_| s.small_value_arg(&x)));
        }
        tpuray::get_all(&results).map_err(|e| e.to_string())?;
        Ok(0)
    }
}

fn zero_cpu() -> ActorOptions {
    ActorOptions { num_cpus: Some(0.0), ..ActorOptions::default() }
}

fn new_actor(opts: ActorOptions) -> Result<ActorHandle> {
    Actor::options(opts).remote().context("creating an actor")
}

/// A private head and node on this machine, stopped on drop.
struct LocalCluster {
    dir: PathBuf,
    registry: PathBuf,
    address: String,
}

impl LocalCluster {
    fn start(resources: &str) -> Result<Self> {
        let dir = std::env::temp_dir().join(format!("tpuray-microbench-{}", std::process::id()));
        let registry = dir.join("registry");
        std::fs::create_dir_all(&registry)
            .with_context(|| format!("cannot create {}", registry.display()))?;
        let port = std::net::TcpListener::bind("127.0.0.1:0")?.local_addr()?.port();
        let head_dir = dir.join("head");
        let out = cli_command(&registry)?
            .args([
                "start",
                "--head",
                "--node-ip-address",
                "127.0.0.1",
                "--port",
                &port.to_string(),
            ])
            .args(["--resources", resources])
            .arg("--temp-dir")
            .arg(&head_dir)
            .stdout(Stdio::null())
            .stderr(Stdio::piped())
            .output()
            .context("cannot run `tpuray start --head`")?;
        let cluster = LocalCluster { dir, registry, address: format!("127.0.0.1:{port}") };
        if !out.status.success() {
            bail!(
                "could not start a local cluster: {}",
                String::from_utf8_lossy(&out.stderr).trim()
            );
        }
        Ok(cluster)
    }
}

impl Drop for LocalCluster {
    fn drop(&mut self) {
        if let Ok(mut c) = cli_command(&self.registry) {
            let _ = c.arg("stop").stdout(Stdio::null()).stderr(Stdio::null()).status();
        }
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

/// This CLI again (`TPURAY_SELF_COMMAND` under the Python package), with `registry`
/// as its machine-wide registry so the cluster stays private to this run.
fn cli_command(registry: &Path) -> Result<Command> {
    let argv = crate::procs::self_command()?;
    let mut c = Command::new(&argv[0]);
    c.args(&argv[1..]).env("TPURAY_REGISTRY_DIR", registry).env_remove("TPURAY_ADDRESS");
    Ok(c)
}

/// Starts the local cluster, runs every case, stops the cluster.
///
/// # Errors
/// The cluster does not start, the driver cannot join, or a case fails.
pub fn run(t: &Timing) -> Result<()> {
    let cluster = LocalCluster::start(r#"{"custom": 100}"#)?;
    tpuray::init_with(
        Some(&cluster.address),
        &tpuray::DriverOptions {
            upload_binary: false,
            namespace: None,
            registry_dir: Some(cluster.registry.clone()),
        },
    )
    .context("joining the local cluster")?;
    let r = cases(t);
    tpuray::shutdown();
    drop(cluster);
    r
}

fn cases(t: &Timing) -> Result<()> {
    let value = tpuray::put(&0i64)?;
    t.timeit("single client get calls (Plasma Store)", 1.0, || {
        tpuray::get(&value)?;
        Ok(())
    })?;
    t.timeit("single client put calls (Plasma Store)", 1.0, || {
        tpuray::put(&0i64)?;
        Ok(())
    })?;
    t.timeit("multi client put calls (Plasma Store)", 1000.0, || {
        let refs: Vec<_> = (0..10).map(|_| do_put_small::remote()).collect();
        tpuray::get_all(&refs)?;
        Ok(())
    })?;
    if t.selected("single client put gigabytes") {
        let arr = Zeros::new(100 * 1024 * 1024 * 8);
        t.timeit("single client put gigabytes", 8.0 * 0.1, || {
            tpuray::put(&arr)?;
            Ok(())
        })?;
    }
    t.timeit("single client tasks and get batch", 1.0, || {
        let refs: Vec<_> = (0..1000).map(|_| small_value::remote()).collect();
        tpuray::get_all(&refs)?;
        Ok(())
    })?;
    t.timeit("multi client put gigabytes", 10.0 * 8.0 * 0.1, || {
        let refs: Vec<_> = (0..10).map(|_| do_put::remote()).collect();
        tpuray::get_all(&refs)?;
        Ok(())
    })?;
    if t.selected("single client get object containing 10k refs") {
        let obj_containing_ref = create_object_containing_ref::remote();
        t.timeit("single client get object containing 10k refs", 1.0, || {
            tpuray::get(&obj_containing_ref)?;
            Ok(())
        })?;
    }
    t.timeit("single client wait 1k refs", 1.0, || {
        let mut not_ready: Vec<_> = (0..1000).map(|_| small_value::remote()).collect();
        for _ in 0..1000 {
            not_ready = tpuray::wait(&not_ready, 1, None)?.1;
        }
        Ok(())
    })?;
    t.timeit("single client tasks sync", 1.0, || {
        tpuray::get(&small_value::remote())?;
        Ok(())
    })?;
    t.timeit("single client tasks async", 1000.0, || {
        let refs: Vec<_> = (0..1000).map(|_| small_value::remote()).collect();
        tpuray::get_all(&refs)?;
        Ok(())
    })?;

    let (n, m) = (10_000u32, 4usize);
    if t.selected("multi client tasks async") {
        let actors = (0..m).map(|_| new_actor(zero_cpu())).collect::<Result<Vec<_>>>()?;
        t.timeit("multi client tasks async", f64::from(n) * m as f64, || {
            let refs: Vec<_> = actors.iter().map(|a| a.small_value_batch(n)).collect();
            tpuray::get_all(&refs)?;
            Ok(())
        })?;
    }
    for (name, sync, opts) in [
        ("1:1 actor calls sync", true, zero_cpu()),
        ("1:1 actor calls async", false, zero_cpu()),
        ("1:1 actor calls concurrent", false, ActorOptions { max_concurrency: 16, ..zero_cpu() }),
    ] {
        if !t.selected(name) {
            continue;
        }
        let a = new_actor(opts)?;
        if sync {
            t.timeit(name, 1.0, || {
                tpuray::get(&a.small_value())?;
                Ok(())
            })?;
        } else {
            t.timeit(name, 1000.0, || {
                let refs: Vec<_> = (0..1000).map(|_| a.small_value()).collect();
                tpuray::get_all(&refs)?;
                Ok(())
            })?;
        }
    }

    let n = 5000u32;
    let n_cpu = (std::thread::available_parallelism().map(|p| p.get()).unwrap_or(2) / 2).max(1);
    if t.selected("1:n actor calls async") {
        let actors = (0..n_cpu).map(|_| new_actor(zero_cpu())).collect::<Result<Vec<_>>>()?;
        let client = Client::options(zero_cpu()).remote(actors.clone())?;
        t.timeit("1:n actor calls async", f64::from(n) * actors.len() as f64, || {
            tpuray::get(&client.small_value_batch(n))?;
            Ok(())
        })?;
    }
    if t.selected("n:n actor calls async") {
        let a = (0..n_cpu).map(|_| new_actor(zero_cpu())).collect::<Result<Vec<_>>>()?;
        t.timeit("n:n actor calls async", (m as f64) * f64::from(n), || {
            let refs: Vec<_> = (0..m).map(|_| work::remote(a.clone(), n)).collect();
            tpuray::get_all(&refs)?;
            Ok(())
        })?;
    }
    let n = 1000u32;
    if t.selected("n:n actor calls with arg async") {
        let actors = (0..n_cpu).map(|_| new_actor(zero_cpu())).collect::<Result<Vec<_>>>()?;
        let clients = actors
            .iter()
            .map(|a| Client::options(zero_cpu()).remote(vec![a.clone()]))
            .collect::<Result<Vec<_>, _>>()?;
        t.timeit("n:n actor calls with arg async", f64::from(n) * clients.len() as f64, || {
            let refs: Vec<_> = clients.iter().map(|c| c.small_value_batch_arg(n)).collect();
            tpuray::get_all(&refs)?;
            Ok(())
        })?;
    }
    for name in [
        "1:1 async-actor calls sync",
        "1:1 async-actor calls async",
        "1:1 async-actor calls with args async",
        "1:n async-actor calls async",
        "n:n async-actor calls async",
    ] {
        t.skipped(name, "the Rust SDK has no async actors");
    }

    const NUM_PGS: usize = 100;
    let bundle: BTreeMap<String, f64> = BTreeMap::from([("custom".to_string(), 0.001)]);
    t.timeit("placement group create/removal", NUM_PGS as f64, || {
        let pgs = (0..NUM_PGS)
            .map(|_| tpuray::placement_group(std::slice::from_ref(&bundle), "PACK"))
            .collect::<Result<Vec<_>, _>>()?;
        for pg in &pgs {
            pg.wait(Duration::from_secs(30))?;
        }
        for pg in &pgs {
            tpuray::remove_placement_group(pg)?;
        }
        Ok(())
    })?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The Rust cases' `np.zeros` is zeroed and encodes as a zeroed [`Blob`] of its
    /// length does, both below and above numpy's huge-page advice size.
    #[test]
    fn zeros_are_zero_and_encode_as_a_zeroed_blob() {
        for len in [1, 4095, (4 << 20) + 4097] {
            let z = Zeros::new(len);
            let want = tpuray::codec::encode(&Blob(vec![0u8; len]));
            assert_eq!(tpuray::codec::encode(&z), want, "{len} bytes");
            // The bytes are this process's own, writable as any allocation.
            // SAFETY: `len` bytes owned by `z`.
            unsafe { z.ptr.as_ptr().add(len - 1).write(7) };
            assert_ne!(tpuray::codec::encode(&z), want);
        }
    }
}
