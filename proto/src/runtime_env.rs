//! The runtime environment of a job submitted through the Jobs API, as the head checks
//! it and a node agent builds it (Ray's `runtime_env` dict, `ray/runtime_env/runtime_env.py`
//! and `ray/_private/runtime_env/pip.py`).
//!
//! Fields honoured here: `working_dir` (a package URI, `gcs://_ray_pkg_<hash>.zip`, as
//! Ray's job client uploads it), `pip` (a list of requirement lines, or Ray's dict form
//! `{"packages": [...], "pip_check": bool, "pip_version": "==23.3"}`), `env_vars`, and
//! `config.setup_timeout_seconds` / `config.eager_install`. `excludes` is applied by the
//! client when it packs `working_dir` and means nothing after the upload. Any other
//! field is refused by name.

use std::collections::BTreeMap;
use std::time::Duration;

use serde_json::Value;

/// Ray's package URI scheme for files uploaded through the Jobs API (`gcs://`).
pub const PACKAGE_SCHEME: &str = "gcs://";
/// The fields [`JobRuntimeEnv::parse`] accepts.
pub const SUPPORTED_FIELDS: &[&str] = &["working_dir", "pip", "env_vars", "config", "excludes"];

/// The resources a job's entrypoint reserves on its node, by Ray's names (`CPU`, `GPU`,
/// `memory` in bytes, and the custom ones), zero amounts left out (Ray's
/// `entrypoint_num_cpus`, `entrypoint_num_gpus`, `entrypoint_memory`,
/// `entrypoint_resources`).
pub fn entrypoint_resources<'a>(
    num_cpus: Option<f64>,
    num_gpus: Option<f64>,
    memory: Option<u64>,
    custom: impl IntoIterator<Item = (&'a String, &'a f64)>,
) -> BTreeMap<String, f64> {
    let mut m: BTreeMap<String, f64> = custom.into_iter().map(|(k, v)| (k.clone(), *v)).collect();
    for (name, v) in [("CPU", num_cpus), ("GPU", num_gpus), ("memory", memory.map(|b| b as f64))] {
        if let Some(v) = v.filter(|v| *v > 0.0) {
            m.insert(name.into(), v);
        }
    }
    m.retain(|_, v| *v > 0.0);
    m
}

/// A duration in seconds from environment variable `var` (a number >= 0, fractions
/// allowed: Ray's `RAY_JOB_*_S` variables), else `default`.
pub fn env_seconds(var: &str, default: Duration) -> Duration {
    std::env::var(var)
        .ok()
        .and_then(|v| v.trim().parse::<f64>().ok())
        .filter(|s| s.is_finite() && *s >= 0.0)
        .map(Duration::from_secs_f64)
        .unwrap_or(default)
}

/// `pip` in Ray's dict form.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct PipSpec {
    /// Requirement lines (`"requests==2.31"`, `"-r reqs.txt"` is not one: Ray's client reads
    /// a requirements file into lines before sending).
    pub packages: Vec<String>,
    /// Run `pip check` after installing (Ray's default: false).
    pub pip_check: bool,
    /// A pip version specifier (`"==23.3"`) installed into the environment first.
    pub pip_version: Option<String>,
    /// Extra `pip install` options (Ray's `pip_install_options`).
    pub install_options: Vec<String>,
}

impl PipSpec {
    /// The content hash that names the environment built for it (lowercase sha256 hex of
    /// a canonical JSON form): equal specs share one cached environment per node.
    pub fn hash(&self) -> String {
        use sha2::Digest;
        let canon = serde_json::json!({
            "packages": self.packages,
            "pip_check": self.pip_check,
            "pip_version": self.pip_version,
            "pip_install_options": self.install_options,
        });
        format!("{:x}", sha2::Sha256::digest(canon.to_string().as_bytes()))
    }
}

/// A job's runtime environment, checked.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct JobRuntimeEnv {
    /// A package URI (`gcs://...`).
    pub working_dir: Option<String>,
    pub pip: Option<PipSpec>,
    pub env_vars: BTreeMap<String, String>,
    /// `config.setup_timeout_seconds` (Ray's default is 600 s; `-1` means no limit).
    pub setup_timeout: Option<Duration>,
}

impl JobRuntimeEnv {
    /// Parses and checks a runtime environment given as JSON text ("" for none).
    ///
    /// # Errors
    /// A message naming the field and what was expected: a field tpuray does not
    /// support, a `working_dir` that is not an uploaded package URI, a malformed `pip`,
    /// `env_vars` that are not strings.
    pub fn parse_json(text: &str) -> Result<Self, String> {
        if text.trim().is_empty() {
            return Ok(Self::default());
        }
        let v: Value =
            serde_json::from_str(text).map_err(|e| format!("runtime_env is not JSON: {e}"))?;
        Self::parse(&v)
    }

