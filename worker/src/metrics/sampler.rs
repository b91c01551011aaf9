//! The sampler of `/proc` (METRICS-5): host rates and process CPU read every
//! [`sample_interval`] on a blocking thread, so every scrape reads the newest sample.

use std::collections::HashMap;
use std::sync::Arc;
use std::time::{Duration, Instant};

use super::{AgentMetrics, Sample, lock};
use crate::agent::Agent;

/// How often the sampler reads `/proc` (`TPURAY_METRICS_SAMPLE_INTERVAL_MS`, default
/// 2000; Ray's reporter: 5 s).
pub fn sample_interval() -> Duration {
    crate::run::env_duration_ms("TPURAY_METRICS_SAMPLE_INTERVAL_MS", 2_000)
        .max(Duration::from_millis(100))
}

impl AgentMetrics {
    /// Reads `/proc` for the host and `pids` (METRICS-5). Blocking.
    pub fn sample(&self, pids: &[u32], disk_path: &std::path::Path) {
        let now = Instant::now();
        let host = tpuray_proto::metrics::host_stat();
        let mut sampler = lock(&self.sampler);
        let (host, rates) = sampler.host(now, host);
        let mut procs = HashMap::new();
        for &pid in pids {
            if let Some(st) = tpuray_proto::metrics::proc_stat(pid) {
                let cpu = sampler.process(now, pid, &st);
                procs.insert(pid, (st, cpu));
            }
        }
        sampler.retain_processes(&procs.keys().copied().collect());
        drop(sampler);
        *lock(&self.sample) =
            Sample { host, rates, procs, disk: tpuray_proto::metrics::disk_usage(disk_path) };
    }
}

/// Runs the sampler until the process exits (METRICS-5).
pub fn spawn_sampler(agent: Arc<Agent>) {
    tokio::spawn(async move {
        let every = sample_interval();
        loop {
            let a = Arc::clone(&agent);
            let _ = tokio::task::spawn_blocking(move || {
                let mut pids: Vec<u32> = a.metrics_view().workers.iter().map(|w| w.pid).collect();
                pids.push(std::process::id());
                a.metrics.sample(&pids, &a.config.session_dir);
            })
            .await;
            tokio::time::sleep(every).await;
        }
    });
}
