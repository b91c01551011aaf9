//! Starting and stopping tpuray processes: `start` spawns the head and node
//! agent processes detached (or keeps them in the foreground with `--block`),
//! waits until each is ready, and records them in the machine-wide registry
//! so `stop` finds them (REG-1).
//!
//! `tpuray start` returns once each process it spawned wrote its ready file (the head:
//! listening; an agent: registered with the head). A replicated head is three `tpuray
//! start --head --head-peers h1:p1,h2:p2,h3:p3 --head-id N`; nothing serves before a
//! majority is up, so each returns once its own head listens and its node agent joins in
//! the background (recorded in the registry at once, with its address once it joined; it
//! keeps trying for 10 minutes), and the three may be started one after another.
//! `--head-only` starts a head without a node agent (a head machine that runs no work, or
//! a head restarted from its `--head-data-dir`). Logs go to
//! `<temp-dir>/session_<ms>_<pid>/logs/{head,agent}.{out,err}`.
//!
//! REG-2: the registry entry of a head node's agent names its head (`head_of`: the head's
//! address, or `<peers>#<id>`); starting a head with an agent while that head's agent
//! still runs is refused, naming it.
//!
//! `tpuray stop` signals workers and agents first, then heads, and returns only when all
//! have exited (SIGKILL after a grace period). `run_head` starts the autoscaler (when
//! `--autoscaling-config` is given) once the head listens, and stops it, with everything
//! it started, before the head stops.

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::process::{Child, Stdio};
use std::time::{Duration, Instant};

use anyhow::{Context, Result, anyhow, bail};
use tpuray_worker::registry::{self, CurrentCluster, ProcEntry};

use crate::args::{AgentArgs, AuthMode, HeadArgs, StartArgs};

/// How long `start` waits for a spawned process to become ready.
const READY_TIMEOUT: Duration = Duration::from_secs(45);

/// The program and leading arguments that run this CLI again. The Python
/// package sets `TPURAY_SELF_COMMAND` (a JSON list), since its executable is
/// the interpreter.
pub(crate) fn self_command() -> Result<Vec<String>> {
    if let Ok(j) = std::env::var("TPURAY_SELF_COMMAND") {
        let v: Vec<String> = serde_json::from_str(&j)
            .with_context(|| format!("TPURAY_SELF_COMMAND is not a JSON list of strings: {j}"))?;
        if !v.is_empty() {
            return Ok(v);
        }
    }
    let exe = std::env::current_exe().context("cannot find the tpuray executable")?;
    Ok(vec![exe.display().to_string()])
}

fn new_session_dir(temp_dir: &Path) -> Result<PathBuf> {
    let stamp = chrono_like_stamp();
    let dir = temp_dir.join(format!("session_{stamp}_{}", std::process::id()));
    std::fs::create_dir_all(dir.join("logs"))
        .with_context(|| format!("cannot create session folder {}", dir.display()))?;
    let latest = temp_dir.join("session_latest");
    let _ = std::fs::remove_file(&latest);
    let _ = std::os::unix::fs::symlink(&dir, &latest);
    Ok(dir)
}

fn chrono_like_stamp() -> String {
    let secs = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_millis())
        .unwrap_or(0);
    format!("{secs}")
}

struct Spawned {
    child: Child,
    kind: &'static str,
    ready: serde_json::Value,
}

/// How `tpuray start` waits for a process it spawns.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Wait {
    /// Until it writes its ready file (a head listening, an agent registered).
    Ready,
    /// Not at all: it is recorded in the registry at once and runs on in the
    /// background (the node agent of a replicated head, which joins once a majority
    /// of heads elected a leader; it records its own address when it has joined).
    Background,
}

