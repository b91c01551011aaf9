//! Worker output at the driver: Ray's repeated-line deduplication and the
//! `(name pid=N, ip=H)` prefix, as Ray 2.60's driver prints worker lines.
//!
//! Workers send their lines to their job's driver (`ReportLogs`, from the Python
//! worker's stdout/stderr forwarder); the driver's `WorkerService` hands each batch to
//! [`print_batch`]. The rules are Ray's (`ray/_private/ray_logging/__init__.py`,
//! `LogDeduplicator`, and `print_worker_logs` in `ray/_private/worker.py`):
//!
//! - LOGS-1: a line is keyed by its words without digits or hex (`_canonicalise_log_line`);
//!   the first occurrence of a key prints at once; a later one from the *same* source
//!   (node ip, pid) prints too; one from another source is counted instead. When the
//!   key's oldest sighting is `RAY_DEDUP_LOGS_AGG_WINDOW_S` (5 s) old, a count above 1
//!   prints the latest line with ` [repeated Nx across cluster]` (and aggregation goes
//!   on), a count of 1 prints that line plainly and forgets the key. Shutdown prints
//!   what is left ([`flush`]). Lines matching `RAY_DEDUP_LOGS_ALLOW_REGEX` (default
//!   `__ray_testing_never_deduplicate__`) always print; lines matching
//!   `RAY_DEDUP_LOGS_SKIP_REGEX` never do; lines empty once canonicalised always
//!   print; `RAY_DEDUP_LOGS=0` turns deduplication off.
//! - Ray checks for expired keys only when a batch arrives; here a driver thread also
//!   calls [`tick`] every second, so a count is printed within a second of its window
//!   ending even when nothing else arrives (the printed text is Ray's).
//! - The prefix is `(name pid=N)`, `(pid=N)` without a name, with `, ip=H` when the
//!   worker's node is not the driver's. `RAY_DISABLE_WORKER_LOG_PREFIX=1` drops it.
//!   Colour: `RAY_COLOR_PREFIX=0` none, `=1` one colour per pid, unset Ray's cyan
//!   prefix and green count. Chosen: unset, colour codes are written only when the
//!   stream is a terminal (Ray writes them into pipes and files as well).
//! - `init(log_to_driver=False)` (or `RAY_LOG_TO_DRIVER=0`): [`set_log_to_driver`];
//!   the `ReportLogs` reply then tells the worker to stop sending.
//!
//! Regexes are Rust's `regex` syntax (Python's without look-around and
//! backreferences); one that does not compile is refused at `init` by name.

use std::collections::{HashMap, HashSet, VecDeque};
use std::io::{IsTerminal, Write};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Mutex, OnceLock};

use regex::Regex;

/// Ray's `RAY_TQDM_MAGIC`: tqdm_ray state lines are never deduplicated.
const TQDM_MAGIC: &str = "__ray_tqdm_magic_token__";
/// Ray's `TESTING_NEVER_DEDUP_TOKEN`, the default allow regex.
const NEVER_DEDUP_TOKEN: &str = "__ray_testing_never_deduplicate__";
/// Ray's `LOG_PREFIX_INFO_MESSAGE`: what follows it is printed alone.
const INFO_MESSAGE: &str = ":info_message:";
/// The text Ray appends to the first `[repeated ...]` line of a driver's life, word for
/// word (a drop-in prints what Ray prints; the variables it names are honoured here).
const DEDUP_NOTE: &str = " (Ray deduplicates logs by default. Set RAY_DEDUP_LOGS=0 to disable log \
deduplication, or see https://docs.ray.io/en/master/ray-observability/user-guides/\
configure-logging.html#log-deduplication for more options.)";

/// Ray's deduplication settings, read from the environment.
#[derive(Debug, Clone)]
pub struct DedupConfig {
    /// `RAY_DEDUP_LOGS` (default on).
    pub enabled: bool,
    /// `RAY_DEDUP_LOGS_AGG_WINDOW_S`, in seconds (default 5).
    pub window_s: f64,
    /// `RAY_DEDUP_LOGS_ALLOW_REGEX`: lines never deduplicated.
    pub allow: Option<Regex>,
    /// `RAY_DEDUP_LOGS_SKIP_REGEX`: lines never printed.
    pub skip: Option<Regex>,
}

