//! pip and uv virtual environments (Ray's `pip.py`, `uv.py`): a venv of the interpreter
//! tpuray runs in with that interpreter's site-packages after its own, the packages
//! installed with the base's pip, the venv's own pip, or `uv`, a READY marker once done.

use std::path::{Path, PathBuf};

use tpuray_proto::runtime_env::{PipSpec, UvSpec};

use super::package_files::dir_size;
use super::{Builder, EnvUses, Kind, run_logged};

/// The marker a finished venv gets (a venv without it is half made and is rebuilt).
const READY: &str = ".tpuray-ready";

impl Builder {
    pub(super) async fn venv(
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
pub(super) enum Installer<'a> {
    Pip(&'a PipSpec),
    Uv(&'a UvSpec),
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
}