/// Spawns `self_command() args...` with its output in `logs/<name>.{out,err}`
/// and waits for it to write its ready file, unless `wait` is [`Wait::Background`];
/// `envs` are added to its environment, `head_of` goes into its registry entry (REG-2).
#[allow(clippy::too_many_arguments)]
fn spawn_with(
    session: &Path,
    name: &str,
    kind: &'static str,
    args: Vec<String>,
    detach: bool,
    waiting: &str,
    wait: Wait,
    envs: &[(&str, String)],
    head_of: &str,
) -> Result<Spawned> {
    let ready_file = session.join(format!("{name}.ready"));
    let _ = std::fs::remove_file(&ready_file);
    let logs = session.join("logs");
    let out = std::fs::File::create(logs.join(format!("{name}.out")))?;
    let err_path = logs.join(format!("{name}.err"));
    let err = std::fs::File::create(&err_path)?;
    let cmdline = self_command()?;
    let mut cmd = std::process::Command::new(&cmdline[0]);
    cmd.args(&cmdline[1..])
        .args(&args)
        .arg("--ready-file")
        .arg(&ready_file)
        .stdin(Stdio::null())
        .stdout(out)
        .stderr(err);
    for (k, v) in envs {
        cmd.env(k, v);
    }
    if detach {
        use std::os::unix::process::CommandExt;
        // SAFETY: setsid is async-signal-safe; it detaches the child from our
        // terminal so it outlives `tpuray start`.
        unsafe {
            cmd.pre_exec(|| {
                libc::setsid();
                Ok(())
            });
        }
    }
    let mut child = cmd.spawn().with_context(|| format!("cannot start {kind} process"))?;
    if wait == Wait::Background {
        if let Some(e) = ProcEntry::for_pid(child.id(), kind, &session.display().to_string(), "") {
            registry::record(&e.head_of(head_of)).context("cannot write the process registry")?;
        }
        return Ok(Spawned { child, kind, ready: serde_json::Value::Null });
    }
    let started = Instant::now();
    let mut told = false;
    loop {
        if !told && kind == "agent" && started.elapsed() > Duration::from_secs(2) {
            told = true;
            eprintln!("tpuray: {waiting}");
        }
        if let Ok(s) = std::fs::read_to_string(&ready_file)
            && let Ok(v) = serde_json::from_str::<serde_json::Value>(&s)
        {
            let entry = ProcEntry::for_pid(
                child.id(),
                kind,
                &session.display().to_string(),
                v.get("address").and_then(|a| a.as_str()).unwrap_or(""),
            );
            if let Some(e) = entry {
                registry::record(&e.head_of(head_of))
                    .context("cannot write the process registry")?;
            }
            return Ok(Spawned { child, kind, ready: v });
        }
        if let Some(status) = child.try_wait()? {
            let tail = tail(&err_path, 3000);
            let tail = tail.trim_end();
            // The process's own error line says what went wrong; show it alone.
            let last = tail
                .lines()
                .rev()
                .find(|l| l.starts_with("tpuray: "))
                .map(|l| l.trim_start_matches("tpuray: "));
            match last {
                Some(line) => bail!("{line}"),
                None => bail!("the {kind} process exited during start-up ({status}):\n{tail}"),
            }
        }
        if started.elapsed() > READY_TIMEOUT {
            let _ = child.kill();
            bail!(
                "the {kind} process did not become ready within {READY_TIMEOUT:?}; see {}",
                err_path.display()
            );
        }
        std::thread::sleep(Duration::from_millis(5));
    }
}

fn tail(path: &Path, max: usize) -> String {
    let s = std::fs::read_to_string(path).unwrap_or_default();
    let mut start = s.len().saturating_sub(max);
    while !s.is_char_boundary(start) {
        start += 1;
    }
    s[start..].to_string()
}

/// `--node-ip-address` checked, or the address a head advertises by default (NET-3).
fn node_ip(a: &StartArgs) -> Result<String> {
    match &a.node_ip_address {
        Some(ip) => {
            let parsed = ip.parse::<std::net::IpAddr>().map_err(|_| {
                anyhow!(
                    "--node-ip-address {ip:?}: expected a numeric IP address such as 198.18.0.2"
                )
            })?;
            if !tpuray_proto::net::is_local_address(parsed) {
                bail!(
                    "--node-ip-address {ip}: not an address of this host (expected the address \
                     of one of its interfaces, as other hosts reach it)"
                );
            }
            Ok(ip.clone())
        }
        None => Ok(tpuray_proto::net::head_advertise_address().to_string()),
    }
}

