//! Which address a process advertises and which one it binds (NET-3).
//!
//! A node is reached at one advertised IPv4 address. Without
//! `--node-ip-address`, a head advertises the address of the interface that
//! holds the default route, and a node agent (or a driver) the address of the
//! interface that routes to its head, as Ray does (`ray._private.services.
//! get_node_ip_address`, which asks the kernel for the source address of a route
//! through a connected UDP socket); both fall back to `127.0.0.1` when there is no
//! such route. Servers whose advertised address is a loopback address bind it
//! alone; any other advertised address is served on every address of the host
//! (`0.0.0.0`), so a process on the same host reaches it through `127.0.0.1`
//! too. Nothing here sends a packet: connecting a UDP socket only asks the
//! kernel for a route.
//!
//! All functions are blocking system calls that return at once (no I/O).
//!
//! The environment variable `TPURAY_NODE_IP_ADDRESS` stands for `--node-ip-address`.
//! Private clusters (`init()` with no cluster, the microbenchmarks, the demo, the tests)
//! pass 127.0.0.1.
//!
//! A driver attaches to a node whose agent this host's process registry lists
//! ([`crate::registry`], REG-1; the head node's first when several), never by comparing
//! the head's address with the nodes', and listens on that node's address. A driver on a
//! host without a node leases from the head node's agent and keeps its objects in a
//! private store (`/dev/shm/tpuray-driver-<worker id>`, a quarter of available memory,
//! removed at `shutdown` or swept once its process is gone) that it serves to other nodes
//! with the agents' `ObjectTransferService` on its own address; its node id is
//! `driver-<worker id>`. (Until issue 21, every address defaulted to 127.0.0.1.)

use std::net::{IpAddr, Ipv4Addr, SocketAddr, UdpSocket};

/// The loopback address every fallback uses.
pub const LOOPBACK: IpAddr = IpAddr::V4(Ipv4Addr::LOCALHOST);

/// The local address the kernel would use as the source of packets to `target`
/// (`host:port` or a bare IP; a host name is resolved, e.g. through `/etc/hosts`),
/// or `None` when it does not resolve or there is no route to it. Sends nothing.
pub fn source_address_toward(target: &str) -> Option<IpAddr> {
    use std::net::ToSocketAddrs;
    let ip: IpAddr = match target.parse::<SocketAddr>() {
        Ok(sa) => sa.ip(),
        Err(_) => match target.parse() {
            Ok(ip) => ip,
            Err(_) => target.to_socket_addrs().ok()?.find(|a| a.is_ipv4())?.ip(),
        },
    };
    let bind = if ip.is_ipv4() { "0.0.0.0:0" } else { "[::]:0" };
    let sock = UdpSocket::bind(bind).ok()?;
    // The port only has to be non-zero for connect; no datagram is sent.
    sock.connect(SocketAddr::new(ip, 9)).ok()?;
    let local = sock.local_addr().ok()?.ip();
    (!local.is_unspecified()).then_some(local)
}

/// The IPv4 gateway (or, for a route on the link, `None` inside `Some`) and the
/// interface of the default route in `/proc/net/route` text.
fn default_route(route_table: &str) -> Option<(String, Option<Ipv4Addr>)> {
    for line in route_table.lines().skip(1) {
        let f: Vec<&str> = line.split_whitespace().collect();
        // Iface Destination Gateway Flags RefCnt Use Metric Mask ...
        if f.len() < 8 || f[1] != "00000000" || f[7] != "00000000" {
            continue;
        }
        let flags = u32::from_str_radix(f[3], 16).unwrap_or(0);
        if flags & 0x1 == 0 {
            continue; // RTF_UP unset
        }
        let gw = u32::from_str_radix(f[2], 16).ok().map(|g| Ipv4Addr::from(g.swap_bytes()));
        return Some((f[0].to_string(), gw.filter(|g| !g.is_unspecified())));
    }
    None
}

/// The first IPv4 address of interface `name`, from `getifaddrs(3)`.
fn interface_ipv4(name: &str) -> Option<Ipv4Addr> {
    let mut head: *mut libc::ifaddrs = std::ptr::null_mut();
    // SAFETY: getifaddrs fills `head` with a list we free below with freeifaddrs; we
    // only read fields of entries while the list is alive.
    unsafe {
        if libc::getifaddrs(&mut head) != 0 {
            return None;
        }
        let mut found = None;
        let mut cur = head;
        while !cur.is_null() {
            let ifa = &*cur;
            cur = ifa.ifa_next;
            if ifa.ifa_addr.is_null() || (*ifa.ifa_addr).sa_family as i32 != libc::AF_INET {
                continue;
            }
            let ifname = std::ffi::CStr::from_ptr(ifa.ifa_name).to_string_lossy();
            if ifname != name {
                continue;
            }
            let sin = &*(ifa.ifa_addr as *const libc::sockaddr_in);
            found = Some(Ipv4Addr::from(u32::from_be(sin.sin_addr.s_addr)));
            break;
        }
        libc::freeifaddrs(head);
        found
    }
}

