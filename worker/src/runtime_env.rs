//! Runtime environments a node agent builds for Jobs API jobs and their workers
//! (AGENT-13): `working_dir` packages unpacked once per node and `pip` virtual
//! environments made once per node and cached by the environment's hash, under
//! `<session>/runtime_resources/` (Ray's layout: `working_dir_files/`, `pip/`).
//!
//! A pip environment is a venv of the interpreter tpuray runs in (the one in the agent's
//! `TPURAY_SELF_COMMAND`, else `python3`), with a `.pth` file naming that interpreter's
//! site-packages, so tpuray and what the base environment has stay importable even when
//! the base is itself a venv; packages installed into the new venv come first.
//! A failed install removes the half-made environment and fails with pip's own output.
//! The venv is made without a pip of its own when the base's pip can install into it
//! (`pip --python`), which saves `ensurepip`'s 2 s, unless `pip_version` asks for one.

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use tpuray_proto::packages::{self, PACKAGES_NAMESPACE};
use tpuray_proto::runtime_env::{JobRuntimeEnv, PACKAGE_SCHEME, PipSpec};

/// Ray's default `setup_timeout_seconds`.
pub const DEFAULT_SETUP_TIMEOUT: Duration = Duration::from_secs(600);
/// How much of pip's output a failure message carries.
const PIP_OUTPUT_TAIL: usize = 4000;

/// What a built environment changes for a process started in it.
#[derive(Clone, Debug, Default)]
pub struct Prepared {
    /// The unpacked `working_dir`: the process's working directory and first on its path.
    pub working_dir: Option<PathBuf>,
    /// The pip environment's root (`bin/python`, `bin` first on `PATH`).
    pub venv: Option<PathBuf>,
}