/// The address a node agent advertises: `--node-ip-address`, the head's own when this
/// is the head node, else the one that routes to the head (NET-3).
fn agent_ip(a: &StartArgs, head_address: &str) -> Result<String> {
    if a.node_ip_address.is_some() {
        return node_ip(a);
    }
    if a.head {
        // The head's own address (a replica's is its entry in --head-peers).
        let (listen, _, _) = head_listen(a)?;
        return Ok(listen.rsplit_once(':').map(|(h, _)| h.to_string()).unwrap_or(listen));
    }
    Ok(tpuray_proto::net::advertise_address_toward(head_address).to_string())
}

/// A head's listen address, its peer list (empty for a lone head) and replica id. With
/// `--head-peers`, the head listens on the port of its own entry.
fn head_listen(a: &StartArgs) -> Result<(String, String, u64)> {
    let Some(peers) = &a.head_peers else {
        return Ok((format!("{}:{}", node_ip(a)?, a.port.unwrap_or(6379)), String::new(), 1));
    };
    let list: Vec<&str> = peers.split(',').map(str::trim).filter(|p| !p.is_empty()).collect();
    for p in &list {
        tpuray_proto::client::check_address(p).map_err(|e| anyhow!("--head-peers: {e}"))?;
    }
    let id = match a.head_id {
        Some(id) => id,
        None => head_id_from_hostname(&list)?,
    };
    let own = usize::try_from(id)
        .ok()
        .and_then(|i| i.checked_sub(1))
        .and_then(|i| list.get(i))
        .ok_or_else(|| {
            anyhow!(
                "--head-id {id} is not a position in --head-peers (expected 1 to {})",
                list.len()
            )
        })?;
    let (own_host, own_port) = own.rsplit_once(':').unwrap_or((own, ""));
    let port = match a.port {
        Some(p) => p.to_string(),
        None => own_port.to_string(),
    };
    // Without --node-ip-address, a replica is at the host of its own entry.
    let ip = match (&a.node_ip_address, own_host.parse::<std::net::IpAddr>()) {
        (None, Ok(ip)) => ip.to_string(),
        _ => node_ip(a)?,
    };
    Ok((format!("{ip}:{port}"), list.join(","), id))
}

/// The 1-based position in `peers` of the entry naming this host: its host is `$HOSTNAME`
/// or starts with `$HOSTNAME.` (a StatefulSet pod `<set>-1` in
/// `<set>-0.<svc>:6379,<set>-1.<svc>:6379,...`).
fn head_id_from_hostname(peers: &[&str]) -> Result<u64> {
    head_id_of_host(peers, &std::env::var("HOSTNAME").unwrap_or_default())
}

fn head_id_of_host(peers: &[&str], host: &str) -> Result<u64> {
    let host = host.trim();
    if host.is_empty() {
        bail!(
            "--head-peers without --head-id: give --head-id N (HOSTNAME is not set to find this head's entry)"
        );
    }
    let mine: Vec<usize> = peers
        .iter()
        .enumerate()
        .filter(|(_, p)| {
            let h = p.rsplit_once(':').map_or(**p, |(h, _)| h);
            h == host || h.strip_prefix(host).is_some_and(|rest| rest.starts_with('.'))
        })
        .map(|(i, _)| i)
        .collect();
    match mine.as_slice() {
        [i] => Ok(*i as u64 + 1),
        [] => bail!(
            "--head-peers without --head-id: no entry's host is HOSTNAME {host:?} (give --head-id N)"
        ),
        _ => bail!(
            "--head-peers without --head-id: several entries name HOSTNAME {host:?} (give --head-id N)"
        ),
    }
}

/// How long the node agent of a replicated head keeps trying to join (10 minutes):
/// the other heads may be started well after this one.
const HA_AGENT_JOIN_PATIENCE_MS: u64 = 600_000;

