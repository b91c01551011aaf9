//! Mutual TLS between every tpuray process (TLS-1..TLS-4): the process's TLS identity,
//! the rustls configurations made from it, the accept loop servers use, and readable
//! explanations of rustls errors.
//!
//! - TLS-1: a process uses TLS when it has a certificate, its key and the cluster's CA:
//!   `--tls-cert`, `--tls-key`, `--tls-ca` on `tpuray start` (which hands them to its
//!   head and agent as the environment), or [`CERT_ENV`], [`KEY_ENV`], [`CA_ENV`] for
//!   drivers, the CLI and workers (which inherit them from their agent). All three or
//!   none: a partial set is refused naming what is missing. The identity is read once per
//!   process, at the first channel or server made ([`current`]), or set before that by
//!   [`install`].
//! - TLS-2: every server asks for and verifies a client certificate signed by the CA
//!   (mutual TLS); every client verifies the server's certificate against the CA and the
//!   host it dials (the host part of `HOST:PORT`, a DNS name or an IP address), so a
//!   certificate must name every address it is reached by (`tpuray tls make-cert` adds
//!   `localhost`, `127.0.0.1` and `::1` to the hosts given). Certificates carry both the
//!   serverAuth and the clientAuth extended key usages: every process is both.
//! - TLS-3: a cluster is all-TLS or all-plain. A plain process dialling a TLS server (or
//!   the reverse) fails its handshake; [`probe`] tells which side speaks TLS so the error
//!   names the mismatch, and the head reports its mode at registration.
//! - TLS-4: a handshake that fails is reported on both sides with its reason in words
//!   ([`explain`]): another CA, an expired certificate, no certificate, a name mismatch,
//!   a peer that does not speak TLS. Token auth stays on top of TLS.
//!
//! The plain path is untouched: with TLS off, channels and servers are built exactly as
//! before (no wrapper, no extra allocation or copy per call).
//!
//! rustls with the ring provider only (no aws-lc-rs); TLS 1.3 and 1.2.
//! [`incoming`] and [`accept`] need a tokio runtime; the rest does not block.
//!
//! Where each side lives. Servers: tonic's behind [`incoming`], the h2 worker server
//! ([`crate::h2grpc`]), axum behind [`HttpsListener`]. Clients: tonic's `Endpoint` with
//! `tls-ring`, the h2 channel, and the CLI's HTTP/WebSocket clients through
//! [`ClientStream`]. `tpuray start --tls-*` hands the files to the head and agent as
//! `TPURAY_TLS_*`, which workers inherit; drivers and the CLI read `TPURAY_TLS_*`.
//! Handshakes run in a task per connection, so a slow one holds up no other.
//!
//! TLS-3 in detail: the head reports `tls` in `GetHeadInfo` and `RegisterNode` replies
//! (checked at registration, as AUTH-1's mode), and a failed connection is diagnosed by
//! [`diagnose`]: an HTTP/2-preface probe tells a TLS server from a plain one, and a
//! handshake and first read surface the alert of a server that refused this process's
//! certificate, which TLS 1.3 delivers after the client's handshake completed. TLS-4:
//! servers log each refused handshake.

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::sync::{Arc, OnceLock};
use std::time::Duration;

use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, PrivateKeyDer, ServerName};
use rustls::server::WebPkiClientVerifier;
use tokio::net::{TcpListener, TcpStream};

/// The process's certificate (PEM), signed by the cluster's CA.
pub const CERT_ENV: &str = "TPURAY_TLS_CERT";
/// The private key of [`CERT_ENV`]'s certificate (PEM).
pub const KEY_ENV: &str = "TPURAY_TLS_KEY";
/// The cluster's CA certificate (PEM): peers' certificates must be signed by it.
pub const CA_ENV: &str = "TPURAY_TLS_CA";

/// How long a server waits for a new connection's TLS handshake.
const HANDSHAKE_TIMEOUT: Duration = Duration::from_secs(10);

