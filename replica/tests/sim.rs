//! The Raft test harness: replicas ([`Node`], the same Ready code the head runs) over a
//! simulated network that drops, delays, duplicates and reorders messages, with
//! partitions and crash-restarts (a crashed replica keeps only its storage). Clients
//! retry each command with the same request id until it is acknowledged, as tpuray's
//! clients do; the machine applies a request id once (as the head's does, HEAD-2).
//!
//! Checked (RAFT-3, RAFT-4, RAFT-5): replicas never apply different commands at the same
//! index; no acknowledged command is lost; no command takes effect twice; every replica
//! ends with the same effects; the log stays bounded by compaction.
//!
//! Deterministic per seed. `TPURAY_RAFT_SIM_SEEDS=N` runs N seeds (default 8).

use std::collections::{BTreeMap, HashMap, HashSet};

use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use tpuray_replica::{Machine, MemKv, Message, MessageType, Node, NodeConfig, ProposeError};

/// Every command applied anywhere, by index: replicas must agree (state machine safety).
type Agreement = BTreeMap<u64, String>;

struct TestMachine {
    /// Request ids that took effect, in order.
    effects: Vec<String>,
    seen: HashSet<String>,
    last_index: u64,
}

impl TestMachine {
    fn new() -> Self {
        Self { effects: Vec::new(), seen: HashSet::new(), last_index: 0 }
    }
}

impl Machine for TestMachine {
    type Output = bool;

    fn apply(&mut self, index: u64, data: &[u8]) -> bool {
        assert!(index > self.last_index, "index {index} applied after {}", self.last_index);
        self.last_index = index;
        let id = String::from_utf8(data.to_vec()).unwrap();
        if self.seen.insert(id.clone()) {
            self.effects.push(id);
            true
        } else {
            false
        }
    }

    fn snapshot(&mut self) -> Vec<u8> {
        format!("{}\n{}", self.last_index, self.effects.join(",")).into_bytes()
    }

    fn restore(&mut self, index: u64, data: &[u8]) -> Result<(), String> {
        let s = String::from_utf8(data.to_vec()).map_err(|e| e.to_string())?;
        let (idx, rest) = s.split_once('\n').ok_or("no index line")?;
        // Empty entries of new leaders never reach the machine: its own last index may
        // trail the snapshot's.
        assert!(idx.parse::<u64>().unwrap() <= index, "snapshot from the future");
        self.effects = rest.split(',').filter(|s| !s.is_empty()).map(String::from).collect();
        self.seen = self.effects.iter().cloned().collect();
        self.last_index = index;
        Ok(())
    }
}

/// (client, request id)
type Token = (usize, String);

struct Replica {
    kv: MemKv,
    node: Option<Node<MemKv, TestMachine, Token>>,
    down_until: u64,
    incarnation: u64,
}

struct InFlight {
    at: u64,
    from: u64,
    msg: Message,
}

struct Client {
    seq: u64,
    current: Option<String>,
    next_try: u64,
}

struct Sim {
    rng: StdRng,
    step: u64,
    replicas: Vec<Replica>,
    net: Vec<InFlight>,
    clients: Vec<Client>,
    acked: Vec<String>,
    agreement: Agreement,
    /// Pairs that cannot talk, until a step.
    cut: HashMap<(u64, u64), u64>,
    drop_p: f64,
    dup_p: f64,
    max_delay: u64,
    faults: bool,
    /// Snapshots delivered to a replica that fell behind the compacted log.
    snapshots_delivered: u64,
    cfg: NodeConfig,
    logger: slog::Logger,
}

impl Sim {
    fn new(seed: u64, n: u64) -> Self {
        let logger = slog::Logger::root(slog::Discard, slog::o!());
        let voters: Vec<u64> = (1..=n).collect();
        let mut cfg = NodeConfig::new(1, voters.clone());
        cfg.snapshot_every = 25;
        cfg.keep_after_snapshot = 5;
        cfg.max_size_per_msg = 1024;
        let mut s = Self {
            rng: StdRng::seed_from_u64(seed),
            step: 0,
            replicas: Vec::new(),
            net: Vec::new(),
            clients: (0..4).map(|_| Client { seq: 0, current: None, next_try: 0 }).collect(),
            acked: Vec::new(),
            agreement: Agreement::new(),
            cut: HashMap::new(),
            drop_p: 0.1,
            dup_p: 0.02,
            max_delay: 6,
            faults: true,
            snapshots_delivered: 0,
            cfg,
            logger,
        };
        for id in voters {
            let kv = MemKv::new();
            let node = s.open(id, kv.clone(), 1);
            s.replicas.push(Replica { kv, node: Some(node), down_until: 0, incarnation: 1 });
        }
        s
    }