pub fn start(mut a: StartArgs) -> Result<i32> {
    // A Kubernetes pod's address (the manifests set POD_IP from status.podIP) when no
    // --node-ip-address (or TPURAY_NODE_IP_ADDRESS) names one.
    if a.node_ip_address.is_none()
        && let Ok(ip) = std::env::var("POD_IP")
        && !ip.trim().is_empty()
    {
        a.node_ip_address = Some(ip.trim().to_string());
    }
    // Check every flag before anything starts, so bad input fails fast.
    tpuray_worker::build_resources(&a.resources.options())?;
    if let Some(path) = &a.autoscaling_config {
        if !a.head {
            bail!("--autoscaling-config needs --head (the autoscaler runs in the head process)");
        }
        crate::autoscaler::config::load(path)?;
        if a.head_peers.is_some() {
            bail!("--autoscaling-config is for a lone head (not with --head-peers)");
        }
        a.autoscaling_config = Some(
            std::path::absolute(path)
                .with_context(|| format!("--autoscaling-config {}", path.display()))?,
        );
    }
    if let Some(addr) = &a.address {
        for part in addr.split(',') {
            tpuray_proto::client::check_address(part).map_err(|e| anyhow!("--address: {e}"))?;
        }
    }
    // The address is checked before anything is made (no empty session folder).
    let head_key = if a.head {
        let (listen, peers, id) = head_listen(&a)?;
        if peers.is_empty() { listen } else { format!("{peers}#{id}") }
    } else {
        String::new()
    };
    // REG-2: one node agent per head; a head restarted while its agent still runs
    // would otherwise add a second node for the same machine.
    if a.head && !a.head_only {
        let running = registry::live_agents_in(&registry::registry_dir())
            .into_iter()
            .find(|e| e.head_of == head_key);
        if let Some(e) = running {
            bail!(
                "the node agent of this head already runs on this machine (pid {}, session {}): \
                 restart the head alone with --head-only, or stop that agent first",
                e.pid,
                e.session_dir
            );
        }
    }
    if !a.head && a.node_ip_address.is_some() {
        node_ip(&a)?;
    }
    // TLS-1: all three files or none, read and checked before anything starts; the
    // head and agent get them as their environment (and workers from the agent's).
    let tls = tpuray_proto::tls::TlsFiles::from_parts(
        a.tls_cert.clone(),
        a.tls_key.clone(),
        a.tls_ca.clone(),
    )?;
    tpuray_proto::tls::install(tls.as_ref())
        .map_err(|e| anyhow!("--tls-cert, --tls-key, --tls-ca: {e}"))?;
    let tls_env: Vec<(&str, String)> = tls.as_ref().map(|f| f.env()).unwrap_or_default();
    let session = new_session_dir(&a.temp_dir)?;
    let detach = !a.block;
    // How long `--block` waits for the agent it stops: its drain grace period plus the
    // 3 s it takes to stop its workers and a margin (AGENT-16).
    let drain_wait = Duration::from_secs(a.drain_grace_period) + Duration::from_secs(10);
    let mut spawned = Vec::new();
    let waiting = if a.head_peers.is_some() {
        "waiting for a majority of the heads to be up and elect a leader..."
    } else {
        "waiting for the head to answer (retrying for up to 30 s)..."
    };
    let head_address = if a.head {
        if a.auth_mode == AuthMode::Token {
            tpuray_proto::auth::load_or_create_token()?;
        }
        let (listen, peers, id) = head_listen(&a)?;
        let auth = match a.auth_mode {
            AuthMode::Token => "token",
            AuthMode::Disabled => "disabled",
        };
        let data_dir =
            a.head_data_dir.clone().unwrap_or_else(|| session.join(format!("head-data-{id}")));
        let mut args: Vec<String> = vec![
            "_head".into(),
            "--listen".into(),
            listen,
            "--session-dir".into(),
            session.display().to_string(),
            "--auth-mode".into(),
            auth.into(),
            "--head-peers".into(),
            peers.clone(),
            "--head-id".into(),
            id.to_string(),
            "--data-dir".into(),
            data_dir.display().to_string(),
        ];
        if let Some(p) = a.dashboard_port {
            args.extend(["--dashboard-port".into(), p.to_string()]);
        }
        if let Some(h) = &a.dashboard_host {
            args.extend(["--dashboard-host".into(), h.clone()]);
        }
        if let Some(c) = &a.autoscaling_config {
            args.extend(["--autoscaling-config".into(), c.display().to_string()]);
        }
        let s = spawn_with(&session, "head", "head", args, detach, "", Wait::Ready, &tls_env, "")?;
        let addr = s.ready["address"].as_str().unwrap_or_default().to_string();
        spawned.push(s);
        if peers.is_empty() { addr } else { peers }
    } else {
        a.address.clone().ok_or_else(|| anyhow!("--address is required without --head"))?
    };
    if a.head_only {
        registry::set_current_cluster(&CurrentCluster {
            address: head_address.clone(),
            session_dir: session.display().to_string(),
        })?;
        let own = spawned[0].ready["address"].as_str().unwrap_or_default().to_string();
        if own == head_address {
            println!("tpuray head started at {head_address} (no node agent)");
        } else {
            println!("tpuray head started at {own} (replica of {head_address}; no node agent)");
        }
        print_dashboard(&spawned[0]);
        println!("  session folder: {}", session.display());
        println!("  add a node:     tpuray start --address {head_address}");
        if a.block {
            return block_until_stopped(spawned, drain_wait);
        }
        return Ok(0);
    }
    let mut args = vec![
        "_agent".into(),
        "--address".into(),
        head_address.clone(),
        "--listen".into(),
        format!("{}:{}", agent_ip(&a, &head_address)?, a.node_manager_port),
        "--session-dir".into(),
        session.display().to_string(),
    ];
    if a.head {
        args.push("--head-node".into());
        args.extend(["--head-of".into(), head_key.clone()]);
    }
    let spill = match &a.spill_dir {
        Some(d) => {
            std::path::absolute(d).with_context(|| format!("--spill-dir {}", d.display()))?
        }
        None => session.join("spill"),
    };
    args.extend(["--spill-dir".into(), spill.display().to_string()]);
    if let Some(p) = a.metrics_export_port {
        args.extend(["--metrics-export-port".into(), p.to_string()]);
    }
    args.extend(["--drain-grace-period".into(), a.drain_grace_period.to_string()]);
    args.extend(a.resources.to_args());
    // The node agent of a replicated head joins in the background: a majority of the
    // heads must be up before any serves, and they are started one after another.
    let replicated = a.head && a.head_peers.is_some();
    let (wait, mut envs) = if replicated {
        let patience = std::env::var("TPURAY_HEAD_CONNECT_TIMEOUT_MS")
            .unwrap_or_else(|_| HA_AGENT_JOIN_PATIENCE_MS.to_string());
        (Wait::Background, vec![("TPURAY_HEAD_CONNECT_TIMEOUT_MS", patience)])
    } else {
        (Wait::Ready, vec![])
    };
    envs.extend(tls_env.iter().cloned());
    // A pod's worker id (from JOB_COMPLETION_INDEX or the HOSTNAME ordinal) goes into the
    // agent's environment, so its tasks see TPU_WORKER_ID as JAX and libtpu expect.
    let env = &a.resources.options().env;
    if !env.contains_key("TPU_WORKER_ID")
        && let Ok(filled) = tpuray_worker::run::with_pod_worker_id(env)
        && let Some(id) = filled.get("TPU_WORKER_ID")
    {
        envs.push(("TPU_WORKER_ID", id.clone()));
    }
    let agent =
        match spawn_with(&session, "agent", "agent", args, detach, waiting, wait, &envs, &head_key)
        {
            Ok(s) => s,
            Err(e) => {
                for mut s in spawned {
                    terminate_child(&mut s.child, Duration::from_secs(10));
                }
                return Err(e);
            }
        };
    if replicated {
        let pid = agent.child.id();
        spawned.push(agent);
        registry::set_current_cluster(&CurrentCluster {
            address: head_address.clone(),
            session_dir: session.display().to_string(),
        })?;
        println!(
            "tpuray head started at {} (replica of {head_address})",
            spawned[0].ready["address"].as_str().unwrap_or_default()
        );
        print_dashboard(&spawned[0]);
        println!(
            "  its node agent (pid {pid}) joins once a majority of the heads elected a leader"
        );
        println!("  session folder: {}", session.display());
        println!("  cluster status: tpuray status --address {head_address}");
        if a.block {
            return block_until_stopped(spawned, drain_wait);
        }
        return Ok(0);
    }
    let node_id = agent.ready["node_id"].as_str().unwrap_or_default().to_string();
    let node_address = agent.ready["address"].as_str().unwrap_or_default().to_string();
    spawned.push(agent);
    if a.head {
        registry::set_current_cluster(&CurrentCluster {
            address: head_address.clone(),
            session_dir: session.display().to_string(),
        })?;
        println!("tpuray head started at {head_address} (node {node_id})");
        print_dashboard(&spawned[0]);
        println!("  session folder: {}", session.display());
        println!("  add a node:     tpuray start --address {head_address}");
        println!("  cluster status: tpuray status");
        println!("  stop:           tpuray stop");
    } else {
        // `tpuray status`, `list` and `init()` on this machine find the cluster too, as
        // on the head's (Ray writes its current cluster on every node).
        if registry::current_cluster().is_none() {
            registry::set_current_cluster(&CurrentCluster {
                address: head_address.clone(),
                session_dir: session.display().to_string(),
            })?;
        }
        println!("tpuray node {node_id} joined the cluster at {head_address}");
        println!("  node address:   {node_address}");
        println!("  session folder: {}", session.display());
    }
    if a.block {
        return block_until_stopped(spawned, drain_wait);
    }
    Ok(0)
}

