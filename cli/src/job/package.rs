//! Packages for a job's `runtime_env`, made as Ray's client makes them
//! (`ray/_private/runtime_env/packaging.py`) so the server unpacks them as Ray's would.
//!
//! - A folder ([`package_directory`]) becomes a zip of its files; `working_dir` keeps them
//!   at the zip's root (Ray's `include_parent_dir=False`), `py_modules` under the
//!   folder's name. Skipped: what `excludes` names (gitignore patterns relative to the
//!   folder), Ray's default excludes (`.git`, `.venv`, `venv`, `__pycache__`, or
//!   `RAY_OVERRIDE_RUNTIME_ENV_DEFAULT_EXCLUDES`), and what each folder's `.gitignore`
//!   (unless `RAY_RUNTIME_ENV_IGNORE_GITIGNORE=1`) and `.rayignore` name, relative to
//!   that folder. Empty folders are kept as entries; symbolic links are followed (a link
//!   back to a folder being packed is refused); broken links, sockets and FIFOs are left
//!   out.
//! - Its URI is Ray's content hash: `gcs://_ray_pkg_<16 hex>.zip`, the first 8 bytes of
//!   the XOR over every packed path of SHA-1(relative path, then the file's bytes),
//!   started from `b"00000000"` (`_hash_directory`); the same folder gets the URI Ray's
//!   client gives it.
//! - The bytes are deterministic: entries sorted by path, every timestamp 1980-01-01
//!   00:00, permission bits kept, deflate. Packing the same tree twice gives the same
//!   bytes (Ray's zips carry modification times; ours do not, so an unchanged folder is
//!   not uploaded again under the same URI with other bytes).
//! - An existing archive ([`package_archive`]) is sent as it is: `gcs://_ray_pkg_<sha1 of
//!   its bytes>.zip` (`.tar.gz`, `.tar.xz`), a wheel under its own file name.
//!
//! Everything here is synchronous file I/O.
//!
//! JOBC-1: a folder's package URI is Ray's content hash, so Ray's client and ours name
//! the same folder alike, and its bytes are deterministic: the same tree packs to the
//! same bytes.

use std::io::{Cursor, Write};
use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};

use ignore::gitignore::{Gitignore, GitignoreBuilder};
use sha1::{Digest, Sha1};
use zip::write::{SimpleFileOptions, ZipWriter};
use zip::{CompressionMethod, DateTime};

use super::JobError;

/// Ray's `RAY_RUNTIME_ENV_DEFAULT_EXCLUDES`.
pub const DEFAULT_EXCLUDES: &str = ".git,.venv,venv,__pycache__";
/// Ray's variable replacing [`DEFAULT_EXCLUDES`] (comma-separated; empty: none).
pub const OVERRIDE_DEFAULT_EXCLUDES_ENV: &str = "RAY_OVERRIDE_RUNTIME_ENV_DEFAULT_EXCLUDES";
/// Ray's variable that, set to `1`, makes packaging ignore `.gitignore` files.
pub const IGNORE_GITIGNORE_ENV: &str = "RAY_RUNTIME_ENV_IGNORE_GITIGNORE";
/// The prefix of every package name Ray's client makes.
pub const PKG_PREFIX: &str = "_ray_pkg_";

/// A package ready to upload.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Package {
    /// `gcs://NAME`.
    pub uri: String,
    pub bytes: Vec<u8>,
}

/// The default excludes in force (Ray's, or the override variable's).
pub fn default_excludes() -> Vec<String> {
    let v =
        std::env::var(OVERRIDE_DEFAULT_EXCLUDES_ENV).unwrap_or_else(|_| DEFAULT_EXCLUDES.into());
    v.split(',').map(str::trim).filter(|s| !s.is_empty()).map(String::from).collect()
}

/// Whether `.gitignore` files are honoured (Ray's default; not with
/// `RAY_RUNTIME_ENV_IGNORE_GITIGNORE=1`).
pub fn include_gitignore() -> bool {
    std::env::var(IGNORE_GITIGNORE_ENV).map(|v| v != "1").unwrap_or(true)
}