    fn open(&self, id: u64, kv: MemKv, incarnation: u64) -> Node<MemKv, TestMachine, Token> {
        let mut cfg = self.cfg.clone();
        cfg.id = id;
        Node::open(cfg, kv, TestMachine::new(), incarnation, &self.logger).expect("open replica")
    }

    fn linked(&self, a: u64, b: u64) -> bool {
        let key = (a.min(b), a.max(b));
        self.cut.get(&key).is_none_or(|until| *until <= self.step)
    }

    fn send(&mut self, from: u64, msgs: Vec<Message>) {
        for m in msgs {
            let copies = if self.faults && self.rng.random_bool(self.dup_p) { 2 } else { 1 };
            for _ in 0..copies {
                if self.faults && self.rng.random_bool(self.drop_p) {
                    self.snapshot_report(from, &m, false);
                    continue;
                }
                let delay = self.rng.random_range(0..=self.max_delay);
                self.net.push(InFlight { at: self.step + delay, from, msg: m.clone() });
            }
        }
    }

    fn snapshot_report(&mut self, from: u64, m: &Message, delivered: bool) {
        if m.get_msg_type() == MessageType::MsgSnapshot
            && let Some(node) = self.replicas[(from - 1) as usize].node.as_mut()
        {
            node.report_snapshot(m.to, delivered);
        }
    }

    fn deliver(&mut self) {
        let mut due = Vec::new();
        let mut later = Vec::new();
        for f in std::mem::take(&mut self.net) {
            if f.at <= self.step { due.push(f) } else { later.push(f) }
        }
        self.net = later;
        // Messages due together arrive in any order.
        for i in (1..due.len()).rev() {
            let j = self.rng.random_range(0..=i);
            due.swap(i, j);
        }
        for f in due {
            let to = f.msg.to;
            let up = self.replicas[(to - 1) as usize].node.is_some();
            let ok = up && self.linked(f.from, to);
            self.snapshot_report(f.from, &f.msg, ok);
            if ok && f.msg.get_msg_type() == MessageType::MsgSnapshot {
                self.snapshots_delivered += 1;
            }
            if ok {
                self.replicas[(to - 1) as usize].node.as_mut().unwrap().step(f.msg);
            }
        }
    }

    fn faults_step(&mut self) {
        if !self.faults {
            return;
        }
        let n = self.replicas.len() as u64;
        // Crash a replica now and then (at most one down at a time keeps progress likely,
        // but sometimes two go down: nothing may be lost even then).
        let down = self.replicas.iter().filter(|r| r.node.is_none()).count();
        if down < 2 && self.rng.random_bool(0.004) {
            let i = self.rng.random_range(0..n) as usize;
            if self.replicas[i].node.is_some() {
                self.replicas[i].node = None; // unsent messages and pending replies are lost
                self.replicas[i].down_until = self.step + self.rng.random_range(5..80);
            }
        }
        if self.rng.random_bool(0.005) {
            let a = self.rng.random_range(1..=n);
            let b = self.rng.random_range(1..=n);
            if a != b {
                let until = self.step + self.rng.random_range(10..120);
                self.cut.insert((a.min(b), a.max(b)), until);
            }
        }
    }

    fn restarts(&mut self) {
        for i in 0..self.replicas.len() {
            let r = &self.replicas[i];
            if r.node.is_none() && (r.down_until <= self.step || !self.faults) {
                let inc = r.incarnation + 1;
                let node = self.open(i as u64 + 1, r.kv.clone(), inc);
                let r = &mut self.replicas[i];
                r.node = Some(node);
                r.incarnation = inc;
            }
        }
    }

