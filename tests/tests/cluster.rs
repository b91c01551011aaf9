//! Cluster integration tests (issue 2): real head, node agent and worker
//! processes started through the `tpuray` CLI on loopback.

// Message literals end in `..Default::default()` so they keep compiling as
// the protocol gains fields.
#![allow(clippy::needless_update)]

use std::collections::HashMap;
use std::time::{Duration, Instant};

use prost::bytes::{Buf, BufMut};
use tonic::codec::{Codec, DecodeBuf, Decoder, EncodeBuf, Encoder};
use tonic::{Code, Request};
use tpuray_proto::pb;
use tpuray_proto::pb::request_worker_lease_reply::Outcome;
use tpuray_tests::*;

const TWO_CPUS: &[&str] = &["--num-cpus", "2"];

fn expect_code<T: std::fmt::Debug>(r: Result<T, tonic::Status>, code: Code, what: &str) -> String {
    match r {
        Ok(v) => panic!("{what}: expected {code:?}, got Ok({v:?})"),
        Err(s) => {
            assert_eq!(s.code(), code, "{what}: wrong code, message: {}", s.message());
            s.message().to_string()
        }
    }
}

fn assert_mentions(msg: &str, needles: &[&str], what: &str) {
    for n in needles {
        assert!(msg.contains(n), "{what}: message does not mention {n:?}: {msg}");
    }
}

/// A job registered at the head `h` with `entrypoint`.
async fn register_job(
    h: &mut pb::head_service_client::HeadServiceClient<tpuray_proto::client::AuthChannel>,
    entrypoint: &str,
) -> pb::JobInfo {
    h.register_job(pb::RegisterJobRequest {
        request_id: tpuray_proto::new_request_id(),
        protocol_version: tpuray_proto::PROTOCOL_VERSION,
        entrypoint: entrypoint.into(),
        ..Default::default()
    })
    .await
    .expect("RegisterJob")
    .into_inner()
    .job
    .expect("job")
}

/// The head still answers `GetClusterStatus` with `nodes` live nodes.
async fn head_still_serves(c: &Cluster) {
    let st = within(
        Duration::from_secs(10),
        "GetClusterStatus after bad input",
        c.head_client().get_cluster_status(pb::GetClusterStatusRequest {}),
    )
    .await
    .expect("head keeps serving after bad input")
    .into_inner();
    assert!(!st.nodes.is_empty());
    assert!(st.nodes.iter().all(|n| n.state == pb::NodeState::Alive as i32), "{st:?}");
}

/// The node agent at `addr` still answers.
async fn agent_still_serves(c: &Cluster, addr: &str) {
    within(
        Duration::from_secs(10),
        "GetNodeInfo after bad input",
        c.agent_client(addr).get_node_info(pb::GetNodeInfoRequest {}),
    )
    .await
    .expect("agent keeps serving after bad input");
}

fn node_info(node_id: &str, resources: &[(&str, f64)]) -> pb::NodeInfo {
    pb::NodeInfo {
        node_id: node_id.to_string(),
        address: "127.0.0.1:1".to_string(),
        hostname: "fake".to_string(),
        total: resources.iter().map(|(k, v)| (k.to_string(), *v)).collect(),
        state: pb::NodeState::Alive as i32,
        ..Default::default()
    }
}

async fn lease(
    c: &Cluster,
    agent_addr: &str,
    req: pb::RequestWorkerLeaseRequest,
) -> pb::request_worker_lease_reply::Outcome {
    within(SOON, "RequestWorkerLease", c.agent_client(agent_addr).request_worker_lease(req))
        .await
        .expect("RequestWorkerLease")
        .into_inner()
        .outcome
        .expect("lease reply has an outcome")
}

async fn return_lease(c: &Cluster, agent_addr: &str, lease_id: &str) {
    c.agent_client(agent_addr)
        .return_worker_lease(pb::ReturnWorkerLeaseRequest {
            request_id: tpuray_proto::new_request_id(),
            lease_id: lease_id.to_string(),
            disconnect_worker: false,
            ..Default::default()
        })
        .await
        .expect("ReturnWorkerLease");
}

fn granted(o: Outcome, what: &str) -> pb::request_worker_lease_reply::Granted {
    match o {
        Outcome::Granted(g) => g,
        o => panic!("{what}: expected a granted lease, got {o:?}"),
    }
}

