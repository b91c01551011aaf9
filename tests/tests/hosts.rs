//! Tests of the multi-host harness itself (`tpuray_tests::hosts`): each simulated
//! host's own address, `/dev/shm`, `/tmp`, `HOME` and hostname; reaching hosts by
//! name through the bridge; every fault; and that the root namespace is left as it
//! was with nothing left behind. Needs root.

use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use tpuray_tests::hosts::{Host, Hosts, NO_NETEM, nft_status, output_within, proc_state};

const TIMEOUT: Duration = Duration::from_secs(30);

/// `sh -c SCRIPT` in `host`; its stdout, panicking when it fails.
fn sh(host: &Host, script: &str) -> String {
    let mut c = host.command("sh");
    c.args(["-c", script]);
    let out = output_within(c, TIMEOUT);
    assert!(
        out.status.success(),
        "{script:?} in {} failed: {}",
        host.name,
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8_lossy(&out.stdout).into_owned()
}

fn wait_until(what: &str, timeout: Duration, mut cond: impl FnMut() -> bool) {
    let deadline = Instant::now() + timeout;
    while !cond() {
        assert!(Instant::now() < deadline, "timed out after {timeout:?}: {what}");
        std::thread::sleep(Duration::from_millis(20));
    }
}

const SERVER: &str = r#"
import socket, sys
s = socket.socket()
s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
s.bind(("0.0.0.0", int(sys.argv[1])))
s.listen(64)
print("LISTENING", flush=True)
while True:
    c, a = s.accept()
    c.sendall(("hi from %s to %s\n" % (socket.gethostname(), a[0])).encode())
    c.close()
"#;

const CLIENT: &str = r#"
import socket, sys
try:
    c = socket.create_connection((sys.argv[1], int(sys.argv[2])), timeout=float(sys.argv[3]))
    c.settimeout(float(sys.argv[3]))
    print(c.makefile().readline().strip())
except Exception as e:
    print("FAIL", e)
    sys.exit(1)
"#;

/// Starts the TCP greeting server on `port` in `host`, its output in the host's
/// `/tmp/server.out`, and waits until it listens.
fn start_server(host: &Host, port: u16) -> std::process::Child {
    let log = std::fs::File::create(host.tmp.join("server.out")).expect("server log");
    let child = host
        .command("python3")
        .args(["-u", "-c", SERVER, &port.to_string()])
        .stdin(Stdio::null())
        .stdout(log.try_clone().unwrap())
        .stderr(log)
        .spawn()
        .expect("spawn server");
    let out = host.tmp.join("server.out");
    wait_until("server listening", TIMEOUT, || {
        std::fs::read_to_string(&out).is_ok_and(|s| s.contains("LISTENING"))
    });
    child
}

/// One TCP connection from `from` to `to:port` with a `timeout_s` timeout: the greeting,
/// or `None` when it failed.
fn probe(from: &Host, to: &str, port: u16, timeout_s: f64) -> Option<String> {
    let mut c = from.command("python3");
    c.args(["-c", CLIENT, to, &port.to_string(), &timeout_s.to_string()]);
    let out = output_within(c, TIMEOUT);
    out.status.success().then(|| String::from_utf8_lossy(&out.stdout).trim().to_string())
}

fn kill_wait(mut c: std::process::Child) {
    let _ = c.kill();
    let _ = c.wait();
}

#[test]
fn hosts_have_their_own_address_shm_tmp_home_and_hostname() {
    let hosts = Hosts::new(3);
    let etc = std::fs::read_to_string(hosts.hosts_file()).unwrap();
    for (i, h) in hosts.hosts().iter().enumerate() {
        assert_eq!(h.name, format!("host{i}"));
        assert_eq!(h.address.to_string(), format!("198.18.0.{}", i + 1));
        assert!(etc.contains(&format!("{}\t{}", h.address, h.name)), "{etc}");
        let script = format!(
            "hostname; ip -o -4 addr show dev eth0; ip route; echo \"HOME=$HOME\"; \
             echo {n} > /dev/shm/mark-{n}; ls /dev/shm; echo {n} > /tmp/mark; cat /etc/hosts; \
             ip -o link show lo",
            n = h.name
        );
        let out = sh(h, &script);
        let lines: Vec<&str> = out.lines().collect();
        assert_eq!(lines[0], h.name, "{out}");
        assert!(lines[1].contains(&format!("inet {}/15", h.address)), "{out}");
        assert!(out.contains("default dev eth0"), "{out}");
        assert!(out.contains(&format!("HOME={}", h.home.display())), "{out}");
        assert!(out.contains(&format!("mark-{}\n", h.name)), "{out}");
        assert!(etc.lines().all(|l| out.contains(l)), "{out}");
        assert!(out.contains("localhost"), "{out}");
        assert!(out.contains("state UNKNOWN") || out.contains(",UP"), "lo not up: {out}");
        assert_eq!(std::fs::read_to_string(h.tmp.join("mark")).unwrap().trim(), h.name);
        assert!(h.home.is_dir() && !h.home.starts_with("/tmp"));
    }
    // Each /dev/shm is its own: only this host's mark is there.
    for h in hosts.hosts() {
        let shm = sh(h, "ls /dev/shm");
        assert_eq!(shm.trim(), format!("mark-{}", h.name), "{}", h.name);
    }
    // The root namespace's /dev/shm and /tmp saw none of it.
    assert!(!std::path::Path::new("/dev/shm/mark-host0").exists());
    let root_host = String::from_utf8(Command::new("hostname").output().unwrap().stdout).unwrap();
    assert_ne!(root_host.trim(), "host0");
    // The shared checkout is visible from a host.
    let ls = sh(hosts.host(0), "ls Cargo.toml");
    assert_eq!(ls.trim(), "Cargo.toml");
}

#[test]
fn hosts_reach_each_other_by_name_through_the_bridge() {
    let hosts = Hosts::new(3);
    let server = start_server(hosts.host(0), 7000);
    for h in &hosts.hosts()[1..] {
        let got = probe(h, "host0", 7000, 5.0);
        assert_eq!(got.as_deref(), Some(format!("hi from host0 to {}", h.address).as_str()));
    }
    // The root namespace cannot reach it.
    let out = output_within(
        {
            let mut c = Command::new("python3");
            c.args(["-c", CLIENT, "198.18.0.1", "7000", "1"]);
            c
        },
        TIMEOUT,
    );
    assert!(!out.status.success(), "the root namespace reached host0");
    kill_wait(server);
}

#[test]
fn partition_cuts_and_heal_restores_the_link() {
    let hosts = Hosts::new(2);
    let (h0, h1) = (hosts.host(0), hosts.host(1));
    let server = start_server(h0, 7001);
    assert!(probe(h1, "host0", 7001, 5.0).is_some());
    h0.partition().unwrap();
    assert_eq!(probe(h1, "host0", 7001, 1.0), None, "reached a partitioned host");
    assert_eq!(probe(h0, "host1", 7001, 1.0), None, "a partitioned host reached out");
    // Its processes keep running.
    assert_eq!(proc_state(server.id()).map(|s| s != 'Z'), Some(true));
    h0.heal().unwrap();
    wait_until("link healed", TIMEOUT, || probe(h1, "host0", 7001, 1.0).is_some());
    h0.partition().unwrap();
    h0.clear_faults().unwrap();
    wait_until("link cleared", TIMEOUT, || probe(h1, "host0", 7001, 1.0).is_some());
    kill_wait(server);
}

#[test]
fn crash_and_freeze_act_on_every_process_of_the_host() {
    let hosts = Hosts::new(2);
    let (h0, h1) = (hosts.host(0), hosts.host(1));
    let mut children = Vec::new();
    for _ in 0..2 {
        children.push(h0.command("sleep").arg("1000").stdin(Stdio::null()).spawn().unwrap());
    }
    // Grandchildren too.
    children.push(h0.command("sh").args(["-c", "sleep 1000 & sleep 1000 & wait"]).spawn().unwrap());
    let other = h1.command("sleep").arg("1000").spawn().unwrap();
    wait_until("5 processes in host0", TIMEOUT, || h0.processes().len() == 5);
    wait_until("1 process in host1", TIMEOUT, || h1.processes() == vec![other.id()]);

    h0.freeze().unwrap();
    for p in h0.processes() {
        assert_eq!(proc_state(p), Some('T'), "pid {p} not stopped");
    }
    assert_ne!(proc_state(other.id()), Some('T'), "froze another host's process");
    assert_ne!(proc_state(h0.pid), Some('T'), "froze the holder");
    h0.thaw().unwrap();
    wait_until("thawed", TIMEOUT, || h0.processes().iter().all(|&p| proc_state(p) != Some('T')));

    h0.freeze().unwrap();
    h0.crash().unwrap();
    assert!(h0.processes().is_empty());
    for mut c in children {
        use std::os::unix::process::ExitStatusExt;
        assert_eq!(c.wait().unwrap().signal(), Some(libc::SIGKILL));
    }
    assert!(tpuray_tests::pid_alive(other.id()), "crashed another host's process");
    // The host is still usable after a crash.
    assert_eq!(sh(h0, "hostname").trim(), "host0");
    kill_wait(other);
}

/// UDP datagrams from `from` to `to` that arrive, of `n`.
fn udp_delivered(from: &Host, to: &Host, port: u16, n: usize) -> usize {
    let recv = format!(
        "import socket\ns=socket.socket(socket.AF_INET,socket.SOCK_DGRAM)\ns.bind(('0.0.0.0',{port}))\n\
         s.settimeout(1.5)\nprint('READY',flush=True)\nk=0\ntry:\n    while True:\n        s.recv(100); k+=1\n\
         except socket.timeout:\n    pass\nprint('GOT',k,flush=True)\n"
    );
    let log = to.tmp.join(format!("udp-{port}.out"));
    let f = std::fs::File::create(&log).unwrap();
    let mut r = to.command("python3");
    r.args(["-u", "-c", &recv]).stdout(f.try_clone().unwrap()).stderr(f);
    let mut rchild = r.spawn().unwrap();
    wait_until("udp receiver ready", TIMEOUT, || {
        std::fs::read_to_string(&log).is_ok_and(|s| s.contains("READY"))
    });
    let send = format!(
        "import socket,time\ns=socket.socket(socket.AF_INET,socket.SOCK_DGRAM)\n\
         for i in range({n}):\n    try: s.sendto(b'x',('{}',{port}))\n    except PermissionError: pass\n    time.sleep(0.001)\n",
        to.name
    );
    let mut c = from.command("python3");
    c.args(["-c", &send]);
    assert!(output_within(c, TIMEOUT).status.success());
    wait_until("udp receiver done", TIMEOUT, || rchild.try_wait().unwrap().is_some());
    let text = std::fs::read_to_string(&log).unwrap();
    let got = text.lines().find_map(|l| l.strip_prefix("GOT ")).unwrap_or_else(|| panic!("{text}"));
    got.trim().parse().unwrap()
}

#[test]
fn loss_drops_packets() {
    // scripts/test.sh installs nftables; without it this fails rather than skips.
    if let Err(e) = nft_status() {
        panic!("packet loss needs nftables: {e}");
    }
    let hosts = Hosts::new(2);
    let (h0, h1) = (hosts.host(0), hosts.host(1));
    // Warm up ARP so the first datagrams are not lost to neighbour resolution.
    let _ = sh(
        h1,
        "python3 -c \"import socket;socket.socket(socket.AF_INET,socket.SOCK_DGRAM).sendto(b'x',('host0',9))\"",
    );
    let clean = udp_delivered(h1, h0, 7100, 300);
    assert!(clean >= 290, "{clean}/300 without loss");
    h1.loss(50).unwrap();
    let lossy = udp_delivered(h1, h0, 7101, 300);
    assert!((75..=225).contains(&lossy), "{lossy}/300 with 50% loss");
    h1.loss(100).unwrap();
    assert_eq!(udp_delivered(h1, h0, 7102, 50), 0);
    h1.clear_faults().unwrap();
    let back = udp_delivered(h1, h0, 7103, 300);
    assert!(back >= 290, "{back}/300 after clear_faults");
    assert!(h1.loss(101).is_err());
}

#[test]
fn latency_without_netem_is_refused_by_name() {
    let hosts = Hosts::new(2);
    let (h0, h1) = (hosts.host(0), hosts.host(1));
    match h0.latency(200) {
        Err(e) => assert_eq!(e.to_string(), NO_NETEM),
        Ok(()) => {
            // A kernel with netem: a connection's round trips take the delay.
            let server = start_server(h1, 7200);
            let t = Instant::now();
            assert!(probe(h0, "host1", 7200, 10.0).is_some());
            assert!(t.elapsed() >= Duration::from_millis(400), "{:?}", t.elapsed());
            h0.clear_faults().unwrap();
            kill_wait(server);
        }
    }
}

fn root_state() -> String {
    let mut s = String::new();
    for args in [&["-o", "link"][..], &["-o", "addr"], &["route"], &["-6", "route"]] {
        let out = Command::new("ip").args(args).output().unwrap();
        s += &String::from_utf8_lossy(&out.stdout);
    }
    s += &std::fs::read_to_string("/proc/self/mountinfo").unwrap();
    s += &String::from_utf8(Command::new("hostname").output().unwrap().stdout).unwrap();
    s += &std::fs::read_to_string("/etc/hosts").unwrap();
    s
}

#[test]
fn the_root_namespace_is_unchanged_and_everything_is_removed() {
    let before = root_state();
    let t = Instant::now();
    let hosts = Hosts::new(4);
    let built = t.elapsed();
    let namespaces = hosts.namespaces();
    assert_eq!(namespaces.len(), 5);
    let workdir = hosts.workdir().to_path_buf();
    assert!(workdir.is_dir() && !workdir.starts_with("/tmp"));
    // Processes the test left running, one of them frozen, one partitioned host.
    let mut kids = Vec::new();
    for h in hosts.hosts() {
        kids.push(h.command("sleep").arg("1000").spawn().unwrap());
        sh(h, "echo log line > /tmp/x.log");
    }
    hosts.host(1).freeze().unwrap();
    hosts.host(2).partition().unwrap();
    if nft_status().is_ok() {
        hosts.host(3).loss(30).unwrap();
    }
    assert_eq!(root_state(), before, "the root namespace changed while the hosts were up");
    let t = Instant::now();
    drop(hosts);
    let torn = t.elapsed();
    eprintln!("4 hosts: built in {built:?}, torn down in {torn:?}");
    assert_eq!(root_state(), before, "the root namespace changed");
    for ns in &namespaces {
        assert_eq!(
            tpuray_tests::hosts::pids_in_net_ns(ns),
            Vec::<u32>::new(),
            "processes left in {ns}"
        );
    }
    assert!(!workdir.exists(), "{} left behind", workdir.display());
    for mut k in kids {
        k.wait().unwrap();
    }
}
