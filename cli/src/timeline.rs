//! `tpuray timeline`: the cluster's task events as Chrome trace JSON, as Ray's `ray
//! timeline` writes them (`tpuray_head::timeline`, which also serves `tpuray.timeline()`
//! and the dashboard's `/api/v0/tasks/timeline`). Open the file in Perfetto
//! (ui.perfetto.dev) or `chrome://tracing`.

use std::path::PathBuf;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use anyhow::{Context, Result, anyhow};
use tonic::Request;
use tpuray_proto::pb;

/// The trace events of the cluster at `address` (job `job` only, when given), as a JSON
/// array. Blocks: it runs a runtime of its own.
///
/// # Errors
/// When the head cannot be reached or answers an error.
pub fn trace_json(address: &str, job: Option<&str>) -> Result<String> {
    let rt = tokio::runtime::Builder::new_current_thread().enable_all().build()?;
    let (tasks, nodes, job) = rt.block_on(async {
        let token = tpuray_proto::auth::load_token()?;
        let mut head = tpuray_proto::client::head(address, token.as_deref())?;
        let err = |s: tonic::Status| match tpuray_proto::tls::why_failed(address, "head", &s) {
            Some(why) => anyhow!(why),
            None => anyhow!("the head at {address} answered {:?}: {}", s.code(), s.message()),
        };
        let mut req = Request::new(pb::ListTasksRequest { limit: 0 });
        req.set_timeout(Duration::from_secs(30));
        let tasks = head.list_tasks(req).await.map_err(err)?.into_inner().tasks;
        let mut req = Request::new(pb::GetClusterStatusRequest {});
        req.set_timeout(Duration::from_secs(10));
        let nodes = head.get_cluster_status(req).await.map_err(err)?.into_inner().nodes;
        let job = match job {
            None => None,
            Some(want) => {
                let mut req = Request::new(pb::ListJobsRequest {});
                req.set_timeout(Duration::from_secs(10));
                let jobs = head.list_jobs(req).await.map_err(err)?.into_inner().jobs;
                Some(job_named(&jobs, want)?)
            }
        };
        Ok::<_, anyhow::Error>((tasks, nodes, job))
    })?;
    let now = SystemTime::now().duration_since(UNIX_EPOCH).map(|d| d.as_millis() as u64)?;
    let events = tpuray_head::timeline::chrome_trace(&tasks, &nodes, job.as_deref(), now);
    Ok(serde_json::Value::Array(events).to_string())
}

/// The job id of the job that `want` names, by its job id or its Jobs API submission id.
///
/// # Errors
/// When no job of the cluster has that id, naming it and the known ones (an unknown id would
/// otherwise write an empty trace without a word).
fn job_named(jobs: &[pb::JobInfo], want: &str) -> Result<String> {
    if let Some(j) = jobs
        .iter()
        .find(|j| j.job_id == want || (!j.submission_id.is_empty() && j.submission_id == want))
    {
        return Ok(j.job_id.clone());
    }
    let known: Vec<&str> = jobs.iter().map(|j| j.job_id.as_str()).collect();
    Err(anyhow!(
        "no job {want:?} in this cluster (expected a job id or submission id; known job ids: {})",
        if known.is_empty() { "none".to_string() } else { known.join(", ") }
    ))
}

/// `YYYY-MM-DD_HH-MM-SS` (UTC) of Unix seconds `secs`, as Ray names its timeline files.
fn stamp(secs: u64) -> String {
    let (y, m, d, h, mi, s) = tpuray_head::timeline::utc(secs);
    format!("{y:04}-{m:02}-{d:02}_{h:02}-{mi:02}-{s:02}")
}

/// Writes the trace to `output` (default: `<temp dir>/tpuray-timeline-<UTC time>.json`)
/// and says where, as `ray timeline` does.
pub fn run(address: &str, output: Option<PathBuf>, job: Option<&str>) -> Result<i32> {
    let json = trace_json(address, job)?;
    let path = output.unwrap_or_else(|| {
        let secs = SystemTime::now().duration_since(UNIX_EPOCH).map(|d| d.as_secs()).unwrap_or(0);
        std::env::temp_dir().join(format!("tpuray-timeline-{}.json", stamp(secs)))
    });
    std::fs::write(&path, &json).with_context(|| format!("write {}", path.display()))?;
    let spans = json.matches("\"ph\":\"X\"").count();
    println!("Trace file written to {} ({spans} task spans).", path.display());
    println!("Open it with https://ui.perfetto.dev or chrome://tracing.");
    Ok(0)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn file_names_carry_the_utc_date_and_time() {
        assert_eq!(stamp(0), "1970-01-01_00-00-00");
        assert_eq!(stamp(951_782_400 + 3_723), "2000-02-29_01-02-03");
        assert_eq!(stamp(1_767_225_599), "2025-12-31_23-59-59");
    }

    #[test]
    fn a_job_is_named_by_its_id_or_submission_id_and_an_unknown_one_is_refused() {
        let jobs = vec![
            pb::JobInfo { job_id: "01000000".into(), ..Default::default() },
            pb::JobInfo {
                job_id: "02000000".into(),
                submission_id: "raysubmit_abc".into(),
                ..Default::default()
            },
        ];
        assert_eq!(job_named(&jobs, "01000000").unwrap(), "01000000");
        assert_eq!(job_named(&jobs, "raysubmit_abc").unwrap(), "02000000");
        let e = job_named(&jobs, "ffff").unwrap_err().to_string();
        assert!(e.contains("\"ffff\"") && e.contains("01000000, 02000000"), "{e}");
        assert!(job_named(&[], "").unwrap_err().to_string().contains("none"));
    }
}
