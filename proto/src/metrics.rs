//! Prometheus exposition shared by the head's and the node agents' `/metrics`
//! (METRICS-1..6 in ARCHITECTURE.md): metric families built from current state at
//! scrape time and encoded in the Prometheus text format 0.0.4 (the format Ray's
//! endpoints serve) with the `prometheus` crate, the memory of series already exported
//! that makes a count which falls to zero read 0 instead of vanishing (METRICS-2), and
//! readers of `/proc` for process and host statistics.
//!
//! Nothing here needs a runtime; the `/proc` readers do small blocking reads (call them
//! off the threads that answer RPCs when the caller has such threads).
//!
//! The encoder is tikv's `prometheus` crate without protobuf. Names and labels are Ray's
//! (`ray_tasks{State,Name,IsRetry,Source,JobId}`, `ray_actors`, `ray_resources`,
//! `ray_object_store_memory`, `ray_node_*`, `ray_component_*`, `ray_placement_groups`,
//! user metrics as `ray_<name>`), and `tpuray_*` for what Ray lacks (TPU slices, chips,
//! gangs, Raft, workers by state); every series carries `SessionName` (`session_<cluster
//! id>`, as `/api/version`), `Version` and `NodeAddress`. Nothing is kept as counters
//! that could go stale.

use std::collections::{BTreeMap, HashMap};
use std::path::Path;
use std::time::Instant;

use prometheus::proto::{
    Bucket, Counter, Gauge, Histogram, LabelPair, Metric, MetricFamily, MetricType,
};

/// The content type of [`Exposition::encode`]'s output.
pub const CONTENT_TYPE: &str = prometheus::TEXT_FORMAT;

/// Label pairs of one series, in the order they are written.
pub type Labels = Vec<(String, String)>;

/// Labels from `(&str, &str)` pairs.
pub fn labels(pairs: &[(&str, &str)]) -> Labels {
    pairs.iter().map(|(k, v)| (k.to_string(), v.to_string())).collect()
}

/// The metric families of one scrape. Every series gets the base labels (Ray's global
/// tags: `SessionName`, `Version`, ...) after its own, unless it has a label of that
/// name itself.
#[derive(Debug, Default)]
pub struct Exposition {
    base: Labels,
    families: Vec<MetricFamily>,
    index: HashMap<String, usize>,
}

impl Exposition {
    /// An empty scrape whose series all carry `base`.
    pub fn new(base: Labels) -> Self {
        Self { base, ..Default::default() }
    }

    fn family(&mut self, name: &str, help: &str, kind: MetricType) -> &mut MetricFamily {
        let i = match self.index.get(name) {
            Some(&i) => i,
            None => {
                let mut f = MetricFamily::default();
                f.set_name(name.to_string());
                f.set_help(if help.is_empty() { name.to_string() } else { help.to_string() });
                f.set_field_type(kind);
                self.families.push(f);
                self.index.insert(name.to_string(), self.families.len() - 1);
                self.families.len() - 1
            }
        };
        &mut self.families[i]
    }

    fn metric(&self, own: &[(String, String)]) -> Metric {
        let mut pairs: Vec<LabelPair> = Vec::with_capacity(own.len() + self.base.len());
        let mut push = |k: &str, v: &str| {
            let mut p = LabelPair::default();
            p.set_name(k.to_string());
            p.set_value(v.to_string());
            pairs.push(p);
        };
        for (k, v) in own {
            push(k, v);
        }
        for (k, v) in &self.base {
            if !own.iter().any(|(o, _)| o == k) {
                push(k, v);
            }
        }
        Metric::from_label(pairs)
    }

    /// Declares a gauge family, so that it is listed even while it has no series.
    pub fn declare_gauge(&mut self, name: &str, help: &str) {
        self.family(name, help, MetricType::GAUGE);
    }