    fn clients_step(&mut self) {
        let n = self.replicas.len() as u64;
        for c in 0..self.clients.len() {
            if self.clients[c].next_try > self.step {
                continue;
            }
            if self.clients[c].current.is_none() {
                if !self.faults {
                    continue; // after healing, clients only finish what they started
                }
                self.clients[c].seq += 1;
                self.clients[c].current = Some(format!("c{c}-{}", self.clients[c].seq));
            }
            let id = self.clients[c].current.clone().unwrap();
            // Try a random replica; a follower refuses and the client tries again later
            // with the same request id.
            let target = self.rng.random_range(0..n) as usize;
            if let Some(node) = self.replicas[target].node.as_mut() {
                let _ = node.propose(id.clone().into_bytes(), (c, id));
            }
            self.clients[c].next_try = self.step + self.rng.random_range(3..15);
        }
    }

    fn ready_all(&mut self) {
        for i in 0..self.replicas.len() {
            let Some(node) = self.replicas[i].node.as_mut() else { continue };
            let fx = node.handle_ready().expect("in-memory storage does not fail");
            let from = i as u64 + 1;
            for ((c, id), _took_effect) in fx.applied {
                // Acknowledged: it must survive everything that follows.
                if self.clients[c].current.as_deref() == Some(&id) {
                    self.clients[c].current = None;
                    self.clients[c].next_try = self.step;
                }
                self.acked.push(id);
            }
            for ((_c, _id), e) in fx.dropped {
                assert!(matches!(e, ProposeError::NotLeader { .. } | ProposeError::Overwritten));
            }
            self.send(from, fx.messages);
        }
        self.check_agreement();
    }

    /// No two replicas apply different commands at one index: compare each replica's
    /// effects with the longest.
    fn check_agreement(&mut self) {
        let mut longest: Vec<String> = Vec::new();
        for r in self.replicas.iter().filter_map(|r| r.node.as_ref()) {
            let e = &r.machine().effects;
            let common = e.len().min(longest.len());
            assert_eq!(e[..common], longest[..common], "replicas diverged at step {}", self.step);
            if e.len() > longest.len() {
                longest = e.clone();
            }
        }
        for (i, id) in longest.iter().enumerate() {
            let prev = self.agreement.insert(i as u64, id.clone());
            if let Some(p) = prev {
                assert_eq!(&p, id, "effect {i} changed at step {}", self.step);
            }
        }
    }

    fn run_step(&mut self) {
        self.step += 1;
        self.faults_step();
        self.restarts();
        for r in self.replicas.iter_mut() {
            if let Some(n) = r.node.as_mut() {
                n.tick();
            }
        }
        self.deliver();
        self.clients_step();
        self.ready_all();
    }

    fn settled(&self) -> bool {
        let nodes: Vec<_> = self.replicas.iter().filter_map(|r| r.node.as_ref()).collect();
        nodes.len() == self.replicas.len()
            && self.clients.iter().all(|c| c.current.is_none())
            && nodes.windows(2).all(|w| w[0].status().applied == w[1].status().applied)
            && nodes.iter().all(|n| n.status().applied == n.status().commit)
            && nodes.iter().any(|n| n.status().leader_ready)
    }
}

/// Runs one seed; returns how many snapshots were delivered.
fn run(seed: u64, n: u64, steps: u64) -> u64 {
    let mut sim = Sim::new(seed, n);
    for _ in 0..steps {
        sim.run_step();
    }
    // Heal: no more faults; every replica comes back; clients finish their requests.
    sim.faults = false;
    sim.cut.clear();
    let mut extra = 0;
    while !sim.settled() {
        sim.run_step();
        extra += 1;
        assert!(extra < 5_000, "seed {seed}: the cluster did not settle after healing");
    }
    // One more round so the last commit index reaches everyone.
    for _ in 0..30 {
        sim.run_step();
    }
    let effects: Vec<Vec<String>> =
        sim.replicas.iter().map(|r| r.node.as_ref().unwrap().machine().effects.clone()).collect();
    for e in &effects[1..] {
        assert_eq!(e, &effects[0], "seed {seed}: replicas ended with different effects");
    }
    let set: HashSet<&String> = effects[0].iter().collect();
    assert_eq!(set.len(), effects[0].len(), "seed {seed}: a command took effect twice");
    for id in &sim.acked {
        assert!(set.contains(id), "seed {seed}: acknowledged command {id} was lost");
    }
    let total: u64 = sim.clients.iter().map(|c| c.seq).sum();
    assert_eq!(effects[0].len() as u64, total, "seed {seed}: every request took effect once");
    assert!(total > 20, "seed {seed}: too little progress to mean anything ({total} commands)");
    for r in &sim.replicas {
        let st = r.node.as_ref().unwrap().status();
        let len = st.last_index - st.first_index + 1;
        assert!(
            len <= sim.cfg.snapshot_every + sim.cfg.keep_after_snapshot + 50,
            "seed {seed}: replica {} keeps {len} entries despite compaction",
            st.id
        );
    }
    sim.snapshots_delivered
}