/// Errors loading a TLS identity.
#[derive(Debug, thiserror::Error)]
pub enum TlsError {
    #[error(
        "TLS needs a certificate, its key and the cluster's CA together (--tls-cert, --tls-key, --tls-ca, or {CERT_ENV}, {KEY_ENV}, {CA_ENV}): {0} missing"
    )]
    Incomplete(String),
    #[error("cannot read the TLS {what} {path}: {source}")]
    Read { what: &'static str, path: PathBuf, source: std::io::Error },
    #[error("the TLS {what} {path} is not valid: {detail}")]
    Bad { what: &'static str, path: PathBuf, detail: String },
    #[error("this process already uses {0}")]
    AlreadySet(String),
}

/// Where a process's TLS identity lives.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct TlsFiles {
    /// This process's certificate (PEM; a chain may follow it).
    pub cert: PathBuf,
    /// Its private key (PEM: PKCS#8, PKCS#1 or SEC1).
    pub key: PathBuf,
    /// The cluster's CA certificate (PEM).
    pub ca: PathBuf,
}

impl TlsFiles {
    /// All three paths, or none (plain).
    ///
    /// # Errors
    /// [`TlsError::Incomplete`] naming the missing ones when only some are given.
    pub fn from_parts(
        cert: Option<PathBuf>,
        key: Option<PathBuf>,
        ca: Option<PathBuf>,
    ) -> Result<Option<Self>, TlsError> {
        match (cert, key, ca) {
            (None, None, None) => Ok(None),
            (Some(cert), Some(key), Some(ca)) => Ok(Some(TlsFiles { cert, key, ca })),
            (c, k, a) => {
                let missing: Vec<&str> = [
                    (c.is_none(), "the certificate (--tls-cert / TPURAY_TLS_CERT)"),
                    (k.is_none(), "the key (--tls-key / TPURAY_TLS_KEY)"),
                    (a.is_none(), "the CA (--tls-ca / TPURAY_TLS_CA)"),
                ]
                .into_iter()
                .filter(|(m, _)| *m)
                .map(|(_, w)| w)
                .collect();
                Err(TlsError::Incomplete(missing.join(" and ")))
            }
        }
    }

    /// From [`CERT_ENV`], [`KEY_ENV`] and [`CA_ENV`] (empty values count as unset).
    ///
    /// # Errors
    /// [`TlsError::Incomplete`] when only some are set.
    pub fn from_env() -> Result<Option<Self>, TlsError> {
        let var = |k: &str| std::env::var_os(k).filter(|v| !v.is_empty()).map(PathBuf::from);
        Self::from_parts(var(CERT_ENV), var(KEY_ENV), var(CA_ENV))
    }

    /// The environment that hands this identity to a child process, paths made absolute.
    pub fn env(&self) -> Vec<(&'static str, String)> {
        let abs = |p: &Path| std::path::absolute(p).unwrap_or_else(|_| p.to_path_buf());
        vec![
            (CERT_ENV, abs(&self.cert).display().to_string()),
            (KEY_ENV, abs(&self.key).display().to_string()),
            (CA_ENV, abs(&self.ca).display().to_string()),
        ]
    }
}

/// A loaded TLS identity and the configurations made from it.
pub struct Tls {
    files: TlsFiles,
    cert_pem: Vec<u8>,
    key_pem: Vec<u8>,
    ca_pem: Vec<u8>,
    grpc_server: Arc<rustls::ServerConfig>,
    http_server: Arc<rustls::ServerConfig>,
    grpc_client: Arc<rustls::ClientConfig>,
    http_client: Arc<rustls::ClientConfig>,
}

impl std::fmt::Debug for Tls {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Tls").field("files", &self.files).finish_non_exhaustive()
    }
}

fn provider() -> Arc<rustls::crypto::CryptoProvider> {
    Arc::new(rustls::crypto::ring::default_provider())
}

