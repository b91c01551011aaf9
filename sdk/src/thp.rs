//! ALLOC-3: a worker keeps transparent huge pages for the memory its task asks them for.
//!
//! The node agent starts workers with `MIMALLOC_ALLOW_THP=0` (ALLOC-2): mimalloc then
//! advises no huge pages for its own heap, which saves a starting worker a zeroed 2 MiB
//! page at each of its first allocations. But mimalloc implements that option with
//! `prctl(PR_SET_THP_DISABLE, 1)` at load, which turns huge pages off for the whole
//! process and its children, the task's own memory included: numpy advises
//! `MADV_HUGEPAGE` for arrays of 4 MiB and more (`numpy/_core/src/multiarray/alloc.c`),
//! and without it reading a fresh `np.zeros(10_000_000)` faulted once per 4 KiB page,
//! 20 ms instead of 2 ms here, which held Ray's "multi client put gigabytes" case to
//! 4.7 GB/s.
//!
//! So a worker whose agent chose that default ([`THP_EXCEPT_ADVISED_ENV`]) narrows the
//! disable, once, before it serves:
//! - to "all but advised regions" (`PR_THP_DISABLE_EXCEPT_ADVISED`, Linux 6.18 and
//!   later, `Documentation/admin-guide/mm/transhuge.rst`), which leaves mimalloc's
//!   unadvised heap without huge pages and gives them to what asks;
//! - on older kernels, where that flag is refused (`EINVAL`), to nothing when the host's
//!   mode is `madvise` (`/sys/kernel/mm/transparent_hugepage/enabled`), where only
//!   advised regions get huge pages anyway;
//! - and otherwise (mode `always` on an older kernel) it stays off for the whole
//!   process, as ALLOC-2 set it: a runtime environment with `MIMALLOC_ALLOW_THP=1`
//!   turns huge pages back on for everything.

use tpuray_proto::THP_EXCEPT_ADVISED_ENV;

const PR_SET_THP_DISABLE: libc::c_int = 41;
const PR_GET_THP_DISABLE: libc::c_int = 42;
/// `PR_SET_THP_DISABLE`'s flag (Linux 6.18): disable huge pages except in regions
/// advised `MADV_HUGEPAGE`. `PR_GET_THP_DISABLE` then answers `1 | EXCEPT_ADVISED`.
const PR_THP_DISABLE_EXCEPT_ADVISED: libc::c_ulong = 1 << 1;

/// Whether clearing the disable is safe when the kernel refuses
/// `PR_THP_DISABLE_EXCEPT_ADVISED`: the host's mode (the contents of
/// `/sys/kernel/mm/transparent_hugepage/enabled`, the selected mode in brackets) gives
/// huge pages only to advised regions.
fn may_clear(host_mode: &str) -> bool {
    host_mode.contains("[madvise]")
}

/// Narrows this process's huge page disable as the module says, when the agent asked
/// for it ([`THP_EXCEPT_ADVISED_ENV`]) and the whole process is disabled
/// (`PR_GET_THP_DISABLE` answers 1; 3 is "except advised" already). Never fails: a
/// refused call leaves the process as it was.
pub(crate) fn narrow_disable() {
    // SAFETY: these prctl calls read or set one flag of this process's memory map.
    let whole = unsafe { libc::prctl(PR_GET_THP_DISABLE, 0, 0, 0, 0) } == 1;
    if std::env::var(THP_EXCEPT_ADVISED_ENV).as_deref() != Ok("1") || !whole {
        return;
    }
    // SAFETY: as above.
    let narrowed =
        unsafe { libc::prctl(PR_SET_THP_DISABLE, 1, PR_THP_DISABLE_EXCEPT_ADVISED, 0, 0) } == 0;
    if !narrowed {
        let mode = std::fs::read_to_string("/sys/kernel/mm/transparent_hugepage/enabled")
            .unwrap_or_default();
        if may_clear(&mode) {
            // SAFETY: as above.
            unsafe { libc::prctl(PR_SET_THP_DISABLE, 0, 0, 0, 0) };
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_disable_is_cleared_on_an_older_kernel_only_in_madvise_mode_alloc_3() {
        assert!(may_clear("always [madvise] never\n"));
        assert!(!may_clear("[always] madvise never\n"));
        assert!(!may_clear("always madvise [never]\n"));
        assert!(!may_clear(""));
    }
}
