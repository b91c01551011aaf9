//! Files kept in the head's KV in chunks (each KV value stays far below the 64 MiB
//! message limit): Jobs API packages (`working_dir` zips, namespace [`PACKAGES_NAMESPACE`],
//! keyed by their URI). Layout: `<key>/meta` holds `{"size": N, "chunks": C, "sha256": H}`,
//! `<key>/<i>` chunk `i`. The meta entry is written last, so a package is visible only
//! once every chunk is stored.

use sha2::Digest;

use crate::client::AuthChannel;
use crate::pb;
use crate::pb::head_service_client::HeadServiceClient;

/// KV namespace of Jobs API packages.
pub const PACKAGES_NAMESPACE: &str = "packages";
/// Bytes per chunk.
pub const CHUNK_BYTES: usize = 8 * 1024 * 1024;
/// Largest package accepted, in bytes (Ray's limit for uploaded packages is 512 MiB,
/// `GCS_STORAGE_MAX_SIZE`).
pub const MAX_PACKAGE_BYTES: usize = 512 * 1024 * 1024;

type Head = HeadServiceClient<AuthChannel>;

fn kv_key(key: &str, part: &str) -> Vec<u8> {
    format!("{key}/{part}").into_bytes()
}

/// Whether `key` is stored completely.
///
/// # Errors
/// The head's status.
pub async fn exists(head: &mut Head, namespace: &str, key: &str) -> Result<bool, tonic::Status> {
    let r = head
        .kv_get(pb::KvGetRequest { namespace: namespace.into(), key: kv_key(key, "meta") })
        .await?;
    Ok(r.into_inner().found)
}

/// Stores `bytes` under `key` (replacing what was there).
///
/// # Errors
/// `OUT_OF_RANGE` above [`MAX_PACKAGE_BYTES`]; else the head's status.
pub async fn put(
    head: &mut Head,
    namespace: &str,
    key: &str,
    bytes: &[u8],
) -> Result<(), tonic::Status> {
    if bytes.len() > MAX_PACKAGE_BYTES {
        return Err(tonic::Status::out_of_range(format!(
            "package {key} is {} bytes, more than the limit of {MAX_PACKAGE_BYTES} bytes",
            bytes.len()
        )));
    }
    let chunks: Vec<&[u8]> = bytes.chunks(CHUNK_BYTES).collect();
    for (i, c) in chunks.iter().enumerate() {
        head.kv_put(pb::KvPutRequest {
            namespace: namespace.into(),
            key: kv_key(key, &i.to_string()),
            value: c.to_vec(),
            overwrite: true,
            ..Default::default()
        })
        .await?;
    }
    let meta = serde_json::json!({
        "size": bytes.len(),
        "chunks": chunks.len(),
        "sha256": format!("{:x}", sha2::Sha256::digest(bytes)),
    });
    head.kv_put(pb::KvPutRequest {
        namespace: namespace.into(),
        key: kv_key(key, "meta"),
        value: meta.to_string().into_bytes(),
        overwrite: true,
        ..Default::default()
    })
    .await?;
    Ok(())
}

/// The bytes stored under `key`, `None` when there are none.
///
/// # Errors
/// A message naming the key: a missing chunk, bytes that do not match the stored hash,
/// the head's status.
pub async fn get(head: &mut Head, namespace: &str, key: &str) -> Result<Option<Vec<u8>>, String> {
    let get =
        |part: String| pb::KvGetRequest { namespace: namespace.into(), key: kv_key(key, &part) };
    let meta = head.kv_get(get("meta".into())).await.map_err(|s| s.message().to_string())?;
    let meta = meta.into_inner();
    if !meta.found {
        return Ok(None);
    }
    let meta: serde_json::Value =
        serde_json::from_slice(&meta.value).map_err(|e| format!("package {key}: metadata: {e}"))?;
    let chunks = meta["chunks"].as_u64().unwrap_or(0);
    let mut bytes = Vec::with_capacity(meta["size"].as_u64().unwrap_or(0) as usize);
    for i in 0..chunks {
        let c = head.kv_get(get(i.to_string())).await.map_err(|s| s.message().to_string())?;
        let c = c.into_inner();
        if !c.found {
            return Err(format!("package {key}: chunk {i} of {chunks} is missing"));
        }
        bytes.extend_from_slice(&c.value);
    }
    let got = format!("{:x}", sha2::Sha256::digest(&bytes));
    if meta["sha256"].as_str() != Some(got.as_str()) {
        return Err(format!(
            "package {key}: the stored bytes hash to {got}, not {}",
            meta["sha256"]
        ));
    }
    Ok(Some(bytes))
}
