//! Runtime environments a node agent builds for jobs, tasks and actors (AGENT-13):
//! `working_dir` and `py_modules` packages unpacked once per node, `pip` and `uv`
//! virtual environments made once per node, all cached by content under
//! `<session>/runtime_resources/` (Ray's layout: `working_dir_files/`,
//! `py_modules_files/`, `pip/`, `uv/`).
//!
//! A pip or uv environment is a venv of the interpreter tpuray runs in (the one in the
//! agent's `TPURAY_SELF_COMMAND`, else `python3`), with a `.pth` file naming that
//! interpreter's site-packages, so tpuray and what the base environment has stay
//! importable even when the base is itself a venv; packages installed into the new venv
//! come first. pip installs with the base's pip when it can (`pip --python`, which saves
//! `ensurepip`'s 2 s) unless `pip_version` asks for one; uv is the `uv` executable next
//! to the base interpreter or on `PATH` (or the `uv_version` asked for, pip-installed
//! into the venv, as Ray does), refused by name when there is none. A `py_modules` wheel
//! is installed with `pip install --target` (Ray's `install_wheel_package`).
//!
//! AGENT-14: the whole setup of one environment runs within its
//! `setup_timeout_seconds`; a failed or timed-out build removes what it half made and
//! fails with the installer's own output (the tail of its log). Nothing here panics on
//! bad input; the agent answers the failure and goes on.
//!
//! AGENT-15 (the cache, [`UriCache`], Ray's `uri_cache.py`): every built directory is
//! counted by the processes that use it (a worker from its start until it exits, a job's
//! entrypoint while it runs). A directory nobody uses stays for reuse until its kind's
//! total size passes `RAY_RUNTIME_ENV_<KIND>_CACHE_SIZE_GB` (Ray's variables, default
//! 10 GB; `KIND` is `WORKING_DIR`, `PY_MODULES`, `PIP` or `UV`); then unused ones are
//! removed, least recently used first, until it fits. A directory in use is never removed.
//!
//! Blocking: `prepare` needs a tokio runtime (it runs installers as child processes and
//! unpacks on the blocking pool); the cache's methods take a short lock and never block
//! on I/O beyond a `rename` (removal happens on a thread of its own).
//!
//! Here: what a built environment gives a process ([`Prepared`]), the [`Builder`] and its
//! `prepare` (AGENT-14's timeout), and the installers' logged runs. By seam: `cache.rs`
//! (AGENT-15: [`UriCache`], [`EnvUses`]), `package_files.rs` (`working_dir` and
//! `py_modules` packages fetched and unpacked or installed) and `venv.rs` (pip and uv
//! virtual environments).
//!
//! AGENT-13's packages are `gcs://` URIs in the KV's `packages` namespace. A uv venv uses
//! Ray's default `uv_pip_install_options` (`--no-cache`).
//!
//! AGENT-14's consequences: `setup_timeout_seconds` defaults to 600 (`-1`: none). A
//! failed setup answers a lease `SetupFailed` with the installer's output (never an RPC
//! error, which owners retry): the owner fails the tasks waiting for that environment
//! with `RUNTIME_ENV_SETUP_FAILED` (Python: `RuntimeEnvSetupError` at `get`), an actor
//! dies with the message (its calls raise `RuntimeEnvSetupError`), a job ends `FAILED`
//! with `RUNTIME_ENV_SETUP_FAILURE`. The agent itself carries on.

mod cache;
mod package_files;
mod venv;

pub use cache::{EnvUses, Kind, UriCache};
pub use venv::{base_python, find_uv};

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};

use tpuray_proto::packages::{self, PACKAGES_NAMESPACE};
use tpuray_proto::runtime_env::JobRuntimeEnv;

use venv::Installer;

/// How much of an installer's output a failure message carries.
const OUTPUT_TAIL: usize = 4000;

/// What a built environment changes for a process started in it.
#[derive(Debug, Default)]
pub struct Prepared {
    /// The unpacked `working_dir`: the process's working directory and first on its path.
    pub working_dir: Option<PathBuf>,
    /// The unpacked or installed `py_modules`, in order, on the path after `working_dir`.
    pub py_modules: Vec<PathBuf>,
    /// The pip or uv environment's root (`bin/python`, `bin` first on `PATH`).
    pub venv: Option<PathBuf>,
    /// The cache entries this environment holds while a process uses it.
    pub uses: Option<EnvUses>,
}

impl Prepared {
    /// The venv's interpreter, when there is a venv.
    pub fn python(&self) -> Option<PathBuf> {
        self.venv.as_ref().map(|v| v.join("bin").join("python"))
    }

    /// The folders a Python process puts first on its path (`working_dir`, then
    /// `py_modules`, Ray's order).
    pub fn python_path(&self) -> Vec<String> {
        self.working_dir
            .iter()
            .chain(self.py_modules.iter())
            .map(|d| d.display().to_string())
            .collect()
    }

    /// Environment variables for a process started in this environment (`PATH` with the
    /// venv's `bin` first, `VIRTUAL_ENV`).
    pub fn env(&self) -> Vec<(String, String)> {
        let mut out = Vec::new();
        if let Some(v) = &self.venv {
            let path = std::env::var("PATH").unwrap_or_default();
            out.push(("PATH".into(), format!("{}:{path}", v.join("bin").display())));
            out.push(("VIRTUAL_ENV".into(), v.display().to_string()));
        }
        out
    }
}

