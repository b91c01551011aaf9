//! The native `tpuray` binary: a thin shell over [`tpuray_cli::run`].

fn main() {
    std::process::exit(tpuray_cli::run(std::env::args().collect()));
}
