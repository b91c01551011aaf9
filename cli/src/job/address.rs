//! Which job server to talk to. An address is either the HTTP address of a head's
//! dashboard (`http://HOST:PORT[/prefix]`, as Ray's clients take it) or a head's gRPC
//! address (`HOST:PORT`, or `HOST:PORT,HOST:PORT,...` for a replicated head), which is
//! resolved to its dashboard through `GetHeadInfo` (`dashboard_url`), as Ray resolves a
//! cluster address through the GCS.
//!
//! Where the address comes from ([`choose`]): for the CLI, `--address`, then
//! `RAY_API_SERVER_ADDRESS`, `RAY_ADDRESS`, `TPURAY_ADDRESS`, then the cluster `tpuray
//! start --head` left on this machine (DESIGN.md §13). For the Python
//! `JobSubmissionClient` Ray's rule holds: `RAY_API_SERVER_ADDRESS` and `RAY_ADDRESS`
//! override the argument. `auto` means "this machine's cluster".

use std::time::Duration;

use super::JobError;

/// Environment variables read, in order, after an explicit address.
pub const ENV_VARS: [&str; 3] = ["RAY_API_SERVER_ADDRESS", "RAY_ADDRESS", "TPURAY_ADDRESS"];

/// A parsed `http://` or `https://` address.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct HttpAddress {
    /// Host as written (a name, an IPv4 address, or an IPv6 address without brackets).
    pub host: String,
    pub port: u16,
    /// A path prefix the routes hang under (empty, or starting with `/`, no trailing `/`).
    pub prefix: String,
    /// `https://`: the server of a TLS cluster, reached with this process's TLS identity
    /// (TLS-2: `TPURAY_TLS_CERT`, `TPURAY_TLS_KEY`, `TPURAY_TLS_CA`).
    pub https: bool,
}

impl HttpAddress {
    /// `host:port` for a `Host` header and for connecting (IPv6 in brackets).
    pub fn authority(&self) -> String {
        if self.host.contains(':') {
            format!("[{}]:{}", self.host, self.port)
        } else {
            format!("{}:{}", self.host, self.port)
        }
    }

    /// The address as Ray's `get_address()` returns it: `http://host:port[/prefix]`
    /// (`https://` for a TLS cluster's).
    pub fn url(&self) -> String {
        let scheme = if self.https { "https" } else { "http" };
        format!("{scheme}://{}{}", self.authority(), self.prefix)
    }
}

/// What an address names.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Target {
    /// A job server's HTTP address.
    Http(HttpAddress),
    /// A head's gRPC address (one or several, comma-separated).
    Head(String),
}

/// Where an address came from, for error messages.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Source {
    Given,
    Env(&'static str),
    ThisMachine,
}

impl std::fmt::Display for Source {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Source::Given => f.write_str("the address given"),
            Source::Env(v) => write!(f, "{v}"),
            Source::ThisMachine => f.write_str("this machine's cluster"),
        }
    }
}

fn bad(addr: &str, what: &str) -> JobError {
    JobError::Address(format!(
        "bad job server address {addr:?}: {what} (expected http://HOST:DASHBOARD_PORT, or a head's HOST:PORT)"
    ))
}

/// Parses an address (see the module doc). A trailing `/` is dropped, as Ray's client
/// drops it.
pub fn classify(addr: &str) -> Result<Target, JobError> {
    let a = addr.trim().trim_end_matches('/');
    if a.is_empty() {
        return Err(bad(addr, "it is empty"));
    }
    let Some((scheme, rest)) = a.split_once("://") else {
        for part in a.split(',') {
            let part = part.trim();
            let (host, port) = split_host_port(part)
                .ok_or_else(|| bad(addr, &format!("{part:?} is not HOST:PORT")))?;
            if host.is_empty() || port == 0 {
                return Err(bad(addr, &format!("{part:?} is not HOST:PORT")));
            }
        }
        return Ok(Target::Head(a.to_string()));
    };
    let https = match scheme.to_ascii_lowercase().as_str() {
        "http" => false,
        "https" => true,
        "ray" => {
            return Err(JobError::Address(format!(
                "{addr:?}: Ray Client (ray://) addresses are not supported; pass the dashboard's http://HOST:PORT, or the head's HOST:PORT"
            )));
        }
        other => {
            return Err(bad(addr, &format!("unknown scheme {other:?}")));
        }
    };
    let default_port = if https { 443 } else { 80 };
    let (authority, prefix) = match rest.find('/') {
        Some(i) => (&rest[..i], rest[i..].to_string()),
        None => (rest, String::new()),
    };
    if authority.contains('@') {
        return Err(bad(
            addr,
            "user:password@ is not supported; pass credentials with --headers '{\"Authorization\": ...}'",
        ));
    }
    if prefix.contains(['?', '#']) {
        return Err(bad(addr, "a query or fragment is not allowed"));
    }
    let (host, port) = match split_host_port(authority) {
        Some((h, p)) => (h, p),
        None if !authority.is_empty() && !authority.contains(':') => {
            (authority.to_string(), default_port)
        }
        None if authority.starts_with('[') && authority.ends_with(']') => {
            (authority[1..authority.len() - 1].to_string(), default_port)
        }
        None => return Err(bad(addr, &format!("{authority:?} is not HOST[:PORT]"))),
    };
    if host.is_empty() {
        return Err(bad(addr, "the host is empty"));
    }
    Ok(Target::Http(HttpAddress { host, port, prefix, https }))
}

