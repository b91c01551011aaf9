//! A node's log files as the head's logs API reads them (`ListLogs`, `ReadLog`; Ray's
//! log agent, `ray/dashboard/modules/log/log_agent.py`): the files under
//! `<session>/logs` (the agent's and head's `.out`/`.err`, every worker's
//! `worker-<worker id>-<job id>-<pid>.out|err` (LOGS-2), and the Jobs API's
//! `job-driver-<submission id>.log`).
//!
//! LOGS-4: only paths inside the logs directory are served: a name that is absolute
//! or holds `..` is refused, and symbolic links are not followed out of it.
//! Both functions block (directory walks, file reads): call them on a blocking thread.
//! They fail with a [`LogFileError`]; the agent's gRPC service turns it into a status.

use std::io::{Read, Seek, SeekFrom};
use std::path::{Component, Path, PathBuf};

use tpuray_proto::pb;

/// The most a `ReadLog` answers with (4 MiB).
pub const MAX_READ: u64 = 4 << 20;

/// Why a log file could not be listed or read. Each variant says which gRPC code the
/// agent's service answers it with (in brackets).
#[derive(Debug, thiserror::Error)]
pub enum LogFileError {
    /// The `ListLogs` glob does not parse (`INVALID_ARGUMENT`).
    #[error("glob {glob:?} does not parse: {error}")]
    BadGlob { glob: String, error: globset::Error },
    /// LOGS-4: the name is empty, absolute or holds `..` (`INVALID_ARGUMENT`).
    #[error(
        "log file name {0:?} must be a path inside the node's logs directory (no `..`, not absolute)"
    )]
    NameOutside(String),
    /// The name is a directory, a symbolic link or another non-file (`INVALID_ARGUMENT`).
    #[error("{0} is not a plain file")]
    NotPlainFile(String),
    /// LOGS-4: the name resolves (through a symbolic link above it) to a path outside
    /// the logs directory (`INVALID_ARGUMENT`).
    #[error("{0} lies outside the node's logs directory")]
    ResolvesOutside(String),
    /// The file or the logs directory could not be read (`INTERNAL`).
    #[error("{}: {error}", path.display())]
    Io { path: PathBuf, error: std::io::Error },
}

/// The files under `dir` whose path relative to it matches `glob` (`""` is `*`), sorted.
///
/// # Errors
/// [`LogFileError::BadGlob`] for a glob that does not parse.
pub fn list(dir: &Path, glob: &str) -> Result<Vec<String>, LogFileError> {
    let glob = if glob.is_empty() { "*" } else { glob };
    let m = globset::Glob::new(glob)
        .map_err(|error| LogFileError::BadGlob { glob: glob.to_string(), error })?
        .compile_matcher();
    let mut out = Vec::new();
    let mut stack = vec![dir.to_path_buf()];
    while let Some(d) = stack.pop() {
        let Ok(entries) = std::fs::read_dir(&d) else { continue };
        for e in entries.flatten() {
            let Ok(ty) = e.file_type() else { continue };
            let path = e.path();
            if ty.is_dir() {
                stack.push(path);
            } else if ty.is_file()
                && let Ok(rel) = path.strip_prefix(dir)
                && m.is_match(rel)
            {
                out.push(rel.to_string_lossy().into_owned());
            }
        }
    }
    out.sort();
    Ok(out)
}

/// `name` inside `dir` (LOGS-4).
fn inside(dir: &Path, name: &str) -> Result<PathBuf, LogFileError> {
    let p = Path::new(name);
    if name.is_empty()
        || p.components().any(|c| !matches!(c, Component::Normal(_) | Component::CurDir))
    {
        return Err(LogFileError::NameOutside(name.to_string()));
    }
    Ok(dir.join(p))
}

/// Reads the piece `req` asks for from a file under `dir`.
///
/// # Errors
/// [`LogFileError::NameOutside`], [`LogFileError::NotPlainFile`] or
/// [`LogFileError::ResolvesOutside`] for a name that is not a file inside the directory,
/// [`LogFileError::Io`] when the file cannot be read; a missing file is `found: false`.
pub fn read(dir: &Path, req: &pb::ReadLogRequest) -> Result<pb::ReadLogReply, LogFileError> {
    let path = inside(dir, &req.filename)?;
    let io = |error: std::io::Error| LogFileError::Io { path: path.clone(), error };
    let meta = match std::fs::symlink_metadata(&path) {
        Ok(m) if m.is_file() => m,
        Ok(_) => return Err(LogFileError::NotPlainFile(req.filename.clone())),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
            return Ok(pb::ReadLogReply { found: false, ..Default::default() });
        }
        Err(e) => return Err(io(e)),
    };
    let root = dir.canonicalize().map_err(io)?;
    if !path.canonicalize().map_err(io)?.starts_with(&root) {
        return Err(LogFileError::ResolvesOutside(req.filename.clone()));
    }
    let mut f = std::fs::File::open(&path).map_err(io)?;
    let size = meta.len();
    let end = if req.end == 0 { size } else { req.end.min(size) };
    let mut start = req.start.min(end);
    if req.lines >= 0 {
        start = start_of_last_lines(&mut f, start, end, req.lines as u64).map_err(io)?;
    }
    let max = if req.max_bytes == 0 { MAX_READ } else { req.max_bytes.min(MAX_READ) };
    let len = (end - start).min(max);
    f.seek(SeekFrom::Start(start)).map_err(io)?;
    let mut data = Vec::with_capacity(len as usize);
    f.take(len).read_to_end(&mut data).map_err(io)?;
    Ok(pb::ReadLogReply { found: true, data, offset: start, size })
}

