//! Object transfer between nodes (OBJ-8) through the public SDK: a large object
//! read on several nodes at once is pulled from every node that has a copy, not
//! all from the one that made it. Five node agents on this machine, a driver
//! (`tpuray-test-driver`, scenario `broadcast`) on the head node, and the bytes
//! each agent served read from its `GetStoreUsage` reply.

use std::path::PathBuf;
use std::time::Duration;

use tpuray_proto::pb;
use tpuray_tests::*;

fn driver_bin() -> PathBuf {
    PathBuf::from(env!("CARGO_BIN_EXE_tpuray-test-driver"))
}

const GIB: u64 = 1 << 30;
/// Each node's store: room for one 1 GiB copy and a half (the object store is tmpfs).
const STORE_BYTES: &str = "1610612736";
const READERS: [&str; 4] = ["B", "C", "D", "E"];

/// Object bytes the agent at `address` sent to pullers.
fn bytes_served(c: &Cluster, address: &str) -> u64 {
    let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().expect("runtime");
    let token = c.token();
    rt.block_on(async {
        let mut client = tpuray_proto::client::objects(address, Some(&token)).expect("client");
        client
            .get_store_usage(pb::GetStoreUsageRequest { limit: 1 })
            .await
            .unwrap_or_else(|s| panic!("GetStoreUsage on {address}: {s}"))
            .into_inner()
            .bytes_served
    })
}

/// OBJ-8: a 1 GiB object put on node A is read byte-exact by one task on each of B..E at
/// the same time. The owner hands each puller the copy with the fewest pulls in flight
/// (at most two per copy) and adds every finished copy as a source, so A's agent serves
/// well under the 4 GiB a pull-everything-from-the-origin scheme would.
#[test]
fn broadcast_of_one_gib_to_four_nodes_pulls_from_copies_not_only_the_origin() {
    let mut c = Cluster::new();
    let a = c.start_head(&["--num-cpus", "1", "--object-store-memory", STORE_BYTES]);
    let mut nodes = Vec::new();
    for n in READERS {
        let res = format!(r#"{{"{n}": 1}}"#);
        nodes.push(c.add_node(&[
            "--num-cpus",
            "1",
            "--object-store-memory",
            STORE_BYTES,
            "--resources",
            &res,
        ]));
    }
    let addr = c.head_addr();
    let size = GIB.to_string();
    let names = READERS.join(",");
    let d = Driver::start(&c, &driver_bin(), &["broadcast", &addr, &size, &names], &[]);
    let out = d.finish(Duration::from_secs(600));
    out.assert_success();
    for (n, node) in READERS.iter().zip(&nodes) {
        let line = out
            .stdout
            .iter()
            .find(|l| l.starts_with(&format!("READ name={n} ")))
            .unwrap_or_else(|| panic!("no READ line for {n}:\n{out}"));
        assert!(line.contains(" ok=true "), "{line}");
        assert!(line.ends_with(&format!("node={}", node.node_id)), "ran on its node: {line}");
    }

    let from_a = bytes_served(&c, &a.address);
    let others: Vec<u64> = nodes.iter().map(|n| bytes_served(&c, &n.address)).collect();
    eprintln!(
        "bytes served: A={from_a} ({:.2} GiB), B..E={others:?}; {}",
        from_a as f64 / GIB as f64,
        out.line("DONE")
    );
    let total = from_a + others.iter().sum::<u64>();
    assert!(total >= 4 * GIB, "every reader pulled a whole copy: {total}");
    assert!(from_a <= 3 * GIB, "A served {from_a} bytes: the readers did not share copies");
    assert!(others.iter().any(|&b| b >= GIB), "a reader's copy served another: {others:?}");
}
