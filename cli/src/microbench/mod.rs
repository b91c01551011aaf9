//! `tpuray microbenchmark`: Ray's `ray microbenchmark` cases, named and timed as
//! Ray names and times them (DESIGN.md §9), with the floor they stand on.
//!
//! A run prints the floor first ([`floor`]: an empty tonic unary round trip on a
//! loopback server this process starts, and a 100 MiB `memcpy`), then either the
//! Python SDK's cases (`python -m tpuray._private.ray_perf`, a child process run
//! by the Python interpreter that has tpuray installed) or, with `--rust`, the
//! Rust SDK's task, actor and object cases ([`rust_cases`]) against a private
//! local cluster. The Rust cases' remote functions and actors live in this crate,
//! so the workers the agent starts (`tpuray _worker`, the CLI itself, or `python -m
//! tpuray _worker` from the Python package) are this job's workers (DESIGN.md §8).
//!
//! Every line is `<name> per second <mean> +- <sd>`, or one JSON object per case
//! with `--json` (`{"name", "mean", "sd", "unit"}`, `{"name", "skipped"}`).
//! Everything here blocks the calling thread.

pub mod floor;
pub mod rust_cases;

use std::path::PathBuf;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail};

use crate::args::MicrobenchmarkArgs;

/// How cases are timed and reported: Ray's `timeit` (an idle pause, a 1 s warm-up
/// counting calls, then trials of repeated steps of a tenth of that count).
#[derive(Clone, Debug)]
pub struct Timing {
    /// Idle pause before each case (Ray: 10 s, against noisy neighbours).
    pub pause: Duration,
    pub trials: usize,
    pub trial: Duration,
    pub json: bool,
    /// Only cases whose name contains this (Ray's `TESTS_TO_RUN`; `a|b`: either).
    pub filter: Option<String>,
    /// Leave out cases whose name contains this (Ray's `TESTS_TO_SKIP`).
    pub skip: Option<String>,
}

impl Timing {
    /// The timing the arguments ask for.
    ///
    /// # Errors
    /// `--trials 0`, a `--trial-seconds` that is not a positive number of seconds, or a
    /// `--warmup-sleep` that is negative or not finite, each named with what is expected.
    pub fn from_args(a: &MicrobenchmarkArgs) -> Result<Self> {
        let (pause, trials, trial) = if a.quick { (0.0, 1, 0.5) } else { (10.0, 4, 2.0) };
        let (pause, trials, trial) = (
            a.warmup_sleep.unwrap_or(pause),
            a.trials.unwrap_or(trials),
            a.trial_seconds.unwrap_or(trial),
        );
        if trials == 0 {
            bail!("--trials 0: expected at least 1 timed trial per case");
        }
        if !(trial.is_finite() && trial > 0.0) {
            bail!("--trial-seconds {trial}: expected a positive number of seconds");
        }
        if !(pause.is_finite() && pause >= 0.0) {
            bail!("--warmup-sleep {pause}: expected 0 or more seconds");
        }
        Ok(Timing {
            pause: Duration::from_secs_f64(pause),
            trials,
            trial: Duration::from_secs_f64(trial),
            json: a.json,
            filter: a.filter.clone().or_else(|| std::env::var("TESTS_TO_RUN").ok()),
            skip: a.skip.clone().or_else(|| std::env::var("TESTS_TO_SKIP").ok()),
        }
        .non_empty())
    }

    fn non_empty(mut self) -> Self {
        self.filter = self.filter.filter(|f| !f.is_empty());
        self.skip = self.skip.filter(|s| !s.is_empty());
        self
    }

    /// Whether the filters let the case named `name` run (`a|b`: either pattern).
    pub fn selected(&self, name: &str) -> bool {
        let hit = |patterns: &str| patterns.split('|').any(|p| name.contains(p));
        self.filter.as_deref().is_none_or(hit) && self.skip.as_deref().is_none_or(|s| !hit(s))
    }

