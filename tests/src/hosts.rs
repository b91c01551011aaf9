//! Simulated hosts on this one machine: each a network namespace of its own.
//!
//! [`Hosts::new`] makes N hosts (DESIGN.md §12). Each host is held by a long-lived
//! process (`unshare --net --mount --uts --propagation private --fork --kill-child`)
//! that mounts a fresh tmpfs on `/dev/shm`, bind-mounts a per-host folder onto
//! `/tmp` (so its logs can be read from outside: [`Host::tmp`]), bind-mounts one
//! shared hosts file onto `/etc/hosts`, sets its hostname, then sleeps. Its `eth0`
//! is one end of a veth pair whose other end is attached to the bridge `br0`,
//! which lives in a namespace of its own (also held by a process). Host `i` has
//! address `198.18.0.(i+1)/15` (RFC 2544 benchmarking range), `lo` up and a
//! `default dev eth0` route. Namespaces are entered by PID with `nsenter -t PID`;
//! `ip netns` is never used, so nothing is added under `/run/netns` and the root
//! namespace's interfaces, routes and mounts are never changed.
//!
//! What the hosts share is what is not under `/tmp`: the checkout, `./target`,
//! the virtual environments in it, `/root/.pyenv`. Each has its own `HOME` (a folder of the work dir, set
//! in the environment of [`Host::command`]), its own `/tmp` and so its own
//! `/tmp/tpuray/registry`.
//!
//! Faults per host: [`Host::partition`]/[`Host::heal`] (the bridge-side veth down/up),
//! [`Host::loss`] (nftables `numgen random` drops on `eth0`), [`Host::latency`]
//! (`tc netem`, refused by name where the kernel lacks it), [`Host::crash`]
//! (SIGKILL), [`Host::freeze`]/[`Host::thaw`] (SIGSTOP/SIGCONT), [`Host::clear_faults`].
//!
//! Everything needs root. Holders are spawned with `PR_SET_PDEATHSIG=SIGKILL`, so
//! they die with the thread that made the [`Hosts`] (keep the `Hosts` on the thread
//! that made it); dropping [`Hosts`] kills every process in every host namespace,
//! then the holders, then the bridge holder, and removes the work dir (after
//! printing the tail of every `*.out`/`*.err`/`*.log` under each host's `/tmp`
//! when the thread is panicking).
//!
//! `latency` needs `tc netem`, which this machine's kernel lacks (`CONFIG_NET_SCH_NETEM`
//! is not set), so it refuses saying so. Suites on these hosts: `tests/hosts.rs` (the
//! harness itself), `tests/multihost.rs` (a Rust job on a worker host, nodes at their
//! hosts' addresses), `tests/stale_stores.rs` (OBJ-13), `tests/addresses.rs` (NET-3), and
//! pytest's `test_multihost.py` (drivers on every kind of host, objects in every
//! direction, tokens, partition, heal, crash, freeze, a partitioned leader head) and
//! `test_multihost_gang.py` (a v6e-16 gang over four hosts with gloo), through
//! `src/bin/tpuray-hosts` and `python-sdk/tests/hosts.py`.

use std::collections::HashSet;
use std::io::Write;
use std::net::Ipv4Addr;
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::OnceLock;
use std::sync::atomic::{AtomicU32, Ordering};
use std::time::{Duration, Instant};

use anyhow::{Context, bail};

/// The error [`Host::latency`] returns where the kernel has no netem qdisc.
pub const NO_NETEM: &str =
    "tc netem is not available on this kernel (CONFIG_NET_SCH_NETEM is not set)";

/// Name of the nftables table [`Host::loss`] installs in a host namespace.
const NFT_TABLE: &str = "tpuray_faults";

/// How long setup steps (a holder becoming ready, processes dying) may take.
const SETUP_TIMEOUT: Duration = Duration::from_secs(20);

/// Lines of each log file printed when a test using [`Hosts`] fails.
const TAIL_LINES: usize = 40;

