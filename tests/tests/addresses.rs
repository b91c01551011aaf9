//! What a node advertises and how the CLI finds the cluster on a machine that joined
//! it (NET-3), on two simulated hosts (`tpuray_tests::hosts`). Needs root.

use std::process::{Output, Stdio};

use tpuray_tests::hosts::{Host, Hosts};
use tpuray_tests::tpuray_bin;

fn tpuray(host: &Host, args: &[&str]) -> Output {
    host.command(tpuray_bin())
        .args(args)
        .stdin(Stdio::null())
        .output()
        .expect("run tpuray in the host")
}

fn ok(host: &Host, args: &[&str]) -> String {
    let out = tpuray(host, args);
    assert!(
        out.status.success(),
        "tpuray {args:?} in {} failed:\n{}\n{}",
        host.name,
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8_lossy(&out.stdout).into_owned()
}

/// Copies host0's cluster token into `to`'s home (0600).
fn copy_token(from: &Host, to: &Host) {
    use std::os::unix::fs::PermissionsExt;
    let token = std::fs::read(from.home.join(".tpuray/auth_token")).expect("head's token");
    std::fs::create_dir_all(to.home.join(".tpuray")).unwrap();
    let dst = to.home.join(".tpuray/auth_token");
    std::fs::write(&dst, token).unwrap();
    std::fs::set_permissions(&dst, std::fs::Permissions::from_mode(0o600)).unwrap();
}

#[test]
fn net3_a_node_joining_by_host_name_advertises_its_address_and_its_machine_finds_the_cluster() {
    let hosts = Hosts::new(2);
    let (h0, h1) = (hosts.host(0), hosts.host(1));
    let out = ok(h0, &["start", "--head", "--port", "6379", "--num-cpus", "1"]);
    assert!(out.contains(&format!("tpuray head started at {}:6379", h0.address)), "{out}");
    copy_token(h0, h1);
    // The head by the name /etc/hosts gives it, as a user on a real network would.
    let head = format!("{}:6379", h0.name);
    let out = ok(h1, &["start", "--address", &head, "--num-cpus", "1"]);
    assert!(out.contains(&format!("node address:   {}:", h1.address)), "{out}");
    // `tpuray list` and `status` on the joined machine need no --address.
    let nodes: serde_json::Value =
        serde_json::from_str(&ok(h1, &["list", "nodes", "--format", "json"])).unwrap();
    let mut addrs: Vec<String> = nodes
        .as_array()
        .unwrap()
        .iter()
        .map(|n| n["address"].as_str().unwrap().rsplit_once(':').unwrap().0.to_string())
        .collect();
    addrs.sort();
    assert_eq!(addrs, vec![h0.address.to_string(), h1.address.to_string()], "{nodes:#}");
    assert!(ok(h1, &["status"]).contains(&h1.address.to_string()));
}

#[test]
fn net3_a_node_ip_address_that_is_not_on_the_host_is_refused_by_name() {
    let hosts = Hosts::new(2);
    let (h0, h1) = (hosts.host(0), hosts.host(1));
    ok(h0, &["start", "--head", "--port", "6379", "--num-cpus", "1"]);
    copy_token(h0, h1);
    let head = format!("{}:6379", h0.address);
    // host0's address is on the bridge, but not on host1; 203.0.113.7 is on no host.
    for wrong in [h0.address.to_string(), "203.0.113.7".to_string()] {
        let out = tpuray(h1, &["start", "--address", &head, "--node-ip-address", &wrong]);
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(!out.status.success(), "a node at {wrong} was accepted on {}", h1.name);
        assert!(
            err.contains(&format!("--node-ip-address {wrong}: not an address of this host")),
            "{err}"
        );
    }
    // The head refuses one too, at once, instead of waiting for itself.
    let out =
        tpuray(h1, &["start", "--head", "--port", "6380", "--node-ip-address", "203.0.113.7"]);
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains("not an address of this host"));
    let nodes = ok(h0, &["list", "nodes", "--format", "json"]);
    assert_eq!(
        serde_json::from_str::<serde_json::Value>(&nodes).unwrap().as_array().unwrap().len(),
        1
    );
}
