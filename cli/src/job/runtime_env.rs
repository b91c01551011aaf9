//! A job's `runtime_env` made ready to send, as Ray's `JobSubmissionClient.submit_job`
//! makes it: a local `working_dir` (a folder, or a `.zip`/`.tar.gz`/`.tgz`/`.tar.xz`
//! file) and local `py_modules` entries are uploaded (only when the server lacks them)
//! and replaced by their `gcs://` URIs; a `pip` given as a requirements file is read into
//! its list of lines; a `conda` given as a `.yml`/`.yaml` file is read into its object.
//! URIs (`gcs://`, `https://...zip`, `s3://`, `local://`, ...) pass as they are. Other
//! fields pass untouched: the server judges them.
//!
//! Also: Ray's CLI rules for `--runtime-env FILE`, `--runtime-env-json` and
//! `--working-dir` ([`from_cli_args`]), and the YAML reader they need.

use std::path::{Path, PathBuf};

use serde_json::{Map, Value};

use super::package::{self, Package};
use super::{JobClient, JobError};

/// URI protocols Ray knows (`ray._private.runtime_env.protocol`).
const PROTOCOLS: [&str; 12] =
    ["gcs", "conda", "pip", "uv", "http", "https", "s3", "gs", "azure", "abfss", "file", "local"];
/// Of those, the ones naming a remote archive (which must end in an archive suffix).
const REMOTE_PROTOCOLS: [&str; 7] = ["http", "https", "s3", "gs", "azure", "abfss", "file"];

/// The protocol of `s` if it is a URI of a known protocol.
fn uri_protocol(s: &str) -> Option<String> {
    let (scheme, _) = s.split_once("://")?;
    let scheme = scheme.to_ascii_lowercase();
    PROTOCOLS.contains(&scheme.as_str()).then_some(scheme)
}

fn has_suffix(path: &str, suffixes: &[&str]) -> bool {
    let path = path.split(['?', '#']).next().unwrap_or(path);
    suffixes.iter().any(|s| path.ends_with(s))
}

/// Reads a YAML (or JSON) document into a JSON value.
pub fn parse_yaml(text: &str, what: &str) -> Result<Value, JobError> {
    let docs = yaml_rust2::YamlLoader::load_from_str(text)
        .map_err(|e| JobError::Invalid(format!("{what} is not YAML or JSON: {e}")))?;
    match docs.into_iter().next() {
        None => Ok(Value::Null),
        Some(d) => yaml_to_json(d, what),
    }
}

fn yaml_to_json(y: yaml_rust2::Yaml, what: &str) -> Result<Value, JobError> {
    use yaml_rust2::Yaml;
    Ok(match y {
        Yaml::Null => Value::Null,
        Yaml::Boolean(b) => Value::Bool(b),
        Yaml::Integer(i) => Value::from(i),
        Yaml::Real(r) => match r.parse::<f64>().ok().and_then(serde_json::Number::from_f64) {
            Some(n) => Value::Number(n),
            None => Value::String(r),
        },
        Yaml::String(s) => Value::String(s),
        Yaml::Array(a) => {
            Value::Array(a.into_iter().map(|v| yaml_to_json(v, what)).collect::<Result<_, _>>()?)
        }
        Yaml::Hash(h) => {
            let mut m = Map::new();
            for (k, v) in h {
                let key = match k {
                    Yaml::String(s) | Yaml::Real(s) => s,
                    Yaml::Integer(i) => i.to_string(),
                    Yaml::Boolean(b) => if b { "True" } else { "False" }.to_string(),
                    Yaml::Null => "None".to_string(),
                    other => {
                        return Err(JobError::Invalid(format!(
                            "{what} has a key that is not a scalar: {other:?}"
                        )));
                    }
                };
                m.insert(key, yaml_to_json(v, what)?);
            }
            Value::Object(m)
        }
        Yaml::Alias(_) | Yaml::BadValue => {
            return Err(JobError::Invalid(format!(
                "{what} uses a YAML alias or a bad value, which is not supported"
            )));
        }
    })
}

