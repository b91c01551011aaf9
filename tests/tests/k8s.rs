//! Kubernetes (issue 31): the rendered examples in `deploy/k8s/examples` are what
//! `tpuray k8s manifests` renders today and pass `kubernetes-validate --strict` and
//! `yamllint`; bad slice shapes are refused naming them; a pod-shaped `tpuray start
//! --block` (the environment a slice StatefulSet gives its pods) advertises what the
//! hand-made start of the same worker does; SIGTERM drains a node (AGENT-16).
//!
//! `kubernetes-validate` and `yamllint` come from PyPI into the tests' venv (`.venv-test`)
//! (`scripts/test.sh` installs them); they validate offline, against the schemas bundled
//! with kubernetes-validate, for Kubernetes 1.34 (`tpuray_cli::k8s::KUBERNETES_VERSION`).

use std::io::BufRead;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use tpuray_tests::*;

fn repo_root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).parent().expect("workspace root").to_path_buf()
}

/// A tool from the tests' virtual environment (`$TPURAY_TEST_VENV`, default
/// `.venv-test`, where scripts/test.sh installs it), else from `.venv`, else PATH.
fn venv_tool(name: &str) -> PathBuf {
    let test_venv = std::env::var_os("TPURAY_TEST_VENV")
        .map(PathBuf::from)
        .unwrap_or_else(|| repo_root().join(".venv-test"));
    for venv in [test_venv, repo_root().join(".venv")] {
        let p = venv.join("bin").join(name);
        if p.exists() {
            return p;
        }
    }
    let found = std::env::var_os("PATH")
        .into_iter()
        .flat_map(|p| std::env::split_paths(&p).collect::<Vec<_>>())
        .map(|d| d.join(name))
        .find(|p| p.exists());
    found.unwrap_or_else(|| {
        panic!(
            "{name} is not installed: run scripts/test.sh's setup, or `.venv-test/bin/python -m \
             pip install kubernetes-validate yamllint`"
        )
    })
}

/// Every example with the command on its first line, `# tpuray k8s manifests ...`.
fn examples() -> Vec<(PathBuf, Vec<String>)> {
    let dir = repo_root().join("deploy/k8s/examples");
    let mut out: Vec<(PathBuf, Vec<String>)> = std::fs::read_dir(&dir)
        .unwrap_or_else(|e| panic!("{}: {e}", dir.display()))
        .filter_map(|e| e.ok().map(|e| e.path()))
        .filter(|p| p.extension().is_some_and(|x| x == "yaml"))
        .map(|p| {
            let text = std::fs::read_to_string(&p).unwrap();
            let first = text.lines().next().unwrap_or_default();
            let args = first
                .strip_prefix("# tpuray ")
                .filter(|a| a.starts_with("k8s manifests "))
                .unwrap_or_else(|| {
                    panic!("{}: first line is not `# tpuray k8s manifests ...`", p.display())
                });
            (p.clone(), args.split_whitespace().map(String::from).collect())
        })
        .collect();
    out.sort();
    out
}

