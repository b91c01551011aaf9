//! `tpuray tls make-ca` and `tpuray tls make-cert`: a cluster CA and per-host
//! certificates for mutual TLS (TLS-2), made with rcgen (the rustls project's
//! certificate generator). Keys are ECDSA P-256; files are PEM; private keys are
//! written mode 0600. Nothing here needs a runtime.

use std::net::IpAddr;
use std::path::{Path, PathBuf};

use anyhow::{Context, Result, bail};
use rcgen::{
    BasicConstraints, CertificateParams, DistinguishedName, DnType, ExtendedKeyUsagePurpose, IsCa,
    Issuer, KeyPair, KeyUsagePurpose, SanType,
};
use time::{Duration, OffsetDateTime};

/// How long a CA made by `make-ca` is valid: 10 years.
const CA_DAYS: i64 = 3650;
/// How long a certificate made by `make-cert` is valid: 825 days (the longest browsers
/// take for a server certificate).
const CERT_DAYS: i64 = 825;

/// The names every certificate holds besides the host's own, so the processes of one
/// host reach each other through loopback (NET-3).
const LOOPBACK_NAMES: [&str; 3] = ["localhost", "127.0.0.1", "::1"];

fn write(path: &Path, text: &str, private: bool) -> Result<()> {
    use std::io::Write;
    use std::os::unix::fs::OpenOptionsExt;
    let mut f = std::fs::OpenOptions::new()
        .write(true)
        .create_new(true)
        .mode(if private { 0o600 } else { 0o644 })
        .open(path)
        .with_context(|| format!("cannot write {}", path.display()))?;
    f.write_all(text.as_bytes()).with_context(|| format!("cannot write {}", path.display()))
}

fn fresh(out: &Path, names: &[&str]) -> Result<Vec<PathBuf>> {
    std::fs::create_dir_all(out).with_context(|| format!("cannot make {}", out.display()))?;
    let paths: Vec<PathBuf> = names.iter().map(|n| out.join(n)).collect();
    for p in &paths {
        if p.exists() {
            bail!("{} exists: remove it first or choose another --out", p.display());
        }
    }
    Ok(paths)
}

/// Makes a CA valid from now for [`CA_DAYS`]: writes `out/ca.pem` and `out/ca-key.pem`.
///
/// # Errors
/// A file exists already, or cannot be written.
pub fn make_ca(out: &Path) -> Result<()> {
    let paths = fresh(out, &["ca.pem", "ca-key.pem"])?;
    let mut params = CertificateParams::default();
    let mut dn = DistinguishedName::new();
    dn.push(DnType::OrganizationName, "tpuray");
    // A CA of its own per run: two clusters' CAs never pass for each other.
    dn.push(DnType::CommonName, format!("tpuray cluster CA {}", uuid::Uuid::new_v4().simple()));
    params.distinguished_name = dn;
    params.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
    params.key_usages = vec![
        KeyUsagePurpose::KeyCertSign,
        KeyUsagePurpose::CrlSign,
        KeyUsagePurpose::DigitalSignature,
    ];
    let now = OffsetDateTime::now_utc();
    params.not_before = now - Duration::minutes(5);
    params.not_after = now + Duration::days(CA_DAYS);
    let key = KeyPair::generate().context("generating the CA key")?;
    let cert = params.self_signed(&key).context("signing the CA certificate")?;
    write(&paths[0], &cert.pem(), false)?;
    write(&paths[1], &key.serialize_pem(), true)?;
    Ok(())
}

