//! Generates the gRPC code from `proto/*.proto` with a vendored protoc, so a
//! fresh machine builds with cargo alone.
fn main() -> Result<(), Box<dyn std::error::Error>> {
    let protoc = protoc_bin_vendored::protoc_bin_path()?;
    // SAFETY: build scripts are single-threaded; nothing else reads the environment here.
    unsafe { std::env::set_var("PROTOC", protoc) };
    let files = [
        "proto/common.proto",
        "proto/head.proto",
        "proto/agent.proto",
        "proto/worker.proto",
        "proto/object.proto",
    ];
    for f in files {
        println!("cargo:rerun-if-changed={f}");
    }
    tonic_prost_build::configure().compile_protos(&files, &["proto"])?;
    Ok(())
}