static SEQ: AtomicU32 = AtomicU32::new(0);
static NFT: OnceLock<Result<(), String>> = OnceLock::new();

/// The repository root (the checkout the hosts share).
pub fn repo_root() -> PathBuf {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("..");
    root.canonicalize().unwrap_or(root)
}

fn target_dir() -> PathBuf {
    let root = repo_root();
    std::env::var_os("CARGO_TARGET_DIR")
        .map(|t| root.join(t))
        .unwrap_or_else(|| root.join("target"))
}

/// A fresh work dir that is not under `/tmp` (each host has its own `/tmp`).
fn new_workdir() -> PathBuf {
    let unique = format!(
        "{}-{}-{}",
        std::process::id(),
        SEQ.fetch_add(1, Ordering::SeqCst),
        std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map(|d| d.subsec_nanos())
            .unwrap_or(0)
    );
    let target = target_dir();
    let target = target.canonicalize().unwrap_or(target);
    if !target.starts_with("/tmp") && std::fs::create_dir_all(target.join("tmp-hosts")).is_ok() {
        target.join("tmp-hosts").join(unique)
    } else {
        PathBuf::from(format!("/var/tmp/tpuray-hosts-{unique}"))
    }
}

/// Runs `cmd`, returning its stdout, or an error naming it with its stderr.
fn run(cmd: &mut Command) -> anyhow::Result<String> {
    let out = cmd
        .stdin(Stdio::null())
        .output()
        .with_context(|| format!("could not run {:?}", cmd.get_program()))?;
    if !out.status.success() {
        bail!(
            "{:?} {:?} failed ({}): {}",
            cmd.get_program(),
            cmd.get_args().collect::<Vec<_>>(),
            out.status,
            String::from_utf8_lossy(&out.stderr).trim()
        );
    }
    Ok(String::from_utf8_lossy(&out.stdout).into_owned())
}

/// `nsenter -t PID --net -- PROG`: a command in the network namespace of `pid`.
fn in_net(pid: u32, prog: &str) -> Command {
    let mut c = Command::new("nsenter");
    c.args(["-t", &pid.to_string(), "--net", "--", prog]);
    c
}

/// The network namespace of `pid` (`net:[inode]`), `None` once it has exited.
pub fn net_ns(pid: u32) -> Option<String> {
    std::fs::read_link(format!("/proc/{pid}/ns/net")).ok().map(|p| p.to_string_lossy().into_owned())
}

/// Every live process whose network namespace is `ns`.
pub fn pids_in_net_ns(ns: &str) -> Vec<u32> {
    let Ok(dir) = std::fs::read_dir("/proc") else { return Vec::new() };
    dir.filter_map(|e| e.ok()?.file_name().to_str()?.parse::<u32>().ok())
        .filter(|&pid| net_ns(pid).as_deref() == Some(ns))
        .collect()
}

/// The state letter of `pid` (`/proc/PID/stat` field 3: `R`, `S`, `T`, `Z`, ...).
pub fn proc_state(pid: u32) -> Option<char> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    stat[stat.rfind(')')? + 1..].trim_start().chars().next()
}

fn kill(pid: u32, sig: i32) {
    // SAFETY: kill(2) with a pid we found in /proc; no memory is touched.
    unsafe {
        libc::kill(pid as i32, sig);
    }
}

/// Whether `nft` can be used for [`Host::loss`]. The first call installs nftables
/// with apt-get when `nft` is missing (needs root; blocks up to a few minutes).
pub fn nft_status() -> Result<(), String> {
    NFT.get_or_init(|| {
        let have =
            || Command::new("nft").arg("--version").output().is_ok_and(|o| o.status.success());
        if have() {
            return Ok(());
        }
        let apt = |args: &[&str]| {
            Command::new("apt-get")
                .args(["-o", "DPkg::Lock::Timeout=120"])
                .args(args)
                .env("DEBIAN_FRONTEND", "noninteractive")
                .stdin(Stdio::null())
                .output()
        };
        let mut detail = String::new();
        for attempt in 0..2 {
            if attempt == 1 {
                let _ = apt(&["update", "-qq"]);
            }
            match apt(&["install", "-y", "-qq", "nftables"]) {
                Ok(o) if o.status.success() && have() => return Ok(()),
                Ok(o) => detail = String::from_utf8_lossy(&o.stderr).trim().to_string(),
                Err(e) => detail = e.to_string(),
            }
        }
        Err(format!(
            "packet loss needs nftables: `nft` is not installed and `apt-get install nftables` \
             failed: {detail}"
        ))
    })
    .clone()
}

