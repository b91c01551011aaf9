//! Mutual TLS (TLS-1..TLS-4): an all-TLS cluster of three head replicas over three
//! simulated hosts (`tpuray_tests::hosts`) runs tasks, actors and cross-host objects;
//! on loopback, a node with a certificate of another CA, an expired certificate or no
//! TLS at all is refused by a TLS head with the reason named on both sides, and a TLS
//! node is refused by a plain head. Certificates come from `tpuray tls make-ca` and
//! `tpuray tls make-cert`. The three-host test needs root.

use std::path::{Path, PathBuf};
use std::process::{Command, Output};
use std::time::{Duration, Instant};

use tpuray_tests::hosts::{Host, Hosts, output_within};
use tpuray_tests::{Cluster, tpuray_bin};

const PORT: u16 = 6379;
/// Bound for one `tpuray` CLI call.
const CLI_TIMEOUT: Duration = Duration::from_secs(120);
/// Bound for the driver's run.
const DRIVER_TIMEOUT: Duration = Duration::from_secs(300);
/// Bytes of each object the mesh driver moves between hosts (stored, not inline).
const MESH_BYTES: usize = 2_000_000;

fn text(out: &Output) -> String {
    format!(
        "exit: {}\n--- stdout ---\n{}\n--- stderr ---\n{}",
        out.status,
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    )
}

/// `tpuray ARGS` outside any host (certificate making); panics when it fails.
fn tpuray_here(args: &[&str]) {
    let out = output_within(
        {
            let mut c = Command::new(tpuray_bin());
            c.args(args);
            c
        },
        CLI_TIMEOUT,
    );
    assert!(out.status.success(), "tpuray {args:?} failed:\n{}", text(&out));
}

/// The `TPURAY_TLS_*` environment for the certificate in `dir` and the CA in `ca`.
fn tls_env(dir: &Path, ca: &Path) -> Vec<(String, String)> {
    vec![
        ("TPURAY_TLS_CERT".into(), dir.join("cert.pem").display().to_string()),
        ("TPURAY_TLS_KEY".into(), dir.join("key.pem").display().to_string()),
        ("TPURAY_TLS_CA".into(), ca.join("ca.pem").display().to_string()),
    ]
}

fn make_ca(dir: &Path) -> PathBuf {
    tpuray_here(&["tls", "make-ca", "--out", &dir.display().to_string()]);
    dir.to_path_buf()
}

fn make_cert(ca: &Path, hosts: &str, out: &Path) -> PathBuf {
    let (ca_s, out_s) = (ca.display().to_string(), out.display().to_string());
    tpuray_here(&["tls", "make-cert", "--ca", &ca_s, "--host", hosts, "--out", &out_s]);
    out.to_path_buf()
}

/// `tpuray ARGS` in `host` with `envs`; its output, panicking when it fails.
fn tpuray_in(host: &Host, args: &[&str], envs: &[(String, String)]) -> String {
    let mut c = host.command(tpuray_bin());
    c.args(args).envs(envs.iter().map(|(k, v)| (k, v)));
    let out = output_within(c, CLI_TIMEOUT);
    assert!(out.status.success(), "tpuray {args:?} in {} failed:\n{}", host.name, text(&out));
    String::from_utf8_lossy(&out.stdout).into_owned()
}

