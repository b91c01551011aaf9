//! A cluster over three simulated hosts (`tpuray_tests::hosts`: network namespaces,
//! each with its own 198.18 address, `/dev/shm`, `/tmp`, `HOME` and hostname): the
//! head on `host0`, `host1` joining with the cluster token in `TPURAY_AUTH_TOKEN`,
//! `host2` with the token file copied into its home. A Rust job (`tpuray-test-driver`)
//! started on `host1`, a worker host, runs tasks on every host: its binary is uploaded
//! to the cluster and the node agents of the other hosts fetch it (BIN-1), and objects
//! travel between the hosts' stores both ways. Every node advertises its host's own
//! address, never 127.0.0.1 (NET-3). Needs root.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::process::{Output, Stdio};
use std::time::{Duration, Instant};

use tpuray_tests::hosts::{Host, Hosts, output_within};
use tpuray_tests::tpuray_bin;

const PORT: u16 = 6379;
/// Bound for one `tpuray start`, `tpuray list` or other CLI call.
const CLI_TIMEOUT: Duration = Duration::from_secs(120);
/// Bound for a whole driver run.
const DRIVER_TIMEOUT: Duration = Duration::from_secs(300);
/// Bytes of the object the broadcast reads on every host (stored, not inline).
const BROADCAST_BYTES: usize = 20_000_000;

fn driver_bin() -> PathBuf {
    PathBuf::from(env!("CARGO_BIN_EXE_tpuray-test-driver"))
}

fn text(out: &Output) -> String {
    format!(
        "exit: {}\n--- stdout ---\n{}\n--- stderr ---\n{}",
        out.status,
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    )
}

/// `tpuray ARGS` in `host` with `envs`; its stdout, panicking when it fails.
fn tpuray(host: &Host, args: &[&str], envs: &[(&str, &str)]) -> String {
    let mut c = host.command(tpuray_bin());
    c.args(args);
    for (k, v) in envs {
        c.env(k, v);
    }
    let out = output_within(c, CLI_TIMEOUT);
    assert!(out.status.success(), "tpuray {args:?} in {} failed:\n{}", host.name, text(&out));
    String::from_utf8_lossy(&out.stdout).into_owned()
}