/// One simulated host: a network, mount and UTS namespace held by a process.
pub struct Host {
    /// Hostname, listed in the shared `/etc/hosts`.
    pub name: String,
    /// Its address on `eth0` (prefix /15).
    pub address: Ipv4Addr,
    /// PID of the holder process (`unshare`), to enter with `nsenter -t PID`.
    pub pid: u32,
    /// Its `HOME` (set by [`Host::command`]), a folder of the work dir.
    pub home: PathBuf,
    /// Its `/tmp`, as seen from the root namespace.
    pub tmp: PathBuf,
    /// `net:[inode]` of its network namespace.
    pub netns: String,
    /// PID of the `sleep` the holder forked (also a holder: never signalled by faults).
    sleep_pid: u32,
    /// Bridge-side end of its veth pair.
    veth: String,
    bridge_pid: u32,
    holder: Option<Child>,
}

impl Host {
    /// `["nsenter", "-t", PID, "--net", "--mount", "--uts", "--"]`: prefix a command
    /// line with it to run it in this host. Entering the mount namespace resets the
    /// working directory to `/`; add `--wd=.` before `--` to keep the caller's.
    pub fn nsenter_prefix(&self) -> Vec<String> {
        ["nsenter", "-t", &self.pid.to_string(), "--net", "--mount", "--uts", "--"]
            .iter()
            .map(|s| s.to_string())
            .collect()
    }

    /// A command running `prog` inside this host (`nsenter ... -- prog`), with `HOME`
    /// set to the host's, `TPURAY_ADDRESS`, `TPURAY_AUTH_TOKEN`,
    /// `TPURAY_REGISTRY_DIR` and `TMPDIR` removed (so the host's own `/tmp` and
    /// registry are used), in the repository root (`nsenter --wd=.`, so
    /// `current_dir` on the returned command still applies). Add args and spawn as
    /// usual.
    pub fn command(&self, prog: impl AsRef<std::ffi::OsStr>) -> Command {
        let mut c = Command::new("nsenter");
        c.args(["-t", &self.pid.to_string(), "--net", "--mount", "--uts", "--wd=.", "--"])
            .arg(prog)
            .env("HOME", &self.home)
            .env_remove("TPURAY_ADDRESS")
            .env_remove("TPURAY_AUTH_TOKEN")
            .env_remove("TPURAY_REGISTRY_DIR")
            .env_remove("TPURAY_TLS_CERT")
            .env_remove("TPURAY_TLS_KEY")
            .env_remove("TPURAY_TLS_CA")
            .env_remove("TMPDIR")
            .current_dir(repo_root());
        c
    }

    /// Every live process in this host's network namespace but its holders.
    pub fn processes(&self) -> Vec<u32> {
        pids_in_net_ns(&self.netns)
            .into_iter()
            .filter(|&p| p != self.pid && p != self.sleep_pid)
            .collect()
    }

    /// Cuts the host's link (its bridge-side veth down): its processes keep running
    /// and its packets are dropped silently until [`Host::heal`].
    pub fn partition(&self) -> anyhow::Result<()> {
        run(in_net(self.bridge_pid, "ip").args(["link", "set", &self.veth, "down"]))?;
        Ok(())
    }

    /// Restores the link [`Host::partition`] cut.
    pub fn heal(&self) -> anyhow::Result<()> {
        run(in_net(self.bridge_pid, "ip").args(["link", "set", &self.veth, "up"]))?;
        Ok(())
    }