/// Ray's `parse_runtime_env_args`: at most one of `file` (YAML or JSON) and `json`;
/// `working_dir` (the `--working-dir` flag) overrides the one they name. Returns the
/// environment and the warning Ray prints when it overrides.
pub fn from_cli_args(
    file: Option<&Path>,
    json: Option<&str>,
    working_dir: Option<&str>,
) -> Result<(Map<String, Value>, Option<String>), JobError> {
    let mut env = match (file, json) {
        (Some(_), Some(_)) => {
            return Err(JobError::Invalid(
                "only one of --runtime-env and --runtime-env-json can be provided".into(),
            ));
        }
        (Some(f), None) => {
            let text = std::fs::read_to_string(f).map_err(|e| {
                JobError::Invalid(format!("cannot read --runtime-env file {}: {e}", f.display()))
            })?;
            let what = format!("--runtime-env file {}", f.display());
            as_env(parse_yaml(&text, &what)?, &what)?
        }
        (None, Some(j)) => {
            let v: Value = serde_json::from_str(j).map_err(|e| {
                JobError::Invalid(format!("--runtime-env-json is not valid JSON ({e}); expected an object such as '{{\"pip\": [\"requests\"]}}'"))
            })?;
            as_env(v, "--runtime-env-json")?
        }
        (None, None) => Map::new(),
    };
    let mut warning = None;
    if let Some(wd) = working_dir {
        if env.contains_key("working_dir") {
            warning =
                Some("Overriding runtime_env working_dir with --working-dir option".to_string());
        }
        env.insert("working_dir".into(), Value::String(wd.into()));
    }
    Ok((env, warning))
}

fn as_env(v: Value, what: &str) -> Result<Map<String, Value>, JobError> {
    match v {
        Value::Object(m) => Ok(m),
        Value::Null => Ok(Map::new()),
        other => Err(JobError::Invalid(format!(
            "{what} must be an object of runtime_env fields, got {other}"
        ))),
    }
}

/// Uploads `pkg` unless the server has it; `log` hears what happens.
fn upload_if_needed(
    client: &JobClient,
    pkg: Package,
    log: &mut dyn FnMut(String),
) -> Result<String, JobError> {
    if client.package_exists(&pkg.uri)? {
        log(format!("Package {} already exists, skipping upload.", pkg.uri));
    } else {
        log(format!("Uploading package {} ({} bytes).", pkg.uri, pkg.bytes.len()));
        client.upload_package(&pkg.uri, pkg.bytes)?;
    }
    Ok(pkg.uri)
}

fn string_list(v: &Value, what: &str) -> Result<Vec<String>, JobError> {
    match v {
        Value::Null => Ok(Vec::new()),
        Value::Array(a) => a
            .iter()
            .map(|x| {
                x.as_str().map(String::from).ok_or_else(|| {
                    JobError::Invalid(format!(
                        "runtime_env {what} must be a list of strings, got {v}"
                    ))
                })
            })
            .collect(),
        other => Err(JobError::Invalid(format!(
            "runtime_env {what} must be a list of strings, got {other}"
        ))),
    }
}

/// A local path, relative to `cwd` unless absolute.
fn local(cwd: &Path, p: &str) -> PathBuf {
    let p = Path::new(p);
    if p.is_absolute() { p.to_path_buf() } else { cwd.join(p) }
}

/// Prepares `env` for submission through `client` (see the module doc). `cwd` is where
/// relative paths start.
pub fn prepare(
    client: &JobClient,
    env: Value,
    cwd: &Path,
    log: &mut dyn FnMut(String),
) -> Result<Value, JobError> {
    let mut env = match env {
        Value::Null => return Ok(Value::Object(Map::new())),
        Value::Object(m) => m,
        other => return Err(JobError::Invalid(format!("runtime_env must be a dict, got {other}"))),
    };
    let user_excludes = string_list(env.get("excludes").unwrap_or(&Value::Null), "excludes")?;
    let gitignore = package::include_gitignore();

    if let Some(wd) = env.get("working_dir").cloned() {
        let uri = match wd {
            Value::String(s) => working_dir_uri(client, &s, cwd, &user_excludes, gitignore, log)?,
            Value::Null => None,
            other => {
                return Err(JobError::Invalid(format!(
                    "working_dir must be a string (a local path or a remote URI), got {other}"
                )));
            }
        };
        if let Some(uri) = uri {
            env.insert("working_dir".into(), Value::String(uri));
        }
    }

    if let Some(mods) = env.get("py_modules").cloned().filter(|v| !v.is_null()) {
        let Value::Array(mods) = mods else {
            return Err(JobError::Invalid(format!(
                "py_modules must be a list of local paths or URIs, got {mods}"
            )));
        };
        let mut uris = Vec::with_capacity(mods.len());
        for m in mods {
            let Value::String(m) = m else {
                return Err(JobError::Invalid(format!(
                    "py_modules entries must be strings, got {m}"
                )));
            };
            uris.push(Value::String(py_module_uri(
                client,
                &m,
                cwd,
                &user_excludes,
                gitignore,
                log,
            )?));
        }
        env.insert("py_modules".into(), Value::Array(uris));
    }

    if let Some(Value::String(req)) = env.get("pip").cloned() {
        // A requirements file (Ray: `read_text().strip().split("\n")`).
        let path = local(cwd, &req);
        let text = std::fs::read_to_string(&path).map_err(|e| {
            JobError::Invalid(format!(
                "runtime_env pip {req:?} is not a readable requirements file ({e}); expected a list of packages or a requirements file"
            ))
        })?;
        let lines: Vec<Value> =
            text.trim().split('\n').map(|l| Value::String(l.to_string())).collect();
        env.insert("pip".into(), Value::Array(lines));
    }

    if let Some(Value::String(c)) = env.get("conda").cloned()
        && (c.ends_with(".yml") || c.ends_with(".yaml"))
    {
        let path = local(cwd, &c);
        let text = std::fs::read_to_string(&path).map_err(|e| {
            JobError::Invalid(format!("cannot read runtime_env conda file {}: {e}", path.display()))
        })?;
        let what = format!("runtime_env conda file {}", path.display());
        env.insert("conda".into(), parse_yaml(&text, &what)?);
    }

    Ok(Value::Object(env))
}