#[test]
fn rendered_examples_match_the_cli_and_pass_kubernetes_validate_strict_and_yamllint() {
    let all = examples();
    assert!(all.len() >= 3, "expected three rendered examples, found {}", all.len());
    for (path, args) in &all {
        let out = Command::new(tpuray_bin()).args(args).output().expect("run tpuray");
        assert!(
            out.status.success(),
            "tpuray {args:?} failed: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        let rendered = String::from_utf8(out.stdout).unwrap();
        let text = std::fs::read_to_string(path).unwrap();
        let (_, body) = text.split_once('\n').unwrap();
        assert!(
            body == rendered,
            "{} is not what `tpuray {}` renders today: run scripts/render-k8s-examples.sh",
            path.display(),
            args.join(" ")
        );
        assert!(body.contains("kind: StatefulSet"), "{}", path.display());
    }
    let files: Vec<&Path> = all.iter().map(|(p, _)| p.as_path()).collect();
    let v = Command::new(venv_tool("kubernetes-validate"))
        .args(["--strict", "--kubernetes-version", tpuray_cli::k8s::KUBERNETES_VERSION])
        .args(&files)
        .output()
        .expect("run kubernetes-validate");
    let report =
        String::from_utf8_lossy(&v.stdout).into_owned() + &String::from_utf8_lossy(&v.stderr);
    assert!(v.status.success(), "kubernetes-validate --strict refused:\n{report}");
    // Every object was checked (one `passed` line each), none skipped as unknown.
    let objects: usize = all
        .iter()
        .map(|(p, _)| std::fs::read_to_string(p).unwrap().matches("\nkind: ").count())
        .sum();
    assert_eq!(report.matches(" passed for resource ").count(), objects, "{report}");
    let y = Command::new(venv_tool("yamllint"))
        .args(["--strict", "-c"])
        .arg(repo_root().join("deploy/k8s/.yamllint"))
        .args(&files)
        .output()
        .expect("run yamllint");
    assert!(
        y.status.success(),
        "yamllint refused:\n{}{}",
        String::from_utf8_lossy(&y.stdout),
        String::from_utf8_lossy(&y.stderr)
    );
}

/// The README's `tpuray k8s manifests ... | kubectl apply -f -` line renders.
#[test]
fn readme_manifests_command_renders() {
    let readme = std::fs::read_to_string(repo_root().join("README.md")).unwrap();
    let at = readme.find("\ntpuray k8s manifests ").expect("README shows tpuray k8s manifests");
    let line: String =
        readme[at + 1..].split(" | kubectl apply").next().unwrap().replace("\\\n", " ");
    let words: Vec<&str> = line.split_whitespace().skip(1).collect();
    let out = Command::new(tpuray_bin()).args(&words).output().expect("run tpuray");
    assert!(out.status.success(), "{line}: {}", String::from_utf8_lossy(&out.stderr));
    let yaml = String::from_utf8(out.stdout).unwrap();
    assert!(yaml.contains("name: demo-v6e-16-0\n") && yaml.contains("replicas: 4\n"), "{yaml}");
}

#[test]
fn bad_slice_shapes_are_refused_naming_the_value_and_print_nothing() {
    for (slice, needle) in [
        ("v9z-16", "\"v9z-16\""),
        ("v6e-12", "\"v6e-12\" is not a slice size of v6e"),
        ("v5p-24", "\"v5p-24\" is not a slice size of v5p"),
        ("v6e-16:0", "count \"0\""),
    ] {
        let out = Command::new(tpuray_bin())
            .args(["k8s", "manifests", "--name", "x", "--image", "i", "--slice", slice])
            .output()
            .expect("run tpuray");
        let err = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(1), "--slice {slice}: {err}");
        assert!(err.contains(needle), "--slice {slice}: {err}");
        assert!(out.stdout.is_empty(), "--slice {slice} printed YAML");
    }
}

/// The slice environment of TPU.md's simulated host, for a pod or a hand-made start.
const SLICE_ENV: [(&str, &str); 4] = [
    ("TPU_ACCELERATOR_TYPE", "v6e-16"),
    ("TPU_TOPOLOGY", "4x4"),
    ("TPU_NAME", "sa"),
    (
        "TPU_WORKER_HOSTNAMES",
        "sa-0.sa.default.svc,sa-1.sa.default.svc,sa-2.sa.default.svc,sa-3.sa.default.svc",
    ),
];
/// Flags both starts share (memory given, so the advertised amounts do not follow the
/// machine's free memory of the moment).
const NODE_FLAGS: [&str; 8] = [
    "--num-cpus",
    "1",
    "--resources",
    r#"{"TPU": 4}"#,
    "--memory",
    "1000000000",
    "--object-store-memory",
    "100000000",
];

/// A `tpuray start --address HEAD --block ...` in the foreground, as a pod's command:
/// its pid is what Kubernetes signals.
struct Blocked {
    child: Child,
    node_id: String,
}

impl Blocked {
    fn start(
        c: &Cluster,
        temp: &str,
        extra: &[&str],
        envs: &[(&str, &str)],
        unset: &[&str],
    ) -> Self {
        let addr = c.head_addr();
        let mut cmd = c.command(&["start", "--address", &addr, "--block", "--temp-dir", temp]);
        cmd.args(extra).stdout(Stdio::piped()).stderr(Stdio::inherit());
        for (k, v) in envs {
            cmd.env(k, v);
        }
        for k in unset {
            cmd.env_remove(k);
        }
        let mut child = cmd.spawn().expect("start tpuray --block");
        let stdout = child.stdout.take().unwrap();
        let (tx, rx) = std::sync::mpsc::channel();
        std::thread::spawn(move || {
            for line in std::io::BufReader::new(stdout).lines().map_while(Result::ok) {
                let _ = tx.send(line);
            }
        });
        let deadline = Instant::now() + SOON;
        let node_id = loop {
            let line = rx
                .recv_timeout(deadline.saturating_duration_since(Instant::now()))
                .expect("`tpuray start --block` printed no `joined` line in time");
            if let Some(rest) = line.strip_prefix("tpuray node ") {
                break rest.split_whitespace().next().unwrap().to_string();
            }
        };
        Self { child, node_id }
    }

