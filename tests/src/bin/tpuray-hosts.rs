//! `tpuray-hosts --hosts N [--prefix host]`: simulated hosts for pytest
//! (`python-sdk/tests/hosts.py`), made by `tpuray_tests::hosts::Hosts`. Needs root.
//!
//! Prints one JSON line on stdout, `{"hosts":[{"name","address","pid","home","tmp",
//! "nsenter":["nsenter","-t",PID,"--net","--mount","--uts","--"]}],"workdir"}`,
//! then reads commands on stdin, one a line: `partition NAME`, `heal NAME`,
//! `loss NAME PCT`, `latency NAME MS`, `clear NAME`, `crash NAME`, `freeze NAME`,
//! `thaw NAME`, each answered by `ok` or `err MESSAGE` on a line of its own. On
//! stdin EOF, `quit`, SIGTERM, SIGINT or SIGHUP it removes every host and exits 0.

use std::io::{BufRead, Write};
use std::sync::{Arc, Mutex};

use tpuray_tests::hosts::Hosts;

fn usage() -> ! {
    eprintln!("usage: tpuray-hosts --hosts N [--prefix PREFIX]");
    std::process::exit(2)
}

/// Blocks the termination signals in this thread (and so in threads made after).
fn block_signals() -> libc::sigset_t {
    // SAFETY: plain libc calls on a sigset_t we own.
    unsafe {
        let mut set: libc::sigset_t = std::mem::zeroed();
        libc::sigemptyset(&mut set);
        for s in [libc::SIGTERM, libc::SIGINT, libc::SIGHUP] {
            libc::sigaddset(&mut set, s);
        }
        libc::pthread_sigmask(libc::SIG_BLOCK, &set, std::ptr::null_mut());
        set
    }
}

fn apply(hosts: &Hosts, line: &str) -> anyhow::Result<()> {
    let words: Vec<&str> = line.split_whitespace().collect();
    let (cmd, name) = match words.as_slice() {
        [cmd, name, ..] => (*cmd, *name),
        _ => anyhow::bail!("expected `COMMAND NAME [ARG]`, got {line:?}"),
    };
    let host = hosts.by_name(name).ok_or_else(|| anyhow::anyhow!("no host named {name:?}"))?;
    let arg = || -> anyhow::Result<u32> {
        let a = words.get(2).ok_or_else(|| anyhow::anyhow!("{cmd} needs a number"))?;
        a.parse().map_err(|_| anyhow::anyhow!("{cmd}: not a number: {a:?}"))
    };
    match (cmd, words.len()) {
        ("partition", 2) => host.partition(),
        ("heal", 2) => host.heal(),
        ("loss", 3) => host.loss(arg()?),
        ("latency", 3) => host.latency(arg()?),
        ("clear", 2) => host.clear_faults(),
        ("crash", 2) => host.crash(),
        ("freeze", 2) => host.freeze(),
        ("thaw", 2) => host.thaw(),
        _ => anyhow::bail!("unknown command {line:?}"),
    }
}

fn main() {
    let mut args = std::env::args().skip(1);
    let (mut n, mut prefix) = (None, "host".to_string());
    while let Some(a) = args.next() {
        match a.as_str() {
            "--hosts" => n = args.next().and_then(|v| v.parse::<usize>().ok()),
            "--prefix" => prefix = args.next().unwrap_or_else(|| usage()),
            _ => usage(),
        }
    }
    let Some(n) = n else { usage() };

    let set = block_signals();
    let hosts = Hosts::with_prefix(n, &prefix);
    let info = serde_json::json!({
        "hosts": hosts.hosts().iter().map(|h| serde_json::json!({
            "name": h.name,
            "address": h.address.to_string(),
            "pid": h.pid,
            "home": h.home,
            "tmp": h.tmp,
            "nsenter": h.nsenter_prefix(),
        })).collect::<Vec<_>>(),
        "workdir": hosts.workdir(),
    });
    let shared = Arc::new(Mutex::new(Some(hosts)));
    {
        let shared = shared.clone();
        std::thread::spawn(move || {
            let mut sig = 0;
            // SAFETY: sigwait on the set blocked above.
            unsafe { libc::sigwait(&set, &mut sig) };
            drop(shared.lock().unwrap_or_else(|p| p.into_inner()).take());
            std::process::exit(0);
        });
    }
    let mut out = std::io::stdout().lock();
    let _ = writeln!(out, "{info}");
    let _ = out.flush();
    for line in std::io::stdin().lock().lines() {
        let Ok(line) = line else { break };
        let line = line.trim();
        if line.is_empty() {
            continue;
        }
        if line == "quit" {
            break;
        }
        let guard = shared.lock().unwrap_or_else(|p| p.into_inner());
        let Some(hosts) = guard.as_ref() else { break };
        let answer = match apply(hosts, line) {
            Ok(()) => "ok".to_string(),
            Err(e) => format!("err {}", format!("{e:#}").replace('\n', " ")),
        };
        drop(guard);
        let _ = writeln!(out, "{answer}");
        let _ = out.flush();
    }
    drop(shared.lock().unwrap_or_else(|p| p.into_inner()).take());
}
