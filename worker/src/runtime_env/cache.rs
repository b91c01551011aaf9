//! The cache of built directories (AGENT-15, Ray's `uri_cache.py`): [`UriCache`] counts
//! each directory's users and gives up unused ones past their kind's size limit, least
//! recently used first; [`EnvUses`] holds one process's directories and releases them
//! when dropped, moving what the cache gave up aside for deletion.

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};

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
    pub(super) cache: Arc<Mutex<UriCache>>,
    pub(super) dirs: Vec<PathBuf>,
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
}