    /// Drops `percent`% of packets, at random, both in and out of `eth0` (nftables
    /// `numgen random mod 100 < P drop`); 0 removes the rule. Needs `nft`
    /// ([`nft_status`]); the error says so when it is missing.
    pub fn loss(&self, percent: u32) -> anyhow::Result<()> {
        if percent > 100 {
            bail!("loss percent must be 0..=100, got {percent}");
        }
        nft_status().map_err(anyhow::Error::msg)?;
        // Creating then deleting the table makes the delete succeed when it is absent.
        let mut rules = format!("table inet {NFT_TABLE}\ndelete table inet {NFT_TABLE}\n");
        if percent > 0 {
            // `mod 100 < 100` is out of nft's range: 100% drops unconditionally.
            let cond = if percent == 100 {
                String::new()
            } else {
                format!("numgen random mod 100 < {percent} ")
            };
            rules += &format!(
                "table inet {NFT_TABLE} {{\n\
                 chain input {{ type filter hook input priority 0; policy accept; \
                 iifname \"eth0\" {cond}drop\n}}\n\
                 chain output {{ type filter hook output priority 0; policy accept; \
                 oifname \"eth0\" {cond}drop\n}}\n}}\n"
            );
        }
        let mut child = in_net(self.pid, "nft")
            .args(["-f", "-"])
            .stdin(Stdio::piped())
            .stdout(Stdio::null())
            .stderr(Stdio::piped())
            .spawn()
            .context("could not run nft")?;
        child.stdin.take().expect("piped stdin").write_all(rules.as_bytes())?;
        let out = child.wait_with_output()?;
        if !out.status.success() {
            bail!("nft failed: {}", String::from_utf8_lossy(&out.stderr).trim());
        }
        Ok(())
    }

    /// Delays every packet out of `eth0` by `ms` (`tc qdisc replace ... netem`);
    /// 0 removes the delay. Where the kernel has no netem the error is exactly
    /// [`NO_NETEM`].
    pub fn latency(&self, ms: u32) -> anyhow::Result<()> {
        if ms == 0 {
            let _ = run(in_net(self.pid, "tc").args(["qdisc", "del", "dev", "eth0", "root"]));
            return Ok(());
        }
        let delay = format!("{ms}ms");
        match run(in_net(self.pid, "tc")
            .args(["qdisc", "replace", "dev", "eth0", "root", "netem", "delay", &delay]))
        {
            Ok(_) => Ok(()),
            Err(e) if e.to_string().contains("qdisc kind is unknown") => bail!("{NO_NETEM}"),
            Err(e) => Err(e),
        }
    }

    /// Heals the link and removes any loss rule and delay. Leaves processes alone
    /// (use [`Host::thaw`] for a frozen host).
    pub fn clear_faults(&self) -> anyhow::Result<()> {
        self.heal()?;
        let _ = run(in_net(self.pid, "nft").args(["delete", "table", "inet", NFT_TABLE]));
        let _ = run(in_net(self.pid, "tc").args(["qdisc", "del", "dev", "eth0", "root"]));
        Ok(())
    }

    /// SIGKILLs every process in the host but its holders, and blocks (up to 20 s)
    /// until none is left. The host itself stays usable.
    pub fn crash(&self) -> anyhow::Result<()> {
        let deadline = Instant::now() + SETUP_TIMEOUT;
        loop {
            let left = self.processes();
            if left.is_empty() {
                return Ok(());
            }
            if Instant::now() > deadline {
                bail!("processes {left:?} of {} survived SIGKILL", self.name);
            }
            for p in left {
                kill(p, libc::SIGKILL);
            }
            std::thread::sleep(Duration::from_millis(10));
        }
    }

