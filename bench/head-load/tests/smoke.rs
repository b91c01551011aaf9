//! A short run of `head_load` so it keeps building and running (issue 34): 20 simulated
//! nodes against a real head for 5 s, with a few actors, placement groups and one TPU
//! slice group. Checks the outcome, never a timing: no false node deaths, everything
//! placed, and the last line's format. Uses the debug `tpuray` binary beside this
//! package's (`cargo build -p tpuray-cli` first, as `scripts/test.sh` does).

use std::process::Command;

#[test]
fn twenty_simulated_nodes_hold_with_no_false_deaths_and_everything_placed() {
    let exe = env!("CARGO_BIN_EXE_head_load");
    let tpuray = std::path::Path::new(exe).with_file_name("tpuray");
    assert!(
        tpuray.exists(),
        "{} is missing: run `cargo build -p tpuray-cli` first",
        tpuray.display()
    );
    let out = Command::new(exe)
        .args(["--nodes", "20", "--seconds", "5", "--actors", "40", "--pgs", "5", "--slices", "1"])
        .args(["--place-timeout", "120"])
        .env("TPURAY_ALLOW_DEBUG_BUILD", "1")
        .output()
        .expect("run head_load");
    let stdout = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "head_load failed ({}):\n{stdout}\n{stderr}", out.status);
    assert!(stdout.contains("simulated, not real: actors are records"), "{stdout}");
    assert!(stdout.contains("registered 20 of 20 nodes"), "{stdout}");
    assert!(stdout.contains("40 alive"), "{stdout}");
    assert!(stdout.contains("5 CREATED"), "{stdout}");
    assert!(stdout.contains("1 CREATED"), "{stdout}");
    let last = stdout.lines().last().unwrap_or_default();
    let f: Vec<&str> = last.split_whitespace().collect();
    assert_eq!(f.len(), 11, "last line: {last}");
    assert_eq!((f[0], f[1], f[2]), ("head_load:", "nodes", "20"), "last line: {last}");
    assert_eq!((f[3], f[4]), ("false_deaths", "0"), "last line: {last}");
    assert_eq!((f[5], f[7], f[9]), ("head_cpu_cores", "head_rss_mib", "harness_cpu_cores"));
    for v in [f[6], f[8], f[10]] {
        v.parse::<f64>().unwrap_or_else(|_| panic!("not a number: {v} in {last}"));
    }
}
