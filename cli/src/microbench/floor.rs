//! The floor under the microbenchmark's figures, measured in the same run: an empty
//! tonic unary round trip on loopback (a server this process starts, called through
//! the cluster's own client channel, one blocking call at a time as the SDK's `get`
//! makes them), a raw 64-byte TCP round trip on loopback (blocking sockets, an echo
//! thread: the wire's own cost, under any RPC stack) and a 100 MiB `memcpy`.

use std::time::Duration;

use anyhow::{Context, Result};
use tonic::{Request, Response, Status};
use tpuray_proto::pb;
use tpuray_proto::pb::object_transfer_service_server::{
    ObjectTransferService, ObjectTransferServiceServer,
};

use super::Timing;

/// Name of the RPC floor case.
pub const RPC_CASE: &str = "floor: empty tonic unary RPC round trip (loopback)";
/// Name of the raw TCP floor case.
pub const TCP_CASE: &str = "floor: raw TCP 64-byte round trip (loopback)";
/// Bytes each way of one raw TCP round trip.
const TCP_BYTES: usize = 64;
/// Name of the copy floor case (GB per second, 100 MiB counted as 0.1 GB as Ray's
/// gigabyte cases count).
pub const MEMCPY_CASE: &str = "floor: memcpy 100 MB (GB)";

const MEMCPY_BYTES: usize = 100 * 1024 * 1024;

/// An `ObjectTransferService` that answers `GetStoreUsage` at once and nothing else.
struct Empty;

type NoStream =
    std::pin::Pin<Box<dyn tokio_stream::Stream<Item = Result<pb::ObjectChunk, Status>> + Send>>;

#[tonic::async_trait]
impl ObjectTransferService for Empty {
    async fn get_object_info(
        &self,
        _: Request<pb::GetObjectInfoRequest>,
    ) -> Result<Response<pb::GetObjectInfoReply>, Status> {
        Err(Status::unimplemented("floor server"))
    }

    type PullStream = NoStream;

    async fn pull(&self, _: Request<pb::PullRequest>) -> Result<Response<NoStream>, Status> {
        Err(Status::unimplemented("floor server"))
    }

    async fn free_objects(
        &self,
        _: Request<pb::FreeObjectsRequest>,
    ) -> Result<Response<pb::FreeObjectsReply>, Status> {
        Err(Status::unimplemented("floor server"))
    }

    async fn get_store_usage(
        &self,
        _: Request<pb::GetStoreUsageRequest>,
    ) -> Result<Response<pb::GetStoreUsageReply>, Status> {
        Ok(Response::new(pb::GetStoreUsageReply::default()))
    }
}

/// Measures and prints both floor figures.
///
/// # Errors
/// The loopback server cannot listen, or a call fails.
pub fn measure(t: &Timing) -> Result<()> {
    rpc(t)?;
    tcp(t)?;
    memcpy(t)?;
    Ok(())
}

fn rpc(t: &Timing) -> Result<()> {
    // As the SDK's driver runtime: two worker threads; the caller blocks on each call.
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .context("floor runtime")?;
    let listener = rt
        .block_on(tokio::net::TcpListener::bind("127.0.0.1:0"))
        .context("floor server cannot listen on loopback")?;
    let addr = listener.local_addr()?.to_string();
    let (stop_tx, stop_rx) = tokio::sync::oneshot::channel::<()>();
    let router = tonic::transport::Server::builder()
        .tcp_nodelay(true)
        .add_service(ObjectTransferServiceServer::new(Empty));
    let stopped = async {
        let _ = stop_rx.await;
    };
    // With TPURAY_TLS_* set, the floor is that of a TLS call (the client below uses it too).
    match tpuray_proto::tls::current().map_err(|e| anyhow::anyhow!(e))? {
        None => {
            rt.spawn(
                router.serve_with_incoming_shutdown(tpuray_proto::incoming(listener), stopped),
            );
        }
        Some(tls) => {
            let _in_rt = rt.enter();
            rt.spawn(router.serve_with_incoming_shutdown(
                tpuray_proto::tls::incoming(listener, tls, "floor server"),
                stopped,
            ));
        }
    }
    let mut client = {
        let _in_rt = rt.enter(); // the channel's lazy connector needs a runtime
        tpuray_proto::client::objects(&addr, None)?
    };
    let mut call = || -> Result<()> {
        rt.block_on(client.get_store_usage(pb::GetStoreUsageRequest { limit: 0 }))
            .context("floor call")?;
        Ok(())
    };
    call()?; // connect outside the timing
    let r = t.timeit(RPC_CASE, 1.0, call);
    let _ = stop_tx.send(());
    rt.shutdown_timeout(Duration::from_secs(1));
    if let Some((mean, _)) = r?
        && !t.json
        && mean > 0.0
    {
        println!("floor: (that is {:.1} us per round trip)", 1e6 / mean);
    }
    Ok(())
}

/// A 64-byte message to an echo thread and back over loopback TCP (`TCP_NODELAY` on
/// both ends, blocking reads and writes): what one RPC round trip cannot go below.
fn tcp(t: &Timing) -> Result<()> {
    use std::io::{Read, Write};
    let listener = std::net::TcpListener::bind("127.0.0.1:0")
        .context("raw TCP floor cannot listen on loopback")?;
    let addr = listener.local_addr()?;
    let echo = std::thread::spawn(move || -> std::io::Result<()> {
        let (mut s, _) = listener.accept()?;
        s.set_nodelay(true)?;
        let mut buf = [0u8; TCP_BYTES];
        loop {
            match s.read_exact(&mut buf) {
                Ok(()) => s.write_all(&buf)?,
                // The client closed: the measurement is over.
                Err(e) if e.kind() == std::io::ErrorKind::UnexpectedEof => return Ok(()),
                Err(e) => return Err(e),
            }
        }
    });
    let mut s = std::net::TcpStream::connect(addr).context("raw TCP floor connect")?;
    s.set_nodelay(true)?;
    let mut buf = [7u8; TCP_BYTES];
    let r = t.timeit(TCP_CASE, 1.0, || {
        s.write_all(&buf)?;
        s.read_exact(&mut buf)?;
        Ok(())
    });
    drop(s);
    echo.join().map_err(|_| anyhow::anyhow!("raw TCP echo thread panicked"))??;
    if let Some((mean, _)) = r?
        && !t.json
        && mean > 0.0
    {
        println!("floor: (that is {:.1} us per round trip)", 1e6 / mean);
    }
    Ok(())
}

fn memcpy(t: &Timing) -> Result<()> {
    let src = vec![1u8; MEMCPY_BYTES];
    let mut dst = vec![0u8; MEMCPY_BYTES];
    t.timeit_unit(MEMCPY_CASE, 0.1, "GB per second", || {
        dst.copy_from_slice(std::hint::black_box(&src));
        std::hint::black_box(&mut dst);
        Ok(())
    })?;
    Ok(())
}
