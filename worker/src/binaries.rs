//! Job worker binaries (DESIGN.md §11): a Rust job's driver uploads its own
//! executable to the head's KV, content-addressed by sha256; a node agent
//! fetches it once, verifies the hash, and caches it under
//! `<session>/binaries/<sha256>`, so no shared filesystem is assumed (BIN-1).

use std::path::{Path, PathBuf};

use sha2::Digest;
use tpuray_proto::pb;

/// KV namespace of uploaded binaries (see `tpuray::driver`).
pub const BINARIES_NAMESPACE: &str = "binaries";

/// Returns the cached path of binary `hash`, fetching it from the head first
/// when this node does not have it.
///
/// # Errors
/// A message naming the hash: missing upload, a hash mismatch, disk errors.
pub async fn ensure_binary(
    head: &mut pb::head_service_client::HeadServiceClient<tpuray_proto::client::AuthChannel>,
    cache_dir: &Path,
    hash: &str,
) -> Result<PathBuf, String> {
    if hash.is_empty() || !hash.chars().all(|c| c.is_ascii_hexdigit()) {
        return Err(format!("invalid worker binary hash {hash:?} (expected sha256 hex)"));
    }
    let path = cache_dir.join(hash);
    if path.exists() {
        return Ok(path);
    }
    let get = |key: String| pb::KvGetRequest {
        namespace: BINARIES_NAMESPACE.into(),
        key: key.into_bytes(),
    };
    let meta = head
        .kv_get(get(format!("{hash}/meta")))
        .await
        .map_err(|s| s.message().to_string())?
        .into_inner();
    if !meta.found {
        return Err(format!("worker binary {hash} was never uploaded to the cluster"));
    }
    let meta: serde_json::Value =
        serde_json::from_slice(&meta.value).map_err(|e| format!("binary {hash} metadata: {e}"))?;
    let chunks = meta["chunks"].as_u64().unwrap_or(0);
    let mut bytes = Vec::with_capacity(meta["size"].as_u64().unwrap_or(0) as usize);
    for i in 0..chunks {
        let c = head
            .kv_get(get(format!("{hash}/{i}")))
            .await
            .map_err(|s| s.message().to_string())?
            .into_inner();
        if !c.found {
            return Err(format!("worker binary {hash}: chunk {i} of {chunks} is missing"));
        }
        bytes.extend_from_slice(&c.value);
    }
    let got = format!("{:x}", sha2::Sha256::digest(&bytes));
    if got != hash {
        return Err(format!("worker binary {hash}: downloaded bytes hash to {got}"));
    }
    std::fs::create_dir_all(cache_dir).map_err(|e| format!("{}: {e}", cache_dir.display()))?;
    // A name of its own per fetch: concurrent fetches of one binary (two
    // workers starting at once) must not share a temporary file.
    let tmp = cache_dir.join(format!(".{hash}.{}", tpuray_proto::ids::WorkerId::random()));
    {
        use std::io::Write;
        use std::os::unix::fs::OpenOptionsExt;
        let mut f = std::fs::OpenOptions::new()
            .write(true)
            .create(true)
            .truncate(true)
            .mode(0o755)
            .open(&tmp)
            .map_err(|e| format!("{}: {e}", tmp.display()))?;
        f.write_all(&bytes).map_err(|e| format!("{}: {e}", tmp.display()))?;
    }
    if let Err(e) = std::fs::rename(&tmp, &path) {
        let _ = std::fs::remove_file(&tmp);
        if !path.exists() {
            return Err(format!("{}: {e}", path.display()));
        }
    }
    Ok(path)
}
