//! Cluster-token auth (AUTH-1): every RPC carries `authorization: Bearer
//! <token>`; a server in token mode refuses calls without it, or with another
//! token, with `UNAUTHENTICATED` and a message saying which.
//!
//! The token lives in `~/.tpuray/auth_token` (mode 0600), as Ray 2.60 keeps
//! `~/.ray/auth_token`, or comes from `TPURAY_AUTH_TOKEN`.
//!
//! `--auth-mode disabled` on the head opts the whole cluster out: agents and workers
//! follow the head's mode, learnt at registration. Token auth stays on over TLS (TLS-4).

use std::path::PathBuf;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};

use tonic::metadata::MetadataValue;
use tonic::service::Interceptor;
use tonic::{Request, Status};

/// Environment variable that overrides the token file.
pub const TOKEN_ENV: &str = "TPURAY_AUTH_TOKEN";

/// Environment variable a node agent sets for its workers: `token` or
/// `disabled`, the cluster's auth mode.
pub const AUTH_MODE_ENV: &str = "TPURAY_AUTH_MODE";

/// Errors reading or creating the token.
#[derive(Debug, thiserror::Error)]
pub enum AuthError {
    #[error("cannot find the home directory for the cluster token (set HOME or {TOKEN_ENV})")]
    NoHome,
    #[error("cannot read or write cluster token file {path}: {source}")]
    Io { path: PathBuf, source: std::io::Error },
    #[error("cluster token file {0} is empty")]
    Empty(PathBuf),
}

/// Path of the token file: `$HOME/.tpuray/auth_token`.
pub fn token_path() -> Result<PathBuf, AuthError> {
    let home = std::env::var_os("HOME").ok_or(AuthError::NoHome)?;
    Ok(PathBuf::from(home).join(".tpuray").join("auth_token"))
}

/// The cluster token from `TPURAY_AUTH_TOKEN` or the token file, if any.
pub fn load_token() -> Result<Option<String>, AuthError> {
    if let Ok(t) = std::env::var(TOKEN_ENV) {
        let t = t.trim().to_string();
        if !t.is_empty() {
            return Ok(Some(t));
        }
    }
    let path = token_path()?;
    match std::fs::read_to_string(&path) {
        Ok(s) => {
            let s = s.trim().to_string();
            if s.is_empty() { Err(AuthError::Empty(path)) } else { Ok(Some(s)) }
        }
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(None),
        Err(e) => Err(AuthError::Io { path, source: e }),
    }
}

/// The token, generating and storing a new one (mode 0600) when there is none.
pub fn load_or_create_token() -> Result<String, AuthError> {
    if let Some(t) = load_token()? {
        return Ok(t);
    }
    let path = token_path()?;
    let dir = path.parent().expect("token path has a parent");
    let io = |source| AuthError::Io { path: path.clone(), source };
    std::fs::create_dir_all(dir).map_err(io)?;
    let token =
        uuid::Uuid::new_v4().simple().to_string() + &uuid::Uuid::new_v4().simple().to_string();
    // Write to a private temp file, then rename, so a concurrent reader never sees half a token.
    let tmp = dir.join(format!(".auth_token.{}", std::process::id()));
    {
        use std::io::Write;
        use std::os::unix::fs::OpenOptionsExt;
        let mut f = std::fs::OpenOptions::new()
            .write(true)
            .create(true)
            .truncate(true)
            .mode(0o600)
            .open(&tmp)
            .map_err(io)?;
        f.write_all(token.as_bytes()).map_err(io)?;
    }
    // Another process may have won the race: keep its token.
    if let Some(existing) = load_token()? {
        let _ = std::fs::remove_file(&tmp);
        return Ok(existing);
    }
    std::fs::rename(&tmp, &path).map_err(io)?;
    Ok(token)
}

/// Adds the token to every outgoing request.
#[derive(Clone)]
pub struct ClientAuth {
    header: Option<MetadataValue<tonic::metadata::Ascii>>,
}

impl ClientAuth {
    /// A client interceptor sending `token` (none: send nothing).
    pub fn new(token: Option<&str>) -> Self {
        let header = token.and_then(|t| format!("Bearer {t}").parse().ok());
        Self { header }
    }
}

impl Interceptor for ClientAuth {
    fn call(&mut self, mut req: Request<()>) -> Result<Request<()>, Status> {
        if let Some(h) = &self.header {
            req.metadata_mut().insert("authorization", h.clone());
        }
        Ok(req)
    }
}

/// Checks the token on every incoming request while `required` is set.
#[derive(Clone)]
pub struct ServerAuth {
    token: Arc<str>,
    required: Arc<AtomicBool>,
}

impl ServerAuth {
    /// A server interceptor that accepts only `token` when `required`.
    pub fn new(token: &str, required: bool) -> Self {
        Self { token: Arc::from(token), required: Arc::new(AtomicBool::new(required)) }
    }

    /// Turns checking on or off (a node agent follows its head's mode).
    pub fn set_required(&self, required: bool) {
        self.required.store(required, Ordering::SeqCst);
    }

    /// Whether tokens are checked.
    pub fn required(&self) -> bool {
        self.required.load(Ordering::SeqCst)
    }

    /// Checks one request's metadata.
    pub fn check(&self, md: &tonic::metadata::MetadataMap) -> Result<(), Status> {
        if !self.required() {
            return Ok(());
        }
        let Some(v) = md.get("authorization") else {
            return Err(Status::unauthenticated(
                "missing cluster token: this cluster requires auth; the token is in ~/.tpuray/auth_token on the head's machine or in TPURAY_AUTH_TOKEN",
            ));
        };
        let got = v.to_str().unwrap_or("");
        let got = got.strip_prefix("Bearer ").unwrap_or(got);
        if constant_time_eq(got.as_bytes(), self.token.as_bytes()) {
            Ok(())
        } else {
            Err(Status::unauthenticated(
                "wrong cluster token: the token sent does not match this cluster's (check ~/.tpuray/auth_token or TPURAY_AUTH_TOKEN)",
            ))
        }
    }
}

impl Interceptor for ServerAuth {
    fn call(&mut self, req: Request<()>) -> Result<Request<()>, Status> {
        self.check(req.metadata())?;
        Ok(req)
    }
}

fn constant_time_eq(a: &[u8], b: &[u8]) -> bool {
    if a.len() != b.len() {
        return false;
    }
    a.iter().zip(b).fold(0u8, |acc, (x, y)| acc | (x ^ y)) == 0
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn server_refuses_missing_and_wrong_tokens_with_named_errors() {
        let s = ServerAuth::new("secret", true);
        let mut md = tonic::metadata::MetadataMap::new();
        let e = s.check(&md).unwrap_err();
        assert_eq!(e.code(), tonic::Code::Unauthenticated);
        assert!(e.message().contains("missing cluster token"));
        md.insert("authorization", "Bearer nope".parse().unwrap());
        assert!(s.check(&md).unwrap_err().message().contains("wrong cluster token"));
        md.insert("authorization", "Bearer secret".parse().unwrap());
        assert!(s.check(&md).is_ok());
        s.set_required(false);
        assert!(s.check(&tonic::metadata::MetadataMap::new()).is_ok());
    }
}
