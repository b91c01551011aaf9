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

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};

use tpuray_proto::packages::{self, PACKAGES_NAMESPACE};
use tpuray_proto::runtime_env::{JobRuntimeEnv, PACKAGE_SCHEME, PipSpec, UvSpec};

/// How much of an installer's output a failure message carries.
const OUTPUT_TAIL: usize = 4000;
/// The marker a finished venv gets (a venv without it is half made and is rebuilt).
const READY: &str = ".tpuray-ready";

/// The kinds of cached directories, each with its own size limit.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Kind {
    WorkingDir,
    PyModules,
    Pip,
    Uv,
}

impl Kind {
    /// Ray's name of the plugin, as in `RAY_RUNTIME_ENV_<NAME>_CACHE_SIZE_GB`.
    pub fn name(self) -> &'static str {
        match self {
            Kind::WorkingDir => "working_dir",
            Kind::PyModules => "py_modules",
            Kind::Pip => "pip",
            Kind::Uv => "uv",
        }
    }

    /// The size limit of this kind's unused directories, in bytes (Ray's variable, in
    /// GB, default 10).
    pub fn limit_from_env(self) -> u64 {
        let var = format!("RAY_RUNTIME_ENV_{}_CACHE_SIZE_GB", self.name().to_uppercase());
        let gb = std::env::var(&var)
            .ok()
            .and_then(|v| v.trim().parse::<f64>().ok())
            .filter(|g| g.is_finite() && *g >= 0.0)
            .unwrap_or(10.0);
        (gb * 1024.0 * 1024.0 * 1024.0) as u64
    }
}

struct CacheEntry {
    kind: Kind,
    size: u64,
    users: usize,
    last_used: u64,
}

/// AGENT-15: the built directories of one node, counted by their users (a pure
/// structure: the caller deletes what [`UriCache::release`] returns).
pub struct UriCache {
    entries: HashMap<PathBuf, CacheEntry>,
    limits: HashMap<Kind, u64>,
    clock: u64,
}

impl UriCache {
    /// A cache with `limits` per kind (kinds left out have no limit).
    pub fn new(limits: HashMap<Kind, u64>) -> Self {
        Self { entries: HashMap::new(), limits, clock: 0 }
    }

    /// Counts one more user of `dir` if it is cached; false when it is not (build it).
    pub fn use_existing(&mut self, dir: &Path) -> bool {
        self.clock += 1;
        match self.entries.get_mut(dir) {
            Some(e) => {
                e.users += 1;
                e.last_used = self.clock;
                true
            }
            None => false,
        }
    }

    /// Adds a directory just built, with its first user.
    pub fn add(&mut self, dir: PathBuf, kind: Kind, size: u64) {
        self.clock += 1;
        self.entries.insert(dir, CacheEntry { kind, size, users: 1, last_used: self.clock });
    }

    /// One user of `dir` is done; returns the directories to delete now (unused ones of
    /// its kind, least recently used first, while the kind's total passes its limit).
    /// They are no longer in the cache.
    pub fn release(&mut self, dir: &Path) -> Vec<PathBuf> {
        let Some(e) = self.entries.get_mut(dir) else {
            return Vec::new();
        };
        e.users = e.users.saturating_sub(1);
        let kind = e.kind;
        let Some(&limit) = self.limits.get(&kind) else {
            return Vec::new();
        };
        let mut total: u64 = self.entries.values().filter(|e| e.kind == kind).map(|e| e.size).sum();
        let mut unused: Vec<(u64, PathBuf, u64)> = self
            .entries
            .iter()
            .filter(|(_, e)| e.kind == kind && e.users == 0)
            .map(|(p, e)| (e.last_used, p.clone(), e.size))
            .collect();
        unused.sort();
        let mut out = Vec::new();
        for (_, p, size) in unused {
            if total <= limit {
                break;
            }
            total -= size;
            self.entries.remove(&p);
            out.push(p);
        }
        out
    }

    /// Users of `dir` now (0 when it is not cached).
    pub fn users(&self, dir: &Path) -> usize {
        self.entries.get(dir).map_or(0, |e| e.users)
    }
}

/// The directories one process uses (AGENT-15); dropping it releases them and deletes
/// what the cache gives up.
pub struct EnvUses {
    cache: Arc<Mutex<UriCache>>,
    dirs: Vec<PathBuf>,
}

impl EnvUses {
    /// The directories held.
    pub fn dirs(&self) -> &[PathBuf] {
        &self.dirs
    }
}

impl std::fmt::Debug for EnvUses {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("EnvUses").field("dirs", &self.dirs).finish()
    }
}