impl Default for DedupConfig {
    fn default() -> Self {
        DedupConfig {
            enabled: true,
            window_s: 5.0,
            allow: Some(Regex::new(NEVER_DEDUP_TOKEN).expect("literal regex")),
            skip: None,
        }
    }
}

/// Ray's `env_bool`: `true`/`1` (any case) is true, anything else false, unset the default.
fn env_bool(get: &dyn Fn(&str) -> Option<String>, name: &str, default: bool) -> bool {
    match get(name) {
        Some(v) => matches!(v.to_ascii_lowercase().as_str(), "true" | "1"),
        None => default,
    }
}

impl DedupConfig {
    /// Reads Ray's variables through `get` (`std::env::var` in a driver).
    ///
    /// # Errors
    /// `RAY_DEDUP_LOGS_AGG_WINDOW_S` is not a whole number of seconds, or a regex does
    /// not compile: the message names the variable and its value.
    pub fn from_vars(get: &dyn Fn(&str) -> Option<String>) -> Result<Self, String> {
        let mut c =
            DedupConfig { enabled: env_bool(get, "RAY_DEDUP_LOGS", true), ..Default::default() };
        if let Some(w) = get("RAY_DEDUP_LOGS_AGG_WINDOW_S") {
            let n: i64 = w.trim().parse().map_err(|_| {
                format!("RAY_DEDUP_LOGS_AGG_WINDOW_S={w:?} is not a whole number of seconds")
            })?;
            c.window_s = n as f64;
        }
        let re = |name: &str, v: String| {
            Regex::new(&v).map_err(|e| format!("{name}={v:?} is not a regular expression: {e}"))
        };
        c.allow = match get("RAY_DEDUP_LOGS_ALLOW_REGEX") {
            Some(v) if v.is_empty() => None,
            Some(v) => Some(re("RAY_DEDUP_LOGS_ALLOW_REGEX", v)?),
            None => c.allow,
        };
        c.skip = match get("RAY_DEDUP_LOGS_SKIP_REGEX") {
            Some(v) if v.is_empty() => None,
            Some(v) => Some(re("RAY_DEDUP_LOGS_SKIP_REGEX", v)?),
            None => None,
        };
        Ok(c)
    }
}

/// Where a batch of lines comes from.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Source {
    /// The task's function name or the actor's name; empty for neither.
    pub name: String,
    pub pid: u32,
    /// The worker's node address.
    pub ip: String,
}

/// One line to print: its source, its text and, for an aggregate, how many
/// occurrences it stands for.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Printed {
    pub source: Source,
    pub line: String,
    /// `Some(n)`: printed as `line [repeated nx across cluster]`.
    pub repeated: Option<u32>,
}

struct Pattern {
    first_seen: f64,
    count: u32,
    line: String,
    source: Source,
    sources: HashSet<(String, u32)>,
}

/// Ray's `_canonicalise_log_line`: the words that hold no digit and no `0x` hex.
fn canonical(line: &str) -> String {
    line.split_whitespace()
        .filter(|w| !w.bytes().any(|b| b.is_ascii_digit()))
        .collect::<Vec<_>>()
        .join(" ")
}

/// LOGS-1: Ray's `LogDeduplicator`, one per stream; time is passed in (seconds).
pub struct Deduplicator {
    config: DedupConfig,
    /// Keys in the order first seen (Python's dict order), with their state.
    order: VecDeque<String>,
    recent: HashMap<String, Pattern>,
}

impl Deduplicator {
    pub fn new(config: DedupConfig) -> Self {
        Deduplicator { config, order: VecDeque::new(), recent: HashMap::new() }
    }