fn seeds() -> u64 {
    std::env::var("TPURAY_RAFT_SIM_SEEDS").ok().and_then(|s| s.parse().ok()).unwrap_or(8)
}

#[test]
fn three_replicas_lose_and_duplicate_nothing_over_a_faulty_network() {
    let mut snapshots = 0;
    for seed in 0..seeds() {
        snapshots += run(seed, 3, 3_000);
    }
    assert!(snapshots > 0, "no replica ever caught up through a snapshot: compaction untested");
}

#[test]
fn five_replicas_lose_and_duplicate_nothing_over_a_faulty_network() {
    for seed in 0..seeds().div_ceil(2) {
        run(1_000 + seed, 5, 2_000);
    }
}

#[test]
fn one_replica_applies_each_command_in_the_round_that_persists_it() {
    // RAFT-1: with the LightReady handled, a one-voter group answers a proposal in the
    // same Ready round, with no tick in between.
    let logger = slog::Logger::root(slog::Discard, slog::o!());
    let mut node: Node<MemKv, TestMachine, u32> =
        Node::open(NodeConfig::new(1, vec![1]), MemKv::new(), TestMachine::new(), 1, &logger)
            .unwrap();
    // Become leader and apply the empty entry of the new term.
    for _ in 0..3 {
        let _ = node.handle_ready().unwrap();
    }
    assert!(node.status().leader_ready);
    for i in 0..5u32 {
        node.propose(format!("r{i}").into_bytes(), i).map_err(|e| e.1).unwrap();
        let fx = node.handle_ready().unwrap();
        assert_eq!(fx.applied.len(), 1, "proposal {i} answered in its own round");
        assert_eq!(fx.applied[0].0, i);
    }
}

#[test]
fn a_restarted_replica_rebuilds_its_machine_from_snapshot_and_log() {
    let logger = slog::Logger::root(slog::Discard, slog::o!());
    let kv = MemKv::new();
    let mut cfg = NodeConfig::new(1, vec![1]);
    cfg.snapshot_every = 7;
    cfg.keep_after_snapshot = 2;
    {
        let mut node: Node<MemKv, TestMachine, u32> =
            Node::open(cfg.clone(), kv.clone(), TestMachine::new(), 1, &logger).unwrap();
        for _ in 0..3 {
            let _ = node.handle_ready().unwrap();
        }
        for i in 0..20u32 {
            node.propose(format!("r{i}").into_bytes(), i).map_err(|e| e.1).unwrap();
            let _ = node.handle_ready().unwrap();
        }
        // A retried request id takes no effect.
        node.propose(b"r3".to_vec(), 99).map_err(|e| e.1).unwrap();
        let fx = node.handle_ready().unwrap();
        assert_eq!(fx.applied, vec![(99, false)]);
        let st = node.status();
        assert!(st.snapshot_index > 0);
        // Status reports the snapshots taken (at applied indexes 7, 14 and 21) and the
        // size of the last one: the machine's bytes at index 21 (entries r0..r19).
        assert_eq!(st.snapshots_taken, 3);
        assert_eq!(st.snapshot_index, 21);
        let at_21 =
            format!("21\n{}", (0..20).map(|i| format!("r{i}")).collect::<Vec<_>>().join(","));
        assert_eq!(st.last_snapshot.bytes, at_21.len() as u64);
    }
    let mut node: Node<MemKv, TestMachine, u32> =
        Node::open(cfg, kv, TestMachine::new(), 2, &logger).unwrap();
    for _ in 0..3 {
        let _ = node.handle_ready().unwrap();
    }
    let want: Vec<String> = (0..20).map(|i| format!("r{i}")).collect();
    assert_eq!(node.machine().effects, want);
}
