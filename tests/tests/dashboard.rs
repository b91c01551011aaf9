//! The dashboard's pages on a replicated head (DASH-4, HTTP-1): every head serves them, a
//! follower's pages show the leader's data and say so, the replicas page shows every
//! replica's Raft state, and after the leader dies the survivors' pages still show the
//! cluster. Pages in a real browser are tested in python-sdk/tests/test_dashboard.py.

use tpuray_tests::*;

/// A GET with the token.
fn get(url: &str, path: &str, token: &str) -> (u16, String) {
    http(url, "GET", path, Some(token), "")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn dash_4_every_head_serves_the_leaders_data_before_and_after_the_leader_dies() {
    let mut c = Cluster::new();
    c.start_heads(3, false);
    let node = c.add_node(&["--num-cpus", "1"]);
    let leader = c.wait_leader(SOON).await;
    let token = c.token();
    let urls = c.dashboards().await;
    for (id, url) in &urls {
        let (code, body) = get(url, "/", &token);
        assert_eq!(code, 200, "head {id}: {body}");
        assert!(body.contains(&format!("<code>{}</code>", node.node_id)), "head {id}: {body}");
        assert!(body.contains(&node.address), "head {id}");
        if *id == leader {
            assert!(body.contains(", the leader."), "head {id}: {body}");
        } else {
            assert!(body.contains("the data is the leader's (leader: head"), "head {id}: {body}");
        }
        let (code, body) = get(url, "/replicas", &token);
        assert_eq!(code, 200);
        assert_eq!(body.matches("<span class=\"badge ok\">leader</span>").count(), 1, "{body}");
        assert_eq!(
            body.matches("<span class=\"badge plain\">follower</span>").count(),
            2,
            "{body}"
        );
        assert!(body.contains(&format!("{id} <span class=\"badge plain\">this head</span>")));
    }
    c.kill_head(leader);
    let new_leader = c.wait_leader(SOON).await;
    for (id, url) in urls.iter().filter(|(id, _)| *id != leader) {
        let (code, _) = eventually(SOON, "a survivor's overview lists the node", || {
            let (url, token, node_id) = (url.clone(), token.clone(), node.node_id.clone());
            async move {
                let r =
                    tokio::task::spawn_blocking(move || get(&url, "/nodes", &token)).await.ok()?;
                (r.0 == 200 && r.1.contains(&node_id)).then_some(r)
            }
        })
        .await;
        assert_eq!(code, 200, "head {id}");
        let (_, body2) = get(url, "/replicas", &token);
        assert!(body2.contains("unreachable"), "the dead head is named: {body2}");
        assert!(body2.contains(&format!("Leader: head {new_leader} ")), "{body2}");
    }
}
