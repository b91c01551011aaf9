//! The README's placement-group and TPU slice snippet, exactly as written (its
//! `on_a_slice`), run by `tests/readme.rs` on a cluster with a simulated v6e-16 slice.

include!(concat!(env!("OUT_DIR"), "/readme_slice.rs"));

fn main() -> Result<(), tpuray::Error> {
    tpuray::init(None)?;
    on_a_slice()?;
    tpuray::shutdown();
    Ok(())
}
