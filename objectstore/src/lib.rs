//! tpuray's per-node object store (DESIGN.md §4). This first part fixes the
//! store's capacity rule; the shared-memory arena, sealing, zero-copy reads
//! and transfer arrive with the core-worker and object-store issues.

/// Ray's default object store size: 30% of the memory available when the
/// node starts, capped at 200 GB (Ray's `ray_constants.py`
/// `DEFAULT_OBJECT_STORE_MEMORY_PROPORTION` and `..._MAX_BYTES`).
///
/// `available_bytes`: `MemAvailable` in bytes. Returns bytes.
pub fn default_capacity(available_bytes: u64) -> u64 {
    const PROPORTION: f64 = 0.3;
    const MAX_BYTES: u64 = 200_000_000_000;
    ((available_bytes as f64 * PROPORTION) as u64).min(MAX_BYTES)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn default_capacity_is_thirty_percent_capped_at_200_gb() {
        assert_eq!(default_capacity(1000), 300);
        assert_eq!(default_capacity(10_000_000_000_000), 200_000_000_000);
    }
}
