//! tpuray attribute macros; `#[tpuray::remote]` and `#[tpuray::actor]` arrive with the core-worker issue.
