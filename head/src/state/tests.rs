use super::*;

fn node(id: &NodeId) -> NodeRecord {
    NodeRecord {
        node_id: id.clone(),
        address: "127.0.0.1:1".into(),
        hostname: "h".into(),
        total: ResourceSet::from_json(r#"{"CPU": 2}"#).unwrap(),
        labels: Labels::default(),
        is_head_node: false,
        start_time_ms: 0,
        session_dir: String::new(),
        pid: 1,
        status: NodeStatus::Alive,
        object_store_dir: String::new(),
        metrics_export_port: 0,
    }
}

fn actor(name: &str, max_restarts: i64) -> ActorRecord {
    ActorRecord {
        actor_id: ActorId::random(),
        job_id: JobId::random(),
        name: name.into(),
        namespace: DEFAULT_NAMESPACE.into(),
        class_name: "C".into(),
        resources: ResourceSet::new(),
        placement_resources: ResourceSet::new(),
        label_selector: vec![],
        affinity: None,
        spread: false,
        max_restarts,
        num_restarts: 0,
        detached: false,
        status: ActorStatus::PendingCreation,
        creation_task: vec![],
        last_placement: None,
        placement_group: None,
    }
}

fn cmd(kind: CommandKind) -> Command {
    Command { request_id: tpuray_proto::new_request_id(), kind }
}

#[test]
fn retried_request_id_is_applied_once() {
    let mut sm = StateMachine::new();
    let a = actor("x", 0);
    let c = Command {
        request_id: "r1".into(),
        kind: CommandKind::CreateActor { actor: a.clone(), get_if_exists: false },
    };
    let (o1, ch1) = sm.apply(c.clone());
    let (o2, ch2) = sm.apply(c);
    assert_eq!(o1, o2);
    assert_eq!(ch1.len(), 1);
    assert!(ch2.is_empty());
    assert_eq!(sm.actors.len(), 1);
}

/// HEAD-3: at most one live actor per (namespace, name).
#[test]
fn second_live_actor_with_same_name_is_rejected() {
    let mut sm = StateMachine::new();
    sm.apply(cmd(CommandKind::CreateActor { actor: actor("x", 0), get_if_exists: false }));
    let (o, _) =
        sm.apply(cmd(CommandKind::CreateActor { actor: actor("x", 0), get_if_exists: false }));
    assert!(matches!(o, Outcome::Rejected(Rejection::AlreadyExists(m)) if m.contains("\"x\"")));
}

/// ACTOR-1: an exit not asked for (here a node death) counts against `max_restarts`.
#[test]
fn actor_restarts_on_node_death_until_max_restarts_then_dies() {
    let mut sm = StateMachine::new();
    let n1 = NodeId::random();
    let n2 = NodeId::random();
    sm.apply(cmd(CommandKind::RegisterNode(node(&n1))));
    sm.apply(cmd(CommandKind::RegisterNode(node(&n2))));
    let a = actor("", 1);
    let id = a.actor_id.clone();
    sm.apply(cmd(CommandKind::CreateActor { actor: a, get_if_exists: false }));
    for n in [&n1, &n2] {
        sm.apply(cmd(CommandKind::ActorAlive {
            actor_id: id.clone(),
            node_id: n.clone(),
            worker_id: WorkerId::random(),
            address: "a".into(),
            pid: 1,
        }));
        sm.apply(cmd(CommandKind::MarkNodeDead { node_id: n.clone(), reason: "gone".into() }));
    }
    let rec = &sm.actors[&id];
    assert_eq!(rec.num_restarts, 1);
    assert!(rec.is_dead(), "{:?}", rec.status);
}

/// The alive-actors-by-node and waiting-actors indexes follow every status change
/// (alive, moved by a restart, a node's death, an exit) and are rebuilt from a snapshot.
#[test]
fn alive_actors_by_node_follow_each_change_and_survive_a_snapshot() {
    let mut sm = StateMachine::new();
    let (n1, n2) = (NodeId::random(), NodeId::random());
    for n in [&n1, &n2] {
        sm.apply(cmd(CommandKind::RegisterNode(node(n))));
    }
    let (a, b) = (actor("", 5), actor("", 0));
    let (ia, ib) = (a.actor_id.clone(), b.actor_id.clone());
    for x in [a, b] {
        sm.apply(cmd(CommandKind::CreateActor { actor: x, get_if_exists: false }));
    }
    let alive = |sm: &mut StateMachine, id: &ActorId, n: &NodeId| {
        let w = WorkerId::random();
        sm.apply(cmd(CommandKind::ActorAlive {
            actor_id: id.clone(),
            node_id: n.clone(),
            worker_id: w.clone(),
            address: "a".into(),
            pid: 1,
        }));
        w
    };
    let waiting = |sm: &StateMachine| {
        sm.waiting_actors().map(|a| a.actor_id.clone()).collect::<Vec<ActorId>>()
    };
    let mut both: Vec<ActorId> = vec![ia.clone(), ib.clone()];
    both.sort();
    assert_eq!(waiting(&sm), both);
    let wa = alive(&mut sm, &ia, &n1);
    let wb = alive(&mut sm, &ib, &n1);
    assert_eq!(waiting(&sm), Vec::<ActorId>::new());
    assert_eq!(sm.alive_actors_on(&n1), HashMap::from([(ia.clone(), wa), (ib.clone(), wb)]));
    // a restart: away from n1 while restarting, then alive on n2
    sm.apply(cmd(CommandKind::ActorWorkerExited {
        actor_id: ia.clone(),
        worker_id: None,
        intended: false,
        cause: "crashed".into(),
    }));
    assert_eq!(sm.alive_actors_on(&n1).len(), 1);
    assert_eq!(waiting(&sm), vec![ia.clone()]);
    let restored = StateMachine::restore(&sm.snapshot(0)).unwrap().0;
    assert_eq!(waiting(&restored), vec![ia.clone()]);
    let wa2 = alive(&mut sm, &ia, &n2);
    assert_eq!(sm.alive_actors_on(&n2), HashMap::from([(ia.clone(), wa2.clone())]));
    let (back, _) = StateMachine::restore(&sm.snapshot(0)).unwrap();
    assert_eq!(back.alive_actors_on(&n2), sm.alive_actors_on(&n2));
    assert_eq!(back.alive_actors_on(&n1), sm.alive_actors_on(&n1));
    // n1's death ends b (no restarts left); a on n2 stays
    sm.apply(cmd(CommandKind::MarkNodeDead { node_id: n1.clone(), reason: "gone".into() }));
    assert!(sm.actors[&ib].is_dead());
    assert!(sm.alive_actors_on(&n1).is_empty());
    assert_eq!(sm.alive_actors_on(&n2), HashMap::from([(ia.clone(), wa2)]));
}

/// HEAD-8: a leader that lost its term and led again can see two starts of one attempt
/// succeed: the first worker recorded is the actor's, a second is refused (its starter
/// stops it), and recording the first again changes nothing.
#[test]
fn a_second_start_of_an_alive_actor_is_refused_and_the_first_worker_stays() {
    let mut sm = StateMachine::new();
    let (n1, n2) = (NodeId::random(), NodeId::random());
    for n in [&n1, &n2] {
        sm.apply(cmd(CommandKind::RegisterNode(node(n))));
    }
    let a = actor("k", -1);
    let id = a.actor_id.clone();
    sm.apply(cmd(CommandKind::CreateActor { actor: a, get_if_exists: false }));
    let alive = |n: &NodeId, w: &WorkerId, pid: u32| {
        cmd(CommandKind::ActorAlive {
            actor_id: id.clone(),
            node_id: n.clone(),
            worker_id: w.clone(),
            address: format!("w{pid}"),
            pid,
        })
    };
    let (first, second) = (WorkerId::random(), WorkerId::random());
    assert_eq!(sm.apply(alive(&n1, &first, 1)).0, Outcome::Actor(id.clone()));
    let refused = sm.apply(alive(&n2, &second, 2)).0;
    assert!(
        matches!(&refused, Outcome::Rejected(Rejection::AlreadyExists(m)) if m.contains(&first.to_string())),
        "{refused:?}"
    );
    assert_eq!(sm.apply(alive(&n1, &first, 1)).0, Outcome::Actor(id.clone()));
    match &sm.actors[&id].status {
        ActorStatus::Alive { node_id, worker_id, pid, .. } => {
            assert_eq!((node_id, worker_id, *pid), (&n1, &first, 1));
        }
        s => panic!("not alive: {s:?}"),
    }
    assert_eq!(sm.alive_actors_on(&n2).len(), 0);
    assert_eq!(sm.actors[&id].num_restarts, 0);
}

/// ACTOR-1: an exit code 0 not asked for counts as a restart; an intended exit ends the
/// actor (and frees its name, HEAD-3).
#[test]
fn clean_exit_not_asked_for_counts_as_a_restart() {
    let mut sm = StateMachine::new();
    let a = actor("n", 2);
    let id = a.actor_id.clone();
    sm.apply(cmd(CommandKind::CreateActor { actor: a, get_if_exists: false }));
    sm.apply(cmd(CommandKind::ActorWorkerExited {
        actor_id: id.clone(),
        worker_id: None,
        intended: false,
        cause: "exit code 0".into(),
    }));
    assert_eq!(sm.actors[&id].num_restarts, 1);
    sm.apply(cmd(CommandKind::ActorWorkerExited {
        actor_id: id.clone(),
        worker_id: None,
        intended: true,
        cause: "killed".into(),
    }));
    assert!(sm.actors[&id].is_dead());
    assert!(sm.named_actor(DEFAULT_NAMESPACE, "n").is_none());
}

fn group(name: &str, job: &JobId, n: usize) -> PlacementGroupRecord {
    PlacementGroupRecord {
        pg_id: PlacementGroupId::random(),
        job_id: job.clone(),
        name: name.into(),
        namespace: DEFAULT_NAMESPACE.into(),
        strategy: PgStrategy::Pack,
        bundles: vec![
            Bundle {
                demand: ResourceSet::from_json(r#"{"CPU": 1}"#).unwrap(),
                label_selector: vec![]
            };
            n
        ],
        slice: None,
        detached: false,
        status: PgStatus::Pending,
        bundle_nodes: vec![None; n],
        create_time_ms: 0,
    }
}

fn placed(pg: &PlacementGroupId, bundles: Vec<(u32, NodeId)>) -> CommandKind {
    CommandKind::PlacementGroupPlaced { pg_id: pg.clone(), bundles, slice_bundles: None }
}

/// PG-1: clients choose group ids; a second group with a taken id never replaces the
/// first.
#[test]
fn creating_a_group_with_a_taken_id_is_refused_and_keeps_the_first() {
    let mut sm = StateMachine::new();
    let first = group("", &JobId::random(), 1);
    let mut second = group("", &JobId::random(), 2);
    second.pg_id = first.pg_id.clone();
    let id = first.pg_id.clone();
    sm.apply(cmd(CommandKind::CreatePlacementGroup(first)));
    let (o, changed) = sm.apply(cmd(CommandKind::CreatePlacementGroup(second)));
    assert!(matches!(o, Outcome::Rejected(Rejection::AlreadyExists(_))), "{o:?}");
    assert!(changed.is_empty());
    assert_eq!(sm.placement_groups[&id].bundles.len(), 1);
}

#[test]
fn group_is_created_once_every_bundle_is_placed_and_a_retry_reserves_nothing_twice() {
    let mut sm = StateMachine::new();
    let (n1, n2) = (NodeId::random(), NodeId::random());
    let pg = group("g", &JobId::random(), 2);
    let id = pg.pg_id.clone();
    sm.apply(cmd(CommandKind::CreatePlacementGroup(pg)));
    sm.apply(cmd(placed(&id, vec![(0, n1.clone())])));
    assert_eq!(sm.placement_groups[&id].status, PgStatus::Pending);
    let c = Command { request_id: "r".into(), kind: placed(&id, vec![(1, n2.clone())]) };
    sm.apply(c.clone());
    assert_eq!(sm.placement_groups[&id].status, PgStatus::Created);
    // The same request again changes nothing; a new one for a taken bundle is refused.
    let (_, ch) = sm.apply(c);
    assert!(ch.is_empty());
    let (o, _) = sm.apply(cmd(placed(&id, vec![(1, n1.clone())])));
    assert!(matches!(o, Outcome::Rejected(Rejection::Invalid(_))), "{o:?}");
    assert_eq!(sm.placement_groups[&id].bundle_nodes, vec![Some(n1), Some(n2)]);
}

#[test]
fn node_death_sends_its_bundles_back_to_placement_keeping_the_others() {
    let mut sm = StateMachine::new();
    let (n1, n2) = (NodeId::random(), NodeId::random());
    sm.apply(cmd(CommandKind::RegisterNode(node(&n1))));
    sm.apply(cmd(CommandKind::RegisterNode(node(&n2))));
    let pg = group("", &JobId::random(), 2);
    let id = pg.pg_id.clone();
    sm.apply(cmd(CommandKind::CreatePlacementGroup(pg)));
    sm.apply(cmd(placed(&id, vec![(0, n1.clone()), (1, n2.clone())])));
    sm.apply(cmd(CommandKind::MarkNodeDead { node_id: n2, reason: "gone".into() }));
    let g = &sm.placement_groups[&id];
    assert_eq!(g.status, PgStatus::Rescheduling);
    assert_eq!(g.bundle_nodes, vec![Some(n1), None]);
}

#[test]
fn removing_a_group_kills_its_actors_frees_its_name_and_placing_it_later_is_refused() {
    let mut sm = StateMachine::new();
    let job = JobId::random();
    let pg = group("g", &job, 1);
    let id = pg.pg_id.clone();
    sm.apply(cmd(CommandKind::CreatePlacementGroup(pg)));
    let (o, _) = sm.apply(cmd(CommandKind::CreatePlacementGroup(group("g", &job, 1))));
    assert!(matches!(o, Outcome::Rejected(Rejection::AlreadyExists(_))), "{o:?}");
    let mut a = actor("", -1);
    a.placement_group = Some((id.clone(), 0));
    let aid = a.actor_id.clone();
    sm.apply(cmd(CommandKind::CreateActor { actor: a, get_if_exists: false }));
    sm.apply(cmd(CommandKind::RemovePlacementGroup { pg_id: id.clone(), reason: "x".into() }));
    assert!(sm.actors[&aid].is_dead(), "restarts never bring back an actor of a removed group");
    assert!(sm.named_placement_group(DEFAULT_NAMESPACE, "g").is_none());
    let (o, _) = sm.apply(cmd(placed(&id, vec![(0, NodeId::random())])));
    assert!(matches!(o, Outcome::Rejected(_)), "{o:?}");
    let (o, _) = sm.apply(cmd(CommandKind::CreatePlacementGroup(group("g", &job, 1))));
    assert!(matches!(o, Outcome::PlacementGroup(_)), "the name is free again: {o:?}");
}

/// HEAD-9: the state keeps the newest removed groups only; live ones always stay.
#[test]
fn only_the_newest_removed_groups_are_kept_head_9() {
    let mut sm = StateMachine::new();
    let job = JobId::random();
    let live = group("", &job, 1);
    let live_id = live.pg_id.clone();
    sm.apply(cmd(CommandKind::CreatePlacementGroup(live)));
    let mut ids = Vec::new();
    let made = MAX_REMOVED_PLACEMENT_GROUPS + REMOVED_PLACEMENT_GROUPS_SLACK + 5;
    for i in 0..made {
        let mut g = group("", &job, 1);
        g.create_time_ms = 1 + i as u64;
        ids.push(g.pg_id.clone());
        sm.apply(cmd(CommandKind::CreatePlacementGroup(g)));
    }
    for id in &ids {
        sm.apply(cmd(CommandKind::RemovePlacementGroup { pg_id: id.clone(), reason: "x".into() }));
    }
    let removed = sm.placement_groups.values().filter(|p| p.is_removed()).count();
    // Past max + slack (at the removal after it), the oldest went down to the max;
    // the 4 removals since are kept.
    assert_eq!(removed, MAX_REMOVED_PLACEMENT_GROUPS + 4);
    let forgotten = made - removed;
    assert!(
        ids[..forgotten].iter().all(|id| !sm.placement_groups.contains_key(id)),
        "oldest forgotten"
    );
    assert!(ids[forgotten..].iter().all(|id| sm.placement_groups.contains_key(id)), "newest kept");
    assert!(sm.placement_groups.contains_key(&live_id), "a live group is never forgotten");
}

#[test]
fn groups_die_with_their_job_unless_detached() {
    let mut sm = StateMachine::new();
    let job = JobId::random();
    sm.apply(cmd(CommandKind::RegisterJob(JobRecord {
        job_id: job.clone(),
        status: JobStatus::Running,
        driver_address: String::new(),
        driver_pid: 1,
        entrypoint: String::new(),
        namespace: DEFAULT_NAMESPACE.into(),
        start_time_ms: 0,
        end_time_ms: 0,
        worker_binary_hash: String::new(),
        submission_id: String::new(),
    })));
    let plain = group("", &job, 1);
    let mut detached = group("", &job, 1);
    detached.detached = true;
    let (p, d) = (plain.pg_id.clone(), detached.pg_id.clone());
    sm.apply(cmd(CommandKind::CreatePlacementGroup(plain)));
    sm.apply(cmd(CommandKind::CreatePlacementGroup(detached)));
    sm.apply(cmd(CommandKind::FinishJob { job_id: job, end_time_ms: 1 }));
    assert!(sm.placement_groups[&p].is_removed());
    assert!(!sm.placement_groups[&d].is_removed());
}

#[test]
fn snapshot_restores_every_record_and_the_dedup_memory() {
    let mut sm = StateMachine::new();
    let n = NodeId::random();
    sm.apply(cmd(CommandKind::RegisterNode(node(&n))));
    let c = Command {
        request_id: "once".into(),
        kind: CommandKind::CreateActor { actor: actor("x", -1), get_if_exists: false },
    };
    let (first, _) = sm.apply(c.clone());
    sm.apply(cmd(CommandKind::KvPut {
        namespace: "ns".into(),
        key: b"k".to_vec(),
        value: b"v".to_vec(),
        overwrite: true,
    }));
    let bytes = sm.snapshot(42);
    let (mut back, extra) = StateMachine::restore(&bytes).unwrap();
    assert_eq!(extra, 42);
    assert_eq!(back.nodes, sm.nodes);
    assert_eq!(back.actors, sm.actors);
    assert_eq!(back.kv, sm.kv);
    assert!(back.named_actor(DEFAULT_NAMESPACE, "x").is_some());
    // HEAD-2 survives a snapshot: the retried request is answered, not applied.
    let (again, changed) = back.apply(c);
    assert_eq!(again, first);
    assert!(changed.is_empty());
    assert_eq!(back.actors.len(), 1);
}

#[test]
fn commands_round_trip_through_the_log_encoding() {
    let c = cmd(CommandKind::KvDelete { namespace: "a".into(), key: vec![1, 2] });
    assert_eq!(decode_command(&encode_command(&c)).unwrap(), c);
    // Byte strings travel whole: a binary chunk costs its length plus a few bytes.
    let put = cmd(CommandKind::KvPut {
        namespace: "binaries".into(),
        key: b"k".to_vec(),
        value: vec![7; 1 << 20],
        overwrite: false,
    });
    let bytes = encode_command(&put);
    assert!(bytes.len() < (1 << 20) + 100, "{} bytes", bytes.len());
    assert_eq!(decode_command(&bytes).unwrap(), put);
    assert!(decode_command(&[9, 0]).unwrap_err().contains("format 9"));
    assert!(StateMachine::restore(&[]).is_err());
}

#[test]
fn cluster_id_is_set_once() {
    let mut sm = StateMachine::new();
    for id in ["a", "b"] {
        sm.apply(cmd(CommandKind::InitCluster { cluster_id: id.into(), created_ms: 1 }));
    }
    assert_eq!(sm.cluster_id, "a");
}

#[test]
fn dead_node_cannot_register_again() {
    let mut sm = StateMachine::new();
    let n = NodeId::random();
    sm.apply(cmd(CommandKind::RegisterNode(node(&n))));
    sm.apply(cmd(CommandKind::MarkNodeDead { node_id: n.clone(), reason: "x".into() }));
    let (o, _) = sm.apply(cmd(CommandKind::RegisterNode(node(&n))));
    assert!(matches!(o, Outcome::Rejected(_)));
}

#[test]
fn head10_a_second_live_host_with_a_slices_worker_id_is_refused() {
    let tpu = |id: &NodeId, slice: &str, w: &str| {
        let mut r = node(id);
        r.labels.0.insert("tpuray.io/tpu-slice-name".into(), slice.into());
        r.labels.0.insert("tpuray.io/tpu-worker-id".into(), w.into());
        r
    };
    let mut sm = StateMachine::new();
    let (a, b, c, d) = (NodeId::random(), NodeId::random(), NodeId::random(), NodeId::random());
    assert!(matches!(
        sm.apply(cmd(CommandKind::RegisterNode(tpu(&a, "ix", "0")))).0,
        Outcome::Node(_)
    ));
    // The same node registering again (a retry) is fine; another slice's 0 too.
    assert!(matches!(
        sm.apply(cmd(CommandKind::RegisterNode(tpu(&a, "ix", "0")))).0,
        Outcome::Node(_)
    ));
    assert!(matches!(
        sm.apply(cmd(CommandKind::RegisterNode(tpu(&b, "iy", "0")))).0,
        Outcome::Node(_)
    ));
    let (o, _) = sm.apply(cmd(CommandKind::RegisterNode(tpu(&c, "ix", "0"))));
    match o {
        Outcome::Rejected(r) => {
            let m = r.to_string();
            assert!(
                m.contains("TPU slice \"ix\" already has a live host with TPU_WORKER_ID=0"),
                "{m}"
            );
        }
        _ => panic!("a duplicate worker id was accepted"),
    }
    // Once the first is declared dead, a restarted host takes its place.
    sm.apply(cmd(CommandKind::MarkNodeDead { node_id: a.clone(), reason: "x".into() }));
    assert!(matches!(
        sm.apply(cmd(CommandKind::RegisterNode(tpu(&d, "ix", "0")))).0,
        Outcome::Node(_)
    ));
}
