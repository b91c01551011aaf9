//! `tpuray start --head --autoscaling-config FILE` refuses a bad file before anything
//! starts, naming what is wrong. The scaling itself (whole slices up and down, max_workers,
//! infeasible demand, a lost host, `request_resources`) is checked end to end with the
//! local provider by `python-sdk/tests/test_autoscaler.py` (the API is Python's), and
//! decision by decision by the unit tests of `cli/src/autoscaler/decide.rs`.

use tpuray_tests::*;

fn start_head(c: &Cluster, config: &std::path::Path) -> std::process::Output {
    let port = c.head_addr().rsplit_once(':').expect("host:port").1.to_string();
    let temp = c.dir().join("head").display().to_string();
    let config = config.display().to_string();
    c.cli(&[
        "start",
        "--head",
        "--port",
        &port,
        "--temp-dir",
        &temp,
        "--node-ip-address",
        "127.0.0.1",
        "--autoscaling-config",
        &config,
    ])
}

#[test]
fn a_bad_autoscaling_config_is_refused_by_name_and_starts_nothing() {
    let c = Cluster::new();
    let cases = [
        (
            "provider: {type: local}\nidle_timeout_minute: 1\navailable_node_types: {cpu: {max_workers: 1}}\n",
            "idle_timeout_minute",
        ),
        (
            "provider: {type: local}\navailable_node_types:\n  s: {max_workers: 1, tpu: {accelerator_type: v6e-16, topology: 8x8}}\n",
            "available_node_types.s.tpu.topology",
        ),
        ("provider: {type: gce}\navailable_node_types: {cpu: {max_workers: 1}}\n", "gce"),
    ];
    for (i, (text, needle)) in cases.iter().enumerate() {
        let path = c.dir().join(format!("bad{i}.yaml"));
        std::fs::write(&path, text).expect("write the config");
        let out = start_head(&c, &path);
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(!out.status.success(), "{text:?} was accepted");
        assert!(err.contains(needle), "{needle:?} not in {err}");
        assert!(err.contains(&path.display().to_string()), "names the file: {err}");
    }
    assert!(c.registry().iter().all(|e| !e.is_alive()), "nothing started");
    // Only a head runs an autoscaler.
    let path = c.dir().join("bad0.yaml");
    let out = c.cli(&[
        "start",
        "--address",
        "127.0.0.1:1",
        "--autoscaling-config",
        &path.display().to_string(),
    ]);
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains("--head"), "{out:?}");
}