impl Tls {
    /// Reads and checks the three files.
    ///
    /// # Errors
    /// [`TlsError`] naming the file that cannot be read or parsed, or a key that does
    /// not match its certificate.
    pub fn load(files: &TlsFiles) -> Result<Self, TlsError> {
        let read = |what: &'static str, path: &Path| {
            std::fs::read(path).map_err(|source| TlsError::Read {
                what,
                path: path.to_path_buf(),
                source,
            })
        };
        let bad = |what: &'static str, path: &Path, detail: String| TlsError::Bad {
            what,
            path: path.to_path_buf(),
            detail,
        };
        let cert_pem = read("certificate", &files.cert)?;
        let key_pem = read("key", &files.key)?;
        let ca_pem = read("CA certificate", &files.ca)?;
        let chain: Vec<CertificateDer<'static>> = CertificateDer::pem_slice_iter(&cert_pem)
            .collect::<Result<_, _>>()
            .map_err(|e| bad("certificate", &files.cert, e.to_string()))?;
        if chain.is_empty() {
            return Err(bad("certificate", &files.cert, "no PEM CERTIFICATE block".into()));
        }
        let key = PrivateKeyDer::from_pem_slice(&key_pem)
            .map_err(|e| bad("key", &files.key, format!("no PEM private key ({e})")))?;
        let mut roots = rustls::RootCertStore::empty();
        let cas: Vec<CertificateDer<'static>> = CertificateDer::pem_slice_iter(&ca_pem)
            .collect::<Result<_, _>>()
            .map_err(|e| bad("CA certificate", &files.ca, e.to_string()))?;
        if cas.is_empty() {
            return Err(bad("CA certificate", &files.ca, "no PEM CERTIFICATE block".into()));
        }
        for c in cas {
            roots.add(c).map_err(|e| bad("CA certificate", &files.ca, e.to_string()))?;
        }
        let roots = Arc::new(roots);
        let verifier = WebPkiClientVerifier::builder_with_provider(Arc::clone(&roots), provider())
            .build()
            .map_err(|e| bad("CA certificate", &files.ca, e.to_string()))?;
        let server = |alpn: &[&[u8]]| -> Result<Arc<rustls::ServerConfig>, TlsError> {
            let mut c = rustls::ServerConfig::builder_with_provider(provider())
                .with_safe_default_protocol_versions()
                .map_err(|e| bad("certificate", &files.cert, e.to_string()))?
                .with_client_cert_verifier(Arc::clone(&verifier))
                .with_single_cert(chain.clone(), key.clone_key())
                .map_err(|e| {
                    bad("key", &files.key, format!("{e} (does it match {}?)", files.cert.display()))
                })?;
            c.alpn_protocols = alpn.iter().map(|p| p.to_vec()).collect();
            Ok(Arc::new(c))
        };
        let client = |alpn: &[&[u8]]| -> Result<Arc<rustls::ClientConfig>, TlsError> {
            let mut c = rustls::ClientConfig::builder_with_provider(provider())
                .with_safe_default_protocol_versions()
                .map_err(|e| bad("certificate", &files.cert, e.to_string()))?
                .with_root_certificates(Arc::clone(&roots))
                .with_client_auth_cert(chain.clone(), key.clone_key())
                .map_err(|e| {
                    bad("key", &files.key, format!("{e} (does it match {}?)", files.cert.display()))
                })?;
            c.alpn_protocols = alpn.iter().map(|p| p.to_vec()).collect();
            Ok(Arc::new(c))
        };
        Ok(Tls {
            grpc_server: server(&[b"h2"])?,
            http_server: server(&[b"http/1.1"])?,
            grpc_client: client(&[b"h2"])?,
            http_client: client(&[b"http/1.1"])?,
            files: files.clone(),
            cert_pem,
            key_pem,
            ca_pem,
        })
    }

    /// Where this identity was read from.
    pub fn files(&self) -> &TlsFiles {
        &self.files
    }

    /// tonic's client TLS for a channel (the server name is the host tonic dials).
    pub fn tonic_client(&self) -> tonic::transport::ClientTlsConfig {
        tonic::transport::ClientTlsConfig::new()
            .ca_certificate(tonic::transport::Certificate::from_pem(&self.ca_pem))
            .identity(tonic::transport::Identity::from_pem(&self.cert_pem, &self.key_pem))
            .timeout(HANDSHAKE_TIMEOUT)
    }

    /// An acceptor for gRPC servers (ALPN `h2`), asking for a client certificate.
    pub fn grpc_acceptor(&self) -> tokio_rustls::TlsAcceptor {
        tokio_rustls::TlsAcceptor::from(Arc::clone(&self.grpc_server))
    }

    /// An acceptor for HTTP servers (ALPN `http/1.1`), asking for a client
    /// certificate.
    pub fn http_acceptor(&self) -> tokio_rustls::TlsAcceptor {
        tokio_rustls::TlsAcceptor::from(Arc::clone(&self.http_server))
    }

    /// A connector for h2 channels (ALPN `h2`).
    pub fn grpc_connector(&self) -> tokio_rustls::TlsConnector {
        tokio_rustls::TlsConnector::from(Arc::clone(&self.grpc_client))
    }

    /// A connector for HTTP/1.1 clients (the CLI's Jobs and dashboard clients).
    pub fn http_connector(&self) -> tokio_rustls::TlsConnector {
        tokio_rustls::TlsConnector::from(Arc::clone(&self.http_client))
    }
}

