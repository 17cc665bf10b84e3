//! The two netlink requests done in-process instead of starting a program: the probe for
//! "this network namespace has no packet-filter state at all", and adding `::6/128` to lo
//! (as Istio does through vishvananda/netlink, capture/run.go `configureIPv6Addresses`).
//!
//! Reading the state with `iptables-save` costs a process start (about as long as the
//! `iptables-restore` that follows; docs/benchmarks-log.md), and in a fresh pod namespace — the
//! init container's normal case — there is nothing to read. One netlink dump of the
//! nftables tables (`NFT_MSG_GETTABLE`, every family) plus the legacy table lists in /proc
//! answer that without a process. Any doubt (an error, an unexpected answer) means "maybe",
//! and the caller falls back to `*-save`.
#![allow(
    clippy::disallowed_methods,
    reason = "istio-iptables runs synchronously as its own command; no runtime is serving"
)]

use std::os::fd::{AsRawFd, OwnedFd};

use nix::sys::socket::{
    self, AddressFamily, MsgFlags, NetlinkAddr, SockFlag, SockProtocol, SockType,
};

const NFNL_SUBSYS_NFTABLES: u16 = 10;
const NFT_MSG_NEWTABLE: u16 = 0;
const NFT_MSG_GETTABLE: u16 = 1;
const NLM_F_REQUEST: u16 = 0x1;
const NLM_F_DUMP: u16 = 0x300;
const NLMSG_ERROR: u16 = 2;
const NLMSG_DONE: u16 = 3;

/// True only when it is certain that there are no nftables tables and no legacy iptables
/// tables in this namespace.
pub fn namespace_is_empty() -> bool {
    let legacy_empty = ["/proc/net/ip_tables_names", "/proc/net/ip6_tables_names"]
        .iter()
        .all(|p| std::fs::read_to_string(p).map_or(true, |s| s.trim().is_empty()));
    legacy_empty && nft_tables() == Some(0)
}

fn netlink_socket(proto: SockProtocol) -> nix::Result<OwnedFd> {
    let fd = socket::socket(
        AddressFamily::Netlink,
        SockType::Raw,
        SockFlag::SOCK_CLOEXEC,
        proto,
    )?;
    socket::bind(fd.as_raw_fd(), &NetlinkAddr::new(0, 0))?;
    Ok(fd)
}

/// The number of nftables tables (all families), or `None` if the dump failed.
fn nft_tables() -> Option<usize> {
    let fd = netlink_socket(SockProtocol::NetlinkNetFilter).ok()?;
    // nlmsghdr (len, type, flags, seq, pid) + nfgenmsg (family AF_UNSPEC, version 0, res_id 0).
    let mut req = Vec::with_capacity(20);
    req.extend_from_slice(&20u32.to_ne_bytes());
    req.extend_from_slice(&((NFNL_SUBSYS_NFTABLES << 8) | NFT_MSG_GETTABLE).to_ne_bytes());
    req.extend_from_slice(&(NLM_F_REQUEST | NLM_F_DUMP).to_ne_bytes());
    req.extend_from_slice(&1u32.to_ne_bytes());
    req.extend_from_slice(&0u32.to_ne_bytes());
    req.extend_from_slice(&[0, 0, 0, 0]);
    socket::send(fd.as_raw_fd(), &req, MsgFlags::empty()).ok()?;
    let mut tables = 0;
    let mut buf = vec![0u8; 64 * 1024];
    loop {
        let n = socket::recv(fd.as_raw_fd(), &mut buf, MsgFlags::empty()).ok()?;
        if n == 0 {
            return None;
        }
        let mut off = 0;
        while off + 16 <= n {
            let len = u32::from_ne_bytes(buf[off..off + 4].try_into().ok()?) as usize;
            let ty = u16::from_ne_bytes(buf[off + 4..off + 6].try_into().ok()?);
            if len < 16 || off + len > n {
                return None;
            }
            match ty {
                NLMSG_DONE => return Some(tables),
                NLMSG_ERROR => return None,
                t if t == (NFNL_SUBSYS_NFTABLES << 8) | NFT_MSG_NEWTABLE => tables += 1,
                _ => return None,
            }
            off += (len + 3) & !3;
        }
    }
}

const RTM_NEWADDR: u16 = 20;
const NLM_F_ACK: u16 = 0x4;
const NLM_F_EXCL: u16 = 0x200;
const NLM_F_CREATE: u16 = 0x400;
const IFA_ADDRESS: u16 = 1;
const IFA_LOCAL: u16 = 2;
const AF_INET6: u8 = 10;
const EEXIST: i32 = 17;

/// `ip -6 addr add ::6/128 dev lo` (an existing address is fine): the source Envoy binds for
/// inbound passthrough, which IPv6 (unlike 127/8) does not provide on lo by default.
pub fn add_ipv6_passthrough_address() -> Result<(), String> {
    let index = nix::net::if_::if_nametoindex("lo").map_err(|e| format!("no lo interface: {e}"))?;
    let fd =
        netlink_socket(SockProtocol::NetlinkRoute).map_err(|e| format!("netlink socket: {e}"))?;
    let addr = std::net::Ipv6Addr::new(0, 0, 0, 0, 0, 0, 0, 6).octets();
    let mut req = Vec::with_capacity(64);
    req.extend_from_slice(&64u32.to_ne_bytes());
    req.extend_from_slice(&RTM_NEWADDR.to_ne_bytes());
    req.extend_from_slice(&(NLM_F_REQUEST | NLM_F_ACK | NLM_F_EXCL | NLM_F_CREATE).to_ne_bytes());
    req.extend_from_slice(&1u32.to_ne_bytes());
    req.extend_from_slice(&0u32.to_ne_bytes());
    // ifaddrmsg: family, prefix length, flags, scope (universe), interface index.
    req.extend_from_slice(&[AF_INET6, 128, 0, 0]);
    req.extend_from_slice(&index.to_ne_bytes());
    for attr in [IFA_LOCAL, IFA_ADDRESS] {
        req.extend_from_slice(&20u16.to_ne_bytes());
        req.extend_from_slice(&attr.to_ne_bytes());
        req.extend_from_slice(&addr);
    }
    socket::send(fd.as_raw_fd(), &req, MsgFlags::empty())
        .map_err(|e| format!("netlink send: {e}"))?;
    let mut buf = [0u8; 512];
    let n = socket::recv(fd.as_raw_fd(), &mut buf, MsgFlags::empty())
        .map_err(|e| format!("netlink recv: {e}"))?;
    if n < 20 || u16::from_ne_bytes([buf[4], buf[5]]) != NLMSG_ERROR {
        return Err("unexpected netlink answer to RTM_NEWADDR".into());
    }
    match -i32::from_ne_bytes([buf[16], buf[17], buf[18], buf[19]]) {
        0 | EEXIST => Ok(()),
        errno => Err(format!(
            "failed to add IPv6 inbound address ::6/128: {}",
            nix::errno::Errno::from_raw(errno)
        )),
    }
}

#[cfg(test)]
mod tests {
    #[test]
    fn probe_answers_in_the_test_namespace() {
        // Whatever the host has, the probe must not fail open: it answers a count or None.
        let _ = super::nft_tables();
    }
}