    /// SIGSTOPs every process in the host but its holders, and blocks (up to 20 s)
    /// until every one of them is stopped (catching ones forked meanwhile).
    pub fn freeze(&self) -> anyhow::Result<()> {
        let deadline = Instant::now() + SETUP_TIMEOUT;
        loop {
            let running: Vec<u32> = self
                .processes()
                .into_iter()
                .filter(|&p| !matches!(proc_state(p), Some('T' | 't' | 'Z') | None))
                .collect();
            if running.is_empty() {
                return Ok(());
            }
            if Instant::now() > deadline {
                bail!("processes {running:?} of {} did not stop", self.name);
            }
            for p in running {
                kill(p, libc::SIGSTOP);
            }
            std::thread::sleep(Duration::from_millis(10));
        }
    }

    /// SIGCONTs every process in the host but its holders.
    pub fn thaw(&self) -> anyhow::Result<()> {
        for p in self.processes() {
            kill(p, libc::SIGCONT);
        }
        Ok(())
    }

    /// SIGCONT + SIGKILL every process in the host (holders included), until none
    /// is left or the timeout passes.
    fn kill_all(&mut self) {
        let deadline = Instant::now() + SETUP_TIMEOUT;
        while !self.processes().is_empty() && Instant::now() < deadline {
            for p in self.processes() {
                kill(p, libc::SIGCONT);
                kill(p, libc::SIGKILL);
            }
            std::thread::sleep(Duration::from_millis(10));
        }
        if let Some(mut h) = self.holder.take() {
            let _ = h.kill();
            let _ = h.wait();
        }
        if self.sleep_pid != 0 {
            kill(self.sleep_pid, libc::SIGKILL);
        }
    }

    /// Prints the last lines of every `*.out`, `*.err` and `*.log` under its `/tmp`.
    fn print_log_tails(&self) {
        let mut files = Vec::new();
        collect_logs(&self.tmp, 0, &mut files);
        let holder_err = self.tmp.parent().map(|d| d.join("holder.err"));
        files.extend(holder_err.filter(|p| p.metadata().is_ok_and(|m| m.len() > 0)));
        files.sort();
        for f in files {
            let text = std::fs::read_to_string(&f).unwrap_or_default();
            let lines: Vec<&str> = text.lines().collect();
            let shown =
                f.strip_prefix(&self.tmp).map(|r| Path::new("/tmp").join(r)).unwrap_or(f.clone());
            eprintln!("---- {}: {} (last {TAIL_LINES} lines) ----", self.name, shown.display());
            for l in &lines[lines.len().saturating_sub(TAIL_LINES)..] {
                eprintln!("{l}");
            }
        }
    }
}

fn collect_logs(dir: &Path, depth: usize, out: &mut Vec<PathBuf>) {
    let Ok(entries) = std::fs::read_dir(dir) else { return };
    for e in entries.flatten() {
        let Ok(ft) = e.file_type() else { continue };
        let p = e.path();
        if ft.is_dir() && depth < 8 {
            collect_logs(&p, depth + 1, out);
        } else if ft.is_file()
            && matches!(p.extension().and_then(|x| x.to_str()), Some("out" | "err" | "log"))
        {
            out.push(p);
        }
    }
}

/// N simulated hosts joined by one bridge. Dropping it removes everything it made.
pub struct Hosts {
    workdir: PathBuf,
    hosts_file: PathBuf,
    bridge_pid: u32,
    bridge: Option<Child>,
    hosts: Vec<Host>,
}

/// Spawns `unshare ARGS...` as a holder: it gets SIGKILL when the spawning thread
/// dies, with an empty signal mask, and its stderr goes to `err`.
fn spawn_holder(args: &[&str], err: &Path) -> std::io::Result<Child> {
    let mut c = Command::new("unshare");
    c.args(args).stdin(Stdio::null()).stdout(Stdio::null()).stderr(std::fs::File::create(err)?);
    // SAFETY: prctl and sigprocmask are async-signal-safe; nothing is allocated.
    unsafe {
        c.pre_exec(|| {
            if libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGKILL as libc::c_ulong, 0, 0, 0) != 0 {
                return Err(std::io::Error::last_os_error());
            }
            let mut set: libc::sigset_t = std::mem::zeroed();
            libc::sigemptyset(&mut set);
            libc::sigprocmask(libc::SIG_SETMASK, &set, std::ptr::null_mut());
            Ok(())
        });
    }
    c.spawn()
}

