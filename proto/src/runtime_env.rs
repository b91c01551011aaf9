//! The runtime environment of a job submitted through the Jobs API, as the head checks
//! it and a node agent builds it (Ray's `runtime_env` dict, `ray/runtime_env/runtime_env.py`
//! and `ray/_private/runtime_env/pip.py`).
//!
//! Fields honoured here: `working_dir` (a package URI, `gcs://_ray_pkg_<hash>.zip`, as
//! Ray's job client uploads it), `py_modules` (a list of package URIs: `gcs://..zip`
//! folders, `gcs://NAME.whl` wheels), `pip` (a list of requirement lines, or Ray's dict
//! form `{"packages": [...], "pip_check": bool, "pip_version": "==23.3"}`), `uv` (a list,
//! or Ray's dict form `{"packages": [...], "uv_check": bool, "uv_version": "==0.4",
//! "uv_pip_install_options": [...]}`), `env_vars`, and `config.setup_timeout_seconds` /
//! `config.eager_install` / `config.log_files` (empty only). `excludes` is applied by the
//! client when it packs `working_dir` and `py_modules` and means nothing after the
//! upload. Any other field is refused by name, and so are `pip` and `uv` together (Ray's
//! rule, `ray/runtime_env/runtime_env.py`).
//!
//! The same checks serve a whole job's environment (the Jobs API, `init`) and a task's
//! or actor's (already merged with its job's by the submitting SDK, Ray's
//! `_merge_runtime_env(job, task, override=True)`: the task's fields replace the job's,
//! `env_vars` merged per variable).

use std::collections::BTreeMap;
use std::time::Duration;

use serde_json::Value;

/// Ray's package URI scheme for files uploaded through the Jobs API (`gcs://`).
pub const PACKAGE_SCHEME: &str = "gcs://";
/// The fields [`JobRuntimeEnv::parse`] accepts.
pub const SUPPORTED_FIELDS: &[&str] =
    &["working_dir", "py_modules", "pip", "uv", "env_vars", "config", "excludes"];
/// How a node agent's message for a failed environment setup starts; the SDK turns a
/// failure carrying it into `RuntimeEnvSetupError` (Ray's class) and the Jobs API into
/// the job's `RUNTIME_ENV_SETUP_FAILURE`.
pub const SETUP_FAILED_PREFIX: &str = "runtime_env setup failed: ";
/// Ray's default `uv_pip_install_options` (`ray/_private/runtime_env/uv.py`).
pub const UV_DEFAULT_INSTALL_OPTIONS: &[&str] = &["--no-cache"];
/// Ray's default `setup_timeout_seconds` (`DEFAULT_RUNTIME_ENV_TIMEOUT_SECONDS`).
pub const DEFAULT_SETUP_TIMEOUT: Duration = Duration::from_secs(600);

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

/// `uv` in Ray's dict form (`ray/_private/runtime_env/validation.py`,
/// `parse_and_validate_uv`).
#[derive(Clone, Debug, Default, PartialEq)]
pub struct UvSpec {
    /// Requirement lines.
    pub packages: Vec<String>,
    /// Run `uv pip check` after installing (Ray's default: false).
    pub uv_check: bool,
    /// A uv version specifier (`"==0.4.0"`): that uv is pip-installed into the
    /// environment and used instead of the node's.
    pub uv_version: Option<String>,
    /// `uv pip install` options; `None` means Ray's default, [`UV_DEFAULT_INSTALL_OPTIONS`].
    pub install_options: Option<Vec<String>>,
}

impl UvSpec {
    /// The options `uv pip install` gets (Ray's default when none were given).
    pub fn options(&self) -> Vec<String> {
        self.install_options
            .clone()
            .unwrap_or_else(|| UV_DEFAULT_INSTALL_OPTIONS.iter().map(|s| s.to_string()).collect())
    }

    /// The content hash naming the environment built for it (as [`PipSpec::hash`]).
    pub fn hash(&self) -> String {
        use sha2::Digest;
        let canon = serde_json::json!({
            "uv": self.packages,
            "uv_check": self.uv_check,
            "uv_version": self.uv_version,
            "uv_pip_install_options": self.options(),
        });
        format!("{:x}", sha2::Sha256::digest(canon.to_string().as_bytes()))
    }
}