    /// Times `f` as Ray's `timeit`: returns (mean, sd) of `multiplier * calls / s`
    /// over the trials, and prints the case; `None` when the filters leave it out.
    ///
    /// # Errors
    /// The first error `f` returns (the case stops there).
    pub fn timeit(
        &self,
        name: &str,
        multiplier: f64,
        f: impl FnMut() -> Result<()>,
    ) -> Result<Option<(f64, f64)>> {
        self.timeit_unit(name, multiplier, "per second", f)
    }

    /// [`Timing::timeit`] with another unit in the JSON (`GB per second`).
    pub fn timeit_unit(
        &self,
        name: &str,
        multiplier: f64,
        unit: &str,
        mut f: impl FnMut() -> Result<()>,
    ) -> Result<Option<(f64, f64)>> {
        if !self.selected(name) {
            return Ok(None);
        }
        std::thread::sleep(self.pause);
        let start = Instant::now();
        let mut count = 0usize;
        while start.elapsed() < Duration::from_secs(1) {
            f().with_context(|| format!("case {name:?}"))?;
            count += 1;
        }
        let step = count / 10 + 1;
        let mut stats = Vec::with_capacity(self.trials);
        for _ in 0..self.trials {
            let start = Instant::now();
            let mut count = 0usize;
            while start.elapsed() < self.trial {
                for _ in 0..step {
                    f().with_context(|| format!("case {name:?}"))?;
                }
                count += step;
            }
            stats.push(multiplier * count as f64 / start.elapsed().as_secs_f64());
        }
        let (mean, sd) = mean_sd(&stats);
        self.report(name, mean, sd, unit);
        Ok(Some((mean, sd)))
    }

    /// Prints one case's figure.
    pub fn report(&self, name: &str, mean: f64, sd: f64, unit: &str) {
        if self.json {
            println!(
                "{}",
                serde_json::json!({ "name": name, "mean": mean, "sd": sd, "unit": unit })
            );
        } else {
            println!("{name} per second {mean:.2} +- {sd:.2}");
        }
    }

    /// Prints a case that cannot run, with why (when the filters select it).
    pub fn skipped(&self, name: &str, reason: &str) {
        if !self.selected(name) {
            return;
        }
        if self.json {
            println!("{}", serde_json::json!({ "name": name, "skipped": reason }));
        } else {
            println!("{name} skipped: {reason}");
        }
    }
}

/// Mean and population standard deviation (numpy's `std`, as Ray reports).
pub fn mean_sd(xs: &[f64]) -> (f64, f64) {
    if xs.is_empty() {
        return (0.0, 0.0);
    }
    let n = xs.len() as f64;
    let mean = xs.iter().sum::<f64>() / n;
    let var = xs.iter().map(|x| (x - mean).powi(2)).sum::<f64>() / n;
    (mean, var.sqrt())
}

/// `tpuray microbenchmark`: the floor, then the Python cases or (`--rust`) the Rust ones.
///
/// # Errors
/// No Python with tpuray installed, a cluster that does not start, or a failed case.
pub fn run(a: MicrobenchmarkArgs) -> Result<i32> {
    let timing = Timing::from_args(&a)?;
    check_build(
        OPTIMIZED,
        debug_build_allowed(a.allow_debug_build, std::env::var(ALLOW_ENV).ok()),
    )?;
    if !a.no_floor {
        let floor_timing =
            Timing { pause: Duration::ZERO, filter: None, skip: None, ..timing.clone() };
        floor::measure(&floor_timing)?;
    }
    if a.rust {
        rust_cases::run(&timing)?;
        return Ok(0);
    }
    run_python(&a, &timing)
}

/// Whether this binary was compiled with optimisations (cargo's release profile).
pub const OPTIMIZED: bool = !cfg!(debug_assertions);

/// Set to `1` to measure a debug build anyway, as `--allow-debug-build` does (the
/// variable every `bench/*` script and the Python package's guard read:
/// `tpuray._private.build.ALLOW_ENV`).
const ALLOW_ENV: &str = "TPURAY_ALLOW_DEBUG_BUILD";