fn terminate_child(c: &mut Child, within: Duration) {
    tpuray_worker::agent::signal(c.id(), libc::SIGTERM);
    let deadline = Instant::now() + within;
    while Instant::now() < deadline {
        if let Ok(Some(_)) = c.try_wait() {
            registry::remove(c.id());
            return;
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    let _ = c.kill();
    let _ = c.wait();
    registry::remove(c.id());
}

/// `--block`: wait until SIGINT/SIGTERM or until a started process exits,
/// then stop the rest (agents before the head), giving an agent `agent_wait` to drain
/// and exit before it is killed (a head 10 s).
fn block_until_stopped(mut spawned: Vec<Spawned>, agent_wait: Duration) -> Result<i32> {
    let rt = tokio::runtime::Builder::new_current_thread().enable_all().build()?;
    let code = rt.block_on(async {
        let mut term = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate())?;
        let mut int = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::interrupt())?;
        loop {
            tokio::select! {
                _ = term.recv() => return Ok::<i32, anyhow::Error>(0),
                _ = int.recv() => return Ok(0),
                _ = tokio::time::sleep(Duration::from_millis(200)) => {
                    for s in spawned.iter_mut() {
                        if let Ok(Some(status)) = s.child.try_wait() {
                            eprintln!("tpuray: the {} process exited ({status}); stopping the rest", s.kind);
                            return Ok(1);
                        }
                    }
                }
            }
        }
    })?;
    for s in spawned.iter_mut().rev() {
        let within = if s.kind == "agent" { agent_wait } else { Duration::from_secs(10) };
        terminate_child(&mut s.child, within);
    }
    Ok(code)
}

