//! Node deaths as the head announces them (CORE-10): the core worker follows the
//! head's state-change stream and acts on a node's death at once, instead of waiting
//! for a transport keep-alive to notice a silent peer.
//!
//! [`NodeDeaths`] is the set of nodes the head declared dead plus a wake-up for
//! everything waiting on one ([`NodeDeaths::died`]); `Core::watch_nodes` (in
//! `core.rs`) feeds it from `HeadService::Subscribe` and runs the owner's reactions.
//! A dead node never comes back under its id (the head fences it: its agent exits
//! and a restarted one registers as a new node), so the set only grows.
//!
//! Async: [`NodeDeaths::died`] needs the SDK's runtime; the rest never blocks.

use std::collections::HashSet;
use std::sync::Mutex;

/// The nodes the head declared dead, and a signal when the set grows.
pub(crate) struct NodeDeaths {
    dead: Mutex<HashSet<String>>,
    /// Bumped whenever a node is added to `dead`.
    grew: tokio::sync::watch::Sender<u64>,
}

impl Default for NodeDeaths {
    fn default() -> Self {
        Self { dead: Mutex::new(HashSet::new()), grew: tokio::sync::watch::channel(0).0 }
    }
}

impl NodeDeaths {
    /// Whether the head declared `node_id` dead (false for "", an unknown node).
    pub(crate) fn is_dead(&self, node_id: &str) -> bool {
        !node_id.is_empty() && self.dead.lock().unwrap().contains(node_id)
    }

    /// Records a death; true when it is news.
    pub(crate) fn mark_dead(&self, node_id: &str) -> bool {
        let new = self.dead.lock().unwrap().insert(node_id.to_string());
        if new {
            self.grew.send_modify(|n| *n += 1);
        }
        new
    }

    /// Resolves once `node_id` is declared dead; never for "" (no node known).
    pub(crate) async fn died(&self, node_id: &str) {
        if node_id.is_empty() {
            return std::future::pending().await;
        }
        let mut rx = self.grew.subscribe();
        loop {
            if self.is_dead(node_id) {
                return;
            }
            if rx.changed().await.is_err() {
                return std::future::pending().await;
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::Arc;
    use std::time::Duration;

    #[test]
    fn core10_a_wait_on_a_node_ends_when_it_is_declared_dead_and_not_before() {
        let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
        rt.block_on(async {
            let d = Arc::new(NodeDeaths::default());
            let w = Arc::clone(&d);
            let waiter = tokio::spawn(async move { w.died("n1").await });
            d.mark_dead("n2");
            tokio::time::sleep(Duration::from_millis(20)).await;
            assert!(!waiter.is_finished(), "another node's death ended the wait");
            assert!(d.mark_dead("n1"));
            assert!(!d.mark_dead("n1"), "a second notice is not news");
            tokio::time::timeout(Duration::from_secs(1), waiter).await.unwrap().unwrap();
            assert!(d.is_dead("n1") && !d.is_dead("") && !d.is_dead("n3"));
            // Already dead: answers at once.
            tokio::time::timeout(Duration::from_secs(1), d.died("n2")).await.unwrap();
            // No node: never.
            assert!(tokio::time::timeout(Duration::from_millis(20), d.died("")).await.is_err());
        });
    }
}