fn io_err(path: &Path, what: &str, e: std::io::Error) -> JobError {
    JobError::Package(format!("cannot {what} {}: {e}", path.display()))
}

/// One exclusion source: patterns relative to `base` (a path relative to the packed
/// folder, empty for the folder itself).
struct Matcher {
    base: PathBuf,
    gitignore: Gitignore,
}

impl Matcher {
    fn excludes(&self, rel: &Path, is_dir: bool) -> bool {
        let Ok(under) = rel.strip_prefix(&self.base) else { return false };
        !under.as_os_str().is_empty() && self.gitignore.matched(under, is_dir).is_ignore()
    }
}

fn patterns_matcher(root: &Path, patterns: &[String]) -> Result<Matcher, JobError> {
    let mut b = GitignoreBuilder::new(root);
    for p in patterns {
        b.add_line(None, p).map_err(|e| {
            JobError::Invalid(format!(
                "runtime_env excludes pattern {p:?} is not a gitignore pattern: {e}"
            ))
        })?;
    }
    let gitignore =
        b.build().map_err(|e| JobError::Invalid(format!("runtime_env excludes: {e}")))?;
    Ok(Matcher { base: PathBuf::new(), gitignore })
}

/// The matchers of the ignore files in folder `dir` (`rel` from the packed folder).
fn ignore_file_matchers(dir: &Path, rel: &Path, gitignore: bool) -> Result<Vec<Matcher>, JobError> {
    let mut out = Vec::new();
    let names: &[&str] = if gitignore { &[".gitignore", ".rayignore"] } else { &[".rayignore"] };
    for name in names {
        let f = dir.join(name);
        if !f.is_file() {
            continue;
        }
        let mut b = GitignoreBuilder::new(dir);
        if let Some(e) = b.add(&f) {
            return Err(JobError::Package(format!("cannot use {}: {e}", f.display())));
        }
        let g =
            b.build().map_err(|e| JobError::Package(format!("cannot use {}: {e}", f.display())))?;
        out.push(Matcher { base: rel.to_path_buf(), gitignore: g });
    }
    Ok(out)
}

/// A packed path.
enum Entry {
    File { rel: String, bytes: Vec<u8>, mode: u32 },
    EmptyDir { rel: String, mode: u32 },
}

/// Ray's hash state: 8 bytes, XORed with the head of each path's SHA-1 (JOBC-1).
struct RayHash([u8; 8]);

impl RayHash {
    fn new() -> Self {
        RayHash(*b"00000000")
    }
    fn add(&mut self, rel: &str, content: Option<&[u8]>) {
        let mut h = Sha1::new();
        h.update(rel.as_bytes());
        if let Some(c) = content {
            h.update(c);
        }
        let d = h.finalize();
        for (a, b) in self.0.iter_mut().zip(d.iter()) {
            *a ^= b;
        }
    }
    fn hex(&self) -> String {
        self.0.iter().map(|b| format!("{b:02x}")).collect()
    }
}

struct Walk<'a> {
    gitignore: bool,
    matchers: Vec<Matcher>,
    hash: RayHash,
    entries: Vec<Entry>,
    /// Canonical paths of the folders being walked (a link back to one is a loop).
    ancestors: Vec<PathBuf>,
    root: &'a Path,
}