/// `host:port` or `[v6]:port`, the host without brackets.
fn split_host_port(s: &str) -> Option<(String, u16)> {
    let (host, port) = if let Some(rest) = s.strip_prefix('[') {
        let (h, p) = rest.split_once("]:")?;
        (h, p)
    } else {
        let (h, p) = s.rsplit_once(':')?;
        if h.contains(':') {
            return None;
        }
        (h, p)
    };
    let port: u16 = port.parse().ok()?;
    Some((host.to_string(), port))
}

/// Picks the address to use. `given` is the caller's (`--address`, or the Python
/// client's argument); with `env_overrides` (Ray's rule for `JobSubmissionClient`)
/// `RAY_API_SERVER_ADDRESS` and `RAY_ADDRESS` win over it. Empty values and `auto` are
/// skipped. `None`: use this machine's cluster.
pub fn choose(given: Option<&str>, env_overrides: bool) -> Option<(String, Source)> {
    choose_from(given, env_overrides, |k| std::env::var(k).ok())
}

fn choose_from(
    given: Option<&str>,
    env_overrides: bool,
    env: impl Fn(&str) -> Option<String>,
) -> Option<(String, Source)> {
    let usable = |v: &str| !v.trim().is_empty() && v.trim() != "auto";
    let given = given.filter(|g| usable(g)).map(|g| (g.trim().to_string(), Source::Given));
    let from_env = |names: &[&'static str]| {
        names.iter().find_map(|&k| env(k).filter(|v| usable(v)).map(|v| (v, Source::Env(k))))
    };
    if env_overrides {
        from_env(&ENV_VARS[..2]).or(given).or_else(|| from_env(&ENV_VARS[2..]))
    } else {
        given.or_else(|| from_env(&ENV_VARS))
    }
}

/// The HTTP address of the job server named by `given` (see [`choose`]); a head address
/// is resolved through the head. `token` authenticates the `GetHeadInfo` call.
pub async fn resolve(
    given: Option<&str>,
    env_overrides: bool,
    token: Option<&str>,
) -> Result<HttpAddress, JobError> {
    let (addr, source) = match choose(given, env_overrides) {
        Some(x) => x,
        None => match tpuray_proto::registry::current_cluster() {
            Some(c) => (c.address, Source::ThisMachine),
            None => {
                return Err(JobError::Address(
                    "no job server address given and no cluster found on this machine: pass --address http://HOST:DASHBOARD_PORT (or the head's HOST:PORT), set RAY_ADDRESS, or start a cluster with `tpuray start --head`".into(),
                ));
            }
        },
    };
    let target = classify(&addr).map_err(|e| match source {
        Source::Given => e,
        _ => JobError::Address(format!("{e} (from {source})")),
    })?;
    match target {
        Target::Http(h) => Ok(h),
        Target::Head(head) => dashboard_of_head(&head, token).await,
    }
}