    /// One gauge sample.
    pub fn gauge(&mut self, name: &str, help: &str, own: &[(String, String)], value: f64) {
        let mut m = self.metric(own);
        let mut g = Gauge::default();
        g.set_value(value);
        m.set_gauge(g);
        self.family(name, help, MetricType::GAUGE).mut_metric().push(m);
    }

    /// One counter sample (`name` ends in `_total`, the text format's convention).
    pub fn counter(&mut self, name: &str, help: &str, own: &[(String, String)], value: f64) {
        let mut m = self.metric(own);
        let mut c = Counter::default();
        c.set_value(value);
        m.set_counter(c);
        self.family(name, help, MetricType::COUNTER).mut_metric().push(m);
    }

    /// One histogram: `buckets` are (upper bound, observations at or below it), ascending;
    /// the `+Inf` bucket is written from `count`.
    #[allow(clippy::too_many_arguments)]
    pub fn histogram(
        &mut self,
        name: &str,
        help: &str,
        own: &[(String, String)],
        buckets: &[(f64, u64)],
        sum: f64,
        count: u64,
    ) {
        let mut m = self.metric(own);
        let mut h = Histogram::default();
        h.set_bucket(
            buckets
                .iter()
                .map(|(le, n)| {
                    let mut b = Bucket::default();
                    b.set_upper_bound(*le);
                    b.set_cumulative_count(*n);
                    b
                })
                .collect(),
        );
        h.set_sample_sum(sum);
        h.set_sample_count(count);
        m.set_histogram(h);
        self.family(name, help, MetricType::HISTOGRAM).mut_metric().push(m);
    }

    /// Gauges of one family from `current` (labels → value), plus a 0 for every series
    /// `seen` remembers that `current` lacks (METRICS-2); `seen` learns `current`'s.
    pub fn gauges_remembered(
        &mut self,
        seen: &mut SeenSeries,
        name: &str,
        help: &str,
        current: BTreeMap<Labels, f64>,
    ) {
        self.declare_gauge(name, help);
        for (l, v) in seen.merge(name, current) {
            self.gauge(name, help, &l, v);
        }
    }

    /// The families in the text format; families without series are left out (the
    /// format has no way to write them).
    pub fn encode(mut self) -> String {
        self.families.retain(|f| !f.get_metric().is_empty());
        prometheus::TextEncoder::new()
            .encode_to_string(&self.families)
            .unwrap_or_else(|e| format!("# tpuray: encoding failed: {e}\n"))
    }
}

/// How many series of one family [`SeenSeries`] remembers at most; past that the
/// oldest zero series are forgotten (a bound on memory for names that never return).
pub const MAX_REMEMBERED_SERIES: usize = 10_000;

/// METRICS-2: the series each family has exported, so a series whose count went away
/// is exported as 0 on every later scrape instead of vanishing (a vanished series reads
/// as its last value for minutes in Prometheus's range queries, ray#50735), and every
/// scrape returns the same set of series (ray#63131).
#[derive(Debug, Default)]
pub struct SeenSeries {
    /// family → series → the scrape that last had it non-zero.
    families: HashMap<String, HashMap<Labels, u64>>,
    scrape: u64,
}

impl SeenSeries {
    /// `current` plus a 0 for each remembered series it lacks, in label order.
    pub fn merge(&mut self, family: &str, current: BTreeMap<Labels, f64>) -> BTreeMap<Labels, f64> {
        self.scrape += 1;
        let scrape = self.scrape;
        let seen = self.families.entry(family.to_string()).or_default();
        for l in current.keys() {
            seen.insert(l.clone(), scrape);
        }
        if seen.len() > MAX_REMEMBERED_SERIES {
            let mut by_age: Vec<(u64, Labels)> = seen
                .iter()
                .filter(|(l, _)| !current.contains_key(*l))
                .map(|(l, s)| (*s, l.clone()))
                .collect();
            by_age.sort();
            let extra = seen.len() - MAX_REMEMBERED_SERIES;
            for (_, l) in by_age.into_iter().take(extra) {
                seen.remove(&l);
            }
        }
        let mut out = current;
        for l in seen.keys() {
            out.entry(l.clone()).or_insert(0.0);
        }
        out
    }
}