/// REG-1: the head, agents and workers are in the machine-wide registry, and `tpuray stop`
/// finds every one of them.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn three_node_cluster_status_lists_nodes_and_special_total_and_stop_leaves_nothing() {
    let mut c = Cluster::new();
    let head = c.start_head(&["--num-cpus", "1"]);
    let plain = c.add_node(TWO_CPUS);
    let special = c.add_node(&["--num-cpus", "2", "--resources", r#"{"special": 1}"#]);
    assert_ne!(head.temp_dir, plain.temp_dir);

    let status = c.status();
    assert!(status.contains("Nodes (3 alive, 0 dead)"), "status:\n{status}");
    assert!(status.contains("/5.0 CPU"), "status shows 5 CPUs in total:\n{status}");
    assert!(status.contains("special"), "status shows the special resource:\n{status}");

    let nodes = c.list("nodes");
    let nodes = nodes.as_array().expect("a JSON list");
    assert_eq!(nodes.len(), 3, "{nodes:#?}");
    assert!(nodes.iter().all(|n| node_state(n) == "ALIVE"), "{nodes:#?}");
    for id in [&head.node_id, &plain.node_id, &special.node_id] {
        assert!(nodes.iter().any(|n| n["node_id"] == id.as_str()), "node {id} listed");
    }

    // Make the plain node start a worker process, then hand it back (it stays idle in the pool).
    let g = granted(
        lease(&c, &plain.address, lease_request("job-stop", &[("CPU", 1.0)])).await,
        "lease",
    );
    assert!(pid_alive(g.worker_pid));
    return_lease(&c, &plain.address, &g.lease_id).await;
    let reg = c.registry();
    for (kind, pid) in [("agent", plain.pid), ("worker", g.worker_pid)] {
        assert!(
            reg.iter().any(|e| e.pid == pid && e.kind == kind),
            "{kind} {pid} is in the registry: {reg:?}"
        );
    }
    assert!(reg.iter().any(|e| e.kind == "head"), "head is in the registry: {reg:?}");
    let pids: Vec<u32> = reg.iter().map(|e| e.pid).collect();

    let out = c.cli(&["stop"]);
    assert!(out.status.success(), "tpuray stop failed: {}", String::from_utf8_lossy(&out.stderr));
    let alive: Vec<&RegEntry> = reg.iter().filter(|e| e.is_alive()).collect();
    assert!(alive.is_empty(), "processes alive after `tpuray stop`: {alive:?}");
    for pid in pids.iter().chain([g.worker_pid, head.pid, plain.pid, special.pid].iter()) {
        assert!(!pid_alive(*pid), "pid {pid} is alive after `tpuray stop`");
    }
}

/// HEAD-4: a killed agent and a SIGSTOPped one (its TCP connection still open) are both
/// declared dead for missing heartbeats.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sigkilled_agent_and_sigstopped_agent_are_both_marked_dead() {
    let mut c = Cluster::new();
    let head = c.start_head(&["--num-cpus", "1"]);
    let killed = c.add_node(TWO_CPUS);
    let stopped = c.add_node(TWO_CPUS);

    signal(killed.pid, libc::SIGKILL);
    signal(stopped.pid, libc::SIGSTOP);
    struct Cont(u32);
    impl Drop for Cont {
        fn drop(&mut self) {
            signal(self.0, libc::SIGCONT);
        }
    }
    let _cont = Cont(stopped.pid);

    wait_until(SOON, "both agents are DEAD", || {
        let nodes = c.list("nodes");
        let state = |id: &str| {
            nodes
                .as_array()
                .unwrap()
                .iter()
                .find(|n| n["node_id"] == id)
                .map(|n| node_state(n).to_string())
        };
        state(&killed.node_id).as_deref() == Some("DEAD")
            && state(&stopped.node_id).as_deref() == Some("DEAD")
    });
    let s = c.list_node(&stopped.node_id);
    let reason = s["death_reason"].as_str().unwrap_or_default();
    assert!(reason.contains("heartbeat"), "death reason of the stopped agent: {reason:?}");
    assert_eq!(node_state(&c.list_node(&head.node_id)), "ALIVE");
    let status = c.status();
    assert!(status.contains("Nodes (1 alive, 2 dead)"), "status:\n{status}");
}

/// AGENT-1: heartbeats run on their own thread, so a node whose CPUs are all busy is never
/// declared dead.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn busy_node_whose_cpus_are_saturated_is_not_marked_dead() {
    let mut c = Cluster::new();
    c.start_head(&["--num-cpus", "1"]);
    let node = c.add_node(TWO_CPUS);
    // Every CPU of the agent is leased to a worker (grant_or_reject: no
    // spilling to the head node once the agent is half full).
    let mut leases = Vec::new();
    for _ in 0..2 {
        let req = pb::RequestWorkerLeaseRequest {
            grant_or_reject: true,
            queue_timeout_ms: 10_000,
            ..lease_request("job-busy", &[("CPU", 1.0)])
        };
        let g = granted(lease(&c, &node.address, req).await, "lease");
        assert_eq!(g.node_id, node.node_id);
        leases.push(g);
    }
    let info = c
        .agent_client(&node.address)
        .get_node_info(pb::GetNodeInfoRequest {})
        .await
        .expect("GetNodeInfo")
        .into_inner()
        .node
        .expect("node info");
    assert_eq!(info.available.get("CPU").copied().unwrap_or(0.0), 0.0, "all CPUs leased: {info:?}");
    let mut head = c.head_client();
    assert!(all_alive(&mut head).await.unwrap());

    // And every CPU of the machine is busy, for 3x the death timeout.
    let burners = Burners::start(2 * nproc());
    let until = Instant::now() + Duration::from_millis(3 * DEATH_TIMEOUT_MS);
    let mut checks = 0;
    while Instant::now() < until {
        let st = within(
            Duration::from_secs(10),
            "GetClusterStatus under load",
            head.get_cluster_status(pb::GetClusterStatusRequest {}),
        )
        .await
        .expect("GetClusterStatus under load")
        .into_inner();
        for n in &st.nodes {
            assert_eq!(
                n.state,
                pb::NodeState::Alive as i32,
                "node {} was marked dead under CPU load: {}",
                n.node_id,
                n.death_reason
            );
        }
        checks += 1;
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    drop(burners);
    assert!(checks > 3, "only {checks} status checks ran");
    for g in &leases {
        assert!(pid_alive(g.worker_pid), "leased worker {} died", g.worker_pid);
        return_lease(&c, &node.address, &g.lease_id).await;
    }
    assert!(all_alive(&mut head).await.unwrap());
}