/// The name a client verifies the server's certificate against: the host of
/// `HOST:PORT` (brackets of an IPv6 address removed).
///
/// # Errors
/// A message naming `addr` when its host is neither a DNS name nor an IP address.
pub fn server_name(addr: &str) -> Result<ServerName<'static>, String> {
    let host = addr.rsplit_once(':').map_or(addr, |(h, _)| h);
    let host = host.trim_start_matches('[').trim_end_matches(']');
    ServerName::try_from(host.to_string())
        .map_err(|e| format!("{host:?} (from {addr:?}) is not a host name for TLS: {e}"))
}

static CURRENT: OnceLock<Result<Option<Arc<Tls>>, String>> = OnceLock::new();

/// Sets this process's TLS identity (`None`: plain) before any channel or server is
/// made (TLS-1).
///
/// # Errors
/// The load error, or a message when an identity was already in use and differs.
pub fn install(files: Option<&TlsFiles>) -> Result<(), TlsError> {
    let loaded = match files {
        Some(f) => Some(Arc::new(Tls::load(f)?)),
        None => None,
    };
    let wanted = loaded.as_ref().map(|t| t.files.clone());
    let got = CURRENT.get_or_init(|| Ok(loaded));
    let now = match got {
        Ok(t) => t.as_ref().map(|t| t.files.clone()),
        Err(_) => None,
    };
    if now != wanted {
        return Err(TlsError::AlreadySet(match now {
            Some(f) => format!("the TLS identity of {}", f.cert.display()),
            None => "no TLS identity (plain)".into(),
        }));
    }
    Ok(())
}

/// This process's TLS identity: the one [`install`]ed, or else the one [`CERT_ENV`],
/// [`KEY_ENV`] and [`CA_ENV`] name, read at the first call; `None` when plain.
///
/// # Errors
/// The message of the [`TlsError`] met loading it (every later call returns it too).
pub fn current() -> Result<Option<&'static Arc<Tls>>, String> {
    let got = CURRENT.get_or_init(|| {
        let files = TlsFiles::from_env().map_err(|e| e.to_string())?;
        match files {
            Some(f) => Tls::load(&f).map(|t| Some(Arc::new(t))).map_err(|e| e.to_string()),
            None => Ok(None),
        }
    });
    match got {
        Ok(t) => Ok(t.as_ref()),
        Err(e) => Err(e.clone()),
    }
}

/// Whether this process uses TLS (false when its identity failed to load).
pub fn enabled() -> bool {
    matches!(current(), Ok(Some(_)))
}