impl Walk<'_> {
    /// Ray's `_dir_travel`: the folder's own ignore files apply from the folder on.
    fn dir(&mut self, path: &Path, rel: &Path) -> Result<(), JobError> {
        let new = ignore_file_matchers(path, rel, self.gitignore)?;
        let pushed = new.len();
        self.matchers.extend(new);
        let result = self.dir_inner(path, rel);
        self.matchers.truncate(self.matchers.len() - pushed);
        result
    }

    fn dir_inner(&mut self, path: &Path, rel: &Path) -> Result<(), JobError> {
        let canonical = path.canonicalize().map_err(|e| io_err(path, "read", e))?;
        if self.ancestors.contains(&canonical) {
            return Err(JobError::Package(format!(
                "{} links back to a folder that contains it ({}): refusing to package a loop",
                self.root.join(rel).display(),
                canonical.display()
            )));
        }
        self.ancestors.push(canonical);
        self.hash.add(&rel_str(rel), None);
        let mut children: Vec<_> = std::fs::read_dir(path)
            .map_err(|e| io_err(path, "read folder", e))?
            .map(|e| e.map(|e| e.file_name()))
            .collect::<Result<_, _>>()
            .map_err(|e| io_err(path, "read folder", e))?;
        children.sort();
        let mut packed_any = false;
        for name in children {
            let child = path.join(&name);
            let child_rel = rel.join(&name);
            // Follow links as Ray does (`Path.is_dir`/`is_file`); broken ones are skipped.
            let Ok(meta) = std::fs::metadata(&child) else { continue };
            let is_dir = meta.is_dir();
            if !is_dir && !meta.is_file() {
                continue;
            }
            if self.matchers.iter().any(|m| m.excludes(&child_rel, is_dir)) {
                continue;
            }
            packed_any = true;
            if is_dir {
                self.dir(&child, &child_rel)?;
            } else {
                let bytes = std::fs::read(&child).map_err(|e| io_err(&child, "read", e))?;
                let r = rel_str(&child_rel);
                self.hash.add(&r, Some(&bytes));
                self.entries.push(Entry::File {
                    rel: r,
                    bytes,
                    mode: meta.permissions().mode() & 0o777,
                });
            }
        }
        if !packed_any && !rel.as_os_str().is_empty() {
            let mode =
                std::fs::metadata(path).map(|m| m.permissions().mode() & 0o777).unwrap_or(0o755);
            self.entries.push(Entry::EmptyDir { rel: rel_str(rel), mode });
        }
        self.ancestors.pop();
        Ok(())
    }
}

/// A relative path as Python's `str(Path)` writes it (`.` for the folder itself).
fn rel_str(rel: &Path) -> String {
    if rel.as_os_str().is_empty() { ".".into() } else { rel.to_string_lossy().into_owned() }
}

/// JOBC-1: entries come sorted (the walk sorts each folder) and every timestamp is
/// 1980-01-01 00:00, so a tree packs to the same bytes whenever it is packed.
fn zip_entries(entries: &[Entry], prefix: Option<&str>) -> Result<Vec<u8>, JobError> {
    let mut zip = ZipWriter::new(Cursor::new(Vec::new()));
    let base = SimpleFileOptions::default()
        .compression_method(CompressionMethod::Deflated)
        .last_modified_time(DateTime::DEFAULT);
    let name = |rel: &str| match prefix {
        Some(p) => format!("{p}/{rel}"),
        None => rel.to_string(),
    };
    let zerr = |e: zip::result::ZipError| JobError::Package(format!("cannot write the zip: {e}"));
    if let Some(p) = prefix
        && entries.is_empty()
    {
        zip.add_directory(p, base.unix_permissions(0o755)).map_err(zerr)?;
    }
    for e in entries {
        match e {
            Entry::File { rel, bytes, mode } => {
                let opts =
                    base.unix_permissions(*mode).large_file(bytes.len() as u64 >= u32::MAX as u64);
                zip.start_file(name(rel), opts).map_err(zerr)?;
                zip.write_all(bytes)
                    .map_err(|e| JobError::Package(format!("cannot write the zip: {e}")))?;
            }
            Entry::EmptyDir { rel, mode } => {
                zip.add_directory(name(rel), base.unix_permissions(*mode)).map_err(zerr)?;
            }
        }
    }
    Ok(zip.finish().map_err(zerr)?.into_inner())
}

