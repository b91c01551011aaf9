//! `tpuray job submit|status|logs|stop|list|delete`: Ray's `ray job` verbs
//! (`dashboard/modules/job/cli.py`), printing the lines Ray's CLI prints in a terminal
//! (its "pretty" log style, without colours; `ray` becomes `tpuray` in the hints).
//! Exit codes as Ray's: 0, except `submit` without `--no-wait` of a job that FAILED (1);
//! errors print `tpuray: <message>` and exit 1.

use std::collections::BTreeMap;
use std::io::Write;
use std::path::Path;
use std::time::Duration;

use anyhow::{Context, Result, bail};
use serde_json::{Map, Value, json};

use super::client::is_terminal;
use super::{ClientOptions, JobClient, runtime_env};
use crate::args::{JobCommand, JobCommonArgs, JobSubmitArgs};

/// Runs one `tpuray job` verb; returns the exit code.
pub fn run(cmd: JobCommand) -> Result<i32> {
    match cmd {
        JobCommand::Submit(a) => submit(*a),
        JobCommand::Status(a) => {
            let c = client(&a.common)?;
            log_job_status(&c, &a.job_id)?;
            Ok(0)
        }
        JobCommand::Logs(a) => {
            let c = client(&a.common)?;
            if a.follow {
                tail_logs(&c, &a.job_id)?;
            } else {
                let logs = c.logs(&a.job_id)?;
                print!("{logs}");
                std::io::stdout().flush()?;
            }
            Ok(0)
        }
        JobCommand::Stop(a) => {
            let c = client(&a.common)?;
            println!("Attempting to stop job '{}'", a.job_id);
            c.stop(&a.job_id)?;
            if a.no_wait {
                return Ok(0);
            }
            println!("Waiting for job '{}' to exit (disable with --no-wait):", a.job_id);
            loop {
                let status = c.job_status(&a.job_id)?;
                if is_terminal(&status) {
                    log_job_status(&c, &a.job_id)?;
                    return Ok(0);
                }
                println!("Job has not exited yet. Status: {status}");
                std::thread::sleep(Duration::from_secs(1));
            }
        }
        JobCommand::List(common) => {
            let c = client(&common)?;
            let jobs = c.list()?;
            println!("{}", pformat_jobs(&jobs));
            Ok(0)
        }
        JobCommand::Delete(a) => {
            let c = client(&a.common)?;
            c.delete(&a.job_id)?;
            println!("Job '{}' deleted successfully", a.job_id);
            Ok(0)
        }
    }
}

/// A JSON object of strings from flag `flag` (`--headers`, `--metadata-json`, ...).
fn string_map(flag: &str, text: &str, example: &str) -> Result<BTreeMap<String, String>> {
    let expected = || format!("{flag} must be a JSON object of strings, e.g. {flag}='{example}'");
    let v: Value = serde_json::from_str(text)
        .map_err(|e| anyhow::anyhow!("{flag} is not valid JSON ({e}): {}", expected()))?;
    let Value::Object(m) = v else { bail!("{}, got {text}", expected()) };
    m.into_iter()
        .map(|(k, v)| match v {
            Value::String(s) => Ok((k, s)),
            other => bail!("{}: {k:?} is {other}", expected()),
        })
        .collect()
}

/// A JSON object of numbers from `--entrypoint-resources`.
fn resources_map(text: &str) -> Result<Map<String, Value>> {
    let expected = r#"--entrypoint-resources must be a JSON object of resource names to numbers, e.g. --entrypoint-resources='{"CustomResource3": 1, "CustomResource2": 2}'"#;
    let v: Value = serde_json::from_str(text).map_err(|e| {
        anyhow::anyhow!("--entrypoint-resources is not valid JSON ({e}): {expected}")
    })?;
    let Value::Object(m) = v else { bail!("{expected}, got {text}") };
    for (k, v) in &m {
        if !v.is_number() {
            bail!("{expected}: {k:?} is {v}");
        }
    }
    Ok(m)
}

