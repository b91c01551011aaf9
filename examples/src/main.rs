//! `cluster_info`: joins the cluster that `tpuray start --head` left on this
//! machine (or `TPURAY_ADDRESS`) as a job, prints its nodes and resources as
//! `ray.nodes()` and `ray.cluster_resources()` would, and finishes the job.

fn main() -> anyhow::Result<()> {
    let address = std::env::args().nth(1);
    tpuray::init(address.as_deref())?;
    println!("joined as job {}", tpuray::job_id()?);
    for n in tpuray::nodes()? {
        let cpus = n.resources.get("CPU").copied().unwrap_or(0.0);
        let custom: Vec<String> = n
            .resources
            .iter()
            .filter(|(k, _)| !["CPU", "memory", "object_store_memory"].contains(&k.as_str()))
            .map(|(k, v)| format!("{k}={v}"))
            .collect();
        println!(
            "node {} alive={} address={} CPU={cpus} {}",
            &n.node_id[..8],
            n.alive,
            n.address,
            custom.join(" ")
        );
    }
    println!("cluster resources: {:?}", tpuray::cluster_resources()?);
    println!("available resources: {:?}", tpuray::available_resources()?);
    tpuray::shutdown();
    Ok(())
}