/// Stops every live process in the registry: workers and agents first, then
/// heads; returns once all have exited (SIGKILL after a grace period).
pub fn stop(force: bool) -> Result<i32> {
    let entries = registry::list();
    let live: Vec<ProcEntry> = entries.iter().filter(|e| e.is_alive()).cloned().collect();
    for e in entries.iter().filter(|e| !e.is_alive()) {
        registry::remove(e.pid);
    }
    if live.is_empty() {
        registry::clear_current_cluster();
        println!("no tpuray processes are running on this machine");
        sweep_stores();
        return Ok(0);
    }
    let rank = |k: &str| match k {
        "worker" => 0,
        "agent" => 1,
        _ => 2,
    };
    let mut groups: Vec<Vec<&ProcEntry>> = vec![vec![], vec![], vec![]];
    for e in &live {
        groups[rank(&e.kind)].push(e);
    }
    let sig = if force { libc::SIGKILL } else { libc::SIGTERM };
    for group in groups.iter().filter(|g| !g.is_empty()) {
        for e in group {
            tpuray_worker::agent::signal(e.pid, sig);
        }
        wait_gone(group, Duration::from_secs(if force { 5 } else { 10 }));
    }
    let stubborn: Vec<&ProcEntry> = live.iter().filter(|e| e.is_alive()).collect();
    for e in &stubborn {
        tpuray_worker::agent::signal(e.pid, libc::SIGKILL);
    }
    wait_gone(&stubborn, Duration::from_secs(5));
    let left: Vec<u32> = live.iter().filter(|e| e.is_alive()).map(|e| e.pid).collect();
    for e in &live {
        if !e.is_alive() {
            registry::remove(e.pid);
        }
    }
    registry::clear_current_cluster();
    if !left.is_empty() {
        sweep_stores();
        bail!("these tpuray processes did not exit: {left:?}");
    }
    println!("stopped {} tpuray process(es)", live.len());
    sweep_stores();
    Ok(0)
}