/// TLS-4: a rustls error in words, naming the reason (`peer` is who sent the
/// certificate or the alert: "the server", "the client", "the peer").
pub fn explain(e: &rustls::Error, peer: &str) -> String {
    use rustls::{AlertDescription as A, CertificateError as C, Error as E};
    match e {
        E::InvalidCertificate(c) => match c {
            C::UnknownIssuer | C::BadSignature => format!(
                "{peer}'s certificate is not signed by this cluster's CA ({CA_ENV} / --tls-ca)"
            ),
            C::InvalidPurpose | C::InvalidPurposeContext { .. } => format!(
                "{peer}'s certificate is not for this use (it needs both the serverAuth and clientAuth extended key usages; make it with `tpuray tls make-cert`)"
            ),
            C::NotValidForName => format!(
                "{peer}'s certificate does not name the address dialled (make it with `tpuray tls make-cert --host` naming every host name and IP it is reached by)"
            ),
            C::Expired | C::ExpiredContext { .. } => {
                format!("{peer}'s certificate has expired ({c})")
            }
            C::NotValidYet | C::NotValidYetContext { .. } => {
                format!("{peer}'s certificate is not valid yet ({c}; check the clocks)")
            }
            C::NotValidForNameContext { expected, .. } => format!(
                "{peer}'s certificate does not name {}, the address dialled (make it with `tpuray tls make-cert --host` naming every host name and IP it is reached by)",
                expected.to_str()
            ),
            C::Revoked => format!("{peer}'s certificate is revoked"),
            other => format!("{peer}'s certificate is not valid: {other}"),
        },
        E::AlertReceived(a) => match a {
            A::UnknownCA | A::BadCertificate | A::DecryptError => {
                format!("{peer} refused this process's certificate: not signed by its CA ({a:?})")
            }
            A::CertificateExpired => {
                format!("{peer} refused this process's certificate: it has expired")
            }
            A::CertificateRequired => format!(
                "{peer} requires a certificate and this process sent none (set --tls-cert, --tls-key and --tls-ca, or {CERT_ENV}, {KEY_ENV} and {CA_ENV})"
            ),
            A::CertificateUnknown | A::UnsupportedCertificate => {
                format!("{peer} refused this process's certificate ({a:?})")
            }
            A::NoApplicationProtocol => {
                format!("{peer} speaks another protocol over TLS (no common ALPN protocol)")
            }
            other => format!("{peer} ended the TLS handshake: alert {other:?}"),
        },
        E::NoCertificatesPresented => format!(
            "{peer} sent no certificate: it does not use TLS with a certificate of this cluster (a plain process, or one without --tls-cert)"
        ),
        E::InvalidMessage(_) => format!(
            "TLS mismatch: {peer} does not speak TLS: this process uses TLS and {peer} is plain (a cluster is all-TLS or all-plain)"
        ),
        other => format!("TLS handshake with {peer} failed: {other}"),
    }
}

/// The first rustls error under `e` (itself, or wrapped in `std::io::Error`s), in words.
pub fn explain_chain(e: &(dyn std::error::Error + 'static), peer: &str) -> Option<String> {
    let mut cur = Some(e);
    while let Some(err) = cur {
        if let Some(r) = err.downcast_ref::<rustls::Error>() {
            return Some(explain(r, peer));
        }
        if let Some(io) = err.downcast_ref::<std::io::Error>()
            && let Some(inner) = io.get_ref()
            && let Some(r) = inner.downcast_ref::<rustls::Error>()
        {
            return Some(explain(r, peer));
        }
        cur = err.source();
    }
    None
}

/// TLS-4: the reason in words when `s` failed in a TLS handshake (its server named
/// "the server"); `None` for any other failure.
pub fn status_reason(s: &tonic::Status) -> Option<String> {
    explain_chain(std::error::Error::source(s)?, "the server")
}

/// The reason a server-side handshake failed, in words.
fn refused_reason(e: &std::io::Error) -> String {
    explain_chain(e, "the client").unwrap_or_else(|| e.to_string())
}

/// TLS-2: accepts connections on `listener` and runs each handshake in a task of its
/// own (a slow one never holds up the others), handing on the sessions that complete.
/// A refused handshake is logged with its reason (TLS-4) and dropped. Ends when the
/// receiver is dropped. `what` names the server in the log ("head", "node agent").
pub fn accept(
    listener: TcpListener,
    acceptor: tokio_rustls::TlsAcceptor,
    what: &'static str,
) -> tokio::sync::mpsc::Receiver<(tokio_rustls::server::TlsStream<TcpStream>, SocketAddr)> {
    let (tx, rx) = tokio::sync::mpsc::channel(64);
    tokio::spawn(async move {
        loop {
            let (tcp, peer) = tokio::select! {
                () = tx.closed() => return,
                a = listener.accept() => match a {
                    Ok(a) => a,
                    Err(_) => {
                        // Out of file descriptors: wait and go on, as tonic's server does.
                        tokio::time::sleep(Duration::from_millis(50)).await;
                        continue;
                    }
                },
            };
            let _ = tcp.set_nodelay(true);
            let tx = tx.clone();
            let acceptor = acceptor.clone();
            tokio::spawn(async move {
                match tokio::time::timeout(HANDSHAKE_TIMEOUT, acceptor.accept(tcp)).await {
                    Ok(Ok(s)) => {
                        let _ = tx.send((s, peer)).await;
                    }
                    Ok(Err(e)) => tracing::warn!(
                        "the {what} refused a TLS connection from {peer}: {}",
                        refused_reason(&e)
                    ),
                    Err(_) => tracing::warn!(
                        "the {what} dropped a connection from {peer}: no TLS handshake within {HANDSHAKE_TIMEOUT:?}"
                    ),
                }
            });
        }
    });
    rx
}

/// The sessions [`accept`] hands on, as the stream of connections tonic's
/// `serve_with_incoming*` takes.
pub fn incoming(
    listener: TcpListener,
    tls: &Tls,
    what: &'static str,
) -> impl tokio_stream::Stream<Item = Result<tokio_rustls::server::TlsStream<TcpStream>, std::io::Error>>
+ Send
+ 'static {
    use tokio_stream::StreamExt;
    tokio_stream::wrappers::ReceiverStream::new(accept(listener, tls.grpc_acceptor(), what))
        .map(|(s, _)| Ok(s))
}