// ---- bad input: one test per family --------------------------------------

/// PROTO-1: a node, driver job or worker registering with another protocol version is
/// refused naming the version.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn wrong_protocol_version_on_register_node_and_register_job_is_refused_naming_versions() {
    let mut c = Cluster::new();
    let head = c.start_head(&["--num-cpus", "1"]);
    let mut h = c.head_client();
    let bad = tpuray_proto::PROTOCOL_VERSION + 41;
    let r = h
        .register_node(pb::RegisterNodeRequest {
            request_id: tpuray_proto::new_request_id(),
            protocol_version: bad,
            node: Some(node_info("fake-node-proto", &[("CPU", 1.0)])),
            ..Default::default()
        })
        .await;
    let m = expect_code(r, Code::FailedPrecondition, "RegisterNode with a wrong version");
    assert_mentions(&m, &["protocol version", &bad.to_string()], "RegisterNode");

    let r = h
        .register_job(pb::RegisterJobRequest {
            request_id: tpuray_proto::new_request_id(),
            protocol_version: bad,
            entrypoint: "test".into(),
            ..Default::default()
        })
        .await;
    let m = expect_code(r, Code::FailedPrecondition, "RegisterJob with a wrong version");
    assert_mentions(&m, &["protocol version", &bad.to_string()], "RegisterJob");

    // A worker announcing itself with a wrong version is refused by the agent.
    let r = c
        .agent_client(&head.address)
        .register_worker(pb::RegisterWorkerRequest {
            protocol_version: bad,
            worker_id: "w".into(),
            address: "127.0.0.1:1".into(),
            pid: 1,
            ..Default::default()
        })
        .await;
    let m = expect_code(r, Code::FailedPrecondition, "RegisterWorker with a wrong version");
    assert_mentions(&m, &["protocol version"], "RegisterWorker");

    head_still_serves(&c).await;
    agent_still_serves(&c, &head.address).await;
    assert_eq!(c.list("nodes").as_array().unwrap().len(), 1, "the refused node was not added");
}

/// AUTH-1: head and agent refuse a missing or wrong token with `UNAUTHENTICATED` saying which.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn missing_or_wrong_cluster_token_is_refused_by_head_and_agent() {
    let mut c = Cluster::new();
    let head = c.start_head(&["--num-cpus", "1"]);
    assert!(!c.token().is_empty());
    let addr = c.head_addr();
    for (token, needle) in
        [(None, "missing cluster token"), (Some("not-the-token"), "wrong cluster token")]
    {
        let mut h = tpuray_proto::client::head(&addr, token).unwrap();
        let r = h.get_cluster_status(pb::GetClusterStatusRequest {}).await;
        let m = expect_code(r, Code::Unauthenticated, "head call without the right token");
        assert_mentions(&m, &[needle], "head");
        let mut a = tpuray_proto::client::agent(&head.address, token).unwrap();
        let r = a.list_workers(pb::ListWorkersRequest {}).await;
        let m = expect_code(r, Code::Unauthenticated, "agent call without the right token");
        assert_mentions(&m, &[needle], "agent");
    }
    head_still_serves(&c).await;
    agent_still_serves(&c, &head.address).await;
}

/// AUTH-1: `--auth-mode disabled` on the head opts the cluster out; its agent follows.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn head_with_auth_mode_disabled_accepts_calls_without_token() {
    let mut c = Cluster::new();
    let head = c.start_head(&["--num-cpus", "1", "--auth-mode", "disabled"]);
    let mut h = tpuray_proto::client::head(&c.head_addr(), None).unwrap();
    let info = h.get_head_info(pb::GetHeadInfoRequest {}).await.expect("GetHeadInfo").into_inner();
    assert!(!info.auth_required);
    let st =
        h.get_cluster_status(pb::GetClusterStatusRequest {}).await.expect("status").into_inner();
    assert_eq!(st.nodes.len(), 1);
    let job = h
        .register_job(pb::RegisterJobRequest {
            request_id: tpuray_proto::new_request_id(),
            protocol_version: tpuray_proto::PROTOCOL_VERSION,
            entrypoint: "no-token".into(),
            ..Default::default()
        })
        .await
        .expect("RegisterJob without token");
    assert!(job.into_inner().job.is_some());
    // The node agent follows its head's mode.
    let mut a = tpuray_proto::client::agent(&head.address, None).unwrap();
    eventually(SOON, "the agent accepts calls without a token", || {
        let mut a = a.clone();
        async move { a.list_workers(pb::ListWorkersRequest {}).await.ok() }
    })
    .await;
    a.get_node_info(pb::GetNodeInfoRequest {}).await.expect("agent call without token");
}

