//! `tour`: the core of tpuray from Rust, against a running cluster (run it
//! after `tpuray start --head` and two `tpuray start --address` nodes, one
//! with `--resources '{"special": 1}'`). Every step checks its own result and
//! the program exits non-zero on the first mismatch.
//!
//! Steps: a remote function; an `ObjectRef` passed into another task; nested
//! tasks; an actor whose calls from one caller run in order; a task that
//! needs `special` landing on that node; 10,000 small tasks; a 50 MB result
//! made on one node and read byte-exact on another; a streaming generator of
//! 100 items.

use std::time::Instant;

use anyhow::{Context, bail, ensure};
use tpuray::{Blob, Generator, TaskOptions};

#[tpuray::remote]
fn add(a: i64, b: i64) -> i64 {
    a + b
}

#[tpuray::remote]
fn square(x: i64) -> i64 {
    x * x
}

/// Submits tasks from inside a task (nested tasks).
#[tpuray::remote]
fn sum_of_squares(n: i64) -> Result<i64, String> {
    let refs: Vec<_> = (1..=n).map(square::remote).collect();
    let values = tpuray::get_all(&refs).map_err(|e| e.to_string())?;
    Ok(values.iter().sum())
}

#[tpuray::remote]
fn where_am_i() -> String {
    tpuray::node_id().unwrap_or_default()
}

/// 50 MB of a position-dependent pattern, so any corruption shows.
#[tpuray::remote]
fn big_blob(mb: usize) -> (String, Blob) {
    let bytes = (0..mb * 1_000_000).map(|i| (i % 251) as u8).collect();
    (tpuray::node_id().unwrap_or_default(), Blob(bytes))
}

#[tpuray::remote]
fn countdown(n: u32) -> Generator<u32> {
    Generator::new((0..n).rev())
}

#[derive(Default)]
pub struct Journal {
    entries: Vec<u64>,
}

#[tpuray::actor]
impl Journal {
    pub fn new() -> Self {
        Journal::default()
    }
    pub fn append(&mut self, x: u64) -> usize {
        self.entries.push(x);
        self.entries.len()
    }
    pub fn entries(&self) -> Vec<u64> {
        self.entries.clone()
    }
}

fn step(name: &str, f: impl FnOnce() -> anyhow::Result<String>) -> anyhow::Result<()> {
    let t = Instant::now();
    let detail = f().with_context(|| format!("step {name:?} failed"))?;
    println!("ok  {name:<38} {:>8.1} ms  {detail}", t.elapsed().as_secs_f64() * 1e3);
    Ok(())
}

fn main() -> anyhow::Result<()> {
    tpuray::init(std::env::args().nth(1).as_deref())?;
    let driver_node = tpuray::node_id()?;

    step("remote function", || {
        let v = tpuray::get(&add::remote(1, 2))?;
        ensure!(v == 3, "add(1, 2) = {v}");
        Ok(format!("add(1, 2) = {v}"))
    })?;

    step("ObjectRef passed into another task", || {
        let x = add::remote(20, 1);
        let y = square::remote(&x);
        let v = tpuray::get(&y)?;
        ensure!(v == 441, "square(add(20, 1)) = {v}");
        Ok(format!("square(add(20, 1)) = {v}"))
    })?;

    step("nested tasks", || {
        let v = tpuray::get(&sum_of_squares::remote(10))?;
        ensure!(v == 385, "sum of squares 1..10 = {v}");
        Ok(format!("sum of squares 1..10 = {v}"))
    })?;

    step("actor calls run in order", || {
        let j = Journal::remote()?;
        let lens: Vec<_> = (0..200u64).map(|i| j.append(i)).collect();
        let lens = tpuray::get_all(&lens)?;
        ensure!(lens == (1..=200).collect::<Vec<usize>>(), "append returned lengths out of order");
        let entries = tpuray::get(&j.entries())?;
        ensure!(entries == (0..200).collect::<Vec<u64>>(), "entries out of order");
        j.handle().kill(true)?;
        Ok("200 appends in order".into())
    })?;

    let special_node = step_special()?;

    step("10,000 small tasks", || {
        let t = Instant::now();
        let refs: Vec<_> = (0..10_000).map(|i| add::remote(i, 1)).collect();
        let vals = tpuray::get_all(&refs)?;
        let want: i64 = (1..=10_000).sum();
        ensure!(vals.iter().sum::<i64>() == want, "wrong sum");
        Ok(format!("{:.0} tasks/s", 10_000.0 / t.elapsed().as_secs_f64()))
    })?;

    step("50 MB result made on another node", || {
        let r = big_blob::options(TaskOptions::default().resource("special", 1.0)).remote(50);
        let (made_on, blob) = tpuray::get(&r)?;
        ensure!(made_on == special_node, "made on {made_on}, expected the special node");
        ensure!(made_on != driver_node, "made on the driver's own node");
        ensure!(blob.0.len() == 50_000_000, "got {} bytes", blob.0.len());
        if let Some(i) = blob.0.iter().enumerate().position(|(i, b)| *b != (i % 251) as u8) {
            bail!("byte {i} differs");
        }
        Ok(format!("50,000,000 bytes byte-exact, made on {}", &made_on[..8]))
    })?;

    step("streaming generator of 100 items", || {
        let items: Vec<u32> = countdown::remote(100)
            .map(|r| r.and_then(|r| tpuray::get(&r)))
            .collect::<Result<_, _>>()?;
        ensure!(items == (0..100).rev().collect::<Vec<u32>>(), "items out of order or missing");
        Ok(format!("{} items, first {}, last {}", items.len(), items[0], items[99]))
    })?;

    tpuray::shutdown();
    println!("tour finished: every step passed");
    Ok(())
}

fn step_special() -> anyhow::Result<String> {
    let mut node = String::new();
    step("task needing `special` lands on that node", || {
        let n = tpuray::get(
            &where_am_i::options(TaskOptions::default().resource("special", 1.0)).remote(),
        )?;
        let nodes = tpuray::nodes()?;
        let has_special = nodes
            .iter()
            .find(|x| x.node_id == n)
            .map(|x| x.resources.contains_key("special"))
            .unwrap_or(false);
        ensure!(has_special, "ran on {n}, which has no `special`");
        node = n.clone();
        Ok(format!("ran on {}", &n[..8]))
    })?;
    Ok(node)
}
