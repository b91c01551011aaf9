//! `working_dir` and `py_modules` packages: fetched from the cluster's KV, unzipped once
//! per node into their cached folder (a `py_modules` wheel installed with
//! `pip install --target`), and the folders' names and sizes.

use std::path::{Path, PathBuf};

use tpuray_proto::runtime_env::PACKAGE_SCHEME;

use super::{Builder, EnvUses, Kind, Source, base_python, run_logged};

impl Builder {
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

    pub(super) async fn working_dir(
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
    pub(super) async fn py_module(
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
}

/// `gcs://_ray_pkg_abc.zip` -> `_ray_pkg_abc` (a wheel keeps its full name minus `.whl`).
fn package_stem(uri: &str) -> String {
    let name = uri.strip_prefix(PACKAGE_SCHEME).unwrap_or(uri);
    name.strip_suffix(".zip").or_else(|| name.strip_suffix(".whl")).unwrap_or(name).to_string()
}

/// Bytes of the files under `dir` (links not followed).
pub(super) fn dir_size(dir: &Path) -> u64 {
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn package_stems_name_cache_folders() {
        assert_eq!(package_stem("gcs://_ray_pkg_ab12.zip"), "_ray_pkg_ab12");
        assert_eq!(package_stem("gcs://m-1.0-py3-none-any.whl"), "m-1.0-py3-none-any");
    }
}
