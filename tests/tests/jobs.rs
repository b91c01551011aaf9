//! The Jobs API's durable side (HEAD-11, AGENT-13) with real processes: a job outlives
//! the leader head that placed it, a job whose supervisor's node dies ends FAILED with
//! the reason (never RUNNING with nothing behind it, kuberay#2161), and every head's HTTP
//! server answers the Jobs REST API, token first (HTTP-1, HTTP-2). The REST API's shapes
//! against Ray's own client are tested in python-sdk/tests/test_jobs.py.

use std::time::Duration;

use tpuray_proto::client::AuthChannel;
use tpuray_proto::pb;
use tpuray_proto::pb::head_service_client::HeadServiceClient;
use tpuray_tests::*;

type Head = HeadServiceClient<AuthChannel>;

async fn submit(h: &mut Head, id: &str, entrypoint: &str) {
    let job = pb::JobSubmission {
        submission_id: id.into(),
        entrypoint: entrypoint.into(),
        ..Default::default()
    };
    h.submit_job(pb::SubmitJobRequest { request_id: format!("submit-{id}"), job: Some(job) })
        .await
        .expect("submit job");
}

async fn job(h: &mut Head, id: &str) -> Option<pb::JobSubmission> {
    let r = h.get_job_submission(pb::GetJobSubmissionRequest { id: id.into() }).await.ok()?;
    r.into_inner().job
}