// ---- /proc ----

/// Clock ticks per second (`sysconf(_SC_CLK_TCK)`).
fn clock_ticks() -> f64 {
    // SAFETY: sysconf has no preconditions.
    let t = unsafe { libc::sysconf(libc::_SC_CLK_TCK) };
    if t > 0 { t as f64 } else { 100.0 }
}

fn page_size() -> u64 {
    // SAFETY: sysconf has no preconditions.
    let p = unsafe { libc::sysconf(libc::_SC_PAGESIZE) };
    if p > 0 { p as u64 } else { 4096 }
}

/// One process's counters from `/proc/<pid>`.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct ProcStat {
    /// User plus system CPU time so far, in seconds.
    pub cpu_seconds: f64,
    /// Resident set size, bytes.
    pub rss_bytes: u64,
    /// Resident pages shared with other processes (`top`'s SHR), bytes.
    pub shared_bytes: u64,
    pub num_fds: u64,
}

impl ProcStat {
    /// Ray's USS approximation on Linux: RSS minus shared.
    pub fn uss_bytes(&self) -> u64 {
        self.rss_bytes.saturating_sub(self.shared_bytes)
    }
}

/// `/proc/<pid>` read now; `None` when the process is gone.
pub fn proc_stat(pid: u32) -> Option<ProcStat> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    // The command name is in parentheses and may hold spaces: fields start after ')'.
    let rest = &stat[stat.rfind(')')? + 1..];
    let f: Vec<&str> = rest.split_whitespace().collect();
    // After ')': state is field 3 of the whole line, utime 14, stime 15.
    let utime: f64 = f.get(11)?.parse().ok()?;
    let stime: f64 = f.get(12)?.parse().ok()?;
    let statm = std::fs::read_to_string(format!("/proc/{pid}/statm")).ok()?;
    let m: Vec<u64> = statm.split_whitespace().filter_map(|x| x.parse().ok()).collect();
    let page = page_size();
    let num_fds =
        std::fs::read_dir(format!("/proc/{pid}/fd")).map(|d| d.count() as u64).unwrap_or(0);
    Some(ProcStat {
        cpu_seconds: (utime + stime) / clock_ticks(),
        rss_bytes: m.get(1).copied().unwrap_or(0) * page,
        shared_bytes: m.get(2).copied().unwrap_or(0) * page,
        num_fds,
    })
}

/// The host's counters and sizes read now.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct HostStat {
    /// CPU jiffies (all, idle + iowait) from `/proc/stat`.
    pub cpu_total: u64,
    pub cpu_idle: u64,
    pub cpu_count: u64,
    pub mem_total: u64,
    pub mem_available: u64,
    /// `Shmem` of `/proc/meminfo` (tmpfs and shared memory, /dev/shm included).
    pub mem_shared: u64,
    /// Bytes received and sent on interfaces named `e*` (Ray's choice: physical and
    /// virtual Ethernet, not loopback or bridges).
    pub net_received: u64,
    pub net_sent: u64,
    /// Bytes read and written on whole disks (`/proc/diskstats`, partitions left out).
    pub disk_read: u64,
    pub disk_written: u64,
    /// The container's memory use and limit (cgroup v2), when it has a limit.
    pub cgroup_mem: Option<(u64, u64)>,
}

fn meminfo_kib(text: &str, key: &str) -> u64 {
    text.lines()
        .find_map(|l| l.strip_prefix(key)?.strip_prefix(':'))
        .and_then(|v| v.split_whitespace().next()?.parse::<u64>().ok())
        .unwrap_or(0)
        * 1024
}

