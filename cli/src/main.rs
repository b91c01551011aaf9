//! The native `tpuray` binary: a thin shell over [`tpuray_cli::run`].

fn main() {
    // Die quietly on a closed pipe (`tpuray list tasks | head`), like other
    // command-line tools, instead of panicking in println!.
    // SAFETY: setting a signal disposition before any thread starts.
    unsafe {
        libc::signal(libc::SIGPIPE, libc::SIG_DFL);
    }
    std::process::exit(tpuray_cli::run(std::env::args().collect()));
}