/// The holder script: `$1` its /tmp, `$2` the hosts file, `$3` hostname, `$4` pid file.
const HOLDER_SCRIPT: &str = "mount -t tmpfs -o mode=1777 tmpfs /dev/shm && mount --bind \"$1\" /tmp \
     && mount --bind \"$2\" /etc/hosts && hostname \"$3\" && echo $$ > \"$4.new\" \
     && mv \"$4.new\" \"$4\" && exec sleep infinity";

impl Hosts {
    /// Makes `n` hosts named `host0..host{n-1}`. Needs root; blocks until every host
    /// is up (about a second for a few hosts; the first call may install nftables).
    /// Panics with the reason when it cannot (not root, `unshare --net` refused, ...).
    pub fn new(n: usize) -> Hosts {
        Hosts::with_prefix(n, "host")
    }

    /// As [`Hosts::new`], with hostnames `{prefix}0..{prefix}{n-1}`.
    pub fn with_prefix(n: usize, prefix: &str) -> Hosts {
        // SAFETY: geteuid has no preconditions.
        if unsafe { libc::geteuid() } != 0 {
            panic!("tpuray-tests hosts: simulated hosts need root (network namespaces, mounts)");
        }
        assert!(n > 0 && n < 60000, "tpuray-tests hosts: bad host count {n}");
        for tool in ["unshare", "nsenter", "ip"] {
            if Command::new(tool)
                .arg("--version")
                .stdout(Stdio::null())
                .stderr(Stdio::null())
                .status()
                .is_err()
            {
                panic!(
                    "tpuray-tests hosts: `{tool}` is missing (apt-get install -y iproute2 util-linux nftables)"
                );
            }
        }
        if let Err(e) = nft_status() {
            eprintln!("tpuray-tests hosts: {e} (Host::loss will fail)");
        }
        let workdir = new_workdir();
        std::fs::create_dir_all(&workdir).unwrap_or_else(|e| {
            panic!("tpuray-tests hosts: cannot create {}: {e}", workdir.display())
        });
        let hosts_file = workdir.join("hosts");
        let mut hosts = Hosts {
            workdir: workdir.clone(),
            hosts_file: hosts_file.clone(),
            bridge_pid: 0,
            bridge: None,
            hosts: Vec::new(),
        };

        let names: Vec<String> = (0..n).map(|i| format!("{prefix}{i}")).collect();
        let base = u32::from(Ipv4Addr::new(198, 18, 0, 0));
        let addrs: Vec<Ipv4Addr> = (0..n).map(|i| Ipv4Addr::from(base + i as u32 + 1)).collect();
        let mut etc =
            String::from("127.0.0.1\tlocalhost\n::1\tlocalhost ip6-localhost ip6-loopback\n");
        for (name, a) in names.iter().zip(&addrs) {
            etc += &format!("{a}\t{name}\n");
        }
        std::fs::write(&hosts_file, etc).expect("write hosts file");

        // The bridge's namespace.
        let berr = workdir.join("bridge.err");
        let bridge = spawn_holder(&["--net", "--fork", "--kill-child", "sleep", "infinity"], &berr)
            .unwrap_or_else(|e| panic!("tpuray-tests hosts: cannot run unshare: {e}"));
        hosts.bridge_pid = bridge.id();
        hosts.bridge = Some(bridge);
        let root_ns = net_ns(std::process::id()).expect("own net namespace");
        let bpid = hosts.bridge_pid;
        let deadline = Instant::now() + SETUP_TIMEOUT;
        while net_ns(bpid).is_none_or(|ns| ns == root_ns) {
            if let Some(Ok(Some(st))) = hosts.bridge.as_mut().map(|c| c.try_wait()) {
                panic!(
                    "tpuray-tests hosts: `unshare --net` failed ({st}): {}",
                    std::fs::read_to_string(&berr).unwrap_or_default().trim()
                );
            }
            assert!(
                Instant::now() < deadline,
                "tpuray-tests hosts: bridge namespace not up within {SETUP_TIMEOUT:?}"
            );
            std::thread::sleep(Duration::from_millis(5));
        }
        run(in_net(bpid, "sh").args([
            "-c",
            "ip link set lo up && ip link add br0 type bridge && ip link set br0 up",
        ]))
        .unwrap_or_else(|e| panic!("tpuray-tests hosts: cannot make the bridge: {e:#}"));

        // Holders, all started before waiting for any.
        for (i, name) in names.iter().enumerate() {
            let dir = workdir.join(name);
            let (home, tmp) = (dir.join("home"), dir.join("tmp"));
            for d in [&home, &tmp] {
                std::fs::create_dir_all(d).expect("create host dirs");
            }
            use std::os::unix::fs::PermissionsExt;
            std::fs::set_permissions(&tmp, std::fs::Permissions::from_mode(0o1777))
                .expect("chmod tmp");
            let pidfile = dir.join("holder.pid");
            let args = [
                "--net",
                "--mount",
                "--uts",
                "--propagation",
                "private",
                "--fork",
                "--kill-child",
                "sh",
                "-c",
                HOLDER_SCRIPT,
                "sh",
                tmp.to_str().expect("utf-8 path"),
                hosts_file.to_str().expect("utf-8 path"),
                name,
                pidfile.to_str().expect("utf-8 path"),
            ];
            let child = spawn_holder(&args, &dir.join("holder.err"))
                .unwrap_or_else(|e| panic!("tpuray-tests hosts: cannot run unshare: {e}"));
            hosts.hosts.push(Host {
                name: name.clone(),
                address: addrs[i],
                pid: child.id(),
                home,
                tmp,
                netns: String::new(),
                sleep_pid: 0,
                veth: format!("vh{i}"),
                bridge_pid: bpid,
                holder: Some(child),
            });
        }
        for h in hosts.hosts.iter_mut() {
            let dir = h.tmp.parent().expect("host dir").to_path_buf();
            let pidfile = dir.join("holder.pid");
            let deadline = Instant::now() + SETUP_TIMEOUT;
            loop {
                let pid = std::fs::read_to_string(&pidfile)
                    .ok()
                    .and_then(|s| s.trim().parse::<u32>().ok());
                if let Some(pid) = pid
                    && std::fs::read_to_string(format!("/proc/{pid}/comm"))
                        .is_ok_and(|c| c.trim() == "sleep")
                {
                    h.sleep_pid = pid;
                    break;
                }
                if let Some(Ok(Some(st))) = h.holder.as_mut().map(|c| c.try_wait()) {
                    panic!(
                        "tpuray-tests hosts: holder of {} exited ({st}): {}",
                        h.name,
                        std::fs::read_to_string(dir.join("holder.err")).unwrap_or_default().trim()
                    );
                }
                assert!(
                    Instant::now() < deadline,
                    "tpuray-tests hosts: {} not up within {SETUP_TIMEOUT:?}",
                    h.name
                );
                std::thread::sleep(Duration::from_millis(5));
            }
            h.netns = net_ns(h.pid).expect("holder's net namespace");
            assert_ne!(
                h.netns, root_ns,
                "tpuray-tests hosts: holder of {} is in the root namespace",
                h.name
            );
        }

        // Links and addresses.
        for h in &hosts.hosts {
            let (pid, veth) = (h.pid.to_string(), &h.veth);
            let script = format!(
                "ip link add {veth} type veth peer name eth0 netns {pid} && ip link set {veth} master br0 && ip link set {veth} up"
            );
            run(in_net(bpid, "sh").args(["-c", &script]))
                .unwrap_or_else(|e| panic!("tpuray-tests hosts: cannot link {}: {e:#}", h.name));
            let script = format!(
                "ip link set lo up && ip addr add {}/15 dev eth0 && ip link set eth0 up && ip route add default dev eth0",
                h.address
            );
            run(in_net(h.pid, "sh").args(["-c", &script]))
                .unwrap_or_else(|e| panic!("tpuray-tests hosts: cannot set up {}: {e:#}", h.name));
        }
        hosts
    }