/// Parses `/proc/stat`'s aggregate `cpu` line: (all jiffies, idle + iowait jiffies).
pub fn parse_cpu_line(stat: &str) -> (u64, u64) {
    let Some(line) = stat.lines().find(|l| l.starts_with("cpu ")) else { return (0, 0) };
    let v: Vec<u64> = line.split_whitespace().skip(1).filter_map(|x| x.parse().ok()).collect();
    // user nice system idle iowait irq softirq steal (guest is inside user already).
    let total: u64 = v.iter().take(8).sum();
    let idle = v.get(3).copied().unwrap_or(0) + v.get(4).copied().unwrap_or(0);
    (total, idle)
}

/// Parses `/proc/net/dev`: (received, sent) bytes summed over interfaces named `e*`.
pub fn parse_net_dev(text: &str) -> (u64, u64) {
    let (mut rx, mut tx) = (0, 0);
    for line in text.lines().skip(2) {
        let Some((name, rest)) = line.split_once(':') else { continue };
        if !name.trim().starts_with('e') {
            continue;
        }
        let v: Vec<u64> = rest.split_whitespace().filter_map(|x| x.parse().ok()).collect();
        rx += v.first().copied().unwrap_or(0);
        tx += v.get(8).copied().unwrap_or(0);
    }
    (rx, tx)
}

/// Parses `/proc/diskstats`: (read, written) bytes of whole disks (devices listed in
/// `/sys/block`, so partitions do not count twice); `is_disk` says which names are.
pub fn parse_diskstats(text: &str, is_disk: impl Fn(&str) -> bool) -> (u64, u64) {
    let (mut r, mut w) = (0, 0);
    for line in text.lines() {
        let f: Vec<&str> = line.split_whitespace().collect();
        if f.len() < 10 || !is_disk(f[2]) || f[2].starts_with("loop") || f[2].starts_with("ram") {
            continue;
        }
        r += f[5].parse::<u64>().unwrap_or(0) * 512;
        w += f[9].parse::<u64>().unwrap_or(0) * 512;
    }
    (r, w)
}

fn cgroup_memory() -> Option<(u64, u64)> {
    let max = std::fs::read_to_string("/sys/fs/cgroup/memory.max").ok()?;
    let max: u64 = max.trim().parse().ok()?; // "max": no limit
    let cur: u64 =
        std::fs::read_to_string("/sys/fs/cgroup/memory.current").ok()?.trim().parse().ok()?;
    Some((cur, max))
}

/// The host's statistics read now.
pub fn host_stat() -> HostStat {
    let read = |p: &str| std::fs::read_to_string(p).unwrap_or_default();
    let (cpu_total, cpu_idle) = parse_cpu_line(&read("/proc/stat"));
    let mem = read("/proc/meminfo");
    let (net_received, net_sent) = parse_net_dev(&read("/proc/net/dev"));
    let (disk_read, disk_written) =
        parse_diskstats(&read("/proc/diskstats"), |d| Path::new("/sys/block").join(d).exists());
    HostStat {
        cpu_total,
        cpu_idle,
        cpu_count: std::thread::available_parallelism().map(|n| n.get() as u64).unwrap_or(1),
        mem_total: meminfo_kib(&mem, "MemTotal"),
        mem_available: meminfo_kib(&mem, "MemAvailable"),
        mem_shared: meminfo_kib(&mem, "Shmem"),
        net_received,
        net_sent,
        disk_read,
        disk_written,
        cgroup_mem: cgroup_memory(),
    }
}