impl Drop for EnvUses {
    fn drop(&mut self) {
        let mut gone = Vec::new();
        {
            let mut c = self.cache.lock().unwrap_or_else(|p| p.into_inner());
            for d in self.dirs.drain(..) {
                gone.extend(c.release(&d));
            }
            // Renamed under the lock, so a build of the same environment starting now
            // finds nothing there (it is no longer cached) and makes a fresh one.
            gone = gone.into_iter().filter_map(|d| trash(&d)).collect();
        }
        if !gone.is_empty() {
            std::thread::spawn(move || {
                for d in gone {
                    let _ = std::fs::remove_dir_all(&d);
                }
            });
        }
    }
}

/// Moves `dir` aside for deletion (`None`: nothing there).
fn trash(dir: &Path) -> Option<PathBuf> {
    let name = dir.file_name()?.to_string_lossy().into_owned();
    let t = dir.with_file_name(format!(".trash-{name}-{}", tpuray_proto::ids::WorkerId::random()));
    std::fs::rename(dir, &t).ok().map(|_| {
        tracing::info!(dir = %dir.display(), "removed an unused runtime environment (cache over its limit)");
        t
    })
}

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

    /// A package unpacked (cached) into `dir`.
    async fn unpacked(
        &self,
        src: &Source<'_>,
        uri: &str,
        dir: PathBuf,
        kind: Kind,
        uses: &mut EnvUses,
    ) -> Result<PathBuf, String> {
        let lock = self.lock_for(&dir);
        let _held = lock.lock().await;
        if self.cache().use_existing(&dir) {
            uses.dirs.push(dir.clone());
            return Ok(dir);
        }
        let _ = std::fs::remove_dir_all(&dir); // left from before, not counted: rebuild
        let bytes = src.fetch(uri, kind.name()).await?;
        let parent = dir.parent().map(Path::to_path_buf).unwrap_or_default();
        let d = dir.clone();
        let what = kind.name();
        let size = tokio::task::spawn_blocking(move || {
            unpack(&bytes, &parent, &d, what).map(|_| dir_size(&d))
        })
        .await
        .map_err(|e| format!("unpacking {uri}: {e}"))??;
        self.cache().add(dir.clone(), kind, size);
        uses.dirs.push(dir.clone());
        Ok(dir)
    }

    async fn working_dir(
        &self,
        src: &Source<'_>,
        root: &Path,
        uri: &str,
        uses: &mut EnvUses,
    ) -> Result<PathBuf, String> {
        let dir = root.join("working_dir_files").join(package_stem(uri));
        self.unpacked(src, uri, dir, Kind::WorkingDir, uses).await
    }

    /// A `py_modules` entry: a zipped folder unpacked (its folder inside, so the
    /// returned directory goes on the path), or a wheel installed with
    /// `pip install --target` into its own directory.
    async fn py_module(
        &self,
        src: &Source<'_>,
        root: &Path,
        uri: &str,
        log: &Path,
        uses: &mut EnvUses,
    ) -> Result<PathBuf, String> {
        let base = root.join("py_modules_files");
        let dir = base.join(package_stem(uri));
        if !uri.ends_with(".whl") {
            return self.unpacked(src, uri, dir, Kind::PyModules, uses).await;
        }
        let lock = self.lock_for(&dir);
        let _held = lock.lock().await;
        if self.cache().use_existing(&dir) {
            uses.dirs.push(dir.clone());
            return Ok(dir);
        }
        let _ = std::fs::remove_dir_all(&dir);
        let bytes = src.fetch(uri, "py_modules").await?;
        std::fs::create_dir_all(&base).map_err(|e| format!("{}: {e}", base.display()))?;
        // pip wants the wheel's own file name (it reads name and version from it).
        let name = uri.strip_prefix(PACKAGE_SCHEME).unwrap_or(uri);
        let tmp = base.join(format!(".wheel-{}", tpuray_proto::ids::WorkerId::random()));
        let wheel = tmp.join(name);
        std::fs::create_dir_all(&tmp).map_err(|e| format!("{}: {e}", tmp.display()))?;
        std::fs::write(&wheel, &bytes).map_err(|e| format!("{}: {e}", wheel.display()))?;
        let argv = vec![
            base_python(),
            "-m".into(),
            "pip".into(),
            "install".into(),
            "--no-input".into(),
            format!("--target={}", dir.display()),
            wheel.display().to_string(),
        ];
        let r = run_logged(&argv, log).await;
        let _ = std::fs::remove_dir_all(&tmp);
        if let Err(e) = r {
            let _ = std::fs::remove_dir_all(&dir);
            return Err(format!("installing the py_modules wheel {name}: {e}"));
        }
        self.cache().add(dir.clone(), Kind::PyModules, dir_size(&dir));
        uses.dirs.push(dir.clone());
        Ok(dir)
    }

    async fn venv(
        &self,
        root: &Path,
        installer: Installer<'_>,
        log: &Path,
        uses: &mut EnvUses,
    ) -> Result<PathBuf, String> {
        let (kind, hash) = match installer {
            Installer::Pip(p) => (Kind::Pip, p.hash()),
            Installer::Uv(u) => (Kind::Uv, u.hash()),
        };
        let dir = root.join(kind.name()).join(hash);
        let lock = self.lock_for(&dir);
        let _held = lock.lock().await;
        if self.cache().use_existing(&dir) && dir.join(READY).exists() {
            uses.dirs.push(dir.clone());
            return Ok(dir);
        }
        let _ = std::fs::remove_dir_all(&dir); // a build that did not finish
        // Dropped on a timeout: the installer is killed (kill_on_drop) and the half-made
        // directory is removed by the next build, which finds no READY marker.
        let built = match installer {
            Installer::Pip(p) => build_pip_env(&dir, p, log).await,
            Installer::Uv(u) => build_uv_env(&dir, u, log).await,
        };
        if let Err(e) = built {
            let _ = std::fs::remove_dir_all(&dir);
            return Err(e);
        }
        let ready = dir.join(READY);
        std::fs::write(&ready, b"").map_err(|e| format!("{}: {e}", ready.display()))?;
        let d = dir.clone();
        let size = tokio::task::spawn_blocking(move || dir_size(&d)).await.unwrap_or(0);
        self.cache().add(dir.clone(), kind, size);
        uses.dirs.push(dir.clone());
        Ok(dir)
    }
}