    /// As [`JobRuntimeEnv::parse_json`], from a JSON value.
    ///
    /// # Errors
    /// As [`JobRuntimeEnv::parse_json`].
    pub fn parse(v: &Value) -> Result<Self, String> {
        let Value::Object(map) = v else {
            return Err(format!("runtime_env must be a JSON object (got {v})"));
        };
        let mut env = Self::default();
        for (k, val) in map {
            match k.as_str() {
                // Ray's job client adds the commit of the Ray that sent it; it is
                // bookkeeping, not an option, and is dropped (the one field accepted
                // without effect).
                "_ray_commit" => {}
                "working_dir" => env.working_dir = parse_working_dir(val)?,
                "pip" => env.pip = parse_pip(val)?,
                "env_vars" => env.env_vars = parse_env_vars(val)?,
                "config" => env.setup_timeout = parse_config(val)?,
                // Applied by the client when it packed working_dir.
                "excludes" => {
                    if !val.is_null() && !val.is_array() {
                        return Err(format!(
                            "runtime_env['excludes'] must be a list of patterns (got {val})"
                        ));
                    }
                }
                other => {
                    return Err(format!(
                        "runtime_env field {other:?} is not supported by tpuray's Jobs API (supported: {})",
                        SUPPORTED_FIELDS.join(", ")
                    ));
                }
            }
        }
        Ok(env)
    }

    /// Whether there is nothing to set up.
    pub fn is_empty(&self) -> bool {
        self.working_dir.is_none() && self.pip.is_none() && self.env_vars.is_empty()
    }
}

fn parse_working_dir(v: &Value) -> Result<Option<String>, String> {
    match v {
        Value::Null => Ok(None),
        Value::String(s) if s.starts_with(PACKAGE_SCHEME) => {
            let name = &s[PACKAGE_SCHEME.len()..];
            if name.is_empty() || name.contains('/') {
                return Err(format!(
                    "runtime_env['working_dir'] {s:?} is not a package URI (expected gcs://_ray_pkg_<hash>.zip)"
                ));
            }
            Ok(Some(s.clone()))
        }
        Value::String(s) if s.contains("://") => Err(format!(
            "runtime_env['working_dir'] {s:?}: tpuray jobs read packages from the cluster only \
             (gcs:// URIs, uploaded by the job client); remote URIs are not fetched"
        )),
        Value::String(s) => Err(format!(
            "runtime_env['working_dir'] {s:?} is a local path: the job client uploads it and \
             sends its package URI (use `tpuray job submit --working-dir` or JobSubmissionClient)"
        )),
        other => Err(format!("runtime_env['working_dir'] must be a string (got {other})")),
    }
}

fn string_list(what: &str, v: &Value) -> Result<Vec<String>, String> {
    let Value::Array(items) = v else {
        return Err(format!("{what} must be a list of strings (got {v})"));
    };
    items
        .iter()
        .map(|i| match i {
            Value::String(s) => Ok(s.trim().to_string()),
            other => Err(format!("{what} must be a list of strings (got the item {other})")),
        })
        .filter(|r| r.as_ref().map_or(true, |s| !s.is_empty()))
        .collect()
}

fn parse_pip(v: &Value) -> Result<Option<PipSpec>, String> {
    let spec = match v {
        Value::Null => return Ok(None),
        Value::Array(_) => {
            PipSpec { packages: string_list("runtime_env['pip']", v)?, ..Default::default() }
        }
        Value::Object(m) => {
            let mut spec = PipSpec::default();
            for (k, val) in m {
                match k.as_str() {
                    "packages" => {
                        spec.packages = match val {
                            Value::String(s) => {
                                return Err(format!(
                                    "runtime_env['pip']['packages'] {s:?}: a requirements file is read by the \
                                     client; send its lines as a list"
                                ));
                            }
                            _ => string_list("runtime_env['pip']['packages']", val)?,
                        }
                    }
                    "pip_check" => {
                        spec.pip_check = val.as_bool().ok_or_else(|| {
                            format!(
                                "runtime_env['pip']['pip_check'] must be true or false (got {val})"
                            )
                        })?
                    }
                    "pip_version" => {
                        spec.pip_version = match val {
                            Value::Null => None,
                            Value::String(s) if !s.trim().is_empty() => Some(s.trim().to_string()),
                            other => {
                                return Err(format!(
                                    "runtime_env['pip']['pip_version'] must be a version specifier such as \"==23.3\" (got {other})"
                                ));
                            }
                        }
                    }
                    "pip_install_options" => {
                        spec.install_options =
                            string_list("runtime_env['pip']['pip_install_options']", val)?
                    }
                    other => {
                        return Err(format!(
                            "runtime_env['pip'] key {other:?} is not supported (expected packages, pip_check, \
                             pip_version, pip_install_options)"
                        ));
                    }
                }
            }
            spec
        }
        Value::String(s) => {
            return Err(format!(
                "runtime_env['pip'] {s:?}: a requirements file is read by the client; send its lines as a list"
            ));
        }
        other => {
            return Err(format!(
                "runtime_env['pip'] must be a list of requirements or a dict with 'packages' (got {other})"
            ));
        }
    };
    Ok(if spec.packages.is_empty() { None } else { Some(spec) })
}