/// Removes the object store folders that agents of this machine left under
/// `/dev/shm` when they died (killed by `stop --force`, or earlier), with
/// their spill folders (OBJ-13), and says how many when there were any. A
/// live agent's store is never touched.
fn sweep_stores() {
    let root = Path::new(tpuray_objectstore::STORE_ROOT);
    let removed = tpuray_objectstore::sweep_stale_stores(root);
    let stores = removed.iter().filter(|p| p.parent() == Some(root)).count();
    if stores > 0 {
        println!(
            "removed {stores} object store folder(s) of stopped node agents from {}",
            root.display()
        );
    }
}

fn wait_gone(group: &[&ProcEntry], within: Duration) {
    let deadline = Instant::now() + within;
    while Instant::now() < deadline && group.iter().any(|e| e.is_alive()) {
        std::thread::sleep(Duration::from_millis(10));
    }
}

fn init_logging() {
    let filter = tracing_subscriber::EnvFilter::try_from_env("TPURAY_LOG")
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info"));
    let _ = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_ansi(false)
        .with_writer(std::io::stderr)
        .try_init();
}

async fn shutdown_signal() {
    use tokio::signal::unix::{SignalKind, signal};
    let mut term = signal(SignalKind::terminate()).expect("SIGTERM handler");
    let mut int = signal(SignalKind::interrupt()).expect("SIGINT handler");
    tokio::select! {
        _ = term.recv() => {}
        _ = int.recv() => {}
    }
}

fn write_ready(path: &Option<PathBuf>, v: serde_json::Value) {
    if let Some(p) = path {
        let tmp = p.with_extension("tmp");
        if std::fs::write(&tmp, v.to_string()).is_ok() {
            let _ = std::fs::rename(tmp, p);
        }
    }
}

fn env_ms(var: &str, default: u64) -> Duration {
    tpuray_worker::run::env_duration_ms(var, default)
}

/// `Dashboard: http://ADDRESS:PORT`, from the head's ready file (DESIGN.md §13).
fn print_dashboard(head: &Spawned) {
    if let Some(url) = head.ready["dashboard_url"].as_str() {
        println!("Dashboard: {url}");
    }
}

pub fn run_head(a: HeadArgs) -> Result<i32> {
    init_logging();
    let listen: SocketAddr = a
        .listen
        .parse()
        .with_context(|| format!("invalid listen address {:?} (expected IP:PORT)", a.listen))?;
    let token = match a.auth_mode {
        AuthMode::Token => Some(tpuray_proto::auth::load_or_create_token()?),
        AuthMode::Disabled => tpuray_proto::auth::load_token().ok().flatten(),
    };
    let peers: Vec<String> = a
        .head_peers
        .split(',')
        .filter(|p| !p.trim().is_empty())
        .map(|p| p.trim().to_string())
        .collect();
    let config = tpuray_head::HeadConfig {
        listen,
        token,
        auth_required: a.auth_mode == AuthMode::Token,
        heartbeat_interval: env_ms("TPURAY_HEARTBEAT_INTERVAL_MS", 1000),
        node_death_timeout: env_ms("TPURAY_NODE_DEATH_TIMEOUT_MS", 5_000),
        replica_id: a.head_id,
        peers,
        data_dir: Some(a.data_dir.clone()),
        raft_tick: env_ms("TPURAY_RAFT_TICK_MS", 50),
        snapshot_every: std::env::var("TPURAY_HEAD_SNAPSHOT_EVERY")
            .ok()
            .and_then(|v| v.parse().ok())
            .unwrap_or(10_000),
        dashboard: Some(tpuray_head::DashboardConfig {
            host: match &a.dashboard_host {
                Some(h) => Some(h.parse().with_context(|| {
                    format!(
                        "invalid --dashboard-host {h:?} (expected an IP address such as 0.0.0.0)"
                    )
                })?),
                None => None,
            },
            port: a.dashboard_port.unwrap_or(8265),
            explicit: a.dashboard_port.is_some(),
        }),
        session_dir: Some(a.session_dir.clone()),
    };
    let autoscaling = match &a.autoscaling_config {
        Some(p) => Some(crate::autoscaler::config::load(p)?),
        None => None,
    };
    let token = config.token.clone();
    let rt = tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build()?;
    let ready = a.ready_file.clone();
    // The autoscaler starts once the head listens, and stops (with every node it
    // started, AUTOSCALE-8) before the head does.
    let scaler: std::sync::Arc<std::sync::Mutex<Option<crate::autoscaler::Autoscaler>>> =
        Default::default();
    let slot = scaler.clone();
    let session = a.session_dir.clone();
    let stopping = async move {
        shutdown_signal().await;
        let taken = scaler.lock().unwrap_or_else(|e| e.into_inner()).take();
        if let Some(s) = taken {
            let _ = tokio::task::spawn_blocking(move || s.stop()).await;
        }
    };
    rt.block_on(tpuray_head::serve(
        config,
        move |r| {
            if let Some(c) = autoscaling {
                match crate::autoscaler::Autoscaler::start(c, r.address.to_string(), token, session)
                {
                    Ok(s) => *slot.lock().unwrap_or_else(|e| e.into_inner()) = Some(s),
                    Err(e) => tracing::error!("the autoscaler did not start: {e:#}"),
                }
            }
            write_ready(
                &ready,
                serde_json::json!({ "address": r.address.to_string(), "dashboard_url": r.dashboard_url }),
            )
        },
        stopping,
    ))
    .map_err(|e| anyhow!("{e}"))?;
    Ok(0)
}