    /// The lines to print now for a batch from `source` arriving at `now` (seconds),
    /// the batch's own first, then aggregates whose window ended.
    pub fn deduplicate(&mut self, source: &Source, lines: &[String], now: f64) -> Vec<Printed> {
        let plain =
            |line: &str| Printed { source: source.clone(), line: line.to_string(), repeated: None };
        if !self.config.enabled {
            return lines.iter().map(|l| plain(l)).collect();
        }
        let mut out = Vec::new();
        let from = (source.ip.clone(), source.pid);
        for line in lines {
            if line.contains(TQDM_MAGIC)
                || self.config.allow.as_ref().is_some_and(|r| r.is_match(line))
            {
                out.push(plain(line));
                continue;
            }
            if self.config.skip.as_ref().is_some_and(|r| r.is_match(line)) {
                continue;
            }
            let key = canonical(line);
            if key.is_empty() {
                out.push(plain(line));
                continue;
            }
            match self.recent.get_mut(&key) {
                Some(p) => {
                    p.sources.insert(from.clone());
                    if p.sources.len() > 1 {
                        p.count += 1;
                        p.line = line.clone();
                        p.source = source.clone();
                    } else {
                        out.push(plain(line));
                    }
                }
                None => {
                    self.order.push_back(key.clone());
                    self.recent.insert(
                        key,
                        Pattern {
                            first_seen: now,
                            count: 0,
                            line: line.clone(),
                            source: source.clone(),
                            sources: HashSet::from([from.clone()]),
                        },
                    );
                    out.push(plain(line));
                }
            }
        }
        self.expire(now, &mut out);
        out
    }

    /// Aggregates whose window ended by `now`, oldest first (Ray's loop after a batch).
    pub fn expire(&mut self, now: f64, out: &mut Vec<Printed>) {
        while let Some(key) = self.order.front() {
            let p = &self.recent[key];
            if now - p.first_seen < self.config.window_s {
                break;
            }
            let key = self.order.pop_front().expect("front exists");
            let mut p = self.recent.remove(&key).expect("ordered keys are present");
            if p.count > 1 {
                out.push(Printed {
                    source: p.source.clone(),
                    line: p.line.clone(),
                    repeated: Some(p.count),
                });
                p.first_seen = now;
                p.count = 0;
                self.order.push_back(key.clone());
                self.recent.insert(key, p);
            } else if p.count > 0 {
                out.push(Printed { source: p.source, line: p.line, repeated: None });
            }
        }
    }

    /// Everything still counted, and forgets every key (Ray's `flush`, at shutdown).
    pub fn flush(&mut self) -> Vec<Printed> {
        let mut out = Vec::new();
        for key in self.order.drain(..) {
            let p = self.recent.remove(&key).expect("ordered keys are present");
            if p.count > 1 {
                out.push(Printed { source: p.source, line: p.line, repeated: Some(p.count) });
            } else if p.count > 0 {
                out.push(Printed { source: p.source, line: p.line, repeated: None });
            }
        }
        out
    }
}

#[derive(Clone, Copy, PartialEq, Eq)]
enum Colour {
    Off,
    /// Ray's cyan prefix and green count.
    Plain,
    /// `RAY_COLOR_PREFIX=1`: a colour per pid.
    PerPid,
}

const CYAN: &str = "\x1b[36m";
const GREEN: &str = "\x1b[32m";
const RESET: &str = "\x1b[0m";
/// Ray's palette for `RAY_COLOR_PREFIX=1` (colorama's MAGENTA, CYAN, GREEN,
/// LIGHTBLACK_EX, LIGHTBLUE_EX, LIGHTMAGENTA_EX).
const PID_COLOURS: [&str; 6] =
    ["\x1b[35m", "\x1b[36m", "\x1b[32m", "\x1b[90m", "\x1b[94m", "\x1b[95m"];

/// Formats lines as Ray's `print_worker_logs` does.
pub struct Formatter {
    /// The driver's own node address: lines from it carry no `ip=`.
    pub local_ip: String,
    pub no_prefix: bool,
    colour: Colour,
    warned: bool,
}

impl Formatter {
    /// `colour_env` is `RAY_COLOR_PREFIX`; `terminal` whether the stream is one.
    pub fn new(
        local_ip: String,
        no_prefix: bool,
        colour_env: Option<&str>,
        terminal: bool,
    ) -> Self {
        let colour = match colour_env {
            Some("0") => Colour::Off,
            Some("1") => Colour::PerPid,
            _ if terminal => Colour::Plain,
            _ => Colour::Off,
        };
        Formatter { local_ip, no_prefix, colour, warned: false }
    }