/// Makes a certificate for `hosts` (DNS names and IP addresses; [`LOOPBACK_NAMES`] are
/// added) signed by the CA in `ca_dir`, valid from `not_before` to `not_after`, with the
/// serverAuth and clientAuth extended key usages: writes `out/cert.pem` and
/// `out/key.pem`.
///
/// # Errors
/// No host, a host that is neither a DNS name nor an IP, the CA's files cannot be read
/// or parsed, or an output file exists already.
pub fn make_cert_valid(
    ca_dir: &Path,
    hosts: &[String],
    out: &Path,
    not_before: OffsetDateTime,
    not_after: OffsetDateTime,
) -> Result<()> {
    let hosts: Vec<&str> = hosts.iter().map(|h| h.trim()).filter(|h| !h.is_empty()).collect();
    let Some(first) = hosts.first() else {
        bail!(
            "--host is empty (expected NAME[,IP...], the names and addresses the host is dialled by)"
        );
    };
    let ca_pem_path = ca_dir.join("ca.pem");
    let ca_key_path = ca_dir.join("ca-key.pem");
    let ca_pem = std::fs::read_to_string(&ca_pem_path)
        .with_context(|| format!("cannot read the CA certificate {}", ca_pem_path.display()))?;
    let ca_key_pem = std::fs::read_to_string(&ca_key_path)
        .with_context(|| format!("cannot read the CA key {}", ca_key_path.display()))?;
    let ca_key = KeyPair::from_pem(&ca_key_pem).with_context(|| {
        format!("the CA key {} is not a PEM private key", ca_key_path.display())
    })?;
    let issuer = Issuer::from_ca_cert_pem(&ca_pem, ca_key).with_context(|| {
        format!("the CA certificate {} is not a PEM certificate", ca_pem_path.display())
    })?;
    let mut names: Vec<String> = Vec::new();
    for h in hosts.iter().copied().chain(LOOPBACK_NAMES) {
        if !names.iter().any(|n| n == h) {
            names.push(h.to_string());
        }
    }
    let mut params = CertificateParams::default();
    for n in &names {
        let san = match n.parse::<IpAddr>() {
            Ok(ip) => SanType::IpAddress(ip),
            Err(_) => SanType::DnsName(n.as_str().try_into().with_context(|| {
                format!("--host {n:?} is neither a DNS name nor an IP address")
            })?),
        };
        params.subject_alt_names.push(san);
    }
    let mut dn = DistinguishedName::new();
    dn.push(DnType::OrganizationName, "tpuray");
    dn.push(DnType::CommonName, *first);
    params.distinguished_name = dn;
    params.is_ca = IsCa::ExplicitNoCa;
    params.key_usages = vec![KeyUsagePurpose::DigitalSignature];
    // TLS-2: every process is both server and client.
    params.extended_key_usages =
        vec![ExtendedKeyUsagePurpose::ServerAuth, ExtendedKeyUsagePurpose::ClientAuth];
    params.use_authority_key_identifier_extension = true;
    params.not_before = not_before;
    params.not_after = not_after;
    let paths = fresh(out, &["cert.pem", "key.pem"])?;
    let key = KeyPair::generate().context("generating the key")?;
    let cert = params.signed_by(&key, &issuer).context("signing the certificate")?;
    write(&paths[0], &cert.pem(), false)?;
    write(&paths[1], &key.serialize_pem(), true)?;
    Ok(())
}

/// [`make_cert_valid`] from now for [`CERT_DAYS`]; `hosts` is `NAME[,IP...]`.
///
/// # Errors
/// As [`make_cert_valid`].
pub fn make_cert(ca_dir: &Path, hosts: &str, out: &Path) -> Result<()> {
    let hosts: Vec<String> = hosts.split(',').map(str::to_string).collect();
    let now = OffsetDateTime::now_utc();
    make_cert_valid(
        ca_dir,
        &hosts,
        out,
        now - Duration::minutes(5),
        now + Duration::days(CERT_DAYS),
    )
}

pub(crate) fn make_ca_cmd(out: &Path) -> Result<i32> {
    make_ca(out)?;
    println!("wrote {} and {}", out.join("ca.pem").display(), out.join("ca-key.pem").display());
    println!("  ca.pem goes to every host (--tls-ca, TPURAY_TLS_CA); keep ca-key.pem private");
    Ok(0)
}

pub(crate) fn make_cert_cmd(ca: &Path, hosts: &str, out: &Path) -> Result<i32> {
    make_cert(ca, hosts, out)?;
    println!("wrote {} and {}", out.join("cert.pem").display(), out.join("key.pem").display());
    Ok(0)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_cert_made_by_make_cert_loads_with_the_ca_of_make_ca() {
        let d = tempfile::tempdir().unwrap();
        make_ca(&d.path().join("ca")).unwrap();
        make_cert(&d.path().join("ca"), "node-1,10.0.0.7", &d.path().join("n1")).unwrap();
        let files = tpuray_proto::tls::TlsFiles {
            cert: d.path().join("n1/cert.pem"),
            key: d.path().join("n1/key.pem"),
            ca: d.path().join("ca/ca.pem"),
        };
        tpuray_proto::tls::Tls::load(&files).unwrap();
        let e = make_ca(&d.path().join("ca")).unwrap_err().to_string();
        assert!(e.contains("exists"), "{e}");
        let e = make_cert(&d.path().join("ca"), " ", &d.path().join("n2")).unwrap_err().to_string();
        assert!(e.contains("--host is empty"), "{e}");
    }
}