fn parse_env_vars(v: &Value) -> Result<BTreeMap<String, String>, String> {
    match v {
        Value::Null => Ok(BTreeMap::new()),
        Value::Object(m) => m
            .iter()
            .map(|(k, val)| match val {
                Value::String(s) => Ok((k.clone(), s.clone())),
                other => {
                    Err(format!("runtime_env['env_vars'][{k:?}] must be a string (got {other})"))
                }
            })
            .collect(),
        other => Err(format!("runtime_env['env_vars'] must be a dict of strings (got {other})")),
    }
}

fn parse_config(v: &Value) -> Result<Option<Duration>, String> {
    let Value::Object(m) = v else {
        return if v.is_null() {
            Ok(None)
        } else {
            Err(format!("runtime_env['config'] must be a dict (got {v})"))
        };
    };
    let mut timeout = None;
    for (k, val) in m {
        match k.as_str() {
            "setup_timeout_seconds" => {
                let s = val.as_f64().ok_or_else(|| {
                    format!("runtime_env['config']['setup_timeout_seconds'] must be a number (got {val})")
                })?;
                // Ray: -1 disables the timeout.
                timeout = if s == -1.0 {
                    None
                } else if s > 0.0 && s.is_finite() {
                    Some(Duration::from_secs_f64(s))
                } else {
                    return Err(format!(
                        "runtime_env['config']['setup_timeout_seconds'] must be positive or -1 (got {s})"
                    ));
                };
            }
            // A job's environment is always built before its entrypoint starts.
            "eager_install" => {
                if !val.is_boolean() {
                    return Err(format!(
                        "runtime_env['config']['eager_install'] must be true or false (got {val})"
                    ));
                }
            }
            other => {
                return Err(format!(
                    "runtime_env['config'] key {other:?} is not supported (expected setup_timeout_seconds, eager_install)"
                ));
            }
        }
    }
    Ok(timeout)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rays_client_forms_parse_and_the_rest_is_refused_by_name() {
        let env = JobRuntimeEnv::parse_json(
            r#"{"working_dir": "gcs://_ray_pkg_abc.zip", "pip": {"packages": ["six"], "pip_check": false},
                "env_vars": {"A": "1"}, "_ray_commit": "x", "config": {"setup_timeout_seconds": 30}}"#,
        )
        .unwrap();
        assert_eq!(env.working_dir.as_deref(), Some("gcs://_ray_pkg_abc.zip"));
        assert_eq!(env.pip.as_ref().unwrap().packages, vec!["six"]);
        assert_eq!(env.env_vars["A"], "1");
        assert_eq!(env.setup_timeout, Some(Duration::from_secs(30)));
        let list = JobRuntimeEnv::parse_json(r#"{"pip": ["six", " "]}"#).unwrap();
        assert_eq!(list.pip.unwrap().packages, vec!["six"]);
        for (bad, says) in [
            (r#"{"conda": "env"}"#, "\"conda\" is not supported"),
            (r#"{"working_dir": "."}"#, "local path"),
            (r#"{"working_dir": "s3://b/x.zip"}"#, "remote URIs"),
            (r#"{"pip": "requirements.txt"}"#, "requirements file"),
            (r#"{"pip": {"packages": ["x"], "bogus": 1}}"#, "\"bogus\""),
            (r#"{"env_vars": {"A": 1}}"#, "must be a string"),
            (r#"[]"#, "JSON object"),
        ] {
            let e = JobRuntimeEnv::parse_json(bad).unwrap_err();
            assert!(e.contains(says), "{bad}: {e}");
        }
    }

    #[test]
    fn equal_pip_specs_share_a_hash() {
        let a = PipSpec { packages: vec!["six".into()], ..Default::default() };
        let mut b = a.clone();
        assert_eq!(a.hash(), b.hash());
        b.pip_check = true;
        assert_ne!(a.hash(), b.hash());
    }
}