    /// The printed text of `p`, without a newline.
    pub fn format(&mut self, p: &Printed) -> String {
        let message = match p.line.split_once(INFO_MESSAGE) {
            Some((_, rest)) => rest,
            None => &p.line,
        };
        let mut text = String::new();
        if !self.no_prefix {
            let (pre, post) = match self.colour {
                Colour::Off => ("", ""),
                Colour::Plain => (CYAN, RESET),
                Colour::PerPid => (PID_COLOURS[p.source.pid as usize % PID_COLOURS.len()], RESET),
            };
            let name = if p.source.name.is_empty() {
                String::new()
            } else {
                format!("{} ", p.source.name)
            };
            let ip = if p.source.ip.is_empty() || p.source.ip == self.local_ip {
                String::new()
            } else {
                format!(", ip={}", p.source.ip)
            };
            text.push_str(&format!("{pre}({name}pid={}{ip}){post} ", p.source.pid));
        }
        text.push_str(message);
        if let Some(n) = p.repeated {
            let note = if self.warned { "" } else { DEDUP_NOTE };
            self.warned = true;
            let (pre, post) = if self.colour == Colour::Off { ("", "") } else { (GREEN, RESET) };
            text.push_str(&format!("{pre} [repeated {n}x across cluster]{note}{post}"));
        }
        text
    }
}

struct Sink {
    out: Deduplicator,
    err: Deduplicator,
    fmt_out: Formatter,
    fmt_err: Formatter,
    start: std::time::Instant,
}

static LOG_TO_DRIVER: AtomicBool = AtomicBool::new(true);
static SINK: OnceLock<Mutex<Sink>> = OnceLock::new();

/// Sets up this driver's printing of worker lines: reads Ray's variables
/// (`RAY_DEDUP_LOGS*`, `RAY_DISABLE_WORKER_LOG_PREFIX`, `RAY_COLOR_PREFIX`) once and
/// starts the 1 s tick thread. `local_ip` is the driver's node address. `log_to_driver`
/// `None` means `RAY_LOG_TO_DRIVER` (default true).
///
/// # Errors
/// A variable has a value Ray's driver would not accept (see [`DedupConfig::from_vars`]).
pub fn configure(local_ip: &str, log_to_driver: Option<bool>) -> Result<(), String> {
    let get = |k: &str| std::env::var(k).ok();
    let on = log_to_driver.unwrap_or_else(|| env_bool(&get, "RAY_LOG_TO_DRIVER", true));
    LOG_TO_DRIVER.store(on, Ordering::SeqCst);
    let config = DedupConfig::from_vars(&get)?;
    let no_prefix = env_bool(&get, "RAY_DISABLE_WORKER_LOG_PREFIX", false);
    let colour = get("RAY_COLOR_PREFIX");
    let sink = Sink {
        out: Deduplicator::new(config.clone()),
        err: Deduplicator::new(config),
        fmt_out: Formatter::new(
            local_ip.to_string(),
            no_prefix,
            colour.as_deref(),
            std::io::stdout().is_terminal(),
        ),
        fmt_err: Formatter::new(
            local_ip.to_string(),
            no_prefix,
            colour.as_deref(),
            std::io::stderr().is_terminal(),
        ),
        start: std::time::Instant::now(),
    };
    if SINK.set(Mutex::new(sink)).is_ok() {
        let _ = std::thread::Builder::new().name("tpuray-log-tick".into()).spawn(|| {
            loop {
                std::thread::sleep(std::time::Duration::from_secs(1));
                tick();
            }
        });
    }
    Ok(())
}

/// Turns the printing of worker lines on or off (`init(log_to_driver=...)`).
pub fn set_log_to_driver(on: bool) {
    LOG_TO_DRIVER.store(on, Ordering::SeqCst);
}

/// Whether this driver prints worker lines.
pub fn log_to_driver() -> bool {
    LOG_TO_DRIVER.load(Ordering::SeqCst)
}

fn write_all(is_err: bool, sink: &mut Sink, printed: &[Printed]) {
    if printed.is_empty() {
        return;
    }
    let fmt = if is_err { &mut sink.fmt_err } else { &mut sink.fmt_out };
    let mut text = String::new();
    for p in printed {
        text.push_str(&fmt.format(p));
        text.push('\n');
    }
    // Straight to the process's descriptors, as Ray's driver prints.
    if is_err {
        let _ = std::io::stderr().lock().write_all(text.as_bytes());
    } else {
        let mut o = std::io::stdout().lock();
        let _ = o.write_all(text.as_bytes());
        let _ = o.flush();
    }
}

