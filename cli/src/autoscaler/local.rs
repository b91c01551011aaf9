//! The `local` provider: each host of an instance is a `tpuray start --address HEAD
//! --block` process on the head's machine (the same binary), a slice host with the
//! simulated TPU environment of TPU.md (`TPU_ACCELERATOR_TYPE`, `TPU_NAME` = the instance,
//! `TPU_WORKER_ID`, `TPU_TOPOLOGY`, and `--resources '{"TPU": chips}'`). For tests, and for
//! trying the autoscaler on a laptop.
//!
//! AUTOSCALE-8: nothing it starts outlives the head. Every host is a child of the
//! autoscaler's own thread with `PR_SET_PDEATHSIG=SIGTERM`, so a head that dies (even by
//! SIGKILL) has its `start --block` processes told to stop their agents; each host is a
//! process group of its own (the `start` process and its agent), signalled as a group, so
//! a `start` stopped while it still waits for its agent to register leaves no agent
//! behind; a head that stops calls [`Provider::shutdown`], which stops them all and waits
//! for them.
//! Blocking: every call spawns, signals or reaps processes; run it on the autoscaler's
//! thread, never on an async executor.

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use anyhow::{Context, Result};

use super::config::NodeType;
use super::decide::InstanceView;
use super::provider::Provider;

/// How long a stopped host's `start --block` gets to stop its agent before SIGKILL: the
/// agent's own 10 s stop margin (the provider starts agents with a 0 s drain) and more.
const STOP_WAIT: Duration = Duration::from_secs(30);

/// Signals the process group a host's `start` process leads (it and its agent).
fn signal_group(pid: u32, sig: i32) {
    if let Ok(pid) = i32::try_from(pid) {
        // SAFETY: kill(2) with a negative pid signals that process group; no memory is
        // touched.
        unsafe {
            libc::kill(-pid, sig);
        }
    }
}

struct Host {
    worker_id: u32,
    child: Child,
}

struct Instance {
    node_type: String,
    launched_ms: u64,
    hosts: Vec<Host>,
}

/// Node agents as local processes.
pub struct LocalProvider {
    head_address: String,
    node_ip: String,
    session_dir: PathBuf,
    command: Vec<String>,
    instances: BTreeMap<String, Instance>,
    stopping: Vec<(Child, Instant)>,
}

impl LocalProvider {
    /// `command` is how this binary is started (`procs::self_command`); hosts join
    /// `head_address` advertising `node_ip`, with their session folders and logs under
    /// `session_dir`.
    pub fn new(
        head_address: &str,
        node_ip: &str,
        session_dir: PathBuf,
        command: Vec<String>,
    ) -> Self {
        Self {
            head_address: head_address.to_string(),
            node_ip: node_ip.to_string(),
            session_dir,
            command,
            instances: BTreeMap::new(),
            stopping: Vec::new(),
        }
    }

    /// The `tpuray start` arguments and environment of host `worker_id` of `instance`.
    pub fn host_command(
        &self,
        t: &NodeType,
        instance: &str,
        worker_id: u32,
    ) -> (Vec<String>, Vec<(String, String)>) {
        let temp = self.session_dir.join("autoscaler").join(format!("{instance}-{worker_id}"));
        let mut args: Vec<String> = vec![
            "start".into(),
            "--address".into(),
            self.head_address.clone(),
            "--block".into(),
            "--node-ip-address".into(),
            self.node_ip.clone(),
            "--temp-dir".into(),
            temp.display().to_string(),
            "--drain-grace-period".into(),
            "0".into(),
        ];
        let mut custom = serde_json::Map::new();
        let cpus = t.resources.get("CPU").to_f64();
        args.extend(["--num-cpus".into(), cpus.to_string()]);
        args.extend(["--num-gpus".into(), t.resources.get("GPU").to_f64().to_string()]);
        for (k, v) in t.resources.iter() {
            match k {
                "CPU" | "GPU" => {}
                "memory" => args.extend(["--memory".into(), (v.to_f64() as u64).to_string()]),
                "object_store_memory" => {
                    args.extend(["--object-store-memory".into(), (v.to_f64() as u64).to_string()])
                }
                _ => {
                    custom.insert(k.to_string(), serde_json::json!(v.to_f64()));
                }
            }
        }
        let mut env = Vec::new();
        if let Some(s) = &t.slice {
            custom.insert("TPU".into(), serde_json::json!(s.chips_per_host()));
            env.push(("TPU_ACCELERATOR_TYPE".to_string(), s.accelerator_type.to_string()));
            env.push(("TPU_NAME".to_string(), instance.to_string()));
            env.push(("TPU_WORKER_ID".to_string(), worker_id.to_string()));
            env.push(("TPU_TOPOLOGY".to_string(), s.topology.to_string()));
        }
        if !custom.is_empty() {
            args.extend(["--resources".into(), serde_json::Value::Object(custom).to_string()]);
        }
        args.extend(t.labels_arg(instance));
        (args, env)
    }

    fn reap_stopping(&mut self) {
        self.stopping.retain_mut(|(c, since)| {
            if matches!(c.try_wait(), Ok(Some(_))) {
                return false;
            }
            if since.elapsed() > STOP_WAIT {
                signal_group(c.id(), libc::SIGKILL);
                let _ = c.wait();
                return false;
            }
            true
        });
    }
}

