//! Head high availability: three head replicas (Raft over `tpuray-replica`, HEAD-6..8),
//! clients following the leader (CLIENT-1), failover without losing or repeating a
//! committed command (HEAD-2), catch-up of a restarted replica, and recovery after every
//! head restarts from its data folder.

use std::collections::HashMap;
use std::time::Duration;

use tonic::Code;
use tpuray_proto::client::AuthChannel;
use tpuray_proto::pb;
use tpuray_proto::pb::head_service_client::HeadServiceClient;
use tpuray_tests::*;

type Head = HeadServiceClient<AuthChannel>;

fn chaos_bin() -> std::path::PathBuf {
    std::path::PathBuf::from(env!("CARGO_BIN_EXE_tpuray-chaos-driver"))
}

async fn kv_put(h: &mut Head, request_id: &str, key: &str, value: &str) -> bool {
    let mut req = tonic::Request::new(pb::KvPutRequest {
        request_id: request_id.into(),
        namespace: "ha".into(),
        key: key.as_bytes().to_vec(),
        value: value.as_bytes().to_vec(),
        overwrite: false,
    });
    req.set_timeout(SOON);
    h.kv_put(req).await.unwrap_or_else(|s| panic!("kv put {key}: {s}")).into_inner().added
}

async fn kv_get(h: &mut Head, key: &str) -> Option<String> {
    let r = h
        .kv_get(pb::KvGetRequest { namespace: "ha".into(), key: key.as_bytes().to_vec() })
        .await
        .unwrap_or_else(|s| panic!("kv get {key}: {s}"))
        .into_inner();
    r.found.then(|| String::from_utf8_lossy(&r.value).into_owned())
}

async fn register_job(h: &mut Head, request_id: &str) -> String {
    h.register_job(pb::RegisterJobRequest {
        request_id: request_id.into(),
        protocol_version: tpuray_proto::PROTOCOL_VERSION,
        entrypoint: "ha test".into(),
        ..Default::default()
    })
    .await
    .expect("register job")
    .into_inner()
    .job
    .expect("job")
    .job_id
}

fn group_request(
    request_id: &str,
    job: &str,
    name: &str,
    detached: bool,
) -> pb::CreatePlacementGroupRequest {
    pb::CreatePlacementGroupRequest {
        request_id: request_id.into(),
        job_id: job.into(),
        name: name.into(),
        bundles: vec![pb::Bundle {
            resources: HashMap::from([("CPU".to_string(), 1.0)]),
            ..Default::default()
        }],
        strategy: "PACK".into(),
        detached,
        ..Default::default()
    }
}

async fn create_group(h: &mut Head, req: pb::CreatePlacementGroupRequest) -> String {
    h.create_placement_group(req)
        .await
        .expect("create placement group")
        .into_inner()
        .placement_group
        .expect("group")
        .placement_group_id
}

async fn group_state(h: &mut Head, name: &str, wait_ms: u64) -> pb::PlacementGroupInfo {
    h.get_placement_group(pb::GetPlacementGroupRequest {
        name: name.into(),
        wait_ready_ms: wait_ms,
        ..Default::default()
    })
    .await
    .expect("get placement group")
    .into_inner()
    .placement_group
    .expect("group")
}

fn actor_request(request_id: &str, job: &str, name: &str) -> pb::CreateActorRequest {
    pb::CreateActorRequest {
        request_id: request_id.into(),
        job_id: job.into(),
        name: name.into(),
        class_name: "Nowhere".into(),
        // Nothing offers it: the actor stays pending and starts no process.
        resources: HashMap::from([("nowhere".to_string(), 1.0)]),
        ..Default::default()
    }
}