/// Packages folder `dir` (see the module doc). `excludes`: gitignore patterns relative
/// to `dir`, the caller's defaults included. `include_parent_dir`: the files go under
/// the folder's name (`py_modules`) instead of the zip's root (`working_dir`).
pub fn package_directory(
    dir: &Path,
    excludes: &[String],
    include_gitignore: bool,
    include_parent_dir: bool,
) -> Result<Package, JobError> {
    let meta = std::fs::metadata(dir).map_err(|e| io_err(dir, "read", e))?;
    if !meta.is_dir() {
        return Err(JobError::Invalid(format!("{} is not a folder", dir.display())));
    }
    let mut walk = Walk {
        gitignore: include_gitignore,
        matchers: vec![patterns_matcher(dir, excludes)?],
        hash: RayHash::new(),
        entries: Vec::new(),
        ancestors: Vec::new(),
        root: dir,
    };
    walk.dir(dir, Path::new(""))?;
    let prefix = if include_parent_dir {
        let abs = std::path::absolute(dir).map_err(|e| io_err(dir, "read", e))?;
        let name = abs.file_name().map(|n| n.to_string_lossy().into_owned()).ok_or_else(|| {
            JobError::Invalid(format!("{} has no folder name to package it under", dir.display()))
        })?;
        Some(name)
    } else {
        None
    };
    let bytes = zip_entries(&walk.entries, prefix.as_deref())?;
    Ok(Package { uri: format!("gcs://{PKG_PREFIX}{}.zip", walk.hash.hex()), bytes })
}

/// Packages one Python file as a module (Ray's `get_uri_for_file`): a zip holding it
/// at the root.
pub fn package_file(file: &Path) -> Result<Package, JobError> {
    let bytes = std::fs::read(file).map_err(|e| io_err(file, "read", e))?;
    let name = file
        .file_name()
        .map(|n| n.to_string_lossy().into_owned())
        .ok_or_else(|| JobError::Invalid(format!("{} has no file name", file.display())))?;
    let mode = std::fs::metadata(file).map(|m| m.permissions().mode() & 0o777).unwrap_or(0o644);
    let mut hash = RayHash::new();
    hash.add(&name, Some(&bytes));
    let zipped = zip_entries(&[Entry::File { rel: name, bytes, mode }], None)?;
    Ok(Package { uri: format!("gcs://{PKG_PREFIX}{}.zip", hash.hex()), bytes: zipped })
}

/// Archive suffixes Ray accepts for a local `working_dir` file.
pub const WORKING_DIR_ARCHIVES: [&str; 4] = [".zip", ".tar.gz", ".tgz", ".tar.xz"];
/// Archive suffixes Ray accepts for a local `py_modules` file.
pub const PY_MODULES_ARCHIVES: [&str; 5] = [".zip", ".whl", ".tar.gz", ".tgz", ".tar.xz"];

/// An existing archive sent as it is (Ray's `get_uri_for_package`): a wheel under its
/// own name, anything else under the SHA-1 of its bytes.
pub fn package_archive(file: &Path) -> Result<Package, JobError> {
    let bytes = std::fs::read(file).map_err(|e| io_err(file, "read", e))?;
    let name = file.file_name().map(|n| n.to_string_lossy().into_owned()).unwrap_or_default();
    if name.ends_with(".whl") {
        return Ok(Package { uri: format!("gcs://{name}"), bytes });
    }
    let ext = if name.ends_with(".tar.gz") || name.ends_with(".tgz") {
        ".tar.gz"
    } else if name.ends_with(".tar.xz") {
        ".tar.xz"
    } else {
        ".zip"
    };
    let hex: String = Sha1::digest(&bytes).iter().map(|b| format!("{b:02x}")).collect();
    Ok(Package { uri: format!("gcs://{PKG_PREFIX}{hex}{ext}"), bytes })
}

#[cfg(test)]
mod tests {
    use std::io::Read;

    use super::*;

    fn write(root: &Path, rel: &str, body: &str) {
        let p = root.join(rel);
        std::fs::create_dir_all(p.parent().unwrap()).unwrap();
        std::fs::write(p, body).unwrap();
    }

