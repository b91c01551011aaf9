//! The README's commands and snippets, run as written, so a README that stops working
//! fails the tests: the shell blocks of "Using the CLI" and "Head high availability"
//! (with free ports and this test's folders substituted, and the binary taken from
//! this build instead of the block's `cargo build` line), and its Rust snippets, which
//! `tests/build.rs` copies into the `readme_main` and `readme_slice` binaries. Every
//! process runs on loopback (`TPURAY_NODE_IP_ADDRESS=127.0.0.1`) with this test's own
//! `HOME` and process registry.

use std::path::{Path, PathBuf};
use std::process::{Command, Output};
use std::time::Duration;

use tpuray_tests::hosts::output_within;
use tpuray_tests::{stable_port, tpuray_bin};

const README: &str = include_str!("../../README.md");
const TIMEOUT: Duration = Duration::from_secs(180);

/// The first ```` ```sh ```` block after the heading `heading`.
fn shell_block(heading: &str) -> String {
    let start = README.find(heading).unwrap_or_else(|| panic!("README has no {heading:?}"));
    let rest = &README[start..];
    let open = rest.find("```sh\n").expect("a ```sh block after the heading") + 6;
    let len = rest[open..].find("```").expect("the block's end");
    rest[open..open + len].to_string()
}

/// A private environment: `HOME`, registry, loopback, this build's `tpuray` first on PATH.
struct Env {
    dir: tempfile::TempDir,
}

impl Env {
    fn new() -> Self {
        Env { dir: tempfile::Builder::new().prefix("tpuray-readme-").tempdir().unwrap() }
    }

    fn path(&self) -> &Path {
        self.dir.path()
    }

    fn command(&self, program: impl AsRef<std::ffi::OsStr>) -> Command {
        let bin_dir = tpuray_bin().parent().unwrap().to_path_buf();
        let path = format!("{}:{}", bin_dir.display(), std::env::var("PATH").unwrap_or_default());
        let mut c = Command::new(program);
        c.env("HOME", self.path().join("home"))
            .env("TPURAY_REGISTRY_DIR", self.path().join("registry"))
            // A block's `tpuray start` without --temp-dir leaves its session here, not in
            // /tmp/tpuray (a head's session holds a few hundred MB of Raft data).
            .env("TPURAY_TEMP_DIR", self.path().join("tpuray"))
            .env("TPURAY_NODE_IP_ADDRESS", "127.0.0.1")
            .env("PATH", path)
            .env_remove("TPURAY_ADDRESS")
            .env_remove("TPURAY_AUTH_TOKEN")
            .current_dir(self.path());
        c
    }

    /// Runs `script` with bash (`-euo pipefail`); panics with its output when it fails.
    fn bash(&self, script: &str) -> String {
        let mut c = self.command("bash");
        c.args(["-euo", "pipefail", "-c", script]);
        expect_ok(output_within(c, TIMEOUT), script)
    }

    fn run(&self, program: &Path, envs: &[(&str, &str)]) -> String {
        let mut c = self.command(program);
        for (k, v) in envs {
            c.env(k, v);
        }
        expect_ok(output_within(c, TIMEOUT), &program.display().to_string())
    }
}

impl Drop for Env {
    fn drop(&mut self) {
        let mut c = self.command(tpuray_bin());
        c.args(["stop", "--force"]);
        let _ = output_within(c, TIMEOUT);
    }
}

fn expect_ok(out: Output, what: &str) -> String {
    let stdout = String::from_utf8_lossy(&out.stdout).into_owned();
    assert!(
        out.status.success(),
        "{what} failed ({}):\n--- stdout ---\n{stdout}\n--- stderr ---\n{}",
        out.status,
        String::from_utf8_lossy(&out.stderr)
    );
    stdout
}

/// `block` as the test runs it: its `cargo build` line dropped (this build's binary is
/// on PATH), each port in `ports` replaced by a free one, `/tmp/` paths moved under `dir`.
fn substituted(block: &str, ports: &[&str], dir: &Path) -> String {
    let mut s: String = block
        .lines()
        .filter(|l| !l.trim_start().starts_with("cargo build"))
        .map(|l| format!("{l}\n"))
        .collect();
    for p in ports {
        s = s.replace(p, &stable_port().to_string());
    }
    s.replace("/tmp/", &format!("{}/", dir.display()))
}

#[test]
fn the_readme_cli_block_runs_as_written() {
    let env = Env::new();
    let block = shell_block("## Using the CLI");
    assert!(block.contains("tpuray start --head"), "{block}");
    let out = env.bash(&substituted(&block, &["6379"], env.path()));
    assert!(out.contains("tpuray head started at 127.0.0.1:"), "{out}");
    assert!(out.contains("Nodes (2 alive"), "status shows both nodes:\n{out}");
    assert!(out.contains("\"special\""), "list nodes shows the custom resource:\n{out}");
    assert!(out.contains("hello from a job"), "tpuray job submit streams the job's logs:\n{out}");
    assert!(out.contains("succeeded"), "tpuray job submit waits for the job's end:\n{out}");
}

#[test]
fn the_readme_high_availability_block_runs_as_written_one_start_after_another() {
    let env = Env::new();
    let block = shell_block("## Head high availability");
    assert!(block.contains("for i in 1 2 3"), "{block}");
    let script = substituted(&block, &["7001", "7002", "7003"], env.path());
    let out = env.bash(&script);
    assert!(out.contains("Head replicas (leader: "), "status names a leader:\n{out}");
    assert!(out.contains("joined the cluster at 127.0.0.1:"), "{out}");
    // REG-2: head 1 restarted without --head-only while its node agent runs is refused,
    // naming that agent, instead of adding a second node for the machine.
    let peers = script.lines().find_map(|l| l.strip_prefix("P=")).expect("the block sets P");
    let dir = env.path().display();
    let mut again = env.command(tpuray_bin());
    again.args(["start", "--head", "--head-peers", peers, "--head-id", "1"]);
    again.args(["--head-data-dir", &format!("{dir}/head1"), "--temp-dir", &format!("{dir}/h1b")]);
    let out = output_within(again, TIMEOUT);
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success(), "a second agent for head 1 was started");
    assert!(
        err.contains("the node agent of this head already runs on this machine (pid "),
        "{err}"
    );
}

#[test]
fn the_readme_rust_snippets_run_as_written() {
    let env = Env::new();
    let port = stable_port().to_string();
    env.bash(&format!("tpuray start --head --port {port} --num-cpus 4"));
    let main = PathBuf::from(env!("CARGO_BIN_EXE_readme_main"));
    let out = env.run(&main, &[]);
    assert!(out.contains("add(add(1, 2), 10) = 13"), "{out}");
    // One simulated v6e-16 slice, each host started as the README's line says.
    for w in 0..4 {
        env.bash(&format!(
            "TPU_ACCELERATOR_TYPE=v6e-16 TPU_NAME=sa TPU_WORKER_ID={w} TPU_TOPOLOGY=4x4 \
             tpuray start --address 127.0.0.1:{port} --resources '{{\"TPU\": 4}}' \
             --num-cpus 1 --temp-dir {}/tpu{w}",
            env.path().display()
        ));
    }
    let slice = PathBuf::from(env!("CARGO_BIN_EXE_readme_slice"));
    let out = env.run(&slice, &[]);
    assert!(out.contains("host 0 of the slice sees chips 0,1,2,3"), "{out}");
}