/// A runtime environment (a job's, or a task's merged with its job's), checked.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct JobRuntimeEnv {
    /// A package URI (`gcs://...`).
    pub working_dir: Option<String>,
    /// Package URIs (`gcs://_ray_pkg_<hash>.zip` folders, `gcs://NAME.whl` wheels), in
    /// the order given: each lands on the worker's `sys.path` (Ray's order).
    pub py_modules: Vec<String>,
    pub pip: Option<PipSpec>,
    pub uv: Option<UvSpec>,
    pub env_vars: BTreeMap<String, String>,
    /// `config.setup_timeout_seconds`: [`DEFAULT_SETUP_TIMEOUT`] when not given, `None`
    /// for Ray's `-1` (no limit).
    pub setup_timeout: Option<Duration>,
    /// `config.eager_install` (Ray's default: true): a driver's `init` starts building
    /// the environment on its node before the first task asks for a worker.
    pub eager_install: bool,
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
        let mut env = Self {
            eager_install: true,
            setup_timeout: Some(DEFAULT_SETUP_TIMEOUT),
            ..Self::default()
        };
        for (k, val) in map {
            match k.as_str() {
                // Ray's job client adds the commit of the Ray that sent it; it is
                // bookkeeping, not an option, and is dropped (the one field accepted
                // without effect).
                "_ray_commit" => {}
                "working_dir" => env.working_dir = parse_working_dir(val)?,
                "py_modules" => env.py_modules = parse_py_modules(val)?,
                "pip" => env.pip = parse_pip(val)?,
                "uv" => env.uv = parse_uv(val)?,
                "env_vars" => env.env_vars = parse_env_vars(val)?,
                "config" => {
                    let (timeout, eager) = parse_config(val)?;
                    if let Some(t) = timeout {
                        env.setup_timeout = t;
                    }
                    env.eager_install = eager;
                }
                // Applied by the client when it packed working_dir and py_modules.
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
        if env.pip.is_some() && env.uv.is_some() {
            return Err(
                "the 'pip' field and the 'uv' field of runtime_env cannot be specified at \
                        the same time (Ray's rule); give one of them"
                    .into(),
            );
        }
        Ok(env)
    }

    /// Whether there is nothing to set up.
    pub fn is_empty(&self) -> bool {
        !self.needs_build() && self.env_vars.is_empty()
    }

    /// Whether a node must build something (fetch a package, make a venv) before a
    /// process can start in this environment.
    pub fn needs_build(&self) -> bool {
        self.working_dir.is_some()
            || !self.py_modules.is_empty()
            || self.pip.is_some()
            || self.uv.is_some()
    }
}

fn parse_py_modules(v: &Value) -> Result<Vec<String>, String> {
    if v.is_null() {
        return Ok(Vec::new());
    }
    let uris = string_list("runtime_env['py_modules']", v)?;
    for u in &uris {
        let Some(name) = u.strip_prefix(PACKAGE_SCHEME) else {
            return Err(if u.contains("://") {
                format!(
                    "runtime_env['py_modules'] entry {u:?}: tpuray reads packages from the cluster \
                     only (gcs:// URIs, uploaded by the client); remote URIs are not fetched"
                )
            } else {
                format!(
                    "runtime_env['py_modules'] entry {u:?} is a local path: the client uploads it \
                     and sends its package URI (tpuray.init, .options(runtime_env=...), \
                     JobSubmissionClient or `tpuray job submit` do)"
                )
            });
        };
        if name.is_empty()
            || name.contains('/')
            || !(name.ends_with(".zip") || name.ends_with(".whl"))
        {
            return Err(format!(
                "runtime_env['py_modules'] entry {u:?} is not a package URI tpuray unpacks \
                 (expected gcs://_ray_pkg_<hash>.zip or gcs://NAME.whl)"
            ));
        }
    }
    Ok(uris)
}

fn opt_version(what: &str, v: &Value, example: &str) -> Result<Option<String>, String> {
    match v {
        Value::Null => Ok(None),
        Value::String(s) if !s.trim().is_empty() => Ok(Some(s.trim().to_string())),
        other => {
            Err(format!("{what} must be a version specifier such as \"{example}\" (got {other})"))
        }
    }
}