/// The CPU a node has free, as its heartbeats tell the head.
async fn node_cpu(h: &mut Head, node_id: &str) -> Option<(f64, f64)> {
    let st = h.get_cluster_status(pb::GetClusterStatusRequest {}).await.ok()?.into_inner();
    let n = st.nodes.into_iter().find(|n| n.node_id == node_id)?;
    Some((n.available.get("CPU").copied()?, n.total.get("CPU").copied()?))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn three_heads_elect_one_leader_and_status_lists_each_replica_with_log_indexes() {
    let mut c = Cluster::new();
    c.start_heads(3, false);
    let node = c.add_node(&["--num-cpus", "1"]);
    let leader = c.wait_leader(SOON).await;
    let statuses: Vec<_> = c.replica_statuses().await.into_iter().flatten().collect();
    assert_eq!(statuses.len(), 3, "every replica answers: {statuses:?}");
    assert_eq!(statuses.iter().filter(|s| s.role == "leader").count(), 1, "{statuses:?}");
    assert!(statuses.iter().all(|s| s.leader_id == leader), "all follow {leader}: {statuses:?}");
    let status = c.status();
    assert!(status.contains(&format!("Head replicas (leader: {leader} ")), "{status}");
    for h in c.heads() {
        assert!(
            status
                .lines()
                .any(|l| l.contains(&h.listen) && l.contains("commit") && l.contains("log ")),
            "replica {} listed with its log indexes:\n{status}",
            h.id
        );
    }
    assert!(status.contains(&node.node_id), "{status}");
}

/// HEAD-2 across a failover: a client retrying a creation with the same request id on
/// the new leader gets the first outcome; nothing committed is lost; the group is
/// reserved once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn killing_the_leader_loses_no_committed_write_and_retried_request_ids_apply_once() {
    let mut c = Cluster::new();
    c.start_heads(3, false);
    let node = c.add_node(&["--num-cpus", "2"]);
    let mut h = c.head_client();
    let job = register_job(&mut h, "job-1").await;
    for i in 0..20 {
        assert!(kv_put(&mut h, &format!("put-{i}"), &format!("k{i}"), &format!("v{i}")).await);
    }
    let pg = create_group(&mut h, group_request("pg-1", &job, "g", false)).await;
    let info = group_state(&mut h, "g", 20_000).await;
    assert_eq!(info.state, pb::PlacementGroupState::Created as i32, "{info:?}");
    let actor = h
        .create_actor(actor_request("actor-1", &job, "a"))
        .await
        .expect("create actor")
        .into_inner()
        .actor
        .expect("actor")
        .actor_id;

    let old = c.wait_leader(SOON).await;
    c.kill_head(old);

    // The same requests again, as a client whose first reply was lost would send them.
    assert_eq!(register_job(&mut h, "job-1").await, job, "job registered once");
    for i in 0..20 {
        assert!(
            kv_put(&mut h, &format!("put-{i}"), &format!("k{i}"), "other").await,
            "a retried put answers as the first did"
        );
        assert_eq!(kv_get(&mut h, &format!("k{i}")).await.as_deref(), Some(&*format!("v{i}")));
    }
    assert_eq!(create_group(&mut h, group_request("pg-1", &job, "g", false)).await, pg);
    let again = h
        .create_actor(actor_request("actor-1", &job, "a"))
        .await
        .expect("retried create actor")
        .into_inner()
        .actor
        .expect("actor");
    assert_eq!(again.actor_id, actor, "one actor named a");
    let dup = h.create_actor(actor_request("actor-2", &job, "a")).await;
    assert_eq!(dup.map(|_| ()).unwrap_err().code(), Code::AlreadyExists);
    let new = c.wait_leader(SOON).await;
    assert_ne!(new, old, "a surviving head leads");

    let groups = h
        .list_placement_groups(pb::ListPlacementGroupsRequest {})
        .await
        .expect("list groups")
        .into_inner()
        .placement_groups;
    assert_eq!(groups.iter().filter(|g| g.name == "g").count(), 1, "{groups:?}");
    // Reserved once: the node's 2 CPUs minus the one bundle.
    eventually(SOON, "the node reports one CPU held by the group", || async {
        let mut h = c.head_client();
        node_cpu(&mut h, &node.node_id).await.filter(|(a, t)| *a == 1.0 && *t == 2.0)
    })
    .await;
    c.restart_head(old);
    eventually(SOON, "the restarted head caught up", || async {
        let st = c.replica_statuses().await;
        let lead = st.iter().flatten().find(|s| s.id == new)?.commit_index;
        st.iter().flatten().find(|s| s.id == old && s.applied_index >= lead).map(|_| ())
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_restarted_head_catches_up_from_its_data_folder_and_its_peers() {
    let mut c = Cluster::new();
    c.start_heads(3, false);
    let leader = c.wait_leader(SOON).await;
    let follower = (1..=3).find(|i| *i != leader).expect("a follower");
    c.kill_head(follower);
    let mut h = c.head_client();
    for i in 0..30 {
        assert!(kv_put(&mut h, &format!("w-{i}"), &format!("w{i}"), "x").await);
    }
    c.restart_head(follower);
    let target =
        c.replica_statuses().await[(leader - 1) as usize].as_ref().expect("leader").commit_index;
    eventually(SOON, "the restarted follower applied everything committed", || async {
        c.replica_statuses().await[(follower - 1) as usize]
            .as_ref()
            .filter(|s| s.applied_index >= target)
            .map(|_| ())
    })
    .await;
    // Without the old leader, the restarted replica is part of every majority.
    c.kill_head(leader);
    c.wait_leader(SOON).await;
    for i in 0..30 {
        assert_eq!(kv_get(&mut h, &format!("w{i}")).await.as_deref(), Some("x"), "key w{i}");
    }
}

/// A SIGSTOPped leader keeps its connections open: it is found out by timeouts only.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_frozen_leader_is_replaced_and_clients_and_agents_follow_the_new_one() {
    let mut c = Cluster::new();
    c.start_heads(3, false);
    let node = c.add_node(&["--num-cpus", "1"]);
    let mut h = c.head_client();
    assert!(kv_put(&mut h, "before", "before", "1").await);
    let old = c.wait_leader(SOON).await;
    let pid = c.head_pid(old).expect("leader pid");
    signal(pid, libc::SIGSTOP);
    assert!(
        within(SOON, "a write while the leader is frozen", kv_put(&mut h, "during", "during", "1"))
            .await
    );
    let new = c.wait_leader(SOON).await;
    assert_ne!(new, old);
    // The node's heartbeats reach the new leader: it stays alive past the death timeout.
    tokio::time::sleep(Duration::from_millis(2 * DEATH_TIMEOUT_MS)).await;
    assert_eq!(node_state(&c.list_node(&node.node_id)), "ALIVE");
    signal(pid, libc::SIGCONT);
    eventually(SOON, "the old leader follows and caught up", || async {
        let st = c.replica_statuses().await;
        let lead = st.iter().flatten().find(|s| s.id == new)?.commit_index;
        st.iter()
            .flatten()
            .find(|s| s.id == old && s.role == "follower" && s.applied_index >= lead)
            .map(|_| ())
    })
    .await;
}

/// HEAD-7: a leader cut off from its peers stops serving (check-quorum) and another serves.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_head_cut_off_from_its_peers_loses_leadership_and_rejoins_after_healing() {
    let mut c = Cluster::new();
    c.start_heads(3, true);
    c.add_node(&["--num-cpus", "1"]);
    let old = c.wait_leader(SOON).await;
    c.isolate_head(old, true);
    let mut h = c.head_client();
    assert!(
        within(SOON, "a write with the leader cut off", kv_put(&mut h, "cut", "cut", "1")).await
    );
    let new = eventually(SOON, "another head leads", || async {
        c.replica_statuses()
            .await
            .into_iter()
            .flatten()
            .find(|s| s.id != old && s.role == "leader" && s.leader_ready)
            .map(|s| s.id)
    })
    .await;
    eventually(SOON, "the cut-off head stops leading", || async {
        let st = c.replica_statuses().await;
        st[(old - 1) as usize].as_ref().filter(|s| !s.leader_ready).map(|_| ())
    })
    .await;
    c.isolate_head(old, false);
    eventually(SOON, "the healed head follows and caught up", || async {
        let st = c.replica_statuses().await;
        let lead = st.iter().flatten().find(|s| s.id == new && s.role == "leader")?.commit_index;
        st.iter()
            .flatten()
            .find(|s| s.id == old && s.role == "follower" && s.applied_index >= lead)
            .map(|_| ())
    })
    .await;
    assert_eq!(kv_get(&mut h, "cut").await.as_deref(), Some("1"));
}

/// Every head down at once, then restarted from its folder: named and detached actors,
/// groups and KV entries are all there. HEAD-8 reconciles with what survived: `keeper`
/// keeps its process and answers through the handle its driver held all along; `lost`,
/// whose worker died while no head ran (its exit report gave up), and `moved`, whose
/// node died meanwhile, are restarted (`max_restarts=-1`) and answer through their old
/// handles too.
#[test]
fn every_head_restarted_from_disk_keeps_actors_groups_and_kv_and_reconciles_with_survivors() {
    let rt = tokio::runtime::Runtime::new().expect("runtime");
    let mut c = Cluster::new();
    c.start_heads(3, false);
    let x = c.add_node(&["--num-cpus", "2"]);
    let y = c.add_node(&["--num-cpus", "2"]);
    let work = c.dir().join("keeper");
    std::fs::create_dir_all(&work).expect("work dir");
    let mut d = Driver::start(
        &c,
        &chaos_bin(),
        &["keeper", &c.head_addr(), &work.display().to_string(), &x.node_id, &y.node_id],
        &[],
    );
    // The driver keeps node a (its own agent must live) and puts `moved` on b.
    let nodes = d.wait_line("NODES ", Duration::from_secs(60));
    let (a, b) = if nodes.contains(&format!("a={}", x.node_id)) { (x, y) } else { (y, x) };
    let mut pids = HashMap::new();
    for name in ["keeper", "lost", "moved"] {
        let line = d.wait_line(&format!("ACTOR name={name} "), Duration::from_secs(60));
        let pid: u32 = line.rsplit("pid=").next().and_then(|p| p.trim().parse().ok()).expect("pid");
        pids.insert(name, pid);
    }
    d.wait_line("READY", SOON);
    let job = rt.block_on(async {
        let mut h = c.head_client();
        let moved = h
            .get_actor(pb::GetActorRequest { name: "moved".into(), ..Default::default() })
            .await
            .expect("moved")
            .into_inner()
            .actor
            .expect("actor");
        assert_eq!(moved.node_id, b.node_id, "moved runs on node b: {moved:?}");
        let job = register_job(&mut h, "hold-job").await;
        create_group(&mut h, group_request("hold-1", &job, "hold", true)).await;
        let g = group_state(&mut h, "hold", 20_000).await;
        assert_eq!(g.state, pb::PlacementGroupState::Created as i32, "{g:?}");
        assert!(kv_put(&mut h, "survivor", "survivor", "yes").await);
        job
    });

    for id in 1..=3 {
        c.kill_head(id);
    }
    signal(pids["lost"], libc::SIGKILL);
    signal(b.pid, libc::SIGKILL);
    // Longer than an agent retries an actor's exit report (15 s): only reconciliation
    // can tell the new leader that `lost` died.
    std::thread::sleep(Duration::from_secs(17));
    for id in 1..=3 {
        c.restart_head(id);
    }
    rt.block_on(async {
        c.wait_leader(SOON).await;
        let mut h = c.head_client();
        assert_eq!(kv_get(&mut h, "survivor").await.as_deref(), Some("yes"));
        let g = group_state(&mut h, "hold", 20_000).await;
        assert_eq!(g.state, pb::PlacementGroupState::Created as i32, "{g:?}");
        assert_eq!(g.job_id, job);
        let actor = |name: &'static str| {
            let mut h = c.head_client();
            async move {
                h.get_actor(pb::GetActorRequest { name: name.into(), ..Default::default() })
                    .await
                    .ok()?
                    .into_inner()
                    .actor
            }
        };
        let keeper = actor("keeper").await.expect("keeper by name");
        assert_eq!(keeper.state, pb::ActorState::Alive as i32, "{keeper:?}");
        assert_eq!(keeper.pid, pids["keeper"], "the actor kept its process: {keeper:?}");
        assert!(keeper.detached);
        for (name, node) in [("lost", &a.node_id), ("moved", &a.node_id)] {
            let old = pids[name];
            let info =
                eventually(Duration::from_secs(60), &format!("{name} restarted"), || async {
                    actor(name)
                        .await
                        .filter(|x| x.state == pb::ActorState::Alive as i32 && x.pid != old)
                })
                .await;
            assert_eq!(&info.node_id, node, "{name} runs on a live node: {info:?}");
            assert!(info.num_restarts >= 1, "{info:?}");
        }
        // Still the same process after the new leader compared the agents' workers.
        tokio::time::sleep(Duration::from_millis(3 * DEATH_TIMEOUT_MS)).await;
        let keeper = actor("keeper").await.expect("keeper again");
        assert_eq!(
            (keeper.state, keeper.pid),
            (pb::ActorState::Alive as i32, pids["keeper"]),
            "the keeper kept its process: {keeper:?}"
        );
        let st = h.get_cluster_status(pb::GetClusterStatusRequest {}).await.expect("status");
        let dead: Vec<_> = st
            .into_inner()
            .nodes
            .into_iter()
            .filter(|n| n.state == pb::NodeState::Dead as i32)
            .map(|n| n.node_id)
            .collect();
        assert_eq!(dead, vec![b.node_id.clone()], "only node b is gone");
    });
    std::fs::write(work.join("go"), b"go").expect("go file");
    let old = d.wait_line("OLD_HANDLE name=keeper ", Duration::from_secs(90));
    assert_eq!(old, format!("OLD_HANDLE name=keeper pid={}", pids["keeper"]));
    for name in ["lost", "moved"] {
        let line = d.wait_line(&format!("OLD_HANDLE name={name} "), Duration::from_secs(90));
        assert_ne!(line, format!("OLD_HANDLE name={name} pid={}", pids[name]), "{name} restarted");
    }
    let by_name = d.wait_line("BY_NAME ", Duration::from_secs(60));
    assert!(by_name.ends_with(&format!("pid={}", pids["keeper"])), "{by_name}");
    d.finish(Duration::from_secs(60)).assert_success();
}