    /// Host `i` (panics when out of range).
    pub fn host(&self, i: usize) -> &Host {
        &self.hosts[i]
    }

    /// Every host, in order.
    pub fn hosts(&self) -> &[Host] {
        &self.hosts
    }

    /// The host named `name`.
    pub fn by_name(&self, name: &str) -> Option<&Host> {
        self.hosts.iter().find(|h| h.name == name)
    }

    /// Number of hosts.
    pub fn len(&self) -> usize {
        self.hosts.len()
    }

    /// Always false (a `Hosts` has at least one host).
    pub fn is_empty(&self) -> bool {
        self.hosts.is_empty()
    }

    /// The hosts file bind-mounted onto every host's `/etc/hosts`.
    pub fn hosts_file(&self) -> &Path {
        &self.hosts_file
    }

    /// The work dir (removed on drop): per-host `home/` and `tmp/`, the hosts file.
    pub fn workdir(&self) -> &Path {
        &self.workdir
    }

    /// PID of the bridge namespace's holder.
    pub fn bridge_pid(&self) -> u32 {
        self.bridge_pid
    }

    /// Network namespaces (`net:[inode]`) of the hosts and the bridge.
    pub fn namespaces(&self) -> Vec<String> {
        let mut v: Vec<String> =
            self.hosts.iter().map(|h| h.netns.clone()).filter(|s| !s.is_empty()).collect();
        v.extend(net_ns(self.bridge_pid));
        v
    }
}