    fn names(bytes: &[u8]) -> Vec<String> {
        let z = zip::ZipArchive::new(Cursor::new(bytes)).unwrap();
        let mut v: Vec<String> = z.file_names().map(|n| n.unwrap().into_owned()).collect();
        v.sort();
        v
    }

    fn read(bytes: &[u8], name: &str) -> String {
        let mut z = zip::ZipArchive::new(Cursor::new(bytes)).unwrap();
        let mut s = String::new();
        z.by_name(name).unwrap().read_to_string(&mut s).unwrap();
        s
    }

    fn defaults() -> Vec<String> {
        DEFAULT_EXCLUDES.split(',').map(String::from).collect()
    }

    #[test]
    fn jobc_1_the_same_tree_packs_to_the_same_bytes_and_uri_whatever_its_timestamps() {
        let a = tempfile::tempdir().unwrap();
        let b = tempfile::tempdir().unwrap();
        for root in [a.path(), b.path()] {
            write(root, "train.py", "print('hi')\n");
            write(root, "pkg/mod.py", "X = 1\n");
        }
        // Different modification times, different creation order.
        std::thread::sleep(std::time::Duration::from_millis(20));
        write(b.path(), "train.py", "print('hi')\n");
        let pa = package_directory(a.path(), &defaults(), true, false).unwrap();
        let pb = package_directory(b.path(), &defaults(), true, false).unwrap();
        assert_eq!(pa, pb);
        assert!(pa.uri.starts_with("gcs://_ray_pkg_") && pa.uri.ends_with(".zip"), "{}", pa.uri);
        assert_eq!(pa.uri.len(), "gcs://_ray_pkg_".len() + 16 + ".zip".len());
        assert_eq!(names(&pa.bytes), ["pkg/mod.py", "train.py"]);
        assert_eq!(read(&pa.bytes, "pkg/mod.py"), "X = 1\n");
        // Changing a byte changes the URI.
        write(b.path(), "pkg/mod.py", "X = 2\n");
        assert_ne!(package_directory(b.path(), &defaults(), true, false).unwrap().uri, pa.uri);
    }

    /// JOBC-1: the URI is Ray's content hash, the XOR of SHA-1(path, bytes) over what is packed.
    #[test]
    fn jobc_1_the_uri_is_rays_content_hash() {
        // Ray 2.60's get_uri_for_directory for a folder holding a.txt ("hello") and an
        // empty folder e: hashes ".", "a.txt"+"hello" and "e", XORed into b"00000000".
        let d = tempfile::tempdir().unwrap();
        write(d.path(), "a.txt", "hello");
        std::fs::create_dir(d.path().join("e")).unwrap();
        let p = package_directory(d.path(), &[], true, false).unwrap();
        let mut h = RayHash::new();
        h.add(".", None);
        h.add("a.txt", Some(b"hello"));
        h.add("e", None);
        assert_eq!(p.uri, format!("gcs://_ray_pkg_{}.zip", h.hex()));
        assert_eq!(names(&p.bytes), ["a.txt", "e/"]);
        // And what Ray 2.60 itself computed for this tree plus sub/m.py ("X = 1\n").
        write(d.path(), "sub/m.py", "X = 1\n");
        let p = package_directory(d.path(), &[], true, false).unwrap();
        assert_eq!(p.uri, "gcs://_ray_pkg_0c61f3f7b33c7230.zip");
    }