/// The package of a local `working_dir` (`field` = `"working_dir"`) or `py_modules`
/// entry (`"py_modules"`) `s`, as Ray's client packs it: `excludes` (gitignore patterns)
/// and, for a `working_dir`, Ray's default excludes, left out; `None` when `s` is a URI
/// (sent as it is).
///
/// # Errors
/// `Invalid` for a path that is neither a folder nor a supported file, a URI of a
/// protocol Ray does not know, a bad pattern, a package over the size limit.
pub fn package_local(
    field: &str,
    s: &str,
    cwd: &Path,
    user_excludes: &[String],
) -> Result<Option<Package>, JobError> {
    let gitignore = package::include_gitignore();
    match field {
        "working_dir" => working_dir_package(s, cwd, user_excludes, gitignore, &mut |_| {}),
        "py_modules" => py_module_package(s, cwd, user_excludes, gitignore, &mut |_| {}),
        other => Err(JobError::Invalid(format!(
            "cannot package runtime_env field {other:?} (expected working_dir or py_modules)"
        ))),
    }
}

/// The URI to send for `working_dir` `s`, uploading a local one; `None`: leave it.
fn working_dir_uri(
    client: &JobClient,
    s: &str,
    cwd: &Path,
    user_excludes: &[String],
    gitignore: bool,
    log: &mut dyn FnMut(String),
) -> Result<Option<String>, JobError> {
    match working_dir_package(s, cwd, user_excludes, gitignore, log)? {
        Some(pkg) => upload_if_needed(client, pkg, log).map(Some),
        None => Ok(None),
    }
}

fn working_dir_package(
    s: &str,
    cwd: &Path,
    user_excludes: &[String],
    gitignore: bool,
    log: &mut dyn FnMut(String),
) -> Result<Option<Package>, JobError> {
    if let Some(protocol) = uri_protocol(s) {
        if (protocol == "gcs" || REMOTE_PROTOCOLS.contains(&protocol.as_str()))
            && !has_suffix(s, &package::WORKING_DIR_ARCHIVES)
        {
            return Err(JobError::Invalid(format!(
                "working_dir URI {s:?} must name an archive ending in {}",
                package::WORKING_DIR_ARCHIVES.join(", ")
            )));
        }
        return Ok(None);
    }
    if let Some((scheme, _)) = s.split_once("://") {
        return Err(JobError::Invalid(format!(
            "working_dir {s:?} has protocol {scheme:?}, which Ray does not know (known: {})",
            PROTOCOLS.join(", ")
        )));
    }
    let path = local(cwd, s);
    let pkg = if path.is_dir() {
        let excludes = [package::default_excludes(), user_excludes.to_vec()].concat();
        log(format!("Creating a file package for local module '{s}'."));
        package::package_directory(&path, &excludes, gitignore, false)?
    } else if path.is_file() && has_suffix(s, &package::WORKING_DIR_ARCHIVES) {
        package::package_archive(&path)?
    } else {
        return Err(JobError::Invalid(format!(
            "working_dir {s:?} must be an existing directory or a supported archive ({})",
            package::WORKING_DIR_ARCHIVES.join(", ")
        )));
    };
    Ok(Some(pkg))
}

