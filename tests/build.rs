//! Extracts the README's Rust snippets (its ```` ```rust ```` blocks, in order) into
//! `OUT_DIR`, where the `readme_main` and `readme_slice` binaries include them as
//! written, so a README snippet that stops compiling fails the build and one that stops
//! working fails `tests/readme.rs`.

use std::path::Path;

fn main() {
    let readme = Path::new(env!("CARGO_MANIFEST_DIR")).join("../README.md");
    println!("cargo:rerun-if-changed={}", readme.display());
    let text = std::fs::read_to_string(&readme).expect("read README.md");
    let mut blocks = Vec::new();
    let mut current: Option<String> = None;
    for line in text.lines() {
        match &mut current {
            None if line.trim_start() == "```rust" => current = Some(String::new()),
            Some(_) if line.trim_start() == "```" => blocks.push(current.take().unwrap()),
            Some(b) => {
                b.push_str(line);
                b.push('\n');
            }
            None => {}
        }
    }
    assert!(blocks.len() >= 2, "README.md has {} ```rust blocks, expected 2", blocks.len());
    let out = std::env::var("OUT_DIR").expect("OUT_DIR");
    std::fs::write(Path::new(&out).join("readme_main.rs"), &blocks[0]).unwrap();
    std::fs::write(Path::new(&out).join("readme_slice.rs"), &blocks[1]).unwrap();
}