/// An HTTPS listener for `axum::serve` (TLS-2): the sessions [`accept`] hands on, with
/// client certificates required as on every tpuray server.
pub struct HttpsListener {
    rx: tokio::sync::mpsc::Receiver<(tokio_rustls::server::TlsStream<TcpStream>, SocketAddr)>,
    local: SocketAddr,
}

impl HttpsListener {
    /// Serves HTTPS on `listener` with `tls`'s HTTP acceptor; `what` names the server in
    /// the log of refused handshakes.
    ///
    /// # Errors
    /// The listener's local address cannot be read.
    pub fn new(listener: TcpListener, tls: &Tls, what: &'static str) -> std::io::Result<Self> {
        let local = listener.local_addr()?;
        Ok(HttpsListener { rx: accept(listener, tls.http_acceptor(), what), local })
    }
}

impl axum::serve::Listener for HttpsListener {
    type Io = tokio_rustls::server::TlsStream<TcpStream>;
    type Addr = SocketAddr;

    async fn accept(&mut self) -> (Self::Io, Self::Addr) {
        match self.rx.recv().await {
            Some(c) => c,
            // The accept task ends only with this listener.
            None => std::future::pending().await,
        }
    }

    fn local_addr(&self) -> std::io::Result<SocketAddr> {
        Ok(self.local)
    }
}

/// A client connection to an HTTP server: plain TCP, or TLS over it (for the CLI's
/// Jobs, state and log clients; not a hot path).
pub enum ClientStream {
    Plain(TcpStream),
    Tls(Box<tokio_rustls::client::TlsStream<TcpStream>>),
}

impl ClientStream {
    /// Over `tcp` to `host` (the name the server's certificate must hold): TLS with
    /// `tls`'s HTTP/1.1 client identity, or plain without one.
    ///
    /// # Errors
    /// The handshake's failure, its reason in words (TLS-4).
    pub async fn connect(tcp: TcpStream, host: &str, tls: Option<&Tls>) -> Result<Self, String> {
        let Some(t) = tls else { return Ok(ClientStream::Plain(tcp)) };
        let name = ServerName::try_from(host.to_string())
            .map_err(|e| format!("{host:?} is not a host name for TLS: {e}"))?;
        match tokio::time::timeout(HANDSHAKE_TIMEOUT, t.http_connector().connect(name, tcp)).await {
            Ok(Ok(s)) => Ok(ClientStream::Tls(Box::new(s))),
            Ok(Err(e)) => Err(format!(
                "TLS handshake failed: {}",
                explain_chain(&e, "the server").unwrap_or_else(|| e.to_string())
            )),
            Err(_) => Err(format!("no TLS handshake within {HANDSHAKE_TIMEOUT:?}")),
        }
    }
}

impl tokio::io::AsyncRead for ClientStream {
    fn poll_read(
        self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
        buf: &mut tokio::io::ReadBuf<'_>,
    ) -> std::task::Poll<std::io::Result<()>> {
        match self.get_mut() {
            ClientStream::Plain(s) => std::pin::Pin::new(s).poll_read(cx, buf),
            ClientStream::Tls(s) => std::pin::Pin::new(s.as_mut()).poll_read(cx, buf),
        }
    }
}

impl tokio::io::AsyncWrite for ClientStream {
    fn poll_write(
        self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
        buf: &[u8],
    ) -> std::task::Poll<std::io::Result<usize>> {
        match self.get_mut() {
            ClientStream::Plain(s) => std::pin::Pin::new(s).poll_write(cx, buf),
            ClientStream::Tls(s) => std::pin::Pin::new(s.as_mut()).poll_write(cx, buf),
        }
    }