/// Whether a debug build may be measured: `--allow-debug-build`, or [`ALLOW_ENV`]
/// (`env`, its value when set) is `1`.
fn debug_build_allowed(flag: bool, env: Option<String>) -> bool {
    flag || env.as_deref() == Some("1")
}

/// Refuses to measure a debug build (`optimized` false) unless `allow`; then warns.
/// Ray's `ray microbenchmark` warns about the same (`ray._raylet.OPTIMIZED`,
/// `check_optimized_build` in `ray/_private/ray_perf.py`); a debug build here runs the
/// core several times slower, so its figures would be read as tpuray's.
///
/// # Errors
/// A debug build without `--allow-debug-build`, naming the binary and the way out.
fn check_build(optimized: bool, allow: bool) -> Result<()> {
    if optimized {
        return Ok(());
    }
    let exe = std::env::current_exe().map(|p| p.display().to_string()).unwrap_or_default();
    // Under `python -m tpuray` this CLI is the Python package's extension; name the
    // interpreter as the user ran it (current_exe() is the symlink-resolved base one).
    let exe = match python_interpreter(None) {
        p if std::env::var_os("TPURAY_SELF_COMMAND").is_some() => {
            format!("the extension of the tpuray package that {} imports", p.display())
        }
        _ => exe,
    };
    if !allow {
        bail!(
            "refusing to measure a debug build of tpuray ({exe}): its figures would not be \
             tpuray's. Build a release one (`cargo build --release -p tpuray-cli`, or \
             `pip install ./python-sdk` with MATURIN_PEP517_ARGS unset, as ./scripts/demo.sh \
             does), or pass --allow-debug-build (or set {ALLOW_ENV}=1) to measure it anyway"
        );
    }
    eprintln!("tpuray microbenchmark: WARNING: measuring a debug build ({exe})");
    Ok(())
}

/// The Python interpreter that runs the Python cases: `--python`, else the one this CLI
/// runs in (the Python package sets `TPURAY_SELF_COMMAND` to `[python, -m, tpuray]`),
/// else `python3` from `PATH`.
fn python_interpreter(given: Option<&str>) -> PathBuf {
    if let Some(p) = given {
        return PathBuf::from(p);
    }
    if let Ok(j) = std::env::var("TPURAY_SELF_COMMAND")
        && let Ok(v) = serde_json::from_str::<Vec<String>>(&j)
        && v.len() >= 3
        && v[1] == "-m"
        && v[2] == "tpuray"
    {
        return PathBuf::from(&v[0]);
    }
    PathBuf::from("python3")
}