impl Prepared {
    /// The venv's interpreter, when there is a venv.
    pub fn python(&self) -> Option<PathBuf> {
        self.venv.as_ref().map(|v| v.join("bin").join("python"))
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

/// Builds environments on one node; one build per environment at a time.
#[derive(Default)]
pub struct Builder {
    locks: Mutex<HashMap<String, Arc<tokio::sync::Mutex<()>>>>,
}

impl Builder {
    fn lock_for(&self, key: &str) -> Arc<tokio::sync::Mutex<()>> {
        let mut m = self.locks.lock().unwrap_or_else(|p| p.into_inner());
        Arc::clone(m.entry(key.to_string()).or_default())
    }

    /// Builds (or finds cached) what `env` needs on this node. Setup output goes to
    /// `log` (appended).
    ///
    /// # Errors
    /// A message for the job's status: the package that could not be fetched or
    /// unpacked, or pip's output when an install failed or ran past the timeout.
    pub async fn prepare(
        &self,
        head_address: &str,
        token: Option<&str>,
        root: &Path,
        env: &JobRuntimeEnv,
        log: &Path,
    ) -> Result<Prepared, String> {
        let mut out = Prepared::default();
        if let Some(uri) = &env.working_dir {
            out.working_dir = Some(self.working_dir(head_address, token, root, uri).await?);
        }
        if let Some(pip) = &env.pip {
            let timeout = env.setup_timeout.unwrap_or(DEFAULT_SETUP_TIMEOUT);
            out.venv = Some(self.pip_env(root, pip, timeout, log).await?);
        }
        Ok(out)
    }

    async fn working_dir(
        &self,
        head_address: &str,
        token: Option<&str>,
        root: &Path,
        uri: &str,
    ) -> Result<PathBuf, String> {
        let name = uri.strip_prefix(PACKAGE_SCHEME).unwrap_or(uri);
        let stem = name.strip_suffix(".zip").unwrap_or(name);
        let dir = root.join("working_dir_files").join(stem);
        let lock = self.lock_for(&dir.display().to_string());
        let _held = lock.lock().await;
        if dir.is_dir() {
            return Ok(dir);
        }
        let mut head =
            tpuray_proto::client::head(head_address, token).map_err(|e| e.to_string())?;
        let bytes = packages::get(&mut head, PACKAGES_NAMESPACE, uri)
            .await?
            .ok_or_else(|| format!("working_dir package {uri} is not in the cluster"))?;
        let parent = dir.parent().unwrap_or(root).to_path_buf();
        let (d, p) = (dir.clone(), parent.clone());
        tokio::task::spawn_blocking(move || unpack(&bytes, &p, &d))
            .await
            .map_err(|e| format!("unpacking {uri}: {e}"))??;
        Ok(dir)
    }

    async fn pip_env(
        &self,
        root: &Path,
        pip: &PipSpec,
        timeout: Duration,
        log: &Path,
    ) -> Result<PathBuf, String> {
        let dir = root.join("pip").join(pip.hash());
        let lock = self.lock_for(&dir.display().to_string());
        let _held = lock.lock().await;
        let ready = dir.join(".tpuray-ready");
        if ready.exists() {
            return Ok(dir);
        }
        let _ = std::fs::remove_dir_all(&dir); // a build that did not finish
        match tokio::time::timeout(timeout, build_pip_env(&dir, pip, log)).await {
            Ok(Ok(())) => {
                std::fs::write(&ready, b"").map_err(|e| format!("{}: {e}", ready.display()))?;
                Ok(dir)
            }
            Ok(Err(e)) => {
                let _ = std::fs::remove_dir_all(&dir);
                Err(e)
            }
            Err(_) => {
                let _ = std::fs::remove_dir_all(&dir);
                Err(format!(
                    "the pip environment was not ready within setup_timeout_seconds = {} (runtime_env \
                     config); output so far: {}",
                    timeout.as_secs_f64(),
                    tail(log)
                ))
            }
        }
    }
}

/// Unzips `bytes` into `dir` (through a temporary sibling, renamed at the end), refusing
/// entries that would land outside it.
fn unpack(bytes: &[u8], parent: &Path, dir: &Path) -> Result<(), String> {
    std::fs::create_dir_all(parent).map_err(|e| format!("{}: {e}", parent.display()))?;
    let tmp = parent.join(format!(".unpack-{}", tpuray_proto::ids::WorkerId::random()));
    let result = (|| {
        let mut zip = zip::ZipArchive::new(std::io::Cursor::new(bytes))
            .map_err(|e| format!("the working_dir package is not a zip file: {e}"))?;
        zip.extract(&tmp).map_err(|e| format!("unpacking the working_dir package: {e}"))
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
    let status = tokio::process::Command::new(&argv[0])
        .args(&argv[1..])
        .stdin(std::process::Stdio::null())
        .stdout(open()?)
        .stderr(open()?)
        .env("PIP_DISABLE_PIP_VERSION_CHECK", "1")
        .env("PIP_NO_INPUT", "1")
        .kill_on_drop(true)
        .status()
        .await
        .map_err(|e| format!("cannot run {}: {e}", argv[0]))?;
    if status.success() {
        Ok(())
    } else {
        Err(format!(
            "`{}` failed ({status}):\n{}",
            argv.iter().take(4).cloned().collect::<Vec<_>>().join(" "),
            tail(log)
        ))
    }
}

fn tail(log: &Path) -> String {
    let text =
        std::fs::read(log).map(|b| String::from_utf8_lossy(&b).into_owned()).unwrap_or_default();
    let mut start = text.len().saturating_sub(PIP_OUTPUT_TAIL);
    while !text.is_char_boundary(start) {
        start += 1;
    }
    text[start..].trim().to_string()
}

async fn build_pip_env(dir: &Path, pip: &PipSpec, log: &Path) -> Result<(), String> {
    if let Some(p) = dir.parent() {
        std::fs::create_dir_all(p).map_err(|e| format!("{}: {e}", p.display()))?;
    }
    let base = base_python();
    let d = dir.display().to_string();
    // Without pip of its own (ensurepip costs about 2 s): the base's pip installs into
    // it (`pip --python`, pip >= 22.3), unless a pip version is asked for.
    let base_pip = pip.pip_version.is_none()
        && tokio::process::Command::new(&base)
            .args(["-m", "pip", "--python", &base, "--version"])
            .stdout(std::process::Stdio::null())
            .stderr(std::process::Stdio::null())
            .status()
            .await
            .is_ok_and(|s| s.success());
    let mut venv = vec![base.clone(), "-m".into(), "venv".into()];
    if base_pip {
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
    let python = dir.join("bin").join("python").display().to_string();
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
