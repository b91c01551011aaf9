use super::*;

#[test]
fn dash_2_escape_covers_every_html_special_character() {
    assert_eq!(
        esc("<a href=\"x\">'&'</a>"),
        "&lt;a href=&quot;x&quot;&gt;&#39;&amp;&#39;&lt;/a&gt;"
    );
    assert_eq!(esc("plain ünïcode"), "plain ünïcode");
    assert_eq!(esc(""), "");
}

#[test]
fn url_components_are_percent_encoded_and_forms_decoded() {
    assert_eq!(enc("a b/c?d=e&f"), "a%20b%2Fc%3Fd%3De%26f");
    assert_eq!(enc("raysubmit_AbC-1.2~"), "raysubmit_AbC-1.2~");
    assert_eq!(decode("a+b%2Fc%3d"), "a b/c=");
    assert_eq!(decode("100%"), "100%");
    assert_eq!(decode("%zz%4"), "%zz%4");
    assert_eq!(decode("%C3%A9"), "é");
    assert_eq!(decode("%FF"), "\u{FFFD}");
    let q = parse_query("state=FAILED&job=j%201&&flag&state=X");
    assert_eq!(param(&q, "state"), Some("FAILED"));
    assert_eq!(param(&q, "job"), Some("j 1"));
    assert_eq!(param(&q, "flag"), Some(""));
    assert_eq!(param(&q, "none"), None);
    for s in ["", "%", "a=%", "=%2", "&&&", "%%%%", "é=%E9"] {
        let _ = parse_query(s); // never panics
    }
}

#[test]
fn times_and_durations_read_as_people_write_them() {
    assert_eq!(time(0), "-");
    let sp = |s: &str| s.replace('\u{a0}', " ");
    assert_eq!(sp(&time(951_782_400_000 + 3_723_000)), "2000-02-29 01:02:03 UTC");
    assert_eq!(utc(1_767_225_599), (2025, 12, 31, 23, 59, 59));
    assert_eq!(sp(&duration(850)), "850 ms");
    assert_eq!(sp(&duration(12_345)), "12.3 s");
    assert_eq!(sp(&duration(242_000)), "4 min 2 s");
    assert_eq!(sp(&duration(12_000_000)), "3 h 20 min");
    assert_eq!(sp(&ago(1_000, 4_200)), "3.2 s ago");
}

fn mk_node(id: &str, address: &str) -> pb::NodeInfo {
    pb::NodeInfo {
        node_id: id.into(),
        address: address.into(),
        state: pb::NodeState::Alive as i32,
        total: HashMap::from([("CPU".into(), 4.0), ("memory".into(), 2048.0)]),
        available: HashMap::from([("CPU".into(), 1.0), ("memory".into(), 1024.0)]),
        ..Default::default()
    }
}

#[test]
fn dash_2_values_from_the_cluster_never_reach_the_page_raw() {
    let evil = "<script>alert(1)</script>";
    let mut n = mk_node(evil, evil);
    n.labels.insert(evil.into(), evil.into());
    n.death_reason = evil.into();
    let st = pb::GetClusterStatusReply { nodes: vec![n.clone()], ..Default::default() };
    let actor = pb::ActorInfo {
        actor_id: evil.into(),
        class_name: evil.into(),
        name: evil.into(),
        death_cause: evil.into(),
        ..Default::default()
    };
    let task = pb::TaskSummary {
        task_id: evil.into(),
        name: evil.into(),
        state: evil.into(),
        error: evil.into(),
        job_id: evil.into(),
        ..Default::default()
    };
    let read = TasksRead { tasks: vec![task], truncated: false, dropped: 0 };
    let sub = pb::JobSubmission {
        submission_id: evil.into(),
        status: evil.into(),
        entrypoint: evil.into(),
        message: evil.into(),
        ..Default::default()
    };
    let group = pb::PlacementGroupInfo {
        placement_group_id: evil.into(),
        name: evil.into(),
        pending_reason: evil.into(),
        bundles: vec![pb::Bundle {
            resources: HashMap::from([(evil.to_string(), 1.0)]),
            ..Default::default()
        }],
        bundle_node_ids: vec![evil.into()],
        ..Default::default()
    };
    let serve_doc = serde_json::json!({"applications": {evil: {"status": evil, "route_prefix": evil,
        "deployments": {evil: {"status": evil, "replicas": [{"replica_id": evil}]}}}}});
    let pages = [
        overview(
            &st,
            Ok(std::slice::from_ref(&actor)),
            Ok(&read),
            Ok(std::slice::from_ref(&sub)),
            Ok(&[]),
            Ok(std::slice::from_ref(&group)),
            &HashMap::new(),
            0,
        ),
        nodes(&st, 0),
        node(&n, Ok(&[]), Err(evil), &[], 0),
        actors(std::slice::from_ref(&actor), &st.nodes, None),
        actors(std::slice::from_ref(&actor), &st.nodes, Some(evil)),
        tasks(&read, &st.nodes, None, Some(evil), 10),
        tasks(&read, &st.nodes, Some(evil), None, 10),
        groups(std::slice::from_ref(&group), &st.nodes, 0),
        jobs(std::slice::from_ref(&sub), &[], &st.nodes),
        submission(&sub, Ok(Some(LogTail { text: evil.into(), offset: 0, size: 1 })), &st.nodes),
        serve(Some(&serve_doc), 0.0),
        replicas(&[(1, evil.into(), Err(evil.into()))], 1),
        layout(evil, "/", &esc(evil), "", 5),
        login_page(evil, Some(evil)),
        error_box(evil, evil),
    ];
    for (i, p) in pages.iter().enumerate() {
        assert!(!p.contains("<script>alert"), "page {i} has the value raw:\n{p}");
        assert!(!p.contains("<script>a"), "page {i}");
    }
    assert!(pages[3].contains("&lt;script&gt;"), "the actor page shows the value, escaped");
}