/// Ray's `--verify`: true/1, false/0, or a path that must exist.
fn check_verify(v: &str) -> Result<()> {
    match v.to_ascii_lowercase().as_str() {
        "true" | "1" | "false" | "0" => Ok(()),
        _ if Path::new(v).exists() => Ok(()),
        _ => bail!(
            "--verify {v:?}: expected true, false, or the path of a CA certificate file or folder (no such path)"
        ),
    }
}

/// Ray's `_get_sdk_client`: connects and prints the server's address.
fn client(common: &JobCommonArgs) -> Result<JobClient> {
    check_verify(&common.verify)?;
    let headers = match common.headers.clone().or_else(|| std::env::var("RAY_JOB_HEADERS").ok()) {
        Some(h) => string_map("--headers", &h, r#"{"Authorization": "Bearer <token>"}"#)?,
        None => BTreeMap::new(),
    };
    let opts = ClientOptions { address: common.address.clone(), headers, ..Default::default() };
    let c = JobClient::connect(opts)?;
    println!("Job submission server address: {}", c.address());
    Ok(c)
}

fn big_msg(msg: &str) {
    let line = "-".repeat(msg.chars().count());
    println!("\n{line}\n{msg}\n{line}\n");
}

/// Ray's `_log_job_status`: prints the job's end (or current) state; returns its status.
fn log_job_status(c: &JobClient, job_id: &str) -> Result<String> {
    let info = c.job_info(job_id)?;
    let status = info["status"].as_str().unwrap_or_default().to_string();
    let message = info["message"].as_str();
    match status.as_str() {
        "SUCCEEDED" => big_msg(&format!("Job '{job_id}' succeeded")),
        "STOPPED" => println!("Job '{job_id}' was stopped"),
        "FAILED" => {
            big_msg(&format!("Job '{job_id}' failed"));
            if let Some(m) = message {
                println!("Status message: {m}");
            }
        }
        _ => {
            println!("Status for job '{job_id}': {status}");
            if let Some(m) = message {
                println!("Status message: {m}");
            }
        }
    }
    Ok(status)
}

/// Ray's `_tail_logs`: prints the logs as they come until the job ended, then its state.
fn tail_logs(c: &JobClient, job_id: &str) -> Result<String> {
    let mut tail = c.tail(job_id);
    let mut out = std::io::stdout();
    while let Some(chunk) = tail.next_chunk()? {
        out.write_all(chunk.as_bytes())?;
        out.flush()?;
    }
    log_job_status(c, job_id)
}

/// Python's `shlex.quote`.
pub fn shell_quote(word: &str) -> String {
    if word.is_empty() {
        return "''".into();
    }
    let safe = word.chars().all(|c| c.is_ascii_alphanumeric() || "@%+=:,./-_".contains(c));
    if safe { word.to_string() } else { format!("'{}'", word.replace('\'', r#"'"'"'"#)) }
}

fn submit(a: JobSubmitArgs) -> Result<i32> {
    if a.job_id.is_some() {
        println!("--job-id option is deprecated. Please use --submission-id instead.");
    }
    let resources = a.entrypoint_resources.as_deref().map(resources_map).transpose()?;
    let label_selector = a
        .entrypoint_label_selector
        .as_deref()
        .map(|t| string_map("--entrypoint-label-selector", t, r#"{"zone": "us-west1-a"}"#))
        .transpose()?;
    let metadata = a
        .metadata_json
        .as_deref()
        .map(|t| string_map("--metadata-json", t, r#"{"key1": "value1", "key2": "value2"}"#))
        .transpose()?;
    for (flag, v) in [
        ("--entrypoint-num-cpus", a.entrypoint_num_cpus),
        ("--entrypoint-num-gpus", a.entrypoint_num_gpus),
    ] {
        if let Some(x) = v
            && !(x.is_finite() && x >= 0.0)
        {
            bail!("{flag} {x}: expected a number of at least 0");
        }
    }
    let (env, warning) = runtime_env::from_cli_args(
        a.runtime_env.as_deref(),
        a.runtime_env_json.as_deref(),
        a.working_dir.as_deref(),
    )?;
    let submission_id = a.submission_id.clone().or(a.job_id.clone());

    let c = client(&a.common)?;
    if let Some(w) = warning {
        println!("{w}");
    }
    let cwd = std::env::current_dir().context("reading the current folder")?;
    let env = runtime_env::prepare(&c, Value::Object(env), &cwd, &mut |line| println!("{line}"))?;
    let entrypoint: Vec<String> = a.entrypoint.iter().map(|w| shell_quote(w)).collect();
    let request = json!({
        "entrypoint": entrypoint.join(" "),
        "submission_id": submission_id,
        "runtime_env": env,
        "metadata": metadata,
        "entrypoint_num_cpus": a.entrypoint_num_cpus,
        "entrypoint_num_gpus": a.entrypoint_num_gpus,
        "entrypoint_memory": a.entrypoint_memory,
        "entrypoint_resources": resources,
        "entrypoint_label_selector": label_selector,
    });
    let job_id = c.submit(request)?;
    big_msg(&format!("Job '{job_id}' submitted successfully"));
    println!("Next steps");
    println!("  Query the logs of the job:");
    println!("    tpuray job logs {job_id}");
    println!("  Query the status of the job:");
    println!("    tpuray job status {job_id}");
    println!("  Request the job to be stopped:");
    println!("    tpuray job stop {job_id}");
    println!();
    std::io::stdout().flush()?;
    if a.no_wait {
        return Ok(0);
    }
    println!("Tailing logs until the job exits (disable with --no-wait):");
    let status = tail_logs(&c, &job_id)?;
    Ok(if status == "FAILED" { 1 } else { 0 })
}

/// Python's `repr` of a JSON value (as Ray's CLI prints `JobDetails` fields).
fn py_repr(v: &Value) -> String {
    match v {
        Value::Null => "None".into(),
        Value::Bool(b) => if *b { "True" } else { "False" }.into(),
        Value::Number(n) => n.to_string(),
        Value::String(s) => py_str(s),
        Value::Array(a) => format!("[{}]", a.iter().map(py_repr).collect::<Vec<_>>().join(", ")),
        Value::Object(m) => format!(
            "{{{}}}",
            m.iter()
                .map(|(k, v)| format!("{}: {}", py_str(k), py_repr(v)))
                .collect::<Vec<_>>()
                .join(", ")
        ),
    }
}

/// Python's `repr` of a string.
fn py_str(s: &str) -> String {
    let quote = if s.contains('\'') && !s.contains('"') { '"' } else { '\'' };
    let mut out = String::with_capacity(s.len() + 2);
    out.push(quote);
    for c in s.chars() {
        match c {
            '\\' => out.push_str("\\\\"),
            '\n' => out.push_str("\\n"),
            '\r' => out.push_str("\\r"),
            '\t' => out.push_str("\\t"),
            c if c == quote => {
                out.push('\\');
                out.push(c);
            }
            c if (c as u32) < 0x20 || c as u32 == 0x7f => {
                out.push_str(&format!("\\x{:02x}", c as u32))
            }
            c => out.push(c),
        }
    }
    out.push(quote);
    out
}

/// `JobDetails(...)` as pydantic's `repr` writes it, fields in the model's order.
fn job_details_repr(j: &Value) -> String {
    let enum_repr = |class: &str, v: &Value| match v.as_str() {
        Some(s) => format!("<{class}.{s}: {}>", py_str(s)),
        None => py_repr(v),
    };
    let driver = match &j["driver_info"] {
        Value::Object(d) => format!(
            "DriverInfo(id={}, node_ip_address={}, pid={})",
            py_repr(d.get("id").unwrap_or(&Value::Null)),
            py_repr(d.get("node_ip_address").unwrap_or(&Value::Null)),
            py_repr(
                &d.get("pid")
                    .map(|p| Value::String(
                        p.as_str().map(String::from).unwrap_or_else(|| p.to_string())
                    ))
                    .unwrap_or(Value::Null)
            ),
        ),
        _ => "None".into(),
    };
    let field = |k: &str| py_repr(j.get(k).unwrap_or(&Value::Null));
    format!(
        "JobDetails(type={}, job_id={}, submission_id={}, driver_info={driver}, status={}, entrypoint={}, message={}, error_type={}, start_time={}, end_time={}, metadata={}, runtime_env={}, driver_agent_http_address={}, driver_node_id={}, driver_exit_code={})",
        enum_repr("JobType", &j["type"]),
        field("job_id"),
        field("submission_id"),
        enum_repr("JobStatus", &j["status"]),
        field("entrypoint"),
        field("message"),
        field("error_type"),
        field("start_time"),
        field("end_time"),
        field("metadata"),
        field("runtime_env"),
        field("driver_agent_http_address"),
        field("driver_node_id"),
        field("driver_exit_code"),
    )
}

/// `pprint.pformat` of a list of `JobDetails` (one per line once it is over 80 columns).
fn pformat_jobs(jobs: &[Value]) -> String {
    let items: Vec<String> = jobs.iter().map(job_details_repr).collect();
    let one_line = format!("[{}]", items.join(", "));
    if one_line.len() <= 80 { one_line } else { format!("[{}]", items.join(",\n ")) }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn entrypoint_words_are_joined_as_shlex_join_does() {
        let words = ["python", "train.py", "--lr=0.1", "a b", "it's", "", "$HOME"];
        let joined: Vec<String> = words.iter().map(|w| shell_quote(w)).collect();
        assert_eq!(joined.join(" "), r#"python train.py --lr=0.1 'a b' 'it'"'"'s' '' '$HOME'"#);
    }

    #[test]
    fn job_lists_print_as_rays_pprint_of_job_details() {
        let j = json!({
            "type": "SUBMISSION", "job_id": "02000000", "submission_id": "raysubmit_1",
            "driver_info": {"id": "02000000", "node_ip_address": "10.0.0.1", "pid": "42"},
            "status": "SUCCEEDED", "entrypoint": "echo 'hi'", "message": "Job finished successfully.",
            "error_type": null, "start_time": 1, "end_time": 2, "metadata": {"a": "b"},
            "runtime_env": {"pip": ["six"]}, "driver_agent_http_address": null,
            "driver_node_id": "n", "driver_exit_code": 0
        });
        let r = job_details_repr(&j);
        assert_eq!(
            r,
            "JobDetails(type=<JobType.SUBMISSION: 'SUBMISSION'>, job_id='02000000', submission_id='raysubmit_1', \
             driver_info=DriverInfo(id='02000000', node_ip_address='10.0.0.1', pid='42'), \
             status=<JobStatus.SUCCEEDED: 'SUCCEEDED'>, entrypoint=\"echo 'hi'\", message='Job finished successfully.', \
             error_type=None, start_time=1, end_time=2, metadata={'a': 'b'}, runtime_env={'pip': ['six']}, \
             driver_agent_http_address=None, driver_node_id='n', driver_exit_code=0)"
        );
        assert_eq!(pformat_jobs(&[]), "[]");
        assert_eq!(pformat_jobs(&[j.clone(), j]).matches(",\n JobDetails(").count(), 1);
    }

    #[test]
    fn json_flags_say_what_they_expected() {
        let e = string_map("--headers", "[1]", "{}").unwrap_err().to_string();
        assert!(e.contains("--headers must be a JSON object of strings"), "{e}");
        let e = string_map("--metadata-json", r#"{"a": 1}"#, "{}").unwrap_err().to_string();
        assert!(e.contains("\"a\" is 1"), "{e}");
        let e = resources_map(r#"{"TPU": "4"}"#).unwrap_err().to_string();
        assert!(e.contains("resource names to numbers") && e.contains("\"TPU\""), "{e}");
        assert_eq!(resources_map(r#"{"TPU": 4}"#).unwrap()["TPU"], 4);
        assert!(check_verify("False").is_ok());
        assert!(
            check_verify("/nonexistent/ca.pem")
                .unwrap_err()
                .to_string()
                .contains("/nonexistent/ca.pem")
        );
    }
}