    /// Waits for the process to exit, at most `within`; returns how long it took.
    fn wait_exit(&mut self, within: Duration) -> Duration {
        let t = Instant::now();
        while t.elapsed() < within {
            if let Ok(Some(_)) = self.child.try_wait() {
                return t.elapsed();
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        panic!("`tpuray start --block` still runs {within:?} after SIGTERM");
    }
}

impl Drop for Blocked {
    fn drop(&mut self) {
        if let Ok(None) = self.child.try_wait() {
            let _ = self.child.kill();
        }
        let _ = self.child.wait();
    }
}

/// The fields the node advertises: its resources and labels as the head reports them.
fn advertised(n: &serde_json::Value) -> (serde_json::Value, serde_json::Value) {
    (n["resources_total"].clone(), n["labels"].clone())
}

#[test]
fn pod_shaped_start_advertises_what_the_hand_made_start_of_worker_2_does() {
    // The hand-made start of worker 2 (TPU.md's simulated host).
    let mut by_hand = Cluster::new();
    by_hand.start_head(&["--num-cpus", "0"]);
    for (k, v) in SLICE_ENV {
        by_hand.set_env(k, v);
    }
    by_hand.set_env("TPU_WORKER_ID", "2");
    let h = by_hand.add_node(&NODE_FLAGS);
    let want = advertised(&by_hand.list_node(&h.node_id));
    assert_eq!(want.1["tpuray.io/tpu-worker-id"], "2", "{want:?}");

    // The pod: HOSTNAME is the StatefulSet pod name, POD_IP its address, no TPU_WORKER_ID.
    let mut pods = Cluster::new();
    pods.start_head(&["--num-cpus", "0"]);
    let metrics = free_port();
    let metrics_s = metrics.to_string();
    let temp = pods.dir().join("pod").display().to_string();
    let mut flags = NODE_FLAGS.to_vec();
    flags.extend(["--metrics-export-port", &metrics_s]);
    let mut env: Vec<(&str, &str)> = SLICE_ENV.to_vec();
    env.extend([("HOSTNAME", "sa-2"), ("POD_IP", "127.0.0.2")]);
    let mut pod =
        Blocked::start(&pods, &temp, &flags, &env, &["TPU_WORKER_ID", "JOB_COMPLETION_INDEX"]);
    let n = pods.list_node(&pod.node_id);
    assert_eq!(advertised(&n), want, "pod-shaped node:\n{n:#}");
    let address = n["address"].as_str().unwrap();
    assert!(address.starts_with("127.0.0.2:"), "the node's address is not POD_IP's: {address}");
    // The agent (whose environment its workers inherit) has the derived TPU_WORKER_ID.
    let agent_pid = n["pid"].as_u64().unwrap();
    let environ = std::fs::read(format!("/proc/{agent_pid}/environ")).unwrap();
    assert!(
        environ.split(|b| *b == 0).any(|kv| kv == b"TPU_WORKER_ID=2"),
        "the agent's environment lacks TPU_WORKER_ID=2"
    );

    // Kubernetes' probes, without a token, on --metrics-export-port at POD_IP.
    let url = format!("http://127.0.0.2:{metrics}");
    assert_eq!(http(&url, "GET", "/healthz", None, "").0, 200);
    let (code, body) = http(&url, "GET", "/readyz", None, "");
    assert_eq!((code, body.trim()), (200, "ready"));

    // SIGTERM with nothing running: the node leaves at once and the process exits.
    signal(pod.child.id(), libc::SIGTERM);
    let took = pod.wait_exit(Duration::from_secs(20));
    let n = pods.list_node(&pod.node_id);
    assert_eq!(node_state(&n), "DEAD", "{n:#}");
    assert!(n["death_reason"].as_str().unwrap().contains("drained"), "{n:#}");
    eprintln!("idle pod exited {took:?} after SIGTERM");
}

#[test]
fn sigterm_during_a_task_drains_the_node_and_the_driver_gets_its_result() {
    let mut c = Cluster::new();
    // A death timeout far beyond the test: a node seen dead within seconds was told.
    c.set_env("TPURAY_NODE_DEATH_TIMEOUT_MS", "120000");
    // The driver's node runs nothing: the task goes to the node that drains.
    c.start_head(&["--num-cpus", "0"]);
    let metrics = free_port();
    let metrics_s = metrics.to_string();
    let temp = c.dir().join("pod").display().to_string();
    let mut pod = Blocked::start(
        &c,
        &temp,
        &["--num-cpus", "1", "--drain-grace-period", "20", "--metrics-export-port", &metrics_s],
        &[],
        &[],
    );
    let work = tempfile::tempdir().unwrap();
    let pid_file = work.path().join("task.pid");
    let bin = PathBuf::from(env!("CARGO_BIN_EXE_tpuray-test-driver"));
    let addr = c.head_addr();
    let pid_s = pid_file.display().to_string();
    let go = work.path().join("go");
    let go_s = go.display().to_string();
    let mut d = Driver::start(&c, &bin, &["sleep-task", &addr, &pid_s, "12000", &go_s], &[]);
    d.wait_line("SUBMITTED", SOON);
    wait_until(SOON, "the task started", || pid_file.exists());
    let task_started = Instant::now();
    let first = std::fs::read_to_string(&pid_file).unwrap();
    assert!(first.trim().ends_with(&pod.node_id), "the task ran elsewhere: {first}");
    // Where the retry can go.
    let other = c.add_node(&["--num-cpus", "1"]);

    let sent = Instant::now();
    signal(pod.child.id(), libc::SIGTERM);
    let mut dead_after = None;
    let mut not_ready = false;
    let url = format!("http://127.0.0.1:{metrics}");
    while sent.elapsed() < Duration::from_secs(10) {
        if !not_ready && let Ok(s) = std::net::TcpStream::connect(("127.0.0.1", metrics)) {
            drop(s);
            let (code, body) = http(&url, "GET", "/readyz", None, "");
            not_ready = code == 503 && body.contains("draining");
        }
        if node_state(&c.list_node(&pod.node_id)) == "DEAD" {
            dead_after = Some(sent.elapsed());
            break;
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    let dead_after = dead_after.expect("the head still lists the draining node alive after 10 s");
    // Far below the 120 s death timeout: the agent told the head.
    assert!(dead_after < Duration::from_secs(5), "dead only after {dead_after:?}");
    // The task's first attempt was still running on it (12 s): the agent waits for it,
    // within its grace.
    let (code, body) = http(&url, "GET", "/readyz", None, "");
    assert!(
        not_ready || (code == 503 && body.contains("draining")),
        "/readyz while draining: {code} {body}"
    );
    assert!(pod_alive(&mut pod.child), "the node exited before its running task finished");

    // The owner retried it elsewhere at once (the node was dead for it) and has its
    // result; it stays alive, so the first attempt is not an orphan that its node kills.
    let result = d.wait_line("RESULT ", Duration::from_secs(60));
    assert!(result.starts_with("RESULT 42 "), "{result}");
    let last = std::fs::read_to_string(&pid_file).unwrap();
    assert!(last.trim().ends_with(&other.node_id), "not retried on the other node: {last}");

    // The draining node exits once the first attempt's 12 s are over, within its grace.
    let exited = pod.wait_exit(Duration::from_secs(30));
    assert!(sent.elapsed() < Duration::from_secs(20 + 10), "exit took {:?}", sent.elapsed());
    assert!(
        task_started.elapsed() >= Duration::from_secs(12),
        "the node exited {:?} after its task started, before the task's 12 s were over",
        task_started.elapsed()
    );
    let log = std::fs::read_to_string(Path::new(&temp).join("session_latest/logs/agent.err"))
        .unwrap_or_default();
    assert!(
        log.contains("drained: no task runs on this node any more")
            && !log.contains("lease holder is gone"),
        "the agent did not let its running task finish:\n{log}"
    );
    std::fs::write(&go, "").unwrap();
    d.finish(Duration::from_secs(30)).assert_success();
    eprintln!(
        "node dead {dead_after:?} after SIGTERM; process exited {exited:?} after the driver's result, {:?} after the task started",
        task_started.elapsed()
    );
}

fn pod_alive(c: &mut Child) -> bool {
    matches!(c.try_wait(), Ok(None))
}