#[derive(Clone, Copy)]
enum Installer<'a> {
    Pip(&'a PipSpec),
    Uv(&'a UvSpec),
}

/// `gcs://_ray_pkg_abc.zip` -> `_ray_pkg_abc` (a wheel keeps its full name minus `.whl`).
fn package_stem(uri: &str) -> String {
    let name = uri.strip_prefix(PACKAGE_SCHEME).unwrap_or(uri);
    name.strip_suffix(".zip").or_else(|| name.strip_suffix(".whl")).unwrap_or(name).to_string()
}

/// Bytes of the files under `dir` (links not followed).
fn dir_size(dir: &Path) -> u64 {
    let mut total = 0;
    let mut stack = vec![dir.to_path_buf()];
    while let Some(d) = stack.pop() {
        let Ok(rd) = std::fs::read_dir(&d) else { continue };
        for e in rd.flatten() {
            match e.file_type() {
                Ok(t) if t.is_dir() => stack.push(e.path()),
                Ok(t) if t.is_file() => total += e.metadata().map(|m| m.len()).unwrap_or(0),
                _ => {}
            }
        }
    }
    total
}

/// Unzips `bytes` into `dir` (through a temporary sibling, renamed at the end), refusing
/// entries that would land outside it.
fn unpack(bytes: &[u8], parent: &Path, dir: &Path, what: &str) -> Result<(), String> {
    std::fs::create_dir_all(parent).map_err(|e| format!("{}: {e}", parent.display()))?;
    let tmp = parent.join(format!(".unpack-{}", tpuray_proto::ids::WorkerId::random()));
    let result = (|| {
        let mut zip = zip::ZipArchive::new(std::io::Cursor::new(bytes))
            .map_err(|e| format!("the {what} package is not a zip file: {e}"))?;
        zip.extract(&tmp).map_err(|e| format!("unpacking the {what} package: {e}"))
    })();
    if let Err(e) = result {
        let _ = std::fs::remove_dir_all(&tmp);
        return Err(e);
    }
    if let Err(e) = std::fs::rename(&tmp, dir) {
        let _ = std::fs::remove_dir_all(&tmp);
        if !dir.is_dir() {
            return Err(format!("{}: {e}", dir.display()));
        }
    }
    Ok(())
}

/// The interpreter tpuray runs in: the first word of the agent's `TPURAY_SELF_COMMAND`
/// when that is a Python (`python -m tpuray`), else `python3` from `PATH`.
pub fn base_python() -> String {
    std::env::var("TPURAY_SELF_COMMAND")
        .ok()
        .and_then(|v| serde_json::from_str::<Vec<String>>(&v).ok())
        .and_then(|argv| argv.into_iter().next())
        .filter(|p| {
            Path::new(p)
                .file_name()
                .and_then(|n| n.to_str())
                .is_some_and(|n| n.starts_with("python"))
        })
        .unwrap_or_else(|| "python3".into())
}

/// The `uv` executable: next to the interpreter `python` (its folder as given, links not
/// resolved, so a venv's `bin/`), else the first on `PATH`.
///
/// # Errors
/// A message naming both places and how to get uv.
pub fn find_uv(python: &str) -> Result<PathBuf, String> {
    find_uv_in(python, &std::env::var_os("PATH").unwrap_or_default())
}

fn find_uv_in(python: &str, path: &std::ffi::OsStr) -> Result<PathBuf, String> {
    let py = Path::new(python);
    let beside = py.parent().filter(|p| !p.as_os_str().is_empty()).map(|p| p.join("uv"));
    beside
        .into_iter()
        .chain(std::env::split_paths(path).map(|d| d.join("uv")))
        .find(|c| c.is_file())
        .ok_or_else(|| {
            format!(
                "runtime_env['uv'] needs the uv executable, found neither next to the interpreter \
                 {python} nor on PATH; install it on every node (`pip install uv`, \
                 https://docs.astral.sh/uv/) or use runtime_env['pip']"
            )
        })
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

/// Makes the venv at `dir` (without pip when `without_pip`) with the base's
/// site-packages after its own; returns the venv's interpreter.
async fn make_venv(dir: &Path, without_pip: bool, log: &Path) -> Result<String, String> {
    if let Some(p) = dir.parent() {
        std::fs::create_dir_all(p).map_err(|e| format!("{}: {e}", p.display()))?;
    }
    let base = base_python();
    let d = dir.display().to_string();
    let mut venv = vec![base.clone(), "-m".into(), "venv".into()];
    if without_pip {
        venv.push("--without-pip".into());
    }
    venv.push(d.clone());
    run_logged(&venv, log).await?;
    // The base interpreter's site-packages, after the venv's own (a .pth file).
    let out = tokio::process::Command::new(&base)
        .args([
            "-c",
            "import site, sys; print('\\n'.join([p for p in site.getsitepackages() + [site.getusersitepackages()] if p]))",
        ])
        .output()
        .await
        .map_err(|e| format!("cannot run {base}: {e}"))?;
    // `site.addsitedir` lines, not bare paths: the base's own .pth files (an editable
    // install of tpuray, for one) are processed too, which a bare path line skips.
    let base_paths: String = String::from_utf8_lossy(&out.stdout)
        .lines()
        .map(str::trim)
        .filter(|p| !p.is_empty())
        .map(|p| format!("import site; site.addsitedir({})\n", serde_json::Value::from(p)))
        .collect();
    let venv_site = std::fs::read_dir(dir.join("lib"))
        .map_err(|e| format!("{}: {e}", dir.join("lib").display()))?
        .filter_map(Result::ok)
        .map(|e| e.path().join("site-packages"))
        .find(|p| p.is_dir())
        .ok_or_else(|| format!("the new venv {d} has no lib/python*/site-packages"))?;
    std::fs::write(venv_site.join("_tpuray_base_env.pth"), base_paths)
        .map_err(|e| format!("{}: {e}", venv_site.display()))?;
    Ok(dir.join("bin").join("python").display().to_string())
}

/// Whether the base interpreter's pip can install into another interpreter
/// (`pip --python`, pip >= 22.3).
async fn base_pip_installs_elsewhere(base: &str) -> bool {
    tokio::process::Command::new(base)
        .args(["-m", "pip", "--python", base, "--version"])
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::null())
        .status()
        .await
        .is_ok_and(|s| s.success())
}

async fn build_pip_env(dir: &Path, pip: &PipSpec, log: &Path) -> Result<(), String> {
    let base = base_python();
    // Without pip of its own (ensurepip costs about 2 s): the base's pip installs into
    // it, unless a pip version is asked for.
    let base_pip = pip.pip_version.is_none() && base_pip_installs_elsewhere(&base).await;
    let python = make_venv(dir, base_pip, log).await?;
    let pip_cmd = |args: &[&str]| -> Vec<String> {
        let mut v = if base_pip {
            vec![base.clone(), "-m".into(), "pip".into(), "--python".into(), python.clone()]
        } else {
            vec![python.clone(), "-m".into(), "pip".into()]
        };
        v.extend(args.iter().map(|s| s.to_string()));
        v
    };
    if let Some(version) = &pip.pip_version {
        run_logged(&pip_cmd(&["install", &format!("pip{version}")]), log).await?;
    }
    let mut install = pip_cmd(&["install"]);
    install.extend(pip.install_options.iter().cloned());
    install.extend(pip.packages.iter().cloned());
    run_logged(&install, log).await?;
    if pip.pip_check {
        run_logged(&pip_cmd(&["check"]), log).await?;
    }
    Ok(())
}

/// A uv environment (Ray's `uv.py`): `uv pip install` of the packages with
/// `uv_pip_install_options` (Ray's default `--no-cache`), then `uv pip check` when
/// `uv_check` asks.
async fn build_uv_env(dir: &Path, uv: &UvSpec, log: &Path) -> Result<(), String> {
    let base = base_python();
    let uv_exe = match &uv.uv_version {
        // The uv asked for, installed into the venv (as Ray does).
        Some(_) => None,
        None => Some(find_uv(&base)?),
    };
    let python = make_venv(dir, uv.uv_version.is_none(), log).await?;
    let uv_exe = match (uv_exe, &uv.uv_version) {
        (Some(u), _) => u.display().to_string(),
        (None, Some(version)) => {
            run_logged(
                &[
                    python.clone(),
                    "-m".into(),
                    "pip".into(),
                    "install".into(),
                    format!("uv{version}"),
                ],
                log,
            )
            .await?;
            dir.join("bin").join("uv").display().to_string()
        }
        (None, None) => unreachable!("uv_exe is found when no uv_version is given"),
    };
    let mut install =
        vec![uv_exe.clone(), "pip".into(), "install".into(), "--python".into(), python.clone()];
    install.extend(uv.options());
    install.extend(uv.packages.iter().cloned());
    run_logged(&install, log).await?;
    if uv.uv_check {
        run_logged(&[uv_exe, "pip".into(), "check".into(), "--python".into(), python], log).await?;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn cache(limit: u64) -> UriCache {
        UriCache::new([(Kind::Pip, limit)].into_iter().collect())
    }

    #[test]
    fn agent_15_an_environment_in_use_is_never_removed_and_unused_ones_go_oldest_first() {
        let mut c = cache(100);
        let (a, b, d) =
            (PathBuf::from("/r/pip/a"), PathBuf::from("/r/pip/b"), PathBuf::from("/r/pip/d"));
        c.add(a.clone(), Kind::Pip, 60);
        c.add(b.clone(), Kind::Pip, 60);
        assert!(c.use_existing(&a));
        assert_eq!(c.users(&a), 2);
        // b unused, total 120 > 100: b goes, a stays (in use).
        assert_eq!(c.release(&b), vec![b.clone()]);
        assert!(!c.use_existing(&b));
        assert_eq!(c.release(&a), Vec::<PathBuf>::new(), "one user left");
        assert_eq!(c.release(&a), Vec::<PathBuf>::new(), "60 fits in 100");
        c.add(d.clone(), Kind::Pip, 60);
        // a (unused, older) goes when d is released and 120 passes the limit.
        assert_eq!(c.release(&d), vec![a.clone()]);
        assert_eq!(c.users(&d), 0);
        assert!(c.use_existing(&d), "d stays cached for reuse");
    }

    #[test]
    fn agent_15_kinds_have_their_own_limits_and_unknown_dirs_release_nothing() {
        let mut c = cache(0);
        c.add(PathBuf::from("/w"), Kind::WorkingDir, 1 << 40);
        assert!(c.release(Path::new("/w")).is_empty(), "working_dir has no limit here");
        assert!(c.release(Path::new("/nowhere")).is_empty());
        c.add(PathBuf::from("/p"), Kind::Pip, 1);
        assert_eq!(c.release(Path::new("/p")), vec![PathBuf::from("/p")]);
    }

    #[test]
    fn uv_is_found_beside_the_interpreter_first_and_refused_by_name_when_absent() {
        let d = std::env::temp_dir().join(format!("tpuray-uv-{}", std::process::id()));
        std::fs::create_dir_all(&d).unwrap();
        std::fs::write(d.join("uv"), b"").unwrap();
        let py = d.join("python").display().to_string();
        assert_eq!(find_uv(&py).unwrap(), d.join("uv"));
        std::fs::remove_dir_all(&d).unwrap();
        // With nothing beside it nor on PATH, the error names uv and where it looked.
        let e = find_uv_in("/nonexistent/bin/python", std::ffi::OsStr::new("/nonexistent/x"))
            .unwrap_err();
        assert!(e.contains("uv executable") && e.contains("/nonexistent/bin/python"), "{e}");
    }

    #[test]
    fn package_stems_name_cache_folders() {
        assert_eq!(package_stem("gcs://_ray_pkg_ab12.zip"), "_ray_pkg_ab12");
        assert_eq!(package_stem("gcs://m-1.0-py3-none-any.whl"), "m-1.0-py3-none-any");
    }
}
