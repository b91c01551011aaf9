//! `tpuray logs`: Ray 2.60's `ray logs` (`ray/util/state/state_cli.py`) over the head's
//! logs API (`/api/v0/logs`, `/api/v0/logs/{file,stream}`; `head/src/logs_api.rs`).
//!
//! As Ray's: `logs [cluster] GLOB` lists the matching files of a node (the head node's
//! unless `--node-id`/`--node-ip` name another) as YAML grouped by kind, and prints the
//! file when exactly one matches; `actor --id|--pid`, `task --id [--attempt-number]`,
//! `worker --pid`, `job --id` print one log; `--tail N` (default 1000, -1 all) starts
//! with the preamble Ray prints, `--follow` keeps printing what is appended, `--err`
//! reads the stderr file. Every call blocks.

use std::io::Write;
use std::time::Duration;

use anyhow::{Result, anyhow, bail};
use serde_json::Value;

use crate::args::{LogsArgs, LogsClusterArgs, LogsCommon, LogsKind, LogsNode};
use crate::job::{ClientOptions, JobClient};

use crate::job::client::segment as enc;

fn query(params: &[(&str, String)]) -> String {
    params.iter().map(|(k, v)| format!("{k}={}", enc(v))).collect::<Vec<_>>().join("&")
}

fn client(address: Option<&str>) -> Result<JobClient> {
    JobClient::connect(ClientOptions {
        address: address.map(str::to_string),
        env_overrides: false,
        ..Default::default()
    })
    .map_err(|e| anyhow!("{e}"))
}

/// The node parameter a request names: the given id or ip, else the head node's id.
fn node_param(c: &JobClient, node: &LogsNode, timeout: Duration) -> Result<(&'static str, String)> {
    match (&node.node_id, &node.node_ip) {
        (Some(_), Some(_)) => bail!("give one of --node-id and --node-ip, not both"),
        (Some(id), None) => Ok(("node_id", id.clone())),
        (None, Some(ip)) => Ok(("node_ip", ip.clone())),
        (None, None) => {
            let body = c
                .get(
                    "/api/v0/nodes?filter_keys=is_head_node&filter_predicates=%3D&filter_values=true",
                    timeout,
                )
                .map_err(|e| anyhow!("{e}"))?;
            let v: Value = serde_json::from_str(&body)?;
            let id = v["data"]["result"]["result"]
                .as_array()
                .and_then(|rows| rows.iter().find_map(|r| r["node_id"].as_str()))
                .ok_or_else(|| {
                    anyhow!("the cluster has no live head node: name one with --node-id")
                })?;
            Ok(("node_id", id.to_string()))
        }
    }
}

/// How bytes become text (Ray's `--encoding`/`--encoding-errors`).
#[derive(Clone, Copy)]
enum OnBadBytes {
    Strict,
    Replace,
    Ignore,
}

fn decoding(encoding: &str, errors: &str) -> Result<OnBadBytes> {
    let e = encoding.to_ascii_lowercase().replace('_', "-");
    if e != "utf-8" && e != "utf8" {
        bail!("encoding {encoding:?} is not supported: tpuray logs decodes utf-8");
    }
    Ok(match errors {
        "strict" => OnBadBytes::Strict,
        "replace" => OnBadBytes::Replace,
        "ignore" => OnBadBytes::Ignore,
        other => bail!("--encoding-errors {other:?} is not supported (strict, replace or ignore)"),
    })
}

/// An incremental UTF-8 decoder: a sequence split between chunks waits for its rest.
struct Decoder {
    pending: Vec<u8>,
    on_bad: OnBadBytes,
}

impl Decoder {
    fn push(&mut self, data: &[u8], last: bool) -> Result<String> {
        self.pending.extend_from_slice(data);
        let mut out = String::new();
        loop {
            match std::str::from_utf8(&self.pending) {
                Ok(s) => {
                    out.push_str(s);
                    self.pending.clear();
                    return Ok(out);
                }
                Err(e) => {
                    let good = e.valid_up_to();
                    out.push_str(std::str::from_utf8(&self.pending[..good]).expect("valid prefix"));
                    let bad = match e.error_len() {
                        Some(n) => n,
                        None if !last => {
                            self.pending.drain(..good);
                            return Ok(out);
                        }
                        None => self.pending.len() - good,
                    };
                    match self.on_bad {
                        OnBadBytes::Strict => bail!(
                            "the log is not valid utf-8 (pass --encoding-errors replace or ignore)"
                        ),
                        OnBadBytes::Replace => out.push('\u{FFFD}'),
                        OnBadBytes::Ignore => {}
                    }
                    self.pending.drain(..good + bad);
                }
            }
        }
    }
}

/// Ray's `_print_log`: the preamble, then the log as it arrives.
fn print_log(
    c: &JobClient,
    common: &LogsCommon,
    mut params: Vec<(&str, String)>,
    on_bad: OnBadBytes,
) -> Result<i32> {
    if common.tail > 0 {
        println!(
            "--- Log has been truncated to last {} lines. Use `--tail` flag to toggle. Set to -1 for getting the entire file. ---\n",
            common.tail
        );
    }
    params.push(("lines", common.tail.to_string()));
    params.push(("timeout", common.timeout.to_string()));
    if let Some(i) = common.interval {
        if !common.follow {
            bail!("--interval is only for --follow");
        }
        params.push(("interval", i.to_string()));
    }
    let media = if common.follow { "stream" } else { "file" };
    let path = format!("/api/v0/logs/{media}?{}", query(&params));
    let mut body = c
        .get_stream(&path, Duration::from_secs(common.timeout.max(1) + 5))
        .map_err(|e| anyhow!("{e}"))?;
    let mut dec = Decoder { pending: Vec::new(), on_bad };
    let mut out = std::io::stdout().lock();
    while let Some(chunk) = body.next_chunk().map_err(|e| anyhow!("{e}"))? {
        out.write_all(dec.push(&chunk, false)?.as_bytes())?;
        out.flush()?;
    }
    out.write_all(dec.push(&[], true)?.as_bytes())?;
    out.flush()?;
    Ok(0)
}

