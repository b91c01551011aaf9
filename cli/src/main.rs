//! The native `tpuray` binary: a thin shell over [`tpuray_cli::run`].
//!
//! ALLOC-1: this binary and the Python extension (`python-sdk/src/lib.rs`) allocate
//! through mimalloc (`#[global_allocator]`); with glibc's malloc, allocating and freeing
//! task specs, events and replies across runtime threads was a fifth of a driver's CPU.
//! Rust drivers and workers built by users keep the allocator their binary chooses.

/// ALLOC-1: mimalloc instead of glibc's malloc for every process this binary runs (head, node
/// agents, workers, drivers of `tpuray microbenchmark`): task submission allocates and
/// frees many small strings per task across threads, where glibc's arenas spent a fifth
/// of a driver's CPU (perf, `single client tasks async`), much of it consolidating
/// fastbins.
#[global_allocator]
static ALLOCATOR: mimalloc::MiMalloc = mimalloc::MiMalloc;

fn main() {
    // SIGPIPE stays ignored (Rust's default) in every command: a socket write to a peer
    // that hung up (a plain client that a TLS server refused, hyper's vectored writes,
    // which cannot pass MSG_NOSIGNAL) must fail that connection with EPIPE, not kill the
    // command before it can name why. A closed stdout (`tpuray list tasks | head`) still
    // ends the command quietly, as other command-line tools do: println! panics on EPIPE,
    // and this hook turns that one panic into a silent exit with SIGPIPE's status (141).
    let default_hook = std::panic::take_hook();
    std::panic::set_hook(Box::new(move |info| {
        let msg = info
            .payload()
            .downcast_ref::<String>()
            .map(String::as_str)
            .or_else(|| info.payload().downcast_ref::<&str>().copied())
            .unwrap_or("");
        if msg.starts_with("failed printing to stdout") && msg.contains("Broken pipe") {
            std::process::exit(128 + libc::SIGPIPE);
        }
        default_hook(info);
    }));
    std::process::exit(tpuray_cli::run(std::env::args().collect()));
}

#[cfg(test)]
mod tests {
    /// ALLOC-1: what this binary allocates comes from mimalloc's heap (with glibc's
    /// malloc the pointer lies outside every mimalloc region).
    #[test]
    fn alloc1_this_binary_allocates_through_mimalloc() {
        let boxed = Box::new([7u8; 64]);
        let p = std::ptr::from_ref(&*boxed).cast::<std::ffi::c_void>();
        // SAFETY: mi_is_in_heap_region only compares the address with mimalloc's regions.
        assert!(unsafe { libmimalloc_sys::mi_is_in_heap_region(p) }, "not mimalloc's memory");
    }
}