impl Drop for Hosts {
    fn drop(&mut self) {
        if std::thread::panicking() {
            eprintln!("tpuray-tests hosts: work dir {}", self.workdir.display());
            for h in &self.hosts {
                h.print_log_tails();
            }
        }
        let namespaces: HashSet<String> = self.namespaces().into_iter().collect();
        for h in self.hosts.iter_mut() {
            h.kill_all();
        }
        if let Some(mut b) = self.bridge.take() {
            let _ = b.kill();
            let _ = b.wait();
        }
        // The holders' `sleep`s are not our children: wait for them to be gone.
        let deadline = Instant::now() + SETUP_TIMEOUT;
        loop {
            let left: Vec<u32> = namespaces.iter().flat_map(|ns| pids_in_net_ns(ns)).collect();
            if left.is_empty() {
                break;
            }
            if Instant::now() > deadline {
                eprintln!("tpuray-tests hosts: processes {left:?} outlived their host namespaces");
                break;
            }
            for p in left {
                kill(p, libc::SIGKILL);
            }
            std::thread::sleep(Duration::from_millis(10));
        }
        if let Err(e) = std::fs::remove_dir_all(&self.workdir) {
            eprintln!("tpuray-tests hosts: cannot remove {}: {e}", self.workdir.display());
        }
    }
}

/// Runs `cmd` to completion with stdin closed and stdout/stderr captured; SIGKILLs it
/// and panics naming it when it takes longer than `timeout`.
pub fn output_within(mut cmd: Command, timeout: Duration) -> std::process::Output {
    let what = format!("{cmd:?}");
    let child = cmd
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap_or_else(|e| panic!("cannot start {what}: {e}"));
    let pid = child.id();
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        let _ = tx.send(child.wait_with_output());
    });
    match rx.recv_timeout(timeout) {
        Ok(out) => out.expect("wait for the child"),
        Err(_) => {
            // SAFETY: kill(2) on our own child.
            unsafe { libc::kill(pid as i32, libc::SIGKILL) };
            panic!("timed out after {timeout:?}: {what}");
        }
    }
}