impl Provider for LocalProvider {
    fn launch(&mut self, t: &NodeType, instance: &str, now_ms: u64) -> Result<()> {
        let logs = self.session_dir.join("logs");
        std::fs::create_dir_all(&logs).context("cannot make the logs folder")?;
        let mut hosts = Vec::new();
        for w in 0..t.hosts() {
            let (args, env) = self.host_command(t, instance, w);
            let name = format!("autoscaler-{instance}-{w}");
            let out = std::fs::File::create(logs.join(format!("{name}.out")))?;
            let err = std::fs::File::create(logs.join(format!("{name}.err")))?;
            let mut cmd = Command::new(&self.command[0]);
            cmd.args(&self.command[1..]).args(&args).stdin(Stdio::null()).stdout(out).stderr(err);
            // Hosts start from the head's environment, without a slice of their own.
            for k in [
                "TPU_ACCELERATOR_TYPE",
                "TPU_NAME",
                "TPU_WORKER_ID",
                "TPU_TOPOLOGY",
                "TPU_WORKER_HOSTNAMES",
            ] {
                cmd.env_remove(k);
            }
            for (k, v) in &env {
                cmd.env(k, v);
            }
            use std::os::unix::process::CommandExt;
            // SAFETY: prctl is async-signal-safe. AUTOSCALE-8: the host is told to stop
            // when the thread that started it (the autoscaler's, which lives as long as
            // the head) goes.
            unsafe {
                cmd.pre_exec(|| {
                    libc::setpgid(0, 0);
                    libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGTERM as libc::c_ulong, 0, 0, 0);
                    Ok(())
                });
            }
            match cmd.spawn() {
                Ok(child) => hosts.push(Host { worker_id: w, child }),
                Err(e) => {
                    for h in hosts {
                        signal_group(h.child.id(), libc::SIGTERM);
                        self.stopping.push((h.child, Instant::now()));
                    }
                    return Err(e).context(format!("cannot start host {w} of {instance}"));
                }
            }
        }
        self.instances.insert(
            instance.to_string(),
            Instance { node_type: t.name.clone(), launched_ms: now_ms, hosts },
        );
        Ok(())
    }

    fn terminate(&mut self, instance: &str) -> Result<()> {
        if let Some(inst) = self.instances.remove(instance) {
            for mut h in inst.hosts {
                // The group, even when the `start` process already exited (its agent may not
                // have).
                signal_group(h.child.id(), libc::SIGTERM);
                if matches!(h.child.try_wait(), Ok(None)) {
                    self.stopping.push((h.child, Instant::now()));
                }
            }
        }
        self.reap_stopping();
        Ok(())
    }

    fn instances(&mut self) -> Result<Vec<InstanceView>> {
        self.reap_stopping();
        let mut out = Vec::new();
        for (id, inst) in &mut self.instances {
            let mut lost = None;
            for h in &mut inst.hosts {
                if let Ok(Some(status)) = h.child.try_wait() {
                    lost = Some(format!(
                        "host {}'s node agent process exited ({status})",
                        h.worker_id
                    ));
                    break;
                }
            }
            out.push(InstanceView {
                id: id.clone(),
                node_type: inst.node_type.clone(),
                launched_ms: inst.launched_ms,
                lost,
            });
        }
        Ok(out)
    }

    fn shutdown(&mut self) {
        let ids: Vec<String> = self.instances.keys().cloned().collect();
        for id in ids {
            let _ = self.terminate(&id);
        }
        while !self.stopping.is_empty() {
            self.reap_stopping();
            std::thread::sleep(Duration::from_millis(50));
        }
    }
}

#[cfg(test)]
mod tests {
    use super::super::config::parse;
    use super::*;

    #[test]
    fn a_slice_host_is_started_with_the_tpu_md_environment_and_its_labels() {
        let cfg = parse(
            "provider: {type: local}\navailable_node_types:\n  s: {resources: {CPU: 1, special: 2}, labels: {zone: a}, max_workers: 1, tpu: {accelerator_type: v6e-16}}\n",
        )
        .unwrap();
        let p =
            LocalProvider::new("127.0.0.1:1", "127.0.0.1", "/tmp/x".into(), vec!["tpuray".into()]);
        let (args, env) = p.host_command(&cfg.node_types["s"], "s-1", 3);
        let flag = |f: &str| args[args.iter().position(|a| a == f).unwrap() + 1].clone();
        assert_eq!(flag("--address"), "127.0.0.1:1");
        assert_eq!(flag("--num-cpus"), "1");
        let res: serde_json::Value = serde_json::from_str(&flag("--resources")).unwrap();
        assert_eq!(res, serde_json::json!({"TPU": 4, "special": 2.0}));
        assert_eq!(
            flag("--labels"),
            "zone=a,tpuray.io/autoscaler-node-type=s,tpuray.io/autoscaler-instance=s-1"
        );
        let env: BTreeMap<String, String> = env.into_iter().collect();
        assert_eq!(env["TPU_ACCELERATOR_TYPE"], "v6e-16");
        assert_eq!(env["TPU_NAME"], "s-1");
        assert_eq!(env["TPU_WORKER_ID"], "3");
        assert_eq!(env["TPU_TOPOLOGY"], "4x4");
        assert!(args.contains(&"--block".to_string()));
    }
}
