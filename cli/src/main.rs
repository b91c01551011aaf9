//! The native `tpuray` binary: a thin shell over [`tpuray_cli::run`].

/// mimalloc instead of glibc's malloc for every process this binary runs (head, node
/// agents, workers, drivers of `tpuray microbenchmark`): task submission allocates and
/// frees many small strings per task across threads, where glibc's arenas spent a fifth
/// of a driver's CPU (perf, `single client tasks async`), much of it consolidating
/// fastbins.
#[global_allocator]
static ALLOCATOR: mimalloc::MiMalloc = mimalloc::MiMalloc;

fn main() {
    // Die quietly on a closed pipe (`tpuray list tasks | head`), like other
    // command-line tools, instead of panicking in println!.
    // SAFETY: setting a signal disposition before any thread starts.
    unsafe {
        libc::signal(libc::SIGPIPE, libc::SIG_DFL);
    }
    std::process::exit(tpuray_cli::run(std::env::args().collect()));
}