/// Sends raw bytes as a gRPC message body and decodes the reply as raw bytes.
#[derive(Clone, Default)]
struct RawCodec;
struct RawEncoder;
struct RawDecoder;

impl Encoder for RawEncoder {
    type Item = Vec<u8>;
    type Error = tonic::Status;
    fn encode(&mut self, item: Vec<u8>, dst: &mut EncodeBuf<'_>) -> Result<(), tonic::Status> {
        dst.put_slice(&item);
        Ok(())
    }
}

impl Decoder for RawDecoder {
    type Item = Vec<u8>;
    type Error = tonic::Status;
    fn decode(&mut self, src: &mut DecodeBuf<'_>) -> Result<Option<Vec<u8>>, tonic::Status> {
        let mut v = vec![0u8; src.remaining()];
        src.copy_to_slice(&mut v);
        Ok(Some(v))
    }
}

impl Codec for RawCodec {
    type Encode = Vec<u8>;
    type Decode = Vec<u8>;
    type Encoder = RawEncoder;
    type Decoder = RawDecoder;
    fn encoder(&mut self) -> RawEncoder {
        RawEncoder
    }
    fn decoder(&mut self) -> RawDecoder {
        RawDecoder
    }
}

async fn raw_call(
    c: &Cluster,
    path: &'static str,
    body: Vec<u8>,
) -> Result<Vec<u8>, tonic::Status> {
    let channel = tpuray_proto::client::channel(&c.head_addr()).unwrap();
    let mut grpc = tonic::client::Grpc::new(channel);
    grpc.ready().await.map_err(|e| tonic::Status::unavailable(e.to_string()))?;
    let mut req = Request::new(body);
    let auth = format!("Bearer {}", c.token());
    req.metadata_mut().insert("authorization", auth.parse().unwrap());
    let path = tonic::codegen::http::uri::PathAndQuery::from_static(path);
    grpc.unary(req, path, RawCodec).await.map(|r| r.into_inner())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn malformed_message_is_refused_with_a_decode_error() {
    let mut c = Cluster::new();
    c.start_head(&["--num-cpus", "1"]);
    // Field 3 (node) length-delimited, claiming 100 bytes but holding garbage and too few.
    let garbage = vec![0x1a, 0x64, 0xff, 0xff, 0xff, 0xff, 0xff, 0x0f, 0x07];
    let r = raw_call(&c, "/tpuray.v1.HeadService/RegisterNode", garbage).await;
    let m = match r {
        Ok(v) => panic!("garbage RegisterNode was accepted: {v:?}"),
        Err(s) => {
            assert_ne!(s.code(), Code::Ok);
            s.message().to_string()
        }
    };
    assert!(m.to_lowercase().contains("decode"), "error does not say decode: {m}");
    // Pure garbage with an invalid wire type as well.
    let r = raw_call(&c, "/tpuray.v1.HeadService/RegisterNode", vec![0xff; 32]).await;
    let m = r.expect_err("all-0xff RegisterNode refused").message().to_string();
    assert!(m.to_lowercase().contains("decode"), "error does not say decode: {m}");
    head_still_serves(&c).await;
    assert_eq!(c.list("nodes").as_array().unwrap().len(), 1);
}

async fn put_65_mib(c: &Cluster) -> Result<tonic::Response<pb::KvPutReply>, tonic::Status> {
    let value = vec![7u8; 65 * 1024 * 1024];
    c.head_client()
        .kv_put(pb::KvPutRequest {
            request_id: tpuray_proto::new_request_id(),
            namespace: "t".into(),
            key: b"big".to_vec(),
            value,
            overwrite: true,
            ..Default::default()
        })
        .await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn oversized_message_is_refused_naming_the_size_limit() {
    let mut c = Cluster::new();
    c.start_head(&["--num-cpus", "1"]);
    let m = put_65_mib(&c).await.expect_err("a 65 MiB KvPut is refused").message().to_string();
    assert_mentions(&m, &[&tpuray_proto::MAX_MESSAGE_BYTES.to_string()], "oversized KvPut");
    head_still_serves(&c).await;
    // A small put still works, and the refused one stored nothing.
    let mut h = c.head_client();
    h.kv_put(pb::KvPutRequest {
        request_id: tpuray_proto::new_request_id(),
        namespace: "t".into(),
        key: b"small".to_vec(),
        value: b"v".to_vec(),
        overwrite: true,
        ..Default::default()
    })
    .await
    .expect("small KvPut");
    let got = h
        .kv_get(pb::KvGetRequest {
            namespace: "t".into(),
            key: b"small".to_vec(),
            ..Default::default()
        })
        .await
        .unwrap()
        .into_inner();
    assert!(got.found && got.value == b"v");
    let big = h
        .kv_get(pb::KvGetRequest {
            namespace: "t".into(),
            key: b"big".to_vec(),
            ..Default::default()
        })
        .await
        .unwrap();
    assert!(!big.into_inner().found, "the refused put stored nothing");
}

/// PROTO-2: an over-limit message is refused with OUT_OF_RANGE (tonic's code
/// for it) and a message naming the size and the limit.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn oversized_message_is_refused_with_out_of_range_proto_2() {
    let mut c = Cluster::new();
    c.start_head(&["--num-cpus", "1"]);
    let m = expect_code(put_65_mib(&c).await, Code::OutOfRange, "KvPut of 65 MiB");
    assert_mentions(&m, &[&tpuray_proto::MAX_MESSAGE_BYTES.to_string()], "oversized KvPut");
    head_still_serves(&c).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn unknown_actor_name_is_not_found_naming_name_and_namespace() {
    let mut c = Cluster::new();
    c.start_head(&["--num-cpus", "1"]);
    let r = c
        .head_client()
        .get_actor(pb::GetActorRequest {
            name: "nope".into(),
            namespace: "ns1".into(),
            ..Default::default()
        })
        .await;
    let m = expect_code(r, Code::NotFound, "GetActor nope");
    assert_mentions(&m, &["nope", "ns1"], "GetActor nope");
    let r = c
        .head_client()
        .get_actor(pb::GetActorRequest { name: "nope".into(), ..Default::default() })
        .await;
    let m = expect_code(r, Code::NotFound, "GetActor nope in the default namespace");
    assert_mentions(&m, &["nope", "default"], "GetActor nope");
    head_still_serves(&c).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn negative_resource_amounts_are_refused_naming_the_resource() {
    let mut c = Cluster::new();
    let head = c.start_head(&["--num-cpus", "1"]);
    let mut h = c.head_client();
    let job = register_job(&mut h, "neg").await;
    let r = h
        .create_actor(pb::CreateActorRequest {
            request_id: tpuray_proto::new_request_id(),
            job_id: job.job_id.clone(),
            name: "neg".into(),
            class_name: "Neg".into(),
            resources: HashMap::from([("widgets".to_string(), -2.0)]),
            ..Default::default()
        })
        .await;
    let m = expect_code(r, Code::InvalidArgument, "CreateActor with a negative resource");
    assert_mentions(&m, &["widgets", "negative"], "CreateActor");

    let r = h
        .register_node(pb::RegisterNodeRequest {
            request_id: tpuray_proto::new_request_id(),
            protocol_version: tpuray_proto::PROTOCOL_VERSION,
            node: Some(node_info("fake-node-neg", &[("CPU", 1.0), ("gizmos", -1.0)])),
            ..Default::default()
        })
        .await;
    let m = expect_code(r, Code::InvalidArgument, "RegisterNode with a negative resource");
    assert_mentions(&m, &["gizmos", "negative"], "RegisterNode");

    let r = c
        .agent_client(&head.address)
        .request_worker_lease(lease_request("job-neg", &[("CPU", -1.0)]))
        .await;
    let m = expect_code(r, Code::InvalidArgument, "RequestWorkerLease with a negative resource");
    assert_mentions(&m, &["CPU", "negative"], "RequestWorkerLease");
    head_still_serves(&c).await;
    agent_still_serves(&c, &head.address).await;
    assert_eq!(c.list("nodes").as_array().unwrap().len(), 1);
    assert!(c.list("actors").as_array().unwrap().is_empty(), "no actor was created");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cli_start_with_bad_resource_flags_fails_naming_the_problem_and_starts_nothing() {
    let mut c = Cluster::new();
    c.start_head(&["--num-cpus", "1"]);
    let before: Vec<u32> = c.registry().iter().map(|e| e.pid).collect();
    let addr = c.head_addr();
    let temp = c.dir().join("bad-node");
    let temp_s = temp.display().to_string();
    let cases: [(&[&str], &[&str]); 4] = [
        (&["--resources", r#"{"x": -1}"#], &["--resources", "\"x\"", "negative"]),
        (&["--resources", r#"{"x": "abc"}"#], &["--resources", "\"x\"", "abc"]),
        (&["--resources", "{bad json"], &["--resources", "JSON"]),
        (&["--num-cpus", "-1"], &["--num-cpus", "negative"]),
    ];
    for (flags, needles) in cases {
        let mut args = vec!["start", "--address", &addr, "--temp-dir", &temp_s];
        args.extend_from_slice(flags);
        let out = c.cli(&args);
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert!(!out.status.success(), "tpuray start {flags:?} succeeded");
        assert_mentions(&stderr, needles, &format!("tpuray start {flags:?}"));
        assert!(!temp.exists(), "tpuray start {flags:?} created {}", temp.display());
        let after: Vec<u32> = c.registry().iter().map(|e| e.pid).collect();
        assert_eq!(before.len(), after.len(), "tpuray start {flags:?} started a process");
    }
    assert_eq!(c.list("nodes").as_array().unwrap().len(), 1);
    head_still_serves(&c).await;
}

// ---- actors, leases, subscription ----------------------------------------

async fn get_actor(c: &Cluster, name: &str, wait_ms: u64) -> pb::ActorInfo {
    within(
        Duration::from_millis(wait_ms + 10_000),
        "GetActor",
        c.head_client().get_actor(pb::GetActorRequest {
            name: name.into(),
            wait_alive_ms: wait_ms,
            ..Default::default()
        }),
    )
    .await
    .expect("GetActor")
    .into_inner()
    .actor
    .expect("actor info")
}

async fn get_actor_by_id(c: &Cluster, id: &str) -> pb::ActorInfo {
    c.head_client()
        .get_actor(pb::GetActorRequest { actor_id: id.into(), ..Default::default() })
        .await
        .expect("GetActor by id")
        .into_inner()
        .actor
        .expect("actor info")
}

fn is(state: pb::ActorState, a: &pb::ActorInfo) -> bool {
    a.state == state as i32
}

/// HEAD-3: a second live actor with the same name is refused. ACTOR-1: a worker or node
/// death counts against `max_restarts`; a kill with `no_restart` is never restarted.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn actor_lifecycle() {
    let mut c = Cluster::new();
    // The head node has no CPUs, so actors land on the two worker nodes.
    c.start_head(&["--num-cpus", "0"]);
    let a = c.add_node(&["--num-cpus", "1"]);
    let b = c.add_node(&["--num-cpus", "1"]);
    let agents: HashMap<String, NodeHandle> =
        [(a.node_id.clone(), a.clone()), (b.node_id.clone(), b.clone())].into();
    let mut h = c.head_client();
    let job = register_job(&mut h, "actor_lifecycle").await;
    let create = |name: &str| pb::CreateActorRequest {
        request_id: tpuray_proto::new_request_id(),
        job_id: job.job_id.clone(),
        name: name.into(),
        class_name: "Counter".into(),
        max_restarts: 1,
        ..Default::default()
    };
    let created = h.create_actor(create("a1")).await.expect("CreateActor a1").into_inner();
    let id = created.actor.expect("actor").actor_id;

    let first = get_actor(&c, "a1", 15_000).await;
    assert!(is(pb::ActorState::Alive, &first), "a1 is ALIVE: {first:?}");
    assert_eq!(first.actor_id, id);
    assert!(first.pid > 0 && pid_alive(first.pid), "a1's worker pid {} is alive", first.pid);
    assert!(agents.contains_key(&first.node_id), "a1 is on a worker node: {first:?}");

    // A second live actor with the same name is refused.
    let r = h.create_actor(create("a1")).await;
    let m = expect_code(r, Code::AlreadyExists, "second CreateActor a1");
    assert_mentions(&m, &["a1"], "AlreadyExists");

    // The worker dies: the actor restarts once, in a new process.
    signal(first.pid, libc::SIGKILL);
    let second = eventually(SOON, "a1 restarts", || {
        let c = &c;
        async move {
            let x = get_actor(c, "a1", 1000).await;
            (is(pb::ActorState::Alive, &x) && x.num_restarts == 1).then_some(x)
        }
    })
    .await;
    assert_ne!(second.pid, first.pid, "the restarted actor runs in a new process");
    assert!(pid_alive(second.pid));

    // Its node dies: with max_restarts 1 used up, the actor is DEAD with a cause.
    let host = agents.get(&second.node_id).expect("a1 is on a worker node").clone();
    signal(host.pid, libc::SIGKILL);
    let dead = eventually(SOON, "a1 is DEAD after its node died", || {
        let c = &c;
        let id = id.clone();
        async move {
            let x = get_actor_by_id(c, &id).await;
            is(pb::ActorState::Dead, &x).then_some(x)
        }
    })
    .await;
    assert_eq!(dead.num_restarts, 1);
    assert!(!dead.death_cause.is_empty(), "a dead actor has a death cause");
    assert_mentions(&dead.death_cause, &[&host.node_id], "death cause");
    wait_until(SOON, "the dead actor's worker exits", || !pid_alive(second.pid));

    // A second actor on the surviving node, killed with no_restart: DEAD at once.
    let a2 =
        h.create_actor(create("a2")).await.expect("CreateActor a2").into_inner().actor.unwrap();
    let alive = get_actor(&c, "a2", 15_000).await;
    assert!(is(pb::ActorState::Alive, &alive), "a2 is ALIVE: {alive:?}");
    h.kill_actor(pb::KillActorRequest {
        request_id: tpuray_proto::new_request_id(),
        actor_id: a2.actor_id.clone(),
        no_restart: true,
        ..Default::default()
    })
    .await
    .expect("KillActor");
    let killed = eventually(SOON, "a2 is DEAD after KillActor", || {
        let c = &c;
        let id = a2.actor_id.clone();
        async move {
            let x = get_actor_by_id(c, &id).await;
            is(pb::ActorState::Dead, &x).then_some(x)
        }
    })
    .await;
    assert_eq!(killed.num_restarts, 0, "no_restart: not restarted");
    wait_until(SOON, "a2's worker exits", || !pid_alive(alive.pid));

    let actors = c.list("actors");
    let actors = actors.as_array().expect("a JSON list");
    for (name, aid) in [("a1", &id), ("a2", &a2.actor_id)] {
        let row = actors
            .iter()
            .find(|x| x["actor_id"] == aid.as_str())
            .unwrap_or_else(|| panic!("{name} not listed: {actors:#?}"));
        assert_eq!(row["name"], name);
        assert_eq!(row["state"], "DEAD", "{row:#}");
    }
}

/// AGENT-4: a lease request is granted, spilled back to the node with the resource, or
/// answered infeasible and listed as infeasible demand.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn lease_spillback_to_node_with_special() {
    let mut c = Cluster::new();
    let head = c.start_head(&["--num-cpus", "1"]);
    let special = c.add_node(&["--num-cpus", "1", "--resources", r#"{"special": 1}"#]);

    // The head node's agent learns of the special node from a heartbeat reply.
    let spill = eventually(SOON, "the head node's agent spills {special: 1} back", || {
        let c = &c;
        let addr = head.address.clone();
        async move {
            match lease(c, &addr, lease_request("job-spill", &[("special", 1.0)])).await {
                Outcome::Spillback(s) => Some(s),
                _ => None,
            }
        }
    })
    .await;
    assert_eq!(spill.node_id, special.node_id);
    assert_eq!(spill.address, special.address);

    let g = granted(
        lease(&c, &special.address, lease_request("job-spill", &[("special", 1.0)])).await,
        "special",
    );
    assert_eq!(g.node_id, special.node_id);
    assert!(g.worker_pid > 0 && pid_alive(g.worker_pid), "worker {} is alive", g.worker_pid);
    return_lease(&c, &special.address, &g.lease_id).await;
    let again = granted(
        lease(&c, &special.address, lease_request("job-spill", &[("special", 1.0)])).await,
        "again",
    );
    assert_eq!(again.worker_id, g.worker_id, "the pooled worker is reused");
    assert_eq!(again.worker_pid, g.worker_pid);
    return_lease(&c, &special.address, &again.lease_id).await;

    match lease(&c, &head.address, lease_request("job-spill", &[("GPU", 1.0)])).await {
        Outcome::Infeasible(i) => assert_mentions(&i.reason, &["GPU"], "infeasible reason"),
        o => panic!("a GPU lease on a cluster without GPUs: expected infeasible, got {o:?}"),
    }
    wait_until(SOON, "tpuray status lists the GPU demand as infeasible", || {
        let s = c.status();
        s.split_once("Infeasible:").is_some_and(|(_, inf)| inf.contains("GPU"))
    });
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn subscription_stream_resumes_after_sequence_number() {
    let mut c = Cluster::new();
    let head = c.start_head(&["--num-cpus", "1"]);
    let mut h = c.head_client();

    let mut stream = h
        .subscribe(pb::SubscribeRequest { after_seq: 0, ..Default::default() })
        .await
        .expect("Subscribe")
        .into_inner();
    let mut last = 0;
    let mut seen_head = false;
    while !seen_head {
        let ch = within(Duration::from_secs(10), "the head node's change", stream.message())
            .await
            .expect("stream ok")
            .expect("stream open");
        assert!(ch.seq > last, "seq grows: {} after {last}", ch.seq);
        last = ch.seq;
        if let Some(pb::state_change::Change::Node(n)) = &ch.change {
            seen_head |= n.node_id == head.node_id;
        }
    }
    drop(stream);

    let node = c.add_node(&["--num-cpus", "1"]);
    let mut stream = h
        .subscribe(pb::SubscribeRequest { after_seq: last, ..Default::default() })
        .await
        .expect("resume")
        .into_inner();
    let mut got_new = false;
    let deadline = Instant::now() + Duration::from_secs(10);
    while !got_new {
        assert!(Instant::now() < deadline, "no change for the new node after seq {last}");
        let ch = within(Duration::from_secs(10), "a change after resuming", stream.message())
            .await
            .expect("stream ok")
            .expect("stream open");
        assert!(ch.seq > last, "resumed stream delivered seq {} <= {last}: {ch:?}", ch.seq);
        if let Some(pb::state_change::Change::Node(n)) = &ch.change {
            assert_ne!(n.node_id, head.node_id, "the head's old change was not replayed");
            got_new |= n.node_id == node.node_id;
        }
    }
    // Nothing older shows up afterwards either.
    while let Ok(Ok(Some(ch))) =
        tokio::time::timeout(Duration::from_millis(300), stream.message()).await
    {
        assert!(ch.seq > last, "resumed stream delivered seq {} <= {last}", ch.seq);
    }
}

/// TPU.md's simulated-host line: the `TPU_*` environment plus
/// `--resources '{"TPU": 4}'` advertises the slice's resources and labels,
/// with exactly one `TPU-v6e-16-head` in the slice.
#[test]
fn simulated_tpu_hosts_advertise_slice_resources_and_labels() {
    let mut c = Cluster::new();
    c.start_head(&["--num-cpus", "1"]);
    c.set_env("TPU_ACCELERATOR_TYPE", "v6e-16");
    c.set_env("TPU_NAME", "sa");
    c.set_env("TPU_TOPOLOGY", "4x4");
    let mut hosts = Vec::new();
    for w in 0..4 {
        c.set_env("TPU_WORKER_ID", &w.to_string());
        hosts.push(c.add_node(&["--num-cpus", "1", "--resources", r#"{"TPU": 4}"#]));
    }
    let mut heads = 0;
    for (w, h) in hosts.iter().enumerate() {
        let n = c.list_node(&h.node_id);
        let res = &n["resources_total"];
        assert_eq!(res["TPU"], 4.0, "{n:#}");
        assert_eq!(res["accelerator_type:TPU-V6E"], 1.0, "{n:#}");
        assert_eq!(res["sa"], 1.0, "{n:#}");
        heads += res.get("TPU-v6e-16-head").is_some() as u32;
        assert_eq!(n["labels"]["tpuray.io/tpu-worker-id"], w.to_string(), "{n:#}");
        assert_eq!(n["labels"]["ray.io/tpu-slice-name"], "sa", "{n:#}");
        assert_eq!(n["labels"]["tpuray.io/tpu-topology"], "4x4", "{n:#}");
    }
    assert_eq!(heads, 1, "exactly one head resource per slice");
    let status = c.status();
    assert!(status.contains("TPU"), "{status}");
}

/// AGENT-14: a lease whose runtime environment cannot be set up is answered
/// `SetupFailed` naming what is wrong (not an RPC error, which owners retry forever),
/// its CPU comes back, and the agent grants the next plain lease.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn agent_14_a_lease_whose_environment_cannot_be_built_is_answered_setup_failed() {
    let mut c = Cluster::new();
    let head = c.start_head(&["--num-cpus", "1"]);
    for (key, env, says) in [
        ("bad-pip", r#"{"pip": "requirements.txt"}"#, "requirements file"),
        (
            "missing-module",
            r#"{"py_modules": ["gcs://_ray_pkg_0000000000000000.zip"]}"#,
            "gcs://_ray_pkg_0000000000000000.zip is not in the cluster",
        ),
    ] {
        c.head_client()
            .kv_put(pb::KvPutRequest {
                request_id: tpuray_proto::new_request_id(),
                namespace: "runtime_env".into(),
                key: key.as_bytes().to_vec(),
                value: env.as_bytes().to_vec(),
                overwrite: true,
                ..Default::default()
            })
            .await
            .expect("KvPut");
        let mut req = lease_request("job-env", &[("CPU", 1.0)]);
        req.language = "python".into();
        req.runtime_env_hash = key.into();
        match lease(&c, &head.address, req).await {
            Outcome::SetupFailed(f) => assert_mentions(&f.message, &[says], "setup failure"),
            o => panic!("{key}: expected SetupFailed, got {o:?}"),
        }
    }
    let g =
        granted(lease(&c, &head.address, lease_request("job-env", &[("CPU", 1.0)])).await, "plain");
    return_lease(&c, &head.address, &g.lease_id).await;
}

/// AGENT-2: two requests to start the same actor's worker that overlap (the head asked
/// again while the first start ran) start one worker and get the same answer; before,
/// each started its own, and the head recorded one while callers reached the other.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn overlapping_requests_to_start_one_actor_start_one_worker() {
    let mut c = Cluster::new();
    let head = c.start_head(&["--num-cpus", "1"]);
    let mut h = c.head_client();
    let job = register_job(&mut h, "overlapping_starts").await;
    let start = || {
        let mut a = c.agent_client(&head.address);
        let req = pb::StartActorWorkerRequest {
            request_id: tpuray_proto::new_request_id(),
            actor_id: "0123456789abcdef0123456789abcdef".into(),
            job_id: job.job_id.clone(),
            class_name: "Overlapping".into(),
            ..Default::default()
        };
        async move { a.start_actor_worker(req).await.map(|r| r.into_inner()) }
    };
    let (first, second) = tokio::join!(start(), start());
    let (first, second) = (first.expect("first start"), second.expect("second start"));
    assert_eq!(first.worker_id, second.worker_id, "one worker: {first:?} {second:?}");
    let workers = c
        .agent_client(&head.address)
        .list_workers(pb::ListWorkersRequest {})
        .await
        .expect("ListWorkers")
        .into_inner()
        .workers;
    let hosting: Vec<_> =
        workers.iter().filter(|w| w.actor_id == "0123456789abcdef0123456789abcdef").collect();
    assert_eq!(hosting.len(), 1, "one worker hosts the actor: {workers:#?}");
}