/// Builds environments on one node; one build per directory at a time.
pub struct Builder {
    locks: Mutex<HashMap<String, Arc<tokio::sync::Mutex<()>>>>,
    cache: Arc<Mutex<UriCache>>,
}

impl Default for Builder {
    fn default() -> Self {
        let limits = [Kind::WorkingDir, Kind::PyModules, Kind::Pip, Kind::Uv]
            .into_iter()
            .map(|k| (k, k.limit_from_env()))
            .collect();
        Self { locks: Default::default(), cache: Arc::new(Mutex::new(UriCache::new(limits))) }
    }
}

/// Where a package's bytes come from.
struct Source<'a> {
    head_address: &'a str,
    token: Option<&'a str>,
}

impl Source<'_> {
    async fn fetch(&self, uri: &str, what: &str) -> Result<Vec<u8>, String> {
        let mut head =
            tpuray_proto::client::head(self.head_address, self.token).map_err(|e| e.to_string())?;
        packages::get(&mut head, PACKAGES_NAMESPACE, uri)
            .await?
            .ok_or_else(|| format!("{what} package {uri} is not in the cluster"))
    }
}

impl Builder {
    fn lock_for(&self, dir: &Path) -> Arc<tokio::sync::Mutex<()>> {
        let mut m = self.locks.lock().unwrap_or_else(|p| p.into_inner());
        Arc::clone(m.entry(dir.display().to_string()).or_default())
    }

    fn cache(&self) -> std::sync::MutexGuard<'_, UriCache> {
        self.cache.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Users of the cached directory `dir` now (AGENT-15; 0 when not cached).
    pub fn users(&self, dir: &Path) -> usize {
        self.cache().users(dir)
    }

    /// Builds (or finds cached) what `env` needs on this node, within its
    /// `setup_timeout_seconds` (AGENT-14). Setup output goes to `log` (appended). The
    /// result holds its cache entries until it (its `uses`) is dropped.
    ///
    /// # Errors
    /// A message for the caller's error: the package that could not be fetched or
    /// unpacked, a missing `uv`, or the installer's output when an install failed or ran
    /// past the timeout.
    pub async fn prepare(
        &self,
        head_address: &str,
        token: Option<&str>,
        root: &Path,
        env: &JobRuntimeEnv,
        log: &Path,
    ) -> Result<Prepared, String> {
        let mut uses = EnvUses { cache: Arc::clone(&self.cache), dirs: Vec::new() };
        let mut out = Prepared::default();
        if !env.needs_build() {
            return Ok(out);
        }
        let src = Source { head_address, token };
        // The log may be shared with other builds: a timeout quotes what came after this.
        let log_start = std::fs::metadata(log).map(|m| m.len()).unwrap_or(0);
        let build = async {
            if let Some(uri) = &env.working_dir {
                let dir = self.working_dir(&src, root, uri, &mut uses).await?;
                out.working_dir = Some(dir);
            }
            for uri in &env.py_modules {
                let dir = self.py_module(&src, root, uri, log, &mut uses).await?;
                out.py_modules.push(dir);
            }
            if let Some(pip) = &env.pip {
                out.venv = Some(self.venv(root, Installer::Pip(pip), log, &mut uses).await?);
            } else if let Some(uv) = &env.uv {
                out.venv = Some(self.venv(root, Installer::Uv(uv), log, &mut uses).await?);
            }
            Ok::<(), String>(())
        };
        let result = match env.setup_timeout {
            Some(t) => tokio::time::timeout(t, build).await.unwrap_or_else(|_| {
                Err(format!(
                    "the runtime environment was not ready within setup_timeout_seconds = {} \
                     (runtime_env config); output so far: {}",
                    t.as_secs_f64(),
                    tail_from(log, log_start)
                ))
            }),
            None => build.await,
        };
        // On an error, `uses` drops here and gives back what was taken.
        result?;
        out.uses = Some(uses);
        Ok(out)
    }
}

async fn run_logged(argv: &[String], log: &Path) -> Result<(), String> {
    use std::io::Write;
    let open = || {
        std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(log)
            .map_err(|e| format!("{}: {e}", log.display()))
    };
    let mut f = open()?;
    let _ = writeln!(f, "$ {}", argv.join(" "));
    let start = f.metadata().map(|m| m.len()).unwrap_or(0);
    let status = tokio::process::Command::new(&argv[0])
        .args(&argv[1..])
        .stdin(std::process::Stdio::null())
        .stdout(open()?)
        .stderr(open()?)
        .env("PIP_DISABLE_PIP_VERSION_CHECK", "1")
        .env("PIP_NO_INPUT", "1")
        .env("UV_NO_PROGRESS", "1")
        .env_remove("VIRTUAL_ENV")
        .kill_on_drop(true)
        .status()
        .await
        .map_err(|e| format!("cannot run {}: {e}", argv[0]))?;
    if status.success() {
        Ok(())
    } else {
        Err(format!(
            "`{}` failed ({status}):\n{}",
            argv.iter().take(5).cloned().collect::<Vec<_>>().join(" "),
            tail_from(log, start)
        ))
    }
}

/// The last [`OUTPUT_TAIL`] bytes of `log` after byte `start` (this command's output).
fn tail_from(log: &Path, start: u64) -> String {
    let text =
        std::fs::read(log).map(|b| String::from_utf8_lossy(&b).into_owned()).unwrap_or_default();
    let mut from = (start as usize).min(text.len()).max(text.len().saturating_sub(OUTPUT_TAIL));
    while !text.is_char_boundary(from) {
        from += 1;
    }
    text[from..].trim().to_string()
}