/// TLS-2: heads, agents, workers and the driver on three hosts all talk mutual TLS, with
/// certificates naming each host's address.
#[test]
fn an_all_tls_cluster_of_three_heads_on_three_hosts_runs_tasks_actors_and_objects() {
    let hosts = Hosts::new(3);
    let tls_dir = hosts.workdir().join("tls");
    let ca = make_ca(&tls_dir.join("ca"));
    // One certificate per host, naming its hostname and address (clients verify the
    // host they dial: every address here is an IP).
    let certs: Vec<PathBuf> = hosts
        .hosts()
        .iter()
        .map(|h| make_cert(&ca, &format!("{},{}", h.name, h.address), &tls_dir.join(&h.name)))
        .collect();
    let peers: Vec<String> =
        hosts.hosts().iter().map(|h| format!("{}:{PORT}", h.address)).collect();
    let peers = peers.join(",");
    // Three heads, each with the host's node agent, share one token.
    let token = uuid_like();
    let env_of = |i: usize| {
        let mut e = tls_env(&certs[i], &ca);
        e.push(("TPURAY_AUTH_TOKEN".into(), token.clone()));
        e
    };
    let started: Vec<std::thread::JoinHandle<Output>> = hosts
        .hosts()
        .iter()
        .enumerate()
        .map(|(i, h)| {
            let mut c = h.command(tpuray_bin());
            let id = (i + 1).to_string();
            let res = format!(r#"{{"h{i}": 1}}"#);
            c.args(["start", "--head", "--head-peers", &peers, "--head-id", &id])
                .args(["--port", &PORT.to_string(), "--num-cpus", "1", "--resources", &res])
                .envs(env_of(i));
            std::thread::spawn(move || output_within(c, CLI_TIMEOUT))
        })
        .collect();
    for (i, t) in started.into_iter().enumerate() {
        let out = t.join().expect("start thread");
        assert!(out.status.success(), "head {} did not start:\n{}", i + 1, text(&out));
    }
    // Every node agent joins in the background, over TLS.
    let deadline = Instant::now() + Duration::from_secs(180);
    let nodes = loop {
        let out = tpuray_in(
            hosts.host(0),
            &["list", "nodes", "--format", "json", "--address", &peers],
            &env_of(0),
        );
        let v: serde_json::Value = serde_json::from_str(&out).unwrap_or(serde_json::Value::Null);
        let alive: Vec<serde_json::Value> = v
            .as_array()
            .map(|a| a.iter().filter(|n| n["state"] == "ALIVE").cloned().collect())
            .unwrap_or_default();
        if alive.len() == 3 {
            break alive;
        }
        assert!(Instant::now() < deadline, "three TLS nodes never joined: {out}");
        std::thread::sleep(Duration::from_millis(500));
    };
    let node_of = |i: usize| -> String {
        let n = nodes
            .iter()
            .find(|n| n["resources_total"].get(format!("h{i}")).is_some())
            .unwrap_or_else(|| panic!("no node with h{i}: {nodes:#?}"));
        n["node_id"].as_str().expect("node id").to_string()
    };
    let ids: Vec<String> = (0..3).map(node_of).collect();
    // `tpuray status` lists the three replicas, reached over TLS.
    let status = tpuray_in(hosts.host(2), &["status", "--address", &peers], &env_of(2));
    assert!(status.contains("Head replicas (leader: "), "{status}");

    // A Rust driver on host1: for each host a task, an actor pinned there (two calls)
    // and a 2 MB object made there, read byte-exact here and on the next host.
    let mut c = hosts.host(1).command(env!("CARGO_BIN_EXE_tpuray-test-driver"));
    c.args(["mesh", &peers, &MESH_BYTES.to_string(), "h0,h1,h2"]).envs(env_of(1));
    let out = output_within(c, DRIVER_TIMEOUT);
    let shown = text(&out);
    assert!(out.status.success(), "mesh driver failed:\n{shown}");
    let stdout = String::from_utf8_lossy(&out.stdout);
    for i in 0..3 {
        let line = stdout
            .lines()
            .find(|l| l.starts_with(&format!("MESH name=h{i} ")))
            .unwrap_or_else(|| panic!("no MESH line for h{i}:\n{shown}"));
        let next = &ids[(i + 1) % 3];
        assert!(line.contains(&format!(" task={} ", ids[i])), "{line}\n{shown}");
        assert!(line.contains(&format!(" actor={} ", ids[i])), "{line}\n{shown}");
        assert!(line.contains(" calls=2 "), "{line}");
        assert!(line.contains(" here=true "), "the object made on h{i} read here: {line}");
        assert!(
            line.contains(" next=true "),
            "the object made on h{i} read on h{}: {line}",
            (i + 1) % 3
        );
        assert!(line.ends_with(&format!(" next_node={next}")), "{line}\n{shown}");
    }
    assert!(stdout.lines().any(|l| l == "DONE"), "{shown}");

    // A plain driver is refused naming the mismatch, not run in clear text.
    let mut c = hosts.host(1).command(env!("CARGO_BIN_EXE_tpuray-test-driver"));
    c.args(["mesh", &peers, "1", "h0"]).env("TPURAY_AUTH_TOKEN", &token);
    let out = output_within(c, DRIVER_TIMEOUT);
    let shown = text(&out);
    assert!(!out.status.success(), "a plain driver ran on a TLS cluster:\n{shown}");
    assert!(
        shown.contains("TLS mismatch") && shown.contains("uses TLS but this process is plain"),
        "{shown}"
    );
}

/// A token-like random string (the heads of the three-host test share it).
fn uuid_like() -> String {
    use rand::Rng;
    let mut r = rand::rng();
    (0..32).map(|_| char::from(b"0123456789abcdef"[r.random_range(0..16)])).collect()
}

/// Every `.err` log of `c`'s processes, concatenated.
fn logs_of(c: &Cluster) -> String {
    c.logs().iter().map(|p| std::fs::read_to_string(p).unwrap_or_default()).collect()
}

/// `tpuray start --address` of `c`'s head with the TLS environment `env` (none:
/// plain); expected to fail: its output.
fn join_fails(c: &Cluster, env: &[(String, String)], name: &str) -> String {
    let temp = c.dir().join(name).display().to_string();
    let addr = c.head_addr();
    let mut cmd = c.command(&["start", "--address", &addr, "--temp-dir", &temp, "--num-cpus", "1"]);
    cmd.env_remove("TPURAY_TLS_CERT").env_remove("TPURAY_TLS_KEY").env_remove("TPURAY_TLS_CA");
    cmd.envs(env.iter().map(|(k, v)| (k, v)));
    // TLS-3/TLS-4: refused at once, never retried until the join gives up (which would
    // say "cannot reach the head ... after").
    cmd.env("TPURAY_HEAD_CONNECT_TIMEOUT_MS", "600000");
    let out = output_within(cmd, CLI_TIMEOUT);
    let shown = text(&out);
    assert!(!out.status.success(), "node {name} joined:\n{shown}");
    assert!(shown.contains(&format!("cannot join the head at {addr}: ")), "{shown}");
    shown
}

/// TLS-2: the head requires a client certificate signed by the cluster's CA, and a client
/// verifies the head's against its CA (other CA, expired, plain: each refused and named).
#[test]
fn a_tls_head_refuses_other_cas_expired_certificates_and_plain_nodes_naming_why() {
    let d = tempfile::tempdir().expect("tempdir");
    let ca = make_ca(&d.path().join("ca"));
    let good = make_cert(&ca, "node", &d.path().join("good"));
    let mut c = Cluster::new();
    for (k, v) in tls_env(&good, &ca) {
        c.set_env(&k, &v);
    }
    let head = c.start_head(&["--num-cpus", "1"]);
    // A TLS node joins, and the CLI reaches the cluster over TLS.
    let node = c.add_node(&["--num-cpus", "1"]);
    assert_ne!(node.node_id, head.node_id);
    assert!(c.status().contains("2 alive"), "{}", c.status());
    // The Jobs API over HTTPS (the head names its https:// dashboard), token on top.
    let addr = c.head_addr();
    let jobs = c.cli_ok(&["job", "list", "--address", &addr]);
    assert!(jobs.contains("https://127.0.0.1:"), "{jobs}");
    let mut plain_cli = c.command(&["job", "list", "--address", &addr]);
    plain_cli
        .env_remove("TPURAY_TLS_CERT")
        .env_remove("TPURAY_TLS_KEY")
        .env_remove("TPURAY_TLS_CA");
    let out = text(&output_within(plain_cli, CLI_TIMEOUT));
    assert!(out.contains("TLS mismatch") && out.contains("this process is plain"), "{out}");

    // Another CA: the node refuses the head's certificate, the head the node's.
    let other_ca = make_ca(&d.path().join("other-ca"));
    let other = make_cert(&other_ca, "node", &d.path().join("other"));
    let out = join_fails(&c, &tls_env(&other, &other_ca), "other-ca");
    assert!(out.contains("the server's certificate is not signed by this cluster's CA"), "{out}");
    // Signed by another CA but trusting the cluster's: the head refuses it.
    let out = join_fails(&c, &tls_env(&other, &ca), "other-cert");
    assert!(out.contains("refused this process's certificate: not signed by its CA"), "{out}");

    // An expired certificate of the cluster's CA.
    let now = time::OffsetDateTime::now_utc();
    let expired = d.path().join("expired");
    tpuray_cli::tls::make_cert_valid(
        &ca,
        &["node".to_string()],
        &expired,
        now - time::Duration::days(30),
        now - time::Duration::days(1),
    )
    .expect("make an expired certificate");
    let out = join_fails(&c, &tls_env(&expired, &ca), "expired");
    assert!(out.contains("refused this process's certificate: it has expired"), "{out}");

    // A plain node.
    let out = join_fails(&c, &[], "plain");
    assert!(
        out.contains("TLS mismatch") && out.contains("uses TLS but this process is plain"),
        "{out}"
    );

    // The head's side names each reason.
    tpuray_tests::wait_until(Duration::from_secs(20), "the head logs every refusal", || {
        let logs = logs_of(&c);
        logs.contains("the client's certificate is not signed by this cluster's CA")
            && logs.contains("the client's certificate has expired")
            && logs.contains("the client does not speak TLS")
            && logs.contains("the client refused this process's certificate")
    });

    // The reverse: a TLS node joining a plain cluster.
    let mut plain = Cluster::new();
    plain.start_head(&["--num-cpus", "1"]);
    let out = join_fails(&plain, &tls_env(&good, &ca), "tls-to-plain");
    assert!(out.contains("TLS mismatch") && out.contains("is plain"), "{out}");
}