async fn wait_status(
    h: &mut Head,
    id: &str,
    timeout: Duration,
    done: &[&str],
) -> pb::JobSubmission {
    eventually(timeout, &format!("job {id} reaches one of {done:?}"), || {
        let mut h = h.clone();
        async move { job(&mut h, id).await.filter(|j| done.contains(&j.status.as_str())) }
    })
    .await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_job_running_while_the_leader_head_is_killed_ends_and_the_new_leader_lists_it() {
    let mut c = Cluster::new();
    c.start_heads(3, false);
    c.add_node(&["--num-cpus", "1"]);
    let leader = c.wait_leader(SOON).await;
    let mut h = c.head_client();
    submit(&mut h, "ha-job", "for i in 1 2 3 4 5 6; do echo tick $i; sleep 1; done").await;
    let running = wait_status(&mut h, "ha-job", SOON, &["RUNNING"]).await;
    assert!(!running.driver_node_id.is_empty(), "placed on a node: {running:?}");
    c.kill_head(leader);
    let new_leader = c.wait_leader(SOON).await;
    assert_ne!(new_leader, leader);
    let done = wait_status(&mut h, "ha-job", SOON, &["SUCCEEDED", "FAILED"]).await;
    assert_eq!(done.status, "SUCCEEDED", "the supervisor outlived the leader: {done:?}");
    assert_eq!(done.driver_exit_code, Some(0));
    let listed = h.list_job_submissions(pb::ListJobSubmissionsRequest {}).await.unwrap();
    let listed = listed.into_inner().jobs;
    assert!(
        listed.iter().any(|j| j.submission_id == "ha-job" && j.status == "SUCCEEDED"),
        "the new leader lists it: {listed:?}"
    );
    // Its log stayed on its node and every line is there.
    let mut agent = c.agent_client(&done.driver_agent_address);
    let log = agent
        .read_job_logs(pb::ReadJobLogsRequest {
            submission_id: "ha-job".into(),
            offset: 0,
            max_bytes: 0,
        })
        .await
        .unwrap()
        .into_inner();
    let text = String::from_utf8_lossy(&log.data);
    assert!((1..=6).all(|i| text.contains(&format!("tick {i}\n"))), "{text}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_job_whose_node_dies_fails_naming_the_node() {
    let mut c = Cluster::new();
    c.start_head(&["--num-cpus", "0"]);
    let node = c.add_node(&["--num-cpus", "1", "--resources", r#"{"jobnode": 1}"#]);
    let mut h = c.head_client();
    let req = pb::JobSubmission {
        submission_id: "doomed".into(),
        entrypoint: "sleep 600".into(),
        entrypoint_resources: [("jobnode".to_string(), 1.0)].into(),
        ..Default::default()
    };
    h.submit_job(pb::SubmitJobRequest { request_id: "doomed".into(), job: Some(req) })
        .await
        .unwrap();
    let running = wait_status(&mut h, "doomed", SOON, &["RUNNING"]).await;
    assert_eq!(running.driver_node_id, node.node_id);
    signal(node.pid, libc::SIGKILL);
    let failed = wait_status(&mut h, "doomed", SOON, &["FAILED"]).await;
    assert_eq!(failed.error_type, "JOB_SUPERVISOR_ACTOR_DIED", "{failed:?}");
    assert!(failed.message.contains(&node.node_id), "names the node: {}", failed.message);
    assert!(failed.end_time_ms > 0);
}

/// HTTP-1: a follower's server reaches the leader. HTTP-2: 401 without the token, 403 with
/// a wrong one. HTTP-3: a bad request gets a status and a body naming the problem.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_head_serves_the_jobs_api_and_refuses_requests_without_the_token() {
    let mut c = Cluster::new();
    c.start_heads(3, false);
    c.add_node(&["--num-cpus", "1"]);
    let leader = c.wait_leader(SOON).await;
    let token = c.token();
    let urls: Vec<String> = c.dashboards().await.into_iter().map(|(_, u)| u).collect();
    assert!(urls.iter().all(|u| u.starts_with("http://127.0.0.1:")), "{urls:?}");
    let follower = c.heads().iter().position(|h| h.id != leader).unwrap();
    let url = &urls[follower];
    // Health needs no token; the API does (401 missing, 403 wrong, Ray's texts).
    assert_eq!(http(url, "GET", "/api/gcs_healthz", None, "").0, 200);
    let (code, body) = http(url, "GET", "/api/jobs/", None, "");
    assert_eq!((code, body.as_str()), (401, "Unauthorized: Missing authentication token"));
    let (code, body) = http(url, "GET", "/api/jobs/", Some("wrong"), "");
    assert_eq!((code, body.as_str()), (403, "Forbidden: Invalid authentication token"));
    let (code, body) = http(url, "GET", "/api/version", Some(&token), "");
    assert_eq!(code, 200, "{body}");
    let v: serde_json::Value = serde_json::from_str(&body).unwrap();
    assert_eq!(v["ray_version"], "2.60.0");
    // A follower's HTTP server reaches the leader.
    let (code, body) = http(
        url,
        "POST",
        "/api/jobs/",
        Some(&token),
        r#"{"entrypoint": "echo from-a-follower", "submission_id": "via-follower"}"#,
    );
    assert_eq!(code, 200, "{body}");
    let v: serde_json::Value = serde_json::from_str(&body).unwrap();
    assert_eq!(v["submission_id"], "via-follower");
    let mut h = c.head_client();
    wait_status(&mut h, "via-follower", SOON, &["SUCCEEDED"]).await;
    let (code, body) = http(&urls[0], "GET", "/api/jobs/via-follower/logs", Some(&token), "");
    assert_eq!(code, 200, "{body}");
    let v: serde_json::Value = serde_json::from_str(&body).unwrap();
    assert_eq!(v["logs"], "from-a-follower\n");
    // Bad input is named, and nothing stops serving.
    let (code, body) =
        http(url, "POST", "/api/jobs/", Some(&token), r#"{"entrypoint": "x", "nope": 1}"#);
    assert_eq!(code, 400);
    assert!(body.contains("unknown field `nope`"), "{body}");
    let (code, body) = http(url, "GET", "/api/jobs/no-such-job", Some(&token), "");
    assert_eq!((code, body.as_str()), (404, "Job no-such-job does not exist"));
    let (code, _) = http(url, "DELETE", "/api/jobs/via-follower", Some(&token), "");
    assert_eq!(code, 200);
    assert!(job(&mut h, "via-follower").await.is_none(), "deleted");
}