pub fn run_agent(a: AgentArgs) -> Result<i32> {
    init_logging();
    let mut options = a.resources.options();
    // One reading of available memory for both the advertised resource and the store.
    let capacity_bytes = tpuray_worker::object_store_bytes(&options);
    options.object_store_memory = Some(capacity_bytes);
    let (total, labels) = tpuray_worker::build_resources(&options)?;
    let store = tpuray_worker::StoreOptions {
        capacity_bytes,
        spill_dir: a.spill_dir.clone().unwrap_or_else(|| a.session_dir.join("spill")),
    };
    let listen: SocketAddr = a
        .listen
        .parse()
        .with_context(|| format!("invalid listen address {:?} (expected IP:PORT)", a.listen))?;
    let token = tpuray_proto::auth::load_token()?;
    let mut worker_command = self_command()?;
    worker_command.push("_worker".into());
    let rt = tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build()?;
    let ready = a.ready_file.clone();
    let host = listen.ip().to_string();
    let session = a.session_dir.clone();
    let session_s = session.display().to_string();
    let head_of = a.head_of.clone();
    rt.block_on(tpuray_worker::serve_agent(
        listen,
        &host,
        &a.address,
        total,
        labels,
        a.head_node,
        session,
        token,
        worker_command,
        store,
        a.metrics_export_port,
        Duration::from_secs(a.drain_grace_period),
        move |addr, node_id| {
            write_ready(
                &ready,
                serde_json::json!({ "address": addr.to_string(), "node_id": node_id.to_string() }),
            );
            // The agent's registry entry names its address (REG-1; an agent started in
            // the background was recorded without one).
            let me = std::process::id();
            if let Some(e) = ProcEntry::for_pid(me, "agent", &session_s, &addr.to_string()) {
                let _ = registry::record(&e.head_of(&head_of));
            }
        },
        shutdown_signal(),
    ))?;
    Ok(0)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn head_id_is_the_peer_entry_whose_host_is_the_pod_name() {
        let peers = [
            "t-head-0.t-head.ml.svc:6379",
            "t-head-1.t-head.ml.svc:6379",
            "t-head-10.t-head.ml.svc:6379",
        ];
        assert_eq!(head_id_of_host(&peers, "t-head-1").unwrap(), 2);
        assert_eq!(head_id_of_host(&peers, "t-head-10").unwrap(), 3);
        assert_eq!(head_id_of_host(&["10.0.0.1:1", "10.0.0.2:1"], "10.0.0.2").unwrap(), 2);
        let e = head_id_of_host(&peers, "t-head-2").unwrap_err().to_string();
        assert!(e.contains("\"t-head-2\"") && e.contains("--head-id"), "{e}");
        assert!(head_id_of_host(&peers, "").unwrap_err().to_string().contains("HOSTNAME"));
    }
}
