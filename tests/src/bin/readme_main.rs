//! The README's first Rust example ("Rust SDK"), exactly as written: `tests/build.rs`
//! copies it out of README.md and `tests/readme.rs` runs it against a cluster.

// The README keeps its example short: `Counter::new` without a `Default` impl.
#![allow(clippy::new_without_default)]

include!(concat!(env!("OUT_DIR"), "/readme_main.rs"));