/// (used, free) bytes of the file system holding `path`.
pub fn disk_usage(path: &Path) -> Option<(u64, u64)> {
    use std::os::unix::ffi::OsStrExt;
    let c = std::ffi::CString::new(path.as_os_str().as_bytes()).ok()?;
    // SAFETY: statvfs writes into the zeroed struct we pass; `c` is a valid C string.
    let mut s: libc::statvfs = unsafe { std::mem::zeroed() };
    if unsafe { libc::statvfs(c.as_ptr(), &mut s) } != 0 {
        return None;
    }
    let frsize = s.f_frsize as u64;
    let total = s.f_blocks as u64 * frsize;
    let free = s.f_bavail as u64 * frsize;
    let used = total.saturating_sub(s.f_bfree as u64 * frsize);
    Some((used, free))
}

/// Rates between two readings: CPU utilisation (percent of all CPUs), and bytes per
/// second received, sent, read and written.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct HostRates {
    pub cpu_percent: f64,
    pub net_receive_speed: f64,
    pub net_send_speed: f64,
    pub disk_read_speed: f64,
    pub disk_write_speed: f64,
}

/// Turns successive readings into rates: host CPU utilisation and throughput, and each
/// process's CPU percentage (of one CPU, as `top` shows it; Ray's `cpu_percent`).
#[derive(Debug, Default)]
pub struct Sampler {
    host: Option<(Instant, HostStat)>,
    procs: HashMap<u32, (Instant, f64)>,
}

impl Sampler {
    /// A new reading of the host: its statistics and the rates since the last reading
    /// (zeros for the first).
    pub fn host(&mut self, now: Instant, stat: HostStat) -> (HostStat, HostRates) {
        let rates = match &self.host {
            Some((then, prev)) => {
                let dt = now.duration_since(*then).as_secs_f64().max(1e-3);
                let dtotal = stat.cpu_total.saturating_sub(prev.cpu_total) as f64;
                let didle = stat.cpu_idle.saturating_sub(prev.cpu_idle) as f64;
                let per = |a: u64, b: u64| a.saturating_sub(b) as f64 / dt;
                HostRates {
                    cpu_percent: if dtotal > 0.0 { 100.0 * (1.0 - didle / dtotal) } else { 0.0 },
                    net_receive_speed: per(stat.net_received, prev.net_received),
                    net_send_speed: per(stat.net_sent, prev.net_sent),
                    disk_read_speed: per(stat.disk_read, prev.disk_read),
                    disk_write_speed: per(stat.disk_written, prev.disk_written),
                }
            }
            None => HostRates::default(),
        };
        self.host = Some((now, stat.clone()));
        (stat, rates)
    }

    /// A process's CPU percentage since its last reading (0 for the first); readings of
    /// processes not passed in `alive` are forgotten.
    pub fn process(&mut self, now: Instant, pid: u32, stat: &ProcStat) -> f64 {
        let pct = match self.procs.get(&pid) {
            Some((then, cpu)) => {
                let dt = now.duration_since(*then).as_secs_f64();
                if dt > 0.0 { 100.0 * (stat.cpu_seconds - cpu).max(0.0) / dt } else { 0.0 }
            }
            None => 0.0,
        };
        self.procs.insert(pid, (now, stat.cpu_seconds));
        pct
    }