fn cluster(a: LogsClusterArgs) -> Result<i32> {
    let on_bad = decoding(&a.encoding, &a.encoding_errors)?;
    let timeout = Duration::from_secs(a.common.timeout.max(1));
    let c = client(a.common.address.as_deref())?;
    let node = node_param(&c, &a.node, timeout)?;
    let q =
        query(&[node.clone(), ("glob", a.glob.clone()), ("timeout", a.common.timeout.to_string())]);
    let body = c
        .get(&format!("/api/v0/logs?{q}"), timeout + Duration::from_secs(5))
        .map_err(|e| anyhow!("{e}"))?;
    let v: Value = serde_json::from_str(&body)?;
    if v["result"] != Value::Bool(true) {
        bail!("API server internal error. Error: {}", v["msg"].as_str().unwrap_or(""));
    }
    let groups = v["data"]["result"].as_object().cloned().unwrap_or_default();
    let files: Vec<&str> = groups
        .values()
        .flat_map(|g| g.as_array().into_iter().flatten())
        .filter_map(Value::as_str)
        .collect();
    if files.len() == 1 {
        let params = vec![node, ("filename", files[0].to_string())];
        return print_log(&c, &a.common, params, on_bad);
    }
    if node.0 == "node_id" {
        println!("Node ID: {}", node.1);
    } else {
        println!("Node IP: {}", node.1);
    }
    // Ray prints the groups with yaml.dump(indent=4, explicit_start, explicit_end).
    let mut text = String::from("---\n");
    if groups.is_empty() {
        text = String::from("--- {}\n");
    }
    for (group, list) in &groups {
        text.push_str(&format!("{group}:\n"));
        for f in list.as_array().into_iter().flatten().filter_map(Value::as_str) {
            text.push_str(&format!("- {f}\n"));
        }
    }
    text.push_str("...\n");
    println!("{text}");
    Ok(0)
}

/// `tpuray logs ...` (see the module doc).
pub fn run(a: LogsArgs) -> Result<i32> {
    let kind = match a.kind {
        None => return cluster(a.cluster),
        Some(k) => k,
    };
    let suffix = |err: bool| ("suffix", if err { "err" } else { "out" }.to_string());
    match kind {
        LogsKind::Cluster(c) => cluster(c),
        LogsKind::Actor(x) => {
            if x.id.is_none() && x.pid.is_none() {
                bail!("At least one of `--pid` and `--id` has to be set");
            }
            let c = client(x.common.address.as_deref())?;
            let timeout = Duration::from_secs(x.common.timeout.max(1));
            let mut params = vec![suffix(x.err)];
            // As Ray's: the id wins over the pid; a pid needs a node (default the head's).
            if let Some(id) = &x.id {
                params.push(("actor_id", id.clone()));
                if x.node.node_id.is_some() || x.node.node_ip.is_some() {
                    params.push(node_param(&c, &x.node, timeout)?);
                }
            } else if let Some(pid) = x.pid {
                params.push(node_param(&c, &x.node, timeout)?);
                params.push(("pid", pid.to_string()));
            }
            print_log(&c, &x.common, params, OnBadBytes::Strict)
        }
        LogsKind::Task(x) => {
            let c = client(x.common.address.as_deref())?;
            let params = vec![
                ("task_id", x.id.clone()),
                ("attempt_number", x.attempt_number.to_string()),
                suffix(x.err),
            ];
            print_log(&c, &x.common, params, OnBadBytes::Strict)
        }
        LogsKind::Worker(x) => {
            let c = client(x.common.address.as_deref())?;
            let node = node_param(&c, &x.node, Duration::from_secs(x.common.timeout.max(1)))?;
            let params = vec![node, ("pid", x.pid.to_string()), suffix(x.err)];
            print_log(&c, &x.common, params, OnBadBytes::Strict)
        }
        LogsKind::Job(x) => {
            let c = client(x.common.address.as_deref())?;
            let node = node_param(
                &c,
                &LogsNode { node_id: None, node_ip: None },
                Duration::from_secs(x.common.timeout.max(1)),
            )?;
            let params = vec![node, ("submission_id", x.id.clone())];
            print_log(&c, &x.common, params, OnBadBytes::Strict)
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_sequence_split_between_chunks_decodes_whole_and_bad_bytes_follow_the_rule() {
        let mut d = Decoder { pending: Vec::new(), on_bad: OnBadBytes::Strict };
        let e = "é".as_bytes();
        assert_eq!(d.push(&[b'a', e[0]], false).unwrap(), "a");
        assert_eq!(d.push(&[e[1], b'b'], false).unwrap(), "éb");
        assert!(d.push(&[0xff], false).is_err());
        let mut d = Decoder { pending: Vec::new(), on_bad: OnBadBytes::Replace };
        assert_eq!(d.push(&[b'x', 0xff, b'y'], false).unwrap(), "x\u{FFFD}y");
        let mut d = Decoder { pending: Vec::new(), on_bad: OnBadBytes::Ignore };
        assert_eq!(d.push(&[b'x', e[0]], true).unwrap(), "x");
        assert!(decoding("latin-1", "strict").is_err());
        assert!(decoding("UTF_8", "bogus").is_err());
    }
}