#[test]
fn dash_1_the_overview_names_every_node_by_id_and_address() {
    let st = pb::GetClusterStatusReply {
        nodes: vec![
            mk_node("n1aaaaaaaaaa", "10.0.0.1:7001"),
            mk_node("n2bbbbbbbbbb", "10.0.0.2:7001"),
        ],
        ..Default::default()
    };
    let page = overview(&st, Ok(&[]), Err("down"), Ok(&[]), Ok(&[]), Ok(&[]), &HashMap::new(), 0);
    for (id, addr) in [("n1aaaaaaaaaa", "10.0.0.1:7001"), ("n2bbbbbbbbbb", "10.0.0.2:7001")] {
        assert!(page.contains(&format!("<code>{id}</code>")), "{page}");
        assert!(page.contains(addr));
    }
    assert!(page.contains("unavailable: down"), "a failed read is said, not hidden");
}

#[test]
fn a_gang_on_a_slice_is_drawn_on_every_chip_it_holds() {
    let pg = "feedfeedfeedfeedfeedfeedfeedfeed";
    let mut hosts = Vec::new();
    for w in 0..4u32 {
        let mut n = mk_node(&format!("host{w}xxxxxxxx"), &format!("10.0.0.{w}:7001"));
        for (k, v) in [
            ("tpu-slice-name", "sa".to_string()),
            ("tpu-worker-id", w.to_string()),
            ("tpu-pod-type", "v6e-16".into()),
            ("tpu-topology", "4x4".into()),
        ] {
            n.labels.insert(format!("tpuray.io/{k}"), v);
        }
        n.total.insert("TPU".into(), 4.0);
        n.available.insert("TPU".into(), 0.0);
        n.total.insert(format!("TPU_group_{pg}"), 4.0);
        hosts.push(n);
    }
    let group = pb::PlacementGroupInfo {
        placement_group_id: pg.into(),
        name: "gang:train:1".into(),
        state: pb::PlacementGroupState::Created as i32,
        bundle_node_ids: hosts.iter().map(|n| n.node_id.clone()).collect(),
        ..Default::default()
    };
    let mut workers = HashMap::new();
    workers.insert(
        hosts[0].node_id.clone(),
        Ok(vec![pb::WorkerInfo {
            worker_id: "wk".into(),
            pid: 99,
            state: "ACTOR".into(),
            key: Some(pb::WorkerPoolKey { tpu_chips: vec![0, 1, 2, 3], ..Default::default() }),
            resources: HashMap::from([(format!("TPU_group_0_{pg}"), 4.0)]),
            ..Default::default()
        }]),
    );
    workers.insert(hosts[1].node_id.clone(), Err("agent gone".to_string()));
    let page = slices_page(&hosts, std::slice::from_ref(&group), &workers, &[]);
    assert!(page.contains("slice sa: v6e-16, topology 4x4, 4 hosts"), "{page}");
    assert_eq!(page.matches("class=\"chip busy grouped\"").count(), 4, "host 0's four chips");
    assert_eq!(page.matches("class=\"chip reserved grouped\"").count(), 12, "the others");
    assert_eq!(page.matches("<span class=\"gang\">gang train (gen 1)</span>").count(), 16);
    assert!(page.contains("grid-column:2;grid-row:2"), "worker 3 at the grid's corner");
    assert!(page.contains("agent gone"));
    for n in &hosts {
        assert!(page.contains(&n.address));
    }
}

#[test]
fn the_stylesheet_styles_every_chip_state() {
    let css = include_str!("../dashboard.css");
    for s in CHIP_CLASSES {
        assert!(css.contains(&format!(".chip.{}", s.word())), "{}", s.word());
    }
}