/// The address of the interface that holds the default route (a head's
/// advertised address), or `None` when there is no default route.
pub fn default_route_address() -> Option<IpAddr> {
    let table = std::fs::read_to_string("/proc/net/route").ok()?;
    let (iface, gateway) = default_route(&table)?;
    if let Some(gw) = gateway
        && let Some(ip) = source_address_toward(&gw.to_string())
    {
        return Some(ip);
    }
    interface_ipv4(&iface).map(IpAddr::V4)
}

/// The address a head advertises when none is given: [`default_route_address`],
/// else loopback.
pub fn head_advertise_address() -> IpAddr {
    default_route_address().unwrap_or(LOOPBACK)
}

/// The address a node agent or driver advertises when none is given: the source
/// address toward the first reachable head address in `heads`
/// (`host:port,host:port`), else loopback.
pub fn advertise_address_toward(heads: &str) -> IpAddr {
    heads
        .split(',')
        .map(str::trim)
        .filter(|h| !h.is_empty())
        .find_map(source_address_toward)
        .unwrap_or(LOOPBACK)
}

/// Whether `ip` is an address of this host (it can be bound).
pub fn is_local_address(ip: IpAddr) -> bool {
    UdpSocket::bind(SocketAddr::new(ip, 0)).is_ok()
}

/// The socket address a server advertising `advertised` binds (NET-3): the
/// address itself when it is a loopback address, every address of the host
/// otherwise.
pub fn bind_address(advertised: SocketAddr) -> SocketAddr {
    if advertised.ip().is_loopback() || advertised.ip().is_unspecified() {
        advertised
    } else if advertised.is_ipv4() {
        SocketAddr::new(IpAddr::V4(Ipv4Addr::UNSPECIFIED), advertised.port())
    } else {
        SocketAddr::new(IpAddr::V6(std::net::Ipv6Addr::UNSPECIFIED), advertised.port())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const TABLE: &str = "Iface\tDestination\tGateway \tFlags\tRefCnt\tUse\tMetric\tMask\t\tMTU\tWindow\tIRTT\n\
        eth0\t00000000\t0100A8C0\t0003\t0\t0\t0\t00000000\t0\t0\t0\n\
        eth0\t0000A8C0\t00000000\t0001\t0\t0\t0\t00FFFFFF\t0\t0\t0\n";

    #[test]
    fn the_default_route_is_read_with_its_gateway() {
        let (iface, gw) = default_route(TABLE).unwrap();
        assert_eq!(iface, "eth0");
        assert_eq!(gw, Some(Ipv4Addr::new(192, 168, 0, 1)));
    }

    #[test]
    fn a_default_route_on_the_link_has_no_gateway() {
        let t = "Iface\tDestination\tGateway\tFlags\tRefCnt\tUse\tMetric\tMask\n\
                 eth0\t00000000\t00000000\t0001\t0\t0\t0\t00000000\n";
        assert_eq!(default_route(t), Some(("eth0".into(), None)));
    }

    #[test]
    fn no_default_route_gives_none() {
        let t = "Iface\tDestination\tGateway\tFlags\tRefCnt\tUse\tMetric\tMask\n\
                 eth0\t0000A8C0\t00000000\t0001\t0\t0\t0\t00FFFFFF\n";
        assert_eq!(default_route(t), None);
    }

    #[test]
    fn loopback_heads_are_reached_from_loopback() {
        assert_eq!(advertise_address_toward("127.0.0.1:6379"), LOOPBACK);
        assert_eq!(advertise_address_toward("localhost:6379"), LOOPBACK);
        assert_eq!(source_address_toward("no-such-host.invalid:1"), None);
    }

    #[test]
    fn only_addresses_of_this_host_are_local() {
        assert!(is_local_address(LOOPBACK));
        // TEST-NET-3 (RFC 5737) is on no host.
        assert!(!is_local_address("203.0.113.7".parse().unwrap()));
    }

    #[test]
    fn net3_loopback_binds_itself_and_other_addresses_bind_all() {
        let lo: SocketAddr = "127.0.0.1:7000".parse().unwrap();
        assert_eq!(bind_address(lo), lo);
        let a: SocketAddr = "198.18.0.2:7000".parse().unwrap();
        assert_eq!(bind_address(a), "0.0.0.0:7000".parse().unwrap());
    }

    #[test]
    fn the_loopback_interface_has_its_address() {
        assert_eq!(interface_ipv4("lo"), Some(Ipv4Addr::LOCALHOST));
        assert_eq!(interface_ipv4("no-such-interface0"), None);
    }
}