    /// Forgets the processes not in `alive`.
    pub fn retain_processes(&mut self, alive: &std::collections::HashSet<u32>) {
        self.procs.retain(|p, _| alive.contains(p));
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_series_carries_the_base_labels_after_its_own() {
        let mut e = Exposition::new(labels(&[("SessionName", "session_x"), ("Version", "1")]));
        e.gauge("ray_tasks", "tasks", &labels(&[("State", "RUNNING"), ("Version", "own")]), 2.0);
        let text = e.encode();
        assert!(
            text.contains(r#"ray_tasks{State="RUNNING",Version="own",SessionName="session_x"} 2"#),
            "{text}"
        );
        assert!(text.contains("# TYPE ray_tasks gauge"), "{text}");
    }

    #[test]
    fn families_without_series_are_left_out() {
        let mut e = Exposition::new(vec![]);
        e.declare_gauge("empty", "nothing");
        e.counter("c_total", "", &[], 1.0);
        let text = e.encode();
        assert!(!text.contains("empty"), "{text}");
        assert!(text.contains("# TYPE c_total counter\nc_total 1\n"), "{text}");
    }

    #[test]
    fn histograms_write_cumulative_buckets_and_inf() {
        let mut e = Exposition::new(vec![]);
        e.histogram("h", "", &labels(&[("a", "b")]), &[(1.0, 2), (5.0, 3)], 7.5, 4);
        let text = e.encode();
        assert!(text.contains(r#"h_bucket{a="b",le="1"} 2"#), "{text}");
        assert!(text.contains(r#"h_bucket{a="b",le="+Inf"} 4"#), "{text}");
        assert!(text.contains(r#"h_sum{a="b"} 7.5"#), "{text}");
    }

    /// METRICS-2.
    #[test]
    fn a_series_whose_count_went_away_is_exported_as_zero() {
        let mut seen = SeenSeries::default();
        let a = labels(&[("State", "RUNNING")]);
        let first = seen.merge("ray_tasks", BTreeMap::from([(a.clone(), 3.0)]));
        assert_eq!(first[&a], 3.0);
        let second = seen.merge("ray_tasks", BTreeMap::new());
        assert_eq!(second.get(&a), Some(&0.0));
    }

    #[test]
    fn remembered_series_are_bounded() {
        let mut seen = SeenSeries::default();
        for i in 0..MAX_REMEMBERED_SERIES + 5 {
            seen.merge("f", BTreeMap::from([(labels(&[("i", &i.to_string())]), 1.0)]));
        }
        let out = seen.merge("f", BTreeMap::new());
        assert_eq!(out.len(), MAX_REMEMBERED_SERIES);
        assert!(!out.contains_key(&labels(&[("i", "0")])), "the oldest went first");
    }

    #[test]
    fn proc_files_parse() {
        assert_eq!(parse_cpu_line("cpu  10 0 5 80 5 0 0 0 0 0\ncpu0 1 2 3 4"), (100, 85));
        let net = "Inter-|\n face |\n    lo: 100 1 0 0 0 0 0 0 100 1 0 0 0 0 0 0\n  eth0: 300 3 0 0 0 0 0 0 400 4 0 0 0 0 0 0\n";
        assert_eq!(parse_net_dev(net), (300, 400));
        let disk =
            "   8       0 sda 1 0 10 0 2 0 20 0 0 0 0\n   8       1 sda1 1 0 10 0 2 0 20 0 0 0 0\n";
        assert_eq!(parse_diskstats(disk, |d| d == "sda"), (5120, 10240));
        let me = proc_stat(std::process::id()).expect("our own /proc entry");
        assert!(me.rss_bytes > 0 && me.num_fds > 0, "{me:?}");
        assert!(host_stat().mem_total > 0);
    }

    #[test]
    fn sampler_turns_readings_into_rates() {
        let mut s = Sampler::default();
        let t0 = Instant::now();
        let h = |total, idle, rx| HostStat {
            cpu_total: total,
            cpu_idle: idle,
            net_received: rx,
            ..Default::default()
        };
        assert_eq!(s.host(t0, h(100, 50, 0)).1, HostRates::default());
        let (_, r) = s.host(t0 + std::time::Duration::from_secs(2), h(200, 125, 1000));
        assert!((r.cpu_percent - 25.0).abs() < 1e-9, "{r:?}");
        assert!((r.net_receive_speed - 500.0).abs() < 1e-9, "{r:?}");
        let p = ProcStat { cpu_seconds: 1.0, ..Default::default() };
        assert_eq!(s.process(t0, 7, &p), 0.0);
        let p2 = ProcStat { cpu_seconds: 2.0, ..Default::default() };
        let pct = s.process(t0 + std::time::Duration::from_secs(2), 7, &p2);
        assert!((pct - 50.0).abs() < 1e-9, "{pct}");
    }
}