fn parse_uv(v: &Value) -> Result<Option<UvSpec>, String> {
    let spec = match v {
        Value::Null => return Ok(None),
        Value::Array(_) => {
            UvSpec { packages: string_list("runtime_env['uv']", v)?, ..Default::default() }
        }
        Value::Object(m) => {
            if !m.contains_key("packages") {
                return Err(format!("runtime_env['uv'] must include field 'packages' (got {v})"));
            }
            let mut spec = UvSpec::default();
            for (k, val) in m {
                match k.as_str() {
                    "packages" => {
                        if let Value::String(s) = val {
                            return Err(format!(
                                "runtime_env['uv']['packages'] {s:?}: a requirements file is read by \
                                 the client; send its lines as a list"
                            ));
                        }
                        spec.packages = string_list("runtime_env['uv']['packages']", val)?;
                    }
                    "uv_check" => {
                        spec.uv_check = val.as_bool().ok_or_else(|| {
                            format!(
                                "runtime_env['uv']['uv_check'] must be true or false (got {val})"
                            )
                        })?
                    }
                    "uv_version" => {
                        spec.uv_version =
                            opt_version("runtime_env['uv']['uv_version']", val, "==0.4.0")?
                    }
                    "uv_pip_install_options" => {
                        spec.install_options =
                            Some(string_list("runtime_env['uv']['uv_pip_install_options']", val)?)
                    }
                    other => {
                        return Err(format!(
                            "runtime_env['uv'] key {other:?} is not supported (expected packages, \
                             uv_check, uv_version, uv_pip_install_options)"
                        ));
                    }
                }
            }
            spec
        }
        Value::String(s) => {
            return Err(format!(
                "runtime_env['uv'] {s:?}: a requirements file is read by the client; send its lines as a list"
            ));
        }
        other => {
            return Err(format!(
                "runtime_env['uv'] must be a list of requirements or a dict with 'packages' (got {other})"
            ));
        }
    };
    Ok(if spec.packages.is_empty() { None } else { Some(spec) })
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

/// `(setup timeout if given: None for no limit, eager_install)` from Ray's
/// `RuntimeEnvConfig` dict.
fn parse_config(v: &Value) -> Result<(Option<Option<Duration>>, bool), String> {
    let Value::Object(m) = v else {
        return if v.is_null() {
            Ok((None, true))
        } else {
            Err(format!("runtime_env['config'] must be a dict (got {v})"))
        };
    };
    let mut timeout = None;
    let mut eager = true;
    for (k, val) in m {
        match k.as_str() {
            "setup_timeout_seconds" => {
                let s = val.as_f64().ok_or_else(|| {
                    format!("runtime_env['config']['setup_timeout_seconds'] must be a number (got {val})")
                })?;
                // Ray: -1 disables the timeout.
                timeout = if s == -1.0 {
                    Some(None)
                } else if s > 0.0 && s.is_finite() {
                    Some(Some(Duration::from_secs_f64(s)))
                } else {
                    return Err(format!(
                        "runtime_env['config']['setup_timeout_seconds'] must be positive or -1 (got {s})"
                    ));
                };
            }
            "eager_install" => {
                eager = val.as_bool().ok_or_else(|| {
                    format!(
                        "runtime_env['config']['eager_install'] must be true or false (got {val})"
                    )
                })?;
            }
            // Ray's RuntimeEnvConfig always carries it (default []); files to show in
            // Ray's dashboard, which tpuray's does not list.
            "log_files" => match val {
                Value::Null => {}
                Value::Array(a) if a.is_empty() => {}
                other => {
                    return Err(format!(
                        "runtime_env['config']['log_files'] {other} is not supported by tpuray \
                         (its dashboard does not list runtime environment log files); leave it empty"
                    ));
                }
            },
            other => {
                return Err(format!(
                    "runtime_env['config'] key {other:?} is not supported (expected setup_timeout_seconds, \
                     eager_install, log_files)"
                ));
            }
        }
    }
    Ok((timeout, eager))
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
            (r#"{"pip": ["a"], "uv": ["b"]}"#, "cannot be specified at the same time"),
            (r#"{"uv": {"uv_check": true}}"#, "must include field 'packages'"),
            (r#"{"uv": {"packages": ["x"], "nope": 1}}"#, "\"nope\""),
            (r#"{"py_modules": ["./lib"]}"#, "local path"),
            (r#"{"py_modules": ["https://h/x.zip"]}"#, "remote URIs"),
            (r#"{"py_modules": ["gcs://x.tar.gz"]}"#, "not a package URI"),
            (r#"{"config": {"log_files": ["a.log"]}}"#, "log_files"),
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
    fn uv_forms_py_modules_and_config_parse_with_rays_defaults() {
        let env = JobRuntimeEnv::parse_json(r#"{"uv": ["six"], "py_modules": ["gcs://_ray_pkg_1.zip", "gcs://w-1.0-py3-none-any.whl"]}"#)
            .unwrap();
        let uv = env.uv.unwrap();
        assert_eq!(uv.packages, vec!["six"]);
        assert_eq!(uv.options(), vec!["--no-cache"]);
        assert_eq!(env.py_modules.len(), 2);
        assert!(env.eager_install);
        let env = JobRuntimeEnv::parse_json(
            r#"{"uv": {"packages": ["six"], "uv_check": true, "uv_pip_install_options": []},
                "config": {"setup_timeout_seconds": -1, "eager_install": false, "log_files": []}}"#,
        )
        .unwrap();
        let uv = env.uv.unwrap();
        assert!(uv.uv_check && uv.options().is_empty());
        assert_eq!(env.setup_timeout, None, "-1: no limit");
        assert_eq!(
            JobRuntimeEnv::parse_json(r#"{"uv": ["six"]}"#).unwrap().setup_timeout,
            Some(DEFAULT_SETUP_TIMEOUT)
        );
        assert!(!env.eager_install);
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