fn run_python(a: &MicrobenchmarkArgs, t: &Timing) -> Result<i32> {
    let python = python_interpreter(a.python.as_deref());
    let check = Command::new(&python)
        .args(["-c", "import tpuray._private.ray_perf"])
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .output()
        .with_context(|| format!("cannot run {}", python.display()))?;
    if !check.status.success() {
        bail!(
            "{} cannot import tpuray._private.ray_perf (pass --python with the interpreter that has tpuray installed, or run `python -m tpuray microbenchmark`):\n{}",
            python.display(),
            String::from_utf8_lossy(&check.stderr).trim()
        );
    }
    let mut cmd = Command::new(&python);
    cmd.args(["-m", "tpuray._private.ray_perf"])
        .env("TPURAY_MICROBENCH_WARMUP_S", t.pause.as_secs_f64().to_string())
        .env("TPURAY_MICROBENCH_TRIALS", t.trials.to_string())
        .env("TPURAY_MICROBENCH_TRIAL_S", t.trial.as_secs_f64().to_string())
        .env("TPURAY_MICROBENCH_JSON", if t.json { "1" } else { "0" })
        .env("TESTS_TO_RUN", t.filter.as_deref().unwrap_or(""))
        .env("TESTS_TO_SKIP", t.skip.as_deref().unwrap_or(""))
        .env_remove("TPURAY_ADDRESS");
    if a.allow_debug_build {
        // The interpreter's extension may be a debug build while this binary is not.
        cmd.env(ALLOW_ENV, "1");
    }
    let status = cmd.status().with_context(|| format!("cannot run {}", python.display()))?;
    Ok(status.code().unwrap_or(1))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_debug_build_is_refused_unless_allowed() {
        assert!(check_build(true, false).is_ok());
        let e = check_build(false, false).unwrap_err().to_string();
        assert!(e.contains("debug build") && e.contains("--allow-debug-build"), "{e}");
        assert!(check_build(false, true).is_ok());
        // TPURAY_ALLOW_DEBUG_BUILD=1 allows it as the flag does; other values do not.
        assert!(debug_build_allowed(true, None));
        assert!(debug_build_allowed(false, Some("1".into())));
        for other in [None, Some("0".into()), Some("yes".into()), Some(String::new())] {
            assert!(!debug_build_allowed(false, other.clone()), "{other:?}");
        }
    }

    #[test]
    fn bad_trial_counts_and_durations_are_refused_with_what_was_expected() {
        let err = |a: MicrobenchmarkArgs| Timing::from_args(&a).unwrap_err().to_string();
        let e = err(MicrobenchmarkArgs { trials: Some(0), ..Default::default() });
        assert!(e.contains("--trials 0") && e.contains("at least 1"), "{e}");
        for bad in [0.0, -1.0, f64::NAN, f64::INFINITY] {
            let e = err(MicrobenchmarkArgs { trial_seconds: Some(bad), ..Default::default() });
            assert!(e.contains("--trial-seconds") && e.contains("positive"), "{e}");
        }
        let e = err(MicrobenchmarkArgs { warmup_sleep: Some(-0.5), ..Default::default() });
        assert!(e.contains("--warmup-sleep -0.5") && e.contains("0 or more"), "{e}");
        let t = Timing::from_args(&MicrobenchmarkArgs {
            trials: Some(2),
            trial_seconds: Some(0.25),
            warmup_sleep: Some(0.0),
            ..Default::default()
        })
        .unwrap();
        assert_eq!((t.trials, t.trial, t.pause), (2, Duration::from_millis(250), Duration::ZERO));
    }

    fn timing(filter: Option<&str>, skip: Option<&str>) -> Timing {
        Timing {
            pause: Duration::ZERO,
            trials: 1,
            trial: Duration::from_millis(10),
            json: true,
            filter: filter.map(String::from),
            skip: skip.map(String::from),
        }
    }

    #[test]
    fn filters_match_substrings_and_bar_separated_alternatives() {
        let t = timing(Some("tasks sync|1:1 actor"), Some("concurrent"));
        assert!(t.selected("single client tasks sync"));
        assert!(t.selected("1:1 actor calls async"));
        assert!(!t.selected("1:1 actor calls concurrent"));
        assert!(!t.selected("single client put calls (Plasma Store)"));
        assert!(timing(None, None).selected("anything"));
    }

    #[test]
    fn mean_and_sd_are_numpys_population_figures() {
        let (m, sd) = mean_sd(&[1.0, 2.0, 3.0, 4.0]);
        assert_eq!(m, 2.5);
        assert!((sd - 1.118_033_988_7).abs() < 1e-9);
        assert_eq!(mean_sd(&[]), (0.0, 0.0));
    }

    #[test]
    fn timeit_counts_calls_times_the_multiplier() {
        let t = timing(None, None);
        let mut calls = 0u64;
        let (mean, _) = t
            .timeit("case", 10.0, || {
                calls += 1;
                std::thread::sleep(Duration::from_millis(1));
                Ok(())
            })
            .unwrap()
            .unwrap();
        // About 1 ms a call: roughly 10 000 operations a second, never more.
        assert!(mean > 1000.0 && mean <= 10_000.0, "{mean}");
        assert!(t.timeit("skipped case", 1.0, || Ok(())).is_ok());
        assert_eq!(timing(Some("x"), None).timeit("case", 1.0, || Ok(())).unwrap(), None);
    }
}