/// Three hosts: the head on `host0` (`--num-cpus 1`), `host1` joined with the token in
/// `TPURAY_AUTH_TOKEN`, `host2` with the token file copied (0600). Node `i` has one
/// CPU and the custom resource `h<i>`, so a task can be sent to a chosen host; host2
/// also has `far` (the `pulled-copy` scenario's resource). Returns
/// the hosts, the head address and the token.
fn three_host_cluster() -> (Hosts, String, String) {
    let hosts = Hosts::new(3);
    let (h0, h1, h2) = (hosts.host(0), hosts.host(1), hosts.host(2));
    let head = format!("{}:{PORT}", h0.address);
    let port = PORT.to_string();
    let out = tpuray(
        h0,
        &["start", "--head", "--port", &port, "--num-cpus", "1", "--resources", r#"{"h0": 1}"#],
        &[],
    );
    assert!(
        out.contains(&format!("head started at {head}")),
        "head does not advertise {head}: {out}"
    );
    let token_file = h0.home.join(".tpuray").join("auth_token");
    let token = std::fs::read_to_string(&token_file)
        .unwrap_or_else(|e| panic!("no token at {}: {e}", token_file.display()))
        .trim()
        .to_string();
    assert!(!token.is_empty());

    let join = |h: &Host, res: &str, envs: &[(&str, &str)]| {
        let out =
            tpuray(h, &["start", "--address", &head, "--num-cpus", "1", "--resources", res], envs);
        assert!(out.contains("joined the cluster"), "{} did not join: {out}", h.name);
    };
    join(h1, r#"{"h1": 1}"#, &[("TPURAY_AUTH_TOKEN", &token)]);
    let dir = h2.home.join(".tpuray");
    std::fs::create_dir_all(&dir).expect("token dir");
    std::fs::copy(&token_file, dir.join("auth_token")).expect("copy the token");
    use std::os::unix::fs::PermissionsExt;
    std::fs::set_permissions(dir.join("auth_token"), std::fs::Permissions::from_mode(0o600))
        .expect("chmod the token");
    join(h2, r#"{"h2": 1, "far": 1}"#, &[]);
    (hosts, head, token)
}

/// `tpuray list nodes --format json` run inside `host0`.
fn list_nodes(hosts: &Hosts, head: &str) -> Vec<serde_json::Value> {
    let out = tpuray(hosts.host(0), &["list", "nodes", "--format", "json", "--address", head], &[]);
    let v: serde_json::Value = serde_json::from_str(&out)
        .unwrap_or_else(|e| panic!("`tpuray list nodes` is not JSON ({e}):\n{out}"));
    v.as_array().expect("a JSON list of nodes").clone()
}

/// The host part of an `ip:port` address.
fn ip_of(address: &str) -> &str {
    address.rsplit_once(':').map_or(address, |(ip, _)| ip)
}

/// Node id of each host (by the `h<i>` resource it was started with), checking that it
/// is ALIVE and advertises its host's own address and hostname.
fn node_ids_by_host(hosts: &Hosts, nodes: &[serde_json::Value]) -> Vec<String> {
    let all = format!("{nodes:#?}");
    assert_eq!(nodes.len(), 3, "three nodes: {all}");
    hosts
        .hosts()
        .iter()
        .enumerate()
        .map(|(i, h)| {
            let n = nodes
                .iter()
                .find(|n| n["resources_total"].get(format!("h{i}")).is_some())
                .unwrap_or_else(|| panic!("no node with resource h{i}: {all}"));
            let addr = n["address"].as_str().unwrap_or_default();
            assert_eq!(ip_of(addr), h.address.to_string(), "node of {}: {all}", h.name);
            assert!(!addr.starts_with("127."), "a loopback address: {all}");
            assert_eq!(n["hostname"], h.name.as_str(), "{all}");
            assert_eq!(n["state"], "ALIVE", "{all}");
            assert_eq!(n["is_head_node"], i == 0, "{all}");
            n["node_id"].as_str().expect("node id").to_string()
        })
        .collect()
}

/// Waits (at most `timeout`) until the driver `child` printed a line starting with
/// `prefix` into `log` (a file as seen from outside its host).
fn wait_for_line(log: &Path, prefix: &str, timeout: Duration, child: &mut std::process::Child) {
    let deadline = Instant::now() + timeout;
    loop {
        let s = std::fs::read_to_string(log).unwrap_or_default();
        if s.lines().any(|l| l.starts_with(prefix)) {
            return;
        }
        let exited = child.try_wait().ok().flatten();
        assert!(
            exited.is_none() && Instant::now() < deadline,
            "driver {} before printing {prefix:?} (waited {timeout:?}):\n{s}",
            exited.map_or("timed out".to_string(), |st| format!("exited ({st})"))
        );
        std::thread::sleep(Duration::from_millis(50));
    }
}

/// Files under `/tmp/tpuray/session_*/binaries/` of `host` (the worker binaries its
/// node agent fetched).
fn cached_binaries(host: &Host) -> Vec<PathBuf> {
    let mut found = Vec::new();
    let Ok(sessions) = std::fs::read_dir(host.tmp.join("tpuray")) else { return found };
    for s in sessions.flatten() {
        if let Ok(bins) = std::fs::read_dir(s.path().join("binaries")) {
            found.extend(bins.flatten().map(|b| b.path()).filter(|p| p.is_file()));
        }
    }
    found
}

#[test]
fn three_hosts_nodes_advertise_their_own_addresses_not_loopback() {
    let (hosts, head, _) = three_host_cluster();
    let nodes = list_nodes(&hosts, &head);
    let ids = node_ids_by_host(&hosts, &nodes);
    assert_eq!(ids.iter().collect::<std::collections::HashSet<_>>().len(), 3, "{ids:?}");
    let ips: Vec<&str> =
        nodes.iter().map(|n| ip_of(n["address"].as_str().unwrap_or_default())).collect();
    let mut sorted = ips.clone();
    sorted.sort();
    assert_eq!(sorted, ["198.18.0.1", "198.18.0.2", "198.18.0.3"], "{nodes:#?}");
}

#[test]
fn a_rust_driver_on_a_worker_host_runs_tasks_on_every_host() {
    let (hosts, head, token) = three_host_cluster();
    let ids = node_ids_by_host(&hosts, &list_nodes(&hosts, &head));
    let h1 = hosts.host(1);
    let auth = [("TPURAY_AUTH_TOKEN", token.as_str())];

    // broadcast: an object put by the driver on host1, read byte-exact by one task on
    // each host (two of them pull it over the bridge).
    let t = Instant::now();
    let mut c = h1.command(driver_bin());
    let bytes = BROADCAST_BYTES.to_string();
    c.args(["broadcast", &head, &bytes, "h0,h1,h2"]).envs(auth);
    let out = output_within(c, DRIVER_TIMEOUT);
    let shown = text(&out);
    eprintln!("broadcast driver on host1 ran in {:?}", t.elapsed());
    assert!(out.status.success(), "broadcast driver failed:\n{shown}");
    let stdout = String::from_utf8_lossy(&out.stdout);
    // The driver found host1's node through host1's own registry.
    let info =
        stdout.lines().find(|l| l.starts_with("INFO node=")).unwrap_or_else(|| panic!("{shown}"));
    assert_eq!(info, format!("INFO node={}", ids[1]), "{shown}");
    let mut ran_on = BTreeMap::new();
    for (i, id) in ids.iter().enumerate() {
        let line = stdout
            .lines()
            .find(|l| l.starts_with(&format!("READ name=h{i} ")))
            .unwrap_or_else(|| panic!("no READ line for h{i}:\n{shown}"));
        assert!(line.contains(" ok=true "), "{line}\n{shown}");
        // `len` is the stored object's size: the bytes plus their encoding's header.
        let len: usize = line
            .split_whitespace()
            .find_map(|w| w.strip_prefix("len="))
            .and_then(|v| v.parse().ok())
            .unwrap_or_else(|| panic!("no len in {line}"));
        assert!(len >= BROADCAST_BYTES, "{line}\n{shown}");
        assert!(line.ends_with(&format!("node={id}")), "h{i}'s task ran elsewhere: {line}");
        ran_on.insert(i, id.clone());
    }
    assert_eq!(ran_on.len(), 3);
    assert!(stdout.lines().any(|l| l.starts_with("DONE ")), "{shown}");
    // BIN-1: the agents of host0 and host2 ran the job's workers from their own copy of
    // its binary, fetched through the cluster into their session's `binaries/`.
    let driver = std::fs::read(driver_bin()).expect("read the driver binary");
    for h in [hosts.host(0), hosts.host(2)] {
        let cached = cached_binaries(h);
        assert!(
            cached.iter().any(|p| std::fs::read(p).is_ok_and(|b| b == driver)),
            "{} has no fetched copy of the driver binary: {cached:?}",
            h.name
        );
    }

    // pulled-copy: a 2 MB result made by a task on host2 (the node with `far`), kept in
    // host2's store, read byte-exact by the driver on host1.
    let done = h1.tmp.join("pulled.done");
    let log = h1.tmp.join("pulled-driver.out");
    let f = std::fs::File::create(&log).expect("driver log");
    let t = Instant::now();
    let mut child = h1
        .command(driver_bin())
        .args(["pulled-copy", &head, "/tmp/pulled.done"])
        .envs(auth)
        .stdin(Stdio::null())
        .stdout(f.try_clone().expect("log fd"))
        .stderr(f)
        .spawn()
        .expect("start the pulled-copy driver");
    wait_for_line(&log, "PULLED ", DRIVER_TIMEOUT, &mut child);
    std::fs::write(&done, "").expect("done file");
    let deadline = Instant::now() + Duration::from_secs(60);
    let status = loop {
        if let Some(st) = child.try_wait().expect("wait") {
            break st;
        }
        if Instant::now() > deadline {
            let _ = child.kill();
            let _ = child.wait();
            panic!("pulled-copy driver still running 60 s after the done file");
        }
        std::thread::sleep(Duration::from_millis(50));
    };
    let s = std::fs::read_to_string(&log).unwrap_or_default();
    eprintln!("pulled-copy driver on host1 ran in {:?}", t.elapsed());
    assert!(status.success(), "pulled-copy driver failed ({status}):\n{s}");
    let line = s.lines().find(|l| l.starts_with("PULLED ")).expect("PULLED line");
    assert!(line.ends_with(" size=2000000 ok=true"), "{line}\n{s}");
}
