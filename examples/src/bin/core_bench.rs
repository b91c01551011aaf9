//! `core_bench`: throughput and latency of the Rust SDK's core paths against
//! a running cluster (`tpuray start --head` first). Prints one line per case
//! in `tpuray microbenchmark`'s format: `<name> per second <mean> +- <sd>`
//! over ROUNDS rounds (default 3), plus the time to the first task. `ONLY=<text>` runs
//! only the cases whose name contains it (`bench/sync_profile.sh` profiles one so).
//!
//!   cargo build --release -p tpuray-examples
//!   target/release/core_bench [HEAD_ADDRESS]

use std::time::{Duration, Instant};

#[tpuray::remote]
fn noop() -> u8 {
    0
}

#[derive(Default)]
pub struct Counter {
    n: u64,
}

#[tpuray::actor]
impl Counter {
    pub fn new() -> Self {
        Counter::default()
    }
    pub fn incr(&mut self) -> u64 {
        self.n += 1;
        self.n
    }
}

fn rate(
    name: &str,
    rounds: usize,
    per_round: usize,
    mut f: impl FnMut() -> anyhow::Result<()>,
) -> anyhow::Result<()> {
    if std::env::var("ONLY").is_ok_and(|only| !name.contains(&only)) {
        return Ok(());
    }
    let mut rates = Vec::new();
    for _ in 0..rounds {
        let t = Instant::now();
        f()?;
        rates.push(per_round as f64 / t.elapsed().as_secs_f64());
    }
    let mean = rates.iter().sum::<f64>() / rates.len() as f64;
    let var = rates.iter().map(|r| (r - mean).powi(2)).sum::<f64>() / rates.len() as f64;
    println!("{name} per second {mean:.2} +- {:.2}", var.sqrt());
    Ok(())
}

fn main() -> anyhow::Result<()> {
    let t0 = Instant::now();
    tpuray::init(std::env::args().nth(1).as_deref())?;
    let joined = t0.elapsed();
    tpuray::get(&noop::remote())?;
    let first = t0.elapsed();
    println!(
        "init {:.1} ms, first task result {:.1} ms after start",
        joined.as_secs_f64() * 1e3,
        first.as_secs_f64() * 1e3
    );
    let rounds: usize = std::env::var("ROUNDS").ok().and_then(|r| r.parse().ok()).unwrap_or(3);

    rate("single client tasks sync", rounds, 500, || {
        for _ in 0..500 {
            tpuray::get(&noop::remote())?;
        }
        Ok(())
    })?;
    rate("single client tasks async", rounds, 5000, || {
        let refs: Vec<_> = (0..5000).map(|_| noop::remote()).collect();
        tpuray::get_all(&refs)?;
        Ok(())
    })?;
    let c = Counter::remote()?;
    tpuray::get(&c.incr())?;
    rate("1:1 actor calls sync", rounds, 1000, || {
        for _ in 0..1000 {
            tpuray::get(&c.incr())?;
        }
        Ok(())
    })?;
    rate("1:1 actor calls async", rounds, 5000, || {
        let refs: Vec<_> = (0..5000).map(|_| c.incr()).collect();
        tpuray::get_all(&refs)?;
        Ok(())
    })?;
    rate("actors created", rounds, 10, || {
        let actors: Vec<_> = (0..10).map(|_| Counter::remote()).collect::<Result<_, _>>()?;
        for a in &actors {
            tpuray::get_timeout(&a.incr(), Duration::from_secs(60))?;
        }
        for a in actors {
            a.handle().kill(true)?;
        }
        Ok(())
    })?;
    rate("single client put calls", rounds, 2000, || {
        for i in 0..2000u64 {
            tpuray::put(&i)?;
        }
        Ok(())
    })?;
    tpuray::shutdown();
    Ok(())
}