/// Prints a batch a worker sent (LOGS-1). Returns false when this driver takes no
/// worker output. Without [`configure`] (a Rust driver that never called it) the
/// defaults apply.
pub fn print_batch(source: &Source, lines: &[String], is_err: bool) -> bool {
    if !log_to_driver() {
        return false;
    }
    let m = SINK.get_or_init(|| {
        Mutex::new(Sink {
            out: Deduplicator::new(DedupConfig::default()),
            err: Deduplicator::new(DedupConfig::default()),
            fmt_out: Formatter::new(String::new(), false, None, false),
            fmt_err: Formatter::new(String::new(), false, None, false),
            start: std::time::Instant::now(),
        })
    });
    let mut sink = m.lock().unwrap_or_else(|e| e.into_inner());
    let now = sink.start.elapsed().as_secs_f64();
    let printed = if is_err {
        sink.err.deduplicate(source, lines, now)
    } else {
        sink.out.deduplicate(source, lines, now)
    };
    write_all(is_err, &mut sink, &printed);
    true
}

/// Prints the aggregates whose window ended (called every second).
pub fn tick() {
    let Some(m) = SINK.get() else { return };
    let mut sink = m.lock().unwrap_or_else(|e| e.into_inner());
    let now = sink.start.elapsed().as_secs_f64();
    for is_err in [false, true] {
        let mut printed = Vec::new();
        if is_err {
            sink.err.expire(now, &mut printed)
        } else {
            sink.out.expire(now, &mut printed)
        }
        write_all(is_err, &mut sink, &printed);
    }
}

/// Prints every count still held (the driver's shutdown, as Ray's `disconnect`).
pub fn flush() {
    let Some(m) = SINK.get() else { return };
    let mut sink = m.lock().unwrap_or_else(|e| e.into_inner());
    for is_err in [false, true] {
        let printed = if is_err { sink.err.flush() } else { sink.out.flush() };
        write_all(is_err, &mut sink, &printed);
    }
}

/// LOGS-3: where one task's output lies in its worker's log files (Ray's
/// `task_log_info`), measured around a task that runs alone on its thread: the
/// descriptors' offsets before and after it (a Python worker flushes its streams
/// when a task ends). Recorded for tasks, and for actor tasks when
/// `RAY_ENABLE_RECORD_ACTOR_TASK_LOGGING` is true (Ray's default is off: calls of a
/// concurrent actor interleave). The offsets go to the head as a task event without a
/// state, and the head keeps them in the task's row.
pub(crate) struct TaskLog {
    info: tpuray_proto::pb::TaskLogInfo,
}

/// The name (in the logs directory) and current offset of descriptor `fd`, when it
/// is a file.
///
/// The name is read from `/proc/self/fd` (a path walk through procfs, several times the
/// cost of the task it measures for a small one) only when the file changed since the
/// last time: [`NAMES`] keeps it per descriptor with the file's identity and status
/// change time (`fstat`). An open descriptor's name changes only by a rename (the
/// agent's LOGS-2 rename of a new worker's files) or by the descriptor being pointed
/// at another file (`dup2`); Linux sets the inode's ctime on a rename (every local
/// filesystem, tmpfs included) and a `dup2` brings another (device, inode), so a
/// cached name is never stale. Writes set the ctime too: after a task that printed,
/// the name is read again.
fn file_position(fd: i32) -> Option<(String, u64)> {
    // SAFETY: fstat fills `st` for a descriptor this process holds; nothing else is touched.
    let mut st: libc::stat = unsafe { std::mem::zeroed() };
    if unsafe { libc::fstat(fd, &mut st) } != 0 || (st.st_mode & libc::S_IFMT) != libc::S_IFREG {
        return None;
    }
    // SAFETY: lseek on a descriptor this process holds open changes nothing.
    let at = unsafe { libc::lseek(fd, 0, libc::SEEK_CUR) };
    if at < 0 {
        return None;
    }
    let key: FileKey =
        (st.st_dev as u64, st.st_ino as u64, st.st_ctime as i64, st.st_ctime_nsec as i64);
    let mut names = NAMES.lock().unwrap();
    if let Some((_, k, name)) = names.iter().find(|(f, _, _)| *f == fd)
        && *k == key
    {
        return Some((name.clone(), at as u64));
    }
    let path = std::fs::read_link(format!("/proc/self/fd/{fd}")).ok()?;
    let name = path.file_name()?.to_string_lossy().into_owned();
    names.retain(|(f, _, _)| *f != fd);
    names.push((fd, key, name.clone()));
    Some((name, at as u64))
}