/// Asks the head at `head` for its dashboard's address (`GetHeadInfo.dashboard_url`).
pub async fn dashboard_of_head(head: &str, token: Option<&str>) -> Result<HttpAddress, JobError> {
    let mut client = tpuray_proto::client::head(head, token)
        .map_err(|e| JobError::Address(format!("bad head address {head:?}: {e}")))?;
    let mut req = tonic::Request::new(tpuray_proto::pb::GetHeadInfoRequest {});
    req.set_timeout(Duration::from_secs(10));
    let info = client
        .get_head_info(req)
        .await
        .map_err(|s| JobError::Connect {
            address: head.to_string(),
            // TLS-3/TLS-4: a TLS mismatch or a refused certificate is named as such.
            reason: match tpuray_proto::tls::why_failed(head, "head", &s) {
                Some(why) => why,
                None => format!(
                    "the head did not answer GetHeadInfo ({:?}: {}); if this is the dashboard's port, pass http://{head}",
                    s.code(),
                    s.message()
                ),
            },
        })?
        .into_inner();
    if info.dashboard_url.is_empty() {
        return Err(JobError::Address(format!(
            "the head at {head} serves no job server (its GetHeadInfo names no dashboard_url: a tpuray older than the Jobs API, or started without a dashboard)"
        )));
    }
    let mut h = match classify(&info.dashboard_url) {
        Ok(Target::Http(h)) => h,
        _ => {
            return Err(JobError::Protocol(format!(
                "the head at {head} names dashboard_url {:?}, which is not an http(s)://HOST:PORT address",
                info.dashboard_url
            )));
        }
    };
    // A server listening on every address may name itself 0.0.0.0: reach it where we
    // reached the head.
    if h.host == "0.0.0.0" || h.host == "::" {
        let first = head.split(',').next().unwrap_or(head).trim();
        if let Some((host, _)) = split_host_port(first) {
            h.host = host;
        }
    }
    Ok(h)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn http(host: &str, port: u16, prefix: &str) -> Target {
        Target::Http(HttpAddress { host: host.into(), port, prefix: prefix.into(), https: false })
    }

    #[test]
    fn http_addresses_keep_host_port_and_prefix_and_lose_trailing_slashes() {
        assert_eq!(classify("http://127.0.0.1:8265").unwrap(), http("127.0.0.1", 8265, ""));
        assert_eq!(classify("http://127.0.0.1:8265/").unwrap(), http("127.0.0.1", 8265, ""));
        assert_eq!(classify("HTTP://head:1/ray/").unwrap(), http("head", 1, "/ray"));
        assert_eq!(classify("http://localhost").unwrap(), http("localhost", 80, ""));
        assert_eq!(classify("http://[::1]:8265").unwrap(), http("::1", 8265, ""));
    }

    #[test]
    fn an_address_without_scheme_is_a_head_and_may_list_several() {
        assert_eq!(classify("10.0.0.1:6379").unwrap(), Target::Head("10.0.0.1:6379".into()));
        assert_eq!(classify("a:1,b:2").unwrap(), Target::Head("a:1,b:2".into()));
        assert_eq!(classify("[::1]:6379").unwrap(), Target::Head("[::1]:6379".into()));
    }

    #[test]
    fn bad_addresses_say_what_is_wrong_and_what_is_expected() {
        for (a, says) in [
            ("", "empty"),
            ("localhost", "is not HOST:PORT"),
            ("h:notaport", "is not HOST:PORT"),
            ("h:0", "is not HOST:PORT"),
            ("ftp://h:1", "unknown scheme \"ftp\""),
            ("http://u:p@h:1", "user:password@"),
            ("http://h:1/x?y", "query"),
            ("http://h:99999", "is not HOST[:PORT]"),
        ] {
            let e = classify(a).unwrap_err().to_string();
            assert!(e.contains(says), "{a:?}: {e}");
            assert!(e.contains("expected http://HOST:DASHBOARD_PORT"), "{a:?}: {e}");
        }
        let Target::Http(h) = classify("https://h").unwrap() else { panic!("an https address") };
        assert!(h.https && h.port == 443 && h.url() == "https://h:443", "{h:?}");
        assert!(classify("ray://h:10001").unwrap_err().to_string().contains("Ray Client"));
    }

    #[test]
    fn the_cli_prefers_its_flag_and_reads_the_environment_in_rays_order() {
        let env = |vars: &'static [(&'static str, &'static str)]| {
            move |k: &str| vars.iter().find(|(n, _)| *n == k).map(|(_, v)| v.to_string())
        };
        let all = env(&[
            ("RAY_API_SERVER_ADDRESS", "http://api:1"),
            ("RAY_ADDRESS", "ray:2"),
            ("TPURAY_ADDRESS", "tp:3"),
        ]);
        assert_eq!(choose_from(Some("given:4"), false, all).unwrap().0, "given:4");
        assert_eq!(
            choose_from(None, false, all).unwrap(),
            ("http://api:1".into(), Source::Env("RAY_API_SERVER_ADDRESS"))
        );
        let two = env(&[("RAY_ADDRESS", "auto"), ("TPURAY_ADDRESS", "tp:3")]);
        assert_eq!(choose_from(Some(" "), false, two).unwrap().0, "tp:3", "auto is skipped");
        assert_eq!(choose_from(None, false, env(&[])), None);
    }

    #[test]
    fn the_python_client_lets_rays_variables_override_its_argument() {
        let vars = |k: &str| (k == "RAY_ADDRESS").then(|| "http://env:1".to_string());
        assert_eq!(choose_from(Some("http://arg:2"), true, vars).unwrap().0, "http://env:1");
        let tp = |k: &str| (k == "TPURAY_ADDRESS").then(|| "tp:3".to_string());
        assert_eq!(choose_from(Some("http://arg:2"), true, tp).unwrap().0, "http://arg:2");
        assert_eq!(choose_from(None, true, tp).unwrap().0, "tp:3");
    }
}