    fn poll_flush(
        self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<std::io::Result<()>> {
        match self.get_mut() {
            ClientStream::Plain(s) => std::pin::Pin::new(s).poll_flush(cx),
            ClientStream::Tls(s) => std::pin::Pin::new(s.as_mut()).poll_flush(cx),
        }
    }

    fn poll_shutdown(
        self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<std::io::Result<()>> {
        match self.get_mut() {
            ClientStream::Plain(s) => std::pin::Pin::new(s).poll_shutdown(cx),
            ClientStream::Tls(s) => std::pin::Pin::new(s.as_mut()).poll_shutdown(cx),
        }
    }
}

/// What a server speaks, as [`probe`] finds.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Speaks {
    Tls,
    Plain,
}

/// TLS-3: whether the server at `addr` speaks TLS or plain HTTP/2, found by sending the
/// HTTP/2 client preface: a plain server answers with its SETTINGS frame, a TLS one with
/// an alert record or by closing the connection. `None` when it cannot be reached or
/// the answer is neither. Takes up to about 2 s.
pub async fn probe(addr: &str) -> Option<Speaks> {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let t = Duration::from_secs(2);
    let mut s = tokio::time::timeout(t, TcpStream::connect(addr)).await.ok()?.ok()?;
    let mut hello = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n".to_vec();
    hello.extend_from_slice(&[0, 0, 0, 4, 0, 0, 0, 0, 0]); // an empty SETTINGS frame
    tokio::time::timeout(t, s.write_all(&hello)).await.ok()?.ok()?;
    let mut buf = [0u8; 9];
    match tokio::time::timeout(t, s.read(&mut buf)).await.ok()? {
        // A TLS record: alert (21) or handshake (22), version 3.x.
        Ok(n) if n >= 2 && (buf[0] == 21 || buf[0] == 22) && buf[1] == 3 => Some(Speaks::Tls),
        // An HTTP/2 frame header: SETTINGS (4) or GOAWAY (7).
        Ok(n) if n >= 4 && (buf[3] == 4 || buf[3] == 7) => Some(Speaks::Plain),
        // Closed without a byte: a TLS server dropping a handshake that is not one.
        Ok(0) => Some(Speaks::Tls),
        Err(e) if e.kind() == std::io::ErrorKind::ConnectionReset => Some(Speaks::Tls),
        _ => None,
    }
}

/// TLS-3/TLS-4: why a connection to the server at `addr` fails, in words, when TLS is
/// the reason (`what` names the server: "the head at 10.0.0.1:6379"): the server speaks
/// otherwise than this process (TLS or plain), or the handshake is refused on either
/// side (another CA, an expired certificate...). `None` when TLS is not the reason or it
/// cannot be told. Takes up to about 4 s; for error paths only.
pub async fn diagnose(addr: &str, what: &str) -> Option<String> {
    let ours = match current() {
        Ok(t) => t,
        Err(e) => return Some(e),
    };
    match (probe(addr).await?, ours) {
        (Speaks::Tls, None) => Some(format!(
            "TLS mismatch: {what} uses TLS but this process is plain; give it the cluster's certificates (--tls-cert, --tls-key, --tls-ca on tpuray start, or {CERT_ENV}, {KEY_ENV}, {CA_ENV})"
        )),
        (Speaks::Plain, Some(_)) => Some(format!(
            "TLS mismatch: this process uses TLS but {what} is plain; a cluster is all-TLS or all-plain (start every process with the same --tls-* flags, or none)"
        )),
        (Speaks::Tls, Some(t)) => {
            handshake_failure(addr, t).await.map(|why| format!("{what}: {why}"))
        }
        (Speaks::Plain, None) => None,
    }
}

/// TLS-3/TLS-4 for blocking callers (the CLI): why a call to the servers at `addrs` (a
/// comma-separated list; `what` names them, "head") failed with `s`, when TLS is the
/// reason: the reason the status carries, else what [`diagnose`] finds for a transport
/// failure. Runs the probes on a thread of its own, so it may be called inside or
/// outside a runtime; error paths only.
pub fn why_failed(addrs: &str, what: &str, s: &tonic::Status) -> Option<String> {
    if let Some(why) = status_reason(s) {
        return Some(why);
    }
    if !matches!(
        s.code(),
        tonic::Code::Unavailable
            | tonic::Code::Unknown
            | tonic::Code::Internal
            | tonic::Code::Cancelled
    ) {
        return None;
    }
    let addrs: Vec<String> =
        addrs.split(',').map(str::trim).filter(|a| !a.is_empty()).map(String::from).collect();
    let what = what.to_string();
    std::thread::spawn(move || {
        let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().ok()?;
        rt.block_on(async {
            for a in &addrs {
                if let Some(m) = diagnose(a, &format!("the {what} at {a}")).await {
                    return Some(m);
                }
            }
            None
        })
    })
    .join()
    .ok()
    .flatten()
}

/// Runs a TLS handshake with `addr` and reads its first answer: the reason in words
/// when either side refuses (a server refusing this process's certificate says so in an
/// alert after a TLS 1.3 handshake completes on this side).
async fn handshake_failure(addr: &str, tls: &Tls) -> Option<String> {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let t = Duration::from_secs(2);
    let name = server_name(addr).ok()?;
    let tcp = tokio::time::timeout(t, TcpStream::connect(addr)).await.ok()?.ok()?;
    let mut s = match tokio::time::timeout(t, tls.grpc_connector().connect(name, tcp)).await.ok()? {
        Ok(s) => s,
        Err(e) => return explain_chain(&e, "the server"),
    };
    let mut hello = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n".to_vec();
    hello.extend_from_slice(&[0, 0, 0, 4, 0, 0, 0, 0, 0]);
    if let Err(e) = s.write_all(&hello).await {
        return explain_chain(&e, "the server");
    }
    let _ = s.flush().await;
    let mut buf = [0u8; 9];
    match tokio::time::timeout(t, s.read(&mut buf)).await.ok()? {
        Err(e) => explain_chain(&e, "the server"),
        Ok(_) => None,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_certificate_for_another_address_names_the_one_dialled_as_written() {
        let ip = std::net::IpAddr::from([192, 0, 2, 2]);
        let e =
            rustls::Error::InvalidCertificate(rustls::CertificateError::NotValidForNameContext {
                expected: rustls::pki_types::ServerName::IpAddress(ip.into()),
                presented: vec![],
            });
        let s = explain(&e, "the server");
        assert!(s.contains("does not name 192.0.2.2, the address dialled"), "{s}");
    }

    #[test]
    fn a_partial_identity_is_refused_naming_what_is_missing() {
        let e = TlsFiles::from_parts(Some("c".into()), None, None).unwrap_err().to_string();
        assert!(
            e.contains("the key") && e.contains("the CA") && !e.contains("the certificate ("),
            "{e}"
        );
        assert_eq!(TlsFiles::from_parts(None, None, None).unwrap(), None);
    }

    /// TLS-2: a client verifies the server's certificate against the host it dials.
    #[test]
    fn server_names_are_the_dialled_host() {
        assert!(matches!(server_name("127.0.0.1:6379").unwrap(), ServerName::IpAddress(_)));
        assert!(matches!(server_name("[::1]:1").unwrap(), ServerName::IpAddress(_)));
        assert!(matches!(server_name("head-0.svc:1").unwrap(), ServerName::DnsName(_)));
        assert!(server_name("bad host:1").is_err());
    }

    #[test]
    fn rustls_errors_read_as_their_reason() {
        use rustls::{AlertDescription as A, CertificateError as C, Error as E};
        let e = explain(&E::InvalidCertificate(C::UnknownIssuer), "the server");
        assert!(e.contains("not signed by this cluster's CA"), "{e}");
        let e = explain(&E::InvalidCertificate(C::Expired), "the client");
        assert!(e.contains("expired"), "{e}");
        let e = explain(&E::AlertReceived(A::CertificateExpired), "the head");
        assert!(e.contains("refused this process's certificate: it has expired"), "{e}");
        let e =
            explain(&E::InvalidMessage(rustls::InvalidMessage::InvalidContentType), "the server");
        assert!(e.contains("does not speak TLS"), "{e}");
        let io = std::io::Error::new(std::io::ErrorKind::InvalidData, E::NoCertificatesPresented);
        assert!(explain_chain(&io, "the client").unwrap().contains("sent no certificate"));
    }
}