    #[test]
    fn git_venv_pycache_gitignore_rayignore_and_excludes_are_left_out() {
        let d = tempfile::tempdir().unwrap();
        let r = d.path();
        write(r, "main.py", "");
        write(r, ".git/HEAD", "ref");
        write(r, ".venv/bin/python", "");
        write(r, "sub/__pycache__/m.pyc", "");
        write(r, ".gitignore", "*.log\n/build/\n!keep.log\n");
        write(r, "x.log", "");
        write(r, "keep.log", "");
        write(r, "build/out.o", "");
        write(r, "sub/build/kept.txt", "anchored /build/ is only the top one");
        write(r, "sub/.gitignore", "local.txt\n");
        write(r, "sub/local.txt", "");
        write(r, "local.txt", "a sub folder's .gitignore does not reach up");
        write(r, ".rayignore", "secret/\n");
        write(r, "secret/key", "");
        write(r, "data/big.bin", "");
        write(r, "data/small.txt", "");
        let p =
            package_directory(r, &[defaults(), vec!["data/*.bin".into()]].concat(), true, false)
                .unwrap();
        assert_eq!(
            names(&p.bytes),
            [
                ".gitignore",
                ".rayignore",
                "data/small.txt",
                "keep.log",
                "local.txt",
                "main.py",
                "sub/.gitignore",
                "sub/build/kept.txt"
            ]
        );
        // RAY_RUNTIME_ENV_IGNORE_GITIGNORE=1: .gitignore files are not read.
        let p = package_directory(r, &defaults(), false, false).unwrap();
        assert!(names(&p.bytes).contains(&"x.log".to_string()));
        assert!(
            !names(&p.bytes).iter().any(|n| n.starts_with("secret")),
            ".rayignore still applies"
        );
    }

    #[test]
    fn py_modules_keep_the_folder_name_and_single_files_and_archives_have_rays_uris() {
        let d = tempfile::tempdir().unwrap();
        write(d.path(), "mylib/__init__.py", "V = 3\n");
        let p = package_directory(&d.path().join("mylib"), &[], true, true).unwrap();
        assert_eq!(names(&p.bytes), ["mylib/__init__.py"]);
        write(d.path(), "one.py", "Y = 1\n");
        let f = package_file(&d.path().join("one.py")).unwrap();
        assert_eq!(names(&f.bytes), ["one.py"]);
        assert!(f.uri.starts_with("gcs://_ray_pkg_"));
        std::fs::write(d.path().join("w-1.0-py3-none-any.whl"), b"wheel").unwrap();
        let w = package_archive(&d.path().join("w-1.0-py3-none-any.whl")).unwrap();
        assert_eq!(w.uri, "gcs://w-1.0-py3-none-any.whl");
        std::fs::write(d.path().join("src.tgz"), b"tar").unwrap();
        let t = package_archive(&d.path().join("src.tgz")).unwrap();
        assert_eq!(t.uri, "gcs://_ray_pkg_680254bad1d7ca0d65ec46aaa315d363abf6a50a.tar.gz");
    }

    #[test]
    fn executable_bits_survive_and_empty_folders_are_entries() {
        let d = tempfile::tempdir().unwrap();
        write(d.path(), "run.sh", "#!/bin/sh\n");
        std::fs::set_permissions(d.path().join("run.sh"), std::fs::Permissions::from_mode(0o755))
            .unwrap();
        std::fs::create_dir_all(d.path().join("out/logs")).unwrap();
        let p = package_directory(d.path(), &[], true, false).unwrap();
        let mut z = zip::ZipArchive::new(Cursor::new(&p.bytes)).unwrap();
        assert_eq!(z.by_name("run.sh").unwrap().unix_mode().unwrap() & 0o777, 0o755);
        assert_eq!(names(&p.bytes), ["out/logs/", "run.sh"]);
    }

    #[test]
    fn a_link_back_up_the_tree_is_refused_by_name() {
        let d = tempfile::tempdir().unwrap();
        std::fs::create_dir(d.path().join("a")).unwrap();
        std::os::unix::fs::symlink(d.path(), d.path().join("a/up")).unwrap();
        let e = package_directory(d.path(), &[], true, false).unwrap_err().to_string();
        assert!(e.contains("a/up") && e.contains("loop"), "{e}");
    }

    #[test]
    fn a_bad_exclude_pattern_is_named() {
        let d = tempfile::tempdir().unwrap();
        let e = package_directory(d.path(), &["a{b".into()], true, false).unwrap_err().to_string();
        assert!(e.contains("\"a{b\""), "{e}");
    }
}
