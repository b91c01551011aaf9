//! What this machine has: CPUs and memory (GPU and TPU detection come with
//! the TPU executor). Reads `/proc`; blocking, called once at start.

/// Logical CPUs available to this process.
pub fn num_cpus() -> usize {
    std::thread::available_parallelism().map(|n| n.get()).unwrap_or(1)
}

/// `MemTotal` and `MemAvailable` from `/proc/meminfo`, in bytes.
pub fn memory_bytes() -> (u64, u64) {
    let Ok(s) = std::fs::read_to_string("/proc/meminfo") else {
        return (0, 0);
    };
    let field = |name: &str| {
        s.lines()
            .find(|l| l.starts_with(name))
            .and_then(|l| l.split_whitespace().nth(1))
            .and_then(|v| v.parse::<u64>().ok())
            .map(|kib| kib * 1024)
            .unwrap_or(0)
    };
    (field("MemTotal:"), field("MemAvailable:"))
}

/// Default object store size when `--object-store-memory` is not given
/// (see [`tpuray_objectstore::default_capacity`]).
pub fn default_object_store_bytes(available: u64) -> u64 {
    tpuray_objectstore::default_capacity(available)
}

/// The `memory` resource: 70% of available memory minus the object store
/// (Ray reports the memory left for tasks and actors the same way).
pub fn memory_resource_bytes(available: u64, object_store: u64) -> u64 {
    ((available as f64 * 0.7) as u64).saturating_sub(object_store)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn this_machine_has_cpus_and_memory() {
        assert!(num_cpus() >= 1);
        let (total, avail) = memory_bytes();
        assert!(total > 0 && avail > 0 && avail <= total);
    }
}