/// A file's (device, inode, ctime seconds, ctime nanoseconds).
type FileKey = (u64, u64, i64, i64);

/// [`file_position`]'s names: (descriptor, the file's [`FileKey`] then, its name).
static NAMES: Mutex<Vec<(i32, FileKey, String)>> = Mutex::new(Vec::new());

impl TaskLog {
    /// Before the task runs; `None` when it is not recorded or the worker's output
    /// is not a file.
    pub(crate) fn start(spec: &tpuray_proto::pb::TaskSpec) -> Option<TaskLog> {
        if !spec.actor_id.is_empty() {
            static ACTOR_TASKS: OnceLock<bool> = OnceLock::new();
            let on = *ACTOR_TASKS.get_or_init(|| {
                env_bool(&|k| std::env::var(k).ok(), "RAY_ENABLE_RECORD_ACTOR_TASK_LOGGING", false)
            });
            if !on {
                return None;
            }
        }
        let (stdout_file, stdout_start) = file_position(1)?;
        let (stderr_file, stderr_start) = file_position(2)?;
        Some(TaskLog {
            info: tpuray_proto::pb::TaskLogInfo {
                stdout_file,
                stderr_file,
                stdout_start,
                stderr_start,
                ..Default::default()
            },
        })
    }

    /// After it ran: the ranges it wrote.
    pub(crate) fn end(mut self) -> tpuray_proto::pb::TaskLogInfo {
        self.info.stdout_end = file_position(1).map(|p| p.1).unwrap_or(self.info.stdout_start);
        self.info.stderr_end = file_position(2).map(|p| p.1).unwrap_or(self.info.stderr_start);
        self.info.ended = true;
        self.info
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn logs_3_a_descriptors_name_follows_writes_renames_and_dup2() {
        use std::os::fd::AsRawFd;
        let dir = std::env::temp_dir().join(format!("tpuray-logs3-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let (a, b, c) = (dir.join("a.out"), dir.join("b.out"), dir.join("c.out"));
        let mut f = std::fs::File::create(&a).unwrap();
        let fd = f.as_raw_fd();
        assert_eq!(file_position(fd), Some(("a.out".into(), 0)));
        f.write_all(b"hello").unwrap();
        assert_eq!(file_position(fd), Some(("a.out".into(), 5)));
        // Unchanged file: the cached name, the current offset.
        assert_eq!(file_position(fd), Some(("a.out".into(), 5)));
        // Renamed while open (the agent's LOGS-2 rename): the new name.
        std::fs::rename(&a, &b).unwrap();
        assert_eq!(file_position(fd), Some(("b.out".into(), 5)));
        // The descriptor pointed at another file.
        let other = std::fs::File::create(&c).unwrap();
        // SAFETY: both descriptors are open and owned by this test.
        assert!(unsafe { libc::dup2(other.as_raw_fd(), fd) } >= 0);
        assert_eq!(file_position(fd), Some(("c.out".into(), 0)));
        // Not a file: none.
        let (r, _w) = std::io::pipe().unwrap();
        assert_eq!(file_position(r.as_raw_fd()), None);
        drop((f, other));
        std::fs::remove_dir_all(&dir).unwrap();
    }

    fn src(pid: u32) -> Source {
        Source { name: "f".into(), pid, ip: "10.0.0.1".into() }
    }
    fn lines(v: &[&str]) -> Vec<String> {
        v.iter().map(|s| s.to_string()).collect()
    }

    #[test]
    fn logs_1_first_occurrence_prints_at_once_and_other_sources_are_counted() {
        let mut d = Deduplicator::new(DedupConfig::default());
        assert_eq!(d.deduplicate(&src(1), &lines(&["hello"]), 0.0).len(), 1);
        // The same source prints again; others are counted.
        assert_eq!(d.deduplicate(&src(1), &lines(&["hello"]), 0.1).len(), 1);
        for pid in 2..10 {
            assert!(d.deduplicate(&src(pid), &lines(&["hello"]), 0.2).is_empty());
        }
        // The window ends: one aggregate with the latest source, counting on.
        let out = d.deduplicate(&src(20), &lines(&["other"]), 5.0);
        assert_eq!(out.len(), 2);
        assert_eq!(out[1], Printed { source: src(9), line: "hello".into(), repeated: Some(8) });
        assert!(d.deduplicate(&src(3), &lines(&["hello"]), 5.1).is_empty());
        // A count of one prints plainly at shutdown.
        let left = d.flush();
        assert_eq!(left, vec![Printed { source: src(3), line: "hello".into(), repeated: None }]);
        assert!(d.flush().is_empty());
    }

    #[test]
    fn logs_1_numbers_do_not_split_a_key_and_empty_keys_always_print() {
        let mut d = Deduplicator::new(DedupConfig::default());
        d.deduplicate(&src(1), &lines(&["step 1 loss 0x1f"]), 0.0);
        assert!(d.deduplicate(&src(2), &lines(&["step 2 loss 0x2e"]), 0.0).is_empty());
        assert_eq!(d.deduplicate(&src(2), &lines(&["42", "42"]), 0.0).len(), 2);
        assert_eq!(
            d.deduplicate(
                &src(3),
                &lines(&[
                    "x __ray_testing_never_deduplicate__",
                    "x __ray_testing_never_deduplicate__"
                ]),
                0.0
            )
            .len(),
            2
        );
    }

    #[test]
    fn logs_1_ray_variables_turn_dedup_off_and_set_regexes() {
        let vars = |pairs: &'static [(&'static str, &'static str)]| {
            move |k: &str| pairs.iter().find(|(n, _)| *n == k).map(|(_, v)| v.to_string())
        };
        let c = DedupConfig::from_vars(&vars(&[("RAY_DEDUP_LOGS", "0")])).unwrap();
        let mut d = Deduplicator::new(c);
        d.deduplicate(&src(1), &lines(&["a"]), 0.0);
        assert_eq!(d.deduplicate(&src(2), &lines(&["a"]), 0.0).len(), 1);
        let c = DedupConfig::from_vars(&vars(&[
            ("RAY_DEDUP_LOGS_SKIP_REGEX", "^noise"),
            ("RAY_DEDUP_LOGS_AGG_WINDOW_S", "1"),
        ]))
        .unwrap();
        assert_eq!(c.window_s, 1.0);
        let mut d = Deduplicator::new(c);
        assert!(d.deduplicate(&src(1), &lines(&["noise here"]), 0.0).is_empty());
        let e = DedupConfig::from_vars(&vars(&[("RAY_DEDUP_LOGS_ALLOW_REGEX", "(")])).unwrap_err();
        assert!(e.contains("RAY_DEDUP_LOGS_ALLOW_REGEX"), "{e}");
        let e =
            DedupConfig::from_vars(&vars(&[("RAY_DEDUP_LOGS_AGG_WINDOW_S", "soon")])).unwrap_err();
        assert!(e.contains("RAY_DEDUP_LOGS_AGG_WINDOW_S"), "{e}");
    }

    #[test]
    fn prefix_names_the_source_and_another_hosts_ip_and_the_note_comes_once() {
        let mut f = Formatter::new("10.0.0.1".into(), false, None, false);
        let p = |ip: &str, name: &str, n: Option<u32>| Printed {
            source: Source { name: name.into(), pid: 7, ip: ip.into() },
            line: "hi".into(),
            repeated: n,
        };
        assert_eq!(f.format(&p("10.0.0.1", "f", None)), "(f pid=7) hi");
        assert_eq!(f.format(&p("10.0.0.2", "", None)), "(pid=7, ip=10.0.0.2) hi");
        let first = f.format(&p("10.0.0.1", "A", Some(9)));
        assert!(first.starts_with("(A pid=7) hi [repeated 9x across cluster] (Ray deduplicates logs by default. Set RAY_DEDUP_LOGS=0"), "{first}");
        assert_eq!(
            f.format(&p("10.0.0.1", "A", Some(3))),
            "(A pid=7) hi [repeated 3x across cluster]"
        );
        let mut bare = Formatter::new("10.0.0.1".into(), true, Some("1"), false);
        assert_eq!(bare.format(&p("10.0.0.2", "f", None)), "hi");
    }
}