/// Where the last `n` lines of `[start, end)` begin (a final line without its newline
/// counts as a line), reading backwards in 64 KiB blocks.
fn start_of_last_lines(
    f: &mut std::fs::File,
    start: u64,
    end: u64,
    n: u64,
) -> std::io::Result<u64> {
    if n == 0 {
        return Ok(end);
    }
    const BLOCK: u64 = 64 << 10;
    let mut newlines = 0u64;
    let mut pos = end;
    let mut buf = vec![0u8; BLOCK as usize];
    let mut last_byte_seen = false;
    while pos > start {
        let len = (pos - start).min(BLOCK);
        let from = pos - len;
        f.seek(SeekFrom::Start(from))?;
        let chunk = &mut buf[..len as usize];
        f.read_exact(chunk)?;
        for i in (0..chunk.len()).rev() {
            let at = from + i as u64;
            if !last_byte_seen {
                last_byte_seen = true;
                // A newline ending the range closes the last line; it does not start one.
                if chunk[i] == b'\n' {
                    continue;
                }
            }
            if chunk[i] == b'\n' {
                newlines += 1;
                if newlines == n {
                    return Ok(at + 1);
                }
            }
        }
        pos = from;
    }
    Ok(start)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn req(name: &str, lines: i64) -> pb::ReadLogRequest {
        pb::ReadLogRequest { filename: name.into(), lines, ..Default::default() }
    }

    #[test]
    fn lists_by_glob_and_reads_whole_tails_and_ranges() {
        let d = tempfile::tempdir().unwrap();
        std::fs::write(d.path().join("worker-a-j-12.out"), "one\ntwo\nthree\n").unwrap();
        std::fs::write(d.path().join("worker-a-j-12.err"), "").unwrap();
        std::fs::write(d.path().join("agent.out"), "x").unwrap();
        assert_eq!(list(d.path(), "*12*out").unwrap(), vec!["worker-a-j-12.out"]);
        assert_eq!(list(d.path(), "").unwrap().len(), 3);
        let r = read(d.path(), &req("worker-a-j-12.out", -1)).unwrap();
        assert_eq!(r.data, b"one\ntwo\nthree\n");
        assert_eq!(read(d.path(), &req("worker-a-j-12.out", 2)).unwrap().data, b"two\nthree\n");
        assert_eq!(
            read(d.path(), &req("worker-a-j-12.out", 9)).unwrap().data,
            b"one\ntwo\nthree\n"
        );
        assert!(read(d.path(), &req("worker-a-j-12.out", 0)).unwrap().data.is_empty());
        let mut r = req("worker-a-j-12.out", 1);
        (r.start, r.end) = (4, 8);
        assert_eq!(read(d.path(), &r).unwrap().data, b"two\n");
        assert!(!read(d.path(), &req("nope.out", -1)).unwrap().found);
    }

    #[test]
    fn logs_4_names_outside_the_directory_are_refused() {
        let d = tempfile::tempdir().unwrap();
        for bad in ["../secret", "/etc/passwd", "a/../../b", ""] {
            let e = read(d.path(), &req(bad, -1)).unwrap_err();
            assert!(matches!(e, LogFileError::NameOutside(ref n) if n == bad), "{bad}: {e:?}");
            assert_eq!(
                e.to_string(),
                format!(
                    "log file name {bad:?} must be a path inside the node's logs directory (no `..`, not absolute)"
                )
            );
        }
        let e = list(d.path(), "[").unwrap_err();
        assert!(matches!(e, LogFileError::BadGlob { .. }), "{e:?}");
        assert!(e.to_string().starts_with("glob \"[\" does not parse: "), "{e}");
    }

    #[test]
    fn logs_4_directories_and_links_out_of_the_directory_are_refused() {
        let outside = tempfile::tempdir().unwrap();
        std::fs::write(outside.path().join("secret"), "s").unwrap();
        let d = tempfile::tempdir().unwrap();
        std::fs::create_dir(d.path().join("sub")).unwrap();
        std::os::unix::fs::symlink(outside.path(), d.path().join("up")).unwrap();
        let e = read(d.path(), &req("sub", -1)).unwrap_err();
        assert!(matches!(e, LogFileError::NotPlainFile(_)), "{e:?}");
        assert_eq!(e.to_string(), "sub is not a plain file");
        let e = read(d.path(), &req("up/secret", -1)).unwrap_err();
        assert!(matches!(e, LogFileError::ResolvesOutside(_)), "{e:?}");
        assert_eq!(e.to_string(), "up/secret lies outside the node's logs directory");
    }
}