/// The URI to send for a `py_modules` entry, uploading a local one.
fn py_module_uri(
    client: &JobClient,
    m: &str,
    cwd: &Path,
    user_excludes: &[String],
    gitignore: bool,
    log: &mut dyn FnMut(String),
) -> Result<String, JobError> {
    match py_module_package(m, cwd, user_excludes, gitignore, log)? {
        Some(pkg) => upload_if_needed(client, pkg, log),
        None => Ok(m.to_string()),
    }
}

fn py_module_package(
    m: &str,
    cwd: &Path,
    user_excludes: &[String],
    gitignore: bool,
    log: &mut dyn FnMut(String),
) -> Result<Option<Package>, JobError> {
    if uri_protocol(m).is_some() {
        return Ok(None);
    }
    let path = local(cwd, m);
    let pkg = if path.is_dir() {
        // Ray applies only the runtime_env's own excludes to py_modules.
        log(format!("Creating a file package for local module '{m}'."));
        package::package_directory(&path, user_excludes, gitignore, true)?
    } else if path.is_file() && m.ends_with(".py") {
        package::package_file(&path)?
    } else if path.is_file() && has_suffix(m, &package::PY_MODULES_ARCHIVES) {
        package::package_archive(&path)?
    } else {
        return Err(JobError::Invalid(format!(
            "py_modules entry {m:?} must be a URI, an existing directory, a .py file or a supported archive ({})",
            package::PY_MODULES_ARCHIVES.join(", ")
        )));
    };
    Ok(Some(pkg))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn yaml_and_json_runtime_env_files_read_alike() {
        let y =
            parse_yaml("working_dir: .\npip:\n  - six==1.16.0\nenv_vars:\n  A: '1'\n  N: 2\n", "f")
                .unwrap();
        let j = parse_yaml(
            r#"{"working_dir": ".", "pip": ["six==1.16.0"], "env_vars": {"A": "1", "N": 2}}"#,
            "f",
        )
        .unwrap();
        assert_eq!(y, j);
        assert_eq!(y["pip"][0], "six==1.16.0");
        assert_eq!(parse_yaml("", "f").unwrap(), Value::Null);
        let e = parse_yaml("a: [", "runtime.yaml").unwrap_err().to_string();
        assert!(e.starts_with("runtime.yaml is not YAML or JSON"), "{e}");
    }

    #[test]
    fn cli_runtime_env_flags_follow_rays_rules() {
        let (env, warn) =
            from_cli_args(None, Some(r#"{"working_dir": "a", "pip": ["x"]}"#), Some("b")).unwrap();
        assert_eq!(env["working_dir"], "b");
        assert_eq!(env["pip"][0], "x");
        assert!(warn.unwrap().contains("Overriding"));
        let (env, warn) = from_cli_args(None, None, Some(".")).unwrap();
        assert_eq!(Value::Object(env), serde_json::json!({"working_dir": "."}));
        assert!(warn.is_none());
        let e = from_cli_args(Some(Path::new("f")), Some("{}"), None).unwrap_err().to_string();
        assert!(e.contains("only one of --runtime-env and --runtime-env-json"), "{e}");
        let e = from_cli_args(None, Some("[1]"), None).unwrap_err().to_string();
        assert!(e.contains("--runtime-env-json must be an object"), "{e}");
        let e = from_cli_args(None, Some("{"), None).unwrap_err().to_string();
        assert!(e.contains("--runtime-env-json is not valid JSON"), "{e}");
        let e = from_cli_args(Some(Path::new("/nonexistent/env.yaml")), None, None)
            .unwrap_err()
            .to_string();
        assert!(e.contains("/nonexistent/env.yaml"), "{e}");
    }

    #[test]
    fn uris_are_told_from_paths() {
        assert_eq!(uri_protocol("gcs://_ray_pkg_1.zip").as_deref(), Some("gcs"));
        assert_eq!(uri_protocol("HTTPS://h/x.zip").as_deref(), Some("https"));
        assert_eq!(uri_protocol("./dir"), None);
        assert_eq!(uri_protocol("foo://x"), None);
        assert!(has_suffix("https://h/x.zip?token=1", &package::WORKING_DIR_ARCHIVES));
        assert!(!has_suffix("s3://b/x", &package::WORKING_DIR_ARCHIVES));
    }
}
